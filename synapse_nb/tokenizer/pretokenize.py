"""BPE pre-tokenization: split text into words exactly as llama.cpp does.

Reproduces llama.cpp unicode.cpp `unicode_regex_split` and the per-`tokenizer.ggml.pre`
regex lists of llama-vocab.cpp (`llm_tokenizer_bpe`). llama.cpp never runs a Unicode
regex engine: it "collapses" the text first, one byte per code point -- ASCII stays
itself, every other code point becomes one marker for its category (whitespace -> \\x0B,
\\p{N} -> \\xD1, \\p{L} -> \\xD2, \\p{P} -> \\xD3, \\p{M} -> \\xD4, \\p{S} -> \\xD5, anything
else -> \\xD0) -- and runs std::regex (ECMAScript, "C" locale) on that, with \\p{X}
rewritten to "[marker + ASCII members]". Two regexes (GPT-2's and Llama 3's) are instead
hand-written loops (`unicode_regex_split_custom_gpt2/_llama3`); each is written here as
the regex that splits identically (the GPT-2 loop ends with an extra `\\s+`).

We do the same: collapse with categories from the `regex` package (which is what
llama.cpp's scripts/gen-unicode-data.py used to build its tables), then run Python `re`
on the collapsed string with every class spelled out, so the consequences of collapsing
are kept: e.g. with tekken's lookahead classes a non-ASCII letter counts as both upper-
and lower-case, and `~` is not in \\p{S} (llama.cpp's ASCII list omits it).

Several regexes are applied in sequence, each inside the words of the previous one
(a word's end acts as end of text for lookaheads). Stretches a regex does not match
become words of their own, as in llama.cpp's std::regex path.

llama.cpp's tables are Unicode 15.1; code points assigned since (Unicode 16/17, e.g.
U+1C89, Garay, Tulu-Tigalari, CJK extension J) are unassigned there, so they are made
"other" here too (_NEWER_THAN_15_1), whatever Unicode version the regex package has.
"""

from __future__ import annotations

import re
from bisect import bisect_right

import regex

from ..errors import SynapseError

# Category markers of the collapsed text (llama.cpp unicode.cpp k_ucat_cpt).
_WS, _NUM, _LET, _PUN, _ACC, _SYM, _OTHER = "\x0b", "\xd1", "\xd2", "\xd3", "\xd4", "\xd5", "\xd0"

_RX_WS = regex.compile(r"\s")
_RX_CATS = [
    (regex.compile(r"\p{N}"), _NUM),
    (regex.compile(r"\p{L}"), _LET),
    (regex.compile(r"\p{P}"), _PUN),
    (regex.compile(r"\p{M}"), _ACC),
    (regex.compile(r"\p{S}"), _SYM),
]


