"""Row kernels for the non-K formats: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL.

Two kinds of plain ``@njit(cache=True)`` functions, output first, on raw GGUF bytes:
  * ``dequantize_row_T(out: float32[K], w_row: uint8[row_bytes])``: bit-exact with
    gguf.quants.dequantize (and ggml-quants.c dequantize_row_T).
  * ``vec_dot_T(w_row: uint8[:], a_row: uint8[:], scratch: int32[:]) -> float32``: one weight
    row against one activation row already converted to T's vec_dot_type (Q8_0 / Q8_1 blocks,
    F16 / BF16 values, F32). ``scratch`` is per-thread int32 working memory (>= matmul.scratch_ints(K)).

Summation order (documented once here, per function below): the integer part of every block is
exact; the float accumulation reproduces ggml's x86 AVX2/AVX-512 code lane by lane:
  * Q4_0, Q5_0, Q8_0 (x Q8_0), Q4_1, Q5_1 (x Q8_1): 8 float lanes; lane l of block b takes the
    exact integer sum of elements 4l..4l+3 of the block and does acc[l] = fma(d, float(isum), acc[l])
    with d = F16(dw) * F16(da) (Q5_1: acc = fma(float(isum), dw*da, acc)); the row result is
    hsum_float_8(acc) (+ summs, the sequential float sum of m*s, for Q4_1/Q5_1).
  * IQ4_NL: the same 8-lane scheme with two accumulators, even blocks in acc1, odd in acc2,
    result hsum_float_8(acc1 + acc2); a trailing odd block is added as sumf = fma(d, isum, sumf).
  * F32: ggml_vec_dot_f32 with AVX-512: 4 x 16 lanes fma over 64-element steps, reduced as
    (s0+s2)+(s1+s3) lane-wise then _mm512_reduce_add_ps; leftovers (K % 64) added sequentially.
  * F16: ggml_vec_dot_f16, same scheme on F16->F32 values; reduce in float, then leftovers in double.
  * BF16: ggml_vec_dot_bf16 with AVX512BF16 (vdpbf16ps): 2 x 16 lanes over 64-element steps;
    lane l adds the odd product then the even one of its pair; each accumulator is reduced with
    _mm512_reduce_add_ps into a double sum; leftovers in double.
"""

import numpy as np
from numba import njit

from .common import F16_TO_F32_TABLE, f16_le, fma32, hsum_float_8, reduce_add_16, u32_as_f32

# IQ4_NL / IQ4_XS non-linear codebook (ggml-common.h kvalues_iq4nl).
KVALUES_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)


# ----------------------------------------------------------------------------------------------
# Dequantize (ggml-quants.c dequantize_row_*; gguf.quants.dequantize)
# ----------------------------------------------------------------------------------------------


@njit(cache=True)
def dequantize_row_f32(out, w_row):
    """F32 bytes -> float32 (copy)."""
    wf = w_row.view(np.float32)
    for i in range(out.size):
        out[i] = wf[i]


@njit(cache=True)
def dequantize_row_f16(out, w_row):
    """F16 -> float32, exact (ggml_cpu_fp16_to_fp32)."""
    wh = w_row.view(np.uint16)
    for i in range(out.size):
        out[i] = F16_TO_F32_TABLE[wh[i]]


@njit(cache=True)
def dequantize_row_bf16(out, w_row):
    """BF16 -> float32, exact (ggml_cpu_bf16_to_fp32)."""
    wh = w_row.view(np.uint16)
    ob = out.view(np.uint32)
    for i in range(out.size):
        ob[i] = np.uint32(wh[i]) << np.uint32(16)


@njit(cache=True)
def dequantize_row_q4_0(out, w_row):
    """Q4_0 (18 B / 32: f16 d, 16 B nibbles; low nibbles = elements 0..15) -> (q - 8) * d.

    ggml-quants.c dequantize_row_q4_0."""
    nb = out.size // 32
    for b in range(nb):
        o = b * 18
        d = f16_le(w_row, o)
        for j in range(16):
            q = w_row[o + 2 + j]
            out[b * 32 + j] = np.float32(np.int32(q & 15) - 8) * d
            out[b * 32 + 16 + j] = np.float32(np.int32(q >> 4) - 8) * d


