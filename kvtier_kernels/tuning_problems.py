"""What ``kvtier tune`` sweeps: the candidate launch configs of each tunable op, and one
:class:`TuningProblem` per op and shape that allocates its inputs, runs a candidate and
checks it against the op's torch reference (bit-exact for copies, within a stated
tolerance for RoPE) before :mod:`kvtier_kernels.tuning` times it.

Importing this module imports neither triton nor the op modules (they are imported when a
problem is built), and touches no GPU driver.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvtier_kernels.layouts import PagedKV, get_layout
from kvtier_kernels.tuning_files import NUM_WARPS, TUNABLES, dtype_name
from kvtier_kernels.tuning_shapes import ModelShape

# ---------------------------------------------------------------------------------------
# candidates
# ---------------------------------------------------------------------------------------


def _powers_of_two(low: int, high: int) -> list[int]:
    """Powers of two in ``[low, high]``."""
    powers, p = [], 1
    while p <= high:
        if p >= low:
            powers.append(p)
        p *= 2
    return powers


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _warps_for(elements: int, quick: bool) -> list[int]:
    """Warps that give every thread 1 to 32 of a tile's ``elements`` (quick: 4 or 8)."""
    fitting = [w for w in NUM_WARPS if 32 * w <= elements <= 1024 * w] or [1]
    if quick:
        fitting = [w for w in fitting if w in (4, 8)] or fitting[:1]
    return fitting


def paged_copy_candidates(
    row_words: int, word_bytes: int, num_tokens: int, *, quick: bool = False
) -> list[Any]:
    """Launch configs to try for a paged copy of ``row_words``-word rows.

    Rows split into ``BLOCK_R`` words (down to 8 words, or the whole row when smaller),
    ``BLOCK_T`` from 1 to 64 tokens (at most the chunk), tiles of 256 B to 32 KiB, and
    warps for 1 to 32 words per thread. ``quick``: 4 or 8 warps and every other token count.
    """
    from kvtier_kernels.paged_copy import LaunchConfig

    full_row = _next_power_of_2(row_words)
    token_cap = min(64, _next_power_of_2(num_tokens))
    token_choices = _powers_of_two(1, token_cap)
    if quick:
        token_choices = sorted({*token_choices[::2], token_cap})
    smallest = min(256, full_row * token_cap * word_bytes)  # tiny problems: one whole tile
    configs = []
    for block_row in _powers_of_two(min(8, full_row), full_row):
        for block_tokens in token_choices:
            elements = block_row * block_tokens
            if not smallest <= elements * word_bytes <= 32768:
                continue
            for num_warps in _warps_for(elements, quick):
                configs.append(LaunchConfig(block_tokens, block_row, num_warps))
    return configs


def rope_candidates(half_rotary: int, num_tokens: int, *, quick: bool = False) -> list[Any]:
    """Launch configs to try for re-rotating ``half_rotary`` pairs per head.

    ``BLOCK_P`` from 8 pairs (or the whole head when smaller) to the whole head,
    ``BLOCK_T`` from 1 to 128 tokens (at most the chunk), tiles of 64 to 8192 pairs, and
    warps for 1 to 32 pairs per thread. ``quick``: 4 or 8 warps and every other token count.
    """
    from kvtier_kernels.rope import LaunchConfig

    all_pairs = _next_power_of_2(half_rotary)
    token_cap = min(128, _next_power_of_2(num_tokens))
    token_choices = _powers_of_two(1, token_cap)
    if quick:
        token_choices = sorted({*token_choices[::2], token_cap})
    smallest = min(64, all_pairs * token_cap)  # tiny problems: one whole tile
    configs = []
    for block_pairs in _powers_of_two(min(8, all_pairs), all_pairs):
        for block_tokens in token_choices:
            pairs = block_pairs * block_tokens
            if not smallest <= pairs <= 8192:
                continue
            for num_warps in _warps_for(pairs, quick):
                configs.append(LaunchConfig(block_tokens, block_pairs, num_warps))
    return configs


