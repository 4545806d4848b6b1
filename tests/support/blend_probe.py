"""Probes of the CacheBlend engine tests, run inside a vLLM worker through
``LLM.collective_rpc`` (sending a function needs ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``
in the engine's environment). They reach kvtier's ``BlendWorker`` through vLLM's
connector group, change its recompute ratio between requests, read back the KV a blend
wrote into vLLM's blocks, and compare it with a full prefill through the same running
model. Each function takes the vLLM worker first (``collective_rpc``'s convention).
"""

from __future__ import annotations

import torch

from kvtier.blend import blend, place_segments
from kvtier.integration.vllm.common import slot_mapping


def _blend_worker():
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    side = get_kv_transfer_group()._worker
    found = [e.worker for e in side.extensions if e.name == "blend"]
    assert found and found[0] is not None, "kvtier's worker has no CacheBlend (enable_blending off)"
    return found[0]


def record_blends(_vllm_worker) -> None:
    """Keep each blend's spec (``probe_spec``) and a table for the KV read back
    (``probe_kv``: ratio -> ``[2, L, T, Hkv * D]``)."""
    worker = _blend_worker()
    run = worker.run

    def recording(spec) -> None:
        worker.probe_spec = spec
        run(spec)

    worker.run = recording
    worker.probe_kv = {}


def set_ratio(_vllm_worker, ratio: float) -> None:
    """Recompute ``ratio`` of the reused tokens at every check layer from now on."""
    worker = _blend_worker()
    worker.schedule = [(layer, ratio) for layer, _ in worker.schedule]


def keep_blended_kv(_vllm_worker, label: float) -> int:
    """Read the last blend's KV back from vLLM's blocks (the request has just finished;
    nothing ran since) and keep it under ``label``; returns its token count."""
    worker = _blend_worker()
    spec = worker.probe_spec
    slots = slot_mapping(spec.block_ids, worker.tokens.paged.block_size, len(spec.token_ids))
    worker.probe_kv[label] = worker.tokens.read(slots).float()
    return len(spec.token_ids)


def _relative_deviation(kv: torch.Tensor, reference: torch.Tensor) -> list[float]:
    """Per layer: squared KV error relative to the reference's squared norm."""
    error = ((kv - reference) ** 2).sum(dim=(0, 2, 3))
    return (error / (reference**2).sum(dim=(0, 2, 3))).tolist()


@torch.inference_mode()
def deviations(_vllm_worker) -> dict[str, list[float]]:
    """Per-layer deviation from a full prefill of the last blended prompt, through the
    running model's layers (every token computed: ``blend`` with nothing reused), of each
    KV kept by ``keep_blended_kv`` and of plain reuse (the cached segments placed without
    re-rotation, never recomputed; the other tokens computed over them)."""
    worker = _blend_worker()
    spec, model = worker.probe_spec, worker.model
    tokens = torch.tensor(spec.token_ids)
    num_tokens = tokens.shape[0]
    shape = (2, model.num_layers, num_tokens, model.num_kv_heads * model.head_size)
    none = torch.zeros(num_tokens, dtype=torch.bool)
    full = blend(model, tokens, torch.zeros(shape), none, []).kv
    kv, reused = torch.zeros(shape), none.clone()
    placed = worker._placed(spec, shape[3], worker.tokens.paged.dtype)
    place_segments(kv, reused, placed, None)
    plain = blend(model, tokens, kv, reused, [], fixed=reused.clone()).kv
    curve = {str(label): _relative_deviation(kv, full) for label, kv in worker.probe_kv.items()}
    curve["plain"] = _relative_deviation(plain, full)
    return curve
