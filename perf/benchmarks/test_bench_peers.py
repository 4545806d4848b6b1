"""Pulls between ``kvtier serve`` peers, and what peers cost an idle server.

Server a (a real ``kvtier serve`` process) holds ``BLOBS`` wire-format objects of
``BLOB_MIB`` MiB; a puller in this process (``kvtier.server.peers.Peers``, what server b
runs, with its own memory pool) pulls all of them, ``ROUNDS`` times, nothing kept:

- ``peer_pull_nixl_ucx_shm``: NIXL one-sided READs, UCX's default transports (shared
  memory / cma on one host);
- ``peer_pull_nixl_ucx_tcp``: the same with ``UCX_TLS=tcp`` (what crosses hosts without
  RDMA);
- ``peer_pull_tcp``: the server protocol's GET over TCP (``--peer-transport tcp``);

each against a raw loopback socket moving the same bytes in the same run (a thread
sending, this thread ``recv_into`` a preallocated buffer). A pull includes the lease,
the release and the checksum of every blob.

Idle CPU: a server with a peer configured (and NIXL set up) over ``IDLE_S`` seconds of
no traffic, against a bare NIXL agent with its progress thread on (NIXL's default);
printed and bounded (under 0.05 cores), not recorded.

Time to first token across peers (``ttft_engine_b_via_peer_<n>_tokens``): real vLLM
engines, each a fresh process run by ``perf/benchmarks/vllm_ttft_run.py`` (model and
timing as in ``test_bench_server_ttft.py``), with no CPU tier of their own. Server b
names server a as its peer; both run ``--peer-transport nixl`` where NIXL is installed
(else ``tcp``), so that pulls are NIXL READs; nothing else is shared. A round:

1. engine A, on server a, serves one prompt per length (its cold prefill, not recorded)
   and shuts down, which flushes its stores to server a;
2. engine B, a new process on server b, warmed up on prompts of its own, serves A's
   prompts (timed: every token it did not compute, server b pulled from server a), then
   as many new prompts (timed: B's cold prefill, the baseline, lookups at the peer
   included).

A row's value is the median over rounds of B's TTFT via the peer, its baseline the
median of B's cold prefill.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
from support.kvtier_server import KVTierServerProcess

from kvtier.observability.stats import Stats
from kvtier.server.nixl import NixlPlane, NixlUnavailable, import_nixl
from kvtier.server.peers import Peers
from kvtier.storage.cpu import LocalCPUTier
from kvtier.storage.serde import make_serde
from kvtier.storage.wire import encode

RESULTS_NAME = "peers"
BLOBS, BLOB_MIB, ROUNDS = 16, 4, 5
IDLE_S = 5.0
RUNNER = Path(__file__).with_name("vllm_ttft_run.py")
TTFT_ROUNDS, TTFT_TOKENS, TTFT_CHUNK = 3, [1024, 4000], 256
RUN_TIMEOUT_S = 300
NS = "bench"
NAME = "kvtier1@bench@1@0@bfloat16@{:032x}"

try:
    import_nixl()
    NIXL = True
except NixlUnavailable:
    NIXL = False


def _blobs() -> list[tuple[str, bytes]]:
    elements = BLOB_MIB * 2**20 // 2
    out = []
    for i in range(BLOBS):
        tensor = torch.full((elements,), float(i), dtype=torch.bfloat16).view(2, 1, -1, 128)
        out.append(
            (
                NAME.format(i),
                b"".join(bytes(p) for p in encode(NAME.format(i), tensor, make_serde("naive"))),
            )
        )
    return out


def _holder(transport: str, env: dict[str, str]) -> KVTierServerProcess:
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return KVTierServerProcess("--max-local-cpu-size", "0.5", "--peer-transport", transport)
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def _pull_gbps(holder: KVTierServerProcess, nixl: bool, names: list[str], nbytes: int) -> float:
    memory = LocalCPUTier(256 << 20, "LRU", alignment=64, pin_memory=False)
    plane = NixlPlane(memory.pool.buffer) if nixl else None
    peers = Peers(
        [holder.url], memory=memory, stats=Stats(), token=None, timeout_s=30.0,
        reconnect_max_s=1.0, plane=plane, keep=False,
    )  # fmt: skip
    times = []
    for _ in range(ROUNDS + 1):
        started = time.perf_counter()
        got = peers.pull(NS, names)
        times.append(time.perf_counter() - started)
        assert len(got) == len(names)
        for obj in got.values():
            obj.ref_down()
    peers.close()
    if plane is not None:
        plane.close()
    memory.close()
    return nbytes / statistics.median(times[1:]) / 1e9


def _raw_socket_gbps(nbytes: int) -> float:
    server = socket.create_server(("127.0.0.1", 0))
    payload = bytes(nbytes)
    sink = bytearray(nbytes)

    def send() -> None:
        conn, _ = server.accept()
        for _ in range(ROUNDS + 1):
            conn.sendall(payload)
        conn.close()

    sender = threading.Thread(target=send)
    sender.start()
    client = socket.create_connection(server.getsockname())
    view, times = memoryview(sink), []
    for _ in range(ROUNDS + 1):
        started, got = time.perf_counter(), 0
        while got < nbytes:
            got += client.recv_into(view[got:])
        times.append(time.perf_counter() - started)
    sender.join()
    client.close()
    server.close()
    return nbytes / statistics.median(times[1:]) / 1e9


@pytest.mark.parametrize(
    "case",
    [
        ("peer_pull_tcp", "tcp", {}),
        pytest.param(
            ("peer_pull_nixl_ucx_shm", "nixl", {"UCX_NET_DEVICES": "lo"}),
            marks=pytest.mark.skipif(not NIXL, reason="no NIXL"),
        ),
        pytest.param(
            ("peer_pull_nixl_ucx_tcp", "nixl", {"UCX_NET_DEVICES": "lo", "UCX_TLS": "tcp"}),
            marks=pytest.mark.skipif(not NIXL, reason="no NIXL"),
        ),
    ],
    ids=lambda c: c[0],
)
def test_pull_throughput(case, record):
    metric, transport, env = case
    blobs = _blobs()
    nbytes = sum(len(b) for _, b in blobs)
    with _holder(transport, env) as holder:
        client = holder.client(NS, timeout_s=30)
        client.put_many([(name, [data]) for name, data in blobs])
        client.close()
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            value = _pull_gbps(holder, transport == "nixl", [n for n, _ in blobs], nbytes)
        finally:
            for k, v in saved.items():
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    raw = _raw_socket_gbps(nbytes)
    record(
        metric=metric, value=round(value, 3), unit="GB/s", baseline="raw_loopback_socket",
        baseline_value=round(raw, 3), ratio=round(value / raw, 3),
        params={"blobs": BLOBS, "blob_mib": BLOB_MIB, "rounds": ROUNDS},
    )  # fmt: skip


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.skipif(not NIXL, reason="no NIXL")
def test_idle_cpu_of_a_server_with_peers():
    os.environ["UCX_NET_DEVICES"] = "lo"
    with KVTierServerProcess() as a, KVTierServerProcess("--peer", a.url) as b:
        time.sleep(1.0)
        before = _cpu_seconds(b.process.pid)
        time.sleep(IDLE_S)
        idle = (_cpu_seconds(b.process.pid) - before) / IDLE_S
    agent = (
        "import time; from kvtier.server.nixl import import_nixl; a, c = import_nixl(); "
        "x = a('bench', c(backends=['UCX'])); time.sleep(60)"
    )
    process = subprocess.Popen([sys.executable, "-c", agent])
    try:
        time.sleep(2.0)
        before = _cpu_seconds(process.pid)
        time.sleep(IDLE_S)
        thread = (_cpu_seconds(process.pid) - before) / IDLE_S
    finally:
        process.kill()
        process.wait()
    # printed and bounded, not recorded: the report has no section for CPU cores yet
    print(f"\npeer idle CPU: {idle:.4f} cores; a NIXL agent's progress thread: {thread:.4f}")
    assert idle < 0.05, f"an idle server with peers used {idle:.3f} cores"


@pytest.fixture(scope="module")
def ttft_model():
    pytest.importorskip("vllm")
    from kvtier.demo_vllm import build_model

    return build_model(Path(tempfile.gettempdir()) / "kvtier-demo-llama-v1")


def _engine_run(model: Path, url: str, out: Path, seed: int, prompts: int, warmup: int) -> dict:
    extra = {"local_cpu": False, "remote_url": url, "remote_timeout_ms": 5000}
    command = [
        sys.executable, str(RUNNER), "--mode=kvtier", "--tokens", *map(str, TTFT_TOKENS),
        f"--prompts={prompts}", f"--seed={seed}", f"--warmup-seed={warmup}", f"--model={model}",
        f"--json={out}", f"--kvtier-extra={json.dumps(extra)}",
    ]  # fmt: skip
    proc = subprocess.run(command, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(command)} exited with {proc.returncode}:\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def peer_rounds(ttft_model, tmp_path_factory) -> tuple[list[dict], dict]:
    """Engine B's run per round (``miss_s[n]``: via the peer, then cold), and server b's
    counters after the last round."""
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    out = tmp_path_factory.mktemp("peer-ttft")
    pool = ("--chunk-size", str(TTFT_CHUNK), "--max-local-cpu-size", "1")
    transport = "nixl" if NIXL else "tcp"
    runs = []
    with (
        KVTierServerProcess(*pool, "--peer-transport", transport) as a,
        KVTierServerProcess(*pool, "--peer", a.url, "--peer-transport", transport, admin=True) as b,
    ):
        for round_ in range(TTFT_ROUNDS):
            seed = 200 + round_  # prompts no other benchmark stored
            _engine_run(ttft_model, a.url, out / f"{round_}-a.json", seed, 1, seed)
            runs.append(
                _engine_run(ttft_model, b.url, out / f"{round_}-b.json", seed, 2, seed + 1000)
            )
        stats = b.admin("/stats")[1]
    return runs, stats


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("tokens", TTFT_TOKENS)
def test_ttft_engine_b_via_peer_vs_its_cold_prefill(peer_rounds, record, tokens):
    runs, stats = peer_rounds
    key = str(tokens)
    warm = [run["miss_s"][key][0] for run in runs]
    cold = [run["miss_s"][key][1] for run in runs]
    loaded = [run["miss_cached_tokens"][key][0] for run in runs]
    cold_cached = [run["miss_cached_tokens"][key][1] for run in runs]
    transport = "nixl" if stats.get("peer_bytes_nixl", 0) else "tcp"
    record(
        metric=f"ttft_engine_b_via_peer_{tokens}_tokens", value=statistics.median(warm),
        unit="s", baseline=f"ttft_cold_prefill_engine_b_{tokens}_tokens",
        baseline_value=statistics.median(cold), rounds=warm, spread=[min(warm), max(warm)],
        baseline_rounds=cold, baseline_spread=[min(cold), max(cold)],
        params={"peer_transport": transport, "chunk_size": TTFT_CHUNK},
        engine={"vllm": runs[0]["vllm"], "kvtier_config": runs[0]["kvtier_config"]},
    )  # fmt: skip
    assert max(cold_cached) == 0, f"B's cold prefill loaded: {cold_cached}"
    assert min(loaded) >= tokens // TTFT_CHUNK * TTFT_CHUNK - TTFT_CHUNK, (
        f"B loaded too little: {loaded}"
    )
    assert stats["peer_hits"] > 0 and transport == ("nixl" if NIXL else "tcp"), stats
