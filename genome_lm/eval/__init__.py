"""Evaluation: loss by preceding context, parity of inference paths, long-range recall.

- ``score``: per-token NLL of a model on a split's windows (whole or by chunked prefill)
- ``buckets``: context-length buckets and bootstrap intervals over windows
- ``report``: the ``genome-lm.eval/1`` JSON, CSV and plots
- ``planted``: the demo genome's planted copies, in vs out of the window
- ``models``: what a user can name as a model (run, checkpoint, Hugging Face folder, init, preset)
- ``evaluate``: `genome-lm eval`; ``logprobs``: `genome-lm check-logprobs`; ``recall``: `genome-lm recall`
- ``analysis``: reading a result back (the notebook); ``commands``: the CLI commands
"""
