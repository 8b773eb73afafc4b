"""Streaming detokenization that never emits a broken UTF-8 character.

A token's piece can end in the middle of a multi-byte character (byte tokens <0xE4>,
or BPE tokens holding part of an emoji). The decoder keeps such an incomplete tail
until the bytes that complete it arrive; bytes that can never form a valid character
become U+FFFD, exactly where decoding the whole byte string with errors="replace" puts
them, so the concatenation of everything `push` and `flush` return, decoded, equals
detokenize(all ids).
"""

from __future__ import annotations

import codecs
import numbers


class StreamDecoder:
    """Incremental token -> UTF-8 decoder.

    push(token) -> bytes: `token` is a token id (its piece is taken with
        token_to_piece(id, special)) or a piece (bytes) already looked up; returns the
        newly completed characters as valid UTF-8 (possibly b"").
    flush() -> bytes: whatever is held back, an incomplete tail as U+FFFD; call at the end.
    pending: the bytes held back.
    """

    def __init__(self, tokenizer=None, special: bool = True):
        self._tok = tokenizer
        self._special = special
        self._dec = codecs.getincrementaldecoder("utf-8")("replace")

    def push(self, token) -> bytes:
        if isinstance(token, (bytes, bytearray, memoryview)):
            piece = bytes(token)
        elif isinstance(token, numbers.Integral):
            if self._tok is None:
                raise TypeError("StreamDecoder without a tokenizer takes pieces (bytes)")
            piece = self._tok.token_to_piece(int(token), self._special)
        else:
            raise TypeError(f"push: expected a token id or bytes, not {type(token).__name__}")
        return self._dec.decode(piece).encode("utf-8")

    def flush(self) -> bytes:
        return self._dec.decode(b"", final=True).encode("utf-8")

    @property
    def pending(self) -> bytes:
        """Bytes held back (an incomplete character)."""
        return self._dec.getstate()[0]
