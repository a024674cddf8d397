"""Block-granular caches keyed like vLLM's KV cache: the block hash chain and the signature
cache."""

__all__: list[str] = []  # import from the modules (hashing, sigcache)
