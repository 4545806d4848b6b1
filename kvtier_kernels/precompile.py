"""Compile the Triton kernels one engine will launch before it serves: no JIT stall.

Triton compiles a kernel on its first launch with a new specialization, which on a GPU
stalls the caller for a second or more per variant: without this the first request to
store or load KV would wait for it. Triton specializes on its integer arguments (equal to
1, divisible by 16) and the launchers pick ``BLOCK_T`` from the token count, so partial
chunks hit variants of their own. :func:`plan_warmup` therefore lists a launch for every
token count from 1 to ``chunk_size``, and Triton itself decides which are new.

What is warmed, for one engine cache (a :class:`~kvtier_kernels.layouts.PagedKV`: layout,
dtype, heads, head size, block size) and chunk size:

- ``paged_gather`` / ``paged_scatter``: every layer in one launch, and with ``layerwise``
  one layer per launch. Every slot is -1 (skip), so the launches move nothing: warming on
  the engine's own cache is safe while it serves;
- ``cachegen``: the rANS encoder and decoder, by encoding and decoding a zero chunk of
  ``chunk_size`` tokens on the device (plus one partial chunk);
- ``rope_rerotate``: every token count of the K plane of a chunk.

:meth:`WarmupPlan.run` launches each call (``kvtier precompile``: a process of its own that
fills Triton's on-disk cache), or with ``compile_only`` compiles without launching
(:func:`kvtier_kernels._launch.compile_only`; the connector's start-up thread, which must
not touch the device while the engine captures CUDA graphs). Triton keeps what it compiled
in its cache directory (:func:`cache_dir`), where the engine's process finds it.

Nothing here is needed on a machine without a GPU: the torch kernels compile nothing. The
``interpret`` backend runs the same plan under Triton's interpreter (tests).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from kvtier_kernels import registry
from kvtier_kernels._launch import compile_only as _compile_only
from kvtier_kernels._launch import compiling_only
from kvtier_kernels.layouts import PagedKV
from kvtier_kernels.paged.rows import layer_table

__all__ = [
    "NUMBA_OPS",
    "WARMABLE_OPS",
    "OpWarmup",
    "WarmupPlan",
    "WarmupReport",
    "cache_dir",
    "plan_warmup",
    "token_counts",
    "warm_numba",
]

WARMABLE_OPS = ("paged_gather", "paged_scatter", "cachegen", "rope_rerotate")
"""What :func:`plan_warmup` can warm; ``cachegen`` stands for ``rans_encode`` and
``rans_decode``."""


def cache_dir() -> str | None:
    """Triton's cache directory (``TRITON_CACHE_DIR`` or its default), None without Triton."""
    if not registry.available_backends()["interpret"].startswith("available"):
        return None
    from kvtier_kernels import _triton_compat

    return _triton_compat.cache_dir()


def token_counts(chunk_size: int) -> list[int]:
    """The token counts one launch may move: every count from ``chunk_size`` down to 1."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1; got {chunk_size}")
    return list(range(chunk_size, 0, -1))


@dataclass(slots=True)
class OpWarmup:
    """What warming one op did: ``calls`` launches (or compile requests) in ``seconds``."""

    op: str
    calls: int = 0
    seconds: float = 0.0


@dataclass(slots=True)
class WarmupReport:
    """The outcome of :meth:`WarmupPlan.run`.

    Attributes:
        ops: per op, calls and wall time (the first run includes the compiles).
        variants: distinct compiled kernels that ``compile_only`` got back from Triton
            (None when launching, or under the interpreter, which compiles nothing).
        seconds: the whole run.
    """

    ops: list[OpWarmup]
    variants: int | None
    seconds: float


@dataclass(slots=True)
class WarmupPlan:
    """The launches to warm, with every tensor they need already allocated (so that
    running the plan allocates nothing on the device and reads nothing back)."""

    device: torch.device
    backend: str
    calls: list[tuple[str, Callable[[], object]]] = field(default_factory=list)

    def describe(self) -> dict[str, int]:
        """Calls per op."""
        counts: dict[str, int] = {}
        for op, _ in self.calls:
            counts[op] = counts.get(op, 0) + 1
        return counts

    def run(
        self, *, compile_only: bool = False, progress: Callable[[str], None] | None = None
    ) -> WarmupReport:
        """Make every call: launching, or with ``compile_only`` compiling without
        launching. Calls of this thread only; the engine's threads launch as usual."""
        start = time.perf_counter()
        ops: dict[str, OpWarmup] = {}
        requests: list[tuple[str, object]] = []
        for op, call in self.calls:
            entry = ops.setdefault(op, OpWarmup(op))
            if entry.calls == 0 and progress is not None:
                progress(f"{op}: {self.describe()[op]} calls")
            began = time.perf_counter()
            if compile_only:
                with _compile_only() as requested:
                    call()
                requests.extend(requested)
            else:
                call()
            entry.calls += 1
            entry.seconds += time.perf_counter() - began
        if not compile_only and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        compiled = {id(kernel) for _, kernel in requests if kernel is not None}
        variants = len(compiled) if compile_only and self.backend == "triton" else None
        return WarmupReport(list(ops.values()), variants, time.perf_counter() - start)


