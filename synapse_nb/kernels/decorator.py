"""``kernel``: the one decorator of every Numba function in synapse_nb/kernels.

``@kernel`` / ``@kernel(inline="always")`` / ``@kernel(parallel=True)`` / ``@kernel(nested=True)``
is Numba's njit with the package's policy, so that no kernel differs from another in how it is
compiled or cached:
  * ``cache=True``, with the locators of cache_locators.py (installed here before the first kernel is
    decorated, as Numba picks a function's locator then): a cached kernel depends on all of
    synapse_nb/kernels/*.py, never running code built from an older file it inlines;
  * ``error_model="numpy"``: a division by zero gives inf or nan as in ggml's C, instead of
    Numba's default Python semantics, which raise ZeroDivisionError (from inside a parallel
    region: "SystemError ... returned a result with an exception set"). Finite results are the
    same either way.
  * ``nested=True``: a kernel that only other kernels call (a callee, not inlined at Numba's level;
    or a kernel called by address, native.call_at). Numba compiles every function it is asked to
    with two wrappers, one that Python calls (boxing and unboxing each argument) and one of the C
    ABI; a callee needs neither, and they were ~40 ms of each such function's compile (25-30 such
    functions in a first run). Compiled without them (Numba's own no_cpython_wrapper and
    no_cfunc_wrapper, as its @overload implementations are), its code is the same; a call from
    Python, which would jump to the missing wrapper, raises TypeError instead (NestedDispatcher);
    python_call makes one callable from a test.
Other njit options (inline, parallel, ...) pass through; cache and error_model may not be given.
"""

import functools

from numba import njit
from numba.core.registry import CPUDispatcher

from . import cache_locators


class NestedDispatcher(CPUDispatcher):
    """A kernel compiled without Numba's Python wrapper (kernel(nested=True)): callable from
    kernels only. Called from Python, it raises TypeError naming itself."""

    def __call__(self, *args, **kwargs):
        raise TypeError(f"{self.py_func.__module__}.{self.py_func.__qualname__} is a nested kernel "
                        "(kernel(nested=True)): call it from a kernel, not from Python")


@functools.cache
def python_call(nested_kernel):
    """nested_kernel (kernel(nested=True)) made callable from Python, for tests and benchmarks: a
    jitted function that calls it with its arguments (compiled for each argument types, not
    cached; the kernel itself is compiled and cached as for any caller)."""

    @njit(cache=False, error_model="numpy")
    def call(*args):
        return nested_kernel(*args)

    return call


def kernel(fn=None, *, nested=False, **options):
    """njit(cache=True, error_model="numpy", **options)(fn); without fn, the decorator. nested: no
    Python or C wrapper (see the module docstring)."""
    cache_locators.install()
    if nested:
        options.update(no_cpython_wrapper=True, no_cfunc_wrapper=True)
    dec = njit(cache=True, error_model="numpy", **options)

    def decorate(f):
        d = dec(f)
        if nested:  # (njit has no argument for the dispatcher's class; NestedDispatcher adds no state)
            d.__class__ = NestedDispatcher
        return d

    return decorate if fn is None else decorate(fn)
