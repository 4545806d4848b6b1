"""CacheGen's quantization, statistics and dequantization as numba CPU kernels.

:mod:`kvtier_kernels.cachegen.codec` runs these steps as torch code on the chunk's device; when
its rANS coder is the ``numba`` backend (``auto`` on a CPU with numba installed), it runs
them here instead, with the same results bit for bit (the tests compare both):

- :func:`encode_statistics`: chunk ``[2, L, T, D]`` -> per-token scales, the symbols of
  each lane ``[lanes, T]``, each lane's frequency table under the model the encoder
  picks (:mod:`kvtier_kernels.cachegen.tables`: both models' sizes estimated, the
  Gaussian fitted) and that model's payload sections: one pass over the chunk, one or two
  over the counts;
- :func:`histogram_tables`: the stored histograms -> each lane's frequency table, once
  the histograms are checked (a Gaussian lane's table is a row of the codebook);
- :func:`dequantize`: symbols -> ``out``, once the symbols' histograms match the stored
  ones, or give the stored Gaussian models (``out`` is untouched otherwise).

The arithmetic is the torch code's: float32 absmax, ``step = scale / n`` and
``x / step`` as correctly rounded float32 divisions, round half to even, integer tables,
round to nearest even from float32 to bf16. Plane ``p = kv * L + layer`` holds lanes
``p * D .. p * D + D - 1`` (one per channel). Bytes moved: encode reads the chunk once and
writes the symbols once (``lanes * T``), then reads them once more per plane, while they
are cached, for the histograms; decode reads the symbols twice (histogram check, then
dequantization) and writes ``out`` once.

Every kernel runs one plane or one lane per ``prange`` iteration (see
:class:`~kvtier_kernels._launch.NumbaKernel`: compiled on first use, cached on disk). The
launchers raise :class:`~kvtier_kernels._launch.NumbaUnavailable` where numba fails to
import or to compile; the codec catches it and runs its torch code.

NOTE: no ``prange`` loop sums anything across its iterations: each iteration sets its own
plane's or lane's flag in an array, and the launcher reads the array. numba's parfor pass
finds a reduction's update by following the copies of its variable, and from Python 3.12
on (numba 0.65 to 0.68 at least), a flag reassigned in an inner loop and summed across
iterations orders those copies into a cycle it does not detect: compiling raises
``RecursionError`` (or ``AssertionError: unexpected cycle in lookup()``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvtier_kernels._launch import NumbaKernel
from kvtier_kernels.cachegen.rans.common import PROB_SCALE, CodecError
from kvtier_kernels.cachegen.tables import (
    GAUSSIAN_MAX_TOKENS,
    SPREADS,
    VARIANCE_BITS,
    choose_gaussian,
    cost_table,
    gaussian_codebook,
    spread_thresholds,
)

__all__ = [
    "KERNELS",
    "dequantize",
    "encode_statistics",
    "histogram_tables",
]

prange: Any = range  # numba.prange once a kernel is compiled (NumbaKernel.get)
_TILE = 16  # tokens quantized together, then transposed to lanes


# ---------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------


def _frequencies(counts, freq):
    """``freq = quantize_counts(counts)`` for one lane's row (see
    :mod:`kvtier_kernels.cachegen.tables`): proportional, floored, every used symbol at
    least 1, the remainder to the first most frequent symbol. The row's total must be
    positive; ``freq`` may be ``counts`` itself."""
    alphabet = counts.shape[0]
    total, top, best = 0, 0, -1
    for a in range(alphabet):
        total += counts[a]
        if counts[a] > best:
            top, best = a, counts[a]
    assigned = 0
    for a in range(alphabet):
        f = 0
        if counts[a] > 0:
            f = max(1, counts[a] * PROB_SCALE // total)
        freq[a] = f
        assigned += f
    freq[top] += PROB_SCALE - assigned


def _gaussian_model(counts, num_tokens, thresholds):
    """``(centre, spread)`` of one lane's histogram, as ``gaussian_models`` computes it."""
    first, second = 0, 0
    for a in range(counts.shape[0]):
        first += a * counts[a]
        second += a * a * counts[a]
    centre = (2 * first + num_tokens) // (2 * num_tokens)
    variance = ((num_tokens * second - first * first) << VARIANCE_BITS) // (num_tokens * num_tokens)
    spread, above = 0, thresholds.shape[0]  # spread: the number of thresholds <= variance
    while spread < above:
        middle = (spread + above) // 2
        if thresholds[middle] <= variance:
            spread = middle + 1
        else:
            above = middle
    return centre, spread


