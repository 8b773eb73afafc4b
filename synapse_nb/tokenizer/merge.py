"""Numba kernel shared by the BPE and SentencePiece tokenizers: greedy pair merging.

Both llama.cpp sessions (llama-vocab.cpp llm_tokenizer_bpe_session::tokenize and
llm_tokenizer_spm_session::tokenize) run the same loop over a word's symbols: keep every
adjacent pair that has a merge in a priority queue, pop the best pair (BPE: lowest merge
rank; SPM: highest score of the merged token; ties: leftmost pair), skip it if either
symbol changed since it was queued, else merge the right symbol into the left one and
queue the two new neighbour pairs. We do exactly that, with symbols as integer ids:

- a symbol is a string id: a token id (< n_vocab), or an "extra" id (>= n_vocab) for a
  string that can take part in a merge but is not a token (rare: a BPE merge whose parts
  or result are not in the vocabulary; an SPM character that only occurs inside tokens);
  negative ids never merge (SPM characters that occur in no token);
- the pair table maps (left id, right id) -> (priority, merged id), lower priority first
  (BPE: rank; SPM: -score), in an open-addressing hash table built once per vocabulary.

A queued pair is stale exactly when one of its symbols was merged away or has grown:
llama.cpp compares the pair's text (BPE) or total length (SPM) with the current symbols;
symbols only ever grow by absorbing their right neighbour, so comparing ids is the same.
"""

from __future__ import annotations

import numpy as np
from numba import njit

_EMPTY = -1


@njit(cache=True, inline="always")
def _hash(key):
    key ^= key >> 29
    key *= 0x5851F42D4C957F2D  # wraps around, as int64 arithmetic does in Numba
    return key ^ (key >> 31)


@njit(cache=True)
def _build_pair_table(left, right, prio, result, n_ids):
    n = left.shape[0]
    size = 16
    while size < 2 * n + 2:
        size *= 2
    keys = np.full(size, _EMPTY, np.int64)
    tprio = np.zeros(size, np.float64)
    tres = np.zeros(size, np.int32)
    mask = size - 1
    for i in range(n):
        a = left[i]
        b = right[i]
        if a < 0 or b < 0:
            continue
        key = np.int64(a) * n_ids + b
        h = _hash(key) & mask
        while True:
            k = keys[h]
            if k == _EMPTY:
                keys[h] = key
                tprio[h] = prio[i]
                tres[h] = result[i]
                break
            if k == key:  # first one wins (llama.cpp: bpe_ranks.emplace keeps the lowest rank)
                break
            h = (h + 1) & mask
    return keys, tprio, tres


@njit(cache=True, inline="always")
def _find(keys, n_ids, a, b):
    if a < 0 or b < 0:
        return -1
    key = np.int64(a) * n_ids + b
    mask = keys.shape[0] - 1
    h = _hash(key) & mask
    while True:
        k = keys[h]
        if k == key:
            return h
        if k == _EMPTY:
            return -1
        h = (h + 1) & mask


@njit(cache=True, inline="always")
def _before(hp, hl, i, j):
    # heap order: lower priority first, then the leftmost pair
    return hp[i] < hp[j] or (hp[i] == hp[j] and hl[i] < hl[j])


@njit(cache=True, inline="always")
def _swap(hp, hl, hr, ha, hb, i, j):
    hp[i], hp[j] = hp[j], hp[i]
    hl[i], hl[j] = hl[j], hl[i]
    hr[i], hr[j] = hr[j], hr[i]
    ha[i], ha[j] = ha[j], ha[i]
    hb[i], hb[j] = hb[j], hb[i]


