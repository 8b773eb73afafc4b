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

import re

import numpy as np
from numba import njit

from ..gguf_file import StringArray

_EMPTY = -1
_FNV_BASIS = -3750763034362895579  # FNV-1a's 64-bit offset basis as an int64: the seed of every string hash
_ESCAPED = re.compile("[\udc80-\udcff]")  # invalid bytes kept by the GGUF reader


@njit(cache=True, inline="always")
def _hash(key):
    key ^= key >> 29
    key *= 0x5851F42D4C957F2D  # wraps around, as int64 arithmetic does in Numba
    return key ^ (key >> 31)


@njit(cache=True)
def _build_pair_table(left, right, prio, result, n_ids):
    # prio: int32 ranks >= 0 (lower merges first). A slot holds its pair as the key
    # left * n_ids + right (both ids in [0, n_ids)), its rank and its merged id.
    n = left.shape[0]
    size = 16
    while size < 2 * n + 2:
        size *= 2
    keys = np.full(size, _EMPTY, np.int64)
    trank = np.zeros(size, np.int32)
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
                trank[h] = prio[i]
                tres[h] = result[i]
                break
            if k == key:  # first one wins (llama.cpp: bpe_ranks.emplace keeps the lowest rank)
                break
            h = (h + 1) & mask
    return keys, trank, tres


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


@njit(cache=True)
def _merge_words(sym, starts, keys, trank, tres, n_ids, out, out_starts):
    """Merge the symbols of each word.

    sym: int32 [n] initial symbol ids of all words, concatenated.
    starts: int64 [n_words + 1] word boundaries in sym.
    keys/trank/tres: the pair table (key = left id * n_ids + right id, rank, merged id).
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
    cap = 3 * maxlen + 4  # n-1 initial pairs + at most 2 per merge
    hk = np.empty(cap, np.int64)  # rank << 32 | left symbol index
    hs = np.empty(cap, np.int32)  # pair table slot
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
        # seed the queue with every adjacent pair that has a merge
        for i in range(n - 1):
            slot = _find(keys, n_ids, cur[i], cur[i + 1])
            if slot >= 0:
                hn = _push(hk, hs, hn, (np.int64(trank[slot]) << 32) | i, slot)
        while hn > 0:
            l = np.int32(hk[0] & 0xFFFFFFFF)
            slot = hs[0]
            hn = _pop(hk, hs, hn)
            # stale: the left symbol was merged away or changed, or its right neighbour
            # is not the one queued (cur == -2 marks merged-away symbols; a pair of ids >= 0
            # is the slot's pair exactly when it gives the slot's key)
            a = cur[l]
            r = nxt[l]
            if a < 0 or r < 0:
                continue
            b = cur[r]
            if b < 0 or np.int64(a) * n_ids + b != keys[slot]:
                continue
            cur[l] = tres[slot]
            cur[r] = -2
            nr = nxt[r]
            nxt[l] = nr
            if nr >= 0:
                prv[nr] = l
            # queue the new neighbour pairs: (prev, l) and (l, next)
            x = prv[l]
            if x >= 0:
                slot2 = _find(keys, n_ids, cur[x], cur[l])
                if slot2 >= 0:
                    hn = _push(hk, hs, hn, (np.int64(trank[slot2]) << 32) | x, slot2)
            if nr >= 0:
                slot2 = _find(keys, n_ids, cur[l], cur[nr])
                if slot2 >= 0:
                    hn = _push(hk, hs, hn, (np.int64(trank[slot2]) << 32) | l, slot2)
        i = 0
        while i >= 0:
            out[o] = cur[i]
            o += 1
            i = nxt[i]
    out_starts[n_words] = o
    return o


@njit(cache=True, inline="always")
def _fnv(buf, a0, a1, h):
    for i in range(a0, a1):
        h = (h ^ buf[i]) * 0x100000001B3  # FNV-1a, wrapping int64
    return h


@njit(cache=True, inline="always")
def _bytes_at(tok_buf, j, buf, i0, i1):
    # buf[i0:i1] == tok_buf[j:j + i1 - i0]
    for i in range(i0, i1):
        if tok_buf[j] != buf[i]:
            return False
        j += 1
    return True


@njit(cache=True, inline="always")
def _token_table(tok_buf, tok_off):
    """(table, mask): an open-addressing hash table of the token ids, by FNV-1a of each token's
    bytes tok_buf[tok_off[t]:tok_off[t + 1]], linear probing; at least twice the tokens' count."""
    n_tok = tok_off.shape[0] - 1
    size = 16
    while size < 2 * n_tok + 2:
        size *= 2
    mask = size - 1
    table = np.full(size, -1, np.int32)
    for t in range(n_tok):
        h = _fnv(tok_buf, tok_off[t], tok_off[t + 1], np.int64(_FNV_BASIS)) & mask
        while table[h] >= 0:
            h = (h + 1) & mask
        table[h] = t
    return table, mask


