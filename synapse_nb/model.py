"""The Llama-family graph (every architecture of synapse_nb.arch) as llama.cpp's CPU backend runs it.

Reproduces llama.cpp (vendored in llama-cpp-python 0.3.36): src/models/<arch>.cpp (the graph
builder of each architecture of synapse_nb.arch) and llama-graph.cpp (build_qkv, build_attn,
build_attn_mha, build_ffn), with flash attention off and an F16 KV cache. One forward over a
batch of tokens: the embedding, the transformer blocks (one compiled loop,
synapse_nb.kernels.graph.layers, a comment per step), the head; every buffer is allocated once
per session (ForwardState) and the KV cache once (KVCache). What differs between architectures
(biases, RoPE mode and scaling, the attention temperature, Q/K and post norms, SwiGLU or GEGLU,
the embedding and attention scales, the sliding window and its RoPE base) is the recipe read
into HParams (synapse_nb.arch, hparams.py), given to the loop as a record (graph.Block) and
per-layer vectors: no step tests an architecture's name.

Where each number is rounded:
  - weights stay in their GGUF blocks; matmul/get_rows (synapse_nb.kernels) convert activations
    to the weight's vec_dot_type (Q8_0/Q8_1/Q8_K/F16/BF16) as ggml does;
  - K and V are stored as F16; q is rounded to F16 before q.k; the softmax probabilities are
    rounded to F16 before they weight V (synapse_nb.kernels.attention);
  - everything else is float32 arithmetic in ggml's order (synapse_nb.kernels.ops).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from .gguf_spec import GGMLQuantizationType

from .errors import SynapseError
from .gguf_file import open_gguf
from .hparams import HParams
from .kernels import BoundWeight, bind
from .kernels import graph as _graph
from .kernels import ops as _ops

if TYPE_CHECKING:  # the state types, for annotations only
    from .state import ForwardState, KVCache



def _f32_vector(g, name: str, n: int) -> np.ndarray:
    """A 1-D tensor (norm weight, bias, rope_freqs) as float32 [n], read from F32 or F16 storage."""
    t = g.tensor(name)
    if t.shape != (n,):
        raise SynapseError(f"{g.path}: tensor {name} has shape {list(t.shape)}, expected [{n}]")
    if t.ggml_type == GGMLQuantizationType.F32:
        return np.frombuffer(t.data, dtype="<f4", count=n).astype(np.float32)
    if t.ggml_type == GGMLQuantizationType.F16:
        return np.frombuffer(t.data, dtype="<f2", count=n).astype(np.float32)
    raise SynapseError(f"{g.path}: tensor {name} is {t.ggml_type.name}; 1-D tensors must be F32 or F16")


@dataclass(frozen=True)
class LayerWeights:
    """One transformer block: GGUF weights (kept in their blocks, validated once: BoundWeight) and
    float32 vectors."""

    attn_norm: np.ndarray  # float32 [n_embd]
    wq: BoundWeight  # (n_head * head_dim_k, n_embd)
    wk: BoundWeight  # (n_head_kv * head_dim_k, n_embd)
    wv: BoundWeight  # (n_head_kv * head_dim_v, n_embd)
    wo: BoundWeight  # (n_embd, n_head * head_dim_v)
    bq: np.ndarray | None  # Q, K, V, output biases (float32 [rows]), when the model has them
    bk: np.ndarray | None
    bv: np.ndarray | None
    bo: np.ndarray | None
    ffn_norm: np.ndarray  # float32 [n_embd]
    w_gate: BoundWeight  # (n_ff, n_embd)
    w_up: BoundWeight  # (n_ff, n_embd)
    w_down: BoundWeight  # (n_embd, n_ff)
    q_norm: np.ndarray | None = None  # recipe qk_norm: float32 [head_dim_k], RMS norm of each q head
    k_norm: np.ndarray | None = None  # recipe qk_norm: float32 [head_dim_k], of each k head
    post_attn_norm: np.ndarray | None = None  # recipe post_norms: float32 [n_embd], on the attention output
    post_ffn_norm: np.ndarray | None = None  # recipe post_norms: float32 [n_embd], on the FFN output


@dataclass(frozen=True)
class Weights:
    """All weights of a model; `output` is token_embd when the model has no output.weight (tied)."""

    tok_embd: BoundWeight
    output_norm: np.ndarray
    output: BoundWeight
    rope_freqs: np.ndarray  # float32 [n_rot/2]: rope_freqs.weight, or ones
    layers: tuple[LayerWeights, ...]

    @classmethod
    def from_gguf(cls, g, hp: HParams) -> Weights:
        """Collect the tensors of an opened GGUF (shapes already checked by HParams.from_gguf) and
        bind each 2-D weight to its kernels (synapse_nb.kernels.bind: validated here, once)."""
        E = hp.n_embd
        q, kv, v = hp.n_head * hp.head_dim_k, hp.n_head_kv * hp.head_dim_k, hp.n_head_kv * hp.head_dim_v
        layers = []
        for i in range(hp.n_layer):
            b = f"blk.{i}."
            layers.append(LayerWeights(
                attn_norm=_f32_vector(g, b + "attn_norm.weight", E),
                wq=bind(g.tensor(b + "attn_q.weight")),
                wk=bind(g.tensor(b + "attn_k.weight")),
                wv=bind(g.tensor(b + "attn_v.weight")),
                wo=bind(g.tensor(b + "attn_output.weight")),
                bq=_f32_vector(g, b + "attn_q.bias", q) if hp.has_bias_qkv else None,
                bk=_f32_vector(g, b + "attn_k.bias", kv) if hp.has_bias_qkv else None,
                bv=_f32_vector(g, b + "attn_v.bias", v) if hp.has_bias_qkv else None,
                bo=_f32_vector(g, b + "attn_output.bias", E) if hp.has_bias_o else None,
                ffn_norm=_f32_vector(g, b + "ffn_norm.weight", E),
                w_gate=bind(g.tensor(b + "ffn_gate.weight")),
                w_up=bind(g.tensor(b + "ffn_up.weight")),
                w_down=bind(g.tensor(b + "ffn_down.weight")),
                q_norm=_f32_vector(g, b + "attn_q_norm.weight", hp.head_dim_k) if hp.has_qk_norm else None,
                k_norm=_f32_vector(g, b + "attn_k_norm.weight", hp.head_dim_k) if hp.has_qk_norm else None,
                post_attn_norm=_f32_vector(g, b + "post_attention_norm.weight", E) if hp.has_post_norms else None,
                post_ffn_norm=_f32_vector(g, b + "post_ffw_norm.weight", E) if hp.has_post_norms else None,
            ))
        tok_embd = bind(g.tensor("token_embd.weight"))
        return cls(
            tok_embd=tok_embd,
            output_norm=_f32_vector(g, "output_norm.weight", E),
            output=tok_embd if hp.tied_output else bind(g.tensor("output.weight")),
            rope_freqs=(_f32_vector(g, "rope_freqs.weight", hp.n_rot // 2) if hp.has_rope_freqs
                        else np.ones(hp.n_rot // 2, np.float32)),
            layers=tuple(layers),
        )


class Model:
    """A loaded GGUF model: hyper-parameters, weights (memory-mapped), tokenizer.

    Build with load_model(path). The forward is Model.forward, run on a session's state:
    synapse_nb.session.Session(model) holds the KV cache and buffers, prefill and decode.
    """

    def __init__(self, path, gguf, hparams: HParams, weights: Weights):
        self.path = Path(path)
        self.gguf = gguf
        self.hparams = hparams
        self.weights = weights
        self._tokenizer = None
        self._tables = None  # the compiled layer loop's kernel tables, on first forward
        hp = hparams
        f32 = np.float32
        # RoPE constants of ggml_compute_forward_rope_flt, fixed for the model.
        self._theta_scale = _ops.rope_theta_scale(f32(hp.rope_freq_base), hp.n_rot)
        lo, hi = _ops.rope_corr_dims(hp.n_rot, hp.yarn_orig_ctx, f32(hp.rope_freq_base),
                                     f32(hp.yarn_beta_fast), f32(hp.yarn_beta_slow))
        self._corr_dims = (f32(lo), f32(hi))
        # The SWA layers' RoPE (llama_model::get_rope_freq_base / _scale of an SWA layer)
        if hp.n_swa > 0:
            self._theta_scale_swa = _ops.rope_theta_scale(f32(hp.rope_freq_base_swa), hp.n_rot)
            lo, hi = _ops.rope_corr_dims(hp.n_rot, hp.yarn_orig_ctx, f32(hp.rope_freq_base_swa),
                                         f32(hp.yarn_beta_fast), f32(hp.yarn_beta_slow))
            self._corr_dims_swa = (f32(lo), f32(hi))
        if hp.attn_scale != 0.0:
            # q *= f_attention_scale before build_attn, whose kq_scale is 1.0f
            q_scale, self._kq_scale = f32(hp.attn_scale), f32(1.0)
        else:
            q_scale = f32(0.0)
            self._kq_scale = f32(1.0) / f32(math.sqrt(f32(hp.head_dim_k)))  # 1.0f/sqrtf(float(n_embd_head))
        # The block recipe as the compiled loop reads it (exact types: one loop for every model)
        self.block = _graph.Block(
            n_head=int(hp.n_head), n_head_kv=int(hp.n_head_kv), head_dim_k=int(hp.head_dim_k), n_rot=int(hp.n_rot),
            neox=hp.rope_type == "neox", eps=f32(hp.rms_eps), kq_scale=self._kq_scale, q_scale=q_scale,
            attn_temp=bool(hp.attn_temp_scale != 0.0), has_bias_qkv=bool(hp.has_bias_qkv),
            has_bias_o=bool(hp.has_bias_o), has_qk_norm=bool(hp.has_qk_norm), has_post_norms=bool(hp.has_post_norms),
            geglu=hp.ffn_act == "gelu")
        self._block_args = tuple(self.block)  # as graph.layers takes it

    @property
    def tokenizer(self):
        """The GGUF's tokenizer (synapse_nb.tokenizer), loaded on first use."""
        if self._tokenizer is None:
            from .tokenizer import load_tokenizer

            self._tokenizer = load_tokenizer(self.gguf)
        return self._tokenizer

    def _position_inputs(self, st: ForwardState, pos: np.ndarray) -> None:
        """Per-row inputs of the graph for rows at positions pos (int64 [n]): the RoPE cos/sin tables
        and the q temperature (when the recipe has one)."""
        hp = self.hparams
        f32 = np.float32
        n = len(pos)
        # ggml_rope_cache_init for each position (cos/sin pairs, YaRN ramp and magnitude)
        _ops.rope_cache(st.rope[:n], pos, hp.n_rot, self._theta_scale, f32(hp.rope_freq_scale),
                        self.weights.rope_freqs, f32(hp.yarn_ext_factor), f32(hp.yarn_attn_factor),
                        self._corr_dims[0], self._corr_dims[1])
        if hp.n_swa > 0:  # the SWA layers' table (their own base and scale)
            _ops.rope_cache(st.rope_swa[:n], pos, hp.n_rot, self._theta_scale_swa, f32(hp.rope_freq_scale_swa),
                            self.weights.rope_freqs, f32(hp.yarn_ext_factor), f32(hp.yarn_attn_factor),
                            self._corr_dims_swa[0], self._corr_dims_swa[1])
        if hp.attn_temp_scale != 0.0:
            # llm_graph_input_attn_temp::set_input: float position, float division by the floor
            # length, then log(floor(.) + 1.0) * scale + 1.0 in double, stored as float
            for t in range(n):
                r = f32(f32(pos[t]) + f32(hp.attn_temp_offset)) / f32(hp.attn_temp_floor)
                st.temp[t, 0] = f32(math.log(float(math.floor(r)) + 1.0) * float(f32(hp.attn_temp_scale)) + 1.0)

    def forward(self, st: ForwardState, cache: KVCache, tokens: np.ndarray, n_past: int,
                all_logits: bool, want_logits: bool = True, head: bool = True) -> np.ndarray | None:
        """Run the graph on tokens at positions n_past.., appending their K/V to the cache.

        tokens: int64 [n], 1 <= n <= st.n_batch, ids in [0, n_vocab); n_past + n <= cache.n_ctx
        (the Session checks both). Returns float32 logits [n, n_vocab] when all_logits, else
        [1, n_vocab] for the last token (llama.cpp without an output mask computes the last
        layer's FFN and the head for the output rows only; the values are the same). With
        want_logits=False (a prefill batch whose logits nobody reads) the last layer stops once
        its K/V are cached and None is returned. head=False (the warm-up's batched forward, which
        compiles the batch's kernels and not the head's matmul, which a run reading its last row's
        logits never calls): the rows go through every layer as for their logits, and None is
        returned.
        """
        n = len(tokens)
        hp = self.hparams
        tabs = self._graph_tables()
        last_row = want_logits and not all_logits and n > 1
        segs = np.array([[0, n, 0, n_past, 0]], np.int64)
        rk = tabs.rows(st.attn_ws, n, n_past, last_row, hp)
        segs[0, _graph.SEG_ATTN] = rk[0, _graph.ATTN]
        x = self._run_layers(st, cache.k[np.newaxis], cache.v[np.newaxis], tokens,
                             np.arange(n_past, n_past + n, dtype=np.int64), segs, tabs.matmuls(n > 1, last_row), rk,
                             want_logits, all_logits)
        if not want_logits or not head:
            return None  # the cache is complete; nothing after the last layer's K/V feeds it
        return self._head(st, x[-1:] if last_row else x)

    def forward_segments(self, st: ForwardState, k_slots: np.ndarray, v_slots: np.ndarray, tokens: np.ndarray,
                         segments, out_rows) -> np.ndarray:
        """Run the graph on a batch of several sequences' rows, each appending to its own cache.

        tokens: int64 [n], 1 <= n <= st.n_batch; segments: (slot, n_past, count) per sequence, its
        count rows consecutive in tokens in the order given, at positions n_past.. of the cache
        slot (k_slots, v_slots: uint16 [n_slot, n_layer, ...], KVCache's arrays per slot; each
        slot at most once, n_past + count <= its n_ctx: the caller checks). out_rows: int64
        indices into the batch of the rows whose logits are wanted (none: the last layer stops
        after its K/V). Returns float32 [len(out_rows), n_vocab]. Each row's logits and K/V are the
        bits of the same tokens run alone (Model.forward): no row's arithmetic depends on another
        sequence's rows.
        """
        hp = self.hparams
        tabs = self._graph_tables()
        n = len(tokens)
        out_rows = np.asarray(out_rows, np.int64)
        # one sequence whose last row alone is wanted: its last layer goes on with that row (as forward)
        last_row = len(segments) == 1 and n > 1 and out_rows.tolist() == [n - 1]
        # a few rows: row kernels and conversions on this thread (ops.SERIAL_ROWS; the same bits)
        # two or more sequences of one row (decoding): their attention in one parallel call
        decode_rows = sum(count == 1 for _, _, count in segments) >= 2
        rk = tabs.rows(st.attn_ws, n, int(segments[0][1]), last_row, hp, _ops.SERIAL_ROWS, decode_rows)
        together = rk[0, _graph.ATTN_SEGS] != 0
        segs = np.empty((len(segments), _graph.SEG_FIELDS), np.int64)
        pos = np.empty(n, np.int64)
        r0 = 0
        for i, (slot, n_past, count) in enumerate(segments):
            # a row the ATTN_SEGS call attends needs no kernel of its own (none looked up: that
            # could compile one)
            attn = 0 if together and count == 1 else tabs.attention(st.attn_ws, count, n_past, hp)
            segs[i] = (r0, count, slot, n_past, attn)
            pos[r0:r0 + count] = np.arange(n_past, n_past + count)
            r0 += count
        x = self._run_layers(st, k_slots, v_slots, tokens, pos, segs, tabs.matmuls(n > 1, last_row, n), rk,
                             len(out_rows) > 0, not last_row)
        if len(out_rows) == 0:
            return np.empty((0, hp.n_vocab), np.float32)
        # The head on all wanted rows in one call: its n_vocab rows read once for all the
        # sequences (SmolLM2's 49152 x 576 Q8_0, 16 rows: 5.5 ms against 12.1 as 16 matvecs);
        # the bits are those of a matvec per row (matmul rows == matvec)
        return self._head(st, x[out_rows])

    def _run_layers(self, st, kc, vc, tokens, pos, segs, mt, rk, want_logits, all_logits) -> np.ndarray:
        """Embed tokens into st.x, run graph.layers on those rows, return st.x's rows (float32 [n, n_embd])."""
        n = len(tokens)
        acts = st.activations(n)
        # Embedding: the token rows of token_embd.weight, dequantized to float (ggml_get_rows).
        # Bound weights do not re-validate: tokens (int64, in range) and the buffers' shapes are
        # guaranteed by the caller and ForwardState.
        self.weights.tok_embd.get_rows(tokens, acts[0])
        if self.hparams.embd_scale != 0.0:
            # ggml_scale(inpL, embd_scale), one float product per value
            acts[0][...] *= np.float32(self.hparams.embd_scale)
        # Positions: RoPE cos/sin tables (and the attention temperature) per row
        self._position_inputs(st, pos)
        # The transformer blocks, in one compiled loop (kernels/graph.py: each step of a block
        # there, as llama.cpp's build_attn / build_ffn; its kernels in the tables built here)
        _graph.layers(*self._layers_args(st, kc, vc, acts, segs, mt, rk, want_logits, all_logits))
        return acts[0]

    def _head(self, st: ForwardState, x: np.ndarray) -> np.ndarray:
        """Final RMSNorm and the output head (token_embd when tied) on the rows x: float32 [m, n_vocab]."""
        h = st.h[:len(x)]
        _ops.rms_norm_rows(h, np.ascontiguousarray(x), self.weights.output_norm, np.float32(self.hparams.rms_eps))
        return self.weights.output.matmul(h)

    def _layers_args(self, st, kc, vc, acts, segs, mt, rk, want_logits, all_logits) -> tuple:
        """graph.layers' arguments for the rows acts of st in segments segs (tables mt, rk), grouped
        as layers takes them."""
        tabs = self._graph_tables()
        n = len(acts[0])
        if st.abuf is None or st.abuf.shape[1] < st.n_batch * tabs.act_row_bytes:
            st.abuf = np.empty((len(_graph.MATMULS), st.n_batch * tabs.act_row_bytes), np.uint8)
        return (acts, (st.rope[:n], st.rope_swa[:n], st.temp[:n]), (kc, vc), (st.abuf, st.attn_ws.buf),
                (mt, rk, tabs.items), tabs.vector_args, segs, self._block_args, want_logits, all_logits)

    def compile_layers(self, st: ForwardState, cache: KVCache) -> None:
        """Compile (or load from the cache) graph.layers for this model's forwards, without running
        it or building its kernel tables (so compiling no kernel): what the compile helper does
        first, so that the warm-up's process finds the loop in the cache (one signature serves
        every batch; the tables' types are fixed)."""
        import numba

        args = self._layers_args(st, cache.k[np.newaxis], cache.v[np.newaxis], st.activations(1),
                                 np.zeros((1, _graph.SEG_FIELDS), np.int64),
                                 np.zeros((1, len(_graph.MATMULS), _graph.ENTRY_FIELDS), np.int64),
                                 np.zeros((2, _graph.ROW_KERNELS), np.int64), True, True)
        _graph.layers.compile(tuple(numba.typeof(a) for a in args))

    def _graph_tables(self) -> _graph.Tables:
        if self._tables is None:
            self._tables = _graph.Tables(self.weights.layers, self.hparams)
        return self._tables


def load_model(path) -> Model:
    """Open a GGUF model file and read its hyper-parameters and weight table (nothing dequantized).

    path: str or Path of a GGUF file of an architecture of synapse_nb.arch.ARCHS.
    Returns a Model. Raises SynapseError (one line naming the file) for unreadable files,
    unsupported architectures, missing keys, or missing / misshapen tensors.
    """
    g = open_gguf(path)
    hp = HParams.from_gguf(g)
    return Model(path, g, hp, Weights.from_gguf(g, hp))
