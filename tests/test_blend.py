"""CacheBlend's core without vLLM: segments and their store, the model checks, RoPE specs
from configs, and the blend itself against a full prefill of a transformers Llama."""

from __future__ import annotations

import itertools

import pytest
import torch
from support.blend import documents, full_kv, join, tiny_hf_llama

from kvtier.blend import (
    PlacedSegment,
    UnsupportedModelError,
    blend,
    check_blendable,
    check_rerotation,
    place_segments,
    rope_spec,
)
from kvtier.blend.hf import HFDecoder
from kvtier.blend.segments import Segment, SegmentStore, segment_hash, split_segments
from kvtier.chunker import RequestExtras
from kvtier.config import KVTierConfig
from kvtier.hashing import ChunkHasher
from kvtier.keys import CacheKey
from kvtier.observability.stats import Counter, Stats
from kvtier.storage.manager import StorageManager

pytest.importorskip("transformers")

SEP = [3, 3]
RATIOS = [0.0, 0.05, 0.15, 0.3, 1.0]


# -- segments --------------------------------------------------------------------------


def test_split_segments() -> None:
    tokens = [1, 2, 3, 3, 4, 5, 6, 3, 3, 7, 3, 3]
    assert split_segments(tokens, SEP, 1) == [Segment(0, 2), Segment(4, 7), Segment(9, 10)]
    assert split_segments(tokens, SEP, 2) == [Segment(0, 2), Segment(4, 7)]
    assert split_segments(tokens, SEP, 1, end=6) == [Segment(0, 2), Segment(4, 6)]
    assert split_segments([1, 2], [], 1) == [Segment(0, 2)]


def test_segment_hash_ignores_place_but_not_salt() -> None:
    hasher = ChunkHasher("sha256_cbor", 0)
    doc = [5, 6, 7]
    assert segment_hash(hasher, doc) == segment_hash(hasher, list(doc))
    assert segment_hash(hasher, doc) != segment_hash(hasher, [5, 6, 8])
    salted = segment_hash(hasher, doc, RequestExtras(cache_salt="tenant"))
    assert salted != segment_hash(hasher, doc)
    assert segment_hash(hasher, doc) != hasher.hash_chunk(hasher.root(), doc)  # not a prefix key


def test_segment_store_round_trip() -> None:
    config = KVTierConfig(max_local_cpu_size=0.01)
    storage = StorageManager(config, Stats(), pin_memory=False, namespace="m")
    try:
        store = SegmentStore(storage, CacheKey("m", 1, 0, "float32", b""))
        kv = torch.randn(2, 3, 5, 8)
        positions = torch.arange(7, 12)
        h = segment_hash(ChunkHasher("sha256_cbor", 0), [1, 2, 3, 4, 5])
        assert not store.contains(h) and store.get(h, kv.shape, kv.dtype) is None
        assert store.put(h, kv, positions)
        assert store.contains(h)
        got_kv, got_positions = store.get(h, kv.shape, kv.dtype)
        assert torch.equal(got_kv, kv) and torch.equal(got_positions, positions)
    finally:
        storage.close()


@pytest.mark.parametrize(("capacity", "fits"), [(1024, False), (1280, True)])
def test_a_segment_fits_when_its_kv_and_positions_fit_together(capacity, fits) -> None:
    """A segment's KV (960 bytes, 1024 aligned) alone fits a pool of 1024 bytes, but
    ``put`` holds its positions (40 bytes, 256 aligned) too: such a segment never fits."""
    config = KVTierConfig(max_local_cpu_size=capacity / 2**30)
    storage = StorageManager(config, Stats(), pin_memory=False, namespace="m")
    try:
        store = SegmentStore(storage, CacheKey("m", 1, 0, "float32", b""))
        kv, positions = torch.randn(2, 3, 5, 8), torch.arange(5)
        assert store.fits(tuple(kv.shape), kv.dtype) is fits
        assert store.put(b"h" * 32, kv, positions) is fits
    finally:
        storage.close()


