"""Grammar-constrained generation as llama.cpp does it (synapse_nb.grammar, Sampler(grammar=...)).

Expected values come from llama.cpp, never from our own output:
- the parser's symbol ids and rule elements from llama.cpp's tests/test-grammar-parser.cpp;
- the refusals (undefined rule, missing root, left recursion, over-long repetitions) from
  llama-grammar.cpp's checks and tests/test-grammar-parser.cpp's verify_failure cases;
- which strings a grammar accepts from the grammar's meaning (GBNF semantics);
- the generations from tests/data/grammar/cases.json (llama.cpp 0c1e570's tokens, see its README).
The whole-vocabulary mask (the trie pass) is checked against the one-token transcription of
llama_grammar_reject_candidates_for_stack on every token of the vocabulary.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from synapse_nb.errors import SynapseError
from synapse_nb.grammar import Grammar, GrammarMatcher, decode_utf8, parse_grammar
from synapse_nb.grammar.gbnf import ALT, CHAR, CHAR_ALT, CHAR_NOT, CHAR_RNG_UPPER, END, RULE_REF, TOKEN, TOKEN_NOT

from conftest import GRAMMAR

CASES = json.loads((GRAMMAR / "cases.json").read_text())["cases"]
MODELS = {"smollm2": "smollm2-135m-instruct-q4_1", "qwen2.5": "qwen2.5-coder-0.5b-instruct-q4_k_m"}


# ---------------------------------------------------------------- parser (test-grammar-parser.cpp)

PARSER_CASES = [
    ('root  ::= "a"', {"root": 0}, [[(CHAR, 97), (END, 0)]]),
    ('root  ::= "a" | [bdx-z] | [^1-3]', {"root": 0},
     [[(CHAR, 97), (ALT, 0), (CHAR, 98), (CHAR_ALT, 100), (CHAR_ALT, 120), (CHAR_RNG_UPPER, 122), (ALT, 0),
       (CHAR_NOT, 49), (CHAR_RNG_UPPER, 51), (END, 0)]]),
    ('root  ::= a+\na     ::= "a"', {"a": 1, "root": 0, "root_2": 2},
     [[(RULE_REF, 1), (RULE_REF, 2), (END, 0)], [(CHAR, 97), (END, 0)],
      [(RULE_REF, 1), (RULE_REF, 2), (ALT, 0), (END, 0)]]),
    ('root  ::= "a"+', {"root": 0, "root_1": 1},
     [[(CHAR, 97), (RULE_REF, 1), (END, 0)], [(CHAR, 97), (RULE_REF, 1), (ALT, 0), (END, 0)]]),
    ('root  ::= a?\na     ::= "a"', {"a": 1, "root": 0, "root_2": 2},
     [[(RULE_REF, 2), (END, 0)], [(CHAR, 97), (END, 0)], [(RULE_REF, 1), (ALT, 0), (END, 0)]]),
    ('root  ::= "a"*', {"root": 0, "root_1": 1},
     [[(RULE_REF, 1), (END, 0)], [(CHAR, 97), (RULE_REF, 1), (ALT, 0), (END, 0)]]),
    ('root  ::= "a"{2}', {"root": 0}, [[(CHAR, 97), (CHAR, 97), (END, 0)]]),
    ('root  ::= "a"{ 4}', {"root": 0}, [[(CHAR, 97)] * 4 + [(END, 0)]]),
    ('root  ::= "a"{2,4}', {"root": 0, "root_1": 1, "root_2": 2},
     [[(CHAR, 97), (CHAR, 97), (RULE_REF, 2), (END, 0)], [(CHAR, 97), (ALT, 0), (END, 0)],
      [(CHAR, 97), (RULE_REF, 1), (ALT, 0), (END, 0)]]),
    ('root ::= "a"{0,5000}', {"root": 0, "root_1": 1},
     [[(RULE_REF, 1), (END, 0)], [(CHAR, 97), (RULE_REF, 1), (ALT, 0), (END, 0)]]),
    ('root  ::= (expr "=" term "\\n")+\nexpr  ::= term ([-+*/] term)*\nterm  ::= [0-9]+',
     {"expr": 2, "expr_5": 5, "expr_6": 6, "root": 0, "root_1": 1, "root_4": 4, "term": 3, "term_7": 7},
     [[(RULE_REF, 1), (RULE_REF, 4), (END, 0)],
      [(RULE_REF, 2), (CHAR, 61), (RULE_REF, 3), (CHAR, 10), (END, 0)],
      [(RULE_REF, 3), (RULE_REF, 6), (END, 0)],
      [(CHAR, 48), (CHAR_RNG_UPPER, 57), (RULE_REF, 7), (END, 0)],
      [(RULE_REF, 1), (RULE_REF, 4), (ALT, 0), (END, 0)],
      [(CHAR, 45), (CHAR_ALT, 43), (CHAR_ALT, 42), (CHAR_ALT, 47), (RULE_REF, 3), (END, 0)],
      [(RULE_REF, 5), (RULE_REF, 6), (ALT, 0), (END, 0)],
      [(CHAR, 48), (CHAR_RNG_UPPER, 57), (RULE_REF, 7), (ALT, 0), (END, 0)]]),
    ('root  ::= <[1000]> !<[1001]> <[1001]>', {"root": 0},
     [[(TOKEN, 1000), (TOKEN_NOT, 1001), (TOKEN, 1001), (END, 0)]]),
]


@pytest.mark.parametrize("text,symbols,rules", PARSER_CASES)
def test_parser_rules_as_llama_cpp(text, symbols, rules):
    got_rules, got_symbols, root = parse_grammar(text)
    assert got_symbols == symbols
    assert got_rules == rules
    assert root == symbols["root"]


def test_parser_arithmetic_symbol_ids():
    # test-grammar-parser.cpp's arithmetic grammar: the ids of generated rules follow llama.cpp's order
    text = (GRAMMAR / "arithmetic.gbnf").read_text()
    _, symbols, _ = parse_grammar(text)
    assert symbols == {"expr": 2, "expr_6": 6, "expr_7": 7, "ident": 8, "ident_10": 10, "num": 9, "num_11": 11,
                       "root": 0, "root_1": 1, "root_5": 5, "term": 4, "ws": 3, "ws_12": 12}


@pytest.mark.parametrize("name", ["json.gbnf", "list.gbnf", "arithmetic.gbnf", "chess.gbnf"])
def test_llama_cpp_grammar_files_parse(name):
    g = Grammar((GRAMMAR / name).read_text())
    assert g.symbol_ids["root"] == g.root_id
    assert g.initial_stacks


BAD = [
    ('root ::= "a"{,}"', "expecting an int"),
    ('root ::= "a"{,10}"', "expecting an int"),
    ('root ::= "a"{5000}', "repetitions exceeds"),
    ('root ::= "a"{5000,}', "repetitions exceeds"),
    ('root ::= (((((([^x]*){0,99}){0,99}){0,99}){0,99}){0,99}){0,99}', "exceeds sane defaults"),
    ('root ::= foo', "undefined rule 'foo'"),
    ('root ::= "a" bar\nbar ::= baz', "undefined rule 'baz'"),
    ('rot ::= "a"', "no 'root' rule"),
    ('root ::= root "a" | "b"', "left recursion"),
    ('root ::= a\na ::= b? "x" | c\nb ::= "b"\nc ::= a "c"', "left recursion"),
    ('root ::= "abc', "unexpected end of input"),
    ('root ::= [a-', "unexpected end of input"),
    ('root ::= "\\q"', "unknown escape"),
    ('root ::= "\\x4"', "expecting 2 hex chars"),
    ('root := "a"', "expecting ::="),
    ('root ::= ("a"', "expecting ')'"),
    ('root ::= *', "expecting preceding item"),
    ('root ::= "a" ]', "expecting newline or end"),
    ('', "no rules"),
    ('# only a comment\n', "no rules"),
]


@pytest.mark.parametrize("text,msg", BAD)
def test_parser_refuses_as_llama_cpp(text, msg):
    with pytest.raises(SynapseError) as e:
        Grammar(text)
    s = str(e.value)
    assert msg in s and "\n" not in s and s.startswith("grammar: ")


def test_parser_error_names_position():
    with pytest.raises(SynapseError, match=r"line 2, column 10"):
        Grammar('root ::= "a"\nfoo ::= "\\q"')


# ---------------------------------------------------------------- matcher semantics (no vocabulary)

class _CharVocab:
    """A vocabulary of given pieces (token i = pieces[i]), EOG = the last id."""

    def __init__(self, pieces):
        self._pieces = [p.encode() if isinstance(p, str) else p for p in pieces] + [b"</s>"]
        self.n_vocab = len(self._pieces)
        self.eog_ids = frozenset({self.n_vocab - 1})

    def token_to_piece(self, t, special=True):
        return self._pieces[t]


def _accepts(grammar_text, s):
    """Whether the grammar accepts the whole string s, fed one character per token."""
    chars = sorted(set(s)) or ["x"]
    vocab = _CharVocab(chars)
    m = GrammarMatcher(grammar_text, vocab)
    for ch in s:
        t = chars.index(ch)
        if not m.allows(t):
            return False
        assert m.allowed_mask()[t]
        m.accept(t)
    return m.can_end and m.allows(vocab.n_vocab - 1)


ACCEPT = [
    ('root ::= "a"{2,3}', ["aa", "aaa"], ["", "a", "aaaa", "b"]),
    ('root ::= [a-c]+ "."', ["a.", "abcab."], [".", "ad.", "a"]),
    ('root ::= [^abc]*', ["", "xyz", "é"], ["a", "xa"]),
    ('root ::= ("yes" | "no") "!"?', ["yes", "no!", "yes!"], ["ye", "yes!!", "maybe"]),
    ('root ::= "x" ws "y"\nws ::= [ \\t]*', ["xy", "x  \ty"], ["x\ny", "x"]),
    ('root ::= . "z"', ["az", "ßz", "日z"], ["z", "abz"]),
    ('root ::= "\\u00e9" [\\u3041-\\u309f]+', ["éぁ", "éゟぁ"], ["e", "é", "éア"]),
]


@pytest.mark.parametrize("text,good,bad", ACCEPT)
def test_grammar_accepts_its_language(text, good, bad):
    for s in good:
        assert _accepts(text, s), s
    for s in bad:
        assert not _accepts(text, s), s


def test_partial_utf8_across_tokens():
    # "é" (c3 a9) split over two tokens, and a token that ends inside a 3-byte character
    vocab = _CharVocab([b"\xc3", b"\xa9", b"a", b"\xe3\x81", b"\x81", b"\xe3", b"\x81\x81", b"\xa9b"])
    m = GrammarMatcher('root ::= "é" [ぁ-ゟ]', vocab)
    assert m.allows(0) and not m.allows(2) and not m.allows(1) and not m.allows(3)
    assert list(np.flatnonzero(m.allowed_mask())) == [0]
    m.accept(0)
    assert m.partial == (0x3, 1)
    assert list(np.flatnonzero(m.allowed_mask())) == [1]  # "\xa9b" would complete é then need ぁ-ゟ
    m.accept(1)
    assert list(np.flatnonzero(m.allowed_mask())) == [3, 5]  # e3 81 / e3 can still become ぁ-ゟ
    m.accept(5)
    # 81 81 completes ぁ (U+3041); 81 alone leaves e3 81, which can still become one of ぁ-ゟ
    assert list(np.flatnonzero(m.allowed_mask())) == [4, 6]
    m.accept(6)
    assert m.can_end and list(np.flatnonzero(m.allowed_mask())) == [vocab.n_vocab - 1]


def test_decode_utf8_as_llama_cpp():
    assert decode_utf8("aé".encode()) == ([0x61, 0xE9], (0xE9, 0))
    assert decode_utf8(b"a\xe3\x81") == ([0x61], (0x3041 >> 6, 1))
    assert decode_utf8(b"\x81", (0x3041 >> 6, 1)) == ([0x3041], (0x3041, 0))
    assert decode_utf8(b"\xa9") == ([], (0, -1))          # a continuation byte first: invalid
    assert decode_utf8(b"a", (3, 1)) == ([], (0, -1))     # a pending sequence not continued
    assert decode_utf8(b"ab\x00cd") == ([0x61, 0x62], (0x62, 0))  # stops at NUL


def test_eog_only_where_the_grammar_can_end():
    vocab = _CharVocab(["a", "b"])
    m = GrammarMatcher('root ::= "a" "b"?', vocab)
    eog = vocab.n_vocab - 1
    assert not m.allows(eog)
    with pytest.raises(SynapseError):
        m.accept(eog)
    m.accept(0)
    assert m.allows(eog) and m.allows(1)
    with pytest.raises(SynapseError):
        m.accept(0)  # not allowed: one line, the state unchanged
    m.accept(1)
    assert list(np.flatnonzero(m.allowed_mask())) == [eog]


def test_token_elements():
    vocab = _CharVocab(["<think>", "</think>", "x", "y"])
    m = GrammarMatcher("root ::= <[0]> !<[1]> <[1]>", vocab)
    assert list(np.flatnonzero(m.allowed_mask())) == [0]
    m.accept(0)
    assert list(np.flatnonzero(m.allowed_mask())) == [0, 2, 3]
    m.accept(3)
    assert list(np.flatnonzero(m.allowed_mask())) == [1]


# ---------------------------------------------------------------- real vocabularies and generations

def _model(key):
    from conftest import shared_model

    return shared_model(MODELS[key])


@pytest.mark.parametrize("case", [c for c in CASES if c["name"] in ("smol-json-greedy", "qwen-planets-seed3",
                                                                    "qwen-chess-seed5")],
                         ids=lambda c: c["name"])
def test_vocabulary_mask_equals_token_by_token_check(case):
    """The trie pass gives, on every token of the real vocabulary, the answer of the direct
    transcription of llama_grammar_reject_candidates_for_stack, along the case's tokens."""
    tok = _model(case["model"]).tokenizer
    m = GrammarMatcher(case["grammar"], tok)
    for step, t in enumerate(case["tokens"][:6]):
        mask = m.allowed_mask()
        ref = np.array([m.allows(i) for i in range(tok.n_vocab)])
        assert np.array_equal(mask, ref), f"step {step}: {np.flatnonzero(mask != ref)[:10]}"
        assert mask[t]
        m.accept(t)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c["name"])