# Code points assigned after Unicode 15.1, the version of llama.cpp's tables (its
# gen-unicode-data.py ran the regex package of that time): llama.cpp sees them as
# unassigned. Found by comparing every code point's class under regex 2023.12.25
# (Unicode 15.1) and a current regex; all were unassigned before.
_NEWER_THAN_15_1 = (
    (0x88F, 0x88F), (0x897, 0x897), (0xC5C, 0xC5C), (0xCDC, 0xCDC), (0x1ACF, 0x1ADD),
    (0x1AE0, 0x1AEB), (0x1B4E, 0x1B4F), (0x1B7F, 0x1B7F), (0x1C89, 0x1C8A),
    (0x20C1, 0x20C1), (0x2427, 0x2429), (0x2B96, 0x2B96), (0x31E4, 0x31E5),
    (0xA7CB, 0xA7CF), (0xA7D2, 0xA7D2), (0xA7D4, 0xA7D4), (0xA7DA, 0xA7DC),
    (0xA7F1, 0xA7F1), (0xFBC3, 0xFBD2), (0xFD90, 0xFD91), (0xFDC8, 0xFDCE),
    (0x105C0, 0x105F3), (0x10940, 0x10959), (0x10D40, 0x10D65), (0x10D69, 0x10D85),
    (0x10D8E, 0x10D8F), (0x10EC2, 0x10EC7), (0x10ED0, 0x10ED8), (0x10EFA, 0x10EFC),
    (0x11380, 0x11389), (0x1138B, 0x1138B), (0x1138E, 0x1138E), (0x11390, 0x113B5),
    (0x113B7, 0x113C0), (0x113C2, 0x113C2), (0x113C5, 0x113C5), (0x113C7, 0x113CA),
    (0x113CC, 0x113D5), (0x113D7, 0x113D8), (0x113E1, 0x113E2), (0x116D0, 0x116E3),
    (0x11B60, 0x11B67), (0x11BC0, 0x11BE1), (0x11BF0, 0x11BF9), (0x11DB0, 0x11DDB),
    (0x11DE0, 0x11DE9), (0x11F5A, 0x11F5A), (0x13460, 0x143FA), (0x16100, 0x16139),
    (0x16D40, 0x16D79), (0x16EA0, 0x16EB8), (0x16EBB, 0x16ED3), (0x16FF2, 0x16FF6),
    (0x187F8, 0x187FF), (0x18CFF, 0x18CFF), (0x18D09, 0x18D1E), (0x18D80, 0x18DF2),
    (0x1CC00, 0x1CCFC), (0x1CD00, 0x1CEB3), (0x1CEBA, 0x1CED0), (0x1CEE0, 0x1CEF0),
    (0x1E5D0, 0x1E5FA), (0x1E5FF, 0x1E5FF), (0x1E6C0, 0x1E6DE), (0x1E6E0, 0x1E6F5),
    (0x1E6FE, 0x1E6FF), (0x1F6D8, 0x1F6D8), (0x1F777, 0x1F77A), (0x1F8B2, 0x1F8BB),
    (0x1F8C0, 0x1F8C1), (0x1F8D0, 0x1F8D8), (0x1FA54, 0x1FA57), (0x1FA89, 0x1FA8A),
    (0x1FA8E, 0x1FA8F), (0x1FABE, 0x1FABE), (0x1FAC6, 0x1FAC6), (0x1FAC8, 0x1FAC8),
    (0x1FACD, 0x1FACD), (0x1FADC, 0x1FADC), (0x1FADF, 0x1FADF), (0x1FAE9, 0x1FAEA),
    (0x1FAEF, 0x1FAEF), (0x1FBCB, 0x1FBEF), (0x1FBFA, 0x1FBFA), (0x2B73A, 0x2B73F),
    (0x2CEA2, 0x2CEAD), (0x323B0, 0x33479),
)
_NEWER_STARTS = [a for a, _ in _NEWER_THAN_15_1]


class _CollapseTable(dict):
    """str.translate table: code point -> its collapsed character, filled on first use.

    ASCII maps to itself; other code points to their category marker (whitespace first,
    as in unicode_regex_split). Unicode categories come from the `regex` package.
    """

    def __missing__(self, cp: int) -> str:
        k = bisect_right(_NEWER_STARTS, cp) - 1
        if cp < 128:
            v = chr(cp)
        elif k >= 0 and cp <= _NEWER_THAN_15_1[k][1]:
            v = _OTHER
        else:
            ch = chr(cp)
            if _RX_WS.match(ch):
                v = _WS
            else:
                v = _OTHER
                for rx, marker in _RX_CATS:
                    if rx.match(ch):
                        v = marker
                        break
        self[cp] = v
        return v


_COLLAPSE = _CollapseTable()


def collapse(text: str) -> str:
    """The collapsed form of `text`: same length, one character per code point."""
    if text.isascii():
        return text
    return text.translate(_COLLAPSE)


# Character-class bodies in the collapsed alphabet (llama.cpp unicode.cpp k_ucat_map).
# \s is std::regex's "C"-locale isspace: \t \n \v \f \r and space (non-ASCII whitespace
# was collapsed to \v); Python's own \s would also match \x1c-\x1f, so it is never used.
S = r"\t\n\x0b\x0c\r "
L = r"\xd2A-Za-z"
N = r"\xd10-9"
P = r"\xd3!-#%-*,-/:;?@\[-\]_{}"
SYM = r"\xd5$+<->^`|"

_CONTRACTIONS_CI = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"

