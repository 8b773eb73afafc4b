"""A second process that compiles half of a cold warm-up's kernels into Numba's cache.

Numba compiles one function at a time under a process-wide lock, about half of it in LLVM and
half in Python, so a first run (an empty cache) uses one core however many the machine has.
compilation.warmup's two forwards compile disjoint sets of kernels when the batched one keeps all
its logits (every kernel call has N > 1 rows: the _mm_ drivers, the parallel row ops, prefill
attention) and the single-token one has one row (the _mv_ drivers, the serial ops, decode
attention). So while the warm-up runs the batched forward, this process (main(), started with
the parent's own package first on sys.path: the cache entries are keyed by source file) runs
the single-token forward on the same model into the same cache; the warm-up then runs its
single-token forward, which loads what this process wrote. Both forwards run the one compiled
block loop (kernels/graph.layers): this process compiles it first (Model.compile_layers), so
that the warm-up's process loads it. A run of a one-token prompt has no batched forward: then
this process compiles the block loop only (and the attention kinds of the warm-up's last step)
while the warm-up's process compiles the single-token kernels.

A Helper starts the process only when the warm-up really compiles (Numba's first
"numba:compile" event: a warm cache never starts it), and the warm-up waits for it before it
touches its kernels. Nothing depends on it for correctness: a kernel it did not write in time
(it failed, or was killed) is compiled by the warm-up as without it, and its outputs go to
/dev/null (stdout is the product). It exits when the warm-up's process is gone.

Both processes save to the same cache files, so while a Helper runs each of them takes an
exclusive lock on the cache directory around Numba's index update and data write
(locked_cache_saves): without it two processes saving different signatures of one function
could both take data file number 1, and the index would name the other's code.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys

try:
    import fcntl
except ImportError:  # not POSIX: no helper (available() is False)
    fcntl = None


def _package_dir() -> str:
    """The directory of the synapse_nb package this module belongs to."""
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def available() -> bool:
    """Whether a Helper can run here (POSIX file locks)."""
    return fcntl is not None


@contextlib.contextmanager
def locked_cache_saves():
    """Within the block, every Numba cache save of this process holds an exclusive flock on the
    cache directory around the index's read-modify-write and the data file's write."""
    from numba.core import caching

    cls = caching.IndexDataCacheFile
    save = cls.save

    def locked_save(self, key, data):
        fd = os.open(self._cache_path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            save(self, key, data)
        finally:
            os.close(fd)  # releases the lock

    cls.save = locked_save
    try:
        yield
    finally:
        cls.save = save


class Helper:
    """The helper process of one warm-up: the block loop, the single-token forward (unless
    single=False: a warm-up with no batched forward, whose own process compiles it) and the
    attention kernels of ``rest`` (see compilation.warmup) on the model at ``path``, with
    ``override`` as the warm-up Session's Workspace.parallel_override. ``helper.beside(work)`` runs
    the work it compiles beside."""

    TIMEOUT_S = 900  # a helper past this is killed; the warm-up compiles what it did not

    def __init__(self, path, override: dict, rest, single: bool = True):
        self._args = [os.path.abspath(path), json.dumps({"override": sorted(override.items()), "rest": sorted(rest),
                                                         "single": single})]
        self._proc = None

    def _start(self):
        if self._proc is not None:
            return
        # The child must import this very package (its kernels' cache entries are keyed by their
        # source files): its directory goes first on sys.path, before the working directory
        # (which may hold another copy, e.g. a source checkout beside an installed package).
        pkg = _package_dir()
        code = ("import sys; sys.path.insert(0, sys.argv[1]); from synapse_nb.compilation.helper import main; "
                "sys.exit(main(sys.argv[2:]))")
        try:
            self._proc = subprocess.Popen([sys.executable, "-c", code, os.path.dirname(pkg), pkg, *self._args],
                                          stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL)
        except OSError:
            self._proc = False  # no helper: the warm-up compiles everything itself

    @property
    def started(self) -> bool:
        """Whether the helper process was started (something compiled)."""
        return bool(self._proc)

    def beside(self, work) -> None:
        """Run work() with this helper started at Numba's first compile in it, then wait for the
        helper; the cache saves of both processes locked meanwhile (locked_cache_saves)."""
        with locked_cache_saves():
            with self._on_first_compile():
                work()
            self.wait()

    def _on_first_compile(self):
        """Within the block, start the helper when Numba first compiles something."""
        from ..jit import watch_compiles

        return watch_compiles(lambda name: self._start())

    def wait(self):
        """Wait for the helper to finish (if it started); kill it after TIMEOUT_S."""
        if self._proc:
            try:
                self._proc.wait(timeout=self.TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()


def _exit_with_parent():
    """A daemon thread that ends this process when the warm-up's process is gone (killed), so
    that a killed run leaves no compiler behind (what it saved is complete: saves are atomic)."""
    import threading
    import time

    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(0.2)
        os._exit(0)

    threading.Thread(target=watch, daemon=True).start()


def main(argv) -> int:
    """The helper process: argv = [the parent's synapse_nb package directory, model path, JSON
    {"override": [[decode, parallel], ...], "rest": [[decode, parallel], ...], "single": bool}]. Returns 2 without
    compiling anything when this process imported another synapse_nb than the parent."""
    if _package_dir() != argv[0]:
        return 2
    _exit_with_parent()
    path, spec = argv[1], json.loads(argv[2])
    from ..model import load_model
    from .forwards import compile_attention, warmup_session

    with locked_cache_saves():
        model = load_model(path)
        s = warmup_session(model, {bool(d): bool(p) for d, p in spec["override"]})
        model.compile_layers(s.state, s.cache)  # first: the parent's first forward needs it too
        if spec.get("single", True):
            s.eval([0])
        rest = {(bool(d), bool(p)) for d, p in spec["rest"]}
        if rest:
            compile_attention(model, s, rest)
    return 0
