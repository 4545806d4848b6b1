"""Lane-parallel rANS encode / decode of CacheGen symbols on the device, bit-exact with
:func:`kvtier_kernels.cachegen.rans_encode` / :func:`~kvtier_kernels.cachegen.rans_decode`.

The bitstream is the reference's (see :mod:`kvtier_kernels.cachegen`): each lane is an
independent rANS stream, 32-bit state in ``[2**16, 2**32)``, 16-bit renormalization,
``PROB_BITS = 16``; a lane's stream is its final state (low word, high word) then its
renormalization words in the order the decoder reads them::

    symbols   [lanes, n]      uint8; lane l coded with freq[l]
    freq      [lanes, A]      int32/int64, rows sum to PROB_SCALE, A <= 255
    words     [sum(lengths)]  int32 holding 16-bit words: the lanes' streams concatenated
    lengths   [lanes]         int64, 2 <= lengths[l] <= n + 2

Bytes moved: the encoder reads the symbols once (``lanes * n``), one frequency and one
cumulative frequency per symbol (cache-resident tables), writes at most ``n + 2`` int32
words per lane into a scratch buffer and compacts them (read + write of the kept words);
the decoder reads each word once, ``log2(A)`` cumulative-table probes plus one frequency
per symbol, and writes ``lanes * n`` symbol bytes.

Backends (see :mod:`kvtier_kernels.registry`): ``torch`` runs the numpy reference on CPU
copies; ``triton`` runs ``_encode_kernel`` / ``_decode_kernel`` compiled on CUDA/ROCm
tensors; ``interpret`` runs them under Triton's interpreter on CPU tensors. Integer-only
math (int64 state), so every backend gives the same bits by construction.

Sections: torch reference (wrappers of the numpy codec) -> Triton kernels -> launchers
(public, then Triton) -> registration.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, NoReturn

import numpy as np
import torch

from kvtier_kernels import registry
from kvtier_kernels._launch import LazyKernel, check_launch_config, next_power_of_2, triton_loader
from kvtier_kernels.cachegen import (
    PROB_BITS,
    PROB_SCALE,
    RANS_LOW,
    CodecError,
    rans_decode,
    rans_encode,
)

__all__ = [
    "LaunchConfig",
    "launch_config",
    "rans_decode_lanes",
    "rans_decode_reference",
    "rans_decode_triton",
    "rans_encode_lanes",
    "rans_encode_reference",
    "rans_encode_triton",
]

MAX_ALPHABET = 255
_FREQ_DTYPES = (torch.int32, torch.int64)


# ---------------------------------------------------------------------------------------
# data checks shared by every backend (the numpy codec assumes valid tables)
# ---------------------------------------------------------------------------------------


def _first(flags: torch.Tensor) -> int:
    return int(flags.nonzero()[0, 0])


def _bad_rows(freq: torch.Tensor) -> torch.Tensor:
    """bool ``[lanes]``: rows of ``freq`` that are not a probability table (on its device)."""
    return (freq.sum(1, dtype=torch.int64) != PROB_SCALE) | (freq < 0).any(1)


def _raise_bad_table(bad_rows: torch.Tensor, freq: torch.Tensor) -> NoReturn:
    lane = _first(bad_rows)
    raise ValueError(
        f"freq row of lane {lane} must be non-negative and sum to PROB_SCALE={PROB_SCALE}; "
        f"it sums to {int(freq[lane].sum(dtype=torch.int64))} "
        f"({int(bad_rows.sum())} of {len(freq)} rows are bad)"
    )


def _raise_unusable_symbols(bad_lanes: torch.Tensor) -> NoReturn:
    raise ValueError(
        f"lane {_first(bad_lanes)} uses a symbol outside its freq row or with frequency 0 "
        f"({int(bad_lanes.sum())} of {len(bad_lanes)} lanes); every symbol used needs a "
        "positive frequency"
    )


def _raise_short_lanes(lengths: torch.Tensor) -> NoReturn:
    lane = _first(lengths < 2)
    raise CodecError(
        f"every lane needs at least its 2 state words; lane {lane} has {int(lengths[lane])}"
    )


def _raise_length_mismatch(total: int, num_words: int) -> NoReturn:
    raise CodecError(f"lane lengths sum to {total}, stream has {num_words}")


def _raise_bad_streams(bad_lanes: torch.Tensor) -> NoReturn:
    raise CodecError(
        f"rANS stream of lane {_first(bad_lanes)} is inconsistent "
        f"({int(bad_lanes.sum())} of {len(bad_lanes)} lanes)"
    )


# ---------------------------------------------------------------------------------------
# torch reference: the numpy codec on CPU copies
# ---------------------------------------------------------------------------------------


def rans_encode_reference(
    symbols: torch.Tensor,  # [lanes, n] uint8
    freq: torch.Tensor,  # [lanes, A] int32/int64
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`~kvtier_kernels.cachegen.rans_encode` on CPU copies; returns ``(words,
    lengths)`` (int32, int64) on ``symbols``' device. Shapes are assumed valid
    (:func:`rans_encode_lanes` checks them).

    Raises:
        ValueError: a freq row is negative or does not sum to ``PROB_SCALE``, or a lane
            uses a symbol outside its row or with frequency 0.
    """
    freq_cpu = freq.cpu()
    bad_rows = _bad_rows(freq_cpu)
    if bad_rows.any():
        _raise_bad_table(bad_rows, freq_cpu)
    sym = symbols.cpu().numpy()
    table = freq_cpu.numpy().astype(np.uint32)
    lanes, alphabet = table.shape
    usable = np.zeros((lanes, MAX_ALPHABET + 1), dtype=bool)  # a uint8 symbol indexes it
    usable[:, :alphabet] = table > 0
    bad_lanes = ~usable[np.arange(lanes)[:, None], sym].all(1)
    if bad_lanes.any():
        _raise_unusable_symbols(torch.from_numpy(bad_lanes))
    words, lengths = rans_encode(sym, table)
    device = symbols.device
    return (
        torch.from_numpy(words.astype(np.int32)).to(device),
        torch.from_numpy(lengths.astype(np.int64)).to(device),
    )


