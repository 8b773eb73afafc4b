"""The warm-up's forwards: a tiny Session to run them on, and the attention kernels' own step.

Shared by the warm-up (synapse_nb.compilation.warmup) and its helper process
(synapse_nb.compilation.helper), which run the same forwards into the same Numba cache.
"""

from __future__ import annotations

import numpy as np

from ..kernels import attention as _attn
from ..kernels.ops import SERIAL_ROWS
from ..model import Model
from ..session import Session


def warmup_session(model: Model, override: dict) -> Session:
    """The warm-up's 3-position Session (forwards of 1 and 2 tokens), its attention taking the
    parallel-or-serial choice of override (decode: bool -> parallel: bool) per kind."""
    s = Session(model, n_ctx=3, n_threads=None, n_batch=2)
    s.state.attn_ws.parallel_override = dict(override)
    return s


def batched_layers(model: Model, s: Session, head: bool) -> None:
    """Run s's 2-token batch at position 0 through every layer, each row to the last layer's end
    (no one-row kernel: those are the single-token forward's), and through the output head when
    head. A run that reads its last row's logits calls the one-row head only, so its warm-up
    leaves the head out (the head's batch matmul and conversion were 2.7 s of SmolLM2's first
    run); a warm-up for every run (a server's, perplexity's) keeps it. The Session's own position
    stays 0 (the cache's 2 positions are overwritten by its next forward)."""
    model.forward(s.state, s.cache, np.zeros(2, np.int64), 0, all_logits=True, head=head)


def compile_attention(model: Model, s: Session, kinds) -> None:
    """Run the attention kernels of kinds ((decode, parallel) pairs) on s's first layer."""
    hp = model.hparams
    _attn.compile_kernels(s.cache.k[0], s.cache.v[0], hp.n_head, hp.n_head_kv, hp.head_dim_k, hp.head_dim_v,
                          model._kq_scale, s.state.attn_ws, kinds)


def compile_segments(model: Model, s: Session) -> None:
    """Compile (or load) the attention kernel of several sequences' decode rows (a ParallelSession
    step: attention.segments_kernel), as graph.layers calls it; nothing runs."""
    model._graph_tables().rows(s.state.attn_ws, 2, 0, False, model.hparams, SERIAL_ROWS, decode_rows=True)
