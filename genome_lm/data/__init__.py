"""Genome data: FASTA reading, tokenization, windows, prepared datasets and the demo genome."""