def test_case_generation_library(case):
    """Session.generate with Sampler(**params, grammar=...): llama.cpp's tokens, and its redraws."""
    import synapse_nb
    from synapse_nb.sampling import Sampler

    model = _model(case["model"])
    s = synapse_nb.Session(model, n_threads=1)
    m = GrammarMatcher(case["grammar"], model.tokenizer)
    sampler = Sampler(**case["params"], grammar=m)
    redraws = []
    orig = sampler.sample

    def sample(logits):
        tok = orig(logits)
        if sampler.last_resampled:
            redraws.append(len(seen))
        seen.append(tok)
        return tok

    seen: list = []
    sampler.sample = sample
    out = s.generate(case["prompt_tokens"], case["n_predict"], sampler=sampler)
    assert out == case["tokens"]
    assert redraws == case["resampled_steps"]
    assert s.stop_reason == ("eog" if case["ended_by_eog"] else "length")
    eog = set(model.tokenizer.eog_ids)
    assert model.tokenizer.detokenize([t for t in out if t not in eog], special=False) == case["text"]


def test_greedy_grammar_is_argmax_over_allowed_tokens():
    """No sampler: the highest logit among the allowed tokens (checked against a direct argmax of the
    masked logits at every step), and a token the grammar allows at every step."""
    import synapse_nb

    case = next(c for c in CASES if c["name"] == "smol-yesno-greedy")
    model = _model("smollm2")
    s = synapse_nb.Session(model, n_threads=1)
    m = GrammarMatcher(case["grammar"], model.tokenizer)
    shadow = GrammarMatcher(case["grammar"], model.tokenizer)
    out = list(s.greedy_tokens(s.eval(case["prompt_tokens"]), 8, grammar=m))
    assert out[-1] in model.tokenizer.eog_ids
    # replay: the same logits, masked by the shadow matcher
    s2 = synapse_nb.Session(model, n_threads=1)
    row = s2.eval(case["prompt_tokens"])
    for tok in out:
        allowed = shadow.allowed_mask()
        assert tok == int(np.argmax(np.where(allowed, row, -np.inf)))
        shadow.accept(tok)
        if tok in model.tokenizer.eog_ids:
            break
        row = s2.eval([tok])
    assert model.tokenizer.detokenize(out[:-1], special=False) in (" yes.", " no.")


