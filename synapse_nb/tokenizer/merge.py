"""Numba kernels of the BPE and SentencePiece tokenizers: greedy pair merging.

Both llama.cpp sessions (llama-vocab.cpp llm_tokenizer_bpe_session::tokenize and
llm_tokenizer_spm_session::tokenize) run the same loop over a word's symbols: keep every
adjacent pair that has a merge in a priority queue, pop the best pair (BPE: lowest merge
rank; SPM: highest score of the merged token; ties: leftmost pair), skip it if either
symbol changed since it was queued, else merge the right symbol into the left one and
queue the two new neighbour pairs. We do exactly that, on one binary heap (_push, _pop):

- BPE (_merge_words): a symbol is a string id: a token id (< n_vocab), or an "extra" id
  (>= n_vocab) for a string that takes part in a merge but is not a token (a merge whose
  parts or result are not in the vocabulary); the pair table maps (left id, right id) ->
  (rank, merged id) in an open-addressing hash table built once per vocabulary (PairTable).
- SPM (_spm_merge_words): a pair merges when its text is a token, so, as llama.cpp, each
  candidate pair's code points are looked up in the vocabulary's TokenIndex (index.cp_find);
  a symbol is a run of the word's characters.

A queued pair is stale exactly when one of its symbols was merged away or has grown:
llama.cpp compares the pair's text (BPE) or total length (SPM) with the current symbols;
symbols only ever grow by absorbing their right neighbour, so comparing ids (BPE) or the
right symbol's end (SPM) is the same.
"""
from __future__ import annotations

import numpy as np
from numba import njit


_EMPTY = -1
_FNV_BASIS = -3750763034362895579  # FNV-1a's 64-bit offset basis as an int64: the seed of every string hash


@njit(cache=True, inline="always")
def _hash(key):
    key ^= key >> 29
    key *= 0x5851F42D4C957F2D  # wraps around, as int64 arithmetic does in Numba
    return key ^ (key >> 31)


def table_size(n: int) -> int:
    """The size of an open-addressing table of n keys (the pair table's, TokenIndex's): a power
    of two >= 2n + 2 (load <= 1/2)."""
    size = 16
    while size < 2 * n + 2:
        size *= 2
    return size


@njit(cache=True)
def _build_pair_table(left, right, prio, result, n_ids, keys, trank, tres):
    # prio: int32 ranks >= 0 (lower merges first). A slot holds its pair as the key
    # left * n_ids + right (both ids in [0, n_ids)), its rank and its merged id. keys: int64
    # [table_size(n)] all _EMPTY; trank, tres: int32, the same size (the caller allocates them:
    # an allocation in a kernel compiles NumPy's implementation into it, 0.1 s a first run).
    n = left.shape[0]
    mask = keys.shape[0] - 1
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
                trank[h] = prio[i]
                tres[h] = result[i]
                break
            if k == key:  # first one wins (llama.cpp: bpe_ranks.emplace keeps the lowest rank)
                break
            h = (h + 1) & mask


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
def _move_up(hk, hs, src, hole):
    # the entry at src fills the hole; src is the new hole
    hk[hole] = hk[src]
    hs[hole] = hs[src]
    return src


@njit(cache=True, inline="always")
def _place(hk, hs, i, key, slot):
    hk[i] = key
    hs[i] = slot


@njit(cache=True, inline="always")
def _push(hk, hs, hn, key, slot):
    # binary min-heap on key = rank << 32 | left index (lower rank, then leftmost first)
    hole = hn
    while hole > 0:
        p = (hole - 1) >> 1
        if hk[p] <= key:
            break
        hole = _move_up(hk, hs, p, hole)
    _place(hk, hs, hole, key, slot)
    return hn + 1


@njit(cache=True, inline="always")
def _pop(hk, hs, hn):
    # remove the top (read it before calling); returns the new size
    hn -= 1
    if hn > 0:
        key = hk[hn]
        slot = hs[hn]
        hole = 0
        while True:
            c = 2 * hole + 1
            if c >= hn:
                break
            if c + 1 < hn and hk[c + 1] < hk[c]:
                c += 1
            if hk[c] >= key:
                break
            hole = _move_up(hk, hs, c, hole)
        _place(hk, hs, hole, key, slot)
    return hn


