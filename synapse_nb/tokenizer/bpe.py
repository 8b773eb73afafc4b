"""Byte-level BPE (tokenizer.ggml.model = "gpt2"), as llama.cpp runs it.

Reproduces llama-vocab.cpp llm_tokenizer_bpe_session::tokenize for one text fragment:
split into words with the pre-tokenizer of tokenizer.ggml.pre, map each word's UTF-8
bytes through GPT-2's byte-to-unicode table, take the whole word as one token when
ignore_merges is set and the word is a token, else start from one symbol per byte and
apply merges lowest rank first (merge.py); a final symbol that is not a token falls back
to the single-byte tokens of its bytes (bytes without one are dropped, as in llama.cpp).

Merges are strings "left right" split at the first space after the first character
(llama.cpp: word.find(' ', 1)); the first occurrence of a pair keeps its rank.
"""

from __future__ import annotations

from itertools import chain

import numpy as np

from ..gguf_file import StringArray
from .index import TokenIndex, sequence_code_points
from .merge import PairTable
from .pretokenize import PreTokenizer
from .vocab import BYTE_ENCODE_TABLE, BYTE_TO_UNICODE, Vocab

_CACHE_LIMIT = 200_000  # words kept between calls


def _split_merge(m: str) -> tuple[str, str]:
    """llama.cpp: split at word.find(' ', 1); no such space gives an empty pair."""
    p = m.find(" ", 1)
    return (m[:p], m[p + 1:]) if p >= 0 else ("", "")


def merge_part_ids(index: TokenIndex, merges) -> np.ndarray:
    """For each merge "left right" (split as _split_merge), the token ids of left, right and
    left + right in index (-1 for an empty or absent part), int32 [n, 3]; a merge without a space
    after its first character gives -2 in every column. merges: a list of str or a
    gguf_file.StringArray, looked up as code points (no str per merge), three compiled calls."""
    cps, off = sequence_code_points(merges)
    n = off.shape[0] - 1
    out = np.full((n, 3), -2, np.int32)
    # the first space of each merge after its first character (a space is one byte and one
    # code point, so this is llama.cpp's byte search too)
    space = cps == 32
    space[off[:-1][off[1:] > off[:-1]]] = False
    at = np.flatnonzero(space)
    if at.shape[0] == 0:
        return out
    p = at[np.minimum(np.searchsorted(at, off[:-1]), at.shape[0] - 1)]
    split = np.flatnonzero((p >= off[:-1]) & (p < off[1:]))  # the merges that have one
    a, p, b = off[split], p[split], off[split + 1]
    out[split, 0] = index.find(cps, a, p)
    out[split, 1] = index.find(cps, p + 1, b)
    # left + right: the merges' code points without those spaces
    joined = np.delete(cps, p)
    shift = np.arange(split.shape[0])  # spaces removed before each split merge
    out[split, 2] = index.find(joined, a - shift, b - shift - 1)
    return out


class BPE:
    """BPE merges and pre-tokenizer of one vocabulary.

    merges: list[str] or gguf_file.StringArray (tokenizer.ggml.merges: read as bytes, never
    decoded but for merges whose parts are not tokens). tokenize_fragment(text, out) appends the
    ids of `text` (a fragment without special tokens) to the list `out`.
    """

    def __init__(self, vocab: Vocab, merges: list[str]):
        self.vocab = vocab
        self.pre = PreTokenizer(vocab.pre, vocab.where)
        self.ignore_merges = vocab.ignore_merges
        self.n_vocab = vocab.n_vocab
        t2i = vocab.token_to_id
        self._extra: dict[str, int] = {}  # strings in merges that are not tokens -> extra ids
        self._extra_strs: list[str] = []

        if not isinstance(merges, (list, StringArray)):
            raise TypeError("merges must be a list of str or a gguf_file.StringArray")
        ids = merge_part_ids(t2i, merges)
        left, right, result = ids[:, 0], ids[:, 1], ids[:, 2]
        missing = np.flatnonzero((ids == -1).any(axis=1))
        for k in missing.tolist():
            # parts that are not tokens get extra ids (empty parts never match a symbol)
            a, b = _split_merge(merges[k])
            for arr, part in ((left, a), (right, b), (result, a + b)):
                if arr[k] == -1 and part:
                    arr[k] = self._intern(part)
        byte_sym = t2i.ids(BYTE_TO_UNICODE)
        for b, u in enumerate(BYTE_TO_UNICODE):
            if byte_sym[b] == -1:
                byte_sym[b] = self._intern(u)
        self._byte_sym = np.array(byte_sym, np.int32)
        self.table = PairTable(left, right, np.arange(len(merges), dtype=np.int64), result,
                               self.n_vocab + len(self._extra_strs))
        self._cache: dict[str, list[int]] = {}

    def _intern(self, s: str) -> int:
        i = self.vocab.token_to_id.get(s)
        if i is not None:
            return i
        i = self._extra.get(s)
        if i is None:
            i = self._extra[s] = self.n_vocab + len(self._extra_strs)
            self._extra_strs.append(s)
        return i

    def tokenize_fragment(self, text: str, out: list[int]) -> None:
        words = self.pre.words(text)
        cache = self._cache
        new = [w for w in dict.fromkeys(words) if w not in cache]
        if new:
            if len(cache) + len(new) > _CACHE_LIMIT:
                cache.clear()
            self._encode_words(new)
        out.extend(chain.from_iterable(map(cache.__getitem__, words)))

    def _encode_words(self, words: list[str]) -> None:
        cache = self._cache
        t2i = self.vocab.token_to_id
        todo: list[str] = []
        raw: list[bytes] = []
        encoded = [w.encode("utf-8", "surrogatepass") for w in words]
        # ignore_merges: a word that is a token is that token (one lookup call for all words)
        whole = (t2i.ids([b.decode("latin-1").translate(BYTE_ENCODE_TABLE) for b in encoded])
                 if self.ignore_merges else [-1] * len(words))
        for w, b, i in zip(words, encoded, whole):
            if i >= 0:
                cache[w] = [i]
                continue
            todo.append(w)
            raw.append(b)
        if not todo:
            return
        sym = self._byte_sym[np.frombuffer(b"".join(raw), np.uint8)]
        starts = np.zeros(len(raw) + 1, np.int64)
        np.cumsum([len(b) for b in raw], out=starts[1:])
        res, rstarts = self.table.merge(sym, starts)
        ids = res.tolist()
        st = rstarts.tolist()
        slow = res.size > 0 and int(res.max()) >= self.n_vocab
        for k, w in enumerate(todo):
            piece = ids[st[k]:st[k + 1]]
            if slow:
                piece = self._fallback(piece)
            cache[w] = piece

    def _fallback(self, piece: list[int]) -> list[int]:
        # a final symbol that is not a token: look up each of its bytes as a 1-byte string
        out = []
        t2i = self.vocab.token_to_id
        for i in piece:
            if i < self.n_vocab:
                out.append(i)
                continue
            for b in self._extra_strs[i - self.n_vocab].encode("utf-8", "surrogateescape"):
                j = t2i.get(bytes([b]).decode("utf-8", "surrogateescape"))
                if j is not None:
                    out.append(j)
        return out
