"""The CacheGen CPU reference codec: exact symbols, bounded KV error, ratio, rejection."""

from __future__ import annotations

import importlib.util

import cbor2
import numpy as np
import pytest
import torch
from support.samples import OUT_ROUNDING, assert_within_bound, synthetic_kv, tiny_model_kv

from kvtier_kernels.cachegen import (
    MODELS,
    CodecError,
    decode_chunk,
    default_levels,
    encode_chunk,
    params_checksum,
    quantize_counts,
)
from kvtier_kernels.cachegen.format import MODEL_FIELDS, pack, read_container
from kvtier_kernels.cachegen.rans import PROB_SCALE, rans_decode, rans_encode


def roundtrip(chunk, out_dtype=torch.float32, **options):
    payload, params = encode_chunk(chunk, **options)
    out = torch.empty(chunk.shape, dtype=out_dtype)
    decode_chunk(payload, params, out)
    return payload, params, out


# --- rANS symbols -------------------------------------------------------------------


def random_freq(counts: np.ndarray) -> np.ndarray:
    freq = quantize_counts(counts)
    assert (freq.sum(1) == PROB_SCALE).all() and ((freq > 0) == (counts > 0)).all()
    return freq


@pytest.mark.parametrize("alphabet", [1, 2, 33, 255])
@pytest.mark.parametrize("skew", ["uniform", "geometric", "one_hot"])
@pytest.mark.parametrize("n", [0, 1, 7, 300])
def test_rans_symbols_roundtrip_exactly(alphabet, skew, n):
    rng = np.random.default_rng(alphabet * 1000 + n)
    lanes = 64
    if skew == "uniform":
        symbols = rng.integers(0, alphabet, size=(lanes, n))
    elif skew == "geometric":
        symbols = np.minimum(rng.geometric(0.6, size=(lanes, n)) - 1, alphabet - 1)
    else:
        symbols = np.broadcast_to(rng.integers(0, alphabet, size=(lanes, 1)), (lanes, n))
    symbols = np.ascontiguousarray(symbols, dtype=np.uint8)
    counts = np.stack([np.bincount(row, minlength=alphabet) for row in symbols]) + (n == 0)
    words, lengths = rans_encode(symbols, random_freq(counts))
    assert len(words) == lengths.sum() and (lengths >= 2).all() and (lengths <= n + 2).all()
    if skew == "one_hot":  # a single-symbol stream costs only its state
        assert (lengths == 2).all()
    np.testing.assert_array_equal(rans_decode(words, lengths, random_freq(counts), n), symbols)


def test_rans_rare_symbols_of_a_skewed_stream():
    """One symbol in 10^4 still decodes exactly (frequency 1 of 2^16 at least)."""
    symbols = np.zeros((3, 20000), dtype=np.uint8)
    symbols[:, 1234] = 200
    symbols[1, 9999] = 254
    counts = np.stack([np.bincount(row, minlength=255) for row in symbols])
    words, lengths = rans_encode(symbols, quantize_counts(counts))
    np.testing.assert_array_equal(
        rans_decode(words, lengths, quantize_counts(counts), 20000), symbols
    )


def test_rans_rejects_streams_it_did_not_make():
    rng = np.random.default_rng(1)
    symbols = rng.integers(0, 9, size=(16, 100)).astype(np.uint8)
    freq = quantize_counts(np.stack([np.bincount(r, minlength=9) for r in symbols]))
    words, lengths = rans_encode(symbols, freq)
    with pytest.raises(CodecError):
        rans_decode(words[:-1], lengths, freq, 100)
    shifted = lengths.copy()
    shifted[0] += 1
    shifted[1] -= 1
    with pytest.raises(CodecError):
        rans_decode(words, shifted, freq, 100)
    with pytest.raises(CodecError):
        rans_decode(words, lengths, freq, 99)


# --- chunk codec ----------------------------------------------------------------------


