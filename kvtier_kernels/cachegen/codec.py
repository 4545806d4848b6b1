"""CacheGen-style KV compression: the CPU reference codec that defines the bitstream.

A ``KV_2LTD`` chunk is quantized per token (absmax scale, per-layer levels) and each
``(kv, layer, channel)`` lane of symbols is entropy-coded with rANS
(:mod:`kvtier_kernels.cachegen.rans`) under a per-lane frequency table
(:mod:`kvtier_kernels.cachegen.tables`); the payload's sections are checked by
:mod:`kvtier_kernels.cachegen.format`. The scheme, its error bound and the bitstream
(versions 5 down to 2) are specified in docs/compression.md, and only there.

Quantization, statistics and dequantization are torch code with integer or correctly
rounded fp32 arithmetic, so a GPU encode gives the bytes a CPU encode gives; the numba
kernels (:mod:`kvtier_kernels.cachegen.numba_kernels`) run the same arithmetic on a CPU,
and where numba fails to import or to compile them the torch code runs instead (one
warning per direction, see :class:`~kvtier_kernels._launch.NumbaKernel`).
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
import torch

from kvtier_kernels import registry
from kvtier_kernels._launch import NumbaUnavailable
from kvtier_kernels.cachegen import numba_kernels
from kvtier_kernels.cachegen.format import (
    MODELS,
    Container,
    check_levels,
    check_models,
    count_dtype,
    lanes_per_stream,
    make_params,
    model_lane_levels,
    pack,
    padded,
    read_container,
)
from kvtier_kernels.cachegen.rans import CodecError, rans_decode_lanes, rans_encode_lanes
from kvtier_kernels.cachegen.tables import (
    GAUSSIAN_MAX_TOKENS,
    GaussianCodebook,
    choose_gaussian,
    coding_cost,
    entropy_cost,
    gaussian_codebook,
    gaussian_freq,
    gaussian_models,
    lane_models,
    quantize_counts,
)

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

__all__ = ["FLOAT_DTYPES", "Statistics", "decode_chunk", "default_levels", "encode_chunk"]

# ---------------------------------------------------------------------------------------
# schedule
# ---------------------------------------------------------------------------------------


def default_levels(num_layers: int) -> tuple[list[int], list[int]]:
    """The default ``(k_levels, v_levels)``: levels_half per layer, from the layer count.

    Early layers get more levels (their errors propagate through every later layer):
    keys 16 for the first third of the layers, 8 after; values 16 for the first sixth,
    8 after (values tolerate coarser codes than keys). At least one layer is "early".
    """
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    k_early = max(1, num_layers // 3)
    v_early = max(1, num_layers // 6)
    k_levels = [16 if layer < k_early else 8 for layer in range(num_layers)]
    v_levels = [16 if layer < v_early else 8 for layer in range(num_layers)]
    return k_levels, v_levels


# ---------------------------------------------------------------------------------------
# quantization and statistics (torch, on the chunk's device)
# ---------------------------------------------------------------------------------------

Statistics = tuple[np.ndarray, torch.Tensor, torch.Tensor, str, list[np.ndarray]]
"""What the encoder's first steps return: ``(scale, symbols, freq, model, tables)``:
float32 ``[2, L, T]`` scales, uint8 ``[lanes, T]`` symbols and int64 ``[lanes, A]``
frequency tables (tensors), the model's name and its payload sections as arrays
(``histogram``: bounds, stored counts; ``gaussian``: models)."""


def _levels(k_levels: list[int], v_levels: list[int], device: torch.device) -> torch.Tensor:
    """levels_half of each (plane, layer) as float32 ``[2, L, 1]``."""
    return torch.tensor([k_levels, v_levels], dtype=torch.float32, device=device)[:, :, None]


def _lane_levels(k_levels: list[int], v_levels: list[int], hidden: int) -> np.ndarray:
    """int64 ``[lanes]``: each lane's levels ``n``."""
    return np.repeat(np.array(k_levels + v_levels, dtype=np.int64), hidden)


