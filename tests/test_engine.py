"""The cache engine end to end on the CPU: store → evict → retrieve, bit-exact."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support.tiers import fill, key, make_pool, make_tier

from kvtier.chunker import RequestExtras
from kvtier.config import load_config
from kvtier.engine import CacheEngine, EngineMetadata
from kvtier.observability.stats import Counter
from kvtier_kernels import PagedKV


def make_engine(
    layout="vllm_cpu",
    *,
    num_layers=3,
    num_blocks=64,
    block_size=4,
    num_heads=2,
    head_size=8,
    dtype=torch.bfloat16,
    seed=0,
    **overrides,
) -> CacheEngine:
    config = load_config({"chunk_size": 8, "max_local_cpu_size": 0.01, **overrides}, env={})
    paged = PagedKV.empty(
        layout,
        num_layers=num_layers,
        num_blocks=num_blocks,
        block_size=block_size,
        num_heads=num_heads,
        head_size=head_size,
        dtype=dtype,
    )
    gen = torch.Generator().manual_seed(seed)
    for tensor in paged.tensors:
        tensor.copy_(torch.randn(tensor.shape, generator=gen).to(dtype))
    return CacheEngine(config, EngineMetadata("test-model"), paged)


def kv_at(engine: CacheEngine, slots: torch.Tensor) -> torch.Tensor:
    """[layers, kv, tokens, heads, head_size] of the given slots, as raw bits."""
    paged = engine.paged_io.paged
    blocks, offsets = slots // paged.block_size, slots % paged.block_size
    rows = torch.stack([paged.layer_view(i)[:, blocks, offsets] for i in range(paged.num_layers)])
    return (
        rows.view(torch.uint8)
        if rows.dtype.itemsize == 1
        else rows.view(torch.int16 if rows.dtype.itemsize == 2 else torch.int32)
    )


def assert_kv_equal(engine, got_slots, want: torch.Tensor, what: str) -> None:
    got = kv_at(engine, got_slots)
    if not torch.equal(got, want):
        idx = (got != want).nonzero()[0].tolist()
        layer, plane, token, head, dim = idx
        raise AssertionError(
            f"{what}: first mismatch at layer {layer}, {'KV'[plane] if plane < 2 else plane}, "
            f"token {token} (slot {int(got_slots[token])}), head {head}, dim {dim}"
        )


@pytest.mark.parametrize(
    "layout", ["vllm_cpu", "vllm_nhd", "flash_nhd", "flashinfer_hnd", "mla", "cross_layer"]
)
@pytest.mark.parametrize("num_tokens", [8, 29, 40])
def test_store_evict_retrieve_bit_exact(layout, num_tokens):
    mla = layout == "mla"
    engine = make_engine(layout, num_heads=1 if mla else 2, head_size=576 if mla else 8)
    tokens = torch.arange(100, 100 + num_tokens)
    src = torch.randperm(engine.paged_io.paged.num_slots)[:num_tokens]
    reference = kv_at(engine, src)
    result = engine.store(tokens, slot_mapping=src)
    full = num_tokens // 8 * 8
    assert (result.stored_chunks, result.stored_tokens) == (num_tokens // 8, full)
    assert result.stored_bytes == reference[:, :, :full].numel() * 2  # bf16
    # the engine forgets: overwrite the source pages
    for t in engine.paged_io.paged.tensors:
        t.zero_()
    dst = torch.randperm(engine.paged_io.paged.num_slots)[:num_tokens]
    assert engine.lookup(tokens) == full
    assert engine.retrieve(tokens, slot_mapping=dst) == full
    assert_kv_equal(engine, dst[:full], reference[:, :, :full], "retrieved prefix")
    # tokens of the partial last chunk were not touched
    assert bool((kv_at(engine, dst[full:]) == 0).all())


def test_evicted_middle_chunk_stops_retrieval_there():
    engine = make_engine()
    tokens = torch.arange(40)
    src = torch.arange(40)
    reference = kv_at(engine, src)
    engine.store(tokens, slot_mapping=src)
    chunks = engine.chunker.chunks(tokens)
    assert engine.storage.remove(chunks[2].key)
    dst = torch.arange(100, 140)
    before = kv_at(engine, dst)
    assert engine.lookup(tokens) == 16
    assert engine.retrieve(tokens, slot_mapping=dst) == 16
    assert_kv_equal(engine, dst[:16], reference[:, :, :16], "prefix before the gap")
    assert torch.equal(kv_at(engine, dst[16:]), before[:, :, 16:]), "wrote past the missing chunk"
    snap = engine.stats.snapshot()
    assert snap[Counter.HIT_TOKENS] == 16 and snap[Counter.REQUESTED_TOKENS] == 40
    assert snap["retrieve_hit_ratio"] == pytest.approx(0.4)


def test_store_skips_existing_and_masked_chunks():
    engine = make_engine()
    tokens = torch.arange(32)
    assert engine.store(tokens[:16], slot_mapping=torch.arange(16)).stored_chunks == 2
    result = engine.store(tokens, slot_mapping=torch.arange(32))
    assert (result.stored_chunks, result.skipped_existing) == (2, 2)
    other = torch.arange(1000, 1032)
    mask = torch.tensor([False] * 8 + [True] * 24)
    result = engine.store(other, mask, slot_mapping=torch.arange(32))
    assert result.stored_chunks == 3 and engine.lookup(other) == 0  # chunk 0 was never stored


def test_retrieve_with_mask_leaves_engine_prefix_alone():
    engine = make_engine()
    tokens, src = torch.arange(24), torch.arange(24)
    reference = kv_at(engine, src)
    engine.store(tokens, slot_mapping=src)
    dst = torch.arange(200, 224)
    before = kv_at(engine, dst)
    mask = torch.tensor([False] * 8 + [True] * 16)
    assert engine.retrieve(tokens, mask, slot_mapping=dst) == 24
    assert torch.equal(kv_at(engine, dst[:8]), before[:, :, :8])
    assert_kv_equal(engine, dst[8:], reference[:, :, 8:], "unmasked part")


def test_negative_slots():
    engine = make_engine()
    tokens = torch.arange(24)
    src = torch.arange(24)
    reference = kv_at(engine, src)
    bad = src.clone()
    bad[12] = -1  # a token whose KV is not in the cache: its chunk and later ones are not stored
    assert engine.store(tokens, slot_mapping=bad).stored_chunks == 1
    engine.store(tokens, slot_mapping=src)
    dst = torch.arange(200, 224)
    dst[3] = -1  # skip writing one token on load
    before = kv_at(engine, torch.tensor([0]))
    assert engine.retrieve(tokens, slot_mapping=dst) == 24
    keep = dst >= 0
    assert_kv_equal(engine, dst[keep], reference[:, :, keep], "loaded tokens")
    assert torch.equal(kv_at(engine, torch.tensor([0])), before)


def test_partial_last_chunk_when_configured():
    engine = make_engine(save_unfull_chunk=True)
    tokens, src = torch.arange(29), torch.arange(29)
    reference = kv_at(engine, src)
    assert engine.store(tokens, slot_mapping=src).stored_tokens == 29
    dst = torch.arange(100, 129)
    assert engine.lookup(tokens) == 29
    assert engine.retrieve(tokens, slot_mapping=dst) == 29
    assert_kv_equal(engine, dst, reference, "with partial chunk")
    # a longer prompt does not reuse the partial chunk as if it were full
    longer = torch.arange(32)
    assert engine.lookup(longer) == 24


def test_exhausted_memory_skips_store_and_keeps_prefix():
    # room for 3 chunks only; a 6-chunk prompt keeps its first 3 (its own prefix is pinned
    # while it is stored, so it cannot evict itself)
    chunk_bytes = 2 * 3 * 8 * 16 * 2  # kv * layers * tokens * hidden * bf16
    engine = make_engine(max_local_cpu_size=3 * chunk_bytes / 2**30)
    result = engine.store(torch.arange(48), slot_mapping=torch.arange(48))
    assert (result.stored_chunks, result.skipped_no_memory) == (3, 3)
    assert engine.lookup(torch.arange(48)) == 24
    assert engine.stats.get(Counter.STORE_SKIPPED_NO_MEMORY) == 3
    # a later prompt evicts the older chunks instead of failing
    assert engine.store(torch.arange(500, 516), slot_mapping=torch.arange(16)).stored_chunks == 2
    assert engine.stats.get(Counter.EVICTIONS) == 2


@pytest.mark.parametrize("pool_chunks", [0.5, 1, 3, 3.5])
def test_max_load_chunks_is_what_the_cpu_pool_stages_at_once(pool_chunks):
    """A load holds all its chunks in the CPU pool at once: one of more chunks than
    ``max_load_chunks`` could not complete."""
    chunk_bytes = 2 * 3 * 8 * 16 * 2
    engine = make_engine(max_local_cpu_size=pool_chunks * chunk_bytes / 2**30)
    assert engine.max_load_chunks == int(pool_chunks)
    engine.close()


@pytest.mark.parametrize("chunks_held", [0, 1])
def test_a_cpu_pool_smaller_than_a_chunk_starts_warns_and_skips_stores(caplog, chunks_held):
    """max_local_cpu_size is any size > 0: a pool that rounds to less than a byte, or holds
    less than one chunk, is not an error; a store is skipped and counted, once warned."""
    chunk_bytes = 2 * 3 * 8 * 16 * 2
    size = chunk_bytes / 2**30 if chunks_held else 1e-12
    with caplog.at_level("WARNING", logger="kvtier.engine"):
        engine = make_engine(max_local_cpu_size=size)
    warned = "is smaller than one chunk of this KV cache (1536 bytes)" in caplog.text
    assert warned is not bool(chunks_held), caplog.text
    result = engine.store(torch.arange(16), slot_mapping=torch.arange(16))
    assert (result.stored_chunks, result.skipped_no_memory) == (chunks_held, 2 - chunks_held)
    assert engine.lookup(torch.arange(16)) == 8 * chunks_held
    assert engine.stats.get(Counter.ALLOC_FAILURES) == 1
    engine.close()


def test_extras_and_model_separate_caches():
    engine = make_engine()
    tokens, src = torch.arange(16), torch.arange(16)
    engine.store(tokens, slot_mapping=src, extras=RequestExtras(cache_salt="a"))
    assert engine.lookup(tokens) == 0
    assert engine.lookup(tokens, extras=RequestExtras(cache_salt="b")) == 0
    assert engine.lookup(tokens, extras=RequestExtras(cache_salt="a")) == 16


def test_stats_count_what_happened():
    engine = make_engine()
    engine.store(torch.arange(20), slot_mapping=torch.arange(20))  # 2 chunks
    engine.retrieve(torch.arange(20), slot_mapping=torch.arange(50, 70))
    snap = engine.stats.snapshot()
    chunk_bytes = 2 * 3 * 8 * 16 * 2  # kv * layers * tokens * hidden * bf16
    assert snap[Counter.STORED_CHUNKS] == 2
    assert snap[Counter.STORED_BYTES] == 2 * chunk_bytes
    assert snap[Counter.LOADED_BYTES] == 2 * chunk_bytes
    assert snap[Counter.HIT_TOKENS] == 16
    assert snap["store_gbps"] > 0 and snap["load_gbps"] > 0


def test_errors_name_the_problem():
    engine = make_engine()
    with pytest.raises(ValueError, match="slot_mapping has shape"):
        engine.store(torch.arange(16), slot_mapping=torch.arange(8))
    unbound = CacheEngine(load_config(env={}), EngineMetadata("m"))
    with pytest.raises(RuntimeError, match="KV dtype"):
        unbound.lookup(torch.arange(8))
    with pytest.raises(ValueError, match=r"differs from metadata\.kv_dtype"):
        CacheEngine(
            load_config(env={}), EngineMetadata("m", kv_dtype="float16"), engine.paged_io.paged
        )


def test_a_closed_engine_says_so():
    engine = make_engine()
    tokens, slots = torch.arange(16), torch.arange(16)
    engine.store(tokens, slot_mapping=slots)
    engine.close()
    for call in (
        lambda: engine.store(tokens, slot_mapping=slots),
        lambda: engine.retrieve(tokens, slot_mapping=slots),
        lambda: engine.lookup(tokens),
        lambda: engine.lookup_hashes([b"h"]),
    ):
        with pytest.raises(RuntimeError, match="CacheEngine is closed"):
            call()
    engine.close()  # again: nothing more to release


@settings(max_examples=40, deadline=None)
@given(
    num_tokens=st.integers(0, 60),
    chunk_size=st.sampled_from([1, 4, 8, 16]),
    removed=st.none() | st.integers(0, 20),
    partial=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_property_retrieve_returns_longest_stored_prefix(
    num_tokens, chunk_size, removed, partial, seed
):
    engine = make_engine(chunk_size=chunk_size, save_unfull_chunk=partial, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 50, (num_tokens,), generator=gen)
    num_slots = engine.paged_io.paged.num_slots
    src = torch.randperm(num_slots, generator=gen)[:num_tokens]
    reference = kv_at(engine, src)
    engine.store(tokens, slot_mapping=src)
    chunks = engine.chunker.chunks(tokens, include_partial=partial)
    expected = chunks[-1].end if chunks else 0
    if removed is not None and removed < len(chunks):
        engine.storage.remove(chunks[removed].key)
        expected = chunks[removed].start
    dst = torch.randperm(num_slots, generator=gen)[:num_tokens]
    assert engine.lookup(tokens) == expected
    assert engine.retrieve(tokens, slot_mapping=dst) == expected
    assert_kv_equal(engine, dst[:expected], reference[:, :, :expected], "property")
    engine.close()


@pytest.mark.parametrize("layout", ["vllm_cpu", "vllm_nhd", "cross_layer"])
def test_engine_through_triton_interpreter_matches_torch(layout):
    """kernel_backend selects the implementation; the Triton kernels (interpreted on CPU)
    move the same bytes as the torch reference."""
    torch_engine = make_engine(layout, num_layers=2, kernel_backend="torch")
    triton_engine = make_engine(layout, num_layers=2, kernel_backend="interpret")
    tokens, src = torch.arange(16), torch.arange(16)
    dst = torch.arange(40, 56)
    for engine in (torch_engine, triton_engine):
        engine.store(tokens, slot_mapping=src)
        for t in engine.paged_io.paged.tensors:
            t.zero_()
        assert engine.retrieve(tokens, slot_mapping=dst) == 16
    assert torch.equal(kv_at(torch_engine, dst), kv_at(triton_engine, dst))
    assert bool((kv_at(triton_engine, dst) != 0).any())


def test_store_does_not_evict_its_own_already_stored_prefix():
    chunk_bytes = 2 * 3 * 8 * 16 * 2
    engine = make_engine(max_local_cpu_size=3 * chunk_bytes / 2**30)
    tokens = torch.arange(48)
    assert engine.store(tokens[:8], slot_mapping=torch.arange(8)).stored_chunks == 1
    # chunk 0 is the least recently used object, but this prompt needs it as its prefix
    result = engine.store(tokens, slot_mapping=torch.arange(48))
    assert (result.skipped_existing, result.stored_chunks, result.skipped_no_memory) == (1, 2, 3)
    assert engine.lookup(tokens) == 24


@pytest.mark.parametrize("direction", ["store", "retrieve"])
def test_a_copy_that_fails_mid_transfer_leaves_nothing_held(monkeypatch, direction):
    """store/retrieve queue each chunk's copy as soon as the chunk is staged or accepted;
    a copy that raises part-way releases every buffer and pin the transfer held."""
    engine = make_engine()
    tokens = torch.arange(32)  # 4 chunks
    if direction == "retrieve":
        engine.store(tokens, slot_mapping=torch.arange(32))
    io = engine.paged_io
    name = "from_engine" if direction == "store" else "to_engine"
    real, calls = getattr(io, name), []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("copy failed")
        return real(*args, **kwargs)

    monkeypatch.setattr(io, name, failing)
    with pytest.raises(RuntimeError, match="copy failed"):
        if direction == "store":
            engine.store(tokens, slot_mapping=torch.arange(32))
        else:
            engine.retrieve(tokens, slot_mapping=torch.arange(100, 132))
    gauges = engine.storage.gauges()
    assert gauges["cpu_pinned_chunks"] == 0
    held = 4 if direction == "retrieve" else 0  # the stored chunks stay stored
    assert gauges["cpu_chunks"] == held
    if direction == "store":  # no staged buffer is left allocated
        assert gauges["cpu_pool_used_bytes"] == 0
    monkeypatch.setattr(io, name, real)
    engine.store(tokens, slot_mapping=torch.arange(32))
    assert engine.retrieve(tokens, slot_mapping=torch.arange(100, 132)) == 32


def test_a_store_releases_the_chunks_it_pinned_even_when_their_keys_were_stored_again():
    """A store pins the chunks already held until it commits; if another thread clears
    the tier and stores the same prompt meanwhile, the commit unpins its own objects
    (not the new ones under the same keys) and every byte returns to the pool."""
    engine = make_engine()
    tokens, slots = torch.arange(16), torch.arange(16)
    engine.store(tokens, slot_mapping=slots)
    transfer = engine.begin_store(engine.chunker.chunks(tokens), slots)  # pins both chunks
    engine.clear()
    engine.store(tokens, slot_mapping=slots)
    transfer.commit()
    assert engine.storage.gauges()["cpu_pinned_chunks"] == 0
    engine.clear()
    assert engine.storage.cpu.pool.used_bytes() == 0


def test_a_load_that_fails_midway_returns_every_chunk_it_fetched(monkeypatch):
    """A check that raises on the third chunk (a tier that cannot drop a corrupt chunk,
    say): the load fails, and the chunks fetched after it go back to the pool too."""
    engine = make_engine(local_cpu=True)
    tokens = torch.arange(40)  # five chunks
    engine.store(tokens, slot_mapping=torch.arange(40))
    held = engine.storage.cpu.pool.used_bytes()
    accept, seen = engine.checked.accept, []

    def failing_on_the_third(key, *args):
        seen.append(key)
        if len(seen) == 3:
            raise OSError("cannot drop it")
        return accept(key, *args)

    monkeypatch.setattr(engine.checked, "accept", failing_on_the_third)
    with pytest.raises(OSError, match="cannot drop it"):
        engine.retrieve(tokens, slot_mapping=torch.arange(100, 140))
    assert engine.storage.cpu.pool.used_bytes() == held
    assert engine.storage.gauges()["cpu_pinned_chunks"] == 0
    engine.clear()
    assert engine.storage.cpu.pool.used_bytes() == 0


def test_parallel_ranks_on_one_disk_keep_their_own_chunks_across_a_restart(tmp_path):
    """The ranks of a tensor-parallel engine share ``local_disk``, each bounded to
    ``max_local_disk_size``. A restarted rank rebuilds its index from its own files only:
    with one tree for all ranks it indexed its peer's files too, twice its bound, and
    evicted half of every rank's chunks (a chunk one rank lacks is a miss for all)."""
    pool = make_pool(16)
    probe = make_tier(tmp_path / "probe")
    assert probe.submit_put(key(0), fill(pool, 0)) and probe.flush(10)
    per_rank = 6  # chunks each rank's bound holds
    config = load_config(
        {
            "local_disk": str(tmp_path / "disk"),
            "max_local_disk_size": per_rank * probe.used_bytes / 2**30,
            "max_local_cpu_size": 0.01,
        },
        env={},
    )
    probe.close()

    def disks():
        return [CacheEngine(config, EngineMetadata("m", 2, rank)) for rank in range(2)]

    engines = disks()
    for rank, engine in enumerate(engines):
        (disk,) = engine.storage.lower
        for i in range(per_rank):
            assert disk.submit_put(key(i, rank=rank), fill(pool, i))
        assert disk.flush(10)
        engine.close()
    for rank, engine in enumerate(disks()):
        (disk,) = engine.storage.lower
        assert disk.contains_many([key(i, rank=rank) for i in range(per_rank)]) == [True] * per_rank
        engine.close()
    pool.close()


