"""Incremental inference: terminal and full KV caches, the chunked `extend` path and the depth rule
of a decode (design §7)."""

from looplm.infer.cache import FullCache, KVBank, KVCache, TerminalCache, chunk_mask, make_cache
from looplm.infer.depth_rule import CACHE_KINDS, CacheKind, DepthRule, check_depth
from looplm.infer.extend import extend

__all__ = [
    "CACHE_KINDS",
    "CacheKind",
    "DepthRule",
    "FullCache",
    "KVBank",
    "KVCache",
    "TerminalCache",
    "check_depth",
    "chunk_mask",
    "extend",
    "make_cache",
]
