"""Numba process setup: seeing what compiles, and a quick start for a command-line run.

watch_compiles: Numba fires its "numba:compile" event only when it compiles a function; a signature loaded
from the on-disk cache fires none. So a warm start, whose kernels all come from the cache,
reports nothing, and the CLI's "compiling kernels" notice appears only when something is
actually compiled.

fast_start: what llama-decode's process sets up before its first kernel so that a warm start
(every kernel in Numba's cache) does only what loading needs. Numba prepares every process
for compiling, cache hit or not; each part below skips one such step, measured on a warm
1-token SmolLM2 run (2 cores, numba 0.68.1):
  * PyYAML, imported by Numba's config for a .numba_config.yaml (_import_numba_lean): 17 ms;
  * SciPy's BLAS, imported by numba.np.arraymath (_registries_without_blas): 0.3 s;
  * the registry refresh before a cache load (_light_cache_loads): Numba imports and installs
    every typing template and lowering of NumPy and Python (0.06 s, 10 MiB) although a cached
    kernel is object code that needs none of them. For synapse_nb's kernels a cache load only
    starts Numba's runtime (NRT); a compilation still refreshes everything first (Numba's
    compiler does it itself), so a cache miss compiles exactly as before;
  * NRT's own functions (atomic incref / decref), which Numba compiles with LLVM in every
    process (_cached_nrt_module): the compile is cheap but it is the only LLVM code generation
    of a warm start, and running LLVM's back end maps 20 MiB more of libllvmlite; the object
    code is kept beside the kernels' cache instead;
  * numba.np.arrayobj and Numba's string support, imported when a cached kernel's environment
    refers to Numba's implementation of np.empty (_environments_without_imports): 37 ms, 4 MiB;
  * numpy.ma, imported by Numba's typeof of the first array argument only to reject masked
    arrays (_typeof_without_numpy_ma): 0.05 s; no masked array can exist before numpy.ma is
    imported;
  * Numba's scan of every installed distribution for numba_extensions entry points
    (_no_extension_entry_points): 0.02 s; no kernel of synapse_nb uses an extension;
  * Python's cyclic garbage collector during the start (_collector_paused): the imports of
    NumPy, Numba and the kernel modules allocate ~0.5 M objects and almost no garbage, and the
    collections they trigger cost 0.04 s (the imports alone, 15 alternating runs: 266 ms median
    with the collector paused, 310 with it). It resumes at the warm-up's end (start_done), the
    start's objects frozen out of later collections (gc.freeze), or at Numba's first compile (a
    compile makes garbage).
All of it changes nothing a kernel computes (the same cached object code runs) and applies to
this process only; library users' processes keep Numba's behaviour.
"""

from __future__ import annotations

import atexit
import gc
import hashlib
import os
import pickle
import sys
from contextlib import contextmanager


@contextmanager
def _hidden(*modules):
    """Within the block, `import M` raises ImportError for each M of modules not yet imported."""
    hide = [m for m in modules if m not in sys.modules]
    for m in hide:
        sys.modules[m] = None
    try:
        yield
    finally:
        for m in hide:
            if m in sys.modules and sys.modules[m] is None:
                del sys.modules[m]


def _import_numba_lean() -> None:
    """Import Numba without PyYAML, unless a .numba_config.yaml (the one file Numba would read
    with it, in the current directory) exists: numba.core.config imports yaml for it (17 ms);
    without SciPy, which Numba's import imports only to check its version (7 ms; a later
    `import scipy` works as usual); and with importlib.metadata a lazy module (the standard
    library's importlib.util.LazyLoader: executed at its first use), which numba.core.entrypoints
    imports for the extension scan that fast_start skips (10 ms)."""
    if "numba" in sys.modules:
        return
    _lazy_module("importlib.metadata")
    with _hidden(*(() if os.path.exists(".numba_config.yaml") else ("yaml",)), "scipy"):
        import numba  # noqa: F401


