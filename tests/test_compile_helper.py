"""synapse_nb.compilation.helper: a cold warm-up's second compiling process, and its cache-save lock."""

import json
import os
import subprocess
import sys
import threading
import time

import pytest

from conftest import ROOT, tiny
from synapse_nb.compilation import helper as compile_helper

TINY = tiny("tiny-llama-q4_0")

_WARMUP = r"""
import json, sys
sys.path.insert(0, sys.argv[2])  # this checkout's package, whatever the working directory holds
from synapse_nb.jit import watch_compiles
from synapse_nb.model import load_model
from synapse_nb.compilation.warmup import warmup
from synapse_nb.session import Session
from synapse_nb.compilation import helper
helpers = []
class Recorded(helper.Helper):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        helpers.append(self)
helper.Helper = Recorded
import os, subprocess
_Popen = subprocess.Popen
def _traced(args, **kw):  # the helper process records its compiles (names, a line each) in HELPER_LOG
    args = list(args)
    args[2] = args[2].replace("from synapse_nb.compilation.helper import main;",
                              "from synapse_nb.jit import watch_compiles as _w; _f = open(os.environ['HELPER_LOG'], 'a', "
                              "buffering=1); _c = _w(lambda n: _f.write(n + chr(10))); _c.__enter__(); "
                              "from synapse_nb.compilation.helper import main;")
    return _Popen(args, **kw)
subprocess.Popen = _traced
m = load_model(sys.argv[1])
head_rows = []  # rows of each output-head call of the warm-up
head = type(m)._head
m._head = lambda st, x: (head_rows.append(len(x)), head(m, st, x))[1]
names = []
n_prompt = int(sys.argv[4])
ahead = None
if sys.argv[5] == "ahead":  # as a completion: the helper started at the vocabulary's first compile
    ahead = helper.Helper.ahead(sys.argv[1])
    ahead.start_on_first_compile()
with watch_compiles(names.append):
    if ahead is not None:
        m.tokenizer.tokenize("Hello", add_special=True, parse_special=False)
        started_ahead = ahead.started
    warmup(m, n_prompt=n_prompt, n_predict=int(sys.argv[3]), n_ctx=64, jobs=2, ahead=ahead)
del m._head
s = Session(m, n_ctx=64, n_threads=2)
print(json.dumps({"compiled": names, "tokens": s.generate([1, 2, 3, 4, 5][:n_prompt], 4, ignore_eos=True),
                  "helpers": [[json.loads(h._spec)["batched"], h.started] for h in helpers],
                  "head_rows": head_rows, "started_ahead": ahead is not None and started_ahead}))
"""

# The block loop and its helpers (kernels/graph.py), which the helper compiles first
_LOOP = ("layers", "_matvecs", "_matmul", "_add_rows", "_head_norms", "_scale_rows", "_scale_all", "_add_rows_2d")


