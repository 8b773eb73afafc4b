"""The kernels' one toolkit: scalar helpers, the host-feature probe and every LLVM-IR helper.

Scalar functions are plain ``@njit(cache=True, error_model="numpy")`` so that kernels inline
them; the SIMD pieces are Numba intrinsics emitting explicit LLVM vector IR (block dots, lane
fmas, table lookups, stack buffers), used by legacy.py and kquants.py.

Host features (HOST_FEATURES, probed once here): vpdpbusd (AVX512-VNNI + VL), vcvtph2ps (F16C)
and pshufb (SSSE3) are used when the host has them, else portable IR computing the same bits.
Numba's cache is keyed on the host CPU and its features, so baking the choice into compiled code
is safe; when Numba is told to target another CPU (NUMBA_CPU_NAME / NUMBA_CPU_FEATURES, e.g.
``NUMBA_CPU_NAME=generic``), the probe reports no features and only portable IR is emitted.

Sources reproduced:
  * ``ggml_table_f32_f16`` / ``GGML_CPU_FP16_TO_FP32`` (F16 -> F32, exact),
  * ``GGML_CPU_FP32_TO_FP16`` on x86 with F16C (``_cvtss_sh(x, 0)``: round to nearest even,
    overflow to inf),
  * ``GGML_BF16_TO_FP32`` (exact) and the BF16 rounding of ``ggml_cpu_fp32_to_bf16``
    (round to nearest even, NaN kept quiet),
  * ``_mm256_fmadd_ps`` / ``_mm512_fmadd_ps`` (one rounding), through LLVM's ``llvm.fma.f32``.
"""

import inspect

import numpy as np
from llvmlite import binding as llvm_binding
from llvmlite import ir
from numba import njit, types
from numba.core import config
from numba.core import cgutils
from numba.extending import intrinsic

from ..formats import KVALUES_IQ4NL as _KVALUES_IQ4NL

_I8, _I32, _F32 = ir.IntType(8), ir.IntType(32), ir.FloatType()

# Activation rows per pass of the multi-row dots (rows_dot_*: legacy.py, kquants.py): their
# accumulators, 8 float32 per row, live on the stack.
ROWS_GROUP = 64

HOST_FEATURES = {} if (config.CPU_NAME or config.CPU_FEATURES) else dict(llvm_binding.get_host_cpu_features())
HAS_F16C = bool(HOST_FEATURES.get("f16c"))
HAS_VNNI256 = bool(HOST_FEATURES.get("avx512vnni") and HOST_FEATURES.get("avx512vl"))
HAS_PSHUFB = bool(HOST_FEATURES.get("ssse3"))
HAS_VNNI512 = bool(HOST_FEATURES.get("avx512vnni") and HOST_FEATURES.get("avx512bw"))

# ggml-common.h kvalues_iq4nl: the 16 non-linear levels of IQ4_NL / IQ4_XS (defined in formats.py).
KVALUES_IQ4NL = _KVALUES_IQ4NL

# ggml_table_f32_f16: every F16 bit pattern as F32 (exact; 256 KiB, frozen into kernels as a constant).
F16_TO_F32_TABLE = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)


