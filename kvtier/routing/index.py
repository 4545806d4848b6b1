"""The block index: vLLM block hash -> the instances holding it and where (medium, locality).

Built from the instances' KV events (``kvtier.routing.events``):

    BlockStored(hashes, medium, locality)   the instance holds those blocks there
    BlockRemoved(hashes, medium, locality)  it no longer holds them there (that place only)
    AllBlocksCleared                        vLLM's prefix cache was reset: the instance's
                                            GPU entries go; its kvtier tiers announce
                                            their own removals

A block hash is the 64-bit integer vLLM publishes by default
(``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``); raw 32-byte hashes are folded to the same
integer (their last 8 bytes, big-endian, as vLLM folds them).

Each place a block can be is one bit of a small mask per (block, instance), so an entry
costs a dict slot, not a set. The index holds at most ``max_blocks`` hashes; past that
the least recently stored or looked-up block goes (LRU), counted in ``evicted``.

NOTE: a REMOTE block (a shared tier every instance of a remote group can load from)
counts for every instance of the group that stored it, not only for the publisher.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"
LOCAL = "LOCAL"
REMOTE = "REMOTE"

# Weight classes: what a block held there is worth to the instance that can load it.
GPU, CPU, LOCAL_STORAGE, REMOTE_TIER = 0, 1, 2, 3
WEIGHT_CLASSES = ("gpu", "cpu", "local_storage", "remote")
_GPU_BIT, _CPU_BIT, _STORAGE_BIT, _REMOTE_BIT = 1, 2, 4, 8
CLASS_BITS = (_GPU_BIT, _CPU_BIT, _STORAGE_BIT, _REMOTE_BIT)  # by weight class
REMOTE_BIT = _REMOTE_BIT
_LOCAL_BITS = _GPU_BIT | _CPU_BIT | _STORAGE_BIT

DEFAULT_MAX_BLOCKS = 1_000_000
_MASK64 = (1 << 64) - 1


def block_key(block_hash: int | bytes) -> int:
    """The index key of an event's block hash: an int as it is, bytes folded as vLLM's
    ``maybe_convert_block_hash`` folds them (the low 64 bits, big-endian)."""
    if isinstance(block_hash, int):
        return block_hash & _MASK64
    return int.from_bytes(block_hash, "big") & _MASK64


def placement_bit(medium: str | None, locality: str | None) -> int:
    """The bit of a (medium, locality) pair. ``medium`` None is vLLM's own cache (GPU);
    REMOTE on any medium is the remote class; an unknown medium counts as local storage."""
    if locality == REMOTE:
        return _REMOTE_BIT
    if medium is None or medium == MEDIUM_GPU:
        return _GPU_BIT
    if medium == MEDIUM_CPU:
        return _CPU_BIT
    return _STORAGE_BIT


@dataclass(slots=True)
class InstanceEntry:
    """One instance as the index knows it: a number (keys of the holdings), its remote
    group, and how many blocks it holds (any place)."""

    number: int
    name: str
    remote_group: str
    blocks: int = 0


class BlockIndex:
    """Which instance holds which block, and where.

    Args:
        max_blocks: the most block hashes kept (LRU beyond).

    Instances are registered once (``add_instance``) with their remote group; events
    then name them by ``name`` (the instance URL).
    """

    def __init__(self, max_blocks: int = DEFAULT_MAX_BLOCKS):
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
        self.max_blocks = max_blocks
        self.evicted = 0
        self.instances: dict[str, InstanceEntry] = {}
        # block key -> {instance number: placement bits}
        self._blocks: OrderedDict[int, dict[int, int]] = OrderedDict()
        self._by_number: list[InstanceEntry] = []

    def __len__(self) -> int:
        return len(self._blocks)

    def add_instance(self, name: str, remote_group: str) -> InstanceEntry:
        entry = self.instances.get(name)
        if entry is None:
            entry = InstanceEntry(len(self._by_number), name, remote_group)
            self.instances[name] = entry
            self._by_number.append(entry)
        return entry

    # -- events ----------------------------------------------------------------------

    def stored(
        self,
        name: str,
        block_hashes: Iterable[int | bytes],
        medium: str | None,
        locality: str | None,
    ) -> None:
        entry = self.instances[name]
        bit = placement_bit(medium, locality)
        blocks = self._blocks
        for block_hash in block_hashes:
            key = block_key(block_hash)
            holders = blocks.get(key)
            if holders is None:
                holders = blocks[key] = {}
                if len(blocks) > self.max_blocks:
                    self._evict_oldest()
            else:
                blocks.move_to_end(key)
            bits = holders.get(entry.number, 0)
            if not bits:
                entry.blocks += 1
            holders[entry.number] = bits | bit

    def removed(
        self,
        name: str,
        block_hashes: Iterable[int | bytes],
        medium: str | None,
        locality: str | None,
    ) -> None:
        entry = self.instances[name]
        bit = placement_bit(medium, locality)
        for block_hash in block_hashes:
            key = block_key(block_hash)
            holders = self._blocks.get(key)
            if holders is not None:
                self._drop_bits(key, holders, entry, bit)

    def cleared(self, name: str, medium: str | None = MEDIUM_GPU) -> None:
        """vLLM's ``AllBlocksCleared``: the instance's blocks in ``medium`` go (GPU: what
        vLLM's prefix cache announced); ``medium`` None drops all of its entries."""
        entry = self.instances[name]
        bits = (_LOCAL_BITS | _REMOTE_BIT) if medium is None else placement_bit(medium, LOCAL)
        for key, holders in list(self._blocks.items()):
            if entry.number in holders:
                self._drop_bits(key, holders, entry, bits)

    def drop_instance(self, name: str) -> None:
        """Forget everything ``name`` announced (a gap that replay could not fill)."""
        self.cleared(name, None)

    def _drop_bits(
        self, key: int, holders: dict[int, int], entry: InstanceEntry, bits: int
    ) -> None:
        held = holders.get(entry.number, 0)
        if not held & bits:
            return
        left = held & ~bits
        if left:
            holders[entry.number] = left
            return
        del holders[entry.number]
        entry.blocks -= 1
        if not holders:
            del self._blocks[key]

    def _evict_oldest(self) -> None:
        _, holders = self._blocks.popitem(last=False)
        for number in holders:
            self._by_number[number].blocks -= 1
        self.evicted += 1

    # -- lookups ---------------------------------------------------------------------

    def holders(self, key: int) -> dict[int, int] | None:
        """``{instance number: placement bits}`` of a block key (None: nobody), marking
        it recently used."""
        holders = self._blocks.get(key)
        if holders is not None:
            self._blocks.move_to_end(key)
        return holders

    def entry(self, number: int) -> InstanceEntry:
        return self._by_number[number]
