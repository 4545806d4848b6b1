"""Cache-aware routing with real vLLM CPU engines: how much of a shared-prefix workload's
reusable prompt the engines find cached, and its time to first token, for ``kvtier proxy``
with ``--policy cache_aware`` against ``round_robin`` and ``least_loaded``.

Setup (``tests/support/routing.py``): two ``kv_both`` vLLM OpenAI servers, the tests' tiny
random-weight Llama with its word tokenizer, block 32, a small KV cache (``KV_CACHE_BYTES``:
96 blocks, so prefixes are evicted and come back from kvtier), each with its own kvtier
CPU tier (chunk 64), KV events and ``--enable-prompt-tokens-details``, each engine's
threads bound to a core of its own (``VLLM_CPU_OMP_THREADS_BIND``; vLLM's default binds
both to every core). Scenarios:

- ``local``: each instance only has its own CPU tier;
- ``shared``: every instance also has one ``kvtier serve`` as its remote tier, so an
  instance can load what any instance stored (the router should weigh load more).

Workload: ``PROMPTS`` system prompts of ``SHARED`` tokens (templated: ``system``, the
words, ``user``: 4 chunks), each followed by ``QUESTIONS`` different questions, in an
order shuffled with a fixed seed, sent as chat requests streamed through the proxy,
``CONCURRENCY`` at a time. Each engine first serves a few requests of that shape (its
first ones are slow). Then ``ROUNDS`` rounds, the policies in a rotated order in each (the
machine is shared: load from elsewhere weighs on every policy alike); each policy's run
gets system prompts of its own (no run finds another's prefixes), after a reset of both
engines' caches (vLLM's and kvtier's local ones), and a proxy of its own. A run sends the
workload twice: the first pass is measured; the second (the same bodies, whose token ids
the cache_aware proxy has cached) times the proxy without the ``/tokenize`` round trip.

Figures, per scenario and policy:

- cached prompt tokens (the answers' ``usage.prompt_tokens_details.cached_tokens``, which
  counts vLLM's prefix-cache and kvtier's hits) as a share of the ideal: every repeat of
  a system prompt finds its ``SHARED`` tokens cached, a first occurrence none;
- mean and p90 TTFT (send to the first SSE event; vLLM sends it with the first token);
- the proxy's overhead per request (``kvtier_proxy_overhead_seconds``: its time besides
  the engine leg) for cache_aware against round_robin: in the first pass (a ``/tokenize``
  round trip per request: every body is new) and in the second (none); the ``/tokenize``
  round trip timed apart (the bodies posted to an idle engine, as the proxy posts them);
  the decision's own cost (``kvtier_proxy_route_seconds``).

Results go to ``perf/results/<device>-routing.json``.
"""

from __future__ import annotations

import http.client
import json
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

RESULTS_NAME = "routing"
BLOCK, CHUNK = 32, 64
KV_CACHE_BYTES = 3 << 20  # vLLM's own cache: 3072 tokens of this model, 96 blocks
PROMPTS, QUESTIONS = 8, 8
SYSTEM_WORDS = 254  # with "system" and "user": 256 tokens shared, 8 blocks, 4 chunks
SHARED = SYSTEM_WORDS + 2
QUESTION_WORDS = 40
CONCURRENCY = 2
ROUNDS = 3
WARMUP_REQUESTS = 4
POLICIES = ["cache_aware", "round_robin", "least_loaded"]
TARGET_SHARE = 0.9
TARGET_ADDED_MS = 2.0


@dataclass
class Sent:
    system: int  # which system prompt
    ttft_s: float
    cached: int  # usage.prompt_tokens_details.cached_tokens


