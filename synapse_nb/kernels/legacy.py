"""Row kernels for the non-K formats: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL.

Two kinds of ``@kernel(nested=True)`` functions (called by the drivers of matmul.py only), output
first, on raw GGUF bytes:
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

Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (and IQ4_NL's dequantize) differ only in their block layout, so their
row functions are generated from one template each (_DEQUANTIZE, _VEC_DOT, _ROWS_DOT, _VEC_DOT4,
_ROWS_DOT4, _ROWS_DOT8) and the table _BLOCK_FORMATS; the per-block vector work is an intrinsic per format
built in block_ir.py from the format's IR decoder (_decode_T one block, _decode2_T two blocks).

Several weight rows at once, each output still computed by vec_dot's operations in vec_dot's order:
  * vec_dot4_T(y, m, w, a_row): y[m..m+3] for one activation row (decode). One row's dot is bound
    by the latency of its fma chain and by scalar F16 work; four rows share the scalar work in
    vector ops (4 F16 scales converted and multiplied at once), run two rows per 16-lane vpdpbusd
    and overlap four accumulator chains, and prefetch the rows ahead (make_block4_dot).
  * rows_dot8_T(y, m, w, a): y[:, m..m+7] for all activation rows (prefill): vec_dot4's block
    operation twice for each activation row, sharing its loads and conversions, the weight side of
    a block computed once for all of them (Q5_0 matmul 1.12-1.17x over one 4-row operation per
    activation row, 1 thread, same-minute pairs). IQ4_NL has rows_dot4 (its even / odd sets).
  * F32, F16, BF16: vec_dot4 in explicit vector IR (block_ir.float4_fma / bf16x4_dot: the rows' lanes
    in registers, the activation converted once for the four), their reductions too
    (block_ir.reduce64 / reduce16); rows_dot4 is vec_dot4 for one activation row after another.
"""

import numpy as np
from llvmlite import ir
from numba import carray

from ..formats import format_of
from .block_ir import (bf16x4_dot, float4_fma, make_block4_dot, make_block_dequant, make_block_lanes_fma,
                       prefetch4_ahead, reduce16, reduce64)
from .decorator import kernel
from .scalar import IQ4NL_TABLE_U8, KVALUES_IQ4NL, as_f32, copy_u32, f16_le, f16_to_f32, fma32, u32_as_f32  # noqa: F401
from .simd import (ROWS_GROUP, acc8_add, acc8_hsum, acc8_lane, acc8_zero, acc16_add, acc16_hsum,  # noqa: F401
                   acc16_zero, ir_add_const, ir_high_bits32, ir_high_bits64, ir_int8x32, ir_lookup64,
                   ir_lookup_nibbles32, ir_nibbles32, ir_nibbles64, ptr_offset, stack_f32, store4_hsum,
                   store4_hsum_sums)  # (F401: some are used by the generated code only)


# ----------------------------------------------------------------------------------------------
# Dequantize (ggml-quants.c dequantize_row_*; gguf.quants.dequantize); the 32-value block formats'
# are generated below (_DEQUANTIZE).
# ----------------------------------------------------------------------------------------------


@kernel(nested=True)
def dequantize_row_f32(out, w_row):
    """F32 bytes -> float32 (copy)."""
    copy_u32(out.view(np.uint32), w_row.view(np.uint32))


@kernel(nested=True)
def dequantize_row_f16(out, w_row):
    """F16 -> float32, exact (ggml_cpu_fp16_to_fp32)."""
    wh = w_row.view(np.uint16)
    for i in range(out.size):
        out[i] = f16_to_f32(wh[i])


@kernel(nested=True)
def dequantize_row_bf16(out, w_row):
    """BF16 -> float32, exact (ggml_cpu_bf16_to_fp32)."""
    wh = w_row.view(np.uint16)
    ob = out.view(np.uint32)
    for i in range(out.size):
        ob[i] = np.uint32(wh[i]) << np.uint32(16)


