"""llama-decode end to end: exit codes, clean stdout, and agreement with llama.cpp on the real models.

The real-model cases come from tests/data/real/*.json (llama.cpp 0c1e570 through
llama-cpp-python 0.3.36); the comparison rule is "How to compare with the
reference" of shared/README.md: greedy tokens identical while the reference's
top-2 margin exceeds 2 * tol * |top-1 logit|, tol = max(2 * self_maxrel, 1e-2),
and our top-1 equals the reference's at every prompt position where that margin
is clear.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from conftest import GOLDENS, PERPLEXITY, REAL_MODELS, ROOT, TINY, one_error_line, run_cli
from conftest import real_model as real_model_path  # not fetched: fails, naming the fetch command


run = run_cli  # llama-decode in a subprocess, from the repository root


# ---------------------------------------------------------------- bad input

def test_missing_model_file(tmp_path):
    res = run(tmp_path / "nope.gguf", "hi")
    assert res.returncode == 2
    assert "nope.gguf" in one_error_line(res)
    assert res.stdout == b""


def test_not_a_gguf(tmp_path):
    bad = tmp_path / "bad.gguf"
    data = bytearray((TINY / "tiny-llama-q8_0.gguf").read_bytes())
    data[:4] = b"XXXX"
    bad.write_bytes(bytes(data))
    before = bad.read_bytes()
    res = run(bad, "hi")
    assert res.returncode == 2
    assert "bad.gguf" in one_error_line(res)
    assert bad.read_bytes() == before  # the input is never touched


def test_truncated_gguf(tmp_path):
    bad = tmp_path / "short.gguf"
    bad.write_bytes((TINY / "tiny-llama-q8_0.gguf").read_bytes()[:200_000])
    res = run(bad, "hi")
    assert res.returncode == 2
    assert "short.gguf" in one_error_line(res)


@pytest.mark.parametrize("args", [["-n", "-2"], ["-b", "0"], ["-t", "x"], ["--tokens", "1,x"],
                                  ["--logits-out", "out.txt"], ["--bogus-option"], ["-n", "abc"], ["-c", "-1"],
                                  ["--tokens", " , "], ["-f", "/nonexistent/prompt.txt"], ["--tokens", "1,,2"],
                                  ["--tokens", "\uff11"], ["-ngl", "x"], ["-l", "1+1e39"], ["-l", "\uff11+1"]])
def test_bad_options(args):
    # click's usage errors used to be three lines (Usage:, Try:, Error:); now one, exit 2
    res = run(TINY / "tiny-llama-q8_0.gguf", *args)
    assert res.returncode == 2, res.stderr.decode()
    line = one_error_line(res)
    assert line.startswith("error: ") and args[0] in line.replace("'", ""), line
    assert res.stdout == b""


def test_missing_model_argument_is_one_line():
    res = run()
    assert res.returncode == 2
    assert "MODEL" in one_error_line(res)


def test_tokens_separated_by_spaces_are_separate_ids():
    # "1 2" used to be read as the single id 12
    res = run(TINY / "tiny-llama-q8_0.gguf", "--tokens", "1 2,  3", "--tokenize")
    assert res.returncode == 0, res.stderr.decode()
    assert json.loads(res.stdout) == [1, 2, 3]


def test_invalid_utf8_prompt_file_and_stdin(tmp_path):
    # invalid bytes were silently replaced by U+FFFD; now an error naming the source and offset
    p = tmp_path / "prompt.txt"
    p.write_bytes(b"Hello \xff world")
    res = run(TINY / "tiny-llama-q8_0.gguf", "-f", p, "--tokenize")
    assert res.returncode == 2 and res.stdout == b""
    line = one_error_line(res)
    assert "prompt.txt" in line and "UTF-8" in line and "offset 6" in line, line
    res = run(TINY / "tiny-llama-q8_0.gguf", "-", "--tokenize", input=b"ab\xc3")
    assert res.returncode == 2 and "standard input" in one_error_line(res)


def test_logits_out_never_overwrites_and_fails_before_generating(tmp_path):
    model = tmp_path / "model.npy"  # a model whose name ends in .npy
    model.write_bytes((TINY / "tiny-llama-q8_0.gguf").read_bytes())
    existing = tmp_path / "existing.npy"
    existing.write_bytes(b"keep me")
    prompt = tmp_path / "p.npy"
    prompt.write_text("Hello")
    for args in ([model, "hi", "--logits-out", model], [model, "-f", prompt, "--logits-out", prompt],
                 [model, "hi", "--logits-out", existing]):
        res = run(*args, "-n", "2")
        assert res.returncode == 2, res.stderr.decode()
        assert "not overwritten" in one_error_line(res)
        assert res.stdout == b""  # refused up front, not after generating the text
    assert model.read_bytes() == (TINY / "tiny-llama-q8_0.gguf").read_bytes()
    assert existing.read_bytes() == b"keep me" and prompt.read_text() == "Hello"


@pytest.mark.parametrize("ctx", ["1000000000000", "99999999999999999999999"])
def test_huge_context_is_bad_input(ctx):
    # was "internal error: MemoryError" / "ValueError: Maximum allowed dimension exceeded", exit 1
    res = run(TINY / "tiny-llama-q8_0.gguf", "hi", "-c", ctx, "-n", "1")
    assert res.returncode == 2
    line = one_error_line(res)
    assert "KV cache" in line or "-c/--ctx-size: must be <= 2147483647" in line  # -c is int32, as llama.cpp's


def test_error_message_with_control_characters_is_one_line(tmp_path):
    res = run(tmp_path / "a\nb.gguf", "hi")
    assert res.returncode == 2
    assert "a\\nb.gguf" in one_error_line(res)


def test_context_larger_than_training_warns(tmp_path):
    res = run(TINY / "tiny-llama-q8_0.gguf", "--tokens", "1,2", "-c", "600", "-n", "1", "-t", "1")
    assert res.returncode == 0, res.stderr.decode()
    assert b"warning: n_ctx 600 > n_ctx_train 512" in res.stderr


@pytest.mark.slow
def test_llama_cpp_option_values():
    # llama.cpp's meanings: -c 0 is the model's training context, -t <= 0 every core, -m the model
    # (then the first argument is the prompt), -ngl accepted and ignored with a warning
    tiny = str(TINY / "tiny-llama-q8_0.gguf")
    res = run(tiny, "--tokens", "1,2", "-c", "0", "-n", "1", "--json")
    assert res.returncode == 0, res.stderr.decode()
    assert json.loads(res.stdout)["stop"] == "length"
    res = run(tiny, "--tokens", ",".join(["1"] * 600), "-c", "0", "-n", "1")  # 600 > n_ctx_train 512
    assert res.returncode == 2 and "n_ctx = 512" in one_error_line(res)
    for t in ("0", "-1", "100000"):  # all cores, and never more threads than that reported
        res = run(tiny, "--tokens", "1,2", "-n", "1", "-t", t, "--json")
        assert res.returncode == 0, res.stderr.decode()
        assert json.loads(res.stdout)["timings"]["n_threads"] == os.cpu_count()
    a = run(tiny, "--tokens", "1,2", "-n", "4", "-t", "1")
    b = run("-m", tiny, "--tokens", "1,2", "-n", "4", "-t", "1", "-ngl", "99")
    assert a.returncode == b.returncode == 0 and a.stdout == b.stdout
    assert b"warning: llama-decode runs on the CPU only: -ngl/--gpu-layers is ignored" in b.stderr
    c = run("-m", tiny, "hi", "-n", "2", "-t", "1")
    d = run(tiny, "hi", "-n", "2", "-t", "1")
    assert c.returncode == d.returncode == 0 and c.stdout == d.stdout
    res = run("-m", tiny, "hi", "there")
    assert res.returncode == 2 and "-m/--model" in one_error_line(res)


def test_unwritable_stdout_and_closed_streams():
    # stdout on a full device, stdout or stdin closed: one line, exit 2 (was an internal error)
    tiny = str(TINY / "tiny-llama-q8_0.gguf")
    with open("/dev/full", "wb") as full:
        for extra in ([], ["--json"], ["--tokenize"]):
            res = subprocess.run([sys.executable, "-m", "cli.main", tiny, "hi", "-n", "2", "-t", "1", *extra],
                                 stdout=full, stderr=subprocess.PIPE, timeout=300, cwd=ROOT)
            assert res.returncode == 2, res.stderr.decode()
            assert one_error_line(res) == "error: cannot write to standard output: No space left on device"
    res = subprocess.run([sys.executable, "-m", "cli.main", tiny, "hi", "-n", "2"], stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, timeout=300, cwd=ROOT,
                         preexec_fn=lambda: os.close(1))
    assert res.returncode == 2 and "standard output is closed" in one_error_line(res)
    res = subprocess.run([sys.executable, "-m", "cli.main", tiny, "-", "-n", "2"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, timeout=300, cwd=ROOT, preexec_fn=lambda: os.close(0))
    assert res.returncode == 2 and "standard input is closed" in one_error_line(res)


def test_fifo_model_is_refused_not_waited_for(tmp_path):
    fifo = tmp_path / "m.gguf"
    os.mkfifo(fifo)
    res = run(fifo, "hi", timeout=60)
    assert res.returncode == 2 and "not a regular file" in one_error_line(res)


def test_sigterm_removes_the_partial_kld_file(tmp_path):
    # SIGTERM unwinds like an error: the .kld being written under its temporary name is removed
    model = real_model_path("smollm2-135m-instruct-q4_1")
    out = tmp_path / "base.kld"
    proc = subprocess.Popen([sys.executable, "-m", "cli.main", str(model), "--perplexity", "-f",
                             str(PERPLEXITY / "GPL-3.txt"), "-c", "128", "--kl-divergence-base", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=ROOT)
    for line in proc.stderr:  # the first chunk is done: the temporary file is being written
        if b"seconds per pass" in line:
            break
    # written unnamed (O_TMPFILE), or under its temporary name where the file system has no O_TMPFILE
    assert all(p.name.startswith("base.kld.tmp") for p in tmp_path.iterdir())
    proc.send_signal(signal.SIGTERM)
    err = proc.stderr.read()
    proc.wait(timeout=120)
    assert proc.returncode == 143, err.decode()
    assert b"terminated" in err and b"Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def test_closed_stdout_is_not_a_traceback():
    # `llama-decode ... | head -c 10`: the reader is gone before we write
    proc = subprocess.Popen([sys.executable, "-m", "cli.main", str(TINY / "tiny-llama-q8_0.gguf"), "hi", "-n", "8",
                             "--ignore-eos", "-t", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            cwd=ROOT)
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=300) == 0, err.decode()
    assert b"Traceback" not in err and b"BrokenPipe" not in err


def test_token_id_out_of_vocab():
    res = run(TINY / "tiny-llama-q8_0.gguf", "--tokens", "1,512", "-n", "1")
    assert res.returncode == 2
    assert "512" in one_error_line(res)


def test_prompt_longer_than_context():
    res = run(TINY / "tiny-llama-q8_0.gguf", "--tokens", ",".join(["5"] * 20), "-c", "16", "-n", "1")
    assert res.returncode == 2
    assert "n_ctx" in one_error_line(res)


def test_help_and_version():
    res = run("--help")
    assert res.returncode == 0 and b"--prefill-check" in res.stdout
    res = run("--version")
    assert res.returncode == 0 and res.stdout.startswith(b"llama-decode ")


# ---------------------------------------------------------------- tiny fixtures

def test_prefill_check_ok_on_tiny():
    ids = ",".join(str(3 + (7 * i) % 500) for i in range(70))  # crosses the 64-token batch boundary
    res = run(TINY / "tiny-qwen2-q4_k_m.gguf", "--tokens", ids, "--prefill-check", "-t", "2", "-b", "64")
    assert res.returncode == 0, res.stderr.decode()
    assert b"OK" in res.stdout
    assert b"prefill check: 64/70 tokens compared" in res.stderr  # progress, batch by batch
    assert b"prefill check: 70/70 tokens compared" in res.stderr


def test_tokens_json_matches_golden_greedy_on_tiny(tmp_path):
    """--tokens/--json/--logits-out on a tiny fixture against llama.cpp's greedy continuation."""
    g = np.load(GOLDENS / "tiny-llama-f32.npz")
    toks = g["ids_tokens"]
    out = tmp_path / "logits.npy"
    res = run(TINY / "tiny-llama-f32.gguf", "--tokens", ",".join(map(str, toks)), "-n", "8",
              "--ignore-eos", "--json", "--logits-out", out)
    assert res.returncode == 0, res.stderr.decode()
    doc = json.loads(res.stdout)
    assert doc["prompt_tokens"] == toks.tolist()
    assert doc["tokens"] == g["ids_greedy"][:8].tolist()
    assert doc["stop"] == "length"
    logits = np.load(out)
    assert logits.shape == (len(toks) + 8 - 1, 512) and logits.dtype == np.float32
    # Row p is the logits at position p: the prompt rows match llama.cpp's, then the greedy steps.
    tol = max(2 * float(g["ids_self_maxrel"]), 1e-4)
    ref = np.concatenate([g["ids_logits_tbt"], g["ids_gen_logits"][1:8]])
    dist = np.abs(logits - ref).max(axis=1) / np.abs(ref).max(axis=1)
    assert dist.max() <= tol, dist.max()


