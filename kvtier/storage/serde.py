"""Serdes: how a chunk tensor becomes the payload of a stored object, and back.

A serde is chosen per tier (``remote_serde`` for the remote tier; the disk tiers use the
same setting) and named in every object's header, so a reader always decodes with the
codec the writer used, whatever its own setting (a tier decodes its own codec with its
configured serde, any other with that codec's defaults). The serdes:

- ``naive``: the tensor's bytes as they are (lossless, zero-copy on the way out).
- ``cachegen``: CacheGen-style quantization + rANS (lossy, bounded error per element; see
  ``kvtier_kernels/cachegen/``, docs/compression.md). On a GPU its rANS coder is a
  Triton kernel; on the CPU numba kernels where numba is installed, else the numpy
  reference.

A chunk a codec cannot take (``ValueError`` from ``encode``: for ``cachegen`` non-finite
values, an MLA chunk, a dtype other than bf16/fp16/fp32) is written with ``naive``
instead, with a warning; so is a tensor that is no KV chunk at all (``NotAKVChunk``:
CacheBlend's segment positions), without one. The header always names the codec used.
"""

from __future__ import annotations

import contextlib
import threading
from typing import TYPE_CHECKING, Any, Protocol

import torch

from kvtier.storage.blob_store import Buffer

if TYPE_CHECKING:
    from kvtier.config import KVTierConfig


class CorruptObject(ValueError):
    """A stored object that must not be used: its bytes disagree with its header, with
    the key asked for, or with the wire format. Readers treat it as a miss."""


class NewerFormat(CorruptObject):
    """A stored object in a format this kvtier does not read, as a newer kvtier writes
    it: a wire format version, a chunk layout, a codec or a codec version it does not
    know. A miss like any object refused, but no sign of damage: a rolling upgrade
    writes many, so readers count and log it apart from corrupt ones."""


class NotAKVChunk(ValueError):
    """A tensor a KV codec does not code by design, as it is no KV chunk
    (``[planes, layers, tokens, width]``): CacheBlend's segment positions, say. It is
    stored verbatim (``naive``) without a warning."""


class Serde(Protocol):
    #: the codec name written into headers
    name: str
    #: whether ``decode(encode(t))`` reproduces ``t`` bit for bit
    lossless: bool
    #: whether the payload is the tensor's bytes as they are (so the tensor's known
    #: checksum is the payload's)
    verbatim: bool

    def encode(self, tensor: torch.Tensor) -> tuple[list[Buffer], dict[str, Any]]:
        """The payload parts for ``tensor`` (contiguous, on the CPU) and the codec
        parameters the decoder will need (CBOR-encodable)."""
        ...

    def decode(self, payload: memoryview, params: dict[str, Any], out: torch.Tensor) -> None:
        """Fill ``out`` (its shape and dtype come from the header) from ``payload``.

        Raises:
            CorruptObject: the payload or the parameters are inconsistent.
        """
        ...


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor (no copy; any dtype)."""
    if not tensor.is_contiguous() or tensor.device.type != "cpu":
        raise ValueError("tensor_bytes needs a contiguous CPU tensor")
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy()).cast("B")


class NaiveSerde:
    """The tensor's bytes, unchanged."""

    name = "naive"
    lossless = True
    verbatim = True

    def encode(self, tensor: torch.Tensor) -> tuple[list[Buffer], dict[str, Any]]:
        return [tensor_bytes(tensor)], {}

    def decode(self, payload: memoryview, params: dict[str, Any], out: torch.Tensor) -> None:
        self.check(payload, params, out)
        tensor_bytes(out)[:] = payload

    @staticmethod
    def check(payload: memoryview, params: dict[str, Any], out: torch.Tensor) -> None:
        """Raise ``CorruptObject`` unless ``payload`` can be decoded into ``out``: no
        parameters, and as many bytes as ``out`` holds."""
        if params:
            raise CorruptObject(f"naive codec takes no parameters, header has {sorted(params)}")
        if len(payload) != out.nbytes:
            raise CorruptObject(
                f"naive payload is {len(payload)} bytes, the header's shape needs {out.nbytes}"
            )


