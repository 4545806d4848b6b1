"""Worker side of the vLLM connector: moves KV between vLLM's paged cache and kvtier.

It runs in each vLLM worker process (one per tensor/pipeline-parallel rank), owns that
rank's ``CacheEngine`` (tiers + kernels) and serves the scheduler's lookups over a local
RPC socket. Per engine step it executes the ``StepPlan`` the scheduler side built:

    bind_connector_metadata
                        take the step's plan, before the forward pass
    start_load_kv       sync loads: fetch + verify chunks, then scatter (all layers now,
                        or one layer per ``wait_for_layer_load`` when layer-wise)
                        async loads: handed to a background thread, reported through
                        ``get_finished`` once written (on a step with no sync load,
                        vLLM calls this hook after the forward launch)
    save_kv_layer       layer-wise only: copy this layer of the chunks to save
    wait_for_save       copy (or finish copying) the chunks to save and publish them
    (after the step)    with KV events on, hand over what the tiers recorded since the
                        last step (``take_events``)

Optional features (CacheBlend, KV events) are ``WorkerExtension`` objects: they run their
part of the step's plan before the forward pass (after the loads) and after it (before the
saves). ``WorkerSide.from_vllm`` wires one up in a vLLM worker process.

NOTE: a chunk that cannot be loaded (evicted since the lookup, corrupt, wrong shape) is
never written into vLLM's cache; the blocks it should have filled are reported through
``get_block_ids_with_load_errors`` so vLLM recomputes them. So are the blocks an
extension was to fill before the forward pass and could not (a blend that failed).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from kvtier.config import KVTierConfig
from kvtier.engine import CacheEngine, EngineMetadata
from kvtier.integration.vllm import facts
from kvtier.integration.vllm.common import (
    LoadSpec,
    RankContext,
    SaveSpec,
    StatsDelta,
    StepPlan,
    WorkerExtension,
    slot_mapping,
)
from kvtier.integration.vllm.extensions import worker_extensions
from kvtier.integration.vllm.rpc import RpcServer, endpoint_for
from kvtier.keys import geometry_tag
from kvtier.logs import show_kvtier_logs
from kvtier.machine import PoolTooLarge
from kvtier.observability.stats import Counter, Stats
from kvtier.observability.tier_events import TierEvent, TierEventLog
from kvtier.paged_io import use_tuning_dir
from kvtier.transfers import RetrieveTransfer, StoreTransfer
from kvtier.warmup import start_background

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger(__name__)

# Counted once for all ranks, by the scheduler: lookups, and the KV events it announces.
# A rank never counts them, so its metrics leave them out rather than export them at 0.
SCHEDULER_COUNTERS = (
    Counter.LOOKUP_REQUESTS,
    Counter.LOOKUP_TOKENS,
    Counter.LOOKUP_HIT_TOKENS,
    Counter.KV_EVENTS_BLOCKS_STORED,
    Counter.KV_EVENTS_BLOCKS_REMOVED,
    Counter.KV_EVENTS_UNANNOUNCED,
)


class WorkerSide:
    """One rank's half of the connector.

    Args:
        config: kvtier's config.
        metadata: model name and rank (part of every key).
        endpoint: where to serve the scheduler's lookups (None: do not serve).
        record_events: record what the tiers hold for KV events (``take_tier_events``).
        wait_stored_s: a ``kv_producer``'s ``producer_store_timeout_ms``: after a step's
            saves, wait up to this long until they reached every tier (0: do not wait).
        extensions: optional features, run around each forward pass.
        mla_replicas: ranks in a row (one pipeline stage's tensor-parallel ranks) that
            hold the same KV if the cache turns out to be MLA's latent: they then store
            it under the same keys, once per stage (``EngineMetadata.replicated``).
        head_replicas: ranks in a row that hold the same KV head if the cache turns out
            to hold one head a rank (``facts.kv_head_replicas``): they store it so too.
    """

    def __init__(
        self,
        config: KVTierConfig,
        metadata: EngineMetadata,
        endpoint: str | None,
        *,
        record_events: bool = False,
        wait_stored_s: float = 0.0,
        extensions: Sequence[WorkerExtension] = (),
        mla_replicas: int = 1,
        head_replicas: int = 1,
        async_scheduling: bool = False,
    ):
        self.config = config
        self.mla_replicas = mla_replicas
        self.head_replicas = head_replicas
        self.async_scheduling = async_scheduling
        self.extensions = list(extensions)
        self.metadata = metadata
        self.endpoint = endpoint
        self.wait_stored_s = wait_stored_s
        self.stats = Stats()
        self.events = TierEventLog(stats=self.stats) if record_events else None
        self.engine: CacheEngine | None = None
        self.layer_index: dict[str, int] = {}
        self.block_size = 0
        self._server: RpcServer | None = None
        self._plan = StepPlan()
        self._layer_loads: list[tuple[LoadSpec, RetrieveTransfer]] = []
        self._layer_saves: list[StoreTransfer] = []
        self._saved_layers: set[int] = set()
        self._loaded_layers: set[int] = set()
        self._load_errors: set[int] = set()  # not yet reported to vLLM
        self._failed_this_step: set[int] = set()  # the step's saves must not read over them
        self._failed_last_step: set[int] = set()  # async scheduling: nor the next step's
        self._async = ThreadPoolExecutor(1, thread_name_prefix="kvtier-load")
        self._async_futures: dict[str, tuple[LoadSpec, Future[set[int]]]] = {}
        # NOTE: one lock orders the forward thread's steps against the lookup server's
        # clear and shutdown; an async load runs beside them (see _load_now), the tiers
        # lock internally.
        self._lock = threading.RLock()
        self._stats = StatsDelta(self.stats.snapshot)
        self._vllm_config: VllmConfig | None = None  # from_vllm: vLLM says backend and tags

    @classmethod
    def from_vllm(cls, config: KVTierConfig, vllm_config: VllmConfig) -> WorkerSide:
        """The worker side of one rank of an engine, with the extensions its config
        enables."""
        show_kvtier_logs()
        rank = facts.worker_rank(vllm_config)
        model_name = config.model_name or str(vllm_config.model_config.model)
        producer = vllm_config.kv_transfer_config.kv_role == "kv_producer"
        side = cls(
            config,
            EngineMetadata(model_name, facts.world_size(vllm_config), rank),
            endpoint_for(facts.engine_tag(vllm_config), rank),
            record_events=facts.kv_events_enabled(vllm_config),
            wait_stored_s=config.producer_store_timeout_ms / 1000 if producer else 0.0,
            extensions=worker_extensions(config, vllm_config),
            mla_replicas=facts.latent_replicas(vllm_config),
            head_replicas=facts.kv_head_replicas(vllm_config),
            async_scheduling=bool(vllm_config.scheduler_config.async_scheduling),
        )
        side._vllm_config = vllm_config
        return side

    # -- set-up ----------------------------------------------------------------------

    def register_kv_caches(
        self,
        kv_caches: dict[str, torch.Tensor],
        backend: str | None = None,
        tags: tuple[tuple[str, str], ...] = (),
    ) -> None:
        """Describe vLLM's KV tensors, build this rank's cache engine, serve lookups.

        ``backend``: vLLM's attention backend (from_vllm: asked of vLLM). ``tags`` join
        every key (from_vllm: e.g. the CPU backend's instruction set, which decides how
        bytes sit inside a block, or a quantized cache's format), so chunks from
        incompatible engines never mix. The KV geometry (layers x KV heads x head size)
        joins every key too, and a layout copied in whole blocks (not token-major) adds
        its block size. An MLA cache is keyed per pipeline stage, not per rank
        (``mla_replicas``); a KV head replicated across ranks per head (``head_replicas``).
        """
        block_size = None
        if self._vllm_config is not None:
            backend = facts.attention_backend(self._vllm_config, kv_caches)
            tags = facts.key_tags(self._vllm_config, backend)
            block_size = self._vllm_config.cache_config.block_size
        paged = facts.detect_paged_kv(kv_caches, backend, self.config.kv_layout, block_size)
        tags = (*tags, geometry_tag(paged.num_layers, paged.num_heads, paged.head_size))
        if not paged.layout.token_major:
            # its chunks are whole blocks, their tokens interleaved: at another block size
            # the same bytes are other KV
            tags = (*tags, ("block_size", str(paged.block_size)))
        self.metadata = dataclasses.replace(self.metadata, tags=tuple(tags))
        if paged.layout.name == "mla":
            # NOTE: every tensor-parallel rank holds the whole latent, byte for byte
            self.metadata = self.metadata.replicated(self.mla_replicas)
        elif paged.num_heads == 1:  # keyed by the head it holds, not by the rank
            self.metadata = self.metadata.replicated(self.head_replicas)
        self.layer_index = {name: i for i, name in enumerate(kv_caches)}
        self.block_size = paged.block_size
        use_tuning_dir(self.config.tuning_dir)  # this worker process's kernel tuning files
        try:
            self.engine = CacheEngine(
                self.config, self.metadata, paged, stats=self.stats, events=self.events
            )
        except PoolTooLarge as exc:
            # NOTE: vLLM allocates (and zero-fills) its KV cache before this hook, so the
            # memory it holds is already spent; on its CPU build, unless
            # --kv-cache-memory-bytes says otherwise, that is most of the machine.
            host_kv = facts.host_kv_cache_bytes(kv_caches)
            if not host_kv:
                raise
            raise PoolTooLarge(
                f"{exc}, or vLLM's KV cache: it already holds {host_kv / 2**30:.1f} GiB "
                "of this machine's memory (size the two together: --kv-cache-memory-bytes "
                "and max_local_cpu_size)"
            ) from None
        logger.info(
            "kvtier: %d layers, layout %s, %d blocks of %d tokens, %d KV heads x %d, %s",
            paged.num_layers,
            paged.layout.name,
            paged.num_blocks,
            paged.block_size,
            paged.num_heads,
            paged.head_size,
            paged.dtype,
        )
        if self.endpoint is not None:
            self._server = RpcServer(
                self.endpoint,
                {
                    "lookup": self._serve_lookup,
                    "held": self._serve_held,
                    "clear": self._serve_clear,
                    "stats": lambda args: self.stats.snapshot(),
                    "metrics": lambda args: self._require_engine().metrics(omit=self._uncounted()),
                    **{
                        op: h
                        for extension in self.extensions
                        for op, h in extension.handlers().items()
                    },
                },
            )
            self._server.start()
        rank = RankContext(self.engine, self.stats, backend, self.take_tier_events)
        for extension in self.extensions:
            extension.attach(rank)
        if self._vllm_config is not None:  # precompile_kernels: compile in the background
            start_background(self.config, self.engine)

    def _require_engine(self) -> CacheEngine:
        if self.engine is None:
            raise RuntimeError("kvtier: register_kv_caches has not been called")
        return self.engine

    def _serve_lookup(self, args: dict) -> dict:
        engine = self._require_engine()
        return {
            "hits": engine.lookup_hashes(args["hashes"], int(args.get("load_from", 0))),
            "max_load_chunks": engine.max_load_chunks,
        }

    def _serve_held(self, args: dict) -> dict:
        engine = self._require_engine()
        return {
            "held": engine.held_chunks(args["hashes"]),
            "max_load_chunks": engine.max_load_chunks,
        }

    def _serve_clear(self, args: dict) -> dict:
        with self._lock:
            self._require_engine().clear()
        return {}

    # -- loads -----------------------------------------------------------------------

    def _chunks(self, spec: LoadSpec | SaveSpec):
        return self._require_engine().chunks_from_hashes(
            spec.first_chunk, spec.hashes, spec.chunks_end
        )

    def _failed_blocks(self, load: LoadSpec, loaded_end: int) -> set[int]:
        """Blocks of ``[start, end)`` that the loaded run ``[.., loaded_end)`` did not fill."""
        first_bad = max(loaded_end, load.start)
        if first_bad >= load.end:
            return set()
        bs = self.block_size
        return set(load.block_ids[first_bad // bs : -(-load.end // bs)])

    def _load_slots(self, load: LoadSpec) -> torch.Tensor:
        return slot_mapping(load.block_ids, self.block_size, load.chunks_end, load.start, load.end)

    def _reported(self, load: LoadSpec, failed: set[int]) -> set[int]:
        if failed:
            logger.warning(
                "kvtier: request %s: %d blocks could not be loaded; vLLM recomputes them",
                load.req_id,
                len(failed),
            )
        return failed

    def _load_now(self, load: LoadSpec) -> set[int]:
        """An async load, in the loader thread: fetch, verify, write every layer.

        NOTE: outside the lock, so that the engine thread's saves (and its sync loads) run
        meanwhile, each direction on its own stream: the transfer's buffers are its own
        (pinned until it closes), ``PagedIO``'s batches are per thread, and the tiers
        lock internally. vLLM writes nothing else into the request's blocks, nor reads
        them, before ``get_finished`` reports the load (``shutdown`` joins this thread
        before it closes the engine)."""
        if not load.hashes:
            return set()
        transfer = self._require_engine().begin_retrieve(self._chunks(load), self._load_slots(load))
        failed = self._failed_blocks(load, transfer.end)
        try:
            transfer.scatter()
        finally:
            transfer.close()
        return self._reported(load, failed)

    def bind(self, plan: StepPlan) -> None:
        """Take this step's plan as vLLM binds it, before the forward pass: the layer hooks
        (``save_layer``) may run before ``start_load``, which vLLM calls after the forward
        launch on a step that has no sync load."""
        self._plan = plan

    def start_load(self, plan: StepPlan) -> None:
        """Before the forward pass (after it on a step with async loads only): run (or
        start) this step's loads, then the extensions' part of the plan."""
        self._plan = plan
        for load in plan.loads:
            if load.is_async:
                future = self._async.submit(self._load_now, load)
                self._async_futures[load.req_id] = (load, future)
                continue
            if not load.hashes:
                continue
            layerwise = self.config.use_layerwise
            with self._lock:
                # fetch + verify now; write now, or layer by layer (wait_for_layer_load)
                transfer = self._require_engine().begin_retrieve(
                    self._chunks(load), self._load_slots(load)
                )
                failed = self._failed_blocks(load, transfer.end)
                if layerwise:
                    self._layer_loads.append((load, transfer))
                else:
                    try:
                        transfer.scatter()
                    finally:
                        transfer.close()
            self._load_errors |= self._reported(load, failed)
            self._failed_this_step |= failed
        for extension in self.extensions:
            failed = extension.before_forward(plan.extensions.get(extension.name, [])) or set()
            self._load_errors |= failed
            self._failed_this_step |= failed

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Layer-wise: write this layer of the step's loads before its attention runs."""
        if not self._layer_loads:
            return
        layer = self.layer_index.get(layer_name)
        if layer is None or layer in self._loaded_layers:
            return
        with self._lock:
            for _, transfer in self._layer_loads:
                transfer.scatter(layer)
            self._loaded_layers.add(layer)
            if len(self._loaded_layers) == len(self.layer_index):
                self._finish_layer_loads()

    def _finish_layer_loads(self) -> None:
        """Write the layers no ``wait_for_layer_load`` asked for, then release."""
        for layer in range(len(self.layer_index)):
            if layer not in self._loaded_layers:
                for _, transfer in self._layer_loads:
                    transfer.scatter(layer)
        for _, transfer in self._layer_loads:
            transfer.close()
        self._layer_loads = []
        self._loaded_layers = set()

    def get_finished(self) -> set[str]:
        """Async loads that completed (written, or failed with their blocks reported)."""
        done = {req_id for req_id, (_, future) in self._async_futures.items() if future.done()}
        for req_id in done:
            load, future = self._async_futures.pop(req_id)
            try:
                self._load_errors |= future.result()
            except Exception:
                # NOTE: nothing written by a failed load may be trusted: all its blocks
                # are reported, so vLLM recomputes them.
                logger.exception("kvtier: async load of request %s failed", req_id)
                self._load_errors |= self._failed_blocks(load, load.start)
        return done

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    # -- saves -----------------------------------------------------------------------

    def _save_slots(self, save: SaveSpec) -> torch.Tensor:
        return slot_mapping(save.block_ids, self.block_size, save.chunks_end)

    def _trusted_saves(self) -> list[SaveSpec]:
        """This step's saves, less those of requests that attended to a block whose load
        failed this step.

        NOTE: vLLM runs the step's forward pass before it learns of a failed load, so
        the KV computed after a failed block (the request's own, and that of a request
        sharing the block through vLLM's prefix cache) was computed over garbage. vLLM
        discards and recomputes it; kvtier must not store it, or later hits load it.
        The step's failures are kept apart from those still to report: with speculative
        decoding vLLM takes the load errors before ``wait_for_save``. With async
        scheduling vLLM plans step N+1 before it learns of step N's failed loads, so N+1
        computes over the same garbage and its saves are refused too.
        """
        saves = self._plan.saves
        failed = self._failed_this_step | self._failed_last_step
        if not failed:
            return saves
        trusted = []
        for save in saves:
            blocks = save.block_ids[: -(-save.chunks_end // self.block_size)]
            if failed.isdisjoint(blocks):
                trusted.append(save)
                continue
            self.stats.inc("store_skipped_load_failed_chunks", len(save.hashes))
            logger.warning(
                "kvtier: request %s: not storing %d chunks computed over blocks whose load "
                "failed (vLLM recomputes them)",
                save.req_id,
                len(save.hashes),
            )
        return trusted

    def save_layer(self, layer_name: str) -> None:
        """Layer-wise: copy this layer of the step's saves (its attention just ran)."""
        if not self.config.use_layerwise or not self._plan.saves:
            return
        layer = self.layer_index.get(layer_name)
        if layer is None:
            return
        with self._lock:
            if not self._layer_saves and not self._saved_layers:
                engine = self._require_engine()
                self._layer_saves = [
                    engine.begin_store(self._chunks(save), self._save_slots(save))
                    for save in self._trusted_saves()
                ]
            for transfer in self._layer_saves:
                transfer.gather(layer)
            self._saved_layers.add(layer)

    def wait_for_save(self) -> None:
        """After the forward pass: the extensions' part of the plan, then publish this
        step's saves (every layer's KV is computed by now)."""
        for extension in self.extensions:
            extension.after_forward(self._plan.extensions.get(extension.name, []))
        with self._lock:
            if self._layer_loads:  # a layer-wise load some layer never waited for
                self._finish_layer_loads()
            engine = self._require_engine() if self._plan.saves else None
            if self._layer_saves:
                missing = set(range(len(self.layer_index))) - self._saved_layers
                for transfer in self._layer_saves:
                    for layer in sorted(missing):
                        transfer.gather(layer)
                    transfer.commit()
            elif engine is not None:
                for save in self._trusted_saves():
                    engine.store_chunks(self._chunks(save), self._save_slots(save))
            if engine is not None and self.wait_stored_s:
                self._wait_stored(engine)
            self._layer_saves = []
            self._saved_layers = set()
            self._failed_last_step = self._failed_this_step if self.async_scheduling else set()
            self._failed_this_step = set()
            self._plan = StepPlan()

    def _wait_stored(self, engine: CacheEngine) -> None:
        """A producer's step ends once its stores reached every tier (vLLM returns the
        step's outputs after this hook), so a response means its KV can be loaded."""
        # NOTE: a flush waits for every queued write, this step's and any before it.
        if not engine.flush(self.wait_stored_s):
            self.stats.inc("producer_store_timeouts")
            logger.warning(
                "kvtier: stores not complete after producer_store_timeout_ms=%d; they go on "
                "in the background (a consumer may miss them meanwhile)",
                round(self.wait_stored_s * 1000),
            )

    # -- events ----------------------------------------------------------------------

    def _uncounted(self) -> tuple[str, ...]:
        """The engine counters this rank never counts: the scheduler's, and, without KV
        events, the tier records dropped (``kv_events_dropped``)."""
        if self.events is None:
            return (*SCHEDULER_COUNTERS, Counter.KV_EVENTS_DROPPED)
        return SCHEDULER_COUNTERS

    def take_tier_events(self) -> list[TierEvent]:
        """What this rank's tiers recorded since the last call (empty without
        ``record_events``)."""
        return self.events.drain() if self.events is not None else []

    def take_events(self) -> Any:
        """This rank's KV events for vLLM since the last step (None: none, or events off)."""
        for extension in self.extensions:
            events = extension.take_events()
            if events is not None:
                return events
        return None

    def take_stats(self) -> dict[str, float]:
        """Counters since the previous call (vLLM reports per interval)."""
        return self._stats.take()

    # -- shutdown --------------------------------------------------------------------

    def shutdown(self) -> None:
        """Finish in-flight loads, stop serving lookups, release the tiers (idempotent)."""
        self._async.shutdown(wait=True)
        for extension in self.extensions:
            extension.close()
        if self._server is not None:
            self._server.close()
            self._server = None
        with self._lock:
            for transfer in self._layer_saves:
                transfer.abort()
            self._layer_saves = []
            self._finish_layer_loads()
            if self.engine is not None:
                self.engine.close()
                self.engine = None
