"""Paged KV cache: layer-group specs, the block pool with an LRU free queue, prefix caching, planning."""
