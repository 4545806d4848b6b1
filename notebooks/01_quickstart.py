# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Quickstart: a paged KV cache through kvtier's tiers
#
# A serving engine keeps the attention KV of its requests in a *paged* cache: fixed-size
# blocks of `block_size` token slots, one tensor per layer. kvtier copies the KV of a
# prompt out of those pages in chunks of `chunk_size` tokens, keys each chunk by a hash of
# the whole prefix up to it, and keeps the chunks in tiers: memory first, then (here) a
# local disk directory. A later request with the same prefix gets the KV back into
# whatever pages it was given, instead of recomputing it.
#
# This notebook plays the engine itself, with no model: it fills a small cache with
# random KV, stores a prompt, loads it back bit for bit, restarts kvtier on the same disk
# directory, and reads the metrics, both as counters and as Prometheus text scraped over
# HTTP. Every number it prints is asserted at the end.

# %%
import tempfile
import urllib.request
from pathlib import Path

import torch
from prometheus_client.parser import text_string_to_metric_families

from kvtier.config import load_config
from kvtier.engine import CacheEngine, EngineMetadata
from kvtier.observability.prometheus import serve_engine_metrics
from kvtier.observability.stats import Counter
from kvtier_kernels import PagedKV

# %% [markdown]
# ## The engine's KV cache
#
# `PagedKV.empty` allocates a cache in a named engine layout. `vllm_cpu` is what vLLM's
# CPU backend hands a connector: per layer, `[num_blocks, num_kv_heads, block_size,
# 2 * head_size]`, all layers views into one buffer. The model here is tiny: 4 layers,
# 2 KV heads of size 64, bf16, 64 blocks of 16 slots.

# %%
LAYERS, KV_HEADS, HEAD_SIZE, BLOCK_SIZE, NUM_BLOCKS = 4, 2, 64, 16, 64
DTYPE = torch.bfloat16
CHUNK_SIZE = 64


def new_cache(seed: int | None) -> PagedKV:
    """A cache in vLLM's CPU layout, filled with random KV (zeros when seed is None)."""
    paged = PagedKV.empty(
        "vllm_cpu",
        num_layers=LAYERS,
        num_blocks=NUM_BLOCKS,
        block_size=BLOCK_SIZE,
        num_heads=KV_HEADS,
        head_size=HEAD_SIZE,
        dtype=DTYPE,
    )
    if seed is not None:
        gen = torch.Generator().manual_seed(seed)
        for tensor in paged.tensors:
            tensor.copy_(torch.randn(tensor.shape, generator=gen).to(DTYPE))
    return paged


def kv_of(paged: PagedKV, slots: torch.Tensor) -> torch.Tensor:
    """The K and V of ``slots`` in every layer, ``[layers, 2, tokens, heads, head_size]``,
    as raw 16-bit words, so that comparisons are bit for bit."""
    blocks, offsets = slots // paged.block_size, slots % paged.block_size
    rows = [paged.layer_view(layer)[:, blocks, offsets] for layer in range(paged.num_layers)]
    return torch.stack(rows).view(torch.int16)


def slots_of_blocks(blocks: list[int], num_tokens: int) -> torch.Tensor:
    """The slot mapping of a request given ``blocks``: slot = block * block_size + offset."""
    block_ids = torch.tensor(blocks, dtype=torch.int64)
    offsets = torch.arange(BLOCK_SIZE, dtype=torch.int64)
    return (block_ids[:, None] * BLOCK_SIZE + offsets[None, :]).flatten()[:num_tokens]


paged = new_cache(seed=0)
print("layer 0 tensor:", tuple(paged.tensors[0].shape), paged.dtype)
print("canonical view [KV, blocks, slots, heads, head_size]:", tuple(paged.layer_view(0).shape))
print("a 64-token chunk in kvtier (KV_2LTD):", paged.chunk_shape(CHUNK_SIZE))

# %% [markdown]
# ## kvtier with a memory tier and a disk tier
#
# One validated config object: `chunk_size` tokens per chunk, `max_local_cpu_size` GB of
# host memory, and `local_disk` for a directory that outlives the process. (`env={}`
# ignores any `KVTIER_*` variables, so the notebook does the same thing everywhere.)

