"""``make gpu-bench``: kvtier's GPU tests and benchmarks in one command of at most 5 minutes.

Run from the repository root on a machine with a CUDA or ROCm GPU, torch and Triton; nothing
is installed (no venv, no vLLM), the checkout is put on ``PYTHONPATH``::

    PYTHONPATH=. python3 -m perf.gpu_bench [--out DIR] [--only STEP ...] [--scratch]

Each step is a pytest process of its own, with a time budget (seconds):

=============  ================================================================  ======
step           what                                                              budget
=============  ================================================================  ======
tests          ``pytest -m gpu`` of the test files that mark tests ``gpu``           90
               (``-n 8`` where pytest-xdist is installed)
kernels        ``perf/benchmarks/test_bench_kernels.py``                             45
engine         ``perf/benchmarks/test_bench_engine_gpu.py``                          45
launch         ``perf/benchmarks/test_bench_launch.py -m gpu`` (host cost)           40
compression    ``perf/benchmarks/test_bench_compression.py -m gpu`` (Triton)         50
report         ``python -m perf.report`` of this device's results files              20
=============  ================================================================  ======

A step past its budget is interrupted (SIGINT, so that pytest still merges the rows it has
measured; SIGKILL ``GRACE_SECONDS`` later) and the next step runs. No step starts past the
whole run's budget (``--total``, 300 s); the report always gets its share.

Writes the benchmarks' rows into ``perf/results/<device>.json`` and
``perf/results/<device>-launch.json`` (pytest's ``--save-results``; with ``--scratch``,
into ``perf/results/scratch/``), and into ``--out`` after every step, so that a run cut off
still leaves what it measured: copies of those files, ``gpu-bench.json`` (the machine with
its driver, CUDA or ROCm, torch, Triton, Python; every step's status, seconds, budget,
exit code, rows and output tail), ``gpu-bench.log`` (every step's output) and
``report.md`` (the report of this device's files; its plots stay behind).

Exit status: 0 when every step passed; 1 when one did not (failed, ran out of time, or
measured no row); 2 when nothing could run (no torch, no GPU, no Triton), said in one line
within seconds.

kvtier's chunk hashing imports ``cbor2``, which some GPU images lack: when it does not
import and ``--wheels`` (default ``.whl/``) holds wheels, they are installed with
``pip --no-index --no-deps`` into a temporary folder on the steps' ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TextIO

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "perf" / "results"
DEFAULT_OUT = RESULTS_DIR / "scratch" / "gpu-bench"
TOTAL_SECONDS = 300.0
GRACE_SECONDS = 15.0  # after SIGINT, for pytest to write its rows
MIN_STEP_SECONDS = 10.0  # a step with less time left is not started
TAIL_LINES = 40
XDIST_WORKERS = 8
NO_GPU = 2


@dataclass(frozen=True, slots=True)
class Step:
    """One step: ``python <args>`` with ``budget`` seconds. ``saves``: a benchmark, given
    ``--save-results``; ``parallel``: given ``-n`` where pytest-xdist is installed."""

    name: str
    what: str
    args: tuple[str, ...]
    budget: float
    saves: bool = True
    parallel: bool = False


def pytest_step(name: str, what: str, budget: float, *args: str, **kinds: bool) -> Step:
    return Step(
        name, what, ("-m", "pytest", "-q", "-p", "no:cacheprovider", *args), budget, **kinds
    )


def gpu_test_files() -> list[str]:
    """The test files with ``gpu``-marked tests: collecting only them keeps a module that
    needs what a GPU image lacks (vLLM, pyzmq, redis) from failing the step."""
    files = (ROOT / "tests").rglob("test_*.py")
    return sorted(str(p.relative_to(ROOT)) for p in files if "pytest.mark.gpu" in p.read_text())


BENCH = "perf/benchmarks"
STEPS: tuple[Step, ...] = (
    pytest_step("tests", "the GPU-marked tests", 90, "-m", "gpu", *gpu_test_files(),
                "--continue-on-collection-errors", saves=False, parallel=True),
    pytest_step("kernels", "kernel benchmark", 45, f"{BENCH}/test_bench_kernels.py"),
    pytest_step("engine", "engine store / retrieve / both at once, GPU pages <-> pinned CPU tier", 45,
                f"{BENCH}/test_bench_engine_gpu.py"),
    pytest_step("launch", "host cost per call, GPU rows", 40, "-m", "gpu",
                f"{BENCH}/test_bench_launch.py"),
    pytest_step("compression", "CacheGen Triton coder on the GPU", 50, "-m", "gpu",
                f"{BENCH}/test_bench_compression.py"),
)  # fmt: skip
REPORT = Step("report", "the report of this device's results", ("-m", "perf.report"), 20, False)


@dataclass(slots=True)
class StepResult:
    name: str
    what: str
    status: str  # passed, failed, timed out, no rows (a benchmark that measured none), not run
    budget_s: float
    seconds: float = 0.0
    exit_code: int | None = None
    rows: int = 0
    command: list[str] = field(default_factory=list)
    note: str = ""
    tail: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------------------
# what the machine has
# ---------------------------------------------------------------------------------------


def missing_gpu() -> str | None:
    """Why this machine cannot run the GPU steps (one line), or None when it can."""
    if importlib.util.find_spec("torch") is None:
        return "torch is not installed"
    import torch

    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "no CUDA"
        if torch.version.hip:
            build = f"ROCm {torch.version.hip}"
        return f"no GPU: torch {torch.__version__} ({build}) sees none"
    if importlib.util.find_spec("triton") is None:
        return f"triton is not installed (torch {torch.__version__} sees a GPU)"
    return None


def wheel_site(wheels: Path, scratch: Path, log: TextIO) -> Path | None:
    """A folder with ``wheels`` installed, when cbor2 is missing and there are wheels."""
    if importlib.util.find_spec("cbor2") is not None:
        return None
    found = sorted(wheels.glob("*.whl")) if wheels.is_dir() else []
    if not found:
        say(log, f"gpu-bench: cbor2 is missing and {wheels}/ holds no wheel: steps that "
            "import kvtier's hashing will fail (docs/performance.md: carry its wheel)")  # fmt: skip
        return None
    site = scratch / "site"
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
           "--no-compile", "--target", str(site), *map(str, found)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        say(log, f"gpu-bench: installing {wheels}/*.whl failed:\n{done.stdout}{done.stderr}")
        return None
    say(log, f"gpu-bench: cbor2 was missing: installed {[w.name for w in found]} into {site}")
    return site


def step_env(site: Path | None) -> dict[str, str]:
    paths = [str(ROOT)] + ([str(site)] if site else [])
    if os.environ.get("PYTHONPATH"):
        paths.append(os.environ["PYTHONPATH"])
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "PYTHONUNBUFFERED": "1"}


# ---------------------------------------------------------------------------------------
# running a step
# ---------------------------------------------------------------------------------------


def say(log: TextIO, text: str) -> None:
    print(text, flush=True)
    log.write(text + "\n")
    log.flush()


def run_bounded(
    cmd: list[str], budget: float, env: dict[str, str], log: TextIO
) -> tuple[int | None, bool, float, list[str]]:
    """Run ``cmd`` in the repository root, its output to stdout and ``log``, for at most
    ``budget`` seconds (then SIGINT, and SIGKILL ``GRACE_SECONDS`` later, to its whole
    process group). Returns (exit code, timed out, seconds, the output's last lines)."""
    started = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        start_new_session=True,
    )
    tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            log.write(line)
            tail.append(line.rstrip("\n"))

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    timed_out = False
    try:
        code = proc.wait(timeout=budget)
    except subprocess.TimeoutExpired:
        timed_out = True
        _signal_group(proc, signal.SIGINT)
        try:
            code = proc.wait(timeout=GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)
            code = proc.wait()
    reader.join(timeout=5)
    log.flush()
    return code, timed_out, time.monotonic() - started, list(tail)