@intrinsic
def fma32(typingctx, a, b, c):
    """float32 a*b + c with a single rounding (llvm.fma.f32), as _mm*_fmadd_ps per lane."""
    sig = types.float32(types.float32, types.float32, types.float32)

    def codegen(context, builder, signature, args):
        f32 = ir.FloatType()
        fnty = ir.FunctionType(f32, [f32, f32, f32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.fma.f32")
        return builder.call(fn, args)

    return sig, codegen


@intrinsic
def f32_bits(typingctx, f):
    """Bit pattern (uint32) of a float32 scalar (LLVM bitcast)."""
    sig = types.uint32(types.float32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return sig, codegen


# F16C turns ``fpext half`` into vcvtph2ps; without it LLVM would call a compiler-rt helper that
# Numba's JIT does not provide, so then the conversion is spelled out in integer IR.


def _ir_f16_to_f32(builder, h16):
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


@intrinsic
def f16_to_f32(typingctx, h):
    """F16 bits (an integer whose low 16 bits hold them) -> float32, exact (= ggml_table_f32_f16[h];
    LLVM fpext half -> float, which vectorizes to vcvtph2ps)."""
    if not isinstance(h, types.Integer):
        return None
    sig = types.float32(h)

    def codegen(context, builder, signature, args):
        v = args[0]
        if h.bitwidth > 16:  # numba widens uint16 arithmetic; the F16 bits are the low 16
            v = builder.trunc(v, ir.IntType(16))
        elif h.bitwidth < 16:
            v = builder.zext(v, ir.IntType(16))
        if HAS_F16C:
            return builder.fpext(builder.bitcast(v, ir.HalfType()), ir.FloatType())
        return _ir_f16_to_f32(builder, v)

    return sig, codegen


@intrinsic
def as_f32(typingctx, v):
    """A float32 unchanged, or F16 bits (an integer) as float32 (f16_to_f32): lets one loop read
    F32 and F16 rows (ggml_vec_dot_f32 / ggml_vec_dot_f16's F32Cx16 loads)."""
    if isinstance(v, types.Integer):
        return f16_to_f32._defn(typingctx, v)  # its typing and codegen
    if v != types.float32:
        return None
    return types.float32(v), lambda context, builder, signature, args: args[0]


@njit(cache=True, error_model="numpy", inline="always")
def copy_u32(dst, src):
    """dst[i] = src[i] for the dst.size 32-bit words (F32 rows viewed as uint32: bits unchanged)."""
    for i in range(dst.size):
        dst[i] = src[i]


@njit(cache=True, error_model="numpy", inline="always")
def f16_le(buf, off):
    """float32 value of the little-endian F16 stored at buf[off:off+2] (uint8 buffer)."""
    return f16_to_f32(np.uint16(buf[off]) | (np.uint16(buf[off + 1]) << np.uint16(8)))


@njit(cache=True, error_model="numpy", inline="always")
def f32_to_f16_bits(f, u):
    """float32 ``f`` (with bit pattern ``u``: uint32) -> F16 bits, round to nearest even.

    Reproduces GGML_CPU_FP32_TO_FP16 with F16C (vcvtps2ph, imm 0): overflow -> inf,
    subnormal results rounded to nearest even, NaN -> quiet NaN.
    """
    sign = np.uint32((u >> np.uint32(16)) & np.uint32(0x8000))
    a = u & np.uint32(0x7FFFFFFF)
    if a >= np.uint32(0x7F800000):  # inf or NaN
        if a > np.uint32(0x7F800000):
            r = np.uint32(0x7E00) | ((a >> np.uint32(13)) & np.uint32(0x3FF))
        else:
            r = np.uint32(0x7C00)
    elif a >= np.uint32(0x477FF000):  # >= 65520 rounds to inf
        r = np.uint32(0x7C00)
    elif a < np.uint32(0x38800000):  # below 2**-14: F16 subnormal (units of 2**-24), exact scaling
        r = np.uint32(np.rint(abs(f) * np.float32(16777216.0)))
    else:  # normal: rebias exponent, round 13 low mantissa bits to nearest even
        a2 = a - np.uint32(0x38000000)
        r = (a2 + np.uint32(0xFFF) + ((a2 >> np.uint32(13)) & np.uint32(1))) >> np.uint32(13)
    return np.uint16(sign | r)


@njit(cache=True, error_model="numpy", inline="always")
def f32_to_bf16_bits(u):
    """float32 bits ``u`` (uint32) -> BF16 bits, round to nearest even; NaN stays a quiet NaN.

    ggml_compute_fp32_to_bf16 (ggml-impl.h).
    """
    if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
        return np.uint16((u >> np.uint32(16)) | np.uint32(64))
    return np.uint16((u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16))


@njit(cache=True, error_model="numpy", inline="always")
def hsum_float_8(a):
    """Horizontal sum of the 8 float32 lanes a[0:8] in ggml's hsum_float_8 order (x86/quants.c):
    ((a0+a4) + (a2+a6)) + ((a1+a5) + (a3+a7))."""
    r0 = a[0] + a[4]
    r1 = a[1] + a[5]
    r2 = a[2] + a[6]
    r3 = a[3] + a[7]
    return (r0 + r2) + (r1 + r3)


def ir_reduce_add_16(builder, v):
    """_mm512_reduce_add_ps of a <16 x float> v, as a float, in GCC's order: halves t[i] = v[i] +
    v[i+8], then u[i] = t[i] + t[i+4], then (u0 + u2) + (u1 + u3) (formats.reduce_add_16)."""
    def sh(v, idx):
        return builder.shuffle_vector(v, ir.Constant(v.type, ir.Undefined), ir.Constant(ir.VectorType(_I32, len(idx)), idx))
    t = builder.fadd(sh(v, list(range(8, 16))), sh(v, list(range(8))))
    u = builder.fadd(sh(t, [4, 5, 6, 7]), sh(t, [0, 1, 2, 3]))
    a = builder.fadd(sh(u, [0, 1]), sh(u, [2, 3]))
    return builder.fadd(builder.extract_element(a, ir.Constant(_I32, 0)), builder.extract_element(a, ir.Constant(_I32, 1)))


@intrinsic
def u32_as_f32(typingctx, u):
    """float32 whose bit pattern is the uint32 ``u`` (LLVM bitcast)."""
    sig = types.float32(types.uint32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return sig, codegen


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

def _vload(builder, ptr_i8, n, elt=_I8, align=1):
    vty = ir.VectorType(elt, n)
    return builder.load(builder.bitcast(ptr_i8, vty.as_pointer()), align=align)


def _splat(builder, val, n):
    vty = ir.VectorType(val.type, n)
    v = builder.insert_element(ir.Constant(vty, ir.Undefined), val, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, ir.Constant(vty, ir.Undefined), ir.Constant(ir.VectorType(_I32, n), [0] * n))


def ir_nibbles32(builder, qs_ptr):
    """16 bytes at qs_ptr -> <32 x i8>: low nibbles (values 0..15) then high nibbles (16..31)."""
    v = _vload(builder, qs_ptr, 16)
    lo = builder.and_(v, ir.Constant(ir.VectorType(_I8, 16), [15] * 16))
    hi = builder.lshr(v, ir.Constant(ir.VectorType(_I8, 16), [4] * 16))
    return builder.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(_I32, 32), list(range(32))))


def ir_high_bits32(builder, qh_ptr):
    """The 32 bits of the little-endian uint32 at qh_ptr -> <32 x i8> of (bit j) << 4."""
    qh = builder.load(builder.bitcast(qh_ptr, _I32.as_pointer()), align=1)
    v = _splat(builder, qh, 32)
    sh = builder.lshr(v, ir.Constant(ir.VectorType(_I32, 32), list(range(32))))
    bit = builder.and_(sh, ir.Constant(ir.VectorType(_I32, 32), [1] * 32))
    return builder.trunc(builder.shl(bit, ir.Constant(ir.VectorType(_I32, 32), [4] * 32)), ir.VectorType(_I8, 32))


def ir_int8x32(builder, ptr):
    """32 int8 at ptr -> <32 x i8>."""
    return _vload(builder, ptr, 32)


def ir_add_const(builder, v, c):
    return builder.add(v, ir.Constant(v.type, [c & 0xFF if v.type.element == _I8 else c] * v.type.count))


# vpdpbusd computes exactly the 8 lanes (u8 x s8, groups of 4 summed into int32; 16 lanes for 64
# values on a zmm): used when the host has AVX512-VNNI + VL (HAS_VNNI256; the 512-bit form needs
# only AVX512-VNNI, which implies AVX512F), else the portable widening multiply.


def _lanes_portable(builder, w8, a8, signed):
    n = w8.type.count
    i32xn = ir.VectorType(_I32, n)
    wv = builder.sext(w8, i32xn) if signed else builder.zext(w8, i32xn)
    prod = builder.mul(wv, builder.sext(a8, i32xn))
    undef = ir.Constant(i32xn, ir.Undefined)
    parts = [builder.shuffle_vector(prod, undef, ir.Constant(ir.VectorType(_I32, n // 4), list(range(k, n, 4))))
             for k in range(4)]
    return builder.add(builder.add(parts[0], parts[1]), builder.add(parts[2], parts[3]))


def _vpdpbusd(builder, acc, u8, a8):
    """acc + the lanes of unsigned u8 x signed a8 (<n x i8>, n = 32 or 64; acc <n/4 x i32>):
    vpdpbusd.256 / .512, a wrapping int32 add of the exact 4-product sums."""
    n = u8.type.count
    i32xl = ir.VectorType(_I32, n // 4)
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(i32xl, [i32xl] * 3),
                                        f"llvm.x86.avx512.vpdpbusd.{8 * n}")
    return builder.call(fn, [acc, builder.bitcast(u8, i32xl), builder.bitcast(a8, i32xl)])


def _has_vnni(n):
    """vpdpbusd on n-byte vectors: 32 needs AVX512-VNNI + VL, 64 AVX512-VNNI + BW."""
    return HAS_VNNI256 if n == 32 else HAS_VNNI512


def ir_lanes(builder, u8, a8):
    """<n/4 x i32> lanes l = sum_{k<4} u[4l+k] * a[4l+k] of <n x i8> unsigned weights u (0..255)
    and signed activations a, n = 32 (one ymm: vpdpbusd.256) or 64 (two 32-value chunks in one
    zmm: vpdpbusd.512): exact (ggml's maddubs + madd). Signed weights: ir_lanes_offset."""
    n = u8.type.count
    if not _has_vnni(n):
        return _lanes_portable(builder, u8, a8, False)
    return _vpdpbusd(builder, ir.Constant(ir.VectorType(_I32, n // 4), [0] * (n // 4)), u8, a8)


def ir_lanes_offset(builder, u8, a8, offset):
    """The lanes of ir_lanes for the signed weights w = u - offset, from their unsigned codes u
    (<n x i8>, values 0..255; offset 0..128, a Python int) and signed activations a8, exact.

    sum_k (u_k - offset) * a_k = sum_k u_k * a_k - offset * sum_k a_k per lane, every term an exact
    int32 (|offset * sum| <= 2^16): with vpdpbusd, one multiply of u (unsigned as it is) started
    from -offset * sum(a) -- the same int32 lanes as ggml's sign trick, without its per-weight
    abs / sign / mask work. The -offset * sum(a) part reads only the activations: LLVM computes it
    once for the weights (rows) that share them. Portable IR multiplies w itself."""
    n = u8.type.count
    if offset == 0:
        return ir_lanes(builder, u8, a8)
    if not _has_vnni(n):
        return _lanes_portable(builder, ir_add_const(builder, u8, -offset), a8, True)
    zero = ir.Constant(ir.VectorType(_I32, n // 4), [0] * (n // 4))
    bias = _vpdpbusd(builder, zero, ir.Constant(ir.VectorType(_I8, n), [offset & 0xFF] * n), a8)
    return _vpdpbusd(builder, builder.sub(zero, bias), u8, a8)


def ir_fma8(builder, acc_ptr, d, lanes, splat_first=False):
    """acc[0:8] = fma(d, float(lanes), acc[0:8]) per lane (_mm256_fmadd_ps(d, cvtepi32_ps(lanes),
    acc)) as one <8 x float> llvm.fma; acc_ptr: a pointer to 8 float32.

    The same operations either way; ``splat_first`` only changes the order the IR is emitted in,
    which changes LLVM's register allocation: each caller keeps the order it was tuned with (the
    legacy block dots measured 8-15% slower with the K-quants' order, the K-quant dots keep theirs).
    """
    v8f = ir.VectorType(_F32, 8)
    dv = _splat(builder, d, 8) if splat_first else None
    fl = builder.sitofp(lanes, v8f)
    vptr = builder.bitcast(acc_ptr, v8f.as_pointer())
    acc = builder.load(vptr, align=4)
    fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v8f, [v8f] * 3), "llvm.fma.v8f32")
    builder.store(builder.call(fma, [dv or _splat(builder, d, 8), fl, acc]), vptr, align=4)


def _data(context, builder, aty, aval, elt=_I8):
    """Data pointer of a Numba array argument, or a raw pointer (stack_*, ptr_offset), as elt*.
    Offsets into it are flat element offsets: a 2-D (C-contiguous, see _flat) array's row r
    starts at r * shape[1]."""
    if isinstance(aty, types.CPointer):
        return builder.bitcast(aval, elt.as_pointer())
    return builder.bitcast(context.make_array(aty)(context, builder, aval).data, elt.as_pointer())


def _flat(*tys):
    """True when every type is a raw pointer, a 1-D array, or a C-contiguous array: memory that
    _data plus a flat offset addresses correctly (typers return no signature otherwise)."""
    return all(isinstance(t, types.CPointer) or (isinstance(t, types.Array) and (t.ndim == 1 or t.layout == "C"))
               for t in tys)


def make_block_lanes_fma(decode, offset):
    """Build the block intrinsic for a weight decoder (see the comment above). ``decode(builder,
    wblock_ptr)`` returns the block's 32 weights as <32 x i8> unsigned codes u (0..255), the
    weights being u - offset (ir_lanes_offset)."""

    @intrinsic
    def block_lanes_fma(typingctx, acc_ptr, d, w_row, w_off, a_row, a_off):
        sig = types.void(acc_ptr, types.float32, w_row, types.intp, a_row, types.intp)

        def codegen(context, builder, signature, args):
            accp, dval, w, wo, a, ao = args
            wdata = _data(context, builder, signature.args[2], w)
            adata = _data(context, builder, signature.args[4], a)
            w8 = decode(builder, builder.gep(wdata, [wo]))
            a8 = ir_int8x32(builder, builder.gep(adata, [ao]))
            ir_fma8(builder, accp, dval, ir_lanes_offset(builder, w8, a8, offset))
            return context.get_dummy_value()

        return sig, codegen

    return block_lanes_fma


def ir_f16_vec_to_f32(builder, h16):
    """<n x i16> F16 bits -> <n x float>, exact (vcvtph2ps with F16C, else integer IR)."""
    if HAS_F16C:
        n = h16.type.count
        return builder.fpext(builder.bitcast(h16, ir.VectorType(ir.HalfType(), n)), ir.VectorType(_F32, n))
    return _ir_f16_to_f32(builder, h16)


def ir_nibbles64(builder, p0, p1):
    """16 bytes at p0 and at p1 -> <64 x i8>: ir_nibbles32(p0) then ir_nibbles32(p1), with one
    and / one shift over both rows' bytes."""
    i8x32 = ir.VectorType(_I8, 32)
    v = builder.shuffle_vector(_vload(builder, p0, 16), _vload(builder, p1, 16),
                               ir.Constant(ir.VectorType(_I32, 32), list(range(32))))
    lo = builder.and_(v, ir.Constant(i8x32, [15] * 32))
    hi = builder.lshr(v, ir.Constant(i8x32, [4] * 32))
    order = list(range(0, 16)) + list(range(32, 48)) + list(range(16, 32)) + list(range(48, 64))
    return builder.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(_I32, 64), order))


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


def ir_prefetch_rows_ahead(builder, wp, wo, block_bytes):
    """Prefetch the four adjacent weight rows' stream ahead of one block-step of a four-row
    kernel: wp, the rows' pointers at the step's offset wo (i64), each step reading a block of
    block_bytes from each row. The 4 * block_bytes at max(4 * PREFETCH_GROUPS * stride,
    PREFETCH_MIN_BYTES) past the rows' start + 4 * wo are fetched (stride: the rows' distance):
    one stream over the group, continuous from group to group, at the rate it is read. A
    prefetch past the end of the mapping is dropped, never a fault."""
    i64 = ir.IntType(64)
    stride = builder.sub(builder.ptrtoint(wp[1], i64), builder.ptrtoint(wp[0], i64))
    rows = builder.mul(stride, ir.Constant(i64, 4 * PREFETCH_GROUPS))
    lo = ir.Constant(i64, PREFETCH_MIN_BYTES)
    ahead = builder.add(builder.mul(wo, ir.Constant(i64, 3)), builder.select(builder.icmp_unsigned(">", rows, lo),
                                                                              rows, lo))
    for extra in range(0, 4 * block_bytes, 64):
        ir_prefetch(builder, builder.gep(wp[0], [builder.add(ahead, ir.Constant(i64, extra))]))


def ir_prefetch(builder, p):
    """Emit a prefetch of the cache line at pointer p (llvm.prefetch: read, keep in all caches,
    data). A prefetch past the end of the mapping is dropped, never a fault; it changes no value."""
    i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                                        "llvm.prefetch.p0i8")
    builder.call(fn, [builder.bitcast(p, i8p), i32(0), i32(3), i32(1)])


def make_block4_dot(decode2, offset, d_off, with_min, a_d_off, a_q_off, block_bytes, prefetch=True):
    """Build the four-row block intrinsic of a 32-value block format:
        block4_dot(acc01, acc23, sums, w0, w1, w2, w3, w_off, a_row, a_off)
    does for each row r < 4 exactly what one block of the format's vec_dot does (same integer
    lanes, same roundings), with the rows' scalars and lanes in vectors:
      d_r = F16(w_r[w_off + d_off]) * F16(a[a_off + a_d_off])          (4 products in one vmulps)
      acc_r[l] = fma(d_r, float(lanes_r[l]), acc_r[l]), l < 8         (two rows per 16-lane op)
      with_min: sums[2r+1] = fma(F16(m_r), F16(s), sums[2r+1]), m_r at w_off + d_off + 2 and s at
      a_off + a_d_off + 2 (the even lanes of sums hold junk: read only the odd ones).
    acc01 / acc23: 16 float32 each (rows 0, 1 / 2, 3: lanes 0..7 / 8..15), sums: 8 float32 (stack
    buffers; touch them only with acc16_zero / acc16_hsum / acc8_zero / acc8_lane).
    ``decode2(builder, p0, p1)`` gives two blocks' 32 weights each as one <64 x i8> of unsigned
    codes u, the weights being u - offset (ir_lanes_offset); block_bytes: the format's block size.
    ``prefetch``: fetch the weights ahead (a matvec streams them; a matmul
    re-reads each block for many rows)."""
    v8f, v16f = ir.VectorType(_F32, 8), ir.VectorType(_F32, 16)
    i16, i32 = ir.IntType(16), _I32

    @intrinsic
    def block4_dot(typingctx, acc01, acc23, sums, w0, w1, w2, w3, w_off, a_row, a_off):
        sig = types.void(acc01, acc23, sums, w0, w1, w2, w3, types.intp, a_row, types.intp)

        def codegen(context, builder, signature, args):
            p01, p23, ps, r0, r1, r2, r3, wo, a, ao = args
            wp = [builder.gep(_data(context, builder, signature.args[3 + r], v), [wo])
                  for r, v in enumerate((r0, r1, r2, r3))]
            ap = builder.gep(_data(context, builder, signature.args[8], a), [ao])
            # The four rows (adjacent in memory) are read side by side, each slowly (one block a
            # step): the hardware prefetchers lose track of them (4 blocks a step: two lines,
            # three for Q8_0's 136 bytes)
            if prefetch:
                ir_prefetch_rows_ahead(builder, wp, wo, block_bytes)
            def at(ptr, off, ty):
                return builder.load(builder.bitcast(builder.gep(ptr, [ir.Constant(ir.IntType(64), off)]),
                                                    ty.as_pointer()), align=1)

            if with_min:  # (d, m) of each row as one i32: [d0, m0, d1, m1, ...] after the conversion
                wv = ir.Constant(ir.VectorType(i32, 4), ir.Undefined)
                for r in range(4):
                    wv = builder.insert_element(wv, at(wp[r], d_off, i32), ir.Constant(i32, r))
                wf = ir_f16_vec_to_f32(builder, builder.bitcast(wv, ir.VectorType(i16, 8)))
                av = _splat(builder, at(ap, a_d_off, i32), 4)
                af = ir_f16_vec_to_f32(builder, builder.bitcast(av, ir.VectorType(i16, 8)))
                dprod = builder.fmul(wf, af)
                fma8 = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v8f, [v8f] * 3), "llvm.fma.v8f32")
                sptr = builder.bitcast(ps, v8f.as_pointer())
                builder.store(builder.call(fma8, [wf, af, builder.load(sptr, align=4)]), sptr, align=4)
                pick = (0, 2, 4, 6)
            else:
                wv = ir.Constant(ir.VectorType(i16, 4), ir.Undefined)
                for r in range(4):
                    wv = builder.insert_element(wv, at(wp[r], d_off, i16), ir.Constant(i32, r))
                wf = ir_f16_vec_to_f32(builder, wv)
                af = ir_f16_vec_to_f32(builder, _splat(builder, at(ap, a_d_off, i16), 4))
                dprod = builder.fmul(wf, af)
                pick = (0, 1, 2, 3)
            a32 = ir_int8x32(builder, builder.gep(ap, [ir.Constant(ir.IntType(64), a_q_off)]))
            a64 = builder.shuffle_vector(a32, a32, ir.Constant(ir.VectorType(_I32, 64), list(range(32)) * 2))
            fma16 = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v16f, [v16f] * 3), "llvm.fma.v16f32")
            for pair, accp in ((0, p01), (1, p23)):
                w8 = decode2(builder, wp[2 * pair], wp[2 * pair + 1])
                lanes = ir_lanes_offset(builder, w8, a64, offset)
                i0, i1 = pick[2 * pair], pick[2 * pair + 1]
                dv = builder.shuffle_vector(dprod, dprod, ir.Constant(ir.VectorType(_I32, 16), [i0] * 8 + [i1] * 8))
                vptr = builder.bitcast(accp, v16f.as_pointer())
                acc = builder.load(vptr, align=4)
                builder.store(builder.call(fma16, [dv, builder.sitofp(lanes, v16f), acc]), vptr, align=4)
            return context.get_dummy_value()

        return sig, codegen

    return block4_dot


def _rows4_step(context, builder, sig, args, size):
    """The four weight rows' pointers (i8*) at a 64-element step of a four-row float kernel
    (args: acc, w0, w1, w2, w3, i, x; values of ``size`` bytes), their prefetch emitted, and the
    step's byte offset."""
    off = builder.mul(args[5], args[5].type(size))
    wp = [builder.gep(_data(context, builder, sig.args[1 + r], args[1 + r]), [off]) for r in range(4)]
    ir_prefetch_rows_ahead(builder, wp, off, 64 * size)
    return wp, off


def _acc_ptr(context, builder, aty, aval, k, n):
    """Pointer to the n float32 at acc[k] (k: a Python int or an i64 value) as <n x float>*."""
    base = _data(context, builder, aty, aval, _F32)
    off = ir.Constant(ir.IntType(64), k) if isinstance(k, int) else k
    return builder.bitcast(builder.gep(base, [off]), ir.VectorType(_F32, n).as_pointer())


def _make_reduce(parts):
    """An intrinsic reduce(acc, k) -> float32 of acc[k:k + 16 * parts] (float32 array or pointer):
    parts 1: _mm512_reduce_add_ps (ir_reduce_add_16); parts 4: ggml_vec_dot_f32 / _f16's AVX-512
    reduction of its four 16-lane accumulators, (acc0 + acc2) + (acc1 + acc3) lane-wise, then
    _mm512_reduce_add_ps. In vector operations."""

    def reduce(typingctx, acc, k):
        if not (isinstance(k, types.Integer) and _flat(acc)):
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
    of the step. The rows are prefetched ahead (ir_prefetch_rows_ahead), as the block formats'
    four-row kernels do."""
    if not (isinstance(x, types.Array) and x.dtype in (types.float32, types.uint16) and _flat(acc, w0, w1, w2, w3)):
        return None
    half = x.dtype == types.uint16
    elt, size = (ir.IntType(16), 2) if half else (_F32, 4)
    v64f = ir.VectorType(_F32, 64)
    sig = types.void(acc, w0, w1, w2, w3, types.intp, x)

    def codegen(context, builder, signature, args):
        wp, off = _rows4_step(context, builder, signature, args, size)

        def load(p_i8):
            v = _vload(builder, p_i8, 64, elt, size)
            return ir_f16_vec_to_f32(builder, v) if half else v

        xf = load(builder.gep(_data(context, builder, signature.args[6], args[6]), [off]))
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
    if not (isinstance(x, types.Array) and x.dtype == types.uint16 and _flat(acc, w0, w1, w2, w3)):
        return None
    sig = types.void(acc, w0, w1, w2, w3, types.intp, x)
    v32i = ir.VectorType(_I32, 32)

    def codegen(context, builder, signature, args):
        wp, off = _rows4_step(context, builder, signature, args, 2)

        def load(p_i8):  # (odd, even) elements as float32: the high and the low half of each pair
            v = _vload(builder, p_i8, 32, _I32, 2)
            return (builder.bitcast(builder.and_(v, ir.Constant(v32i, [-65536] * 32)), ir.VectorType(_F32, 32)),
                    builder.bitcast(builder.shl(v, ir.Constant(v32i, [16] * 32)), ir.VectorType(_F32, 32)))

        xo, xe = load(builder.gep(_data(context, builder, signature.args[6], args[6]), [off]))
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
            q = decode(builder, builder.gep(_data(context, builder, signature.args[4], w), [wo]))
            r = builder.fmul(builder.sitofp(q, v32f), _splat(builder, dval, 32))
            if with_min:
                r = builder.fadd(r, _splat(builder, mval, 32))
            dst = builder.gep(_data(context, builder, signature.args[0], o, _F32), [oo])
            builder.store(r, builder.bitcast(dst, v32f.as_pointer()), align=4)
            return context.get_dummy_value()

        return sig, codegen

    return block_dequant


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
    v = _vload(builder, qs_ptr, 16)
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


# kvalues_iq4nl + 128 as bytes: the unsigned codes of the IQ4 weights (offset 128, ir_lanes_offset)
IQ4NL_TABLE_U8 = [int(v) + 128 for v in KVALUES_IQ4NL]


# ---------------------------------------------------------------------------------------------
# K-quant super-block pieces (kquants.py): weights unpacked to uint8 arrays, int32 lane sums.
# ---------------------------------------------------------------------------------------------


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


@ir_intrinsic(lambda p, qb, qo, ya, yo, s_lo, s_hi: types.void(p, qb, types.intp, ya, types.intp, types.int32,
                                                               types.int32) if _flat(p, qb, ya) else None)
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
    q8 = ir_int8x32(builder, builder.gep(_data(context, builder, qb_t, qb_v), [qo_v]))
    y8 = ir_int8x32(builder, builder.gep(_data(context, builder, ya_t, ya_v), [yo_v]))
    lanes = ir_lanes(builder, q8, y8)
    scale = builder.shuffle_vector(_splat(builder, slo_v, 8), _splat(builder, shi_v, 8),
                                   ir.Constant(_V8I, [0, 1, 2, 3, 12, 13, 14, 15]))
    p_ptr = builder.bitcast(_data(context, builder, p_t, p_v, _I32), _V8I.as_pointer())
    builder.store(builder.add(builder.load(p_ptr, align=4), builder.mul(lanes, scale)), p_ptr, align=4)


_V16I = ir.VectorType(_I32, 16)


@ir_intrinsic(lambda p16, qb, qo, ya, yo, sv, so: types.void(p16, qb, types.intp, ya, types.intp, sv, types.intp)
              if _flat(p16, qb, ya, sv) else None)
def dot64_scaled_add(context, builder, sig, args):
    """p16[j] += sv[so+j] * sum_{i<4} qb[qo+4j+i] * int8(ya[yo+4j+i]), j = 0..15: two consecutive
    32-value chunks at once (lanes 0..7 the first chunk's, 8..15 the second's; one vpdpbusd.512).
    With sv[so+j] the scale of lane j % 8 of chunk j // 8, fold16_add(p, p16) then gives p exactly
    the int32 lanes of dot32_scaled_add on the two chunks (wrapping int32 sums: any order).
    p16, sv: int32[16] (arrays or pointers); qb, ya as in dot32_scaled_add."""
    p_t, qb_t, _, ya_t, _, sv_t, _ = sig.args
    p_v, qb_v, qo_v, ya_v, yo_v, sv_v, so_v = args
    q8 = _vload(builder, builder.gep(_data(context, builder, qb_t, qb_v), [qo_v]), 64)
    y8 = _vload(builder, builder.gep(_data(context, builder, ya_t, ya_v), [yo_v]), 64)
    lanes = ir_lanes(builder, q8, y8)
    sv_ptr = builder.gep(_data(context, builder, sv_t, sv_v, _I32), [so_v])
    scale = builder.load(builder.bitcast(sv_ptr, _V16I.as_pointer()), align=4)
    p_ptr = builder.bitcast(_data(context, builder, p_t, p_v, _I32), _V16I.as_pointer())
    builder.store(builder.add(builder.load(p_ptr, align=4), builder.mul(lanes, scale)), p_ptr, align=4)


@ir_intrinsic(lambda p16, qb, qo, qh, ho, ya, yo, sv, so: types.void(
    p16, qb, types.intp, qh, types.intp, ya, types.intp, sv, types.intp) if _flat(p16, qb, qh, ya, sv) else None)
def dot64_diff_scaled_add(context, builder, sig, args):
    """p16[j] += sv[so+j] * (lanes(qb[qo:]) - lanes(qh[ho:]))[j], j = 0..15, with lanes(q) the 4-value
    sums of q * int8(ya[yo:yo+64]) (as dot64_scaled_add): for weights stored as a difference of two
    unsigned parts (Q3_K's low bits and "minus 4", IQ4_XS's kvalues + 128 and 128), the int32 lanes
    of dot32_scaled_add(qb, s) then dot32_scaled_add(qh, -s) on each chunk, in one multiply."""
    p_t, qb_t, _, qh_t, _, ya_t, _, sv_t, _ = sig.args
    p_v, qb_v, qo_v, qh_v, ho_v, ya_v, yo_v, sv_v, so_v = args
    y8 = _vload(builder, builder.gep(_data(context, builder, ya_t, ya_v), [yo_v]), 64)
    l1 = ir_lanes(builder, _vload(builder, builder.gep(_data(context, builder, qb_t, qb_v), [qo_v]), 64), y8)
    l2 = ir_lanes(builder, _vload(builder, builder.gep(_data(context, builder, qh_t, qh_v), [ho_v]), 64), y8)
    sv_ptr = builder.gep(_data(context, builder, sv_t, sv_v, _I32), [so_v])
    scale = builder.load(builder.bitcast(sv_ptr, _V16I.as_pointer()), align=4)
    p_ptr = builder.bitcast(_data(context, builder, p_t, p_v, _I32), _V16I.as_pointer())
    builder.store(builder.add(builder.load(p_ptr, align=4), builder.mul(builder.sub(l1, l2), scale)), p_ptr, align=4)


@ir_intrinsic(lambda p, p16: types.void(p, p16) if _flat(p, p16) else None)
def fold16_add(context, builder, sig, args):
    """p[k] += p16[k] + p16[8+k], k = 0..7 (int32, wrapping): dot64_scaled_add's two chunk halves
    into the 8 lanes."""
    (p_t, p16_t), (p_v, p16_v) = sig.args, args
    v = builder.load(builder.bitcast(_data(context, builder, p16_t, p16_v, _I32), _V16I.as_pointer()), align=4)
    lo = builder.shuffle_vector(v, v, ir.Constant(_V8I, list(range(8))))
    hi = builder.shuffle_vector(v, v, ir.Constant(_V8I, list(range(8, 16))))
    p_ptr = builder.bitcast(_data(context, builder, p_t, p_v, _I32), _V8I.as_pointer())
    builder.store(builder.add(builder.load(p_ptr, align=4), builder.add(lo, hi)), p_ptr, align=4)


@ir_intrinsic(lambda p16: types.void(p16) if _flat(p16) else None)
def zero16(context, builder, sig, args):
    """p16[0:16] = 0 (int32[16], array or pointer), as one <16 x i32> store."""
    ptr = builder.bitcast(_data(context, builder, sig.args[0], args[0], _I32), _V16I.as_pointer())
    builder.store(ir.Constant(_V16I, [0] * 16), ptr, align=4)


@ir_intrinsic(lambda acc, d, p: types.void(acc, types.float32, p) if _flat(acc, p) else None)
def lanes_fma8(context, builder, sig, args):
    """acc[k] = fma(d, float32(p[k]), acc[k]) for k = 0..7 (acc: float32[>= 8], p: int32[8], each
    an array or a raw pointer, e.g. ptr_offset(accs, 8 * n)):
    _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(sumi), acc) as one <8 x float> llvm.fma (ir_fma8)."""
    (acc_t, _, p_t), (acc_v, d_v, p_v) = sig.args, args
    lanes = builder.load(builder.bitcast(_data(context, builder, p_t, p_v, _I32), _V8I.as_pointer()), align=4)
    ir_fma8(builder, _data(context, builder, acc_t, acc_v, _F32), d_v, lanes, splat_first=True)


@ir_intrinsic(lambda p, coef, a, off: types.void(p, coef, a, types.intp) if _flat(p, coef, a) else None)
def bsums_madd8(context, builder, sig, args):
    """p[k] = coef[2k] * bs[2k] + coef[2k+1] * bs[2k+1], k = 0..7, for the 16 little-endian int16
    bsums bs at byte offset off of a (a Q8_K block's, flat as _data) and int32 coef[16]; exact
    int32 (as _mm256_madd_epi16 on ggml's 16-bit operands). p, coef: int32 arrays or pointers."""
    (p_t, c_t, a_t, _), (p_v, c_v, a_v, off_v) = sig.args, args
    v16i = ir.VectorType(_I32, 16)
    bs_ptr = builder.gep(_data(context, builder, a_t, a_v), [off_v])
    bs = builder.sext(_vload(builder, bs_ptr, 16, ir.IntType(16)), v16i)
    coef = builder.load(builder.bitcast(_data(context, builder, c_t, c_v, _I32), v16i.as_pointer()), align=4)
    prod = builder.mul(bs, coef)
    undef = ir.Constant(v16i, ir.Undefined)
    even = builder.shuffle_vector(prod, undef, ir.Constant(_V8I, list(range(0, 16, 2))))
    odd = builder.shuffle_vector(prod, undef, ir.Constant(_V8I, list(range(1, 16, 2))))
    builder.store(builder.add(even, odd), builder.bitcast(_data(context, builder, p_t, p_v, _I32), _V8I.as_pointer()),
                  align=4)


@ir_intrinsic(lambda acc, d, p: types.void(acc, types.float32, p) if _flat(acc, p) else None)
def pairs_fma4(context, builder, sig, args):
    """acc[m] = fma(d, float32(p[2m] + p[2m+1]), acc[m]) for m = 0..3 (acc: float32[4], p: int32[8];
    arrays or pointers): four lanes of one <4 x float> llvm.fma, each the scalar fma's bits."""
    (acc_t, _, p_t), (acc_v, d_v, p_v) = sig.args, args
    v4i, v4f = ir.VectorType(_I32, 4), ir.VectorType(_F32, 4)
    lanes = builder.load(builder.bitcast(_data(context, builder, p_t, p_v, _I32), _V8I.as_pointer()), align=4)
    undef = ir.Constant(_V8I, ir.Undefined)
    s = builder.add(builder.shuffle_vector(lanes, undef, ir.Constant(v4i, [0, 2, 4, 6])),
                    builder.shuffle_vector(lanes, undef, ir.Constant(v4i, [1, 3, 5, 7])))
    aptr = builder.bitcast(_data(context, builder, acc_t, acc_v, _F32), v4f.as_pointer())
    fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v4f, [v4f] * 3), "llvm.fma.v4f32")
    builder.store(builder.call(fma, [_splat(builder, d_v, 4), builder.sitofp(s, v4f), builder.load(aptr, align=4)]),
                  aptr, align=4)


