"""The rANS coder's Triton kernels: the encoder, the compaction of its lanes' streams into
one, and the decoder.

A call's work runs in them, all but its one read-back. Each kernel builds the cumulative
tables it codes with from the call's ``freq`` (in a workspace: the head of each lane's
scratch row, or ``cum_hi``) and checks every row of ``freq`` (non-negative, summing to
``PROB_SCALE``), the decoder also the lengths; it leaves what the host must know in
``summary`` (int64, zeroed by the caller): first the counts that say whether to raise
(``ENCODE_COUNTS`` / ``DECODE_COUNTS`` of them, read back in one sync by
:mod:`~kvtier_kernels.cachegen.rans.plans`), then per-lane entries that the compaction and
the rare error path read. The bitstream is :mod:`~kvtier_kernels.cachegen.rans.common`'s.

Bytes moved, besides what :mod:`~kvtier_kernels.cachegen.rans.encode` and
:mod:`~kvtier_kernels.cachegen.rans.decode` count for the coding itself: each row of
``freq`` read once more and its cumulative table written (int32, ``A`` entries a row for
the encoder, ``SEARCH`` for the decoder); 16 (encoder) or 8 (decoder) bytes of summary a
lane; the decoder's sums of the lengths before each program (``lanes**2 / (2 * BLOCK)``
loads in all, from the cache).
"""

from __future__ import annotations

from typing import Any

from kvtier_kernels._launch import LazyKernel

__all__ = [
    "COMPACT_KERNEL",
    "DECODE_COUNTS",
    "DECODE_KERNEL",
    "ENCODE_COUNTS",
    "ENCODE_KERNEL",
    "rans_compact_kernel",
    "rans_decode_kernel",
    "rans_encode_kernel",
]

ENCODE_COUNTS = 3
"""The encoder's summary starts with: the words of all lanes, the rows of freq that are no
table, the lanes that used a symbol without frequency."""
DECODE_COUNTS = 4
"""The decoder's summary starts with: the rows of freq that are no table, the lanes with
fewer than 2 words, ``sum(lengths) - len(words)``, the lanes whose stream is rejected."""

# ---------------------------------------------------------------------------------------
# encode
#
# Grid: (cdiv(lanes, BLOCK),). Program p codes lanes p * BLOCK : +BLOCK, one lane per
# vector element. Lane l's row of `scratch` is its workspace: first the cumulative tables
# of its G rows of freq (freq[0] + ... + freq[a - 1], built and checked first), then its
# stream, written downward from the row's end while the lane loops over its symbols from
# the last to the first. State arithmetic is int64 (``f << 16`` reaches 2**32 and
# ``state // f`` must be exact); every value stays below 2**32, so int64 gives the
# reference's uint64 results bit for bit. A renormalization word is stored only when one
# is emitted; the stream ends with the final state's low and high words. The summary:
#
#     [0] words of all lanes   [1] rows that are no table   [2] lanes flagged below
#     [3 : 3 + lanes]                  each lane's length
#     [3 + lanes : 3 + 2 * lanes]      1 where the lane used a symbol outside its row or
#                                      with frequency 0 (the division then runs on 1)
#     [3 + 2 * lanes : + programs]     each program's words (the compaction's offsets)
#
# The compaction (grid and BLOCK as the encoder's) copies each lane's stream to where the
# lanes before it end: the words of the programs before it (summed PROGRAMS at a time),
# then a cumsum over its own lanes; it copies WORDS words of each of its lanes at a time.
#
# NOTE: `tl` is bound to `triton.language` by `LazyKernel.get()` on first use, so that
# importing this module never imports triton. Masks combine vector conditions only
# (Triton 3.9's interpreter rejects `block_mask & scalar`).
# ---------------------------------------------------------------------------------------

tl: Any = None


