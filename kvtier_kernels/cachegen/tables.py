"""CacheGen's symbol statistics: the rANS frequency table each lane is coded with.

A lane is one ``(plane, layer, channel)`` stream of ``T`` symbols in ``[0, 2n]`` (``n``:
its layer's levels). Encoder and decoder must derive the same table from what the payload
stores; the bitstream's ``model`` field (version 3) says what that is:

- ``histogram``: each lane's histogram is stored (its ``(lo, hi)`` bounds and the counts
  in between; version 2 has only this model) and the table is :func:`quantize_counts` of
  it. It fits a lane exactly but costs about one byte per used symbol per lane, which
  outweighs the lane's words in short chunks (at 64 tokens about as much as the words).
- ``gaussian``: each lane stores two bytes, a centre ``c`` (its mean symbol, rounded) and
  a spread ``k`` (0..63), and the table is :func:`quantize_counts` of the weights
  ``W[k][|s - c|]`` for ``s`` in ``[0, 2n]`` (0 above): a Gaussian of standard deviation
  ``sigma_k = 2**(k / 7 - 2)`` symbols (0.25 .. 128) sampled at the integers, in integer
  arithmetic (:func:`gaussian_weights`), every symbol of the alphabet at least weight 1.
  ``k`` is the spread whose model variance is nearest (geometrically) to the lane's
  variance (:func:`spread_thresholds`). Per-token quantization leaves each channel
  near-Gaussian around its own offset; the model costs 0.1-0.2 bits per symbol more than a
  lane's own histogram at 64-256 tokens and saves the histogram's bytes. The tables of
  every ``(n, c, k)`` are computed once per process (:func:`gaussian_codebook`), so a
  lane's table is a row lookup.

The encoder estimates the chunk's coded size with each model: the symbols' cost is
``sum -log2(f / 2**16)`` with the Gaussian tables and the lanes' empirical entropy
``sum -log2(count / T)`` with their own histograms (both from :func:`cost_table`, in
``2**-COST_BITS`` bits), plus the stored model's bytes; it keeps the smaller,
``gaussian`` on a tie (:func:`choose_gaussian`), and builds the histogram tables only if
it keeps those. Chunks of more than ``GAUSSIAN_MAX_TOKENS`` tokens use ``histogram`` (the
variance arithmetic stays inside int64).

Everything is integer arithmetic on tables built from integers (the Gaussian decays are
constants below), so every device, backend and machine derives the same tables and makes
the same choice. The torch functions here run on the tensors' device; the numba kernels of
:mod:`kvtier_kernels.cachegen.numba_kernels` compute the same from the same numpy constants.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass, field

import numpy as np
import torch

from kvtier_kernels.cachegen.rans.common import PROB_BITS, PROB_SCALE

__all__ = [
    "COST_BITS",
    "GAUSSIAN_MAX_TOKENS",
    "MAX_DISTANCE",
    "MAX_LEVELS",
    "SPREADS",
    "VARIANCE_BITS",
    "GaussianCodebook",
    "choose_gaussian",
    "coding_cost",
    "cost_table",
    "entropy_cost",
    "gaussian_codebook",
    "gaussian_freq",
    "gaussian_models",
    "gaussian_weights",
    "lane_models",
    "quantize_counts",
    "spread_sigma",
    "spread_thresholds",
]

MAX_LEVELS = 127  # n: the alphabet 2n + 1 <= 255 fits the uint8 symbols and bounds
MAX_DISTANCE = 2 * MAX_LEVELS  # |s - c| within the largest alphabet
SPREADS = 64
GAUSSIAN_MAX_TOKENS = 1 << 16  # (T * sum s^2) << VARIANCE_BITS < 2**63
VARIANCE_BITS = 12  # a lane's variance in 2**-12 symbols^2
COST_BITS = 12  # estimated sizes in 2**-12 bits
_WEIGHT_ONE = 1 << 30  # W[k][0]
# round(2**32 * exp(-1 / (2 sigma_k**2))), sigma_k = 2**(k / 7 - 2): the weight ratio
# W[k][d + 1] / W[k][d] is q**(2d + 1). Constants, so that no libm rounding enters a table.
_DECAY_Q32 = (
    1440801, 6064890, 19719312, 51875217, 114698227, 219908300,
    375092218, 581260615, 832579329, 1118002654, 1423835700, 1736237259,
    2043056144, 2334825402, 2605029347, 2849878218, 3067825158, 3259003789,
    3424697083, 3566892094, 3687937041, 3790295335, 3876381136, 3948458221,
    4008585141, 4058592392, 4100080548, 4134431211, 4162825044, 4186263044,
    4205588561, 4221508558, 4234613280, 4245393915, 4254258141, 4261543595,
    4267529426, 4272446091, 4276483635, 4279798624, 4282519944, 4284753632,
    4286586875, 4288091334, 4289325890, 4290338905, 4291170095, 4291852070,
    4292411600, 4292870656, 4293247273, 4293556249, 4293809730, 4294017681,
    4294188278, 4294328229, 4294443040, 4294537226, 4294614491, 4294677875,
    4294729873, 4294772528, 4294807520, 4294836226,
)  # fmt: skip


def spread_sigma(k: int) -> float:
    """The standard deviation (symbols) that spread ``k``'s decay was made from."""
    return 2.0 ** (k / 7 - 2)