def rans_decode_reference(
    words: torch.Tensor,  # [total_words] int32/int64, values 0..65535
    lengths: torch.Tensor,  # [lanes] int64/int32
    freq: torch.Tensor,  # [lanes, A] int32/int64
    n: int,
) -> torch.Tensor:
    """:func:`~kvtier_kernels.cachegen.rans_decode` on CPU copies; returns uint8 ``[lanes,
    n]`` on ``words``' device. Shapes are assumed valid (:func:`rans_decode_lanes` checks
    them).

    Raises:
        ValueError: a freq row is negative or does not sum to ``PROB_SCALE``.
        CodecError: where the reference rejects the stream.
    """
    freq_cpu, lengths_cpu = freq.cpu(), lengths.cpu().to(torch.int64)
    bad_rows = _bad_rows(freq_cpu)
    if bad_rows.any():
        _raise_bad_table(bad_rows, freq_cpu)
    # the reference's own length checks, worded as the Triton backend words them
    if (lengths_cpu < 2).any():
        _raise_short_lanes(lengths_cpu)
    if int(lengths_cpu.sum()) != len(words):
        _raise_length_mismatch(int(lengths_cpu.sum()), len(words))
    symbols = rans_decode(
        words.cpu().numpy().astype(np.uint16),
        lengths_cpu.numpy(),
        freq_cpu.numpy().astype(np.uint32),
        n,
    )
    return torch.from_numpy(symbols).to(words.device)


