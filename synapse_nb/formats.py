"""ggml block formats: layouts, the activation format ggml pairs with each, NumPy references.

One class per format, registered by ggml type (the gguf-py quants.py style). Each class knows
its block size (values per block), type size (bytes per block) and vec_dot_type (the format
ggml-cpu converts activations to before the dot product, ggml-cpu.c type_traits_cpu), and offers
NumPy references:
  * ``dequantize(blocks: uint8[..., n*type_size]) -> float32[..., n*block_size]`` (weights);
  * ``quantize(x: float32[..., K]) -> uint8[...]`` for activation formats, transcribing ggml's
    x86 CPU quantizers (not the _ref ones where they differ);
  * ``vec_dot(w_row: uint8[:], a_row: uint8[:]) -> float32`` for weight formats with NumPy
    kernels here: the same rounded math as ggml's AVX2/AVX-512 dot (lane order included).
These references are slow and exist for tests; the decoder uses synapse_nb.kernels.

This registry is the one table of formats: every ggml type appears here once, and everything else
(synapse_nb.kernels.matmul.KERNELS and its drivers, hparams.WEIGHT_TYPES, the tests' and
benchmarks' type lists) iterates over it. Besides the layout, a class says where its Numba row
functions live:
  * ``kernels``: the module of synapse_nb.kernels implementing a weight format's row functions
    ("legacy" or "kquants"); None for a format that is only an activation format (Q8_1, Q8_K).
  * ``quantize_kernels``: for a format that is some weight's vec_dot_type, the module holding
    its ``quantize_row_<stem>`` ("quant_act" or "kquants").
Row functions are found by name, with ``stem`` = the type name in lower case except a trailing
"_K" (Q4_0 -> q4_0, Q4_K -> q4_K, IQ4_XS -> iq4_xs) and A = format_of(vec_dot_type):
  * ``dequantize_row_<stem>(out, w_row)``;
  * ``vec_dot_<stem>(w_row, a_row, scratch)`` for the float types (block size 1: F32, F16, BF16,
    whose activations are of their own type), else ``vec_dot_<stem>_<A.stem>``;
  * optionally ``rows_dot_<stem>_<A.stem>(y, m, w_row, a)`` (all activation rows at once);
  * ``quantize_row_<A.stem>(out, x)`` in A's ``quantize_kernels`` module.
The contracts of these functions are in synapse_nb/kernels/matmul.py.
"""

from __future__ import annotations

import numpy as np
from .gguf_spec import GGML_QUANT_SIZES, GGMLQuantizationType as GT

_REGISTRY: dict[int, "BlockFormat"] = {}
_BY_NAME: dict[str, "BlockFormat"] = {}

KVALUES_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)


def format_of(t) -> "BlockFormat":
    """The format of a ggml type given as GGMLQuantizationType, int or name ('Q4_0').

    Raises KeyError for types without a registered format.
    """
    if isinstance(t, str):
        return _BY_NAME[t.upper() if t.upper() in _BY_NAME else t]
    return _REGISTRY[int(t)]


def registered_formats():
    """All registered formats, by ggml type value."""
    return dict(_REGISTRY)


def weight_formats():
    """The formats with Numba row kernels (``kernels`` set), in ggml type order."""
    return [f for _, f in sorted(_REGISTRY.items()) if f.kernels is not None]


def _register(cls):
    """Register a format class, its block_size and type_size read from gguf_spec.GGML_QUANT_SIZES
    (the one table of block sizes; a class may correct it, as Q8_1 does)."""
    block_size, type_size = GGML_QUANT_SIZES[cls.ggml_type]
    cls.block_size = block_size
    if "type_size" not in cls.__dict__:
        cls.type_size = type_size
    if cls.__doc__ is None:
        cls.__doc__ = f"{cls.name}: {cls.block_size} values in {cls.type_size} bytes."
    inst = cls()
    _REGISTRY[int(cls.ggml_type)] = inst
    _BY_NAME[cls.name] = inst
    return cls


# --------------------------------------------------------------------------------------------
# NumPy helpers reproducing ggml's scalar rounding.
# --------------------------------------------------------------------------------------------


def f16_to_f32(h):
    """uint16 F16 bits -> float32 (exact)."""
    return np.asarray(h, np.uint16).view(np.float16).astype(np.float32)


