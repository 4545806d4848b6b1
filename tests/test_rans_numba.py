"""The CacheGen codec's numba CPU kernels against the numpy / torch references, bit for bit.

The ``numba`` backend of ``rans_encode`` / ``rans_decode`` must write and read exactly the
reference's words and lengths and reject exactly the streams it rejects, with its errors;
the codec's numba quantization, tables and dequantization (used with it) must give the
payload and the KV the torch code gives. Without numba, ``auto`` runs the references:
the fallback tests here run everywhere.
"""

from __future__ import annotations

import importlib.util
import logging
import subprocess
import sys
from collections.abc import Callable

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support.rans_cases import (
    DAMAGES,
    DISTRIBUTIONS,
    as_tensors,
    assert_same_outcome,
    assert_stream_equal,
    make_lanes,
    outcome,
)
from support.samples import synthetic_kv

from kvtier_kernels import _launch, registry
from kvtier_kernels.cachegen import (
    MODELS,
    decode_chunk,
    encode_chunk,
    numba_kernels,
    params_checksum,
    quantize_counts,
)
from kvtier_kernels.cachegen.rans import (
    PROB_SCALE,
    CodecError,
    decode,
    encode,
    rans_decode,
    rans_decode_lanes,
    rans_encode,
    rans_encode_lanes,
)

has_numba = importlib.util.find_spec("numba") is not None
needs_numba = pytest.mark.skipif(not has_numba, reason="needs numba (kvtier[cpu-codec])")


@pytest.fixture(params=["one thread", "every thread"])
def threads(request, monkeypatch):
    """Kernels on one thread (small work) and on all of numba's (as for a large chunk)."""
    if request.param == "every thread":
        monkeypatch.setattr(_launch, "NUMBA_WORK_PER_THREAD", 1)
    return request.param


def roundtrip(symbols: np.ndarray, freq: np.ndarray, freq_dtype=torch.int64) -> None:
    """numba encode == the reference's bytes; numba decode gives the symbols back."""
    ref_words, ref_lengths = rans_encode(symbols, freq)
    sym_t, freq_t = as_tensors(symbols, freq, freq_dtype)
    words, lengths = rans_encode_lanes(sym_t, freq_t, backend="numba")
    assert_stream_equal(words, lengths, ref_words, ref_lengths)
    decoded = rans_decode_lanes(words, lengths, freq_t, symbols.shape[1], backend="numba")
    assert decoded.dtype == torch.uint8
    np.testing.assert_array_equal(decoded.numpy(), symbols)


# ---------------------------------------------------------------------------------------
# the coder: round trips
# ---------------------------------------------------------------------------------------


@needs_numba
@pytest.mark.parametrize("distribution", DISTRIBUTIONS)
@pytest.mark.parametrize("alphabet", [1, 2, 17, 255])
@pytest.mark.parametrize(("lanes", "n"), [(1, 1), (5, 23), (9, 256), (130, 7), (3, 0)])
def test_roundtrip_matches_reference(
    lanes: int, n: int, alphabet: int, distribution: str, threads: str
) -> None:
    """Lane counts around the encoder's groups (8) and the decoder's pairs and blocks (64)."""
    roundtrip(*make_lanes(lanes, n, alphabet, distribution, seed=lanes * 1000 + alphabet))


@needs_numba
@pytest.mark.parametrize("freq_dtype", [torch.int32, torch.int64], ids=str)
def test_edge_tables(freq_dtype: torch.dtype) -> None:
    """A one-symbol alphabet (frequency PROB_SCALE), a symbol of frequency PROB_SCALE - 1
    beside one of frequency 1 (used, so the state renormalizes at its limits), and lanes
    whose streams differ in length (a constant lane, a uniform one)."""
    one = np.full((2, 40), 0, dtype=np.uint8), np.full((2, 1), PROB_SCALE, dtype=np.uint32)
    roundtrip(*one, freq_dtype)
    roundtrip(np.zeros((0, 5), dtype=np.uint8), np.zeros((0, 3), dtype=np.uint32), freq_dtype)
    symbols = np.zeros((3, 300), dtype=np.uint8)
    symbols[:, ::37] = 1
    freq = np.array([[PROB_SCALE - 1, 1]] * 3, dtype=np.uint32)
    roundtrip(symbols, freq, freq_dtype)
    mixed = np.stack([np.zeros(64), np.arange(64) % 17]).astype(np.uint8)
    freq = quantize_counts(np.stack([np.bincount(row, minlength=17) for row in mixed]))
    lengths = rans_encode(mixed, freq)[1]
    assert lengths[0] == 2 and lengths[1] > 2
    roundtrip(mixed, freq, freq_dtype)


