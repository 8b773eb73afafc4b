"""LLVM-IR intrinsics of the 32-value block formats and of the float rows (legacy.py's kernels).

Built from simd.py's emitters: one block's integer lanes and fma (make_block_lanes_fma), the
four-row block step of a matvec (make_block4_dot), a block's dequantization (make_block_dequant),
and the four-row F32 / F16 / BF16 steps with their reductions (float4_fma, bf16x4_dot, reduce16,
reduce64), each reproducing one step of ggml-cpu's x86 vec_dot (lane order and roundings
included) for the rows it covers.
"""

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from . import simd
from .simd import (flat_args, ir_add_const, ir_data, ir_f16_vec_to_f32, ir_fma8, ir_int8x32, ir_lanes_offset,
                   ir_load, ir_prefetch_rows_ahead, ir_prefetch_rows_ahead_by_length,
                   ir_reduce_add_16, ir_splat, ir_vpdpbusd)

_I8, _I32, _F32 = ir.IntType(8), ir.IntType(32), ir.FloatType()


# ---------------------------------------------------------------------------------------------
# One 32-value block of an integer dot, in explicit LLVM vector IR.
#
# Numba leaves LLVM's SLP vectorizer off and fully unrolls 16/32-trip inner loops, so a per-block
# loop compiles to scalar code. ggml's x86 dots are per block anyway: 32 int8 weight values x 32
# int8 activations, products summed in groups of 4 into 8 int32 lanes (maddubs + madd), lanes
# converted to float and accumulated with one fma each. ``make_block_lanes_fma(decode)`` builds
# an intrinsic doing exactly that for one block, with ``decode(builder, wblock_ptr)`` producing
# the 32 weight values as <32 x i32> for a format:
#     block_lanes_fma(acc_ptr, d, w_row, w_off, a_row, a_off)
#     acc[l] = fma(d, float(sum_{k<4} w[4l+k] * a[a_off + 4l + k]), acc[l])   for l in 0..7
# acc_ptr points to 8 float32 (stack_f32(8)); w_off is the block's byte offset in w_row, a_off
# the offset of the block's 32 int8 activations in a_row. The integer part is exact.
# ---------------------------------------------------------------------------------------------

def make_block_lanes_fma(decode, offset, u_max=255):
    """Build the block intrinsic for a weight decoder (see the comment above). ``decode(builder,
    wblock_ptr)`` returns the block's 32 weights as <32 x i8> unsigned codes u (0..u_max), the
    weights being u - offset (ir_lanes_offset)."""

    @intrinsic
    def block_lanes_fma(typingctx, acc_ptr, d, w_row, w_off, a_row, a_off):
        sig = types.void(acc_ptr, types.float32, w_row, types.intp, a_row, types.intp)

        def codegen(context, builder, signature, args):
            accp, dval, w, wo, a, ao = args
            wdata = ir_data(context, builder, signature.args[2], w)
            adata = ir_data(context, builder, signature.args[4], a)
            w8 = decode(builder, builder.gep(wdata, [wo]))
            a8 = ir_int8x32(builder, builder.gep(adata, [ao]))
            ir_fma8(builder, accp, dval, ir_lanes_offset(builder, w8, a8, offset, u_max))
            return context.get_dummy_value()

        return sig, codegen

    return block_lanes_fma


@intrinsic
def prefetch4_ahead(typingctx, w0, w1, w_off, block_bytes):
    """Prefetch the stream of four adjacent weight rows (w0, w1: the first two of them, rows of
    one 2-D array) ahead of a block step at byte offset w_off, into L1 as the matvec's block4_dot
    does for short rows (simd.ir_prefetch_rows_ahead; block_bytes: a literal int, the format's
    block size; the matvec's L2 rule for long rows measured no clear gain here: a few activation
    rows are bound by their arithmetic). For a matmul's several-row kernels (rows_dot8 /
    rows_dot4): once per weight block, however many activation rows the block then serves. It
    changes no value."""
    if not isinstance(block_bytes, types.IntegerLiteral):
        return None
    nbytes = block_bytes.literal_value
    sig = types.void(w0, w1, types.intp, block_bytes)

    def codegen(context, builder, signature, args):
        p0, p1, wo, _ = args
        wp = [builder.gep(ir_data(context, builder, signature.args[r], v), [wo]) for r, v in enumerate((p0, p1))]
        ir_prefetch_rows_ahead(builder, wp, wo, nbytes)
        return context.get_dummy_value()

    return sig, codegen


