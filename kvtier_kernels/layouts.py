"""Engine paged-KV layouts and the canonical chunk layout.

Every engine layout reduces to one strided *canonical view* per layer::

    [KV, num_blocks, block_size, num_heads, head_size]

``KV`` is 2 (plane 0 = K, plane 1 = V), or 1 for MLA, where ``num_heads`` is 1 and
``head_size`` is the latent dim. The view is built from the engine tensor's *actual*
strides with ``as_strided`` (it shares storage, never copies), so per-layer tensors that
are non-contiguous views into one shared buffer work as they are.

``slot = block_id * block_size + offset``; a negative slot means "skip".

Supported layouts (``dims`` labels: ``L`` layer, ``KV`` K/V plane, ``NB`` block, ``BS``
token slot in the block, ``H`` kv head, ``D`` head dim, ``2D`` K and V packed in one dim):

=================  ==========================  ==============================================  =============================
name               engine tensor (per layer)   where K and V sit                               used by
=================  ==========================  ==============================================  =============================
``flash_nhd``      ``[2, NB, BS, H, D]``       plane 0 / 1 of the leading dim                  vLLM flash-attn (older, NHD)
``flash_hnd``      ``[2, NB, H, BS, D]``       plane 0 / 1 of the leading dim                  vLLM flash-attn (older, HND)
``flashinfer_nhd`` ``[NB, 2, BS, H, D]``       plane 0 / 1 of dim 1                            FlashInfer NHD
``flashinfer_hnd`` ``[NB, 2, H, BS, D]``       plane 0 / 1 of dim 1                            FlashInfer HND
``mla``            ``[NB, BS, D]``             one latent plane (KV = 1, H = 1)                MLA (DeepSeek) backends
``cross_layer``    ``[NB, L, 2, BS, H, D]``    plane 0 / 1 of dim 2; one tensor, all layers    cross-layer block layout
``vllm_cpu``       ``[NB, H, BS, 2*D]``        per (block, head): a K region of BS * D, then   vLLM 0.32+ CPU backend
                   contiguous (LBHNC)          a V region (``.view(NB, H, 2*BS, D).chunk``);   (LBHNC)
                                               inside a region the CPU kernels' own tiling
                                               (``token_major=False``: whole blocks only)
``vllm_nhd``       ``[NB, H, BS, 2*D]`` view   per (block, token, head): ``[..., :D]`` is K,   vLLM 0.32+ FlashAttention
                   of ``[NB, BS, H, 2*D]``     ``[..., D:]`` is V                              (default LBNHC)
``vllm_hnd``       ``[NB, H, BS, 2*D]``        per (block, head, token): ``[..., :D]`` is K,   vLLM 0.32+ FlashAttention
                   contiguous (LBHNC)          ``[..., D:]`` is V                              with HND requested
=================  ==========================  ==============================================  =============================

The canonical in-memory chunk layout is ``KV_2LTD``: ``[2, num_layers, num_tokens,
num_heads * head_size]`` (MLA: ``[1, num_layers, num_tokens, head_size]``); see
:meth:`PagedKV.chunk_shape`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

__all__ = [
    "KV_2LTD",
    "LAYOUTS",
    "KVLayout",
    "LayoutError",
    "PagedKV",
    "get_layout",
]

KV_2LTD = "KV_2LTD"
"""Name of the canonical chunk layout: ``[KV, num_layers, num_tokens, num_heads * head_size]``.

