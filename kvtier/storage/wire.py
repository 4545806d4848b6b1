"""The wire format of a stored chunk (disk files, Redis values, S3 objects).

::

    offset  size          field
    0       4             magic  b"KVTR"
    4       2             format version, little-endian (1)
    6       4             header length H, little-endian
    10      8             xxh3-64 of the header bytes, little-endian
    18      H             header: a CBOR map (below)
    18+H    payload_len   payload: the codec's output

Header fields: ``key`` (the canonical ``CacheKey`` string), ``layout`` (the order of the
payload's bytes, below), ``dtype`` and ``shape`` of the chunk tensor, ``codec`` and
``codec_params`` (see ``serde``), ``payload_len``, ``checksum`` (xxh3-64 of the payload),
``created`` (Unix time, informational) and, where the payload is the tensor's bytes as
they are (a verbatim codec), ``pad`` (zero bytes that put the payload at an offset that is
a multiple of ``PAYLOAD_ALIGN``; readers ignore it). A coded payload is decoded, never
copied as it is, so its object has no ``pad``.

Layouts: ``KV_2LTD`` (``CHUNK_LAYOUT``), the chunk as its shape says,
``[planes, layers, tokens, width]``; and ``KV_2TLD`` (``TOKEN_MAJOR_LAYOUT``), the same
chunk with tokens before layers, ``[planes, tokens, layers, width]`` — how SGLang's
``page_first`` host pool holds a page, written from the pool as it is (naive codec only).
``shape`` is the chunk's shape in both; decoding always yields ``KV_2LTD``.

The payload's alignment matters for speed, not correctness: the kernel copies a file's
bytes to or from a buffer fastest when both sit at the same offset within a cache line;
a payload 8 or 16 bytes past the buffer's alignment halved the throughput of ``write``
into the page cache on x86 (4K aliasing of loads behind stores).

NOTE: nothing here is ever unpickled. A reader validates every field before it trusts
any of them, and anything wrong — bad magic, unknown version, a header whose checksum or
CBOR is wrong or that is not the expected map, a key other than the one asked for, a length or checksum mismatch —
raises ``CorruptObject``, which the tiers turn into a counted, logged miss. What a newer
kvtier may write (a format version above ``VERSION``, a layout or codec not known here)
raises its subclass ``NewerFormat``: a miss too, counted apart and logged once per cause.
"""

from __future__ import annotations

import logging
import math
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import cbor2
import numpy as np
import torch
import xxhash

from kvtier.memory import MemoryObj
from kvtier.storage.blob_store import Buffer
from kvtier.storage.serde import (
    CorruptObject,
    NaiveSerde,
    NewerFormat,
    NotAKVChunk,
    Serde,
    make_serde,
    tensor_bytes,
)
from kvtier.warn import warn_once

logger = logging.getLogger(__name__)

MAGIC = b"KVTR"
VERSION = 1
PREFIX = struct.Struct("<4sHIQ")
PREFIX_SIZE = PREFIX.size
MAX_HEADER_BYTES = 1 << 20
CHUNK_LAYOUT = "KV_2LTD"  # [planes, layers, tokens, width]: the chunk as its shape says
TOKEN_MAJOR_LAYOUT = "KV_2TLD"  # [planes, tokens, layers, width] (naive codec only)
LAYOUTS = (CHUNK_LAYOUT, TOKEN_MAJOR_LAYOUT)
PAYLOAD_ALIGN = 64  # bytes; a cache line (the CPU pool's buffers are aligned to more)
COPY_BLOCK = 1 << 20  # bytes copied, then hashed while in cache (``copy_hashed``)

DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float64,
        torch.int8,
        torch.uint8,
        torch.int16,
        torch.int32,
        torch.int64,
        *(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)),
    )
}

Allocate = Callable[[tuple[int, ...], torch.dtype], MemoryObj | None]

__all__ = [
    "ChunkBuffers",
    "CorruptObject",
    "Header",
    "NewerFormat",
    "checksum_holds",
    "checksum_of",
    "decode",
    "encode",
    "encode_buffers",
]


def checksum_of(*buffers: Buffer) -> int:
    """xxh3-64 of the buffers concatenated."""
    if len(buffers) == 1:
        return xxhash.xxh3_64_intdigest(buffers[0])
    digest = xxhash.xxh3_64()
    for buffer in buffers:
        digest.update(buffer)
    return digest.intdigest()