def _cost(counts, freq, cost):
    """Estimated bits (``2**-COST_BITS``) of one lane's symbols coded with ``freq``."""
    bits = 0
    for a in range(counts.shape[0]):
        if counts[a] > 0:
            bits += counts[a] * cost[freq[a]]
    return bits


def quantize_kernel(
    x,  # [planes, T, D] uint16 (bf16 bits) or uint32 (float32 bits), contiguous
    shift,  # 16 for bf16 bits, 0 for float32 bits
    levels,  # [planes] float32: levels_half n of each plane
    scale,  # [planes, T] float32 (out): absmax of each token's row
    symbols,  # [planes * D, T] uint8 (out): q + n
    counts,  # [planes * D, A] int64 (out): each lane's histogram
    nonfinite,  # [planes] uint8 (out): 1 where the plane holds inf or nan (its symbols wrong)
):
    planes, tokens, hidden = x.shape
    for p in prange(planes):
        n = levels[p]
        bits = np.empty(hidden, np.uint32)  # a token's row as float32 bits ...
        row = bits.view(np.float32)  # ... and values
        top = np.empty(1, np.uint32)  # the row's absmax as bits and value
        tile = np.empty((_TILE, hidden), np.uint8)  # symbols of _TILE tokens
        nonfinite[p] = 0
        for t0 in range(0, tokens, _TILE):
            width = min(_TILE, tokens - t0)
            for k in range(width):
                top_bits = 0
                for d in range(hidden):
                    bits[d] = np.uint32(x[p, t0 + k, d]) << shift
                    top_bits = max(top_bits, bits[d] & 0x7FFFFFFF)  # |x| orders as its bits
                if top_bits >= 0x7F800000:  # inf or nan: the caller raises
                    nonfinite[p], top_bits = 1, 0
                    bits[:] = 0
                top[0] = top_bits
                scale[p, t0 + k] = top.view(np.float32)[0]
                step = top.view(np.float32)[0] / n
                safe = step if step > 0 else np.float32(1)
                for d in range(hidden):
                    tile[k, d] = np.uint8(min(max(np.rint(row[d] / safe), -n), n) + n)
            for d in range(hidden):
                for k in range(width):
                    symbols[p * hidden + d, t0 + k] = tile[k, d]
        seen = np.empty((4, counts.shape[1]), np.int64)  # 4 histograms: no chains of += 1
        for lane in range(p * hidden, (p + 1) * hidden):
            seen[:] = 0
            for t in range(tokens):
                seen[t & 3, symbols[lane, t]] += 1
            for a in range(counts.shape[1]):
                counts[lane, a] = seen[0, a] + seen[1, a] + seen[2, a] + seen[3, a]


def tables_kernel(
    counts,  # [lanes, A] int64: histograms summing to num_tokens
    lane_first_row,  # [lanes] int64: the codebook row of (lane's n, centre 0, spread 0)
    codebook,  # [rows, A] int32: the Gaussian tables (GaussianCodebook.tables)
    thresholds,  # [SPREADS - 1] int64: spread_thresholds()
    cost,  # [PROB_SCALE + 1] int64: cost_table()
    num_tokens,
    gaussian,  # whether to fit the Gaussian model (num_tokens <= GAUSSIAN_MAX_TOKENS)
    bounds,  # [lanes, 2] uint8 (out): (lo, hi), the used symbol range
    models,  # [lanes, 2] uint8 (out): (centre, spread), if gaussian
    freq,  # [lanes, A] int64 (out): the lane's Gaussian table, if gaussian
    lane_cost,  # [lanes, 3] int64 (out): entropy bits, stored counts, Gaussian bits
):
    lanes, alphabet = counts.shape
    for lane in prange(lanes):
        row = counts[lane]
        lo, hi = alphabet, 0
        for a in range(alphabet):
            if row[a] > 0:
                lo, hi = min(lo, a), a
        bounds[lane, 0], bounds[lane, 1] = lo, hi
        lane_cost[lane, 1] = hi - lo + 1 if hi > lo else 0
        if gaussian:
            entropy = 0
            for a in range(lo, hi + 1):
                entropy += row[a] * (cost[row[a]] - cost[num_tokens])
            lane_cost[lane, 0] = entropy
            centre, spread = _gaussian_model(row, num_tokens, thresholds)
            models[lane, 0], models[lane, 1] = centre, spread
            table = codebook[lane_first_row[lane] + centre * SPREADS + spread]
            for a in range(alphabet):
                freq[lane, a] = table[a]
            lane_cost[lane, 2] = _cost(row, freq[lane], cost)


