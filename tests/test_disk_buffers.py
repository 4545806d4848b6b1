"""The disk tier's direct path (``FileTier.put_buffers`` / ``get_into``): chunks written
from and read into memory the caller owns, as several runs, in either byte order of the
wire format; and what the rest of the tier makes of those files (reads, damage, the cap)."""

from __future__ import annotations

import os

import pytest
import torch
from support.tiers import CHUNK_SHAPE, counter, fill, key, make_pool, make_tier

from kvtier.observability.stats import Counter, Stats, TierCounter
from kvtier.storage import wire
from kvtier.storage.disk import DirectRead
from kvtier.storage.serde import tensor_bytes
from kvtier.storage.wire import CHUNK_LAYOUT, TOKEN_MAJOR_LAYOUT, ChunkBuffers
from kvtier_kernels.dtypes import fill_random_bits_

LAYOUTS = [CHUNK_LAYOUT, TOKEN_MAJOR_LAYOUT]
IO = [False, True]


@pytest.fixture
def pool():
    pool = make_pool(64)
    yield pool
    pool.close()


class Page:
    """A chunk held the way a host pool holds a page: each (plane, row) is a separate
    run of a larger buffer, with gaps between runs; ``layout`` is the runs' order."""

    def __init__(self, layout: str, seed: int, shape=CHUNK_SHAPE, dtype=torch.bfloat16):
        planes, layers, tokens, width = shape
        rows = (tokens, layers) if layout == TOKEN_MAJOR_LAYOUT else (layers, tokens)
        self.backing = torch.empty(planes, rows[0] + 1, rows[1], width, dtype=dtype)
        fill_random_bits_(self.backing, torch.Generator().manual_seed(seed))
        self.held = self.backing[:, 1:]  # [planes, rows, row, width], one run per row
        self.chunk = ChunkBuffers(
            tuple(shape),
            dtype,
            layout,
            tuple(tensor_bytes(self.held[p, r]) for p in range(planes) for r in range(rows[0])),
        )
        self.layout = layout

    def canonical(self) -> torch.Tensor:
        """The chunk in the chunk layout."""
        held = self.held.transpose(1, 2) if self.layout == TOKEN_MAJOR_LAYOUT else self.held
        return held.contiguous()

    def scrub(self) -> None:
        self.held.view(torch.uint8).fill_(0)


def raw(t: torch.Tensor) -> bytes:
    return bytes(tensor_bytes(t.contiguous()))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("o_direct", IO, ids=["buffered", "o_direct"])
def test_buffers_round_trip_bit_exact(tmp_path, layout, o_direct):
    stats = Stats()
    tier = make_tier(tmp_path, stats, o_direct=o_direct)
    pages = [Page(layout, seed) for seed in range(3)]
    expected = [raw(p.held) for p in pages]
    assert tier.put_buffers([(key(i), p.chunk) for i, p in enumerate(pages)]) == [True] * 3
    for p in pages:
        p.scrub()
    got = tier.get_into([(key(i), p.chunk) for i, p in enumerate(pages)])
    assert got == [DirectRead.LOADED] * 3
    assert [raw(p.held) for p in pages] == expected
    nbytes = pages[0].chunk.nbytes
    assert counter(stats, TierCounter.PUT_CHUNKS) == 3
    assert counter(stats, TierCounter.PUT_RAW_BYTES) == 3 * nbytes
    assert counter(stats, TierCounter.GET_HITS) == 3
    assert counter(stats, TierCounter.GET_BYTES) == 3 * nbytes
    assert not list(tmp_path.rglob("*.tmp"))
    tier.close()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("o_direct", IO, ids=["buffered", "o_direct"])
def test_get_many_reads_either_order_into_the_chunk_layout(tmp_path, pool, layout, o_direct):
    tier = make_tier(tmp_path, o_direct=o_direct)
    page = Page(layout, seed=5)
    assert tier.put_buffers([(key(1), page.chunk)]) == [True]
    (obj,) = tier.get_many([key(1)], pool.allocate)
    assert obj is not None and obj.shape == CHUNK_SHAPE
    assert raw(obj.tensor) == raw(page.canonical())
    assert obj.verified and obj.checksum == wire.checksum_of(tensor_bytes(obj.tensor))
    assert wire.checksum_holds(obj) and wire.checksum_holds(obj)  # hashed the second time
    obj.ref_down()
    tier.close()


