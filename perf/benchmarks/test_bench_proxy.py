"""Latency ``kvtier proxy`` adds to a request, against calling the engines directly.

Fake OpenAI engines (``tests/support/openai_fakes.py``, each in a process of its own,
answering at once: 16 SSE events with ``stream: true``, one JSON object without) stand
in for vLLM, so what is timed is HTTP and the proxy, not a model. Two proxies run as the
real command (``python -m kvtier proxy``, default log level: one log line per request
included), each in its own process:

- decode only (no ``--prefill``): one leg, the proxy's routing cost on its own;
- prefill + decode: the disaggregated request, two legs.

A client in this process (``http.client``, one keep-alive connection per target) sends
the same completion request to each target in turn, round after round, so the targets
share whatever the machine is doing; a figure is the median over rounds. Rows:

- ``proxy_decode_only`` vs a direct call to the decode engine;
- ``proxy_prefill_decode`` vs the client making both legs itself (the prefill request
  with ``max_tokens=1``, then the decode request): the proxy's own added time;
- ``proxy_prefill_decode`` vs a direct call to the decode engine alone: what a client
  sees compared to no disaggregation (with an instant fake prefill).

Each row's ``added_ms`` is its value minus its baseline (target: at most 2 ms).
"""

from __future__ import annotations

import http.client
import json
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

pytest.importorskip("aiohttp")

RESULTS_NAME = "proxy"
ROOT = Path(__file__).resolve().parents[2]
FAKE = ROOT / "tests" / "support" / "openai_fakes.py"
ROUNDS = 400
WARMUP = 40
CHUNKS = 16
PROMPT = "The quick brown fox jumps over the lazy dog. " * 24  # about 1 KiB
TARGET_ADDED_MS = 2.0
# The same request id on every call, so every way of serving gives the same bytes.
HEADERS = {"Content-Type": "application/json", "X-Request-Id": "bench"}


def _start(command: list[str], pattern: str, log: Path) -> tuple[subprocess.Popen, str]:
    """Start ``command``; wait for ``pattern`` (one group) on its stdout or its log."""
    with log.open("w") as sink:
        process = subprocess.Popen(
            command, cwd=ROOT, stdout=subprocess.PIPE, stderr=sink, text=True
        )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"{' '.join(command)} exited: {log.read_text()[-2000:]}")
        if pattern == "port":
            return process, f"http://127.0.0.1:{process.stdout.readline().strip()}"
        found = re.search(pattern, log.read_text())
        if found:
            return process, found.group(1)
        time.sleep(0.05)
    process.kill()
    pytest.fail(f"{' '.join(command)} did not start: {log.read_text()[-2000:]}")


@pytest.fixture(scope="module")
def targets(tmp_path_factory) -> Iterator[dict[str, str]]:
    """URLs: the fake ``prefill`` and ``decode`` engines and the two proxies."""
    logs = tmp_path_factory.mktemp("proxy-bench")
    processes, urls = [], {}
    try:
        for role in ("prefill", "decode"):
            command = [sys.executable, str(FAKE), "--name", role, "--chunks", str(CHUNKS)]
            process, urls[role] = _start(command, "port", logs / f"{role}.log")
            processes.append(process)
        proxies = {
            "proxy_decode_only": ["--decode", urls["decode"]],
            "proxy_prefill_decode": ["--prefill", urls["prefill"], "--decode", urls["decode"]],
        }
        for name, flags in proxies.items():
            command = [sys.executable, "-m", "kvtier", "proxy", "--port", "0", *flags]
            process, urls[name] = _start(
                command, r"listening on (http://\S+)", logs / f"{name}.log"
            )
            processes.append(process)
        yield urls
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(10)


class Client:
    """One keep-alive connection to ``url``; ``post`` returns the whole answer."""

    def __init__(self, url: str):
        host, port = url.removeprefix("http://").split(":")
        self.conn = http.client.HTTPConnection(host, int(port), timeout=30)

    def post(self, body: bytes) -> bytes:
        self.conn.request("POST", "/v1/completions", body=body, headers=HEADERS)
        response = self.conn.getresponse()
        data = response.read()
        assert response.status == 200, data[:500]
        return data

    def close(self) -> None:
        self.conn.close()


def _bodies(stream: bool) -> tuple[bytes, bytes]:
    """(the client's request, the prefill leg the client would send itself)."""
    request = {"model": "fake", "prompt": PROMPT, "max_tokens": 64, "stream": stream}
    prefill = {**request, "max_tokens": 1, "stream": False}
    return json.dumps(request).encode(), json.dumps(prefill).encode()


def _interleaved(calls: dict[str, Callable[[], object]]) -> dict[str, float]:
    """Median seconds of each call, run in turn round after round."""
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for round_ in range(WARMUP + ROUNDS):
        for name, call in calls.items():
            started = time.perf_counter()
            call()
            if round_ >= WARMUP:
                samples[name].append(time.perf_counter() - started)
    return {name: statistics.median(times) for name, times in samples.items()}


@pytest.fixture(scope="module", params=[False, True], ids=["json", "stream"])
def medians(request, targets) -> dict[str, float]:
    """Median seconds per way of serving one request, measured interleaved."""
    stream = request.param
    body, prefill_body = _bodies(stream)
    clients = {name: Client(url) for name, url in targets.items()}
    expected = clients["decode"].post(body)
    for name in ("proxy_decode_only", "proxy_prefill_decode"):
        assert clients[name].post(body) == expected, f"{name} changed the answer"

    def both_legs() -> None:
        clients["prefill"].post(prefill_body)
        clients["decode"].post(body)

    try:
        result = _interleaved(
            {
                "direct_decode": lambda: clients["decode"].post(body),
                "direct_prefill_then_decode": both_legs,
                "proxy_decode_only": lambda: clients["proxy_decode_only"].post(body),
                "proxy_prefill_decode": lambda: clients["proxy_prefill_decode"].post(body),
            }
        )
    finally:
        for client in clients.values():
            client.close()
    result["stream"] = stream
    return result


@pytest.mark.parametrize(
    ("path", "baseline"),
    [
        ("proxy_decode_only", "direct_decode"),
        ("proxy_prefill_decode", "direct_prefill_then_decode"),
        ("proxy_prefill_decode", "direct_decode"),
    ],
)
def test_proxy_added_latency(benchmark, record, medians, targets, path, baseline):
    stream = medians["stream"]
    body, _ = _bodies(stream)
    client = Client(targets[path])
    try:
        benchmark.pedantic(client.post, args=(body,), rounds=100, warmup_rounds=10)
    finally:
        client.close()
    value_ms, baseline_ms = medians[path] * 1e3, medians[baseline] * 1e3
    added_ms = value_ms - baseline_ms
    kind = "stream" if stream else "json"
    record(
        metric=f"{path}_latency_{kind}",
        value=value_ms,
        unit="ms",
        baseline=f"{baseline}_latency_{kind} (same run, interleaved)",
        baseline_value=baseline_ms,
        added_ms=added_ms,
        target_added_ms=TARGET_ADDED_MS,
        rounds=ROUNDS,
        sse_events=CHUNKS + 1 if stream else 0,
    )
    benchmark.extra_info["added_ms"] = added_ms
    print(
        f"\n{path} vs {baseline} ({kind}): {value_ms:.3f} ms vs {baseline_ms:.3f} ms, "
        f"added {added_ms:.3f} ms"
    )
