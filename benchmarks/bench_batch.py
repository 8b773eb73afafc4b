"""Batch mode against one llama-decode run per prompt.

    python benchmarks/bench_batch.py [MODEL] [--prompts 32] [--n-predict 32]

For --prompts prompts of --n-predict tokens each (--ignore-eos, so every prompt generates
exactly that many), it times, as wall clock of the whole command:
  - `llama-decode MODEL --batch IN --output OUT --workers 1 -t 2` (one process, 2 threads);
  - the same with `--workers 2 -t 1` (2 worker processes of 1 thread);
  - one `llama-decode MODEL PROMPT --json -t 2` run per prompt, one after the other (half of
    them before the batch runs and half after, so that a change of load over the run weighs on
    both sides alike).
It prints total seconds and generated tokens/s of each, and the start-up of a separate run
(its wall time minus the prompt and decode times it reports in --json timings; the median).
Then it checks what batch mode is for: its total time is at most the separate runs' total
minus (prompts - 1) start-ups, i.e. it pays start-up once. Numba's cache is warmed first.
The numbers are wall-clock: on a shared machine they move with the load. Nothing is asserted
(exit 0); the check's outcome is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOPICS = ["the sea", "a mountain", "bread", "winter", "a library", "the moon", "a train", "music", "a garden",
          "rain", "a city at night", "coffee", "a river", "friendship", "an old clock", "the desert", "snow",
          "a lighthouse", "chess", "a forest", "the sun", "a bridge", "a cat", "autumn", "a market", "the wind",
          "a ship", "mathematics", "a castle", "spring", "an island", "the stars"]


def cli(*args) -> tuple[float, subprocess.CompletedProcess]:
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "cli.main", *map(str, args)], capture_output=True, cwd=ROOT)
    dt = time.perf_counter() - t0
    if res.returncode != 0:
        sys.exit(f"llama-decode {' '.join(map(str, args))} failed:\n{res.stderr.decode()}")
    return dt, res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", nargs="?", default="smollm2-135m-instruct-q4_1")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n-predict", type=int, default=32)
    a = ap.parse_args()
    prompts = [f"Write one sentence about {TOPICS[i % len(TOPICS)]}." for i in range(a.prompts)]
    n = a.n_predict
    total_tokens = n * len(prompts)
    cli(a.model, "warm up", "-n", 2)  # compile or load the kernels once, outside the timings

    with tempfile.TemporaryDirectory() as d:
        inp = Path(d) / "in.jsonl"
        inp.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n" for i, p in enumerate(prompts)))
        walls, startups, got = [], [], 0

        def separate(ps):
            nonlocal got
            for p in ps:
                dt, res = cli(a.model, p, "-n", n, "--ignore-eos", "--json", "-t", 2)
                doc = json.loads(res.stdout)
                got += len(doc["tokens"])
                walls.append(dt)
                startups.append(dt - (doc["timings"]["prompt_ms"] + doc["timings"]["eval_ms"]) / 1e3)

        half = len(prompts) // 2
        separate(prompts[:half])
        rows = []
        for label, extra in (("batch, 1 worker x 2 threads", ["--workers", 1, "-t", 2]),
                             ("batch, 2 workers x 1 thread", ["--workers", 2, "-t", 1])):
            out = Path(d) / f"out{len(rows)}.jsonl"
            dt, _ = cli(a.model, "--batch", inp, "--output", out, "-n", n, "--ignore-eos", *extra)
            got = sum(len(json.loads(line)["tokens"]) for line in out.read_text().splitlines())
            assert got == total_tokens, (got, total_tokens)
            rows.append((label, dt, got))

        separate(prompts[half:])
        total_separate = sum(walls)
        rows.append((f"{len(prompts)} separate runs x 2 threads", total_separate, got))

    startup = statistics.median(startups)
    print(f"{len(prompts)} prompts x {n} tokens, {a.model}, {os.cpu_count()} cores")
    print(f"{'mode':34s} {'total s':>8s} {'tokens/s':>9s}")
    for label, dt, tokens in rows:
        print(f"{label:34s} {dt:8.2f} {tokens / dt:9.1f}")
    print(f"start-up of one separate run (median wall - prompt - eval): {startup:.2f} s")
    bound = total_separate - (len(prompts) - 1) * startup
    for label, dt, _ in rows[:2]:
        ok = dt <= bound
        print(f"check {label}: {dt:.2f} s {'<=' if ok else '>'} separate total {total_separate:.2f} s - "
              f"{len(prompts) - 1} x {startup:.2f} s start-up = {bound:.2f} s: {'holds' if ok else 'DOES NOT HOLD'}")


if __name__ == "__main__":
    main()
