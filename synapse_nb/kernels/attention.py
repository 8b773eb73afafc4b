"""Numba kernels for attention over an F16 KV cache, as llama.cpp runs it with flash attention off.

The cache holds what llama.cpp's F16 cache holds (llama-kv-cache.cpp), in as many bytes: every K
and V entry rounded to F16 when it is stored, kept as F16 bits (uint16) and converted to float
(exact; vcvtph2ps with F16C) where attention reads it. The layout is ours, one layer's:
  K  [n_head_kv, n_ctx / 64, head_dim_k, 64]   position p, dim i of KV head g at [g, p // 64, i, p % 64]
  V  [n_head_kv, 64, n_ctx / 64, head_dim_v]   position p, channel c of g at [g, p % 64, p // 64, c]
(n_ctx rounded up to 64). q.k runs over a K tile of 64 positions with contiguous loads of 16
positions at a time; a p.V accumulator lane l (below) reads the positions l, l + 64, l + 128, ...,
which V stores one after the other. Either way one KV head's data is read as one sequential
stream, which is what the prefetches (and the memory bandwidth of a decode step) want.

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
Call these 64 accumulator lanes "lane l" below: for q.k lane l takes dims 64 s + l, for p.V
positions 64 m + l, each by fma in ascending order.

Two implementations compute exactly these operations:
  * the vector kernels (head_dim_k 64 or 128, head_dim_v a multiple of 64: every Llama-family
    model we run), LLVM IR intrinsics vectorized over 16 positions (q.k) or 16 channels (p.V)
    and over several queries at once: the query heads sharing a KV head, and in prefill several
    rows, so that each K / V value is loaded and converted once for all of them. Each query's
    score, probability and output channel still sees its own operations in ggml's order; only
    independent computations are interleaved. Work splits (all independent of the thread count):
      decode (one row)  q.k over (KV head, K tile), softmax over query heads, p.V over (KV head,
                        a quarter of the 64 lanes): three parallel loops, both threads busy in
                        each, then the lane reductions;
      prefill (N rows)  (KV head, block of rows): each block's q.k, softmaxes and p.V, blocks
                        taken in an order that balances the causal triangle;
    the loops (vector_kernel, decode_segments) are compiled once for every head configuration and
    call their configuration's items (plan_items: the decode q.k and p.V items, the prefill item,
    with the query counts compiled in) by address (kernels/native.py);
  * the per-head kernel (_attend_head, any head dims), one (row, query head) per iteration.
"""

import numpy as np
from llvmlite import ir
from numba import get_thread_id, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from .decorator import kernel
from .native import call_at, flat, kind, native_fn
from .ops import EXPF_C1, EXPF_C2, EXPF_C3, EXPF_C4, EXPF_C5, EXPF_LN2_HI, EXPF_LN2_LO, EXPF_LOG2E
from .scalar import f16_to_f32, f32_bits, f32_to_f16_bits, fma32
from .simd import (HOST_FEATURES, f16_bits16, f16_round16, ir_f16_vec_to_f32, ir_f32_to_f16, ir_prefetch,
                   ir_reduce_add_16)

_F32 = np.float32

# Positions per K tile and per p.V lane step.
KT = 64


def kv_shapes(n_ctx, n_head_kv, head_dim_k, head_dim_v):
    """Shapes of one layer's K and V cache (uint16 F16 bits) for n_ctx positions (see above)."""
    nt = (n_ctx + KT - 1) // KT
    return (n_head_kv, nt, head_dim_k, KT), (n_head_kv, KT, nt, head_dim_v)


@kernel(inline="always")
def _f16_bits(x):
    """float32 -> F16 bits, round to nearest even (GGML_CPU_FP32_TO_FP16)."""
    return f32_to_f16_bits(x, f32_bits(x))


@kernel(inline="always")
def _f16_round(x):
    """float32 -> nearest F16 value, returned as float32 (GGML_CPU_FP32_TO_FP16 then back)."""
    return f16_to_f32(_f16_bits(x))


@kernel(nested=True)
def _f16_row(dst, src, so, n):
    """dst[i] = the F16 bits of src[so + i] for i < n, 16 at a time, then one by one (one copy of
    the scalar rounding for K and V: 0.1 s less of store_kv_kernel's compile, 0.75-0.80 -> 0.67-0.69 s)."""
    n16 = n - n % 16
    for i in range(0, n16, 16):
        f16_bits16(dst, i, src, so + i)
    for i in range(n16, n):
        dst[i] = _f16_bits(src[so + i])


@kernel
def store_kv_kernel(k_cache, v_cache, k, v, pos0):
    """store_kv's kernel (unchecked; also called from the compiled block loop, kernels/graph.py)."""
    hd_k, hd_v = k_cache.shape[2], v_cache.shape[3]
    kb = np.empty(hd_k, np.uint16)  # a K row's F16 bits, converted 16 at a time, then spread over the tile
    for t in range(k.shape[0]):
        p = pos0 + t
        blk, pj = p // KT, p % KT
        kt, vt = k[t], v[t]
        for g in range(k_cache.shape[0]):
            _f16_row(kb, kt, g * hd_k, hd_k)
            for i in range(hd_k):
                k_cache[g, blk, i, pj] = kb[i]
            _f16_row(v_cache[g, pj, blk], vt, g * hd_v, hd_v)


def store_kv(k_cache, v_cache, k, v, pos0):
    """Append rows to one layer's cache, rounded to F16 (ggml_set_rows with ggml_cpu_fp32_to_fp16).

    k_cache, v_cache: uint16 of kv_shapes(); k: float32 [N, n_head_kv * head_dim_k]; v: float32
    [N, n_head_kv * head_dim_v]; row t goes to position pos0 + t. The caller guarantees
    pos0 + N <= n_ctx.
    """
    store_kv_kernel(k_cache, v_cache, k, v, pos0)


# ---------------------------------------------------------------------------------------------
# The per-head kernel: any head dims, one (row, query head) per iteration.
# ---------------------------------------------------------------------------------------------

@kernel(inline="always")
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


@kernel(inline="always")
def _reduce_lanes64(r, acc, n):
    """r[0, :n] = ggml's reduction of the 64 lane accumulators acc[:, :n] of ggml_vec_dot_f16:
    GGML_F32x16_REDUCE, (acc0 + acc2) + (acc1 + acc3), then _mm512_reduce_add_ps's tree (r is
    scratch [16, >= n])."""
    for l in range(16):
        for j in range(n):
            r[l, j] = (acc[l, j] + acc[32 + l, j]) + (acc[16 + l, j] + acc[48 + l, j])
    _reduce_r16(r, n)


@kernel(nested=True)
def _qk_scores(sd, kg, qh, c0, n_kv, head_dim_k, a, r):
    """sd[j] = K[j] . qh (ggml_vec_dot_f16, rounded to float) for c0 <= j < n_kv (c0 a multiple of
    64): lane l of 64 takes dims i + l, by fma, kept for the 64 positions of one K tile at a time
    (a: scratch [64, 64], r: [16, 64]); dims past the last 64-step are added in double. kg: one KV
    head's K tiles, uint16 [n_ctx / 64, head_dim_k, 64]."""
    hd64 = head_dim_k - head_dim_k % 64
    for c in range(c0, n_kv, KT):
        blk = c // KT
        nb = min(KT, n_kv - c)
        for l in range(64):
            for j in range(nb):
                a[l, j] = _F32(0.0)
        for i in range(0, hd64, 64):
            for l in range(64):
                qv = qh[i + l]
                kr = kg[blk, i + l]  # row views: see _pv
                ar = a[l]
                for j in range(nb):
                    ar[j] = fma32(f16_to_f32(kr[j]), qv, ar[j])
        _reduce_lanes64(r, a, nb)
        for j in range(nb):
            s = np.float64(r[0, j])
            for i in range(hd64, head_dim_k):  # leftovers, added in double
                s += np.float64(f16_to_f32(kg[blk, i, j]) * qh[i])
            sd[c + j] = _F32(s)


