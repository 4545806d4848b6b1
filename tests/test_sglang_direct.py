"""The SGLang backend's direct path: with the disk tier alone, pages go between SGLang's
real host pools and their files with no copy in memory (``page_store.py``). Round trips,
pages written from one layout read into another, files of the staged path, damage, and
the disk cap (docs/sglang.md).

Runs in .venv-sglang (``make test-sglang``); skipped where SGLang is not installed.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip(
    "sglang.srt.mem_cache.hicache_storage",
    reason="SGLang is not installed here: these tests run in .venv-sglang (make test-sglang)",
)

import torch
from support.sglang_hicache import (
    LAYOUTS,
    assert_pages_equal,
    make_backend,
    mha_pool,
    mla_pool,
    page_indices,
    randomize,
)

from kvtier.storage import wire
from kvtier.storage.disk import FileTier
from kvtier_kernels.dtypes import bits

KEYS = [f"{i:064x}" for i in range(1, 9)]
POOLS = {"mha": mha_pool, "mla": mla_pool}


def disk_only(tmp_path: Path, **extra) -> dict:
    return {"local_disk": str(tmp_path / "disk"), "local_cpu": False, **extra}


def cpu_and_disk(tmp_path: Path) -> dict:
    return {"local_disk": str(tmp_path / "disk"), "max_local_cpu_size": 0.05}


def no_staging(backend, monkeypatch) -> None:
    """Fail the test if a page is staged through kvtier's pool."""

    def staged(*args):
        raise AssertionError("a page was staged through kvtier's pool")

    monkeypatch.setattr(backend.storage, "allocate", staged)
    monkeypatch.setattr(backend.storage, "get_many", staged)


def stored_layouts(backend, keys) -> list[str]:
    """The byte order recorded in each page's file header."""
    _, fmt = backend._pools["kv"]
    tier: FileTier = backend.storage.lower[0]
    layouts = []
    for page_key in keys:
        key = backend.keys.key(page_key, fmt)
        blob = tier.path_of(tier.file_name(key)).read_bytes()
        header, _ = wire.split(blob, key.to_string())
        layouts.append(header.layout)
    return layouts


