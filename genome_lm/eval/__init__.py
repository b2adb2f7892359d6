"""Evaluation: per-token scores of a model on a prepared split, bucketed by preceding context."""