# ---------------------------------------------------------------------------------------
# integer constants (numpy, built once)
# ---------------------------------------------------------------------------------------


@functools.cache
def _sampled_gaussians() -> tuple[tuple[int, ...], ...]:
    """``W[k][d]`` for ``d`` in ``0..MAX_DISTANCE``, before the floor of 1: ``2**30 *
    q**(d * d)`` by the integer recurrence ``w <- w * r >> 32``, ``r <- r * q * q >> 32``."""
    rows = []
    for q in _DECAY_Q32:
        q2 = q * q >> 32
        w, r, row = _WEIGHT_ONE, q, []
        for _ in range(MAX_DISTANCE + 1):
            row.append(w)
            w, r = w * r >> 32, r * q2 >> 32
        rows.append(tuple(row))
    return tuple(rows)


@functools.cache
def gaussian_weights() -> np.ndarray:
    """int64 ``[SPREADS, MAX_DISTANCE + 1]``: the Gaussian model's weight of a symbol at
    distance ``d`` from the centre, at least 1 (every symbol stays codable)."""
    table = np.maximum(np.array(_sampled_gaussians(), dtype=np.int64), 1)
    table.flags.writeable = False
    return table


@functools.cache
def spread_thresholds() -> np.ndarray:
    """int64 ``[SPREADS - 1]``, increasing: a lane with variance ``v`` (in
    ``2**-VARIANCE_BITS``) gets the spread ``k = #{j : thresholds[j] <= v}``. Threshold
    ``j`` is the geometric mean of the variances of models ``j`` and ``j + 1`` (two-sided,
    distances up to ``MAX_DISTANCE``), computed exactly in integers."""
    variances = []
    for row in _sampled_gaussians():
        total = row[0] + 2 * sum(row[1:])
        moment = 2 * sum(d * d * w for d, w in enumerate(row))
        variances.append((moment, total))  # variance = moment / total
    thresholds = [
        math.isqrt((m0 * m1 << 2 * VARIANCE_BITS) // (t0 * t1))
        for (m0, t0), (m1, t1) in itertools.pairwise(variances)
    ]
    table = np.array(thresholds, dtype=np.int64)
    table.flags.writeable = False
    return table


@functools.cache
def cost_table() -> np.ndarray:
    """int64 ``[PROB_SCALE + 1]``: ``-log2(f / PROB_SCALE)`` in ``2**-COST_BITS`` bits
    for a frequency ``f`` (entry 0 unused), from an integer log2 (the fraction's bits by
    repeated squaring), truncated."""
    f = np.arange(PROB_SCALE + 1, dtype=np.int64)
    f[0] = 1
    exponent = np.zeros_like(f)
    for bit in range(1, PROB_BITS + 1):
        exponent += f >= 1 << bit
    mantissa = f << (30 - exponent)  # [2**30, 2**31): 1.x in 2**-30
    fraction = np.zeros_like(f)
    for _ in range(COST_BITS):
        mantissa = mantissa * mantissa >> 30
        carry = mantissa >= 1 << 31
        mantissa = np.where(carry, mantissa >> 1, mantissa)
        fraction = 2 * fraction + carry
    table = (PROB_BITS << COST_BITS) - (exponent << COST_BITS) - fraction
    table.flags.writeable = False
    return table


@dataclass(frozen=True, slots=True)
class GaussianCodebook:
    """The Gaussian model's frequency table of every ``(n, centre, spread)`` for a set of
    levels ``n``: lane ``l`` with levels ``n`` and model ``(c, k)`` is coded with row
    ``first_row[n] + c * SPREADS + k`` of ``tables``."""

    tables: np.ndarray  # int32 [rows, alphabet]
    first_row: np.ndarray  # int64 [MAX_LEVELS + 1]: n -> its (c, k) = (0, 0) row, else -1
    device_copies: dict = field(default_factory=dict)  # torch.device -> (tables, first_row)

    def freq(self, models: np.ndarray, lane_levels: np.ndarray) -> np.ndarray:
        """:func:`gaussian_freq` in numpy (no torch threads to wake for a CPU kernel):
        int64 ``[lanes, alphabet]`` from uint8 ``models`` and int64 ``lane_levels``."""
        centre, spread = (models[:, i].astype(np.int64) for i in (0, 1))
        rows = self.first_row[lane_levels] + centre * SPREADS + spread
        return self.tables[rows].astype(np.int64)

    def on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(tables, first_row)`` as tensors on ``device`` (cached)."""
        device = torch.device(device)
        copies = self.device_copies.get(device)
        if copies is None:
            copies = self.device_copies[device] = (
                torch.from_numpy(self.tables.copy()).to(device),
                torch.from_numpy(self.first_row.copy()).to(device),
            )
        return copies


@functools.lru_cache(maxsize=16)
def gaussian_codebook(levels: tuple[int, ...], alphabet: int) -> GaussianCodebook:
    """The codebook of the distinct ``levels`` (each ``n`` with ``2n < alphabet``), built
    by :func:`quantize_counts` from :func:`gaussian_weights` (a few ms at ``n = 127``)."""
    symbol = torch.arange(alphabet)
    weights = torch.from_numpy(gaussian_weights().copy())
    first_row = np.full(MAX_LEVELS + 1, -1, dtype=np.int64)
    books, rows = [], 0
    for n in sorted(set(levels)):
        centre = torch.arange(2 * n + 1)
        distance = (symbol[None, :] - centre[:, None]).abs().clamp_(max=MAX_DISTANCE)
        book = weights[:, distance].permute(1, 0, 2)  # [centre, spread, symbol]
        book = torch.where(symbol <= 2 * n, book, 0).reshape(-1, alphabet)
        books.append(quantize_counts(book).to(torch.int32))
        first_row[n] = rows
        rows += len(book)
    tables = torch.cat(books).numpy()
    tables.flags.writeable = False
    first_row.flags.writeable = False
    return GaussianCodebook(tables, first_row)


_device_copies: dict[tuple[str, torch.device], torch.Tensor] = {}


def _on(device: torch.device, name: str) -> torch.Tensor:
    """One of the constants above as a tensor on ``device`` (cached)."""
    key = (name, torch.device(device))
    tensor = _device_copies.get(key)
    if tensor is None:
        tensor = _device_copies[key] = torch.from_numpy(_CONSTANTS[name]().copy()).to(device)
    return tensor


_CONSTANTS = {"thresholds": spread_thresholds, "cost": cost_table}


# ---------------------------------------------------------------------------------------
# tables (torch, on the tensors' device)
# ---------------------------------------------------------------------------------------


def quantize_counts(counts: np.ndarray | torch.Tensor) -> np.ndarray | torch.Tensor:
    """Frequencies summing to ``PROB_SCALE`` from ``counts`` ``[lanes, A]`` (each row
    non-negative with a positive total, ``A <= 255``, total ``< 2**47``): proportional,
    floored, every used symbol at least 1, the rounding remainder given to the most
    frequent symbol (first on ties). Integer arithmetic only, so every device gives the
    same table. Returns uint32 ``[lanes, A]`` for a numpy ``counts``, int64 on ``counts``'
    device for a tensor; a symbol has frequency 0 iff its count is 0."""
    as_numpy = isinstance(counts, np.ndarray)
    c = torch.from_numpy(counts) if as_numpy else counts
    c = c.to(torch.int64)
    total = c.sum(dim=1, keepdim=True)
    freq = c * PROB_SCALE // total
    freq = torch.where((c > 0) & (freq == 0), torch.ones_like(freq), freq)
    # NOTE: the top symbol has count >= total / 255, so freq >= 257 before the fix-up and
    # the fix-up subtracts at most 254 (one per other used symbol): it stays positive.
    top = c.argmax(dim=1, keepdim=True)  # the first maximum on every device
    freq.scatter_add_(1, top, PROB_SCALE - freq.sum(dim=1, keepdim=True))
    return freq.numpy().astype(np.uint32) if as_numpy else freq


def gaussian_models(counts: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Each lane's ``(centre, spread)``, uint8 ``[lanes, 2]``, from its histogram
    ``counts`` int64 ``[lanes, A]`` (rows summing to ``num_tokens <=
    GAUSSIAN_MAX_TOKENS``): the centre is the mean symbol rounded half up, the spread as
    :func:`spread_thresholds` says."""
    symbol = torch.arange(counts.shape[1], device=counts.device, dtype=torch.int64)
    first = (counts * symbol).sum(1)  # sum of the symbols
    second = (counts * symbol * symbol).sum(1)
    centre = (2 * first + num_tokens) // (2 * num_tokens)
    variance = ((num_tokens * second - first * first) << VARIANCE_BITS) // (num_tokens * num_tokens)
    spread = torch.searchsorted(_on(counts.device, "thresholds"), variance, right=True)
    return torch.stack([centre, spread], dim=1).to(torch.uint8)


def lane_models(symbols: np.ndarray) -> np.ndarray:
    """:func:`gaussian_models` of each lane of ``symbols`` (uint8 ``[lanes, T]``, ``T <=
    GAUSSIAN_MAX_TOKENS``) in numpy, from the symbols themselves: uint8 ``[lanes, 2]``.
    For a few short lanes, where torch's per-call cost would dominate."""
    num_tokens = symbols.shape[1]
    s = symbols.astype(np.int64)
    first, second = s.sum(1), (s * s).sum(1)
    centre = (2 * first + num_tokens) // (2 * num_tokens)
    variance = ((num_tokens * second - first * first) << VARIANCE_BITS) // (num_tokens**2)
    spread = np.searchsorted(spread_thresholds(), variance, side="right")
    return np.stack([centre, spread], axis=1).astype(np.uint8)


def gaussian_freq(
    models: torch.Tensor, lane_levels: torch.Tensor, codebook: GaussianCodebook
) -> torch.Tensor:
    """The Gaussian model's frequency tables, int64 ``[lanes, alphabet]`` on ``models``'
    device, from ``models`` uint8 ``[lanes, 2]`` (centre ``<= 2n``, spread ``<
    SPREADS``, checked by the caller), each lane's ``n`` (``lane_levels`` int64
    ``[lanes]``, on the same device) and the codebook of those levels; symbols above
    ``2n`` get frequency 0."""
    tables, first_row = codebook.on(models.device)
    rows = first_row[lane_levels] + models[:, 0].long() * SPREADS + models[:, 1].long()
    return tables[rows].long()


def coding_cost(counts: torch.Tensor, freq: torch.Tensor) -> torch.Tensor:
    """Estimated bits (in ``2**-COST_BITS``) of coding the symbols ``counts`` counts
    with ``freq`` (positive wherever ``counts`` is), an int64 scalar on their device."""
    return (counts * _on(counts.device, "cost")[freq]).sum()


def entropy_cost(counts: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The lanes' empirical entropy in ``2**-COST_BITS`` bits, ``sum -log2(count / T)``
    over their symbols (rows of ``counts`` sum to ``num_tokens <= PROB_SCALE``), an int64
    scalar on ``counts``' device: what coding each lane with its own histogram costs,
    less the rounding of the histogram to a table."""
    cost = _on(counts.device, "cost")
    return (counts * (cost[counts] - cost[num_tokens])).sum()


def choose_gaussian(
    histogram_cost: int, histogram_bytes: int, gaussian_cost: int, gaussian_bytes: int
) -> bool:
    """Whether the Gaussian model's estimated size (coded symbols + stored model) is at
    most the histogram model's."""
    return gaussian_cost + (8 * gaussian_bytes << COST_BITS) <= histogram_cost + (
        8 * histogram_bytes << COST_BITS
    )
