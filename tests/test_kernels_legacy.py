"""Numba kernels for F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, and the drivers.

Against ggml itself (tests/data/kernels/FMT.npz: activation bytes and vec_dot outputs), against
gguf-py's dequantize (tiny model tensors and random blocks), and against the NumPy references
of synapse_nb.formats on random inputs. Driver properties (matmul rows == matvec, thread-count
independence, input validation) are checked on every supported format.
"""

import importlib

import gguf
import gguf.quants
import numba
import numpy as np
import pytest
from gguf import GGMLQuantizationType as GT

from conftest import KERNELS, TINY
from synapse_nb import SynapseError
from synapse_nb import formats as F
from synapse_nb.kernels import (BoundWeight, bind, dequantize, get_rows, matmul, matvec, quantize_activations,
                                supported_types)

MM = importlib.import_module("synapse_nb.kernels.matmul")

# from the one table of formats (tests/test_formats.py checks it against ggml's list of types)
LEGACY = [f.name for f in F.weight_formats() if f.kernels == "legacy"]
ALL = [f.name for f in F.weight_formats()]


class T:
    """Minimal TensorInfo stand-in: name, ggml_type, shape (numpy order), data (uint8 1-D)."""

    def __init__(self, name, ggml_type, shape, data):
        self.name, self.ggml_type, self.shape = name, ggml_type, tuple(shape)
        self.data = np.ascontiguousarray(data).reshape(-1).view(np.uint8)


def fixture(name):
    return np.load(KERNELS / f"{name.lower()}.npz")


def fixture_weight(name):
    d = fixture(name)
    return T(f"{name}.ffn_up", GT[name], (768, 256), d["weight_bytes"]), d


