"""CacheGen's statistics models (``kvtier_kernels/cachegen/tables.py``): the Gaussian
model's integer tables, the encoder's choice between it and per-lane histograms, the
same bytes from every backend in either model, and objects whose stored model disagrees
with their symbols, rejected by every backend.
"""

from __future__ import annotations

import importlib.util
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support.samples import assert_within_bound, synthetic_kv

from kvtier_kernels.cachegen import MODELS, CodecError, decode_chunk, encode_chunk
from kvtier_kernels.cachegen import tables as cachegen_tables
from kvtier_kernels.cachegen.format import (
    MODEL_SPREAD_LEVELS,
    lanes_per_stream,
    make_params,
    model_lane_levels,
    pack,
    padded,
    params_checksum,
    read_container,
)
from kvtier_kernels.cachegen.rans import PROB_SCALE, rans_encode_lanes
from kvtier_kernels.cachegen.tables import (
    GAUSSIAN_MAX_TOKENS,
    MAX_DISTANCE,
    SPREADS,
    VARIANCE_BITS,
    cost_table,
    entropy_cost,
    gaussian_codebook,
    gaussian_freq,
    gaussian_models,
    gaussian_weights,
    quantize_counts,
    spread_sigma,
    spread_thresholds,
)

has_numba = importlib.util.find_spec("numba") is not None
has_triton = importlib.util.find_spec("triton") is not None
CPU_BACKENDS = ["torch", *(["numba"] if has_numba else [])]
DECODE_BACKENDS = [*CPU_BACKENDS, *(["interpret"] if has_triton else [])]


# ---------------------------------------------------------------------------------------
# the Gaussian model's constants
# ---------------------------------------------------------------------------------------


def test_decays_are_the_documented_gaussians():
    for k, q in enumerate(cachegen_tables._DECAY_Q32):
        expected = 2**32 * math.exp(-1 / (2 * spread_sigma(k) ** 2))
        assert abs(q - expected) <= 1, f"spread {k}: {q}, expected {expected:.1f}"


def test_weights_fall_with_distance_and_never_reach_zero():
    weights = gaussian_weights()
    assert weights.shape == (SPREADS, MAX_DISTANCE + 1)
    assert (weights >= 1).all() and (weights[:, 0] == 1 << 30).all()
    assert (np.diff(weights, axis=1) <= 0).all()
    assert (np.diff(weights[:, 1], axis=0) > 0).all(), "wider spreads weigh neighbours more"


def test_model_variances_follow_sigma_and_thresholds_separate_them():
    thresholds = spread_thresholds()
    assert len(thresholds) == SPREADS - 1 and (np.diff(thresholds) > 0).all()
    d = np.arange(-MAX_DISTANCE, MAX_DISTANCE + 1)
    for k in range(14, 45):  # a sampled Gaussian's variance is sigma^2 once sigma >~ 1,
        # plus the weight-1 floors' (~0.004)
        w = gaussian_weights()[k][np.abs(d)].astype(np.float64)
        variance = (w * d * d).sum() / w.sum()
        assert variance == pytest.approx(spread_sigma(k) ** 2, rel=5e-3), f"spread {k}"
        assert thresholds[k - 1] / 2**VARIANCE_BITS < variance < thresholds[k] / 2**VARIANCE_BITS


def test_cost_table_is_minus_log2_within_a_unit():
    cost = cost_table()
    f = np.arange(1, PROB_SCALE + 1)
    exact = -np.log2(f / PROB_SCALE) * 2**cachegen_tables.COST_BITS
    assert np.abs(cost[1:] - exact).max() < 1
    assert cost[PROB_SCALE] == 0 and cost[1] == 16 << cachegen_tables.COST_BITS


# ---------------------------------------------------------------------------------------
# a lane's model and table
# ---------------------------------------------------------------------------------------


