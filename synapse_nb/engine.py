"""The engine layer every mode calls: load a model by name or path, its Session and warm-up.

Completion, chat, batch, perplexity and the server (synapse_nb.api) load through here, so that a
model is found, checked and warmed up one way whatever the mode.
"""

from __future__ import annotations

from .model import Model
from .model import load_model as _load_gguf
from .models import resolve_model


def load_model(name_or_path) -> Model:
    """Load a GGUF model given its path or a models.txt name (synapse_nb.models.resolve_model,
    then synapse_nb.model.load_model). Raises SynapseError when the file is missing (or the name
    not fetched) or unreadable."""
    return _load_gguf(resolve_model(name_or_path))
