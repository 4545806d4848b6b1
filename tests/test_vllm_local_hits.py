"""Hits of a full-attention model that start at vLLM's own prefix-cache hit.

vLLM asks for the tokens beyond its own hit, whose KV is in its blocks already: a load
reads only the chunks from the one holding that hit's end. So a chunk wholly inside
vLLM's hit need not be in kvtier at all (evicted from every tier, never stored)::

    token  0     64    128   192   256  300       (chunk_size 64, block_size 16)
           | c0  | c1  | c2  | c3  |...|
             --    ++    ++    ++          kvtier lost c0
           |== vLLM ==|== loaded ==|       vLLM's own hit of 128 tokens: c2, c3 loaded

A chunk that straddles vLLM's hit is loaded from the hit on, as when kvtier holds every
chunk before it (``test_vllm_scheduler_side.py``).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from support.kv import bits
from support.vllm_steps import FakeNewRequest, FakeSchedulerOutput
from support.worker_rig import random_paged, serving_worker, store_prompt

from kvtier.chunker import Chunker
from kvtier.config import load_config
from kvtier.hashing import ChunkHasher
from kvtier.integration.vllm.rpc import RankLookup, RpcClient
from kvtier.integration.vllm.scheduler import SchedulerSide
from kvtier.integration.vllm.worker import WorkerSide
from kvtier.keys import CacheKey
from kvtier_kernels import PagedKV

CHUNK = 64
BLOCK = 16
PROMPT = 300
TOKENS = list(range(1000, 1000 + PROMPT))


def chunk_hashes(tokens: list[int], chunk_size: int = CHUNK) -> list[bytes]:
    config = load_config({"chunk_size": chunk_size}, env={})
    chunker = Chunker(
        chunk_size,
        ChunkHasher(config.hash_algorithm, config.hash_seed),
        CacheKey("test-model", 1, 0, "bfloat16", b""),
    )
    return chunker.chunk_hashes(tokens, None, include_partial=False)


class Ranks:
    """Worker ranks, each holding the chunks in its set, answering ``lookup`` as
    ``RankLookup`` does (the smallest answer); ``asked``: the chunks of each lookup."""

    def __init__(self, *held: set[int]):
        self.hashes = chunk_hashes(TOKENS)
        self.holding = [{self.hashes[i] for i in chunks} for chunks in held]
        self.asked: list[list[int]] = []

    def lookup(self, hashes: list[bytes], load_from: int = 0) -> int:
        self.asked.append([self.hashes.index(h) for h in hashes])
        return min(
            next((i for i, h in enumerate(hashes) if h not in holding), len(hashes))
            for holding in self.holding
        )


def side_of(ranks: Ranks, *, most: int | None = None, **config) -> SchedulerSide:
    return SchedulerSide(
        load_config({"chunk_size": CHUNK, **config}, env={}),
        ranks.lookup,
        can_save=not config.get("pd_wait_ms"),
        block_size=BLOCK,
        whole_blocks=True,
        max_load_chunks=lambda: most,
    )


def request(tokens: list[int] = TOKENS) -> SimpleNamespace:
    return SimpleNamespace(request_id="r", all_token_ids=tokens, num_prompt_tokens=len(tokens))


def test_a_hit_needs_no_chunk_inside_vllms_own():
    ranks = Ranks({1, 2, 3})
    side = side_of(ranks)
    matched, _ = side.get_num_new_matched_tokens(request(), 128)
    assert matched == 128, f"kvtier holds c2, c3 past vLLM's 128 tokens; offered {matched}"
    assert ranks.asked == [[0, 1, 2, 3], [2, 3]], f"lookups of chunks {ranks.asked}"
    assert side.counters()["lookup_hit_tokens"] == 128
    blocks = list(range(100, 119))
    side.update_state_after_alloc(request(), blocks, matched)
    step = FakeSchedulerOutput(
        scheduled_new_reqs=[FakeNewRequest("r", (blocks,), 256)],
        num_scheduled_tokens={"r": PROMPT - 256},
    )
    (load,) = side.build_plan(step).loads
    assert (load.start, load.end, load.first_chunk) == (128, 256, 2)
    assert load.hashes == ranks.hashes[2:4]


def test_a_chunk_straddling_vllms_hit_loads_from_the_hit_on():
    ranks = Ranks({2, 3})
    side = side_of(ranks)
    matched, _ = side.get_num_new_matched_tokens(request(), 160)
    assert matched == 96, f"c2 from token 160 and c3; offered {matched}"
    assert side.counters()["lookup_hit_tokens"] == 96
    blocks = list(range(100, 119))
    side.update_state_after_alloc(request(), blocks, matched)
    step = FakeSchedulerOutput(
        scheduled_new_reqs=[FakeNewRequest("r", (blocks,), 256)],
        num_scheduled_tokens={"r": PROMPT - 256},
    )
    (load,) = side.build_plan(step).loads
    assert (load.start, load.end, load.first_chunk, load.chunks_end) == (160, 256, 2, 256)
    assert load.hashes == ranks.hashes[2:4]


def test_the_chunk_at_vllms_hit_is_still_needed():
    for held, computed in [({3}, 128), ({3}, 160), ({1, 2, 3}, 0), ({0, 2, 3}, 64)]:
        side = side_of(Ranks(held))
        got = side.get_num_new_matched_tokens(request(), computed)
        assert got == (0, False), f"chunks {sorted(held)}, vLLM's {computed}: offered {got}"
        assert side.counters()["lookup_hit_tokens"] == 0


def test_every_rank_must_hold_the_chunks_past_vllms_hit():
    assert side_of(Ranks({0, 1, 2, 3}, {2})).get_num_new_matched_tokens(request(), 128) == (
        64,
        False,
    )


def test_one_load_stages_at_most_max_load_chunks_past_vllms_hit():
    side = side_of(Ranks({2, 3}), most=1)
    assert side.get_num_new_matched_tokens(request(), 128)[0] == 64
    assert side.counters()["lookup_hit_tokens"] == 128, "the whole hit is counted"


def test_the_chunks_kvtier_lacks_are_stored_again():
    """vLLM's blocks still hold c0 and c1: the step that completes the prompt stores them,
    as it would with no hit (the chunks kvtier holds are skipped when stored)."""
    ranks = Ranks({2, 3})
    side = side_of(ranks)
    matched, _ = side.get_num_new_matched_tokens(request(), 64)
    assert matched == 0, "c1 is missing past vLLM's own hit"
    matched, _ = side.get_num_new_matched_tokens(request(), 128)
    blocks = list(range(100, 119))
    side.update_state_after_alloc(request(), blocks, matched)
    step = FakeSchedulerOutput(
        scheduled_new_reqs=[FakeNewRequest("r", (blocks,), 256)],
        num_scheduled_tokens={"r": PROMPT - 256},
    )
    (save,) = side.build_plan(step).saves
    assert (save.first_chunk, save.hashes) == (0, ranks.hashes[:4])


def test_a_consumer_waits_only_for_the_chunks_past_vllms_hit():
    assert side_of(Ranks({2, 3}), pd_wait_ms=60_000).get_num_new_matched_tokens(request(), 128) == (
        128,
        False,
    )
    waiting = side_of(Ranks({2}), pd_wait_ms=60_000)
    assert waiting.get_num_new_matched_tokens(request(), 128) == (None, False)
    assert waiting.pd_waits == 1


# -- the scheduler side and a worker, over the lookup socket ---------------------------

SMALL_CHUNK, SMALL_BLOCK, LAYERS = 8, 4, 2


def test_a_worker_loads_past_vllms_hit_after_kvtier_lost_the_first_chunks(tmp_path):
    """Request a stores the five chunks of a 41-token prompt; c0 and c1 are then dropped
    from kvtier. Request b shares a's first five blocks (vLLM's own hit: 20 tokens, inside
    c2) and gets tokens [20, 40) from c2 (its part past token 20), c3 and c4: a's KV, bit
    for bit; the blocks vLLM holds are never written, and b stores c0 and c1 again."""
    config = load_config({"chunk_size": SMALL_CHUNK, "kernel_backend": "torch"}, env={})
    paged = random_paged(LAYERS, 24, SMALL_BLOCK, num_heads=2, head_size=8)
    worker, endpoint = serving_worker(tmp_path, config, paged)
    try:
        with RpcClient([endpoint], 2.0) as client:
            side = SchedulerSide(config, RankLookup(client), block_size=SMALL_BLOCK)
            load_after_dropping_the_first_chunks(worker, side, paged)
    finally:
        worker.shutdown()


def load_after_dropping_the_first_chunks(worker: WorkerSide, side: SchedulerSide, paged: PagedKV):
    tokens, blocks_a = list(range(500, 541)), list(range(1, 12))
    store_prompt(worker, side, "a", tokens, blocks_a)
    for h in chunk_hashes(tokens, SMALL_CHUNK)[:2]:
        assert worker.engine.storage.remove(worker.engine.chunker.key(h))

    b = SimpleNamespace(request_id="b", all_token_ids=tokens, num_prompt_tokens=41)
    assert side.get_num_new_matched_tokens(b, 0) == (0, False), "c0 is gone"
    matched, _ = side.get_num_new_matched_tokens(b, 20)
    assert matched == 20, f"c2 past token 20, c3, c4 are held; vLLM offered {matched}"
    blocks_b = [*blocks_a[:5], 12, 13, 14, 15, 16, 17]
    views = [paged.layer_view(i) for i in range(LAYERS)]
    before = [bits(layer[:, blocks_a[:5]]) for layer in views]
    side.update_state_after_alloc(b, blocks_b, matched)
    step = FakeSchedulerOutput(
        scheduled_new_reqs=[FakeNewRequest("b", (blocks_b,), 40)],
        num_scheduled_tokens={"b": 1},
    )
    worker.start_load(side.build_plan(step))
    worker.wait_for_save()
    assert worker.take_load_errors() == set()
    for layer, shared in zip(views, before, strict=True):
        assert torch.equal(bits(layer[:, blocks_a[:5]]), shared), "the load wrote vLLM's blocks"
        for p in range(20, 40):
            loaded = layer[:, blocks_b[p // SMALL_BLOCK], p % SMALL_BLOCK]
            stored = layer[:, blocks_a[p // SMALL_BLOCK], p % SMALL_BLOCK]
            assert torch.equal(bits(loaded), bits(stored)), f"token {p} differs from a's KV"
    keys = [worker.engine.chunker.key(h) for h in chunk_hashes(tokens, SMALL_CHUNK)]
    assert worker.engine.storage.contains_many(keys) == [True] * 5, "b stored c0, c1 again"
