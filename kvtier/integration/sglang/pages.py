"""SGLang's host-pool pages as kvtier chunks, and SGLang's page keys as kvtier keys.

Nothing here imports SGLang: a host pool is read through the methods every SGLang
``HostKVCache`` has (``get_data_page``, ``page_size``, ``layout``, ``dtype``), so the
module is tested with SGLang absent as well as against its real pools.

One SGLang page (``page_size`` tokens) is one kvtier chunk, stored in kvtier's canonical
layout whatever the host pool's layout, so a deployment may change
``--hicache-mem-layout`` and keep its cache::

    MHA  [2, num_layers, page_size, num_heads * head_dim]   (K plane, V plane)
    MLA  [1, num_layers, page_size, kv_cache_dim]

The host pool's page of each layout, as ``get_data_page(index, flat=False)`` returns it,
and the strided (never copied) view of it in the canonical layout:

    layout              MHA data page            MLA data page
    layer_first         [2, L, P, H, D]          [L, P, 1, D]
    page_first          [2, P, L, H, D]          [P, L, 1, D]
    page_first_direct   [2, 1, L, P, H, D]       [1, L, P, 1, D]

Any other layout (``page_head``, …) and the pools of SGLang's v2 path (Mamba states,
indexers, …) are stored as the pool's own flat page (``get_data_page(flat=True)``, 1-D),
under a key tagged with the layout so that a page is only ever read back into a pool of
the same format.

Where the disk tier is the only tier, a page moves between the pool and its file directly
(``PageFormat.buffers``): the file is written from, and read into, the runs of pool memory
that hold the page, in the pool's own order — ``page_first`` pages token-major
(``wire.TOKEN_MAJOR_LAYOUT``, ``[K, P, L, W]``: each plane one run), the others in the
chunk layout (``layer_first``: one run per plane and layer; ``page_first_direct``: one per
plane). The order is in the file's header, so any pool reads any page (``get_many``
decodes a page stored in another order into the chunk layout).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from kvtier.keys import CacheKey, geometry_tag
from kvtier.storage.serde import tensor_bytes
from kvtier.storage.wire import CHUNK_LAYOUT, TOKEN_MAJOR_LAYOUT, ChunkBuffers
from kvtier_kernels.dtypes import dtype_name

logger = logging.getLogger(__name__)

CANONICAL_LAYOUTS = ("layer_first", "page_first", "page_first_direct")

# The keys SGLang itself reads from --hicache-storage-backend-extra-config; they arrive in
# the same dict as kvtier's and are not kvtier config keys.
SGLANG_EXTRA_KEYS = frozenset(
    {
        "backend_name",
        "module_path",
        "class_name",
        "interface_v1",
        "tp_lcm_size",
        "enable_storage_metrics",
    }
)


# The pools an MLA model's TP ranks each hold their own shard of; SGLang's cache
# controller has every rank back them up (HybridCacheController.should_backup), and only
# the writer rank the others.
RANK_SHARDED_MLA_POOLS = frozenset({"mamba"})


class HostPool(Protocol):
    """What kvtier uses of an SGLang ``HostKVCache``."""

    page_size: int
    layout: str
    dtype: torch.dtype

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor: ...

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None: ...


def split_extra_config(extra: dict[str, Any] | None) -> dict[str, Any]:
    """The kvtier keys of SGLang's storage extra config (SGLang's own keys dropped).

    What is left goes to ``load_config`` as overrides, which rejects unknown keys and
    names them.
    """
    return {k: v for k, v in (extra or {}).items() if k not in SGLANG_EXTRA_KEYS}


@dataclass(frozen=True, slots=True)
class PageFormat:
    """How one host pool's pages are stored.

    Attributes:
        layout: the host pool's layout (``layer_first``, ``page_first``, …).
        is_mla: an MLA pool (one latent plane) rather than MHA (K and V planes).
        page_size: tokens per page as SGLang's controller counts them: its host indices
            run ``page_size`` to a page. Under decode context parallelism (DCP) that is
            the pool's ``logical_page_size``; each rank's pool holds ``page_size /
            dcp_size`` of those tokens (its data page).
        dtype: the pool's dtype.
        shape: the stored chunk's shape: canonical ``[K, L, P, W]``, or ``[numel]`` for
            a flat page.
        data_page_shape: ``get_data_page(i, flat=False).shape`` (what SGLang's generic
            path flattens).
    """

    layout: str
    is_mla: bool
    page_size: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    data_page_shape: tuple[int, ...]

    @property
    def canonical(self) -> bool:
        """Stored in kvtier's canonical layout (else as the pool's flat page)."""
        return len(self.shape) == 4

    @property
    def geometry(self) -> tuple[int, ...]:
        """What decides the page's bytes besides its dtype and page size: layers, KV
        heads and head size for a canonical page (an MLA page: one latent head), whatever
        the host layout; for a flat page, the pool's data page shape."""
        if not self.canonical:
            return tuple(self.data_page_shape)
        num_heads, head_size = self.data_page_shape[-2:]  # [..., H, D], MLA [..., 1, D]
        return self.shape[1], num_heads, head_size

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @classmethod
    def of(cls, pool: HostPool, *, flat: bool = False) -> PageFormat:
        """The format of ``pool``'s pages; ``flat`` forces the flat format (v2 pools)."""
        data_page = pool.get_data_page(0, flat=False)
        is_mla = hasattr(pool, "kv_cache_dim")
        if flat or pool.layout not in CANONICAL_LAYOUTS:
            shape: tuple[int, ...] = (data_page.numel(),)
        else:
            shape = tuple(_canonical_view(pool.layout, is_mla, data_page).shape)
        page_size = getattr(pool, "logical_page_size", pool.page_size)
        return cls(pool.layout, is_mla, page_size, pool.dtype, shape, data_page.shape)

    def page(self, pool: HostPool, index: int) -> torch.Tensor:
        """The page starting at host slot ``index`` in the stored layout: a view into the
        pool for canonical formats, else a flat copy (written back with
        ``pool.set_from_flat_data_page``)."""
        if self.canonical:
            return _canonical_view(self.layout, self.is_mla, pool.get_data_page(index, False))
        return pool.get_data_page(index, flat=True)

    def buffers(self, pool: HostPool, index: int) -> ChunkBuffers | None:
        """The page starting at host slot ``index`` as the runs of pool memory holding
        it, in the order it is stored in directly (module docstring); None for a flat
        format or a page the pool does not hold in contiguous runs."""
        if not self.canonical:
            return None
        data_page = pool.get_data_page(index, flat=False)
        if self.layout == "page_first":
            layout, view = TOKEN_MAJOR_LAYOUT, _token_major_view(self.is_mla, data_page)
        else:
            layout, view = CHUNK_LAYOUT, _canonical_view(self.layout, self.is_mla, data_page)
        runs = _byte_runs(view, depth=2) if view.device.type == "cpu" else None
        return None if runs is None else ChunkBuffers(self.shape, self.dtype, layout, runs)

    def from_flat(self, flat: torch.Tensor) -> torch.Tensor:
        """A flattened data page of this pool's layout (SGLang's generic ``get``/``set``
        path) seen in the stored layout (a view).

        Raises:
            ValueError: ``flat`` does not hold one page of this pool.
        """
        if flat.numel() != self.numel:
            raise ValueError(
                f"a flat page of {flat.numel()} elements; this pool's pages have {self.numel}"
            )
        if not self.canonical:
            return flat.view(-1)
        return _canonical_view(self.layout, self.is_mla, flat.view(self.data_page_shape))


