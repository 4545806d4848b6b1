"""PagedIO's streams: on a GPU, gathers and scatters run on side streams ordered
against the engine's stream with events (a load is complete before the model's next work
reads it; a buffer is only read or released after ``stores_done``/``loads_done``). Off the
GPU the copies are synchronous and the waits return at once. The GPU tests are skipped
without one."""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch
from support.kv import bits, fill_random_

from kvtier.config import load_config
from kvtier.engine import CacheEngine, EngineMetadata
from kvtier.paged_io import PagedIO, _Streams
from kvtier.transfers import RetrieveTransfer, StoreTransfer
from kvtier_kernels import PagedKV, registry

has_gpu = torch.cuda.is_available()
LAYERS, BLOCKS, BLOCK_SIZE, HEADS, HEAD_SIZE = 3, 40, 16, 2, 64


def random_cache(layout: str, device: str = "cpu", seed: int = 0) -> PagedKV:
    paged = PagedKV.empty(
        layout,
        num_layers=LAYERS,
        num_blocks=BLOCKS,
        block_size=BLOCK_SIZE,
        num_heads=HEADS,
        head_size=HEAD_SIZE,
        dtype=torch.bfloat16,
        device=device,
    )
    gen = torch.Generator().manual_seed(seed)
    for t in paged.tensors:
        t.copy_(fill_random_(torch.empty_like(t, device="cpu"), gen))
    return paged


def make_connector(device: str, backend: str) -> PagedIO:
    return PagedIO(random_cache("vllm_nhd", device), backend)


