"""``KVTierConnector``: kvtier behind vLLM's ``KVConnectorBase_V1``.

vLLM builds two instances: one with the SCHEDULER role in the engine-core process (it
decides what to load and save) and one with the WORKER role in each worker process (it
moves the KV). This facade passes each hook, in one call, to ``scheduler.SchedulerSide``
or ``worker.WorkerSide``. The scheduler learns what the workers' tiers hold through a
local RPC socket per rank (``rpc``): a lookup that fails or takes longer than
``lookup_timeout_ms`` is a miss. With tensor or pipeline parallelism every rank stores its
own shard, and a chunk counts as a hit only when every rank has it.

Optional features plug into both sides as extensions (``extensions``): CacheBlend with
``enable_blending`` (``kvtier.blend.vllm_extension``; docs/cacheblend.md), and KV events
with vLLM's ``kv_events_config`` (``events``: what kvtier's tiers store and drop comes out
of vLLM's KV event stream as ``BlockStored`` / ``BlockRemoved``).

Supported vLLM: the V1 connector API with the 3-argument constructor
``(vllm_config, role, kv_cache_config)`` (vLLM 0.32 and 0.33).
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

# vLLM before kvtier's connector sides, whose RPC needs pyzmq: without vLLM (and so without
# the pyzmq it brings) the error names vLLM.
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

from kvtier.config import KVTierConfig, load_config
from kvtier.integration.vllm import facts
from kvtier.integration.vllm.common import StepPlan
from kvtier.integration.vllm.extensions import check_extensions
from kvtier.integration.vllm.scheduler import SchedulerSide
from kvtier.integration.vllm.scheduler_setup import scheduler_side
from kvtier.integration.vllm.worker import WorkerSide

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

    from kvtier.integration.vllm.kv_events import KVTierKVEvents

logger = logging.getLogger(__name__)


class KVTierConnectorMetadata(KVConnectorMetadata):
    """One step's plan, sent from the scheduler to every worker."""

    def __init__(self, plan: StepPlan):
        self.plan = plan


@dataclass
class KVTierConnectorStats(KVConnectorStats):
    """Counters for one reporting interval (deltas), summed across workers.

    ``data`` maps counter names (``kvtier.observability.stats.Counter``) to amounts; ``reduce`` adds
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
        check_extensions(config, vllm_config)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = scheduler_side(config, vllm_config, kv_cache_config)
        else:
            self._worker = WorkerSide.from_vllm(config, vllm_config)
        logger.info("kvtier connector (%s role): %s", role.name.lower(), config.summary())
        logger.debug("kvtier config in effect:\n%s", config.describe())

    # -- scheduler side --------------------------------------------------------------

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
        return KVTierConnectorMetadata(self._scheduler.build_plan(scheduler_output))

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        # Saves complete within the step that computed the KV, so blocks can go now.
        assert self._scheduler is not None
        self._scheduler.request_finished(request)
        return False, None

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """The workers' output of a step: blocks whose load failed (stored again once
        recomputed), their tier records (KV events)."""
        if self._scheduler is not None:
            self._scheduler.update_connector_output(connector_output)

    def take_events(self) -> Iterable[KVCacheEvent]:
        """kvtier's ``BlockStored`` / ``BlockRemoved`` events since the last call."""
        return self._scheduler.take_events() if self._scheduler is not None else ()

    def reset_cache(self) -> bool | None:
        """``reset_prefix_cache(reset_connector=True)``: empty every rank's tiers."""
        return self._scheduler.clear_tiers() if self._scheduler is not None else None

    # -- worker side -----------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        # NOTE: on a step without sync loads vLLM calls start_load_kv after the forward
        # launch, so the layer hooks of that forward learn the step's saves from here
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, KVTierConnectorMetadata):
            self._worker.bind(connector_metadata.plan)

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
        return None, (self._worker.get_finished() or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self._worker is not None
        return self._worker.take_load_errors()

    def get_kv_connector_kv_cache_events(self) -> KVTierKVEvents | None:
        """This rank's tier records since the last step (None: none, or events off)."""
        return self._worker.take_events() if self._worker is not None else None

    def get_kv_connector_stats(self) -> KVTierConnectorStats | None:
        side = self._worker or self._scheduler
        delta = side.take_stats() if side is not None else None
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
        config = kvtier_config_from_vllm(vllm_config)
        check_extensions(config, vllm_config)
        whole_blocks = not facts.token_major_layout(config)
        facts.check_chunk_size(config.chunk_size, vllm_config.cache_config.block_size, whole_blocks)
        return None

    def shutdown(self) -> None:
        if self._scheduler is not None:
            self._scheduler.close()
        if self._worker is not None:
            self._worker.shutdown()
