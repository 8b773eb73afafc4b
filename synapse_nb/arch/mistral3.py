"""mistral3: Ministral 3 (llama.cpp LLM_ARCH_MISTRAL3, src/models/mistral3.cpp).

Keys beyond the common ones (llama-model.cpp load_hparams, case LLM_ARCH_MISTRAL3): the YaRN
betas and log multiplier, and the attention temperature scale. Tensors: the llama list
(load_tensors shares LLM_ARCH_LLAMA's). Block: normal RoPE (LLAMA_ROPE_TYPE_NORM), usually YaRN
scaled (the common rope.scaling keys), q scaled after RoPE by the attention temperature of its
position when the scale is not 0, SwiGLU FFN.
"""

from ..gguf_spec import Keys
from . import llama
from .recipe import Key, Recipe

NAME = "mistral3"
RECIPE = Recipe(rope_type="norm")
KEYS = {
    "yarn_beta_fast": Key(Keys.Rope.SCALING_YARN_BETA_FAST, "number", 32.0),
    "yarn_beta_slow": Key(Keys.Rope.SCALING_YARN_BETA_SLOW, "number", 1.0),
    "yarn_log_multiplier": Key(Keys.Rope.SCALING_YARN_LOG_MUL, "number", 0.0),
    "attn_temp_scale": Key(Keys.Attention.TEMPERATURE_SCALE, "number", 0.0),  # 0: no temperature
}
TENSORS = llama.TENSORS


def derive(hp: dict, path) -> dict:
    """The temperature's floor length and offset: llama.cpp sets n_attn_temp_floor_scale =
    n_ctx_orig_yarn (yarn_orig_ctx; there is no key) when the temperature scale is not 0 (0:
    none), and f_attn_temp_offset = 0."""
    return {"attn_temp_floor": hp["yarn_orig_ctx"] if hp["attn_temp_scale"] != 0 else 0, "attn_temp_offset": 0.0}
