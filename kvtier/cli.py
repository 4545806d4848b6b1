"""The ``kvtier`` command line.

kvtier info     versions, devices seen, kernel backends, config in effect
kvtier demo     a real vLLM engine: time to first token cold vs a kvtier hit
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import platform
import sys
from collections.abc import Sequence

from kvtier.config import ConfigError, load_config


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _devices() -> list[str]:
    import torch

    devices = [f"cpu ({platform.processor() or platform.machine()})"]
    if torch.cuda.is_available():
        runtime = f"HIP {torch.version.hip}" if torch.version.hip else f"CUDA {torch.version.cuda}"
        for i in range(torch.cuda.device_count()):
            devices.append(f"cuda:{i} {torch.cuda.get_device_name(i)} ({runtime})")
    return devices


def cmd_info(args: argparse.Namespace) -> int:
    from kvtier_kernels import registry

    try:
        config = load_config(config_file=args.config)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    info = {
        "versions": {
            "kvtier": _version("kvtier"),
            "python": platform.python_version(),
            **{dist: _version(dist) for dist in ("torch", "triton", "numpy", "vllm")},
        },
        "devices": _devices(),
        "kernel_backends": registry.available_backends(),
        "kernel_ops": {op: registry.backends_for(op) for op in registry.ops()},
        "config": [
            {"key": key, "value": value, "source": config.source_of(key)}
            for key, value in config.to_dict().items()
        ],
        "ignored_lmcache_keys": list(config.ignored_lmcache_keys),
    }
    if args.json:
        print(json.dumps(info, indent=2, default=str))
        return 0
    print("kvtier", info["versions"]["kvtier"])
    print("\nversions:")
    for name, version in info["versions"].items():
        print(f"  {name:<8} {version}")
    print("\ndevices:")
    for device in info["devices"]:
        print(f"  {device}")
    print("\nkernel backends:")
    for backend, status in info["kernel_backends"].items():
        print(f"  {backend:<10} {status}")
    print("\nkernel ops:")
    for op, backends in info["kernel_ops"].items():
        print(f"  {op:<16} {', '.join(backends)}")
    print("\nconfig in effect:")
    for row in info["config"]:
        print(f"  {row['key']:<20} {row['value']!s:<16} ({row['source']})")
    if info["ignored_lmcache_keys"]:
        print("  ignored LMCache keys:", ", ".join(info["ignored_lmcache_keys"]))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    if not args.synthetic:
        from kvtier.demo_vllm import run_vllm_demo

        return run_vllm_demo(tokens=args.tokens or 4000, chunk_size=args.chunk_size)
    from kvtier.demo import run_demo

    return run_demo(
        num_tokens=args.tokens or 4096,
        num_layers=args.layers,
        num_kv_heads=args.kv_heads,
        head_size=args.head_size,
        block_size=args.block_size,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvtier", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    info = sub.add_parser("info", help="versions, devices, kernel backends, config in effect")
    info.add_argument("--config", help="YAML config file (default: KVTIER_CONFIG_FILE)")
    info.add_argument("--json", action="store_true", help="print JSON")
    info.set_defaults(func=cmd_info)

    demo = sub.add_parser(
        "demo", help="a real vLLM engine: cold prefill vs a kvtier hit (--synthetic: no engine)"
    )
    demo.add_argument(
        "--synthetic",
        action="store_true",
        help="store → evict → retrieve on a synthetic paged KV cache, without vLLM",
    )
    demo.add_argument("--tokens", type=int, default=None, help="prompt length (4000 / 4096)")
    demo.add_argument("--chunk-size", type=int, default=256, help="kvtier chunk size (engine)")
    demo.add_argument("--layers", type=int, default=32, help="synthetic: layers")
    demo.add_argument("--kv-heads", type=int, default=8, help="synthetic: KV heads")
    demo.add_argument("--head-size", type=int, default=128, help="synthetic: head size")
    demo.add_argument("--block-size", type=int, default=16, help="synthetic: block size")
    demo.set_defaults(func=cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
