"""Batch mode (synapse_nb.batch, llama-decode --batch): same tokens as one run per prompt, resumable.

The reference for every path (in-process, --workers 2 worker processes, Ray) is 8 separate
`llama-decode MODEL ... --json` runs on SmolLM2, one per prompt: batch mode must give, per id,
exactly their prompt tokens, tokens, text and stop. (That those runs agree with llama.cpp is
tests/test_cli.py's job.)
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, real_model, tiny

MODEL = "smollm2-135m-instruct-q4_1"
N_PREDICT = 8
CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"

# 8 inputs: plain text, chat prompts (some stop at <|im_end|> within 8 tokens), token ids, and
# per-line n_predict. Ids are strings and integers.
INPUTS = [
    {"id": "capital", "prompt": "The capital of France is"},
    {"id": 2, "prompt": CHAT.format("Say yes.")},
    {"id": "colors", "prompt": CHAT.format("Name three colors.")},
    {"id": 4, "prompt": "def fibonacci(n):"},
    {"id": "ids", "tokens": [1, 504, 3575, 282]},
    {"id": "short", "prompt": "Once upon a time", "n_predict": 3},
    {"id": 7, "prompt": CHAT.format("What is 2+2? Answer with a number only.")},
    {"id": "zero", "prompt": "Hello", "n_predict": 0},
]
COMPARED = ("prompt_tokens", "tokens", "text", "stop")


def cli(*args, timeout=900, **kw):
    """llama-decode in a subprocess from the repository root (bytes stdout/stderr)."""
    return subprocess.run([sys.executable, "-m", "cli.main", *map(str, args)], capture_output=True,
                          timeout=timeout, cwd=ROOT, **kw)


def model_path() -> Path:
    return real_model(MODEL)  # not fetched: fails, naming the fetch command


def write_jsonl(path: Path, objs) -> Path:
    path.write_text("".join(json.dumps(o) + "\n" for o in objs))
    return path


def read_results(path: Path) -> list[dict]:
    data = path.read_bytes()
    assert data.endswith(b"\n"), "the output must end with a complete line"
    return [json.loads(line) for line in data.decode().splitlines()]


@pytest.fixture(scope="module")
def reference():
    """id -> the --json document of one separate llama-decode run for that input."""
    model = model_path()
    ref = {}
    for obj in INPUTS:
        src = ["--tokens", ",".join(map(str, obj["tokens"]))] if "tokens" in obj else [obj["prompt"]]
        res = cli(model, *src, "-n", obj.get("n_predict", N_PREDICT), "--json", "-t", "2")
        assert res.returncode == 0, res.stderr.decode()
        ref[obj["id"]] = json.loads(res.stdout)
    # The inputs exercise both ways of stopping and n_predict 0.
    assert {d["stop"] for d in ref.values()} == {"eog", "length"}
    assert ref["zero"]["tokens"] == [] and len(ref["short"]["tokens"]) == 3
    return ref


def check_against_reference(results, reference):
    ids = [r["id"] for r in results]
    assert sorted(map(str, ids)) == sorted(str(o["id"]) for o in INPUTS), "every id exactly once"
    assert len(set(ids)) == len(ids)
    for r in results:
        assert "error" not in r, r
        assert list(r) == ["id", "prompt_tokens", "tokens", "text", "stop", "timings"]
        ref = reference[r["id"]]
        for k in COMPARED:
            assert r[k] == ref[k], f"id {r['id']!r}: {k} {r[k]!r} != separate run's {ref[k]!r}"
        # the per-prompt timing keys of --json (load and compile are per worker, not per prompt)
        assert set(r["timings"]) == set(ref["timings"]) - {"load_ms", "compile_ms"}


# ---------------------------------------------------------------- same tokens on every path

def test_batch_equals_separate_runs(reference, tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", INPUTS)
    out = tmp_path / "out.jsonl"
    res = cli(model_path(), "--batch", inp, "--output", out, "-n", N_PREDICT, "-t", "2")
    assert res.returncode == 0, res.stderr.decode()
    assert res.stdout == b""  # results go to OUT; progress and logs to stderr
    err = res.stderr.decode()
    assert "8/8 done" in err and "tokens/s" in err and "Traceback" not in err
    results = read_results(out)
    assert [r["id"] for r in results] == [o["id"] for o in INPUTS]  # one process: input order
    check_against_reference(results, reference)
    # A second run finds everything done and leaves OUT as it was.
    before = out.read_bytes()
    res = cli(model_path(), "--batch", inp, "--output", out, "-n", N_PREDICT)
    assert res.returncode == 0, res.stderr.decode()
    assert "8 already in" in res.stderr.decode() and out.read_bytes() == before


def test_two_workers_equal_separate_runs(reference, tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", INPUTS)
    out = tmp_path / "out.jsonl"
    res = cli(model_path(), "--batch", inp, "--output", out, "-n", N_PREDICT, "--workers", "2")
    assert res.returncode == 0, res.stderr.decode()
    assert "2 worker processes" in res.stderr.decode()
    results = read_results(out)
    check_against_reference(results, reference)
    assert {r["timings"]["n_threads"] for r in results} == {max(1, (os.cpu_count() or 1) // 2)}


def test_python_api_in_process(reference):
    from synapse_nb import batch, load_model

    model = load_model(MODEL)
    results = list(batch.run(model, INPUTS, n_predict=N_PREDICT, n_threads=2))
    check_against_reference(results, reference)


def test_ray_equals_separate_runs(reference, tmp_path):
    """Ray started here with ray.init(num_cpus=2): the Python API uses it, and the CLI joins it by address."""
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[ray]'); CI installs it")
    from synapse_nb import batch

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        results = list(batch.run(str(model_path()), INPUTS, ray_address="", workers=2, n_predict=N_PREDICT))
        check_against_reference(results, reference)

        address = ray.get_runtime_context().gcs_address
        inp = write_jsonl(tmp_path / "in.jsonl", INPUTS)
        out = tmp_path / "out.jsonl"
        # Half done already: the CLI on Ray skips those ids too.
        done = [r for r in results if r["id"] in ("capital", 2, "colors", 4)]
        out.write_bytes(b"".join(batch.result_line(r) for r in done))
        res = cli(model_path(), "--batch", inp, "--output", out, "-n", N_PREDICT, "--ray", address, "--workers", "2")
        assert res.returncode == 0, res.stderr.decode()
        assert res.stdout == b""
        assert f"4 already in {out}, 4 to do on Ray ({address})" in res.stderr.decode()
        check_against_reference(read_results(out), reference)
    finally:
        ray.shutdown()


def test_ray_not_installed_is_one_line_exit_2(tmp_path):
    fake = tmp_path / "fake"
    (fake / "ray").mkdir(parents=True)
    (fake / "ray" / "__init__.py").write_text("raise ImportError('No module named ray')\n")
    inp = write_jsonl(tmp_path / "in.jsonl", INPUTS[:1])
    out = tmp_path / "out.jsonl"
    res = cli(model_path(), "--batch", inp, "--output", out, "--ray",
              env={**os.environ, "PYTHONPATH": str(fake)})
    assert res.returncode == 2
    lines = res.stderr.decode().strip().splitlines()
    assert len(lines) == 1 and "pip install 'synapse_nb[ray]'" in lines[0], lines
    assert not out.exists()


# ---------------------------------------------------------------- killed and resumed

def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


@pytest.mark.parametrize("workers", [1, 2])
def test_sigkill_then_resume_gives_every_id_once(reference, tmp_path, workers):
    inp = write_jsonl(tmp_path / "in.jsonl", INPUTS)
    out = tmp_path / "out.jsonl"
    args = [sys.executable, "-m", "cli.main", str(model_path()), "--batch", str(inp), "--output", str(out),
            "-n", str(N_PREDICT), "--workers", str(workers)]
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 600
        while (not out.exists() or out.read_bytes().count(b"\n") < 3) and proc.poll() is None:
            assert time.monotonic() < deadline, "no results within 10 minutes"
            time.sleep(0.01)
        workers_pids = _children(proc.pid)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
    n_before = out.read_bytes().count(b"\n")
    assert 3 <= n_before < len(INPUTS), f"killed after {n_before} results: too late to test resuming"
    if workers > 1:  # worker processes do not outlive a killed parent
        assert len(workers_pids) >= 2
        t0 = time.monotonic()
        while any(Path(f"/proc/{p}").exists() and "zombie" not in _state(p) for p in workers_pids):
            assert time.monotonic() - t0 < 30, "workers still running after their parent was killed"
            time.sleep(0.1)
    res = subprocess.run(args, cwd=ROOT, capture_output=True, timeout=900)
    assert res.returncode == 0, res.stderr.decode()
    assert f"already in {out}" in res.stderr.decode()
    check_against_reference(read_results(out), reference)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split("\n")[0].lower()
    except (OSError, IndexError):
        return "zombie"


def test_unfinished_last_line_is_dropped_and_redone(reference, tmp_path):
    from synapse_nb.batch import result_line

    inp = write_jsonl(tmp_path / "in.jsonl", INPUTS)
    out = tmp_path / "out.jsonl"
    kept = b"".join(result_line({"id": i, **{k: reference[i][k] for k in COMPARED}, "timings": {}})
                    for i in ("capital", 2))
    partial = result_line({"id": "colors", **{k: reference["colors"][k] for k in COMPARED}, "timings": {}})
    out.write_bytes(kept + partial[:25])  # killed in the middle of writing the third line
    res = cli(model_path(), "--batch", inp, "--output", out, "-n", N_PREDICT)
    assert res.returncode == 0, res.stderr.decode()
    assert "dropped an unfinished last line (25 bytes)" in res.stderr.decode()
    data = out.read_bytes()
    assert data.startswith(kept)  # the complete lines are kept as they were
    results = read_results(out)
    assert [r["id"] for r in results[:2]] == ["capital", 2]
    for r in results:
        r["timings"] = {k: None for k in set(reference[r["id"]]["timings"]) - {"load_ms", "compile_ms"}}
    check_against_reference(results, reference)


@pytest.mark.parametrize("content", [b"not json\n", b'{"no_id": 1}\n', b'{"id": 1, "tokens": [1]}\nhello',
                                     b'{"id": 1, "prompt": "another batch input"}\n{"id": 9, "prompt": "x"}\n'])
def test_output_that_is_not_ours_is_not_touched(tmp_path, content):
    inp = write_jsonl(tmp_path / "in.jsonl", INPUTS[:1])
    out = tmp_path / "out.jsonl"
    out.write_bytes(content)
    res = cli(model_path(), "--batch", inp, "--output", out)
    assert res.returncode == 2
    lines = res.stderr.decode().strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --output") and "not modified" in lines[0], lines
    assert out.read_bytes() == content


# ---------------------------------------------------------------- bad input

def one_error_line(res) -> str:
    assert res.returncode == 2, res.stderr.decode()
    lines = [ln for ln in res.stderr.decode().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


def test_duplicate_ids_are_an_error_up_front(tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", [INPUTS[0], INPUTS[1], {"id": "capital", "prompt": "again"}])
    out = tmp_path / "out.jsonl"
    msg = one_error_line(cli(model_path(), "--batch", inp, "--output", out))
    assert 'line 3: duplicate id "capital" (first on line 1)' in msg
    assert not out.exists()


@pytest.mark.parametrize("line,what", [
    ("not json", "line 2: not JSON"),
    ('["id", 1]', "line 2: not a JSON object"),
    ('{"prompt": "no id"}', 'line 2: no "id"'),
    ('{"id": 1.5, "prompt": "x"}', '"id" must be a string or an integer'),
])
def test_unidentifiable_line_is_an_error_up_front(tmp_path, line, what):
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps(INPUTS[0]) + "\n" + line + "\n")
    out = tmp_path / "out.jsonl"
    assert what in one_error_line(cli(model_path(), "--batch", inp, "--output", out))
    assert not out.exists()


def test_bad_lines_get_an_error_field_and_the_run_goes_on(reference, tmp_path):
    import synapse_nb

    bad = [
        ({"id": "empty", "prompt": ""}, "the prompt is empty"),
        ({"id": "both", "prompt": "a", "tokens": [1]}, 'exactly one of "prompt"'),
        ({"id": "neither"}, 'exactly one of "prompt"'),
        ({"id": "typo", "prompt": "a", "n_predcit": 3}, "unknown key 'n_predcit'"),
        ({"id": "vocab", "tokens": [1, 49152]}, "id 49152 is outside the vocabulary [0, 49152)"),
        ({"id": "tokstr", "tokens": "1,2"}, '"tokens" must be a list of integer token ids'),
        ({"id": "nneg", "prompt": "a", "n_predict": -1}, '"n_predict" must be an integer >= 0'),
        ({"id": "long", "prompt": "a " * 40}, "exceeds the context size n_ctx = 32"),
        ({"id": "text", "prompt": 5}, '"prompt" must be a string'),
    ]
    if not hasattr(synapse_nb, "Sampler"):
        bad.append(({"id": "temp", "prompt": "a", "temp": 0.7}, "sampling is not supported"))
    else:  # logit biases are checked as -l checks them: a token of the vocabulary, a number
        bad += [({"id": "biasvocab", "prompt": "a", "logit_bias": [[49152, 1.0]]},
                 "logit_bias token must be in [0, 49151], got 49152"),
                ({"id": "biasstr", "prompt": "a", "logit_bias": [[1, "inf"]]}, "logit_bias bias must be a number"),
                ({"id": "tempstr", "prompt": "a", "temp": "0.5"}, "temp must be a number")]
    good = INPUTS[0]
    lines = [b[0] for b in bad[:4]] + [good] + [b[0] for b in bad[4:]]
    inp = write_jsonl(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    res = cli(model_path(), "--batch", inp, "--output", out, "-n", N_PREDICT, "-c", "32")
    assert res.returncode == 0, res.stderr.decode()
    assert f"{len(bad)} errors" in res.stderr.decode()
    results = {r["id"]: r for r in read_results(out)}
    assert len(results) == len(lines)
    for obj, msg in bad:
        r = results[obj["id"]]
        assert list(r) == ["id", "error"] and msg in r["error"], r
        assert "\n" not in r["error"]
    for k in COMPARED:
        assert results[good["id"]][k] == reference[good["id"]][k]


@pytest.mark.parametrize("extra,what", [
    (["PROMPT"], "PROMPT does not go with --batch"),
    (["--json"], "--json does not go with --batch"),
    (["--output-missing"], "needs both --batch IN.jsonl and --output OUT.jsonl"),
    (["--workers", "0"], "--workers"),
])
def test_bad_batch_options(tmp_path, extra, what):
    inp = write_jsonl(tmp_path / "in.jsonl", INPUTS[:1])
    out = tmp_path / "out.jsonl"
    args = [model_path(), "--batch", inp]
    if extra != ["--output-missing"]:
        args += ["--output", out]
    args += [a for a in extra if a not in ("PROMPT", "--output-missing")]
    if "PROMPT" in extra:
        args.insert(1, "hello")
    assert what in one_error_line(cli(*args))
    assert not out.exists()


def test_output_is_neither_the_input_nor_the_model(tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", INPUTS[:1])
    before = inp.read_bytes()
    assert "is the input file" in one_error_line(cli(model_path(), "--batch", inp, "--output", inp))
    assert inp.read_bytes() == before
    link = tmp_path / "model-link.gguf"
    link.symlink_to(model_path())
    assert "is the model file" in one_error_line(cli(model_path(), "--batch", inp, "--output", link))


@pytest.mark.parametrize("flag,path", [("--output", "/dev/full"), ("--output", "/dev/null"), ("--batch", "/dev/zero"),
                                       ("--batch", "/dev/urandom")])
def test_devices_are_not_batch_files(tmp_path, flag, path):
    # /dev/zero or /dev/full as IN or OUT was read to the end of memory (OOM); now refused up front
    inp = write_jsonl(tmp_path / "in.jsonl", INPUTS[:1])
    out = tmp_path / "out.jsonl"
    args = {"--batch": inp, "--output": out, flag: path}
    msg = one_error_line(cli(model_path(), "--batch", args["--batch"], "--output", args["--output"], timeout=120))
    assert msg == f"error: {flag} {path}: not a regular file" + (
        " (results are appended to a file and resumed from it)" if flag == "--output" else "")
    assert not out.exists()


def test_endless_input_line_is_refused(tmp_path, monkeypatch):
    from synapse_nb import SynapseError, batch

    monkeypatch.setattr(batch, "LINE_BYTES", 1000)
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps(INPUTS[0]) + "\n" + "x" * 5000)
    with pytest.raises(SynapseError, match="line 2: longer than"):
        batch.read_inputs(inp)


def test_a_full_stderr_does_not_stop_the_batch(reference, tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", INPUTS[:2])
    out = tmp_path / "out.jsonl"
    with open("/dev/full", "w") as full:
        res = subprocess.run([sys.executable, "-m", "cli.main", model_path(), "--batch", inp, "--output", out, "-n",
                              str(N_PREDICT)], stdout=subprocess.PIPE, stderr=full, timeout=900, cwd=ROOT)
    assert res.returncode == 0
    results = read_results(out)
    assert sorted(map(str, (r["id"] for r in results))) == ["2", "capital"]
    for r in results:
        for k in COMPARED:
            assert r[k] == reference[r["id"]][k]


def test_progress_plain_lines_when_not_a_terminal():
    from synapse_nb.batch import Progress

    s = io.StringIO()
    p = Progress(3, stream=s, interval=3600)
    for n in (4, 4, 4):
        p.update({"tokens": [0] * n})
    p.close()
    lines = s.getvalue().splitlines()
    assert len(lines) == 1  # within the interval: only the closing line
    assert lines[-1].startswith("batch: 3/3 done, ") and lines[-1].endswith("tokens/s, ETA 0s")
    assert "\r" not in s.getvalue() and "\x1b" not in s.getvalue()


def test_sampled_lines_equal_cli_sampling_runs(tmp_path):
    """Per-line sampling options (Sampler parameter names) give the tokens of the CLI's sampling
    flags with the same seed. Runs once synapse_nb.Sampler and the CLI's sampling flags exist."""
    import synapse_nb

    if getattr(synapse_nb, "Sampler", None) is None:
        pytest.skip("synapse_nb.Sampler is not in this build: sampling is not merged yet")
    cases = [({"temp": 0.8, "seed": 42}, ["--temp", "0.8", "--seed", "42"]),
             ({"temp": 1.0, "top_k": 10, "repeat_penalty": 1.1, "seed": 7},
              ["--temp", "1.0", "--top-k", "10", "--repeat-penalty", "1.1", "--seed", "7"]),
             ({"temp": 0.8, "seed": 7, "logit_bias": [[198, -1.5]]}, ["--temp", "0.8", "--seed", "7",
                                                                      "--logit-bias", "198-1.5"])]
    lines = [{"id": i, "prompt": "Once upon a time", **opts} for i, (opts, _) in enumerate(cases)]
    inp = write_jsonl(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    res = cli(model_path(), "--batch", inp, "--output", out, "-n", 16, "--ignore-eos", "--workers", "2")
    assert res.returncode == 0, res.stderr.decode()
    results = {r["id"]: r for r in read_results(out)}
    for i, (opts, flags) in enumerate(cases):
        ref = cli(model_path(), "Once upon a time", "-n", 16, "--ignore-eos", *flags, "--json")
        assert ref.returncode == 0, ref.stderr.decode()
        doc = json.loads(ref.stdout)
        assert results[i]["tokens"] == doc["tokens"] and results[i]["seed"] == opts["seed"], (opts, results[i])


def test_parallel_lines_equal_separate_runs(reference, tmp_path):
    """-np 8: one process decodes the lines together in one ParallelSession; every id gets the
    tokens of its separate run (results in completion order)."""
    inp = write_jsonl(tmp_path / "in.jsonl", INPUTS)
    out = tmp_path / "out.jsonl"
    res = cli(model_path(), "--batch", inp, "--output", out, "-n", N_PREDICT, "-np", "8", "-t", "2")
    assert res.returncode == 0, res.stderr.decode()
    assert "8 sequences at once" in res.stderr.decode()
    check_against_reference(read_results(out), reference)


def test_parallel_sampled_lines_equal_cli_sampling_runs(tmp_path):
    """-np 3 with per-line seeds: each line's tokens are the CLI's sampled tokens for its seed."""
    seeds = [42, 7, 1234]
    lines = [{"id": i, "prompt": "Once upon a time", "temp": 0.9, "seed": s} for i, s in enumerate(seeds)]
    inp = write_jsonl(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    res = cli(model_path(), "--batch", inp, "--output", out, "-n", 16, "--ignore-eos", "-np", "3")
    assert res.returncode == 0, res.stderr.decode()
    results = {r["id"]: r for r in read_results(out)}
    for i, s in enumerate(seeds):
        ref = cli(model_path(), "Once upon a time", "-n", 16, "--ignore-eos", "--temp", "0.9", "--seed", s, "--json")
        assert ref.returncode == 0, ref.stderr.decode()
        assert results[i]["tokens"] == json.loads(ref.stdout)["tokens"] and results[i]["seed"] == s


def test_parallel_does_not_combine_with_workers(tmp_path):
    from conftest import one_error_line

    inp = write_jsonl(tmp_path / "in.jsonl", INPUTS[:1])
    res = cli(model_path(), "--batch", inp, "--output", tmp_path / "out.jsonl", "-np", "2", "--workers", "2")
    assert res.returncode == 2 and "does not combine with --workers" in one_error_line(res)
    assert not (tmp_path / "out.jsonl").exists()


# ---------------------------------------------------------------- hostile lines (issue 34)

TINY = tiny("tiny-llama-q8_0")
DIGITS = "9" * 5000  # past Python's int-string limit (4300 digits)


def test_hostile_values_give_that_line_an_error_and_the_run_goes_on(tmp_path):
    # a 5000-digit n_predict was a ValueError out of json.loads, min_keep 1e300 or a 20-digit one a
    # Numba TypingError: each aborted the whole batch (internal error, exit 1)
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"id": "good", "tokens": [1, 2]}\n'
                   f'{{"id": "digits", "tokens": [1], "n_predict": {DIGITS}}}\n'
                   '{"id": "keepf", "tokens": [1], "min_keep": 1e300}\n'
                   '{"id": "keepi", "tokens": [1], "min_keep": 99999999999999999999}\n'
                   f'{{"id": "topk", "tokens": [1], "top_k": {DIGITS}}}\n')
    out = tmp_path / "out.jsonl"
    res = cli(TINY, "--batch", inp, "--output", out, "-n", "2", "-c", "64", "-t", "1", timeout=300)
    assert res.returncode == 0, res.stderr.decode()
    results = {r["id"]: r for r in read_results(out)}
    assert "error" not in results["good"] and len(results["good"]["tokens"]) == 2
    assert '"n_predict" must be an integer' in results["digits"]["error"]
    assert "min_keep must be in [0, 2147483647]" in results["keepf"]["error"]
    assert "min_keep must be in [0, 2147483647]" in results["keepi"]["error"]
    assert "top_k must be an integer" in results["topk"]["error"]


