"""Benchmark synapse_nb against llama.cpp on the same machine, in the same run.

    python benchmarks/bench.py MODEL [MODEL ...] [--runs 3] [--threads 2] [--no-llama-cpp]

MODEL is a models.txt name or a GGUF path. For each model it prints:
- load time (GGUF header, vocabulary, tensor table), in-process;
- kernel compile time with a cold cache (a fresh NUMBA_CACHE_DIR), and the warm
  start: wall time from launching a fresh process to its first generated token;
- prefill tokens/s on a 128-token prompt (two 64-token batches) and decode
  tokens/s over 64 generated tokens, with --threads threads;
- peak RSS of the process that ran prefill and decode.
Every figure is the median of --runs runs (each in a fresh process). When
llama_cpp (pip install llama-cpp-python) is importable, llama.cpp is measured
on the same prompt and settings (n_threads, n_batch = n_ubatch = 64, F16 KV
cache, flash attention off) and the ratios ours / llama.cpp are printed.
Nothing here is asserted: it prints numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

N_PROMPT = 128
N_DECODE = 64
PROMPT_TEXT = ("The history of the city begins with a small settlement on the river, where fishermen and traders "
               "built their houses of wood and stone. Over the centuries it grew into a market town, then a port, "
               "and finally the capital of a province whose roads reached every valley of the region. ")


def _prompt_ids(tokenize, bos):
    ids = tokenize(PROMPT_TEXT * 8)
    ids = ([bos] if bos is not None else []) + [t for t in ids if t != bos]
    return ids[:N_PROMPT]


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


# ------------------------------------------------------------------ children (one measurement each)

def child_ours(model: str, threads: int, mode: str) -> dict:
    t0 = time.perf_counter()
    import numpy as np

    import synapse_nb

    model_obj = synapse_nb.load_model(model)
    t_load = time.perf_counter()
    model_obj.warmup()
    t_compile = time.perf_counter()
    tok = model_obj.tokenizer
    ids = _prompt_ids(lambda s: tok.tokenize(s, add_special=False, parse_special=False), tok.bos_id)
    sess = model_obj.new_session(n_ctx=N_PROMPT + N_DECODE + 8, n_threads=threads)
    if mode == "start":  # command start to the first generated token
        logits = sess.eval(ids[:16])
        int(np.argmax(logits))
        return {"load_s": t_load - t0, "compile_s": t_compile - t_load, "first_token_s": time.perf_counter() - t0}
    tp = time.perf_counter()
    logits = sess.eval(ids)
    prefill_s = time.perf_counter() - tp
    nxt = int(np.argmax(logits))
    td = time.perf_counter()
    for _ in range(N_DECODE):
        nxt = int(np.argmax(sess.eval([nxt])))
    decode_s = time.perf_counter() - td
    return {"load_s": t_load - t0, "compile_s": t_compile - t_load, "prefill_tps": len(ids) / prefill_s,
            "decode_tps": N_DECODE / decode_s, "peak_rss_mb": _peak_rss_mb()}


def child_llama_cpp(model: str, threads: int, mode: str) -> dict:
    t0 = time.perf_counter()
    import llama_cpp
    import numpy as np
    from llama_cpp import Llama

    llm = Llama(model_path=model, n_ctx=N_PROMPT + N_DECODE + 8, n_batch=64, n_ubatch=64, n_threads=threads,
                n_threads_batch=threads, flash_attn=False, logits_all=False, verbose=False)
    t_load = time.perf_counter()
    ids = _prompt_ids(lambda s: llm.tokenize(s.encode(), add_bos=False, special=False), llm.token_bos())

    def last_logits():  # the last evaluated row (only it is computed without logits_all)
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),))

    if mode == "start":
        llm.eval(ids[:16])
        int(np.argmax(last_logits()))
        return {"load_s": t_load - t0, "compile_s": 0.0, "first_token_s": time.perf_counter() - t0}
    tp = time.perf_counter()
    llm.eval(ids)
    prefill_s = time.perf_counter() - tp
    nxt = int(np.argmax(last_logits()))
    td = time.perf_counter()
    for _ in range(N_DECODE):
        llm.eval([nxt])
        nxt = int(np.argmax(last_logits()))
    decode_s = time.perf_counter() - td
    return {"load_s": t_load - t0, "compile_s": 0.0, "prefill_tps": len(ids) / prefill_s,
            "decode_tps": N_DECODE / decode_s, "peak_rss_mb": _peak_rss_mb()}


# ------------------------------------------------------------------ parent

def _spawn(impl: str, model: str, threads: int, mode: str, env=None) -> dict:
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, __file__, "--child", impl, mode, model, str(threads)],
                         capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if res.returncode != 0:
        raise RuntimeError(f"{impl} {mode} failed:\n{res.stderr[-2000:]}")
    out = json.loads(res.stdout.strip().splitlines()[-1])
    out["wall_s"] = wall
    return out


def _median(rows, key):
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(vals) if vals else float("nan")


def bench_model(model: str, runs: int, threads: int, with_llama: bool) -> None:
    from synapse_nb.models import resolve_model

    path = str(resolve_model(model))
    size_mb = os.path.getsize(path) / 2**20
    print(f"\n## {model}  ({size_mb:.0f} MiB, {threads} threads, {runs} runs, median)")

    with tempfile.TemporaryDirectory() as cache:  # cold cache: every kernel compiles
        cold = _spawn("ours", path, threads, "start", env={**os.environ, "NUMBA_CACHE_DIR": cache})
    _spawn("ours", path, threads, "start")  # make sure the normal cache is warm
    ours_start = [_spawn("ours", path, threads, "start") for _ in range(runs)]
    ours_run = [_spawn("ours", path, threads, "run") for _ in range(runs)]
    rows = [
        ("load (s)", _median(ours_run, "load_s"), None),
        ("compile, cold cache (s)", cold["compile_s"], None),
        ("kernel cache load, warm (s)", _median(ours_start, "compile_s"), None),
        ("warm start to first token (s)", _median(ours_start, "wall_s"), None),
        ("prefill 128 tok (tok/s)", _median(ours_run, "prefill_tps"), None),
        ("decode 64 tok (tok/s)", _median(ours_run, "decode_tps"), None),
        ("peak RSS (MiB)", _median(ours_run, "peak_rss_mb"), None),
    ]
    if with_llama:
        ll_start = [_spawn("llama_cpp", path, threads, "start") for _ in range(runs)]
        ll_run = [_spawn("llama_cpp", path, threads, "run") for _ in range(runs)]
        ref = {"load (s)": _median(ll_run, "load_s"), "warm start to first token (s)": _median(ll_start, "wall_s"),
               "prefill 128 tok (tok/s)": _median(ll_run, "prefill_tps"),
               "decode 64 tok (tok/s)": _median(ll_run, "decode_tps"),
               "peak RSS (MiB)": _median(ll_run, "peak_rss_mb")}
        rows = [(k, v, ref.get(k)) for k, v, _ in rows]
    print(f"| {'figure':<32} | {'synapse_nb':>11} | {'llama.cpp':>10} | {'ratio':>6} |")
    print(f"|{'-' * 34}|{'-' * 13}|{'-' * 12}|{'-' * 8}|")
    for k, v, r in rows:
        rs = f"{r:10.2f}" if r is not None else f"{'-':>10}"
        ratio = f"{v / r:6.2f}" if r else f"{'-':>6}"
        print(f"| {k:<32} | {v:11.2f} | {rs} | {ratio} |")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        impl, mode, model, threads = sys.argv[2:6]
        fn = child_ours if impl == "ours" else child_llama_cpp
        print(json.dumps(fn(model, int(threads), mode)))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-llama-cpp", action="store_true")
    a = ap.parse_args()
    try:
        import llama_cpp  # noqa: F401

        with_llama = not a.no_llama_cpp
    except ImportError:
        with_llama = False
        print("llama_cpp not importable: measuring synapse_nb only (pip install llama-cpp-python)")
    print(f"machine: {os.cpu_count()} cores, {os.uname().machine}, python {sys.version.split()[0]}")
    for m in a.models:
        bench_model(m, a.runs, a.threads, with_llama)


if __name__ == "__main__":
    main()
