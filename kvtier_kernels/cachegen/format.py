"""The CacheGen bitstream's container: the params and the payload's sections, checked.

The format itself (every version, field by field) is documented in docs/compression.md.
This module builds the params of a version-5 object (:func:`make_params`) and its packed
sections (:func:`pack`), and, for the decoder, turns params + payload into a
:class:`Container` whose readers return each section as numpy arrays once its size, range
and consistency are checked (:func:`read_container`; versions 2 to 5). Anything wrong raises
:class:`~kvtier_kernels.cachegen.rans.CodecError` before the decoder writes any output.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtier_kernels.cachegen.rans.common import PROB_BITS, CodecError
from kvtier_kernels.cachegen.tables import GAUSSIAN_MAX_TOKENS, MAX_LEVELS, SPREADS

__all__ = [
    "MODELS",
    "MODEL_FIELDS",
    "MODEL_SPREAD_LEVELS",
    "SCALE_DTYPES",
    "STREAM_SYMBOLS",
    "VERSION",
    "Container",
    "check_levels",
    "check_models",
    "count_dtype",
    "lanes_per_stream",
    "make_params",
    "model_lane_levels",
    "pack",
    "padded",
    "params_checksum",
    "read_container",
]

VERSION = 5
MODELS = {
    "histogram": ("scales", "bounds", "counts", "lengths", "words"),
    "gaussian": ("scales", "models", "lengths", "words"),
}
"""Statistics model -> the payload's sections, in order."""
SCALE_DTYPES = {"float32": np.dtype("<f4"), "bfloat16": np.dtype("<u2"), "float16": np.dtype("<f2")}
"""How the scales are stored (bfloat16: the high 16 bits of the float32)."""
MODEL_FIELDS = ("model", "scale_dtype", "length_bytes")
"""The params version 3 adds to version 2's (versions 4 and 5 have the first two)."""
_KEYS = {2: {"version", "shape", "prob_bits", "k_levels", "v_levels", "sections", "crc"}}
_KEYS[3] = _KEYS[2] | set(MODEL_FIELDS)
_KEYS[4] = _KEYS[3] - {"length_bytes"}
_KEYS[5] = _KEYS[4] - {"prob_bits"}  # always PROB_BITS from version 5 on
_WIDTHS = {1: np.dtype("<u1"), 2: np.dtype("<u2"), 4: np.dtype("<u4")}
PACKED = ("scales", "models", "lengths")
"""The sections versions 4 and 5 store packed (:func:`pack`; version 5's models are coded,
see :meth:`Container.coded_models`)."""
_PACK_HEAD = 5  # width (uint8), then base (uint32)
_SCALE_BITS = {"float32": 32, "bfloat16": 16, "float16": 16}


MODEL_SPREAD_LEVELS = SPREADS // 2
"""Version 5 codes each lane's spread (0..63) as a symbol of this many levels (0..64)."""
STREAM_SYMBOLS = 1024
"""Version 5 codes several lanes in one rANS stream, up to this many symbols a stream."""


def lanes_per_stream(lanes: int, num_tokens: int) -> int:
    """Lanes coded in one rANS stream (version 5): the largest power of two that divides
    ``lanes`` and keeps a stream within ``STREAM_SYMBOLS`` symbols (at least 1). Each stream
    ends in a 32-bit state that carries about 3 bytes more than its symbols' information,
    and has its own length: with a lane a stream, 10% of a 64-token lane's bytes."""
    group = 1
    while lanes % (2 * group) == 0 and 2 * group * num_tokens <= STREAM_SYMBOLS:
        group *= 2
    return group


def model_lane_levels(k_levels: list[int], v_levels: list[int]) -> np.ndarray:
    """int64 ``[4 * L]``: the levels of version 5's model lanes, the centres of each
    (plane, layer)'s lanes, then their spreads (as symbols of ``MODEL_SPREAD_LEVELS``)."""
    levels = k_levels + v_levels
    return np.array(levels + [MODEL_SPREAD_LEVELS] * len(levels), dtype=np.int64)


