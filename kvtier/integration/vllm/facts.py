"""What kvtier reads off vLLM's config, a request and the running engine.

From the config: ranks, roles, KV events, the layout; from a request: what separates its
cache besides its tokens; from the engine: the attention backend, the CPU backend's
instruction set, the KV tensors' layout. vLLM's objects are duck-typed; vLLM itself is
imported only inside the functions that ask the running engine.
"""

from __future__ import annotations

import functools
import logging
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from kvtier.chunker import MultiModalSpan, PromptEmbeds, RequestExtras
from kvtier.config import KVTierConfig
from kvtier_kernels import LAYOUTS, LayoutError, PagedKV
from kvtier_kernels.dtypes import dtype_name

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger(__name__)


def request_extras(request: Any, mm_scope: str | None = None) -> RequestExtras | None:
    """What separates this request's cache besides its tokens: LoRA, multimodal items,
    the cache salt, prompt embeddings (read off a vLLM ``Request``). ``mm_scope``
    (``mm_identifier_scope``) prefixes every multimodal item's identifier."""
    lora = getattr(request, "lora_request", None)
    mm = []
    for feature in getattr(request, "mm_features", None) or ():
        position = getattr(feature, "mm_position", None)
        identifier = getattr(feature, "identifier", None)
        if position is not None and identifier is not None:
            name = f"{mm_scope}/{identifier}" if mm_scope else str(identifier)
            mm.append(MultiModalSpan(name, int(position.offset), int(position.length)))
    salt = getattr(request, "cache_salt", None)
    embeds = getattr(request, "prompt_embeds", None)
    if lora is None and not mm and not salt and embeds is None:
        return None
    return RequestExtras(
        lora_name=getattr(lora, "lora_name", None),
        lora_path=getattr(lora, "lora_path", None),
        mm=tuple(sorted(mm, key=lambda item: item.offset)),
        cache_salt=salt,
        prompt_embeds=None if embeds is None else PromptEmbeds(embeds),
    )


def reads_no_prefix_cache(request: Any) -> bool:
    """Whether vLLM computes every prompt token of ``request`` itself and so drops any
    hit offered for it: its ``skip_reading_prefix_cache``, which vLLM sets for prompt
    logprobs (every prompt token's logits are needed), for most pooling requests, and
    where a request asks for it."""
    return bool(getattr(request, "skip_reading_prefix_cache", False))


def mm_identifier_scope(vllm_config: VllmConfig) -> str | None:
    """None when vLLM names a multimodal item by its content (a hash, or the uuid the
    request gave); else a name of this process to scope the identifiers with.

    With neither the processor cache (``mm_processor_cache_gb: 0``) nor prefix caching,
    vLLM names an item without a uuid by a per-process counter
    (``renderer0-mm-<n>-image-0``): the first image of every process gets the same name,
    so keyed as it is a restarted engine, or another one sharing a tier, would load KV
    computed over another image. Scoped, such chunks are never found by another process.
    """
    mm_config = getattr(vllm_config.model_config, "multimodal_config", None)
    if mm_config is None or getattr(vllm_config.cache_config, "enable_prefix_caching", True):
        return None
    if (getattr(mm_config, "mm_processor_cache_gb", None) or 0) > 0:
        return None
    return f"process-{uuid.uuid4().hex}"


def extras_reader(vllm_config: VllmConfig) -> Callable[[Any], RequestExtras | None]:
    """``request_extras`` for this engine, its multimodal identifiers scoped to this
    process where vLLM names items per process (``mm_identifier_scope``)."""
    return functools.partial(request_extras, mm_scope=mm_identifier_scope(vllm_config))


def engine_tag(vllm_config: VllmConfig) -> str:
    """The engine's name among the lookup sockets of one host (engine id, data-parallel
    rank)."""
    parallel = vllm_config.parallel_config
    engine_id = vllm_config.kv_transfer_config.engine_id or "engine"
    return f"{engine_id}-dp{getattr(parallel, 'data_parallel_rank', 0) or 0}"


def world_size(vllm_config: VllmConfig) -> int:
    """Worker ranks of the engine: tensor x prefill-context x pipeline parallel, as vLLM
    counts them (decode context parallelism reuses those ranks, adding none)."""
    parallel = vllm_config.parallel_config
    return (
        parallel.tensor_parallel_size
        * _prefill_context_size(parallel)
        * parallel.pipeline_parallel_size
    )


