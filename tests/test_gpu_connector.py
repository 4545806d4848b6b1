"""PagedKVConnector's streams: on a GPU, gathers and scatters run on side streams ordered
against the engine's stream with events (a load is complete before the model's next work
reads it; a buffer is only read or released after ``stores_done``/``loads_done``). Off the
GPU the copies are synchronous and the waits return at once. The GPU tests are skipped
without one."""

from __future__ import annotations

import pytest
import torch
from kv_helpers import bits, fill_random_

from kvtier.gpu_connector import PagedKVConnector
from kvtier_kernels import PagedKV

has_gpu = torch.cuda.is_available()
LAYERS, BLOCKS, BLOCK_SIZE, HEADS, HEAD_SIZE = 3, 40, 16, 2, 64


def make_connector(device: str, backend: str) -> PagedKVConnector:
    paged = PagedKV.empty(
        "vllm_nhd",
        num_layers=LAYERS,
        num_blocks=BLOCKS,
        block_size=BLOCK_SIZE,
        num_heads=HEADS,
        head_size=HEAD_SIZE,
        dtype=torch.bfloat16,
        device=device,
    )
    gen = torch.Generator().manual_seed(0)
    for t in paged.tensors:
        t.copy_(fill_random_(torch.empty_like(t, device="cpu"), gen))
    return PagedKVConnector(paged, backend)


def round_trip(connector: PagedKVConnector, pinned: bool) -> None:
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
