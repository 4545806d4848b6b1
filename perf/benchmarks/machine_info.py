"""The machine a benchmark ran on: device, driver, CUDA or ROCm, Python and library versions.

``describe_machine`` is every results file's ``machine`` (``conftest.py``) and the machine of
``make gpu-bench``'s summary (``perf/gpu_bench.py``); ``device_slug`` names a device's
results file (``perf/results/<slug>.json``). Nothing here needs a GPU: on a machine without
one the device is ``cpu`` and the GPU fields are absent.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from pathlib import Path

import torch


def device_slug(device: str) -> str:
    """``"NVIDIA H200"`` → ``"nvidia-h200"``: the results file's name for ``device``."""
    return device.lower().replace(" ", "-")


def describe_machine(date: str) -> dict:
    """The machine, Python, torch and Triton versions and, with a GPU, its name, driver and
    CUDA or ROCm version."""
    info = {
        "date": date,
        "device": "cpu",
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if torch.cuda.is_available():
        info.update(gpu_versions())
    return info


def gpu_versions() -> dict:
    """``device``, ``rocm`` or ``cuda`` (the toolkit torch was built with) and ``driver``."""
    info: dict = {"device": torch.cuda.get_device_name(0)}
    if torch.version.hip:
        info["rocm"] = torch.version.hip
    else:
        info["cuda"] = torch.version.cuda
    info["driver"] = driver_version()
    return info


def driver_version() -> str | None:
    """The GPU driver's version (``nvidia-smi``, NVML, or amdgpu's module); None if unknown."""
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=20,
                check=True,
            ).stdout.split()
        except (OSError, subprocess.SubprocessError):
            out = []
        if out:
            return out[0]
    try:
        import pynvml

        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:  # NVML absent, or not an NVIDIA machine
        pass
    amdgpu = Path("/sys/module/amdgpu/version")
    if amdgpu.exists():
        return amdgpu.read_text().strip() or None
    return None