@kernel(nested=True)
def _pv(out, t, o0, vg, w, c0, n_kv, head_dim_v, b, rv):
    """out[t, o0 + d] = V^T[d] . w (ggml_vec_dot_f16) for d < head_dim_v: lane l of 64 takes
    positions c + l, by fma (b: scratch [64, head_dim_v], rv: [16, head_dim_v]); cells past
    n_kv add nothing, nor do cells before c0 (a multiple of 64, below a sliding window: their
    probability is 0, and fma(v, 0, acc) is acc). vg: one KV head's V, uint16 [64, n_ctx / 64,
    head_dim_v]."""
    for l in range(64):
        for d in range(head_dim_v):
            b[l, d] = _F32(0.0)
    # Rows of V and of b as views, indexed by the loop counter alone: an index like v0 + d makes
    # Numba test it for wraparound on every element, which keeps LLVM from vectorizing (8x slower).
    for c in range(c0, n_kv, 64):
        for l in range(min(64, n_kv - c)):
            wl = w[c + l]
            vr = vg[l, c // 64]
            br = b[l]
            for d in range(head_dim_v):
                br[d] = fma32(f16_to_f32(vr[d]), wl, br[d])
    _reduce_lanes64(rv, b, head_dim_v)
    for d in range(head_dim_v):
        out[t, o0 + d] = rv[0, d]


@kernel(inline="always")
def _window_start(p, n_swa):
    """The first position query position p attends: p - n_swa + 1 under a sliding window of n_swa
    (llama.cpp's LLAMA_SWA_TYPE_STANDARD masks cell p0 when p - p0 >= n_swa), else 0 (n_swa 0)."""
    return max(0, p - n_swa + 1) if n_swa > 0 else 0


@kernel(inline="always")
def _attend_head(out, q, kc, vc, pos0, n_head, n_head_kv, head_dim_k, head_dim_v, kq_scale, th, n_swa):
    """Attention of query head h for row t (th = t * n_head + h), reading KV head h // gqa; kc, vc:
    one layer's cache (kv_shapes); n_swa: the layer's sliding window (0: none).

    Under a window, llama.cpp still runs its softmax and p.V over all n_kv cells, the masked
    ones -inf (probability 0). The 16-lane chunks of the softmax sum and the 64 p.V lanes are
    taken by cell index, so the work starts at lo64, the window start rounded down to 64, with
    the scores in [lo64, lo) set to -inf: every chunk and lane sees what llama.cpp's sees, and the
    cells before lo64 only add zeros."""
    gqa = n_head // n_head_kv
    t = th // n_head
    h = th % n_head
    kvh = h // gqa
    n_kv = pos0 + t + 1
    lo = _window_start(pos0 + t, n_swa)
    lo64 = lo // KT * KT
    n_kv16 = (n_kv + 15) // 16 * 16
    qh = np.empty(head_dim_k, np.float32)
    w = np.empty(n_kv16, np.float32)  # scores, exp, then probabilities (from lo64 on)
    # q rounded to F16: mul_mat converts src1 to the F16 cache's vec_dot_type
    for i in range(head_dim_k):
        qh[i] = _f16_round(q[t, h * head_dim_k + i])
    _qk_scores(w, kc[kvh], qh, lo64, n_kv, head_dim_k, np.empty((64, KT), np.float32),
               np.empty((16, KT), np.float32))
    for j in range(lo64, lo):
        w[j] = -np.inf
    _softmax(w, lo64, n_kv - lo64, kq_scale)
    _pv(out, t, h * head_dim_v, vc[kvh], w, lo64, n_kv, head_dim_v,
        np.empty((64, head_dim_v), np.float32), np.empty((16, head_dim_v), np.float32))


@kernel(parallel=True)
def _attention_par(out, q, kc, vc, pos0, n_head, n_head_kv, head_dim_k, head_dim_v, kq_scale, n_swa):
    for th in prange(q.shape[0] * n_head):
        _attend_head(out, q, kc, vc, pos0, n_head, n_head_kv, head_dim_k, head_dim_v, kq_scale, th, n_swa)


@kernel
def _attention_ser(out, q, kc, vc, pos0, n_head, n_head_kv, head_dim_k, head_dim_v, kq_scale, n_swa):
    for th in range(q.shape[0] * n_head):
        _attend_head(out, q, kc, vc, pos0, n_head, n_head_kv, head_dim_k, head_dim_v, kq_scale, th, n_swa)


# ---------------------------------------------------------------------------------------------
# LLVM IR pieces. Numba leaves LLVM's SLP vectorizer off, so the vector kernels are intrinsics
# emitting <16 x float> IR; every one is a sequence of the per-lane operations above.
# ---------------------------------------------------------------------------------------------

_I16, _I32 = ir.IntType(16), ir.IntType(32)
_V16F = ir.VectorType(ir.FloatType(), 16)
_V16H = ir.VectorType(_I16, 16)
_V16I = ir.VectorType(_I32, 16)

# Prefetch distance of the streaming reads (K tiles, V lane chains): 8 KiB ahead, in F16 elements.
# Measured on V chains read from DRAM: 17 GB/s without, 35 GB/s at 8 KiB (a plain read: ~52).
PREFETCH_AHEAD = 4096
PREFETCH_K = 4096


def _ptr(context, builder, aty, aval, elt):
    """Data pointer of a Numba array argument, as elt*."""
    return builder.bitcast(context.make_array(aty)(context, builder, aval).data, elt.as_pointer())


def _vconst(v, ty=_V16F):
    return ir.Constant(ty, [v] * ty.count)


def _splat(builder, x):
    """x (a scalar IR value) in all 16 lanes."""
    vty = ir.VectorType(x.type, 16)
    v = builder.insert_element(ir.Constant(vty, ir.Undefined), x, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, ir.Constant(vty, ir.Undefined), ir.Constant(_V16I, [0] * 16))


def _vcall(builder, name, args, ty=_V16F):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ty, [a.type for a in args]), name)
    return builder.call(fn, args)


def _fma16(builder, a, b, c):
    """fma(a, b, c) per lane, one rounding (_mm512_fmadd_ps)."""
    return _vcall(builder, "llvm.fma.v16f32", [a, b, c])


def _f16x16(builder, base, off):
    """16 F16 bits at base[off] (i16*) -> <16 x float>, exact (vcvtph2ps with F16C)."""
    return ir_f16_vec_to_f32(builder, builder.load(builder.bitcast(builder.gep(base, [off]), _V16H.as_pointer()), align=2))


def _bcast16(builder, base, off):
    """The float32 base[off] in all 16 lanes."""
    return _splat(builder, builder.load(builder.gep(base, [off]), align=4))


def _vload(builder, base, off):
    return builder.load(builder.bitcast(builder.gep(base, [off]), _V16F.as_pointer()), align=4)


def _vstore(builder, v, base, off):
    builder.store(v, builder.bitcast(builder.gep(base, [off]), _V16F.as_pointer()), align=4)


def _literal(t):
    return t.literal_value if isinstance(t, types.IntegerLiteral) else None


