"""A grammar's state during generation, with llama.cpp's stack semantics (src/llama-grammar.cpp).

The state is llama.cpp's: a list of stacks (tuples of element positions, the top last), each
ending at a terminal element after ``advance``, plus the partial UTF-8 sequence of the tokens
accepted so far. A token is allowed when some stack can consume its piece (the token's bytes
with special=True, decoded as llama.cpp's decode_utf8 decodes them, partial sequences and its
quirks included); an end-of-generation token only when some stack is empty (the grammar can
end); an empty piece or one starting with a NUL byte never.

Two ways to the same answer:
- ``allows(token)``: one token, the direct transcription of
  llama_grammar_reject_candidates_for_stack (recursive over stacks and code points);
- ``allowed_mask()``: the whole vocabulary at once. The sets of stacks reachable after each
  prefix are interned as states; a vocabulary's token code points form a trie; one Numba pass
  over the trie computes the state at every node from its parent's (transitions between states
  are computed lazily per class of code points that the grammar cannot tell apart, and cached
  for the grammar's lifetime). A token whose piece ends inside a UTF-8 sequence is checked
  against its end state as llama_grammar_match_partial_char does. With a partial sequence
  pending, only tokens starting with a continuation byte can match; they are checked one by one.
  Grammars with token elements (``<[id]>``) are checked token by token (slow on a big
  vocabulary; llama.cpp's own grammars do not use them).
"""

from __future__ import annotations

import weakref

import numpy as np

from ..errors import SynapseError
from .gbnf import (ALT, CHAR, CHAR_ALT, CHAR_ANY, CHAR_NOT, CHAR_RNG_UPPER, END, RULE_REF, TOKEN, TOKEN_NOT,
                   parse_grammar)

__all__ = ["Grammar", "GrammarMatcher", "decode_utf8"]

_LOOKUP = (1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 2, 2, 3, 4)


def decode_utf8(piece: bytes, partial=(0, 0)):
    """llama.cpp's decode_utf8(std::string, partial_start): (code points, (value, n_remain)).

    Reads up to the first NUL byte; continues a pending partial sequence first; n_remain -1
    (and no code points) for an invalid sequence; the last sequence may be partial. The code
    points are those llama.cpp pushes before its terminating 0 (a decoded value 0 included).
    """
    value, n_remain = partial
    cps = []
    i, n = 0, len(piece)
    while i < n and piece[i] != 0 and n_remain > 0:
        b = piece[i]
        if b >> 6 != 2:
            return [], (0, -1)
        value = (value << 6) + (b & 0x3F)
        i += 1
        n_remain -= 1
    if partial[1] > 0 and n_remain == 0:
        cps.append(value)
    while i < n and piece[i] != 0:
        b = piece[i]
        n_remain = _LOOKUP[b >> 4] - 1
        if n_remain < 0:
            return [], (0, n_remain)
        value = b & ((1 << (7 - n_remain)) - 1)
        i += 1
        while i < n and piece[i] != 0 and n_remain > 0:
            value = (value << 6) + (piece[i] & 0x3F)
            i += 1
            n_remain -= 1
        if n_remain == 0:
            cps.append(value)
    return cps, (value, n_remain)


def _until_zero(cps):
    # llama.cpp walks code points until a 0 value (its terminator)
    try:
        return cps[:cps.index(0)]
    except ValueError:
        return cps


