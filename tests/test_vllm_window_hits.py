"""Hits of a model that attends to a window (a sliding window, chunked local attention).

vLLM gives a request that starts at token ``n`` (a prefix hit of ``n`` tokens) blocks
only from ``window_start(n)`` on, its null block before them: the KV the next token
attends to. So a hit needs only the chunks of the window before its end, not every chunk
from the first, and kvtier looks for the longest one all ranks hold::

    token  0     64    128   192   256  300       (chunk_size 64, block_size 16, window 64)
           | c0  | c1  | c2  | c3  |...|
             --    --    --    ++          kvtier holds c3 only (c0..c2 were never stored)
           |0 0 0 0 0 0 0 0 0 0 0 0|      twelve null blocks: tokens [0, 192) before the
                                 ^ load   window of token 256; the hit is 256 tokens, c3 loaded

A model without a window still hits from chunk 0 (``test_vllm_scheduler_side.py``).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from support.kv import bits
from support.vllm_steps import FakeNewRequest, FakeSchedulerOutput
from support.worker_rig import random_paged, serving_worker, store_prompt

from kvtier.chunker import Chunker
from kvtier.config import load_config
from kvtier.hashing import ChunkHasher
from kvtier.integration.vllm.request_tracker import NULL_BLOCK_ID
from kvtier.integration.vllm.rpc import RankLookup, RpcClient
from kvtier.integration.vllm.scheduler import SchedulerSide
from kvtier.integration.vllm.worker import WorkerSide
from kvtier.keys import CacheKey
from kvtier_kernels import PagedKV

CHUNK = 64
BLOCK = 16
PROMPT = 300
TOKENS = list(range(1000, 1000 + PROMPT))


def sliding(window: int):
    """``facts.window_start`` of a sliding window ``window`` tokens long."""
    return lambda computed: max(0, computed - window + 1)


def chunk_hashes(tokens: list[int], chunk_size: int = CHUNK) -> list[bytes]:
    config = load_config({"chunk_size": chunk_size}, env={})
    chunker = Chunker(
        chunk_size,
        ChunkHasher(config.hash_algorithm, config.hash_seed),
        CacheKey("test-model", 1, 0, "bfloat16", b""),
    )
    return chunker.chunk_hashes(tokens, None, include_partial=False)


class Ranks:
    """Worker ranks that hold the chunks ``held`` of the prompt, answering as
    ``RankLookup``; ``prefetched``: the chunks of each ``lookup`` asked (each prefetches
    what it finds)."""

    def __init__(self, held: set[int]):
        self.hashes = chunk_hashes(TOKENS)
        self.holding = {self.hashes[i] for i in held}
        self.prefetched: list[list[int]] = []

    def held(self, hashes: list[bytes]) -> list[bool]:
        return [h in self.holding for h in hashes]

    def lookup(self, hashes: list[bytes], load_from: int = 0) -> int:
        self.prefetched.append([self.hashes.index(h) for h in hashes])
        return next((i for i, h in enumerate(hashes) if h not in self.holding), len(hashes))


def window_side(window: int, ranks: Ranks, *, most: int | None = None) -> SchedulerSide:
    config = load_config({"chunk_size": CHUNK}, env={})
    return SchedulerSide(
        config,
        ranks.lookup,
        block_size=BLOCK,
        whole_blocks=True,
        max_load_chunks=lambda: most,
        window_start=sliding(window),
        held=ranks.held,
    )


def request(tokens: list[int] = TOKENS) -> SimpleNamespace:
    return SimpleNamespace(request_id="r", all_token_ids=tokens, num_prompt_tokens=len(tokens))


def test_a_hit_loads_only_the_chunks_of_its_window():
    ranks = Ranks(held={3})
    side = window_side(64, ranks)
    matched, _ = side.get_num_new_matched_tokens(request(), 0)
    assert matched == 256, f"kvtier holds c3, the window of token 256; vLLM offered {matched}"
    assert ranks.prefetched == [[3]], f"prefetched chunks {ranks.prefetched}, expected c3"
    assert side.counters()["lookup_hit_tokens"] == 256
    blocks = [NULL_BLOCK_ID] * 12 + list(range(100, 107))  # vLLM: window_start(256) = 193
    side.update_state_after_alloc(request(), blocks, matched)
    step = FakeSchedulerOutput(
        scheduled_new_reqs=[FakeNewRequest("r", (blocks,), matched)],
        num_scheduled_tokens={"r": PROMPT - matched},
    )
    (load,) = side.build_plan(step).loads
    assert (load.start, load.end, load.first_chunk) == (192, 256, 3), (
        f"load [{load.start}, {load.end}) from chunk {load.first_chunk}; expected [192, 256) "
        "from c3"
    )
    assert load.hashes == ranks.hashes[3:4]


@pytest.mark.parametrize(
    ("held", "hit"),
    [
        ({1, 2, 3}, 256),  # the window of token 256 starts at 157: c2, c3
        ({0, 1, 3}, 128),  # c2 missing: the hits of 256 and 192 tokens need it
        ({0, 1, 2}, 192),  # the window of token 192 starts at 93: c1, c2
        ({3}, 0),
        (set(), 0),
    ],
)
def test_the_longest_hit_whose_window_every_rank_holds(held, hit):
    ranks = Ranks(held)
    side = window_side(100, ranks)
    matched, _ = side.get_num_new_matched_tokens(request(), 0)
    assert matched == hit, f"window 100, chunks {sorted(held)} held: {matched} tokens offered"
    assert side.counters()["lookup_hit_tokens"] == hit


def test_a_hit_past_vllms_own_reads_only_its_window():
    """vLLM's own hit of 128 tokens (its first chunks), kvtier's c3: the load reads c3; with
    vLLM's own hit inside that window, the load starts there."""
    ranks = Ranks(held={3})
    side = window_side(64, ranks)
    assert side.get_num_new_matched_tokens(request(), 128) == (128, False)
    assert side.get_num_new_matched_tokens(request(), 224) == (32, False)
    assert ranks.prefetched == [[3], [3]]


