"""Cost of llama.cpp's sampler chain (synapse_nb.Sampler) against a decode step.

    python benchmarks/bench_sampling.py [MODEL] [--reps N]

Loads MODEL (default qwen2.5-coder-0.5b-instruct-q4_k_m: 151,936 logits), evaluates a short
prompt, times decode steps (median of 16) and Sampler.sample on the last logits row for a few
configurations (median of --reps calls each), and prints microseconds and the ratio to a step.
"""

import argparse
import time

import numpy as np

import synapse_nb
from synapse_nb.sampling import Sampler, warmup
from synapse_nb.compilation.warmup import warmup as session_warmup
from synapse_nb.session import Session

CONFIGS = {
    "llama.cpp defaults (top-k 40, top-p 0.95, min-p 0.05, temp 0.8)": {},
    "defaults + --ignore-eos bias + repeat-penalty 1.1": {"repeat_penalty": 1.1, "_eog": True},
    "top-k 0 (top-p's adaptive sort over the vocabulary)": {"top_k": 0},
    "top-k 1000 (bucket sort)": {"top_k": 1000},
    "everything off, temp 1 (dist over the vocabulary)": {"top_k": 0, "top_p": 1.0, "min_p": 0.0, "temp": 1.0},
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default="qwen2.5-coder-0.5b-instruct-q4_k_m")
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("-t", "--threads", type=int, default=2)
    a = ap.parse_args()
    m = synapse_nb.load_model(a.model)
    session_warmup(m)
    warmup()
    s = Session(m, n_threads=a.threads)
    ids = m.tokenizer.tokenize("def fibonacci(n):", add_special=True, parse_special=True)
    logits = s.eval(ids)
    steps = []
    tok = int(np.argmax(logits))
    for _ in range(16):
        t0 = time.perf_counter()
        logits = s.eval([tok])
        steps.append(time.perf_counter() - t0)
        tok = int(np.argmax(logits))
    step_us = 1e6 * float(np.median(steps))
    print(f"{a.model}: n_vocab {logits.shape[0]}, decode step {step_us / 1e3:.2f} ms (median of 16, {a.threads} threads)")
    for name, cfg in CONFIGS.items():
        cfg = dict(cfg)
        bias = [(t, float("-inf")) for t in sorted(m.tokenizer.eog_ids)] if cfg.pop("_eog", False) else []
        smp = Sampler(seed=42, logit_bias=bias, **cfg)
        smp.accept_many(ids)
        times = []
        for _ in range(a.reps):
            t0 = time.perf_counter()
            smp.sample(logits)
            times.append(time.perf_counter() - t0)
        us = 1e6 * float(np.median(times))
        print(f"  {name}: {us:8.1f} us/sample = {100 * us / step_us:5.2f}% of a decode step")


if __name__ == "__main__":
    main()