def _prefill_context_size(parallel: Any) -> int:
    return getattr(parallel, "prefill_context_parallel_size", 1) or 1


def latent_replicas(vllm_config: VllmConfig) -> int:
    """Ranks in a row that hold the same KV when the cache is MLA's latent: the
    tensor-parallel ranks of a pipeline stage, each holding the whole latent (MLA's one
    KV head is replicated, not sharded). 1 under decode or prefill context parallelism,
    which splits a sequence's tokens across those ranks."""
    parallel = vllm_config.parallel_config
    for split in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        if (getattr(parallel, split, 1) or 1) > 1:
            return 1
    return parallel.tensor_parallel_size


def kv_head_replicas(vllm_config: VllmConfig) -> int:
    """Ranks in a row that hold the same KV heads when the model has fewer KV heads than
    tensor-parallel ranks: vLLM's ``QKVParallelLinear`` gives each head to ``tp //
    kv_heads`` consecutive ranks (rank ``r`` holds head ``r // replicas``, byte for byte)
    and refuses a ``tp`` that is neither a divisor nor a multiple of the heads. 1 where
    each rank holds heads of its own, under context parallelism (``latent_replicas``),
    and where the replication is not one for every layer: layers, or a draft model, of
    other KV heads or another tensor-parallel size."""
    tp = latent_replicas(vllm_config)
    speculative = getattr(vllm_config, "speculative_config", None)
    draft = getattr(speculative, "draft_model_config", None)
    draft_tp = getattr(speculative, "draft_tensor_parallel_size", tp) or tp
    if tp == 1 or (draft is not None and draft_tp != tp):
        return 1
    try:
        heads = _kv_head_counts(vllm_config.model_config) | _kv_head_counts(draft)
    except (AttributeError, TypeError, ValueError):  # a model whose heads vLLM cannot say
        return 1
    if len(heads) != 1 or not 0 < (kv_heads := heads.pop()) < tp or tp % kv_heads:
        return 1
    return tp // kv_heads


def _kv_head_counts(model_config: Any) -> set[int]:
    """The total KV head counts of a model's layers (none for no model)."""
    if model_config is None:
        return set()
    arch = getattr(model_config, "model_arch_config", None)
    layers = getattr(arch, "per_layer_overrides", None) or ()
    return {int(model_config.get_total_num_kv_heads())} | {
        int(layer["total_num_kv_heads"]) for layer in layers if "total_num_kv_heads" in layer
    }


def stores_partial_chunks(config: KVTierConfig, kv_role: str | None) -> bool:
    """Whether a prompt's partial last chunk is stored and looked up: ``save_unfull_chunk``,
    which defaults to on for both sides of disaggregated prefill (as in LMCache), so the
    consumer loads all of the prompt but its last token."""
    if config.source_of("save_unfull_chunk") == "default" and kv_role in (
        "kv_producer",
        "kv_consumer",
    ):
        return True
    return config.save_unfull_chunk


def kv_events_enabled(vllm_config: VllmConfig) -> bool:
    """Whether vLLM publishes KV events (``kv_events_config.enable_kv_cache_events``)."""
    events = getattr(vllm_config, "kv_events_config", None)
    return bool(events is not None and events.enable_kv_cache_events)


def worker_rank(vllm_config: VllmConfig) -> int:
    """This worker's rank among the engine's ``world_size`` ranks, numbered as vLLM lays
    them out (pipeline, then prefill context, then tensor parallel, the last varying
    fastest): ``(pp_rank * pcp + pcp_rank) * tp + tp_rank``."""
    parallel = vllm_config.parallel_config
    try:
        from vllm.distributed import parallel_state

        tp, pcp = parallel.tensor_parallel_size, _prefill_context_size(parallel)
        pcp_rank = parallel_state.get_pcp_group().rank_in_group if pcp > 1 else 0
        stage = parallel_state.get_pp_group().rank_in_group
        return (stage * pcp + pcp_rank) * tp + parallel_state.get_tp_group().rank_in_group
    except (ImportError, AssertionError, AttributeError):
        if world_size(vllm_config) > 1:
            raise
        return 0


def token_major_layout(config: KVTierConfig) -> bool:
    """Whether the workers' KV layout addresses single tokens inside a block (decided in
    the scheduler process, which has no KV tensors: by the forced layout or the platform)."""
    if config.kv_layout is not None:
        return LAYOUTS[config.kv_layout].token_major
    from vllm.platforms import current_platform

    return not current_platform.is_cpu()


