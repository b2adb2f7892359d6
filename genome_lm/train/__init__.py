"""Training: the loss, the memory techniques, checkpoints and the loop."""
