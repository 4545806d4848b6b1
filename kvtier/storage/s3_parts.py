"""How a blob's buffers become the bodies of S3 requests: one body for a PutObject, the
parts of a multipart upload, with as few copies as botocore allows.

botocore sends a bytes-like body as it is, so a part that lies inside one of the caller's
buffers goes as a slice of it; only a body that spans buffers is joined (copied).
"""

from __future__ import annotations

from kvtier.storage.blob_store import Buffer

__all__ = ["byte_view", "joined", "part_size_for", "pieces"]

# S3 limit: an upload has at most 10000 parts.
_MAX_PARTS = 10_000


def byte_view(part: Buffer) -> memoryview:
    """``part`` as a flat byte view (no copy unless it is not contiguous)."""
    view = memoryview(part)
    if not view.c_contiguous:
        return memoryview(view.tobytes())
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def joined(views: list[memoryview]) -> bytes | memoryview:
    """The concatenation of ``views`` as one body (the view itself when there is one)."""
    # botocore sends a bytes-like body as is, but a file-like one in 16 KiB reads with an
    # Expect: 100-continue round trip; joining a blob below the multipart threshold is the
    # cheaper of the two.
    return views[0] if len(views) == 1 else b"".join(views)


def part_size_for(size: int, part_size: int) -> int:
    """The part size of a multipart upload of ``size`` bytes: ``part_size``, or larger
    where that would take more parts than S3 allows (rather than failing)."""
    return max(part_size, -(-size // _MAX_PARTS))


def pieces(views: list[memoryview], piece_size: int) -> list[bytes | memoryview]:
    """The concatenation of ``views`` cut into ``piece_size`` pieces (the last shorter).

    A piece inside one view is a slice of it (no copy); a piece spanning views is joined.
    """
    out: list[bytes | memoryview] = []
    pending: list[memoryview] = []  # the current piece's slices
    pending_size = 0
    for view in views:
        offset = 0
        while offset < view.nbytes:
            take = min(piece_size - pending_size, view.nbytes - offset)
            pending.append(view[offset : offset + take])
            pending_size += take
            offset += take
            if pending_size == piece_size:
                out.append(joined(pending))
                pending, pending_size = [], 0
    if pending:
        out.append(joined(pending))
    return out
