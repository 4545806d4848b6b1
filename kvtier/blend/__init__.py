"""CacheBlend: reuse the KV of text segments that are not a prefix (docs/cacheblend.md).

``model_spec`` (which models, their RoPE) → ``segments`` (splitting, keys, the segment
store) → ``blender`` (re-rotation and selective recompute over a ``BlendModel``);
``hf`` drives a transformers decoder. In vLLM: ``vllm_extension`` plugs ``vllm_plan``
(the scheduler's claims and segment stores) and ``vllm_worker`` (the blend with the running
model) into the connector.
"""

from kvtier.blend.blender import (
    BlendModel,
    BlendResult,
    PlacedSegment,
    blend,
    check_rerotation,
    place_segments,
)
from kvtier.blend.model_spec import RopeSpec, UnsupportedModelError, check_blendable, rope_spec

__all__ = [
    "BlendModel",
    "BlendResult",
    "PlacedSegment",
    "RopeSpec",
    "UnsupportedModelError",
    "blend",
    "check_blendable",
    "check_rerotation",
    "place_segments",
    "rope_spec",
]