def random_weight(name, m, k, rng):
    """Random blocks of any weight format with finite, modest scales (its F16 fields, from the
    format table: d, dmin in [1e-4, 0.05]; the Q4_1 / Q5_1 min m in [-0.5, 0.5]) so every value
    is finite."""
    fmt = F.format_of(name)
    if name == "F32":
        return T("rand", GT.F32, (m, k), rng.standard_normal(m * k).astype(np.float32))
    if name == "F16":
        return T("rand", GT.F16, (m, k), rng.standard_normal(m * k).astype(np.float16))
    if name == "BF16":
        v = rng.standard_normal(m * k).astype(np.float32).view(np.uint32) >> 16
        return T("rand", GT.BF16, (m, k), v.astype(np.uint16))
    b = rng.integers(0, 256, (m * k // fmt.block_size, fmt.type_size), dtype=np.uint8)
    for off in fmt.f16_fields:
        lo, hi = (-0.5, 0.5) if (name in ("Q4_1", "Q5_1") and off == 2) else (1e-4, 0.05)
        b[:, off:off + 2] = rng.uniform(lo, hi, len(b)).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return T("rand", GT[name], (m, k), b)


def same_bits(a, b):
    return a.shape == b.shape and np.array_equal(np.asarray(a, np.float32).view(np.uint32),
                                                 np.asarray(b, np.float32).view(np.uint32))


# --- activation converters -------------------------------------------------------------------


@pytest.mark.parametrize("name", LEGACY)
def test_activation_bytes_match_ggml(name):
    d = fixture(name)
    got = quantize_activations(d["x"], str(d["act_type"]))
    assert np.array_equal(got, d["act_bytes"])


def _hard_rows(rng, k):
    x = rng.standard_normal((12, k)).astype(np.float32)
    x[1] *= 1e4
    x[2] *= 1e-6
    x[3] = 0.0                                                  # all-zero row
    x[4, :32] = 0.0                                             # one all-zero block
    x[5] = (rng.integers(-127, 127, k) + 0.5).astype(np.float32)  # ties
    x[5, ::32] = 127.0
    x[6] = -x[5]
    x[7, 10] = 3e4                                              # spike
    x[8] *= 1e-38                                               # subnormal territory
    x[9] = rng.integers(-3, 4, k).astype(np.float32)            # small integers
    x[10, :32] = np.float32(1.0) / np.float32(3.0)              # constant block
    x[11] = np.float32(65519.0) * np.sign(x[11])                # F16 overflow boundary
    return x


@pytest.mark.parametrize("act", ["Q8_0", "Q8_1", "Q8_K", "F16", "BF16", "F32"])
def test_activation_kernels_match_numpy(act):
    rng = np.random.default_rng(7)
    x = _hard_rows(rng, 256)
    if act == "Q8_K":  # row 8 (|x| < 4e-37: -127/max overflows) is test_q8_K_overflowing_iscale
        x = np.ascontiguousarray(np.delete(x, 8, axis=0))
    got = quantize_activations(x, act)
    ref = F.format_of(act).quantize(x)
    assert np.array_equal(got, ref)
    assert np.array_equal(quantize_activations(x[3], act), ref[3])  # 1-D form


# ggml stores 0 where -127/max overflows to inf (a block with max|x| < 3.7e-37): nearest_int(inf)
# has zero low mantissa bits.
def test_q8_K_overflowing_iscale():
    x = np.ascontiguousarray(_hard_rows(np.random.default_rng(7), 256)[8])
    assert np.array_equal(quantize_activations(x, "Q8_K"), F.format_of("Q8_K").quantize(x))


def test_f16_rounding_many_bit_patterns():
    rng = np.random.default_rng(3)
    bits = rng.integers(0, 2**32, 1 << 20, dtype=np.uint64).astype(np.uint32)
    specials = np.array([0, 0x80000000, 0x7F800000, 0xFF800000, 0x477FE000, 0x477FEFFF, 0x477FF000,
                         0x387FC000, 0x33800000, 0x33000000, 0x33000001, 0x38800000, 0x387FFFFF], np.uint32)
    x = np.concatenate([bits, specials]).view(np.float32)
    x = x[~np.isnan(x)][: (len(x) // 32) * 32 - 32]
    got = quantize_activations(np.ascontiguousarray(x), "F16").view(np.uint16)
    assert np.array_equal(got, x.astype(np.float16).view(np.uint16))


# --- dot products ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ALL)
def test_matmul_matches_ggml_vec_dot(name):
    """Every output of ggml's own vec_dot on the fixture, reproduced bit for bit (8 activation
    rows: through the format's multi-row kernel rows_dot where it has one)."""
    w, d = fixture_weight(name)
    y = matmul(w, d["x"])
    assert same_bits(y, d["y"])


@pytest.mark.parametrize("name", ALL)
def test_matvec_matches_ggml_vec_dot(name):
    """One activation row (the decode path: vec_dot4 where the format has it) against ggml's
    vec_dot on the fixture, bit for bit, row by row."""
    w, d = fixture_weight(name)
    for n in range(len(d["x"])):
        assert same_bits(matvec(w, d["x"][n]), d["y"][n]), n


@pytest.mark.parametrize("name", ALL)
def test_matvec_remainder_rows_match_ggml_vec_dot(name):
    """22 weight rows (fixture rows 5..26): the driver's 16-row chunks are then 16 and 6 rows, so
    vec_dot4 runs on groups of 4 and the single-row vec_dot on the 2 left over (a K-quant's
    vec_dot4 on a padded copy of them); bit for bit."""
    w, d = fixture_weight(name)
    rb = F.format_of(name).row_bytes(w.shape[1])
    w22 = T(w.name, w.ggml_type, (22, w.shape[1]), w.data[5 * rb:27 * rb])
    for n in range(len(d["x"])):
        assert same_bits(matvec(w22, d["x"][n]), d["y"][n][5:27]), n


@pytest.mark.parametrize("name", LEGACY)
@pytest.mark.parametrize("k", [96, 896])
def test_dot_matches_numpy_reference(name, k):
    """Random weights, odd block counts (96 = 3 blocks: IQ4_NL's tail) and K % 64 != 0 (F32/F16/
    BF16 leftovers): the kernel performs the NumPy reference's rounded math exactly."""
    rng = np.random.default_rng(k)
    w = random_weight(name, 24, k, rng)
    x = _hard_rows(rng, k)[[0, 1, 2, 3, 5, 7]]
    y = matmul(w, x)
    fmt = F.format_of(name)
    a = quantize_activations(x, fmt.vec_dot_type)
    rows = w.data.reshape(24, -1)
    ref = np.array([[fmt.vec_dot(rows[m], a[n]) for m in range(24)] for n in range(len(x))], np.float32)
    assert same_bits(y, ref)
    # 22 weight rows (a 16-row chunk, then 4 + 2: the remainder paths of the multi-row kernels),
    # one activation row at a time and all at once
    w22 = T(w.name, w.ggml_type, (22, k), rows[:22].reshape(-1))
    for n in range(len(x)):
        assert same_bits(matvec(w22, x[n]), ref[n, :22]), n
    assert same_bits(matmul(w22, x), ref[:, :22])


# --- dequantize / get_rows -------------------------------------------------------------------


@pytest.mark.parametrize("name", ALL)
def test_dequantize_tiny_model_tensors(name):
    r = gguf.GGUFReader(TINY / f"tiny-llama-{name.lower()}.gguf")
    seen = 0
    for t in r.tensors:
        ti = T(t.name, GT(t.tensor_type), tuple(int(s) for s in reversed(t.shape)), np.asarray(t.data))
        ref = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32).reshape(ti.shape)
        assert same_bits(dequantize(ti), ref), t.name
        seen += t.tensor_type == GT[name]
    assert seen >= 7  # every weight matrix is in the file's format (--pure)


@pytest.mark.parametrize("name", LEGACY)
def test_dequantize_random_blocks(name):
    rng = np.random.default_rng(11)
    w = random_weight(name, 16, 320, rng)
    ref = gguf.quants.dequantize(w.data.reshape(16, -1), GT[name]).astype(np.float32)
    assert same_bits(dequantize(w), ref)
    assert same_bits(F.format_of(name).dequantize(w.data.reshape(16, -1)), ref)


@pytest.mark.parametrize("name", ALL)
def test_get_rows(name):
    w, _ = fixture_weight(name)
    ids = [5, 0, 767, 5]
    assert same_bits(get_rows(w, ids), dequantize(w)[ids])
    assert get_rows(w, np.array([], np.int64)).shape == (0, 256)
    with pytest.raises(SynapseError, match="row id 768"):
        get_rows(w, [1, 768])
    with pytest.raises(SynapseError):
        get_rows(w, [-1])


# --- driver properties -----------------------------------------------------------------------


def test_every_block_format_has_a_rows_dot():
    """The quantized formats' matmul drivers take the multi-row path (formats.BlockFormat.rows_dot_name),
    so test_matmul_rows_equal_matvec compares two different kernels for them."""
    for fmt in F.weight_formats():
        if fmt.block_size > 1:
            assert hasattr(importlib.import_module(f"synapse_nb.kernels.{fmt.kernels}"), fmt.rows_dot_name()), fmt


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("k", [256, 1280])
def test_matmul_rows_equal_matvec(name, k):
    """matmul rows (N > 1: the format's rows_dot when it has one) == matvec (the pair kernel), bit
    for bit: the fixture weight (one K-quant super-block per row) and random weights of 5
    super-blocks (40 32-value blocks) per row; one activation row has a zero block."""
    rng = np.random.default_rng(5)
    w = fixture_weight(name)[0] if k == 256 else random_weight(name, 40, k, rng)
    x = (rng.standard_normal((130, k)) * rng.uniform(0.01, 10, (130, 1))).astype(np.float32)
    x[5, 256:512] = 0.0
    vec = np.stack([matvec(w, x[n]) for n in range(130)])
    assert np.isfinite(vec).all()
    for n in (1, 2, 7, 64, 130):  # 130: more rows than one 64-row group of the multi-row kernels (and
        # than one of the matmul driver's 64-row activation blocks, matmul.ACT_BLOCK)
        assert same_bits(matmul(w, np.ascontiguousarray(x[:n])), vec[:n])


@pytest.mark.threads(2)
@pytest.mark.parametrize("name", ALL)
def test_thread_count_independence(name):
    rng = np.random.default_rng(9)
    w, _ = fixture_weight(name)
    x = rng.standard_normal((7, 256)).astype(np.float32)
    before = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        y1 = matmul(w, x)
        numba.set_num_threads(2)
        y2 = matmul(w, x)
    finally:
        numba.set_num_threads(before)
    assert same_bits(y1, y2)


def test_supported_types():
    """The weight formats the README promises (its "weight formats" row), each with its kernels built
    and a row of ggml's block size: a list written independently of formats.py's registry."""
    promised = ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
                "IQ4_NL", "IQ4_XS"]
    assert sorted(supported_types()) == sorted(promised)
    for name in promised:
        block, type_size = gguf.GGML_QUANT_SIZES[GT[name]]  # gguf-py's table
        w = T(name, GT[name], (1, 256), np.zeros(256 // block * type_size, np.uint8))
        assert bind(w).rows.shape == (1, 256 // block * type_size), name


def test_out_argument():
    w, d = fixture_weight("Q4_0")
    out = np.full((8, 768), np.nan, np.float32)
    assert matmul(w, d["x"], out=out) is out
    assert same_bits(out, d["y"])
    with pytest.raises(SynapseError, match="out must be"):
        matmul(w, d["x"], out=np.empty((8, 767), np.float32))


@pytest.mark.parametrize("bad", ["dtype", "noncontig", "k", "ndim"])
def test_activation_validation(bad):
    w, d = fixture_weight("Q8_0")
    x = {"dtype": d["x"].astype(np.float64), "noncontig": np.asfortranarray(d["x"]),
         "k": np.ascontiguousarray(d["x"][:, :224]), "ndim": d["x"][None]}[bad]
    with pytest.raises(SynapseError, match="Q8_0.ffn_up"):
        matmul(w, x)


def test_weight_validation():
    w, d = fixture_weight("Q4_0")
    with pytest.raises(SynapseError, match="bytes of data"):
        matmul(T("short", GT.Q4_0, (768, 256), w.data[:-1]), d["x"])
    with pytest.raises(SynapseError, match="block size"):
        matmul(T("odd", GT.Q4_0, (768 * 8, 32 + 4), w.data), np.zeros((1, 36), np.float32))
    with pytest.raises(SynapseError, match="not supported"):
        matmul(T("iq2", GT.IQ2_XXS, (8, 256), np.zeros(8 * 66, np.uint8)), np.zeros((1, 256), np.float32))
    with pytest.raises(SynapseError, match="2-D"):
        matmul(T("vec", GT.F32, (256,), np.zeros(256, np.float32)), np.zeros((1, 256), np.float32))
    with pytest.raises(SynapseError):
        matvec(w, d["x"])  # 2-D where 1-D is required
    with pytest.raises(SynapseError):
        quantize_activations(d["x"][:, :40].copy(), "Q8_0")


def test_f16_to_f32_exhaustive():
    """Every F16 bit pattern converts exactly (ggml_table_f32_f16)."""
    from numba import njit

    from synapse_nb.kernels.scalar import f16_to_f32

    @njit
    def conv(h, out):
        for i in range(h.size):
            out[i] = f16_to_f32(h[i])

    h = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    out = np.empty(65536, np.float32)
    conv(h, out)
    ref = h.view(np.float16).astype(np.float32)
    nan = np.isnan(ref)
    assert same_bits(out[~nan], ref[~nan])
    assert np.isnan(out[nan]).all()


@pytest.mark.parametrize("name", ["Q4_1", "Q4_K", "F16"])
def test_bound_weight_is_the_checked_path_without_checks(name):
    """bind() validates once; BoundWeight.matmul / get_rows give the public functions' bits."""
    rng = np.random.default_rng(11)
    w, d = fixture_weight(name)
    b = bind(w)
    assert isinstance(b, BoundWeight) and bind(b) is b
    assert (b.m, b.k, b.fmt.name, b.act_fmt.name) == (768, 256, name, F.format_of(name).vec_dot_type)
    assert b.rows.shape == (768, F.format_of(name).row_bytes(256)) and np.shares_memory(b.rows, w.data)
    x = rng.standard_normal((5, 256)).astype(np.float32)
    out = np.full((5, 768), np.nan, np.float32)
    assert b.matmul(x, out) is out
    assert same_bits(out, matmul(w, x)) and same_bits(matmul(b, x), out)
    assert same_bits(b.matmul(d["x"]), d["y"])  # ggml's own outputs
    ids = np.array([3, 0, 767, 3], np.int64)
    assert same_bits(b.get_rows(ids, np.empty((4, 256), np.float32)), get_rows(w, ids))
    assert same_bits(matvec(b, x[0]), out[0])
    with pytest.raises(SynapseError, match="activations have 255 columns"):
        matmul(b, np.ascontiguousarray(x[:, :255]))  # the public function still checks a bound weight


@pytest.mark.parametrize("name", ["Q4_1", "Q4_K", "IQ4_NL", "F16"])
def test_the_matvec_of_three_weights_is_three_matvecs(name):
    """A decode driver takes up to three weights reading one activation row in one parallel
    region (wq, wk, wv): each output the bits of its weight's own matvec, for row counts that are
    not multiples of the chunk (16) or of vec_dot4's 4 (the format's mv_any: a weight of such rows
    is bound to it), for multiples of 4 (mv), and for a weight of 0 rows."""
    rng = np.random.default_rng(5)
    w, _ = fixture_weight(name)
    b = bind(w)
    x = rng.standard_normal((1, 256)).astype(np.float32)
    a = b.quantize(x)
    y = b.matmul(x)
    kern = MM.kernels_for(name)
    assert b.drivers(1)[0] is kern.mv and 768 % kern.mv_rows == 0
    for mv, cuts in ((kern.mv_any, (37, 42)), (kern.mv, (36, 44))):
        parts = (b.rows[:cuts[0]], b.rows[cuts[0]:cuts[1]], b.rows[cuts[1]:])
        want = [y[:, :cuts[0]], y[:, cuts[0]:cuts[1]], y[:, cuts[1]:]]
        outs = [np.full((1, p.shape[0]), np.nan, np.float32) for p in parts]
        mv(outs[0], parts[0], outs[1], parts[1], outs[2], parts[2], a, b.n_scratch)
        assert all(same_bits(o, yw) for o, yw in zip(outs, want))
        one = np.full((1, parts[1].shape[0]), np.nan, np.float32)
        mv(one, parts[1], one[:0], parts[1][:0], one[:0], parts[1][:0], a, b.n_scratch)
        assert same_bits(one, want[1])
    odd = bind(T(w.name, w.ggml_type, (37, 256), b.rows[:37].reshape(-1)))
    assert odd.drivers(1)[0] is kern.mv_any and same_bits(odd.matmul(x), y[:, :37])
    assert (kern.mv_rows, kern.mv_any is kern.mv) == ((4, False) if name in ("Q4_1", "IQ4_NL", "F16") else (1, True))


def test_bind_validates_at_load():
    w, d = fixture_weight("Q4_0")
    with pytest.raises(SynapseError, match="short: .*bytes of data"):
        bind(T("short", GT.Q4_0, (768, 256), w.data[:-1]))
    with pytest.raises(SynapseError, match="not supported"):
        bind(T("iq2", GT.IQ2_XXS, (8, 256), np.zeros(8 * 66, np.uint8)))
