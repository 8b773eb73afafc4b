"""Numba process setup: seeing what compiles, and a faster first kernel for a command-line run.

watch_compiles: Numba fires its "numba:compile" event only when it compiles a function; a signature loaded
from the on-disk cache fires none. So a warm start, whose kernels all come from the cache,
reports nothing, and the CLI's "compiling kernels" notice appears only when something is
actually compiled.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager


def import_numba_without_blas() -> None:
    """Import Numba's NumPy implementation layer with SciPy hidden, for a process that never
    asks Numba for BLAS (no kernel of synapse_nb uses np.dot / np.linalg).

    numba.np.arraymath imports scipy.linalg.cython_blas when SciPy is installed, only to offer
    np.dot and np.linalg in jitted code; Numba imports that module on its first compile or cache
    load, and SciPy's import costs 0.3-0.4 s of a 1 s warm start here. scipy.linalg is hidden only
    while that module imports: a later `import scipy` in the process works as usual (Numba's
    own np.dot stays unavailable in it). Does nothing when SciPy or that module is already
    imported. Meant for the llama-decode process, not for library users' processes.
    """
    # Numba's own import already imports the bare scipy package (a version check, 10 ms); what
    # costs is scipy.linalg, so that is what is hidden.
    if "scipy.linalg" in sys.modules or "numba.np.arraymath" in sys.modules:
        return
    sys.modules["scipy.linalg"] = None  # makes `import scipy.linalg...` raise ImportError
    try:
        import numba.np.arraymath  # noqa: F401
    finally:
        if "scipy.linalg" in sys.modules and sys.modules["scipy.linalg"] is None:
            del sys.modules["scipy.linalg"]


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
