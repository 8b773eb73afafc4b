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
  session     KV cache, prefill/decode loop, prefill check, warmup
  parallel    ParallelSession: many sequences per forward, each bit-identical to running alone
  api         Llama: llama-cpp-python's API (completions, chat) over a ParallelSession
  server/     the OpenAI-compatible HTTP server (FastAPI on uvicorn) and its chat page
  compile_helper  the second process of a cold warm-up
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
    """Load a GGUF model given its path or a models.txt name; see synapse_nb.model.load_model.

    Raises SynapseError when the file is missing (or the name not fetched) or unreadable.
    """
    from .model import load_model as _load
    from .models import resolve_model

    return _load(resolve_model(path))


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
    if name in ("Session", "warmup"):  # synapse_nb.session: KV cache, prefill/decode, kernel warm-up
        from . import session

        return getattr(session, name)
    # synapse_nb.perplexity is the submodule, made callable (its __call__ is perplexity.perplexity):
    # a function of that name here would be replaced by the submodule as soon as it is imported.
    # Imported on first use, so that importing synapse_nb stays free of Numba.
    if name == "perplexity":
        import importlib

        return importlib.import_module(".perplexity", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
