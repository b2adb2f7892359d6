"""genome-lm's model against transformers' glm5_next on the same weights: logits (``parity``,
`genome-lm parity`) and forward+backward speed (``bench``, `genome-lm bench model`)."""