def test_models_of_histograms():
    tokens = 64
    counts = torch.zeros((4, 17), dtype=torch.int64)
    counts[0, 8] = tokens  # one symbol: narrowest spread
    counts[1, [7, 8, 9]] = torch.tensor([16, 32, 16])  # variance 0.5
    counts[2, [0, 16]] = 32  # two extremes: variance 64, centre 8
    counts[3, 16] = tokens  # at the top of the alphabet
    models = gaussian_models(counts, tokens).tolist()
    assert models[0] == [8, 0] and models[3] == [16, 0]
    for lane, variance in ((1, 0.5), (2, 64.0)):
        centre, spread = models[lane]
        sigma = [spread_sigma(k) for k in range(SPREADS)]
        nearest = min(range(SPREADS), key=lambda k: abs(math.log(sigma[k] ** 2 / variance)))
        assert centre == 8 and abs(spread - nearest) <= 1, f"lane {lane}: {models[lane]}"


def test_mean_rounds_half_up():
    counts = torch.zeros((1, 9), dtype=torch.int64)
    counts[0, [3, 4]] = 1  # mean 3.5
    assert gaussian_models(counts, 2)[0, 0] == 4


@pytest.mark.parametrize("levels", [1, 8, 127])
def test_gaussian_tables_cover_exactly_the_lanes_alphabet(levels):
    alphabet = 2 * 127 + 1
    codebook = gaussian_codebook((levels, 127), alphabet)
    centres = torch.tensor([0, levels, 2 * levels, levels])
    spreads = torch.tensor([0, 20, SPREADS - 1, 40])
    models = torch.stack([centres, spreads], 1).to(torch.uint8)
    freq = gaussian_freq(models, torch.full((4,), levels), codebook)
    assert (freq.sum(1) == PROB_SCALE).all()
    assert (freq[:, : 2 * levels + 1] > 0).all() and (freq[:, 2 * levels + 1 :] == 0).all()
    as_numpy = codebook.freq(models.numpy(), np.full(4, levels))
    np.testing.assert_array_equal(as_numpy, freq.numpy())


def test_codebook_rows_are_the_quantized_weights():
    """The definition the codebook caches: quantize_counts of W[k][|s - c|] on [0, 2n]."""
    alphabet = 33
    codebook = gaussian_codebook((4, 16), alphabet)
    rng = np.random.default_rng(0)
    for n in (4, 16):
        models = zip(rng.integers(0, 2 * n + 1, 20), rng.integers(0, SPREADS, 20), strict=True)
        for centre, spread in models:
            symbol = np.arange(alphabet)
            distance = np.minimum(np.abs(symbol - centre), MAX_DISTANCE)
            weights = np.where(symbol <= 2 * n, gaussian_weights()[spread, distance], 0)
            expected = quantize_counts(weights[None, :])[0]
            got = codebook.freq(np.array([[centre, spread]], np.uint8), np.array([n]))[0]
            np.testing.assert_array_equal(got, expected, err_msg=f"n={n} ({centre}, {spread})")


def test_entropy_cost_is_the_empirical_entropy():
    rng = np.random.default_rng(1)
    counts = torch.from_numpy(rng.multinomial(100, np.ones(9) / 9, size=20))
    exact = sum(-c * math.log2(c / 100) for c in counts.flatten().tolist() if c)
    got = int(entropy_cost(counts, 100)) / 2**cachegen_tables.COST_BITS
    assert got == pytest.approx(exact, abs=counts.sum().item() * 2**-cachegen_tables.COST_BITS)


# ---------------------------------------------------------------------------------------
# the encoder's choice
# ---------------------------------------------------------------------------------------


def sizes(chunk: torch.Tensor) -> dict[str | None, tuple[int, str]]:
    encoded = {model: encode_chunk(chunk, model=model) for model in (None, *MODELS)}
    return {model: (len(payload), params["model"]) for model, (payload, params) in encoded.items()}


