"""Numba kernels for the non-matmul steps of the Llama graph: RMSNorm, RoPE, SwiGLU, exp.

Each kernel reproduces the float operations of ggml-cpu (llama.cpp vendored in llama-cpp-python
0.3.36, x86 with AVX-512F/DQ, built by GCC with its default -ffp-contract=fast) one for one, so
that a row computed here equals ggml's bit for bit:

  rms_norm_rows  ggml-cpu/ops.cpp ggml_compute_forward_rms_norm_f32 (+ the fused MUL by the weight)
  rope_cache     ggml-cpu/ops.cpp ggml_rope_cache_init / rope_yarn / rope_yarn_ramp and
                 ggml.c ggml_rope_yarn_corr_dims
  rope_rows      ggml-cpu/ops.cpp rotate_pairs (GGML_ROPE_TYPE_NORMAL and _NEOX)
  swiglu_rows    ggml-cpu/vec.cpp ggml_vec_swiglu_f32 (ggml_v_silu on 16 lanes, ggml_silu_f32 tail)
  geglu_rows     ggml-cpu/vec.h ggml_vec_geglu_f32 with GGML_GELU_FP16 (defined there unconditionally):
                 the gate rounded to F16 and looked up in ggml_table_gelu_f16 (gelu_table)
  v_expf         ggml-cpu/vec.h ggml_v_expf (AVX-512 branch), one lane

Kernels write into arrays the caller allocated (output first) and do not bounds-check: the
Python callers in synapse_nb.model validate shapes. Rows are independent, so results do not
depend on the thread count.
"""

import math
from typing import NamedTuple

import numpy as np
from llvmlite import ir
from numba import prange, types
from numba.core import cgutils

from .decorator import kernel
from .scalar import f16_to_f32, f32_bits, f32_to_f16_bits, fma32, u32_as_f32
from .simd import flat_args, ir_data, ir_f32_to_f16, ir_intrinsic, ir_load, ir_shuffle, ir_store

_F32 = np.float32

# ggml_v_expf constants, written as in vec.h (hex float literals)
EXPF_LOG2E = np.float32(float.fromhex("0x1.715476p+0"))
EXPF_LN2_HI = np.float32(float.fromhex("0x1.62e4p-1"))
EXPF_LN2_LO = np.float32(float.fromhex("0x1.7f7d1cp-20"))
EXPF_C5 = np.float32(float.fromhex("0x1.0e4020p-7"))
EXPF_C4 = np.float32(float.fromhex("0x1.573e2ep-5"))
EXPF_C3 = np.float32(float.fromhex("0x1.555e66p-3"))
EXPF_C2 = np.float32(float.fromhex("0x1.fffdb6p-2"))
EXPF_C1 = np.float32(float.fromhex("0x1.ffffecp-1"))


# ---------------------------------------------------------------------------------------------
# exp / silu
# ---------------------------------------------------------------------------------------------

@kernel(inline="always")
def _expf_n(x):
    """n = round(x / ln 2) as float32, by the 0x1.8p23 shift (ggml_v_expf's first step)."""
    r = _F32(12582912.0)  # 0x1.8p23f
    return fma32(x, EXPF_LOG2E, r) - r


@kernel(inline="always")
def _expf_poly(x, n):
    """ggml_v_expf's j(b): b = x - n ln 2 in two fnmadd steps, then its degree-5 polynomial."""
    b = fma32(-n, EXPF_LN2_LO, fma32(-n, EXPF_LN2_HI, x))
    u = b * b
    return fma32(
        fma32(fma32(EXPF_C5, b, EXPF_C4), u,
              fma32(EXPF_C3, b, EXPF_C2)),
        u,
        fma32(EXPF_C1, b, _F32(1.0)))


@kernel(inline="always")
def _expf_normal_n(n):
    """Whether 2**n is a normal float, -125 <= n <= 127 (false for NaN): where j * 2**n is one
    float multiply (v_expf_normal's path)."""
    return (n >= _F32(-125.0)) & (n <= _F32(127.0))


