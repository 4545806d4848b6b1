"""The vLLM connector's extension interface: every hook of ``SchedulerSide`` and
``WorkerSide`` reaches each extension, and the connector works with CacheBlend deleted."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from kvtier.config import load_config
from kvtier.engine import EngineMetadata
from kvtier.integration.vllm.common import (
    RankContext,
    SaveSpec,
    SchedulerExtension,
    StepPlan,
    WorkerExtension,
)
from kvtier.integration.vllm.extensions import EXTENSIONS
from kvtier.integration.vllm.scheduler import SchedulerSide
from kvtier.integration.vllm.worker import WorkerSide
from kvtier_kernels import PagedKV

ROOT = Path(__file__).resolve().parent.parent
CHUNK = 8
BLOCK = 4


class Recorder(SchedulerExtension):
    """Claims every prompt named ``claim-*`` (all but its last token) and records hooks."""

    name = "recorder"

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def claim(self, request: Any, num_computed_tokens: int) -> int:
        self.calls.append(("claim", request.request_id))
        if request.request_id.startswith("claim-"):
            return len(request.all_token_ids) - 1 - num_computed_tokens
        return 0

    def after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int) -> bool:
        self.calls.append(("after_alloc", request.request_id, num_external_tokens))
        return num_external_tokens > 0

    def on_chunks(self, request: Any, first_chunk: int, hashes: list[bytes], end: int) -> None:
        self.calls.append(("on_chunks", request.request_id, first_chunk, len(hashes), end))

    def extend_plan(self, plan: StepPlan, scheduler_output: Any, block_ids) -> None:
        for new in scheduler_output.scheduled_new_reqs:
            plan.extensions.setdefault(self.name, []).append((new.req_id, block_ids(new.req_id)))

    def on_preempted(self, req_ids: set[str]) -> None:
        self.calls.append(("on_preempted", sorted(req_ids)))

    def request_finished(self, request: Any) -> None:
        self.calls.append(("request_finished", request.request_id))

    def take_events(self) -> list:
        return ["event"]

    def counters(self) -> dict[str, float]:
        return {"recorder_calls": len(self.calls)}


class WorkerRecorder(WorkerExtension):
    name = "recorder"

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.rank: RankContext | None = None

    def attach(self, rank: RankContext) -> None:
        self.rank = rank

    def before_forward(self, specs: list) -> None:
        self.calls.append(("before", list(specs)))

    def after_forward(self, specs: list) -> None:
        self.calls.append(("after", list(specs)))

    def take_events(self) -> Any:
        return "rank-events"


def request(req_id: str, tokens: list[int]) -> SimpleNamespace:
    return SimpleNamespace(
        request_id=req_id,
        all_token_ids=tokens,
        num_prompt_tokens=len(tokens),
        prompt_token_ids=tokens,
    )


def new_step(req_id: str, blocks: list[int], computed: int, scheduled: int, preempted=()):
    new = SimpleNamespace(req_id=req_id, block_ids=(blocks,), num_computed_tokens=computed)
    cached = SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[])
    return SimpleNamespace(
        scheduled_new_reqs=[new],
        scheduled_cached_reqs=cached,
        num_scheduled_tokens={req_id: scheduled},
        preempted_req_ids=set(preempted),
    )


def recorded_side() -> tuple[SchedulerSide, Recorder]:
    """A scheduler side that finds nothing in kvtier, with a ``Recorder`` extension."""
    recorder = Recorder()
    config = load_config({"chunk_size": CHUNK}, env={})
    side = SchedulerSide(
        config, lambda hashes, load_from: 0, block_size=BLOCK, extensions=[recorder]
    )
    return side, recorder


def test_scheduler_hooks_reach_every_extension() -> None:
    side, recorder = recorded_side()

    # no prefix hit: the extension's claim is the answer; a claimed prompt is never stored
    claimed = request("claim-1", list(range(20)))
    assert side.get_num_new_matched_tokens(claimed, 0) == (19, False)
    side.update_state_after_alloc(claimed, [0, 1, 2, 3, 4], 19)
    plan = side.build_plan(new_step("claim-1", [0, 1, 2, 3, 4], 19, 1, preempted=["gone"]))
    assert plan.saves == []
    assert plan.extensions == {"recorder": [("claim-1", [0, 1, 2, 3, 4])]}

    # an ordinary prompt: its saves go out, and the extension sees their chunks
    plain = request("plain", list(range(100, 120)))
    assert side.get_num_new_matched_tokens(plain, 0) == (0, False)
    side.update_state_after_alloc(plain, [5, 6, 7, 8, 9], 0)
    plan = side.build_plan(new_step("plain", [5, 6, 7, 8, 9], 0, 20))
    assert [(s.first_chunk, len(s.hashes), s.chunks_end) for s in plan.saves] == [(0, 2, 16)]
    side.request_finished(plain)

    assert recorder.calls == [
        ("claim", "claim-1"),
        ("after_alloc", "claim-1", 19),
        ("on_preempted", ["gone"]),
        ("claim", "plain"),
        ("after_alloc", "plain", 0),
        ("on_preempted", []),
        ("on_chunks", "plain", 0, 2, 16),
        ("request_finished", "plain"),
    ]
    assert side.take_events() == ["event"]
    assert side.counters()["recorder_calls"] == len(recorder.calls)


def test_a_request_resumed_in_the_step_it_was_preempted_keeps_its_claim() -> None:
    """A request preempted between steps (``reset_prefix_cache`` with
    ``reset_running_requests``) resumes in the next: the claim it made since is its own."""
    side, recorder = recorded_side()
    resumed = request("claim-resumed", list(range(20)))
    assert side.get_num_new_matched_tokens(resumed, 0) == (19, False)
    side.update_state_after_alloc(resumed, [5, 6, 7, 8, 9], 19)
    plan = side.build_plan(
        new_step("claim-resumed", [5, 6, 7, 8, 9], 19, 1, preempted=["claim-resumed"])
    )
    assert ("on_preempted", []) in recorder.calls, recorder.calls
    assert plan.extensions == {"recorder": [("claim-resumed", [5, 6, 7, 8, 9])]}


def test_scheduler_counts_each_lookup_it_asks_of_the_ranks() -> None:
    config = load_config({"chunk_size": CHUNK}, env={})
    side = SchedulerSide(config, lambda hashes, load_from: 1, block_size=BLOCK)
    side.get_num_new_matched_tokens(request("a", list(range(20))), 0)
    side.get_num_new_matched_tokens(request("b", list(range(50, 70))), 0)
    counters = side.counters()
    assert (counters["lookup_requests"], counters["lookup_tokens"]) == (2, 40)
    assert counters["lookup_hit_tokens"] == 2 * CHUNK


def test_lookup_hits_count_only_what_vllm_does_not_hold() -> None:
    """``lookup_hit_tokens``: tokens found in kvtier beyond vLLM's own prefix cache."""
    config = load_config({"chunk_size": CHUNK}, env={})
    side = SchedulerSide(config, lambda hashes, load_from: len(hashes), block_size=BLOCK)
    assert side.get_num_new_matched_tokens(request("a", list(range(40))), 2 * BLOCK)[0] > 0
    side.get_num_new_matched_tokens(request("b", list(range(50, 70))), 3 * BLOCK)
    counters = side.counters()
    assert (counters["lookup_requests"], counters["lookup_tokens"]) == (2, 60)
    assert counters["lookup_hit_tokens"] == (40 - 2 * BLOCK) + (2 * CHUNK - 3 * BLOCK)


