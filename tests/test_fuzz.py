"""Malformed files and inputs are rejected cleanly (issue 18).

- A fixed 300-case subset of fuzz/gguf.py (seed 1): no outcome other than OK or a clean
  SynapseError (no other exception, signal, hang or memory error).
- Every file a fuzz run flagged, kept in tests/data/fuzz/ (mutations of micro-llama-f16.gguf, the
  regression base): through the CLI, exit 2, exactly one stderr line "error: ...", no traceback,
  naming the file and the key; the message each one must give is in tests/data/fuzz/expected.json.
- The typed GGUF accessor (gguf_file.Metadata): wrong types name file, key, expected and found
  type; llama.cpp's leniency (per-layer arrays) is kept.
- Prompts from a file or stdin are bounded; --logits-out is checked before any work; NaN weights
  give NaN logits and one warning line.
"""

import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import FUZZ, GRAMMAR, ROOT, tiny
from fuzz import gguf as fz
from fuzz.harness import LIMIT_RSS_MB, LIMIT_S

from synapse_nb.errors import SynapseError
from synapse_nb.gguf_file import Metadata, open_gguf
from synapse_nb.hparams import HParams
from synapse_nb.tokenizer import load_tokenizer

MICRO = FUZZ / "micro-llama-f16.gguf"
MICRO_BPE = FUZZ / "micro-bpe-f16.gguf"
# file -> {"mutation": what was done to the micro base, "base_defect": how main at c38829a failed on it,
#          "any_of": the messages it must give now (derived from the mutation: the key whose type changed)}
EXPECTED = json.loads((FUZZ / "expected.json").read_text())
REGRESSIONS = sorted(p for p in FUZZ.glob("*.gguf") if p not in (MICRO, MICRO_BPE))


def cli(*args, input=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "cli.main", *map(str, args)], cwd=ROOT, capture_output=True,
                          input=input, timeout=timeout)


def assert_one_error_line(res, *words):
    err = res.stderr.decode("utf-8", "replace")
    lines = err.splitlines()
    assert res.returncode == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


def micro_with(tmp_path, name="case.gguf", **changes) -> Path:
    """micro-llama-f16.gguf with keys replaced: key=(GGUF type, raw value bytes)."""
    buf = MICRO.read_bytes()
    lay = fz.parse_layout(buf)
    kvs = lay.kvs
    for key, (vt, raw) in changes.items():
        lay.kvs = kvs
        kvs = fz.replace_kv(lay, key.encode(), vt, raw)
    out = tmp_path / name
    out.write_bytes(fz.build(lay, buf, kvs))
    return out


# ---------------------------------------------------------------- the fuzz campaign subset