def check_chunk_size(chunk_size: int, block_size: int | None, whole_blocks: bool) -> None:
    """Refuse a ``chunk_size`` an engine whose KV layout is copied in ``whole_blocks`` of
    ``block_size`` tokens (``token_major_layout`` False) cannot store: one that is not a
    multiple of the block size. Checked at the connector's first hook in the engine core,
    before memory profiling and the KV cache, and by the scheduler side it builds.

    Raises:
        ValueError: naming chunk_size and vLLM's block_size.
    """
    if whole_blocks and block_size and chunk_size % block_size:
        raise ValueError(
            f"chunk_size={chunk_size} must be a multiple of vLLM's block_size="
            f"{block_size}: this engine's KV layout can only be copied in whole blocks"
        )


def window_start(kv_cache_config: Any) -> Callable[[int], int]:
    """``num_computed_tokens -> first token vLLM keeps for a request``: its KV cache
    manager frees the blocks wholly before that token as the request runs (sliding-window
    and chunked-local attention groups) and puts its null block in their place, and gives
    a request that starts at ``num_computed_tokens`` (a prefix hit) blocks from there on
    only. 0 with full attention, and where no config is known. A sliding window's keeps
    its ``extra_retained_tokens`` more (multi-token prediction re-reads them)."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or ()
    spec = getattr(groups[0], "kv_cache_spec", None) if len(groups) == 1 else None
    if specs := getattr(spec, "kv_cache_specs", None):  # layers of one kind, other shapes
        spec = next(iter(specs.values()))
    kinds = {cls.__name__ for cls in type(spec).__mro__}
    if "SlidingWindowSpec" in kinds:
        window = int(spec.sliding_window) + int(getattr(spec, "extra_retained_tokens", 0) or 0)
        return lambda computed: max(0, computed - window + 1)
    if "ChunkedLocalAttentionSpec" in kinds:
        span = int(spec.attention_chunk_size)
        return lambda computed: computed // span * span
    return lambda computed: 0


def key_tags(vllm_config: VllmConfig, backend: str | None) -> tuple[tuple[str, str], ...]:
    """Key tags for chunks whose bytes depend on more than model and KV tensor dtype.

    The CPU backend tiles blocks per instruction set, so its chunks carry that ISA. A
    quantized KV cache (``kv_cache_dtype`` fp8, fp8_e5m2, ...) is a uint8 tensor whatever
    its format, so its chunks carry the format, the model dtype whose values it quantized
    and, for fp8, the platform's fp8 encoding."""
    tags = []
    if backend == "CPU_ATTN":
        isa = cpu_attn_isa(vllm_config)
        if isa is None:
            import platform

            isa = f"unknown-{platform.machine()}"
        tags.append(("cpu_attn_isa", isa))
    cache_dtype = str(getattr(vllm_config.cache_config, "cache_dtype", None) or "auto")
    if cache_dtype != "auto":
        model_dtype = dtype_name(vllm_config.model_config.dtype)
        tags += [("kv_cache_dtype", cache_dtype), ("model_dtype", model_dtype)]
    if cache_dtype.startswith("fp8"):
        # the same name is another encoding on MI300 (e4m3fnuz) than on NVIDIA (e4m3fn)
        tags.append(("fp8_dtype", platform_fp8_dtype()))
    return tuple(tags)


def platform_fp8_dtype() -> str:
    """The fp8 encoding vLLM's kernels use on this machine (``float8_e4m3fn``, or
    ``float8_e4m3fnuz`` on AMD MI300), by vLLM's ``current_platform.fp8_dtype()``."""
    try:
        from vllm.platforms import current_platform

        return dtype_name(current_platform.fp8_dtype())
    except Exception:  # a vLLM without it: the encoding every other platform uses
        return "float8_e4m3fn"


def cpu_attn_isa(vllm_config: VllmConfig) -> str | None:
    """The instruction set vLLM's CPU attention uses for this model (None: unknown)."""
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        return str(
            _get_attn_isa(
                vllm_config.model_config.dtype,
                vllm_config.cache_config.block_size,
                vllm_config.model_config.get_head_size(),
                vllm_config.cache_config.cache_dtype,
            )
        )
    except Exception:
        return None


