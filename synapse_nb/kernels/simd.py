"""The host's SIMD features and the LLVM-IR building blocks every kernel module emits with.

Host features (HOST_FEATURES, probed once here): vpdpbusd (AVX512-VNNI + VL / BW), else
vpmaddubsw + vpmaddwd (AVX2), vcvtph2ps (F16C) and pshufb (SSSE3) are used when the host has
them, else portable IR computing the same bits. Numba's cache is keyed on the host CPU and its
features, so baking the choice into compiled code is safe; when Numba is told to target another
CPU, the probe reports the features it is told (NUMBA_CPU_FEATURES), or none (NUMBA_CPU_NAME
alone, e.g. ``NUMBA_CPU_NAME=generic``: only portable IR is emitted). The emitters read the HAS_*
flags of this module when a kernel is compiled (tests patch them here).

Here: the probe; ``ir_*`` emitters (vector loads and shuffles, the exact integer lane dots ggml's
maddubs + madd compute, lane fmas, F16 conversion, table lookups, prefetches); ``ir_intrinsic``
(a Numba intrinsic from an IR emitter); stack buffers and pointer arithmetic (stack_*,
ptr_offset, load_f32); and the accumulator intrinsics (acc8_* / acc16_*, store4_hsum*) that keep
ggml's 8-lane float accumulators in vector registers and reduce them in hsum_float_8's order.
The block-format and K-quant intrinsics built from these live in block_ir.py and kquant_ir.py.
"""

import inspect

from llvmlite import binding as llvm_binding
from llvmlite import ir
from numba import types
from numba.core import cgutils, config
from numba.extending import intrinsic

_I8, _I16, _I32, _F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType()

# Activation rows per pass of the multi-row dots (rows_dot_*: legacy.py, kquants.py): their
# accumulators, 8 float32 per row, live on the stack.
ROWS_GROUP = 64


def _probe():
    """The features kernels are compiled for: NUMBA_CPU_FEATURES's when it is set (Numba compiles
    for those: "+avx2,-avx512f,..."), none for a NUMBA_CPU_NAME alone, else the host's."""
    if config.CPU_FEATURES:
        return {f[1:]: f[0] == "+" for f in config.CPU_FEATURES.split(",") if f[:1] in ("+", "-")}
    return {} if config.CPU_NAME else dict(llvm_binding.get_host_cpu_features())


HOST_FEATURES = _probe()
HAS_F16C = bool(HOST_FEATURES.get("f16c"))
HAS_VNNI256 = bool(HOST_FEATURES.get("avx512vnni") and HOST_FEATURES.get("avx512vl"))
HAS_PSHUFB = bool(HOST_FEATURES.get("ssse3"))
HAS_VNNI512 = bool(HOST_FEATURES.get("avx512vnni") and HOST_FEATURES.get("avx512bw"))
HAS_AVX2 = bool(HOST_FEATURES.get("avx2"))


# F16C turns ``fpext half`` into vcvtph2ps; without it LLVM would call a compiler-rt helper that
# Numba's JIT does not provide, so then the conversion is spelled out in integer IR.


def ir_f16_to_f32_portable(builder, h16):
    """Exact F16 -> F32 of an i16 (scalar or vector) without F16C."""
    ty = h16.type
    n = ty.count if isinstance(ty, ir.VectorType) else None

    def c(v, bits=32):
        t = ir.IntType(bits)
        return ir.Constant(ir.VectorType(t, n), [v] * n) if n else ir.Constant(t, v)

    i32t = ir.VectorType(_I32, n) if n else _I32
    f32t = ir.VectorType(_F32, n) if n else _F32
    h = builder.zext(h16, i32t)
    sign = builder.shl(builder.and_(h, c(0x8000)), c(16))
    em = builder.and_(h, c(0x7FFF))
    normal = builder.add(builder.shl(em, c(13)), c(0x38000000))
    special = builder.or_(builder.shl(em, c(13)), c(0x7F800000))
    sub = builder.bitcast(builder.fmul(builder.uitofp(em, f32t),
                                       ir.Constant(f32t, [2.0 ** -24] * n) if n else ir.Constant(_F32, 2.0 ** -24)), i32t)
    bits = builder.select(builder.icmp_unsigned("<", em, c(0x400)), sub,
                          builder.select(builder.icmp_unsigned(">=", em, c(0x7C00)), special, normal))
    return builder.bitcast(builder.or_(bits, sign), f32t)


def ir_reduce_add_16(builder, v):
    """_mm512_reduce_add_ps of a <16 x float> v, as a float, in GCC's order: halves t[i] = v[i] +
    v[i+8], then u[i] = t[i] + t[i+4], then (u0 + u2) + (u1 + u3) (formats.reduce_add_16)."""
    def sh(v, idx):
        return builder.shuffle_vector(v, ir.Constant(v.type, ir.Undefined), ir.Constant(ir.VectorType(_I32, len(idx)), idx))
    t = builder.fadd(sh(v, list(range(8, 16))), sh(v, list(range(8))))
    u = builder.fadd(sh(t, [4, 5, 6, 7]), sh(t, [0, 1, 2, 3]))
    a = builder.fadd(sh(u, [0, 1]), sh(u, [2, 3]))
    return builder.fadd(builder.extract_element(a, ir.Constant(_I32, 0)), builder.extract_element(a, ir.Constant(_I32, 1)))


def _stack_array(elt_ir, elt_nb, what):
    def stack(typingctx, n):
        if not isinstance(n, types.IntegerLiteral):
            return None
        size = n.literal_value

        def codegen(context, builder, signature, args):
            return cgutils.alloca_once(builder, elt_ir, size=size)

        return types.CPointer(elt_nb)(n), codegen

    stack.__name__ = stack.__qualname__ = f"stack_{elt_nb}"
    stack.__doc__ = (f"Pointer to n {what} in the calling function's stack frame (n a literal; allocated "
                     "once in the entry block). LLVM knows it aliases nothing else, which lets loops that "
                     "store into it vectorize. Wrap with numba.carray(ptr, n).")
    return intrinsic(prefer_literal=True)(stack)