def test_one_load_stages_the_window_not_the_hit():
    """The CPU pool stages two chunks: a hit loads as far as its window fits in them, not
    two chunks past vLLM's own hit; a window wider than the pool loads what fits from
    vLLM's own hit on. Either way the whole hit is counted."""
    ranks = Ranks(held={0, 1, 2, 3})
    assert window_side(64, ranks, most=2).get_num_new_matched_tokens(request(), 0)[0] == 256
    side = window_side(100, ranks, most=1)  # the windows past token 64 span two chunks
    assert side.get_num_new_matched_tokens(request(), 0)[0] == 64
    assert side.counters()["lookup_hit_tokens"] == 256


def test_a_window_evicted_since_it_was_found_is_no_hit():
    ranks = Ranks(held={3})
    ranks.lookup = lambda hashes, load_from=0: 0  # gone by the prefetch
    assert window_side(64, ranks).get_num_new_matched_tokens(request(), 0) == (0, False)


def test_without_a_window_a_hit_starts_at_the_first_chunk():
    ranks = Ranks(held={1, 2, 3})
    config = load_config({"chunk_size": CHUNK}, env={})
    side = SchedulerSide(config, ranks.lookup, block_size=BLOCK, held=ranks.held)
    assert side.get_num_new_matched_tokens(request(), 0) == (0, False)


# -- the scheduler side and a worker, over the lookup socket ---------------------------

SMALL_CHUNK, SMALL_BLOCK, WINDOW, LAYERS = 8, 4, 10, 2


def test_a_worker_loads_the_window_of_a_prompt_whose_first_chunks_are_gone(tmp_path):
    """Request a stores the five chunks of a 41-token prompt; c0..c2 are then dropped. A
    request on the same prompt resumes at token 40, whose window of 10 starts at 31:
    vLLM holds its blocks from token 28 on, and the worker fills them from c3 and c4 with
    a's KV, the null block untouched."""
    config = load_config({"chunk_size": SMALL_CHUNK, "kernel_backend": "torch"}, env={})
    paged = random_paged(LAYERS, 24, SMALL_BLOCK, num_heads=2, head_size=8)
    worker, endpoint = serving_worker(tmp_path, config, paged)
    try:
        with RpcClient([endpoint], 2.0) as client:
            lookup = RankLookup(client)
            side = SchedulerSide(
                config,
                lookup,
                block_size=SMALL_BLOCK,
                window_start=sliding(WINDOW),
                held=lookup.held,
            )
            load_after_dropping_the_first_chunks(worker, side, paged)
    finally:
        worker.shutdown()


def load_after_dropping_the_first_chunks(worker: WorkerSide, side: SchedulerSide, paged: PagedKV):
    tokens, blocks_a = list(range(500, 541)), list(range(1, 12))
    store_prompt(worker, side, "a", tokens, blocks_a)
    for h in chunk_hashes(tokens, SMALL_CHUNK)[:3]:
        assert worker.engine.storage.remove(worker.engine.chunker.key(h))

    b = SimpleNamespace(request_id="b", all_token_ids=tokens, num_prompt_tokens=41)
    matched, _ = side.get_num_new_matched_tokens(b, 0)
    assert matched == 40, f"c3 and c4 hold the window of token 40; vLLM offered {matched}"
    blocks_b = [NULL_BLOCK_ID] * 7 + [12, 13, 14, 15]  # window_start(40) = 31
    null_before = [bits(layer[:, NULL_BLOCK_ID]) for layer in layer_views(paged)]
    side.update_state_after_alloc(b, blocks_b, matched)
    step = FakeSchedulerOutput(
        scheduled_new_reqs=[FakeNewRequest("b", (blocks_b,), matched)],
        num_scheduled_tokens={"b": 1},
    )
    worker.start_load(side.build_plan(step))
    worker.wait_for_save()
    assert worker.take_load_errors() == set()
    for layer, null in zip(layer_views(paged), null_before, strict=True):
        assert torch.equal(bits(layer[:, NULL_BLOCK_ID]), null), "the load wrote the null block"
        for p in range(28, 40):
            loaded = layer[:, blocks_b[p // SMALL_BLOCK], p % SMALL_BLOCK]
            stored = layer[:, blocks_a[p // SMALL_BLOCK], p % SMALL_BLOCK]
            assert torch.equal(bits(loaded), bits(stored)), f"token {p} differs from a's KV"


def layer_views(paged: PagedKV) -> list[torch.Tensor]:
    """Each layer as ``[2, blocks, block_size, ...]`` (K and V, then token order)."""
    return [paged.layer_view(i) for i in range(LAYERS)]
