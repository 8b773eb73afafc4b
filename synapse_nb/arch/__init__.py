"""One module per architecture: what each reads, needs and computes, in one place.

ARCHS maps general.architecture to its module (llama, qwen2, mistral3, gemma3). Each module
gives NAME, RECIPE (arch.recipe.Recipe), KEYS, TENSORS and derive (arch.recipe describes them);
hparams.HParams.from_gguf reads a model through its architecture's module and the rest of the
decoder reads only HParams. Adding an architecture whose blocks are a new recipe of the existing
steps is one new module here, registered below, plus its fixtures.
"""

from . import gemma3, llama, mistral3, qwen2

ARCHS = {m.NAME: m for m in (llama, mistral3, qwen2, gemma3)}