stack_i32 = _stack_array(_I32, types.int32, "int32")
stack_f32 = _stack_array(_F32, types.float32, "float32")
stack_u8 = _stack_array(_I8, types.uint8, "uint8")


# ---------------------------------------------------------------------------------------------
# Vector loads, integer block lanes, lane fmas
# ---------------------------------------------------------------------------------------------

def ir_load(builder, ptr_i8, n, elt=_I8, align=1):
    """<n x elt> loaded from the i8* ptr_i8 (any pointer; unaligned unless align says otherwise)."""
    vty = ir.VectorType(elt, n)
    return builder.load(builder.bitcast(ptr_i8, vty.as_pointer()), align=align)


def ir_store(builder, v, ptr, align=1):
    """Store the vector v at ptr (any pointer; unaligned unless align says otherwise)."""
    builder.store(v, builder.bitcast(ptr, v.type.as_pointer()), align=align)


def ir_splat(builder, val, n):
    """<n x type(val)> with every lane the scalar value val."""
    vty = ir.VectorType(val.type, n)
    v = builder.insert_element(ir.Constant(vty, ir.Undefined), val, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, ir.Constant(vty, ir.Undefined), ir.Constant(ir.VectorType(_I32, n), [0] * n))


def ir_nibbles32(builder, qs_ptr):
    """16 bytes at qs_ptr -> <32 x i8>: low nibbles (values 0..15) then high nibbles (16..31)."""
    if avx2_path():
        return _nibbles_by_halves(builder, qs_ptr)
    v = ir_load(builder, qs_ptr, 16)
    lo = builder.and_(v, ir.Constant(ir.VectorType(_I8, 16), [15] * 16))
    hi = builder.lshr(v, ir.Constant(ir.VectorType(_I8, 16), [4] * 16))
    return builder.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(_I32, 32), list(range(32))))


def ir_high_bits32(builder, qh_ptr):
    """The 32 bits of the little-endian uint32 at qh_ptr -> <32 x i8> of (bit j) << 4."""
    qh = builder.load(builder.bitcast(qh_ptr, _I32.as_pointer()), align=1)
    v = ir_splat(builder, qh, 32)
    sh = builder.lshr(v, ir.Constant(ir.VectorType(_I32, 32), list(range(32))))
    bit = builder.and_(sh, ir.Constant(ir.VectorType(_I32, 32), [1] * 32))
    return builder.trunc(builder.shl(bit, ir.Constant(ir.VectorType(_I32, 32), [4] * 32)), ir.VectorType(_I8, 32))


def ir_int8x32(builder, ptr):
    """32 int8 at ptr -> <32 x i8>."""
    return ir_load(builder, ptr, 32)


def ir_add_const(builder, v, c):
    """v + c in every lane (c a Python int; wrapping in i8 lanes)."""
    return builder.add(v, ir.Constant(v.type, [c & 0xFF if v.type.element == _I8 else c] * v.type.count))


# vpdpbusd computes exactly the 8 lanes (u8 x s8, groups of 4 summed into int32; 16 lanes for 64
# values on a zmm): used when the host has AVX512-VNNI + VL (HAS_VNNI256; the 512-bit form needs
# only AVX512-VNNI, which implies AVX512F); else, with AVX2, ggml's own vpmaddubsw + vpmaddwd
# (ir_lanes_avx2); else the portable widening multiply.


def _maddubs_lanes32(builder, u8, a8):
    """<8 x i32> lanes of <32 x i8> u8 (unsigned) x a8 (signed): vpmaddubsw (products in pairs,
    int16 with saturation) then vpmaddwd by 1 (the pairs in pairs, int32). Exact when no pair
    exceeds int16: u <= 128 and |a| <= 127 (2 * 128 * 127 < 2^15), as in ggml's AVX2 dots."""
    i16x16 = ir.VectorType(ir.IntType(16), 16)
    fn = cgutils.get_or_insert_function
    maddubs = fn(builder.module, ir.FunctionType(i16x16, [ir.VectorType(_I8, 32)] * 2), "llvm.x86.avx2.pmadd.ub.sw")
    madd = fn(builder.module, ir.FunctionType(ir.VectorType(_I32, 8), [i16x16] * 2), "llvm.x86.avx2.pmadd.wd")
    return builder.call(madd, [builder.call(maddubs, [u8, a8]), ir.Constant(i16x16, [1] * 16)])


def ir_by32(builder, f, *vs):
    """f on each 32-element part of the <n x ...> vs (n = 32 or 64: one ymm of bytes, or two), its
    results (vectors of one length) concatenated."""
    n = vs[0].type.count
    if n == 32:
        return f(*vs)
    parts = [f(*[ir_shuffle(builder, v, None, range(h, h + 32)) for v in vs]) for h in range(0, n, 32)]
    return ir_shuffle(builder, parts[0], parts[1], range(2 * parts[0].type.count))


def _sums4(builder, a8):
    """The 4-value sums of signed a8 (<n x i8>, n = 32 or 64) as <n/4 x i32> (vpmaddubsw by 1)."""
    ones = ir.Constant(ir.VectorType(_I8, 32), [1] * 32)
    return ir_by32(builder, lambda a: _maddubs_lanes32(builder, ones, a), a8)


