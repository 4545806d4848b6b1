"""rANS encode / decode kernels against the numpy reference codec, bit for bit.

On a machine without a GPU the kernels run in Triton's interpreter (backend
``"interpret"``, CPU tensors), so every shape here is tiny: a few lanes of a few symbols.
Every comparison is against the numpy references
:func:`kvtier_kernels.cachegen.rans.encode.rans_encode` /
:func:`kvtier_kernels.cachegen.rans.decode.rans_decode`; rejected streams must be rejected
exactly where the reference rejects them. ``gpu`` tests run the compiled kernels.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from collections.abc import Callable

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support.gpu_compile import TARGETS as GPU_TARGETS
from support.gpu_compile import binary, compile_for, spill_count
from support.rans_cases import (
    DAMAGES,
    DISTRIBUTIONS,
    as_tensors,
    assert_same_outcome,
    assert_stream_equal,
    make_lanes,
    outcome,
)

from kvtier_kernels import registry
from kvtier_kernels.cachegen.rans import PROB_SCALE, CodecError
from kvtier_kernels.cachegen.rans import kernels as rans_kernels
from kvtier_kernels.cachegen.rans.common import LaunchConfig, launch_config
from kvtier_kernels.cachegen.rans.decode import (
    rans_decode,
    rans_decode_lanes,
    rans_decode_reference,
    rans_decode_triton,
)
from kvtier_kernels.cachegen.rans.encode import (
    rans_encode,
    rans_encode_lanes,
    rans_encode_reference,
    rans_encode_triton,
)
from kvtier_kernels.cachegen.rans.encode import rans_encode_numba as numba_encode

has_triton = importlib.util.find_spec("triton") is not None
has_gpu = torch.cuda.is_available()
has_numba = registry.pick("rans_encode", "auto", "cpu") == "numba"
needs_triton = pytest.mark.skipif(not has_triton, reason="needs triton (interpreter or GPU)")

BACKENDS = [pytest.param("interpret", marks=needs_triton), "torch"]


# ---------------------------------------------------------------------------------------
# round trips: bit-exact words and lengths, then the symbols back
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("distribution", DISTRIBUTIONS)
@pytest.mark.parametrize("alphabet", [1, 2, 17, 255])
def test_roundtrip_matches_reference(backend: str, alphabet: int, distribution: str) -> None:
    symbols, freq = make_lanes(5, 23, alphabet, distribution, seed=alphabet)
    ref_words, ref_lengths = rans_encode(symbols, freq)
    sym_t, freq_t = as_tensors(symbols, freq)
    words, lengths = rans_encode_lanes(sym_t, freq_t, backend=backend)
    assert_stream_equal(words, lengths, ref_words, ref_lengths)
    decoded = rans_decode_lanes(words, lengths, freq_t, 23, backend=backend)
    assert decoded.dtype == torch.uint8
    np.testing.assert_array_equal(decoded.numpy(), symbols)


@pytest.mark.parametrize(
    "backend",
    [*BACKENDS, pytest.param("numba", marks=pytest.mark.skipif(not has_numba, reason="no numba"))],
)
@pytest.mark.parametrize(("streams", "per_stream", "n"), [(3, 4, 5), (2, 8, 1), (1, 2, 0)])
def test_several_lanes_per_stream_match_the_reference(
    backend: str, streams: int, per_stream: int, n: int
) -> None:
    """``tables_per_stream``: each stream codes ``per_stream`` lanes of ``n`` symbols in
    turn, each with its own table; a damaged stream is rejected as the reference rejects it."""
    symbols, freq = make_lanes(streams * per_stream, n, 17, "dense", seed=n)
    symbols = symbols.reshape(streams, per_stream * n)
    ref_words, ref_lengths = rans_encode(symbols, freq, per_stream)
    np.testing.assert_array_equal(
        rans_decode(ref_words, ref_lengths, freq, per_stream * n, per_stream), symbols
    )
    sym_t, freq_t = as_tensors(symbols, freq)
    words, lengths = rans_encode_lanes(sym_t, freq_t, backend, tables_per_stream=per_stream)
    assert_stream_equal(words, lengths, ref_words, ref_lengths)
    decoded = rans_decode_lanes(
        words, lengths, freq_t, per_stream * n, backend, tables_per_stream=per_stream
    )
    np.testing.assert_array_equal(decoded.numpy(), symbols)
    damaged = ref_words.copy()
    damaged[len(damaged) // 2] ^= 0x0100
    expected = outcome(lambda: rans_decode(damaged, ref_lengths, freq, per_stream * n, per_stream))
    got = outcome(
        lambda: rans_decode_lanes(
            torch.from_numpy(damaged.astype(np.int32)),
            lengths,
            freq_t,
            per_stream * n,
            backend,
            tables_per_stream=per_stream,
        )
    )
    assert_same_outcome(expected, got)


def assert_round_trip_in_blocks(
    symbols: np.ndarray, freq: np.ndarray, *, block: int, freq_dtype: torch.dtype = torch.int64
) -> None:
    """The interpreted kernels with ``block`` lanes a program: the reference's words and
    lengths, then the symbols back."""
    ref_words, ref_lengths = rans_encode(symbols, freq)
    sym_t, freq_t = as_tensors(symbols, freq, freq_dtype)
    config = LaunchConfig(block_lanes=block, num_warps=1)
    words, lengths = rans_encode_triton(sym_t, freq_t, interpret=True, config=config)
    assert_stream_equal(words, lengths, ref_words, ref_lengths)
    n = symbols.shape[1]
    decoded = rans_decode_triton(words, lengths, freq_t, n, interpret=True, config=config)
    np.testing.assert_array_equal(decoded.numpy(), symbols)


@needs_triton
@pytest.mark.parametrize("freq_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize(("lanes", "n"), [(1, 1), (3, 1), (5, 7), (7, 2), (9, 0), (4, 40)])
def test_lanes_not_a_multiple_of_block(lanes: int, n: int, freq_dtype: torch.dtype) -> None:
    """BLOCK = 4 lanes: the last program's spare lanes must neither write nor count."""
    symbols, freq = make_lanes(lanes, n, 17, "skewed", seed=lanes * 100 + n)
    assert_round_trip_in_blocks(symbols, freq, block=4, freq_dtype=freq_dtype)


