"""The wire protocol between ``kvtier serve`` and its clients (``kvtier://`` remotes).

Every message, request or reply, is one frame::

    offset  size   field
    0       4      magic  b"KVTS"
    4       1      protocol version (1)
    5       1      op (``Op``)
    6       2      flags, little-endian (``REPLY`` on replies)
    8       8      request id, little-endian (a reply carries its request's id)
    16      4      header length H, little-endian (at most ``MAX_HEADER_BYTES``)
    20      4      payload length P, little-endian (at most the server's frame limit)
    24      H      header: a CBOR map (below)
    24+H    P      payload: blobs, concatenated, as the header's ``sizes`` cut them

Requests (header fields → reply header fields; names are relative to the connection's
namespace, which the server prefixes to every name it stores):

    HELLO   token, namespace[, shm] → max_frame, max_names, idle_timeout_s, ops[, shm,
                                     shm_error] (first frame)
    PING    -                      → -
    EXISTS  names                  → present: [bool]
    GET     names[, shm]           → sizes: [int, -1 where absent][, shm]; payload: the blobs
    PUT     names, sizes; payload  → stored: int
            (or names, sizes, shm and no payload)

``shm`` fields (the same-host path, ``kvtier.storage.node_shm``): HELLO offers a segment
``{name, size, nonce}`` and the reply says whether the server mapped it; a PUT gives one
offset per blob into it instead of a payload; a GET gives ``[offset, capacity]``, the
region the server may fill, and the reply one offset per blob (-1: absent, or in the
payload). The capability is negotiated, so the version stays 1.
    DELETE  names                  → deleted: int
    CLEAR   -                      → deleted: int   (this namespace only)
    STATS   -                      → the server's counters

Between servers (peers; a peer's HELLO carries ``peer: true``, and its EXISTS and GET
are answered from the server's own memory and disk, never passed on to its peers):

    PEER    [metadata]             → agent, epoch, metadata, base   (NIXL handshake)
    LEASE   names                  → lease, agent, epoch, sizes, offsets
    RELEASE lease                  → held: bool
    CORRUPT names                  → dropped: int   (names a pull found corrupt)

PEER returns the server's NIXL agent name, the epoch of its memory registration, its
agent metadata and the pool's base address (or ``error`` without NIXL). LEASE pins the
named blobs held in memory (-1 where not) for a bounded time, giving each one's offset
in the pool; RELEASE ends the lease and says whether it was held throughout, so a
puller that read the pool one-sidedly meanwhile knows whether the bytes it read were
still the blobs it asked for. CORRUPT tells the server which blobs a pull found corrupt:
it drops each copy of them in its memory and on disk whose own bytes fail their checksum
(it verifies them itself: the damage may have been on the way), and says how many.

The HELLO reply announces the server's limits: ``max_frame`` (payload bytes per frame),
``max_names`` (names per request: a request with more is an error reply, so a client
splits its batches to fit) and ``idle_timeout_s`` (how long the server keeps a connection
that sends nothing; 0: for ever). A server that leaves one out has no such limit.

It also lists the ops the server answers (``ops``, their numbers), so that an op added
since (CORRUPT) is never sent to a server that predates it: such a server takes an
unknown op for a broken frame and closes the connection. A server that leaves ``ops``
out is one of those and answers ``UNANNOUNCED_OPS``. Ops are only ever added, so the
version stays 1.

A reply's header has ``error`` (a string) when the request failed; after an error
about the frame itself (bad magic, version, size, CBOR, authentication) the server
closes the connection, since the stream can no longer be trusted.

NOTE: never pickle: headers are CBOR maps of strings, ints, bools and lists, and the
decoder checks every field's type before anything uses it. This module imports nothing
from kvtier: both the server and the client (``kvtier.storage.node_store``) import it.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import cbor2

MAGIC = b"KVTS"
VERSION = 1
PREFIX = struct.Struct("<4sBBHQII")
PREFIX_SIZE = PREFIX.size  # 24
MAX_HEADER_BYTES = 4 << 20  # a batch of 10k names fits easily
DEFAULT_MAX_FRAME_BYTES = 256 << 20  # payload; 8 chunks of 32 MiB
# names per request: a 1M-token prompt in 256-token chunks, and far more than the 4 MiB
# header holds of the longest names
DEFAULT_MAX_NAMES = 4096
DEFAULT_IDLE_TIMEOUT_S = 600.0  # a connection that sends nothing this long is closed
REPLY = 0x1
MAX_NAME_CHARS = 1024
MAX_NAMESPACE_CHARS = 256
# NOTE: CBOR carries integers of any size, and Python cannot even format one of more than
# 4300 digits: every size, offset and count a frame gives is checked against this first.
MAX_INT = (1 << 63) - 1


class Op(enum.IntEnum):
    HELLO = 1
    PING = 2
    EXISTS = 3
    GET = 4
    PUT = 5
    DELETE = 6
    CLEAR = 7
    STATS = 8
    PEER = 9
    LEASE = 10
    RELEASE = 11
    CORRUPT = 12


UNANNOUNCED_OPS = frozenset(Op) - {Op.CORRUPT}
"""What a server that announces no ``ops`` answers: every op but those added since."""


class ProtocolError(Exception):
    """A frame that breaks the protocol (the connection cannot go on)."""


class TooManyNames(ProtocolError):
    """A request that names more blobs than the server takes in one (``max_names``)."""


@dataclass(slots=True)
class Frame:
    """One decoded frame: ``header`` is the CBOR map, ``payload`` the bytes after it."""

    op: Op
    request_id: int
    header: dict[str, Any] = field(default_factory=dict)
    payload: bytes | memoryview = b""
    flags: int = 0


def encode_prefix(
    op: int, request_id: int, header_len: int, payload_len: int, flags: int = 0
) -> bytes:
    return PREFIX.pack(MAGIC, VERSION, op, flags, request_id, header_len, payload_len)


def encode(
    op: int,
    request_id: int,
    header: dict[str, Any] | None = None,
    payload_parts: Sequence[bytes | memoryview] = (),
    flags: int = 0,
) -> list[bytes | memoryview]:
    """The frame as buffer parts to send in order (payload parts are not copied)."""
    head = cbor2.dumps(header or {})
    payload_len = sum(len(p) for p in payload_parts)
    return [encode_prefix(op, request_id, len(head), payload_len, flags), head, *payload_parts]


@dataclass(frozen=True, slots=True)
class Prefix:
    op: Op
    flags: int
    request_id: int
    header_len: int
    payload_len: int


def decode_prefix(data: bytes, max_payload: int) -> Prefix:
    """The fixed prefix, checked.

    Raises:
        ProtocolError: bad magic, unsupported version, unknown op, or a header or payload
            length over its limit.
    """
    magic, version, op, flags, request_id, header_len, payload_len = PREFIX.unpack(data)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {magic!r} (expected {MAGIC!r})")
    if version != VERSION:
        raise ProtocolError(f"unsupported protocol version {version} (this end speaks {VERSION})")
    try:
        op = Op(op)
    except ValueError:
        raise ProtocolError(f"unknown op {op}") from None
    if header_len > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {header_len} bytes exceeds {MAX_HEADER_BYTES}")
    if payload_len > max_payload:
        raise ProtocolError(f"payload of {payload_len} bytes exceeds the limit of {max_payload}")
    return Prefix(op, flags, request_id, header_len, payload_len)


def decode_header(data: bytes) -> dict[str, Any]:
    """The CBOR header map (string keys).

    Raises:
        ProtocolError: not CBOR, or not a map with string keys.
    """
    try:
        header = cbor2.loads(data) if data else {}
    except Exception as exc:  # cbor2 raises several types on garbage
        raise ProtocolError(f"header is not CBOR: {type(exc).__name__}") from None
    if not isinstance(header, dict) or not all(isinstance(k, str) for k in header):
        raise ProtocolError("header is not a CBOR map with string keys")
    return header


# -- typed header fields ---------------------------------------------------------------


def names_of(header: dict[str, Any], limit: int | None = None) -> list[str]:
    """``header["names"]``: a list of non-empty strings without NUL, at most ``limit`` of
    them (None: any number).

    Raises:
        TooManyNames: more than ``limit``.
        ProtocolError: missing or of the wrong type.
    """
    names = header.get("names")
    if limit is not None and isinstance(names, list) and len(names) > limit:
        raise TooManyNames(
            f"{len(names)} names in one request, over the server's limit of {limit} "
            "(kvtier serve --max-names; clients split their batches to the max_names "
            "of the HELLO reply)"
        )
    if not isinstance(names, list) or not all(
        isinstance(n, str) and 0 < len(n) <= MAX_NAME_CHARS and "\x00" not in n for n in names
    ):
        raise ProtocolError(f"'names' must be a list of strings of 1 to {MAX_NAME_CHARS} chars")
    return names


def sizes_of(
    header: dict[str, Any], count: int, payload_len: int | None, *, absent_ok: bool
) -> list[int]:
    """``header["sizes"]``: ``count`` ints (``-1`` for absent where ``absent_ok``) whose
    non-negative entries sum to ``payload_len`` (None: blobs not in the payload).

    Raises:
        ProtocolError: missing, of the wrong type or length, or not adding up.
    """
    sizes = header.get("sizes")
    low = -1 if absent_ok else 0
    if not isinstance(sizes, list) or len(sizes) != count or not all(is_int(s, low) for s in sizes):
        raise ProtocolError(f"'sizes' must be a list of {count} integers >= {low}")
    if payload_len is not None and sum(s for s in sizes if s > 0) != payload_len:
        raise ProtocolError(f"'sizes' add up to {sum(sizes)}, the payload has {payload_len} bytes")
    return sizes


def is_int(value: Any, low: int = 0) -> bool:
    """Whether ``value`` is an int in ``[low, MAX_INT]`` (a bool is not one)."""
    return type(value) is int and low <= value <= MAX_INT


def shown(value: Any) -> str:
    """What a client sent, as an error message shows it: its repr, cut to 80 characters,
    or its type where Python cannot write it (an int of more than 4300 digits)."""
    try:
        text = repr(value)
    except ValueError:
        return f"a {type(value).__name__} too large to show"
    return text if len(text) <= 80 else text[:77] + "..."


def split_payload(payload: bytes | memoryview, sizes: Sequence[int]) -> list[memoryview | None]:
    """The blobs of a payload cut by ``sizes`` (None where a size is -1); no copies."""
    view = memoryview(payload)
    out: list[memoryview | None] = []
    offset = 0
    for size in sizes:
        if size < 0:
            out.append(None)
            continue
        out.append(view[offset : offset + size])
        offset += size
    return out


def ops_of(hello: dict[str, Any]) -> frozenset[Op]:
    """The ops a HELLO reply says the server answers (``UNANNOUNCED_OPS`` where it says
    none); numbers this end does not know (a newer server's ops) are left out.

    Raises:
        ProtocolError: ``ops`` is not a list of integers.
    """
    ops = hello.get("ops")
    if ops is None:
        return UNANNOUNCED_OPS
    if not isinstance(ops, list) or not all(type(op) is int for op in ops):
        raise ProtocolError(f"HELLO: 'ops' {ops!r} is not a list of op numbers")
    known = {int(op) for op in Op}
    return frozenset(Op(op) for op in ops if op in known)


def valid_namespace(namespace: Any) -> bool:
    """A namespace is 1 to ``MAX_NAMESPACE_CHARS`` characters without ``/`` or NUL."""
    return (
        isinstance(namespace, str)
        and 0 < len(namespace) <= MAX_NAMESPACE_CHARS
        and "/" not in namespace
        and "\x00" not in namespace
    )