def ir_lanes_avx2(builder, w8, a8, signed, small=False):
    """ir_lanes_portable's exact int32 lanes (<n/4 x i32> of <n x i8> w8 x signed a8, n = 32 or 64)
    with AVX2, as ggml's AVX2 dots compute them, for activations |a| <= 127 (every Q8_0 / Q8_1 /
    Q8_K quant: ggml's quantizers round to [-127, 127]):
      signed w (-128..127): vpmaddubsw(|w|, a with w's sign) (mul_sum_i8_pairs_float's sign trick)
        then vpmaddwd by 1;
      unsigned w, ``small`` (w <= 128, e.g. nibbles): vpmaddubsw(w, a) then vpmaddwd by 1;
      unsigned w (0..255): the signed lanes of w - 128 plus 128 * the 4-value sums of a (the
        activations' part, which LLVM computes once for the rows sharing them).
    Every term stays within int16 before the int32 sums, so the lanes are the exact ones."""
    zero = ir.Constant(ir.VectorType(_I8, 32), [0] * 32)

    def signed_lanes(w, a):
        neg = builder.icmp_signed("<", w, zero)
        return _maddubs_lanes32(builder, builder.select(neg, builder.sub(zero, w), w),
                                builder.select(neg, builder.sub(zero, a), a))

    if signed:
        return ir_by32(builder, signed_lanes, w8, a8)
    if small:
        return ir_by32(builder, lambda u, a: _maddubs_lanes32(builder, u, a), w8, a8)
    centred = ir_add_const(builder, w8, -128)  # w - 128 as int8
    lanes = ir_by32(builder, signed_lanes, centred, a8)
    sums = _sums4(builder, a8)
    return builder.add(lanes, builder.shl(sums, ir.Constant(sums.type, [7] * sums.type.count)))


def ir_lanes_novnni(builder, w8, a8, signed, small=False):
    """The exact lanes without vpdpbusd: ir_lanes_avx2 on AVX2 hosts, else ir_lanes_portable."""
    if HAS_AVX2:
        return ir_lanes_avx2(builder, w8, a8, signed, small)
    return ir_lanes_portable(builder, w8, a8, signed)