def plan_warmup(
    paged: PagedKV,
    chunk_size: int,
    *,
    backend: str = "auto",
    ops: tuple[str, ...] = ("paged_gather", "paged_scatter"),
    layerwise: bool = False,
    rotary_dim: int | None = None,
    is_neox_style: bool = True,
) -> WarmupPlan:
    """The warm-up launches for ``paged`` (its device, layout, dtype and geometry) with
    chunks of ``chunk_size`` tokens, their buffers allocated here.

    Args:
        paged: the engine's cache, or one of the same geometry; nothing in it is read or
            written (every slot is -1).
        chunk_size: kvtier's chunk size; every token count up to it is warmed.
        backend: resolved against ``paged.device`` (``auto``: Triton on a GPU).
        ops: a subset of :data:`WARMABLE_OPS`.
        layerwise: also one-layer launches of the paged copies (``use_layerwise``).
        rotary_dim / is_neox_style: for ``rope_rerotate`` (default: the whole head, NeoX).

    Raises:
        ValueError: an unknown op, or a backend that compiles nothing here (``torch``:
            the message says why), or a chunk size below 1.
    """
    unknown = sorted(set(ops) - set(WARMABLE_OPS))
    if unknown:
        raise ValueError(f"cannot warm {unknown}; warmable ops: {', '.join(WARMABLE_OPS)}")
    device = paged.device
    resolved = registry.resolve_backend(backend, device)
    if resolved == "torch":
        raise ValueError(
            f"kernel backend {backend!r} runs the torch kernels on {device}: nothing to compile"
        )
    plan = WarmupPlan(device, resolved)
    counts = token_counts(chunk_size)
    pinned = device.type == "cuda"
    layer_sets = [range(paged.num_layers)] + ([range(1)] if layerwise else [])
    for layers in layer_sets:
        if device.type == "cuda":
            layer_table(paged, layers)  # built (host-to-device) here, not while warming
        full = torch.empty(
            paged.chunk_shape(chunk_size, len(layers)), dtype=paged.dtype, pin_memory=pinned
        )
        full = full if pinned else full.to(device)
        for op in ("paged_gather", "paged_scatter"):
            if op not in ops:
                continue
            impl = registry.get(op, resolved, device)
            for n in counts:
                chunk = _front(full, paged.chunk_shape(n, len(layers)))
                slots = torch.full((n,), -1, dtype=torch.int64, device=device)
                plan.calls.append((op, _bind(impl, paged, slots, chunk, layers)))
    if "cachegen" in ops:
        plan.calls.extend(_cachegen_calls(paged, chunk_size, resolved))
    if "rope_rerotate" in ops:
        plan.calls.extend(_rope_calls(paged, counts, resolved, rotary_dim, is_neox_style))
    return plan


def _bind(impl: Callable, *args: object) -> Callable[[], object]:
    return lambda: impl(*args)


