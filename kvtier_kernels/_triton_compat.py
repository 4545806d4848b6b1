"""Triton version and interpreter quirks, in one place.

Imported only by kernel loaders (on first use of a Triton backend), never when
``kvtier_kernels`` is imported, so importing kvtier never imports ``triton``.

How Triton chooses interpret mode (read from the installed sources of triton 3.5.1, 3.6.0
and 3.9.0; the mechanism is the same in all three):

- ``triton.jit(fn)`` decides when it *decorates*: if ``triton.knobs.runtime.interpret`` is
  true it returns ``triton.runtime.interpreter.InterpretedFunction(fn)``, else
  ``triton.runtime.jit.JITFunction(fn)``. The knob re-reads the ``TRITON_INTERPRET``
  environment variable on every access unless it was set from Python (setting it also
  writes ``os.environ``). Launching never looks at the knob again: the type of the
  decorated object decides.
- So the two backends build those objects directly: :func:`jit_compiled` always returns a
  ``JITFunction`` (compiled even when ``TRITON_INTERPRET=1`` is set globally: the kernels
  read cache memory through raw device addresses, which the interpreter cannot follow) and
  :func:`jit_interpreted` an ``InterpretedFunction``, whatever the environment says.

Catches of running the interpreter without ``TRITON_INTERPRET`` set at import time, each
handled by :func:`interpreter_scope` around every interpreted launch:

1. Triton's own helpers written in Triton (``tl.zeros``, ``tl.cdiv``, ``tl.sum``,
   ``tl.max``, ... and their ``tensor.sum()``-style member forms) were decorated when
   ``triton.language`` was imported, so they are ``JITFunction`` objects, and the
   interpreter refuses them ("Cannot call @triton.jit'd outside of the scope of a
   kernel"). The scope swaps in interpreted copies and restores the originals afterwards.
2. numpy >= 2.4 refuses ``int()`` of a one-element 1-d array; the interpreter of triton
   <= 3.6 implements ``tensor.__index__`` (``range(n)`` over a runtime ``n``, ...) as
   ``int(handle.data)`` and fails with "only 0-dimensional arrays can be converted to Python
   scalars" (triton-lang/triton#9171, fixed upstream with ``.squeeze()``, as in 3.9). The
   scope installs the fixed ``__index__`` where the installed interpreter lacks it.
3. The first interpreted launch imports ``triton.experimental.gluon`` lazily, which
   asserts that the helpers of (1) are ``JITFunction`` objects; the scope triggers that
   import before swapping.
4. The interpreter patches ``triton.language`` (its builtins, ``tensor``'s methods,
   ``dtype.to_ir``, ``range``, ...) with numpy versions. Triton 3.5 never undoes this, and
   3.6 / 3.9 undo it for the launched kernel but not for helpers it calls; either way a
   kernel *compiled* later in the same process fails ("'value' object has no attribute
   'dtype'"). The scope snapshots the namespaces the interpreter patches and restores
   them after the launch, so interpreted and compiled kernels can share a process.

NOTE: the swap in (1) and the interpreter's own patching of ``triton.language`` are
process-wide while a launch runs. Interpreted launches are serialized by a lock, but
compiling a Triton kernel on another thread during one is not safe: the interpret backend
is for tests and CPU-only machines, not for a serving process.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
import triton
import triton.language as tl
from triton.runtime import interpreter as _interpreter
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

__all__ = [
    "InterpretedKernel",
    "cache_dir",
    "current_device_getter",
    "current_stream_getter",
    "direct_launcher",
    "interpreter_scope",
    "jit_compiled",
    "jit_interpreted",
    "language",
    "triton_version",
]

_scope_lock = threading.RLock()
_interpreted_helpers: dict[int, tuple[JITFunction, InterpretedFunction]] = {}


def triton_version() -> tuple[int, int]:
    """``(major, minor)`` of the installed triton."""
    major, minor = triton.__version__.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def cache_dir() -> str:
    """Where Triton keeps compiled kernels: ``TRITON_CACHE_DIR``, else Triton's default
    (``~/.triton/cache``, under ``TRITON_HOME`` when set)."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return str(knobs.cache.dir)
    from triton.runtime.cache import default_cache_dir  # pragma: no cover - triton < 3.4

    return str(default_cache_dir())  # pragma: no cover


