"""The SGLang backend's SGLang-free part (``kvtier.integration.sglang.pages``): which keys
of SGLang's extra config are kvtier's, and how SGLang's page keys become kvtier keys.
Runs everywhere; the backend itself is tested against SGLang in test_sglang_hicache.py."""

from __future__ import annotations

import pytest
import torch

from kvtier.config import ConfigError, load_config
from kvtier.integration.sglang.pages import (
    CANONICAL_LAYOUTS,
    PageFormat,
    PageKeys,
    page_hash,
    split_extra_config,
)
from kvtier.keys import CacheKey

SGLANG_KEYS = {
    "backend_name": "kvtier",
    "module_path": "kvtier.integration.sglang",
    "class_name": "KVTierHiCacheStorage",
    "interface_v1": 1,
}
MHA = PageFormat("page_first", False, 64, torch.bfloat16, (2, 4, 64, 256), (2, 64, 4, 2, 128))
MLA = PageFormat("page_first", True, 64, torch.bfloat16, (1, 4, 64, 576), (64, 4, 1, 576))
FLAT = PageFormat("page_head", False, 64, torch.bfloat16, (131072,), (2, 1, 2, 64, 4, 128))
PAGE = "ab" * 32  # SGLang's page keys are sha256 hex digests


def test_sglangs_own_keys_are_left_to_sglang():
    extra = {**SGLANG_KEYS, "chunk_size": 64, "local_disk": "/tmp/x"}
    assert split_extra_config(extra) == {"chunk_size": 64, "local_disk": "/tmp/x"}
    assert split_extra_config(None) == {}
    config = load_config(overrides=split_extra_config(extra), env={})
    assert config.local_disk == "/tmp/x"


def test_an_unknown_kvtier_key_is_named():
    with pytest.raises(ConfigError, match="'max_local_cpu_sise'"):
        load_config(overrides=split_extra_config({**SGLANG_KEYS, "max_local_cpu_sise": 1}))


def test_page_keys_round_trip_and_carry_the_namespace():
    keys = PageKeys("org/model", tp_rank=1, tp_size=2, is_mla=False, salt="tenant-a")
    key = keys.key(PAGE, MHA)
    assert CacheKey.from_string(key.to_string()) == key
    assert key.chunk_hash == bytes.fromhex(PAGE) and (key.rank, key.world_size) == (1, 2)
    assert dict(key.tags) == {
        "engine": "sglang",
        "page": "64",
        "salt": "tenant-a",
        "kv_geometry": "4x2x128",  # layers x KV heads x head size
    }
    assert key.kv_dtype == "bfloat16" and key.model_name == "org/model"


def test_what_separates_pages():
    base = PageKeys("m", 0, 2, is_mla=False)
    distinct = {
        base.key(PAGE, MHA),
        PageKeys("m", 0, 2, is_mla=False, salt="s").key(PAGE, MHA),
        PageKeys("other", 0, 2, is_mla=False).key(PAGE, MHA),
        PageKeys("m", 1, 2, is_mla=False).key(PAGE, MHA),
        base.key(PAGE, MHA, pool="mamba"),
        base.key(PAGE, FLAT),
        base.key("cd" * 32, MHA),
    }
    assert len(distinct) == 7


def mha(layout: str, layers: int, heads: int, head_dim: int, page: int = 64) -> PageFormat:
    """The format of an MHA host pool of ``layout`` (its data page as SGLang shapes it)."""
    data_page = {
        "layer_first": (2, layers, page, heads, head_dim),
        "page_first": (2, page, layers, heads, head_dim),
        "page_first_direct": (2, 1, layers, page, heads, head_dim),
    }[layout]
    shape = (2, layers, page, heads * head_dim)
    return PageFormat(layout, False, page, torch.bfloat16, shape, data_page)


def test_another_geometry_under_the_same_name_is_another_key():
    """Two models served under one name, with other layers, KV heads or head size (even
    at the same bytes per token): their pages never share a key, so a lookup misses
    rather than find pages the load refuses. The host layout is not part of it: a
    deployment that changes --hicache-mem-layout keeps its cache."""
    keys = PageKeys("m", 0, 2, is_mla=False)
    geometries = [(4, 2, 128), (8, 2, 128), (4, 4, 64), (4, 2, 64)]
    distinct = {keys.key(PAGE, mha("page_first", *g)) for g in geometries}
    assert len(distinct) == len(geometries)
    layouts = {keys.key(PAGE, mha(layout, 4, 2, 128)) for layout in CANONICAL_LAYOUTS}
    assert layouts == {keys.key(PAGE, MHA)}, "a host layout change drops the cache"
    assert dict(keys.key(PAGE, MLA).tags)["kv_geometry"] == "4x1x576"
    assert dict(keys.key(PAGE, FLAT).tags)["kv_geometry"] == "2x1x2x64x4x128"


def test_mla_kv_is_shared_by_ranks_but_extra_pools_are_not():
    rank0, rank1 = PageKeys("m", 0, 4, is_mla=True), PageKeys("m", 1, 4, is_mla=True)
    assert rank0.key(PAGE, MLA) == rank1.key(PAGE, MLA)
    assert rank0.key(PAGE, MLA, pool="mamba") != rank1.key(PAGE, MLA, pool="mamba")


@pytest.mark.parametrize("pool", ["indexer", "swa", "draft"])
def test_an_mla_models_other_pools_are_shared_by_ranks(pool):
    """SGLang has only the writer rank of an MLA model back up pools other than Mamba
    states: every rank reads that rank's pages. An MHA model's ranks keep theirs apart."""
    rank0, rank1 = PageKeys("m", 0, 4, is_mla=True), PageKeys("m", 1, 4, is_mla=True)
    assert rank0.key(PAGE, FLAT, pool=pool) == rank1.key(PAGE, FLAT, pool=pool)
    mha0, mha1 = PageKeys("m", 0, 4, is_mla=False), PageKeys("m", 1, 4, is_mla=False)
    assert mha0.key(PAGE, FLAT, pool=pool) != mha1.key(PAGE, FLAT, pool=pool)


def test_page_hash_of_keys_that_are_not_hex():
    assert page_hash("00ff") == b"\x00\xff"
    assert page_hash("not-hex") == b"not-hex"
    assert page_hash("abc") == b"abc"


@pytest.mark.parametrize("fmt", [MHA, MLA, FLAT])
def test_flat_pages_are_seen_in_the_stored_layout(fmt):
    flat = torch.arange(fmt.numel, dtype=torch.float32).to(fmt.dtype)
    view = fmt.from_flat(flat)
    assert tuple(view.shape) == fmt.shape and view.data_ptr() == flat.data_ptr()
    with pytest.raises(ValueError, match="flat page"):
        fmt.from_flat(flat[:-1])
