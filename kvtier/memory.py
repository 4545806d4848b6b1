"""Chunk buffers (`MemoryObj`) carved out of one pre-allocated host pool.

A `HostMemoryPool` allocates a single `torch.uint8` buffer up front (pinned when a GPU is
present, so host<->device copies can be asynchronous) and hands out aligned sub-ranges of it
as `MemoryObj`s. The pool never allocates again after construction: when no free extent is
large enough, `allocate` returns `None` and the caller (a storage tier) decides whether to
evict and retry, or to skip the store. Exhaustion is an ordinary outcome, not an error.

Allocator
---------
``allocate`` is best-fit over the pool's free extents, and a free merges with both
neighbours, so free space stays fully coalesced (`kvtier.extents`, which the pool's lock
guards). One lock guards the pool and every object's counters: the engine's
store/retrieve and the background tiers run on different threads.

Reference counts and pins
-------------------------
A `MemoryObj` starts with ``ref_count == 1`` (owned by whoever allocated it). `ref_up` /
`ref_down` share ownership (e.g. the CPU tier and an in-flight disk write). A separate pin
count means "being read or written right now, must not be evicted"; eviction policies ask
`MemoryObj.is_pinned`.

NOTE: memory returns to the pool when the ref count reaches zero *and* no pin is held. If
the last reference is dropped while the object is pinned (e.g. a key is overwritten while a
copy out of its buffer is in flight), the free is deferred until the last `unpin`; until
then the tensor stays readable for the in-flight copy, but the object can no longer be
`ref_up`-ed or newly pinned.
"""

from __future__ import annotations

import contextlib
import math
import operator
import threading
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from kvtier.extents import Extents
from kvtier.machine import PoolTooLarge, check_host_memory

__all__ = ["HostMemoryPool", "MemoryObj", "PoolStats"]


@dataclass(slots=True)
class PoolStats:
    """Counters of a `HostMemoryPool`, updated under the pool lock.

    Attributes:
        allocations: successful `allocate` calls.
        frees: extents returned to the pool (one per object whose memory was released).
        failed_allocations: `allocate` calls that returned ``None`` (no extent large enough).
        peak_used_bytes: highest `used_bytes()` seen, counting aligned allocation sizes.
    """

    allocations: int = 0
    frees: int = 0
    failed_allocations: int = 0
    peak_used_bytes: int = 0


