"""The constants of the GGUF format that synapse_nb reads, as gguf-py (gguf.constants) defines them.

The same names and values as the gguf package (0.19): the ggml type and value type enums, block
sizes, the magic and default alignment, and the metadata keys the loader reads. Kept here so that
loading a model does not import the gguf package, whose import (its writer, vocab and metadata
modules, with yaml and certifi) costs 45-75 ms of a 0.6 s start; tests/test_gguf_file.py checks
every entry against gguf's own.
"""

from enum import IntEnum

GGUF_MAGIC = 0x46554747  # "GGUF"
GGUF_DEFAULT_ALIGNMENT = 32


class GGMLQuantizationType(IntEnum):
    """ggml_type: the storage type of a tensor."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q8_1 = 9
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15
    IQ2_XXS = 16
    IQ2_XS = 17
    IQ3_XXS = 18
    IQ1_S = 19
    IQ4_NL = 20
    IQ3_S = 21
    IQ2_S = 22
    IQ4_XS = 23
    I8 = 24
    I16 = 25
    I32 = 26
    I64 = 27
    F64 = 28
    IQ1_M = 29
    BF16 = 30
    TQ1_0 = 34
    TQ2_0 = 35
    MXFP4 = 39
    NVFP4 = 40
    Q1_0 = 41


class GGUFValueType(IntEnum):
    """gguf_type: the type of a metadata value."""

    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


# ggml type -> (values per block, bytes per block)
GGML_QUANT_SIZES: dict[GGMLQuantizationType, tuple[int, int]] = {
    GGMLQuantizationType.F32: (1, 4),
    GGMLQuantizationType.F16: (1, 2),
    GGMLQuantizationType.Q4_0: (32, 18),
    GGMLQuantizationType.Q4_1: (32, 20),
    GGMLQuantizationType.Q5_0: (32, 22),
    GGMLQuantizationType.Q5_1: (32, 24),
    GGMLQuantizationType.Q8_0: (32, 34),
    GGMLQuantizationType.Q8_1: (32, 40),
    GGMLQuantizationType.Q2_K: (256, 84),
    GGMLQuantizationType.Q3_K: (256, 110),
    GGMLQuantizationType.Q4_K: (256, 144),
    GGMLQuantizationType.Q5_K: (256, 176),
    GGMLQuantizationType.Q6_K: (256, 210),
    GGMLQuantizationType.Q8_K: (256, 292),
    GGMLQuantizationType.IQ2_XXS: (256, 66),
    GGMLQuantizationType.IQ2_XS: (256, 74),
    GGMLQuantizationType.IQ3_XXS: (256, 98),
    GGMLQuantizationType.IQ1_S: (256, 50),
    GGMLQuantizationType.IQ4_NL: (32, 18),
    GGMLQuantizationType.IQ3_S: (256, 110),
    GGMLQuantizationType.IQ2_S: (256, 82),
    GGMLQuantizationType.IQ4_XS: (256, 136),
    GGMLQuantizationType.I8: (1, 1),
    GGMLQuantizationType.I16: (1, 2),
    GGMLQuantizationType.I32: (1, 4),
    GGMLQuantizationType.I64: (1, 8),
    GGMLQuantizationType.F64: (1, 8),
    GGMLQuantizationType.IQ1_M: (256, 56),
    GGMLQuantizationType.BF16: (1, 2),
    GGMLQuantizationType.TQ1_0: (256, 54),
    GGMLQuantizationType.TQ2_0: (256, 66),
    GGMLQuantizationType.MXFP4: (32, 17),
    GGMLQuantizationType.NVFP4: (64, 36),
    GGMLQuantizationType.Q1_0: (128, 18),
}


class Keys:
    """Metadata keys (str.format templates with {arch} where per architecture)."""

    class Attention:
        HEAD_COUNT = "{arch}.attention.head_count"
        HEAD_COUNT_KV = "{arch}.attention.head_count_kv"
        KEY_LENGTH = "{arch}.attention.key_length"
        LAYERNORM_RMS_EPS = "{arch}.attention.layer_norm_rms_epsilon"
        SLIDING_WINDOW = "{arch}.attention.sliding_window"
        TEMPERATURE_SCALE = "{arch}.attention.temperature_scale"
        VALUE_LENGTH = "{arch}.attention.value_length"

    class General:
        ALIGNMENT = "general.alignment"
        ARCHITECTURE = "general.architecture"
        NAME = "general.name"

    class LLM:
        BLOCK_COUNT = "{arch}.block_count"
        CONTEXT_LENGTH = "{arch}.context_length"
        EMBEDDING_LENGTH = "{arch}.embedding_length"
        FEED_FORWARD_LENGTH = "{arch}.feed_forward_length"
        VOCAB_SIZE = "{arch}.vocab_size"

    class Rope:
        DIMENSION_COUNT = "{arch}.rope.dimension_count"
        FREQ_BASE = "{arch}.rope.freq_base"
        SCALING_ATTN_FACTOR = "{arch}.rope.scaling.attn_factor"
        SCALING_FACTOR = "{arch}.rope.scaling.factor"
        SCALING_ORIG_CTX_LEN = "{arch}.rope.scaling.original_context_length"
        SCALING_TYPE = "{arch}.rope.scaling.type"
        SCALING_YARN_BETA_FAST = "{arch}.rope.scaling.yarn_beta_fast"
        SCALING_YARN_BETA_SLOW = "{arch}.rope.scaling.yarn_beta_slow"
        SCALING_YARN_LOG_MUL = "{arch}.rope.scaling.yarn_log_multiplier"

    class Tokenizer:
        ADD_BOS = "tokenizer.ggml.add_bos_token"
        ADD_EOS = "tokenizer.ggml.add_eos_token"
        ADD_PREFIX = "tokenizer.ggml.add_space_prefix"
        BOS_ID = "tokenizer.ggml.bos_token_id"
        EOM_ID = "tokenizer.ggml.eom_token_id"
        EOS_ID = "tokenizer.ggml.eos_token_id"
        EOT_ID = "tokenizer.ggml.eot_token_id"
        FIM_MID_ID = "tokenizer.ggml.fim_mid_token_id"
        FIM_PAD_ID = "tokenizer.ggml.fim_pad_token_id"
        FIM_PRE_ID = "tokenizer.ggml.fim_pre_token_id"
        FIM_REP_ID = "tokenizer.ggml.fim_rep_token_id"
        FIM_SEP_ID = "tokenizer.ggml.fim_sep_token_id"
        FIM_SUF_ID = "tokenizer.ggml.fim_suf_token_id"
        LIST = "tokenizer.ggml.tokens"
        MASK_ID = "tokenizer.ggml.mask_token_id"
        MERGES = "tokenizer.ggml.merges"
        MIDDLE_ID = "tokenizer.ggml.middle_token_id"
        MODEL = "tokenizer.ggml.model"
        PAD_ID = "tokenizer.ggml.padding_token_id"
        PRE = "tokenizer.ggml.pre"
        PREFIX_ID = "tokenizer.ggml.prefix_token_id"
        SCORES = "tokenizer.ggml.scores"
        SEP_ID = "tokenizer.ggml.seperator_token_id"
        SUFFIX_ID = "tokenizer.ggml.suffix_token_id"
        TOKEN_TYPE = "tokenizer.ggml.token_type"
        UNK_ID = "tokenizer.ggml.unknown_token_id"
