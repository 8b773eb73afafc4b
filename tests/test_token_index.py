"""TokenIndex (tokenizer/index.py): a vocabulary's text -> id map without a str per token, and
the strict UTF-8 decode and SentencePiece queue order it rests on, against Python's own."""

from __future__ import annotations

import random

import numpy as np
import pytest

from synapse_nb import SynapseError, load_tokenizer
from synapse_nb.gguf_file import StringArray, open_gguf
from synapse_nb.tokenizer import Tokenizer
from synapse_nb.tokenizer.index import TokenIndex
from synapse_nb.tokenizer.merge import spm_order, strings_code_points

from conftest import VOCAB

NAMES = ["llama-spm", "llama-bpe", "qwen2", "smollm", "mistral-spm-v1", "mistral-spm-v3",
         "mistral-tekken", "gemma3"]


def _gguf_strings(strs: list[bytes]):
    """A GGUF string array's bytes (8-byte length, bytes; ...) and StringArray-style bounds."""
    data = b"".join(len(s).to_bytes(8, "little") + s for s in strs)
    bounds, pos = [], 0
    for s in strs:
        pos += 8
        bounds.append(pos)
        pos += len(s)
    bounds.append(pos + 8)
    return np.frombuffer(data, np.uint8), np.array(bounds, np.int64)


def _check_decode(strs: list[bytes]) -> None:
    cps, off, ok = strings_code_points(*_gguf_strings(strs))
    try:
        texts = [s.decode("utf-8") for s in strs]
    except UnicodeDecodeError:
        texts = None
    assert ok == (texts is not None), strs
    if ok:
        assert np.array_equal(cps, np.frombuffer("".join(texts).encode("utf-32-le", "surrogatepass"), np.int32))
        assert off.tolist() == np.cumsum([0] + [len(t) for t in texts]).tolist()


def test_strict_utf8_decode_accepts_exactly_what_python_does():
    # every pair of bytes, as one string and as two; random 3- and 4-byte sequences around the
    # lead bytes; every 7th scalar value and the edges; a character split over two strings
    for a in range(256):
        for b in range(256):
            _check_decode([bytes([a, b])])
            _check_decode([bytes([a]), bytes([b])])
    rng = random.Random(1)
    for _ in range(40000):
        k = rng.choice([3, 4])
        tail = [rng.randrange(0x80, 0xC0) if rng.random() < 0.8 else rng.randrange(256) for _ in range(k - 1)]
        _check_decode([bytes([rng.randrange(0xC0, 0x100)] + tail)])
    scalars = [c for c in range(0, 0x110000, 7) if not 0xD800 <= c < 0xE000]
    _check_decode([chr(c).encode() for c in scalars + [0x7F, 0x80, 0x7FF, 0x800, 0xD7FF, 0xE000, 0xFFFF,
                                                       0x10000, 0x10FFFF]])
    _check_decode([b"abc", b"\xe2\x82", b"\xac"])  # valid only when joined: invalid


@pytest.mark.parametrize("name", NAMES)
def test_index_maps_every_token_as_a_dict_does(name):
    arr = open_gguf(VOCAB / f"ggml-vocab-{name}.gguf").kv["tokenizer.ggml.tokens"]
    assert isinstance(arr, StringArray)
    idx = TokenIndex(arr)
    texts = list(arr)
    ref = {t: i for i, t in enumerate(texts)}
    assert len(ref) == len(texts) == len(idx) and idx.duplicate is None
    assert idx.ids(texts) == list(range(len(texts)))
    rng = random.Random(2)
    for i in rng.sample(range(len(texts)), 300):
        assert idx[texts[i]] == i and texts[i] in idx and idx.get(texts[i]) == i
    # texts that are not tokens: a token plus a character no token has, halves of long tokens
    absent = [t + "\U000E01EF" for t in texts[:50]] + [t[: len(t) // 2] for t in texts if len(t) > 6][:300]
    assert idx.ids(absent) == [ref.get(t, -1) for t in absent]
    assert idx.get(b"a") is None and 7 not in idx and idx.get("\ud800") is None
    with pytest.raises(KeyError):
        idx["\U000E01EF"]
    # the file's bytes path and the str path give the same code points
    cps, off = TokenIndex(texts).cps, TokenIndex(texts).offsets
    assert np.array_equal(cps, idx.cps) and np.array_equal(off, idx.offsets)


def test_loading_a_vocabulary_makes_no_str_per_token():
    t = load_tokenizer(VOCAB / "ggml-vocab-gemma3.gguf")
    assert isinstance(t.vocab.tokens, StringArray) and t.vocab.tokens._list is None
    assert t.vocab.max_token_bytes == max(len(x.encode("utf-8", "surrogateescape")) for x in t.vocab.tokens)


def test_invalid_bytes_and_duplicates():
    # a token with an invalid byte (the reader's surrogate escape) is found by that text; a
    # vocabulary with two equal texts is refused naming both ids
    toks = ["<unk>", "<s>", "</s>", "a", "b\udcff", "ab\udcff", "\u2581"]
    idx = TokenIndex(toks)
    assert idx.ids(toks) == list(range(len(toks))) and idx.get("b\udcfe") is None
    assert TokenIndex(["x", "y", "x"]).duplicate == (0, 2)
    kv = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["<unk>", "<s>", "</s>", "a", "b", "a"],
          "tokenizer.ggml.scores": np.zeros(6, np.float32), "tokenizer.ggml.token_type": np.ones(6, np.int32)}
    with pytest.raises(SynapseError, match="duplicate token in vocabulary: 'a' has ids 3 and 5"):
        Tokenizer.from_kv(kv)


def test_spm_order_is_the_order_of_minus_score():
    # lower key = merged first; equal scores equal keys (0.0 and -0.0 too); NaN after +inf, as
    # the sorted dense ranks the queue order replaced
    rng = np.random.default_rng(3)
    s = np.concatenate([rng.standard_normal(500).astype(np.float32) * 1e3, rng.integers(-3, 3, 200).astype(np.float32),
                        np.array([0.0, -0.0, np.inf, -np.inf, np.nan, np.nan, 1e-45, -1e-45, 3.4e38, -3.4e38],
                                 np.float32)])
    key = spm_order(s).astype(np.int64)
    _, rank = np.unique(-s.astype(np.float64), return_inverse=True)
    assert np.array_equal(np.sign(key[:, None] - key[None, :]), np.sign(rank[:, None] - rank[None, :]))
