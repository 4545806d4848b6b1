"""The vLLM connector's scheduler side on model shapes and engine limits beyond the main
scheduler tests (``test_vllm_scheduler_side.py``).

A sliding-window model: vLLM gives a request's blocks before its window as the null block
(``NULL_BLOCK_ID``), one placeholder every such request shares, so a load never writes
there and skips the chunks wholly before it::

    token  0     64    128   192   256  300       (chunk_size 64, block_size 16)
           | c0  | c1  | c2  | c3  |...|
           |0 0 0 0 0 0 0 0 0|  own blocks ...    nine null blocks: tokens [0, 144)
                              ^ the load starts here, at chunk c2

A save reads only blocks vLLM still holds for the request: not the null blocks of its
own prefix hit, nor blocks its window freed before the step (another request may write
them in the same step), so chunks that start before them are not stored.

A ``chunk_size`` longer than vLLM's ``max_model_len`` never fills: kvtier says so at
start-up. A request that reads no prefix cache (prompt logprobs) drops any hit: it is not
looked up, only stored.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from support.vllm_steps import FakeCachedRequests, FakeNewRequest, FakeSchedulerOutput

from kvtier.chunker import Chunker
from kvtier.config import load_config
from kvtier.hashing import ChunkHasher
from kvtier.integration.vllm import facts
from kvtier.integration.vllm.common import slot_mapping
from kvtier.integration.vllm.request_tracker import NULL_BLOCK_ID
from kvtier.integration.vllm.scheduler import SchedulerSide
from kvtier.keys import CacheKey

CHUNK = 64
BLOCK = 16
PROMPT = 300


def plan_hit(num_null_blocks: int, *, enable_async_loading: bool):
    """A 300-token prompt whose four whole chunks kvtier holds, allocated behind
    ``num_null_blocks`` null blocks; returns the hashes of its chunks and the step's load."""
    config = load_config(
        {"chunk_size": CHUNK, "enable_async_loading": enable_async_loading}, env={}
    )
    side = SchedulerSide(
        config, lambda hashes, load_from: len(hashes), block_size=BLOCK, whole_blocks=True
    )
    request = SimpleNamespace(
        request_id="r", all_token_ids=list(range(1000, 1000 + PROMPT)), num_prompt_tokens=PROMPT
    )
    matched, _ = side.get_num_new_matched_tokens(request, 0)
    assert matched == 4 * CHUNK, f"the lookup held 4 chunks; vLLM was offered {matched} tokens"
    num_blocks = -(-PROMPT // BLOCK)
    blocks = [NULL_BLOCK_ID] * num_null_blocks + list(
        range(100, 100 + num_blocks - num_null_blocks)
    )
    side.update_state_after_alloc(request, blocks, matched)
    step = SimpleNamespace(
        scheduled_new_reqs=[
            SimpleNamespace(req_id="r", block_ids=(blocks,), num_computed_tokens=matched)
        ],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[]),
        num_scheduled_tokens={"r": PROMPT - matched},
        preempted_req_ids=set(),
    )
    plan = side.build_plan(step)
    (load,) = plan.loads
    chunker = Chunker(
        CHUNK,
        ChunkHasher(config.hash_algorithm, config.hash_seed),
        CacheKey("test-model", 1, 0, "bfloat16", b""),
    )
    return chunker.chunk_hashes(request.all_token_ids, None, include_partial=False), load