def _lazy_module(name: str) -> None:
    """Put module `name` (not imported yet) in sys.modules as a lazy module: its code runs when
    one of its attributes is first read (importlib.util.LazyLoader)."""
    import importlib.util

    if name in sys.modules:
        return
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None:
        return
    spec.loader = importlib.util.LazyLoader(spec.loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    parent, _, child = name.rpartition(".")
    if parent in sys.modules:
        setattr(sys.modules[parent], child, module)


def _registries_without_blas() -> None:
    """Numba's NumPy implementation layer imported with SciPy's BLAS hidden, for a process that
    never asks Numba for BLAS (no kernel of synapse_nb uses np.dot / np.linalg).

    numba.np.arraymath imports scipy.linalg.cython_blas when SciPy is installed, only to offer
    np.dot and np.linalg in jitted code; Numba imports that module with its registries (before
    the first compile, and before a cache load that is not one of ours, see _light_cache_loads),
    and SciPy's import costs 0.3-0.4 s. scipy.linalg is hidden only while the registries load,
    and only if numba.np.arraymath is not imported yet: a later `import scipy.linalg` works as
    usual (Numba's own np.dot stays unavailable in this process). A warm start loads no registry
    and imports none of it (55 ms).
    """
    from numba.core import cpu

    numba_load = cpu.CPUContext.load_additional_registries
    if getattr(numba_load, "_synapse_nb", False):
        return

    def load_additional_registries(self):
        # Numba's own import already imports the bare scipy package (a version check, 10 ms);
        # what costs is scipy.linalg, so that is what is hidden.
        with _hidden(*(() if "numba.np.arraymath" in sys.modules else ("scipy.linalg",))):
            return numba_load(self)

    load_additional_registries._synapse_nb = True
    cpu.CPUContext.load_additional_registries = load_additional_registries


def fast_start() -> None:
    """Set up this process for a quick warm start (see the module docstring); idempotent.

    Call before Numba is imported (else PyYAML is imported as usual) and before the first kernel
    loads. Meant for the llama-decode process, not for library users' processes: it patches
    Numba's process-wide behaviour.
    """
    _collector_paused()
    _import_numba_lean()
    for step in (_collector_resumes_at_compiles, _registries_without_blas, _no_extension_entry_points,
                 _typeof_without_numpy_ma, _light_cache_loads, _cached_nrt_module):
        try:
            step()
        except (AttributeError, ImportError, KeyError, TypeError):
            pass  # a Numba without the internals a step relies on (tested with 0.68): its own behaviour


_GC_PAUSED = False  # fast_start paused the cyclic collector (start_done resumes it)
_GC_WATCH = None  # the watch_compiles block (entered) that resumes it at a compile


def _collector_paused() -> None:
    global _GC_PAUSED
    if gc.isenabled():
        gc.disable()
        _GC_PAUSED = True


def _resume_collector(name=None) -> None:
    """Resume the collector if fast_start paused it (name: a compile's, from watch_compiles)."""
    global _GC_PAUSED
    if _GC_PAUSED:
        _GC_PAUSED = False
        gc.enable()


def _collector_resumes_at_compiles() -> None:
    """A Numba compile resumes the collector (Numba's compiler makes cyclic garbage: IR, types)."""
    global _GC_WATCH
    if not _GC_PAUSED or _GC_WATCH is not None:
        return
    _GC_WATCH = watch_compiles(_resume_collector)
    _GC_WATCH.__enter__()
    # a process that exits without start_done (a script calling fast_start) ends the block
    # before the interpreter's teardown, which would otherwise close it with Numba's module gone
    atexit.register(_end_collector_watch)


def _end_collector_watch() -> None:
    global _GC_WATCH
    if _GC_WATCH is not None:
        watch, _GC_WATCH = _GC_WATCH, None
        watch.__exit__(None, None, None)


def start_done() -> None:
    """The end of a run's start (its warm-up): the cyclic garbage collector, if fast_start paused
    it, resumes with every object allocated so far frozen (gc.freeze: the imports' and the
    model's objects live as long as the process, later collections need not traverse them).
    Does nothing in a process that did not call fast_start; idempotent."""
    _end_collector_watch()
    if _GC_PAUSED:
        gc.freeze()
        _resume_collector()


def _no_extension_entry_points() -> None:
    # Numba loads its third-party extensions (entry points of group numba_extensions) on a
    # dispatcher's first call by scanning the metadata of every installed distribution.
    from numba.core import entrypoints

    entrypoints._already_initialized = True


def _typeof_without_numpy_ma() -> None:
    """Numba's typeof of an ndarray, without importing numpy.ma while no masked array can exist."""
    import numpy as np
    from numba.core.typing import typeof as _typeof

    numba_impl = _typeof.typeof_impl.dispatch(np.ndarray)
    if getattr(numba_impl, "_synapse_nb", False):
        return

    def typeof_ndarray(val, c):
        if "numpy.ma" in sys.modules:  # masked arrays may exist: Numba's own check
            return numba_impl(val, c)
        # numba.core.typing.typeof._typeof_ndarray without the isinstance(val, np.ma.MaskedArray)
        try:
            dtype = _typeof.numpy_support.from_dtype(val.dtype)
        except _typeof.errors.NumbaNotImplementedError:
            raise _typeof.errors.NumbaValueError(f"Unsupported array dtype: {val.dtype}")
        layout = _typeof.numpy_support.map_layout(val)
        return _typeof.types.Array(dtype, val.ndim, layout, readonly=not val.flags.writeable)

    typeof_ndarray._synapse_nb = True
    _typeof.typeof_impl.register(np.ndarray)(typeof_ndarray)


def _ours(py_func) -> bool:
    return getattr(py_func, "__module__", "").startswith("synapse_nb.")


def _holds(obj, needle: bytes) -> bool:
    """True when a bytes object anywhere in the nested tuples/lists obj contains needle."""
    if isinstance(obj, (bytes, bytearray)):
        return needle in obj
    if isinstance(obj, (tuple, list)):
        return any(_holds(x, needle) for x in obj)
    return False


def _light_cache_loads() -> None:
    """A cache load of a synapse_nb kernel skips Numba's registry refresh (see the module docstring).

    Numba's Cache.load_overload refreshes the target context before it loads: that installs the
    typing and lowering registries (needed to compile, not to load object code) and starts NRT
    (needed: the kernels call NRT_* functions). For our kernels only NRT is started; the symbols
    a registry module adds when imported are Numba's string-hash secrets (numba.cpython.hashing),
    imported first if the cached code refers to them. Other functions load as Numba loads them.
    """
    from numba.core import caching

    numba_load = caching.Cache.load_overload
    if getattr(numba_load, "_synapse_nb", False):
        return

    def load_overload(self, sig, target_context):
        if not _ours(getattr(self, "_py_func", None)):
            return numba_load(self, sig, target_context)
        from numba.core.runtime import rtsys

        global _LOADING
        rtsys.initialize(target_context)
        with self._guard_against_spurious_io_errors():  # as Numba's _load_overload
            if not self._enabled:
                return None
            _LOADING = True
            try:
                data = self._cache_file.load(self._index_key(sig, target_context.codegen()))
            finally:
                _LOADING = False
            if data is None:
                return None
            if _holds(data, b"_numba_hashsecret_"):
                import numba.cpython.hashing  # noqa: F401  (adds the symbols)
            global _LAZY_NAMES
            fndesc = data[1] if isinstance(data, tuple) and len(data) > 1 else None
            # Its CPython wrapper and its native entry (what kernels.native calls by address)
            names = (getattr(fndesc, "llvm_cpython_wrapper_name", None), getattr(fndesc, "llvm_func_name", None))
            _LAZY_NAMES = names if all(isinstance(n, str) for n in names) else None
            try:
                return self._impl.rebuild(target_context, data)
            finally:
                _LAZY_NAMES = None
        return None  # an I/O error swallowed by the guard

    load_overload._synapse_nb = True
    caching.Cache.load_overload = load_overload
    _lazy_bitcode()
    _environments_without_imports()


_LOADING = False  # a cache entry of ours is being unpickled (under Numba's compiler lock)


def _environments_without_imports() -> None:
    """A cached kernel's environments of Numba's own implementations, without importing their module.

    A kernel that allocates (np.empty, np.full) refers to the environment (globals and constants
    for Python objects) of Numba's implementation of that function, and unpickling it imports
    the module holding the implementation to take its globals: numba.np.arrayobj, which imports
    Numba's string support (37 ms, 4 MiB). Nopython code reads only the constants of an
    environment (the globals serve object mode, which no kernel uses), so while one of our cache
    entries loads, the environment of a Numba module not imported yet gets a globals dict holding
    its name only (as pickled). Everything else is Numba's _rebuild_env.

    The replacement takes the original's module and name: Numba pickles an environment as a call
    of environment._rebuild_env, and cloudpickle stores a function it finds under its module and
    name as that reference. A nested function would be stored by value in every cache entry
    compiled in this process, its module globals frozen (_LOADING false: each load of such an
    entry imports the module again), and deserialized at every load.
    """
    from numba.core import environment

    numba_rebuild = environment._rebuild_env
    if getattr(numba_rebuild, "_synapse_nb", False):
        return

    def _rebuild_env(modname, consts, env_name):
        if not (_LOADING and isinstance(modname, str) and modname.startswith("numba.")
                and modname not in sys.modules) or environment.lookup_environment(env_name) is not None:
            return numba_rebuild(modname, consts, env_name)
        env = environment.Environment({"__name__": modname})
        env.consts[:] = consts
        env.env_name = env_name
        environment.Environment._memo[env_name] = env
        return env

    _rebuild_env._synapse_nb = True
    _rebuild_env.__module__ = numba_rebuild.__module__  # pickled as numba.core.environment._rebuild_env
    _rebuild_env.__qualname__ = numba_rebuild.__qualname__
    environment._rebuild_env = _rebuild_env


# Set by a cache load of ours around Numba's rebuild (under Numba's compiler lock): the symbols
# looked up in the loaded library (its CPython wrapper, its native entry), known without parsing
# its bitcode.
_LAZY_NAMES = None


def _lazy_bitcode() -> None:
    """A kernel loaded from the cache parses its LLVM bitcode only when something needs it.

    Numba's cache entry holds a kernel's object code (what runs) and its bitcode (what a later
    compilation links in, and where Numba reads the names of the symbols the code defines).
    Numba parses the bitcode at load: 0.7 MiB of LLVM module per kernel, 9 MiB for the kernels
    of a 1-token run, never used unless something compiles in the process. For our loads the
    library keeps the bytes and parses them on first need: linking (its shared module), or a
    symbol other than its wrapper and native entry looked up (get_pointer_to_function).
    """
    import inspect

    import llvmlite.binding as ll
    from numba.core import codegen

    base = codegen.JITCodeLibrary
    numba_unserialize = inspect.getattr_static(base, "_unserialize")  # the classmethod object
    if getattr(numba_unserialize, "_synapse_nb", False):
        return

    class LazyBitcodeLibrary(base):
        """A JITCodeLibrary from cached object code whose bitcode is parsed on first use."""

        _bitcode = None

        @property
        def _shared_module(self):
            if self._bitcode is not None:  # parse it, and learn every symbol the library defines
                bc, self._bitcode = self._bitcode, None
                self.__dict__["_shared_module_"] = ll.parse_bitcode(bc)
                self._codegen._engine._load_defined_symbols(self.__dict__["_shared_module_"])
            return self.__dict__.get("_shared_module_")

        @_shared_module.setter
        def _shared_module(self, mod):
            self.__dict__["_shared_module_"] = mod

        def get_pointer_to_function(self, name):
            if self._bitcode is not None and not self._codegen._engine.is_symbol_defined(name):
                self._shared_module  # noqa: B018  (parses the bitcode, registering its symbols)
            return super().get_pointer_to_function(name)

    def _unserialize(cls, codegen_, state):
        names = _LAZY_NAMES
        try:
            name, kind, (object_code, shared_bitcode) = state
        except (TypeError, ValueError):
            names = None
        if names is None or cls is not base or kind != "object":
            return numba_unserialize.__func__(cls, codegen_, state)
        # numba.core.codegen.CPUCodeLibrary._unserialize ("object"), the bitcode kept as bytes
        self = LazyBitcodeLibrary(codegen_, name)
        self.enable_object_caching()
        self._set_compiled_object(object_code)
        self._bitcode = shared_bitcode
        self._finalize_final_module()
        codegen_._engine._defined_symbols.update(names)
        return self

    _unserialize._synapse_nb = True
    base._unserialize = classmethod(_unserialize)


def _nrt_cache_file(codegen):
    """Path of the cached NRT object code for this Numba, LLVM and target, or None (no cache dir,
    or NRT debugging on: then Numba's module differs)."""
    import llvmlite
    import numba
    from numba.core import config

    from .kernels import cache_locators

    if config.DEBUG_NRT or config.NRT_STATS:
        return None
    d = cache_locators.cache_dir()
    if d is None:
        return None
    key = repr((numba.__version__, llvmlite.__version__, codegen.magic_tuple(), config.OPT, sys.version_info[:2]))
    return os.path.join(d, f"numba_nrt-{hashlib.sha256(key.encode()).hexdigest()[:16]}.nbc")


def _cached_nrt_module() -> None:
    """NRT's LLVM functions loaded as cached object code instead of compiled in every process.

    numba.core.runtime.nrtdynmod.compile_nrt_functions builds a small LLVM module (atomic
    incref/decref, meminfo data, the unresolved-symbol abort) and compiles it: the same module for
    a given Numba, LLVM and CPU. Its object code is saved beside the kernels' cache (the file
    name keys Numba's and llvmlite's versions and the target) and reloaded as Numba reloads a
    cached kernel; anything unusable about the file means compiling, as Numba does.
    """
    from numba.core.runtime import nrtdynmod

    numba_compile = nrtdynmod.compile_nrt_functions
    if getattr(numba_compile, "_synapse_nb", False):
        return

    def compile_nrt_functions(ctx):
        codegen = ctx.codegen()
        try:
            path = _nrt_cache_file(codegen)
        except Exception:  # no usable cache directory
            path = None
        if path is None:
            return numba_compile(ctx)
        try:
            with open(path, "rb") as f:
                state = pickle.load(f)
            if isinstance(state, tuple) and len(state) == 3 and state[:2] == ("nrt", "object"):
                global _LAZY_NAMES
                _LAZY_NAMES = ()  # its bitcode parsed only if a compilation links it in (3 MiB)
                try:
                    return codegen.unserialize_library(state)
                finally:
                    _LAZY_NAMES = None
        except Exception:
            pass  # missing or unreadable: compile and save it again
        ir_mod, library = nrtdynmod.create_nrt_module(ctx)
        library.enable_object_caching()
        library.add_ir_module(ir_mod)
        library.finalize()
        try:
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "wb") as f:
                pickle.dump(library.serialize_using_object_code(), f, protocol=pickle.HIGHEST_PROTOCOL)
            os.replace(tmp, path)
        except OSError:
            pass
        return library

    compile_nrt_functions._synapse_nb = True
    nrtdynmod.compile_nrt_functions = compile_nrt_functions


