"""``kvtier precompile``: compile the Triton kernels an engine with this model and kvtier
config will launch, into Triton's cache, so its first request does not wait for the JIT.

Run it on the GPU machine, with the same Triton and the same ``TRITON_CACHE_DIR`` as the
engine: the engine's process loads the kernels from there. Without a GPU there is no
Triton kernel to compile: it says so and exits 0, after warming what numba compiles on a
CPU (see :mod:`kvtier.warmup`).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from kvtier.commands.model_shape import add_shape_arguments, device_from_flag, shape_from_args
from kvtier.config import ConfigError, load_config
from kvtier.paged_io import use_tuning_dir
from kvtier.warmup import engine_ops, nothing_to_compile, numba_ops
from kvtier_kernels import PagedKV
from kvtier_kernels.precompile import NUMBA_OPS, WARMABLE_OPS, cache_dir, plan_warmup, warm_numba

HELP = "compile the Triton kernels an engine will use, into Triton's cache"
DESCRIPTION = (
    "Compile the kernels an engine with this model and kvtier config will "
    "launch (every token count up to chunk_size) so its first request does not wait for "
    "Triton's JIT. They are kept in Triton's cache (TRITON_CACHE_DIR). Without a GPU "
    "there is nothing to compile; it says so and exits 0. See docs/portability.md."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``kvtier precompile``."""
    shape = parser.add_argument_group("the engine's KV cache (flags override --model-config)")
    add_shape_arguments(shape)
    shape.add_argument(
        "--layout", help="engine KV layout (default: the config's kv_layout, else vllm_nhd)"
    )
    shape.add_argument("--rotary-dim", type=int, help="rotary dims per head, for rope_rerotate")
    parser.add_argument(
        "--config", help="kvtier YAML config (chunk_size, use_layerwise, remote_serde, ...)"
    )
    parser.add_argument(
        "--ops",
        help=f"comma-separated, from {', '.join(WARMABLE_OPS)} (default: what the engine "
        "uses: the paged copies, and cachegen when remote_serde is cachegen)",
    )
    parser.add_argument("--device", default="cuda", help="the GPU to compile for (default cuda)")


def run(args: argparse.Namespace) -> int:
    """``kvtier precompile``: 0 when compiled or when there is nothing to compile, 2 on a
    bad argument."""
    try:
        config = load_config(config_file=args.config)
        shape = shape_from_args(
            args, chunk_size=config.chunk_size, layout=args.layout or config.kv_layout
        )
        ops = tuple(o.strip() for o in args.ops.split(",") if o.strip()) if args.ops else None
        unknown = sorted(set(ops or ()) - set(WARMABLE_OPS))
        if unknown or ops == ():
            raise ValueError(f"--ops: unknown {unknown}; warmable ops: {', '.join(WARMABLE_OPS)}")
        device = device_from_flag(args.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            device = torch.device("cpu")  # said below: nothing to compile
    except (ConfigError, ValueError, RuntimeError) as error:
        print(f"kvtier precompile: {error}", file=sys.stderr)
        return 2
    use_tuning_dir(config.tuning_dir)  # the launch parameters the engine's kernels will use
    why = nothing_to_compile(config.kernel_backend, device)
    if why is not None:
        cpu_ops = [op for op in ops or numba_ops(config) if op in NUMBA_OPS]
        began = time.perf_counter()
        warmed = warm_numba(cpu_ops, shape.dtype) if device.type == "cpu" else []
        if warmed:
            print(
                f"kvtier precompile: numba CPU kernels of {', '.join(warmed)} ready in "
                f"{time.perf_counter() - began:.2f} s (compiled, or loaded from numba's cache)."
            )
            print(f"kvtier precompile: no Triton kernel to compile on this machine: {why}.")
        else:
            print(f"kvtier precompile: nothing to compile on this machine: {why}.")
        print(
            "For the GPU kernels, run it on the GPU machine, with the engine's Triton and "
            "TRITON_CACHE_DIR."
        )
        return 0
    paged = PagedKV.empty(
        shape.layout,
        num_layers=shape.num_layers,
        num_blocks=16,  # the engine's strides divide by 16 when its block count does
        block_size=shape.block_size,
        num_heads=shape.num_kv_heads,
        head_size=shape.head_size,
        dtype=shape.dtype,
        device=device,
    )
    try:
        plan = plan_warmup(
            paged,
            shape.chunk_size,
            backend=config.kernel_backend,
            ops=ops or engine_ops(config),
            layerwise=config.use_layerwise,
            rotary_dim=shape.rope_dim,
        )
    except ValueError as error:
        print(f"kvtier precompile: {error}", file=sys.stderr)
        return 2
    print(f"kvtier precompile on {device} (backend {plan.backend}): {shape.describe()}")
    print(f"Triton cache: {cache_dir()} (TRITON_CACHE_DIR)")
    report = plan.run(progress=lambda line: print(f"  {line}", file=sys.stderr, flush=True))
    again = plan.run()
    for first, second in zip(report.ops, again.ops, strict=True):
        print(
            f"  {first.op:<14} {first.calls:>4} launches  first {first.seconds:7.2f} s  "
            f"again {second.seconds:7.3f} s"
        )
    compiled = "nothing compiled (interpreter)" if plan.backend == "interpret" else "compiled"
    print(f"{compiled}: {report.seconds:.2f} s the first time, {again.seconds:.3f} s again")
    return 0
