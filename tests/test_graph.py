"""The forward graph against llama.cpp's goldens (tests/data/tiny/goldens), rules of shared/README.md.

For every fixture and both prompts ("ids", "text") of its goldens npz:
  1. over the 32 one-token sequences (single_logits), the median row distance <= 1e-6;
  2. every prompt row (our batched prefill vs llama.cpp's token-by-token P_logits_tbt) and every
     greedy step (vs P_gen_logits) within tol = max(2 * P_self_maxrel, 1e-4) for float weight
     formats, max(2 * P_self_rms, 3e-2) for quantized ones;
  3. our greedy token equals the reference's at every step while the reference's top-2 margin
     at that step exceeds 2 * tol * max|ref|.
Row distance: max|ours - ref| / max|ref| for F32/F16/BF16 weights, rms(ours - ref) / rms(ref)
for quantized weights. Greedy steps are decoded on the reference's tokens (teacher forcing), so
that step i of ours and of llama.cpp see the same context; until the first unclear step this is
exactly our own greedy run.
A fixture whose weight format has no kernel yet fails here (it is not skipped).
"""

import numpy as np
import pytest

from synapse_nb.session import Session

from conftest import GOLDENS, shared_model, tiny

FIXTURES = sorted(p.stem for p in GOLDENS.glob("*.npz"))
FLOAT_FORMATS = ("-f32", "-f16", "-bf16")


def is_float_format(name: str) -> bool:
    return name.endswith(FLOAT_FORMATS)


def row_distance(ours: np.ndarray, ref: np.ndarray, float_format: bool) -> float:
    ours = ours.astype(np.float64)
    ref = ref.astype(np.float64)
    if float_format:
        return float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref)))
    return float(np.sqrt(np.mean((ours - ref) ** 2)) / np.sqrt(np.mean(ref ** 2)))


def tolerance(golden, prompt: str, float_format: bool) -> float:
    if float_format:
        return max(2 * float(golden[f"{prompt}_self_maxrel"]), 1e-4)
    return max(2 * float(golden[f"{prompt}_self_rms"]), 3e-2)


@pytest.fixture(scope="module")
def cache():
    """The goldens read in this module (the models come from conftest's session cache)."""
    return {}


def _model(cache, name):
    if name not in cache:
        cache[name] = np.load(GOLDENS / f"{name}.npz")
    return shared_model(name), cache[name]


def test_fixture_list_is_complete():
    assert len(FIXTURES) == 23
    for name in FIXTURES:
        assert tiny(name).is_file()


@pytest.mark.parametrize("name", FIXTURES)
def test_rule1_single_tokens(cache, name):
    model, golden = _model(cache, name)
    fl = is_float_format(name)
    s = Session(model, n_ctx=64)
    d = []
    for tok, ref in zip(golden["single_tokens"], golden["single_logits"]):
        s.reset()
        d.append(row_distance(s.eval([int(tok)]), ref, fl))
    med = float(np.median(d))
    print(f"{name}: single-token median distance {med:.3g}, max {max(d):.3g}")
    assert med <= 1e-6, f"{name}: median distance over 32 one-token sequences {med:.3g} > 1e-6"