def make_block4_dot(decode2, offset, d_off, with_min, a_d_off, a_q_off, block_bytes, prefetch=True,
                    many_rows=False, u_max=255):
    """Build the four-row block intrinsic of a 32-value block format:
        block4_dot(acc01, acc23, sums, w0, w1, w2, w3, w_off, a_row, a_off)
    does for each row r < 4 exactly what one block of the format's vec_dot does (same integer
    lanes, same roundings), with the rows' scalars and lanes in vectors:
      d_r = F16(w_r[w_off + d_off]) * F16(a[a_off + a_d_off])    (two rows' products in one 16-lane vmulps;
                                                                  on AVX2 the four in one, _products8)
      acc_r[l] = fma(d_r, float(lanes_r[l]), acc_r[l]), l < 8         (two rows per 16-lane op)
      with_min: sums[2r+1] = fma(F16(m_r), F16(s), sums[2r+1]), m_r at w_off + d_off + 2 and s at
      a_off + a_d_off + 2 (the even lanes of sums hold junk: read only the odd ones).
    acc01 / acc23: 16 float32 each (rows 0, 1 / 2, 3: lanes 0..7 / 8..15), sums: 8 float32 (stack
    buffers; touch them only with acc16_zero / acc16_hsum / acc8_zero / acc8_lane).
    ``decode2(builder, p0, p1)`` gives two blocks' 32 weights each as one <64 x i8> of unsigned
    codes u (0..u_max), the weights being u - offset (ir_lanes_offset); block_bytes: the format's
    block size.
    ``prefetch``: fetch the weights ahead (a matvec streams them; a matmul
    re-reads each block for many rows). ``many_rows`` (a matmul: the same weight blocks against
    many activation rows, rows_dot8): with AVX512-VNNI and an offset, the lanes are formed as
    sum (a + 128) * w - 128 * sum w (a + 128: the activation byte read unsigned, a ^ 0x80; w =
    u - offset, signed), the weight-only 128 * sum w computed once per block for all the rows,
    where the matvec form subtracts offset * sum a per activation row (ir_lanes_offset): the
    same exact int32 lanes, one vpdpbusd and two vector ops fewer per activation row."""
    v8f, v16f = ir.VectorType(_F32, 8), ir.VectorType(_F32, 16)
    i16, i32 = ir.IntType(16), _I32

    @intrinsic
    def block4_dot(typingctx, acc01, acc23, sums, w0, w1, w2, w3, w_off, a_row, a_off):
        sig = types.void(acc01, acc23, sums, w0, w1, w2, w3, types.intp, a_row, types.intp)

        def codegen(context, builder, signature, args):
            p01, p23, ps, r0, r1, r2, r3, wo, a, ao = args
            wp = [builder.gep(ir_data(context, builder, signature.args[3 + r], v), [wo])
                  for r, v in enumerate((r0, r1, r2, r3))]
            ap = builder.gep(ir_data(context, builder, signature.args[8], a), [ao])
            # The four rows (adjacent in memory) are read side by side, each slowly (one block a
            # step): the hardware prefetchers lose track of them (4 blocks a step: two lines,
            # three for Q8_0's 136 bytes)
            if prefetch:  # into L1, or into L2 for long rows (simd.L2_PREFETCH)
                ir_prefetch_rows_ahead_by_length(builder, wp, wo, block_bytes)
            def at(ptr, off, ty):
                return builder.load(builder.bitcast(builder.gep(ptr, [ir.Constant(ir.IntType(64), off)]),
                                                    ty.as_pointer()), align=1)

            if with_min:  # (d, m) of each row as one i32: [d0, m0, d1, m1, ...] after the conversion
                wv = ir.Constant(ir.VectorType(i32, 4), ir.Undefined)
                for r in range(4):
                    wv = builder.insert_element(wv, at(wp[r], d_off, i32), ir.Constant(i32, r))
                wf = ir_f16_vec_to_f32(builder, builder.bitcast(wv, ir.VectorType(i16, 8)))
                av = ir_splat(builder, at(ap, a_d_off, i32), 4)
                af = ir_f16_vec_to_f32(builder, builder.bitcast(av, ir.VectorType(i16, 8)))
                fma8 = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v8f, [v8f] * 3), "llvm.fma.v8f32")
                sptr = builder.bitcast(ps, v8f.as_pointer())
                builder.store(builder.call(fma8, [wf, af, builder.load(sptr, align=4)]), sptr, align=4)
                pick = (0, 2, 4, 6)
            else:
                wv = ir.Constant(ir.VectorType(i16, 4), ir.Undefined)
                for r in range(4):
                    wv = builder.insert_element(wv, at(wp[r], d_off, i16), ir.Constant(i32, r))
                wf = ir_f16_vec_to_f32(builder, wv)
                af = ir_f16_vec_to_f32(builder, ir_splat(builder, at(ap, a_d_off, i16), 4))
                pick = (0, 1, 2, 3)
            a32 = ir_int8x32(builder, builder.gep(ap, [ir.Constant(ir.IntType(64), a_q_off)]))
            a64 = builder.shuffle_vector(a32, a32, ir.Constant(ir.VectorType(_I32, 64), list(range(32)) * 2))
            fma16 = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v16f, [v16f] * 3), "llvm.fma.v16f32")
            # d of rows 2 pair, 2 pair + 1 spread over their 8 lanes each, times da: the weight side
            # alone is spread, so that a kernel running many activation rows on the same weight
            # blocks (rows_dot8) spreads it once (each lane the product F16(dw) * F16(da), as before)
            af16 = builder.shuffle_vector(af, af, ir.Constant(ir.VectorType(_I32, 16), [0] * 16))
            weight_bias = many_rows and offset and simd.HAS_VNNI512
            if weight_bias:
                a64u = builder.xor(a64, ir.Constant(a64.type, [0x80] * 64))
                zero = ir.Constant(ir.VectorType(_I32, 16), [0] * 16)
                c128 = ir.Constant(ir.VectorType(_I8, 64), [0x80] * 64)
            # (a matmul's rows_dot8 keeps the 16-lane products: with the asm statement below LLVM no
            # longer hoists its weight decoding out of the activation rows' loop: 2x slower)
            spread = simd.avx2_path() and not many_rows
            if spread:
                d8 = _products8(builder, wf, af, pick)
            for pair, accp in ((0, p01), (1, p23)):
                w8 = decode2(builder, wp[2 * pair], wp[2 * pair + 1])
                if weight_bias:
                    ws8 = ir_add_const(builder, w8, -offset)
                    init = builder.sub(zero, ir_vpdpbusd(builder, zero, c128, ws8))
                    lanes = ir_vpdpbusd(builder, init, a64u, ws8)
                else:
                    lanes = ir_lanes_offset(builder, w8, a64, offset, u_max)
                if not spread:
                    i0, i1 = pick[2 * pair], pick[2 * pair + 1]
                    wv16 = builder.shuffle_vector(wf, wf, ir.Constant(ir.VectorType(_I32, 16), [i0] * 8 + [i1] * 8))
                    dv = builder.fmul(wv16, af16)
                else:  # d8 lanes r and r + 4 hold row r's product: an in-lane vpermilps spreads it
                    r0, r1 = 2 * pair, 2 * pair + 1
                    dv = builder.shuffle_vector(d8, d8, ir.Constant(ir.VectorType(_I32, 16),
                                                                    [r0] * 4 + [r0 + 4] * 4 + [r1] * 4 + [r1 + 4] * 4))
                vptr = builder.bitcast(accp, v16f.as_pointer())
                acc = builder.load(vptr, align=4)
                builder.store(builder.call(fma16, [dv, builder.sitofp(lanes, v16f), acc]), vptr, align=4)
            return context.get_dummy_value()

        return sig, codegen

    return block4_dot


