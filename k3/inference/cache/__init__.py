"""The hybrid paged cache: layout (bytes per token / per state), the block pool, the KDA-aware prefix cache."""

from .layout import CacheLayout
from .pool import BlockPool, OutOfPages
from .prefix import PrefixCache, PrefixHit, chain_hashes

__all__ = ["CacheLayout", "BlockPool", "OutOfPages", "PrefixCache", "PrefixHit", "chain_hashes"]