@kernel(inline="always")
def v_expf(x):
    """One lane of ggml_v_expf (ggml-cpu/vec.h, __AVX512F__ && __AVX512DQ__ branch).

    x: float32. Returns float32 exp(x) with ggml's polynomial (max error ~1.5 ulp): n = round(x /
    ln 2) by the 0x1.8p23 shift, b = x - n ln 2 in two fnmadd steps, a degree-5 polynomial j(b)
    in fmadds, then _mm512_scalef_ps(j, n) = j * 2**n rounded once; |n| > 192 gives 0 (n <= 0)
    or inf.
    """
    n = _expf_n(x)
    if math.fabs(n) > _F32(192.0):
        return _F32(0.0) if n <= _F32(0.0) else _F32(np.inf)
    if n != n:  # NaN input: the mask tests are false, the polynomial result (NaN) is returned
        return n
    j = _expf_poly(x, n)
    # scalef: j * 2**n rounded once. For -125 <= n <= 127, 2**n is a normal float and j * 2**n
    # (j in [0.7, 1.5)) a normal float or inf: one float multiply rounds exactly as scalef.
    # Otherwise (subnormal results) scale exactly in double and round once to float.
    ni = np.int32(n)
    if ni >= -125 and ni <= 127:
        return j * u32_as_f32(np.uint32(ni + 127) << np.uint32(23))
    return _F32(math.ldexp(np.float64(j), int(ni)))


@kernel(inline="always")
def v_expf_normal(x):
    """v_expf(x) on its common path, without branches so that a loop over it vectorizes.

    x: float32. Returns (value, ok): when ok (_expf_normal_n: -125 <= n <= 127, n = round(x /
    ln 2); false for NaN), value is v_expf(x) bit for bit (the polynomial scaled by one float
    multiply); otherwise value is meaningless and the caller must use v_expf(x).
    """
    n = _expf_n(x)
    j = _expf_poly(x, n)
    ok = _expf_normal_n(n)
    ni = np.int32(n if ok else _F32(0.0))
    return j * u32_as_f32(np.uint32(ni + 127) << np.uint32(23)), ok


@kernel(inline="always")
def v_silu(x):
    """One lane of ggml_v_silu (AVX-512): x / (1 + ggml_v_expf(0 - x)), float32."""
    e = v_expf(_F32(0.0) - x)
    return x / (_F32(1.0) + e)


@kernel(inline="always")
def silu_f32(x):
    """ggml_silu_f32 (vec.h): x / (1.0f + expf(-x)) with libm expf (the scalar tail)."""
    return x / (_F32(1.0) + math.exp(-x))


@kernel(nested=True)
def _swiglu_row(out, gate, up, t):
    m = gate.shape[1]
    m16 = m - m % 16
    # ggml_v_silu on its common path in a loop that vectorizes (v_expf_normal), then v_silu itself
    # for the rare lanes off it (as the softmax in attention.py)
    n_off = 0
    for i in range(m16):
        g = gate[t, i]
        e, ok = v_expf_normal(_F32(0.0) - g)
        out[t, i] = (g / (_F32(1.0) + e)) * up[t, i]
        n_off += np.int32(0) if ok else np.int32(1)
    if n_off:
        for i in range(m16):
            if not _expf_normal_n(_expf_n(_F32(0.0) - gate[t, i])):  # v_expf_normal's ok alone
                out[t, i] = v_silu(gate[t, i]) * up[t, i]
    for i in range(m16, m):
        out[t, i] = silu_f32(gate[t, i]) * up[t, i]


@kernel(parallel=True)
def _swiglu_par(out, gate, up):
    for t in prange(gate.shape[0]):
        _swiglu_row(out, gate, up, np.int64(t))  # (int64 as in _swiglu_ser: one compiled row function)


