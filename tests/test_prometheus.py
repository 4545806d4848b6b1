"""Prometheus metrics checked against what a scripted workload really did: exact chunk,
byte and token counts, per-tier counters, histograms and gauges, scraped over HTTP."""

from __future__ import annotations

import http.client
import re
import socket
import urllib.request
from pathlib import Path

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from test_engine import make_engine

from kvtier.blend.vllm_plan import BlendPlanner
from kvtier.config import KVTierConfig, load_config
from kvtier.engine import CacheEngine, EngineMetadata
from kvtier.observability.prometheus import (
    HELP,
    MetricsServer,
    export,
    serve_engine_metrics,
)
from kvtier.observability.stats import Stats
from kvtier.observability.tier_events import TierEventLog

LAYERS, HEADS, HEAD, CHUNK = 3, 2, 8, 8  # test_engine.make_engine's defaults
CHUNK_BYTES = 2 * LAYERS * CHUNK * HEADS * HEAD * 2  # K and V planes, bf16


def scrape(server: MetricsServer) -> dict[tuple[str, tuple], float]:
    return scrape_url(f"http://{server.host}:{server.port}/metrics")


def scrape_url(url: str) -> dict[tuple[str, tuple], float]:
    """``{(sample name, sorted labels): value}`` from a live metrics endpoint."""
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples, name: str, **labels) -> float:
    key = (name, tuple(sorted({"rank": "0", **labels}.items())))
    assert key in samples, f"{name}{labels} not exported; have {sorted(k[0] for k in samples)}"
    return samples[key]


def test_numbers_match_a_scripted_workload(tmp_path):
    first = make_engine(local_disk=str(tmp_path))
    first.store(torch.arange(40), slot_mapping=torch.arange(40))  # 5 chunks
    first.store(torch.arange(24), slot_mapping=torch.arange(24))  # all 3 already held
    assert first.storage.flush(30)
    first.close()

    engine = make_engine(local_disk=str(tmp_path))  # a restart: chunks come from disk
    engine.store(torch.arange(100, 116), slot_mapping=torch.arange(100, 116))  # 2 new
    assert engine.retrieve(torch.arange(40), slot_mapping=torch.arange(40, 80)) == 40
    assert engine.retrieve(torch.arange(24), slot_mapping=torch.arange(40, 64)) == 24
    assert engine.storage.flush(30)
    server = serve_engine_metrics(engine)
    try:
        assert server.host == "127.0.0.1"  # localhost unless configured
        samples = scrape(server)
    finally:
        server.close()

    assert value(samples, "kvtier_stored_chunks_total") == 2
    assert value(samples, "kvtier_stored_bytes_total") == 2 * CHUNK_BYTES
    assert value(samples, "kvtier_retrieve_hit_tokens_total") == 64
    assert value(samples, "kvtier_loaded_bytes_total") == 8 * CHUNK_BYTES
    # 5 chunks read from disk (then written back to memory); the second load hit memory.
    assert value(samples, "kvtier_tier_get_hits_total", tier="disk") == 5
    assert value(samples, "kvtier_tier_put_chunks_total", tier="disk") == 2
    assert value(samples, "kvtier_cpu_writeback_chunks_total") == 5
    assert value(samples, "kvtier_tier_hit_ratio", tier="disk") == 1.0
    # One observation per store and per load, summing to the measured seconds.
    assert value(samples, "kvtier_store_latency_seconds_count") == 1
    assert value(samples, "kvtier_load_latency_seconds_count") == 2
    assert value(samples, "kvtier_load_latency_seconds_sum") == pytest.approx(
        value(samples, "kvtier_load_seconds_total")
    )
    assert value(samples, "kvtier_load_latency_seconds_bucket", le="+Inf") == 2
    assert value(samples, "kvtier_tier_chunks", tier="cpu") == 7
    used = engine.storage.cpu.used_bytes
    assert value(samples, "kvtier_tier_pool_used_bytes", tier="cpu") == used
    assert value(samples, "kvtier_tier_up", tier="disk") == 1.0
    assert value(samples, "kvtier_tier_pending_writes", tier="disk") == 0
    disk_files = sum(p.stat().st_size for p in tmp_path.rglob("*.kvt"))
    assert value(samples, "kvtier_tier_used_bytes", tier="disk") == disk_files
    directories = sum(1 for p in tmp_path.rglob("*") if p.is_dir()) - 1  # below kvtier-v1
    assert value(samples, "kvtier_tier_directories", tier="disk") == directories
    assert value(samples, "kvtier_corrupt_chunks_rejected_total") == 0
    engine.close()