def current_stream_getter() -> Callable[[int], int]:
    """``get(device_index)``: the raw handle of that device's current stream, as Triton's
    own launches read it (torch's current stream, without building a ``Stream`` object)."""
    return triton.runtime.driver.active.get_current_stream


def current_device_getter() -> Callable[[], int]:
    """``get()``: the index of the current CUDA/HIP device, without torch's lazy-init check
    on every call (torch's own getter where its private one is missing)."""
    return getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device


def direct_launcher(compiled: Any, grid: tuple[int, ...]) -> Callable[..., None] | None:
    """``launch(*args, stream=handle)``: Triton's C launcher of ``compiled`` over ``grid``,
    called without the per-call wrapper of ``compiled[grid]`` (which rereads the launch
    hooks and builds launch metadata for them), or None where launch hooks are installed
    (a profiler such as proton: ``compiled[grid]`` then calls them) or this Triton's
    compiled kernel lacks what the call needs.

    NOTE: the positional contract of ``CompiledKernel.run`` (grid, stream, function,
    packed metadata, launch metadata, enter and exit hooks, then the kernel's arguments) is
    that of Triton 3.2 to 3.9; a Triton that changes it raises on the first call, which
    :class:`kvtier_kernels._launch.BoundLaunch` answers by falling back to ``kernel[grid]``.
    """
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime is None:
        return None
    if _hooked(runtime.launch_enter_hook) or _hooked(runtime.launch_exit_hook):
        return None
    compiled[grid]  # loads the module and function handles (_init_handles)
    run = getattr(compiled, "run", None)
    function = getattr(compiled, "function", None)
    packed = getattr(compiled, "packed_metadata", None)
    if run is None or function is None or packed is None:
        return None
    grid_x, grid_y, grid_z = (*grid, 1, 1)[:3]

    def launch(*args: Any, stream: int) -> None:
        run(grid_x, grid_y, grid_z, stream, function, packed, None, None, None, *args)

    return launch


def _hooked(hook: Any) -> bool:
    """Whether a launch hook knob holds a hook: a callable (Triton < 3.7), or a
    ``HookChain`` with calls in it (later Tritons keep an empty chain when none is set)."""
    return hook is not None and bool(getattr(hook, "calls", True))


def language() -> Any:
    """The ``triton.language`` module (for binding a kernel module's ``tl`` global)."""
    return tl


def jit_compiled(fn: Callable) -> JITFunction:
    """Decorate ``fn`` as a compiled Triton kernel, whatever ``TRITON_INTERPRET`` says."""
    return JITFunction(fn)


class InterpretedKernel:
    """``fn`` under Triton's interpreter; launched as ``kernel[grid](*args, **meta)``.

    Every launch runs inside :func:`interpreter_scope`. Launch options the interpreter has
    no use for (``num_warps``, ``num_stages``) are accepted and ignored.
    """

    def __init__(self, fn: Callable) -> None:
        self.fn = fn
        self._interpreted = InterpretedFunction(fn)

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        def launch(*args: Any, **kwargs: Any) -> None:
            with interpreter_scope():
                self._interpreted[grid](*args, **kwargs)

        return launch

    def __repr__(self) -> str:
        return f"InterpretedKernel({self.fn.__qualname__})"


def jit_interpreted(fn: Callable) -> InterpretedKernel:
    """Decorate ``fn`` to run under Triton's interpreter, whatever ``TRITON_INTERPRET`` says."""
    return InterpretedKernel(fn)