@pytest.mark.parametrize("n_predict", ["100", "-1"])
def test_generation_stops_at_a_full_context(n_predict):
    """prompt + n_predict > n_ctx is no longer refused: as llama-completion without context shift,
    generation stops when the context is full (stop "context"); -n -1 has no token limit."""
    g = np.load(GOLDENS / "tiny-llama-f32.npz")
    toks = g["ids_tokens"]
    res = run(TINY / "tiny-llama-f32.gguf", "--tokens", ",".join(map(str, toks)), "-c", len(toks) + 6,
              "-n", n_predict, "--ignore-eos", "--json", "-t", "1")
    assert res.returncode == 0, res.stderr.decode()
    doc = json.loads(res.stdout)
    assert doc["tokens"] == g["ids_greedy"][:6].tolist()  # llama.cpp's greedy continuation
    assert doc["stop"] == "context"
    assert b"stop: context, 6 tokens generated" in res.stderr


# ---------------------------------------------------------------- real models

def _cases():
    for name, path in REAL_MODELS.items():
        for case in json.loads(path.read_text())["cases"]:
            yield pytest.param(name, case, id=f"{name}-{case['name']}")


@pytest.mark.slow
@pytest.mark.parametrize("name,case", list(_cases()))
def test_real_model_against_llama_cpp(name, case, tmp_path):
    model = real_model_path(name)
    tol = max(2 * case["self_maxrel"], 1e-2)

    # Tokenization as llama.cpp's (add_special true, parse_special as recorded).
    targs = ["--tokenize"] + ([] if case["parse_special"] else ["--no-parse-special"])
    res = run(model, case["text"], *targs)
    assert res.returncode == 0, res.stderr.decode()
    assert json.loads(res.stdout) == case["tokens"]

    out = tmp_path / "logits.npy"
    n_gen = len(case["greedy"])
    res = run(model, "--tokens", ",".join(map(str, case["tokens"])), "-n", n_gen, "--ignore-eos", "--json",
              "--logits-out", out, "-t", "2")
    assert res.returncode == 0, res.stderr.decode()
    doc = json.loads(res.stdout)
    ours = doc["tokens"]
    assert len(ours) == n_gen

    # Greedy tokens identical while the reference's margin is clear.
    for i, (top_ids, top_logits) in enumerate(zip(case["gen_top_ids"], case["gen_top_logits"])):
        margin = top_logits[0] - top_logits[1]
        if margin <= 2 * tol * abs(top_logits[0]):
            break
        assert ours[i] == case["greedy"][i], f"greedy step {i}: ours {ours[i]}, llama.cpp {case['greedy'][i]} " \
                                              f"(margin {margin:.3f})"

    # Our top-1 is the reference's at every prompt position where its margin is clear.
    logits = np.load(out)
    n_prompt = len(case["tokens"])
    for p in range(n_prompt):
        top_ids, top_logits = case["tbt_top_ids"][p], case["tbt_top_logits"][p]
        if top_logits[0] - top_logits[1] > 2 * tol * abs(top_logits[0]):
            assert int(np.argmax(logits[p])) == top_ids[0], f"prompt position {p}"