def in_cache(dispatcher, sig: tuple) -> bool:
    """Whether dispatcher's overload for sig (a tuple of Numba types) is compiled in this process
    or in Numba's cache for its current source (the cache's index names it), without loading it:
    the key is the one Cache.load_overload looks up. False for a dispatcher without a cache, or an
    index that cannot be read (a load would compile then)."""
    if sig in dispatcher.overloads:
        return True
    cache = getattr(dispatcher, "_cache", None)
    try:
        return cache._index_key(sig, dispatcher.targetctx.codegen()) in cache._cache_file._load_index()
    except (AttributeError, OSError, EOFError, pickle.UnpicklingError, TypeError, ValueError):
        return False


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


# Shared libraries whose pages a run touches mostly while they load: LLVM (llvmlite's
# libllvmlite.so: its static initializers, Numba's code generator set-up and each kernel's cache
# load), OpenSSL (hashlib's set-up) and NumPy's OpenBLAS (its initialization; no kernel uses it).
_RELEASABLE = ("libllvmlite", "libcrypto", "openblas", "libgfortran")
_CLEAN: dict = {}  # (start, end, path) of a mapping -> it held only the file's pages when first seen
_MADVISE = None
_MADV_DONTNEED = 4


def _releasable_ranges() -> list:
    """(address, length) of every read-only private mapping of a _RELEASABLE library that holds no
    page of the process's own: text, read-only data and headers, whose pages all are the file's
    (never the relocated RELRO pages, copies written by the loader). /proc/self/maps gives the
    mappings as they are now (1 ms); /proc/self/pagemap tells, page by page, a present page of
    the file (bit 61) from an anonymous copy, or a swapped one (bit 62), checked once per mapping
    (1 ms): a mapping with any such page is left alone. (/proc/self/smaps says the same per
    mapping, but takes 5 ms to produce.)"""
    import numpy as np

    cands = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if (len(parts) >= 6 and parts[1][1] == "-" and parts[1][3] == "p"
                    and any(n in parts[5].rsplit("/", 1)[-1] for n in _RELEASABLE)):
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                cands.append((lo, hi, parts[5]))
    new = [c for c in cands if c not in _CLEAN]
    if new:
        page = os.sysconf("SC_PAGE_SIZE")
        fd = os.open("/proc/self/pagemap", os.O_RDONLY)
        try:
            for c in new:
                lo, hi = c[0], c[1]
                e = np.frombuffer(os.pread(fd, (hi - lo) // page * 8, lo // page * 8), np.uint64)
                own = ((e >> np.uint64(63)) & ~(e >> np.uint64(61))) | (e >> np.uint64(62))
                _CLEAN[c] = e.shape[0] == (hi - lo) // page and not (own & np.uint64(1)).any()
        finally:
            os.close(fd)
    return [(lo, hi - lo) for lo, hi, path in cands if _CLEAN[(lo, hi, path)]]


def release_library_pages() -> None:
    """Unmap from this process the pages of LLVM's (and a few other) shared libraries that it has
    touched, so that only those used again count in its resident set (Linux; elsewhere nothing).

    Importing llvmlite maps 40 MiB of libllvmlite.so (its static initializers run all over
    it, and the kernel maps each faulted page's neighbours); loading the kernels maps more; a
    decode step runs none of it. madvise(MADV_DONTNEED) on a clean read-only file mapping only
    drops page-table entries: the pages stay in the page cache (other processes keep using them)
    and a later access maps them again, unchanged; nothing is written, freed or read from disk
    unless the kernel evicted them meanwhile. A mapping with a page of the process's own (written
    or swapped) is never touched, and the mappings are read again at every call. The first call
    costs 3 ms (finding the mappings, 2 ms, and unmapping 45 MiB), later ones 1 ms plus the pages
    mapped again; compilation.warmup calls it before and after it loads the kernels. (Calling it
    after each kernel's load too would keep the 5 MiB that a load maps out of the peak, for 5 ms
    of a warm start.)
    """
    global _MADVISE
    if not sys.platform.startswith("linux") or _MADVISE is False:
        return
    try:
        if _MADVISE is None:
            import ctypes

            madvise = ctypes.CDLL(None, use_errno=True).madvise
            madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
            madvise.restype = ctypes.c_int
            _MADVISE = madvise
        for addr, length in _releasable_ranges():
            _MADVISE(addr, length, _MADV_DONTNEED)
    except (OSError, AttributeError, ValueError):
        _MADVISE = False  # no /proc or no madvise: nothing to release
