"""``kvtier info``: versions, devices, kernel backends, tuning files and the config in effect;
with ``--kv-transfer-config``, vLLM's JSON checked before an engine starts."""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

from kvtier.commands.paths import why_not_writable
from kvtier.config import ConfigError, load_config
from kvtier.machine import (
    auto_backends,
    devices,
    dist_version,
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
    "value came from (--config, KVTIER_* variables, defaults). With --kv-transfer-config, "
    "check vLLM's JSON as the engine would take it before starting one. Exit 0, or 2 on a "
    "config error."
)

KVTIER_MODULE = "kvtier.integration.vllm"  # kv_connector_module_path in vLLM's config
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")  # what vLLM's KVTransferConfig takes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML config file (default: KVTIER_CONFIG_FILE)")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument(
        "--kv-transfer-config",
        metavar="JSON",
        help="check vLLM's --kv-transfer-config (the same JSON) before starting the engine, "
        "and show the kvtier config it gives",
    )


def _extra_config(kv_transfer_config: str | None, problems: list[str]) -> dict[str, object] | None:
    """kvtier's part of a vLLM ``--kv-transfer-config`` JSON, checked as vLLM would use it:
    what does not name kvtier's connector is added to ``problems``.

    Raises:
        ConfigError: the JSON does not parse, or is not an object.
    """
    if kv_transfer_config is None:
        return None
    try:
        transfer = json.loads(kv_transfer_config)
    except ValueError as exc:
        raise ConfigError([f"--kv-transfer-config is not JSON: {exc}"]) from None
    if not isinstance(transfer, dict):
        raise ConfigError(["--kv-transfer-config must be a JSON object"])
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
    role = transfer.get("kv_role")
    if role not in KV_ROLES:
        problems.append(f"kv_role is {role!r}; vLLM takes {', '.join(map(repr, KV_ROLES))}")
    extra = transfer.get("kv_connector_extra_config") or {}
    if not isinstance(extra, dict):
        problems.append("kv_connector_extra_config must be a JSON object")
        return {}
    return extra


def _disk_problem(local_disk: str | None) -> str | None:
    """Why the engine could not use ``local_disk`` (it creates the directory when it
    starts: the nearest existing ancestor must be a writable directory), or None."""
    if local_disk is None:
        return None
    reason = why_not_writable(Path(local_disk))
    return f"local_disk {local_disk!r}: {reason}" if reason else None


def run(args: argparse.Namespace) -> int:
    """0, or 2 on a config error."""
    from kvtier_kernels import registry

    try:
        problems: list[str] = []  # the connector's and kvtier's, reported together
        extra = _extra_config(args.kv_transfer_config, problems)
        try:
            config = load_config(overrides=extra, config_file=args.config)
        except ConfigError as exc:
            raise ConfigError(problems + exc.problems) from None
        problem = _disk_problem(config.local_disk)
        if problems or problem is not None:
            raise ConfigError(problems + ([problem] if problem else []))
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