@ir_intrinsic(lambda p: types.int32(p) if _flat(p) else None)
def isum8(context, builder, sig, args):
    """p[0] + ... + p[7] (int32[8], array or pointer; wrapping int32, so the order is immaterial)."""
    v = builder.load(builder.bitcast(_data(context, builder, sig.args[0], args[0], _I32), _V8I.as_pointer()), align=4)
    for half in (4, 2, 1):  # a shuffle tree: halves added lane-wise
        lo = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, half), list(range(half))))
        hi = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, half), list(range(half, 2 * half))))
        v = builder.add(lo, hi)
    return builder.extract_element(v, ir.Constant(_I32, 0))


@ir_intrinsic(lambda qb, qo, w, wo: types.void(qb, types.intp, w, types.intp))
def iq4_lookup32(context, builder, sig, args):
    """qb[qo+t] = kvalues_iq4nl[w[wo+t] & 15] + 128, qb[qo+16+t] = ...[w[wo+t] >> 4] + 128, t < 16
    (unsigned bytes for dot32_scaled_add; ir_lookup_nibbles32)."""
    (qb_t, _, w_t, _), (qb_v, qo_v, w_v, wo_v) = sig.args, args
    v = ir_lookup_nibbles32(builder, builder.gep(_data(context, builder, w_t, w_v), [wo_v]), IQ4NL_TABLE_U8)
    dst = builder.gep(_data(context, builder, qb_t, qb_v), [qo_v])
    builder.store(v, builder.bitcast(dst, v.type.as_pointer()), align=1)


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