def _histogram(symbols: torch.Tensor, alphabet: int) -> torch.Tensor:
    """Counts of each symbol per lane, int64 ``[lanes, alphabet]`` on ``symbols``' device."""
    lanes = symbols.shape[0]
    index = torch.arange(lanes, device=symbols.device)[:, None] * alphabet + symbols.long()
    return torch.bincount(index.reshape(-1), minlength=lanes * alphabet).view(lanes, alphabet)


def _in_range(lo: torch.Tensor, hi: torch.Tensor, alphabet: int) -> torch.Tensor:
    """``[lanes, alphabet]``: True where ``lo <= symbol <= hi`` and the lane has more than
    one symbol (a one-symbol lane's count is implied)."""
    columns = torch.arange(alphabet, device=lo.device)[None, :]
    return (columns >= lo[:, None]) & (columns <= hi[:, None]) & (hi > lo)[:, None]


def _encode_statistics(
    chunk: torch.Tensor,  # [2, L, T, D]
    k_levels: list[int],
    v_levels: list[int],
    alphabet: int,
    counts_dtype: np.dtype,
    model: str | None,
) -> Statistics:
    """Quantization and tables in torch on ``chunk``'s device, as
    :func:`~kvtier_kernels.cachegen.numba_kernels.encode_statistics` computes them; ``model``
    is the statistics model to use, None for the smaller.

    Raises:
        ValueError: non-finite values.
    """
    _, _, num_tokens, hidden = chunk.shape
    x = chunk.detach().to(torch.float32)
    if not bool(torch.isfinite(x).all()):
        raise ValueError("chunk holds non-finite values (inf/nan), which cannot be quantized")
    levels = _levels(k_levels, v_levels, x.device)
    scale = x.abs().amax(dim=-1)  # [2, L, T]
    step = scale / levels
    safe = torch.where(step > 0, step, torch.ones_like(step))[..., None]
    q = torch.round(x / safe)
    q = torch.minimum(torch.maximum(q, -levels[..., None]), levels[..., None])
    symbols = (q + levels[..., None]).to(torch.uint8)  # [2, L, T, D]
    symbols = symbols.permute(0, 1, 3, 2).reshape(-1, num_tokens).contiguous()  # [lanes, T]
    scale_np = scale.cpu().numpy()

    counts = _histogram(symbols, alphabet)
    used = counts > 0
    lo = used.to(torch.uint8).argmax(dim=1)
    hi = alphabet - 1 - used.flip(1).to(torch.uint8).argmax(dim=1)
    stored = _in_range(lo, hi, alphabet)
    if model != "histogram" and num_tokens <= GAUSSIAN_MAX_TOKENS:
        lane_levels = torch.from_numpy(_lane_levels(k_levels, v_levels, hidden)).to(x.device)
        models = gaussian_models(counts, num_tokens)
        codebook = gaussian_codebook(tuple(sorted(set(k_levels + v_levels))), alphabet)
        gaussian = gaussian_freq(models, lane_levels, codebook)
        if model is None:  # the smaller, estimated
            costs = [stored.sum(), entropy_cost(counts, num_tokens), coding_cost(counts, gaussian)]
            num_stored, entropy, gaussian_cost = torch.stack(costs).tolist()
            histogram_bytes = 2 * len(counts) + num_stored * counts_dtype.itemsize
            smaller = choose_gaussian(entropy, histogram_bytes, gaussian_cost, 2 * len(counts))
            model = "gaussian" if smaller else "histogram"
        if model == "gaussian":
            return scale_np, symbols, gaussian, "gaussian", [models.cpu().numpy()]
    bounds = torch.stack([lo, hi], dim=1).to(torch.uint8).cpu().numpy()
    return (
        scale_np,
        symbols,
        quantize_counts(counts),
        "histogram",
        [bounds, counts[stored].cpu().numpy().astype(counts_dtype)],
    )


# ---------------------------------------------------------------------------------------
# encode
# ---------------------------------------------------------------------------------------


