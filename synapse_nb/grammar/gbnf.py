"""GBNF parsing as llama.cpp's src/llama-grammar.cpp parses it (llama_grammar_parser).

The grammar text is read as UTF-8 bytes, with llama.cpp's syntax: ``name ::= alternatives``
rules, ``|`` alternatives, ``( )`` groups, ``"..."`` literals, ``[...]`` / ``[^...]`` character
classes with ranges, ``.`` any character, ``*`` ``+`` ``?`` ``{m}`` ``{m,}`` ``{m,n}``
repetitions (rewritten into generated rules exactly as llama.cpp does, so that rule ids and
stacks match), escapes ``\\x.. \\u.... \\U........ \\t \\r \\n \\\\ \\" \\[ \\] \\-``, ``#``
comments, and token elements ``<[id]>`` / ``!<[id]>`` / ``<text>``.

Refusals are llama.cpp's: syntax errors, undefined rules, a missing ``root``, left recursion,
too many repetitions; each a one-line SynapseError naming the rule or the position (line and
column of the grammar text).
"""

from __future__ import annotations

from ..errors import SynapseError

# llama_gretype
END, ALT, RULE_REF, CHAR, CHAR_NOT, CHAR_RNG_UPPER, CHAR_ALT, CHAR_ANY, TOKEN, TOKEN_NOT = range(10)

MAX_REPETITION_THRESHOLD = 2000
_U64_MAX = (1 << 64) - 1

_HEX = {**{c: c - 48 for c in range(48, 58)}, **{c: c - 87 for c in range(97, 103)},
        **{c: c - 55 for c in range(65, 71)}}


def _is_digit(c: int) -> bool:
    return 48 <= c <= 57


def _is_word(c: int) -> bool:
    return 97 <= c <= 122 or 65 <= c <= 90 or c == 45 or 48 <= c <= 57


class _Fail(Exception):
    def __init__(self, msg, pos=None):
        super().__init__(msg)
        self.pos = pos


