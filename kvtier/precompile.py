"""``kvtier precompile`` and the connector's opt-in start-up warm-up (``precompile_kernels``).

Both compile the Triton kernels an engine will launch (:mod:`kvtier_kernels.precompile`)
so that its first request does not wait for Triton's JIT. Triton keeps the compiled
kernels in its cache directory (``TRITON_CACHE_DIR``, default ``~/.triton/cache``): run
``kvtier precompile`` on the GPU machine, with the same Triton and the same
``TRITON_CACHE_DIR`` as the engine, and the engine's process loads them from there.

Without a GPU there is no Triton kernel to compile: the torch kernels run, and they are
not compiled. The command says so and exits 0. What numba compiles on a CPU (CacheGen's
coder with ``remote_serde: cachegen``, CacheBlend's RoPE with ``enable_blending``; about
2-5 s each on first use) is compiled, or loaded from numba's on-disk cache, instead.
(Compiling for a GPU that is absent is what ``make gpu-check`` does to inspect machine
code; its results are not written where the JIT looks, because Triton's cache keys include
the live device's options and toolchain.)
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import threading
import time

import torch

from kvtier.config import ConfigError, KVTierConfig, load_config
from kvtier.engine import CacheEngine
from kvtier_kernels import PagedKV, registry
from kvtier_kernels.precompile import (
    NUMBA_OPS,
    WARMABLE_OPS,
    WarmupReport,
    cache_dir,
    plan_warmup,
    warm_numba,
)

logger = logging.getLogger(__name__)

__all__ = [
    "add_arguments",
    "nothing_to_compile",
    "numba_ops",
    "run_precompile",
    "start_background",
]

_ENGINE_OPS = ("paged_gather", "paged_scatter")


def nothing_to_compile(kernel_backend: str, device: torch.device) -> str | None:
    """Why no Triton kernel would be compiled for ``device`` with ``kernel_backend``, or
    None when there is something to compile."""
    triton = registry.available_backends()["triton"]
    if kernel_backend == "interpret":
        return None  # the plan runs under the interpreter: it checks, compiles nothing
    if device.type != "cuda" or not torch.cuda.is_available():
        where = "torch sees no GPU" if not torch.cuda.is_available() else f"the device is {device}"
        return f"{where}, so kvtier runs its torch kernels, which need no compilation"
    if kernel_backend == "torch":
        return "kernel_backend is torch: the torch kernels need no compilation"
    if triton.startswith("triton not installed"):
        return "triton is not installed, so kvtier runs its torch kernels"
    return None


def engine_ops(config: KVTierConfig) -> tuple[str, ...]:
    """The warmable ops an engine with ``config`` launches."""
    return (*_ENGINE_OPS, "cachegen") if config.remote_serde == "cachegen" else _ENGINE_OPS


def numba_ops(config: KVTierConfig) -> tuple[str, ...]:
    """The ops with numba CPU kernels an engine with ``config`` runs: CacheGen's coder
    (``remote_serde: cachegen``) and CacheBlend's RoPE (``enable_blending``)."""
    return tuple(
        op
        for op, used in (
            ("cachegen", config.remote_serde == "cachegen"),
            ("rope_rerotate", config.enable_blending),
        )
        if used
    )


def _warm_numba_in_background(ops: tuple[str, ...], dtype: torch.dtype) -> threading.Thread:
    def warm() -> None:
        began = time.perf_counter()
        try:
            warmed = warm_numba(ops, dtype)
        except Exception:  # a failed warm-up leaves numba to compile on first use
            logger.exception("kvtier precompile_kernels: numba warm-up failed")
            return
        logger.info(
            "kvtier precompile_kernels: numba kernels of %s ready in %.2f s (numba's cache)",
            ", ".join(warmed) or "nothing (numba is not what runs here)",
            time.perf_counter() - began,
        )

    thread = threading.Thread(target=warm, name="kvtier-precompile-numba", daemon=True)
    thread.start()
    return thread


