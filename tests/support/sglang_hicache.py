"""SGLang's real HiCache host pools and storage factory, built on a CPU, for the SGLang
backend's tests and benchmark (run in .venv-sglang; import only after
``pytest.importorskip("sglang")``).

The host pools are SGLang's own classes (``MHATokenToKVPoolHost``,
``MLATokenToKVPoolHost``) over small CPU "device" buffers; the backend is built the way
SGLang's cache controller builds it: ``StorageBackendFactory.create_backend("dynamic",
HiCacheStorageConfig(...), host_pool)`` then ``register_mem_pool_host(host_pool)``.
"""

from __future__ import annotations

import torch
from sglang.srt.mem_cache.device_pool_info import (
    KVBufferLayout,
    KVBuffers,
    MHABufferInfo,
    MLABufferInfo,
)
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

from kvtier_kernels.dtypes import bits, fill_random_bits_

LAYOUTS = ("layer_first", "page_first", "page_first_direct")
BACKEND_KEYS = {
    "backend_name": "kvtier",
    "module_path": "kvtier.integration.sglang",
    "class_name": "KVTierHiCacheStorage",
    "interface_v1": 1,
}


def _ptrs(tensors) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.uint64)


def mha_pool(
    layout: str,
    *,
    layers: int = 2,
    heads: int = 2,
    head_dim: int = 80,
    page_size: int = 4,
    device_tokens: int = 64,
    ratio: float = 2.0,
    dtype: torch.dtype = torch.bfloat16,
) -> MHATokenToKVPoolHost:
    """SGLang's MHA host pool (``ratio`` x ``device_tokens`` tokens), filled with random bits."""
    k = tuple(torch.zeros(device_tokens, heads, head_dim, dtype=dtype) for _ in range(layers))
    v = tuple(torch.zeros(device_tokens, heads, head_dim, dtype=dtype) for _ in range(layers))
    buffers = KVBuffers(
        k=k, v=v, k_data_ptrs=_ptrs(k), v_data_ptrs=_ptrs(v), layout=KVBufferLayout.NHD
    )
    info = MHABufferInfo(
        buffers=buffers,
        page_size=page_size,
        head_num=heads,
        head_dim=head_dim,
        v_head_dim=head_dim,
        dtype=dtype,
        device=torch.device("cpu"),
    )
    pool = MHATokenToKVPoolHost(
        info,
        ratio,
        0,
        page_size,
        layout,
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=device_tokens,
        start_layer=0,
        end_layer=layers,
    )
    randomize(pool, seed=0)
    return pool


def mla_pool(
    layout: str,
    *,
    layers: int = 2,
    kv_lora_rank: int = 512,
    rope_dim: int = 64,
    page_size: int = 4,
    device_tokens: int = 64,
    dtype: torch.dtype = torch.bfloat16,
    dcp_size: int = 1,
    dcp_rank: int = 0,
) -> MLATokenToKVPoolHost:
    """SGLang's MLA host pool (latent width ``kv_lora_rank + rope_dim``: 576 as in
    DeepSeek), filled with random bits. With ``dcp_size`` > 1 (decode context
    parallelism) ``page_size`` is the logical page SGLang's controller indexes; the
    pool holds ``page_size / dcp_size`` tokens of each page, this rank's share."""
    width = kv_lora_rank + rope_dim
    rows = tuple(torch.zeros(device_tokens, 1, width, dtype=dtype) for _ in range(layers))
    info = MLABufferInfo(
        buffers=rows,
        data_ptrs=_ptrs(rows),
        layer_indices=tuple(range(layers)),
        device_layer_num=layers,
        page_size=page_size // dcp_size,
        kv_lora_rank=kv_lora_rank,
        qk_rope_head_dim=rope_dim,
        kv_cache_dim=width,
        dtype=dtype,
        device=torch.device("cpu"),
    )
    pool = MLATokenToKVPoolHost(
        info,
        2.0,
        0,
        page_size,
        layout,
        pin_memory=False,
        device="cpu",
        dcp_size=dcp_size,
        dcp_rank=dcp_rank,
        device_capacity_tokens=device_tokens,
        start_layer=0,
        end_layer=layers,
        target_layer_num=layers,
    )
    randomize(pool, seed=0)
    return pool


def randomize(pool, seed: int) -> None:
    fill_random_bits_(pool.kv_buffer, torch.Generator().manual_seed(seed))


def storage_config(
    extra: dict,
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    mla: bool = False,
    model="org/model",
    dcp_size: int = 1,
    logical_page_size: int | None = None,
    metrics: bool = True,
) -> HiCacheStorageConfig:
    """What SGLang's cache controller passes a storage backend (``_generate_storage_config``);
    with ``dcp_size`` > 1 the DCP rank is the TP rank's place in its DCP group; ``metrics``:
    SGLang runs with ``--enable-metrics``."""
    return HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=mla,
        enable_storage_metrics=metrics,
        is_page_first_layout=False,
        model_name=model,
        extra_config={**BACKEND_KEYS, **extra},
        dcp_size=dcp_size,
        dcp_rank=tp_rank % dcp_size,
        logical_page_size=logical_page_size if dcp_size > 1 else None,
    )


def make_backend(pool, extra: dict, **config) -> HiCacheStorage:
    """The backend as SGLang's cache controller attaches it (dynamic factory, then the
    host pool registered)."""
    mla = isinstance(pool, MLATokenToKVPoolHost)
    if pool.dcp_size > 1:
        config = {"dcp_size": pool.dcp_size, "logical_page_size": pool.logical_page_size, **config}
    backend = StorageBackendFactory.create_backend(
        "dynamic", storage_config(dict(extra), mla=mla, **config), pool
    )
    backend.register_mem_pool_host(pool)
    return backend


def page_indices(pool, pages) -> torch.Tensor:
    """Host indices of whole pages (as the controller passes them: every token's slot, of
    a logical page under DCP)."""
    size = pool.logical_page_size
    return torch.cat([torch.arange(p * size, (p + 1) * size) for p in pages])


def assert_pages_equal(pool_a, pages_a, pool_b, pages_b) -> None:
    """Bit-exact equality of host pages, naming the first page that differs."""
    for pa, pb in zip(pages_a, pages_b, strict=True):
        a = pool_a.get_data_page(pa * pool_a.logical_page_size, flat=False)
        b = pool_b.get_data_page(pb * pool_b.logical_page_size, flat=False)
        if pool_a.layout != pool_b.layout:
            a, b = canonical(pool_a, a), canonical(pool_b, b)
        assert torch.equal(bits(a), bits(b)), f"host page {pb} differs from source page {pa}"


def canonical(pool, data_page: torch.Tensor) -> torch.Tensor:
    """A data page as [planes, layers, tokens, width] whatever the layout (for comparing
    pools of different layouts), computed independently of kvtier's ``pages``."""
    mla = isinstance(pool, MLATokenToKVPoolHost)
    d = data_page
    if mla:
        d = {"layer_first": d, "page_first": d.transpose(0, 1), "page_first_direct": d[0]}[
            pool.layout
        ]
        return d.reshape(1, d.shape[0], d.shape[1], -1)
    d = {"layer_first": d, "page_first": d.transpose(1, 2), "page_first_direct": d[:, 0]}[
        pool.layout
    ]
    return d.reshape(2, d.shape[1], d.shape[2], -1)