@njit(cache=True, inline="always")
def _next_pair(k, n, c0, c1):
    """The next pair a merge loop (_merge_words, _spm_merge_words) looks up, by its left symbol a:
    first the word's n - 1 adjacent pairs in order (k the next of them), then a merge's new
    neighbour pairs c0, c1 (-1: none). Returns (a, k, c0, c1) after taking it; a is -1 when none
    is left, and the loop pops its queue's best pair."""
    if k < n - 1:
        return k, k + 1, c0, c1
    if c0 >= 0:
        return c0, k, c1, np.int64(-1)
    return np.int64(-1), k, c0, c1


@njit(cache=True)
def _merge_words(sym, starts, keys, trank, tres, n_ids, out, out_starts, cur, prv, nxt, hk, hs):
    """Merge the symbols of each word.

    sym: int32 [n] initial symbol ids of all words, concatenated.
    starts: int64 [n_words + 1] word boundaries in sym.
    keys/trank/tres: the pair table (key = left id * n_ids + right id, rank, merged id).
    out: int32 [n] receives the final symbols; out_starts: int64 [n_words + 1] their
    boundaries. Scratch (the caller's: an allocation here would compile NumPy's np.empty into the
    kernel, 0.25 s of a first run for the five): cur, prv, nxt int32 [longest word], the queue's
    hk int64 and hs int32 [3 * longest word + 4]. Returns the number of output symbols.
    """
    n_words = starts.shape[0] - 1
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
        nxt[n - 1] = -1
        hn = 0
        # Every pair (a, nxt[a]) that may merge is looked up and queued at one place, the loop's
        # end (one copy of the inlined lookup and push: a second and third were 0.3 s of the
        # kernel's compile): first the word's adjacent pairs left to right, then after each merge
        # its new neighbour pairs, (prev, l) then (l, next), before the next pop.
        k, c0, c1 = np.int64(0), np.int64(-1), np.int64(-1)  # see _next_pair
        while True:
            a, k, c0, c1 = _next_pair(k, n, c0, c1)
            if a < 0:
                if hn == 0:
                    break
                l = np.int32(hk[0] & 0xFFFFFFFF)
                slot = hs[0]
                hn = _pop(hk, hs, hn)
                # stale: the left symbol was merged away or changed, or its right neighbour
                # is not the one queued (cur == -2 marks merged-away symbols; a pair of ids >= 0
                # is the slot's pair exactly when it gives the slot's key)
                ca = cur[l]
                r = nxt[l]
                if ca < 0 or r < 0:
                    continue
                cb = cur[r]
                if cb < 0 or np.int64(ca) * n_ids + cb != keys[slot]:
                    continue
                cur[l] = tres[slot]
                cur[r] = -2
                nr = nxt[r]
                nxt[l] = nr
                if nr >= 0:
                    prv[nr] = l
                # then its new neighbour pairs, (prev, l) and (l, next), those that exist, in order
                x, y = np.int64(prv[l]), (np.int64(l) if nr >= 0 else np.int64(-1))
                c0, c1 = (x, y) if x >= 0 else (y, np.int64(-1))
                continue
            slot = _find(keys, n_ids, cur[a], cur[nxt[a]])
            if slot >= 0:
                hn = _push(hk, hs, hn, (np.int64(trank[slot]) << 32) | a, slot)
        i = 0
        while i >= 0:
            out[o] = cur[i]
            o += 1
            i = nxt[i]
    out_starts[n_words] = o
    return o