@njit(cache=True)
def _string_ids(tok_buf, tok_off, buf, off, sep):
    """Token ids of byte strings, by hashing: for string k = buf[off[k]:off[k+1]]:
    if sep: split it at the first space after its first byte (llama.cpp word.find(' ', 1))
    into left and right and look up left, right and left+right; else look up the string.
    Returns int32 [n, 3] (left, right, joined ids; -1 when not a token; a string without
    the space gives -2 in every column)."""
    table, mask = _token_table(tok_buf, tok_off)
    seed = np.int64(_FNV_BASIS)
    n = off.shape[0] - 1
    res = np.full((n, 3), -1, np.int32)
    for k in range(n):
        a0 = off[k]
        a1 = off[k + 1]
        p = -1
        if sep:
            for i in range(a0 + 1, a1):
                if buf[i] == 32:
                    p = i
                    break
            if p < 0:
                res[k, 0] = -2
                res[k, 1] = -2
                res[k, 2] = -2
                continue
            parts = ((a0, p, p, p), (p + 1, a1, a1, a1), (a0, p, p + 1, a1))
        else:
            parts = ((a0, a1, a1, a1), (a1, a1, a1, a1), (a1, a1, a1, a1))
        for c in range(3):
            x0, x1, y0, y1 = parts[c]
            ln = (x1 - x0) + (y1 - y0)
            if ln == 0:
                continue
            h = _fnv(buf, y0, y1, _fnv(buf, x0, x1, seed)) & mask
            while True:
                t = table[h]
                if t < 0:
                    break
                t0 = tok_off[t]
                if (tok_off[t + 1] - t0 == ln and _bytes_at(tok_buf, t0, buf, x0, x1)
                        and _bytes_at(tok_buf, t0 + (x1 - x0), buf, y0, y1)):
                    res[k, c] = t
                    break
                h = (h + 1) & mask
    return res


def utf8_buffer(strs) -> tuple[np.ndarray, np.ndarray]:
    """All strings as one UTF-8 byte buffer and their byte offsets (int64 [n + 1]).
    Surrogate escapes (invalid bytes kept by the GGUF reader) become their byte.
    strs: a list of str, or a gguf_file.StringArray (its bytes are read from the file as they are)."""
    if isinstance(strs, StringArray):
        return strs.utf8()
    joined = "".join(strs)
    buf = np.frombuffer(joined.encode("utf-8", "surrogateescape"), np.uint8)
    coff = np.zeros(len(strs) + 1, np.int64)
    np.cumsum(np.fromiter(map(len, strs), np.int64, len(strs)), out=coff[1:])
    if joined.isascii():
        return buf, coff
    if not _ESCAPED.search(joined):
        # valid UTF-8: characters start at the bytes that are not continuation bytes
        char_starts = np.flatnonzero((buf & 0xC0) != 0x80)
        return buf, np.append(char_starts, buf.shape[0])[coff]
    cps = np.frombuffer(joined.encode("utf-32-le", "surrogatepass"), np.uint32)
    blen = (1 + (cps >= 0x80).astype(np.int64) + (cps >= 0x800) + (cps >= 0x10000)
            - 2 * ((cps >= 0xDC80) & (cps <= 0xDCFF)))
    boff = np.zeros(cps.shape[0] + 1, np.int64)
    np.cumsum(blen, out=boff[1:])
    if boff[-1] != buf.shape[0]:
        raise ValueError("utf8_buffer: string is not encodable")
    return buf, boff[coff]