# ---------------------------------------------------------------------------------------
# problems: one op at one shape, its inputs, and the reference check
# ---------------------------------------------------------------------------------------


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _fill_random_bits_(t: torch.Tensor, generator: torch.Generator) -> None:
    """Random bytes into ``t`` (any strides, any device; NaN payloads and all)."""
    raw = t.view(torch.int8) if t.dim() and t.stride(-1) == 1 else _bits(t)
    info = torch.iinfo(raw.dtype)
    values = torch.randint(info.min, info.max + 1, raw.shape, generator=generator, dtype=raw.dtype)
    raw.copy_(values)


def _alloc_chunk(
    shape: Sequence[int], dtype: torch.dtype, device: torch.device, chunk_memory: str
) -> torch.Tensor:
    if device.type == "cuda" and chunk_memory == "pinned":
        return torch.empty(tuple(shape), dtype=dtype, pin_memory=True)
    return torch.empty(tuple(shape), dtype=dtype, device=device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _first_difference(got: torch.Tensor, want: torch.Tensor, dims: str) -> str | None:
    """None when ``got`` and ``want`` hold the same bits, else where they first differ."""
    if got.device == want.device and torch.equal(_bits(got), _bits(want)):
        return None
    diff = _bits(got).cpu() != _bits(want).cpu()
    if not bool(diff.any()):
        return None
    where = ", ".join(f"{d} {int(i)}" for d, i in zip(dims.split(), diff.nonzero()[0], strict=True))
    return f"{int(diff.sum())} elements differ from the torch reference; first at {where}"


class TuningProblem:
    """One op at one shape: the candidates to try and how to run and check one.

    Subclasses allocate in :meth:`setup` and free in :meth:`teardown`, so that problems
    are held in memory one at a time. They run the op's registered implementation for
    their backend, or the ``impl`` they were given (same signature, with ``config=``).

    Attributes:
        op: registry op name.
        dtype: the dtype the op's tuning file is named by.
        key: the shape key of the entry this problem produces.
        candidates: the launch configs to try (the heuristic's is always among them).
        heuristic: the built-in heuristic's config for this shape.
        bytes_moved: bytes read plus written by one launch (for GB/s).
        shape: what is timed (informational, written into the entry).
    """

    op: str
    dtype: torch.dtype
    key: dict[str, int]
    candidates: list[Any]
    heuristic: Any
    bytes_moved: int
    shape: dict[str, Any]

    def setup(self) -> None:
        raise NotImplementedError

    def run(self, config: Any) -> None:
        """Launch once with ``config`` (asynchronous on a GPU)."""
        raise NotImplementedError

    def check(self, config: Any) -> str | None:
        """Reset the inputs, run with ``config``, compare with the reference: None when it
        matches, else where it differs."""
        raise NotImplementedError

    def teardown(self) -> None:
        raise NotImplementedError

    def describe(self) -> str:
        return f"{self.op} " + " ".join(f"{k}={v}" for k, v in self.key.items())


def _with_heuristic(candidates: list[Any], heuristic: Any) -> list[Any]:
    return candidates if heuristic in candidates else [heuristic, *candidates]


class PagedCopyProblem(TuningProblem):
    """``paged_gather`` or ``paged_scatter`` of one chunk, every layer in one launch.

    The cache is filled with random bits and ``chunk_size`` tokens sit in random blocks.
    Each candidate is checked bit for bit against the torch reference on that slot mapping
    and on the same with every 7th slot negative (skipped).
    """

    def __init__(
        self,
        op: str,
        shape: ModelShape,
        device: torch.device,
        backend: str,
        *,
        chunk_memory: str = "pinned",
        quick: bool = False,
        seed: int = 0,
        impl: Callable[..., Any] | None = None,
    ) -> None:
        from kvtier_kernels import paged_copy

        if op not in ("paged_gather", "paged_scatter"):
            raise ValueError(f"PagedCopyProblem is for paged_gather / paged_scatter, not {op!r}")
        if chunk_memory not in ("pinned", "device"):
            raise ValueError(f"chunk_memory must be 'pinned' or 'device'; got {chunk_memory!r}")
        self.op, self.model, self.device, self.backend = op, shape, torch.device(device), backend
        self.chunk_memory, self.seed, self._impl = chunk_memory, seed, impl
        blocks_per_chunk = -(-shape.chunk_size // shape.block_size)
        self.num_blocks = max(4 * blocks_per_chunk, 16)
        # The word type and row length the launcher will see, from a small CPU replica
        # with the same layout, geometry and strides (checked again on the real tensors).
        replica = self._cache("cpu", num_layers=min(2, shape.num_layers))
        chunk = torch.empty(replica.chunk_shape(1, replica.num_layers), dtype=shape.dtype)
        self.word_bytes = self._word_bytes(replica, chunk)
        self.row_words = (
            shape.num_kv_heads * shape.head_size * shape.dtype.itemsize // self.word_bytes
        )
        word_dtype = paged_copy._WORD_OF_BYTES[self.word_bytes]
        self.dtype = word_dtype
        self.key = {"row_words": self.row_words}
        heuristic = paged_copy.launch_config(
            op, self.row_words, word_dtype, self.device, tuned=False
        )
        # What the launcher really launches: it caps BLOCK_T at the tokens there are.
        token_cap = _next_power_of_2(shape.chunk_size)
        self.heuristic = dataclasses.replace(
            heuristic, block_tokens=min(heuristic.block_tokens, token_cap)
        )
        self.candidates = _with_heuristic(
            paged_copy_candidates(self.row_words, self.word_bytes, shape.chunk_size, quick=quick),
            self.heuristic,
        )
        kv = get_layout(shape.layout).kv_planes
        row_bytes = shape.num_kv_heads * shape.head_size * shape.dtype.itemsize
        self.bytes_moved = 2 * kv * shape.num_layers * shape.chunk_size * row_bytes
        self.shape = {
            "layout": shape.layout,
            "num_layers": shape.num_layers,
            "num_tokens": shape.chunk_size,
            "block_size": shape.block_size,
            "num_kv_heads": shape.num_kv_heads,
            "head_size": shape.head_size,
            "cache_dtype": dtype_name(shape.dtype),
            "chunk_memory": chunk_memory if self.device.type == "cuda" else "cpu",
        }
        self._tensors: dict[str, Any] = {}

    def _cache(self, device: torch.device | str, num_layers: int) -> PagedKV:
        s = self.model
        return PagedKV.empty(
            s.layout,
            num_layers=num_layers,
            num_blocks=self.num_blocks,
            block_size=s.block_size,
            num_heads=s.num_kv_heads,
            head_size=s.head_size,
            dtype=s.dtype,
            device=device,
        )

    @staticmethod
    def _word_bytes(paged: PagedKV, chunk: torch.Tensor) -> int:
        from kvtier_kernels import paged_copy

        layers = range(paged.num_layers)
        table = paged_copy._layer_table(paged, layers)
        return paged_copy._word_view(paged, chunk, table.alignment)[2]

    def setup(self) -> None:
        from kvtier_kernels import registry

        s, device = self.model, self.device
        gen = torch.Generator().manual_seed(self.seed)
        paged = self._cache(device, s.num_layers)
        for t in paged.tensors:
            _fill_random_bits_(t, gen)
        blocks = torch.randperm(self.num_blocks, generator=gen)[: -(-s.chunk_size // s.block_size)]
        slots = (blocks[:, None] * s.block_size + torch.arange(s.block_size)).flatten()
        slots = slots[: s.chunk_size].to(device)
        padded = slots.clone()
        padded[::7] = -1
        chunk_shape = paged.chunk_shape(s.chunk_size)
        chunk = _alloc_chunk(chunk_shape, s.dtype, device, self.chunk_memory)
        start = torch.empty(chunk_shape, dtype=s.dtype)
        _fill_random_bits_(start, gen)
        chunk.copy_(start)
        if self._word_bytes(paged, chunk) != self.word_bytes:
            raise RuntimeError(f"{self.describe()}: word size differs from the replica's")
        t = self._tensors = {
            "paged": paged,
            "slots": {"full": slots, "padded": padded},
            "chunk": chunk,
            "start": start.to(chunk.device),
            "impl": self._impl or registry.get(self.op, self.backend, device),
        }
        from kvtier_kernels.paged_copy import gather_reference, scatter_reference

        if self.op == "paged_gather":
            t["expected"] = {}
            for name, mapping in t["slots"].items():
                expected = t["start"].clone()
                gather_reference(paged, mapping, expected)
                t["expected"][name] = expected
        else:
            t["initial"] = [x.clone() for x in paged.tensors]
            t["expected"] = {}
            for name, mapping in t["slots"].items():
                expected = PagedKV(paged.layout, [x.clone() for x in paged.tensors])
                scatter_reference(expected, mapping, chunk)
                t["expected"][name] = expected.tensors
        _sync(device)

    def run(self, config: Any) -> None:
        t = self._tensors
        t["impl"](t["paged"], t["slots"]["full"], t["chunk"], config=config)

    def check(self, config: Any) -> str | None:
        t = self._tensors
        paged, chunk = t["paged"], t["chunk"]
        for name, mapping in t["slots"].items():
            if self.op == "paged_gather":
                chunk.copy_(t["start"])
                _sync(self.device)
                t["impl"](paged, mapping, chunk, config=config)
                _sync(self.device)
                problem = _first_difference(chunk, t["expected"][name], "plane layer token col")
            else:
                for x, x0 in zip(paged.tensors, t["initial"], strict=True):
                    x.copy_(x0)
                _sync(self.device)
                t["impl"](paged, mapping, chunk, config=config)
                _sync(self.device)
                problem = None
                for layer, (x, want) in enumerate(
                    zip(paged.tensors, t["expected"][name], strict=True)
                ):
                    problem = _first_difference(x, want, " ".join(paged.layout.axes))
                    if problem:
                        problem = f"layer {layer}: {problem}"
                        break
            if problem:
                return f"{name} slot mapping: {problem}"
        return None

    def teardown(self) -> None:
        self._tensors = {}


# Re-rotation tolerance: |got - want| <= _ROPE_ATOL + _ROPE_RTOL * |want| in fp32, and one
# ulp of the storage dtype more for fp16 / bf16 (a last-bit cos/sin or an FMA may flip one
# rounding; the interpreter truncates fp32 -> bf16). Dims past rotary_dim: bit-exact.
_ROPE_ATOL = 1e-5
_ROPE_RTOL = 1e-5
_MANTISSA_BITS = {torch.float32: 23, torch.float16: 10, torch.bfloat16: 7}


class RopeProblem(TuningProblem):
    """``rope_rerotate`` of one chunk's K plane ``[L, T, H * D]`` (NeoX pairing), random
    keys and positions below 4096; each candidate is checked against the torch reference
    within the tolerance above."""

    def __init__(
        self,
        shape: ModelShape,
        device: torch.device,
        backend: str,
        *,
        quick: bool = False,
        seed: int = 0,
        impl: Callable[..., Any] | None = None,
    ) -> None:
        from kvtier_kernels import rope

        if shape.dtype not in rope.SUPPORTED_DTYPES:
            raise ValueError(f"rope_rerotate does not support {shape.dtype}")
        if shape.rope_dim == 0:
            raise ValueError("the model has no rotary dims to re-rotate")
        self.op, self.model, self.device, self.backend, self.seed = (
            "rope_rerotate",
            shape,
            torch.device(device),
            backend,
            seed,
        )
        self.dtype, self._impl = shape.dtype, impl
        half = shape.rope_dim // 2
        self.key = {"half_rotary": half, "num_tokens": shape.chunk_size}
        self.heuristic = rope.launch_config(
            half, shape.chunk_size, shape.dtype, self.device, tuned=False
        )
        self.candidates = _with_heuristic(
            rope_candidates(half, shape.chunk_size, quick=quick), self.heuristic
        )
        itemsize = shape.dtype.itemsize
        self.bytes_moved = (
            2 * shape.num_layers * shape.chunk_size * shape.num_kv_heads * shape.rope_dim * itemsize
        )
        self.shape = {
            "num_layers": shape.num_layers,
            "num_tokens": shape.chunk_size,
            "num_kv_heads": shape.num_kv_heads,
            "head_size": shape.head_size,
            "rotary_dim": shape.rope_dim,
            "is_neox_style": True,
        }
        self._tensors: dict[str, Any] = {}

    def setup(self) -> None:
        from kvtier_kernels import registry
        from kvtier_kernels.rope import rerotate_reference

        s, device = self.model, self.device
        gen = torch.Generator().manual_seed(self.seed)
        width = s.num_kv_heads * s.head_size
        chunk = torch.randn(2, s.num_layers, s.chunk_size, width, generator=gen).to(s.dtype)
        chunk = chunk.to(device)
        k = chunk[0]  # the K plane of a KV_2LTD chunk
        old = torch.randint(0, 4096, (s.chunk_size,), generator=gen).to(device)
        new = torch.randint(0, 4096, (s.chunk_size,), generator=gen).to(device)
        geometry = {"head_size": s.head_size, "rotary_dim": s.rope_dim, "is_neox_style": True}
        initial = k.clone()
        expected = rerotate_reference(initial.clone(), old, new, **geometry)
        self._tensors = {
            "chunk": chunk,
            "k": k,
            "old": old,
            "new": new,
            "geometry": geometry,
            "initial": initial,
            "expected": expected,
            "impl": self._impl or registry.get(self.op, self.backend, device),
        }
        _sync(device)

    def run(self, config: Any) -> None:
        t = self._tensors
        t["impl"](t["k"], t["old"], t["new"], **t["geometry"], config=config)

    def check(self, config: Any) -> str | None:
        t = self._tensors
        k = t["k"]
        k.copy_(t["initial"])
        _sync(self.device)
        self.run(config)
        _sync(self.device)
        s = self.model
        heads = (s.num_layers, s.chunk_size, s.num_kv_heads, s.head_size)
        got, want = k.cpu().view(heads), t["expected"].cpu().view(heads)
        rest = _first_difference(
            got[..., s.rope_dim :], want[..., s.rope_dim :], "layer token head dim"
        )
        if rest:
            return f"dims past rotary_dim changed: {rest}"
        got64, want64 = got[..., : s.rope_dim].double(), want[..., : s.rope_dim].double()
        tolerance = _ROPE_ATOL + _ROPE_RTOL * want64.abs()
        if k.dtype != torch.float32:
            _, exponent = torch.frexp(want64.abs())
            tolerance = tolerance + torch.ldexp(
                torch.ones_like(want64), exponent - 1 - _MANTISSA_BITS[k.dtype]
            )
        bad = (got64 - want64).abs() > tolerance
        if bool(bad.any()):
            layer, token, head, dim = (int(i) for i in bad.nonzero()[0])
            return (
                f"{int(bad.sum())} values off the torch reference beyond tolerance; first at "
                f"layer {layer}, token {token}, head {head}, dim {dim}: got "
                f"{float(got64[layer, token, head, dim])!r}, want {float(want64[layer, token, head, dim])!r}"
            )
        return None

    def teardown(self) -> None:
        self._tensors = {}


def build_problems(
    shape: ModelShape,
    *,
    device: torch.device | str,
    backend: str,
    ops: Sequence[str] = tuple(TUNABLES),
    chunk_memory: str = "pinned",
    quick: bool = False,
) -> tuple[list[TuningProblem], list[str]]:
    """The problems :func:`tune` runs for ``shape``, and notes on ops it skips (RoPE for
    fp8 caches or models without RoPE). Nothing is allocated on ``device`` yet.

    Raises:
        ValueError: an op that is not tunable.
    """
    device = torch.device(device)
    problems: list[TuningProblem] = []
    notes: list[str] = []
    for op in ops:
        if op not in TUNABLES:
            raise ValueError(f"op {op!r} is not tunable; tunable ops: {', '.join(TUNABLES)}")
        if op == "rope_rerotate":
            from kvtier_kernels.rope import SUPPORTED_DTYPES

            if shape.rope_dim == 0:
                notes.append("rope_rerotate skipped: the model has no rotary dims to re-rotate")
            elif shape.dtype not in SUPPORTED_DTYPES:
                notes.append(
                    f"rope_rerotate skipped: it does not support {dtype_name(shape.dtype)} keys"
                )
            else:
                problems.append(RopeProblem(shape, device, backend, quick=quick))
        else:
            problems.append(
                PagedCopyProblem(op, shape, device, backend, chunk_memory=chunk_memory, quick=quick)
            )
    return problems, notes
