"""CacheBlend behind the vLLM connector, without an engine: the start-up model check, the
scheduler's claims and segment stores (``BlendPlanner``), and single-token access to the
CPU backend's tiled KV blocks (``PagedTokens``, through vLLM's own op).
The real engine: ``test_vllm_blend_engine.py``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from kvtier.blend import UnsupportedModelError, rope_spec, vllm_worker
from kvtier.blend.segments import segment_hash
from kvtier.blend.vllm_extension import BlendWorking, separator_tokens
from kvtier.blend.vllm_plan import PLAN_KEY, BlendPlanner, BlendSpec, SegmentSaveSpec
from kvtier.blend.vllm_worker import BlendWorker, PagedTokens, cpu_block_map
from kvtier.config import KVTierConfig
from kvtier.integration.vllm.common import StepPlan
from kvtier.integration.vllm.extensions import check_extensions
from kvtier.keys import CacheKey
from kvtier.observability.stats import Counter, Stats
from kvtier.storage.manager import StorageManager
from kvtier_kernels import PagedKV
from kvtier_kernels.rope import rerotate_reference, rope_inv_freq


def _vllm_config(**hf_fields) -> SimpleNamespace:
    return SimpleNamespace(model_config=SimpleNamespace(hf_config=SimpleNamespace(**hf_fields)))


def test_unsupported_model_is_named() -> None:
    config = KVTierConfig(enable_blending=True)
    vllm_config = _vllm_config(architectures=["GPT2LMHeadModel"])
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        check_extensions(config, vllm_config)


def test_blendable_model_is_accepted() -> None:
    config = KVTierConfig(enable_blending=True)
    check_extensions(config, _vllm_config(architectures=["LlamaForCausalLM"], rope_theta=10000.0))


def test_blending_off_changes_nothing() -> None:
    check_extensions(KVTierConfig(), _vllm_config(architectures=["GPT2LMHeadModel"]))


@pytest.mark.parametrize(
    ("engine", "named"),
    [
        ({"lora_config": object()}, "LoRA"),
        ({"speculative_config": object()}, "speculative decoding"),
        ({"cache_config": SimpleNamespace(cache_dtype="fp8")}, "kv_cache_dtype 'fp8'"),
    ],
    ids=["lora", "speculative", "fp8"],
)
def test_engine_features_the_blend_ignores_are_refused(engine: dict, named: str) -> None:
    vllm_config = _vllm_config(architectures=["LlamaForCausalLM"], rope_theta=10000.0)
    for name, value in engine.items():
        setattr(vllm_config, name, value)
    with pytest.raises(ValueError, match=f"enable_blending: .*{named}"):
        check_extensions(KVTierConfig(enable_blending=True), vllm_config)
    check_extensions(KVTierConfig(), vllm_config)  # blending off: nothing refused


def test_float_kv_cache_dtypes_are_blended() -> None:
    for cache_dtype in ("auto", "bfloat16", "float16"):
        vllm_config = _vllm_config(architectures=["LlamaForCausalLM"], rope_theta=10000.0)
        vllm_config.cache_config = SimpleNamespace(cache_dtype=cache_dtype)
        check_extensions(KVTierConfig(enable_blending=True), vllm_config)


def _tokenizer(pre_tokenizer, words: list[str]):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizer
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>")


def test_separator_that_keeps_its_tokens_in_text(caplog) -> None:
    from tokenizers import pre_tokenizers

    tokenizer = _tokenizer(pre_tokenizers.WhitespaceSplit(), ["<unk>", "x", "#"])
    assert separator_tokens(tokenizer, " # # ") == [2, 2]
    assert "will not be split" not in caplog.text
    with pytest.raises(ValueError, match="blend_special_str: ' ' tokenizes to no tokens"):
        separator_tokens(tokenizer, " ")


def test_separator_whose_tokens_change_in_text_is_warned_about(caplog) -> None:
    """A SentencePiece-style tokenizer makes the default separator's trailing space a
    token of its own, which text between words never has."""
    from tokenizers import pre_tokenizers

    metaspace = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    tokenizer = _tokenizer(metaspace, ["<unk>", "\u2581", "\u2581#", "\u2581x"])
    assert separator_tokens(tokenizer, " # # ") == [2, 2, 1]
    assert "will not be split" in caplog.text


# -- the scheduler's claims and stores ---------------------------------------------------


def _blends(plan: StepPlan) -> list[BlendSpec]:
    return [s for s in plan.extensions.get(PLAN_KEY, []) if isinstance(s, BlendSpec)]


def _segment_saves(plan: StepPlan) -> list[SegmentSaveSpec]:
    return [s for s in plan.extensions.get(PLAN_KEY, []) if isinstance(s, SegmentSaveSpec)]


SEP = [7, 7]


def _request(req_id: str, tokens: list[int]) -> SimpleNamespace:
    return SimpleNamespace(request_id=req_id, prompt_token_ids=tokens, all_token_ids=tokens)


def _step(new: list[tuple[str, int, int, list[int]]]) -> SimpleNamespace:
    """A scheduler output with new requests ``(req_id, computed, scheduled, blocks)``."""
    return SimpleNamespace(
        scheduled_new_reqs=[
            SimpleNamespace(req_id=r, num_computed_tokens=c, block_ids=(b,)) for r, c, _, b in new
        ],
        num_scheduled_tokens={r: n for r, _, n, _ in new},
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
    )


def _planner(held: set[bytes]) -> tuple[BlendPlanner, list[list[bytes]]]:
    asked: list[list[bytes]] = []

    def lookup(hashes: list[bytes]) -> list[bool]:
        asked.append(hashes)
        return [h in held for h in hashes]

    return BlendPlanner(KVTierConfig(blend_min_tokens=3), SEP, lookup), asked


def test_planner_stores_then_claims() -> None:
    doc_a, doc_b = [10, 11, 12, 13], [20, 21, 22]
    first = [1, 2, 3, *SEP, *doc_a, *SEP, *doc_b, *SEP, 4]
    planner, asked = _planner(set())
    assert planner.claim(_request("r1", first), 0) == 0  # nothing held: stored instead
    assert planner.after_alloc(_request("r1", first), [0], 0) is False
    plan = StepPlan()
    planner.extend(plan, _step([("r1", 0, 8, [0, 1])]), lambda r: [0, 1])
    assert [(s, e) for s, e, _ in _segment_saves(plan)[0].segments] == [(0, 3)]  # computed
    plan = StepPlan()
    planner.extend(plan, _step([("r1", 8, len(first) - 8, [0, 1])]), lambda r: [0, 1])
    assert [(s, e) for s, e, _ in _segment_saves(plan)[0].segments] == [(5, 9), (11, 14)]
    stored = {h for _, _, h in _segment_saves(plan)[0].segments}

    second = [5, 6, 5, *SEP, *doc_b, *SEP, *doc_a, *SEP, 8, 9]
    planner, asked = _planner(stored)
    request = _request("r2", second)
    claimed = planner.claim(request, 0)
    assert claimed == len(second) - 1
    assert planner.claim(request, 0) == claimed and len(asked) == 1  # asked once
    assert planner.after_alloc(request, [3, 4], claimed)
    plan = StepPlan()
    planner.extend(plan, _step([("r2", claimed, 1, [3, 4])]), lambda r: [3, 4])
    (spec,) = _blends(plan)
    assert spec.token_ids == second[:claimed] and spec.block_ids == [3, 4]
    assert [(s, e) for s, e, _ in spec.segments] == [(5, 8), (10, 14)]
    assert not _segment_saves(plan)  # a blended prompt stores nothing
    assert planner.counters()["blend_reused_tokens"] == 7


def test_planner_leaves_images_and_prompt_embeds_alone() -> None:
    """Their placeholder ids are not what the model saw: never blended, never stored as
    segments, even when segments of the same ids are held."""
    doc = [10, 11, 12, 13]
    prompt = [1, 2, 3, *SEP, *doc, *SEP, 4]
    image = SimpleNamespace(identifier="img", mm_position=SimpleNamespace(offset=5, length=4))
    for extra in ({"mm_features": [image]}, {"prompt_embeds": torch.zeros(len(prompt), 8)}):
        held: set[bytes] = set()
        planner, asked = _planner(held)
        held.add(segment_hash(planner.hasher, doc))
        assert planner.claim(_request("plain", prompt), 0) == len(prompt) - 1
        asked.clear()
        request = _request("r", prompt)
        vars(request).update(extra)
        assert planner.claim(request, 0) == 0, f"{list(extra)} claimed"
        assert not asked, f"{list(extra)}: segments looked up"
        assert planner.after_alloc(request, [0], 0) is False
        plan = StepPlan()
        planner.extend(plan, _step([("r", 0, len(prompt), [0])]), lambda r: [0])
        assert not _segment_saves(plan), f"{list(extra)}: segments stored"


def test_planner_leaves_prefix_hits_and_refusals_alone() -> None:
    doc = [10, 11, 12, 13]
    prompt = [1, 2, 3, *SEP, *doc, *SEP, 4]
    held = {h for _, _, h in _spans(prompt)}
    planner, _ = _planner(held)
    assert planner.claim(_request("a", prompt), 32) == 0  # vLLM's own prefix hit
    planner, _ = _planner(held)
    request = _request("b", prompt)
    claimed = planner.claim(request, 0)
    assert claimed == len(prompt) - 1
    assert planner.after_alloc(request, [0], 0) is False  # vLLM did not take the claim
    plan = StepPlan()
    planner.extend(plan, _step([("b", 0, len(prompt), [0])]), lambda r: [0])
    assert not _blends(plan)


def test_planner_counts_a_claim_when_vllm_accepts_it_and_keeps_it() -> None:
    """The scheduler's blend counters are of claims (docs/observability.md): counted at
    ``after_alloc``, kept when the blend never runs (preempted) or fails in a worker."""
    prompt = [1, 2, 3, *SEP, 10, 11, 12, 13, *SEP, 4]
    planner, _ = _planner({h for _, _, h in _spans(prompt)})
    request = _request("p", prompt)
    claimed = planner.claim(request, 0)
    assert set(planner.counters().values()) == {0}, "a claim vLLM has not accepted"
    assert planner.after_alloc(request, [0, 1], claimed)
    counted = planner.counters()
    assert (counted["blend_requests"], counted["blend_claimed_tokens"]) == (1, claimed)
    assert counted["blend_reused_tokens"] == 7  # [1, 2, 3] and the document
    planner.on_preempted({"p"})
    plan = StepPlan()
    planner.extend(plan, _step([("p", 0, len(prompt), [0, 1])]), lambda r: [0, 1])
    assert not _blends(plan) and planner.counters() == counted, "dropped, still counted"


def _spans(tokens: list[int]) -> list:
    planner, asked = _planner(set())
    planner.claim(_request("x", tokens), 0)
    return [(0, 0, h) for h in asked[0]]


# -- single tokens of the CPU backend's KV -------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "block_size", "head_size"), [(2, 32, 32), (1, 16, 80)])
def test_cpu_tokens_round_trip_bit_exact(dtype, heads, block_size, head_size) -> None:
    """Written with vLLM's ``cpu_attn_reshape_and_cache``, read back through the map:
    the same bits; and the map places every value where the op does."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = str(_get_attn_isa(dtype, block_size, head_size, "auto"))
    layers, blocks = 2, 5
    tensors = [
        torch.zeros(blocks, heads, block_size, 2 * head_size, dtype=dtype) for _ in range(layers)
    ]
    tokens = PagedTokens(PagedKV("vllm_cpu", tensors), isa)
    slots = torch.tensor([3, block_size + 1, 4 * block_size - 1, 0, 2 * block_size + 5])
    kv = torch.randn(2, layers, len(slots), heads * head_size).to(dtype)
    tokens.write(slots, kv)
    assert torch.equal(tokens.read(slots), kv)

    where = cpu_block_map(heads, block_size, head_size, dtype, isa)
    placed = torch.zeros(blocks, heads * 2 * block_size * head_size, dtype=dtype)
    block, offset = slots // block_size, slots % block_size
    placed[block[None, :, None], where[:, offset]] = kv[:, 0]
    by_op = torch.zeros(blocks, heads, 2 * block_size, head_size, dtype=dtype)
    key_cache, value_cache = by_op.chunk(2, dim=2)
    shape = (len(slots), heads, head_size)
    ops.cpu_attn_reshape_and_cache(
        kv[0, 0].reshape(shape), kv[1, 0].reshape(shape), key_cache, value_cache, slots, isa
    )
    assert torch.equal(placed, by_op.view(blocks, -1))


