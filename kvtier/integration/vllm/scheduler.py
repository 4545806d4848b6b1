"""Scheduler side of the vLLM connector: which token ranges to load and to save.

It runs in vLLM's engine-core process, which holds the tokens but not the KV. Per live
request it keeps one ``RequestTracker`` (``request_tracker``: the token ranges it has
loaded, holds and stored).

Chunk hashes are computed here (the workers receive hashes, not tokens) and cached per
request, so a long prompt is hashed once, not once per step.

Optional features (CacheBlend, KV events) are ``SchedulerExtension`` objects
(``extensions``): each hook of this side calls theirs, e.g. every chunk a worker may come to
hold (a planned save, a lookup hit) goes to ``on_chunks``.

``scheduler_setup.scheduler_side`` wires one up in vLLM's engine core: the lookup client
that asks every worker rank what its tiers hold, the enabled extensions, the Prometheus
endpoint, the failure policy. Everything here duck-types vLLM's objects (``Request``,
``SchedulerOutput``) and imports no vLLM, so the logic is tested without an engine.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvtier.chunker import HashChain
from kvtier.config import KVTierConfig
from kvtier.hashing import ChunkHasher
from kvtier.integration.vllm import facts
from kvtier.integration.vllm.common import (
    LoadSpec,
    SaveSpec,
    SchedulerExtension,
    StatsDelta,
    StepPlan,
)
from kvtier.integration.vllm.request_tracker import (
    RequestTracker,
    leading_null_blocks,
    skip_null_blocks,
)
from kvtier.integration.vllm.rpc import RpcClient
from kvtier.observability.prometheus import MetricsServer

logger = logging.getLogger(__name__)


class SchedulerSide:
    """Plans loads and saves for vLLM's scheduler.

    Args:
        config: kvtier's config (chunk size, hashing, modes).
        lookup: ``(hashes, load_from) -> hits`` over the workers (each prefetches from
            chunk ``load_from``); 0 on any failure or timeout (never raises or blocks).
        can_load / can_save: the ``kv_role`` (consumer loads, producer saves).
        block_size: vLLM's block size.
        whole_blocks: the engine's layout is not token-major inside a block (vLLM's CPU
            backend), so only whole blocks are loaded, and a partial last chunk ends at
            the prompt's last whole block.
        partial_chunks: store and look up a prompt's partial last chunk (default:
            ``save_unfull_chunk``).
        max_model_len: vLLM's longest sequence (None: unknown); a ``chunk_size`` longer
            than it is warned about, as no whole chunk ever fills.
        max_load_chunks: how many chunks one load can stage on every rank (None: not
            known); a hit is loaded up to that many chunks past vLLM's own (with
            ``held``: that many chunks of its window).
        window_start: ``num_computed_tokens -> token`` before which vLLM may have freed a
            request's blocks (``facts.window_start``: a sliding window's); a chunk that
            starts before it is not stored, as its first blocks may hold another
            request's KV or the null block's.
        held: ``hashes -> whether every rank holds each``; given, and with a
            ``window_start``, a hit needs only the chunks of the window before its end
            (``_window_hit``), not every chunk from the first.
        extensions: optional features, called from each hook.
    """

    def __init__(
        self,
        config: KVTierConfig,
        lookup: Callable[[list[bytes], int], int],
        *,
        can_load: bool = True,
        can_save: bool = True,
        block_size: int = 1,
        whole_blocks: bool = False,
        partial_chunks: bool | None = None,
        max_model_len: int | None = None,
        max_load_chunks: Callable[[], int | None] = lambda: None,
        window_start: Callable[[int], int] = lambda computed: 0,
        held: Callable[[list[bytes]], list[bool]] | None = None,
        extensions: Sequence[SchedulerExtension] = (),
    ):
        self.config = config
        self.extensions = list(extensions)
        self.chunk_size = config.chunk_size
        self.hasher = ChunkHasher(config.hash_algorithm, config.hash_seed)
        self.lookup = lookup
        self.max_load_chunks = max_load_chunks
        self.window_start = window_start
        self.held = held if window_start(1 << 40) > 0 else None
        self.can_load = can_load
        self.can_save = can_save
        self.block_size = block_size
        self.whole_blocks = whole_blocks
        partial = config.save_unfull_chunk if partial_chunks is None else partial_chunks
        self.save_partial = partial
        # kv_consumer with pd_wait_ms: req_id -> when to stop waiting for a producer
        self.pd_wait_s = config.pd_wait_ms / 1000 if can_load and not can_save else 0.0
        self._wait_until: dict[str, float] = {}
        facts.check_chunk_size(config.chunk_size, block_size, whole_blocks)
        if max_model_len is not None and config.chunk_size > max_model_len and not partial:
            logger.warning(
                "kvtier: chunk_size=%d is longer than vLLM's max_model_len=%d: no sequence "
                "fills a chunk, so kvtier stores and loads nothing (lower chunk_size, or set "
                "save_unfull_chunk)",
                config.chunk_size,
                max_model_len,
            )
        if self._window_cuts_chunks(max_model_len or 1 << 17):
            logger.warning(
                "kvtier: chunk_size=%d is not below this model's attention window plus a "
                "block of %d tokens: vLLM frees a request's blocks behind its window as it "
                "runs, so a chunk whose first block is freed before the step that completes "
                "it is not stored, and a later prompt hits only where the chunks of its "
                "window are stored (lower chunk_size)",
                config.chunk_size,
                block_size,
            )
        if self.save_partial and whole_blocks:
            logger.info(
                "kvtier: this engine's KV layout is copied in whole blocks: a partial last "
                "chunk is stored up to the prompt's last whole block of %d tokens",
                block_size,
            )
        self.trackers: dict[str, RequestTracker] = {}
        self._hash_cache: dict[str, HashChain] = {}
        self.extras_of = facts.request_extras  # scheduler_side: facts.extras_reader's
        # req_id -> (vllm_cached, load_end, tokens kvtier holds) from the last lookup
        self._hits: dict[str, tuple[int, int, int]] = {}
        self._cancelled_async: list[LoadSpec] = []
        # Counted once per scheduling of a request: vLLM asks again every step while the
        # request waits for blocks, and only the first answer counts until it is scheduled.
        self.lookup_requests = 0
        self.lookup_tokens = 0
        self.lookup_hit_tokens = 0
        self._looked_up: set[str] = set()  # counted since their last scheduling
        self.pd_waits = 0  # lookups answered "ask again later" (pd_wait_ms)
        self._stats = StatsDelta(self.counters)
        self.clients: list[RpcClient] = []  # lookup sockets, closed with this side
        self.metrics: MetricsServer | None = None  # the endpoint serving counters()

    # -- helpers ---------------------------------------------------------------------

    def _window_cuts_chunks(self, max_model_len: int) -> bool:
        """Whether vLLM may free a block of a chunk before the step that completes it
        (which starts with fewer tokens computed than the chunk's end)."""
        cs, bs = self.chunk_size, self.block_size
        return any(
            self.window_start(start + cs - 1) // bs * bs > start
            for start in range(0, max_model_len, cs)
        )

    def _hashes(self, request: Any) -> HashChain:
        req_id = request.request_id
        hashes = self._hash_cache.get(req_id)
        if hashes is None:
            hashes = HashChain(self.hasher, self.chunk_size, self.extras_of(request))
            self._hash_cache[req_id] = hashes
        return hashes

    def _tracker(self, request: Any) -> RequestTracker:
        tracker = self.trackers.get(request.request_id)
        if tracker is None:
            tracker = RequestTracker(request.request_id, request, self._hashes(request))
            self.trackers[request.request_id] = tracker
        return tracker

    def _held_end(self, num_tokens: int) -> int:
        """Where the chunks kvtier can hold of ``num_tokens`` tokens end: the tokens
        themselves, or their last whole block when only whole blocks can be copied."""
        return num_tokens // self.block_size * self.block_size if self.whole_blocks else num_tokens

    def _bounds(self, first_chunk: int, hashes: list[bytes], end: int) -> int:
        """End token of the last of ``hashes`` (chunks from ``first_chunk``)."""
        return min((first_chunk + len(hashes)) * self.chunk_size, end)

    # -- vLLM hooks ------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` that kvtier can load (chunk-aligned,
        never the whole sequence): a prefix hit, else an extension's claim. Calling it
        again for the same request is harmless.

        A consumer with ``pd_wait_ms`` answers None (vLLM: "not known yet, ask again in a
        later step"; other requests run meanwhile) while its prompt is not fully held and
        the wait has not run out.

        NOTE: a request that reads no prefix cache (prompt logprobs) is not looked up:
        vLLM would drop the hit, and the lookup would only count it and prefetch its
        chunks for nothing. Its chunks are still stored."""
        if facts.reads_no_prefix_cache(request):
            return 0, False
        hit = self._prefix_hit(request, num_computed_tokens)
        if hit != (0, False):
            return hit
        for extension in self.extensions:
            claimed = extension.claim(request, num_computed_tokens)
            if claimed > 0:
                return claimed, False
        return hit

    def _prefix_hit(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        self._hits.pop(request.request_id, None)
        if not self.can_load:
            return 0, False
        tokens = request.all_token_ids
        num_tokens = len(tokens)
        held_end = self._held_end(num_tokens)
        hashes = self._hashes(request).upto(tokens, held_end, partial=self.save_partial)
        if self._bounds(0, hashes, held_end) <= num_computed_tokens:
            return 0, False  # nothing kvtier could hold goes past vLLM's own hit
        if self.held is None:
            first, hits, load_end = self._leading_hit(hashes, num_computed_tokens, num_tokens)
        else:
            first, hits, load_end = self._window_hit(hashes, num_computed_tokens, num_tokens)
        if self.pd_wait_s and self._wait_for_producer(request.request_id, hits < len(hashes)):
            return None, False
        hit_tokens = self._bounds(0, hashes[:hits], held_end)
        # Stored again: the prompt from chunk 0 when a chunk before vLLM's hit is missing.
        stored = 0 if self.held is None and first > 0 else hit_tokens
        if request.request_id not in self._looked_up:
            self._looked_up.add(request.request_id)
            self.lookup_requests += 1
            self.lookup_tokens += num_tokens
            self.lookup_hit_tokens += max(hit_tokens - num_computed_tokens, 0)
        if hits > first:
            self._on_chunks(request, first, hashes[first:hits], hit_tokens)
        if load_end - num_computed_tokens < self._least_load:
            return 0, False  # nothing new, or too little to be worth a load
        self._hits[request.request_id] = (num_computed_tokens, load_end, stored)
        return load_end - num_computed_tokens, self.config.enable_async_loading

    @property
    def _least_load(self) -> int:
        return max(self.config.min_retrieve_tokens, 1)

    def _load_end(self, hits: int, num_tokens: int) -> int:
        """Where a load of a sequence's first ``hits`` chunks ends: never at its last
        token (vLLM computes it to sample the next), at a block boundary when only whole
        blocks are copied."""
        load_end = min(hits * self.chunk_size, self._held_end(num_tokens), num_tokens - 1)
        return load_end // self.block_size * self.block_size if self.whole_blocks else load_end

    def _leading_hit(
        self, hashes: list[bytes], vllm_cached: int, num_tokens: int
    ) -> tuple[int, int, int]:
        """``(first, hits, load_end)``: the chunks every rank holds from chunk ``first``
        (0: the leading ones), loaded up to the chunks one load can stage past vLLM's own
        hit. A load reads only the chunks from the one holding vLLM's hit's end, so where
        a rank lacks a chunk wholly inside vLLM's own hit (evicted, never stored), the hit
        is the chunks it holds from that one on (``first``)."""
        cs = self.chunk_size
        first = vllm_cached // cs
        hits = self.lookup(hashes, first)
        if hits >= first:
            first = 0
        else:  # the leading chunks end inside vLLM's own hit
            hits = first + self.lookup(hashes[first:], 0)
        load_end = self._load_end(hits, num_tokens)
        if (most := self.max_load_chunks()) is not None:  # a longer load fails partway
            load_end = min(load_end, (vllm_cached // cs + most) * cs)
        return first, hits, load_end

    def _window_hit(
        self, hashes: list[bytes], vllm_cached: int, num_tokens: int
    ) -> tuple[int, int, int]:
        """``(first, hits, load_end)`` for a model that attends to a window: vLLM gives a
        request that resumes at ``load_end`` blocks only from ``window_start(load_end)``
        on (the null block before them, see ``skip_null_blocks``), so a hit of ``hits``
        chunks needs only chunks ``[first, hits)``: those of its window past vLLM's own
        hit. The longest such hit every rank holds (counted, announced), and the longest
        whose window one load can stage (loaded; its chunks are prefetched)."""
        held, most = self.held(hashes), self.max_load_chunks()
        cs, bs, found = self.chunk_size, self.block_size, None
        for hits in range(len(hashes), 0, -1):
            load_end = self._load_end(hits, num_tokens)
            if load_end <= vllm_cached:
                break
            first = max(vllm_cached, self.window_start(load_end) // bs * bs) // cs
            end = -(-load_end // cs)  # chunks the load reads: [first, end)
            if first >= end or not all(held[first:hits]):
                continue  # NOTE: a hit that needs no chunk (a chunked-local boundary) is none
            found = found or (first, hits)
            if load_end - vllm_cached >= self._least_load and (most is None or end - first <= most):
                if self.lookup(hashes[first:end], 0) < end - first:
                    break  # evicted since the first question: no load
                return *found, load_end
        return *(found or (0, 0)), vllm_cached

    def _wait_for_producer(self, req_id: str, missing: bool) -> bool:
        """Whether to look again later: chunks are ``missing`` and the request's
        ``pd_wait_ms`` (from its first lookup) has not run out."""
        now = time.monotonic()
        until = self._wait_until.setdefault(req_id, now + self.pd_wait_s)
        if missing and now < until:
            self.pd_waits += 1
            return True
        return False

    def update_state_after_alloc(
        self, request: Any, block_ids: list[int], num_external_tokens: int
    ) -> None:
        """Record the request's blocks and, when vLLM accepted a hit, plan its load."""
        self._looked_up.discard(request.request_id)  # scheduled: preempted, it counts again
        tracker = self._tracker(request)
        tracker.block_ids = list(block_ids)
        for extension in self.extensions:
            if extension.after_alloc(request, tracker.block_ids, num_external_tokens):
                # NOTE: e.g. a blended prompt's KV is approximate: never stored as chunks,
                # nor are the chunks its generated tokens fill (save_decode_cache).
                tracker.stores = False
        hit = self._hits.pop(request.request_id, None)
        if num_external_tokens <= 0 or hit is None:
            return
        start, load_end, held = hit
        end = min(load_end, start + num_external_tokens)
        first = start // self.chunk_size
        held_end = self._held_end(len(tracker.tokens))
        hashes = self._hashes(request).upto(tracker.tokens, held_end, partial=self.save_partial)
        last = -(-end // self.chunk_size)  # chunks needed to cover [start, end)
        hashes = hashes[first:last]
        tracker.vllm_cached = start
        # Every chunk the lookup found is in kvtier already: never stored again.
        held_upto = held if held == held_end else held // self.chunk_size * self.chunk_size
        tracker.saved_upto = max(tracker.saved_upto, held_upto)
        tracker.load = LoadSpec(
            req_id=tracker.req_id,
            first_chunk=first,
            hashes=hashes,
            chunks_end=self._bounds(first, hashes, held_end),
            start=start,
            end=end,
            block_ids=tracker.block_ids,
            is_async=self.config.enable_async_loading,
        )

    def build_plan(self, scheduler_output: Any) -> StepPlan:
        """Loads and saves for this step (resets what was planned), then the extensions'
        specs.

        NOTE: a request preempted between steps (vLLM's ``reset_prefix_cache`` with
        ``reset_running_requests``) is resumed in the next step, whose output reports it
        preempted too: what was planned for it since (a load) goes into its new blocks.
        """
        scheduled = scheduler_output.num_scheduled_tokens
        preempted = set(getattr(scheduler_output, "preempted_req_ids", None) or ())
        self.on_preempted(preempted.difference(scheduled))
        plan = StepPlan(loads=self._cancelled_async)
        self._cancelled_async = []

        for new in scheduler_output.scheduled_new_reqs:
            tracker = self.trackers.get(new.req_id)
            if tracker is None:
                continue
            tracker.block_ids = list(new.block_ids[0])
            self._take_sync_load(tracker, plan)
            self._plan_save(tracker, new.num_computed_tokens, scheduled.get(new.req_id, 0), plan)

        cached = scheduler_output.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", set())
        for i, req_id in enumerate(cached.req_ids):
            tracker = self.trackers.get(req_id)
            if tracker is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if req_id in resumed:
                tracker.block_ids = list(new_blocks[0]) if new_blocks else []
                tracker.loading = None
            elif new_blocks:
                tracker.block_ids.extend(new_blocks[0])
            self._take_sync_load(tracker, plan)
            self._plan_save(tracker, cached.num_computed_tokens[i], scheduled.get(req_id, 0), plan)

        # Async loads go out as soon as their blocks exist; the request itself is not
        # scheduled until the workers report the load finished.
        for tracker in self.trackers.values():
            if tracker.load is not None and tracker.load.is_async:
                self._send_load(tracker, plan)
        for extension in self.extensions:
            extension.extend_plan(plan, scheduler_output, self._block_ids)
        return plan

    def _block_ids(self, req_id: str) -> list[int]:
        tracker = self.trackers.get(req_id)
        return list(tracker.block_ids) if tracker is not None else []

    def _take_sync_load(self, tracker: RequestTracker, plan: StepPlan) -> None:
        if tracker.load is not None and not tracker.load.is_async:
            self._send_load(tracker, plan)

    def _send_load(self, tracker: RequestTracker, plan: StepPlan) -> None:
        """Move the tracker's planned load into ``plan``, into its current blocks."""
        load = tracker.load
        tracker.load = None
        load.block_ids = list(tracker.block_ids)
        skip_null_blocks(load, self.block_size, self.chunk_size)
        tracker.loading = (load.start, load.end)
        plan.loads.append(load)

    def _plan_save(
        self, tracker: RequestTracker, computed: int, scheduled: int, plan: StepPlan
    ) -> None:
        """Store the chunks this step completes (its ``scheduled`` tokens after ``computed``)
        whose blocks vLLM still holds for the request: none of its leading null blocks,
        nor blocks its window left before this step (freed, maybe another request's now)."""
        if not self.can_save or not tracker.stores:
            return
        cs = self.chunk_size
        computed_end = computed + scheduled
        num_prompt = tracker.num_prompt_tokens
        limit = len(tracker.tokens) if self.config.save_decode_cache else num_prompt
        end = min(computed_end, limit)
        partial_end = self._held_end(end)
        partial = self.save_partial and end == num_prompt and partial_end % cs != 0
        save_end = partial_end if partial else end // cs * cs
        if save_end <= tracker.saved_upto:
            return
        held = max(
            self.window_start(computed) // self.block_size,
            leading_null_blocks(tracker.block_ids),
        )
        first = max(tracker.saved_upto // cs, -(-held * self.block_size // cs))
        tracker.saved_upto = save_end
        if first * cs >= save_end:
            return  # the blocks of every chunk left to store are gone
        hashes = tracker.hashes.upto(tracker.tokens, save_end, partial=partial)[first:]
        plan.saves.append(
            SaveSpec(tracker.req_id, first, hashes, save_end, list(tracker.block_ids))
        )
        self._on_chunks(tracker.request, first, hashes, save_end)

    def on_preempted(self, req_ids: set[str] | None) -> None:
        """A preempted request lost its blocks: drop any load planned into them."""
        for req_id in req_ids or ():
            tracker = self.trackers.get(req_id)
            if tracker is None:
                continue
            tracker.loading = None
            if tracker.load is not None and not tracker.load.is_async:
                tracker.load = None
        for extension in self.extensions:
            extension.on_preempted(set(req_ids or ()))

    def request_finished(self, request: Any) -> None:
        """Forget the request. An async load planned but never sent is sent empty, so the
        workers report it finished and vLLM frees the blocks it holds for it."""
        req_id = request.request_id
        tracker = self.trackers.pop(req_id, None)
        self._hash_cache.pop(req_id, None)
        self._hits.pop(req_id, None)
        self._wait_until.pop(req_id, None)
        self._looked_up.discard(req_id)
        if tracker is not None and tracker.load is not None and tracker.load.is_async:
            load = tracker.load
            load.hashes, load.end, load.chunks_end = [], load.start, load.start
            self._cancelled_async.append(load)
        for extension in self.extensions:
            extension.request_finished(request)

    # -- extensions, events, counters --------------------------------------------------

    def _on_chunks(self, request: Any, first_chunk: int, hashes: list[bytes], end: int) -> None:
        for extension in self.extensions:
            extension.on_chunks(request, first_chunk, hashes, end)

    def update_connector_output(self, connector_output: Any) -> None:
        """The workers' output of a step: blocks whose load failed, KV events (to the
        extensions)."""
        self._on_load_errors(getattr(connector_output, "invalid_block_ids", None) or set())
        events = getattr(connector_output, "kv_cache_events", None)
        if events is not None:
            for extension in self.extensions:
                extension.add_worker_events(events)

    def _on_load_errors(self, failed_blocks: set[int]) -> None:
        """The request whose load failed stores again from the chunk of its first failed
        block on, which vLLM recomputes. NOTE: in a later step; the worker never stores KV
        computed over a failed block in the step of the failure (``_trusted_saves``)."""
        bs = self.block_size
        for tracker in self.trackers.values() if failed_blocks else ():
            start, end = tracker.loading or (0, 0)
            blocks = tracker.block_ids[start // bs : -(-end // bs)]
            bad = next((i for i, b in enumerate(blocks) if b in failed_blocks), None)
            if bad is not None:
                first_bad = (start // bs + bad) * bs // self.chunk_size * self.chunk_size
                tracker.saved_upto, tracker.loading = min(tracker.saved_upto, first_bad), None

    def take_events(self) -> list:
        """The extensions' vLLM KV events since the last call."""
        return [event for extension in self.extensions for event in extension.take_events()]

    def counters(self) -> dict[str, float]:
        """This process's own counters: lookups (once for all ranks) and the extensions'.
        Only those it can count: no lookups where it loads nothing (``kv_producer``), no
        ``pd_waits`` unless it waits for a producer (``kv_consumer`` with ``pd_wait_ms``)."""
        counters: dict[str, float] = {}
        if self.can_load:
            counters["lookup_requests"] = self.lookup_requests
            counters["lookup_tokens"] = self.lookup_tokens
            counters["lookup_hit_tokens"] = self.lookup_hit_tokens
        if self.pd_wait_s:
            counters["pd_waits"] = self.pd_waits
        for extension in self.extensions:
            counters.update(extension.counters())
        return counters

    def take_stats(self) -> dict[str, float]:
        """Counters since the previous call (vLLM reports per interval)."""
        return self._stats.take()

    def clear_tiers(self) -> bool:
        """Empty every rank's tiers; False when a rank did not answer (or none is known)."""
        return bool(self.clients) and self.clients[0].call_all("clear") is not None

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
        for extension in self.extensions:
            extension.close()
        for client in self.clients:
            client.close()