def test_streamed_text_equals_json_text():
    model = real_model_path("smollm2-135m-instruct-q4_1")
    args = [model, "The capital of France is", "-n", "24", "--ignore-eos", "-t", "2"]
    streamed = run(*args)
    assert streamed.returncode == 0, streamed.stderr.decode()
    doc = json.loads(run(*args, "--json").stdout)
    assert streamed.stdout.decode() == doc["text"] + "\n"
    err = streamed.stderr.decode()
    assert "prompt eval time" in err and "eval time" in err  # timings on stderr, not stdout


def test_prompt_from_stdin_and_file(tmp_path):
    model = real_model_path("smollm2-135m-instruct-q4_1")
    text = "Once upon a time"
    p = tmp_path / "prompt.txt"
    p.write_text(text)
    a = run(model, "-", "--tokenize", input=text.encode())
    b = run(model, "-f", p, "--tokenize")
    c = run(model, text, "--tokenize")
    assert a.returncode == b.returncode == c.returncode == 0
    assert a.stdout == b.stdout == c.stdout


def test_ctrl_c_exits_130_and_keeps_output():
    model = real_model_path("smollm2-135m-instruct-q4_1")
    proc = subprocess.Popen([sys.executable, "-m", "cli.main", str(model), "Once upon a time", "-n", "4000",
                             "-c", "4096", "--ignore-eos", "-t", "1"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=ROOT)
    first = proc.stdout.read(8)  # wait until text is streaming
    assert first
    proc.send_signal(signal.SIGINT)
    rest, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err.decode()
    assert b"Traceback" not in err


def test_compile_notice_only_when_something_compiles():
    # The first run may compile (or load) the kernels; a second run loads every kernel from
    # Numba's cache, compiles nothing, and so prints no compile notice, even with -v.
    args = (TINY / "tiny-llama-q8_0.gguf", "hi", "-n", "2", "-t", "1")
    first = run(*args)
    assert first.returncode == 0, first.stderr
    for extra in ((), ("-v",)):
        res = run(*args, *extra)
        assert res.returncode == 0, res.stderr
        assert b"compiling kernels" not in res.stderr and b"compile time" not in res.stderr, res.stderr


@pytest.mark.slow
@pytest.mark.cold_compile
def test_compile_notice_shown_when_compiling(tmp_path):
    # With an empty Numba cache (NUMBA_CACHE_DIR pointing at a fresh directory) the run compiles
    # and says so (one line at the start, one at the end, as stderr is not a terminal).
    import os

    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba-cache"))
    res = subprocess.run([sys.executable, "-m", "cli.main", TINY / "tiny-llama-f32.gguf", "hi", "-n", "1",
                          "-t", "1"], capture_output=True, timeout=900, cwd=ROOT, env=env)
    assert res.returncode == 0, res.stderr
    assert b"compiling kernels, first run only...\n" in res.stderr
    assert b"compiling kernels, first run only: done in" in res.stderr


@pytest.mark.slow
@pytest.mark.cold_compile
@pytest.mark.parametrize("args", [["hello world " * 10], ["-st", "-p", "hello world " * 4]], ids=["completion", "chat"])
def test_a_first_runs_short_prompt_is_evaluated_token_by_token(tmp_path, args):
    # With an empty cache a short prompt is evaluated one token at a time, so that the run compiles
    # the single-token forward only (compilation.warmup.prompt_n_batch); -b given keeps the batches.
    # Both give the same tokens (a sequence's bits do not depend on its batches); once a batched
    # run has compiled its kernels, a run without -b batches its prompt again. Short: here more
    # than 16 tokens (the tiny model's forward reads little: warmup.short_prompt). A single-turn
    # chat with its prompt given (-st -p) too: its warm-up then compiles its run's kernels, as a
    # completion's.
    import os

    from synapse_nb.compilation.warmup import SHORT_PROMPT

    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba-cache"))
    note = b"the prompt is evaluated token by token"

    def cli(*extra):
        res = subprocess.run([sys.executable, "-m", "cli.main", TINY / "tiny-llama-q4_0.gguf", *args,
                              "-n", "6", "-t", "2", "--json", "-v", *extra], capture_output=True, timeout=900,
                             cwd=ROOT, env=env)
        assert res.returncode == 0, res.stderr
        return json.loads(res.stdout), res.stderr

    first, err = cli()
    assert len(first["prompt_tokens"]) > SHORT_PROMPT and note in err and b"compiling kernels, first run only" in err
    batched, err = cli("-b", "512")
    assert note not in err and batched["tokens"] == first["tokens"]
    again, err = cli()
    assert note not in err and again["tokens"] == first["tokens"]


def _capped(*args, timeout=120, stdin=None):
    """The CLI under a 3 GiB address-space cap (a regression fails with MemoryError, exit 1, instead of
    taking the shared machine's memory)."""
    import resource

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))

    return subprocess.run([sys.executable, "-m", "cli.main", *map(str, args)], capture_output=True, timeout=timeout,
                          cwd=ROOT, preexec_fn=cap, stdin=stdin)


