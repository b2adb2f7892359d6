"""DeepSeek sparse attention with a k-pool lightning indexer."""