class PairTable:
    """Merge table for _merge_words: (left id, right id) -> (priority, merged id).

    left, right: int ids (negative entries are skipped); prio: lower merges first, either
    int64 ranks or floats (turned into dense ranks, ties kept); result: merged id. n_ids: bound on every id (token ids and extra ids).
    For duplicate pairs the first entry wins.
    """

    def __init__(self, left, right, prio, result, n_ids: int):
        self.n_ids = int(max(n_ids, 1))
        prio = np.asarray(prio)
        if prio.dtype.kind == "f" or (prio.size and (prio.min() < 0 or prio.max() >= 2**31)):
            # dense integer ranks (the same order; equal priorities stay equal), int32
            _, rank = np.unique(prio, return_inverse=True)
        else:
            rank = prio
        left = np.ascontiguousarray(left, np.int32)
        size = table_size(left.shape[0])
        self.keys = np.full(size, _EMPTY, np.int64)
        self.rank = np.zeros(size, np.int32)
        self.result = np.zeros(size, np.int32)
        _build_pair_table(left, np.ascontiguousarray(right, np.int32), np.ascontiguousarray(rank, np.int32),
                          np.ascontiguousarray(result, np.int32), np.int64(self.n_ids), self.keys, self.rank,
                          self.result)

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
        if sym.shape[0] and (int(sym.max()) >= self.n_ids or int(sym.min()) < -(2**31 - 1)):
            raise ValueError("merge: symbol id out of range")
        if sym.shape[0] >= 2**31:
            raise ValueError("merge: word too long")
        out = np.empty(sym.shape[0], np.int32)
        out_starts = np.empty(n_words + 1, np.int64)
        maxlen = max(1, int(np.diff(starts).max())) if n_words > 0 else 1
        cap = 3 * maxlen + 4  # n-1 initial pairs + at most 2 per merge
        # cur, prv, nxt: each symbol's id, neighbours; hk: rank << 32 | left symbol, hs: pair table slot
        m = _merge_words(sym, starts, self.keys, self.rank, self.result, np.int64(self.n_ids), out, out_starts,
                         np.empty(maxlen, np.int32), np.empty(maxlen, np.int32), np.empty(maxlen, np.int32),
                         np.empty(cap, np.int64), np.empty(cap, np.int32))
        return out[:m], out_starts


# --- the vocabulary's code points and their hash table (index.TokenIndex), in this file because
# the SPM merge loop inlines cp_find (Numba stamps a cached kernel with its own file only) ---


@njit(cache=True, inline="always")
def _utf8_char(buf, i, end):
    """(code point, byte length) of the character at buf[i] (i < end), strict UTF-8 as Python's
    decoder (Unicode's well-formed sequences: no overlong form, surrogate or value past
    U+10FFFF); (-1, 0) when the bytes at i are not one."""
    b0 = np.int64(buf[i])
    if b0 < 0x80:
        return b0, 1
    if b0 < 0xC2 or b0 > 0xF4:
        return -1, 0
    n = 2 if b0 < 0xE0 else (3 if b0 < 0xF0 else 4)
    if i + n > end:
        return -1, 0
    b1 = np.int64(buf[i + 1])
    lo, hi = 0x80, 0xBF  # the second byte's range (Unicode Table 3-7)
    if b0 == 0xE0:
        lo = 0xA0
    elif b0 == 0xED:
        hi = 0x9F
    elif b0 == 0xF0:
        lo = 0x90
    elif b0 == 0xF4:
        hi = 0x8F
    if b1 < lo or b1 > hi:
        return -1, 0
    cp = (b0 & (0x1F if n == 2 else (0x0F if n == 3 else 0x07))) << 6 | (b1 & 0x3F)
    for k in range(2, n):
        bk = np.int64(buf[i + k])
        if bk < 0x80 or bk > 0xBF:
            return -1, 0
        cp = cp << 6 | (bk & 0x3F)
    return cp, n


@njit(cache=True)
def _code_points(buf, bounds, cps, off):
    """strings_code_points' loop: each string's code points into cps (int32, room for them all),
    where each starts into off (int64 [n + 1]), in one pass; returns how many, or -1 when a
    string is not valid UTF-8."""
    n = bounds.shape[0] - 1
    off[0] = 0
    k = 0
    for t in range(n):
        i = bounds[t]
        end = bounds[t + 1] - 8
        while i < end:
            cp, ln = _utf8_char(buf, i, end)
            if ln == 0:
                return -1
            cps[k] = cp
            k += 1
            i += ln
        off[t + 1] = k
    return k


def strings_code_points(buf, bounds):
    """index.code_points of the strings buf[bounds[i] : bounds[i + 1] - 8] (a GGUF string array, see
    gguf_file.StringArray.raw), each decoded alone as strict UTF-8: (cps int32, off int64 [n + 1],
    ok); ok False (and nothing else meaningful) when one is not valid UTF-8. One compiled pass into
    room for as many code points as the strings have bytes (a copy of what it used when that is
    under 3/4 of it: a vocabulary of multi-byte characters)."""
    n = bounds.shape[0] - 1
    room = max(0, int(bounds[n] - bounds[0]) - 8 * n)  # the strings' bytes
    cps, off = np.empty(room, np.int32), np.empty(n + 1, np.int64)
    total = _code_points(buf, bounds, cps, off)
    if total < 0:
        return np.empty(0, np.int32), off, False
    return (cps[:total] if 4 * total >= 3 * room else cps[:total].copy()), off, True