def test_segment_changed_in_memory_is_a_miss_and_no_longer_held() -> None:
    """A segment whose KV changed after it was stored (verify_checksums) is a miss, and
    it leaves the tiers: otherwise every later prompt with that document would be claimed
    for it and miss it, and it would never be stored again."""
    stats = Stats()
    config = KVTierConfig(max_local_cpu_size=0.01, verify_checksums=True)
    storage = StorageManager(config, stats, pin_memory=False, namespace="m")
    try:
        store = SegmentStore(storage, CacheKey("m", 1, 0, "float32", b""))
        h = segment_hash(ChunkHasher("sha256_cbor", 0), [1, 2, 3, 4, 5])
        assert store.put(h, torch.randn(2, 3, 5, 8), torch.arange(7, 12))
        (held,) = storage.get_many([store._key(h, "kv")])
        held.tensor.add_(1.0)  # the bytes change in memory after the store
        held.ref_down()
        assert store.get(h, (2, 3, 5, 8), torch.float32) is None
        assert stats.get(Counter.CORRUPT_CHUNKS) == 1
        assert not store.contains(h)  # the next prompt that computes it stores it again
        kv = torch.randn(2, 3, 5, 8)
        assert store.put(h, kv, torch.arange(0, 5))
        assert torch.equal(store.get(h, kv.shape, kv.dtype)[0], kv)
    finally:
        storage.close()


# -- models ----------------------------------------------------------------------------


class _Config:
    def __init__(self, **fields):
        self.architectures = [fields.pop("arch", "FakeForCausalLM")]
        self.__dict__.update(fields)


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"arch": "GPT2LMHeadModel"}, "does not use rotary"),
        ({"rope_theta": 1e4, "kv_lora_rank": 512, "arch": "DeepseekV3ForCausalLM"}, "MLA"),
        ({"rope_theta": 1e4, "sliding_window": 4096, "arch": "MistralForCausalLM"}, "sliding"),
        ({"rope_theta": 1e4, "layer_types": ["full_attention", "linear_attention"]}, "hybrid"),
        ({"rope_theta": 1e4, "rope_scaling": {"rope_type": "dynamic"}}, "rope type"),
        ({"rope_theta": 1e4, "embedding_multiplier": 12.0, "arch": "GraniteForCausalLM"}, "scales"),
        ({"rope_theta": 1e4, "scale_depth": 1.4, "arch": "MiniCPMForCausalLM"}, "scales"),
        ({"rope_theta": 1e4, "llama_4_scaling": {"beta": 0.1}}, "scales queries by position"),
        ({"rope_theta": 1e4, "is_causal": False, "arch": "Qwen2Model"}, "bidirectional"),
        ({"rope_theta": 1e4, "use_bidirectional_attention": True}, "bidirectional"),
        ({"rope_theta": 1e4, "attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0"),
        (
            {
                "rope_theta": 1e4,
                "head_dim": 64,
                "partial_rotary_factor": 0.3,
                "arch": "PhiForCausalLM",
            },
            r"rotary dims \(19 of head size 64\)",
        ),
        (
            {
                "rope_theta": 1e4,
                "rope_parameters": {"rope_theta": 1e4, "rope_dim": 7},
                "head_dim": 64,
            },
            "rotary dims",
        ),
    ],
)
def test_unsupported_models_name_their_class(fields: dict, reason: str) -> None:
    name = fields.get("arch", "FakeForCausalLM")
    with pytest.raises(UnsupportedModelError, match=reason) as excinfo:
        check_blendable(_Config(**fields))
    assert name in str(excinfo.value)


def test_sliding_window_off_is_blendable() -> None:
    check_blendable(_Config(rope_theta=1e4, sliding_window=4096, use_sliding_window=False))


