"""Long-context timing in one process: prefill of a long prompt, then greedy decode after it.

    python3 -m benchmarks.bench_long [MODEL] [--n-prompt 3000] [--n-decode 32] [-c 4096] [-t 2]

The prompt is README.md tokenized (repeated if shorter), cut to --n-prompt tokens. Prints prefill
tokens/s, decode ms per token and tokens/s, and the share of decode time spent in attention
(attention_rows timed on its own at the last position, times the layers). One run, no medians:
on a shared machine take ratios.
"""

import argparse
import time
from pathlib import Path

import numpy as np
from synapse_nb.compilation.warmup import warmup as session_warmup
from synapse_nb.session import Session


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default="smollm2-135m-instruct-q4_1")
    ap.add_argument("--n-prompt", type=int, default=3000)
    ap.add_argument("--n-decode", type=int, default=32)
    ap.add_argument("-c", "--ctx-size", type=int, default=4096)
    ap.add_argument("-t", "--threads", type=int, default=2)
    a = ap.parse_args()

    from synapse_nb.kernels import attention as attn
    from synapse_nb.model import load_model
    from synapse_nb.models import resolve_model

    m = load_model(resolve_model(a.model))
    text = (Path(__file__).parents[1] / "README.md").read_text()
    ids = m.tokenizer.tokenize(text, add_special=True, parse_special=False)
    while len(ids) < a.n_prompt:
        ids = ids + ids[1:]
    ids = ids[:a.n_prompt]
    session_warmup(m)
    s = Session(m, n_ctx=a.ctx_size, n_threads=a.threads)
    t0 = time.perf_counter()
    logits = s.eval(ids)
    t1 = time.perf_counter()
    print(f"prefill {len(ids)} tokens: {t1 - t0:.2f} s, {len(ids) / (t1 - t0):.1f} tok/s")

    t0 = time.perf_counter()
    for _ in range(a.n_decode):
        logits = s.eval([int(np.argmax(logits))])
    t1 = time.perf_counter()
    # Attention's share: the forward calls it from its compiled loop, so it is timed on its own,
    # one layer's call at the last position (the same kernel and cache) times n_layer.
    hp, st = m.hparams, s.state
    pos = s.n_past - 1
    q, out = np.zeros_like(st.q[:1]), np.empty_like(st.attn[:1])
    args = (out, q, s.cache.k[0], s.cache.v[0], pos, hp.n_head, hp.n_head_kv, hp.head_dim_k, hp.head_dim_v,
            m._kq_scale, st.attn_ws)
    attn.attention_rows(*args)
    ta = time.perf_counter()
    for _ in range(a.n_decode):
        attn.attention_rows(*args)
    spent = (time.perf_counter() - ta) * hp.n_layer
    ms = 1e3 * (t1 - t0) / a.n_decode
    print(f"decode {a.n_decode} tokens at n_past {len(ids)}..: {ms:.1f} ms/token ({1e3 / ms:.1f} tok/s), "
          f"attention {1e3 * spent / a.n_decode:.1f} ms/token ({100 * spent / (t1 - t0):.0f} %)")


if __name__ == "__main__":
    main()