# -- the worker's start-up checks -----------------------------------------------------------


class _Attention(torch.nn.Module):
    """A vLLM ``LlamaAttention``'s surface: fused QKV, RoPE of ``theta`` with ``pairing``."""

    def __init__(self, heads: int, kv_heads: int, head_size: int, theta: float, neox: bool):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = heads, kv_heads, head_size
        self.q_size, self.kv_size = heads * head_size, kv_heads * head_size
        self.scaling = head_size**-0.5
        self.qkv = torch.nn.Linear(heads * head_size, self.q_size + 2 * self.kv_size)
        self.out = torch.nn.Linear(self.q_size, heads * head_size)
        self.inv_freq, self.neox = rope_inv_freq(head_size, theta), neox

    def qkv_proj(self, x):
        return self.qkv(x), None

    def o_proj(self, x):
        return self.out(x), None

    def rotary_emb(self, positions, q, k):
        start = torch.zeros_like(positions)
        rotate = {"head_size": self.head_dim, "inv_freq": self.inv_freq}
        rotate["is_neox_style"] = self.neox
        return (
            rerotate_reference(q[None], start, positions, **rotate)[0],
            rerotate_reference(k[None], start, positions, **rotate)[0],
        )


def _vllm_llama(num_layers: int, *, theta: float = 10000.0, neox: bool = True):
    torch.manual_seed(0)
    heads, kv_heads, head_size = 4, 2, 16
    layers = [
        SimpleNamespace(
            self_attn=_Attention(heads, kv_heads, head_size, theta, neox),
            input_layernorm=torch.nn.Identity(),
            post_attention_layernorm=torch.nn.Identity(),
            mlp=torch.nn.Identity(),
        )
        for _ in range(num_layers)
    ]
    embed = torch.nn.Embedding(64, heads * head_size)
    return SimpleNamespace(model=SimpleNamespace(embed_tokens=embed, layers=layers))


