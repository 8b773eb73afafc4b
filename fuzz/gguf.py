"""Structure-aware GGUF fuzzer: mutated tiny models and vocabularies, run as llama-decode runs them.

From the repository root:

    python -m fuzz.gguf --n 10000 [--seed 0] [--start 0] [--jobs 2] [--root DIR] [--json]
    python -m fuzz.gguf --case 1234 --write /tmp/case.gguf     # reproduce one case
    python -m fuzz.gguf --n 10000 --save-flagged DIR            # keep every flagged file

Seeds used so far: 0 (the first 10,000-case campaign), 1 (tests/test_fuzz.py's subset), 34034 (issue
34's campaign); take a new one for a new campaign.

Case k of seed s is a pure function of (s, k): random.Random(f"{s}/{k}") picks a base file
(tests/data/tiny/*.gguf, or tests/data/vocab/*.gguf, or tests/data/fuzz/micro-llama-f16.gguf with
--bases micro) and a mutation of its parsed layout:

  truncate    cut at a section boundary (header, after key/value i, after tensor info j, data start,
              inside a tensor), +- a few bytes
  byte        1-4 bytes of the header / key-value / tensor-info region set to 0, 0xff, random, or flipped
  intfield    an integer field at its parsed offset (counts, string lengths, value / element types,
              array counts, n_dims, dims, ggml type, data offset, integer values) set to 0, 1, 2**31,
              2**32-1, 2**63, 2**64-1, v+-1, 2v, v + 2**32 or random
  typeswap    a key's value replaced by a value of another GGUF type (integers, NaN / inf floats,
              bool, string, arrays of each, empty arrays)
  hparam      a model key ({arch}.*, special-token ids) set to a huge / zero / negative / NaN / inf value
              of its own type, or to a plausible one that contradicts the tensor shapes
  dims        a tensor's dims changed (swap, 0, 1, +-block, x2, /2, huge), or a key it must agree with
  duplicate   a key/value or a tensor info repeated (counts raised to match)
  remove      a key removed
  nanweights  NaN / inf written into a tensor's data (F32 / F16 / BF16 elements, or block scales)
  vocab       a malformed vocabulary: duplicate / empty / invalid-UTF-8 / missing tokens, token list
              shorter than scores or types, scores / types of other element types or lengths, types out
              of range, garbage merges, unknown tokenizer model / pre, special ids out of range
  multi       two or three of typeswap / hparam / byte / vocab together

Each case runs in a worker process (one Python start-up for many cases; the library is imported
once): a model file through the CLI's own entry point in-process (llama-decode FILE "hi" -n 2 -c 64
-t 1, stdout/stderr captured), a vocabulary through load_tokenizer + tokenize + detokenize.
Workers run under an address-space limit (RLIMIT_AS, set in preexec_fn) and a per-case alarm;
the parent kills a worker that does not answer within the hard time limit, records which case it
was on, and starts a new worker; a worker killed by a signal is restarted the same way. Each case's
wall time and peak RSS are measured (fuzz.harness.PeakRSS) and a case over 30 s or 2 GiB is flagged
whatever its class; the summary gives the largest of each.

Outcome classes (printed as counts):
  ok        the CLI exited 0 (or the tokenizer loaded and round-tripped)
  clean     SynapseError: CLI exit 2 with exactly one stderr line "error: ..." and no traceback
  exception any other exception (CLI exit 1 "internal error", or a multi-line / traceback error)
  signal    the worker died of a signal on that case
  timeout   the case did not finish within the time limits
  memory    MemoryError (or the address-space limit hit)
OK cases whose logits are not all finite (NaN / inf weights) are counted as well (ok_nonfinite).

--root DIR runs another checkout's synapse_nb and cli (e.g. an older commit) on the same cases.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from fuzz.harness import (CLASSES, PeakRSS, Worker, library_outcome, limit_as, run_case, run_cli, run_workers,
                          summarize)

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
MICRO = DATA / "fuzz" / "micro-llama-f16.gguf"  # SentencePiece vocabulary (tiny-llama's)
MICRO_BPE = DATA / "fuzz" / "micro-bpe-f16.gguf"  # byte-level BPE vocabulary (smollm's first 512 tokens)
EDITS: list = []  # key-level edits of the case being made: (key, vtype, raw), vtype None = removed

# GGUF value types (gguf.GGUFValueType) and their fixed sizes / struct formats
UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64, INT64, FLOAT64 = range(13)
FMT = {UINT8: "B", INT8: "b", UINT16: "H", INT16: "h", UINT32: "I", INT32: "i", FLOAT32: "f", BOOL: "B",
       UINT64: "Q", INT64: "q", FLOAT64: "d"}
INT_TYPES = (UINT8, INT8, UINT16, INT16, UINT32, INT32, UINT64, INT64)
GGML_BLOCK = {0: (1, 4), 1: (1, 2), 30: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24),
              8: (32, 34), 10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176), 14: (256, 210),
              20: (32, 18), 23: (256, 136)}


# ------------------------------------------------------------------ GGUF layout (independent parser)

@dataclass
class KV:
    key: bytes
    vtype: int
    raw: bytes  # the value's bytes as stored (arrays: element type, count, elements)
    off: int  # offset of the entry (its key length)
    val_off: int


@dataclass
class TI:
    name: bytes
    dims: list
    ttype: int
    offset: int  # relative to the data section
    off: int  # offset of the entry


@dataclass
class Layout:
    version: int
    kvs: list
    tensors: list
    alignment: int
    data_offset: int
    size: int
    ints: list = field(default_factory=list)  # (offset, size, what) of integer fields
    bounds: list = field(default_factory=list)  # section boundaries (offsets)

    def kv(self, key: str):
        k = key.encode()
        return next((x for x in self.kvs if x.key == k), None)

    def arch(self) -> str:
        x = self.kv("general.architecture")
        return x.raw[8:].decode("utf-8", "replace") if x is not None and x.vtype == STRING else "llama"


def parse_layout(buf: bytes) -> Layout:
    """Offsets of every section and integer field of a well-formed GGUF file (the fuzz bases)."""
    pos = 0
    ints, bounds = [], [0]

    def u(fmt, what=None):
        nonlocal pos
        st = struct.Struct("<" + fmt)
        if what:
            ints.append((pos, st.size, what))
        (v,) = st.unpack_from(buf, pos)
        pos += st.size
        return v

    def s(what=None):
        nonlocal pos
        n = u("Q", what)
        v = buf[pos:pos + n]
        pos += n
        return v

    u("I")
    version = u("I", "version")
    n_tensors = u("Q", "n_tensors")
    n_kv = u("Q", "n_kv")
    bounds.append(pos)
    kvs = []
    for _ in range(n_kv):
        off = pos
        key = s("key length")
        vtype = u("I", "value type")
        val_off = pos
        if vtype == STRING:
            s("string length")
        elif vtype == ARRAY:
            et = u("I", "element type")
            n = u("Q", "array count")
            if et == STRING:
                for i in range(n):
                    s("string length" if i < 3 else None)
            else:
                pos += n * struct.calcsize(FMT[et])
        else:
            u(FMT[vtype], "value" if vtype in INT_TYPES else None)
        kvs.append(KV(key, vtype, buf[val_off:pos], off, val_off))
        bounds.append(pos)
    alignment = 32
    for x in kvs:
        if x.key == b"general.alignment" and x.vtype == UINT32:
            alignment = struct.unpack("<I", x.raw)[0]
    tensors = []
    for _ in range(n_tensors):
        off = pos
        name = s("tensor name length")
        nd = u("I", "n_dims")
        dims = [u("Q", "dim") for _ in range(nd)]
        tt = u("I", "ggml type")
        to = u("Q", "tensor offset")
        tensors.append(TI(name, dims, tt, to, off))
        bounds.append(pos)
    data_offset = -(-pos // alignment) * alignment
    bounds.append(data_offset)
    for t in tensors:
        bounds.append(data_offset + t.offset)
        bounds.append(data_offset + t.offset + tensor_bytes(t) // 2)
    bounds.append(len(buf))
    return Layout(version, kvs, tensors, alignment, data_offset, len(buf), ints, sorted(set(bounds)))


def tensor_bytes(t: TI) -> int:
    block, size = GGML_BLOCK.get(t.ttype, (1, 4))
    n = 1
    for d in t.dims:
        n *= d
    return n // block * size


def enc_str(b) -> bytes:
    b = b.encode("utf-8", "surrogateescape") if isinstance(b, str) else b
    return struct.pack("<Q", len(b)) + b


def enc_scalar(vtype: int, v) -> bytes:
    if vtype == STRING:
        return enc_str(v)
    f = FMT[vtype]
    if f in "fd":
        return struct.pack("<" + f, v)
    bits = struct.calcsize(f) * 8
    v = int(v) % (1 << bits)  # two's complement wrap for negative / huge
    if f.islower():
        v = v - (1 << bits) if v >= 1 << (bits - 1) else v
    return struct.pack("<" + f, v)


def enc_array(etype: int, values) -> bytes:
    return struct.pack("<IQ", etype, len(values)) + b"".join(enc_scalar(etype, v) for v in values)


def build(lay: Layout, buf: bytes, kvs=None, tensors=None, n_kv=None, n_tensors=None) -> bytes:
    """Serialize a (modified) layout: key/values (key, vtype, raw), tensor infos, then the base's data
    section re-aligned after the new table (tensor offsets are relative, so they stay valid)."""
    kvs = lay.kvs if kvs is None else kvs
    tensors = lay.tensors if tensors is None else tensors
    out = bytearray(struct.pack("<IIQQ", 0x46554747, lay.version, len(tensors) if n_tensors is None else n_tensors,
                                len(kvs) if n_kv is None else n_kv))
    for x in kvs:
        out += enc_str(x.key) + struct.pack("<I", x.vtype) + x.raw
    for t in tensors:
        out += enc_str(t.name) + struct.pack("<I", len(t.dims)) + b"".join(struct.pack("<Q", d % (1 << 64))
                                                                           for d in t.dims)
        out += struct.pack("<IQ", t.ttype, t.offset % (1 << 64))
    out += b"\0" * (-len(out) % lay.alignment)
    out += buf[lay.data_offset:]
    return bytes(out)


def replace_kv(lay: Layout, key: bytes, vtype: int, raw: bytes, add=True):
    EDITS.append((key, vtype, raw))
    kvs = [KV(x.key, x.vtype, x.raw, 0, 0) for x in lay.kvs]
    for x in kvs:
        if x.key == key:
            x.vtype, x.raw = vtype, raw
            return kvs
    if add:
        kvs.append(KV(key, vtype, raw, 0, 0))
    return kvs


# ------------------------------------------------------------------ mutations

NAN, INF = float("nan"), float("inf")
HUGE_INTS = [0, 1, 2, 3, 7, 255, 65535, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1, -1, -2**31]
FLOATS = [NAN, INF, -INF, 0.0, -0.0, -1.0, 1e38, 3.4e38, 1e-45, 1e-30, 1e30, 5e-324]


def interesting_int(rng, v=None):
    opts = list(HUGE_INTS)
    if v is not None:
        opts += [v + 1, v - 1, 2 * v, v // 2, v + 2**32, v ^ (1 << rng.randrange(64))]
    return rng.choice(opts + [rng.getrandbits(rng.choice((8, 16, 32, 64)))])


def random_value(rng, not_type=None):
    """(vtype, raw) of a random value of a random GGUF type other than not_type."""
    while True:
        kind = rng.choice(["int", "float", "bool", "str", "arr_int", "arr_float", "arr_str", "arr_bool",
                           "arr_empty", "f64"])
        if kind == "int":
            vt = rng.choice(INT_TYPES)
            raw = enc_scalar(vt, interesting_int(rng))
        elif kind == "float":
            vt, raw = FLOAT32, enc_scalar(FLOAT32, rng.choice(FLOATS + [rng.uniform(-1e3, 1e3)]))
        elif kind == "f64":
            vt, raw = FLOAT64, enc_scalar(FLOAT64, rng.choice(FLOATS))
        elif kind == "bool":
            vt, raw = BOOL, struct.pack("<B", rng.choice([0, 1, 2, 255]))
        elif kind == "str":
            vt, raw = STRING, enc_str(rng.choice(["", "llama", "gpt2", "x" * 300, "\x00\n\udcff", "qwen2", "bogus"]))
        elif kind == "arr_int":
            et = rng.choice(INT_TYPES)
            vt, raw = ARRAY, enc_array(et, [interesting_int(rng) for _ in range(rng.choice([1, 2, 3, 8]))])
        elif kind == "arr_float":
            vt, raw = ARRAY, enc_array(FLOAT32, [rng.choice(FLOATS) for _ in range(rng.choice([1, 2, 5]))])
        elif kind == "arr_str":
            vt, raw = ARRAY, enc_array(STRING, [rng.choice(["a", "", "llama", "\udcff"]) for _ in range(3)])
        elif kind == "arr_bool":
            vt, raw = ARRAY, enc_array(BOOL, [1, 0])
        else:
            vt, raw = ARRAY, enc_array(rng.choice([STRING, UINT32, FLOAT32]), [])
        if vt != not_type:
            return vt, raw


IMPORTANT = ["general.architecture", "general.name", "general.alignment", "tokenizer.ggml.model", "tokenizer.ggml.pre",
             "tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type", "tokenizer.ggml.merges",
             "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.unknown_token_id",
             "tokenizer.ggml.padding_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.add_bos_token",
             "tokenizer.ggml.add_eos_token", "tokenizer.ggml.add_space_prefix", "{arch}.vocab_size",
             "{arch}.context_length", "{arch}.embedding_length", "{arch}.block_count", "{arch}.feed_forward_length",
             "{arch}.attention.head_count", "{arch}.attention.head_count_kv", "{arch}.attention.key_length",
             "{arch}.attention.value_length", "{arch}.attention.layer_norm_rms_epsilon", "{arch}.rope.freq_base",
             "{arch}.rope.dimension_count", "{arch}.rope.scaling.type", "{arch}.rope.scaling.factor",
             "{arch}.rope.scaling.original_context_length", "{arch}.rope.scaling.attn_factor",
             "{arch}.rope.scaling.yarn_beta_fast", "{arch}.rope.scaling.yarn_log_multiplier",
             "{arch}.attention.temperature_scale", "{arch}.rope.scale_linear"]


def pick_key(rng, lay: Layout) -> bytes:
    if rng.random() < 0.75:
        return rng.choice(IMPORTANT).format(arch=lay.arch()).encode()
    return rng.choice(lay.kvs).key


def m_truncate(rng, lay, buf):
    b = rng.choice(lay.bounds)
    cut = max(0, min(len(buf) - 1, b + rng.choice([0, 0, 0, -1, 1, -4, 4, -8, 8, rng.randrange(-64, 64)])))
    return buf[:cut], f"truncate at {cut} of {len(buf)}"


def m_byte(rng, lay, buf):
    b = bytearray(buf)
    end = lay.data_offset if rng.random() < 0.9 else len(buf)
    off = rng.randrange(0, end)
    n = rng.choice([1, 1, 2, 4])
    how = rng.choice(["zero", "ff", "rand", "flip"])
    for i in range(off, min(off + n, len(b))):
        b[i] = {"zero": 0, "ff": 255, "rand": rng.randrange(256), "flip": b[i] ^ (1 << rng.randrange(8))}[how]
    return bytes(b), f"byte {how} x{n} at {off}"


def m_intfield(rng, lay, buf):
    off, size, what = rng.choice(lay.ints)
    old = int.from_bytes(buf[off:off + size], "little")
    v = interesting_int(rng, old) % (1 << (8 * size))
    return buf[:off] + v.to_bytes(size, "little") + buf[off + size:], f"intfield {what}@{off} {old} -> {v}"


def m_typeswap(rng, lay, buf):
    key = pick_key(rng, lay)
    old = next((x for x in lay.kvs if x.key == key), None)
    vt, raw = random_value(rng, None if old is None else (old.vtype if old.vtype != ARRAY else None))
    return build(lay, buf, replace_kv(lay, key, vt, raw)), f"typeswap {key.decode()} -> type {vt} {raw[:24].hex()}"


HP_KEYS = {  # key template -> GGUF type it has in the fixtures
    "{arch}.context_length": UINT32, "{arch}.embedding_length": UINT32, "{arch}.block_count": UINT32,
    "{arch}.feed_forward_length": UINT32, "{arch}.attention.head_count": UINT32,
    "{arch}.attention.head_count_kv": UINT32, "{arch}.attention.key_length": UINT32,
    "{arch}.attention.value_length": UINT32, "{arch}.rope.dimension_count": UINT32, "{arch}.vocab_size": UINT32,
    "{arch}.rope.scaling.original_context_length": UINT32, "{arch}.attention.layer_norm_rms_epsilon": FLOAT32,
    "{arch}.rope.freq_base": FLOAT32, "{arch}.rope.scaling.factor": FLOAT32, "{arch}.rope.scaling.attn_factor": FLOAT32,
    "{arch}.rope.scaling.yarn_beta_fast": FLOAT32, "{arch}.rope.scaling.yarn_beta_slow": FLOAT32,
    "{arch}.rope.scaling.yarn_log_multiplier": FLOAT32, "{arch}.attention.temperature_scale": FLOAT32,
    "tokenizer.ggml.bos_token_id": UINT32, "tokenizer.ggml.eos_token_id": UINT32,
    "tokenizer.ggml.unknown_token_id": UINT32, "tokenizer.ggml.padding_token_id": UINT32,
    "tokenizer.ggml.eot_token_id": UINT32,
}


def m_hparam(rng, lay, buf):
    tmpl = rng.choice(list(HP_KEYS))
    key, vt = tmpl.format(arch=lay.arch()).encode(), HP_KEYS[tmpl]
    old = next((x for x in lay.kvs if x.key == key), None)
    if vt == FLOAT32:
        v = rng.choice(FLOATS + [rng.uniform(-10, 10)])
    else:
        cur = struct.unpack("<I", old.raw)[0] if old is not None and old.vtype == UINT32 else 64
        v = rng.choice([interesting_int(rng, cur) % 2**32, cur * 2, cur // 2, cur + 1, max(cur - 1, 0), 1, 0, 4, 8,
                        64, 128, 512, 511])
    if rng.random() < 0.15 and "head_count" in tmpl or "feed_forward" in tmpl and rng.random() < 0.15:
        # a per-layer array (llama.cpp accepts one): uniform, varying, or of the wrong length
        n = rng.choice([1, 2, 2, 3])
        vals = [v] * n if rng.random() < 0.5 else [v, v + 1, v][:n]
        return build(lay, buf, replace_kv(lay, key, ARRAY, enc_array(rng.choice([INT32, UINT32, UINT8]), vals))), \
            f"hparam {key.decode()} = array {vals}"
    return build(lay, buf, replace_kv(lay, key, vt, enc_scalar(vt, v))), f"hparam {key.decode()} = {v}"


def m_dims(rng, lay, buf):
    if not lay.tensors:
        return m_hparam(rng, lay, buf)
    ts = [TI(t.name, list(t.dims), t.ttype, t.offset, 0) for t in lay.tensors]
    t = rng.choice(ts)
    block = GGML_BLOCK.get(t.ttype, (1, 4))[0]
    op = rng.choice(["swap", "zero", "one", "double", "half", "plus", "huge", "ndims", "type"])
    if op == "swap" and len(t.dims) > 1:
        t.dims.reverse()
    elif op == "ndims":
        t.dims = t.dims + [1] if rng.random() < 0.5 else t.dims[:-1]
    elif op == "type":
        t.ttype = rng.choice([0, 1, 2, 3, 8, 12, 14, 30, 99])
    else:
        i = rng.randrange(len(t.dims)) if t.dims else 0
        if t.dims:
            d = t.dims[i]
            t.dims[i] = {"zero": 0, "one": 1, "double": 2 * d, "half": max(d // 2, 1), "plus": d + block,
                         "huge": rng.choice([2**32, 2**40, 2**62]), "swap": d}[op]
    return build(lay, buf, tensors=ts), f"dims {t.name.decode()} {op} -> {t.dims} type {t.ttype}"


def m_duplicate(rng, lay, buf):
    if lay.tensors and rng.random() < 0.5:
        ts = list(lay.tensors)
        ts.insert(rng.randrange(len(ts) + 1), rng.choice(lay.tensors))
        return build(lay, buf, tensors=ts), "duplicate tensor"
    kvs = list(lay.kvs)
    x = rng.choice([k for k in kvs if k.key.decode("utf-8", "replace") in
                    {s.format(arch=lay.arch()) for s in IMPORTANT}] or kvs)
    kvs.insert(rng.randrange(len(kvs) + 1), x)
    return build(lay, buf, kvs), f"duplicate key {x.key.decode('utf-8', 'replace')}"


def m_remove(rng, lay, buf):
    key = pick_key(rng, lay)
    kvs = [x for x in lay.kvs if x.key != key]
    EDITS.append((key, None, None))
    return build(lay, buf, kvs), f"remove {key.decode()}"


def m_nanweights(rng, lay, buf):
    if not lay.tensors:
        return m_vocab(rng, lay, buf)
    t = rng.choice(lay.tensors)
    start, n = lay.data_offset + t.offset, tensor_bytes(t)
    b = bytearray(buf)
    val = rng.choice(["nan", "inf", "-inf"])
    k = rng.choice([1, 3, 50])
    if t.ttype == 0:
        pat = struct.pack("<f", {"nan": NAN, "inf": INF, "-inf": -INF}[val])
        step = 4
    else:  # F16 / BF16 elements, or the F16 scale of a quant block (at some 2-aligned offset)
        pat = {"nan": b"\x00\x7e", "inf": b"\x00\x7c", "-inf": b"\x00\xfc"}[val] if t.ttype != 30 else \
            {"nan": b"\xc0\x7f", "inf": b"\x80\x7f", "-inf": b"\x80\xff"}[val]
        step = 2
        if t.ttype not in (1, 30):
            block, size = GGML_BLOCK.get(t.ttype, (1, 4))
            if rng.random() < 0.7:  # block starts: d of Q4_0..Q8_0, Q4_K/Q5_K (d, dmin), not Q2_K/Q3_K/Q6_K
                step = size
    for _ in range(k):
        i = start + rng.randrange(0, max(n // step, 1)) * step
        b[i:i + len(pat)] = pat
    return bytes(b), f"nanweights {t.name.decode()} {val} x{k}"


def _array_strings(entry) -> list[bytes]:
    """The elements of a string-array key/value of a parsed layout (its raw bytes: type, count, strings)."""
    _, n = struct.unpack_from("<IQ", entry.raw)
    pos, out = 12, []
    for _ in range(n):
        (ln,) = struct.unpack_from("<Q", entry.raw, pos)
        out.append(entry.raw[pos + 8:pos + 8 + ln])
        pos += 8 + ln
    return out


def m_vocab(rng, lay, buf):
    toks = lay.kv("tokenizer.ggml.tokens")
    if toks is None or toks.vtype != ARRAY:
        return m_typeswap(rng, lay, buf)
    strs = _array_strings(toks)
    n = len(strs)
    op = rng.choice(["dup", "empty", "badutf8", "shorter", "longer", "one", "none", "scores_short", "scores_type",
                     "types_range", "types_short", "types_type", "merges_garbage", "merges_type", "model", "pre",
                     "special_range", "byte_tokens", "control_text"])
    if not strs:
        return m_typeswap(rng, lay, buf)
    kvs = None
    desc = f"vocab {op}"
    if op in ("dup", "empty", "badutf8", "shorter", "longer", "one", "none", "byte_tokens", "control_text"):
        s = list(strs)
        i = rng.randrange(len(s))
        if op == "dup":
            s[i] = s[rng.randrange(len(s))]
        elif op == "empty":
            for _ in range(rng.choice([1, 5])):
                s[rng.randrange(len(s))] = b""
        elif op == "badutf8":
            s[i] = rng.choice([b"\xff", b"\xc3", b"a\x80b", b"\xed\xa0\x80", b"\x00"])
        elif op == "shorter":
            s = s[:rng.choice([1, 2, 3, 10, len(s) // 2, len(s) - 1])]
        elif op == "longer":
            s = s + [b"<extra_%d>" % j for j in range(rng.choice([1, 7]))]
        elif op == "one":
            s = s[:1]
        elif op == "none":
            s = []
        elif op == "byte_tokens":  # SPM byte tokens / BPE byte symbols renamed away
            for j in range(len(s)):
                if s[j].startswith(b"<0x") or (len(s[j]) <= 2 and rng.random() < 0.5):
                    s[j] = b"renamed_%d" % j
        else:  # control-token texts put in the vocabulary
            for t in (b"<|im_end|>", b"<|endoftext|>", b"<|fim_pad|>", b"<|tool_response>", b"</s>", b"<|end|>",
                      b"<|call|>", b"<|return|>"):
                s[rng.randrange(len(s))] = t
        raw = struct.pack("<IQ", STRING, len(s)) + b"".join(enc_str(x) for x in s)
        kvs = replace_kv(lay, b"tokenizer.ggml.tokens", ARRAY, raw)
        desc += f" (n {len(s)})"
    elif op == "scores_short":
        kvs = replace_kv(lay, b"tokenizer.ggml.scores", ARRAY, enc_array(FLOAT32, [0.0] * rng.choice([0, 1, n - 1])))
    elif op == "scores_type":
        et2 = rng.choice([INT8, UINT16, INT32, FLOAT64, UINT64, BOOL, STRING])
        vals = [("x" if et2 == STRING else rng.choice([0, 1])) for _ in range(n)]
        kvs = replace_kv(lay, b"tokenizer.ggml.scores", ARRAY, enc_array(et2, vals))
        desc += f" {et2}"
    elif op in ("types_range", "types_short", "types_type"):
        if op == "types_range":
            vals = [rng.choice([-1, 0, 1, 2, 3, 4, 5, 6, 7, 2**31 - 1, -2**31]) for _ in range(n)]
            kvs = replace_kv(lay, b"tokenizer.ggml.token_type", ARRAY, enc_array(INT32, vals))
        elif op == "types_short":
            kvs = replace_kv(lay, b"tokenizer.ggml.token_type", ARRAY, enc_array(INT32, [1] * rng.choice([0, n - 1])))
        else:
            et2 = rng.choice([UINT8, INT16, INT64, FLOAT32, STRING])
            kvs = replace_kv(lay, b"tokenizer.ggml.token_type", ARRAY,
                             enc_array(et2, [("x" if et2 == STRING else 1) for _ in range(n)]))
    elif op == "merges_garbage":
        m = [rng.choice(["", " ", "a", "a b", " x", "x ", "\udcff \udcfe", "Ġ Ġ", "zzz yyy", "a  b"])
             for _ in range(rng.choice([1, 10, 100]))]
        kvs = replace_kv(lay, b"tokenizer.ggml.merges", ARRAY, enc_array(STRING, m))
    elif op == "merges_type":
        kvs = replace_kv(lay, b"tokenizer.ggml.merges", *random_value(rng, None))
    elif op == "model":
        kvs = replace_kv(lay, b"tokenizer.ggml.model", STRING,
                         enc_str(rng.choice(["llama", "gpt2", "bert", "t5", "rwkv", "", "none", "ugm"])))
    elif op == "pre":
        kvs = replace_kv(lay, b"tokenizer.ggml.pre", STRING,
                         enc_str(rng.choice(["", "default", "llama3", "qwen2", "bogus", "gpt-4o", "tekken", "smollm"])))
    else:
        key = rng.choice([b"tokenizer.ggml.bos_token_id", b"tokenizer.ggml.eos_token_id",
                          b"tokenizer.ggml.unknown_token_id", b"tokenizer.ggml.eot_token_id"])
        kvs = replace_kv(lay, key, UINT32, enc_scalar(UINT32, rng.choice([n, n + 1, 2**32 - 1, 2**31, 0, n - 1])))
    return build(lay, buf, kvs), desc


MUTATIONS = [(m_truncate, 10), (m_byte, 12), (m_intfield, 14), (m_typeswap, 20), (m_hparam, 12), (m_dims, 8),
             (m_duplicate, 4), (m_remove, 5), (m_nanweights, 6), (m_vocab, 12)]


def m_multi(rng, lay, buf):
    descs = []
    for _ in range(rng.choice([2, 3])):
        f = rng.choice([m_typeswap, m_hparam, m_vocab, m_remove])
        buf, d = f(rng, lay, buf)
        descs.append(d)
        lay = parse_layout(buf)
    if rng.random() < 0.3:
        buf, d = m_byte(rng, lay, buf)
        descs.append(d)
    return buf, "multi: " + "; ".join(descs)


MUTATIONS.append((m_multi, 5))


def bases(which: str) -> list[tuple[Path, str, int]]:
    """(path, kind, weight) of the fuzz bases: tiny models ("model"), vocabularies ("vocab")."""
    if which == "micro":
        return [(MICRO, "model", 1)]
    out = [(p, "model", 3) for p in sorted((DATA / "tiny").glob("*.gguf"))]
    # vocabularies weighted by speed (the big BPE ones load in 0.3-0.5 s)
    vw = {"ggml-vocab-llama-bpe": 1, "ggml-vocab-mistral-tekken": 1, "ggml-vocab-qwen2": 2, "ggml-vocab-gemma3": 1}
    out += [(p, "vocab", vw.get(p.stem, 4)) for p in sorted((DATA / "vocab").glob("*.gguf"))]
    return out


class CaseMaker:
    """Builds case k of a seed: (bytes, kind, description). Base layouts are parsed once and kept."""

    def __init__(self, seed: int, which: str = "all"):
        self.seed, self.bases = seed, bases(which)
        self.cache: dict[Path, tuple[bytes, Layout]] = {}

    def base(self, path: Path):
        if path not in self.cache:
            buf = path.read_bytes()
            self.cache[path] = (buf, parse_layout(buf))
        return self.cache[path]

    def make(self, k: int, base: Path | None = None):
        """Case k: (bytes, kind "model" / "vocab", description). base: apply case k's mutation to this
        file instead of the one case k picks (the random draws after the pick are the same, so a
        key-level mutation carries over: how the regression cases were made from micro-llama-f16)."""
        rng = random.Random(f"{self.seed}/{k}")
        path, kind, _ = rng.choices(self.bases, weights=[w for _, _, w in self.bases])[0]
        if base is not None:
            path, kind = Path(base), "model"
        buf, lay = self.base(path)
        EDITS.clear()
        fn = rng.choices([f for f, _ in MUTATIONS], weights=[w for _, w in MUTATIONS])[0]
        try:
            data, desc = fn(rng, lay, buf)
        except Exception as e:  # a mutation that does not apply to this base: a byte mutation instead
            data, desc = m_byte(random.Random(f"{self.seed}/{k}/fallback"), lay, buf)
            desc += f" (fallback: {fn.__name__} failed: {type(e).__name__})"
        return data, kind, f"{path.name}: {desc}"


def make_micro(dst: Path) -> None:
    """tests/data/fuzz/micro-llama-f16.gguf: the base of the regression cases (about 60 KB).

    tiny-llama-f32's key/values and 512-token vocabulary with n_embd 32, 1 layer, 4 heads / 2 KV
    heads of 8, n_ff 64 (tied output); 2-D weights are the top-left corners of tiny-llama-f32's,
    stored as F16; norms F32. Random weights, like the tiny fixtures: only its validity matters.
    """
    import numpy as np

    src = DATA / "tiny" / "tiny-llama-f32.gguf"
    buf = src.read_bytes()
    lay = parse_layout(buf)
    E, F, H, HKV, D = 32, 64, 4, 2, 8
    new = {"llama.embedding_length": E, "llama.feed_forward_length": F, "llama.block_count": 1,
           "llama.attention.head_count": H, "llama.attention.head_count_kv": HKV, "llama.rope.dimension_count": D}
    kvs = []
    for x in lay.kvs:
        k = x.key.decode()
        kvs.append(KV(x.key, UINT32, enc_scalar(UINT32, new[k]), 0, 0) if k in new else x)
    kvs = [x for x in kvs if x.key.decode() not in ("llama.attention.key_length", "llama.attention.value_length")]
    shapes = {"token_embd.weight": (512, E), "output_norm.weight": (E,), "blk.0.attn_norm.weight": (E,),
              "blk.0.ffn_norm.weight": (E,), "blk.0.attn_q.weight": (H * D, E), "blk.0.attn_k.weight": (HKV * D, E),
              "blk.0.attn_v.weight": (HKV * D, E), "blk.0.attn_output.weight": (E, H * D),
              "blk.0.ffn_gate.weight": (F, E), "blk.0.ffn_up.weight": (F, E), "blk.0.ffn_down.weight": (E, F)}
    tensors, data = [], bytearray()
    for t in lay.tensors:
        name = t.name.decode()
        if name not in shapes:
            continue
        full = np.frombuffer(buf, "<f4", count=tensor_bytes(t) // 4, offset=lay.data_offset + t.offset)
        full = full.reshape(tuple(reversed(t.dims)))
        shape = shapes[name]
        a = full[:shape[0]] if len(shape) == 1 else full[:shape[0], :shape[1]]
        a = np.ascontiguousarray(a, "<f4" if len(shape) == 1 else "<f2")
        data += b"\0" * (-len(data) % 32)
        tensors.append(TI(t.name, list(reversed(shape)), 0 if len(shape) == 1 else 1, len(data), 0))
        data += a.tobytes()
    out = Layout(lay.version, kvs, tensors, 32, 0, 0)
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_bytes(build(out, bytes(data)))


def make_micro_bpe(dst: Path) -> None:
    """tests/data/fuzz/micro-bpe-f16.gguf: micro-llama-f16 with a byte-level BPE vocabulary (tokenizer.ggml.model
    gpt2, pre smollm): ggml-vocab-smollm's first 512 tokens and the merges among them."""
    mbuf = MICRO.read_bytes()
    mlay = parse_layout(mbuf)
    vbuf = (DATA / "vocab" / "ggml-vocab-smollm.gguf").read_bytes()
    vlay = parse_layout(vbuf)

    toks = _array_strings(vlay.kv("tokenizer.ggml.tokens"))[:512]
    have = set(toks)
    merges = []
    for m in _array_strings(vlay.kv("tokenizer.ggml.merges")):
        a, _, b = m.partition(b" ")
        if a in have and b in have and a + b in have:
            merges.append(m)
    ttype = struct.unpack_from("<512i", vlay.kv("tokenizer.ggml.token_type").raw, 12)
    kvs = [x for x in mlay.kvs if not x.key.startswith(b"tokenizer.")]
    kvs += [KV(b"tokenizer.ggml.model", STRING, enc_str("gpt2"), 0, 0),
            KV(b"tokenizer.ggml.pre", STRING, enc_str("smollm"), 0, 0),
            KV(b"tokenizer.ggml.tokens", ARRAY, struct.pack("<IQ", STRING, len(toks)) +
               b"".join(enc_str(t) for t in toks), 0, 0),
            KV(b"tokenizer.ggml.token_type", ARRAY, enc_array(INT32, ttype), 0, 0),
            KV(b"tokenizer.ggml.merges", ARRAY, struct.pack("<IQ", STRING, len(merges)) +
               b"".join(enc_str(t) for t in merges), 0, 0)]
    for k in ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id", "add_bos_token",
              "add_space_prefix"):
        x = vlay.kv("tokenizer.ggml." + k)
        if x is not None:
            kvs.append(x)
    dst.write_bytes(build(mlay, mbuf, kvs))


