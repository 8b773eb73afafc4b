"""Session: one sequence's batched prefill and decode, and the checks of a session's arguments.

A Session evaluates tokens through Model.forward in batches of n_batch (options.DEFAULT_N_BATCH,
512: llama.cpp's n_ubatch), appending each token's K/V to its cache. Every
kernel computes a row exactly as for a single token, so a batched prefill gives the same
logits and cache bits as token-by-token decoding (synapse_nb.checks.prefill_check proves it on
a prompt). Its state (KVCache, ForwardState) is synapse_nb.state's; the kernels' warm-up is
synapse_nb.compilation.
"""

from __future__ import annotations

import os
import time

import numba
import numpy as np

from .decode_threads import DecodeThreads
from .errors import SynapseError
from .hparams import HParams
from .model import Model
from .options import DEFAULT_N_BATCH
from .state import ForwardState, KVCache, WindowRelease

__all__ = ["Session", "KVCache", "ForwardState", "DEFAULT_N_BATCH", "DEFAULT_N_CTX_MAX", "default_n_ctx",
           "resolve_n_ctx", "usable_threads", "check_token_ids", "check_n_ctx", "check_session_args"]

DEFAULT_N_CTX_MAX = 4096  # default n_ctx = min(n_ctx_train, 4096)


# How long an idle OpenMP worker spins before it sleeps. libgomp's default (300,000 spins) makes a
# decode step wait for a descheduled spinner whenever another process holds a core: measured on
# SmolLM2 with 2 threads and one busy process beside it, 0.3 tok/s by default, 25 tok/s at 1000,
# 42 tok/s never spinning (OMP_WAIT_POLICY=passive, but that costs 85 -> 31 tok/s on an idle
# machine, where 1000 costs nothing measurable). Read by libgomp when Numba first launches
# threads, so it is set before the first kernel runs; the user's own setting wins.
_GOMP_SPINCOUNT = "1000"


def _configure_threads() -> None:
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ.setdefault("GOMP_SPINCOUNT", _GOMP_SPINCOUNT)


def default_n_ctx(hp: HParams) -> int:
    """The context size when none is given: min(n_ctx_train, 4096) positions."""
    return min(hp.n_ctx_train, DEFAULT_N_CTX_MAX)


def resolve_n_ctx(hp: HParams, n_ctx):
    """n_ctx as given to a Session: None is default_n_ctx, 0 the model's n_ctx_train (llama.cpp's
    -c 0, "loaded from model"); any other value is returned as it is (Session checks it)."""
    if n_ctx is None:
        return default_n_ctx(hp)
    if isinstance(n_ctx, (int, np.integer)) and not isinstance(n_ctx, bool) and n_ctx == 0:
        return hp.n_ctx_train
    return n_ctx


def usable_threads(n_threads: int) -> int:
    """The threads a Session runs n_threads (>= 1) as: at most Numba's pool (NUMBA_NUM_THREADS)."""
    return min(int(n_threads), numba.config.NUMBA_NUM_THREADS)


def check_token_ids(ids, n_vocab: int, what: str = "tokens") -> None:
    """Raise SynapseError (naming `what`) unless every id is an integer in [0, n_vocab)."""
    for t in ids:
        if not isinstance(t, (int, np.integer)) or not 0 <= t < n_vocab:
            raise SynapseError(f"{what}: id {t!r} is outside the vocabulary [0, {n_vocab})")