def test_legacy_rope_scaling_type_is_read() -> None:
    """Older configs name the rope type ``type`` in ``rope_scaling``."""
    plain = rope_spec(_Config(rope_theta=1e4, hidden_size=256, num_attention_heads=4))
    linear = rope_spec(
        _Config(
            rope_theta=1e4,
            hidden_size=256,
            num_attention_heads=4,
            rope_scaling={"type": "linear", "factor": 4.0},
        )
    )
    torch.testing.assert_close(linear.inv_freq, plain.inv_freq / 4)
    with pytest.raises(UnsupportedModelError, match="'dynamic'"):
        check_blendable(_Config(rope_theta=1e4, rope_scaling={"type": "dynamic", "factor": 2.0}))


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 1024,
        },
        {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 1024,
        },
    ],
    ids=lambda rope: rope["rope_type"],
)
def test_rope_spec_matches_transformers(rope: dict) -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(
        hidden_size=256,
        num_attention_heads=4,
        max_position_embeddings=4096,
        rope_parameters=dict(rope),
    )
    spec = rope_spec(config)
    if rope["rope_type"] == "default":
        from kvtier_kernels.rope import rope_inv_freq

        expected = rope_inv_freq(64, 10000.0)
    else:
        expected, _ = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config, "cpu")
    assert spec.head_size == spec.rotary_dim == 64 and spec.is_neox_style
    torch.testing.assert_close(spec.inv_freq, expected.float(), rtol=1e-6, atol=0)


# -- the blend -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama():
    return tiny_hf_llama(num_layers=4)


@pytest.fixture(scope="module")
def scenario(llama):
    """Four documents stored behind one system prompt, then reused in another order behind
    a new system prompt with a question: the stored KV, and the new prompt's full prefill."""
    docs = documents(4, 64, seed=1)
    sys_old, sys_new, question = documents(3, 20, seed=2)
    stored, stored_starts = join([sys_old, *docs], SEP)
    order = [2, 0, 3, 1]
    prompt, starts = join([sys_new, *(docs[i] for i in order), question], SEP)
    stored_kv = full_kv(llama, stored)
    segments = [
        (stored_kv[:, :, s : s + 64], torch.arange(s, s + 64), starts[1 + j])
        for j, s in enumerate(stored_starts[1 + i] for i in order)
    ]
    return prompt, segments, full_kv(llama, prompt)


def _blend(llama, scenario, ratio: float | None, *, rerotate: bool = True):
    """The blended KV at ``ratio`` (None: the baseline, cached KV reused as it is)."""
    prompt, segments, reference = scenario
    kv = torch.zeros_like(reference)
    reused = torch.zeros(len(prompt), dtype=torch.bool)
    placed = [PlacedSegment(kv_.clone(), old, start) for kv_, old, start in segments]
    place_segments(
        kv, reused, placed, rope_spec(llama.config) if rerotate else None, backend="torch"
    )
    tokens = torch.tensor(prompt)
    if ratio is None:
        return blend(HFDecoder(llama), tokens, kv, reused, [], fixed=reused.clone()).kv
    return blend(HFDecoder(llama), tokens, kv, reused, [(0, ratio)]).kv


