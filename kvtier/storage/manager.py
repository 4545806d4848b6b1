"""The storage manager: one entry point over the tiers.

Today the hierarchy has one tier, the local CPU tier, which also provides the buffers
that chunks are staged in. Lower tiers (disk, remote) plug in behind the same calls:
``put`` writes through, ``lookup_prefix`` finds the longest prefix present across tiers,
``get`` reads from the fastest tier that has the chunk.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from kvtier.config import KVTierConfig
from kvtier.keys import CacheKey
from kvtier.memory import MemoryObj
from kvtier.metrics import Stats
from kvtier.storage.cpu import LocalCPUTier

logger = logging.getLogger(__name__)


class StorageManager:
    """Routes chunk objects to and from the enabled tiers.

    Args:
        config: the validated kvtier config (``local_cpu``, ``max_local_cpu_size``,
            ``cache_policy``, ``pool_alignment``).
        stats: shared counters.
        pin_memory: pin the host pool (None: when a GPU is present).
    """

    def __init__(self, config: KVTierConfig, stats: Stats | None = None, *, pin_memory=None):
        self.config = config
        self.stats = stats or Stats()
        # NOTE: the CPU pool exists even with local_cpu=false: it is the staging area
        # chunks pass through on their way to and from the lower tiers.
        self.cpu = LocalCPUTier(
            config.max_local_cpu_bytes,
            config.cache_policy,
            alignment=config.pool_alignment,
            pin_memory=pin_memory,
            stats=self.stats,
        )
        self.retain_in_cpu = config.local_cpu
        if not self.retain_in_cpu:
            logger.warning(
                "local_cpu=false and no other tier is configured: kvtier will not keep "
                "any KV (stores are staged and dropped)"
            )

    def allocate(self, shape: Sequence[int], dtype: torch.dtype) -> MemoryObj | None:
        """A staging buffer for one chunk, or None when memory is exhausted."""
        return self.cpu.allocate(shape, dtype)

    def put(self, key: CacheKey, obj: MemoryObj) -> bool:
        """Store ``obj`` under ``key`` in every enabled tier. The caller keeps its own
        reference. Returns whether any tier took a new copy."""
        if self.retain_in_cpu:
            return self.cpu.put(key, obj)
        return False

    def get(self, key: CacheKey) -> MemoryObj | None:
        """The chunk under ``key`` with a reference for the caller, or None on a miss."""
        return self.cpu.get(key)

    def contains(self, key: CacheKey) -> bool:
        return self.cpu.contains(key)

    def lookup_prefix(self, keys: Sequence[CacheKey]) -> int:
        """How many of ``keys``, from the first, some tier holds."""
        return self.cpu.prefix_length(keys)

    def pin(self, keys: Sequence[CacheKey]) -> list[CacheKey]:
        """Pin what is stored among ``keys``; returns the keys pinned (to unpin later)."""
        return [key for key in keys if self.cpu.pin(key)]

    def unpin(self, keys: Sequence[CacheKey]) -> None:
        for key in keys:
            self.cpu.unpin(key)

    def remove(self, key: CacheKey) -> bool:
        return self.cpu.remove(key)

    def clear(self) -> None:
        self.cpu.clear()

    def close(self) -> None:
        self.cpu.close()
