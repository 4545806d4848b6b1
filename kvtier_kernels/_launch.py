"""What every Triton or numba op file shares to launch its kernels, without importing either.

- :class:`LazyKernel`: a kernel written as a plain function, decorated (compiled or
  interpreted) on first use, so importing ``kvtier_kernels`` never imports triton;
- :func:`triton_loader`: the registry loader that decorates the kernel and returns the
  launcher bound to one backend;
- :func:`check_launch_config` and :func:`next_power_of_2` for launch parameters;
- :func:`compile_only`: within it, this thread's launches compile their kernel (Triton's
  ``warmup``) but run nothing (``kvtier precompile`` and the connector's start-up warm-up);
- :class:`NumbaKernel` and :func:`numba_loader`: the same laziness for CPU kernels that
  numba compiles; where numba fails to import or to compile a kernel, the kernel raises
  :class:`NumbaUnavailable` (one warning per op, :func:`numba_failures` keeps why), and
  its launcher (:meth:`NumbaKernel.falling_back_to`) runs the op's reference instead.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= ``n`` (``triton.next_power_of_2`` without importing triton)."""
    return 1 << max(0, n - 1).bit_length()


def check_launch_config(config: Any, block_fields: Sequence[str]) -> None:
    """Raise ValueError unless ``block_fields`` of ``config`` are powers of two and its
    ``num_warps`` is one of 1, 2, 4, 8, 16."""
    for name in block_fields:
        value = getattr(config, name)
        if value < 1 or value & (value - 1):
            raise ValueError(f"launch_config: {name} must be a power of two; got {value}")
    if config.num_warps not in (1, 2, 4, 8, 16):
        raise ValueError(
            f"launch_config: num_warps must be 1, 2, 4, 8 or 16; got {config.num_warps}"
        )


_mode = threading.local()


@contextlib.contextmanager
def compile_only() -> Iterator[list[tuple[str, Any]]]:
    """Within this block, in this thread only, ``kernel[grid](...)`` of a :class:`LazyKernel`
    compiles the kernel for those arguments (Triton's ``warmup``: specialization, compile,
    Triton's cache) and launches nothing; an interpreted kernel does nothing at all.

    Yields the list of ``(kernel name, compiled kernel or None)`` requested so far, one per
    launch, for reports. Other threads launch as usual meanwhile.

    NOTE: launchers still read what their host code reads after the launch (buffers that
    the kernel would have written hold whatever they were allocated with).
    """
    outer = getattr(_mode, "requests", None)
    _mode.requests = requests = []
    try:
        yield requests
    finally:
        _mode.requests = outer


def compiling_only() -> bool:
    """Whether this thread is inside :func:`compile_only`."""
    return getattr(_mode, "requests", None) is not None


class _CompileOnly:
    """``kernel[grid](*args, **meta)`` that compiles (or, interpreted, skips) the launch."""

    def __init__(self, kernel: Any, name: str, requests: list[tuple[str, Any]]) -> None:
        self.kernel, self.name, self.requests = kernel, name, requests

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        def launch(*args: Any, **meta: Any) -> None:
            warmup = getattr(self.kernel, "warmup", None)  # None: the interpreter
            compiled = warmup(*args, grid=grid, **meta) if warmup is not None else None
            self.requests.append((self.name, compiled))

        return launch


class LazyKernel:
    """A Triton kernel kept as a plain function until first use.

    The kernel's module declares ``tl: Any = None``; :meth:`get` binds it to
    ``triton.language`` in that module's globals, then decorates the function once per mode
    (compiled for GPUs, interpreted for CPU tensors) and caches the result.
    """

    def __init__(self, fn: Callable) -> None:
        self.fn = fn
        self._decorated: dict[bool, Any] = {}
        self._lock = threading.Lock()

    def get(self, interpret: bool) -> Any:
        """The decorated kernel: interpreted when ``interpret``, else compiled (inside
        :func:`compile_only`, a stand-in that compiles instead of launching)."""
        kernel = self._decorated.get(interpret)
        if kernel is None:
            with self._lock:
                kernel = self._decorated.get(interpret)
                if kernel is None:
                    from kvtier_kernels import _triton_compat

                    self.fn.__globals__["tl"] = _triton_compat.language()
                    decorate = (
                        _triton_compat.jit_interpreted if interpret else _triton_compat.jit_compiled
                    )
                    kernel = self._decorated[interpret] = decorate(self.fn)
        requests = getattr(_mode, "requests", None)
        if requests is not None:
            return _CompileOnly(kernel, self.fn.__name__, requests)
        return kernel


