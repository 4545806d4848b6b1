"""What the Redis store keeps in a Redis value, and how it reads a pipeline's replies.

A value is a blob, or the manifest of a blob split into parts: values larger than the
store's ``max_value_bytes`` (Redis refuses bulk strings over ``proto-max-bulk-len``,
512 MB by default) are split::

    namespace+name        -> MANIFEST_MAGIC + cbor {"parts": n, "part_bytes": p, "length": total}
    namespace+name#p0     -> blob[0 : p]
    ...
    namespace+name#p{n-1} -> blob[(n-1)*p : total]

NOTE: a value that starts with ``MANIFEST_MAGIC`` is always a manifest: a blob that
happens to start with the magic is stored split (in one part) so it cannot be misread.
NOTE: kvtier names never contain ``#`` (``CacheKey`` percent-encodes it), so a part key
cannot collide with a blob's key.
NOTE: a key under kvtier's namespace may hold a value kvtier did not write, of another
kind (a list, a hash): Redis answers ``WRONGTYPE`` to reading it, which ``replies``
turns into a value of the caller's choosing (an empty blob, which the layer above
rejects as corrupt and deletes; a missing part), never a failure of the whole store.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import cbor2
from redis.exceptions import ResponseError

#: prefix of a split value's manifest (the layer above writes a different magic)
MANIFEST_MAGIC = b"KVTIERPARTS\x00"
#: a part's key is ``key + PART_SEP + index``
PART_SEP = "#p"
# A manifest is the magic plus a CBOR map of three small ints (< 60 bytes); delete_many
# reads this many leading bytes of each value to find manifests without fetching blobs.
MANIFEST_PROBE_BYTES = 256
# More parts than this is a corrupt manifest (at the default part size, 256 TiB).
_MAX_PARTS = 1 << 20


@dataclass(frozen=True, slots=True)
class Manifest:
    """How a split blob was cut: ``parts`` parts of ``part_bytes`` (the last shorter),
    ``length`` bytes in all."""

    parts: int
    part_bytes: int
    length: int

    def encode(self) -> bytes:
        body = {"parts": self.parts, "part_bytes": self.part_bytes, "length": self.length}
        return MANIFEST_MAGIC + cbor2.dumps(body)

    @classmethod
    def decode(cls, value: bytes) -> Manifest | None:
        """The manifest in ``value``, or None when it is malformed."""
        try:
            body = cbor2.loads(value[len(MANIFEST_MAGIC) :])
            manifest = cls(int(body["parts"]), int(body["part_bytes"]), int(body["length"]))
        except (ValueError, TypeError, KeyError, cbor2.CBORDecodeError):
            return None
        parts, part_bytes = manifest.parts, manifest.part_bytes
        if not 1 <= parts <= _MAX_PARTS or part_bytes < 1:
            return None
        # Every part but the last is full, the last holds 1..part_bytes bytes.
        if not (parts - 1) * part_bytes < manifest.length <= parts * part_bytes:
            return None
        return manifest

    def part_length(self, index: int) -> int:
        return min(self.part_bytes, self.length - index * self.part_bytes)


def replies(pipe: Any, wrong_kind: bytes | None) -> list[Any]:
    """The replies of the read-only pipeline ``pipe``, executed now, where the reply of a
    key holding another kind of value than a string is ``wrong_kind``.

    Raises:
        redis.exceptions.RedisError: any other error a command answered, or the call's.
    """
    values = pipe.execute(raise_on_error=False)
    for value in values:
        if isinstance(value, Exception) and not _is_wrong_kind(value):
            raise value
    return [wrong_kind if isinstance(value, Exception) else value for value in values]


def _is_wrong_kind(error: Exception) -> bool:
    return isinstance(error, ResponseError) and str(error).startswith("WRONGTYPE")
