"""``kernel``: the one decorator of every Numba function in synapse_nb/kernels.

``@kernel`` / ``@kernel(inline="always")`` / ``@kernel(parallel=True)`` is Numba's njit with the
package's policy, so that no kernel differs from another in how it is compiled or cached:
  * ``cache=True``, with the locators of cache_locators.py (installed here before the first kernel is
    decorated, as Numba picks a function's locator then): a cached kernel depends on all of
    synapse_nb/kernels/*.py, never running code built from an older file it inlines;
  * ``error_model="numpy"``: a division by zero gives inf or nan as in ggml's C, instead of
    Numba's default Python semantics, which raise ZeroDivisionError (from inside a parallel
    region: "SystemError ... returned a result with an exception set"). Finite results are the
    same either way.
Other njit options (inline, parallel, ...) pass through; cache and error_model may not be given.
"""

from numba import njit

from . import cache_locators


def kernel(fn=None, **options):
    """njit(cache=True, error_model="numpy", **options)(fn); without fn, the decorator."""
    cache_locators.install()
    dec = njit(cache=True, error_model="numpy", **options)
    return dec if fn is None else dec(fn)