@needs_triton
@pytest.mark.parametrize(
    ("lanes", "n", "block"),
    [(37, 9, 4), (37, 4, 1), (1200, 3, 128)],
    ids=["10 programs", "37 programs", "1200 lanes"],
)
def test_lanes_start_where_the_lanes_before_them_end(lanes: int, n: int, block: int) -> None:
    """Each program finds where its lanes' streams start from the programs before it: the
    compaction sums their words (8 * BLOCK programs at a time), the decoder their lanes'
    lengths (1024 at a time); lanes of many lengths give the reference's bytes back."""
    symbols, freq = make_lanes(lanes, n, 17, "dense", seed=lanes)
    assert len(set(rans_encode(symbols, freq)[1].tolist())) > 1
    assert_round_trip_in_blocks(symbols, freq, block=block)


@needs_triton
def test_strided_lengths() -> None:
    """Lengths with a stride (every other entry of a buffer), int64 and int32, are read
    through it."""
    symbols, freq = make_lanes(5, 9, 7, "skewed", seed=3)
    words, lengths = rans_encode(symbols, freq)
    words_t, freq_t = torch.from_numpy(words.astype(np.int32)), torch.from_numpy(freq)
    for dtype in (torch.int64, torch.int32):
        spaced = torch.zeros(2 * len(lengths), dtype=dtype)
        spaced[::2] = torch.from_numpy(lengths)
        decoded = rans_decode_lanes(words_t, spaced[::2], freq_t.long(), 9, "interpret")
        np.testing.assert_array_equal(decoded.numpy(), symbols)


