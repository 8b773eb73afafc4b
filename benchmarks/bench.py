"""Benchmark synapse_nb against llama.cpp on the same machine, in the same run.

    python benchmarks/bench.py MODEL [MODEL ...] [--runs 3] [--threads 2]
                               [--only short,long,start,compile,rss,scaling,parallel] [--llama-bin DIR]
                               [--no-llama-cpp]

MODEL is a models.txt name or a GGUF path. llama.cpp is run from its own tools (llama-bench,
llama-completion), built by ../shared/tools/build-llama-cpp.sh into
${XDG_CACHE_HOME:-~/.cache}/synapse_nb/llama.cpp/src/build/bin (or --llama-bin / $LLAMA_CPP_BIN),
in two settings:
  default       what a llama.cpp user gets: weight repacking on, flash attention auto, its batch sizes;
  like-for-like as synapse_nb runs: --repack 0, -fa off, -b 64 -ub 64 (the fixtures' settings),
                beside ours at -b 64 (its prefill rows; ours runs -b 512 by default, as llama.cpp's
                n_ubatch: the "synapse_nb" column).
Figures (each the median over --runs repetitions; every ratio is ours / llama.cpp, higher is
better for tok/s, lower for seconds and MiB; short and long run ours and llama.cpp's two
settings in interleaved rounds, one repetition each, so that drift falls on all three):
  short    prefill of 128 and 512 tokens (tok/s) and decode of 64 tokens (tok/s), as llama-bench
           -p / -n: timed in-process after a warm-up, each repetition from an empty cache;
  long     prefill of 3000 tokens, and decode of 32 tokens after a 3000-token prompt (-n 32 -d 3000);
  start    wall time and peak RSS of a whole 1-token run of "Hello" with -c 512
           (llama-decode vs llama-completion), a fresh process each;
  compile  the kernel compile time of a first run (a cold Numba cache);
  rss      peak RSS with a full 4096-token context (a 4064-token prompt, then 32 tokens decoded);
  scaling  decode of 64 tokens on 1 thread and on --threads, each side's ratio of the two, beside the
           machine's own: a plain parallel read of 384 MiB (beyond the L3) on 1 and on --threads, in
           the same process and rounds as our decodes. A decode streams its weights every token, so
           its ratio is at most (read GB/s on --threads) / (its GB/s on 1 thread); that bound is
           printed too, and the share of the read a 1.7x ratio would need (not in the default
           --only: it adds ~1 minute a model).
  parallel N = 1, 2, 4, 8, 16 sequences decoded together (synapse_nb.ParallelSession), each a 128-token
           prompt and 128 generated tokens, beside llama-batched-bench -npp 128 -ntg 128 -npl 1,2,4,8,16:
           aggregate prompt tok/s (all N prompts, 64-row steps), aggregate generation tok/s (N tokens a
           step) and the peak RSS of the process (one process per N). Ours: the prompts are evaluated
           with a 1-token generation, then the same N prompts are added again: each takes the slot
           holding its prompt (the prefix cache) and generates 128 tokens, timed (not in the default
           --only).
Nothing here is asserted: it prints numbers. The machine is shared: compare ratios from one run.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from synapse_nb.compilation.warmup import warmup as session_warmup
from synapse_nb.session import DEFAULT_N_BATCH, Session

ROOT = Path(__file__).resolve().parents[1]
LFL_BATCH = 64
LIKE_FOR_LIKE = ["--repack", "0", "-fa", "off", "-b", str(LFL_BATCH), "-ub", str(LFL_BATCH)]


def _llama_bin(arg: str | None) -> Path | None:
    cands = [arg, os.environ.get("LLAMA_CPP_BIN"),
             str(Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "synapse_nb/llama.cpp/src/build/bin")]
    for c in cands:
        if c and (Path(c) / "llama-bench").is_file():
            return Path(c)
    return None


def _run(cmd, env=None, stdin=subprocess.DEVNULL) -> tuple[float, float, subprocess.CompletedProcess]:
    """Run cmd; returns (wall seconds, peak RSS MiB of the child, completed process)."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=stdin, env=env)
    out, err = p.stdout.read(), p.stderr.read()
    _, status, ru = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    p.returncode = os.waitstatus_to_exitcode(status)
    res = subprocess.CompletedProcess(cmd, p.returncode, out, err)
    if res.returncode != 0:
        hint = ""
        if res.returncode == -signal.SIGILL and "llama" in Path(str(cmd[0])).name:
            # seen on a Sapphire Rapids VM (2026-12-05) whose CPU flags list amx_int8 but whose
            # hypervisor traps the tile instructions: ggml's -march=native build uses them
            hint = ("\nillegal instruction: this llama.cpp build uses an instruction the host does not run (AMX "
                    "tiles, on a VM that lists amx flags?); rebuild it with CMAKE_C_FLAGS and CMAKE_CXX_FLAGS "
                    "'-mno-amx-tile -mno-amx-int8 -mno-amx-bf16' (cmake -S src -B src/build ... && ninja -C src/build)")
        raise RuntimeError(f"{' '.join(map(str, cmd))} failed ({res.returncode}):\n{err.decode()[-2000:]}{hint}")
    return wall, ru.ru_maxrss / 1024.0, res