def test_without_a_cpu_tier_a_store_copies_out_no_chunk_the_disk_already_holds(
    tmp_path, monkeypatch
):
    """``local_cpu: false`` over a local disk alone: storing a prompt again skips the
    chunks the disk's index holds (counted as existing) without copying them out of the
    engine, and still marks each of their files used, for eviction order."""
    engine = make_engine(local_cpu=False, local_disk=str(tmp_path), max_local_disk_size=0.01)
    tokens, slots = torch.arange(32), torch.arange(32)  # 4 chunks
    assert engine.store(tokens[:16], slot_mapping=slots[:16]).stored_chunks == 2
    assert engine.flush(10)
    (disk,) = engine.storage.lower
    copies, used = [], []
    monkeypatch.setattr(engine.paged_io, "from_engine", spy(engine.paged_io.from_engine, copies))
    monkeypatch.setattr(disk.files, "touch", spy(disk.files.touch, used))

    result = engine.store(tokens, slot_mapping=slots)
    assert engine.flush(10)
    assert (result.stored_chunks, result.skipped_existing, len(copies)) == (2, 2, 2)
    held = [disk.file_name(chunk.key) for chunk in engine.chunker.chunks(tokens[:16])]
    assert set(held) <= {args[0] for args in used}
    assert engine.stats.get(Counter.STORE_SKIPPED_EXISTING) == 2
    assert engine.retrieve(tokens, slot_mapping=torch.arange(100, 132)) == 32
    engine.close()