# %%
workdir = tempfile.TemporaryDirectory(prefix="kvtier-quickstart-")
disk_dir = workdir.name
config = load_config(
    {
        "chunk_size": CHUNK_SIZE,
        "max_local_cpu_size": 0.05,
        "local_disk": disk_dir,
        "max_local_disk_size": 0.1,
    },
    env={},
)
engine = CacheEngine(config, EngineMetadata("quickstart-model"), paged)
print(engine.tier_names)

# %% [markdown]
# ## Store a prompt
#
# A 200-token prompt sits in blocks 3, 9, 4, ... of the cache (an engine hands out blocks
# in any order). `store` copies every *full* chunk out: 3 chunks of 64 tokens; the last 8
# tokens are not a full chunk and stay only in the engine. The chunks go to memory at once
# and are written to disk by a background thread; `flush` waits for those writes.

# %%
PROMPT_TOKENS = 200
prompt = torch.randint(0, 32_000, (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(1))
slots = slots_of_blocks([3, 9, 4, 20, 11, 7, 30, 2, 15, 5, 40, 41, 42], PROMPT_TOKENS)
reference = kv_of(paged, slots)

stored = engine.store(prompt, slot_mapping=slots)
assert engine.flush(30), "the disk writes did not finish"
print(stored)

CHUNK_BYTES = 2 * LAYERS * CHUNK_SIZE * KV_HEADS * HEAD_SIZE * DTYPE.itemsize
print(f"one chunk: {CHUNK_BYTES} bytes (K and V x {LAYERS} layers x {CHUNK_SIZE} tokens x ...)")

# %% [markdown]
# ## The engine forgets; kvtier brings it back
#
# The engine reuses the prompt's pages for other work (here: overwrites them with new
# random values). The prompt comes back; `lookup` says how much of it kvtier holds and
# `retrieve` writes it into the new blocks the engine gave it. The result is compared
# with the original KV bit for bit.

# %%
other_work = torch.Generator().manual_seed(2)
for tensor in paged.tensors:
    tensor.copy_(torch.randn(tensor.shape, generator=other_work).to(DTYPE))

new_slots = slots_of_blocks([50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62], PROMPT_TOKENS)
hit = engine.lookup(prompt)
loaded = engine.retrieve(prompt, slot_mapping=new_slots)
exact = torch.equal(kv_of(paged, new_slots[:loaded]), reference[:, :, :loaded])
print(f"lookup: {hit} tokens; retrieve loaded {loaded} tokens; bit-exact: {exact}")
print(f"the engine computes the remaining {PROMPT_TOKENS - loaded} tokens itself")

# %% [markdown]
# ## The counters
#
# Every component counts into one `Stats` object. Rates (`store_gbps`, `load_gbps`) are
# bytes divided by the measured time of the operations that moved them.

# %%
before_restart = engine.stats.snapshot()
for name in (
    Counter.STORED_CHUNKS,
    Counter.STORED_BYTES,
    Counter.HIT_TOKENS,
    Counter.LOADED_BYTES,
    "disk_put_chunks",
    "disk_put_bytes",
):
    print(f"{name:28s} {before_restart.get(name, 0):>10.0f}")
print(f"{'retrieve_hit_ratio':28s} {before_restart['retrieve_hit_ratio']:>10.3f}")
print(
    f"measured: store {before_restart['store_gbps']:.2f} GB/s, load {before_restart['load_gbps']:.2f} GB/s"
)
disk_files = [path.stat().st_size for path in Path(disk_dir).rglob("*.kvt")]
print(f"files in {disk_dir}: {len(disk_files)} chunk files, {sum(disk_files)} bytes")
engine.close()  # the process ends: its memory tier is gone, the disk directory stays

# %% [markdown]
# ## A restart
#
# A new `CacheEngine` on the same `local_disk` directory rebuilds the disk tier's index
# from the files there. Its memory tier is empty, its cache is fresh (zeros), and still
# the prompt is found: the chunks are read from disk, checked (header, key, checksum),
# copied into memory for next time, and written into the engine's pages.

# %%
paged2 = new_cache(seed=None)
engine2 = CacheEngine(config, EngineMetadata("quickstart-model"), paged2)
hit2 = engine2.lookup(prompt)
loaded2 = engine2.retrieve(prompt, slot_mapping=slots)
exact2 = torch.equal(kv_of(paged2, slots[:loaded2]), reference[:, :, :loaded2])
print(f"after the restart: lookup {hit2} tokens, loaded {loaded2}, bit-exact: {exact2}")

# %% [markdown]
# ## Prometheus
#
# `serve_engine_metrics` serves one engine's metrics on `/metrics` (port 0 picks a free
# port; inside vLLM, the `metrics_port` key does this for every rank). We scrape it over
# HTTP like Prometheus would and parse the text.

# %%
server = serve_engine_metrics(engine2, host="127.0.0.1", port=0)
try:
    url = f"http://{server.host}:{server.port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
finally:
    server.close()

samples = {
    (sample.name, tuple(sorted(sample.labels.items()))): sample.value
    for family in text_string_to_metric_families(text)
    for sample in family.samples
}


def metric(name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted({"rank": "0", **labels}.items())))]


