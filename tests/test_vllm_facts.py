"""What the vLLM connector reads off the engine (``facts``): which layout vLLM's KV
tensors are in (``detect_paged_kv``), the tags that keep chunks of engines whose KV
bytes differ apart (``key_tags``), the engine's ranks (``world_size``,
``worker_rank``), and which blocks a sliding window frees (``window_start``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvtier.config import load_config
from kvtier.engine import CacheEngine, EngineMetadata
from kvtier.integration.vllm.facts import (
    detect_paged_kv,
    key_tags,
    window_start,
    worker_rank,
    world_size,
)
from kvtier_kernels import LayoutError, PagedKV, gather, scatter
from kvtier_kernels.dtypes import bits, fill_random_bits_

BLOCK = 4
HEADS = 2
HEAD = 8


def layer_names(num_layers: int) -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(num_layers)]


# -- detect_paged_kv -----------------------------------------------------------------


def caches_dict(layout: str) -> dict[str, torch.Tensor]:
    paged = PagedKV.empty(
        layout,
        num_layers=2,
        num_blocks=4,
        block_size=BLOCK,
        num_heads=HEADS,
        head_size=HEAD,
        dtype=torch.float16,
    )
    return dict(zip(layer_names(2), paged.tensors, strict=True))


@pytest.mark.parametrize(
    ("layout", "backend", "expected"),
    [
        ("vllm_cpu", "CPU_ATTN", "vllm_cpu"),
        ("vllm_nhd", "FLASH_ATTN", "vllm_nhd"),
        ("vllm_hnd", "FLASH_ATTN", "vllm_hnd"),
        ("vllm_nhd", "TRITON_ATTN", "vllm_nhd"),
        ("vllm_hnd", "ROCM_ATTN", "vllm_hnd"),
    ],
)
def test_detect_paged_kv(layout, backend, expected):
    kv_caches = caches_dict(layout)
    paged = detect_paged_kv(kv_caches, backend)
    assert paged.layout.name == expected, f"{backend} over {layout}: detected {paged.layout.name}"
    shape = (paged.num_layers, paged.num_blocks, paged.block_size, paged.num_heads, paged.head_size)
    assert shape == (2, 4, BLOCK, HEADS, HEAD), f"{backend} over {layout}: dims {shape}"
    for layer, tensor in enumerate(kv_caches.values()):
        view = paged.layer_view(layer)
        assert view.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr(), (
            f"layer {layer}: the canonical view does not share the engine tensor's storage"
        )


@pytest.mark.parametrize("backend", ["FLASHINFER", "XFORMERS", None])
def test_detect_paged_kv_unknown_backend_names_it_and_kv_layout(backend):
    with pytest.raises(LayoutError) as info:
        detect_paged_kv(caches_dict("vllm_hnd"), backend)
    message = str(info.value)
    assert repr(backend) in message and "kv_layout" in message, (
        f"error for backend {backend!r} does not name it and kv_layout: {message}"
    )


@pytest.mark.parametrize(
    ("layout", "backend", "forced"),
    [
        ("vllm_nhd", "FLASH_ATTN", "vllm_hnd"),
        ("vllm_hnd", "MYSTERY_ATTN", "vllm_hnd"),
        ("flash_nhd", None, "flash_nhd"),
        ("vllm_cpu", "FLASH_ATTN", "vllm_cpu"),
    ],
)
def test_forced_layout_overrides_detection(layout, backend, forced):
    paged = detect_paged_kv(caches_dict(layout), backend, forced)
    assert paged.layout.name == forced, f"forced {forced}, got {paged.layout.name}"


@pytest.mark.parametrize(
    ("layout", "backend", "forced", "message"),
    [
        ("flash_nhd", "FLASH_ATTN", None, "kv_layout"),  # a 5-D tensor is not [NB, H, BS, 2D]
        ("vllm_nhd", "CPU_ATTN", None, "contiguous"),
        ("flash_nhd", "FLASH_ATTN", "vllm_hnd", "does not fit layout 'vllm_hnd'"),
    ],
)
def test_detect_paged_kv_rejects_misfits(layout, backend, forced, message):
    with pytest.raises(LayoutError, match=message):
        detect_paged_kv(caches_dict(layout), backend, forced)


def test_detect_paged_kv_needs_a_tensor():
    with pytest.raises(LayoutError, match="no KV cache tensors"):
        detect_paged_kv({}, "FLASH_ATTN")


def mla_caches(num_layers: int = 2, num_blocks: int = 4, latent: int = 12):
    """vLLM's MLA KV tensors: one latent row per token, handed out as [NB, 1, BS, D]."""
    buffer = torch.arange(num_layers * num_blocks * BLOCK * latent, dtype=torch.float32)
    layers = buffer.view(num_layers, num_blocks, 1, BLOCK, latent).to(torch.bfloat16)
    return dict(zip(layer_names(num_layers), layers.unbind(0), strict=True))


