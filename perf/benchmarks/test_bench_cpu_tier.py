"""CPU tier put/get of 256-token chunks at a realistic model shape.

Shape: 32 layers, 8 KV heads, head size 128, bf16 — one 256-token chunk is 32 MiB. Each
figure is GB/s with the ratio against a raw ``torch`` copy of the same bytes measured in
the same run, the op and the copy timed in alternation (``interleaved_medians``), so that
load from elsewhere weighs on both alike. ``put`` = allocate a pool buffer + copy the
chunk in + index it; ``get`` = look it up + copy it out. The store/retrieve rows go through the whole engine
path instead: gather from / scatter into a paged KV cache in vLLM's CPU layout, a prompt
of four chunks (128 MiB) a call. Their baseline copies the same bytes as they move: 128
MiB from one buffer into another, both larger than the machine's last-level cache as the
prompt's pages and chunks are (a copy of one 32 MiB chunk, repeated, runs partly in a 32
MiB L3 and measured anywhere from 23 to 53 GB/s on this project's 2-core machine).
"""

from __future__ import annotations

import pytest
import torch
from conftest import interleaved_medians

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
def raw_copy(chunk):
    dst = torch.empty_like(chunk)
    return lambda: dst.copy_(chunk)


def _record_gbps(record, metric: str, fn, raw_copy, nbytes: int, raw_nbytes: int = NBYTES):
    """``fn`` (moving ``nbytes``) and the raw copy (of ``raw_nbytes``), timed in alternation."""
    seconds, raw_seconds = interleaved_medians(fn, raw_copy)
    record(
        metric=metric,
        value=nbytes / seconds / 1e9,
        unit="GB/s",
        baseline="raw torch copy",
        baseline_value=raw_nbytes / raw_seconds / 1e9,
    )


def _key(i: int) -> CacheKey:
    return CacheKey("bench", 1, 0, "bfloat16", ChunkHasher().hash_chunk(b"", [i]))


def test_cpu_tier_put(benchmark, record, chunk, raw_copy):
    tier = LocalCPUTier(8 * NBYTES, "LRU")
    counter = iter(range(10**9))

    def put():
        obj = tier.allocate(SHAPE, DTYPE)  # evicts the oldest chunk once the tier is full
        obj.tensor.copy_(chunk)
        tier.put(_key(next(counter)), obj)
        obj.ref_down()

    benchmark(put)
    _record_gbps(record, "cpu tier put", put, raw_copy, NBYTES)
    tier.close()


def test_cpu_tier_get(benchmark, record, chunk, raw_copy):
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
    _record_gbps(record, "cpu tier get", get, raw_copy, NBYTES)
    tier.close()


@pytest.fixture(scope="module")
def raw_copy_of_a_prompt():
    """A raw copy of as many bytes as the engine rows move (four chunks), buffer to buffer."""
    src = torch.randn(4 * NBYTES // DTYPE.itemsize, generator=torch.Generator().manual_seed(3))
    src = src.to(DTYPE)
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


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


def test_engine_store(benchmark, record, engine_setup, raw_copy_of_a_prompt):
    engine, tokens, slots, _ = engine_setup

    def store():
        engine.clear()
        engine.store(tokens, slot_mapping=slots)

    benchmark(store)
    nbytes = len(tokens) // CHUNK * NBYTES
    raw = raw_copy_of_a_prompt
    _record_gbps(record, "engine store (gather + put)", store, raw, nbytes, 4 * NBYTES)


def test_engine_retrieve(benchmark, record, engine_setup, raw_copy_of_a_prompt):
    engine, tokens, slots, _ = engine_setup
    engine.clear()
    engine.store(tokens, slot_mapping=slots)
    target = slots.roll(len(slots) // 2)  # load into other pages than the source

    def retrieve():
        assert engine.retrieve(tokens, slot_mapping=target) == len(tokens)

    benchmark(retrieve)
    nbytes = len(tokens) // CHUNK * NBYTES
    raw = raw_copy_of_a_prompt
    _record_gbps(record, "engine retrieve (get + scatter)", retrieve, raw, nbytes, 4 * NBYTES)
