"""Activation converters: one float32 row -> the block bytes ggml's vec_dot consumes.

Each is ``quantize_row_T(out: uint8[:], x: float32[:])`` (``@kernel(nested=True)``: the drivers of
matmul.py call it), output first; ``out`` holds exactly ``len(x) // block * block_bytes`` bytes.
The caller (matmul.py) validates sizes. Q8_K lives in kquants.py.
"""

import numpy as np
from .decorator import kernel
from .scalar import copy_u32, f32_bits, f32_to_bf16_bits, f32_to_f16_bits

QK8_0 = 32
Q8_0_BYTES = 34  # f16 d, int8 qs[32]
Q8_1_BYTES = 36  # f16 d, f16 s, int8 qs[32]  (gguf-py's GGML_QUANT_SIZES says 40: stale)


@kernel(inline="always")
def _cvt_i32(v):
    """_mm256_round_ps(nearest) + _mm256_cvtps_epi32: half to even; out of range or NaN gives
    the 'integer indefinite' INT32_MIN (only reachable when 127/amax overflows, amax < 4e-37)."""
    if abs(v) < np.float32(2147483648.0):
        return np.int32(np.rint(v))
    return np.int32(-2147483648)


@kernel(inline="always")
def _sat8(q):
    """_mm256_packs_epi32 then _mm256_packs_epi16: saturate int32 to int8."""
    return np.int32(min(max(q, -128), 127))


@kernel(inline="always")
def _q8_block_scale(out, x, b, o):
    """Block b of a Q8_0/Q8_1 row: amax = max|x|, d = amax / 127 written as F16 at out[o:o+2];
    returns (d before its F16 rounding, id = 127 / amax or 0 when amax == 0)."""
    amax = np.float32(0.0)
    for j in range(QK8_0):
        amax = max(amax, abs(x[b * QK8_0 + j]))
    d = amax / np.float32(127.0)
    h = f32_to_f16_bits(d, f32_bits(d))
    out[o] = np.uint8(h & np.uint16(0xFF))
    out[o + 1] = np.uint8(h >> np.uint16(8))
    idv = np.float32(127.0) / amax if amax != np.float32(0.0) else np.float32(0.0)
    return d, idv


@kernel(nested=True)
def quantize_row_q8_0(out, x):
    """Quantize x (float32 [K], K % 32 == 0) to Q8_0 blocks in out (uint8 [K/32*34]).

    Reproduces ggml-cpu/arch/x86/quants.c quantize_row_q8_0 (AVX2 path): per block
    amax = max|x|, d = amax / 127 stored as F16 (round to nearest even), id = 127 / amax
    (0 when amax == 0), q = round_half_even(x * id) as int8 (saturating packs).
    """
    nb = x.size // QK8_0
    for b in range(nb):
        o = b * Q8_0_BYTES
        d, idv = _q8_block_scale(out, x, b, o)
        for j in range(QK8_0):
            out[o + 2 + j] = np.uint8(_sat8(_cvt_i32(x[b * QK8_0 + j] * idv)) & 0xFF)


@kernel(nested=True)
def quantize_row_q8_1(out, x):
    """Quantize x (float32 [K], K % 32 == 0) to Q8_1 blocks in out (uint8 [K/32*36]).

    Reproduces ggml-cpu/arch/x86/quants.c quantize_row_q8_1 (AVX2 path): as Q8_0, plus
    s = F16(d * sum(q)) computed with d = amax/127 *before* d is rounded to F16.
    """
    nb = x.size // QK8_0
    for b in range(nb):
        o = b * Q8_1_BYTES
        d, idv = _q8_block_scale(out, x, b, o)
        isum = np.int64(0)
        for j in range(QK8_0):
            q = _cvt_i32(x[b * QK8_0 + j] * idv)
            isum += q
            out[o + 4 + j] = np.uint8(_sat8(q) & 0xFF)
        s = d * np.float32(np.int32(isum))  # int32 wraparound, as _mm256_add_epi32
        hs = f32_to_f16_bits(s, f32_bits(s))
        out[o + 2] = np.uint8(hs & np.uint16(0xFF))
        out[o + 3] = np.uint8(hs >> np.uint16(8))


@kernel(nested=True)
def quantize_row_f16(out, x):
    """Round x (float32 [K]) to F16 (round to nearest even) into out (uint8 [2K], little endian).

    Reproduces ggml_cpu_fp32_to_fp16 (F16C vcvtps2ph) used as from_float for F16 weights.
    """
    xb = x.view(np.uint32)
    o16 = out.view(np.uint16)
    for i in range(x.size):
        o16[i] = f32_to_f16_bits(x[i], xb[i])


@kernel(nested=True)
def quantize_row_bf16(out, x):
    """Round x (float32 [K]) to BF16 (round to nearest even) into out (uint8 [2K]).

    Reproduces ggml_cpu_fp32_to_bf16 / ggml_compute_fp32_to_bf16.
    """
    xb = x.view(np.uint32)
    o16 = out.view(np.uint16)
    for i in range(x.size):
        o16[i] = f32_to_bf16_bits(xb[i])


@kernel(nested=True)
def quantize_row_f32(out, x):
    """Copy x (float32 [K]) into out (uint8 [4K]) unchanged: F32 weights take float activations."""
    copy_u32(out.view(np.uint32), x.view(np.uint32))