@njit(cache=True)
def dequantize_row_q4_1(out, w_row):
    """Q4_1 (20 B / 32: f16 d, f16 m, 16 B nibbles) -> q * d + m (multiply, then add).

    ggml-quants.c dequantize_row_q4_1."""
    nb = out.size // 32
    for b in range(nb):
        o = b * 20
        d = f16_le(w_row, o)
        m = f16_le(w_row, o + 2)
        for j in range(16):
            q = w_row[o + 4 + j]
            out[b * 32 + j] = np.float32(q & 15) * d + m
            out[b * 32 + 16 + j] = np.float32(q >> 4) * d + m


@njit(cache=True, inline="always")
def _u32_le(buf, off):
    return (np.uint32(buf[off]) | (np.uint32(buf[off + 1]) << np.uint32(8))
            | (np.uint32(buf[off + 2]) << np.uint32(16)) | (np.uint32(buf[off + 3]) << np.uint32(24)))


@njit(cache=True)
def dequantize_row_q5_0(out, w_row):
    """Q5_0 (22 B / 32: f16 d, u32 qh, 16 B nibbles; bit j of qh is bit 4 of element j)
    -> (q - 16) * d. ggml-quants.c dequantize_row_q5_0."""
    nb = out.size // 32
    for b in range(nb):
        o = b * 22
        d = f16_le(w_row, o)
        qh = _u32_le(w_row, o + 2)
        for j in range(16):
            q = w_row[o + 6 + j]
            h0 = np.int32((qh >> np.uint32(j)) & np.uint32(1)) << 4
            h1 = np.int32((qh >> np.uint32(j + 16)) & np.uint32(1)) << 4
            out[b * 32 + j] = np.float32((np.int32(q & 15) | h0) - 16) * d
            out[b * 32 + 16 + j] = np.float32((np.int32(q >> 4) | h1) - 16) * d


@njit(cache=True)
def dequantize_row_q5_1(out, w_row):
    """Q5_1 (24 B / 32: f16 d, f16 m, u32 qh, 16 B nibbles) -> q * d + m.

    ggml-quants.c dequantize_row_q5_1."""
    nb = out.size // 32
    for b in range(nb):
        o = b * 24
        d = f16_le(w_row, o)
        m = f16_le(w_row, o + 2)
        qh = _u32_le(w_row, o + 4)
        for j in range(16):
            q = w_row[o + 8 + j]
            h0 = np.int32((qh >> np.uint32(j)) & np.uint32(1)) << 4
            h1 = np.int32((qh >> np.uint32(j + 16)) & np.uint32(1)) << 4
            out[b * 32 + j] = np.float32(np.int32(q & 15) | h0) * d + m
            out[b * 32 + 16 + j] = np.float32(np.int32(q >> 4) | h1) * d + m


@njit(cache=True)
def dequantize_row_q8_0(out, w_row):
    """Q8_0 (34 B / 32: f16 d, int8 qs[32]) -> q * d. ggml-quants.c dequantize_row_q8_0."""
    nb = out.size // 32
    wi = w_row.view(np.int8)
    for b in range(nb):
        o = b * 34
        d = f16_le(w_row, o)
        for j in range(32):
            out[b * 32 + j] = np.float32(wi[o + 2 + j]) * d


@njit(cache=True)
def dequantize_row_iq4_nl(out, w_row):
    """IQ4_NL (18 B / 32: f16 d, 16 B nibble indices into kvalues_iq4nl) -> d * kvalues[q].

    ggml-quants.c dequantize_row_iq4_nl."""
    nb = out.size // 32
    for b in range(nb):
        o = b * 18
        d = f16_le(w_row, o)
        for j in range(16):
            q = w_row[o + 2 + j]
            out[b * 32 + j] = d * np.float32(KVALUES_IQ4NL[q & 15])
            out[b * 32 + 16 + j] = d * np.float32(KVALUES_IQ4NL[q >> 4])