_V16F = ir.VectorType(_F32, 16)


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
    out = builder.gep(_data(context, builder, sig.args[0], y, _F32), [m])
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


@ir_intrinsic(lambda a, off: types.float32(a, types.intp) if _flat(a) else None)
def load_f32(context, builder, sig, args):
    """The little-endian float32 at byte offset off of a uint8 array or pointer (flat, as _data):
    one unaligned load (the Q8_K block's d)."""
    ptr = builder.gep(_data(context, builder, sig.args[0], args[0]), [args[1]])
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


# ---------------------------------------------------------------------------------------------
# Four K-quant weight rows against one Q8_K activation row, one super-block per call
# (kquants.py vec_dot4_T_q8_K): the vector form of the formats' vec_dot per super-block.
# ---------------------------------------------------------------------------------------------


def ir_bytes(builder, ptr, off, n):
    """<n x i8> at byte offset off (a Python int) of the i8* ptr (unaligned load)."""
    return _vload(builder, builder.gep(ptr, [ir.Constant(ir.IntType(64), off)]), n)


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


def _madd_pairs(builder, x, y):
    """<2n x i32> x, y -> <n x i32>: x[2i]*y[2i] + x[2i+1]*y[2i+1] (exact for the K-quants' small
    operands; _mm256_madd_epi16)."""
    n = x.type.count
    prod = builder.mul(x, y)
    return builder.add(ir_shuffle(builder, prod, None, range(0, n, 2)), ir_shuffle(builder, prod, None, range(1, n, 2)))