@dataclass(slots=True, eq=False, repr=False)
class MemoryObj:
    """A chunk buffer: a typed view into the pool. Reference counted; the memory returns to
    the pool when the count reaches zero.

    Created only by `HostMemoryPool.allocate`, with ``ref_count == 1`` and ``pin_count == 0``.
    Equality and hashing are by identity.

    Attributes:
        pool: the pool the bytes belong to.
        offset: byte offset of the buffer in the pool (a multiple of ``pool.alignment``).
        nbytes: allocated size in bytes, rounded up to ``pool.alignment`` (>= `data_nbytes`).
        shape: the tensor shape.
        dtype: the tensor dtype.
        checksum: xxh3-64 of the chunk's bytes as the engine gathered them (wire format's
            checksum), when known: a tier that read and verified the chunk sets it, and a
            store sets it only with ``verify_checksums`` (a load then verifies it before
            the engine sees the bytes). None: not computed; a lower tier's writer computes
            it when the chunk leaves the process. The pool never reads it.
        verified: the bytes were just checked against ``checksum`` by the tier that read
            them; the next load takes that (``take_verified``) instead of hashing again.
    """

    pool: HostMemoryPool
    offset: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    checksum: int | None = None
    verified: bool = field(default=False, compare=False)
    _ref_count: int = field(default=1, init=False)
    _pin_count: int = field(default=0, init=False)
    _freed: bool = field(default=False, init=False)

    # -- views ---------------------------------------------------------------------------

    @property
    def data_nbytes(self) -> int:
        """Exact size of ``shape`` x ``dtype`` in bytes (<= `nbytes`)."""
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def tensor(self) -> torch.Tensor:
        """A contiguous ``dtype``/``shape`` view of the pool bytes; writes land in the pool.

        Raises:
            RuntimeError: the object was already freed, or its pool was closed.
        """
        if self._freed:
            raise RuntimeError(
                f"use after free: {self!r} was already returned to the pool; "
                "its memory may now belong to another object"
            )
        buffer = self.pool._buffer
        if buffer is None:
            raise RuntimeError(f"{self!r}: its pool was closed")
        raw = buffer[self.offset : self.offset + self.data_nbytes]
        return raw.view(self.dtype).view(self.shape)

    def take_verified(self) -> bool:
        """Whether a tier verified the bytes since the last call (then clears it: only the
        first load after a read skips its own check)."""
        verified, self.verified = self.verified, False
        return verified

    # -- ownership -----------------------------------------------------------------------

    @property
    def ref_count(self) -> int:
        """Number of owners; 0 once released."""
        return self._ref_count

    @property
    def is_freed(self) -> bool:
        """True once the memory went back to the pool (any further use raises)."""
        return self._freed

    def ref_up(self) -> None:
        """Add an owner.

        Raises:
            RuntimeError: the object was released (ref count already 0).
        """
        with self.pool._lock:
            if self._ref_count <= 0:
                state = "freed" if self._freed else "released (free deferred until unpinned)"
                raise RuntimeError(f"ref_up on {self!r}, which was already {state}")
            self._ref_count += 1

    def ref_down(self) -> None:
        """Drop an owner; the last one returns the memory to the pool (exactly once).

        If the object is still pinned the free is deferred to the last `unpin`.

        Raises:
            RuntimeError: the ref count is already 0 (a double free: a bug in the caller).
        """
        with self.pool._lock:
            if self._ref_count <= 0:
                raise RuntimeError(
                    f"double free: ref_down on {self!r} whose ref_count is already 0 "
                    "(more ref_down than ref_up calls)"
                )
            self._ref_count -= 1
            if self._ref_count == 0 and self._pin_count == 0:
                self.pool._release_locked(self)

    # -- pins ----------------------------------------------------------------------------

    @property
    def pin_count(self) -> int:
        """Number of outstanding `pin` calls."""
        return self._pin_count

    @property
    def is_pinned(self) -> bool:
        """True while the buffer is being read or written: it must not be evicted."""
        return self._pin_count > 0

    def pin(self) -> None:
        """Mark the buffer as in use by a read or write; nests.

        Raises:
            RuntimeError: the object was already released (ref count 0).
        """
        with self.pool._lock:
            if self._ref_count <= 0:
                raise RuntimeError(f"pin on {self!r}, which was already released")
            self._pin_count += 1

    def unpin(self) -> None:
        """Undo one `pin`; the last unpin of a released object frees it.

        Raises:
            RuntimeError: the object is not pinned (more unpin than pin calls).
        """
        with self.pool._lock:
            if self._pin_count <= 0:
                raise RuntimeError(f"unpin on {self!r}, which is not pinned")
            self._pin_count -= 1
            if self._pin_count == 0 and self._ref_count == 0:
                self.pool._release_locked(self)

    @contextlib.contextmanager
    def pinned(self) -> Iterator[MemoryObj]:
        """``with obj.pinned(): ...`` pins for the duration of the block."""
        self.pin()
        try:
            yield self
        finally:
            self.unpin()

    def __repr__(self) -> str:
        shape = "x".join(map(str, self.shape))
        return (
            f"MemoryObj(offset={self.offset}, nbytes={self.nbytes}, shape=[{shape}], "
            f"dtype={self.dtype}, ref_count={self._ref_count}, pin_count={self._pin_count}"
            f"{', freed' if self._freed else ''})"
        )