shown = (
    "kvtier_retrieve_hit_tokens_total",
    "kvtier_loaded_bytes_total",
    "kvtier_cpu_writeback_chunks_total",
    'kvtier_tier_get_hits_total{rank="0",tier="disk"}',
    'kvtier_tier_hit_ratio{rank="0",tier="disk"}',
    'kvtier_tier_chunks{rank="0",tier="cpu"}',
    'kvtier_tier_used_bytes{rank="0",tier="disk"}',
    "kvtier_load_latency_seconds_count",
)
for line in text.splitlines():
    if line.startswith(shown):
        print(line)

# %% [markdown]
# ## Results
#
# Exact numbers: 3 full chunks of 64 tokens stored (the 8-token tail is not a chunk), in
# memory and on disk; 192 tokens found and loaded bit for bit, before and after the
# restart; after the restart all 3 chunks came from disk and were written back to memory.

# %%
assert (stored.stored_chunks, stored.stored_tokens) == (3, 192)
assert stored.stored_bytes == 3 * CHUNK_BYTES == 3 * 131_072
assert hit == loaded == 192 and exact

assert before_restart[Counter.STORED_CHUNKS] == 3
assert before_restart[Counter.STORED_BYTES] == 3 * CHUNK_BYTES
assert before_restart[Counter.HIT_TOKENS] == 192
assert before_restart[Counter.REQUESTED_TOKENS] == 200
assert before_restart[Counter.LOADED_BYTES] == 3 * CHUNK_BYTES
assert before_restart["retrieve_hit_ratio"] == 192 / 200
assert before_restart["disk_put_chunks"] == 3
# the disk tier wrote 3 files: each a chunk's bytes behind a small header (key, checksum, ...)
assert len(disk_files) == 3
assert before_restart["disk_put_bytes"] == sum(disk_files) > 3 * CHUNK_BYTES

assert hit2 == loaded2 == 192 and exact2
assert metric("kvtier_stored_chunks_total") == 0  # nothing new was stored after the restart
assert metric("kvtier_retrieve_hit_tokens_total") == 192
assert metric("kvtier_loaded_bytes_total") == 3 * CHUNK_BYTES
assert metric("kvtier_tier_get_hits_total", tier="disk") == 3
assert metric("kvtier_tier_get_misses_total", tier="disk") == 0
assert metric("kvtier_tier_hit_ratio", tier="disk") == 1.0
assert metric("kvtier_cpu_writeback_chunks_total") == 3
assert metric("kvtier_tier_chunks", tier="cpu") == 3
assert metric("kvtier_load_latency_seconds_count") == 1
assert metric("kvtier_tier_used_bytes", tier="disk") == sum(disk_files)
assert metric("kvtier_corrupt_chunks_rejected_total") == 0
engine2.close()
workdir.cleanup()
print("all results as expected")