@pytest.mark.parametrize("mode", [[], ["-cnv"], ["-st"]])
def test_ctx_size_is_checked_before_the_prompt_is_read(mode, tmp_path):
    # the prompt's read bound came from -c before -c was checked: -f /dev/zero -c 80000000 read 5 GB,
    # -f FILE -c 2000000000 was "internal error: MemoryError"
    small = tmp_path / "p.txt"
    small.write_text("hi")
    for args in (["-f", "/dev/zero", "-c", "80000000"], ["-f", small, "-c", "2000000000"]):
        res = _capped(TINY / "tiny-llama-q8_0.gguf", *mode, *args, "-n", "1")
        assert res.returncode == 2, res.stderr.decode()[-500:]
        assert "the KV cache would need" in one_error_line(res)


@pytest.mark.parametrize("flag", ["-n", "-c", "-b", "-t", "--chunks", "--top-k", "--repeat-last-n", "--min-keep",
                                  "-s"])
@pytest.mark.parametrize("value", ["99999999999999999999", "9" * 5000])
def test_every_integer_option_has_a_range(flag, value):
    # --min-keep 99999999999999999999 reached a Numba kernel (internal error); every integer option is
    # now range-checked where it is parsed: one line naming it, exit 2
    res = run(TINY / "tiny-llama-q8_0.gguf", "hi", flag, value, "-n" if flag != "-n" else "-c", "1" if flag != "-n"
              else "64", "-t" if flag != "-t" else "-b", "1")
    assert res.returncode == 2, res.stderr.decode()[-300:]
    assert flag in one_error_line(res)