def ir_lanes_portable(builder, w8, a8, signed):
    n = w8.type.count
    i32xn = ir.VectorType(_I32, n)
    wv = builder.sext(w8, i32xn) if signed else builder.zext(w8, i32xn)
    prod = builder.mul(wv, builder.sext(a8, i32xn))
    undef = ir.Constant(i32xn, ir.Undefined)
    parts = [builder.shuffle_vector(prod, undef, ir.Constant(ir.VectorType(_I32, n // 4), list(range(k, n, 4))))
             for k in range(4)]
    return builder.add(builder.add(parts[0], parts[1]), builder.add(parts[2], parts[3]))


def ir_vpdpbusd(builder, acc, u8, a8):
    """acc + the lanes of unsigned u8 x signed a8 (<n x i8>, n = 32 or 64; acc <n/4 x i32>):
    vpdpbusd.256 / .512, a wrapping int32 add of the exact 4-product sums."""
    n = u8.type.count
    i32xl = ir.VectorType(_I32, n // 4)
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(i32xl, [i32xl] * 3),
                                        f"llvm.x86.avx512.vpdpbusd.{8 * n}")
    return builder.call(fn, [acc, builder.bitcast(u8, i32xl), builder.bitcast(a8, i32xl)])


def avx2_path():
    """True when the kernels take their AVX2 forms: a host with AVX2 and without AVX512-VNNI (read
    when a kernel compiles, as the HAS_* flags are, so that tests patching those see it)."""
    return HAS_AVX2 and not HAS_VNNI512


def _has_vnni(n):
    """vpdpbusd on n-byte vectors: 32 needs AVX512-VNNI + VL, 64 AVX512-VNNI + BW."""
    return HAS_VNNI256 if n == 32 else HAS_VNNI512


def ir_lanes(builder, u8, a8, u_max=255):
    """<n/4 x i32> lanes l = sum_{k<4} u[4l+k] * a[4l+k] of <n x i8> unsigned weights u (0..u_max,
    a Python int: what the caller's values can be) and signed activations a, n = 32 (one ymm:
    vpdpbusd.256) or 64 (two 32-value chunks in one zmm: vpdpbusd.512): exact (ggml's maddubs +
    madd). Signed weights: ir_lanes_offset."""
    n = u8.type.count
    if not _has_vnni(n):
        return ir_lanes_novnni(builder, u8, a8, False, small=u_max <= 128)
    return ir_vpdpbusd(builder, ir.Constant(ir.VectorType(_I32, n // 4), [0] * (n // 4)), u8, a8)


def ir_lanes_offset(builder, u8, a8, offset, u_max=255):
    """The lanes of ir_lanes for the signed weights w = u - offset, from their unsigned codes u
    (<n x i8>, values 0..u_max; offset 0..128, Python ints) and signed activations a8, exact.

    sum_k (u_k - offset) * a_k = sum_k u_k * a_k - offset * sum_k a_k per lane, every term an exact
    int32 (|offset * sum| <= 2^16): with vpdpbusd, one multiply of u (unsigned as it is) started
    from -offset * sum(a) -- the same int32 lanes as ggml's sign trick, without its per-weight
    abs / sign / mask work. The -offset * sum(a) part reads only the activations: LLVM computes it
    once for the weights (rows) that share them. With AVX2 the same for codes u_max <= 128
    (vpmaddubsw of u as it is, then offset * the sums of a subtracted), else ggml's sign trick on
    w; portable IR multiplies w itself."""
    n = u8.type.count
    if offset == 0:
        return ir_lanes(builder, u8, a8, u_max)
    if not _has_vnni(n):
        if HAS_AVX2 and u_max <= 128:
            sums = _sums4(builder, a8)
            return builder.sub(ir_lanes_avx2(builder, u8, a8, False, small=True),
                               builder.mul(sums, ir.Constant(sums.type, [offset] * sums.type.count)))
        return ir_lanes_novnni(builder, ir_add_const(builder, u8, -offset), a8, True)
    zero = ir.Constant(ir.VectorType(_I32, n // 4), [0] * (n // 4))
    bias = ir_vpdpbusd(builder, zero, ir.Constant(ir.VectorType(_I8, n), [offset & 0xFF] * n), a8)
    return ir_vpdpbusd(builder, builder.sub(zero, bias), u8, a8)


def ir_fma8(builder, acc_ptr, d, lanes, splat_first=False):
    """acc[0:8] = fma(d, float(lanes), acc[0:8]) per lane (_mm256_fmadd_ps(d, cvtepi32_ps(lanes),
    acc)) as one <8 x float> llvm.fma; acc_ptr: a pointer to 8 float32.

    The same operations either way; ``splat_first`` only changes the order the IR is emitted in,
    which changes LLVM's register allocation: each caller keeps the order it was tuned with (the
    legacy block dots measured 8-15% slower with the K-quants' order, the K-quant dots keep theirs).
    """
    v8f = ir.VectorType(_F32, 8)
    dv = ir_splat(builder, d, 8) if splat_first else None
    fl = builder.sitofp(lanes, v8f)
    vptr = builder.bitcast(acc_ptr, v8f.as_pointer())
    acc = builder.load(vptr, align=4)
    fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v8f, [v8f] * 3), "llvm.fma.v8f32")
    builder.store(builder.call(fma, [dv or ir_splat(builder, d, 8), fl, acc]), vptr, align=4)


def ir_data(context, builder, aty, aval, elt=_I8):
    """Data pointer of a Numba array argument, or a raw pointer (stack_*, ptr_offset), as elt*.
    Offsets into it are flat element offsets: a 2-D (C-contiguous, see flat_args) array's row r
    starts at r * shape[1]."""
    if isinstance(aty, types.CPointer):
        return builder.bitcast(aval, elt.as_pointer())
    return builder.bitcast(context.make_array(aty)(context, builder, aval).data, elt.as_pointer())


def flat_args(*tys):
    """True when every type is a raw pointer, a 1-D array, or a C-contiguous array: memory that
    ir_data plus a flat offset addresses correctly (typers return no signature otherwise)."""
    return all(isinstance(t, types.CPointer) or (isinstance(t, types.Array) and (t.ndim == 1 or t.layout == "C"))
               for t in tys)


def ir_f16_vec_to_f32(builder, h16):
    """<n x i16> F16 bits -> <n x float>, exact (vcvtph2ps with F16C, else integer IR)."""
    if HAS_F16C:
        n = h16.type.count
        return builder.fpext(builder.bitcast(h16, ir.VectorType(ir.HalfType(), n)), ir.VectorType(_F32, n))
    return ir_f16_to_f32_portable(builder, h16)


def ir_f32_to_f16(builder, f):
    """<n x float> -> <n x i16> F16 bits, round to nearest even: GGML_CPU_FP32_TO_FP16, vcvtps2ph
    (imm 0) with F16C, else scalar.f32_to_f16_bits per lane in integer IR (overflow -> inf,
    subnormals rounded, NaN -> quiet NaN keeping the top payload bits)."""
    n = f.type.count
    vi, vf = ir.VectorType(_I32, n), ir.VectorType(_F32, n)
    if HAS_F16C:
        return builder.bitcast(builder.fptrunc(f, ir.VectorType(ir.HalfType(), n)), ir.VectorType(_I16, n))
    c = lambda v: ir.Constant(vi, [v] * n)  # noqa: E731
    u = builder.bitcast(f, vi)
    sign = builder.and_(builder.lshr(u, c(16)), c(0x8000))
    a = builder.and_(u, c(0x7FFFFFFF))
    nan_r = builder.or_(c(0x7E00), builder.and_(builder.lshr(a, c(13)), c(0x3FF)))
    rint = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vf, [vf]), f"llvm.rint.v{n}f32")
    sub_r = builder.fptoui(builder.call(rint, [builder.fmul(builder.bitcast(a, vf), ir.Constant(vf, [16777216.0] * n))]), vi)
    a2 = builder.sub(a, c(0x38000000))
    norm_r = builder.lshr(builder.add(builder.add(a2, c(0xFFF)), builder.and_(builder.lshr(a2, c(13)), c(1))), c(13))
    r = builder.select(builder.icmp_unsigned("<", a, c(0x38800000)), sub_r, norm_r)
    r = builder.select(builder.icmp_unsigned(">=", a, c(0x477FF000)), c(0x7C00), r)
    r = builder.select(builder.icmp_unsigned(">", a, c(0x7F800000)), nan_r, r)
    return builder.trunc(builder.or_(sign, r), ir.VectorType(_I16, n))


def ir_nibbles64(builder, p0, p1):
    """16 bytes at p0 and at p1 -> <64 x i8>: ir_nibbles32(p0) then ir_nibbles32(p1), with one
    and / one shift over both rows' bytes (on AVX2, ir_nibbles32 of each: no shuffle across
    the halves then)."""
    if avx2_path():
        return ir_shuffle(builder, ir_nibbles32(builder, p0), ir_nibbles32(builder, p1), range(64))
    i8x32 = ir.VectorType(_I8, 32)
    v = builder.shuffle_vector(ir_load(builder, p0, 16), ir_load(builder, p1, 16),
                               ir.Constant(ir.VectorType(_I32, 32), list(range(32))))
    lo = builder.and_(v, ir.Constant(i8x32, [15] * 32))
    hi = builder.lshr(v, ir.Constant(i8x32, [4] * 32))
    order = list(range(0, 16)) + list(range(32, 48)) + list(range(16, 32)) + list(range(48, 64))
    return builder.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(_I32, 64), order))


def _nibbles_by_halves(builder, p):
    """ir_nibbles32(p) on the AVX2 path (avx2_path): the 16 bytes loaded into both 128-bit halves
    (vbroadcasti128), the upper half's dwords shifted right by 4 (one vpsrlvd), then one and: the
    low nibbles in the lower half, the high ones in the upper, without the lane-crossing
    shuffles (vinserti128, vperm2i128) of the and / shift / concatenate form. The four-row matvec
    (AVX2 host, Zen 3, 1 thread, rows of 896 in L3, GB/s): Q4_0 11.8 -> 14.1, Q4_1 12.1 -> 15.2,
    Q5_0 9.6 -> 10.3."""
    v = ir_load(builder, p, 16)
    both = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, 32), list(range(16)) * 2))
    i32x8 = ir.VectorType(_I32, 8)
    sh = builder.lshr(builder.bitcast(both, i32x8), ir.Constant(i32x8, [0] * 4 + [4] * 4))
    return builder.and_(builder.bitcast(sh, ir.VectorType(_I8, 32)), ir.Constant(ir.VectorType(_I8, 32), [15] * 32))