@dataclass
class Run:
    """A policy's runs, rounds together."""

    sent: list[Sent] = field(default_factory=list)  # the first passes' requests
    overhead: list[float] = field(default_factory=lambda: [0.0, 0.0])  # per pass: s, count
    repeat_overhead: list[float] = field(default_factory=lambda: [0.0, 0.0])
    route: list[float] = field(default_factory=lambda: [0.0, 0.0])
    predicted: float = 0.0  # kvtier_proxy_predicted_cached_tokens_total, first passes
    actual: float = 0.0  # kvtier_proxy_actual_cached_tokens_total, first passes
    ideal: int = 0
    bodies: list[dict] = field(default_factory=list)

    @property
    def share(self) -> float:
        return sum(s.cached for s in self.sent) / self.ideal

    def ttft_ms(self) -> list[float]:
        return sorted(s.ttft_s * 1e3 for s in self.sent)


def mean(pair: list[float]) -> float | None:
    return pair[0] / pair[1] if pair[1] else None


def ideal(sent: list[Sent]) -> int:
    """Cached tokens when every repeat of a system prompt hits: its whole blocks."""
    seen: set[int] = set()
    total = 0
    for s in sent:
        total += SHARED // BLOCK * BLOCK if s.system in seen else 0
        seen.add(s.system)
    return total


def p90(values: list[float]) -> float:
    return statistics.quantiles(values, n=10)[-1]


def stream_chat(url: str, body: dict) -> tuple[float, dict]:
    """POST a streamed chat request: (seconds to its first SSE event, the usage its last
    chunk carries)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=300)
    try:
        payload = {**body, "stream": True, "stream_options": {"include_usage": True}}
        started = time.perf_counter()
        conn.request(
            "POST",
            "/v1/chat/completions",
            body=json.dumps(payload),
            headers={"Content-Type": "application/json"},
        )
        response = conn.getresponse()
        assert response.status == 200, response.read()[:500]
        ttft, usage = None, {}
        for line in response:
            if not line.startswith(b"data: "):
                continue
            if ttft is None:
                ttft = time.perf_counter() - started
            data = line[len(b"data: ") :].strip()
            if data != b"[DONE]":
                usage = json.loads(data).get("usage") or usage
        assert ttft is not None, "no SSE event"
        return ttft, usage
    finally:
        conn.close()


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    pytest.importorskip("vllm")
    from support.models import add_word_tokenizer, make_tiny_llama

    return add_word_tokenizer(make_tiny_llama(tmp_path_factory.mktemp("models") / "llama-chat"))


class Deployment:
    """Two routed instances (and, for ``shared``, their ``kvtier serve``)."""

    def __init__(self, scenario: str, model: Path, logs: Path):
        from support.kvtier_server import KVTierServerProcess
        from support.routing import RoutedInstance

        self.model, self.logs = str(model), logs
        self.node = None
        extra = {"chunk_size": CHUNK, "max_local_cpu_size": 0.25}
        if scenario == "shared":
            self.node = KVTierServerProcess("--chunk-size", str(CHUNK))
            extra |= {"remote_url": self.node.url, "remote_timeout_ms": 5000}
        self.instances = [
            RoutedInstance(
                model,
                logs / f"{scenario}-engine-{i}.log",
                extra,
                block_size=BLOCK,
                kv_cache_memory_bytes=KV_CACHE_BYTES,
                env={"VLLM_CPU_OMP_THREADS_BIND": str(i % os.cpu_count())},
            )
            for i in range(2)
        ]
        for instance in self.instances:
            instance.server.wait_healthy()

    def warm_up(self) -> None:
        """A few requests of the workload's shape to each engine, then a cache reset."""
        from support.routing import chat, shared_prefix_workload

        workload = shared_prefix_workload(
            1, WARMUP_REQUESTS, system_words=SYSTEM_WORDS, question_words=QUESTION_WORDS, seed=7
        )
        for instance in self.instances:
            for _, system, question in workload:
                stream_chat(instance.url, chat(self.model, system, question))

    def run(self, policy: str, seed: int, into: Run) -> None:
        """Reset both engines, then the workload (system prompts of ``seed``) twice
        through a proxy with ``policy``; add the figures to ``into``."""
        from support.routing import (
            ProxyProcess,
            cache_aware_flags,
            chat,
            shared_prefix_workload,
        )
        from support.vllm_openai import metric

        for instance in self.instances:
            instance.server.reset_prefix_cache(external=True)
        if policy == "cache_aware":
            flags = cache_aware_flags(self.instances)
        else:
            flags = ["--policy", policy]
            for instance in self.instances:
                flags += ["--decode", instance.url]
        proxy = ProxyProcess(flags, self.logs / f"proxy-{policy}-{seed}.log")
        workload = shared_prefix_workload(
            PROMPTS,
            QUESTIONS,
            system_words=SYSTEM_WORDS,
            question_words=QUESTION_WORDS,
            seed=seed,
        )
        bodies = [chat(self.model, system, question) for _, system, question in workload]
        texts = []
        try:
            with ThreadPoolExecutor(CONCURRENCY) as pool:
                for _ in range(2):
                    answers = list(pool.map(lambda body: stream_chat(proxy.url, body), bodies))
                    texts.append(proxy.metrics_text())
                    if len(texts) == 1:
                        first = answers
        finally:
            proxy.close()
        sent = [
            Sent(i, ttft, int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0))
            for (i, _, _), (ttft, usage) in zip(workload, first, strict=True)
        ]
        into.sent += sent
        into.ideal += ideal(sent)
        into.bodies += bodies

        def total(text: str, name: str) -> tuple[float, float]:
            return metric(text, f"{name}_sum"), metric(text, f"{name}_count")

        overhead = [total(text, "kvtier_proxy_overhead_seconds") for text in texts]
        for k in range(2):
            into.overhead[k] += overhead[0][k]
            into.repeat_overhead[k] += overhead[1][k] - overhead[0][k]
            into.route[k] += total(texts[0], "kvtier_proxy_route_seconds")[k]
        into.predicted += metric(texts[0], "kvtier_proxy_predicted_cached_tokens_total")
        into.actual += metric(texts[0], "kvtier_proxy_actual_cached_tokens_total")

    def tokenize_s(self, bodies: list[dict]) -> float:
        """Mean seconds of a ``/tokenize`` round trip for these chat bodies, posted to the
        first engine as the proxy posts them."""
        from support.vllm_openai import post_json

        times = []
        for body in bodies:
            request = {"model": body["model"], "messages": body["messages"]}
            request["add_generation_prompt"] = True
            started = time.perf_counter()
            post_json(self.instances[0].url + "/tokenize", request)
            times.append(time.perf_counter() - started)
        return statistics.mean(times)

    def close(self) -> None:
        for instance in self.instances:
            instance.server.close()
        if self.node is not None:
            self.node.close()


