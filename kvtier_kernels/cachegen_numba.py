"""CacheGen's quantization, statistics and dequantization as numba CPU kernels.

:mod:`kvtier_kernels.cachegen` runs these steps as torch code on the chunk's device; when
its rANS coder is the ``numba`` backend (``auto`` on a CPU with numba installed), it runs
them here instead, with the same results bit for bit (the tests compare both):

- :func:`encode_statistics`: chunk ``[2, L, T, D]`` -> per-token scales, the symbols of
  each lane ``[lanes, T]``, each lane's frequency table, ``(lo, hi)`` bounds and stored
  counts (the payload's ``counts`` section): one pass over the chunk, one over the counts;
- :func:`decode_tables`: bounds + stored counts -> each lane's histogram (checked) and
  frequency table;
- :func:`dequantize`: symbols -> ``out``, once the symbols' histograms match the stored
  ones (``out`` is untouched otherwise).

The arithmetic is the torch code's: float32 absmax, ``step = scale / n`` and
``x / step`` as correctly rounded float32 divisions, round half to even, integer tables,
round to nearest even from float32 to bf16. Plane ``p = kv * L + layer`` holds lanes
``p * D .. p * D + D - 1`` (one per channel). Bytes moved: encode reads the chunk once and
writes the symbols once (``lanes * T``), then reads them once more per plane, while they
are cached, for the histograms; decode reads the symbols twice (histogram check, then
dequantization) and writes ``out`` once.

Every kernel runs one plane or one lane per ``prange`` iteration (see
:class:`~kvtier_kernels._launch.NumbaKernel`: compiled on first use, cached on disk).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvtier_kernels._launch import NumbaKernel
from kvtier_kernels.rans import PROB_SCALE, CodecError

__all__ = ["KERNELS", "decode_tables", "dequantize", "encode_statistics"]

prange: Any = range  # numba.prange once a kernel is compiled (NumbaKernel.get)
_TILE = 16  # tokens quantized together, then transposed to lanes


# ---------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------


def _frequencies(counts, freq, lane):
    """``freq[lane] = quantize_counts(counts[lane])`` (see :mod:`kvtier_kernels.cachegen`):
    proportional, floored, every used symbol at least 1, the remainder to the first most
    frequent symbol. The row's total must be positive."""
    alphabet = counts.shape[1]
    total, top, best = 0, 0, -1
    for a in range(alphabet):
        total += counts[lane, a]
        if counts[lane, a] > best:
            top, best = a, counts[lane, a]
    assigned = 0
    for a in range(alphabet):
        f = 0
        if counts[lane, a] > 0:
            f = max(1, counts[lane, a] * PROB_SCALE // total)
        freq[lane, a] = f
        assigned += f
    freq[lane, top] += PROB_SCALE - assigned


def quantize_kernel(
    x,  # [planes, T, D] uint16 (bf16 bits) or uint32 (float32 bits), contiguous
    shift,  # 16 for bf16 bits, 0 for float32 bits
    levels,  # [planes] float32: levels_half n of each plane
    scale,  # [planes, T] float32 (out): absmax of each token's row
    symbols,  # [planes * D, T] uint8 (out): q + n
    counts,  # [planes * D, A] int64 (out): each lane's histogram
):  # -> the number of planes holding a non-finite value (their symbols are then wrong)
    planes, tokens, hidden = x.shape
    nonfinite = 0
    for p in prange(planes):
        n = levels[p]
        bits = np.empty(hidden, np.uint32)  # a token's row as float32 bits ...
        row = bits.view(np.float32)  # ... and values
        top = np.empty(1, np.uint32)  # the row's absmax as bits and value
        tile = np.empty((_TILE, hidden), np.uint8)  # symbols of _TILE tokens
        plane_bad = 0
        for t0 in range(0, tokens, _TILE):
            width = min(_TILE, tokens - t0)
            for k in range(width):
                top_bits = 0
                for d in range(hidden):
                    bits[d] = np.uint32(x[p, t0 + k, d]) << shift
                    top_bits = max(top_bits, bits[d] & 0x7FFFFFFF)  # |x| orders as its bits
                if top_bits >= 0x7F800000:  # inf or nan: the caller raises
                    plane_bad, top_bits = 1, 0
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
        nonfinite += plane_bad
    return nonfinite


def tables_kernel(
    counts,  # [lanes, A] int64: histograms with a positive total
    freq,  # [lanes, A] int64 (out): frequency tables
    bounds,  # [lanes, 2] uint8 (out): (lo, hi), the used symbol range
    like,  # [1] of the stored counts' dtype
):  # -> stored counts: counts[lo..hi] of each lane with lo < hi, lanes in order
    lanes, alphabet = counts.shape
    widths = np.empty(lanes, np.int64)
    for lane in prange(lanes):
        _frequencies(counts, freq, lane)
        lo, hi = alphabet, 0
        for a in range(alphabet):
            if counts[lane, a] > 0:
                lo, hi = min(lo, a), a
        bounds[lane, 0], bounds[lane, 1] = lo, hi
        widths[lane] = hi - lo + 1 if hi > lo else 0
    starts = np.empty(lanes, np.int64)
    total = 0
    for lane in range(lanes):
        starts[lane] = total
        total += widths[lane]
    stored = np.empty(total, like.dtype)
    for lane in prange(lanes):
        lo = np.int64(bounds[lane, 0])
        for k in range(widths[lane]):
            stored[starts[lane] + k] = counts[lane, lo + k]
    return stored


def unpack_kernel(
    bounds,  # [lanes, 2] uint8: (lo, hi) with lo <= hi < A
    stored,  # [sum of widths] uint8/uint16/uint32: counts[lo..hi] of the lanes with lo < hi
    num_tokens,
    counts,  # [lanes, A] int64 (out, zeroed by the caller)
    freq,  # [lanes, A] int64 (out): frequency tables, where the histogram is good
):  # -> the number of lanes whose histogram does not sum to num_tokens or is not tight
    lanes = bounds.shape[0]
    starts = np.empty(lanes, np.int64)
    total = 0
    for lane in range(lanes):
        starts[lane] = total
        if bounds[lane, 1] > bounds[lane, 0]:
            total += np.int64(bounds[lane, 1]) - np.int64(bounds[lane, 0]) + 1
    bad = 0
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
        if row_total != num_tokens or counts[lane, lo] == 0 or counts[lane, hi] == 0:
            bad += 1
        else:
            _frequencies(counts, freq, lane)
    return bad


def dequantize_kernel(
    symbols,  # [planes * D, T] uint8
    counts,  # [planes * D, A] int64: the histograms the symbols must have
    scale,  # [planes, T] float32
    levels,  # [planes] float32: levels_half n of each plane
    out,  # [planes, T, D] float32, or uint16 for bf16 bits (out)
    bf16,  # whether out holds bf16 bits (rounded to nearest even from float32)
):  # -> the number of planes where a lane's symbols disagree with counts (out untouched)
    lanes, tokens = symbols.shape
    planes, alphabet = scale.shape[0], counts.shape[1]
    hidden = lanes // planes
    bad = 0
    for p in prange(planes):
        seen = np.empty((4, alphabet + 1), np.int64)  # 4 histograms, then a bin for >= A
        plane_bad = 0
        for lane in range(p * hidden, (p + 1) * hidden):
            seen[:] = 0
            for t in range(tokens):
                seen[t & 3, min(np.int64(symbols[lane, t]), alphabet)] += 1
            for a in range(alphabet):
                if seen[0, a] + seen[1, a] + seen[2, a] + seen[3, a] != counts[lane, a]:
                    plane_bad = 1
        bad += plane_bad
    if bad:
        return bad
    for p in prange(planes):
        n = levels[p]
        bits = np.empty(hidden, np.uint32)  # a token's row as float32 bits ...
        row = bits.view(np.float32)  # ... and values
        for t in range(tokens):
            step = scale[p, t] / n
            for d in range(hidden):  # reads across lanes: the plane's symbols stay cached
                row[d] = (np.float32(symbols[p * hidden + d, t]) - n) * step
            if bf16:
                for d in range(hidden):
                    out[p, t, d] = (bits[d] + 0x7FFF + ((bits[d] >> 16) & 1)) >> 16
            else:
                for d in range(hidden):
                    out[p, t, d] = row[d]
    return 0


KERNELS = {
    "quantize": NumbaKernel(quantize_kernel),
    "tables": NumbaKernel(tables_kernel, helpers=[_frequencies]),
    "unpack": NumbaKernel(unpack_kernel, helpers=[_frequencies]),
    "dequantize": NumbaKernel(dequantize_kernel),
}
"""The codec's numba kernels by step, compiled on first use."""


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
) -> tuple[np.ndarray, torch.Tensor, torch.Tensor, np.ndarray, np.ndarray]:
    """Quantize ``chunk`` (checked by the caller but for finiteness) and build its tables.

    Returns ``(scale, symbols, freq, bounds, stored)``: float32 ``[2, L, T]``, uint8
    ``[lanes, T]`` and int64 ``[lanes, alphabet]`` tensors on the CPU, uint8
    ``[lanes, 2]``, and the stored counts as ``count_dtype``.

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
    levels = _plane_levels(k_levels, v_levels)
    if KERNELS["quantize"](bits, shift, levels, scale, symbols, counts, work=symbols.size):
        raise ValueError("chunk holds non-finite values (inf/nan), which cannot be quantized")
    freq = np.empty((lanes, alphabet), dtype=np.int64)
    bounds = np.empty((lanes, 2), dtype=np.uint8)
    like = np.zeros(1, dtype=count_dtype)
    stored = KERNELS["tables"](counts, freq, bounds, like, work=counts.size)
    return (
        scale.reshape(2, num_layers, num_tokens),
        torch.from_numpy(symbols),
        torch.from_numpy(freq),
        bounds,
        stored,
    )


def decode_tables(
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
    if KERNELS["unpack"](bounds, stored, num_tokens, counts, freq, work=counts.size):
        raise CodecError("a lane's histogram does not sum to num_tokens or is not tight")
    return counts, torch.from_numpy(freq)


def dequantize(
    symbols: torch.Tensor,  # [lanes, T] uint8
    counts: np.ndarray,  # [lanes, A] int64
    scale: np.ndarray,  # [2, L, T] float32
    k_levels: list[int],
    v_levels: list[int],
    out: torch.Tensor,  # [2, L, T, D] bf16/fp16/fp32, contiguous, any device
) -> None:
    """Write the dequantized chunk into ``out`` once every lane's symbols have the
    histogram ``counts`` holds for it.

    Raises:
        CodecError: some lane's symbols disagree with its histogram (``out`` untouched).
    """
    _, num_layers, num_tokens, hidden = out.shape
    planes = 2 * num_layers
    bf16 = out.dtype == torch.bfloat16
    direct = out.device.type == "cpu" and out.dtype in (torch.bfloat16, torch.float32)
    target = out if direct else torch.empty(out.shape, dtype=out.dtype if bf16 else torch.float32)
    values = target.view(torch.int16).numpy().view(np.uint16) if bf16 else target.numpy()
    if KERNELS["dequantize"](
        symbols.cpu().contiguous().numpy(),  # [lanes, T]
        counts,  # [lanes, A]
        scale.reshape(planes, num_tokens),  # [planes, T]
        _plane_levels(k_levels, v_levels),  # [planes]
        values.reshape(planes, num_tokens, hidden),  # [planes, T, D]
        bf16,
        work=symbols.numel(),
    ):
        raise CodecError("decoded symbols disagree with the stored histograms")
    if not direct:
        out.copy_(target)