def ir_high_bits64(builder, p0, p1):
    """The 32 bits of the little-endian uint32s at p0 and at p1 -> <64 x i8> of (bit j) << 4
    (ir_high_bits32 of each, side by side): the 64 bits as a mask, widened to bytes (kmovq +
    vpmovm2b with AVX512BW)."""
    i64 = ir.IntType(64)
    q0 = builder.zext(builder.load(builder.bitcast(p0, _I32.as_pointer()), align=1), i64)
    q1 = builder.zext(builder.load(builder.bitcast(p1, _I32.as_pointer()), align=1), i64)
    bits = builder.bitcast(builder.or_(q0, builder.shl(q1, ir.Constant(i64, 32))), ir.VectorType(ir.IntType(1), 64))
    return builder.shl(builder.zext(bits, ir.VectorType(_I8, 64)), ir.Constant(ir.VectorType(_I8, 64), [4] * 64))


# How far ahead of the bytes being read the four-row kernels (make_block4_dot, make_superblock4_dot,
# float4_fma, bf16x4_dot) prefetch the weights: PREFETCH_GROUPS 4-row groups, and at least PREFETCH_MIN_BYTES.
# Measured cold from memory, 1 thread (best of 15): SmolLM2's Q4_1 gate (360-byte rows, 2 groups =
# 2.9 KiB) 33-35 -> 25-26 us at 8 KiB, its Q8_0 head 1175-1210 -> 1028-1053 us (with Q8_0's third
# line a step), Qwen2.5's Q8_0 head 5016-5075 -> 4510-4614 us; 16 and 32 KiB were slower again, and
# 8 KiB rather than 2 groups made Qwen's 3990-byte Q6_K rows (2 groups: 32 KiB) 25 % slower. At 2
# threads the same kernels measured no different (within this machine's noise).
PREFETCH_GROUPS = 2
PREFETCH_MIN_BYTES = 8192
# Rows whose four-row groups are long are prefetched into L2 only (prefetcht1: locality 2) and
# further ahead (L2_PREFETCH): PREFETCH_GROUPS groups of such rows in flight into L1 are more than
# its 32 KiB hold. Streamed from memory (120 MB matrices of random blocks, 1 thread, best of 9,
# alternating rounds), into L1 / into L2 4 groups and at least 16 KiB ahead, GB/s: Q8_0 rows of
# 4864 values 14.2-15.4 / 29.0-34.5, of 1536 28.2-29.6 / 31.0-33.1, but of 896 29.7-32.6 /
# 22.6-32.1 (and at 2 threads, five rounds, rows of 576 / 640 / 896: medians 41.7 / 40.5 / 41.3
# into L1, 41.8 / 35.0 / 35.4 into L2). The K-quants' super-block kernels (make_superblock4_dot)
# and the float formats' (float4_fma, bf16x4_dot) measured better into L2 whatever their rows:
# Q6_K rows of 4864 / 2048 values 10.0-10.5 / 9.9-10.0 -> 27.0-28.6 / 28.1-28.2, Q4_K rows of
# 1024 / 4864 12.0-12.1 / 15.3-15.5 -> 20.3-20.9 / 23.7-23.8, rows of 896 values F32 12.5-12.8 ->
# 20.3-20.4, BF16 9.6-14.9 -> 21.1-21.7, F16 9.6-11.1 -> 13.7-15.6 (the machine's one-thread read:
# 24-28 GB/s); IQ4_XS's (bound by its lookups: 12-15 GB/s on 1 thread either way, 19-28 / 15-28
# at 2) no better, so it keeps L1. Those prefetch into L2, and the 32-value formats' matvec
# (make_block4_dot) into L2 when PREFETCH_GROUPS groups of its rows are more than
# PREFETCH_MIN_BYTES (rows of more than 1 KiB), into L1 as above otherwise.
L2_PREFETCH = dict(groups=4, min_bytes=16384, locality=2)


def _stride(builder, wp):
    """The distance in bytes (i64) of the first two of four adjacent weight rows' pointers."""
    i64 = ir.IntType(64)
    return builder.sub(builder.ptrtoint(wp[1], i64), builder.ptrtoint(wp[0], i64))


