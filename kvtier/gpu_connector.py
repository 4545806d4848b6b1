"""Moves chunks between an engine's paged KV cache and kvtier's chunk buffers.

The engine's cache is described once, by a ``PagedKV`` (layout descriptor + tensors);
every copy goes through the kernel registry (``paged_gather`` / ``paged_scatter``), so
the torch reference, the Triton kernels and the Triton interpreter are interchangeable
behind ``kernel_backend``. A chunk buffer is in the canonical ``KV_2LTD`` layout,
``[kv_planes, num_layers, num_tokens, num_heads * head_size]``.
"""

from __future__ import annotations

import torch

from kvtier_kernels import PagedKV, gather, scatter


class PagedKVConnector:
    """Copies token ranges of a paged KV cache into and out of chunk buffers.

    Args:
        paged: the engine's KV cache with its layout.
        backend: kernel backend (``auto`` | ``triton`` | ``interpret`` | ``torch``).
    """

    def __init__(self, paged: PagedKV, backend: str = "auto"):
        self.paged = paged
        self.backend = backend

    @property
    def dtype(self) -> torch.dtype:
        return self.paged.dtype

    def chunk_shape(self, num_tokens: int) -> tuple[int, int, int, int]:
        """Shape of the chunk buffer that holds ``num_tokens`` tokens of every layer."""
        return self.paged.chunk_shape(num_tokens)

    def from_engine(
        self, chunk: torch.Tensor, slot_mapping: torch.Tensor, layers: range | None = None
    ) -> None:
        """Gather the KV of ``slot_mapping``'s slots into ``chunk``.

        Args:
            chunk: ``[kv_planes, len(layers), T, hidden]`` buffer to fill.
            slot_mapping: ``[T]`` engine slots, one per token, all >= 0.
            layers: the engine layers ``chunk``'s layer dim holds (default: all).
        """
        gather(self.paged, slot_mapping, chunk, layers, backend=self.backend)

    def to_engine(
        self, chunk: torch.Tensor, slot_mapping: torch.Tensor, layers: range | None = None
    ) -> None:
        """Scatter ``chunk`` (layers ``layers``, default all) into the engine's slots;
        negative slots are skipped."""
        scatter(self.paged, slot_mapping, chunk, layers, backend=self.backend)