# ---------------------------------------------------------------------------------------
# Triton kernels
#
# Grid: (cdiv(lanes, BLOCK),). Program p codes lanes p * BLOCK : +BLOCK, one lane per
# vector element, looping over the lane's symbols: the encoder from the last symbol to the
# first, the decoder forward. State arithmetic is int64 (``f << 16`` reaches 2**32 and
# ``state // f`` must be exact); every value stays below 2**32, so int64 gives the
# reference's uint64 results bit for bit.
#
# Encoder: lane l writes its stream downward into scratch[l, pos : n + 2] (pos starts at
# n + 2; a renormalization word is stored only when one is emitted) and ends with its final
# state's low and high words; its length is n + 2 - pos. The launcher compacts the lanes'
# regions into one stream. `bad` flags a lane that used a symbol outside its row or with
# frequency 0 (the division then runs on 1, to stay defined).
#
# Decoder: symbol lookup is a branch-free binary search over the lane's row of `cum_hi`
# (cum_hi[a] = freq[0] + ... + freq[a], padded with PROB_SCALE to SEARCH = 2**LOG2_SEARCH
# entries, the last real entry forced to PROB_SCALE as in the reference): sym ends as the
# number of entries <= slot, found in LOG2_SEARCH probes. A probe at an index >= A - 1
# reads PROB_SCALE > slot and is never taken, so sym <= A - 1 whatever the table holds.
# (A slot -> symbol table would save the probes but take 64 KiB per lane: 16 GiB for the
# 262144 lanes of a 32-layer, 4096-wide chunk; cum_hi takes at most 1 KiB per lane.)
# `bad` flags exactly the reference's rejections: a read past the lane's words, unread
# words, a final state other than RANS_LOW. Lengths are checked after the launch (one host
# sync), so reads are also kept inside `words` for inconsistent lengths.
#
# NOTE: `tl` is bound to `triton.language` by `LazyKernel.get()` on first use, so that
# importing this module never imports triton. Masks combine vector conditions only
# (Triton 3.9's interpreter rejects `block_mask & scalar`).
# ---------------------------------------------------------------------------------------

tl: Any = None


