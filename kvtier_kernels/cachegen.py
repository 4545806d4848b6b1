"""CacheGen-style KV compression: the CPU reference codec that defines the bitstream.

A chunk in the canonical layout ``KV_2LTD`` (``[2, num_layers, num_tokens, hidden]``,
bf16/fp16/fp32) is quantized per token and entropy-coded with lane-parallel rANS::

    scale[kv, l, t]   = max_d |x[kv, l, t, d]|                  (float32, absmax per token)
    n                 = levels[kv][l]                            (1..127, "levels_half")
    step              = scale / n                                (float32)
    q[kv, l, t, d]    = clamp(round(x / step), -n, n)            symbol = q + n in [0, 2n]
    x_hat             = (symbol - n) * step                      (float32, then out's dtype)

Error bound (what :func:`decode_chunk` guarantees for an object :func:`encode_chunk` made
from finite input; fp32 arithmetic, so a slack of ``2**-20 * scale`` covers its
roundings)::

    |x - x_hat| <= scale / (2 n) + 2**-20 * scale               (out is float32)
    ... plus u * scale, u = 2**-8 (bf16) or 2**-11 (fp16)        (rounding to out's dtype)

Statistics: each lane is one ``(kv, layer, channel)`` stream of ``num_tokens`` symbols;
its histogram (counts, summing to ``num_tokens``) is stored and turned into frequencies
summing to ``1 << PROB_BITS`` by :func:`quantize_counts` (every used symbol gets >= 1), so
encoder and decoder derive the same table from the same integers.

Entropy coding: rANS, 32-bit state in ``[2**16, 2**32)``, 16-bit renormalization, 16-bit
probabilities; at most one word is emitted per symbol. Lanes are independent: the coder is
the kernel registry's ``rans_encode``/``rans_decode`` (op files
:mod:`kvtier_kernels.rans_encode` / :mod:`kvtier_kernels.rans_decode`, the bitstream in
:mod:`kvtier_kernels.rans`), whose ``torch`` backend is a numpy reference (vectorized across
lanes, a loop over the symbols of a lane), and whose ``triton`` backend (one GPU thread per
lane) and ``numba`` backend (compiled CPU loops, lanes across threads) produce the same
bytes. A lane's stream is its final encoder state (low word, high word) followed by the
renormalization words in the order the decoder reads them; a decoded lane must end in the
initial state ``2**16`` having read exactly its words, which catches most damage.

Quantization, statistics and dequantization are torch code that runs on the chunk's
device with integer or correctly rounded fp32 arithmetic, so a GPU encode gives the bytes
a CPU encode gives. With the ``numba`` coder (``auto`` on a CPU where numba is installed)
they run as numba kernels instead (:mod:`kvtier_kernels.cachegen_numba`), with the same
arithmetic and results.

Payload, version 2 (little-endian; each section zero-padded to a multiple of 4 bytes;
``lanes = 2 * num_layers * hidden``, lane index ``(kv * num_layers + l) * hidden + d``)::

    section   contents                                        dtype
    scales    scale[kv, l, t]                                 float32 [2, L, T]
    bounds    (lo, hi): the used symbol range of each lane   uint8   [lanes, 2]
    counts    counts[lo..hi] of each lane with lo < hi,       uint8 if T <= 256, uint16 if
              lanes in order (a lane with lo == hi stores     T <= 65536, else uint32
              nothing: its one symbol occurs T times)
    lengths   words in each lane's stream                     uint16 if T + 2 < 65536,
                                                              else uint32 [lanes]
    words     the lanes' streams concatenated                 uint16

Size, for scale: at 256 tokens a lane of 8-level codes costs ~100 bytes of words and
~12-17 bytes of counts, bounds and length; the scales cost 4 bytes per token per layer
per plane.

Params (CBOR-encodable, small — the bulk lives in the payload because the wire header is
capped at 1 MiB): ``version``, ``shape``, ``prob_bits``, ``k_levels``/``v_levels`` (one
int per layer), ``sections`` (the five padded byte lengths) and ``crc`` (CRC-32 of the
params and the payload: defense in depth — the wire format checksums too). The decoder
checks all of it and raises :class:`CodecError` (a ``ValueError``) on anything
inconsistent, before it writes ``out``. Version 1 (every lane's counts stored, uint8 only
below 256 tokens) is not read: a stored object of it is a miss.

Bytes moved: the chunk is read once to quantize, the symbols once per pass (histogram,
encode); the output is the payload. Measured figures: ``perf/test_bench_compression.py``
and docs/compression.md.
"""

from __future__ import annotations

import json
import zlib
from typing import Any