def frequencies_kernel(
    counts,  # [lanes, A] int64: histograms with a positive total
    freq,  # [lanes, A] int64 (out): quantize_counts(counts)
):
    for lane in prange(counts.shape[0]):
        _frequencies(counts[lane], freq[lane])


def _lane_starts(bounds, starts):
    """``starts[lane]``: where each lane's stored counts ``counts[lo..hi]`` begin (lanes with
    ``lo < hi`` store ``hi - lo + 1`` of them, the others none); returns their total."""
    total = 0
    for lane in range(bounds.shape[0]):
        starts[lane] = total
        if bounds[lane, 1] > bounds[lane, 0]:
            total += np.int64(bounds[lane, 1]) - np.int64(bounds[lane, 0]) + 1
    return total


def pack_kernel(
    counts,  # [lanes, A] int64
    bounds,  # [lanes, 2] uint8: (lo, hi)
    like,  # [1] of the stored counts' dtype
):  # -> stored counts: counts[lo..hi] of each lane with lo < hi, lanes in order
    lanes = counts.shape[0]
    starts = np.empty(lanes, np.int64)
    total = _lane_starts(bounds, starts)
    stored = np.empty(total, like.dtype)
    for lane in prange(lanes):
        lo, hi = np.int64(bounds[lane, 0]), np.int64(bounds[lane, 1])
        if hi > lo:
            for k in range(hi - lo + 1):
                stored[starts[lane] + k] = counts[lane, lo + k]
    return stored


def unpack_kernel(
    bounds,  # [lanes, 2] uint8: (lo, hi) with lo <= hi < A
    stored,  # [sum of widths] uint8/uint16/uint32: counts[lo..hi] of the lanes with lo < hi
    num_tokens,
    counts,  # [lanes, A] int64 (out, zeroed by the caller)
    freq,  # [lanes, A] int64 (out): frequency tables, where the histogram is good
    bad,  # [lanes] uint8 (out): 1 where the histogram does not sum to num_tokens or is not tight
):
    lanes = bounds.shape[0]
    starts = np.empty(lanes, np.int64)
    _lane_starts(bounds, starts)
    for lane in prange(lanes):
        lo, hi = np.int64(bounds[lane, 0]), np.int64(bounds[lane, 1])
        if lo == hi:
            counts[lane, lo] = num_tokens
        else:
            for k in range(hi - lo + 1):
                counts[lane, lo + k] = stored[starts[lane] + k]
        row_total = 0
        for k in range(hi - lo + 1):
            row_total += counts[lane, lo + k]
        bad[lane] = row_total != num_tokens or counts[lane, lo] == 0 or counts[lane, hi] == 0
        if not bad[lane]:
            _frequencies(counts[lane], freq[lane])


def dequantize_kernel(
    symbols,  # [planes * D, T] uint8
    gaussian,  # whether the check is against models (else against counts)
    counts,  # [planes * D, A] int64: the histograms the symbols must have
    models,  # [planes * D, 2] uint8: the Gaussian models the symbols must give
    thresholds,  # [SPREADS - 1] int64
    scale,  # [planes, T] float32
    levels,  # [planes] float32: levels_half n of each plane
    out,  # [planes, T, D] float32, or uint16 for bf16 bits (out)
    bf16,  # whether out holds bf16 bits (rounded to nearest even from float32)
    top,  # float32: the largest finite value of out's dtype, where values are clamped
    bad,  # [planes] uint8 (out): 1 where a lane's symbols disagree with its model
):  # out is written only when no plane is bad
    lanes, tokens = symbols.shape
    planes, alphabet = scale.shape[0], counts.shape[1]
    hidden = lanes // planes
    for p in prange(planes):
        seen = np.empty((4, alphabet + 1), np.int64)  # 4 histograms, then a bin for >= A
        row = np.empty(alphabet, np.int64)
        bad[p] = 0
        for lane in range(p * hidden, (p + 1) * hidden):
            seen[:] = 0
            for t in range(tokens):
                seen[t & 3, min(np.int64(symbols[lane, t]), alphabet)] += 1
            for a in range(alphabet):
                row[a] = seen[0, a] + seen[1, a] + seen[2, a] + seen[3, a]
            if gaussian:
                centre, spread = _gaussian_model(row, tokens, thresholds)
                extra = seen[0, alphabet] + seen[1, alphabet] + seen[2, alphabet]
                if (
                    extra + seen[3, alphabet]
                    or centre != models[lane, 0]
                    or spread != models[lane, 1]
                ):
                    bad[p] = 1
            else:
                for a in range(alphabet):
                    if row[a] != counts[lane, a]:
                        bad[p] = 1
    for p in range(planes):  # serial: not a reduction (see the module's NOTE)
        if bad[p]:
            return
    for p in prange(planes):
        n = levels[p]
        bits = np.empty(hidden, np.uint32)  # a token's row as float32 bits ...
        row = bits.view(np.float32)  # ... and values
        for t in range(tokens):
            step = scale[p, t] / n
            for d in range(hidden):  # reads across lanes: the plane's symbols stay cached
                value = (np.float32(symbols[p * hidden + d, t]) - n) * step
                row[d] = min(max(value, -top), top)  # n * step may round above ``top``
            if bf16:
                for d in range(hidden):
                    out[p, t, d] = (bits[d] + 0x7FFF + ((bits[d] >> 16) & 1)) >> 16
            else:
                for d in range(hidden):
                    out[p, t, d] = row[d]


