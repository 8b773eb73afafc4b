"""Sampling as llama.cpp samples: tokens identical to llama.cpp's sampler chain.

Reference data (tests/data/sampling/, copied from shared/fixtures/sampling/, made by llama.cpp
0c1e570 through llama-cpp-python 0.3.36, g++ 12 / libstdc++):
  sampler_cases.jsonl    197 (parameters, logits rows) cases -> tokens and candidate counts
  rng_vectors.json       std::mt19937 outputs and libstdc++ uniform_real_distribution draws
  real_sampled_tbt.json  both real models, seed 42, 48 tokens, prompt on llama.cpp's
                         single-token path (which our logits equal bit for bit)
The logits rows of the tiny-model cases are those of tests/data/tiny/goldens/*.npz.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from synapse_nb import SynapseError
from synapse_nb.sampling import MT19937, Sampler, _Cands, _partial_sort_inplace, eog_logit_bias, parse_logit_bias
from synapse_nb.session import Session

from conftest import GOLDENS, ROOT, SAMPLING, TINY, one_error_line, real_model, run_cli, shared_model

CASES = [json.loads(line) for line in (SAMPLING / "sampler_cases.jsonl").read_text().splitlines() if line.strip()]
TBT = json.loads((SAMPLING / "real_sampled_tbt.json").read_text())
MODEL_NAMES = {"SmolLM2-135M-Instruct.Q4_1": "smollm2-135m-instruct-q4_1",
               "qwen2.5-coder-0.5b-instruct-q4_k_m": "qwen2.5-coder-0.5b-instruct-q4_k_m"}


run = run_cli


def _params(case):
    p = dict(case["params"])
    if "logit_bias" in p:
        p["logit_bias"] = [(t, float(b)) for t, b in p["logit_bias"]]
    return p


def _rows(case):
    if case["logits_source"] == "synthetic":
        return np.array([[float(v) for v in r] for r in case["rows"]], np.float32)
    path, key = case["logits_source"].split(":")
    return np.load(GOLDENS / Path(path).name)[key].astype(np.float32)


# ---------------------------------------------------------------- RNG

@pytest.mark.parametrize("entry", json.loads((SAMPLING / "rng_vectors.json").read_text())["seeds"],
                         ids=lambda e: str(e["seed"]))
def test_rng_vectors(entry):
    g = MT19937(entry["seed"])
    assert [g.next_u32() for _ in range(8)] == entry["raw"]
    g = MT19937(entry["seed"])
    assert [g.uniform_double() for _ in range(8)] == [float.fromhex(h) for h in entry["u_double_hex"]]
    g = MT19937(entry["seed"])
    uf = [g.uniform_float() for _ in range(8)]
    assert all(isinstance(u, np.float32) for u in uf)
    assert [float(u) for u in uf] == [float.fromhex(h) for h in entry["u_float_hex"]]


# ---------------------------------------------------------------- the chain on fixed logits

def test_cases_cover_ties():
    """The fixture's tie-order-sensitive cases are all in the parametrized test below."""
    assert len(CASES) == 197
    assert sum(c["tie_order_sensitive"] for c in CASES) == 59


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_sampler_case(case):
    s = Sampler(**_params(case))
    assert s.chain == case["chain"]
    rows = _rows(case)
    toks, ncand = [], []
    for i in range(len(case["tokens"])):
        toks.append(s.sample(rows[i]))
        ncand.append(s.last_n_candidates)
    assert toks == case["tokens"]
    assert ncand == case["n_candidates"]


@pytest.mark.parametrize("top_k,token", [(3, 5), (200, 3)])
def test_readme_tie_examples(top_k, token):
    """README: logits [1,0,0,1,0,1,0,0] at temp 0 give token 5 with top_k 3 and 3 with top_k 200
    (libstdc++'s partial_sort order among the three tied maxima), the lowest id with all off."""
    row = np.array([1, 0, 0, 1, 0, 1, 0, 0], np.float32)
    assert Sampler(temp=0.0, top_k=top_k, seed=1).sample(row) == token
    assert Sampler(temp=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=1).sample(row) == 0


def test_readme_flat40_order():
    """README: 40 equal logits after top-k 40 come out as 38, 22, 10, 34, 26, 18, ..."""
    c = _Cands(np.zeros(40, np.float32))
    _partial_sort_inplace(c, 40)
    assert c.get_ids()[:6].tolist() == [38, 22, 10, 34, 26, 18]
    assert sorted(c.get_ids().tolist()) == list(range(40))


