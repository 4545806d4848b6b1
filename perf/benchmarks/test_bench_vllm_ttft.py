"""Time to first token in a real vLLM engine (CPU build): a kvtier hit vs cold prefill,
and what kvtier costs on a pure-miss workload vs vLLM with no connector.

Model: the demo's random-weight Llama (8 layers, 16 heads / 4 KV heads, head size 64,
bf16); kvtier with 256-token chunks. TTFT is the wall time of a one-token greedy
generation.

Every engine runs in its own fresh process (``perf/benchmarks/vllm_ttft_run.py``), warms up there
(not timed), then times prompts it has never seen. The two configurations alternate, and
the order of each pair flips from one round to the next so that a drift of the machine's
load favours neither::

    round 0: none   kvtier      round 2: none   kvtier
    round 1: kvtier none        round 3: kvtier none

Both runs of a round serve the same prompts. A round's figure is the median over its
prompts; a row's value is the median over rounds, with the rounds' min and max beside it
(``spread``) and every round's figure (``rounds``). The miss-overhead ratio is kvtier /
no connector on those medians; ``paired_ratio`` gives the spread of the per-round ratios.
Cold vs hit comes from the kvtier runs: after the misses, vLLM's prefix cache is reset
and the same prompts are served again, so the hit can only come from kvtier.

Both configurations get the same CPU binding: vLLM's CPU build would otherwise give the
engine with a connector one more OpenMP thread on a 2-core machine (see the NOTE in
``perf/benchmarks/vllm_ttft_run.py``); every run records its binding and the test checks they match.

Results go to ``perf/results/<device>-vllm-ttft.json``.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

RESULTS_NAME = "vllm-ttft"
RUNNER = Path(__file__).with_name("vllm_ttft_run.py")
ROUNDS = 4  # runs per configuration
COMPARED_TOKENS = [1024, 2048]  # timed in both configurations: the miss overhead
PROMPTS = 2  # per compared length and run
HIT_ONLY_TOKENS = [4000]  # timed in the kvtier runs only: cold vs hit
HIT_ONLY_PROMPTS = 1  # per run; the rounds give the median
RUN_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def model():
    pytest.importorskip("vllm")
    from kvtier.demo_vllm import build_model

    # Built here, once, so that the runs never race to write it.
    return build_model(Path(tempfile.gettempdir()) / "kvtier-demo-llama-v1")


def _run(mode: str, round_: int, model: Path, out: Path) -> dict:
    """One fresh engine process; its timings (``perf/benchmarks/vllm_ttft_run.py``'s JSON)."""
    command = [
        sys.executable,
        str(RUNNER),
        f"--mode={mode}",
        "--tokens",
        *map(str, COMPARED_TOKENS),
        f"--prompts={PROMPTS}",
        f"--seed={round_}",
        f"--model={model}",
        f"--json={out}",
    ]
    if mode == "kvtier":
        command += ["--extra-tokens", *map(str, HIT_ONLY_TOKENS)]
        command += [f"--extra-prompts={HIT_ONLY_PROMPTS}"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(command)} exited with {proc.returncode}:\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def runs(model, tmp_path_factory) -> dict[str, list[dict]]:
    """``{"none": [...], "kvtier": [...]}``: one timings dict per round, in round order."""
    out_dir = tmp_path_factory.mktemp("vllm-ttft")
    results: dict[str, list[dict]] = {"none": [], "kvtier": []}
    start = time.perf_counter()
    for round_ in range(ROUNDS):
        order = ("none", "kvtier") if round_ % 2 == 0 else ("kvtier", "none")
        for mode in order:
            run = _run(mode, round_, model, out_dir / f"{round_}-{mode}.json")
            results[mode].append(run)
            misses = ", ".join(
                f"{n}: {statistics.median(s):.3f} s" for n, s in run["miss_s"].items()
            )
            print(f"\nround {round_} {mode:<6} startup {run['startup_s']:5.1f} s  miss {misses}")
    print(f"\nTTFT benchmark: {2 * ROUNDS} engine runs in {time.perf_counter() - start:.0f} s")
    return results


def _per_round(runs: list[dict], key: str, tokens: int) -> list[float]:
    """Each run's median TTFT (s) at ``tokens``."""
    return [statistics.median(run[key][str(tokens)]) for run in runs]


def _cached(runs: list[dict], key: str, tokens: int) -> list[int]:
    return [c for run in runs for c in run[key][str(tokens)]]


def _worker_cpus(run: dict) -> tuple[str, ...]:
    return tuple(sorted(run["thread_cpus"].get("VLLM::Worker", {})))


def _engine(runs: dict[str, list[dict]]) -> dict:
    """How the engines ran, for a row: vLLM, kvtier's config, the worker's CPU binding."""
    kvtier = runs["kvtier"][0]
    return {
        "vllm": kvtier["vllm"],
        "kvtier_config": kvtier["kvtier_config"],
        "reserved_cpus": kvtier["reserved_cpus"],
        "worker_cpus": list(_worker_cpus(kvtier)),
        "runs_per_config": ROUNDS,
    }


def _summary(rounds: list[float], baseline_rounds: list[float]) -> dict:
    """The extra fields of a row: both sides' per-round figures and their spread."""
    return {
        "rounds": rounds,
        "spread": [min(rounds), max(rounds)],
        "baseline_rounds": baseline_rounds,
        "baseline_spread": [min(baseline_rounds), max(baseline_rounds)],
    }


@pytest.mark.parametrize("tokens", COMPARED_TOKENS + HIT_ONLY_TOKENS)
def test_ttft_warm_vs_cold(runs, record, tokens):
    warm = _per_round(runs["kvtier"], "hit_s", tokens)
    cold = _per_round(runs["kvtier"], "miss_s", tokens)
    prompts = PROMPTS if tokens in COMPARED_TOKENS else HIT_ONLY_PROMPTS
    record(
        metric=f"ttft_warm_kvtier_{tokens}_tokens",
        value=statistics.median(warm),
        unit="s",
        baseline=f"ttft_cold_prefill_{tokens}_tokens",
        baseline_value=statistics.median(cold),
        prompts_per_round=prompts,
        **_summary(warm, cold),
        engine=_engine(runs),
    )
    loaded = _cached(runs["kvtier"], "hit_cached_tokens", tokens)
    assert min(loaded) > 0, f"{tokens}-token prompts: a hit loaded nothing from kvtier: {loaded}"


@pytest.mark.parametrize("tokens", COMPARED_TOKENS)
def test_ttft_miss_overhead_vs_no_connector(runs, record, tokens):
    kvtier = _per_round(runs["kvtier"], "miss_s", tokens)
    none = _per_round(runs["none"], "miss_s", tokens)
    paired = [k / n for k, n in zip(kvtier, none, strict=True)]
    record(
        metric=f"ttft_miss_kvtier_{tokens}_tokens",
        value=statistics.median(kvtier),
        unit="s",
        baseline=f"ttft_no_connector_{tokens}_tokens",
        baseline_value=statistics.median(none),
        prompts_per_round=PROMPTS,
        **_summary(kvtier, none),
        engine=_engine(runs),
        paired_ratio={"median": statistics.median(paired), "spread": [min(paired), max(paired)]},
    )
    # The CPU sets the worker's threads run on (not their count: kvtier adds threads).
    bindings = {mode: {_worker_cpus(run) for run in runs[mode]} for mode in runs}
    assert len(bindings["none"] | bindings["kvtier"]) == 1, (
        f"the engines' worker threads were bound differently: {bindings}"
    )
    for mode in ("none", "kvtier"):
        cached = _cached(runs[mode], "miss_cached_tokens", tokens)
        assert max(cached) == 0, f"{mode}, {tokens}-token prompts: not a pure miss: {cached}"
