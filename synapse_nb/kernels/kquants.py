"""K-quant weight formats (Q2_K..Q6_K, IQ4_XS) and the Q8_K activation quantizer.

Row kernels that reproduce ggml's CPU backend bit for bit:

- ``dequantize_row_T(out, w_row)``: ggml-quants.c ``dequantize_row_T`` (equal to
  ``gguf.quants.dequantize``: every value is ``dl * q - ml`` in float32, unfused).
- ``quantize_row_q8_K(out, x)``: ggml-quants.c ``quantize_row_q8_K_ref``, which is what
  ggml-cpu's x86 ``quantize_row_q8_K`` calls.
- ``vec_dot_T_q8_K(w_row, a_row, scratch)``: ggml-cpu/arch/x86/quants.c ``ggml_vec_dot_T_q8_K``,
  AVX2 path (the AVX-512 build compiles the same code), as vendored in llama-cpp-python
  0.3.36 (llama.cpp 0c1e570), built by gcc -O3 -march=native -std=gnu11.
- ``rows_dot_T_q8_K(y, m, w_row, a)``: y[n, m] = vec_dot_T_q8_K(w_row, a[n]) for all rows n of
  a (uint8 [N, nb*292], C-contiguous) bit for bit: the matmul drivers' kernel for N > 1.  Per
  super-block the weight-only work (unpack qb[256] through the same _unpack_* helper as
  vec_dot, the scales and mins, the F16 d / dmin) is done once, then each row does vec_dot's
  activation-dependent steps in its order (d = y.d * ..., min terms from bsums, the 8 chunk dots,
  the lane fma) into its own 8 accumulators on the stack (simd.ROWS_GROUP rows per pass).
  Activations are addressed by flat byte offsets into a (no per-row or per-block views, which
  cost more than the work here).  Integer lanes are exact int32, so where rows_dot forms them
  differently (bsums with one vector multiply, Q3_K / IQ4_XS's two dots per chunk with one
  scale multiply) they are the same bits.  Generated from one template (_ROWS_DOT) and a
  descriptor per format, as vec_dot4 is.
- ``vec_dot4_T_q8_K(y, m, w, a_row)``: y[m + r] = vec_dot_T_q8_K(w[m + r], a_row) for r < 4 (w:
  uint8 [M, nb*block bytes], C-contiguous) bit for bit: the matmul drivers' kernel for N == 1 on
  whole groups of four rows.  Per super-block one intrinsic (kquant_ir.make_superblock4_dot, built
  from this file's per-format IR readers of the values and scales) does each row's vec_dot step
  with the four rows' scalar work in vector ops and two rows per 16-lane integer dot and fma; one
  row alone is bound by its scalar scale unpacking and its single fma chain.

How the x86 dots accumulate, and how we reproduce it.  Each 256-value super-block is
reduced to eight int32 "lanes" (one per 32-bit element of a __m256i): lane k holds the
exact integer sum, over every 32-value chunk of the block, of sub-block scale * q * q8
for the four values at positions 4k..4k+3 of the chunk (maddubs + madd pair them up
that way).  Integer sums are exact, so we may form them in any order.  The floats are
then accumulated per lane across blocks with one fused multiply-add each,
``acc[k] = fma(d, float(lane[k]), acc[k])`` with ``d = y.d * fp16(x.d)``, and reduced at
the end by ``hsum_float_8``: ``((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7))``.  The min terms:
Q2_K adds ``fma(-y.d*dmin, madd(mins, bsums))`` into the same eight lanes first; Q4_K
keeps a separate four-lane accumulator reduced as ``(m0+m2)+(m1+m3)`` and added last;
Q5_K keeps a scalar ``summs += dmin * sum(mins * q8sums)`` (fused: gcc contracts it to
vfmadd231ss) added last.  Q6_K multiplies the unsigned 6-bit values and subtracts
``32 * (scale * bsums)`` per lane afterwards (lane k gets sub-blocks 2k and 2k+1).

Speed: the SIMD pieces come from kquant_ir.py and simd.py: the integer lanes use vpdpbusd
(AVX512-VNNI, 256-bit) when the host has it, else portable LLVM vector IR; the half->float
conversion is vcvtph2ps with F16C, else exact integer IR; the IQ4 lookup is pshufb or portable.

Weights and activations are the raw GGUF/ggml block bytes (uint8, C-contiguous rows).  The
kernels do not bounds-check: callers validate that a row holds whole blocks and that
weights and activations have the same number of blocks.  Activations are a Q8_K row: per
256 values f32 d, 256 int8 qs, 16 int16 bsums (292 bytes).  An invalid row length is never
seen here: the drivers in matmul.py check shapes against the ggml type first.
"""


import numpy as np
from llvmlite import ir
from numba import carray

from ..formats import format_of
from .decorator import kernel
from .kquant_ir import (bsums_madd8, dot32_scaled_add, dot64_diff_scaled_add, dot64_madd_add,  # noqa: F401
                        fold16_add, iq4_lookup32, isum8, lanes_fma8, make_rows2_step, make_superblock4_dot, pairs_fma4,
                        q8k_bsums, zero16)
from .scalar import IQ4NL_TABLE_U8, KVALUES_IQ4NL, f16_le, f32_bits, fma32, hsum_float_8, u32_as_f32  # noqa: F401
from .simd import (HAS_VNNI512, ROWS_GROUP, acc8_hsum, acc8_zero, acc16_hsum, acc16_lane, acc16_zero,  # noqa: F401
                   ir_bytes, ir_lookup64, ir_lookup_nibbles32, ir_shuffle, ir_splat_const, ir_vec, ir_word, load_f32,
                   ptr_offset, stack_f32, stack_i32, stack_u8, store4_hsum)  # (F401: used by the generated rows_dot / vec_dot4)