def _products8(builder, wf, af, pick):
    """<8 x float>: the four rows' products d_r = (wf * af)[pick[r]] (one vmulps; each lane the
    product the 16-lane form makes) twice, d_r in lanes r and r + 4, so that an in-lane shuffle
    (vpermilps) spreads one row's d over 8 lanes. On AVX2 (without AVX-512) LLVM otherwise makes
    each row's product a scalar vmulss and a broadcast (three vector ops a row instead of one): the
    four-row matvec of the 32-value formats 7-10 % faster on an AVX2 host (Zen 3). The products pass
    through an empty asm statement that LLVM cannot look into (it reads and writes no memory),
    which keeps the vector form."""
    prod = builder.fmul(wf, af)
    v8f = ir.VectorType(_F32, 8)
    d8 = builder.shuffle_vector(prod, prod, ir.Constant(ir.VectorType(_I32, 8), list(pick) * 2))
    opaque = ir.InlineAsm(ir.FunctionType(v8f, [v8f]), "", "=x,0", side_effect=False)
    return builder.call(opaque, [d8], attrs=("nounwind", "readnone"))


def _rows4_step(context, builder, sig, args, size):
    """The four weight rows' pointers (i8*) at a 64-element step of a four-row float kernel
    (args: acc, w0, w1, w2, w3, i, x; values of ``size`` bytes), their prefetch emitted (into L2,
    simd.L2_PREFETCH), and the step's byte offset."""
    off = builder.mul(args[5], args[5].type(size))
    wp = [builder.gep(ir_data(context, builder, sig.args[1 + r], args[1 + r]), [off]) for r in range(4)]
    ir_prefetch_rows_ahead(builder, wp, off, 64 * size, **simd.L2_PREFETCH)
    return wp, off


