"""What the scheduler side and the worker side of the vLLM connector share: the step plan
the scheduler sends every worker, the extension interface optional features plug in
through, and the token-slot arithmetic.

Nothing here imports vLLM.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from kvtier.engine import CacheEngine
    from kvtier.observability.stats import Stats
    from kvtier.observability.tier_events import TierEvent


@dataclass(slots=True)
class LoadSpec:
    """Load chunks ``first_chunk ...`` into the request's blocks.

    Tokens ``[start, end)`` are written; the chunks cover ``[first_chunk * chunk_size,
    chunks_end)`` (their tokens outside ``[start, end)`` are skipped). An empty ``hashes``
    list loads nothing (an async load cancelled before it was sent): the worker only
    reports it finished.
    """

    req_id: str
    first_chunk: int
    hashes: list[bytes]
    chunks_end: int
    start: int
    end: int
    block_ids: list[int]
    is_async: bool = False


@dataclass(slots=True)
class SaveSpec:
    """Store chunks ``first_chunk ...`` (tokens up to ``chunks_end``) from the request's
    blocks."""

    req_id: str
    first_chunk: int
    hashes: list[bytes]
    chunks_end: int
    block_ids: list[int]


@dataclass(slots=True)
class StepPlan:
    """What the workers do in one engine step (the connector metadata's payload).

    ``extensions`` carries each extension's own specs for the step, under its name.
    """

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    extensions: dict[str, list] = field(default_factory=dict)


class SchedulerExtension:
    """An optional feature on the scheduler side (CacheBlend, KV events).

    ``SchedulerSide`` calls every hook of every extension it was built with; each hook
    does nothing unless overridden.
    """

    name = "extension"

    def claim(self, request: Any, num_computed_tokens: int) -> int:
        """Tokens past ``num_computed_tokens`` to claim as an external hit when kvtier's
        prefix lookup found none (0: no claim)."""
        return 0

    def after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int) -> bool:
        """vLLM allocated the request's blocks; True: its KV must never be stored as
        prefix chunks (e.g. it is an approximation)."""
        return False

    def on_chunks(self, request: Any, first_chunk: int, hashes: list[bytes], end: int) -> None:
        """Chunks ``first_chunk, ...`` of ``request`` (tokens end at ``end``) that a worker
        may come to hold: a planned save or a lookup hit."""

    def extend_plan(
        self, plan: StepPlan, scheduler_output: Any, block_ids: Callable[[str], list[int]]
    ) -> None:
        """Add this step's specs to ``plan.extensions[self.name]``; ``block_ids`` gives a
        scheduled request's current blocks."""

    def on_preempted(self, req_ids: set[str]) -> None:
        """These requests lost their blocks."""

    def request_finished(self, request: Any) -> None:
        """Forget the request."""

    def add_worker_events(self, events: Any) -> None:
        """The workers' KV events of a step (``KVConnectorOutput.kv_cache_events``)."""

    def take_events(self) -> list:
        """vLLM KV events to publish since the last call."""
        return []

    def counters(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        """Release what the extension holds."""


@dataclass(frozen=True, slots=True)
class RankContext:
    """What a worker extension may use of its rank once the KV cache is registered."""

    engine: CacheEngine
    stats: Stats
    backend: str | None  # vLLM's attention backend (None: unknown)
    take_tier_events: Callable[[], list[TierEvent]]  # what the tiers recorded since last


class WorkerExtension:
    """An optional feature on the worker side; every hook does nothing unless overridden."""

    name = "extension"

    def attach(self, rank: RankContext) -> None:
        """The rank's cache engine exists (called from ``register_kv_caches``)."""

    def handlers(self) -> dict[str, Callable[[dict], dict]]:
        """More operations for the rank's lookup socket (op name -> handler)."""
        return {}

    def before_forward(self, specs: list) -> set[int] | None:
        """This step's specs, before the forward pass (after the step's loads). Returns
        the vLLM blocks it was to fill and could not: reported to vLLM as failed loads,
        like a plain load's (None: none)."""

    def after_forward(self, specs: list) -> None:
        """This step's specs, after the forward pass (before the step's saves)."""

    def take_events(self) -> Any:
        """This rank's KV events since the last step (None: none)."""
        return None

    def close(self) -> None:
        """Release what the extension holds."""


class StatsDelta:
    """Counters as amounts since the previous call (vLLM's stats are per interval);
    rates and ratios, which do not add, are left out."""

    def __init__(self, read: Callable[[], dict[str, float]]):
        self._read = read
        self._last: dict[str, float] = {}

    def take(self) -> dict[str, float]:
        now = self._read()
        delta = {
            name: value - self._last.get(name, 0)
            for name, value in now.items()
            if not name.endswith("_gbps") and not name.endswith("_ratio")
        }
        self._last = now
        return {name: value for name, value in delta.items() if value}


def slot_mapping(
    block_ids: list[int], block_size: int, num_tokens: int, start: int = 0, end: int | None = None
) -> torch.Tensor:
    """``[num_tokens]`` int64 slots of a request's tokens; tokens outside ``[start, end)``
    or beyond its blocks get -1 (skipped)."""
    end = num_tokens if end is None else end
    positions = torch.arange(num_tokens, dtype=torch.int64)
    blocks = torch.tensor(block_ids or [0], dtype=torch.int64)
    block_index = positions // block_size
    valid = (positions >= start) & (positions < end) & (block_index < len(block_ids))
    slots = blocks[block_index.clamp(max=len(blocks) - 1)] * block_size + positions % block_size
    return torch.where(valid, slots, torch.full_like(slots, -1))


def held_by_every_rank(replies: list[dict] | None, count: int) -> list[bool]:
    """Per hash of a ``count``-hash question to every rank, whether every reply's
    ``held`` says it holds it (none when a rank failed, ``replies`` None, or a reply
    answers another number of hashes)."""
    if replies is None:
        return [False] * count
    held = [list(reply.get("held", ())) for reply in replies]
    return [all(len(h) == count and h[i] for h in held) for i in range(count)]