# ---------------------------------------------------------------- the command line

def _cli_args(case, tmp_path):
    from conftest import real_model

    args = [real_model(MODELS[case["model"]]), case["prompt"], "-n", case["n_predict"], "--json", "-t", "1"]
    if "json_schema" in case:
        args += ["-j", json.dumps(case["json_schema"])]
    elif "grammar_file" in case:
        args += ["--grammar-file", GRAMMAR / case["grammar_file"]]
    else:
        args += ["--grammar", case["grammar"]]
    return args + case["llama_flags"]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c["name"])
def test_case_generation_cli(case, tmp_path):
    """llama-decode MODEL PROMPT -n N --grammar-file F | --grammar G | -j SCHEMA + the case's flags."""
    from conftest import run_cli

    res = run_cli(*_cli_args(case, tmp_path))
    assert res.returncode == 0, res.stderr.decode()[-2000:]
    doc = json.loads(res.stdout)
    assert doc["prompt_tokens"] == case["prompt_tokens"]
    assert doc["tokens"] == case["tokens"]
    assert doc["text"] == case["text"]
    assert doc["stop"] == ("eog" if case["ended_by_eog"] else "length")


def test_cli_streamed_text_follows_the_grammar():
    from conftest import real_model, run_cli

    case = next(c for c in CASES if c["name"] == "smol-list-seed7")
    res = run_cli(real_model(MODELS["smollm2"]), case["prompt"], "-n", case["n_predict"], "-t", "1",
                  "--grammar-file", GRAMMAR / "list.gbnf", *case["llama_flags"])
    assert res.returncode == 0
    assert res.stdout.decode() == case["text"] + "\n"


