"""Numba kernels of llama.cpp's sampler chain: libstdc++'s sorts and the samplers' float loops.

llama.cpp (src/llama-sampling.cpp, commit 0c1e570 as vendored by llama-cpp-python 0.3.36, built
by g++ 12 / libstdc++ on x86-64 without FMA contraction in libllama) orders candidates with
``std::partial_sort`` and ``std::sort``. Neither is stable, so the order of tied logits, and with
it the sampled token, depends on the exact sequence of comparisons and moves. The functions below
transcribe libstdc++'s algorithms (bits/stl_algo.h, bits/stl_heap.h of GCC 12) move for move:

  partial_sort(key, pos, first, middle, last)   std::partial_sort = __heap_select + __sort_heap
  introsort(key, pos, first, last)              std::sort = __introsort_loop (threshold 16,
                                                depth 2*lg n, median-of-3 pivot, heapsort
                                                fallback) + __final_insertion_sort
  bucket_partial_sort(key, pos, npartial)       llama_token_data_array_partial_sort

An element of llama.cpp's llama_token_data array is represented by a pair (key[j], pos[j]):
key is the comparison key (float32), pos an int64 carried along (the element's index in the
caller's arrays), so the caller applies the resulting permutation to ids and probabilities.
The comparator is always ``comp(a, b) = key[a] > key[b]`` (llama.cpp's ``a.logit > b.logit``;
typical's ``score[a] < score[b]`` is the same comparator on key = -score, exact for every float
including NaN, for which every comparison is false).

The float loops (softmax, dist, top-n-sigma, typical, min-p, dynatemp, temp 0) round every
operation to float32 (or double where llama.cpp uses double) in llama.cpp's order; ``math.exp``
and ``math.log`` on float32 compile to calls to glibc's ``expf`` and ``logf``, as llama.cpp's.

The kernels do not bounds-check (Numba does not); synapse_nb.sampling validates the arrays
(contiguous, matching lengths, 0 <= first <= middle <= last <= len) before calling them. The
scans that libstdc++ leaves unguarded (it relies on a consistent ordering) are bounded by the
range here, which changes nothing for a strict weak ordering and keeps memory safe otherwise.
"""

import math

import numpy as np
from .decorator import kernel

_F32 = np.float32
_NEG_INF = np.float32(-np.inf)
_FLT_MAX = np.float32(np.finfo(np.float32).max)

# llama_token_data_array_partial_sort: 128 buckets over [-10, 10], as its constexpr floats.
_NBUCKETS = 128
_BUCKET_SCALE = np.float32(np.float32(128) / (np.float32(10.0) - np.float32(-10.0)))  # 6.4f
_BUCKET_INTER = np.float32(-np.float32(-10.0) * _BUCKET_SCALE)                        # 64.0f


# ---------------------------------------------------------------------------------------------
# libstdc++ heap (bits/stl_heap.h) with comp(a, b) = key[a] > key[b]
# ---------------------------------------------------------------------------------------------

@kernel(inline="always")
def _adjust_heap(key, pos, first, hole, length, vkey, vpos):
    """std::__adjust_heap(first, holeIndex, len, value) followed by std::__push_heap."""
    top = hole
    second = hole
    while second < (length - 1) // 2:
        second = 2 * (second + 1)
        if key[first + second] > key[first + second - 1]:
            second -= 1
        key[first + hole] = key[first + second]
        pos[first + hole] = pos[first + second]
        hole = second
    if (length & 1) == 0 and second == (length - 2) // 2:
        second = 2 * (second + 1)
        key[first + hole] = key[first + second - 1]
        pos[first + hole] = pos[first + second - 1]
        hole = second - 1
    # __push_heap(first, hole, top, value)
    while hole > top:
        parent = (hole - 1) // 2
        if not (key[first + parent] > vkey):
            break
        key[first + hole] = key[first + parent]
        pos[first + hole] = pos[first + parent]
        hole = parent
    key[first + hole] = vkey
    pos[first + hole] = vpos


@kernel
def _make_heap(key, pos, first, last):
    """std::__make_heap(first, last)."""
    length = last - first
    if length < 2:
        return
    parent = (length - 2) // 2
    while True:
        _adjust_heap(key, pos, first, parent, length, key[first + parent], pos[first + parent])
        if parent == 0:
            return
        parent -= 1


@kernel
def _pop_heap(key, pos, first, last, result):
    """std::__pop_heap(first, last, result): *result = *first, then re-heap [first, last) with *result's old value."""
    vkey = key[result]
    vpos = pos[result]
    key[result] = key[first]
    pos[result] = pos[first]
    _adjust_heap(key, pos, first, 0, last - first, vkey, vpos)