def test_default_schedule_from_layer_count_alone():
    k, v = default_levels(32)
    assert k[:10] == [16] * 10 and k[10:] == [8] * 22
    assert v[:5] == [16] * 5 and v[5:] == [8] * 27
    assert default_levels(1) == ([16], [16])


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("levels", [{}, {"k_levels": [32, 16, 8, 1, 127, 2], "v_levels": [4] * 6}])
def test_kv_error_within_bound_per_layer(out_dtype, levels):
    chunk = synthetic_kv(layers=6, tokens=100, hidden=80)
    _, params, out = roundtrip(chunk, out_dtype, **levels)
    assert_within_bound(chunk, out, params)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_input_dtypes_and_odd_shapes(dtype):
    chunk = synthetic_kv(layers=3, tokens=17, hidden=576, seed=2).to(dtype)
    chunk[1, 2, 5] = 0  # an all-zero token (scale 0)
    _, params, out = roundtrip(chunk)
    assert_within_bound(chunk, out, params)
    assert (out[1, 2, 5] == 0).all()
    single = synthetic_kv(layers=1, tokens=1, hidden=1).to(dtype)
    assert_within_bound(single, roundtrip(single)[2], roundtrip(single)[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_subnormal_values_within_the_bound_and_its_absolute_terms(dtype, out_dtype):
    """Tokens at the bottom of a dtype's range: float32 steps below its normal range cost
    at most 2^-143, and rounding to a dtype whose subnormals hold x^ at most u times its
    smallest normal m, on top of the relative bound (docs/compression.md)."""
    gen = torch.Generator().manual_seed(5)
    tiny = float(torch.finfo(dtype).smallest_normal)
    magnitudes = torch.tensor([4 * tiny, tiny / 8, 1e-40, 1e-44, 1e-6]).to(dtype).float()
    chunk = (torch.randn(2, 1, 5, 64, generator=gen) * magnitudes[:, None]).to(dtype)
    out = roundtrip(chunk, out_dtype, k_levels=[127], v_levels=[8])[2]
    x = chunk.float()
    scale = x.abs().amax(-1, keepdim=True)
    levels = torch.tensor([127.0, 8.0])[:, None, None, None]
    u, m = OUT_ROUNDING[out_dtype], float(torch.finfo(out_dtype).smallest_normal)
    bound = scale * (1 / (2 * levels) + 2.0**-20 + u) + 2.0**-143 + u * m
    assert bool(((out.float() - x).abs() <= bound).all())


@pytest.mark.parametrize("backend", ["torch", "numba"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_values_at_the_top_of_a_dtypes_range_decode_finite(backend, dtype):
    """Tokens whose absmax is their dtype's largest finite value: ``n * (scale / n)`` may
    round above it (float32's at n = 25, 31, 127 among others), and the decoder gives
    that largest value, never inf."""
    if backend == "numba" and importlib.util.find_spec("numba") is None:
        pytest.skip("numba is not installed")
    levels = [1, 8, 25, 31, 127]
    top = float(torch.finfo(dtype).max)
    chunk = torch.zeros(2, len(levels), 2, 4)
    chunk[..., 0], chunk[..., 1], chunk[..., 2] = top, -top, 0.7 * top
    chunk = chunk.to(dtype)
    payload, params = encode_chunk(chunk, levels, levels, backend=backend)
    out = torch.empty_like(chunk)
    decode_chunk(payload, params, out, backend=backend)
    assert bool(torch.isfinite(out).all())
    assert_within_bound(chunk, out, params)


@pytest.mark.parametrize(("tokens", "count_bytes"), [(255, 1), (256, 1), (257, 2)])
def test_counts_table_layout(tokens, count_bytes):
    """The histogram model's tables: a lane with one symbol stores no counts (its count is
    T), the others store lo..hi, one byte per count up to 256 tokens, two bytes above."""
    chunk = synthetic_kv(layers=1, tokens=tokens, hidden=8, seed=tokens).float()
    chunk[:, :, :, 3] = 0.0  # channel 3 of K and V: symbol n only
    payload, params, out = roundtrip(chunk, model="histogram")
    assert params["model"] == "histogram"
    assert_within_bound(chunk, out, params)
    offset = params["sections"][0]
    bounds = np.frombuffer(payload, np.uint8, count=2 * 2 * 8, offset=offset).reshape(-1, 2)
    assert bounds[3].tolist() == bounds[11].tolist() == [16, 16]  # (lo, hi) = (n, n)
    widths = np.where(bounds[:, 0] == bounds[:, 1], 0, bounds[:, 1] - bounds[:, 0] + 1)
    stored = int(widths.sum()) * count_bytes
    assert params["sections"][2] == stored + (-stored % 4)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
@pytest.mark.parametrize("model", list(MODELS))
def test_triton_coder_makes_and_reads_the_reference_bytes(model):
    """The rANS coder as the Triton kernel (interpreted here; compiled on a GPU) gives
    the reference's payload, and decodes it to the same KV."""
    chunk = synthetic_kv(layers=2, tokens=9, hidden=6, seed=3)
    payload, params = encode_chunk(chunk, backend="interpret", model=model)
    assert (payload, params) == encode_chunk(chunk, backend="torch", model=model)
    by_kernel, by_reference = torch.empty(chunk.shape), torch.empty(chunk.shape)
    decode_chunk(payload, params, by_kernel, backend="interpret")
    decode_chunk(payload, params, by_reference)
    assert torch.equal(by_kernel, by_reference)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")
@pytest.mark.parametrize("model", [None, *MODELS])
@pytest.mark.parametrize("tokens", [1, 100, 256, 300])
def test_gpu_codec_makes_and_reads_the_reference_bytes(tokens, model):
    chunk = synthetic_kv(layers=3, tokens=tokens, hidden=192, seed=tokens)
    payload, params = encode_chunk(chunk.cuda(), backend="triton", model=model)
    assert (payload, params) == encode_chunk(chunk, backend="torch", model=model)
    on_gpu = torch.empty(chunk.shape, dtype=torch.bfloat16, device="cuda")
    decode_chunk(payload, params, on_gpu, backend="triton")
    on_cpu = torch.empty(chunk.shape, dtype=torch.bfloat16)
    decode_chunk(payload, params, on_cpu)
    assert torch.equal(on_gpu.cpu(), on_cpu)


def test_realistic_data_ratio_and_error():
    """Measured on this data at the default schedule: 7.5x (synthetic, outliers, 256
    tokens) and 4.0x (tiny model, 128 tokens) smaller than bf16, both with the Gaussian
    model; with per-lane histograms 7.1x and 3.2x (version 2: 6.9x and 3.1x). Real Llama
    KV: tests/test_cachegen_quality.py."""
    synthetic = synthetic_kv()
    payload, params, out = roundtrip(synthetic)
    assert_within_bound(synthetic, out, params)
    assert synthetic.numel() * 2 / len(payload) >= 7.2
    model = tiny_model_kv()
    payload, params, out = roundtrip(model)
    assert_within_bound(model, out, params)
    assert model.numel() * 2 / len(payload) >= 3.7


def test_encoding_is_deterministic_and_params_cbor_encodable():
    chunk = synthetic_kv(layers=2, tokens=64, hidden=128)
    first, params = encode_chunk(chunk)
    second, params2 = encode_chunk(chunk.clone())
    assert first == second and params == params2
    assert cbor2.loads(cbor2.dumps(params)) == params


def test_encoder_rejects_bad_input():
    chunk = synthetic_kv(layers=2, tokens=8, hidden=16)
    with pytest.raises(ValueError, match="KV_2LTD"):
        encode_chunk(chunk[0])
    with pytest.raises(ValueError, match="k_levels"):
        encode_chunk(chunk, k_levels=[8])
    with pytest.raises(ValueError, match=r"1\.\.127"):
        encode_chunk(chunk, v_levels=[8, 128])
    bad = chunk.clone()
    bad[0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        encode_chunk(bad)
    with pytest.raises(ValueError, match="dtype"):
        encode_chunk(chunk.to(torch.int32))


def seal(params, payload):
    """``params`` with a matching CRC, so that damage reaches the structural checks."""
    return {**params, "crc": params_checksum(params, payload)}


@pytest.fixture(scope="module", params=list(MODELS))
def encoded(request):
    chunk = synthetic_kv(layers=2, tokens=40, hidden=64, seed=3)
    payload, params = encode_chunk(chunk, model=request.param)
    assert params["model"] == request.param
    return chunk, payload, params


def section_start(params, name):
    names = MODELS[params["model"]]
    return sum(params["sections"][: names.index(name)])


def decode_fails(payload, params, shape=(2, 2, 40, 64), match=None):
    out = torch.full(shape, 7.0)
    with pytest.raises(CodecError, match=match):
        decode_chunk(payload, params, out)
    assert (out == 7.0).all(), "out was written before the object was rejected"


def test_decoder_rejects_damage_caught_by_crc(encoded):
    _, payload, params = encoded
    decode_fails(payload[:-4], params)  # truncated
    decode_fails(payload + b"\0\0\0\0", params)
    flipped = bytearray(payload)
    flipped[len(payload) // 2] ^= 0x10
    decode_fails(bytes(flipped), params, match="CRC")
    decode_fails(payload, {**params, "k_levels": [17, 8]}, match="CRC")
    decode_fails(payload, {**params, "crc": params["crc"] ^ 1}, match="CRC")


@pytest.mark.parametrize(
    "change, match",
    [
        ({"version": 1}, "version"),
        ({"version": 6}, "version"),
        ({"version": "3"}, "version"),
        ({"shape": [2, 2, 40]}, "four ints"),
        ({"shape": [2, 2, 41, 64]}, "out has shape"),
        ({"k_levels": [16]}, "k_levels"),
        ({"v_levels": [16, 0]}, "1..127"),
        ({"v_levels": [16, 2]}, "alphabet|histogram|inconsistent|disagree|Gaussian"),
        ({"sections": [1, 2, 3]}, "sections"),
        ({"prob_bits": 15}, "prob_bits"),
        ({"model": "laplace"}, "model"),
        ({"model": ["gaussian"]}, "model"),
        ({"scale_dtype": "float64"}, "scale_dtype"),
        ({"length_bytes": 1}, "keys"),
        ({"crc": None, "extra": 1}, "keys"),
    ],
)
def test_decoder_rejects_inconsistent_params(encoded, change, match):
    _, payload, params = encoded
    decode_fails(payload, seal({**params, **change}, payload), match=match)


def test_decoder_rejects_the_other_models_sections(encoded):
    _, payload, params = encoded
    other = next(model for model in MODELS if model != params["model"])
    decode_fails(payload, seal({**params, "model": other}, payload), match="section")


def test_older_versions_params_do_not_read_a_version_5_payload(encoded):
    _, payload, params = encoded
    params = {**params, "prob_bits": 16}  # what versions 2 to 4 add
    decode_fails(payload, seal({**params, "version": 4}, payload))
    version_2 = {k: v for k, v in params.items() if k not in MODEL_FIELDS}
    decode_fails(payload, seal({**version_2, "version": 2}, payload), match="section")
    decode_fails(payload, seal({**params, "version": 2}, payload), match="keys")
    decode_fails(payload, seal({**params, "version": 3}, payload), match="keys")
    version_3 = {**params, "version": 3, "length_bytes": 1}
    decode_fails(payload, seal(version_3, payload), match="section")


def test_decoder_rejects_inconsistent_sections(encoded):
    _, payload, params = encoded
    sizes = params["sections"]
    shifted = [sizes[0] + 4, sizes[1] - 4, *sizes[2:]]
    decode_fails(payload, seal({**params, "sections": shifted}, payload), match="section")
    # swap two lanes' lengths: the streams no longer parse
    start = section_start(params, "lengths")
    lengths, _ = read_container(params, payload, params["shape"]).streams()
    i = int(np.flatnonzero(lengths != lengths[0])[0]) if (lengths != lengths[0]).any() else 1
    lengths[[0, i]] = lengths[[i, 0]]
    lengths[0] += 1
    lengths[i] -= 1
    section = pack(lengths)
    size = params["sections"][MODELS[params["model"]].index("lengths")]
    assert len(section) == size
    damaged = payload[:start] + section + payload[start + size :]
    decode_fails(damaged, seal(params, damaged))
    # a packed section whose width does not fit its size
    damaged = bytes([payload[start] + 1]) + payload[start + 1 :]
    damaged = payload[:start] + damaged
    decode_fails(damaged, seal(params, damaged), match="packed")
    # random garbage of the right size never crashes and never writes out
    rng = np.random.default_rng(0)
    for _ in range(5):
        garbage = rng.integers(0, 256, len(payload), dtype=np.uint8).tobytes()
        decode_fails(garbage, seal(params, garbage))
    # a negative scale (bfloat16: the sign is the pattern's top bit) and an infinite one,
    # as the packed scales' base (bytes 1-4, after the width)
    assert params["scale_dtype"] == "bfloat16"
    for pattern in (0x8080, 0x7F80):
        damaged = payload[:1] + pattern.to_bytes(4, "little") + payload[5:]
        decode_fails(damaged, seal(params, damaged), match="scales")


def test_decoder_rejects_wrong_out(encoded):
    _, payload, params = encoded
    with pytest.raises(CodecError, match="out"):
        decode_chunk(payload, params, torch.empty(2, 2, 40, 64, dtype=torch.int32))
    with pytest.raises(CodecError, match="out has shape"):
        decode_chunk(payload, params, torch.empty(2, 2, 64, 40))
    with pytest.raises(CodecError, match="map"):
        decode_chunk(payload, [params], torch.empty(2, 2, 40, 64))