@pytest.fixture(scope="module", params=["local", "shared"])
def runs(request, model, tmp_path_factory) -> tuple[str, dict[str, Run], float]:
    """(scenario, each policy's runs, the /tokenize round trip in s)."""
    scenario = request.param
    deployment = Deployment(scenario, model, tmp_path_factory.mktemp(f"routing-{scenario}"))
    result = {policy: Run() for policy in POLICIES}
    try:
        deployment.warm_up()
        for round_ in range(ROUNDS):
            for k in range(len(POLICIES)):
                policy = POLICIES[(round_ + k) % len(POLICIES)]
                seed = 1000 * round_ + 100 * POLICIES.index(policy) + (scenario == "shared")
                deployment.run(policy, seed, result[policy])
        tokenize = deployment.tokenize_s(result["cache_aware"].bodies)
    finally:
        deployment.close()
    return scenario, result, tokenize


def test_cached_share_and_ttft_by_policy(runs, record):
    scenario, result, _ = runs
    baseline = result["round_robin"]
    common = {
        "scenario": scenario,
        "requests": len(baseline.sent),
        "rounds": ROUNDS,
        "system_prompts": PROMPTS,
        "questions_each": QUESTIONS,
        "shared_tokens": SHARED,
        "concurrency": CONCURRENCY,
        "engines": 2,
        "kv_cache_bytes": KV_CACHE_BYTES,
    }
    for policy, run in result.items():
        ttft = run.ttft_ms()
        extra = {}
        if policy == "cache_aware":
            extra = {
                "target": TARGET_SHARE,
                "predicted_cached_tokens": run.predicted,
                "actual_cached_tokens": run.actual,
            }
        if policy == "round_robin":
            share_baseline = ("ideal (every repeat of a system prompt hits)", 1.0)
        else:
            share_baseline = ("round_robin (same run)", baseline.share)
        record(
            metric=f"routing_cached_share_{policy}_{scenario}",
            value=run.share,
            unit="share of ideal",
            baseline=share_baseline[0],
            baseline_value=share_baseline[1],
            cached_tokens=sum(s.cached for s in run.sent),
            ideal_tokens=run.ideal,
            **common,
            **extra,
        )
        record(
            metric=f"routing_ttft_mean_{policy}_{scenario}",
            value=statistics.mean(ttft),
            unit="ms",
            baseline="round_robin mean TTFT (same run)",
            baseline_value=statistics.mean(baseline.ttft_ms()),
            **common,
        )
        record(
            metric=f"routing_ttft_p90_{policy}_{scenario}",
            value=p90(ttft),
            unit="ms",
            baseline="round_robin p90 TTFT (same run)",
            baseline_value=p90(baseline.ttft_ms()),
            **common,
        )
        print(
            f"\n{scenario:>6} {policy:<12} cached {run.share:.3f} of ideal, TTFT mean "
            f"{statistics.mean(ttft):.1f} ms, p90 {p90(ttft):.1f} ms"
        )
    if scenario == "local":
        assert result["cache_aware"].share >= TARGET_SHARE, result["cache_aware"].share


