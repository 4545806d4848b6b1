"""What every Triton or numba op file shares to launch its kernels, without importing either.

- :class:`LazyKernel`: a kernel written as a plain function, decorated (compiled or
  interpreted) on first use, so importing ``kvtier_kernels`` never imports triton;
- :func:`triton_loader`: the registry loader that decorates the kernel and returns the
  launcher bound to one backend;
- :func:`check_launch_config` and :func:`next_power_of_2` for launch parameters, and
  :func:`upload` for host tensors a launch reads on the device;
- :func:`compile_only`: within it, this thread's launches compile their kernel (Triton's
  ``warmup``) but run nothing (``kvtier precompile`` and the connector's start-up warm-up);
- :class:`BoundLaunch` (made by :meth:`LazyKernel.bind`): one launch with everything but
  the per-call tensors fixed (grid, constexprs, options, the compiled kernel), what the
  ops' cached launch plans call on the hot path; :func:`record_launches` swaps the device
  launch for a recorder (the host-cost benchmark, tests);
- :class:`NumbaKernel` and :func:`numba_loader`: the same laziness for CPU kernels that
  numba compiles; where numba fails to import or to compile a kernel, the kernel raises
  :class:`NumbaUnavailable` (one warning per op, :func:`numba_failures` keeps why), and
  its launcher (:meth:`NumbaKernel.falling_back_to`) runs the op's reference instead.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import inspect
import logging
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from kvtier_kernels._numba_compat import import_numba


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= ``n`` (``triton.next_power_of_2`` without importing triton)."""
    return 1 << max(0, n - 1).bit_length()


def upload(tensor: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None):
    """``tensor`` (as ``dtype``) on ``device``, queued without waiting for the stream.

    A copy from pageable host memory to a GPU waits for the work already queued on the
    stream (CUDA stages it through a bounce buffer), which would stall the host behind an
    engine's forward pass; a host tensor is therefore first copied into pinned memory
    (torch's caching host allocator, which keeps the block until the copy has run).
    """
    if tensor.device.type == "cpu" and torch.device(device).type != "cpu":
        if dtype is not None and tensor.dtype != dtype:
            tensor = tensor.to(dtype)
        if not tensor.is_pinned():
            tensor = tensor.pin_memory()
    return tensor.to(device, dtype, non_blocking=True)


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


class LaunchRecorder:
    """What :func:`record_launches` keeps of the launches it stood in for: their count and
    the last one (kernel name, grid, positional arguments), never a tensor list that grows."""

    __slots__ = ("calls", "last")

    def __init__(self) -> None:
        self.calls = 0
        self.last: tuple[str, tuple[int, ...], tuple[Any, ...]] | None = None


@contextlib.contextmanager
def record_launches() -> Iterator[LaunchRecorder]:
    """Within this block, in this thread only, every :class:`BoundLaunch` records its call
    (see :class:`LaunchRecorder`) and launches nothing: a launch path's host cost measured
    without a device (``perf/benchmarks/test_bench_launch.py``), or what it would launch.

    NOTE: a plan is built as usual meanwhile (interpreted kernels are decorated, compiled ones
    compiled); only the launch is replaced, so a plan built here serves later calls as well.
    """
    outer = getattr(_mode, "recorder", None)
    _mode.recorder = recorder = LaunchRecorder()
    try:
        yield recorder
    finally:
        _mode.recorder = outer


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
        kernel = self.decorated(interpret)
        requests = getattr(_mode, "requests", None)
        if requests is not None:
            return _CompileOnly(kernel, self.fn.__name__, requests)
        return kernel

    def decorated(self, interpret: bool) -> Any:
        """The kernel decorated for ``interpret`` (once), whatever launch mode is on."""
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
        return kernel


def bind(
    kernel: LazyKernel,
    interpret: bool,
    grid: tuple[int, ...],
    args: Sequence[Any],
    meta: dict[str, Any],
    device_index: int | None = None,
    per_call: int | None = None,
) -> BoundLaunch:
    """One launch of ``kernel`` over ``grid`` with the constexprs and options ``meta``
    fixed, for calls whose positional arguments specialize as ``args`` do (same dtypes,
    pointer alignment and integer values: the caller's cache key must say so). With
    ``per_call`` set, only the first ``per_call`` arguments are passed per call; the rest
    are fixed to those of ``args``.

    Compiled (``interpret`` False), the kernel is compiled here for ``args`` (Triton's
    ``warmup``; within :func:`compile_only` this is the compile request) for CUDA device
    ``device_index``; interpreted, nothing happens until a call.
    """
    compiled = None
    if not interpret:
        compiled = kernel.decorated(False).warmup(*args, grid=grid, **meta)
    fixed = () if per_call is None else tuple(args[per_call:])
    return BoundLaunch(kernel, interpret, grid, meta, compiled, device_index, fixed)


