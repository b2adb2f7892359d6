"""Kimi Delta Attention: the gated delta rule with per-channel decay."""
