"""The prefix cache: prompt blocks computed once per worker, restored bit for bit (docs/prefix-cache.md)."""

from .store import CacheStats, Entry, Hit, PrefixStore

__all__ = ["CacheStats", "Entry", "Hit", "PrefixStore"]
