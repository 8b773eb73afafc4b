"""The wheel a user installs: the command inside synapse_nb's namespace, models.txt as package data."""

import subprocess
import sys
import zipfile

import pytest

from conftest import ROOT


@pytest.mark.slow
def test_wheel_contents(tmp_path):
    # Build the wheel as `pip install .` does (an isolated build environment with the
    # pyproject's setuptools, from the package index or pip's cache).
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q",
                          "-w", str(tmp_path), str(ROOT)], capture_output=True, timeout=600)
    assert res.returncode == 0, res.stderr.decode()
    (whl,) = tmp_path.glob("synapse_nb-*.whl")
    with zipfile.ZipFile(whl) as z:
        names = set(z.namelist())
        models_txt = z.read("synapse_nb/models.txt").decode()
        entry_points = next(z.read(n).decode() for n in names if n.endswith("entry_points.txt"))
    assert "synapse_nb/cli/main.py" in names
    assert not any(n.startswith(("cli/", "fuzz/", "tests/")) for n in names)  # no top-level cli; no fuzzers, tests
    assert models_txt == (ROOT / "models.txt").read_text()  # the file itself, not a link
    assert "llama-decode = synapse_nb.cli.main:main" in entry_points
    assert {"synapse_nb/kernels/matmul.py", "synapse_nb/tokenizer/core.py", "synapse_nb/arch/llama.py",
            "synapse_nb/grammar/gbnf.py"} <= names
    # the server and its chat page (package data: a non-editable install serves it too)
    assert {"synapse_nb/server/app.py", "synapse_nb/cli/server.py", "synapse_nb/server/static/index.html"} <= names


def test_models_txt_found_by_the_package():
    from synapse_nb.models import MODELS_TXT, load_models_txt

    assert MODELS_TXT.read_text() == (ROOT / "models.txt").read_text()
    assert "smollm2-135m-instruct-q4_1" in load_models_txt()