def f32_to_f16_bits(x):
    """float32 -> F16 bits, round to nearest even (F16C vcvtps2ph / numpy astype)."""
    with np.errstate(over="ignore"):
        return np.asarray(x, np.float32).astype(np.float16).view(np.uint16)


def f32_to_bf16_bits(x):
    """float32 -> BF16 bits: ggml_compute_fp32_to_bf16 (round to nearest even, NaN quiet)."""
    u = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    r = (u + (0x7FFF + ((u >> 16) & 1))) >> 16
    r = np.where(nan, (u >> 16) | 64, r)
    return r.astype(np.uint16)


def fma32(a, b, c):
    """float32 fma(a, b, c) with one rounding (via float64: the product is exact in double)."""
    return np.float32(np.float64(np.float32(a)) * np.float64(np.float32(b)) + np.float64(np.float32(c)))


def hsum_float_8(acc):
    """ggml x86 hsum_float_8 of 8 float32 lanes: ((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7))."""
    a = np.asarray(acc, np.float32)
    r = a[4:8] + a[0:4]
    return np.float32((r[0] + r[2]) + (r[1] + r[3]))


def reduce_add_16(v):
    """_mm512_reduce_add_ps (GCC order) of 16 float32 lanes."""
    v = np.asarray(v, np.float32)
    t = v[8:16] + v[0:8]
    u = t[4:8] + t[0:4]
    return np.float32((u[0] + u[2]) + (u[1] + u[3]))


def cvt_round_i32(v):
    """x86 round-to-nearest-even + cvtps_epi32: out of range / NaN -> INT32_MIN (int64 array)."""
    v = np.asarray(v, np.float32)
    with np.errstate(invalid="ignore"):
        ok = np.abs(v) < np.float32(2147483648.0)
        return np.where(ok, np.rint(np.where(ok, v, 0)), -2147483648).astype(np.int64)