def count_dtype(num_tokens: int) -> np.dtype:
    """Stored counts: a lane with one symbol stores none (its count is ``num_tokens``), so
    every stored count is below ``num_tokens``."""
    dtype = np.uint8 if num_tokens <= 256 else np.uint16 if num_tokens <= 65536 else np.uint32
    return np.dtype(dtype).newbyteorder("<")


def padded(data: bytes) -> bytes:
    return data + b"\0" * (-len(data) % 4)


def _padded_len(nbytes: int) -> int:
    return nbytes + (-nbytes % 4)


def pack(values: np.ndarray) -> bytes:
    """Non-negative integers (< 2**32) packed: the width ``w`` of ``max - min`` in bits
    (uint8), ``min`` (uint32), then each ``value - min`` in ``w`` bits, least significant
    first, the last byte padded with zero bits, then zero bytes to a multiple of 4."""
    values = np.asarray(values, dtype=np.int64).reshape(-1)
    base = int(values.min()) if values.size else 0
    width = (int(values.max()) - base).bit_length() if values.size else 0
    bits = ((values - base)[:, None] >> np.arange(width)) & 1
    head = np.array([width], "<u1").tobytes() + np.array([base], "<u4").tobytes()
    return padded(
        head + np.packbits(bits.astype(np.uint8).reshape(-1), bitorder="little").tobytes()
    )


def _unpack(buffer: Any, offset: int, size: int, count: int, max_bits: int) -> np.ndarray:
    """int64 ``[count]`` from the packed array at ``offset`` of a section of ``size`` bytes.

    Raises:
        CodecError: a width above ``max_bits``, values of ``max_bits`` or more bits, a
            section of another size, or padding bits set.
    """
    if size < _PACK_HEAD:
        raise CodecError("a packed section is shorter than its head")
    head = np.frombuffer(buffer, np.uint8, count=_PACK_HEAD, offset=offset)
    width, base = int(head[0]), int(head[1:].view("<u4")[0])
    nbytes = (count * width + 7) // 8
    if width > max_bits or _padded_len(_PACK_HEAD + nbytes) != size:
        raise CodecError(f"a packed section of width {width} for {count} values is {size} bytes")
    data = np.frombuffer(buffer, np.uint8, count=nbytes, offset=offset + _PACK_HEAD)
    bits = np.unpackbits(data, bitorder="little")
    if bits[count * width :].any():
        raise CodecError("a packed section has padding bits set")
    weights = np.left_shift(1, np.arange(width, dtype=np.int64))
    values = bits[: count * width].reshape(count, width).astype(np.int64) @ weights + base
    if count and int(values.max()) >> max_bits:
        raise CodecError(f"a packed section holds values of more than {max_bits} bits")
    return values


def params_checksum(params: dict[str, Any], payload: bytes | memoryview) -> int:
    """The ``crc`` of ``params`` (every field but ``crc``, as sorted JSON) and ``payload``."""
    fields = {k: v for k, v in params.items() if k != "crc"}
    head = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
    return zlib.crc32(payload, zlib.crc32(head))


def check_levels(levels: Any, num_layers: int, what: str, error: type[Exception]) -> list[int]:
    """``levels`` as a list of ``num_layers`` ints in ``1..MAX_LEVELS``, else ``error``."""
    if not isinstance(levels, list | tuple) or len(levels) != num_layers:
        raise error(f"{what} must be a list of {num_layers} ints (one per layer)")
    for layer, n in enumerate(levels):
        if type(n) is not int or not 1 <= n <= MAX_LEVELS:
            raise error(f"{what}[{layer}] = {n!r}: levels must be an int in 1..{MAX_LEVELS}")
    return list(levels)


def make_params(
    shape: list[int],
    k_levels: list[int],
    v_levels: list[int],
    model: str,
    scale_dtype: str,
    sections: list[bytes],
) -> tuple[bytes, dict[str, Any]]:
    """``(payload, params)`` of a version-5 object from its padded ``sections``."""
    payload = b"".join(sections)
    params: dict[str, Any] = {
        "version": VERSION,
        "shape": shape,
        "k_levels": k_levels,
        "v_levels": v_levels,
        "model": model,
        "scale_dtype": scale_dtype,
        "sections": [len(s) for s in sections],
    }
    params["crc"] = params_checksum(params, payload)
    return payload, params


