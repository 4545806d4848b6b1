"""The two roles of ``KVTierConnector``, with everything each one wires up.

``SchedulerRole`` lives in vLLM's engine-core process: the planner (``SchedulerSide``),
the lookup client that asks every worker rank what its tiers hold, KV-event tracking, the
Prometheus endpoint and the failure policy. ``WorkerRole`` lives in each worker process:
its rank, the attention backend and layout of the KV it is handed, and the mover
(``WorkerSide``). The connector facade (``connector.py``) builds one of them and passes
each vLLM hook on in a line or two.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

import torch

from kvtier.config import KVTierConfig
from kvtier.engine import EngineMetadata
from kvtier.integration.vllm.blend import BlendWorker, PagedTokens, running_model
from kvtier.integration.vllm.blend_plan import BlendPlanner
from kvtier.integration.vllm.events import KVEventTracker, KVTierKVEvents, rank_events
from kvtier.integration.vllm.rpc import RpcClient, endpoint_for
from kvtier.integration.vllm.scheduler import SchedulerSide, StepPlan
from kvtier.integration.vllm.worker import WorkerSide
from kvtier.prometheus import MetricsServer
from kvtier_kernels import LAYOUTS

if TYPE_CHECKING:
    from collections.abc import Iterable

    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent

logger = logging.getLogger(__name__)


class SchedulerRole:
    """The engine-core side: plans loads and stores, asks the workers' tiers.

    Attributes:
        plan: the planner vLLM's scheduler hooks go to.
    """

    def __init__(self, config: KVTierConfig, vllm_config: VllmConfig):
        transfer = vllm_config.kv_transfer_config
        block_size = vllm_config.cache_config.block_size
        endpoints = [
            endpoint_for(_engine_tag(vllm_config), rank) for rank in range(_world(vllm_config))
        ]
        self._client = RpcClient(endpoints, config.lookup_timeout_ms / 1000)
        self.plan = SchedulerSide(
            config,
            self._lookup,
            can_load=transfer.is_kv_consumer,
            can_save=transfer.is_kv_producer,
            block_size=block_size,
            whole_blocks=not _token_major_layout(config),
            partial_chunks=_partial_chunks(config, transfer.kv_role),
        )
        self.blend: BlendPlanner | None = None
        if config.enable_blending:
            self.blend = BlendPlanner(
                config,
                _separator_ids(vllm_config, config.blend_special_str),
                self._lookup_segments,
                can_load=transfer.is_kv_consumer,
                can_save=transfer.is_kv_producer,
            )
        self._events: KVEventTracker | None = None
        if _kv_events_enabled(vllm_config):
            self._events = KVEventTracker(_world(vllm_config), config.chunk_size, block_size)
            self.plan.chunk_observer = self._events.record_chunks
        self._metrics_client: RpcClient | None = None
        self._metrics = self._serve_metrics(config, endpoints, vllm_config)
        if transfer.kv_load_failure_policy != config.kv_load_failure_policy:
            # NOTE: by default a chunk kvtier cannot load is recomputed, never a failed
            # request; vLLM's own default is "fail", so kvtier's key decides (vLLM reads
            # this after building the scheduler's connector).
            logger.info(
                "kvtier: kv_load_failure_policy set to %r (kvtier's kv_load_failure_policy)",
                config.kv_load_failure_policy,
            )
            transfer.kv_load_failure_policy = config.kv_load_failure_policy

    def _lookup(self, hashes: list[bytes]) -> int:
        """Leading chunks every worker rank holds (0 when any rank is late or fails)."""
        replies = self._client.call_all("lookup", hashes=hashes)
        if replies is None:
            return 0
        return min(int(reply.get("hits", 0)) for reply in replies)

    def _lookup_segments(self, hashes: list[bytes]) -> list[bool]:
        """Which CacheBlend segments every worker rank holds (none when a rank fails)."""
        replies = self._client.call_all("blend_lookup", hashes=hashes)
        if replies is None:
            return [False] * len(hashes)
        held = [list(reply.get("held", ())) for reply in replies]
        return [all(len(h) == len(hashes) and h[i] for h in held) for i in range(len(hashes))]

    # -- vLLM's scheduler hooks: the planner, then CacheBlend ------------------------

    def matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens kvtier can provide: a prefix hit, else (with blending) a blend claim."""
        hit = self.plan.get_num_new_matched_tokens(request, num_computed_tokens)
        if self.blend is not None and hit == (0, False):
            claimed = self.blend.claim(request, num_computed_tokens)
            if claimed > num_computed_tokens:
                return claimed - num_computed_tokens, False
        return hit

    def after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        self.plan.update_state_after_alloc(request, block_ids, num_external_tokens)
        if self.blend is not None and self.blend.after_alloc(
            request, block_ids, num_external_tokens
        ):
            # NOTE: a blended prompt's KV is approximate: never stored as prefix chunks.
            self.plan.trackers[request.request_id].saved_upto = len(request.all_token_ids)

    def build_plan(self, scheduler_output: Any) -> StepPlan:
        preempted = getattr(scheduler_output, "preempted_req_ids", None)
        self.plan.on_preempted(preempted)
        plan = self.plan.build_plan(scheduler_output)
        if self.blend is not None:
            self.blend.on_preempted(preempted)
            trackers = self.plan.trackers
            self.blend.extend(
                plan,
                scheduler_output,
                lambda req_id: list(trackers[req_id].block_ids) if req_id in trackers else [],
            )
        return plan

    def request_finished(self, request: Any) -> None:
        self.plan.request_finished(request)
        if self.blend is not None:
            self.blend.request_finished(request)

    def _serve_metrics(
        self, config: KVTierConfig, endpoints: list[str], vllm_config: VllmConfig
    ) -> MetricsServer | None:
        """The Prometheus endpoint (``metrics_port``), served from this process: each
        scrape asks every worker rank for its metrics over the lookup sockets."""
        if config.metrics_port is None:
            return None
        client = self._metrics_client = RpcClient(endpoints, config.lookup_timeout_ms / 1000)
        lock = threading.Lock()  # one scrape at a time on the client's sockets

        def sources() -> list[dict]:
            own = {"labels": {"rank": "scheduler"}, "counters": self.counters()}
            with lock:
                replies = client.call_all("metrics")
            if replies is None:
                logger.warning("kvtier metrics: a worker rank did not answer; serving partial")
                replies = []
            return [own, *replies]

        dp_rank = getattr(vllm_config.parallel_config, "data_parallel_rank", 0) or 0
        port = config.metrics_port + dp_rank if config.metrics_port else 0
        return MetricsServer(config.metrics_host, port, sources)

    def counters(self) -> dict[str, float]:
        """This process's own counters: lookups (once for all ranks) and KV events."""
        counters: dict[str, float] = {
            "lookup_tokens": self.plan.lookup_tokens,
            "lookup_hit_tokens": self.plan.lookup_hit_tokens,
            "pd_waits": self.plan.pd_waits,
        }
        if self._events is not None:
            counters.update(self._events.counters)
        if self.blend is not None:
            counters.update(self.blend.counters())
        return counters

    def add_worker_events(self, events: Any) -> None:
        """The workers' tier records of a step (``KVTierKVEvents``), for KV events."""
        if self._events is not None and isinstance(events, KVTierKVEvents):
            self._events.add(events.get_all_events())

    def take_events(self) -> Iterable[KVCacheEvent]:
        """kvtier's ``BlockStored`` / ``BlockRemoved`` events since the last call."""
        return self._events.take() if self._events is not None else ()

    def clear_tiers(self) -> bool:
        """Empty every rank's tiers; False when a rank did not answer."""
        return self._client.call_all("clear") is not None

    def close(self) -> None:
        if self._metrics is not None:
            self._metrics.close()
        for client in (self._client, self._metrics_client):
            if client is not None:
                client.close()