def _signal_group(proc: subprocess.Popen, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):  # it has ended already
        os.killpg(proc.pid, sig)


def row_stamps(files: list[Path]) -> set[tuple[str, str, str, str]]:
    """Every row in ``files`` as (file, benchmark, metric, date): a step's rows are the
    stamps present after it that were not before it (a row dated in the second an earlier
    step ended in is that step's, not a later one's)."""
    stamps = set()
    for path in files:
        try:
            rows = json.loads(path.read_text()).get("results", [])
        except (OSError, ValueError, AttributeError):
            continue
        stamps.update(
            (
                path.name,
                str(r.get("benchmark", "")),
                str(r.get("metric", "")),
                str(r.get("date", "")),
            )
            for r in rows
            if isinstance(r, dict)
        )
    return stamps


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


# ---------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------


@dataclass(slots=True)
class Run:
    """One ``gpu-bench`` run: where it reads and writes, and what it has done so far."""

    out: Path
    results_dir: Path
    device: str  # the results files' stem, ``device_slug`` of the GPU's name
    machine: dict
    total: float
    log: TextIO
    env: dict[str, str]
    save: bool = True
    started: float = field(default_factory=time.monotonic)
    steps: list[StepResult] = field(default_factory=list)

    def device_files(self) -> list[Path]:
        """This device's results files: ``<device>.json``, ``<device>-<suffix>.json``."""
        names = [self.results_dir / f"{self.device}.json"]
        names += sorted(self.results_dir.glob(f"{self.device}-*.json"))
        return [p for p in names if p.is_file()]

    def left(self) -> float:
        return self.total - (time.monotonic() - self.started)

    def command(self, step: Step) -> list[str]:
        cmd = [sys.executable, *step.args]
        if step.parallel and importlib.util.find_spec("xdist") is not None:
            cmd += ["-n", str(min(XDIST_WORKERS, os.cpu_count() or 1))]
        if step.saves and self.save:
            cmd.append("--save-results")
        return cmd

    def run_step(self, step: Step, reserve: float) -> StepResult:
        """``step`` within its budget and what the run has left (less ``reserve``)."""
        budget = min(step.budget, self.left() - reserve - GRACE_SECONDS)
        result = StepResult(step.name, step.what, "not run", round(step.budget, 1))
        if budget < MIN_STEP_SECONDS:
            result.note = (
                f"not started: {max(self.left(), 0):.0f} s left of the run's {self.total:.0f}"
            )
            say(self.log, f"gpu-bench: step {step.name}: {result.note}")
            return self.finish(result)
        say(self.log, f"\n=== gpu-bench step {step.name}: {step.what} (budget {budget:.0f} s)")
        if step is REPORT:
            return self.finish(self._report(result, budget))
        before = row_stamps(self.device_files())
        result.command = self.command(step)
        code, timed_out, seconds, tail = run_bounded(result.command, budget, self.env, self.log)
        result.exit_code, result.seconds, result.tail = code, round(seconds, 1), tail
        result.rows = len(row_stamps(self.device_files()) - before) if step.saves else 0
        result.status = "timed out" if timed_out else ("passed" if code == 0 else "failed")
        if timed_out:
            result.note = f"interrupted after {budget:.0f} s; rows measured until then are kept"
        elif result.status == "passed" and step.saves and not result.rows:
            result.status, result.note = "no rows", "every benchmark was skipped: see the tail"
        return self.finish(result)

    def _report(self, result: StepResult, budget: float) -> StepResult:
        """``python -m perf.report`` of this device's files alone; ``report.md`` to ``out``."""
        if importlib.util.find_spec("matplotlib") is None:
            result.note = "matplotlib is missing: render the report where the results land"
            return result
        files = self.device_files()
        if not files:
            result.note = "no results file of this device to render"
            return result
        with tempfile.TemporaryDirectory(prefix="gpu-bench-report-") as tmp:
            results, rendered = Path(tmp) / "results", Path(tmp) / "report"
            results.mkdir()
            for path in files:
                shutil.copy2(path, results / path.name)
            cmd = [*self.command(REPORT), "--results", str(results), "--out", str(rendered)]
            result.command = cmd
            code, timed_out, seconds, tail = run_bounded(cmd, budget, self.env, self.log)
            if (rendered / "report.md").is_file():
                shutil.copy2(rendered / "report.md", self.out / "report.md")
        result.exit_code, result.seconds, result.tail = code, round(seconds, 1), tail
        result.status = "timed out" if timed_out else ("passed" if code == 0 else "failed")
        return result

    def finish(self, result: StepResult) -> StepResult:
        self.steps.append(result)
        self.write()
        return result

    def write(self, status: str = "running") -> None:
        """Copy this device's results files to ``out`` and write ``gpu-bench.json``."""
        copied = []
        for path in self.device_files():
            if path.resolve().parent != self.out.resolve():
                shutil.copy2(path, self.out / path.name)
            copied.append(path.name)
        summary = {
            "status": status,
            "machine": self.machine,
            "total_budget_s": self.total,
            "seconds": round(time.monotonic() - self.started, 1),
            "results_dir": os.path.relpath(self.results_dir, ROOT),
            "results_files": copied,
            "steps": [asdict(s) for s in self.steps],
        }
        (self.out / "gpu-bench.json").write_text(json.dumps(summary, indent=2) + "\n")