_HF_CONFIG = SimpleNamespace(
    architectures=["LlamaForCausalLM"],
    rope_theta=10000.0,
    hidden_size=64,
    num_attention_heads=4,
    head_dim=16,
    max_position_embeddings=2048,
)


@pytest.mark.parametrize(
    "rotary",
    [
        {"rope_dim": 8},
        {"rope_dim": 8, "partial_rotary_factor": 0.5},
        {"partial_rotary_factor": 0.5},
    ],
    ids=["rope_dim", "rope_dim_wins", "partial_factor"],
)
def test_rope_spec_reads_the_rotary_dims_vllm_reads(rotary: dict) -> None:
    """vLLM's ``get_rope`` rotates ``rope_parameters['rope_dim']`` dims when the config
    gives them, else ``head_size * partial_rotary_factor``."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    params = {"rope_type": "default", "rope_theta": 10000.0, **rotary}
    config = SimpleNamespace(**{**vars(_HF_CONFIG), "head_dim": 32, "rope_parameters": params})
    with set_current_vllm_config(VllmConfig()):
        vllm_rope = get_rope(32, 2048, True, dict(params), torch.float32)
    spec = rope_spec(config)
    assert (spec.head_size, spec.rotary_dim) == (32, vllm_rope.rotary_dim)
    half = spec.rotary_dim // 2
    positions = torch.arange(2048, dtype=torch.float32)[:, None]
    cos = torch.cos(positions * spec.inv_freq[None])
    torch.testing.assert_close(cos, vllm_rope.cos_sin_cache[:, :half], rtol=0, atol=1e-5)


def _blend_worker(model, **keys) -> BlendWorker:
    config = KVTierConfig(enable_blending=True, max_local_cpu_size=0.01, **keys)
    storage = StorageManager(config, Stats(), pin_memory=False, namespace="m")
    key = CacheKey("m", 1, 0, "float32", b"")
    try:
        return BlendWorker(config, _HF_CONFIG, model, None, storage, key)
    finally:
        storage.close()


def test_worker_accepts_a_model_whose_rope_its_config_gives() -> None:
    worker = _blend_worker(_vllm_llama(2), blend_check_layers=[0, 1], blend_recompute_ratios=0.3)
    assert worker.schedule == [(0, 0.3), (1, 0.3)]


def test_check_layer_past_the_model_is_refused_at_start_up() -> None:
    """Not at the first blended request, inside vLLM's step."""
    with pytest.raises(ValueError, match=r"blend_check_layers: '0,2'.* 2 layers"):
        _blend_worker(_vllm_llama(2), blend_check_layers=[0, 2])


