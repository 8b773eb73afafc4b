"""gemma3: Gemma 3 text models (llama.cpp LLM_ARCH_GEMMA3, src/models/gemma3.cpp llm_build_gemma3).

Keys beyond the common ones (llama-model.cpp load_hparams, case LLM_ARCH_GEMMA3): the sliding
window (required; a model without one is not supported). Tensors: load_tensors' LLM_ARCH_GEMMA3
list: the Llama-family block plus per-head Q/K norms and post-attention / post-FFN norms; no
biases, no rope_freqs. Block: NEOX RoPE (LLAMA_ROPE_TYPE_NEOX), the embeddings scaled by
sqrt(n_embd), RMS norms of each q and k head, q scaled by f_attention_scale after RoPE (the
softmax scale then 1), post norms before both residual adds, GEGLU FFN; every 6th layer attends
all positions, the others a sliding window with their own RoPE base.
"""

import numpy as np

from ..errors import SynapseError
from ..gguf_spec import Keys
from .recipe import BLOCK, GLOBAL, Key, Recipe, Tensor

NAME = "gemma3"
RECIPE = Recipe(rope_type="neox", qk_norm=True, post_norms=True, ffn_act="gelu")
KEYS = {"n_swa": Key(Keys.Attention.SLIDING_WINDOW, "integer")}
TENSORS = (
    *GLOBAL,
    *BLOCK,
    Tensor("blk.{i}.attn_q_norm.weight", ("head_dim_k",)),
    Tensor("blk.{i}.attn_k_norm.weight", ("head_dim_k",)),
    Tensor("blk.{i}.post_attention_norm.weight", ("n_embd",)),
    Tensor("blk.{i}.post_ffw_norm.weight", ("n_embd",)),
)
# hparams.set_swa_pattern(6): every 6th layer attends all positions, the others the window
# (llama_hparams::is_swa(il) = il % 6 < 5); the SWA layers' RoPE base 10000 and scale 1
# (rope_freq_base_train_swa / rope_freq_scale_train_swa: no GGUF key for either)
SWA_PATTERN = 6
ROPE_FREQ_BASE_SWA = 10000.0


def derive(hp: dict, path) -> dict:
    """The window layers, their RoPE, the attention and embedding scales (float32, as llama.cpp).

    Raises SynapseError naming path when the sliding window is not positive."""
    n_swa = hp["n_swa"]
    if n_swa <= 0:
        raise SynapseError(f"{path}: key {Keys.Attention.SLIDING_WINDOW.format(arch=NAME)} = {n_swa}: gemma3 "
                           f"without a sliding window is not supported")
    f32 = np.float32
    # llm_type 27B (62 layers) scales q by 1/sqrt(n_embd / n_head), the others by 1/sqrt(head_dim)
    d = hp["n_embd"] // hp["n_head"] if hp["n_layer"] == 62 else hp["head_dim_k"]
    return dict(
        swa_layers=tuple(il % SWA_PATTERN < SWA_PATTERN - 1 for il in range(hp["n_layer"])),
        rope_freq_base_swa=ROPE_FREQ_BASE_SWA,
        rope_freq_scale_swa=1.0,
        attn_scale=float(f32(1.0) / np.sqrt(f32(d))),
        embd_scale=float(np.sqrt(f32(hp["n_embd"]))),
    )
