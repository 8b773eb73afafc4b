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
K/V store, attention, conversions and the loop itself.

Then the rest of the step by kind (--rest-pos, default 32: the attention's length): decode steps
at that position (each step's K/V truncated again) in which every kernel the layer loop calls is a
no-op of its signature except one kind, in turn: the attention, the K/V store, the activations'
conversions, the RMS norms, RoPE, the FFN's activation, and the matvec drivers on weights of 0
rows (their parallel regions' launch, no weight read); "the loop" is every kernel a no-op. Each
kind's row is its steps' layer-loop time minus the loop's (medians over --rounds steps, the
variants taken in turn, with a real step between them so that the weights' stream evicts the
caches as in decoding). One process, nothing asserted: on a shared machine compare figures from
the same run.
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


def _noops():
    """{kind: address}: a compiled no-op of each kind's signature (graph.SIGNATURES)."""
    from numba import njit

    from synapse_nb.kernels import graph as G
    from synapse_nb.kernels.native import native_fn

    out = {}
    for k in G.KINDS:
        ns = {}
        exec(f"def f({', '.join(f'a{i}' for i in range(len(G.SIGNATURES[k])))}):\n    pass", ns)
        out[k] = native_fn(njit(ns["f"]), *G.SIGNATURES[k]).addr
    return out


# The rest of a step by kind: (label, the row-kernel columns, the matmul-table fields and the
# segment-table attention it keeps real; "mv0": the matvec drivers real on weights of 0 rows)
_REST = (("attention", ("ATTN", "ATTN_SEGS"), (), True), ("K/V store", ("STORE",), (), False),
         ("activation conversions", (), ("ACT_N", "ACT_1"), False), ("RMS norms", ("RMS",), (), False),
         ("RoPE", ("ROPE",), (), False), ("FFN activation", ("SWIGLU",), (), False),
         ("matvec launches (0 rows)", (), ("MM_N", "MM_1", "mv0"), False))


def _rest_by_kind(m, s, pos, rounds):
    """{label: ms a step} of the layer loop with every kernel a no-op but one kind (see the
    module's docstring), and "the loop" (all no-ops), "layers" (nothing replaced)."""
    from synapse_nb.kernels import graph as G

    noop = _noops()
    rk_kinds = {"RMS": "rms_norm", "ROPE": "rope", "SWIGLU": "geglu" if m._graph_tables().geglu else "swiglu",
                "STORE": "store_kv", "ATTN": "attention", "ATTN_SEGS": "attention_segs"}
    mt_kinds = {"MM_N": "matvec", "MM_1": "matvec", "ACT_N": "convert", "ACT_1": "convert"}
    variants = [("layers", None), ("the loop", ((), (), False))] + [(r[0], r[1:]) for r in _REST]
    times = {v: [] for v, _ in variants}
    cur = [None]
    real = G.layers

    def patched(acts, inputs, cache, scratch, kernels, vecs, segs, *rest):
        label, keep = cur[0]
        mt, rk, items = kernels
        if keep is not None:
            rk_keep, mt_keep, attn = keep
            mt, rk, segs = mt.copy(), rk.copy(), segs.copy()
            for col, k in rk_kinds.items():
                if col not in rk_keep:
                    c = getattr(G, col)
                    rk[:, c] = np.where(rk[:, c] != 0, noop[k], 0)
            for f, k in mt_kinds.items():
                if f not in mt_keep:
                    c = getattr(G, f)
                    mt[:, :, c] = np.where(mt[:, :, c] != 0, noop[k], 0)
            if "mv0" in mt_keep:
                mt[:, :, G.M] = 0
            if not attn:
                segs[:, G.SEG_ATTN] = noop["attention"]
        t0 = time.perf_counter()
        real(acts, inputs, cache, scratch, (mt, rk, items), vecs, segs, *rest)
        if label is not None:
            times[label].append(time.perf_counter() - t0)

    s.truncate(0)
    s.eval([1000] * pos)  # the cache's first pos positions (their values do not change the work)
    G.layers = patched
    try:
        for _ in range(rounds):
            for v in variants:
                cur[0] = v
                s.eval([1000])
                s.truncate(pos)
                cur[0] = (None, None)
                s.eval([1000])  # a real step: the weights stream through the caches
                s.truncate(pos)
    finally:
        G.layers = real
    return {v: float(np.median(t[2:])) * 1e3 for v, t in times.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default="smollm2-135m-instruct-q4_1")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--rest-pos", type=int, default=32, help="position of the rest-by-kind steps")
    a = ap.parse_args()
    n_ctx = 512
    if not 1 <= a.rest_pos < n_ctx:
        ap.error(f"--rest-pos must be in 1..{n_ctx - 1}")

    import numba

    from synapse_nb.compilation.warmup import warmup
    from synapse_nb.model import load_model
    from synapse_nb.models import resolve_model
    from synapse_nb.session import Session

    numba.set_num_threads(a.threads)
    m = load_model(resolve_model(a.model))
    warmup(m)
    s = Session(m, n_ctx=n_ctx, n_threads=a.threads)
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

    rest = _rest_by_kind(m, s, a.rest_pos, max(a.rounds, 8) * 2)
    loop = rest["the loop"]
    print(f"\nthe layer loop's time by kind at position {a.rest_pos} (ms a step; the layer loop whole "
          f"{rest['layers']:.3f} ms)\n| kind | ms | us a layer |\n|---|---:|---:|")
    n_layer = len(m.weights.layers)
    print(f"| the loop (every kernel a no-op) | {loop:.3f} | {loop / n_layer * 1e3:.1f} |")
    for label, *_ in _REST:
        print(f"| {label} | {rest[label] - loop:.3f} | {(rest[label] - loop) / n_layer * 1e3:.1f} |")


if __name__ == "__main__":
    main()
