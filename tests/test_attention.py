"""Attention kernels over the F16 KV cache (synapse_nb.kernels.attention).

The graph tests (test_graph.py: bit-exact against llama.cpp's goldens) and the prefill checks
(test_session.py) cover the kernels end to end; here: the cache's bytes and tiling, the
vectorizable exp against ggml_v_expf's transcription (ops.v_expf), the softmax against a scalar
transcription of ggml_compute_forward_soft_max_f32 (including lanes off exp's common path), and
the parallel kernel (one decode row split over heads) against the serial one at 1 and 2 threads.
"""

from pathlib import Path

import numba
import numpy as np
import pytest

from synapse_nb.kernels import attention as A
from synapse_nb.kernels.common import reduce_add_16
from synapse_nb.kernels.ops import v_expf, v_expf_normal
from synapse_nb.model import load_model
from synapse_nb.session import KVCache
from synapse_nb.session import Session

TINY = Path(__file__).parent / "data" / "tiny"


@pytest.fixture
def threads():
    before = numba.get_num_threads()
    yield
    numba.set_num_threads(before)


def test_kv_cache_has_llama_cpp_bytes_and_tiles_k():
    m = load_model(TINY / "tiny-llama-hd128-q4_k_m.gguf")
    hp = m.hparams
    c = KVCache(hp, 4096)
    n_embd_k, n_embd_v = hp.n_head_kv * hp.head_dim_k, hp.n_head_kv * hp.head_dim_v
    assert c.k.dtype == np.uint16 and c.v.dtype == np.uint16
    assert c.k.nbytes + c.v.nbytes == hp.n_layer * 4096 * (n_embd_k + n_embd_v) * 2
    s = Session(m, n_ctx=200)
    s.eval([1] + list(range(3, 140)))
    k = s.cache.k_rows(1, 138)
    assert k.shape == (138, n_embd_k)
    for p in (0, 63, 64, 137):  # position p of layer il lives at k[il, p // 64, :, p % 64]
        assert np.array_equal(k[p], s.cache.k[1, p // 64, :, p % 64])
    assert np.array_equal(s.cache.v_rows(1, 138), s.cache.v[1, :138])
    assert k.any() and not s.cache.k_rows(1, 200)[138:].any()  # written positions only


def test_v_expf_normal_equals_v_expf_on_its_path():
    rng = np.random.default_rng(0)
    xs = np.concatenate([
        rng.uniform(-200, 100, 200_000).astype(np.float32),
        rng.uniform(-90, -85, 50_000).astype(np.float32),  # around n = -125
        rng.uniform(86, 90, 50_000).astype(np.float32),  # around n = 127
        np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -87.3365, 88.7228, -1e-30], np.float32),
    ])
    seen_ok = seen_off = 0
    for x in xs:
        e, ok = v_expf_normal(x)
        n = np.float32(x) * np.float32(1.4426950)  # about ggml's n = round(x / ln 2)
        if ok:
            seen_ok += 1
            assert np.float32(e).view(np.uint32) == np.float32(v_expf(x)).view(np.uint32), x
        else:
            seen_off += 1
            assert x != x or abs(n) > 124, x  # off the path only far from 0 (or NaN)
    assert seen_ok > 100_000 and seen_off > 10_000


def _softmax_reference(sd, scale):
    """ggml_compute_forward_soft_max_f32 (zero mask) then the F16 rounding, one scalar at a time."""
    s = (sd.astype(np.float32) * scale).astype(np.float32)
    mx = s.max()
    e = np.array([v_expf(np.float32(x - mx)) for x in s], np.float32)
    n16 = (len(e) + 15) // 16 * 16
    lanes = np.zeros(n16, np.float32)
    lanes[:len(e)] = e
    total = 0.0
    for c in range(0, n16, 16):
        total += float(np.float32(reduce_add_16(lanes[c:c + 16])))
    inv = np.float32(1.0 / total)
    return (e * inv).astype(np.float32).astype(np.float16).astype(np.float32)


@pytest.mark.parametrize("n_kv", [1, 15, 16, 17, 700])
def test_softmax_equals_scalar_transcription(n_kv):
    rng = np.random.default_rng(n_kv)
    sd = rng.standard_normal(n_kv) * 20
    if n_kv > 16:
        sd[3] = sd.max() + 2000  # every other lane's exp(x), x < -240, is 0 (n < -192)
        sd[5] = sd[3] - 800  # exp(-100): n = -144, a subnormal result (v_expf's ldexp path)
        xs = (sd * 0.125).astype(np.float32) - np.float32(sd[3] * 0.125)
        assert not any(v_expf_normal(np.float32(x))[1] for x in xs[xs < 0])
        assert 0 < v_expf(np.float32(xs[5])) < np.finfo(np.float32).tiny
    n16 = (n_kv + 15) // 16 * 16
    w, pr = np.empty(n16, np.float32), np.empty(n16, np.float32)
    A._softmax(w, pr, sd, n_kv, np.float32(0.125), np.empty(16, np.float32))
    ref = _softmax_reference(sd, np.float32(0.125))
    assert np.array_equal(w[:n_kv].view(np.uint32), ref.view(np.uint32))


@pytest.mark.parametrize("n_head,n_head_kv,hd", [(9, 3, 64), (4, 1, 128), (14, 2, 64), (4, 2, 40)])
def test_parallel_kernel_equals_serial_at_any_thread_count(threads, n_head, n_head_kv, hd):
    rng = np.random.default_rng(hd)
    n_ctx, pos = 1024, 900
    ek, ev = n_head_kv * hd, n_head_kv * hd
    kc = rng.standard_normal((n_ctx // 64, ek, 64)).astype(np.float16).view(np.uint16)
    vc = rng.standard_normal((n_ctx, ev)).astype(np.float16).view(np.uint16)
    scale = np.float32(1 / np.sqrt(hd))
    q = rng.standard_normal((3, n_head * hd)).astype(np.float32)
    ref = np.empty((3, n_head * hd), np.float32)
    A._attention_ser(ref, q, kc, vc, pos, n_head, n_head_kv, hd, hd, scale)
    for nt in (1, 2):
        numba.set_num_threads(min(nt, numba.config.NUMBA_NUM_THREADS))
        out = np.empty_like(ref)
        A._attention_par(out, q, kc, vc, pos, n_head, n_head_kv, hd, hd, scale)
        assert np.array_equal(out.view(np.uint32), ref.view(np.uint32))
        one = np.empty((1, n_head * hd), np.float32)  # a decode row: parallel over its heads
        assert 1 * n_head * (pos + 3) * 2 * hd >= A.PARALLEL_MIN_WORK
        A.attention_rows(one, q[2:], kc, vc, pos + 2, n_head, n_head_kv, hd, hd, scale)
        assert np.array_equal(one[0].view(np.uint32), ref[2].view(np.uint32))
