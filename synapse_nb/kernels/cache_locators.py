"""Numba cache locators that make every cached kernel of this package depend on all its sources.

Numba stamps a function's on-disk cache with a hash of the function's own source file only
(numba.core.caching._SourceFileBackedLocatorMixin.get_source_stamp). Our kernels inline functions
from other files (a matmul driver inlines legacy.py's row functions, which inline simd.py's
helpers), so after an edit to simd.py the cached legacy.py and matmul.py code would keep
running the old helper. The locators here replace that stamp with one sha256 over the contents of
every synapse_nb/kernels/*.py file: an edit to any of them invalidates every cached kernel of the
package (recompiling all of it once, ~1 minute, is the price of never running stale code).

They are Numba's own three file-backed locators (NUMBA_CACHE_DIR, the __pycache__ next to the
source, the user-wide cache directory), with only the stamp changed, and they decline functions
defined outside synapse_nb/kernels, which Numba's own locators then handle as usual.

``install()`` puts them at the front of numba.core.caching.CacheImpl._locator_classes. It must
run before the first kernel of the package is decorated, because Numba chooses the locator (and
reads the source stamp) at decoration time; decorator.kernel, the package's one decorator, calls
it (idempotent) each time it decorates. It changes only how functions in this directory are
cached.
"""

import functools
import hashlib
import os

from numba.core import caching

KERNELS_DIR = os.path.dirname(os.path.abspath(__file__))


@functools.lru_cache(maxsize=None)
def package_source_stamp():
    """sha256 (hex) of the (name, contents) of all synapse_nb/kernels/*.py.

    Computed once per process, when the first kernel is decorated, i.e. from the sources this
    process imports (a file edited while the process runs does not change what it runs, nor
    what it stamps); every new process hashes the files again.
    """
    h = hashlib.sha256()
    for name in sorted(os.listdir(KERNELS_DIR)):
        if name.endswith(".py"):
            h.update(name.encode() + b"\0")
            with open(os.path.join(KERNELS_DIR, name), "rb") as f:
                h.update(f.read())
            h.update(b"\0")
    return h.hexdigest()


def _in_package(py_file):
    try:
        return os.path.dirname(os.path.abspath(py_file)) == KERNELS_DIR
    except (TypeError, ValueError):
        return False


_USABLE_DIRS = set()  # cache directories found writable in this process


class _PackageStampMixin:
    """Source stamp = the whole package's; only functions defined in synapse_nb/kernels."""

    def get_source_stamp(self):
        return package_source_stamp()

    def ensure_cache_path(self):
        # Numba's creates the directory and a temporary file in it for every decorated function
        # (about 130 at import); once per directory and process is enough to know it is usable.
        path = self.get_cache_path()
        if path not in _USABLE_DIRS:
            super().ensure_cache_path()
            _USABLE_DIRS.add(path)

    @classmethod
    def from_function(cls, py_func, py_file):
        if not _in_package(py_file):
            return None
        return super().from_function(py_func, py_file)


class UserProvidedCacheLocator(_PackageStampMixin, caching.UserProvidedCacheLocator):
    """NUMBA_CACHE_DIR, with the package-wide source stamp."""


class InTreeCacheLocator(_PackageStampMixin, caching.InTreeCacheLocator):
    """synapse_nb/kernels/__pycache__, with the package-wide source stamp."""


class UserWideCacheLocator(_PackageStampMixin, caching.UserWideCacheLocator):
    """The user-wide Numba cache directory, with the package-wide source stamp."""


LOCATORS = (UserProvidedCacheLocator, InTreeCacheLocator, UserWideCacheLocator)


def cache_dir():
    """The directory Numba caches this package's kernels in (the first usable of LOCATORS, as
    Numba chooses for each kernel), or None when none is usable."""
    for cls in LOCATORS:
        loc = cls.from_function(cache_dir, os.path.abspath(__file__))
        if loc is not None:
            return loc.get_cache_path()
    return None


def install():
    """Put LOCATORS first in Numba's locator list (idempotent). See the module docstring."""
    classes = caching.CacheImpl._locator_classes
    if list(classes[:len(LOCATORS)]) != list(LOCATORS):
        classes[:] = list(LOCATORS) + [c for c in classes if c not in LOCATORS]
