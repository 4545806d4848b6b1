"""Per-device launch parameters for the Triton kernels: the files, their lookup at run
time, and the sweep that writes them (``kvtier tune``).

Every Triton launcher asks its op's ``launch_config(...)`` for tile sizes and warps; that
function first calls :func:`tuned_config` here, and an entry of a matching per-device JSON
file wins over the op's built-in heuristic. There is no ``@triton.autotune``: its
first-call benchmarking would stall a serving engine. The files are written ahead of time
by :func:`tune`, which checks every candidate against the torch reference (bit-exact for

This module is the sweep (timing, the copy-engine crossover, :func:`tune`) and re-exports
the public names of the modules it is built from:

- :mod:`kvtier_kernels.tuning_files`: tunable ops, file names, reading and writing files;
- :mod:`kvtier_kernels.tuning_lookup`: the search path and :func:`tuned_config`;
- :mod:`kvtier_kernels.tuning_shapes`: :class:`ModelShape` and model configs;
- :mod:`kvtier_kernels.tuning_problems`: candidates and the per-op problems.

Importing this module imports neither triton nor the op modules, and touches no GPU driver.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import importlib.metadata
import platform
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvtier_kernels import tuning_lookup
from kvtier_kernels.layouts import PagedKV, get_layout
from kvtier_kernels.tuning_files import (
    SCHEMA_VERSION,
    TUNABLES,
    CopyEngineFigures,
    TuningEntry,
    TuningFile,
    TuningFileError,
    device_name,
    dtype_name,
    file_name,
    load_tuning_file,
    save_tuning_file,
)
from kvtier_kernels.tuning_lookup import (
    PACKAGED_DIR,
    TUNING_DIR_ENV,
    FileStatus,
    _format_bytes,
    clear_cache,
    default_user_dir,
    files_in_effect,
    find_tuning_file,
    prepend_search_path,
    search_path,
    set_search_path,
    tuned_config,
    user_dirs,
)
from kvtier_kernels.tuning_problems import (
    PagedCopyProblem,
    RopeProblem,
    TuningProblem,
    _fill_random_bits_,
    _sync,
    build_problems,
    paged_copy_candidates,
    rope_candidates,
)
from kvtier_kernels.tuning_shapes import (
    ModelShape,
    model_shape_from_config,
    parse_dtype,
    read_model_config,
)

__all__ = [
    "PACKAGED_DIR",
    "SCHEMA_VERSION",
    "TUNABLES",
    "TUNING_DIR_ENV",
    "CopyEngineFigures",
    "FileStatus",
    "ModelShape",
    "PagedCopyProblem",
    "ProblemResult",
    "RopeProblem",
    "TuneReport",
    "TuningEntry",
    "TuningFile",
    "TuningFileError",
    "TuningProblem",
    "build_problems",
    "clear_cache",
    "default_user_dir",
    "device_name",
    "dtype_name",
    "event_timer",
    "file_name",
    "files_in_effect",
    "find_crossover",
    "find_tuning_file",
    "load_tuning_file",
    "measure_copy_engine",
    "model_shape_from_config",
    "paged_copy_candidates",
    "parse_dtype",
    "prepend_search_path",
    "read_model_config",
    "rope_candidates",
    "run_problems",
    "save_tuning_file",
    "search_path",
    "set_search_path",
    "tune",
    "tune_problem",
    "tuned_config",
    "user_dirs",
]


# ---------------------------------------------------------------------------------------
# timing and the sweep
# ---------------------------------------------------------------------------------------

Timer = Callable[[Callable[[], None], int, int], list[float]]
"""``timer(fn, warmup, repeats)``: call ``fn`` ``warmup`` times untimed, then return the
seconds of each of ``repeats`` timed calls."""

Progress = Callable[[str], None]


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
# copy engine against the kernel
# ---------------------------------------------------------------------------------------


def find_crossover(points: Sequence[Mapping[str, float]]) -> int | None:
    """The smallest ``bytes`` from which on ``copy_us < kernel_us`` at every point
    (``points`` in any order), or None when the kernel wins at the largest size."""
    ordered = sorted(points, key=lambda p: p["bytes"])
    crossover = None
    for point in reversed(ordered):
        if point["copy_us"] < point["kernel_us"]:
            crossover = int(point["bytes"])
        else:
            break
    return crossover


def _pages_layout(layout: str) -> str:
    """``layout`` if one layer's blocks are contiguous runs in memory, else ``vllm_nhd``."""
    kv_layout = get_layout(layout)
    storage = (kv_layout.storage or kv_layout.dims).split()
    return layout if storage[0] == "NB" and not kv_layout.cross_layer else "vllm_nhd"


