"""Serdes: how a chunk tensor becomes the payload of a stored object, and back.

A serde is chosen per tier (``remote_serde`` for the remote tier; the disk tiers use the
same setting) and named in every object's header, so a reader always decodes with the
codec the writer used, whatever its own setting. Today there is one:

- ``naive``: the tensor's bytes as they are (lossless, zero-copy on the way out).
- ``cachegen``: CacheGen-style quantization + rANS (lossy, bounded error per element; see
  ``kvtier_kernels/cachegen.py``). Today the CPU reference codec runs it (tens of MB/s);
  use it where bandwidth, not CPU, is the limit.

A chunk a codec cannot take (``ValueError`` from ``encode``, e.g. non-finite values for
``cachegen``) is written with ``naive`` instead: the header always names the codec used.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from kvtier.storage.backend import Buffer


class CorruptObject(ValueError):
    """A stored object that must not be used: its bytes disagree with its header, with
    the key asked for, or with the wire format. Readers treat it as a miss."""


class Serde(Protocol):
    #: the codec name written into headers
    name: str
    #: whether ``decode(encode(t))`` reproduces ``t`` bit for bit
    lossless: bool

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

    def encode(self, tensor: torch.Tensor) -> tuple[list[Buffer], dict[str, Any]]:
        return [tensor_bytes(tensor)], {}

    def decode(self, payload: memoryview, params: dict[str, Any], out: torch.Tensor) -> None:
        target = tensor_bytes(out)
        if params:
            raise CorruptObject(f"naive codec takes no parameters, header has {sorted(params)}")
        if len(payload) != len(target):
            raise CorruptObject(
                f"naive payload is {len(payload)} bytes, the header's shape needs {len(target)}"
            )
        target[:] = payload


class CachegenSerde:
    """CacheGen-style compression with the default per-layer level schedule."""

    name = "cachegen"
    lossless = False

    def encode(self, tensor: torch.Tensor) -> tuple[list[Buffer], dict[str, Any]]:
        from kvtier_kernels.cachegen import encode_chunk

        payload, params = encode_chunk(tensor)
        return [payload], params

    def decode(self, payload: memoryview, params: dict[str, Any], out: torch.Tensor) -> None:
        from kvtier_kernels.cachegen import CodecError, decode_chunk

        try:
            decode_chunk(payload, params, out)
        except CodecError as exc:
            raise CorruptObject(f"cachegen payload rejected: {exc}") from None


SERDES: dict[str, type] = {"naive": NaiveSerde, "cachegen": CachegenSerde}


def make_serde(name: str) -> Serde:
    """The serde called ``name``.

    Raises:
        ValueError: unknown name (the message lists the known ones).
    """
    try:
        return SERDES[name]()
    except KeyError:
        raise ValueError(
            f"unknown serde {name!r} (remote_serde): known are {', '.join(SERDES)}"
        ) from None
