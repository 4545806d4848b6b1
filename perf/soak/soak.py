"""The reliability soak: a real vLLM engine (CPU build) with kvtier over CPU + a size-capped
local disk + a remote, under mixed load, with faults injected on a schedule, every output
checked against an engine without kvtier (docs/reliability.md).

    SOAK_SECONDS=3600 python perf/soak/soak.py   # or: make soak
    → perf/results/soak/cpu-soak.json (+ .png); exit status 1 when a criterion fails

1. A tiny random-weight float32 Llama is written locally; a no-connector engine computes
   the greedy reference output of every prompt of the workload, then exits.
2. The kvtier engine (``tests/support/vllm_node_engine.py`` in its own process) serves rounds of
   4-8 concurrent prompts drawn from shared-prefix, unrelated, short and long prompts;
   half the rounds start with vLLM's prefix cache reset, so kvtier serves the repeats.
   Its remote is redis-server, then (after each engine restart) ``kvtier serve``, then
   redis again: each reached through a ``FaultyProxy``.
3. Every ``period`` seconds the next fault of ``SCHEDULE`` is injected; after each, every
   prompt is replayed (prefix cache reset) so the tiers are read.
4. After each round: the engine tree's RSS and descriptors, the CPU pool's bytes, the disk
   tier's bytes, and kvtier's counters (the worker's ``metrics``) are sampled.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
PERF = HERE.parent
sys.path[:0] = [str(HERE), str(PERF.parent / "tests")]
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")  # as tests/conftest.py

from faults import (  # noqa: E402
    FaultyProxy,
    SmallDisk,
    corrupt_files,
    dir_bytes,
    kill_tree,
    pooled_slope_per_hour,
    slope_per_hour,
    tree_usage,
)
from support.engine_process import EngineProcess  # noqa: E402
from support.kvtier_server import KVTierServerProcess  # noqa: E402
from support.models import make_tiny_llama  # noqa: E402
from support.redis_server import RedisServer  # noqa: E402

from kvtier.integration.vllm.rpc import RpcClient, endpoint_for  # noqa: E402

CHUNK = 64
TIMEOUT_MS = 1000
CPU_GB = 4 / 1024  # 64 chunks of 64 KiB: most of the workload lives below the CPU tier
DISK_CAP = 6 << 20  # the disk tier's max_local_disk_size: 96 chunks
TMPFS = 10 << 20  # the filesystem under it, filled to make the disk full
STALL_MARGIN_S = 20.0  # CPU contention on a shared 2-core host, stated in reliability.md
# A request waits on the remote at most: a lookup, a prefetch and a load, each cut at the
# timeout; a batch slower than that plus the margin is stalled.
STALL_BOUND_S = 3 * TIMEOUT_MS / 1000 + STALL_MARGIN_S
# A process's warm-up: its first minutes, while RSS still grows as each kind of fault and
# prompt passes the first time (about 4 minutes for the engine, seen in runs of 40 min).
WARMUP_S = 240.0
# Memory and descriptor slopes are judged only over at least this much time after warm-up,
# summed over the process's lives; a shorter window (a run of a few minutes) reports them,
# not judged.
MIN_SLOPE_WINDOW_S = 300.0
# Per measure: the sample field that tells one life of its process from the next.
LIFE_OF = {
    "rss_bytes": "incarnation",
    "front_rss_bytes": "incarnation",
    "fds": "incarnation",
    "cpu_pool_used_bytes": "incarnation",
    "server_rss_bytes": "server_pid",
    "server_fds": "server_pid",
}
SCHEDULE = (
    "kill_remote",
    "slow",
    "drop",
    "truncate",
    "bitflip",
    "delete",
    "disk_full",
    "kill_engine",
)
# The counters that show each fault (deltas from its injection to the next fault).
SEEN_BY = {
    "kill_remote": ("{remote}_reconnects",),
    # a slow reply surfaces as kvtier's own timeout, or as the client's socket timeout
    "slow": ("{remote}_timeouts", "{remote}_errors"),
    "drop": ("{remote}_errors", "{remote}_reconnects", "{remote}_puts_dropped_unavailable"),
    "truncate": ("disk_corrupt_rejected",),
    "bitflip": ("disk_corrupt_rejected",),
    "delete": ("disk_get_misses",),
    # a full filesystem makes the tier evict to make room, or drop a store it cannot
    "disk_full": ("disk_evictions_no_space", "disk_puts_dropped_no_space"),
    "kill_engine": ("disk_lookup_hit_chunks",),  # the restarted engine hits the same disk
}
REMOTES = ("redis", "kvtier")
COUNTERS = (
    "store_skipped_load_failed_chunks",
    "retrieve_hit_tokens",
    "stored_chunks",
    "corrupt_chunks_rejected",
    "disk_get_hits",
    "disk_evictions",
    *sorted(
        {name.format(remote=r) for names in SEEN_BY.values() for name in names for r in REMOTES}
    ),
)


def workload(seed: int = 0) -> list[list[int]]:
    """48 prompts: 4 long prefixes (512 tokens) × 6 tails, 12 long unrelated prompts
    (600-1000 tokens), 12 short ones (20-120 tokens)."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(1, 500) for _ in range(n)]

    prompts = []
    for _ in range(4):
        prefix = tokens(512)
        prompts += [prefix + tokens(rng.randrange(10, 200)) for _ in range(6)]
    prompts += [tokens(rng.randrange(600, 1000)) for _ in range(12)]
    prompts += [tokens(rng.randrange(20, 120)) for _ in range(12)]
    return prompts


