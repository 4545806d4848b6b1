"""``kvtier demo``: the store → evict → retrieve path on a synthetic paged KV cache.

It plays the part of a serving engine with a realistic model shape (32 layers, 8 KV
heads, head size 128, bf16 — a Llama-3-8B-sized KV cache) whose KV sits in vLLM's CPU
backend layout, all layers as views into one shared buffer, and walks through what
kvtier does for it:

1. request A (a 2048-token shared system prompt + 2048 tokens of its own) is prefilled
   and its KV stored in kvtier, chunk by chunk;
2. the engine reuses A's pages for other work (its own prefix cache forgot A);
3. A comes back: kvtier finds all of it and loads it into fresh pages, bit-exact;
4. request B shares A's system prompt: kvtier serves the shared part, and only B's own
   chunks are stored;
5. request C, unrelated, overflows the CPU tier: the eviction policy makes room
   (LRU keeps the shared system prompt, which B just used).
"""

from __future__ import annotations

import time

import torch

from kvtier.config import load_config
from kvtier.engine import CacheEngine, EngineMetadata
from kvtier.machine import check_host_memory
from kvtier.observability.stats import Counter
from kvtier_kernels import PagedKV, get_layout
from kvtier_kernels.dtypes import bits

CHUNK_SIZE = 256  # kvtier's default