def test_libm_is_glibc():
    """The kernels' expf/logf/powf are glibc's (ctypes), which llama.cpp calls."""
    import ctypes
    import ctypes.util

    from synapse_nb.kernels.sampling import libm_f32

    lib = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
    for name, n in (("expf", 1), ("logf", 1), ("powf", 2)):
        getattr(lib, name).restype = ctypes.c_float
        getattr(lib, name).argtypes = [ctypes.c_float] * n
    rng = np.random.default_rng(0)
    xs = np.concatenate([rng.normal(0, 8, 3000), rng.uniform(0, 1, 2000)]).astype(np.float32)
    for x in xs:
        e, lg, pw = libm_f32(x, np.float32(0.7))
        assert e == np.float32(lib.expf(float(x)))
        if x > 0:
            assert lg == np.float32(lib.logf(float(x))) and pw == np.float32(lib.powf(float(x), 0.7))


def test_penalties_window_counts_prompt():
    """accept() fills the penalty window (last penalty_last_n tokens): a token accepted once is
    penalised, one that left the window is not."""
    row = np.zeros(8, np.float32)
    row[1] = row[2] = 2.0
    s = Sampler(temp=0.0, top_k=0, top_p=1.0, min_p=0.0, penalty_last_n=2, repeat_penalty=2.0, seed=0)
    s.accept_many([1, 5, 6])  # 1 has left the 2-token window
    assert s.sample(row) == 1
    s.accept_many([1])  # window [sampled 1, 1]: token 1 penalised, 2 wins
    assert s.sample(row) == 2


# ---------------------------------------------------------------- API errors

@pytest.mark.parametrize("kw", [dict(repeat_penalty=0.0), dict(repeat_penalty=float("nan")), dict(min_keep=-1),
                                dict(penalty_last_n=-1), dict(seed=2**32), dict(dry_multiplier=0.5),
                                dict(temp="hot"), dict(logit_bias=[(1,)]), dict(top_k=1.5), dict(temp="0.5"),
                                dict(temp=1e39), dict(temp=True), dict(logit_bias=[(1, "inf")]),
                                dict(logit_bias=[(1, 1e39)]), dict(logit_bias=[(-1, 1.0)]),
                                dict(logit_bias=[(10, 1.0)], n_vocab=10)])
def test_bad_parameters(kw):
    with pytest.raises(SynapseError):
        Sampler(**kw)


def test_logit_bias_edges_accepted():
    s = Sampler(logit_bias=[(9, float("-inf")), (0, 3)], n_vocab=10)
    assert s.logit_bias == ((9, np.float32(-np.inf)), (0, np.float32(3.0)))


def test_bad_logits():
    with pytest.raises(SynapseError):
        Sampler(seed=0).sample(np.zeros((2, 3), np.float32))
    with pytest.raises(SynapseError):
        Sampler(seed=0).sample(np.zeros(0, np.float32))


def test_parse_logit_bias():
    assert parse_logit_bias("15043+1") == (15043, 1.0)
    assert parse_logit_bias("7-inf") == (7, float("-inf"))
    assert parse_logit_bias("3-0.5") == (3, -0.5)
    for bad in ("15043", "x+1", "1*2", "1+nan", "1+abc"):
        with pytest.raises(SynapseError):
            parse_logit_bias(bad)
    with pytest.raises(SynapseError):
        parse_logit_bias("600+1", n_vocab=512)


def test_random_seed_is_reported_and_reproduces():
    rng = np.random.default_rng(3)
    rows = rng.normal(0, 3, (16, 300)).astype(np.float32)
    a = Sampler(seed=-1)
    toks = [a.sample(r) for r in rows]
    assert 0 <= a.seed < 2**32
    b = Sampler(seed=a.seed)
    assert [b.sample(r) for r in rows] == toks


def test_lazy_export():
    code = ("import sys, synapse_nb; assert 'synapse_nb.sampling' not in sys.modules; "
            "assert 'numpy' not in sys.modules; S = synapse_nb.Sampler; assert S.__name__ == 'Sampler'")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True)
    assert res.returncode == 0, res.stderr.decode()


# ---------------------------------------------------------------- real models, end to end