@dataclass(frozen=True, slots=True)
class Header:
    key: str
    layout: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    codec: str
    codec_params: dict[str, Any]
    payload_len: int
    checksum: int

    @property
    def tensor_nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True, slots=True)
class ChunkBuffers:
    """A chunk held in memory kvtier does not own (an engine's host pool) as byte buffers,
    concatenated in the order of ``layout``: what a tier writes from, or reads into, with
    no staging copy (``FileTier.put_buffers`` / ``get_into``).

    Attributes:
        shape: the chunk's shape (``[planes, layers, tokens, width]`` for the KV layouts).
        dtype: its dtype.
        layout: the order of the bytes, one of ``LAYOUTS``.
        buffers: the bytes (writable to be read into).
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    layout: str
    buffers: tuple[Buffer, ...]

    @property
    def nbytes(self) -> int:
        return sum(len(b) for b in self.buffers)


def encode(
    key: str,
    tensor: torch.Tensor,
    serde: Serde,
    *,
    checksum: int | None = None,
) -> list[Buffer]:
    """The object for ``tensor`` (a ``CHUNK_LAYOUT`` chunk) stored under ``key``: a list
    of parts to be written concatenated (the payload parts are views, not copies, for the
    naive codec).

    ``checksum``: the xxh3-64 of ``tensor``'s bytes when the caller knows it (a stored
    chunk's ``MemoryObj.checksum``); a verbatim codec's payload is those bytes, so they are
    not hashed again. Were the bytes changed since, the object is refused when read."""
    try:
        payload, params = serde.encode(tensor)
    except ValueError as exc:  # a chunk this codec cannot take (e.g. non-finite): raw
        if not isinstance(exc, NotAKVChunk):  # a KV codec, asked to code no KV: raw, unsaid
            warn_once(logger, f"codec {serde.name} cannot take a chunk ({exc}): stored naive")
        serde = NaiveSerde()
        payload, params = serde.encode(tensor)
    known = checksum is not None and serde.verbatim
    header = encode_header(
        key,
        CHUNK_LAYOUT,
        tensor.dtype,
        tuple(tensor.shape),
        serde.name,
        params,
        payload_len=sum(len(p) for p in payload),
        checksum=checksum if known else checksum_of(*payload),
        aligned=serde.verbatim,
    )
    return [header, *payload]


def encode_buffers(key: str, chunk: ChunkBuffers) -> list[Buffer]:
    """The object for ``chunk`` stored under ``key``, verbatim (naive codec): the header,
    then ``chunk.buffers`` themselves, whose checksum is computed here, over those bytes."""
    header = encode_header(
        key,
        chunk.layout,
        chunk.dtype,
        chunk.shape,
        NaiveSerde.name,
        {},
        payload_len=chunk.nbytes,
        checksum=checksum_of(*chunk.buffers),
    )
    return [header, *chunk.buffers]


def encode_header(
    key: str,
    layout: str,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    codec: str,
    codec_params: dict[str, Any],
    *,
    payload_len: int,
    checksum: int,
    aligned: bool = True,
) -> bytes:
    """The prefix and header of an object (everything before its payload); ``aligned``:
    padded so that the payload starts at a multiple of ``PAYLOAD_ALIGN``."""
    fields = {
        "key": key,
        "layout": layout,
        "dtype": str(dtype).removeprefix("torch."),
        "shape": list(shape),
        "codec": codec,
        "codec_params": codec_params,
        "payload_len": payload_len,
        "checksum": checksum,
        "created": time.time(),
    }
    header = _aligned_header(fields) if aligned else cbor2.dumps(fields)
    return PREFIX.pack(MAGIC, VERSION, len(header), checksum_of(header)) + header


def _aligned_header(fields: dict[str, Any]) -> bytes:
    """``fields`` as CBOR with a ``pad`` that ends the header at a multiple of
    ``PAYLOAD_ALIGN`` from the object's start."""
    bare = len(cbor2.dumps({**fields, "pad": b""}))  # an empty pad: its key + 1 byte
    need = -(PREFIX_SIZE + bare) % PAYLOAD_ALIGN
    # n pad bytes add n to the header, plus 1 when n >= 24 (CBOR's longer length form)
    if need == 24:
        need += PAYLOAD_ALIGN
    header = cbor2.dumps({**fields, "pad": bytes(need if need < 24 else need - 1)})
    assert (PREFIX_SIZE + len(header)) % PAYLOAD_ALIGN == 0
    return header


