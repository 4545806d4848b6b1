"""Read a running vLLM engine's KV blocks back, to prove KV bit-identity.

kvtier's guarantee is about KV, not tokens: after a hit, the engine's KV blocks of the
loaded tokens hold exactly the bytes the engine computed when the prompt was stored.
``KVProbe`` checks that directly. It records the block ids of every request as vLLM
frees them and hashes (xxh3_64) each layer's KV of each block, so two runs of the same
prompt can be compared block by block::

    probe = KVProbe(llm)
    llm.generate(...)                       # cold: full prefill
    cold = probe.digests(prompt)
    llm.reset_prefix_cache(); llm.generate(...)   # served from kvtier
    first_mismatch(cold, probe.digests(prompt), num_blocks=loaded // block_size)  # None

It reads vLLM's scheduler directly, so it needs the engine core in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``). The KV is read where it lives, on every worker
rank (``LLM.collective_rpc``): with tensor or pipeline parallelism a digest covers each
rank's own layers and heads. It is a verification tool for the demo, the tests and
operators debugging a deployment, never part of the serving path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash


@dataclass(frozen=True)
class KVDigests:
    """xxh3_64 of each (layer, block) of one request's KV, blocks in token order; with
    several worker ranks, each rank's layers in turn (rank 0's first)."""

    block_size: int
    per_layer: tuple[tuple[int, ...], ...]  # [rank's layer][block]

    @property
    def num_blocks(self) -> int:
        return len(self.per_layer[0]) if self.per_layer else 0


def first_mismatch(a: KVDigests, b: KVDigests, *, num_blocks: int) -> tuple[int, int] | None:
    """The first ``(layer, block)`` among the first ``num_blocks`` blocks whose KV bytes
    differ between ``a`` and ``b``; None when all are identical.

    Raises:
        ValueError: when either side holds fewer than ``num_blocks`` blocks, or the two
            have different layer counts or block sizes.
    """
    if a.block_size != b.block_size or len(a.per_layer) != len(b.per_layer):
        raise ValueError(
            f"digests of different engines: block size {a.block_size} vs {b.block_size}, "
            f"{len(a.per_layer)} vs {len(b.per_layer)} layers"
        )
    if min(a.num_blocks, b.num_blocks) < num_blocks:
        raise ValueError(
            f"asked to compare {num_blocks} blocks; the digests hold {a.num_blocks} "
            f"and {b.num_blocks}"
        )
    for layer, (blocks_a, blocks_b) in enumerate(zip(a.per_layer, b.per_layer, strict=True)):
        for block in range(num_blocks):
            if blocks_a[block] != blocks_b[block]:
                return layer, block
    return None


@dataclass
class KVProbe:
    """Hashes the KV blocks of the requests an in-process ``vllm.LLM`` served.

    Raises:
        RuntimeError: when the engine core is not in this process.
    """

    llm: Any
    _blocks_of: dict[tuple[int, ...], list[int]] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        core = getattr(self.llm.llm_engine.engine_core, "engine_core", None)
        if core is None:
            raise RuntimeError(
                "KVProbe needs vLLM's engine core in this process: set "
                "VLLM_ENABLE_V1_MULTIPROCESSING=0 before creating the LLM"
            )
        self._cache_config = core.vllm_config.cache_config
        self._executor = core.model_executor
        manager = core.scheduler.kv_cache_manager
        free = manager.free

        def recording_free(request) -> None:
            # NOTE: a request's blocks are known until vLLM frees them; their contents stay
            # until another request reuses them, so hash before the next request runs.
            (block_ids, *_) = manager.get_block_ids(request.request_id)
            self._blocks_of[tuple(request.prompt_token_ids)] = list(block_ids)
            free(request)

        manager.free = recording_free

    def block_ids(self, prompt: list[int]) -> list[int]:
        """Block ids the last finished request with this prompt held, in token order."""
        try:
            return self._blocks_of[tuple(prompt)]
        except KeyError:
            raise KeyError(
                f"no finished request with this {len(prompt)}-token prompt was seen"
            ) from None

    def digests(self, prompt: list[int], *, num_tokens: int | None = None) -> KVDigests:
        """Per (layer, block) digests of the blocks that hold the prompt's first
        ``num_tokens`` tokens (default: the whole prompt), read from the engine now."""
        block_size = self._cache_config.block_size
        num_tokens = len(prompt) if num_tokens is None else num_tokens
        block_ids = self.block_ids(prompt)[: -(-num_tokens // block_size)]
        num_blocks = self._cache_config.num_gpu_blocks
        ranks = self.llm.collective_rpc(_rank_digests, args=(block_ids, num_blocks))
        return KVDigests(block_size, tuple(layer for rank in ranks for layer in rank))

    def layer_caches(self) -> list[torch.Tensor]:
        """The engine's KV tensor of each layer (views into vLLM's cache: writes land).

        Raises:
            RuntimeError: when the engine's workers run in other processes (tensor or
                pipeline parallelism), whose tensors cannot be handed out here.
        """
        worker = getattr(self._executor, "driver_worker", None)
        if worker is None:
            raise RuntimeError(
                "the engine's workers run in other processes (tensor or pipeline "
                "parallelism): their KV tensors are read there, by digests()"
            )
        return _layer_caches(worker)


def _layer_caches(worker: Any) -> list[torch.Tensor]:
    caches = worker.model_runner.kv_caches
    if not caches or not all(isinstance(t, torch.Tensor) for t in caches):
        raise RuntimeError("the engine's model runner holds no per-layer KV tensors")
    return list(caches)


def _rank_digests(worker: Any, block_ids: list[int], num_blocks: int) -> list[tuple[int, ...]]:
    """On one worker rank (``collective_rpc``): the digests of its layers' blocks."""
    per_layer = []
    for layer in _layer_caches(worker):
        block_dim = list(layer.shape).index(num_blocks)
        per_layer.append(tuple(_digest(layer.select(block_dim, block)) for block in block_ids))
    return per_layer


def _digest(tensor: torch.Tensor) -> int:
    raw = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
    return xxhash.xxh3_64_intdigest(raw.numpy().tobytes())