def rans_encode_kernel(
    symbols,  # [lanes, n] uint8
    freq,  # [lanes * G, A] int32/int64
    scratch,  # [lanes, G * A + n + 2] int32, contiguous: cumulative tables, then the stream
    summary,  # [3 + 2 * lanes + programs] int64, zeroed (out): see above
    s_sym_lane,  # symbols strides, in elements
    s_sym_pos,
    s_freq_lane,  # freq strides, in elements
    s_freq_sym,
    num_lanes,
    n,
    alphabet,
    tables_per_stream,  # G: lane l's symbol i is coded with row l * G + i // segment
    segment,
    PROB_BITS: tl.constexpr,
    RANS_LOW: tl.constexpr,
    BLOCK: tl.constexpr,
):
    lanes = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_lane = lanes < num_lanes
    lane64 = lanes.to(tl.int64)
    width = tables_per_stream * alphabet + n + 2
    region = lane64 * width
    bad_rows = tl.full([BLOCK], 0, tl.int64)
    for g in range(tables_per_stream):
        at = (lane64 * tables_per_stream + g) * s_freq_lane
        total = tl.full([BLOCK], 0, tl.int64)
        negative = tl.full([BLOCK], 0, tl.int32)
        for a in range(alphabet):
            tl.store(scratch + region + g * alphabet + a, total.to(tl.int32), mask=in_lane)
            f = tl.load(freq + at, mask=in_lane, other=0).to(tl.int64)
            at += s_freq_sym
            total += f
            negative = negative | (f < 0).to(tl.int32)
        bad = in_lane & ((negative != 0) | (total != (1 << PROB_BITS)))
        bad_rows += bad.to(tl.int64)
    tl.debug_barrier()  # the tables are read back below (each lane reads its own)

    state = tl.full([BLOCK], RANS_LOW, tl.int64)
    pos = tl.full([BLOCK], 0, tl.int64) + width
    flags = tl.full([BLOCK], 0, tl.int32)
    sym_at = lane64 * s_sym_lane + (lane64 * 0 + n - 1) * s_sym_pos  # int64: the last symbol
    for step in range(n):
        sym = tl.load(symbols + sym_at, mask=in_lane, other=0).to(tl.int64)
        sym_at -= s_sym_pos
        known = in_lane & (sym < alphabet)
        run = (n - 1 - step) // segment  # coded with the lane's row `run` of freq
        row = lane64 * tables_per_stream + run
        f = tl.load(freq + row * s_freq_lane + sym * s_freq_sym, mask=known, other=0)
        f = f.to(tl.int64)
        c = tl.load(scratch + region + run * alphabet + sym, mask=known, other=0).to(tl.int64)
        flags = flags | (f <= 0).to(tl.int32)
        f = tl.maximum(f, 1)
        emit = state >= (f << 16)
        tl.store(scratch + region + pos - 1, (state & 0xFFFF).to(tl.int32), mask=in_lane & emit)
        pos = pos - emit.to(tl.int64)
        state = tl.where(emit, state >> 16, state)
        state = ((state // f) << PROB_BITS) + state % f + c
    tl.store(scratch + region + pos - 2, (state & 0xFFFF).to(tl.int32), mask=in_lane)
    tl.store(scratch + region + pos - 1, (state >> 16).to(tl.int32), mask=in_lane)

    length = tl.where(in_lane, width - pos + 2, 0)
    flags = tl.where(in_lane, flags, 0).to(tl.int64)
    tl.store(summary + 3 + lane64, length, mask=in_lane)
    tl.store(summary + 3 + num_lanes + lane64, flags, mask=in_lane)
    words = tl.sum(length, 0)
    tl.store(summary + 3 + 2 * num_lanes + tl.program_id(0), words)
    tl.atomic_add(summary + 0, words)
    tl.atomic_add(summary + 1, tl.sum(bad_rows, 0))
    tl.atomic_add(summary + 2, tl.sum(flags, 0))


def rans_compact_kernel(
    scratch,  # [lanes, width] int32, contiguous: each lane's stream at the end of its row
    summary,  # the encoder's summary: lengths at 3, each program's words at 3 + 2 * lanes
    words,  # [sum(lengths)] int32 (out): the lanes' streams concatenated
    width,
    num_lanes,
    BLOCK: tl.constexpr,
    WORDS: tl.constexpr,
    PROGRAMS: tl.constexpr,  # earlier programs' words summed at a time
):
    program = tl.program_id(0)
    before = tl.full([PROGRAMS], 0, tl.int64)
    for earliest in range(0, program, PROGRAMS):
        earlier = earliest + tl.arange(0, PROGRAMS)
        words_at = summary + 3 + 2 * num_lanes + earlier
        before += tl.load(words_at, mask=earlier < program, other=0)
    lanes = program * BLOCK + tl.arange(0, BLOCK)
    in_lane = lanes < num_lanes
    lane64 = lanes.to(tl.int64)
    length = tl.load(summary + 3 + lane64, mask=in_lane, other=0)
    start = tl.sum(before, 0) + tl.cumsum(length, 0) - length
    source = lane64 * width + width - length
    for copied in range(0, tl.max(length, 0), WORDS):
        k = copied + tl.arange(0, WORDS)
        keep = in_lane[:, None] & (k[None, :] < length[:, None])
        word = tl.load(scratch + source[:, None] + k[None, :], mask=keep, other=0)
        tl.store(words + start[:, None] + k[None, :], word, mask=keep)


ENCODE_KERNEL = LazyKernel(rans_encode_kernel)
"""The encode kernel, decorated (compiled or interpreted) on first use."""
COMPACT_KERNEL = LazyKernel(rans_compact_kernel)
"""The compaction of the lanes' streams, decorated on first use."""


# ---------------------------------------------------------------------------------------
# decode
#
# Grid: (cdiv(lanes, BLOCK),). Program p decodes lanes p * BLOCK : +BLOCK, one lane per
# vector element, looping forward over the lane's symbols. State arithmetic is int64;
# every value stays below 2**32, so int64 gives the reference's uint64 results bit for bit.
# First, where each lane's stream starts (the lengths of every lane before the program's,
# PREFIX at a time, then a cumsum over its own), and each lane's rows of `cum_hi`, built
# from its rows of freq, which are checked.
#
# Symbol lookup is a branch-free binary search over the lane's row of `cum_hi`
# (cum_hi[a] = freq[0] + ... + freq[a], padded with PROB_SCALE to SEARCH = 2**LOG2_SEARCH
# entries, the last real entry forced to PROB_SCALE as in the reference): sym ends as the
# number of entries <= slot, found in LOG2_SEARCH probes. A probe at an index >= A - 1
# reads PROB_SCALE > slot and is never taken, so sym <= A - 1 whatever the table holds.
# (A slot -> symbol table would save the probes but take 64 KiB per lane: 16 GiB for the
# 262144 lanes of a 32-layer, 4096-wide chunk; cum_hi takes at most 1 KiB per lane.)
# A lane is flagged exactly where the reference rejects it: a read past the lane's words,
# unread words, a final state other than RANS_LOW. Reads are kept inside `words` whatever
# the lengths, which the host checks after the launch. The summary:
#
#     [0] rows that are no table   [1] lanes with fewer than 2 words
#     [2] sum(lengths) - num_words   [3] lanes flagged
#     [4 : 4 + lanes]  1 where the lane is flagged
# ---------------------------------------------------------------------------------------


def rans_decode_kernel(
    words,  # [num_words] int32/int64 16-bit words
    lengths,  # [lanes] int32/int64
    freq,  # [lanes * G, A] int32/int64
    cum_hi,  # [lanes * G, SEARCH] int32, contiguous (built here): freq[0] + ... + freq[a]
    out,  # [lanes, n] uint8 (out)
    summary,  # [4 + lanes] int64, zeroed (out): see above
    s_word,  # words stride, in elements
    s_length,  # lengths stride, in elements
    s_freq_lane,  # freq strides, in elements
    s_freq_sym,
    s_out_lane,  # out strides, in elements
    s_out_pos,
    num_lanes,
    n,
    alphabet,
    num_words,
    tables_per_stream,  # G: lane l's symbol i is decoded with row l * G + i // segment
    segment,
    PROB_BITS: tl.constexpr,
    RANS_LOW: tl.constexpr,
    LOG2_SEARCH: tl.constexpr,
    BLOCK: tl.constexpr,
    PREFIX: tl.constexpr,
):
    first = tl.program_id(0) * BLOCK
    lanes = first + tl.arange(0, BLOCK)
    in_lane = lanes < num_lanes
    lane64 = lanes.to(tl.int64)
    before = tl.full([PREFIX], 0, tl.int64)
    for earliest in range(0, first, PREFIX):
        earlier = earliest + tl.arange(0, PREFIX)
        length_at = lengths + earlier.to(tl.int64) * s_length
        before += tl.load(length_at, mask=earlier < first, other=0).to(tl.int64)
    length = tl.load(lengths + lane64 * s_length, mask=in_lane, other=0).to(tl.int64)
    start = tl.sum(before, 0) + tl.cumsum(length, 0) - length
    bad_rows = tl.full([BLOCK], 0, tl.int64)
    for g in range(tables_per_stream):
        row = lane64 * tables_per_stream + g
        at = row * s_freq_lane
        table = row * (1 << LOG2_SEARCH)
        total = tl.full([BLOCK], 0, tl.int64)
        negative = tl.full([BLOCK], 0, tl.int32)
        for a in range(alphabet):
            f = tl.load(freq + at, mask=in_lane, other=0).to(tl.int64)
            at += s_freq_sym
            total += f
            negative = negative | (f < 0).to(tl.int32)
            cum = tl.where(a < alphabet - 1, total, 1 << PROB_BITS)  # the last one forced
            tl.store(cum_hi + table + a, cum.to(tl.int32), mask=in_lane)
        for a in range(alphabet, 1 << LOG2_SEARCH):
            tl.store(cum_hi + table + a, tl.full([BLOCK], 1 << PROB_BITS, tl.int32), mask=in_lane)
        bad = in_lane & ((negative != 0) | (total != (1 << PROB_BITS)))
        bad_rows += bad.to(tl.int64)
    tl.debug_barrier()  # the tables are read back below (each lane reads its own)

    head = in_lane & (start >= 0) & (start + 1 < num_words)
    low = tl.load(words + start * s_word, mask=head, other=0).to(tl.int64) & 0xFFFF
    high = tl.load(words + (start + 1) * s_word, mask=head, other=0).to(tl.int64) & 0xFFFF
    state = low | (high << 16)
    read = tl.full([BLOCK], 2, tl.int64)
    flags = tl.full([BLOCK], 0, tl.int32)
    out_at = lane64 * s_out_lane
    for i in range(n):
        row = lane64 * tables_per_stream + i // segment
        table = row * (1 << LOG2_SEARCH)
        slot = state & ((1 << PROB_BITS) - 1)
        sym = tl.full([BLOCK], 0, tl.int64)
        for k in tl.static_range(LOG2_SEARCH):
            step = 1 << (LOG2_SEARCH - 1 - k)
            probe = tl.load(cum_hi + table + sym + (step - 1), mask=in_lane, other=0)
            sym = sym + tl.where(probe.to(tl.int64) <= slot, step, 0)
        tl.store(out + out_at, sym.to(tl.uint8), mask=in_lane)
        out_at += s_out_pos
        f = tl.load(freq + row * s_freq_lane + sym * s_freq_sym, mask=in_lane, other=0)
        f = f.to(tl.int64)
        c = tl.load(cum_hi + table + sym, mask=in_lane, other=0).to(tl.int64) - f
        state = f * (state >> PROB_BITS) + slot - c
        need = state < RANS_LOW
        flags = flags | (need & (read >= length)).to(tl.int32)
        at = start + read
        take = need & (read < length) & (at >= 0) & (at < num_words)
        word = tl.load(words + at * s_word, mask=take, other=0).to(tl.int64) & 0xFFFF
        state = tl.where(need, (state << 16) | word, state)
        read = read + need.to(tl.int64)
    flags = flags | ((read != length) | (state != RANS_LOW)).to(tl.int32)
    flags = tl.where(in_lane, flags, 0).to(tl.int64)
    tl.store(summary + 4 + lane64, flags, mask=in_lane)
    tl.atomic_add(summary + 0, tl.sum(bad_rows, 0))
    tl.atomic_add(summary + 1, tl.sum((in_lane & (length < 2)).to(tl.int64), 0))
    tl.atomic_add(summary + 2, tl.sum(length, 0) - tl.where(first == 0, num_words, 0))
    tl.atomic_add(summary + 3, tl.sum(flags, 0))


DECODE_KERNEL = LazyKernel(rans_decode_kernel)
"""The decode kernel, decorated (compiled or interpreted) on first use."""
