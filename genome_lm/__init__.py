"""genome-lm: fine-tune a long-context hybrid-attention language model on genomes."""

__version__ = "0.1.0"
