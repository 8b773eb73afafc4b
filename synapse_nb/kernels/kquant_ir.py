"""LLVM-IR intrinsics of the K-quant dots (kquants.py): super-block lanes and the four-row step.

Per super-block of 256 values, ggml's x86 K-quant dots reduce each 32-value chunk to eight exact
int32 lanes (scale * the 4-value sums of weight * Q8_K activation) and accumulate them per lane
with one fma. The pieces here do that on unpacked weights (dot32_scaled_add, dot64_madd_add,
dot64_diff_scaled_add, fold16_add, lanes_fma8, bsums_madd8, pairs_fma4, isum8, iq4_lookup32: the
single-row vec_dot and the multi-row rows_dot; q8k_bsums, the Q8_K quantizer's block sums), and make_superblock4_dot builds, from a format's
IR readers of its values and scales, the four-row super-block step of vec_dot4.
"""

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .scalar import IQ4NL_TABLE_U8
from . import simd
from .simd import (flat_args, ir_by32, ir_bytes, ir_data, ir_f16_vec_to_f32, ir_fma8, ir_int8x32,
                   ir_intrinsic, ir_lanes, ir_lanes_novnni, ir_load, ir_lookup_nibbles32, ir_prefetch_rows_ahead,
                   ir_shuffle, ir_splat, ir_splat_const, ir_store, ir_vec, ir_vpdpbusd, ir_word)

_I8, _I32, _F32 = ir.IntType(8), ir.IntType(32), ir.FloatType()
_V8I, _V8F = ir.VectorType(_I32, 8), ir.VectorType(_F32, 8)
_V16I, _V16F = ir.VectorType(_I32, 16), ir.VectorType(_F32, 16)


# ---------------------------------------------------------------------------------------------
# K-quant super-block pieces (kquants.py): weights unpacked to uint8 arrays, int32 lane sums.
# ---------------------------------------------------------------------------------------------


@ir_intrinsic(lambda p, qb, qo, ya, yo, s_lo, s_hi: types.void(p, qb, types.intp, ya, types.intp, types.int32,
                                                               types.int32) if flat_args(p, qb, ya) else None)
def dot32_scaled_add(context, builder, sig, args):
    """p[k] += (k < 4 ? s_lo : s_hi) * sum_{i<4} qb[qo+4k+i] * int8(ya[yo+4k+i]), k = 0..7.

    p: int32[8]; qb: uint8 values 0..255 (unpacked weights); ya: the Q8_K activation bytes;
    qo, yo: element offsets of a 32-value chunk; s_lo, s_hi: int32 scales of its two halves.
    Each of p, qb, ya may be an array (a 2-D one C-contiguous, yo then a flat byte offset: row r
    at r * shape[1]) or a raw pointer (stack_*, ptr_offset).
    The 4-value lane sums are those of ggml's maddubs+madd (exact int32), ir_lanes unsigned.
    """
    p_t, qb_t, _, ya_t, _, _, _ = sig.args
    p_v, qb_v, qo_v, ya_v, yo_v, slo_v, shi_v = args
    q8 = ir_int8x32(builder, builder.gep(ir_data(context, builder, qb_t, qb_v), [qo_v]))
    y8 = ir_int8x32(builder, builder.gep(ir_data(context, builder, ya_t, ya_v), [yo_v]))
    lanes = ir_lanes(builder, q8, y8)
    scale = builder.shuffle_vector(ir_splat(builder, slo_v, 8), ir_splat(builder, shi_v, 8),
                                   ir.Constant(_V8I, [0, 1, 2, 3, 12, 13, 14, 15]))
    p_ptr = builder.bitcast(ir_data(context, builder, p_t, p_v, _I32), _V8I.as_pointer())
    builder.store(builder.add(builder.load(p_ptr, align=4), builder.mul(lanes, scale)), p_ptr, align=4)


_V16I = ir.VectorType(_I32, 16)


def _dot64_typer(p16, qb, qo, ya, yo, sv, so):
    return types.void(p16, qb, types.intp, ya, types.intp, sv, types.intp) if flat_args(p16, qb, ya, sv) else None


def _emit_dot64_scaled_add(context, builder, sig, args):
    """dot64_madd_add's portable form (vpdpbusd.512 with AVX512-VNNI, else widening IR):
    p16[j] += sv[so+j] * sum_{i<4} qb[qo+4j+i] * int8(ya[yo+4j+i]), j = 0..15: two consecutive
    32-value chunks at once (lanes 0..7 the first chunk's, 8..15 the second's; one vpdpbusd.512).
    With sv[so+j] the scale of lane j % 8 of chunk j // 8, fold16_add(p, p16) then gives p exactly
    the int32 lanes of dot32_scaled_add on the two chunks (wrapping int32 sums: any order).
    p16, sv: int32[16] (arrays or pointers); qb, ya as in dot32_scaled_add."""
    p_t, qb_t, _, ya_t, _, sv_t, _ = sig.args
    p_v, qb_v, qo_v, ya_v, yo_v, sv_v, so_v = args
    q8 = ir_load(builder, builder.gep(ir_data(context, builder, qb_t, qb_v), [qo_v]), 64)
    y8 = ir_load(builder, builder.gep(ir_data(context, builder, ya_t, ya_v), [yo_v]), 64)
    lanes = ir_lanes(builder, q8, y8)
    sv_ptr = builder.gep(ir_data(context, builder, sv_t, sv_v, _I32), [so_v])
    scale = builder.load(builder.bitcast(sv_ptr, _V16I.as_pointer()), align=4)
    p_ptr = builder.bitcast(ir_data(context, builder, p_t, p_v, _I32), _V16I.as_pointer())
    builder.store(builder.add(builder.load(p_ptr, align=4), builder.mul(lanes, scale)), p_ptr, align=4)