@intrinsic(prefer_literal=True)
def qk16(typingctx, sc, so, ss, kc, ko, q, qo, qs, ncol, nq, n64):
    """sc[so + r*ss + 16 c + j] = ggml_vec_dot_f16(K[16 c + j], q_r) (float32) for ncol columns of
    16 positions (c < ncol, j < 16) and the nq (literal) queries r: dim i of K row p at
    kc[ko + i*64 + p] (a K tile, uint16 F16 bits); dim i of q_r at q[qo + r*qs + i] (float32 F16
    values); n64 (literal) 64-dim steps.

    Lane l is fma(k_i, q_i, .) over dims i = 64 s + l, s ascending from 0 (starting from +0);
    then (acc0 + acc2) + (acc1 + acc3) and _mm512_reduce_add_ps's tree: _qk_scores's
    operations, vectorized over positions. The lanes are taken in pairs (l, 8 + l), whose first
    stage sums are added at once (the tree's second stage); the remaining stages read those 8
    sums back. Also prefetches the tile PREFETCH_AHEAD elements ahead.

    The code is emitted query after query (with hd_k 64 the four lanes' K converted once before
    them; else lane after lane) so that what is live fits AVX2's 16 vector registers: emitted
    lane by lane for all queries at once, 6-8 queries spilled (10.5 -> 7.1 cycles a score for 6
    queries of 64 dims, 1 thread, K tiles in L2; 39 -> 35 for 8 of 256)."""
    R, S = _literal(nq), _literal(n64)
    if R is None or S is None:
        return None
    sig = types.void(sc, types.intp, types.intp, kc, types.intp, q, types.intp, types.intp, types.intp, nq, n64)

    def codegen(context, builder, signature, args):
        if R == 0:  # a VectorPlan's absent second count (a branch never taken): no code
            return context.get_dummy_value()
        scv, sov, ssv, kcv, kov, qv, qov, qsv, ncolv = args[:9]
        scp = _ptr(context, builder, signature.args[0], scv, ir.FloatType())
        kp = _ptr(context, builder, signature.args[3], kcv, _I16)
        qp = _ptr(context, builder, signature.args[5], qv, ir.FloatType())
        intp = kov.type
        qb = [builder.gep(qp, [builder.add(qov, builder.mul(qsv, intp(r)))]) for r in range(R)]
        zero = _vconst(0.0)
        stash = cgutils.alloca_once(builder, _V16F, size=8 * R)  # s_l = r_{8+l} + r_l, l < 8
        with cgutils.for_range(builder, ncolv) as col:
            kc0 = builder.add(kov, builder.mul(col.index, intp(16)))
            # 16 positions are 32 bytes: columns 0, 1 (2, 3) of a 128-byte tile row share a line;
            # the even column prefetches the even rows, the odd column the odd rows.
            odd = builder.and_(col.index, intp(1))
            pf = builder.gep(kp, [builder.add(kc0, builder.add(intp(PREFETCH_K), builder.mul(odd, intp(KT))))])
            for i in range(0, 64 * S, 2):
                ir_prefetch(builder, builder.gep(pf, [intp(i * KT)]))

            def kvec(lane, s):  # K at dim lane + 64 s, the column's 16 positions
                return _f16x16(builder, kp, builder.add(kc0, builder.mul(builder.add(lane, intp(64 * s)), intp(KT))))

            def lane_acc(ks, lane, r):  # lane `lane` of query r after all steps
                acc = zero
                for s in range(S):
                    acc = _fma16(builder, ks[s], _bcast16(builder, qb[r], builder.add(lane, intp(64 * s))), acc)
                return acc

            with cgutils.for_range(builder, intp(8)) as lp:
                l = lp.index
                for d in (8, 0):  # r_{l+8} into the stash first, then r_l added to it
                    lanes = [builder.add(l, intp(d + o)) for o in (0, 32, 16, 48)]  # a, c, b, e

                    def stash_first(r, v):
                        dst = builder.gep(stash, [builder.add(builder.mul(l, intp(R)), intp(r))])
                        builder.store(v if d == 8 else builder.fadd(builder.load(dst), v), dst)

                    if S == 1:  # the four lanes' K (8 registers), then one query after another
                        ks = [[kvec(lane, 0)] for lane in lanes]
                        for r in range(R):
                            a, c, b, e = (lane_acc(k, lane, r) for k, lane in zip(ks, lanes))
                            stash_first(r, builder.fadd(builder.fadd(a, c), builder.fadd(b, e)))
                    else:  # lane after lane (K of its S steps), each query's partial sums kept
                        ac, b = [None] * R, [None] * R
                        for j, lane in enumerate(lanes):
                            ks = [kvec(lane, s) for s in range(S)]
                            for r in range(R):
                                v = lane_acc(ks, lane, r)
                                if j == 0:
                                    ac[r] = v
                                elif j == 1:
                                    ac[r] = builder.fadd(ac[r], v)
                                elif j == 2:
                                    b[r] = v
                                else:
                                    stash_first(r, builder.fadd(ac[r], builder.fadd(b[r], v)))

            def s_(l, r):
                return builder.load(builder.gep(stash, [intp(l * R + r)]))

            for r in range(R):
                t = [builder.fadd(s_(4 + l, r), s_(l, r)) for l in range(4)]  # r_l = r_{4+l} + r_l
                res = builder.fadd(builder.fadd(t[0], t[2]), builder.fadd(t[1], t[3]))
                _vstore(builder, res, scp, builder.add(builder.add(sov, builder.mul(ssv, intp(r))),
                                                       builder.mul(col.index, intp(16))))
        return context.get_dummy_value()

    return sig, codegen


@intrinsic(prefer_literal=True)
def pv_chain(typingctx, acc, ao, as_, fresh, vc, vo, vs, w, wo, ws, m0, m1, nq, dv):
    """p.V lane steps m0..m1-1 for nq (literal) queries and 16 * dv (literal) channels:
    acc[ao + r*as_ + c] = fma(V_m[c], w[wo + r*ws + 64 m], acc[...]) for m in order, with
    V_m[c] = vc[vo + m*vs + c] (uint16 F16 bits: the lane's row at step m). The accumulators
    start at +0 when fresh != 0, else at acc's values, and stay in registers through the chain;
    V is prefetched PREFETCH_AHEAD elements ahead of each row."""
    R, DV = _literal(nq), _literal(dv)
    if R is None or DV is None:
        return None
    sig = types.void(acc, types.intp, types.intp, types.intp, vc, types.intp, types.intp, w, types.intp,
                     types.intp, types.intp, types.intp, nq, dv)

    def codegen(context, builder, signature, args):
        if R == 0:  # a VectorPlan's absent second count (a branch never taken): no code
            return context.get_dummy_value()
        accv, aov, asv, freshv, vcv, vov, vsv, wv, wov, wsv, m0v, m1v = args[:12]
        ap = _ptr(context, builder, signature.args[0], accv, ir.FloatType())
        vp = _ptr(context, builder, signature.args[4], vcv, _I16)
        wp = _ptr(context, builder, signature.args[7], wv, ir.FloatType())
        intp = aov.type
        aoff = [[builder.add(aov, builder.add(builder.mul(asv, intp(r)), intp(16 * d))) for d in range(DV)]
                for r in range(R)]
        wb = [builder.gep(wp, [builder.add(wov, builder.mul(wsv, intp(r)))]) for r in range(R)]
        is_fresh = builder.icmp_signed("!=", freshv, intp(0))
        slots = [[cgutils.alloca_once(builder, _V16F) for d in range(DV)] for r in range(R)]
        for r in range(R):
            for d in range(DV):
                builder.store(builder.select(is_fresh, _vconst(0.0), _vload(builder, ap, aoff[r][d])), slots[r][d])
        with cgutils.for_range(builder, m1v, start=m0v) as loop:
            m = loop.index
            vrow = builder.add(vov, builder.mul(m, vsv))
            for d in range(0, DV, 2):  # one 64-byte line per 32 channels
                ir_prefetch(builder, builder.gep(vp, [builder.add(vrow, intp(PREFETCH_AHEAD + 16 * d))]))
            vv = [_f16x16(builder, vp, builder.add(vrow, intp(16 * d))) for d in range(DV)]
            woff = builder.mul(m, intp(KT))
            for r in range(R):
                wr = _bcast16(builder, wb[r], woff)
                for d in range(DV):
                    builder.store(_fma16(builder, vv[d], wr, builder.load(slots[r][d])), slots[r][d])
        for r in range(R):
            for d in range(DV):
                _vstore(builder, builder.load(slots[r][d]), ap, aoff[r][d])
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def reduce64(typingctx, acc, ao, als, out, oo, nl):
    """out[oo + c] = ggml's reduction of the 64 lane accumulators acc[ao + l*als + c], l < 64, for
    16 channels c: (acc_l + acc_{32+l}) + (acc_{16+l} + acc_{48+l}), then _mm512_reduce_add_ps's
    tree over l < 16 (_reduce_lanes64 on 16 channels). Lanes l >= nl are +0 (lanes that took no
    step: their accumulators are not read, so they need not be written)."""
    sig = types.void(acc, types.intp, types.intp, out, types.intp, types.intp)

    def codegen(context, builder, signature, args):
        accv, aov, alsv, outv, oov, nlv = args
        ap = _ptr(context, builder, signature.args[0], accv, ir.FloatType())
        op = _ptr(context, builder, signature.args[3], outv, ir.FloatType())
        intp = aov.type

        def lane(l):
            v = _vload(builder, ap, builder.add(aov, builder.mul(alsv, intp(l))))
            return builder.select(builder.icmp_signed("<", intp(l), nlv), v, _vconst(0.0))

        r = [builder.fadd(builder.fadd(lane(l), lane(32 + l)), builder.fadd(lane(16 + l), lane(48 + l)))
             for l in range(16)]
        r = [builder.fadd(r[8 + l], r[l]) for l in range(8)]
        r = [builder.fadd(r[4 + l], r[l]) for l in range(4)]
        _vstore(builder, builder.fadd(builder.fadd(r[0], r[2]), builder.fadd(r[1], r[3])), op, oov)
        return context.get_dummy_value()

    return sig, codegen


# --- softmax: ggml_compute_forward_soft_max_f32 (zero mask) then the F16 rounding, 16 lanes at a time


