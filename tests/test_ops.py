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