@kernel
def _swiglu_ser(out, gate, up):
    for t in range(gate.shape[0]):
        _swiglu_row(out, gate, up, t)


def swiglu_rows(out, gate, up):
    """out[n, i] = silu(gate[n, i]) * up[n, i]: ggml_vec_swiglu_f32 per row.

    out, gate, up: float32 [N, n_ff]. The first n_ff - n_ff % 16 columns use the 16-lane
    ggml_v_silu; the remainder the scalar ggml_silu_f32 with libm expf (as ggml's tail loop).
    Rows run in parallel when there are several (one row is not worth waking threads).
    """
    row_kernels(gate.shape[0]).swiglu(out, gate, up)


# ---------------------------------------------------------------------------------------------
# GEGLU (Gemma 3's FFN): gelu(gate) * up through ggml's F16 GELU table
# ---------------------------------------------------------------------------------------------

_GELU_COEF_A = np.float32(0.044715)
_SQRT_2_OVER_PI = np.float32(0.79788456080286535587989211986876)


@kernel
def _gelu_table_f32(out):
    """out[i] = ggml_table_gelu_f16[i] as float32: for the F16 value x of bits i,
    F16(ggml_gelu_f32(x)), ggml_gelu_f32 = 0.5f*x*(1.0f + tanhf(SQRT_2_OVER_PI*x*(1.0f +
    GELU_COEF_A*x*x))) as GCC contracts it (1.0f + (A*x)*x fused) with libm tanhf (ggml_cpu_init)."""
    for i in range(65536):
        x = f16_to_f32(np.uint16(i))
        c = fma32(_GELU_COEF_A * x, x, _F32(1.0))
        t = math.tanh((_SQRT_2_OVER_PI * x) * c)
        y = (_F32(0.5) * x) * (_F32(1.0) + t)
        out[i] = f16_to_f32(f32_to_f16_bits(y, f32_bits(y)))


_GELU_TABLE = []


def gelu_table() -> np.ndarray:
    """ggml_table_gelu_f16 as float32 [65536] (indexed by F16 bits), built on first use."""
    if not _GELU_TABLE:
        t = np.empty(65536, np.float32)
        _gelu_table_f32(t)
        _GELU_TABLE.append(t)
    return _GELU_TABLE[0]


@ir_intrinsic(lambda out, gate, up, table, i: types.void(out, gate, up, table, types.intp)
              if flat_args(out, gate, up, table) else None)
def geglu16(context, builder, sig, args):
    """out[i + l] for l < 16 (flat float32 offsets; 1-D rows): ggml_vec_geglu_f32's scalar loop on
    16 lanes at once. gate rounded to F16 (vcvtps2ph), its table entry fetched per lane, then
    per lane: 0 where gate <= -10, gate * up where gate >= 10, else table * up (NaN: table)."""
    f32 = ir.FloatType()
    o, g, u, tab = (ir_data(context, builder, t, v, f32) for t, v in zip(sig.args[:4], args[:4]))
    i = args[4]
    v16f = ir.VectorType(f32, 16)
    x, up = ir_load(builder, builder.gep(g, [i]), 16, f32, align=4), ir_load(builder, builder.gep(u, [i]), 16, f32, align=4)
    idx = builder.zext(ir_f32_to_f16(builder, x), ir.VectorType(ir.IntType(32), 16))
    t = ir.Constant(v16f, ir.Undefined)
    for lane in range(16):
        at = builder.extract_element(idx, ir.Constant(ir.IntType(32), lane))
        t = builder.insert_element(t, builder.load(builder.gep(tab, [at])), ir.Constant(ir.IntType(32), lane))
    big = builder.fcmp_ordered(">=", x, ir.Constant(v16f, [10.0] * 16))
    y = builder.fmul(builder.select(big, x, t), up)
    y = builder.select(builder.fcmp_ordered("<=", x, ir.Constant(v16f, [-10.0] * 16)), ir.Constant(v16f, [0.0] * 16), y)
    ir_store(builder, y, builder.gep(o, [i]), align=4)