def test_ranks_are_labels():
    stats = [Stats(), Stats()]
    stats[0].inc("stored_chunks", 3)
    stats[1].inc("stored_chunks", 4)
    stats[1].inc("redis_timeouts", 2)
    stats[1].observe("redis_get_latency_seconds", 0.003)
    server = MetricsServer(
        "127.0.0.1", 0, lambda: [export(s, rank=str(i)) for i, s in enumerate(stats)]
    )
    try:
        samples = scrape(server)
        assert value(samples, "kvtier_stored_chunks_total", rank="0") == 3
        assert value(samples, "kvtier_stored_chunks_total", rank="1") == 4
        assert value(samples, "kvtier_tier_timeouts_total", rank="1", tier="redis") == 2
        assert (
            value(
                samples,
                "kvtier_tier_get_latency_seconds_bucket",
                rank="1",
                tier="redis",
                le="0.005",
            )
            == 1
        )
        assert (
            value(
                samples,
                "kvtier_tier_get_latency_seconds_bucket",
                rank="1",
                tier="redis",
                le="0.0025",
            )
            == 0
        )
        stats[0].inc("stored_chunks")  # live: the next scrape sees it
        assert value(scrape(server), "kvtier_stored_chunks_total", rank="0") == 4
    finally:
        server.close()


def test_a_taken_port_is_a_clear_error():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        with pytest.raises(OSError, match="metrics_port"):
            MetricsServer("127.0.0.1", port, list)


def test_a_port_past_65535_is_a_clear_error():
    """``metrics_port`` 65535 on data-parallel engine 1 asks for 65536."""
    with pytest.raises(OSError, match="metrics_port 65536"):
        MetricsServer("127.0.0.1", 65536, list)


def test_only_metrics_is_served_and_head_answers_its_headers():
    server = MetricsServer("127.0.0.1", 0, lambda: [export(Stats(), rank="0")])

    def ask(method: str, path: str) -> tuple[int, dict[str, str], bytes]:
        conn = http.client.HTTPConnection(server.host, server.port, timeout=10)
        try:
            conn.request(method, path)
            reply = conn.getresponse()
            return reply.status, dict(reply.getheaders()), reply.read()
        finally:
            conn.close()

    try:
        status, headers, body = ask("GET", "/metrics")
        assert status == 200 and b"kvtier_stored_bytes_total" in body
        status, head_headers, head_body = ask("HEAD", "/metrics")
        assert status == 200 and head_body == b""
        assert head_headers["Content-Type"] == headers["Content-Type"]
        assert int(head_headers["Content-Length"]) == len(body)
        for path in ("/", "/metric", "/metrics/x", "/favicon.ico"):
            assert ask("GET", path)[0] == 404, path
    finally:
        server.close()


def test_every_family_has_its_own_help():
    """The engine's ``evictions`` and the tiers' share a counter name, not a HELP."""
    stats = Stats()
    for name in ("disk_get_hits", "disk_evictions", "store_skipped_load_failed_chunks"):
        stats.inc(name)
    stats.observe("disk_get_latency_seconds", 0.01)
    gauges = {"cpu_chunks": 1.0, "cpu_pool_used_bytes": 1.0, "disk_up": 1.0}
    source = export(stats, gauges=gauges, tiers=["disk"], rank="0")
    server = MetricsServer("127.0.0.1", 0, lambda: [source])
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics") as reply:
            text = reply.read().decode()
    finally:
        server.close()
    helps = {f.name: f.documentation for f in text_string_to_metric_families(text)}
    assert helps["kvtier_evictions"] == "Chunks evicted from the CPU tier."
    assert helps["kvtier_tier_evictions"].startswith("Objects evicted from the tier")
    for name, documentation in helps.items():
        assert documentation != name.replace("_", " "), name


