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
grid, the constexprs and, for Triton, the kernel bound and compiled for those arguments
(:func:`kvtier_kernels._launch.bind`). A hit skips all of that::

    key -> EncodePlan:  cumulative table, scratch, lengths, flags  ->  BoundLaunch
                        -> checks (one host sync)  ->  compaction of the lanes' streams
    key -> DecodePlan:  starts, cumulative table, out, flags  ->  BoundLaunch
                        -> checks (one host sync)

What a call still does is what its data needs. The cumulative tables are built from each
call's ``freq``, and the buffers are allocated per call (the caching allocator's blocks):
a buffer kept in the plan would be shared by callers on other threads or streams, and the
encoder's scratch is still read by the compaction queued after the call returns. Each op
keeps its one host sync: the table, length and stream checks are read back after the
launch (a corrupt stream raises :class:`~kvtier_kernels.cachegen.rans.common.CodecError`
before any symbol is returned), and the encoder needs the stream's total length to size
its output. :meth:`EncodePlan.enqueue` / :meth:`DecodePlan.enqueue` are the part before
the sync (the host-cost benchmark times them apart).
"""

from __future__ import annotations

from typing import Any

import torch

from kvtier_kernels._launch import BoundLaunch, LazyKernel, bind, check_launch_config
from kvtier_kernels.cachegen.rans.common import (
    PROB_BITS,
    PROB_SCALE,
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


def _bind_kernel(
    kernel: LazyKernel,
    lanes: int,
    device: torch.device,
    interpret: bool,
    config: LaunchConfig | None,
    args: tuple,
    meta: dict[str, Any],
    per_call: int | None,
) -> BoundLaunch:
    """``kernel`` bound over ``lanes`` lanes (grid ``(cdiv(lanes, BLOCK),)``) for ``args``,
    with the constexprs ``PROB_BITS``, ``RANS_LOW``, ``meta`` and ``BLOCK``."""
    config = launch_config(lanes, device) if config is None else config
    check_launch_config(config, ("block_lanes",))
    grid = (-(-lanes // config.block_lanes),)
    meta = {
        "PROB_BITS": PROB_BITS,
        "RANS_LOW": RANS_LOW,
        **meta,
        "BLOCK": config.block_lanes,
        "num_warps": config.num_warps,
    }
    if interpret:
        return bind(kernel, True, grid, args, meta, per_call=per_call)
    index = device.index if device.index is not None else torch.cuda.current_device()
    with torch.cuda.device(index):  # compiled for, and later launched on, the tensors' GPU
        return bind(kernel, False, grid, args, meta, index, per_call=per_call)


# ---------------------------------------------------------------------------------------
# encode
# ---------------------------------------------------------------------------------------


class EncodePlan:
    """One encode bound to its shapes: ``plan(symbols, freq)`` returns ``(words, lengths)``
    (see the module docstring for what a call does). Built by :func:`encode_plan`."""

    __slots__ = ("device", "lanes", "launch", "width")

    def __init__(
        self, launch: BoundLaunch | None, lanes: int, width: int, device: torch.device
    ) -> None:
        self.launch, self.lanes, self.width, self.device = launch, lanes, width, device

    def enqueue(
        self, symbols: torch.Tensor, freq: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queue the encode without waiting for it: returns ``(scratch, lengths, bad)``,
        each lane's stream at the end of its row of ``scratch`` ``[lanes, n + 2]``, its
        length, and 1 where it used a symbol without frequency (nothing is checked yet)."""
        device, lanes = self.device, self.lanes
        cum = freq.cumsum(1, dtype=torch.int64)
        cum -= freq
        # [lanes * g, A], contiguous: freq[0] + ... + freq[a - 1]
        cum_lo = cum.to(torch.int32, memory_format=torch.contiguous_format)
        scratch = torch.empty((lanes, self.width), dtype=torch.int32, device=device)
        lengths = torch.zeros(lanes, dtype=torch.int64, device=device)
        bad = torch.zeros(lanes, dtype=torch.int8, device=device)
        if self.launch is not None:
            self.launch(symbols, freq, cum_lo, scratch, lengths, bad)
        return scratch, lengths, bad

    def __call__(
        self, symbols: torch.Tensor, freq: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        scratch, lengths, bad = self.enqueue(symbols, freq)
        bad_rows = bad_table_rows(freq)
        checks = torch.stack([lengths.sum(), bad_rows.sum(), bad.sum(dtype=torch.int64)])
        total, bad_row_count, bad_lane_count = checks.tolist()  # the one host sync
        if bad_row_count:
            raise_bad_table(bad_rows, freq)
        if bad_lane_count:
            raise_unusable_symbols(bad != 0)

        # compact: lane l's word k (k counted over the whole stream) sits at flat scratch
        # index (l + 1) * width - ends[l] + k.
        width, device = self.width, self.device
        shift = torch.arange(width, (self.lanes + 1) * width, width, device=device)
        shift -= lengths.cumsum(0)
        index = torch.arange(total, dtype=torch.int64, device=device)
        index += shift.repeat_interleave(lengths, output_size=total)
        return scratch.view(-1)[index], lengths


def encode_plan(
    symbols: torch.Tensor,  # [lanes, n] uint8
    freq: torch.Tensor,  # [lanes * g, A] int32/int64
    tables_per_stream: int,  # g
    interpret: bool,
    kernel: LazyKernel,
    config: LaunchConfig | None = None,
) -> EncodePlan:
    """Build the plan of an encode for arguments shaped as these (shapes and dtypes already
    checked): check the placement, pick the launch config (``config``, else
    :func:`~kvtier_kernels.cachegen.rans.common.launch_config`), the grid, and bind
    ``kernel``.

    Raises:
        ValueError: tensors this backend cannot reach, or an invalid ``config``.
    """
    device = symbols.device
    check_placement(device, interpret)
    lanes, n = symbols.shape
    if not lanes:
        return EncodePlan(None, lanes, n + 2, device)
    args = (
        symbols,  # [lanes, n] uint8
        freq,  # [lanes * g, A]
        torch.empty(freq.shape, dtype=torch.int32, device=device),  # cum_lo
        torch.empty((lanes, n + 2), dtype=torch.int32, device=device),  # scratch
        torch.empty(lanes, dtype=torch.int64, device=device),  # lengths
        torch.empty(lanes, dtype=torch.int8, device=device),  # bad
        *symbols.stride(),
        *freq.stride(),
        lanes,
        n,
        freq.shape[1],
        tables_per_stream,
        max(1, n // tables_per_stream),  # segment
    )
    launch = _bind_kernel(kernel, lanes, device, interpret, config, args, {}, per_call=6)
    return EncodePlan(launch, lanes, n + 2, device)


# ---------------------------------------------------------------------------------------
# decode
# ---------------------------------------------------------------------------------------


class DecodePlan:
    """One decode bound to its shapes: ``plan(words, lengths, freq)`` returns the symbols
    (see the module docstring for what a call does). Built by :func:`decode_plan`."""

    __slots__ = ("alphabet", "device", "lanes", "launch", "n", "rows", "scalars", "search")
    __slots__ += ("tables",)

    def __init__(
        self,
        launch: BoundLaunch | None,
        lanes: int,
        n: int,
        freq_shape: tuple[int, int],
        device: torch.device,
        scalars: tuple[int, ...] = (),
        tables: tuple[int, int] = (1, 1),
    ) -> None:
        self.launch, self.lanes, self.n, self.device = launch, lanes, n, device
        self.rows, self.alphabet = freq_shape
        self.scalars, self.tables = scalars, tables  # the kernel's before / after num_words
        self.search = 1 << (self.alphabet - 1).bit_length()

    def enqueue(
        self, words: torch.Tensor, lengths: torch.Tensor, freq: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queue the decode without waiting for it: returns ``(out, lengths64, bad)``, the
        symbols ``[lanes, n]``, the lengths as int64 and 1 where a lane's stream is
        inconsistent (nothing is checked yet; with no words nothing is launched)."""
        device, lanes, last = self.device, self.lanes, self.alphabet - 1
        lengths64 = lengths.to(torch.int64)
        starts = lengths64.cumsum(0)
        starts -= lengths64  # [lanes]: where each lane's stream starts in words
        # cum_hi[a] = freq[0] + ... + freq[a], its last real entry and the padding PROB_SCALE
        shape = (self.rows, self.search)  # [lanes * g, SEARCH]
        cum_hi = torch.full(shape, PROB_SCALE, dtype=torch.int32, device=device)
        torch.cumsum(freq[:, :last], 1, dtype=torch.int32, out=cum_hi[:, :last])
        out = torch.empty((lanes, self.n), dtype=torch.uint8, device=device)
        bad = torch.zeros(lanes, dtype=torch.int8, device=device)
        num_words = words.numel()
        if self.launch is not None and num_words:
            scalars, tables = self.scalars, self.tables
            self.launch(
                words, starts, lengths64, freq, cum_hi, out, bad, *scalars, num_words, *tables
            )
        return out, lengths64, bad

    def __call__(
        self, words: torch.Tensor, lengths: torch.Tensor, freq: torch.Tensor
    ) -> torch.Tensor:
        out, lengths64, bad = self.enqueue(words, lengths, freq)
        num_words = words.numel()
        bad_rows = bad_table_rows(freq)
        short = lengths64 < 2
        checks = [bad_rows.sum(), short.sum(), lengths64.sum(), bad.sum(dtype=torch.int64)]
        bad_row_count, short_count, total, bad_lane_count = torch.stack(checks).tolist()
        # ^ the one host sync
        if bad_row_count:
            raise_bad_table(bad_rows, freq)
        if short_count:
            raise_short_lanes(lengths64)
        if total != num_words:
            raise_length_mismatch(total, num_words)
        if bad_lane_count:
            raise_bad_streams(bad != 0)
        return out


def decode_plan(
    words: torch.Tensor,  # [num_words] int32/int64
    lengths: torch.Tensor,  # [lanes] int64/int32
    freq: torch.Tensor,  # [lanes * g, A] int32/int64
    n: int,
    tables_per_stream: int,  # g
    interpret: bool,
    kernel: LazyKernel,
    config: LaunchConfig | None = None,
) -> DecodePlan:
    """Build the plan of a decode for arguments shaped as these (already validated): check
    the placement, pick the launch config (``config``, else
    :func:`~kvtier_kernels.cachegen.rans.common.launch_config`), the grid, and bind
    ``kernel`` (every argument passed per call: the word count changes from call to call).

    Raises:
        ValueError: tensors this backend cannot reach, or an invalid ``config``.
    """
    device = words.device
    check_placement(device, interpret)
    lanes = len(lengths)
    rows, alphabet = freq.shape
    if not lanes:
        return DecodePlan(None, lanes, n, (rows, alphabet), device)
    out = torch.empty((lanes, n), dtype=torch.uint8, device=device)  # as a call makes it
    scalars = (words.stride(0), *freq.stride(), *out.stride(), lanes, n)
    tables = (tables_per_stream, max(1, n // tables_per_stream))  # G, segment
    search = 1 << (alphabet - 1).bit_length()
    args = (
        words,  # [num_words]
        torch.empty(lanes, dtype=torch.int64, device=device),  # starts
        lengths.to(torch.int64),  # the caller's own when int64 (its alignment is keyed)
        freq,  # [lanes * g, A]
        torch.empty((rows, search), dtype=torch.int32, device=device),  # cum_hi
        out,  # [lanes, n] uint8
        torch.empty(lanes, dtype=torch.int8, device=device),  # bad
        *scalars,
        words.numel(),
        *tables,
    )
    meta = {"LOG2_SEARCH": (alphabet - 1).bit_length()}
    launch = _bind_kernel(kernel, lanes, device, interpret, config, args, meta, None)
    return DecodePlan(launch, lanes, n, (rows, alphabet), device, scalars, tables)
