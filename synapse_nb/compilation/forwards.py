"""The warm-up's forwards: a tiny Session to run them on, and the attention kernels' own step.

Shared by the warm-up (synapse_nb.compilation.warmup) and its helper process
(synapse_nb.compilation.helper), which run the same forwards into the same Numba cache.
"""

from __future__ import annotations

from functools import partial

import numpy as np

from ..kernels import attention as _attn
from ..kernels import graph as _graph
from ..kernels import ops as _ops
from ..kernels.native import native_fn
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
    step: attention.decode_segments), as graph.layers calls it; nothing runs."""
    model._graph_tables().rows(s.state.attn_ws, 2, 0, False, model.hparams, SERIAL_ROWS, decode_rows=True)


def warmup_steps(model: Model, s: Session, batched: bool, head: bool = False, rest=()) -> list:
    """The kernels of the warm-up's forwards on s as [(name, compile, runs)], each once, in the order
    the forwards first call them (the block loop aside): with batched, the 2-token forward's
    (batched_layers: its row kernels and attention, its matmul drivers and conversions, and the
    output head's on 2 rows when head), then the single-token forward's (one token at position
    0: its row kernels and attention, its matvec drivers and conversions, the output head's norm,
    conversion and matvec), then the embedding's row dequantization and the positions' RoPE
    tables, with head (a warm-up of every run) several sequences' attention (compile_segments),
    and the attention kernels of the kinds rest ((decode, parallel) pairs: compile_attention).
    The tables' kernels are read from a graph.Tables whose lookups compile nothing
    (table_kernels), the head's as Model._head calls them (the same overloads as the tables' of
    its format); each compile() compiles (or loads from the cache) its kernels, never the loop;
    those with runs True do so by a call on s's buffers. Both processes of a cold warm-up build
    the same list (the same model, the same parallel_override) and compile it from opposite ends
    (helper.Helper.share)."""
    st, hp = s.state, model.hparams
    zero = np.zeros(1, np.int64)
    x = st.activations(1)[0]
    out = model.weights.output

    def head_kernels(n):  # Model._head of n rows: rms_norm_rows, BoundWeight.quantize and .matmul_q
        mv = n == 1 or out.uses_matvec(n)
        return [(_ops.row_kernels(n).rms_norm, "rms_norm"), (out.drivers(n)[1], "convert"),
                *_graph.driver_kernels(out.drivers(1 if mv else n)[0], "matvec" if mv else "matmul")]

    wanted = []  # (dispatcher, kind) in the order the forwards look them up
    if batched:
        wanted += table_kernels(model, lambda t: (t.rows(st.attn_ws, 2, 0, False, hp), t.matmuls(True, False)))
        if head:
            wanted += head_kernels(2)
    wanted += table_kernels(model, lambda t: (t.rows(st.attn_ws, 1, 0, False, hp), t.matmuls(False, False)))
    wanted += head_kernels(1)
    if head:  # several sequences' attention, as compile_segments looks it up (its row kernels are above)
        wanted += table_kernels(model, lambda t: t.rows(st.attn_ws, 2, 0, False, hp, SERIAL_ROWS, decode_rows=True))
    steps = [(d.__name__, partial(native_fn, d, *_graph.SIGNATURES[k]), False) for d, k in dict.fromkeys(wanted)]
    steps += [("embedding", lambda: model.weights.tok_embd.get_rows(zero, x), True),
              ("positions", lambda: model._position_inputs(st, zero), True)]
    steps += [(f"attention {kind}", partial(compile_attention, model, s, {kind}), True) for kind in sorted(rest)]
    return steps


def table_kernels(model: Model, lookups) -> list:
    """[(dispatcher, kind)]: the kernels that lookups(tables) (calls of a graph.Tables' rows and
    matmuls) looks up on a Tables of model's own, in order, each once, none compiled or loaded
    (its lookup records them; its tables, filled with zeros, are dropped)."""
    wanted = []
    lookups(_graph.Tables(model.weights.layers, model.hparams,
                          lookup=lambda dispatcher, kind: wanted.append((dispatcher, kind)) or 0))
    return list(dict.fromkeys(wanted))