def run_all(run: Run, steps: list[Step]) -> int:
    """Every step, then the report; returns the exit status (0 or 1)."""
    for i, step in enumerate(steps):
        later = sum(min(s.budget, MIN_STEP_SECONDS) for s in steps[i + 1 :])
        run.run_step(step, reserve=REPORT.budget + later)
    run.run_step(REPORT, reserve=0)
    ok = all(s.status == "passed" for s in run.steps if s.name != REPORT.name)
    run.write("passed" if ok else "failed")
    say(run.log, "\n=== gpu-bench summary")
    for s in run.steps:
        rows = f", {s.rows} rows" if s.rows else ""
        note = f" ({s.note})" if s.note else ""
        say(
            run.log,
            f"  {s.name:<12} {s.status:<9} {s.seconds:6.1f} s of {s.budget_s:.0f}{rows}{note}",
        )
    say(run.log, f"  total {time.monotonic() - run.started:.1f} s; results in {run.out}")
    return 0 if ok else 1


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m perf.gpu_bench",
        description="kvtier's GPU tests and benchmarks in one bounded run (make gpu-bench).",
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help="where the summary, log, results copies and report.md go")  # fmt: skip
    parser.add_argument("--only", action="append", choices=[s.name for s in STEPS],
                        help="run only this step (repeatable); the report follows")  # fmt: skip
    parser.add_argument("--scratch", action="store_true",
                        help="rows into perf/results/scratch/, not the committed files")  # fmt: skip
    parser.add_argument("--total", type=float, default=TOTAL_SECONDS,
                        help="seconds for the whole run (default %(default)s)")  # fmt: skip
    parser.add_argument("--wheels", type=Path, default=ROOT / ".whl",
                        help="wheels installed when cbor2 is missing (default .whl/)")  # fmt: skip
    parser.add_argument("--list", action="store_true", help="print the steps and exit")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()  # --total counts from here
    args = parse_args(argv)
    steps = [s for s in STEPS if not args.only or s.name in args.only]
    if args.list:
        for s in [*steps, REPORT]:
            print(f"{s.name:<12} {s.budget:4.0f} s  {s.what}")
        return 0
    why = missing_gpu()
    if why:
        print(f"gpu-bench: {why}. make gpu-bench needs a CUDA or ROCm GPU with torch and "
              "Triton; docs/performance.md runs it on a lent GPU machine.", file=sys.stderr)  # fmt: skip
        return NO_GPU
    from perf.benchmarks.machine_info import describe_machine, device_slug

    machine = describe_machine(_now())
    args.out.mkdir(parents=True, exist_ok=True)
    results_dir = RESULTS_DIR if not args.scratch else RESULTS_DIR / "scratch"
    with open(args.out / "gpu-bench.log", "w") as log, tempfile.TemporaryDirectory() as tmp:
        say(log, f"gpu-bench: {json.dumps(machine)}")
        site = wheel_site(args.wheels, Path(tmp), log)
        run = Run(args.out, results_dir, device_slug(machine["device"]), machine, args.total,
                  log, step_env(site), save=not args.scratch, started=started)  # fmt: skip
        return run_all(run, steps)


if __name__ == "__main__":
    sys.exit(main())
