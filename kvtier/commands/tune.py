"""``kvtier tune``: sweep the Triton kernels' launch parameters on the local GPU for one
model's KV shape and write per-device tuning files; refuses without a GPU."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from kvtier.commands.model_shape import add_shape_arguments, device_from_flag, shape_from_args
from kvtier.commands.paths import why_not_writable

HELP = "sweep the Triton kernels' launch parameters on the local GPU; write tuning files"
DESCRIPTION = (
    "Sweep each kernel's launch parameters on the local GPU for one model's "
    "KV shape, check every candidate against the torch reference, time the rest "
    "(CUDA/HIP events, median) and write per-device JSON tuning files that the "
    "launchers load at run time. Also measures where a copy-engine transfer beats the "
    "paged-copy kernel. Refuses without a GPU."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    shape = parser.add_argument_group("model shape (flags override --model-config)")
    add_shape_arguments(shape)
    shape.add_argument("--chunk-size", type=int, help="kvtier chunk size (default 256)")
    shape.add_argument("--layout", help="engine KV layout (default vllm_nhd; MLA models: mla)")
    shape.add_argument("--rotary-dim", type=int, help="rotary dims per head (0: no RoPE)")
    parser.add_argument(
        "--ops",
        default="paged_gather,paged_scatter,rope_rerotate",
        help="comma-separated ops to tune (default: all)",
    )
    parser.add_argument(
        "--chunk-memory",
        choices=("pinned", "device"),
        default="pinned",
        help="where the paged copies' chunk buffer lives while timing (default pinned host)",
    )
    parser.add_argument("--quick", action="store_true", help="a smaller sweep (4 or 8 warps, ...)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed runs per candidate")
    parser.add_argument("--repeats", type=int, default=25, help="timed runs per candidate (median)")
    parser.add_argument(
        "--no-copy-engine", action="store_true", help="skip the copy-engine crossover measurement"
    )
    parser.add_argument(
        "--copy-engine-max-mib",
        type=int,
        default=64,
        help="largest contiguous run of pages timed for the crossover (MiB, default 64)",
    )
    parser.add_argument("--device", default="cuda", help="the GPU to tune (default: current)")
    parser.add_argument(
        "--out",
        help="directory to write into (default: KVTIER_TUNING_DIR or ~/.cache/kvtier/tuning)",
    )


_NO_GPU = (
    "needs a CUDA or ROCm GPU that Triton can drive, and {why}. Launch parameters tuned "
    "under Triton's interpreter on the CPU would be meaningless, so nothing was tuned; the "
    "kernels keep their built-in heuristics (and any tuning files already on the search "
    "path: see `kvtier kernels`)."
)


def _tuning_target(device: torch.device) -> tuple[object, str, object] | str:
    """``(device, backend, timer)`` for ``kvtier tune`` on ``device`` (a GPU, or its
    index checked by :func:`device_from_flag`), or why there is none."""
    from kvtier_kernels import registry
    from kvtier_kernels.tuning import sweep as tuning

    if not torch.cuda.is_available():
        return _NO_GPU.format(why="torch sees none (torch.cuda.is_available() is False)")
    if registry.available_backends()["triton"].startswith("triton not installed"):
        return _NO_GPU.format(why="triton is not installed")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device, "triton", tuning.event_timer(device)


def _copy_engine_problem(max_mib: int, device: torch.device, skipped: bool) -> str | None:
    """Why the copy-engine crossover could not time runs of up to ``max_mib`` MiB on
    ``device`` (it holds them on the GPU and in pinned host memory), or None."""
    if skipped or device.type != "cuda":
        return None
    memory = torch.cuda.get_device_properties(device).total_memory
    if max_mib << 20 > memory:
        return f"--copy-engine-max-mib {max_mib}: more than {device} holds ({memory >> 20} MiB)"
    return None


def run(args: argparse.Namespace) -> int:
    """0 when every op was tuned, 1 when one had no candidate left, 2 without a GPU or on a
    bad argument."""
    from kvtier_kernels.tuning import files as tuning_files
    from kvtier_kernels.tuning import lookup as tuning_lookup
    from kvtier_kernels.tuning import sweep as tuning

    try:  # the arguments first: a mistake in them is worth knowing on any machine
        shape = shape_from_args(args, chunk_size=args.chunk_size, layout=args.layout)
        ops = [op.strip() for op in args.ops.split(",") if op.strip()]
        tunable = tuning_files.TUNABLES
        unknown = sorted(set(ops) - set(tunable))
        if unknown or not ops:
            raise ValueError(f"--ops: unknown {unknown or ops}; tunable ops: {', '.join(tunable)}")
        for flag, value, least in (
            ("--warmup", args.warmup, 0),
            ("--repeats", args.repeats, 1),
            ("--copy-engine-max-mib", args.copy_engine_max_mib, 0),
        ):
            if value < least:
                raise ValueError(f"{flag} {value}: expected an integer >= {least}")
        device = device_from_flag(args.device)
        if device.type != "cuda":
            raise ValueError(f"--device {args.device!r}: tune times a GPU (cuda or cuda:N)")
        if args.out is not None and not args.out.strip():
            raise ValueError(
                "--out is empty: give the directory to write into, or leave the flag out "
                f"({tuning_lookup.TUNING_DIR_ENV} or ~/.cache/kvtier/tuning)"
            )
        out_dir = Path(args.out) if args.out is not None else tuning_lookup.user_dirs()[0]
        problem = why_not_writable(out_dir)
        if problem is not None:  # found now, not after the sweep
            where = (
                "--out"
                if args.out is not None
                else f"the tuning directory ({tuning_lookup.TUNING_DIR_ENV})"
            )
            raise ValueError(f"{where} {str(out_dir)!r}: {problem}")
    except ValueError as error:
        print(f"kvtier tune: {error}", file=sys.stderr)
        return 2
    target = _tuning_target(device)
    if isinstance(target, str):
        print(f"kvtier tune: {target}", file=sys.stderr)
        return 2
    device, backend, timer = target
    problem = _copy_engine_problem(args.copy_engine_max_mib, device, args.no_copy_engine)
    if problem is not None:  # found now, not after the sweep has written its files
        print(f"kvtier tune: {problem}", file=sys.stderr)
        return 2
    print(f"kvtier tune on {tuning_files.device_name(device)} ({device}, backend {backend})")
    print(f"shape: {shape.describe()}")
    report = tuning.tune(
        shape,
        device=device,
        backend=backend,
        timer=timer,
        out_dir=out_dir,
        ops=ops,
        chunk_memory=args.chunk_memory,
        quick=args.quick,
        warmup=args.warmup,
        repeats=args.repeats,
        copy_engine=not args.no_copy_engine,
        copy_engine_max_bytes=args.copy_engine_max_mib << 20,
        progress=lambda line: print(line, file=sys.stderr, flush=True),
    )
    print()
    for note in report.notes:
        print(note)
    failed = 0
    for result in report.results:
        problem = result.problem
        checked, rejected = len(result.timed), len(result.rejected)
        if result.best is None:
            failed += 1
            first = result.rejected[0][1] if result.rejected else "no candidates"
            print(f"{problem.describe()}: every candidate was rejected ({first}); not written")
            continue
        entry = result.entry()
        config = " ".join(f"{k}={v}" for k, v in entry.config.items())
        line = f"{problem.describe()}: {config}  {entry.median_us:.2f} us"
        if entry.gbps is not None:
            line += f"  {entry.gbps:.1f} GB/s"
        if entry.heuristic_us:
            line += f"; heuristic {entry.heuristic_us:.2f} us ({entry.heuristic_us / entry.median_us:.2f}x)"
        print(f"{line}; {checked} checked, {rejected} rejected")
    for op, figures in report.copy_engine.items():
        crossover = figures.crossover_bytes
        verdict = (
            f"copy_ beats the kernel from {crossover} B ({crossover / 2**20:.3g} MiB) "
            "contiguous runs of pages"
            if crossover is not None
            else "the kernel won at every size measured"
        )
        print(f"copy engine, {op} ({figures.direction}): {verdict}")
    if report.written:
        print("wrote:")
        for path in report.written:
            print(f"  {path}")
    return 1 if failed else 0