@pytest.mark.parametrize("line,what", [
    (f'{{"id": {DIGITS}, "tokens": [1]}}', '"id" must be a string or an integer'),
    ('{"id": "deep", "tokens": [1], "logit_bias": ' + "[" * 100000 + "]" * 100000 + "}", "nested too deeply"),
    ("[" * 100000 + "]" * 100000, "nested too deeply"),
], ids=["5000-digit-id", "deep-value", "deep-line"])
def test_line_whose_id_cannot_be_read_stops_the_run_with_one_line(tmp_path, line, what):
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"id": "good", "tokens": [1, 2]}\n' + line + "\n")
    out = tmp_path / "out.jsonl"
    assert what in one_error_line(cli(TINY, "--batch", inp, "--output", out, "-n", "2", "-c", "64", timeout=300))
    assert not out.exists()


@pytest.mark.parametrize("content", [b'{"id": 5, "name": "my data"}', b'{"id": "x", "prompt": "mine"}',
                                     b'{"id": 5}', b'{"id": 1, "text": "a", "stop": "eog"}\n{"id": 2, "nam'])
def test_a_user_file_without_its_last_newline_is_not_cut(tmp_path, content):
    # a one-line JSON file without a trailing newline was taken for a killed run's unfinished line,
    # cut off and replaced: only a prefix of one of our result lines is cut now
    inp = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "tokens": [1, 2]}])
    out = tmp_path / "out.jsonl"
    out.write_bytes(content)
    res = cli(TINY, "--batch", inp, "--output", out, "-n", "1", "-c", "64", timeout=300)
    assert "not modified" in one_error_line(res)
    assert out.read_bytes() == content