def test_short_chunks_choose_the_gaussian_model():
    by_model = sizes(synthetic_kv(layers=2, tokens=64, hidden=128, seed=1))
    assert by_model[None] == by_model["gaussian"]
    assert by_model["gaussian"][0] < 0.8 * by_model["histogram"][0]


def test_lanes_far_from_gaussian_choose_histograms():
    """Long lanes of two values far apart: their histograms cost little, a Gaussian of
    their variance wastes bits on every symbol between."""
    g = torch.Generator().manual_seed(0)
    x = torch.where(torch.rand(2, 1, 2048, 16, generator=g) < 0.5, -1.0, 1.0)
    by_model = sizes(x.to(torch.bfloat16))
    assert by_model[None] == by_model["histogram"]
    assert by_model["histogram"][0] < 0.8 * by_model["gaussian"][0]


def test_forced_model_arguments():
    chunk = synthetic_kv(layers=1, tokens=8, hidden=4)
    with pytest.raises(ValueError, match="model"):
        encode_chunk(chunk, model="laplace")
    long = torch.zeros(2, 1, GAUSSIAN_MAX_TOKENS + 1, 1)
    with pytest.raises(ValueError, match="at most"):
        encode_chunk(long, model="gaussian")
    assert encode_chunk(long)[1]["model"] == "histogram"


def test_lanes_of_more_than_255_words_round_trip():
    g = torch.Generator().manual_seed(0)
    chunk = torch.rand(2, 1, 600, 4, generator=g) * 2 - 1  # ~8 bits per 255-level symbol
    payload, params = encode_chunk(chunk, k_levels=[127], v_levels=[127])
    assert params["scale_dtype"] == "float32"
    lengths, _ = read_container(params, payload, params["shape"]).streams()
    assert lengths.max() > 255
    out = torch.empty(chunk.shape)
    decode_chunk(payload, params, out)
    assert_within_bound(chunk, out, params)


# ---------------------------------------------------------------------------------------
# every backend: the same bytes, and the same KV back
# ---------------------------------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(
    layers=st.integers(1, 3),
    tokens=st.integers(1, 70),
    hidden=st.integers(1, 9),
    levels=st.lists(st.integers(1, 127), min_size=6, max_size=6),
    model=st.sampled_from([None, *MODELS]),
    dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
    seed=st.integers(0, 2**16),
)
def test_property_backends_write_and_read_the_same_bytes(
    layers, tokens, hidden, levels, model, dtype, seed
):
    chunk = synthetic_kv(layers=layers, tokens=tokens, hidden=hidden, seed=seed).to(dtype)
    k_levels, v_levels = levels[:layers], levels[3 : 3 + layers]
    options = {"k_levels": k_levels, "v_levels": v_levels, "model": model}
    reference = encode_chunk(chunk, backend="torch", **options)
    for backend in CPU_BACKENDS[1:]:
        assert encode_chunk(chunk, backend=backend, **options) == reference, backend
    outs = {}
    for backend in CPU_BACKENDS:
        outs[backend] = torch.empty(chunk.shape, dtype=dtype)
        decode_chunk(*reference, outs[backend], backend=backend)
        assert torch.equal(outs[backend], outs["torch"]), backend
    assert_within_bound(chunk, outs["torch"], reference[1])


@pytest.mark.parametrize(
    ("layers", "tokens", "heads", "head_size"),
    [(1, 7, 3, 80), (5, 2, 1, 96), (1, 1, 3, 80), (1, 16, 3, 32), (2, 3, 1, 256)],
)
def test_model_widths_give_the_same_bytes_on_every_backend(layers, tokens, heads, head_size):
    """Widths of real models (head sizes 80, 96, 256; three KV heads): lane counts with an
    odd factor, so a stream holds fewer lanes than the power of two that would fit."""
    chunk = synthetic_kv(layers=layers, tokens=tokens, hidden=heads * head_size, seed=tokens)
    backends = [*CPU_BACKENDS, *(["interpret"] if has_triton and tokens == 1 else [])]
    reference = encode_chunk(chunk, backend="torch")
    outs = {}
    for backend in backends:
        assert encode_chunk(chunk, backend=backend) == reference, backend
        outs[backend] = torch.empty(chunk.shape, dtype=chunk.dtype)
        decode_chunk(*reference, outs[backend], backend=backend)
        assert torch.equal(outs[backend], outs["torch"]), backend
    assert_within_bound(chunk, outs["torch"], reference[1])


