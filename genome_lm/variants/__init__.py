"""Zero-shot variant effect scoring: variants from a VCF, their sequence windows, and the metrics."""
