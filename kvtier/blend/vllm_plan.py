"""Scheduler side of CacheBlend in the vLLM connector: which prompts to blend, which
segments to store.

vLLM accepts externally computed tokens only as a prefix of the prompt, so a prompt with
cached segments is claimed as an ordinary external hit of all but its last token; the
workers build that KV themselves before the forward pass (``vllm_worker.BlendWorker``)::

    token    0                                                      T-1   T
             | sys |sep| doc B (cached) |sep| doc A (cached) |sep| question |
    vLLM     |========== "external hit": written by the blend ==========|last|
    blend    fresh tokens computed, cached segments placed + re-rotated, the most
             deviating ones recomputed (kvtier.blend.blend)

* A prompt with multimodal items or prompt embeddings is never blended nor stored as
  segments (its placeholder ids do not say what the model saw); the ordinary path,
  which keys those, serves it.
* A prompt is looked at once, when vLLM asks for its external hit with nothing of it in
  vLLM's own prefix cache (a prefix hit is not blended: the ordinary path serves it).
  Its segments (``split_segments``) are looked up in every worker's segment store over
  the lookup socket; when one lying wholly before the last token is held, the request
  is claimed (``claim``) and, once vLLM allocated its blocks, blended in its first step.
* A prompt that is not blended stores its segments that no worker holds, each once vLLM
  computed it (``SegmentSaveSpec``; the KV is read back from vLLM's cache). A blended
  prompt stores nothing (neither segments nor prefix chunks): its KV is an approximation
  below ratio 1.

Nothing here imports vLLM; its objects are duck-typed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.blend.segments import segment_hash, split_segments
from kvtier.config import KVTierConfig
from kvtier.hashing import ChunkHasher
from kvtier.integration.vllm.common import StepPlan
from kvtier.integration.vllm.facts import request_extras

logger = logging.getLogger(__name__)

Span = tuple[int, int, bytes]  # (start, end, segment hash)
PLAN_KEY = "blend"  # this feature's specs in ``StepPlan.extensions``


@dataclass(slots=True)
class BlendSpec:
    """Build the KV of ``token_ids`` (tokens ``[0, len(token_ids))`` of the request) from
    the cached segments ``(start, end, hash)`` and write it to its blocks."""

    req_id: str
    token_ids: list[int]
    segments: list[Span]
    block_ids: list[int]


@dataclass(slots=True)
class SegmentSaveSpec:
    """Store the KV of tokens ``[start, end)`` (in the request's blocks, just computed by
    vLLM) as the segment ``hash``, with the positions it sits at."""

    req_id: str
    segments: list[Span]
    block_ids: list[int]


class BlendPlanner:
    """Claims blendable prompts and plans segment stores.

    Args:
        config: kvtier's config (``blend_min_tokens``, hashing).
        separator: the token ids of ``blend_special_str``.
        lookup: asks the workers which of some segment hashes they all hold (one bool
            per hash; all False on any failure or timeout).
        can_load / can_save: the ``kv_role``.
    """

    def __init__(
        self,
        config: KVTierConfig,
        separator: Sequence[int],
        lookup: Callable[[list[bytes]], list[bool]],
        *,
        can_load: bool = True,
        can_save: bool = True,
    ):
        if not separator:
            raise ValueError("blend_special_str: the separator tokenizes to no tokens")
        self.separator = list(separator)
        self.min_tokens = config.blend_min_tokens
        self.hasher = ChunkHasher(config.hash_algorithm, config.hash_seed)
        self.lookup = lookup
        self.can_load = can_load
        self.can_save = can_save
        self._claims: dict[str, tuple[int, list[Span]]] = {}  # req -> (claimed, reused)
        self._blends: dict[str, BlendSpec] = {}  # accepted by vLLM, not yet sent
        self._to_store: dict[str, list[Span]] = {}  # segments to store once computed
        self._seen: set[str] = set()
        # NOTE: claims vLLM accepted, counted then and never taken back: a blend that
        # fails in the worker (which counts it) or never runs (preempted) stays counted.
        self.blended_requests = 0
        self.blended_tokens = 0  # tokens claimed by blends
        self.reused_tokens = 0  # tokens of those in cached segments

    def claim(self, request: Any, num_computed_tokens: int) -> int:
        """Tokens to claim as an external hit (0: do not blend this prompt)."""
        req_id = request.request_id
        if req_id in self._seen:
            claim = self._claims.get(req_id)
            return claim[0] if claim and num_computed_tokens == 0 else 0
        self._seen.add(req_id)
        tokens = list(request.prompt_token_ids or ())
        extras = request_extras(request)
        if not tokens or (extras is not None and (extras.mm or extras.prompt_embeds is not None)):
            # NOTE: images and embedded parts sit on placeholder ids, which are all the
            # blend keys segments by and runs the model on: such prompts are not blended
            return 0
        spans = [
            (s.start, s.end, segment_hash(self.hasher, tokens[s.start : s.end], extras))
            for s in split_segments(tokens, self.separator, self.min_tokens)
        ]
        if not spans:
            return 0
        held = self.lookup([h for _, _, h in spans])
        last = len(tokens) - 1  # vLLM computes the last token itself
        reused = [span for span, ok in zip(spans, held, strict=True) if ok and span[1] <= last]
        if self.can_load and reused and num_computed_tokens == 0:
            self._claims[req_id] = (last, reused)
            return last
        if self.can_save:
            missing = [span for span, ok in zip(spans, held, strict=True) if not ok]
            if missing:
                self._to_store[req_id] = missing
        return 0

    def after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int) -> bool:
        """vLLM allocated the request's blocks; True when it accepted the blend claim."""
        claim = self._claims.pop(request.request_id, None)
        if claim is None or num_external_tokens != claim[0]:
            return False
        claimed, reused = claim
        tokens = list(request.prompt_token_ids)[:claimed]
        self._blends[request.request_id] = BlendSpec(
            request.request_id, tokens, reused, list(block_ids)
        )
        self.blended_requests += 1
        self.blended_tokens += claimed
        self.reused_tokens += sum(end - start for start, end, _ in reused)
        return True

    def extend(
        self, plan: StepPlan, scheduler_output: Any, block_ids: Callable[[str], list[int]]
    ) -> None:
        """Add this step's blends and segment stores to ``plan``; ``block_ids`` gives a
        scheduled request's current blocks."""
        scheduled = scheduler_output.num_scheduled_tokens
        computed: dict[str, int] = {}
        for new in scheduler_output.scheduled_new_reqs:
            computed[new.req_id] = new.num_computed_tokens + scheduled.get(new.req_id, 0)
            spec = self._blends.pop(new.req_id, None)
            if spec is not None:
                spec.block_ids = list(new.block_ids[0])
                plan.extensions.setdefault(PLAN_KEY, []).append(spec)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            computed[req_id] = cached.num_computed_tokens[i] + scheduled.get(req_id, 0)
        for req_id, end in computed.items():
            pending = self._to_store.get(req_id)
            if not pending:
                continue
            ready = [span for span in pending if span[1] <= end]
            if ready:
                plan.extensions.setdefault(PLAN_KEY, []).append(
                    SegmentSaveSpec(req_id, ready, block_ids(req_id))
                )
                self._to_store[req_id] = [span for span in pending if span[1] > end]

    def on_preempted(self, req_ids: set[str] | None) -> None:
        """A preempted request lost its blocks (and is recomputed by vLLM when resumed)."""
        for req_id in req_ids or ():
            self._blends.pop(req_id, None)
            self._to_store.pop(req_id, None)

    def request_finished(self, request: Any) -> None:
        req_id = request.request_id
        for table in (self._claims, self._blends, self._to_store):
            table.pop(req_id, None)
        self._seen.discard(req_id)

    def counters(self) -> dict[str, float]:
        return {
            "blend_requests": self.blended_requests,
            "blend_claimed_tokens": self.blended_tokens,
            "blend_reused_tokens": self.reused_tokens,
        }
