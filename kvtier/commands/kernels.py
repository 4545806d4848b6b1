"""``kvtier kernels``: the kernel ops, the backends available, what ``auto`` picks on this
machine and the tuning files in effect for each op."""

from __future__ import annotations

import argparse
import json
import sys

from kvtier.config import ConfigError, load_config
from kvtier.machine import search_path_note, search_path_rows
from kvtier.paged_io import use_tuning_dir

HELP = "kernel ops, backends available, what auto picks, tuning files in effect"
DESCRIPTION = (
    "List the kernel ops, the backends available on this machine, what kernel_backend "
    "auto picks for each op, and the tuning files in effect (written by kvtier tune), in "
    "the order they are searched: the config's tuning_dir, KVTIER_TUNING_DIR (else "
    "~/.cache/kvtier/tuning), the packaged defaults. Exit 0, or 2 on a config error."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        help="YAML config file whose tuning_dir is searched first (default: KVTIER_CONFIG_FILE)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON")


def run(args: argparse.Namespace) -> int:
    """0, or 2 on a config error."""
    import torch

    from kvtier_kernels import registry
    from kvtier_kernels.tuning import files as tuning_files
    from kvtier_kernels.tuning import lookup as tuning_lookup

    try:
        config = load_config(config_file=args.config)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    use_tuning_dir(config.tuning_dir)  # the search path an engine with this config has
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
        state = search_path_note(row)
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
