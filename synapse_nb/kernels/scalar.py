"""Scalar helpers of the kernels: ggml's float conversions and roundings, one value at a time.

Plain ``@kernel(inline="always")`` functions and small intrinsics that kernels inline. Sources
reproduced:
  * ``ggml_table_f32_f16`` / ``GGML_CPU_FP16_TO_FP32`` (F16 -> F32, exact; vcvtph2ps with F16C,
    else exact integer IR: simd.ir_f16_to_f32_portable),
  * ``GGML_CPU_FP32_TO_FP16`` on x86 with F16C (``_cvtss_sh(x, 0)``: round to nearest even,
    overflow to inf),
  * ``GGML_BF16_TO_FP32`` (exact) and the BF16 rounding of ``ggml_cpu_fp32_to_bf16``
    (round to nearest even, NaN kept quiet),
  * ``_mm256_fmadd_ps`` / ``_mm512_fmadd_ps`` (one rounding), through LLVM's ``llvm.fma.f32``,
  * x86 ``hsum_float_8`` (ggml-cpu/arch/x86/quants.c),
and the value tables the kernels share (kvalues_iq4nl, ggml_table_f32_f16).
"""

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ..formats import KVALUES_IQ4NL as _KVALUES_IQ4NL
from . import simd
from .decorator import kernel

# ggml-common.h kvalues_iq4nl: the 16 non-linear levels of IQ4_NL / IQ4_XS (defined in formats.py).
KVALUES_IQ4NL = _KVALUES_IQ4NL

# ggml_table_f32_f16: every F16 bit pattern as F32 (exact; 256 KiB, frozen into kernels as a constant).
F16_TO_F32_TABLE = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)


# kvalues_iq4nl + 128 as bytes: the unsigned codes of the IQ4 weights (offset 128, ir_lanes_offset)
IQ4NL_TABLE_U8 = [int(v) + 128 for v in KVALUES_IQ4NL]


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
        if simd.HAS_F16C:
            return builder.fpext(builder.bitcast(v, ir.HalfType()), ir.FloatType())
        return simd.ir_f16_to_f32_portable(builder, v)

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


@kernel(inline="always")
def copy_u32(dst, src):
    """dst[i] = src[i] for the dst.size 32-bit words (F32 rows viewed as uint32: bits unchanged)."""
    for i in range(dst.size):
        dst[i] = src[i]


@kernel(inline="always")
def f16_le(buf, off):
    """float32 value of the little-endian F16 stored at buf[off:off+2] (uint8 buffer)."""
    return f16_to_f32(np.uint16(buf[off]) | (np.uint16(buf[off + 1]) << np.uint16(8)))


@kernel(inline="always")
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


@kernel(inline="always")
def f32_to_bf16_bits(u):
    """float32 bits ``u`` (uint32) -> BF16 bits, round to nearest even; NaN stays a quiet NaN.

    ggml_compute_fp32_to_bf16 (ggml-impl.h).
    """
    if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
        return np.uint16((u >> np.uint32(16)) | np.uint32(64))
    return np.uint16((u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16))


@kernel(inline="always")
def hsum_float_8(a):
    """Horizontal sum of the 8 float32 lanes a[0:8] in ggml's hsum_float_8 order (x86/quants.c):
    ((a0+a4) + (a2+a6)) + ((a1+a5) + (a3+a7))."""
    r0 = a[0] + a[4]
    r1 = a[1] + a[5]
    r2 = a[2] + a[6]
    r3 = a[3] + a[7]
    return (r0 + r2) + (r1 + r3)


@intrinsic
def u32_as_f32(typingctx, u):
    """float32 whose bit pattern is the uint32 ``u`` (LLVM bitcast)."""
    sig = types.float32(types.uint32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return sig, codegen


