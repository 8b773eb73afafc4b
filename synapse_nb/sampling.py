"""Sampling exactly as llama.cpp samples: its sampler chain, its defaults, its RNG.

``Sampler(**params)`` reproduces the chain llama.cpp's ``common_sampler_init`` builds (llama.cpp
0c1e570, src/llama-sampling.cpp and common/sampling.cpp, as vendored by llama-cpp-python 0.3.36):

    [logit-bias] -> penalties -> dry -> top-n-sigma -> top-k -> typical -> top-p -> min-p
    -> xtc -> temp-ext -> dist(seed)

with every sampler's float32 arithmetic, glibc's expf/logf/powf, libstdc++'s std::partial_sort /
std::sort (unstable: the order of tied logits, hence the token, is libstdc++'s; see
synapse_nb.kernels.sampling) and std::mt19937 with libstdc++'s uniform_real_distribution. Given
the same logits, parameters and seed it picks the same tokens as llama.cpp (checked against the
library on tests/data/sampling/). A sampler llama.cpp builds as a disabled no-op (its name starts
with "?") is a no-op here under the same condition:

    penalties    penalty_last_n == 0, or repeat 1, frequency 0 and presence 0 together
    top-n-sigma  top_n_sigma <= 0          top-k    top_k <= 0
    typical      typical_p >= 1            top-p    top_p >= 1
    min-p        min_p <= 0                xtc      xtc_probability <= 0 or xtc_threshold > 0.5
    temp-ext     temp == 1 and dynatemp_range <= 0   (so temp 1.0 changes nothing)
    logit-bias   present only when there are biases

temp <= 0 is not a greedy shortcut: temp-ext keeps the first maximum in the current candidate
order and dist still draws. DRY and mirostat are not implemented: dry_multiplier != 0 raises
SynapseError (the other dry_* parameters are accepted, as they do nothing without it).

Usage (as llama-completion: accept the prompt, then sample-then-accept each step)::

    s = Sampler(temp=0.8, seed=42)
    s.accept_many(prompt_ids)
    tok = s.sample(logits)          # float32 [n_vocab]; accepts tok

Speed: the default chain on 151,936 logits costs one libstdc++ heap-select pass over the vocabulary
(Numba) plus work on the 40 candidates left; see README "Sampling".
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import random
import secrets
from collections import Counter, deque

import numpy as np

from .errors import SynapseError
from .options import BY_KEY, DRY_DEFAULTS, I32_MAX, I32_MIN, REFUSED, SAMPLING

__all__ = ["Sampler", "MT19937", "LLAMA_DEFAULT_SEED", "DEFAULTS", "CHAIN_ORDER", "eog_logit_bias",
           "parse_logit_bias", "given_options", "sampler_from_options", "build_sampler", "warmup"]

LLAMA_DEFAULT_SEED = 0xFFFFFFFF  # seed -1: a random seed

# common_params_sampling defaults (common/common.h), from the one parameter table (synapse_nb.options);
# the parameter names of the fixtures.
DEFAULTS = {**{p.key: p.default for p in SAMPLING}, **DRY_DEFAULTS}

# common_params_sampling.samplers, the default order.
CHAIN_ORDER = ("penalties", "dry", "top-n-sigma", "top-k", "typical", "top-p", "min-p", "xtc", "temp-ext")

_F32 = np.float32
_TWO32 = 4294967296.0
_TWO64 = 18446744073709551616.0


# ---------------------------------------------------------------------------------------------
# glibc libm for the scalar calls (logf(p), powf(entropy, exponent), ...)
# ---------------------------------------------------------------------------------------------

_libm_cache = None


def _libm():
    global _libm_cache
    if _libm_cache is None:
        lib = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
        for name, nargs in (("logf", 1), ("powf", 2)):
            f = getattr(lib, name)
            f.restype = ctypes.c_float
            f.argtypes = [ctypes.c_float] * nargs
        _libm_cache = lib
    return _libm_cache


def _logf(x) -> np.float32:
    return _F32(_libm().logf(float(_F32(x))))


def _powf(x, y) -> np.float32:
    return _F32(_libm().powf(float(_F32(x)), float(_F32(y))))


# ---------------------------------------------------------------------------------------------
# std::mt19937 and libstdc++'s uniform_real_distribution
# ---------------------------------------------------------------------------------------------

class MT19937:
    """std::mt19937 seeded with a 32-bit seed, with libstdc++'s uniform_real_distribution(0, 1).

    Outputs come from CPython's own Mersenne Twister (the same generator and tempering as
    std::mt19937), loaded with the state std::mt19937(seed) initialises.
    """

    def __init__(self, seed: int):
        seed = int(seed) & 0xFFFFFFFF
        mt = [seed]
        for i in range(1, 624):
            prev = mt[-1]
            mt.append((1812433253 * (prev ^ (prev >> 30)) + i) & 0xFFFFFFFF)
        self._rng = random.Random()
        self._rng.setstate((3, tuple(mt) + (624,), None))
        self._bits = self._rng.getrandbits

    def next_u32(self) -> int:
        """The next raw 32-bit output (operator())."""
        return self._bits(32)

    def uniform_double(self) -> float:
        """uniform_real_distribution<double>(0, 1): generate_canonical<double, 53> takes two
        outputs x1, x2: (x1 + x2 * 2**32) rounded to double, / 2**64, 1.0 -> nextafter(1, 0)."""
        x1 = self._bits(32)
        x2 = self._bits(32)
        u = (float(x1) + float(x2) * _TWO32) / _TWO64
        return math.nextafter(1.0, 0.0) if u >= 1.0 else u

    def uniform_float(self) -> np.float32:
        """uniform_real_distribution<float>(0, 1): one output, float(x) / 2**32 in float."""
        u = _F32(self._bits(32)) / _F32(_TWO32)
        return np.nextafter(_F32(1.0), _F32(0.0)) if u >= _F32(1.0) else u


# ---------------------------------------------------------------------------------------------
# The candidate array (llama_token_data_array) and the sorts llama.cpp applies to it
# ---------------------------------------------------------------------------------------------

class _Cands:
    """llama_token_data_array as parallel arrays: ids int64 [n], logit float32 [n], p float32 [n]
    or None (never read before a softmax writes it), sorted flag, and whether ids are still
    0..n-1 in order (so data[id].id == id, llama.cpp's logit-bias fast path)."""

    __slots__ = ("ids", "logit", "p", "sorted", "identity", "selected")

    def __init__(self, logits: np.ndarray):
        self.ids = None  # identity: materialised on the first reorder
        self.logit = logits
        self.p = None
        self.sorted = False
        self.identity = True
        self.selected = -1

    @property
    def size(self) -> int:
        return self.logit.shape[0]

    def take(self, pos: np.ndarray, new_logit: np.ndarray | None = None) -> None:
        """Keep the elements at positions pos (int64), in that order."""
        self.ids = pos.copy() if self.identity else self.ids[pos]
        self.identity = False
        self.logit = self.logit[pos] if new_logit is None else new_logit
        if self.p is not None:
            self.p = self.p[pos]

    def get_ids(self) -> np.ndarray:
        return np.arange(self.size, dtype=np.int64) if self.identity else self.ids


def _K():
    from .kernels import sampling as k

    return k


def _partial_sort_inplace(c: _Cands, npartial: int) -> None:
    """llama_token_data_array_partial_sort_inplace: the npartial largest, sorted; size = npartial."""
    k = _K()
    n = c.size
    if npartial <= 128:
        key = c.logit.copy()
        pos = np.arange(n, dtype=np.int64)
        k.partial_sort(key, pos, 0, npartial, n)
        c.take(pos[:npartial].copy(), key[:npartial].copy())
    else:
        rkey, rpos = k.bucket_partial_sort(c.logit, np.arange(n, dtype=np.int64), npartial)
        c.take(rpos[:npartial], rkey[:npartial].copy())
    c.sorted = True


def _softmax(c: _Cands, do_sort: bool) -> None:
    """llama_sampler_softmax_impl(cur_p, do_sort)."""
    if c.size == 0:
        raise SynapseError("sampling: no candidates left")
    if do_sort and not c.sorted:
        _partial_sort_inplace(c, c.size)
    if c.p is None or c.p.shape[0] != c.size:
        c.p = np.empty(c.size, np.float32)
    _K().softmax(c.logit, c.p, c.sorted)


# ---------------------------------------------------------------------------------------------
# The sampler
# ---------------------------------------------------------------------------------------------

_F32_MAX = float(np.finfo(np.float32).max)


def _f32_param(name, value, finite=True):
    # a number (not a string, a bool or None: batch lines are JSON), within float32's range
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise SynapseError(f"sampling: {name} must be a number, got {value!r}")
    v = float(value)
    if math.isnan(v) or (finite and math.isinf(v)):
        raise SynapseError(f"sampling: {name} must be a finite number, got {value!r}")
    if math.isfinite(v) and abs(v) > _F32_MAX:
        raise SynapseError(f"sampling: {name} {value!r} is out of float32's range")
    return _F32(v)


def _int_param(name, value, lo=None, hi=None):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise SynapseError(f"sampling: {name} must be an integer, got {value!r}")
    value = int(value)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise SynapseError(f"sampling: {name} must be {rng}, got {value}")
    return value


def _table_int(key, value):
    """An integer parameter checked against its range in the parameter table (synapse_nb.options)."""
    p = BY_KEY[key]
    return _int_param(key, value, p.lo, p.hi)


class Sampler:
    """llama.cpp's default sampler chain with its parameters (common_params_sampling names).

    Parameters (defaults are llama.cpp's): temp 0.8, top_k 40, top_p 0.95, min_p 0.05,
    typical_p 1.0, min_keep 0, penalty_last_n 64 (>= 0; 0 disables), repeat_penalty 1.0 (finite,
    > 0), frequency_penalty 0.0, presence_penalty 0.0, top_n_sigma -1.0, xtc_probability 0.0,
    xtc_threshold 0.1, dynatemp_range 0.0, dynatemp_exponent 1.0, seed -1 (random: the seed
    chosen is ``self.seed``, used by both dist and xtc, so passing it back reproduces the run;
    otherwise 0..2**32-1), logit_bias: iterable of (token id, bias) pairs (bias may be -inf),
    applied in order (token ids in [0, n_vocab) when n_vocab is given). Numbers must be int or
    float (not strings) within float32's range; they are rounded to float32 as llama.cpp stores them. dry_multiplier
    must be 0 (DRY is not implemented); dry_base, dry_allowed_length and dry_penalty_last_n are
    accepted and unused. Raises SynapseError for a bad value.

    grammar: a synapse_nb.grammar.GrammarMatcher, or None. With it, sample() does what
    llama.cpp's common_sampler_sample does: sample with the chain, check that token against the
    grammar, and if the grammar rejects it, apply the grammar to all the logits (rejected ones
    -inf) and run the chain again (so dist draws again); the token is then accepted by the
    grammar, then by the chain. accept() / accept_many() (the prompt) go to the chain only.

    Attributes: ``chain`` (sampler names as llama.cpp prints them, "?x" for a disabled one),
    ``seed``, ``grammar``, and after each sample(): ``last_u`` (dist's uniform draw),
    ``last_n_candidates``, ``last_p`` (the token's probability after the chain),
    ``last_resampled`` (the grammar rejected the first draw).
    """

    def __init__(self, *, temp=0.8, top_k=40, top_p=0.95, min_p=0.05, typical_p=1.0, min_keep=0,
                 penalty_last_n=64, repeat_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0,
                 top_n_sigma=-1.0, xtc_probability=0.0, xtc_threshold=0.1, dynatemp_range=0.0,
                 dynatemp_exponent=1.0, seed=-1, logit_bias=(), dry_multiplier=0.0, dry_base=1.75,
                 dry_allowed_length=2, dry_penalty_last_n=64, n_vocab=None, grammar=None):
        self._params = dict(temp=temp, top_k=top_k, top_p=top_p, min_p=min_p, typical_p=typical_p,
                            min_keep=min_keep, penalty_last_n=penalty_last_n, repeat_penalty=repeat_penalty,
                            frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
                            top_n_sigma=top_n_sigma, xtc_probability=xtc_probability, xtc_threshold=xtc_threshold,
                            dynatemp_range=dynatemp_range, dynatemp_exponent=dynatemp_exponent)
        for key, value in self._params.items():  # float32 numbers, or ints in the table's range
            setattr(self, key, _f32_param(key, value) if BY_KEY[key].kind == "float" else _table_int(key, value))
        if not self.repeat_penalty > 0 or not math.isfinite(_F32(1.0) / self.repeat_penalty):
            raise SynapseError(f"sampling: repeat_penalty must be finite and > 0, got {repeat_penalty!r}")
        if _f32_param("dry_multiplier", dry_multiplier) != 0:
            raise SynapseError("sampling: DRY (dry_multiplier != 0) is not supported")
        _f32_param("dry_base", dry_base)
        _int_param("dry_allowed_length", dry_allowed_length, I32_MIN, I32_MAX)
        _int_param("dry_penalty_last_n", dry_penalty_last_n, I32_MIN, I32_MAX)
        seed = _table_int("seed", seed)
        if seed == -1 or seed == LLAMA_DEFAULT_SEED:
            seed = secrets.randbits(32)  # get_rng_seed's random seed, one for dist and xtc
        self.seed = seed
        biases = []
        for item in logit_bias or ():
            try:
                tok, bias = item
            except (TypeError, ValueError):
                raise SynapseError(f"sampling: logit_bias entries must be (token, bias) pairs, got {item!r}") \
                    from None
            tok = _int_param("logit_bias token", tok, 0, None if n_vocab is None else n_vocab - 1)
            biases.append((tok, _f32_param("logit_bias bias", bias, finite=False)))
        self.logit_bias = tuple(biases)

        # Which samplers are active (llama_sampler_init_* returning an empty "?name" sampler).
        self._pen_on = not (self.penalty_last_n == 0 or (self.repeat_penalty == 1 and self.frequency_penalty == 0
                                                          and self.presence_penalty == 0))
        active = {
            "penalties": self._pen_on,
            "dry": False,
            "top-n-sigma": self.top_n_sigma > 0,
            "top-k": self.top_k > 0,
            "typical": self.typical_p < 1,
            "top-p": self.top_p < 1,
            "min-p": self.min_p > 0,
            "xtc": not (self.xtc_probability <= 0 or self.xtc_threshold > 0.5),
            "temp-ext": not (self.temp == 1 and self.dynatemp_range <= 0),
        }
        self.chain = (["logit-bias"] if self.logit_bias else []) + \
            [n if active[n] else "?" + n for n in CHAIN_ORDER] + ["dist"]
        self._active = active
        self._log_min_p = _logf(self.min_p) if active["min-p"] else None
        self._dist_rng = MT19937(self.seed)
        self._xtc_rng = MT19937(self.seed)
        self._prev = deque(maxlen=max(self.penalty_last_n, 1))
        self._counts = Counter()
        self.last_u = None
        self.last_n_candidates = None
        self.last_p = None
        if grammar is not None and not all(hasattr(grammar, a) for a in ("allows", "allowed_mask", "accept")):
            raise SynapseError("sampling: grammar must be a synapse_nb.grammar.GrammarMatcher")
        self.grammar = grammar
        self.last_resampled = False

    def __repr__(self) -> str:
        return f"Sampler(chain={' -> '.join(self.chain)}, seed={self.seed})"

    # -- accept -------------------------------------------------------------------------------

    def accept(self, token: int) -> None:
        """llama_sampler_accept(chain, token): only the penalties window records it (dist and xtc
        do not touch their RNG on accept)."""
        if not self._pen_on:
            return
        token = int(token)
        self._counts[token] += 1
        if len(self._prev) >= self.penalty_last_n:
            old = self._prev[0]
            self._counts[old] -= 1
            if self._counts[old] == 0:
                del self._counts[old]
        self._prev.append(token)

    def accept_many(self, tokens) -> None:
        """accept() each token in order (llama-completion does this for the prompt)."""
        for t in tokens:
            self.accept(t)

    # -- sample -------------------------------------------------------------------------------

    def sample(self, logits) -> int:
        """Apply the chain to one row of logits, draw a token with dist, accept it and return it.

        logits: float32 [n_vocab] (other float dtypes are converted to float32; not modified).
        Raises SynapseError for a row that is not 1-D or empty.
        """
        row = np.asarray(logits)
        if row.ndim != 1 or row.shape[0] == 0:
            raise SynapseError(f"sampling: logits must be a non-empty 1-D row, got shape {row.shape}")
        if row.dtype != np.float32 and not np.issubdtype(row.dtype, np.floating):
            raise SynapseError(f"sampling: logits must be floating point, got {row.dtype}")
        c = _Cands(np.array(row, dtype=np.float32, copy=True, order="C"))
        self._apply(c)
        tok = int(c.get_ids()[c.selected])
        g = self.grammar
        if g is not None:
            # common_sampler_sample: the chain's token is checked against the grammar; if it is
            # rejected, the candidates are reset, the grammar applied to all of them (rejected
            # logits -inf), and the chain runs again (dist draws again)
            self.last_resampled = not g.allows(tok)
            if self.last_resampled:
                masked = np.where(g.allowed_mask(), np.asarray(row, dtype=np.float32), _F32(-np.inf))
                c = _Cands(np.ascontiguousarray(masked, dtype=np.float32))
                self._apply(c)
                tok = int(c.get_ids()[c.selected])
            g.accept(tok)  # common_sampler_accept: the grammar first, then the chain
        self.accept(tok)
        return tok

    def _apply(self, c: _Cands) -> None:
        a = self._active
        if self.logit_bias:
            self._logit_bias(c)
        for name in CHAIN_ORDER:  # common_sampler_init's order; a disabled sampler is a no-op
            if a.get(name):
                getattr(self, "_" + name.replace("-", "_"))(c)
        self._dist(c)

    def _logit_bias(self, c: _Cands) -> None:
        """llama_sampler_logit_bias_apply: direct index while data[id].id == id, else a search."""
        n = c.size
        ids = None
        for tok, bias in self.logit_bias:
            if c.identity:
                if 0 <= tok < n:
                    c.logit[tok] = c.logit[tok] + bias
            else:
                if ids is None:
                    ids = c.get_ids()
                if 0 <= tok < n and ids[tok] == tok:
                    c.logit[tok] = c.logit[tok] + bias
                else:  # first element with this id (one per element: `break` after a match)
                    hit = np.flatnonzero(ids == tok)
                    if hit.size:
                        c.logit[hit[0]] = c.logit[hit[0]] + bias
        # (the search loop applies only the first matching bias per element; entries reach it
        # only when candidates were reordered, which never happens before logit-bias here)

    def _penalties(self, c: _Cands) -> None:
        """llama_sampler_penalties_apply: per id in the window, repeat then frequency/presence."""
        rep, freq, pres = self.repeat_penalty, self.frequency_penalty, self.presence_penalty
        n = c.size
        ids = None if c.identity else c.get_ids()
        for tok, count in self._counts.items():
            if ids is None:
                if not 0 <= tok < n:
                    continue
                where = (tok,)
            else:
                where = np.flatnonzero(ids == tok)
            for i in where:
                x = c.logit[i]
                x = x * rep if x <= 0 else x / rep
                c.logit[i] = x - (_F32(count) * freq + _F32(count > 0) * pres)
        c.sorted = False

    def _top_n_sigma(self, c: _Cands) -> None:
        if c.size <= 1:
            return
        _K().top_n_sigma(c.logit, self.top_n_sigma)

    def _top_k(self, c: _Cands) -> None:
        """llama_sampler_top_k_impl: clamp k, partial sort unless sorted, truncate."""
        k = min(self.top_k, c.size)
        if not c.sorted:
            _partial_sort_inplace(c, k)
        else:
            self._truncate(c, k)

    @staticmethod
    def _truncate(c: _Cands, m: int) -> None:
        c.logit = c.logit[:m]
        if c.p is not None:
            c.p = c.p[:m]
        if not c.identity:  # (a prefix of 0..n-1 stays 0..m-1)
            c.ids = c.ids[:m]

    def _typical(self, c: _Cands) -> None:
        """llama_sampler_typical_apply: sort, entropy, std::sort of indices by |-log p - H|."""
        k = _K()
        _softmax(c, True)
        neg = k.typical_scores(c.p)
        order = np.arange(c.size, dtype=np.int64)
        k.introsort(neg, order, 0, c.size)
        last = k.typical_cut(c.p, order, self.typical_p, self.min_keep)
        c.take(order[:last].copy())
        c.sorted = False

    def _top_p(self, c: _Cands) -> None:
        """llama_sampler_top_p_apply, with its adaptive partial sort for > 1024 unsorted candidates."""
        k = _K()
        _softmax(c, False)
        n = c.size
        if not c.sorted and n > 1024:
            kk = min(256, n)
            pos0 = np.arange(n, dtype=np.int64)
            _, rpos = k.bucket_partial_sort(c.logit, pos0, kk)
            pdata = c.p[rpos]
            last, cum = k.top_p_cut(pdata, self.top_p, self.min_keep, kk)
            if last < 0 and kk < n:
                # i == k - 1 reached without the target: sort everything, continue at i = k
                _, rpos = k.bucket_partial_sort(c.logit, pos0, n)
                pdata = c.p[rpos]
                last = k.top_p_cut_from(pdata, self.top_p, self.min_keep, kk, cum)
            if last < 0:
                last = n
            c.take(rpos[:last].copy())
            c.sorted = True
            return
        if not c.sorted:
            _partial_sort_inplace(c, n)
        last, _ = k.top_p_cut(c.p, self.top_p, self.min_keep, n)
        self._truncate(c, n if last < 0 else last)

    def _min_p(self, c: _Cands) -> None:
        """llama_sampler_min_p_apply: unsorted filter first, sorted prefix cut as the fallback."""
        k = _K()
        if c.size == 0:
            return
        if not c.sorted:
            mask, cnt = k.min_p_unsorted(c.logit, self._log_min_p)
            if cnt > 0 and cnt >= self.min_keep:
                c.take(np.flatnonzero(mask).astype(np.int64))
                return
            _partial_sort_inplace(c, c.size)
        self._truncate(c, k.min_p_sorted_cut(c.logit, self._log_min_p, self.min_keep))

    def _xtc(self, c: _Cands) -> None:
        """llama_sample_xtc_apply: one float draw when >= 2 candidates; drop the top ones above
        the threshold (the data pointer moves past them)."""
        if c.size < 2:
            return
        chance = self._xtc_rng.uniform_float()
        if chance > self.xtc_probability:
            return
        _softmax(c, True)
        above = c.p >= self.xtc_threshold
        pos_last = 0
        if above[0]:
            nz = np.flatnonzero(~above)
            pos_last = (int(nz[0]) if nz.size else c.size) - 1
        if c.size - pos_last >= self.min_keep and pos_last > 0:
            if c.identity:
                c.ids = np.arange(c.size, dtype=np.int64)
                c.identity = False
            c.ids = c.ids[pos_last:]
            c.logit = c.logit[pos_last:]
            c.p = c.p[pos_last:]

    def _temp_ext(self, c: _Cands) -> None:
        """llama_sampler_temp_ext_apply: dynamic temperature from the entropy, or plain temp."""
        if self.dynatemp_range > 0:
            temp, delta = self.temp, self.dynatemp_range
            min_temp = max(_F32(0.0), temp - delta)
            max_temp = temp + delta
            if c.size <= 1:
                return
            max_entropy = -_logf(_F32(1.0) / _F32(c.size))
            _softmax(c, True)
            ent = _K().entropy_pos(c.p)
            norm = ent / max_entropy
            dyn = min_temp + (max_temp - min_temp) * _powf(norm, self.dynatemp_exponent)
            self._temp(c, dyn)
            # (its double-precision re-softmax only rewrites p, which dist recomputes)
        else:
            self._temp(c, self.temp)

    @staticmethod
    def _temp(c: _Cands, temp) -> None:
        """llama_sampler_temp_impl."""
        if c.size == 0:
            return
        if temp <= 0:
            _K().temp_zero(c.logit)
        else:
            c.logit = c.logit / _F32(temp)

    def _dist(self, c: _Cands) -> None:
        """llama_sampler_dist_apply: expf softmax summed in double, one uniform double draw."""
        n = c.size
        if n == 0:
            raise SynapseError("sampling: no candidates left for dist")
        u = self._dist_rng.uniform_double()
        self.last_u = u
        self.last_n_candidates = n
        if n == 1:
            c.selected = 0
            self.last_p = 1.0
            return
        p = np.empty(n, np.float32)
        c.selected = int(_K().dist(c.logit, p, c.sorted, u))
        self.last_p = float(p[c.selected])


# ---------------------------------------------------------------------------------------------
# Helpers for callers: EOG biases, command-line options, kernel warm-up
# ---------------------------------------------------------------------------------------------

def eog_logit_bias(eog_ids) -> list:
    """The biases llama-completion's --ignore-eos adds: (id, -inf) for every end-of-generation
    token, in ascending id order (common_init_from_params), after the user's own biases."""
    return [(int(t), float("-inf")) for t in sorted(eog_ids)]


# Sampler parameter -> command-line option (llama.cpp's flag names, common/arg.cpp), from the table.
CLI_PARAMS = {p.key: p.flag for p in SAMPLING}
# Flags of samplers not implemented (refused rather than ignored); their "disabled" value is accepted.
CLI_REFUSED = REFUSED


def parse_logit_bias(text: str, n_vocab: int | None = None) -> tuple:
    """One --logit-bias value, TOKEN_ID(+|-)BIAS as llama.cpp's ("15043+1", "15043-inf"), as
    (id, bias). Raises SynapseError for another form or an id outside [0, n_vocab)."""
    import re

    m = re.fullmatch(r"\s*([0-9]+)\s*([+-])\s*(\S+)\s*", text or "")
    try:
        bias = float(m.group(3)) if m else math.nan
    except ValueError:
        bias = math.nan
    if m is None or math.isnan(bias):
        raise SynapseError(f"-l/--logit-bias {text!r}: expected TOKEN_ID(+|-)BIAS, e.g. 15043+1 or 15043-inf")
    tok = int(m.group(1))
    if n_vocab is not None and tok >= n_vocab:
        raise SynapseError(f"-l/--logit-bias {text!r}: token id {tok} is outside the vocabulary [0, {n_vocab})")
    return tok, (-bias if m.group(2) == "-" else bias)


def given_options(opts: dict, n_vocab: int | None = None) -> dict:
    """The sampling options the command line gave, as Sampler parameters ({} when none).

    opts: option values by CLI_PARAMS / CLI_REFUSED key (None or empty when not given), logit_bias
    as TOKEN(+|-)BIAS strings, parsed here into (id, bias) pairs. Raises SynapseError (naming the
    flag) for a refused flag (DRY, mirostat) or a malformed bias. Used for the defaults of batch
    lines (synapse_nb.batch) and by sampler_from_options.
    """
    for key, (flag, disabled) in CLI_REFUSED.items():
        v = opts.get(key)
        if v is None or v == () or v == []:
            continue
        if disabled is not None:
            try:
                if float(v) == float(disabled):
                    continue
            except (TypeError, ValueError):
                pass
        what = "DRY" if key.startswith("dry") else "mirostat"
        raise SynapseError(f"{flag}: {what} sampling is not supported (llama.cpp's default chain without {what} is)")
    given = {k: v for k, v in opts.items() if k in CLI_PARAMS and v is not None and v != () and v != []}
    if "logit_bias" in given:
        given["logit_bias"] = [parse_logit_bias(t, n_vocab) for t in given["logit_bias"]]
    return given


def sampler_from_options(opts: dict, *, n_vocab: int, eog_ids=(), has_eos: bool = True,
                         ignore_eos: bool = False, grammar=None):
    """The Sampler the command line asks for, or None for greedy decoding.

    opts: option values by CLI_PARAMS / CLI_REFUSED key, None (or empty) when not given;
    logit_bias a sequence of TOKEN(+|-)BIAS strings. If no sampling option is given, returns
    None (the product's default stays greedy). Otherwise build_sampler with the options given
    over llama.cpp's defaults, its errors naming the flags; with ignore_eos (and a vocabulary that
    has an EOS token, else llama.cpp ignores --ignore-eos) every EOG token is biased to -inf.
    Raises SynapseError (naming the flag) for a refused flag (DRY, mirostat) or a bad value.
    grammar: a GrammarMatcher for Sampler(grammar=...), or None.
    """
    given = given_options(opts, n_vocab)
    if not given:
        return None
    return build_sampler(given, n_vocab=n_vocab, eog_ids=eog_ids if has_eos else (), ignore_eos=ignore_eos,
                         grammar=grammar, names=CLI_PARAMS)


def build_sampler(params: dict, *, n_vocab: int | None = None, eog_ids=(), ignore_eos: bool = False, grammar=None,
                  names: dict | None = None) -> Sampler:
    """The Sampler of params, as every mode builds it (the CLI, batch lines, HTTP requests).

    params: Sampler keywords (the table's keys, synapse_nb.options; logit_bias (id, bias) pairs),
    the ones missing taking llama.cpp's defaults. As llama.cpp's argument parser does, temp < 0
    becomes 0 (the same chain: a temperature <= 0 keeps the argmax). With ignore_eos, every token
    of eog_ids is biased to -inf after params' own biases (eog_logit_bias; llama-completion gives
    none when the vocabulary has no EOS token, llama-server all of them). names: key -> the name
    an error gives the parameter (a flag, an HTTP field); SynapseError for a bad value.
    """
    params = dict(params)
    temp = params.get("temp")
    if isinstance(temp, (int, float)) and not isinstance(temp, bool) and temp < 0:
        params["temp"] = 0.0
    if ignore_eos and eog_ids:
        own = params.get("logit_bias") or ()
        if not isinstance(own, (list, tuple)):
            name = (names or {}).get("logit_bias", '"logit_bias"')
            raise SynapseError(f"{name} must be a list of [token id, bias] pairs")
        params["logit_bias"] = list(own) + eog_logit_bias(eog_ids)
    try:
        return Sampler(**params, n_vocab=n_vocab, grammar=grammar)
    except SynapseError as e:
        msg = str(e)
        for key, name in (names or {}).items():
            if msg.startswith(f"sampling: {key} "):
                raise SynapseError(name + msg[len(f"sampling: {key}"):]) from None
        raise
    except (TypeError, ValueError) as e:  # an unknown keyword (a batch line's own dict)
        raise SynapseError(f"sampling options: {e}") from None


def warmup(sampler: Sampler | None = None) -> None:
    """Compile (or load from Numba's cache) the kernels ``sampler``'s chain uses (all of them
    without a sampler), by sampling a 1,200-logit row with the same parameters."""
    row = np.tile(np.linspace(-3, 3, 300, dtype=np.float32), 4)
    if sampler is not None:
        configs = [sampler._params]
    else:
        configs = [{"top_k": 40}, {"top_k": 200, "typical_p": 0.9, "top_n_sigma": 2.0, "dynatemp_range": 0.3},
                   {"top_k": 0, "top_p": 0.9, "min_p": 0.0, "temp": 0.0, "xtc_probability": 1.0}]
    for params in configs:
        s = Sampler(**{**params, "seed": 0})
        s.accept_many([0, 1])
        s.sample(row)
