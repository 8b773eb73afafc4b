"""synapse_nb: decoding and serving Llama-family GGUF models with Numba kernels, as llama.cpp's CPU backend.

Modules, one concern each:
  errors      SynapseError, the one exception class users see
  gguf_file   memory-mapped GGUF reader (header, key/values, tensor table)
  gguf_spec   the GGUF format's constants (ggml types, value types, keys), as gguf-py's
  hparams     HParams, a frozen dataclass read from GGUF keys
  arch/       one module per architecture: its extra keys, tensors and block recipe (ARCHS)
  models      models.txt: the real models we test on, and fetching them
  formats     ggml block formats: layouts and NumPy references
  kernels/    Numba kernels: activation quantizers, dots, matvec/matmul, attention
  model       the Llama-family graph (Model, forward)
  state       a sequence's state: the F16 KV cache, the forward's activation buffers
  session     Session: one sequence's prefill/decode loop, and its arguments' checks
  checks      prefill_check: batched prefill against token-by-token decoding, bit for bit
  compilation/  the kernels' warm-up, its forwards, and the second process of a cold warm-up
  engine      the layer every mode calls: load by name or path, session, warm-up, generation
  options     the one table of a run's parameters (flags, batch keys, HTTP fields, ranges, defaults)
  timings     the one timings dict of a generation
  parallel    ParallelSession: many sequences per forward, each bit-identical to running alone
  api         Llama: llama-cpp-python's API (completions, chat) over a ParallelSession
  server/     the OpenAI-compatible HTTP server (FastAPI on uvicorn) and its chat page
  decode_threads  a decode step's thread count, from its measured time
  tokenizer/  BPE and SentencePiece tokenizers read from the GGUF vocabulary
  sampling    Sampler: llama.cpp's sampler chain (temp, top-k/p, min-p, ...) token for token
  grammar/    GBNF grammars and JSON schemas as llama.cpp: parser, matcher, schema conversion
  chat        chat templates rendered as llama.cpp, conversations on one KV cache
  perplexity  perplexity and KL divergence as llama-perplexity computes them
  jit         Numba process setup: the compile notice's watch, llama-decode's fast_start
"""

from .errors import SynapseError

__all__ = ["SynapseError", "Sampler", "Session", "ParallelSession", "Llama", "load_model", "load_tokenizer",
           "perplexity", "warmup"]
__version__ = "0.1.0"


def load_model(path):
    """Load a GGUF model given its path or a models.txt name; see synapse_nb.engine.load_model.

    Raises SynapseError when the file is missing (or the name not fetched) or unreadable.
    """
    from .engine import load_model as _load

    return _load(path)


def load_tokenizer(path):
    """Load the tokenizer of a GGUF file; see synapse_nb.tokenizer.load_tokenizer."""
    from .tokenizer import load_tokenizer as _load

    return _load(path)


def __getattr__(name):
    # Sampler is imported on first use: `import synapse_nb` stays free of numpy/Numba imports.
    if name == "Sampler":
        from .sampling import Sampler

        return Sampler
    if name == "ParallelSession":
        from .parallel import ParallelSession

        return ParallelSession
    if name == "Llama":
        from .api import Llama

        return Llama
    if name == "Session":  # synapse_nb.session: prefill/decode on a KV cache
        from .session import Session

        return Session
    if name == "warmup":  # synapse_nb.compilation.warmup: the kernels' warm-up
        from .compilation.warmup import warmup

        return warmup
    # synapse_nb.perplexity is the submodule, made callable (its __call__ is perplexity.perplexity):
    # a function of that name here would be replaced by the submodule as soon as it is imported.
    # Imported on first use, so that importing synapse_nb stays free of Numba.
    if name == "perplexity":
        import importlib

        return importlib.import_module(".perplexity", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
