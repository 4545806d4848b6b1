"""The byte-level contract of a remote store, and the errors stores raise.

A ``BlobStore`` keeps opaque byte objects ("blobs") under string names. It knows
nothing about KV, keys or the wire format: ``kvtier.storage.remote.RemoteTier`` turns
chunks into blobs (``kvtier.storage.wire``), owns timeouts, health and reconnects, and
calls a store from its own threads. A store is therefore small: a client, a namespace,
batched calls.

Contract for every implementation:

- Names are kvtier key strings (``CacheKey.to_string()``: ASCII, no ``/``). The store
  maps them into its own namespace (a Redis key prefix, an S3 prefix) so that several
  models and deployments share one server without colliding.
- Batched calls answer in the order asked, one element per name, in as few round trips
  as the store allows (a Redis pipeline, concurrent S3 requests).
- A name that is absent is ``None`` / ``False``, never an exception.
- A failure of the store itself (connection refused or reset, timeout, authentication,
  a server error) raises ``StoreUnavailable`` with a message naming the store and what
  failed. Nothing else escapes: client-library exceptions are wrapped.
- A write the store answers but refuses for want of room (Redis out of memory under
  ``noeviction``, an S3 quota or a full backend) raises ``WriteRefused``, a
  ``StoreUnavailable`` that is no outage: the store still reads. One it refuses for want
  of permission (a read-only Redis ACL user, an S3 policy without ``PutObject``) raises
  ``WriteDenied``, a ``WriteRefused`` of that cause.
- A request the store answers but throttles (S3's ``SlowDown``, ``Throttling``, HTTP
  429) past the store's own retries raises ``Throttled``, a ``StoreUnavailable`` that is
  no outage either: that request failed, the store answers.
- Thread-safe: calls may come from several threads at once.
- ``put_many`` takes each blob as a list of buffer parts (``bytes`` or ``memoryview``)
  to be stored concatenated, so the caller never has to join a header and a large
  payload when the store can send parts (files); stores that cannot, join.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Protocol, TypeVar, runtime_checkable

Buffer = bytes | bytearray | memoryview
T = TypeVar("T")


class StoreUnavailable(Exception):
    """The store could not be reached or failed to answer (a fault, not a miss)."""


class WriteRefused(StoreUnavailable):
    """The store answered but refused to keep a write for want of room (out of memory,
    over quota, no space) or, as ``WriteDenied``, of permission: a failed store, not an
    outage, as reads still work.

    Attributes:
        cause: what refused it, the same for every refusal of one kind (``redis out of
            memory``, ``s3 QuotaExceeded``): warnings are given once per cause.
    """

    def __init__(self, message: str, cause: str):
        super().__init__(message)
        self.cause = cause


class WriteDenied(WriteRefused):
    """The store answered but does not let this client write (a Redis ACL user without
    ``SET``, S3's ``AccessDenied`` on a put): a failed store, not an outage, as reads
    still work."""


class Throttled(StoreUnavailable):
    """The store answered but asked for fewer requests (back-pressure: S3's ``SlowDown``,
    ``Throttling``, HTTP 429), and still did after the store's own retries: this request
    failed, not the store. A put is a failed store, a read a miss; the store stays up."""


@runtime_checkable
class BlobStore(Protocol):
    """A remote byte store (Redis/Valkey, S3). See the module docstring for the contract."""

    #: short name for logs and metrics, e.g. ``"redis"`` or ``"s3"``
    name: str

    def put_many(self, items: Sequence[tuple[str, Sequence[Buffer]]]) -> None:
        """Store each ``(name, parts)``: the blob is the parts concatenated. Overwrites."""
        ...

    def get_many(self, names: Sequence[str]) -> list[bytes | None]:
        """The blob under each name, or None where absent."""
        ...

    def exists_many(self, names: Sequence[str]) -> list[bool]:
        """Whether each name is present."""
        ...

    def delete_many(self, names: Sequence[str]) -> int:
        """Delete the names (absent ones are ignored); returns how many were deleted."""
        ...

    def clear(self) -> int:
        """Delete every blob in this store's namespace; returns how many."""
        ...

    def ping(self) -> None:
        """Return if the store answers, else raise StoreUnavailable."""
        ...

    def close(self) -> None:
        """Release connections and threads (idempotent)."""
        ...


@runtime_checkable
class ReadingStore(Protocol):
    """A store that can hand each blob to a callback while the blob is still in its own
    buffer (a reply, a shared segment, the server's memory), saving the copy ``get_many``
    makes; the remote tier then decodes chunks straight from there.

    ``read_batch``: how many blobs one call should carry. 1 where a read waits on the
    network (the tier makes one call per blob, in parallel); more where a read is a copy
    out of memory, which parallel calls would not make faster than their overhead.
    """

    read_batch: int

    def read_each(
        self, names: Sequence[str], consume: Callable[[int, memoryview], T]
    ) -> list[T | None]:
        """``consume(i, view)`` of each blob ``names[i]`` present (None where absent); the
        view is valid only during the call."""
        ...


def join_parts(parts: Sequence[Buffer]) -> bytes | memoryview:
    """The blob of ``parts`` as one buffer (no copy when there is a single part)."""
    if len(parts) == 1:
        return parts[0] if isinstance(parts[0], bytes | memoryview) else bytes(parts[0])
    return b"".join(parts)


PutItem = tuple[str, Sequence[Buffer]]


def batches(
    items: Sequence[PutItem], max_bytes: int, size: Callable[[Sequence[Buffer]], int]
) -> Iterator[list[PutItem]]:
    """``items`` cut, in order, into batches whose ``size`` adds up to at most
    ``max_bytes`` (one item larger than that is a batch of its own)."""
    batch: list[PutItem] = []
    batch_bytes = 0
    for name, parts in items:
        item_bytes = size(parts)
        if batch and batch_bytes + item_bytes > max_bytes:
            yield batch
            batch, batch_bytes = [], 0
        batch.append((name, parts))
        batch_bytes += item_bytes
    if batch:
        yield batch