def micro_variant(maker: "CaseMaker", k: int):
    """Case k's key-level edits applied to the micro base of the same tokenizer type (micro-bpe for
    gpt2 vocabularies, else micro-llama); None when case k is not key-level (bytes, tensors, data)
    or needs its own vocabulary (an edit of more than 4 KiB: token lists, merges)."""
    data, kind, desc = maker.make(k)
    edits = list(EDITS)
    if not edits or any(raw is not None and len(raw) > 4096 for _, _, raw in edits):
        return None
    _, lay = maker.base(next(p for p, _, _ in maker.bases if p.name == desc.split(":")[0]))
    m = lay.kv("tokenizer.ggml.model")
    base = MICRO_BPE if m is not None and m.raw[8:] == b"gpt2" else MICRO
    buf = base.read_bytes()
    for key, vt, raw in edits:
        lay2 = parse_layout(buf)
        kvs = [x for x in lay2.kvs if x.key != key] if vt is None else replace_kv(lay2, key, vt, raw)
        buf = build(lay2, buf, kvs)
    return buf, f"{base.name}: " + desc.split(": ", 1)[1]


# ------------------------------------------------------------------ worker (runs cases in-process)

def run_model_case(path: str, llama_decode) -> dict:
    """The CLI in-process: llama-decode FILE "hi" -n 2 -c 64 -t 1, stdout and stderr captured."""
    code, lines = run_cli(llama_decode, [path, "hi", "-n", "2", "-c", "64", "-t", "1"])
    if code == "memory" or any("MemoryError" in ln for ln in lines):
        return {"cls": "memory", "detail": lines[-1:] or ["MemoryError"]}
    if code == 0:
        nonfinite = any("not finite" in ln or "non-finite" in ln for ln in lines)
        return {"cls": "ok", "nonfinite": nonfinite}
    if code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in lines[0]:
        return {"cls": "clean", "detail": lines[0][:200]}
    return {"cls": "exception", "detail": f"exit {code}: " + " | ".join(lines[-3:])[:300]}