def ir_prefetch_rows_ahead(builder, wp, wo, block_bytes, groups=None, min_bytes=None, locality=3):
    """Prefetch the four adjacent weight rows' stream ahead of one block-step of a four-row
    kernel: wp, the rows' pointers at the step's offset wo (i64), each step reading a block of
    block_bytes from each row. The 4 * block_bytes at max(4 * groups * stride, min_bytes) past
    the rows' start + 4 * wo are fetched (stride: the rows' distance; groups, min_bytes:
    PREFETCH_GROUPS, PREFETCH_MIN_BYTES unless given): one stream over the group, continuous from
    group to group, at the rate it is read; locality: ir_prefetch's cache level. A prefetch past
    the end of the mapping is dropped, never a fault."""
    groups = PREFETCH_GROUPS if groups is None else groups
    min_bytes = PREFETCH_MIN_BYTES if min_bytes is None else min_bytes
    i64 = ir.IntType(64)
    rows = builder.mul(_stride(builder, wp), ir.Constant(i64, 4 * groups))
    lo = ir.Constant(i64, min_bytes)
    ahead = builder.add(builder.mul(wo, ir.Constant(i64, 3)), builder.select(builder.icmp_unsigned(">", rows, lo),
                                                                              rows, lo))
    for extra in range(0, 4 * block_bytes, 64):
        ir_prefetch(builder, builder.gep(wp[0], [builder.add(ahead, ir.Constant(i64, extra))]), locality)


def ir_prefetch_rows_ahead_by_length(builder, wp, wo, block_bytes):
    """ir_prefetch_rows_ahead with its defaults (into L1) when 4 * PREFETCH_GROUPS rows take at
    most PREFETCH_MIN_BYTES, else with L2_PREFETCH: a branch on the rows' length, the same for
    every step of a call (see L2_PREFETCH)."""
    i64 = ir.IntType(64)
    long_rows = builder.icmp_unsigned(">", builder.mul(_stride(builder, wp), ir.Constant(i64, 4 * PREFETCH_GROUPS)),
                                      ir.Constant(i64, PREFETCH_MIN_BYTES))
    with builder.if_else(long_rows) as (far, near):
        with far:
            ir_prefetch_rows_ahead(builder, wp, wo, block_bytes, **L2_PREFETCH)
        with near:
            ir_prefetch_rows_ahead(builder, wp, wo, block_bytes)


def ir_prefetch(builder, p, locality=3):
    """Emit a prefetch of the cache line at pointer p (llvm.prefetch: read, data; locality 3 keeps
    it in all caches, prefetcht0; 2: prefetcht1, into L2 and beyond). A prefetch past the end of
    the mapping is dropped, never a fault; it changes no value."""
    i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                                        "llvm.prefetch.p0i8")
    builder.call(fn, [builder.bitcast(p, i8p), i32(0), i32(locality), i32(1)])


def ir_lookup16(builder, idx, table):
    """table[idx] for a <16 x i8> vector of indices 0..15 and 16 byte values (ints 0..255):
    pshufb (what ggml's AVX2 code does) with SSSE3, else a compare/select chain."""
    i8x16 = ir.VectorType(_I8, 16)
    if HAS_PSHUFB:
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(i8x16, [i8x16, i8x16]),
                                            "llvm.x86.ssse3.pshuf.b.128")
        return builder.call(fn, [ir.Constant(i8x16, list(table)), idx])
    res = ir.Constant(i8x16, [table[0]] * 16)
    for v in range(1, 16):
        hit = builder.icmp_unsigned("==", idx, ir.Constant(i8x16, [v] * 16))
        res = builder.select(hit, ir.Constant(i8x16, [table[v]] * 16), res)
    return res


def ir_lookup_nibbles32(builder, qs_ptr, table):
    """16 bytes of nibble indices at qs_ptr -> <32 x i8>: table[low nibbles] then table[high]."""
    i8x16 = ir.VectorType(_I8, 16)
    v = ir_load(builder, qs_ptr, 16)
    lo = ir_lookup16(builder, builder.and_(v, ir.Constant(i8x16, [15] * 16)), table)
    hi = ir_lookup16(builder, builder.lshr(v, ir.Constant(i8x16, [4] * 16)), table)
    return builder.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(_I32, 32), list(range(32))))


def ir_lookup64(builder, idx, table):
    """table[idx] for a <64 x i8> vector of indices 0..15 (ir_lookup16 on 64 lanes: one zmm vpshufb
    with AVX512BW, else four ir_lookup16)."""
    i8x64 = ir.VectorType(_I8, 64)
    if HAS_VNNI512:  # (implies AVX512BW)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(i8x64, [i8x64, i8x64]),
                                            "llvm.x86.avx512.pshuf.b.512")
        return builder.call(fn, [ir.Constant(i8x64, list(table) * 4), idx])
    quarters = [builder.shuffle_vector(idx, idx, ir.Constant(ir.VectorType(_I32, 16), list(range(16 * q, 16 * q + 16))))
                for q in range(4)]
    parts = [ir_lookup16(builder, q, table) for q in quarters]
    lo = builder.shuffle_vector(parts[0], parts[1], ir.Constant(ir.VectorType(_I32, 32), list(range(32))))
    hi = builder.shuffle_vector(parts[2], parts[3], ir.Constant(ir.VectorType(_I32, 32), list(range(32))))
    return builder.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(_I32, 64), list(range(64))))


def ir_intrinsic(typer):
    """Decorator: a Numba intrinsic from an LLVM-IR emitter, without the typing/codegen boilerplate.

    ``typer(arg types...) -> signature`` (its parameter names are the intrinsic's);
    the decorated ``emit(context, builder, sig, args)`` emits the IR and returns the result value,
    or None for a void intrinsic.
    """

    def wrap(emit):
        def typing(typingctx, *arg_types):
            sig = typer(*arg_types)

            def codegen(context, builder, signature, args):
                res = emit(context, builder, signature, args)
                return context.get_dummy_value() if res is None else res

            return sig, codegen

        params = [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD)
                  for n in ["typingctx", *inspect.signature(typer).parameters]]
        typing.__signature__ = inspect.Signature(params)  # what Numba reads as the call signature
        typing.__name__ = typing.__qualname__ = emit.__name__
        typing.__doc__ = emit.__doc__
        return intrinsic(typing)

    return wrap