def test_every_series_exported_is_in_docs_observability_md(tmp_path):
    """An engine with a disk tier, and a vLLM scheduler's own counters (rank
    ``scheduler``): each family scraped is a metric name the docs list."""
    from test_vllm_scheduler_side import HeldHashes, make_side

    docs = (Path(__file__).resolve().parents[1] / "docs" / "observability.md").read_text()
    engine = make_engine(local_disk=str(tmp_path))
    engine.store(torch.arange(16), slot_mapping=torch.arange(16))
    assert engine.retrieve(torch.arange(16), slot_mapping=torch.arange(16, 32)) == 16
    assert engine.storage.flush(30)
    scheduler = {"labels": {"rank": "scheduler"}, "counters": make_side(HeldHashes()).counters()}
    server = MetricsServer("127.0.0.1", 0, lambda: [engine.metrics(), scheduler])
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics") as reply:
            text = reply.read().decode()
    finally:
        server.close()
        engine.close()
    for family in text_string_to_metric_families(text):
        suffix = "_total" if family.type == "counter" else ""
        assert f"`{family.name}{suffix}" in docs, family.name


def test_every_blend_counter_has_help_and_docs():
    """CacheBlend's counters: the scheduler's (the planner's) and those a worker rank
    increments (``BlendWorker``), each with its own HELP and listed in the docs."""
    root = Path(__file__).resolve().parents[1]
    worker = (root / "kvtier" / "blend" / "vllm_worker.py").read_text()
    names = set(re.findall(r'stats\.inc\(\s*"(blend_\w+)"', worker))
    names |= set(BlendPlanner(KVTierConfig(), [7], lambda hashes: []).counters())
    assert {"blend_requests", "blend_recomputed_tokens", "blend_claimed_tokens"} <= names
    docs = (root / "docs" / "observability.md").read_text()
    for name in sorted(names):
        assert name in HELP, name
        assert f"`kvtier_{name}_total`" in docs, name


def test_every_counter_a_vllm_rank_names_has_help_and_docs():
    """Counters the vLLM connector increments under a literal name (a worker rank's
    ``producer_store_timeouts``, ...) are exported: each needs its HELP and a docs row."""
    root = Path(__file__).resolve().parents[1]
    names = {
        name
        for path in (root / "kvtier" / "integration" / "vllm").glob("*.py")
        for name in re.findall(r'stats\.inc\(\s*"(\w+)"', path.read_text())
    }
    assert "producer_store_timeouts" in names
    docs = (root / "docs" / "observability.md").read_text()
    for name in sorted(names):
        assert name in HELP, name
        assert f"`kvtier_{name}_total`" in docs, name


@pytest.mark.parametrize(
    ("local_cpu", "disk", "uncounted"),
    [
        (True, False, {"prefetched_chunks", "cpu_writeback_chunks"}),
        (True, True, set()),
        (False, True, {"prefetched_chunks", "cpu_writeback_chunks", "evictions"}),
    ],
)
def test_an_engine_exports_no_counter_its_tiers_cannot_move(tmp_path, local_cpu, disk, uncounted):
    """Copies into the CPU tier need a lower tier and the CPU tier; evictions from it
    need it to keep chunks: elsewhere these series would sit at 0 for want of counting."""
    tiers = {"local_disk": str(tmp_path)} if disk else {}
    engine = make_engine(local_cpu=local_cpu, **tiers)
    try:
        counters = set(engine.metrics()["counters"])
    finally:
        engine.close()
    copies = {"prefetched_chunks", "cpu_writeback_chunks", "evictions"}
    assert copies & counters == copies - uncounted


@pytest.mark.parametrize("record_events", [False, True])
def test_an_engine_exports_only_the_kv_event_counters_it_counts(record_events):
    """``serve_engine_metrics``: an engine announces no KV events (vLLM's scheduler does),
    and drops tier records only when it records them."""
    config = load_config({"max_local_cpu_size": 0.01}, env={})
    events = TierEventLog(stats=Stats()) if record_events else None
    engine = CacheEngine(config, EngineMetadata("test-model"), events=events)
    server = serve_engine_metrics(engine)
    try:
        families = {name for name, _ in scrape(server)}
    finally:
        server.close()
        engine.close()
    exported = {name for name in families if name.startswith("kvtier_kv_events_")}
    assert exported == ({"kvtier_kv_events_dropped_total"} if record_events else set())
    assert "kvtier_stored_chunks_total" in families