@needs_triton
def test_strided_inputs() -> None:
    """Non-contiguous symbols, freq and words are read through their strides."""
    symbols, freq = make_lanes(6, 11, 9, "uniform", seed=7)
    ref_words, ref_lengths = rans_encode(symbols, freq)
    sym_t = torch.from_numpy(np.ascontiguousarray(symbols.T)).t()  # stride (1, lanes)
    freq_t = torch.zeros((6, 2 * 9), dtype=torch.int64)[:, ::2]
    freq_t.copy_(torch.from_numpy(freq.astype(np.int64)))
    words, lengths = rans_encode_lanes(sym_t, freq_t, backend="interpret")
    assert_stream_equal(words, lengths, ref_words, ref_lengths)
    spaced = torch.zeros(2 * len(words), dtype=torch.int64)
    spaced[::2] = words
    decoded = rans_decode_lanes(spaced[::2], lengths, freq_t, 11, backend="interpret")
    np.testing.assert_array_equal(decoded.numpy(), symbols)


@needs_triton
@settings(max_examples=25, deadline=None)
@given(
    lanes=st.integers(1, 6),
    n=st.integers(0, 12),
    alphabet=st.integers(1, 255),
    distribution=st.sampled_from(DISTRIBUTIONS),
    block=st.sampled_from([1, 2, 8]),
    seed=st.integers(0, 2**32 - 1),
)
def test_property_roundtrip(
    lanes: int, n: int, alphabet: int, distribution: str, block: int, seed: int
) -> None:
    symbols, freq = make_lanes(lanes, n, alphabet, distribution, seed)
    assert_round_trip_in_blocks(symbols, freq, block=block)


# ---------------------------------------------------------------------------------------
# damaged streams: rejected exactly where the reference rejects them
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "backend",
    [
        *BACKENDS,
        pytest.param(
            "triton",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not has_gpu, reason="needs a CUDA/ROCm GPU"),
            ],
        ),
    ],
)
@pytest.mark.parametrize("damage", [d for _, d in DAMAGES], ids=[name for name, _ in DAMAGES])
def test_damaged_stream_rejected_like_reference(backend: str, damage: Callable) -> None:
    device = "cuda" if backend == "triton" else "cpu"
    symbols, freq = make_lanes(5, 40, 33, "skewed", seed=3)
    words, lengths = rans_encode(symbols, freq)
    words, lengths, freq, n = damage(words, lengths, freq, 40)
    expected = outcome(lambda: rans_decode(words, lengths, freq, n))
    got = outcome(
        lambda: rans_decode_lanes(
            torch.from_numpy(words.astype(np.int32)).to(device),
            torch.from_numpy(lengths.astype(np.int64)).to(device),
            torch.from_numpy(freq.astype(np.int32)).to(device),
            n,
            backend=backend,
        )
    )
    assert_same_outcome(expected, got)


@needs_triton
@settings(max_examples=30, deadline=None)
@given(
    distribution=st.sampled_from(DISTRIBUTIONS),
    seed=st.integers(0, 2**32 - 1),
    at=st.integers(0, 10**6),
    mask=st.integers(1, 0xFFFF),
    n_delta=st.sampled_from([0, 0, 0, -1, 1]),
)
def test_property_damaged_stream(
    distribution: str, seed: int, at: int, mask: int, n_delta: int
) -> None:
    """A random flip (and sometimes a wrong n): the same symbols or the same rejection."""
    symbols, freq = make_lanes(3, 9, 7, distribution, seed)
    words, lengths = rans_encode(symbols, freq)
    words[at % len(words)] ^= np.uint16(mask)
    n = 9 + n_delta
    expected = outcome(lambda: rans_decode(words, lengths, freq, n))
    got = outcome(
        lambda: rans_decode_triton(
            torch.from_numpy(words.astype(np.int32)),
            torch.from_numpy(lengths),
            torch.from_numpy(freq.astype(np.int64)),
            n,
            interpret=True,
            config=LaunchConfig(block_lanes=2, num_warps=1),
        )
    )
    assert_same_outcome(expected, got)