class BoundLaunch:
    """A launch of one kernel with its grid, constexprs, options, trailing arguments
    (``fixed``) and (compiled) its Triton ``CompiledKernel`` fixed: ``launch(*args,
    stream=None)`` passes the leading positional arguments alone, on ``stream`` (a raw
    CUDA/HIP stream handle; default: the current stream of the kernel's device).

    Compiled, a call is Triton's own launcher and nothing else: no argument binding, no
    specialization key, no cache lookup (what ``kernel[grid](...)`` pays on every call).
    The caller guarantees that ``args`` specialize as those it was bound with. Within
    :func:`record_launches` a call is recorded instead; within :func:`compile_only` it is
    reported as a compile request and launches nothing. Interpreted, a call runs the kernel
    under Triton's interpreter (CPU tensors).
    """

    __slots__ = ("compiled", "device_index", "fixed", "grid", "interpret", "kernel", "meta")
    __slots__ += ("_device_of", "_runner", "_stream_of", "_trailing")

    def __init__(
        self,
        kernel: LazyKernel,
        interpret: bool,
        grid: tuple[int, ...],
        meta: dict[str, Any],
        compiled: Any,
        device_index: int | None,
        fixed: tuple[Any, ...] = (),
    ) -> None:
        self.kernel, self.interpret, self.grid, self.meta = kernel, interpret, grid, meta
        self.compiled, self.device_index, self.fixed = compiled, device_index, fixed
        self._trailing = fixed
        if not interpret:
            # Triton's compiled launcher takes every parameter, the constexprs last; the
            # launch options (num_warps, ...) are already in the compiled kernel.
            names = inspect.signature(kernel.fn).parameters
            self._trailing += tuple(meta[name] for name in names if name in meta)
        self._runner: Callable[..., None] | None = None
        self._stream_of: Callable[[int], int] | None = None
        self._device_of: Callable[[], int] | None = None

    @property
    def name(self) -> str:
        return getattr(getattr(self.kernel, "fn", None), "__name__", type(self.kernel).__name__)

    def __call__(self, *args: Any, stream: int | None = None) -> None:
        recorder = getattr(_mode, "recorder", None)
        if recorder is not None:
            recorder.calls += 1
            recorder.last = (self.name, self.grid, args + self.fixed)
            return
        requests = getattr(_mode, "requests", None)
        if requests is not None:
            requests.append((self.name, self.compiled))
            return
        if self.interpret:
            self.kernel.get(True)[self.grid](*args, *self.fixed, **self.meta)
            return
        runner = self._runner
        if runner is None:
            self._first_launch(args, stream)
            return
        index = self.device_index
        if self._device_of() != index:
            with torch.cuda.device(index):
                self(*args, stream=stream)
            return
        if stream is None:
            stream = self._stream_of(index)
        runner(*args, *self._trailing, stream=stream)

    def _first_launch(self, args: tuple, stream: int | None) -> None:
        """Launch this first call through Triton's C launcher
        (:func:`_triton_compat.direct_launcher`, else ``compiled[grid]``) and keep it as the
        runner; where this Triton's launcher refuses the call (a signature kvtier was not
        checked with), launch through ``kernel[grid]`` from now on instead (one warning),
        which every Triton takes."""
        from kvtier_kernels import _triton_compat

        self._stream_of = _triton_compat.current_stream_getter()
        self._device_of = _triton_compat.current_device_getter()
        index = self.device_index
        with torch.cuda.device(index) if index is not None else contextlib.nullcontext():
            try:
                runner = _triton_compat.direct_launcher(self.compiled, self.grid)
                if runner is None:
                    runner = self.compiled[self.grid]
                launch_stream = stream if stream is not None else self._stream_of(index)
                runner(*args, *self._trailing, stream=launch_stream)
            except (TypeError, ValueError, RuntimeError, SystemError) as exc:
                warnings.warn(
                    f"kvtier: Triton's compiled launcher refused {self.name} ({exc}); "
                    "launching it through kernel[grid] (slower on the host)",
                    RuntimeWarning,
                    stacklevel=3,
                )
                runner = functools.partial(
                    _launch_through_jit,
                    self.kernel.get(False)[self.grid],
                    len(self._trailing),
                    self.fixed,
                    self.meta,
                )
                runner(*args, *self._trailing, stream=stream)
        self._runner = runner


def _launch_through_jit(
    launch: Callable[..., Any],
    num_trailing: int,
    fixed: tuple[Any, ...],
    meta: dict[str, Any],
    *args: Any,
    stream: int | None = None,
) -> None:
    """``kernel[grid](*args, *fixed, **meta)`` on ``stream`` (a raw handle; None: the
    current one): a bound launch's fallback, called as its compiled runner is."""
    leading = args[: len(args) - num_trailing]
    if stream is None:
        launch(*leading, *fixed, **meta)
        return
    with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
        launch(*leading, *fixed, **meta)


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
    and rebound under their names there (once, by whichever kernel gets them first), and
    what ``bindings()`` returns (names to numba objects, e.g. intrinsics) is bound there.
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
        self,
        fn: Callable,
        helpers: Sequence[Callable] = (),
        *,
        op: str,
        parallel: bool = True,
        bindings: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        self.fn, self.helpers, self.op, self.parallel = fn, tuple(helpers), op, parallel
        self.bindings = bindings
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
                        numba = import_numba()
                    except Exception as error:  # an ImportError, or a numpy it refuses
                        raise _numba_failed(self.op, "import numba", error) from error
                    try:
                        bound = self.bindings() if self.bindings is not None else {}
                    except Exception as error:  # intrinsics this numba cannot build
                        raise _numba_failed(self.op, self.fn.__name__, error) from error

                    module = self.fn.__globals__
                    module["prange"] = numba.prange
                    module.update(bound)
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
        numba = import_numba()

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