def round_trip(connector: PagedIO, pinned: bool) -> None:
    """Gather 48 slots into a chunk, scatter it to 48 other slots, and check both copies
    bit for bit against a direct read of the cache."""
    device = connector.paged.device
    src = torch.randperm(BLOCKS * BLOCK_SIZE // 2)[:48].to(device)
    dst = src + BLOCKS * BLOCK_SIZE // 2
    chunk = torch.empty(connector.chunk_shape(48), dtype=connector.dtype)
    chunk = chunk.pin_memory() if pinned else chunk.to(device)
    connector.from_engine(chunk, src)
    connector.stores_done()
    views = [connector.paged.layer_view(i) for i in range(LAYERS)]
    expected = torch.stack([v[:, src // BLOCK_SIZE, src % BLOCK_SIZE].flatten(2) for v in views])
    assert torch.equal(bits(chunk.cpu()), bits(expected.transpose(0, 1).cpu()))
    connector.to_engine(chunk, dst)
    # no host sync here: the engine's stream waits for the load by itself
    got = torch.stack([v[:, dst // BLOCK_SIZE, dst % BLOCK_SIZE].flatten(2) for v in views])
    assert torch.equal(bits(got.transpose(0, 1).cpu()), bits(chunk.cpu()))
    connector.loads_done()


def test_cpu_copies_are_synchronous_and_need_no_streams():
    connector = make_connector("cpu", "torch")
    assert connector._streams is None
    round_trip(connector, pinned=False)


@pytest.mark.gpu
@pytest.mark.skipif(not has_gpu, reason="needs a CUDA/ROCm GPU")
@pytest.mark.parametrize("pinned", [False, True], ids=["device_chunk", "pinned_chunk"])
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_gpu_copies_run_on_side_streams_in_order(backend, pinned):
    connector = make_connector("cuda", backend)
    streams = connector._streams
    assert streams is not None and streams.store != torch.cuda.current_stream()
    round_trip(connector, pinned)
    assert streams.store_done.query() and streams.load_done.query()


@pytest.mark.gpu
@pytest.mark.skipif(not has_gpu, reason="needs a CUDA/ROCm GPU")
def test_gpu_gather_waits_for_the_engine_stream_and_the_engine_waits_for_a_load():
    """A slow kernel on the engine's stream writes the KV a gather then reads: the gather
    must see the written values. The model's next kernel must see a load's values."""
    connector = make_connector("cuda", "triton")
    view = connector.paged.layer_view(0)
    slots = torch.arange(16, device="cuda")
    big = torch.randn(4096, 4096, device="cuda")
    for _ in range(8):
        big = big @ big / 64  # keeps the engine's stream busy for a while
    view[:, 0].fill_(3.0)  # block 0 = slots 0..15, written after the matmuls
    chunk = torch.empty(connector.chunk_shape(16), dtype=connector.dtype).pin_memory()
    connector.from_engine(chunk, slots)
    connector.stores_done()
    assert bool((chunk[:, 0] == 3.0).all())

    chunk.fill_(5.0)
    connector.to_engine(chunk, slots + BLOCK_SIZE)  # into block 1
    seen = view[:, 1].float().sum()  # queued on the engine's stream after the load
    connector.loads_done()
    assert float(seen) == 5.0 * view[:, 1].numel()


def copy_engine_connector(layout: str, min_bytes: int) -> PagedIO:
    paged = random_cache(layout, seed=1)
    return PagedIO(paged, "torch", {"store": min_bytes, "load": min_bytes})


def test_copy_engine_runs_move_the_same_bytes_as_the_kernel():
    """Runs of consecutive slots of at least ``min_bytes`` per (layer, plane) go through
    ``copy_``, the rest through the kernel; the result is the kernel's, bit for bit."""
    row_bytes = HEADS * HEAD_SIZE * 2
    copier = copy_engine_connector("flash_nhd", 20 * row_bytes)
    kernel_only = PagedIO(copier.paged, "torch", {})
    # runs of 40 (copied), 12 (too short: kernel), 1, a padding slot, 30 (copied)
    slots = torch.cat(
        [
            torch.arange(100, 140),
            torch.arange(300, 312),
            torch.tensor([7, -1]),
            torch.arange(500, 530),
        ]
    )
    rest = copier._copy_runs(
        "store", torch.empty(copier.chunk_shape(len(slots)), dtype=torch.bfloat16), slots, None
    )
    assert (rest[:40] == -1).all() and (rest[-30:] == -1).all()
    assert torch.equal(rest[40:54], slots[40:54])

    by_copy = torch.zeros(copier.chunk_shape(len(slots)), dtype=torch.bfloat16)
    by_kernel = torch.zeros_like(by_copy)
    copier.from_engine(by_copy, slots)
    kernel_only.from_engine(by_kernel, slots)
    assert torch.equal(bits(by_copy), bits(by_kernel))

    target = torch.arange(540, 540 + len(slots))
    target[52] = -1
    before = [t.clone() for t in copier.paged.tensors]
    copier.to_engine(by_copy, target)
    after_copy = [t.clone() for t in copier.paged.tensors]
    for t, b in zip(copier.paged.tensors, before, strict=True):
        t.copy_(b)
    kernel_only.to_engine(by_copy, target)
    for a, t in zip(after_copy, copier.paged.tensors, strict=True):
        assert torch.equal(bits(a), bits(t))


@pytest.mark.parametrize("layout", ["vllm_nhd", "vllm_cpu", "flashinfer_nhd"])
def test_layouts_without_token_rows_never_use_copy_engine(layout):
    assert copy_engine_connector(layout, 1).copy_engine_min_bytes == {}
    assert copy_engine_connector("flash_nhd", 1).copy_engine_min_bytes == {"store": 1, "load": 1}


def test_no_tuned_crossover_means_kernel_only():
    paged = copy_engine_connector("flash_nhd", 1).paged
    assert PagedIO(paged).copy_engine_min_bytes == {"store": None, "load": None}
    too_far = torch.tensor([0, 1, 2, BLOCKS * BLOCK_SIZE])
    chunk = torch.empty(paged.chunk_shape(4), dtype=paged.dtype)
    with pytest.raises(ValueError, match="slot"):
        copy_engine_connector("flash_nhd", 1).from_engine(chunk, too_far)


@pytest.mark.gpu
@pytest.mark.skipif(not has_gpu, reason="needs a CUDA/ROCm GPU")
def test_gpu_copy_engine_runs_with_a_pinned_chunk():
    paged = copy_engine_connector("flash_nhd", 1).paged
    paged = PagedKV(paged.layout, [t.cuda() for t in paged.tensors])
    copier = PagedIO(paged, "triton", {"store": 1024, "load": 1024})
    kernel_only = PagedIO(paged, "triton", {})
    slots = torch.cat([torch.arange(64, 128), torch.tensor([3, -1, 9])])
    by_copy = torch.zeros(paged.chunk_shape(len(slots)), dtype=paged.dtype).pin_memory()
    by_kernel = torch.zeros_like(by_copy).pin_memory()
    copier.from_engine(by_copy, slots)
    kernel_only.from_engine(by_kernel, slots)
    copier.stores_done()
    kernel_only.stores_done()
    assert torch.equal(bits(by_copy), bits(by_kernel))


class StreamLog:
    """Stand-ins for the CUDA stream calls ``PagedIO`` makes, logging them in order: the
    side-stream protocol checked on the CPU (the copies themselves run synchronously)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.entries: list[tuple[str, ...]] = []
        unnamed = iter(("store", "load"))  # the order in which ``_Streams`` makes them
        log = self

        class Stream:
            def __init__(self, device=None, name: str | None = None) -> None:
                self.name = name or next(unnamed)

            def wait_stream(self, other) -> None:
                log.entries.append(("wait", self.name, other.name))

            def wait_event(self, event) -> None:
                log.entries.append(("wait", self.name, event.name))

        class Event:
            def record(self, stream) -> None:
                self.name = f"{stream.name} event"
                log.entries.append(("record", stream.name))

            def synchronize(self) -> None:
                log.entries.append(("sync", self.name))

        @contextlib.contextmanager
        def on(stream):
            outer, log.current = log.current, stream
            try:
                yield
            finally:
                log.current = outer

        self.current = Stream(name="engine")
        monkeypatch.setattr(torch.cuda, "Stream", Stream)
        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: log.current)
        monkeypatch.setattr(torch.cuda, "stream", on)

    def copies(self, io: PagedIO) -> None:
        """Log each gather and scatter ``io`` queues, with the stream it is queued on."""
        for name in ("_gather", "_scatter"):
            copy = getattr(io, name)

            def logged(*args, copy=copy, name=name):
                self.entries.append((name[1:], self.current.name))
                return copy(*args)

            setattr(io, name, logged)


def test_a_store_and_a_load_queued_together_run_at_once(monkeypatch):
    """One engine stores one prompt while it loads another: every copy of both is queued,
    each on its direction's stream, before anything waits for either; neither stream
    waits for the other's event (nothing orders the load after the store)."""
    log = StreamLog(monkeypatch)
    config = load_config({"chunk_size": 16, "max_local_cpu_size": 0.05}, env={})
    engine = CacheEngine(config, EngineMetadata("m"), random_cache("vllm_nhd"))
    io = engine.paged_io
    io._streams = _Streams(torch.device("cuda"))
    tokens_a, tokens_b = torch.arange(48), torch.arange(48) + 1000
    slots_a, slots_b = torch.arange(48), torch.arange(48) + 320
    engine.store(tokens_b, slot_mapping=slots_b)
    want = bits(engine.paged_io.paged.tensors[0].clone())
    log.copies(io)
    log.entries.clear()

    chunker = engine.chunker
    store = StoreTransfer(
        engine.checked, io, chunker.prompt_chunks(tokens_a), slots_a, gather_now=True
    )
    load = RetrieveTransfer(
        engine.checked, io, chunker.prompt_chunks(tokens_b), slots_b.roll(5), scatter_now=True
    )
    assert store.commit().stored_chunks == 3
    load.close()

    copies = [i for i, entry in enumerate(log.entries) if entry[0] in ("gather", "scatter")]
    queued, waited = log.entries[: copies[-1] + 1], log.entries[copies[-1] + 1 :]
    assert [e for e in queued if e[0] in ("gather", "scatter")] == [("gather", "store")] * 3 + [
        ("scatter", "load")
    ] * 3
    assert not [e for e in queued if e[0] == "sync"], f"a host wait between the copies: {queued}"
    side_waits = [e for e in log.entries if e[0] == "wait" and e[1] != "engine"]
    assert side_waits == [("wait", "store", "engine"), ("wait", "load", "engine")]
    assert ("wait", "engine", "store event") not in log.entries
    assert queued.index(("wait", "store", "engine")) < queued.index(("wait", "load", "engine"))
    assert [e for e in waited if e[0] == "sync"] == [
        ("sync", "store event"),
        ("sync", "load event"),
    ]
    assert not torch.equal(bits(engine.paged_io.paged.tensors[0]), want), "nothing was loaded"


def test_a_batch_belongs_to_its_thread():
    """A loader thread's open load batch leaves the engine thread free to store (vLLM's
    async loads beside a step's saves); inside one thread, directions still do not mix."""
    io = make_connector("cpu", "torch")
    src, dst = torch.arange(48), torch.arange(48) + 320
    stored = torch.empty(io.chunk_shape(48), dtype=io.dtype)
    loaded = fill_random_(torch.empty_like(stored), torch.Generator().manual_seed(4))
    opened, release = threading.Event(), threading.Event()

    def loader() -> None:
        with io.loading():
            opened.set()
            assert release.wait(10)
            io.to_engine(loaded, dst)

    thread = threading.Thread(target=loader)
    thread.start()
    try:
        assert opened.wait(5)
        io.from_engine(stored, src)  # a store batch of its own, in this thread
        with io.storing(), pytest.raises(RuntimeError, match="a store batch is open"):
            io.to_engine(loaded, dst)
    finally:
        release.set()
        thread.join()
    check = torch.empty_like(stored)
    io.from_engine(check, dst)
    assert torch.equal(bits(check), bits(loaded))
    io.from_engine(check, src)
    assert torch.equal(bits(check), bits(stored))


def test_backend_that_cannot_run_is_refused_at_construction() -> None:
    paged = PagedKV.empty(
        "vllm_cpu", num_layers=1, num_blocks=2, block_size=16, num_heads=1, head_size=64,
        dtype=torch.bfloat16,
    )  # fmt: skip
    with pytest.raises(ValueError, match="'triton' cannot run on device 'cpu'"):
        PagedIO(paged, "triton")
    with pytest.raises(ValueError, match="unknown kernel backend 'cuda'"):
        PagedIO(paged, "cuda")
    assert load_config({"kernel_backend": "numba"}, env={}).kernel_backend == "numba"
    if "numba" in registry.backends_for("paged_scatter"):
        io = PagedIO(paged, "numba")
        chunk = torch.ones(paged.chunk_shape(16), dtype=torch.bfloat16)
        with io.loading():
            io.to_engine(chunk, torch.arange(16))
        assert bool((paged.layer_view(0)[:, 0] == 1).all())
