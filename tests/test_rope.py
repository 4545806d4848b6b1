"""RoPE re-rotation of cached K: the reference against an independent RoPE, and the Triton
kernel (under the interpreter on CPU, compiled on a GPU) against the reference.

The interpreter costs about a millisecond per program instance, so the shapes here are
tiny: one or two layers and heads, a few tokens. ``gpu`` tests run the compiled kernel.
"""

from __future__ import annotations

import importlib.util
import logging

import pytest
import torch

from kvtier_kernels import registry
from kvtier_kernels.dtypes import bits
from kvtier_kernels.rope import numba_kernels as rope_numba
from kvtier_kernels.rope import rerotation
from kvtier_kernels.rope.rerotation import (
    LaunchConfig,
    rerotate,
    rerotate_reference,
    rerotate_triton,
    rope_inv_freq,
)

has_triton = importlib.util.find_spec("triton") is not None
has_gpu = torch.cuda.is_available()
needs_triton = pytest.mark.skipif(not has_triton, reason="needs triton (interpreter or GPU)")
has_numba = importlib.util.find_spec("numba") is not None
needs_numba = pytest.mark.skipif(not has_numba, reason="needs numba (kvtier[cpu-codec])")
# The CPU backends that are the reference's arithmetic bit for bit.
EXACT_BACKENDS = ["torch", pytest.param("numba", marks=needs_numba)]

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
STYLES = [pytest.param(True, id="neox"), pytest.param(False, id="gptj")]

_MANTISSA_BITS = {torch.float32: 23, torch.float16: 10, torch.bfloat16: 7}


# ---------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------