import numpy as np
import torch

from kvtier_kernels import cachegen_numba, registry
from kvtier_kernels.rans import PROB_BITS, PROB_SCALE, CodecError
from kvtier_kernels.rans_decode import rans_decode_lanes
from kvtier_kernels.rans_encode import rans_encode_lanes

VERSION = 2
MAX_LEVELS = 127  # alphabet 2n+1 <= 255 fits the uint8 symbols and bounds
SECTIONS = ("scales", "bounds", "counts", "lengths", "words")
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

__all__ = [
    "CodecError",
    "decode_chunk",
    "default_levels",
    "encode_chunk",
    "params_checksum",
    "quantize_counts",
]

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


def _check_levels(levels: Any, num_layers: int, what: str, error: type[Exception]) -> list[int]:
    if not isinstance(levels, list | tuple) or len(levels) != num_layers:
        raise error(f"{what} must be a list of {num_layers} ints (one per layer)")
    for layer, n in enumerate(levels):
        if type(n) is not int or not 1 <= n <= MAX_LEVELS:
            raise error(f"{what}[{layer}] = {n!r}: levels must be an int in 1..{MAX_LEVELS}")
    return list(levels)


# ---------------------------------------------------------------------------------------
# statistics
# ---------------------------------------------------------------------------------------


def quantize_counts(counts: np.ndarray | torch.Tensor) -> np.ndarray | torch.Tensor:
    """Frequencies summing to ``PROB_SCALE`` from ``counts`` ``[lanes, A]`` (each row a
    histogram with a positive total, ``A <= 255``): proportional, floored, every used
    symbol at least 1, the rounding remainder given to the most frequent symbol (first on
    ties). Integer arithmetic only, so every device gives the same table. Returns uint32
    ``[lanes, A]`` for a numpy ``counts``, int64 on ``counts``' device for a tensor; a
    symbol has frequency 0 iff its count is 0."""
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


# ---------------------------------------------------------------------------------------
# container
# ---------------------------------------------------------------------------------------


def _count_dtype(num_tokens: int) -> np.dtype:
    """Stored counts: a lane with one symbol stores none (its count is ``num_tokens``), so
    every stored count is below ``num_tokens``."""
    dtype = np.uint8 if num_tokens <= 256 else np.uint16 if num_tokens <= 65536 else np.uint32
    return np.dtype(dtype).newbyteorder("<")


def _length_dtype(num_tokens: int) -> np.dtype:
    return np.dtype(np.uint16 if num_tokens + 2 < 65536 else np.uint32).newbyteorder("<")


def _padded(data: bytes) -> bytes:
    return data + b"\0" * (-len(data) % 4)


def _padded_len(nbytes: int) -> int:
    return nbytes + (-nbytes % 4)


def params_checksum(params: dict[str, Any], payload: bytes | memoryview) -> int:
    """The ``crc`` of ``params`` (every field but ``crc``, as sorted JSON) and ``payload``."""
    fields = {k: v for k, v in params.items() if k != "crc"}
    head = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
    return zlib.crc32(payload, zlib.crc32(head))


def _levels(k_levels: list[int], v_levels: list[int], device: torch.device) -> torch.Tensor:
    """levels_half of each (plane, layer) as float32 ``[2, L, 1]``."""
    return torch.tensor([k_levels, v_levels], dtype=torch.float32, device=device)[:, :, None]


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
    count_dtype: np.dtype,
) -> tuple[np.ndarray, torch.Tensor, torch.Tensor, np.ndarray, np.ndarray]:
    """Quantization and tables in torch on ``chunk``'s device: ``(scale, symbols, freq,
    bounds, stored)`` as :func:`kvtier_kernels.cachegen_numba.encode_statistics` returns
    them (``symbols`` and ``freq`` on ``chunk``'s device).

    Raises:
        ValueError: non-finite values.
    """
    num_tokens = chunk.shape[2]
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

    counts = _histogram(symbols, alphabet)
    used = counts > 0
    lo = used.to(torch.uint8).argmax(dim=1)
    hi = alphabet - 1 - used.flip(1).to(torch.uint8).argmax(dim=1)
    return (
        scale.cpu().numpy(),
        symbols,
        quantize_counts(counts),
        torch.stack([lo, hi], dim=1).to(torch.uint8).cpu().numpy(),
        counts[_in_range(lo, hi, alphabet)].cpu().numpy().astype(count_dtype),
    )


