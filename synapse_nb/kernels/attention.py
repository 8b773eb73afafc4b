"""Numba kernels for attention over an F16 KV cache, as llama.cpp runs it with flash attention off.

The cache holds what llama.cpp's F16 cache holds (llama-kv-cache.cpp), in as many bytes: every K
and V entry rounded to F16 when it is stored, kept as F16 bits (uint16) and converted to float
(exact; vcvtph2ps with F16C) where attention reads it. V is [n_ctx, n_embd_v] as llama.cpp's;
K is tiled by 64 positions, [n_ctx / 64, n_embd_k, 64], so that q.k runs over a tile of 64
positions with contiguous loads (the lane accumulators of 64 positions stay in L1) and writing
a position touches only its tile's pages.

For query position p the reference graph (llama-graph.cpp build_attn_mha) computes
  kq  = mul_mat(K, q)      q converted to F16 (ggml_cpu_fp32_to_fp16), then ggml_vec_dot_f16
                           of each cached K row with it (ggml-cpu/vec.cpp)
  kq  = soft_max_ext(kq, mask, scale)     ggml_compute_forward_soft_max_f32: kq * scale, the
                           causal mask (-inf beyond p), max, ggml_vec_soft_max_f32 (ggml_v_expf
                           on 16 lanes, each 16-lane sum reduced in float and added in double),
                           then * (float)(1.0 / sum)
  kqv = mul_mat(V^T, kq)   kq converted to F16, ggml_vec_dot_f16 of each V channel row with it
over n_kv cache cells (a multiple of 256): cells beyond p are masked, their probability is 0 and
they add nothing, so only cells 0..p are visited here (the zero products llama.cpp adds leave
every accumulator unchanged).

ggml_vec_dot_f16 on AVX-512 (GGML_F16_DOT_* = F32x16): four 16-lane float accumulators, element
i of each 64-element step going to accumulator (i % 64) // 16, lane i % 16, by fma; then
acc0 += acc2, acc1 += acc3, acc0 += acc1, _mm512_reduce_add_ps, converted to double; elements
past the last full 64-step are added one by one in double; the result is rounded to float.
"""

import numpy as np
from numba import njit, prange

from .common import f16_to_f32, f32_bits, f32_to_f16_bits, fma32, reduce_add_16
from .ops import v_expf, v_expf_normal

_F32 = np.float32

# Positions per K tile (and per q.k block): the ggml_vec_dot_f16 lane accumulators of one tile,
# float32 [64, 64], fit in L1.
KT = 64


@njit(cache=True, error_model="numpy", inline="always")
def _f16_bits(x):
    """float32 -> F16 bits, round to nearest even (GGML_CPU_FP32_TO_FP16)."""
    return f32_to_f16_bits(x, f32_bits(x))


@njit(cache=True, error_model="numpy", inline="always")
def _f16_round(x):
    """float32 -> nearest F16 value, returned as float32 (GGML_CPU_FP32_TO_FP16 then back)."""
    return f16_to_f32(_f16_bits(x))


@njit(cache=True, error_model="numpy")
def _store_kv(k_cache, v_cache, k, v, pos0):
    for t in range(k.shape[0]):
        p = pos0 + t
        blk, pj = p // KT, p % KT
        for i in range(k.shape[1]):
            k_cache[blk, i, pj] = _f16_bits(k[t, i])
        for i in range(v.shape[1]):
            v_cache[p, i] = _f16_bits(v[t, i])


def store_kv(k_cache, v_cache, k, v, pos0):
    """Append rows to one layer's cache, rounded to F16 (ggml_set_rows with ggml_cpu_fp32_to_fp16).

    k_cache: uint16 [n_ctx / 64, n_embd_k, 64] (K tiles: position p at [p // 64, :, p % 64]);
    v_cache: uint16 [n_ctx, n_embd_v]; both F16 bits.
    k: float32 [N, n_embd_k]; v: float32 [N, n_embd_v]; row t goes to position pos0 + t.
    The caller guarantees pos0 + N <= n_ctx.
    """
    _store_kv(k_cache, v_cache, k, v, pos0)


@njit(cache=True, error_model="numpy", inline="always")
def _reduce_r16(r, n):
    """r[0, :n] = _mm512_reduce_add_ps's tree over the 16 lanes r[:, :n] (r[1:] is clobbered)."""
    for l in range(8):
        for j in range(n):
            r[l, j] = r[8 + l, j] + r[l, j]
    for l in range(4):
        for j in range(n):
            r[l, j] = r[4 + l, j] + r[l, j]
    for j in range(n):
        r[0, j] = (r[0, j] + r[2, j]) + (r[1, j] + r[3, j])


@njit(cache=True, error_model="numpy", inline="always")
def _reduce_lanes64(r, acc, n):
    """r[0, :n] = ggml's reduction of the 64 lane accumulators acc[:, :n] of ggml_vec_dot_f16:
    GGML_F32x16_REDUCE, (acc0 + acc2) + (acc1 + acc3), then _mm512_reduce_add_ps's tree (r is
    scratch [16, >= n])."""
    for l in range(16):
        for j in range(n):
            r[l, j] = (acc[l, j] + acc[32 + l, j]) + (acc[16 + l, j] + acc[48 + l, j])
    _reduce_r16(r, n)