def test_token_list_with_a_huge_item_is_bad_input():
    # a 5000-digit item was "internal error: ValueError" (Python's int-string limit)
    for item in ["9" * 5000, "99999999999999999999"]:
        res = run(TINY / "tiny-llama-q8_0.gguf", "--tokens", f"1,{item}", "--tokenize")
        assert res.returncode == 2
        line = one_error_line(res)
        assert "--tokens" in line and "outside the vocabulary" in line and len(line) < 400


@pytest.mark.parametrize("what", ["npy", "kld"])
def test_sigkill_while_writing_leaves_no_temporary_file(tmp_path, what):
    # SIGKILL during --logits-out / --kl-divergence-base left X.npy.tmpPID.npy / X.kld.tmpPID (up to 117 MB):
    # a child writes part of each the way the CLI does, then is killed in the middle
    script = {
        "npy": "import os, signal, numpy as np\nfrom cli import main\n"
               "def save(f, a):\n    f.write(b'x' * 100000); f.flush(); os.kill(os.getpid(), signal.SIGKILL)\n"
               "np.save = save\nmain._save_npy(DEST, np.zeros((4, 4), np.float32))\n",
        "kld": "import os, signal\nfrom synapse_nb.perplexity import _NewFile\n"
               "w = _NewFile(DEST); w.write(b'x' * 100000); w._file.f.flush(); os.kill(os.getpid(), signal.SIGKILL)\n",
    }[what].replace("DEST", repr(str(tmp_path / f"x.{what}")))
    res = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, timeout=120)
    assert res.returncode == -signal.SIGKILL, res.stderr.decode()
    assert list(tmp_path.iterdir()) == []