@pytest.mark.parametrize("args,msg", [
    (["--grammar", 'root ::= foo'], "undefined rule 'foo'"),
    (["--grammar", 'root ::= root "a"'], "left recursion"),
    (["--grammar", 'item ::= "a"'], "no 'root' rule"),
    (["--grammar", 'root ::= "a'], "unexpected end of input"),
    (["--grammar-file", "/nonexistent/g.gbnf"], "--grammar-file /nonexistent/g.gbnf"),
    (["--grammar-file", "/dev/zero"], "not a regular file"),
    (["-j", "{bad"], "not valid JSON"),
    (["-j", "2"], "Unrecognized schema"),
    (["-j", '{"$ref": "other.json#/a"}'], "Unsupported ref"),
    (["-j", '{"type": "string", "pattern": "abc"}'], "Pattern must start with '^' and end with '$'"),
    (["-jf", "/nonexistent/s.json"], "-jf/--json-schema-file /nonexistent/s.json"),
    (["--grammar", 'root ::= "a"', "-j", "{}"], "give one of them"),
])
def test_cli_bad_grammar_is_one_line_exit_2(args, msg):
    from conftest import one_error_line, real_model, run_cli

    res = run_cli(real_model(MODELS["smollm2"]), "Hello", "-n", "4", *args)
    assert res.returncode == 2
    line = one_error_line(res)
    assert line.startswith("error: ") and msg in line
    assert res.stdout == b""


