"""The one table of a run's parameters: each one's names in every mode, its type, range and default.

A parameter reaches the sampler under three names: llama.cpp's command-line flag (llama-decode,
generated from this table by cli/), a batch line's key (synapse_nb.batch; the Sampler keyword,
common_params_sampling's name) and an HTTP request's field (OpenAI / llama-server's name,
synapse_nb.api and synapse_nb.server). The Sampler checks its integer parameters against the
ranges here, which are those of the kernels' types (llama.cpp's int32_t; the seed a uint32_t,
-1 meaning random), so a value out of range is refused where it is given, never wrapped.

RUN holds the run's own integer parameters (tokens to generate, context, batch, threads, chunks)
with the ranges of the types they reach (llama.cpp's int32_t), so that every integer option of
every mode has one.

Pure Python (no NumPy): the CLI builds its options from this module at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass

# Tokens per forward of a prefill: llama.cpp's default n_ubatch (its physical batch). Results do not
# depend on it (each row's operations are those of a single token); larger batches spread each
# forward's fixed costs (a parallel region per kernel and layer, the attention's per-item setup) over
# more tokens: Gemma 3 270M prefill of 512 tokens +9 %, SmolLM2 +11 %, Qwen2.5 0.5B +5 % against 64
# (medians of interleaved rounds, 2 threads).
DEFAULT_N_BATCH = 512

I32_MIN, I32_MAX = -2**31, 2**31 - 1  # llama.cpp's int32_t parameters: the kernels' range
U32_MAX = 2**32 - 1


@dataclass(frozen=True)
class Param:
    """One sampling parameter.

    key: the Sampler keyword and batch line key; flags: llama.cpp's command-line flags (short
    first); field: the HTTP request field, None when the request's form differs (logit_bias);
    kind: "float", "int" or "bias" (TOKEN(+|-)BIAS on the command line, repeatable); default:
    llama.cpp's (common_params_sampling); lo, hi: an int's range (inclusive); note: said after
    the bound in a range error (e.g. " (-1: random)"); help: the --help text (the default is
    appended in brackets).
    """

    key: str
    flags: tuple
    field: str | None
    kind: str
    default: object
    help: str
    lo: int | None = None
    hi: int | None = None
    note: str = ""
    metavar: str = "N"

    @property
    def flag(self) -> str:
        """The flags as one name, as errors give it: "-s/--seed"."""
        return "/".join(self.flags)


SAMPLING = (
    Param("temp", ("--temp",), "temperature", "float", 0.8, "Sampling temperature"),
    Param("top_k", ("--top-k",), "top_k", "int", 40, "Top-k sampling, 0 = off", I32_MIN, I32_MAX),
    Param("top_p", ("--top-p",), "top_p", "float", 0.95, "Top-p sampling, 1.0 = off"),
    Param("min_p", ("--min-p",), "min_p", "float", 0.05, "Min-p sampling, 0.0 = off"),
    Param("typical_p", ("--typical",), "typical_p", "float", 1.0, "Locally typical sampling p, 1.0 = off"),
    Param("top_n_sigma", ("--top-nsigma",), "top_n_sigma", "float", -1.0, "Top-n-sigma sampling, -1 = off"),
    Param("xtc_probability", ("--xtc-probability",), "xtc_probability", "float", 0.0, "XTC probability, 0.0 = off"),
    Param("xtc_threshold", ("--xtc-threshold",), "xtc_threshold", "float", 0.1, "XTC threshold, > 0.5 = off"),
    Param("dynatemp_range", ("--dynatemp-range",), "dynatemp_range", "float", 0.0,
          "Dynamic temperature range, 0.0 = off"),
    Param("dynatemp_exponent", ("--dynatemp-exp",), "dynatemp_exponent", "float", 1.0, "Dynamic temperature exponent"),
    Param("repeat_penalty", ("--repeat-penalty",), "repeat_penalty", "float", 1.0, "Repeat penalty, 1.0 = off"),
    Param("penalty_last_n", ("--repeat-last-n",), "repeat_last_n", "int", 64,
          "Last N tokens (prompt included) to penalize, 0 = off", 0, I32_MAX, " (0 = off)"),
    Param("presence_penalty", ("--presence-penalty",), "presence_penalty", "float", 0.0, "Presence penalty, 0.0 = off"),
    Param("frequency_penalty", ("--frequency-penalty",), "frequency_penalty", "float", 0.0,
          "Frequency penalty, 0.0 = off"),
    Param("min_keep", ("--min-keep",), "min_keep", "int", 0, "Minimum candidates each sampler keeps", 0, I32_MAX),
    Param("seed", ("-s", "--seed"), "seed", "int", -1, "RNG seed, -1 = random (the seed used is printed on stderr)",
          -1, U32_MAX, " (-1: random)", "SEED"),
    Param("logit_bias", ("-l", "--logit-bias"), None, "bias", (),
          "Add BIAS to TOKEN's logit, e.g. 15043+1 or 15043-inf (repeatable)", metavar="TOKEN(+|-)BIAS"),
)
BY_KEY = {p.key: p for p in SAMPLING}
KEYS = tuple(p.key for p in SAMPLING)  # a batch line's sampling keys
FIELDS = {p.field: p.key for p in SAMPLING if p.field is not None}  # HTTP field -> key

# Flags of samplers not implemented (refused rather than ignored; the CLI accepts them hidden, to
# say so by name): key -> (flag, its "disabled" value, which is accepted), or None for no such value.
REFUSED = {
    "dry_multiplier": ("--dry-multiplier", "0"), "dry_base": ("--dry-base", None),
    "dry_allowed_length": ("--dry-allowed-length", None), "dry_penalty_last_n": ("--dry-penalty-last-n", None),
    "dry_sequence_breaker": ("--dry-sequence-breaker", None), "mirostat": ("--mirostat", "0"),
    "mirostat_lr": ("--mirostat-lr", None), "mirostat_ent": ("--mirostat-ent", None),
}
# The DRY parameters' defaults (common_params_sampling): the Sampler accepts them, unused.
DRY_DEFAULTS = {"dry_multiplier": 0.0, "dry_base": 1.75, "dry_allowed_length": 2, "dry_penalty_last_n": 64}

# The run's integer parameters (not the sampler's). default: the CLI's (None: decided by the mode).
RUN = (
    Param("n_predict", ("-n", "--n-predict"), "n_predict", "int", 128,
          "Tokens to generate; -1: until end of generation or a full context.", -1, I32_MAX, " (-1: no limit)"),
    Param("n_ctx", ("-c", "--ctx-size"), None, "int", None,
          "Context size n_ctx in tokens, 0 = the model's n_ctx_train [default: min(n_ctx_train, 4096)].", 0, I32_MAX),
    Param("n_batch", ("-b", "--batch-size"), None, "int", DEFAULT_N_BATCH, "Prefill batch size: tokens per forward.", 1,
          I32_MAX),
    Param("n_threads", ("-t", "--threads"), None, "int", None, "Threads, <= 0 = all cores [default: all cores].",
          I32_MIN, I32_MAX),
    Param("chunks", ("--chunks",), None, "int", None, "Perplexity: at most N chunks [default: all].", I32_MIN, I32_MAX),
)
