"""Where a copy-engine transfer beats the paged-copy kernel: :func:`measure_copy_engine`
times both on contiguous runs of pages, :func:`find_crossover` reads the run size from
which ``copy_(non_blocking=True)`` wins (written into the paged copies' tuning files and
read back by :func:`kvtier_kernels.tuning.lookup.copy_engine_crossover`)."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence

import torch

from kvtier_kernels import registry
from kvtier_kernels.dtypes import dtype_name, fill_random_bits_
from kvtier_kernels.layouts import PagedKV, get_layout
from kvtier_kernels.tuning.files import CopyEngineFigures
from kvtier_kernels.tuning.lookup import format_bytes
from kvtier_kernels.tuning.problem import Progress, Timer, sync
from kvtier_kernels.tuning.shapes import ModelShape

__all__ = ["find_crossover", "measure_copy_engine"]


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
    fill_random_bits_(paged.tensors[0], torch.Generator().manual_seed(1))
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
                f"copy engine {direction}: {format_bytes(nbytes):>10}  kernel "
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
    sync(device)
    return figures
