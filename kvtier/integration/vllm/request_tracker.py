"""The token ranges the scheduler side keeps per live request of vLLM's scheduler.

One ``RequestTracker`` per request::

    token   0            vllm_cached     load_end                       computed   num_tokens
            |== in vLLM ==|== loaded from kvtier ==|== computed by vLLM ==|...........|
            |============ held by kvtier (lookup hit) ==========|
            |============ in kvtier ==========================|== stored as it is computed ==>
                                                        saved_upto ^   (whole chunks)

* ``vllm_cached``: what vLLM's own prefix cache already had (``num_computed_tokens``
  handed to ``get_num_new_matched_tokens``); never loaded again.
* ``[vllm_cached, load_end)``: loaded from kvtier. ``load_end`` is the lookup hit, cut to
  ``num_tokens - 1`` when the whole sequence hit (vLLM must compute the last token to
  sample the next one), and to the chunks one load can stage (``max_load_chunks``).
* ``saved_upto``: tokens ``[0, saved_upto)`` are in kvtier (hit or stored by this
  request), or lie before the window of a model that attends to one, whose hit needs
  only the window's chunks (``SchedulerSide._window_hit``). Each step, chunks that became complete (their KV was computed in this step or
  earlier) are sent to the workers to store; with ``save_unfull_chunk`` the partial last
  chunk of the prompt too; with ``save_decode_cache`` chunks of generated tokens too.
  A load that fails lowers it to the chunk of its first failed block: vLLM recomputes
  from there, and the request stores what it recomputes.

A planned load goes out into the request's blocks as they are when it is sent, after its
leading null blocks (``skip_null_blocks``). A save never reads blocks vLLM no longer holds
for the request (a sliding window's, see ``SchedulerSide``): chunks that start before them
are not stored.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.chunker import HashChain
from kvtier.integration.vllm.common import LoadSpec

NULL_BLOCK_ID = 0  # vLLM's null block: the placeholder for blocks a request does not hold


@dataclass(slots=True)
class RequestTracker:
    """The token ranges of one live request (see the module docstring)."""

    req_id: str
    request: Any  # vLLM's Request: read for its token ids only
    hashes: HashChain
    block_ids: list[int] = field(default_factory=list)
    vllm_cached: int = 0
    saved_upto: int = 0
    load: LoadSpec | None = None  # planned, not yet sent to the workers
    loading: tuple[int, int] | None = None  # the tokens [start, end) of the load sent
    stores: bool = True  # False: an extension claimed it (its KV is not stored as chunks)

    @property
    def tokens(self) -> Sequence[int]:
        return self.request.all_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return self.request.num_prompt_tokens


def leading_null_blocks(block_ids: Sequence[int]) -> int:
    """How many of a request's blocks, from its first, are vLLM's null block."""
    null = 0
    while null < len(block_ids) and block_ids[null] == NULL_BLOCK_ID:
        null += 1
    return null


def skip_null_blocks(load: LoadSpec, block_size: int, chunk_size: int) -> None:
    """Start ``load`` after its leading null blocks.

    vLLM gives a sliding-window request's blocks before its window as its null block
    (``NULL_BLOCK_ID``), one placeholder every such request shares: nothing is written
    there, and chunks that lie wholly before the window are not fetched."""
    start = max(load.start, leading_null_blocks(load.block_ids) * block_size)
    if start == load.start:
        return
    if start >= load.end:  # sent empty: an async load still reports finished
        load.hashes, load.end, load.chunks_end = [], load.start, load.start
        return
    first = start // chunk_size
    load.hashes = load.hashes[first - load.first_chunk :]
    load.first_chunk, load.start = first, start