def _front(buffer: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """A contiguous tensor of ``shape`` at the start of ``buffer``'s storage (as aligned as
    ``buffer``): one allocation serves every token count."""
    numel = 1
    for size in shape:
        numel *= size
    return buffer.view(-1)[:numel].view(shape)


def _cachegen_calls(
    paged: PagedKV, chunk_size: int, backend: str
) -> list[tuple[str, Callable[[], object]]]:
    """Encode then decode a zero chunk (and a partial one): both rANS kernels.

    NOTE: the codec reads results back to the host (a device sync); compile-only runs
    skip the launches, so what it reads is meaningless and nothing uses it: the checks may
    pass it (their flags start at zero and no kernel ran to set them) or reject it.
    """
    from kvtier_kernels.cachegen import FLOAT_DTYPES, CodecError, decode_chunk, encode_chunk

    if paged.kv_planes != 2 or paged.dtype not in FLOAT_DTYPES:
        return []  # the codec takes K and V planes of a float cache only
    calls = []
    for n in sorted({chunk_size, max(1, chunk_size // 2 + 1)}, reverse=True):
        chunk = torch.zeros(paged.chunk_shape(n), dtype=paged.dtype, device=paged.device)
        out = torch.empty_like(chunk)
        # the decoder reads a payload made here by the reference coder (equal bytes on any
        # backend), so a compile-only encode, which leaves its output empty, cannot break it
        payload, params = encode_chunk(chunk, backend="torch")

        def round_trip(chunk=chunk, out=out, payload=payload, params=params) -> None:
            encode_chunk(chunk, backend=backend)
            try:
                decode_chunk(payload, params, out, backend=backend)
            except (CodecError, RuntimeError):
                if not compiling_only():
                    raise  # compile-only: nothing was decoded, whatever the checks found

        calls.append(("cachegen", round_trip))
    return calls


def _rope_calls(
    paged: PagedKV, counts: list[int], backend: str, rotary_dim: int | None, is_neox: bool
) -> list[tuple[str, Callable[[], object]]]:
    from kvtier_kernels.rope.rerotation import rerotate_triton, rope_inv_freq

    if paged.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return []
    rotary = paged.head_size if rotary_dim is None else rotary_dim
    if rotary == 0 or paged.kv_planes != 2:
        return []  # nothing rotates (MLA, no RoPE)
    interpret = backend == "interpret"
    inv_freq = rope_inv_freq(rotary, 10000.0, paged.device)
    shape = (paged.num_layers, max(counts), paged.hidden_dim)
    k_full = torch.zeros(shape, dtype=paged.dtype, device=paged.device)
    calls = []
    for n in counts:
        k = _front(k_full, (paged.num_layers, n, paged.hidden_dim))
        positions = torch.zeros(n, dtype=torch.int64, device=paged.device)

        def rotate(k: torch.Tensor = k, positions: torch.Tensor = positions) -> None:
            rerotate_triton(
                k,
                positions,
                positions,
                head_size=paged.head_size,
                rotary_dim=rotary,
                inv_freq=inv_freq,
                is_neox_style=is_neox,
                interpret=interpret,
            )

        calls.append(("rope_rerotate", rotate))
    return calls


NUMBA_OPS = ("paged_gather", "paged_scatter", "cachegen", "rope_rerotate")
"""The warmable ops with numba CPU kernels (``auto``'s pick on a CPU where numba imports)."""
_CACHEGEN_OPS = ("rans_encode", "rans_decode")  # the registry ops of the cachegen coder


def warm_numba(ops: Sequence[str], dtype: torch.dtype) -> list[str]:
    """Compile the numba CPU kernels of ``ops`` (of :data:`NUMBA_OPS`) for KV of ``dtype``,
    or load them from numba's on-disk cache, by running each once on a tiny input with
    every argument type kvtier calls it with: contiguous and strided keys for RoPE, both
    statistics models of CacheGen. Returns the ops warmed: none where ``auto`` does not
    pick numba on the CPU (numba not installed, or it fails to import), nor one whose
    kernels failed to compile here (logged; the op runs its reference).

    numba compiles per argument type, not per shape, so this covers every model shape.
    """
    cpu = torch.device("cpu")
    warmed = []
    for op in ("paged_gather", "paged_scatter"):
        if op in ops and registry.pick(op, "auto", cpu) == "numba":
            # rows of 64-bit words: what a cache whose head rows are 8-byte multiples moves
            paged = PagedKV.empty(
                "vllm_cpu", num_layers=2, num_blocks=2, block_size=16, num_heads=2,
                head_size=64, dtype=dtype,
            )  # fmt: skip
            chunk = torch.zeros(paged.chunk_shape(16), dtype=dtype)
            # slots across two blocks, not whole ones: a gather of whole blocks is torch's
            registry.get(op, "numba", cpu)(paged, torch.arange(8, 24), chunk)
            if registry.pick(op, "auto", cpu) == "numba":
                warmed.append(op)
    if "cachegen" in ops and registry.pick("rans_encode", "auto", cpu) == "numba":
        from kvtier_kernels.cachegen import FLOAT_DTYPES, decode_chunk, encode_chunk

        if dtype in FLOAT_DTYPES:
            chunk = torch.randn(2, 2, 16, 64, generator=torch.Generator().manual_seed(0))
            chunk = chunk.to(dtype)
            for model in ("gaussian", "histogram"):
                payload, params = encode_chunk(chunk, backend="numba", model=model)
                decode_chunk(payload, params, torch.empty_like(chunk), backend="numba")
            if all(registry.pick(op, "auto", cpu) == "numba" for op in _CACHEGEN_OPS):
                warmed.append("cachegen")
    rope_on_numba = dtype in (torch.bfloat16, torch.float32)  # fp16 keys go to torch
    if (
        "rope_rerotate" in ops
        and rope_on_numba
        and registry.pick("rope_rerotate", "auto", cpu) == "numba"
    ):
        from kvtier_kernels.rope import rerotate

        chunk = torch.zeros(2, 2, 4, 2 * 64, dtype=dtype)  # [KV, L, T, H * D]
        positions = torch.arange(4)
        # a whole chunk's K plane, and a strided view (the pairing style is an argument's
        # value, not its type: one style compiles both)
        for k in (chunk[0], chunk[0, :, 1:3]):
            n = k.shape[1]
            rerotate(k, positions[:n], positions[:n] + 1, head_size=64)
        if registry.pick("rope_rerotate", "auto", cpu) == "numba":
            warmed.append("rope_rerotate")
    return warmed
