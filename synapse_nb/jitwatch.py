"""Seeing Numba compile: a context manager that reports each real compilation (a cache miss).

Numba fires its "numba:compile" event only when it compiles a function; a signature loaded
from the on-disk cache fires none. So a warm start, whose kernels all come from the cache,
reports nothing, and the CLI's "compiling kernels" notice appears only when something is
actually compiled.
"""

from __future__ import annotations

from contextlib import contextmanager


@contextmanager
def watch_compiles(on_compile):
    """Within the block, call on_compile(name: str) at the start of every Numba compilation.

    name is the compiled function's qualified name (as Numba reports it). Nested compiles
    (a kernel inlining helpers it compiles first) each report. Yields nothing.
    """
    from numba.core import event

    class _Listener(event.Listener):
        def on_start(self, ev):
            data = ev.data or {}
            disp = data.get("dispatcher")
            on_compile(getattr(getattr(disp, "py_func", None), "__qualname__", "?"))

        def on_end(self, ev):
            pass

    listener = _Listener()
    event.register("numba:compile", listener)
    try:
        yield
    finally:
        event.unregister("numba:compile", listener)
