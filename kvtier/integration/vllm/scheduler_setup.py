"""The scheduler side as vLLM's engine core builds it: its lookups, extensions, metrics
endpoint and failure policy.

``scheduler_side`` asks every worker rank what its tiers hold over the ranks' lookup
sockets, enables the extensions the config names, serves the Prometheus endpoint
(``metrics_port``) and sets vLLM's ``kv_load_failure_policy`` from kvtier's.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

from kvtier.config import KVTierConfig
from kvtier.integration.vllm import facts
from kvtier.integration.vllm.extensions import scheduler_extensions
from kvtier.integration.vllm.rpc import RankLookup, RpcClient, endpoint_for
from kvtier.integration.vllm.scheduler import SchedulerSide
from kvtier.logs import show_kvtier_logs
from kvtier.observability.prometheus import MetricsServer

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger(__name__)


def scheduler_side(
    config: KVTierConfig, vllm_config: VllmConfig, kv_cache_config: Any = None
) -> SchedulerSide:
    """The scheduler side of an engine: lookups over every worker rank's socket, the
    extensions its config enables, its metrics endpoint; ``kv_cache_config`` (vLLM's
    ``KVCacheConfig``) tells which blocks a sliding window frees."""
    show_kvtier_logs()
    transfer = vllm_config.kv_transfer_config
    endpoints = [
        endpoint_for(facts.engine_tag(vllm_config), rank)
        for rank in range(facts.world_size(vllm_config))
    ]
    client = RpcClient(endpoints, config.lookup_timeout_ms / 1000)
    lookup = RankLookup(client)
    side = SchedulerSide(
        config,
        lookup,
        can_load=transfer.is_kv_consumer,
        can_save=transfer.is_kv_producer,
        block_size=vllm_config.cache_config.block_size,
        whole_blocks=not facts.token_major_layout(config),
        partial_chunks=facts.stores_partial_chunks(config, transfer.kv_role),
        max_model_len=vllm_config.model_config.max_model_len,
        max_load_chunks=lambda: lookup.max_load_chunks,
        window_start=facts.window_start(kv_cache_config),
        held=lookup.held,
        extensions=scheduler_extensions(config, vllm_config, client),
    )
    side.clients.append(client)
    side.extras_of = facts.extras_reader(vllm_config)
    if config.metrics_port is not None:
        side.metrics = _serve_metrics(side, endpoints, vllm_config)
    if transfer.kv_load_failure_policy != config.kv_load_failure_policy:
        # NOTE: by default a chunk kvtier cannot load is recomputed, never a failed
        # request; vLLM's own default is "fail", so kvtier's key decides (vLLM reads
        # this after building the scheduler's connector).
        logger.info(
            "kvtier: kv_load_failure_policy set to %r (kvtier's kv_load_failure_policy)",
            config.kv_load_failure_policy,
        )
        transfer.kv_load_failure_policy = config.kv_load_failure_policy
    return side


def _serve_metrics(
    side: SchedulerSide, endpoints: list[str], vllm_config: VllmConfig
) -> MetricsServer:
    """The Prometheus endpoint (``metrics_port``), served from this process: each
    scrape asks every worker rank for its metrics over the lookup sockets."""
    config = side.config
    client = RpcClient(endpoints, config.lookup_timeout_ms / 1000)
    side.clients.append(client)
    lock = threading.Lock()  # one scrape at a time on the client's sockets

    def sources() -> list[dict]:
        own = {"labels": {"rank": "scheduler"}, "counters": side.counters()}
        with lock:
            replies = client.call_all("metrics")
        if replies is None:
            logger.warning("kvtier metrics: a worker rank did not answer; serving partial")
            replies = []
        return [own, *replies]

    dp_rank = getattr(vllm_config.parallel_config, "data_parallel_rank", 0) or 0
    port = config.metrics_port + dp_rank if config.metrics_port else 0
    return MetricsServer(config.metrics_host, port, sources)
