"""K-quant row kernels (synapse_nb/kernels/kquants.py) against ggml and independent references.

- tests/data/kernels/FMT.npz: ggml-cpu's own Q8_K conversion (act_bytes) and vec_dot (y) on
  blk.0.ffn_up.weight of the tiny fixture: ours must equal them bit for bit.
- dequantize_row_T against gguf.quants.dequantize on every K-quant tensor of the tiny
  fixtures and on random multi-block rows: bit for bit.
- quantize_row_q8_K against a NumPy transcription of ggml-quants.c quantize_row_q8_K_ref.
- vec_dot_T_q8_K on random 19-block rows against a NumPy transcription of the x86 AVX2
  accumulation (exact integer lanes, one correctly rounded fma per lane and block,
  hsum_float_8): bit for bit; and against float64 dot products of the dequantized operands
  within the float32 rounding bound derived below.
"""

from fractions import Fraction

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from conftest import KERNELS, tiny
from synapse_nb.kernels import kquants as kq
from synapse_nb.kernels.decorator import python_call

FORMATS = {
    # fixture name: (ggml type, block bytes, offsets of the f16 fields in a block)
    "q2_k": (T.Q2_K, 84, (80, 82)),
    "q3_k": (T.Q3_K, 110, (108,)),
    "q4_k": (T.Q4_K, 144, (0, 2)),
    "q5_k": (T.Q5_K, 176, (0, 2)),
    "q6_k": (T.Q6_K, 210, (208,)),
    "iq4_xs": (T.IQ4_XS, 136, (0,)),
}
SUFFIX = {"q2_k": "q2_K", "q3_k": "q3_K", "q4_k": "q4_K", "q5_k": "q5_K", "q6_k": "q6_K", "iq4_xs": "iq4_xs"}
TYPE_TO_FMT = {v[0]: k for k, v in FORMATS.items()}


def test_block_layouts_match_the_format_table():
    from synapse_nb import formats as F

    for fmt, (ggml_type, size, f16_offsets) in FORMATS.items():
        assert (F.format_of(ggml_type).type_size, F.format_of(ggml_type).f16_fields) == (size, f16_offsets), fmt


def dot_kernel(fmt):
    return getattr(kq, f"vec_dot_{SUFFIX[fmt]}_q8_K")


def dot_fn(fmt):  # the row functions are nested kernels: called from Python through python_call
    return python_call(dot_kernel(fmt))


def deq_fn(fmt):
    return python_call(getattr(kq, f"dequantize_row_{SUFFIX[fmt]}"))


def scratch(k):
    return np.empty(2 * k + 128, np.int32)  # the driver's scratch contract (unused by these kernels)


