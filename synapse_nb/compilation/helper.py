"""A second process that compiles half of a cold warm-up's kernels into Numba's cache.

Numba compiles one function at a time under a process-wide lock, about half of it in LLVM and
half in Python, so a first run (an empty cache) uses one core however many the machine has.
compilation.warmup's forwards (a batched one, whose calls have N > 1 rows: the _mm_ drivers, the
parallel row ops, prefill attention; a single-token one: the _mv_ drivers, the serial ops,
decode attention) call kernels the warm-up can list without compiling them
(forwards.warmup_steps). This process (main(), started with the parent's own package first on
sys.path: the cache entries are keyed by source file) first compiles the one block loop both
forwards run (kernels/graph.layers, Model.compile_layers), so that the warm-up's process loads
it; then the two processes compile that list from opposite ends, the warm-up's process from the
batched forward's first kernel, this one from the single-token forward's last, each claiming a
kernel before it compiles it (Helper.share), until they meet; the warm-up then waits for this
process and runs its forwards, which load everything from the cache. (Before, this process
compiled the single-token forward whole beside the batched one, and for a one-token prompt the
block loop only, the warm-up's process the single-token kernels alone: SmolLM2's first 'Hello'
-n 1 compiled for 8.6 s, now 5.2 s.)

A Helper starts the process only when the warm-up really compiles (Numba's first
"numba:compile" event: a warm cache never starts it), and the warm-up waits for it before it
touches its kernels. A completion or a chat starts it earlier (Helper.ahead,
engine.compiling_ahead): at the first compile of the model's load and the prompt's tokenization
(the vocabulary's kernels, 2.6-3.4 s of a cold SmolLM2 run), before the warm-up knows what the
run needs. That process compiles the block loop, which the helper compiles first in every case,
and then reads the rest of its work (the JSON of main's argv) from its standard input, which the
warm-up writes (Helper.tell) or closes (Helper.cancel: nothing more to do). Nothing depends on it
for correctness: a kernel it did not write in time (it failed, or was killed) is compiled by the
warm-up as without it, and its outputs go to /dev/null (stdout is the product). It exits when
the warm-up's process is gone.

Both processes save to the same cache files, so from a Helper's start until it is waited for each
of them takes an exclusive lock on the cache directory around Numba's index update and data write
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


def _spec(override: dict, rest, batched: bool, head: bool) -> str:
    return json.dumps({"override": sorted(override.items()), "rest": sorted(rest), "batched": batched, "head": head})


class Helper:
    """The helper process of one warm-up: the block loop, its share of the warm-up's kernels
    (forwards.warmup_steps of batched, head and rest, from the last; see share) and the
    attention kernels of ``rest`` (see compilation.warmup) on the model at ``path``, with
    ``override`` as the warm-up Session's Workspace.parallel_override. ``helper.beside(work)`` runs
    the work it compiles beside. Helper.ahead(path) is one whose work is told later (tell)."""

    TIMEOUT_S = 900  # a helper past this is killed; the warm-up compiles what it did not

    def __init__(self, path, override: dict | None = None, rest=(), batched: bool = False, head: bool = False):
        self._path = os.path.abspath(path)
        self._spec = None if override is None else _spec(override, rest, batched, head)
        self._proc = None
        self._told = self._spec is not None  # its work is known (given, told, or cancelled)
        self._locks = None  # locked_cache_saves while the process may save
        self._watch = None
        self._claims = None  # the claims file of share (an unlinked temporary file), inherited by the process

    @classmethod
    def ahead(cls, path) -> "Helper":
        """A Helper for the model at path whose work the warm-up tells it later (tell, or cancel);
        start_on_first_compile() starts it at this process's first compile."""
        return cls(path)

    def _start(self):
        if self._proc is not None:
            return
        # The child must import this very package (its kernels' cache entries are keyed by their
        # source files): its directory goes first on sys.path, before the working directory
        # (which may hold another copy, e.g. a source checkout beside an installed package).
        pkg = _package_dir()
        # os._exit: what it compiled is saved, and the warm-up waits for its exit, not for
        # the interpreter's teardown of Numba's and LLVM's objects (0.1-0.15 s)
        code = ("import os, sys; sys.path.insert(0, sys.argv[1]); from synapse_nb.compilation.helper import main; "
                "os._exit(main(sys.argv[2:]))")
        told = self._spec is not None
        try:
            claims = self._claims_fd()
            self._proc = subprocess.Popen([sys.executable, "-c", code, os.path.dirname(pkg), pkg, self._path,
                                           self._spec if told else "-", str(claims)],
                                          stdin=subprocess.DEVNULL if told else subprocess.PIPE,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, pass_fds=(claims,))
        except OSError:
            self._proc = False  # no helper: the warm-up compiles everything itself
            return
        self._locks = locked_cache_saves()
        self._locks.__enter__()

    def _claims_fd(self) -> int:
        """The descriptor of the claims file (created on first use; closed by wait)."""
        if self._claims is None:
            import tempfile

            self._claims = tempfile.TemporaryFile()
        return self._claims.fileno()

    def share(self, steps) -> None:
        """Compile steps ([(name, compile, runs)], forwards.warmup_steps) from the front while
        the helper compiles them from the back (the same list: its spec's), each step once: a process
        claims step i (an exclusive lock on byte i of the claims file, which both hold) before it
        compiles it and stops at the first step the other holds, which has claimed every step
        beyond it. The locks last until the process ends or wait(); the warm-up then waits for
        the helper, and its forward loads the helper's steps from the cache. While the helper
        has not started (nothing compiled: a warm cache) a step that runs its kernels (runs) is
        left to the forward, which makes that call anyway."""
        _compile_claimed(steps, self._claims_fd(), from_end=False, skip_runs=lambda: not self.started)

    @property
    def started(self) -> bool:
        """Whether the helper process was started (something compiled)."""
        return bool(self._proc)

    def start_on_first_compile(self) -> None:
        """Start the helper at this process's next Numba compile (until tell, cancel or beside's end)."""
        from ..jit import watch_compiles

        if self._watch is None and self._proc is None:
            self._watch = watch_compiles(lambda name: self._start())
            self._watch.__enter__()

    def _stop_watching(self) -> None:
        if self._watch is not None:
            watch, self._watch = self._watch, None
            watch.__exit__(None, None, None)

    def tell(self, override: dict, rest, batched: bool = False, head: bool = False) -> None:
        """The work of a Helper.ahead (as the constructor's arguments): sent to its process if it
        runs (which has compiled, or is compiling, the block loop), else kept for its start."""
        self._stop_watching()
        if self._told:
            return
        self._told = True
        self._spec = _spec(override, rest, batched, head)
        if self._proc:
            try:
                self._proc.stdin.write((self._spec + "\n").encode())
                self._proc.stdin.close()
            except OSError:  # it ended (failed, killed): the warm-up compiles what it did not write
                pass

    def cancel(self, kill: bool = False) -> None:
        """No work for a Helper.ahead (or none left to tell): its process, if it runs, ends once its
        block loop is saved, or at once with kill (a run that ends before its warm-up: Numba's
        saves are atomic, a killed helper leaves what it saved whole); waited for."""
        self._stop_watching()
        if not self._told:
            self._told = True
            if self._proc:
                try:
                    self._proc.kill() if kill else self._proc.stdin.close()
                except OSError:
                    pass
        self.wait()

    def beside(self, work) -> None:
        """Run work() with this helper started at Numba's first compile in it (if not yet), then
        wait for the helper; the cache saves of both processes locked meanwhile."""
        self.start_on_first_compile()
        try:
            work()
        finally:
            self._stop_watching()
        self.wait()

    def wait(self):
        """Wait for the helper to finish (if it started); kill it after TIMEOUT_S."""
        if self._proc:
            try:
                self._proc.wait(timeout=self.TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if self._locks is not None:  # no other process saves any more
            locks, self._locks = self._locks, None
            locks.__exit__(None, None, None)
        if self._claims is not None:  # the helper has ended (or never started)
            claims, self._claims = self._claims, None
            claims.close()  # this process's claims with it


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


def _compile_claimed(steps, fd: int, from_end: bool, skip_runs=lambda: False) -> None:
    """Run each step's compile in order (from_end: last first) while its claim (byte i of the
    file fd, locked exclusively without waiting) is this process's; stop at the first that is not.
    A claimed step that runs its kernels (its runs flag) is skipped while skip_runs()."""
    for i in (range(len(steps) - 1, -1, -1) if from_end else range(len(steps))):
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, i, os.SEEK_SET)
        except OSError:
            return  # the other process's, and every step beyond it
        _, compile_step, runs = steps[i]
        if not (runs and skip_runs()):
            compile_step()