def _ir_v_expf(builder, x):
    """ops.v_expf on 16 lanes, common path: returns (value, ok, n, j). Where ok (-125 <= n <= 127)
    value is v_expf(x): the polynomial j scaled by one multiply; elsewhere see _ir_v_expf_rare."""
    f = lambda c: _vconst(float(c))  # noqa: E731
    r = f(12582912.0)  # 0x1.8p23f
    z = _fma16(builder, x, f(EXPF_LOG2E), r)
    n = builder.fsub(z, r)
    nn = builder.fneg(n)
    b = _fma16(builder, nn, f(EXPF_LN2_LO), _fma16(builder, nn, f(EXPF_LN2_HI), x))
    u = builder.fmul(b, b)
    j = _fma16(builder, _fma16(builder, _fma16(builder, f(EXPF_C5), b, f(EXPF_C4)), u, _fma16(builder, f(EXPF_C3), b, f(EXPF_C2))),
               u, _fma16(builder, f(EXPF_C1), b, f(1.0)))
    ok = builder.and_(builder.fcmp_ordered(">=", n, f(-125.0)), builder.fcmp_ordered("<=", n, f(127.0)))
    ni = builder.fptosi(builder.select(ok, n, f(0.0)), _V16I)
    p2 = builder.bitcast(builder.shl(builder.add(ni, _vconst(127, _V16I)), _vconst(23, _V16I)), _V16F)
    return builder.fmul(j, p2), ok, n, j


def _ir_v_expf_rare(builder, n, j):
    """v_expf's other cases, per lane, from n and the polynomial j: |n| > 192 gives 0 (n <= 0) or
    inf, NaN gives n, else j * 2**n exactly in double, rounded once to float (math.ldexp)."""
    f = lambda c: _vconst(float(c))  # noqa: E731
    big = builder.fcmp_ordered(">", _vcall(builder, "llvm.fabs.v16f32", [n]), f(192.0))
    isnan = builder.fcmp_unordered("uno", n, n)
    safe = builder.select(builder.or_(big, isnan), f(0.0), n)
    v16d, v16l = ir.VectorType(ir.DoubleType(), 16), ir.VectorType(ir.IntType(64), 16)
    e2 = builder.bitcast(builder.shl(builder.add(builder.fptosi(safe, v16l), _vconst(1023, v16l)), _vconst(52, v16l)), v16d)
    scaled = builder.fptrunc(builder.fmul(builder.fpext(j, v16d), e2), _V16F)
    edge = builder.select(builder.fcmp_ordered("<=", n, f(0.0)), f(0.0), f(float("inf")))
    return builder.select(big, edge, builder.select(isnan, n, scaled))


def _tail_mask(builder, c, n):
    """<16 x i1>: positions 16 c + i < n of chunk c."""
    pos = builder.add(_splat(builder, builder.mul(c, c.type(16))), ir.Constant(ir.VectorType(c.type, 16), list(range(16))))
    return builder.icmp_signed("<", pos, _splat(builder, n))


def _chunks(builder, n):
    return builder.sdiv(builder.add(n, n.type(15)), n.type(16))


def _full_then_tail(builder, n, chunk):
    """chunk(c, tail) for the 16-value chunks c of n values, in order: the full ones (tail False:
    no lane masked), then the partial last one if n % 16 (tail True: its lanes past n are absent).
    One loop with every chunk masked spent ~20 instructions a chunk on the mask (softmax of 3000
    scores, 1 thread: 3.1 -> 2.4 cycles a score)."""
    nfull = builder.sdiv(n, n.type(16))
    with cgutils.for_range(builder, nfull) as loop:
        chunk(loop.index, False)
    with builder.if_then(builder.icmp_signed("!=", builder.srem(n, n.type(16)), n.type(0))):
        chunk(nfull, True)


@intrinsic
def sm_max(typingctx, sc, so, n, scale):
    """Max over j < n of sc[so + j] * scale (float32): soft_max's scaled scores, their maximum as
    the scalar loop's mx = (s > mx) ? s : mx finds it (NaN never taken; -inf if no number; of
    +0 / -0 either, which the exp arguments s - mx cannot tell apart)."""
    sig = types.float32(sc, types.intp, types.intp, types.float32)

    def codegen(context, builder, signature, args):
        scv, sov, nv, scalev = args
        sp = builder.gep(_ptr(context, builder, signature.args[0], scv, ir.FloatType()), [sov])
        vscale, ninf = _splat(builder, scalev), _vconst(float("-inf"))
        mslot = cgutils.alloca_once_value(builder, ninf)

        def chunk(c, tail):
            s = builder.fmul(_vload(builder, sp, builder.mul(c, c.type(16))), vscale)
            if tail:
                s = builder.select(_tail_mask(builder, c, nv), s, ninf)
            m = builder.load(mslot)
            builder.store(builder.select(builder.fcmp_ordered(">", s, m), s, m), mslot)

        _full_then_tail(builder, nv, chunk)
        mv = builder.load(mslot)
        m = ir.Constant(ir.FloatType(), float("-inf"))
        for l in range(16):
            x = builder.extract_element(mv, ir.Constant(_I32, l))
            m = builder.select(builder.fcmp_ordered(">", x, m), x, m)
        return m

    return sig, codegen


@intrinsic
def sm_exp(typingctx, sc, so, n, scale, mx):
    """sc[so + j] = ggml_v_expf(sc[so + j] * scale - mx) for j < n, and 0 up to n rounded up to 16
    (in place); returns their sum as ggml_vec_soft_max_f32 forms it: each 16-lane chunk reduced
    in float (_mm512_reduce_add_ps), the chunk sums added in double in order."""
    sig = types.float64(sc, types.intp, types.intp, types.float32, types.float32)

    def codegen(context, builder, signature, args):
        scv, sov, nv, scalev, mxv = args
        sp = builder.gep(_ptr(context, builder, signature.args[0], scv, ir.FloatType()), [sov])
        vscale, vmx = _splat(builder, scalev), _splat(builder, mxv)
        tslot = cgutils.alloca_once_value(builder, ir.Constant(ir.DoubleType(), 0.0))

        def chunk(c, tail):
            off = builder.mul(c, c.type(16))
            x = builder.fsub(builder.fmul(_vload(builder, sp, off), vscale), vmx)
            fast, ok, nexp, j = _ir_v_expf(builder, x)
            valid = _tail_mask(builder, c, nv) if tail else None
            rare_lanes = builder.and_(valid, builder.not_(ok)) if tail else builder.not_(ok)
            any_rare = builder.icmp_unsigned("!=", builder.bitcast(rare_lanes, _I16), _I16(0))
            bb0 = builder.basic_block
            with builder.if_then(any_rare, likely=False):
                rare = builder.select(ok, fast, _ir_v_expf_rare(builder, nexp, j))
                bb1 = builder.basic_block
            e = builder.phi(_V16F)
            e.add_incoming(fast, bb0)
            e.add_incoming(rare, bb1)
            if tail:
                e = builder.select(valid, e, _vconst(0.0))
            _vstore(builder, e, sp, off)
            chunk_sum = builder.fpext(ir_reduce_add_16(builder, e), ir.DoubleType())
            builder.store(builder.fadd(builder.load(tslot), chunk_sum), tslot)

        _full_then_tail(builder, nv, chunk)
        return builder.load(tslot)

    return sig, codegen


@intrinsic
def sm_round(typingctx, sc, so, n, inv):
    """sc[so + j] = F16-rounded sc[so + j] * inv (as float32), j < n rounded up to 16 (in place)."""
    sig = types.void(sc, types.intp, types.intp, types.float32)

    def codegen(context, builder, signature, args):
        scv, sov, nv, invv = args
        sp = builder.gep(_ptr(context, builder, signature.args[0], scv, ir.FloatType()), [sov])
        vinv = _splat(builder, invv)
        with cgutils.for_range(builder, _chunks(builder, nv)) as loop:
            off = builder.mul(loop.index, loop.index.type(16))
            h = ir_f32_to_f16(builder, builder.fmul(_vload(builder, sp, off), vinv))
            _vstore(builder, ir_f16_vec_to_f32(builder, h), sp, off)
        return context.get_dummy_value()

    return sig, codegen


@kernel
def _softmax(sc, so, n_kv, kq_scale):
    """sc[so + j] = the F16-rounded softmax of sc[so + j] * kq_scale for j < n_kv, in place
    (ggml_compute_forward_soft_max_f32 with a zero mask, then mul_mat's conversion of the
    probabilities to F16); sc must hold n_kv rounded up to 16 values from so."""
    mx = sm_max(sc, so, n_kv, kq_scale)
    total = sm_exp(sc, so, n_kv, kq_scale, mx)
    sm_round(sc, so, n_kv, _F32(1.0 / total))


# ---------------------------------------------------------------------------------------------
# The vector kernels.
# ---------------------------------------------------------------------------------------------

# Queries per qk16 call, and per _pv_lanes call (which runs them two at a time; the name is from
# when one pv_chain took them all on 64 channels).
QK_MAX_Q = 8
# 16-channel groups of a two-query p.V chain (_pv_lane_range): 8 registers of accumulators, the
# fewest that keep both fma units busy through its latency, whatever the vector width
PV_PAIR_DV = 4 if HOST_FEATURES.get("avx512f") else 2
PV_MAX_Q4 = 6
# K tiles per decode q.k item.
QK_TILES = 4