def triton_loader(
    kernel: LazyKernel, launcher: Callable, interpret: bool
) -> Callable[[], Callable]:
    """A registry loader: decorates ``kernel`` (importing triton) and returns ``launcher``
    bound to ``interpret``."""

    def load() -> Callable:
        kernel.get(interpret)
        return functools.partial(launcher, interpret=interpret)

    return load


logger = logging.getLogger(__name__)

_numba_lock = threading.Lock()
# error_model="numpy": no ZeroDivisionError checks (the kernels never divide by zero), so
# loops with a division vectorize; no fastmath: the kernels must round as the references.
_NUMBA_OPTIONS = {"nogil": True, "cache": True, "error_model": "numpy"}
NUMBA_WORK_PER_THREAD = 1 << 20
"""Elements or symbols per thread of a numba kernel (a few milliseconds of work): a
small chunk runs on one thread rather than pay for waking the others."""


class NumbaUnavailable(RuntimeError):
    """numba failed to import, or to compile one of an op's kernels, in this process. The
    op's launcher catches it and runs its numpy/torch reference (the same bytes)."""


_numba_failures: dict[str, str] = {}  # op -> why its numba kernels do not run here


def numba_failures() -> dict[str, str]:
    """Each op whose numba kernels failed to import or compile in this process, with why;
    ``auto`` picks the op's torch backend from then on (:func:`kvtier_kernels.registry.pick`)."""
    return dict(_numba_failures)


def numba_version() -> str:
    """The installed numba's version, from its metadata (no import)."""
    try:
        return importlib.metadata.version("numba")
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"


def _numba_failed(op: str, kernel: str, error: BaseException) -> NumbaUnavailable:
    """Record that ``op``'s numba kernel ``kernel`` failed with ``error`` and return the
    exception to raise. The first failure of an op logs its one warning."""
    lines = str(error).strip().splitlines()  # numba's typing errors run to many lines
    why = f"{type(error).__name__}: {lines[0][:200] if lines else ''}".rstrip(": ")
    entry = f"numba {numba_version()}, {kernel}: {why}"
    if _numba_failures.setdefault(op, entry) is entry:  # the op's first failure
        logger.warning(
            "numba %s failed on %s (%s): %s runs its numpy/torch reference in this process "
            "(the same bytes, slower)",
            numba_version(),
            kernel,
            why,
            op,
        )
    return NumbaUnavailable(_numba_failures[op])


