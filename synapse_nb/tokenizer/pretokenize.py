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

Known divergence: llama.cpp's tables were generated with an older Unicode (15.x);
code points assigned since (Unicode 16/17, e.g. U+1C89, Garay, Tulu-Tigalari) are
"undefined" there but letters/numbers/symbols here.
"""

from __future__ import annotations

import re

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


class _CollapseTable(dict):
    """str.translate table: code point -> its collapsed character, filled on first use.

    ASCII maps to itself; other code points to their category marker (whitespace first,
    as in unicode_regex_split). Unicode categories come from the `regex` package.
    """

    def __missing__(self, cp: int) -> str:
        if cp < 128:
            v = chr(cp)
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
