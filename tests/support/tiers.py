"""Helpers shared by the tier tests: chunk keys, chunk buffers with known bytes, and a
check that a buffer holds exactly what was stored."""

from __future__ import annotations

import torch

from kvtier.keys import CacheKey
from kvtier.memory import HostMemoryPool, MemoryObj
from kvtier.storage.serde import tensor_bytes
from kvtier.storage.wire import checksum_of

CHUNK_SHAPE = (2, 3, 16, 64)  # [K/V, layers, tokens, heads * head_size]


def key(i: int, *, model: str = "org/model-a", rank: int = 0, layer: int | None = None):
    return CacheKey(model, 2, rank, "bfloat16", i.to_bytes(16, "big"), layer, (("isa", "vec"),))


def make_pool(mib: int = 64) -> HostMemoryPool:
    return HostMemoryPool(mib * 2**20, alignment=256, pin_memory=False)


def fill(pool: HostMemoryPool, seed: int, shape=CHUNK_SHAPE, dtype=torch.bfloat16) -> MemoryObj:
    """A chunk buffer full of random bit patterns (NaNs included), checksummed as the
    engine does at store time."""
    obj = pool.allocate(shape, dtype)
    assert obj is not None, "test pool exhausted"
    gen = torch.Generator().manual_seed(seed)
    raw = tensor_bytes(obj.tensor)
    raw[:] = torch.randint(0, 256, (len(raw),), generator=gen, dtype=torch.uint8).numpy().data
    obj.checksum = checksum_of(raw)
    return obj


def same_bytes(a: MemoryObj, b: MemoryObj) -> bool:
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and bytes(tensor_bytes(a.tensor)) == bytes(tensor_bytes(b.tensor))
    )
