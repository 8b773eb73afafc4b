"""llama: Llama 2/3, Mistral 7B, SmolLM, TinyLlama (llama.cpp LLM_ARCH_LLAMA, src/models/llama.cpp).

Keys: the common ones only (llama-model.cpp load_hparams, case LLM_ARCH_LLAMA reads none that
this decoder uses beyond them). Tensors: load_tensors' LLM_ARCH_LLAMA list: the Llama-family
block, optional rope_freqs (Llama 3), optional Q/K/V and output biases (all layers or none,
like layer 0). Block: normal RoPE (llama_model_rope_type: LLAMA_ROPE_TYPE_NORM), SwiGLU FFN,
no extra norms.
"""

from .recipe import BLOCK, GLOBAL, NEEDED, ROPE_FREQS, Recipe, Tensor, no_derived, qkv_biases

NAME = "llama"
RECIPE = Recipe(rope_type="norm")
KEYS = {}
TENSORS = (
    *GLOBAL,
    ROPE_FREQS,
    *BLOCK,
    *qkv_biases(when="has_bias_qkv"),
    Tensor("blk.{i}.attn_output.bias", ("n_embd",), NEEDED, when="has_bias_o"),
)
derive = no_derived
