"""The vocabulary read from GGUF `tokenizer.ggml.*` keys, as llama.cpp interprets it.

Reproduces llama-vocab.cpp `llama_vocab::impl::load`: the tokenizer type from
tokenizer.ggml.model ("llama" -> SentencePiece, "gpt2" -> byte-level BPE), per-type
defaults (special ids, add_bos/add_eos, add_space_prefix), token types -> attributes,
special ids from their keys, the text-based detection of EOT/EOM/FIM tokens, the
end-of-generation set (`special_eog_ids`), the special-token list used to split text
(`cache_special_tokens`) and `token_to_piece`.

Where llama.cpp iterates an unordered_map (EOT/FIM auto-detection when several
candidate texts are present, e.g. <|eot_id|> and <|end_of_text|>) its pick depends on
hash order; we take the first text of llama.cpp's list. The EOG set does not depend
on it (every candidate is end-of-generation).
"""

from __future__ import annotations

import numpy as np
from ..gguf_spec import GGUFValueType as VT
from ..gguf_spec import Keys

from ..errors import SynapseError
from ..gguf_file import Metadata, StringArray
from .index import TokenIndex

# llama.h enum llama_token_attr
ATTR_UNDEFINED = 0
ATTR_UNKNOWN = 1 << 0
ATTR_UNUSED = 1 << 1
ATTR_NORMAL = 1 << 2
ATTR_CONTROL = 1 << 3
ATTR_USER_DEFINED = 1 << 4
ATTR_BYTE = 1 << 5
ATTR_NORMALIZED = 1 << 6
ATTR_LSTRIP = 1 << 7
ATTR_RSTRIP = 1 << 8
ATTR_SINGLE_WORD = 1 << 9

# GGUF token types (llama_token_type: UNDEFINED, NORMAL, UNKNOWN, CONTROL, USER_DEFINED,
# UNUSED, BYTE) -> attributes; other values -> UNDEFINED.
_TYPE_TO_ATTR = np.array(
    [ATTR_UNDEFINED, ATTR_NORMAL, ATTR_UNKNOWN, ATTR_CONTROL, ATTR_USER_DEFINED, ATTR_UNUSED,
     ATTR_BYTE], np.int32)

SPM = "spm"
BPE = "bpe"

# Texts that llama.cpp marks as end-of-turn / end-of-generation (llama-vocab.cpp load()).
_EOT_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
              "<|end_of_text|>", "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>",
              "<end_of_utterance>")
_EOM_TEXTS = ("<|eom_id|>",)
_FIM_PRE_TEXTS = ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>",
                  "▁<PRE>", "<|code_prefix|>", "<|prefix|>")
_FIM_SUF_TEXTS = ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>",
                  "▁<SUF>", "<|code_suffix|>", "<|suffix|>")
_FIM_MID_TEXTS = ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>",
                  "▁<MID>", "<|code_middle|>", "<|middle|>")
_FIM_PAD_TEXTS = ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]")
_FIM_REP_TEXTS = ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>")
_FIM_SEP_TEXTS = ("<|file_sep|>",)
_EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>",
              "<|calls|>", "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>",
              "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>", "<end_of_utterance>", "<eos>",
              "<turn|>", "<|tool_response>", "<｜end▁of▁sentence｜>", "[e~[")

# GPT-2 byte <-> unicode table (unicode.cpp unicode_byte_to_utf8_map).
_B2U_LIST: list[str] = [""] * 256


def _init_byte_map() -> None:
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    for b in printable:
        _B2U_LIST[b] = chr(b)
    n = 0
    for b in range(256):
        if not _B2U_LIST[b]:
            _B2U_LIST[b] = chr(256 + n)
            n += 1


_init_byte_map()
BYTE_TO_UNICODE: tuple[str, ...] = tuple(_B2U_LIST)
UNICODE_TO_BYTE: dict[str, int] = {u: b for b, u in enumerate(BYTE_TO_UNICODE)}
# str.translate table turning latin-1-decoded bytes into their GPT-2 characters
BYTE_ENCODE_TABLE: dict[int, str] = {b: u for b, u in enumerate(BYTE_TO_UNICODE)}

