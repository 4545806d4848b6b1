"""Worker side of CacheBlend in the vLLM connector: blend with the running model, read and
write single tokens of vLLM's paged KV.

* ``VLLMDecoder`` drives a vLLM ``LlamaForCausalLM``-shaped model (``model.model``:
  ``embed_tokens``; per layer ``input_layernorm``, ``self_attn.qkv_proj`` /
  ``rotary_emb`` / ``o_proj``, ``post_attention_layernorm``, ``mlp``) as a
  :class:`~kvtier.blend.BlendModel`. It calls the modules, never their ``.weight``: on
  the CPU build a ``Linear`` may hold only a packed copy of its weight.
* ``PagedTokens`` reads and writes the KV of single tokens. Token-major layouts go
  through kvtier's paged gather/scatter. vLLM's CPU backend tiles each block per
  instruction set, so there the KV is written with vLLM's own
  ``cpu_attn_reshape_and_cache`` and read back through a map of where that op puts each
  (token, head, dim) of a block, found at start-up by letting the op write the indices
  themselves (base-256 digits, exact in every float dtype).
* ``BlendWorker`` executes a step's ``BlendSpec`` (before the forward pass) and
  ``SegmentSaveSpec`` (after it) and answers the scheduler's segment lookups.

NOTE: an error inside a blend never ends vLLM's step. A blend that fails is a failed
load (docs/reliability.md): the request's claimed blocks are reported to vLLM through
``get_block_ids_with_load_errors`` (vLLM recomputes them, or fails the request under
``kv_load_failure_policy: fail``); a segment store that fails stores nothing. Each is
counted and logged once per cause, with its traceback.

The model is reached from ``register_kv_caches``: vLLM calls it from its model runner's
``initialize_kv_cache`` once the model is loaded, and ``running_model`` walks up to that
runner and asks its ``get_model()``.
"""

from __future__ import annotations

import inspect
import logging
import math
import time
import traceback
from typing import Any

import torch

from kvtier.blend import (
    PlacedSegment,
    UnsupportedModelError,
    blend,
    check_rerotation,
    place_segments,
    rope_spec,
)
from kvtier.blend.segments import SegmentStore
from kvtier.blend.vllm_plan import BlendSpec, SegmentSaveSpec
from kvtier.config import KVTierConfig
from kvtier.config.blend import blend_schedule
from kvtier.integration.vllm.common import slot_mapping
from kvtier.keys import CacheKey
from kvtier.observability.stats import Stats
from kvtier.storage.manager import StorageManager
from kvtier.warn import warn_once
from kvtier_kernels import LayoutError, PagedKV
from kvtier_kernels.paged import gather, scatter

logger = logging.getLogger(__name__)

_DIGIT = 256  # every float dtype holds 0..255 exactly
# The start-up check of the RoPE read from the config against the running model's keys:
# positions it re-rotates to, and the relative squared error it accepts (float rounding
# is far below; another rotation is of order 1).
_ROPE_CHECK_POSITIONS = 4096
_ROPE_CHECK_TOLERANCE = 0.1


def _cause(error: BaseException) -> str:
    """Where ``error`` was raised (its type and innermost frame): a failure logged once."""
    frames = traceback.extract_tb(error.__traceback__)
    where = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
    return f"{type(error).__name__}{where}"


def running_model() -> Any:
    """The model of the vLLM model runner up the call stack (``register_kv_caches`` is
    called from its ``initialize_kv_cache``), or None."""
    frame = inspect.currentframe()
    while frame is not None:
        owner = frame.f_locals.get("self")
        get_model = getattr(owner, "get_model", None)
        if callable(get_model) and hasattr(owner, "initialize_kv_cache"):
            return get_model()
        frame = frame.f_back
    return None


