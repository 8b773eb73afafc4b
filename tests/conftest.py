"""Shared test helpers: the one place for reference-data paths, the models (one cache for the
whole session), the missing-model policy, the markers and the CLI in a subprocess.

Import in a test module with `from conftest import DATA, TINY, shared_model, real_model` (pytest puts
tests/ on sys.path; pyproject.toml's pythonpath puts the repository root there too, for `cli`
and `fuzz`).

Markers (registered in pyproject.toml; select with -m, e.g. `python3 -m pytest -q -m "not slow"`):
  slow          30 s or more on 2 busy cores, its fixture included (a live server or browser, real
                models end to end, a wheel build, the 300-case fuzz subset, every cold_compile test)
  cold_compile  a test that compiles kernels in a fresh Numba cache (a subprocess with its own
                cache directory, or NUMBA_BOUNDSCHECK): minutes, whatever the cache holds
  threads(n)    needs n Numba threads (it compares thread counts): skipped, with the reason, where
                Numba's pool is smaller (NUMBA_NUM_THREADS, the core count)
"""

import functools
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).parents[1]
DATA = ROOT / "tests" / "data"
TINY = DATA / "tiny"
GOLDENS = TINY / "goldens"
VOCAB = DATA / "vocab"
KERNELS = DATA / "kernels"
TOKENIZER = DATA / "tokenizer"
REAL = DATA / "real"
CHAT = DATA / "chat"
GRAMMAR = DATA / "grammar"
PERPLEXITY = DATA / "perplexity"
SAMPLING = DATA / "sampling"
FUZZ = DATA / "fuzz"

TINY_GGUFS = sorted(TINY.glob("*.gguf"))
VOCAB_GGUFS = sorted(VOCAB.glob("*.gguf"))

# models.txt names of the real models, with the reference JSON of each (tests/data/real/).
REAL_MODELS = {
    "smollm2-135m-instruct-q4_1": REAL / "SmolLM2-135M-Instruct.Q4_1.json",
    "qwen2.5-coder-0.5b-instruct-q4_k_m": REAL / "qwen2.5-coder-0.5b-instruct-q4_k_m.json",
    "gemma-3-270m-q4_k_m": REAL / "gemma-3-270m-q4_k_m.json",
}


def tiny(name: str) -> Path:
    """Path of a tiny fixture by stem, e.g. tiny("tiny-llama-q4_k") -> tests/data/tiny/tiny-llama-q4_k.gguf."""
    return TINY / f"{name}.gguf"


FETCH_ALL = "python3 -m synapse_nb.models fetch all"


def real_model(name: str) -> Path:
    """Cached path of a real model (models.txt name). A model that is not fetched FAILS the test,
    naming the fetch command: the README's test command fetches every model first, so absent is
    a broken set-up, not a reason to skip."""
    from synapse_nb.models import cached_path, load_models_txt

    entry = load_models_txt()[name]
    path = cached_path(name)
    if not path.is_file() or path.stat().st_size != entry.size:
        pytest.fail(f"real model {name} is not fetched ({path}); run: {FETCH_ALL}", pytrace=False)
    return path


@functools.cache
def _load(path: Path):
    import synapse_nb

    return synapse_nb.load_model(path)


def shared_model(name):
    """The loaded Model of a tiny fixture's stem ("tiny-llama-q4_0"), a real model's models.txt name
    (failing when not fetched) or a path: loaded once per test session and shared by every test
    module (a test must not change it)."""
    if name in REAL_MODELS:
        path = real_model(name)
    else:
        path = Path(name) if isinstance(name, Path) or name.endswith(".gguf") else tiny(name)
    return _load(path.resolve())  # one key per file, however it was named


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct Q4_1, loaded once (fails when not fetched)."""
    return shared_model("smollm2-135m-instruct-q4_1")


@pytest.fixture(scope="session")
def qwen25():
    """Qwen2.5-Coder-0.5B-Instruct Q4_K_M, loaded once (fails when not fetched)."""
    return shared_model("qwen2.5-coder-0.5b-instruct-q4_k_m")


@pytest.fixture(scope="session")
def gemma3():
    """Gemma 3 270M Q4_K_M, loaded once (fails when not fetched)."""
    return shared_model("gemma-3-270m-q4_k_m")


def _need_threads(n: int) -> None:
    """Skip (with the reason) the test that compares thread counts where Numba's pool has fewer
    than n threads: there "2 threads" would run on 1, a comparison that cannot fail."""
    import numba

    if numba.config.NUMBA_NUM_THREADS < n:
        pytest.skip(f"compares thread counts: needs {n} Numba threads, this machine allows "
                    f"{numba.config.NUMBA_NUM_THREADS}")


def use_threads(n: int) -> None:
    """numba.set_num_threads(n) inside a test's loop over thread counts; where the pool has fewer
    than n threads, the rest of the test is skipped with the reason (what ran before has passed)."""
    import numba

    _need_threads(n)
    numba.set_num_threads(n)


def pytest_configure(config):
    # A suite started as a background job of a non-interactive shell (`pytest &` in a script)
    # inherits SIGINT ignored (POSIX), and so does every process it starts: Python installs no
    # KeyboardInterrupt handler in them, and the tests that press Ctrl-C in a child (test_cli,
    # test_chat) wait for an exit that never comes (seen 2026-12-05: both failed in such a run,
    # with SigIgn's SIGINT bit set in pytest's /proc status). They are about a terminal's Ctrl-C,
    # where SIGINT is not ignored: give it Python's handler back, so that the children start
    # with it at its default.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_runtest_setup(item):
    mark = item.get_closest_marker("threads")
    if mark is not None:
        _need_threads(mark.args[0])


def part_offset(reader, part: np.ndarray) -> int:
    """Byte offset in the file of one part (a numpy view) of a gguf.GGUFReader field."""
    return part.__array_interface__["data"][0] - reader.data.__array_interface__["data"][0]


def damaged_copy(src: Path, dst: Path, patches=(), size=None) -> Path:
    """Copy src to dst, overwriting bytes at each (offset, bytes) of `patches`, then cutting to `size` bytes."""
    b = bytearray(Path(src).read_bytes())
    for off, data in patches:
        b[off : off + len(data)] = data
    if size is not None:
        del b[size:]
    Path(dst).write_bytes(bytes(b))
    return Path(dst)


def run_cli(*args, input=None, timeout=600, env=None):
    """Run llama-decode (python -m cli.main, from the repository root) in a subprocess; returns the
    CompletedProcess with bytes stdout/stderr."""
    return subprocess.run([sys.executable, "-m", "cli.main", *map(str, args)], input=input, capture_output=True,
                          timeout=timeout, cwd=ROOT, env=env)


def one_error_line(res) -> str:
    """The one non-empty stderr line of a failed run (asserts there is exactly one, no traceback)."""
    err = res.stderr.decode()
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, f"expected one line on stderr, got:\n{err}"
    assert "Traceback" not in err
    return lines[0]