# ----------------------------------------------------------------------------------------------
# Dot products. Pattern (for AVX-512 code from Numba): pass 1 writes the exact int32 products of
# the whole row into scratch in one flat elementwise loop; pass 2 walks the blocks, summing groups
# of 4 products into the 8 lanes and accumulating them with fma, as ggml's AVX2 code does.
# ----------------------------------------------------------------------------------------------


@njit(cache=True, inline="always")
def _lanes_fma(p, base, d, a0, a1, a2, a3, a4, a5, a6, a7):
    """acc[l] = fma(d, float(sum p[base+4l : base+4l+4]), acc[l]) for the 8 lanes of one block."""
    a0 = fma32(d, np.float32(p[base + 0] + p[base + 1] + p[base + 2] + p[base + 3]), a0)
    a1 = fma32(d, np.float32(p[base + 4] + p[base + 5] + p[base + 6] + p[base + 7]), a1)
    a2 = fma32(d, np.float32(p[base + 8] + p[base + 9] + p[base + 10] + p[base + 11]), a2)
    a3 = fma32(d, np.float32(p[base + 12] + p[base + 13] + p[base + 14] + p[base + 15]), a3)
    a4 = fma32(d, np.float32(p[base + 16] + p[base + 17] + p[base + 18] + p[base + 19]), a4)
    a5 = fma32(d, np.float32(p[base + 20] + p[base + 21] + p[base + 22] + p[base + 23]), a5)
    a6 = fma32(d, np.float32(p[base + 24] + p[base + 25] + p[base + 26] + p[base + 27]), a6)
    a7 = fma32(d, np.float32(p[base + 28] + p[base + 29] + p[base + 30] + p[base + 31]), a7)
    return a0, a1, a2, a3, a4, a5, a6, a7


@njit(cache=True)
def vec_dot_q4_0_q8_0(w_row, a_row, scratch):
    """Q4_0 weight row . Q8_0 activation row -> float32.

    Reproduces ggml-cpu/arch/x86/quants.c ggml_vec_dot_q4_0_q8_0 (AVX2 path): per block
    d = F16(dw)*F16(da); 8 lanes of 4-element integer sums; acc = fma(d, lanes, acc);
    result hsum_float_8(acc).
    """
    nb = w_row.size // 18
    ai = a_row.view(np.int8)
    p = scratch
    for b in range(nb):
        wo = b * 18 + 2
        ao = b * 34 + 2
        for j in range(16):
            q = w_row[wo + j]
            p[b * 32 + j] = (np.int32(q & 15) - 8) * np.int32(ai[ao + j])
            p[b * 32 + 16 + j] = (np.int32(q >> 4) - 8) * np.int32(ai[ao + 16 + j])
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = np.float32(0.0)
    for b in range(nb):
        d = f16_le(w_row, b * 18) * f16_le(a_row, b * 34)
        a0, a1, a2, a3, a4, a5, a6, a7 = _lanes_fma(p, b * 32, d, a0, a1, a2, a3, a4, a5, a6, a7)
    return hsum_float_8(a0, a1, a2, a3, a4, a5, a6, a7)


@njit(cache=True)
def vec_dot_q8_0_q8_0(w_row, a_row, scratch):
    """Q8_0 weight row . Q8_0 activation row -> float32.

    Reproduces ggml-cpu/arch/x86/quants.c ggml_vec_dot_q8_0_q8_0 (AVX2 path), same lane scheme
    as Q4_0.
    """
    nb = w_row.size // 34
    wi = w_row.view(np.int8)
    ai = a_row.view(np.int8)
    p = scratch
    for b in range(nb):
        o = b * 34 + 2
        for j in range(32):
            p[b * 32 + j] = np.int32(wi[o + j]) * np.int32(ai[o + j])
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = np.float32(0.0)
    for b in range(nb):
        d = f16_le(w_row, b * 34) * f16_le(a_row, b * 34)
        a0, a1, a2, a3, a4, a5, a6, a7 = _lanes_fma(p, b * 32, d, a0, a1, a2, a3, a4, a5, a6, a7)
    return hsum_float_8(a0, a1, a2, a3, a4, a5, a6, a7)


