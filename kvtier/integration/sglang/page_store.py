"""Host-pool pages into and out of kvtier's tiers: what ``KVTierHiCacheStorage`` does for
each of SGLang's loads and stores, with kvtier's counters (SGLang-free).

A page moves one of two ways::

    staged   host pool ─copy─▶ chunk buffer (kvtier's pool) ─▶ CPU tier; disk, remote writes
             host pool ◀─copy─ chunk buffer ◀─ CPU tier, or a lower tier's read
    direct   host pool ─writev─▶ its file           (the disk tier is the only tier)
             host pool ◀─preadv─ its file

The direct way applies where ``StorageManager.sole_disk`` is a tier (no CPU tier, no
remote tier, the naive codec) and the pool holds the page in contiguous runs
(``PageFormat.buffers``): no copy in memory, and the checksum is computed over, or
verified on, the pool's own bytes. A page stored in another order than this pool's
(written from a pool of another layout, or by the staged way) is read the staged way.

NOTE: a page counts as loaded only once its bytes in the host pool were verified. A page
that fails is reported not loaded, though the direct way may have written part of it into
its host slot: SGLang treats it as a miss and frees the slot. Loads report the run of
pages from the first; pages after a miss are reported not loaded.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvtier.integration.sglang.pages import PageFormat, PageKeys
from kvtier.keys import CacheKey
from kvtier.observability.stats import Counter, Histogram, Stats
from kvtier.storage.checked import CheckedChunks
from kvtier.storage.disk import DirectRead, FileTier
from kvtier.storage.manager import StorageManager
from kvtier.storage.split_disk import SplitDisk
from kvtier.storage.wire import ChunkBuffers
from kvtier.warn import warn_once

logger = logging.getLogger(__name__)

FLUSH_TIMEOUT_S = 60.0

PageBuffers = Callable[[int], ChunkBuffers | None]


@dataclass(frozen=True, slots=True)
class Moved:
    """What one load or store did.

    Attributes:
        ok: per page, loaded (a run from the first) or stored (or already held).
        pages: pages moved (loaded, or newly stored).
        seconds: how long it took.
    """

    ok: list[bool]
    pages: int
    seconds: float


class PageStore:
    """Loads and stores host-pool pages under their kvtier keys.

    Args:
        storage: the tiers.
        stats: kvtier's counters (retrieve_*, store_*).
        keys: SGLang page keys to kvtier keys.
        verify_checksums: also checksum pages held in kvtier's own memory, and check
            them before they are loaded (every lower tier verifies what it reads in any
            case).
    """

    def __init__(
        self, storage: StorageManager, stats: Stats, keys: PageKeys, *, verify_checksums: bool
    ):
        self.storage = storage
        self.stats = stats
        self.keys = keys
        self.checked = CheckedChunks(storage, verify=verify_checksums, noun="page")

    def _direct(
        self, fmt: PageFormat, buffers: PageBuffers | None, todo: list[int]
    ) -> tuple[FileTier | SplitDisk | None, dict[int, ChunkBuffers]]:
        """The disk tier and the pages of ``todo`` that move directly (module docstring),
        with their buffers; else ``(None, {})``: every page is staged."""
        disk = self.storage.sole_disk
        if disk is None or buffers is None or not fmt.canonical:
            return None, {}
        return disk, {i: chunk for i in todo if (chunk := buffers(i)) is not None}

    # -- loads -----------------------------------------------------------------------

    def load(
        self,
        pool_name: str,
        fmt: PageFormat,
        page_keys: Sequence[str],
        write: Callable[[int, torch.Tensor], Any],
        buffers: PageBuffers | None = None,
    ) -> Moved:
        """Fetch and verify each page and ``write(i, chunk)`` it (staged), or read it
        straight into ``buffers(i)``, its memory in the host pool (direct)."""
        started = time.perf_counter()
        keys = [self.keys.key(k, fmt, pool_name) for k in page_keys]
        loaded = [False] * len(keys)
        staged = list(range(len(keys)))
        disk, direct = self._direct(fmt, buffers, staged)
        if disk is not None and direct:
            got = disk.get_into([(keys[i], chunk) for i, chunk in direct.items()])
            results = dict(zip(direct, got, strict=True))
            loaded = [results.get(i) is DirectRead.LOADED for i in staged]
            other = DirectRead.OTHER_FORMAT  # and pages with no buffers: read staged
            staged = [i for i in staged if results.get(i, other) is other]
        # A lower tier's page is read into the CPU pool: the staged pages come in rounds
        # the pool holds at once, each written into the host pool before the next.
        most = max(self.storage.cpu.fitting(fmt.shape, fmt.dtype), 1)
        for start in range(0, len(staged), most):
            part = staged[start : start + most]
            if not all(loaded[: part[0]]):
                break
            for i, obj in zip(part, self.checked.get_many([keys[i] for i in part]), strict=True):
                if obj is None:
                    continue
                try:
                    if all(loaded[:i]) and self.checked.accept(keys[i], obj, fmt.shape, fmt.dtype):
                        write(i, obj.tensor)
                        loaded[i] = True
                finally:
                    obj.ref_down()
        hits = loaded.index(False) if False in loaded else len(loaded)
        seconds = time.perf_counter() - started
        s = self.stats
        s.inc(Counter.RETRIEVE_REQUESTS)
        s.inc(Counter.REQUESTED_TOKENS, len(keys) * fmt.page_size)
        s.inc(Counter.HIT_TOKENS, hits * fmt.page_size)
        s.inc(Counter.LOADED_BYTES, hits * fmt.nbytes)
        s.inc(Counter.LOAD_SECONDS, seconds)
        s.observe(Histogram.LOAD, seconds)
        return Moved([i < hits for i in range(len(keys))], hits, seconds)

    # -- stores ----------------------------------------------------------------------

    def store(
        self,
        pool_name: str,
        fmt: PageFormat,
        page_keys: Sequence[str],
        read: Callable[[int], torch.Tensor],
        buffers: PageBuffers | None = None,
    ) -> Moved:
        """Store each page not yet held: ``read(i)`` (the page in the chunk layout) copied
        into a chunk buffer (staged), or written straight from ``buffers(i)`` (direct).
        A page whose key comes twice in the batch is stored once. Returns once the lower
        tiers have written them.

        NOTE: "held" is answered from memory (``StorageManager.held_everywhere``: the CPU
        tier, the disk tier's index), never by a disk or network access on SGLang's
        backup thread; any other page is put, and each lower tier's writer leaves out
        what it has already (the disk: its file is there; a remote: one batched lookup
        per write). So a remote lacking a page the disk holds still gets it."""
        started = time.perf_counter()
        keys = [self.keys.key(k, fmt, pool_name) for k in page_keys]
        stored = [self.storage.held_everywhere(key) for key in keys]
        skipped_existing = sum(stored)
        first = {key: i for i, key in reversed(list(enumerate(keys)))}  # each key's first page
        todo = [i for i, held in enumerate(stored) if not held and first[keys[i]] == i]
        staged = todo
        disk, direct = self._direct(fmt, buffers, staged)
        if disk is not None and direct:
            written = disk.put_buffers([(keys[i], chunk) for i, chunk in direct.items()])
            for i, ok in zip(direct, written, strict=True):
                stored[i] = ok
            staged = [i for i in staged if i not in direct]
        no_memory = self._store_staged(fmt, keys, staged, read, stored)
        new = sum(stored[i] for i in todo)
        stored = [stored[first[key]] for key in keys]
        seconds = time.perf_counter() - started
        s = self.stats
        s.inc(Counter.STORE_REQUESTS)
        s.inc(Counter.STORED_CHUNKS, new)
        s.inc(Counter.STORED_TOKENS, new * fmt.page_size)
        s.inc(Counter.STORED_BYTES, new * fmt.nbytes)
        s.inc(Counter.STORE_SECONDS, seconds)
        s.observe(Histogram.STORE, seconds)
        s.inc(Counter.STORE_SKIPPED_EXISTING, skipped_existing)
        s.inc(Counter.STORE_SKIPPED_NO_MEMORY, no_memory)
        return Moved(stored, new, seconds)

    def _store_staged(
        self,
        fmt: PageFormat,
        keys: list[CacheKey],
        todo: list[int],
        read: Callable[[int], torch.Tensor],
        stored: list[bool],
    ) -> int:
        """Copy page ``read(i)`` of each ``i`` in ``todo`` into a chunk buffer, put it
        (``stored[i]``) and wait for the lower tiers; returns the pages left out for
        want of memory."""
        no_memory, stalled = 0, False
        for i in todo:
            obj = self.checked.allocate(fmt.shape, fmt.dtype)
            if obj is None and not stalled and any(stored[j] for j in todo):
                # The pool is full of this batch's pages still being written below: once
                # written, they can be evicted. A tier that outlasts the wait is not
                # waited for again.
                stalled = not self.storage.flush(FLUSH_TIMEOUT_S)
                obj = self.checked.allocate(fmt.shape, fmt.dtype)
            if obj is None:
                no_memory += 1
                continue
            try:
                obj.tensor.copy_(read(i))
                # NOTE: a put that takes nothing finds the key already held (another
                # thread stored it meanwhile): held, so stored.
                stored[i] = self.checked.put(keys[i], obj) or self.storage.contains(keys[i])
            finally:
                obj.ref_down()
        if any(stored[i] for i in todo) and (stalled or not self.storage.flush(FLUSH_TIMEOUT_S)):
            warn_once(logger, f"kvtier: lower tiers still writing after {FLUSH_TIMEOUT_S:.0f} s")
        return no_memory