class GbnfParser:
    """llama_grammar_parser: symbol_ids (name -> id, in first-seen order) and rules (id ->
    list of (type, value), each ending with END). ``tokenize`` (text -> ids), if given, resolves
    ``<text>`` token elements (else they are refused, as llama.cpp without a vocabulary)."""

    def __init__(self, tokenize=None):
        self.symbol_ids: dict[str, int] = {}
        self.rules: list[list] = []
        self._tokenize = tokenize

    # -- helpers over the NUL-terminated byte string ---------------------------------------
    def _space(self, pos: int, newline_ok: bool) -> int:
        s = self.src
        while True:
            c = s[pos]
            if c == 32 or c == 9 or (newline_ok and (c == 13 or c == 10)):
                pos += 1
            elif c == 35:  # '#': to the end of the line
                while s[pos] and s[pos] != 13 and s[pos] != 10:
                    pos += 1
            else:
                return pos

    def _name(self, pos: int) -> int:
        s = self.src
        end = pos
        while _is_word(s[end]):
            end += 1
        if end == pos:
            raise _Fail("expecting name", pos)
        return end

    def _int(self, pos: int) -> int:
        end = pos
        while _is_digit(self.src[end]):
            end += 1
        if end == pos:
            raise _Fail("expecting integer", pos)
        return end

    def _hex(self, pos: int, size: int):
        s = self.src
        value, p, end = 0, pos, pos + size
        while p < end and s[p]:
            d = _HEX.get(s[p])
            if d is None:
                break
            value = (value << 4) + d
            p += 1
        if p != end:
            raise _Fail(f"expecting {size} hex chars", pos)
        return value, p

    def _char_in(self, pos: int):
        """_char inside a literal or a class, whose closer has not come yet: the end of the
        source there is parse_sequence's "unexpected end of input"."""
        if not self.src[pos]:
            raise _Fail("unexpected end of input", pos)
        return self._char(pos)

    def _char(self, pos: int):
        s = self.src
        c = s[pos]
        if c == 92:  # backslash
            e = s[pos + 1]
            if e == 120:  # x
                return self._hex(pos + 2, 2)
            if e == 117:  # u
                return self._hex(pos + 2, 4)
            if e == 85:  # U
                return self._hex(pos + 2, 8)
            if e == 116:
                return 9, pos + 2
            if e == 114:
                return 13, pos + 2
            if e == 110:
                return 10, pos + 2
            if e in (92, 34, 91, 93, 45):
                return e, pos + 2
            raise _Fail("unknown escape", pos)
        if c:
            # decode_utf8(const char *): length from the high bits, value masked, stops at NUL
            n = (1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4)[c >> 4]
            value = c & ((1 << (8 - n)) - 1)
            p = pos + 1
            while p < pos + n and s[p]:
                value = (value << 6) + (s[p] & 0x3F)
                p += 1
            return value, p
        raise _Fail("unexpected end of input", pos)

    def _token(self, pos: int):
        s = self.src
        start = pos
        if s[pos] != 60:
            raise _Fail("expecting '<'", pos)
        pos += 1
        if s[pos] == 91:  # <[id]>
            pos += 1
            end = self._int(pos)
            tid = int(self.src[pos:end])
            pos = end
            if s[pos] != 93:
                raise _Fail("expecting ']'", pos)
            pos += 1
            if s[pos] != 62:
                raise _Fail("expecting '>'", pos)
            return tid & 0xFFFFFFFF, pos + 1
        if self._tokenize is None:
            raise _Fail("no vocab to parse token", start)
        while s[pos] and s[pos] != 62:
            pos += 1
        if s[pos] != 62:
            raise _Fail("expecting '>'", pos)
        pos += 1
        text = bytes(self.src[start:pos]).decode("utf-8", "replace")
        ids = self._tokenize(text)
        if len(ids) != 1:
            raise _Fail(f"invalid token '{text}'", start)
        return ids[0], pos

    # -- symbols and rules --------------------------------------------------------------
    def _symbol(self, name: str) -> int:
        return self.symbol_ids.setdefault(name, len(self.symbol_ids))

    def _generate_symbol(self, base: str) -> int:
        nid = len(self.symbol_ids)
        self.symbol_ids[f"{base}_{nid}"] = nid
        return nid

    def _add_rule(self, rid: int, rule: list) -> None:
        if len(self.rules) <= rid:
            self.rules.extend([] for _ in range(rid + 1 - len(self.rules)))
        self.rules[rid] = rule

    def _alternates(self, pos: int, name: str, rid: int, nested: bool) -> int:
        rule: list = []
        pos = self._sequence(pos, name, rule, nested)
        while self.src[pos] == 124:  # '|'
            rule.append((ALT, 0))
            pos = self._space(pos + 1, True)
            pos = self._sequence(pos, name, rule, nested)
        rule.append((END, 0))
        self._add_rule(rid, rule)
        return pos

    def _sequence(self, pos: int, name: str, rule: list, nested: bool) -> int:
        s = self.src
        last_sym_start = len(rule)
        n_prev_rules = 1

        def repetitions(min_times: int, max_times: int, at: int) -> None:
            nonlocal n_prev_rules
            no_max = max_times == _U64_MAX
            if last_sym_start == len(rule):
                raise _Fail("expecting preceding item to */+/?/{", at)
            prev = rule[last_sym_start:]
            total = 1
            if not no_max and max_times > 0:
                total = max_times
            elif min_times > 0:
                total = min_times
            if n_prev_rules * total >= MAX_REPETITION_THRESHOLD:
                raise _Fail("number of rules that are going to be repeated multiplied by the new repetition "
                            "exceeds sane defaults, please reduce the number of repetitions or rule complexity", at)
            if min_times == 0:
                del rule[last_sym_start:]
            else:
                for _ in range(1, min_times):
                    rule.extend(prev)
            last_rec = 0
            n_opt = 1 if no_max else max_times - min_times
            for i in range(n_opt):
                rec = list(prev)
                rec_id = self._generate_symbol(name)
                if i > 0 or no_max:
                    rec.append((RULE_REF, rec_id if no_max else last_rec))
                rec.append((ALT, 0))
                rec.append((END, 0))
                self._add_rule(rec_id, rec)
                last_rec = rec_id
            if n_opt > 0:
                rule.append((RULE_REF, last_rec))
            n_prev_rules *= total

        while s[pos]:
            c = s[pos]
            if c == 34:  # '"' literal
                pos += 1
                last_sym_start = len(rule)
                n_prev_rules = 1
                while s[pos] != 34:
                    ch, pos = self._char_in(pos)
                    rule.append((CHAR, ch))
                pos = self._space(pos + 1, nested)
            elif c == 91:  # '[' class
                pos += 1
                start_type = CHAR
                if s[pos] == 94:  # '^'
                    pos += 1
                    start_type = CHAR_NOT
                last_sym_start = len(rule)
                n_prev_rules = 1
                while s[pos] != 93:
                    ch, pos = self._char_in(pos)
                    rule.append((CHAR_ALT if last_sym_start < len(rule) else start_type, ch))
                    if s[pos] == 45 and s[pos + 1] != 93:  # '-' not before ']'
                        if not s[pos + 1]:
                            raise _Fail("unexpected end of input", pos + 1)
                        hi, pos = self._char(pos + 1)
                        rule.append((CHAR_RNG_UPPER, hi))
                pos = self._space(pos + 1, nested)
            elif c == 60 or c == 33:  # '<' or '!': token
                typ = TOKEN
                if c == 33:
                    typ = TOKEN_NOT
                    pos += 1
                tid, end = self._token(pos)
                last_sym_start = len(rule)
                n_prev_rules = 1
                rule.append((typ, tid))
                pos = self._space(end, nested)
            elif _is_word(c):  # rule reference
                end = self._name(pos)
                ref = self._symbol(bytes(s[pos:end]).decode("ascii"))
                pos = self._space(end, nested)
                last_sym_start = len(rule)
                n_prev_rules = 1
                rule.append((RULE_REF, ref))
            elif c == 40:  # '(' group
                pos = self._space(pos + 1, True)
                n_before = len(self.symbol_ids)
                sub = self._generate_symbol(name)
                pos = self._alternates(pos, name, sub, True)
                n_prev_rules = max(1, len(self.symbol_ids) - n_before)
                last_sym_start = len(rule)
                rule.append((RULE_REF, sub))
                if s[pos] != 41:
                    raise _Fail("expecting ')'", pos)
                pos = self._space(pos + 1, nested)
            elif c == 46:  # '.'
                last_sym_start = len(rule)
                n_prev_rules = 1
                rule.append((CHAR_ANY, 0))
                pos = self._space(pos + 1, nested)
            elif c == 42:  # '*'
                at = pos
                pos = self._space(pos + 1, nested)
                repetitions(0, _U64_MAX, at)
            elif c == 43:  # '+'
                at = pos
                pos = self._space(pos + 1, nested)
                repetitions(1, _U64_MAX, at)
            elif c == 63:  # '?'
                at = pos
                pos = self._space(pos + 1, nested)
                repetitions(0, 1, at)
            elif c == 123:  # '{'
                at = pos
                pos = self._space(pos + 1, nested)
                if not _is_digit(s[pos]):
                    raise _Fail("expecting an int", pos)
                end = self._int(pos)
                min_times = min(int(s[pos:end]), _U64_MAX)
                pos = self._space(end, nested)
                max_times = _U64_MAX
                if s[pos] == 125:
                    max_times = min_times
                    pos = self._space(pos + 1, nested)
                elif s[pos] == 44:
                    pos = self._space(pos + 1, nested)
                    if _is_digit(s[pos]):
                        end = self._int(pos)
                        max_times = min(int(s[pos:end]), _U64_MAX)
                        pos = self._space(end, nested)
                    if s[pos] != 125:
                        raise _Fail("expecting '}'", pos)
                    pos = self._space(pos + 1, nested)
                else:
                    raise _Fail("expecting ','", pos)
                if min_times > MAX_REPETITION_THRESHOLD:
                    raise _Fail("number of repetitions exceeds sane defaults, please reduce the number of "
                                "repetitions", at)
                if max_times != _U64_MAX and max_times > MAX_REPETITION_THRESHOLD:
                    max_times = _U64_MAX
                if max_times != _U64_MAX and max_times < min_times:
                    # llama.cpp's unsigned n_opt would wrap and loop for ever: refused here
                    raise _Fail(f"repetition {{{min_times},{max_times}}} has max < min", at)
                repetitions(min_times, max_times, at)
            else:
                break
        return pos

    def _rule(self, pos: int) -> int:
        s = self.src
        name_end = self._name(pos)
        p = self._space(name_end, False)
        name = bytes(s[pos:name_end]).decode("ascii")
        rid = self._symbol(name)
        if not (s[p] == 58 and s[p + 1] == 58 and s[p + 2] == 61):
            raise _Fail("expecting ::=", p)
        p = self._space(p + 3, True)
        p = self._alternates(p, name, rid, False)
        if s[p] == 13:
            p += 2 if s[p + 1] == 10 else 1
        elif s[p] == 10:
            p += 1
        elif s[p]:
            raise _Fail("expecting newline or end", p)
        return self._space(p, True)

    def parse(self, text: str) -> None:
        """Parse ``text``; raises SynapseError ("grammar: ..." with the position) on a syntax
        error or an undefined rule."""
        raw = text.encode("utf-8", "surrogatepass")
        self.src = raw + b"\0\0\0\0"
        try:
            pos = self._space(0, True)
            while self.src[pos]:
                pos = self._rule(pos)
        except _Fail as e:
            raise SynapseError(f"grammar: {e} {_where(raw, e.pos)}") from None
        except RecursionError:
            raise SynapseError("grammar: groups nested too deeply") from None
        names = {v: k for k, v in self.symbol_ids.items()}
        n = len(self.rules)
        for rid in range(n):
            if not self.rules[rid]:
                raise SynapseError(f"grammar: undefined rule '{names.get(rid, rid)}'")
            for typ, val in self.rules[rid]:
                if typ == RULE_REF and (val >= n or not self.rules[val]):
                    raise SynapseError(f"grammar: undefined rule '{names.get(val, val)}' "
                                       f"(referenced by '{names.get(rid, rid)}')")
        # a name only referenced, with a larger id than every rule defined
        for name, sid in self.symbol_ids.items():
            if sid >= n:
                raise SynapseError(f"grammar: undefined rule '{name}'")