@njit(cache=True)
def vec_dot_q5_0_q8_0(w_row, a_row, scratch):
    """Q5_0 weight row . Q8_0 activation row -> float32.

    Reproduces ggml-cpu/arch/x86/quants.c ggml_vec_dot_q5_0_q8_0 (AVX2 path): weights
    (q | hbit << 4) - 16, lane scheme as Q4_0.
    """
    nb = w_row.size // 22
    ai = a_row.view(np.int8)
    p = scratch
    for b in range(nb):
        wo = b * 22
        ao = b * 34 + 2
        qh = _u32_le(w_row, wo + 2)
        for j in range(16):
            q = w_row[wo + 6 + j]
            h0 = np.int32((qh >> np.uint32(j)) & np.uint32(1)) << 4
            h1 = np.int32((qh >> np.uint32(j + 16)) & np.uint32(1)) << 4
            p[b * 32 + j] = ((np.int32(q & 15) | h0) - 16) * np.int32(ai[ao + j])
            p[b * 32 + 16 + j] = ((np.int32(q >> 4) | h1) - 16) * np.int32(ai[ao + 16 + j])
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = np.float32(0.0)
    for b in range(nb):
        d = f16_le(w_row, b * 22) * f16_le(a_row, b * 34)
        a0, a1, a2, a3, a4, a5, a6, a7 = _lanes_fma(p, b * 32, d, a0, a1, a2, a3, a4, a5, a6, a7)
    return hsum_float_8(a0, a1, a2, a3, a4, a5, a6, a7)


@njit(cache=True)
def vec_dot_q4_1_q8_1(w_row, a_row, scratch):
    """Q4_1 weight row . Q8_1 activation row -> float32.

    Reproduces ggml-cpu/arch/x86/quants.c ggml_vec_dot_q4_1_q8_1 (AVX2 path): lanes of
    unsigned nibble x q8 sums, acc = fma(F16(dw)*F16(da), lanes, acc); summs += F16(m)*F16(s)
    sequentially; result hsum_float_8(acc) + summs.
    """
    nb = w_row.size // 20
    ai = a_row.view(np.int8)
    p = scratch
    for b in range(nb):
        wo = b * 20 + 4
        ao = b * 36 + 4
        for j in range(16):
            q = w_row[wo + j]
            p[b * 32 + j] = np.int32(q & 15) * np.int32(ai[ao + j])
            p[b * 32 + 16 + j] = np.int32(q >> 4) * np.int32(ai[ao + 16 + j])
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = np.float32(0.0)
    summs = np.float32(0.0)
    for b in range(nb):
        wo = b * 20
        ao = b * 36
        d = f16_le(w_row, wo) * f16_le(a_row, ao)
        summs = _SUMMS(f16_le(w_row, wo + 2), f16_le(a_row, ao + 2), summs)
        a0, a1, a2, a3, a4, a5, a6, a7 = _lanes_fma(p, b * 32, d, a0, a1, a2, a3, a4, a5, a6, a7)
    return hsum_float_8(a0, a1, a2, a3, a4, a5, a6, a7) + summs