class Soak:
    def __init__(self, seconds: float, work: Path, out: Path, seed: int = 0):
        self.seconds = seconds
        self.work = work
        self.out = out
        self.rng = random.Random(seed)
        self.period = min(max(seconds / 14, 8.0), 60.0)
        self.sample_every = max(1.0, seconds / 1500)
        self.prompts = workload(seed)
        self.model = make_tiny_llama(work / "llama")
        # kept after the run: what to read when a criterion fails
        self.logs = Path(tempfile.mkdtemp(prefix="kvtier-soak-logs-"))
        self.schedule = tuple(os.environ.get("SOAK_FAULTS", ",".join(SCHEDULE)).split(","))
        self.disk = SmallDisk.mount(work / "tmpfs", TMPFS)
        self.disk_dir = (self.disk.path if self.disk else work / "disk") / "tier"
        self.redis = RedisServer()
        self.server = KVTierServerProcess("--chunk-size", str(CHUNK))
        delay = 0.6 * TIMEOUT_MS / 1000  # a request and its reply: past the timeout
        self.proxies = {
            "redis": FaultyProxy(("127.0.0.1", self.redis.port), delay),
            "kvtier": FaultyProxy(("127.0.0.1", self.server.port), delay),
        }
        self.remote = "redis"
        self.engine: EngineProcess | None = None
        self.incarnation = 0
        self.base: dict[str, float] = dict.fromkeys(COUNTERS, 0.0)  # killed engines' totals
        self.last: dict[str, float] = dict.fromkeys(COUNTERS, 0.0)
        self.samples: list[dict] = []
        self.faults: list[dict] = []
        self.active: tuple[str, float] | None = None  # a fault held until a time
        self.requests = self.wrong = self.stalled = self.crashes = 0
        self.loaded_tokens = self.reset_prompt_tokens = 0
        self.round_seconds: list[float] = []
        self.reference: dict[tuple[int, ...], tuple[int, ...]] = {}
        self.start = 0.0

    # -- engines ---------------------------------------------------------------------

    def references(self) -> None:
        engine = EngineProcess(self.model, "soak-reference", None, self.logs / "reference.log")
        try:
            engine.wait_ready()
            results, _ = engine.generate(self.prompts, timeout=900)
        finally:
            engine.close()
        self.reference = {tuple(p): ids for p, (ids, _) in zip(self.prompts, results, strict=True)}

    def extra(self) -> dict:
        port = self.proxies[self.remote].port
        url = (
            f"redis://127.0.0.1:{port}/0"
            if self.remote == "redis"
            else f"kvtier://127.0.0.1:{port}?shm=0"
        )
        return {
            "chunk_size": CHUNK,
            "max_local_cpu_size": CPU_GB,
            "local_disk": str(self.disk_dir),
            "max_local_disk_size": DISK_CAP / 2**30,
            "remote_url": url,
            "remote_timeout_ms": TIMEOUT_MS,
            "remote_reconnect_max_ms": 500,
        }

    def start_engine(self) -> None:
        self.incarnation += 1
        engine_id = f"soak-{os.getpid()}-{self.incarnation}"
        log = self.logs / f"{engine_id}.log"
        self.engine = EngineProcess(self.model, engine_id, self.extra(), log)
        self.engine.wait_ready()
        self.last = dict.fromkeys(COUNTERS, 0.0)

    def retire_engine(self) -> None:
        """Fold the engine's last counters into the totals (it is about to go)."""
        for name in COUNTERS:
            self.base[name] += self.last[name]
        self.last = dict.fromkeys(COUNTERS, 0.0)

    def metrics(self) -> dict | None:
        assert self.engine is not None
        endpoint = endpoint_for(f"{self.engine.engine_id}-dp0", 0)
        with contextlib.suppress(Exception), RpcClient([endpoint], timeout=5.0) as client:
            replies = client.call_all("metrics")
            return replies[0] if replies else None
        return None

    # -- load ------------------------------------------------------------------------

    def round(self, prompts: list[list[int]], reset: bool) -> None:
        assert self.engine is not None
        try:
            if reset:
                self.engine.call("reset", timeout=STALL_BOUND_S * 4)
            results, seconds = self.engine.generate(prompts, timeout=STALL_BOUND_S * 4)
        except AssertionError as exc:  # the engine exited, or did not answer in time
            self.crashes += 1
            print(f"soak: engine failure: {str(exc)[-2000:]}", file=sys.stderr)
            self.retire_engine()
            kill_tree(self.engine.process.pid)
            self.start_engine()
            return
        self.requests += len(prompts)
        self.round_seconds.append(seconds)
        if seconds > STALL_BOUND_S:
            self.stalled += len(prompts)
        for prompt, (ids, cached) in zip(prompts, results, strict=True):
            if ids != self.reference[tuple(prompt)]:
                self.wrong += 1
                print(f"soak: wrong output for a {len(prompt)}-token prompt", file=sys.stderr)
            if reset:
                self.loaded_tokens += cached
                self.reset_prompt_tokens += len(prompt)

    def mixed_round(self) -> None:
        batch = self.rng.sample(self.prompts, self.rng.randrange(4, 9))
        self.round(batch, reset=self.rng.random() < 0.5)

    def replay(self) -> None:
        """Every prompt again, vLLM's cache reset first: whatever kvtier holds is read."""
        order = self.prompts[:]
        self.rng.shuffle(order)
        for i in range(0, len(order), 8):
            self.round(order[i : i + 8], reset=True)

    def sample(self, force: bool = False) -> None:
        assert self.engine is not None
        data = self.metrics()
        if data is None:
            return
        counters, gauges = data["counters"], data["gauges"]
        self.last = {name: float(counters.get(name, 0.0)) for name in COUNTERS}
        now = time.monotonic() - self.start
        if not force and self.samples and now - self.samples[-1]["t"] < self.sample_every:
            return
        (rss, front_rss), fds = tree_usage(self.engine.process.pid)
        server = self.server.process
        alive = server is not None and server.poll() is None
        (server_rss, _), server_fds = tree_usage(server.pid) if alive else ((0, 0), 0)
        self.samples.append(
            {
                "t": round(now, 2),
                "incarnation": self.incarnation,
                "remote": self.remote,
                "requests": self.requests,
                "wrong": self.wrong,
                "rss_bytes": rss,
                "front_rss_bytes": front_rss,
                "fds": fds,
                "server_pid": server.pid if alive else None,
                "server_rss_bytes": server_rss,
                "server_fds": server_fds,
                "cpu_pool_used_bytes": gauges.get("cpu_pool_used_bytes", 0.0),
                "cpu_pool_capacity_bytes": gauges.get("cpu_pool_capacity_bytes", 0.0),
                "disk_bytes": dir_bytes(self.disk_dir),
                "disk_gauge_bytes": gauges.get("disk_used_bytes", 0.0),
                "counters": self.totals(),
            }
        )

    def totals(self) -> dict[str, float]:
        return {name: self.base[name] + self.last[name] for name in COUNTERS}

    # -- faults ----------------------------------------------------------------------

    def inject(self, kind: str) -> None:
        proxy = self.proxies[self.remote]
        record = {"kind": kind, "t": round(time.monotonic() - self.start, 2), "remote": self.remote}
        record["before"] = self.totals()
        hold = min(self.period / 2, 20.0)
        if kind == "kill_remote":
            (self.redis.stop if self.remote == "redis" else self.server.kill)()
            # Every prompt while it is down: a remote nobody asks is never seen to fail
            # (redis-py reconnects to the restarted server without an error).
            self.replay()
            (self.redis.start if self.remote == "redis" else self.server.start)()
        elif kind in ("slow", "drop"):
            proxy.set_mode(kind)
            self.active = (kind, time.monotonic() + hold)
            self.replay()
        elif kind in ("truncate", "bitflip", "delete"):
            record["files"] = corrupt_files(self.disk_dir, kind, 12, self.rng)
            self.replay()
        elif kind == "disk_full":
            if self.disk is None:
                record["skipped"] = "no tmpfs could be mounted: a full disk cannot be made"
            else:
                # Another writer takes the free space and the space of the oldest chunk
                # files (deleted), so evicting them frees nothing for kvtier's next write.
                record["files"] = corrupt_files(self.disk_dir, "delete", 12, self.rng)
                self.disk.fill()
                self.active = (kind, time.monotonic() + hold)
        elif kind == "kill_engine":
            assert self.engine is not None
            self.sample(force=True)
            prompts = self.rng.sample(self.prompts, 8)
            self.engine.send("reset")
            self.engine.send("generate", prompts=prompts, max_tokens=8)
            time.sleep(self.rng.uniform(0.3, 1.5))  # in the middle of its stores
            kill_tree(self.engine.process.pid)
            self.retire_engine()
            self.remote = "kvtier" if self.remote == "redis" else "redis"
            self.start_engine()
            self.replay()
        self.faults.append(record)
        print(f"soak: t={record['t']:.0f}s fault {kind} ({record['remote']})", file=sys.stderr)

    def revert(self) -> None:
        if self.active is None:
            return
        kind, _ = self.active
        self.active = None
        if kind == "disk_full" and self.disk is not None:
            self.disk.drain()
        for proxy in self.proxies.values():
            proxy.set_mode("ok")

    def judge_faults(self) -> dict[str, dict]:
        """Per kind: injections, and how many showed in their counters before the next."""
        ends = [f["before"] for f in self.faults[1:]] + [self.totals()]
        summary: dict[str, dict] = {}
        for fault, after in zip(self.faults, ends, strict=True):
            entry = summary.setdefault(fault["kind"], {"injected": 0, "seen": 0, "skipped": 0})
            if "skipped" in fault:
                entry["skipped"] += 1
                continue
            entry["injected"] += 1
            names = [n.format(remote=fault["remote"]) for n in SEEN_BY[fault["kind"]]]
            delta = sum(after.get(n, 0.0) - fault["before"].get(n, 0.0) for n in names)
            fault["seen_delta"] = delta
            entry["seen"] += delta > 0
        return summary

    # -- the run ---------------------------------------------------------------------

    def run(self) -> dict:
        self.references()
        self.start = time.monotonic()
        self.start_engine()
        next_fault, index = self.period, 0
        while time.monotonic() - self.start < self.seconds:
            now = time.monotonic() - self.start
            if self.active is not None and time.monotonic() > self.active[1]:
                self.revert()
            if self.active is None and now >= next_fault:
                self.inject(self.schedule[index % len(self.schedule)])
                index += 1
                next_fault = time.monotonic() - self.start + self.period
            if self.active is not None and self.active[0] == "disk_full" and self.disk:
                self.disk.fill()  # space the tier freed by evicting is taken again
            self.mixed_round()
            self.sample()
        self.revert()
        self.replay()  # the last fault's window: the tiers read once more
        self.sample(force=True)
        elapsed = time.monotonic() - self.start
        assert self.engine is not None
        self.engine.close()
        return self.report(elapsed)

    def close(self) -> None:
        if self.engine is not None:
            kill_tree(self.engine.process.pid)
        for proxy in self.proxies.values():
            proxy.close()
        self.server.close()
        self.redis.close()
        if self.disk is not None:
            self.disk.unmount()

    # -- results ---------------------------------------------------------------------

    def slopes(self) -> dict[str, dict]:
        """Per measure: one least-squares slope per hour over every life of its process
        (the engine's, or the kvtier server's) after that life's warm-up (its first
        ``WARMUP_S`` seconds), each life at its own level; with each life's own slope."""
        out: dict[str, dict] = {}
        for measure, life_key in LIFE_OF.items():
            lives: dict[object, list[dict]] = {}
            for s in self.samples:
                if s.get(life_key) is not None:
                    lives.setdefault(s[life_key], []).append(s)
            kept = []
            for rows in lives.values():
                warm = rows[0]["t"] + WARMUP_S
                rows = [s for s in rows if s["t"] >= warm]
                if len(rows) >= 5:
                    kept.append(([s["t"] for s in rows], [float(s[measure]) for s in rows]))
            if not kept:
                continue
            values = [v for _, vs in kept for v in vs]
            out[measure] = {
                "per_hour": pooled_slope_per_hour(kept),
                "window_s": round(sum(ts[-1] - ts[0] for ts, _ in kept), 1),
                "mean": sum(values) / len(values),
                "lives": len(kept),
                "per_life_per_hour": [round(slope_per_hour(ts, vs)) for ts, vs in kept],
            }
        return out

    def report(self, elapsed: float) -> dict:
        def memory_flat(m: dict) -> bool:
            return m["per_hour"] < 0.1 * m["mean"]

        def fds_flat(m: dict) -> bool:
            return m["per_hour"] * m["window_s"] / 3600 < 16

        def judged(measure: dict | None, flat: Callable[[dict], bool]) -> bool | None:
            if measure is None or measure["window_s"] < MIN_SLOPE_WINDOW_S:
                return None
            return flat(measure)

        faults = self.judge_faults()
        slopes = self.slopes()
        rss, fds = slopes.get("rss_bytes"), slopes.get("fds")
        server_rss, server_fds = slopes.get("server_rss_bytes"), slopes.get("server_fds")
        pool_cap = max((s["cpu_pool_capacity_bytes"] for s in self.samples), default=0.0)
        disk_max = max((s["disk_bytes"] for s in self.samples), default=0)
        criteria = {
            "no_wrong_outputs": self.wrong == 0,
            "no_engine_crashes": self.crashes == 0,
            "no_stalled_requests": self.stalled == 0,
            # flat: RSS growing under a tenth of itself per hour; the fitted growth of
            # descriptors over the window under one remote connection pool (16)
            # None: not judged, the window after warm-up is too short for a slope to mean
            # anything (a short run: its RSS still grows while faults pass the first time)
            "memory_flat": judged(rss, memory_flat),
            "fds_flat": judged(fds, fds_flat),
            "server_memory_flat": judged(server_rss, memory_flat),
            "server_fds_flat": judged(server_fds, fds_flat),
            "pinned_within_pool": all(s["cpu_pool_used_bytes"] <= pool_cap for s in self.samples),
            "disk_within_cap": disk_max <= DISK_CAP,
            "every_fault_seen": all(f["seen"] == f["injected"] for f in faults.values())
            and all(f["injected"] > 0 for f in faults.values() if not f["skipped"]),
        }
        return {
            "seconds_requested": self.seconds,
            "seconds": round(elapsed, 1),
            "fault_period_s": self.period,
            "logs": str(self.logs),
            "requests": self.requests,
            "wrong_outputs": self.wrong,
            "stalled_requests": self.stalled,
            "stall_bound_s": STALL_BOUND_S,
            "remote_timeout_ms": TIMEOUT_MS,
            "engine_crashes": self.crashes,
            "engine_starts": self.incarnation,
            "max_round_seconds": round(max(self.round_seconds, default=0.0), 2),
            "hit_rate": self.loaded_tokens / max(self.reset_prompt_tokens, 1),
            "disk_cap_bytes": DISK_CAP,
            "disk_max_bytes": disk_max,
            "disk_full_by": "tmpfs ballast" if self.disk else "not injected (no tmpfs)",
            "cpu_pool_capacity_bytes": pool_cap,
            "slopes": slopes,
            "faults": faults,
            "fault_log": self.faults,
            "counters": self.totals(),
            "criteria": criteria,
            "passed": all(ok is not False for ok in criteria.values()),
            "samples": self.samples,
        }