# ----------------------------------------------------------------------------------------------
# Dot products of the 32-value block formats. The per-block integer work (decode 32 weights,
# multiply by the 32 int8 activations, sum groups of 4 into 8 lanes, convert, fma into 8 float
# accumulators) is one explicit-vector LLVM intrinsic per format (block_ir.make_block_lanes_fma);
# the block loop, the F16 scales and the final reduction are plain Numba.
# ----------------------------------------------------------------------------------------------


def _gep(builder, ptr, k):
    return builder.gep(ptr, [ir.Constant(ir.IntType(64), k)])


# The decoders give each weight's unsigned code u (0..255): the weight is u - offset, offset
# per format in _BLOCK_FORMATS (ggml's signed values, e.g. q - 8, are not formed: see
# simd.ir_lanes_offset).
def _decode_q4_0(b, p):
    return ir_nibbles32(b, _gep(b, p, 2))


def _decode_q4_1(b, p):
    return ir_nibbles32(b, _gep(b, p, 4))


def _decode_q5_0(b, p):
    return b.or_(ir_nibbles32(b, _gep(b, p, 6)), ir_high_bits32(b, _gep(b, p, 2)))


def _decode_q5_1(b, p):
    return b.or_(ir_nibbles32(b, _gep(b, p, 8)), ir_high_bits32(b, _gep(b, p, 4)))


def _decode_q8_0(b, p):
    return ir_add_const(b, ir_int8x32(b, _gep(b, p, 2)), 128)


def _decode_iq4_nl(b, p):
    return ir_lookup_nibbles32(b, _gep(b, p, 2), IQ4NL_TABLE_U8)


def _concat64(b, v0, v1):
    return b.shuffle_vector(v0, v1, ir.Constant(ir.VectorType(ir.IntType(32), 64), list(range(64))))


def _decode2_q4_0(b, p0, p1):
    return ir_nibbles64(b, _gep(b, p0, 2), _gep(b, p1, 2))


def _decode2_q4_1(b, p0, p1):
    return ir_nibbles64(b, _gep(b, p0, 4), _gep(b, p1, 4))


def _decode2_q5_0(b, p0, p1):
    hb = ir_high_bits64(b, _gep(b, p0, 2), _gep(b, p1, 2))
    return b.or_(ir_nibbles64(b, _gep(b, p0, 6), _gep(b, p1, 6)), hb)


def _decode2_q5_1(b, p0, p1):
    hb = ir_high_bits64(b, _gep(b, p0, 4), _gep(b, p1, 4))
    return b.or_(ir_nibbles64(b, _gep(b, p0, 8), _gep(b, p1, 8)), hb)


def _decode2_q8_0(b, p0, p1):
    return ir_add_const(b, _concat64(b, ir_int8x32(b, _gep(b, p0, 2)), ir_int8x32(b, _gep(b, p1, 2))), 128)


def _decode2_iq4_nl(b, p0, p1):
    return ir_lookup64(b, ir_nibbles64(b, _gep(b, p0, 2), _gep(b, p1, 2)), IQ4NL_TABLE_U8)


# The 32-value block formats, one line each: (stem, its activation format's stem, block bytes,
# activation block bytes (both from the one table of sizes, through formats), offset of the 32 int8
# activations in their block, the weights' offset (weight = code - offset), a min m per block
# (Q4_1 / Q5_1: summs and x*d + m), what the weights are).
_BLOCK_FORMATS = tuple((w, a, format_of(w).type_size, format_of(a).type_size, *rest) for w, a, *rest in (
    ("q4_0", "q8_0", 2, 8, False, "(q - 8), q the 4-bit values"),
    ("q4_1", "q8_1", 4, 0, True, "4-bit unsigned q, y = q*d + m"),
    ("q5_0", "q8_0", 2, 16, False, "(q | hbit << 4) - 16"),
    ("q5_1", "q8_1", 4, 0, True, "5-bit unsigned q | hbit << 4, y = q*d + m"),
    ("q8_0", "q8_0", 2, 128, False, "int8 q"),
    ("iq4_nl", "q8_0", 2, 128, False, "kvalues_iq4nl[q], q the 4-bit indices"),
))