def _canonical_view(layout: str, is_mla: bool, d: torch.Tensor) -> torch.Tensor:
    """A data page of ``layout`` (unflattened) seen as ``[K, L, P, W]``: a view, so writes
    land in the pool (``view`` raises rather than copy)."""
    if is_mla:
        if layout == "layer_first":  # [L, P, 1, D]
            d = d.unsqueeze(0)
        elif layout == "page_first":  # [P, L, 1, D]
            d = d.transpose(0, 1).unsqueeze(0)
        # page_first_direct: [1, L, P, 1, D] already
        return d.view(1, d.shape[1], d.shape[2], -1)
    if layout == "page_first":  # [2, P, L, H, D]
        d = d.transpose(1, 2)
    elif layout == "page_first_direct":  # [2, 1, L, P, H, D]
        d = d[:, 0]
    return d.view(d.shape[0], d.shape[1], d.shape[2], -1)


def _token_major_view(is_mla: bool, d: torch.Tensor) -> torch.Tensor:
    """A ``page_first`` data page seen as ``[K, P, L, W]``, its own order (a view)."""
    if is_mla:  # [P, L, 1, D]
        return d.view(1, d.shape[0], d.shape[1], -1)
    return d.view(d.shape[0], d.shape[1], d.shape[2], -1)  # [2, P, L, H, D]