def _maddubs64(builder, u8, a8):
    """vpmaddubsw on <64 x i8> unsigned u8 x signed a8 -> <32 x i16> (word w: u[2w] * a[2w] +
    u[2w+1] * a[2w+1], saturated: exact for u < 128, |a| <= 127): one 512-bit op with AVX512-VNNI
    hosts' AVX512BW, two 256-bit ones with AVX2."""
    i16 = ir.IntType(16)
    fn = cgutils.get_or_insert_function
    if simd.HAS_VNNI512:
        maddubs = fn(builder.module, ir.FunctionType(ir.VectorType(i16, 32), [ir.VectorType(_I8, 64)] * 2),
                     "llvm.x86.avx512.pmaddubs.w.512")
        return builder.call(maddubs, [u8, a8])
    maddubs = fn(builder.module, ir.FunctionType(ir.VectorType(i16, 16), [ir.VectorType(_I8, 32)] * 2),
                 "llvm.x86.avx2.pmadd.ub.sw")
    return ir_by32(builder, lambda u, a: builder.call(maddubs, [u, a]), u8, a8)


def _dpwssd(builder, acc, t, words):
    """acc + (t[2j] * words[2j] + t[2j+1] * words[2j+1]) per int32 lane j (<16 x i32> acc, <32 x i16>
    t and words; exact int32, wrapping): vpdpwssd.512 with AVX512-VNNI, else two vpmaddwd (AVX2)
    and an add."""
    i16 = ir.IntType(16)
    fn = cgutils.get_or_insert_function
    if simd.HAS_VNNI512:
        dpwssd = fn(builder.module, ir.FunctionType(_V16I, [_V16I] * 3), "llvm.x86.avx512.vpdpwssd.512")
        return builder.call(dpwssd, [acc, builder.bitcast(t, _V16I), builder.bitcast(words, _V16I)])
    madd = fn(builder.module, ir.FunctionType(_V8I, [ir.VectorType(i16, 16)] * 2), "llvm.x86.avx2.pmadd.wd")
    halves = [builder.call(madd, [ir_shuffle(builder, t, None, range(h, h + 16)),
                                  ir_shuffle(builder, words, None, range(h, h + 16))]) for h in (0, 16)]
    return builder.add(acc, ir_shuffle(builder, halves[0], halves[1], range(16)))