def _signed(decode, offset):
    """decode's weights themselves (<32 x i8>, u - offset), for the dequantizer."""
    return lambda b, p: ir_add_const(b, decode(b, p), -offset) if offset else decode(b, p)


# Per-block intrinsics (block_ir.py): _blk_T, the lanes-and-fma step of the dots; _deqblk_T, the
# dequantization of one block.
# the largest code u each decoder gives (AVX2 without VNNI multiplies codes up to 128 unsigned as
# they are, larger ones by ggml's sign trick: simd.ir_lanes_offset)
_CODE_MAX = {"q4_0": 15, "q4_1": 15, "q5_0": 31, "q5_1": 31, "q8_0": 255, "iq4_nl": 255}
for _stem, _, _bb, _, _ao, _off, _with_min, _ in _BLOCK_FORMATS:
    globals()[f"_blk_{_stem}"] = make_block_lanes_fma(globals()[f"_decode_{_stem}"], _off, _CODE_MAX[_stem])
    globals()[f"_blk4_{_stem}"] = make_block4_dot(globals()[f"_decode2_{_stem}"], _off, 0, _with_min, 0, _ao, _bb,
                                                  u_max=_CODE_MAX[_stem])
    globals()[f"_blk4m_{_stem}"] = make_block4_dot(globals()[f"_decode2_{_stem}"], _off, 0, _with_min, 0, _ao, _bb,
                                                   u_max=_CODE_MAX[_stem],
                                                   prefetch=False, many_rows=True)
    globals()[f"_deqblk_{_stem}"] = make_block_dequant(_signed(globals()[f"_decode_{_stem}"], _off), with_min=_with_min)


# ----------------------------------------------------------------------------------------------
# Row functions of the block formats, generated from one template each (the formats differ only
# in the numbers and intrinsics of _BLOCK_FORMATS) and compiled under this file's name, so that
# Numba's cache finds them again in a new process (as matmul.py's drivers). A template line
# ending in "#M" is kept only for formats with a min, "#-" only for those without. IQ4_NL's dots
# (two accumulators) are written out below.
#
# rows_dot_T: several activation rows against one weight row (the matmul drivers' inner call for
# N > 1): y[n, m] for all n, each with exactly the operations and order of vec_dot_T(w_row, a[n])
# -- per output the same 8-lane accumulator over blocks in order -- but the loop is blocks outer,
# activation rows inner, so each weight block is loaded and decoded once for up to ROWS_GROUP rows
# (LLVM hoists the decode out of the inner loop). Accumulators: 8 float32 per row, on the stack.
# ----------------------------------------------------------------------------------------------

@kernel(inline="always")
def _zero16s(acc, k):
    """acc16_zero on the k groups of 16 float32 at acc (a pointer): a row's accumulators."""
    for q in range(k):
        acc16_zero(ptr_offset(acc, 16 * q))


_DEQUANTIZE = '''
@kernel(nested=True)
def dequantize_row_{w}(out, w_row):
    """{W} ({WB} B / 32 values: f16 d{Mdoc}, then the weights: {what}) -> float32.

    ggml-quants.c dequantize_row_{w} (= gguf.quants.dequantize): q*d (+ m), per block."""
    for b in range(out.size // 32):
        _deqblk_{w}(out, b * 32, f16_le(w_row, b * {WB}), f16_le(w_row, b * {WB} + 2), w_row, b * {WB})  #M
        _deqblk_{w}(out, b * 32, f16_le(w_row, b * {WB}), np.float32(0.0), w_row, b * {WB})  #-
'''

