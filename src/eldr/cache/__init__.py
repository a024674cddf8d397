"""Block-granular caches keyed like vLLM's KV cache: the block hash chain and the signature
cache."""