def test_stale_temporary_files_of_dead_runs_are_removed(tmp_path):
    # where O_TMPFILE is missing, the named temporaries of killed runs are removed by the next run
    from synapse_nb.inputs import remove_stale_temps

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    stale = [tmp_path / f"x.npy.tmp{dead}.npy", tmp_path / f"x.kld.tmp{dead}"]
    alive = tmp_path / f"x.npy.tmp{os.getppid()}.npy"
    for p in stale + [alive, tmp_path / "x.npy.tmpnotapid"]:
        p.write_bytes(b"partial")
    assert sorted(remove_stale_temps(tmp_path / "x.npy") + remove_stale_temps(tmp_path / "x.kld")) == \
        sorted(map(str, stale))
    assert alive.exists() and (tmp_path / "x.npy.tmpnotapid").exists()


@pytest.mark.slow
def test_llama_completion_common_flags():
    # -no-cnv was read as -n o-cnv, -fa off as a second prompt, -ub 64 as "No such option '-u'"
    m = TINY / "tiny-llama-q8_0.gguf"
    base = ["-p", "hi", "-n", "2", "-t", "1"]
    for extra in (["-no-cnv"], ["-cnv", "-no-cnv"], ["-fa", "off"], ["--flash-attn", "auto"], ["-ub", "64"],
                  ["--ubatch-size", "8"], ["--color"], ["--no-display-prompt"], ["--no-conversation"]):
        res = run(m, *base, *extra)
        assert res.returncode == 0, (extra, res.stderr.decode())
    assert b"warning: -ub/--ubatch-size is ignored" in run(m, *base, "-ub", "64").stderr
    for extra, name in ((["-fa", "on"], "-fa/--flash-attn on"), (["-i"], "-i/--interactive"),
                        (["-ub", "0"], "-ub/--ubatch-size")):
        res = run(m, *base, *extra)
        assert res.returncode == 2 and name in one_error_line(res), extra
    shown = run(m, "-p", "hello", "-n", "2", "-t", "1", "--display-prompt", "--json").stdout
    plain = run(m, "-p", "hello", "-n", "2", "-t", "1").stdout
    assert run(m, "-p", "hello", "-n", "2", "-t", "1", "--display-prompt").stdout == b" hello" + plain
    assert json.loads(shown)["prompt_tokens"]  # --json output is unchanged by --display-prompt


