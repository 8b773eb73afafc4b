"""Tokenizers read from a GGUF vocabulary: byte-level BPE and SentencePiece, as llama.cpp.

load_tokenizer(path_or_GGUFFile) -> Tokenizer with
  tokenize(text, add_special, parse_special) -> list[int]
  token_to_piece(id, special) -> bytes
  detokenize(ids, special=True) -> str
  stream_decoder(special=True) -> StreamDecoder (push(id or piece) -> bytes of whole
    UTF-8 characters, flush() -> bytes)
  bos_id, eos_id, eog_ids, n_vocab

Modules: vocab (GGUF keys -> tokens, attributes, special ids), pretokenize (BPE word
splitting), merge (Numba merge kernel), bpe, spm, stream, core (Tokenizer).
"""

from __future__ import annotations

from pathlib import Path

from .core import Tokenizer
from .stream import StreamDecoder

__all__ = ["Tokenizer", "StreamDecoder", "load_tokenizer"]


def load_tokenizer(source) -> Tokenizer:
    """The tokenizer of a GGUF model or vocabulary-only GGUF file.

    source: a path (str / Path) or an already opened synapse_nb.gguf_file.GGUFFile.
    Raises SynapseError (naming the file) for unreadable files, missing or invalid
    tokenizer.ggml.* keys, or unsupported tokenizer types.
    """
    from ..gguf_file import open_gguf

    if isinstance(source, (str, Path)):
        g = open_gguf(source)
    else:
        g = source
    return Tokenizer.from_kv(g.meta)