_V8I, _V8F = ir.VectorType(_I32, 8), ir.VectorType(_F32, 8)
_V16I, _V16F = ir.VectorType(_I32, 16), ir.VectorType(_F32, 16)


# The 8 accumulators are touched only through these <8 x float> loads/stores, so LLVM keeps them in
# one vector register across the block loop (mixed scalar/vector access would pin them to memory).


def _acc8(builder, ptr):
    return builder.bitcast(ptr, _V8F.as_pointer())


@ir_intrinsic(lambda acc_ptr: types.void(acc_ptr))
def acc8_zero(context, builder, sig, args):
    """acc[0:8] = 0 (acc_ptr from stack_f32(8), or stack_i32(8): int32 lanes, as one <8 x i32> store)."""
    vty = _V8I if sig.args[0].dtype == types.int32 else _V8F
    builder.store(ir.Constant(vty, [0] * 8), builder.bitcast(args[0], vty.as_pointer()), align=4)


@ir_intrinsic(lambda dst_ptr, src_ptr: types.void(dst_ptr, src_ptr))
def acc8_add(context, builder, sig, args):
    """dst[0:8] += src[0:8] (lane-wise _mm256_add_ps)."""
    dp, sp = _acc8(builder, args[0]), _acc8(builder, args[1])
    builder.store(builder.fadd(builder.load(dp, align=4), builder.load(sp, align=4)), dp, align=4)


@ir_intrinsic(lambda acc_ptr: types.float32(acc_ptr))
def acc8_hsum(context, builder, sig, args):
    """hsum_float_8 of acc[0:8] in ggml's order: ((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7))."""
    v = builder.load(_acc8(builder, args[0]), align=4)
    return _ir_hsum8(builder, [builder.extract_element(v, ir.Constant(_I32, i)) for i in range(8)])


def _ir_hsum8(builder, a):
    """ggml's hsum_float_8 of 8 float values: ((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7))."""
    r0, r1 = builder.fadd(a[0], a[4]), builder.fadd(a[1], a[5])
    r2, r3 = builder.fadd(a[2], a[6]), builder.fadd(a[3], a[7])
    return builder.fadd(builder.fadd(r0, r2), builder.fadd(r1, r3))


@ir_intrinsic(lambda acc_ptr: types.void(acc_ptr))
def acc16_zero(context, builder, sig, args):
    """acc[0:16] = 0 (acc_ptr from stack_f32(16), the accumulators of a two-row block intrinsic)."""
    builder.store(ir.Constant(_V16F, [0.0] * 16), builder.bitcast(args[0], _V16F.as_pointer()), align=4)


@ir_intrinsic(lambda dst_ptr, src_ptr: types.void(dst_ptr, src_ptr))
def acc16_add(context, builder, sig, args):
    """dst[0:16] += src[0:16] (lane-wise, as acc8_add on both halves)."""
    dp, sp = (builder.bitcast(a, _V16F.as_pointer()) for a in args)
    builder.store(builder.fadd(builder.load(dp, align=4), builder.load(sp, align=4)), dp, align=4)


@ir_intrinsic(lambda acc_ptr, half: types.float32(acc_ptr, types.intp))
def acc16_hsum(context, builder, sig, args):
    """hsum_float_8 (ggml's order, as acc8_hsum) of lanes 8*half .. 8*half+7 of acc[0:16]."""
    v = builder.load(builder.bitcast(args[0], _V16F.as_pointer()), align=4)
    base = builder.mul(builder.trunc(args[1], _I32), ir.Constant(_I32, 8))
    return _ir_hsum8(builder, [builder.extract_element(v, builder.add(base, ir.Constant(_I32, i))) for i in range(8)])


def _emit_store4_hsum(context, builder, sig, args, with_sums):
    """y[m + r] = hsum_float_8 of row r's 8 lanes (r < 4: rows 0, 1 in acc01, 2, 3 in acc23, as
    acc16_hsum), plus sums[2r + 1] (with_sums), stored as 4 floats: _ir_hsum8's adds, operands in
    its order, done for the four rows in three vector adds instead of 28 scalar ones."""
    y, m, p01, p23 = args[:4]
    v01 = builder.load(builder.bitcast(p01, _V16F.as_pointer()), align=4)
    v23 = builder.load(builder.bitcast(p23, _V16F.as_pointer()), align=4)
    v = builder.shuffle_vector(v01, v23, ir.Constant(ir.VectorType(_I32, 32), list(range(32))))

    def pick(vec, idx):
        return builder.shuffle_vector(vec, vec, ir.Constant(ir.VectorType(_I32, len(idx)), idx))

    # (a0 + a4), (a1 + a5), (a2 + a6), (a3 + a7) per row
    s1 = builder.fadd(pick(v, [8 * r + i for r in range(4) for i in range(4)]),
                      pick(v, [8 * r + 4 + i for r in range(4) for i in range(4)]))
    # (a0+a4) + (a2+a6), (a1+a5) + (a3+a7)
    s2 = builder.fadd(pick(s1, [4 * r + i for r in range(4) for i in (0, 1)]),
                      pick(s1, [4 * r + i for r in range(4) for i in (2, 3)]))
    s3 = builder.fadd(pick(s2, [2 * r for r in range(4)]), pick(s2, [2 * r + 1 for r in range(4)]))
    if with_sums:
        sv = builder.load(_acc8(builder, args[4]), align=4)
        s3 = builder.fadd(s3, pick(sv, [1, 3, 5, 7]))
    out = builder.gep(ir_data(context, builder, sig.args[0], y, _F32), [m])
    builder.store(s3, builder.bitcast(out, ir.VectorType(_F32, 4).as_pointer()), align=4)