def read_prefix(prefix: Buffer) -> tuple[int, int]:
    """The header's length and checksum from the object's first ``PREFIX_SIZE`` bytes."""
    if len(prefix) < PREFIX_SIZE:
        raise CorruptObject(f"truncated: {len(prefix)} bytes, shorter than the prefix")
    magic, version, length, header_checksum = PREFIX.unpack_from(prefix)
    if magic != MAGIC:
        raise CorruptObject(f"bad magic {bytes(magic)!r} (expected {MAGIC!r})")
    if version > VERSION:
        raise NewerFormat(f"format version {version}; this kvtier reads up to {VERSION}")
    if version != VERSION:
        raise CorruptObject(f"unknown format version {version} (this kvtier reads {VERSION})")
    if not 0 < length <= MAX_HEADER_BYTES:
        raise CorruptObject(f"header length {length} out of range")
    return length, header_checksum


def parse_header(data: Buffer, expected_key: str, header_checksum: int) -> Header:
    """Validate the CBOR header ``data`` of an object read for ``expected_key``."""
    if checksum_of(data) != header_checksum:
        raise CorruptObject("header checksum mismatch")
    try:
        fields = cbor2.loads(bytes(data))
    except Exception as exc:  # cbor2 raises several types on garbage
        raise CorruptObject(f"header is not valid CBOR ({exc})") from None
    if not isinstance(fields, dict):
        raise CorruptObject("header is not a map")
    try:
        key, layout, dtype = fields["key"], fields["layout"], fields["dtype"]
        shape, codec, params = fields["shape"], fields["codec"], fields["codec_params"]
        payload_len, checksum = fields["payload_len"], fields["checksum"]
    except KeyError as exc:
        raise CorruptObject(f"header lacks field {exc.args[0]!r}") from None
    if key != expected_key:
        raise CorruptObject(f"holds key {key!r}, not the one asked for")
    if layout not in LAYOUTS:
        raise NewerFormat(f"chunk layout {layout!r}, unknown to this kvtier")
    if dtype not in DTYPES:
        raise CorruptObject(f"unknown dtype {dtype!r}")
    if not (
        isinstance(shape, list)
        and 1 <= len(shape) <= 8
        and all(isinstance(d, int) and 0 < d < 1 << 40 for d in shape)
    ):
        raise CorruptObject(f"bad shape {shape!r}")
    if not isinstance(codec, str) or not isinstance(params, dict):
        raise CorruptObject("bad codec fields")
    if layout == TOKEN_MAJOR_LAYOUT and (codec != NaiveSerde.name or len(shape) != 4):
        raise CorruptObject(f"layout {layout} needs the naive codec and a 4-d shape")
    if not isinstance(payload_len, int) or not 0 <= payload_len < 1 << 44:
        raise CorruptObject(f"bad payload length {payload_len!r}")
    if not isinstance(checksum, int):
        raise CorruptObject("bad checksum field")
    header = Header(key, layout, DTYPES[dtype], tuple(shape), codec, params, payload_len, checksum)
    # NOTE: checked before a reader allocates a buffer of the header's shape, which
    # could evict the CPU tier's chunks to make room for an object that is not one
    if codec == NaiveSerde.name and payload_len != header.tensor_nbytes:
        need = header.tensor_nbytes
        raise CorruptObject(f"naive payload of {payload_len} bytes, the shape needs {need}")
    return header


def verify_payload(header: Header, *payload: Buffer) -> None:
    """Check ``payload`` (one buffer, or several concatenated) against the header's length
    and checksum."""
    _check_length(header, *payload)
    if checksum_of(*payload) != header.checksum:
        raise CorruptObject("payload checksum mismatch")


def copy_hashed(target: memoryview, source: Buffer) -> int:
    """Copy ``source`` into ``target`` (of the same length) and return the xxh3-64 of the
    bytes now in ``target``: each ``COPY_BLOCK`` is hashed as soon as it is copied, while
    it is still in the CPU's cache, so the checksum costs no second pass over memory.

    The bytes hashed are those in ``target``, read back after the copy: a source that
    another process changes meanwhile can only make the checksum disagree."""
    source = memoryview(source).cast("B")
    digest = xxhash.xxh3_64()
    for start in range(0, len(source), COPY_BLOCK):
        block = target[start : start + COPY_BLOCK]
        block[:] = source[start : start + COPY_BLOCK]
        digest.update(block)
    return digest.intdigest()