@pytest.mark.parametrize("backend", BACKENDS)
def test_lengths_not_one_per_lane(backend: str) -> None:
    symbols, freq = make_lanes(3, 5, 4, "uniform")
    words, lengths = rans_encode(symbols, freq)
    with pytest.raises(CodecError, match="2 state words"):
        rans_decode(words, lengths[:2], freq, 5)
    with pytest.raises(CodecError, match="2 state words: 2 lengths for 3 lanes"):
        rans_decode_lanes(
            torch.from_numpy(words.astype(np.int32)),
            torch.from_numpy(lengths[:2]),
            torch.from_numpy(freq.astype(np.int64)),
            5,
            backend=backend,
        )


@pytest.mark.parametrize("backend", BACKENDS)
def test_short_lane_and_length_errors_name_the_problem(backend: str) -> None:
    symbols, freq = make_lanes(4, 6, 3, "uniform")
    words, lengths = rans_encode(symbols, freq)
    words_t, freq_t = torch.from_numpy(words.astype(np.int32)), torch.from_numpy(freq)
    short = torch.from_numpy(lengths).clone()
    short[2] = 1
    with pytest.raises(CodecError, match="2 state words; lane 2 has 1"):
        rans_decode_lanes(words_t, short, freq_t.long(), 6, backend=backend)
    long = torch.from_numpy(lengths) + torch.tensor([0, 0, 0, 1])
    with pytest.raises(CodecError, match=f"sum to {len(words) + 1}, stream has {len(words)}"):
        rans_decode_lanes(words_t, long, freq_t.long(), 6, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_words(backend: str) -> None:
    freq = torch.full((2, 1), PROB_SCALE, dtype=torch.int64)
    empty = torch.zeros(0, dtype=torch.int32)
    with pytest.raises(CodecError, match="2 state words; lane 0 has 0"):
        rans_decode_lanes(empty, torch.zeros(2, dtype=torch.int64), freq, 3, backend=backend)
    with pytest.raises(CodecError, match="sum to 4, stream has 0"):
        rans_decode_lanes(empty, torch.full((2,), 2), freq, 3, backend=backend)


# ---------------------------------------------------------------------------------------
# invalid tables and arguments
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("symbol", "lanes_hit"), [(2, [2]), (3, [2, 3])])
def test_encode_rejects_symbols_without_frequency(
    backend: str, symbol: int, lanes_hit: list[int]
) -> None:
    """Symbol 2 has frequency 0 and symbol 3 is past the table: the first lane is named."""
    freq = torch.tensor([[PROB_SCALE // 2, PROB_SCALE // 2, 0]] * 4)
    symbols = torch.tensor([[0, 1, 1, 0]] * 4, dtype=torch.uint8)
    symbols[lanes_hit, 1] = symbol
    match = rf"lane 2 uses a symbol .* \({len(lanes_hit)} of 4 lanes\)"
    with pytest.raises(ValueError, match=match):
        rans_encode_lanes(symbols, freq, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("direction", ["encode", "decode"])
def test_rejects_tables_that_do_not_sum(backend: str, direction: str) -> None:
    symbols, freq = make_lanes(3, 4, 3, "dense")
    words, lengths = rans_encode(symbols, freq)
    sym_t, freq_t = as_tensors(symbols, freq)
    freq_t[1, 0] += 1
    with pytest.raises(
        ValueError,
        match=f"lane 1 must be non-negative and sum to PROB_SCALE={PROB_SCALE}; it sums to ",
    ):
        if direction == "encode":
            rans_encode_lanes(sym_t, freq_t, backend=backend)
        else:
            w, le = torch.from_numpy(words.astype(np.int32)), torch.from_numpy(lengths)
            rans_decode_lanes(w, le, freq_t, 4, backend=backend)


@pytest.mark.parametrize(
    ("symbols", "freq", "message"),
    [
        (torch.zeros(2, 3, dtype=torch.int32), torch.ones(2, 4), "symbols must be a 2-D uint8"),
        (torch.zeros(3, dtype=torch.uint8), torch.ones(2, 4), "symbols must be a 2-D uint8"),
        (torch.zeros(2, 3, dtype=torch.uint8), torch.ones(2, 4), "freq must be a 2-D int32"),
        (torch.zeros(2, 3, dtype=torch.uint8), torch.ones(3, 4, dtype=torch.int32), "lanes=2"),
        (torch.zeros(2, 3, dtype=torch.uint8), torch.ones(2, 256, dtype=torch.int64), "<= 255"),
        (torch.zeros(2, 3, dtype=torch.uint8), torch.ones(2, 0, dtype=torch.int64), "1 <= A"),
    ],
)
def test_encode_argument_errors(symbols: torch.Tensor, freq: torch.Tensor, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        rans_encode_lanes(symbols, freq, backend="torch")


def test_decode_argument_errors() -> None:
    freq = torch.full((2, 1), PROB_SCALE, dtype=torch.int64)
    words, lengths = torch.zeros(4, dtype=torch.int32), torch.full((2,), 2)
    with pytest.raises(ValueError, match="words must be a 1-D int32 or int64"):
        rans_decode_lanes(words.to(torch.int16), lengths, freq, 1)
    with pytest.raises(ValueError, match="lengths must be a 1-D"):
        rans_decode_lanes(words, lengths[None], freq, 1)
    with pytest.raises(ValueError, match="n must be an int >= 0"):
        rans_decode_lanes(words, lengths, freq, -1)
    with pytest.raises(TypeError, match=r"freq must be a torch\.Tensor"):
        rans_decode_lanes(words, lengths, freq.numpy(), 1)


@needs_triton
def test_interpret_refuses_device_tensors_it_cannot_reach() -> None:
    symbols = torch.zeros(1, 1, dtype=torch.uint8, device="meta")
    freq = torch.full((1, 1), PROB_SCALE, dtype=torch.int64, device="meta")
    with pytest.raises(ValueError, match="'interpret' runs on CPU tensors"):
        rans_encode_triton(symbols, freq, interpret=True)
    with pytest.raises(ValueError, match="'triton' needs CUDA/ROCm tensors"):
        rans_encode_triton(torch.zeros(1, 1, dtype=torch.uint8), torch.ones(1, 1), interpret=False)


# ---------------------------------------------------------------------------------------
# registry, launch parameters, import
# ---------------------------------------------------------------------------------------


def test_ops_are_registered() -> None:
    assert {"rans_encode", "rans_decode"} <= set(registry.ops())
    numba = registry.pick("rans_encode", "auto", "cpu") == "numba"  # where numba imports
    on_cpu = numba_encode if numba else rans_encode_reference
    assert registry.get("rans_encode", "auto", torch.device("cpu")) is on_cpu
    assert registry.get("rans_decode", "torch") is rans_decode_reference
    expected = ["torch", "triton", "interpret"] if has_triton else ["torch"]
    if not torch.cuda.is_available():
        expected = [b for b in expected if b != "triton"]  # compiled Triton needs a GPU
    assert registry.backends_for("rans_decode")[: len(expected)] == expected


def test_launch_config_heuristic() -> None:
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert launch_config(5, cpu) == LaunchConfig(8, 1)
    assert launch_config(1 << 20, cpu).block_lanes == 4096
    assert launch_config(1, gpu, warp_size=32) == LaunchConfig(32, 1)
    assert launch_config(64 * 1024, gpu, warp_size=32) == LaunchConfig(64, 2)
    assert launch_config(1 << 20, gpu, warp_size=32) == LaunchConfig(128, 4)
    assert launch_config(1, gpu, warp_size=64) == LaunchConfig(64, 1)  # a CDNA wavefront
    assert launch_config(1 << 20, gpu, warp_size=64) == LaunchConfig(128, 2)


@needs_triton
def test_invalid_launch_config() -> None:
    symbols, freq = as_tensors(*make_lanes(2, 2, 2, "uniform"))
    with pytest.raises(ValueError, match="block_lanes must be a power of two"):
        rans_encode_triton(symbols, freq, interpret=True, config=LaunchConfig(3, 1))


def test_import_does_not_import_triton() -> None:
    code = (
        "import sys, kvtier_kernels\n"
        "from kvtier_kernels import registry\n"
        "assert {'rans_encode', 'rans_decode'} <= set(registry.ops())\n"
        "registry.get('rans_encode', 'auto', None)\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('triton', 'kvtier'))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------------------------------
# compiled kernels: lowering for NVIDIA and AMD targets, no GPU needed
# ---------------------------------------------------------------------------------------

# (pointer arguments, int arguments, constexprs besides BLOCK)
_SIGNATURES = {
    "rans_encode": (
        {"symbols": "*u8", "freq": "*i32", "scratch": "*i32", "summary": "*i64"},
        [
            "s_sym_lane",
            "s_sym_pos",
            "s_freq_lane",
            "s_freq_sym",
            "num_lanes",
            "n",
            "alphabet",
            "tables_per_stream",
            "segment",
        ],
        {"PROB_BITS": 16, "RANS_LOW": 1 << 16},
    ),
    "rans_compact": (
        {"scratch": "*i32", "summary": "*i64", "words": "*i32"},
        ["width", "num_lanes"],
        {"WORDS": 16, "PROGRAMS": 512},
    ),
    "rans_decode": (
        {
            "words": "*i32",
            "lengths": "*i64",
            "freq": "*i64",
            "cum_hi": "*i32",
            "out": "*u8",
            "summary": "*i64",
        },
        [
            "s_word",
            "s_length",
            "s_freq_lane",
            "s_freq_sym",
            "s_out_lane",
            "s_out_pos",
            "num_lanes",
            "n",
            "alphabet",
            "num_words",
            "tables_per_stream",
            "segment",
        ],
        {"PROB_BITS": 16, "RANS_LOW": 1 << 16, "PREFIX": 1024},
    ),
}
_KERNELS = {
    "rans_encode": rans_kernels.ENCODE_KERNEL,
    "rans_compact": rans_kernels.COMPACT_KERNEL,
    "rans_decode": rans_kernels.DECODE_KERNEL,
}


@needs_triton
@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
@pytest.mark.parametrize(
    ("op", "meta"),
    [
        ("rans_encode", {}),
        ("rans_compact", {}),
        ("rans_decode", {"LOG2_SEARCH": 0}),
        ("rans_decode", {"LOG2_SEARCH": 8}),
    ],
    ids=["encode", "compact", "decode-A1", "decode-A255"],
)
@pytest.mark.parametrize("target", GPU_TARGETS)
def test_kernels_compile_for_gpu_targets(op: str, meta: dict[str, int], target: str) -> None:
    """The kernels lower to cubin / hsaco for NVIDIA and AMD targets (``make gpu-check``),
    with no inline asm and no register spills."""
    pointers, ints, constexprs = _SIGNATURES[op]
    constants = {**constexprs, "BLOCK": 64, **meta}
    signature = {
        **pointers,
        **dict.fromkeys(ints, "i32"),
        **dict.fromkeys(constants, "constexpr"),
    }
    compiled = compile_for(_KERNELS[op].get(interpret=False), signature, constants, target)
    assert binary(compiled, target)
    assert "inline_asm" not in compiled.asm["ttgir"]
    assert spill_count(compiled, target) in (0, None)


# ---------------------------------------------------------------------------------------
# GPU: the compiled kernels (skipped without a GPU)
# ---------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not has_gpu, reason="needs a CUDA/ROCm GPU")
@pytest.mark.parametrize("freq_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize(("lanes", "n", "alphabet"), [(1, 1, 1), (77, 5, 2), (4099, 256, 33)])
def test_gpu_roundtrip_matches_reference(
    lanes: int, n: int, alphabet: int, freq_dtype: torch.dtype
) -> None:
    symbols, freq = make_lanes(lanes, n, alphabet, "skewed", seed=lanes)
    ref_words, ref_lengths = rans_encode(symbols, freq)
    sym_t, freq_t = (t.cuda() for t in as_tensors(symbols, freq, freq_dtype))
    words, lengths = rans_encode_lanes(sym_t, freq_t, backend="triton")
    assert words.is_cuda and lengths.is_cuda
    assert_stream_equal(words, lengths, ref_words, ref_lengths)
    decoded = rans_decode_lanes(words, lengths, freq_t, n, backend="triton")
    np.testing.assert_array_equal(decoded.cpu().numpy(), symbols)