def q8k(x):
    a = np.empty(x.size // 256 * 292, np.uint8)
    python_call(kq.quantize_row_q8_K)(a, x)
    return a


def random_rows(fmt, n_rows, nb, rng):
    """Random block bytes with finite, sane f16 scales (d, dmin ~ N(0, 0.01))."""
    _, bs, f16_offsets = FORMATS[fmt]
    w = rng.integers(0, 256, (n_rows, nb * bs), dtype=np.uint8)
    for b in range(nb):
        for o in f16_offsets:
            h = rng.normal(0.0, 0.01, n_rows).astype(np.float16)
            w[:, b * bs + o: b * bs + o + 2] = h.view(np.uint8).reshape(n_rows, 2)
    return w


def bits(a):
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def bits1(x):
    """Bit pattern of one float32 scalar."""
    return int(np.array(x, np.float32).view(np.uint32))


# ------------------------------------------------------------------------------------------
# ggml's own results
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", list(FORMATS))
def test_q8_K_matches_ggml_bytes(fmt):
    z = np.load(KERNELS / f"{fmt}.npz")
    assert str(z["act_type"]) == "Q8_K"
    for r in range(z["x"].shape[0]):
        assert np.array_equal(q8k(z["x"][r]), z["act_bytes"][r]), f"row {r}"


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_vec_dot_matches_ggml(fmt):
    z = np.load(KERNELS / f"{fmt}.npz")
    assert str(z["weight_type"]).lower() == fmt
    w, a, y = z["weight_bytes"], z["act_bytes"], z["y"]
    dot = dot_fn(fmt)
    s = scratch(256)
    ours = np.array([[dot(w[m], a[r], s) for m in range(w.shape[0])] for r in range(a.shape[0])], np.float32)
    rel = np.abs(ours.astype(np.float64) - y) / np.maximum(np.abs(y), np.finfo(np.float32).tiny)
    # bit for bit (the report's "max relative error" is this maximum: 0)
    assert np.array_equal(bits(ours), bits(y)), f"max rel err {rel.max():.3g}"


# ------------------------------------------------------------------------------------------
# dequantization
# ------------------------------------------------------------------------------------------

KQUANT_GGUFS = [f"tiny-llama-{f}" for f in FORMATS] + [
    "tiny-llama3-q4_k_m", "tiny-qwen2-q4_k_m", "tiny-mistral3-q4_k_m", "tiny-llama-hd128-q4_k_m"]


@pytest.mark.parametrize("name", KQUANT_GGUFS)
def test_dequantize_fixture_tensors_bit_exact(name):
    reader = gguf.GGUFReader(tiny(name))
    n_checked = 0
    for t in reader.tensors:
        fmt = TYPE_TO_FMT.get(t.tensor_type)
        if fmt is None:
            continue
        rows = np.ascontiguousarray(t.data).reshape(t.data.shape[0], -1)
        ref = gguf.quants.dequantize(rows, t.tensor_type)
        ours = np.empty(ref.shape, np.float32)
        deq = deq_fn(fmt)
        for m in range(rows.shape[0]):
            deq(ours[m], rows[m])
        assert np.array_equal(bits(ours), bits(ref)), t.name
        n_checked += 1
    assert n_checked >= 3


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_dequantize_random_rows_bit_exact(fmt):
    rng = np.random.default_rng(11)
    w = random_rows(fmt, 64, 5, rng)
    ref = gguf.quants.dequantize(w, FORMATS[fmt][0])
    ours = np.empty(ref.shape, np.float32)
    for m in range(w.shape[0]):
        deq_fn(fmt)(ours[m], w[m])
    assert np.array_equal(bits(ours), bits(ref))


# ------------------------------------------------------------------------------------------
# Q8_K quantizer vs a NumPy transcription of quantize_row_q8_K_ref
# ------------------------------------------------------------------------------------------

def ref_q8_K(x):
    out = []
    for blk in x.reshape(-1, 256).astype(np.float32):
        i = int(np.argmax(np.abs(blk)))  # first value of largest magnitude ("ax > amax")
        if np.abs(blk[i]) == 0:
            out.append(np.zeros(292, np.uint8))
            continue
        iscale = np.float32(-127.0) / blk[i]
        q = np.minimum(np.rint(iscale * blk), np.float32(127)).astype(np.int8)  # float32 product, half-even
        d = np.float32(1.0) / iscale
        bsums = q.astype(np.int32).reshape(16, 16).sum(axis=1).astype(np.int16)
        out.append(np.concatenate([np.array([d], np.float32).view(np.uint8), q.view(np.uint8),
                                   bsums.view(np.uint8)]))
    return np.concatenate(out)


def q8_cases():
    rng = np.random.default_rng(5)
    ties_neg = (rng.integers(-126, 126, 256) + 0.5).astype(np.float32)
    ties_neg[17] = -127.0  # max -127: iscale = 1, every other value sits on a .5 tie
    ties_pos = -ties_neg   # max +127: iscale = -1
    first_wins = rng.standard_normal(256).astype(np.float32)
    first_wins[3], first_wins[200] = 4.0, -4.0  # equal magnitudes: the first one sets the sign
    return {
        "normal": rng.standard_normal(256 * 4).astype(np.float32),
        "mixed_zero_blocks": np.concatenate([np.zeros(256, np.float32), rng.standard_normal(256).astype(np.float32) * 50,
                                             np.zeros(256, np.float32)]),
        "ties_neg_max": ties_neg,
        "ties_pos_max": ties_pos,
        "first_wins": first_wins,
        "tiny": (rng.standard_normal(512) * 1e-30).astype(np.float32),
        "spike": np.where(np.arange(256) == 77, np.float32(1e4), np.float32(1e-3)).astype(np.float32),
    }


@pytest.mark.parametrize("case", list(q8_cases()))
def test_q8_K_matches_numpy_transcription(case):
    x = q8_cases()[case]
    assert np.array_equal(q8k(x), ref_q8_K(x))


def test_q8_K_zero_block_is_all_zero():
    x = np.zeros(512, np.float32)
    x[300] = 1.0
    a = q8k(x)
    assert not a[:292].any()
    assert a[292:].any()


# ------------------------------------------------------------------------------------------
# vec_dot vs a NumPy transcription of the x86 accumulation, and vs float64
# ------------------------------------------------------------------------------------------

def fma32(a, b, c):
    """Correctly rounded float32 fma(a, b, c) (exact rational arithmetic, ties to even)."""
    exact = Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c))
    f = np.float32(float(exact))
    best = f
    for cand in (np.nextafter(f, np.float32(-np.inf)), np.nextafter(f, np.float32(np.inf))):
        e_c, e_b = abs(Fraction(float(cand)) - exact), abs(Fraction(float(best)) - exact)
        if e_c < e_b or (e_c == e_b and (bits1(cand) & 1) == 0):
            best = cand
    return np.float32(best)


