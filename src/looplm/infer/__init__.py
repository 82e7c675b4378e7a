"""Incremental inference: terminal and full KV caches and the chunked `extend` path (design §7)."""

from looplm.infer.cache import FullCache, KVBank, KVCache, TerminalCache, chunk_mask, make_cache
from looplm.infer.extend import extend

__all__ = ["FullCache", "KVBank", "KVCache", "TerminalCache", "chunk_mask", "extend", "make_cache"]