@pytest.mark.parametrize("kind", ["mha", "mla"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_direct_round_trip_is_bit_exact(tmp_path, monkeypatch, kind, layout):
    pool = POOLS[kind](layout)
    backend = make_backend(pool, disk_only(tmp_path))
    assert backend.storage.sole_disk is not None
    no_staging(backend, monkeypatch)
    assert backend.batch_set_v1(KEYS[:3], page_indices(pool, [1, 2, 3])) == [True] * 3
    order = wire.TOKEN_MAJOR_LAYOUT if layout == "page_first" else wire.CHUNK_LAYOUT
    assert stored_layouts(backend, KEYS[:3]) == [order] * 3
    assert backend.batch_get_v1(KEYS[:3], page_indices(pool, [9, 10, 11])) == [True] * 3
    assert_pages_equal(pool, [1, 2, 3], pool, [9, 10, 11])
    counters = backend.metrics()["counters"]
    page_bytes = pool.get_data_page(0).numel() * pool.dtype.itemsize
    assert counters["stored_chunks"] == 3 and counters["stored_bytes"] == 3 * page_bytes
    assert counters["retrieve_hit_tokens"] == 3 * pool.page_size
    assert backend.get_stats().backup_pgs == [3]
    backend.close()


@pytest.mark.parametrize("kind", ["mha", "mla"])
@pytest.mark.parametrize(
    ("written", "read"),
    [
        ("page_first", "layer_first"),
        ("page_first", "page_first_direct"),
        ("layer_first", "page_first"),
        ("page_first_direct", "page_first"),
    ],
)
@pytest.mark.parametrize("reader_tiers", ["disk", "cpu+disk"])
def test_pages_written_from_one_layout_load_into_another(
    tmp_path, kind, written, read, reader_tiers
):
    """A pool's layout may change and keep its cache: the file says its byte order."""
    source = POOLS[kind](written)
    writer = make_backend(source, disk_only(tmp_path))
    assert all(writer.batch_set_v1(KEYS[:3], page_indices(source, [3, 4, 5])))
    target = POOLS[kind](read)
    randomize(target, seed=7)
    extra = disk_only(tmp_path) if reader_tiers == "disk" else cpu_and_disk(tmp_path)
    reader = make_backend(target, extra)
    assert reader.batch_get_v1(KEYS[:3], page_indices(target, [5, 6, 7])) == [True] * 3
    assert_pages_equal(source, [3, 4, 5], target, [5, 6, 7])
    assert reader.metrics()["counters"]["corrupt_chunks_rejected"] == 0
    writer.close()
    reader.close()


@pytest.mark.parametrize("kind", ["mha", "mla"])
@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_files_of_the_staged_path_still_read(tmp_path, kind, layout):
    """Pages stored the staged way (the chunk layout, the only one kvtier wrote before the
    direct path) load into a disk-only backend: directly where the pool's order is the
    chunk layout, staged otherwise."""
    pool = POOLS[kind](layout)
    writer = make_backend(pool, cpu_and_disk(tmp_path))
    assert all(writer.batch_set_v1(KEYS[:2], page_indices(pool, [1, 2])))
    assert stored_layouts(writer, KEYS[:2]) == [wire.CHUNK_LAYOUT] * 2
    reader = make_backend(pool, disk_only(tmp_path))
    assert reader.batch_get_v1(KEYS[:2], page_indices(pool, [12, 13])) == [True, True]
    assert_pages_equal(pool, [1, 2], pool, [12, 13])
    writer.close()
    reader.close()


def _page_file(backend, page_key: str) -> Path:
    _, fmt = backend._pools["kv"]
    tier: FileTier = backend.storage.lower[0]
    return tier.path_of(tier.file_name(backend.keys.key(page_key, fmt)))


@pytest.mark.parametrize("kind", ["mha", "mla"])
@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
@pytest.mark.parametrize("damage", ["flip_payload_byte", "truncate", "extend", "delete"])
def test_a_damaged_page_is_a_miss_on_the_direct_path(tmp_path, kind, layout, damage):
    pool = POOLS[kind](layout)
    backend = make_backend(pool, disk_only(tmp_path))
    assert all(backend.batch_set_v1(KEYS[:3], page_indices(pool, [1, 2, 3])))
    target = _page_file(backend, KEYS[1])
    data = bytearray(target.read_bytes())
    if damage == "flip_payload_byte":
        data[-5] ^= 0xFF
    elif damage == "truncate":
        data = data[:-100]
    elif damage == "extend":
        data += b"\0" * 8
    target.write_bytes(bytes(data))
    if damage == "delete":
        target.unlink()
    loaded = backend.batch_get_v1(KEYS[:3], page_indices(pool, [19, 20, 21]))
    assert loaded == [True, False, False]  # SGLang stops at the first False: a miss
    assert_pages_equal(pool, [1], pool, [19])
    assert not target.exists() and backend.batch_exists(KEYS[:3]) == 1
    counters = backend.metrics()["counters"]
    assert counters["corrupt_chunks_rejected"] == (0 if damage == "delete" else 1)
    assert counters["retrieve_hit_tokens"] == pool.page_size
    backend.close()


def test_the_disk_cap_holds_on_the_direct_path(tmp_path):
    pool = mha_pool("page_first", layers=4, heads=4, head_dim=128, page_size=16)
    page_bytes = pool.get_data_page(0).numel() * pool.dtype.itemsize  # 64 KiB
    cap_gb = 5 * page_bytes / 2**30  # room for four files with their headers
    backend = make_backend(pool, disk_only(tmp_path, max_local_disk_size=cap_gb))
    for round_ in range(3):
        keys = [f"{round_:02x}{i:062x}" for i in range(3)]
        assert backend.batch_set_v1(keys, page_indices(pool, [1, 2, 3])) == [True] * 3
        on_disk = sum(p.stat().st_size for p in (tmp_path / "disk").rglob("*.kvt"))
        assert on_disk <= cap_gb * 2**30
    assert backend.batch_exists(keys) == 3  # the newest pages are kept
    assert backend.metrics()["counters"]["disk_evictions"] >= 4
    backend.close()


def test_a_write_fault_on_the_direct_path_is_false_not_raised(tmp_path, monkeypatch):
    pool = mha_pool("layer_first")
    backend = make_backend(pool, disk_only(tmp_path))
    tier: FileTier = backend.storage.lower[0]

    def broken(*args, **kwargs):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(tier, "_write_file", broken)
    assert backend.batch_set_v1(KEYS[:2], page_indices(pool, [1, 2])) == [False, False]
    monkeypatch.setattr(tier, "put_buffers", lambda items: 1 / 0)  # a bug, not a fault
    assert backend.batch_set_v1(KEYS[:2], page_indices(pool, [1, 2])) == [False, False]
    assert backend.batch_exists(KEYS[:2]) == 0
    before = bits(pool.get_data_page(5 * pool.page_size, flat=False)).clone()
    assert backend.batch_get_v1(KEYS[:1], page_indices(pool, [5])) == [False]
    assert torch.equal(before, bits(pool.get_data_page(5 * pool.page_size, flat=False)))
    backend.close()