def _acc_ptr(context, builder, aty, aval, k, n):
    """Pointer to the n float32 at acc[k] (k: a Python int or an i64 value) as <n x float>*."""
    base = ir_data(context, builder, aty, aval, _F32)
    off = ir.Constant(ir.IntType(64), k) if isinstance(k, int) else k
    return builder.bitcast(builder.gep(base, [off]), ir.VectorType(_F32, n).as_pointer())


def _make_reduce(parts):
    """An intrinsic reduce(acc, k) -> float32 of acc[k:k + 16 * parts] (float32 array or pointer):
    parts 1: _mm512_reduce_add_ps (ir_reduce_add_16); parts 4: ggml_vec_dot_f32 / _f16's AVX-512
    reduction of its four 16-lane accumulators, (acc0 + acc2) + (acc1 + acc3) lane-wise, then
    _mm512_reduce_add_ps. In vector operations."""

    def reduce(typingctx, acc, k):
        if not (isinstance(k, types.Integer) and flat_args(acc)):
            return None
        sig = types.float32(acc, k)

        def codegen(context, builder, signature, args):
            k = context.cast(builder, args[1], signature.args[1], types.int64)
            v = [builder.load(_acc_ptr(context, builder, signature.args[0], args[0], builder.add(k, k.type(16 * q)), 16),
                              align=4) for q in range(parts)]
            if parts == 4:
                v = [builder.fadd(builder.fadd(v[0], v[2]), builder.fadd(v[1], v[3]))]
            return ir_reduce_add_16(builder, v[0])

        return sig, codegen

    reduce.__name__ = reduce.__qualname__ = f"reduce{16 * parts}"
    return intrinsic(reduce)


reduce16 = _make_reduce(1)
reduce64 = _make_reduce(4)