def run_vocab_case(path: str, lib) -> dict:
    """Tokenizer only: load_tokenizer + tokenize (special and plain) + detokenize."""
    SynapseError, load_tokenizer = lib

    def run():
        tok = load_tokenizer(path)
        ids = tok.tokenize("hi there <|im_end|> </s> \u00e9\u4e2d", add_special=True, parse_special=True)
        tok.tokenize(" \n\n  x", add_special=False, parse_special=False)
        tok.detokenize(ids)

    return library_outcome(run, SynapseError)


VOCAB_SCRIPT = """
import sys
from synapse_nb import SynapseError
from synapse_nb.tokenizer import load_tokenizer
try:
    tok = load_tokenizer(sys.argv[1])
    ids = tok.tokenize("hi there <|im_end|> </s> \u00e9\u4e2d", add_special=True, parse_special=True)
    tok.tokenize(" \\n\\n  x", add_special=False, parse_special=False)
    tok.detokenize(ids)
except SynapseError as e:
    sys.stderr.write("error: " + str(e) + "\\n")
    sys.exit(2)
"""


def run_subprocess_case(path: str, lib) -> dict:
    """--subprocess: one Python start-up per case (the CLI itself, or a tokenizer-only script),
    under the same time and address-space limits; classified from exit status and stderr."""
    kind, args = lib
    cmd = [sys.executable, "-m", "cli.main", path, "hi", "-n", "2", "-c", "64", "-t", "1"] if kind == "model" else \
        [sys.executable, "-c", VOCAB_SCRIPT, path]
    try:
        r = subprocess.run(cmd, cwd=args.root, capture_output=True, timeout=args.soft_timeout,
                           preexec_fn=limit_as(args.mem_mb), text=True, errors="replace")
    except subprocess.TimeoutExpired:
        return {"cls": "timeout", "detail": f"timeout {args.soft_timeout} s"}
    lines = r.stderr.splitlines()
    if r.returncode < 0:
        return {"cls": "signal", "detail": f"signal {-r.returncode}"}
    if "MemoryError" in r.stderr:
        return {"cls": "memory", "detail": lines[-1:]}
    if r.returncode == 0:
        return {"cls": "ok", "nonfinite": "not finite" in r.stderr}
    if r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in r.stderr:
        return {"cls": "clean", "detail": lines[0][:200]}
    return {"cls": "exception", "detail": f"exit {r.returncode}: " + " | ".join(lines[-3:])[:300]}