@contextlib.contextmanager
def interpreter_scope() -> Iterator[None]:
    """Make ``triton.language`` usable by the interpreter for one launch (see module doc)."""
    with _scope_lock:
        _warm_up_lazy_imports()
        snapshot = [(owner, dict(vars(owner))) for owner in _namespaces_the_interpreter_patches()]
        restore: list[tuple[Any, str, Any]] = []
        try:
            _swap_helpers_for_interpreted_copies(restore)
            if _index_needs_numpy24_fix():
                _install_index_fix(restore)
            yield
        finally:
            for owner, name, value in reversed(restore):
                setattr(owner, name, value)
            _restore_snapshot(snapshot)


def _namespaces_the_interpreter_patches() -> list[Any]:
    owners = [tl, tl.core, tl.math, tl.tensor, tl.core.dtype]
    descriptor = getattr(tl.core, "tensor_descriptor_base", None)
    if descriptor is not None:
        owners.append(descriptor)
    return list({id(o): o for o in owners}.values())


_MISSING = object()


def _restore_snapshot(snapshot: list[tuple[Any, dict[str, Any]]]) -> None:
    for owner, before in snapshot:
        now = vars(owner)
        for name in [n for n in now if n not in before]:
            delattr(owner, name)
        for name, value in before.items():
            if now.get(name, _MISSING) is not value:
                setattr(owner, name, value)


def _warm_up_lazy_imports() -> None:
    # Argument mangling imports gluon on first use, and gluon asserts that tl.cdiv & co.
    # are JITFunctions: import it before they are swapped.
    with contextlib.suppress(Exception):
        triton.runtime.jit.mangle_type(1)


def _helper_owners() -> list[Any]:
    owners: list[Any] = [tl, tl.core, tl.math]
    for name in ("standard", "random"):
        with contextlib.suppress(ImportError):
            owners.append(importlib.import_module(f"triton.language.{name}"))
    owners.append(tl.tensor)  # member forms: x.sum(), x.to(...) builtins are not JITFunctions
    return owners


def _swap_helpers_for_interpreted_copies(restore: list[tuple[Any, str, Any]]) -> None:
    for owner in _helper_owners():
        for name, value in list(vars(owner).items()):
            if not isinstance(value, JITFunction):
                continue
            cached = _interpreted_helpers.get(id(value))
            if cached is None or cached[0] is not value:
                cached = (value, InterpretedFunction(value.fn))
                _interpreted_helpers[id(value)] = cached
            replacement: Any = cached[1]
            if isinstance(owner, type):  # a method must bind self: wrap in a function
                replacement = _as_method(replacement)
            restore.append((owner, name, value))
            setattr(owner, name, replacement)


def _as_method(fn: InterpretedFunction) -> Callable[..., Any]:
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        return fn(self, *args, **kwargs)

    return method


def _index_needs_numpy24_fix() -> bool:
    if tuple(int(p) for p in np.__version__.split(".")[:2]) < (2, 4):
        return False
    try:
        source = inspect.getsource(_interpreter._patch_lang_tensor)
    except (OSError, TypeError, AttributeError):
        return True  # unknown: the fixed __index__ behaves the same where it is not needed
    return "int(self.handle.data)" in source


def _fixed_index(self: Any) -> int:
    return int(self.handle.data.squeeze())


def _install_index_fix(restore: list[tuple[Any, str, Any]]) -> None:
    # The interpreter (re)sets tensor.__index__ in _patch_lang_tensor at every launch:
    # wrap that function so the fixed version is set right after it.
    original = _interpreter._patch_lang_tensor

    def patch_lang_tensor(tensor: Any, *scope: Any) -> None:
        original(tensor, *scope)
        if scope:  # triton >= 3.6: patches are undone by the scope after the launch
            scope[0].set_attr(tensor, "__index__", _fixed_index)
        else:  # triton 3.5 patches the class for good
            tensor.__index__ = _fixed_index

    restore.append((_interpreter, "_patch_lang_tensor", original))
    _interpreter._patch_lang_tensor = patch_lang_tensor
