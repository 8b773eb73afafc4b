"""The prefill check: a batched prefill against token-by-token decoding, bit for bit.

prefill_check runs a prompt both ways on two Sessions and reports the first logit or K/V cache
entry that differs (PrefillCheckResult); first_row_diff compares two logits rows by their bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .model import Model
from .session import DEFAULT_N_BATCH, Session, default_n_ctx


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
        n_ctx = max(len(ids), default_n_ctx(model.hparams))
    # full-size sliding-window caches: every position's K/V is compared
    batched = Session(model, n_ctx=n_ctx, n_threads=n_threads, n_batch=n_batch, swa_full=True)
    single = Session(model, n_ctx=n_ctx, n_threads=n_threads, n_batch=1, swa_full=True)
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
