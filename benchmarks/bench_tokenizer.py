"""Tokenizer benchmark: load time and tokenization throughput (MB/s), printed, not asserted.

Text: 1 MB (UTF-8) of deterministic multilingual text: English prose (docstrings of the
standard library), code-like lines with numbers, and Zipf-distributed words in Latin
with diacritics, Cyrillic, Greek, Chinese, Japanese, Arabic, Devanagari, Thai and
emoji. Throughput is measured on a fresh tokenizer (cold word cache: a user's long
prompt is seen once) and again on the same one (warm).

usage: python benchmarks/bench_tokenizer.py [--mb 1.0] [VOCAB ...]
VOCAB names a tests/data/vocab/ggml-vocab-VOCAB.gguf file or is a path to a GGUF file.
"""

from __future__ import annotations

import argparse
import importlib
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from synapse_nb.gguf_file import open_gguf  # noqa: E402
from synapse_nb.tokenizer import Tokenizer  # noqa: E402

SCRIPTS = {
    "latin": "abcdefghijklmnopqrstuvwxyzàáâäãåçèéêëìíîïñòóôöõùúûüýÿßœæ",
    "cyrillic": "абвгдеёжзийклмнопрстуфхцчшщъыьэюя",
    "greek": "αβγδεζηθικλμνξοπρστυφχψωάέήίόύώ",
    "chinese": "的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年得就那要下以生会自着去之过家学对可她里后小么心多天而能好都然没日于起还发成事只作当想看文无开手十用主行方又如前所本见经头面公同三已老从动两长知民样现分将外但身些与高意进把法此实回二理美点月明",
    "japanese": "あいうえおかきくけこさしすせそたちつてとなにぬねのはひふへほまみむめもやゆよらりるれろわをんアイウエオカキクケコサシスセソタチツテト",
    "arabic": "ابتثجحخدذرزسشصضطظعغفقكلمنهوي",
    "devanagari": "अआइईउऊएऐओऔकखगघचछजझटठडढणतथदधनपफबभमयरलवशषसहािीुूेैोौं्",
    "thai": "กขคงจฉชซญดตถทธนบปผพฟภมยรลวศษสหอฮะาิีึืุูเแโใไ่้๊๋",
}
EMOJI = "😀😁😂🤣😊😍🤔🙄😴🥳🚀🦙✅❤️👍🎉🔥💡📚🌍"
NO_SPACE = {"chinese", "japanese", "thai"}


def english_prose() -> str:
    parts = []
    # standard-library modules only (never whatever else is on sys.path)
    for name in sorted(sys.stdlib_module_names):
        if name.startswith("_") or name in ("this", "antigravity", "idlelib", "tkinter",
                                            "turtle", "turtledemo", "test", "__main__"):
            continue
        try:
            doc = importlib.import_module(name).__doc__
        except Exception:  # noqa: BLE001 - any import failure just skips the module
            continue
        if doc:
            parts.append(doc)
        if sum(map(len, parts)) > 400_000:
            break
    return "\n\n".join(parts)


def multilingual_text(n_bytes: int, seed: int = 1234) -> str:
    rng = random.Random(seed)
    lexicons = {}
    for name, chars in SCRIPTS.items():
        lex = []
        for _ in range(4000):
            k = max(1, int(rng.expovariate(1 / 5)) + 1)
            lex.append("".join(rng.choice(chars) for _ in range(k)))
        lexicons[name] = lex
    weights = [1.0 / (r + 1) for r in range(4000)]  # Zipf
    prose = english_prose()
    out, size, pi = [], 0, 0
    while size < n_bytes:
        kind = rng.random()
        if kind < 0.45 and prose:  # a slice of English prose
            k = rng.randint(200, 1500)
            chunk = prose[pi:pi + k]
            pi = (pi + k) % max(1, len(prose) - 1500)
        elif kind < 0.55:  # code-like line with numbers
            chunk = (f"    x_{rng.randint(0, 999)} = compute({rng.randint(0, 10**6)}, "
                     f"{rng.random():.6f}, '{rng.choice(['a', 'bc', 'def'])}')  # step {rng.randint(1, 99)}\n")
        else:
            script = rng.choice(list(SCRIPTS))
            words = rng.choices(lexicons[script], weights, k=rng.randint(5, 40))
            sep = "" if script in NO_SPACE else " "
            chunk = sep.join(words)
            if rng.random() < 0.3:
                chunk += " " + rng.choice(EMOJI)
            chunk += rng.choice([". ", "。", "，", "! ", "?\n", "\n\n", ", "])
        out.append(chunk)
        size += len(chunk.encode())
    text = "".join(out)
    data = text.encode()[:n_bytes]
    return data.decode("utf-8", "ignore")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, default=1.0)
    ap.add_argument("vocabs", nargs="*", default=["llama-bpe", "qwen2", "llama-spm"])
    args = ap.parse_args()
    text = multilingual_text(int(args.mb * 1_000_000))
    n = len(text.encode())
    print(f"text: {n / 1e6:.2f} MB UTF-8, {len(text)} characters")
    t0 = time.perf_counter()
    Tokenizer.from_kv(open_gguf(ROOT / "tests/data/vocab/ggml-vocab-llama-spm.gguf").meta)
    print(f"first tokenizer build (Numba kernels from cache): {time.perf_counter() - t0:.2f} s")
    for name in args.vocabs:
        path = Path(name) if name.endswith(".gguf") else ROOT / f"tests/data/vocab/ggml-vocab-{name}.gguf"
        t0 = time.perf_counter()
        g = open_gguf(path)
        t1 = time.perf_counter()
        tok = Tokenizer.from_kv(g.meta)
        t2 = time.perf_counter()
        ids = tok.tokenize(text, add_special=True, parse_special=False)
        t3 = time.perf_counter()
        tok.tokenize(text, add_special=True, parse_special=False)
        t4 = time.perf_counter()
        tok.detokenize(ids)
        t5 = time.perf_counter()
        print(f"{path.name}: open_gguf {t1 - t0:.3f} s, tokenizer build {t2 - t1:.3f} s; "
              f"tokenize {n / 1e6 / (t3 - t2):.2f} MB/s cold, {n / 1e6 / (t4 - t3):.2f} MB/s warm "
              f"({len(ids)} tokens); detokenize {n / 1e6 / (t5 - t4):.2f} MB/s")


if __name__ == "__main__":
    main()