@njit(cache=True, error_model="numpy")
def _qk_scores(sd, kc, qh, n_kv, k0, head_dim_k, a, r):
    """sd[j] = K[j] . qh (ggml_vec_dot_f16, as double) for j < n_kv: lane l of 64 takes dims i + l,
    by fma, kept for the 64 positions of one K tile at a time (a: scratch [64, 64], r: [16, 64]);
    dims past the last 64-step are added in double. kc: uint16 [n_ctx / 64, n_embd_k, 64]."""
    hd64 = head_dim_k - head_dim_k % 64
    if head_dim_k == 64:
        # One 64-step: lane l holds fma(k_l, q_l, 0), and GGML_F32x16_REDUCE's first stage
        # (acc0 + acc2) + (acc1 + acc3) is taken at once, lanes l, 32 + l, 16 + l, 48 + l: the
        # same operations, without a round trip of the 64 lanes through memory.
        z = _F32(0.0)
        for c in range(0, n_kv, KT):
            blk = c // KT
            nb = min(KT, n_kv - c)
            for l in range(16):
                ka, kb = kc[blk, k0 + l], kc[blk, k0 + 16 + l]
                kc_, kd = kc[blk, k0 + 32 + l], kc[blk, k0 + 48 + l]
                qa, qb, qc, qd = qh[l], qh[16 + l], qh[32 + l], qh[48 + l]
                rr = r[l]
                for j in range(nb):
                    rr[j] = ((fma32(f16_to_f32(ka[j]), qa, z) + fma32(f16_to_f32(kc_[j]), qc, z))
                             + (fma32(f16_to_f32(kb[j]), qb, z) + fma32(f16_to_f32(kd[j]), qd, z)))
            _reduce_r16(r, nb)
            for j in range(nb):
                sd[c + j] = np.float64(r[0, j])
        return
    for c in range(0, n_kv, KT):
        blk = c // KT
        nb = min(KT, n_kv - c)
        for l in range(64):
            for j in range(nb):
                a[l, j] = _F32(0.0)
        for i in range(0, hd64, 64):
            for l in range(64):
                qv = qh[i + l]
                kr = kc[blk, k0 + i + l]  # row views: see _pv
                ar = a[l]
                for j in range(nb):
                    ar[j] = fma32(f16_to_f32(kr[j]), qv, ar[j])
        _reduce_lanes64(r, a, nb)
        for j in range(nb):
            sd[c + j] = np.float64(r[0, j])
        for i in range(hd64, head_dim_k):  # leftovers, added in double
            qv = qh[i]
            for j in range(nb):
                sd[c + j] += np.float64(f16_to_f32(kc[blk, k0 + i, j]) * qv)


@njit(cache=True, error_model="numpy")
def _softmax(w, pr, sd, n_kv, kq_scale, lanes):
    """w[:n_kv] = F16-rounded softmax of sd[:n_kv] * kq_scale (ggml_compute_forward_soft_max_f32
    with a zero mask). w, pr: float32 scratch [>= n_kv rounded up to 16]; lanes: [16]."""
    n_kv16 = (n_kv + 15) // 16 * 16
    # soft_max_ext: scaled (ggml_vec_scale_f32), + mask 0, max
    mx = _F32(-np.inf)
    for j in range(n_kv):
        s = _F32(sd[j]) * kq_scale
        w[j] = s
        mx = max(mx, s)
    # exp(w - max): ggml_v_expf per 16-lane chunk (here a vectorizable loop on its common path,
    # v_expf itself for the rare lanes off it), chunk sums reduced in float, added in double
    n_off = 0
    for j in range(n_kv):
        e, ok = v_expf_normal(w[j] - mx)
        pr[j] = e
        n_off += np.int32(0) if ok else np.int32(1)
    if n_off:
        for j in range(n_kv):
            e, ok = v_expf_normal(w[j] - mx)
            if not ok:
                pr[j] = v_expf(w[j] - mx)
    for j in range(n_kv, n_kv16):
        pr[j] = _F32(0.0)
    total = 0.0
    for c in range(0, n_kv16, 16):
        for l in range(16):
            lanes[l] = pr[c + l]
        total += np.float64(reduce_add_16(lanes))
    inv = _F32(1.0 / total)
    # probabilities rounded to F16 (mul_mat with the F16 V cache converts src1)
    for j in range(n_kv):
        w[j] = _f16_round(pr[j] * inv)


