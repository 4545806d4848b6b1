"""``KVTierConnector``: kvtier behind vLLM's ``KVConnectorBase_V1``.

vLLM builds two instances: one with the SCHEDULER role in the engine-core process (it
decides what to load and save: ``scheduler.SchedulerSide``) and one with the WORKER role
in each worker process (it moves the KV: ``worker.WorkerSide``). The scheduler learns what
the workers' tiers hold through a local RPC socket per rank (``rpc``): a lookup that fails
or takes longer than ``lookup_timeout_ms`` is a miss. With tensor or pipeline parallelism
every rank stores its own shard, and a chunk counts as a hit only when every rank has it.

With vLLM's ``kv_events_config`` enabled, what kvtier's CPU tier stores and drops comes
out of vLLM's KV event stream as ``BlockStored`` / ``BlockRemoved`` events (``events``).

Supported vLLM: the V1 connector API with the 3-argument constructor
``(vllm_config, role, kv_cache_config)`` (vLLM 0.32 and 0.33).
"""

from __future__ import annotations

import inspect
import logging
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvtier.config import KVTierConfig, load_config
from kvtier.engine import EngineMetadata
from kvtier.integration.vllm.events import KVEventTracker, KVTierKVEvents, rank_events
from kvtier.integration.vllm.rpc import RpcClient, endpoint_for
from kvtier.integration.vllm.scheduler import SchedulerSide, StepPlan
from kvtier.integration.vllm.worker import WorkerSide
from kvtier.prometheus import MetricsServer
from kvtier_kernels import LAYOUTS

try:
    import vllm
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
except ImportError as error:  # pragma: no cover - depends on the installed vLLM
    raise ImportError(
        "kvtier's vLLM connector needs vLLM with the V1 KV connector API "
        f"(vLLM 0.32 or 0.33): {error}"
    ) from error

if "kv_cache_config" not in inspect.signature(KVConnectorBase_V1.__init__).parameters:
    raise ImportError(
        f"kvtier's vLLM connector supports vLLM 0.32 and 0.33; the installed vLLM "
        f"{getattr(vllm, '__version__', '?')} has a KVConnectorBase_V1 without the "
        "(vllm_config, role, kv_cache_config) constructor"
    )

if TYPE_CHECKING:
    from collections.abc import Iterable

    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

# vLLM configures only its own loggers: give kvtier's a handler so its start-up lines
# (the config in effect, the layout found) show in the engine's log.
_kvtier_logger = logging.getLogger("kvtier")
if not _kvtier_logger.handlers and not logging.getLogger().handlers:
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("(kvtier) %(levelname)s %(asctime)s %(message)s"))
    _kvtier_logger.addHandler(_handler)
    _kvtier_logger.setLevel(logging.INFO)


class KVTierConnectorMetadata(KVConnectorMetadata):
    """One step's plan, sent from the scheduler to every worker."""

    def __init__(self, plan: StepPlan):
        self.plan = plan


@dataclass
class KVTierConnectorStats(KVConnectorStats):
    """Counters for one reporting interval (deltas), summed across workers.

    ``data`` maps counter names (``kvtier.metrics.Counter``) to amounts; ``reduce`` adds
    the rates computed from measured time (``store_gbps``, ``load_gbps``).
    """

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVTierConnectorStats:
        for name, value in (other.data or {}).items():
            self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        out = {name: round(value, 6) for name, value in sorted(self.data.items())}
        for what, nbytes, seconds in (
            ("store", "stored_bytes", "store_seconds"),
            ("load", "loaded_bytes", "load_seconds"),
        ):
            if self.data.get(seconds):
                out[f"{what}_gbps"] = round(self.data.get(nbytes, 0) / self.data[seconds] / 1e9, 3)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())


def kvtier_config_from_vllm(vllm_config: VllmConfig) -> KVTierConfig:
    """kvtier's config from ``kv_connector_extra_config`` (which may name a YAML file
    with ``config_file``), ``KVTIER_*`` variables and defaults."""
    extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
    return load_config(overrides=extra)