def _where(raw: bytes, pos) -> str:
    if pos is None:
        return ""
    pos = min(pos, len(raw))
    line = raw.count(b"\n", 0, pos) + 1
    col = pos - (raw.rfind(b"\n", 0, pos) + 1) + 1
    rest = raw[pos:pos + 24].split(b"\n")[0].decode("utf-8", "replace")
    return f"at line {line}, column {col}" + (f": {rest!r}" if rest else " (end of input)")


def _end_of_seq(typ: int) -> bool:
    return typ == END or typ == ALT


def _left_recursion(rules, i, visited, in_progress, may_be_empty) -> bool:
    """llama_grammar_detect_left_recursion, in the same visiting order."""
    if in_progress[i]:
        return True
    in_progress[i] = True
    rule = rules[i]
    at_start = True
    for typ, _ in rule:
        if _end_of_seq(typ):
            if at_start:
                may_be_empty[i] = True
                break
            at_start = True
        else:
            at_start = False
    recurse = True
    for typ, val in rule:
        if typ == RULE_REF and recurse:
            if _left_recursion(rules, val, visited, in_progress, may_be_empty):
                return True
            if not may_be_empty[val]:
                recurse = False
        elif _end_of_seq(typ):
            recurse = True
        else:
            recurse = False
    in_progress[i] = False
    visited[i] = True
    return False