def _run(cache, cwd=ROOT, n_predict=4, n_prompt=5, ahead=False):
    log = cache.parent / (cache.name + ".helper.log")
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache), HELPER_LOG=str(log))
    r = subprocess.run([sys.executable, "-c", _WARMUP, str(TINY), str(ROOT), str(n_predict), str(n_prompt),
                        "ahead" if ahead else "-"], cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    out["helper_compiled"] = log.read_text().split() if log.exists() else []
    log.unlink(missing_ok=True)
    return out


def _shared(first, first_step):
    """The two processes of a cold warm-up shared the kernels of forwards.warmup_steps: the
    warm-up's process compiled the first step's kernel (first_step) and the helper did not; the
    helper compiled steps of its own (from the list's end: the output head's conversion first)
    beside the block loop."""
    ours, theirs = first["compiled"], first["helper_compiled"]
    assert first_step in ours and first_step not in theirs, (ours, theirs)
    assert [n for n in theirs if n not in _LOOP and n.startswith(("_act", "_mv_", "_mm_", "_deq_"))], theirs


@pytest.mark.slow
@pytest.mark.cold_compile
@pytest.mark.skipif(not compile_helper.available(), reason="no POSIX file locks")
@pytest.mark.parametrize("other_copy_in_cwd", [False, True])
def test_cold_warmup_shares_the_kernels_with_the_helper(tmp_path, other_copy_in_cwd):
    """With an empty cache the warm-up's process compiles the warm-up's kernels from the batched
    forward's first while the helper compiles them from the single-token forward's last (the
    output head's), each once; the warm-up's process does not compile the block loop. A second
    process then compiles nothing, and both decode the same tokens. Also from a working
    directory holding another copy of the package (a source checkout beside an installed one):
    the helper must import the parent's, or its cache entries are another's."""
    import shutil

    cwd = ROOT
    if other_copy_in_cwd:
        cwd = tmp_path / "elsewhere"
        shutil.copytree(ROOT / "synapse_nb", cwd / "synapse_nb", ignore=shutil.ignore_patterns("__pycache__"))
    tmp_path = tmp_path / "cache"
    first = _run(tmp_path, cwd)
    _shared(first, "_rope_par")
    assert "layers" not in first["compiled"] and "layers" in first["helper_compiled"]
    # The output head ran on one row only: a run reads its last row's logits, so the head's batch
    # matmul (2.7 s of SmolLM2's first run, with its conversion) is not the warm-up's to compile
    assert first["head_rows"] and set(first["head_rows"]) == {1}, first["head_rows"]
    # The second process loads the block loop (kernels/graph.py, compiled by either process of
    # the first) from the cache, and calls the kernels at its own addresses (native.call_at)
    second = _run(tmp_path, cwd)
    assert second["compiled"] == [] and second["tokens"] == first["tokens"]


@pytest.mark.slow
@pytest.mark.cold_compile
@pytest.mark.skipif(not compile_helper.available(), reason="no POSIX file locks")
def test_cold_warmup_of_a_one_token_generation_uses_the_helper(tmp_path):
    """-n 1 after a 5-token prompt: no single-token step, but the batched forward's last row
    calls the one-row kernels; with an empty cache those come from the helper too (they were
    compiled one after the other in one process: Gemma 3's first -n 1 run took 45 s, now 26 s)."""
    first = _run(tmp_path, n_predict=1)
    _shared(first, "_rope_par")
    assert first["helpers"] == [[True, True]]
    second = _run(tmp_path, n_predict=1)
    assert second["compiled"] == [] and second["tokens"] == first["tokens"]
    assert second["helpers"] == []  # a warm cache: no helper, the warm-up is the run's one forward


@pytest.mark.slow
@pytest.mark.cold_compile
@pytest.mark.skipif(not compile_helper.available(), reason="no POSIX file locks")
def test_cold_warmup_of_a_one_token_prompt_shares_the_single_token_kernels(tmp_path):
    """A one-token prompt has no batched forward: the helper compiles the block loop (and the
    other attention kinds), and the single-token forward's kernels from the last while the
    warm-up's process compiles them from the first (it had compiled them all alone: SmolLM2's
    first 'Hello' -n 1 compiled for 8.6 s, now 5.2 s). The cache then serves a second process
    everything."""
    first = _run(tmp_path, n_prompt=1)
    assert first["helpers"] == [[False, True]]  # a share of the single-token forward's list only
    _shared(first, "_rope_ser")
    assert not any(n.startswith("_mm_") for n in first["compiled"] + first["helper_compiled"])
    second = _run(tmp_path, n_prompt=1)
    assert second["compiled"] == [] and second["tokens"] == first["tokens"]
    assert second["helpers"] == [[False, False]]


@pytest.mark.slow
@pytest.mark.cold_compile
@pytest.mark.skipif(not compile_helper.available(), reason="no POSIX file locks")
@pytest.mark.parametrize("n_prompt", [5, 1])
def test_cold_helper_started_ahead_at_the_vocabulary_compile(tmp_path, n_prompt):
    """A completion's helper (engine.compiling_ahead) starts at the first compile of the
    tokenizer, before the warm-up knows the run: it compiles the block loop meanwhile, then its
    share of the kernels the warm-up tells it (from the list's end, while the warm-up's process
    compiles from its first). The warm-up's process does not compile the loop, and a second
    process compiles nothing and decodes the same tokens."""
    first = _run(tmp_path, n_prompt=n_prompt, ahead=True)
    assert first["started_ahead"]
    assert first["helpers"] == [[n_prompt > 1, True]]
    assert "layers" not in first["compiled"], first["compiled"]
    _shared(first, "_rope_par" if n_prompt > 1 else "_rope_ser")
    second = _run(tmp_path, n_prompt=n_prompt, ahead=True)
    assert second["compiled"] == [] and second["tokens"] == first["tokens"]
    assert not second["started_ahead"] and second["helpers"] == [[n_prompt > 1, False]]


@pytest.mark.skipif(not compile_helper.available(), reason="no POSIX file locks")
def test_a_helper_ahead_the_run_does_not_take_is_killed(tmp_path):
    """A run that ends before its warm-up (an error, --tokenize) kills the helper it started
    ahead; a helper told nothing more (cancel) ends on its own; neither is left running."""
    from synapse_nb.engine import compiling_ahead

    with compiling_ahead(TINY, 2) as ahead:
        if ahead is None:
            pytest.skip("one Numba thread: no helper")
        ahead._start()
        proc = ahead._proc
    assert proc.returncode is not None
    assert _saves_unlocked()
    ahead = compile_helper.Helper.ahead(TINY)
    ahead._start()
    ahead.cancel()
    assert ahead._proc.returncode == 0


def _saves_unlocked():
    """Numba's own cache save is back (the helper's lock released once it was waited for)."""
    from numba.core.caching import IndexDataCacheFile

    return "locked" not in IndexDataCacheFile.save.__name__


@pytest.mark.skipif(not compile_helper.available(), reason="no POSIX file locks")
def test_cache_saves_wait_for_the_directory_lock(tmp_path):
    """Within locked_cache_saves, a Numba cache save waits while another holder (here this test,
    as the other process would) has the cache directory's lock, then completes."""
    import fcntl

    from numba.core.caching import IndexDataCacheFile

    f = IndexDataCacheFile(str(tmp_path), "fn", "stamp")
    fd = os.open(tmp_path, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    done = []
    with compile_helper.locked_cache_saves():
        t = threading.Thread(target=lambda: (f.save("key", b"data"), done.append(1)))
        t.start()
        time.sleep(0.3)
        assert not done  # blocked on the lock
        os.close(fd)  # release
        t.join(10)
    assert done and f.load("key") == b"data"
    assert IndexDataCacheFile.save is not None and "locked" not in IndexDataCacheFile.save.__name__  # restored