def _ir_madd_dpwssd(builder, acc, q8, y8, sv16):
    """acc + vpdpwssd(vpmaddubsw(q8, y8), each int32 lane's scale on both its words): <16 x i32>,
    q8 <64 x i8> unsigned values < 128, y8 <64 x i8> signed, sv16 <16 x i32> scales that fit int16
    (dot64_madd_add's and make_rows2_step's integer step; AVX512-VNNI, or AVX2: _maddubs64, _dpwssd)."""
    i16 = ir.IntType(16)
    words = ir_shuffle(builder, builder.trunc(sv16, ir.VectorType(i16, 16)), None, [j // 2 for j in range(32)])
    return _dpwssd(builder, acc, _maddubs64(builder, q8, y8), words)


@ir_intrinsic(_dot64_typer)
def dot64_madd_add(context, builder, sig, args):
    """p16 += the int32 lanes of _emit_dot64_scaled_add (the same exact values) for stored values qb < 128 and
    scales that fit int16 (every K-quant's but Q3_K / IQ4_XS, whose dots are differences): with
    AVX512-VNNI, vpmaddubsw (word w: qb[2w] * a[2w] + qb[2w+1] * a[2w+1] in int16, never
    saturated: |.| <= 2 * 127 * 128) then vpdpwssd of the words with their lane's scale (both
    words of int32 lane j scaled by sv[so+j]), added to p16 in the same op: two instructions
    where vpdpbusd, vpmulld and vpaddd take three (ggml's AVX2 maddubs + madd(scales), fused).
    With AVX2 (no VNNI), ggml's own two vpmaddubsw and two vpmaddwd(scales) per 64 values and an
    add; without either, _emit_dot64_scaled_add's portable code."""
    if not (simd.HAS_VNNI512 or simd.HAS_AVX2):
        return _emit_dot64_scaled_add(context, builder, sig, args)
    p_t, qb_t, _, ya_t, _, sv_t, _ = sig.args
    p_v, qb_v, qo_v, ya_v, yo_v, sv_v, so_v = args
    q8 = ir_load(builder, builder.gep(ir_data(context, builder, qb_t, qb_v), [qo_v]), 64)
    y8 = ir_load(builder, builder.gep(ir_data(context, builder, ya_t, ya_v), [yo_v]), 64)
    sv_ptr = builder.gep(ir_data(context, builder, sv_t, sv_v, _I32), [so_v])
    scale = builder.load(builder.bitcast(sv_ptr, _V16I.as_pointer()), align=4)
    p_ptr = builder.bitcast(ir_data(context, builder, p_t, p_v, _I32), _V16I.as_pointer())
    builder.store(_ir_madd_dpwssd(builder, builder.load(p_ptr, align=4), q8, y8, scale), p_ptr, align=4)


@ir_intrinsic(lambda p16, qb, qo, qh, ho, ya, yo, sv, so: types.void(
    p16, qb, types.intp, qh, types.intp, ya, types.intp, sv, types.intp) if flat_args(p16, qb, qh, ya, sv) else None)
def dot64_diff_scaled_add(context, builder, sig, args):
    """p16[j] += sv[so+j] * (lanes(qb[qo:]) - lanes(qh[ho:]))[j], j = 0..15, with lanes(q) the 4-value
    sums of q * int8(ya[yo:yo+64]) (as dot64_madd_add): for weights stored as a difference of two
    unsigned parts (Q3_K's low bits and "minus 4", IQ4_XS's kvalues + 128 and 128), the int32 lanes
    of dot32_scaled_add(qb, s) then dot32_scaled_add(qh, -s) on each chunk, in one multiply."""
    p_t, qb_t, _, qh_t, _, ya_t, _, sv_t, _ = sig.args
    p_v, qb_v, qo_v, qh_v, ho_v, ya_v, yo_v, sv_v, so_v = args
    y8 = ir_load(builder, builder.gep(ir_data(context, builder, ya_t, ya_v), [yo_v]), 64)
    l1 = ir_lanes(builder, ir_load(builder, builder.gep(ir_data(context, builder, qb_t, qb_v), [qo_v]), 64), y8)
    l2 = ir_lanes(builder, ir_load(builder, builder.gep(ir_data(context, builder, qh_t, qh_v), [ho_v]), 64), y8)
    sv_ptr = builder.gep(ir_data(context, builder, sv_t, sv_v, _I32), [so_v])
    scale = builder.load(builder.bitcast(sv_ptr, _V16I.as_pointer()), align=4)
    p_ptr = builder.bitcast(ir_data(context, builder, p_t, p_v, _I32), _V16I.as_pointer())
    builder.store(builder.add(builder.load(p_ptr, align=4), builder.mul(builder.sub(l1, l2), scale)), p_ptr, align=4)


@ir_intrinsic(lambda p, p16: types.void(p, p16) if flat_args(p, p16) else None)
def fold16_add(context, builder, sig, args):
    """p[k] += p16[k] + p16[8+k], k = 0..7 (int32, wrapping): dot64_madd_add's two chunk halves
    into the 8 lanes."""
    (p_t, p16_t), (p_v, p16_v) = sig.args, args
    v = builder.load(builder.bitcast(ir_data(context, builder, p16_t, p16_v, _I32), _V16I.as_pointer()), align=4)
    lo = builder.shuffle_vector(v, v, ir.Constant(_V8I, list(range(8))))
    hi = builder.shuffle_vector(v, v, ir.Constant(_V8I, list(range(8, 16))))
    p_ptr = builder.bitcast(ir_data(context, builder, p_t, p_v, _I32), _V8I.as_pointer())
    builder.store(builder.add(builder.load(p_ptr, align=4), builder.add(lo, hi)), p_ptr, align=4)


@ir_intrinsic(lambda p16: types.void(p16) if flat_args(p16) else None)
def zero16(context, builder, sig, args):
    """p16[0:16] = 0 (int32[16], array or pointer), as one <16 x i32> store."""
    ptr = builder.bitcast(ir_data(context, builder, sig.args[0], args[0], _I32), _V16I.as_pointer())
    builder.store(ir.Constant(_V16I, [0] * 16), ptr, align=4)


@ir_intrinsic(lambda acc, d, p: types.void(acc, types.float32, p) if flat_args(acc, p) else None)
def lanes_fma8(context, builder, sig, args):
    """acc[k] = fma(d, float32(p[k]), acc[k]) for k = 0..7 (acc: float32[>= 8], p: int32[8], each
    an array or a raw pointer, e.g. ptr_offset(accs, 8 * n)):
    _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(sumi), acc) as one <8 x float> llvm.fma (ir_fma8)."""
    (acc_t, _, p_t), (acc_v, d_v, p_v) = sig.args, args
    lanes = builder.load(builder.bitcast(ir_data(context, builder, p_t, p_v, _I32), _V8I.as_pointer()), align=4)
    ir_fma8(builder, ir_data(context, builder, acc_t, acc_v, _F32), d_v, lanes, splat_first=True)


@ir_intrinsic(lambda p, coef, a, off: types.void(p, coef, a, types.intp) if flat_args(p, coef, a) else None)
def bsums_madd8(context, builder, sig, args):
    """p[k] = coef[2k] * bs[2k] + coef[2k+1] * bs[2k+1], k = 0..7, for the 16 little-endian int16
    bsums bs at byte offset off of a (a Q8_K block's, flat as ir_data) and int32 coef[16]; exact
    int32 (as _mm256_madd_epi16 on ggml's 16-bit operands). p, coef: int32 arrays or pointers."""
    (p_t, c_t, a_t, _), (p_v, c_v, a_v, off_v) = sig.args, args
    v16i = ir.VectorType(_I32, 16)
    bs_ptr = builder.gep(ir_data(context, builder, a_t, a_v), [off_v])
    coef = builder.load(builder.bitcast(ir_data(context, builder, c_t, c_v, _I32), v16i.as_pointer()), align=4)
    p_ptr = builder.bitcast(ir_data(context, builder, p_t, p_v, _I32), _V8I.as_pointer())
    if simd.HAS_AVX2:  # vpmaddwd: the coefficients (mins, -32 * scales) fit int16, as in ggml
        i16x16 = ir.VectorType(ir.IntType(16), 16)
        madd = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V8I, [i16x16] * 2),
                                              "llvm.x86.avx2.pmadd.wd")
        builder.store(builder.call(madd, [ir_load(builder, bs_ptr, 16, ir.IntType(16)), builder.trunc(coef, i16x16)]),
                      p_ptr, align=4)
        return
    bs = builder.sext(ir_load(builder, bs_ptr, 16, ir.IntType(16)), v16i)
    prod = builder.mul(bs, coef)
    undef = ir.Constant(v16i, ir.Undefined)
    even = builder.shuffle_vector(prod, undef, ir.Constant(_V8I, list(range(0, 16, 2))))
    odd = builder.shuffle_vector(prod, undef, ir.Constant(_V8I, list(range(1, 16, 2))))
    builder.store(builder.add(even, odd), p_ptr, align=4)