@kernel
def _sort_heap(key, pos, first, last):
    """std::__sort_heap(first, last)."""
    while last - first > 1:
        last -= 1
        _pop_heap(key, pos, first, last, last)


@kernel
def partial_sort(key, pos, first, middle, last):
    """std::partial_sort(first, middle, last, comp) of libstdc++: __heap_select + __sort_heap.

    After it, [first, middle) holds the middle-first largest keys in descending order (ties in
    libstdc++'s order); [middle, last) holds the rest, permuted as libstdc++ leaves them.
    """
    _make_heap(key, pos, first, middle)
    for i in range(middle, last):
        if key[i] > key[first]:
            _pop_heap(key, pos, first, middle, i)
    _sort_heap(key, pos, first, middle)


# ---------------------------------------------------------------------------------------------
# libstdc++ std::sort (bits/stl_algo.h): introsort + final insertion sort
# ---------------------------------------------------------------------------------------------

@kernel(inline="always")
def _swap(key, pos, a, b):
    k = key[a]
    key[a] = key[b]
    key[b] = k
    p = pos[a]
    pos[a] = pos[b]
    pos[b] = p


@kernel
def _move_median_to_first(key, pos, result, a, b, c):
    """std::__move_median_to_first(result, a, b, c): its comparisons in its order, then its one swap.

    libstdc++ branches on comp(a, b) into two mirror images: (hi, lo) = (b, a) if comp(a, b) else
    (a, b), then hi if comp(hi, c), else c if comp(lo, c), else lo."""
    hi, lo = (b, a) if key[a] > key[b] else (a, b)
    if key[hi] > key[c]:
        median = hi
    elif key[lo] > key[c]:
        median = c
    else:
        median = lo
    _swap(key, pos, result, median)


@kernel
def _unguarded_partition(key, pos, first, last, pivot, lo, hi):
    """std::__unguarded_partition(first, last, pivot); scans bounded to [lo, hi) for memory safety."""
    pk = key[pivot]
    while True:
        while first < hi - 1 and key[first] > pk:
            first += 1
        last -= 1
        while last > lo and pk > key[last]:
            last -= 1
        if not first < last:
            return first
        _swap(key, pos, first, last)
        first += 1


@kernel
def _unguarded_linear_insert(key, pos, last, lo):
    """std::__unguarded_linear_insert(last); the scan stops at lo for memory safety."""
    vkey = key[last]
    vpos = pos[last]
    nxt = last - 1
    while nxt >= lo and vkey > key[nxt]:
        key[last] = key[nxt]
        pos[last] = pos[nxt]
        last = nxt
        nxt -= 1
    key[last] = vkey
    pos[last] = vpos


@kernel
def _insertion_sort(key, pos, first, last):
    """std::__insertion_sort(first, last)."""
    if first == last:
        return
    for i in range(first + 1, last):
        if key[i] > key[first]:
            vkey = key[i]
            vpos = pos[i]
            for j in range(i, first, -1):  # move_backward(first, i, i + 1)
                key[j] = key[j - 1]
                pos[j] = pos[j - 1]
            key[first] = vkey
            pos[first] = vpos
        else:
            _unguarded_linear_insert(key, pos, i, first)


@kernel
def _lg(n):
    """std::__lg(n): floor(log2(n)) for n >= 1."""
    r = -1
    while n > 0:
        n >>= 1
        r += 1
    return r


@kernel
def introsort(key, pos, first, last):
    """std::sort(first, last, comp) of libstdc++ (GCC 12), descending by key, unstable.

    __introsort_loop's recursion on the right part is an explicit stack here: the parts are
    disjoint, so the order in which they are finished does not change the result.
    """
    if last - first < 1:
        return
    threshold = 16
    stack = np.empty((2 * 64 + 8, 3), np.int64)
    sp = 0
    stack[0, 0] = first
    stack[0, 1] = last
    stack[0, 2] = 2 * _lg(last - first)
    sp = 1
    while sp > 0:
        sp -= 1
        f = stack[sp, 0]
        la = stack[sp, 1]
        depth = stack[sp, 2]
        while la - f > threshold:
            if depth == 0:
                partial_sort(key, pos, f, la, la)
                break
            depth -= 1
            mid = f + (la - f) // 2
            _move_median_to_first(key, pos, f, f + 1, mid, la - 1)
            cut = _unguarded_partition(key, pos, f + 1, la, f, f, la)
            stack[sp, 0] = cut
            stack[sp, 1] = la
            stack[sp, 2] = depth
            sp += 1
            la = cut
    # __final_insertion_sort
    if last - first > threshold:
        _insertion_sort(key, pos, first, first + threshold)
        for i in range(first + threshold, last):
            _unguarded_linear_insert(key, pos, i, first)
    else:
        _insertion_sort(key, pos, first, last)


