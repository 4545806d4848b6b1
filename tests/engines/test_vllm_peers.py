"""Two nodes with no shared store: ``kvtier serve`` a and b, each the other's peer, and
real ``vllm serve`` engines (CPU build) on different servers: engine A, a
``kv_producer``, on server a; engine B, a ``kv_consumer``, on server b; ``kvtier proxy``
in front of them (the topology of docs/disaggregated.md, "PD across nodes").

- B hits what only A computed: A's KV is stored on server a only, B's lookups and loads
  go to server b, which asks a and pulls the chunks (``--peer-transport tcp`` on b);
  B's answers equal A's, and a producer never loads, so A's answers are those of an
  engine without any connector;
- through the proxy: A prefills, B decodes with the KV server b pulled from server a;
- server b restarted with ``--peer-transport auto``: B's loads are NIXL READs from
  server a's pool (skipped without NIXL).

B never stores (a consumer), so whatever server b holds was pulled from server a.
"""

from __future__ import annotations

import pytest
from conftest import BLOCK, CHUNK
from support.engines import expected_loaded, kv_transfer_config, prompts_of
from support.kvtier_server import KVTierServerProcess, free_port, nixl_installed
from support.models import add_word_tokenizer, make_tiny_llama
from support.routing import ProxyProcess
from support.tiers import wait_until
from support.vllm_openai import VllmServer, post_json

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]


HITS = "vllm:external_prefix_cache_hits_total"


class Nodes:
    """Servers a and b (peers of each other), A on a, B on b, and the proxy."""

    def __init__(self, tmp_path_factory):
        model_dir = tmp_path_factory.mktemp("models") / "llama-peers"
        self.model = str(add_word_tokenizer(make_tiny_llama(model_dir)))
        logs = tmp_path_factory.mktemp("peers-logs")
        port_a, port_b = free_port(), free_port()
        common = ("--chunk-size", str(CHUNK), "--max-local-cpu-size", "0.25")
        self.server_a = KVTierServerProcess(
            *common, "--peer", f"kvtier://127.0.0.1:{port_b}", admin=True, port=port_a
        )
        self.server_b = KVTierServerProcess(
            *common, "--peer", self.server_a.url, "--peer-transport", "tcp", admin=True,
            port=port_b,
        )  # fmt: skip
        self.engines = []
        self.proxy: ProxyProcess | None = None
        for role, server in (("kv_producer", self.server_a), ("kv_consumer", self.server_b)):
            extra = {
                "chunk_size": CHUNK,
                "local_cpu": False,
                "max_local_cpu_size": 0.25,
                "remote_url": server.url,
                "remote_timeout_ms": 5000,
                "remote_reconnect_max_ms": 500,
            }
            self.engines.append(
                VllmServer(
                    model_dir,
                    logs / f"{role}.log",
                    kv_transfer=kv_transfer_config(extra, kv_role=role),
                    tokenizer=True,
                    block_size=BLOCK,
                )
            )
        self.a, self.b = self.engines
        self.a.wait_healthy()
        self.b.wait_healthy()
        self.proxy = ProxyProcess(
            ["--prefill", self.a.url, "--decode", self.b.url], logs / "proxy.log"
        )
        self.url = self.proxy.url

    def stats(self, server: KVTierServerProcess) -> dict:
        return server.admin("/stats")[1]

    def close(self) -> None:
        if self.proxy is not None:
            self.proxy.stop()
        for engine in self.engines:
            engine.close()
        self.server_a.close()
        self.server_b.close()


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    pytest.importorskip("vllm")
    deployment = Nodes(tmp_path_factory)
    try:
        yield deployment
    finally:
        deployment.close()


def word_prompts(lengths: list[int], seed: int) -> list[list[int]]:
    """Prompts of plain words (ids 6..: no special tokens)."""
    return [[t + 6 for t in p] for p in prompts_of(lengths, seed=seed, vocab=500)]


def complete(url: str, model: str, prompt: list[int]) -> str:
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0}
    body |= {"ignore_eos": True}
    text = post_json(url + "/v1/completions", body)["choices"][0]["text"]
    assert text
    return text


def loaded_by_b(prompt: list[int]) -> int:
    """What a consumer loads: every whole block but the last token's (producers store
    partial last chunks)."""
    return expected_loaded(len(prompt), chunk_size=CHUNK, block_size=BLOCK, partial=True)


def test_engine_b_hits_what_only_engine_a_computed(nodes):
    prompts = word_prompts([40, 128, 300], seed=51)
    for i, prompt in enumerate(prompts):
        direct = complete(nodes.a.url, nodes.model, prompt)  # computed, stored on a
        hits = nodes.b.metric(HITS)
        text = complete(nodes.b.url, nodes.model, prompt)
        assert text == direct, f"prompt {i} ({len(prompt)} tokens): B's answer differs"
        assert nodes.b.metric(HITS) - hits == loaded_by_b(prompt), f"prompt {i}"
    b, a = nodes.stats(nodes.server_b), nodes.stats(nodes.server_a)
    assert b.get("puts", 0) == 0 and a["puts"] > 0, "server b was given KV it did not pull"
    assert b["peer_hits"] == b["memory_blobs"] > 0
    assert b["peer_bytes_tcp"] > 0 and b.get("peer_bytes_nixl", 0) == 0
    assert a.get("peer_hits", 0) == 0, "server a pulled from b"


def test_pd_across_nodes_through_the_proxy(nodes):
    (prompt,) = word_prompts([300], seed=52)
    hits, pulled = nodes.b.metric(HITS), nodes.stats(nodes.server_b)["peer_hits"]
    text = complete(nodes.url, nodes.model, prompt)
    assert nodes.b.metric(HITS) - hits == loaded_by_b(prompt)
    assert nodes.stats(nodes.server_b)["peer_hits"] > pulled
    assert text == complete(nodes.a.url, nodes.model, prompt)


def test_pulls_are_nixl_reads_once_server_b_may_use_nixl(nodes):
    if not nixl_installed():
        pytest.skip("NIXL is not installed: pulls stay on TCP (the test above)")
    server_b = nodes.server_b
    server_b.kill()
    transport = server_b.args.index("--peer-transport") + 1
    server_b.args[transport] = "auto"
    server_b.start()  # the same port, empty memory
    # B finds its connection broken at its next request (a miss), then reconnects
    complete(nodes.b.url, nodes.model, word_prompts([100], seed=54)[0])
    wait_until(lambda: nodes.stats(server_b).get("clients_connected", 0) >= 1, timeout=60)
    (prompt,) = word_prompts([300], seed=53)
    hits = nodes.b.metric(HITS)
    text = complete(nodes.url, nodes.model, prompt)
    assert nodes.b.metric(HITS) - hits == loaded_by_b(prompt)
    b = nodes.stats(server_b)
    assert b["peer_bytes_nixl"] > 0 and b.get("peer_bytes_tcp", 0) == 0, b
    assert b.get("peer_fallbacks", 0) == 0
    assert text == complete(nodes.a.url, nodes.model, prompt)