def _lanes64_acc(builder, w8, a8, acc):
    """acc + the 16 int32 lanes of unsigned w8 x signed a8 (<64 x i8>; vpdpbusd.512 with acc as its
    accumulator, else portable IR): wrapping int32, the same bits either way."""
    if HAS_VNNI512:
        return _vpdpbusd(builder, acc, w8, a8)
    return builder.add(acc, _lanes_portable(builder, w8, a8, False))


def make_superblock4_dot(block_bytes, d_off, values, scales, per_half, offset=0, dmin_off=None, mins=None,
                         small_values=True, values2=None, prefetch=True):
    """Build the four-row super-block intrinsic of a K-quant format (kquants.py vec_dot4_T_q8_K):
        sb4_dot(acc01, acc23, accx, w0, w1, w2, w3, w_off, a_row, a_off)
    does for each row r < 4 exactly the super-block step of the format's vec_dot_T_q8_K: the same
    eight exact int32 lanes p_r (lane k: sum over the 32-value chunks c of scale * the 4-value sums
    at 4k..4k+3), the same float32 roundings per lane, in shared vector operations:
      d_r = y.d * F16(w_r[d_off]) (dmin_r = -y.d * F16(w_r[dmin_off])), four rows in one multiply;
      per row pair (0, 1 / 2, 3) and chunk c one 16-lane step on [row a's chunk c, row b's chunk c]
      against the chunk's 32 activations twice: with ``small_values`` (stored values < 128) and
      AVX512-VNNI, vpmaddubsw (pairs of products in int16: |.| <= 2 * 127 * 128, never saturated)
      then vpdpwssd with the lanes' scales (scale and add in one op); else vpdpbusd.512, times the
      scales, added (portable IR without VNNI); acc_pair = fma(d, float(lanes), acc_pair).
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
    ``prefetch``: fetch the weights ahead (ir_prefetch_rows_ahead)."""
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
            use_madd = HAS_VNNI512 and small_values
            wp = [builder.gep(_data(context, builder, signature.args[3 + r], v), [wo])
                  for r, v in enumerate((r0, r1, r2, r3))]
            ap = builder.gep(_data(context, builder, signature.args[8], a), [ao])
            if prefetch:  # as make_block4_dot
                ir_prefetch_rows_ahead(builder, wp, wo, block_bytes)
            if use_madd:
                maddubs = cgutils.get_or_insert_function(builder.module, ir.FunctionType(
                    ir.VectorType(i16, 32), [ir.VectorType(_I8, 64)] * 2), "llvm.x86.avx512.pmaddubs.w.512")
                dpwssd = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V16I, [_V16I] * 3),
                                                        "llvm.x86.avx512.vpdpwssd.512")
            yd = builder.load(builder.bitcast(ap, _F32.as_pointer()), align=1)
            # the rows' F16 d (and dmin) in one conversion and one multiply: dm[di(r)], dm[mi(r)]
            if has_min:
                wf = ir_f16_vec_to_f32(builder, builder.bitcast(ir_vec(builder, [ir_word(builder, p, d_off)
                                                                                 for p in wp]), ir.VectorType(i16, 8)))
                ydv = ir_vec(builder, [yd, builder.fneg(yd)] * 4)
                di, mi = (lambda r: 2 * r), (lambda r: 2 * r + 1)
            else:
                wf = ir_f16_vec_to_f32(builder, ir_vec(builder, [ir_word(builder, p, d_off, 16) for p in wp]))
                ydv = _splat(builder, yd, 4)
                di, mi = (lambda r: r), None
            dm = builder.fmul(ydv, wf)
            bs = None
            if mins is not None:
                bs = builder.sext(_vload(builder, builder.gep(ap, [ir.Constant(i64, 260)]), 16, i16), _V16I)
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
                        builder.call(maddubs, [ir_splat_const(_I8, offset, 64), a64]))
                else:
                    acc0 = ir.Constant(_V16I, [0] * 16)
                    if offset:
                        acc0 = builder.sub(acc0, _lanes64_acc(builder, ir_splat_const(_I8, offset, 64), a64, acc0))
                for q, (ra, rb) in enumerate(pairs):
                    if values2 is not None:
                        v = values2(builder, wp[ra], wp[rb], c)
                    else:
                        v = ir_shuffle(builder, values(builder, wp[ra], c), values(builder, wp[rb], c), range(64))
                    if use_madd:  # vpmaddubsw (word w: 2 products, no saturation: values < 128) + vpdpwssd
                        t = builder.call(maddubs, [v, a64])
                        if offset:
                            t = builder.add(t, acc0)
                        sv = ir_shuffle(builder, tabs[q], None, [sidx(c, L) for L in range(16) for _ in range(2)])
                        lanes[q] = builder.call(dpwssd, [lanes[q], builder.bitcast(t, _V16I),
                                                         builder.bitcast(sv, _V16I)])
                    else:
                        sv = ir_shuffle(builder, tabs[q], None, [sidx(c, L) for L in range(16)] if per_half
                                        else [c] * 8 + [8 + c] * 8)
                        lanes[q] = builder.add(lanes[q], builder.mul(sv, _lanes64_acc(builder, v, a64, acc0)))
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