# ---------------------------------------------------------------- JSON schema -> GBNF

@pytest.mark.parametrize("case", [c for c in CASES if "json_schema" in c], ids=lambda c: c["name"])
def test_schema_grammar_identical_to_llama_cpp(case):
    from synapse_nb.grammar import json_schema_to_grammar

    assert json_schema_to_grammar(case["json_schema"]) == case["grammar"]
    assert json_schema_to_grammar(json.dumps(case["json_schema"])) == case["grammar"]


def _schema_accepts(schema, s):
    from synapse_nb.grammar import json_schema_to_grammar

    return _accepts(json_schema_to_grammar(schema), s)


SCHEMA_LANGUAGES = [
    ({"type": "integer", "minimum": 10, "maximum": 250}, ["10", "99", "100", "250"], ["9", "251", "010", "1000", "-1"]),
    ({"type": "integer", "minimum": -5, "maximum": 5}, ["-5", "0", "5"], ["-6", "6", "-0x"]),
    ({"type": "integer", "exclusiveMinimum": 0}, ["1", "42"], ["0", "-1"]),
    ({"type": "string", "minLength": 2, "maxLength": 3}, ['"ab"', '"abc"'], ['"a"', '"abcd"']),
    ({"type": "string", "pattern": "^[a-c]+-[0-9]{2}$"}, ['"ab-12"'], ['"ab-1"', '"ad-12"', "ab-12"]),
    ({"enum": ["red", 1, None]}, ['"red"', "1", "null"], ['"blue"', "2"]),
    ({"const": {"a": [1, 2]}}, ['{"a":[1,2]}'], ['{"a": [1,2]}']),
    ({"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 2},
     ["[true]", "[true,false]", "[ true, false ]"], ["[]", "[true,true,true]"]),
    ({"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "null"}}, "required": ["a"],
      "additionalProperties": False}, ['{"a":1.5}', '{"a":-2e3,"b":null}'], ["{}", '{"b":null}', '{"a":1,"c":2}']),
    ({"anyOf": [{"type": "string", "format": "date"}, {"type": "integer", "maximum": 3}]},
     ['"2024-02-29"', "3", "-7"], ['"2024-13-01"', "4"]),
    ({"$defs": {"pt": {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "integer"}]}},
      "type": "object", "properties": {"p": {"$ref": "#/$defs/pt"}}, "required": ["p"]},
     ['{"p":[1,2]}'], ['{"p":[1]}', '{"p":[1,2,3]}']),
    ({"type": "object", "additionalProperties": {"type": "integer"}}, ['{"x":1,"y":2}', "{}"], ['{"x":"1"}']),
    ({"allOf": [{"properties": {"a": {"type": "integer"}}}, {"properties": {"b": {"type": "integer"}}}]},
     ['{"a":1,"b":2}'], ['{"a":1}']),
]


def _schema_id(x):
    return json.dumps(x)[:40] if isinstance(x, dict) else ""


@pytest.mark.parametrize("schema,good,bad", SCHEMA_LANGUAGES, ids=_schema_id)
def test_schema_grammar_language(schema, good, bad):
    """The converted grammar accepts the JSON the schema allows and refuses what it does not."""
    for s in good:
        assert _schema_accepts(schema, s), s
    for s in bad:
        assert not _schema_accepts(schema, s), s