def hsum8(a):
    r = [np.float32(a[k] + a[k + 4]) for k in range(4)]
    return np.float32(np.float32(r[0] + r[2]) + np.float32(r[1] + r[3]))


def f16(b, o):
    return np.float32(b[o: o + 2].view(np.float16)[0])


def k4_scales_mins(s12):
    s = s12.astype(np.int32)
    sc = np.concatenate([s[0:4] & 63, (s[8:12] & 15) | ((s[0:4] >> 6) << 4)])
    mn = np.concatenate([s[4:8] & 63, (s[8:12] >> 4) | ((s[4:8] >> 6) << 4)])
    return sc, mn


def block_ints(fmt, b):
    """(per-value integer weights q[256], per-value integer scale[256], extras) of one block."""
    if fmt == "q2_k":
        qs = b[16:80].astype(np.int32)
        q = np.concatenate([(qs[32 * j: 32 * j + 32] >> (2 * s)) & 3 for j in range(2) for s in range(4)])
        return q, np.repeat(b[0:16].astype(np.int32) & 15, 16), b[0:16].astype(np.int32) >> 4
    if fmt == "q3_k":
        qs, hm, s = b[32:96].astype(np.int32), b[0:32].astype(np.int32), b[96:108].astype(np.int32)
        q = np.concatenate([((qs[32 * j: 32 * j + 32] >> (2 * k)) & 3) - 4 + (((hm >> (4 * j + k)) & 1) << 2)
                            for j in range(2) for k in range(4)])
        lo = np.concatenate([s[0:8] & 15, s[0:8] >> 4])
        hi = np.concatenate([(s[8:12] >> (2 * k)) & 3 for k in range(4)])
        return q, np.repeat((lo | (hi << 4)) - 32, 16), None
    if fmt in ("q4_k", "q5_k"):
        sc, mn = k4_scales_mins(b[4:16])
        if fmt == "q4_k":
            qs = b[16:144].astype(np.int32)
            q = np.concatenate([x for j in range(4) for x in (qs[32 * j: 32 * j + 32] & 15, qs[32 * j: 32 * j + 32] >> 4)])
        else:
            qs, qh = b[48:176].astype(np.int32), b[16:48].astype(np.int32)
            q = np.concatenate([x for j in range(4) for x in (
                (qs[32 * j: 32 * j + 32] & 15) | (((qh >> (2 * j)) & 1) << 4),
                (qs[32 * j: 32 * j + 32] >> 4) | (((qh >> (2 * j + 1)) & 1) << 4))])
        return q, np.repeat(sc, 32), mn
    if fmt == "q6_k":
        ql, qh = b[0:128].astype(np.int32), b[128:192].astype(np.int32)
        parts = []
        for j in range(2):
            a_, b_, h = ql[64 * j: 64 * j + 32], ql[64 * j + 32: 64 * j + 64], qh[32 * j: 32 * j + 32]
            parts += [(a_ & 15) | ((h & 3) << 4), (b_ & 15) | (((h >> 2) & 3) << 4),
                      (a_ >> 4) | (((h >> 4) & 3) << 4), (b_ >> 4) | (((h >> 6) & 3) << 4)]
        return np.concatenate(parts), np.repeat(b[192:208].view(np.int8).astype(np.int32), 16), None  # unsigned 0..63
    if fmt == "iq4_xs":
        kv = kq.KVALUES_IQ4NL.astype(np.int32)
        sh = int(b[2]) | (int(b[3]) << 8)
        ls = [(((int(b[4 + ib // 2]) >> (4 * (ib % 2))) & 15) | (((sh >> (2 * ib)) & 3) << 4)) - 32 for ib in range(8)]
        qs = b[8:136].astype(np.int32)
        q = np.concatenate([x for ib in range(8) for x in (kv[qs[16 * ib: 16 * ib + 16] & 15], kv[qs[16 * ib: 16 * ib + 16] >> 4])])
        return q, np.repeat(np.array(ls, np.int32), 32), None
    raise AssertionError(fmt)


def ref_vec_dot(fmt, w, a):
    """NumPy transcription of ggml_vec_dot_T_q8_K (x86 AVX2) for one row."""
    bs = FORMATS[fmt][1]
    acc = [np.float32(0)] * 8
    accm = [np.float32(0)] * 4
    summs = np.float32(0)
    for i in range(w.size // bs):
        b, y = w[i * bs: (i + 1) * bs], a[i * 292: (i + 1) * 292]
        yd = y[0:4].view(np.float32)[0]
        q8 = y[4:260].view(np.int8).astype(np.int64)
        bsums = y[260:292].view(np.int16).astype(np.int64)
        q, sc, extra = block_ints(fmt, b)
        lanes = (sc.astype(np.int64) * q * q8).reshape(8, 8, 4).sum(axis=(0, 2))  # lane k: positions 4k..4k+3
        d = {"q2_k": lambda: yd * f16(b, 80), "q3_k": lambda: yd * f16(b, 108), "q6_k": lambda: yd * f16(b, 208),
             "iq4_xs": lambda: f16(b, 0) * yd}.get(fmt, lambda: yd * f16(b, 0))()
        if fmt == "q2_k":
            dmin = -yd * f16(b, 82)
            prod = (extra.astype(np.int64) * bsums).reshape(8, 2).sum(axis=1)
            acc = [fma32(dmin, np.float32(prod[k]), acc[k]) for k in range(8)]
        if fmt == "q6_k":
            lanes = lanes - 32 * (sc[::16].astype(np.int64) * bsums).reshape(8, 2).sum(axis=1)
        if fmt == "q4_k":
            dmin = -yd * f16(b, 2)
            q8s = bsums.reshape(8, 2).sum(axis=1)
            prod = (extra.astype(np.int64) * q8s).reshape(4, 2).sum(axis=1)
            accm = [fma32(dmin, np.float32(prod[m]), accm[m]) for m in range(4)]
        if fmt == "q5_k":
            dmin = -yd * f16(b, 2)
            summs = fma32(dmin, np.float32(int((extra.astype(np.int64) * bsums.reshape(8, 2).sum(axis=1)).sum())), summs)
        acc = [fma32(d, np.float32(lanes[k]), acc[k]) for k in range(8)]
    out = hsum8(acc)
    if fmt == "q4_k":
        out = np.float32(out + np.float32(np.float32(accm[0] + accm[2]) + np.float32(accm[1] + accm[3])))
    if fmt == "q5_k":
        out = np.float32(out + summs)
    return out


def random_acts(k, rng):
    x = (rng.standard_normal(k) * 10.0 ** rng.uniform(-3, 2)).astype(np.float32)
    x[256:512] = 0  # one all-zero block
    return q8k(x)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_vec_dot_matches_numpy_transcription(fmt):
    rng = np.random.default_rng(3)
    nb = 19  # 4864 values, the ffn_down rows of Qwen2.5-0.5B
    w = random_rows(fmt, 6, nb, rng)
    for r in range(3):
        a = random_acts(nb * 256, rng)
        for m in range(w.shape[0]):
            ours = dot_fn(fmt)(w[m], a, scratch(nb * 256))
            ref = ref_vec_dot(fmt, w[m], a)
            assert bits1(ours) == bits1(ref), (r, m, ours, ref)


def extreme_rows(fmt, n_rows, nb, rng):
    """Rows whose stored values and scales are at their limits (bytes 0xFF, 0x00, 0x80, 0x7F, 0x55
    runs: every value 63 for Q6_K, kvalues' ends for IQ4_XS, ...), finite f16 fields."""
    _, bs, f16_offsets = FORMATS[fmt]
    fill = np.array([0xFF, 0x00, 0x80, 0x7F, 0x55, 0xAA], np.uint8)
    w = np.repeat(fill[rng.integers(0, fill.size, (n_rows, nb))], bs, axis=1)
    for b in range(nb):
        for o in f16_offsets:
            h = rng.uniform(-0.05, 0.05, n_rows).astype(np.float16)
            w[:, b * bs + o: b * bs + o + 2] = h.view(np.uint8).reshape(n_rows, 2)
    return np.ascontiguousarray(w)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_vec_dot4_matches_vec_dot(fmt):
    """vec_dot4_T_q8_K (the matvec's four-row kernel) == vec_dot_T_q8_K row by row, bit for bit, on
    random and extreme 19-block rows (22 of them, also through the matvec driver: groups of 4 and
    the single-row kernel for the rest) and activations: random, all +-127 (the largest products),
    one all-zero block."""
    from synapse_nb.kernels import matvec

    rng = np.random.default_rng(11)
    nb, k = 19, 19 * 256
    dot4 = python_call(getattr(kq, f"vec_dot4_{SUFFIX[fmt]}_q8_K"))
    w = np.concatenate([random_rows(fmt, 11, nb, rng), extreme_rows(fmt, 11, nb, rng)])
    w = w[rng.permutation(len(w))]
    xs = [(rng.standard_normal(k) * 10.0 ** rng.uniform(-3, 2)).astype(np.float32) for _ in range(3)]
    xs.append(np.where(rng.random(k) < 0.5, -1.0, 1.0).astype(np.float32))  # every q8 is +-127
    xs.append(np.full(k, -2.5, np.float32))
    xs[0][256:512] = 0.0
    for x in xs:
        a = q8k(x)
        ref = np.array([dot_fn(fmt)(w[m], a, scratch(k)) for m in range(len(w))], np.float32)
        assert np.isfinite(ref).all()
        y = np.zeros(len(w), np.float32)
        for m in range(0, len(w) - 3, 2):  # (overlapping groups: every row in several positions)
            dot4(y, m, w, a)
            assert np.array_equal(bits(y[m:m + 4]), bits(ref[m:m + 4])), m
        t = type("W", (), dict(name="w", ggml_type=FORMATS[fmt][0], shape=(len(w), k), data=w.reshape(-1)))
        assert np.array_equal(bits(matvec(t, x)), bits(ref))


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_vec_dot_close_to_float64_of_dequantized(fmt):
    """ours vs sum(dequant(w) * dequant(a)) in float64.

    Bound: ours is exact integer lanes, one rounding in d = y.d*x.d, nb fmas per lane, three
    levels of hsum (+1 for the min terms); the float64 side uses dequantized float32 weights,
    themselves rounded (d*sc, then *q, then - dmin*m: up to 3 roundings of 2^-24 relative to
    the terms).  Every rounding is at most 2^-24 relative to a partial sum bounded by
    S = sum |w_i * a_i| (dequantized), so |ours - ref| <= (nb + 8) * 2^-24 * S.
    """
    rng = np.random.default_rng(7)
    nb = 19
    w = random_rows(fmt, 32, nb, rng)
    wd = gguf.quants.dequantize(w, FORMATS[fmt][0]).astype(np.float64)
    worst = 0.0
    for r in range(4):
        a = random_acts(nb * 256, rng)
        blocks = a.reshape(nb, 292)
        ad = (blocks[:, 4:260].view(np.int8).astype(np.float64) * blocks[:, 0:4].view(np.float32).astype(np.float64)).ravel()
        ref = wd @ ad
        S = np.abs(wd) @ np.abs(ad)
        ours = np.array([dot_fn(fmt)(w[m], a, scratch(nb * 256)) for m in range(w.shape[0])], np.float64)
        err = np.abs(ours - ref) / np.maximum(S, 1e-300)
        worst = max(worst, err.max())
        assert (err <= (nb + 8) * 2.0 ** -24).all(), err.max()
    assert worst > 0  # the comparison is live (float32 rounding is visible)


def test_portable_dot_path_matches_ggml(monkeypatch):
    """The vector-IR fallback used on CPUs without AVX512-VNNI gives the same bits.

    kquant_ir.dot32_scaled_add (vpdpbusd), iq4_lookup32 (pshufb) and f16_to_f32 (vcvtph2ps) pick
    their instruction or portable IR when a kernel is compiled; recompile every
    vec_dot (uncached) with the portable choice and compare with ggml's results.
    (tests/test_kernels_portable.py runs every format's portable path in a generic-CPU process.)
    """
    from numba import njit

    from synapse_nb.kernels import simd

    monkeypatch.setattr(simd, "HAS_VNNI256", False)
    monkeypatch.setattr(simd, "HAS_PSHUFB", False)
    monkeypatch.setattr(simd, "HAS_F16C", False)
    rng = np.random.default_rng(9)
    for fmt in FORMATS:
        portable = njit(cache=False)(dot_kernel(fmt).py_func)
        z = np.load(KERNELS / f"{fmt}.npz")
        w, a, y = z["weight_bytes"], z["act_bytes"], z["y"]
        ours = np.array([[portable(w[m], a[r], scratch(256)) for m in range(0, w.shape[0], 7)]
                         for r in range(a.shape[0])], np.float32)
        assert np.array_equal(bits(ours), bits(y[:, ::7])), fmt
        wr = random_rows(fmt, 4, 19, rng)
        ar = random_acts(19 * 256, rng)
        for m in range(wr.shape[0]):
            assert bits1(portable(wr[m], ar, scratch(19 * 256))) == bits1(dot_fn(fmt)(wr[m], ar, scratch(19 * 256)))