class NumbaKernel:
    """A CPU kernel written as a plain Python function (numpy arrays, loops, ``prange``),
    compiled by numba on first use.

    The kernel's module declares ``prange: Any = range``; :meth:`get` imports numba, binds
    ``numba.prange`` in that module's globals and wraps the function once in
    ``numba.njit(parallel=True, nogil=True, cache=True, error_model="numpy")``. The
    ``helpers`` it calls, plain functions of that module, are wrapped in ``numba.njit``
    and rebound under their names there (once, by whichever kernel gets them first).
    numba compiles a kernel on its first call with new argument types (seconds) and keeps
    the machine code in its on-disk cache (``__pycache__`` beside the module, else
    ``NUMBA_CACHE_DIR`` or a per-user directory), from which later processes load it in
    milliseconds.

    NOTE: calls run one at a time in a process. Each already uses all of numba's threads
    (``NUMBA_NUM_THREADS``), and numba's fallback threading layer (workqueue, when neither
    TBB nor OpenMP loads) aborts the process when two threads launch parallel code at once.
    ``nogil`` lets other Python threads run meanwhile.

    NOTE: ``parallel=False`` compiles a serial kernel that never enters a threading layer,
    for kernels a serving engine's own thread calls: numba's OpenMP layer leaves the
    launching thread's OpenMP thread count at its last launch's, and vLLM's CPU attention,
    which checks that count against its plan, aborted the engine.

    NOTE: where numba fails to import, or to compile the kernel (numba's own errors, and
    failures inside its passes such as a ``RecursionError``), the kernel raises
    :class:`NumbaUnavailable`, once ``op`` has logged its one warning; every later call of
    any kernel of ``op`` raises it at once, without trying again. ``op`` is the registry op
    whose launcher runs the kernel; that launcher runs the op's reference instead
    (:meth:`falling_back_to`), so no caller sees the failure.
    """

    def __init__(
        self, fn: Callable, helpers: Sequence[Callable] = (), *, op: str, parallel: bool = True
    ) -> None:
        self.fn, self.helpers, self.op, self.parallel = fn, tuple(helpers), op, parallel
        self._compiled: Any = None
        self._lock = threading.Lock()

    def get(self) -> Any:
        """The numba dispatcher (imports numba; compiles nothing until it is called).

        Raises:
            NumbaUnavailable: numba does not import.
        """
        if self._compiled is None:
            with self._lock:
                if self._compiled is None:
                    try:
                        import numba
                    except Exception as error:  # an ImportError, or a numpy it refuses
                        raise _numba_failed(self.op, "import numba", error) from error

                    module = self.fn.__globals__
                    module["prange"] = numba.prange
                    for helper in self.helpers:
                        if module[helper.__name__] is helper:
                            module[helper.__name__] = numba.njit(**_NUMBA_OPTIONS)(helper)
                    self._compiled = numba.njit(parallel=self.parallel, **_NUMBA_OPTIONS)(self.fn)
        return self._compiled

    def __call__(self, *args: Any, work: int) -> Any:
        """Run the kernel on ``args`` with one thread per ``NUMBA_WORK_PER_THREAD`` of
        ``work`` (elements or symbols): at least one, at most the calling thread's numba
        thread count (``NUMBA_NUM_THREADS``, or what ``numba.set_num_threads`` set).

        Raises:
            NumbaUnavailable: numba failed to import or to compile a kernel of ``op`` here.
        """
        if self.op in _numba_failures:
            raise NumbaUnavailable(_numba_failures[self.op])
        kernel = self.get()
        try:
            if not self.parallel:
                return kernel(*args)  # no threading layer: the caller's thread alone
            return self._run_parallel(kernel, args, work)
        except Exception as error:  # the kernels raise nothing: this is numba's compiler
            raise _numba_failed(self.op, self.fn.__name__, error) from error

    def falling_back_to(self, reference: Callable) -> Callable[[Callable], Callable]:
        """A decorator for the launcher of this kernel: where the kernel raises
        :class:`NumbaUnavailable` (before it wrote anything), the call runs ``reference``,
        the op's reference implementation, with the same arguments."""

        def decorate(launcher: Callable) -> Callable:
            @functools.wraps(launcher)
            def launch(*args: Any, **kwargs: Any) -> Any:
                try:
                    return launcher(*args, **kwargs)
                except NumbaUnavailable:  # logged once for the op
                    return reference(*args, **kwargs)

            return launch

        return decorate

    @staticmethod
    def _run_parallel(kernel: Any, args: tuple, work: int) -> Any:
        import numba

        with _numba_lock:
            default = numba.get_num_threads()
            numba.set_num_threads(min(default, max(1, work // NUMBA_WORK_PER_THREAD)))
            try:
                return kernel(*args)
            finally:
                numba.set_num_threads(default)


def numba_loader(kernels: Sequence[NumbaKernel], launcher: Callable) -> Callable[[], Callable]:
    """A registry loader: imports numba and wraps ``kernels``, then returns ``launcher``
    (also where numba does not import: the launcher then runs its reference)."""

    def load() -> Callable:
        for kernel in kernels:
            with contextlib.suppress(NumbaUnavailable):  # logged; the launcher falls back
                kernel.get()
        return launcher

    return load