@pytest.mark.parametrize(("backend", "forced"), [("CPU_MLA", None), ("MYSTERY_MLA", "mla")])
def test_mla_latent_rows_handed_out_as_one_head(backend, forced):
    kv_caches = mla_caches()
    paged = detect_paged_kv(kv_caches, backend, forced)
    assert paged.layout.name == "mla", f"{backend}: detected {paged.layout.name}"
    shape = (paged.num_layers, paged.num_blocks, paged.block_size, paged.num_heads, paged.head_size)
    assert shape == (2, 4, BLOCK, 1, 12), f"{backend}: dims {shape}"
    for layer, tensor in enumerate(kv_caches.values()):
        view = paged.layer_view(layer)  # [1, NB, BS, 1, D]
        assert torch.equal(view[0, 2, 3, 0], tensor[2, 0, 3]), (
            f"layer {layer}: the canonical row of block 2, slot 3 is not the engine's"
        )
        view[0, 1, 0, 0].fill_(-1.0)
        assert bool((tensor[1, 0, 0] == -1.0).all()), (
            f"layer {layer}: a write through the canonical view did not land in the engine tensor"
        )


# -- vLLM's GPU MLA caches -------------------------------------------------------------
# vLLM 0.32 allocates one int8 buffer and views it per layer as [B, H, N, C], C in bytes,
# then as the cache dtype (vllm/v1/kv_cache_interface.py: compute_layout_strides,
# create_kv_cache_views; vllm/v1/core/kv_cache_utils.py: get_kv_cache_config_from_groups).
# An MLA layer has H = 1 and C = one token's latent row (576 values; fp8: 576 bytes).

LBNHC = (0, 1, 3, 2, 4)  # vLLM's default layout (KVCacheLayout.LBNHC)
BLHNC = (1, 0, 2, 3, 4)  # block-outermost: a block holds every layer's page (DeepSeek-V4)


def vllm_layout_strides(shape, order, fixed=(None,) * 5, padded_page=None):
    """``compute_layout_strides``: byte strides of the logical ``[L, B, H, N, C]``."""
    page_grid_end = max(order.index(0), order.index(1)) + 1
    strides = [0] * 5
    current = 1
    for physical, dim in reversed(tuple(enumerate(order))):
        if padded_page is not None and physical == page_grid_end - 1:
            current = max(current, padded_page)
        strides[dim] = fixed[dim] or current
        current = strides[dim] * shape[dim]
    return tuple(strides)


