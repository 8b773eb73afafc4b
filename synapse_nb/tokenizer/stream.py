"""Streaming detokenization that never emits a broken UTF-8 character.

A token's piece can end in the middle of a multi-byte character (byte tokens <0xE4>,
or BPE tokens holding part of an emoji). The decoder keeps such an incomplete tail
until the bytes that complete it arrive; bytes that can never form a valid character
become U+FFFD, exactly where decoding the whole byte string with errors="replace" puts
them, so the concatenation of everything `push` and `flush` return equals
detokenize(all ids).
"""

from __future__ import annotations

import codecs


class StreamDecoder:
    """Incremental token -> text decoder.

    push(token_id) -> str: the newly complete text (possibly "").
    flush() -> str: whatever is held back, incomplete bytes as U+FFFD; call at the end.
    `special` is passed to token_to_piece (render control tokens or not).
    """

    def __init__(self, tokenizer, special: bool = True):
        self._tok = tokenizer
        self._special = special
        self._dec = codecs.getincrementaldecoder("utf-8")("replace")

    def push(self, token_id: int) -> str:
        return self._dec.decode(self._tok.token_to_piece(token_id, self._special))

    def push_bytes(self, data: bytes) -> str:
        return self._dec.decode(data)

    def flush(self) -> str:
        return self._dec.decode(b"", final=True)

    @property
    def pending(self) -> bytes:
        """Bytes held back (an incomplete character)."""
        return self._dec.getstate()[0]
