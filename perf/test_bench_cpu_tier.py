"""CPU tier put/get of 256-token chunks at a realistic model shape.

Shape: 32 layers, 8 KV heads, head size 128, bf16 — one 256-token chunk is 32 MiB. Each
figure is GB/s with the ratio against a raw ``torch`` copy of the same bytes measured in
the same run. ``put`` = allocate a pool buffer + copy the chunk in + index it;
``get`` = look it up + copy it out. The store/retrieve rows go through the whole engine
path instead: gather from / scatter into a paged KV cache in vLLM's CPU layout.
"""

from __future__ import annotations

import pytest
import torch
from conftest import median_seconds

from kvtier.config import load_config
from kvtier.engine import CacheEngine, EngineMetadata
from kvtier.hashing import ChunkHasher
from kvtier.keys import CacheKey
from kvtier.storage.cpu import LocalCPUTier
from kvtier_kernels import PagedKV, get_layout

LAYERS, HEADS, HEAD_SIZE, CHUNK = 32, 8, 128, 256
DTYPE = torch.bfloat16
SHAPE = (2, LAYERS, CHUNK, HEADS * HEAD_SIZE)
NBYTES = 2 * LAYERS * CHUNK * HEADS * HEAD_SIZE * DTYPE.itemsize


@pytest.fixture(scope="module")
def chunk():
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(0)).to(DTYPE)


@pytest.fixture(scope="module")
def raw_copy_gbps(chunk):
    dst = torch.empty_like(chunk)
    return NBYTES / median_seconds(lambda: dst.copy_(chunk)) / 1e9


def _key(i: int) -> CacheKey:
    return CacheKey("bench", 1, 0, "bfloat16", ChunkHasher().hash_chunk(b"", [i]))


def test_cpu_tier_put(benchmark, record, chunk, raw_copy_gbps):
    tier = LocalCPUTier(8 * NBYTES, "LRU")
    counter = iter(range(10**9))

    def put():
        obj = tier.allocate(SHAPE, DTYPE)  # evicts the oldest chunk once the tier is full
        obj.tensor.copy_(chunk)
        tier.put(_key(next(counter)), obj)
        obj.ref_down()

    benchmark(put)
    gbps = NBYTES / benchmark.stats.stats.median / 1e9
    record(
        metric="cpu tier put",
        value=gbps,
        unit="GB/s",
        baseline="raw torch copy",
        baseline_value=raw_copy_gbps,
    )
    tier.close()


def test_cpu_tier_get(benchmark, record, chunk, raw_copy_gbps):
    tier = LocalCPUTier(4 * NBYTES, "LRU")
    obj = tier.allocate(SHAPE, DTYPE)
    obj.tensor.copy_(chunk)
    tier.put(_key(0), obj)
    obj.ref_down()
    dst = torch.empty_like(chunk)

    def get():
        got = tier.get(_key(0))
        dst.copy_(got.tensor)
        got.ref_down()

    benchmark(get)
    assert torch.equal(dst.view(torch.int16), chunk.view(torch.int16))
    gbps = NBYTES / benchmark.stats.stats.median / 1e9
    record(
        metric="cpu tier get",
        value=gbps,
        unit="GB/s",
        baseline="raw torch copy",
        baseline_value=raw_copy_gbps,
    )
    tier.close()


@pytest.fixture(scope="module")
def engine_setup():
    block_size, num_tokens = 16, 4 * CHUNK
    num_blocks = 2 * num_tokens // block_size
    buffer = torch.randn(
        (LAYERS, num_blocks, HEADS, block_size, 2 * HEAD_SIZE),
        generator=torch.Generator().manual_seed(1),
    ).to(DTYPE)
    paged = PagedKV(get_layout("vllm_cpu"), [buffer[i] for i in range(LAYERS)])
    config = load_config({"max_local_cpu_size": 64 * NBYTES / 2**30})
    engine = CacheEngine(config, EngineMetadata("bench"), paged)
    tokens = torch.arange(num_tokens)
    # a random block table, as a serving engine hands out blocks; slots within a block are
    # consecutive
    blocks = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(2))
    slots = (blocks[:, None] * block_size + torch.arange(block_size)).flatten()[:num_tokens]
    yield engine, tokens, slots, buffer
    engine.close()


def test_engine_store(benchmark, record, engine_setup, raw_copy_gbps):
    engine, tokens, slots, _ = engine_setup

    def store():
        engine.clear()
        engine.store(tokens, slot_mapping=slots)

    benchmark(store)
    gbps = len(tokens) // CHUNK * NBYTES / benchmark.stats.stats.median / 1e9
    record(
        metric="engine store (gather + put)",
        value=gbps,
        unit="GB/s",
        baseline="raw torch copy",
        baseline_value=raw_copy_gbps,
    )


def test_engine_retrieve(benchmark, record, engine_setup, raw_copy_gbps):
    engine, tokens, slots, _ = engine_setup
    engine.clear()
    engine.store(tokens, slot_mapping=slots)
    target = slots.roll(len(slots) // 2)  # load into other pages than the source

    result = benchmark(lambda: engine.retrieve(tokens, slot_mapping=target))
    assert result == len(tokens)
    gbps = len(tokens) // CHUNK * NBYTES / benchmark.stats.stats.median / 1e9
    record(
        metric="engine retrieve (get + scatter)",
        value=gbps,
        unit="GB/s",
        baseline="raw torch copy",
        baseline_value=raw_copy_gbps,
    )
