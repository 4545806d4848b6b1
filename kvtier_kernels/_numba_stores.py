"""Streaming (non-temporal) stores for kvtier's numba CPU kernels: :func:`streaming_stores`
returns ``stream_store(array, index, value)`` and ``store_fence()``, numba intrinsics that a
kernel module binds in its globals (:class:`~kvtier_kernels._launch.NumbaKernel`'s
``bindings``).

A paged copy writes each byte once and reads none of them back: with ordinary stores every
destination cache line is first read from memory (read for ownership), so a copy moves
three bytes over the memory bus for every two a streaming store moves, and it evicts the
cache's useful lines besides. ``stream_store`` is an LLVM store carrying ``!nontemporal``:
on x86-64 a ``movnti`` that writes through the write-combining buffers (a prompt's
scatter into vLLM's CPU layout went from 0.55x to 0.90-0.95x of a raw copy of the same
bytes on this project's 2-core machine); on a target without such a store LLVM emits an
ordinary one, so the result is the same bytes everywhere. Streaming stores are weakly ordered, so a kernel that makes
them ends with ``store_fence()`` (an LLVM ``fence seq_cst``: ``mfence`` on x86-64), after
which every other thread sees them: the kernel's caller may hand the memory on at once.
"""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["streaming_stores"]


@functools.cache
def streaming_stores() -> dict[str, Any]:
    """``{"stream_store": ..., "store_fence": ...}``, the intrinsics (imports numba; built
    once per process).

    ``stream_store(array, index, value)``: ``array.reshape(-1)[index] = value`` for a
    C-contiguous 1-D integer ``array``, ``index`` an integer in range (not checked, not
    wrapped: a kernel computes its indices) and ``value`` of the array's dtype.
    ``store_fence()``: orders every store before it.
    """
    from llvmlite import ir
    from numba import types
    from numba.extending import intrinsic

    @intrinsic
    def stream_store(typingctx: Any, array: Any, index: Any, value: Any) -> Any:
        if not (
            isinstance(array, types.Array)
            and array.ndim == 1
            and array.layout == "C"
            and isinstance(array.dtype, types.Integer)
            and isinstance(index, types.Integer)
            and value == array.dtype
        ):
            return None  # numba then reports a typing error naming these argument types

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            target, at, word = args
            data = context.make_array(signature.args[0])(context, builder, target).data
            at = context.cast(builder, at, signature.args[1], types.intp)
            align = context.get_abi_sizeof(context.get_value_type(signature.args[2]))
            store = builder.store(word, builder.gep(data, [at]), align=align)
            one = builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)])
            store.set_metadata("nontemporal", one)
            return context.get_dummy_value()

        return types.void(array, index, value), codegen

    @intrinsic
    def store_fence(typingctx: Any) -> Any:
        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            builder.fence("seq_cst")
            return context.get_dummy_value()

        return types.void(), codegen

    return {"stream_store": stream_store, "store_fence": store_fence}
