"""The Llama-family graph (arch llama, qwen2, mistral3) as llama.cpp's CPU backend runs it.

Reproduces llama.cpp (vendored in llama-cpp-python 0.3.36): src/models/llama.cpp, qwen2.cpp,
mistral3.cpp and llama-graph.cpp (build_qkv, build_attn, build_attn_mha, build_ffn), with flash
attention off and an F16 KV cache. One forward over a batch of tokens, a comment per step;
every buffer is allocated once per session (ForwardState) and the KV cache once (KVCache).

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
from .kernels import attention as _attn
from .kernels import ops as _ops

if TYPE_CHECKING:  # the session's state types, for annotations only (session.py imports this module)
    from .session import ForwardState, KVCache



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
    bq: np.ndarray | None  # qwen2 biases, float32
    bk: np.ndarray | None
    bv: np.ndarray | None
    bo: np.ndarray | None
    ffn_norm: np.ndarray  # float32 [n_embd]
    w_gate: BoundWeight  # (n_ff, n_embd)
    w_up: BoundWeight  # (n_ff, n_embd)
    w_down: BoundWeight  # (n_embd, n_ff)


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
        hp = hparams
        f32 = np.float32
        # RoPE constants of ggml_compute_forward_rope_flt, fixed for the model.
        self._theta_scale = _ops.rope_theta_scale(f32(hp.rope_freq_base), hp.n_rot)
        lo, hi = _ops.rope_corr_dims(hp.n_rot, hp.yarn_orig_ctx, f32(hp.rope_freq_base),
                                     f32(hp.yarn_beta_fast), f32(hp.yarn_beta_slow))
        self._corr_dims = (f32(lo), f32(hi))
        self._kq_scale = f32(1.0) / f32(math.sqrt(f32(hp.head_dim_k)))  # 1.0f/sqrtf(float(n_embd_head))

    @property
    def tokenizer(self):
        """The GGUF's tokenizer (synapse_nb.tokenizer), loaded on first use."""
        if self._tokenizer is None:
            from .tokenizer import load_tokenizer

            self._tokenizer = load_tokenizer(self.gguf)
        return self._tokenizer

    def _position_inputs(self, st: ForwardState, n_past: int, n: int) -> None:
        """Per-position inputs of the graph: the RoPE cos/sin table and mistral3's q temperature."""
        hp = self.hparams
        f32 = np.float32
        pos = np.arange(n_past, n_past + n, dtype=np.int64)
        # ggml_rope_cache_init for each position (cos/sin pairs, YaRN ramp and magnitude)
        _ops.rope_cache(st.rope[:n], pos, hp.n_rot, self._theta_scale, f32(hp.rope_freq_scale),
                        self.weights.rope_freqs, f32(hp.yarn_ext_factor), f32(hp.yarn_attn_factor),
                        self._corr_dims[0], self._corr_dims[1])
        if hp.attn_temp_scale != 0.0:
            # llm_graph_input_attn_temp::set_input: float position, float division by the floor
            # length, then log(floor(.) + 1.0) * scale + 1.0 in double, stored as float
            for t in range(n):
                r = f32(f32(n_past + t) + f32(0.0)) / f32(hp.attn_temp_floor)
                st.temp[t, 0] = f32(math.log(float(math.floor(r)) + 1.0) * float(f32(hp.attn_temp_scale)) + 1.0)

    def forward(self, st: ForwardState, cache: KVCache, tokens: np.ndarray, n_past: int,
                all_logits: bool, want_logits: bool = True) -> np.ndarray | None:
        """Run the graph on tokens at positions n_past.., appending their K/V to the cache.

        tokens: int64 [n], 1 <= n <= st.n_batch, ids in [0, n_vocab); n_past + n <= cache.n_ctx
        (the Session checks both). Returns float32 logits [n, n_vocab] when all_logits, else
        [1, n_vocab] for the last token (llama.cpp without an output mask computes the last
        layer's FFN and the head for the output rows only; the values are the same). With
        want_logits=False (a prefill batch whose logits nobody reads) the last layer stops once
        its K/V are cached and None is returned.
        """
        hp = self.hparams
        W = self.weights
        n = len(tokens)
        f32 = np.float32
        eps = f32(hp.rms_eps)
        neox = hp.rope_type == "neox"
        x, h, q, k, v = st.x[:n], st.h[:n], st.q[:n], st.k[:n], st.v[:n]
        attn, o, gate, up, act = st.attn[:n], st.o[:n], st.gate[:n], st.up[:n], st.act[:n]

        # Embedding: the token rows of token_embd.weight, dequantized to float (ggml_get_rows).
        # Bound weights do not re-validate: tokens (int64, in range) and the buffers' shapes are
        # guaranteed by the Session and ForwardState.
        W.tok_embd.get_rows(tokens, x)
        # Positions: RoPE cos/sin table (and mistral3's attention temperature) per row
        self._position_inputs(st, n_past, n)
        rope = st.rope[:n]

        for il, L in enumerate(W.layers):
            # Attention RMSNorm: x / sqrt(mean(x^2) + eps) * attn_norm
            _ops.rms_norm_rows(h, x, L.attn_norm, eps)
            # Q, K, V projections (+ biases: qwen2)
            # (h is converted to the weights' vec_dot_type once when they share it: same bytes)
            _matmuls_sharing_input(h, ((L.wq, q), (L.wk, k), (L.wv, v)))
            if L.bq is not None:
                q += L.bq
                k += L.bk
                v += L.bv
            # RoPE on q and k (normal: pairs (2i, 2i+1); NEOX: (i, i + n_rot/2))
            _ops.rope_rows(q, rope, hp.n_head, hp.head_dim_k, hp.n_rot, neox)
            _ops.rope_rows(k, rope, hp.n_head_kv, hp.head_dim_k, hp.n_rot, neox)
            # mistral3: q scaled by the attention temperature of its position (after RoPE)
            if hp.attn_temp_scale != 0.0:
                q *= st.temp[:n]
            # Append k, v to this layer's cache as F16
            _attn.store_kv(cache.k[il], cache.v[il], k, v, n_past)
            pos_q = n_past
            if il == hp.n_layer - 1:
                if not want_logits:
                    return None  # the cache is complete; nothing after this feeds it
                if not all_logits and n > 1:
                    # Last layer: only the row that produces logits goes on (llama.cpp's
                    # ggml_get_rows on inp_out_ids; rows are independent, values unchanged)
                    q, attn, x, h, o, gate, up, act = (a[-1:] for a in (q, attn, x, h, o, gate, up, act))
                    pos_q = n_past + n - 1
            # Causal attention over positions 0..p: F16 q.k, softmax, F16 probabilities . V
            _attn.attention_rows(attn, q, cache.k[il], cache.v[il], pos_q, hp.n_head, hp.n_head_kv,
                                 hp.head_dim_k, hp.head_dim_v, self._kq_scale, st.attn_ws)
            # Output projection (+ bias)
            L.wo.matmul(attn, o)
            if L.bo is not None:
                o += L.bo
            # Residual: ffn_inp = attn_out + x
            x += o
            # FFN RMSNorm
            _ops.rms_norm_rows(h, x, L.ffn_norm, eps)
            # SwiGLU FFN: down(silu(gate(h)) * up(h))
            _matmuls_sharing_input(h, ((L.w_gate, gate), (L.w_up, up)))
            _ops.swiglu_rows(act, gate, up)
            L.w_down.matmul(act, o)
            # Residual: x = ffn_out + ffn_inp
            x += o

        # Final RMSNorm and the output head (token_embd when tied)
        _ops.rms_norm_rows(h, x, W.output_norm, eps)
        return W.output.matmul(h)


def _matmuls_sharing_input(x: np.ndarray, pairs) -> None:
    """out = w . x for each (BoundWeight w, out) of pairs, all reading the same x: x is converted
    to a vec_dot_type once and reused by every weight that shares it (a weight of another type
    converts its own), exactly the bytes each weight's own conversion would give."""
    conv = []  # (weight whose conversion it is, converted x)
    for w, out in pairs:
        a = next((a for w0, a in conv if w0.shares_activation(w)), None)
        if a is None:
            a = w.quantize(x)
            conv.append((w, a))
        w.matmul_q(a, out)


def load_model(path) -> Model:
    """Open a GGUF model file and read its hyper-parameters and weight table (nothing dequantized).

    path: str or Path of a GGUF file of arch llama, qwen2 or mistral3.
    Returns a Model. Raises SynapseError (one line naming the file) for unreadable files,
    unsupported architectures, missing keys, or missing / misshapen tensors.
    """
    g = open_gguf(path)
    hp = HParams.from_gguf(g)
    return Model(path, g, hp, Weights.from_gguf(g, hp))
