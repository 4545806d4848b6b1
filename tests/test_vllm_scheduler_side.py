"""The vLLM connector's scheduler side, driven with small fakes of vLLM's objects.

``SchedulerSide`` duck-types vLLM's ``Request`` and ``SchedulerOutput``; the fakes below
carry exactly the attributes it reads. The lookup is a real set of chunk hashes the test
controls, and every hash the planner emits is cross-checked against an independent
computation (``Chunker.chunk_hashes``).

    token  0     64    128   192  200         (chunk_size 64, a 200-token prompt)
           |  c0 |  c1 |  c2 | c3 |
           |== held by kvtier ==|             lookup -> 3 chunks -> a 192-token hit
"""

from __future__ import annotations

import collections
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pytest
from support.vllm_steps import FakeCachedRequests, FakeNewRequest, FakeSchedulerOutput

from kvtier.chunker import Chunker, MultiModalSpan, RequestExtras
from kvtier.config import KVTierConfig, load_config
from kvtier.hashing import ChunkHasher
from kvtier.integration.vllm.common import LoadSpec, SaveSpec, StepPlan
from kvtier.integration.vllm.facts import request_extras
from kvtier.integration.vllm.scheduler import SchedulerSide
from kvtier.keys import CacheKey

CHUNK = 64
BLOCK = 16

# -- fakes of vLLM's objects ---------------------------------------------------------


@dataclass
class FakeLora:
    lora_name: str
    lora_path: str


@dataclass
class FakePosition:
    offset: int
    length: int


@dataclass
class FakeMMFeature:
    identifier: str
    mm_position: FakePosition


@dataclass
class FakeRequest:
    """vLLM's ``Request``: ``all_token_ids`` grows as tokens are generated."""

    request_id: str
    all_token_ids: list[int]
    num_prompt_tokens: int
    lora_request: FakeLora | None = None
    mm_features: list[FakeMMFeature] | None = None
    cache_salt: str | None = None


def make_request(req_id: str, num_tokens: int, *, seed: int = 0, **extras: Any) -> FakeRequest:
    rng = random.Random(seed)
    tokens = [rng.randrange(50_000) for _ in range(num_tokens)]
    return FakeRequest(req_id, tokens, num_tokens, **extras)