def text_bytes(s: str) -> bytes:
    """The exact bytes of a token text (GGUF strings keep invalid bytes as surrogate escapes)."""
    return s.encode("utf-8", "surrogateescape")


def _strtol_hex2(s: str) -> int:
    # strtol(text.substr(3, 2), NULL, 16): leading hex digits of at most two characters
    v = 0
    for ch in s[3:5]:
        d = "0123456789abcdef".find(ch.lower())
        if d < 0:
            break
        v = v * 16 + d
    return v & 0xFF


class Vocab:
    """Tokens, attributes and special ids of one GGUF vocabulary.

    Attributes:
      type: "spm" or "bpe"; pre: tokenizer.ggml.pre (BPE; "default" when absent).
      tokens: the token texts, a sequence of str (a file's gguf_file.StringArray, decoded on
        access; a list when given one, or when a text is empty: renamed "[EMPTY_i]" as llama.cpp
        does). max_token_bytes: the longest text's length in bytes.
      token_to_id: a TokenIndex, a Mapping str -> int (tokenizer/index.py).
      scores: float32 [n_vocab] (tokenizer.ggml.scores; zeros when absent).
      attrs: int32 [n_vocab] llama_token_attr bits.
      bos_id, eos_id, eot_id, eom_id, unk_id, sep_id, pad_id, mask_id, fim_*_id: int or None.
      add_bos, add_eos, add_space_prefix: bool.
      eog_ids: frozenset[int] end-of-generation tokens.
      special_tokens: ids split out of text before tokenizing (control, user-defined and
        unknown tokens), longest text first.
    """

    def __init__(self, kv, where: str = ""):
        """kv: a gguf_file.Metadata (GGUFFile.meta), or a plain key -> value dict (GGUF types inferred,
        Metadata.from_values). Every key is read with the GGUF type llama-vocab.cpp reads it as
        (STRING model/pre/name, UINT32 special ids, BOOL flags, ARRAY of STRING tokens); a wrong
        type raises SynapseError naming the key, the expected and the found type."""
        meta = kv if isinstance(kv, Metadata) else Metadata.from_values(kv, where)
        where = meta.where
        self.where = where
        model = meta.get(Keys.Tokenizer.MODEL, VT.STRING)
        pre = meta.get(Keys.Tokenizer.PRE, VT.STRING, None)
        self.model = model
        self.name = meta.get(Keys.General.NAME, VT.STRING, "")
        if model == "llama":
            self.type = SPM
            bos, eos, unk = 1, 2, 0
            self.add_space_prefix, self.add_bos, self.add_eos = True, True, False
            self.pre = "default"
            self.ignore_merges = False
        elif model == "gpt2":
            self.type = BPE
            bos, eos, unk = 11, 11, None
            self.add_space_prefix, self.add_bos, self.add_eos = False, False, False
            self.pre = pre if pre else "default"
            from .pretokenize import PRE_TYPES

            spec = PRE_TYPES.get(self.pre)
            if spec is None:
                raise SynapseError(f"{where}unsupported {Keys.Tokenizer.PRE} '{self.pre}'")
            _, self.ignore_merges, self.add_bos = spec
            if Keys.Tokenizer.MERGES not in meta:
                raise SynapseError(f"{where}missing key {Keys.Tokenizer.MERGES}")
        else:
            raise SynapseError(f"{where}unsupported {Keys.Tokenizer.MODEL} '{model}' "
                               "(supported: llama, gpt2)")
        self.add_space_prefix = meta.get(Keys.Tokenizer.ADD_PREFIX, VT.BOOL, self.add_space_prefix)

        tokens = meta.get_array(Keys.Tokenizer.LIST, VT.STRING)
        n = len(tokens)
        if n == 0:
            raise SynapseError(f"{where}{Keys.Tokenizer.LIST} is empty")
        # A file's array stays in the file, each text decoded when asked for (a str per token was
        # 22 MiB and 0.2 s at every start for Gemma 3's 262k); one with an empty text becomes a list
        nbytes = tokens.byte_lengths() if isinstance(tokens, StringArray) else None
        if nbytes is None or not nbytes.all():
            tokens = list(tokens)
            if not all(tokens):
                tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
            nbytes = np.fromiter((len(text_bytes(t)) for t in tokens), np.int64, n)
        self.tokens = tokens  # list[str] or gguf_file.StringArray: a sequence of str
        self._nbytes = nbytes
        self.max_token_bytes = int(nbytes.max())
        self.token_to_id = TokenIndex(tokens)
        if self.token_to_id.duplicate is not None:
            i, j = self.token_to_id.duplicate
            raise SynapseError(f"{where}duplicate token in vocabulary: {tokens[j]!r} has ids {i} and {j}")
        self.n_vocab = n

        # llama.cpp reads scores as `(const float *) gguf_get_arr_data` and token types as
        # `(const int *)`, n_tokens of each, without checking the element type. Scores: the 4-byte
        # types are accepted and read as llama.cpp reads them, the bits as float32 (real files have
        # INT32 scores: Mistral Tekken's, all zeros). Token types: INT32 / UINT32 (the same bits);
        # a float token type is an unchecked cast in llama.cpp, not a file anyone writes. At least
        # n elements each (fewer would be a read past the array in llama.cpp).
        four = (VT.FLOAT32, VT.INT32, VT.UINT32)
        scores = meta.get_array(Keys.Tokenizer.SCORES, four, min_length=n, default=None)
        if scores is None:
            self.scores = np.zeros(n, np.float32)
        else:
            self.scores = np.ascontiguousarray(scores[:n]).view("<f4").astype(np.float32)
        ttype = meta.get_array(Keys.Tokenizer.TOKEN_TYPE, (VT.INT32, VT.UINT32), min_length=n, default=None)
        if ttype is None:
            self.attrs = np.full(n, ATTR_NORMAL, np.int32)
        else:
            t = np.ascontiguousarray(ttype[:n]).view("<i4").astype(np.int64)
            ok = (t >= 0) & (t < len(_TYPE_TO_ATTR))
            self.attrs = np.where(ok, _TYPE_TO_ATTR[np.where(ok, t, 0)], ATTR_UNDEFINED).astype(np.int32)

        # special ids: per-type defaults (disabled when out of range), then the GGUF keys
        ids = {"bos": bos, "eos": eos, "eot": None, "eom": None, "unk": unk, "sep": None,
               "pad": None, "mask": None, "fim_pre": None, "fim_suf": None, "fim_mid": None,
               "fim_pad": None, "fim_rep": None, "fim_sep": None}
        for k, v in ids.items():
            if v is not None and v >= n:
                ids[k] = None
        key_of = [("bos", Keys.Tokenizer.BOS_ID), ("eos", Keys.Tokenizer.EOS_ID),
                  ("eot", Keys.Tokenizer.EOT_ID), ("eom", Keys.Tokenizer.EOM_ID),
                  ("unk", Keys.Tokenizer.UNK_ID), ("sep", Keys.Tokenizer.SEP_ID),
                  ("pad", Keys.Tokenizer.PAD_ID), ("mask", Keys.Tokenizer.MASK_ID),
                  ("fim_pre", Keys.Tokenizer.FIM_PRE_ID), ("fim_suf", Keys.Tokenizer.FIM_SUF_ID),
                  ("fim_mid", Keys.Tokenizer.FIM_MID_ID), ("fim_pad", Keys.Tokenizer.FIM_PAD_ID),
                  ("fim_rep", Keys.Tokenizer.FIM_REP_ID), ("fim_sep", Keys.Tokenizer.FIM_SEP_ID),
                  ("fim_pre", Keys.Tokenizer.PREFIX_ID), ("fim_suf", Keys.Tokenizer.SUFFIX_ID),
                  ("fim_mid", Keys.Tokenizer.MIDDLE_ID)]
        for name, key in key_of:
            v = meta.get(key, VT.UINT32, None)  # llama.cpp: get_key(..., uint32_t new_id, false)
            if v is not None and v < n:  # llama.cpp keeps the default for an out-of-range id
                ids[name] = v

        self.add_bos = meta.get(Keys.Tokenizer.ADD_BOS, VT.BOOL, self.add_bos)
        self.add_eos = meta.get(Keys.Tokenizer.ADD_EOS, VT.BOOL, self.add_eos)
        if self.add_bos and ids["bos"] is None:
            raise SynapseError(f"{where}{Keys.Tokenizer.ADD_BOS} is true, but "
                               f"{Keys.Tokenizer.BOS_ID} is not set")
        if self.add_eos and ids["eos"] is None:
            raise SynapseError(f"{where}{Keys.Tokenizer.ADD_EOS} is true, but "
                               f"{Keys.Tokenizer.EOS_ID} is not set")

        self._detect_special(ids)
        for k, v in ids.items():
            setattr(self, f"{k}_id", v)
        self._per_model_attrs(pre or "", meta.get(Keys.General.ARCHITECTURE, VT.STRING, ""))

        sp = np.nonzero(self.attrs & (ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN))[0]
        # llama.cpp sorts by byte length, longest first (std::sort; ties here by id)
        self.special_tokens: list[int] = sp[np.argsort(-self._nbytes[sp], kind="stable")].tolist()
        self._pieces: list[bytes | None] = [None] * n

    # --- load-time special token handling (llama-vocab.cpp load()) ---
    def _mark_control(self, i: int) -> None:
        self.attrs[i] |= ATTR_CONTROL

    def _detect_special(self, ids: dict) -> None:
        t2i = self.token_to_id
        groups = [("eot", _EOT_TEXTS), ("eom", _EOM_TEXTS), ("fim_pre", _FIM_PRE_TEXTS),
                  ("fim_suf", _FIM_SUF_TEXTS), ("fim_mid", _FIM_MID_TEXTS),
                  ("fim_pad", _FIM_PAD_TEXTS), ("fim_rep", _FIM_REP_TEXTS),
                  ("fim_sep", _FIM_SEP_TEXTS)]
        for name, texts in groups:
            if ids[name] is not None:
                continue
            found = [t2i[t] for t in texts if t in t2i]  # first listed text wins
            if found:
                ids[name] = found[0]
                self._mark_control(found[0])
        # unused: control tokens whose text contains "unused"
        for i in np.nonzero(self.attrs & ATTR_CONTROL)[0].tolist():
            if "unused" in self.tokens[i]:
                self.attrs[i] |= ATTR_UNUSED

        eog = set()
        for name in ("fim_pad", "fim_rep", "fim_sep"):
            if ids[name] is not None:
                eog.add(ids[name])
        for t in _EOG_TEXTS:
            i = t2i.get(t)
            if i is not None:
                eog.add(i)
                self._mark_control(i)
        # gpt-oss: these are always rendered
        for t in ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"):
            i = t2i.get(t)
            if i is not None:
                self.attrs[i] = ATTR_USER_DEFINED
        for name in ("eos", "eot", "eom"):
            if ids[name] is not None:
                eog.add(ids[name])
        # o200k_harmony / solar-open: "<|end|>" is not EOG when <|return|>+<|call|> or
        # <|calls|>+<|flush|> are
        texts = {self.tokens[i]: i for i in eog}
        has_call = "<|call|>" in texts or "<|calls|>" in texts
        if "<|end|>" in texts and has_call and ("<|return|>" in texts or "<|flush|>" in texts):
            i = texts["<|end|>"]
            eog.discard(i)
            self.attrs[i] = ATTR_USER_DEFINED
        # gemma4 / paddleocr: "</s>" is not EOG next to "<|tool_response>"
        if "<|tool_response>" in texts and "</s>" in texts:
            i = texts["</s>"]
            eog.discard(i)
            self.attrs[i] = ATTR_NORMAL
        self.eog_ids = frozenset(eog)

    def _per_model_attrs(self, pre: str, arch: str) -> None:
        # llama.cpp sets lstrip/rstrip by model name / pre-tokenizer / architecture
        name = self.name.lower()
        t2i = self.token_to_id
        if (any(s in pre for s in ("jina-v2-de", "jina-v2-es", "jina-v2-code"))
                or any(s in arch for s in ("nomic-bert-moe", "jina-bert-v3"))):
            if "<mask>" in t2i:
                self.attrs[t2i["<mask>"]] |= ATTR_LSTRIP
        elif "phi-3" in name or "phi3" in name:
            sp = np.nonzero(self.attrs & (ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN))[0]
            self.attrs[sp] |= ATTR_RSTRIP
            for t, on in (("</s>", True), ("<unk>", False), ("<s>", False),
                          ("<|endoftext|>", False)):
                if t in t2i:
                    if on:
                        self.attrs[t2i[t]] |= ATTR_RSTRIP
                    else:
                        self.attrs[t2i[t]] &= ~ATTR_RSTRIP
        elif "modern-bert" in name:
            if "[MASK]" in t2i:
                self.attrs[t2i["[MASK]"]] |= ATTR_LSTRIP

    # --- lookups ---
    def byte_to_token(self, b: int) -> int:
        """llama_vocab::byte_to_token: the token of one byte (SPM: <0xXX>, else the byte)."""
        if self.type == SPM:
            i = self.token_to_id.get(f"<0x{b:02X}>")
            if i is not None:
                return i
            key = bytes([b]).decode("utf-8", "surrogateescape")
        else:
            key = BYTE_TO_UNICODE[b]
        i = self.token_to_id.get(key)
        if i is None:
            raise SynapseError(f"{self.where}no token for byte 0x{b:02X} in the vocabulary")
        return i

    def token_to_piece(self, token: int, special: bool = True) -> bytes:
        """llama_token_to_piece(token, lstrip=0, special): the token's bytes.

        Control and unknown tokens give b"" unless `special`; user-defined tokens are
        their text; SPM normal tokens have U+2581 turned into spaces; BPE normal tokens
        are decoded through GPT-2's byte map; byte tokens (<0xXX>) are that byte.
        Raises SynapseError for an id outside the vocabulary.
        """
        token = int(token)
        if not 0 <= token < self.n_vocab:
            raise SynapseError(f"{self.where}token id {token} out of range [0, {self.n_vocab})")
        attr = int(self.attrs[token])
        if not special and attr & (ATTR_UNKNOWN | ATTR_CONTROL):
            return b""
        piece = self._pieces[token]
        if piece is None:
            piece = self._pieces[token] = self._make_piece(token, attr)
        return piece

    def _make_piece(self, token: int, attr: int) -> bytes:
        text = self.tokens[token]
        if attr & (ATTR_UNKNOWN | ATTR_CONTROL | ATTR_USER_DEFINED):
            return text_bytes(text)
        if attr & ATTR_NORMAL:
            if self.type == SPM:
                return text_bytes(text.replace("\u2581", " "))
            return _decode_bpe_text(text)
        if attr & ATTR_BYTE:
            return bytes([_strtol_hex2(text)])
        return b""


def _decode_bpe_text(text: str) -> bytes:
    """llama-vocab.cpp llama_decode_text: undo GPT-2's byte-to-unicode map."""
    out = bytearray()
    for ch in text:
        b = UNICODE_TO_BYTE.get(ch)
        if b is not None:
            out.append(b)
            continue
        if 0xDC80 <= ord(ch) <= 0xDCFF:  # an invalid byte: llama.cpp sees U+FFFD
            ch = "\ufffd"
        out += b"[UNK_BYTE_0x" + ch.encode("utf-8", "surrogatepass").hex().encode() + \
            text_bytes(text) + b"]"
    return bytes(out)
