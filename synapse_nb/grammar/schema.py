"""JSON schema -> GBNF as llama.cpp's common/json-schema-to-grammar.cpp (0c1e570) converts it.

The grammar text is the same, rule for rule: rule names from the schema's property paths
(characters outside [a-zA-Z0-9-] replaced by '-', a number appended on a clash), rules sorted by
name, ``space`` before closing brackets, llama.cpp's primitive rules, its integer-range
construction and its regex-pattern translation. Supported: ``type`` (and lists of types),
``properties``, ``required``, ``additionalProperties``, ``enum``, ``const``, ``items`` /
``prefixItems`` / ``minItems`` / ``maxItems``, string ``pattern`` / ``minLength`` /
``maxLength`` / ``format`` (date, time, date-time, uuid), integer ``minimum`` / ``maximum`` /
``exclusiveMinimum`` / ``exclusiveMaximum``, ``$ref`` to ``#/...`` (and ``$defs`` anywhere),
``anyOf`` / ``oneOf`` / ``allOf``. What llama.cpp refuses (remote or unsupported ``$ref``, an
unrecognized schema, an unanchored or malformed pattern, ...) is a one-line SynapseError.
"""

from __future__ import annotations

import copy
import json
import re

from ..errors import SynapseError

_INT_MAX = 2**31 - 1
_I64_MIN = -2**63
_I64_MAX = 2**63 - 1

SPACE_RULE = '| " " | "\\n"{1,2} [ \\t]{0,20}'

# name: (content, deps)
PRIMITIVE_RULES = {
    "boolean": ('("true" | "false")', []),
    "decimal-part": ("[0-9]{1,16}", []),
    "integral-part": ("[0] | [1-9] [0-9]{0,15}", []),
    "number": ('("-"? integral-part) ("." decimal-part)? ([eE] [-+]? integral-part)?',
               ["integral-part", "decimal-part"]),
    "integer": ('("-"? integral-part)', ["integral-part"]),
    "value": ("object | array | string | number | boolean | null",
              ["object", "array", "string", "number", "boolean", "null"]),
    "object": ('"{" space ( string ":" space value ("," space string ":" space value)* )? space "}"',
               ["string", "value"]),
    "array": ('"[" space ( value ("," space value)* )? space "]"', ["value"]),
    "uuid": ('"\\"" [0-9a-fA-F]{8} "-" [0-9a-fA-F]{4} "-" [0-9a-fA-F]{4} "-" [0-9a-fA-F]{4} "-" '
             '[0-9a-fA-F]{12} "\\""', []),
    "char": ('[^"\\\\\\x7F\\x00-\\x1F] | [\\\\] (["\\\\bfnrt] | "u" [0-9a-fA-F]{4})', []),
    "string": ('"\\"" char* "\\""', ["char"]),
    "null": ('"null"', []),
}

STRING_FORMAT_RULES = {
    "date": ('[0-9]{4} "-" ( "0" [1-9] | "1" [0-2] ) "-" ( "0" [1-9] | [1-2] [0-9] | "3" [0-1] )', []),
    "time": ('([01] [0-9] | "2" [0-3]) ":" [0-5] [0-9] ":" [0-5] [0-9] ( "." [0-9]{3} )? ( "Z" | ( "+" | "-" ) '
             '( [01] [0-9] | "2" [0-3] ) ":" [0-5] [0-9] )', []),
    "date-time": ('date "T" time', ["date", "time"]),
    "date-string": ('"\\"" date "\\""', ["date"]),
    "time-string": ('"\\"" time "\\""', ["time"]),
    "date-time-string": ('"\\"" date-time "\\""', ["date-time"]),
}

RESERVED_NAMES = {"root", *PRIMITIVE_RULES, *STRING_FORMAT_RULES}

_INVALID_RULE_CHARS = re.compile(r"[^a-zA-Z0-9-]+")
_LITERAL_ESCAPE = re.compile(r'[\r\n"\\]')
_LITERAL_ESCAPES = {"\r": "\\r", "\n": "\\n", '"': '\\"', "-": "\\-", "]": "\\]", "\\": "\\\\"}
_NON_LITERAL = set("|.()[]{}*+?")
_ESCAPED_IN_REGEXPS_BUT_NOT_IN_LITERALS = set("^$.[]()|{}*+?")


