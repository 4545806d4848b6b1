"""``kvtier info``: versions, devices, kernel backends, tuning files and the config in effect;
with ``--kv-transfer-config``, vLLM's JSON checked before an engine starts."""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

from kvtier.commands import kv_transfer
from kvtier.commands.paths import why_not_writable
from kvtier.config import ConfigError, KVTierConfig, load_config
from kvtier.machine import (
    auto_backends,
    devices,
    dist_version,
    host_memory,
    package_version,
    search_path_note,
    search_path_rows,
    torch_build,
    tuning_in_effect,
)
from kvtier.paged_io import use_tuning_dir
from kvtier_kernels.precompile import cache_dir

HELP = "versions, devices, kernel backends, config in effect"
DESCRIPTION = (
    "Print what this install of kvtier runs with: the versions of kvtier, Python, torch, "
    "Triton, numpy and vLLM; the devices torch sees; the kernel backends available, each "
    "op's backends and what kernel_backend auto picks for it; the tuning files searched "
    "and in effect; Triton's kernel cache; and every config key in effect, with where its "
    "value came from (--config, KVTIER_* and LMCACHE_* variables, defaults). With "
    "--kv-transfer-config, "
    "check vLLM's JSON as the engine would take it before starting one. Exit 0, or 2 on a "
    "config error."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        help="YAML config file (default: KVTIER_CONFIG_FILE); as that variable, it comes "
        "after a config_file in --kv-transfer-config's kv_connector_extra_config",
    )
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument(
        "--kv-transfer-config",
        metavar="JSON",
        help="check vLLM's --kv-transfer-config (the same JSON) before starting the engine, "
        "and show the kvtier config it gives",
    )


def _extra_config(kv_transfer_config: str | None, problems: list[str]) -> dict[str, object] | None:
    """kvtier's part of a vLLM ``--kv-transfer-config`` JSON, checked as vLLM would use it
    (``kv_transfer``): what vLLM or kvtier's connector would refuse is added to ``problems``.

    Raises:
        ConfigError: the JSON does not parse, or is not an object.
    """
    if kv_transfer_config is None:
        return None
    return kv_transfer.kvtier_extra_config(kv_transfer.parse(kv_transfer_config), problems)


def _config_file(given: str | None, extra: dict[str, object] | None) -> str | None:
    """The ``--config`` file to read: it stands where ``KVTIER_CONFIG_FILE`` does, so a
    ``config_file`` in the extra config goes before it, as in the engine (None: that one)."""
    return given if extra is None or extra.get("config_file") in (None, "") else None


def _disk_problem(local_disk: str | None) -> str | None:
    """Why the engine could not use ``local_disk`` (it creates the directory when it
    starts: the nearest existing ancestor must be a writable directory), or None."""
    if local_disk is None:
        return None
    reason = why_not_writable(Path(local_disk))
    return f"local_disk {local_disk!r}: {reason}" if reason else None


def _pool_problem(config: KVTierConfig) -> str | None:
    """Why no engine on this machine could allocate the CPU pool ``config`` sets (it is
    larger than the machine's memory, e.g. a size given in bytes), or None; the default
    pool is left to the engine, so that ``kvtier info`` runs on any machine."""
    memory = host_memory()
    if memory is None or config.source_of("max_local_cpu_size") == "default":
        return None
    if config.max_local_cpu_bytes <= memory[1]:
        return None
    return (
        f"max_local_cpu_size={config.max_local_cpu_size:g} (GiB, kvtier's CPU pool) is more "
        f"than this machine's memory ({memory[1] / 2**30:.1f} GiB)"
    )


def run(args: argparse.Namespace) -> int:
    """0, or 2 on a config error."""
    from kvtier_kernels import registry

    try:
        problems: list[str] = []  # the connector's and kvtier's, reported together
        extra = _extra_config(args.kv_transfer_config, problems)
        try:
            config = load_config(overrides=extra, config_file=_config_file(args.config, extra))
        except ConfigError as exc:
            raise ConfigError(problems + exc.problems) from None
        problems += [p for p in (_disk_problem(config.local_disk), _pool_problem(config)) if p]
        if problems:
            raise ConfigError(problems)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    use_tuning_dir(config.tuning_dir)  # the search path an engine with this config has
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
            {"key": key, "value": config.public_value(key), "source": config.source_of(key)}
            for key in config.to_dict()
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
        print(f"  {row['path']}  [{row['kind']}]{search_path_note(row)}")
    print("tuning files in effect:" if info["tuning_in_effect"] else "tuning files in effect: none")
    for row in info["tuning_in_effect"]:
        print(f"  {row['op']} ({row['backend']}, {row['dtype']}): {row['path']}")
    if info["tuning_in_effect"]:
        print("  (other ops, dtypes and shapes: the built-in heuristics)")
    else:
        print("  (the kernels use their built-in launch heuristics)")
    triton_cache = info["triton_cache"]
    if triton_cache is None:
        triton_cache = "none (triton not installed)"
    elif not triton_cache:
        triton_cache = "none: TRITON_CACHE_DIR is set but empty (Triton fails to compile)"
    print(f"Triton kernel cache (TRITON_CACHE_DIR; kvtier precompile fills it): {triton_cache}")
    print("\nconfig in effect:")
    key_width = max((len(row["key"]) for row in info["config"]), default=0)
    value_width = min(max((len(str(row["value"])) for row in info["config"]), default=0), 40)
    for row in info["config"]:
        value = str(row["value"])
        print(f"  {row['key']:<{key_width}}  {value:<{value_width}}  ({row['source']})")
    if info["ignored_lmcache_keys"]:
        print("  ignored LMCache keys:", ", ".join(info["ignored_lmcache_keys"]))
    return 0