def _engine_tag(vllm_config: VllmConfig) -> str:
    parallel = vllm_config.parallel_config
    engine_id = vllm_config.kv_transfer_config.engine_id or "engine"
    return f"{engine_id}-dp{getattr(parallel, 'data_parallel_rank', 0) or 0}"


def _world(vllm_config: VllmConfig) -> int:
    parallel = vllm_config.parallel_config
    return parallel.tensor_parallel_size * parallel.pipeline_parallel_size


def _kv_events_enabled(vllm_config: VllmConfig) -> bool:
    """Whether vLLM publishes KV events (``kv_events_config.enable_kv_cache_events``)."""
    events = getattr(vllm_config, "kv_events_config", None)
    return bool(events is not None and events.enable_kv_cache_events)


class KVTierConnector(KVConnectorBase_V1):
    """kvtier as a vLLM KV connector (see the module docstring)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        groups = getattr(kv_cache_config, "kv_cache_groups", None)
        if groups is not None and len(groups) > 1:
            raise ValueError(
                f"kvtier supports models with one KV cache group; this model has "
                f"{len(groups)} (hybrid attention)"
            )
        self.kvtier_config = config = kvtier_config_from_vllm(vllm_config)
        model_name = config.model_name or str(vllm_config.model_config.model)
        transfer = self._kv_transfer_config
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._client: RpcClient | None = None
        self._last_stats: dict[str, float] = {}
        self._metrics: MetricsServer | None = None
        self._metrics_client: RpcClient | None = None
        self._events: KVEventTracker | None = None
        events_on = _kv_events_enabled(vllm_config)
        tag = _engine_tag(vllm_config)
        if role == KVConnectorRole.SCHEDULER:
            endpoints = [endpoint_for(tag, rank) for rank in range(_world(vllm_config))]
            self._client = RpcClient(endpoints, config.lookup_timeout_ms / 1000)
            self._scheduler = SchedulerSide(
                config,
                self._lookup,
                can_load=transfer.is_kv_consumer,
                can_save=transfer.is_kv_producer,
                block_size=vllm_config.cache_config.block_size,
                whole_blocks=not _token_major_layout(config),
            )
            if events_on:
                self._events = KVEventTracker(
                    _world(vllm_config), config.chunk_size, vllm_config.cache_config.block_size
                )
                self._scheduler.chunk_observer = self._events.record_chunks
            self._metrics = self._serve_metrics(config, endpoints, vllm_config)
            if transfer.kv_load_failure_policy != "recompute":
                # NOTE: a chunk kvtier cannot load is a cache miss, never a failed
                # request; vLLM reads this after building the scheduler's connector.
                logger.info("kvtier: kv_load_failure_policy set to 'recompute'")
                transfer.kv_load_failure_policy = "recompute"
        else:
            rank = _worker_rank(vllm_config)
            metadata = EngineMetadata(model_name, _world(vllm_config), rank)
            self._worker = WorkerSide(
                config, metadata, endpoint_for(tag, rank), record_events=events_on
            )
        logger.info("kvtier connector (%s role): %s", role.name.lower(), config.summary())
        logger.debug("kvtier config in effect:\n%s", config.describe())

    # -- scheduler side --------------------------------------------------------------

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
            own = {"labels": {"rank": "scheduler"}, "counters": self._scheduler_counters()}
            with lock:
                replies = client.call_all("metrics")
            if replies is None:
                logger.warning("kvtier metrics: a worker rank did not answer; serving partial")
                replies = []
            return [own, *replies]

        dp_rank = getattr(vllm_config.parallel_config, "data_parallel_rank", 0) or 0
        port = config.metrics_port + dp_rank if config.metrics_port else 0
        return MetricsServer(config.metrics_host, port, sources)

    def _scheduler_counters(self) -> dict[str, float]:
        """The scheduler process's own counters: lookups and KV events."""
        scheduler = self._scheduler
        counters: dict[str, float] = {
            "lookup_tokens": scheduler.lookup_tokens if scheduler else 0,
            "lookup_hit_tokens": scheduler.lookup_hit_tokens if scheduler else 0,
        }
        if self._events is not None:
            counters.update(self._events.counters)
        return counters

    def _lookup(self, hashes: list[bytes]) -> int:
        assert self._client is not None
        replies = self._client.call_all("lookup", hashes=hashes)
        if replies is None:
            return 0
        return min(int(reply.get("hits", 0)) for reply in replies)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self._scheduler is not None
        block_ids = blocks.get_block_ids()[0] if blocks is not None else []
        self._scheduler.update_state_after_alloc(request, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        self._scheduler.on_preempted(getattr(scheduler_output, "preempted_req_ids", None))
        return KVTierConnectorMetadata(self._scheduler.build_plan(scheduler_output))

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        # Saves complete within the step that computed the KV, so blocks can go now.
        assert self._scheduler is not None
        self._scheduler.request_finished(request)
        return False, None

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """The workers' output of a step: merge their tier records (KV events)."""
        events = connector_output.kv_cache_events
        if self._events is not None and isinstance(events, KVTierKVEvents):
            self._events.add(events.get_all_events())

    def take_events(self) -> Iterable[KVCacheEvent]:
        """kvtier's ``BlockStored`` / ``BlockRemoved`` events since the last call."""
        return self._events.take() if self._events is not None else ()

    def reset_cache(self) -> bool | None:
        """``reset_prefix_cache(reset_connector=True)``: empty every rank's tiers."""
        if self._client is None:
            return None
        return self._client.call_all("clear") is not None

    # -- worker side -----------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        backend = _attention_backend(self._vllm_config, kv_caches)
        self._worker.register_kv_caches(
            kv_caches, backend, _layout_tags(self._vllm_config, backend)
        )

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._worker is not None
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, KVTierConnectorMetadata)
        self._worker.start_load(metadata.plan)

    def wait_for_layer_load(self, layer_name: str) -> None:
        assert self._worker is not None
        self._worker.wait_for_layer_load(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        assert self._worker is not None
        self._worker.save_layer(layer_name)

    def wait_for_save(self) -> None:
        assert self._worker is not None
        self._worker.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        assert self._worker is not None
        loaded = self._worker.get_finished()
        return None, (loaded or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self._worker is not None
        return self._worker.take_load_errors()

    def get_kv_connector_kv_cache_events(self) -> KVTierKVEvents | None:
        """This rank's tier records since the last step (None: none, or events off)."""
        if self._worker is None:
            return None
        return rank_events(self._worker.metadata.rank, self._worker.take_tier_events())

    def get_kv_connector_stats(self) -> KVTierConnectorStats | None:
        if self._worker is not None:
            now = self._worker.stats.snapshot()
        elif self._scheduler is not None:
            now = self._scheduler_counters()
        else:
            return None
        delta = {
            name: value - self._last_stats.get(name, 0)
            for name, value in now.items()
            if not name.endswith("_gbps") and not name.endswith("_ratio")
        }
        self._last_stats = now
        delta = {name: value for name, value in delta.items() if value}
        return KVTierConnectorStats(data=delta) if delta else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVTierConnectorStats:
        return KVTierConnectorStats(data=dict(data or {}))

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # NOTE: vLLM calls this while it builds its config (GPU, CUDA graphs on), before any
        # engine process starts: a mistake in the extra config stops `vllm serve` here.
        return load_config(overrides=dict(extra_config or {})).use_layerwise

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        # NOTE: the first hook vLLM calls in the engine core on every backend (before memory
        # profiling and the KV cache): a config mistake is reported here once, not by each
        # worker after profiling. kvtier reads any layout, so it asks for none.
        kvtier_config_from_vllm(vllm_config)
        return None

    def shutdown(self) -> None:
        if self._metrics is not None:
            self._metrics.close()
        if self._worker is not None:
            self._worker.shutdown()
        for client in (self._client, self._metrics_client):
            if client is not None:
                client.close()


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
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        isa = _get_attn_isa(
            vllm_config.model_config.dtype,
            vllm_config.cache_config.block_size,
            vllm_config.model_config.get_head_size(),
            vllm_config.cache_config.cache_dtype,
        )
    except Exception:
        import platform

        isa = f"unknown-{platform.machine()}"
    return (("cpu_attn_isa", str(isa)),)


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