def _stored_scales(scale: np.ndarray, dtype: torch.dtype) -> tuple[str, bytes]:
    """The scales' bit patterns in the chunk's dtype, where each is exact (an absmax of its
    values), packed: non-negative floats, so a pattern grows with the value."""
    if dtype == torch.bfloat16:
        return "bfloat16", pack(scale.view(np.uint32) >> 16)
    if dtype == torch.float16:
        return "float16", pack(scale.astype("<f2").view("<u2"))
    return "float32", pack(scale.astype("<f4").view("<u4"))


def _model_codebook(levels: np.ndarray) -> GaussianCodebook:
    alphabet = 2 * int(levels.max()) + 1
    return gaussian_codebook(tuple(sorted(set(levels.tolist()))), alphabet)


def _cpu_backend(backend: str) -> str:
    """The backend that codes the model lanes, which are on the CPU."""
    return backend if backend in ("torch", "numba", "interpret") else "auto"


def _coded_models(
    models: np.ndarray, k_levels: list[int], v_levels: list[int], hidden: int, backend: str
) -> bytes:
    """Version 5's models section: each model lane is coded as the chunk's lanes are, with
    a Gaussian model of its own (stored as two bytes), in streams of
    :func:`lanes_per_stream` lanes; then the streams' lengths, packed, then their words."""
    levels = model_lane_levels(k_levels, v_levels)
    lanes = np.ascontiguousarray(models.T).reshape(len(levels), hidden)  # [4 * L, D]
    meta = lane_models(lanes)
    freq = torch.from_numpy(_model_codebook(levels).freq(meta, levels))
    group = lanes_per_stream(len(lanes), hidden)
    streams = torch.from_numpy(lanes).view(len(lanes) // group, group * hidden)
    words, lengths = rans_encode_lanes(
        streams, freq, _cpu_backend(backend), tables_per_stream=group
    )
    return (
        padded(meta.tobytes())
        + pack(lengths.numpy())
        + padded(words.numpy().astype("<u2").tobytes())
    )


def _decoded_models(container: Container, backend: str) -> np.ndarray:
    """uint8 ``[lanes, 2]``: the lanes' Gaussian models from version 5's models section.

    Raises:
        CodecError: the section is inconsistent, or its streams do not give back the
            models stored for them.
    """
    meta, lengths, words = container.coded_models()
    levels = container.model_lane_levels
    group = lanes_per_stream(len(meta), container.hidden)
    lanes = rans_decode_lanes(
        torch.from_numpy(words),
        torch.from_numpy(lengths),
        torch.from_numpy(_model_codebook(levels).freq(meta, levels)),
        group * container.hidden,
        _cpu_backend(backend),
        tables_per_stream=group,
    ).numpy()
    lanes = lanes.reshape(len(meta), container.hidden)
    if not np.array_equal(lane_models(lanes), meta):
        raise CodecError("decoded models disagree with their stored Gaussian models")
    return check_models(lanes.reshape(2, -1).T.astype(np.int64), container.lane_levels)


def encode_chunk(
    chunk: torch.Tensor,
    k_levels: list[int] | None = None,
    v_levels: list[int] | None = None,
    *,
    backend: str = "auto",
    model: str | None = None,
) -> tuple[bytes, dict[str, Any]]:
    """Compress ``chunk`` ``[2, num_layers, num_tokens, hidden]`` (bf16/fp16/fp32, finite;
    ``num_tokens >= 1``). ``k_levels``/``v_levels``: levels_half per layer (1..127);
    default :func:`default_levels`. ``model``: the statistics model, ``histogram`` or
    ``gaussian`` (at most ``GAUSSIAN_MAX_TOKENS`` tokens); None (default) writes whichever
    is estimated smaller. Deterministic: equal inputs give equal bytes, on any device and
    with any backend.

    The rANS coder is the kernel registry's ``rans_encode`` for ``backend`` (``torch`` is
    the numpy reference; ``auto`` picks Triton for a GPU chunk, else numba where it is
    installed). Quantization and statistics run in torch on ``chunk``'s device, or, when
    the coder is numba, as numba kernels (:mod:`kvtier_kernels.cachegen.numba_kernels`).

    Returns ``(payload, params)``, see the module docstring.

    Raises:
        ValueError: wrong shape, dtype, levels, or non-finite values.
    """
    if chunk.dim() != 4 or chunk.shape[0] != 2:
        raise ValueError(
            f"chunk must be [2, num_layers, num_tokens, hidden] (KV_2LTD), got {list(chunk.shape)}"
        )
    if chunk.dtype not in FLOAT_DTYPES:
        raise ValueError(f"chunk dtype must be one of {FLOAT_DTYPES}, got {chunk.dtype}")
    _, num_layers, num_tokens, hidden = chunk.shape
    if num_layers < 1 or num_tokens < 1 or hidden < 1:
        raise ValueError(
            f"chunk must have at least one layer, token and channel: {list(chunk.shape)}"
        )
    default_k, default_v = default_levels(num_layers)
    k_levels = check_levels(
        default_k if k_levels is None else k_levels, num_layers, "k_levels", ValueError
    )
    v_levels = check_levels(
        default_v if v_levels is None else v_levels, num_layers, "v_levels", ValueError
    )

    if model not in (None, *MODELS) or (model == "gaussian" and num_tokens > GAUSSIAN_MAX_TOKENS):
        raise ValueError(
            f"model {model!r}: expected None or one of {sorted(MODELS)} (gaussian: at most "
            f"{GAUSSIAN_MAX_TOKENS} tokens, the chunk has {num_tokens})"
        )

    alphabet = 2 * max(k_levels + v_levels) + 1
    args = (chunk, k_levels, v_levels, alphabet, count_dtype(num_tokens), model)
    statistics = None
    if registry.pick("rans_encode", backend, chunk.device) == "numba":
        with contextlib.suppress(NumbaUnavailable):  # logged once; the torch code below
            statistics = numba_kernels.encode_statistics(*args)
    scale, symbols, freq, model, tables = statistics or _encode_statistics(*args)
    group = lanes_per_stream(len(symbols), num_tokens)
    streams = symbols.view(len(symbols) // group, group * num_tokens)
    words, lengths = rans_encode_lanes(streams, freq, backend, tables_per_stream=group)

    scale_name, scales = _stored_scales(scale, chunk.dtype)
    if model == "gaussian":
        stored = [_coded_models(tables[0], k_levels, v_levels, hidden, backend)]
    else:
        stored = [padded(table.tobytes()) for table in tables]
    sections = [
        scales,
        *stored,
        pack(lengths.cpu().numpy()),
        padded(words.cpu().numpy().astype("<u2").tobytes()),
    ]
    shape = [2, num_layers, num_tokens, hidden]
    return make_params(shape, k_levels, v_levels, model, scale_name, sections)


# ---------------------------------------------------------------------------------------
# decode
# ---------------------------------------------------------------------------------------


def decode_chunk(
    payload: bytes | memoryview,
    params: dict[str, Any],
    out: torch.Tensor,
    *,
    backend: str = "auto",
    device: torch.device | str | None = None,
) -> None:
    """Fill ``out`` (``[2, L, T, D]`` as in ``params``, bf16/fp16/fp32, contiguous, any
    device) from what :func:`encode_chunk` made (bitstream version 2, 3 or 4). ``out`` is
    written only once everything checked. The rANS decoder is the registry's
    ``rans_decode`` for ``backend``; it and the dequantization run on ``device`` (default
    ``out``'s), or, when the decoder is numba, on the CPU as numba kernels
    (:mod:`kvtier_kernels.cachegen.numba_kernels`).

    Raises:
        CodecError: the params, the payload or ``out`` disagree with each other or with the
            bitstream (wrong version, shape, levels, section sizes, CRC, tables, streams).
    """
    if not isinstance(params, dict):
        raise CodecError(f"params must be a map, got {type(params).__name__}")
    container = read_container(params, payload, list(out.shape))
    if out.dtype not in FLOAT_DTYPES or not out.is_contiguous():
        raise CodecError(f"out must be a contiguous tensor of {FLOAT_DTYPES}, got {out.dtype}")
    num_tokens = container.num_tokens
    k_levels, v_levels = container.k_levels, container.v_levels
    alphabet = 2 * max(k_levels + v_levels) + 1
    scale = container.scales()
    dev = out.device if device is None else torch.device(device)
    on_cpu = registry.pick("rans_decode", backend, dev) == "numba"
    if container.model == "histogram":
        bounds, stored = container.histogram_tables()
        if on_cpu:
            try:
                expected, freq = numba_kernels.histogram_tables(
                    bounds, stored, num_tokens, alphabet
                )
            except NumbaUnavailable:  # logged once; from here on the torch code
                on_cpu = False
        if not on_cpu:
            lo, hi = (bounds[:, i].astype(np.int64) for i in (0, 1))
            expected = _stored_histograms(lo, hi, stored, num_tokens, alphabet).to(dev)
            freq = quantize_counts(expected)
    else:
        if container.version >= 5:
            expected = _decoded_models(container, backend)
        else:
            expected = container.gaussian_models()
        codebook = gaussian_codebook(tuple(sorted(set(k_levels + v_levels))), alphabet)
        if on_cpu:
            freq = torch.from_numpy(codebook.freq(expected, container.lane_levels))
        else:
            expected = torch.from_numpy(expected).to(dev)
            lane_levels = torch.from_numpy(container.lane_levels).to(dev)
            freq = gaussian_freq(expected, lane_levels, codebook)
    lengths, words = container.streams()
    group = container.lanes_per_stream
    symbols = rans_decode_lanes(
        torch.from_numpy(words).to(dev),
        torch.from_numpy(lengths).to(dev),
        freq,
        group * num_tokens,
        backend,
        tables_per_stream=group,
    ).view(container.lanes, num_tokens)
    if on_cpu:
        try:
            numba_kernels.dequantize(
                symbols, container.model, expected, scale, k_levels, v_levels, out
            )
            return
        except NumbaUnavailable:  # logged once; out is untouched
            expected = torch.from_numpy(expected).to(dev)
    decoded = _histogram(symbols, alphabet)
    if container.model == "gaussian":
        decoded = gaussian_models(decoded, num_tokens)
    if not torch.equal(decoded, expected):
        raise CodecError(f"decoded symbols disagree with the stored {container.model} model")
    num_layers, hidden = container.num_layers, container.hidden
    levels = _levels(k_levels, v_levels, dev)
    step = torch.from_numpy(scale).to(dev).view(2, num_layers, num_tokens) / levels
    codes = symbols.view(2, num_layers, hidden, num_tokens).permute(0, 1, 3, 2)
    x_hat = (codes.to(torch.float32) - levels[..., None]) * step[..., None]
    top = torch.finfo(out.dtype).max  # n * (scale / n) may round above the dtype's largest
    out.copy_(x_hat.clamp_(-top, top))


def _stored_histograms(
    lo: np.ndarray, hi: np.ndarray, stored: np.ndarray, num_tokens: int, alphabet: int
) -> torch.Tensor:
    """Each lane's histogram int64 ``[lanes, alphabet]`` (CPU) from its bounds and the
    stored counts, as :func:`kvtier_kernels.cachegen.numba_kernels.histogram_tables` builds it.

    Raises:
        CodecError: a lane's histogram does not sum to ``num_tokens`` or is not tight.
    """
    lo_t, hi_t = torch.from_numpy(lo), torch.from_numpy(hi)
    counts = torch.zeros((len(lo), alphabet), dtype=torch.int64)
    counts[_in_range(lo_t, hi_t, alphabet)] = torch.from_numpy(stored.astype(np.int64))
    single = lo_t == hi_t
    counts[single, lo_t[single]] = num_tokens
    rows = torch.arange(len(lo))
    if (
        bool((counts.sum(dim=1) != num_tokens).any())
        or bool((counts[rows, lo_t] == 0).any())
        or bool((counts[rows, hi_t] == 0).any())
    ):
        raise CodecError("a lane's histogram does not sum to num_tokens or is not tight")
    return counts