_VEC_DOT = '''
@kernel(nested=True)
def vec_dot_{w}_{a}(w_row, a_row, scratch):
    """{W} weight row . {A} activation row -> float32; weights {what}.

    Reproduces ggml-cpu/arch/x86/quants.c ggml_vec_dot_{w}_{a} (AVX2 path): per block
    d = F16(dw)*F16(da); 8 lanes of 4-element integer sums; acc = fma(d, lanes, acc); result
    hsum_float_8(acc) (+ summs = fma(F16(m), F16(s), summs) in block order, with a min).
    """
    nb = w_row.size // {WB}
    accp = stack_f32(8)
    acc8_zero(accp)
    summs = np.float32(0.0)  #M
    for b in range(nb):
        d = f16_le(w_row, b * {WB}) * f16_le(a_row, b * {AB})
        summs = _summs(f16_le(w_row, b * {WB} + 2), f16_le(a_row, b * {AB} + 2), summs)  #M
        _blk_{w}(accp, d, w_row, b * {WB}, a_row, b * {AB} + {AO})
    return acc8_hsum(accp) + summs  #M
    return acc8_hsum(accp)  #-
'''

_ROWS_DOT = '''
@kernel(nested=True)
def rows_dot_{w}_{a}(y, m, w_row, a):
    """y[n, m] = vec_dot_{w}_{a}(w_row, a[n]) for every row n of a (bit for bit)."""
    nb = w_row.size // {WB}
    accs = stack_f32(512)
    summs = carray(stack_f32(64), 64)  #M
    for g in range(0, a.shape[0], ROWS_GROUP):
        ng = min(ROWS_GROUP, a.shape[0] - g)
        for n in range(ng):
            acc8_zero(ptr_offset(accs, 8 * n))
            summs[n] = np.float32(0.0)  #M
        for b in range(nb):
            dw = f16_le(w_row, b * {WB})
            mw = f16_le(w_row, b * {WB} + 2)  #M
            for n in range(ng):
                summs[n] = _summs(mw, f16_le(a[g + n], b * {AB} + 2), summs[n])  #M
                _blk_{w}(ptr_offset(accs, 8 * n), dw * f16_le(a[g + n], b * {AB}), w_row, b * {WB}, a[g + n], b * {AB} + {AO})
        for n in range(ng):
            y[g + n, m] = acc8_hsum(ptr_offset(accs, 8 * n)) + summs[n]  #M
            y[g + n, m] = acc8_hsum(ptr_offset(accs, 8 * n))  #-
'''

_ROWS_DOT8 = '''
@kernel(nested=True)
def rows_dot8_{w}_{a}(y, m, w, a):
    """y[n, m + r] = vec_dot_{w}_{a}(w[m + r], a[n]) for r < 8 and every row n of a (bit for bit):
    vec_dot4's block operation (_blk4m_{w}: without its prefetch, done once per block here) twice
    per activation row and block, on rows m..m+3 and m+4..m+7, sharing the activation's loads and
    conversions; the weight side of each block is computed once for all activation rows."""
    nb = w.shape[1] // {WB}
    w0, w1, w2, w3 = w[m], w[m + 1], w[m + 2], w[m + 3]
    w4, w5, w6, w7 = w[m + 4], w[m + 5], w[m + 6], w[m + 7]
    accs = stack_f32(4096)
    sums = stack_f32(1024)
    for g in range(0, a.shape[0], ROWS_GROUP):
        ng = min(ROWS_GROUP, a.shape[0] - g)
        for n in range(ng):
            _zero16s(ptr_offset(accs, 64 * n), 4)
            acc8_zero(ptr_offset(sums, 16 * n))
            acc8_zero(ptr_offset(sums, 16 * n + 8))
        for b in range(nb):
            # the weights' stream ahead, once per block (the matvec's prefetch): a few activation
            # rows make this kernel wait on memory, as a matvec does
            prefetch4_ahead(w0, w1, b * {WB}, {WB})
            prefetch4_ahead(w4, w5, b * {WB}, {WB})
            for n in range(ng):
                an = a[np.uint64(g + n)]  # an unsigned index: no wraparound test per row
                pa = ptr_offset(accs, 64 * n)
                ps = ptr_offset(sums, 16 * n)
                _blk4m_{w}(pa, ptr_offset(pa, 16), ps, w0, w1, w2, w3, b * {WB}, an, b * {AB})
                _blk4m_{w}(ptr_offset(pa, 32), ptr_offset(pa, 48), ptr_offset(ps, 8), w4, w5, w6, w7, b * {WB}, an, b * {AB})
        for n in range(ng):
            for r in range(8):
                y[g + n, m + r] = acc16_hsum(ptr_offset(accs, 64 * n + 16 * (r // 2)), r % 2) + acc8_lane(ptr_offset(sums, 16 * n + 8 * (r // 4)), 2 * (r % 4) + 1)  #M
                y[g + n, m + r] = acc16_hsum(ptr_offset(accs, 64 * n + 16 * (r // 2)), r % 2)  #-
'''