class Grammar:
    """A parsed GBNF grammar, flattened for matching (immutable; share it between matchers).

    ``Grammar(text, root="root", tokenizer=None)``: raises SynapseError for a grammar
    llama.cpp refuses (see synapse_nb.grammar.gbnf). ``tokenizer`` resolves ``<text>`` token
    elements. Attributes: ``text``, ``rules`` (lists of (type, value)), ``symbol_ids``.
    """

    def __init__(self, text: str, root: str = "root", tokenizer=None):
        tok = None if tokenizer is None else \
            (lambda s: tokenizer.tokenize(s, add_special=False, parse_special=True))
        self.text = text
        self.rules, self.symbol_ids, self.root_id = parse_grammar(text, root, tok)
        T, V, start = [], [], []
        for rule in self.rules:
            start.append(len(T))
            for typ, val in rule:
                T.append(typ)
                V.append(val)
        self._T, self._V, self._start = T, V, start
        self.has_tokens = any(t in (TOKEN, TOKEN_NOT) for t in T)
        # code point classes: the grammar cannot tell apart two code points of one class
        b = {0}
        for typ, val in zip(T, V):
            if typ in (CHAR, CHAR_NOT, CHAR_ALT):
                b.update((val, val + 1))
            elif typ == CHAR_RNG_UPPER:
                b.add(val + 1)
        self._bounds = np.array(sorted(x for x in b if 0 < x < 2**32), dtype=np.int64)
        self._advance_cache: dict = {}
        self._states: list = []          # state id -> frozenset of stacks
        self._state_ids: dict = {}
        self._trans = np.full((16, len(self._bounds) + 1), -2, dtype=np.int32)
        self._partial_ok: dict = {}
        self._vocab_cls = weakref.WeakKeyDictionary()
        # initial stacks (llama_grammar_init_impl): one per alternative of the root rule
        stacks: list = []
        for pos in self._alternatives(start[self.root_id]):
            for s in self.advance(() if self._eos(pos) else (pos,)):
                if s not in stacks:
                    stacks.append(s)
        self.initial_stacks = tuple(stacks)

    def __repr__(self) -> str:
        return f"Grammar({len(self.rules)} rules)"

    # -- llama.cpp's primitives -----------------------------------------------------------
    def _eos(self, pos: int) -> bool:
        t = self._T[pos]
        return t == END or t == ALT

    def _alternatives(self, pos: int):
        """The first element of each alternative of the rule whose elements start at pos."""
        while True:
            yield pos
            while not self._eos(pos):
                pos += 1
            if self._T[pos] != ALT:
                return
            pos += 1

    def advance(self, stack: tuple) -> tuple:
        """llama_grammar_advance_stack: the stacks ``stack`` expands to, each topped by a
        terminal (or empty)."""
        hit = self._advance_cache.get(stack)
        if hit is not None:
            return hit
        T, V, start = self._T, self._V, self._start
        todo = [stack]
        seen = set()
        out: list = []
        while todo:
            cur = todo.pop()
            if cur in seen:
                continue
            seen.add(cur)
            if not cur:
                if cur not in out:
                    out.append(cur)
                continue
            pos = cur[-1]
            typ = T[pos]
            if typ == RULE_REF:
                base = cur[:-1] if self._eos(pos + 1) else cur[:-1] + (pos + 1,)
                for sub in self._alternatives(start[V[pos]]):
                    todo.append(base if self._eos(sub) else base + (sub,))
            elif typ in (CHAR, CHAR_NOT, CHAR_ANY, TOKEN, TOKEN_NOT):
                if cur not in out:
                    out.append(cur)
            else:  # pragma: no cover - a stack never rests on END/ALT/CHAR_ALT/CHAR_RNG_UPPER
                raise SynapseError("grammar: internal error (stack on a non-terminal element)")
        res = tuple(out)
        self._advance_cache[stack] = res
        return res

    def match_char(self, pos: int, chr_: int):
        """llama_grammar_match_char: (matches, position after the character class)."""
        T, V = self._T, self._V
        found = False
        positive = T[pos] == CHAR or T[pos] == CHAR_ANY
        while True:
            if T[pos + 1] == CHAR_RNG_UPPER:
                found = found or (V[pos] <= chr_ <= V[pos + 1])
                pos += 2
            elif T[pos] == CHAR_ANY:
                found = True
                pos += 1
            else:
                found = found or V[pos] == chr_
                pos += 1
            if T[pos] != CHAR_ALT:
                break
        return found == positive, pos

    def match_partial_char(self, pos: int, partial) -> bool:
        """llama_grammar_match_partial_char: can some completion of the partial sequence match?"""
        T, V = self._T, self._V
        value, n_remain = partial
        positive = T[pos] == CHAR or T[pos] == CHAR_ANY
        if n_remain < 0 or (n_remain == 1 and value < 2):
            return False
        low = (value << (n_remain * 6)) & 0xFFFFFFFF
        high = low | ((1 << (n_remain * 6)) - 1)
        if low == 0:
            if n_remain == 2:
                low = 1 << 11
            elif n_remain == 3:
                low = 1 << 16
        while True:
            if T[pos + 1] == CHAR_RNG_UPPER:
                if V[pos] <= high and low <= V[pos + 1]:
                    return positive
                pos += 2
            elif T[pos] == CHAR_ANY:
                return True
            else:
                if low <= V[pos] <= high:
                    return positive
                pos += 1
            if T[pos] != CHAR_ALT:
                break
        return not positive

    def _after(self, stack: tuple, pos_after: int) -> tuple:
        return stack[:-1] if self._eos(pos_after) else stack[:-1] + (pos_after,)

    # -- states (sets of stacks) and their transitions -------------------------------------
    def state_id(self, stacks) -> int:
        key = frozenset(stacks)
        if not key:
            return -1
        sid = self._state_ids.get(key)
        if sid is None:
            sid = len(self._states)
            self._states.append(key)
            self._state_ids[key] = sid
            if sid >= self._trans.shape[0]:
                grown = np.full((2 * self._trans.shape[0], self._trans.shape[1]), -2, dtype=np.int32)
                grown[:self._trans.shape[0]] = self._trans
                self._trans = grown
        return sid

    def step_char(self, stacks, c: int) -> list:
        """The stacks after code point c from each of stacks (llama_grammar_advance_stack after
        llama_grammar_match_char, as llama_grammar_accept does per character): a list without
        repeats, in first-seen order; stacks that are empty or at a token element drop out."""
        T = self._T
        out: list = []
        for st in stacks:
            if not st:
                continue
            pos = st[-1]
            if T[pos] == TOKEN or T[pos] == TOKEN_NOT:
                continue
            ok, after = self.match_char(pos, c)
            if ok:
                for s in self.advance(self._after(st, after)):
                    if s not in out:
                        out.append(s)
        return out

    def _rep(self, cls: int) -> int:
        return 0 if cls == 0 else int(self._bounds[cls - 1])

    def code_class(self, cp: int) -> int:
        return int(np.searchsorted(self._bounds, cp, side="right"))

    def transition(self, sid: int, cls: int) -> int:
        """The state after one code point of class ``cls`` from state ``sid`` (-1: none)."""
        t = int(self._trans[sid, cls])
        if t != -2:
            return t
        t = self.state_id(self.step_char(self._states[sid], self._rep(cls)))
        self._trans[sid, cls] = t
        return t

    def partial_ok(self, sid: int, partial) -> bool:
        key = (sid, partial)
        hit = self._partial_ok.get(key)
        if hit is None:
            T = self._T
            hit = any(st and T[st[-1]] not in (TOKEN, TOKEN_NOT) and self.match_partial_char(st[-1], partial)
                      for st in self._states[sid])
            self._partial_ok[key] = hit
        return hit