def spy(fn, calls: list):
    """``fn``, recording the arguments of each call in ``calls``."""

    def recorded(*args, **kwargs):
        calls.append(args)
        return fn(*args, **kwargs)

    return recorded


def test_a_hit_larger_than_the_cpu_pool_is_loaded_in_rounds(tmp_path):
    """The disk holds a prompt of 8 chunks, the CPU pool room for 3, and it holds the
    prompt's last 3 (stored last): a retrieve loads the whole prompt in rounds of what
    the pool holds, bit-exact, and counts one load of all of it."""
    chunk_bytes = 2 * 3 * 8 * 16 * 2
    engine = make_engine(
        max_local_cpu_size=3 * chunk_bytes / 2**30,
        local_disk=str(tmp_path),
        max_local_disk_size=0.01,
    )
    tokens, src = torch.arange(64), torch.arange(64)
    reference = kv_at(engine, src)
    for start, end in [(0, 24), (24, 48), (48, 64)]:
        mask = torch.arange(end) >= start
        assert engine.store(tokens[:end], mask, slot_mapping=src[:end]).stored_chunks
        assert engine.flush(10)  # the disk writes let go of the pool's buffers
    for t in engine.paged_io.paged.tensors:
        t.zero_()
    dst = torch.arange(100, 164)
    assert engine.lookup(tokens) == 64
    assert engine.retrieve(tokens, slot_mapping=dst) == 64
    assert_kv_equal(engine, dst, reference, "loaded in rounds")
    assert (engine.stats.get(Counter.RETRIEVE_REQUESTS), engine.stats.get(Counter.HIT_TOKENS)) == (
        1,
        64,
    )
    pool = engine.storage.cpu.pool
    assert pool.used_bytes() == len(engine.storage.cpu) * chunk_bytes
    engine.close()
