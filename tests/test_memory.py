"""Tests for kvtier.memory: the host pool allocator, MemoryObj views, ref counts and pins."""

from __future__ import annotations

import itertools
import random
import threading
import warnings

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

import kvtier.machine
from kvtier.extents import Extents
from kvtier.machine import PoolTooLarge
from kvtier.memory import HostMemoryPool, MemoryObj, PoolStats

KiB = 1024


def make_pool(capacity: int = 64 * KiB, alignment: int = 256) -> HostMemoryPool:
    return HostMemoryPool(capacity, alignment=alignment, pin_memory=False)


def assert_no_overlap(objs: list[MemoryObj]) -> None:
    for a, b in itertools.pairwise(sorted(objs, key=lambda o: o.offset)):
        assert a.offset + a.nbytes <= b.offset, f"{a!r} overlaps {b!r}"


# -- construction ------------------------------------------------------------------------


def test_construction_validates_arguments() -> None:
    with pytest.raises(ValueError, match="alignment"):
        HostMemoryPool(4096, alignment=48, pin_memory=False)
    with pytest.raises(ValueError, match="alignment"):
        HostMemoryPool(4096, alignment=0, pin_memory=False)
    with pytest.raises(ValueError, match="capacity_bytes"):
        HostMemoryPool(0, pin_memory=False)
    with pytest.raises(ValueError, match="pin_memory"):
        HostMemoryPool(4096, pin_memory=True, device="meta")


def test_fresh_pool_is_one_free_extent() -> None:
    pool = make_pool()
    assert (pool.capacity, pool.alignment, pool.pinned) == (64 * KiB, 256, False)
    assert pool.free_bytes() == pool.largest_free_block() == 64 * KiB
    assert pool.used_bytes() == pool.num_allocated() == 0
    assert pool.stats == PoolStats()
    assert pool.buffer.dtype == torch.uint8 and pool.buffer.numel() == 64 * KiB
    pool.check_invariants()


@pytest.mark.parametrize("alignment", [64, 256, 4096])
def test_buffer_base_address_is_aligned(alignment: int) -> None:
    pool = make_pool(alignment=alignment)
    assert pool.buffer.data_ptr() % alignment == 0


def test_pin_memory_default_follows_cuda_availability() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning on the default path
        pool = HostMemoryPool(4096)
    assert pool.pinned == torch.cuda.is_available()
    if pool.pinned:
        assert pool.buffer.is_pinned()


@pytest.mark.skipif(torch.cuda.is_available(), reason="pinning succeeds with a GPU")
def test_pin_failure_falls_back_to_pageable_with_one_warning() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pool = HostMemoryPool(4096, pin_memory=True)
    assert [w.category for w in caught] == [RuntimeWarning]
    assert "pageable" in str(caught[0].message)
    assert not pool.pinned
    obj = pool.allocate([16], torch.float32)
    assert obj is not None and obj.tensor.numel() == 16


def test_a_pool_larger_than_the_available_memory_is_refused_naming_both(monkeypatch) -> None:
    monkeypatch.setattr(kvtier.machine, "host_memory", lambda: (1 << 30, 2 << 30))
    with pytest.raises(
        PoolTooLarge,
        match=r"cannot allocate 3\.0 GiB: .* 1\.0 GiB of memory available \(of 2\.0 GiB\)",
    ):
        HostMemoryPool(3 << 30, pin_memory=False)


def test_a_pool_that_leaves_little_memory_warns_once(monkeypatch) -> None:
    monkeypatch.setattr(kvtier.machine, "host_memory", lambda: (4096 + 300, 1 << 20))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        HostMemoryPool(4096, pin_memory=False)
    assert [w.category for w in caught] == [RuntimeWarning]
    assert "close to exhausting it" in str(caught[0].message)


def test_the_allocators_refusal_becomes_pool_too_large(monkeypatch) -> None:
    monkeypatch.setattr(kvtier.machine, "host_memory", lambda: None)  # unknown: no check

    def refuse(*args, **kwargs):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr(torch, "empty", refuse)
    with pytest.raises(PoolTooLarge, match=r"cannot allocate .* DefaultCPUAllocator"):
        HostMemoryPool(4096, pin_memory=False)