def deviation(kv: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """Per layer: squared KV error relative to the reference's squared norm."""
    return ((kv - reference) ** 2).sum(dim=(0, 2, 3)) / (reference**2).sum(dim=(0, 2, 3))


def test_fresh_prompt_equals_full_prefill(llama, scenario) -> None:
    prompt, _, reference = scenario
    kv = torch.zeros_like(reference)
    none = torch.zeros(len(prompt), dtype=torch.bool)
    result = blend(HFDecoder(llama), torch.tensor(prompt), kv, none, [(0, 0.15)])
    torch.testing.assert_close(result.kv, reference, rtol=1e-4, atol=1e-4)
    assert bool(result.recomputed.all())


def test_ratio_one_equals_full_prefill(llama, scenario) -> None:
    _, _, reference = scenario
    torch.testing.assert_close(_blend(llama, scenario, 1.0), reference, rtol=1e-4, atol=1e-4)


def test_quality_curve_falls_and_beats_plain_reuse(llama, scenario) -> None:
    _, _, reference = scenario
    baseline = deviation(_blend(llama, scenario, None, rerotate=False), reference).mean()
    curve = [deviation(_blend(llama, scenario, r), reference).mean() for r in RATIOS]
    print("baseline", float(baseline), "curve", [round(float(c), 4) for c in curve])
    assert all(a > b for a, b in itertools.pairwise(curve)), curve
    assert all(c < baseline for c in curve[:-1]), (curve, baseline)
    assert curve[-1] < 1e-9


def test_fixed_prefix_is_kept(llama, scenario) -> None:
    """Tokens the engine already holds exactly are read, not recomputed."""
    prompt, _, reference = scenario
    kv = torch.zeros_like(reference)
    fixed = torch.zeros(len(prompt), dtype=torch.bool)
    fixed[:22] = True
    kv[:, :, :22] = reference[:, :, :22]
    result = blend(
        HFDecoder(llama), torch.tensor(prompt), kv, fixed.clone(), [(0, 1.0)], fixed=fixed
    )
    torch.testing.assert_close(result.kv, reference, rtol=1e-4, atol=1e-4)
    assert not bool(result.recomputed[:22].any())


def test_check_layer_past_the_model_is_an_error(llama, scenario) -> None:
    prompt, _, reference = scenario
    none = torch.zeros(len(prompt), dtype=torch.bool)
    with pytest.raises(ValueError, match="blend_check_layers"):
        blend(HFDecoder(llama), torch.tensor(prompt), reference.clone(), none, [(4, 0.1)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 500000.0},
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 1024,
        },
    ],
    ids=lambda rope: rope["rope_type"],
)
def test_rerotated_keys_equal_keys_made_at_new_positions(rope: dict, dtype) -> None:
    """Keys rotated by the model's own RoPE (transformers) at old positions, re-rotated
    with the spec read from its config, equal its keys made at the new positions."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(
        hidden_size=256,
        num_attention_heads=4,
        max_position_embeddings=8192,
        rope_parameters=dict(rope),
    )
    rotary = LlamaRotaryEmbedding(config)
    keys = torch.randn(1, 40, 2, 64, generator=torch.Generator().manual_seed(0))
    old, new = torch.arange(100, 140), torch.arange(3000, 3040)

    def rotated(positions):
        cos, sin = rotary(keys, positions[None])
        cos, sin = cos[0][:, None], sin[0][:, None]
        half = torch.cat((-keys[..., 32:], keys[..., :32]), -1)
        return (keys * cos + half * sin).flatten(-2)  # [1, T, H * D]

    spec = rope_spec(config)
    k = rotated(old).to(dtype)
    from kvtier_kernels import rerotate

    rerotate(k, old, new, head_size=64, inv_freq=spec.inv_freq, backend="torch")
    expected = rotated(new)
    # bf16: one ulp. fp32: the angles' own fp32 rounding at positions near 3000 (about
    # 3000 * 6e-8 rad, docs/rope.md), in the model's RoPE as much as in the re-rotation.
    tolerance = 5e-4 if dtype == torch.float32 else 2**-7
    assert (k.float() - expected).abs().max() <= tolerance * expected.abs().clamp(min=1).max()


def test_check_rerotation_tells_the_model_rope_from_another(llama) -> None:
    import dataclasses

    spec = rope_spec(llama.config)
    decoder = HFDecoder(llama)
    assert check_rerotation(decoder, spec, 4096) < 1e-8
    for other in (
        dataclasses.replace(spec, is_neox_style=False),
        dataclasses.replace(spec, inv_freq=spec.inv_freq / 2),
        dataclasses.replace(spec, rotary_dim=spec.head_size // 2, inv_freq=spec.inv_freq[::2]),
    ):
        assert check_rerotation(decoder, other, 4096) > 0.5


def test_every_token_reused_at_ratio_zero(llama, scenario) -> None:
    """Nothing is left to compute past the check layer: the reused KV is kept there,
    without calling the model on no tokens (vLLM: a prompt ``doc + separator`` whose
    document is held, at ratio 0)."""
    prompt, _, reference = scenario
    kv = reference.clone()
    everything = torch.ones(len(prompt), dtype=torch.bool)
    result = blend(HFDecoder(llama), torch.tensor(prompt), kv, everything, [(0, 0.0)])
    assert not bool(result.recomputed.any())
    torch.testing.assert_close(result.kv, reference, rtol=1e-4, atol=1e-4)