@ir_intrinsic(lambda y, m, acc01, acc23: types.void(y, types.intp, acc01, acc23)
              if isinstance(y, types.Array) and y.ndim == 1 and y.dtype == types.float32 else None)
def store4_hsum(context, builder, sig, args):
    """y[m + r] = acc16_hsum(acc01 / acc23, r % 2) for r < 4, bit for bit (y: float32 1-D, C)."""
    _emit_store4_hsum(context, builder, sig, args, False)


@ir_intrinsic(lambda y, m, acc01, acc23, sums: types.void(y, types.intp, acc01, acc23, sums)
              if isinstance(y, types.Array) and y.ndim == 1 and y.dtype == types.float32 else None)
def store4_hsum_sums(context, builder, sig, args):
    """y[m + r] = acc16_hsum(acc01 / acc23, r % 2) + acc8_lane(sums, 2r + 1) for r < 4, bit for bit."""
    _emit_store4_hsum(context, builder, sig, args, True)


@ir_intrinsic(lambda acc_ptr, i: types.float32(acc_ptr, types.intp))
def acc8_lane(context, builder, sig, args):
    """acc[i] of 8 float32 touched only as a vector (e.g. the sums of make_block4_dot)."""
    v = builder.load(_acc8(builder, args[0]), align=4)
    return builder.extract_element(v, builder.trunc(args[1], _I32))


@ir_intrinsic(lambda a, off: types.float32(a, types.intp) if flat_args(a) else None)
def load_f32(context, builder, sig, args):
    """The little-endian float32 at byte offset off of a uint8 array or pointer (flat, as ir_data):
    one unaligned load (the Q8_K block's d)."""
    ptr = builder.gep(ir_data(context, builder, sig.args[0], args[0]), [args[1]])
    return builder.load(builder.bitcast(ptr, _F32.as_pointer()), align=1)


@intrinsic
def ptr_offset(typingctx, p, k):
    """p + k (pointer arithmetic in elements), e.g. the n-th group of 8 accumulators in a stack array."""
    if not isinstance(p, types.CPointer):
        return None
    sig = p(p, types.intp)

    def codegen(context, builder, signature, args):
        return builder.gep(args[0], [args[1]])

    return sig, codegen


@ir_intrinsic(lambda acc_ptr, i: types.float32(acc_ptr, types.intp))
def acc16_lane(context, builder, sig, args):
    """acc[i] of 16 float32 touched only as a vector (the extra accumulators of make_superblock4_dot)."""
    v = builder.load(builder.bitcast(args[0], _V16F.as_pointer()), align=4)
    return builder.extract_element(v, builder.trunc(args[1], _I32))


def ir_bytes(builder, ptr, off, n):
    """<n x i8> at byte offset off (a Python int) of the i8* ptr (unaligned load)."""
    return ir_load(builder, builder.gep(ptr, [ir.Constant(ir.IntType(64), off)]), n)


def ir_word(builder, ptr, off, bits=32):
    """The little-endian integer of ``bits`` bits at byte offset off (a Python int) of the i8* ptr."""
    ty = ir.IntType(bits)
    return builder.load(builder.bitcast(builder.gep(ptr, [ir.Constant(ir.IntType(64), off)]), ty.as_pointer()),
                        align=1)


def ir_vec(builder, vals):
    """A vector from a list of scalars of one type (insertelement chain)."""
    v = ir.Constant(ir.VectorType(vals[0].type, len(vals)), ir.Undefined)
    for i, x in enumerate(vals):
        v = builder.insert_element(v, x, ir.Constant(_I32, i))
    return v


def ir_splat_const(ty, v, n):
    """<n x ty> with every lane the Python int v."""
    return ir.Constant(ir.VectorType(ty, n), [v] * n)


def ir_shuffle(builder, a, b, idx):
    """shufflevector(a, b, idx) with idx a list of Python ints (b None: a with itself)."""
    return builder.shuffle_vector(a, a if b is None else b, ir.Constant(ir.VectorType(_I32, len(idx)), list(idx)))


# F16 conversion of 16 values at a time (activations ggml converts to F16: the attention query, the KV
# cache entries)

@ir_intrinsic(lambda dst, do, src, so: types.void(dst, types.intp, src, types.intp) if flat_args(dst, src) else None)
def f16_round16(context, builder, sig, args):
    """dst[do + j] = float32(F16(src[so + j])) for j < 16 (flat float32 offsets): ggml's
    fp32 -> fp16 conversion of an activation that a later op reads back as float (exact)."""
    d, s = ir_data(context, builder, sig.args[0], args[0], _F32), ir_data(context, builder, sig.args[2], args[2], _F32)
    x = ir_load(builder, builder.gep(s, [args[3]]), 16, _F32, align=4)
    ir_store(builder, ir_f16_vec_to_f32(builder, ir_f32_to_f16(builder, x)), builder.gep(d, [args[1]]), align=4)


@ir_intrinsic(lambda dst, do, src, so: types.void(dst, types.intp, src, types.intp) if flat_args(dst, src) else None)
def f16_bits16(context, builder, sig, args):
    """dst[do + j] = F16 bits of src[so + j] for j < 16 (dst uint16, src float32; flat offsets):
    GGML_CPU_FP32_TO_FP16 on 16 values."""
    d = ir_data(context, builder, sig.args[0], args[0], _I16)
    s = ir_data(context, builder, sig.args[2], args[2], _F32)
    x = ir_load(builder, builder.gep(s, [args[3]]), 16, _F32, align=4)
    ir_store(builder, ir_f32_to_f16(builder, x), builder.gep(d, [args[1]]), align=2)