def test_a_refused_run_never_removes_the_output_another_run_holds(tmp_path, monkeypatch):
    # a run that failed to take OUT's lock unlinked OUT when OUT had not existed at its earlier check
    # and was empty now: the winner then wrote its results into a removed file
    import fcntl

    import synapse_nb.batch as batch

    inp = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "tokens": [1, 2]}])
    out = tmp_path / "out.jsonl"
    real_open = os.open
    holder = []

    def racing_open(path, flags, *a):
        if os.fspath(path) == str(out) and not holder:  # the other run creates and locks OUT first
            fd = real_open(out, os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            holder.append(fd)
        return real_open(path, flags, *a)

    monkeypatch.setattr(batch.os, "open", racing_open)
    with pytest.raises(batch.SynapseError, match="being written by another batch run"):
        batch.run_file(TINY, inp, out, n_predict=1, n_ctx=64)
    monkeypatch.undo()
    assert out.exists() and os.fstat(holder[0]).st_nlink == 1  # the holder's file is still OUT
    os.close(holder[0])


def test_progress_rate_is_tokens_over_wall_time_from_the_first_decode(monkeypatch):
    # two workers' results arriving together gave "2/2 done, 4598.3 tokens/s" for a 37 s run
    import synapse_nb.batch as batch

    clock = [100.0]
    monkeypatch.setattr(batch.time, "perf_counter", lambda: clock[0])
    s = io.StringIO()
    p = batch.Progress(2, stream=s, interval=3600)
    clock[0] = 137.0  # both lines decoded in parallel, 36 s each, done within a millisecond
    p.update({"tokens": [0] * 100, "timings": {"prompt_ms": 1000.0, "eval_ms": 35000.0}})
    clock[0] = 137.001
    p.update({"tokens": [0] * 100, "timings": {"prompt_ms": 1000.0, "eval_ms": 35000.0}})
    assert s.getvalue().strip() == "batch: 2/2 done, 5.6 tokens/s, ETA 0s"


@pytest.mark.parametrize("how", ["file", "stdin"])
def test_workers_from_a_script_without_a_main_guard(tmp_path, how):
    # the README's batch.run(..., workers=2) copied into a script crashed ("An attempt has been made to
    # start a new process before the current process has finished its bootstrapping phase"): spawned
    # workers re-ran the caller's script; they now import nothing of it
    script = ("import sys\nsys.path.insert(0, %r)\nfrom synapse_nb import batch\n"
              "res = list(batch.run(%r, [{'id': i, 'tokens': [1, 2]} for i in range(4)], workers=2, n_predict=2, "
              "n_ctx=64))\nprint(sorted(r['id'] for r in res), all('error' not in r for r in res))\n"
              % (str(ROOT), str(TINY)))
    path = tmp_path / "noguard.py"
    path.write_text(script)
    args, stdin = ([sys.executable, str(path)], None) if how == "file" else ([sys.executable, "-"], script.encode())
    res = subprocess.run(args, input=stdin, capture_output=True, timeout=300, cwd=tmp_path)
    assert res.returncode == 0, res.stderr.decode()[-1000:]
    assert res.stdout.decode().strip() == "[0, 1, 2, 3] True"


def test_local_ray_run_prints_only_our_progress(tmp_path):
    # --ray printed Ray's token-authentication WARNING and an "E core_worker" line on every run
    pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[ray]'); CI installs it")
    inp = write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "tokens": [1, 2]}, {"id": 2, "tokens": [1, 3]}])
    out = tmp_path / "out.jsonl"
    res = cli(TINY, "--batch", inp, "--output", out, "-n", "2", "-c", "64", "--ray", "--workers", "1", timeout=600)
    assert res.returncode == 0, res.stderr.decode()
    assert [r["id"] for r in sorted(read_results(out), key=lambda r: r["id"])] == [1, 2]
    assert b"WARNING" not in res.stderr and b"authentication" not in res.stderr, res.stderr.decode()
    # nor its core's "E core_worker" line about restartable actors: our progress lines only
    assert all(ln.startswith("batch: ") for ln in res.stderr.decode().splitlines() if ln.strip()), res.stderr.decode()


def test_kill_9_of_a_worker_run_leaves_no_resource_tracker_warning(tmp_path):
    # kill -9 of a --workers 2 batch left "resource_tracker: There appear to be N leaked semaphore objects"
    # (multiprocessing Queues' semaphores); the workers now talk over Pipes, which register nothing
    inp = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "tokens": [1, 2]} for i in range(400)])
    out = tmp_path / "out.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "cli.main", str(TINY), "--batch", str(inp), "--output", str(out),
                             "-n", "32", "-c", "64", "--workers", "2", "-t", "1"], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None and (not out.exists() or out.stat().st_size == 0):
        time.sleep(0.1)
    assert proc.poll() is None, "the run ended before it could be killed"
    proc.kill()
    err = proc.stderr.read()  # EOF once every process holding our stderr (tracker, workers) is gone
    proc.wait()
    assert b"leaked" not in err and b"resource_tracker" not in err, err.decode()
    results = read_results(out) if out.read_bytes().endswith(b"\n") else []
    assert all("error" not in r for r in results)
