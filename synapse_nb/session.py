"""Session: a KV cache, batched prefill, greedy decode, and the prefill check.

A Session evaluates tokens through Model.forward in batches of n_batch (64, as llama.cpp's
n_batch = n_ubatch of the reference runs), appending each token's K/V to its cache. Every
kernel computes a row exactly as for a single token, so a batched prefill gives the same
logits and cache bits as token-by-token decoding (prefill_check proves it on a prompt).
"""

from __future__ import annotations

import mmap
import os
import time
from dataclasses import dataclass

import numba
import numpy as np

from .decode_threads import DecodeThreads
from .errors import SynapseError
from .hparams import HParams
from .kernels import attention as _attn
from .model import Model

DEFAULT_N_CTX_MAX = 4096  # default n_ctx = min(n_ctx_train, 4096)
DEFAULT_N_BATCH = 64  # llama.cpp's n_batch = n_ubatch of the reference runs


def _lazy_zeros(shape, dtype) -> np.ndarray:
    """A zeroed array backed by an anonymous mapping, committed 4 KiB page by page as it is written.

    numpy's allocator asks for transparent huge pages, so the first write to each channel row of a
    transposed cache would commit 2 MiB: 235 MB for SmolLM2 at n_ctx 4096 after a 5-token prompt.
    """
    count = int(np.prod(shape))
    buf = mmap.mmap(-1, max(count * np.dtype(dtype).itemsize, 1))
    return np.frombuffer(buf, dtype=dtype, count=count).reshape(shape)


