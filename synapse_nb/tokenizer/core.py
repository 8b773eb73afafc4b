"""Tokenizer: text <-> token ids for a GGUF vocabulary, identical to llama.cpp.

Reproduces llama-vocab.cpp `llama_vocab::impl::tokenize` (special-token partition by
`tokenizer_st_partition`, BOS/EOS insertion, the SPM and BPE sessions) and
`token_to_piece`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from ..gguf_spec import GGUFValueType as VT

from ..errors import SynapseError
from ..gguf_file import Metadata
from .bpe import BPE
from .spm import SPM
from .stream import StreamDecoder
from .vocab import (ATTR_CONTROL, ATTR_LSTRIP, ATTR_RSTRIP, ATTR_UNKNOWN, BPE as TYPE_BPE,
                    SPM as TYPE_SPM, Vocab)

_C_SPACE = " \t\n\x0b\x0c\r"  # isspace() in the "C" locale: what lstrip/rstrip remove
_SURROGATE = re.compile("[\ud800-\udfff]")
_PREFIX = 3  # special tokens are first looked for by their first characters, per group


class Tokenizer:
    """llama.cpp's tokenizer for one vocabulary (SentencePiece or byte-level BPE).

    Build with load_tokenizer(path or GGUFFile) or Tokenizer.from_kv(kv).
    Attributes: n_vocab, bos_id, eos_id, eot_id (int or None), eog_ids (frozenset),
    add_bos, add_eos (bool), type ("spm" or "bpe"), vocab (Vocab), chat_template (the GGUF's
    tokenizer.chat_template, str or None), source_name (the file, for messages).
    """

    def __init__(self, vocab: Vocab, merges=None):
        self.vocab = vocab
        self.type = vocab.type
        if vocab.type == TYPE_BPE:
            self._bpe = BPE(vocab, merges if merges is not None else [])
            self._spm = None
        else:
            self._spm = SPM(vocab)
            self._bpe = None
        # special tokens split out before tokenizing: (id, text, lstrip, rstrip), longest
        # first; user-defined always, control/unknown only with parse_special
        self._specials_all = []
        self._specials_user = []
        for i in vocab.special_tokens:
            a = int(vocab.attrs[i])
            t = vocab.tokens[i]
            entry = (i, t, bool(a & ATTR_LSTRIP), bool(a & ATTR_RSTRIP), t[:_PREFIX])
            self._specials_all.append(entry)
            if not a & (ATTR_CONTROL | ATTR_UNKNOWN):
                self._specials_user.append(entry)
        self.chat_template: str | None = None  # the GGUF key tokenizer.chat_template (Jinja source)
        self.source_name = ""  # the file, for error messages

    @classmethod
    def from_kv(cls, kv, where: str = "") -> "Tokenizer":
        """Build from GGUF key/values: a gguf_file.Metadata (GGUFFile.meta, with the file's GGUF
        types), or a plain dict as GGUFFile.kv (string arrays as list[str], numeric arrays as
        numpy; types inferred by Metadata.from_values). `where` prefixes error messages of a
        plain dict (e.g. "model.gguf: ").
        Raises SynapseError for missing/invalid tokenizer keys (wrong GGUF type included) or
        unsupported types."""
        meta = kv if isinstance(kv, Metadata) else Metadata.from_values(kv, where)
        vocab = Vocab(meta)
        merges = None
        if vocab.type == TYPE_BPE:  # llama.cpp: gguf_get_arr_str on every element: ARRAY of STRING
            merges = meta.get_array("tokenizer.ggml.merges", VT.STRING)
        tok = cls(vocab, merges)
        tok.source_name = meta.where[:-2] if meta.where.endswith(": ") else meta.where
        # llama.cpp reads it as a string (llama_model_chat_template); another type is refused
        tok.chat_template = meta.get("tokenizer.chat_template", VT.STRING, default=None)
        return tok

    # --- properties ---
    @property
    def n_vocab(self) -> int:
        return self.vocab.n_vocab

    @property
    def bos_id(self):
        return self.vocab.bos_id

    @property
    def eos_id(self):
        return self.vocab.eos_id

    @property
    def eot_id(self):
        return self.vocab.eot_id

    @property
    def eog_ids(self) -> frozenset:
        return self.vocab.eog_ids

    @property
    def add_bos(self) -> bool:
        return self.vocab.add_bos

    @property
    def add_eos(self) -> bool:
        return self.vocab.add_eos

    def is_eog(self, token: int) -> bool:
        """True for end-of-generation tokens (llama_vocab_is_eog)."""
        return token in self.vocab.eog_ids

    # --- tokenize ---
    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """llama_tokenize(text, add_special, parse_special) -> token ids.

        add_special: insert BOS/EOS as the vocabulary asks (tokenizer.ggml.add_bos_token /
        add_eos_token, else llama.cpp's per-type defaults). parse_special: also turn the
        texts of control tokens (e.g. <|im_start|>) into those tokens; user-defined
        tokens are always matched. `text` may be bytes (decoded as UTF-8, invalid bytes
        kept as surrogate escapes).
        """
        if isinstance(text, (bytes, bytearray)):
            text = bytes(text).decode("utf-8", "surrogateescape")
        if not isinstance(text, str):
            raise TypeError(f"tokenize: text must be str, not {type(text).__name__}")
        v = self.vocab
        frags = self._partition(text, parse_special)
        out: list[int] = []
        if add_special and v.add_bos:
            out.append(v.bos_id)
        if self.type == TYPE_SPM:
            texts = []
            layout = []  # index into texts, or ~token_id for a special token
            prev_special = True  # llama.cpp: prefix with a space if first or after a special
            for f in frags:
                if isinstance(f, str):
                    if v.add_space_prefix and prev_special:
                        f = " " + f
                    layout.append(len(texts))
                    texts.append(f.replace(" ", "\u2581"))
                    prev_special = False
                else:
                    layout.append(~f)
                    prev_special = True
            pieces = self._spm.tokenize_fragments(texts)
            for k in layout:
                if k >= 0:
                    out += pieces[k]
                else:
                    out.append(~k)
        else:
            for f in frags:
                if isinstance(f, str):
                    if not f.isascii() and _SURROGATE.search(f):
                        # llama.cpp reads invalid UTF-8 as U+FFFD, one per bad byte
                        f = _SURROGATE.sub("\ufffd", f)
                    self._bpe.tokenize_fragment(f, out)
                else:
                    out.append(f)
        if add_special and v.add_eos:
            out.append(v.eos_id)
        return out

    def _partition(self, text: str, parse_special: bool) -> list:
        """tokenizer_st_partition: split `text` around special-token texts.

        Returns str fragments and int token ids in order. Each special token, longest
        first, splits every remaining text fragment at all its occurrences, left to right.
        """
        if not text:
            return []
        frags: list = [text]
        specials = self._specials_all if parse_special else self._specials_user
        present: dict[str, bool] = {}  # prefix -> occurs in text
        for tid, s, lstrip, rstrip, prefix in specials:
            p = present.get(prefix)
            if p is None:
                p = present[prefix] = prefix in text
            if not p or s not in text:
                continue  # fragments are substrings of text
            new: list = []
            for f in frags:
                if not isinstance(f, str):
                    new.append(f)
                    continue
                start = 0
                while True:
                    i = f.find(s, start)
                    if i < 0:
                        break
                    left = f[start:i]
                    if lstrip:
                        left = left.rstrip(_C_SPACE)
                    if left:
                        new.append(left)
                    new.append(tid)
                    start = i + len(s)
                    if rstrip:
                        while start < len(f) and f[start] in _C_SPACE:
                            start += 1
                if start == 0:
                    new.append(f)
                elif start < len(f):
                    new.append(f[start:])
            frags = new
        return frags

    # --- chat ---
    def apply_chat_template(self, messages, add_generation_prompt: bool = True, chat_template: str | None = None,
                            jinja: bool = True) -> str:
        """The conversation rendered as llama.cpp renders it for this vocabulary (see synapse_nb.chat).

        messages: [{"role": str, "content": str}, ...]. add_generation_prompt: end with the
        assistant's header. chat_template: a template's text to use instead of the GGUF's
        tokenizer.chat_template (--chat-template-file). jinja: run the template (llama.cpp --jinja);
        False: llama.cpp's built-in format for the template's family (--no-jinja; ChatML here).
        Returns the prompt text; tokenize it with add_special=True, parse_special=True.
        Raises SynapseError when there is no template, or it fails to parse or render (naming
        the file and the template line).
        """
        from ..chat import apply_chat_template

        return apply_chat_template(self, messages, add_generation_prompt, chat_template=chat_template, jinja=jinja)

    # --- detokenize ---
    def token_to_piece(self, token: int, special: bool = True) -> bytes:
        """llama_token_to_piece(token, lstrip=0, special) -> bytes (see Vocab.token_to_piece).
        Raises SynapseError for an id outside [0, n_vocab)."""
        return self.vocab.token_to_piece(token, special)

    def detokenize(self, ids: Iterable[int], special: bool = True) -> str:
        """Concatenated pieces of `ids`, decoded as UTF-8 with invalid bytes replaced
        by U+FFFD."""
        tp = self.vocab.token_to_piece
        return b"".join(tp(i, special) for i in ids).decode("utf-8", "replace")

    def stream_decoder(self, special: bool = True) -> StreamDecoder:
        """A StreamDecoder: push(id or piece bytes) -> the UTF-8 bytes of the characters
        completed so far, holding back a partial character; flush() at the end."""
        return StreamDecoder(self, special)