@kernel(nested=True)
def _geglu_row(out, gate, up, table, t):
    m = gate.shape[1]
    m16 = m - m % 16
    o, g, u = out[t], gate[t], up[t]
    for i in range(0, m16, 16):
        geglu16(o, g, u, table, i)
    for i in range(m16, m):
        x = g[i]
        if x <= _F32(-10.0):
            o[i] = _F32(0.0)
        elif x >= _F32(10.0):
            o[i] = x * u[i]
        else:
            o[i] = table[f32_to_f16_bits(x, f32_bits(x))] * u[i]


@kernel(parallel=True)
def _geglu_par(out, gate, up, table):
    for t in prange(gate.shape[0]):
        _geglu_row(out, gate, up, table, np.int64(t))


@kernel
def _geglu_ser(out, gate, up, table):
    for t in range(gate.shape[0]):
        _geglu_row(out, gate, up, table, t)


def geglu_rows(out, gate, up):
    """out[n, i] = gelu(gate[n, i]) * up[n, i]: ggml_vec_geglu_f32 per row, GGML_GELU_FP16 branch:
    0 for gate <= -10, gate * up for gate >= 10, else the F16 table's gelu of F16(gate), times up
    (float). out, gate, up: float32 [N, n_ff]."""
    (_geglu_par if gate.shape[0] > 1 else _geglu_ser)(out, gate, up, gelu_table())


# ---------------------------------------------------------------------------------------------
# RMSNorm
# ---------------------------------------------------------------------------------------------

@kernel(nested=True)
def _rms_norm_row(out, x, w, eps, t):
    m = x.shape[1]
    s = 0.0
    for i in range(m):
        v = x[t, i]
        s += np.float64(v * v)
    _rms_scale_row(out, x, w, eps, t, s)


@kernel(inline="always")
def _rms_scale_row(out, x, w, eps, t, s):
    """out[t] = (x[t] * scale) * w, scale = 1 / sqrt((float)(s / m) + eps) from the row's sum s."""
    m = x.shape[1]
    mean = _F32(s / m)
    scale = _F32(1.0) / math.sqrt(mean + eps)
    for i in range(m):
        out[t, i] = (x[t, i] * scale) * w[i]


@kernel(nested=True)
def _rms_norm_rows4(out, x, w, eps, t):
    """_rms_norm_row for rows t..t+3: their four sums side by side (each still in index order, a
    chain of double adds whose latency one row alone waits on)."""
    m = x.shape[1]
    s0 = s1 = s2 = s3 = 0.0
    for i in range(m):
        v0, v1, v2, v3 = x[t, i], x[t + 1, i], x[t + 2, i], x[t + 3, i]
        s0 += np.float64(v0 * v0)
        s1 += np.float64(v1 * v1)
        s2 += np.float64(v2 * v2)
        s3 += np.float64(v3 * v3)
    _rms_scale_row(out, x, w, eps, t, s0)
    _rms_scale_row(out, x, w, eps, t + 1, s1)
    _rms_scale_row(out, x, w, eps, t + 2, s2)
    _rms_scale_row(out, x, w, eps, t + 3, s3)


@kernel(parallel=True)
def _rms_norm_par(out, x, w, eps):
    n = x.shape[0]
    n4 = n // 4
    for g in prange(n4 + n % 4):
        if g < n4:
            _rms_norm_rows4(out, x, w, eps, np.int64(4 * g))
        else:
            _rms_norm_row(out, x, w, eps, np.int64(4 * n4 + g - n4))  # (int64 as in _rms_norm_ser)


@kernel
def _rms_norm_ser(out, x, w, eps):
    n = x.shape[0]
    n4 = n - n % 4
    for t in range(0, n4, 4):
        _rms_norm_rows4(out, x, w, eps, t)
    for t in range(n4, n):
        _rms_norm_row(out, x, w, eps, t)


