"""The op registry: one op name -> one implementation per backend.

Backends:

- ``torch``: the reference implementation; always present and the definition of correct.
- ``triton``: the Triton kernel, for tensors on a GPU Triton can drive (CUDA or ROCm).
- ``interpret``: the same Triton kernel run by Triton's interpreter on CPU tensors, for
  testing; it needs no ``TRITON_INTERPRET`` in the environment (see ``_triton_compat``).

Implementations may be registered eagerly (``fn``) or lazily (``loader``): a loader is
called once, on the first :func:`get` that needs it, and returns the callable. Triton
kernels are registered with loaders so that importing ``kvtier_kernels`` never imports
``triton`` or touches a GPU driver.

The registry takes explicit arguments only; reading ``KVTIER_KERNEL_BACKEND`` is the job of
the caller's config.
"""

from __future__ import annotations

import importlib.util
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = [
    "BACKENDS",
    "available_backends",
    "backends_for",
    "get",
    "ops",
    "register",
    "resolve_backend",
]

BACKENDS = ("torch", "triton", "interpret")
"""Every backend name; ``"auto"`` is accepted wherever a backend is requested."""

_GPU_DEVICE_TYPES = frozenset({"cuda"})  # ROCm builds of torch also use the "cuda" device type.


@dataclass(slots=True)
class _Entry:
    """One (op, backend) implementation: ready, or a loader still to be called."""

    fn: Callable | None
    loader: Callable[[], Callable] | None


_registry: dict[str, dict[str, _Entry]] = {}
_lock = threading.RLock()


def register(
    op: str,
    backend: str,
    fn: Callable | None = None,
    *,
    loader: Callable[[], Callable] | None = None,
    replace: bool = False,
) -> None:
    """Register the ``backend`` implementation of ``op``.

    Args:
        op: op name, e.g. ``"paged_gather"``.
        backend: one of :data:`BACKENDS`.
        fn: the implementation; exactly one of ``fn`` and ``loader``.
        loader: zero-argument callable returning the implementation; called once, on the
            first :func:`get` of this (op, backend). Use it for anything that imports
            ``triton`` or decorates a kernel.
        replace: allow replacing an existing registration.

    Raises:
        ValueError: unknown backend, not exactly one of ``fn``/``loader``, or a duplicate
            registration without ``replace=True``.
    """
    if backend not in BACKENDS:
        raise ValueError(
            f"cannot register op {op!r}: unknown backend {backend!r}; backends: {BACKENDS}"
        )
    if (fn is None) == (loader is None):
        raise ValueError(f"register({op!r}, {backend!r}): pass exactly one of fn and loader")
    with _lock:
        impls = _registry.setdefault(op, {})
        if backend in impls and not replace:
            raise ValueError(
                f"op {op!r} already has a {backend!r} implementation (pass replace=True)"
            )
        impls[backend] = _Entry(fn, loader)


def ops() -> list[str]:
    """Names of every registered op, sorted."""
    with _lock:
        return sorted(_registry)


def backends_for(op: str) -> list[str]:
    """Backends registered for ``op`` that can run here, in :data:`BACKENDS` order:
    ``interpret`` only when Triton is installed, ``triton`` only when it is and torch sees
    a GPU (:func:`available_backends` says why one is missing).

    Raises:
        KeyError: ``op`` is not registered (the message lists the registered ops).
    """
    triton = _triton_installed()
    runnable = [b for b in BACKENDS if b == "torch" or (triton and (b != "triton" or _gpu_kind()))]
    with _lock:
        impls = _op_impls(op)
        return [b for b in runnable if b in impls]


def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def _gpu_kind() -> str | None:
    """``"ROCm"``/``"CUDA"`` when torch sees a GPU, else None. Creates no context."""
    if not torch.cuda.is_available():
        return None
    return "ROCm" if torch.version.hip else "CUDA"


def resolve_backend(requested: str, device: torch.device | str | None) -> str:
    """Turn a requested backend (or ``"auto"``) into a concrete backend name.

    ``"auto"`` is ``"triton"`` when triton is installed and ``device`` is a GPU Triton can
    drive (CUDA or ROCm), else ``"torch"`` (also when ``device`` is None).

    Raises:
        ValueError: unknown backend name; ``"triton"`` for a non-GPU device (the message
            suggests ``"interpret"`` or ``"torch"``); ``"triton"``/``"interpret"`` without
            triton installed.
    """
    dev = torch.device(device) if device is not None else None
    on_gpu = dev is not None and dev.type in _GPU_DEVICE_TYPES
    if requested == "auto":
        return "triton" if on_gpu and _triton_installed() else "torch"
    if requested not in BACKENDS:
        raise ValueError(
            f"unknown kernel backend {requested!r}; choose one of {('auto', *BACKENDS)}"
        )
    if requested == "triton" and dev is not None and not on_gpu:
        raise ValueError(
            f"kernel backend 'triton' cannot run on device {str(dev)!r}: Triton drives CUDA/ROCm "
            "GPUs only; use 'interpret' (Triton's interpreter, for tests) or 'torch'"
        )
    if requested in ("triton", "interpret") and not _triton_installed():
        raise ValueError(
            f"kernel backend {requested!r} needs triton, which is not installed; use 'torch'"
        )
    return requested


def get(op: str, backend: str = "auto", device: torch.device | str | None = None) -> Callable:
    """Return the implementation of ``op`` for ``backend`` on ``device``.

    ``"auto"`` resolves with :func:`resolve_backend` and falls back to ``"torch"`` when the
    op has no implementation for the resolved backend; an explicitly requested backend
    never falls back. A lazy loader runs here, once.

    Raises:
        KeyError: ``op`` is not registered (lists the registered ops).
        ValueError: the backend is unknown or cannot run on ``device``, or ``op`` has no
            implementation for an explicitly requested backend (lists the ones it has).
    """
    with _lock:
        impls = _op_impls(op)
        resolved = resolve_backend(backend, device)
        if resolved not in impls and backend == "auto":
            resolved = "torch"
        if resolved not in impls:
            have = [b for b in BACKENDS if b in impls]
            raise ValueError(f"op {op!r} has no {resolved!r} implementation; it has: {have}")
        entry = impls[resolved]
        if entry.fn is None:
            assert entry.loader is not None
            fn = entry.loader()
            if not callable(fn):
                raise TypeError(
                    f"loader for ({op!r}, {resolved!r}) returned {fn!r}, not a callable"
                )
            entry.fn, entry.loader = fn, None
        return entry.fn


def available_backends() -> dict[str, str]:
    """Map each backend to a human-readable status; never initialises a GPU context."""
    triton = _triton_installed()
    gpu = _gpu_kind()
    if not triton:
        triton_status = "triton not installed"
    elif gpu is None:
        triton_status = "no GPU (torch.cuda.is_available() is False)"
    else:
        triton_status = f"available ({gpu})"
    return {
        "torch": "available",
        "triton": triton_status,
        "interpret": "available (Triton interpreter, slow)" if triton else "triton not installed",
    }


def _op_impls(op: str) -> dict[str, _Entry]:
    try:
        return _registry[op]
    except KeyError:
        raise KeyError(f"unknown kernel op {op!r}; registered ops: {sorted(_registry)}") from None