def _dump(value) -> str:
    """nlohmann::ordered_json::dump(): compact, UTF-8 kept, keys in document order."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def format_literal(literal: str) -> str:
    return '"' + _LITERAL_ESCAPE.sub(lambda m: _LITERAL_ESCAPES[m.group(0)], literal) + '"'


def build_repetition(item_rule: str, min_items: int, max_items: int, separator_rule: str = "") -> str:
    has_max = max_items != _INT_MAX
    if max_items == 0:
        return ""
    if min_items == 0 and max_items == 1:
        return item_rule + "?"
    if not separator_rule:
        if min_items == 1 and not has_max:
            return item_rule + "+"
        if min_items == 0 and not has_max:
            return item_rule + "*"
        return item_rule + "{" + str(min_items) + "," + (str(max_items) if has_max else "") + "}"
    result = item_rule + " " + build_repetition("(" + separator_rule + " " + item_rule + ")",
                                                0 if min_items == 0 else min_items - 1,
                                                max_items - 1 if has_max else max_items)
    if min_items == 0:
        result = "(" + result + ")?"
    return result


def _build_min_max_int(min_value: int, max_value: int, out: list, decimals_left: int = 16,
                       top_level: bool = True) -> None:
    has_min = min_value != _I64_MIN
    has_max = max_value != _I64_MAX

    def digit_range(a: str, b: str) -> None:
        out.append("[" + (a if a == b else a + "-" + b) + "]")

    def more_digits(lo: int, hi: int) -> None:
        out.append("[0-9]")
        if lo == hi == 1:
            return
        out.append("{" + str(lo))
        if hi != lo:
            out.append(",")
            if hi != _INT_MAX:
                out.append(str(hi))
        out.append("}")

    def uniform_range(frm: str, to: str) -> None:
        i = 0
        while i < len(frm) and i < len(to) and frm[i] == to[i]:
            i += 1
        if i > 0:
            out.append('"' + frm[:i] + '"')
        if i < len(frm) and i < len(to):
            if i > 0:
                out.append(" ")
            sub_len = len(frm) - i - 1
            if sub_len > 0:
                from_sub, to_sub = frm[i + 1:], to[i + 1:]
                zeros, nines = "0" * sub_len, "9" * sub_len
                to_reached = False
                out.append("(")
                if from_sub == zeros:
                    digit_range(frm[i], chr(ord(to[i]) - 1))
                    out.append(" ")
                    more_digits(sub_len, sub_len)
                else:
                    out.append("[" + frm[i] + "] ")
                    out.append("(")
                    uniform_range(from_sub, nines)
                    out.append(")")
                    if ord(frm[i]) < ord(to[i]) - 1:
                        out.append(" | ")
                        if to_sub == nines:
                            digit_range(chr(ord(frm[i]) + 1), to[i])
                            to_reached = True
                        else:
                            digit_range(chr(ord(frm[i]) + 1), chr(ord(to[i]) - 1))
                        out.append(" ")
                        more_digits(sub_len, sub_len)
                if not to_reached:
                    out.append(" | ")
                    digit_range(to[i], to[i])
                    out.append(" ")
                    uniform_range(zeros, to_sub)
                out.append(")")
            else:
                out.append("[" + frm[i] + "-" + to[i] + "]")

    if has_min and has_max:
        if min_value < 0 and max_value < 0:
            out.append('"-" (')
            _build_min_max_int(-max_value, -min_value, out, decimals_left, True)
            out.append(")")
            return
        if min_value < 0:
            out.append('"-" (')
            _build_min_max_int(0, -min_value, out, decimals_left, True)
            out.append(") | ")
            min_value = 0
        min_s, max_s = str(min_value), str(max_value)
        for digits in range(len(min_s), len(max_s)):
            uniform_range(min_s, "9" * digits)
            min_s = "1" + "0" * digits
            out.append(" | ")
        uniform_range(min_s, max_s)
        return

    less_decimals = max(decimals_left - 1, 1)
    if has_min:
        if min_value < 0:
            out.append('"-" (')
            _build_min_max_int(_I64_MIN, -min_value, out, decimals_left, False)
            out.append(") | [0] | [1-9] ")
            more_digits(0, decimals_left - 1)
        elif min_value == 0:
            if top_level:
                out.append("[0] | [1-9] ")
                more_digits(0, less_decimals)
            else:
                more_digits(1, decimals_left)
        elif min_value <= 9:
            c = chr(ord("0") + min_value)
            range_start = "1" if top_level else "0"
            if c > range_start:
                digit_range(range_start, chr(ord(c) - 1))
                out.append(" ")
                more_digits(1, less_decimals)
                out.append(" | ")
            digit_range(c, "9")
            out.append(" ")
            more_digits(0, less_decimals)
        else:
            min_s = str(min_value)
            n = len(min_s)
            c = min_s[0]
            if c > "1":
                digit_range("1" if top_level else "0", chr(ord(c) - 1))
                out.append(" ")
                more_digits(n, less_decimals)
                out.append(" | ")
            digit_range(c, c)
            out.append(" (")
            _build_min_max_int(int(min_s[1:]), _I64_MAX, out, less_decimals, False)
            out.append(")")
            if c < "9":
                out.append(" | ")
                digit_range(chr(ord(c) + 1), "9")
                out.append(" ")
                more_digits(n - 1, less_decimals)
        return

    if has_max:
        if max_value >= 0:
            if top_level:
                out.append('"-" [1-9] ')
                more_digits(0, less_decimals)
                out.append(" | ")
            _build_min_max_int(0, max_value, out, decimals_left, True)
        else:
            out.append('"-" (')
            _build_min_max_int(-max_value, _I64_MAX, out, decimals_left, False)
            out.append(")")
        return
    raise SynapseError("json schema: at least one of minimum or maximum must be set")


def _contains(schema, key) -> bool:
    return isinstance(schema, dict) and key in schema


def _as_int(value, what: str, lo: int = -2**31, hi: int = _INT_MAX) -> int:
    """nlohmann's get<int>() / get<int64_t>(): a number (a float truncated), else refused."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SynapseError(f"json schema: {what} must be a number, got {_dump(value)}")
    v = int(value)
    if not lo <= v <= hi:
        raise SynapseError(f"json schema: {what} {v} is out of range")
    return v