@pytest.mark.parametrize("prompt", ["ids", "text"])
@pytest.mark.parametrize("name", FIXTURES)
def test_rules2_3_prompt_and_greedy(cache, name, prompt):
    model, golden = _model(cache, name)
    fl = is_float_format(name)
    tol = tolerance(golden, prompt, fl)
    tokens = golden[f"{prompt}_tokens"].astype(np.int64)
    ref_rows = golden[f"{prompt}_logits_tbt"]
    ref_gen = golden[f"{prompt}_gen_logits"]
    ref_greedy = golden[f"{prompt}_greedy"].astype(np.int64)
    s = Session(model, n_ctx=256)

    # Rule 2, prompt rows: batched prefill (64-token batches) vs llama.cpp's token-by-token rows
    rows = s.eval(tokens, all_logits=True)
    assert rows.shape == ref_rows.shape and rows.dtype == np.float32
    d_rows = [row_distance(rows[i], ref_rows[i], fl) for i in range(len(tokens))]

    # Greedy steps on the reference's tokens: row 0 is the last prompt row
    gen = [rows[-1]]
    for t in ref_greedy[:-1]:
        gen.append(s.eval([int(t)]))
    d_gen = [row_distance(gen[i], ref_gen[i], fl) for i in range(len(ref_greedy))]

    self_d = float(golden[f"{prompt}_self_maxrel" if fl else f"{prompt}_self_rms"])
    print(f"{name}/{prompt}: max prompt-row distance {max(d_rows):.3g}, max greedy-step distance "
          f"{max(d_gen):.3g}, llama.cpp self {self_d:.3g}, tol {tol:.3g}")
    bad_rows = [i for i, d in enumerate(d_rows) if d > tol]
    assert not bad_rows, (f"{name}/{prompt}: prompt row {bad_rows[0]} distance {d_rows[bad_rows[0]]:.3g} > tol "
                          f"{tol:.3g} ({len(bad_rows)} rows out)")
    bad_gen = [i for i, d in enumerate(d_gen) if d > tol]
    assert not bad_gen, (f"{name}/{prompt}: greedy step {bad_gen[0]} distance {d_gen[bad_gen[0]]:.3g} > tol "
                         f"{tol:.3g} ({len(bad_gen)} steps out)")

    # Rule 3: identical greedy tokens while the reference's margin is clear
    for i in range(len(ref_greedy)):
        top2 = np.sort(ref_gen[i].astype(np.float64))[-2:]
        if top2[1] - top2[0] <= 2 * tol * np.max(np.abs(ref_gen[i])):
            break  # from here the two continuations may legitimately part
        ours = int(np.argmax(gen[i]))
        assert ours == ref_greedy[i], f"{name}/{prompt}: greedy step {i}: ours {ours}, llama.cpp {ref_greedy[i]}"


@pytest.mark.parametrize("name", FIXTURES)
def test_prompt_rows_bit_identical_to_llamacpp_single_token_path(cache, name):
    """Stronger than rule 2: every op rounds where and as ggml's does, so our rows are llama.cpp's
    token-by-token rows bit for bit (measured on all 23 fixtures, both prompts, and the 32 one-token
    sequences). A failure here, with rules 1-3 passing, means one rounding point moved (a different
    libm, an fma contracted differently, a changed summation order): find it before relaxing this."""
    model, golden = _model(cache, name)
    s = Session(model, n_ctx=128)
    for prompt in ("ids", "text"):
        s.reset()
        rows = s.eval(golden[f"{prompt}_tokens"].astype(np.int64), all_logits=True)
        ref = golden[f"{prompt}_logits_tbt"]
        differ = np.flatnonzero((rows.view(np.uint32) != ref.view(np.uint32)).any(axis=1))
        assert differ.size == 0, f"{name}/{prompt}: rows {differ[:10].tolist()} differ from llama.cpp"
    single = []
    for t in golden["single_tokens"]:
        s.reset()
        single.append(s.eval([int(t)]))
    single = np.stack(single)
    assert np.array_equal(single.view(np.uint32), golden["single_logits"].view(np.uint32))


# --- kernel unit checks (the end-to-end tests above are the bit-exact ones) -----------------------

def test_rms_norm_matches_numpy_transcription():
    from synapse_nb.kernels import ops

    rng = np.random.default_rng(0)
    x = (rng.standard_normal((5, 576)) * 3).astype(np.float32)
    w = rng.standard_normal(576).astype(np.float32)
    eps = np.float32(1e-5)
    out = np.empty_like(x)
    ops.rms_norm_rows(out, x, w, eps)
    for t in range(5):  # ggml: float squares summed in double, mean and scale in float
        s = 0.0
        for v in x[t]:
            s += float(v * v)
        scale = np.float32(1) / np.sqrt(np.float32(s / 576) + eps, dtype=np.float32)
        assert np.array_equal(out[t], (x[t] * scale) * w)
    one = np.empty_like(x[:1])
    ops.rms_norm_rows(one, x[3:4], w, eps)  # the serial (one-row) kernel gives the same bits
    assert np.array_equal(one[0], out[3])
    ser = np.empty_like(x)
    ops._rms_norm_ser(ser, x, w, eps)  # serial, rows 0-3 side by side then row 4 alone
    assert np.array_equal(ser, out)