def attention_backend(vllm_config: VllmConfig, kv_caches: dict[str, torch.Tensor]) -> str | None:
    """Name of the attention backend of the layers in ``kv_caches`` (None if unknown)."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

        backends = get_current_attn_backends(vllm_config, list(kv_caches))
    except Exception:
        logger.warning("kvtier: could not ask vLLM for the attention backend", exc_info=True)
        return None
    names = {backend.get_name() for backend in backends}
    if names & set(_SPARSE_MLA_BACKENDS):
        raise LayoutError(
            f"kvtier cannot store the KV cache of attention backends {sorted(names)}: "
            f"{_SPARSE_MLA_REASON}; setting kv_layout does not change that"
        )
    if len(names) != 1:
        raise ValueError(f"kvtier needs one attention backend for every layer; got {sorted(names)}")
    return names.pop()


# vLLM attention backend -> how its per-layer tensor [NB, H, BS, 2 * D] holds K and V.
_HALVES_BACKENDS = ("FLASH_ATTN", "TRITON_ATTN", "ROCM_ATTN", "ROCM_AITER_FA")
_CPU_BACKENDS = ("CPU_ATTN",)
# MLA backends whose per-layer tensor [NB, 1, BS, D] holds one latent row per token: D
# elements of the KV cache dtype (kv_lora_rank + rope dims; a quantized cache's row is its
# bytes, with per-token scales inline where the format has them).
_MLA_BACKENDS = (
    "CPU_MLA",
    "AMX_MLA",
    "TRITON_MLA",
    "FLASHMLA",
    "FLASH_ATTN_MLA",
    "FLASHINFER_MLA",
    "CUTLASS_MLA",
    "TOKENSPEED_MLA",
    "ROCM_AITER_MLA",
    "AITER_TRITON_MLA",
)
# Sparse MLA backends, and the indexer caches that always come with them.
_SPARSE_MLA_BACKENDS = (
    "FLASHMLA_SPARSE",
    "FLASH_ATTN_MLA_SPARSE",
    "FLASHINFER_MLA_SPARSE",
    "FLASHINFER_MLA_SPARSE_SM90",
    "FLASHINFER_MLA_SPARSE_SM120",
    "ROCM_AITER_MLA_SPARSE",
    "XPU_MLA_SPARSE",
    "DEEPSEEK_V32_INDEXER",
    "DEEPSEEK_V4_INDEXER",
    "DEEPSEEK_V41_INDEXER",
    "DEEPSEEK_V41_SPARSE_INDEXER",
    "DEEPSEEK_V41_ROCM_MXFP4_INDEXER",
    "DEEPSEEK_SPARSE_SWA",
)
_SPARSE_MLA_REASON = (
    "sparse MLA (DeepSeek-V3.2/V4, GLM-5) picks the tokens it attends to with an indexer "
    "whose keys sit in caches of their own, which kvtier does not store; a prefix loaded "
    "without them would attend to the wrong tokens"
)


def detect_paged_kv(
    kv_caches: dict[str, torch.Tensor],
    backend: str | None,
    forced_layout: str | None = None,
    block_size: int | None = None,
) -> PagedKV:
    """Describe vLLM's KV tensors as a ``PagedKV``.

    Args:
        kv_caches: layer name -> that layer's KV tensor, in model order.
        backend: vLLM's attention backend name (``AttentionBackend.get_name()``).
        forced_layout: a layout name from ``kvtier_kernels.LAYOUTS`` that overrides
            detection (``kv_layout`` in the config).
        block_size: tokens in the blocks vLLM's scheduler hands out
            (``cache_config.block_size``); None: the tensors' own. Where the backend's
            kernels take smaller blocks, vLLM splits each of its blocks into kernel
            blocks and hands out a tensor of those; an MLA cache's are joined back.

    Raises:
        LayoutError: a backend or tensor shape kvtier does not know how to read, a sparse
            MLA backend, or blocks of another size than ``block_size`` that cannot be
            joined; the message names the backend, the shape and strides, and the
            ``kv_layout`` key.
    """
    tensors = list(kv_caches.values())
    if not tensors:
        raise LayoutError("vLLM registered no KV cache tensors")
    first = tensors[0]
    described = (
        f"attention backend {backend!r}, per-layer tensor shape {tuple(first.shape)} "
        f"strides {first.stride()} dtype {first.dtype}"
    )
    if backend in _SPARSE_MLA_BACKENDS:
        raise LayoutError(
            f"kvtier cannot store the KV cache of {described}: {_SPARSE_MLA_REASON}; "
            "setting kv_layout does not change that"
        )
    if forced_layout is not None:
        name = forced_layout
    elif backend in _CPU_BACKENDS:
        name = "vllm_cpu"
    elif backend in _MLA_BACKENDS:
        name = "mla"
    elif backend in _HALVES_BACKENDS and first.dim() == 4:
        # [NB, H, BS, 2D] view; NHD storage (LBNHC) has heads inside tokens.
        name = "vllm_nhd" if first.stride(1) < first.stride(2) else "vllm_hnd"
    else:
        raise LayoutError(
            f"kvtier cannot read the KV cache of {described}: supported backends are "
            f"{', '.join(_CPU_BACKENDS + _HALVES_BACKENDS + _MLA_BACKENDS)}; set kv_layout "
            f"to one of "
            f"{', '.join(LAYOUTS)} if you know the layout"
        )
    if name == "vllm_cpu" and not first.is_contiguous():
        raise LayoutError(f"vllm_cpu layout needs contiguous per-layer tensors; got {described}")
    if name == "mla" and first.dim() == 4 and first.shape[1] == 1:
        # vLLM hands MLA's latent cache out as [NB, H=1, BS, D]: the same rows as [NB, BS, D].
        tensors = [tensor.select(1, 0) for tensor in tensors]
    token_dim = _KERNEL_BLOCK_TOKEN_DIMS.get((name, tensors[0].dim()))
    if block_size is not None and token_dim is not None:
        tensors = [join_kernel_blocks(tensor, block_size, token_dim) for tensor in tensors]
    try:
        paged = PagedKV(name, tensors)
    except LayoutError as error:
        raise LayoutError(f"{described} does not fit layout {name!r}: {error}") from None
    if block_size is not None and paged.block_size != block_size:
        raise LayoutError(
            f"{described} read as layout {name!r} has blocks of {paged.block_size} tokens, "
            f"vLLM's scheduler blocks of {block_size}: its kernels split each block, in a "
            "way kvtier cannot join back; set block_size to the kernel's, or kv_layout if "
            "the layout is another"
        )
    return paged


# (layout, dims) -> the token dim of a tensor whose kernel blocks may be joined back:
# MLA's [NB, BS, D], FlashAttention's [NB, H, BS, 2D]. The CPU layout's blocks are never
# split (its K and V rows run per block and head).
_KERNEL_BLOCK_TOKEN_DIMS = {("mla", 3): 1, ("vllm_nhd", 4): 2, ("vllm_hnd", 4): 2}


def join_kernel_blocks(tensor: torch.Tensor, block_size: int, token_dim: int) -> torch.Tensor:
    """Kernel blocks of ``BS / r`` tokens (dim 0, tokens in ``token_dim``) -> the
    scheduler's blocks of ``block_size``, as one strided view.

    vLLM splits a block into ``r`` kernel blocks where the backend's kernels take smaller
    blocks (``create_kv_cache_views``): where a block's kernel blocks are one run of token
    rows (MLA; FlashAttention's NHD storage, heads inside tokens), they are joined. A
    tensor that is not so is returned as it is, and ``detect_paged_kv`` refuses it.
    """
    shape, strides = list(tensor.shape), list(tensor.stride())
    kernel_block_size = shape[token_dim]
    if kernel_block_size >= block_size or block_size % kernel_block_size:
        return tensor
    ratio = block_size // kernel_block_size
    if shape[0] % ratio or strides[0] != kernel_block_size * strides[token_dim]:
        return tensor
    shape[0], shape[token_dim], strides[0] = shape[0] // ratio, block_size, strides[0] * ratio
    return tensor.as_strided(shape, strides, tensor.storage_offset())


def host_kv_cache_bytes(kv_caches: dict[str, torch.Tensor]) -> int:
    """Bytes of the engine's KV cache in this machine's memory: the storage of every KV
    tensor on the CPU, once per storage (vLLM's layers are views into one buffer)."""
    storages = {
        tensor.untyped_storage().data_ptr(): tensor.untyped_storage().nbytes()
        for tensor in kv_caches.values()
        if tensor.device.type == "cpu"
    }
    return sum(storages.values())