@ir_intrinsic(lambda acc, d, p: types.void(acc, types.float32, p) if flat_args(acc, p) else None)
def pairs_fma4(context, builder, sig, args):
    """acc[m] = fma(d, float32(p[2m] + p[2m+1]), acc[m]) for m = 0..3 (acc: float32[4], p: int32[8];
    arrays or pointers): four lanes of one <4 x float> llvm.fma, each the scalar fma's bits."""
    (acc_t, _, p_t), (acc_v, d_v, p_v) = sig.args, args
    v4i, v4f = ir.VectorType(_I32, 4), ir.VectorType(_F32, 4)
    lanes = builder.load(builder.bitcast(ir_data(context, builder, p_t, p_v, _I32), _V8I.as_pointer()), align=4)
    undef = ir.Constant(_V8I, ir.Undefined)
    s = builder.add(builder.shuffle_vector(lanes, undef, ir.Constant(v4i, [0, 2, 4, 6])),
                    builder.shuffle_vector(lanes, undef, ir.Constant(v4i, [1, 3, 5, 7])))
    aptr = builder.bitcast(ir_data(context, builder, acc_t, acc_v, _F32), v4f.as_pointer())
    fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v4f, [v4f] * 3), "llvm.fma.v4f32")
    builder.store(builder.call(fma, [ir_splat(builder, d_v, 4), builder.sitofp(s, v4f), builder.load(aptr, align=4)]),
                  aptr, align=4)


@ir_intrinsic(lambda p: types.int32(p) if flat_args(p) else None)
def isum8(context, builder, sig, args):
    """p[0] + ... + p[7] (int32[8], array or pointer; wrapping int32, so the order is immaterial)."""
    v = builder.load(builder.bitcast(ir_data(context, builder, sig.args[0], args[0], _I32), _V8I.as_pointer()), align=4)
    for half in (4, 2, 1):  # a shuffle tree: halves added lane-wise
        lo = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, half), list(range(half))))
        hi = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, half), list(range(half, 2 * half))))
        v = builder.add(lo, hi)
    return builder.extract_element(v, ir.Constant(_I32, 0))