class HostMemoryPool:
    """One pre-allocated buffer from which `MemoryObj` chunk buffers are allocated.

    Args:
        capacity_bytes: size of the buffer, allocated once in the constructor.
        alignment: power of two; every object's offset (and, since the buffer base is
            aligned to it, its address) is a multiple of it and its size is rounded up to it.
        pin_memory: pin the buffer (page-locked, for async host<->device copies).
            ``None`` pins when ``torch.cuda.is_available()`` (true on ROCm builds too). If
            pinning fails the pool falls back to pageable memory with one warning; check
            `pinned`. Only meaningful for a CPU ``device``.
        device: where the buffer lives (normally ``"cpu"``).
        memory: a CPU uint8 tensor of at least ``capacity_bytes + alignment - 1`` bytes
            to carve the pool from instead of allocating one (memory shared with another
            process); the caller keeps it alive and unpinned.

    Raises:
        ValueError: ``capacity_bytes`` is not positive, ``alignment`` is not a power of
            two, or ``pin_memory=True`` with a non-CPU device.

    All methods are thread-safe.
    """

    def __init__(
        self,
        capacity_bytes: int,
        *,
        alignment: int = 256,
        pin_memory: bool | None = None,
        device: str | torch.device = "cpu",
        memory: torch.Tensor | None = None,
    ) -> None:
        if not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be a positive int, got {capacity_bytes!r}")
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two, got {alignment!r}")
        device = torch.device(device)
        if device.type != "cpu":
            if pin_memory:
                raise ValueError(
                    f"pin_memory=True needs a CPU device, got device={device}; "
                    "pinning only applies to host memory"
                )
            pin_memory = False
        elif pin_memory is None:
            pin_memory = torch.cuda.is_available()

        self.capacity: int = capacity_bytes
        self.alignment: int = alignment
        self.device: torch.device = device
        self.pinned: bool = False
        self.stats: PoolStats = PoolStats()
        self._lock = threading.Lock()
        self._buffer: torch.Tensor | None = (
            self._allocate_buffer(pin_memory) if memory is None else self._aligned(memory)
        )
        self._extents = Extents(capacity_bytes, alignment)

    def _allocate_buffer(self, pin_memory: bool) -> torch.Tensor:
        # Over-allocate so the base address itself is aligned: torch's CPU allocator only
        # guarantees 64 bytes, and alignment is a promise about addresses, not offsets.
        raw_nbytes = self.capacity + self.alignment - 1
        if self.device.type == "cpu":
            check_host_memory(raw_nbytes)
        raw: torch.Tensor | None = None
        if pin_memory:
            try:
                raw = torch.empty(raw_nbytes, dtype=torch.uint8, pin_memory=True)
                self.pinned = True
            except RuntimeError as exc:
                warnings.warn(
                    f"HostMemoryPool: could not pin {raw_nbytes} bytes ({exc}); "
                    "falling back to pageable memory, host<->device copies will be synchronous",
                    RuntimeWarning,
                    stacklevel=3,
                )
        if raw is None:
            try:
                raw = torch.empty(raw_nbytes, dtype=torch.uint8, device=self.device)
            except RuntimeError as exc:  # the allocator's refusal, with a raw traceback
                raise PoolTooLarge(f"cannot allocate {raw_nbytes / 2**30:.1f} GiB: {exc}") from None
        return self._aligned(raw)

    def _aligned(self, raw: torch.Tensor) -> torch.Tensor:
        """The pool's ``capacity`` bytes of ``raw``, from its first aligned address."""
        shift = -raw.data_ptr() % self.alignment
        if raw.dtype != torch.uint8 or raw.dim() != 1 or raw.numel() < shift + self.capacity:
            raise ValueError(f"memory must be a 1-d uint8 tensor of {self.capacity} bytes or more")
        return raw[shift : shift + self.capacity]

    # -- allocation ----------------------------------------------------------------------

    def allocate(self, shape: Sequence[int], dtype: torch.dtype) -> MemoryObj | None:
        """Carve a buffer for a ``shape`` x ``dtype`` tensor out of the pool (best-fit).

        Returns:
            A new `MemoryObj` with ``ref_count == 1`` owned by the caller, or ``None`` when
            no free extent is large enough (counted in ``stats.failed_allocations``).
            Exhaustion never raises and never allocates outside the pool.

        Raises:
            ValueError: a dimension is zero or negative, or ``dtype.itemsize`` exceeds the
                pool's alignment (the view could not be aligned for it).
            RuntimeError: the pool was closed.
        """
        dims = tuple(operator.index(d) for d in shape)
        if any(d <= 0 for d in dims):
            raise ValueError(f"shape must have positive dimensions, got {list(dims)}")
        if dtype.itemsize > self.alignment:
            raise ValueError(
                f"dtype {dtype} (itemsize {dtype.itemsize}) needs alignment >= "
                f"{dtype.itemsize}, pool alignment is {self.alignment}"
            )
        data_nbytes = math.prod(dims) * dtype.itemsize
        nbytes = -(-data_nbytes // self.alignment) * self.alignment

        with self._lock:
            if self._buffer is None:
                raise RuntimeError("allocate on a closed HostMemoryPool")
            offset = self._extents.take(nbytes)
            if offset is None:
                self.stats.failed_allocations += 1
                return None
            self.stats.allocations += 1
            self.stats.peak_used_bytes = max(self.stats.peak_used_bytes, self._extents.used)
        return MemoryObj(self, offset, nbytes, dims, dtype)

    def _release_locked(self, obj: MemoryObj) -> None:
        """Return ``obj``'s extent to the free list, merging with both neighbours.

        Caller holds ``self._lock``. After `close` this only marks the object freed.
        """
        obj._freed = True
        if self._buffer is None:
            return
        if not self._extents.release(obj.offset, obj.nbytes):
            raise RuntimeError(f"pool corruption: {obj!r} is not a live allocation of this pool")
        self.stats.frees += 1

    # -- introspection -------------------------------------------------------------------

    @property
    def buffer(self) -> torch.Tensor:
        """The whole pool as a ``uint8`` tensor of ``capacity`` bytes (e.g. to register it
        with a copy engine). Raises `RuntimeError` once closed."""
        buffer = self._buffer
        if buffer is None:
            raise RuntimeError("HostMemoryPool is closed")
        return buffer

    @property
    def closed(self) -> bool:
        """True after `close`."""
        return self._buffer is None

    def free_bytes(self) -> int:
        """Bytes not allocated (possibly fragmented; see `largest_free_block`)."""
        with self._lock:
            return self.capacity - self._extents.used

    def used_bytes(self) -> int:
        """Bytes held by live objects, counting aligned sizes."""
        with self._lock:
            return self._extents.used

    def largest_free_block(self) -> int:
        """Size of the largest free extent: an upper bound on what `allocate` can serve."""
        with self._lock:
            return self._extents.largest_free()

    def num_allocated(self) -> int:
        """Number of live objects (allocated and not yet returned)."""
        with self._lock:
            return self._extents.num_live

    def check_invariants(self) -> None:
        """Check the allocator's bookkeeping; used by tests.

        Raises:
            AssertionError: the free list is not sorted, overlaps itself or a live
                allocation, is not fully coalesced, the two free indexes disagree, an
                offset is misaligned, or free + used != capacity.
        """
        with self._lock:
            self._extents.check_invariants()

    # -- lifetime ------------------------------------------------------------------------

    def close(self) -> None:
        """Release the buffer; idempotent.

        Further `allocate` raises `RuntimeError`, as does `MemoryObj.tensor` on objects still
        alive; their `ref_down` only marks them freed. Tensors already obtained from
        `MemoryObj.tensor` keep the storage alive until they are dropped.
        """
        with self._lock:
            self._buffer = None
            self._extents.reset()

    def __enter__(self) -> HostMemoryPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"HostMemoryPool(capacity={self.capacity}, alignment={self.alignment}, "
            f"pinned={self.pinned}, used={self._extents.used}, objects={self._extents.num_live}"
            f"{', closed' if self._buffer is None else ''})"
        )