_HELPERS = [_frequencies, _gaussian_model, _cost, _lane_starts]
KERNELS = {
    "quantize": NumbaKernel(quantize_kernel, op="rans_encode"),
    "tables": NumbaKernel(tables_kernel, helpers=_HELPERS, op="rans_encode"),
    "frequencies": NumbaKernel(frequencies_kernel, helpers=_HELPERS, op="rans_encode"),
    "pack": NumbaKernel(pack_kernel, helpers=_HELPERS, op="rans_encode"),
    "unpack": NumbaKernel(unpack_kernel, helpers=_HELPERS, op="rans_decode"),
    "dequantize": NumbaKernel(dequantize_kernel, helpers=_HELPERS, op="rans_decode"),
}
"""The codec's numba kernels by step, compiled on first use. They run with the ``numba``
coder, so they belong to its ops: where one of the encoder's steps fails to compile, the
codec encodes with its torch code (``rans_encode``), and likewise for decoding."""


# ---------------------------------------------------------------------------------------
# launchers
# ---------------------------------------------------------------------------------------


def _plane_levels(k_levels: list[int], v_levels: list[int]) -> np.ndarray:
    return np.array(k_levels + v_levels, dtype=np.float32)


def encode_statistics(
    chunk: torch.Tensor,  # [2, L, T, D] bf16/fp16/fp32
    k_levels: list[int],
    v_levels: list[int],
    alphabet: int,
    count_dtype: np.dtype,
    model: str | None,
) -> tuple[np.ndarray, torch.Tensor, torch.Tensor, str, list[np.ndarray]]:
    """Quantize ``chunk`` (checked by the caller but for finiteness) and build its tables
    for ``model`` (None: the model estimated smaller).

    Returns ``(scale, symbols, freq, model, tables)`` as
    :data:`kvtier_kernels.cachegen.codec.Statistics` describes them (the tensors on the CPU).

    Raises:
        ValueError: the chunk holds a non-finite value.
    """
    _, num_layers, num_tokens, hidden = chunk.shape
    planes, lanes = 2 * num_layers, 2 * num_layers * hidden
    x = chunk.detach().cpu()
    if x.dtype == torch.float16:
        x = x.float()  # exact; numba has no fp16 loads
    shift = 16 if x.dtype == torch.bfloat16 else 0
    bits = x.contiguous().view(torch.int16 if shift else torch.int32).numpy()
    bits = bits.view(np.uint16 if shift else np.uint32).reshape(planes, num_tokens, hidden)
    scale = np.empty((planes, num_tokens), dtype=np.float32)
    symbols = np.empty((lanes, num_tokens), dtype=np.uint8)
    counts = np.empty((lanes, alphabet), dtype=np.int64)
    nonfinite = np.empty(planes, dtype=np.uint8)
    levels = _plane_levels(k_levels, v_levels)
    KERNELS["quantize"](bits, shift, levels, scale, symbols, counts, nonfinite, work=symbols.size)
    if nonfinite.any():
        raise ValueError("chunk holds non-finite values (inf/nan), which cannot be quantized")
    gaussian = model != "histogram" and num_tokens <= GAUSSIAN_MAX_TOKENS
    codebook = gaussian_codebook(tuple(sorted(set(k_levels + v_levels))), alphabet)
    lane_levels = np.repeat(np.array(k_levels + v_levels, dtype=np.int64), hidden)
    bounds = np.empty((lanes, 2), dtype=np.uint8)
    models = np.empty((lanes, 2), dtype=np.uint8)
    freq = np.empty((lanes, alphabet), dtype=np.int64)
    lane_cost = np.zeros((lanes, 3), dtype=np.int64)
    KERNELS["tables"](
        counts,  # [lanes, A]
        codebook.first_row[lane_levels],  # [lanes]
        codebook.tables,  # [rows, A]
        spread_thresholds(),
        cost_table(),
        num_tokens,
        gaussian,
        bounds,  # [lanes, 2]
        models,  # [lanes, 2]
        freq,  # [lanes, A]
        lane_cost,  # [lanes, 3]
        work=counts.size,
    )
    scale = scale.reshape(2, num_layers, num_tokens)
    symbols_t = torch.from_numpy(symbols)
    if gaussian:
        entropy, num_stored, gaussian_cost = lane_cost.sum(0).tolist()
        histogram_bytes = 2 * lanes + num_stored * count_dtype.itemsize
        if model == "gaussian" or choose_gaussian(
            entropy, histogram_bytes, gaussian_cost, 2 * lanes
        ):
            return scale, symbols_t, torch.from_numpy(freq), "gaussian", [models]
    KERNELS["frequencies"](counts, freq, work=counts.size)
    like = np.zeros(1, dtype=count_dtype)
    stored = KERNELS["pack"](counts, bounds, like, work=counts.size)
    return scale, symbols_t, torch.from_numpy(freq), "histogram", [bounds, stored]