@njit(cache=True, error_model="numpy")
def _pv(out, t, o0, vc, w, n_kv, v0, head_dim_v, b, rv):
    """out[t, o0 + d] = V^T[d] . w (ggml_vec_dot_f16) for d < head_dim_v: lane l of 64 takes
    positions c + l, by fma (b: scratch [64, head_dim_v], rv: [16, head_dim_v]); cells past
    n_kv add nothing. vc: uint16 [n_ctx, n_embd_v]."""
    for l in range(64):
        for d in range(head_dim_v):
            b[l, d] = _F32(0.0)
    # Rows of V and of b as views, indexed by the loop counter alone: an index like v0 + d makes
    # Numba test it for wraparound on every element, which keeps LLVM from vectorizing (8x slower).
    for c in range(0, n_kv, 64):
        for l in range(min(64, n_kv - c)):
            wl = w[c + l]
            vr = vc[c + l, v0:v0 + head_dim_v]
            br = b[l]
            for d in range(head_dim_v):
                br[d] = fma32(f16_to_f32(vr[d]), wl, br[d])
    _reduce_lanes64(rv, b, head_dim_v)
    for d in range(head_dim_v):
        out[t, o0 + d] = rv[0, d]


@njit(cache=True, error_model="numpy", inline="always")
def _attend_head(out, q, kc, vc, pos0, n_head, n_head_kv, head_dim_k, head_dim_v, kq_scale, th):
    """Attention of query head h for row t (th = t * n_head + h), reading KV head h // gqa.

    kc: one layer's K tiles, uint16 [n_ctx / 64, n_embd_k, 64]; vc: its V cache, uint16
    [n_ctx, n_embd_v] (F16 bits). The 64 lane accumulators of ggml_vec_dot_f16 are kept for the 64
    positions of a K tile (q.k) or for all channels (p.V) at once, so that the innermost loops run
    over positions or channels (contiguous) while every lane sees ggml's operations in ggml's order.
    """
    gqa = n_head // n_head_kv
    t = th // n_head
    h = th % n_head
    kvh = h // gqa
    n_kv = pos0 + t + 1
    n_kv16 = (n_kv + 15) // 16 * 16
    qh = np.empty(head_dim_k, np.float32)
    sd = np.empty(n_kv, np.float64)
    w = np.empty(n_kv16, np.float32)  # scaled scores, then probabilities
    pr = np.empty(n_kv16, np.float32)  # exp(score - max)
    # q rounded to F16: mul_mat converts src1 to the F16 cache's vec_dot_type
    for i in range(head_dim_k):
        qh[i] = _f16_round(q[t, h * head_dim_k + i])
    _qk_scores(sd, kc, qh, n_kv, kvh * head_dim_k, head_dim_k, np.empty((64, KT), np.float32),
               np.empty((16, KT), np.float32))
    _softmax(w, pr, sd, n_kv, kq_scale, np.empty(16, np.float32))
    _pv(out, t, h * head_dim_v, vc, w, n_kv, kvh * head_dim_v, head_dim_v,
        np.empty((64, head_dim_v), np.float32), np.empty((16, head_dim_v), np.float32))


@njit(cache=True, error_model="numpy", parallel=True)
def _attention_par(out, q, kc, vc, pos0, n_head, n_head_kv, head_dim_k, head_dim_v, kq_scale):
    for th in prange(q.shape[0] * n_head):
        _attend_head(out, q, kc, vc, pos0, n_head, n_head_kv, head_dim_k, head_dim_v, kq_scale, th)


@njit(cache=True, error_model="numpy")
def _attention_ser(out, q, kc, vc, pos0, n_head, n_head_kv, head_dim_k, head_dim_v, kq_scale):
    for th in range(q.shape[0] * n_head):
        _attend_head(out, q, kc, vc, pos0, n_head, n_head_kv, head_dim_k, head_dim_v, kq_scale, th)


# Below this many multiply-adds (q.k plus p.V over all rows and heads) one thread is faster than
# waking the others.
PARALLEL_MIN_WORK = 1 << 17


def uses_parallel(n, pos0, n_head, head_dim_k, head_dim_v):
    """True when attention_rows of n query rows at positions pos0.. runs on all threads."""
    return n * n_head * (pos0 + n) * (head_dim_k + head_dim_v) >= PARALLEL_MIN_WORK


def attention_rows(out, q, kc, vc, pos0, n_head, n_head_kv, head_dim_k, head_dim_v, kq_scale):
    """Causal multi-head attention of N query rows at positions pos0..pos0+N-1 over the cache.

    out: float32 [N, n_head * head_dim_v]; q: float32 [N, n_head * head_dim_k] (after RoPE);
    kc, vc: one layer's K tiles uint16 [n_ctx / 64, n_embd_k, 64] and V cache uint16
    [n_ctx, n_embd_v] (F16 bits, see store_kv), holding positions 0..pos0+N-1;
    kq_scale: float32 (1/sqrt(head_dim)). Query head h reads KV head h // (n_head / n_head_kv).
    Each (row, query head) is computed by one thread in a fixed order, in parallel over rows and
    heads (a single decode row too, once the work is large enough): results do not depend on the
    thread count, and row t equals a one-row call at position pos0 + t bit for bit.
    The caller guarantees the shapes and pos0 + N <= n_ctx.
    """
    fn = _attention_par if uses_parallel(q.shape[0], pos0, n_head, head_dim_k, head_dim_v) else _attention_ser
    fn(out, q, kc, vc, pos0, n_head, n_head_kv, head_dim_k, head_dim_v, np.float32(kq_scale))
