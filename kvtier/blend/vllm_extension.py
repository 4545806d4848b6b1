"""CacheBlend as an extension of the vLLM connector (docs/cacheblend.md): on the scheduler
side ``vllm_plan.BlendPlanner`` claims blendable prompts and plans segment stores; on
each worker ``vllm_worker.BlendWorker`` blends before the forward pass and stores
segments after it. ``kvtier.integration.vllm.extensions`` registers this module.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from kvtier.blend.model_spec import check_blendable
from kvtier.blend.vllm_plan import PLAN_KEY, BlendPlanner, BlendSpec, SegmentSaveSpec
from kvtier.blend.vllm_worker import BlendWorker, PagedTokens, running_model
from kvtier.config import KVTierConfig
from kvtier.integration.vllm import facts
from kvtier.integration.vllm.common import (
    RankContext,
    SchedulerExtension,
    StepPlan,
    WorkerExtension,
    held_by_every_rank,
)

logger = logging.getLogger(__name__)

# kv_cache_dtype values that store K and V as floats (no scales): the blend writes them.
_FLOAT_CACHE_DTYPES = ("auto", "None", "float32", "float", "float16", "half", "bfloat16")

if TYPE_CHECKING:
    from collections.abc import Callable

    from vllm.config import VllmConfig

    from kvtier.integration.vllm.rpc import RpcClient


class BlendScheduling(SchedulerExtension):
    """The scheduler's hooks, passed to a ``BlendPlanner``."""

    name = PLAN_KEY

    def __init__(self, planner: BlendPlanner):
        self.planner = planner

    def claim(self, request: Any, num_computed_tokens: int) -> int:
        claimed = self.planner.claim(request, num_computed_tokens)
        return claimed - num_computed_tokens if claimed > num_computed_tokens else 0

    def after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int) -> bool:
        return self.planner.after_alloc(request, block_ids, num_external_tokens)

    def extend_plan(
        self, plan: StepPlan, scheduler_output: Any, block_ids: Callable[[str], list[int]]
    ) -> None:
        self.planner.extend(plan, scheduler_output, block_ids)

    def on_preempted(self, req_ids: set[str]) -> None:
        self.planner.on_preempted(req_ids)

    def request_finished(self, request: Any) -> None:
        self.planner.request_finished(request)

    def counters(self) -> dict[str, float]:
        return self.planner.counters()


class BlendWorking(WorkerExtension):
    """A rank's hooks: builds its ``BlendWorker`` once the KV cache is registered."""

    name = PLAN_KEY

    def __init__(self, config: KVTierConfig, vllm_config: VllmConfig):
        self.config = config
        self.vllm_config = vllm_config
        self.worker: BlendWorker | None = None

    def attach(self, rank: RankContext) -> None:
        engine = rank.engine
        model = running_model()
        if model is None:
            raise RuntimeError(
                "enable_blending: kvtier could not reach the model from register_kv_caches "
                "(no model runner with get_model() up the call stack)"
            )
        assert engine.paged_io is not None
        paged = engine.paged_io.paged
        world = facts.world_size(self.vllm_config)
        if world > 1 or paged.device.type != "cpu":
            # NOTE: the blend has run only in one CPU worker: refused elsewhere, never
            # tried on a device or a parallel layout no test has seen.
            raise ValueError(
                "enable_blending: kvtier's vLLM connector blends on the CPU backend with "
                f"one worker only; this engine has {world} ranks and its KV on "
                f"{paged.device}; set enable_blending: false"
            )
        isa = facts.cpu_attn_isa(self.vllm_config) if rank.backend == "CPU_ATTN" else None
        self.worker = BlendWorker(
            self.config,
            self.vllm_config.model_config.hf_config,
            model,
            PagedTokens(paged, isa),
            engine.storage,
            engine.chunker.key_template,
            rank.stats,
        )

    def handlers(self) -> dict[str, Callable[[dict], dict]]:
        return {"blend_lookup": self._serve_lookup}

    def _serve_lookup(self, args: dict) -> dict:
        hashes = list(args["hashes"])
        return {"held": self.worker.held(hashes) if self.worker else [False] * len(hashes)}

    def before_forward(self, specs: list) -> set[int]:
        failed: set[int] = set()
        for spec in specs:
            if isinstance(spec, BlendSpec) and self.worker is not None:
                failed |= self.worker.run_or_report(spec)
        return failed

    def after_forward(self, specs: list) -> None:
        for spec in specs:
            if isinstance(spec, SegmentSaveSpec) and self.worker is not None:
                self.worker.save(spec)


