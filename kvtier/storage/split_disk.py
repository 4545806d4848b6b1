"""The local disk tier of one rank whose chunks are of two kinds: its own shard's, and
those it shares with replica ranks on the same machine (each tensor-parallel rank of an
MLA model holds the same latent KV).

::

    <local_disk>/<own dir>/kvtier-v1/…      this rank's own chunks: it writes, bounds and
                                            evicts them, as every rank does its own
    <local_disk>/<shared dir>/kvtier-v1/…   the replicas' chunks: one rank (the writer)
                                            writes, bounds and evicts them; the others
                                            read them, and neither index nor evict them

Each directory has one writer, so no two indexes bound one directory: with every rank
indexing a common tree, each would adopt its peers' files within its own bound and evict
them. A reader looks a shared chunk up in the directory itself (one ``stat``): whatever
the writer stored is there for every rank. A reader's write of a shared chunk is skipped
(``disk_puts_skipped_replica``), as the writer stores the same bytes under the same key.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from kvtier.keys import CacheKey
from kvtier.memory import MemoryObj
from kvtier.observability.stats import Stats, TierCounter, tier_counter
from kvtier.storage.disk import DirectRead, FileTier
from kvtier.storage.serde import Serde
from kvtier.storage.wire import Allocate, ChunkBuffers

T = TypeVar("T")
R = TypeVar("R")


@dataclass(frozen=True, slots=True)
class SharedDisk:
    """Where a rank's shared chunks live on the local disk (``SplitDisk``).

    Attributes:
        subdir: the shared directory under ``local_disk`` (None: ``local_disk`` itself).
        owns: whether a key is of this rank's own shard (else shared with its replicas).
        writer: this rank writes, bounds and evicts the shared directory.
    """

    subdir: str | None
    owns: Callable[[CacheKey], bool]
    writer: bool


class SplitDisk:
    """The local disk tier over two ``FileTier``s: ``own`` for the keys ``owns``, and
    ``shared`` for the others (module docstring). Named ``disk`` like a plain one, its
    counters are theirs summed.

    Args:
        own: this rank's own directory (bounded).
        shared: the shared directory: bounded for the writer, unbounded (no index, no
            eviction) for a reader.
        owns: whether a key goes to ``own``.
        writer: this rank writes the shared directory.
        stats: where skipped writes are counted.
    """

    def __init__(
        self,
        own: FileTier,
        shared: FileTier,
        owns: Callable[[CacheKey], bool],
        *,
        writer: bool,
        stats: Stats,
    ):
        self.name = own.name
        self.own = own
        self.shared = shared
        self.owns = owns
        self.writer = writer
        self.stats = stats

    def __repr__(self) -> str:
        role = "writer" if self.writer else "reader"
        return f"SplitDisk({self.own!r}, {self.shared!r} as {role})"

    @property
    def serde(self) -> Serde:
        return self.own.serde

    @property
    def capacity_bytes(self) -> int | None:
        return self.own.capacity_bytes

    @property
    def used_bytes(self) -> int:
        """Bytes of the files this rank bounds: its own, and the shared ones if it writes
        them."""
        return self.own.used_bytes + (self.shared.used_bytes if self.writer else 0)

    @property
    def directories(self) -> int:
        """Directories of the trees this rank bounds: its own, and the shared one if it
        writes it."""
        return self.own.directories + (self.shared.directories if self.writer else 0)

    def _tier(self, key: CacheKey) -> FileTier:
        return self.own if self.owns(key) else self.shared

    def _split(
        self, items: Sequence[T], key_of: Callable[[T], CacheKey], call: Callable[..., list[R]]
    ) -> list[R]:
        """``call(tier, items of that tier)`` for each tier, answers back in order."""
        out: list = [None] * len(items)
        for tier in (self.own, self.shared):
            mine = [i for i, item in enumerate(items) if self._tier(key_of(item)) is tier]
            if mine:
                for i, answer in zip(mine, call(tier, [items[i] for i in mine]), strict=True):
                    out[i] = answer
        return out

    def leaves_to_writer(self, key: CacheKey) -> bool:
        """Whether a put of ``key`` is left to the writer: a shared chunk, on a reader."""
        return self._tier(key) is self.shared and not self.writer

    def _skipped(self, writes: int = 1) -> None:
        """Writes of shared chunks left to the writer: a skipped write is no failed one."""
        self.stats.inc(tier_counter(self.name, TierCounter.SKIPPED_REPLICA), writes)

    # -- reads -----------------------------------------------------------------------

    def contains_many(self, keys: Sequence[CacheKey]) -> list[bool]:
        return self._split(keys, lambda key: key, lambda tier, part: tier.contains_many(part))

    def indexed(self, key: CacheKey) -> bool:
        """``FileTier.indexed`` of the key's directory: never for a reader's shared chunk
        (that directory is unbounded for it, with no index)."""
        return self._tier(key).indexed(key)

    def get_many(self, keys: Sequence[CacheKey], allocate: Allocate) -> list[MemoryObj | None]:
        return self._split(keys, lambda key: key, lambda tier, part: tier.get_many(part, allocate))

    def get_into(self, items: Sequence[tuple[CacheKey, ChunkBuffers]]) -> list[DirectRead]:
        return self._split(items, lambda item: item[0], lambda tier, part: tier.get_into(part))

    # -- writes ----------------------------------------------------------------------

    def submit_put(self, key: CacheKey, obj: MemoryObj) -> bool:
        if self.leaves_to_writer(key):
            self._skipped()
            return True
        return self._tier(key).submit_put(key, obj)

    def put_buffers(self, items: Sequence[tuple[CacheKey, ChunkBuffers]]) -> list[bool]:
        def put(tier: FileTier, part: list[tuple[CacheKey, ChunkBuffers]]) -> list[bool]:
            if tier is self.shared and not self.writer:
                self._skipped(len(part))
                return [True] * len(part)
            return tier.put_buffers(part)

        return self._split(items, lambda item: item[0], put)

    # -- management ------------------------------------------------------------------

    def remove(self, key: CacheKey) -> bool:
        return self._tier(key).remove(key)

    def clear(self) -> None:
        """Delete this rank's own files, and the shared ones if it writes them (their
        writer clears them for every rank)."""
        self.own.clear()
        if self.writer:
            self.shared.clear()

    def flush(self, timeout: float | None = None) -> bool:
        return self.own.flush(timeout) and self.shared.flush(timeout)

    @property
    def pending_writes(self) -> int:
        return self.own.pending_writes + self.shared.pending_writes

    def __len__(self) -> int:
        return len(self.own) + (len(self.shared) if self.writer else 0)

    def close(self) -> None:
        self.own.close()
        self.shared.close()