class _VocabIndex:
    """Per vocabulary (built once per tokenizer): pieces, decoded code points as a trie."""

    def __init__(self, tokenizer):
        n = tokenizer.n_vocab
        self.n_vocab = n
        eog = np.zeros(n, dtype=bool)
        for t in tokenizer.eog_ids:
            if 0 <= t < n:
                eog[t] = True
        self.eog = eog
        self.pieces = [tokenizer.token_to_piece(t, special=True) for t in range(n)]
        end_node = np.full(n, -1, dtype=np.int32)
        part_key = np.full(n, -1, dtype=np.int32)
        partials: dict = {}
        parent = [0]
        node_cp = [0]
        children: dict = {}
        cont_first = []
        for t, piece in enumerate(self.pieces):
            if eog[t] or not piece or piece[0] == 0:
                continue
            if 0x80 <= piece[0] <= 0xBF:
                cont_first.append(t)
            try:  # valid UTF-8 without NUL: llama.cpp's decoder gives the standard code points
                if 0 in piece:
                    raise UnicodeDecodeError("utf-8", piece, 0, 1, "NUL")
                cps, part = [ord(c) for c in piece.decode("utf-8")], (0, 0)
            except UnicodeDecodeError:
                cps, part = decode_utf8(piece)
            if part[1] < 0:
                continue  # invalid: rejected by every stack
            node = 0
            for cp in _until_zero(cps):
                key = (node, cp)
                nxt = children.get(key)
                if nxt is None:
                    nxt = len(parent)
                    children[key] = nxt
                    parent.append(node)
                    node_cp.append(cp)
                node = nxt
            end_node[t] = node
            if part[1] != 0:
                part_key[t] = partials.setdefault(part, len(partials))
        self.end_node = end_node
        self.part_key = part_key
        self.partials = list(partials)
        self.parent = np.array(parent, dtype=np.int32)
        self.node_cp = np.array(node_cp, dtype=np.int64)
        self.cont_first = np.array(cont_first, dtype=np.int64)
        self.partial_tokens = np.flatnonzero(part_key >= 0)