def test_prompt_escapes_are_processed_as_llama_cpp_does():
    # llama.cpp's -e/--escape is on by default: \n, \t, \\, \', \" in -p are the characters
    from cli.main import process_escapes

    assert process_escapes(r"a\nb\tc\\d\'e\"f\x41\q" + "\\") == "a\nb\tc\\d'e\"fA\\q\\"
    m = TINY / "tiny-llama-q8_0.gguf"

    def ids(*args):
        res = run(m, *args, "--tokenize")
        assert res.returncode == 0, res.stderr.decode()
        return json.loads(res.stdout)

    assert ids("-p", r"a\nb") == ids("-p", "a\nb") == ids("-e", "-p", r"a\nb") == ids("--escape", "-p", r"a\nb")
    assert ids("--no-escape", "-p", r"a\nb") != ids("-p", "a\nb")
    assert ids(r"a\nb") == ids("--no-escape", "-p", r"a\nb")  # the PROMPT argument is taken as written


def test_long_prefill_progress_on_a_terminal_only(capsys):
    """Issue 35: a prompt that takes over 2 s shows "prompt: done/total tokens, R tok/s" on a terminal,
    redrawn per batch and cleared before the text; a short one and any non-terminal stderr stay silent."""
    from cli.complete import prefill_progress

    assert prefill_progress(tty=False) is None
    now = [0.0]
    p = prefill_progress(tty=True, clock=lambda: now[0])
    for done, t in ((64, 1.0), (128, 2.5), (192, 3.0), (200, 3.1)):
        now[0] = t
        p(done, 200)
    err = capsys.readouterr().err
    assert err == ("\rprompt: 128/200 tokens, 51.2 tok/s\x1b[K" "\rprompt: 192/200 tokens, 64.0 tok/s\x1b[K"
                   "\r\x1b[K"), repr(err)
    p = prefill_progress(tty=True, clock=lambda: now[0])  # done within 2 s: nothing at all
    p(64, 128)
    p(128, 128)
    assert capsys.readouterr().err == ""


@pytest.mark.slow
def test_swa_full_gives_the_same_continuation_past_the_window(tmp_path):
    """Gemma 3, a 720-token prompt past its 512-token window, 16 tokens: the default bounded
    window cache and --swa-full (llama.cpp's flag) print the same token ids and logits."""
    toks = next(c for c in json.loads(REAL_MODELS["gemma-3-270m-q4_k_m"].read_text())["cases"]
                if c["name"] == "long-swa")["tokens"]
    outs = []
    for extra in ([], ["--swa-full"]):
        out = tmp_path / f"logits{len(extra)}.npy"
        res = run(real_model_path("gemma-3-270m-q4_k_m"), "--tokens", ",".join(map(str, toks)), "-n", "16",
                  "--json", "--ignore-eos", "-c", "1024", "--logits-out", str(out), *extra)
        assert res.returncode == 0, res.stderr.decode()
        outs.append((json.loads(res.stdout)["tokens"], np.load(out)))
    assert outs[0][0] == outs[1][0] and len(outs[0][0]) == 16
    assert np.array_equal(outs[0][1].view(np.uint32), outs[1][1].view(np.uint32))