@njit(cache=True, inline="always")
def _cp_hash(cps, a0, a1):
    h = np.int64(_FNV_BASIS)
    for i in range(a0, a1):
        h = (h ^ cps[i]) * 0x100000001B3  # FNV-1a on code points, wrapping int64
    h ^= h >> 29  # mix the high bits into the low ones the table's mask keeps
    h *= 0x5851F42D4C957F2D
    return h ^ (h >> 31)


@njit(cache=True, inline="always")
def _cp_equal(a, a0, b, b0, n):
    for k in range(n):
        if a[a0 + k] != b[b0 + k]:
            return False
    return True


@njit(cache=True)
def build_cp_table(cps, off, table):
    """Fill table (int32 [table_size(n)], all -1) with string t's id at the slot of its hash or
    the next free one after it; returns the first duplicate (id, id), or (-1, -1)."""
    n = off.shape[0] - 1
    mask = table.shape[0] - 1
    dup_a = -1
    dup_b = -1
    for t in range(n):
        a0 = off[t]
        ln = off[t + 1] - a0
        h = _cp_hash(cps, a0, a0 + ln) & mask
        while True:
            u = table[h]
            if u < 0:
                table[h] = t
                break
            if off[u + 1] - off[u] == ln and _cp_equal(cps, off[u], cps, a0, ln):
                if dup_a < 0:
                    dup_a = u
                    dup_b = t
                break
            h = (h + 1) & mask
    return dup_a, dup_b


@njit(cache=True, inline="always")
def cp_find(table, tok_cps, tok_off, q, q0, q1):
    """The id of the token whose code points are q[q0:q1], or -1 (compiled; inlined)."""
    mask = table.shape[0] - 1
    n = q1 - q0
    h = _cp_hash(q, q0, q1) & mask
    while True:
        t = table[h]
        if t < 0:
            return -1
        t0 = tok_off[t]
        if tok_off[t + 1] - t0 == n and _cp_equal(tok_cps, t0, q, q0, n):
            return t
        h = (h + 1) & mask


@njit(cache=True)
def find_many(table, tok_cps, tok_off, q, q_start, q_end, out):
    """out[k] (int64 [n]) = cp_find of the string q[q_start[k]:q_end[k]] (-1 for an empty one)."""
    for k in range(out.shape[0]):
        a, b = q_start[k], q_end[k]
        out[k] = cp_find(table, tok_cps, tok_off, q, a, b) if b > a else -1


@njit(cache=True, inline="always")
def _spm_try(l, e, s, text, tok_cps, tok_off, table, prio, is_len, hk, hs, hn):
    """llm_tokenizer_spm_session::try_add_bigram: queue the pair of symbols covering word
    characters [l, e) (word start s in text) when their text is a token: key = its score's order
    << 32 | l, payload = e << 32 | its id. Returns the queue's new size."""
    ln = e - l
    if ln >= is_len.shape[0] or not is_len[ln]:
        return hn  # no token has that many characters
    t = cp_find(table, tok_cps, tok_off, text, s + l, s + e)
    if t < 0:
        return hn
    return _push(hk, hs, hn, (np.int64(prio[t]) << 32) | l, (np.int64(e) << 32) | t)