def _physical_memory() -> int:
    """Bytes of RAM (sysconf); a large number when unknown, so that nothing is refused for it."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1 << 62


def check_n_ctx(hp: HParams, n_ctx, what: str = "n_ctx", n_seq: int = 1) -> int:
    """n_ctx (after resolve_n_ctx) as an int, after checking that it is a positive integer whose
    KV cache (n_seq of them: a ParallelSession's slots) fits in this machine's memory; raises
    SynapseError naming `what` otherwise. Cheap: the CLI calls it before any input sized by n_ctx
    (a prompt read, a .kld workload) is read."""
    if isinstance(n_ctx, bool) or not isinstance(n_ctx, (int, np.integer)) or n_ctx < 1:
        raise SynapseError(f"{what} must be a positive integer, got {n_ctx!r}")
    kv_bytes = n_seq * KVCache.nbytes(hp, int(n_ctx))
    if kv_bytes > _physical_memory():
        caches = f" x {n_seq} sequences" if n_seq > 1 else ""
        raise SynapseError(f"{what} {n_ctx}{caches}: the KV cache would need {kv_bytes / 2**30:.1f} GiB, more than "
                           f"this machine's memory; use a smaller context (-c/--ctx-size)")
    return int(n_ctx)


def _positive_int(v, name: str, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
        raise SynapseError(f"{what}{name} must be a positive integer, got {v!r}")
    return int(v)


def check_session_args(hp: HParams, n_ctx, n_threads, n_batch, n_seq: int = 1, what: str = "") -> tuple:
    """(n_ctx, n_batch, n_threads) of a Session or a ParallelSession of n_seq sequences, checked:
    n_ctx after resolve_n_ctx, n_batch and n_seq positive integers, n_threads None or a positive
    integer (then usable_threads' count), and the n_seq x n_ctx positions' KV cache within this
    machine's memory (check_n_ctx). Raises SynapseError (its message starting with `what`)
    otherwise; sets the OpenMP spin count the first kernel launch reads (_configure_threads)."""
    n_seq = _positive_int(n_seq, "n_seq", what)
    n_ctx = _positive_int(resolve_n_ctx(hp, n_ctx), "n_ctx", what)
    check_n_ctx(hp, n_ctx, n_seq=n_seq)
    n_batch = _positive_int(n_batch, "n_batch", what)
    if n_threads is not None:
        n_threads = usable_threads(_positive_int(n_threads, "n_threads", what))
    _configure_threads()
    return n_ctx, n_batch, n_threads


class Session:
    """One sequence being decoded: KV cache of n_ctx positions, n_past of them filled.

    Build with Session(model, n_ctx=None, n_threads=None, n_batch=512).
    n_ctx: cache positions (default min(n_ctx_train, 4096); 0: n_ctx_train); n_threads: Numba threads used by
    eval (default: Numba's current setting; results do not depend on it; with n_threads > 1 a
    one-token eval may take 1 while that is faster, see decode_threads); n_batch: tokens per
    forward; swa_full (llama.cpp's --swa-full): the sliding-window layers keep every position
    (default: they give back what their window no longer reads, see state.WindowRelease; the bits
    are the same). Raises SynapseError for values out of range.
    """

    def __init__(self, model: Model, n_ctx: int | None = None, n_threads: int | None = None,
                 n_batch: int = DEFAULT_N_BATCH, swa_full: bool = False):
        hp = model.hparams
        n_ctx, n_batch, n_threads = check_session_args(hp, n_ctx, n_threads, n_batch, what=f"{model.path}: ")
        kv_bytes = KVCache.nbytes(hp, n_ctx)
        self.model = model
        self.n_ctx = int(n_ctx)
        self.n_batch = int(min(n_batch, n_ctx))
        self.n_threads = n_threads
        self._decode_threads = None  # made by the first decode step, see eval
        try:
            self.cache = KVCache(hp, self.n_ctx)
        except (MemoryError, OSError) as e:  # the cache's anonymous mappings could not be made
            raise SynapseError(f"n_ctx {n_ctx}: cannot allocate the KV cache ({kv_bytes / 2**30:.1f} GiB): {e}; "
                               f"use a smaller context (-c/--ctx-size)") from None
        self.state = ForwardState(hp, self.n_batch, self.n_ctx)
        self._window = WindowRelease(hp, 1, swa_full)
        # the cached positions' tokens, to evaluate again what a window gave back (kept only when one can)
        self._tokens: list[int] = []
        self._n_past = 0

    def check_prompt(self, n_tokens: int) -> None:
        """Raise SynapseError unless a prompt of n_tokens fits in the context after the n_past
        cached positions (generation then stops when the context is full)."""
        if self._n_past + n_tokens > self.n_ctx:
            cached = f"{self._n_past} cached + " if self._n_past else ""
            raise SynapseError(f"the prompt ({cached}{n_tokens} tokens) exceeds the context size n_ctx = "
                               f"{self.n_ctx}; raise -c/--ctx-size or shorten the prompt")
        # Why the last greedy_tokens run ended: "eog", "length" (n_predict reached), "context" (full).
        self.stop_reason: str | None = None

    @property
    def n_past(self) -> int:
        """Number of positions in the KV cache (tokens evaluated since creation or reset)."""
        return self._n_past

    def reset(self) -> None:
        """Empty the KV cache (n_past = 0). Stale entries are never read: attention stops at p."""
        self._n_past = 0
        self._tokens.clear()
        self._window.reset(0)

    def truncate(self, n_past: int) -> None:
        """Keep the first n_past cached positions and drop the rest (llama_memory_seq_rm(mem, 0,
        n_past, -1)), so the next eval continues at position n_past. When the sliding-window layers
        have given back positions a query at n_past reads, the first n_past tokens are evaluated
        again (the same bits: a sequence's K/V do not depend on the split). Raises SynapseError
        unless 0 <= n_past <= self.n_past."""
        if not isinstance(n_past, (int, np.integer)) or not 0 <= n_past <= self._n_past:
            raise SynapseError(f"truncate: n_past must be in [0, {self._n_past}], got {n_past!r}")
        n_past = int(n_past)
        if self._window.can_keep(0, n_past):
            self._n_past = n_past
            del self._tokens[n_past:]
            return
        kept = self._tokens[:n_past]
        self.reset()
        if kept:
            self.eval(kept)

    def eval(self, tokens, all_logits: bool = False, progress=None) -> np.ndarray:
        """Append tokens to the cache (in batches of n_batch) and return their logits.

        tokens: sequence of ints in [0, n_vocab), at least one; n_past + len(tokens) <= n_ctx.
        progress(done, total), if given, is called after each batch with the tokens evaluated so far.
        Returns float32 [n_vocab] for the last token, or [len(tokens), n_vocab] with all_logits.
        Raises SynapseError (and leaves the cache unchanged) on bad ids or context overflow.
        """
        hp = self.model.hparams
        ids = np.asarray(tokens)
        if ids.ndim != 1 or ids.size == 0:
            raise SynapseError("eval: tokens must be a non-empty 1-D sequence of token ids")
        if not np.issubdtype(ids.dtype, np.integer):
            raise SynapseError("eval: token ids must be integers")
        ids = ids.astype(np.int64)
        bad = (ids < 0) | (ids >= hp.n_vocab)
        if bad.any():
            raise SynapseError(f"eval: token id {int(ids[bad][0])} is outside the vocabulary [0, {hp.n_vocab})")
        n = int(ids.size)
        if self._n_past + n > self.n_ctx:
            raise SynapseError(f"context full: {self._n_past} cached + {n} new tokens exceed n_ctx = {self.n_ctx}")
        step = None
        if n == 1 and self.n_threads is not None and self.n_threads > 1:
            # a decode step: on fewer threads while that is faster (a busy machine), see decode_threads
            step = self._decode_threads
            if step is None or step.n != self.n_threads:
                step = self._decode_threads = DecodeThreads(self.n_threads)
        if step is not None:
            threads = step.threads()
            numba.set_num_threads(threads)
            t0 = time.perf_counter()
        elif self.n_threads is not None:
            numba.set_num_threads(self.n_threads)
        out = np.empty((n, hp.n_vocab), np.float32) if all_logits else None
        last = None
        for b0 in range(0, n, self.n_batch):
            batch = ids[b0:b0 + self.n_batch]
            want = all_logits or b0 + len(batch) == n
            logits = self.model.forward(self.state, self.cache, batch, self._n_past, all_logits=all_logits,
                                        want_logits=want)
            self._n_past += len(batch)
            if self._window.layers:
                self._tokens.extend(batch.tolist())
            self._window.after_write(self.cache.k, self.cache.v, 0, self._n_past)
            if all_logits:
                out[b0:b0 + len(batch)] = logits
            elif want:
                last = logits[-1].copy()
            if progress is not None:
                progress(b0 + len(batch), n)
        if step is not None:
            step.record(threads, time.perf_counter() - t0)
        return out if all_logits else last

    def generate(self, prompt_tokens, n_predict: int, ignore_eos: bool = False, on_token=None,
                 sampler=None, grammar=None) -> list[int]:
        """Greedy continuation: eval the prompt, then argmax (lowest id on ties) token by token.

        Stops after n_predict tokens (-1: no limit), at an end-of-generation token of the
        vocabulary (which is returned as the last token, not passed to on_token) unless
        ignore_eos, or when the context is full (see greedy_tokens); why is in self.stop_reason.
        on_token(id) is called for each other token as it is chosen. Raises SynapseError when
        n_predict < -1 or when n_past + the prompt exceed n_ctx (checked before anything is
        evaluated).

        sampler: a synapse_nb.Sampler to draw the tokens instead of argmax; the prompt tokens are
        passed to its accept() first, as llama-completion does. (ignore_eos does not bias the
        sampler: build it with logit_bias=synapse_nb.sampling.eog_logit_bias(...) for that.)

        grammar: a synapse_nb.grammar.GrammarMatcher constraining greedy decoding (the highest
        logit among the tokens it allows); with a sampler, give it to the Sampler instead.
        """
        prompt = list(prompt_tokens)
        if n_predict < -1:
            raise SynapseError(f"n_predict must be >= 0, or -1 for no limit, got {n_predict}")
        need = self._n_past + len(prompt)
        if need > self.n_ctx:
            raise SynapseError(f"context full: {self._n_past} cached + {len(prompt)} prompt tokens = {need} "
                               f"exceed n_ctx = {self.n_ctx}")
        eog = self._eog_ids(ignore_eos)
        out: list[int] = []
        if sampler is not None:
            sampler.accept_many(prompt)
        if n_predict == 0:
            if prompt:
                self.eval(prompt)
            self.stop_reason = "length"
            return out
        for tok in self.greedy_tokens(self.eval(prompt), n_predict, ignore_eos, sampler=sampler, grammar=grammar):
            out.append(tok)
            if on_token is not None and tok not in eog:
                on_token(tok)
        return out

    def eog_ids(self, ignore_eos: bool = False) -> set:
        """The token ids that end a generation: the vocabulary's end-of-generation tokens, or none
        with ignore_eos."""
        return self._eog_ids(ignore_eos)

    def _eog_ids(self, ignore_eos: bool) -> set:
        return set() if ignore_eos else set(self.model.tokenizer.eog_ids)

    def greedy_tokens(self, logits, n_predict: int, ignore_eos: bool = False, on_logits=None, sampler=None,
                      grammar=None):
        """Yield tokens continuing from ``logits`` (float32 [n_vocab], the last evaluated
        position): argmax, the lowest id on ties; or, with a synapse_nb.Sampler,
        sampler.sample(logits) (which accepts the token; the caller accepts the prompt first).

        Each token is yielded before it is evaluated, so a caller can stream it; it is then
        appended to the cache and its logits (float32 [n_vocab]) passed to on_logits(row), if
        given. Stops after n_predict tokens (-1: no limit), after an end-of-generation token
        unless ignore_eos, or when the context is full: as llama-completion without context
        shift, cached + generated tokens never exceed n_ctx (n_ctx - n_past tokens at most). The
        last token is yielded and not evaluated. On return self.stop_reason is "eog", "length"
        or "context" (the first that applies, in this order).

        grammar (greedy only; a sampler has its own): a synapse_nb.grammar.GrammarMatcher; the
        argmax is checked against it and, if rejected, the argmax among the allowed tokens
        taken instead (the highest allowed logit, lowest id on ties); it accepts each token.
        """
        if grammar is not None and sampler is not None:
            raise SynapseError("give the grammar to the Sampler (Sampler(..., grammar=...)), not to greedy_tokens")
        eog = self._eog_ids(ignore_eos)
        self.stop_reason = None
        if n_predict == 0:
            self.stop_reason = "length"
            return
        i = 0
        while self._n_past < self.n_ctx:
            # argmax: the first maximum, lowest id on ties
            tok = int(np.argmax(logits)) if sampler is None else sampler.sample(logits)
            if grammar is not None:
                if not grammar.allows(tok):
                    tok = int(np.argmax(np.where(grammar.allowed_mask(), logits, np.float32(-np.inf))))
                grammar.accept(tok)
            i += 1
            yield tok
            if tok in eog:
                self.stop_reason = "eog"
                return
            if i == n_predict:
                self.stop_reason = "length"
                return
            if self._n_past + 1 >= self.n_ctx:
                break  # this token took the last position: llama-completion's "context full"
            logits = self.eval([tok])
            if on_logits is not None:
                on_logits(logits)
        self.stop_reason = "context"