def _q8_blocks(x):
    """ggml x86 quantize_row_q8_0/q8_1 core: (d unrounded, int32 q before packing) per 32 block."""
    x = np.asarray(x, np.float32)
    xb = x.reshape(*x.shape[:-1], -1, 32)
    amax = np.abs(xb).max(axis=-1)
    d = (amax / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore", over="ignore"):
        idv = np.where(amax != 0, np.float32(127) / np.where(amax != 0, amax, 1), np.float32(0)).astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        q = cvt_round_i32((xb * idv[..., None]).astype(np.float32))
    return xb, d, q


def _lanes(p32):
    """int products of one 32-value block -> 8 float32 lane values (sums of 4 consecutive)."""
    return p32.reshape(8, 4).sum(axis=1).astype(np.float32)


def _lane_dot(prods, d):
    """acc[l] = fma(d[b], lane_l(b), acc[l]) over blocks b in order; returns the 8 lanes."""
    acc = np.zeros(8, np.float32)
    for b in range(len(d)):
        lanes = _lanes(prods[b])
        acc = (np.float64(d[b]) * lanes.astype(np.float64) + acc.astype(np.float64)).astype(np.float32)
    return acc


# --------------------------------------------------------------------------------------------
# Formats
# --------------------------------------------------------------------------------------------


class BlockFormat:
    """A ggml block format. Subclasses set name, ggml_type, vec_dot_type; _register sets block_size
    (values per block) and type_size (bytes per block) from gguf_spec.GGML_QUANT_SIZES."""

    name: str
    ggml_type: GT
    block_size: int
    type_size: int
    vec_dot_type: str | None = None
    kernels: str | None = None  # kernel module of the row functions (weight formats)
    quantize_kernels: str | None = None  # kernel module of quantize_row_<stem> (activation formats)
    # byte offsets in a block of its F16 scale fields (d, and dmin / m / s where there is one):
    # what a generator of random blocks must fill with finite values (tests, benchmarks)
    f16_fields: tuple[int, ...] = ()
    # A matmul of up to this many activation rows runs the matvec driver (vec_dot4) for one row
    # after another, each chunk's weights read from memory once (matmul.py): the same bits as the
    # several-row kernel. Set where that kernel's per-block weight work costs more than a few
    # rows' dots: the K-quants' rows_dot / rows_dot2 unpack every super-block for the batch
    # (Qwen2.5's 896 x 4864 Q4_K, 2 threads: 2 rows 110 us against 217, 6 rows 317 against 331).
    matvec_rows: int = 1

    @property
    def stem(self) -> str:
        """Name used in row-function names: 'q4_0', 'q4_K', 'iq4_xs', 'f32'."""
        low = self.name.lower()
        return low[:-2] + "_K" if low.endswith("_k") else low

    def vec_dot_name(self) -> str:
        """Name of the row dot function (vec_dot_<stem>[_<act stem>])."""
        if self.block_size == 1:
            return f"vec_dot_{self.stem}"
        return f"vec_dot_{self.stem}_{format_of(self.vec_dot_type).stem}"

    def rows_dot_name(self) -> str:
        """Name of the optional multi-row dot function (rows_dot_<stem>_<act stem>)."""
        return f"rows_dot_{self.stem}_{format_of(self.vec_dot_type).stem}"

    def vec_dot4_name(self) -> str:
        """Name of the optional four-weight-row dot function (vec_dot4_<stem>[_<act stem>], as
        vec_dot_name)."""
        return self.vec_dot_name().replace("vec_dot_", "vec_dot4_", 1)

    def row_bytes(self, k: int) -> int:
        """Bytes of one row of k values (k a multiple of block_size)."""
        return k // self.block_size * self.type_size

    def blocks(self, data) -> np.ndarray:
        """View bytes as uint8 [..., n_blocks, type_size]."""
        b = np.asarray(data).view(np.uint8)
        return b.reshape(*b.shape[:-1], -1, self.type_size)

    def dequantize(self, data) -> np.ndarray:
        """NumPy reference dequantize of rows of blocks (uint8 [..., row_bytes]) -> float32."""
        import gguf.quants

        b = np.asarray(data).view(np.uint8)
        return gguf.quants.dequantize(b, self.ggml_type).astype(np.float32)

    def __repr__(self):
        return f"<format {self.name}: {self.block_size} values / {self.type_size} bytes>"


@_register
class F32(BlockFormat):
    name, ggml_type, vec_dot_type = "F32", GT.F32, "F32"
    kernels, quantize_kernels = "legacy", "quant_act"

    def dequantize(self, data):
        return np.asarray(data).view(np.uint8).view(np.float32).copy()

    def quantize(self, x):
        return np.ascontiguousarray(x, np.float32).view(np.uint8).copy()

    def vec_dot(self, w_row, a_row):
        """ggml_vec_dot_f32, AVX-512: 4 x 16 fma lanes per 64 values, then the fixed reduction."""
        w = np.asarray(w_row).view(np.float32)
        x = np.asarray(a_row).view(np.float32)
        return _float_dot(w, x, double_sum=False)


@_register
class F16(BlockFormat):
    name, ggml_type, vec_dot_type = "F16", GT.F16, "F16"
    kernels, quantize_kernels = "legacy", "quant_act"

    def dequantize(self, data):
        return f16_to_f32(np.asarray(data).view(np.uint8).view(np.uint16))

    def quantize(self, x):
        """ggml_cpu_fp32_to_fp16: round to nearest even."""
        return f32_to_f16_bits(x).view(np.uint8).reshape(*np.shape(x)[:-1], -1)

    def vec_dot(self, w_row, a_row):
        """ggml_vec_dot_f16, AVX-512 (F32Cx16): as F32 on converted values, sum kept in double."""
        w = f16_to_f32(np.asarray(w_row).view(np.uint16))
        x = f16_to_f32(np.asarray(a_row).view(np.uint16))
        return _float_dot(w, x, double_sum=True)


def _float_dot(w, x, double_sum):
    n = w.size
    npart = n - n % 64
    acc = np.zeros(64, np.float32)
    for i in range(0, npart, 64):
        acc = (w[i:i + 64].astype(np.float64) * x[i:i + 64] + acc).astype(np.float32)
    a = acc.reshape(4, 16)
    v = (a[0] + a[2]) + (a[1] + a[3])
    s = reduce_add_16(v)
    if double_sum:
        sd = np.float64(s)
        for i in range(npart, n):
            sd += np.float64(w[i] * x[i])
        return np.float32(sd)
    for i in range(npart, n):
        s = fma32(w[i], x[i], s)
    return np.float32(s)


@_register
class BF16(BlockFormat):
    name, ggml_type, vec_dot_type = "BF16", GT.BF16, "BF16"
    kernels, quantize_kernels = "legacy", "quant_act"

    def dequantize(self, data):
        h = np.asarray(data).view(np.uint8).view(np.uint16)
        return (h.astype(np.uint32) << 16).view(np.float32)

    def quantize(self, x):
        return f32_to_bf16_bits(x).view(np.uint8).reshape(*np.shape(x)[:-1], -1)

    def vec_dot(self, w_row, a_row):
        """ggml_vec_dot_bf16 with AVX512BF16 (vdpbf16ps): 2 x 16 lanes per 64 values, each lane
        adding its odd product then its even one; accumulators reduced into a double."""
        w = self.dequantize(w_row)
        x = self.dequantize(a_row)
        p = w * x  # exact in float32
        n = p.size
        npart = n - n % 64
        acc = np.zeros(32, np.float32)
        for i in range(0, npart, 64):
            acc = acc + p[i + 1:i + 64:2]
            acc = acc + p[i:i + 64:2]
        s = np.float64(reduce_add_16(acc[:16])) + np.float64(reduce_add_16(acc[16:]))
        for i in range(npart, n):
            s += np.float64(p[i])
        return np.float32(s)


class _Int8Blocks(BlockFormat):
    """Q8_0 / Q8_1 / Q8_K: int8 values at bytes [q_lo, q_hi) of a block, times a per-block scale."""

    q_lo: int
    q_hi: int
    f16_fields = (0,)

    def scale(self, blocks):
        return _f16_field(blocks, 0)

    def dequantize(self, data):
        b = self.blocks(data)
        q = b[..., self.q_lo:self.q_hi].view(np.int8).astype(np.float32)
        return (q * self.scale(b)[..., None]).reshape(*b.shape[:-2], -1)


def _f16_field(blocks, off):
    return f16_to_f32(blocks[..., off:off + 2].copy().view(np.uint16)[..., 0])


@_register
class Q8_0(_Int8Blocks):
    name, ggml_type, vec_dot_type = "Q8_0", GT.Q8_0, "Q8_0"
    q_lo, q_hi = 2, 34
    kernels, quantize_kernels = "legacy", "quant_act"


    def quantize(self, x):
        """x86 quantize_row_q8_0 (AVX2): d = amax/127 as F16, q = rint(x * (127/amax)), int8 by
        saturating packs."""
        x = np.asarray(x, np.float32)
        xb, d, q = _q8_blocks(x)
        out = np.empty((*xb.shape[:-1], 34), np.uint8)
        out[..., 0:2] = f32_to_f16_bits(d)[..., None].view(np.uint8)
        out[..., 2:] = np.clip(q, -128, 127).astype(np.int8).view(np.uint8)
        return out.reshape(*x.shape[:-1], -1)

    def products(self, wb, ab):
        return wb[:, 2:].view(np.int8).astype(np.int32) * ab[:, 2:].view(np.int8).astype(np.int32)

    def vec_dot(self, w_row, a_row):
        """ggml_vec_dot_q8_0_q8_0 (x86 AVX2): 8 lanes, fma with F16(dw)*F16(da), hsum_float_8."""
        wb, ab = self.blocks(w_row), Q8_0_ACT.blocks(a_row)
        d = _f16_field(wb, 0) * _f16_field(ab, 0)
        return hsum_float_8(_lane_dot(self.products(wb, ab), d))


Q8_0_ACT = None  # set below (the Q8_0 instance used as an activation format)


@_register
class Q8_1(_Int8Blocks):
    name, ggml_type, vec_dot_type = "Q8_1", GT.Q8_1, "Q8_1"
    type_size = 36  # ggml's sizeof(block_q8_1): F16 d, F16 s, 32 int8 (gguf-py's table says 40)
    q_lo, q_hi, quantize_kernels = 4, 36, "quant_act"
    f16_fields = (0, 2)
    # ggml block_q8_1 is {f16 d, f16 s, int8 qs[32]} = 36 bytes (gguf-py's table says 40).


    def quantize(self, x):
        """x86 quantize_row_q8_1 (AVX2): as Q8_0, plus s = F16(d * sum(q)) with d before F16
        (sum of the int32 q in wrapping int32 arithmetic)."""
        x = np.asarray(x, np.float32)
        xb, d, q = _q8_blocks(x)
        isum = ((q.sum(axis=-1) + 2**31) % 2**32 - 2**31).astype(np.float32)
        with np.errstate(over="ignore"):
            s = (d * isum).astype(np.float32)
        out = np.empty((*xb.shape[:-1], 36), np.uint8)
        out[..., 0:2] = f32_to_f16_bits(d)[..., None].view(np.uint8)
        out[..., 2:4] = f32_to_f16_bits(s)[..., None].view(np.uint8)
        out[..., 4:] = np.clip(q, -128, 127).astype(np.int8).view(np.uint8)
        return out.reshape(*x.shape[:-1], -1)


class _Nibbles32(BlockFormat):
    """Formats with 16 bytes of nibbles per 32 values: low nibbles are values 0..15."""

    f16_fields = (0,)

    qs_off: int

    def nibbles(self, b):
        qs = b[..., self.qs_off:self.qs_off + 16]
        return np.concatenate([qs & 15, qs >> 4], axis=-1).astype(np.int32)

    def high_bits(self, b, off):
        qh = b[..., off:off + 4].copy().view(np.uint32)[..., 0]
        return ((qh[..., None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.int32)

    def dequantize(self, data):
        b = self.blocks(data)
        v = self.values(b)  # float32 [..., nb, 32]
        return v.reshape(*b.shape[:-2], -1)

    def values(self, b):
        """ints * F16(d) (Q4_0, Q5_0: ggml-quants.c dequantize_row_*)."""
        return self.ints(b).astype(np.float32) * _f16_field(b, 0)[..., None]

    def vec_dot(self, w_row, a_row):
        """ggml_vec_dot_<type>_q8_0 (x86 AVX2) of Q4_0 / Q5_0: 8 lanes of ints * q8, fma with
        F16(dw)*F16(da), hsum_float_8."""
        wb, ab = self.blocks(w_row), Q8_0_ACT.blocks(a_row)
        p = self.ints(wb) * ab[:, 2:].view(np.int8).astype(np.int32)
        return hsum_float_8(_lane_dot(p, _f16_field(wb, 0) * _f16_field(ab, 0)))


class _Nibbles32Min(_Nibbles32):
    """Q4_1 / Q5_1: unsigned ints with a scale d and a min m (f16 d, f16 m at the block start)."""

    f16_fields = (0, 2)

    def values(self, b):
        return self.ints(b).astype(np.float32) * _f16_field(b, 0)[..., None] + _f16_field(b, 2)[..., None]

    def vec_dot(self, w_row, a_row):
        """ggml_vec_dot_<type>_q8_1 (x86 AVX2): lanes with fma, plus summs = sum fma(m, s)."""
        return _dot_q8_1(self, w_row, a_row)


# The nibble formats whose blocks differ only in layout: (name, vec_dot_type, offset of the 16
# nibble bytes, base class, the block's integer values from its bytes b).
for _name, _act, _qs, _base, _ints in (
        ("Q4_0", "Q8_0", 2, _Nibbles32, lambda f, b: f.nibbles(b) - 8),
        ("Q5_0", "Q8_0", 6, _Nibbles32, lambda f, b: (f.nibbles(b) | (f.high_bits(b, 2) << 4)) - 16),
        ("Q4_1", "Q8_1", 4, _Nibbles32Min, lambda f, b: f.nibbles(b)),
        ("Q5_1", "Q8_1", 8, _Nibbles32Min, lambda f, b: f.nibbles(b) | (f.high_bits(b, 4) << 4))):
    _register(type(_name, (_base,), {"name": _name, "ggml_type": GT[_name], "vec_dot_type": _act, "qs_off": _qs,
                                     "kernels": "legacy", "ints": _ints, "__doc__": None}))


@_register
class IQ4_NL(_Nibbles32):
    name, ggml_type, vec_dot_type, qs_off = "IQ4_NL", GT.IQ4_NL, "Q8_0", 2
    kernels = "legacy"

    def ints(self, b):
        return KVALUES_IQ4NL[self.nibbles(b)].astype(np.int32)

    def values(self, b):
        return _f16_field(b, 0)[..., None] * self.ints(b).astype(np.float32)

    def vec_dot(self, w_row, a_row):
        """ggml_vec_dot_iq4_nl_q8_0 (x86 AVX2): even blocks in acc1, odd in acc2, trailing odd
        block added with one fma after hsum_float_8(acc1 + acc2)."""
        wb, ab = self.blocks(w_row), Q8_0_ACT.blocks(a_row)
        p = self.ints(wb) * ab[:, 2:].view(np.int8).astype(np.int32)
        d = _f16_field(ab, 0) * _f16_field(wb, 0)
        nb = len(d)
        npair = nb // 2
        acc1 = _lane_dot(p[0:2 * npair:2], d[0:2 * npair:2])
        acc2 = _lane_dot(p[1:2 * npair:2], d[1:2 * npair:2])
        s = hsum_float_8(acc1 + acc2)
        if nb % 2:
            s = fma32(d[-1], np.float32(p[-1].sum()), s)
        return np.float32(s)



def _dot_q8_1(fmt, w_row, a_row):
    wb, ab = fmt.blocks(w_row), format_of("Q8_1").blocks(a_row)
    p = fmt.ints(wb) * ab[:, 4:].view(np.int8).astype(np.int32)
    acc = _lane_dot(p, _f16_field(wb, 0) * _f16_field(ab, 0))
    m, s = _f16_field(wb, 2), _f16_field(ab, 2)
    summs = np.float32(0)
    for b in range(len(m)):
        summs = fma32(m[b], s[b], summs)
    return np.float32(hsum_float_8(acc) + summs)


class _KQuant(BlockFormat):
    """K-quant weight formats (256 values per super-block); reference dequantize is gguf-py's."""

    vec_dot_type = "Q8_K"
    kernels = "kquants"
    matvec_rows = 8  # Q6_K 896 x 4864: 8 rows 545 us against rows_dot2's 603; Q4_K 420 against 393


# K-quant weight formats: (name, offsets of its F16 d (and dmin) in a 256-value super-block);
# ggml-common.h block_q2_K ...
for _name, _f16 in (("Q2_K", (80, 82)), ("Q3_K", (108,)), ("Q4_K", (0, 2)), ("Q5_K", (0, 2)), ("Q6_K", (208,)),
                   ("IQ4_XS", (0,))):
    _register(type(_name, (_KQuant,), {"name": _name, "ggml_type": GT[_name], "f16_fields": _f16, "__doc__": None}))


@_register
class Q8_K(_Int8Blocks):
    """Activation format of the K-quants: f32 d, int8 qs[256], int16 bsums[16] (292 bytes)."""

    name, ggml_type, vec_dot_type = "Q8_K", GT.Q8_K, "Q8_K"
    quantize_kernels = "kquants"  # f32 scale, then the 256 int8 values
    q_lo, q_hi = 4, 260
    f16_fields = ()

    def scale(self, blocks):
        return blocks[..., 0:4].copy().view(np.float32)[..., 0]

    def quantize(self, x):
        """quantize_row_q8_K (ggml-quants.c quantize_row_q8_K_ref, used by x86):
        max = the value of largest |x| (first one), iscale = -127/max,
        q = min(127, nearest_int(iscale*x)), d = 1/iscale, bsums = sums of 16; all-zero block -> 0."""
        x = np.asarray(x, np.float32)
        xb = x.reshape(-1, 256)
        out = np.zeros((xb.shape[0], 292), np.uint8)
        for i, blk in enumerate(xb):
            j = int(np.argmax(np.abs(blk)))
            amax = abs(blk[j])
            if amax == 0:
                continue  # d = 0, qs = 0, bsums = 0
            iscale = np.float32(-127.0) / blk[j]
            v = (iscale * blk).astype(np.float32)
            q = np.minimum(127, _nearest_int(v)).astype(np.int8)
            out[i, 0:4] = np.array([np.float32(1) / iscale], np.float32).view(np.uint8)
            out[i, 4:260] = q.view(np.uint8)
            out[i, 260:292] = q.astype(np.int16).reshape(16, 16).sum(axis=1).astype(np.int16).view(np.uint8)
        return out.reshape(*x.shape[:-1], -1)


def _nearest_int(v):
    """ggml nearest_int: (v + 12582912.f) rounded in float32, low mantissa bits - 0x400000."""
    t = (np.asarray(v, np.float32) + np.float32(12582912.0)).astype(np.float32)
    return (t.view(np.int32) & 0x007FFFFF) - 0x00400000


Q8_0_ACT = format_of("Q8_0")