@njit(cache=True)
def _merge_words(sym, starts, keys, tprio, tres, n_ids, out, out_starts):
    """Merge the symbols of each word.

    sym: int32 [n] initial symbol ids of all words, concatenated.
    starts: int64 [n_words + 1] word boundaries in sym.
    out: int32 [n] receives the final symbols; out_starts: int64 [n_words + 1] their
    boundaries. Returns the number of output symbols.
    """
    n_words = starts.shape[0] - 1
    maxlen = 1
    for w in range(n_words):
        maxlen = max(maxlen, starts[w + 1] - starts[w])
    cur = np.empty(maxlen, np.int32)
    prv = np.empty(maxlen, np.int32)
    nxt = np.empty(maxlen, np.int32)
    alive = np.empty(maxlen, np.uint8)
    cap = 3 * maxlen + 4  # n-1 initial pairs + at most 2 per merge
    hp = np.empty(cap, np.float64)  # priority
    hl = np.empty(cap, np.int32)  # left symbol index
    hr = np.empty(cap, np.int32)  # right symbol index
    ha = np.empty(cap, np.int32)  # left symbol id when queued
    hb = np.empty(cap, np.int32)  # right symbol id when queued
    o = 0
    for w in range(n_words):
        s = starts[w]
        n = starts[w + 1] - s
        out_starts[w] = o
        if n == 0:
            continue
        for i in range(n):
            cur[i] = sym[s + i]
            prv[i] = i - 1
            nxt[i] = i + 1
            alive[i] = 1
        nxt[n - 1] = -1
        hn = 0
        # seed the queue with every adjacent pair that has a merge
        for i in range(n - 1):
            slot = _find(keys, n_ids, cur[i], cur[i + 1])
            if slot >= 0:
                hp[hn] = tprio[slot]
                hl[hn] = i
                hr[hn] = i + 1
                ha[hn] = cur[i]
                hb[hn] = cur[i + 1]
                c = hn
                hn += 1
                while c > 0:
                    p = (c - 1) >> 1
                    if _before(hp, hl, c, p):
                        _swap(hp, hl, hr, ha, hb, c, p)
                        c = p
                    else:
                        break
        while hn > 0:
            l = hl[0]
            r = hr[0]
            a = ha[0]
            b = hb[0]
            # pop the top
            hn -= 1
            if hn > 0:
                hp[0] = hp[hn]
                hl[0] = hl[hn]
                hr[0] = hr[hn]
                ha[0] = ha[hn]
                hb[0] = hb[hn]
                c = 0
                while True:
                    lc = 2 * c + 1
                    if lc >= hn:
                        break
                    best = lc
                    if lc + 1 < hn and _before(hp, hl, lc + 1, lc):
                        best = lc + 1
                    if _before(hp, hl, best, c):
                        _swap(hp, hl, hr, ha, hb, best, c)
                        c = best
                    else:
                        break
            if alive[l] == 0 or alive[r] == 0 or cur[l] != a or cur[r] != b or nxt[l] != r:
                continue  # stale
            slot = _find(keys, n_ids, a, b)
            cur[l] = tres[slot]
            alive[r] = 0
            nr = nxt[r]
            nxt[l] = nr
            if nr >= 0:
                prv[nr] = l
            # queue the new neighbour pairs: (prev, l) then (l, next)
            for side in range(2):
                if side == 0:
                    x = prv[l]
                    y = l
                else:
                    x = l
                    y = nxt[l]
                if x < 0 or y < 0:
                    continue
                slot2 = _find(keys, n_ids, cur[x], cur[y])
                if slot2 < 0:
                    continue
                hp[hn] = tprio[slot2]
                hl[hn] = x
                hr[hn] = y
                ha[hn] = cur[x]
                hb[hn] = cur[y]
                c = hn
                hn += 1
                while c > 0:
                    p = (c - 1) >> 1
                    if _before(hp, hl, c, p):
                        _swap(hp, hl, hr, ha, hb, c, p)
                        c = p
                    else:
                        break
        i = 0
        while i >= 0:
            out[o] = cur[i]
            o += 1
            i = nxt[i]
    out_starts[n_words] = o
    return o


class PairTable:
    """Merge table for _merge_words: (left id, right id) -> (priority, merged id).

    left, right: int ids (negative entries are skipped); prio: float64, lower merges
    first; result: merged id. n_ids: bound on every id (token ids and extra ids).
    For duplicate pairs the first entry wins.
    """

    def __init__(self, left, right, prio, result, n_ids: int):
        self.n_ids = int(max(n_ids, 1))
        self.keys, self.prio, self.result = _build_pair_table(
            np.ascontiguousarray(left, np.int32),
            np.ascontiguousarray(right, np.int32),
            np.ascontiguousarray(prio, np.float64),
            np.ascontiguousarray(result, np.int32),
            np.int64(self.n_ids),
        )

    def merge(self, sym: np.ndarray, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Run the merges on words given as initial symbol ids.

        sym: int32 [n], starts: int64 [n_words + 1] (starts[0] == 0, starts[-1] == n).
        Returns (out int32 [m], out_starts int64 [n_words + 1]): the final symbols.
        """
        sym = np.ascontiguousarray(sym, np.int32)
        starts = np.ascontiguousarray(starts, np.int64)
        n_words = starts.shape[0] - 1
        if n_words < 0 or starts[0] != 0 or starts[-1] != sym.shape[0] or np.any(np.diff(starts) < 0):
            raise ValueError("merge: bad word boundaries")
        if sym.shape[0] and int(sym.max()) >= self.n_ids:
            raise ValueError("merge: symbol id out of range")
        out = np.empty(sym.shape[0], np.int32)
        out_starts = np.empty(n_words + 1, np.int64)
        m = _merge_words(sym, starts, self.keys, self.prio, self.result,
                         np.int64(self.n_ids), out, out_starts)
        return out[:m], out_starts