@pytest.mark.parametrize("model", [{"theta": 500000.0}, {"neox": False}], ids=["base", "gptj"])
def test_rope_the_config_does_not_describe_is_refused(model: dict) -> None:
    """A running model whose RoPE is not the one read from its config (base, pairing):
    re-rotated keys would be wrong, so the worker refuses to blend."""
    with pytest.raises(UnsupportedModelError, match="does not re-rotate the keys"):
        _blend_worker(_vllm_llama(1, **model))


def _unlike_llama(change: str):
    model = _vllm_llama(2)
    if change == "moe":  # Mixtral: the MLP is block_sparse_moe
        model.model.layers[1] = SimpleNamespace(
            **{k: v for k, v in vars(model.model.layers[1]).items() if k != "mlp"}
        )
    elif change == "embedding scale":  # Gemma
        model.model.normalizer = torch.tensor(8.0)
    elif change == "residual scale":  # Granite
        model.model.layers[0].residual_multiplier = 0.2
    return model


@pytest.mark.parametrize("change", ["moe", "embedding scale", "residual scale"])
def test_decoders_the_blend_would_drive_wrongly_are_refused(change: str) -> None:
    """Refused at start-up: not blended with the wrong arithmetic, nor failing inside
    vLLM's step at the first blend."""
    with pytest.raises(UnsupportedModelError, match="Llama-shaped layers"):
        _blend_worker(_unlike_llama(change))


