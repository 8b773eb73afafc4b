"""Row kernels for the non-K formats: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL.

Two kinds of plain ``@njit(cache=True, error_model="numpy")`` functions, output first, on raw GGUF bytes:
  * ``dequantize_row_T(out: float32[K], w_row: uint8[row_bytes])``: bit-exact with
    gguf.quants.dequantize (and ggml-quants.c dequantize_row_T).
  * ``vec_dot_T(w_row: uint8[:], a_row: uint8[:], scratch: int32[:]) -> float32``: one weight
    row against one activation row already converted to T's vec_dot_type (Q8_0 / Q8_1 blocks,
    F16 / BF16 values, F32). ``scratch`` is the driver's per-thread buffer (matmul.py contract);
    these kernels keep their few accumulators on the stack instead and leave it untouched.

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
With these orders every output of ggml's own vec_dot in tests/data/kernels (8 activation rows x 768
weight rows per format) is reproduced bit for bit.
"""

import numpy as np
from llvmlite import ir
from numba import carray, njit

from .common import (IQ4NL_TABLE_S8, KVALUES_IQ4NL, acc8_add, acc8_hsum, acc8_zero, f16_le, f16_to_f32, fma32,
                     ir_add_const, ir_high_bits32, ir_int8x32, ir_lookup_nibbles32, ir_nibbles32,
                     make_block_lanes_fma, ptr_offset, reduce_add_16, stack_f32, u32_as_f32)


# ----------------------------------------------------------------------------------------------
# Dequantize (ggml-quants.c dequantize_row_*; gguf.quants.dequantize)
# ----------------------------------------------------------------------------------------------


@njit(cache=True, error_model="numpy")
def dequantize_row_f32(out, w_row):
    """F32 bytes -> float32 (copy)."""
    wf = w_row.view(np.float32)
    for i in range(out.size):
        out[i] = wf[i]


@njit(cache=True, error_model="numpy")
def dequantize_row_f16(out, w_row):
    """F16 -> float32, exact (ggml_cpu_fp16_to_fp32)."""
    wh = w_row.view(np.uint16)
    for i in range(out.size):
        out[i] = f16_to_f32(wh[i])


@njit(cache=True, error_model="numpy")
def dequantize_row_bf16(out, w_row):
    """BF16 -> float32, exact (ggml_cpu_bf16_to_fp32)."""
    wh = w_row.view(np.uint16)
    ob = out.view(np.uint32)
    for i in range(out.size):
        ob[i] = np.uint32(wh[i]) << np.uint32(16)


@njit(cache=True, error_model="numpy")
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


@njit(cache=True, error_model="numpy")
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


@njit(cache=True, error_model="numpy", inline="always")
def _u32_le(buf, off):
    return (np.uint32(buf[off]) | (np.uint32(buf[off + 1]) << np.uint32(8))
            | (np.uint32(buf[off + 2]) << np.uint32(16)) | (np.uint32(buf[off + 3]) << np.uint32(24)))


@njit(cache=True, error_model="numpy")
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


@njit(cache=True, error_model="numpy")
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


@njit(cache=True, error_model="numpy")
def dequantize_row_q8_0(out, w_row):
    """Q8_0 (34 B / 32: f16 d, int8 qs[32]) -> q * d. ggml-quants.c dequantize_row_q8_0."""
    nb = out.size // 32
    wi = w_row.view(np.int8)
    for b in range(nb):
        o = b * 34
        d = f16_le(w_row, o)
        for j in range(32):
            out[b * 32 + j] = np.float32(wi[o + 2 + j]) * d


@njit(cache=True, error_model="numpy")
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
# Dot products of the 32-value block formats. The per-block integer work (decode 32 weights,
# multiply by the 32 int8 activations, sum groups of 4 into 8 lanes, convert, fma into 8 float
# accumulators) is one explicit-vector LLVM intrinsic per format (common.make_block_lanes_fma);
# the block loop, the F16 scales and the final reduction are plain Numba.
# ----------------------------------------------------------------------------------------------


def _gep(builder, ptr, k):
    return builder.gep(ptr, [ir.Constant(ir.IntType(64), k)])


def _decode_q4_0(b, p):
    return ir_add_const(b, ir_nibbles32(b, _gep(b, p, 2)), -8)


def _decode_q4_1(b, p):
    return ir_nibbles32(b, _gep(b, p, 4))


def _decode_q5_0(b, p):
    return ir_add_const(b, b.or_(ir_nibbles32(b, _gep(b, p, 6)), ir_high_bits32(b, _gep(b, p, 2))), -16)


