"""Numba kernels for llama-perplexity's per-position log-softmax (tools/perplexity/perplexity.cpp).

perplexity.cpp is compiled without -march (plain x86-64: SSE2, no FMA, so no contraction) and
mixes float and double in a precise way; each kernel below repeats that mix operation for
operation, so that the NLL sums, and the digits llama-perplexity prints from them, are the same:

  nll_rows        log_softmax(n_vocab, logits, tok) of the plain run: float max and float
                  ``l - max``, float ``expf``, the sum of the exps in double, ``log`` in double,
                  and NLL = -((double)(l_tok - max) - log(sum)).
  kld_base_rows   log_softmax(n_vocab, logits, log_prob, tok) of a --kl-divergence-base run:
                  the same sum, but log(sum) rounded to float and NLL = (max + lse) - l_tok in
                  float; also the uint16 record of the .kld base file (see synapse_nb.perplexity).
  kld_rows        log_softmax(n_vocab, logits, base_log_prob, tok, kld) of --kl-divergence:
                  NLL of ours and of the base, the KL divergence of the position, p(tok)
                  difference and whether the top tokens agree.
  kld_accumulate  the serial part of kl_divergence_result's sums (float products added to
                  double sums exactly as the C++ types do).

``math.exp`` of a float32 in Numba is a call to the C library's ``expf``, the function
perplexity.cpp calls (NumPy's own float32 exp differs from it in the last bit on ~40 % of
inputs); tests/test_perplexity.py checks the equality against libm through ctypes.
Rows are independent (parallel over rows); results do not depend on the thread count. The
kernels do not bounds-check: synapse_nb.perplexity validates shapes, dtypes and token ids.
"""

import math

import numpy as np
from numba import prange

from .decorator import kernel

_M16 = np.float32(16.0)  # the 16-nat window of the base file
_NEG16 = np.float32(-16.0)
_Q_MAX = np.float32(65535.0)
_ONE = np.float32(1.0)
_ZERO = np.float32(0.0)
_MAGIC = np.float32(12582912.0)  # nearest_int: 1.5 * 2**23


@kernel(parallel=True)
def nll_rows(out, logits, targets):
    """out float64 [n] <- NLL of targets[r] under logits[r] (float32 [n, n_vocab]); targets int64 [n]."""
    n, nv = logits.shape
    for r in prange(n):
        row = logits[r]
        mx = row[0]
        for i in range(1, nv):
            v = row[i]
            if mx < v:  # std::max(max_logit, v)
                mx = v
        s = 0.0
        for i in range(nv):
            s += math.exp(row[i] - mx)  # float expf, double sum
        out[r] = -(np.float64(row[targets[r]] - mx) - math.log(s))


@kernel(parallel=True)
def kld_base_rows(out_nll, rec_u16, rec_f32, logits, targets):
    """One .kld record per row, and the NLL that llama-perplexity sums while it writes them.

    out_nll float64 [n]; rec_u16 uint16 [n, nv] with nv = 2*ceil(n_vocab/2) + 4, zeroed by the
    caller (the pad entry stays 0); rec_f32 = rec_u16.view(float32) [n, nv/2] (the same memory:
    rec_f32[r, 0] = scale, rec_f32[r, 1] = min_log_prob); logits float32 [n, n_vocab].
    """
    n, nv = logits.shape
    for r in prange(n):
        row = logits[r]
        mx = row[0]
        mn = row[0]
        for i in range(1, nv):
            v = row[i]
            if mx < v:
                mx = v
            if v < mn:  # std::min(min_logit, v)
                mn = v
        lo = mx - _M16
        if mn < lo:  # std::max(min_logit, max_logit - 16)
            mn = lo
        s = 0.0
        for i in range(nv):
            s += math.exp(row[i] - mx)
        lse = np.float32(math.log(s))
        min_log_prob = (mn - mx) - lse
        scale = (mx - mn) / _Q_MAX
        rec_f32[r, 0] = scale
        rec_f32[r, 1] = min_log_prob
        if scale != _ZERO:
            inv = _ONE / scale
            for i in range(nv):
                v = row[i]
                if v > mn:
                    # nearest_int(): adding 1.5 * 2**23 in float rounds half to even
                    t = inv * (v - mn) + _MAGIC
                    rec_u16[r, 4 + i] = np.uint16((np.int64(t) - 12582912) & 0xFFFF)
                else:
                    rec_u16[r, 4 + i] = 0
        out_nll[r] = np.float64((mx + lse) - row[targets[r]])


@kernel(parallel=True)
def kld_rows(out_nll, out_nll_base, out_kld, out_pdiff, out_same, logits, targets, rec_u16, rec_f32):
    """Per row: our NLL (float32), the base's NLL (float32), KL(base || ours) (float64), p - p_base
    (float32) and top token agreement (uint8), from logits float32 [n, n_vocab] and the base's
    records rec_u16 uint16 [n, nv] / rec_f32 float32 [n, nv/2] (the same bytes)."""
    n, nv = logits.shape
    for r in prange(n):
        row = logits[r]
        mx = row[0]
        imax = 0
        for i in range(1, nv):
            if row[i] > mx:
                mx = row[i]
                imax = i
        s = 0.0
        for i in range(nv):
            s += math.exp(row[i] - mx)
        lse = np.float32(math.log(s))
        scale = rec_f32[r, 0]
        min_log_prob = rec_f32[r, 1]
        tok = targets[r]
        nll = (mx + lse) - row[tok]
        nll_base = -(scale * np.float32(rec_u16[r, 4 + tok]) + min_log_prob)
        mxl = mx + lse
        acc = 0.0
        imax_base = -1
        p_max = _ZERO
        for i in range(nv):
            plb = scale * np.float32(rec_u16[r, 4 + i]) + min_log_prob
            if i == 0 or plb > p_max:
                p_max = plb
                imax_base = i
            if plb > _NEG16:
                pb = math.exp(plb)
                acc += pb * ((plb - row[i]) + mxl)  # float product, double sum
        out_nll[r] = nll
        out_nll_base[r] = nll_base
        out_kld[r] = acc
        out_pdiff[r] = math.exp(-nll) - math.exp(-nll_base)
        out_same[r] = 1 if imax == imax_base else 0


@kernel
def kld_accumulate(sums, nll, nll_base, kld, pdiff, same):
    """Add one chunk's rows to sums float64 [13] in row order (serial, as one thread of C++ would).

    sums: 0 nll, 1 nll^2, 2 nll_base, 3 nll_base^2, 4 nll*nll_base, 5 kld, 6 kld^2, 7 p_diff,
    8 p_diff^2, 9 p_diff^4, 10 max|p_diff| (a float32 value), 11 n_same_top, 12 count.
    """
    max_pd = np.float32(sums[10])
    for i in range(nll.shape[0]):
        a = nll[i]
        b = nll_base[i]
        sums[0] += a
        sums[1] += a * a  # float * float
        sums[2] += b
        sums[3] += b * b
        sums[4] += a * b
        sums[5] += kld[i]
        sums[6] += kld[i] * kld[i]  # double
        d = pdiff[i]
        sums[7] += d
        d2 = np.float64(d * d)
        sums[8] += d2
        sums[9] += d2 * d2
        ad = abs(d)
        if max_pd < ad:
            max_pd = ad
        sums[11] += same[i]
        sums[12] += 1.0
    sums[10] = max_pd
