"""Probes of a model beside the evaluation report: ``logprobs`` (the training forward's per-token
log-probabilities against independent inference paths, ``genome-lm check-logprobs``), ``recall``
(the long-range copy probe, ``genome-lm recall``) and ``selection`` (how often the DSA indexer
selects a planted copy's source, in the demo's summary)."""