@kernel
def _rms_norm_rows1(out, x, w, eps):
    """_rms_norm_ser one row after another, without the four-row kernel: the kernel of a one-token
    forward (its rows: the token, or its heads for a head norm), so that a first run that only
    decodes does not compile _rms_norm_rows4 (0.4 s)."""
    for t in range(x.shape[0]):
        _rms_norm_row(out, x, w, eps, t)


def rms_norm_rows(out, x, w, eps):
    """out[n] = x[n] * (1 / sqrt(mean(x[n]**2) + eps)) * w, per row.

    ggml_compute_forward_rms_norm_f32 fused with the MUL by the norm weight: each square is a
    float product accumulated in double in index order; mean = (float)(sum / n); scale =
    1.0f / sqrtf(mean + eps); y = (x * scale) * w in float.
    out, x: float32 [N, n_embd]; w: float32 [n_embd]; eps: float32.
    """
    row_kernels(x.shape[0]).rms_norm(out, x, w, np.float32(eps))


# ---------------------------------------------------------------------------------------------
# RoPE
# ---------------------------------------------------------------------------------------------

@kernel
def rope_theta_scale(freq_base, n_dims):
    """powf(freq_base, -2.0f / n_dims) with libm powf, as ggml_compute_forward_rope_flt.

    Returns the float32 value (as a Python float when called from Python)."""
    return _F32(freq_base) ** (_F32(-2.0) / _F32(n_dims))


@kernel
def rope_corr_dims(n_dims, n_ctx_orig, freq_base, beta_fast, beta_slow):
    """ggml_rope_yarn_corr_dims (ggml.c): the YaRN ramp's [start, end] dims, float32 pair.

    corr_dim(beta) = n_dims * logf(n_ctx_orig / (beta * 2 * (float)M_PI)) / (2 * logf(base)),
    start = max(0, floorf(corr_dim(beta_fast))), end = min(n_dims - 1, ceilf(corr_dim(beta_slow))).
    """
    pi = _F32(math.pi)
    base = _F32(freq_base)
    d = _F32(n_dims)
    c = _F32(n_ctx_orig)
    lo = d * math.log(c / (_F32(beta_fast) * _F32(2.0) * pi)) / (_F32(2.0) * math.log(base))
    hi = d * math.log(c / (_F32(beta_slow) * _F32(2.0) * pi)) / (_F32(2.0) * math.log(base))
    start = _F32(math.floor(lo))
    end = _F32(math.ceil(hi))
    return max(_F32(0.0), start), min(_F32(n_dims - 1), end)