def test_v_expf_is_ggml_polynomial_exp():
    from numba import njit

    from synapse_nb.kernels import ops

    @njit
    def run(x, out):
        for i in range(x.shape[0]):
            out[i] = ops.v_expf(x[i])

    x = np.concatenate([np.linspace(-100, 80, 20001, dtype=np.float32),
                        np.array([0, -0.0, -np.inf, np.inf, -200, 200, -101, -88, 88], np.float32)])
    y = np.empty_like(x)
    run(x, y)
    ref = np.exp(x.astype(np.float64))
    fin = np.isfinite(ref) & (ref > 1e-37) & (ref < 3e38)
    ulps = np.abs(y[fin] - ref[fin]) / np.spacing(ref[fin].astype(np.float32))
    assert ulps.max() < 2.5  # ggml: max error 1.45 ulp + 0.5 rounding
    assert y[-9] == 1 and y[-8] == 1 and y[-7] == 0 and y[-6] == np.inf
    assert y[-5] == 0 and y[-4] == np.inf  # |n| > 192: 0 or inf
    assert 0 < y[-3] < 1e-38  # subnormal result of scalef


def test_rope_tables():
    from synapse_nb.kernels import ops

    # tiny-mistral3: n_rot 64, n_ctx_orig 32, base 1e6, beta_fast 32, beta_slow 1 -> ramp dims [0, 4]
    assert ops.rope_corr_dims(64, 32, np.float32(1e6), np.float32(32), np.float32(1)) == (0.0, 4.0)
    ts = ops.rope_theta_scale(np.float32(10000), 64)
    assert np.float32(ts) == np.float32(10000) ** (np.float32(-2) / np.float32(64))
    cache = np.empty((2, 64), np.float32)
    ops.rope_cache(cache, np.array([0, 5]), 64, ts, np.float32(1), np.ones(32, np.float32),
                   np.float32(0), np.float32(1), np.float32(0), np.float32(0))
    assert np.all(cache[0, 0::2] == 1) and np.all(cache[0, 1::2] == 0)  # position 0: identity
    theta = np.float32(5)  # theta multiplied by theta_scale once per pair, in float
    for i in range(32):
        assert abs(cache[1, 2 * i] - np.cos(np.float64(theta))) < 1e-6
        theta = np.float32(theta * np.float32(ts))
    # rotation: normal mode rotates (2i, 2i+1), NEOX (i, i+32); position 0 leaves x unchanged
    x = np.random.default_rng(1).standard_normal((2, 128)).astype(np.float32)
    for neox in (False, True):
        y = x.copy()
        ops.rope_rows(y, cache, 2, 64, 64, neox)
        assert np.array_equal(y[0], x[0]) and not np.array_equal(y[1], x[1])
        norms = lambda v: (v[:32] ** 2 + v[32:64] ** 2) if neox else (v[0:64:2] ** 2 + v[1:64:2] ** 2)
        assert np.allclose(norms(y[1]), norms(x[1]), rtol=1e-5)


def test_a_group_is_one_matvec_only_with_one_chunk_kernel():
    """q, k, v (gate, up) are one matvec call (graph.Tables' FUSE) when they share a format, a
    conversion and a chunk kernel: a weight whose rows are not a multiple of 4 runs its format's
    mv_any (matmul.Kernels), so it keeps its own call beside weights bound to mv."""
    import dataclasses

    from synapse_nb.kernels import bind
    from synapse_nb.kernels import graph as G

    model = shared_model("tiny-llama-q4_1")
    layers, hp = model.weights.layers, model.hparams
    t = G.Tables(layers, hp).matmuls(False, False)
    assert (t[:, G.WQ, G.FUSE] == 3).all() and (t[:, G.WGATE, G.FUSE] == 2).all()

    def cut(w):  # the weight's first rows, a number that is not a multiple of 4
        m = w.m - 4 + 1
        return bind(type("W", (), {"name": w.name, "ggml_type": w.fmt.ggml_type, "shape": (m, w.k),
                                   "data": w.rows[:m].reshape(-1)})())

    odd = [dataclasses.replace(L, wk=cut(L.wk), w_up=cut(L.w_up)) for L in layers]
    t = G.Tables(odd, hp).matmuls(False, False)
    assert (t[:, G.WK, G.CH_N] != t[:, G.WQ, G.CH_N]).all()
    assert (t[:, G.WQ, G.FUSE] == 0).all() and (t[:, G.WGATE, G.FUSE] == 0).all()