def worker_main(args) -> None:
    """Read case numbers on stdin; answer each with one JSON line on stdout."""
    sys.path.insert(0, str(Path(args.root).resolve()))
    os.chdir(args.root)
    proto = os.fdopen(os.dup(1), "w", buffering=1)  # the protocol channel; fd 1 itself stays for stray prints
    from cli.main import llama_decode
    from synapse_nb import SynapseError
    from synapse_nb.tokenizer import load_tokenizer

    maker = CaseMaker(args.seed, args.bases)
    tmpdir = Path(tempfile.mkdtemp(prefix="fuzz-gguf-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    # Warm-up before the first case: every kernel the bases use is loaded from Numba's cache (or
    # compiled), so that no case's time includes it.
    warm = [] if args.subprocess else maker.bases  # --subprocess: nothing runs in-process
    for p, kind, _ in warm:
        if kind == "model":
            run_model_case(str(p), llama_decode)
    for p, kind, _ in warm[-1:]:
        if kind == "vocab":
            run_vocab_case(str(p), (SynapseError, load_tokenizer))
    peak = PeakRSS()
    proto.write(json.dumps({"ready": os.getpid()}) + "\n")
    try:
        for line in sys.stdin:
            job = json.loads(line)
            k = job["case"]
            if "file" in job:  # an existing file (--files): run as is
                path, kind, desc = Path(job["file"]), job["kind"], job["file"]
            else:
                data, kind, desc = maker.make(k)
                path = tmpdir / f"case-{k}.gguf"
                path.write_bytes(data)
            try:
                if args.subprocess:  # the child has its own timeout: no alarm here
                    res = run_case(run_subprocess_case, str(path), (kind, args), 0, peak)
                elif kind == "model":
                    res = run_case(run_model_case, str(path), llama_decode, args.soft_timeout, peak)
                else:
                    res = run_case(run_vocab_case, str(path), (SynapseError, load_tokenizer), args.soft_timeout, peak)
            finally:
                if "file" not in job:
                    path.unlink()
            res.update(case=k, desc=desc)
            proto.write(json.dumps(res) + "\n")
            if res.get("retire"):  # grown too much to measure the next case: a fresh worker will
                break
    finally:
        for p in tmpdir.iterdir():
            p.unlink()
        tmpdir.rmdir()


# ------------------------------------------------------------------ parent

def spawn_worker(args) -> Worker:
    cmd = [sys.executable, "-m", "fuzz.gguf", "--worker", "--seed", str(args.seed), "--root", str(args.root),
           "--bases", args.bases, "--soft-timeout", str(args.soft_timeout), "--mem-mb", str(args.mem_mb)] + \
        (["--subprocess"] if args.subprocess else [])
    env = dict(os.environ, PYTHONWARNINGS="default", NUMBA_NUM_THREADS="1")
    if args.boundscheck:  # every array access of every kernel checked (IndexError): a separate cache
        env.update(NUMBA_BOUNDSCHECK="1", NUMBA_CACHE_DIR=str(Path(tempfile.gettempdir()) / "fuzz-gguf-numba-bc"))
    # cwd: this checkout, where `fuzz` is importable (the worker then runs --root's code)
    return Worker(cmd, env, args.mem_mb, ROOT)


def run_campaign(args, files=None) -> dict:
    """Run cases start .. start + n - 1 (or, with files = [(path, kind)], those files) in args.jobs
    workers; returns the summary: counts per class, flagged cases, the largest case, elapsed time."""
    if files is not None:
        args.start, args.n = 0, len(files)
    t0 = time.monotonic()
    job_of = None if files is None else lambda k: {"case": k, "file": str(files[k][0]), "kind": files[k][1]}
    results = run_workers(lambda: spawn_worker(args), args.jobs, list(range(args.start, args.start + args.n)),
                          args.timeout, job_of=job_of, progress=args.progress,
                          hint=f"try --jobs 1 and check --root {args.root}")
    elapsed = time.monotonic() - t0
    sm = summarize(results)
    flagged = sm["flagged"]
    if files is not None:
        return {"elapsed_s": round(elapsed, 1), "counts": sm["counts"],
                "results": [dict(results[k], file=str(files[k][0])) for k in sorted(results)]}
    maker = None
    for x in flagged:
        if "desc" not in x:
            maker = maker or CaseMaker(args.seed, args.bases)
            x["desc"] = maker.make(x["case"])[2]
    summary = {
        "seed": args.seed, "n": args.n, "start": args.start, "root": str(args.root), "bases": args.bases,
        "elapsed_s": round(elapsed, 1), **sm,  # counts, flagged, the largest case's RSS and time
        "ok_nonfinite": sum(1 for x in results.values() if x.get("nonfinite")),
        # one letter per case (o k e s t m: ok clean exception signal timeout memory), to compare runs
        "by_case": "".join("okestm"[CLASSES.index(results[k]["cls"])] for k in sorted(results)),
    }
    if args.save_flagged:
        d = Path(args.save_flagged)
        d.mkdir(parents=True, exist_ok=True)
        maker = maker or CaseMaker(args.seed, args.bases)
        for x in flagged:
            (d / f"seed{args.seed}-case{x['case']}.gguf").write_bytes(maker.make(x["case"])[0])
    return summary


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=1000, help="number of cases")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start", type=int, default=0, help="first case number")
    ap.add_argument("--jobs", type=int, default=2, help="worker processes")
    ap.add_argument("--timeout", type=float, default=30.0, help="hard per-case limit, s (worker killed)")
    ap.add_argument("--soft-timeout", type=float, default=15.0, help="per-case alarm inside the worker, s")
    ap.add_argument("--mem-mb", type=int, default=4096, help="address-space limit of a worker, MiB")
    ap.add_argument("--root", default=str(ROOT), help="checkout whose synapse_nb and cli are run")
    ap.add_argument("--bases", choices=("all", "micro"), default="all")
    ap.add_argument("--boundscheck", action="store_true",
                    help="workers run Numba with NUMBA_BOUNDSCHECK=1 (own kernel cache; the first start compiles "
                         "every kernel): an out-of-bounds read in a forward is an IndexError, not silent")
    ap.add_argument("--subprocess", action="store_true",
                    help="one CLI (or tokenizer script) process per case instead of in-process (slow: to check "
                         "that both agree)")
    ap.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    ap.add_argument("--progress", action="store_true", help="counts on stderr every 30 s")
    ap.add_argument("--save-flagged", metavar="DIR", help="write every flagged case's file to DIR")
    ap.add_argument("--case", type=int, help="with --write: build case CASE only")
    ap.add_argument("--write", metavar="FILE", help="with --case: write that case's file")
    ap.add_argument("--files", nargs="+", metavar="FILE", help="run these GGUF files (as models) instead of cases")
    ap.add_argument("--micro-of", nargs="+", type=int, metavar="CASE",
                    help="with --write DIR: each case's mutation applied to micro-llama-f16.gguf, one file per "
                         "distinct result")
    ap.add_argument("--make-micro", action="store_true",
                    help="(re)build tests/data/fuzz/micro-llama-f16.gguf and micro-bpe-f16.gguf")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.make_micro:
        make_micro(MICRO)
        make_micro_bpe(MICRO_BPE)
        for p in (MICRO, MICRO_BPE):
            print(f"{p}: {p.stat().st_size} bytes")
        return 0
    if args.worker:
        worker_main(args)
        return 0
    if args.micro_of:
        import hashlib

        maker, out, seen = CaseMaker(args.seed, args.bases), Path(args.write), set()
        out.mkdir(parents=True, exist_ok=True)
        for k in args.micro_of:
            v = micro_variant(maker, k)
            if v is None:
                print(f"case {k}: not key-level, no micro variant: {maker.make(k)[2]}")
                continue
            data, desc = v
            h = hashlib.sha256(data).hexdigest()[:12]
            if h not in seen:
                seen.add(h)
                (out / f"seed{args.seed}-case{k}.gguf").write_bytes(data)
                print(f"seed{args.seed}-case{k}.gguf: {desc}")
        return 0
    if args.files:
        s = run_campaign(args, [(Path(f).resolve(), "model") for f in args.files])
        print(json.dumps(s) if args.json else "\n".join(f"{x['cls']:10s} {x['file']}: {x.get('detail', '')}"
                                                          for x in s["results"]))
        return 0
    if args.case is not None:
        data, kind, desc = CaseMaker(args.seed, args.bases).make(args.case)
        if args.write:
            Path(args.write).write_bytes(data)
        print(f"case {args.case} ({kind}): {desc}")
        return 0
    s = run_campaign(args)
    if args.json:
        print(json.dumps(s))
    else:
        print(f"seed {s['seed']}, {s['n']} cases, root {s['root']}: {s['elapsed_s']} s")
        for c in CLASSES:
            print(f"  {c:10s} {s['counts'][c]}")
        print(f"  (ok with non-finite logits: {s['ok_nonfinite']})")
        print(f"  largest case: peak RSS {s['max_rss_mb']} MiB ({s['max_growth_mb']} MiB over its worker's "
              f"baseline), {s['max_s']} s ({s['max_cpu_s']} s of CPU); over a limit: {s['over_limits']}")
        for x in s["flagged"][:50]:
            print(f"  flagged case {x['case']} {x['cls']}{' ' + ', '.join(x['over']) if 'over' in x else ''}: "
                  f"{x.get('detail')} [{x.get('desc')}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
