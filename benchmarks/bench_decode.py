"""Per-token decode profile: each matvec of a decode step timed over all layers, beside the step.

    python benchmarks/bench_decode.py [MODEL] [-t 2] [--rounds 12]

A decode step (one token, Session.eval) is timed whole (median of 32 steps at positions 6..38).
Then the step's matvec kernels are called as the step calls them, layer after layer, so that the
weights stream from memory as in a real step (the models are larger than the L3 cache): per
layer q/k/v (one call when the three share a format and input: ``qkv``), o, gate/up (``gate_up``
likewise), down, and last the output head. Each kind's time is summed over the layers per round
(median over --rounds rounds; the first two are dropped) and printed as calls, MB of weights read,
ms a token, us a call and GB/s. The matvecs' converted input is made once (a decode step converts
it once per input too; that conversion is part of "the rest"). Each call here also pays the
Python dispatch of a kernel (printed: an empty call), which the step's compiled layer loop does
not, so "the rest of the step" (step minus the matvecs) is a lower bound of the norms, RoPE, the
K/V store, attention, conversions and the loop itself. One process, nothing asserted: on a
shared machine compare figures from the same run.
"""

import argparse
import time

import numpy as np


def _fused(ws, rng):
    """(driver, args, bytes): one call of ws[0]'s matvec driver on up to three weights sharing
    its format and input, as graph._matvecs makes it (out rows of 0 for the absent ones)."""
    w0 = ws[0]
    a = w0.quantize(rng.standard_normal((1, w0.k)).astype(np.float32))
    outs = [np.empty((1, w.m), np.float32) for w in ws]
    args = []
    for i in range(3):
        args += [outs[i], ws[i].rows] if i < len(ws) else [outs[0][:, :0], w0.rows[:0]]
    return w0.drivers(1)[0], args + [a, w0.n_scratch], sum(w.rows.nbytes for w in ws)


def _groups(name, names, ws):
    """[(kind, weights)]: ws as one call (kind name) when they share a format and n_in, as the
    step fuses them, else one call each (kinds names)."""
    if len({(w.fmt.name, w.k) for w in ws}) == 1:
        return [(name, ws)]
    return [(n, [w]) for n, w in zip(names, ws)]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default="smollm2-135m-instruct-q4_1")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=12)
    a = ap.parse_args()

    import numba

    from synapse_nb.compilation.warmup import warmup
    from synapse_nb.model import load_model
    from synapse_nb.models import resolve_model
    from synapse_nb.session import Session

    numba.set_num_threads(a.threads)
    m = load_model(resolve_model(a.model))
    warmup(m)
    s = Session(m, n_ctx=512, n_threads=a.threads)
    s.eval(m.tokenizer.tokenize("The capital of France is", add_special=True, parse_special=False))
    steps = []
    for _ in range(40):
        t0 = time.perf_counter()
        s.eval([1000])
        steps.append(time.perf_counter() - t0)
    step = float(np.median(steps[8:]))

    rng = np.random.default_rng(0)
    kinds = {}  # kind:format -> [(driver, args, bytes)] in layer order
    order = []
    for L in m.weights.layers:
        for kind, ws in (_groups("qkv", ("q", "k", "v"), [L.wq, L.wk, L.wv]) + [("o", [L.wo])]
                         + _groups("gate_up", ("gate", "up"), [L.w_gate, L.w_up]) + [("down", [L.w_down])]):
            key = f"{kind}:{'/'.join(sorted({w.fmt.name for w in ws}))}"
            item = _fused(ws, rng)
            kinds.setdefault(key, []).append(item)
            order.append((key, item))
    head = m.weights.output
    key = f"output:{head.fmt.name}"
    kinds[key] = [_fused([head], rng)]
    order.append((key, kinds[key][0]))

    per_round = {k: [] for k in kinds}
    for _ in range(a.rounds):
        acc = dict.fromkeys(kinds, 0.0)
        for key, (fn, args, _) in order:
            t0 = time.perf_counter()
            fn(*args)
            acc[key] += time.perf_counter() - t0
        for k, t in acc.items():
            per_round[k].append(t)
    fn, args, _ = kinds[order[0][0]][0]
    empty = list(args)
    for i in (0, 2, 4):  # every weight of 0 rows
        empty[i], empty[i + 1] = args[i][:, :0], args[i + 1][:0]
    calls = []
    for _ in range(2000):
        t0 = time.perf_counter()
        fn(*empty)
        calls.append(time.perf_counter() - t0)

    print(f"{a.model}, {a.threads} threads: decode step {step * 1e3:.2f} ms ({1 / step:.1f} tok/s); "
          f"an empty driver call {np.median(calls) * 1e6:.1f} us")
    print(f"| kernel | calls | MB | ms | us/call | GB/s |\n|---|---:|---:|---:|---:|---:|")
    total_t = total_b = 0.0
    for k, items in kinds.items():
        t = float(np.median(per_round[k][2:]))
        b = sum(x[2] for x in items)
        total_t, total_b = total_t + t, total_b + b
        print(f"| {k} | {len(items)} | {b / 1e6:.1f} | {t * 1e3:.3f} | {t / len(items) * 1e6:.1f} | {b / t / 1e9:.1f} |")
    print(f"| all matvecs | | {total_b / 1e6:.1f} | {total_t * 1e3:.3f} | | {total_b / total_t / 1e9:.1f} |")
    print(f"the rest of the step: {(step - total_t) * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
