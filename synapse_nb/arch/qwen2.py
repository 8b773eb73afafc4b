"""qwen2: Qwen2, Qwen2.5 (llama.cpp LLM_ARCH_QWEN2, src/models/qwen2.cpp).

Keys: the common ones only. Tensors: load_tensors' LLM_ARCH_QWEN2 list: the Llama-family block
with Q/K/V biases in every layer; no output bias, no rope_freqs. Block: NEOX RoPE
(llama_model_rope_type: LLAMA_ROPE_TYPE_NEOX), SwiGLU FFN.
"""

from .recipe import BLOCK, GLOBAL, Recipe, no_derived, qkv_biases

NAME = "qwen2"
RECIPE = Recipe(rope_type="neox")
KEYS = {}
TENSORS = (*GLOBAL, *BLOCK, *qkv_biases(when=None))
derive = no_derived
