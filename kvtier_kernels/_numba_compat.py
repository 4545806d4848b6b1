"""Importing numba for kvtier's CPU kernels: :func:`import_numba`, which also keeps
llvmlite's library handle safe for code that walks every module's namespace."""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["import_numba"]


def import_numba() -> Any:
    """``import numba`` (raising what it raises), with llvmlite's library handle made safe
    for code that walks every module's namespace (:func:`_give_llvmlite_lib_a_dict`)."""
    import numba

    _give_llvmlite_lib_a_dict()
    return numba


def _give_llvmlite_lib_a_dict() -> None:
    """Replace ``llvmlite.binding.ffi.lib`` with an equal handle that has a ``__dict__``.

    NOTE: llvmlite's handle on its shared library answers every attribute it lacks with a
    C function, ``__dict__`` included, so ``vars(lib)`` returns a function. vLLM 0.32's CPU
    worker start-up walks every loaded module's namespace and calls ``vars(value).get``
    on each value (``register_triton_kernel_overrides``), so an engine started in a
    process where numba was already imported (a second engine in one process) fails
    with ``'_lib_fn_wrapper' object has no attribute 'get'``. The replacement is an
    instance of a subclass without ``__slots__`` (so with an empty ``__dict__``) sharing
    the original's library handle, function table and lock; llvmlite reads ``ffi.lib``
    at every call, so it uses the replacement from then on. Nothing is changed where
    llvmlite's internals differ from that.
    """
    try:
        from llvmlite.binding import ffi

        lib = ffi.lib
        cls = type(lib)
        slots = cls.__dict__.get("__slots__")
        if not slots or isinstance(vars(lib), dict):
            return
        with_dict = type(cls.__name__, (cls,), {"__module__": cls.__module__})
        replacement = object.__new__(with_dict)
        for slot in slots:
            setattr(replacement, slot, getattr(lib, slot))
        ffi.lib = replacement
    except Exception:  # another llvmlite: leave it as it is
        logger.debug("llvmlite's library handle left as it is", exc_info=True)