def test_a_request_asked_again_while_it_waits_is_counted_once_per_scheduling() -> None:
    """vLLM asks again every step while a request waits for blocks: one lookup counted
    until it is scheduled; preempted and asked again, it counts again."""
    config = load_config({"chunk_size": CHUNK}, env={})
    side = SchedulerSide(config, lambda hashes, load_from: 1, block_size=BLOCK)
    waiting = request("a", list(range(20)))

    def counted() -> tuple[float, float, float]:
        counters = side.counters()
        return counters["lookup_requests"], counters["lookup_tokens"], counters["lookup_hit_tokens"]

    for _ in range(3):  # no free blocks: still waiting
        assert side.get_num_new_matched_tokens(waiting, 0) == (CHUNK, False)
    assert counted() == (1, 20, CHUNK)
    side.update_state_after_alloc(waiting, [0, 1, 2, 3, 4], CHUNK)
    side.build_plan(new_step("a", [0, 1, 2, 3, 4], CHUNK, 12, preempted=["a"]))
    for _ in range(2):  # preempted: waiting again
        side.get_num_new_matched_tokens(waiting, 0)
    assert counted() == (2, 40, 2 * CHUNK)
    side.request_finished(waiting)
    side.get_num_new_matched_tokens(request("a", list(range(20))), 0)  # a new request, same id
    assert counted() == (3, 60, 3 * CHUNK)


def registered_worker(extension: WorkerExtension) -> WorkerSide:
    """A worker with ``extension``, its KV cache (2 layers, 8 float32 blocks) registered
    as a FLASH_ATTN engine's; the caller shuts it down."""
    config = load_config(
        {"chunk_size": CHUNK, "max_local_cpu_size": 0.01, "kernel_backend": "torch"}, env={}
    )
    worker = WorkerSide(config, EngineMetadata("m"), None, extensions=[extension])
    paged = PagedKV.empty(
        "vllm_hnd",
        num_layers=2,
        num_blocks=8,
        block_size=BLOCK,
        num_heads=2,
        head_size=8,
        dtype=torch.float32,
    )
    try:
        worker.register_kv_caches(
            {f"layer.{i}": t for i, t in enumerate(paged.tensors)}, "FLASH_ATTN"
        )
    except BaseException:
        worker.shutdown()
        raise
    return worker


