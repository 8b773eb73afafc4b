"""Make tests/data/tokenizer/NAME-random.jsonl: llama.cpp's ids for random strings (reference data).

    LLAMA_CPP_LIB_PATH=~/.cache/synapse_nb/llama.cpp/src/build/bin \\
        ~/.cache/synapse_nb/llama.cpp/venv/bin/python tests/data/tokenizer/make_random.py gemma3 [--n 400] [--seed 33]

Runs llama.cpp itself (llama-cpp-python 0.3.36's bindings over the libllama that
../shared/tools/build-llama-cpp.sh builds) on tests/data/vocab/ggml-vocab-NAME.gguf, loaded vocab-only.
Each random string is tokenized with every (add_special, parse_special) pair by
llama_tokenize; detok is the concatenation of llama_token_to_piece(id, lstrip=0, special=true)
over those ids, decoded as UTF-8 with invalid bytes replaced, as in ../shared's fixtures; the lines have the format of the shared fixtures (text, add_special, parse_special, ids, detok), so
tests/test_tokenizer.py reads them the same way. Not run by the tests: they read its output.

The strings are pieces drawn from pools meant to reach the tokenizer's corners: ASCII words and
punctuation, runs of spaces / tabs / newlines, digits, accented Latin, Greek, Cyrillic, CJK, Hangul,
Devanagari, Arabic, emoji (with ZWJ and skin tones), combining marks, private-use and astral code
points, the vocabulary's own special-token texts, and runs of random vocabulary pieces (long merges).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import random
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

POOLS = [
    "abcdefghijklmnopqrstuvwxyz",
    "ABCDEFGHIJKLMNOPQRSTUVWXYZ",
    "0123456789",
    " !\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~",
    "      \t\n\n\r\u00a0\u3000",
    "àáâãäåæçèéêëìíîïñòóôõöøùúûüýÿßœ",
    "αβγδεζηθικλμνξοπρστυφχψωΑΒΓΔ",
    "абвгдежзийклмнопрстуфхцчшщыэюяЖЩ",
    "的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年",
    "가나다라마바사아자차카타파하한국어",
    "नमस्तेहिन्दीभाषा",
    "مرحبابالعربية",
    "😀😂🥲👍🏽👨\u200d👩\u200d👧🇫🇷❤️✨",
    "e\u0301a\u0308o\u0303\u0327",
    "\ue000\uf8ff\U0001d400\U0001f9ff\U00010348\u200b\ufeff",
]
WORDS = ["the", "The", " hello", "world", "  ", "function", "return", "<", ">", "</s>", "\n\n", "1234567",
         "é", "naïve", "über", "東京", "http://example.com/a?b=c", "def f(x):", "{}", "[]"]


def _specials(model, llama_cpp):
    """The vocabulary's control / user-defined pieces' texts (what parse_special matches)."""
    vocab = llama_cpp.llama_model_get_vocab(model)
    out = []
    for t in range(llama_cpp.llama_vocab_n_tokens(vocab)):
        attr = llama_cpp.llama_vocab_get_attr(vocab, t)
        if attr & (llama_cpp.LLAMA_TOKEN_ATTR_CONTROL | llama_cpp.LLAMA_TOKEN_ATTR_USER_DEFINED):
            out.append(llama_cpp.llama_vocab_get_text(vocab, t).decode("utf-8", "replace"))
    return out


def _pieces(model, llama_cpp, rng, k):
    vocab = llama_cpp.llama_model_get_vocab(model)
    n = llama_cpp.llama_vocab_n_tokens(vocab)
    out = []
    for _ in range(k):
        s = llama_cpp.llama_vocab_get_text(vocab, rng.randrange(n)).decode("utf-8", "replace")
        out.append(s.replace("\u2581", " "))
    return out


def _piece(vocab, token, llama_cpp) -> bytes:
    """llama_token_to_piece(token, lstrip=0, special=true): the shared fixtures' detok is these
    pieces concatenated (not llama_detokenize, which also strips a leading space and cleans spaces)."""
    buf = ctypes.create_string_buffer(256)
    n = llama_cpp.llama_token_to_piece(vocab, token, buf, len(buf), 0, True)
    if n < 0:
        buf = ctypes.create_string_buffer(-n)
        n = llama_cpp.llama_token_to_piece(vocab, token, buf, len(buf), 0, True)
    assert n >= 0, n
    return buf.raw[:n]


def random_text(rng, specials, pieces) -> str:
    parts = []
    for _ in range(rng.randrange(0, 12)):
        r = rng.random()
        if r < 0.45:
            pool = rng.choice(POOLS)
            parts.append("".join(rng.choice(pool) for _ in range(rng.randrange(1, 9))))
        elif r < 0.65:
            parts.append(rng.choice(WORDS))
        elif r < 0.75 and specials:
            parts.append(rng.choice(specials[:64]))
        else:
            parts.append("".join(rng.choice(pieces) for _ in range(rng.randrange(1, 5))))
    return "".join(parts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("name")
    ap.add_argument("--n", type=int, default=400)
    ap.add_argument("--seed", type=int, default=33)
    a = ap.parse_args(argv)
    import llama_cpp

    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    path = HERE.parent / "vocab" / f"ggml-vocab-{a.name}.gguf"
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
    if not model:
        print(f"cannot load {path}", file=sys.stderr)
        return 1
    vocab = llama_cpp.llama_model_get_vocab(model)
    rng = random.Random(f"{a.name}/{a.seed}")
    specials = _specials(model, llama_cpp)
    pieces = _pieces(model, llama_cpp, rng, 2000)
    out_path = HERE / f"{a.name}-random.jsonl"
    tmp = out_path.with_suffix(".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for _ in range(a.n):
            text = random_text(rng, specials, pieces)
            data = text.encode("utf-8")
            for add_special in (False, True):
                for parse_special in (False, True):
                    cap = len(data) + 8
                    buf = (llama_cpp.llama_token * cap)()
                    n = llama_cpp.llama_tokenize(vocab, data, len(data), buf, cap, add_special, parse_special)
                    assert n >= 0, n
                    ids = list(buf[:n])
                    detok = b"".join(_piece(vocab, t, llama_cpp) for t in ids).decode("utf-8", "replace")
                    f.write(json.dumps({"text": text, "add_special": add_special, "parse_special": parse_special,
                                        "ids": ids, "detok": detok}, ensure_ascii=False) + "\n")
    tmp.replace(out_path)
    llama_cpp.llama_model_free(model)
    print(f"{out_path}: {4 * a.n} cases", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
