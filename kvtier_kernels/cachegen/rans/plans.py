"""Launch plans of the rANS coder's Triton kernels: what an encode or decode computes once
per shape, strides, dtypes, devices and backend, and what is left to do per call.

:func:`~kvtier_kernels.cachegen.rans.encode.rans_encode_lanes` and
:func:`~kvtier_kernels.cachegen.rans.decode.rans_decode_lanes` look their plan up under a
key of the arguments' shapes, strides, dtypes, devices and alignment, ``tables_per_stream``
(plus ``n`` for a decode) and the backend; no tensor address, and not the length of a
decode's ``words``, which changes with every chunk: only what Triton specializes the
kernel on (a length of 1, a multiple of 16, beyond int32). The kernels' segment length
``max(1, n // tables_per_stream)`` follows from ``n`` and ``tables_per_stream``, so the key
fixes it too. A miss validates the arguments and builds the plan: the launch config, the
grid, the constexprs and, for Triton, the kernels bound and compiled for those arguments
(:func:`kvtier_kernels._launch.bind`). A hit skips all of that::

    key -> EncodePlan:  scratch, zeroed summary  ->  encoder  ->  counts (one host sync)
                        ->  words  ->  compaction
    key -> DecodePlan:  cum_hi, out, zeroed summary  ->  decoder  ->  counts (one host sync)

The rest of a call's work runs in the kernels (:mod:`~kvtier_kernels.cachegen.rans.kernels`):
they build the cumulative tables from the call's ``freq``, check its rows and a decode's
lengths, and leave a few counts at the head of ``summary``, which the host reads back. Only
where a count is not zero does the host look further, to raise the error the reference
raises (the first bad row or lane), in the reference's order. The buffers are allocated
per call (the caching allocator's blocks): a buffer kept in the plan would be shared by
callers on other threads or streams, and the encoder's scratch is still read by the
compaction queued after the call returns. On the CPU, whose allocator caches nothing, the
encoder's scratch is the calling thread's own (:func:`_cpu_scratch`). Each op keeps its
one host sync: a corrupt stream raises :class:`~kvtier_kernels.cachegen.rans.common.CodecError` before any symbol is
returned, and the encoder needs the stream's total length to size its output.
:meth:`EncodePlan.enqueue` / :meth:`DecodePlan.enqueue` are the part before the sync and
:meth:`EncodePlan.compact` the encoder's part after it (the host-cost benchmark times them
apart).
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from kvtier_kernels._launch import (
    BoundLaunch,
    LazyKernel,
    bind,
    check_launch_config,
    compiling_only,
)
from kvtier_kernels.cachegen.rans.common import (
    PROB_BITS,
    RANS_LOW,
    LaunchConfig,
    bad_table_rows,
    check_placement,
    launch_config,
    raise_bad_streams,
    raise_bad_table,
    raise_length_mismatch,
    raise_short_lanes,
    raise_unusable_symbols,
)
from kvtier_kernels.cachegen.rans.kernels import (
    COMPACT_KERNEL,
    DECODE_COUNTS,
    DECODE_KERNEL,
    ENCODE_COUNTS,
    ENCODE_KERNEL,
)
from kvtier_kernels.plan_cache import PlanCache

__all__ = [
    "MAX_PLANS",
    "DecodePlan",
    "EncodePlan",
    "cached_plan",
    "clear_plans",
    "decode_key",
    "decode_plan",
    "encode_key",
    "encode_plan",
    "store_plan",
]

MAX_PLANS = 512
"""Plans kept (the oldest go first): one per direction, lane count, symbols per lane (every
partial chunk length up to a few hundred), alphabet and backend."""

_plans = PlanCache(MAX_PLANS)


def _tensor_key(t: torch.Tensor) -> tuple:
    return (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() & 15)


def encode_key(
    backend: Any, symbols: torch.Tensor, freq: torch.Tensor, tables_per_stream: Any
) -> tuple:
    """What an encode plan depends on, read off the arguments without a sync (raises
    AttributeError or TypeError for arguments that are not tensors, or an unhashable
    ``tables_per_stream``: validate those)."""
    return ("rans_encode", backend, _tensor_key(symbols), _tensor_key(freq),
            tables_per_stream, type(tables_per_stream))  # fmt: skip


def decode_key(
    backend: Any,
    words: torch.Tensor,
    lengths: torch.Tensor,
    freq: torch.Tensor,
    n: Any,
    tables_per_stream: Any,
) -> tuple:
    """What a decode plan depends on, read off the arguments without a sync: of ``words``
    its dtype, stride, device and alignment, and of its length only the classes Triton
    specializes an integer on (raises AttributeError or TypeError for arguments that are
    not tensors, or an unhashable ``n`` or ``tables_per_stream``: validate those)."""
    num_words = words.numel()
    word_class = (num_words == 1, num_words % 16 == 0, num_words < 1 << 31)
    words_key = (words.dim(), words.stride(), words.dtype, words.device, words.data_ptr() & 15)
    return ("rans_decode", backend, words_key, word_class, _tensor_key(lengths),
            _tensor_key(freq), n, type(n), tables_per_stream,
            type(tables_per_stream))  # fmt: skip


def cached_plan(key: tuple) -> Any:
    """The plan stored under ``key``, or None (raises TypeError for an unhashable key)."""
    return _plans.get(key)


def clear_plans() -> None:
    """Drop every cached plan (benchmarks time the path without them)."""
    _plans.clear()


def store_plan(key: tuple, plan: Any) -> None:
    """Keep ``plan`` under ``key`` (dropping the oldest past MAX_PLANS)."""
    _plans.put(key, plan)


_DECODE_PREFIX = 1024  # lengths summed at a time by a decode program (its lanes' starts)
_COMPACT_WORDS = 16  # words a compaction program copies of each lane at a time (32 spill)
_COMPACT_PROGRAMS = 8  # times BLOCK: earlier programs' words summed at a time by one


def _grid(
    lanes: int, device: torch.device, config: LaunchConfig | None
) -> tuple[LaunchConfig, tuple[int]]:
    """The launch config (``config``, else :func:`launch_config`'s) and grid over ``lanes``."""
    config = launch_config(lanes, device) if config is None else config
    check_launch_config(config, ("block_lanes",))
    return config, (-(-lanes // config.block_lanes),)


def _bind_kernel(
    kernel: LazyKernel,
    config: LaunchConfig,
    grid: tuple[int],
    device: torch.device,
    interpret: bool,
    args: tuple,
    meta: dict[str, Any],
    per_call: int | None,
) -> BoundLaunch:
    """``kernel`` bound over ``grid`` for ``args``, with the constexprs ``meta`` and
    ``BLOCK``."""
    meta = {**meta, "BLOCK": config.block_lanes, "num_warps": config.num_warps}
    if interpret:
        return bind(kernel, True, grid, args, meta, per_call=per_call)
    index = device.index if device.index is not None else torch.cuda.current_device()
    with torch.cuda.device(index):  # compiled for, and later launched on, the tensors' GPU
        return bind(kernel, False, grid, args, meta, index, per_call=per_call)


# ---------------------------------------------------------------------------------------
# encode
# ---------------------------------------------------------------------------------------

_cpu_scratches = threading.local()


def _cpu_scratch(numel: int) -> torch.Tensor:
    """``numel`` int32 of this thread's encoder scratch on the CPU (the head of one buffer,
    grown to the largest call the thread made). A GPU call takes its scratch from the
    caching allocator; the CPU's allocator caches nothing, and a chunk's scratch (76 MB for
    32 layers x 8 heads x 128) lies past glibc's mmap threshold, so every call mapped,
    faulted in and unmapped it (22 of a call's 37 us). A CPU call runs to its end before
    it returns (interpreted, or recorded: nothing runs), so the thread's next call finds
    the buffer free; the encoder writes every word of it that it or the compaction reads."""
    buffer = getattr(_cpu_scratches, "buffer", None)
    if buffer is None or buffer.numel() < numel:
        buffer = _cpu_scratches.buffer = torch.empty(numel, dtype=torch.int32)
    return buffer[:numel]


class EncodePlan:
    """One encode bound to its shapes: ``plan(symbols, freq)`` returns ``(words, lengths)``
    (see the module docstring for what a call does). Built by :func:`encode_plan`."""

    __slots__ = ("compaction", "device", "lanes", "launch", "summary_size", "width")

    def __init__(
        self,
        launch: BoundLaunch | None,
        compaction: BoundLaunch | None,
        lanes: int,
        width: int,
        summary_size: int,
        device: torch.device,
    ) -> None:
        self.launch, self.compaction, self.device = launch, compaction, device
        self.lanes, self.width, self.summary_size = lanes, width, summary_size

    def enqueue(
        self, symbols: torch.Tensor, freq: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Queue the encoder without waiting for it: returns ``(scratch, summary)``, each
        lane's stream at the end of its row of ``scratch`` and the summary the kernel
        leaves (:mod:`~kvtier_kernels.cachegen.rans.kernels`; nothing is checked yet)."""
        device = self.device
        shape = (self.lanes, self.width)
        if device.type == "cpu":
            scratch = _cpu_scratch(self.lanes * self.width).view(shape)
        else:
            scratch = torch.empty(shape, dtype=torch.int32, device=device)
        summary = torch.zeros(self.summary_size, dtype=torch.int64, device=device)
        self.launch(symbols, freq, scratch, summary)
        return scratch, summary

    def compact(
        self, scratch: torch.Tensor, summary: torch.Tensor, total: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Queue the compaction of the lanes' streams, ``total`` words in all, into one
        without waiting for it: returns ``(words, lengths)``."""
        words = torch.empty(total, dtype=torch.int32, device=self.device)
        # total is 0 only where the encoder did not run (launches recorded, or compiled
        # only: then the compaction's kernel is asked for as well)
        if total or compiling_only():
            self.compaction(scratch, summary, words)
        return words, summary[ENCODE_COUNTS : ENCODE_COUNTS + self.lanes]

    def __call__(
        self, symbols: torch.Tensor, freq: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.launch is None:  # no lanes
            words = torch.empty(0, dtype=torch.int32, device=self.device)
            return words, torch.zeros(0, dtype=torch.int64, device=self.device)
        scratch, summary = self.enqueue(symbols, freq)
        total, bad_rows, bad_lanes = summary[:ENCODE_COUNTS].tolist()  # the one host sync
        if bad_rows:
            raise_bad_table(bad_table_rows(freq), freq)
        if bad_lanes:
            flags = summary[ENCODE_COUNTS + self.lanes : ENCODE_COUNTS + 2 * self.lanes]
            raise_unusable_symbols(flags != 0)
        return self.compact(scratch, summary, total)


def encode_plan(
    symbols: torch.Tensor,  # [lanes, n] uint8
    freq: torch.Tensor,  # [lanes * g, A] int32/int64
    tables_per_stream: int,  # g
    interpret: bool,
    config: LaunchConfig | None = None,
) -> EncodePlan:
    """Build the plan of an encode for arguments shaped as these (shapes and dtypes already
    checked): check the placement, pick the launch config (``config``, else
    :func:`~kvtier_kernels.cachegen.rans.common.launch_config`), the grid, and bind the
    encoder and the compaction (the same grid).

    Raises:
        ValueError: tensors this backend cannot reach, or an invalid ``config``.
    """
    device = symbols.device
    check_placement(device, interpret)
    lanes, n = symbols.shape
    width = tables_per_stream * freq.shape[1] + n + 2  # the lane's tables, then its stream
    if not lanes:
        return EncodePlan(None, None, lanes, width, 0, device)
    config, grid = _grid(lanes, device, config)
    scratch = torch.empty((lanes, width), dtype=torch.int32, device=device)
    summary = torch.zeros(ENCODE_COUNTS + 2 * lanes + grid[0], dtype=torch.int64, device=device)
    args = (
        symbols,  # [lanes, n] uint8
        freq,  # [lanes * g, A]
        scratch,  # [lanes, g * A + n + 2]
        summary,  # [3 + 2 * lanes + programs]
        *symbols.stride(),
        *freq.stride(),
        lanes,
        n,
        freq.shape[1],
        tables_per_stream,
        max(1, n // tables_per_stream),  # segment
    )
    meta = {"PROB_BITS": PROB_BITS, "RANS_LOW": RANS_LOW}
    launch = _bind_kernel(ENCODE_KERNEL, config, grid, device, interpret, args, meta, 4)
    words = torch.empty(2 * lanes, dtype=torch.int32, device=device)  # as a call makes it
    meta = {"WORDS": _COMPACT_WORDS, "PROGRAMS": _COMPACT_PROGRAMS * config.block_lanes}
    args = (scratch, summary, words, width, lanes)
    compaction = _bind_kernel(COMPACT_KERNEL, config, grid, device, interpret, args, meta, 3)
    return EncodePlan(launch, compaction, lanes, width, len(summary), device)


# ---------------------------------------------------------------------------------------
# decode
# ---------------------------------------------------------------------------------------


def _check_lengths(lengths: torch.Tensor, freq: torch.Tensor, num_words: int) -> None:
    """The checks of a decode that launched nothing (no lanes, or no words: then a lane is
    short or the lengths do not sum to 0), on the host: the tables, then the lengths."""
    bad_rows = bad_table_rows(freq)
    if bad_rows.any():
        raise_bad_table(bad_rows, freq)
    lengths64 = lengths.to(torch.int64)
    if (lengths64 < 2).any():
        raise_short_lanes(lengths64)
    total = int(lengths64.sum())
    if total != num_words:
        raise_length_mismatch(total, num_words)


class DecodePlan:
    """One decode bound to its shapes: ``plan(words, lengths, freq)`` returns the symbols
    (see the module docstring for what a call does). Built by :func:`decode_plan`."""

    __slots__ = ("device", "lanes", "launch", "n", "rows", "scalars", "search", "tables")

    def __init__(
        self,
        launch: BoundLaunch | None,
        lanes: int,
        n: int,
        table_shape: tuple[int, int],
        device: torch.device,
        scalars: tuple[int, ...] = (),
        tables: tuple[int, int] = (1, 1),
    ) -> None:
        self.launch, self.lanes, self.n, self.device = launch, lanes, n, device
        self.rows, self.search = table_shape  # of cum_hi
        self.scalars, self.tables = scalars, tables  # the kernel's before / after num_words

    def enqueue(
        self, words: torch.Tensor, lengths: torch.Tensor, freq: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Queue the decoder without waiting for it: returns ``(out, summary)``, the
        symbols ``[lanes, n]`` and the summary the kernel leaves
        (:mod:`~kvtier_kernels.cachegen.rans.kernels`; nothing is checked yet). With no
        words nothing is launched."""
        device, lanes = self.device, self.lanes
        cum_hi = torch.empty((self.rows, self.search), dtype=torch.int32, device=device)
        out = torch.empty((lanes, self.n), dtype=torch.uint8, device=device)
        summary = torch.zeros(DECODE_COUNTS + lanes, dtype=torch.int64, device=device)
        num_words = words.numel()
        if self.launch is not None and num_words:
            scalars, tables = self.scalars, self.tables
            self.launch(words, lengths, freq, cum_hi, out, summary, *scalars, num_words, *tables)
        return out, summary

    def __call__(
        self, words: torch.Tensor, lengths: torch.Tensor, freq: torch.Tensor
    ) -> torch.Tensor:
        num_words = words.numel()
        if self.launch is None or not num_words:
            _check_lengths(lengths, freq, num_words)
            return torch.empty((self.lanes, self.n), dtype=torch.uint8, device=self.device)
        out, summary = self.enqueue(words, lengths, freq)
        bad_rows, short, excess, bad_lanes = summary[:DECODE_COUNTS].tolist()
        # ^ the one host sync
        if bad_rows:
            raise_bad_table(bad_table_rows(freq), freq)
        if short:
            raise_short_lanes(lengths.to(torch.int64))
        if excess:
            raise_length_mismatch(num_words + excess, num_words)
        if bad_lanes:
            raise_bad_streams(summary[DECODE_COUNTS:] != 0)
        return out


def decode_plan(
    words: torch.Tensor,  # [num_words] int32/int64
    lengths: torch.Tensor,  # [lanes] int64/int32
    freq: torch.Tensor,  # [lanes * g, A] int32/int64
    n: int,
    tables_per_stream: int,  # g
    interpret: bool,
    config: LaunchConfig | None = None,
) -> DecodePlan:
    """Build the plan of a decode for arguments shaped as these (already validated): check
    the placement, pick the launch config (``config``, else
    :func:`~kvtier_kernels.cachegen.rans.common.launch_config`), the grid, and bind the
    decoder (every argument passed per call: the word count changes from call to call).

    Raises:
        ValueError: tensors this backend cannot reach, or an invalid ``config``.
    """
    device = words.device
    check_placement(device, interpret)
    lanes = len(lengths)
    rows, alphabet = freq.shape
    log2_search = (alphabet - 1).bit_length()
    table_shape = (rows, 1 << log2_search)  # cum_hi: [lanes * g, SEARCH]
    if not lanes:
        return DecodePlan(None, lanes, n, table_shape, device)
    config, grid = _grid(lanes, device, config)
    out = torch.empty((lanes, n), dtype=torch.uint8, device=device)  # as a call makes it
    scalars = (words.stride(0), lengths.stride(0), *freq.stride(), *out.stride(), lanes, n)
    scalars += (alphabet,)
    tables = (tables_per_stream, max(1, n // tables_per_stream))  # G, segment
    args = (
        words,  # [num_words]
        lengths,  # [lanes]
        freq,  # [lanes * g, A]
        torch.empty(table_shape, dtype=torch.int32, device=device),  # cum_hi
        out,  # [lanes, n] uint8
        torch.zeros(DECODE_COUNTS + lanes, dtype=torch.int64, device=device),  # summary
        *scalars,
        words.numel(),
        *tables,
    )
    meta = {"PROB_BITS": PROB_BITS, "RANS_LOW": RANS_LOW, "LOG2_SEARCH": log2_search}
    meta["PREFIX"] = _DECODE_PREFIX
    launch = _bind_kernel(DECODE_KERNEL, config, grid, device, interpret, args, meta, None)
    return DecodePlan(launch, lanes, n, table_shape, device, scalars, tables)