def _decode_q5_1(b, p):
    return b.or_(ir_nibbles32(b, _gep(b, p, 8)), ir_high_bits32(b, _gep(b, p, 4)))


def _decode_q8_0(b, p):
    return ir_int8x32(b, _gep(b, p, 2))


def _decode_iq4_nl(b, p):
    return ir_lookup_nibbles32(b, _gep(b, p, 2), IQ4NL_TABLE_S8)


_blk_q4_0 = make_block_lanes_fma(_decode_q4_0, signed=True)
_blk_q4_1 = make_block_lanes_fma(_decode_q4_1, signed=False)
_blk_q5_0 = make_block_lanes_fma(_decode_q5_0, signed=True)
_blk_q5_1 = make_block_lanes_fma(_decode_q5_1, signed=False)
_blk_q8_0 = make_block_lanes_fma(_decode_q8_0, signed=True)
_blk_iq4_nl = make_block_lanes_fma(_decode_iq4_nl, signed=True)


@njit(cache=True, error_model="numpy")
def vec_dot_q4_0_q8_0(w_row, a_row, scratch):
    """Q4_0 weight row . Q8_0 activation row -> float32.

    Reproduces ggml-cpu/arch/x86/quants.c ggml_vec_dot_q4_0_q8_0 (AVX2 path): per block
    d = F16(dw)*F16(da); 8 lanes of 4-element integer sums; acc = fma(d, lanes, acc);
    result hsum_float_8(acc).
    """
    nb = w_row.size // 18
    accp = stack_f32(8)
    acc8_zero(accp)
    for b in range(nb):
        d = f16_le(w_row, b * 18) * f16_le(a_row, b * 34)
        _blk_q4_0(accp, d, w_row, b * 18, a_row, b * 34 + 2)
    return acc8_hsum(accp)


@njit(cache=True, error_model="numpy")
def vec_dot_q8_0_q8_0(w_row, a_row, scratch):
    """Q8_0 weight row . Q8_0 activation row -> float32.

    Reproduces ggml-cpu/arch/x86/quants.c ggml_vec_dot_q8_0_q8_0 (AVX2 path), same lane scheme
    as Q4_0.
    """
    nb = w_row.size // 34
    accp = stack_f32(8)
    acc8_zero(accp)
    for b in range(nb):
        d = f16_le(w_row, b * 34) * f16_le(a_row, b * 34)
        _blk_q8_0(accp, d, w_row, b * 34, a_row, b * 34 + 2)
    return acc8_hsum(accp)


@njit(cache=True, error_model="numpy")
def vec_dot_q5_0_q8_0(w_row, a_row, scratch):
    """Q5_0 weight row . Q8_0 activation row -> float32.

    Reproduces ggml-cpu/arch/x86/quants.c ggml_vec_dot_q5_0_q8_0 (AVX2 path): weights
    (q | hbit << 4) - 16, lane scheme as Q4_0.
    """
    nb = w_row.size // 22
    accp = stack_f32(8)
    acc8_zero(accp)
    for b in range(nb):
        d = f16_le(w_row, b * 22) * f16_le(a_row, b * 34)
        _blk_q5_0(accp, d, w_row, b * 22, a_row, b * 34 + 2)
    return acc8_hsum(accp)


@njit(cache=True, error_model="numpy")
def vec_dot_q4_1_q8_1(w_row, a_row, scratch):
    """Q4_1 weight row . Q8_1 activation row -> float32.

    Reproduces ggml-cpu/arch/x86/quants.c ggml_vec_dot_q4_1_q8_1 (AVX2 path): lanes of
    unsigned nibble x q8 sums, acc = fma(F16(dw)*F16(da), lanes, acc); summs = fma(F16(m),
    F16(s), summs) in block order; result hsum_float_8(acc) + summs.
    """
    nb = w_row.size // 20
    accp = stack_f32(8)
    acc8_zero(accp)
    summs = np.float32(0.0)
    for b in range(nb):
        d = f16_le(w_row, b * 20) * f16_le(a_row, b * 36)
        summs = _summs(f16_le(w_row, b * 20 + 2), f16_le(a_row, b * 36 + 2), summs)
        _blk_q4_1(accp, d, w_row, b * 20, a_row, b * 36 + 4)
    return acc8_hsum(accp) + summs