@pytest.mark.parametrize("schema,msg", [
    ({"$ref": "other.json#/a"}, "Unsupported ref: other.json#/a"),
    ({"$ref": "#/$defs/missing"}, "Error resolving ref #/$defs/missing"),
    ({"type": "strin"}, "Unrecognized schema"),
    ({"type": "string", "pattern": "[a-z]+"}, "Pattern must start with '^' and end with '$'"),
    ({"type": "string", "pattern": "^a{x}$"}, "Invalid number in curly brackets"),
    ({"type": "string", "pattern": "^a{1,2,3}$"}, "Wrong number of values in curly brackets"),
    ({"type": "string", "pattern": "^[ab$"}, "Unbalanced square brackets"),
    ({"type": "string", "pattern": "^]$"}, "unsupported character"),
    ("{not json", "not valid JSON"),
    ({"type": "array", "items": {"type": "integer"}, "minItems": "2"}, "minItems must be a number"),
])
def test_schema_refusals(schema, msg):
    from synapse_nb.grammar import json_schema_to_grammar

    with pytest.raises(SynapseError) as e:
        json_schema_to_grammar(schema)
    assert msg in str(e.value) and "\n" not in str(e.value)


@pytest.mark.slow
def test_batch_lines_with_grammar_and_schema():
    """Batch lines carry "grammar" / "json_schema" (and sampling keys): llama.cpp's tokens per line."""
    from synapse_nb.batch import Decoder

    dec = Decoder(_model("qwen2.5"), n_threads=1)
    for case in CASES:
        if case["model"] != "qwen2.5":
            continue
        line = {"id": case["name"], "tokens": case["prompt_tokens"], "n_predict": case["n_predict"],
                **{k: case["params"][k] for k in ("temp", "seed")}}
        line.update({"json_schema": case["json_schema"]} if "json_schema" in case else {"grammar": case["grammar"]})
        res = dec.decode(line)
        assert res["tokens"] == case["tokens"], case["name"]
    # -np: the lines decoded together in one ParallelSession, greedy with a grammar as well
    lines = []
    for case in CASES:
        if case["model"] == "qwen2.5":
            line = {"id": case["name"], "tokens": case["prompt_tokens"], "n_predict": case["n_predict"],
                    **{k: case["params"][k] for k in ("temp", "seed")}}
            line.update({"json_schema": case["json_schema"]} if "json_schema" in case else {"grammar": case["grammar"]})
            lines.append(line)
    greedy = {"id": "greedy", "prompt": "Is the sky blue? Answer:", "n_predict": 8,
              "grammar": 'root ::= " " ("yes" | "no") "."'}
    alone = dec.decode(greedy)
    got = {r["id"]: r["tokens"] for r in dec.decode_parallel(lines + [greedy], 3)}
    assert got == {**{c["name"]: c["tokens"] for c in CASES if c["model"] == "qwen2.5"}, "greedy": alone["tokens"]}
    assert alone["text"] in (" yes.", " no.")
    bad = dec.decode({"id": 1, "prompt": "x", "grammar": "root ::= foo"})
    assert "undefined rule 'foo'" in bad["error"]
    bad = dec.decode({"id": 2, "prompt": "x", "json_schema": {"type": "strin"}})
    assert "Unrecognized schema" in bad["error"]


def test_chat_replies_follow_the_grammar_each_turn():
    """-cnv: every reply is constrained from its start (the grammar is reset per turn)."""
    from conftest import real_model, run_cli

    res = run_cli(real_model(MODELS["smollm2"]), "-cnv", "--grammar", 'root ::= ("Yes" | "No") "."', "-t", "1",
                  "--temp", "0.8", "-s", "1", input=b"Is grass green?\nIs snow black?\nIs fire hot?\n")
    assert res.returncode == 0, res.stderr.decode()[-1000:]
    replies = [ln for ln in res.stdout.decode().splitlines() if ln.strip()]
    assert len(replies) == 3 and all(r in ("Yes.", "No.") for r in replies), replies


# ---------------------------------------------------------------- Python API (synapse_nb.Llama) and the server

def test_llama_api_grammar_cases():
    """Llama.create_completion(prompt, grammar=..., temperature, seed): llama.cpp's text, through the
    parallel engine."""
    from synapse_nb.api import Llama

    llm = Llama(MODELS["smollm2"], model=_model("smollm2"), n_threads=1, n_parallel=2, warmup=False)
    try:
        for case in [c for c in CASES if c["model"] == "smollm2"]:
            r = llm.create_completion(case["prompt"], max_tokens=case["n_predict"], temperature=case["params"]["temp"],
                                      seed=case["params"]["seed"], grammar=case["grammar"])
            assert r["choices"][0]["text"] == case["text"], case["name"]
        with pytest.raises(SynapseError, match="undefined rule"):
            llm.create_completion("x", grammar="root ::= foo")
        with pytest.raises(SynapseError, match="Cannot use both json_schema and grammar"):
            llm.create_chat_completion([{"role": "user", "content": "x"}], grammar='root ::= "a"',
                                       response_format={"type": "json_object"})
    finally:
        llm.close()