# ------------------------------------------------------------------ our side, one child process per test

def _timed_decode(s, tok: int, n_gen: int) -> float:
    """tok/s of n_gen greedy single-token evals of Session s, starting from token tok."""
    import numpy as np

    t0 = time.perf_counter()
    for _ in range(n_gen):
        tok = int(np.argmax(s.eval([tok])))
    return n_gen / (time.perf_counter() - t0)


def child(model: str, threads: int, test: str, n_prompt: int, n_gen: int, depth: int, reps: int,
          n_batch: int) -> dict:
    """In-process timing as llama-bench does it: a warm-up, then `reps` repetitions, each from an empty
    cache; pp = prefill of n_prompt tokens in n_batch-token batches, tg = n_gen single-token decodes after
    a depth-token prefill (untimed). Token ids are fixed pseudo-random ids, as llama-bench's."""
    import numpy as np

    import synapse_nb

    m = synapse_nb.load_model(model)
    session_warmup(m)
    rng = np.random.default_rng(0)
    n_vocab = m.hparams.n_vocab
    n_ctx = max(16, depth + n_prompt + n_gen)
    s = Session(m, n_ctx=n_ctx, n_threads=threads, n_batch=n_batch)
    samples = []
    for r in range(reps + 1):  # the first is the warm-up
        s.reset()
        if test == "pp":
            ids = rng.integers(0, n_vocab, n_prompt).tolist()
            t0 = time.perf_counter()
            s.eval(ids)
            dt = time.perf_counter() - t0
            samples.append(n_prompt / dt)
        else:
            if depth:
                s.eval(rng.integers(0, n_vocab, depth).tolist())
            samples.append(_timed_decode(s, int(rng.integers(0, n_vocab)), n_gen))
    return {"tps": statistics.median(samples[1:])}


