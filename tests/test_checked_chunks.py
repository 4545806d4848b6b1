"""The storage layer's checked put and get (``CheckedChunks``): sealed with a checksum on
the way in, checked (shape, dtype, checksum) on the way out; a chunk that fails is
counted, removed from the tiers and a miss."""

from __future__ import annotations

import pytest
import torch
from support.tiers import CHUNK_SHAPE, key

from kvtier.config import load_config
from kvtier.observability.stats import Counter, Stats
from kvtier.storage.checked import CheckedChunks
from kvtier.storage.manager import StorageManager
from kvtier.storage.serde import tensor_bytes


@pytest.fixture
def storage():
    manager = StorageManager(load_config({"max_local_cpu_size": 0.05}, env={}), Stats())
    yield manager
    manager.close()


def put_chunk(checked: CheckedChunks, seed: int):
    obj = checked.allocate(CHUNK_SHAPE, torch.bfloat16)
    assert obj is not None
    obj.tensor.copy_(torch.randn(CHUNK_SHAPE, generator=torch.Generator().manual_seed(seed)))
    assert checked.put(key(seed), obj)
    obj.ref_down()


@pytest.mark.parametrize("verify", [True, False])
def test_a_put_is_sealed_only_when_verifying(storage, verify):
    checked = CheckedChunks(storage, verify=verify)
    put_chunk(checked, 1)
    [obj] = checked.get_many([key(1)])
    assert (obj.checksum is not None) == verify
    assert checked.accept(key(1), obj, CHUNK_SHAPE, torch.bfloat16)
    obj.ref_down()


def test_bytes_changed_after_the_put_are_rejected_counted_and_removed(storage):
    checked = CheckedChunks(storage, verify=True)
    put_chunk(checked, 2)
    [obj] = checked.get_many([key(2)])
    tensor_bytes(obj.tensor)[0] ^= 0xFF
    assert not checked.intact(obj)
    assert not checked.accept(key(2), obj, CHUNK_SHAPE, torch.bfloat16)
    obj.ref_down()
    assert storage.stats.get(Counter.CORRUPT_CHUNKS) == 1
    assert storage.get_many([key(2)]) == [None]


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [((2, 3, 8, 64), torch.bfloat16), (CHUNK_SHAPE, torch.float16)],
    ids=["shape", "dtype"],
)
def test_a_chunk_of_another_shape_or_dtype_is_rejected_even_unverified(storage, shape, dtype):
    checked = CheckedChunks(storage, verify=False)
    put_chunk(checked, 3)
    [obj] = checked.get_many([key(3)])
    assert not checked.accept(key(3), obj, shape, dtype)
    obj.ref_down()
    assert storage.stats.get(Counter.CORRUPT_CHUNKS) == 1
    assert not storage.contains(key(3))
