"""Shared test helpers: reference-data paths and the real models.

Import in a test module with `from conftest import DATA, TINY, real_model` (pytest
puts tests/ on sys.path).
"""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

DATA = Path(__file__).parent / "data"
TINY = DATA / "tiny"
GOLDENS = TINY / "goldens"
VOCAB = DATA / "vocab"
KERNELS = DATA / "kernels"
TOKENIZER = DATA / "tokenizer"
REAL = DATA / "real"

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


def real_model(name: str) -> Path:
    """Cached path of a real model (models.txt name); skips the test with the fetch command when absent.

    CI fetches both models first (python -m synapse_nb.models fetch all), so there
    these tests run; locally they are skipped until fetched.
    """
    from synapse_nb.models import cached_path, load_models_txt

    entry = load_models_txt()[name]
    path = cached_path(name)
    if not path.is_file() or path.stat().st_size != entry.size:
        pytest.skip(f"real model {name} not fetched ({path}); run: python -m synapse_nb.models fetch {name}")
    return path


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


ROOT = Path(__file__).parents[1]


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
