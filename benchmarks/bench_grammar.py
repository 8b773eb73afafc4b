"""Cost of a grammar (synapse_nb.grammar) against a decode step, with json.gbnf on Qwen2.5's vocabulary.

    python benchmarks/bench_grammar.py [MODEL] [-n N] [-t THREADS] [--grammar-file F]

Loads MODEL (default qwen2.5-coder-0.5b-instruct-q4_k_m: 151,936 tokens) and generates up to N
tokens for a chat prompt asking for JSON, twice with the same sampler (--temp 0.8 --seed 42):
without a grammar and with json.gbnf (tests/data/grammar/json.gbnf). Prints the one-time
vocabulary index, the decode step, the grammar's time per token (the check of the chain's token,
the whole-vocabulary mask on redraws, the accept; and the chain's second run on redraws), and the
whole-vocabulary mask on its own at each step of the constrained run (the cost if every step
redrew). Nothing is asserted.
"""

import argparse
import statistics
import time
from pathlib import Path


import synapse_nb
from synapse_nb.grammar import Grammar, GrammarMatcher
from synapse_nb.sampling import Sampler, warmup
from synapse_nb.compilation.warmup import warmup as session_warmup
from synapse_nb.session import Session

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "<|im_start|>user\nDescribe a cat as a JSON object.<|im_end|>\n<|im_start|>assistant\n"


class Timed:
    """Wraps a GrammarMatcher: time spent in its methods."""

    def __init__(self, m):
        self.m, self.t, self.masks = m, 0.0, 0

    def __getattr__(self, name):
        f = getattr(self.m, name)
        if name not in ("allows", "allowed_mask", "accept"):
            return f

        def timed(*a):
            t0 = time.perf_counter()
            try:
                return f(*a)
            finally:
                self.t += time.perf_counter() - t0
                self.masks += name == "allowed_mask"
        return timed


def run(model, ids, n, threads, grammar=None):
    s = Session(model, n_threads=threads)
    smp = Sampler(temp=0.8, seed=42, grammar=grammar)
    smp.accept_many(ids)
    logits = s.eval(ids)
    steps, t_sample = [], 0.0
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        tok = smp.sample(logits)
        t_sample += time.perf_counter() - t0
        out.append(tok)
        if tok in model.tokenizer.eog_ids:
            break
        t0 = time.perf_counter()
        logits = s.eval([tok])
        steps.append(time.perf_counter() - t0)
    return out, steps, t_sample


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default="qwen2.5-coder-0.5b-instruct-q4_k_m")
    ap.add_argument("-n", type=int, default=96)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--grammar-file", default=str(ROOT / "tests" / "data" / "grammar" / "json.gbnf"))
    a = ap.parse_args()
    model = synapse_nb.load_model(a.model)
    tok = model.tokenizer
    session_warmup(model)
    warmup()
    ids = tok.tokenize(PROMPT, add_special=True, parse_special=True)
    g = Grammar(Path(a.grammar_file).read_text(), tokenizer=tok)
    t0 = time.perf_counter()
    GrammarMatcher(g, tok)
    t_index = time.perf_counter() - t0

    _, steps0, ts0 = run(model, ids, a.n, a.threads)
    tm = Timed(GrammarMatcher(g, tok))
    out, steps1, ts1 = run(model, ids, a.n, a.threads, grammar=tm)
    n1 = len(out)
    step = statistics.median(steps0 + steps1)
    # the whole-vocabulary mask at each step of the constrained run (transitions cached, as in a run)
    m = GrammarMatcher(g, tok)
    masks = []
    for t in out:
        t0 = time.perf_counter()
        m.allowed_mask()
        masks.append(time.perf_counter() - t0)
        m.accept(t)
    ms = 1e3
    print(f"model {a.model}, n_vocab {tok.n_vocab}, grammar {Path(a.grammar_file).name}, {a.threads} threads")
    print(f"{'what':58s} {'ms':>8s} {'% of a step':>12s}")
    rows = [
        ("vocabulary index (once per vocabulary and process)", t_index, None),
        ("decode step (median)", step, 1.0),
        ("sampling, no grammar (per token)", ts0 / max(1, len(steps0) + 1), None),
        (f"sampling with the grammar (per token; {tm.masks} redraws in {n1} tokens)", ts1 / n1, None),
        ("  of which in the grammar (check, masks on redraws, accept)", tm.t / n1, None),
        ("whole-vocabulary mask alone (median over the run's steps)", statistics.median(masks), None),
        ("whole-vocabulary mask alone (max)", max(masks), None),
    ]
    for what, t, _ in rows:
        print(f"{what:58s} {t * ms:8.3f} {100 * t / step:11.2f}%")
    extra = (ts1 - ts0 * n1 / max(1, len(steps0) + 1)) / n1
    print(f"a constrained token costs {100 * extra / step:+.2f}% of a decode step more than an unconstrained one")


if __name__ == "__main__":
    main()