# -- allocate / free ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "shape"),
    [
        (torch.bfloat16, (2, 3, 5, 80)),
        (torch.float32, (7,)),
        (torch.uint8, (1,)),
        (torch.float16, (1, 1, 576)),
        (torch.int64, (3, 3)),
    ],
)
def test_allocate_views_and_rounding(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    pool = make_pool()
    first = pool.allocate([5], torch.uint8)  # forces the next offset off zero
    obj = pool.allocate(shape, dtype)
    assert first is not None and obj is not None
    data_nbytes = torch.Size(shape).numel() * dtype.itemsize
    assert obj.data_nbytes == data_nbytes
    assert obj.nbytes % 256 == 0 and data_nbytes <= obj.nbytes < data_nbytes + 256
    assert obj.offset % 256 == 0 and obj.offset >= first.nbytes
    assert obj.ref_count == 1 and not obj.is_pinned and not obj.is_freed
    assert pool.used_bytes() == first.nbytes + obj.nbytes
    assert pool.num_allocated() == 2

    view = obj.tensor
    assert view.dtype == dtype and tuple(view.shape) == shape and view.is_contiguous()
    assert view.data_ptr() == pool.buffer.data_ptr() + obj.offset
    # Writes land in the pool buffer, byte for byte.
    source = torch.arange(view.numel()).reshape(shape).to(dtype)
    view.copy_(source)
    raw = pool.buffer[obj.offset : obj.offset + data_nbytes]
    assert torch.equal(raw, source.view(-1).view(torch.uint8))
    assert torch.equal(obj.tensor, source)  # a fresh view sees the same bytes

    obj.ref_down()
    first.ref_down()
    assert obj.is_freed and pool.num_allocated() == 0
    assert pool.free_bytes() == pool.largest_free_block() == pool.capacity
    assert pool.stats.allocations == 2 and pool.stats.frees == 2
    pool.check_invariants()


@pytest.mark.parametrize("shape", [(0,), (4, 0, 2), (-1, 3)])
def test_zero_or_negative_shape_raises(shape: tuple[int, ...]) -> None:
    pool = make_pool()
    with pytest.raises(ValueError, match="positive"):
        pool.allocate(shape, torch.float32)
    assert pool.stats.failed_allocations == 0


def test_dtype_wider_than_alignment_raises() -> None:
    pool = make_pool(alignment=2)
    with pytest.raises(ValueError, match="alignment"):
        pool.allocate([4], torch.float32)
    assert pool.allocate([4], torch.bfloat16) is not None


def test_unaligned_capacity_tail_is_accounted() -> None:
    pool = make_pool(capacity=1000, alignment=256)
    objs = [pool.allocate([256], torch.uint8) for _ in range(3)]
    assert all(o is not None for o in objs)
    assert pool.allocate([1], torch.uint8) is None  # 232-byte tail < one aligned unit
    assert pool.free_bytes() == 232
    pool.check_invariants()


def test_exhaustion_returns_none_and_recovers() -> None:
    pool = make_pool(capacity=8 * KiB, alignment=256)
    objs = [pool.allocate([1 * KiB], torch.uint8) for _ in range(8)]
    assert all(o is not None for o in objs)
    assert pool.free_bytes() == 0 and pool.largest_free_block() == 0

    assert pool.allocate([1], torch.uint8) is None
    assert pool.allocate([1 * KiB], torch.uint8) is None
    assert pool.allocate([1 * KiB * KiB], torch.uint8) is None  # larger than the pool
    assert pool.stats.failed_allocations == 3
    assert pool.stats.peak_used_bytes == 8 * KiB

    objs.pop().ref_down()
    again = pool.allocate([1 * KiB], torch.uint8)
    assert again is not None and again.offset == 7 * KiB
    pool.check_invariants()


def test_fragmentation_then_coalescing() -> None:
    pool = make_pool(capacity=16 * KiB, alignment=256)
    blocks = [pool.allocate([1 * KiB], torch.uint8) for _ in range(16)]
    assert all(b is not None for b in blocks)
    for b in blocks[::2]:  # free every other block: 8 KiB free in 1 KiB holes
        b.ref_down()
    assert pool.free_bytes() == 8 * KiB and pool.largest_free_block() == 1 * KiB
    assert pool.allocate([2 * KiB], torch.uint8) is None
    assert pool.stats.failed_allocations == 1
    pool.check_invariants()

    blocks[5].ref_down()  # bridges holes 4 and 6 into a 3 KiB extent
    assert pool.largest_free_block() == 3 * KiB
    big = pool.allocate([3 * KiB], torch.uint8)
    assert big is not None and big.offset == 4 * KiB
    pool.check_invariants()


def test_best_fit_prefers_smallest_hole() -> None:
    pool = make_pool(capacity=16 * KiB, alignment=256)
    a = pool.allocate([4 * KiB], torch.uint8)  # [0, 4K)
    b = pool.allocate([1 * KiB], torch.uint8)  # [4K, 5K)
    c = pool.allocate([1 * KiB], torch.uint8)  # [5K, 6K)
    assert a is not None and b is not None and c is not None
    a.ref_down()  # holes: 4 KiB at 0, 10 KiB at 6K
    small = pool.allocate([512], torch.uint8)
    assert small is not None and small.offset == 0  # the 4 KiB hole, not the 10 KiB one
    b.ref_down()  # merges with the rest of the first hole: [512, 5K)
    pool.check_invariants()
    exact = pool.allocate([4 * KiB + 512], torch.uint8)
    assert exact is not None and exact.offset == 512


def test_free_merges_with_both_neighbours() -> None:
    pool = make_pool(capacity=4 * KiB, alignment=256)
    a, b, c, d = (pool.allocate([1 * KiB], torch.uint8) for _ in range(4))
    for obj in (a, c, b, d):  # b has a free left and a free right neighbour
        assert obj is not None
        obj.ref_down()
        pool.check_invariants()
    assert pool.largest_free_block() == pool.capacity


# -- ref counts, pins, misuse ------------------------------------------------------------


def test_a_broken_invariant_names_the_extents_bookkeeping() -> None:
    extents = Extents(4 * KiB, alignment=256)
    extents.take(1 * KiB)
    extents.used += 1  # what a lost update to the counter would leave
    with pytest.raises(AssertionError, match=r"^Extents invariant violated: used counter"):
        extents.check_invariants()


def test_ref_counting_frees_on_last_owner() -> None:
    pool = make_pool()
    obj = pool.allocate([64], torch.float32)
    assert obj is not None
    obj.ref_up()
    assert obj.ref_count == 2
    obj.ref_down()
    assert obj.ref_count == 1 and pool.num_allocated() == 1
    obj.ref_down()
    assert obj.ref_count == 0 and obj.is_freed and pool.num_allocated() == 0
    assert pool.stats.frees == 1


def test_double_free_raises() -> None:
    pool = make_pool()
    obj = pool.allocate([64], torch.float32)
    assert obj is not None
    obj.ref_down()
    with pytest.raises(RuntimeError, match="double free"):
        obj.ref_down()
    assert pool.stats.frees == 1  # freed exactly once
    pool.check_invariants()


def test_use_after_free_raises() -> None:
    pool = make_pool()
    obj = pool.allocate([64], torch.float32)
    assert obj is not None
    obj.ref_down()
    with pytest.raises(RuntimeError, match="use after free"):
        _ = obj.tensor
    with pytest.raises(RuntimeError, match="ref_up"):
        obj.ref_up()
    with pytest.raises(RuntimeError, match="pin"):
        obj.pin()


def test_pins_nest_and_unpin_below_zero_raises() -> None:
    pool = make_pool()
    obj = pool.allocate([64], torch.float32)
    assert obj is not None
    with pytest.raises(RuntimeError, match="not pinned"):
        obj.unpin()
    with obj.pinned() as same:
        assert same is obj and obj.is_pinned and obj.pin_count == 1
        obj.pin()
        assert obj.pin_count == 2
        obj.unpin()
    assert not obj.is_pinned and obj.pin_count == 0
    assert obj.ref_count == 1  # pins and references are independent


def test_context_manager_unpins_on_error() -> None:
    pool = make_pool()
    obj = pool.allocate([64], torch.float32)
    assert obj is not None
    with pytest.raises(KeyError), obj.pinned():
        raise KeyError("boom")
    assert not obj.is_pinned


def test_last_ref_dropped_while_pinned_defers_free() -> None:
    pool = make_pool()
    obj = pool.allocate([64], torch.float32)
    assert obj is not None
    obj.pin()
    obj.ref_down()
    # Still readable by the in-flight copy, but released: no new owners or pins.
    assert obj.ref_count == 0 and not obj.is_freed and pool.num_allocated() == 1
    obj.tensor.fill_(1.0)
    with pytest.raises(RuntimeError, match="ref_up"):
        obj.ref_up()
    with pytest.raises(RuntimeError, match="double free"):
        obj.ref_down()
    obj.unpin()
    assert obj.is_freed and pool.num_allocated() == 0 and pool.stats.frees == 1
    pool.check_invariants()


def test_close() -> None:
    pool = make_pool()
    obj = pool.allocate([64], torch.float32)
    assert obj is not None
    kept = obj.tensor
    pool.close()
    assert pool.closed
    with pytest.raises(RuntimeError, match="closed"):
        pool.allocate([64], torch.float32)
    with pytest.raises(RuntimeError, match="closed"):
        _ = obj.tensor
    kept.fill_(2.0)  # an outstanding view keeps its storage alive
    obj.ref_down()
    assert obj.is_freed
    pool.close()  # idempotent


def test_pool_context_manager_closes() -> None:
    with make_pool() as pool:
        assert pool.allocate([1], torch.uint8) is not None
    assert pool.closed


def test_concurrent_allocate_free() -> None:
    pool = make_pool(capacity=64 * KiB, alignment=256)
    errors: list[BaseException] = []
    start = threading.Barrier(8)

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        live: list[MemoryObj] = []
        try:
            start.wait()
            for _ in range(1500):
                if live and (rng.random() < 0.45 or len(live) > 12):
                    obj = live.pop(rng.randrange(len(live)))
                    if rng.random() < 0.3:
                        obj.ref_up()
                        with obj.pinned():
                            obj.ref_down()
                    obj.ref_down()
                else:
                    obj = pool.allocate([rng.randint(1, 4 * KiB)], torch.uint8)
                    if obj is not None:
                        obj.tensor.fill_(seed)
                        live.append(obj)
            # Each worker's bytes are untouched by the others.
            for obj in live:
                assert bool((obj.tensor == seed).all()), f"{obj!r} was overwritten"
                obj.ref_down()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    pool.check_invariants()
    assert pool.num_allocated() == 0
    assert pool.free_bytes() == pool.largest_free_block() == pool.capacity
    assert pool.stats.allocations == pool.stats.frees


# -- property-based storm ----------------------------------------------------------------

STORM_CAPACITY = 64 * KiB
STORM_ALIGNMENT = 256
STORM_DTYPES = [torch.uint8, torch.bfloat16, torch.float32]


class PoolStorm(RuleBasedStateMachine):
    """Random allocate / share / release / evict / pin traffic against a small pool.

    A model tracks each live object's expected ref and pin counts; after every step the
    pool's invariants hold, live objects do not overlap, and each object still holds the
    byte pattern written at allocation (no other object's writes reached it).
    """

    objs = Bundle("objs")

    @initialize()
    def setup(self) -> None:
        self.pool = HostMemoryPool(STORM_CAPACITY, alignment=STORM_ALIGNMENT, pin_memory=False)
        self.live: dict[int, MemoryObj] = {}  # id(obj) -> obj, memory not yet returned
        self.tags: dict[int, int] = {}
        self.next_tag = 1

    @rule(
        target=objs,
        nbytes=st.one_of(
            st.integers(1, 300),
            st.integers(1, 8 * KiB),
            st.integers(STORM_CAPACITY - 2 * KiB, STORM_CAPACITY + 1),
        ),
        dtype=st.sampled_from(STORM_DTYPES),
    )
    def allocate(self, nbytes: int, dtype: torch.dtype) -> MemoryObj | None:
        numel = max(1, nbytes // dtype.itemsize)
        fits = (
            self.pool.largest_free_block()
            >= -(-numel * dtype.itemsize // STORM_ALIGNMENT) * STORM_ALIGNMENT
        )
        failed_before = self.pool.stats.failed_allocations
        obj = self.pool.allocate([numel], dtype)
        assert (obj is not None) == fits
        if obj is None:
            assert self.pool.stats.failed_allocations == failed_before + 1
            return None
        tag = self.next_tag % 251 + 1
        self.next_tag += 1
        obj.tensor.view(-1).view(torch.uint8).fill_(tag)
        self.live[id(obj)] = obj
        self.tags[id(obj)] = tag
        return obj

    def _usable(self, obj: MemoryObj | None) -> bool:
        return obj is not None and obj.ref_count > 0

    @rule(obj=objs)
    def share(self, obj: MemoryObj | None) -> None:
        if self._usable(obj):
            assert obj is not None
            before = obj.ref_count
            obj.ref_up()
            assert obj.ref_count == before + 1

    @rule(obj=objs)
    def release(self, obj: MemoryObj | None) -> None:
        if obj is None:
            return
        if obj.ref_count == 0:
            with pytest.raises(RuntimeError, match="double free"):
                obj.ref_down()
            return
        obj.ref_down()
        self._forget_if_freed(obj)

    @rule(obj=objs)
    def evict(self, obj: MemoryObj | None) -> None:
        # What a storage tier's eviction does: drop every reference of an unpinned object.
        if not self._usable(obj):
            return
        assert obj is not None
        if obj.is_pinned:
            return
        while obj.ref_count:
            obj.ref_down()
        assert obj.is_freed
        self._forget_if_freed(obj)
        with pytest.raises(RuntimeError, match="use after free"):
            _ = obj.tensor

    @rule(obj=objs)
    def pin(self, obj: MemoryObj | None) -> None:
        if self._usable(obj):
            assert obj is not None
            obj.pin()

    @rule(obj=objs)
    def unpin(self, obj: MemoryObj | None) -> None:
        if obj is None or obj.is_freed:
            return
        if not obj.is_pinned:
            with pytest.raises(RuntimeError, match="not pinned"):
                obj.unpin()
            return
        obj.unpin()
        self._forget_if_freed(obj)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def release_everything_then_reuse(self, data: st.DataObject) -> None:
        if not data.draw(st.booleans(), label="drain"):
            return
        self._drain()
        assert self.pool.largest_free_block() == STORM_CAPACITY

    def _forget_if_freed(self, obj: MemoryObj) -> None:
        if obj.is_freed:
            del self.live[id(obj)]
            del self.tags[id(obj)]

    def _drain(self) -> None:
        for obj in list(self.live.values()):
            while obj.is_pinned:
                obj.unpin()
            while obj.ref_count:
                obj.ref_down()
            assert obj.is_freed
            self._forget_if_freed(obj)

    @invariant()
    def pool_is_consistent(self) -> None:
        if not hasattr(self, "pool"):
            return
        self.pool.check_invariants()
        live = list(self.live.values())
        assert self.pool.num_allocated() == len(live)
        assert self.pool.used_bytes() == sum(o.nbytes for o in live)
        assert_no_overlap(live)
        for obj in live:
            raw = obj.tensor.view(-1).view(torch.uint8)
            assert bool((raw == self.tags[id(obj)]).all()), f"{obj!r} lost its bytes"

    def teardown(self) -> None:
        if not hasattr(self, "pool"):
            return
        self._drain()
        self.pool.check_invariants()
        assert self.pool.num_allocated() == 0
        assert self.pool.free_bytes() == STORM_CAPACITY
        assert self.pool.largest_free_block() == STORM_CAPACITY  # one coalesced extent
        assert self.pool.stats.allocations == self.pool.stats.frees


PoolStorm.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_pool_storm = PoolStorm.TestCase