# -- failures inside a blend ----------------------------------------------------------------


def _working_worker(**keys) -> tuple[BlendWorker, StorageManager]:
    """A ``BlendWorker`` over a token-major paged KV of 16 blocks of 4 (the caller closes
    the storage)."""
    keys = {"max_local_cpu_size": 0.01, **keys}
    config = KVTierConfig(enable_blending=True, kernel_backend="torch", **keys)
    storage = StorageManager(config, Stats(), pin_memory=False, namespace="m")
    paged = PagedKV.empty(
        "vllm_hnd",
        num_layers=2,
        num_blocks=16,
        block_size=4,
        num_heads=2,
        head_size=16,
        dtype=torch.float32,
    )
    key = CacheKey("m", 1, 0, "float32", b"")
    worker = BlendWorker(config, _HF_CONFIG, _vllm_llama(2), PagedTokens(paged, None), storage, key)
    return worker, storage


def _raise(*args, **kwargs):
    raise RuntimeError("injected")


@pytest.mark.parametrize("step", ["place_segments", "blend", "write"])
def test_a_blend_that_fails_reports_its_blocks_as_failed_loads(monkeypatch, step: str) -> None:
    """An error while placing, blending or writing into vLLM's blocks ends no step: the
    request's claimed blocks come back as failed loads (vLLM recomputes them)."""
    worker, storage = _working_worker()
    extension = BlendWorking(KVTierConfig(enable_blending=True), None)
    extension.worker = worker
    try:
        ok = BlendSpec("ok", list(range(1, 10)), [], [0, 1, 2])
        assert extension.before_forward([ok]) == set()
        if step == "write":
            monkeypatch.setattr(worker.tokens, "write", _raise)
        else:
            monkeypatch.setattr(vllm_worker, step, _raise)
        failed = BlendSpec("bad", list(range(1, 10)), [], [5, 6, 7, 8])  # 9 tokens: 3 blocks
        other = BlendSpec("bad2", list(range(1, 5)), [], [9, 10])  # 4 tokens: 1 block
        assert extension.before_forward([failed, other]) == {5, 6, 7, 9}
        counters = worker.stats.snapshot()
        assert counters["blend_requests"] == 1
        assert (counters["blend_failed_requests"], counters["blend_failed_blocks"]) == (2, 4)
    finally:
        storage.close()


