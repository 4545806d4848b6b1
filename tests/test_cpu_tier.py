"""The local CPU tier: contents, eviction order, pinning, exhaustion."""

from __future__ import annotations

import pytest
import torch

from kvtier.keys import CacheKey
from kvtier.observability.stats import Counter, Stats
from kvtier.storage.cpu import LocalCPUTier

SHAPE = (2, 2, 4, 32)  # 512 fp32 elements = 2 KiB per object
NBYTES = 2 * 2 * 4 * 32 * 4


def key(i: int) -> CacheKey:
    return CacheKey("m", 1, 0, "float32", i.to_bytes(4, "little"))


def put_new(tier: LocalCPUTier, i: int) -> bool:
    obj = tier.allocate(SHAPE, torch.float32)
    if obj is None:
        return False
    obj.tensor.fill_(i)
    tier.put(key(i), obj)
    obj.ref_down()
    return True


def test_put_get_contains_remove():
    tier = LocalCPUTier(8 * NBYTES)
    assert put_new(tier, 1)
    assert tier.contains(key(1)) and not tier.contains(key(2))
    got = tier.get(key(1))
    assert got is not None and bool((got.tensor == 1).all())
    assert got.ref_count == 2  # tier + caller
    got.ref_down()
    assert tier.get(key(2)) is None
    assert tier.remove(key(1)) and not tier.remove(key(1))
    assert tier.pool.used_bytes() == 0
    tier.close()


def test_duplicate_put_keeps_existing_object():
    tier = LocalCPUTier(8 * NBYTES)
    put_new(tier, 1)
    dup = tier.allocate(SHAPE, torch.float32)
    dup.tensor.fill_(99)
    assert tier.put(key(1), dup) is False
    dup.ref_down()
    got = tier.get(key(1))
    assert bool((got.tensor == 1).all())
    got.ref_down()
    assert tier.pool.num_allocated() == 1


@pytest.mark.parametrize(
    "policy, touched, expected_survivors",
    [
        ("LRU", 0, {0, 2, 3, 4}),  # 1 is least recently used after touching 0
        ("FIFO", 0, {1, 2, 3, 4}),  # 0 was inserted first, touching does not help
        ("MRU", 0, {1, 2, 3, 4}),  # 0 was used last
        ("LFU", 0, {0, 2, 3, 4}),  # 1 has the lowest frequency, oldest among ties
    ],
)
def test_eviction_follows_policy(policy, touched, expected_survivors):
    stats = Stats()
    tier = LocalCPUTier(4 * NBYTES, policy, stats=stats)
    for i in range(4):
        assert put_new(tier, i)
    tier.get(key(touched)).ref_down()
    assert put_new(tier, 4)  # must evict exactly one
    survivors = {i for i in range(5) if tier.contains(key(i))}
    assert survivors == expected_survivors
    assert stats.get(Counter.EVICTIONS) == 1


def test_pinned_and_read_objects_are_not_evicted():
    stats = Stats()
    tier = LocalCPUTier(3 * NBYTES, "LRU", stats=stats)
    for i in range(3):
        put_new(tier, i)
    assert tier.pin(key(0))
    reader = tier.get(key(1))  # a reader holds a reference
    assert put_new(tier, 3)
    assert not tier.contains(key(2)) and tier.contains(key(0)) and tier.contains(key(1))
    # everything left is in use: the next allocation fails, is counted, raises nothing
    tier.pin(key(3))
    assert tier.allocate(SHAPE, torch.float32) is None
    assert stats.get(Counter.ALLOC_FAILURES) == 1
    reader.ref_down()
    tier.unpin(key(0))
    assert put_new(tier, 4)  # now 0 (LRU among the unpinned) can go
    assert not tier.contains(key(0))
    assert not tier.pin(key(42))


def test_remove_while_reading_frees_after_reader():
    tier = LocalCPUTier(2 * NBYTES)
    put_new(tier, 7)
    reader = tier.get(key(7))
    tier.remove(key(7))
    assert tier.pool.used_bytes() > 0  # the reader still holds it
    assert bool((reader.tensor == 7).all())
    reader.ref_down()
    assert tier.pool.used_bytes() == 0


def test_prefix_length():
    tier = LocalCPUTier(8 * NBYTES)
    for i in (0, 1, 3):
        put_new(tier, i)
    assert tier.prefix_length([key(0), key(1), key(2), key(3)]) == 2
    assert tier.prefix_length([key(2)]) == 0
    assert tier.prefix_length([]) == 0
    assert tier.prefix_length([key(0), key(1)]) == 2


def test_clear_and_close_release_everything():
    tier = LocalCPUTier(8 * NBYTES)
    for i in range(5):
        put_new(tier, i)
    assert len(tier) == 5
    tier.clear()
    assert len(tier) == 0 and tier.pool.used_bytes() == 0
    tier.close()
    with pytest.raises(RuntimeError):
        tier.allocate(SHAPE, torch.float32)


def test_an_object_larger_than_the_pool_is_refused_without_evicting():
    stats = Stats()
    tier = LocalCPUTier(4 * NBYTES, stats=stats)
    for i in range(4):
        put_new(tier, i)
    assert tier.allocate((5 * NBYTES,), torch.uint8) is None
    assert stats.get(Counter.ALLOC_FAILURES) == 1 and stats.get(Counter.EVICTIONS) == 0
    assert len(tier) == 4
    tier.close()


def test_replace_keeps_the_new_object_and_frees_the_old_after_its_reader():
    tier = LocalCPUTier(4 * NBYTES)
    put_new(tier, 1)
    reader = tier.get(key(1))
    new = tier.allocate(SHAPE, torch.float32)
    new.tensor.fill_(99)
    tier.replace(key(1), new)
    new.ref_down()
    assert bool((reader.tensor == 1).all()) and tier.pool.num_allocated() == 2
    reader.ref_down()
    assert tier.pool.num_allocated() == 1
    got = tier.get(key(1))
    assert bool((got.tensor == 99).all()) and len(tier) == 1
    got.ref_down()
    tier.close()
