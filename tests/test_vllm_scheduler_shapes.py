"""The vLLM connector's scheduler side on model shapes and engine limits beyond the main
scheduler tests (``test_vllm_scheduler_side.py``).

A sliding-window model: vLLM gives a request's blocks before its window as the null block
(``NULL_BLOCK_ID``), one placeholder every such request shares, so a load never writes
there and skips the chunks wholly before it::

    token  0     64    128   192   256  300       (chunk_size 64, block_size 16)
           | c0  | c1  | c2  | c3  |...|
           |0 0 0 0 0 0 0 0 0|  own blocks ...    nine null blocks: tokens [0, 144)
                              ^ the load starts here, at chunk c2

A ``chunk_size`` longer than vLLM's ``max_model_len`` never fills: kvtier says so at
start-up.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvtier.chunker import Chunker
from kvtier.config import load_config
from kvtier.hashing import ChunkHasher
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