def test_a_failed_blend_is_logged_once_per_cause_with_its_traceback(monkeypatch, caplog) -> None:
    worker, storage = _working_worker()

    def broken(*args, **kwargs):
        raise IndexError("a programming error")

    monkeypatch.setattr(vllm_worker, "blend", broken)
    try:
        with caplog.at_level("WARNING"):
            for req_id in ("a", "b", "c"):
                assert worker.run_or_report(BlendSpec(req_id, [1, 2, 3], [], [4])) == {4}
        logged = [r for r in caplog.records if "CacheBlend: blending request" in r.getMessage()]
        assert len(logged) == 1 and "IndexError" in logged[0].getMessage()
        assert logged[0].exc_info is not None and logged[0].exc_info[0] is IndexError
        assert worker.stats.snapshot()["blend_failed_requests"] == 3
    finally:
        storage.close()


def test_a_segment_store_that_fails_ends_no_step(monkeypatch) -> None:
    worker, storage = _working_worker()
    monkeypatch.setattr(worker.tokens, "read", _raise)
    try:
        worker.save(SegmentSaveSpec("r", [(0, 8, b"x" * 32), (9, 12, b"y" * 32)], [0, 1, 2, 3]))
        counters = worker.stats.snapshot()
        assert counters["blend_failed_segment_stores"] == 2
        assert "blend_stored_segments" not in counters
    finally:
        storage.close()


def test_a_segment_larger_than_the_cpu_pool_is_counted_and_warned_once(caplog) -> None:
    """A pool of about 20 KiB: a 12-token segment (6 KiB of KV) is stored, a 48-token one
    (24 KiB) never is."""
    worker, storage = _working_worker(max_local_cpu_size=2e-5)
    blocks = list(range(16))
    try:
        with caplog.at_level("WARNING"):
            worker.save(SegmentSaveSpec("r", [(0, 12, b"s" * 32)], blocks))
            for h in (b"a" * 32, b"b" * 32):
                worker.save(SegmentSaveSpec("r", [(0, 48, h)], blocks))
        counters = worker.stats.snapshot()
        assert counters["blend_stored_segments"] == 1
        assert counters["blend_skipped_too_large_segments"] == 2
        assert worker.held([b"s" * 32, b"a" * 32]) == [True, False]
        warned = [r for r in caplog.records if "larger than the whole CPU pool" in r.getMessage()]
        assert len(warned) == 1
    finally:
        storage.close()


@pytest.mark.parametrize("disk", [False, True], ids=["cpu", "cpu_and_disk"])
def test_a_segment_of_another_shape_is_a_miss_and_no_longer_held(tmp_path, disk) -> None:
    """A stored segment whose KV is not the shape its tokens need here is a miss, counted
    as a corrupt chunk and removed from every tier: otherwise every later prompt with that
    document would be claimed for it and miss it, and it would never be stored again."""
    tiers = {"local_disk": str(tmp_path), "max_local_disk_size": 0.01} if disk else {}
    worker, storage = _working_worker(**tiers)
    h = b"w" * 32
    try:
        # 4 tokens of 2 layers, but of 16 dims where this model's KV rows have 32
        assert worker.segments.put(h, torch.randn(2, 2, 4, 16), torch.arange(4))
        assert storage.flush(10.0) and worker.held([h]) == [True]
        spec = BlendSpec("r", list(range(1, 10)), [(0, 4, h)], [0, 1, 2])
        assert worker.run_or_report(spec) == set()
        counters = worker.stats.snapshot()
        assert counters["blend_segment_misses"] == 1 and counters["blend_reused_tokens"] == 0
        assert storage.stats.get(Counter.CORRUPT_CHUNKS) == 1
        assert worker.held([h]) == [False]  # the next prompt that computes it stores it again
    finally:
        storage.close()