def parse_grammar(text: str, root: str = "root", tokenize=None):
    """Parse GBNF ``text`` and check it as llama_grammar_init_impl does.

    Returns (rules, symbol_ids, root_id): rules a list of lists of (type, value) ending with END.
    Raises SynapseError for a syntax error, an undefined rule, no rules, a missing root rule or
    left recursion.
    """
    if not isinstance(text, str):
        raise SynapseError(f"grammar: expected a string, got {type(text).__name__}")
    p = GbnfParser(tokenize)
    p.parse(text)
    if not p.rules:
        raise SynapseError("grammar: no rules (empty grammar)")
    if root not in p.symbol_ids:
        raise SynapseError(f"grammar: no '{root}' rule (the grammar's start symbol)")
    rules = p.rules
    n = len(rules)
    import sys

    names = {v: k for k, v in p.symbol_ids.items()}
    visited, in_progress, empty = [False] * n, [False] * n, [False] * n
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(max(old, 4 * n + 1000))
    try:
        for i in range(n):
            if not visited[i] and _left_recursion(rules, i, visited, in_progress, empty):
                raise SynapseError(f"grammar: left recursion in rule '{names.get(i, i)}' "
                                   f"(unsupported, as in llama.cpp)")
    finally:
        sys.setrecursionlimit(old)
    return rules, dict(p.symbol_ids), p.symbol_ids[root]
