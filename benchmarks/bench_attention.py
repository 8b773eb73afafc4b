"""Attention kernel timing at a long context: one decode row and a 64-row prefill batch.

    python3 -m benchmarks.bench_attention [--n-past 3000] [--reps 10] [--layers 30] [--threads 1,2]
                                          [--models smollm2,qwen2.5,gemma3] [--no-phases]

For each model shape (SmolLM2-135M: 9 query heads, 3 KV heads; Qwen2.5-0.5B: 14 / 2; head_dim
64; Gemma 3 270M: 4 / 1, head_dim 256), per layer: the vector kernels (attention_rows) and the
per-head kernel (_attention_par/_ser: the kernel for other head dims; on today's cache layout and softmax), best of --reps, on --layers random caches cycled
through, so that a decode step reads its K/V from memory as in a real forward (one layer's cache
fits in L3; a model's does not). Prints µs per layer, GB/s of K/V bytes read (each KV head's K and
V once) and GMAC/s of q.k + p.V, and for the decode row the three phases (q.k, softmax, p.V) timed
alone; the machine's memory read bandwidth is measured first the same way (a parallel sum).
Numbers only, never asserted; the load average is printed with each figure (shared machine).
"""

import argparse
import os
import time

os.environ.setdefault("GOMP_SPINCOUNT", "1000")  # as Session sets it (see session._GOMP_SPINCOUNT)

import numba  # noqa: E402
import numpy as np  # noqa: E402
from numba import njit, prange  # noqa: E402

from synapse_nb.kernels import attention as A  # noqa: E402

SHAPES = {"smollm2": (9, 3, 64), "qwen2.5": (14, 2, 64), "gemma3": (4, 1, 256)}
KT = A.KT


def best(fn, reps):
    fn()
    t = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        t = min(t, time.perf_counter() - t0)
    return t


def load():
    return f"load {os.getloadavg()[0]:.2f}"


@njit(parallel=True, cache=False)
def _read_sum(a, out):
    for r in prange(a.shape[0]):
        s = np.uint64(0)
        row = a[r]
        for i in range(row.size):
            s += row[i]
        out[r] = s