@needs_numba
@settings(max_examples=60, deadline=None)
@given(
    lanes=st.integers(1, 70),
    n=st.integers(0, 40),
    alphabet=st.integers(1, 255),
    distribution=st.sampled_from(DISTRIBUTIONS),
    seed=st.integers(0, 2**32 - 1),
)
def test_property_roundtrip(lanes: int, n: int, alphabet: int, distribution: str, seed: int):
    roundtrip(*make_lanes(lanes, n, alphabet, distribution, seed))


# ---------------------------------------------------------------------------------------
# the coder: damaged streams and bad arguments, rejected as the reference rejects them
# ---------------------------------------------------------------------------------------


def _decode_both(words, lengths, freq, n) -> tuple[tuple, tuple]:
    expected = outcome(lambda: rans_decode(words, lengths, freq, n))
    got = outcome(
        lambda: rans_decode_lanes(
            torch.from_numpy(words.astype(np.int32)),
            torch.from_numpy(lengths.astype(np.int64)),
            torch.from_numpy(freq.astype(np.int64)),
            n,
            backend="numba",
        )
    )
    return expected, got


@needs_numba
@pytest.mark.parametrize("damage", [d for _, d in DAMAGES], ids=[name for name, _ in DAMAGES])
def test_damaged_stream_rejected_like_reference(damage: Callable, threads: str) -> None:
    symbols, freq = make_lanes(5, 40, 33, "skewed", seed=3)
    words, lengths = rans_encode(symbols, freq)
    assert_same_outcome(*_decode_both(*damage(words, lengths, freq, 40)))


@needs_numba
@settings(max_examples=150, deadline=None)
@given(
    distribution=st.sampled_from(DISTRIBUTIONS),
    lanes=st.integers(1, 9),
    seed=st.integers(0, 2**32 - 1),
    at=st.integers(0, 10**6),
    mask=st.integers(1, 0xFFFF),
    n_delta=st.sampled_from([0, 0, 0, -1, 1, 5]),
)
def test_property_damaged_stream(
    distribution: str, lanes: int, seed: int, at: int, mask: int, n_delta: int
) -> None:
    """A random flip (and sometimes a wrong n): the same symbols or the same rejection."""
    symbols, freq = make_lanes(lanes, 9, 7, distribution, seed)
    words, lengths = rans_encode(symbols, freq)
    words[at % len(words)] ^= np.uint16(mask)
    assert_same_outcome(*_decode_both(words, lengths, freq, max(0, 9 + n_delta)))


