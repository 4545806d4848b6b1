"""What an engine's kernels need compiled: the connector's opt-in start-up warm-up
(``precompile_kernels``) and the questions ``kvtier precompile`` asks.

Both compile the Triton kernels an engine will launch (:mod:`kvtier_kernels.precompile`)
so that its first request does not wait for Triton's JIT. Triton keeps the compiled
kernels in its cache directory (``TRITON_CACHE_DIR``, default ``~/.triton/cache``), where
the engine's process finds what ``kvtier precompile`` compiled with the same Triton.

Without a GPU there is no Triton kernel to compile: the torch kernels run, and they are
not compiled. What numba compiles on a CPU (CacheGen's coder with ``remote_serde:
cachegen``, CacheBlend's RoPE with ``enable_blending``; about 2-5 s each on first use) is
compiled, or loaded from numba's on-disk cache, instead. (Compiling for a GPU that is
absent is what ``make gpu-check`` does to inspect machine code; its results are not
written where the JIT looks, because Triton's cache keys include the live device's
options and toolchain.)
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time

import torch

from kvtier.config import KVTierConfig
from kvtier.engine import CacheEngine
from kvtier_kernels import registry
from kvtier_kernels.precompile import (
    WarmupReport,
    cache_dir,
    plan_warmup,
    warm_numba,
)

logger = logging.getLogger(__name__)

__all__ = [
    "engine_ops",
    "nothing_to_compile",
    "numba_ops",
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
    """The ops with numba CPU kernels an engine with ``config`` runs: the paged copies
    (``kernel_backend`` auto or numba), CacheGen's coder (``remote_serde: cachegen``) and
    CacheBlend's RoPE (``enable_blending``)."""
    paged_on_numba = config.kernel_backend in ("auto", "numba")
    return tuple(
        op
        for op, used in (
            ("paged_gather", paged_on_numba),
            ("paged_scatter", paged_on_numba),
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
    paged = engine.paged_io.paged
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