_VEC_DOT4 = '''
@kernel(nested=True)
def vec_dot4_{w}_{a}(y, m, w, a_row):
    """y[m + r] = vec_dot_{w}_{a}(w[m + r], a_row) for r < 4, bit for bit: per block the same
    operations per row (_blk4_{w}), the four rows' scalars and lanes in shared vector operations and
    their accumulator chains overlapping (one row alone is bound by its fma chain's latency)."""
    nb = w.shape[1] // {WB}
    w0, w1, w2, w3 = w[m], w[m + 1], w[m + 2], w[m + 3]
    p01, p23, sums = stack_f32(16), stack_f32(16), stack_f32(8)
    acc16_zero(p01)
    acc16_zero(p23)
    acc8_zero(sums)
    for b in range(nb):
        _blk4_{w}(p01, p23, sums, w0, w1, w2, w3, b * {WB}, a_row, b * {AB})
    store4_hsum_sums(y, m, p01, p23, sums)  #M
    store4_hsum(y, m, p01, p23)  #-
'''


def _define(template, fmt):
    """Generate and compile one row function of a _BLOCK_FORMATS entry into this module."""
    w, a, wb, ab, ao, _, with_min, what = fmt
    lines = []
    for line in template.splitlines():
        if line.endswith(("  #M", "  #-")):
            if line.endswith("#M") != with_min:
                continue
            line = line[:-4]
        lines.append(line)
    src = "\n".join(lines).format(w=w, a=a, W=w.upper(), A=a.upper(), WB=wb, AB=ab, AO=ao, what=what,
                                  Mdoc=", f16 m" if with_min else "")
    exec(compile(src, __file__, "exec"), globals())


for _fmt in _BLOCK_FORMATS:
    _define(_DEQUANTIZE, _fmt)
    if _fmt[0] != "iq4_nl":
        _define(_VEC_DOT, _fmt)
        _define(_ROWS_DOT, _fmt)
        _define(_VEC_DOT4, _fmt)
        _define(_ROWS_DOT8, _fmt)


@kernel(nested=True)
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


@kernel(nested=True)
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
                an = a[np.uint64(g + n)]  # an unsigned index: no wraparound test per row
                _blk_iq4_nl(ptr_offset(acc1, 8 * n), f16_le(an, b0 * 34) * d0, w_row, b0 * 18, an, b0 * 34 + 2)
                _blk_iq4_nl(ptr_offset(acc2, 8 * n), f16_le(an, b1 * 34) * d1, w_row, b1 * 18, an, b1 * 34 + 2)
        for n in range(ng):
            acc8_add(ptr_offset(acc1, 8 * n), ptr_offset(acc2, 8 * n))
            sumf = acc8_hsum(ptr_offset(acc1, 8 * n))
            if nb % 2 == 1:
                sumf = _iq4_nl_tail(w_row, a[g + n], nb - 1, sumf)
            y[g + n, m] = sumf