def _phases(plan):
    """The decode row's three loops as separate parallel functions (q.k, softmax, p.V), with plan's
    literals (VectorPlan: n64, qa, qb, pa, pb) as constants of their code, as the plan's items
    (attention.plan_items) have them (a literally() argument would send every call through Numba's
    literal dispatch)."""
    n64, qa, qb, pa, pb = plan

    @njit(parallel=True, cache=False)
    def qk(kc, pos0, n_head, n_head_kv, qd, scd):
        gqa = n_head // n_head_kv
        nblk = (pos0 + KT) // KT
        nqk = (nblk + A.QK_TILES - 1) // A.QK_TILES
        nt, hd_k = kc.shape[1], kc.shape[2]
        for it in prange(n_head_kv * nqk):
            b0 = (it % nqk) * A.QK_TILES
            A._decode_qk(scd.ravel(), kc.ravel(), qd.ravel(), it // nqk, b0, min(nblk, b0 + A.QK_TILES), nt, gqa,
                         hd_k, scd.shape[1], n64, qa, qb)

    @njit(parallel=True, cache=False)
    def softmax(pos0, n_head, scd, scale):
        for h in prange(n_head):
            A._softmax(scd.ravel(), h * scd.shape[1], pos0 + 1, scale)

    @njit(parallel=True, cache=False)
    def pv(vc, pos0, n_head, n_head_kv, scd, accd):
        gqa = n_head // n_head_kv
        nt, hd_v = vc.shape[2], vc.shape[3]
        for it in prange(n_head_kv * 4):
            A._decode_pv(accd.ravel(), vc.ravel(), scd.ravel(), it // 4, it % 4, gqa, hd_v, nt, scd.shape[1], 0,
                         pos0 + 1, pa, pb)

    return qk, softmax, pv


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n-past", type=int, default=3000)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--models", default=",".join(SHAPES))
    ap.add_argument("--no-phases", action="store_true")
    a = ap.parse_args()
    threads = [min(int(t), numba.config.NUMBA_NUM_THREADS) for t in a.threads.split(",")]
    buf = np.ones((2048, 16384), np.uint64)  # 256 MiB
    sums = np.zeros(2048, np.uint64)
    for nt in threads:
        numba.set_num_threads(nt)
        t = best(lambda: _read_sum(buf, sums), 3)
        print(f"memory read bandwidth, {nt} thread(s): {buf.nbytes / t / 1e9:.1f} GB/s  {load()}", flush=True)
    del buf
    rng = np.random.default_rng(0)
    n_ctx = (a.n_past + 64 + KT - 1) // KT * KT
    for name in a.models.split(","):
        nh, nkv, hd = SHAPES[name]
        ks, vs = A.kv_shapes(n_ctx, nkv, hd, hd)
        caches = [((rng.standard_normal(ks) * 0.5).astype(np.float16).view(np.uint16),
                   rng.standard_normal(vs).astype(np.float16).view(np.uint16)) for _ in range(a.layers)]
        scale = np.float32(1 / np.sqrt(hd))
        ws = A.Workspace(n_ctx, nh, nkv, hd, hd)
        for n in (1, 64) if a.n_past >= 64 else (1,):  # the 64-row batch ends at position n_past
            pos = a.n_past if n == 1 else a.n_past - n
            q = rng.standard_normal((n, nh * hd)).astype(np.float32)
            out = np.empty((n, nh * hd), np.float32)
            kv_bytes = (pos + n) * nkv * 2 * hd * 2
            macs = nh * sum(pos + t + 1 for t in range(n)) * 2 * hd
            for nt in threads:
                numba.set_num_threads(nt)
                old = A._attention_par if nt > 1 else A._attention_ser
                reps = a.reps if n == 1 else max(2, a.reps // 3)
                few = caches[:4]  # the per-head kernel is slow: 4 layers
                t_old = best(lambda: [old(out, q, kc, vc, pos, nh, nkv, hd, hd, scale, 0) for kc, vc in few],
                             reps) / len(few)
                t_new = best(lambda: [A.attention_rows(out, q, kc, vc, pos, nh, nkv, hd, hd, scale, ws)
                                      for kc, vc in caches], reps) / len(caches)
                print(f"{name:8s} {'decode row' if n == 1 else f'prefill {n} rows'} at n_kv {pos + n}, {nt} thread(s): "
                      f"vector {t_new * 1e6:8.1f} µs/layer ({kv_bytes / t_new / 1e9:5.1f} GB/s K/V, "
                      f"{macs / t_new / 1e9:5.1f} GMAC/s); per-head {t_old * 1e6:8.1f} µs ({t_old / t_new:.2f}x)  {load()}",
                      flush=True)
                if n == 1 and not a.no_phases:
                    qd, scd, accd = ws.decode  # views of ws.buf
                    phase_qk, phase_softmax, phase_pv = _phases(ws.decode_plan)
                    tq = best(lambda: [phase_qk(kc, pos, nh, nkv, qd, scd) for kc, vc in caches], reps) / len(caches)
                    ts = best(lambda: [phase_softmax(pos, nh, scd, scale) for _ in caches], reps) / len(caches)
                    scd[:] = 1e-3
                    tp = best(lambda: [phase_pv(vc, pos, nh, nkv, scd, accd) for kc, vc in caches], reps) / len(caches)
                    half, m = kv_bytes / 2, macs / 2
                    print(f"{'':8s}   phases alone: q.k {tq * 1e6:6.1f} µs ({half / tq / 1e9:5.1f} GB/s, {m / tq / 1e9:5.1f} "
                          f"GMAC/s), softmax {ts * 1e6:6.1f} µs, p.V {tp * 1e6:6.1f} µs ({half / tp / 1e9:5.1f} GB/s, "
                          f"{m / tp / 1e9:5.1f} GMAC/s)", flush=True)


if __name__ == "__main__":
    main()