@pytest.mark.parametrize("case", TBT["cases"], ids=[f"{c['model']}:{c['name']}" for c in TBT["cases"]])
def test_real_sampled_tbt_api(case):
    """Session.generate with a Sampler: every token, every draw u, candidate count and p as llama.cpp's."""
    m = shared_model(MODEL_NAMES[case["model"]])
    assert sorted(m.tokenizer.eog_ids) == case["eog_biased"]
    s = Sampler(**TBT["params"], seed=case["seed"], logit_bias=eog_logit_bias(m.tokenizer.eog_ids))
    assert s.chain == TBT["chain"]
    us, ncand, ps = [], [], []

    def record(tok):
        us.append(s.last_u)
        ncand.append(s.last_n_candidates)
        ps.append(s.last_p)

    sess = Session(m, n_threads=2)
    toks = sess.generate(case["prompt_tokens"], TBT["n_gen"], ignore_eos=True, on_token=record, sampler=s)
    assert toks == case["tokens"]
    assert us == case["u"]
    assert ncand == case["n_candidates"]
    assert [np.float32(p) for p in ps] == [np.float32(p) for p in case["p"]]
    assert m.tokenizer.detokenize(toks, special=False) == case["detokenized"]


@pytest.mark.parametrize("model", sorted(MODEL_NAMES))
def test_real_sampled_tbt_cli(model):
    """llama-decode MODEL --tokens ... -n 48 --ignore-eos --temp 0.8 --seed S --json: llama.cpp's tokens."""
    case = next(c for c in TBT["cases"] if c["model"] == model)
    res = run(real_model(MODEL_NAMES[model]), "--tokens", ",".join(map(str, case["prompt_tokens"])), "-n", TBT["n_gen"],
              "--ignore-eos", "--temp", "0.8", "--seed", case["seed"], "--json", "-t", "2")
    assert res.returncode == 0, res.stderr.decode()
    doc = json.loads(res.stdout)
    assert doc["tokens"] == case["tokens"]
    assert doc["seed"] == case["seed"]
    assert f"sampler seed: {case['seed']}" in res.stderr.decode()


# ---------------------------------------------------------------- greedy unchanged, CLI errors

def test_greedy_default_unchanged():
    """Without sampling flags (CLI) or sampler (API) decoding is the greedy argmax: llama.cpp's
    greedy tokens on a tiny model, no seed in the JSON."""
    g = np.load(GOLDENS / "tiny-llama-f32.npz")
    toks = g["ids_tokens"].tolist()
    res = run(TINY / "tiny-llama-f32.gguf", "--tokens", ",".join(map(str, toks)), "-n", "16", "--ignore-eos",
              "--json", "-t", "1")
    assert res.returncode == 0, res.stderr.decode()
    doc = json.loads(res.stdout)
    assert doc["tokens"] == g["ids_greedy"][:16].tolist()
    assert "seed" not in doc and "sampler seed" not in res.stderr.decode()
    m = shared_model("tiny-llama-f32")
    assert Session(m, n_threads=1).generate(toks, 16, ignore_eos=True) == g["ids_greedy"][:16].tolist()


def test_cli_random_seed_printed():
    res = run(TINY / "tiny-llama-f32.gguf", "--tokens", "1,2,3", "-n", "4", "--temp", "0.9", "--json", "-t", "1")
    assert res.returncode == 0, res.stderr.decode()
    doc = json.loads(res.stdout)
    assert f"sampler seed: {doc['seed']}" in res.stderr.decode()
    again = run(TINY / "tiny-llama-f32.gguf", "--tokens", "1,2,3", "-n", "4", "--temp", "0.9", "--json", "-t", "1",
                "-s", doc["seed"])
    assert json.loads(again.stdout)["tokens"] == doc["tokens"]


@pytest.mark.parametrize("args,needle", [
    (["--top-k", "abc"], "--top-k"),
    (["--temp", "x"], "--temp"),
    (["--repeat-penalty", "0"], "--repeat-penalty"),
    (["--min-keep", "-1"], "--min-keep"),
    (["--repeat-last-n", "-1"], "--repeat-last-n"),
    (["--seed", "-2"], "--seed"),
    (["--logit-bias", "5x3"], "--logit-bias"),
    (["--logit-bias", "99999+1"], "--logit-bias"),
    (["--mirostat", "2"], "--mirostat"),
    (["--mirostat-lr", "0.1"], "--mirostat-lr"),
    (["--dry-multiplier", "0.8"], "--dry-multiplier"),
    (["--dry-sequence-breaker", "x"], "--dry-sequence-breaker"),
])
def test_cli_bad_sampling_flags(args, needle):
    res = run(TINY / "tiny-llama-f32.gguf", "--tokens", "1,2,3", "-n", "2", *args)
    assert res.returncode == 2
    line = one_error_line(res)
    assert line.startswith("error:") and needle in line, line
    assert res.stdout == b""
