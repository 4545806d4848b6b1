"""Layout descriptors: canonical views against each engine's own K/V split."""

from __future__ import annotations

import pytest
import torch

from kvtier_kernels.layouts import (
    KV_2LTD,
    LAYOUTS,
    KVLayout,
    LayoutError,
    PagedKV,
    get_layout,
)

NB, BS, H, D, L = 3, 4, 2, 5, 3


def engine_tensor(name: str, nb: int = NB, bs: int = BS, h: int = H, d: int = D) -> torch.Tensor:
    """An engine tensor as that engine allocates it, filled with distinct values."""
    heads = 1 if name == "mla" else h
    shapes = {
        "flash_nhd": (2, nb, bs, heads, d),
        "flash_hnd": (2, nb, heads, bs, d),
        "flashinfer_nhd": (nb, 2, bs, heads, d),
        "flashinfer_hnd": (nb, 2, heads, bs, d),
        "mla": (nb, bs, d),
        "cross_layer": (nb, L, 2, bs, heads, d),
        "vllm_cpu": (nb, heads, bs, 2 * d),
        "vllm_hnd": (nb, heads, bs, 2 * d),
        "vllm_nhd": (nb, bs, heads, 2 * d),  # physical order; permuted below
    }
    shape = shapes[name]
    t = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
    return t.permute(0, 2, 1, 3) if name == "vllm_nhd" else t


