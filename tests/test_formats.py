"""synapse_nb.formats: the block-format registry and its NumPy references.

The references are checked against ggml itself (tests/data/kernels/FMT.npz: ggml's own activation
bytes and vec_dot outputs) and against gguf-py's dequantize, so that the Numba kernels can in turn
be checked against them on inputs ggml never saw.
"""

import gguf
import gguf.quants
import numpy as np
import pytest
from gguf import GGMLQuantizationType as GT

from conftest import KERNELS, TINY
from synapse_nb import formats as F

# the table's weight formats (formats.py is the one list of types)
WEIGHT_TYPES = [f.name for f in F.weight_formats()]
# independent reference: ggml-cpu.c type_traits_cpu[type].vec_dot_type of each weight type we support
VEC_DOT_TYPE = {"F32": "F32", "F16": "F16", "BF16": "BF16", "Q4_0": "Q8_0", "Q5_0": "Q8_0", "Q8_0": "Q8_0",
                "IQ4_NL": "Q8_0", "Q4_1": "Q8_1", "Q5_1": "Q8_1", "Q2_K": "Q8_K", "Q3_K": "Q8_K",
                "Q4_K": "Q8_K", "Q5_K": "Q8_K", "Q6_K": "Q8_K", "IQ4_XS": "Q8_K"}
# formats whose NumPy vec_dot reference lives in formats.py (the K-quants' are in kquants' tests)
NUMPY_DOT = [f.name for f in F.weight_formats() if hasattr(f, "vec_dot")]


def test_table_weight_types_are_ggml_s():
    """The table's weight formats are exactly the reference list, each with ggml's vec_dot_type."""
    assert sorted(WEIGHT_TYPES) == sorted(VEC_DOT_TYPE)
    for name in WEIGHT_TYPES:
        assert F.format_of(name).vec_dot_type == VEC_DOT_TYPE[name], name
    assert sorted(NUMPY_DOT) == sorted(n for n in VEC_DOT_TYPE if not n.endswith(("_K", "_XS")))


def fixture(fmt):
    return np.load(KERNELS / f"{fmt.lower()}.npz")


@pytest.mark.parametrize("name", WEIGHT_TYPES + ["Q8_0", "Q8_1", "Q8_K"])
def test_registry_layout(name):
    fmt = F.format_of(name)
    assert fmt is F.format_of(GT[name]) is F.format_of(int(GT[name]))
    bs, ts = gguf.GGML_QUANT_SIZES[GT[name]]
    if name == "Q8_1":
        assert (fmt.block_size, fmt.type_size) == (32, 36)  # ggml's block_q8_1; gguf-py says 40
    else:
        assert (fmt.block_size, fmt.type_size) == (bs, ts)
    if name in VEC_DOT_TYPE:
        assert fmt.vec_dot_type == VEC_DOT_TYPE[name]
    assert fmt.row_bytes(256) == 256 // fmt.block_size * fmt.type_size


def test_unknown_type():
    with pytest.raises(KeyError):
        F.format_of(GT.IQ2_XXS)


@pytest.mark.parametrize("name", WEIGHT_TYPES)
def test_fixture_types(name):
    d = fixture(name)
    assert str(d["weight_type"]) == name
    assert str(d["act_type"]) == VEC_DOT_TYPE[name]


@pytest.mark.parametrize("name", ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0", "IQ4_NL", "Q2_K", "Q4_K", "Q6_K"])
def test_activation_reference_matches_ggml(name):
    """NumPy transcriptions of ggml's x86 from_float give ggml's bytes exactly (incl. ties, zeros)."""
    d = fixture(name)
    act = F.format_of(str(d["act_type"]))
    got = act.quantize(d["x"])
    assert got.shape == d["act_bytes"].shape
    assert np.array_equal(got, d["act_bytes"])


@pytest.mark.parametrize("name", NUMPY_DOT)
def test_vec_dot_reference_matches_ggml(name):
    """The NumPy dot reproduces ggml's vec_dot bit for bit (same lanes, fma and reduction order)."""
    d = fixture(name)
    fmt = F.format_of(name)
    w = np.ascontiguousarray(d["weight_bytes"]).view(np.uint8).reshape(768, -1)
    rows = range(0, 768, 5)
    y = np.array([[fmt.vec_dot(w[m], d["act_bytes"][n]) for m in rows] for n in range(8)], np.float32)
    assert np.array_equal(y.view(np.uint32), d["y"][:, ::5].view(np.uint32))


def _reader_tensors(name):
    r = gguf.GGUFReader(TINY / f"tiny-llama-{name.lower()}.gguf")
    return [t for t in r.tensors if t.tensor_type == GT[name]]


@pytest.mark.parametrize("name", ["F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL"])
def test_dequantize_reference_matches_gguf(name):
    fmt = F.format_of(name)
    tensors = _reader_tensors(name)
    assert tensors
    for t in tensors:
        ref = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32)
        got = fmt.dequantize(np.asarray(t.data).view(np.uint8)).reshape(ref.shape)
        assert np.array_equal(got.view(np.uint32), ref.view(np.uint32)), t.name


def test_q8_0_quantize_ties_and_zero_blocks():
    # amax 127: values k + 0.5 multiply by id = 1 exactly and round half to even
    x = np.zeros((2, 64), np.float32)
    x[0, :32] = np.arange(-16, 16, dtype=np.float32) + np.float32(0.5)
    x[0, 0] = 127.0
    x[1, 32:] = 0.0  # all-zero block: d = 0, q = 0
    x[1, :32] = -np.float32(1e-30)
    q = F.format_of("Q8_0").quantize(x)
    qs = q[0, 2:34].view(np.int8)
    assert qs[0] == 127
    # x[1:5] = -14.5, -13.5, -12.5, -11.5 -> half to even
    assert list(qs[1:5]) == [-14, -14, -12, -12]
    assert not q[1, 34:].any()


def test_q8_1_s_uses_unrounded_d():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 32)).astype(np.float32)
    q = F.format_of("Q8_1").quantize(x)
    for r in range(4):
        amax = np.abs(x[r]).max()
        d = amax / np.float32(127)
        isum = q[r, 4:].view(np.int8).astype(np.int32).sum()
        s = np.float32(d * np.float32(isum))
        assert q[r, 2:4].view(np.uint16)[0] == np.float16(s).view(np.uint16)
        assert q[r, 0:2].view(np.uint16)[0] == np.float16(d).view(np.uint16)


def test_bf16_rounding():
    x = np.array([1.0, 1.00390625, 1.01171875, -2.5e-40, np.inf, np.nan, 3.4e38], np.float32)
    b = F.f32_to_bf16_bits(x)
    assert b[0] == 0x3F80
    assert b[1] == 0x3F80  # halfway, even stays
    assert b[2] == 0x3F82  # halfway, odd rounds up
    assert b[4] == 0x7F80
    assert (b[5] & 0x7FC0) == 0x7FC0
