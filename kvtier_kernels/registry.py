"""The op registry: one op name -> one implementation per backend.

Backends:

- ``torch``: the reference implementation; always present and the definition of correct.
- ``triton``: the Triton kernel, for tensors on a GPU Triton can drive (CUDA or ROCm).
- ``interpret``: the same Triton kernel run by Triton's interpreter on CPU tensors, for
  testing; it needs no ``TRITON_INTERPRET`` in the environment (see ``_triton_compat``).
- ``numba``: a CPU kernel compiled by numba (the optional extra ``kvtier[cpu-codec]``),
  bit-exact with the reference; ops that have one run it on CPU copies of their tensors.

``auto`` picks, per op: ``triton`` when the tensors are on a GPU Triton can drive, else
``numba`` when the op has a numba kernel and numba imports, else ``torch``. Where numba
fails to import, or to compile one of an op's kernels, a warning is logged once, the
call runs the op's reference (its numba launcher falls back), and ``auto`` picks
``torch`` for that op from then on; :func:`available_backends` says why.

Implementations may be registered eagerly (``fn``) or lazily (``loader``): a loader is
called once, on the first :func:`get` that needs it, and returns the callable. Triton and
numba kernels are registered with loaders so that importing ``kvtier_kernels`` never
imports ``triton`` or ``numba`` or touches a GPU driver; ``auto`` imports numba (once) the
first time it considers a numba kernel.

The registry takes explicit arguments only; reading ``KVTIER_KERNEL_BACKEND`` is the job of
the caller's config.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvtier_kernels._launch import numba_failures, numba_version
from kvtier_kernels._numba_compat import import_numba

__all__ = [
    "BACKENDS",
    "available_backends",
    "backends_for",
    "get",
    "ops",
    "pick",
    "register",
    "registered",
    "resolve_backend",
]

BACKENDS = ("torch", "triton", "interpret", "numba")
"""Every backend name; ``"auto"`` is accepted wherever a backend is requested."""

_GPU_DEVICE_TYPES = frozenset({"cuda"})  # ROCm builds of torch also use the "cuda" device type.


@dataclass(slots=True)
class _Entry:
    """One (op, backend) implementation: ready, or a loader still to be called."""

    fn: Callable | None
    loader: Callable[[], Callable] | None


logger = logging.getLogger(__name__)

_registry: dict[str, dict[str, _Entry]] = {}
_lock = threading.RLock()
_NOT_TRIED = "not imported yet"
_numba_error: str | None = _NOT_TRIED  # None once numba imported, else why it did not


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
    a GPU, ``numba`` only when numba is installed (and did not fail to import);
    :func:`available_backends` says why one is missing.

    Raises:
        KeyError: ``op`` is not registered (the message lists the registered ops).
    """
    triton = _triton_installed()
    runnable = ["torch"]
    if triton:
        runnable += ["triton", "interpret"] if _gpu_kind() else ["interpret"]
    if _numba_installed() and _numba_error in (None, _NOT_TRIED):
        runnable.append("numba")
    with _lock:
        impls = _op_impls(op)
        return [b for b in runnable if b in impls]


def registered(op: str) -> list[str]:
    """Backends registered for ``op``, whether or not they can run here, in
    :data:`BACKENDS` order.

    Raises:
        KeyError: ``op`` is not registered.
    """
    with _lock:
        impls = _op_impls(op)
        return [b for b in BACKENDS if b in impls]


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None  # a search of sys.path: once


@functools.cache
def _numba_installed() -> bool:
    return importlib.util.find_spec("numba") is not None


def _numba_imports() -> bool:
    """Whether numba imports here (tried once; a failure is logged and kept for
    :func:`available_backends`). ``NUMBA_DISABLE_JIT`` counts as a failure: numba would
    then run its kernels as plain Python."""
    global _numba_error
    with _lock:
        if _numba_error == _NOT_TRIED:
            try:
                numba = import_numba()
            except Exception as exc:  # an ImportError, or a numpy version numba refuses
                _numba_error = f"{type(exc).__name__}: {exc}"
                ops = sorted(op for op, impls in _registry.items() if "numba" in impls)
                logger.warning(
                    "numba %s does not import (%s): %s run their numpy/torch reference "
                    "(the same bytes, slower)",
                    numba_version(),
                    _numba_error,
                    ", ".join(ops),
                )
            else:
                _numba_error = "NUMBA_DISABLE_JIT is set" if numba.config.DISABLE_JIT else None
        return _numba_error is None


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
    if requested == "numba" and not _numba_installed():
        raise ValueError(
            "kernel backend 'numba' needs numba, which is not installed "
            "(pip install 'kvtier[cpu-codec]'); use 'torch'"
        )
    return requested


def pick(op: str, backend: str = "auto", device: torch.device | str | None = None) -> str:
    """The backend :func:`get` uses for ``op``, ``backend`` and ``device``, loading nothing.

    An explicit backend is itself. ``"auto"`` resolves with :func:`resolve_backend`; where
    that gives ``"torch"`` and ``op`` has a numba kernel that can load (numba installed and
    importable: the first such call imports numba; and no kernel of ``op`` failed to
    compile here), it is ``"numba"``; where ``op`` has no implementation for the resolved
    backend, ``"torch"``.

    Raises:
        KeyError / ValueError: as :func:`get`.
    """
    with _lock:
        impls = _op_impls(op)
        resolved = resolve_backend(backend, device)
        if backend != "auto":
            return resolved
        if (
            resolved == "torch"
            and "numba" in impls
            and _numba_installed()
            and _numba_imports()
            and op not in numba_failures()
        ):
            return "numba"
        return resolved if resolved in impls else "torch"


def get(op: str, backend: str = "auto", device: torch.device | str | None = None) -> Callable:
    """Return the implementation of ``op`` for ``backend`` on ``device``.

    ``"auto"`` picks as :func:`pick` says (triton on a GPU, else numba where the op has it
    and numba imports, else torch; torch where the op lacks the pick); an explicitly
    requested backend is itself (a ``numba`` launcher still runs its op's reference where
    numba fails, see the module docstring). A lazy loader runs here, once.

    Raises:
        KeyError: ``op`` is not registered (lists the registered ops).
        ValueError: the backend is unknown or cannot run on ``device``, or ``op`` has no
            implementation for an explicitly requested backend (lists the ones it has).
    """
    with _lock:
        impls = _op_impls(op)
        resolved = pick(op, backend, device)
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
        "numba": _numba_status(),
    }


def _numba_status() -> str:
    if not _numba_installed():
        return "numba not installed (pip install 'kvtier[cpu-codec]')"
    version = numba_version()
    if _numba_error not in (None, _NOT_TRIED):
        return f"numba {version} installed but unusable ({_numba_error})"
    status = f"available (numba {version}; CPU kernels, compiled on first use, cached on disk)"
    failed = "; ".join(f"{op}: {why}" for op, why in sorted(numba_failures().items()))
    return f"{status}; failed here, so torch runs: {failed}" if failed else status


def _op_impls(op: str) -> dict[str, _Entry]:
    try:
        return _registry[op]
    except KeyError:
        raise KeyError(f"unknown kernel op {op!r}; registered ops: {sorted(_registry)}") from None
