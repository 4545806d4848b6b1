"""The sweep behind ``kvtier tune``: build one problem per tunable op and shape, check
every candidate launch config against the op's torch reference (bit-exact for copies,
within a stated tolerance for RoPE), time the ones that pass, and write the fastest into
per-device JSON tuning files (:mod:`~kvtier_kernels.tuning.files`) that the launchers read
through :mod:`~kvtier_kernels.tuning.lookup`. There is no ``@triton.autotune``: its
first-call benchmarking would stall a serving engine.

Here: timing (:func:`event_timer`), :func:`tune_problem`, :func:`run_problems`,
:func:`tune`, and :data:`SWEEPS`, the sweep entry of each tunable op. Used only by
``kvtier tune`` (and tests); no launcher imports it.

Importing this module imports neither triton nor vLLM, and touches no GPU driver.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import importlib.metadata
import platform
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvtier_kernels.dtypes import dtype_name
from kvtier_kernels.tuning import paged, rope
from kvtier_kernels.tuning.copy_engine import measure_copy_engine
from kvtier_kernels.tuning.files import (
    TUNABLES,
    CopyEngineFigures,
    TuningEntry,
    TuningFile,
    device_name,
)
from kvtier_kernels.tuning.lookup import save_tuning_file, searching_first
from kvtier_kernels.tuning.problem import Progress, Timer, TuningProblem
from kvtier_kernels.tuning.shapes import ModelShape

__all__ = [
    "SWEEPS",
    "ProblemResult",
    "Progress",
    "Timer",
    "TuneReport",
    "build_problems",
    "event_timer",
    "run_problems",
    "tune",
    "tune_problem",
]


# ---------------------------------------------------------------------------------------
# the sweep entries
# ---------------------------------------------------------------------------------------

Sweep = Callable[..., "TuningProblem | str"]
"""``sweep(op, shape, device, backend, *, chunk_memory, quick)``: the problem for ``op``
at ``shape``, or a note saying why the op is skipped for it."""

SWEEPS: dict[str, Sweep] = {
    "paged_gather": paged.sweep,
    "paged_scatter": paged.sweep,
    "rope_rerotate": rope.sweep,
}
"""The sweep entry of each tunable op (``files.TUNABLES``)."""


def build_problems(
    shape: ModelShape,
    *,
    device: torch.device | str,
    backend: str,
    ops: Sequence[str] = tuple(sorted(TUNABLES)),
    chunk_memory: str = "pinned",
    quick: bool = False,
) -> tuple[list[TuningProblem], list[str]]:
    """The problems :func:`tune` runs for ``shape``, and notes on ops it skips (RoPE for
    fp8 caches or models without RoPE). Nothing is allocated on ``device`` yet. An op named
    twice is one problem: two would write two entries of one key, a file no launcher reads.

    Raises:
        ValueError: an op that is not tunable.
    """
    device = torch.device(device)
    problems: list[TuningProblem] = []
    notes: list[str] = []
    for op in dict.fromkeys(ops):
        if op not in TUNABLES or op not in SWEEPS:
            raise ValueError(f"op {op!r} is not tunable; tunable ops: {', '.join(TUNABLES)}")
        found = SWEEPS[op](op, shape, device, backend, chunk_memory=chunk_memory, quick=quick)
        if isinstance(found, str):
            notes.append(found)
        else:
            problems.append(found)
    return problems, notes


# ---------------------------------------------------------------------------------------
# timing and the sweep
# ---------------------------------------------------------------------------------------


def event_timer(device: torch.device | str, *, flush_bytes: int = 256 << 20) -> Timer:
    """A :data:`Timer` for a CUDA/ROCm ``device``: CUDA/HIP events around each call on the
    current stream, with the L2 cache flushed (``flush_bytes`` zeroed) before each."""
    device = torch.device(device)
    flush = torch.empty(flush_bytes, dtype=torch.int8, device=device)

    def timer(fn: Callable[[], None], warmup: int, repeats: int) -> list[float]:
        with torch.cuda.device(device):
            for _ in range(warmup):
                fn()
            torch.cuda.synchronize(device)
            events = [
                (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                for _ in range(repeats)
            ]
            for start, end in events:
                flush.zero_()  # also keeps the GPU busy while the launch is enqueued
                start.record()
                fn()
                end.record()
            torch.cuda.synchronize(device)
            return [start.elapsed_time(end) * 1e-3 for start, end in events]

    return timer


def _describe_config(config: Any) -> str:
    return " ".join(f"{f.name}={getattr(config, f.name)}" for f in dataclasses.fields(config))


@dataclass(slots=True)
class ProblemResult:
    """What :func:`tune_problem` found for one problem.

    Attributes:
        problem: the problem.
        timed: ``(config, median seconds)`` of every candidate that passed the check.
        rejected: ``(config, reason)`` of every candidate that did not (or did not run).
        best: the fastest checked config, or None when every candidate was rejected.
        best_s / heuristic_s: their median seconds (None when not timed).
    """

    problem: TuningProblem
    timed: list[tuple[Any, float]]
    rejected: list[tuple[Any, str]]
    best: Any | None
    best_s: float | None
    heuristic_s: float | None

    def entry(self) -> TuningEntry | None:
        """The tuning-file entry for the best config (None if there is none)."""
        if self.best is None or self.best_s is None:
            return None
        p = self.problem
        return TuningEntry(
            key=dict(p.key),
            config=dataclasses.asdict(self.best),
            median_us=round(self.best_s * 1e6, 3),
            gbps=round(p.bytes_moved / self.best_s / 1e9, 3) if self.best_s > 0 else None,
            heuristic_us=None if self.heuristic_s is None else round(self.heuristic_s * 1e6, 3),
            candidates=len(self.timed),
            rejected=len(self.rejected),
            shape=dict(p.shape),
        )


def tune_problem(
    problem: TuningProblem,
    *,
    timer: Timer,
    warmup: int = 5,
    repeats: int = 25,
    progress: Progress | None = None,
    counter: tuple[int, int] = (0, 0),
) -> ProblemResult:
    """Check every candidate of ``problem`` against the reference, time the ones that
    pass with ``timer`` (median of ``repeats``), and pick the fastest.

    A candidate that raises (fails to compile or launch) is rejected like one that gives a
    wrong result. ``counter`` is (candidates done before this problem, total) for
    progress lines.
    """
    say = progress or (lambda _message: None)
    done, total = counter
    total = total or len(problem.candidates)
    width = len(str(total))
    timed: list[tuple[Any, float]] = []
    rejected: list[tuple[Any, str]] = []
    heuristic_s = None
    problem.setup()
    try:
        for i, config in enumerate(problem.candidates, start=done + 1):
            label = f"[{i:>{width}}/{total}] {problem.describe()}: {_describe_config(config)}"
            try:
                reason = problem.check(config)
                if reason is None:
                    times = timer(functools.partial(problem.run, config), warmup, repeats)
            except Exception as error:  # a config that cannot compile or launch
                reason = f"failed to run: {type(error).__name__}: {error}".splitlines()[0]
            if reason is not None:
                rejected.append((config, reason))
                say(f"{label}  REJECTED ({reason})")
                continue
            median = statistics.median(times)
            timed.append((config, median))
            if config == problem.heuristic:
                heuristic_s = median
            rate = f"  {problem.bytes_moved / median / 1e9:8.1f} GB/s" if median > 0 else ""
            mark = "  (heuristic)" if config == problem.heuristic else ""
            say(f"{label}  {median * 1e6:10.2f} us{rate}{mark}")
    finally:
        problem.teardown()
    for config, reason in rejected:
        if config == problem.heuristic:
            say(f"WARNING: {problem.describe()}: the built-in heuristic's config failed: {reason}")
    best, best_s = min(timed, key=lambda item: item[1]) if timed else (None, None)
    return ProblemResult(problem, timed, rejected, best, best_s, heuristic_s)


def _versions() -> dict[str, str]:
    versions = {"torch": torch.__version__, "python": platform.python_version()}
    for dist in ("triton", "kvtier"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[dist] = importlib.metadata.version(dist)
    if torch.version.cuda:
        versions["cuda"] = torch.version.cuda
    if torch.version.hip:
        versions["hip"] = torch.version.hip
    return versions


def run_problems(
    problems: Sequence[TuningProblem],
    *,
    device: torch.device | str,
    backend: str,
    timer: Timer,
    warmup: int = 5,
    repeats: int = 25,
    progress: Progress | None = None,
) -> tuple[list[ProblemResult], list[TuningFile]]:
    """Run :func:`tune_problem` on each problem, one at a time, and group the entries
    into tuning files (one per op and dtype) for ``device``."""
    device = torch.device(device)
    name = device_name(device)
    if name is None:
        raise ValueError(f"cannot name device {device} for tuning files")
    total = sum(len(p.candidates) for p in problems)
    results, files, done = [], {}, 0
    created = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    for problem in problems:
        result = tune_problem(
            problem,
            timer=timer,
            warmup=warmup,
            repeats=repeats,
            progress=progress,
            counter=(done, total),
        )
        done += len(problem.candidates)
        results.append(result)
        entry = result.entry()
        if entry is None:
            continue
        file_key = (problem.op, dtype_name(problem.dtype))
        if file_key not in files:
            files[file_key] = TuningFile(
                op=problem.op,
                backend=backend,
                device=name,
                dtype=dtype_name(problem.dtype),
                entries=[],
                versions=_versions(),
                created=created,
            )
        files[file_key].entries.append(entry)
    return results, list(files.values())


# ---------------------------------------------------------------------------------------
# the whole pipeline
# ---------------------------------------------------------------------------------------


@dataclass(slots=True)
class TuneReport:
    """What :func:`tune` did.

    Attributes:
        results: one per problem run.
        files: the tuning files produced (with copy-engine figures when measured).
        written: the paths written (empty when no directory was given).
        copy_engine: the copy-engine figures per op, when measured.
        notes: ops skipped and why.
    """

    results: list[ProblemResult]
    files: list[TuningFile]
    written: list[Path]
    copy_engine: dict[str, CopyEngineFigures]
    notes: list[str]


def tune(
    shape: ModelShape,
    *,
    device: torch.device | str,
    backend: str,
    timer: Timer,
    out_dir: str | Path | None,
    ops: Sequence[str] = tuple(sorted(TUNABLES)),
    chunk_memory: str = "pinned",
    quick: bool = False,
    warmup: int = 5,
    repeats: int = 25,
    copy_engine: bool = True,
    copy_engine_max_bytes: int = 64 << 20,
    progress: Progress | None = None,
    problems: Sequence[TuningProblem] | None = None,
) -> TuneReport:
    """Sweep, check, time and write tuning files for ``shape`` on ``device``.

    Steps: build the problems (or take ``problems``), run them (:func:`run_problems`),
    write the files into ``out_dir`` (merged with what is there), then, when
    ``copy_engine`` and a paged copy was tuned, measure the copy-engine crossover with the
    new configs in effect and write it into the paged-copy files. ``out_dir=None`` writes
    nothing (and measures the crossover with the configs in effect before).

    ``kvtier tune`` calls this with the GPU, ``backend="triton"`` and :func:`event_timer`;
    tests call it with the CPU, ``"interpret"`` and a fake timer.
    """
    device = torch.device(device)
    notes: list[str] = []
    if problems is None:
        problems, notes = build_problems(
            shape, device=device, backend=backend, ops=ops, chunk_memory=chunk_memory, quick=quick
        )
    results, files = run_problems(
        problems,
        device=device,
        backend=backend,
        timer=timer,
        warmup=warmup,
        repeats=repeats,
        progress=progress,
    )
    written = [save_tuning_file(f, out_dir) for f in files] if out_dir is not None else []
    figures: dict[str, CopyEngineFigures] = {}
    paged_files = [f for f in files if f.op in ("paged_gather", "paged_scatter")]
    if copy_engine and paged_files:
        # NOTE: the output directory may not be on the search path: put it first while
        # measuring, so that the kernel runs with the configs just tuned.
        with searching_first(out_dir):
            figures = measure_copy_engine(
                shape,
                device=device,
                backend=backend,
                timer=timer,
                warmup=warmup,
                repeats=repeats,
                max_bytes=copy_engine_max_bytes,
                progress=progress,
            )
        for f in paged_files:
            f.copy_engine = figures.get(f.op)
        if out_dir is not None:
            written = [save_tuning_file(f, out_dir) for f in files]
    return TuneReport(results, files, written, figures, notes)
