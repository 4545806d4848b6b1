"""Objects written by earlier versions of the CacheGen bitstream still decode, on every
backend, to exactly what their own decoder returned.

``tests/fixtures/cachegen_v2.json`` holds version-2 objects written by the encoder before
version 3 (commit 6a32166), ``tests/fixtures/cachegen_v3.json`` version-3 objects written by
the encoder before version 4 (commit 0811488), ``tests/fixtures/cachegen_v4.json`` version-4
objects written by the encoder before version 5 (commit e44f604): the chunk, the payload and
params, and the sha256 of what that decoder returned (float32 bytes; bfloat16 bits).
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from support.samples import assert_within_bound

from kvtier_kernels.cachegen import CodecError, decode_chunk, params_checksum

FIXTURES = Path(__file__).parent / "fixtures"
CASES = json.loads((FIXTURES / "cachegen_v2.json").read_text())["cases"]
V3_CASES = json.loads((FIXTURES / "cachegen_v3.json").read_text())["cases"]
V4_CASES = json.loads((FIXTURES / "cachegen_v4.json").read_text())["cases"]
BACKENDS = [
    "torch",
    pytest.param(
        "numba",
        marks=pytest.mark.skipif(importlib.util.find_spec("numba") is None, reason="no numba"),
    ),
    pytest.param(
        "interpret",
        marks=pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="no triton"),
    ),
]
OUT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def chunk_of(case: dict) -> torch.Tensor:
    dtype = getattr(torch, case["dtype"])
    raw = np.frombuffer(base64.b64decode(case["chunk"]), dtype=np.uint8).copy()
    shape = case["params"]["shape"]
    return torch.from_numpy(raw).view(dtype).reshape(shape)


def sha256(out: torch.Tensor) -> str:
    bits = out.view(torch.int16) if out.dtype == torch.bfloat16 else out
    return hashlib.sha256(bits.numpy().tobytes()).hexdigest()


def decodes_as_before(case: dict, backend: str) -> None:
    payload = base64.b64decode(case["payload"])
    params = case["params"]
    chunk = chunk_of(case)
    for name, dtype in OUT_DTYPES.items():
        out = torch.empty(params["shape"], dtype=dtype)
        decode_chunk(payload, params, out, backend=backend)
        assert sha256(out) == case["decoded_sha256"][name], f"{name} output differs"
        assert_within_bound(chunk, out, params)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=[case["name"] for case in CASES])
def test_version_2_objects_decode_as_before(case: dict, backend: str) -> None:
    assert case["params"]["version"] == 2
    decodes_as_before(case, backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", V3_CASES, ids=[case["name"] for case in V3_CASES])
def test_version_3_objects_decode_as_before(case: dict, backend: str) -> None:
    assert case["params"]["version"] == 3 and case["params"]["length_bytes"] == 1
    decodes_as_before(case, backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", V4_CASES, ids=[case["name"] for case in V4_CASES])
def test_version_4_objects_decode_as_before(case: dict, backend: str) -> None:
    assert case["params"]["version"] == 4
    decodes_as_before(case, backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", V4_CASES, ids=[case["name"] for case in V4_CASES])
def test_damaged_version_4_objects_are_rejected(case: dict, backend: str) -> None:
    """A version-4 object whose last lane's stream is damaged: one lane a stream, so
    the damage stays in that lane and the decoder rejects it."""
    payload = bytearray(base64.b64decode(case["payload"]))
    payload[-3] ^= 0x10  # a word of the last stream
    params = {**case["params"], "crc": params_checksum(case["params"], bytes(payload))}
    out = torch.full(params["shape"], 7.0)
    with pytest.raises(CodecError):
        decode_chunk(bytes(payload), params, out, backend=backend)
    assert bool((out == 7.0).all())


@pytest.mark.parametrize("backend", BACKENDS)
def test_damaged_version_2_objects_are_rejected(backend: str) -> None:
    case = CASES[0]
    payload = bytearray(base64.b64decode(case["payload"]))
    starts = np.cumsum([0, *case["params"]["sections"]])
    payload[starts[2]] ^= 0x01  # a stored count
    params = {**case["params"], "crc": params_checksum(case["params"], bytes(payload))}
    out = torch.full(params["shape"], 7.0)
    with pytest.raises(CodecError, match="histogram"):
        decode_chunk(bytes(payload), params, out, backend=backend)
    assert bool((out == 7.0).all())