@intrinsic
def float4_fma(typingctx, acc, w0, w1, w2, w3, i, x):
    """float4_fma(acc, w0, w1, w2, w3, i, x): one 64-element step of the four-row F32 or F16 dot:
        acc[64 r + t] = fma(w_r[i + t], x[i + t], acc[64 r + t]),  r < 4, t < 64
    in <64 x float> operations (each four zmm): the lanes of ggml_vec_dot_f32 / _f16's AVX-512
    loop (GGML_F32_STEP 64) for four weight rows at once, x loaded (and converted) once for them.
    x: the activation row, float32 (F32) or uint16 (F16 bits, converted exactly); w_r: the rows
    (uint8, adjacent in memory) of values of x's type; acc: float32 [256]; i: the element offset
    of the step. The rows are prefetched ahead into L2 (_rows4_step, simd.L2_PREFETCH)."""
    if not (isinstance(x, types.Array) and x.dtype in (types.float32, types.uint16) and flat_args(acc, w0, w1, w2, w3)):
        return None
    half = x.dtype == types.uint16
    elt, size = (ir.IntType(16), 2) if half else (_F32, 4)
    v64f = ir.VectorType(_F32, 64)
    sig = types.void(acc, w0, w1, w2, w3, types.intp, x)

    def codegen(context, builder, signature, args):
        wp, off = _rows4_step(context, builder, signature, args, size)

        def load(p_i8):
            v = ir_load(builder, p_i8, 64, elt, size)
            return ir_f16_vec_to_f32(builder, v) if half else v

        xf = load(builder.gep(ir_data(context, builder, signature.args[6], args[6]), [off]))
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v64f, [v64f] * 3), "llvm.fma.v64f32")
        for r in range(4):
            ap = _acc_ptr(context, builder, signature.args[0], args[0], 64 * r, 64)
            builder.store(builder.call(fma, [load(wp[r]), xf, builder.load(ap, align=4)]), ap, align=4)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def bf16x4_dot(typingctx, acc, w0, w1, w2, w3, i, x):
    """bf16x4_dot(acc, w0, w1, w2, w3, i, x): one 64-element step of the four-row BF16 dot:
        acc[32 r + t] = (acc[32 r + t] + w_r[i+2t+1] * x[i+2t+1]) + w_r[i+2t] * x[i+2t],  t < 32
    (vec_dot_bf16's lanes: each product rounded to float32, then added; BF16 values widened
    exactly) in <32 x float> operations, for four weight rows at once, x converted once for them.
    x: uint16 BF16 bits; w_r: uint8 rows of BF16 values (adjacent in memory); acc: float32 [128];
    i: the element offset of the step. The rows are prefetched ahead, as float4_fma's."""
    if not (isinstance(x, types.Array) and x.dtype == types.uint16 and flat_args(acc, w0, w1, w2, w3)):
        return None
    sig = types.void(acc, w0, w1, w2, w3, types.intp, x)
    v32i = ir.VectorType(_I32, 32)

    def codegen(context, builder, signature, args):
        wp, off = _rows4_step(context, builder, signature, args, 2)

        def load(p_i8):  # (odd, even) elements as float32: the high and the low half of each pair
            v = ir_load(builder, p_i8, 32, _I32, 2)
            return (builder.bitcast(builder.and_(v, ir.Constant(v32i, [-65536] * 32)), ir.VectorType(_F32, 32)),
                    builder.bitcast(builder.shl(v, ir.Constant(v32i, [16] * 32)), ir.VectorType(_F32, 32)))

        xo, xe = load(builder.gep(ir_data(context, builder, signature.args[6], args[6]), [off]))
        for r in range(4):
            wo, we = load(wp[r])
            ap = _acc_ptr(context, builder, signature.args[0], args[0], 32 * r, 32)
            a = builder.fadd(builder.load(ap, align=4), builder.fmul(wo, xo))
            builder.store(builder.fadd(a, builder.fmul(we, xe)), ap, align=4)
        return context.get_dummy_value()

    return sig, codegen


def make_block_dequant(decode, with_min):
    """Build ``block_dequant(out, o_off, d, m, w_row, w_off)`` for a 32-value block format:
    out[o_off + j] = float(q_j) * d (+ m when ``with_min``), j < 32, with the q_j from
    ``decode(builder, wblock_ptr)`` (<32 x i8>, as for make_block_lanes_fma; values of unsigned
    formats are < 128). One rounding for the product and one for the sum, as
    ggml-quants.c dequantize_row_* (x*d, x*d + m; never fused)."""

    @intrinsic
    def block_dequant(typingctx, out, o_off, d, m, w_row, w_off):
        sig = types.void(out, types.intp, types.float32, types.float32, w_row, types.intp)

        def codegen(context, builder, signature, args):
            o, oo, dval, mval, w, wo = args
            v32f = ir.VectorType(_F32, 32)
            q = decode(builder, builder.gep(ir_data(context, builder, signature.args[4], w), [wo]))
            r = builder.fmul(builder.sitofp(q, v32f), ir_splat(builder, dval, 32))
            if with_min:
                r = builder.fadd(r, ir_splat(builder, mval, 32))
            dst = builder.gep(ir_data(context, builder, signature.args[0], o, _F32), [oo])
            builder.store(r, builder.bitcast(dst, v32f.as_pointer()), align=4)
            return context.get_dummy_value()

        return sig, codegen

    return block_dequant