class VLLMDecoder:
    """A vLLM Llama-shaped causal LM as a ``BlendModel`` (see the module docstring).

    Raises:
        UnsupportedModelError: the model lacks the modules named above.
    """

    def __init__(self, model: Any):
        decoder = getattr(model, "model", None)
        layers = getattr(decoder, "layers", None)
        attn = getattr(layers[0], "self_attn", None) if layers else None
        needed = ("qkv_proj", "rotary_emb", "o_proj", "q_size", "kv_size", "scaling")
        modules = ("self_attn", "input_layernorm", "post_attention_layernorm", "mlp")
        if (
            attn is None
            or not hasattr(decoder, "embed_tokens")
            or hasattr(decoder, "normalizer")  # Gemma scales its embeddings
            or not all(hasattr(layer, name) for layer in layers for name in modules)
            or any(hasattr(layer, "residual_multiplier") for layer in layers)
            or any(getattr(layer, "ada_rms_norm_t_cond", None) for layer in layers)
            or not all(hasattr(attn, name) for name in needed)
            or any(hasattr(attn, name) for name in ("q_norm", "k_norm"))
        ):
            raise UnsupportedModelError(
                f"enable_blending: CacheBlend cannot drive model class {type(model).__name__} "
                "in vLLM: it needs Llama-shaped layers (embed_tokens; per layer "
                "input_layernorm, self_attn.qkv_proj / rotary_emb / o_proj without q/k "
                "norms, post_attention_layernorm and a dense mlp) and hidden states that "
                "no multiplier scales"
            )
        self.decoder = decoder
        self.num_layers = len(layers)
        self.num_heads = attn.num_heads
        self.num_kv_heads = attn.num_kv_heads
        self.head_size = attn.head_dim
        self.scale = attn.scaling

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.decoder.embed_tokens(token_ids)

    def layer_qkv(self, layer: int, hidden: torch.Tensor, positions: torch.Tensor):
        block = self.decoder.layers[layer]
        attn = block.self_attn
        qkv, _ = attn.qkv_proj(block.input_layernorm(hidden))
        q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        # The CPU build's rotary op works in place: give it tensors of their own.
        q, k = attn.rotary_emb(positions, q.contiguous(), k.contiguous())
        return q, k, v.contiguous()

    def layer_output(self, layer: int, hidden: torch.Tensor, attention: torch.Tensor):
        block = self.decoder.layers[layer]
        out, _ = block.self_attn.o_proj(attention)
        hidden = hidden + out
        return hidden + block.mlp(block.post_attention_layernorm(hidden))


def cpu_block_map(
    num_heads: int, block_size: int, head_size: int, dtype: torch.dtype, isa: str
) -> torch.Tensor:
    """``[2, block_size, num_heads * head_size]`` int64: where in a block's flat storage
    (``[H, 2 * BS, D]`` elements) ``cpu_attn_reshape_and_cache`` puts the K (0) or V (1)
    of each (token offset, head, dim).

    Raises:
        LayoutError: the op does not place every element exactly once.
    """
    from vllm import _custom_ops as ops

    shape = (2, block_size, num_heads, head_size)
    numel = 2 * block_size * num_heads * head_size
    source = torch.arange(numel, dtype=torch.int64).view(shape)
    found = torch.zeros(numel, dtype=torch.int64)
    written = torch.ones(numel, dtype=torch.bool)
    place, slots = 1, torch.arange(block_size, dtype=torch.int64)
    while place < numel:
        digits = (source // place % _DIGIT).to(dtype)
        block = torch.full((1, num_heads, 2 * block_size, head_size), -1.0, dtype=dtype)
        key_cache, value_cache = block.chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(digits[0], digits[1], key_cache, value_cache, slots, isa)
        flat = block.flatten().to(torch.float64)
        written &= flat >= 0
        found += flat.clamp(min=0).to(torch.int64) * place
        place *= _DIGIT
    where = torch.full((numel,), -1, dtype=torch.int64)
    where[found] = torch.arange(numel)
    if not bool(written.all()) or bool((where < 0).any()):
        raise LayoutError(
            f"cpu_attn_reshape_and_cache (isa {isa!r}) does not place each element of a "
            f"block once: kvtier cannot address single tokens of this KV cache"
        )
    return where.view(2, block_size, num_heads * head_size)


class PagedTokens:
    """Token-level access to vLLM's KV (``[2, L, T, Hkv * D]`` canonical rows).

    Args:
        paged: the engine's KV as kvtier describes it.
        isa: vLLM's CPU attention ISA when the layout is the CPU backend's (not
            token-major); None otherwise.
    """

    def __init__(self, paged: PagedKV, isa: str | None):
        self.paged = paged
        self.isa = isa
        self.block_map: torch.Tensor | None = None
        if not paged.layout.token_major:
            if isa is None:
                raise LayoutError("enable_blending: vLLM's CPU attention ISA is unknown")
            self.block_map = cpu_block_map(
                paged.num_heads, paged.block_size, paged.head_size, paged.dtype, isa
            )

    def read(self, slots: torch.Tensor) -> torch.Tensor:
        """The KV of ``slots`` (``[T]`` int64, none negative)."""
        paged = self.paged
        out = paged.chunk_shape(slots.shape[0])
        if self.block_map is None:
            return gather(paged, slots, torch.empty(out, dtype=paged.dtype, device=paged.device))
        block, offset = slots // paged.block_size, slots % paged.block_size
        where = self.block_map[:, offset]  # [2, T, H * D]
        rows = []
        for tensor in paged.tensors:
            flat = tensor.view(tensor.shape[0], -1)
            rows.append(flat[block[None, :, None], where])
        return torch.stack(rows, dim=1)

    def write(self, slots: torch.Tensor, kv: torch.Tensor) -> None:
        """Write ``kv`` (``[2, L, T, Hkv * D]``) into ``slots`` (negative: skipped)."""
        paged = self.paged
        if self.block_map is None:
            scatter(paged, slots, kv.to(paged.dtype).contiguous())
            return
        from vllm import _custom_ops as ops

        h, bs, d = paged.num_heads, paged.block_size, paged.head_size
        for layer, tensor in enumerate(paged.tensors):
            key_cache, value_cache = tensor.view(tensor.shape[0], h, 2 * bs, d).chunk(2, dim=2)
            key = kv[0, layer].to(paged.dtype).reshape(-1, h, d).contiguous()
            value = kv[1, layer].to(paged.dtype).reshape(-1, h, d).contiguous()
            ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, self.isa)