def blocks_for(num_tokens: int, first: int = 100, block_size: int = BLOCK) -> list[int]:
    """Block ids vLLM might hand out for ``num_tokens`` tokens (non-zero, distinctive)."""
    return list(range(first, first + -(-num_tokens // block_size)))


def new_step(req_id: str, blocks: list[int], num_computed: int, scheduled: int):
    return FakeSchedulerOutput(
        scheduled_new_reqs=[FakeNewRequest(req_id, (list(blocks),), num_computed)],
        num_scheduled_tokens={req_id: scheduled},
    )


def cached_step(
    req_id: str,
    num_computed: int,
    scheduled: int,
    new_blocks: list[int] | None = None,
    *,
    resumed: bool = False,
):
    return FakeSchedulerOutput(
        scheduled_cached_reqs=FakeCachedRequests(
            req_ids=[req_id],
            resumed_req_ids={req_id} if resumed else set(),
            new_block_ids=[None if new_blocks is None else (list(new_blocks),)],
            num_computed_tokens=[num_computed],
        ),
        num_scheduled_tokens={req_id: scheduled},
    )


# -- kvtier side helpers -------------------------------------------------------------


class HeldHashes:
    """The lookup ``SchedulerSide`` asks: how many leading hashes are held."""

    def __init__(self) -> None:
        self.held: set[bytes] = set()
        self.calls = 0

    def hold(self, hashes: Sequence[bytes]) -> None:
        self.held.update(hashes)

    def __call__(self, hashes: list[bytes], load_from: int = 0) -> int:
        self.calls += 1
        for i, h in enumerate(hashes):
            if h not in self.held:
                return i
        return len(hashes)


def make_config(**overrides: Any) -> KVTierConfig:
    return load_config({"chunk_size": CHUNK, **overrides}, env={})


def make_side(
    held: HeldHashes, *, block_size: int = BLOCK, whole_blocks: bool = False, **overrides
) -> SchedulerSide:
    can_load = overrides.pop("can_load", True)
    can_save = overrides.pop("can_save", True)
    return SchedulerSide(
        make_config(**overrides),
        held,
        can_load=can_load,
        can_save=can_save,
        block_size=block_size,
        whole_blocks=whole_blocks,
    )


def expected_hashes(
    config: KVTierConfig,
    tokens: Sequence[int],
    extras: RequestExtras | None = None,
    *,
    partial: bool = False,
) -> list[bytes]:
    """Chunk hashes computed by the token database, independently of the scheduler."""
    db = Chunker(
        config.chunk_size,
        ChunkHasher(config.hash_algorithm, config.hash_seed),
        CacheKey("test-model", 1, 0, "bfloat16", b""),
    )
    return db.chunk_hashes(list(tokens), extras, include_partial=partial)


def hit_and_plan(
    side: SchedulerSide, request: FakeRequest, num_computed: int, blocks: list[int]
) -> tuple[int, StepPlan]:
    """vLLM's sequence for a new request: match, allocate, build the step's plan with the
    whole rest of the prompt scheduled."""
    matched, _ = side.get_num_new_matched_tokens(request, num_computed)
    side.update_state_after_alloc(request, blocks, matched)
    computed = num_computed + matched
    plan = side.build_plan(
        new_step(request.request_id, blocks, computed, request.num_prompt_tokens - computed)
    )
    return matched, plan


def saved_chunks(plans: Sequence[StepPlan]) -> list[list[int]]:
    """Per plan, the chunk indices its saves cover."""
    return [
        [
            i
            for save in plan.saves
            for i in range(save.first_chunk, save.first_chunk + len(save.hashes))
        ]
        for plan in plans
    ]


def assert_save(
    save: SaveSpec,
    *,
    first_chunk: int,
    hashes: list[bytes],
    chunks_end: int,
    block_ids: list[int],
    where: str,
) -> None:
    assert save.first_chunk == first_chunk, (
        f"{where}: save starts at chunk {save.first_chunk}, expected {first_chunk}"
    )
    assert len(save.hashes) == len(hashes), (
        f"{where}: save has {len(save.hashes)} hashes, expected {len(hashes)}"
    )
    for i, (got, want) in enumerate(zip(save.hashes, hashes, strict=True)):
        assert got == want, (
            f"{where}: hash of chunk {first_chunk + i} is {got.hex()[:16]}…, "
            f"the token database says {want.hex()[:16]}…"
        )
    assert save.chunks_end == chunks_end, (
        f"{where}: save ends at token {save.chunks_end}, expected {chunks_end}"
    )
    assert save.block_ids == block_ids, (
        f"{where}: save reads blocks {save.block_ids}, expected {block_ids}"
    )


# -- get_num_new_matched_tokens ------------------------------------------------------


@pytest.mark.parametrize(
    ("num_computed", "expected"),
    [(0, 192), (16, 176), (64, 128), (128, 64)],
)
def test_hit_is_chunk_aligned_and_beyond_vllms_own(num_computed, expected):
    held = HeldHashes()
    side = make_side(held)
    request = make_request("r", 200)
    held.hold(expected_hashes(side.config, request.all_token_ids)[:3])
    got = side.get_num_new_matched_tokens(request, num_computed)
    assert got == (expected, False), (
        f"200-token prompt, 3 chunks of 64 held, vLLM has {num_computed}: got {got}, "
        f"expected ({expected}, False)"
    )


@pytest.mark.parametrize(
    ("whole_blocks", "block_size", "expected"),
    [(False, 16, 127), (False, 1, 127), (True, 32, 96), (True, 16, 112), (True, 64, 64)],
)
def test_whole_sequence_hit_never_claims_the_last_token(whole_blocks, block_size, expected):
    held = HeldHashes()
    side = make_side(held, block_size=block_size, whole_blocks=whole_blocks)
    request = make_request("r", 128)
    held.hold(expected_hashes(side.config, request.all_token_ids))
    got = side.get_num_new_matched_tokens(request, 0)
    assert got == (expected, False), (
        f"128-token prompt fully held, whole_blocks={whole_blocks}, block_size={block_size}: "
        f"got {got}, expected ({expected}, False)"
    )


@pytest.mark.parametrize(
    ("case", "held_chunks", "num_computed", "overrides"),
    [
        ("nothing held", 0, 0, {}),
        ("vLLM has exactly what kvtier holds", 3, 192, {}),
        ("vLLM has more than kvtier holds", 1, 128, {}),
        ("kvtier holds what vLLM has", 2, 128, {}),
        ("can_load=False", 3, 0, {"can_load": False}),
        ("nothing held, async", 0, 0, {"enable_async_loading": True}),
    ],
)
def test_no_hit(case, held_chunks, num_computed, overrides):
    held = HeldHashes()
    side = make_side(held, **overrides)
    request = make_request("r", 200)
    held.hold(expected_hashes(side.config, request.all_token_ids)[:held_chunks])
    got = side.get_num_new_matched_tokens(request, num_computed)
    assert got == (0, False), f"{case}: got {got}, expected (0, False)"
    side.update_state_after_alloc(request, blocks_for(200), 0)
    plan = side.build_plan(new_step("r", blocks_for(200), num_computed, 200 - num_computed))
    assert plan.loads == [], f"{case}: planned loads {plan.loads}"


@pytest.mark.parametrize(
    ("min_retrieve_tokens", "num_computed", "expected"),
    [(128, 0, 192), (192, 0, 192), (193, 0, 0), (128, 64, 128), (129, 64, 0)],
)
def test_min_retrieve_tokens_skips_short_hits(min_retrieve_tokens, num_computed, expected):
    held = HeldHashes()
    side = make_side(held, min_retrieve_tokens=min_retrieve_tokens)
    request = make_request("r", 200)
    held.hold(expected_hashes(side.config, request.all_token_ids)[:3])
    got = side.get_num_new_matched_tokens(request, num_computed)
    assert got == (expected, False), (
        f"192 tokens held, vLLM has {num_computed}, min_retrieve_tokens="
        f"{min_retrieve_tokens}: got {got}"
    )


@pytest.mark.parametrize(("held_chunks", "expected"), [(3, (192, True)), (0, (0, False))])
def test_async_loading_flag_only_with_a_hit(held_chunks, expected):
    held = HeldHashes()
    side = make_side(held, enable_async_loading=True)
    request = make_request("r", 200)
    held.hold(expected_hashes(side.config, request.all_token_ids)[:held_chunks])
    got = side.get_num_new_matched_tokens(request, 0)
    assert got == expected, f"{held_chunks} chunks held, async: got {got}, expected {expected}"


@pytest.mark.parametrize("num_computed", [0, 64])
def test_matching_twice_is_the_same_as_once(num_computed):
    plans = []
    for calls in (1, 2):
        held = HeldHashes()
        side = make_side(held)
        request = make_request("r", 200)
        held.hold(expected_hashes(side.config, request.all_token_ids)[:3])
        answers = [side.get_num_new_matched_tokens(request, num_computed) for _ in range(calls)]
        assert len(set(answers)) == 1, f"repeated calls gave different answers: {answers}"
        matched = answers[-1][0]
        side.update_state_after_alloc(request, blocks_for(200), matched)
        step = new_step("r", blocks_for(200), num_computed + matched, 200 - num_computed - matched)
        plans.append(side.build_plan(step))
    assert plans[0] == plans[1], (
        f"plan after one call {plans[0]} differs from the plan after two {plans[1]}"
    )
    assert len(plans[1].loads) == 1, f"expected one load, got {plans[1].loads}"


# -- loads ---------------------------------------------------------------------------


@pytest.mark.parametrize("hash_algorithm", ["sha256_cbor", "xxh3_128"])
@pytest.mark.parametrize("num_computed", [0, 16, 64, 128])
def test_load_spec(hash_algorithm, num_computed):
    held = HeldHashes()
    side = make_side(held, hash_algorithm=hash_algorithm)
    request = make_request("r", 200, seed=3)
    hashes = expected_hashes(side.config, request.all_token_ids)
    held.hold(hashes[:3])
    alloc = blocks_for(200)
    matched, _ = side.get_num_new_matched_tokens(request, num_computed)
    side.update_state_after_alloc(request, alloc, matched)
    scheduled_blocks = blocks_for(200, first=500)  # the blocks the scheduled request holds
    plan = side.build_plan(new_step("r", scheduled_blocks, 192, 8))
    first = num_computed // CHUNK
    want = LoadSpec(
        req_id="r",
        first_chunk=first,
        hashes=hashes[first:3],
        chunks_end=192,
        start=num_computed,
        end=192,
        block_ids=scheduled_blocks,
        is_async=False,
    )
    assert plan.loads == [want], f"vLLM had {num_computed}: planned {plan.loads}, expected [{want}]"
    again = side.build_plan(cached_step("r", 200, 1))
    assert again.loads == [], f"the load was emitted a second time: {again.loads}"


def test_load_spec_of_a_whole_sequence_hit_covers_the_last_chunk():
    held = HeldHashes()
    side = make_side(held)
    request = make_request("r", 128)
    hashes = expected_hashes(side.config, request.all_token_ids)
    held.hold(hashes)
    _, plan = hit_and_plan(side, request, 0, blocks_for(128))
    (load,) = plan.loads
    assert (load.first_chunk, load.hashes, load.chunks_end) == (0, hashes, 128), (
        f"chunks to read: first {load.first_chunk}, {len(load.hashes)} hashes, "
        f"end {load.chunks_end}; expected 0, 2, 128"
    )
    assert (load.start, load.end) == (0, 127), (
        f"tokens written [{load.start}, {load.end}), expected [0, 127)"
    )


def test_no_load_when_vllm_takes_no_external_tokens():
    held = HeldHashes()
    side = make_side(held)
    request = make_request("r", 200)
    held.hold(expected_hashes(side.config, request.all_token_ids)[:3])
    assert side.get_num_new_matched_tokens(request, 0)[0] == 192
    side.update_state_after_alloc(request, blocks_for(200), 0)
    plan = side.build_plan(new_step("r", blocks_for(200), 0, 200))
    assert plan.loads == [], f"vLLM declined the hit but a load was planned: {plan.loads}"


# -- saves ---------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [16, 64])
def test_whole_prompt_in_one_step_saves_every_full_chunk(block_size):
    held = HeldHashes()
    side = make_side(held, block_size=block_size)
    request = make_request("r", 300)
    blocks = blocks_for(300, block_size=block_size)
    _, plan = hit_and_plan(side, request, 0, blocks)
    assert len(plan.saves) == 1, f"expected one save, got {plan.saves}"
    assert_save(
        plan.saves[0],
        first_chunk=0,
        hashes=expected_hashes(side.config, request.all_token_ids)[:4],
        chunks_end=256,
        block_ids=blocks,
        where="300-token prompt in one step",
    )


@pytest.mark.parametrize(
    ("schedule", "expected"),
    [
        ([100, 200], [[0], [1, 2, 3]]),
        ([64, 64, 172], [[0], [1], [2, 3]]),
        ([50, 50, 50, 150], [[], [0], [1], [2, 3]]),
        ([63, 1, 236], [[], [0], [1, 2, 3]]),
        ([300], [[0, 1, 2, 3]]),
    ],
)
def test_chunked_prefill_saves_each_chunk_once(schedule, expected):
    held = HeldHashes()
    side = make_side(held)
    request = make_request("r", 300)
    hashes = expected_hashes(side.config, request.all_token_ids)
    side.get_num_new_matched_tokens(request, 0)
    side.update_state_after_alloc(request, blocks_for(schedule[0]), 0)
    plans, computed, have = [], 0, []
    for step, count in enumerate(schedule):
        if step == 0:
            have = blocks_for(count)
            plan = side.build_plan(new_step("r", have, 0, count))
        else:
            grown = blocks_for(computed + count)
            plan = side.build_plan(cached_step("r", computed, count, grown[len(have) :]))
            have = grown
        for save in plan.saves:
            first = save.first_chunk
            assert_save(
                save,
                first_chunk=first,
                hashes=hashes[first : first + len(save.hashes)],
                chunks_end=(first + len(save.hashes)) * CHUNK,
                block_ids=have,
                where=f"schedule {schedule}, step {step}",
            )
        plans.append(plan)
        computed += count
    assert saved_chunks(plans) == expected, (
        f"schedule {schedule}: chunks saved per step {saved_chunks(plans)}, expected {expected}"
    )


def decode(side: SchedulerSide, request: FakeRequest, steps: int, seed: int = 7):
    """Generate ``steps`` tokens one step at a time; returns each step's plan."""
    rng = random.Random(seed)
    plans = []
    for _ in range(steps):
        request.all_token_ids.append(rng.randrange(50_000))  # sampled by the last step
        computed = len(request.all_token_ids) - 1
        grows = computed % BLOCK == 0
        new = [1000 + computed // BLOCK] if grows else None
        plans.append(side.build_plan(cached_step(request.request_id, computed, 1, new)))
    return plans


@pytest.mark.parametrize("save_decode_cache", [False, True])
def test_decode_saves_only_with_save_decode_cache(save_decode_cache):
    held = HeldHashes()
    side = make_side(held, save_decode_cache=save_decode_cache)
    request = make_request("r", 300)
    _, prefill = hit_and_plan(side, request, 0, blocks_for(300))
    assert saved_chunks([prefill]) == [[0, 1, 2, 3]], f"prefill saved {saved_chunks([prefill])}"
    plans = decode(side, request, 40)  # computed ends at 301 .. 340; chunk 4 ends at 320
    per_step = saved_chunks(plans)
    want = [[4] if 301 + i == 320 and save_decode_cache else [] for i in range(40)]
    assert per_step == want, (
        f"save_decode_cache={save_decode_cache}: decode steps saved "
        f"{[(301 + i, c) for i, c in enumerate(per_step) if c]}, expected "
        f"{[(301 + i, c) for i, c in enumerate(want) if c]} (step: computed end, chunks)"
    )
    if save_decode_cache:
        (save,) = plans[320 - 301].saves
        assert_save(
            save,
            first_chunk=4,
            hashes=expected_hashes(side.config, request.all_token_ids[:320])[4:5],
            chunks_end=320,
            block_ids=save.block_ids,
            where="chunk 4, filled by generated tokens",
        )


class ReadCounting(list):
    """``all_token_ids`` that counts how often each token is sliced out (for hashing)."""

    def __getitem__(self, item):
        if isinstance(item, slice):
            self.reads.update(range(*item.indices(len(self))))
        return super().__getitem__(item)


def test_a_growing_request_has_each_token_hashed_once():
    """Asked while it waits, prefilled, decoded a token a step with decode saves: each
    token is read for hashing once, those of the partial chunk once more."""
    side = make_side(HeldHashes(), save_unfull_chunk=True, save_decode_cache=True)
    request = make_request("r", 300)
    request.all_token_ids = tokens = ReadCounting(request.all_token_ids)
    tokens.reads = collections.Counter()
    for _ in range(5):  # waiting: vLLM asks again every step
        assert side.get_num_new_matched_tokens(request, 0) == (0, False)
    _, prefill = hit_and_plan(side, request, 0, blocks_for(300))
    plans = decode(side, request, 40)  # chunk 4 (256..320) is full at 320
    assert saved_chunks([prefill, *plans]) == [[0, 1, 2, 3, 4]] + [[]] * 19 + [[4]] + [[]] * 20
    assert plans[19].saves[0].hashes == expected_hashes(side.config, list(tokens)[:320])[4:5]
    assert sum(tokens.reads.values()) == 320 + (300 - 256), tokens.reads


@pytest.mark.parametrize(
    ("whole_blocks", "schedule", "expected_chunks", "expected_end"),
    [
        (False, [300], [[0, 1, 2, 3, 4]], 300),
        (False, [100, 200], [[0], [1, 2, 3, 4]], 300),
        # whole blocks only: the partial chunk ends at the last whole block (288)
        (True, [300], [[0, 1, 2, 3, 4]], 288),
        (True, [100, 200], [[0], [1, 2, 3, 4]], 288),
    ],
)
def test_save_unfull_chunk(whole_blocks, schedule, expected_chunks, expected_end):
    held = HeldHashes()
    side = make_side(held, whole_blocks=whole_blocks, save_unfull_chunk=True)
    request = make_request("r", 300)
    hashes = expected_hashes(side.config, request.all_token_ids[:expected_end], partial=True)
    side.get_num_new_matched_tokens(request, 0)
    side.update_state_after_alloc(request, blocks_for(300), 0)
    plans, computed = [], 0
    for step, count in enumerate(schedule):
        if step == 0:
            plans.append(side.build_plan(new_step("r", blocks_for(300), 0, count)))
        else:
            plans.append(side.build_plan(cached_step("r", computed, count)))
        computed += count
    assert saved_chunks(plans) == expected_chunks, (
        f"whole_blocks={whole_blocks}, schedule {schedule}: saved {saved_chunks(plans)}, "
        f"expected {expected_chunks}"
    )
    last = plans[-1].saves[-1]
    assert last.chunks_end == expected_end, (
        f"whole_blocks={whole_blocks}: last save ends at {last.chunks_end}, expected {expected_end}"
    )
    last_chunk = expected_chunks[-1][-1]
    assert last.hashes[-1] == hashes[last_chunk], (
        f"whole_blocks={whole_blocks}: the hash saved for chunk {last_chunk} is not the "
        "token database's"
    )
    assert not decode_saves(side, request), "decode steps saved the prompt's chunks again"


def decode_saves(side: SchedulerSide, request: FakeRequest) -> list[SaveSpec]:
    return [save for plan in decode(side, request, 10) for save in plan.saves]


def test_can_save_false_saves_nothing():
    held = HeldHashes()
    side = make_side(held, can_save=False, save_unfull_chunk=True, save_decode_cache=True)
    request = make_request("r", 300)
    _, prefill = hit_and_plan(side, request, 0, blocks_for(300))
    plans = [prefill, *decode(side, request, 30)]
    assert not any(plan.saves for plan in plans), (
        f"can_save=False but steps saved {[i for i, p in enumerate(plans) if p.saves]}"
    )


@pytest.mark.parametrize(
    ("prompt", "held_chunks", "num_computed", "overrides", "expected"),
    [
        (200, 3, 0, {}, []),
        (200, 3, 64, {}, []),
        (200, 3, 0, {"save_unfull_chunk": True}, [3]),
        (300, 2, 0, {}, [2, 3]),
        (300, 2, 64, {}, [2, 3]),
    ],
)
def test_hit_request_does_not_resave_loaded_chunks(
    prompt, held_chunks, num_computed, overrides, expected
):
    held = HeldHashes()
    side = make_side(held, **overrides)
    request = make_request("r", prompt)
    held.hold(expected_hashes(side.config, request.all_token_ids)[:held_chunks])
    matched, plan = hit_and_plan(side, request, num_computed, blocks_for(prompt))
    assert matched == held_chunks * CHUNK - num_computed, f"hit of {matched} tokens"
    assert saved_chunks([plan]) == [expected], (
        f"{prompt}-token prompt, {held_chunks} chunks loaded: saved {saved_chunks([plan])}, "
        f"expected {[expected]}"
    )


@pytest.mark.parametrize(("whole_blocks", "block_size"), [(False, 16), (True, 32)])
def test_whole_sequence_hit_saves_no_fully_loaded_chunk(whole_blocks, block_size):
    held = HeldHashes()
    side = make_side(held, whole_blocks=whole_blocks, block_size=block_size)
    request = make_request("r", 128)
    held.hold(expected_hashes(side.config, request.all_token_ids))
    matched, plan = hit_and_plan(side, request, 0, blocks_for(128, block_size=block_size))
    fully_loaded = matched // CHUNK
    resaved = [c for c in saved_chunks([plan])[0] if c < fully_loaded]
    assert not resaved, f"chunks {resaved} were loaded whole and saved again"


# -- preemption ----------------------------------------------------------------------


@pytest.mark.parametrize("resumed", [False, True])
def test_resumed_request_replaces_its_blocks(resumed):
    held = HeldHashes()
    side = make_side(held)
    request = make_request("r", 300)
    first_blocks = blocks_for(100)
    side.get_num_new_matched_tokens(request, 0)
    side.update_state_after_alloc(request, first_blocks, 0)
    side.build_plan(new_step("r", first_blocks, 0, 100))  # saves chunk 0
    later = blocks_for(300, first=400)
    given = later if resumed else later[len(first_blocks) :]
    plan = side.build_plan(cached_step("r", 100, 200, given, resumed=resumed))
    want = later if resumed else first_blocks + given
    (save,) = plan.saves
    assert save.block_ids == want, (
        f"resumed={resumed}: the save reads blocks {save.block_ids}, expected {want}"
    )


def test_cached_request_without_new_blocks_keeps_its_blocks():
    held = HeldHashes()
    side = make_side(held)
    request = make_request("r", 300)
    blocks = blocks_for(300)
    side.get_num_new_matched_tokens(request, 0)
    side.update_state_after_alloc(request, blocks, 0)
    side.build_plan(new_step("r", blocks, 0, 100))
    (save,) = side.build_plan(cached_step("r", 100, 200, None)).saves
    assert save.block_ids == blocks, f"save reads {save.block_ids}, expected {blocks}"


@pytest.mark.parametrize(("async_loading", "kept"), [(False, 0), (True, 1)])
def test_preemption_drops_only_a_planned_sync_load(async_loading, kept):
    held = HeldHashes()
    side = make_side(held, enable_async_loading=async_loading)
    request = make_request("r", 200)
    held.hold(expected_hashes(side.config, request.all_token_ids)[:3])
    matched, _ = side.get_num_new_matched_tokens(request, 0)
    side.update_state_after_alloc(request, blocks_for(200), matched)
    side.on_preempted(None)  # no preemption this step: harmless
    side.on_preempted({"r", "someone-else"})
    plan = side.build_plan(FakeSchedulerOutput(preempted_req_ids={"r"}))
    assert len(plan.loads) == kept, (
        f"async={async_loading}: {len(plan.loads)} loads after preemption, expected {kept}"
    )


def test_request_preempted_between_steps_loads_when_resumed():
    """``reset_prefix_cache(reset_running_requests=True)`` preempts running requests between
    steps; vLLM resumes them in the next step, whose output names them preempted. The load
    planned at the resume (vLLM counts its tokens as computed) goes into the new blocks."""
    held = HeldHashes()
    side = make_side(held)
    request = make_request("r", 200)
    side.get_num_new_matched_tokens(request, 0)
    side.update_state_after_alloc(request, blocks_for(200), 0)
    side.build_plan(new_step("r", blocks_for(200), 0, 200))
    held.hold(expected_hashes(side.config, request.all_token_ids)[:3])
    matched, _ = side.get_num_new_matched_tokens(request, 0)
    resumed_blocks = blocks_for(200, first=400)
    side.update_state_after_alloc(request, resumed_blocks, matched)
    step = cached_step("r", matched, 200 - matched, resumed_blocks, resumed=True)
    step.preempted_req_ids = {"r"}
    plan = side.build_plan(step)
    assert [load.block_ids for load in plan.loads] == [resumed_blocks], (
        f"the resumed request's load of {matched} tokens was dropped: {plan.loads}"
    )


# -- finishing -----------------------------------------------------------------------


def test_finished_request_is_forgotten():
    held = HeldHashes()
    side = make_side(held)
    request = make_request("r", 300)
    side.get_num_new_matched_tokens(request, 0)
    side.update_state_after_alloc(request, blocks_for(300), 0)
    side.build_plan(new_step("r", blocks_for(300), 0, 100))
    side.request_finished(request)
    assert "r" not in side.trackers, "the tracker outlived request_finished"
    plan = side.build_plan(cached_step("r", 100, 200))
    assert plan == StepPlan(), f"a finished request was still planned: {plan}"
    # The id comes back with other tokens: nothing cached about the old request leaks.
    reused = make_request("r", 300, seed=99)
    _, plan = hit_and_plan(side, reused, 0, blocks_for(300))
    want = expected_hashes(side.config, reused.all_token_ids)[:4]
    assert plan.saves and plan.saves[0].hashes == want, (
        "a reused request id was planned with the old request's hashes"
    )


def test_finished_request_sends_its_unsent_async_load_empty():
    held = HeldHashes()
    side = make_side(held, enable_async_loading=True)
    request = make_request("r", 200)
    held.hold(expected_hashes(side.config, request.all_token_ids)[:3])
    matched, is_async = side.get_num_new_matched_tokens(request, 64)
    assert (matched, is_async) == (128, True)
    side.update_state_after_alloc(request, blocks_for(200), matched)
    side.request_finished(request)
    plan = side.build_plan(FakeSchedulerOutput())
    assert len(plan.loads) == 1, f"expected the cancelled load, got {plan.loads}"
    (load,) = plan.loads
    assert (load.req_id, load.hashes, load.is_async) == ("r", [], True), (
        f"cancelled load {load}: expected req 'r', no hashes, async"
    )
    assert load.end == load.start == load.chunks_end, (
        f"cancelled load writes [{load.start}, {load.end}) reading to {load.chunks_end}"
    )
    assert side.build_plan(FakeSchedulerOutput()).loads == [], "the cancelled load was resent"


def test_async_load_goes_out_before_the_request_is_scheduled():
    held = HeldHashes()
    side = make_side(held, enable_async_loading=True)
    request = make_request("r", 200)
    hashes = expected_hashes(side.config, request.all_token_ids)
    held.hold(hashes[:3])
    matched, _ = side.get_num_new_matched_tokens(request, 0)
    side.update_state_after_alloc(request, blocks_for(200), matched)
    plan = side.build_plan(FakeSchedulerOutput())  # the request waits for its KV
    want = LoadSpec("r", 0, hashes[:3], 192, 0, 192, blocks_for(200), is_async=True)
    assert plan.loads == [want], f"planned {plan.loads}, expected [{want}]"
    assert side.build_plan(FakeSchedulerOutput()).loads == [], "the async load was resent"
    side.request_finished(request)
    assert side.build_plan(FakeSchedulerOutput()).loads == [], (
        "an async load already sent was sent again, empty, after the request finished"
    )


# -- extras --------------------------------------------------------------------------


_LORA_A = FakeLora("a", "/loras/a")
_LORA_B = FakeLora("b", "/loras/b")
_IMAGE = [FakeMMFeature("img-1", FakePosition(10, 20))]
_OTHER_IMAGE = [FakeMMFeature("img-2", FakePosition(10, 20))]


@pytest.mark.parametrize(
    ("first", "second", "first_extras"),
    [
        (
            {"cache_salt": "tenant-a"},
            {"cache_salt": "tenant-b"},
            RequestExtras(cache_salt="tenant-a"),
        ),
        ({}, {"cache_salt": "tenant-b"}, None),
        (
            {"lora_request": _LORA_A},
            {"lora_request": _LORA_B},
            RequestExtras(lora_name="a", lora_path="/loras/a"),
        ),
        (
            {"mm_features": _IMAGE},
            {"mm_features": _OTHER_IMAGE},
            RequestExtras(mm=(MultiModalSpan("img-1", 10, 20),)),
        ),
    ],
    ids=["salts", "salt-vs-none", "loras", "images"],
)
def test_extras_separate_hashes(first, second, first_extras):
    held = HeldHashes()
    side = make_side(held)
    one = make_request("one", 300, **first)
    two = make_request("two", 300, **second)
    assert request_extras(one) == first_extras, (
        f"request_extras read {request_extras(one)}, expected {first_extras}"
    )
    _, plan_one = hit_and_plan(side, one, 0, blocks_for(300))
    hashes_one = plan_one.saves[0].hashes
    want = expected_hashes(side.config, one.all_token_ids, first_extras)[:4]
    assert hashes_one == want, "the first request's hashes differ from the token database's"
    held.hold(hashes_one)
    got = side.get_num_new_matched_tokens(two, 0)
    assert got == (0, False), f"same tokens, other extras: hit {got} on the first's chunks"
    _, plan_two = hit_and_plan(side, two, 0, blocks_for(300, first=600))
    hashes_two = plan_two.saves[0].hashes
    assert len(hashes_two) == 4, f"the second request saved {len(hashes_two)} chunks, expected 4"
    shared = [i for i, (a, b) in enumerate(zip(hashes_one, hashes_two, strict=True)) if a == b]
    assert not shared, f"chunks {shared} have the same hash for both requests"


# -- configuration -------------------------------------------------------------------


@pytest.mark.parametrize(("chunk_size", "block_size"), [(64, 48), (64, 128), (100, 16)])
def test_chunk_size_must_be_a_multiple_of_block_size_with_whole_blocks(chunk_size, block_size):
    config = make_config(chunk_size=chunk_size)
    with pytest.raises(ValueError, match=rf"chunk_size={chunk_size}.*block_size={block_size}"):
        SchedulerSide(config, HeldHashes(), block_size=block_size, whole_blocks=True)
    SchedulerSide(config, HeldHashes(), block_size=block_size, whole_blocks=False)
