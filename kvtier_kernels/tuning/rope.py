"""The sweep entry of ``rope_rerotate``: the candidate launch configs and
:class:`RopeProblem`, checked against the torch reference within a stated tolerance."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kvtier_kernels import registry
from kvtier_kernels._launch import next_power_of_2
from kvtier_kernels.dtypes import dtype_name
from kvtier_kernels.layouts import get_layout
from kvtier_kernels.rope.rerotation import (
    SUPPORTED_DTYPES,
    LaunchConfig,
    launch_config,
    rerotate_reference,
)
from kvtier_kernels.tuning.problem import (
    TuningProblem,
    first_difference,
    powers_of_two,
    sync,
    warps_for,
    with_heuristic,
)
from kvtier_kernels.tuning.shapes import ModelShape

__all__ = ["RopeProblem", "rope_candidates", "sweep"]


def rope_candidates(half_rotary: int, num_tokens: int, *, quick: bool = False) -> list[Any]:
    """Launch configs to try for re-rotating ``half_rotary`` pairs per head.

    ``BLOCK_P`` from 8 pairs (or the whole head when smaller) to the whole head,
    ``BLOCK_T`` from 1 to 128 tokens (at most the chunk), tiles of 64 to 8192 pairs, and
    warps for 1 to 32 pairs per thread. ``quick``: 4 or 8 warps and every other token count.
    """
    all_pairs = next_power_of_2(half_rotary)
    token_cap = min(128, next_power_of_2(num_tokens))
    token_choices = powers_of_two(1, token_cap)
    if quick:
        token_choices = sorted({*token_choices[::2], token_cap})
    smallest = min(64, all_pairs * token_cap)  # tiny problems: one whole tile
    configs = []
    for block_pairs in powers_of_two(min(8, all_pairs), all_pairs):
        for block_tokens in token_choices:
            pairs = block_pairs * block_tokens
            if not smallest <= pairs <= 8192:
                continue
            for num_warps in warps_for(pairs, quick):
                configs.append(LaunchConfig(block_tokens, block_pairs, num_warps))
    return configs


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
        if shape.dtype not in SUPPORTED_DTYPES:
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
        self.heuristic = launch_config(
            half, shape.chunk_size, shape.dtype, self.device, tuned=False
        )
        self.candidates = with_heuristic(
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
        sync(device)

    def run(self, config: Any) -> None:
        t = self._tensors
        t["impl"](t["k"], t["old"], t["new"], **t["geometry"], config=config)

    def check(self, config: Any) -> str | None:
        t = self._tensors
        k = t["k"]
        k.copy_(t["initial"])
        sync(self.device)
        self.run(config)
        sync(self.device)
        s = self.model
        heads = (s.num_layers, s.chunk_size, s.num_kv_heads, s.head_size)
        got, want = k.cpu().view(heads), t["expected"].cpu().view(heads)
        rest = first_difference(
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


def sweep(
    op: str,
    shape: ModelShape,
    device: torch.device,
    backend: str,
    *,
    chunk_memory: str = "pinned",
    quick: bool = False,
) -> TuningProblem | str:
    """The sweep entry of ``rope_rerotate`` (``tuning.SWEEPS``): a note instead of a problem
    for fp8 caches, models without RoPE and latent (MLA) layouts, which kvtier never
    re-rotates. The keys are re-rotated where they are, so ``chunk_memory`` does not apply."""
    del op, chunk_memory
    if shape.rope_dim == 0:
        return "rope_rerotate skipped: the model has no rotary dims to re-rotate"
    if get_layout(shape.layout).kv_planes != 2:
        return f"rope_rerotate skipped: layout {shape.layout!r} holds latent KV, never re-rotated"
    if shape.dtype not in SUPPORTED_DTYPES:
        return f"rope_rerotate skipped: it does not support {dtype_name(shape.dtype)} keys"
    return RopeProblem(shape, device, backend, quick=quick)