def check(config: KVTierConfig, vllm_config: VllmConfig) -> None:
    """Refuse a model CacheBlend cannot blend (an ``UnsupportedModelError`` naming its
    class), and engine features the blend does not take into account (a ``ValueError``)."""
    check_blendable(vllm_config.model_config.hf_config)
    # NOTE: the blend runs the base model's own layers over its own KV in the model's
    # dtype: a LoRA adapter's layers need vLLM's per-batch adapter mapping, a drafter
    # has KV layers of its own, and a quantized KV cache holds scaled fp8 bytes.
    cache_dtype = str(getattr(getattr(vllm_config, "cache_config", None), "cache_dtype", "auto"))
    unsupported = [
        name
        for name, present in (
            ("LoRA (enable_lora)", getattr(vllm_config, "lora_config", None) is not None),
            (
                "speculative decoding (speculative_config)",
                getattr(vllm_config, "speculative_config", None) is not None,
            ),
            (f"kv_cache_dtype {cache_dtype!r}", cache_dtype not in _FLOAT_CACHE_DTYPES),
        )
        if present
    ]
    if unsupported:
        raise ValueError(
            "enable_blending: kvtier's CacheBlend does not blend with "
            + ", ".join(unsupported)
            + "; turn it off, or set enable_blending: false"
        )


def scheduler_extension(
    config: KVTierConfig, vllm_config: VllmConfig, client: RpcClient
) -> BlendScheduling:
    transfer = vllm_config.kv_transfer_config

    def lookup_segments(hashes: list[bytes]) -> list[bool]:
        """Which segments every worker rank holds (none when a rank fails)."""
        return held_by_every_rank(client.call_all("blend_lookup", hashes=hashes), len(hashes))

    planner = BlendPlanner(
        config,
        separator_ids(vllm_config, config.blend_special_str),
        lookup_segments,
        can_load=transfer.is_kv_consumer,
        can_save=transfer.is_kv_producer,
    )
    return BlendScheduling(planner)


def worker_extension(config: KVTierConfig, vllm_config: VllmConfig) -> BlendWorking:
    return BlendWorking(config, vllm_config)


def separator_ids(vllm_config: VllmConfig, text: str) -> list[int]:
    """``blend_special_str`` in the model's tokenizer, without special tokens.

    Raises:
        ValueError: the tokenizer cannot be loaded, or the text tokenizes to nothing.
    """
    model_config = vllm_config.model_config
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(
            model_config.tokenizer,
            revision=getattr(model_config, "tokenizer_revision", None),
            trust_remote_code=bool(getattr(model_config, "trust_remote_code", False)),
        )
    except Exception as error:
        raise ValueError(
            f"enable_blending: cannot load the tokenizer of {model_config.tokenizer!r} to "
            f"tokenize blend_special_str: {error}"
        ) from error
    return separator_tokens(tokenizer, text)


def separator_tokens(tokenizer: Any, text: str) -> list[int]:
    """``text`` in ``tokenizer`` without special tokens; a warning when those tokens are
    not the ones it gets between words (a SentencePiece tokenizer makes a trailing space a
    token of its own): prompts sent as text are then never split at it.

    Raises:
        ValueError: the text tokenizes to nothing.
    """
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    if not ids:
        raise ValueError(f"blend_special_str: {text!r} tokenizes to no tokens")
    inside = list(tokenizer.encode(f"x{text}x", add_special_tokens=False))
    if not any(inside[i : i + len(ids)] == ids for i in range(len(inside) - len(ids) + 1)):
        logger.warning(
            "kvtier CacheBlend: blend_special_str %r tokenizes to %s on its own but to %s "
            "between words (%r): prompts sent as text will not be split at it. Send prompts "
            "as token ids with %s between the segments, or pick a separator whose tokens "
            "stay the same in text",
            text,
            ids,
            inside,
            f"x{text}x",
            ids,
        )
    return ids