# The item table (int64 [N_ITEMS], the entries' last argument): the addresses of the items the
# entries call (plan_items), at these indices; and the items' signatures (native.call_at checks
# every call against them when an entry compiles).
QK_ITEM, PV_ITEM, PREFILL_ITEM = range(3)
N_ITEMS = 3
_F1C = types.Array(types.float32, 1, "C")
_F2C = types.Array(types.float32, 2, "C")
_H1C = types.Array(types.uint16, 1, "C")
_I64 = types.int64
ITEM_SIGNATURES = {
    # scores, K, q (flat), KV head, tiles b0..b1-1, tiles of the cache, gqa, hd_k, scores' row stride
    "attn_qk": (_F1C, _H1C, _F1C) + (_I64,) * 7,
    # lane accumulators, V, probabilities (flat), KV head, quarter, gqa, hd_v, nt, nctx64, m0, n_kv
    "attn_pv": (_F1C, _H1C, _F1C) + (_I64,) * 8,
    # out, q, K, V (flat), pos0, n_head, n_head_kv, kq_scale, n_swa, nt, hd_k, hd_v, KV head, block,
    # rows per block, the thread's scratch qw, sc, acc (flat)
    "attn_prefill": (_F2C, _F2C, _H1C, _H1C, _I64, _I64, _I64, types.float32) + (_I64,) * 7 + (_F1C,) * 3,
}
_K_QK, _K_PV, _K_PREFILL = (kind(*ITEM_SIGNATURES[k]) for k in ("attn_qk", "attn_pv", "attn_prefill"))


@kernel(nested=True)
def _qk_tiles(sc, so, ss, kf, ko, qf, qo, qs, nq, nblk, qa, qb, n64):
    """Scores of nq queries on nblk consecutive K tiles (kf: one KV head's tiles, the first at ko;
    positions from sc[so]). nq is qa or qb, n64 (64-dim steps) 1 or 2: the literals of the
    model's VectorPlan, so that qk16 is generated for the two query counts the model uses only."""
    if nq == qa:
        _qk_cols(sc, so, ss, kf, ko, qf, qo, qs, nblk, qa, n64)
    else:
        _qk_cols(sc, so, ss, kf, ko, qf, qo, qs, nblk, qb, n64)


@kernel(inline="always")
def _qk_cols(sc, so, ss, kf, ko, qf, qo, qs, nblk, nq, n64):
    for b in range(nblk):  # one tile (4 columns) per qk16 call
        qk16(sc, so + b * KT, ss, kf, ko + b * n64 * 64 * KT, qf, qo, qs, 4, nq, n64)


@kernel(inline="always")
def _pv_lane_range(acc, ao, als, as_, fresh, vf, vo, vls, vs, wf, wo, ws, n0, m0, n1, l0, l1, nq):
    for l in range(l0, l1):
        s0 = m0 if n0 == 0 else _lane_steps(n0, l)
        s1 = _lane_steps(n1, l)
        if fresh != 0 or s1 > s0:
            a, v, w = ao + l * als, vo + l * vls, wo + l
            for r in range(0, nq - 1, 2):  # two queries a chain, on PV_PAIR_DV * 16 of the 64 channels
                for c in range(0, 64, 16 * PV_PAIR_DV):
                    pv_chain(acc, a + r * as_ + c, as_, fresh, vf, v + c, vs, wf, w + r * ws, ws, s0, s1, 2, PV_PAIR_DV)
            if nq % 2 == 1:  # the last query alone on the 64 channels (8 registers with AVX2)
                r = nq - 1
                pv_chain(acc, a + r * as_, as_, fresh, vf, v, vs, wf, w + r * ws, ws, s0, s1, 1, 4)


@kernel(nested=True)
def _pv_lanes(acc, ao, als, as_, fresh, vf, vo, vls, vs, wf, wo, ws, n0, m0, n1, l0, l1, nq, pa, pb):
    """The p.V chains on 64 channels for nq queries (the VectorPlan's literal pa or pb) on lanes
    l0..l1-1 in turn: lane l's accumulators at acc[ao + l * als] (queries as_ apart), its V rows
    at vf[vo + l * vls] (steps vs apart), its probabilities at wf[wo + l] (queries ws apart), its
    steps from m0 (n0 == 0) or _lane_steps(n0, l) up to _lane_steps(n1, l). A lane without a step
    is skipped, unless fresh (its accumulators are then set to +0). One call for all the lanes,
    where a call per lane cost more than the lane's few steps at short contexts.

    A lane's chains are pv_chain calls of 8 accumulator registers each (two queries on 32 channels
    with AVX2, on 64 with AVX-512: PV_PAIR_DV; an odd last query alone on 64), which the 16 vector
    registers of AVX2 hold beside the V rows (the 32 of AVX-512 more than that): one call for
    all nq queries on 64 channels (up to 6 x 4 accumulators of 16 floats, 48 ymm registers)
    spilled, and fewer accumulators wait on the fma's latency. Each accumulator's steps are the
    same, in the same order. Measured (a lane's chains alone, 47 steps, 1 thread, GMAC/s): 3
    queries 14.8 -> 35.6, 6 queries 15.5 -> 27.5; the prefill attention of 64 rows at n_kv 3000 on
    SmolLM2's heads, with qk16's change, 14.6 -> 9.0 ms a layer."""
    if nq == pa:
        _pv_lane_range(acc, ao, als, as_, fresh, vf, vo, vls, vs, wf, wo, ws, n0, m0, n1, l0, l1, pa)
    else:
        _pv_lane_range(acc, ao, als, as_, fresh, vf, vo, vls, vs, wf, wo, ws, n0, m0, n1, l0, l1, pb)


def _chunk_size(n, cap):
    """Size of the chunks when n queries are taken at most cap at a time, as evenly as possible."""
    k = (n + cap - 1) // cap
    return (n + k - 1) // k


_chunk = kernel(inline="always")(_chunk_size)


@kernel(inline="always")
def _lane_steps(n, l):
    """Steps m of lane l (positions 64 m + l) below position n."""
    return (n - l + KT - 1) // KT if n > l else 0


@kernel(inline="always")
def _decode_qk(sc, kf, qf, g, b0, b1, nt, gqa, hd_k, nctx64, n64, qa, qb):
    """Decode phase 1, item (KV head g, K tiles b0..b1-1): the scores of g's query heads there.
    sc: float32 [n_head, nctx64], qf: the F16-rounded q [n_head, hd_k], kf: K [n_head_kv, nt,
    hd_k, 64], all flat."""
    cs = _chunk(gqa, QK_MAX_Q)
    for hc in range(0, gqa, cs):
        h = g * gqa + hc
        _qk_tiles(sc, h * nctx64 + b0 * KT, nctx64, kf, (g * nt + b0) * hd_k * KT, qf, h * hd_k, hd_k,
                  min(cs, gqa - hc), b1 - b0, qa, qb, n64)


@kernel(inline="always")
def _decode_pv(acc, vf, wf, g, quarter, gqa, hd_v, nt, nctx64, m0, n_kv, pa, pb):
    """Decode phase 3, item (KV head g, lane quarter): the p.V lane chains of g's query heads for
    lanes 16 quarter .. 16 quarter + 15 (one stretch of V), all channels, from step m0 (a sliding
    window's first tile; 0 without), into acc (float32 [n_head, 64, hd_v]). wf: the probabilities
    [n_head, nctx64], vf: V [n_head_kv, 64, nt, hd_v], all flat."""
    cs = _chunk(gqa, PV_MAX_Q4)
    l1 = min(quarter * 16 + 16, n_kv - m0 * KT)  # lanes with a step
    for cb in range(0, hd_v, 64):
        for hc in range(0, gqa, cs):
            h = g * gqa + hc
            _pv_lanes(acc, h * KT * hd_v + cb, hd_v, KT * hd_v, 1, vf, g * KT * nt * hd_v + cb, nt * hd_v, hd_v,
                      wf, h * nctx64, nctx64, 0, m0, n_kv, quarter * 16, l1, min(cs, gqa - hc), pa, pb)


