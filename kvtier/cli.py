"""The ``kvtier`` command line.

kvtier info     versions, devices seen, kernel backends, config in effect
kvtier demo     a real vLLM engine: time to first token cold vs a kvtier hit
kvtier kernels  kernel ops, backends available, what `auto` picks, tuning files in effect
kvtier precompile  compile the Triton kernels an engine will use (no JIT stall on its first request)
kvtier tune     sweep the Triton kernels' launch parameters on the local GPU; write tuning files
kvtier serve    a node-level cache server that engines share (remote_url: kvtier://host:port)
kvtier status   a running kvtier serve's health, tiers and counters
kvtier proxy    an OpenAI-compatible prefill/decode router in front of vLLM instances
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from collections.abc import Sequence

from kvtier.config import ConfigError, load_config
from kvtier.machine import (
    auto_backends,
    devices,
    dist_version,
    package_version,
    search_path_rows,
    torch_build,
    tuning_in_effect,
)
from kvtier.precompile import add_arguments as add_precompile_arguments
from kvtier.precompile import add_shape_arguments, run_precompile, shape_from_args
from kvtier.proxy.command import add_arguments as add_proxy_arguments
from kvtier.proxy.command import run_proxy
from kvtier.server.serve import add_arguments, run_serve
from kvtier.server.status import add_arguments as add_status_arguments
from kvtier.server.status import run_status
from kvtier_kernels.precompile import cache_dir

KVTIER_MODULE = "kvtier.integration.vllm"  # kv_connector_module_path in vLLM's config


def _extra_config(kv_transfer_config: str | None) -> dict[str, object] | None:
    """kvtier's part of a vLLM ``--kv-transfer-config`` JSON, checked as vLLM would use it.

    Raises:
        ConfigError: the JSON does not parse, or does not name kvtier's connector.
    """
    if kv_transfer_config is None:
        return None
    try:
        transfer = json.loads(kv_transfer_config)
    except ValueError as exc:
        raise ConfigError([f"--kv-transfer-config is not JSON: {exc}"]) from None
    if not isinstance(transfer, dict):
        raise ConfigError(["--kv-transfer-config must be a JSON object"])
    problems = []
    if transfer.get("kv_connector") != "KVTierConnector":
        problems.append(
            f"kv_connector is {transfer.get('kv_connector')!r}; kvtier's is 'KVTierConnector'"
        )
    module = str(transfer.get("kv_connector_module_path"))
    if module != KVTIER_MODULE and not module.startswith(KVTIER_MODULE + "."):
        problems.append(
            f"kv_connector_module_path is {transfer.get('kv_connector_module_path')!r}; "
            f"kvtier's is {KVTIER_MODULE!r}"
        )
    extra = transfer.get("kv_connector_extra_config") or {}
    if not isinstance(extra, dict):
        problems.append("kv_connector_extra_config must be a JSON object")
    if problems:
        raise ConfigError(problems)
    return extra


def cmd_info(args: argparse.Namespace) -> int:
    from kvtier_kernels import registry

    try:
        extra = _extra_config(args.kv_transfer_config)
        config = load_config(overrides=extra, config_file=args.config)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    info = {
        "versions": {
            "kvtier": dist_version("kvtier"),
            "python": platform.python_version(),
            **{name: package_version(name) for name in ("torch", "triton", "numpy", "vllm")},
        },
        "torch_build": torch_build(),
        "devices": devices(),
        "kernel_backends": registry.available_backends(),
        "kernel_ops": {op: registry.backends_for(op) for op in registry.ops()},
        "kernel_auto": auto_backends(registry),
        "tuning_search_path": search_path_rows(),
        "tuning_in_effect": tuning_in_effect(),
        "triton_cache": cache_dir(),
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
    print(f"  torch build: {info['torch_build']}")
    print("\ndevices:")
    for device in info["devices"]:
        print(f"  {device}")
    print("\nkernel backends:")
    for backend, status in info["kernel_backends"].items():
        print(f"  {backend:<10} {status}")
    print("\nkernel ops (backends here; what auto picks, and why):")
    for op, backends in info["kernel_ops"].items():
        auto = info["kernel_auto"][op]
        print(f"  {op:<16} {', '.join(backends):<26} auto: {auto['backend']} ({auto['why']})")
    print("\ntuning files searched in:")
    for row in info["tuning_search_path"]:
        print(f"  {row['path']}  [{row['kind']}]{'' if row['exists'] else '  (missing)'}")
    print("tuning files in effect:" if info["tuning_in_effect"] else "tuning files in effect: none")
    for row in info["tuning_in_effect"]:
        print(f"  {row['op']} ({row['backend']}, {row['dtype']}): {row['path']}")
    if info["tuning_in_effect"]:
        print("  (other ops, dtypes and shapes: the built-in heuristics)")
    else:
        print("  (the kernels use their built-in launch heuristics)")
    triton_cache = info["triton_cache"] or "none (triton not installed)"
    print(f"Triton kernel cache (TRITON_CACHE_DIR; kvtier precompile fills it): {triton_cache}")
    print("\nconfig in effect:")
    for row in info["config"]:
        print(f"  {row['key']:<20} {row['value']!s:<16} ({row['source']})")
    if info["ignored_lmcache_keys"]:
        print("  ignored LMCache keys:", ", ".join(info["ignored_lmcache_keys"]))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    if not args.synthetic:
        from kvtier.demo_vllm import run_vllm_demo

        return run_vllm_demo(tokens=args.tokens or 4128, chunk_size=args.chunk_size)
    from kvtier.demo import run_demo

    return run_demo(
        num_tokens=args.tokens or 4096,
        num_layers=args.layers,
        num_kv_heads=args.kv_heads,
        head_size=args.head_size,
        block_size=args.block_size,
    )


def cmd_kernels(args: argparse.Namespace) -> int:
    import torch

    from kvtier_kernels import registry
    from kvtier_kernels.tuning import files as tuning_files
    from kvtier_kernels.tuning import lookup as tuning_lookup

    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    # The backend whose launch parameters apply on this machine's device.
    tuning_backend = "triton" if on_gpu else "interpret"
    name = tuning_files.device_name(device) or str(device)
    ops = {}
    for op in registry.ops():
        backends = registry.backends_for(op)
        files = (
            tuning_lookup.files_in_effect(op, tuning_backend, name)
            if op in tuning_files.TUNABLES
            else []
        )
        ops[op] = {
            "backends": backends,
            "auto": registry.pick(op, "auto", device),
            "tunable": op in tuning_files.TUNABLES,
            "tuning_files": [
                {"dtype": f.dtype, "path": str(f.path), "status": f.status, "detail": f.detail}
                for f in files
            ],
        }
    report = {
        "kernel_backends": registry.available_backends(),
        "device": str(device),
        "device_name": name,
        "tuning_backend": tuning_backend,
        "tuning_search_path": search_path_rows(),
        "ops": ops,
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print("kernel backends:")
    for backend, status in report["kernel_backends"].items():
        print(f"  {backend:<10} {status}")
    where = (
        f"{device} ({name})"
        if on_gpu
        else "cpu (no GPU: Triton kernels run here only as 'interpret')"
    )
    print(f"\ndevice: {where}")
    print(f"tuning files for backend {tuning_backend!r} on {name!r}, searched in order:")
    for row in report["tuning_search_path"]:
        state = "" if row["exists"] else "  (missing)"
        print(f"  {row['path']}  [{row['kind']}]{state}")
    print(f"\n  {'op':<16} {'backends':<26} {'auto':<8} tuning in effect")
    for op, row in ops.items():
        lead = f"  {op:<16} {', '.join(row['backends']):<26} {row['auto']:<8} "
        if not row["tunable"]:
            print(f"{lead}built-in heuristics (not tunable)")
            continue
        effective = [f for f in row["tuning_files"] if f["status"] == "in effect"]
        if effective:
            print(f"{lead}tuning files below; other dtypes / shapes: built-in heuristics")
        else:
            print(f"{lead}built-in heuristics")
        for f in row["tuning_files"]:
            print(f"      {f['status']}: {f['dtype']}: {f['path']} ({f['detail']})")
    return 0


_NO_GPU = (
    "needs a CUDA or ROCm GPU that Triton can drive, and {why}. Launch parameters tuned "
    "under Triton's interpreter on the CPU would be meaningless, so nothing was tuned; the "
    "kernels keep their built-in heuristics (and any tuning files already on the search "
    "path: see `kvtier kernels`)."
)


def _tuning_target(requested: str) -> tuple[object, str, object] | str:
    """``(device, backend, timer)`` for ``kvtier tune``, or why there is none."""
    import torch

    from kvtier_kernels import registry
    from kvtier_kernels.tuning import sweep as tuning

    if not torch.cuda.is_available():
        return _NO_GPU.format(why="torch sees none (torch.cuda.is_available() is False)")
    if registry.available_backends()["triton"].startswith("triton not installed"):
        return _NO_GPU.format(why="triton is not installed")
    device = torch.device(requested)
    if device.type != "cuda":
        return f"--device must be a GPU (cuda or cuda:N); got {requested!r}"
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device, "triton", tuning.event_timer(device)


def cmd_tune(args: argparse.Namespace) -> int:
    from kvtier_kernels.tuning import files as tuning_files
    from kvtier_kernels.tuning import lookup as tuning_lookup
    from kvtier_kernels.tuning import sweep as tuning

    target = _tuning_target(args.device)
    if isinstance(target, str):
        print(f"kvtier tune: {target}", file=sys.stderr)
        return 2
    device, backend, timer = target
    try:
        shape = shape_from_args(args, chunk_size=args.chunk_size, layout=args.layout)
        ops = [op.strip() for op in args.ops.split(",") if op.strip()]
        tunable = tuning_files.TUNABLES
        unknown = sorted(set(ops) - set(tunable))
        if unknown:
            raise ValueError(f"--ops: unknown {unknown}; tunable ops: {', '.join(tunable)}")
    except ValueError as error:
        print(f"kvtier tune: {error}", file=sys.stderr)
        return 2
    out_dir = args.out or tuning_lookup.user_dirs()[0]
    print(f"kvtier tune on {tuning_files.device_name(device)} ({device}, backend {backend})")
    print(f"shape: {shape.describe()}")
    report = tuning.tune(
        shape,
        device=device,
        backend=backend,
        timer=timer,
        out_dir=out_dir,
        ops=ops,
        chunk_memory=args.chunk_memory,
        quick=args.quick,
        warmup=args.warmup,
        repeats=args.repeats,
        copy_engine=not args.no_copy_engine,
        copy_engine_max_bytes=args.copy_engine_max_mib << 20,
        progress=lambda line: print(line, file=sys.stderr, flush=True),
    )
    print()
    for note in report.notes:
        print(note)
    failed = 0
    for result in report.results:
        problem = result.problem
        checked, rejected = len(result.timed), len(result.rejected)
        if result.best is None:
            failed += 1
            first = result.rejected[0][1] if result.rejected else "no candidates"
            print(f"{problem.describe()}: every candidate was rejected ({first}); not written")
            continue
        entry = result.entry()
        config = " ".join(f"{k}={v}" for k, v in entry.config.items())
        line = f"{problem.describe()}: {config}  {entry.median_us:.2f} us"
        if entry.gbps is not None:
            line += f"  {entry.gbps:.1f} GB/s"
        if entry.heuristic_us:
            line += f"; heuristic {entry.heuristic_us:.2f} us ({entry.heuristic_us / entry.median_us:.2f}x)"
        print(f"{line}; {checked} checked, {rejected} rejected")
    for op, figures in report.copy_engine.items():
        crossover = figures.crossover_bytes
        verdict = (
            f"copy_ beats the kernel from {crossover} B ({crossover / 2**20:.3g} MiB) "
            "contiguous runs of pages"
            if crossover is not None
            else "the kernel won at every size measured"
        )
        print(f"copy engine, {op} ({figures.direction}): {verdict}")
    if report.written:
        print("wrote:")
        for path in report.written:
            print(f"  {path}")
    return 1 if failed else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvtier", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    info = sub.add_parser("info", help="versions, devices, kernel backends, config in effect")
    info.add_argument("--config", help="YAML config file (default: KVTIER_CONFIG_FILE)")
    info.add_argument("--json", action="store_true", help="print JSON")
    info.add_argument(
        "--kv-transfer-config",
        metavar="JSON",
        help="check vLLM's --kv-transfer-config (the same JSON) before starting the engine, "
        "and show the kvtier config it gives",
    )
    info.set_defaults(func=cmd_info)

    demo = sub.add_parser(
        "demo", help="a real vLLM engine: cold prefill vs a kvtier hit (--synthetic: no engine)"
    )
    demo.add_argument(
        "--synthetic",
        action="store_true",
        help="store → evict → retrieve on a synthetic paged KV cache, without vLLM",
    )
    demo.add_argument(
        "--tokens",
        type=int,
        default=None,
        help="prompt length (default 4128 with vLLM, 4096 with --synthetic)",
    )
    demo.add_argument("--chunk-size", type=int, default=256, help="kvtier chunk size (engine)")
    demo.add_argument("--layers", type=int, default=32, help="synthetic: layers")
    demo.add_argument("--kv-heads", type=int, default=8, help="synthetic: KV heads")
    demo.add_argument("--head-size", type=int, default=128, help="synthetic: head size")
    demo.add_argument("--block-size", type=int, default=16, help="synthetic: block size")
    demo.set_defaults(func=cmd_demo)

    kernels = sub.add_parser(
        "kernels", help="kernel ops, backends available, what auto picks, tuning files in effect"
    )
    kernels.add_argument("--json", action="store_true", help="print JSON")
    kernels.set_defaults(func=cmd_kernels)

    precompile = sub.add_parser(
        "precompile",
        help="compile the Triton kernels an engine will use, into Triton's cache",
        description="Compile the kernels an engine with this model and kvtier config will "
        "launch (every token count up to chunk_size) so its first request does not wait for "
        "Triton's JIT. They are kept in Triton's cache (TRITON_CACHE_DIR). Without a GPU "
        "there is nothing to compile; it says so and exits 0. See docs/portability.md.",
    )
    add_precompile_arguments(precompile)
    precompile.set_defaults(func=run_precompile)

    tune = sub.add_parser(
        "tune",
        help="sweep the Triton kernels' launch parameters on the local GPU; write tuning files",
        description="Sweep each kernel's launch parameters on the local GPU for one model's "
        "KV shape, check every candidate against the torch reference, time the rest "
        "(CUDA/HIP events, median) and write per-device JSON tuning files that the "
        "launchers load at run time. Also measures where a copy-engine transfer beats the "
        "paged-copy kernel. Refuses without a GPU.",
    )
    shape = tune.add_argument_group("model shape (flags override --model-config)")
    add_shape_arguments(shape)
    shape.add_argument("--chunk-size", type=int, help="kvtier chunk size (default 256)")
    shape.add_argument("--layout", help="engine KV layout (default vllm_nhd; MLA models: mla)")
    shape.add_argument("--rotary-dim", type=int, help="rotary dims per head (0: no RoPE)")
    tune.add_argument(
        "--ops",
        default="paged_gather,paged_scatter,rope_rerotate",
        help="comma-separated ops to tune (default: all)",
    )
    tune.add_argument(
        "--chunk-memory",
        choices=("pinned", "device"),
        default="pinned",
        help="where the paged copies' chunk buffer lives while timing (default pinned host)",
    )
    tune.add_argument("--quick", action="store_true", help="a smaller sweep (4 or 8 warps, ...)")
    tune.add_argument("--warmup", type=int, default=5, help="untimed runs per candidate")
    tune.add_argument("--repeats", type=int, default=25, help="timed runs per candidate (median)")
    tune.add_argument(
        "--no-copy-engine", action="store_true", help="skip the copy-engine crossover measurement"
    )
    tune.add_argument(
        "--copy-engine-max-mib",
        type=int,
        default=64,
        help="largest contiguous run of pages timed for the crossover (MiB, default 64)",
    )
    tune.add_argument("--device", default="cuda", help="the GPU to tune (default: current)")
    tune.add_argument(
        "--out",
        help="directory to write into (default: KVTIER_TUNING_DIR or ~/.cache/kvtier/tuning)",
    )
    tune.set_defaults(func=cmd_tune)

    serve = sub.add_parser(
        "serve",
        help="a node-level cache server shared by the engines (remote_url: kvtier://host:port)",
        description="Hold chunks for every engine of this node: a bounded memory tier, "
        "optionally a disk tier and a remote written through. Engines use it with "
        "remote_url: kvtier://HOST:PORT. See docs/server.md.",
    )
    add_arguments(serve)
    serve.set_defaults(func=run_serve)

    status = sub.add_parser(
        "status",
        help="a running kvtier serve's health, tiers and counters",
        description="Read a kvtier server's counters over its cache port. Exit 0: ok, "
        "1: degraded (its remote is down), 2: unreachable or refused.",
    )
    add_status_arguments(status)
    status.set_defaults(func=run_status)

    proxy = sub.add_parser(
        "proxy",
        help="an OpenAI-compatible prefill/decode router in front of vLLM instances",
        description="Serve /v1/completions and /v1/chat/completions: each request runs "
        "on a prefill instance with max_tokens=1 (its KV goes to the kvtier tier the "
        "engines share), then goes unchanged to a decode instance, whose answer "
        "(streamed or not) is passed back. Also /v1/models, /health and /metrics. "
        "Needs aiohttp: pip install 'kvtier[proxy]'. See docs/proxy.md.",
    )
    add_proxy_arguments(proxy)
    proxy.set_defaults(func=run_proxy)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