def rope_apply(
    x: torch.Tensor,  # [L, T, H * D], not rotated
    positions: torch.Tensor,  # [T]
    inv_freq: torch.Tensor,  # [R / 2]
    *,
    head_size: int,
    rotary_dim: int,
    is_neox_style: bool,
) -> torch.Tensor:
    """RoPE at ``positions``, in float64, written independently of the code under test:
    complex multiplication for GPT-J pairs, ``rotate_half`` for NeoX halves."""
    num_layers, num_tokens, width = x.shape
    heads = x.double().reshape(num_layers, num_tokens, width // head_size, head_size)
    rot, rest = heads[..., :rotary_dim], heads[..., rotary_dim:]
    angle = positions.double()[:, None] * inv_freq.double()[None, :]  # [T, R/2]
    if is_neox_style:
        cos = torch.cat([angle.cos(), angle.cos()], -1)[None, :, None, :]
        sin = torch.cat([angle.sin(), angle.sin()], -1)[None, :, None, :]
        x1, x2 = rot.chunk(2, dim=-1)
        out = rot * cos + torch.cat([-x2, x1], -1) * sin
    else:
        pairs = torch.view_as_complex(rot.reshape(*rot.shape[:-1], -1, 2).contiguous())
        turn = torch.polar(torch.ones_like(angle), angle)[None, :, None, :]
        out = torch.view_as_real(pairs * turn).flatten(-2)
    return torch.cat([out, rest], -1).reshape(num_layers, num_tokens, width)


def make_k_plane(
    num_layers: int, num_tokens: int, width: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A ``[2, L, T, width]`` chunk view that is non-contiguous in its outer dims (stored
    layer-major with a padding token either side), and its K plane ``chunk[0]``."""
    gen = torch.Generator().manual_seed(seed)
    storage = torch.randn(num_layers, 2, num_tokens + 2, width, generator=gen).to(dtype)
    chunk = storage.transpose(0, 1)[:, :, 1 : num_tokens + 1]
    return chunk, chunk[0]


def make_positions(num_tokens: int, high: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    old = torch.randint(0, high, (num_tokens,), generator=gen)
    new = torch.randint(0, high, (num_tokens,), generator=gen)
    return old, new


def ulp(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One unit in the last place of ``dtype`` at the magnitude of ``t`` (fp32 tensor)."""
    _, exponent = torch.frexp(t.float().abs())
    return torch.ldexp(
        torch.ones_like(t, dtype=torch.float32), exponent - 1 - _MANTISSA_BITS[dtype]
    )


def ulp_at(value: float, dtype: torch.dtype) -> float:
    return float(ulp(torch.tensor(value), dtype))


def assert_rotated_close(
    got: torch.Tensor,  # [L, T, H * D]
    want: torch.Tensor,  # [L, T, H * D]
    *,
    head_size: int,
    atol: float = 0.0,
    rtol: float = 0.0,
    ulps: float = 0.0,
) -> None:
    """Elementwise ``|got - want| <= atol + rtol * |want| + ulps * ulp(want)`` (ulp of
    ``got``'s dtype); on failure name the first (layer, token, head, dim) that is off."""
    got64, want64 = got.double(), want.double()
    tolerance = atol + rtol * want64.abs() + ulps * ulp(want64, got.dtype).double()
    bad = (got64 - want64).abs() > tolerance
    if bool(bad.any()):
        layer, token, col = (int(i) for i in bad.nonzero()[0])
        head, dim = divmod(col, head_size)
        raise AssertionError(
            f"{int(bad.sum())} values off; first at layer {layer}, token {token}, head {head}, "
            f"dim {dim}: got {float(got64[layer, token, col])!r}, want "
            f"{float(want64[layer, token, col])!r} (tolerance "
            f"{float(tolerance if isinstance(tolerance, float) else tolerance[layer, token, col]):.3g})"
        )


def assert_bits_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    if not torch.equal(bits(got), bits(want)):
        diff = (bits(got) != bits(want)).nonzero()[0].tolist()
        raise AssertionError(f"{what} changed; first difference at index {diff}")


def unrotated_dims(k: torch.Tensor, head_size: int, rotary_dim: int) -> torch.Tensor:
    return k.unflatten(-1, (k.shape[-1] // head_size, head_size))[..., rotary_dim:]


def gptj_to_neox(k: torch.Tensor, head_size: int, rotary_dim: int) -> torch.Tensor:
    """Each head's GPT-J pairs (dims 2i, 2i + 1) moved to NeoX's places (i, i + R/2)."""
    heads = k.unflatten(-1, (k.shape[-1] // head_size, head_size))
    rot, rest = heads[..., :rotary_dim], heads[..., rotary_dim:]
    return torch.cat([rot[..., 0::2], rot[..., 1::2], rest], -1).flatten(-2)


def neox_to_gptj(k: torch.Tensor, head_size: int, rotary_dim: int) -> torch.Tensor:
    heads = k.unflatten(-1, (k.shape[-1] // head_size, head_size))
    x1, x2 = heads[..., : rotary_dim // 2], heads[..., rotary_dim // 2 : rotary_dim]
    return torch.cat([torch.stack([x1, x2], -1).flatten(-2), heads[..., rotary_dim:]], -1).flatten(
        -2
    )


# ---------------------------------------------------------------------------------------
# the reference against an independent RoPE
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("is_neox_style", STYLES)
@pytest.mark.parametrize(("head_size", "rotary_dim"), [(64, 64), (80, 80), (128, 64)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reference_moves_rope_from_old_to_new_positions(
    is_neox_style: bool, head_size: int, rotary_dim: int, dtype: torch.dtype
) -> None:
    """rerotate(rope(x, old), old -> new) == rope(x, new), up to fp32 math and one rounding."""
    gen = torch.Generator().manual_seed(head_size + rotary_dim)
    x = torch.randn(2, 9, 2 * head_size, generator=gen)
    old, new = make_positions(9, 32, seed=1)  # |delta| < 32: the fp32 angle is good to ~2e-6
    inv_freq = rope_inv_freq(rotary_dim)
    geometry = dict(head_size=head_size, rotary_dim=rotary_dim, is_neox_style=is_neox_style)
    k = rope_apply(x, old, inv_freq, **geometry).to(dtype)
    want = rope_apply(x, new, inv_freq, **geometry)
    assert rerotate_reference(k, old, new, **geometry) is k
    if dtype == torch.float32:
        assert_rotated_close(k, want, head_size=head_size, atol=1e-5, rtol=1e-5)
    else:
        # The stored input is off by half an ulp (rotated along) and the output by one more.
        scale = float(x.abs().amax())
        assert_rotated_close(k, want, head_size=head_size, ulps=1.0, atol=ulp_at(scale, dtype))


@pytest.mark.parametrize("is_neox_style", STYLES)
def test_reference_far_positions_within_fp32_angle_rounding(is_neox_style: bool) -> None:
    """Positions up to 100k: the only extra error is the fp32 rounding of delta * inv_freq."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(1, 6, 64, generator=gen)
    old, new = make_positions(6, 100_000, seed=2)
    inv_freq = rope_inv_freq(64)
    geometry = dict(head_size=64, rotary_dim=64, is_neox_style=is_neox_style)
    k = rope_apply(x, old, inv_freq, **geometry).float()
    want = rope_apply(x, new, inv_freq, **geometry)
    rerotate_reference(k, old, new, **geometry)
    max_delta = float((new - old).abs().max())
    angle_error = max_delta * 2.0**-24  # half an ulp of the largest angle, delta * 1.0
    scale = float(x.abs().amax()) * 2**0.5
    assert_rotated_close(k, want, head_size=64, atol=angle_error * scale + 1e-5)


def test_reference_explicit_inv_freq_overrides_base() -> None:
    _, k = make_k_plane(1, 4, 128, torch.float32, seed=3)
    old, new = make_positions(4, 500, seed=4)
    by_base = rerotate_reference(k.clone(), old, new, head_size=64, base=500000.0)
    explicit = rerotate_reference(
        k.clone(), old, new, head_size=64, base=1.0, inv_freq=rope_inv_freq(64, 500000.0)
    )
    assert_bits_equal(explicit, by_base, "k")


# ---------------------------------------------------------------------------------------
# the interpreted Triton kernel against the reference
# ---------------------------------------------------------------------------------------


def check_interpret(
    chunk: torch.Tensor,
    old: torch.Tensor,
    new: torch.Tensor,
    *,
    head_size: int,
    rotary_dim: int,
    is_neox_style: bool,
    inv_freq: torch.Tensor | None = None,
) -> None:
    """Interpret backend on ``chunk[0]`` against the reference on a copy; the V plane and
    the dims past ``rotary_dim`` must stay bit-identical."""
    k, v_before = chunk[0], chunk[1].clone()
    k_before = k.clone()
    kwargs = dict(
        head_size=head_size, rotary_dim=rotary_dim, inv_freq=inv_freq, is_neox_style=is_neox_style
    )
    want = rerotate_reference(k.clone(), old, new, **kwargs)
    assert rerotate(k, old, new, **kwargs, backend="interpret") is k

    if k.dtype == torch.float32:
        assert_rotated_close(k, want, head_size=head_size, atol=1e-5)
    else:
        # fp16: cos/sin may differ in the last fp32 bit and flip a rounding; bf16: the
        # interpreter truncates fp32 -> bf16 where the reference rounds to nearest.
        assert_rotated_close(k, want, head_size=head_size, ulps=1.0, atol=1e-6)
    assert_bits_equal(chunk[1], v_before, "the V plane")
    assert_bits_equal(
        unrotated_dims(k, head_size, rotary_dim),
        unrotated_dims(k_before, head_size, rotary_dim),
        f"dims past rotary_dim={rotary_dim}",
    )


@pytest.mark.parametrize("is_neox_style", STYLES)
@pytest.mark.parametrize("head_size", [64, 80, 128])
@pytest.mark.parametrize("partial", [False, True], ids=["full", "partial"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", EXACT_BACKENDS)
def test_cpu_backends_are_the_reference_bit_for_bit(
    is_neox_style: bool, head_size: int, partial: bool, dtype: torch.dtype, backend: str
) -> None:
    """The torch backend runs the reference's arithmetic a layer at a time, the numba
    kernel a pair at a time with every product and sum rounded alone: same bits."""
    rotary_dim = head_size // 2 if partial else head_size
    chunk, _ = make_k_plane(3, 37, 2 * head_size, dtype, seed=head_size + 1)
    old, new = make_positions(37, 4096, seed=6)
    kwargs = dict(head_size=head_size, rotary_dim=rotary_dim, is_neox_style=is_neox_style)
    want = rerotate_reference(chunk[0].clone(), old, new, **kwargs)
    got = rerotate(chunk[0], old, new, **kwargs, backend=backend)
    assert_bits_equal(got, want, f"{backend} backend vs reference")


@needs_triton
@pytest.mark.parametrize("is_neox_style", STYLES)
@pytest.mark.parametrize("head_size", [64, 80, 128])
@pytest.mark.parametrize("partial", [False, True], ids=["full", "partial"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_interpret_matches_reference(
    is_neox_style: bool, head_size: int, partial: bool, dtype: torch.dtype
) -> None:
    rotary_dim = head_size // 2 if partial else head_size
    num_layers = 1 if partial else 2
    chunk, _ = make_k_plane(num_layers, 5, 2 * head_size, dtype, seed=head_size)
    old, new = make_positions(5, 4096, seed=5)
    check_interpret(
        chunk, old, new, head_size=head_size, rotary_dim=rotary_dim, is_neox_style=is_neox_style
    )


@needs_triton
@pytest.mark.parametrize("is_neox_style", STYLES)
def test_interpret_explicit_scaled_inv_freq(is_neox_style: bool) -> None:
    """A llama3-style scaled inv_freq (low frequencies divided by 8) in place of base."""
    inv_freq = rope_inv_freq(64, 500000.0)
    wavelength = 2 * torch.pi / inv_freq
    inv_freq = torch.where(wavelength > 1024, inv_freq / 8, inv_freq)
    chunk, _ = make_k_plane(2, 3, 64, torch.bfloat16, seed=8)
    old, new = make_positions(3, 100_000, seed=9)
    check_interpret(
        chunk,
        old,
        new,
        head_size=64,
        rotary_dim=64,
        is_neox_style=is_neox_style,
        inv_freq=inv_freq,
    )


@needs_triton
@pytest.mark.parametrize("is_neox_style", STYLES)
@pytest.mark.parametrize(("num_layers", "num_tokens"), [(1, 1), (2, 7)])
def test_interpret_single_and_odd_token_counts(
    is_neox_style: bool, num_layers: int, num_tokens: int
) -> None:
    chunk, _ = make_k_plane(num_layers, num_tokens, 3 * 64, torch.float32, seed=10)
    old, new = make_positions(num_tokens, 1000, seed=11)
    check_interpret(chunk, old, new, head_size=64, rotary_dim=32, is_neox_style=is_neox_style)


@needs_triton
@pytest.mark.parametrize("is_neox_style", STYLES)
@pytest.mark.parametrize("rotary_dim", [80, 36])
def test_interpret_several_token_tiles_and_pair_blocks(
    is_neox_style: bool, rotary_dim: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Small tiles: 3 token tiles x 10 (or 5) pair blocks over 2 layers and 2 heads; no pair
    may span two programs. With R = 36 the last pair block ends past R (pairs 16..19 of
    18), and the dims there must be left alone."""
    monkeypatch.setattr(rerotation, "launch_config", lambda *a: LaunchConfig(2, 4, 1))
    chunk, _ = make_k_plane(2, 5, 2 * 80, torch.float32, seed=12)
    old, new = make_positions(5, 1000, seed=13)
    check_interpret(
        chunk, old, new, head_size=80, rotary_dim=rotary_dim, is_neox_style=is_neox_style
    )


@needs_triton
@pytest.mark.parametrize("is_neox_style", STYLES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_interpret_writes_nothing_past_the_tokens_or_rotary_dims(
    is_neox_style: bool, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The masks hold at the token tail and at R inside a pair block: the tokens after the
    view and each head's dims past R hold inf, which any rotation there, even by a zero
    angle (inf * sin 0 = nan), would change."""
    monkeypatch.setattr(rerotation, "launch_config", lambda *a: LaunchConfig(2, 4, 1))
    head_size, rotary_dim, num_tokens = 80, 36, 5
    buffer = torch.randn(
        2, num_tokens + 3, 2 * head_size, generator=torch.Generator().manual_seed(22)
    )
    buffer[:, num_tokens:] = torch.inf
    unrotated_dims(buffer, head_size, rotary_dim)[:] = torch.inf
    buffer = buffer.to(dtype)
    before = buffer.clone()
    old, new = make_positions(num_tokens, 1000, seed=23)
    k = buffer[:, :num_tokens]
    geometry = dict(head_size=head_size, rotary_dim=rotary_dim, is_neox_style=is_neox_style)
    rerotate(k, old, new, **geometry, backend="interpret")
    assert_bits_equal(buffer[:, num_tokens:], before[:, num_tokens:], "the tokens after k")
    assert_bits_equal(
        unrotated_dims(buffer, head_size, rotary_dim),
        unrotated_dims(before, head_size, rotary_dim),
        f"dims past rotary_dim={rotary_dim}",
    )
    want = rerotate_reference(before[:, :num_tokens].clone(), old, new, **geometry)
    assert_rotated_close(k, want, head_size=head_size, atol=1e-5, ulps=1.0)


@needs_triton
@pytest.mark.parametrize("config", [None, LaunchConfig(2, 4, 1)], ids=["heuristic", "small"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_interpret_gptj_pairs_get_the_neox_arithmetic_bit_for_bit(
    dtype: torch.dtype, config: LaunchConfig | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GPT-J's pairs, loaded as one run of dims and split in registers, are rotated with
    exactly the arithmetic of NeoX's: the same pairs in NeoX's places come out with the same
    bits (partial rotary, 7 tokens, 2 layers, 3 heads)."""
    if config is not None:
        monkeypatch.setattr(rerotation, "launch_config", lambda *a: config)
    head_size, rotary_dim = 80, 36
    _, gptj = make_k_plane(2, 7, 3 * head_size, dtype, seed=20)
    neox = gptj_to_neox(gptj, head_size, rotary_dim)
    old, new = make_positions(7, 4096, seed=21)
    geometry = dict(head_size=head_size, rotary_dim=rotary_dim, backend="interpret")
    rerotate(gptj, old, new, is_neox_style=False, **geometry)
    rerotate(neox, old, new, is_neox_style=True, **geometry)
    assert_bits_equal(gptj, neox_to_gptj(neox, head_size, rotary_dim), "GPT-J vs NeoX keys")


@pytest.mark.parametrize(
    "backend", [*EXACT_BACKENDS, pytest.param("interpret", marks=needs_triton)], ids=str
)
@pytest.mark.parametrize("is_neox_style", STYLES)
def test_round_trip_restores_the_keys(backend: str, is_neox_style: bool) -> None:
    _, k = make_k_plane(2, 5, 2 * 80, torch.float32, seed=14)
    original = k.clone()
    old, new = make_positions(5, 4096, seed=15)
    geometry = dict(head_size=80, rotary_dim=80, is_neox_style=is_neox_style, backend=backend)
    rerotate(k, old, new, **geometry)
    assert not torch.allclose(k, original)
    rerotate(k, new, old, **geometry)
    assert_rotated_close(k, original, head_size=80, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "backend", [*EXACT_BACKENDS, pytest.param("interpret", marks=needs_triton)], ids=str
)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_zero_delta_is_bit_identical(backend: str, dtype: torch.dtype) -> None:
    chunk, k = make_k_plane(2, 3, 2 * 64, dtype, seed=16)
    before = chunk.clone()
    positions = torch.tensor([0, 17, 4095])
    rerotate(k, positions, positions.clone(), head_size=64, is_neox_style=False, backend=backend)
    assert_bits_equal(chunk, before, "the chunk")


@pytest.mark.parametrize(
    "backend", [*EXACT_BACKENDS, pytest.param("interpret", marks=needs_triton)], ids=str
)
@pytest.mark.parametrize("is_neox_style", STYLES)
def test_dims_past_rotary_dim_are_untouched(backend: str, is_neox_style: bool) -> None:
    _, k = make_k_plane(1, 3, 2 * 128, torch.bfloat16, seed=17)
    before = k.clone()
    old, new = make_positions(3, 1000, seed=18)
    rerotate(
        k, old, new, head_size=128, rotary_dim=32, is_neox_style=is_neox_style, backend=backend
    )
    assert_bits_equal(unrotated_dims(k, 128, 32), unrotated_dims(before, 128, 32), "dims >= 32")
    assert not torch.equal(k, before)


@pytest.mark.parametrize(
    "backend", [*EXACT_BACKENDS, pytest.param("interpret", marks=needs_triton)], ids=str
)
def test_empty_inputs_are_a_no_op(backend: str) -> None:
    for k in (torch.zeros(2, 0, 128), torch.zeros(0, 3, 128)):
        positions = torch.zeros(k.shape[1], dtype=torch.int64)
        assert rerotate(k, positions, positions, head_size=64, backend=backend) is k


# ---------------------------------------------------------------------------------------
# validation, registry, launch parameters
# ---------------------------------------------------------------------------------------

_K = torch.zeros(2, 3, 128)
_POS = torch.zeros(3, dtype=torch.int64)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(k=_K[0]), ValueError, r"k must be 3-D \[num_layers, num_tokens, num_heads \* head_size\]"),
        (dict(k=_K.to(torch.float64)), ValueError, "k has dtype torch.float64; supported"),
        (dict(k=_K.int()), ValueError, "k has dtype torch.int32"),
        (dict(head_size=48), ValueError, r"k's last dim 128 .* not divisible by head_size=48"),
        (dict(head_size=0), ValueError, "head_size must be a positive int"),
        (dict(k=torch.zeros(2, 3, 256)[..., ::2]), ValueError, "k must be contiguous in its last dim"),
        (dict(rotary_dim=33), ValueError, "rotary_dim must be a positive even int <= head_size=64; got 33"),
        (dict(rotary_dim=66), ValueError, "rotary_dim must be a positive even int <= head_size=64; got 66"),
        (dict(rotary_dim=0), ValueError, "rotary_dim must be a positive even int"),
        (dict(old_positions=_POS[:2]), ValueError, r"old_positions must have one position per token of k: shape \(3,\); got \(2,\)"),
        (dict(new_positions=_POS.float()), ValueError, r"new_positions must be a 1-D int64 \(or int32\) tensor"),
        (dict(new_positions=_POS[None]), ValueError, r"new_positions must be a 1-D .* got shape \(1, 3\)"),
        (dict(old_positions=[0, 1, 2]), TypeError, "old_positions must be a torch.Tensor"),
        (dict(base=0.0), ValueError, "base must be a positive number; got 0.0"),
        (dict(inv_freq=torch.ones(16)), ValueError, r"inv_freq must be a 1-D float tensor \[rotary_dim // 2\] = \(32,\); got shape \(16,\)"),
        (dict(inv_freq=torch.ones(32, dtype=torch.int64)), ValueError, "inv_freq must be a 1-D float tensor"),
        (dict(backend="cuda"), ValueError, "unknown kernel backend 'cuda'"),
    ],
)  # fmt: skip
def test_validation_names_the_problem(kwargs: dict, error: type, match: str) -> None:
    args = dict(k=_K, old_positions=_POS, new_positions=_POS, head_size=64, backend="torch")
    args.update(kwargs)
    with pytest.raises(error, match=match):
        rerotate(args.pop("k"), args.pop("old_positions"), args.pop("new_positions"), **args)


RUNNABLE = ["torch", "triton", "interpret"] if torch.cuda.is_available() else ["torch", "interpret"]
RUNNABLE += ["numba"] if has_numba else []


@needs_triton
def test_registry_serves_triton_backends_lazily() -> None:
    assert registry.backends_for("rope_rerotate") == RUNNABLE
    impl = registry.get("rope_rerotate", "interpret", "cpu")
    assert impl.func is rerotate_triton and impl.keywords == {"interpret": True}
    on_cpu = registry.get("rope_rerotate", "auto", "cpu")
    assert on_cpu is (rope_numba.rerotate_numba if has_numba else rerotation.rerotate_torch)
    with pytest.raises(ValueError, match="'triton' cannot run on device 'cpu'"):
        rerotate(_K, _POS, _POS, head_size=64, backend="triton")


@needs_triton
def test_launcher_refuses_tensors_it_cannot_reach() -> None:
    with pytest.raises(ValueError, match="'triton' needs k on a CUDA/ROCm GPU; k is on cpu"):
        rerotate_triton(_K.clone(), _POS, _POS, head_size=64, interpret=False)
    with pytest.raises(ValueError, match="'interpret' runs on CPU tensors; k is on meta"):
        rerotate_triton(_K.to("meta"), _POS, _POS, head_size=64, interpret=True)


@needs_triton
def test_launch_config_hook_is_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rerotation, "launch_config", lambda *a: LaunchConfig(3, 16, 4))
    with pytest.raises(ValueError, match="block_tokens must be a power of two; got 3"):
        rerotate(_K.clone(), _POS, _POS, head_size=64, backend="interpret")
    monkeypatch.setattr(rerotation, "launch_config", lambda *a: LaunchConfig(1, 16, 32))
    with pytest.raises(ValueError, match="num_warps must be 1, 2, 4, 8 or 16; got 32"):
        rerotate(_K.clone(), _POS, _POS, head_size=64, backend="interpret")


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_launch_config_heuristic(device: str) -> None:
    for half_rotary in (1, 16, 20, 32, 40, 64, 288):
        for num_tokens in (1, 5, 256, 4096):
            config = rerotation.launch_config(
                half_rotary, num_tokens, torch.bfloat16, torch.device(device)
            )
            for value in (config.block_tokens, config.block_pairs, config.num_warps):
                assert value >= 1 and value & (value - 1) == 0, config
            assert config.num_warps <= 16
            if half_rotary <= 128:
                assert config.block_pairs >= half_rotary  # a head's pairs take one program
            assert config.block_tokens <= max(1, 2 * num_tokens)


@pytest.mark.gpu
@pytest.mark.skipif(not has_gpu, reason="needs a CUDA/ROCm GPU")
@pytest.mark.parametrize("is_neox_style", STYLES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_gpu_realistic_shape(is_neox_style: bool, dtype: torch.dtype) -> None:
    """32 layers x 8 heads x 128, a 256-token chunk's K plane, against the reference."""
    num_layers, num_tokens, heads, head_size = 32, 256, 8, 128
    gen = torch.Generator(device="cuda").manual_seed(19)
    chunk = torch.randn(
        2, num_layers, num_tokens, heads * head_size, generator=gen, device="cuda"
    ).to(dtype)
    v_before = chunk[1].clone()
    old = torch.randint(0, 32768, (num_tokens,), generator=gen, device="cuda")
    new = torch.randint(0, 32768, (num_tokens,), generator=gen, device="cuda")
    geometry = dict(head_size=head_size, is_neox_style=is_neox_style)
    want = rerotate_reference(chunk[0].clone(), old, new, **geometry)
    rerotate(chunk[0], old, new, **geometry, backend="triton")
    torch.cuda.synchronize()
    if dtype == torch.float32:
        assert_rotated_close(chunk[0].cpu(), want.cpu(), head_size=head_size, atol=1e-5)
    else:  # both round to nearest; an FMA or a last-bit cos/sin may flip one rounding
        assert_rotated_close(chunk[0].cpu(), want.cpu(), head_size=head_size, ulps=1.0, atol=1e-6)
    assert_bits_equal(chunk[1], v_before, "the V plane")


@needs_numba
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_kernel_that_fails_to_compile_rotates_as_torch_with_one_warning(
    dtype, numba_compile_fails, caplog
) -> None:
    import numba

    k = torch.randn(2, 5, 2 * 64, generator=torch.Generator().manual_seed(3)).to(dtype)
    old, new = torch.arange(5), torch.arange(5) + 7
    expected = rerotation.rerotate_torch(k.clone(), old, new, head_size=64)
    numba_compile_fails(rope_numba.NUMBA_KERNEL)
    caplog.set_level(logging.WARNING)
    for backend in ("auto", "numba", "auto"):
        assert torch.equal(rerotate(k.clone(), old, new, head_size=64, backend=backend), expected)
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert f"numba {numba.__version__} failed on rerotate_kernel (RecursionError" in warning
    assert "rope_rerotate runs its numpy/torch reference" in warning
    assert registry.pick("rope_rerotate", "auto", "cpu") == "torch"
