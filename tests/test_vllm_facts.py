"""What the vLLM connector reads off the engine (``facts``): which layout vLLM's KV
tensors are in (``detect_paged_kv``), and the tags that keep chunks of engines whose KV
bytes differ apart (``key_tags``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvtier.config import load_config
from kvtier.engine import CacheEngine, EngineMetadata
from kvtier.integration.vllm.facts import detect_paged_kv, key_tags
from kvtier_kernels import LayoutError, PagedKV

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
