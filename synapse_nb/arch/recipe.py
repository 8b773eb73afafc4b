"""The terms an architecture module is written in: its block recipe, its extra GGUF keys, its tensors.

An architecture module (synapse_nb.arch.llama, ...) gives its NAME (general.architecture) and
four things, read by the common code (hparams.HParams.from_gguf, model.Model,
kernels/graph.layers), which never tests the architecture's name:

  RECIPE   Recipe: the steps of its transformer block that are fixed for the architecture
           (llama.cpp src/models/<arch>.cpp, llama_model_rope_type);
  KEYS     {HParams field: Key}: the GGUF keys it reads beyond the common ones
           (llama-model.cpp llama_model::load_hparams, its LLM_ARCH_<ARCH> case);
  TENSORS  tuple of Tensor: every tensor it may have, with its shape (llama-model.cpp
           load_tensors, its LLM_ARCH_<ARCH> case);
  derive   derive(hp: dict, path) -> dict: HParams fields computed from the values read
           (common ones and KEYS'), e.g. a scale or a per-layer pattern; raises SynapseError
           naming path for a value it does not support.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..gguf_file import REQUIRED

# A tensor's need (Tensor.need)
NEEDED = "needed"  # every model of the architecture has it (when Tensor.when holds)
OPTIONAL = "optional"  # may be absent


@dataclass(frozen=True)
class Recipe:
    """The architecture-fixed steps of a block (each the llama.cpp graph step named).

    rope_type   "norm" (pairs (2i, 2i+1): LLAMA_ROPE_TYPE_NORM) or "neox" (pairs (i, i + n_rot/2):
                LLAMA_ROPE_TYPE_NEOX), as llama_model_rope_type returns for the architecture
    qk_norm     RMS norm of each q and k head after the projections (attn_q_norm, attn_k_norm)
    post_norms  RMS norms of the attention and FFN outputs before their residual adds
                (post_attention_norm, post_ffw_norm)
    ffn_act     "silu" (SwiGLU: silu(gate) * up, build_ffn LLM_FFN_SILU) or "gelu" (GEGLU: ggml's
                GELU of gate, times up, LLM_FFN_GELU)

    The rest of a block's recipe is values (HParams): biases and rope_freqs by the tensors present
    (TENSORS), RoPE scaling by the common keys, and the values derive() computes (embedding scale,
    attention scale, attention temperature, sliding window).
    """

    rope_type: str
    qk_norm: bool = False
    post_norms: bool = False
    ffn_act: str = "silu"


@dataclass(frozen=True)
class Key:
    """A GGUF key an architecture reads: template ({arch} = general.architecture), kind ("integer":
    get_key<uint32_t>, "number": get_key<float>, "string") and default (REQUIRED: must be present)."""

    template: str
    kind: str
    default: object = REQUIRED


@dataclass(frozen=True)
class Tensor:
    """A tensor an architecture may have: its GGUF name ("blk.{i}." names: one per layer i), its
    shape in numpy order (outermost first) as dimension names of dims(), its need (NEEDED or
    OPTIONAL), and when: None, or the name of an HParams flag read from the tensors present (e.g.
    has_bias_qkv, set when layer 0 has attn_q.bias): the tensor belongs to the model only when
    the flag is set (all or none: a bias in some layers only is refused)."""

    name: str
    shape: tuple[str, ...]
    need: str = NEEDED
    when: str | None = None


def dims(hp) -> dict[str, int]:
    """The dimension names of Tensor.shape, from HParams hp."""
    return {
        "n_vocab": hp.n_vocab, "n_embd": hp.n_embd, "n_ff": hp.n_ff, "head_dim_k": hp.head_dim_k,
        "n_q": hp.n_head * hp.head_dim_k,  # q projection rows
        "n_k": hp.n_head_kv * hp.head_dim_k,
        "n_v": hp.n_head_kv * hp.head_dim_v,
        "n_o": hp.n_head * hp.head_dim_v,  # attention output width (wo's columns)
        "n_rot/2": hp.n_rot // 2,
    }


# The tensors of every Llama-family block (llama-model.cpp load_tensors, LLM_ARCH_LLAMA's list,
# which the others start from); an architecture's TENSORS are GLOBAL + its extras + BLOCK + its
# per-layer extras, in the order the checks report a missing one.
GLOBAL = (
    Tensor("token_embd.weight", ("n_vocab", "n_embd")),
    Tensor("output_norm.weight", ("n_embd",)),
    Tensor("output.weight", ("n_vocab", "n_embd"), OPTIONAL),  # absent: tied to token_embd
)
BLOCK = (
    Tensor("blk.{i}.attn_norm.weight", ("n_embd",)),
    Tensor("blk.{i}.attn_q.weight", ("n_q", "n_embd")),
    Tensor("blk.{i}.attn_k.weight", ("n_k", "n_embd")),
    Tensor("blk.{i}.attn_v.weight", ("n_v", "n_embd")),
    Tensor("blk.{i}.attn_output.weight", ("n_embd", "n_o")),
    Tensor("blk.{i}.ffn_norm.weight", ("n_embd",)),
    Tensor("blk.{i}.ffn_gate.weight", ("n_ff", "n_embd")),
    Tensor("blk.{i}.ffn_up.weight", ("n_ff", "n_embd")),
    Tensor("blk.{i}.ffn_down.weight", ("n_embd", "n_ff")),
)
# Llama 3's RoPE frequency divisors (n_rot/2 floats; absent: all 1)
ROPE_FREQS = Tensor("rope_freqs.weight", ("n_rot/2",), OPTIONAL)


def qkv_biases(when: str | None) -> tuple[Tensor, ...]:
    """The attn_q / attn_k / attn_v biases of every layer: always (when None) or when hp.<when>."""
    return tuple(Tensor(f"blk.{{i}}.attn_{w}.bias", (d,), NEEDED, when) for w, d in (("q", "n_q"), ("k", "n_k"),
                                                                                    ("v", "n_v")))


def no_derived(hp: dict, path) -> dict:
    """derive() of an architecture that computes nothing beyond what it reads."""
    return {}