class BlendWorker:
    """One rank's CacheBlend: blends, segment stores, segment lookups.

    Args:
        config: kvtier's config (the blend schedule).
        hf_config: the model's HF config (its RoPE).
        model: the running vLLM model.
        tokens: token-level access to the rank's KV.
        storage: the rank's tiers; ``key_template``: a chunk key of this rank.
    """

    def __init__(
        self,
        config: KVTierConfig,
        hf_config: Any,
        model: Any,
        tokens: PagedTokens,
        storage: StorageManager,
        key_template: CacheKey,
        stats: Stats | None = None,
    ):
        self.model = VLLMDecoder(model)
        self.schedule = blend_schedule(config)
        deepest = max(layer for layer, _ in self.schedule)
        if deepest >= self.model.num_layers:
            # NOTE: refused at start-up; blend() would raise it for the first blended
            # request, inside vLLM's step.
            raise ValueError(
                f"blend_check_layers: {config.blend_check_layers!r} names layer {deepest}, but "
                f"the model has {self.model.num_layers} layers (0 to "
                f"{self.model.num_layers - 1}); pick check layers below {self.model.num_layers}"
            )
        self.rope = rope_spec(hf_config)
        max_position = getattr(hf_config, "max_position_embeddings", None) or 4096
        error = check_rerotation(self.model, self.rope, min(max_position, _ROPE_CHECK_POSITIONS))
        if not error < _ROPE_CHECK_TOLERANCE:
            # NOTE: the RoPE read from the config is not the one the running model applies
            # (its rotary dims, pairing, base or scaling): re-rotated keys would be wrong.
            raise UnsupportedModelError(
                f"enable_blending: CacheBlend cannot blend model class {type(model).__name__}: "
                f"the RoPE read from its config (rotary dims {self.rope.rotary_dim} of "
                f"{self.rope.head_size}, {'NeoX' if self.rope.is_neox_style else 'GPT-J'} "
                f"pairing) does not re-rotate the keys its layers make (relative error "
                f"{error:.2g}); set enable_blending: false"
            )
        logger.info("kvtier CacheBlend: RoPE from the config checked (relative error %.2g)", error)
        self.tokens = tokens
        self.segments = SegmentStore(storage, key_template)
        self.stats = stats or Stats()

    def held(self, hashes: list[bytes]) -> list[bool]:
        return [self.segments.contains(h) for h in hashes]

    def _placed(self, spec: BlendSpec, width: int, dtype: torch.dtype) -> list[PlacedSegment]:
        placed = []
        for start, end, h in spec.segments:
            found = self.segments.get(h, (2, self.model.num_layers, end - start, width), dtype)
            if found is None:
                self.stats.inc("blend_segment_misses")
                continue  # NOTE: its tokens are computed afresh: still exact
            placed.append(PlacedSegment(found[0], found[1], start))
        return placed

    def run_or_report(self, spec: BlendSpec) -> set[int]:
        """Run ``spec`` (``run``). Returns the blocks of its claimed tokens when it failed
        (some may be written, none may be trusted): a failed load, counted and logged."""
        try:
            self.run(spec)
            return set()
        except Exception as error:
            blocks = spec.block_ids[: -(-len(spec.token_ids) // self.tokens.paged.block_size)]
            self.stats.inc("blend_failed_requests")
            self.stats.inc("blend_failed_blocks", len(blocks))
            warn_once(
                logger,
                f"kvtier CacheBlend: blending request {spec.req_id} failed ({error!r}); its "
                f"{len(blocks)} blocks are reported to vLLM as failed loads "
                "(kv_load_failure_policy). Later failures of this cause are only counted "
                "(blend_failed_requests)",
                key=f"blend failed: {_cause(error)}",
                exc_info=error,
            )
            return set(blocks)

    def run(self, spec: BlendSpec) -> None:
        """Blend the request's claimed tokens and write their KV into its blocks; what
        fails is raised (``run_or_report`` makes it a failed load)."""
        began = time.perf_counter()
        paged, model = self.tokens.paged, self.model
        num_tokens = len(spec.token_ids)
        width = model.num_kv_heads * model.head_size
        kv = torch.zeros(2, model.num_layers, num_tokens, width, dtype=paged.dtype)
        reused = torch.zeros(num_tokens, dtype=torch.bool)
        placed = self._placed(spec, width, paged.dtype)
        rotate_s = place_segments(kv, reused, placed, self.rope)
        result = blend(model, torch.tensor(spec.token_ids), kv, reused, self.schedule)
        self.tokens.write(slot_mapping(spec.block_ids, paged.block_size, num_tokens), result.kv)
        self.stats.inc("blend_requests")
        self.stats.inc("blend_reused_tokens", int(reused.sum()))
        self.stats.inc("blend_recomputed_tokens", int(result.recomputed.sum()))
        self.stats.inc("blend_seconds", result.seconds)
        self.stats.inc("blend_rope_seconds", rotate_s)
        # everything: segments read, placed, blended and written into vLLM's blocks
        self.stats.inc("blend_total_seconds", time.perf_counter() - began)
        if result.deviation and placed:
            # At the first check layer: how far the placed (re-rotated) KV was from the
            # KV computed there, and its size; at layer 0, where KV does not depend on
            # context, their ratio measures the read-back and re-rotation alone.
            first = min(result.deviation)
            self.stats.inc("blend_check_deviation", float(result.deviation[first].sum()))
            norm = sum(float(p.kv[:, first].float().pow(2).sum()) for p in placed)
            self.stats.inc("blend_check_norm", norm)

    def save(self, spec: SegmentSaveSpec) -> None:
        """Store the request's computed segments that no tier holds yet; one that fails
        is not stored (counted and logged), never an error in vLLM's step."""
        for start, end, h in spec.segments:
            try:
                self._save_segment(spec.block_ids, start, end, h)
            except Exception as error:
                self.stats.inc("blend_failed_segment_stores")
                warn_once(
                    logger,
                    f"kvtier CacheBlend: storing a segment of request {spec.req_id} failed "
                    f"({error!r}): not stored. Later failures of this cause are only "
                    "counted (blend_failed_segment_stores)",
                    key=f"segment store failed: {_cause(error)}",
                    exc_info=error,
                )

    def _save_segment(self, block_ids: list[int], start: int, end: int, h: bytes) -> None:
        if self.segments.contains(h):
            return
        paged = self.tokens.paged
        shape = tuple(paged.chunk_shape(end - start))
        if not self.segments.fits(shape, paged.dtype):
            self.stats.inc("blend_skipped_too_large_segments")
            nbytes = math.prod(shape) * paged.dtype.itemsize
            warn_once(
                logger,
                f"kvtier CacheBlend: a segment of {end - start} tokens ({nbytes / 2**20:.1f} "
                "MiB of KV) is larger than the whole CPU pool (max_local_cpu_size): such "
                "segments are never stored nor reused (blend_skipped_too_large_segments). "
                "Raise max_local_cpu_size, or split the documents with blend_special_str",
                key="blend segment larger than the CPU pool",
            )
            return
        kv = self.tokens.read(slot_mapping(block_ids, paged.block_size, end, start)[start:end])
        if self.segments.put(h, kv, torch.arange(start, end, dtype=torch.int64)):
            self.stats.inc("blend_stored_segments")
        else:  # NOTE: no room now, even after evicting; a later request stores it
            self.stats.inc("blend_skipped_no_memory_segments")