def histogram_tables(
    bounds: np.ndarray,  # [lanes, 2] uint8, lo <= hi < alphabet (checked by the caller)
    stored: np.ndarray,  # the stored counts, as many as the bounds say (checked)
    num_tokens: int,
    alphabet: int,
) -> tuple[np.ndarray, torch.Tensor]:
    """Each lane's histogram int64 ``[lanes, alphabet]`` and frequency table (a CPU
    tensor of the same shape).

    Raises:
        CodecError: a lane's histogram does not sum to ``num_tokens`` or is not tight.
    """
    lanes = bounds.shape[0]
    counts = np.zeros((lanes, alphabet), dtype=np.int64)
    freq = np.zeros((lanes, alphabet), dtype=np.int64)
    bad = np.empty(lanes, dtype=np.uint8)
    KERNELS["unpack"](bounds, stored, num_tokens, counts, freq, bad, work=counts.size)
    if bad.any():
        raise CodecError("a lane's histogram does not sum to num_tokens or is not tight")
    return counts, torch.from_numpy(freq)


def dequantize(
    symbols: torch.Tensor,  # [lanes, T] uint8
    model: str,  # "histogram" or "gaussian"
    expected: np.ndarray,  # [lanes, A] int64 histograms, or [lanes, 2] uint8 models
    scale: np.ndarray,  # [2 * L * T] float32
    k_levels: list[int],
    v_levels: list[int],
    out: torch.Tensor,  # [2, L, T, D] bf16/fp16/fp32, contiguous, any device
) -> None:
    """Write the dequantized chunk into ``out`` once every lane's symbols have the
    histogram ``expected`` holds for it, or give its Gaussian model.

    Raises:
        CodecError: some lane's symbols disagree with its model (``out`` untouched).
    """
    _, num_layers, num_tokens, hidden = out.shape
    planes = 2 * num_layers
    alphabet = 2 * max(k_levels + v_levels) + 1
    gaussian = model == "gaussian"
    counts = np.zeros((1, alphabet), np.int64) if gaussian else expected
    models = expected if gaussian else np.zeros((1, 2), np.uint8)
    bf16 = out.dtype == torch.bfloat16
    direct = out.device.type == "cpu" and out.dtype in (torch.bfloat16, torch.float32)
    target = out if direct else torch.empty(out.shape, dtype=out.dtype if bf16 else torch.float32)
    values = target.view(torch.int16).numpy().view(np.uint16) if bf16 else target.numpy()
    bad = np.empty(planes, dtype=np.uint8)
    KERNELS["dequantize"](
        symbols.cpu().contiguous().numpy(),  # [lanes, T]
        gaussian,
        counts,  # [lanes, A]
        models,  # [lanes, 2]
        spread_thresholds(),
        scale.reshape(planes, num_tokens),  # [planes, T]
        _plane_levels(k_levels, v_levels),  # [planes]
        values.reshape(planes, num_tokens, hidden),  # [planes, T, D]
        bf16,
        np.float32(torch.finfo(out.dtype).max),
        bad,  # [planes]
        work=symbols.numel(),
    )
    if bad.any():
        raise CodecError(f"decoded symbols disagree with the stored {model} model")
    if not direct:
        out.copy_(target)