class _BlockAllocator:
    """Hands out engine blocks in order, like a serving engine's free block queue."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.next = 0

    def slots_for(self, num_tokens: int, block_size: int) -> torch.Tensor:
        blocks_needed = -(-num_tokens // block_size)
        if self.next + blocks_needed > self.num_blocks:
            self.next = 0  # wrap: reuse the oldest pages, as an engine under load does
        blocks = torch.arange(self.next, self.next + blocks_needed, dtype=torch.int64)
        self.next += blocks_needed
        offsets = torch.arange(block_size, dtype=torch.int64)
        return (blocks[:, None] * block_size + offsets[None, :]).flatten()[:num_tokens]


def _prefill(paged: PagedKV, slots: torch.Tensor, generator: torch.Generator) -> None:
    """Stand-in for the model: write fresh KV for ``slots`` into every layer."""
    for layer in range(paged.num_layers):
        view = paged.layer_view(layer)  # [2, NB, BS, H, D]
        blocks, offsets = slots // paged.block_size, slots % paged.block_size
        values = torch.randn(
            (view.shape[0], len(slots), view.shape[3], view.shape[4]), generator=generator
        )
        view[:, blocks, offsets] = values.to(paged.dtype)


def _snapshot(paged: PagedKV, slots: torch.Tensor) -> torch.Tensor:
    blocks, offsets = slots // paged.block_size, slots % paged.block_size
    return torch.stack([paged.layer_view(i)[:, blocks, offsets] for i in range(paged.num_layers)])


def _gbps(nbytes: float, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:6.2f} GB/s" if seconds > 0 else "   n/a"


def tokens_multiple(chunk_size: int) -> int:
    """What a prompt's length must be a multiple of: whole chunks, and so is its first
    half (the system prompt B shares with A), so every token is stored and checked."""
    return 2 * chunk_size


def run_demo(
    num_tokens: int = 4096,
    num_layers: int = 32,
    num_kv_heads: int = 8,
    head_size: int = 128,
    block_size: int = 16,
    chunk_size: int = CHUNK_SIZE,
) -> int:
    """Run the walkthrough and print what kvtier did. Returns a process exit code.

    Raises:
        ValueError: ``num_tokens`` is not a positive multiple of ``tokens_multiple``.
        ConfigError: ``chunk_size`` is not a valid kvtier ``chunk_size``.
        PoolTooLarge: the synthetic KV cache and the CPU tier do not fit this machine's
            memory.
    """
    multiple = tokens_multiple(chunk_size)
    if num_tokens < 1 or num_tokens % multiple:
        raise ValueError(
            f"the synthetic demo's prompt length must be a multiple of {multiple} "
            f"tokens (whole {chunk_size}-token chunks, half of them the shared system "
            f"prompt); got {num_tokens}"
        )
    t_start = time.perf_counter()
    dtype = torch.bfloat16
    shared = num_tokens // 2
    bytes_per_token = 2 * num_layers * num_kv_heads * head_size * dtype.itemsize
    num_blocks = 2 * (-(-num_tokens // block_size)) + 8
    # Room for two prompts' worth of chunks, so step 5 has to evict.
    tier_gb = 2 * num_tokens * bytes_per_token / 2**30
    config = load_config({"max_local_cpu_size": tier_gb, "chunk_size": chunk_size})
    cache_bytes = num_blocks * block_size * bytes_per_token  # the engine KV cache below
    check_host_memory(cache_bytes + config.max_local_cpu_bytes)

    buffer = torch.zeros(
        (num_layers, num_blocks, num_kv_heads, block_size, 2 * head_size), dtype=dtype
    )
    paged = PagedKV(get_layout("vllm_cpu"), [buffer[i] for i in range(num_layers)])
    engine = CacheEngine(config, EngineMetadata("demo/llama-3-8b-shape"), paged)
    pages = _BlockAllocator(num_blocks)
    gen = torch.Generator().manual_seed(0)

    print(
        f"kvtier demo: {num_layers} layers x {num_kv_heads} KV heads x head size {head_size}, "
        f"{str(dtype).removeprefix('torch.')}, block size {block_size}, "
        f"{bytes_per_token / 1024:.0f} KiB of KV per token"
    )
    print(
        f"engine KV cache: {num_blocks} blocks ({buffer.numel() * dtype.itemsize / 2**30:.2f} GiB), "
        f"layout vllm_cpu; kvtier CPU tier {tier_gb:.2f} GiB, chunk {config.chunk_size} tokens, "
        f"{config.cache_policy}, {config.hash_algorithm}\n"
    )

    system = torch.randint(0, 128_000, (shared,), generator=gen)
    prompt_a = torch.cat([system, torch.randint(0, 128_000, (num_tokens - shared,), generator=gen)])
    prompt_b = torch.cat([system, torch.randint(0, 128_000, (num_tokens - shared,), generator=gen)])
    ok = True

    # 1. prefill A and store it.
    slots_a = pages.slots_for(num_tokens, block_size)
    _prefill(paged, slots_a, gen)
    reference_a = _snapshot(paged, slots_a)
    stored = engine.store(prompt_a, slot_mapping=slots_a)
    print(
        f"1. store A      {stored.stored_chunks:3d} chunks  {stored.stored_tokens:6d} tokens  "
        f"{stored.stored_bytes / 2**20:8.1f} MiB  {stored.seconds * 1e3:8.1f} ms  "
        f"{_gbps(stored.stored_bytes, stored.seconds)}"
    )

    # 2. the engine reuses A's pages.
    _prefill(paged, slots_a, gen)
    print("2. evict A      the engine overwrote A's pages with other requests' KV")

    # 3. A again: look up, load into fresh pages, check bit-exact.
    hit = engine.lookup(prompt_a)
    slots_a2 = pages.slots_for(num_tokens, block_size)
    before = engine.stats.snapshot()
    t0 = time.perf_counter()
    filled = engine.retrieve(prompt_a, slot_mapping=slots_a2)
    seconds = time.perf_counter() - t0
    loaded = engine.stats.get(Counter.LOADED_BYTES) - before.get(Counter.LOADED_BYTES, 0)
    exact = torch.equal(bits(_snapshot(paged, slots_a2)), bits(reference_a))
    ok &= exact and filled == hit == num_tokens
    print(
        f"3. retrieve A   lookup hit {hit} tokens, loaded {filled} tokens  "
        f"{loaded / 2**20:8.1f} MiB  {seconds * 1e3:8.1f} ms  {_gbps(loaded, seconds)}  "
        f"bit-exact: {'yes' if exact else 'NO'}"
    )

    # 4. B shares A's system prompt.
    hit_b = engine.lookup(prompt_b)
    slots_b = pages.slots_for(num_tokens, block_size)
    filled_b = engine.retrieve(prompt_b, slot_mapping=slots_b)
    exact_b = torch.equal(
        bits(_snapshot(paged, slots_b[:shared])), bits(reference_a[:, :, :shared])
    )
    _prefill(paged, slots_b[filled_b:], gen)  # the engine computes only B's own tokens
    stored_b = engine.store(prompt_b, slot_mapping=slots_b)
    ok &= exact_b and hit_b == filled_b == shared
    print(
        f"4. request B    lookup hit {hit_b} of {num_tokens} tokens (shared prefix), "
        f"prefilled {num_tokens - filled_b}, stored {stored_b.stored_chunks} new chunks, "
        f"{stored_b.skipped_existing} already stored; prefix bit-exact: "
        f"{'yes' if exact_b else 'NO'}"
    )

    # 5. more traffic than the tier holds.
    evictions_before = engine.stats.get(Counter.EVICTIONS)
    prompt_c = torch.randint(0, 128_000, (num_tokens,), generator=gen)
    slots_c = pages.slots_for(num_tokens, block_size)
    _prefill(paged, slots_c, gen)
    engine.store(prompt_c, slot_mapping=slots_c)
    evicted = engine.stats.get(Counter.EVICTIONS) - evictions_before
    gauges = engine.metrics()["gauges"]
    print(
        f"5. more traffic stored prompt C; {evicted:.0f} chunks evicted ({config.cache_policy}); "
        f"now A hits {engine.lookup(prompt_a)} tokens, B hits {engine.lookup(prompt_b)} tokens; "
        f"tier holds {gauges['cpu_chunks']:.0f} chunks, "
        f"{gauges['cpu_pool_used_bytes'] / 2**30:.2f} GiB"
    )

    snap = engine.stats.snapshot()
    print(
        f"\ntotals: stored {snap.get(Counter.STORED_BYTES, 0) / 2**30:.2f} GiB at "
        f"{snap.get('store_gbps', 0):.2f} GB/s, loaded {snap.get(Counter.LOADED_BYTES, 0) / 2**30:.2f} GiB at "
        f"{snap.get('load_gbps', 0):.2f} GB/s, retrieve hit ratio {snap.get('retrieve_hit_ratio', 0):.2f}, "
        f"wall time {time.perf_counter() - t_start:.1f} s"
    )
    engine.close()
    print("demo", "OK" if ok else "FAILED: retrieved KV differs from what was stored")
    return 0 if ok else 1