@pytest.fixture(scope="module")
def qwen_server():
    from conftest import real_model
    from serverproc import ServerProc

    pytest.importorskip("fastapi")
    s = ServerProc(real_model(MODELS["qwen2.5"]), "-np", "2", "-t", "1", "-c", "1024")
    yield s
    assert s.stop() == 0, s.stderr
    assert "Traceback" not in s.stderr


@pytest.mark.slow
def test_server_completion_json_schema_and_grammar(qwen_server):
    """/completion with llama-server's "json_schema" and "grammar" fields: llama.cpp's text."""
    import httpx

    for case in [c for c in CASES if c["model"] == "qwen2.5"]:
        body = {"prompt": case["prompt"], "n_predict": case["n_predict"], "temperature": case["params"]["temp"],
                "seed": case["params"]["seed"]}
        body.update({"json_schema": case["json_schema"]} if "json_schema" in case else {"grammar": case["grammar"]})
        r = httpx.post(qwen_server.url + "/completion", json=body, timeout=300)
        assert r.status_code == 200, r.text
        assert r.json()["content"] == case["text"], case["name"]
    r = httpx.post(qwen_server.url + "/completion", json={"prompt": "x", "grammar": "root ::= foo"}, timeout=60)
    assert r.status_code == 400 and "undefined rule 'foo'" in r.json()["error"]["message"]