def plot(result: dict, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    samples = result["samples"]
    t = [s["t"] / 60 for s in samples]
    fig = Figure(figsize=(10, 9), dpi=100)
    axes = fig.subplots(4, 1, sharex=True)
    axes[0].plot(t, [s["requests"] for s in samples], label="requests served")
    axes[0].plot(t, [s["wrong"] for s in samples], label="wrong outputs")
    axes[1].plot(t, [s["rss_bytes"] / 2**20 for s in samples], label="engine RSS (MiB)")
    axes[1].plot(
        t, [s["cpu_pool_used_bytes"] / 2**20 for s in samples], label="CPU pool used (MiB)"
    )
    axes[1].plot(t, [s["server_rss_bytes"] / 2**20 for s in samples], label="server RSS (MiB)")
    axes[2].plot(t, [s["fds"] for s in samples], label="engine open descriptors")
    axes[2].plot(t, [s["server_fds"] for s in samples], label="server open descriptors")
    axes[3].plot(t, [s["disk_bytes"] / 2**20 for s in samples], label="disk tier (MiB)")
    axes[3].axhline(result["disk_cap_bytes"] / 2**20, color="red", ls="--", label="cap")
    axes[3].set_ylim(0, result["disk_cap_bytes"] / 2**20 * 1.15)
    for fault in result["fault_log"]:
        for ax in axes:
            ax.axvline(fault["t"] / 60, color="grey", lw=0.5, alpha=0.5)
    for ax in axes:
        ax.legend(loc="upper left", fontsize=8)
    axes[3].set_xlabel("minutes (grey lines: faults injected)")
    axes[0].set_title(f"kvtier soak: {result['seconds'] / 60:.1f} min, passed={result['passed']}")
    fig.tight_layout()
    FigureCanvasAgg(fig).print_png(str(path), metadata={"Software": None})


def main() -> int:
    seconds = float(os.environ.get("SOAK_SECONDS", "3600"))
    out = Path(os.environ.get("SOAK_OUT", PERF / "results" / "soak" / "cpu-soak.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kvtier-soak-") as work:
        soak = Soak(seconds, Path(work), out)
        try:
            result = soak.run()
        finally:
            soak.close()
    out.write_text(json.dumps(result))
    plot(result, out.with_suffix(".png"))
    summary = {k: v for k, v in result.items() if k not in ("samples", "fault_log")}
    print(json.dumps(summary, indent=1))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