class WorkerRole:
    """A worker process's side: its rank and KV layout, and the mover.

    Attributes:
        mover: the ``WorkerSide`` vLLM's worker hooks go to.
    """

    def __init__(self, config: KVTierConfig, vllm_config: VllmConfig):
        self._vllm_config = vllm_config
        self.config = config
        self.blend: BlendWorker | None = None
        rank = _worker_rank(vllm_config)
        model_name = config.model_name or str(vllm_config.model_config.model)
        metadata = EngineMetadata(model_name, _world(vllm_config), rank)
        producer = vllm_config.kv_transfer_config.kv_role == "kv_producer"
        self.mover = WorkerSide(
            config,
            metadata,
            endpoint_for(_engine_tag(vllm_config), rank),
            record_events=_kv_events_enabled(vllm_config),
            wait_stored_s=config.producer_store_timeout_ms / 1000 if producer else 0.0,
        )

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Find the layers' attention backend and layout, then hand the KV to the mover
        (and, with blending, the running model and the KV to the blend worker)."""
        backend = _attention_backend(self._vllm_config, kv_caches)
        self.mover.register_kv_caches(
            kv_caches,
            backend,
            _layout_tags(self._vllm_config, backend),
            handlers={"blend_lookup": self._serve_blend_lookup},
        )
        if self.config.enable_blending:
            self.blend = self._blend_worker(backend)

    def _blend_worker(self, backend: str | None) -> BlendWorker:
        model = running_model()
        if model is None:
            raise RuntimeError(
                "enable_blending: kvtier could not reach the model from register_kv_caches "
                "(no model runner with get_model() up the call stack)"
            )
        engine = self.mover.engine
        assert engine is not None and engine.connector is not None
        paged = engine.connector.paged
        if _world(self._vllm_config) > 1 or paged.device.type != "cpu":
            # NOTE: the blend has run only in one CPU worker: refused elsewhere, never
            # tried on a device or a parallel layout no test has seen.
            raise ValueError(
                "enable_blending: kvtier's vLLM connector blends on the CPU backend with "
                f"one worker only; this engine has {_world(self._vllm_config)} ranks and its "
                f"KV on {paged.device}; set enable_blending: false"
            )
        isa = _cpu_attn_isa(self._vllm_config) if backend == "CPU_ATTN" else None
        return BlendWorker(
            self.config,
            self._vllm_config.model_config.hf_config,
            model,
            PagedTokens(paged, isa),
            engine.storage,
            engine.token_db.key_template,
            self.mover.stats,
        )

    def _serve_blend_lookup(self, args: dict) -> dict:
        hashes = list(args["hashes"])
        return {"held": self.blend.held(hashes) if self.blend else [False] * len(hashes)}

    def start_load(self, plan: StepPlan) -> None:
        """Before the forward pass: the step's loads, then its blends."""
        self.mover.start_load(plan)
        if self.blend is not None:
            for spec in plan.blends:
                self.blend.run(spec)

    def wait_for_save(self, plan: StepPlan | None) -> None:
        """After the forward pass: the step's segment stores, then its saves."""
        if self.blend is not None and plan is not None:
            for spec in plan.segment_saves:
                self.blend.save(spec)
        self.mover.wait_for_save()

    def take_events(self) -> KVTierKVEvents | None:
        """This rank's tier records since the last step (None: none, or events off)."""
        return rank_events(self.mover.metadata.rank, self.mover.take_tier_events())

    def close(self) -> None:
        self.mover.shutdown()


