"""rANS encode of CacheGen symbols, lane-parallel: the ``rans_encode`` op.

Each row (lane) of ``symbols`` ``[lanes, n]`` is coded with its row of ``freq``
``[lanes, A]`` into one stream of the bitstream :mod:`~kvtier_kernels.cachegen.rans.common`
describes; the lanes' streams are concatenated into ``words`` with one length per lane.

Bytes moved: the encoder reads the symbols once (``lanes * n``), one frequency and one
cumulative frequency per symbol (cache-resident tables), writes at most ``n + 2`` int32
words per lane into a scratch buffer and compacts them (read + write of the kept words).

Backends (see :mod:`kvtier_kernels.registry`): ``torch`` runs the numpy reference
:func:`rans_encode` on CPU copies; ``triton`` runs the Triton kernels of
:mod:`~kvtier_kernels.cachegen.rans.kernels` (the encoder, then the compaction) compiled on
CUDA/ROCm tensors; ``interpret`` runs them under Triton's interpreter on CPU tensors;
``numba`` runs ``rans_encode_numba_kernel`` compiled by numba on CPU copies (one lane per
loop iteration, the lanes spread over numba's threads).

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
    MAX_ALPHABET,
    PROB_BITS,
    RANS_LOW,
    LaunchConfig,
    bad_table_rows,
    check_freq,
    check_same_device,
    check_tables_per_stream,
    checked_table,
    raise_bad_table,
    raise_unusable_symbols,
)
from kvtier_kernels.cachegen.rans.kernels import ENCODE_KERNEL
from kvtier_kernels.cachegen.rans.plans import cached_plan, encode_key, encode_plan, store_plan

__all__ = [
    "NUMBA_KERNEL",
    "rans_encode",
    "rans_encode_lanes",
    "rans_encode_numba",
    "rans_encode_numba_kernel",
    "rans_encode_reference",
    "rans_encode_triton",
]


# ---------------------------------------------------------------------------------------
# numpy reference
# ---------------------------------------------------------------------------------------


def rans_encode(
    symbols: np.ndarray, freq: np.ndarray, tables_per_stream: int = 1
) -> tuple[np.ndarray, np.ndarray]:
    """Encode each row (stream) of ``symbols`` ``[streams, n]`` with ``g =
    tables_per_stream`` rows of ``freq`` ``[streams * g, A]`` (uint32, rows summing to
    ``PROB_SCALE``; every symbol used must have a positive frequency): symbol ``i`` of
    stream ``s`` with row ``s * g + i // (n / g)``. Returns ``(words, lengths)``: the
    streams concatenated (uint16) and each one's length in words (int64; ``2 <= length <=
    n + 2``)."""
    lanes, n = symbols.shape
    alphabet = freq.shape[1]
    segment = max(1, n // tables_per_stream)
    freq64 = freq.astype(np.uint64)
    cum = np.zeros_like(freq64)
    np.cumsum(freq64[:, :-1], axis=1, out=cum[:, 1:])
    width = n + 2
    buf = np.zeros(lanes * width, dtype=np.uint16)
    base = np.arange(lanes, dtype=np.int64) * width
    pos = np.full(lanes, width, dtype=np.int64)  # a lane's stream is buf[pos:width]
    state = np.full(lanes, RANS_LOW, dtype=np.uint64)
    first_row = np.arange(lanes, dtype=np.int64) * tables_per_stream
    for i in range(n - 1, -1, -1):
        index = (first_row + i // segment) * alphabet + symbols[:, i]
        f, c = freq64.reshape(-1)[index], cum.reshape(-1)[index]
        emit = state >= (f << np.uint64(16))
        # writing unconditionally is safe: an unused slot below pos is overwritten later
        buf[base + pos - 1] = (state & np.uint64(0xFFFF)).astype(np.uint16)
        pos -= emit
        state = np.where(emit, state >> np.uint64(16), state)
        state = ((state // f) << np.uint64(PROB_BITS)) + state % f + c
    buf[base + pos - 2] = (state & np.uint64(0xFFFF)).astype(np.uint16)
    buf[base + pos - 1] = (state >> np.uint64(16)).astype(np.uint16)
    pos -= 2
    keep = np.arange(width)[None, :] >= pos[:, None]
    return buf.reshape(lanes, width)[keep], width - pos


# ---------------------------------------------------------------------------------------
# torch reference: the numpy codec on CPU copies
# ---------------------------------------------------------------------------------------


def rans_encode_reference(
    symbols: torch.Tensor,  # [lanes, n] uint8
    freq: torch.Tensor,  # [lanes * g, A] int32/int64
    tables_per_stream: int = 1,  # g
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rans_encode` on CPU copies; returns ``(words,
    lengths)`` (int32, int64) on ``symbols``' device. Shapes are assumed valid
    (:func:`rans_encode_lanes` checks them).

    Raises:
        ValueError: a freq row is negative or does not sum to ``PROB_SCALE``, or a lane
            uses a symbol outside its row or with frequency 0.
    """
    freq_cpu = freq.cpu()
    bad_rows = bad_table_rows(freq_cpu)
    if bad_rows.any():
        raise_bad_table(bad_rows, freq_cpu)
    sym = symbols.cpu().numpy()
    table = freq_cpu.numpy().astype(np.uint32)
    rows, alphabet = table.shape
    usable = np.zeros((rows, MAX_ALPHABET + 1), dtype=bool)  # a uint8 symbol indexes it
    usable[:, :alphabet] = table > 0
    lanes, n = sym.shape
    segment = max(1, n // tables_per_stream)
    row = np.arange(lanes)[:, None] * tables_per_stream + np.arange(n)[None, :] // segment
    bad_lanes = ~usable[row, sym].all(1)
    if bad_lanes.any():
        raise_unusable_symbols(torch.from_numpy(bad_lanes))
    words, lengths = rans_encode(sym, table, tables_per_stream)
    device = symbols.device
    return (
        torch.from_numpy(words.astype(np.int32)).to(device),
        torch.from_numpy(lengths.astype(np.int64)).to(device),
    )


# ---------------------------------------------------------------------------------------
# numba kernel (CPU)
#
# Lanes are coded in groups of GROUP, one group per `prange` iteration, the group's lanes
# interleaved symbol by symbol: a lane is a chain of dependent divisions, and interleaving
# lets the core overlap the chains of several (twice as fast as one lane at a time). The
# arithmetic is the reference's, in int64 (every value stays below 2**32); the quotient
# state // f is taken in float64, faster than an integer division and exact: state < 2**32
# and f <= 2**16, so a quotient that is not an integer lies at least 2**-16 below the next
# one, while a float64 quotient below 2**32 is off by at most 2**-21. Lane l writes its
# stream downward into scratch[l, :] as the Triton kernel does (a word is stored at pos - 1
# whether or not it is emitted: an unused one is overwritten later); a second loop copies
# the lanes' streams into one. `bad` flags a lane that used a symbol outside its row or
# with frequency 0 (coded as frequency 1).
#
# NOTE: `prange` is bound to `numba.prange` by `NumbaKernel.get()`, so that importing this
# module never imports numba.
# ---------------------------------------------------------------------------------------

prange: Any = range
GROUP = 8  # lanes interleaved by one loop iteration


def rans_encode_numba_kernel(
    symbols,  # [lanes, n] uint8, contiguous
    freq,  # [lanes * G, A] int64, contiguous; rows non-negative, summing to PROB_SCALE
    scratch,  # [lanes, n + 2] uint16: each lane's stream at its end
    lengths,  # [lanes] int64 (out)
    bad,  # [lanes] uint8 (out): 1 = a symbol outside the row or with frequency 0
    tables_per_stream,  # G: lane l's symbol i is coded with row l * G + i // segment
):  # -> words: int32 [sum(lengths)], the lanes' streams concatenated
    lanes, n = symbols.shape
    alphabet = freq.shape[1]
    width = n + 2
    segment = max(1, n // tables_per_stream)
    for group in prange((lanes + GROUP - 1) // GROUP):
        first = group * GROUP
        count = min(GROUP, lanes - first)
        cum = np.empty((GROUP, alphabet), np.int64)
        state = np.full(GROUP, RANS_LOW, np.int64)
        pos = np.full(GROUP, width, np.int64)
        flag = np.zeros(GROUP, np.uint8)
        row = 0
        for i in range(n - 1, -1, -1):
            if i == n - 1 or i % segment == segment - 1:  # a segment's last symbol: its row
                row = i // segment
                for g in range(count):
                    total = 0
                    for a in range(alphabet):
                        cum[g, a] = total
                        total += freq[(first + g) * tables_per_stream + row, a]
            for g in range(count):
                lane = first + g
                table = lane * tables_per_stream + row
                sym = symbols[lane, i]
                f, c = 1, 0
                if sym < alphabet and freq[table, sym] > 0:
                    f, c = freq[table, sym], cum[g, sym]
                else:
                    flag[g] = 1
                x, at = state[g], pos[g]
                emit = np.int64(x >= f << 16)
                scratch[lane, at - 1] = x & 0xFFFF
                pos[g] = at - emit
                x >>= emit << 4
                quotient = np.int64(np.float64(x) / np.float64(f))
                state[g] = (quotient << PROB_BITS) + x - quotient * f + c
        for g in range(count):
            lane, at = first + g, pos[g]
            scratch[lane, at - 2] = state[g] & 0xFFFF
            scratch[lane, at - 1] = state[g] >> 16
            lengths[lane] = width - at + 2
            bad[lane] = flag[g]
    starts = np.empty(lanes, np.int64)
    total_words = 0
    for lane in range(lanes):
        starts[lane] = total_words
        total_words += lengths[lane]
    words = np.empty(total_words, np.int32)
    for lane in prange(lanes):
        start, length = starts[lane], lengths[lane]
        for k in range(length):
            words[start + k] = scratch[lane, width - length + k]
    return words


NUMBA_KERNEL = NumbaKernel(rans_encode_numba_kernel, op="rans_encode")
"""The encode kernel, compiled by numba on first use."""


# ---------------------------------------------------------------------------------------
# launchers
# ---------------------------------------------------------------------------------------


def rans_encode_lanes(
    symbols: torch.Tensor,  # [lanes, n] uint8
    freq: torch.Tensor,  # [lanes * g, A] int32/int64
    backend: str = "auto",
    *,
    tables_per_stream: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """rANS-encode each lane (row) of ``symbols`` into one stream, with its rows of ``freq``.

    Args:
        symbols: uint8 ``[lanes, n]``.
        freq: int32/int64 ``[lanes * g, A]``, ``1 <= A <= 255``, rows non-negative and
            summing to ``PROB_SCALE``; every symbol a lane uses must have a positive
            frequency in its row.
        backend: ``"auto"``, ``"torch"``, ``"triton"``, ``"interpret"`` or ``"numba"``
            (see registry).
        tables_per_stream: ``g``, a divisor of ``n``: lane ``l``'s symbols are coded in
            ``g`` runs of ``n / g``, run ``j`` with row ``l * g + j`` of ``freq``.

    Returns:
        ``(words, lengths)`` on ``symbols``' device, equal to
        :func:`rans_encode`'s: int32 ``[sum(lengths)]`` holding
        the 16-bit words of the lanes' streams concatenated, and int64 ``[lanes]``.

    Raises:
        TypeError / ValueError: a wrong type, shape, dtype or device (the message names the
            tensor and the expected shape), a freq row that is not a probability table, or
            a lane using a symbol without frequency (names the first such lane).

    NOTE: on the Triton backends, what depends only on the arguments' shapes, strides,
    dtypes, devices and alignment and the backend (validation, launch config, grid, the
    bound kernels) is computed once and cached (:mod:`~kvtier_kernels.cachegen.rans.plans`);
    a call allocates its buffers, launches the encoder, reads its counts back once (the
    kernel builds the cumulative tables and checks them) and launches the compaction.
    """
    try:
        key = encode_key(backend, symbols, freq, tables_per_stream)
        plan = cached_plan(key)
    except (AttributeError, TypeError):  # not tensors, or unhashable: validate
        key, plan = None, None
    if plan is None:
        if not isinstance(symbols, torch.Tensor):
            raise TypeError(f"symbols must be a torch.Tensor, got {type(symbols).__name__}")
        if symbols.dim() != 2 or symbols.dtype != torch.uint8:
            raise ValueError(
                f"symbols must be a 2-D uint8 tensor [lanes, n]; "
                f"got shape {tuple(symbols.shape)} dtype {symbols.dtype}"
            )
        check_tables_per_stream(tables_per_stream, symbols.shape[1])
        check_freq(freq, symbols.shape[0] * tables_per_stream)
        check_same_device(symbols=symbols, freq=freq)
        impl = registry.get("rans_encode", backend, symbols.device)
        if not (isinstance(impl, functools.partial) and impl.func is rans_encode_triton):
            return impl(symbols, freq, tables_per_stream)  # a CPU coder: no launch to plan
        interpret = impl.keywords["interpret"]
        plan = encode_plan(symbols, freq, tables_per_stream, interpret)
        if key is not None:
            store_plan(key, plan)
    return plan(symbols, freq)


# ---------------------------------------------------------------------------------------
# Triton launcher
# ---------------------------------------------------------------------------------------


def rans_encode_triton(
    symbols: torch.Tensor,  # [lanes, n] uint8
    freq: torch.Tensor,  # [lanes * g, A] int32/int64
    tables_per_stream: int = 1,  # g
    *,
    interpret: bool | None = None,
    config: LaunchConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`rans_encode_reference`: the encoder's launch, one host sync
    (the stream's length and the counts of bad rows and lanes), then the compaction of
    the lanes' streams, through the cached plan of these shapes (one per ``config``:
    :class:`~kvtier_kernels.cachegen.rans.plans.EncodePlan`). ``interpret`` picks Triton's
    interpreter (CPU tensors) or the compiled kernel (GPU tensors); None picks by the
    device. ``config`` overrides :func:`launch_config`. Shapes are assumed valid
    (:func:`rans_encode_lanes` checks them).

    Raises:
        ValueError: as :func:`rans_encode_reference`, or tensors this backend cannot reach,
            or an invalid ``config``.
    """
    interpret = symbols.device.type == "cpu" if interpret is None else interpret
    key = encode_key(("triton", interpret, config), symbols, freq, tables_per_stream)
    plan = cached_plan(key)
    if plan is None:
        plan = encode_plan(symbols, freq, tables_per_stream, interpret, config)
        store_plan(key, plan)
    return plan(symbols, freq)


# ---------------------------------------------------------------------------------------
# numba launcher
# ---------------------------------------------------------------------------------------


@NUMBA_KERNEL.falling_back_to(rans_encode_reference)
def rans_encode_numba(
    symbols: torch.Tensor,  # [lanes, n] uint8
    freq: torch.Tensor,  # [lanes * g, A] int32/int64
    tables_per_stream: int = 1,  # g
) -> tuple[torch.Tensor, torch.Tensor]:
    """numba version of :func:`rans_encode_reference`, on CPU copies; the same words,
    lengths and errors. Shapes are assumed valid (:func:`rans_encode_lanes` checks them).
    Where numba fails to import or to compile the kernel, the reference runs (logged once).

    Raises:
        ValueError: as :func:`rans_encode_reference`.
    """
    # validate: the tables first, as the reference does; the symbols in the kernel
    table = checked_table(freq)

    # allocate
    lanes, n = symbols.shape
    scratch = np.empty((lanes, n + 2), dtype=np.uint16)
    lengths = np.empty(lanes, dtype=np.int64)
    bad = np.zeros(lanes, dtype=np.uint8)

    # launch
    words = NUMBA_KERNEL(
        symbols.cpu().contiguous().numpy(),  # [lanes, n]
        table,  # [lanes * g, A]
        scratch,  # [lanes, n + 2]
        lengths,  # [lanes]
        bad,  # [lanes]
        tables_per_stream,
        work=lanes * n,
    )
    if bad.any():
        raise_unusable_symbols(torch.from_numpy(bad != 0))
    device = symbols.device
    return torch.from_numpy(words).to(device), torch.from_numpy(lengths).to(device)


# ---------------------------------------------------------------------------------------
# registration
# ---------------------------------------------------------------------------------------

registry.register("rans_encode", "torch", rans_encode_reference)
registry.register(
    "rans_encode", "triton", loader=triton_loader(ENCODE_KERNEL, rans_encode_triton, False)
)
registry.register(
    "rans_encode", "interpret", loader=triton_loader(ENCODE_KERNEL, rans_encode_triton, True)
)
registry.register("rans_encode", "numba", loader=numba_loader([NUMBA_KERNEL], rans_encode_numba))
