"""KV memory: the slot pool, the request-to-slot table and the radix tree over token ids (RadixAttention)."""
