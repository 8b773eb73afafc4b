"""The warm-up's forwards: a tiny Session to run them on, and the attention kernels' own step.

Shared by the warm-up (synapse_nb.compilation.warmup) and its helper process
(synapse_nb.compilation.helper), which run the same forwards into the same Numba cache.
"""

from __future__ import annotations

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


def compile_attention(model: Model, s: Session, kinds) -> None:
    """Run the attention kernels of kinds ((decode, parallel) pairs) on s's first layer."""
    hp = model.hparams
    _attn.compile_kernels(s.cache.k[0], s.cache.v[0], hp.n_head, hp.n_head_kv, hp.head_dim_k, hp.head_dim_v,
                          model._kq_scale, s.state.attn_ws, kinds)


def compile_segments(model: Model, s: Session) -> None:
    """Compile (or load) the attention kernel of several sequences' decode rows (a ParallelSession
    step: attention.segments_kernel), as graph.layers calls it; nothing runs."""
    model._graph_tables().rows(s.state.attn_ws, 2, 0, False, model.hparams, SERIAL_ROWS, decode_rows=True)
