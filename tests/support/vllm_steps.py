"""Stand-ins for the parts of vLLM's ``SchedulerOutput`` that the connector's scheduler side
reads: the requests a step schedules new, those it continues, and those it preempted."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class FakeNewRequest:
    """``NewRequestData``: ``block_ids`` is a tuple of block lists, one per KV group."""

    req_id: str
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int


@dataclass
class FakeCachedRequests:
    """``CachedRequestData``: parallel lists indexed like ``req_ids``."""

    req_ids: list[str] = field(default_factory=list)
    resumed_req_ids: set[str] = field(default_factory=set)
    new_block_ids: list[tuple[list[int], ...] | None] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)


@dataclass
class FakeSchedulerOutput:
    scheduled_new_reqs: list[FakeNewRequest] = field(default_factory=list)
    scheduled_cached_reqs: FakeCachedRequests = field(default_factory=FakeCachedRequests)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    preempted_req_ids: set[str] = field(default_factory=set)