@pytest.mark.parametrize("enable_async_loading", [False, True], ids=["sync", "async"])
def test_a_load_starts_after_the_null_blocks(enable_async_loading):
    hashes, load = plan_hit(9, enable_async_loading=enable_async_loading)
    assert (load.start, load.end, load.first_chunk) == (144, 4 * CHUNK, 2), (
        f"load covers [{load.start}, {load.end}) from chunk {load.first_chunk}; expected "
        "[144, 256) from chunk 2 (nine null blocks hold tokens [0, 144))"
    )
    assert load.hashes == hashes[2:4], "the load fetches other chunks than c2 and c3"
    slots = slot_mapping(load.block_ids, BLOCK, load.chunks_end, load.start, load.end)
    written = slots[slots >= 0]
    assert not bool((written // BLOCK == NULL_BLOCK_ID).any()), "the load writes the null block"
    assert written.numel() == 256 - 144, f"{written.numel()} tokens written, expected 112"


@pytest.mark.parametrize("enable_async_loading", [False, True], ids=["sync", "async"])
def test_a_load_wholly_before_the_window_is_sent_empty(enable_async_loading):
    _, load = plan_hit(16, enable_async_loading=enable_async_loading)
    assert load.hashes == [] and load.start == load.end, (
        f"every loaded token lies in a null block, yet the load fetches {len(load.hashes)} "
        f"chunks into [{load.start}, {load.end})"
    )


def test_blocks_without_null_blocks_load_every_hit_token():
    hashes, load = plan_hit(0, enable_async_loading=False)
    assert (load.start, load.end, load.first_chunk, load.hashes) == (0, 256, 0, hashes), (
        f"load covers [{load.start}, {load.end}) from chunk {load.first_chunk}"
    )


@pytest.mark.parametrize(
    ("chunk_size", "save_unfull_chunk", "warned"),
    [(4096, False, True), (2048, False, False), (4096, True, False)],
)
def test_a_chunk_longer_than_max_model_len_is_warned_about(
    caplog, chunk_size, save_unfull_chunk, warned
):
    config = load_config({"chunk_size": chunk_size, "save_unfull_chunk": save_unfull_chunk}, env={})
    with caplog.at_level("WARNING", logger="kvtier"):
        SchedulerSide(config, lambda hashes, load_from: 0, block_size=32, max_model_len=2048)
    messages = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    said = any("chunk_size=4096" in m and "max_model_len=2048" in m for m in messages)
    assert said == warned, (
        f"chunk_size={chunk_size}, save_unfull_chunk={save_unfull_chunk}, max_model_len=2048: "
        f"warnings {messages}"
    )


def test_a_request_that_reads_no_prefix_cache_is_stored_but_never_looked_up():
    """vLLM computes every prompt token of a request with prompt logprobs (its
    ``skip_reading_prefix_cache``) and drops an external hit: kvtier does not look it up
    (a lookup prefetches what it finds on every rank), nor counts it, though it holds
    every chunk; the request's chunks are still stored."""
    lookups = []
    config = load_config({"chunk_size": CHUNK}, env={})
    side = SchedulerSide(
        config, lambda hashes, load_from: lookups.append(hashes) or len(hashes), block_size=BLOCK
    )
    request = SimpleNamespace(
        request_id="r",
        all_token_ids=list(range(1000, 1000 + PROMPT)),
        num_prompt_tokens=PROMPT,
        skip_reading_prefix_cache=True,
    )
    assert side.get_num_new_matched_tokens(request, 0) == (0, False)
    assert lookups == [], "a request vLLM loads nothing for was looked up"
    assert side.counters()["lookup_requests"] == 0 and side.counters()["lookup_hit_tokens"] == 0
    blocks = list(range(100, 100 + -(-PROMPT // BLOCK)))
    side.update_state_after_alloc(request, blocks, 0)
    step = SimpleNamespace(
        scheduled_new_reqs=[
            SimpleNamespace(req_id="r", block_ids=(blocks,), num_computed_tokens=0)
        ],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[]),
        num_scheduled_tokens={"r": PROMPT},
        preempted_req_ids=set(),
    )
    plan = side.build_plan(step)
    assert plan.loads == [] and [len(save.hashes) for save in plan.saves] == [4], plan.saves


def saving_side(window: int | None = None) -> SchedulerSide:
    """A scheduler side that stores every chunk (kvtier holds none); with ``window``, of a
    model whose one KV cache group is a sliding window that long."""
    config = load_config({"chunk_size": CHUNK}, env={})
    extra = (
        {}
        if window is None
        else {"window_start": facts.window_start(sliding_window_config(window))}
    )
    return SchedulerSide(
        config, lambda hashes, load_from: 0, block_size=BLOCK, whole_blocks=True, **extra
    )


def test_a_prefix_hit_behind_null_blocks_stores_no_chunk_that_starts_in_them():
    """vLLM's own hit of 240 tokens (a sliding window's, its first nine blocks null) while
    kvtier holds nothing: stored from there, c0..c2 would be the null block's bytes."""
    side = saving_side()
    request = SimpleNamespace(
        request_id="r", all_token_ids=list(range(1000, 1000 + PROMPT)), num_prompt_tokens=PROMPT
    )
    assert side.get_num_new_matched_tokens(request, 240) == (0, False)
    blocks = [NULL_BLOCK_ID] * 9 + list(range(100, 110))
    side.update_state_after_alloc(request, blocks, 0)
    step = FakeSchedulerOutput(
        scheduled_new_reqs=[FakeNewRequest("r", (blocks,), 240)],
        num_scheduled_tokens={"r": PROMPT - 240},
    )
    (save,) = side.build_plan(step).saves
    assert (save.first_chunk, len(save.hashes), save.chunks_end) == (3, 1, 4 * CHUNK), (
        f"stores chunks {save.first_chunk}..{save.first_chunk + len(save.hashes) - 1}; "
        "expected c3 only (c0..c2 start in the null blocks, tokens [0, 144))"
    )


def test_a_chunk_whose_first_blocks_the_window_freed_is_not_stored():
    """Window 32, chunked prefill of 80 tokens a step. c2 [128, 192) completes in step 3,
    which starts with 160 tokens computed: vLLM has freed the blocks before token
    160 - 31 = 129, tokens [0, 128), and c2 is stored. c3 [192, 256) completes in step 4,
    which starts with 240 computed: tokens [0, 208) are freed, c3's block of [192, 208)
    among them (another request may write it in that step), so c3 is not stored."""
    side = saving_side(window=32)
    request = SimpleNamespace(
        request_id="r", all_token_ids=list(range(1000, 1000 + PROMPT)), num_prompt_tokens=PROMPT
    )
    side.get_num_new_matched_tokens(request, 0)
    blocks = list(range(100, 100 + -(-PROMPT // BLOCK)))
    side.update_state_after_alloc(request, blocks, 0)
    stored = []
    for computed, scheduled in [(0, 80), (80, 80), (160, 80), (240, 60)]:
        if computed == 0:
            step = FakeSchedulerOutput(scheduled_new_reqs=[FakeNewRequest("r", (blocks,), 0)])
        else:
            step = FakeSchedulerOutput(
                scheduled_cached_reqs=FakeCachedRequests(["r"], set(), [None], [computed])
            )
        step.num_scheduled_tokens = {"r": scheduled}
        for save in side.build_plan(step).saves:
            stored += range(save.first_chunk, save.first_chunk + len(save.hashes))
    assert stored == [0, 1, 2], (
        f"stored chunks {stored}; expected c0..c2 (c3 starts in a block the window freed "
        "before the step that completed it)"
    )


def sliding_window_config(window: int):
    class SlidingWindowSpec:  # named as vLLM's: window_start reads the class name
        sliding_window = window

    return SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=SlidingWindowSpec())])


def test_window_start_follows_vllms_kv_cache_managers():
    class FullAttentionSpec:  # a sliding window vLLM turned into full attention keeps it
        sliding_window = 64

    class ChunkedLocalAttentionSpec:
        attention_chunk_size = 128

    def config(*specs):
        return SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=s) for s in specs])

    sliding = facts.window_start(sliding_window_config(64))
    assert [sliding(n) for n in (0, 63, 64, 200)] == [0, 0, 1, 137]
    local = facts.window_start(config(ChunkedLocalAttentionSpec()))
    assert [local(n) for n in (127, 128, 300)] == [0, 128, 256]
    for whole in (config(FullAttentionSpec()), None, config()):
        assert facts.window_start(whole)(5000) == 0


@pytest.mark.parametrize(
    ("window", "chunk_size", "warned"),
    [(64, 64, False), (64, 128, True), (None, 4096, False), (4096, 256, False)],
)
def test_a_chunk_the_window_can_free_blocks_of_is_warned_about(caplog, window, chunk_size, warned):
    config = load_config({"chunk_size": chunk_size}, env={})
    start = facts.window_start(None if window is None else sliding_window_config(window))
    with caplog.at_level("WARNING", logger="kvtier"):
        SchedulerSide(config, lambda hashes, load_from: 0, block_size=BLOCK, window_start=start)
    said = any(f"chunk_size={chunk_size} is not below" in r.getMessage() for r in caplog.records)
    assert said == warned, f"window {window}, chunk_size {chunk_size}: warned {said}"