def _check_length(header: Header, *payload: Buffer) -> None:
    length = sum(len(p) for p in payload)
    if length != header.payload_len:
        raise CorruptObject(
            f"payload is {length} bytes, the header says {header.payload_len} (truncated?)"
        )


def decode_into(
    header: Header, payload: Buffer, out: MemoryObj, serde: Serde | None = None
) -> None:
    """Decode ``payload`` into ``out`` (shaped by the header), verified. Sets
    ``out.checksum`` to the xxh3-64 of the decoded bytes, as a store would. ``serde``: the
    tier's configured serde, used when the header names its codec (any other codec is
    decoded with that codec's defaults).

    A verbatim payload is copied first and verified in ``out``, where the engine will
    read it: bytes another process may write (a shared-memory segment) cannot change
    after the check. Any other payload is verified before it is decoded."""
    if header.layout == CHUNK_LAYOUT and header.codec == NaiveSerde.name:
        _check_length(header, payload)
        NaiveSerde.check(memoryview(payload), header.codec_params, out.tensor)
        if copy_hashed(tensor_bytes(out.tensor), payload) != header.checksum:
            raise CorruptObject("payload checksum mismatch")
        out.checksum, out.verified = header.checksum, True
        return
    verify_payload(header, payload)
    if header.layout == TOKEN_MAJOR_LAYOUT:
        _untranspose(header, payload, out)
        return
    if serde is None or serde.name != header.codec:
        try:
            serde = make_serde(header.codec)
        except ValueError:
            raise NewerFormat(f"codec {header.codec!r}, unknown to this kvtier") from None
    serde.decode(memoryview(payload), header.codec_params, out.tensor)
    out.checksum = header.checksum if serde.lossless else checksum_of(tensor_bytes(out.tensor))
    out.verified = True


def _untranspose(header: Header, payload: Buffer, out: MemoryObj) -> None:
    """A verified ``TOKEN_MAJOR_LAYOUT`` payload into ``out`` in ``CHUNK_LAYOUT``."""
    if header.payload_len != header.tensor_nbytes:
        need = header.tensor_nbytes
        raise CorruptObject(f"payload is {header.payload_len} bytes, the shape needs {need}")
    planes, layers, tokens, width = header.shape
    row = width * header.dtype.itemsize  # bytes of one (plane, layer, token)
    source = np.frombuffer(payload, np.uint8, header.payload_len)
    target = np.frombuffer(tensor_bytes(out.tensor), np.uint8)
    target.reshape(planes, layers, tokens, row)[:] = source.reshape(
        planes, tokens, layers, row
    ).transpose(0, 2, 1, 3)
    out.checksum = checksum_of(tensor_bytes(out.tensor))  # of the chunk's bytes, as stored
    out.verified = True


def checksum_holds(obj: MemoryObj) -> bool:
    """Whether ``obj``'s bytes still match its checksum: hashed, unless the tier that read
    them has just verified them (``MemoryObj.take_verified``). False when none is known."""
    if obj.take_verified():
        return obj.checksum is not None
    return obj.checksum is not None and obj.checksum == checksum_of(tensor_bytes(obj.tensor))


def split(blob: Buffer, expected_key: str) -> tuple[Header, memoryview]:
    """The validated header of the object ``blob`` (read for ``expected_key``) and its
    payload (a view, not yet verified).

    Raises:
        CorruptObject: anything wrong up to the payload.
    """
    view = memoryview(blob).cast("B")
    length, header_checksum = read_prefix(view[:PREFIX_SIZE])
    if len(view) < PREFIX_SIZE + length:
        raise CorruptObject("truncated inside the header")
    header = parse_header(view[PREFIX_SIZE : PREFIX_SIZE + length], expected_key, header_checksum)
    return header, view[PREFIX_SIZE + length :]


def decode(
    blob: Buffer, expected_key: str, allocate: Allocate, serde: Serde | None = None
) -> MemoryObj | None:
    """The chunk stored in ``blob`` (one whole object) in a fresh buffer (``serde`` as
    for :func:`decode_into`).

    Returns None when no buffer could be allocated. Raises CorruptObject.
    """
    header, payload = split(blob, expected_key)
    obj = allocate(header.shape, header.dtype)
    if obj is None:
        return None
    try:
        decode_into(header, payload, obj, serde)
    except BaseException:
        obj.ref_down()
        raise
    return obj