@pytest.mark.skipif(not has_triton, reason="needs triton")
@settings(max_examples=8, deadline=None)
@given(
    tokens=st.integers(1, 12),
    hidden=st.integers(1, 5),
    model=st.sampled_from(list(MODELS)),
    seed=st.integers(0, 2**16),
)
def test_property_triton_coder_writes_and_reads_the_reference_bytes(tokens, hidden, model, seed):
    chunk = synthetic_kv(layers=1, tokens=tokens, hidden=hidden, seed=seed)
    reference = encode_chunk(chunk, backend="torch", model=model)
    assert encode_chunk(chunk, backend="interpret", model=model) == reference
    by_kernel, by_reference = torch.empty(chunk.shape), torch.empty(chunk.shape)
    decode_chunk(*reference, by_kernel, backend="interpret")
    decode_chunk(*reference, by_reference, backend="torch")
    assert torch.equal(by_kernel, by_reference)


# ---------------------------------------------------------------------------------------
# a stored model that is not the symbols' own: the stream parses, the check rejects it
# ---------------------------------------------------------------------------------------

LEVELS = 8
TOKENS, HIDDEN = 48, 4
LANES = 2 * HIDDEN


def forged(model: str, model_lane_shift: int = 0) -> tuple[bytes, dict]:
    """A version-5 object for 1 layer whose lanes are coded with a table that is valid for
    their symbols but not theirs: lane 0's stored spread (gaussian) or histogram (two
    counts moved by one) differs from what its symbols give."""
    rng = np.random.default_rng(0)
    symbols = rng.integers(LEVELS - 3, LEVELS + 4, size=(LANES, TOKENS)).astype(np.uint8)
    symbols_t = torch.from_numpy(symbols)
    alphabet = 2 * LEVELS + 1
    counts = torch.stack([torch.bincount(row.long(), minlength=alphabet) for row in symbols_t])
    if model == "gaussian":
        models = gaussian_models(counts, TOKENS)
        if not model_lane_shift:  # else the lanes' models are their own, a model lane's not
            models[0, 1] += 1
        codebook = gaussian_codebook((LEVELS,), alphabet)
        freq = gaussian_freq(models, torch.full((LANES,), LEVELS), codebook)
        tables = [coded_models(models, model_lane_shift)]
    else:
        counts[0, LEVELS] += 1
        counts[0, LEVELS + 1] -= 1
        freq = quantize_counts(counts)
        lo, hi = LEVELS - 3, LEVELS + 3
        bounds = np.tile(np.array([lo, hi], dtype=np.uint8), (LANES, 1))
        stored = counts[:, lo : hi + 1].numpy().astype(np.uint8)
        tables = [padded(bounds.tobytes()), padded(stored.tobytes())]
    group = lanes_per_stream(LANES, TOKENS)
    streams = symbols_t.view(LANES // group, group * TOKENS)
    words, lengths = rans_encode_lanes(streams, freq, "torch", tables_per_stream=group)
    scales = pack(np.ones(2 * TOKENS, dtype="<f4").view("<u4"))
    sections = [scales, *tables, pack(lengths.numpy())]
    sections.append(padded(words.numpy().astype("<u2").tobytes()))
    shape = [2, 1, TOKENS, HIDDEN]
    return make_params(shape, [LEVELS], [LEVELS], model, "float32", sections)


def coded_models(models: torch.Tensor, spread_shift: int = 0) -> bytes:
    """The version-5 models section of ``models`` (1 layer, lanes of ``LEVELS`` levels):
    the model lanes' own Gaussian models, their streams' lengths, the streams' words;
    ``spread_shift`` is added to the first model lane's spread (a valid, foreign model)."""
    levels = model_lane_levels([LEVELS], [LEVELS])
    lanes = models.T.reshape(len(levels), HIDDEN)
    alphabet = 2 * MODEL_SPREAD_LEVELS + 1
    counts = torch.stack([torch.bincount(row.long(), minlength=alphabet) for row in lanes])
    meta = gaussian_models(counts, HIDDEN)
    meta[0, 1] += spread_shift
    codebook = gaussian_codebook((LEVELS, MODEL_SPREAD_LEVELS), alphabet)
    freq = gaussian_freq(meta, torch.from_numpy(levels), codebook)
    group = lanes_per_stream(len(lanes), HIDDEN)
    streams = lanes.reshape(len(lanes) // group, group * HIDDEN)
    words, lengths = rans_encode_lanes(streams, freq, "torch", tables_per_stream=group)
    words = padded(words.numpy().astype("<u2").tobytes())
    return padded(meta.numpy().tobytes()) + pack(lengths.numpy()) + words


@pytest.mark.parametrize("backend", DECODE_BACKENDS)
@pytest.mark.parametrize("model", list(MODELS))
def test_stored_model_must_be_the_symbols_own(model, backend):
    payload, params = forged(model)
    out = torch.full((2, 1, TOKENS, HIDDEN), 7.0)
    with pytest.raises(CodecError, match=f"disagree with the stored {model} model"):
        decode_chunk(payload, params, out, backend=backend)
    assert bool((out == 7.0).all()), "out written before the check"


@pytest.mark.parametrize("backend", DECODE_BACKENDS)
def test_stored_model_of_a_model_lane_must_be_its_own(backend):
    payload, params = forged("gaussian", model_lane_shift=1)
    out = torch.full((2, 1, TOKENS, HIDDEN), 7.0)
    with pytest.raises(CodecError, match="decoded models disagree with their stored"):
        decode_chunk(payload, params, out, backend=backend)
    assert bool((out == 7.0).all()), "out written before the check"


@pytest.mark.parametrize("backend", DECODE_BACKENDS)
@pytest.mark.parametrize(("byte", "value"), [(0, 2 * LEVELS + 1), (1, SPREADS), (1, 255)])
def test_models_outside_the_alphabet_or_the_spreads_are_rejected(byte, value, backend):
    payload, params = encode_chunk(
        synthetic_kv(layers=1, tokens=TOKENS, hidden=HIDDEN), [LEVELS], [LEVELS], model="gaussian"
    )
    damaged = bytearray(payload)
    damaged[params["sections"][0] + byte] = value  # the keys' centres' model: centre or spread
    damaged = bytes(damaged)
    params = {**params, "crc": params_checksum(params, damaged)}
    out = torch.full((2, 1, TOKENS, HIDDEN), 7.0)
    with pytest.raises(CodecError, match="Gaussian model is outside"):
        decode_chunk(damaged, params, out, backend=backend)
    assert bool((out == 7.0).all())


@settings(max_examples=30, deadline=None)
@given(lanes=st.integers(1, 6), tokens=st.integers(1, 300), levels=st.integers(1, 127))
def test_lane_models_are_the_gaussian_models_of_the_symbols(lanes, tokens, levels):
    rng = np.random.default_rng(lanes * tokens + levels)
    symbols = rng.integers(0, 2 * levels + 1, size=(lanes, tokens)).astype(np.uint8)
    alphabet = 2 * levels + 1
    counts = torch.stack(
        [torch.bincount(row.long(), minlength=alphabet) for row in torch.from_numpy(symbols)]
    )
    expected = gaussian_models(counts, tokens).numpy()
    np.testing.assert_array_equal(cachegen_tables.lane_models(symbols), expected)