def start_background(config: KVTierConfig, engine: CacheEngine) -> threading.Thread | None:
    """With ``precompile_kernels`` on, compile the paged-copy kernels for ``engine``'s own
    cache in a daemon thread (on a CPU: warm the numba kernels of :func:`numba_ops`); None
    when off or when nothing would be compiled.

    Buffers are allocated here, in the caller's thread; the thread only compiles (no
    launch, no allocation, no device sync), so it cannot disturb an engine that captures
    CUDA graphs meanwhile. The cachegen coder is left to ``kvtier precompile``: it reads
    results back to the host, which a capture forbids.
    """
    paged = engine.connector.paged
    if not config.precompile_kernels:
        return None
    why = nothing_to_compile(config.kernel_backend, paged.device)
    if why is not None:
        cpu_ops = numba_ops(config) if paged.device.type == "cpu" else ()
        if cpu_ops:  # the CPU kernels that numba compiles on first use
            return _warm_numba_in_background(cpu_ops, paged.dtype)
        logger.info("kvtier precompile_kernels: nothing to compile (%s)", why)
        return None
    plan = plan_warmup(
        paged,
        config.chunk_size,
        backend=config.kernel_backend,
        layerwise=config.use_layerwise,
    )

    def compile_all() -> None:
        try:
            on_gpu = paged.device.type == "cuda"
            with torch.cuda.device(paged.device) if on_gpu else contextlib.nullcontext():
                report = plan.run(compile_only=True)
        except Exception:  # a failed warm-up leaves the JIT to compile on first use
            logger.exception("kvtier precompile_kernels failed; kernels compile on first use")
            return
        logger.info("kvtier precompile_kernels: %s", _summary(report, plan.backend))

    thread = threading.Thread(target=compile_all, name="kvtier-precompile", daemon=True)
    thread.start()
    return thread


def _summary(report: WarmupReport, backend: str) -> str:
    calls = ", ".join(f"{o.op} {o.calls} calls {o.seconds:.2f} s" for o in report.ops)
    variants = "" if report.variants is None else f"{report.variants} kernel variants, "
    return f"{variants}{calls}; {report.seconds:.2f} s in all ({backend}); cache {cache_dir()}"


def add_shape_arguments(shape) -> None:
    """The model-shape flags ``kvtier precompile`` and ``kvtier tune`` share (read by
    ``shape_from_args``); ``--layout``, ``--rotary-dim`` and ``--chunk-size`` are each
    command's own."""
    shape.add_argument(
        "--model-config", help="a HuggingFace-style config.json (or a directory holding one)"
    )
    shape.add_argument("--layers", type=int, help="attention layers (default 32)")
    shape.add_argument("--kv-heads", type=int, help="KV heads per layer (default 8)")
    shape.add_argument("--head-size", type=int, help="head size (default 128; MLA: latent dim)")
    shape.add_argument("--block-size", type=int, help="engine block size (default 16)")
    shape.add_argument("--dtype", help="KV cache dtype: bfloat16 (default), float16, float32, fp8")


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


def shape_from_args(args: argparse.Namespace, *, chunk_size: int, layout: str | None):
    """The model shape of ``kvtier precompile`` / ``kvtier tune`` flags: ``--model-config``
    with flag overrides, else the flags over a Llama-3-8B default."""
    from kvtier_kernels.dtypes import parse_dtype
    from kvtier_kernels.tuning.shapes import ModelShape, model_shape_from_config

    overrides = {
        "num_layers": args.layers,
        "num_kv_heads": args.kv_heads,
        "head_size": args.head_size,
        "block_size": args.block_size,
        "chunk_size": chunk_size,
        "dtype": parse_dtype(args.dtype) if args.dtype else None,
        "layout": layout,
        "rotary_dim": args.rotary_dim,
    }
    if args.model_config:
        return model_shape_from_config(args.model_config, **overrides)
    defaults = {"num_layers": 32, "num_kv_heads": 8, "head_size": 128}  # Llama-3-8B
    return ModelShape(**{**defaults, **{k: v for k, v in overrides.items() if v is not None}})


def run_precompile(args: argparse.Namespace) -> int:
    """``kvtier precompile``: 0 when compiled or when there is nothing to compile, 2 on a
    bad argument."""
    try:
        config = load_config(config_file=args.config)
        shape = shape_from_args(
            args, chunk_size=config.chunk_size, layout=args.layout or config.kv_layout
        )
        ops = tuple(o.strip() for o in args.ops.split(",") if o.strip()) if args.ops else None
        device = torch.device(args.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            device = torch.device("cpu")  # said below: nothing to compile
    except (ConfigError, ValueError, RuntimeError) as error:
        print(f"kvtier precompile: {error}", file=sys.stderr)
        return 2
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
        print(f"kvtier precompile: nothing to compile on this machine: {why}.")
        print("Run it on the GPU machine, with the engine's Triton and TRITON_CACHE_DIR.")
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