_VOCABS = weakref.WeakKeyDictionary()


def _vocab_index(tokenizer) -> _VocabIndex:
    v = _VOCABS.get(tokenizer)
    if v is None:
        v = _VOCABS[tokenizer] = _VocabIndex(tokenizer)
    return v


class GrammarMatcher:
    """llama.cpp's grammar sampler state for one generation: which tokens the grammar allows
    next, and accepting the chosen one.

    ``GrammarMatcher(grammar, tokenizer)``: grammar a Grammar or GBNF text; tokenizer the
    model's (synapse_nb Tokenizer: token_to_piece, eog_ids, n_vocab).

    - ``allows(token)``: whether the grammar allows ``token`` now;
    - ``allowed_mask()``: bool [n_vocab], the tokens allowed now (llama_grammar_apply_impl);
    - ``accept(token)``: advance (llama_grammar_accept_impl); SynapseError if not allowed;
    - ``can_end``: the grammar is complete here (an end-of-generation token is allowed);
    - ``reset()``: back to the start (as llama_sampler_reset on the grammar sampler).
    """

    def __init__(self, grammar, tokenizer):
        if isinstance(grammar, str):
            grammar = Grammar(grammar, tokenizer=tokenizer)
        if not isinstance(grammar, Grammar):
            raise SynapseError(f"grammar: expected a Grammar or GBNF text, got {type(grammar).__name__}")
        self.grammar = grammar
        self.tokenizer = tokenizer
        self._v = _vocab_index(tokenizer)
        self.reset()

    def reset(self) -> None:
        self.stacks = list(self.grammar.initial_stacks)
        self.partial = (0, 0)

    def clone(self) -> "GrammarMatcher":
        c = object.__new__(GrammarMatcher)
        c.grammar, c.tokenizer, c._v = self.grammar, self.tokenizer, self._v
        c.stacks, c.partial = list(self.stacks), self.partial
        return c

    @property
    def can_end(self) -> bool:
        return any(not s for s in self.stacks)

    # -- one token: the reference transcription --------------------------------------------
    def allows(self, token: int) -> bool:
        token = int(token)
        v = self._v
        if not 0 <= token < v.n_vocab:
            raise SynapseError(f"grammar: token id {token} is outside the vocabulary [0, {v.n_vocab})")
        if v.eog[token]:
            return self.can_end
        piece = v.pieces[token]
        if not piece or piece[0] == 0:
            return False
        cps, part = decode_utf8(piece, self.partial)
        cps = _until_zero(cps)
        return any(self._stack_accepts(st, cps, 0, part, token) for st in self.stacks)

    def _stack_accepts(self, stack, cps, i, part, token) -> bool:
        """Not rejected by llama_grammar_reject_candidates_for_stack(stack) from code point i."""
        g = self.grammar
        if not stack:
            return i == len(cps) and part[1] == 0
        pos = stack[-1]
        typ = g._T[pos]
        if typ == TOKEN or typ == TOKEN_NOT:
            if i == len(cps):
                return part[1] == 0
            return (g._V[pos] == token) == (typ == TOKEN)
        if i == len(cps):
            return part[1] == 0 or g.match_partial_char(pos, part)
        ok, after = g.match_char(pos, cps[i])
        if not ok:
            return False
        return any(self._stack_accepts(s, cps, i + 1, part, token) for s in g.advance(g._after(stack, after)))

    # -- the whole vocabulary -------------------------------------------------------------
    def allowed_mask(self) -> np.ndarray:
        v, g = self._v, self.grammar
        mask = np.zeros(v.n_vocab, dtype=bool)
        mask[v.eog] = self.can_end
        if self.partial[1] > 0:  # only a continuation byte can come next
            for t in v.cont_first:
                mask[t] = self.allows(int(t))
            return mask
        if g.has_tokens:
            for t in range(v.n_vocab):
                if not v.eog[t]:
                    mask[t] = self.allows(t)
            return mask
        states = self._node_states()
        tok_state = np.empty(v.n_vocab, dtype=np.int32)
        from ._walk import gather

        gather(states, v.end_node, tok_state)
        complete = v.part_key < 0
        mask |= complete & (tok_state >= 0)
        pt = v.partial_tokens
        if pt.size:
            sts = tok_state[pt]
            live = sts >= 0
            for t, sid in zip(pt[live].tolist(), sts[live].tolist()):
                mask[t] = g.partial_ok(sid, v.partials[v.part_key[t]])
        return mask

    def _node_states(self) -> np.ndarray:
        from ._walk import walk

        v, g = self._v, self.grammar
        cls = g._vocab_cls.get(self.tokenizer)
        if cls is None:
            cls = np.searchsorted(g._bounds, v.node_cp, side="right").astype(np.int32)
            g._vocab_cls[self.tokenizer] = cls
        root = g.state_id(self.stacks)
        node_state = np.empty(v.parent.shape[0], dtype=np.int32)
        miss_s = np.empty(4096, dtype=np.int32)
        miss_c = np.empty(4096, dtype=np.int32)
        while True:
            trans = g._trans
            pending = np.zeros(trans.shape, dtype=np.uint8)
            n_unknown, n_miss = walk(v.parent, cls, trans, root, node_state, pending, miss_s, miss_c)
            if n_unknown == 0:
                return node_state
            for s, c in zip(miss_s[:n_miss].tolist(), miss_c[:n_miss].tolist()):
                g.transition(s, c)

    # -- accept ---------------------------------------------------------------------------
    def accept(self, token: int) -> None:
        """llama_grammar_accept_impl: advance every stack over the token's code points."""
        token = int(token)
        v, g = self._v, self.grammar
        if not 0 <= token < v.n_vocab:
            raise SynapseError(f"grammar: token id {token} is outside the vocabulary [0, {v.n_vocab})")
        if v.eog[token]:
            if self.can_end:
                return
            raise SynapseError(f"grammar: end-of-generation token {token} where the grammar cannot end")
        piece = v.pieces[token]
        cps, part = decode_utf8(piece, self.partial)
        T, V = g._T, g._V
        new: list = []
        for st in self.stacks:
            if not st:
                continue
            pos = st[-1]
            if T[pos] == TOKEN or T[pos] == TOKEN_NOT:
                if (V[pos] == token) == (T[pos] == TOKEN):
                    for s in g.advance(st[:-1] if g._eos(pos + 1) else st[:-1] + (pos + 1,)):
                        if s not in new:
                            new.append(s)
                continue
            cur = [st]
            for c in cps:
                cur = g.step_char(cur, c)
                if not cur:
                    break
            for s in cur:
                if s not in new:
                    new.append(s)
        if not new:
            raise SynapseError(f"grammar: token {token} ({piece!r}) is not allowed by the grammar here")
        self.stacks = new
        self.partial = part
