"""Tokenizer conformance with llama.cpp (tests/data/tokenizer, tests/data/real) and edge cases.

Expected ids / texts come from llama.cpp (see /work/shared/README.md); nothing here is
generated from our own output.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from synapse_nb import SynapseError, load_tokenizer
from synapse_nb.gguf_file import open_gguf
from synapse_nb.tokenizer import Tokenizer
from synapse_nb.tokenizer.merge import PairTable
from synapse_nb.tokenizer.pretokenize import PreTokenizer

from conftest import REAL, ROOT, TOKENIZER, VOCAB, real_model, tiny

VOCABS = ["llama-spm", "llama-bpe", "qwen2", "smollm", "mistral-spm-v1", "mistral-spm-v3",
          "mistral-tekken", "gemma3"]

_cache: dict = {}


def tok(name: str) -> Tokenizer:
    if name not in _cache:
        _cache[name] = load_tokenizer(VOCAB / f"ggml-vocab-{name}.gguf")
    return _cache[name]


def cases(name: str) -> list[dict]:
    with open(TOKENIZER / f"{name}.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def _differences(t, cs) -> list:
    """The cases whose ids (tokenize) or text (detokenize of llama.cpp's ids) differ from llama.cpp's."""
    bad = []
    for c in cs:
        ids = t.tokenize(c["text"], c["add_special"], c["parse_special"])
        det = t.detokenize(c["ids"], special=True)
        if ids != c["ids"] or det != c["detok"]:
            bad.append((c["text"][:60], c["add_special"], c["parse_special"], ids[:20], c["ids"][:20]))
    return bad


@pytest.mark.parametrize("name", VOCABS)
def test_llama_cpp_cases(name):
    t = tok(name)
    cs = cases(name)
    assert len(cs) > 100
    bad = _differences(t, cs)
    assert not bad, f"{len(bad)}/{len(cs)} cases differ: {bad[:5]}"


@pytest.mark.parametrize("name", VOCABS)
def test_llama_cpp_random_strings(name):
    """Random strings (tests/data/tokenizer/make_random.py: scripts, emoji, whitespace runs, special-token
    texts, runs of vocabulary pieces), tokenized and detokenized by llama.cpp's own llama_tokenize /
    llama_detokenize, with every (add_special, parse_special) pair."""
    t = tok(name)
    cs = cases(f"{name}-random")
    assert len(cs) >= 1600 and len({c["text"] for c in cs}) >= 350
    bad = _differences(t, cs)
    assert not bad, f"{len(bad)}/{len(cs)} cases differ: {bad[:5]}"


def _real_cases(model_json: str):
    with open(REAL / model_json, encoding="utf-8") as f:
        return json.load(f)["cases"]


def test_real_smollm_goldens():
    # the smollm vocabulary file holds the tokenizer keys of the SmolLM2 model
    t = tok("smollm")
    for c in _real_cases("SmolLM2-135M-Instruct.Q4_1.json"):
        assert t.tokenize(c["text"], True, c["parse_special"]) == c["tokens"], c["name"]


@pytest.mark.parametrize("model,golden", [
    ("qwen2.5-coder-0.5b-instruct-q4_k_m", "qwen2.5-coder-0.5b-instruct-q4_k_m.json"),
    ("smollm2-135m-instruct-q4_1", "SmolLM2-135M-Instruct.Q4_1.json"),
    ("gemma-3-270m-q4_k_m", "gemma-3-270m-q4_k_m.json"),
])
def test_real_model_goldens(model, golden):
    # where synapse_nb.models caches it (honours SYNAPSE_NB_MODELS); fails naming the fetch command when absent
    t = load_tokenizer(open_gguf(real_model(model)))
    for c in _real_cases(golden):
        assert t.tokenize(c["text"], True, c["parse_special"]) == c["tokens"], c["name"]


def test_special_ids_and_eog():
    # llama.cpp: BPE default add_bos only for llama3/tekken pre-tokenizers; SPM adds BOS
    assert tok("llama-bpe").add_bos and tok("llama-bpe").bos_id == 128000
    assert not tok("qwen2").add_bos and not tok("smollm").add_bos
    assert tok("llama-spm").add_bos and tok("llama-spm").bos_id == 1
    # end-of-generation: eos plus tokens whose text llama.cpp lists
    t = tok("llama-bpe")
    assert {128001, 128009}.issubset(t.eog_ids)  # <|end_of_text|>, <|eot_id|>
    assert t.vocab.tokens[128009] == "<|eot_id|>"
    t = tok("smollm")
    assert t.vocab.tokens[2] == "<|im_end|>" and 2 in t.eog_ids and 0 in t.eog_ids
    assert tok("llama-spm").eog_ids == {2}
    assert tok("mistral-tekken").eog_ids == {2}


def test_token_to_piece():
    t = tok("llama-bpe")
    assert t.token_to_piece(128000, special=True) == b"<|begin_of_text|>"
    assert t.token_to_piece(128000, special=False) == b""
    assert t.token_to_piece(t.tokenize(" Hello", False)[0]) == b" Hello"
    s = tok("llama-spm")
    assert s.token_to_piece(s.vocab.token_to_id["<0x0A>"]) == b"\n"
    assert s.token_to_piece(s.vocab.token_to_id["\u2581the"]) == b" the"
    assert s.token_to_piece(1, special=False) == b"" and s.token_to_piece(1) == b"<s>"
    with pytest.raises(SynapseError):
        t.token_to_piece(t.n_vocab)
    with pytest.raises(SynapseError):
        t.token_to_piece(-1)


@pytest.mark.parametrize("name", VOCABS)
def test_roundtrip_and_stream(name):
    """Byte-level BPE and SPM with byte fallback lose nothing: detokenize(tokenize(x)) == x
    (SPM: plus the prefix space); the stream decoder never emits a broken character and
    its output concatenates to detokenize(). (Gemma 3's SPM vocabulary has no space prefix.)"""
    t = tok(name)
    texts = [
        "a" + " " * 300 + "b" + "\t" * 40 + "\n" * 17 + "  \n \r\n",
        "1234567890" * 20 + " 3.14159e-10 ٣٤٥ ①② 0x1F",
        "🦙🚀👨‍👩‍👧‍👦🏳️‍🌈 𝕳𝖊𝖑𝖑𝖔 𐍈 \U0001F9EA\U0001FAE8",
        "e\u0301 n\u0303 a\u0308\u0304 \u0915\u093f \u0e01\u0e34\u0e4a Zalgo: Z\u0351\u036b\u0343",
        "日本語のテキストと中文混合，Ελληνικά, русский, עברית, العربية",
        "\x00\x01\x1c\x1f\x7f\u200b\u2028\u00a0\u3000\ufeff end",
    ]
    for text in texts:
        ids = t.tokenize(text, add_special=False, parse_special=False)
        assert all(0 <= i < t.n_vocab for i in ids)
        out = t.detokenize(ids)
        if t.type == "spm" and t.vocab.add_space_prefix:
            assert out == " " + text
        else:
            assert out == text
        dec = t.stream_decoder()
        parts = [dec.push(i) for i in ids] + [dec.flush()]
        assert b"".join(parts).decode("utf-8") == out
        # every part is whole characters: none is broken or replaced
        assert all("\ufffd" not in p.decode("utf-8") for p in parts)
        dec = t.stream_decoder()  # pieces looked up by the caller (the CLI's way)
        assert b"".join([dec.push(t.token_to_piece(i, False)) for i in ids] + [dec.flush()]) \
            == t.detokenize(ids, special=False).encode()


def test_stream_holds_back_partial_utf8():
    s = tok("llama-spm")
    # an emoji not in the vocabulary comes out as four byte tokens
    ids = s.tokenize("\U0001F9EA", add_special=False)
    byte_ids = [s.vocab.token_to_id[f"<0x{b:02X}>"] for b in "\U0001F9EA".encode()]
    assert ids[-4:] == byte_ids
    dec = s.stream_decoder()
    assert [dec.push(i) for i in byte_ids] == [b"", b"", b"", "\U0001F9EA".encode()]
    dec.push(byte_ids[0])
    assert dec.pending == b"\xf0"
    assert dec.flush() == "\ufffd".encode()
    # an invalid byte is replaced where it stands, a valid one after it is kept
    dec = s.stream_decoder()
    assert dec.push(b"\xff") + dec.push(b"a") + dec.flush() == "\ufffda".encode()


def test_parse_special_and_user_defined():
    t = tok("qwen2")
    text = "<|im_start|>user\nhi<|im_end|>[PAD151646]x"
    with_special = t.tokenize(text, False, True)
    assert with_special[0] == 151644 and 151645 in with_special
    plain = t.tokenize(text, False, False)
    assert 151644 not in plain and 151645 not in plain
    # user-defined tokens are split out even without parse_special
    assert 151646 in plain
    # text right after a special token
    assert t.tokenize("<|im_end|>Hello", False, True)[1:] == t.tokenize("Hello", False)
    s = tok("llama-spm")
    # SPM: a fragment after a special token gets the space prefix again
    assert s.tokenize("<s>Hello", False, True) == [1] + s.tokenize("Hello", False)


def test_pretokenizer_words():
    # Llama 3 splits digits in threes and keeps a leading non-letter with a word
    p = PreTokenizer("llama-bpe")
    assert p.words("12345 ab,cd\n\n  x") == ["123", "45", " ab", ",cd", "\n\n", " ", " x"]
    assert p.words("don't  'S") == ["don", "'t", " ", " '", "S"]
    # Qwen2: single digits
    assert PreTokenizer("qwen2").words("2024") == ["2", "0", "2", "4"]
    # smollm: digits first, then GPT-2's regex inside the rest
    assert PreTokenizer("smollm").words("ab 12cd") == ["ab", " ", "1", "2", "cd"]
    # tekken: a non-ASCII letter counts as upper and lower case (llama.cpp collapsing)
    assert PreTokenizer("tekken").words("HTTPServer ÄÖÜber") == ["HTTPServer", " ÄÖÜber"]
    with pytest.raises(SynapseError):
        PreTokenizer("no-such-pre")


def test_merge_kernel_order():
    # pairs: (0,1)->5 prio 1, (1,2)->6 prio 0, (5,2)->7 prio 2: "012" merges (1,2) first
    t = PairTable(np.array([0, 1, 5]), np.array([1, 2, 2]), np.array([1.0, 0.0, 2.0]),
                  np.array([5, 6, 7]), 8)
    out, st = t.merge(np.array([0, 1, 2, 0, 1, 1, 1, 2], np.int32), np.array([0, 3, 8]))
    assert out[st[0]:st[1]].tolist() == [0, 6]
    # 0 1 1 1 2: (1,2) first (priority 0), then (0,1) -> 5 1 6
    assert out[st[1]:st[2]].tolist() == [5, 1, 6]
    # (0,0)->9 with equal priority everywhere: leftmost first -> [9, 9, 0]
    t2 = PairTable(np.array([0]), np.array([0]), np.array([0.0]), np.array([9]), 10)
    out, _ = t2.merge(np.zeros(5, np.int32), np.array([0, 5]))
    assert out.tolist() == [9, 9, 0]


def _merge_ids_ref(tokens: list[str], merges: list[str]) -> list[list[int]]:
    # llama.cpp's llm_tokenizer_bpe: word.find(' ', 1), then token_to_id lookups of the parts
    t2i = {}
    for i, t in enumerate(tokens):
        t2i.setdefault(t, i)
    rows = []
    for m in merges:
        p = m.find(" ", 1)
        if p < 0:
            rows.append([-2, -2, -2])
            continue
        a, b = m[:p], m[p + 1:]
        rows.append([t2i.get(x, -1) if x else -1 for x in (a, b, a + b)])
    return rows


@pytest.mark.parametrize("name", ["qwen2", "llama-bpe", "smollm", "mistral-tekken"])
def test_merge_part_ids_equal_a_dict_lookup(name):
    # the merges' parts looked up in the TokenIndex (three compiled calls on code points) against
    # a dict of the tokens, on a real vocabulary's merges and on edge cases: no space after the
    # first character, a space first, an empty right part, parts that are not tokens, non-ASCII
    from synapse_nb.tokenizer.bpe import merge_part_ids
    from synapse_nb.tokenizer.index import TokenIndex

    kv = open_gguf(VOCAB / f"ggml-vocab-{name}.gguf").kv
    tokens, merges = kv["tokenizer.ggml.tokens"], kv["tokenizer.ggml.merges"]
    index = TokenIndex(tokens)
    got = merge_part_ids(index, merges)
    assert got.dtype == np.int32 and got.tolist() == _merge_ids_ref(list(tokens), list(merges))
    edge = ["", "a", " ", "  ", " a b", "a ", "a  b", "ab", "Ġ t", "ĠĠ ĠĠ", "ä ö", "\U0001f600 x y",
            "x \U000e01ef", tokens[100] + " " + tokens[200], merges[0], merges[-1]]
    assert merge_part_ids(index, edge).tolist() == _merge_ids_ref(list(tokens), edge)
    assert merge_part_ids(index, []).shape == (0, 3)


def test_bad_inputs(tmp_path):
    kv = dict(open_gguf(VOCAB / "ggml-vocab-qwen2.gguf").kv)
    with pytest.raises(SynapseError, match="tokenizer.ggml.pre"):
        Tokenizer.from_kv({**kv, "tokenizer.ggml.pre": "bogus"})
    with pytest.raises(SynapseError, match="tokenizer.ggml.model"):
        Tokenizer.from_kv({k: v for k, v in kv.items() if k != "tokenizer.ggml.model"})
    with pytest.raises(SynapseError, match="tokenizer.ggml.model"):
        Tokenizer.from_kv({**kv, "tokenizer.ggml.model": "bert"})
    with pytest.raises(SynapseError, match="merges"):
        Tokenizer.from_kv({k: v for k, v in kv.items() if k != "tokenizer.ggml.merges"})
    with pytest.raises(SynapseError, match="duplicate token"):
        toks = list(kv["tokenizer.ggml.tokens"])
        toks[5] = toks[4]
        Tokenizer.from_kv({**kv, "tokenizer.ggml.tokens": toks})
    with pytest.raises(SynapseError, match="add_bos_token"):
        Tokenizer.from_kv({**kv, "tokenizer.ggml.add_bos_token": True,
                           "tokenizer.ggml.bos_token_id": 10**9, "tokenizer.ggml.model": "gpt2",
                           "tokenizer.ggml.tokens": kv["tokenizer.ggml.tokens"][:10],
                           "tokenizer.ggml.token_type": kv["tokenizer.ggml.token_type"][:10]})
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"not a gguf file")
    with pytest.raises(SynapseError):
        load_tokenizer(bad)
    with pytest.raises(TypeError):
        tok("qwen2").tokenize(123)


# --- literal ports of llama.cpp loops, to check the optimized paths against ---------------

def _flags(ch: str):
    """(is_whitespace, is_letter, is_number) from the same Unicode source as llama.cpp's
    gen-unicode-data.py (the regex package)."""
    import regex
    return (bool(regex.match(r"\s", ch)), bool(regex.match(r"\p{L}", ch)),
            bool(regex.match(r"\p{N}", ch)))


def _ref_split_llama3(text: str) -> list[str]:
    """unicode.cpp unicode_regex_split_custom_llama3, transcribed."""
    n = len(text)
    fl = [_flags(c) for c in text]
    ws = lambda p: 0 <= p < n and fl[p][0]  # noqa: E731
    let = lambda p: 0 <= p < n and fl[p][1]  # noqa: E731
    num = lambda p: 0 <= p < n and fl[p][2]  # noqa: E731
    cpt = lambda p: text[p] if 0 <= p < n else None  # noqa: E731
    out, prev, pos = [], 0, 0

    def add(end):
        nonlocal prev
        if end > prev:
            out.append(text[prev:end])
        prev = end

    while pos < n:
        c = text[pos]
        if c == "'" and pos + 1 < n:
            c1 = text[pos + 1].lower() if text[pos + 1].isascii() else text[pos + 1]
            if c1 in "stmd":
                add(pos + 2); pos += 2; continue  # noqa: E702
            if pos + 2 < n:
                c2 = text[pos + 2].lower() if text[pos + 2].isascii() else text[pos + 2]
                if (c1, c2) in (("r", "e"), ("v", "e"), ("l", "l")):
                    add(pos + 3); pos += 3; continue  # noqa: E702
        if not (c in "\r\n" or num(pos)):
            if let(pos) or let(pos + 1):
                pos += 1
                while let(pos):
                    pos += 1
                add(pos); continue  # noqa: E702
        if num(pos):
            ini = pos
            while num(pos):
                pos += 1
                if pos - ini >= 3:
                    add(pos); ini = pos  # noqa: E702
            add(pos); continue  # noqa: E702
        q = pos + 1 if c == " " else pos
        if not (ws(q) or let(q) or num(q)) and True:  # flags.as_uint() != 0 in range
            if c == " " and q >= n:
                pass  # flags2 of an out-of-range position is 0: the loop does not run
            pos += c == " "
            while pos < n and not (ws(pos) or let(pos) or num(pos)):
                pos += 1
            while cpt(pos) in ("\r", "\n"):
                pos += 1
            add(pos); continue  # noqa: E702
        nw, last_rn = 0, 0
        while ws(pos + nw):
            if text[pos + nw] in "\r\n":
                last_rn = pos + nw + 1
            nw += 1
        if last_rn > 0:
            pos = last_rn; add(pos); continue  # noqa: E702
        if nw > 1 and pos + nw < n:
            pos += nw - 1; add(pos); continue  # noqa: E702
        if nw > 0:
            pos += nw; add(pos); continue  # noqa: E702
        pos += 1
        add(pos)
    return out


def _ref_split_gpt2(text: str) -> list[str]:
    """unicode.cpp unicode_regex_split_custom_gpt2, transcribed."""
    n = len(text)
    fl = [_flags(c) for c in text]
    ws = lambda p: 0 <= p < n and fl[p][0]  # noqa: E731
    let = lambda p: 0 <= p < n and fl[p][1]  # noqa: E731
    num = lambda p: 0 <= p < n and fl[p][2]  # noqa: E731
    out, prev, pos = [], 0, 0

    def add(end):
        nonlocal prev
        if end > prev:
            out.append(text[prev:end])
        prev = end

    while pos < n:
        c = text[pos]
        if c == "'" and pos + 1 < n:
            c1 = text[pos + 1]
            if c1 in "stmd":
                add(pos + 2); pos += 2; continue  # noqa: E702
            if pos + 2 < n and (c1, text[pos + 2]) in (("r", "e"), ("v", "e"), ("l", "l")):
                add(pos + 3); pos += 3; continue  # noqa: E702
        q = pos + 1 if c == " " else pos
        if let(q):
            pos += c == " "
            while let(pos):
                pos += 1
            add(pos); continue  # noqa: E702
        if num(q):
            pos += c == " "
            while num(pos):
                pos += 1
            add(pos); continue  # noqa: E702
        if q < n and not (ws(q) or let(q) or num(q)):
            pos += c == " "
            while pos < n and not (ws(pos) or let(pos) or num(pos)):
                pos += 1
            add(pos); continue  # noqa: E702
        nw = 0
        while ws(pos + nw):
            nw += 1
        if nw > 1 and pos + nw < n:
            pos += nw - 1; add(pos); continue  # noqa: E702
        if nw > 0:
            pos += nw; add(pos); continue  # noqa: E702
        pos += 1
        add(pos)
    return out


_ALPHABET = ([" "] * 8 + ["\t", "\n", "\r", "\x0b", "\x1c", "\u00a0", "\u2028", "\u3000"]
             + list("abcdeSTstrevlmdXYZ") * 2 + list("0123456789") + ["'"] * 4
             + list(",.!?-_/()[]{}<>~$+|@#") + ["é", "Ä", "ß", "ж", "λ", "中", "文", "ア", "ก"]
             + ["\u0301", "\u0308", "\u093f", "\u200d", "\ufe0f", "\u0378", "½", "٣", "Ⅻ"]
             + ["🦙", "🚀", "👨", "\U0001F9EA", "𝕳", "\U000E0041"])


def _random_texts(n, seed=7, max_len=40):
    import random
    rng = random.Random(seed)
    return ["".join(rng.choice(_ALPHABET) for _ in range(rng.randint(1, max_len)))
            for _ in range(n)]


def test_pretokenizer_matches_llama_cpp_custom_loops():
    llama3, gpt2 = PreTokenizer("llama-bpe"), PreTokenizer("gpt-2")
    for text in _random_texts(600):
        assert llama3.words(text) == _ref_split_llama3(text), repr(text)
        assert gpt2.words(text) == _ref_split_gpt2(text), repr(text)


_dicts = {}


def _dict_of(vocab) -> dict:
    """token text -> id as a Python dict (llama.cpp's token_to_id map), independent of TokenIndex."""
    d = _dicts.get(id(vocab))
    if d is None:
        d = _dicts[id(vocab)] = {t: i for i, t in enumerate(list(vocab.tokens))}
    return d


def _ref_spm(vocab, text: str) -> list[int]:
    """llm_tokenizer_spm_session::tokenize, naively: best-scoring adjacent pair first."""
    t2i, scores = _dict_of(vocab), vocab.scores
    syms = list(text)
    while True:
        best = None
        for i in range(len(syms) - 1):
            j = t2i.get(syms[i] + syms[i + 1])
            if j is not None and (best is None or scores[j] > best[0]):
                best = (scores[j], i)
        if best is None:
            break
        i = best[1]
        syms[i:i + 2] = [syms[i] + syms[i + 1]]
    out = []
    for s in syms:
        if s in t2i:
            out.append(t2i[s])
        else:
            out.extend(vocab.byte_to_token(b) for b in s.encode())
    return out


def _ref_bpe(bpe, ranks, word: str) -> list[int]:
    """llm_tokenizer_bpe_session::tokenize for one word, naively: lowest-rank pair first."""
    from synapse_nb.tokenizer.vocab import BYTE_ENCODE_TABLE
    t2i = _dict_of(bpe.vocab)
    enc = word.encode().decode("latin-1").translate(BYTE_ENCODE_TABLE)
    if bpe.ignore_merges and enc in t2i:
        return [t2i[enc]]
    syms = list(enc)
    while True:
        best = None
        for i in range(len(syms) - 1):
            r = ranks.get((syms[i], syms[i + 1]))
            if r is not None and (best is None or r < best[0]):
                best = (r, i)
        if best is None:
            break
        i = best[1]
        syms[i:i + 2] = [syms[i] + syms[i + 1]]
    return [t2i[s] for s in syms]


@pytest.mark.parametrize("name", ["llama-spm", "mistral-spm-v1", "mistral-spm-v3", "gemma3"])
def test_spm_matches_naive_session(name):
    t = tok(name)
    texts = [s.replace(" ", "\u2581") for s in _random_texts(300, seed=11, max_len=30)]
    got = t._spm.tokenize_fragments(texts)
    for text, ids in zip(texts, got):
        assert ids == _ref_spm(t.vocab, text), repr(text)


@pytest.mark.parametrize("name", ["smollm", "llama-bpe", "mistral-tekken"])
def test_bpe_matches_naive_session(name):
    t = tok(name)
    bpe = t._bpe
    ranks = {}
    for r, m in enumerate(open_gguf(VOCAB / f"ggml-vocab-{name}.gguf").kv[
            "tokenizer.ggml.merges"]):
        a, _, b = m.partition(" ")
        ranks.setdefault((a, b), r)
    words = sorted({w for text in _random_texts(300, seed=13) for w in bpe.pre.words(text)})
    words += ["a" * 50, "🦙" * 9, "0" * 40, " " * 64]
    for w in words:
        got = []
        bpe.tokenize_fragment(w, got) if len(bpe.pre.words(w)) == 1 else None
        if got:
            assert got == _ref_bpe(bpe, ranks, w), repr(w)


def test_unicode_tables_are_llama_cpp_15_1():
    from synapse_nb.tokenizer.pretokenize import collapse
    # llama.cpp unicode-data.cpp: U+1C89 (new in Unicode 16) is unassigned, U+0CF3 (15.0) a
    # mark, U+2EBF0 (15.1, CJK ext. I) a letter, U+0378 unassigned, NBSP whitespace
    assert collapse("\u1c89\u0cf3\U0002EBF0\u0378\u00a0") == "\xd0\xd4\xd2\xd0\x0b"


def test_end_to_end_matches_literal_ports():
    """Whole tokenize() (special-token split, word cache, batched kernel) against the
    transcribed llama.cpp loops, on longer random texts."""
    t = tok("llama-bpe")
    ranks = {}
    for r, m in enumerate(open_gguf(VOCAB / "ggml-vocab-llama-bpe.gguf").kv[
            "tokenizer.ggml.merges"]):
        a, _, b = m.partition(" ")
        ranks.setdefault((a, b), r)
    texts = _random_texts(60, seed=21, max_len=300)
    for text in texts:
        want = [i for w in _ref_split_llama3(text) for i in _ref_bpe(t._bpe, ranks, w)]
        assert t.tokenize(text, add_special=False, parse_special=False) == want, repr(text)
    s = tok("llama-spm")
    for text in texts[:30]:
        want = [1] + _ref_spm(s.vocab, (" " + text).replace(" ", "\u2581"))
        assert s.tokenize(text, add_special=True, parse_special=False) == want, repr(text)


def _spm_with_long_token(tmp_path, n_chars: int):
    """tiny-llama's SentencePiece model with token 300 replaced by '▁' + 'ab' * (n_chars / 2)."""
    from fuzz import gguf as fz

    buf = tiny("tiny-llama-q8_0").read_bytes()
    lay = fz.parse_layout(buf)
    toks = fz._array_strings(lay.kv("tokenizer.ggml.tokens"))
    toks[300] = "\u2581".encode() + b"ab" * (n_chars // 2)
    kvs = fz.replace_kv(lay, b"tokenizer.ggml.tokens", fz.ARRAY, fz.enc_array(fz.STRING, toks))
    out = tmp_path / f"long-token-{n_chars}.gguf"
    out.write_bytes(fz.build(lay, buf, kvs=kvs))
    return out


def test_one_very_long_token_does_not_hang_the_spm_table(tmp_path):
    # building the SPM pair table sliced every token at every position: 256 KiB took 8 s, 8 MiB never ended.
    # Now a token is split only where both parts have lengths some token has; and a long token raises
    # the prompt read bound only up to inputs.PROMPT_BYTES_MAX (-f /dev/zero read 4 GB before refusing)
    import subprocess
    import sys

    model = _spm_with_long_token(tmp_path, 8 << 20)
    res = subprocess.run([sys.executable, "-m", "cli.main", str(model), "hello abab", "--tokenize"], cwd=ROOT,
                         capture_output=True, timeout=60)
    assert res.returncode == 0, res.stderr.decode()[-500:]
    tok = load_tokenizer(_spm_with_long_token(tmp_path, 256))
    ref = load_tokenizer(tiny("tiny-llama-q8_0"))
    text = "hello world, abab abababab " * 3
    assert tok.tokenize(text, True, False) == ref.tokenize(text, True, False)  # token 300 never merges
    from synapse_nb.inputs import PROMPT_BYTES_MAX, prompt_byte_limit

    assert prompt_byte_limit(load_tokenizer(model), 4096) == PROMPT_BYTES_MAX
    assert prompt_byte_limit(ref, 4096) == 4096 * 64