@njit(cache=True)
def vec_dot_q5_1_q8_1(w_row, a_row, scratch):
    """Q5_1 weight row . Q8_1 activation row -> float32.

    Reproduces ggml-cpu/arch/x86/quants.c ggml_vec_dot_q5_1_q8_1 (AVX2 path): as Q4_1 with
    5-bit unsigned weights; acc = fma(lanes, F16(dw)*F16(da), acc).
    """
    nb = w_row.size // 24
    ai = a_row.view(np.int8)
    p = scratch
    for b in range(nb):
        wo = b * 24
        ao = b * 36 + 4
        qh = _u32_le(w_row, wo + 4)
        for j in range(16):
            q = w_row[wo + 8 + j]
            h0 = np.int32((qh >> np.uint32(j)) & np.uint32(1)) << 4
            h1 = np.int32((qh >> np.uint32(j + 16)) & np.uint32(1)) << 4
            p[b * 32 + j] = (np.int32(q & 15) | h0) * np.int32(ai[ao + j])
            p[b * 32 + 16 + j] = (np.int32(q >> 4) | h1) * np.int32(ai[ao + 16 + j])
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = np.float32(0.0)
    summs = np.float32(0.0)
    for b in range(nb):
        wo = b * 24
        ao = b * 36
        d = f16_le(w_row, wo) * f16_le(a_row, ao)
        summs = _SUMMS(f16_le(w_row, wo + 2), f16_le(a_row, ao + 2), summs)
        a0, a1, a2, a3, a4, a5, a6, a7 = _lanes_fma(p, b * 32, d, a0, a1, a2, a3, a4, a5, a6, a7)
    return hsum_float_8(a0, a1, a2, a3, a4, a5, a6, a7) + summs


@njit(cache=True)
def vec_dot_iq4_nl_q8_0(w_row, a_row, scratch):
    """IQ4_NL weight row . Q8_0 activation row -> float32.

    Reproduces ggml-cpu/arch/x86/quants.c ggml_vec_dot_iq4_nl_q8_0 (AVX2 path): blocks in
    pairs, even ones into acc1, odd ones into acc2 (8 lanes each, fma with
    d = F16(da)*F16(dw)); result hsum_float_8(acc1 + acc2), then a trailing odd block as
    sumf = fma(d, isum, sumf).
    """
    nb = w_row.size // 18
    ai = a_row.view(np.int8)
    p = scratch
    for b in range(nb):
        wo = b * 18 + 2
        ao = b * 34 + 2
        for j in range(16):
            q = w_row[wo + j]
            p[b * 32 + j] = np.int32(KVALUES_IQ4NL[q & 15]) * np.int32(ai[ao + j])
            p[b * 32 + 16 + j] = np.int32(KVALUES_IQ4NL[q >> 4]) * np.int32(ai[ao + 16 + j])
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = np.float32(0.0)
    c0 = c1 = c2 = c3 = c4 = c5 = c6 = c7 = np.float32(0.0)
    npair = nb // 2
    for i in range(npair):
        b = 2 * i
        d = f16_le(a_row, b * 34) * f16_le(w_row, b * 18)
        a0, a1, a2, a3, a4, a5, a6, a7 = _lanes_fma(p, b * 32, d, a0, a1, a2, a3, a4, a5, a6, a7)
        b = 2 * i + 1
        d = f16_le(a_row, b * 34) * f16_le(w_row, b * 18)
        c0, c1, c2, c3, c4, c5, c6, c7 = _lanes_fma(p, b * 32, d, c0, c1, c2, c3, c4, c5, c6, c7)
    sumf = hsum_float_8(a0 + c0, a1 + c1, a2 + c2, a3 + c3, a4 + c4, a5 + c5, a6 + c6, a7 + c7)
    if nb % 2 == 1:
        b = nb - 1
        d = f16_le(a_row, b * 34) * f16_le(w_row, b * 18)
        isum = np.int32(0)
        for j in range(32):
            isum += p[b * 32 + j]
        sumf = fma32(d, np.float32(isum), sumf)
    return sumf


@njit(cache=True, inline="always")
def _SUMMS(m, s, acc):
    """summs += F16(m) * F16(s): GCC contracts this C expression into one fma on x86-64 with FMA."""
    return fma32(m, s, acc)


