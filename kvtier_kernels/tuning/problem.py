"""What every sweep entry shares: :class:`TuningProblem` (one op at one shape: its
candidates, how to run and check one), the grids candidates are drawn from, and the
bit-exact comparison against the torch reference.

Importing this module imports neither triton nor the op modules, and touches no GPU driver.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvtier_kernels.dtypes import bits
from kvtier_kernels.tuning.files import NUM_WARPS

__all__ = [
    "Progress",
    "Timer",
    "TuningProblem",
    "alloc_chunk",
    "first_difference",
    "powers_of_two",
    "sync",
    "warps_for",
    "with_heuristic",
]

Timer = Callable[[Callable[[], None], int, int], list[float]]
"""``timer(fn, warmup, repeats)``: call ``fn`` ``warmup`` times untimed, then return the
seconds of each of ``repeats`` timed calls."""

Progress = Callable[[str], None]
"""Called with each progress line."""


def powers_of_two(low: int, high: int) -> list[int]:
    """Powers of two in ``[low, high]``."""
    powers, p = [], 1
    while p <= high:
        if p >= low:
            powers.append(p)
        p *= 2
    return powers


def warps_for(elements: int, quick: bool) -> list[int]:
    """Warps that give every thread 1 to 32 of a tile's ``elements`` (quick: 4 or 8)."""
    fitting = [w for w in NUM_WARPS if 32 * w <= elements <= 1024 * w] or [1]
    if quick:
        fitting = [w for w in fitting if w in (4, 8)] or fitting[:1]
    return fitting


def alloc_chunk(
    shape: Sequence[int], dtype: torch.dtype, device: torch.device, chunk_memory: str
) -> torch.Tensor:
    """A chunk buffer: pinned host memory for a GPU ``device`` when ``chunk_memory`` is
    ``"pinned"``, else on ``device``."""
    if device.type == "cuda" and chunk_memory == "pinned":
        return torch.empty(tuple(shape), dtype=dtype, pin_memory=True)
    return torch.empty(tuple(shape), dtype=dtype, device=device)


def sync(device: torch.device) -> None:
    """Wait for ``device`` (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def first_difference(got: torch.Tensor, want: torch.Tensor, dims: str) -> str | None:
    """None when ``got`` and ``want`` hold the same bits, else where they first differ."""
    if got.device == want.device and torch.equal(bits(got), bits(want)):
        return None
    diff = bits(got).cpu() != bits(want).cpu()
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


def with_heuristic(candidates: list[Any], heuristic: Any) -> list[Any]:
    """``candidates`` with the heuristic's config first when it is not among them."""
    return candidates if heuristic in candidates else [heuristic, *candidates]
