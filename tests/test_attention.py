"""Attention kernels over the F16 KV cache (synapse_nb.kernels.attention).

The graph tests (test_graph.py: bit-exact against llama.cpp's goldens) and the prefill checks
(test_session.py) cover the kernels end to end; here: the cache's bytes and layout, the
vectorizable exp against ggml_v_expf's transcription (ops.v_expf), the softmax against a scalar
transcription of ggml_compute_forward_soft_max_f32 (including lanes off exp's common path), the
parallel per-head kernel against the serial one at 1 and 2 threads, and the vector kernels
(decode and prefill, every split, serial and parallel) against the per-head kernel."""

import numba
import numpy as np
import pytest
from numba import njit

from synapse_nb.kernels import attention as A
from synapse_nb.formats import reduce_add_16
from synapse_nb.kernels.ops import v_expf, v_expf_normal
from synapse_nb.session import KVCache
from synapse_nb.session import Session

from conftest import ROOT, shared_model, use_threads


@pytest.fixture
def threads():
    before = numba.get_num_threads()
    yield
    numba.set_num_threads(before)


def test_kv_cache_has_llama_cpp_bytes_and_its_layout():
    m = shared_model("tiny-llama-hd128-q4_k_m")
    hp = m.hparams
    c = KVCache(hp, 4096)
    n_embd_k, n_embd_v = hp.n_head_kv * hp.head_dim_k, hp.n_head_kv * hp.head_dim_v
    assert c.k.dtype == np.uint16 and c.v.dtype == np.uint16
    assert c.k.nbytes + c.v.nbytes == hp.n_layer * 4096 * (n_embd_k + n_embd_v) * 2
    m = shared_model("tiny-llama-q4_0")  # two KV heads
    hp = m.hparams
    hd_k, hd_v = hp.head_dim_k, hp.head_dim_v
    s = Session(m, n_ctx=200)
    s.eval([1] + list(range(3, 140)))
    k, v = s.cache.k_rows(1, 138), s.cache.v_rows(1, 138)
    assert k.shape == (138, hp.n_head_kv * hd_k) and v.shape == (138, hp.n_head_kv * hd_v)
    for p in (0, 63, 64, 137):  # K tiles: k[il, g, p // 64, i, p % 64]; V lanes: v[il, g, p % 64, p // 64, c]
        for g in range(hp.n_head_kv):
            assert np.array_equal(k[p, g * hd_k:(g + 1) * hd_k], s.cache.k[1, g, p // 64, :, p % 64])
            assert np.array_equal(v[p, g * hd_v:(g + 1) * hd_v], s.cache.v[1, g, p % 64, p // 64])
            assert s.cache.v[s.cache.v_entry(1, p, g * hd_v + 5)] == v[p, g * hd_v + 5]
    assert k.any() and v.any()
    assert not s.cache.k_rows(1, 200)[138:].any() and not s.cache.v_rows(1, 200)[138:].any()  # written only


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
    s = (sd * scale).astype(np.float32)
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
    sd = sd.astype(np.float32)  # the scores as q.k leaves them
    n16 = (n_kv + 15) // 16 * 16
    w = np.full(n16 + 16, np.nan, np.float32)  # beyond n_kv: never read
    w[3:3 + n_kv] = sd
    _softmax_at(w, 3, n_kv, np.float32(0.125))
    ref = _softmax_reference(sd, np.float32(0.125))
    assert np.array_equal(w[3:3 + n_kv].view(np.uint32), ref.view(np.uint32))


@njit
def _softmax_at(w, off, n, scale):
    A._softmax(w, off, n, scale)


def _random_cache(rng, n_ctx, n_head_kv, hd):
    ks, vs = A.kv_shapes(n_ctx, n_head_kv, hd, hd)
    kc = rng.standard_normal(ks).astype(np.float16).view(np.uint16)
    vc = rng.standard_normal(vs).astype(np.float16).view(np.uint16)
    return kc, vc


@pytest.mark.parametrize("n_head,n_head_kv,hd", [(9, 3, 64), (4, 1, 128), (14, 2, 64), (4, 2, 40)])
def test_parallel_kernel_equals_serial_at_any_thread_count(threads, n_head, n_head_kv, hd):
    rng = np.random.default_rng(hd)
    n_ctx, pos = 1024, 900
    kc, vc = _random_cache(rng, n_ctx, n_head_kv, hd)
    scale = np.float32(1 / np.sqrt(hd))
    q = rng.standard_normal((3, n_head * hd)).astype(np.float32)
    ref = np.empty((3, n_head * hd), np.float32)
    A._attention_ser(ref, q, kc, vc, pos, n_head, n_head_kv, hd, hd, scale, 0)
    for nt in (1, 2):
        use_threads(nt)
        out = np.empty_like(ref)
        A._attention_par(out, q, kc, vc, pos, n_head, n_head_kv, hd, hd, scale, 0)
        assert np.array_equal(out.view(np.uint32), ref.view(np.uint32))
        out = np.empty_like(ref)
        A.attention_rows(out, q, kc, vc, pos, n_head, n_head_kv, hd, hd, scale)
        assert np.array_equal(out.view(np.uint32), ref.view(np.uint32))
        one = np.empty((1, n_head * hd), np.float32)  # a decode row: parallel over its heads
        vec = A.vector_kernels_apply(hd, hd)
        assert 1 * n_head * (pos + 3) * 2 * hd >= (A.DECODE_PARALLEL_MIN_WORK if vec else A.PARALLEL_MIN_WORK)
        A.attention_rows(one, q[2:], kc, vc, pos + 2, n_head, n_head_kv, hd, hd, scale)
        assert np.array_equal(one[0].view(np.uint32), ref[2].view(np.uint32))


# Shapes: SmolLM2 (9/3), Qwen2.5 (14/2), tiny hd128 (4/1), no GQA (4/4), 16 query heads on one KV
# head (more than one q.k / p.V chunk), 6/2 at hd 128 (two 64-channel p.V blocks).
@pytest.mark.parametrize("n_head,n_head_kv,hd,n_swa", [(9, 3, 64, 0), (14, 2, 64, 0), (4, 1, 128, 0), (4, 4, 64, 0),
                                                       (16, 1, 64, 0), (6, 2, 128, 0), (4, 1, 256, 0), (4, 1, 256, 100),
                                                       (9, 3, 64, 130)])
def test_vector_kernels_equal_per_head_kernel_for_every_split(threads, n_head, n_head_kv, hd, n_swa):
    """The vector kernels against the per-head kernel, bit for bit: decode rows (three parallel
    loops) and prefill blocks of every size, at positions and batch lengths crossing the 64-position
    tiles, at 1 and 2 threads, serial and parallel drivers, and a row of a batch equal to the
    same row alone; Gemma 3's heads (4/1 of 256), with and without a sliding window of n_swa."""
    assert A.vector_kernels_apply(hd, hd)
    rng = np.random.default_rng(n_head * hd)
    n_ctx = 448
    kc, vc = _random_cache(rng, n_ctx, n_head_kv, hd)
    scale = np.float32(1 / np.sqrt(hd))
    ws = A.Workspace(n_ctx, n_head, n_head_kv, hd, hd)
    n64 = hd // 64
    cases = [(0, 1), (62, 1), (63, 1), (64, 1), (299, 1), (0, 2), (0, 63), (0, 64), (1, 64), (62, 3), (63, 65 - 63),
             (200, 65), (236, 64), (300, 1), (383, 65)]
    for pos0, n in cases:
        q = rng.standard_normal((n, n_head * hd)).astype(np.float32)
        ref = np.empty((n, n_head * hd), np.float32)
        A._attention_ser(ref, q, kc, vc, pos0, n_head, n_head_kv, hd, hd, scale, n_swa)
        for nt in (1, 2):
            use_threads(nt)
            for par in (False, True):  # items in order, or split over the threads
                out = np.full_like(ref, np.nan)
                kern = A.vector_kernel(par, n == 1)
                kern(out, q, kc, vc, pos0, n_head, n_head_kv, scale, ws.buf, n_swa, ws.item_table(n == 1))
                assert np.array_equal(out.view(np.uint32), ref.view(np.uint32)), (pos0, n, nt, par)
            if n == 1 and pos0 > 0:  # the decode row as the last row of a 2-row prefill batch
                two = np.full((2, n_head * hd), np.nan, np.float32)
                A.vector_kernel(True, False)(two, np.concatenate([q, q]), kc, vc, pos0 - 1, n_head, n_head_kv, scale,
                                             ws.buf, n_swa, ws.item_table(False))
                assert np.array_equal(two[1].view(np.uint32), ref[0].view(np.uint32)), (pos0, nt)
            out = np.full_like(ref, np.nan)
            A.attention_rows(out, q, kc, vc, pos0, n_head, n_head_kv, hd, hd, scale, ws, n_swa=n_swa)
            assert np.array_equal(out.view(np.uint32), ref.view(np.uint32)), (pos0, n, nt)
        t = n - 1  # the batch's last row, alone as a decode row
        one = np.full((1, n_head * hd), np.nan, np.float32)
        A.attention_rows(one, q[t:], kc, vc, pos0 + t, n_head, n_head_kv, hd, hd, scale, ws, n_swa=n_swa)
        assert np.array_equal(one[0].view(np.uint32), ref[t].view(np.uint32))


@pytest.mark.parametrize("n_head,n_head_kv,hd,n_swa", [(9, 3, 64, 0), (4, 1, 256, 100), (14, 2, 64, 0)])
def test_decode_segments_rows_equal_each_sequence_alone(threads, n_head, n_head_kv, hd, n_swa):
    """A ParallelSession step's decode rows in one call (decode_segments: a parallel region over
    the rows, each on its thread's scratch) against each row alone on its own slot, bit for bit, at
    1 and 2 threads; the segments of several rows are left alone (NaN), as graph.layers runs them
    by their own call."""
    rng = np.random.default_rng(hd + n_swa)
    n_ctx, n_slot, layer = 320, 5, 1
    ks, vs = A.kv_shapes(n_ctx, n_head_kv, hd, hd)
    kc = rng.standard_normal((n_slot, 2, *ks)).astype(np.float16).view(np.uint16)
    vc = rng.standard_normal((n_slot, 2, *vs)).astype(np.float16).view(np.uint16)
    scale = np.float32(1 / np.sqrt(hd))
    ws = A.Workspace(n_ctx, n_head, n_head_kv, hd, hd)
    # (first row, rows, slot, position): decode rows at positions across tiles and the window, a
    # 3-row segment between them
    segs = np.array([(0, 1, 3, 0), (1, 1, 0, 130), (2, 3, 1, 50), (5, 1, 4, 300), (6, 1, 2, 64)], np.int64)
    segs = np.concatenate([segs, np.zeros((len(segs), 1), np.int64)], axis=1)
    q = rng.standard_normal((7, n_head * hd)).astype(np.float32)
    kern = A.decode_segments
    for nt in (1, 2):
        use_threads(nt)
        out = np.full((7, n_head * hd), np.nan, np.float32)
        kern(out, q, kc, vc, segs, layer, n_head, n_head_kv, scale, ws.buf, n_swa, ws.item_table(True))
        for r0, n, slot, pos, _ in segs:
            if n != 1:
                assert np.isnan(out[r0:r0 + n]).all()
                continue
            one = np.full((1, n_head * hd), np.nan, np.float32)
            A.attention_rows(one, q[r0:r0 + 1], kc[slot, layer], vc[slot, layer], pos, n_head, n_head_kv, hd, hd,
                             scale, ws, n_swa=n_swa)
            assert np.array_equal(out[r0].view(np.uint32), one[0].view(np.uint32)), (r0, nt)


def test_vector_softmax_paths_equal_per_lane_v_expf():
    """Scores whose exp leaves v_expf's common path (underflow to subnormals and to 0) in some
    lanes of a 16-lane chunk: the vector softmax takes v_expf's own branches for those lanes."""
    rng = np.random.default_rng(5)
    for n in (1, 16, 17, 40, 300):
        sd = (rng.standard_normal(n) * 30).astype(np.float32)
        sd[0] = 900.0  # scaled by 0.125: other lanes 100+ below the max
        sd[n // 2] = 900.0 - 8 * 95  # exp(-95): n = -137, a subnormal (the double scaling)
        w = np.zeros((n + 15) // 16 * 16, np.float32)
        w[:n] = sd
        _softmax_at(w, 0, n, np.float32(0.125))
        ref = _softmax_reference(sd, np.float32(0.125))
        assert np.array_equal(w[:n].view(np.uint32), ref.view(np.uint32))


_FIRST_CALL = r"""
import numpy as np
from synapse_nb.kernels import attention as A
nh, nkv, hd = 9, 3, 64
ks, vs = A.kv_shapes(128, nkv, hd, hd)
kc, vc = np.ones(ks, np.uint16), np.ones(vs, np.uint16)
ws = A.Workspace(128, nh, nkv, hd, hd)
for n in (1, 5):  # small work: the serial kernel, before any parallel region launched the threads
    q = np.zeros((n, nh * hd), np.float32)
    out = np.empty_like(q)
    A.attention_rows(out, q, kc, vc, 3, nh, nkv, hd, hd, 0.125, ws)
print("ok")
"""


def test_serial_kernel_from_the_cache_runs_as_a_process_first_kernel():
    """A cached serial kernel must not need the threading layer: the second process loads what the
    first compiled (get_thread_id in serial code crashed there: its symbol is registered only when
    the threads launch)."""
    import subprocess
    import sys

    for _ in range(2):
        r = subprocess.run([sys.executable, "-c", _FIRST_CALL], cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def test_vector_plan_exists_for_every_gqa_up_to_64():
    """VectorPlan: for 1..64 query heads per KV head (and the prefill item size R the workspace
    uses) the q.k and p.V calls take at most two query counts each, within the kernels' limits, the
    second 0 when there is one (so that no count is compiled twice); a decode row's plan holds the
    counts the gqa query heads are taken in, and nothing else."""
    for gqa in range(1, 65):
        for hd in (64, 128):
            R = A._ws_sizes(gqa, 1, hd, hd, 64)[2]
            n64, qa, qb, pa, pb = A.VectorPlan(gqa, R, hd // 64)
            assert n64 == hd // 64 and 1 <= qa <= A.QK_MAX_Q and 1 <= pa <= A.PV_MAX_Q4, (gqa, hd)
            assert (qb == 0 or qa < qb <= A.QK_MAX_Q) and (pb == 0 or pa < pb <= A.PV_MAX_Q4), (gqa, hd)
            qk = {min(c, n - r0) for n in (gqa, R) for c in [A._chunk_size(n, A.QK_MAX_Q)] for r0 in range(0, n, c)}
            assert {qa, qb} - {0} == qk, (gqa, hd)
            ws = A.Workspace(64, gqa, 1, hd, hd)
            assert ws.plan == (n64, qa, qb, pa, pb)
            d = ws.decode_plan
            c = A._chunk_size(gqa, A.QK_MAX_Q)
            assert {d[1], d[2]} - {0} == {min(c, gqa - r0) for r0 in range(0, gqa, c)}, gqa
            c = A._chunk_size(gqa, A.PV_MAX_Q4)
            assert {d[3], d[4]} - {0} == {min(c, gqa - r0) for r0 in range(0, gqa, c)}, gqa


@pytest.mark.parametrize("hd", [256, 64])
def test_sliding_window_attends_the_window_only(threads, hd):
    """n_swa > 0 (gemma3's SWA layers): row t at p = pos0 + t attends p - n_swa + 1 .. p. Cache cells
    below every row's window do not change the output (bit for bit), a cell inside some rows'
    windows changes those rows only, a window wider than the prefix is no window, and a batch's
    rows equal one-row calls at any thread count. (llama.cpp's own numbers for a window: the
    long-swa case of the Gemma 3 goldens, test_gemma3.py and test_cli.py.)"""
    rng = np.random.default_rng(hd)
    n_head, n_head_kv, n_swa, pos0, n = 4, 1, 512, 700, 3
    kc, vc = _random_cache(rng, 1024, n_head_kv, hd)
    scale = np.float32(1.0)
    q = (rng.standard_normal((n, n_head * hd)) * 0.0625).astype(np.float32)
    ws = A.Workspace(1024, n_head, n_head_kv, hd, hd)

    def run(kc, vc, w=n_swa):
        out = np.empty((n, n_head * hd), np.float32)
        A.attention_rows(out, q, kc, vc, pos0, n_head, n_head_kv, hd, hd, scale, ws, n_swa=w)
        return out.view(np.uint32)

    def with_garbage(positions):
        k2, v2 = kc.copy(), vc.copy()
        for p in positions:
            k2[:, p // 64, :, p % 64] = rng.standard_normal((n_head_kv, hd)).astype(np.float16).view(np.uint16)
            v2[:, p % 64, p // 64, :] = rng.standard_normal((n_head_kv, hd)).astype(np.float16).view(np.uint16)
        return k2, v2

    ref = run(kc, vc)
    lo = [pos0 + t - n_swa + 1 for t in range(n)]  # 189, 190, 191
    assert np.array_equal(run(*with_garbage(range(lo[0]))), ref)  # below every window: no effect
    changed = run(*with_garbage([lo[1]]))  # in rows 0 and 1's windows, not row 2's
    assert not np.array_equal(changed[0], ref[0]) and not np.array_equal(changed[1], ref[1])
    assert np.array_equal(changed[2], ref[2])
    assert not np.array_equal(run(kc, vc, w=0), ref)
    assert np.array_equal(run(kc, vc, w=pos0 + n), run(kc, vc, w=0))  # the whole prefix fits: no window
    for nt in (1, 2):
        use_threads(nt)
        for par in (False, True):
            for t in range(n):
                one = np.empty((1, n_head * hd), np.float32)
                (A._per_head_par if par else A._per_head_ser)(one, q[t:t + 1], kc, vc, pos0 + t, n_head, n_head_kv,
                                                              scale, ws.buf, n_swa, ws.items)
                assert np.array_equal(one[0].view(np.uint32), ref[t]), (nt, par, t)


@pytest.mark.parametrize("portable", [False, True])
def test_kv_store_and_query_rounding_are_ggml_fp32_to_fp16(portable, monkeypatch):
    """The K/V store and the query's F16 rounding convert 16 values at a time (simd.f16_bits16 /
    f16_round16: vcvtps2ph, or integer IR without F16C); every value as numpy's float16 (round to
    nearest even, overflow to inf, subnormals), a head dim with a scalar tail (72) included."""
    from synapse_nb.kernels import simd

    if portable:
        monkeypatch.setattr(simd, "HAS_F16C", False)
    # compiled afresh, with the row conversion it calls (a cached kernel keeps its first ISA)
    monkeypatch.setattr(A, "_f16_row", njit(cache=False)(A._f16_row.py_func))
    store = njit(cache=False)(A.store_kv_kernel.py_func)
    rnd = njit(cache=False)(lambda d, s: [simd.f16_round16(d, i, s, i) for i in range(0, s.size, 16)])
    rng = np.random.default_rng(11)

    def f16(a):  # numpy's conversion; values past 65519.99... become inf, as intended here
        with np.errstate(over="ignore"):
            return a.astype(np.float16)

    for hd in (64, 72):
        k = (rng.standard_normal((3, 2 * hd)) * rng.choice([1e-6, 1, 3e4, 1e5], (3, 2 * hd))).astype(np.float32)
        v = (rng.standard_normal((3, 2 * hd)) * rng.choice([1e-6, 1, 3e4, 1e5], (3, 2 * hd))).astype(np.float32)
        k[0, :6] = [65504.0, 65520.0, -65519.99, 2.0 ** -25, 3 * 2.0 ** -26, -0.0]
        kc, vc = np.zeros(A.kv_shapes(128, 2, hd, hd)[0], np.uint16), np.zeros(A.kv_shapes(128, 2, hd, hd)[1], np.uint16)
        store(kc, vc, k, v, 62)
        for t in range(3):
            p = 62 + t
            for g in range(2):
                assert np.array_equal(kc[g, p // 64, :, p % 64], f16(k[t, g * hd:(g + 1) * hd]).view(np.uint16))
                assert np.array_equal(vc[g, p % 64, p // 64], f16(v[t, g * hd:(g + 1) * hd]).view(np.uint16))
    x = k[0, :64].copy()
    y = np.empty_like(x)
    rnd(y, x)
    assert np.array_equal(y, f16(x).astype(np.float32))