class _Converter:
    def __init__(self, dotall: bool = False):
        self._dotall = dotall
        self._rules = {"space": SPACE_RULE}
        self._refs: dict = {}
        self._refs_being_resolved: set = set()
        self._errors: list = []
        self._warnings: list = []

    def _add_rule(self, name: str, rule: str) -> str:
        esc = _INVALID_RULE_CHARS.sub("-", name)
        if esc not in self._rules or self._rules[esc] == rule:
            self._rules[esc] = rule
            return esc
        i = 0
        while f"{esc}{i}" in self._rules and self._rules[f"{esc}{i}"] != rule:
            i += 1
        key = f"{esc}{i}"
        self._rules[key] = rule
        return key

    def _add_primitive(self, name: str, rule) -> str:
        n = self._add_rule(name, rule[0])
        for dep in rule[1]:
            dep_rule = PRIMITIVE_RULES.get(dep) or STRING_FORMAT_RULES.get(dep)
            if dep_rule is None:
                self._errors.append(f"Rule {dep} not known")
                continue
            if dep not in self._rules:
                self._add_primitive(dep, dep_rule)
        return n

    def _generate_union_rule(self, name: str, alt_schemas) -> str:
        return " | ".join(self.visit(s, name + ("alternative-" if not name else "-") + str(i))
                          for i, s in enumerate(alt_schemas))

    # -- regex patterns ---------------------------------------------------------------------
    def _visit_pattern(self, pattern: str, name: str) -> str:
        if not isinstance(pattern, str):
            raise SynapseError(f"json schema: pattern must be a string, got {_dump(pattern)}")
        if not (len(pattern) >= 1 and pattern[0] == "^" and pattern[-1] == "$") or len(pattern) < 2:
            self._errors.append("Pattern must start with '^' and end with '$'")
            return ""
        sub = pattern[1:-1]
        sub_rule_ids: dict = {}
        n = len(sub)
        pos = [0]

        def to_rule(ls):
            return '"' + ls[0] + '"' if ls[1] else ls[0]

        def bracketed(close, escapes, unbalanced):
            # sub[pos[0]] opens a [...] or {...}: its text through `close`, pos[0] moved past it
            # (a backslash escapes the next character in a class); the C++ appends the closer even
            # when the pattern ends first, after recording the error
            text = sub[pos[0]]
            pos[0] += 1
            while pos[0] < n and sub[pos[0]] != close:
                step = 2 if escapes and sub[pos[0]] == "\\" else 1
                text += sub[pos[0]:pos[0] + step]
                pos[0] += step
            if pos[0] >= n:
                self._errors.append(unbalanced)
            pos[0] += 1
            return text + close

        def transform():
            start = pos[0]
            seq: list = []

            def join_seq():
                ret, lit = [], ""
                for item in seq:
                    if item[1]:
                        lit += item[0]
                    else:
                        if lit:
                            ret.append((lit, True))
                            lit = ""
                        ret.append(item)
                if lit:
                    ret.append((lit, True))
                return " ".join(to_rule(x) for x in ret), False

            while pos[0] < n:
                i = pos[0]
                c = sub[i]
                if c == ".":
                    seq.append((self._add_rule("dot", "[\\U00000000-\\U0010FFFF]" if self._dotall
                                               else "[^\\x0A\\x0D]"), False))
                    pos[0] += 1
                elif c == "(":
                    pos[0] += 1
                    if pos[0] < n and sub[pos[0]] == "?":
                        if pos[0] + 1 < n and sub[pos[0] + 1] == ":":
                            pos[0] += 2
                        else:
                            self._warnings.append("Unsupported pattern syntax")
                            depth = 1
                            while pos[0] < n and depth > 0:
                                if sub[pos[0]] == "\\" and pos[0] + 1 < n:
                                    pos[0] += 2
                                else:
                                    if sub[pos[0]] == "(":
                                        depth += 1
                                    elif sub[pos[0]] == ")":
                                        depth -= 1
                                    pos[0] += 1
                            continue
                    seq.append(("(" + to_rule(transform()) + ")", False))
                elif c == ")":
                    pos[0] += 1
                    if start > 0 and sub[start - 1] != "(" and (start < 2 or sub[start - 2] != "?"
                                                                 or sub[start - 1] != ":"):
                        self._errors.append("Unbalanced parentheses")
                    return join_seq()
                elif c == "[":
                    seq.append((bracketed("]", True, "Unbalanced square brackets"), False))
                elif c == "|":
                    seq.append(("|", False))
                    pos[0] += 1
                elif c in "*+?":
                    if not seq:
                        raise SynapseError(f"json schema: pattern {pattern!r}: nothing to repeat at {c!r}")
                    seq[-1] = (to_rule(seq[-1]) + c, False)
                    pos[0] += 1
                elif c == "{":
                    curly = bracketed("}", False, "Unbalanced curly brackets")
                    nums = curly[1:-1].split(",")
                    min_times, max_times = 0, _INT_MAX
                    try:
                        if len(nums) == 1:
                            min_times = max_times = _stoi(nums[0])
                        elif len(nums) != 2:
                            self._errors.append("Wrong number of values in curly brackets")
                        else:
                            if nums[0]:
                                min_times = _stoi(nums[0])
                            if nums[1]:
                                max_times = _stoi(nums[1])
                    except ValueError:
                        self._errors.append("Invalid number in curly brackets")
                        return "", False
                    if not seq:
                        raise SynapseError(f"json schema: pattern {pattern!r}: nothing to repeat at '{{'")
                    s, is_lit = seq[-1]
                    if not is_lit:
                        if s not in sub_rule_ids:
                            sub_rule_ids[s] = ""
                            sub_rule_ids[s] = self._add_rule(f"{name}-{len(sub_rule_ids)}", s)
                        s = sub_rule_ids[s]
                    seq[-1] = (build_repetition('"' + s + '"' if is_lit else s, min_times, max_times, ""), False)
                else:
                    lit = ""
                    while pos[0] < n:
                        j = pos[0]
                        if sub[j] == "\\" and j < n - 1:
                            nxt = sub[j + 1]
                            if nxt in _ESCAPED_IN_REGEXPS_BUT_NOT_IN_LITERALS:
                                lit += nxt
                                pos[0] += 2
                            else:
                                lit += sub[j:j + 2]
                                pos[0] += 2
                        elif sub[j] == '"':
                            lit += '\\"'
                            pos[0] += 1
                        elif sub[j] not in _NON_LITERAL and (j == n - 1 or not lit or sub[j + 1] == "."
                                                             or sub[j + 1] not in _NON_LITERAL):
                            lit += sub[j]
                            pos[0] += 1
                        else:
                            break
                    if lit:
                        seq.append((lit, True))
                    elif pos[0] == i:  # llama.cpp would loop for ever on a stray ']' or '}'
                        raise SynapseError(f"json schema: pattern {pattern!r}: unsupported character {c!r}")
            return join_seq()

        return self._add_rule(name, '"\\"" (' + to_rule(transform()) + ') "\\""')

    def _not_strings(self, strings) -> str:
        trie: dict = {}
        END_KEY = None
        for s in strings:
            node = trie
            for ch in s:
                node = node.setdefault(ch, {})
            node[END_KEY] = True
        char_rule = self._add_primitive("char", PRIMITIVE_RULES["char"])
        out = ['["] ( ']

        def visit(node):
            rejects = ""
            first = True
            for ch in sorted(k for k in node if k is not None):
                child = node[ch]
                rejects += ch
                if first:
                    first = False
                else:
                    out.append(" | ")
                out.append("[" + ch + "]")
                if any(k is not None for k in child):
                    out.append(" (")
                    visit(child)
                    out.append(")")
                elif child.get(END_KEY):
                    out.append(" " + char_rule + "+")
            if any(k is not None for k in node):
                if not first:
                    out.append(" | ")
                out.append('[^"' + rejects + "] " + char_rule + "*")

        visit(trie)
        out.append(" )")
        if not trie.get(END_KEY):
            out.append("?")
        out.append(' ["]')
        return "".join(out)

    def _resolve_ref(self, ref: str) -> str:
        frag = ref[ref.index("#") + 1:] if "#" in ref else ref
        ref_name = "ref" + _INVALID_RULE_CHARS.sub("-", frag)
        if ref_name not in self._rules and ref not in self._refs_being_resolved:
            self._refs_being_resolved.add(ref)
            ref_name = self.visit(self._refs.get(ref), ref_name)
            self._refs_being_resolved.discard(ref)
        return ref_name

    def _build_object_rule(self, properties, required, name: str, additional) -> str:
        required_props, optional_props, prop_names = [], [], []
        kv_names: dict = {}
        for prop_name, prop_schema in properties:
            prop_rule = self.visit(prop_schema, name + ("-" if name else "") + prop_name)
            kv_names[prop_name] = self._add_rule(name + ("-" if name else "") + prop_name + "-kv",
                                                 format_literal(_dump(prop_name)) + ' space ":" space ' + prop_rule)
            (required_props if prop_name in required else optional_props).append(prop_name)
            prop_names.append(prop_name)
        if additional is True or isinstance(additional, dict):
            sub_name = name + ("-" if name else "") + "additional"
            value_rule = (self.visit(additional, sub_name + "-value") if isinstance(additional, dict)
                          else self._add_primitive("value", PRIMITIVE_RULES["value"]))
            key_rule = (self._add_primitive("string", PRIMITIVE_RULES["string"]) if not prop_names
                        else self._add_rule(sub_name + "-k", self._not_strings(prop_names)))
            kv_names["*"] = self._add_rule(sub_name + "-kv", key_rule + ' ":" space ' + value_rule)
            optional_props.append("*")
        if not required_props and not optional_props:
            return '"{" space "}"'
        rule = '"{" space '
        rule += ' "," space '.join(kv_names[p] for p in required_props)
        if optional_props:
            rule += " ("
            if required_props:
                rule += ' "," space ( '

            def recursive_refs(ks, first_is_optional):
                if not ks:
                    return ""
                k = ks[0]
                kv = kv_names[k]
                comma_ref = '( "," space ' + kv + " )"
                if first_is_optional:
                    res = comma_ref + ("*" if k == "*" else "?")
                else:
                    res = kv + (" " + comma_ref + "*" if k == "*" else "")
                if len(ks) > 1:
                    res += " " + self._add_rule(name + ("-" if name else "") + k + "-rest",
                                                recursive_refs(ks[1:], True))
                return res

            rule += " | ".join(recursive_refs(optional_props[i:], False) for i in range(len(optional_props)))
            if required_props:
                rule += " )"
            rule += " )?"
        rule += ' space "}"'
        return rule

    # -- $ref resolution ---------------------------------------------------------------------
    def resolve_refs(self, schema, url: str = "") -> None:
        _hoist_defs_to_root(schema)

        def visit_refs(n):
            if isinstance(n, list):
                for x in n:
                    visit_refs(x)
            elif isinstance(n, dict):
                if "$ref" in n:
                    ref = n["$ref"]
                    if not isinstance(ref, str):
                        raise SynapseError(f"json schema: $ref must be a string, got {_dump(ref)}")
                    if ref in self._refs:
                        return
                    if ref.startswith("https://"):
                        # llama.cpp fetches nothing (its fetcher returns null): unresolvable
                        base = ref.split("#")[0]
                        self._refs.setdefault(base, None)
                        if "#" not in ref or not ref[ref.index("#") + 1:]:
                            return
                        target = None
                    elif ref.startswith("#/"):
                        target = schema
                        n["$ref"] = url + ref
                        ref = url + ref
                    else:
                        self._errors.append("Unsupported ref: " + ref)
                        return
                    pointer = ref[ref.index("#") + 1:]
                    for sel in pointer.split("/")[1:]:
                        if isinstance(target, dict) and sel in target:
                            target = target[sel]
                        elif isinstance(target, list):
                            m = re.match(r"\s*\+?([0-9]+)", sel)
                            idx = int(m.group(1)) if m else len(target)
                            if idx >= len(target):
                                self._errors.append(f"Error resolving ref {ref}: {sel} not in {_dump(target)}")
                                return
                            target = target[idx]
                        else:
                            self._errors.append(f"Error resolving ref {ref}: {sel} not in {_dump(target)}")
                            return
                    self._refs[ref] = target
                else:
                    for v in n.values():
                        visit_refs(v)

        visit_refs(schema)

    # -- the schema ---------------------------------------------------------------------------
    def visit(self, schema, name: str) -> str:
        schema_type = schema.get("type") if isinstance(schema, dict) else None
        fmt = schema.get("format", "") if isinstance(schema, dict) else ""
        if not isinstance(fmt, str):
            raise SynapseError(f"json schema: format must be a string, got {_dump(fmt)}")
        rule_name = name + "-" if name in RESERVED_NAMES else (name or "root")
        has = (lambda k: _contains(schema, k))

        if has("$ref"):
            return self._add_rule(rule_name, self._resolve_ref(schema["$ref"]))
        if has("oneOf") or has("anyOf"):
            alts = schema["oneOf"] if has("oneOf") else schema["anyOf"]
            if not isinstance(alts, list):
                raise SynapseError(f"json schema: oneOf/anyOf must be an array, got {_dump(alts)}")
            return self._add_rule(rule_name, self._generate_union_rule(name, alts))
        if isinstance(schema_type, list):
            alts = []
            for t in schema_type:
                c = dict(schema)
                c["type"] = t
                alts.append(c)
            return self._add_rule(rule_name, self._generate_union_rule(name, alts))
        if has("const"):
            return self._add_rule(rule_name, format_literal(_dump(schema["const"])))
        if has("enum"):
            vals = schema["enum"]
            if not isinstance(vals, (list, dict)):
                raise SynapseError(f"json schema: enum must be an array, got {_dump(vals)}")
            items = vals if isinstance(vals, list) else list(vals.values())
            return self._add_rule(rule_name, "(" + " | ".join(format_literal(_dump(v)) for v in items) + ")")
        if (schema_type is None or schema_type == "object") and (
                has("properties") or (has("additionalProperties") and schema["additionalProperties"] is not True)):
            req = schema.get("required")
            required = {x for x in req if isinstance(x, str)} if isinstance(req, list) else set()
            props = schema.get("properties", {})
            if not isinstance(props, dict):
                raise SynapseError(f"json schema: properties must be an object, got {_dump(props)}")
            return self._add_rule(rule_name, self._build_object_rule(list(props.items()), required, name,
                                                                     schema.get("additionalProperties")))
        if (schema_type is None or schema_type in ("object", "string")) and has("allOf"):
            required: set = set()
            properties: list = []
            enum_values: dict = {}

            def add_component(comp, is_required):
                if _contains(comp, "$ref"):
                    add_component(self._refs.get(comp["$ref"]), is_required)
                elif _contains(comp, "properties"):
                    for k, v in comp["properties"].items():
                        properties.append((k, v))
                        if is_required:
                            required.add(k)
                elif _contains(comp, "enum"):
                    for v in comp["enum"]:
                        r = format_literal(_dump(v))
                        enum_values[r] = enum_values.get(r, 0) + 1

            all_of = schema["allOf"]
            if not isinstance(all_of, list):
                raise SynapseError(f"json schema: allOf must be an array, got {_dump(all_of)}")
            for t in all_of:
                if _contains(t, "anyOf"):
                    for tt in t["anyOf"]:
                        add_component(tt, False)
                else:
                    add_component(t, True)
            if enum_values:
                inter = [r for r in sorted(enum_values) if enum_values[r] == len(all_of)]
                if inter:
                    return self._add_rule(rule_name, "(" + " | ".join(inter) + ")")
            return self._add_rule(rule_name, self._build_object_rule(properties, required, name, None))
        if (schema_type is None or schema_type == "array") and (has("items") or has("prefixItems")):
            items = schema["items"] if has("items") else schema["prefixItems"]
            if isinstance(items, list):
                rule = '"[" space ' + ' "," space '.join(
                    self.visit(it, name + ("-" if name else "") + "tuple-" + str(i)) for i, it in enumerate(items))
                return self._add_rule(rule_name, rule + ' space "]"')
            item_rule = self.visit(items, name + ("-" if name else "") + "item")
            min_items = _as_int(schema["minItems"], "minItems") if has("minItems") else 0
            mx = schema.get("maxItems")
            max_items = _as_int(mx, "maxItems") if isinstance(mx, int) and not isinstance(mx, bool) else _INT_MAX
            return self._add_rule(rule_name, '"[" space ' + build_repetition(item_rule, min_items, max_items,
                                                                             '"," space') + ' space "]"')
        if (schema_type is None or schema_type == "string") and has("pattern"):
            return self._visit_pattern(schema["pattern"], rule_name)
        if (schema_type is None or schema_type == "string") and re.fullmatch(r"uuid[1-5]?", fmt):
            return self._add_primitive("root" if rule_name == "root" else fmt, PRIMITIVE_RULES["uuid"])
        if (schema_type is None or schema_type == "string") and fmt + "-string" in STRING_FORMAT_RULES:
            prim = fmt + "-string"
            return self._add_rule(rule_name, self._add_primitive(prim, STRING_FORMAT_RULES[prim]))
        if schema_type == "string" and (has("minLength") or has("maxLength")):
            char_rule = self._add_primitive("char", PRIMITIVE_RULES["char"])
            min_len = _as_int(schema["minLength"], "minLength") if has("minLength") else 0
            max_len = _as_int(schema["maxLength"], "maxLength") if has("maxLength") else _INT_MAX
            return self._add_rule(rule_name, '"\\"" ' + build_repetition(char_rule, min_len, max_len) + ' "\\""')
        if schema_type == "integer" and (has("minimum") or has("exclusiveMinimum") or has("maximum")
                                         or has("exclusiveMaximum")):
            lo, hi = _I64_MIN, _I64_MAX
            if has("minimum"):
                lo = _as_int(schema["minimum"], "minimum", _I64_MIN, _I64_MAX)
            elif has("exclusiveMinimum"):
                lo = _as_int(schema["exclusiveMinimum"], "exclusiveMinimum", _I64_MIN, _I64_MAX - 1) + 1
            if has("maximum"):
                hi = _as_int(schema["maximum"], "maximum", _I64_MIN, _I64_MAX)
            elif has("exclusiveMaximum"):
                hi = _as_int(schema["exclusiveMaximum"], "exclusiveMaximum", _I64_MIN + 1, _I64_MAX) - 1
            out = ["("]
            _build_min_max_int(lo, hi, out)
            out.append(")")
            return self._add_rule(rule_name, "".join(out))
        if schema is None or schema == {} or schema_type == "object":
            return self._add_rule(rule_name, self._add_primitive("object", PRIMITIVE_RULES["object"]))
        if schema_type is None and isinstance(schema, dict):
            return self._add_rule(rule_name, self._add_primitive("value", PRIMITIVE_RULES["value"]))
        if not isinstance(schema_type, str) or schema_type not in PRIMITIVE_RULES:
            self._errors.append("Unrecognized schema: " + _dump(schema))
            return ""
        return self._add_primitive("root" if rule_name == "root" else schema_type, PRIMITIVE_RULES[schema_type])

    def format_grammar(self) -> str:
        return "".join(f"{k} ::= {self._rules[k]}\n" for k in sorted(self._rules, key=lambda s: s.encode()))


