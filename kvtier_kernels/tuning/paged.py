"""The sweep entry of ``paged_gather`` / ``paged_scatter``: the candidate launch configs
and :class:`PagedCopyProblem`, checked bit for bit against the torch reference."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from kvtier_kernels import registry
from kvtier_kernels._launch import next_power_of_2
from kvtier_kernels.dtypes import dtype_name, fill_random_bits_
from kvtier_kernels.layouts import PagedKV, get_layout
from kvtier_kernels.paged.copy import (
    LaunchConfig,
    gather_reference,
    launch_config,
    scatter_reference,
)
from kvtier_kernels.paged.rows import launch_words
from kvtier_kernels.tuning.problem import (
    TuningProblem,
    alloc_chunk,
    first_difference,
    powers_of_two,
    sync,
    warps_for,
    with_heuristic,
)
from kvtier_kernels.tuning.shapes import ModelShape

__all__ = ["PagedCopyProblem", "paged_copy_candidates", "sweep"]


def paged_copy_candidates(
    row_words: int, word_bytes: int, num_tokens: int, *, quick: bool = False
) -> list[Any]:
    """Launch configs to try for a paged copy of ``row_words``-word rows.

    Rows split into ``BLOCK_R`` words (down to 8 words, or the whole row when smaller),
    ``BLOCK_T`` from 1 to 64 tokens (at most the chunk), tiles of 256 B to 32 KiB, and
    warps for 1 to 32 words per thread. ``quick``: 4 or 8 warps and every other token count.
    """
    full_row = next_power_of_2(row_words)
    token_cap = min(64, next_power_of_2(num_tokens))
    token_choices = powers_of_two(1, token_cap)
    if quick:
        token_choices = sorted({*token_choices[::2], token_cap})
    smallest = min(256, full_row * token_cap * word_bytes)  # tiny problems: one whole tile
    configs = []
    for block_row in powers_of_two(min(8, full_row), full_row):
        for block_tokens in token_choices:
            elements = block_row * block_tokens
            if not smallest <= elements * word_bytes <= 32768:
                continue
            for num_warps in warps_for(elements, quick):
                configs.append(LaunchConfig(block_tokens, block_row, num_warps))
    return configs


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
        word_dtype, self.row_words = launch_words(replica, chunk)
        self.word_bytes = word_dtype.itemsize
        self.dtype = word_dtype
        self.key = {"row_words": self.row_words}
        heuristic = launch_config(op, self.row_words, word_dtype, self.device, tuned=False)
        # What the launcher really launches: it caps BLOCK_T at the tokens there are.
        token_cap = next_power_of_2(shape.chunk_size)
        self.heuristic = dataclasses.replace(
            heuristic, block_tokens=min(heuristic.block_tokens, token_cap)
        )
        self.candidates = with_heuristic(
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

    def setup(self) -> None:
        s, device = self.model, self.device
        gen = torch.Generator().manual_seed(self.seed)
        paged = self._cache(device, s.num_layers)
        for t in paged.tensors:
            fill_random_bits_(t, gen)
        blocks = torch.randperm(self.num_blocks, generator=gen)[: -(-s.chunk_size // s.block_size)]
        slots = (blocks[:, None] * s.block_size + torch.arange(s.block_size)).flatten()
        slots = slots[: s.chunk_size].to(device)
        padded = slots.clone()
        padded[::7] = -1
        chunk_shape = paged.chunk_shape(s.chunk_size)
        chunk = alloc_chunk(chunk_shape, s.dtype, device, self.chunk_memory)
        start = torch.empty(chunk_shape, dtype=s.dtype)
        fill_random_bits_(start, gen)
        chunk.copy_(start)
        if launch_words(paged, chunk)[0].itemsize != self.word_bytes:
            raise RuntimeError(f"{self.describe()}: word size differs from the replica's")
        t = self._tensors = {
            "paged": paged,
            "slots": {"full": slots, "padded": padded},
            "chunk": chunk,
            "start": start.to(chunk.device),
            "impl": self._impl or registry.get(self.op, self.backend, device),
        }
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
        sync(device)

    def run(self, config: Any) -> None:
        t = self._tensors
        t["impl"](t["paged"], t["slots"]["full"], t["chunk"], config=config)

    def check(self, config: Any) -> str | None:
        t = self._tensors
        paged, chunk = t["paged"], t["chunk"]
        for name, mapping in t["slots"].items():
            if self.op == "paged_gather":
                chunk.copy_(t["start"])
                sync(self.device)
                t["impl"](paged, mapping, chunk, config=config)
                sync(self.device)
                problem = first_difference(chunk, t["expected"][name], "plane layer token col")
            else:
                for x, x0 in zip(paged.tensors, t["initial"], strict=True):
                    x.copy_(x0)
                sync(self.device)
                t["impl"](paged, mapping, chunk, config=config)
                sync(self.device)
                problem = None
                for layer, (x, want) in enumerate(
                    zip(paged.tensors, t["expected"][name], strict=True)
                ):
                    problem = first_difference(x, want, " ".join(paged.layout.axes))
                    if problem:
                        problem = f"layer {layer}: {problem}"
                        break
            if problem:
                return f"{name} slot mapping: {problem}"
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
) -> TuningProblem:
    """The sweep entry of ``paged_gather`` / ``paged_scatter`` (``tuning.SWEEPS``)."""
    return PagedCopyProblem(op, shape, device, backend, chunk_memory=chunk_memory, quick=quick)
