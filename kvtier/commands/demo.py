"""``kvtier demo``: a real vLLM engine, cold prefill against a kvtier hit (``kvtier.demo_vllm``);
with ``--synthetic``, store → evict → retrieve on a synthetic paged KV cache (``kvtier.demo``)."""

from __future__ import annotations

import argparse
import sys

from kvtier.config import ConfigError, load_config
from kvtier.machine import PoolTooLarge

HELP = "a real vLLM engine: cold prefill vs a kvtier hit (--synthetic: no engine)"
DESCRIPTION = (
    "Serve a long prompt with a vLLM engine and kvtier on a random-weight Llama built "
    "locally (nothing is downloaded): time to first token cold, then loaded from kvtier's "
    "memory, then from its disk tier in a new engine process; the loaded KV is checked "
    "bit-identical to the cold prefill's. With --synthetic, store → evict → retrieve on a "
    "synthetic paged KV cache instead, without vLLM. Exit 0 when every check held."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--synthetic",
        action="store_true",
        help="store → evict → retrieve on a synthetic paged KV cache, without vLLM",
    )
    parser.add_argument(
        "--tokens",
        type=int,
        default=None,
        help="prompt length (default 4128 with vLLM, 16 chunks with --synthetic: 4096)",
    )
    parser.add_argument("--chunk-size", type=int, default=256, help="kvtier chunk size")
    parser.add_argument("--layers", type=int, default=32, help="synthetic: layers")
    parser.add_argument("--kv-heads", type=int, default=8, help="synthetic: KV heads")
    parser.add_argument("--head-size", type=int, default=128, help="synthetic: head size")
    parser.add_argument("--block-size", type=int, default=16, help="synthetic: block size")


_POSITIVE_FLAGS = ("tokens", "chunk_size", "layers", "kv_heads", "head_size", "block_size")


def run(args: argparse.Namespace) -> int:
    """0 when the demo's checks held, 1 otherwise (or without vLLM), 2 on a bad argument."""
    for dest in _POSITIVE_FLAGS:
        value = getattr(args, dest)
        if value is not None and value < 1:
            flag = "--" + dest.replace("_", "-")
            print(f"kvtier demo: {flag} {value}: expected an integer >= 1", file=sys.stderr)
            return 2
    try:  # before any engine starts: the engine would refuse these only in its process
        load_config({"chunk_size": args.chunk_size}, env={})
    except ConfigError as error:
        print(f"kvtier demo: --chunk-size {args.chunk_size}: {error}", file=sys.stderr)
        return 2
    if not args.synthetic:
        from kvtier.demo_vllm import MAX_PROMPT_TOKENS, run_vllm_demo

        tokens = args.tokens or 4128
        if not args.chunk_size < tokens <= MAX_PROMPT_TOKENS:
            print(
                f"kvtier demo: --tokens {tokens}: expected more than --chunk-size "
                f"({args.chunk_size}: kvtier loads whole chunks, and the last token is "
                f"always computed) and at most {MAX_PROMPT_TOKENS} (the demo model's context)",
                file=sys.stderr,
            )
            return 2
        return run_vllm_demo(tokens=tokens, chunk_size=args.chunk_size)
    from kvtier.demo import run_demo, tokens_multiple

    tokens = args.tokens or 16 * args.chunk_size
    multiple = tokens_multiple(args.chunk_size)
    if tokens % multiple:
        print(
            f"kvtier demo: --tokens {tokens}: with --synthetic, a multiple of {multiple} "
            f"(2 x --chunk-size {args.chunk_size}: whole chunks, half of them the shared "
            "system prompt)",
            file=sys.stderr,
        )
        return 2
    try:
        return run_demo(
            num_tokens=tokens,
            num_layers=args.layers,
            num_kv_heads=args.kv_heads,
            head_size=args.head_size,
            block_size=args.block_size,
            chunk_size=args.chunk_size,
        )
    except ConfigError as error:
        print(f"kvtier demo: {error}", file=sys.stderr)
        return 2
    except PoolTooLarge as error:
        print(
            f"kvtier demo: --synthetic with --tokens {tokens}, --layers {args.layers}, "
            f"--kv-heads {args.kv_heads}, --head-size {args.head_size}: the KV cache and "
            f"the CPU tier {error}; give a smaller shape",
            file=sys.stderr,
        )
        return 2