def engine_split(name: str, t: torch.Tensor, layer: int = 0) -> list[torch.Tensor]:
    """K (and V) as ``[NB, BS, H, D]``, written the way each engine splits its tensor."""
    if name == "flash_nhd":
        return [t[0], t[1]]
    if name == "flash_hnd":
        return [t[0].transpose(1, 2), t[1].transpose(1, 2)]
    if name == "flashinfer_nhd":
        return [t[:, 0], t[:, 1]]
    if name == "flashinfer_hnd":
        return [t[:, 0].transpose(1, 2), t[:, 1].transpose(1, 2)]
    if name == "mla":
        return [t.unsqueeze(2)]
    if name == "cross_layer":
        return [t[:, layer, 0], t[:, layer, 1]]
    if name == "vllm_cpu":
        nb, h, bs, two_d = t.shape
        # vLLM's CPU attention backend, verbatim.
        key_cache, value_cache = t.view(nb, h, 2 * bs, two_d // 2).chunk(2, dim=2)
        return [key_cache.transpose(1, 2), value_cache.transpose(1, 2)]
    if name in ("vllm_nhd", "vllm_hnd"):
        d = t.shape[-1] // 2
        nhd = t.permute(0, 2, 1, 3)  # [NB, BS, H, 2D], as the FlashAttention backend reads it
        return [nhd[..., :d], nhd[..., d:]]
    raise AssertionError(name)


def test_layout_names() -> None:
    assert set(LAYOUTS) == {
        "flash_nhd",
        "flash_hnd",
        "flashinfer_nhd",
        "flashinfer_hnd",
        "mla",
        "cross_layer",
        "vllm_cpu",
        "vllm_nhd",
        "vllm_hnd",
    }
    assert KV_2LTD == "KV_2LTD"
    for name, layout in LAYOUTS.items():
        assert get_layout(name) is layout and layout.name == name


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("bs", [1, 4])
def test_canonical_view_matches_engine_split(name: str, bs: int) -> None:
    layout = get_layout(name)
    t = engine_tensor(name, bs=bs)
    layers = range(L) if layout.cross_layer else [None]
    for layer in layers:
        view = layout.canonical_view(t, layer)
        planes = engine_split(name, t, layer or 0)
        assert view.shape == (len(planes), NB, bs, 1 if name == "mla" else H, D)
        for plane, expected in enumerate(planes):
            assert torch.equal(view[plane], expected), f"{name} layer {layer} plane {plane}"


def test_vllm_cpu_planes_are_row_blocks() -> None:
    """Per (block, head): BS rows of K, then BS rows of V, each row head_size long."""
    t = engine_tensor("vllm_cpu")
    view = get_layout("vllm_cpu").canonical_view(t)
    flat = t.reshape(NB, H, 2 * BS * D)
    for b, h, s, d in [(0, 0, 0, 0), (1, 1, 3, 4), (2, 0, 2, 1)]:
        assert view[0, b, s, h, d] == flat[b, h, s * D + d]
        assert view[1, b, s, h, d] == flat[b, h, BS * D + s * D + d]


def test_vllm_nhd_is_noncontiguous_and_read_from_strides() -> None:
    t = torch.empty(NB, BS, H, 2 * D).permute(0, 2, 1, 3)
    assert not t.is_contiguous()
    t.copy_(torch.arange(t.numel(), dtype=torch.float32).reshape(t.shape))
    view = get_layout("vllm_nhd").canonical_view(t)
    assert torch.equal(view[0], t.permute(0, 2, 1, 3)[..., :D])
    assert torch.equal(view[1], t.permute(0, 2, 1, 3)[..., D:])
    # The same engine split holds for the contiguous vllm_hnd physical order.
    c = t.contiguous()
    hnd = get_layout("vllm_hnd").canonical_view(c)
    assert torch.equal(hnd, view)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_view_shares_storage(name: str) -> None:
    layout = get_layout(name)
    t = engine_tensor(name)
    layer = 1 if layout.cross_layer else None
    view = layout.canonical_view(t, layer)
    assert view.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
    view[-1, 1, 2, -1, 3] = -7.0
    assert engine_split(name, t, layer or 0)[-1][1, 2, -1, 3] == -7.0
    assert (t == -7.0).sum() == 1


@pytest.mark.parametrize("name", sorted(n for n in LAYOUTS if not LAYOUTS[n].cross_layer))
def test_empty_allocates_layers_in_one_shared_buffer(name: str) -> None:
    heads = 1 if name == "mla" else H
    paged = PagedKV.empty(
        name, num_layers=L, num_blocks=NB, block_size=BS, num_heads=heads, head_size=D
    )
    storage = {t.untyped_storage().data_ptr() for t in paged.tensors}
    assert len(storage) == 1
    pointers = paged.layer_base_pointers()
    assert pointers.dtype == torch.int64 and pointers.shape == (L,)
    layer_bytes = NB * BS * heads * D * paged.kv_planes * paged.dtype.itemsize
    assert torch.equal(pointers.diff(), torch.full((L - 1,), layer_bytes))
    if name == "vllm_nhd":
        assert not paged.tensors[0].is_contiguous()


def test_layers_as_strided_slices_of_one_buffer() -> None:
    """Per-layer flashinfer_nhd views into a cross-layer buffer agree with cross_layer."""
    buf = torch.arange(NB * L * 2 * BS * H * D, dtype=torch.float32).reshape(NB, L, 2, BS, H, D)
    per_layer = PagedKV(get_layout("flashinfer_nhd"), [buf[:, i] for i in range(L)])
    cross = PagedKV(get_layout("cross_layer"), [buf])
    assert not per_layer.tensors[0].is_contiguous()
    assert per_layer.num_layers == cross.num_layers == L
    for i in range(L):
        a, b = per_layer.layer_view(i), cross.layer_view(i)
        assert a.data_ptr() == b.data_ptr() and a.stride() == b.stride()
        assert torch.equal(a[0], buf[:, i, 0]) and torch.equal(a[1], buf[:, i, 1])
    assert torch.equal(per_layer.layer_base_pointers(), cross.layer_base_pointers())


def test_layers_with_storage_offsets_and_padding() -> None:
    """Layers sliced out of a padded buffer (non-zero storage offsets, gaps between layers)."""
    pad = 7
    buf = torch.arange(L * (2 * NB * BS * H * D + pad), dtype=torch.float32).reshape(L, -1)
    tensors = [row[pad:].view(2, NB, BS, H, D) for row in buf]
    paged = PagedKV(get_layout("flash_nhd"), tensors)
    for i in range(L):
        assert paged.layer_view(i).storage_offset() == tensors[i].storage_offset()
        assert torch.equal(paged.layer_view(i), tensors[i])
        assert paged.layer_base_pointers()[i] == tensors[i].data_ptr()


def test_paged_kv_derived_fields() -> None:
    paged = PagedKV.empty(
        "vllm_cpu", num_layers=L, num_blocks=NB, block_size=BS, num_heads=H, head_size=D
    )
    assert (paged.num_layers, paged.num_blocks, paged.block_size) == (L, NB, BS)
    assert (paged.num_heads, paged.head_size, paged.kv_planes) == (H, D, 2)
    assert paged.hidden_dim == H * D and paged.num_slots == NB * BS
    assert paged.chunk_shape(9) == (2, L, 9, H * D)
    assert paged.chunk_shape(9, num_layers=1) == (2, 1, 9, H * D)
    mla = PagedKV.empty(
        "mla", num_layers=2, num_blocks=NB, block_size=BS, num_heads=1, head_size=576
    )
    assert mla.kv_planes == 1 and mla.num_heads == 1
    assert mla.chunk_shape(16) == (1, 2, 16, 576)
    cross = PagedKV(get_layout("cross_layer"), engine_tensor("cross_layer"))
    assert cross.num_layers == L and len(cross.tensors) == 1
    assert "tensor(" not in repr(cross)
    with pytest.raises(IndexError, match="layer 3 out of range"):
        cross.layer_view(3)


@pytest.mark.parametrize(
    ("name", "tensor", "expected"),
    [
        ("flash_nhd", torch.zeros(2, NB, BS, H), "rank-5"),
        ("flash_nhd", torch.zeros(3, NB, BS, H, D), "size 2 at the KV dim 0"),
        ("flashinfer_hnd", torch.zeros(NB, 4, H, BS, D), "size 2 at the KV dim 1"),
        ("mla", torch.zeros(NB, BS, H, D), "rank-3"),
        ("vllm_cpu", torch.zeros(NB, H, BS, 2 * D + 1), "even size"),
        # K/V row blocks need the (BS, 2D) pair to be one dense run.
        ("vllm_cpu", torch.zeros(NB, H, 2 * D, BS).transpose(2, 3), "stride(BS)"),
        ("cross_layer", torch.zeros(NB, L, 2, BS, H, D), "layer index"),
    ],
)
def test_misfit_tensor_raises_layout_error(name: str, tensor: torch.Tensor, expected: str) -> None:
    with pytest.raises(LayoutError) as info:
        get_layout(name).canonical_view(tensor)
    message = str(info.value)
    assert repr(name) in message and expected in message
    assert str(tuple(tensor.shape)) in message and str(tuple(tensor.stride())) in message


def test_cross_layer_layer_out_of_range() -> None:
    with pytest.raises(LayoutError, match=r"0 <= layer < 3"):
        get_layout("cross_layer").canonical_view(engine_tensor("cross_layer"), 3)


def test_unknown_layout_lists_valid_names() -> None:
    with pytest.raises(LayoutError, match="unknown KV layout 'paged'") as info:
        get_layout("paged")
    assert all(name in str(info.value) for name in LAYOUTS)


@pytest.mark.parametrize(
    ("bad", "what"),
    [
        (torch.zeros(2, NB + 1, BS, H, D), "shape"),
        (torch.zeros(2, NB, BS, H, D, dtype=torch.float16), "dtype"),
        (torch.zeros(2, NB, BS, H, 2 * D)[..., ::2], "strides"),
    ],
)
def test_paged_kv_mismatched_layer_is_named(bad: torch.Tensor, what: str) -> None:
    tensors = [torch.zeros(2, NB, BS, H, D), torch.zeros(2, NB, BS, H, D), bad]
    with pytest.raises(LayoutError, match=rf"'flash_nhd': layer 2 has {what}"):
        PagedKV(get_layout("flash_nhd"), tensors)


def test_paged_kv_rejects_bad_inputs() -> None:
    with pytest.raises(LayoutError, match="at least one tensor"):
        PagedKV(get_layout("flash_nhd"), [])
    cross = engine_tensor("cross_layer")
    with pytest.raises(LayoutError, match="one tensor; got 2"):
        PagedKV(get_layout("cross_layer"), [cross, cross])
    with pytest.raises(LayoutError, match="layer 1"):
        PagedKV(get_layout("flash_hnd"), [torch.zeros(2, NB, H, BS, D), torch.zeros(2, NB, BS)])
    with pytest.raises(LayoutError, match="one latent head"):
        PagedKV.empty("mla", num_layers=1, num_blocks=1, block_size=1, num_heads=2, head_size=4)


def test_layout_definition_is_checked() -> None:
    with pytest.raises(LayoutError, match="both a plane and packed"):
        KVLayout("bad", "KV NB BS H 2D", packed_kv="halves")
    with pytest.raises(LayoutError, match="packed_kv"):
        KVLayout("bad", "NB H BS 2D")
    with pytest.raises(LayoutError, match="bad dims"):
        KVLayout("bad", "NB BS X D")
    with pytest.raises(LayoutError, match="storage"):
        KVLayout("bad", "KV NB BS H D", storage="NB BS H D")
