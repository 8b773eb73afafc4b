"""ParallelSession: many sequences decoded in one forward per step (continuous batching).

Each step gathers one row per generating sequence (its last token) and prompt chunks of the
sequences still being prefilled, up to n_batch rows, and runs them as one batch
(Model.forward_segments): every weight block is read once for all the rows, and the attention
of each sequence runs over its own cache slot. The kernels give every row ggml's per-row
operation order whatever the batch, so a sequence's logits and KV cache are, bit for bit, those
of the same tokens run alone in a Session, whatever the other sequences are, how many, where
they are, how the steps are split, whether a prefix was reused, and the thread count
(tests/test_parallel.py checks it). llama-server's slots cannot promise this (llama.cpp issue
7052).

Sequences join (add) and leave (finish, cancel) at any step. Each has its own sampler and stop
conditions, chosen as Session.greedy_tokens chooses them: argmax (lowest id on ties) or
sampler.sample, stopping at an end-of-generation token, after n_predict tokens, or when its
context is full. A free slot keeps the tokens whose K/V it holds; a new sequence takes the free
slot sharing the longest prefix with its prompt and reuses those positions (a prefix cache, as
llama-server's cache_prompt): the reused K/V bits are the ones the prompt would write again.

Thread safety: add and cancel may be called from any thread; step is called by one thread (the
one running the engine's loop).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import numba
import numpy as np

from .decode_threads import DecodeThreads
from .errors import SynapseError
from .session import DEFAULT_N_BATCH, check_session_args
from .state import ForwardState, KVCache, WindowRelease, lazy_zeros, k_rows, v_rows
from .kernels import attention as _attn


@dataclass(eq=False)
class Sequence:
    """One sequence of a ParallelSession: its prompt, what was generated, why it stopped.

    tokens: the generated ids (the end-of-generation token included as the last one when it
    stopped the sequence, as Session.generate returns it); stop_reason: None while running, then
    "eog", "length", "context" (its n_ctx filled) or "cancelled"; n_reused: prompt positions
    whose K/V came from the prefix cache. From the stepping thread: on_token(seq, token, row) for
    each generated token (end-of-generation tokens included; see is_eog), row being the float32
    [n_vocab] logits it was chosen from (valid during the call only); on_done(seq) once, when it
    has stopped (stop_reason set).
    """

    prompt: list
    n_predict: int
    sampler: object = None
    grammar: object = None  # a GrammarMatcher for argmax decoding (a sampler holds its own)
    eog: frozenset = frozenset()
    on_token: object = None
    on_done: object = None
    keep_logits: bool = False
    tokens: list = field(default_factory=list)
    stop_reason: str | None = None
    n_reused: int = 0
    logits: list = field(default_factory=list)  # float32 [n_vocab] rows it chose from, with keep_logits
    slot: int = -1
    n_past: int = 0  # positions of its slot written for it (reused ones included)
    _pending: list = field(default_factory=list)  # tokens to evaluate, prompt first then each new token
    _cancel: bool = False

    @property
    def done(self) -> bool:
        return self.stop_reason is not None

    def is_eog(self, token: int) -> bool:
        return token in self.eog


class ParallelSession:
    """Up to n_seq sequences, each with its own KV cache slot of n_ctx positions, decoded together.

    Build with ParallelSession(model, n_seq=4, n_ctx=None, n_threads=None, n_batch=512).
    n_ctx: positions per sequence (default min(n_ctx_train, 4096); 0: n_ctx_train); n_batch: rows
    a step runs at most (raised to n_seq, so that every generating sequence moves each step);
    n_threads: Numba threads (results do not depend on it). KV memory is committed as positions
    are written; swa_full as Session's (without it a slot whose window gave back what a reused
    prefix needs evaluates its prompt again). Raises SynapseError for values out of range.
    """

    def __init__(self, model, n_seq: int = 4, n_ctx: int | None = None, n_threads: int | None = None,
                 n_batch: int = DEFAULT_N_BATCH, swa_full: bool = False):
        hp = model.hparams
        n_ctx, n_batch, n_threads = check_session_args(hp, n_ctx, n_threads, n_batch, n_seq=n_seq)
        self.model = model
        self.n_seq = int(n_seq)
        self.n_ctx = int(n_ctx)
        self.n_batch = int(max(n_batch, n_seq))
        self.n_threads = n_threads
        ks, vs = _attn.kv_shapes(self.n_ctx, hp.n_head_kv, hp.head_dim_k, hp.head_dim_v)
        try:
            self._k = lazy_zeros((self.n_seq, hp.n_layer, *ks), np.uint16)
            self._v = lazy_zeros((self.n_seq, hp.n_layer, *vs), np.uint16)
        except (MemoryError, OSError) as e:
            need = self.n_seq * KVCache.nbytes(hp, self.n_ctx)
            raise SynapseError(f"cannot allocate the KV cache of {self.n_seq} x {self.n_ctx} positions "
                               f"({need / 2**30:.1f} GiB): {e}") from None
        self.state = ForwardState(hp, self.n_batch, self.n_ctx)
        self._window = WindowRelease(hp, self.n_seq, swa_full)
        self._decode_threads = DecodeThreads(self.n_threads) if self.n_threads and self.n_threads > 1 else None
        self._slot_seq: list[Sequence | None] = [None] * self.n_seq
        self._slot_tokens: list[list] = [[] for _ in range(self.n_seq)]  # what each slot's cache holds
        self._waiting: list[Sequence] = []  # added, not yet given a slot
        self._lock = threading.RLock()  # re-entrant: on_token / on_done callbacks may cancel
        self._work = threading.Condition(self._lock)

    # ------------------------------------------------------------------ sequences
    def add(self, prompt, n_predict: int = -1, sampler=None, ignore_eos: bool = False, on_token=None,
            on_done=None, keep_logits: bool = False, grammar=None) -> Sequence:
        """Queue a sequence: prompt (token ids, at least one, at most n_ctx),
        then up to n_predict generated tokens (-1: until its context is full). sampler: a
        synapse_nb.Sampler (its accept_many(prompt) is called here, as Session.generate does),
        or None for argmax. grammar: a synapse_nb.grammar.GrammarMatcher constraining argmax
        (as Session.greedy_tokens; with a sampler, give it to the Sampler). The sequence starts
        at the next step with a free slot. Raises SynapseError for bad ids or a prompt longer
        than n_ctx."""
        hp = self.model.hparams
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise SynapseError("the prompt is empty: a sequence needs at least one token")
        for t in prompt:
            if not 0 <= t < hp.n_vocab:
                raise SynapseError(f"token id {t} is outside the vocabulary [0, {hp.n_vocab})")
        if len(prompt) > self.n_ctx:
            raise SynapseError(f"the prompt ({len(prompt)} tokens) exceeds the context size n_ctx = {self.n_ctx}")
        if not isinstance(n_predict, (int, np.integer)) or n_predict < -1:
            raise SynapseError(f"n_predict must be >= 0, or -1 for no limit, got {n_predict!r}")
        eog = frozenset() if ignore_eos else frozenset(self.model.tokenizer.eog_ids)
        if grammar is not None and sampler is not None:
            raise SynapseError("give the grammar to the Sampler (Sampler(..., grammar=...)), not to add")
        seq = Sequence(prompt=prompt, n_predict=int(n_predict), sampler=sampler, grammar=grammar, eog=eog,
                       on_token=on_token, on_done=on_done, keep_logits=keep_logits)
        if sampler is not None:
            sampler.accept_many(prompt)
        with self._work:
            self._waiting.append(seq)
            self._work.notify_all()
        return seq

    def cancel(self, seq: Sequence) -> None:
        """Stop seq at the next step (stop_reason "cancelled"); its slot is then free."""
        with self._work:
            seq._cancel = True
            self._work.notify_all()

    @property
    def active(self) -> int:
        """Sequences queued or running."""
        with self._lock:
            return len(self._waiting) + sum(s is not None for s in self._slot_seq)

    def slots(self) -> list[dict]:
        """Per slot: id, whether a sequence runs in it, its n_past and the cached positions."""
        with self._lock:
            return [{"id": i, "is_processing": s is not None, "n_past": s.n_past if s else 0,
                     "n_cached": len(self._slot_tokens[i])} for i, s in enumerate(self._slot_seq)]

    def wait_for_work(self, timeout: float | None = None) -> bool:
        """Block until a sequence is queued or running (or timeout seconds); True when there is work."""
        with self._work:
            if not self._has_work():
                self._work.wait(timeout)
            return self._has_work()

    def _has_work(self) -> bool:
        return bool(self._waiting) or any(s is not None for s in self._slot_seq)

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.stop_reason = reason
        if seq.slot >= 0 and self._slot_seq[seq.slot] is seq:
            # the slot's cache holds the positions written: kept for the prefix cache
            self._slot_seq[seq.slot] = None
        if seq.on_done is not None:
            seq.on_done(seq)

    def _admit(self) -> None:
        """Give waiting sequences free slots (called with the lock held): the free slot whose
        cached tokens share the longest prefix with the prompt, reusing those positions (all but
        the prompt's last token, whose logits the sequence needs)."""
        still = []
        for seq in self._waiting:
            if seq._cancel:
                self._finish(seq, "cancelled")
                continue
            free = [i for i, s in enumerate(self._slot_seq) if s is None]
            if not free:
                still.append(seq)
                continue
            best, best_n = free[0], -1
            for i in free:
                n = _common_prefix(self._slot_tokens[i], seq.prompt)
                if n > best_n:
                    best, best_n = i, n
            reuse = min(best_n, len(seq.prompt) - 1)
            if not self._window.can_keep(best, reuse):
                reuse = 0  # the window gave back what the prompt's next rows read: evaluate it all again
                self._window.reset(best)
            seq.slot, seq.n_past, seq.n_reused = best, reuse, reuse
            del self._slot_tokens[best][reuse:]
            seq._pending = seq.prompt[reuse:]
            self._slot_seq[best] = seq
        self._waiting = still

    # ------------------------------------------------------------------ the step
    def step(self, max_rows: int | None = None, chunk=None) -> int:
        """Run one forward over the running sequences; returns the rows evaluated (0: nothing to do).

        Each generating sequence contributes its one pending token; sequences in their prompt
        contribute chunks (in slot order) while rows remain, up to max_rows (default n_batch).
        chunk(seq, n_max) -> n may choose a smaller prompt chunk (tests split steps at random).
        Sequences whose last row was their prompt's last token, or a generated token, choose
        their next token from that row's logits; those that stop free their slot.
        """
        limit = self.n_batch if max_rows is None else max(1, min(int(max_rows), self.n_batch))
        with self._lock:
            for seq in self._slot_seq:
                if seq is not None and seq._cancel:
                    self._finish(seq, "cancelled")
            self._admit()
            running = [s for s in self._slot_seq if s is not None]
        # generating sequences first (one row each), then prompt chunks
        batch, rows = [], 0
        for seq in sorted(running, key=lambda s: len(s._pending) > 1):
            if rows >= limit:
                break
            n = min(len(seq._pending), limit - rows)
            if chunk is not None and n > 1:
                n = max(1, min(n, int(chunk(seq, n))))
            batch.append((seq, n))
            rows += n
        if not batch:
            return 0
        tokens = np.empty(rows, np.int64)
        segments, out_rows, outs = [], [], []
        r = 0
        for seq, n in batch:
            tokens[r:r + n] = seq._pending[:n]
            segments.append((seq.slot, seq.n_past, n))
            if n == len(seq._pending):  # its last pending token: the next token is chosen from it
                out_rows.append(r + n - 1)
                outs.append(seq)
            r += n
        step = None
        if rows == 1 and self.n_threads is not None and self.n_threads > 1:
            # one sequence's decode step: on fewer threads while that is faster, as Session does
            # (decode_threads; the bits do not depend on it)
            step = self._decode_threads
            threads = step.threads()
            numba.set_num_threads(threads)
            t0 = time.perf_counter()
        elif self.n_threads is not None:
            numba.set_num_threads(self.n_threads)
        logits = self.model.forward_segments(self.state, self._k, self._v, tokens, segments, out_rows)
        if step is not None:
            step.record(threads, time.perf_counter() - t0)
        for seq, n in batch:
            self._slot_tokens[seq.slot].extend(seq._pending[:n])
            del seq._pending[:n]
            seq.n_past += n
            self._window.after_write(self._k[seq.slot], self._v[seq.slot], seq.slot, seq.n_past)
        with self._lock:
            for seq, row in zip(outs, logits):
                self._choose(seq, row)
        return rows

    def _choose(self, seq: Sequence, row: np.ndarray) -> None:
        """Pick seq's next token from its logits row (Session.greedy_tokens' rule and stops)."""
        if seq._cancel:
            self._finish(seq, "cancelled")
            return
        if seq.n_predict == 0:
            self._finish(seq, "length")
            return
        if seq.n_past >= self.n_ctx:
            self._finish(seq, "context")  # the prompt filled the context: no token (as Session)
            return
        if seq.keep_logits:
            seq.logits.append(row.copy())
        tok = int(np.argmax(row)) if seq.sampler is None else seq.sampler.sample(row)
        if seq.grammar is not None:  # Session.greedy_tokens' rule: the argmax among the allowed tokens
            if not seq.grammar.allows(tok):
                tok = int(np.argmax(np.where(seq.grammar.allowed_mask(), row, np.float32(-np.inf))))
            seq.grammar.accept(tok)
        seq.tokens.append(tok)
        if seq.on_token is not None:
            seq.on_token(seq, tok, row)
        if tok in seq.eog:
            self._finish(seq, "eog")
        elif len(seq.tokens) == seq.n_predict:
            self._finish(seq, "length")
        elif seq.n_past + 1 >= self.n_ctx:
            self._finish(seq, "context")  # this token took the last position
        else:
            seq._pending.append(tok)

    def abort_all(self, reason: str = "error") -> None:
        """Stop every queued and running sequence with stop_reason `reason` (after a failed step)
        and forget what the slots cache."""
        with self._lock:
            for seq in [q for q in self._slot_seq if q is not None] + self._waiting:
                self._finish(seq, reason)
            self._waiting = []
            for t in self._slot_tokens:
                t.clear()

    def run(self, **step_args) -> None:
        """Step until every queued sequence has stopped."""
        while self.step(**step_args) or self.active:
            pass

    def kv_rows(self, seq_or_slot, il: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """K and V of layer il at positions 0..n-1 of a slot (or a sequence's slot), as F16 bits
        uint16 [n, n_embd_k], [n, n_embd_v] (copies; KVCache.k_rows' layout)."""
        slot = seq_or_slot.slot if isinstance(seq_or_slot, Sequence) else int(seq_or_slot)
        return k_rows(self._k[slot], il, n), v_rows(self._v[slot], il, n)

    def generate(self, prompts, n_predict: int = -1, samplers=None, ignore_eos: bool = False) -> list[Sequence]:
        """Decode several prompts together; returns their Sequences (tokens, stop_reason)."""
        samplers = samplers if samplers is not None else [None] * len(prompts)
        seqs = [self.add(p, n_predict, sampler=s, ignore_eos=ignore_eos) for p, s in zip(prompts, samplers)]
        self.run()
        return seqs


def _common_prefix(a: list, b: list) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
