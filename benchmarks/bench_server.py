"""Serving benchmark: llama-decode --server against llama-server, same model, same run, 127.0.0.1 only.

    python benchmarks/bench_server.py MODEL [--clients 1,4,16] [--threads 2] [--llama-bin DIR]
                                            [--no-llama-cpp]
    python benchmarks/bench_server.py MODEL --ray [--clients 8] [--threads 2]

For each N in --clients, a server with N slots (ours: -np N -c 512; llama-server: -np N -c N*512,
in its defaults and like-for-like: --no-repack -fa off -b 64 -ub 64) gets N concurrent clients;
each sends one streamed /v1/completions request of a 128-token prompt (fixed pseudo-random ids,
a different one per client) for 128 tokens (ignore_eos, llama.cpp's default sampling, seed = its
index). Reported per server and N: aggregate generated tok/s (all tokens / wall time from the first
request to the last token), time to first token p50 / p99 and inter-token latency p50 / p99 (ms,
over all clients' gaps between SSE chunks). A warm-up request precedes each round. Nothing is
asserted; run it on an idle machine and compare ratios from one run.

--ray compares, instead of llama-server, plain `--server -t T -np N` with `--server --ray` (a local
Ray): T replicas x 1 thread (N / T slots each, rounded up) and 1 replica x T threads (N slots). On
one machine this measures Ray Serve's overhead, not scale: the ITL p50 of 1 replica x T threads
minus plain --server's is Serve's cost per token (its proxy and the replica's ASGI hop), printed as
a share of plain --server's ITL p50 (about one decode step of the batch).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
N_PROMPT, N_GEN = 128, 128
LIKE_FOR_LIKE = ["--no-repack", "-fa", "off", "-b", "64", "-ub", "64"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(cmd, port, timeout=300.0):
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if p.poll() is not None:
            raise RuntimeError(f"{cmd[0]} exited: {p.stderr.read().decode()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return p, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    p.kill()
    raise RuntimeError(f"{cmd[0]} did not start")


def _client(url, prompt, seed):
    """(time to first token s, [inter-token gaps s], tokens, end time) of one streamed request."""
    body = {"prompt": prompt, "max_tokens": N_GEN, "stream": True, "ignore_eos": True, "seed": seed}
    t0 = time.perf_counter()
    times = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                obj = json.loads(line[6:])
                ch = obj.get("choices") or [{}]
                if ch[0].get("text"):
                    times.append(time.perf_counter())
    gaps = [b - a for a, b in zip(times, times[1:])]
    return (times[0] - t0 if times else float("nan")), gaps, len(times), (times[-1] if times else t0)


def _round(url, n, rng_seed=0):
    import random

    rng = random.Random(rng_seed)
    prompts = [[rng.randrange(100, 30000) for _ in range(N_PROMPT)] for _ in range(n)]
    _client(url, prompts[0][:8], 0)  # warm-up
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(n) as ex:
        res = list(ex.map(lambda i: _client(url, prompts[i], i), range(n)))
    t_end = max(r[3] for r in res)
    ttft = sorted(r[0] for r in res)
    gaps = sorted(g for r in res for g in r[1])
    tokens = sum(r[2] for r in res)

    def pct(xs, q):
        return xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3 if xs else float("nan")

    return {"tps": tokens / (t_end - t0), "ttft50": pct(ttft, 0.5), "ttft99": pct(ttft, 0.99),
            "itl50": pct(gaps, 0.5), "itl99": pct(gaps, 0.99), "chunks": tokens}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--clients", default="1,4,16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-bin", default=None)
    ap.add_argument("--no-llama-cpp", action="store_true")
    ap.add_argument("--ray", action="store_true", help="plain --server against --server --ray (Ray Serve)")
    a = ap.parse_args()
    if a.ray:
        a.no_llama_cpp = True
    from synapse_nb.models import resolve_model

    path = str(resolve_model(a.model))
    bin_dir = None
    if not a.no_llama_cpp:
        cands = [a.llama_bin, os.environ.get("LLAMA_CPP_BIN"),
                 str(Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "synapse_nb/llama.cpp/src/build/bin")]
        bin_dir = next((Path(c) for c in cands if c and (Path(c) / "llama-server").is_file()), None)
        if bin_dir is None:
            sys.exit("llama-server not found: build it with ../shared/tools/build-llama-cpp.sh, or --no-llama-cpp")
    ns = [int(x) for x in a.clients.split(",")]
    servers = [("synapse_nb", lambda n, port: [sys.executable, "-m", "cli.main", path, "--server", "--port", str(port),
                                                 "-np", str(n), "-c", "512", "-t", str(a.threads),
                                                 "--max-queue", "0"])]
    if a.ray:
        t = a.threads

        def ray_cmd(replicas, threads, slots):
            return lambda n, port: [sys.executable, "-m", "cli.main", path, "--server", "--ray", "--replicas",
                                    str(replicas), "-t", str(threads), "--port", str(port), "-np",
                                    str(slots(n)), "-c", "512", "--max-queue", "64"]
            # (--max-queue 64: Serve's router balances by requests in flight, not free slots, so a
            # burst of N can send one replica more than its slots: queued there rather than a 503)

        servers.append((f"--ray {t} replicas x 1 thread", ray_cmd(t, 1, lambda n: -(-n // t))))
        servers.append((f"--ray 1 replica x {t} threads", ray_cmd(1, t, lambda n: n)))
    if bin_dir:
        for name, extra in (("llama-server default", []), ("llama-server like-for-like", LIKE_FOR_LIKE)):
            servers.append((name, lambda n, port, extra=extra: [
                str(bin_dir / "llama-server"), "-m", path, "--port", str(port), "--host", "127.0.0.1", "-np", str(n),
                "-c", str(512 * n), "-t", str(a.threads), "--no-webui", *extra]))
    print(f"## {a.model}: N clients x ({N_PROMPT}-token prompt, {N_GEN} tokens streamed), {a.threads} threads")
    print("| server | N | aggregate tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    results = {}
    for n in ns:
        for name, cmd in servers:
            port = _free_port()
            p, url = _start(cmd(n, port), port)
            try:
                r = _round(url, n)
            finally:
                p.terminate()
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
            results[(name, n)] = r
            print(f"| {name} | {n} | {r['tps']:.1f} | {r['ttft50']:.0f} | {r['ttft99']:.0f} | {r['itl50']:.1f} | "
                  f"{r['itl99']:.1f} |", flush=True)
    if bin_dir:
        print("\nratios, ours / llama-server default (aggregate tok/s; p99 ITL, lower is better):")
        for n in ns:
            o, d = results[("synapse_nb", n)], results[("llama-server default", n)]
            print(f"N={n}: tok/s {o['tps'] / d['tps']:.2f}x, p99 ITL {o['itl99'] / d['itl99']:.2f}x")
    if a.ray:
        print(f"\nRay Serve's overhead per token (ITL p50 of --ray 1 replica x {a.threads} threads minus plain "
              f"--server's, over plain --server's):")
        for n in ns:
            o, r = results[("synapse_nb", n)], results[(f"--ray 1 replica x {a.threads} threads", n)]
            print(f"N={n}: {r['itl50'] - o['itl50']:+.1f} ms per token = {(r['itl50'] - o['itl50']) / o['itl50']:+.1%} "
                  f"of a step ({o['itl50']:.1f} ms)")


if __name__ == "__main__":
    main()
