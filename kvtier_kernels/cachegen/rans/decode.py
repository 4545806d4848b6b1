"""rANS decode of CacheGen symbols, lane-parallel: the ``rans_decode`` op.

The inverse of :mod:`~kvtier_kernels.cachegen.rans.encode`: ``n`` symbols per lane are
decoded from ``(words, lengths)`` with the lane's row of ``freq``, and a lane that reads past
its words, leaves words unread or does not end in ``RANS_LOW`` is rejected with
:class:`~kvtier_kernels.cachegen.rans.common.CodecError` (the bitstream is in
:mod:`~kvtier_kernels.cachegen.rans.common`).

Bytes moved: the decoder reads each word once, ``log2(A)`` cumulative-table probes plus one
frequency per symbol, and writes ``lanes * n`` symbol bytes.

Backends (see :mod:`kvtier_kernels.registry`): ``torch`` runs the numpy reference
:func:`rans_decode` on CPU copies; ``triton`` runs ``rans_decode_kernel``
(:mod:`~kvtier_kernels.cachegen.rans.kernels`) compiled on CUDA/ROCm tensors;
``interpret`` runs it under Triton's interpreter on CPU tensors; ``numba`` runs
``rans_decode_numba_kernel`` compiled by numba on CPU copies.

Sections: numpy reference (the definition of correct) -> torch reference -> numba kernel
-> launchers (public, Triton, numba) -> registration.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch

from kvtier_kernels import registry
from kvtier_kernels._launch import NumbaKernel, numba_loader, triton_loader
from kvtier_kernels.cachegen.rans.common import (
    PROB_BITS,
    PROB_SCALE,
    RANS_LOW,
    CodecError,
    LaunchConfig,
    bad_table_rows,
    check_streams,
    checked_table,
    raise_bad_streams,
    raise_bad_table,
    raise_length_mismatch,
    raise_short_lanes,
)
from kvtier_kernels.cachegen.rans.kernels import DECODE_KERNEL
from kvtier_kernels.cachegen.rans.plans import cached_plan, decode_key, decode_plan, store_plan

__all__ = [
    "NUMBA_KERNEL",
    "rans_decode",
    "rans_decode_lanes",
    "rans_decode_numba",
    "rans_decode_numba_kernel",
    "rans_decode_reference",
    "rans_decode_triton",
]


# ---------------------------------------------------------------------------------------
# numpy reference
# ---------------------------------------------------------------------------------------


def rans_decode(
    words: np.ndarray, lengths: np.ndarray, freq: np.ndarray, n: int, tables_per_stream: int = 1
) -> np.ndarray:
    """Decode ``n`` symbols per lane from ``(words, lengths)`` as :func:`rans_encode`
    made them with ``freq`` ``[lanes * g, A]`` (``g = tables_per_stream``). Returns uint8
    ``[lanes, n]``.

    Raises:
        CodecError: a lane reads past its words, leaves words unread, or does not end
            in the initial state (the stream is not what ``freq`` encoded).
    """
    alphabet = freq.shape[1]
    lanes = len(freq) // tables_per_stream
    lengths = lengths.astype(np.int64)
    if len(lengths) * tables_per_stream != len(freq) or (lanes and lengths.min() < 2):
        raise CodecError("every lane needs at least its 2 state words")
    if int(lengths.sum()) != len(words):
        raise CodecError(f"lane lengths sum to {int(lengths.sum())}, stream has {len(words)}")
    words64 = np.append(words.astype(np.uint64), np.uint64(0))  # a safe target for misses
    start = np.zeros(lanes, dtype=np.int64)
    np.cumsum(lengths[:-1], out=start[1:])
    freq64 = freq.astype(np.uint64).reshape(-1)
    search = 1 << max(0, (alphabet - 1).bit_length())  # power of two >= alphabet
    cum_hi = np.full((len(freq), search), PROB_SCALE, dtype=np.uint64)  # cum of a + 1
    np.cumsum(freq.astype(np.uint64), axis=1, out=cum_hi[:, :alphabet])
    cum_hi[:, alphabet - 1 :] = PROB_SCALE
    cum_hi = cum_hi.reshape(-1)
    first_row = np.arange(lanes, dtype=np.int64) * tables_per_stream
    segment = max(1, n // tables_per_stream)
    state = words64[start] | (words64[start + 1] << np.uint64(16))
    read = np.full(lanes, 2, dtype=np.int64)
    bad = np.zeros(lanes, dtype=bool)
    out = np.empty((lanes, n), dtype=np.uint8)
    mask = np.uint64(PROB_SCALE - 1)
    for i in range(n):
        row_search = (first_row + i // segment) * search
        row = (first_row + i // segment) * alphabet
        slot = state & mask
        sym = np.zeros(lanes, dtype=np.int64)  # the number of a with cum_hi[a] <= slot
        step = search >> 1
        while step:
            probe = cum_hi[row_search + sym + step - 1]
            sym += np.where(probe <= slot, step, 0)
            step >>= 1
        out[:, i] = sym
        f = freq64[row + sym]
        c = cum_hi[row_search + sym] - f
        state = f * (state >> np.uint64(PROB_BITS)) + slot - c
        need = state < RANS_LOW
        have = read < lengths
        bad |= need & ~have
        word = words64[np.where(need & have, start + read, len(words))]
        state = np.where(need, (state << np.uint64(16)) | word, state)
        read += need
    bad |= (read != lengths) | (state != RANS_LOW)
    if bad.any():
        raise CodecError(
            f"rANS stream of lane {int(np.flatnonzero(bad)[0])} is inconsistent "
            f"({int(bad.sum())} of {lanes} lanes)"
        )
    return out


# ---------------------------------------------------------------------------------------
# torch reference: the numpy codec on CPU copies
# ---------------------------------------------------------------------------------------


def rans_decode_reference(
    words: torch.Tensor,  # [total_words] int32/int64, values 0..65535
    lengths: torch.Tensor,  # [lanes] int64/int32
    freq: torch.Tensor,  # [lanes * g, A] int32/int64
    n: int,
    tables_per_stream: int = 1,  # g
) -> torch.Tensor:
    """:func:`rans_decode` on CPU copies; returns uint8 ``[lanes,
    n]`` on ``words``' device. Shapes are assumed valid (:func:`rans_decode_lanes` checks
    them).

    Raises:
        ValueError: a freq row is negative or does not sum to ``PROB_SCALE``.
        CodecError: where the reference rejects the stream.
    """
    freq_cpu, lengths_cpu = freq.cpu(), lengths.cpu().to(torch.int64)
    bad_rows = bad_table_rows(freq_cpu)
    if bad_rows.any():
        raise_bad_table(bad_rows, freq_cpu)
    # the reference's own length checks, worded as the Triton backend words them
    if (lengths_cpu < 2).any():
        raise_short_lanes(lengths_cpu)
    if int(lengths_cpu.sum()) != len(words):
        raise_length_mismatch(int(lengths_cpu.sum()), len(words))
    symbols = rans_decode(
        words.cpu().numpy().astype(np.uint16),
        lengths_cpu.numpy(),
        freq_cpu.numpy().astype(np.uint32),
        n,
        tables_per_stream,
    )
    return torch.from_numpy(symbols).to(words.device)


# ---------------------------------------------------------------------------------------
# numba kernel (CPU)
#
# Lanes are decoded two at a time, interleaved symbol by symbol (a lane is a chain of
# dependent loads; two chains keep the core busier), in blocks of BLOCK lanes per `prange`
# iteration (tables allocated once per block), in int64 as the Triton kernel. The symbol of
# a slot is the number of entries of the lane's cum_hi (cum_hi[A - 1] forced to PROB_SCALE)
# that are <= slot, as the reference's binary search counts them; here a table of the
# symbol at every multiple of 2**shift (one entry per count of the n symbols) gives a lower
# bound and a forward scan, which rarely moves, finishes it. An odd last lane of a block
# is decoded twice, as both lanes of its pair.
#
# Renormalization reads words[at] unconditionally: `words` ends with n + 2 zeros, so a read
# past a lane's own words stays in bounds; such a lane ends with more reads than words and
# the final check rejects it, as the reference does (which reads 0 there too). Lengths are
# checked by the launcher first (each >= 2, summing to the stream's length).
# ---------------------------------------------------------------------------------------

prange: Any = range
BLOCK = 64  # lanes per prange iteration


def _lane_tables(freq, row, cum_hi, lane_freq, lut, k, shift):
    """Row k of cum_hi, lane_freq and lut for ``freq[row]``; lut[b]: the symbol of slot
    b << shift."""
    alphabet = freq.shape[1]
    low = 0
    for a in range(alphabet):
        lane_freq[k, a] = freq[row, a]
        high = PROB_SCALE if a == alphabet - 1 else low + freq[row, a]
        cum_hi[k, a] = high
        for bucket in range((low + (1 << shift) - 1) >> shift, ((high - 1) >> shift) + 1):
            lut[k, bucket] = a
        low = high


def rans_decode_numba_kernel(
    words,  # [num_words + n + 2] uint16: the stream, then n + 2 zeros
    starts,  # [lanes] int64: where each lane's stream starts in words
    lengths,  # [lanes] int64, each >= 2, summing to num_words
    freq,  # [lanes * G, A] int64, contiguous; rows non-negative, summing to PROB_SCALE
    out,  # [lanes, n] uint8 (out)
    bad,  # [lanes] uint8 (out): 1 = the reference rejects this lane's stream
    shift,  # log2 of the slots per table entry: 16 - shift bits of table
    tables_per_stream,  # G: lane l's symbol i is decoded with row l * G + i // segment
):
    lanes, n = out.shape
    alphabet = freq.shape[1]
    segment = max(1, n // tables_per_stream)
    for block in prange((lanes + BLOCK - 1) // BLOCK):
        cum_hi = np.empty((2, alphabet), np.int64)
        lane_freq = np.empty((2, alphabet), np.int64)
        lut = np.empty((2, 1 << (PROB_BITS - shift)), np.uint8)
        end = min(lanes, (block + 1) * BLOCK)
        for l0 in range(block * BLOCK, end, 2):
            l1 = min(l0 + 1, end - 1)
            at0, at1 = starts[l0] + 2, starts[l1] + 2
            x0 = np.int64(words[at0 - 2]) | (np.int64(words[at0 - 1]) << 16)
            x1 = np.int64(words[at1 - 2]) | (np.int64(words[at1 - 1]) << 16)
            for i in range(n):
                if i % segment == 0:
                    row = i // segment
                    _lane_tables(
                        freq, l0 * tables_per_stream + row, cum_hi, lane_freq, lut, 0, shift
                    )
                    _lane_tables(
                        freq, l1 * tables_per_stream + row, cum_hi, lane_freq, lut, 1, shift
                    )
                slot0, slot1 = x0 & (PROB_SCALE - 1), x1 & (PROB_SCALE - 1)
                s0, s1 = np.int64(lut[0, slot0 >> shift]), np.int64(lut[1, slot1 >> shift])
                while cum_hi[0, s0] <= slot0:
                    s0 += 1
                while cum_hi[1, s1] <= slot1:
                    s1 += 1
                out[l0, i], out[l1, i] = s0, s1
                f0, f1 = lane_freq[0, s0], lane_freq[1, s1]
                x0 = f0 * (x0 >> PROB_BITS) + slot0 - cum_hi[0, s0] + f0
                x1 = f1 * (x1 >> PROB_BITS) + slot1 - cum_hi[1, s1] + f1
                need0, need1 = np.int64(x0 < RANS_LOW), np.int64(x1 < RANS_LOW)
                word0, word1 = np.int64(words[at0]), np.int64(words[at1])
                x0 = (x0 << 16) | word0 if need0 else x0
                x1 = (x1 << 16) | word1 if need1 else x1
                at0, at1 = at0 + need0, at1 + need1
            bad[l0] = (at0 - starts[l0] != lengths[l0]) | (x0 != RANS_LOW)
            bad[l1] = (at1 - starts[l1] != lengths[l1]) | (x1 != RANS_LOW)


NUMBA_KERNEL = NumbaKernel(rans_decode_numba_kernel, helpers=[_lane_tables], op="rans_decode")
"""The decode kernel, compiled by numba on first use."""


# ---------------------------------------------------------------------------------------
# launchers
# ---------------------------------------------------------------------------------------


def rans_decode_lanes(
    words: torch.Tensor,  # [total_words] int32/int64, values 0..65535
    lengths: torch.Tensor,  # [lanes] int64/int32
    freq: torch.Tensor,  # [lanes * g, A] int32/int64
    n: int,
    backend: str = "auto",
    *,
    tables_per_stream: int = 1,
) -> torch.Tensor:
    """Decode ``n`` symbols per lane from ``(words, lengths)`` as :func:`rans_encode_lanes`
    made them with ``freq``; the inverse of it and bit-exact with
    :func:`rans_decode`.

    Args:
        words: int32/int64 ``[total_words]``, 16-bit words (higher bits are ignored, as the
            reference's uint16 drops them).
        lengths: int64/int32 ``[lanes]``, each lane's words.
        freq: int32/int64 ``[lanes * g, A]`` as for :func:`rans_encode_lanes`.
        n: symbols per lane, ``>= 0``.
        backend: ``"auto"``, ``"torch"``, ``"triton"``, ``"interpret"`` or ``"numba"``
            (see registry).
        tables_per_stream: ``g``, as for :func:`rans_encode_lanes`.

    Returns:
        uint8 ``[lanes, n]`` on ``words``' device.

    Raises:
        CodecError: exactly where the reference rejects the stream: ``lengths`` not one
            per lane, a lane with fewer than 2 words, lengths not summing to
            ``len(words)``, or a lane that reads past its words, leaves words unread or
            does not end in ``RANS_LOW`` (the message names the first bad lane).
        TypeError / ValueError: a wrong type, shape, dtype or device, or a freq row that is
            not a probability table (checked first).

    NOTE: on the Triton backends, what depends only on the arguments' shapes, strides,
    dtypes, devices and alignment, ``n`` and the backend (validation, launch config, grid,
    the bound kernel) is computed once and cached (:mod:`~kvtier_kernels.cachegen.rans.plans`;
    of ``words`` not its length, which changes from chunk to chunk); a call allocates its
    buffers, launches the decoder and reads its counts back once (the kernel builds the
    cumulative tables and checks them and the lengths).
    """
    try:
        key = decode_key(backend, words, lengths, freq, n, tables_per_stream)
        plan = cached_plan(key)
    except (AttributeError, TypeError):  # not tensors, or unhashable: validate
        key, plan = None, None
    if plan is None:
        check_streams(words, lengths, freq, n, tables_per_stream)
        impl = registry.get("rans_decode", backend, words.device)
        if not (isinstance(impl, functools.partial) and impl.func is rans_decode_triton):
            return impl(words, lengths, freq, n, tables_per_stream)  # a CPU coder: no plan
        interpret = impl.keywords["interpret"]
        plan = decode_plan(words, lengths, freq, n, tables_per_stream, interpret)
        if key is not None:
            store_plan(key, plan)
    return plan(words, lengths, freq)


# ---------------------------------------------------------------------------------------
# Triton launcher
# ---------------------------------------------------------------------------------------


def rans_decode_triton(
    words: torch.Tensor,  # [total_words] int32/int64
    lengths: torch.Tensor,  # [lanes] int64/int32
    freq: torch.Tensor,  # [lanes * g, A] int32/int64
    n: int,
    tables_per_stream: int = 1,  # g
    *,
    interpret: bool | None = None,
    config: LaunchConfig | None = None,
) -> torch.Tensor:
    """Triton version of :func:`rans_decode_reference`: one launch and one host sync (the
    counts of bad rows, short lanes and rejected streams and the lengths' excess), through
    the cached plan of these shapes (one per ``config``:
    :class:`~kvtier_kernels.cachegen.rans.plans.DecodePlan`).
    ``interpret``/``config`` as for :func:`rans_encode_triton`. Shapes are assumed valid
    (:func:`rans_decode_lanes` checks them).

    Raises:
        ValueError / CodecError: as :func:`rans_decode_reference`, or tensors this backend
            cannot reach, or an invalid ``config``.
    """
    interpret = words.device.type == "cpu" if interpret is None else interpret
    key = decode_key(("triton", interpret, config), words, lengths, freq, n, tables_per_stream)
    plan = cached_plan(key)
    if plan is None:
        plan = decode_plan(words, lengths, freq, n, tables_per_stream, interpret, config)
        store_plan(key, plan)
    return plan(words, lengths, freq)


# ---------------------------------------------------------------------------------------
# numba launcher
# ---------------------------------------------------------------------------------------


@NUMBA_KERNEL.falling_back_to(rans_decode_reference)
def rans_decode_numba(
    words: torch.Tensor,  # [total_words] int32/int64, values 0..65535
    lengths: torch.Tensor,  # [lanes] int64/int32
    freq: torch.Tensor,  # [lanes * g, A] int32/int64
    n: int,
    tables_per_stream: int = 1,  # g
) -> torch.Tensor:
    """numba version of :func:`rans_decode_reference` on CPU copies: the same symbols and
    errors, in the same order. Shapes are assumed valid (:func:`rans_decode_lanes`). Where
    numba fails to import or to compile the kernel, the reference runs (logged once)."""
    # validate: tables, then lengths, as the reference; the streams in the kernel
    table = checked_table(freq)
    lengths_np = lengths.cpu().numpy().astype(np.int64)
    if (lengths_np < 2).any():
        raise_short_lanes(torch.from_numpy(lengths_np))
    ends = lengths_np.cumsum()
    total = int(ends[-1]) if len(ends) else 0
    if total != len(words):
        raise_length_mismatch(total, len(words))

    # allocate
    lanes = len(lengths_np)
    segment = max(1, n // tables_per_stream)
    out = np.empty((lanes, n), dtype=np.uint8)
    bad = np.zeros(lanes, dtype=np.uint8)
    padded = np.zeros(total + n + 2, dtype=np.uint16)  # the words, then n + 2 zeros
    padded[:total] = words.cpu().numpy()  # as the reference's uint16: the low 16 bits

    # launch
    NUMBA_KERNEL(
        padded,  # [num_words + n + 2]
        ends - lengths_np,  # starts [lanes]
        lengths_np,  # [lanes]
        table,  # [lanes * g, A]
        out,  # [lanes, n]
        bad,  # [lanes]
        PROB_BITS - min(8, max(1, (segment - 1).bit_length())),  # shift: an entry per count
        tables_per_stream,
        work=lanes * n,
    )
    if bad.any():
        raise_bad_streams(torch.from_numpy(bad != 0))
    return torch.from_numpy(out).to(words.device)


# ---------------------------------------------------------------------------------------
# registration
# ---------------------------------------------------------------------------------------

registry.register("rans_decode", "torch", rans_decode_reference)
registry.register(
    "rans_decode", "triton", loader=triton_loader(DECODE_KERNEL, rans_decode_triton, False)
)
registry.register(
    "rans_decode", "interpret", loader=triton_loader(DECODE_KERNEL, rans_decode_triton, True)
)
registry.register("rans_decode", "numba", loader=numba_loader([NUMBA_KERNEL], rans_decode_numba))