def test_proxy_overhead_against_round_robin(runs, record):
    scenario, result, tokenize_s = runs
    if scenario != "local":
        pytest.skip("measured once, in the local scenario")
    aware, baseline = result["cache_aware"], result["round_robin"]
    decision_us = mean(aware.route) * 1e6
    common = {"requests": len(aware.sent), "rounds": ROUNDS, "scenario": scenario}
    rr_ms = mean(baseline.overhead) * 1e3
    tokenize_ms = tokenize_s * 1e3
    record(
        metric="routing_tokenize_round_trip_ms",
        value=tokenize_ms,
        unit="ms",
        baseline="round_robin proxy overhead per request (same run)",
        baseline_value=rr_ms,
        note="the workload's chat bodies posted to an idle engine's /tokenize by the client",
        **common,
    )
    aware_ms = mean(aware.overhead) * 1e3
    record(
        metric="routing_proxy_overhead_cache_aware_ms",
        value=aware_ms,
        unit="ms",
        baseline="round_robin proxy overhead per request (same run)",
        baseline_value=rr_ms,
        added_ms=aware_ms - rr_ms,
        decision_us=decision_us,
        includes="a /tokenize round trip per request (every body is new)",
        **common,
    )
    repeat_ms = mean(aware.repeat_overhead) * 1e3
    rr_repeat_ms = mean(baseline.repeat_overhead) * 1e3
    record(
        metric="routing_proxy_overhead_cache_aware_without_tokenize_ms",
        value=repeat_ms,
        unit="ms",
        baseline="round_robin proxy overhead per request, second pass (same run)",
        baseline_value=rr_repeat_ms,
        added_ms=repeat_ms - rr_repeat_ms,
        target_added_ms=TARGET_ADDED_MS,
        decision_us=decision_us,
        includes="the second pass: the same bodies, token ids cached in the proxy",
        **common,
    )
    print(
        f"\nproxy overhead: cache_aware {aware_ms:.2f} ms with /tokenize, {repeat_ms:.2f} ms "
        f"without; round_robin {rr_ms:.2f} / {rr_repeat_ms:.2f} ms; /tokenize alone "
        f"{tokenize_ms:.2f} ms; decision {decision_us:.0f} us"
    )
    assert repeat_ms - rr_repeat_ms <= TARGET_ADDED_MS, (repeat_ms, rr_repeat_ms)