class CachegenSerde:
    """CacheGen-style compression (``kvtier_kernels.cachegen``).

    Args:
        k_levels, v_levels: the ``cachegen_k_levels``/``cachegen_v_levels`` texts (empty:
            the default schedule from the layer count).
        device: ``auto`` (the GPU when torch sees one and Triton can drive it, else the
            CPU), ``cpu`` or ``cuda``: where chunks are encoded and decoded.
        backend: the kernel backend of the rANS coder: ``auto`` (Triton on the GPU, else
            numba where it is installed, else the numpy reference), ``torch`` (the numpy
            reference), or ``interpret`` (the Triton kernels in the interpreter, for tests).

    Raises:
        ValueError: ``device``/``backend`` cannot be used on this machine.
    """

    name = "cachegen"
    lossless = False
    verbatim = False

    def __init__(
        self, k_levels: str = "", v_levels: str = "", device: str = "auto", backend: str = "auto"
    ):
        from kvtier_kernels import registry

        if device == "auto":
            gpu = torch.cuda.is_available() and registry.resolve_backend("auto", "cuda") == "triton"
            device = "cuda" if gpu else "cpu"
        if device == "cuda" and not torch.cuda.is_available():
            raise ValueError("cachegen_device is cuda, but torch sees no GPU")
        self.k_levels, self.v_levels = k_levels, v_levels
        self.device = torch.device(device)
        registry.resolve_backend(backend, self.device)  # raises if it cannot run here
        self.backend = backend  # resolved per op and call (auto: triton, numba or torch)
        self._local = threading.local()

    def _stream(self) -> contextlib.AbstractContextManager[Any]:
        """On a GPU, a side stream per calling thread (the tiers' I/O threads), so codec
        work never queues behind the model's kernels on the default stream; its results
        are copied to the host before a call returns."""
        if self.device.type != "cuda":
            return contextlib.nullcontext()
        stream = getattr(self._local, "stream", None)
        if stream is None:
            stream = self._local.stream = torch.cuda.Stream(self.device)
        return torch.cuda.stream(stream)

    def encode(self, tensor: torch.Tensor) -> tuple[list[Buffer], dict[str, Any]]:
        from kvtier.config.tiers import parse_levels
        from kvtier_kernels.cachegen import encode_chunk

        if tensor.dim() != 4:
            raise NotAKVChunk(
                f"cachegen codes KV chunks [planes, layers, tokens, width], not a "
                f"{tensor.dim()}-d tensor"
            )
        if tensor.shape[0] != 2:  # the same words for every chunk size
            raise ValueError(
                "cachegen codes chunks of a K and a V plane, [2, layers, tokens, width]; "
                f"this cache's have {tensor.shape[0]} plane(s) (MLA): they are stored as they are"
            )
        layers = tensor.shape[1]
        k_levels = parse_levels(self.k_levels, layers, "cachegen_k_levels")
        v_levels = parse_levels(self.v_levels, layers, "cachegen_v_levels")
        with self._stream():
            chunk = tensor.to(self.device)
            payload, params = encode_chunk(chunk, k_levels, v_levels, backend=self.backend)
        return [payload], params

    def decode(self, payload: memoryview, params: dict[str, Any], out: torch.Tensor) -> None:
        from kvtier_kernels.cachegen import VERSION, CodecError, decode_chunk

        version = params.get("version")
        if type(version) is int and version > VERSION:
            raise NewerFormat(
                f"cachegen bitstream version {version}; this kvtier reads up to {VERSION}"
            )
        try:
            with self._stream():
                decode_chunk(payload, params, out, backend=self.backend, device=self.device)
        except CodecError as exc:
            raise CorruptObject(f"cachegen payload rejected: {exc}") from None


SERDES: dict[str, type] = {"naive": NaiveSerde, "cachegen": CachegenSerde}


def make_serde(name: str, config: KVTierConfig | None = None) -> Serde:
    """The serde called ``name``, with ``config``'s settings for it (defaults without).

    Raises:
        ValueError: unknown name (the message lists the known ones), or settings that
            cannot be used on this machine.
    """
    if name not in SERDES:
        raise ValueError(f"unknown serde {name!r} (remote_serde): known are {', '.join(SERDES)}")
    if name == "cachegen" and config is not None:
        return CachegenSerde(
            config.cachegen_k_levels,
            config.cachegen_v_levels,
            config.cachegen_device,
            config.kernel_backend if config.kernel_backend in ("interpret", "torch") else "auto",
        )
    with _defaults_lock:  # one default instance per codec (readers of foreign objects)
        if name not in _defaults:
            _defaults[name] = SERDES[name]()
        return _defaults[name]


_defaults: dict[str, Serde] = {}
_defaults_lock = threading.Lock()
