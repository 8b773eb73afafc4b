"""TokenIndex: token text -> id for a whole vocabulary, without a Python object per token.

llama.cpp keeps `token_to_id` as an unordered_map<std::string, llama_token>. A Python dict of
Gemma 3's 262,144 tokens, with the list of their str, took 37 MiB and 0.35 s to build at every
start; here all tokens are one int32 array of their code points (a GGUF's token array is decoded
as one buffer, never as 262k str objects) and an open-addressing hash table of their ids (int32,
at least twice the tokens' count, linear probing), built by one compiled loop: ~10 MiB and a few
ms for Gemma 3.

Keys are compared as code point sequences, which is exactly Python's str equality (a GGUF string's
invalid byte is the surrogate escape U+DC80..U+DCFF the reader decoded it as, on both sides).
The compiled parts (the strict UTF-8 decode, the table, its lookup cp_find) are in merge.py, with
SentencePiece's merge loop that inlines cp_find for every candidate pair, as llama.cpp's
llm_tokenizer_spm_session::try_add_bigram looks each one up in token_to_id.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from ..gguf_file import StringArray
from .merge import build_cp_table, find_many, strings_code_points, table_size


def code_points(strs: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(cps int32 [total], offsets int64 [n + 1]): the code points of every string, back to back
    (surrogates as themselves), and where each string starts."""
    # writable, as every array the kernels take: a read-only one is another Numba type (a second
    # compile of each kernel it reaches on a first run)
    cps = np.frombuffer(bytearray("".join(strs).encode("utf-32-le", "surrogatepass")), np.int32)
    off = np.zeros(len(strs) + 1, np.int64)
    np.cumsum(np.fromiter(map(len, strs), np.int64, len(strs)), out=off[1:])
    return cps, off


def _array_code_points(arr: StringArray):
    """code_points of a GGUF string array, read from the mapped file by one compiled loop, or
    None when a string is not valid UTF-8 (the caller decodes them as the reader does: an
    invalid byte becomes its surrogate escape)."""
    buf, bounds = arr.raw()
    cps, off, ok = strings_code_points(buf, bounds)
    return (cps, off) if ok else None


def sequence_code_points(strs) -> tuple[np.ndarray, np.ndarray]:
    """code_points of a list of str or a gguf_file.StringArray (read from the file when every
    string is valid UTF-8; else, as for a list, from the str the reader decodes)."""
    got = _array_code_points(strs) if isinstance(strs, StringArray) else None
    return got if got is not None else code_points(list(strs))


class TokenIndex(Mapping):
    """A read-only mapping token text (str) -> id (int) over all tokens of a vocabulary.

    tokens: the texts in id order (a list of str, or a gguf_file.StringArray, read from its bytes
    without making str objects). Iterating gives the texts in id order. Lookups of a non-str give
    None / KeyError, as a dict of str would. Attributes: cps (int32 [total]), offsets (int64 [n +
    1]) the tokens' code points; table (int32) the hash table (see merge.cp_find); duplicate: (i, j), the
    first two ids with the same text, or None.
    """

    __slots__ = ("_texts", "cps", "offsets", "table", "duplicate")

    def __init__(self, tokens):
        self.cps, self.offsets = sequence_code_points(tokens)
        self._texts = tokens
        self.table = np.full(table_size(len(self)), -1, np.int32)
        a, b = build_cp_table(self.cps, self.offsets, self.table)
        self.duplicate = (int(a), int(b)) if a >= 0 else None

    def get(self, text, default=None):
        if not isinstance(text, str):
            return default
        q = np.frombuffer(bytearray(text.encode("utf-32-le", "surrogatepass")), np.int32)
        i = self.find(q, np.zeros(1, np.int64), np.full(1, q.shape[0], np.int64))[0]
        return default if i < 0 else int(i)

    def ids(self, texts: list[str]) -> list[int]:
        """The id of each text, -1 for a text that is not a token (one compiled call for all)."""
        if not texts:
            return []
        q, off = code_points(texts)
        return self.find(q, off[:-1], off[1:]).tolist()

    def find(self, q: np.ndarray, start: np.ndarray, end: np.ndarray) -> np.ndarray:
        """int64 [n]: the id of each string q[start[k]:end[k]] given as code points (q int32 [m],
        writable; start, end int64 [n]), -1 for one that is not a token or is empty."""
        out = np.empty(start.shape[0], np.int64)
        find_many(self.table, self.cps, self.offsets, q, np.ascontiguousarray(start, np.int64),
                  np.ascontiguousarray(end, np.int64), out)
        return out

    def __getitem__(self, text) -> int:
        i = self.get(text)
        if i is None:
            raise KeyError(text)
        return i

    def __contains__(self, text) -> bool:
        return self.get(text) is not None

    def __len__(self) -> int:
        return self.offsets.shape[0] - 1

    def __iter__(self):
        return iter(self._texts)

    def lengths(self) -> np.ndarray:
        """Each token's length in code points, int64 [n]."""
        return np.diff(self.offsets)