def merge_part_ids(tokens: list[str], merges: list[str]) -> np.ndarray:
    """For each merge "left right": token ids of left, right and left+right (-1 if not a
    token; -2 for a merge without a space after its first character). int32 [n, 3]."""
    tb, to = utf8_buffer(tokens)
    mb, mo = utf8_buffer(merges)
    return _string_ids(tb, to, mb, mo, True)


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
        self.keys, self.rank, self.result = _build_pair_table(
            np.ascontiguousarray(left, np.int32),
            np.ascontiguousarray(right, np.int32),
            np.ascontiguousarray(rank, np.int32),
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
        if sym.shape[0] and (int(sym.max()) >= self.n_ids or int(sym.min()) < -(2**31 - 1)):
            raise ValueError("merge: symbol id out of range")
        if sym.shape[0] >= 2**31:
            raise ValueError("merge: word too long")
        out = np.empty(sym.shape[0], np.int32)
        out_starts = np.empty(n_words + 1, np.int64)
        m = _merge_words(sym, starts, self.keys, self.rank, self.result, np.int64(self.n_ids), out, out_starts)
        return out[:m], out_starts


@njit(cache=True, inline="always")
def _token_at(table, mask, tok_buf, tok_off, buf, x0, x1):
    """Id of the token whose bytes are buf[x0:x1] in _string_ids' table, or -1."""
    h = _fnv(buf, x0, x1, np.int64(_FNV_BASIS)) & mask
    while True:
        t = table[h]
        if t < 0:
            return -1
        t0 = tok_off[t]
        if tok_off[t + 1] - t0 == x1 - x0 and _bytes_at(tok_buf, t0, buf, x0, x1):
            return t
        h = (h + 1) & mask


@njit(cache=True, inline="always")
def _code_point(buf, x0, x1):
    """The code point of the one UTF-8 character buf[x0:x1] (valid UTF-8)."""
    b = np.int64(buf[x0])
    if x1 - x0 == 1:
        return b
    if x1 - x0 == 2:
        return ((b & 0x1F) << 6) | (buf[x0 + 1] & 0x3F)
    if x1 - x0 == 3:
        return ((b & 0x0F) << 12) | ((buf[x0 + 1] & 0x3F) << 6) | (buf[x0 + 2] & 0x3F)
    return ((b & 0x07) << 18) | ((buf[x0 + 1] & 0x3F) << 12) | ((buf[x0 + 2] & 0x3F) << 6) | (buf[x0 + 3] & 0x3F)


@njit(cache=True, inline="always")
def _part(table, mask, tok_buf, tok_off, x0, x1, single, extra_of, extra_cps, n_extra):
    """Id of the part tok_buf[x0:x1] of a piece: a token's id; else, when it is one character
    (single), that character's extra id (made on first sight, after the n_tok token ids: n_extra[0]
    made so far, their code points in extra_cps); else -1."""
    i = _token_at(table, mask, tok_buf, tok_off, tok_buf, x0, x1)
    if i >= 0 or not single:
        return i
    cp = _code_point(tok_buf, x0, x1)
    if extra_of[cp] < 0:
        extra_of[cp] = tok_off.shape[0] - 1 + n_extra[0]
        extra_cps[n_extra[0]] = cp
        n_extra[0] += 1
    return extra_of[cp]


@njit(cache=True)
def _byte_offsets(buf, n_chars):
    """Byte offsets (int64 [n + 1]) of n strings of n_chars characters each, back to back in the
    valid UTF-8 buf (utf8_buffer's offsets without its whole-text index arrays)."""
    off = np.empty(n_chars.shape[0] + 1, np.int64)
    off[0] = 0
    i = 0
    for t in range(n_chars.shape[0]):
        c = 0
        while c < n_chars[t]:  # step over one character: its lead byte and continuation bytes
            i += 1
            while i < buf.shape[0] and (buf[i] & 0xC0) == 0x80:
                i += 1
            c += 1
        off[t + 1] = i
    return off


@njit(cache=True)
def _spm_pairs(tok_buf, tok_off, is_len):
    """spm_pairs' work (see there): returns (left, right, result, extra code points in id order)."""
    n_tok = tok_off.shape[0] - 1
    table, mask = _token_table(tok_buf, tok_off)
    # a token's characters start at its bytes that are not continuation bytes (valid UTF-8)
    cap = 0  # the splits looked up (a bound on the pairs): memory in what is found, not in the text's size
    longest = 0
    for t in range(n_tok):
        n_t = 0
        for i in range(tok_off[t], tok_off[t + 1]):
            if (tok_buf[i] & 0xC0) != 0x80:
                n_t += 1
        longest = max(longest, n_t)
        if n_t <= 64:
            cap += max(n_t - 1, 0)
        else:
            for k in range(1, n_t):
                if is_len[k] and is_len[n_t - k]:
                    cap += 1
    left = np.empty(cap, np.int32)
    right = np.empty(cap, np.int32)
    result = np.empty(cap, np.int32)
    extra_of = np.full(0x110000, -1, np.int32)
    extra_cps = np.empty(2 * cap + 1, np.int32)  # at most two new characters a split
    n_extra = np.zeros(1, np.int64)  # extra ids made so far
    m = 0
    starts = np.empty(longest + 1, np.int64)  # byte offsets of one token's characters
    for t in range(n_tok):
        b0, b1 = tok_off[t], tok_off[t + 1]
        n_t = 0
        for i in range(b0, b1):
            if (tok_buf[i] & 0xC0) != 0x80:
                starts[n_t] = i
                n_t += 1
        for k in range(1, n_t):
            if n_t > 64 and not (is_len[k] and is_len[n_t - k]):
                continue
            p = starts[k]
            a = _part(table, mask, tok_buf, tok_off, b0, p, k == 1, extra_of, extra_cps, n_extra)
            if a < 0:
                continue
            b = _part(table, mask, tok_buf, tok_off, p, b1, n_t - k == 1, extra_of, extra_cps, n_extra)
            if b < 0:
                continue
            left[m] = a
            right[m] = b
            result[m] = t
            m += 1
    return left[:m], right[:m], result[:m], extra_cps[:n_extra[0]]


def spm_pairs(tokens: list[str]):
    """Every merge a SentencePiece vocabulary allows, as SPM (tokenizer/spm.py) tabulates them:
    for each token t (in id order) and each split of it after k characters (k increasing; for
    a token over 64 characters only where k and len(t) - k are lengths some token has, or 1)
    into two parts that are each a token or one character, the pair (part ids, t). A character
    that is not a token gets an extra id, len(tokens) + the order in which it is first seen (a
    first part before a second). Returns (left, right, result: int32 [m], extra characters in
    id order: list of str), or None when a token holds an invalid byte (an escape of the GGUF
    reader: the caller's character-by-character path handles those)."""
    joined = "".join(tokens)
    if _ESCAPED.search(joined):
        return None
    try:
        buf = np.frombuffer(joined.encode("utf-8"), np.uint8)
    except UnicodeEncodeError:  # another lone surrogate: the character path
        return None
    lens = np.fromiter(map(len, tokens), np.int64, len(tokens))
    is_len = np.zeros(int(lens.max(initial=0)) + 2, np.bool_)
    is_len[lens] = True
    is_len[1] = True
    left, right, result, cps = _spm_pairs(buf, _byte_offsets(buf, lens), is_len)
    return left, right, result, [chr(cp) for cp in cps.tolist()]