class KVCache:
    """The F16 KV cache of a session, in llama.cpp's bytes: every entry rounded to F16 as
    llama.cpp's cache stores it, kept as F16 bits.

    k: uint16 [n_layer, n_head_kv, ceil(n_ctx / 64), head_dim_k, 64]: per KV head, K in tiles of 64
    positions (position p, dim i of head g at k[il, g, p // 64, i, p % 64]);
    v: uint16 [n_layer, n_head_kv, 64, ceil(n_ctx / 64), head_dim_v]: per KV head, the positions
    p = 64 m + l in order of (l, m) (channel c at v[il, g, p % 64, p // 64, c]): the layouts the
    attention kernels read as sequential streams (synapse_nb.kernels.attention). n_layer x n_ctx x
    (n_embd_k + n_embd_v) x 2 bytes (n_ctx rounded up to 64), zero-initialised like llama.cpp's
    buffer clear, committed page by page as positions are written (_lazy_zeros).
    """

    def __init__(self, hp: HParams, n_ctx: int):
        self.n_ctx = n_ctx
        ks, vs = _attn.kv_shapes(n_ctx, hp.n_head_kv, hp.head_dim_k, hp.head_dim_v)
        self.k = _lazy_zeros((hp.n_layer, *ks), np.uint16)
        self.v = _lazy_zeros((hp.n_layer, *vs), np.uint16)

    @staticmethod
    def nbytes(hp: HParams, n_ctx: int) -> int:
        """Bytes of the cache at n_ctx positions: n_layer x n_ctx x (n_embd_k + n_embd_v) x 2 (F16)."""
        return hp.n_layer * n_ctx * hp.n_head_kv * (hp.head_dim_k + hp.head_dim_v) * 2

    def k_rows(self, il: int, n: int) -> np.ndarray:
        """K of layer il at positions 0..n-1 as F16 bits, uint16 [n, n_embd_k] (a copy)."""
        kt = self.k[il]  # [g, tile, i, j] -> [tile, j, g, i]
        return np.ascontiguousarray(kt.transpose(1, 3, 0, 2).reshape(kt.shape[1] * kt.shape[3], -1)[:n])

    def v_rows(self, il: int, n: int) -> np.ndarray:
        """V of layer il at positions 0..n-1 as F16 bits, uint16 [n, n_embd_v] (a copy)."""
        vt = self.v[il]  # [g, l, m, c] -> [m, l, g, c]
        return np.ascontiguousarray(vt.transpose(2, 1, 0, 3).reshape(vt.shape[1] * vt.shape[2], -1)[:n])

    def v_entry(self, il: int, p: int, c: int) -> tuple:
        """Index into v of layer il, position p, channel c of n_embd_v (e.g. for a test's write)."""
        hd = self.v.shape[4]
        return (il, c // hd, p % 64, p // 64, c % hd)


class ForwardState:
    """Activation buffers for batches of up to n_batch tokens, allocated once per session."""

    def __init__(self, hp: HParams, n_batch: int, n_ctx: int):
        n, E, F = n_batch, hp.n_embd, hp.n_ff
        self.n_batch = n_batch
        self.x = np.empty((n, E), np.float32)  # residual stream
        self.h = np.empty((n, E), np.float32)  # normed input of a sub-block
        self.q = np.empty((n, hp.n_head * hp.head_dim_k), np.float32)
        self.k = np.empty((n, hp.n_head_kv * hp.head_dim_k), np.float32)
        self.v = np.empty((n, hp.n_head_kv * hp.head_dim_v), np.float32)
        self.attn = np.empty((n, hp.n_head * hp.head_dim_v), np.float32)  # attention output (kqv)
        self.o = np.empty((n, E), np.float32)  # output of a sub-block (wo or ffn_down)
        self.gate = np.empty((n, F), np.float32)
        self.up = np.empty((n, F), np.float32)
        self.act = np.empty((n, F), np.float32)  # silu(gate) * up
        self.rope = np.empty((n, hp.n_rot), np.float32)  # cos/sin per position
        # the SWA layers' cos/sin (gemma3: their own RoPE base); no rows without a window
        self.rope_swa = np.empty((n if hp.n_swa > 0 else 0, hp.n_rot), np.float32)
        self.temp = np.empty((n, 1), np.float32)  # mistral3 attention temperature per position
        # scratch of the attention kernels for n_ctx positions
        self.attn_ws = _attn.Workspace(n_ctx, hp.n_head, hp.n_head_kv, hp.head_dim_k, hp.head_dim_v)
        self.abuf = None  # uint8 [7, n_batch * act_row_bytes]: converted activations (Model.forward)

    def activations(self, n: int) -> tuple:
        """The first n rows of x, h, q, k, v, attn, o, gate, up, act (graph.layers' order)."""
        return tuple(a[:n] for a in (self.x, self.h, self.q, self.k, self.v, self.attn, self.o, self.gate, self.up,
                                     self.act))


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


def check_n_ctx(hp: HParams, n_ctx, what: str = "n_ctx") -> int:
    """n_ctx (after resolve_n_ctx) as an int, after checking that it is a positive integer whose
    KV cache fits in this machine's memory; raises SynapseError naming `what` otherwise. Cheap: the
    CLI calls it before any input sized by n_ctx (a prompt read, a .kld workload) is read."""
    if isinstance(n_ctx, bool) or not isinstance(n_ctx, (int, np.integer)) or n_ctx < 1:
        raise SynapseError(f"{what} must be a positive integer, got {n_ctx!r}")
    kv_bytes = KVCache.nbytes(hp, int(n_ctx))
    if kv_bytes > _physical_memory():
        raise SynapseError(f"{what} {n_ctx}: the KV cache would need {kv_bytes / 2**30:.1f} GiB, more than this "
                           f"machine's memory; use a smaller context (-c/--ctx-size)")
    return int(n_ctx)


class Session:
    """One sequence being decoded: KV cache of n_ctx positions, n_past of them filled.

    Build with Session(model, n_ctx=None, n_threads=None, n_batch=64).
    n_ctx: cache positions (default min(n_ctx_train, 4096); 0: n_ctx_train); n_threads: Numba threads used by
    eval (default: Numba's current setting; results do not depend on it; with n_threads > 1 a
    one-token eval may take 1 while that is faster, see decode_threads); n_batch: tokens per
    forward. Raises SynapseError for values out of range.
    """

    def __init__(self, model: Model, n_ctx: int | None = None, n_threads: int | None = None,
                 n_batch: int = DEFAULT_N_BATCH):
        hp = model.hparams
        n_ctx = resolve_n_ctx(hp, n_ctx)
        if not isinstance(n_ctx, (int, np.integer)) or n_ctx < 1:
            raise SynapseError(f"{model.path}: n_ctx must be a positive integer, got {n_ctx!r}")
        check_n_ctx(hp, n_ctx)
        kv_bytes = KVCache.nbytes(hp, int(n_ctx))
        if not isinstance(n_batch, (int, np.integer)) or n_batch < 1:
            raise SynapseError(f"{model.path}: n_batch must be a positive integer, got {n_batch!r}")
        if n_threads is not None:
            if not isinstance(n_threads, (int, np.integer)) or n_threads < 1:
                raise SynapseError(f"{model.path}: n_threads must be a positive integer, got {n_threads!r}")
            n_threads = usable_threads(n_threads)
        _configure_threads()
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

    def truncate(self, n_past: int) -> None:
        """Keep the first n_past cached positions and drop the rest (llama_memory_seq_rm(mem, 0,
        n_past, -1)), so the next eval continues at position n_past. Raises SynapseError unless
        0 <= n_past <= self.n_past."""
        if not isinstance(n_past, (int, np.integer)) or not 0 <= n_past <= self._n_past:
            raise SynapseError(f"truncate: n_past must be in [0, {self._n_past}], got {n_past!r}")
        self._n_past = int(n_past)

    def eval(self, tokens, all_logits: bool = False) -> np.ndarray:
        """Append tokens to the cache (in batches of n_batch) and return their logits.

        tokens: sequence of ints in [0, n_vocab), at least one; n_past + len(tokens) <= n_ctx.
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
            if all_logits:
                out[b0:b0 + len(batch)] = logits
            elif want:
                last = logits[-1].copy()
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


def _run_needs(hp: HParams, n_prompt: int, n_predict: int, n_batch: int, n_ctx: int) -> tuple[bool, bool, frozenset]:
    """(batched, single, attention kinds): which warm-up steps a run calls the kernels of.

    The run evaluates a prompt of n_prompt tokens in batches of n_batch (a batch of 1 token runs
    the single-token kernels), then up to n_predict - 1 single tokens (-1: until the context is
    full; the last token is not evaluated, see Session.greedy_tokens) within n_ctx positions.
    Attention kinds: the (decode, parallel) pairs of the attention kernels it calls
    (attention.kernel_for): decode for a one-row call, parallel past
    attention.uses_parallel's threshold. Every layer of a batch attends all its rows, but a batch
    whose logits are not needed stops before its last layer's attention, and the last batch's
    last layer attends its last row only (Model.forward); each decode step attends one row.
    """
    n_batch = min(n_batch, n_ctx)
    last = n_prompt - (n_prompt - 1) % n_batch - 1  # position of the last batch
    n_decode = max(0, n_ctx - n_prompt - 1)
    if n_predict >= 0:
        n_decode = min(n_decode, max(0, n_predict - 1))
    batched = min(n_prompt, n_batch) > 1
    single = n_prompt - last == 1 or n_decode > 0
    calls = [(1, n_prompt - 1)]  # (rows, pos0) of the attention calls
    if hp.n_layer > 1:
        calls += [(min(n_batch, n_prompt - b0), b0) for b0 in range(0, n_prompt, n_batch)]
    if n_decode:  # the threshold grows with the position: the first and last steps decide
        calls += [(1, n_prompt), (1, n_prompt + n_decode - 1)]
    kinds = frozenset((n == 1, _attn.uses_parallel(n, p, hp.n_head, hp.head_dim_k, hp.head_dim_v)) for n, p in calls)
    return batched, single, kinds


_ALL_KINDS = frozenset((d, p) for d in (False, True) for p in (False, True))


def _warmup_session(model: Model, override: dict) -> Session:
    """The warm-up's 3-position Session (forwards of 1 and 2 tokens), its attention taking the
    parallel-or-serial choice of override (decode: bool -> parallel: bool) per kind."""
    s = Session(model, n_ctx=3, n_threads=None, n_batch=2)
    s.state.attn_ws.parallel_override = dict(override)
    return s


def _compile_attention(model: Model, s: Session, kinds) -> None:
    """Run the attention kernels of kinds ((decode, parallel) pairs) on s's first layer."""
    hp = model.hparams
    _attn.compile_kernels(s.cache.k[0], s.cache.v[0], hp.n_head, hp.n_head_kv, hp.head_dim_k, hp.head_dim_v,
                          model._kq_scale, s.state.attn_ws, kinds)


def warmup(model: Model, progress=None, n_prompt: int | None = None, n_predict: int = -1,
           n_batch: int = DEFAULT_N_BATCH, n_ctx: int | None = None, jobs: int = 1) -> None:
    """Compile (or load from Numba's cache) the kernels the forward uses, with 1- and 2-token forwards.

    model: a loaded Model. progress: optional callable(done, total, name) called before each step.
    By default every kernel any run may call. Given n_prompt (a run that evaluates a prompt of
    n_prompt tokens in batches of n_batch, then decodes up to n_predict tokens, -1: until n_ctx
    is full, n_ctx defaulting as Session's), only the kernels of that run (_run_needs): a
    one-token prompt skips the batched (parallel) kernels, and attention compiles the one to
    four kernels (decode or prefill, serial or parallel) the run calls, which cost as much to
    load as to compile when unused. A kernel left out still compiles (or loads) on its first call.
    jobs: with 2 or more, when the warm-up compiles both forwards' kernels (a cold cache), a
    second process compiles the single-token forward's while this one compiles the batched one's
    (synapse_nb.compile_helper); the kernels and the cache are the same either way.
    """
    from . import compile_helper

    hp = model.hparams
    if n_prompt is None:
        batched = single = True
        kinds = _ALL_KINDS
    else:
        batched, single, kinds = _run_needs(hp, n_prompt, n_predict, n_batch,
                                            default_n_ctx(hp) if n_ctx is None else n_ctx)
    from .jit import release_library_pages

    release_library_pages()  # LLVM's pages touched by the imports and the model's load
    # the warm-up forwards' attention takes a kind the run uses (per decode / prefill), the
    # others run on their own in the last step
    override = dict(sorted(kinds))
    rest = kinds - set(override.items())
    s = _warmup_session(model, override)
    helper = None
    if jobs > 1 and batched and single and compile_helper.available():
        helper = compile_helper.Helper(model.path, override, rest)

    def run_batched():
        if helper is None:
            s.eval([0, 0])
            return
        # all logits: no one-row call (its kernels are the helper's); the run's last batch
        # makes those on its last layer, which the single-token forward also makes
        with compile_helper.locked_cache_saves():
            with helper.on_first_compile():
                s.eval([0, 0], all_logits=True)
            helper.wait()

    steps = [
        ("batched forward (parallel kernels)", run_batched) if batched else None,
        ("single-token forward (serial kernels)", lambda: s.eval([0])) if single else None,
        ("attention kernels", lambda: _compile_attention(model, s, rest)) if rest else None,
    ]
    steps = [st for st in steps if st is not None]
    for i, (name, run) in enumerate(steps):
        if progress:
            progress(i, len(steps), name)
        run()
    release_library_pages()  # and by the kernels' loads: a forward runs none of that code
    if progress:
        progress(len(steps), len(steps), "done")


@dataclass(frozen=True)
class PrefillCheckResult:
    """Outcome of prefill_check. ok: logits and cache bit-identical; otherwise the first difference.

    n_tokens, n_batch: what was compared. logits_diff: (position, vocab index, batched value,
    token-by-token value) of the first differing logit, else None. cache_diff: ("K" or "V",
    layer, position, channel, batched value, token-by-token value) of the first differing cache
    entry (lowest layer, then position), else None.
    """

    ok: bool
    n_tokens: int
    n_batch: int
    logits_diff: tuple | None
    cache_diff: tuple | None

    def __str__(self) -> str:
        if self.ok:
            return (f"prefill check OK: {self.n_tokens} tokens in batches of {self.n_batch}: logits at every "
                    f"position and the K/V cache are bit-identical to token-by-token decoding")
        parts = []
        if self.logits_diff is not None:
            p, i, a, b = self.logits_diff
            parts.append(f"logits differ first at position {p} (vocab id {i}): batched {a!r} vs "
                         f"token-by-token {b!r}")
        if self.cache_diff is not None:
            kind, il, p, c, a, b = self.cache_diff
            parts.append(f"{kind} cache differs first at layer {il}, position {p}, channel {c}: batched {a!r} "
                         f"vs token-by-token {b!r}")
        return f"prefill check FAILED ({self.n_tokens} tokens, batches of {self.n_batch}): " + "; ".join(parts)


def _first_cache_diff(kind: str, a, b, n_layer: int, n: int):
    """First differing entry of two caches' K or V (a, b: KVCache.k_rows or v_rows of each), by
    layer then position then channel; the values are reported as floats (the F16 values)."""
    for il in range(n_layer):
        x, y = a(il, n), b(il, n)  # F16 bits [position, channel]
        diff = np.argwhere(x != y)
        if diff.size:
            p, c = (int(v) for v in diff[0])
            fa, fb = x[p:p + 1, c].view(np.float16)[0], y[p:p + 1, c].view(np.float16)[0]
            return (kind, il, p, c, float(fa), float(fb))
    return None


def first_row_diff(position: int, batched: np.ndarray, single: np.ndarray):
    """First bit difference of two logits rows (float32 [n_vocab]) at ``position``.

    Returns (position, vocab id, batched value, token-by-token value) of the lowest differing id
    (bit patterns compared: -0.0 differs from 0.0, NaNs compare by payload), or None when the
    rows are bit-identical.
    """
    neq = batched.view(np.uint32) != single.view(np.uint32)
    if not neq.any():
        return None
    i = int(np.argmax(neq))  # first True
    return (int(position), i, float(batched[i]), float(single[i]))


def prefill_check(model: Model, tokens, n_ctx: int | None = None, n_threads: int | None = None,
                  n_batch: int = DEFAULT_N_BATCH, progress=None) -> PrefillCheckResult:
    """Run tokens once by batched prefill and once token by token; compare bit for bit.

    Compares the logits at every position and the whole K/V cache (positions 0..n-1 of every
    layer). The two sessions advance together, one batch at a time: the batch's logits rows
    [n_batch, n_vocab] are compared with the token-by-token rows as those are produced, so memory
    does not grow with the prompt and the time is one batched prefill plus one token-by-token
    pass. progress(done, total) is called after each batch, if given. n_ctx defaults to
    max(len(tokens), the model's default). Returns a PrefillCheckResult (str() is the one-line
    report). Raises SynapseError on bad tokens.
    """
    ids = list(tokens)
    if n_ctx is None:
        n_ctx = max(len(ids), min(model.hparams.n_ctx_train, DEFAULT_N_CTX_MAX))
    batched = Session(model, n_ctx=n_ctx, n_threads=n_threads, n_batch=n_batch)
    single = Session(model, n_ctx=n_ctx, n_threads=n_threads, n_batch=1)
    n = len(ids)
    if n == 0:
        batched.eval(ids)  # raises the empty-prompt error
    logits_diff = None
    for b0 in range(0, n, batched.n_batch):
        chunk = ids[b0:b0 + batched.n_batch]
        lb = batched.eval(chunk, all_logits=True)
        for t, tok in enumerate(chunk):
            ls = single.eval([tok])
            if logits_diff is None:
                logits_diff = first_row_diff(b0 + t, lb[t], ls)
        if progress is not None:
            progress(b0 + len(chunk), n)
    n_layer = model.hparams.n_layer
    cache_diff = (_first_cache_diff("K", batched.cache.k_rows, single.cache.k_rows, n_layer, n)
                  or _first_cache_diff("V", batched.cache.v_rows, single.cache.v_rows, n_layer, n))
    return PrefillCheckResult(ok=logits_diff is None and cache_diff is None, n_tokens=n, n_batch=batched.n_batch,
                              logits_diff=logits_diff, cache_diff=cache_diff)
