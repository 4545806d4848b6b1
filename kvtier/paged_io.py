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
  :meth:`PagedIO.stores_done` blocks until every gather issued so far has landed
  in its chunk buffer, and must be called before a buffer is read or published;
- a scatter (load) waits for the engine's stream too, and the engine's stream then waits
  for the scatter: whatever the model runs next (the layer's attention) sees the loaded
  KV, with no host sync. :meth:`PagedIO.loads_done` blocks until every scatter
  has finished reading its chunk buffer, and must be called before a buffer is released
  (a pinned host buffer may otherwise be reused while the copy still reads it).

Off the GPU both calls return at once: the copies are synchronous there.

Threads: a batch (below) belongs to the thread that opened it, so one thread may load
while another stores (vLLM's loader thread beside the engine's thread: the two
directions' copies overlap on the bus). ``stores_done`` / ``loads_done`` wait for the
last batch of their direction that any thread closed, which on its stream comes after
the caller's own.

Host cost: a copy is one kernel launch through the launch plan the kernels cache per cache
and chunk geometry (:mod:`kvtier_kernels.paged.plans`), a few microseconds of Python. The
stream fencing above costs about as much again, so a step that moves several chunks (or,
layer by layer, one layer of each) opens one batch, :meth:`PagedIO.storing` /
:meth:`PagedIO.loading`: one fence and one event for the whole batch. Slot mappings are
checked and moved to the cache's device once per request (:meth:`PagedIO.device_slots`),
never read back per copy.

Copy engine: where ``kvtier tune`` found that one ``copy_(non_blocking=True)`` of
contiguous pages beats the kernel from some run size on (its ``crossover_bytes``), runs of
consecutive slots at least that large, between the cache and a pinned host chunk, are
moved with ``copy_`` (the DMA engine, no SMs) and the kernel moves the rest. That needs a
layout whose plane of a layer is one run of token rows (``[num_blocks * block_size,
heads * head_size]``, e.g. flash-attn NHD or MLA); other layouts always use the kernel.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

import torch

from kvtier_kernels import PagedKV, gather, registry, scatter
from kvtier_kernels._launch import upload
from kvtier_kernels.paged.plans import check_slot_range
from kvtier_kernels.tuning.lookup import copy_engine_crossover, prepend_search_path


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


class _Batch:
    """An open batch of copies in one direction (see :meth:`PagedIO.storing`); a batch
    entered while one of its direction is open in the same thread is part of that one."""

    __slots__ = ("direction", "io", "owner", "streams")

    def __init__(self, io: PagedIO, direction: str) -> None:
        self.io, self.direction, self.owner = io, direction, False
        self.streams: contextlib.AbstractContextManager[None] | None = None

    def __enter__(self) -> None:
        io = self.io
        if io._open is not None:
            if io._open != self.direction:
                raise RuntimeError(f"a {io._open} batch is open: no {self.direction} inside it")
            return
        if io._streams is not None:
            self.streams = io._on(self.direction)
            self.streams.__enter__()
        io._open, self.owner = self.direction, True

    def __exit__(self, *exc: object) -> None:
        if not self.owner:
            return
        self.io._open, self.owner = None, False
        streams, self.streams = self.streams, None
        if streams is not None:
            streams.__exit__(*exc)


class PagedIO:
    """Copies token ranges of a paged KV cache into and out of chunk buffers.

    Args:
        paged: the engine's KV cache with its layout.
        backend: kernel backend (``auto`` | ``triton`` | ``interpret`` | ``torch`` |
            ``numba``); checked here (ValueError naming it where it cannot run).
        copy_engine_min_bytes: ``{"store": bytes, "load": bytes}``, the run size from
            which ``copy_`` moves contiguous pages instead of the kernel; default: the
            tuned crossover of ``paged_gather`` / ``paged_scatter`` on this GPU (none on a
            CPU, where only an explicit value enables it).
    """

    def __init__(
        self,
        paged: PagedKV,
        backend: str = "auto",
        copy_engine_min_bytes: dict[str, int | None] | None = None,
    ):
        self.paged = paged
        self.backend = backend
        device = paged.device
        registry.resolve_backend(backend, device)  # e.g. numba not installed: said now
        self._streams = _Streams(device) if device.type == "cuda" else None
        if copy_engine_min_bytes is None:
            copy_engine_min_bytes = {
                "store": copy_engine_crossover("paged_gather", device),
                "load": copy_engine_crossover("paged_scatter", device),
            }
        # every layer shares layer 0's shape and strides (PagedKV checks it)
        token_rows = _token_rows(paged.layer_view(0)) is not None
        self.copy_engine_min_bytes = copy_engine_min_bytes if token_rows else {}
        self._copy_engine = any(v is not None for v in self.copy_engine_min_bytes.values())
        self._thread = threading.local()  # .open: the direction of this thread's batch

    @property
    def _open(self) -> str | None:
        """The direction of the batch this thread has open, if any. Each thread has its
        own: a loader thread's loads run beside the engine thread's stores (on a GPU each
        on its direction's stream; the current stream is per thread too)."""
        return getattr(self._thread, "open", None)

    @_open.setter
    def _open(self, direction: str | None) -> None:
        self._thread.open = direction

    @property
    def dtype(self) -> torch.dtype:
        return self.paged.dtype

    def chunk_shape(self, num_tokens: int) -> tuple[int, int, int, int]:
        """Shape of the chunk buffer that holds ``num_tokens`` tokens of every layer."""
        return self.paged.chunk_shape(num_tokens)

    def device_slots(self, slot_mapping: torch.Tensor) -> torch.Tensor:
        """``slot_mapping`` (a host tensor of int64 slots, negative = skip) checked once
        and placed where the copies read it: on the cache's GPU (one host-to-device copy
        per request, so no copy reads slots back), or left on the host where the copy
        engine needs them (a tuned crossover) or the cache is there.

        Raises:
            ValueError: a slot ``>= num_slots`` (the message names it).
        """
        check_slot_range(self.paged, slot_mapping)
        if self._streams is None or self._copy_engine:
            return slot_mapping
        # through pinned memory: no wait for the engine's stream; the copies wait for it
        return upload(slot_mapping, self.paged.device)

    def from_engine(
        self, chunk: torch.Tensor, slot_mapping: torch.Tensor, layers: range | None = None
    ) -> None:
        """Gather the KV of ``slot_mapping``'s slots into ``chunk`` (on a GPU: queued on
        the store stream; call :meth:`stores_done` before reading ``chunk``).

        Args:
            chunk: ``[kv_planes, len(layers), T, hidden]`` buffer to fill.
            slot_mapping: ``[T]`` engine slots, one per token, all >= 0 (on the host, or
                as :meth:`device_slots` placed them).
            layers: the engine layers ``chunk``'s layer dim holds (default: all).
        """
        if self._open == "store":
            self._gather(chunk, slot_mapping, layers)
            return
        with self.storing():
            self._gather(chunk, slot_mapping, layers)

    def to_engine(
        self, chunk: torch.Tensor, slot_mapping: torch.Tensor, layers: range | None = None
    ) -> None:
        """Scatter ``chunk`` (layers ``layers``, default all) into the engine's slots;
        negative slots are skipped (on a GPU: queued on the load stream, ahead of the
        engine's next work; call :meth:`loads_done` before releasing ``chunk``)."""
        if self._open == "load":
            self._scatter(chunk, slot_mapping, layers)
            return
        with self.loading():
            self._scatter(chunk, slot_mapping, layers)

    def storing(self) -> contextlib.AbstractContextManager[None]:
        """A batch of :meth:`from_engine` calls: on a GPU the store stream waits for the
        engine's queued work once, at the start, and one event marks the end of all of
        them (what :meth:`stores_done` waits for). A batch inside a batch of the same
        direction is part of it."""
        return _Batch(self, "store")

    def loading(self) -> contextlib.AbstractContextManager[None]:
        """A batch of :meth:`to_engine` calls: one fence at the start, and the engine's
        stream waits once, at the end, for all of them."""
        return _Batch(self, "load")

    def _gather(self, chunk: torch.Tensor, slots: torch.Tensor, layers: range | None) -> None:
        rest = self._copy_runs("store", chunk, slots, layers) if self._copy_engine else slots
        if rest is not None:
            gather(self.paged, rest, chunk, layers, backend=self.backend)

    def _scatter(self, chunk: torch.Tensor, slots: torch.Tensor, layers: range | None) -> None:
        rest = self._copy_runs("load", chunk, slots, layers) if self._copy_engine else slots
        if rest is not None:
            scatter(self.paged, rest, chunk, layers, backend=self.backend)

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

    def _copy_runs(
        self,
        direction: str,
        chunk: torch.Tensor,
        slot_mapping: torch.Tensor,
        layers: range | None,
    ) -> torch.Tensor | None:
        """Move the runs of consecutive slots worth a ``copy_`` (see the module
        docstring); return the slots left for the kernel (moved ones set to -1), None when
        nothing is left, or ``slot_mapping`` itself when no run qualifies."""
        min_bytes = self.copy_engine_min_bytes.get(direction)
        if min_bytes is None or not chunk.is_contiguous():
            return slot_mapping
        if self._streams is not None and not chunk.is_pinned():
            return slot_mapping  # the crossover was measured against pinned host memory
        slots = slot_mapping.tolist()
        if slots and max(slots) >= self.paged.num_slots:
            return slot_mapping  # the kernel's checks name the bad slot
        row_bytes = chunk.shape[-1] * chunk.element_size()
        runs = [r for r in _slot_runs(slots) if r[2] * row_bytes >= min_bytes]
        if not runs:
            return slot_mapping
        layers = range(self.paged.num_layers) if layers is None else layers
        rest = slot_mapping.clone()
        for j, layer in enumerate(layers):
            rows = _token_rows(self.paged.layer_view(layer))
            assert rows is not None  # checked for the layout at construction
            for plane in range(chunk.shape[0]):
                for token, slot, n in runs:
                    part, pages = chunk[plane, j, token : token + n], rows[plane, slot : slot + n]
                    if direction == "store":
                        part.copy_(pages, non_blocking=True)
                    else:
                        pages.copy_(part, non_blocking=True)
        for token, _, n in runs:
            rest[token : token + n] = -1
        return rest if bool((rest >= 0).any()) else None


def _token_rows(view: torch.Tensor) -> torch.Tensor | None:
    """A layer's canonical view ``[KV, NB, BS, H, D]`` as ``[KV, NB * BS, H * D]`` token
    rows without a copy, or None when the layout does not store a plane that way."""
    kv, nb, bs, h, d = view.shape
    rows = (h * d, d, 1)
    if view.stride()[2:] != rows or (nb > 1 and view.stride(1) != bs * h * d):
        return None
    return view.as_strided((kv, nb * bs, h * d), (view.stride(0), h * d, 1))


def _slot_runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """Maximal runs of consecutive non-negative slots: ``(first token, first slot, n)``."""
    runs: list[tuple[int, int, int]] = []
    start = 0
    for t in range(1, len(slots) + 1):
        if t < len(slots) and slots[t] >= 0 and slots[t] == slots[t - 1] + 1:
            continue
        if slots[start] >= 0:
            runs.append((start, slots[start], t - start))
        start = t
    return runs


def use_tuning_dir(tuning_dir: str | None) -> None:
    """Put the config's ``tuning_dir`` (``os.pathsep``-separated) first on the kernels'
    tuning search path, for this whole process. Idempotent.

    NOTE: the search path is process-wide (every launcher reads it), so the process's owner
    applies it once (the vLLM worker, the CLI); a ``CacheEngine`` never does.
    """
    if tuning_dir is not None:
        prepend_search_path(tuning_dir.split(os.pathsep))
