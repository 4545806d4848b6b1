"""Small dtype helpers shared by the kernels, kvtier and the tests: same-width integer
views (bit patterns), random bit fills, and dtype names in both directions.

Importing this module imports only torch.
"""

from __future__ import annotations

import torch

__all__ = [
    "INT_OF_SIZE",
    "bits",
    "dtype_name",
    "fill_random_bits_",
    "parse_dtype",
]

INT_OF_SIZE: dict[int, torch.dtype] = {
    1: torch.int8,
    2: torch.int16,
    4: torch.int32,
    8: torch.int64,
}
"""The signed integer dtype of each element size in bytes."""


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as the signed integer dtype of its element size (same storage): compares
    bit patterns exactly, NaN payloads and fp8 included."""
    return t.view(INT_OF_SIZE[t.element_size()])


def fill_random_bits_(t: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Fill ``t`` (any strides, any device) with random bytes, NaN payloads and all; return
    ``t``."""
    raw = t.view(torch.int8) if t.dim() and t.stride(-1) == 1 else bits(t)
    info = torch.iinfo(raw.dtype)
    values = torch.randint(info.min, info.max + 1, raw.shape, generator=generator, dtype=raw.dtype)
    raw.copy_(values)
    return t


def dtype_name(dtype: torch.dtype | str) -> str:
    """``"bfloat16"`` for ``torch.bfloat16`` (a string passes through)."""
    return dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")


_DTYPES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
}
for _alias, _attr in (
    ("float8_e4m3fn", "float8_e4m3fn"),
    ("fp8", "float8_e4m3fn"),
    ("fp8_e4m3", "float8_e4m3fn"),
    ("float8_e5m2", "float8_e5m2"),
    ("fp8_e5m2", "float8_e5m2"),
):
    if hasattr(torch, _attr):
        _DTYPES[_alias] = getattr(torch, _attr)


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """``"bf16"`` / ``"bfloat16"`` / ``"torch.bfloat16"`` -> ``torch.bfloat16``, and so on
    (the KV dtypes: bf16, fp16, fp32, fp8).

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    if isinstance(name, torch.dtype):
        return name
    key = str(name).lower().removeprefix("torch.")
    try:
        return _DTYPES[key]
    except KeyError:
        raise ValueError(f"unknown KV dtype {name!r}; known: {', '.join(_DTYPES)}") from None
