"""kvtier's SGLang HiCache backend against SGLang's own file backend (``HiCacheFile``),
moving the same 64-token pages of SGLang's real host pool in the same run.

Shape: 16 layers, 8 KV heads, head size 128, bf16 (MHA) — one 64-token page is 4 MiB;
every round moves 16 pages (64 MiB) between SGLang's host pool and storage, for the
``page_first`` and ``layer_first`` host layouts. Figures are GB/s of page bytes:

- kvtier set = ``batch_set_v1`` (SGLang's zero-copy path, ``interface_v1: 1``): pages
  copied out of the host pool into kvtier buffers, checksummed, kept in the CPU tier and
  written to the disk tier (wire header, temp file, rename) before it returns; with the
  disk tier alone, each page checksummed in the host pool and written from it (``writev``
  of the header and the page's runs of pool memory, temp file, rename);
- kvtier get = ``batch_get_v1``: pages fetched (CPU tier, else the disk tier), verified and
  copied into the host pool; with the disk tier alone, read straight into the host pool
  (``preadv``) and verified there;
- baseline = ``HiCacheFile`` on the path SGLang's controller takes for it (it has no v1
  methods): set = ``batch_set(keys, [host_pool.get_data_page(i)])``, raw bytes to a temp
  file and a rename; get = ``batch_get(keys, dummy_pages)`` then
  ``set_from_flat_data_page`` into the host pool.

kvtier runs twice: ``disk`` (``local_cpu: false``: the disk tier only, the same medium as
the baseline; the direct path) and ``cpu+disk`` (the default deployment: reads hit the CPU tier). Both
backends' files are in the same temporary directory (page cache); every set round starts
from an empty store (untimed). Each figure is the median of 7 rounds after one warm-up,
kvtier and HiCacheFile timed in alternation, round by round (``interleaved_medians``).
Both run with one torch thread: the page copies are a few MiB, and on a machine whose
cores are busy with other work torch's OpenMP threads wait on each other (a 4 MiB copy
dropped from 40 GB/s to 0.5 GB/s with two threads on a shared two-core machine).

Runs in .venv-sglang (``make bench-sglang``); skipped where SGLang is not installed.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch
from conftest import interleaved_medians

pytest.importorskip(
    "sglang.srt.mem_cache.hicache_storage",
    reason="SGLang is not installed here: this benchmark runs in .venv-sglang (make bench-sglang)",
)
from sglang.srt.mem_cache.hicache_storage import HiCacheFile
from support.sglang_hicache import make_backend, mha_pool, page_indices, storage_config

RESULTS_NAME = "sglang"

PAGE_TOKENS = 64
PAGES = 16
ROUNDS = 7
KEYS = [f"{i:064x}" for i in range(1, PAGES + 1)]
SOURCE = list(range(PAGES))
TARGET = list(range(PAGES, 2 * PAGES))


def _pool(layout: str):
    return mha_pool(
        layout,
        layers=16,
        heads=8,
        head_dim=128,
        page_size=PAGE_TOKENS,
        device_tokens=PAGES * PAGE_TOKENS,
        ratio=2.0,
    )


def _gbps(pool, seconds: float) -> float:
    page_bytes = pool.get_data_page(0, flat=False).numel() * pool.dtype.itemsize
    return PAGES * page_bytes / seconds / 1e9


@pytest.fixture(autouse=True)
def one_torch_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def bench_dir():
    with tempfile.TemporaryDirectory(prefix="kvtier-sgl-", dir=os.environ.get("BENCH_DIR")) as d:
        yield Path(d)


def _file_backend(directory: Path) -> HiCacheFile:
    return HiCacheFile(storage_config({"file_storage_path": str(directory)}), str(directory))


def _file_set(backend: HiCacheFile, pool) -> None:
    """SGLang's controller for a backend without v1 methods (``_generic_page_set``)."""
    size = pool.page_size
    assert backend.batch_set(KEYS, [pool.get_data_page(p * size) for p in SOURCE])


def _file_get(backend: HiCacheFile, pool) -> None:
    """SGLang's controller for a backend without v1 methods (``_generic_page_get``)."""
    pages = backend.batch_get(KEYS, [pool.get_dummy_flat_data_page() for _ in KEYS])
    for page, target in zip(pages, TARGET, strict=True):
        assert page is not None
        pool.set_from_flat_data_page(target * pool.page_size, page)


@pytest.mark.parametrize("tiers", ["disk", "cpu+disk"])
@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_sglang_backend_set_get(benchmark, record, bench_dir, layout, tiers):
    pool = _pool(layout)
    baseline = _file_backend(bench_dir / "hicache-file")
    extra = {"local_disk": str(bench_dir / "kvtier"), "max_local_disk_size": 4}
    extra |= {"local_cpu": False} if tiers == "disk" else {"max_local_cpu_size": 1}
    kvtier = make_backend(pool, extra)
    source, target = page_indices(pool, SOURCE), page_indices(pool, TARGET)

    def kvtier_set():
        assert all(kvtier.batch_set_v1(KEYS, source))

    def kvtier_get():
        assert all(kvtier.batch_get_v1(KEYS, target))

    # kvtier and HiCacheFile timed in alternation, round by round: load from elsewhere on
    # the machine weighs on both alike
    set_seconds, file_set = interleaved_medians(
        kvtier_set,
        lambda: _file_set(baseline, pool),
        repeat=ROUNDS,
        warmup=1,
        setup=kvtier.clear,
        baseline_setup=baseline.clear,
    )
    get_seconds, file_get = interleaved_medians(
        kvtier_get, lambda: _file_get(baseline, pool), repeat=ROUNDS, warmup=1
    )
    benchmark.pedantic(kvtier_get, rounds=3, warmup_rounds=0)
    baseline.clear()
    for op, seconds, base in (("set", set_seconds, file_set), ("get", get_seconds, file_get)):
        record(
            metric=f"sglang batch_{op}_v1 {layout} kvtier {tiers}",
            value=_gbps(pool, seconds),
            unit="GB/s",
            baseline=f"HiCacheFile {op} (SGLang's generic path)",
            baseline_value=_gbps(pool, base),
        )
        print(
            f"\n{layout:12s} {tiers:8s} batch_{op}_v1 {_gbps(pool, seconds):6.2f} GB/s  "
            f"HiCacheFile {_gbps(pool, base):6.2f} GB/s  x{base / seconds:.2f}"
        )
    kvtier.close()