@kernel(nested=True)
def vec_dot4_iq4_nl_q8_0(y, m, w, a_row):
    """y[m + r] = vec_dot_iq4_nl_q8_0(w[m + r], a_row) for r < 4, bit for bit (vec_dot4 of the
    template formats with IQ4_NL's two accumulator sets: even blocks, odd blocks)."""
    nb = w.shape[1] // 18
    w0, w1, w2, w3 = w[m], w[m + 1], w[m + 2], w[m + 3]
    e01, e23, o01, o23, sums = stack_f32(16), stack_f32(16), stack_f32(16), stack_f32(16), stack_f32(8)
    acc16_zero(e01)
    acc16_zero(e23)
    acc16_zero(o01)
    acc16_zero(o23)
    for i in range(nb // 2):
        _blk4_iq4_nl(e01, e23, sums, w0, w1, w2, w3, 2 * i * 18, a_row, 2 * i * 34)
        _blk4_iq4_nl(o01, o23, sums, w0, w1, w2, w3, (2 * i + 1) * 18, a_row, (2 * i + 1) * 34)
    acc16_add(e01, o01)
    acc16_add(e23, o23)
    store4_hsum(y, m, e01, e23)
    if nb % 2 == 1:
        for r in range(4):
            y[m + r] = _iq4_nl_tail(w[m + r], a_row, nb - 1, y[m + r])


@kernel(nested=True)
def rows_dot4_iq4_nl_q8_0(y, m, w, a):
    """y[n, m + r] = vec_dot_iq4_nl_q8_0(w[m + r], a[n]) for r < 4 and every row n of a (bit for
    bit; rows_dot4 with IQ4_NL's even / odd accumulator sets)."""
    nb = w.shape[1] // 18
    w0, w1, w2, w3 = w[m], w[m + 1], w[m + 2], w[m + 3]
    even = stack_f32(2048)
    odd = stack_f32(2048)
    sums = stack_f32(8)
    for g in range(0, a.shape[0], ROWS_GROUP):
        ng = min(ROWS_GROUP, a.shape[0] - g)
        _zero16s(even, 2 * ng)  # rows 0..ng-1: 32 each
        _zero16s(odd, 2 * ng)
        for i in range(nb // 2):
            prefetch4_ahead(w0, w1, 2 * i * 18, 36)  # two blocks a step (see rows_dot8)
            for n in range(ng):
                e, o = ptr_offset(even, 32 * n), ptr_offset(odd, 32 * n)
                _blk4m_iq4_nl(e, ptr_offset(e, 16), sums, w0, w1, w2, w3, 2 * i * 18, a[g + n], 2 * i * 34)
                _blk4m_iq4_nl(o, ptr_offset(o, 16), sums, w0, w1, w2, w3, (2 * i + 1) * 18, a[g + n], (2 * i + 1) * 34)
        for n in range(ng):
            for h in range(2):
                acc16_add(ptr_offset(even, 32 * n + 16 * h), ptr_offset(odd, 32 * n + 16 * h))
            for r in range(4):
                sumf = acc16_hsum(ptr_offset(even, 32 * n + 16 * (r // 2)), r % 2)
                if nb % 2 == 1:
                    sumf = _iq4_nl_tail(w[m + r], a[g + n], nb - 1, sumf)
                y[g + n, m + r] = sumf


@kernel(nested=True)
def _iq4_nl_tail(w_row, a_row, b, sumf):
    """ggml's scalar tail for a trailing odd IQ4_NL block: sumf = fma(d, isum, sumf)."""
    ai = a_row.view(np.int8)
    isum = np.int32(0)
    for j in range(16):
        q = w_row[b * 18 + 2 + j]
        isum += np.int32(KVALUES_IQ4NL[q & 15]) * np.int32(ai[b * 34 + 2 + j])
        isum += np.int32(KVALUES_IQ4NL[q >> 4]) * np.int32(ai[b * 34 + 18 + j])
    return fma32(f16_le(a_row, b * 34) * f16_le(w_row, b * 18), np.float32(isum), sumf)


@kernel(inline="always")
def _summs(m, s, acc):
    """summs += F16(m) * F16(s): GCC contracts this C expression into one fma on x86-64 with FMA."""
    return fma32(m, s, acc)


@kernel(inline="always")
def _fma64_reduced(w, x):
    """ggml_vec_dot_f32 / _f16's AVX-512 loop (GGML_F32_STEP 64, EPR 16, ARR 4) over w, x (float32,
    or F16 bits: as_f32): acc[64] = fma(w, x, acc) per 64-element step, then block_ir.reduce64.
    Returns (that float32 sum, npart = elements done)."""
    n = w.size
    acc = carray(stack_f32(64), 64)
    for t in range(64):
        acc[t] = np.float32(0.0)
    npart = n - n % 64
    for i in range(0, npart, 64):
        for t in range(64):
            acc[t] = fma32(as_f32(w[i + t]), as_f32(x[i + t]), acc[t])
    return reduce64(acc, 0), npart


@kernel(nested=True)
def vec_dot_f32(w_row, a_row, scratch):
    """F32 weight row . F32 activation row -> float32.

    Reproduces ggml-cpu/vec.cpp ggml_vec_dot_f32 with AVX-512: _fma64_reduced, then the
    leftovers (K % 64) as sumf = fma(w, x, sumf) in order.
    """
    w = w_row.view(np.float32)
    x = a_row.view(np.float32)
    sumf, npart = _fma64_reduced(w, x)
    for i in range(npart, w.size):
        sumf = fma32(w[i], x[i], sumf)
    return sumf


@kernel(nested=True)
def vec_dot_f16(w_row, a_row, scratch):
    """F16 weight row . F16 activation row -> float32.

    Reproduces ggml-cpu/vec.cpp ggml_vec_dot_f16 with AVX-512 (F32Cx16: F16 converted to F32):
    _fma64_reduced into a double sum, leftovers added in double; result rounded to float32.
    """
    wh = w_row.view(np.uint16)
    xh = a_row.view(np.uint16)
    s, npart = _fma64_reduced(wh, xh)
    sumd = np.float64(s)
    for i in range(npart, wh.size):
        sumd += np.float64(f16_to_f32(wh[i]) * f16_to_f32(xh[i]))
    return np.float32(sumd)


@kernel(inline="always")
def _float4_loop(acc, w, m, x):
    """acc (float32 [256], row r's lanes at 64 r) = the four rows w[m..m+3]' 64-lane accumulators
    after vec_dot_f32's (x float32) or _f16's (x F16 bits) vector loop, from zero; returns npart
    (the elements done)."""
    for t in range(256):
        acc[t] = np.float32(0.0)
    npart = x.size - x.size % 64
    w0, w1, w2, w3 = w[m], w[m + 1], w[m + 2], w[m + 3]
    for i in range(0, npart, 64):
        float4_fma(acc, w0, w1, w2, w3, i, x)
    return npart


@kernel(nested=True)
def vec_dot4_f32(y, m, w, a_row):
    """y[m + r] = vec_dot_f32(w[m + r], a_row) for r < 4, bit for bit: the same lanes, fmas,
    reduction and leftovers per row; the vector loop in explicit <64 x float> operations (one
    row's loop was compiled with its accumulators in memory), the activation shared, the rows
    prefetched ahead."""
    x = a_row.view(np.float32)
    acc = carray(stack_f32(256), 256)
    npart = _float4_loop(acc, w, m, x)
    for r in range(4):
        wr = w[m + r].view(np.float32)
        sumf = reduce64(acc, 64 * r)
        for i in range(npart, x.size):
            sumf = fma32(wr[i], x[i], sumf)
        y[m + r] = sumf


@kernel(nested=True)
def vec_dot4_f16(y, m, w, a_row):
    """y[m + r] = vec_dot_f16(w[m + r], a_row) for r < 4, bit for bit (as vec_dot4_f32: the F16
    values converted exactly in the vector loop; the sum and leftovers in double)."""
    xh = a_row.view(np.uint16)
    acc = carray(stack_f32(256), 256)
    npart = _float4_loop(acc, w, m, xh)
    for r in range(4):
        wr = w[m + r].view(np.uint16)
        sumd = np.float64(reduce64(acc, 64 * r))
        for i in range(npart, xh.size):
            sumd += np.float64(f16_to_f32(wr[i]) * f16_to_f32(xh[i]))
        y[m + r] = np.float32(sumd)


@kernel(nested=True)
def vec_dot_bf16(w_row, a_row, scratch):
    """BF16 weight row . BF16 activation row -> float32.

    Reproduces ggml-cpu/vec.cpp ggml_vec_dot_bf16 with AVX512BF16: per 64-element step two
    16-lane accumulators (vdpbf16ps: lane l adds the product of pair element 2l+1, then 2l; BF16
    products are exact in F32); each reduced with _mm512_reduce_add_ps into a double sum;
    leftovers added in double.
    """
    wh = w_row.view(np.uint16)
    xh = a_row.view(np.uint16)
    acc = carray(stack_f32(32), 32)
    for t in range(32):
        acc[t] = np.float32(0.0)
    npart = wh.size - wh.size % 64
    for i in range(0, npart, 64):
        for t in range(32):
            acc[t] = acc[t] + _bf16(wh[i + 2 * t + 1]) * _bf16(xh[i + 2 * t + 1])
            acc[t] = acc[t] + _bf16(wh[i + 2 * t]) * _bf16(xh[i + 2 * t])
    sumd = np.float64(reduce16(acc, 0))
    sumd += np.float64(reduce16(acc, 16))
    for i in range(npart, wh.size):
        sumd += np.float64(_bf16(wh[i]) * _bf16(xh[i]))
    return np.float32(sumd)


@kernel(nested=True)
def vec_dot4_bf16(y, m, w, a_row):
    """y[m + r] = vec_dot_bf16(w[m + r], a_row) for r < 4, bit for bit: each row's 32 lanes take
    vec_dot_bf16's products and adds in its order (block_ir.bf16x4_dot, explicit vectors); the
    activation's conversions are shared, the four rows' chains overlap and are prefetched ahead."""
    xh = a_row.view(np.uint16)
    w0, w1, w2, w3 = w[m], w[m + 1], w[m + 2], w[m + 3]
    acc = carray(stack_f32(128), 128)  # row r's lane t at 32 r + t
    for t in range(128):
        acc[t] = np.float32(0.0)
    n = xh.size
    npart = n - n % 64
    for i in range(0, npart, 64):
        bf16x4_dot(acc, w0, w1, w2, w3, i, xh)
    for r in range(4):
        wr = w[m + r].view(np.uint16)
        sumd = np.float64(reduce16(acc, 32 * r))
        sumd += np.float64(reduce16(acc, 32 * r + 16))
        for i in range(npart, n):
            sumd += np.float64(_bf16(wr[i]) * _bf16(xh[i]))
        y[m + r] = np.float32(sumd)


@kernel(inline="always")
def _bf16(h):
    return u32_as_f32(np.uint32(h) << np.uint32(16))



# Prefill (N > 1) of the float formats: rows_dot_T (one weight row, all activation rows) and
# rows_dot4_T (four), each output vec_dot_T's operations in its order. rows_dot4 runs vec_dot4
# (accumulators in registers, the activation row converted once for four weight rows) for every
# activation row while the four weight rows stay in cache; the matmul drivers call it for whole
# groups of four rows and rows_dot for the rest (matmul._row_groups).
_FLOAT_ROWS_DOT = '''
@kernel(nested=True)
def rows_dot_{t}_{t}(y, m, w_row, a):
    """y[n, m] = vec_dot_{t}(w_row, a[n]) for every row n of a."""
    no_scratch = np.empty(0, np.int32)  # (the float dots use none)
    for n in range(a.shape[0]):
        y[n, m] = vec_dot_{t}(w_row, a[n], no_scratch)


@kernel(nested=True)
def rows_dot4_{t}_{t}(y, m, w, a):
    """y[n, m + r] = vec_dot_{t}(w[m + r], a[n]) for r < 4 and every row n of a, bit for bit
    (vec_dot4_{t} per activation row)."""
    for n in range(a.shape[0]):
        vec_dot4_{t}(y[n], m, w, a[n])
'''
for _t in ("f32", "f16", "bf16"):
    exec(compile(_FLOAT_ROWS_DOT.format(t=_t), __file__, "exec"), globals())