def test_chunks_written_by_the_queue_read_into_buffers(tmp_path, pool):
    """Files of the queued path (the chunk layout, as kvtier always wrote them) load
    directly into buffers in that order, and are another format to any other order."""
    stats = Stats()
    tier = make_tier(tmp_path, stats)
    obj = fill(pool, seed=9)
    assert tier.submit_put(key(1), obj) and tier.flush(30)
    same = Page(CHUNK_LAYOUT, seed=0)
    other = Page(TOKEN_MAJOR_LAYOUT, seed=0)
    untouched = raw(other.held)
    assert tier.get_into([(key(1), other.chunk)]) == [DirectRead.OTHER_FORMAT]
    assert raw(other.held) == untouched
    assert tier.get_into([(key(1), same.chunk)]) == [DirectRead.LOADED]
    assert raw(same.held) == raw(obj.tensor)
    assert counter(stats, TierCounter.GET_HITS) == 1 and counter(stats, TierCounter.GET_MISSES) == 0
    obj.ref_down()
    tier.close()


def test_another_shape_or_dtype_is_another_format(tmp_path):
    tier = make_tier(tmp_path)
    page = Page(CHUNK_LAYOUT, seed=1)
    tier.put_buffers([(key(1), page.chunk)])
    for shape, dtype in (((2, 3, 16, 32), torch.bfloat16), (CHUNK_SHAPE, torch.float16)):
        other = Page(CHUNK_LAYOUT, seed=2, shape=shape, dtype=dtype)
        assert tier.get_into([(key(1), other.chunk)]) == [DirectRead.OTHER_FORMAT]
    tier.close()


@pytest.mark.parametrize("damage", ["bit_flip", "truncated", "extended", "header", "gone"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_damaged_file_is_a_counted_miss_never_raised(tmp_path, layout, damage):
    stats = Stats()
    tier = make_tier(tmp_path, stats)
    pages = [Page(layout, seed) for seed in range(2)]
    tier.put_buffers([(key(i), p.chunk) for i, p in enumerate(pages)])
    path = tier.path_of(tier.file_name(key(0)))
    data = bytearray(path.read_bytes())
    if damage == "bit_flip":
        data[-10] ^= 0x40
    elif damage == "truncated":
        data = data[:-100]
    elif damage == "extended":
        data += b"\0"
    elif damage == "header":
        data[30] ^= 0xFF
    path.write_bytes(bytes(data))
    if damage == "gone":
        path.unlink()
    got = tier.get_into([(key(i), p.chunk) for i, p in enumerate(pages)])
    assert got == [DirectRead.MISSING, DirectRead.LOADED]
    assert counter(stats, TierCounter.GET_MISSES) == 1
    assert counter(stats, TierCounter.CORRUPT) == (0 if damage == "gone" else 1)
    assert stats.get(Counter.CORRUPT_CHUNKS) == (0 if damage == "gone" else 1)
    assert not path.exists() and tier.contains_many([key(0), key(1)]) == [False, True]
    tier.close()


def test_the_cap_holds_and_a_chunk_larger_than_it_is_dropped(tmp_path):
    stats = Stats()
    page = Page(CHUNK_LAYOUT, seed=0)
    file_bytes = page.chunk.nbytes + 512  # payload + prefix and header, at most
    tier = make_tier(tmp_path, stats, capacity_bytes=3 * file_bytes)
    for i in range(6):
        assert tier.put_buffers([(key(i), Page(CHUNK_LAYOUT, seed=i).chunk)]) == [True]
        files_bytes = sum(p.stat().st_size for p in tmp_path.rglob("*.kvt"))
        assert tier.used_bytes == files_bytes <= 3 * file_bytes
    assert counter(stats, TierCounter.EVICTIONS) >= 3
    assert tier.contains_many([key(0), key(5)]) == [False, True]
    small = make_tier(tmp_path / "small", stats, capacity_bytes=1000)
    assert small.put_buffers([(key(1), page.chunk)]) == [False]
    assert counter(stats, TierCounter.DROPPED_NO_SPACE) == 1
    small.close()
    tier.close()


def test_a_chunk_already_stored_is_not_written_again(tmp_path):
    stats = Stats()
    tier = make_tier(tmp_path, stats)
    page = Page(TOKEN_MAJOR_LAYOUT, seed=0)
    assert tier.put_buffers([(key(1), page.chunk)]) == [True]
    path = tier.path_of(tier.file_name(key(1)))
    before = path.stat().st_mtime_ns
    assert tier.put_buffers([(key(1), page.chunk)]) == [True]
    assert path.stat().st_mtime_ns == before and counter(stats, TierCounter.PUT_CHUNKS) == 1
    tier.close()


def test_a_write_error_is_a_counted_drop(tmp_path, monkeypatch):
    stats = Stats()
    tier = make_tier(tmp_path, stats)

    def refuse(*args, **kwargs):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "writev", refuse)
    assert tier.put_buffers([(key(1), Page(CHUNK_LAYOUT, seed=0).chunk)]) == [False]
    assert counter(stats, TierCounter.DROPPED_ERROR) == 1
    assert tier.used_bytes == 0 and not list(tmp_path.rglob("*.tmp"))
    tier.close()