def measure_copy_engine(
    shape: ModelShape,
    *,
    device: torch.device | str,
    backend: str,
    timer: Timer,
    warmup: int = 5,
    repeats: int = 25,
    max_bytes: int = 64 << 20,
    progress: Progress | None = None,
) -> dict[str, CopyEngineFigures]:
    """Time, per size of a contiguous run of pages of one layer (1, 2, 4, ... blocks up to
    ``max_bytes``), the kernel (with the launch parameters in effect) against one
    ``copy_(non_blocking=True)`` of the same bytes, both ways between the device and
    pinned host memory; return the figures per op (``paged_gather``: device to host,
    ``paged_scatter``: host to device).

    The cache uses ``shape.layout`` when its blocks are contiguous runs (NB outermost in
    memory), else ``vllm_nhd``.
    """
    from kvtier_kernels import registry

    say = progress or (lambda _message: None)
    device = torch.device(device)
    layout = _pages_layout(shape.layout)
    kv = get_layout(layout).kv_planes
    s = shape
    block_elems = kv * s.block_size * s.num_kv_heads * s.head_size
    block_bytes = block_elems * s.dtype.itemsize
    max_blocks = 1 << max(0, (max(1, max_bytes // block_bytes)).bit_length() - 1)
    paged = PagedKV.empty(
        layout,
        num_layers=1,
        num_blocks=max_blocks,
        block_size=s.block_size,
        num_heads=s.num_kv_heads,
        head_size=s.head_size,
        dtype=s.dtype,
        device=device,
    )
    _fill_random_bits_(paged.tensors[0], torch.Generator().manual_seed(1))
    layer = paged.tensors[0]
    pinned = device.type == "cuda"
    host_pages = torch.empty(max_blocks * block_elems, dtype=s.dtype, pin_memory=pinned)
    host_chunk = torch.empty(max_blocks * block_elems, dtype=s.dtype, pin_memory=pinned)
    base = layer.storage_offset()
    if layer.stride(get_layout(layout).axes.index("NB")) != block_elems:
        raise AssertionError(f"layout {layout}: blocks are not contiguous runs of {block_elems}")
    figures = {}
    for op, direction in (("paged_gather", "device_to_host"), ("paged_scatter", "host_to_device")):
        impl = registry.get(op, backend, device)
        points = []
        blocks = 1
        while blocks <= max_blocks:
            tokens = blocks * s.block_size
            slots = torch.arange(tokens, device=device)
            chunk = host_chunk[: kv * tokens * s.num_kv_heads * s.head_size].view(
                paged.chunk_shape(tokens)
            )
            pages = layer.as_strided((blocks * block_elems,), (1,), base)  # blocks [0, blocks)
            host = host_pages[: blocks * block_elems]
            source, target = (pages, host) if op == "paged_gather" else (host, pages)

            def kernel(slots=slots, chunk=chunk, impl=impl) -> None:
                impl(paged, slots, chunk)

            def copy(source=source, target=target) -> None:
                target.copy_(source, non_blocking=True)

            kernel_s = statistics.median(timer(kernel, warmup, repeats))
            copy_s = statistics.median(timer(copy, warmup, repeats))
            nbytes = blocks * block_bytes
            points.append(
                {
                    "bytes": nbytes,
                    "kernel_us": round(kernel_s * 1e6, 3),
                    "copy_us": round(copy_s * 1e6, 3),
                }
            )
            say(
                f"copy engine {direction}: {_format_bytes(nbytes):>10}  kernel "
                f"{kernel_s * 1e6:9.2f} us  copy_ {copy_s * 1e6:9.2f} us"
            )
            blocks *= 2
        figures[op] = CopyEngineFigures(
            direction=direction,
            crossover_bytes=find_crossover(points),
            points=points,
            shape={
                "layout": layout,
                "block_bytes": block_bytes,
                "block_size": s.block_size,
                "num_kv_heads": s.num_kv_heads,
                "head_size": s.head_size,
                "cache_dtype": dtype_name(s.dtype),
            },
        )
    _sync(device)
    return figures


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
    ops: Sequence[str] = tuple(TUNABLES),
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
        saved = tuning_lookup._override
        if out_dir is not None:
            set_search_path((Path(out_dir), *search_path()))
        try:
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
        finally:
            set_search_path(saved)
        for f in paged_files:
            f.copy_engine = figures.get(f.op)
        if out_dir is not None:
            written = [save_tuning_file(f, out_dir) for f in files]
    return TuneReport(results, files, written, figures, notes)