def _encode_kernel(
    symbols,  # [lanes, n] uint8
    freq,  # [lanes, A] int32/int64
    cum_lo,  # [lanes, A] int32, contiguous: freq[0] + ... + freq[a - 1]
    scratch,  # [lanes, n + 2] int32, contiguous: each lane's stream at its end
    lengths,  # [lanes] int64 (out)
    bad,  # [lanes] int8 (out): 1 = a symbol outside the row or with frequency 0
    s_sym_lane,  # symbols strides, in elements
    s_sym_pos,
    s_freq_lane,  # freq strides, in elements
    s_freq_sym,
    num_lanes,
    n,
    alphabet,
    PROB_BITS: tl.constexpr,
    RANS_LOW: tl.constexpr,
    BLOCK: tl.constexpr,
):
    lanes = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_lane = lanes < num_lanes
    lane64 = lanes.to(tl.int64)
    width = n + 2
    region = lane64 * width
    state = tl.full([BLOCK], RANS_LOW, tl.int64)
    pos = tl.full([BLOCK], 0, tl.int64) + width
    flags = tl.full([BLOCK], 0, tl.int32)
    sym_at = lane64 * s_sym_lane + (lane64 * 0 + n - 1) * s_sym_pos  # int64: the last symbol
    for _ in range(n):
        sym = tl.load(symbols + sym_at, mask=in_lane, other=0).to(tl.int64)
        sym_at -= s_sym_pos
        known = in_lane & (sym < alphabet)
        f = tl.load(freq + lane64 * s_freq_lane + sym * s_freq_sym, mask=known, other=0)
        f = f.to(tl.int64)
        c = tl.load(cum_lo + lane64 * alphabet + sym, mask=known, other=0).to(tl.int64)
        flags = flags | (f <= 0).to(tl.int32)
        f = tl.maximum(f, 1)
        emit = state >= (f << 16)
        tl.store(scratch + region + pos - 1, (state & 0xFFFF).to(tl.int32), mask=in_lane & emit)
        pos = pos - emit.to(tl.int64)
        state = tl.where(emit, state >> 16, state)
        state = ((state // f) << PROB_BITS) + state % f + c
    tl.store(scratch + region + pos - 2, (state & 0xFFFF).to(tl.int32), mask=in_lane)
    tl.store(scratch + region + pos - 1, (state >> 16).to(tl.int32), mask=in_lane)
    tl.store(lengths + lane64, width - pos + 2, mask=in_lane)
    tl.store(bad + lane64, flags.to(tl.int8), mask=in_lane)


def _decode_kernel(
    words,  # [num_words] int32/int64 16-bit words
    starts,  # [lanes] int64: where each lane's stream starts in words
    lengths,  # [lanes] int64
    freq,  # [lanes, A] int32/int64
    cum_hi,  # [lanes, SEARCH] int32, contiguous: freq[0] + ... + freq[a], padded
    out,  # [lanes, n] uint8 (out)
    bad,  # [lanes] int8 (out): 1 = the reference rejects this lane's stream
    s_word,  # words stride, in elements
    s_freq_lane,  # freq strides, in elements
    s_freq_sym,
    s_out_lane,  # out strides, in elements
    s_out_pos,
    num_lanes,
    n,
    num_words,
    PROB_BITS: tl.constexpr,
    RANS_LOW: tl.constexpr,
    LOG2_SEARCH: tl.constexpr,
    BLOCK: tl.constexpr,
):
    lanes = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_lane = lanes < num_lanes
    lane64 = lanes.to(tl.int64)
    table = lane64 * (1 << LOG2_SEARCH)
    start = tl.load(starts + lane64, mask=in_lane, other=0)
    length = tl.load(lengths + lane64, mask=in_lane, other=2)
    head = in_lane & (start >= 0) & (start + 1 < num_words)
    low = tl.load(words + start * s_word, mask=head, other=0).to(tl.int64) & 0xFFFF
    high = tl.load(words + (start + 1) * s_word, mask=head, other=0).to(tl.int64) & 0xFFFF
    state = low | (high << 16)
    read = tl.full([BLOCK], 2, tl.int64)
    flags = tl.full([BLOCK], 0, tl.int32)
    out_at = lane64 * s_out_lane
    for _ in range(n):
        slot = state & ((1 << PROB_BITS) - 1)
        sym = tl.full([BLOCK], 0, tl.int64)
        for k in tl.static_range(LOG2_SEARCH):
            step = 1 << (LOG2_SEARCH - 1 - k)
            probe = tl.load(cum_hi + table + sym + (step - 1), mask=in_lane, other=0)
            sym = sym + tl.where(probe.to(tl.int64) <= slot, step, 0)
        tl.store(out + out_at, sym.to(tl.uint8), mask=in_lane)
        out_at += s_out_pos
        f = tl.load(freq + lane64 * s_freq_lane + sym * s_freq_sym, mask=in_lane, other=0)
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
    tl.store(bad + lane64, flags.to(tl.int8), mask=in_lane)


# ---------------------------------------------------------------------------------------
# launchers
# ---------------------------------------------------------------------------------------


def _check_freq(freq: Any, lanes: int | None) -> None:
    """Check the type, dtype and shape of ``freq`` (``lanes`` rows unless None)."""
    if not isinstance(freq, torch.Tensor):
        raise TypeError(f"freq must be a torch.Tensor, got {type(freq).__name__}")
    if freq.dim() != 2 or freq.dtype not in _FREQ_DTYPES:
        raise ValueError(
            f"freq must be a 2-D int32 or int64 tensor [lanes, A]; "
            f"got shape {tuple(freq.shape)} dtype {freq.dtype}"
        )
    if (lanes is not None and freq.shape[0] != lanes) or not 1 <= freq.shape[1] <= MAX_ALPHABET:
        raise ValueError(
            f"freq must have shape [lanes={lanes}, A] with 1 <= A <= {MAX_ALPHABET}; "
            f"got {tuple(freq.shape)}"
        )


def _check_same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"tensors must be on one device; got {devices}")


def rans_encode_lanes(
    symbols: torch.Tensor,  # [lanes, n] uint8
    freq: torch.Tensor,  # [lanes, A] int32/int64
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """rANS-encode each lane (row) of ``symbols`` with its row of ``freq``.

    Args:
        symbols: uint8 ``[lanes, n]``.
        freq: int32/int64 ``[lanes, A]``, ``1 <= A <= 255``, rows non-negative and summing
            to ``PROB_SCALE``; every symbol a lane uses must have a positive frequency.
        backend: ``"auto"``, ``"torch"``, ``"triton"`` or ``"interpret"`` (see registry).

    Returns:
        ``(words, lengths)`` on ``symbols``' device, equal to
        :func:`~kvtier_kernels.cachegen.rans_encode`'s: int32 ``[sum(lengths)]`` holding
        the 16-bit words of the lanes' streams concatenated, and int64 ``[lanes]``.

    Raises:
        TypeError / ValueError: a wrong type, shape, dtype or device (the message names the
            tensor and the expected shape), a freq row that is not a probability table, or
            a lane using a symbol without frequency (names the first such lane).
    """
    if not isinstance(symbols, torch.Tensor):
        raise TypeError(f"symbols must be a torch.Tensor, got {type(symbols).__name__}")
    if symbols.dim() != 2 or symbols.dtype != torch.uint8:
        raise ValueError(
            f"symbols must be a 2-D uint8 tensor [lanes, n]; "
            f"got shape {tuple(symbols.shape)} dtype {symbols.dtype}"
        )
    _check_freq(freq, symbols.shape[0])
    _check_same_device(symbols=symbols, freq=freq)
    impl = registry.get("rans_encode", backend, symbols.device)
    return impl(symbols, freq)


def rans_decode_lanes(
    words: torch.Tensor,  # [total_words] int32/int64, values 0..65535
    lengths: torch.Tensor,  # [lanes] int64/int32
    freq: torch.Tensor,  # [lanes, A] int32/int64
    n: int,
    backend: str = "auto",
) -> torch.Tensor:
    """Decode ``n`` symbols per lane from ``(words, lengths)`` as :func:`rans_encode_lanes`
    made them with ``freq``; the inverse of it and bit-exact with
    :func:`~kvtier_kernels.cachegen.rans_decode`.

    Args:
        words: int32/int64 ``[total_words]``, 16-bit words (higher bits are ignored, as the
            reference's uint16 drops them).
        lengths: int64/int32 ``[lanes]``, each lane's words.
        freq: int32/int64 ``[lanes, A]`` as for :func:`rans_encode_lanes`.
        n: symbols per lane, ``>= 0``.
        backend: ``"auto"``, ``"torch"``, ``"triton"`` or ``"interpret"`` (see registry).

    Returns:
        uint8 ``[lanes, n]`` on ``words``' device.

    Raises:
        CodecError: exactly where the reference rejects the stream: ``lengths`` not one
            per lane, a lane with fewer than 2 words, lengths not summing to
            ``len(words)``, or a lane that reads past its words, leaves words unread or
            does not end in ``RANS_LOW`` (the message names the first bad lane).
        TypeError / ValueError: a wrong type, shape, dtype or device, or a freq row that is
            not a probability table (checked first).
    """
    for name, tensor in (("words", words), ("lengths", lengths)):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dim() != 1 or tensor.dtype not in (torch.int32, torch.int64):
            raise ValueError(
                f"{name} must be a 1-D int32 or int64 tensor; "
                f"got shape {tuple(tensor.shape)} dtype {tensor.dtype}"
            )
    _check_freq(freq, None)
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be an int >= 0; got {n!r}")
    _check_same_device(words=words, lengths=lengths, freq=freq)
    if len(lengths) != len(freq):
        raise CodecError(
            f"every lane needs at least its 2 state words: {len(lengths)} lengths "
            f"for {len(freq)} lanes"
        )
    impl = registry.get("rans_decode", backend, words.device)
    return impl(words, lengths, freq, n)


# ---------------------------------------------------------------------------------------
# Triton launchers
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LaunchConfig:
    """Launch parameters of one rANS encode or decode launch.

    Attributes:
        block_lanes: lanes per program (``BLOCK``), a power of two; one lane per thread
            on a GPU.
        num_warps: warps per program, one of 1, 2, 4, 8, 16.
    """

    block_lanes: int
    num_warps: int


_GPU_MAX_BLOCK = 128  # 4 warps of one lane per thread
_GPU_MIN_PROGRAMS = 1024  # ~8 programs per SM on a 132-SM H100 before blocks grow
_INTERPRETER_MAX_BLOCK = 4096  # the interpreter pays per program and op: few, wide ones


def launch_config(lanes: int, device: torch.device) -> LaunchConfig:
    """Launch parameters for coding ``lanes`` lanes on ``device`` (CPU means the
    interpreter): a built-in heuristic, the same for encode and decode.

    Each lane is a serial chain of dependent loads and int64 divisions, so a GPU wants many
    resident warps rather than wide ones: one lane per thread, blocks of 32 lanes (one
    warp) growing to 128 only while that still leaves at least 1024 programs. Under the
    interpreter every program costs about a millisecond per op: one program for up to
    4096 lanes. (Not in the tuning files: ``kvtier tune`` has no rANS problem yet.)
    """
    if device.type != "cuda":
        return LaunchConfig(min(next_power_of_2(max(1, lanes)), _INTERPRETER_MAX_BLOCK), 1)
    block = 32
    while block < _GPU_MAX_BLOCK and lanes >= 2 * block * _GPU_MIN_PROGRAMS:
        block *= 2
    return LaunchConfig(block, block // 32)


_KERNELS = {
    "rans_encode": LazyKernel(_encode_kernel),
    "rans_decode": LazyKernel(_decode_kernel),
}


def _kernel(op: str, interpret: bool) -> Any:
    """The decorated kernel of ``op``, compiled or interpreted; decorated on first use."""
    return _KERNELS[op].get(interpret)


def _check_placement(device: torch.device, interpret: bool) -> None:
    """Raise ValueError when the kernel could not reach tensors on ``device``."""
    if interpret and device.type != "cpu":
        raise ValueError(
            f"kernel backend 'interpret' runs on CPU tensors; the tensors are on {device} "
            "(use 'triton' for GPU tensors)"
        )
    if not interpret and device.type != "cuda":
        raise ValueError(
            f"kernel backend 'triton' needs CUDA/ROCm tensors; the tensors are on {device} "
            "(use 'interpret' or 'torch')"
        )


def _launch(
    op: str,
    lanes: int,
    device: torch.device,
    interpret: bool,
    config: LaunchConfig | None,
    *args: Any,
    **meta: Any,
) -> None:
    """Launch ``op``'s kernel over ``lanes`` lanes (grid ``(cdiv(lanes, BLOCK),)``)."""
    config = launch_config(lanes, device) if config is None else config
    check_launch_config(config, ("block_lanes",))
    grid = (-(-lanes // config.block_lanes),)
    kernel = _kernel(op, interpret)
    device_guard = contextlib.nullcontext() if interpret else torch.cuda.device(device)
    with device_guard:
        kernel[grid](
            *args,
            PROB_BITS=PROB_BITS,
            RANS_LOW=RANS_LOW,
            **meta,
            BLOCK=config.block_lanes,
            num_warps=config.num_warps,
        )


def rans_encode_triton(
    symbols: torch.Tensor,  # [lanes, n] uint8
    freq: torch.Tensor,  # [lanes, A] int32/int64
    *,
    interpret: bool | None = None,
    config: LaunchConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`rans_encode_reference`: one launch, then an on-device
    compaction of the lanes' streams and one host sync (the stream's length and the
    validity flags). ``interpret`` picks Triton's interpreter (CPU tensors) or the compiled
    kernel (GPU tensors); None picks by the device. ``config`` overrides
    :func:`launch_config`. Shapes are assumed valid (:func:`rans_encode_lanes` checks them).

    Raises:
        ValueError: as :func:`rans_encode_reference`, or tensors this backend cannot reach,
            or an invalid ``config``.
    """
    # validate: shapes and dtypes are checked by rans_encode_lanes(); tables after the launch
    device = symbols.device
    interpret = device.type == "cpu" if interpret is None else interpret
    _check_placement(device, interpret)
    lanes, n = symbols.shape
    alphabet = freq.shape[1]

    # allocate
    width = n + 2
    freq64 = freq.to(torch.int64)
    cum_lo = (freq64.cumsum(1) - freq64).to(torch.int32)  # [lanes, A]
    scratch = torch.empty((lanes, width), dtype=torch.int32, device=device)
    lengths = torch.zeros(lanes, dtype=torch.int64, device=device)
    bad = torch.zeros(lanes, dtype=torch.int8, device=device)

    # grid + launch
    if lanes:
        _launch(
            "rans_encode",
            lanes,
            device,
            interpret,
            config,
            symbols,  # [lanes, n] uint8
            freq,  # [lanes, A]
            cum_lo,  # [lanes, A] int32
            scratch,  # [lanes, n + 2] int32
            lengths,  # [lanes] int64
            bad,  # [lanes] int8
            *symbols.stride(),
            *freq.stride(),
            lanes,
            n,
            alphabet,
        )

    bad_rows = _bad_rows(freq)
    checks = torch.stack([lengths.sum(), bad_rows.sum(), bad.sum(dtype=torch.int64)])
    total, bad_row_count, bad_lane_count = checks.tolist()  # the one host sync
    if bad_row_count:
        _raise_bad_table(bad_rows, freq)
    if bad_lane_count:
        _raise_unusable_symbols(bad != 0)

    # compact: lane l's word k (k counted over the whole stream) sits at flat scratch index
    # l * width + width - ends[l] + k.
    ends = lengths.cumsum(0)
    shift = torch.arange(1, lanes + 1, dtype=torch.int64, device=device) * width - ends
    index = torch.arange(total, dtype=torch.int64, device=device)
    index += shift.repeat_interleave(lengths, output_size=total)
    return scratch.view(-1)[index], lengths


def rans_decode_triton(
    words: torch.Tensor,  # [total_words] int32/int64
    lengths: torch.Tensor,  # [lanes] int64/int32
    freq: torch.Tensor,  # [lanes, A] int32/int64
    n: int,
    *,
    interpret: bool | None = None,
    config: LaunchConfig | None = None,
) -> torch.Tensor:
    """Triton version of :func:`rans_decode_reference`: one launch and one host sync (the
    length checks and the bad-lane flags). ``interpret``/``config`` as for
    :func:`rans_encode_triton`. Shapes are assumed valid (:func:`rans_decode_lanes`
    checks them).

    Raises:
        ValueError / CodecError: as :func:`rans_decode_reference`, or tensors this backend
            cannot reach, or an invalid ``config``.
    """
    # validate: shapes and dtypes are checked by rans_decode_lanes(); data after the launch
    device = words.device
    interpret = device.type == "cpu" if interpret is None else interpret
    _check_placement(device, interpret)
    lanes, alphabet = freq.shape
    num_words = words.numel()

    # allocate
    lengths64 = lengths.to(torch.int64)
    starts = lengths64.cumsum(0) - lengths64
    log2_search = (alphabet - 1).bit_length()
    cum_hi = torch.full((lanes, 1 << log2_search), PROB_SCALE, dtype=torch.int32, device=device)
    cum_hi[:, : alphabet - 1] = freq[:, : alphabet - 1].to(torch.int64).cumsum(1).to(torch.int32)
    out = torch.empty((lanes, n), dtype=torch.uint8, device=device)
    bad = torch.zeros(lanes, dtype=torch.int8, device=device)

    # grid + launch (with no words every lane is short or the lengths mismatch: no launch)
    if lanes and num_words:
        _launch(
            "rans_decode",
            lanes,
            device,
            interpret,
            config,
            words,  # [num_words]
            starts,  # [lanes] int64
            lengths64,  # [lanes] int64
            freq,  # [lanes, A]
            cum_hi,  # [lanes, SEARCH] int32
            out,  # [lanes, n] uint8
            bad,  # [lanes] int8
            words.stride(0),
            *freq.stride(),
            *out.stride(),
            lanes,
            n,
            num_words,
            LOG2_SEARCH=log2_search,
        )

    bad_rows = _bad_rows(freq)
    short = lengths64 < 2
    checks = torch.stack([bad_rows.sum(), short.sum(), lengths64.sum(), bad.sum(dtype=torch.int64)])
    bad_row_count, short_count, total, bad_lane_count = checks.tolist()  # the one host sync
    if bad_row_count:
        _raise_bad_table(bad_rows, freq)
    if short_count:
        _raise_short_lanes(lengths64)
    if total != num_words:
        _raise_length_mismatch(total, num_words)
    if bad_lane_count:
        _raise_bad_streams(bad != 0)
    return out


# ---------------------------------------------------------------------------------------
# registration
# ---------------------------------------------------------------------------------------

registry.register("rans_encode", "torch", rans_encode_reference)
registry.register("rans_decode", "torch", rans_decode_reference)
for _op, _launcher in (("rans_encode", rans_encode_triton), ("rans_decode", rans_decode_triton)):
    registry.register(_op, "triton", loader=triton_loader(_KERNELS[_op], _launcher, False))
    registry.register(_op, "interpret", loader=triton_loader(_KERNELS[_op], _launcher, True))