def test_worker_runs_extension_specs_around_the_forward_pass() -> None:
    recorder = WorkerRecorder()
    worker = registered_worker(recorder)
    try:
        assert recorder.rank is not None and recorder.rank.engine is worker.engine
        assert recorder.rank.backend == "FLASH_ATTN"
        hashes = worker.engine.chunker.chunk_hashes(torch.arange(16))
        plan = StepPlan(
            saves=[SaveSpec("r", 0, hashes, 16, [0, 1, 2, 3])],
            extensions={"recorder": ["spec"], "other": ["not mine"]},
        )
        worker.start_load(plan)
        assert recorder.calls == [("before", ["spec"])]
        worker.wait_for_save()
        assert recorder.calls == [("before", ["spec"]), ("after", ["spec"])]
        assert worker.engine.lookup_hashes(hashes) == 2  # the core saves still ran
        assert worker.take_events() == "rank-events"
    finally:
        worker.shutdown()


class FailingFiller(WorkerExtension):
    """Was to fill blocks 1 and 2 before the forward pass, and could not."""

    name = "filler"

    def before_forward(self, specs: list) -> set[int]:
        return {1, 2} if specs else set()


def test_blocks_an_extension_could_not_fill_are_failed_loads() -> None:
    """Reported to vLLM as a plain load's failed blocks are, and the step's saves over
    them are not stored."""
    worker = registered_worker(FailingFiller())
    try:
        hashes = worker.engine.chunker.chunk_hashes(torch.arange(16))
        plan = StepPlan(
            saves=[SaveSpec("r", 0, hashes, 16, [0, 1, 2, 3])], extensions={"filler": ["spec"]}
        )
        worker.start_load(plan)
        worker.wait_for_save()
        assert worker.take_load_errors() == {1, 2}
        assert worker.engine.lookup_hashes(hashes) == 0
        worker.start_load(StepPlan())
        assert worker.take_load_errors() == set()
    finally:
        worker.shutdown()


def test_registry_names_each_feature_once() -> None:
    names = [extension.name for extension in EXTENSIONS]
    assert sorted(names) == sorted(set(names)) == ["blend", "kv_events"]
    for extension in EXTENSIONS:
        assert importlib.util.find_spec(extension.module) is not None, extension.module


def test_connector_works_with_cacheblend_deleted() -> None:
    """The connector's own tests pass with ``kvtier.blend`` unimportable and its
    registry line removed (``support.without_blend``)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)])}
    files = [
        "tests/test_vllm_scheduler_side.py",
        "tests/test_vllm_worker_side.py",
        "tests/test_vllm_extensions.py::test_scheduler_hooks_reach_every_extension",
        "tests/test_vllm_extensions.py::test_worker_runs_extension_specs_around_the_forward_pass",
    ]
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "support.without_blend",
            "-p",
            "no:cacheprovider",
            "-m",
            "not vllm",
            *files,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert " passed" in run.stdout and "error" not in run.stdout.splitlines()[-1]


def test_a_claimed_prompt_stores_no_chunk_while_it_decodes() -> None:
    """With ``save_decode_cache`` too: the chunks its generated tokens fill hold the
    claimed prompt's KV (an approximation when blended) and KV computed over it."""
    config = load_config({"chunk_size": CHUNK, "save_decode_cache": True}, env={})
    side = SchedulerSide(
        config, lambda hashes, load_from: 0, block_size=BLOCK, extensions=[Recorder()]
    )
    claimed = request("claim-1", list(range(20)))
    assert side.get_num_new_matched_tokens(claimed, 0) == (19, False)
    blocks = [0, 1, 2, 3, 4]
    side.update_state_after_alloc(claimed, blocks, 19)
    assert side.build_plan(new_step("claim-1", blocks, 19, 1)).saves == []
    for computed in range(20, 40):
        claimed.all_token_ids.append(1000 + computed)
        if computed % BLOCK == 0:
            blocks.append(len(blocks))
        cached = SimpleNamespace(
            req_ids=["claim-1"],
            resumed_req_ids=set(),
            new_block_ids=[([blocks[-1]],) if computed % BLOCK == 0 else None],
            num_computed_tokens=[computed],
        )
        step = SimpleNamespace(
            scheduled_new_reqs=[],
            scheduled_cached_reqs=cached,
            num_scheduled_tokens={"claim-1": 1},
            preempted_req_ids=set(),
        )
        assert side.build_plan(step).saves == [], f"a decode step at {computed} stored chunks"
