"""One ``kvtier serve`` shared by two real vLLM engines (CPU build), each in a process of
its own (``vllm_node_engine.py``), with no CPU tier of their own (``local_cpu: false``):
every hit is served by the node server.

- engine B hits on prompts only engine A served, and a restarted A hits too; outputs
  equal an engine without any connector, and the server's ``/lookup`` agrees with what
  the engines load;
- the server SIGKILLed mid-run: both engines keep serving correct outputs (misses) with
  no request stalled; the server started again: hits resume without restarting engines.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from conftest import BLOCK, CHUNK
from support.engine_process import EngineProcess
from support.engines import expected_loaded
from support.kvtier_server import KVTierServerProcess
from support.tiers import wait_until

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

TIMEOUT_MS = 1000
# What a request may take beyond its cold time while the server is down: a refused
# connection is an immediate miss, and nothing kvtier does waits longer than the timeout.
STALL_BOUND_S = 30


class Node:
    """A kvtier server and the engines of one node."""

    def __init__(self, model: Path, log_dir: Path):
        self.model = model
        self.log_dir = log_dir
        self.server = KVTierServerProcess("--chunk-size", str(CHUNK), admin=True)
        self.extra = {
            "chunk_size": CHUNK,
            "local_cpu": False,
            "max_local_cpu_size": 0.25,
            "remote_url": self.server.url,
            "remote_timeout_ms": TIMEOUT_MS,
            "remote_reconnect_max_ms": 500,
        }
        self.engines: dict[str, EngineProcess] = {}

    def start(self, *names: str) -> None:
        for name in names:
            engine_id = f"kvtier-node-{name}-{int(time.time() * 1000) % 10**8}"
            log = self.log_dir / f"{engine_id}.log"
            self.engines[name] = EngineProcess(self.model, engine_id, self.extra, log)
        for name in names:
            self.engines[name].wait_ready()

    def restart(self, name: str) -> None:
        self.engines.pop(name).close()
        self.start(name)

    def server_stats(self) -> dict:
        return self.server.admin("/stats")[1]

    def close(self) -> None:
        for engine in self.engines.values():
            engine.close()
        self.server.close()


@pytest.fixture(scope="module")
def node(model_a, tmp_path_factory):
    node = Node(model_a, tmp_path_factory.mktemp("node-logs"))
    try:
        node.start("A", "B")
        yield node
    finally:
        node.close()


def distinct_chunks(prompts) -> int:
    """Chunks stored for ``prompts``: whole chunks, a shared prefix's once."""
    return len({tuple(p[: (i + 1) * CHUNK]) for p in prompts for i in range(len(p) // CHUNK)})


def assert_outputs(results, reference, prompts, *, loaded: bool) -> None:
    for i, ((ids, cached), want, prompt) in enumerate(
        zip(results, reference, prompts, strict=True)
    ):
        assert ids == want.token_ids, f"prompt {i}: output differs from no connector"
        expected = expected_loaded(len(prompt), chunk_size=CHUNK, block_size=BLOCK) if loaded else 0
        assert cached == expected, (
            f"prompt {i} ({len(prompt)} tokens): {cached} tokens not computed"
        )


def test_engine_b_hits_what_engine_a_served_and_a_restarted_a_hits_too(
    node, prompts_a, reference_a
):
    a, b = node.engines["A"], node.engines["B"]
    cold, _ = a.generate(prompts_a)
    assert_outputs(cold, reference_a["single"], prompts_a, loaded=False)
    stored = distinct_chunks(prompts_a)
    wait_until(lambda: node.server_stats().get("puts", 0) >= stored, timeout=60)
    assert node.server_stats()["puts"] == stored  # nothing stored twice

    for prompt in prompts_a:  # what a router learns from the server before routing
        body = {"model": str(node.model), "tokens": prompt}
        held = node.server.admin("/lookup", "POST", body=body)[1]["cached_tokens"]
        assert held == len(prompt) // CHUNK * CHUNK

    warm, _ = b.generate(prompts_a)
    assert_outputs(warm, reference_a["single"], prompts_a, loaded=True)
    stats = b.call("stats")
    assert stats["kvtier_get_hits"] > 0 and stats.get("kvtier_put_chunks", 0) == 0

    node.restart("A")
    again, _ = node.engines["A"].generate(prompts_a)
    assert_outputs(again, reference_a["single"], prompts_a, loaded=True)
    assert node.server_stats()["puts"] == stored


def test_a_killed_server_is_a_miss_and_hits_resume_when_it_returns(
    node, shared_prefix_prompts, reference_a
):
    a, b = node.engines["A"], node.engines["B"]
    prompts, reference = shared_prefix_prompts, reference_a["shared"]
    node.server.kill()
    for engine in (a, b):
        engine.call("reset")
        results, seconds = engine.generate(prompts)
        assert [ids for ids, _ in results] == [r.token_ids for r in reference]
        assert seconds < STALL_BOUND_S, f"{seconds:.1f} s with the server down"
    assert b.call("stats").get("kvtier_puts_dropped_unavailable", 0) > 0

    node.server.start()  # the same port, empty memory
    reconnected = lambda e: e.call("stats").get("kvtier_reconnects", 0) >= 1  # noqa: E731
    wait_until(lambda: reconnected(a) and reconnected(b), timeout=60)
    b.call("reset")  # vLLM's own cache emptied: B asks kvtier, misses, and stores
    results, _ = b.generate(prompts)
    assert [ids for ids, _ in results] == [r.token_ids for r in reference]
    stored = distinct_chunks(prompts)
    wait_until(lambda: node.server_stats().get("puts", 0) >= stored, timeout=60)

    a.call("reset")
    before = a.call("stats").get("kvtier_get_hits", 0)
    results, _ = a.generate(prompts)
    assert_outputs(results, reference, prompts, loaded=True)
    assert a.call("stats")["kvtier_get_hits"] > before