@kernel
def rope_cache(out, pos, n_dims, theta_scale, freq_scale, freq_factors, ext_factor, attn_factor,
               corr_lo, corr_hi):
    """cos/sin table per position: ggml_rope_cache_init + rope_yarn (ggml-cpu/ops.cpp).

    out: float32 [N, n_dims], out[t, 2i] = cos, out[t, 2i + 1] = sin of pair i at position
    pos[t] (int64 [N]). theta starts at (float)p and is multiplied by theta_scale once per pair
    (float, as ggml; not p * theta_scale**i). theta_extrap = theta / freq_factors[i] (float32
    [n_dims/2], all ones without rope_freqs.weight); theta_interp = freq_scale * theta_extrap;
    with ext_factor != 0 (YaRN) theta = theta_interp * (1 - mix) + theta_extrap * mix with
    mix = ramp(i) * ext_factor (GCC contracts the first product into an fma) and the
    magnitude attn_factor * (1 + 0.1 * logf(1 / freq_scale)) (an fma as well); cos/sin are libm
    cosf/sinf times that magnitude.
    """
    # every scalar in float32, whatever the caller passed (a float64 would widen theta)
    theta_scale = _F32(theta_scale)
    freq_scale = _F32(freq_scale)
    ext_factor = _F32(ext_factor)
    attn_factor = _F32(attn_factor)
    corr_lo = _F32(corr_lo)
    corr_hi = _F32(corr_hi)
    n = pos.shape[0]
    for t in range(n):
        theta = _F32(pos[t])
        for i0 in range(0, n_dims, 2):
            ff = freq_factors[i0 // 2]
            theta_extrap = theta / ff
            theta_interp = freq_scale * theta_extrap
            th = theta_interp
            mscale = attn_factor
            if ext_factor != _F32(0.0):
                # rope_yarn_ramp: y = (i0/2 - low) / MAX(0.001f, high - low); 1 - MIN(1, MAX(0, y))
                y = (_F32(i0 // 2) - corr_lo) / max(_F32(0.001), corr_hi - corr_lo)
                ramp = _F32(1.0) - min(_F32(1.0), max(_F32(0.0), y))
                mix = ramp * ext_factor
                th = fma32(theta_interp, _F32(1.0) - mix, theta_extrap * mix)
                mscale = mscale * fma32(_F32(0.1), math.log(_F32(1.0) / freq_scale), _F32(1.0))
            out[t, i0] = math.cos(th) * mscale
            out[t, i0 + 1] = math.sin(th) * mscale
            theta = theta * theta_scale


def _rope16_emit(context, builder, sig, args, neox):
    """16 pairs of rotate_pairs from cache pair i0 on (see rope16_neox / rope16_pairs)."""
    f32 = ir.FloatType()
    v16f = ir.VectorType(f32, 16)
    x, cache = ir_data(context, builder, sig.args[0], args[0], f32), ir_data(context, builder, sig.args[-2], args[-2], f32)
    even, odd = range(0, 32, 2), range(1, 32, 2)

    def load(p, off, n):
        return ir_load(builder, builder.gep(p, [off]), n, f32, align=4)

    def store(v, p, off):
        ir_store(builder, v, builder.gep(p, [off]), align=4)

    cs = load(cache, args[-1], 32)
    c, s = ir_shuffle(builder, cs, None, even), ir_shuffle(builder, cs, None, odd)
    if neox:
        x0, x1 = load(x, args[1], 16), load(x, args[2], 16)
    else:
        xx = load(x, args[1], 32)
        x0, x1 = ir_shuffle(builder, xx, None, even), ir_shuffle(builder, xx, None, odd)
    fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v16f, [v16f] * 3), "llvm.fma.v16f32")
    y0 = builder.call(fma, [x0, c, builder.fneg(builder.fmul(x1, s))])  # x0*cos - x1*sin, the first product fused
    y1 = builder.call(fma, [x0, s, builder.fmul(x1, c)])  # x0*sin + x1*cos
    if neox:
        store(y0, x, args[1])
        store(y1, x, args[2])
    else:
        store(ir_shuffle(builder, y0, y1, [j // 2 + 16 * (j % 2) for j in range(32)]), x, args[1])


@ir_intrinsic(lambda x, a, b, cache, i0: types.void(x, types.intp, types.intp, cache, types.intp)
              if flat_args(x, cache) else None)
def rope16_neox(context, builder, sig, args):
    """NEOX rotate_pairs of 16 pairs: x[a + j], x[b + j] (flat float32 offsets) by the cos/sin
    pairs cache[i0 + 2j], cache[i0 + 2j + 1], j < 16, in place (_rope_head's operations)."""
    _rope16_emit(context, builder, sig, args, True)


@ir_intrinsic(lambda x, a, cache, i0: types.void(x, types.intp, cache, types.intp) if flat_args(x, cache) else None)
def rope16_pairs(context, builder, sig, args):
    """Normal-mode rotate_pairs of 16 pairs: (x[a + 2j], x[a + 2j + 1]) by cache[i0 + 2j],
    cache[i0 + 2j + 1], j < 16, in place (_rope_head's operations)."""
    _rope16_emit(context, builder, sig, args, False)


@kernel(nested=True)
def _rope_head(x, cache, n_heads, head_dim, n_dims, neox, th):
    t = th // n_heads
    base = (th % n_heads) * head_dim
    half = n_dims // 2
    xt, ct = x[t], cache[t]
    n32 = n_dims - n_dims % 32  # 16 pairs per vector step, the rest one by one
    for i0 in range(0, n32, 32):
        if neox:
            rope16_neox(xt, base + i0 // 2, base + i0 // 2 + half, ct, i0)
        else:
            rope16_pairs(xt, base + i0, ct, i0)
    for i0 in range(n32, n_dims, 2):
        c = ct[i0]
        s = ct[i0 + 1]
        if neox:
            a = base + i0 // 2
            b = a + half
        else:
            a = base + i0
            b = a + 1
        x0 = xt[a]
        x1 = xt[b]
        xt[a] = fma32(x0, c, -(x1 * s))
        xt[b] = fma32(x0, s, x1 * c)


@kernel(parallel=True)
def _rope_par(x, cache, n_heads, head_dim, n_dims, neox):
    for th in prange(x.shape[0] * n_heads):
        _rope_head(x, cache, n_heads, head_dim, n_dims, neox, np.int64(th))  # (int64 as in _rope_ser)


@kernel
def _rope_ser(x, cache, n_heads, head_dim, n_dims, neox):
    for th in range(x.shape[0] * n_heads):
        _rope_head(x, cache, n_heads, head_dim, n_dims, neox, th)


def rope_rows(x, cache, n_heads, head_dim, n_dims, neox):
    """Rotate every head of x in place: rotate_pairs (ggml-cpu/ops.cpp).

    x: float32 [N, n_heads * head_dim]; cache: float32 [N, n_dims] from rope_cache.
    Normal mode (GGML_ROPE_TYPE_NORMAL) rotates (2i, 2i+1); NEOX rotates (i, i + n_dims/2).
    x0*cos - x1*sin and x0*sin + x1*cos are computed as GCC contracts them: the first product
    fused, fma(x0, cos, -(x1*sin)) and fma(x0, sin, x1*cos). Dims >= n_dims are unchanged.
    """
    row_kernels(x.shape[0]).rope(x, cache, n_heads, head_dim, n_dims, bool(neox))


class RowKernels(NamedTuple):
    """The row-op kernels for a number of rows (the wrappers' arguments, unchecked):
    rms_norm(out, x, w, eps float32), rope(x, cache, n_heads, head_dim, n_dims, neox bool),
    swiglu(out, gate, up), geglu(out, gate, up, gelu_table())."""

    rms_norm: object
    rope: object
    swiglu: object
    geglu: object


# for one row, for a few rows on the calling thread, for the rows on all threads (row_kernels)
_ROW_KERNELS = (RowKernels(_rms_norm_rows1, _rope_ser, _swiglu_ser, _geglu_ser),
                RowKernels(_rms_norm_ser, _rope_ser, _swiglu_ser, _geglu_ser),
                RowKernels(_rms_norm_par, _rope_par, _swiglu_par, _geglu_par))


# Rows up to which a ParallelSession step runs the row kernels (and activation conversions,
# kernels.graph) on the calling thread: a parallel region's launch and wake-up cost more than a few
# rows' work (a 4-sequence decode step of SmolLM2 spent most of its time in ~15 such launches per
# layer). The serial and parallel kernels compute each row alike: the bits are the same either way.
SERIAL_ROWS = 8


def row_kernels(n, serial_upto=1):
    """The RowKernels for n rows: over the rows on all threads when n > serial_upto; fewer run on
    the calling thread (a parallel region would only pay the threads' launch), one row by kernels
    of one row where they differ. ParallelSession's steps pass SERIAL_ROWS; a Session's forward
    keeps 1 (the kernels its warm-up compiles)."""
    return _ROW_KERNELS[2 if n > serial_upto else 0 if n == 1 else 1]