# ---------------------------------------------------------------------------------------------
# llama_token_data_array_partial_sort (the bucket pre-sort for npartial > 128)
# ---------------------------------------------------------------------------------------------

@kernel
def bucket_partial_sort(key, pos, npartial):
    """llama_token_data_array_partial_sort(cur, npartial, res): returns (res_key, res_pos).

    key float32 [n], pos int64 [n] (not modified); 1 <= npartial <= n. The result holds every
    element of the buckets from the top down to the bucket where npartial is reached (nhave >=
    npartial elements), bucket by bucket in descending order and in array order within a bucket;
    each bucket above the cut is std::sort-ed and the cut bucket std::partial_sort-ed, so the
    first npartial are the npartial largest in llama.cpp's order.
    Bucket: int(6.4f * logit + 64.0f) clamped to [0, 127], with x86's cvttss2si for values
    outside int32 (NaN, +-inf, huge: INT_MIN, so bucket 0).
    """
    n = key.shape[0]
    bidx = np.empty(n, np.int32)
    histo = np.zeros(_NBUCKETS, np.int64)
    for i in range(n):
        t = _BUCKET_SCALE * key[i] + _BUCKET_INTER
        if t > _F32(-2147483648.0) and t < _F32(2147483648.0):
            ib = int(t)
        else:
            ib = -2147483648
        if ib > _NBUCKETS - 1:
            ib = _NBUCKETS - 1
        if ib < 0:
            ib = 0
        bidx[i] = ib
        histo[ib] += 1
    nhave = 0
    ib = _NBUCKETS - 1
    while ib >= 0:
        nhave += histo[ib]
        if nhave >= npartial:
            break
        ib -= 1
    rkey = np.empty(nhave, np.float32)
    rpos = np.empty(nhave, np.int64)
    ptrs = np.zeros(_NBUCKETS, np.int64)
    off = 0
    for j in range(_NBUCKETS - 1, ib - 1, -1):
        ptrs[j] = off
        off += histo[j]
    for i in range(n):
        j = bidx[i]
        if j >= ib:
            rkey[ptrs[j]] = key[i]
            rpos[ptrs[j]] = pos[i]
            ptrs[j] += 1
    off = 0
    ndone = 0
    for j in range(_NBUCKETS - 1, ib, -1):
        introsort(rkey, rpos, off, off + histo[j])
        off += histo[j]
        ndone += histo[j]
    partial_sort(rkey, rpos, off, off + npartial - ndone, off + histo[ib])
    return rkey, rpos


# ---------------------------------------------------------------------------------------------
# Float loops of the samplers
# ---------------------------------------------------------------------------------------------

@kernel
def max_logit(logit):
    """std::max accumulated from logit[0]: m = (m < x) ? x : m, as llama.cpp's softmax and dist."""
    m = logit[0]
    for i in range(1, logit.shape[0]):
        if m < logit[i]:
            m = logit[i]
    return m


@kernel
def softmax(logit, p, is_sorted):
    """llama_sampler_softmax_impl after its optional sort: p_i = expf(l_i - max) / sum (float sum in order)."""
    m = logit[0] if is_sorted else max_logit(logit)
    s = _F32(0.0)
    for i in range(logit.shape[0]):
        e = math.exp(logit[i] - m)
        p[i] = e
        s += e
    for i in range(logit.shape[0]):
        p[i] = p[i] / s


@kernel
def dist(logit, p, is_sorted, u):
    """llama_sampler_dist_apply for n >= 2: returns the selected index and fills p (normalised).

    p_i = expf(l_i - max) in float, summed in double in the current order; the first i whose
    running double sum is >= sum * u is selected (the last one if none is, as llama.cpp's fallback).
    """
    n = logit.shape[0]
    m = logit[0] if is_sorted else max_logit(logit)
    sum_cum = 0.0
    for i in range(n):
        e = math.exp(logit[i] - m)
        p[i] = e
        sum_cum += np.float64(e)
    tgt = sum_cum * u
    run = 0.0
    sel = -1
    for i in range(n):
        if sel < 0:
            run += np.float64(p[i])
            if run >= tgt:
                sel = i
        p[i] = _F32(np.float64(p[i]) / sum_cum)
    if sel < 0:
        sel = n - 1
    return sel