@pytest.mark.slow
def test_fuzz_subset_300_cases_only_ok_or_clean():
    res = subprocess.run([sys.executable, "-m", "fuzz.gguf", "--n", "300", "--seed", "1", "--jobs", "2", "--json"],
                         cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert res.returncode == 0, res.stderr[-2000:]
    s = json.loads(res.stdout.splitlines()[-1])
    c = s["counts"]
    assert sum(c.values()) == 300
    assert c["exception"] == c["signal"] == c["timeout"] == c["memory"] == 0, s["flagged"]
    # every case measured, within issue 34's limits for a bad input
    assert 0 < s["max_rss_mb"] <= LIMIT_RSS_MB and 0 < s["max_s"] <= LIMIT_S and s["over_limits"] == 0, s["flagged"]
    # both outcomes occur: the mutations are neither all harmless nor all fatal
    assert c["ok"] >= 30 and c["clean"] >= 100, c


def test_fuzz_cases_are_reproducible():
    a, b = fz.CaseMaker(1), fz.CaseMaker(1)
    for k in (0, 7, 123):
        assert a.make(k) == b.make(k)
    assert fz.CaseMaker(2).make(7) != a.make(7)


# ---------------------------------------------------------------- regression files

@pytest.mark.parametrize("base", [MICRO, MICRO_BPE], ids=lambda p: p.name)
def test_regression_bases_run(base):
    # the regression files fail because of their mutation, not their base
    assert base.stat().st_size < 100_000
    res = cli(base, "hi", "-n", "2", "-c", "64", "-t", "1")
    assert res.returncode == 0, res.stderr.decode()


def test_every_regression_file_is_listed():
    assert REGRESSIONS, "no regression files"
    assert {p.name for p in REGRESSIONS} == set(EXPECTED)
    assert all(p.stat().st_size <= 100_000 for p in REGRESSIONS)


def test_regressions_through_the_cli_in_process():
    # All files through the CLI's entry point, in fuzz workers (one Python start-up for all).
    res = subprocess.run([sys.executable, "-m", "fuzz.gguf", "--jobs", "2", "--json", "--files", *map(str, REGRESSIONS)],
                         cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.splitlines()[-1])
    for x in out["results"]:
        name = Path(x["file"]).name
        assert x["cls"] == "clean", x
        assert x["detail"].startswith("error: ") and name in x["detail"], x
        assert any(w in x["detail"] for w in EXPECTED[name]["any_of"]), x


def test_regressions_through_the_tokenizer_alone():
    # the tokenizer-only path (load_tokenizer, as for vocabulary files): reads general.architecture,
    # general.name and every tokenizer key itself
    for path in REGRESSIONS:
        try:
            load_tokenizer(path).tokenize("hi", add_special=True, parse_special=True)
        except SynapseError as e:
            assert str(path) in str(e) and "\n" not in str(e), str(e)


@pytest.mark.parametrize("path", REGRESSIONS[:: max(1, len(REGRESSIONS) // 6)], ids=lambda p: p.name)
def test_regression_sample_as_a_subprocess(path):
    line = assert_one_error_line(cli(path, "hi", "-n", "2", "-c", "64", "-t", "1"), str(path))
    assert any(w in line for w in EXPECTED[path.name]["any_of"]), line


# ---------------------------------------------------------------- the typed accessor

S, U32, F32, ARR, BOOL, I32 = fz.STRING, fz.UINT32, fz.FLOAT32, fz.ARRAY, fz.BOOL, fz.INT32


@pytest.mark.parametrize("key, value, words", [
    ("general.name", (U32, fz.enc_scalar(U32, 7)), "key general.name has wrong type UINT32 but expected type STRING"),
    ("general.architecture", (ARR, fz.enc_array(S, ["llama"])),
     "key general.architecture has wrong type ARRAY of STRING but expected type STRING"),
    ("llama.block_count", (F32, fz.enc_scalar(F32, 1.0)), "key llama.block_count has wrong type FLOAT32"),
    ("llama.attention.layer_norm_rms_epsilon", (fz.FLOAT64, fz.enc_scalar(fz.FLOAT64, 1e-5)),
     "has wrong type FLOAT64 but expected type FLOAT32"),
    ("llama.attention.head_count_kv", (ARR, fz.enc_array(I32, [2, 2, 2])),
     "key llama.attention.head_count_kv has wrong array length; expected 1, got 3"),
    ("llama.attention.head_count", (ARR, fz.enc_array(F32, [4.0])),
     "has wrong type ARRAY of FLOAT32 but expected type ARRAY of INT32 or ARRAY of UINT32 or ARRAY of BOOL"),
])
def test_hparams_key_of_wrong_type(tmp_path, key, value, words):
    path = micro_with(tmp_path, **{key: value})
    with pytest.raises(SynapseError) as e:
        HParams.from_gguf(open_gguf(path))
    assert str(path) in str(e.value) and words in str(e.value), str(e.value)


def test_per_layer_array_accepted_as_llama_cpp_does(tmp_path):
    # llama_model_loader::get_key_or_arr: an n_layer array of INT32 / UINT32 is a per-layer value
    for et in (I32, U32):
        path = micro_with(tmp_path, f"pl{et}.gguf", **{"llama.attention.head_count_kv": (ARR, fz.enc_array(et, [2])),
                                                      "llama.feed_forward_length": (ARR, fz.enc_array(et, [64]))})
        hp = HParams.from_gguf(open_gguf(path))
        assert (hp.n_head_kv, hp.n_ff) == (2, 64)


@pytest.mark.parametrize("key, value, words", [
    ("tokenizer.ggml.bos_token_id", (F32, fz.enc_scalar(F32, float("nan"))),
     "key tokenizer.ggml.bos_token_id has wrong type FLOAT32 but expected type UINT32"),
    ("tokenizer.ggml.eos_token_id", (F32, fz.enc_scalar(F32, float("inf"))), "wrong type FLOAT32"),
    ("tokenizer.ggml.tokens", (S, fz.enc_str("a")), "tokenizer.ggml.tokens has wrong type STRING but expected "
                                                    "type ARRAY of STRING"),
    ("tokenizer.ggml.scores", (F32, fz.enc_scalar(F32, 0.0)), "tokenizer.ggml.scores has wrong type FLOAT32"),
    ("tokenizer.ggml.scores", (ARR, fz.enc_array(F32, [0.0] * 3)), "tokenizer.ggml.scores has 3 elements, expected "
                                                                  "at least 512"),
    ("tokenizer.ggml.model", (ARR, fz.enc_array(S, ["llama"])), "tokenizer.ggml.model has wrong type ARRAY"),
    ("tokenizer.ggml.pre", (U32, fz.enc_scalar(U32, 1)), "tokenizer.ggml.pre has wrong type UINT32"),
    ("tokenizer.ggml.add_bos_token", (ARR, fz.enc_array(BOOL, [1])), "add_bos_token has wrong type ARRAY of BOOL "
                                                                     "but expected type BOOL"),
    ("general.architecture", (U32, fz.enc_scalar(U32, 3)), "general.architecture has wrong type UINT32"),
])
def test_tokenizer_key_of_wrong_type(tmp_path, key, value, words):
    path = micro_with(tmp_path, **{key: value})
    with pytest.raises(SynapseError) as e:
        load_tokenizer(path)
    assert str(path) in str(e.value) and words in str(e.value), str(e.value)


def test_metadata_of_a_plain_dict():
    m = Metadata.from_values({"a": 3, "b": "x", "c": [1.5], "d": ["p", "q"], "e": True}, "here: ")
    assert m.get("a", fz_type("UINT32")) == 3 and m.get("b", fz_type("STRING")) == "x"
    assert m.get_array("d", fz_type("STRING"), length=2) == ["p", "q"]
    assert m.get("zz", fz_type("STRING"), "dflt") == "dflt"
    with pytest.raises(SynapseError, match="here: key e has wrong type BOOL but expected type UINT32"):
        m.get("e", fz_type("UINT32"))
    with pytest.raises(SynapseError, match="here: missing required key zz"):
        m.get("zz", fz_type("UINT32"))


def fz_type(name):
    from gguf import GGUFValueType

    return GGUFValueType[name]


# ---------------------------------------------------------------- CLI inputs and outputs

def test_prompt_from_dev_zero_is_refused_at_once():
    # Reading all of /dev/zero never ends (the old CLI ran out of memory): the subprocess timeout
    # would fail this test. The bounded read itself is timed below.
    res = cli(MICRO, "-f", "/dev/zero", "-n", "2", "-c", "64", timeout=120)
    assert_one_error_line(res, "-f/--file /dev/zero", "longer than 4096 bytes", "n_ctx = 64")


def test_bounded_read_takes_well_under_a_second():
    from synapse_nb.inputs import prompt_byte_limit, read_bounded

    tok = load_tokenizer(MICRO)
    limit = prompt_byte_limit(tok, 131072)  # a 128k context: 8 MiB
    assert limit == 131072 * 64
    t0 = time.perf_counter()
    with open("/dev/zero", "rb") as f, pytest.raises(SynapseError, match="longer than 8388608 bytes"):
        read_bounded(f, limit, "-f/--file /dev/zero", 131072)
    assert time.perf_counter() - t0 < 1.0


def test_prompt_from_stdin_past_the_bound():
    res = cli(MICRO, "-", "-n", "2", "-c", "64", input=b"a" * 4097)
    assert_one_error_line(res, "standard input", "longer than 4096 bytes")
    ok = cli(MICRO, "-", "-n", "1", "-c", "4096", input=b"a " * 1000)  # 2000 bytes: within the bound
    assert ok.returncode == 0, ok.stderr.decode()


def test_logits_out_unwritable_directory_fails_before_loading(tmp_path):
    if os.geteuid() == 0:  # root writes anywhere that is writable at all
        dest = "/proc/llama-decode-test.npy"
    else:
        d = tmp_path / "ro"
        d.mkdir()
        d.chmod(0o555)
        dest = str(d / "x.npy")
    res = cli(MICRO, "hi", "-n", "2", "--logits-out", dest)
    assert_one_error_line(res, "--logits-out", "cannot write in")
    assert res.stdout == b""  # checked before the model is loaded: nothing was generated


def test_nan_weights_give_nan_logits_and_one_warning(tmp_path):
    buf = bytearray(MICRO.read_bytes())
    lay = fz.parse_layout(bytes(buf))
    t = next(t for t in lay.tensors if t.name == b"output_norm.weight")  # F32: NaN reaches every logit
    off = lay.data_offset + t.offset
    buf[off:off + 4] = struct.pack("<f", float("nan"))
    path = tmp_path / "nan.gguf"
    path.write_bytes(bytes(buf))
    out = tmp_path / "logits.npy"
    res = cli(path, "hi", "-n", "2", "-c", "64", "-t", "1", "--logits-out", out)
    assert res.returncode == 0, res.stderr.decode()
    warn = [ln for ln in res.stderr.decode().splitlines() if "not finite" in ln]
    assert len(warn) == 1 and warn[0].startswith("warning: "), res.stderr.decode()
    logits = np.load(out)
    assert np.isnan(logits).all()


# ---------------------------------------------------------------- grammars and JSON schemas (issue 32)



class _Pieces:
    """A small vocabulary for the grammar matcher: ASCII, a few multi-byte and partial pieces, EOG last."""

    def __init__(self):
        pieces = [bytes([c]) for c in range(32, 127)] + [b"\n", b"\t", b"ab", b"{\"", b"\": ", b"12", "é".encode(),
                                                         b"\xc3", b"\xa9", b"\xe3\x81", b"\x81", b"\x00x", b""]
        self._p = pieces + [b"</s>"]
        self.n_vocab = len(self._p)
        self.eog_ids = frozenset({self.n_vocab - 1})

    def token_to_piece(self, t, special=True):
        return self._p[t]


def _mutate_text(rng, text: str) -> str:
    b = bytearray(text.encode())
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(4)
        i = rng.randrange(len(b) + 1)
        if op == 0 and b:
            del b[min(i, len(b) - 1)]
        elif op == 1:
            b[i:i] = bytes([rng.choice(b'()[]{}*+?|"\\-^.#:=, \n0123456789az')])
        elif op == 2 and b:
            j = rng.randrange(len(b))
            b[j] = rng.randrange(1, 256)
        else:
            k = rng.randrange(len(b) + 1)
            b[i:i] = b[k:k + rng.randint(1, 8)]
    return b.decode("utf-8", "replace")


def test_grammar_fuzz_only_ok_or_clean():
    """Mutated llama.cpp grammars: parsed and matched (mask, accepts) or refused with a one-line
    SynapseError; nothing else, each case well under a second."""
    import random

    from synapse_nb.grammar import Grammar, GrammarMatcher

    rng = random.Random(1)
    bases = [p.read_text() for p in sorted(GRAMMAR.glob("*.gbnf"))] + ['root ::= " " ("yes" | "no") "."']
    vocab = _Pieces()
    outcomes = {"ok": 0, "refused": 0}
    for _ in range(300):
        text = _mutate_text(rng, rng.choice(bases))
        t0 = time.perf_counter()
        try:
            m = GrammarMatcher(Grammar(text), vocab)
            for _ in range(4):
                allowed = np.flatnonzero(m.allowed_mask())
                assert all(m.allows(int(t)) for t in allowed)
                if allowed.size == 0 or vocab.n_vocab - 1 in allowed:
                    break
                m.accept(int(rng.choice(allowed)))
            outcomes["ok"] += 1
        except SynapseError as e:
            assert "\n" not in str(e) and str(e).startswith("grammar: ")
            outcomes["refused"] += 1
        assert time.perf_counter() - t0 < 2.0, text
    assert outcomes["ok"] > 20 and outcomes["refused"] > 20, outcomes


def _random_json(rng, depth=0):
    r = rng.random()
    if depth > 3 or r < 0.3:
        return rng.choice([None, True, False, 0, -3, 2.5, 10**20, "", "x", "^a$", "#/$defs/a", "integer", "string",
                           "object", "array", "number", "boolean", "null", "date", "uuid"])
    if r < 0.5:
        return [_random_json(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    keys = ["type", "properties", "required", "additionalProperties", "enum", "const", "items", "prefixItems",
            "minItems", "maxItems", "pattern", "minLength", "maxLength", "format", "minimum", "maximum",
            "exclusiveMinimum", "exclusiveMaximum", "$ref", "$defs", "anyOf", "oneOf", "allOf", "a"]
    return {rng.choice(keys): _random_json(rng, depth + 1) for _ in range(rng.randint(0, 4))}


def test_json_schema_fuzz_only_ok_or_clean():
    """Random and mutated schemas: a grammar (which then parses, or is refused cleanly by the parser)
    or a one-line SynapseError; nothing else."""
    import random

    from synapse_nb.grammar import Grammar, json_schema_to_grammar

    rng = random.Random(2)
    cases = json.loads((GRAMMAR / "cases.json").read_text())["cases"]
    seeds = [json.dumps(c["json_schema"]) for c in cases if "json_schema" in c]
    outcomes = {"ok": 0, "refused": 0}
    for i in range(300):
        schema = _mutate_text(rng, rng.choice(seeds)) if i % 2 else json.dumps(_random_json(rng))
        try:
            Grammar(json_schema_to_grammar(schema))
            outcomes["ok"] += 1
        except SynapseError as e:
            assert "\n" not in str(e)
            outcomes["refused"] += 1
    assert outcomes["ok"] > 20 and outcomes["refused"] > 20, outcomes


# ------------------------------------------------------------------ templates, batch lines, flags (issue 34)

@pytest.mark.parametrize("kind,n", [("template", 30), ("batch", 60), ("flags", 150)])
def test_input_fuzzer_subset_is_clean(kind, n):
    """A fixed subset of fuzz/inputs.py (seed 1): every chat template, batch line and flag set renders /
    decodes / runs, or is a one-line error; no exception, signal, hang or memory error, and no case
    over 2 GiB of peak RSS or 30 s (a case over a limit is flagged)."""
    res = subprocess.run([sys.executable, "-m", "fuzz.inputs", "--kind", kind, "--n", str(n), "--seed", "1",
                          "--timeout", "30", "--soft-timeout", "20"], capture_output=True, timeout=900, cwd=ROOT)
    summary = json.loads(res.stdout)
    assert summary["flagged"] == [] and summary["counts"]["ok"] + summary["counts"]["clean"] == n, summary
    assert 0 < summary["max_rss_mb"] <= LIMIT_RSS_MB and 0 < summary["max_s"] <= LIMIT_S, summary


def test_chat_first_turn_that_does_not_fit_is_one_error_line():
    """`-cnv` with a sampling flag and a first turn longer than the context: exit 2 and one error line
    (the missing-template warning aside). Found by the seed-34034 flags campaign (cases 483, 1250:
    python -m fuzz.inputs --kind flags --seed 34034 --case 483 --show): the sampler's seed line came first."""
    res = cli(tiny("tiny-llama-q8_0"), "-p", "x" * 1000, "-cnv", "--temp", "0.5", "-n", "1", "-t", "1",
              input=b"")
    lines = [ln for ln in res.stderr.decode().splitlines() if not ln.startswith("warning: ")]
    assert res.returncode == 2 and len(lines) == 1 and "does not fit in the context" in lines[0], res.stderr.decode()