@pytest.mark.slow  # (with the test above: the live server, 35 s to start on 2 busy cores)
def test_server_chat_response_format(qwen_server):
    """/v1/chat/completions response_format json_schema / json_object: the reply is JSON of the schema."""
    import httpx

    schema = {"type": "object", "properties": {"planet": {"enum": ["Mercury", "Venus", "Earth"]},
                                               "moons": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["planet", "moons"]}
    msgs = [{"role": "user", "content": "Name a planet and its number of moons, as JSON."}]
    r = httpx.post(qwen_server.url + "/v1/chat/completions", timeout=300,
                   json={"messages": msgs, "seed": 3, "max_tokens": 64,
                         "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}})
    assert r.status_code == 200, r.text
    obj = json.loads(r.json()["choices"][0]["message"]["content"])
    assert set(obj) == {"planet", "moons"} and obj["planet"] in ("Mercury", "Venus", "Earth")
    assert isinstance(obj["moons"], int) and 0 <= obj["moons"] <= 99
    r = httpx.post(qwen_server.url + "/v1/chat/completions", timeout=300,
                   json={"messages": msgs, "seed": 3, "max_tokens": 200, "response_format": {"type": "json_object"}})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(choice["message"]["content"]), dict)
    else:  # cut by max_tokens: still the start of an object
        assert choice["message"]["content"].startswith("{")
    r = httpx.post(qwen_server.url + "/v1/chat/completions", timeout=60,
                   json={"messages": msgs, "response_format": {"type": "xml"}})
    assert r.status_code == 400 and "response_format type must be one of" in r.json()["error"]["message"]


@pytest.mark.parametrize("case", [c for c in CASES if c["params"]["temp"] == 0], ids=lambda c: c["name"])
def test_greedy_cli_without_sampling_flags(case, tmp_path):
    """No sampling flag: argmax among the allowed tokens, which is what llama.cpp's --temp 0 chain
    picks (temp-ext keeps the maximum): the greedy cases' tokens again, without the sampler."""
    from conftest import run_cli

    args = _cli_args(case, tmp_path)[:-len(case["llama_flags"])]
    res = run_cli(*args)
    assert res.returncode == 0, res.stderr.decode()[-2000:]
    doc = json.loads(res.stdout)
    assert "seed" not in doc  # greedy: no sampler
    assert doc["tokens"] == case["tokens"]


# ---------------------------------------------------------------- llama.cpp's tests/test-grammar-integration.cpp

INTEGRATION_GRAMMARS = [
    ('root ::= "a"*', ["", "a", "aaaaa", "a" * 18, "a" * 62], ["b", "ab", "aab", "ba", "a" * 62 + "b"]),
    ('root ::= "a"+', ["a", "aaaaa", "a" * 18, "a" * 62], ["", "b", "ab", "aab", "ba", "a" * 62 + "b"]),
    ('root ::= "a"?', ["", "a"], ["b", "ab", "aa", "ba"]),
    ('root ::= cons+ vowel* cons? (vowel cons)*\nvowel ::= [aeiouy]\ncons ::= [bcdfghjklmnpqrstvwxyz]',
     ["yes", "no", "noyes", "crwth", "four", "bryyyy"], ["yess", "yesno", "forty", "catyyy"]),
    ('root ::= [ab]{4}', ["aaaa", "bbbb", "abab"], ["a", "b", "aaaaa"]),
    ('root ::= [ab]{4,}', ["aaaa", "aaaaab", "bbbb", "ababab"], ["", "aba"]),
    ('root ::= [ab]{0,4}', ["", "a", "aa", "aaa", "aaab"], ["aaaaa"]),
    ('root ::= ... "abc" ...', ["abcabcabc", "aaaabcccc", "🔵🟠✅abc❌🟠🔵"],
     ["aaabcccc", "aaaaabcccc", "aaaabccc", "aaaabccccc", "🔵🟠✅❌abc❌✅🟠🔵", "🔵🟠abc🟠🔵"]),
    ('root ::= expression\n'
     'expression ::= term ws (("+"|"-") ws term)*\n'
     'term ::= factor ws (("*"|"/") ws factor)*\n'
     'factor ::= number | variable | "(" expression ")" | function-call\n'
     'number ::= [0-9]+\n'
     'variable ::= [a-zA-Z_][a-zA-Z0-9_]*\n'
     'function-call ::= variable ws "(" (expression ("," ws expression)*)? ")"\n'
     'ws ::= [ \\t\\n\\r]?',
     ["42", "1*2*3*4*5", "x", "x+10", "x1+y2", "(a+b)*(c-d)", "func()", "func(x,y+2)", "a*(b+c)-d/e",
      "f(g(x),h(y,z))", "x + 10", "x1 + y2", "(a + b) * (c - d)", "func(x, y + 2)", "a * (b + c) - d / e",
      "f(g(x), h(y, z))", "123+456", "123*456*789-123/456+789*123"],
     ["+", "/ 3x", "x + + y", "a * / b", "func(,)", "func(x y)", "(a + b", "x + y)", "a + b * (c - d", "42 +",
      "x +", "x + 10 +", "(a + b) * (c - d", "func(", "func(x, y + 2", "a * (b + c) - d /", "f(g(x), h(y, z)"]),
]


@pytest.mark.parametrize("text,good,bad", INTEGRATION_GRAMMARS, ids=lambda x: x[:30] if isinstance(x, str) else "")
def test_llama_cpp_integration_grammars(text, good, bad):
    for s in good:
        assert _accepts(text, s), s
    for s in bad:
        assert not _accepts(text, s), s


INTEGRATION_SCHEMAS = [
    ({"type": "integer", "minimum": 0}, ["0", "10", "12", "10000"], ["-1", "-10", "-10000", "00", "01", "-0"]),
    ({"type": "integer", "minimum": 2}, ["2", "3", "4", "10", "20", "1234567890000000"],
     ["0", "1", "-1", "-100", "01", "02"]),
    ({"type": "integer", "minimum": 456}, ["456", "4560", "457", "460", "500"],
     ["455", "356", "50", "050", "-1", "-456"]),
    ({"type": "integer", "minimum": -123}, ["-123", "-122", "-11", "-1", "0", "1", "123", "1234", "2345"],
     ["-1234", "-124"]),
    ({"type": "integer", "maximum": 9999}, ["-99999", "0", "9999"], ["10000", "99991"]),
    ({"type": "integer", "maximum": -9999}, ["-10000", "-9999"], ["-9998", "0", "9999"]),
    ({"type": "integer", "minimum": 5, "maximum": 30}, ["5", "10", "30"], ["05", "4", "-1", "31", "123", "0123"]),
    ({"type": "integer", "minimum": -1, "maximum": 1}, ["-1", "0", "1"], ["-11", "-10", "-2", "2", "10", "11"]),
    ({"type": "integer", "minimum": -123, "maximum": 42},
     ["-123", "-122", "-13", "-11", "-2", "-1", "0", "1", "5", "10", "39", "40", "42"],
     ["-0123", "-124", "-1123", "-200", "43", "123", "0123"]),
    ({"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10000}, ["1", "9999"],
     ["0", "01", "10000", "99999"]),
    ({"type": "object"}, ["{}", '{"foo": "bar"}'], ["", "[]", "null", '""', "true"]),
]


@pytest.mark.parametrize("schema,good,bad", INTEGRATION_SCHEMAS, ids=_schema_id)
def test_llama_cpp_integration_schemas(schema, good, bad):
    for s in good:
        assert _schema_accepts(schema, s), s
    for s in bad:
        assert not _schema_accepts(schema, s), s
