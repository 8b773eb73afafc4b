"""Element-wise ops of the graph (synapse_nb.kernels.ops) against their one-lane ggml reproductions."""

import numpy as np
import pytest

from synapse_nb.kernels import ops


@pytest.mark.parametrize("n", [1, 3])
def test_swiglu_vector_path_equals_lanes(n):
    """The vectorized loop (v_expf_normal, with v_expf for lanes off its path) gives what v_silu
    gives lane by lane, bit for bit, also for inputs off the common path (|x| > 87: exp under- or
    overflow, inf, nan, subnormals) and a row length that leaves a scalar tail."""
    rng = np.random.default_rng(3)
    m = 16 * 40 + 7
    gate = (rng.standard_normal((n, m)) * rng.choice([0.01, 1, 10, 100], (n, m))).astype(np.float32)
    gate[:, :8] = [88.0, -88.0, 200.0, -200.0, np.inf, -np.inf, 1e-40, -0.0]
    gate[:, 9] = np.nan
    up = rng.standard_normal((n, m)).astype(np.float32)
    out = np.empty_like(gate)
    ops.swiglu_rows(out, gate, up)
    ref = np.empty_like(gate)
    _ref_rows(ref, gate, up)
    assert np.array_equal(out.view(np.uint32), ref.view(np.uint32))


def _ref_rows(ref, gate, up):
    from numba import njit

    @njit
    def run(ref, gate, up):
        m = gate.shape[1]
        m16 = m - m % 16
        for t in range(gate.shape[0]):
            for i in range(m):
                if i < m16:
                    ref[t, i] = ops.v_silu(gate[t, i]) * up[t, i]
                else:
                    ref[t, i] = ops.silu_f32(gate[t, i]) * up[t, i]

    run(ref, gate, up)


def _geglu_ref(gate, up):
    """ggml_vec_geglu_f32's GGML_GELU_FP16 loop, transcribed in numpy: 0 for gate <= -10,
    gate * up for gate >= 10, else the table entry of F16(gate) (round to nearest even) times up."""
    table = ops.gelu_table()
    ref = np.empty_like(gate)
    for idx, x in np.ndenumerate(gate):
        if x <= -10:
            ref[idx] = 0.0
        elif x >= 10:
            ref[idx] = x * up[idx]
        else:
            ref[idx] = table[int(np.float16(x).view(np.uint16))] * up[idx]
    return ref


def _geglu_cases(n, m, rng):
    gate = (rng.standard_normal((n, m)) * rng.choice([1e-3, 1, 4, 30], (n, m))).astype(np.float32)
    edge = [-10.0, 10.0, np.nextafter(np.float32(-10), 0), np.nextafter(np.float32(10), 0), np.inf, -np.inf,
            np.nan, -0.0, 1e-8, -3e-5, 65519.0, 65520.0, 1.00048828125, 2.0009765625, -7.998046875, 6e-8]
    gate[:, :len(edge)] = np.array(edge, np.float32)
    return gate, rng.standard_normal((n, m)).astype(np.float32)


@pytest.mark.parametrize("n", [1, 3])
def test_geglu_rows_equal_the_ggml_loop(n):
    """The 16-lane GEGLU (geglu16: vcvtps2ph, a table fetch per lane, the two branches as
    selects) and its scalar tail give the scalar loop's bits, on the parallel (n > 1) and serial
    kernels, for edge inputs (the +-10 bounds, inf, nan, F16 overflow and halfway cases)."""
    rng = np.random.default_rng(5)
    gate, up = _geglu_cases(n, 16 * 9 + 5, rng)
    out = np.full_like(gate, np.nan)
    ops.geglu_rows(out, gate, up)
    assert np.array_equal(out.view(np.uint32), _geglu_ref(gate, up).view(np.uint32))


def test_geglu_portable_f16_rounding(monkeypatch):
    """Without F16C the gate's F16 rounding is integer IR (simd.ir_f32_to_f16): the same bits."""
    from numba import njit

    from synapse_nb.kernels import simd

    monkeypatch.setattr(simd, "HAS_F16C", False)
    row = njit(cache=False)(ops._geglu_row.py_func)  # compiled now, with the portable IR
    rng = np.random.default_rng(6)
    gate, up = _geglu_cases(2, 16 * 5, rng)
    gate[1] = (rng.standard_normal(16 * 5) * 1e-5).astype(np.float32)  # F16 subnormals
    out = np.full_like(gate, np.nan)
    for t in range(2):
        row(out, gate, up, ops.gelu_table(), t)
    assert "half" not in next(iter(row.inspect_llvm().values()))  # no fptrunc to half: the integer path
    assert np.array_equal(out.view(np.uint32), _geglu_ref(gate, up).view(np.uint32))


@pytest.mark.parametrize("neox", [False, True])
def test_rope_vector_steps_equal_rotate_pairs(neox):
    """rope_rows' 16-pair vector steps (rope16_neox / rope16_pairs) and its scalar tail give the
    bits of ggml's rotate_pairs loop, transcribed one pair at a time (the first product fused:
    fma(x0, cos, -(x1*sin)), fma(x0, sin, x1*cos)), for n_dims with and without a tail and
    dims past n_dims left alone."""
    from numba import njit

    from synapse_nb.kernels.scalar import fma32

    @njit
    def ref(x, cache, n_heads, head_dim, n_dims, neox):
        for t in range(x.shape[0]):
            for h in range(n_heads):
                base = h * head_dim
                for i0 in range(0, n_dims, 2):
                    a, b = (base + i0 // 2, base + i0 // 2 + n_dims // 2) if neox else (base + i0, base + i0 + 1)
                    c, s = cache[t, i0], cache[t, i0 + 1]
                    x0, x1 = x[t, a], x[t, b]
                    x[t, a] = fma32(x0, c, -(x1 * s))
                    x[t, b] = fma32(x0, s, x1 * c)

    rng = np.random.default_rng(8)
    for n_rows, n_heads, head_dim, n_dims in ((3, 2, 64, 64), (1, 4, 256, 256), (2, 3, 96, 80), (5, 2, 128, 36)):
        x = (rng.standard_normal((n_rows, n_heads * head_dim)) * 10).astype(np.float32)
        cache = rng.uniform(-1, 1, (n_rows, n_dims)).astype(np.float32)
        y, want = x.copy(), x.copy()
        ops.rope_rows(y, cache, n_heads, head_dim, n_dims, neox)
        ref(want, cache, n_heads, head_dim, n_dims, neox)
        assert np.array_equal(y.view(np.uint32), want.view(np.uint32))