@njit(cache=True)
def vec_dot_f32(w_row, a_row, scratch):
    """F32 weight row . F32 activation row -> float32.

    Reproduces ggml-cpu/vec.cpp ggml_vec_dot_f32 with AVX-512 (GGML_F32_STEP 64, EPR 16,
    ARR 4): acc[64] = fma(w, x, acc) per 64-element step; reduce (acc0+acc2)+(acc1+acc3)
    lane-wise then _mm512_reduce_add_ps; leftovers sumf = fma(w, x, sumf) in order.
    """
    w = w_row.view(np.float32)
    x = a_row.view(np.float32)
    n = w.size
    acc = scratch[:64].view(np.float32)
    for t in range(64):
        acc[t] = np.float32(0.0)
    npart = n - n % 64
    for i in range(0, npart, 64):
        for t in range(64):
            acc[t] = fma32(w[i + t], x[i + t], acc[t])
    for t in range(16):
        acc[t] = (acc[t] + acc[32 + t]) + (acc[16 + t] + acc[48 + t])
    sumf = reduce_add_16(acc)
    for i in range(npart, n):
        sumf = fma32(w[i], x[i], sumf)
    return sumf


@njit(cache=True)
def vec_dot_f16(w_row, a_row, scratch):
    """F16 weight row . F16 activation row -> float32.

    Reproduces ggml-cpu/vec.cpp ggml_vec_dot_f16 with AVX-512 (F32Cx16: F16 converted to F32,
    4 x 16 lanes fma per 64-element step, same reduction as F32 into a double sum; leftovers
    added in double); result rounded to float32.
    """
    wh = w_row.view(np.uint16)
    xh = a_row.view(np.uint16)
    n = wh.size
    acc = scratch[:64].view(np.float32)
    for t in range(64):
        acc[t] = np.float32(0.0)
    npart = n - n % 64
    for i in range(0, npart, 64):
        for t in range(64):
            acc[t] = fma32(F16_TO_F32_TABLE[wh[i + t]], F16_TO_F32_TABLE[xh[i + t]], acc[t])
    for t in range(16):
        acc[t] = (acc[t] + acc[32 + t]) + (acc[16 + t] + acc[48 + t])
    sumd = np.float64(reduce_add_16(acc))
    for i in range(npart, n):
        sumd += np.float64(F16_TO_F32_TABLE[wh[i]] * F16_TO_F32_TABLE[xh[i]])
    return np.float32(sumd)


@njit(cache=True)
def vec_dot_bf16(w_row, a_row, scratch):
    """BF16 weight row . BF16 activation row -> float32.

    Reproduces ggml-cpu/vec.cpp ggml_vec_dot_bf16 with AVX512BF16: per 64-element step two
    16-lane accumulators (vdpbf16ps: lane l adds the product of pair element 2l+1, then 2l; BF16
    products are exact in F32); each reduced with _mm512_reduce_add_ps into a double sum;
    leftovers added in double.
    """
    wh = w_row.view(np.uint16)
    xh = a_row.view(np.uint16)
    n = wh.size
    pf = scratch[: n].view(np.float32)
    for i in range(n):
        pf[i] = _bf16(wh[i]) * _bf16(xh[i])
    acc = scratch[n: n + 32].view(np.float32)
    for t in range(32):
        acc[t] = np.float32(0.0)
    npart = n - n % 64
    for i in range(0, npart, 64):
        for t in range(32):
            acc[t] = acc[t] + pf[i + 2 * t + 1]
            acc[t] = acc[t] + pf[i + 2 * t]
    sumd = np.float64(reduce_add_16(acc[:16]))
    sumd += np.float64(reduce_add_16(acc[16:]))
    for i in range(npart, n):
        sumd += np.float64(pf[i])
    return np.float32(sumd)


@njit(cache=True, inline="always")
def _bf16(h):
    return u32_as_f32(np.uint32(h) << np.uint32(16))