def encode_chunk(
    chunk: torch.Tensor,
    k_levels: list[int] | None = None,
    v_levels: list[int] | None = None,
    *,
    backend: str = "auto",
) -> tuple[bytes, dict[str, Any]]:
    """Compress ``chunk`` ``[2, num_layers, num_tokens, hidden]`` (bf16/fp16/fp32, finite;
    ``num_tokens >= 1``). ``k_levels``/``v_levels``: levels_half per layer (1..127);
    default :func:`default_levels`. Deterministic: equal inputs give equal bytes, on any
    device and with any backend.

    The rANS coder is the kernel registry's ``rans_encode`` for ``backend`` (``torch`` is
    the numpy reference; ``auto`` picks Triton for a GPU chunk, else numba where it is
    installed). Quantization and statistics run in torch on ``chunk``'s device, or, when
    the coder is numba, as numba kernels (:mod:`kvtier_kernels.cachegen_numba`).

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
    k_levels = _check_levels(
        default_k if k_levels is None else k_levels, num_layers, "k_levels", ValueError
    )
    v_levels = _check_levels(
        default_v if v_levels is None else v_levels, num_layers, "v_levels", ValueError
    )

    alphabet = 2 * max(k_levels + v_levels) + 1
    count_dtype = _count_dtype(num_tokens)
    on_cpu = registry.pick("rans_encode", backend, chunk.device) == "numba"
    statistics = cachegen_numba.encode_statistics if on_cpu else _encode_statistics
    scale, symbols, freq, bounds, stored = statistics(
        chunk, k_levels, v_levels, alphabet, count_dtype
    )
    words, lengths = rans_encode_lanes(symbols, freq, backend=backend)

    sections = [
        scale.astype("<f4").tobytes(),
        bounds.tobytes(),
        stored.tobytes(),
        lengths.cpu().numpy().astype(_length_dtype(num_tokens)).tobytes(),
        words.cpu().numpy().astype("<u2").tobytes(),
    ]
    sections = [_padded(bytes(s)) for s in sections]
    payload = b"".join(sections)
    params: dict[str, Any] = {
        "version": VERSION,
        "shape": [2, num_layers, num_tokens, hidden],
        "prob_bits": PROB_BITS,
        "k_levels": k_levels,
        "v_levels": v_levels,
        "sections": [len(s) for s in sections],
    }
    params["crc"] = params_checksum(params, payload)
    return payload, params


def decode_chunk(
    payload: bytes | memoryview,
    params: dict[str, Any],
    out: torch.Tensor,
    *,
    backend: str = "auto",
    device: torch.device | str | None = None,
) -> None:
    """Fill ``out`` (``[2, L, T, D]`` as in ``params``, bf16/fp16/fp32, contiguous, any
    device) from what :func:`encode_chunk` made. ``out`` is written only once everything
    checked. The rANS decoder is the registry's ``rans_decode`` for ``backend``; it and
    the dequantization run on ``device`` (default ``out``'s), or, when the decoder is
    numba, on the CPU as numba kernels (:mod:`kvtier_kernels.cachegen_numba`).

    Raises:
        CodecError: the params, the payload or ``out`` disagree with each other or with the
            bitstream (wrong version, shape, levels, section sizes, CRC, tables, streams).
    """
    if not isinstance(params, dict):
        raise CodecError(f"params must be a map, got {type(params).__name__}")
    expected = {"version", "shape", "prob_bits", "k_levels", "v_levels", "sections", "crc"}
    if set(params) != expected:
        raise CodecError(f"params have keys {sorted(params)}, expected {sorted(expected)}")
    if params["version"] != VERSION or params["prob_bits"] != PROB_BITS:
        raise CodecError(
            f"unsupported version/prob_bits {params['version']!r}/{params['prob_bits']!r} "
            f"(this decoder reads version {VERSION}, prob_bits {PROB_BITS})"
        )
    shape = params["shape"]
    if not isinstance(shape, list) or len(shape) != 4 or any(type(s) is not int for s in shape):
        raise CodecError(f"params shape {shape!r} is not four ints")
    if shape[0] != 2 or min(shape) < 1:
        raise CodecError(f"params shape {shape} is not a non-empty [2, L, T, D]")
    if list(out.shape) != shape:
        raise CodecError(f"out has shape {list(out.shape)}, the params say {shape}")
    if out.dtype not in FLOAT_DTYPES or not out.is_contiguous():
        raise CodecError(f"out must be a contiguous tensor of {FLOAT_DTYPES}, got {out.dtype}")
    _, num_layers, num_tokens, hidden = shape
    k_levels = _check_levels(params["k_levels"], num_layers, "k_levels", CodecError)
    v_levels = _check_levels(params["v_levels"], num_layers, "v_levels", CodecError)
    sizes = params["sections"]
    if (
        not isinstance(sizes, list)
        or len(sizes) != len(SECTIONS)
        or any(type(s) is not int or s < 0 for s in sizes)
    ):
        raise CodecError(f"params sections {sizes!r} is not {len(SECTIONS)} byte lengths")
    if sum(sizes) != len(payload):
        raise CodecError(f"payload is {len(payload)} bytes, the sections add up to {sum(sizes)}")
    if params["crc"] != params_checksum(params, payload):
        raise CodecError("CRC mismatch: the params or the payload are damaged")

    lanes = 2 * num_layers * hidden
    count_dtype, length_dtype = _count_dtype(num_tokens), _length_dtype(num_tokens)
    fixed = {
        "scales": _padded_len(2 * num_layers * num_tokens * 4),
        "bounds": _padded_len(lanes * 2),
        "lengths": _padded_len(lanes * length_dtype.itemsize),
    }
    for name, size in zip(SECTIONS, sizes, strict=True):
        if name in fixed and size != fixed[name]:
            raise CodecError(f"section {name} is {size} bytes, the shape needs {fixed[name]}")
    offsets = dict(zip(SECTIONS, np.cumsum([0, *sizes[:-1]]).tolist(), strict=True))
    buffer = memoryview(payload).cast("B") if isinstance(payload, memoryview) else payload

    def section(name: str, dtype: np.dtype, count: int) -> np.ndarray:
        if count * dtype.itemsize > sizes[SECTIONS.index(name)]:
            raise CodecError(f"section {name} is too short for {count} entries")
        return np.frombuffer(buffer, dtype=dtype, count=count, offset=offsets[name])

    scale = section("scales", np.dtype("<f4"), 2 * num_layers * num_tokens).astype(np.float32)
    if not np.isfinite(scale).all() or (scale < 0).any():
        raise CodecError("scales must be finite and non-negative")
    bounds = section("bounds", np.dtype(np.uint8), lanes * 2).reshape(lanes, 2).copy()
    lo, hi = (bounds[:, i].astype(np.int64) for i in (0, 1))
    lane_levels = np.repeat(np.array(k_levels + v_levels, dtype=np.int64), hidden)
    if (lo > hi).any() or (hi > 2 * lane_levels).any():
        raise CodecError("a lane's symbol range is empty or outside its layer's alphabet")
    alphabet = 2 * max(k_levels + v_levels) + 1
    num_stored = int(np.where(hi > lo, hi - lo + 1, 0).sum())
    if _padded_len(num_stored * count_dtype.itemsize) != sizes[SECTIONS.index("counts")]:
        raise CodecError("section counts does not match the lanes' symbol ranges")
    stored = section("counts", count_dtype, num_stored).copy()
    dev = out.device if device is None else torch.device(device)
    on_cpu = registry.pick("rans_decode", backend, dev) == "numba"
    if on_cpu:
        counts, freq = cachegen_numba.decode_tables(bounds, stored, num_tokens, alphabet)
    else:
        counts = _stored_histograms(lo, hi, stored, num_tokens, alphabet).to(dev)
        freq = quantize_counts(counts)
    lengths = section("lengths", length_dtype, lanes).astype(np.int64)
    total_words = int(lengths.sum())
    if _padded_len(total_words * 2) != sizes[SECTIONS.index("words")]:
        raise CodecError("section words does not match the lane lengths")
    words = section("words", np.dtype("<u2"), total_words).astype(np.int32)

    symbols = rans_decode_lanes(
        torch.from_numpy(words).to(dev),
        torch.from_numpy(lengths).to(dev),
        freq,
        num_tokens,
        backend=backend,
    )
    if on_cpu:
        cachegen_numba.dequantize(symbols, counts, scale, k_levels, v_levels, out)
        return
    if not torch.equal(_histogram(symbols, alphabet), counts):
        raise CodecError("decoded symbols disagree with the stored histograms")
    levels = _levels(k_levels, v_levels, dev)
    step = torch.from_numpy(scale).to(dev).view(2, num_layers, num_tokens) / levels
    codes = symbols.view(2, num_layers, hidden, num_tokens).permute(0, 1, 3, 2)
    x_hat = (codes.to(torch.float32) - levels[..., None]) * step[..., None]
    out.copy_(x_hat)


def _stored_histograms(
    lo: np.ndarray, hi: np.ndarray, stored: np.ndarray, num_tokens: int, alphabet: int
) -> torch.Tensor:
    """Each lane's histogram int64 ``[lanes, alphabet]`` (CPU) from its bounds and the
    stored counts, as :func:`kvtier_kernels.cachegen_numba.decode_tables` builds it.

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