def _stoi(s: str) -> int:
    m = re.match(r"\s*([+-]?[0-9]+)", s)
    if not m:
        raise ValueError(s)
    v = int(m.group(1))
    if not -2**31 <= v <= _INT_MAX:
        raise ValueError(s)
    return v


def _hoist_defs_to_root(schema) -> None:
    """Nested $defs gathered at the root (llama.cpp's hoist_defs_to_root)."""
    if not isinstance(schema, dict):
        return
    collected: dict = {}

    def collect(node):
        if not isinstance(node, dict):
            return
        if isinstance(node.get("$defs"), dict):
            for k, v in node["$defs"].items():
                collected.setdefault(k, v)
            del node["$defs"]
        for v in node.values():
            if isinstance(v, dict):
                collect(v)
            elif isinstance(v, list):
                for it in v:
                    if isinstance(it, dict):
                        collect(it)

    collect(schema)
    if collected:
        defs = schema.setdefault("$defs", {})
        for k, v in collected.items():
            defs.setdefault(k, v)


def json_schema_to_grammar(schema) -> str:
    """GBNF text for ``schema`` (a dict / JSON value, or JSON text), as llama.cpp's
    json_schema_to_grammar(schema, force_gbnf=true). Raises SynapseError (one line) for
    malformed JSON or a schema llama.cpp refuses."""
    if isinstance(schema, (str, bytes)):
        try:
            schema = json.loads(schema)
        except (ValueError, RecursionError) as e:
            raise SynapseError(f"json schema: not valid JSON: {e}") from None
    schema = copy.deepcopy(schema)
    conv = _Converter()
    try:
        conv.resolve_refs(schema, "")
        conv.visit(schema, "")
    except RecursionError:
        raise SynapseError("json schema: nested too deeply") from None
    except (TypeError, AttributeError, KeyError) as e:  # a keyword with a value of the wrong JSON type
        raise SynapseError(f"json schema: malformed schema ({type(e).__name__}: {e})") from None
    if conv._errors:
        raise SynapseError("json schema: conversion failed: " + "; ".join(conv._errors))
    return conv.format_grammar()