@njit(cache=True)
def _spm_merge_words(text, starts, tok_cps, tok_off, table, prio, is_len, out, out_starts):
    """SentencePiece's merge loop on each word (llm_tokenizer_spm_session::tokenize).

    text: int32 [n] the words' code points, back to back; starts: int64 [n_words + 1] word
    boundaries. tok_cps / tok_off / table: the vocabulary's TokenIndex; prio: int32 [n_vocab]
    each token's queue order (lower first: spm_order of -score); is_len: bool [L], whether some
    token has that many code points (a longer or absent length is not looked up).
    A symbol is a run of the word's characters [i, end[i]), named by its first character i;
    symbols only grow by absorbing their right neighbour, so a queued pair (l, e) is stale exactly
    when l was absorbed or its right neighbour no longer ends at e (llama.cpp: a symbol's n is 0,
    or the two lengths no longer add up to the pair's). The best pair first (lowest order, then
    leftmost), its token replaces the two. Writes each final symbol to out: its token id, or for a
    single character that is not a token -(code point + 1); out_starts: int64 [n_words + 1].
    Returns the number of symbols written.
    """
    n_words = starts.shape[0] - 1
    maxlen = 1
    for w in range(n_words):
        maxlen = max(maxlen, starts[w + 1] - starts[w])
    cur = np.empty(maxlen, np.int32)  # the token of a merged symbol; -1 a single character; -2 absorbed
    end = np.empty(maxlen, np.int64)
    prv = np.empty(maxlen, np.int64)
    nxt = np.empty(maxlen, np.int64)
    cap = 3 * maxlen + 4  # n - 1 initial pairs + at most 2 per merge
    hk = np.empty(cap, np.int64)  # order << 32 | left symbol
    hs = np.empty(cap, np.int64)  # end << 32 | token
    o = 0
    for w in range(n_words):
        s = starts[w]
        n = starts[w + 1] - s
        out_starts[w] = o
        if n == 0:
            continue
        for i in range(n):
            cur[i] = -1
            end[i] = i + 1
            prv[i] = i - 1
            nxt[i] = i + 1
        nxt[n - 1] = -1
        hn = 0
        # Each pair is tried at one place, the loop's end (one copy of the inlined _spm_try: a
        # copy per call site was 0.5 s of the kernel's compile): first the word's adjacent
        # characters left to right, then after each merge its new neighbour pairs, (prev, l)
        # then (l, next), before the next pop. The pair of symbol a ends where its right
        # neighbour ends.
        k, c0, c1 = np.int64(0), np.int64(-1), np.int64(-1)  # see _next_pair
        while True:
            a, k, c0, c1 = _next_pair(k, n, c0, c1)
            if a < 0:
                if hn == 0:
                    break
                l = hk[0] & 0xFFFFFFFF
                e = hs[0] >> 32
                t = np.int32(hs[0] & 0xFFFFFFFF)
                hn = _pop(hk, hs, hn)
                if cur[l] == -2:
                    continue
                r = nxt[l]
                if r < 0 or end[r] != e:
                    continue
                cur[l] = t
                end[l] = e
                cur[r] = -2
                nr = nxt[r]
                nxt[l] = nr
                if nr >= 0:
                    prv[nr] = l
                # then its new neighbour pairs, (prev, l) and (l, next), those that exist, in order
                x, y = prv[l], (l if nr >= 0 else np.int64(-1))
                c0, c1 = (x, y) if x >= 0 else (y, np.int64(-1))
                continue
            hn = _spm_try(a, end[nxt[a]], s, text, tok_cps, tok_off, table, prio, is_len, hk, hs, hn)
        i = 0
        while i >= 0:
            t = cur[i]
            if t < 0:  # a character never merged: a token of its own, or its bytes later
                t = cp_find(table, tok_cps, tok_off, text, s + i, s + i + 1) if is_len.shape[0] > 1 and is_len[1] else -1
                if t < 0:
                    t = -(text[s + i] + 1)
            out[o] = t
            o += 1
            i = nxt[i]
    out_starts[n_words] = o
    return o


def spm_order(scores: np.ndarray) -> np.ndarray:
    """int32 [n]: each token's place in SentencePiece's merge queue, lower first: -score's float32
    bits as an order-preserving int32 (-0 as +0, so equal scores stay equal; NaN after +inf, where
    a sort puts it)."""
    x = -np.asarray(scores, np.float32)
    x[x == 0] = 0  # -0.0 and 0.0 compare equal
    bits = x.view(np.int32)
    key = np.where(bits >= 0, bits, bits ^ np.int32(0x7FFFFFFF))
    key[np.isnan(x)] = np.int32(0x7FFFFFFF)
    return key.astype(np.int32)


def spm_merge_words(text: np.ndarray, starts: np.ndarray, index, prio: np.ndarray, is_len: np.ndarray):
    """Run _spm_merge_words on words given as code points (text int32 [n], starts int64 [n_words +
    1]) with the vocabulary's TokenIndex: (out int32 [m], out_starts int64 [n_words + 1])."""
    out = np.empty(text.shape[0], np.int32)
    out_starts = np.empty(starts.shape[0], np.int64)
    m = _spm_merge_words(text, starts, index.cps, index.offsets, index.table, prio, is_len, out, out_starts)
    return out[:m], out_starts