@kernel(inline="always")
def _decode(out, q, kc, vc, pos0, n_head, n_head_kv, kq_scale, ws, n_swa, items):
    """One row at position pos0 (out, q: [1, ...]), in three loops over independent items (parallel
    in a parallel entry, see vector_kernel). ws: Workspace.buf; n_swa: the sliding window (0:
    none; the work starts at its start's tile, as _attend_head's); items: the item table, its
    QK_ITEM and PV_ITEM the decode plan's (plan_items)."""
    gqa = n_head // n_head_kv
    nt, hd_k, hd_v = kc.shape[1], kc.shape[2], vc.shape[3]
    nctx64 = nt * KT
    n_kv = pos0 + 1
    lo = _window_start(pos0, n_swa)
    blk0 = lo // KT
    nblk = (n_kv + KT - 1) // KT
    nqk = (nblk - blk0 + QK_TILES - 1) // QK_TILES
    # Workspace.decode's arrays, flat: q [n_head, hd_k], scores [n_head, nctx64], lanes [n_head, 64, hd_v]
    o1, o2 = n_head * hd_k, n_head * (hd_k + nctx64)
    qf, scf, accf = ws[:o1], ws[o1:o2], ws[o2:o2 + n_head * KT * hd_v]
    kf, vf, orow = flat(kc), flat(vc), out[0]
    q0 = q[0]
    for i in range(0, n_head * hd_k, 16):  # q rounded to F16: mul_mat converts src1 to K's vec_dot_type
        f16_round16(qf, i, q0, i)
    for it in prange(n_head_kv * nqk):
        b0 = blk0 + (it % nqk) * QK_TILES
        call_at(_K_QK, items[QK_ITEM], scf, kf, qf, it // nqk, b0, min(nblk, b0 + QK_TILES), nt, gqa, hd_k, nctx64)
    for h in prange(n_head):
        for j in range(blk0 * KT, lo):  # below the window: probability 0, as llama.cpp's -inf mask
            scf[h * nctx64 + j] = -np.inf
        _softmax(scf, h * nctx64 + blk0 * KT, n_kv - blk0 * KT, kq_scale)
    for it in prange(n_head_kv * 4):
        call_at(_K_PV, items[PV_ITEM], accf, vf, scf, it // 4, it % 4, gqa, hd_v, nt, nctx64, blk0, n_kv)
    nl = min(KT, n_kv - blk0 * KT)  # lanes that took a step (the others are +0: not written)
    for h in range(n_head):  # the 64-lane reductions (a few hundred vector adds)
        for d in range(0, hd_v, 16):
            reduce64(accf, h * KT * hd_v + d, hd_v, orow, h * hd_v + d, nl)


@kernel(inline="always")
def _row_block(j, nrb):
    """Row block of the j-th item of a KV head: 0, nrb - 1, 1, nrb - 2, ... so that consecutive
    items (what a thread takes) pair short early rows with long late ones."""
    return j // 2 if j % 2 == 0 else nrb - 1 - j // 2


@kernel(inline="always")
def _prefill_item(out, q, kf, vf, pos0, n_head, n_head_kv, kq_scale, n_swa, nt, hd_k, hd_v, g, b, rb,
                  qwf, scf, accf, n64, qa, qb, pa, pb):
    """Rows t0 = b * rb .. t1 - 1 (at positions pos0 + t) and the query heads of KV head g:
    queries r = (t - t0) * gqa + hh (head g * gqa + hh). q.k of every query on each K tile up to
    the last row's position (K loaded once for up to QK_MAX_Q queries), each query's softmax,
    p.V lane chains shared by all queries up to the first row's position, each later row's own
    last steps, the 64-lane reductions into out. Scratch (this thread's, flat): qwf [R, hd_k], scf
    [R, nctx64], accf [R, 64, 64], R = rb * gqa (_ws_sizes). q.k and the shared p.V steps always
    take all R queries, as a full block does: a short last block's extra queries (stale scratch rows) are
    computed and never read, so the query counts are the plan's (qa, qb, pa, pb) in every block.
    Each query's operations do not depend on the others it is computed with. Under a sliding
    window (n_swa > 0) everything starts at the tile of the first row's window start (the block's
    lowest), each row's scores below its own window start set to -inf: every row sees the cells
    _attend_head sees, and zeros before them, which add nothing."""
    n = q.shape[0]
    gqa = n_head // n_head_kv
    R = rb * gqa
    t0 = b * rb
    t1 = min(n, t0 + rb)
    nr = (t1 - t0) * gqa
    nctx64 = nt * KT
    for r in range(nr):
        t, h = t0 + r // gqa, g * gqa + r % gqa
        qt = q[t]
        for i in range(0, hd_k, 16):  # (hd_k: 64, 128 or 256)
            f16_round16(qwf, r * hd_k + i, qt, h * hd_k + i)
    n_min, n_max = pos0 + t0 + 1, pos0 + t1
    blk0 = _window_start(pos0 + t0, n_swa) // KT
    lo64 = blk0 * KT
    cs = _chunk(R, QK_MAX_Q)
    for r0 in range(0, R, cs):
        _qk_tiles(scf, r0 * nctx64 + lo64, nctx64, kf, (g * nt + blk0) * hd_k * KT, qwf, r0 * hd_k, hd_k,
                  min(cs, R - r0), (n_max + KT - 1) // KT - blk0, qa, qb, n64)
    for r in range(nr):
        p = pos0 + t0 + r // gqa
        for j in range(lo64, _window_start(p, n_swa)):
            scf[r * nctx64 + j] = -np.inf
        _softmax(scf, r * nctx64 + lo64, p + 1 - lo64, kq_scale)
    cs = _chunk(R, PV_MAX_Q4)
    cr = _chunk(gqa, PV_MAX_Q4)
    ls = 64  # channels of one lane
    nl = min(KT, n_max - lo64)  # lanes with a step for some row (the others stay +0: not written)
    for cb in range(0, hd_v, 64):
        vo = g * KT * nt * hd_v + cb
        # every lane's chain up to the first row's position, shared by all queries; then each later
        # row's own steps past it (per accumulator the steps in order, as one lane at a time did)
        for r0 in range(0, R, cs):
            _pv_lanes(accf, r0 * KT * ls, ls, KT * ls, 1, vf, vo, nt * hd_v, hd_v, scf, r0 * nctx64, nctx64,
                      0, blk0, n_min, 0, nl, min(cs, R - r0), pa, pb)
        for t in range(t0 + 1, t1):
            rt = (t - t0) * gqa
            for r0 in range(rt, rt + gqa, cr):
                _pv_lanes(accf, r0 * KT * ls, ls, KT * ls, 0, vf, vo, nt * hd_v, hd_v, scf, r0 * nctx64, nctx64,
                          n_min, 0, pos0 + t + 1, 0, nl, min(cr, rt + gqa - r0), pa, pb)
        for r in range(nr):
            orow = out[t0 + r // gqa]
            o = (g * gqa + r % gqa) * hd_v + cb
            for d in range(0, 64, 16):
                reduce64(accf, r * KT * ls + d, ls, orow, o + d, nl)


def _ws_sizes(n_head, n_head_kv, head_dim_k, head_dim_v, nctx64):
    """float32 counts of the workspace: (decode part, prefill part of one thread, queries R of one
    prefill item). Decode: q [n_head, hd_k], scores [n_head, nctx64], p.V lanes [n_head, 64, hd_v];
    prefill, per thread: q [R, hd_k], scores [R, nctx64], p.V lanes [R, 64, 64]."""
    gqa = n_head // n_head_kv
    R = max(1, QK_MAX_Q // gqa) * gqa
    return n_head * (head_dim_k + nctx64 + KT * head_dim_v), R * (head_dim_k + nctx64 + KT * 64), R


_ws_sizes_nb = kernel(inline="always")(_ws_sizes)


@kernel(inline="always")
def _ws_thread(ws, tid, n_head, n_head_kv, kc, vc):
    """Flat views of Workspace.buf for prefill thread tid: qw [R, hd_k], sc [R, nctx64], acc [R, 64, 64]."""
    hd_k, hd_v, nctx64 = kc.shape[2], vc.shape[3], kc.shape[1] * KT
    nd, npt, R = _ws_sizes_nb(n_head, n_head_kv, hd_k, hd_v, nctx64)
    o0 = nd + tid * npt
    o1, o2 = o0 + R * hd_k, o0 + R * (hd_k + nctx64)
    return ws[o0:o1], ws[o1:o2], ws[o2:o0 + npt]


@kernel(inline="always")
def _prefill_blocks(q, n_head, n_head_kv):
    """(rows per block, blocks) of a prefill batch: up to QK_MAX_Q queries per (KV head, block)."""
    rb = max(1, QK_MAX_Q // (n_head // n_head_kv))
    return rb, (q.shape[0] + rb - 1) // rb


@kernel(parallel=True)
def _prefill_par(out, q, kc, vc, pos0, n_head, n_head_kv, kq_scale, ws, n_swa, items):
    """A prefill batch (q: N > 1 rows) as independent (KV head, row block) items over the threads,
    each on its thread's scratch (results do not depend on which thread it is); arguments as
    _decode's, items[PREFILL_ITEM] the plan's prefill item (plan_items)."""
    rb, nrb = _prefill_blocks(q, n_head, n_head_kv)
    nt, hd_k, hd_v = kc.shape[1], kc.shape[2], vc.shape[3]
    kf, vf = flat(kc), flat(vc)
    for it in prange(n_head_kv * nrb):
        qw, sc, acc = _ws_thread(ws, get_thread_id(), n_head, n_head_kv, kc, vc)
        call_at(_K_PREFILL, items[PREFILL_ITEM], out, q, kf, vf, pos0, n_head, n_head_kv, kq_scale, n_swa, nt, hd_k,
                hd_v, it // nrb, _row_block(it % nrb, nrb), rb, qw, sc, acc)


@kernel
def _prefill_ser(out, q, kc, vc, pos0, n_head, n_head_kv, kq_scale, ws, n_swa, items):
    """The same items in order on the calling thread (for work too small to wake the others). (No
    get_thread_id here: outside a parallel region its symbol is missing from a cached copy.)"""
    qw, sc, acc = _ws_thread(ws, 0, n_head, n_head_kv, kc, vc)
    rb, nrb = _prefill_blocks(q, n_head, n_head_kv)
    nt, hd_k, hd_v = kc.shape[1], kc.shape[2], vc.shape[3]
    kf, vf = flat(kc), flat(vc)
    for it in range(n_head_kv * nrb):
        call_at(_K_PREFILL, items[PREFILL_ITEM], out, q, kf, vf, pos0, n_head, n_head_kv, kq_scale, n_swa, nt, hd_k,
                hd_v, it // nrb, _row_block(it % nrb, nrb), rb, qw, sc, acc)


@kernel(parallel=True)
def _decode_par(out, q, kc, vc, pos0, n_head, n_head_kv, kq_scale, ws, n_swa, items):
    """A decode row (_decode), its three loops on all threads."""
    _decode(out, q, kc, vc, pos0, n_head, n_head_kv, kq_scale, ws, n_swa, items)


@kernel
def _decode_ser(out, q, kc, vc, pos0, n_head, n_head_kv, kq_scale, ws, n_swa, items):
    """A decode row (_decode) on the calling thread."""
    _decode(out, q, kc, vc, pos0, n_head, n_head_kv, kq_scale, ws, n_swa, items)


@kernel(parallel=True)
def decode_segments(out, q, kc, vc, segs, il, n_head, n_head_kv, kq_scale, ws, n_swa, items):
    """The decode rows (segments of one row) of a several-sequence batch (a ParallelSession step)
    in one parallel region: kc, vc the slots' caches (uint16 [n_slot, n_layer, ...]), segs
    graph.layers' segment table (rows of other lengths are skipped), il the layer, ws a
    Workspace's buf, items its item table with the decode plan's items. Each row's _decode runs
    on its thread's own decode scratch (the last T decode parts of the buffer, counted from its
    end), its loops serial: a row's items and their order are those of a decode call alone, so
    its bits are too (attention_rows on its slot)."""
    nd = _ws_sizes_nb(n_head, n_head_kv, kc.shape[4], vc.shape[5], kc.shape[3] * KT)[0]
    for s in prange(segs.shape[0]):
        if segs[s, 1] == 1:
            r0, slot = segs[s, 0], segs[s, 2]
            o = ws.size - (get_thread_id() + 1) * nd
            _decode(out[r0:r0 + 1], q[r0:r0 + 1], kc[slot, il], vc[slot, il], segs[s, 3], n_head, n_head_kv,
                    kq_scale, ws[o:o + nd], n_swa, items)


def _chunk_sizes(n, cap):
    """The sizes of the chunks _chunk cuts n queries into (at most two distinct values)."""
    cs = _chunk_size(n, cap)
    return {min(cs, n - r0) for r0 in range(0, n, cs)}


class VectorPlan(tuple):
    """(n64, qa, qb, pa, pb) of a head configuration: 64-dim steps of q.k, and the only query counts
    its q.k (qa, qb) and p.V (pa, pb) calls take, in decode (the gqa query heads of a KV head) and
    in prefill (blocks of R = rb * gqa queries, see _prefill_item); qb (pb) is 0 when there is one
    count only. They are literals of the plan's items (plan_items), so each configuration compiles qk16 and pv_chain
    for its one or two counts, not all eight and six (which was half the cold compile of a run);
    a count of 0 compiles to nothing (qk16, pv_chain), so that one count is not compiled twice."""

    __slots__ = ()

    def __new__(cls, gqa, R, n64):
        """gqa: query heads per KV head; R: queries of a prefill item (_ws_sizes), or gqa for
        a decode row's plan (decode_plan); n64: head_dim_k / 64."""
        qk = sorted(_chunk_sizes(gqa, QK_MAX_Q) | _chunk_sizes(R, QK_MAX_Q))
        pv = sorted(_chunk_sizes(gqa, PV_MAX_Q4) | _chunk_sizes(R, PV_MAX_Q4))
        if len(qk) > 2 or len(pv) > 2:  # not for any gqa (a test runs 1..64), but never silently
            raise ValueError(f"attention: no vector plan for {gqa} query heads per KV head")
        return super().__new__(cls, (n64, qk[0], qk[1] if len(qk) == 2 else 0, pv[0], pv[1] if len(pv) == 2 else 0))

    @property
    def tag(self):
        return "n{}_q{}_{}_p{}_{}".format(*self)


# The items of a plan, generated with its literals (plan_items): the decode row's q.k of a KV head
# on a few K tiles and p.V of a KV head on a quarter of the lanes, and a prefill (KV head, row
# block) item. Called by address (kernels/native.py) from the entries above, which therefore hold
# no plan and compile once for every head configuration, sharing the items (a direct call would
# link each item's code into each entry, and compile it there again).
_ITEMS = """
@kernel(nested=True)
def _dqk_{tag}(sc, kf, qf, g, b0, b1, nt, gqa, hd_k, nctx64):
    _decode_qk(sc, kf, qf, g, b0, b1, nt, gqa, hd_k, nctx64, {n64}, {qa}, {qb})


@kernel(nested=True)
def _dpv_{tag}(acc, vf, wf, g, quarter, gqa, hd_v, nt, nctx64, m0, n_kv):
    _decode_pv(acc, vf, wf, g, quarter, gqa, hd_v, nt, nctx64, m0, n_kv, {pa}, {pb})


@kernel(nested=True)
def _pitem_{tag}(out, q, kf, vf, pos0, n_head, n_head_kv, kq_scale, n_swa, nt, hd_k, hd_v, g, b, rb, qwf, scf, accf):
    _prefill_item(out, q, kf, vf, pos0, n_head, n_head_kv, kq_scale, n_swa, nt, hd_k, hd_v, g, b, rb, qwf, scf, accf,
                  {n64}, {qa}, {qb}, {pa}, {pb})
"""
_PLAN_ITEMS = {}


def plan_items(plan):
    """plan's item kernels (q.k, p.V, prefill item: signatures ITEM_SIGNATURES), generated on
    first use with its literals and compiled under this file's name on their first call (so that
    Numba's cache finds them again in a new process). A run compiles the ones it calls only."""
    fns = _PLAN_ITEMS.get(tuple(plan))
    if fns is None:
        n64, qa, qb, pa, pb = plan
        exec(compile(_ITEMS.format(tag=plan.tag, n64=n64, qa=qa, qb=qb, pa=pa, pb=pb), __file__, "exec"), globals())
        fns = _PLAN_ITEMS[tuple(plan)] = tuple(globals()[f"_{p}_{plan.tag}"] for p in ("dqk", "dpv", "pitem"))
    return fns


def item_kernels(ws, decode):
    """[(index in the item table, dispatcher, kind in ITEM_SIGNATURES)]: the items the vector
    kernel of a decode row (decode: the decode plan's q.k and p.V) or of a prefill batch (the
    plan's prefill item) calls; none for the per-head kernel (a Workspace without a plan)."""
    if ws.plan is None:
        return []
    qk, pv, item = plan_items(ws.decode_plan if decode else ws.plan)
    return [(QK_ITEM, qk, "attn_qk"), (PV_ITEM, pv, "attn_pv")] if decode else [(PREFILL_ITEM, item, "attn_prefill")]


def vector_kernel(parallel, decode):
    """The vector kernel for a decode row (decode: q has 1 row) or a prefill batch (N > 1 rows),
    its loops on all threads if parallel: a function (out, q, kc, vc, pos0, n_head, n_head_kv,
    kq_scale, ws, n_swa, items) over arrays attention_rows has checked, ws a Workspace's buf and
    items its item_table(decode)."""
    if decode:
        return _decode_par if parallel else _decode_ser
    return _prefill_par if parallel else _prefill_ser


def vector_kernels_apply(head_dim_k, head_dim_v):
    """Whether the vector kernels take these head dims (else the per-head kernel does)."""
    return head_dim_k in (64, 128, 256) and head_dim_v % 64 == 0


class Workspace:
    """Scratch of the vector kernels for n_ctx positions (ForwardState holds one, so nothing is
    allocated per call): one float32 buffer, buf, holding a decode row's arrays and, per Numba
    thread, a prefill item's and a decode row's (_ws_sizes; decode_segments' rows); a few hundred
    KiB for the models we run. decode and prefill(tid) are views of buf, for tests and benchmarks."""

    def __init__(self, n_ctx, n_head, n_head_kv, head_dim_k, head_dim_v):
        import numba

        T = numba.config.NUMBA_NUM_THREADS  # get_thread_id() < this
        nctx64 = (n_ctx + KT - 1) // KT * KT
        nd, npt, R = _ws_sizes(n_head, n_head_kv, head_dim_k, head_dim_v, nctx64)
        self._dims = (n_head, head_dim_k, head_dim_v, nctx64, nd, npt)
        self.n_ctx = n_ctx
        vector = vector_kernels_apply(head_dim_k, head_dim_v)
        gqa, n64 = n_head // n_head_kv, head_dim_k // 64
        self.plan = VectorPlan(gqa, R, n64) if vector else None
        # a decode row's kernels take the gqa query heads of a KV head only (a prefill block's
        # larger count would be compiled into them and never run)
        self.decode_plan = VectorPlan(gqa, gqa, n64) if vector else None
        self.parallel_override = {}  # decode (bool) -> parallel (bool): set by a warm-up only
        self.items = np.zeros(N_ITEMS, np.int64)  # attention_rows' item table (item_table)
        self._item_fns = {}  # dispatcher -> its NativeFn
        # a decode part, a prefill part per thread, and a decode part per thread (decode_segments;
        # zero pages, committed only when a several-sequence step writes them)
        self.buf = np.zeros(nd + T * npt + T * nd, np.float32)

    def item_table(self, decode):
        """int64 [N_ITEMS]: the item table for the vector kernel of a decode row (decode) or of a
        prefill batch, its items (item_kernels) compiled or loaded now."""
        for i, d, k in item_kernels(self, decode):
            f = self._item_fns.get(d)
            if f is None:
                f = self._item_fns[d] = native_fn(d, *ITEM_SIGNATURES[k])
            self.items[i] = f.addr
        return self.items

    @property
    def decode(self):
        """(qd [n_head, hd_k], scd [n_head, nctx64], accd [n_head, 64, hd_v]), views of buf."""
        n_head, hd_k, hd_v, nctx64, nd, _ = self._dims
        o1, o2 = n_head * hd_k, n_head * (hd_k + nctx64)
        b = self.buf
        return (b[:o1].reshape(n_head, hd_k), b[o1:o2].reshape(n_head, nctx64), b[o2:nd].reshape(n_head, KT, hd_v))


# Below this many multiply-adds (q.k plus p.V over all rows and heads) one thread is faster than
# waking the others: once for the per-head kernel and a prefill batch, three times for a decode
# row of the vector kernels (its three loops). A decode row's threshold is set by whole decode
# steps, not by the kernel alone (bench_attention.py, where the cache stays warm): inside a step
# the K/V cache has been evicted by the weights' stream, so two threads read it faster, and a
# serial stretch of more than ~25 us lets the idle OpenMP worker sleep (GOMP_SPINCOUNT=1000),
# whose wake-up then costs the next matvec ~25 us. Measured on 2 threads, each decode step run
# with the serial and the parallel kernel in turn in one process (whole-step ms, serial /
# parallel): SmolLM2 positions 10..44 7.69 / 7.54 and 7.20 / 8.06, 45..85 8.73 / 7.89 and 7.61 /
# 7.25, 86..299 7.71 / 6.82 and 7.62 / 6.61; Qwen2.5 55..299 23.4 / 22.1; Gemma 3 48..299 14.1 /
# 13.3. (The old threshold, 1 << 19, kept SmolLM2's decode serial up to n_kv 455.)
PARALLEL_MIN_WORK = 1 << 17
DECODE_PARALLEL_MIN_WORK = 1 << 16  # SmolLM2 from n_kv 57, Qwen2.5 from 37, Gemma 3 from 32


def uses_parallel(n, pos0, n_head, head_dim_k, head_dim_v):
    """True when attention_rows of n query rows at positions pos0.. runs on all threads."""
    work = n * n_head * (pos0 + n) * (head_dim_k + head_dim_v)
    if not vector_kernels_apply(head_dim_k, head_dim_v):
        return work >= PARALLEL_MIN_WORK
    return work >= (DECODE_PARALLEL_MIN_WORK if n == 1 else PARALLEL_MIN_WORK)


def attention_rows(out, q, kc, vc, pos0, n_head, n_head_kv, head_dim_k, head_dim_v, kq_scale, ws=None, n_swa=0):
    """Causal multi-head attention of N query rows at positions pos0..pos0+N-1 over the cache.

    out: float32 [N, n_head * head_dim_v]; q: float32 [N, n_head * head_dim_k] (after RoPE);
    kc, vc: one layer's cache (kv_shapes, F16 bits; see store_kv) holding positions
    0..pos0+N-1; kq_scale: float32 (1/sqrt(head_dim)). Query head h reads KV head
    h // (n_head / n_head_kv). ws: a Workspace for at least the cache's positions (made here when
    None). Every output is computed by the same operations in the same order whatever the thread
    count and the split of the work, and row t equals a one-row call at position pos0 + t bit for
    bit. The caller guarantees the shapes and pos0 + N <= n_ctx. n_swa > 0: a sliding window,
    row t attends positions pos0 + t - n_swa + 1 .. pos0 + t only.
    """
    if ws is None:
        ws = Workspace(kc.shape[1] * KT, n_head, n_head_kv, head_dim_k, head_dim_v)
    n = q.shape[0]
    kernel_for(ws, n, pos0, n_head, head_dim_k, head_dim_v)(out, q, kc, vc, pos0, n_head, n_head_kv,
                                                           np.float32(kq_scale), ws.buf, n_swa, ws.item_table(n == 1))


def kernel_for(ws, n, pos0, n_head, head_dim_k, head_dim_v):
    """The attention kernel attention_rows runs for n query rows at positions pos0..: on all
    threads when the Workspace's warm-up override or uses_parallel says so. A function (out, q, kc,
    vc, pos0, n_head, n_head_kv, kq_scale, ws.buf, n_swa, items) over arrays attention_rows has
    checked, items ws.item_table(n == 1)."""
    par = ws.parallel_override.get(n == 1)
    if par is None:
        par = uses_parallel(n, pos0, n_head, head_dim_k, head_dim_v)
    return _entry(ws, par, n == 1)


def _entry(ws, par, decode):
    """The vector kernel for a decode row (decode) or a prefill batch where the Workspace has a
    plan, else the per-head kernel; on all threads (par) or the calling one."""
    if ws.plan is None:
        return _per_head_par if par else _per_head_ser
    return vector_kernel(par, decode)


@kernel
def _per_head_ser(out, q, kc, vc, pos0, n_head, n_head_kv, kq_scale, ws, n_swa, items):
    """_attention_ser with the vector kernels' arguments (head dims from the cache's shapes; no items)."""
    _attention_ser(out, q, kc, vc, pos0, n_head, n_head_kv, kc.shape[2], vc.shape[3], kq_scale, n_swa)


@kernel
def _per_head_par(out, q, kc, vc, pos0, n_head, n_head_kv, kq_scale, ws, n_swa, items):
    """_attention_par with the vector kernels' arguments (head dims from the cache's shapes; no items)."""
    _attention_par(out, q, kc, vc, pos0, n_head, n_head_kv, kc.shape[2], vc.shape[3], kq_scale, n_swa)


def compile_kernels(kc, vc, n_head, n_head_kv, head_dim_k, head_dim_v, kq_scale, ws, kinds):
    """Run (so compile, or load from Numba's cache) the attention kernels of kinds, (decode,
    parallel) pairs (see _entry), on a decode row at position 1 and a 2-row batch (a warm-up).
    kc, vc: a layer's cache of at least 2 positions; ws: a Workspace for it."""
    for decode, par in sorted(kinds):
        n = 1 if decode else 2
        out = np.empty((n, n_head * head_dim_v), np.float32)
        q = np.zeros((n, n_head * head_dim_k), np.float32)
        _entry(ws, par, decode)(out, q, kc, vc, 2 - n, n_head, n_head_kv, np.float32(kq_scale), ws.buf, 0,
                                ws.item_table(decode))
