"""SentencePiece BPE (tokenizer.ggml.model = "llama"), as llama.cpp runs it.

Reproduces llama-vocab.cpp llm_tokenizer_spm_session::tokenize: the fragment (spaces
already escaped to U+2581 by the caller) starts as one symbol per UTF-8 character; the
adjacent pair whose concatenation is a token with the highest score is merged first
(ties: leftmost), repeatedly; a final symbol that is not a token is emitted as its
<0xXX> byte tokens.

A merge needs the concatenation of two symbols to be a token, and symbols are single
characters or tokens, so every possible merge is known in advance: for each token and
each split of it into two parts that are tokens or single characters, the pair table
holds (part ids) -> (-score, token id). Single characters that are not tokens but occur
inside tokens get extra ids; characters that occur in no token never merge.
(llama.cpp's rev_merge re-segmentation only applies to non-token symbols that came from
a merge, and every merge yields a token, so it never fires.)
"""

from __future__ import annotations

import numpy as np

from .merge import PairTable, spm_pairs
from .vocab import Vocab

_N_CODEPOINTS = 0x110000


class SPM:
    """Merge table of one SentencePiece vocabulary.

    tokenize_fragments(texts) -> list[list[int]]: the ids of each escaped fragment.
    """

    def __init__(self, vocab: Vocab):
        self.vocab = vocab
        self.n_vocab = n = vocab.n_vocab
        t2i = vocab.token_to_id
        # every possible merge (merge.spm_pairs, compiled; character by character here when a
        # token holds an invalid byte): 0.28 s instead of 1.35 s on Gemma 3's 262k pieces
        pairs = spm_pairs(vocab.tokens)
        left, right, result, self._extra_strs = pairs if pairs is not None else _pairs_by_characters(vocab)
        extra = {c: n + i for i, c in enumerate(self._extra_strs)}
        prio = (-vocab.scores.astype(np.float64))[result]
        self.table = PairTable(left, right, prio, result, n + len(self._extra_strs))
        # code point -> initial symbol id; -(cp + 1) for characters in no token
        sym = -np.arange(1, _N_CODEPOINTS + 1, dtype=np.int64)
        for s, i in t2i.items():
            if len(s) == 1:
                sym[ord(s)] = i
        for s, i in extra.items():
            sym[ord(s)] = i
        self._cp_sym = sym.astype(np.int32)
        self._byte_tok: list[int | None] = [None] * 256

    def _byte_token(self, b: int) -> int:
        t = self._byte_tok[b]
        if t is None:
            t = self._byte_tok[b] = self.vocab.byte_to_token(b)
        return t

    def tokenize_fragments(self, texts: list[str]) -> list[list[int]]:
        if not texts:
            return []
        joined = "".join(texts)
        cps = np.frombuffer(joined.encode("utf-32-le", "surrogatepass"), np.uint32)
        sym = self._cp_sym[cps]
        lens = np.fromiter((len(t) for t in texts), np.int64, len(texts))
        frag_starts = np.zeros(len(texts) + 1, np.int64)
        np.cumsum(lens, out=frag_starts[1:])
        # A character in no token never merges, so it cuts its fragment into pieces that
        # merge independently (same result, smaller queues): make it a word of its own.
        bar = np.flatnonzero(sym < 0)
        starts = np.unique(np.concatenate([frag_starts, bar, bar + 1]))
        res, rstarts = self.table.merge(sym, starts)
        # output range of each fragment
        st = rstarts[np.searchsorted(starts, frag_starts)].tolist()
        if res.size and (int(res.min()) < 0 or int(res.max()) >= self.n_vocab):
            try:
                res, st = self._expand_bytes(res, st)
            except UnicodeEncodeError:  # a lone surrogate that is not an escaped byte
                return [self._byte_fallback(res[st[k]:st[k + 1]].tolist())
                        for k in range(len(texts))]
        ids = res.tolist()
        return [ids[st[k]:st[k + 1]] for k in range(len(texts))]

    def _expand_bytes(self, res: np.ndarray, st: list[int]):
        """Replace every final symbol that is not a token (a character in no token, or an
        extra id) by the <0xXX> tokens of its UTF-8 bytes, vectorized."""
        n = self.n_vocab
        bad = (res < 0) | (res >= n)
        sym = res[bad].astype(np.int64)
        cps = np.where(sym < 0, -sym - 1, 0)
        if (sym >= n).any():
            extra_cp = np.array([ord(c) for c in self._extra_strs], np.int64)
            cps = np.where(sym >= n, extra_cp[np.clip(sym - n, 0, None)], cps)
        data = np.frombuffer("".join(map(chr, cps.tolist())).encode("utf-8", "surrogateescape"),
                             np.uint8)
        nb = 1 + (cps >= 0x80).astype(np.int64) + (cps >= 0x800) + (cps >= 0x10000)
        nb[(cps >= 0xDC80) & (cps <= 0xDCFF)] = 1  # an escaped invalid byte is one byte
        counts = np.ones(res.shape[0], np.int64)
        counts[bad] = nb
        out = np.repeat(res, counts)
        is_byte = np.repeat(bad, counts)
        table = np.full(256, -1, np.int64)
        for b in np.unique(data).tolist():
            table[b] = self._byte_token(b)
        out[is_byte] = table[data]
        ends = np.zeros(res.shape[0] + 1, np.int64)
        np.cumsum(counts, out=ends[1:])
        return out, ends[st].tolist()

    def _byte_fallback(self, piece: list[int]) -> list[int]:
        out = []
        n = self.n_vocab
        for i in piece:
            if 0 <= i < n:
                out.append(i)
                continue
            ch = self._extra_strs[i - n] if i >= n else chr(-i - 1)
            try:
                bs = ch.encode("utf-8", "surrogateescape")
            except UnicodeEncodeError:
                bs = ch.encode("utf-8", "surrogatepass")
            for b in bs:
                out.append(self._byte_token(b))
        return out


def _pairs_by_characters(vocab: Vocab) -> tuple:
    """merge.spm_pairs' result, (left, right, result, extra characters), computed on Python
    strings (a token may hold invalid bytes, kept by the GGUF reader as surrogate escapes)."""
    n = vocab.n_vocab
    t2i = vocab.token_to_id
    extra: dict[str, int] = {}
    extra_strs: list[str] = []

    def part_id(s: str) -> int:
        i = t2i.get(s)
        if i is None and len(s) == 1:
            i = extra.get(s)
            if i is None:
                i = extra[s] = n + len(extra_strs)
                extra_strs.append(s)
        return -1 if i is None else i

    left, right, result = [], [], []
    # A part is a token or one character, so a split point k of token t is only worth looking up
    # when k and len(t) - k are both lengths some token has (or 1): the distinct token lengths,
    # a few dozen in real vocabularies. Trying every k sliced a token at each of its positions,
    # quadratic in its length (one 8 MiB token in a downloaded vocabulary never finished).
    lengths = sorted({len(t) for t in vocab.tokens} | {1})
    length_set = set(lengths)
    for tid, t in enumerate(vocab.tokens):
        n_t = len(t)
        if n_t <= 64:
            splits = range(1, n_t)
        else:
            splits = sorted({k for ln in lengths if ln < n_t for k in (ln, n_t - ln)})
        for k in splits:
            if n_t > 64 and (k not in length_set or n_t - k not in length_set):
                continue
            a = part_id(t[:k])
            if a < 0:
                continue
            b = part_id(t[k:])
            if b < 0:
                continue
            left.append(a)
            right.append(b)
            result.append(tid)
    return (np.array(left, np.int32), np.array(right, np.int32), np.array(result, np.int32), extra_strs)