def main(argv) -> int:
    """The helper process: argv = [the parent's synapse_nb package directory, model path, JSON
    {"override": [[decode, parallel], ...], "rest": [[decode, parallel], ...], "batched": bool,
    "head": bool}, or "-": that JSON read as a line from standard input once the block loop is
    compiled, an empty input meaning nothing more; the claims file's descriptor (Helper.share)].
    It compiles the block loop, then the warm-up's kernels from the last (forwards.warmup_steps
    of batched, head and rest), up to the first the warm-up's process has claimed
    (Helper.share). Returns 2 without compiling anything when this process imported another
    synapse_nb than the parent."""
    if _package_dir() != argv[0]:
        return 2
    _exit_with_parent()
    path, spec, claims = argv[1], argv[2], int(argv[3])
    from .. import gguf_file
    from ..model import load_model
    from .forwards import warmup_session, warmup_steps

    # This process starts at the parent's first compile, which is the header's string walk
    # (gguf_strings) when the cache is empty: walking the header's strings in Python here (about
    # 0.06 s for Qwen2.5's 300,000) spares compiling that loop a second time (0.4 s).
    gguf_file.COMPILED_STRINGS_MIN = None

    with locked_cache_saves():
        model = load_model(path)
        s = warmup_session(model, {})
        model.compile_layers(s.state, s.cache)  # first: the parent's first forward needs it too
        if spec == "-":
            spec = sys.stdin.readline()
            if not spec.strip():
                return 0
        spec = json.loads(spec)
        s.state.attn_ws.parallel_override = {bool(d): bool(p) for d, p in spec["override"]}
        rest = {(bool(d), bool(p)) for d, p in spec["rest"]}
        _compile_claimed(warmup_steps(model, s, bool(spec["batched"]), bool(spec["head"]), rest), claims, from_end=True)
    return 0