def _byte_runs(t: torch.Tensor, depth: int) -> tuple[memoryview, ...] | None:
    """The bytes of ``t`` (a CPU tensor) as contiguous runs of its storage, in order,
    split along up to ``depth`` leading dims; None if that is not enough. Computed from
    the strides: a ``layer_first`` page is 2·L runs, and a tensor per run would cost more
    than the page's checksum."""
    shape, stride = tuple(t.shape), t.stride()
    split = next((d for d in range(depth + 1) if _contiguous(shape[d:], stride[d:])), None)
    if split is None:
        return None
    item = t.element_size()
    starts = [t.storage_offset() * item]
    for size, step in zip(shape[:split], stride[:split], strict=True):
        starts = [s + i * step * item for s in starts for i in range(size)]
    run = math.prod(shape[split:]) * item
    storage = tensor_bytes(torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()))
    return tuple(storage[s : s + run] for s in starts)


def _contiguous(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    expected = 1
    for size, step in zip(reversed(shape), reversed(stride), strict=True):
        if size != 1 and step != expected:
            return False
        expected *= size
    return True


@dataclass(frozen=True, slots=True)
class PageKeys:
    """Maps SGLang's page keys (hex hashes of the prefix, chained by SGLang) to kvtier keys.

    The namespace: the model, the KV dtype, the page size, the KV geometry
    (``PageFormat.geometry``), the engine (``sglang``), the salt (``key_salt``), the
    pipeline / context-parallel shard, and the tensor-parallel rank for what each rank
    holds its own shard of: in an MHA model every pool, in an MLA model only Mamba
    states. The rest of an MLA model's pools (its KV, indexer, SWA, draft pools) are
    replicated across TP ranks: SGLang lets one rank write them and every rank read them,
    so their keys have no rank (as in SGLang's own file backend).

    NOTE: two deployments that share a tier read each other's pages only when every part
    of the namespace agrees; a different ``key_salt`` always separates them.
    """

    model_name: str
    tp_rank: int
    tp_size: int
    is_mla: bool
    salt: str | None = None
    shard: tuple[tuple[str, str], ...] = ()

    def key(self, page_key: str, fmt: PageFormat, pool: str = "kv") -> CacheKey:
        """The kvtier key of SGLang page ``page_key`` of pool ``pool`` in format ``fmt``."""
        tags = [("engine", "sglang"), ("page", str(fmt.page_size)), *self.shard]
        tags.append(geometry_tag(*fmt.geometry))
        if self.salt:
            tags.append(("salt", self.salt))
        if pool != "kv":
            tags.append(("pool", pool))
        if not fmt.canonical:
            tags.append(("format", f"flat-{fmt.layout}"))
        per_rank = not self.is_mla or pool in RANK_SHARDED_MLA_POOLS
        return CacheKey(
            self.model_name,
            self.tp_size if per_rank else 1,
            self.tp_rank if per_rank else 0,
            dtype_name(fmt.dtype),
            page_hash(page_key),
            None,
            tuple(tags),
        )

    def owns(self, key: CacheKey) -> bool:
        """Whether ``key`` (made by ``key``) is of this rank's own shard; else every TP
        rank of an MLA model holds the page (keyed without the rank)."""
        return key.world_size == self.tp_size


def page_hash(page_key: str) -> bytes:
    """SGLang's page key as the key's hash bytes: its hex digest decoded (SGLang's keys
    are sha256 hex digests), else its UTF-8 bytes."""
    if len(page_key) % 2 == 0:
        try:
            return bytes.fromhex(page_key)
        except ValueError:
            pass
    return page_key.encode()
