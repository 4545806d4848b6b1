"""A real vLLM worker side over a paged cache of random bits, serving the lookup socket
from a temporary directory: what the scheduler-side tests ask through ``RankLookup``."""

from __future__ import annotations

import uuid
from pathlib import Path
from types import SimpleNamespace

import torch

from kvtier.config import KVTierConfig
from kvtier.engine import EngineMetadata
from kvtier.integration.vllm.rpc import endpoint_for
from kvtier.integration.vllm.scheduler import SchedulerSide
from kvtier.integration.vllm.worker import WorkerSide
from kvtier_kernels import PagedKV
from support.kv import fill_random_
from support.vllm_steps import FakeNewRequest, FakeSchedulerOutput


def random_paged(
    layers: int,
    num_blocks: int,
    block_size: int,
    num_heads: int,
    head_size: int,
    layout: str = "vllm_hnd",
) -> PagedKV:
    """A bf16 cache (vLLM's CPU layout unless told), every block filled with the same
    random bits on every call."""
    paged = PagedKV.empty(
        layout,
        num_layers=layers,
        num_blocks=num_blocks,
        block_size=block_size,
        num_heads=num_heads,
        head_size=head_size,
        dtype=torch.bfloat16,
    )
    gen = torch.Generator().manual_seed(0)
    for tensor in paged.tensors:
        fill_random_(tensor, gen)
    return paged


def serving_worker(
    tmp_path: Path, config: KVTierConfig, paged: PagedKV, names: list[str] | None = None
) -> tuple[WorkerSide, str]:
    """A worker with ``paged`` registered (layers named ``names``, else ``layer.<i>``) and
    its lookup endpoint; the caller shuts it down."""
    endpoint = endpoint_for(f"t-{uuid.uuid4().hex[:8]}", 0, base_dir=str(tmp_path))
    worker = WorkerSide(config, EngineMetadata("test-model"), endpoint)
    names = names or [f"layer.{i}" for i in range(paged.num_layers)]
    try:
        worker.register_kv_caches(dict(zip(names, paged.tensors, strict=True)), "FLASH_ATTN")
    except BaseException:
        worker.shutdown()
        raise
    return worker, endpoint


def store_prompt(
    worker: WorkerSide, side: SchedulerSide, request_id: str, tokens: list[int], blocks: list[int]
) -> None:
    """One request of ``tokens`` in ``blocks`` with nothing cached, driven through both
    sides as vLLM does: looked up, allocated, computed in one step, stored, finished."""
    request = SimpleNamespace(
        request_id=request_id, all_token_ids=tokens, num_prompt_tokens=len(tokens)
    )
    side.get_num_new_matched_tokens(request, 0)
    side.update_state_after_alloc(request, blocks, 0)
    step = FakeSchedulerOutput(
        scheduled_new_reqs=[FakeNewRequest(request_id, (blocks,), 0)],
        num_scheduled_tokens={request_id: len(tokens)},
    )
    worker.start_load(side.build_plan(step))
    worker.wait_for_save()
    side.request_finished(request)
