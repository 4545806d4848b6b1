"""Time to first token of engine B on prompts only engine A served, both behind one
``kvtier serve`` on this host, vs A's own cold prefill of the same prompts.

Model and timing as in ``test_bench_vllm_ttft.py`` (the demo's random-weight Llama,
256-token chunks, TTFT = wall time of a one-token greedy generation, every engine in a
fresh process run by ``perf/benchmarks/vllm_ttft_run.py``). Both engines have no CPU tier of their
own (``local_cpu: false``): the node server is their only tier. A round:

1. engine A serves the round's prompts (timed: its cold prefill, the baseline) and shuts
   down, which flushes its stores to the server;
2. engine B, a new process, serves the same prompts (timed: every token it did not
   compute came from the server).

A row's value is the median over rounds of B's TTFT, its baseline the median of A's.

Disaggregated prefill, through the same server: per round a ``kv_producer`` serves the
round's prompts, then a ``kv_consumer`` serves them (timed: its TTFT with the producer's
KV), then another ``kv_consumer`` serves prompts nobody stored (timed: the consumer's
own cold prefill, the baseline).

Results go to ``perf/results/<device>-vllm-ttft.json`` beside the single-engine TTFT rows.
"""

from __future__ import annotations

import json
import socket
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
ROUNDS = 3
TOKENS = [1024, 4000]
RUN_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def model():
    pytest.importorskip("vllm")
    from kvtier.demo_vllm import build_model

    return build_model(Path(tempfile.gettempdir()) / "kvtier-demo-llama-v1")


@pytest.fixture(scope="module")
def server_url():
    """A ``kvtier serve`` on a free loopback port, answering PING."""
    from kvtier.storage.blob_store import StoreUnavailable
    from kvtier.storage.node_store import KVTierStore

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "kvtier.cli", "serve", "--port", str(port)]
    command += ["--max-local-cpu-size", "4"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = KVTierStore("127.0.0.1", port, namespace="bench")
    deadline = time.monotonic() + 60
    while True:
        try:
            client.ping()
            break
        except StoreUnavailable:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                pytest.fail("kvtier serve did not start")
            time.sleep(0.1)
    client.close()
    yield f"kvtier://127.0.0.1:{port}"
    process.terminate()
    process.wait(30)


def _run(round_: int, model: Path, url: str, out: Path, kv_role: str = "kv_both") -> dict:
    extra = {"local_cpu": False, "remote_url": url, "remote_timeout_ms": 5000}
    command = [
        sys.executable,
        str(RUNNER),
        "--mode=kvtier",
        "--tokens",
        *map(str, TOKENS),
        "--prompts=1",
        f"--seed={round_}",
        f"--model={model}",
        f"--json={out}",
        f"--kvtier-extra={json.dumps(extra)}",
        f"--kv-role={kv_role}",
    ]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(command)} exited with {proc.returncode}:\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def rounds(model, server_url, tmp_path_factory) -> list[tuple[dict, dict]]:
    """``(engine A's run: cold, engine B's run: via the server)`` per round."""
    out = tmp_path_factory.mktemp("server-ttft")
    pairs = []
    for round_ in range(ROUNDS):
        a = _run(round_, model, server_url, out / f"{round_}-a.json")
        b = _run(round_, model, server_url, out / f"{round_}-b.json")
        pairs.append((a, b))
    return pairs


@pytest.fixture(scope="module")
def pd_rounds(model, server_url, tmp_path_factory) -> list[tuple[dict, dict]]:
    """``(a consumer's run on new prompts: cold, a consumer's run on the prompts a
    producer just served)`` per round."""
    out = tmp_path_factory.mktemp("pd-ttft")
    pairs = []
    for round_ in range(ROUNDS):
        seed = 100 + round_  # prompts none of the runs above stored
        _run(seed, model, server_url, out / f"{round_}-p.json", "kv_producer")
        hit = _run(seed, model, server_url, out / f"{round_}-c.json", "kv_consumer")
        cold = _run(seed + 1000, model, server_url, out / f"{round_}-cold.json", "kv_consumer")
        pairs.append((cold, hit))
    return pairs


def _record_warm_vs_cold(record, pairs, tokens: int, metric: str, baseline: str):
    """Record the median over rounds of the warm runs' TTFT against the cold runs'; the
    tokens vLLM reported cached in the cold and in the warm runs."""
    key = str(tokens)
    cold = [statistics.median(c["miss_s"][key]) for c, _ in pairs]
    warm = [statistics.median(w["miss_s"][key]) for _, w in pairs]
    record(
        metric=metric,
        value=statistics.median(warm),
        unit="s",
        baseline=baseline,
        baseline_value=statistics.median(cold),
        rounds=warm,
        spread=[min(warm), max(warm)],
        baseline_rounds=cold,
        baseline_spread=[min(cold), max(cold)],
        engine={"vllm": pairs[0][1]["vllm"], "kvtier_config": pairs[0][1]["kvtier_config"]},
    )
    cold_cached = [n for c, _ in pairs for n in c["miss_cached_tokens"][key]]
    warm_cached = [n for _, w in pairs for n in w["miss_cached_tokens"][key]]
    return cold_cached, warm_cached


@pytest.mark.parametrize("tokens", TOKENS)
def test_ttft_engine_b_via_server_vs_cold_prefill(rounds, record, tokens):
    cold_cached, loaded = _record_warm_vs_cold(
        record,
        rounds,
        tokens,
        f"ttft_engine_b_via_server_{tokens}_tokens",
        f"ttft_cold_prefill_engine_a_{tokens}_tokens",
    )
    assert max(cold_cached) == 0, f"engine A was not cold: {cold_cached}"
    assert min(loaded) >= tokens // 256 * 256 - 256, f"B loaded too little: {loaded}"


@pytest.mark.parametrize("tokens", TOKENS)
def test_ttft_pd_consumer_vs_its_cold_prefill(pd_rounds, record, tokens):
    cold_cached, loaded = _record_warm_vs_cold(
        record,
        pd_rounds,
        tokens,
        f"ttft_pd_consumer_{tokens}_tokens",
        f"ttft_pd_consumer_cold_prefill_{tokens}_tokens",
    )
    assert max(cold_cached) == 0, f"the cold consumer loaded: {cold_cached}"
    # producers store partial last chunks: all but the last token's block is loaded
    assert min(loaded) >= tokens - 64, f"the consumer loaded too little: {loaded}"