``KV`` is 2 (K plane, then V plane) or 1 for MLA (``[1, L, T, latent_dim]``). Within a
row the ``num_heads * head_size`` values are head-major (head 0's ``head_size`` values,
then head 1's, ...). Rows are tokens in slot-mapping order."""

_AXES = frozenset({"L", "KV", "NB", "BS", "H", "D", "2D"})

PackedKV = Literal["halves", "rows"]


class LayoutError(ValueError):
    """A tensor does not fit the layout it was described with, or a layout name is unknown."""


@dataclass(frozen=True, slots=True)
class KVLayout:
    """How one engine KV tensor maps onto the canonical ``[KV, NB, BS, H, D]`` view.

    Attributes:
        name: registry name (``LAYOUTS[name]``).
        dims: space-separated axis labels of the engine tensor, outermost first, e.g.
            ``"NB KV BS H D"``. Labels: ``L`` layer (only for a tensor that holds every
            layer), ``KV`` K/V plane (size 2), ``NB`` block, ``BS`` token slot in a block,
            ``H`` kv head, ``D`` head dim, ``2D`` K and V packed into one dim of size
            ``2 * head_size``. No ``KV`` and no ``2D`` means one latent plane (MLA), which
            also has no ``H``.
        packed_kv: for a ``2D`` dim, where K and V sit. ``"halves"``: K is ``[..., :D]``
            and V ``[..., D:]`` of that dim. ``"rows"``: the ``(BS, 2D)`` pair of dims is
            one run of ``BS * 2D`` elements per (block, head), read as ``[2, BS, D]``
            (vLLM's CPU backend: ``.view(NB, H, 2 * BS, D).chunk(2, dim=2)``).
        storage: axis labels in memory order (outermost first) when the engine hands out a
            permuted view; ``None`` means the same as ``dims``. It only guides
            :meth:`empty`; :meth:`canonical_view` always reads the tensor's real strides.
        used_by: who hands out tensors in this layout (documentation).
        token_major: whether the ``BS`` rows of a block are really tokens. False when the
            engine's kernels arrange each (block, head) region their own way (vLLM's CPU
            backend: an ISA-specific tiling, e.g. K transposed to ``[D, BS]``): copies are
            then exact only for whole blocks, and a row is not one token's K or V.
    """

    name: str
    dims: str
    packed_kv: PackedKV | None = None
    storage: str | None = None
    used_by: str = ""
    token_major: bool = True

    def __post_init__(self) -> None:
        axes = self.axes
        unknown = set(axes) - _AXES
        if unknown or len(set(axes)) != len(axes):
            raise LayoutError(
                f"layout {self.name!r}: bad dims {self.dims!r} (labels {sorted(_AXES)})"
            )
        for required in ("NB", "BS"):
            if required not in axes:
                raise LayoutError(f"layout {self.name!r}: dims {self.dims!r} lack {required}")
        if ("D" in axes) == ("2D" in axes):
            raise LayoutError(f"layout {self.name!r}: dims need exactly one of D or 2D")
        if ("2D" in axes) != (self.packed_kv is not None):
            raise LayoutError(f"layout {self.name!r}: packed_kv is set iff dims contain 2D")
        if "2D" in axes and "KV" in axes:
            raise LayoutError(f"layout {self.name!r}: K/V cannot be both a plane and packed")
        if self.kv_planes == 1 and "H" in axes:
            raise LayoutError(f"layout {self.name!r}: a single-plane (MLA) layout has no H")
        if self.storage is not None and sorted(self.storage.split()) != sorted(axes):
            raise LayoutError(f"layout {self.name!r}: storage {self.storage!r} must permute dims")

    @property
    def axes(self) -> tuple[str, ...]:
        """The engine tensor's axis labels, outermost first."""
        return tuple(self.dims.split())

    @property
    def kv_planes(self) -> int:
        """2 for K/V layouts, 1 for MLA."""
        axes = self.axes
        return 2 if ("KV" in axes or "2D" in axes) else 1

    @property
    def cross_layer(self) -> bool:
        """True when one tensor holds every layer (the ``L`` axis)."""
        return "L" in self.axes

    def engine_shape(
        self,
        num_blocks: int,
        block_size: int,
        num_heads: int,
        head_size: int,
        num_layers: int | None = None,
    ) -> tuple[int, ...]:
        """Logical shape of one engine tensor (``num_layers`` only for cross-layer layouts)."""
        if self.kv_planes == 1 and num_heads != 1:
            raise LayoutError(
                f"layout {self.name!r} has one latent head; got num_heads={num_heads}"
            )
        if self.cross_layer and num_layers is None:
            raise LayoutError(f"layout {self.name!r} holds every layer; pass num_layers")
        sizes = {
            "L": num_layers or 0,
            "KV": 2,
            "NB": num_blocks,
            "BS": block_size,
            "H": num_heads,
            "D": head_size,
            "2D": 2 * head_size,
        }
        return tuple(sizes[a] for a in self.axes)

    def empty(
        self,
        num_blocks: int,
        block_size: int,
        num_heads: int,
        head_size: int,
        *,
        num_layers: int | None = None,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
    ) -> torch.Tensor:
        """Allocate one engine tensor in this layout, in its physical (``storage``) order.

        Returns a tensor of :meth:`engine_shape`, a permuted view when ``storage`` differs
        from ``dims`` (as the engine would hand it out).
        """
        shape = self.engine_shape(num_blocks, block_size, num_heads, head_size, num_layers)
        return _alloc_permuted(self, shape, (), dtype, device)[0]

    def canonical_view(self, layer_tensor: torch.Tensor, layer: int | None = None) -> torch.Tensor:
        """Return the canonical ``[KV, NB, BS, H, D]`` view of one layer; shares storage.

        Args:
            layer_tensor: the engine tensor, shaped as ``dims`` with any strides.
            layer: for a cross-layer layout, which layer to view (required); otherwise only
                used to name the layer in errors.

        Raises:
            LayoutError: the tensor's rank, sizes or strides do not fit this layout (the
                message names the layout, the tensor's shape and strides, and what was
                expected), or ``layer`` is missing / out of range for a cross-layer layout.
        """
        t = layer_tensor
        if not isinstance(t, torch.Tensor):
            raise LayoutError(f"layout {self.name!r}: expected a torch.Tensor, got {type(t)!r}")
        axes = self.axes
        if t.dim() != len(axes):
            raise self._misfit(t, layer, f"a rank-{len(axes)} tensor [{', '.join(axes)}]")
        size = dict(zip(axes, t.shape, strict=True))
        stride = dict(zip(axes, t.stride(), strict=True))
        offset = t.storage_offset()

        if self.cross_layer:
            if layer is None:
                raise self._misfit(
                    t, layer, "a layer index (layer=) for a tensor holding all layers"
                )
            if not 0 <= layer < size["L"]:
                raise self._misfit(t, layer, f"0 <= layer < {size['L']}")
            offset += layer * stride["L"]

        if "KV" in axes and size["KV"] != 2:
            raise self._misfit(t, layer, f"size 2 at the KV dim {axes.index('KV')}")
        nb, bs = size["NB"], size["BS"]
        heads, head_stride = (size["H"], stride["H"]) if "H" in axes else (1, 0)

        if "KV" in axes:
            kv, kv_stride = 2, stride["KV"]
            d, d_stride = size["D"], stride["D"]
            bs_stride = stride["BS"]
        elif "2D" in axes:
            if size["2D"] % 2:
                raise self._misfit(
                    t, layer, f"an even size (2 * head_size) at dim {axes.index('2D')}"
                )
            kv, d, d_stride = 2, size["2D"] // 2, stride["2D"]
            if self.packed_kv == "halves":
                kv_stride, bs_stride = d * d_stride, stride["BS"]
            else:  # "rows": (BS, 2D) is one run of BS * 2D elements, read as [2, BS, D].
                if bs > 1 and stride["BS"] != 2 * d * d_stride:
                    raise self._misfit(
                        t, layer, f"stride(BS) == 2 * head_size * stride(2D) = {2 * d * d_stride}"
                    )
                kv_stride, bs_stride = bs * d * d_stride, d * d_stride
        else:  # one latent plane (MLA)
            kv, kv_stride = 1, 0
            d, d_stride = size["D"], stride["D"]
            bs_stride = stride["BS"]

        return t.as_strided(
            (kv, nb, bs, heads, d),
            (kv_stride, stride["NB"], bs_stride, head_stride, d_stride),
            offset,
        )

    def _misfit(self, t: torch.Tensor, layer: int | None, expected: str) -> LayoutError:
        where = "" if layer is None else f" (layer {layer})"
        return LayoutError(
            f"layout {self.name!r} [{', '.join(self.axes)}]{where}: expected {expected}; "
            f"got tensor shape {tuple(t.shape)} strides {tuple(t.stride())}"
        )


def _alloc_permuted(
    layout: KVLayout,
    shape: tuple[int, ...],
    lead: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device | str | None,
) -> list[torch.Tensor]:
    """Allocate ``lead + shape`` in storage order; return the permuted per-``lead`` views."""
    axes = layout.axes
    storage = tuple(layout.storage.split()) if layout.storage else axes
    order = [axes.index(a) for a in storage]
    buffer = torch.empty(*lead, *(shape[i] for i in order), dtype=dtype, device=device)
    inverse = [order.index(i) for i in range(len(axes))]
    flat = buffer.reshape(-1, *buffer.shape[len(lead) :]) if lead else buffer.unsqueeze(0)
    return [flat[i].permute(inverse) for i in range(flat.shape[0])]


_LAYOUT_LIST = (
    KVLayout("flash_nhd", "KV NB BS H D", used_by="vLLM flash-attn (older), NHD"),
    KVLayout("flash_hnd", "KV NB H BS D", used_by="vLLM flash-attn (older), HND"),
    KVLayout("flashinfer_nhd", "NB KV BS H D", used_by="FlashInfer, NHD"),
    KVLayout("flashinfer_hnd", "NB KV H BS D", used_by="FlashInfer, HND"),
    KVLayout("mla", "NB BS D", used_by="MLA backends (one latent plane)"),
    KVLayout("cross_layer", "NB L KV BS H D", used_by="cross-layer block layout (all layers)"),
    KVLayout(
        "vllm_cpu",
        "NB H BS 2D",
        packed_kv="rows",
        used_by="vLLM 0.32+ CPU attention backend (LBHNC)",
        token_major=False,
    ),
    KVLayout(
        "vllm_nhd",
        "NB H BS 2D",
        packed_kv="halves",
        storage="NB BS H 2D",
        used_by="vLLM 0.32+ FlashAttention, default LBNHC",
    ),
    KVLayout(
        "vllm_hnd",
        "NB H BS 2D",
        packed_kv="halves",
        used_by="vLLM 0.32+ FlashAttention, LBHNC",
    ),
)

LAYOUTS: dict[str, KVLayout] = {layout.name: layout for layout in _LAYOUT_LIST}
"""Every supported engine layout by name."""


def get_layout(name: str) -> KVLayout:
    """Return the layout called ``name``; raises LayoutError listing the valid names."""
    try:
        return LAYOUTS[name]
    except KeyError:
        raise LayoutError(
            f"unknown KV layout {name!r}; valid layouts: {', '.join(sorted(LAYOUTS))}"
        ) from None


@dataclass(slots=True)
class PagedKV:
    """An engine's paged KV cache: per-layer tensors, or one tensor holding every layer.

    Args:
        layout: how each tensor maps to the canonical view (a ``KVLayout`` or its name).
        tensors: one tensor per layer, all with the same shape, strides, dtype and device
            (they may be views into one shared buffer); for a cross-layer layout exactly
            one tensor (a bare tensor is accepted and wrapped).

    Derived (validated in ``__post_init__``): ``num_layers``, ``num_blocks``,
    ``block_size``, ``num_heads``, ``head_size``, ``kv_planes`` (2, or 1 for MLA),
    ``dtype``, ``device``. ``launch_cache`` holds what the kernels' launchers computed
    once for this cache (layer-address tables, bound launches; see
    :mod:`kvtier_kernels.paged.plans`).

    NOTE: a cache's tensors are fixed once described: an engine that re-allocates its KV
    cache (a reset, a re-registration) describes it again with a new ``PagedKV``, which
    starts with an empty ``launch_cache``; nothing cached for one cache serves another.

    Raises:
        LayoutError: no tensors, a tensor does not fit the layout, or a layer differs from
            layer 0 in shape, strides, dtype or device (the message names the layer).
    """

    layout: KVLayout
    tensors: list[torch.Tensor] = field(repr=False)
    num_layers: int = field(init=False)
    num_blocks: int = field(init=False)
    block_size: int = field(init=False)
    num_heads: int = field(init=False)
    head_size: int = field(init=False)
    kv_planes: int = field(init=False)
    dtype: torch.dtype = field(init=False)
    device: torch.device = field(init=False)
    launch_cache: dict = field(init=False, repr=False, compare=False, default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.layout, str):
            self.layout = get_layout(self.layout)
        if isinstance(self.tensors, torch.Tensor):
            self.tensors = [self.tensors]
        self.tensors = list(self.tensors)
        name = self.layout.name
        if not self.tensors:
            raise LayoutError(f"layout {name!r}: PagedKV needs at least one tensor")
        first = self.tensors[0]
        if self.layout.cross_layer:
            if len(self.tensors) != 1:
                raise LayoutError(
                    f"layout {name!r} holds every layer in one tensor; got {len(self.tensors)} tensors"
                )
            if first.dim() != len(self.layout.axes):
                raise self.layout._misfit(first, None, f"a rank-{len(self.layout.axes)} tensor")
            self.num_layers = first.shape[self.layout.axes.index("L")]
        else:
            self.num_layers = len(self.tensors)
        for i, t in enumerate(self.tensors[1:], start=1):
            for what, got, want in (
                ("shape", tuple(t.shape), tuple(first.shape)),
                ("strides", t.stride(), first.stride()),
                ("dtype", t.dtype, first.dtype),
                ("device", t.device, first.device),
            ):
                if got != want:
                    raise LayoutError(
                        f"layout {name!r}: layer {i} has {what} {got}, layer 0 has {want}; "
                        "every layer must match"
                    )
        view = self.layer_view(0)
        self.kv_planes, self.num_blocks, self.block_size, self.num_heads, self.head_size = (
            view.shape
        )
        self.dtype = first.dtype
        self.device = first.device

    @classmethod
    def empty(
        cls,
        layout: KVLayout | str,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_heads: int,
        head_size: int,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
    ) -> PagedKV:
        """Allocate an uninitialised cache the way an engine does.

        Per-layer layouts get one shared buffer ``[num_layers, *storage]`` with each layer a
        (possibly permuted) view into it; a cross-layer layout gets one tensor.
        """
        layout = get_layout(layout) if isinstance(layout, str) else layout
        if layout.cross_layer:
            tensor = layout.empty(
                num_blocks,
                block_size,
                num_heads,
                head_size,
                num_layers=num_layers,
                dtype=dtype,
                device=device,
            )
            return cls(layout, [tensor])
        shape = layout.engine_shape(num_blocks, block_size, num_heads, head_size)
        return cls(layout, _alloc_permuted(layout, shape, (num_layers,), dtype, device))

    @property
    def hidden_dim(self) -> int:
        """``num_heads * head_size``: the last dim of a ``KV_2LTD`` chunk."""
        return self.num_heads * self.head_size

    @property
    def num_slots(self) -> int:
        """``num_blocks * block_size``: valid slots are ``0 <= slot < num_slots``."""
        return self.num_blocks * self.block_size

    def layer_view(self, layer: int) -> torch.Tensor:
        """Canonical ``[KV, NB, BS, H, D]`` view of ``layer`` (shares storage).

        Raises:
            IndexError: ``layer`` is not in ``[0, num_layers)``.
        """
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} out of range: the cache has {self.num_layers} layers")
        if self.layout.cross_layer:
            return self.layout.canonical_view(self.tensors[0], layer)
        return self.layout.canonical_view(self.tensors[layer], layer)

    def chunk_shape(
        self, num_tokens: int, num_layers: int | None = None
    ) -> tuple[int, int, int, int]:
        """Shape of a ``KV_2LTD`` chunk: ``(kv_planes, num_layers, num_tokens, hidden_dim)``.

        ``num_layers`` defaults to every layer of the cache.
        """
        layers = self.num_layers if num_layers is None else num_layers
        return (self.kv_planes, layers, num_tokens, self.hidden_dim)

    def layer_base_pointers(self) -> torch.Tensor:
        """int64 CPU tensor ``[num_layers]`` of each layer's canonical-view ``data_ptr()``.

        The storage offset of the view is included; every layer shares the strides of
        layer 0's canonical view, so a kernel needs one stride set plus this table.
        """
        return torch.tensor(
            [self.layer_view(i).data_ptr() for i in range(self.num_layers)], dtype=torch.int64
        )