# GPT-2: 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)
# (custom loop in llama.cpp; it also takes a lone whitespace char the regex would skip)
RX_GPT2 = (
    rf"'s|'t|'re|'ve|'m|'ll|'d| ?[{L}]+| ?[{N}]+| ?[^{S}{L}{N}]+|[{S}]+(?![^{S}])|[{S}]+"
)
# Llama 3: (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|
#          ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+   (custom loop in llama.cpp)
RX_LLAMA3 = (
    rf"{_CONTRACTIONS_CI}|[^\r\n{L}{N}]?[{L}]+|[{N}]{{1,3}}| ?[^{S}{L}{N}]+[\r\n]*"
    rf"|[{S}]*[\r\n]+|[{S}]+(?![^{S}])|[{S}]+"
)
# Qwen2: as Llama 3 but single digits (std::regex path).
RX_QWEN2 = (
    rf"{_CONTRACTIONS_CI}|[^\r\n{L}{N}]?[{L}]+|[{N}]| ?[^{S}{L}{N}]+[\r\n]*"
    rf"|[{S}]*[\r\n]+|[{S}]+(?![^{S}])|[{S}]+"
)
# Tekken: llama.cpp's rewrite of [\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}] as (?=[\p{L}])([^a-z]) and
# [\p{Ll}\p{Lm}\p{Lo}\p{M}] as (?=[\p{L}])([^A-Z]) (std::regex path).
_UP = rf"(?:(?=[{L}])[^a-z])"
_LO = rf"(?:(?=[{L}])[^A-Z])"
RX_TEKKEN = (
    rf"[^\r\n{L}{N}]?{_UP}*{_LO}+|[^\r\n{L}{N}]?{_UP}+{_LO}*|[{N}]| ?[^{S}{L}{N}]+[\r\n/]*"
    rf"|[{S}]*[\r\n]+|[{S}]+(?![^{S}])|[{S}]+"
)
RX_DIGIT = rf"[{N}]"
RX_DEFAULT_PUNCT = rf"[{P}$+<=>^~|]+"
RX_DIGITS = rf"[{N}]+"
RX_3DIGITS = r"[0-9][0-9][0-9]"

# Pre-tokenizer families of llama-vocab.cpp: name -> (regex list, ignore_merges, add_bos
# default, clean_spaces). Only the families whose regexes are written above.
_LLAMA3 = ([RX_LLAMA3], True, True)
_QWEN2 = ([RX_QWEN2], False, False)
_SMOLLM = ([RX_DIGIT, RX_GPT2], False, False)
_GPT2 = ([RX_GPT2], False, False)
_TEKKEN = ([RX_TEKKEN], True, True)
_DEFAULT = ([RX_DEFAULT_PUNCT, RX_GPT2, RX_DIGITS, RX_3DIGITS], False, False)

PRE_TYPES: dict[str, tuple[list[str], bool, bool]] = {
    "default": _DEFAULT,
    **dict.fromkeys(
        ["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
         "lfm2", "jina-v5-nano"], _LLAMA3),
    # same regex as Llama 3, without ignore_merges / add_bos
    **dict.fromkeys(["dbrx", "smaug-bpe"], ([RX_LLAMA3], False, False)),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2"],
                    _QWEN2),
    **dict.fromkeys(["smollm", "starcoder", "refact", "command-r", "codeshell", "exaone",
                     "minerva-7b"], _SMOLLM),
    **dict.fromkeys(["gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es",
                     "jina-v2-de", "a.x-4.0", "mellum", "modern-bert", "mpt", "olmo", "jais",
                     "trillion", "granite-docling", "exaone4"], _GPT2),
    "tekken": _TEKKEN,
}


class PreTokenizer:
    """Splits text into words for one `tokenizer.ggml.pre` value.

    words(text) -> list[str]: consecutive substrings of `text` covering it entirely.
    Raises SynapseError for a pre-tokenizer name llama.cpp would not accept or that is
    not implemented here.
    """

    def __init__(self, pre: str, where: str = ""):
        spec = PRE_TYPES.get(pre)
        if spec is None:
            raise SynapseError(f"{where}unsupported tokenizer.ggml.pre '{pre}'")
        self.pre = pre
        exprs, self.ignore_merges, self.add_bos_default = spec
        # Capturing the whole pattern makes re.split return matches and the unmatched
        # stretches between them, in order (empty strings dropped below).
        self._passes = [re.compile(f"({e})").split for e in exprs]

    def words(self, text: str) -> list[str]:
        if not text:
            return []
        c = collapse(text)
        pieces = [c]
        for split in self._passes:
            out: list[str] = []
            for p in pieces:
                if len(p) == 1:  # a single character is always a word of its own
                    out.append(p)
                else:
                    out.extend(split(p))
            pieces = out
        if c is text:
            return [p for p in pieces if p]
        # Map collapsed words back to the original text (collapsing keeps lengths).
        words = []
        pos = 0
        for p in pieces:
            if p:
                end = pos + len(p)
                words.append(text[pos:end])
                pos = end
        return words