def child_scaling(model: str, threads: int, n_gen: int, reps: int) -> dict:
    """Decode tok/s at 1 thread and at `threads` (fixed counts, Numba's set_num_threads) and the
    machine's read GB/s at each, in `reps` rounds of [read 1, read N, decode 1, decode N]; medians,
    and the weight bytes one decode step reads (every layer's matmuls and the output head)."""
    import numba
    import numpy as np
    from _read_bandwidth import read_kernel

    import synapse_nb

    read_sum = read_kernel()  # as bench_kernels' memory read
    buf = np.ones((3072, 16384), np.uint64)  # 384 MiB in rows of 128 KiB
    sums = np.zeros(buf.shape[0], np.uint64)

    def read(t):
        numba.set_num_threads(t)
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            read_sum(buf, sums)
            best = min(best, time.perf_counter() - t0)
        return buf.nbytes / best / 1e9

    m = synapse_nb.load_model(model)
    session_warmup(m)
    weights = m.weights
    per_token = weights.output.rows.nbytes + sum(getattr(L, w).rows.nbytes for L in weights.layers
                                                 for w in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"))
    rng = np.random.default_rng(0)
    s = Session(m, n_ctx=n_gen + 8)  # n_threads None: the count set here holds for every step

    def decode(t):
        numba.set_num_threads(t)
        s.reset()
        return _timed_decode(s, int(rng.integers(0, m.hparams.n_vocab)), n_gen)

    for t in (1, threads):  # warm-up: compile the read, wake the threads
        read_sum(buf, sums)
        decode(t)
    rows = [(read(1), read(threads), decode(1), decode(threads)) for _ in range(reps)]
    med = [statistics.median(r[i] for r in rows) for i in range(4)]
    return {"read1": med[0], "readN": med[1], "tps1": med[2], "tpsN": med[3], "bytes": per_token}


def child_parallel(model: str, threads: int, n_seq: int, n_prompt: int, n_gen: int, reps: int) -> dict:
    """Aggregate prompt and generation tok/s of n_seq sequences in one ParallelSession (medians of reps,
    after a warm-up round), as llama-batched-bench measures them: all prompts (S_PP), then n_gen
    tokens for every sequence (S_TG). Greedy, the end of generation not honoured."""
    import numpy as np

    import synapse_nb
    from synapse_nb.parallel import ParallelSession

    m = synapse_nb.load_model(model)
    session_warmup(m)
    rng = np.random.default_rng(0)
    pp, tg = [], []
    for r in range(reps + 1):
        ps = ParallelSession(m, n_seq=n_seq, n_ctx=n_prompt + n_gen + 8, n_threads=threads)
        prompts = [rng.integers(0, m.hparams.n_vocab, n_prompt).tolist() for _ in range(n_seq)]
        t0 = time.perf_counter()
        for p in prompts:
            ps.add(p, 1, ignore_eos=True)
        ps.run()
        t1 = time.perf_counter()
        seqs = [ps.add(p, n_gen, ignore_eos=True) for p in prompts]  # each reuses its slot's prompt
        ps.run()
        t2 = time.perf_counter()
        assert all(q.n_reused == n_prompt - 1 and len(q.tokens) == n_gen for q in seqs)
        pp.append(n_seq * n_prompt / (t1 - t0))
        tg.append(n_seq * n_gen / (t2 - t1))
    return {"pp": statistics.median(pp[1:]), "tg": statistics.median(tg[1:])}


def ours(model, threads, test, n_prompt=0, n_gen=0, depth=0, reps=3,
         n_batch=DEFAULT_N_BATCH) -> tuple[float, float]:
    """(median tok/s, peak RSS MiB) of one child test."""
    _, rss, res = _run([sys.executable, __file__, "--child", model, str(threads), test, str(n_prompt), str(n_gen),
                        str(depth), str(reps), str(n_batch)])
    return json.loads(res.stdout.decode().strip().splitlines()[-1])["tps"], rss


def _decode_cmd() -> list[str]:
    """llama-decode as pip installed it for this interpreter: the script beside sys.executable
    (a venv's or a Python version's bin/), not a version manager's shim found first on PATH
    (pyenv's bash shim added 0.1-0.3 s to every start; llama.cpp's binaries run directly)."""
    beside = Path(sys.executable).parent / "llama-decode"
    exe = str(beside) if beside.is_file() else shutil.which("llama-decode")
    return [exe] if exe else [sys.executable, "-m", "cli.main"]


# ------------------------------------------------------------------ llama.cpp's side

def llama_bench(bin_dir: Path, model, threads, extra, n_prompt=0, n_gen=0, depth=0, reps=3) -> tuple[float, float]:
    """(median tok/s over llama-bench's repetitions, peak RSS MiB of the llama-bench process)."""
    cmd = [bin_dir / "llama-bench", "-m", model, "-t", str(threads), "-p", str(n_prompt), "-n", str(n_gen),
           "-d", str(depth), "-r", str(reps), "-o", "json", *extra]
    _, rss, res = _run(cmd)
    rows = json.loads(res.stdout.decode())
    return statistics.median(rows[0]["samples_ts"]), rss


# ------------------------------------------------------------------ report

def _table(title, rows):
    """rows: (figure, ours, llama.cpp default, llama.cpp like-for-like[, ours at -b 64]); without the
    fifth (not a prefill), ours is compared with both settings."""
    print(f"\n{title}")
    print(f"| figure | synapse_nb | llama.cpp default | ratio | synapse_nb -b {LFL_BATCH} | llama.cpp like-for-like "
          "| ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, v, d, l, *v64 in rows:
        w = v64[0] if v64 else v

        def cell(x):
            return "-" if x is None else f"{x:.2f}"

        def ratio(a, b):
            return "-" if (a is None or b is None or b == 0) else f"{a / b:.2f}"

        print(f"| {name} | {cell(v)} | {cell(d)} | {ratio(v, d)} | {cell(w)} | {cell(l)} | {ratio(w, l)} |")
    sys.stdout.flush()


def bench_model(model: str, runs: int, threads: int, bin_dir: Path | None, only: set[str]) -> None:
    from synapse_nb.models import resolve_model

    path = str(resolve_model(model))
    size = os.path.getsize(path) / 2**20
    print(f"\n## {model} ({size:.0f} MiB, {threads} threads, median of {runs})")

    def both(n_prompt=0, n_gen=0, depth=0):
        # Interleaved: each round runs llama.cpp default, like-for-like and ours once (each its own
        # process, its own warm-up), so that a shared machine's drift (its memory bandwidth moved
        # 2x between minutes) falls on the three alike; the medians are over the rounds.
        # A prefill also runs ours at -b 64 (beside like-for-like); a decode does not batch.
        d, l, v, v64 = [], [], [], []
        test = "pp" if n_prompt else "tg"
        for _ in range(runs):
            if bin_dir:
                d.append(llama_bench(bin_dir, path, threads, [], n_prompt, n_gen, depth, 1)[0])
                l.append(llama_bench(bin_dir, path, threads, LIKE_FOR_LIKE, n_prompt, n_gen, depth, 1)[0])
            v.append(ours(path, threads, test, n_prompt, n_gen, depth, 1)[0])
            if test == "pp":
                v64.append(ours(path, threads, test, n_prompt, n_gen, depth, 1, LFL_BATCH)[0])
        med = statistics.median
        return (med(v), med(d) if d else None, med(l) if l else None) + ((med(v64),) if v64 else ())

    if "short" in only:
        rows = [(f"prefill {n} tok (tok/s)", *both(n_prompt=n)) for n in (128, 512)]
        rows.append(("decode 64 tok (tok/s)", *both(n_gen=64)))
        _table("short prompts", rows)
    if "long" in only:
        _table("long context", [("prefill 3000 tok (tok/s)", *both(n_prompt=3000)),
                                ("decode 32 tok at depth 3000 (tok/s)", *both(n_gen=32, depth=3000))])
    if "start" in only:
        ours_cmd = [*_decode_cmd(), path, "Hello", "-n", "1", "-c", "512", "-t", str(threads)]
        # as an installed package runs: with its modules' bytecode (pip compiles it; a sandbox's
        # PYTHONDONTWRITEBYTECODE=1 would make every start compile ~60 modules, 0.1 s)
        env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        _run(ours_cmd, env=env)  # the kernel cache is warm, the bytecode written
        o = [_run(ours_cmd, env=env)[:2] for _ in range(runs)]
        rows = [("warm start, 1-token run (s)", statistics.median(x[0] for x in o), None, None),
                ("peak RSS of that run (MiB)", statistics.median(x[1] for x in o), None, None)]
        if bin_dir:
            def ll(extra):
                cmd = [bin_dir / "llama-completion", "-m", path, "-p", "Hello", "-n", "1", "-c", "512", "-t",
                       str(threads), "-no-cnv", *extra]
                return [_run(cmd)[:2] for _ in range(runs)]
            d, l = ll([]), ll(["--no-repack", "-fa", "off", "-b", "64", "-ub", "64"])
            rows = [(rows[0][0], rows[0][1], statistics.median(x[0] for x in d), statistics.median(x[0] for x in l)),
                    (rows[1][0], rows[1][1], statistics.median(x[1] for x in d), statistics.median(x[1] for x in l))]
        _table("start-up (llama-decode vs llama-completion)", rows)
    if "compile" in only:
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "NUMBA_CACHE_DIR": cache}
            wall, _, res = _run([*_decode_cmd(), path, "Hello", "-n", "1", "-c", "512", "-t", str(threads),
                                 "--json"], env=env)
        ms = json.loads(res.stdout.decode())["timings"]["compile_ms"]
        _table("first run, cold Numba cache", [("kernel compile (s)", ms / 1e3, None, None),
                                               ("whole first run (s)", wall, None, None)])
    if "scaling" in only:
        _run_scaling(path, runs, threads, bin_dir)
    if "parallel" in only:
        _run_parallel(path, runs, threads, bin_dir)
    if "rss" in only:
        v = ours(path, threads, "tg", 0, 32, 4064, 1)[1]
        d = l = None
        if bin_dir:
            d = llama_bench(bin_dir, path, threads, [], 0, 32, 4064, 1)[1]
            l = llama_bench(bin_dir, path, threads, LIKE_FOR_LIKE, 0, 32, 4064, 1)[1]
        _table("memory", [("peak RSS, full 4096 context (MiB)", v, d, l)])


NPL = (1, 2, 4, 8, 16)


def _run_parallel(path, runs, threads, bin_dir, n_prompt=128, n_gen=128):
    """The parallel section: child_parallel per N (a process each, for its peak RSS), then
    llama-batched-bench in both settings (its own processes: RSS over all N)."""
    ours_rows = {}
    for n in NPL:
        _, rss, res = _run([sys.executable, __file__, "--child-parallel", path, str(threads), str(n), str(n_prompt),
                            str(n_gen), str(runs)])
        o = json.loads(res.stdout.decode().strip().splitlines()[-1])
        ours_rows[n] = (o["pp"], o["tg"], rss)
    theirs = {}
    if bin_dir:
        for name, extra in (("default", []), ("like-for-like", ["--no-repack", "-fa", "off", "-b", "64", "-ub", "64"])):
            cmd = [bin_dir / "llama-batched-bench", "-m", path, "-t", str(threads), "-c",
                   str(max(NPL) * (n_prompt + n_gen)), "-npp", str(n_prompt), "-ntg", str(n_gen), "-npl",
                   ",".join(map(str, NPL)), "--output-format", "jsonl", *extra]
            _, rss, res = _run(cmd)
            rows = {}
            for line in res.stdout.decode().splitlines():
                if line.startswith("{"):
                    d = json.loads(line)
                    rows[d["pl"]] = (d["speed_pp"], d["speed_tg"])
            theirs[name] = (rows, rss)
    print(f"\nparallel sequences: N x ({n_prompt}-token prompt + {n_gen} generated), aggregate tok/s")
    print("| N | ours prompt | ours gen | ours RSS MiB | llama.cpp default gen | ratio | like-for-like gen | ratio | "
          "ours gen / ours N=1 |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n in NPL:
        pp, tg, rss = ours_rows[n]
        cells = []
        for name in ("default", "like-for-like"):
            t = theirs.get(name, ({}, None))[0].get(n)
            cells += ["-", "-"] if t is None else [f"{t[1]:.1f}", f"{tg / t[1]:.2f}"]
        print(f"| {n} | {pp:.1f} | {tg:.1f} | {rss:.0f} | {' | '.join(cells)} | {tg / ours_rows[1][1]:.2f} |")
    for name, (rows, rss) in theirs.items():
        print(f"llama-batched-bench {name}: prompt tok/s " +
              ", ".join(f"N={n}: {rows[n][0]:.1f}" for n in NPL if n in rows) + f"; peak RSS {rss:.0f} MiB")
    sys.stdout.flush()


def _run_scaling(path, runs, threads, bin_dir):
    """The scaling section: our child_scaling, then llama-bench -t 1,N in both settings."""
    _, _, res = _run([sys.executable, __file__, "--child-scaling", path, str(threads), "64", str(runs)])
    o = json.loads(res.stdout.decode().strip().splitlines()[-1])
    cols = [("synapse_nb", o["tps1"], o["tpsN"])]
    if bin_dir:
        for name, extra in (("llama.cpp default", []), ("llama.cpp like-for-like", LIKE_FOR_LIKE)):
            cmd = [bin_dir / "llama-bench", "-m", path, "-t", f"1,{threads}", "-p", "0", "-n", "64",
                   "-r", str(runs), "-o", "json", *extra]
            rows = json.loads(_run(cmd)[2].stdout.decode())
            tps = {r["n_threads"]: statistics.median(r["samples_ts"]) for r in rows}
            cols.append((name, tps[1], tps[threads]))
    print(f"\nthread scaling: decode 64 tok on 1 and {threads} threads")
    print("| figure | " + " | ".join(c[0] for c in cols) + " |")
    print("|---|" + "---:|" * len(cols))
    print("| decode tok/s, 1 thread | " + " | ".join(f"{c[1]:.2f}" for c in cols) + " |")
    print(f"| decode tok/s, {threads} threads | " + " | ".join(f"{c[2]:.2f}" for c in cols) + " |")
    print(f"| {threads} threads / 1 thread | " + " | ".join(f"{c[2] / c[1]:.2f}" for c in cols) + " |")
    gb1, gbn = o["tps1"] * o["bytes"] / 1e9, o["tpsN"] * o["bytes"] / 1e9
    print(f"\nmachine read (384 MiB, same rounds as ours): 1 thread {o['read1']:.1f} GB/s, {threads} threads "
          f"{o['readN']:.1f} GB/s ({o['readN'] / o['read1']:.2f}x). Our decode reads {o['bytes'] / 1e6:.1f} MB of "
          f"weights a token: {gb1:.1f} GB/s on 1 thread ({gb1 / o['read1']:.0%} of the read), {gbn:.1f} on "
          f"{threads} ({gbn / o['readN']:.0%}); so its {threads}/1 ratio is at most {o['readN'] / gb1:.2f} here, and "
          f"a ratio of 1.7 would need {1.7 * gb1:.1f} GB/s on {threads} threads ({1.7 * gb1 / o['readN']:.0%} of the "
          f"read) with no serial work at all.")
    sys.stdout.flush()


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child-scaling":
        model, threads, n_gen, reps = sys.argv[2:6]
        print(json.dumps(child_scaling(model, int(threads), int(n_gen), int(reps))))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--child-parallel":
        model, threads, n_seq, n_prompt, n_gen, reps = sys.argv[2:8]
        print(json.dumps(child_parallel(model, int(threads), int(n_seq), int(n_prompt), int(n_gen), int(reps))))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        model, threads, test, n_prompt, n_gen, depth, reps, n_batch = sys.argv[2:10]
        print(json.dumps(child(model, int(threads), test, int(n_prompt), int(n_gen), int(depth), int(reps),
                               int(n_batch))))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", default="short,long,start,compile,rss")
    ap.add_argument("--llama-bin", default=None, help="directory of llama-bench and llama-completion")
    ap.add_argument("--no-llama-cpp", action="store_true")
    a = ap.parse_args()
    bin_dir = None if a.no_llama_cpp else _llama_bin(a.llama_bin)
    if bin_dir is None and not a.no_llama_cpp:
        print("llama.cpp tools not found: measuring synapse_nb only (../shared/tools/build-llama-cpp.sh)")
    print(f"machine: {os.cpu_count()} cores, {os.uname().machine}, python {sys.version.split()[0]}; "
          f"llama.cpp: {bin_dir or '-'}")
    for m in a.models:
        bench_model(m, a.runs, a.threads, bin_dir, set(a.only.split(",")))


if __name__ == "__main__":
    main()