@needs_numba
def test_argument_and_table_errors_match_the_reference() -> None:
    freq = torch.tensor([[PROB_SCALE // 2, PROB_SCALE // 2, 0]] * 4)
    symbols = torch.tensor([[0, 1, 1, 0]] * 4, dtype=torch.uint8)
    symbols[[2, 3], 1] = 2  # frequency 0
    symbols[3, 2] = 7  # past the table
    errors = []
    for backend in ("torch", "numba"):
        with pytest.raises(ValueError) as error:
            rans_encode_lanes(symbols, freq, backend=backend)
        errors.append(str(error.value))
    assert errors[0] == errors[1] and "lane 2 uses a symbol" in errors[0]

    sym, table = make_lanes(3, 4, 3, "dense")
    words, lengths = rans_encode(sym, table)
    sym_t, freq_t = as_tensors(sym, table)
    freq_t[1, 0] += 1
    words_t, lengths_t = torch.from_numpy(words.astype(np.int32)), torch.from_numpy(lengths)
    calls = {
        "encode": lambda b: rans_encode_lanes(sym_t, freq_t, backend=b),
        "decode": lambda b: rans_decode_lanes(words_t, lengths_t, freq_t, 4, backend=b),
        "short": lambda b: rans_decode_lanes(
            words_t, torch.tensor([2, 1, len(words) - 3]), _uniform3(), 4, b
        ),
        "sum": lambda b: rans_decode_lanes(words_t, lengths_t + 1, _uniform3(), 4, b),
        "empty": lambda b: rans_decode_lanes(
            torch.zeros(0, dtype=torch.int32), torch.zeros(3, dtype=torch.int64), _uniform3(), 4, b
        ),
    }
    for name, call in calls.items():
        assert outcome(lambda call=call: call("numba")) == outcome(lambda call=call: call("torch"))
        assert outcome(lambda call=call: call("numba"))[0] != "ok", name


def _uniform3() -> torch.Tensor:
    return torch.tensor([[PROB_SCALE - 2, 1, 1]] * 3)


# ---------------------------------------------------------------------------------------
# the codec: numba (auto on a CPU) and the numpy / torch path give the same bytes
# ---------------------------------------------------------------------------------------

CHUNKS = [
    ((1, 1, 1), torch.float32),
    ((2, 9, 3), torch.bfloat16),
    ((3, 100, 192), torch.bfloat16),
    ((2, 255, 16), torch.float16),
    ((1, 257, 24), torch.float32),  # uint16 counts
    ((4, 64, 128), torch.bfloat16),  # a small model's chunk
]


@needs_numba
@pytest.mark.parametrize("model", [None, *MODELS])
@pytest.mark.parametrize(("shape", "dtype"), CHUNKS, ids=lambda v: str(v))
def test_codec_bytes_match_the_reference(shape, dtype, model, threads: str) -> None:
    layers, tokens, hidden = shape
    chunk = synthetic_kv(layers=layers, tokens=tokens, hidden=hidden, seed=tokens).to(dtype)
    chunk[1, 0, :, hidden // 2] = 0.0  # a channel with one symbol: stores no counts
    chunk[0, -1, tokens // 2] = 0.0  # a token of zeros: step 0
    reference = encode_chunk(chunk, backend="torch", model=model)
    assert model is None or reference[1]["model"] == model
    assert encode_chunk(chunk, backend="numba", model=model) == reference
    assert encode_chunk(chunk, model=model) == reference  # auto: numba here
    for out_dtype in (dtype, torch.float32):
        by_reference, by_numba = (torch.empty(chunk.shape, dtype=out_dtype) for _ in range(2))
        decode_chunk(*reference, by_reference, backend="torch")
        decode_chunk(*reference, by_numba, backend="numba")
        assert torch.equal(by_numba, by_reference), f"{out_dtype}: decoded KV differs"


# section -> (byte offset in it, from its end if negative; xor mask)
DAMAGES_BY_MODEL = {
    "histogram": {"bounds": (3, 0x01), "counts": (0, 0x02)},
    "gaussian": {"models": (0, 0x01), "models, spread": (3, 0x01)},
}


@needs_numba
@pytest.mark.parametrize("model", list(MODELS))
def test_codec_rejects_what_the_reference_rejects(model: str) -> None:
    chunk = synthetic_kv(layers=2, tokens=40, hidden=16, seed=5)
    payload, params = encode_chunk(chunk, backend="torch", model=model)
    names = MODELS[model]
    starts = dict(zip(names, np.cumsum([0, *params["sections"]]).tolist(), strict=False))
    ends = dict(zip(names, np.cumsum(params["sections"]).tolist(), strict=True))
    damages = {
        **DAMAGES_BY_MODEL[model],
        "lengths": (0, 0x01),
        "words": (5, 0x40),
        "words, late": (-6, 0x08),
    }
    for name, (at, mask) in damages.items():
        section = name.split(",")[0]
        data = bytearray(payload)
        data[(starts if at >= 0 else ends)[section] + at] ^= mask
        data = bytes(data)
        fixed = {**params}
        fixed["crc"] = params_checksum(fixed, data)  # past the CRC, into the tables
        errors = []
        for backend in ("torch", "numba"):
            out = torch.full(chunk.shape, 7.0)
            with pytest.raises(CodecError) as error:
                decode_chunk(data, fixed, out, backend=backend)
            errors.append(str(error.value))
            assert bool((out == 7.0).all()), f"{name}: out written before the checks"
        assert errors[0] == errors[1], name

    nonfinite = chunk.clone()
    nonfinite[1, 1, 3, 2] = float("nan")
    for backend in ("torch", "numba"):
        with pytest.raises(ValueError, match="non-finite"):
            encode_chunk(nonfinite, backend=backend, model=model)


def test_importing_kvtier_imports_no_numba() -> None:
    """numba loads on the first codec call that picks it, never with the packages."""
    code = (
        "import sys, kvtier, kvtier_kernels, kvtier.storage.serde\n"
        "from kvtier_kernels.cachegen import codec, numba_kernels, rans\n"
        "from kvtier.storage.serde import make_serde\n"
        "make_serde('cachegen')\n"
        "assert 'numba' not in sys.modules, 'numba imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_fallback_without_numba_writes_the_same_bytes(monkeypatch) -> None:
    """Where numba is missing or does not import, ``auto`` runs the numpy reference."""
    chunk = synthetic_kv(layers=2, tokens=33, hidden=8, seed=9)
    expected = encode_chunk(chunk, backend="torch")
    monkeypatch.setattr(registry, "_numba_error", "ImportError: no numba here")
    assert registry.pick("rans_encode", "auto", "cpu") == "torch"
    assert registry.pick("rans_decode", "auto", "cpu") == "torch"
    assert encode_chunk(chunk) == expected
    out, by_reference = torch.empty(chunk.shape), torch.empty(chunk.shape)
    decode_chunk(*expected, out)
    decode_chunk(*expected, by_reference, backend="torch")
    assert torch.equal(out, by_reference)


def test_where_numba_does_not_import_one_warning_names_the_ops(monkeypatch, caplog) -> None:
    monkeypatch.setattr(registry, "_numba_error", registry._NOT_TRIED)
    monkeypatch.setitem(sys.modules, "numba", None)  # import numba raises ImportError
    assert registry.pick("rans_encode", "auto", "cpu") == "torch"
    assert registry.pick("rans_decode", "auto", "cpu") == "torch"
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert f"numba {_launch.numba_version()} does not import (ModuleNotFoundError" in warning
    assert "rans_decode, rans_encode, rope_rerotate run their numpy/torch reference" in warning


# Where each kernel runs: the codec's steps and the coder's kernels, by direction.
FAILING_KERNELS = {
    "quantize": (lambda: numba_kernels.KERNELS["quantize"], "rans_encode"),
    "coder's encode": (lambda: encode.NUMBA_KERNEL, "rans_encode"),
    "unpack": (lambda: numba_kernels.KERNELS["unpack"], "rans_decode"),
    "coder's decode": (lambda: decode.NUMBA_KERNEL, "rans_decode"),
    "dequantize": (lambda: numba_kernels.KERNELS["dequantize"], "rans_decode"),
}


@needs_numba
@pytest.mark.parametrize(
    ("kernel", "model"),
    [
        (kernel, model)
        for kernel in FAILING_KERNELS
        for model in sorted(MODELS)
        if (kernel, model) != ("unpack", "gaussian")  # a Gaussian payload stores no counts
    ],
)
def test_a_kernel_that_fails_to_compile_gives_the_reference_bytes_and_one_warning(
    kernel, model, numba_compile_fails, caplog
) -> None:
    """A compile failure (numba 0.68's RecursionError on Python 3.12) is one warning
    naming the op and numba's version; every call, ``auto`` or ``numba``, then gives the
    reference's payload and KV, and ``auto`` picks torch for that op."""
    import numba

    chunk = synthetic_kv(layers=2, tokens=40, hidden=16, seed=11)
    expected = encode_chunk(chunk, backend="torch", model=model)
    reference = torch.empty(chunk.shape)
    decode_chunk(*expected, reference, backend="torch")
    get_kernel, op = FAILING_KERNELS[kernel]
    numba_compile_fails(get_kernel())
    caplog.set_level(logging.WARNING)
    for backend in ("auto", "numba", "auto"):
        assert encode_chunk(chunk, backend=backend, model=model) == expected, backend
        out = torch.full(chunk.shape, 7.0)
        decode_chunk(*expected, out, backend=backend)
        assert torch.equal(out, reference), backend
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert f"numba {numba.__version__} failed on {get_kernel().fn.__name__}" in warning
    assert f"RecursionError: maximum recursion depth exceeded): {op} runs its" in warning
    assert registry.pick(op, "auto", "cpu") == "torch"
    other = {"rans_encode": "rans_decode", "rans_decode": "rans_encode"}[op]
    assert registry.pick(other, "auto", "cpu") == "numba"
    assert f"failed here, so torch runs: {op}: numba" in registry.available_backends()["numba"]
