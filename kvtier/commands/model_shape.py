"""The flags that ``kvtier precompile`` and ``kvtier tune`` share: the model shape they
give, and the device ``--device`` names."""

from __future__ import annotations

import argparse

import torch


def add_shape_arguments(shape) -> None:
    """The model-shape flags ``kvtier precompile`` and ``kvtier tune`` share (read by
    ``shape_from_args``); ``--layout``, ``--rotary-dim`` and ``--chunk-size`` are each
    command's own."""
    shape.add_argument(
        "--model-config", help="a HuggingFace-style config.json (or a directory holding one)"
    )
    shape.add_argument("--layers", type=int, help="attention layers (default 32)")
    shape.add_argument("--kv-heads", type=int, help="KV heads per layer (default 8)")
    shape.add_argument("--head-size", type=int, help="head size (default 128; MLA: latent dim)")
    shape.add_argument("--block-size", type=int, help="engine block size (default 16)")
    shape.add_argument("--dtype", help="KV cache dtype: bfloat16 (default), float16, float32, fp8")


def shape_from_args(args: argparse.Namespace, *, chunk_size: int, layout: str | None):
    """The model shape of ``kvtier precompile`` / ``kvtier tune`` flags: ``--model-config``
    with flag overrides, else the flags over a Llama-3-8B default."""
    from kvtier_kernels.dtypes import parse_dtype
    from kvtier_kernels.tuning.shapes import ModelShape, model_shape_from_config

    overrides = {
        "num_layers": args.layers,
        "num_kv_heads": args.kv_heads,
        "head_size": args.head_size,
        "block_size": args.block_size,
        "chunk_size": chunk_size,
        "dtype": parse_dtype(args.dtype) if args.dtype else None,
        "layout": layout,
        "rotary_dim": args.rotary_dim,
    }
    if args.model_config:
        return model_shape_from_config(args.model_config, **overrides)
    defaults = {"num_layers": 32, "num_kv_heads": 8, "head_size": 128}  # Llama-3-8B
    return ModelShape(**{**defaults, **{k: v for k, v in overrides.items() if v is not None}})


def device_from_flag(requested: str) -> torch.device:
    """The device ``--device requested`` names, checked before any work: a GPU index that
    torch does not see is refused here, not by a traceback from the first allocation.

    Raises:
        ValueError: not a device name, or a GPU index past the GPUs torch sees.
    """
    try:
        device = torch.device(requested)
    except RuntimeError:
        raise ValueError(f"--device {requested!r}: not a device (cuda, cuda:N or cpu)") from None
    if device.type == "cuda" and device.index is not None and torch.cuda.is_available():
        count = torch.cuda.device_count()
        if device.index >= count:
            raise ValueError(
                f"--device {requested!r}: torch sees {count} GPU(s), cuda:0 to cuda:{count - 1}"
            )
    return device