@ir_intrinsic(lambda p, off: types.void(p, types.intp) if flat_args(p) else None)
def q8k_bsums(context, builder, sig, args):
    """A Q8_K block's bsums from its qs: the block at byte off of p (uint8); int16 bsums[j] (bytes
    260 + 2j) = the sum of the 16 int8 qs[16 j .. 16 j + 15] (bytes 4 + ...), exact in int16."""
    p = builder.gep(ir_data(context, builder, sig.args[0], args[0]), [args[1]])
    i16 = ir.IntType(16)
    qs = builder.sext(ir_load(builder, builder.gep(p, [ir.Constant(_I32, 4)]), 256), ir.VectorType(i16, 256))
    v, gs = qs, 16
    while gs > 1:  # each group's first half plus its second half, until one value per group
        half = gs // 2
        lo = [(j // half) * gs + j % half for j in range(16 * half)]
        v = builder.add(ir_shuffle(builder, v, None, lo), ir_shuffle(builder, v, None, [i + half for i in lo]))
        gs = half
    ir_store(builder, v, builder.gep(p, [ir.Constant(_I32, 260)]))


@ir_intrinsic(lambda qb, qo, w, wo: types.void(qb, types.intp, w, types.intp))
def iq4_lookup32(context, builder, sig, args):
    """qb[qo+t] = kvalues_iq4nl[w[wo+t] & 15] + 128, qb[qo+16+t] = ...[w[wo+t] >> 4] + 128, t < 16
    (unsigned bytes for dot32_scaled_add; ir_lookup_nibbles32)."""
    (qb_t, _, w_t, _), (qb_v, qo_v, w_v, wo_v) = sig.args, args
    v = ir_lookup_nibbles32(builder, builder.gep(ir_data(context, builder, w_t, w_v), [wo_v]), IQ4NL_TABLE_U8)
    dst = builder.gep(ir_data(context, builder, qb_t, qb_v), [qo_v])
    builder.store(v, builder.bitcast(dst, v.type.as_pointer()), align=1)


# ---------------------------------------------------------------------------------------------
# Four K-quant weight rows against one Q8_K activation row, one super-block per call
# (kquants.py vec_dot4_T_q8_K): the vector form of the formats' vec_dot per super-block.
# ---------------------------------------------------------------------------------------------


def _madd_pairs(builder, x, y):
    """<2n x i32> x, y -> <n x i32>: x[2i]*y[2i] + x[2i+1]*y[2i+1] (exact for the K-quants' small
    operands; _mm256_madd_epi16)."""
    n = x.type.count
    prod = builder.mul(x, y)
    return builder.add(ir_shuffle(builder, prod, None, range(0, n, 2)), ir_shuffle(builder, prod, None, range(1, n, 2)))


def _lanes64_acc(builder, w8, a8, acc, small=False):
    """acc + the 16 int32 lanes of unsigned w8 x signed a8 (<64 x i8>; vpdpbusd.512 with acc as its
    accumulator, else ir_lanes_novnni, ``small``: w8 <= 128): wrapping int32, the same bits either way."""
    if simd.HAS_VNNI512:
        return ir_vpdpbusd(builder, acc, w8, a8)
    return builder.add(acc, ir_lanes_novnni(builder, w8, a8, False, small))


def make_superblock4_dot(block_bytes, d_off, values, scales, per_half, offset=0, dmin_off=None, mins=None,
                         small_values=True, values2=None, prefetch=True, l2_prefetch=True):
    """Build the four-row super-block intrinsic of a K-quant format (kquants.py vec_dot4_T_q8_K):
        sb4_dot(acc01, acc23, accx, w0, w1, w2, w3, w_off, a_row, a_off)
    does for each row r < 4 exactly the super-block step of the format's vec_dot_T_q8_K: the same
    eight exact int32 lanes p_r (lane k: sum over the 32-value chunks c of scale * the 4-value sums
    at 4k..4k+3), the same float32 roundings per lane, in shared vector operations:
      d_r = y.d * F16(w_r[d_off]) (dmin_r = -y.d * F16(w_r[dmin_off])), four rows in one multiply;
      per row pair (0, 1 / 2, 3) and chunk c one 16-lane step on [row a's chunk c, row b's chunk c]
      against the chunk's 32 activations twice: with ``small_values`` (stored values < 128) and
      AVX512-VNNI, vpmaddubsw (pairs of products in int16: |.| <= 2 * 127 * 128, never saturated)
      then vpdpwssd with the lanes' scales (scale and add in one op; with AVX2: two vpmaddubsw,
      two vpmaddwd with the scales, an add); else vpdpbusd.512 (AVX2: ir_lanes_novnni; portable
      IR), times the scales, added; acc_pair = fma(d, float(lanes), acc_pair).
    Chunks outer, row pairs inner: few live vectors (no spills). Integer lanes are exact, so the
    different groupings give vec_dot's int32 values; each float op is vec_dot's, lane by lane.
    acc01 / acc23: 16 float32 each (rows 0, 1 / 2, 3, lanes 0..7 / 8..15); accx: 16 float32 for
    the min terms (touch all three only with acc16_zero / acc16_hsum / acc16_lane).

    The format (all offsets Python ints, bytes into a block of ``block_bytes``):
      values(builder, p, c) -> <32 x i8>: the unsigned stored values of chunk c (< 8) of the block
        at i8* p, value order; the weight is the value minus ``offset`` (offset * the 4-value
        activation sums is subtracted from each chunk's lanes before its scale: exact, = ggml's
        separate dot of the offset part).
      values2(builder, pa, pb, c) (optional) -> <64 x i8>: values(pa, c) then values(pb, c), when
        a format has a cheaper way to decode both rows at once.
      scales(builder, p) -> (sc, mn): <16 x i32> sub-block scales (per_half: 16, the two halves of
        chunk c scaled by sc[2c], sc[2c+1]; else 8, chunk c by sc[c]) and the mins (<16 x i32> or
        None) for ``mins``:
        "lanes" (Q2_K): each lane first acc = fma(dmin, mn[2k]*bs[2k] + mn[2k+1]*bs[2k+1], acc);
        "four" (Q4_K): accx[4r+m] = fma(dmin_r, mn[2m]*bp[2m] + mn[2m+1]*bp[2m+1], accx[4r+m]);
        "scalar" (Q5_K): accx[r] = fma(dmin_r, sum_c mn[c]*bp[c], accx[r]);
        "bsums32" (Q6_K): the lanes start at -32*(sc[2k]*bs[2k] + sc[2k+1]*bs[2k+1]);
        with bs the Q8_K block's 16 bsums, bp[c] = bs[2c] + bs[2c+1].
    ``prefetch``: fetch the weights ahead (ir_prefetch_rows_ahead), into L2 (simd.L2_PREFETCH) when
    ``l2_prefetch``, else as the 32-value formats' short rows."""
    v16f = _V16F
    i16, i64 = ir.IntType(16), ir.IntType(64)
    if dmin_off is not None:
        assert dmin_off == d_off + 2
    has_min = dmin_off is not None

    @intrinsic
    def sb4_dot(typingctx, acc01, acc23, accx, w0, w1, w2, w3, w_off, a_row, a_off):
        sig = types.void(acc01, acc23, accx, w0, w1, w2, w3, types.intp, a_row, types.intp)

        def codegen(context, builder, signature, args):
            p01, p23, px, r0, r1, r2, r3, wo, a, ao = args
            use_madd = (simd.HAS_VNNI512 or simd.HAS_AVX2) and small_values
            wp = [builder.gep(ir_data(context, builder, signature.args[3 + r], v), [wo])
                  for r, v in enumerate((r0, r1, r2, r3))]
            ap = builder.gep(ir_data(context, builder, signature.args[8], a), [ao])
            if prefetch:  # as make_block4_dot, into L2 and further ahead (simd.L2_PREFETCH)
                ir_prefetch_rows_ahead(builder, wp, wo, block_bytes, **(simd.L2_PREFETCH if l2_prefetch else {}))
            yd = builder.load(builder.bitcast(ap, _F32.as_pointer()), align=1)
            # the rows' F16 d (and dmin) in one conversion and one multiply: dm[di(r)], dm[mi(r)]
            if has_min:
                wf = ir_f16_vec_to_f32(builder, builder.bitcast(ir_vec(builder, [ir_word(builder, p, d_off)
                                                                                 for p in wp]), ir.VectorType(i16, 8)))
                ydv = ir_vec(builder, [yd, builder.fneg(yd)] * 4)
                di, mi = (lambda r: 2 * r), (lambda r: 2 * r + 1)
            else:
                wf = ir_f16_vec_to_f32(builder, ir_vec(builder, [ir_word(builder, p, d_off, 16) for p in wp]))
                ydv = ir_splat(builder, yd, 4)
                di, mi = (lambda r: r), None
            dm = builder.fmul(ydv, wf)
            bs = None
            if mins is not None:
                bs = builder.sext(ir_load(builder, builder.gep(ap, [ir.Constant(i64, 260)]), 16, i16), _V16I)
            scs = [scales(builder, p) for p in wp]
            fma16 = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v16f, [v16f] * 3),
                                                   "llvm.fma.v16f32")
            pairs = ((0, 1), (2, 3))
            lanes, tabs = [], []
            for ra, rb in pairs:
                (sa, _), (sb, _) = scs[ra], scs[rb]
                if mins == "bsums32":
                    m32 = ir_splat_const(_I32, -32, 16)
                    lanes.append(ir_shuffle(builder, _madd_pairs(builder, bs, builder.mul(sa, m32)),
                                            _madd_pairs(builder, bs, builder.mul(sb, m32)), range(16)))
                else:
                    lanes.append(ir.Constant(_V16I, [0] * 16))
                if use_madd:
                    i16x16 = ir.VectorType(i16, 16)
                    tabs.append(ir_shuffle(builder, builder.trunc(sa, i16x16), builder.trunc(sb, i16x16),
                                           range(32)))
                elif per_half:
                    tabs.append(ir_shuffle(builder, sa, sb, range(32)))
                else:  # [a's 8 scales, b's 8]: then a one-source permute per chunk
                    tabs.append(ir_shuffle(builder, sa, sb, list(range(8)) + list(range(16, 24))))

            # the scale of int32 lane L (row a's lanes 0..7, row b's 8..15) of chunk c: entry sidx(c, L)
            # of [row a's 16 scales, row b's 16 scales]
            def sidx(c, L):
                return 16 * (L // 8) + (2 * c + (L % 8) // 4 if per_half else c)

            for c in range(8):  # chunk c's 32 activations twice (one per row of a pair), its offset part
                a64 = ir_shuffle(builder, ir_bytes(builder, ap, 4 + 32 * c, 32), None, list(range(32)) * 2)
                if use_madd:  # -offset * (a[2w] + a[2w+1]) per word (|.| < 2^15)
                    acc0 = None if not offset else builder.sub(
                        ir.Constant(ir.VectorType(i16, 32), [0] * 32),
                        _maddubs64(builder, ir_splat_const(_I8, offset, 64), a64))
                else:
                    acc0 = ir.Constant(_V16I, [0] * 16)
                    if offset:
                        acc0 = builder.sub(acc0, _lanes64_acc(builder, ir_splat_const(_I8, offset, 64), a64, acc0,
                                                               small=offset <= 128))
                for q, (ra, rb) in enumerate(pairs):
                    if values2 is not None:
                        v = values2(builder, wp[ra], wp[rb], c)
                    else:
                        v = ir_shuffle(builder, values(builder, wp[ra], c), values(builder, wp[rb], c), range(64))
                    if use_madd:  # vpmaddubsw (word w: 2 products, no saturation: values < 128) + vpdpwssd
                        t = _maddubs64(builder, v, a64)
                        if offset:
                            t = builder.add(t, acc0)
                        sv = ir_shuffle(builder, tabs[q], None, [sidx(c, L) for L in range(16) for _ in range(2)])
                        lanes[q] = _dpwssd(builder, lanes[q], t, sv)
                    else:
                        sv = ir_shuffle(builder, tabs[q], None, [sidx(c, L) for L in range(16)] if per_half
                                        else [c] * 8 + [8 + c] * 8)
                        lanes[q] = builder.add(lanes[q], builder.mul(sv, _lanes64_acc(builder, v, a64, acc0,
                                                                                      small=small_values)))
            for q, ((ra, rb), accp) in enumerate(zip(pairs, (p01, p23))):
                (_, ma), (_, mb) = scs[ra], scs[rb]
                vptr = builder.bitcast(accp, v16f.as_pointer())
                acc = builder.load(vptr, align=4)
                if mins == "lanes":
                    pm = ir_shuffle(builder, _madd_pairs(builder, bs, ma), _madd_pairs(builder, bs, mb), range(16))
                    dmv = ir_shuffle(builder, dm, None, [mi(ra)] * 8 + [mi(rb)] * 8)
                    acc = builder.call(fma16, [dmv, builder.sitofp(pm, v16f), acc])
                dv = ir_shuffle(builder, dm, None, [di(ra)] * 8 + [di(rb)] * 8)
                builder.store(builder.call(fma16, [dv, builder.sitofp(lanes[q], v16f), acc]), vptr, align=4)
            if mins in ("four", "scalar"):
                bp = _madd_pairs(builder, bs, ir_splat_const(_I32, 1, 16))  # bs[2c] + bs[2c+1]
                # lane m of row r: mn[2m]*bp[2m] + mn[2m+1]*bp[2m+1]
                t = [_madd_pairs(builder, bp, ir_shuffle(builder, mn, None, range(8))) for _, mn in scs]
                mv = ir_shuffle(builder, ir_shuffle(builder, t[0], t[1], range(8)),
                                ir_shuffle(builder, t[2], t[3], range(8)), range(16))  # lane 4r+m
                if mins == "four":
                    dmv = ir_shuffle(builder, dm, None, [mi(r) for r in range(4) for _ in range(4)])
                else:  # lane r: row r's sum (exact int32)
                    one = ir_splat_const(_I32, 1, 16)
                    s4 = _madd_pairs(builder, _madd_pairs(builder, mv, one), ir_splat_const(_I32, 1, 8))
                    mv = ir_shuffle(builder, s4, None, list(range(4)) + [0] * 12)
                    dmv = ir_shuffle(builder, dm, None, [mi(r) for r in range(4)] + [mi(0)] * 12)
                xptr = builder.bitcast(px, v16f.as_pointer())
                builder.store(builder.call(fma16, [dmv, builder.sitofp(mv, v16f), builder.load(xptr, align=4)]),
                              xptr, align=4)
            return context.get_dummy_value()

        return sig, codegen

    return sb4_dot


# ---------------------------------------------------------------------------------------------
# Two K-quant weight rows against one Q8_K activation row, one super-block per call (kquants.py
# rows_dot2_T_q8_K, prefill): rows_dot's per-row step for both rows, the two rows' lanes, scales
# and accumulators side by side in one vector where the single-row step has a half-empty one.
# ---------------------------------------------------------------------------------------------

def make_rows2_step(mins):
    """Build ``rows2_step(accs, ao, accm, mo, qb0, qb1, sv0, sv1, mn0, mn1, dv, dmv, a, yo)``: for
    weight rows r = 0, 1 (super-block unpacked as rows_dot does: qb_r uint8[256] values < 64, sv_r
    int32[64] lane scales, mn_r int32[16] the mins pairs ("four": Q4_K) or -32 * scales
    ("bsums32": Q6_K)) and the Q8_K block at byte yo of a, exactly rows_dot's step:
      "four":    accm[mo + 4r + k] = fma(-yd * dmin_r, float(pm_r[2k] + pm_r[2k+1]), ...), k < 4,
                 pm_r = bsums_madd8(mn_r); lanes_r = the chunk lanes (from 0);
      "bsums32": lanes_r start at bsums_madd8(mn_r) (vec_dot's -32 * scale * bsums);
      then accs[ao + 8r + l] = fma(yd * d_r, float(lanes_r[l]), ...), l < 8,
    with yd the block's float d, dv float32[16] = [d_0 x 8, d_1 x 8] and dmv float32[8] = [dmin_0
    x 4, dmin_1 x 4] (F16 values, converted), every product and fma those of the single-row step
    lane by lane (the products yd * d_r, -yd * dmin_r formed in vector lanes: the same roundings).
    Lanes: vpmaddubsw + vpdpwssd per 64 values (dot64_madd_add; AVX512-VNNI hosts only: kquants
    defines rows_dot2 there), the bsums products by one 512-bit vpmaddwd for both rows."""
    i16, i64 = ir.IntType(16), ir.IntType(64)
    v8f = _V8F

    @intrinsic
    def rows2_step(typingctx, accs, ao, accm, mo, qb0, qb1, sv0, sv1, mn0, mn1, dv, dmv, a, yo):
        if not flat_args(accs, accm, qb0, qb1, sv0, sv1, mn0, mn1, dv, dmv, a):
            return None
        sig = types.void(accs, types.intp, accm, types.intp, qb0, qb1, sv0, sv1, mn0, mn1, dv, dmv, a, types.intp)

        def codegen(context, builder, signature, args):
            t = signature.args
            accv, aov, accmv, mov, q0, q1, s0, s1, n0, n1, dvv, dmvv, av, yov = args

            def ptr(k, v, elt=_I8):
                return ir_data(context, builder, t[k], v, elt)

            def vload(p, off, ty):
                return ir_load(builder, builder.gep(p, [off]), ty.count, ty.element)

            def c64(x):
                return ir.Constant(i64, x)

            fn = cgutils.get_or_insert_function
            pmaddwd = fn(builder.module, ir.FunctionType(_V16I, [ir.VectorType(i16, 32)] * 2),
                         "llvm.x86.avx512.pmaddw.d.512")
            fma16 = fn(builder.module, ir.FunctionType(_V16F, [_V16F] * 3), "llvm.fma.v16f32")
            fma8 = fn(builder.module, ir.FunctionType(v8f, [v8f] * 3), "llvm.fma.v8f32")
            ap = builder.gep(ptr(12, av), [yov])
            yd = builder.load(builder.bitcast(ap, _F32.as_pointer()), align=1)
            bs = vload(ap, c64(260), ir.VectorType(i16, 16))
            bs2 = ir_shuffle(builder, bs, None, list(range(16)) * 2)
            coef = ir_shuffle(builder, builder.trunc(vload(ptr(8, n0, _I32), c64(0), _V16I), ir.VectorType(i16, 16)),
                              builder.trunc(vload(ptr(9, n1, _I32), c64(0), _V16I), ir.VectorType(i16, 16)), range(32))
            pm = builder.call(pmaddwd, [bs2, coef])  # [row 0's 8 lanes, row 1's 8 lanes]
            if mins == "four":
                s = builder.add(ir_shuffle(builder, pm, None, range(0, 16, 2)), ir_shuffle(builder, pm, None, range(1, 16, 2)))
                dmn = builder.fmul(ir_splat(builder, builder.fneg(yd), 8), vload(ptr(11, dmvv, _F32), c64(0), v8f))
                mptr = builder.bitcast(builder.gep(ptr(2, accmv, _F32), [mov]), v8f.as_pointer())
                builder.store(builder.call(fma8, [dmn, builder.sitofp(s, v8f), builder.load(mptr, align=4)]), mptr,
                              align=4)
                init = ir.Constant(_V16I, [0] * 16)
            else:  # bsums32: the lanes start at the bsums products
                init = pm
            p16 = []
            for q, sv in ((q0, s0), (q1, s1)):
                qp, sp = ptr(4 + len(p16), q), ptr(6 + len(p16), sv, _I32)
                acc = ir.Constant(_V16I, [0] * 16)
                for c in range(0, 8, 2):
                    acc = _ir_madd_dpwssd(builder, acc, vload(qp, c64(32 * c), ir.VectorType(_I8, 64)),
                                          vload(ap, c64(4 + 32 * c), ir.VectorType(_I8, 64)),
                                          vload(sp, c64(8 * c), _V16I))
                p16.append(acc)
            lo = ir_shuffle(builder, p16[0], p16[1], list(range(8)) + list(range(16, 24)))
            hi = ir_shuffle(builder, p16[0], p16[1], list(range(8, 16)) + list(range(24, 32)))
            lanes = builder.add(init, builder.add(lo, hi))
            d16 = builder.fmul(ir_splat(builder, yd, 16), vload(ptr(10, dvv, _F32), c64(0), _V16F))
            aptr = builder.bitcast(builder.gep(ptr(0, accv, _F32), [aov]), _V16F.as_pointer())
            builder.store(builder.call(fma16, [d16, builder.sitofp(lanes, _V16F), builder.load(aptr, align=4)]), aptr,
                          align=4)
            return context.get_dummy_value()

        return sig, codegen

    return rows2_step