# bytes per 256-value super-block, from the one table (gguf_spec.GGML_QUANT_SIZES, via formats)
QK_K = 256
Q8_K_BYTES, Q2_K_BYTES, Q3_K_BYTES, Q4_K_BYTES, Q5_K_BYTES, Q6_K_BYTES, IQ4_XS_BYTES = (
    format_of(name).type_size for name in ("Q8_K", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS"))


@kernel(nested=True)
def _f32(w, o):
    """float32 at bytes w[o..o+3] (little endian)."""
    u = (np.uint32(w[o]) | (np.uint32(w[o + 1]) << np.uint32(8))
         | (np.uint32(w[o + 2]) << np.uint32(16)) | (np.uint32(w[o + 3]) << np.uint32(24)))
    return u32_as_f32(u)


@kernel(nested=True)
def _k4_scale_min(w, o, j):
    """ggml get_scale_min_k4: 6-bit scale and min j (0..7) of a Q4_K/Q5_K block, scales at w[o..o+11]."""
    if j < 4:
        sc = np.int32(w[o + j]) & np.int32(63)
        m = np.int32(w[o + j + 4]) & np.int32(63)
    else:
        sc = (np.int32(w[o + j + 4]) & np.int32(15)) | ((np.int32(w[o + j - 4]) >> np.int32(6)) << np.int32(4))
        m = (np.int32(w[o + j + 4]) >> np.int32(4)) | ((np.int32(w[o + j]) >> np.int32(6)) << np.int32(4))
    return sc, m


@kernel(nested=True)
def _q3_scale(w, o, i):
    """Q3_K 6-bit scale i (0..15) minus 32, scales at w[o..o+11]."""
    lo = (np.int32(w[o + (i & 7)]) >> np.int32(4 * (i >> 3))) & np.int32(15)
    hi = (np.int32(w[o + 8 + (i & 3)]) >> np.int32(2 * (i >> 2))) & np.int32(3)
    return (lo | (hi << np.int32(4))) - np.int32(32)


# ---------------------------------------------------------------------------------------
# Q8_K activations
# ---------------------------------------------------------------------------------------

@kernel(nested=True)
def quantize_row_q8_K(out, x):
    """Quantize one activation row to Q8_K blocks (ggml-quants.c quantize_row_q8_K_ref,
    which ggml-cpu's x86 quantize_row_q8_K calls).

    out: uint8[(len(x) // 256) * 292], written; x: float32[n], n a multiple of 256.
    Per block: max = the first value of largest magnitude (signed), iscale = -127/max,
    q = min(127, round-half-even(iscale * x)), d = 1/iscale (f32), bsums = sums of 16 q.
    An all-zero block gets d = 0 and zero qs and bsums.
    """
    nb = x.size // QK_K
    for i in range(nb):
        xo = i * QK_K
        bo = i * Q8_K_BYTES
        # ggml's scan keeps the first x of largest |x| (a NaN never compares greater). The same x
        # found in two passes that vectorize: the largest |x| by its bits (as unsigned integers
        # they order like the magnitudes; a NaN counts as 0), then its first position.
        amax_bits = np.uint32(0)
        for j in range(QK_K):
            a = f32_bits(x[xo + j]) & np.uint32(0x7FFFFFFF)
            amax_bits = max(amax_bits, a if a <= np.uint32(0x7F800000) else np.uint32(0))
        if amax_bits == 0:
            for j in range(Q8_K_BYTES):
                out[bo + j] = 0
            continue
        j0 = 0
        while f32_bits(x[xo + j0]) & np.uint32(0x7FFFFFFF) != amax_bits:
            j0 += 1
        iscale = np.float32(-127.0) / x[xo + j0]
        for j in range(QK_K):
            # ggml's nearest_int: add 1.5 * 2^23 and take the low mantissa bits (round half to
            # even for |v| < 2^22); done on the bits so that an overflowed iscale (inf or nan
            # products, max|x| < 3.7e-37) stores what ggml stores: the low byte of MIN(127, v).
            val = iscale * x[xo + j] + np.float32(12582912.0)
            v = np.int32(f32_bits(val) & np.uint32(0x7FFFFF)) - np.int32(0x400000)
            out[bo + 4 + j] = np.uint8(min(np.int32(127), v) & 0xFF)
        d = np.float32(1.0) / iscale
        ud = f32_bits(d)
        for j in range(4):
            out[bo + j] = np.uint8((ud >> np.uint32(8 * j)) & np.uint32(255))
        q8k_bsums(out, bo)


# ---------------------------------------------------------------------------------------
# Dequantization (ggml-quants.c dequantize_row_*, = gguf.quants.dequantize)
# ---------------------------------------------------------------------------------------

@kernel(nested=True)
def dequantize_row_q2_K(out, w_row):
    """Q2_K row -> float32 (ggml-quants.c dequantize_row_q2_K).

    out: float32[nb*256]; w_row: uint8[nb*84] (scales[16] (4-bit scale | 4-bit min << 4),
    qs[64] 2-bit, f16 d, f16 dmin).  y = (d*scale)*q - (dmin*min).
    """
    nb = w_row.size // Q2_K_BYTES
    for i in range(nb):
        o = i * Q2_K_BYTES
        d = f16_le(w_row, o + 80)
        dmin = f16_le(w_row, o + 82)
        for j in range(2):
            for s in range(4):
                for h in range(2):
                    sb = 8 * j + 2 * s + h
                    sc = np.int32(w_row[o + sb])
                    dl = d * np.float32(sc & 15)
                    ml = dmin * np.float32(sc >> 4)
                    base = i * QK_K + 128 * j + 32 * s + 16 * h
                    for t in range(16):
                        q = (np.int32(w_row[o + 16 + 32 * j + 16 * h + t]) >> np.int32(2 * s)) & np.int32(3)
                        out[base + t] = dl * np.float32(q) - ml


@kernel(nested=True)
def dequantize_row_q3_K(out, w_row):
    """Q3_K row -> float32 (ggml-quants.c dequantize_row_q3_K).

    out: float32[nb*256]; w_row: uint8[nb*110] (hmask[32], qs[64] 2-bit, scales[12] 6-bit,
    f16 d).  y = (d*(scale-32)) * (q2 - (hbit ? 0 : 4)).
    """
    nb = w_row.size // Q3_K_BYTES
    for i in range(nb):
        o = i * Q3_K_BYTES
        d = f16_le(w_row, o + 108)
        for sb in range(16):  # sub-block sb = 8j + 2s + h: 128-value half j, 2-bit shift s, 16-value part h
            j, s, h = sb >> 3, (sb >> 1) & 3, sb & 1
            dl = d * np.float32(_q3_scale(w_row, o + 96, sb))
            base = i * QK_K + 16 * sb
            for t in range(16):
                l = 16 * h + t
                ql = (np.int32(w_row[o + 32 + 32 * j + l]) >> np.int32(2 * s)) & np.int32(3)
                hb = (np.int32(w_row[o + l]) >> np.int32(4 * j + s)) & np.int32(1)
                out[base + t] = dl * np.float32(ql - np.int32(4) + (hb << np.int32(2)))


@kernel(inline="always")
def _dequantize_q45_K(out, w_row, block_bytes, qs_off, high_bits):
    """Q4_K / Q5_K rows -> float32: f16 d, f16 dmin, scales[12] (6-bit scales and mins), then for
    Q5_K (high_bits) qh[32] high bits, then qs[128] low nibbles at qs_off. y = (d*sc)*q - (dmin*m)."""
    nb = w_row.size // block_bytes
    for i in range(nb):
        o = i * block_bytes
        d = f16_le(w_row, o)
        dmin = f16_le(w_row, o + 2)
        for j in range(4):
            sc1, m1 = _k4_scale_min(w_row, o + 4, 2 * j)
            sc2, m2 = _k4_scale_min(w_row, o + 4, 2 * j + 1)
            d1 = d * np.float32(sc1)
            mm1 = dmin * np.float32(m1)
            d2 = d * np.float32(sc2)
            mm2 = dmin * np.float32(m2)
            base = i * QK_K + 64 * j
            for t in range(32):
                b = np.int32(w_row[o + qs_off + 32 * j + t])
                q1 = b & np.int32(15)
                q2 = b >> np.int32(4)
                if high_bits:
                    h = np.int32(w_row[o + 16 + t])
                    q1 |= ((h >> np.int32(2 * j)) & np.int32(1)) << np.int32(4)
                    q2 |= ((h >> np.int32(2 * j + 1)) & np.int32(1)) << np.int32(4)
                out[base + t] = d1 * np.float32(q1) - mm1
                out[base + 32 + t] = d2 * np.float32(q2) - mm2


@kernel(nested=True)
def dequantize_row_q4_K(out, w_row):
    """Q4_K row -> float32 (ggml-quants.c dequantize_row_q4_K).

    out: float32[nb*256]; w_row: uint8[nb*144] (f16 d, f16 dmin, scales[12] 6-bit
    scales and mins, qs[128] 4-bit).  y = (d*sc)*q - (dmin*m).
    """
    _dequantize_q45_K(out, w_row, Q4_K_BYTES, 16, False)


@kernel(nested=True)
def dequantize_row_q5_K(out, w_row):
    """Q5_K row -> float32 (ggml-quants.c dequantize_row_q5_K).

    out: float32[nb*256]; w_row: uint8[nb*176] (f16 d, f16 dmin, scales[12], qh[32] high
    bits, qs[128] low nibbles).  y = (d*sc)*q - (dmin*m).
    """
    _dequantize_q45_K(out, w_row, Q5_K_BYTES, 48, True)


@kernel(nested=True)
def dequantize_row_q6_K(out, w_row):
    """Q6_K row -> float32 (ggml-quants.c dequantize_row_q6_K).

    out: float32[nb*256]; w_row: uint8[nb*210] (ql[128] low nibbles, qh[64] high 2 bits,
    int8 scales[16], f16 d).  y = (d*scale) * (q - 32).
    """
    nb = w_row.size // Q6_K_BYTES
    for i in range(nb):
        o = i * Q6_K_BYTES
        d = f16_le(w_row, o + 208)
        for j in range(2):
            for t in range(32):
                a = np.int32(w_row[o + 64 * j + t])
                b = np.int32(w_row[o + 64 * j + 32 + t])
                h = np.int32(w_row[o + 128 + 32 * j + t])
                q1 = ((a & np.int32(15)) | ((h & np.int32(3)) << np.int32(4))) - np.int32(32)
                q2 = ((b & np.int32(15)) | (((h >> np.int32(2)) & np.int32(3)) << np.int32(4))) - np.int32(32)
                q3 = ((a >> np.int32(4)) | (((h >> np.int32(4)) & np.int32(3)) << np.int32(4))) - np.int32(32)
                q4 = ((b >> np.int32(4)) | (((h >> np.int32(6)) & np.int32(3)) << np.int32(4))) - np.int32(32)
                isc = o + 192 + 8 * j + t // 16
                base = i * QK_K + 128 * j + t
                out[base] = (d * np.float32(np.int8(w_row[isc]))) * np.float32(q1)
                out[base + 32] = (d * np.float32(np.int8(w_row[isc + 2]))) * np.float32(q2)
                out[base + 64] = (d * np.float32(np.int8(w_row[isc + 4]))) * np.float32(q3)
                out[base + 96] = (d * np.float32(np.int8(w_row[isc + 6]))) * np.float32(q4)


@kernel(nested=True)
def dequantize_row_iq4_xs(out, w_row):
    """IQ4_XS row -> float32 (ggml-quants.c dequantize_row_iq4_xs).

    out: float32[nb*256]; w_row: uint8[nb*136] (f16 d, u16 scales_h, scales_l[4], qs[128]
    4-bit indices into kvalues_iq4nl).  y = (d*(ls-32)) * kvalues[q].
    """
    nb = w_row.size // IQ4_XS_BYTES
    kv = KVALUES_IQ4NL
    for i in range(nb):
        o = i * IQ4_XS_BYTES
        d = f16_le(w_row, o)
        sh = np.int32(w_row[o + 2]) | (np.int32(w_row[o + 3]) << np.int32(8))
        for ib in range(8):
            ls = ((np.int32(w_row[o + 4 + ib // 2]) >> np.int32(4 * (ib % 2))) & np.int32(15)) \
                | (((sh >> np.int32(2 * ib)) & np.int32(3)) << np.int32(4))
            dl = d * np.float32(ls - np.int32(32))
            base = i * QK_K + 32 * ib
            for t in range(16):
                b = np.int32(w_row[o + 8 + 16 * ib + t])
                out[base + t] = dl * np.float32(kv[b & np.int32(15)])
                out[base + 16 + t] = dl * np.float32(kv[b >> np.int32(4)])


# ---------------------------------------------------------------------------------------
# Dot products with Q8_K activations (ggml-cpu/arch/x86/quants.c, AVX2 path): their pieces
# ---------------------------------------------------------------------------------------
# Per super-block: the weights are unpacked into qb[256] (uint8, value order: a flat,
# vectorized byte loop), then each 32-value chunk adds scale * (4-value dot products) into
# the eight int32 lanes p[8] (kquant_ir.dot32_scaled_add: one vpdpbusd with AVX512-VNNI), then
# acc = fma(d, float(p), acc) lane-wise (kquant_ir.lanes_fma8).  Signed weights are stored with an
# offset and the offset's dot product is subtracted, as ggml does; every step is exact int32.
# Each block is taken as a slice (w, y): indices into it are then small non-negative loop
# values, which lets LLVM drop Numba's negative-index checks and vectorize the byte loops.
# Q8_K block y: d = f32 at byte 0, qs = int8 at bytes 4..259, bsums = int16 at int16 index 130.
# ``scratch`` (driver contract, int32[>= 2K+128]) is accepted but not needed: the per-block
# buffers live on the stack.  The vec_dot_T_q8_K themselves are generated at the end of this
# file (_VEC_DOT), from the per-format code of ggml's loop.


# ---------------------------------------------------------------------------------------
# Multi-row dots (rows_dot_T_q8_K, generated at the end of this file): the per-row pieces
# ---------------------------------------------------------------------------------------
# Per row and super-block, vec_dot's eight dot32_scaled_add calls become four dot64_madd_add
# (two 32-value chunks per vpmaddubsw + vpdpwssd on one zmm) and a fold of the two halves: the
# same exact int32 lanes.  The per-lane scale vectors (sv) are weight-only, built once per block.


@kernel(inline="always")
def _chunk_scales(sv, sc, per_half):
    """sv[8c + k] = the scale of lane k of 32-value chunk c (c < 8): sc[c] (one scale per chunk:
    Q4_K, Q5_K, IQ4_XS) or, per_half, sc[2c] for k < 4 and sc[2c+1] for k >= 4 (16-value
    sub-blocks: Q2_K, Q3_K, Q6_K), as vec_dot's dot32_scaled_add(..., s_lo, s_hi) calls."""
    for j in range(64):
        if per_half:
            sv[j] = sc[2 * (j // 8) + (j % 8) // 4]
        else:
            sv[j] = sc[j // 8]


@kernel(inline="always")
def _k4_min_pairs(mins, sc):
    """mins[2c] = mins[2c+1] = min c (sc[8 + c] from _k4_unpack): bsums_madd8's coefficients, so
    that lane c is min c * (bsums[2c] + bsums[2c+1])."""
    for c in range(8):
        mins[2 * c] = sc[8 + c]
        mins[2 * c + 1] = sc[8 + c]


@kernel(inline="always")
def _lanes_add(p, p16, qb, a, yo, sv):
    """p[0:8] += the super-block's 8 int32 lanes: sum over chunks c of sv[8c + k] * the 4-value
    sums of qb[32c:] * the Q8_K values at a[yo + 4 + 32c:] (vec_dot's dot32_scaled_add loop)."""
    zero16(p16)
    for c in range(0, 8, 2):
        dot64_madd_add(p16, qb, 32 * c, a, yo + 4 + 32 * c, sv, 8 * c)
    fold16_add(p, p16)


@kernel(inline="always")
def _lanes_diff_add(p, p16, qb, qh, h_step, a, yo, sv):
    """As _lanes_add for weights qb - qh (chunk c of qh at h_step * c): vec_dot's pairs of
    dot32_scaled_add with scales s and -s."""
    zero16(p16)
    for c in range(0, 8, 2):
        dot64_diff_scaled_add(p16, qb, 32 * c, qh, h_step * c, a, yo + 4 + 32 * c, sv, 8 * c)
    fold16_add(p, p16)


@kernel(inline="always")
def _unpack_2bit(qb, w, o):
    """qb[0:256] = the 2-bit values of the 64 bytes w[o:o+64] (Q2_K / Q3_K qs) in value order."""
    for j in range(2):
        for t in range(32):
            b = w[o + 32 * j + t]
            qb[128 * j + t] = b & np.uint8(3)
            qb[128 * j + 32 + t] = (b >> np.uint8(2)) & np.uint8(3)
            qb[128 * j + 64 + t] = (b >> np.uint8(4)) & np.uint8(3)
            qb[128 * j + 96 + t] = b >> np.uint8(6)


@kernel(inline="always")
def _unpack_q3_K(qb, qh, w):
    """Q3_K block w (its 110 bytes) -> qb[0:256] its low 2 bits and qh[0:256] its "minus 4"
    (4 where the high bit is clear, else 0), in value order: the value is qb - qh."""
    _unpack_2bit(qb, w, 32)
    for j in range(2):
        for t in range(32):
            hm = w[t] >> np.uint8(4 * j)
            qh[128 * j + t] = ((hm & np.uint8(1)) ^ np.uint8(1)) << np.uint8(2)
            qh[128 * j + 32 + t] = (((hm >> np.uint8(1)) & np.uint8(1)) ^ np.uint8(1)) << np.uint8(2)
            qh[128 * j + 64 + t] = (((hm >> np.uint8(2)) & np.uint8(1)) ^ np.uint8(1)) << np.uint8(2)
            qh[128 * j + 96 + t] = (((hm >> np.uint8(3)) & np.uint8(1)) ^ np.uint8(1)) << np.uint8(2)


@kernel(nested=True)
def _k4_unpack(sc, w, o):
    """Unpack the 12 packed bytes at w[o..o+11] into sc[0..7] = scales, sc[8..15] = mins
    (ggml get_scale_min_k4 for j = 0..7)."""
    for j in range(4):
        b0 = np.int32(w[o + j])
        b1 = np.int32(w[o + 4 + j])
        b2 = np.int32(w[o + 8 + j])
        sc[j] = b0 & np.int32(63)
        sc[8 + j] = b1 & np.int32(63)
        sc[4 + j] = (b2 & np.int32(15)) | ((b0 >> np.int32(6)) << np.int32(4))
        sc[12 + j] = (b2 >> np.int32(4)) | ((b1 >> np.int32(6)) << np.int32(4))


@kernel(inline="always")
def _unpack_q4_K(qb, w):
    """qb[0:256] = the 4-bit values of the Q4_K block w (its 144 bytes), in value order."""
    for j in range(4):
        for t in range(32):
            b = w[16 + 32 * j + t]
            qb[64 * j + t] = b & np.uint8(15)
            qb[64 * j + 32 + t] = b >> np.uint8(4)


@kernel(inline="always")
def _unpack_q5_K(qb, w):
    """qb[0:256] = the 5-bit values of the Q5_K block w (its 176 bytes), in value order."""
    for j in range(4):
        for t in range(32):
            b = w[48 + 32 * j + t]
            h = w[16 + t] >> np.uint8(2 * j)
            qb[64 * j + t] = (b & np.uint8(15)) | ((h & np.uint8(1)) << np.uint8(4))
            qb[64 * j + 32 + t] = (b >> np.uint8(4)) | (((h >> np.uint8(1)) & np.uint8(1)) << np.uint8(4))


@kernel(inline="always")
def _unpack_q6_K(qb, w):
    """qb[0:256] = the unsigned 6-bit values (0..63) of the Q6_K block w (its 210 bytes)."""
    for j in range(2):
        for t in range(32):
            a = w[64 * j + t]
            b = w[64 * j + 32 + t]
            h = w[128 + 32 * j + t]
            qb[128 * j + t] = (a & np.uint8(15)) | ((h & np.uint8(3)) << np.uint8(4))
            qb[128 * j + 32 + t] = (b & np.uint8(15)) | (((h >> np.uint8(2)) & np.uint8(3)) << np.uint8(4))
            qb[128 * j + 64 + t] = (a >> np.uint8(4)) | (((h >> np.uint8(4)) & np.uint8(3)) << np.uint8(4))
            qb[128 * j + 96 + t] = (b >> np.uint8(4)) | ((h >> np.uint8(6)) << np.uint8(4))


# the IQ4 weights are looked up as kvalues_iq4nl + 128 (unsigned bytes for the 4-value dots)
_U8_128 = np.full(64, 128, np.uint8)  # (64: two chunks for dot64_diff_scaled_add)


# ---------------------------------------------------------------------------------------
# Four weight rows per call (the matvec, N == 1): vec_dot4_T_q8_K(y, m, w, a_row)
# ---------------------------------------------------------------------------------------
# y[m + r] = vec_dot_T_q8_K(w[m + r], a_row) for r < 4, bit for bit: per super-block one
# kquant_ir.make_superblock4_dot intrinsic does each row's vec_dot step (the same int32 lanes, the
# same float32 roundings) with the four rows' scalars in shared vector operations, two rows per
# 16-lane integer dot / fma, and a prefetch of the rows ahead (as the legacy formats' vec_dot4).
# The per-format pieces below give it, in LLVM IR, the stored values of a 32-value chunk and the
# sub-block scales (and mins) of the block at i8* p, read exactly as _unpack_T and the scale code
# of vec_dot_T read them (ggml's word arithmetic for the packed 6-bit scales); the tests compare
# vec_dot4 with vec_dot and with ggml, on every path (AVX512-VNNI and portable).

def _c8(v, n=32):
    return ir_splat_const(ir.IntType(8), v, n)


def _nibbles(b, p, off, high):
    """The low (high = 0) or high (1) nibbles of the 32 bytes at p + off."""
    q = ir_bytes(b, p, off, 32)
    return b.and_(b.lshr(q, _c8(4 * high)), _c8(15)) if high else b.and_(q, _c8(15))


def _bits(b, p, off, shift, mask):
    """(byte >> shift) & mask of the 32 bytes at p + off."""
    return b.and_(b.lshr(ir_bytes(b, p, off, 32), _c8(shift)), _c8(mask))


def _vals_q2_K(b, p, c):  # _unpack_2bit(qb, w, 16)
    return _bits(b, p, 16 + 32 * (c // 4), 2 * (c % 4), 3)


def _vals_q3_K(b, p, c):  # _unpack_q3_K: the low 2 bits | the high bit << 2 (the weight is that - 4)
    return b.or_(_bits(b, p, 32 + 32 * (c // 4), 2 * (c % 4), 3), b.shl(_bits(b, p, 0, c, 1), _c8(2)))


def _vals_q4_K(b, p, c):  # _unpack_q4_K
    return _nibbles(b, p, 16 + 32 * (c // 2), c % 2)


def _vals_q5_K(b, p, c):  # _unpack_q5_K
    return b.or_(_nibbles(b, p, 48 + 32 * (c // 2), c % 2), b.shl(_bits(b, p, 16, c, 1), _c8(4)))


def _vals_q6_K(b, p, c):  # _unpack_q6_K
    j, s = divmod(c, 4)
    return b.or_(_nibbles(b, p, 64 * j + 32 * (s % 2), s // 2), b.shl(_bits(b, p, 128 + 32 * j, 2 * s, 3), _c8(4)))


def _vals_iq4_xs(b, p, c):  # iq4_lookup32: kvalues_iq4nl + 128 (the weight is that - 128)
    return ir_lookup_nibbles32(b, b.gep(p, [ir.Constant(ir.IntType(64), 8 + 16 * c)]), IQ4NL_TABLE_U8)


def _vals2_iq4_xs(b, pa, pb, c):
    """_vals_iq4_xs of two rows in one 64-byte lookup: [qa, qa, qb, qb] (16 bytes each), the
    high nibble of the second and fourth copies (one word shift), then kvalues + 128."""
    x = ir_shuffle(b, ir_bytes(b, pa, 8 + 16 * c, 16), ir_bytes(b, pb, 8 + 16 * c, 16),
                   list(range(16)) * 2 + list(range(16, 32)) * 2)
    i16x32 = ir.VectorType(ir.IntType(16), 32)
    sh = b.lshr(b.bitcast(x, i16x32), ir.Constant(i16x32, ([0] * 8 + [4] * 8) * 2))
    return ir_lookup64(b, b.and_(b.bitcast(sh, ir.VectorType(ir.IntType(8), 64)), _c8(15, 64)), IQ4NL_TABLE_U8)


def _i32x(vals):
    return ir.Constant(ir.VectorType(ir.IntType(32), len(vals)), list(vals))


def _bytes_to_i32(b, v, signed=False):
    """<4 x i32> or <16 x i8> -> its 16 bytes as <16 x i32>."""
    v8 = b.bitcast(v, ir.VectorType(ir.IntType(8), 16))
    return (b.sext if signed else b.zext)(v8, ir.VectorType(ir.IntType(32), 16))


def _scales_q2_K(b, p):  # vec_dot: sc[j] = scales[j] & 15, min j = scales[j] >> 4
    v = ir_bytes(b, p, 0, 16)
    return _bytes_to_i32(b, b.and_(v, _c8(15, 16))), _bytes_to_i32(b, b.lshr(v, _c8(4, 16)))


def _scales_q3_K(b, p):
    """_q3_scale(w, 96, i), i < 16, as ggml's word arithmetic: bytes 4t..4t+3 of
    ((aux[t & 1] >> 4 (t >> 1)) & 0x0f0f0f0f) | (((aux[2] >> 2t) & 0x03030303) << 4), minus 32."""
    a0, a1, a2 = (ir_word(b, p, 96 + 4 * t) for t in range(3))
    lo = b.and_(b.lshr(ir_vec(b, [a0, a1, a0, a1]), _i32x([0, 0, 4, 4])), _i32x([0x0F0F0F0F] * 4))
    hi = b.shl(b.and_(b.lshr(ir_vec(b, [a2] * 4), _i32x([0, 2, 4, 6])), _i32x([0x03030303] * 4)), _i32x([4] * 4))
    return b.sub(_bytes_to_i32(b, b.or_(lo, hi)), _i32x([32] * 16)), None


def _scales_k4(b, p):
    """_k4_unpack(sc, w, 4) as ggml's word arithmetic on u = the 3 words at p + 4: bytes 0..7 the
    scales, 8..15 the mins of [u0 & m1, (u2 & m2) | ((u0 >> 6) & m3) << 4, u1 & m1,
    ((u2 >> 4) & m2) | ((u1 >> 6) & m3) << 4] (m1 = 0x3f.., m2 = 0x0f.., m3 = 0x03..)."""
    u = b.bitcast(ir_bytes(b, p, 4, 16), ir.VectorType(ir.IntType(32), 4))  # u0, u1, u2 (+ 4 bytes of qs)
    lo = b.and_(b.lshr(ir_shuffle(b, u, None, [0, 2, 1, 2]), _i32x([0, 0, 0, 4])),
                _i32x([0x3F3F3F3F, 0x0F0F0F0F, 0x3F3F3F3F, 0x0F0F0F0F]))
    hi = b.shl(b.and_(b.lshr(ir_shuffle(b, u, None, [0, 0, 1, 1]), _i32x([6] * 4)),
                      _i32x([0, 0x03030303, 0, 0x03030303])), _i32x([4] * 4))
    t = _bytes_to_i32(b, b.or_(lo, hi))
    return t, ir_shuffle(b, t, None, list(range(8, 16)) * 2)


def _scales_q6_K(b, p):  # int8 scales[16]
    return _bytes_to_i32(b, ir_bytes(b, p, 192, 16), signed=True), None


def _scales_iq4_xs(b, p):
    """vec_dot's ls, ib < 8: ((scales_l word >> 4 ib) & 15) | ((scales_h >> 2 ib) & 3) << 4, minus 32
    (lanes 8..15 repeat 0..7)."""
    i32 = ir.IntType(32)
    sl = ir_vec(b, [ir_word(b, p, 4)] * 16)
    sh = ir_vec(b, [b.zext(ir_word(b, p, 2, 16), i32)] * 16)
    lo = b.and_(b.lshr(sl, _i32x([4 * (i % 8) for i in range(16)])), _i32x([15] * 16))
    hi = b.shl(b.and_(b.lshr(sh, _i32x([2 * (i % 8) for i in range(16)])), _i32x([3] * 16)), _i32x([4] * 16))
    return b.sub(b.or_(lo, hi), _i32x([32] * 16)), None


# stem: (block bytes, make_superblock4_dot arguments after block_bytes; rows_dot reads d_off,
# per_half and mins too)
_SB4 = {
    "q2_K": (Q2_K_BYTES, dict(d_off=80, values=_vals_q2_K, scales=_scales_q2_K, per_half=True, dmin_off=82,
                              mins="lanes")),
    "q3_K": (Q3_K_BYTES, dict(d_off=108, values=_vals_q3_K, scales=_scales_q3_K, per_half=True, offset=4)),
    "q4_K": (Q4_K_BYTES, dict(d_off=0, values=_vals_q4_K, scales=_scales_k4, per_half=False, dmin_off=2,
                              mins="four")),
    "q5_K": (Q5_K_BYTES, dict(d_off=0, values=_vals_q5_K, scales=_scales_k4, per_half=False, dmin_off=2,
                              mins="scalar")),
    "q6_K": (Q6_K_BYTES, dict(d_off=208, values=_vals_q6_K, scales=_scales_q6_K, per_half=True, mins="bsums32")),
    "iq4_xs": (IQ4_XS_BYTES, dict(d_off=0, values=_vals_iq4_xs, scales=_scales_iq4_xs, per_half=False,
                                  offset=128, small_values=False, values2=_vals2_iq4_xs,
                                  l2_prefetch=False)),  # measured no faster into L2 (simd.L2_PREFETCH)
}
for _stem, (_wb, _kw) in _SB4.items():
    globals()[f"_sb4_{_stem}"] = make_superblock4_dot(_wb, **_kw)

# vec_dot's final sum per row r, added to hsum_float_8 of its 8 lanes (store4_hsum's y[m + r])
_TAIL = {
    "q4_K": ("\n    for r in range(4):\n        y[m + r] = y[m + r] + ((acc16_lane(px, 4 * r) + acc16_lane(px, 4 * r + 2))"
             " + (acc16_lane(px, 4 * r + 1) + acc16_lane(px, 4 * r + 3)))"),  # the four min lanes
    "q5_K": "\n    for r in range(4):\n        y[m + r] = y[m + r] + acc16_lane(px, r)",  # summs
}

_VEC_DOT4 = '''
@kernel(nested=True)
def vec_dot4_{w}_q8_K(y, m, w, a_row):
    """y[m + r] = vec_dot_{w}_q8_K(w[m + r], a_row) for r < 4, bit for bit (_sb4_{w} per super-block).

    y: float32[M]; w: uint8[M, nb*{WB}] (C-contiguous); a_row: uint8[nb*292]."""
    nb = w.shape[1] // {WB}
    w0, w1, w2, w3 = w[m], w[m + 1], w[m + 2], w[m + 3]
    acc = stack_f32(32)
    px = stack_f32(16)
    acc16_zero(acc)
    acc16_zero(ptr_offset(acc, 16))
    acc16_zero(px)
    for i in range(nb):
        _sb4_{w}(acc, ptr_offset(acc, 16), px, w0, w1, w2, w3, i * {WB}, a_row, i * Q8_K_BYTES)
    store4_hsum(y, m, acc, ptr_offset(acc, 16)){tail}
'''

for _stem, (_wb, _) in _SB4.items():
    exec(compile(_VEC_DOT4.format(w=_stem, WB=_wb, tail=_TAIL.get(_stem, "")), __file__, "exec"), globals())


# ---------------------------------------------------------------------------------------
# The generated dots: one template per kind (vec_dot, rows_dot) and a descriptor per format
# ---------------------------------------------------------------------------------------
# A template line ending in "  #tag" is kept only for the formats with that tag (_tags: the min
# term as _SB4's ``mins`` names it -- lanes (Q2_K: into the 8 lanes first), four (Q4_K: four min
# lanes added last), scalar (Q5_K: one sum added last), bsums32 (Q6_K: the lanes start at -32 *
# scale * bsums) --; min: a dmin and mins (Q2_K, Q4_K, Q5_K); zero: the lanes start at 0 (all
# but Q6_K); bsums: reads the Q8_K bsums; sc: scales in sc[] (all but IQ4_XS); qh: Q3_K's
# "minus 4" values; c128: IQ4_XS's 128 offset).  A line holding only "{name}" becomes the
# format's code block of that name, at the line's indent.

_EXTRA_TAGS = {"q2_K": {"sc"}, "q3_K": {"sc", "qh"}, "q4_K": {"sc"}, "q5_K": {"sc"}, "q6_K": {"sc"},
               "iq4_xs": {"c128"}}


def _tags(stem):
    mins = _SB4[stem][1].get("mins")
    return _EXTRA_TAGS[stem] | {mins, "min" if mins in ("lanes", "four", "scalar") else None,
                                "bsums" if mins else None, None if mins == "bsums32" else "zero"}


def _generate(template, stem, blocks, **fields):
    """Compile ``template`` for format ``stem`` into this module: its tagged lines and code blocks
    (see above), then str.format with w, WB, D, per_half and ``fields`` (under this file's name,
    so that Numba's cache finds the functions again, as matmul.py's drivers)."""
    wb, kw = _SB4[stem]
    tags = _tags(stem)
    lines = []
    for line in template.splitlines():
        code, _, tag = line.rpartition("  #")
        if code and tag.isidentifier():
            if tag not in tags:
                continue
            line = code
        name = line.strip()
        if name.startswith("{") and name.endswith("}") and name[1:-1] in blocks:
            indent = line[:len(line) - len(line.lstrip())]
            lines += [indent + c for c in blocks[name[1:-1]].splitlines()]
        else:
            lines.append(line)
    src = "\n".join(lines).format(w=stem, WB=wb, D=kw["d_off"], per_half=kw["per_half"], **fields)
    exec(compile(src, __file__, "exec"), globals())


# vec_dot_T_q8_K(w_row, a_row, scratch): ggml_vec_dot_T_q8_K's loop as ggml writes it, one row.
# Per format (_VEC_DOTS): its docstring, the block step before the lanes start (d, the scales and
# mins, the min term, the unpacking), the chunk dots where they are not the plain per-chunk ones.
_VEC_DOT = """
@kernel(nested=True)
def vec_dot_{w}_q8_K(w_row, a_row, scratch):
    '''{doc}'''
    nb = w_row.size // {WB}
    a16 = a_row.view(np.int16)  #bsums
    c128 = _U8_128  #c128
    p = carray(stack_i32(8), 8)
    pm = carray(stack_i32(8), 8)  #lanes
    sc = carray(stack_i32({nsc}), {nsc})  #sc
    qb = carray(stack_u8(256), 256)
    qh = carray(stack_u8(256), 256)  #qh
    acc = carray(stack_f32({nacc}), {nacc})
    for k in range({nacc}):
        acc[k] = np.float32(0.0)
    summs = np.float32(0.0)  #scalar
    for i in range(nb):
        w = w_row[i * {WB}:(i + 1) * {WB}]
        y = a_row[i * Q8_K_BYTES:(i + 1) * Q8_K_BYTES]
        y16 = a16[i * (Q8_K_BYTES // 2):(i + 1) * (Q8_K_BYTES // 2)]  #bsums
        {block}
        for k in range(8):  #zero
            p[k] = 0  #zero
        for c in range(8):  #sc
            dot32_scaled_add(p, qb, 32 * c, y, 4 + 32 * c, {s_lo}, {s_hi})  #sc
            dot32_scaled_add(p, qh, 32 * c, y, 4 + 32 * c, -{s_lo}, -{s_hi})  #qh
        {chunks}
        lanes_fma8(acc, d, p)
    return hsum_float_8(acc){tail}
"""

_VEC_DOTS = {
    "q2_K": ("""Dot of a Q2_K row with a Q8_K row -> float32 (ggml_vec_dot_q2_K_q8_K, x86 AVX2).

    w_row: uint8[nb*84]; a_row: uint8[nb*292]; scratch: int32 (unused).  Per block, eight
    lanes get fma(-y.d*dmin, mins[2k]*bsums[2k] + mins[2k+1]*bsums[2k+1]), then
    fma(y.d*d, lane k); result hsum_float_8.
    """, """yd = _f32(y, 0)
d = yd * f16_le(w, 80)
dmin = -yd * f16_le(w, 82)
for j in range(16):
    b = np.int32(w[j])
    sc[j] = b & np.int32(15)
    sc[16 + j] = b >> np.int32(4)
for k in range(8):
    pm[k] = sc[16 + 2 * k] * np.int32(y16[130 + 2 * k]) + sc[17 + 2 * k] * np.int32(y16[131 + 2 * k])
lanes_fma8(acc, dmin, pm)
_unpack_2bit(qb, w, 16)""", ""),
    "q3_K": ("""Dot of a Q3_K row with a Q8_K row -> float32 (ggml_vec_dot_q3_K_q8_K, x86 AVX2).

    w_row: uint8[nb*110]; a_row: uint8[nb*292]; scratch: int32 (unused).  Per block:
    acc[k] = fma(y.d*d, lane k) over (scale-32) * (q2 - (hbit ? 0 : 4)) * q8, the low
    2 bits and the "minus 4" part dotted separately as in ggml.
    """, """d = _f32(y, 0) * f16_le(w, 108)
for j in range(16):
    sc[j] = _q3_scale(w, 96, j)
_unpack_q3_K(qb, qh, w)""", ""),
    "q4_K": ("""Dot of a Q4_K row with a Q8_K row -> float32 (ggml_vec_dot_q4_K_q8_K, x86 AVX2).

    w_row: uint8[nb*144]; a_row: uint8[nb*292]; scratch: int32 (unused).  Per block:
    acc[k] = fma(y.d*d, lane k); four min lanes accm[m] = fma(-y.d*dmin,
    mins[2m]*s[2m] + mins[2m+1]*s[2m+1]) with s[c] = bsums[2c] + bsums[2c+1].
    Result hsum_float_8(acc) + ((accm0+accm2) + (accm1+accm3)).
    """, """yd = _f32(y, 0)
d = yd * f16_le(w, 0)
dmin = -yd * f16_le(w, 2)
_k4_unpack(sc, w, 4)
for m in range(4):
    qa = np.int32(y16[130 + 4 * m]) + np.int32(y16[131 + 4 * m])
    qc = np.int32(y16[132 + 4 * m]) + np.int32(y16[133 + 4 * m])
    acc[8 + m] = fma32(dmin, np.float32(sc[8 + 2 * m] * qa + sc[9 + 2 * m] * qc), acc[8 + m])
_unpack_q4_K(qb, w)""", ""),
    "q5_K": ("""Dot of a Q5_K row with a Q8_K row -> float32 (ggml_vec_dot_q5_K_q8_K, x86 AVX2).

    w_row: uint8[nb*176]; a_row: uint8[nb*292]; scratch: int32 (unused).  Per block:
    acc[k] = fma(y.d*d, lane k); summs = fma(-y.d*dmin, sum_c mins[c]*(bsums[2c] +
    bsums[2c+1]), summs).  Result hsum_float_8(acc) + summs.
    """, """yd = _f32(y, 0)
d = yd * f16_le(w, 0)
dmin = -yd * f16_le(w, 2)
_k4_unpack(sc, w, 4)
msum = np.int32(0)
for c in range(8):
    msum += sc[8 + c] * (np.int32(y16[130 + 2 * c]) + np.int32(y16[131 + 2 * c]))
summs = fma32(dmin, np.float32(msum), summs)
_unpack_q5_K(qb, w)""", ""),
    "q6_K": ("""Dot of a Q6_K row with a Q8_K row -> float32 (ggml_vec_dot_q6_K_q8_K, x86 AVX2).

    w_row: uint8[nb*210]; a_row: uint8[nb*292]; scratch: int32 (unused).  ggml multiplies
    the unsigned 6-bit values (0..63) and takes the -32 offset out afterwards, per lane:
    lane k = sum(scale * q * q8 at positions 4k..4k+3 of each chunk)
             - 32 * (scale[2k]*bsums[2k] + scale[2k+1]*bsums[2k+1]),
    then acc[k] = fma(y.d*d, lane k, acc[k]); result hsum_float_8.
    """, """d = _f32(y, 0) * f16_le(w, 208)
for j in range(16):
    sc[j] = np.int32(np.int8(w[192 + j]))
_unpack_q6_K(qb, w)
for k in range(8):
    # the -32 offset of lane k: sub-blocks 2k, 2k+1 (ggml's q8sclsub), exact int32
    p[k] = -((sc[2 * k] * np.int32(y16[130 + 2 * k])
              + sc[2 * k + 1] * np.int32(y16[131 + 2 * k])) << np.int32(5))""", ""),
    "iq4_xs": ("""Dot of an IQ4_XS row with a Q8_K row -> float32 (ggml_vec_dot_iq4_xs_q8_K, x86 AVX2).

    w_row: uint8[nb*136]; a_row: uint8[nb*292]; scratch: int32 (unused).  Per block:
    acc[k] = fma(fp16(d)*y.d, lane k) over (ls - 32) * kvalues[q] * q8 (dotted as
    (kvalues + 128) * q8 minus 128 * q8, exact int32).
    """, """d = f16_le(w, 0) * _f32(y, 0)
sh = np.int32(w[2]) | (np.int32(w[3]) << np.int32(8))
for ib in range(8):
    iq4_lookup32(qb, 32 * ib, w, 8 + 16 * ib)""", """for ib in range(8):
    ls = (((np.int32(w[4 + ib // 2]) >> np.int32(4 * (ib % 2))) & np.int32(15))
          | (((sh >> np.int32(2 * ib)) & np.int32(3)) << np.int32(4))) - np.int32(32)
    dot32_scaled_add(p, qb, 32 * ib, y, 4 + 32 * ib, ls, ls)
    dot32_scaled_add(p, c128, 0, y, 4 + 32 * ib, -ls, -ls)"""),
}
# what vec_dot adds to hsum_float_8 of its 8 lanes
_VEC_DOT_TAIL = {"four": " + ((acc[8] + acc[10]) + (acc[9] + acc[11]))", "scalar": " + summs"}

for _stem, (_doc, _block, _chunks) in _VEC_DOTS.items():
    _mins = _SB4[_stem][1].get("mins")
    _generate(_VEC_DOT, _stem, dict(block=_block, chunks=_chunks), doc=_doc, nsc=32 if _mins == "lanes" else 16,
              nacc=12 if _mins == "four" else 8, tail=_VEC_DOT_TAIL.get(_mins, ""),
              s_lo="sc[2 * c]" if _SB4[_stem][1]["per_half"] else "sc[c]",
              s_hi="sc[2 * c + 1]" if _SB4[_stem][1]["per_half"] else "sc[c]")


# ---------------------------------------------------------------------------------------
# Many activation rows per call (the matmul, N > 1): rows_dot_T_q8_K(y, m, w_row, a)
# ---------------------------------------------------------------------------------------
# y[n, m] = vec_dot_T_q8_K(w_row, a[n]) for every row n of a, bit for bit: per super-block the
# weight-only work (F16 d / dmin, the scales and mins, the per-lane scale vector sv, the unpacked
# values qb) once, then for each activation row vec_dot's activation-dependent steps in its order
# into the row's 8 accumulators (ROWS_GROUP rows per pass).  Per format (_ROWS): the scales
# code (fills sc, and mins with a min), the unpacking into qb, the lanes call, and d (vec_dot's
# product y.d * F16(d), in its operand order; Q6_K forms it before its bsums step, "d", which
# keeps its kernel's register allocation: the same machine code as its hand-written version).

_ROWS_DOT = """
@kernel(nested=True)
def rows_dot_{w}_q8_K(y, m, w_row, a):
    '''y[n, m] = vec_dot_{w}_q8_K(w_row, a[n]) for every row n of a (bit for bit).

    y: float32[N, M]; w_row: uint8[nb*{WB}]; a: uint8[N, nb*292] (C-contiguous).'''
    nb = w_row.size // {WB}
    rb = a.shape[1]
    c128 = _U8_128  #c128
    p = stack_i32(8)
    p16 = stack_i32(16)
    pm = stack_i32(8)  #min
    sc = carray(stack_i32(16), 16)
    sc32 = carray(stack_i32(16), 16)  #bsums32
    sv = carray(stack_i32(64), 64)
    mins = carray(stack_i32(16), 16)  #min
    qb = carray(stack_u8(256), 256)
    qh = carray(stack_u8(256), 256)  #qh
    accm = stack_f32(256)  #four
    accm_a = carray(accm, 256)  #four
    summs = carray(stack_f32(64), 64)  #scalar
    accs = stack_f32(512)  # 8 lanes x ROWS_GROUP rows
    for g in range(0, a.shape[0], ROWS_GROUP):
        ng = min(ROWS_GROUP, a.shape[0] - g)
        for n in range(ng):
            acc8_zero(ptr_offset(accs, 8 * n))
            summs[n] = np.float32(0.0)  #scalar
        for k in range(4 * ng):  #four
            accm_a[k] = np.float32(0.0)  #four
        for i in range(nb):
            w = w_row[i * {WB}:(i + 1) * {WB}]
            dw = f16_le(w, {D})
            dminw = f16_le(w, {D} + 2)  #min
            {scales}
            _chunk_scales(sv, sc, {per_half})
            {unpack}
            for n in range(ng):
                yo = (g + n) * rb + i * Q8_K_BYTES
                yd = load_f32(a, yo)
                d = yd * dw  #bsums32
                bsums_madd8(pm, mins, a, yo + 260)  #min
                lanes_fma8(ptr_offset(accs, 8 * n), -yd * dminw, pm)  #lanes
                pairs_fma4(ptr_offset(accm, 4 * n), -yd * dminw, pm)  #four
                summs[n] = fma32(-yd * dminw, np.float32(isum8(pm)), summs[n])  #scalar
                bsums_madd8(p, sc32, a, yo + 260)  #bsums32
                acc8_zero(p)  #zero
                {lanes}
                lanes_fma8(ptr_offset(accs, 8 * n), {d}, p)
        for n in range(ng):
            y[g + n, m] = acc8_hsum(ptr_offset(accs, 8 * n)){tail}
"""

# stem: (scales, unpack, lanes[, d]): the weight-only code (indented in the template), the lanes call
_PLAIN_LANES = "_lanes_add(p, p16, qb, a, yo, sv)"
_K4_SCALES = "_k4_unpack(sc, w, 4)\n_k4_min_pairs(mins, sc)"
_ROWS = {
    "q2_K": ("for j in range(16):\n    b = np.int32(w[j])\n    sc[j] = b & np.int32(15)\n    mins[j] = b >> np.int32(4)",
             "_unpack_2bit(qb, w, 16)", _PLAIN_LANES),
    "q3_K": ("for j in range(16):\n    sc[j] = _q3_scale(w, 96, j)", "_unpack_q3_K(qb, qh, w)",
             "_lanes_diff_add(p, p16, qb, qh, 32, a, yo, sv)"),
    "q4_K": (_K4_SCALES, "_unpack_q4_K(qb, w)", _PLAIN_LANES),
    "q5_K": (_K4_SCALES, "_unpack_q5_K(qb, w)", _PLAIN_LANES),
    # sc32: -((s0*b0 + s1*b1) << 5) == (-32*s0)*b0 + (-32*s1)*b1 (int32), vec_dot's p init
    "q6_K": ("for j in range(16):\n    sc[j] = np.int32(np.int8(w[192 + j]))\n    sc32[j] = sc[j] * np.int32(-32)",
             "_unpack_q6_K(qb, w)", _PLAIN_LANES, "d"),
    # each chunk's two scaled dots of vec_dot in one multiply (the same int32 lanes)
    "iq4_xs": ("sh = np.int32(w[2]) | (np.int32(w[3]) << np.int32(8))\nfor ib in range(8):\n"
               "    iq4_lookup32(qb, 32 * ib, w, 8 + 16 * ib)\n"
               "    sc[ib] = (((np.int32(w[4 + ib // 2]) >> np.int32(4 * (ib % 2))) & np.int32(15))\n"
               "              | (((sh >> np.int32(2 * ib)) & np.int32(3)) << np.int32(4))) - np.int32(32)",
               "", "_lanes_diff_add(p, p16, qb, c128, 0, a, yo, sv)", "dw * yd"),
}
# what vec_dot adds to hsum_float_8 of its 8 lanes (row n)
_ROWS_TAIL = {"four": " + ((accm_a[4 * n] + accm_a[4 * n + 2]) + (accm_a[4 * n + 1] + accm_a[4 * n + 3]))",
              "scalar": " + summs[n]"}


for _stem in _SB4:
    _scales, _unpack, _lanes, *_d = _ROWS[_stem]
    _generate(_ROWS_DOT, _stem, dict(scales=_scales, unpack=_unpack), lanes=_lanes, d=_d[0] if _d else "yd * dw",
              tail=_ROWS_TAIL.get(_SB4[_stem][1].get("mins"), ""))


# Two weight rows per call (rows_dot2_T_q8_K: the matmul's groups of two rows, AVX512-VNNI hosts):
# per super-block each row's weight-only work as rows_dot's, then per activation row one
# kquant_ir.make_rows2_step for both (their lanes, products and fmas side by side in vectors, the
# activation read once): each output's operations are rows_dot's, in its order. Q4_K and Q6_K (the
# K-quants of the Q4_K_M models in models.txt).

_ROWS_DOT2 = """
@kernel(nested=True)
def rows_dot2_{w}_q8_K(y, m, w, a):
    '''y[n, m + r] = vec_dot_{w}_q8_K(w[m + r], a[n]) for r < 2 and every row n of a (bit for bit).'''
    nb = w.shape[1] // {WB}
    rb = a.shape[1]
    sc0, sc1 = carray(stack_i32(16), 16), carray(stack_i32(16), 16)
    mn0, mn1 = carray(stack_i32(16), 16), carray(stack_i32(16), 16)
    sv0, sv1 = carray(stack_i32(64), 64), carray(stack_i32(64), 64)
    qb0, qb1 = carray(stack_u8(256), 256), carray(stack_u8(256), 256)
    dv = carray(stack_f32(16), 16)
    dmv = carray(stack_f32(8), 8)
    accs = stack_f32(1024)  # per activation row: 8 lanes of row m, 8 of row m + 1
    accm = stack_f32(512)  # per activation row: row m's four min lanes, row m + 1's
    accm_a = carray(accm, 512)  #four
    for g in range(0, a.shape[0], ROWS_GROUP):
        ng = min(ROWS_GROUP, a.shape[0] - g)
        for n in range(ng):
            acc16_zero(ptr_offset(accs, 16 * n))
            acc8_zero(ptr_offset(accm, 8 * n))
        for i in range(nb):
            w0 = w[m, i * {WB}:(i + 1) * {WB}]
            w1 = w[m + 1, i * {WB}:(i + 1) * {WB}]
            {prep0}
            {prep1}
            for k in range(8):
                dv[k] = f16_le(w0, {D})
                dv[8 + k] = f16_le(w1, {D})
            for k in range(4):  #four
                dmv[k] = f16_le(w0, {D} + 2)  #four
                dmv[4 + k] = f16_le(w1, {D} + 2)  #four
            for n in range(ng):
                _rows2_{w}(accs, 16 * n, accm, 8 * n, qb0, qb1, sv0, sv1, mn0, mn1, dv, dmv, a, (g + n) * rb + i * Q8_K_BYTES)
        for n in range(ng):
            for r in range(2):
                y[g + n, m + r] = acc8_hsum(ptr_offset(accs, 16 * n + 8 * r)){tail2}
"""
# per row r, the weight-only code (rows_dot's scales, unpacking and lane scales; mn_r: the mins
# pairs or -32 * scales)
_ROWS2_PREP = {
    "q4_K": "_k4_unpack(sc{r}, w{r}, 4)\n_k4_min_pairs(mn{r}, sc{r})\n_chunk_scales(sv{r}, sc{r}, False)\n"
            "_unpack_q4_K(qb{r}, w{r})",
    "q6_K": "for j in range(16):\n    sc{r}[j] = np.int32(np.int8(w{r}[192 + j]))\n    mn{r}[j] = sc{r}[j] * np.int32(-32)\n"
            "_chunk_scales(sv{r}, sc{r}, True)\n_unpack_q6_K(qb{r}, w{r})",
}
_ROWS2_TAIL = {"q4_K": (" + ((accm_a[8 * n + 4 * r] + accm_a[8 * n + 4 * r + 2])"
                        " + (accm_a[8 * n + 4 * r + 1] + accm_a[8 * n + 4 * r + 3]))")}
if HAS_VNNI512:
    for _stem, _prep in _ROWS2_PREP.items():
        globals()[f"_rows2_{_stem}"] = make_rows2_step(_SB4[_stem][1]["mins"])
        _generate(_ROWS_DOT2, _stem, dict(prep0=_prep.format(r=0), prep1=_prep.format(r=1)),
                  tail2=_ROWS2_TAIL.get(_stem, ""))