@njit(cache=True, error_model="numpy")
def vec_dot_q5_1_q8_1(w_row, a_row, scratch):
    """Q5_1 weight row . Q8_1 activation row -> float32.

    Reproduces ggml-cpu/arch/x86/quants.c ggml_vec_dot_q5_1_q8_1 (AVX2 path): as Q4_1 with
    5-bit unsigned weights; acc = fma(lanes, F16(dw)*F16(da), acc).
    """
    nb = w_row.size // 24
    accp = stack_f32(8)
    acc8_zero(accp)
    summs = np.float32(0.0)
    for b in range(nb):
        d = f16_le(w_row, b * 24) * f16_le(a_row, b * 36)
        summs = _summs(f16_le(w_row, b * 24 + 2), f16_le(a_row, b * 36 + 2), summs)
        _blk_q5_1(accp, d, w_row, b * 24, a_row, b * 36 + 4)
    return acc8_hsum(accp) + summs


@njit(cache=True, error_model="numpy")
def vec_dot_iq4_nl_q8_0(w_row, a_row, scratch):
    """IQ4_NL weight row . Q8_0 activation row -> float32.

    Reproduces ggml-cpu/arch/x86/quants.c ggml_vec_dot_iq4_nl_q8_0 (AVX2 path): blocks in
    pairs, even ones into acc1, odd ones into acc2 (8 lanes each, fma with
    d = F16(da)*F16(dw)); result hsum_float_8(acc1 + acc2), then a trailing odd block as
    sumf = fma(d, isum, sumf).
    """
    nb = w_row.size // 18
    p1 = stack_f32(8)
    p2 = stack_f32(8)
    acc8_zero(p1)
    acc8_zero(p2)
    for i in range(nb // 2):
        b = 2 * i
        _blk_iq4_nl(p1, f16_le(a_row, b * 34) * f16_le(w_row, b * 18), w_row, b * 18, a_row, b * 34 + 2)
        b = 2 * i + 1
        _blk_iq4_nl(p2, f16_le(a_row, b * 34) * f16_le(w_row, b * 18), w_row, b * 18, a_row, b * 34 + 2)
    acc8_add(p1, p2)
    sumf = acc8_hsum(p1)
    if nb % 2 == 1:
        sumf = _iq4_nl_tail(w_row, a_row, nb - 1, sumf)
    return sumf


# ----------------------------------------------------------------------------------------------
# Several activation rows against one weight row (the matmul drivers' inner call): y[n, m] for all
# n, each with exactly the operations and order of vec_dot_T(w_row, a[n]) -- per output the same
# 8-lane accumulator over blocks in order -- but the loop is blocks outer, activation rows inner,
# so each weight block is loaded and decoded once for up to ROWS_GROUP rows (LLVM hoists the
# decode out of the inner loop). Accumulators: 8 float32 per row, on the stack.
# ----------------------------------------------------------------------------------------------

ROWS_GROUP = 64  # activation rows per pass (stack: 64 x 8 float32 per accumulator set)


@njit(cache=True, error_model="numpy")
def rows_dot_q4_0_q8_0(y, m, w_row, a):
    """y[n, m] = vec_dot_q4_0_q8_0(w_row, a[n]) for every row n of a (bit for bit)."""
    nb = w_row.size // 18
    accs = stack_f32(512)
    for g in range(0, a.shape[0], ROWS_GROUP):
        ng = min(ROWS_GROUP, a.shape[0] - g)
        for n in range(ng):
            acc8_zero(ptr_offset(accs, 8 * n))
        for b in range(nb):
            dw = f16_le(w_row, b * 18)
            for n in range(ng):
                _blk_q4_0(ptr_offset(accs, 8 * n), dw * f16_le(a[g + n], b * 34), w_row, b * 18, a[g + n], b * 34 + 2)
        for n in range(ng):
            y[g + n, m] = acc8_hsum(ptr_offset(accs, 8 * n))


@njit(cache=True, error_model="numpy")
def rows_dot_q8_0_q8_0(y, m, w_row, a):
    """y[n, m] = vec_dot_q8_0_q8_0(w_row, a[n]) for every row n of a (bit for bit)."""
    nb = w_row.size // 34
    accs = stack_f32(512)
    for g in range(0, a.shape[0], ROWS_GROUP):
        ng = min(ROWS_GROUP, a.shape[0] - g)
        for n in range(ng):
            acc8_zero(ptr_offset(accs, 8 * n))
        for b in range(nb):
            dw = f16_le(w_row, b * 34)
            for n in range(ng):
                _blk_q8_0(ptr_offset(accs, 8 * n), dw * f16_le(a[g + n], b * 34), w_row, b * 34, a[g + n], b * 34 + 2)
        for n in range(ng):
            y[g + n, m] = acc8_hsum(ptr_offset(accs, 8 * n))


@njit(cache=True, error_model="numpy")
def rows_dot_q5_0_q8_0(y, m, w_row, a):
    """y[n, m] = vec_dot_q5_0_q8_0(w_row, a[n]) for every row n of a (bit for bit)."""
    nb = w_row.size // 22
    accs = stack_f32(512)
    for g in range(0, a.shape[0], ROWS_GROUP):
        ng = min(ROWS_GROUP, a.shape[0] - g)
        for n in range(ng):
            acc8_zero(ptr_offset(accs, 8 * n))
        for b in range(nb):
            dw = f16_le(w_row, b * 22)
            for n in range(ng):
                _blk_q5_0(ptr_offset(accs, 8 * n), dw * f16_le(a[g + n], b * 34), w_row, b * 22, a[g + n], b * 34 + 2)
        for n in range(ng):
            y[g + n, m] = acc8_hsum(ptr_offset(accs, 8 * n))


@njit(cache=True, error_model="numpy")
def rows_dot_q4_1_q8_1(y, m, w_row, a):
    """y[n, m] = vec_dot_q4_1_q8_1(w_row, a[n]) for every row n of a (bit for bit)."""
    nb = w_row.size // 20
    accs = stack_f32(512)
    summs = carray(stack_f32(64), 64)
    for g in range(0, a.shape[0], ROWS_GROUP):
        ng = min(ROWS_GROUP, a.shape[0] - g)
        for n in range(ng):
            acc8_zero(ptr_offset(accs, 8 * n))
            summs[n] = np.float32(0.0)
        for b in range(nb):
            dw = f16_le(w_row, b * 20)
            mw = f16_le(w_row, b * 20 + 2)
            for n in range(ng):
                summs[n] = _summs(mw, f16_le(a[g + n], b * 36 + 2), summs[n])
                _blk_q4_1(ptr_offset(accs, 8 * n), dw * f16_le(a[g + n], b * 36), w_row, b * 20, a[g + n], b * 36 + 4)
        for n in range(ng):
            y[g + n, m] = acc8_hsum(ptr_offset(accs, 8 * n)) + summs[n]


@njit(cache=True, error_model="numpy")
def rows_dot_q5_1_q8_1(y, m, w_row, a):
    """y[n, m] = vec_dot_q5_1_q8_1(w_row, a[n]) for every row n of a (bit for bit)."""
    nb = w_row.size // 24
    accs = stack_f32(512)
    summs = carray(stack_f32(64), 64)
    for g in range(0, a.shape[0], ROWS_GROUP):
        ng = min(ROWS_GROUP, a.shape[0] - g)
        for n in range(ng):
            acc8_zero(ptr_offset(accs, 8 * n))
            summs[n] = np.float32(0.0)
        for b in range(nb):
            dw = f16_le(w_row, b * 24)
            mw = f16_le(w_row, b * 24 + 2)
            for n in range(ng):
                summs[n] = _summs(mw, f16_le(a[g + n], b * 36 + 2), summs[n])
                _blk_q5_1(ptr_offset(accs, 8 * n), dw * f16_le(a[g + n], b * 36), w_row, b * 24, a[g + n], b * 36 + 4)
        for n in range(ng):
            y[g + n, m] = acc8_hsum(ptr_offset(accs, 8 * n)) + summs[n]


@njit(cache=True, error_model="numpy")
def rows_dot_iq4_nl_q8_0(y, m, w_row, a):
    """y[n, m] = vec_dot_iq4_nl_q8_0(w_row, a[n]) for every row n of a (bit for bit)."""
    nb = w_row.size // 18
    acc1 = stack_f32(512)
    acc2 = stack_f32(512)
    for g in range(0, a.shape[0], ROWS_GROUP):
        ng = min(ROWS_GROUP, a.shape[0] - g)
        for n in range(ng):
            acc8_zero(ptr_offset(acc1, 8 * n))
            acc8_zero(ptr_offset(acc2, 8 * n))
        for i in range(nb // 2):
            b0 = 2 * i
            b1 = 2 * i + 1
            d0 = f16_le(w_row, b0 * 18)
            d1 = f16_le(w_row, b1 * 18)
            for n in range(ng):
                an = a[g + n]
                _blk_iq4_nl(ptr_offset(acc1, 8 * n), f16_le(an, b0 * 34) * d0, w_row, b0 * 18, an, b0 * 34 + 2)
                _blk_iq4_nl(ptr_offset(acc2, 8 * n), f16_le(an, b1 * 34) * d1, w_row, b1 * 18, an, b1 * 34 + 2)
        for n in range(ng):
            acc8_add(ptr_offset(acc1, 8 * n), ptr_offset(acc2, 8 * n))
            sumf = acc8_hsum(ptr_offset(acc1, 8 * n))
            if nb % 2 == 1:
                sumf = _iq4_nl_tail(w_row, a[g + n], nb - 1, sumf)
            y[g + n, m] = sumf


@njit(cache=True, error_model="numpy")
def _iq4_nl_tail(w_row, a_row, b, sumf):
    """ggml's scalar tail for a trailing odd IQ4_NL block: sumf = fma(d, isum, sumf)."""
    ai = a_row.view(np.int8)
    isum = np.int32(0)
    for j in range(16):
        q = w_row[b * 18 + 2 + j]
        isum += np.int32(KVALUES_IQ4NL[q & 15]) * np.int32(ai[b * 34 + 2 + j])
        isum += np.int32(KVALUES_IQ4NL[q >> 4]) * np.int32(ai[b * 34 + 18 + j])
    return fma32(f16_le(a_row, b * 34) * f16_le(w_row, b * 18), np.float32(isum), sumf)


@njit(cache=True, error_model="numpy", inline="always")
def _summs(m, s, acc):
    """summs += F16(m) * F16(s): GCC contracts this C expression into one fma on x86-64 with FMA."""
    return fma32(m, s, acc)


@njit(cache=True, error_model="numpy")
def vec_dot_f32(w_row, a_row, scratch):
    """F32 weight row . F32 activation row -> float32.

    Reproduces ggml-cpu/vec.cpp ggml_vec_dot_f32 with AVX-512 (GGML_F32_STEP 64, EPR 16,
    ARR 4): acc[64] = fma(w, x, acc) per 64-element step; reduce (acc0+acc2)+(acc1+acc3)
    lane-wise then _mm512_reduce_add_ps; leftovers sumf = fma(w, x, sumf) in order.
    """
    w = w_row.view(np.float32)
    x = a_row.view(np.float32)
    n = w.size
    acc = carray(stack_f32(64), 64)
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


@njit(cache=True, error_model="numpy")
def vec_dot_f16(w_row, a_row, scratch):
    """F16 weight row . F16 activation row -> float32.

    Reproduces ggml-cpu/vec.cpp ggml_vec_dot_f16 with AVX-512 (F32Cx16: F16 converted to F32,
    4 x 16 lanes fma per 64-element step, same reduction as F32 into a double sum; leftovers
    added in double); result rounded to float32.
    """
    wh = w_row.view(np.uint16)
    xh = a_row.view(np.uint16)
    n = wh.size
    acc = carray(stack_f32(64), 64)
    for t in range(64):
        acc[t] = np.float32(0.0)
    npart = n - n % 64
    for i in range(0, npart, 64):
        for t in range(64):
            acc[t] = fma32(f16_to_f32(wh[i + t]), f16_to_f32(xh[i + t]), acc[t])
    for t in range(16):
        acc[t] = (acc[t] + acc[32 + t]) + (acc[16 + t] + acc[48 + t])
    sumd = np.float64(reduce_add_16(acc))
    for i in range(npart, n):
        sumd += np.float64(f16_to_f32(wh[i]) * f16_to_f32(xh[i]))
    return np.float32(sumd)


@njit(cache=True, error_model="numpy")
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
    acc = carray(stack_f32(32), 32)
    for t in range(32):
        acc[t] = np.float32(0.0)
    npart = n - n % 64
    for i in range(0, npart, 64):
        for t in range(32):
            acc[t] = acc[t] + _bf16(wh[i + 2 * t + 1]) * _bf16(xh[i + 2 * t + 1])
            acc[t] = acc[t] + _bf16(wh[i + 2 * t]) * _bf16(xh[i + 2 * t])
    sumd = np.float64(reduce_add_16(acc[:16]))
    sumd += np.float64(reduce_add_16(acc[16:]))
    for i in range(npart, n):
        sumd += np.float64(_bf16(wh[i]) * _bf16(xh[i]))
    return np.float32(sumd)


@njit(cache=True, error_model="numpy", inline="always")
def _bf16(h):
    return u32_as_f32(np.uint32(h) << np.uint32(16))

