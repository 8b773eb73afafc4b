"""SentencePiece BPE (tokenizer.ggml.model = "llama"), as llama.cpp runs it.

Reproduces llama-vocab.cpp llm_tokenizer_spm_session::tokenize: the fragment (spaces
already escaped to U+2581 by the caller) starts as one symbol per character; the adjacent
pair whose concatenation is a token with the highest score is merged first (ties:
leftmost), repeatedly (merge.spm_merge_words, every candidate pair looked up in the
vocabulary's TokenIndex as llama.cpp looks it up in token_to_id); a final symbol that is
not a token is emitted as its <0xXX> byte tokens. (llama.cpp's rev_merge re-segmentation
only applies to non-token symbols that came from a merge, and every merge yields a token,
so it never fires.)

Nothing is tabulated per vocabulary but each token's queue order (merge.spm_order) and which
lengths tokens have: a load costs what the TokenIndex costs.
"""

from __future__ import annotations

import numpy as np

from .merge import spm_merge_words, spm_order
from .vocab import Vocab


class SPM:
    """The SentencePiece session of one vocabulary.

    tokenize_fragments(texts) -> list[list[int]]: the ids of each escaped fragment.
    """

    def __init__(self, vocab: Vocab):
        self.vocab = vocab
        self.n_vocab = vocab.n_vocab
        self._index = vocab.token_to_id
        self._prio = spm_order(vocab.scores)
        lengths = self._index.lengths()
        self._is_len = np.zeros(int(lengths.max(initial=0)) + 1, np.bool_)  # lengths some token has
        self._is_len[lengths] = True
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
        cps = np.frombuffer(joined.encode("utf-32-le", "surrogatepass"), np.int32)
        starts = np.zeros(len(texts) + 1, np.int64)
        np.cumsum(np.fromiter(map(len, texts), np.int64, len(texts)), out=starts[1:])
        res, rstarts = spm_merge_words(cps, starts, self._index, self._prio, self._is_len)
        st = rstarts.tolist()  # output range of each fragment
        if res.size and int(res.min()) < 0:
            try:
                res, st = self._expand_bytes(res, st)
            except UnicodeEncodeError:  # a lone surrogate that is not an escaped byte
                return [self._byte_fallback(res[st[k]:st[k + 1]].tolist())
                        for k in range(len(texts))]
        ids = res.tolist()
        return [ids[st[k]:st[k + 1]] for k in range(len(texts))]

    def _expand_bytes(self, res: np.ndarray, st: list[int]):
        """Replace every final symbol that is not a token (-(code point + 1), a character) by the
        <0xXX> tokens of its UTF-8 bytes, vectorized."""
        bad = res < 0
        cps = -res[bad].astype(np.int64) - 1
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
        for i in piece:
            if i >= 0:
                out.append(i)
                continue
            ch = chr(-i - 1)
            try:
                bs = ch.encode("utf-8", "surrogateescape")
            except UnicodeEncodeError:
                bs = ch.encode("utf-8", "surrogatepass")
            for b in bs:
                out.append(self._byte_token(b))
        return out
