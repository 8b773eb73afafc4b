"""Scalar helpers shared by the kernels: F16/BF16 conversions and an exact FMA.

All functions are plain ``@njit(cache=True)`` so that kernels inline them.

Sources reproduced:
  * ``ggml_table_f32_f16`` / ``GGML_CPU_FP16_TO_FP32`` (F16 -> F32, exact),
  * ``GGML_CPU_FP32_TO_FP16`` on x86 with F16C (``_cvtss_sh(x, 0)``: round to nearest even,
    overflow to inf),
  * ``GGML_BF16_TO_FP32`` (exact) and the BF16 rounding of ``ggml_cpu_fp32_to_bf16``
    (round to nearest even, NaN kept quiet),
  * ``_mm256_fmadd_ps`` / ``_mm512_fmadd_ps`` (one rounding), through LLVM's ``llvm.fma.f32``.
"""

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

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


@njit(cache=True, inline="always")
def f16_to_f32(h):
    """F16 bits (uint16) -> float32, exact (ggml_table_f32_f16 lookup)."""
    return F16_TO_F32_TABLE[h]


@njit(cache=True, inline="always")
def f16_le(buf, off):
    """float32 value of the little-endian F16 stored at buf[off:off+2] (uint8 buffer)."""
    return F16_TO_F32_TABLE[np.uint16(buf[off]) | (np.uint16(buf[off + 1]) << np.uint16(8))]


@njit(cache=True, inline="always")
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


@njit(cache=True, inline="always")
def f32_to_bf16_bits(u):
    """float32 bits ``u`` (uint32) -> BF16 bits, round to nearest even; NaN stays a quiet NaN.

    ggml_compute_fp32_to_bf16 (ggml-impl.h).
    """
    if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
        return np.uint16((u >> np.uint32(16)) | np.uint32(64))
    return np.uint16((u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16))


@njit(cache=True, inline="always")
def hsum_float_8(a0, a1, a2, a3, a4, a5, a6, a7):
    """Horizontal sum of 8 float32 lanes in ggml's hsum_float_8 order (x86/quants.c):
    ((a0+a4) + (a2+a6)) + ((a1+a5) + (a3+a7))."""
    r0 = a0 + a4
    r1 = a1 + a5
    r2 = a2 + a6
    r3 = a3 + a7
    return (r0 + r2) + (r1 + r3)


@njit(cache=True, inline="always")
def reduce_add_16(v):
    """_mm512_reduce_add_ps of 16 float32 lanes v[0:16] (GCC's order):
    halves (v[i] + v[i+8]), then (t[i] + t[i+4]), then (u[0]+u[2]) + (u[1]+u[3])."""
    t0 = v[8] + v[0]
    t1 = v[9] + v[1]
    t2 = v[10] + v[2]
    t3 = v[11] + v[3]
    t4 = v[12] + v[4]
    t5 = v[13] + v[5]
    t6 = v[14] + v[6]
    t7 = v[15] + v[7]
    u0 = t4 + t0
    u1 = t5 + t1
    u2 = t6 + t2
    u3 = t7 + t3
    return (u0 + u2) + (u1 + u3)


@intrinsic
def u32_as_f32(typingctx, u):
    """float32 whose bit pattern is the uint32 ``u`` (LLVM bitcast)."""
    sig = types.float32(types.uint32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return sig, codegen