def _engine_tag(vllm_config: VllmConfig) -> str:
    parallel = vllm_config.parallel_config
    engine_id = vllm_config.kv_transfer_config.engine_id or "engine"
    return f"{engine_id}-dp{getattr(parallel, 'data_parallel_rank', 0) or 0}"


def _world(vllm_config: VllmConfig) -> int:
    parallel = vllm_config.parallel_config
    return parallel.tensor_parallel_size * parallel.pipeline_parallel_size


def _partial_chunks(config: KVTierConfig, kv_role: str | None) -> bool:
    """Whether a prompt's partial last chunk is stored and looked up: ``save_unfull_chunk``,
    which defaults to on for both sides of disaggregated prefill (as in LMCache), so the
    consumer loads all of the prompt but its last token."""
    if config.source_of("save_unfull_chunk") == "default" and kv_role in (
        "kv_producer",
        "kv_consumer",
    ):
        return True
    return config.save_unfull_chunk


def _kv_events_enabled(vllm_config: VllmConfig) -> bool:
    """Whether vLLM publishes KV events (``kv_events_config.enable_kv_cache_events``)."""
    events = getattr(vllm_config, "kv_events_config", None)
    return bool(events is not None and events.enable_kv_cache_events)


def _worker_rank(vllm_config: VllmConfig) -> int:
    """This worker's rank among the engine's ``tp * pp`` ranks."""
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        tp = vllm_config.parallel_config.tensor_parallel_size
        return get_pp_group().rank_in_group * tp + get_tp_group().rank_in_group
    except (ImportError, AssertionError, AttributeError):
        if _world(vllm_config) > 1:
            raise
        return 0


def _token_major_layout(config: KVTierConfig) -> bool:
    """Whether the workers' KV layout addresses single tokens inside a block (decided in
    the scheduler process, which has no KV tensors: by the forced layout or the platform)."""
    if config.kv_layout is not None:
        return LAYOUTS[config.kv_layout].token_major
    from vllm.platforms import current_platform

    return not current_platform.is_cpu()


def _layout_tags(vllm_config: VllmConfig, backend: str | None) -> tuple[tuple[str, str], ...]:
    """Key tags for chunks whose bytes depend on more than model and dtype: the CPU
    backend tiles blocks per instruction set, so its chunks carry that ISA."""
    if backend != "CPU_ATTN":
        return ()
    isa = _cpu_attn_isa(vllm_config)
    if isa is None:
        import platform

        isa = f"unknown-{platform.machine()}"
    return (("cpu_attn_isa", isa),)


def _cpu_attn_isa(vllm_config: VllmConfig) -> str | None:
    """The instruction set vLLM's CPU attention uses for this model (None: unknown)."""
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        return str(
            _get_attn_isa(
                vllm_config.model_config.dtype,
                vllm_config.cache_config.block_size,
                vllm_config.model_config.get_head_size(),
                vllm_config.cache_config.cache_dtype,
            )
        )
    except Exception:
        return None


def _separator_ids(vllm_config: VllmConfig, text: str) -> list[int]:
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
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    if not ids:
        raise ValueError(f"blend_special_str: {text!r} tokenizes to no tokens")
    return ids


def _attention_backend(vllm_config: VllmConfig, kv_caches: dict[str, torch.Tensor]) -> str | None:
    """Name of the attention backend of the layers in ``kv_caches`` (None if unknown)."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

        backends = get_current_attn_backends(vllm_config, list(kv_caches))
    except Exception:
        logger.warning("kvtier: could not ask vLLM for the attention backend", exc_info=True)
        return None
    names = {backend.get_name() for backend in backends}
    if len(names) != 1:
        raise ValueError(f"kvtier needs one attention backend for every layer; got {sorted(names)}")
    return names.pop()