@dataclass(frozen=True, slots=True)
class Container:
    """A checked object's layout and payload; each reader checks its section."""

    version: int
    model: str  # a key of MODELS
    num_layers: int
    num_tokens: int
    hidden: int
    k_levels: list[int]
    v_levels: list[int]
    scale_dtype: np.dtype
    length_dtype: np.dtype
    sizes: dict[str, int]  # section -> padded bytes
    offsets: dict[str, int]  # section -> where it starts in the payload
    buffer: Any  # the payload, bytes-like

    @property
    def lanes(self) -> int:
        return 2 * self.num_layers * self.hidden

    @property
    def lanes_per_stream(self) -> int:
        """Lanes coded in one rANS stream: 1 before version 5."""
        if self.version < 5:
            return 1
        return lanes_per_stream(self.lanes, self.num_tokens)

    @property
    def lane_levels(self) -> np.ndarray:
        """int64 ``[lanes]``: each lane's levels ``n``."""
        levels = np.array(self.k_levels + self.v_levels, dtype=np.int64)
        return np.repeat(levels, self.hidden)

    def section(self, name: str, dtype: np.dtype, count: int) -> np.ndarray:
        if count * dtype.itemsize > self.sizes[name]:
            raise CodecError(f"section {name} is too short for {count} entries")
        return np.frombuffer(self.buffer, dtype=dtype, count=count, offset=self.offsets[name])

    def packed(self, name: str, count: int, max_bits: int, skip: int = 0) -> np.ndarray:
        """int64 ``[count]``: the packed array at byte ``skip`` of section ``name``,
        which must end there (versions 4 and 5)."""
        offset, size = self.offsets[name] + skip, self.sizes[name] - skip
        return _unpack(self.buffer, offset, size, count, max_bits)

    def scales(self) -> np.ndarray:
        """float32 ``[2 * L * T]``, finite and non-negative."""
        count = 2 * self.num_layers * self.num_tokens
        if self.version >= 4:
            bits = 8 * self.scale_dtype.itemsize
            patterns = self.packed("scales", count, bits)
            stored = patterns.astype(f"<u{bits // 8}").view(self.scale_dtype)
        else:
            stored = self.section("scales", self.scale_dtype, count)
        if self.scale_dtype == SCALE_DTYPES["bfloat16"]:
            scale = (stored.astype(np.uint32) << 16).view(np.float32)
        else:
            scale = stored.astype(np.float32)
        if not np.isfinite(scale).all() or (scale < 0).any():
            raise CodecError("scales must be finite and non-negative")
        return scale

    def histogram_tables(self) -> tuple[np.ndarray, np.ndarray]:
        """``(bounds, stored)`` of the histogram model: uint8 ``[lanes, 2]`` with ``lo <= hi
        <= 2n`` per lane, and the stored counts, as many as the bounds say (their sums and
        tightness are checked where the histograms are built)."""
        bounds = self.section("bounds", np.dtype(np.uint8), self.lanes * 2)
        bounds = bounds.reshape(self.lanes, 2).copy()
        lo, hi = (bounds[:, i].astype(np.int64) for i in (0, 1))
        if (lo > hi).any() or (hi > 2 * self.lane_levels).any():
            raise CodecError("a lane's symbol range is empty or outside its layer's alphabet")
        num_stored = int(np.where(hi > lo, hi - lo + 1, 0).sum())
        counts = count_dtype(self.num_tokens)
        if _padded_len(num_stored * counts.itemsize) != self.sizes["counts"]:
            raise CodecError("section counts does not match the lanes' symbol ranges")
        return bounds, self.section("counts", counts, num_stored).copy()

    def _packed_at(self, name: str, skip: int, count: int, max_bits: int) -> tuple[np.ndarray, int]:
        """The packed array at byte ``skip`` of section ``name`` and the byte after it."""
        if skip >= self.sizes[name]:
            raise CodecError(f"section {name} is too short")
        offset = self.offsets[name] + skip
        head = np.frombuffer(self.buffer, np.uint8, count=1, offset=offset)
        size = _padded_len(_PACK_HEAD + (count * int(head[0]) + 7) // 8)
        if skip + size > self.sizes[name]:
            raise CodecError(f"section {name} is too short for its packed arrays")
        return _unpack(self.buffer, offset, size, count, max_bits), skip + size

    @property
    def model_lane_levels(self) -> np.ndarray:
        return model_lane_levels(self.k_levels, self.v_levels)

    def coded_models(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Version 5's models section: ``(models, lengths, words)``, the Gaussian models of
        the model lanes (uint8 ``[4 * L, 2]``, checked as :func:`check_models`), the
        lengths of their streams (int64) and the streams' words (int32)."""
        count = 4 * self.num_layers
        meta = self.section("models", np.dtype(np.uint8), 2 * count).reshape(count, 2)
        models = check_models(meta.astype(np.int64), self.model_lane_levels)
        streams = count // lanes_per_stream(count, self.hidden)
        lengths, end = self._packed_at("models", _padded_len(2 * count), streams, 32)
        total_words = int(lengths.sum())
        if end + _padded_len(2 * total_words) != self.sizes["models"]:
            raise CodecError("section models does not match its streams' lengths")
        words = np.frombuffer(
            self.buffer, np.dtype("<u2"), count=total_words, offset=self.offsets["models"] + end
        )
        return models, lengths, words.astype(np.int32)

    def gaussian_models(self) -> np.ndarray:
        """uint8 ``[lanes, 2]``: each lane's ``(centre, spread)``, centre ``<= 2n``,
        spread ``< SPREADS`` (versions 3 and 4; version 5 codes them, see
        :meth:`coded_models`)."""
        levels = self.lane_levels
        if self.version >= 4:  # centre - n + MAX_LEVELS, then the spreads
            head = np.frombuffer(self.buffer, np.uint8, count=1, offset=self.offsets["models"])
            centres_size = _padded_len(_PACK_HEAD + (self.lanes * int(head[0]) + 7) // 8)
            if centres_size > self.sizes["models"]:
                raise CodecError("section models is too short for its centres")
            offset = self.offsets["models"]
            centres = _unpack(self.buffer, offset, centres_size, self.lanes, 8)
            centres += levels - MAX_LEVELS
            models = np.stack([centres, self.packed("models", self.lanes, 8, centres_size)], 1)
        else:
            models = self.section("models", np.dtype(np.uint8), self.lanes * 2)
            models = models.reshape(self.lanes, 2).astype(np.int64)
        return check_models(models, levels)

    def streams(self) -> tuple[np.ndarray, np.ndarray]:
        """``(lengths, words)``: int64 ``[lanes / lanes_per_stream]`` and int32
        ``[sum(lengths)]``."""
        if self.version >= 4:
            lengths = self.packed("lengths", self.lanes // self.lanes_per_stream, 32)
        else:
            lengths = self.section("lengths", self.length_dtype, self.lanes).astype(np.int64)
        total_words = int(lengths.sum())
        if _padded_len(total_words * 2) != self.sizes["words"]:
            raise CodecError("section words does not match the lane lengths")
        return lengths, self.section("words", np.dtype("<u2"), total_words).astype(np.int32)


def check_models(models: np.ndarray, levels: np.ndarray) -> np.ndarray:
    """``models`` (int64 ``[lanes, 2]``: centre, spread) as uint8 if every centre is in
    its lane's alphabet ``[0, 2n]`` (``levels``: each lane's ``n``) and every spread
    below ``SPREADS``.

    Raises:
        CodecError: a model outside them.
    """
    too_far = (models[:, 0] < 0) | (models[:, 0] > 2 * levels) | (models[:, 1] >= SPREADS)
    if too_far.any():
        raise CodecError(
            f"a lane's Gaussian model is outside its alphabet or spreads (< {SPREADS})"
        )
    return models.astype(np.uint8)


def _is_key(value: Any, mapping: dict, kind: type) -> bool:
    return type(value) is kind and value in mapping


def read_container(params: Any, payload: bytes | memoryview, out_shape: list[int]) -> Container:
    """Check ``params`` (versions 2 to 5), the payload's section sizes and CRC against
    each other and ``out_shape``.

    Raises:
        CodecError: anything inconsistent (the message says what).
    """
    if not isinstance(params, dict):
        raise CodecError(f"params must be a map, got {type(params).__name__}")
    version = params.get("version")
    prob_bits = params.get("prob_bits", PROB_BITS if version == VERSION else None)
    if not _is_key(version, _KEYS, int) or prob_bits != PROB_BITS:
        raise CodecError(
            f"unsupported version/prob_bits {version!r}/{prob_bits!r} "
            f"(this decoder reads versions 2 to {VERSION}, prob_bits {PROB_BITS})"
        )
    if set(params) != _KEYS[version]:
        raise CodecError(
            f"params have keys {sorted(params)}, version {version} has {sorted(_KEYS[version])}"
        )
    shape = params["shape"]
    if not isinstance(shape, list) or len(shape) != 4 or any(type(s) is not int for s in shape):
        raise CodecError(f"params shape {shape!r} is not four ints")
    if shape[0] != 2 or min(shape) < 1:
        raise CodecError(f"params shape {shape} is not a non-empty [2, L, T, D]")
    if list(out_shape) != shape:
        raise CodecError(f"out has shape {list(out_shape)}, the params say {shape}")
    _, num_layers, num_tokens, hidden = shape
    k_levels = check_levels(params["k_levels"], num_layers, "k_levels", CodecError)
    v_levels = check_levels(params["v_levels"], num_layers, "v_levels", CodecError)

    if version == 2:  # histograms, float32 scales, uint16 lengths unless T + 2 needs more
        model, scale_dtype = "histogram", SCALE_DTYPES["float32"]
        lengths_dtype = np.dtype("<u2" if num_tokens + 2 < 65536 else "<u4")
    else:
        model, scale_name = params["model"], params["scale_dtype"]
        length_bytes = params["length_bytes"] if version == 3 else 4  # 4: packed, unused
        known = _is_key(model, MODELS, str) and _is_key(scale_name, SCALE_DTYPES, str)
        if not known or not _is_key(length_bytes, _WIDTHS, int):
            raise CodecError(
                f"params model/scale_dtype/length_bytes {model!r}/{scale_name!r}/"
                f"{length_bytes!r}: expected one of {sorted(MODELS)} / {sorted(SCALE_DTYPES)} "
                f"/ {sorted(_WIDTHS)}"
            )
        if model == "gaussian" and num_tokens > GAUSSIAN_MAX_TOKENS:
            raise CodecError(f"the gaussian model takes at most {GAUSSIAN_MAX_TOKENS} tokens")
        scale_dtype, lengths_dtype = SCALE_DTYPES[scale_name], _WIDTHS[length_bytes]
    names = MODELS[model]

    sizes = params["sections"]
    if (
        not isinstance(sizes, list)
        or len(sizes) != len(names)
        or any(type(s) is not int or s < 0 for s in sizes)
    ):
        raise CodecError(f"params sections {sizes!r} is not {len(names)} byte lengths")
    if sum(sizes) != len(payload):
        raise CodecError(f"payload is {len(payload)} bytes, the sections add up to {sum(sizes)}")
    if params["crc"] != params_checksum(params, payload):
        raise CodecError("CRC mismatch: the params or the payload are damaged")

    lanes = 2 * num_layers * hidden
    fixed = {
        "scales": _padded_len(2 * num_layers * num_tokens * scale_dtype.itemsize),
        "bounds": _padded_len(lanes * 2),
        "models": _padded_len(lanes * 2),
        "lengths": _padded_len(lanes * lengths_dtype.itemsize),
    }
    for name, size in zip(names, sizes, strict=True):
        packed = version >= 4 and name in PACKED  # checked where they are unpacked
        if name in fixed and not packed and size != fixed[name]:
            raise CodecError(f"section {name} is {size} bytes, the shape needs {fixed[name]}")
    offsets = np.cumsum([0, *sizes[:-1]]).tolist()
    return Container(
        version=version,
        model=model,
        num_layers=num_layers,
        num_tokens=num_tokens,
        hidden=hidden,
        k_levels=k_levels,
        v_levels=v_levels,
        scale_dtype=scale_dtype,
        length_dtype=lengths_dtype,
        sizes=dict(zip(names, sizes, strict=True)),
        offsets=dict(zip(names, offsets, strict=True)),
        buffer=memoryview(payload).cast("B") if isinstance(payload, memoryview) else payload,
    )