@kernel
def temp_zero(logit):
    """llama_sampler_temp_impl with temp <= 0: keep the first maximum (strict >) in the current
    order, every other logit becomes -inf."""
    max_i = 0
    max_l = logit[0]
    for i in range(1, logit.shape[0]):
        if logit[i] > max_l:
            logit[max_i] = _NEG_INF
            max_i = i
            max_l = logit[i]
        else:
            logit[i] = _NEG_INF


@kernel
def top_n_sigma(logit, nsig):
    """llama_sampler_top_n_sigma_apply (n > 0, size > 1): logits below max - n*std become -inf.

    Mean in float over the non -inf logits; variance accumulated as acc = float(double(acc) +
    pow(double(l - mean), 2)) (C++ pow on float promotes to double; the square is exact).
    """
    n = logit.shape[0]
    mx = logit[0]
    s = _F32(0.0)
    cnt = 0
    for i in range(n):
        x = logit[i]
        if x != _NEG_INF:
            if mx < x:
                mx = x
            s += x
            cnt += 1
    mean = s / _F32(cnt) if cnt > 0 else _F32(0.0)
    acc = _F32(0.0)
    for i in range(n):
        x = logit[i]
        if x != _NEG_INF:
            d = np.float64(x - mean)
            acc = _F32(np.float64(acc) + d * d)
    sd = _F32(math.sqrt(np.float64(acc / _F32(cnt)))) if cnt > 0 else _F32(0.0)
    thr = mx - nsig * sd
    for i in range(n):
        if logit[i] < thr:
            logit[i] = _NEG_INF


@kernel
def min_p_unsorted(logit, log_p):
    """The unsorted branch of llama_sampler_min_p_apply: a bool mask of logit >= max + logf(p),
    max accumulated from -FLT_MAX with std::max. Returns (mask, count)."""
    n = logit.shape[0]
    m = -_FLT_MAX
    for i in range(n):
        if m < logit[i]:
            m = logit[i]
    thr = m + log_p
    mask = np.empty(n, np.bool_)
    cnt = 0
    for i in range(n):
        k = logit[i] >= thr
        mask[i] = k
        if k:
            cnt += 1
    return mask, cnt


@kernel
def min_p_sorted_cut(logit, log_p, min_keep):
    """The sorted branch of llama_sampler_min_p_apply: the kept prefix length."""
    thr = logit[0] + log_p
    i = 1
    while i < logit.shape[0]:
        if logit[i] < thr and i >= min_keep:
            break
        i += 1
    return i


@kernel
def top_p_cut(p, top_p, min_keep, limit):
    """Running float sum of p over [0, limit): returns (i + 1) at the first i with sum >= top_p and
    i + 1 >= min_keep, or -1 if none (the caller continues after re-sorting, or keeps all)."""
    cum = _F32(0.0)
    for i in range(limit):
        cum += p[i]
        if cum >= top_p and i + 1 >= min_keep:
            return i + 1, cum
    return -1, cum


@kernel
def top_p_cut_from(p, top_p, min_keep, start, cum):
    """top_p_cut continued at index start with the running sum cum (top-p's adaptive path)."""
    for i in range(start, p.shape[0]):
        cum += p[i]
        if cum >= top_p and i + 1 >= min_keep:
            return i + 1
    return -1


@kernel
def typical_scores(p):
    """llama_sampler_typical_apply's entropy and shifted scores: H = sum of (-p) * logf(p) in
    float (NaN when a p is 0), score_i = fabsf(-logf(p_i) - H). Returns the negated scores (the
    sort key for comp = greater)."""
    n = p.shape[0]
    ent = _F32(0.0)
    for i in range(n):
        ent += -p[i] * math.log(p[i])
    neg = np.empty(n, np.float32)
    for i in range(n):
        neg[i] = -math.fabs(-math.log(p[i]) - ent)
    return neg


@kernel
def typical_cut(p, order, typ_p, min_keep):
    """Kept count of llama_sampler_typical_apply: first i with float cum sum > p (strict) and
    (min_keep == 0 or i >= min_keep - 1), in the order of the sorted indices."""
    cum = _F32(0.0)
    n = order.shape[0]
    for i in range(n):
        cum += p[order[i]]
        if cum > typ_p and (min_keep == 0 or i >= min_keep - 1):
            return i + 1
    return n


@kernel
def entropy_pos(p):
    """temp-ext's entropy: e -= p * logf(p) for p > 0, in float."""
    e = _F32(0.0)
    for i in range(p.shape[0]):
        x = p[i]
        if x > _F32(0.0):
            e -= x * math.log(x)
    return e


@kernel
def libm_f32(x, y):
    """(expf(x), logf(x), powf(x, y)) as compiled here, for checking against glibc's own."""
    return math.exp(x), math.log(x), math.pow(x, y)
