"""HParams: the model hyper-parameters, read from GGUF keys as llama.cpp reads them.

Sources reproduced (llama.cpp src/): llama-model.cpp llama_model::load_hparams
(generic keys, then the architecture's case) and llama_model_rope_type; llama-hparams.h
(defaults); llama-context.cpp llama_context::llama_context (the effective rope/YaRN parameters
a context derives from them when the user overrides nothing); llama-model.cpp load_tensors
(the tensor list and shapes checked by validate_tensors).

What differs between architectures (extra keys, tensors, recipe, derived values) is read from
the architecture's module (synapse_nb.arch.ARCHS); this module reads the common keys and checks.
Key names are gguf.Keys templates with {arch} = general.architecture, e.g.
`llama.attention.head_count`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from .gguf_spec import GGUFValueType as VT
from .gguf_spec import Keys

from .arch import ARCHS
from .arch.recipe import NEEDED, dims
from .errors import SynapseError
from .formats import weight_formats
from .gguf_file import REQUIRED, GGUFFile, show

ROPE_SCALING_TYPES = ("none", "linear", "yarn")  # "longrope" exists in llama.cpp, not supported here

# ggml types the kernels can multiply / look up: the weight formats of synapse_nb.formats' table
# (= synapse_nb.kernels.supported_types(); a test keeps the two equal). Checked here so that a file
# is refused when loaded, naming file, tensor and type, not at the first forward. 1-D tensors
# (norms, biases, rope_freqs) are read as F32 or F16.
WEIGHT_TYPES = frozenset(f.name for f in weight_formats())
VECTOR_TYPES = frozenset({"F32", "F16"})


@dataclass(frozen=True)
class HParams:
    """Hyper-parameters of a Llama-family GGUF model (an architecture of synapse_nb.arch.ARCHS).

    Integers are counts or lengths in elements; floats are the float32 values
    stored in the file (or float32 results, as llama.cpp computes them). "The recipe" is the
    architecture module's (synapse_nb.arch): its RECIPE, KEYS and derive().

    arch                general.architecture, a key of synapse_nb.arch.ARCHS
    name                general.name ("" when absent)
    n_vocab             {arch}.vocab_size, else len(tokenizer.ggml.tokens), else token_embd rows
    n_embd              {arch}.embedding_length (required)
    n_layer             {arch}.block_count (required)
    n_head              {arch}.attention.head_count (required)
    n_head_kv           {arch}.attention.head_count_kv (default n_head)
    head_dim_k          {arch}.attention.key_length (default n_embd // n_head)
    head_dim_v          {arch}.attention.value_length (default n_embd // n_head)
    n_ff                {arch}.feed_forward_length (required)
    n_ctx_train         {arch}.context_length (required)
    rms_eps             {arch}.attention.layer_norm_rms_epsilon (required for every arch)
    rope_type           the recipe's: "norm" or "neox" (llama_model_rope_type)
    n_rot               {arch}.rope.dimension_count (default head_dim_k); must equal head_dim_k
                        (llama.cpp checks it for some architectures; every graph here assumes it)
    rope_freq_base      {arch}.rope.freq_base (default 10000)
    rope_scaling_type   {arch}.rope.scaling.type (default "linear"): "none", "linear" or "yarn"
    rope_freq_scale     1 / {arch}.rope.scaling.factor (else the old key {arch}.rope.scale_linear;
                        1 when the factor is absent or 0), in float32; forced to 1 when the scaling
                        type is "none" (llama-context.cpp)
    has_rope_freqs      tensor rope_freqs.weight present (Llama 3 frequency divisors, n_rot/2 floats)
    yarn_orig_ctx       {arch}.rope.scaling.original_context_length (default n_ctx_train)
    yarn_ext_factor     1.0 when the scaling type is "yarn", else 0.0 (llama-context.cpp: the context
                        default -1 means "derive from the scaling type")
    yarn_attn_factor    llama-context.cpp, float32: with ext_factor != 0 and factor = 1/rope_freq_scale,
                        get_mscale(factor, 1) / get_mscale(factor, yarn_log_multiplier) (or just
                        get_mscale(factor, 1) when the multiplier is 0), where get_mscale(s, m) =
                        1 if s <= 1 else 0.1*m*ln(s) + 1; then multiplied by 1/(1 + 0.1*ln(factor)) to
                        cancel the magnitude ggml's rope applies itself (llama.cpp PR 17945); then by
                        {arch}.rope.scaling.attn_factor (default 1). 1.0 without YaRN. For the tiny
                        YaRN fixture (factor 16, multiplier 1): 1/(1 + 0.1 ln 16) = 0.78289.
                        (llama.cpp's graph of that architecture computes this same value itself,
                        1/(1 + 0.1 ln(1/freq_scale)), ignoring the context's.)
    tied_output         no output.weight tensor: the output projection is token_embd
    has_bias_qkv        attn_q/attn_k/attn_v biases present (every layer, like layer 0, when the
                        recipe's TENSORS allow them)
    has_bias_o          attn_output bias present (likewise)

    Set by the recipe (its KEYS or derive(); the defaults, llama-hparams.h's, are "off"):
    yarn_beta_fast      {arch}.rope.scaling.yarn_beta_fast (default 32)
    yarn_beta_slow      {arch}.rope.scaling.yarn_beta_slow (default 1)
    yarn_log_multiplier {arch}.rope.scaling.yarn_log_multiplier (default 0)
    attn_temp_scale     {arch}.attention.temperature_scale (default 0 = off)
    attn_temp_floor     the floor length of the temperature scaling (0 when off). llama.cpp then
                        scales q at position p by 1 + attn_temp_scale * ln(floor((p +
                        attn_temp_offset) / attn_temp_floor) + 1) (llama-graph.cpp
                        llm_graph_input_attn_temp)
    attn_temp_offset    f_attn_temp_offset, the position offset above (default 0)
    n_swa               {arch}.attention.sliding_window: a query at p attends p - n_swa + 1 .. p on
                        the SWA layers (LLAMA_SWA_TYPE_STANDARD); 0: no sliding window
    swa_layers          per layer, True for a sliding-window layer (llama_hparams::is_swa)
    rope_freq_base_swa  RoPE base of the SWA layers (rope_freq_base_train_swa)
    rope_freq_scale_swa RoPE frequency scale of the SWA layers (rope_freq_scale_train_swa)
    attn_scale          f_attention_scale, float32: q is multiplied by it after RoPE and the
                        softmax scale is 1 (0: none, the softmax scale is 1/sqrt(head_dim_k))
    embd_scale          float32: the token embeddings are multiplied by it (0: none)
    has_qk_norm         the recipe's qk_norm: RMS norms on each head of q and k after the
                        projections (attn_q_norm, attn_k_norm: [head_dim_k] per layer)
    has_post_norms      the recipe's post_norms: RMS norms on the attention and FFN outputs before
                        their residual adds (post_attention_norm, post_ffw_norm)
    ffn_act             the recipe's: "silu" (SwiGLU: silu(gate) * up) or "gelu" (GEGLU: ggml's
                        GELU of gate * up)
    """

    arch: str
    name: str
    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim_k: int
    head_dim_v: int
    n_ff: int
    n_ctx_train: int
    rms_eps: float
    rope_type: str
    n_rot: int
    rope_freq_base: float
    rope_scaling_type: str
    rope_freq_scale: float
    has_rope_freqs: bool
    yarn_orig_ctx: int
    yarn_ext_factor: float
    yarn_attn_factor: float
    tied_output: bool
    has_bias_qkv: bool
    has_bias_o: bool
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_log_multiplier: float = 0.0
    attn_temp_scale: float = 0.0
    attn_temp_floor: int = 0
    attn_temp_offset: float = 0.0
    n_swa: int = 0
    swa_layers: tuple = ()
    rope_freq_base_swa: float = 0.0
    rope_freq_scale_swa: float = 1.0
    attn_scale: float = 0.0
    embd_scale: float = 0.0
    has_qk_norm: bool = False
    has_post_norms: bool = False
    ffn_act: str = "silu"

    @property
    def n_gqa(self) -> int:
        """Query heads per KV head (n_head // n_head_kv)."""
        return self.n_head // self.n_head_kv

    def is_swa(self, il: int) -> bool:
        """Whether layer il attends through the sliding window (llama_hparams::is_swa)."""
        return self.n_swa > 0 and bool(self.swa_layers[il])

    @classmethod
    def from_gguf(cls, g: GGUFFile) -> HParams:
        """Read the hyper-parameters of an opened GGUF model and check its tensors (validate_tensors).

        Raises SynapseError (naming the file) for: an architecture not in
        synapse_nb.arch.ARCHS, a missing required key, a key of the wrong
        type, a per-layer array with differing values, inconsistent values
        (n_head not a multiple of n_head_kv, n_rot != head_dim_k, ...), and any
        missing, unexpected or wrongly shaped tensor.
        """
        arch = g.arch  # STRING, as llama.cpp's get_key(LLM_KV_GENERAL_ARCHITECTURE, std::string)
        module = ARCHS.get(arch)  # the architecture's keys, tensors and recipe
        if module is None:
            raise SynapseError(
                f"{g.path}: unsupported architecture {arch!r} (supported: {', '.join(ARCHS)})"
                if arch is not None
                else f"{g.path}: no general.architecture key: not a model file"
            )
        key = _KeyReader(g, arch)
        n_embd = key.integer(Keys.LLM.EMBEDDING_LENGTH)
        n_layer = key.integer(Keys.LLM.BLOCK_COUNT)
        if n_layer <= 0:
            raise SynapseError(f"{g.path}: key {Keys.LLM.BLOCK_COUNT.format(arch=arch)} must be positive, got {n_layer}")
        # Before anything loops over the layers (per-layer keys included): a corrupt block_count
        # (2**31) must not build tables of billions of entries. Each layer has at least the
        # recipe's always-needed per-layer tensors, plus its always-needed global ones.
        needed = [t for t in module.TENSORS if t.need == NEEDED and t.when is None]
        n_per_layer = sum(t.name.startswith("blk.{i}.") for t in needed)
        n_min = n_per_layer * n_layer + len(needed) - n_per_layer
        if len(g.tensors) < n_min:
            raise SynapseError(
                f"{g.path}: key {Keys.LLM.BLOCK_COUNT.format(arch=arch)} = {n_layer} needs at least {n_min} "
                f"tensors, the file has {len(g.tensors)}"
                + (" (a vocabulary-only GGUF, not a model)" if not g.tensors else "")
            )
        key.n_layer = n_layer
        n_head = key.integer(Keys.Attention.HEAD_COUNT, per_layer=True)
        n_head_kv = key.integer(Keys.Attention.HEAD_COUNT_KV, n_head, per_layer=True)
        n_ff = key.integer(Keys.LLM.FEED_FORWARD_LENGTH, per_layer=True)
        n_ctx_train = key.integer(Keys.LLM.CONTEXT_LENGTH)
        head_dim_k = key.integer(Keys.Attention.KEY_LENGTH, None)
        head_dim_v = key.integer(Keys.Attention.VALUE_LENGTH, None)
        n_rot = key.integer(Keys.Rope.DIMENSION_COUNT, None)
        for k, v in ((Keys.LLM.EMBEDDING_LENGTH, n_embd),
                     (Keys.Attention.HEAD_COUNT, n_head), (Keys.Attention.HEAD_COUNT_KV, n_head_kv),
                     (Keys.LLM.FEED_FORWARD_LENGTH, n_ff), (Keys.LLM.CONTEXT_LENGTH, n_ctx_train),
                     (Keys.Attention.KEY_LENGTH, head_dim_k), (Keys.Attention.VALUE_LENGTH, head_dim_v),
                     (Keys.Rope.DIMENSION_COUNT, n_rot)):
            if v is not None and v <= 0:
                raise SynapseError(f"{g.path}: key {k.format(arch=arch)} must be positive, got {v}")
        if n_head % n_head_kv:
            raise SynapseError(f"{g.path}: n_head {n_head} is not a multiple of n_head_kv {n_head_kv}")
        # llama.cpp: n_embd_head_k = n_embd / n_head (integer division) unless the key is given
        head_dim_k = n_embd // n_head if head_dim_k is None else head_dim_k
        head_dim_v = n_embd // n_head if head_dim_v is None else head_dim_v
        n_rot = head_dim_k if n_rot is None else n_rot
        if not (n_rot == head_dim_k == head_dim_v) or n_rot % 2 or n_rot <= 0:
            raise SynapseError(
                f"{g.path}: n_rot {n_rot}, head_dim_k {head_dim_k} and head_dim_v {head_dim_v} must be equal, even "
                f"and positive "
                f"for arch {arch}"
            )

        rope_scaling_type = key.string(Keys.Rope.SCALING_TYPE, "linear")
        if rope_scaling_type not in ROPE_SCALING_TYPES:
            raise SynapseError(
                f"{g.path}: key {Keys.Rope.SCALING_TYPE.format(arch=arch)} = {rope_scaling_type!r} is not supported "
                f"(supported: {', '.join(ROPE_SCALING_TYPES)})"
            )
        factor = key.number(Keys.Rope.SCALING_FACTOR, None)
        if factor is None:
            factor = key.number("{arch}.rope.scale_linear", 0.0)  # the old key name
        f32 = np.float32
        with np.errstate(over="ignore", divide="ignore"):  # a tiny factor gives inf, as in llama.cpp's float math
            rope_freq_scale = 1.0 if factor == 0 or rope_scaling_type == "none" else float(f32(1) / f32(factor))
        yarn_orig_ctx = key.integer(Keys.Rope.SCALING_ORIG_CTX_LEN, 0) or n_ctx_train

        # The recipe's own keys (HParams field -> value; the fields' defaults otherwise)
        extra = {field: key.read(k) for field, k in module.KEYS.items()}
        log_mul = extra.get("yarn_log_multiplier", cls.yarn_log_multiplier)

        # llama-context.cpp: effective YaRN extrapolation and attention factors (float32 arithmetic).
        yarn_ext_factor = 1.0 if rope_scaling_type == "yarn" else 0.0
        attn_factor = f32(1)
        if yarn_ext_factor != 0:
            with np.errstate(all="ignore"):  # extreme factors give inf / 0, as llama.cpp's float math does
                s = f32(1) / f32(rope_freq_scale)

                def mscale(m):
                    return f32(1) if s <= 1 else f32(0.1) * f32(m) * np.log(s) + f32(1)

                attn_factor = mscale(1) / mscale(log_mul) if log_mul != 0 else mscale(1)
                attn_factor = attn_factor * (f32(1) / (f32(1) + f32(0.1) * np.log(s)))
        attn_factor = attn_factor * f32(key.number(Keys.Rope.SCALING_ATTN_FACTOR, 1.0))

        n_vocab = key.integer(Keys.LLM.VOCAB_SIZE, 0)
        tokens = g.get_array(Keys.Tokenizer.LIST, VT.STRING, default=None)
        if n_vocab and tokens is not None and len(tokens) != n_vocab:
            raise SynapseError(
                f"{g.path}: {Keys.LLM.VOCAB_SIZE.format(arch=arch)} = {n_vocab} but "
                f"{Keys.Tokenizer.LIST} has {len(tokens)} tokens"
            )
        if not n_vocab:
            n_vocab = len(tokens) if tokens is not None else g.tensor("token_embd.weight").shape[0]

        common = dict(
            arch=arch,
            name=g.get(Keys.General.NAME, VT.STRING, ""),
            n_vocab=n_vocab,
            n_embd=n_embd,
            n_layer=n_layer,
            n_head=n_head,
            n_head_kv=n_head_kv,
            head_dim_k=head_dim_k,
            head_dim_v=head_dim_v,
            n_ff=n_ff,
            n_ctx_train=n_ctx_train,
            rms_eps=key.number(Keys.Attention.LAYERNORM_RMS_EPS),
            n_rot=n_rot,
            rope_freq_base=key.number(Keys.Rope.FREQ_BASE, 10000.0),
            rope_scaling_type=rope_scaling_type,
            rope_freq_scale=rope_freq_scale,
            yarn_orig_ctx=yarn_orig_ctx,
            yarn_ext_factor=yarn_ext_factor,
            yarn_attn_factor=float(attn_factor),
        )
        derived = module.derive({**common, **extra}, g.path)
        t = g.tensors
        recipe = module.RECIPE
        hp = cls(
            **common,
            **extra,
            **derived,
            rope_type=recipe.rope_type,
            has_qk_norm=recipe.qk_norm,
            has_post_norms=recipe.post_norms,
            ffn_act=recipe.ffn_act,
            has_rope_freqs="rope_freqs.weight" in t,
            tied_output="output.weight" not in t,
            has_bias_qkv="blk.0.attn_q.bias" in t,
            has_bias_o="blk.0.attn_output.bias" in t,
        )
        validate_tensors(g, hp)
        return hp


class _KeyReader:
    """{arch}.* keys read through GGUFFile.get with the GGUF type llama.cpp's load_hparams reads them as:
    UINT32 for counts and lengths (get_key<uint32_t>), FLOAT32 for numbers (get_key<float>), STRING;
    per-layer counts as get_key_or_arr (a UINT32, or an n_layer array of INT32/UINT32)."""

    def __init__(self, g: GGUFFile, arch: str):
        self.g, self.arch = g, arch
        self.n_layer = 0  # set once block_count is read and checked, for the per-layer keys

    def integer(self, template, default=REQUIRED, per_layer=False) -> int:
        k = template.format(arch=self.arch)
        if not per_layer:
            return self.g.get(k, VT.UINT32, default)
        values = self.g.get_per_layer(k, self.n_layer, default)  # n_layer: set by from_gguf, checked first
        if any(v != values[0] for v in values):
            raise SynapseError(f"{self.g.path}: key {k} varies per layer ({values[:8]}...), which is not supported")
        return values[0]

    def number(self, template, default=REQUIRED) -> float:
        return self.g.get(template.format(arch=self.arch), VT.FLOAT32, default)

    def string(self, template, default=REQUIRED) -> str:
        return self.g.get(template.format(arch=self.arch), VT.STRING, default)

    def read(self, k) -> int | float | str:
        """The value of an architecture's key k (synapse_nb.arch.recipe.Key)."""
        return getattr(self, k.kind)(k.template, k.default)


def expected_tensors(hp: HParams) -> dict[str, tuple[tuple[int, ...], bool]]:
    """name -> (shape in numpy order, required) for every tensor the model may have: its
    architecture's TENSORS (synapse_nb.arch), global ones first, then layer by layer; a tensor
    whose `when` flag is unset is left out (not expected: refused when present)."""
    d = dims(hp)
    glob, per_layer = [], []
    for t in ARCHS[hp.arch].TENSORS:
        if t.when is None or getattr(hp, t.when):
            (per_layer if t.name.startswith("blk.{i}.") else glob).append(t)
    exp = {t.name: (tuple(d[n] for n in t.shape), t.need == NEEDED) for t in glob}
    for i in range(hp.n_layer):
        exp.update({t.name.format(i=i): (tuple(d[n] for n in t.shape), t.need == NEEDED) for t in per_layer})
    return exp


def validate_tensors(g: GGUFFile, hp: HParams) -> None:
    """Check that g has every required tensor of hp.arch, each with the expected shape, and nothing else.

    Shapes are numpy order (GGUF ne reversed): token_embd/output (n_vocab, n_embd),
    attn_q (n_head*head_dim_k, n_embd), attn_k (n_head_kv*head_dim_k, n_embd),
    attn_v (n_head_kv*head_dim_v, n_embd), attn_output (n_embd, n_head*head_dim_v),
    ffn_gate/ffn_up (n_ff, n_embd), ffn_down (n_embd, n_ff), norms (n_embd,),
    biases (n_out,), rope_freqs (n_rot/2,).
    Raises SynapseError naming the file and the tensor: missing, wrong shape
    (expected and found), a ggml type without kernels (WEIGHT_TYPES; 1-D tensors
    VECTOR_TYPES), present in some layers only, or not used by the arch
    (llama.cpp likewise refuses files with extra tensors: "wrong number of tensors").
    """
    exp = expected_tensors(hp)
    for name, (shape, required) in exp.items():
        t = g.tensors.get(name)
        if t is None:
            if required:
                raise SynapseError(f"{g.path}: missing tensor {name} (arch {hp.arch})")
            continue
        if t.shape != shape:
            raise SynapseError(
                f"{g.path}: tensor {name} has shape {list(t.shape)}, expected {list(shape)} (numpy order, outermost first)"
            )
        allowed = VECTOR_TYPES if len(shape) == 1 else WEIGHT_TYPES
        if t.ggml_type.name not in allowed:
            raise SynapseError(
                f"{g.path}: tensor {name} has ggml type {t.ggml_type.name}, which is not supported "
                f"(supported: {', '.join(sorted(allowed))})"
            )
    extra = [n for n in g.tensors if n not in exp]
    if extra:
        raise SynapseError(
            f"{g.path}: tensor {show(extra[0])} is not used by arch {hp.arch} "
            f"(or is present in some layers only){f' (+{len(extra) - 1} more)' if len(extra) > 1 else ''}"
        )