def vllm_mla_buffer(
    order,
    *,
    num_layers: int,
    num_blocks: int,
    block_size: int,
    row_bytes: int,
    dtype: torch.dtype,
    padded_page: int | None = None,
    other_pages: int = 0,
    kernel_block_size: int | None = None,
    num_heads: int = 1,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The raw int8 buffer and the per-layer tensors vLLM hands a connector for an MLA
    cache (``num_heads`` 1; more: an attention cache, ``row_bytes`` a head's K and V):
    ``padded_page`` is ``page_size_padded``, ``other_pages`` the bytes of other cache
    groups' pages in a block-outermost block, ``kernel_block_size`` the backend's smaller
    kernel blocks (FlashMLA 64, CUTLASS MLA 128)."""
    shape = (num_layers, num_blocks, num_heads, block_size, row_bytes)
    block_stride = None
    if order[0] == 1:  # block-outermost: interleaved_block_stride = bytes_per_block
        block_stride = num_layers * num_heads * block_size * row_bytes + other_pages
    elif padded_page is not None:
        block_stride = padded_page
    layer_stride, block_stride, *_ = vllm_layout_strides(
        shape, order, (None, block_stride, None, None, None), padded_page
    )
    raw = torch.zeros(max(layer_stride * num_layers, block_stride * num_blocks), dtype=torch.int8)
    bs, ratio = block_size, 1
    if kernel_block_size is not None:
        ratio = block_size // kernel_block_size
        bs, block_stride = kernel_block_size, block_stride // ratio
    logical = (num_layers, num_blocks * ratio, num_heads, bs, row_bytes)
    strides = vllm_layout_strides(
        logical, order, (layer_stride, block_stride, None, None, None), padded_page
    )
    view_5d = torch.as_strided(raw, size=logical, stride=strides, storage_offset=0)
    return raw, [view_5d[layer].view(dtype) for layer in range(num_layers)]


# (backend, layout, kv cache dtype's tensor dtype, row bytes, padded page, other groups'
# bytes per block, kernel block size); manager blocks of 16 tokens (FlashMLA: 128).
GPU_MLA_CASES = {
    "TRITON_MLA bf16": ("TRITON_MLA", LBNHC, torch.bfloat16, 1152, None, 0, None),
    "FLASH_ATTN_MLA fp16": ("FLASH_ATTN_MLA", LBNHC, torch.float16, 1152, None, 0, None),
    "FLASHINFER_MLA fp8": ("FLASHINFER_MLA", LBNHC, torch.uint8, 576, None, 0, None),
    "ROCM_AITER_MLA fp8_e5m2": ("ROCM_AITER_MLA", LBNHC, torch.uint8, 576, None, 0, None),
    # int8_per_token_head: 576 values, then the fp32 scale pair (MLACommonBackend.customize_spec)
    "TRITON_MLA int8 per token": ("TRITON_MLA", LBNHC, torch.int8, 584, None, 0, None),
    "CUTLASS_MLA page_size_padded": (
        "CUTLASS_MLA",
        LBNHC,
        torch.bfloat16,
        1152,
        16 * 1152 + 512,
        0,
        None,
    ),
    "AITER_TRITON_MLA block-outermost": (
        "AITER_TRITON_MLA",
        BLHNC,
        torch.bfloat16,
        1152,
        None,
        4096,
        None,
    ),
    "FLASHMLA kernel blocks": ("FLASHMLA", LBNHC, torch.bfloat16, 1152, None, 0, 64),
}


@pytest.mark.parametrize("case", list(GPU_MLA_CASES))
def test_vllm_gpu_mla_caches_round_trip_bit_for_bit(case):
    backend, order, dtype, row_bytes, padded, other, kernel_bs = GPU_MLA_CASES[case]
    block_size = 128 if kernel_bs else 16
    width = row_bytes // torch.empty((), dtype=dtype).element_size()
    geometry = dict(
        num_layers=3,
        num_blocks=5,
        block_size=block_size,
        row_bytes=row_bytes,
        dtype=dtype,
        padded_page=padded,
        other_pages=other,
        kernel_block_size=kernel_bs,
    )
    src_raw, src_layers = vllm_mla_buffer(order, **geometry)
    fill_random_bits_(src_raw, torch.Generator().manual_seed(1))
    kv_caches = dict(zip(layer_names(3), src_layers, strict=True))
    paged = detect_paged_kv(kv_caches, backend, block_size=block_size)
    dims = (paged.num_layers, paged.num_blocks, paged.block_size, paged.num_heads, paged.head_size)
    assert (paged.layout.name, dims) == ("mla", (3, 5, block_size, 1, width)), (
        f"{case}: detected {paged.layout.name} {dims}"
    )

    slots = torch.randperm(paged.num_slots, generator=torch.Generator().manual_seed(0))
    chunk = torch.empty(paged.chunk_shape(len(slots)), dtype=dtype)
    gather(paged, slots, chunk, backend="torch")
    kernel_bs = kernel_bs or block_size
    for token, slot in enumerate(slots.tolist()):
        block, offset = divmod(slot, block_size)
        kernel_block = block * (block_size // kernel_bs) + offset // kernel_bs
        for layer, tensor in enumerate(src_layers):
            # where vLLM's kernels read the row: [kernel block, head 0, slot in it]
            row = tensor[kernel_block, 0, offset % kernel_bs]
            assert torch.equal(bits(chunk[0, layer, token]), bits(row)), (
                f"{case}: layer {layer}, slot {slot} (block {block}, offset {offset}): the "
                "gathered row is not the one vLLM's kernels read"
            )

    dst_raw, dst_layers = vllm_mla_buffer(order, **geometry)
    dst_raw.fill_(0x55)
    scatter(
        detect_paged_kv(
            dict(zip(layer_names(3), dst_layers, strict=True)), backend, None, block_size
        ),
        slots,
        chunk,
        backend="torch",
    )
    rows_raw, rows_layers = vllm_mla_buffer(order, **geometry)
    for tensor in rows_layers:
        tensor.view(torch.uint8).fill_(1)
    rows = rows_raw.bool()
    assert torch.equal(dst_raw[rows], src_raw[rows]), f"{case}: scattered rows differ"
    assert bool((dst_raw[~rows] == 0x55).all()), (
        f"{case}: scatter wrote {int((dst_raw[~rows] != 0x55).sum())} bytes outside the rows "
        "(page padding, other layers' or groups' pages)"
    )


SPARSE_MLA_BACKENDS = ["FLASHMLA_SPARSE", "FLASHINFER_MLA_SPARSE", "ROCM_AITER_MLA_SPARSE"]


@pytest.mark.parametrize("backend", SPARSE_MLA_BACKENDS)
@pytest.mark.parametrize("forced", [None, "mla"])
def test_sparse_mla_is_refused_naming_backend_shape_and_kv_layout(backend, forced):
    """Sparse MLA keeps indexer keys in caches kvtier does not store (fp8_ds_mla rows:
    656 bytes), so even a forced ``kv_layout`` is refused."""
    _, layers = vllm_mla_buffer(
        LBNHC, num_layers=2, num_blocks=3, block_size=64, row_bytes=656, dtype=torch.uint8
    )
    with pytest.raises(LayoutError) as info:
        detect_paged_kv(dict(zip(layer_names(2), layers, strict=True)), backend, forced)
    message = str(info.value)
    for part in (repr(backend), "(3, 1, 64, 656)", "kv_layout", "indexer"):
        assert part in message, f"{backend}: the refusal does not name {part}: {message}"


LBHNC = (0, 1, 2, 3, 4)  # HND storage: a kernel block's tokens are not one run


@pytest.mark.parametrize("order", [LBNHC, LBHNC], ids=["nhd", "hnd"])
def test_flash_attn_kernel_blocks_are_joined_where_they_are_one_run(order):
    """FlashAttention on some GPUs takes fixed kernel blocks (FA4 at head size 256, fp8
    on sm90): vLLM splits each of its blocks into kernel blocks. In NHD storage a block's
    kernel blocks are one run of token rows and are read as the scheduler's blocks, bit
    for bit where vLLM's kernels read them; in HND storage they are not, and are refused."""
    block_size, kernel_bs, heads, head = 32, 16, 2, 8
    dtype = torch.bfloat16
    row_bytes = 2 * head * dtype.itemsize
    geometry = dict(num_layers=2, num_blocks=3, block_size=block_size, row_bytes=row_bytes)
    raw, layers = vllm_mla_buffer(
        order, **geometry, dtype=dtype, kernel_block_size=kernel_bs, num_heads=heads
    )
    kv_caches = dict(zip(layer_names(2), layers, strict=True))
    if order == LBHNC:
        with pytest.raises(LayoutError, match="blocks of 16 tokens, vLLM's scheduler blocks of 32"):
            detect_paged_kv(kv_caches, "FLASH_ATTN", block_size=block_size)
        return
    fill_random_bits_(raw, torch.Generator().manual_seed(2))
    paged = detect_paged_kv(kv_caches, "FLASH_ATTN", block_size=block_size)
    dims = (paged.num_blocks, paged.block_size, paged.num_heads, paged.head_size)
    assert (paged.layout.name, dims) == ("vllm_nhd", (3, block_size, heads, head)), (
        f"detected {paged.layout.name} {dims}"
    )
    slots = torch.randperm(paged.num_slots, generator=torch.Generator().manual_seed(0))
    chunk = torch.empty(paged.chunk_shape(len(slots)), dtype=dtype)
    gather(paged, slots, chunk, backend="torch")
    for token, slot in enumerate(slots.tolist()):
        block, offset = divmod(slot, block_size)
        kernel_block = block * (block_size // kernel_bs) + offset // kernel_bs
        for layer, tensor in enumerate(layers):
            # FlashAttention's [kernel block, head, slot in it, K then V]
            rows = tensor[kernel_block, :, offset % kernel_bs]
            for plane in range(2):
                expected = rows[:, plane * head : (plane + 1) * head].reshape(-1)
                assert torch.equal(bits(chunk[plane, layer, token]), bits(expected)), (
                    f"layer {layer}, plane {plane}, slot {slot}: the gathered row is not "
                    "the one vLLM's kernels read"
                )


def test_kernel_blocks_kvtier_cannot_join_are_refused():
    """vLLM's scheduler addresses blocks of ``block_size`` tokens; a tensor of smaller
    blocks that kvtier cannot join back would put tokens in the wrong slots."""
    with pytest.raises(LayoutError, match="blocks of 4 tokens, vLLM's scheduler blocks of 8"):
        detect_paged_kv(caches_dict("vllm_hnd"), "FLASH_ATTN", block_size=2 * BLOCK)


# -- key_tags ------------------------------------------------------------------------


def vllm_config(cache_dtype: str, dtype: torch.dtype = torch.bfloat16):
    return SimpleNamespace(
        cache_config=SimpleNamespace(cache_dtype=cache_dtype, block_size=32),
        model_config=SimpleNamespace(dtype=dtype, get_head_size=lambda: 64),
    )


@pytest.mark.parametrize("backend", ["CPU_ATTN", "FLASH_ATTN"])
def test_quantized_kv_caches_never_share_keys_across_formats(backend):
    """vLLM holds every quantized KV cache (fp8_e4m3, fp8_e5m2, ...) in a uint8 tensor, so
    the KV dtype in the key cannot tell them apart: an fp8_e5m2 engine must not load an
    fp8_e4m3 engine's bytes, nor a float16 model's fp8 KV a bfloat16 model's."""
    engines = {
        "fp8_e4m3/bf16": vllm_config("fp8_e4m3"),
        "fp8_e5m2/bf16": vllm_config("fp8_e5m2"),
        "fp8_e4m3/fp16": vllm_config("fp8_e4m3", torch.float16),
    }
    tags = {name: key_tags(config, backend) for name, config in engines.items()}
    assert len(set(tags.values())) == len(tags), f"{backend}: engines share key tags {tags}"
    keys = set()
    for config_tags in tags.values():
        metadata = EngineMetadata("model", kv_dtype="uint8", tags=config_tags)
        engine = CacheEngine(load_config(overrides={"chunk_size": 4}), metadata)
        keys.add(engine.chunker.key_template)
        engine.close()
    assert len(keys) == len(tags), f"{backend}: engines share chunk keys {keys}"


def test_an_unquantized_kv_cache_is_keyed_by_its_dtype_alone():
    assert key_tags(vllm_config("auto"), "FLASH_ATTN") == ()
    (isa,) = key_tags(vllm_config("auto"), "CPU_ATTN")
    assert isa[0] == "cpu_attn_isa", f"CPU backend tags {isa}"


def test_mla_fp8_formats_never_share_keys():
    """A dense MLA fp8 cache (576 bytes a token) and DeepSeek's fp8_ds_mla (656: values,
    scales, rope in bf16) are both uint8 tensors: their key tags keep them apart."""
    tags = {
        dtype: key_tags(vllm_config(dtype), "FLASHMLA") for dtype in ("auto", "fp8", "fp8_ds_mla")
    }
    assert len(set(tags.values())) == len(tags), f"MLA caches share key tags {tags}"


def test_fp8_caches_of_nvidia_and_mi300_never_share_keys(monkeypatch):
    """``fp8`` is e4m3fn on NVIDIA and e4m3fnuz on AMD MI300 (vLLM's
    ``current_platform.fp8_dtype()``): the same name, other bytes for the same values, so
    engines of both sharing one store must not load each other's chunks."""
    from vllm.platforms import current_platform

    tags = {}
    for encoding in (torch.float8_e4m3fn, torch.float8_e4m3fnuz):
        monkeypatch.setattr(current_platform, "fp8_dtype", lambda e=encoding: e)
        tags[encoding] = key_tags(vllm_config("fp8"), "FLASH_ATTN")
    assert tags[torch.float8_e4m3fn] != tags[torch.float8_e4m3fnuz], f"same tags: {tags}"
    assert ("fp8_dtype", "float8_e4m3fnuz") in tags[torch.float8_e4m3fnuz], tags


# -- world_size, worker_rank -----------------------------------------------------------


def parallel_vllm_config(tp: int, pp: int, pcp: int, dcp: int) -> SimpleNamespace:
    parallel = SimpleNamespace(
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        prefill_context_parallel_size=pcp,
        decode_context_parallel_size=dcp,
    )
    return SimpleNamespace(parallel_config=parallel)


@pytest.mark.parametrize(
    ("tp", "pp", "pcp", "dcp"),
    [(1, 1, 1, 1), (2, 2, 1, 1), (2, 1, 2, 1), (2, 3, 2, 1), (4, 1, 1, 2), (2, 2, 2, 2)],
    ids=["single", "tp2-pp2", "tp2-pcp2", "tp2-pp3-pcp2", "tp4-dcp2", "tp2-pp2-pcp2-dcp2"],
)
def test_ranks_are_numbered_as_vllm_lays_them_out(monkeypatch, tp, pp, pcp, dcp):
    parallel_state = pytest.importorskip("vllm.distributed.parallel_state")
    config = parallel_vllm_config(tp, pp, pcp, dcp)
    # vLLM's world size is PP x PCP x TP (DCP reuses those ranks), its ranks laid out
    # as arange(world).reshape(DP, PP, PCP, TP) (initialize_model_parallel).
    assert world_size(config) == tp * pp * pcp
    layout = torch.arange(tp * pp * pcp).reshape(pp, pcp, tp)
    for (stage, pcp_rank, tp_rank), expected in zip(
        [(s, c, t) for s in range(pp) for c in range(pcp) for t in range(tp)],
        layout.flatten().tolist(),
        strict=True,
    ):
        groups = {"pp": stage, "pcp": pcp_rank, "tp": tp_rank}
        for name, rank in groups.items():
            group = SimpleNamespace(rank_in_group=rank)
            monkeypatch.setattr(parallel_state, f"get_{name}_group", lambda group=group: group)
        assert worker_rank(config) == expected, f"pp={stage} pcp={pcp_rank} tp={tp_rank}"


# -- window_start ----------------------------------------------------------------------


def test_window_start_is_where_vllms_kv_cache_managers_free_blocks_up_to():
    """vLLM's own specs and managers: a sliding window (and the tokens it retains past
    it) and chunked local attention free a request's blocks before
    ``get_num_skipped_tokens``; a window vLLM runs as full
    attention (its hybrid manager off, as with a connector) frees none."""
    interface = pytest.importorskip("vllm.v1.kv_cache_interface")
    managers = pytest.importorskip("vllm.v1.core.single_type_kv_cache_manager")
    shape = {"block_size": 16, "num_kv_heads": 2, "head_size": 64, "dtype": torch.bfloat16}

    def config(spec):
        group = interface.KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)
        return interface.KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[group])

    sliding = window_start(config(interface.SlidingWindowSpec(sliding_window=100, **shape)))
    retaining = window_start(
        config(interface.SlidingWindowSpec(sliding_window=100, extra_retained_tokens=5, **shape))
    )
    local = window_start(
        config(interface.ChunkedLocalAttentionSpec(attention_chunk_size=128, **shape))
    )
    full = window_start(config(interface.FullAttentionSpec(sliding_window=100, **shape)))
    narrow = interface.SlidingWindowSpec(sliding_window=100, **{**shape, "head_size": 128})
    mixed = interface.UniformTypeKVCacheSpecs.from_specs(
        {"a": interface.SlidingWindowSpec(sliding_window=100, **shape), "b": narrow}
    )
    assert mixed is not None
    uniform = window_start(config(mixed))
    vllm_sliding = SimpleNamespace(sliding_window=100, extra_retained_tokens=0)
    vllm_retaining = SimpleNamespace(sliding_window=100, extra_retained_tokens=5)
    vllm_local = SimpleNamespace(attention_chunk_size=128)
    for computed in (0, 99, 100, 101, 104, 105, 106, 127, 128, 1000):
        skipped = managers.SlidingWindowManager.get_num_skipped_tokens(vllm_sliding, computed)
        assert sliding(computed) == skipped, f"sliding window, {computed} tokens computed"
        assert uniform(computed) == skipped, f"windows of other shapes, {computed} computed"
        skipped = managers.SlidingWindowManager.get_num_skipped_tokens(vllm_retaining, computed)
        assert retaining(computed) == skipped, f"extra retained tokens, {computed} computed"
        skipped = managers.ChunkedLocalAttentionManager.get_num_skipped_tokens(vllm_local, computed)
        assert local(computed) == skipped, f"chunked local attention, {computed} computed"
        assert full(computed) == 0


@pytest.mark.parametrize(("kv_layout", "refused"), [("vllm_cpu", True), ("flash_nhd", False)])
def test_the_connectors_first_hook_refuses_a_chunk_size_its_blocks_cannot_hold(kv_layout, refused):
    """vLLM's CPU layout is copied in whole blocks: a chunk_size that is not a multiple of
    the block size stops the engine core at the connector's first hook, before memory
    profiling and the KV cache, not when the scheduler is built after them."""
    pytest.importorskip("vllm")
    from kvtier.integration.vllm.connector import KVTierConnector

    extra = {"chunk_size": 48, "kv_layout": kv_layout}
    vllm_config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra),
        cache_config=SimpleNamespace(block_size=32),
        kv_events_config=None,
    )
    if not refused:
        assert KVTierConnector.get_required_kvcache_layout(vllm_config) is None
        return
    with pytest.raises(
        ValueError, match="chunk_size=48 must be a multiple of vLLM's block_size=32"
    ):
        KVTierConnector.get_required_kvcache_layout(vllm_config)
