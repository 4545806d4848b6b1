"""Moves chunks between an engine's paged KV cache and kvtier's chunk buffers.

The engine's cache is described once, by a ``PagedKV`` (layout descriptor + tensors);
every copy goes through the kernel registry (``paged_gather`` / ``paged_scatter``), so
the torch reference, the Triton kernels and the Triton interpreter are interchangeable
behind ``kernel_backend``. A chunk buffer is in the canonical ``KV_2LTD`` layout,
``[kv_planes, num_layers, num_tokens, num_heads * head_size]``.

On a GPU the copies run on two streams of their own, one for stores and one for loads,
ordered against the engine's stream with events:

- a gather (store) first waits for the work already queued on the engine's stream (the
  KV it reads is computed there), then runs beside the model's next layers;
  :meth:`PagedKVConnector.stores_done` blocks until every gather issued so far has landed
  in its chunk buffer, and must be called before a buffer is read or published;
- a scatter (load) waits for the engine's stream too, and the engine's stream then waits
  for the scatter: whatever the model runs next (the layer's attention) sees the loaded
  KV, with no host sync. :meth:`PagedKVConnector.loads_done` blocks until every scatter
  has finished reading its chunk buffer, and must be called before a buffer is released
  (a pinned host buffer may otherwise be reused while the copy still reads it).

Off the GPU both calls return at once: the copies are synchronous there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from kvtier_kernels import PagedKV, gather, scatter


class _Streams:
    """The side streams of one CUDA/HIP device, and the last event recorded on each."""

    def __init__(self, device: torch.device):
        self.device = device
        self.store = torch.cuda.Stream(device)
        self.load = torch.cuda.Stream(device)
        self.store_done: torch.cuda.Event | None = None
        self.load_done: torch.cuda.Event | None = None

    @contextlib.contextmanager
    def on(self, side: torch.cuda.Stream) -> Iterator[None]:
        """Run the body on ``side`` after the engine's queued work; record its end."""
        engine = torch.cuda.current_stream(self.device)
        side.wait_stream(engine)
        with torch.cuda.stream(side):
            yield
        event = torch.cuda.Event()
        event.record(side)
        if side is self.load:
            engine.wait_event(event)  # the model reads what the load wrote
            self.load_done = event
        else:
            self.store_done = event


class PagedKVConnector:
    """Copies token ranges of a paged KV cache into and out of chunk buffers.

    Args:
        paged: the engine's KV cache with its layout.
        backend: kernel backend (``auto`` | ``triton`` | ``interpret`` | ``torch``).
    """

    def __init__(self, paged: PagedKV, backend: str = "auto"):
        self.paged = paged
        self.backend = backend
        device = paged.device
        self._streams = _Streams(device) if device.type == "cuda" else None

    @property
    def dtype(self) -> torch.dtype:
        return self.paged.dtype

    def chunk_shape(self, num_tokens: int) -> tuple[int, int, int, int]:
        """Shape of the chunk buffer that holds ``num_tokens`` tokens of every layer."""
        return self.paged.chunk_shape(num_tokens)

    def from_engine(
        self, chunk: torch.Tensor, slot_mapping: torch.Tensor, layers: range | None = None
    ) -> None:
        """Gather the KV of ``slot_mapping``'s slots into ``chunk`` (on a GPU: queued on
        the store stream; call :meth:`stores_done` before reading ``chunk``).

        Args:
            chunk: ``[kv_planes, len(layers), T, hidden]`` buffer to fill.
            slot_mapping: ``[T]`` engine slots, one per token, all >= 0.
            layers: the engine layers ``chunk``'s layer dim holds (default: all).
        """
        with self._on("store"):
            gather(self.paged, slot_mapping, chunk, layers, backend=self.backend)

    def to_engine(
        self, chunk: torch.Tensor, slot_mapping: torch.Tensor, layers: range | None = None
    ) -> None:
        """Scatter ``chunk`` (layers ``layers``, default all) into the engine's slots;
        negative slots are skipped (on a GPU: queued on the load stream, ahead of the
        engine's next work; call :meth:`loads_done` before releasing ``chunk``)."""
        with self._on("load"):
            scatter(self.paged, slot_mapping, chunk, layers, backend=self.backend)

    def stores_done(self) -> None:
        """Block until every gather issued so far has written its chunk buffer."""
        if self._streams is not None and self._streams.store_done is not None:
            self._streams.store_done.synchronize()

    def loads_done(self) -> None:
        """Block until every scatter issued so far has read its chunk buffer."""
        if self._streams is not None and self._streams.load_done is not None:
            self._streams.load_done.synchronize()

    def _on(self, direction: str) -> contextlib.AbstractContextManager[None]:
        if self._streams is None:
            return contextlib.nullcontext()
        side = self._streams.store if direction == "store" else self._streams.load
        return self._streams.on(side)
