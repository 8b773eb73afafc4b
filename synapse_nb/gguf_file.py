"""Memory-mapped GGUF reader: header, key/values and tensor table in one pass.

The file is mapped read-only; every tensor's `.data` is a uint8 view into the
mapping (never a copy), so opening a 500 MB model costs only the header parse.
Arrays of strings (tokenizer.ggml.tokens, tokenizer.ggml.merges: ~150k each on
Qwen2.5) are StringArrays: the parse records where each string lies in the map,
one tight loop over the lengths, and the strings are decoded when read (the
whole list at once, about 40x faster than gguf.GGUFReader, which builds several
numpy views per string). The tokenizer reads the merges as UTF-8 bytes straight
from the map (StringArray.utf8) and never makes them Python strings.

The checks reproduce ggml/src/gguf.cpp (gguf_init_from_file_impl) and
llama-model-loader.cpp: bad magic, version 1 / 0 / newer than 3 / byte-swapped,
duplicate keys, unknown value types, `general.alignment` not a u32 power of two,
duplicate tensor names, names of 64+ bytes, n_dims > 4, unknown ggml type ids,
rows not a multiple of the block size, and (from the model loader) tensor data
outside the file. One thing is deliberately more lenient: gguf.cpp requires the
tensors to be laid out back to back in table order; we only require every
offset to be aligned and every tensor to lie inside the file.

Key/values are read through Metadata (GGUFFile.get / get_array / get_per_layer,
or GGUFFile.meta): each read states the GGUF type it expects, as llama.cpp's
llama_model_loader get_key / get_arr / get_key_or_arr do, and a wrong type is a
SynapseError naming the file, the key, the expected and the found type.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from .gguf_spec import (
    GGML_QUANT_SIZES,
    GGUF_DEFAULT_ALIGNMENT,
    GGUF_MAGIC,
    GGMLQuantizationType,
    GGUFValueType,
    Keys,
)

from .errors import SynapseError

GGUF_SUPPORTED_VERSIONS = (2, 3)  # gguf.cpp rejects v1 ("no longer supported") and > GGUF_VERSION
GGML_MAX_DIMS = 4
GGML_MAX_NAME = 64  # gguf.cpp: a tensor name must be shorter than GGML_MAX_NAME bytes

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_HEADER = struct.Struct("<IIQQ")  # magic, version, n_tensors, n_kv

# Fixed-size GGUF value types -> struct format (little-endian, standard sizes).
_FORMAT = {
    GGUFValueType.UINT8: "B",
    GGUFValueType.INT8: "b",
    GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I",
    GGUFValueType.INT32: "i",
    GGUFValueType.FLOAT32: "f",
    GGUFValueType.BOOL: "b",  # one byte, nonzero = true (gguf.cpp reads an int8)
    GGUFValueType.UINT64: "Q",
    GGUFValueType.INT64: "q",
    GGUFValueType.FLOAT64: "d",
}
_NUMERIC = {t: np.dtype("<" + f) for t, f in _FORMAT.items()}
_SCALAR = {t: struct.Struct("<" + f) for t, f in _FORMAT.items()}


def show(s: str) -> str:
    """A key or tensor name as it may appear in a one-line error: as is when short and printable,
    else repr() of its first 60 characters (a corrupted length can swallow control bytes and newlines)."""
    if len(s) <= 80 and s.isprintable():
        return s
    return repr(s[:60]) + ("..." if len(s) > 60 else "")


class _Truncated(Exception):
    """Raised inside the parser when a read runs past the end of the file."""


class StringArray(Sequence):
    """A GGUF ARRAY of STRING, read from the mapped file: a read-only sequence of str.

    Elements are decoded on access (UTF-8, invalid bytes kept as surrogate escapes, as every GGUF
    string); tolist() decodes them all once and keeps the list (iteration and comparison use it).
    utf8() gives the exact bytes of all of them without making str objects. Compares equal to a
    list or tuple of the same strings.

    mv: memoryview of the mapped file; bounds: int64 [n + 1], string i is mv[bounds[i] :
    bounds[i + 1] - 8] (each string's 8-byte length precedes it; bounds[n] is the end of the last
    one + 8).
    """

    __slots__ = ("_mv", "_bounds", "_list")

    def __init__(self, mv: memoryview, bounds: np.ndarray):
        self._mv, self._bounds, self._list = mv, bounds, None

    def __len__(self) -> int:
        return self._bounds.shape[0] - 1

    def __getitem__(self, i):
        if self._list is not None or isinstance(i, slice):
            return self.tolist()[i]
        n = len(self)
        i = int(i)  # an index (a non-integer raises TypeError)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError("StringArray index out of range")
        a, b = int(self._bounds[i]), int(self._bounds[i + 1]) - 8
        return str(self._mv[a:b], "utf-8", "surrogateescape")

    def __iter__(self):
        return iter(self.tolist())

    def __contains__(self, x) -> bool:
        return x in self.tolist()

    def __eq__(self, other) -> bool:
        if isinstance(other, StringArray):
            other = other.tolist()
        if isinstance(other, (list, tuple)):
            return self.tolist() == list(other)
        return NotImplemented

    __hash__ = None  # a sequence compared by value, as list

    def __repr__(self) -> str:
        return f"StringArray({len(self)} strings)"

    def tolist(self) -> list[str]:
        """All strings as a list (decoded on the first call, the same list afterwards)."""
        if self._list is None:
            # The hot loop of a tokenizer's load (150k tokens on Qwen2.5): locals only, slices
            # of a memoryview (no copy before decoding).
            mv, b = self._mv, self._bounds.tolist()
            self._list = [str(mv[lo:hi - 8], "utf-8", "surrogateescape") for lo, hi in zip(b, b[1:])]
        return self._list

    def raw(self) -> tuple[np.ndarray, np.ndarray]:
        """(file, bounds): the mapped file as uint8 [size] and the int64 [n + 1] bounds of the
        strings in it (string i is file[bounds[i] : bounds[i + 1] - 8]); nothing copied."""
        return np.frombuffer(self._mv, np.uint8), self._bounds

    def byte_lengths(self) -> np.ndarray:
        """Each string's length in bytes, int64 [n] (nothing decoded)."""
        return np.diff(self._bounds) - 8

    def utf8(self) -> tuple[np.ndarray, np.ndarray]:
        """(bytes, offsets): every string's bytes back to back, uint8 [total], and where each
        starts, int64 [n + 1] (offsets[n] = total); the bytes are the file's, so equal to
        "".join(strings).encode("utf-8", "surrogateescape")."""
        b = self._bounds
        n = b.shape[0] - 1
        if n == 0:
            return np.zeros(0, np.uint8), np.zeros(1, np.int64)
        lens = np.diff(b) - 8
        lo = int(b[0])
        span = np.frombuffer(self._mv, np.uint8, count=int(b[-1]) - 8 - lo, offset=lo)
        # keep each string's bytes, drop the 8-byte length before every string but the first
        keep = np.empty(2 * n - 1, np.int64)
        keep[0::2] = lens
        keep[1::2] = 8
        pattern = np.zeros(2 * n - 1, np.bool_)
        pattern[0::2] = True
        mask = np.repeat(pattern, keep)
        offsets = np.zeros(n + 1, np.int64)
        np.cumsum(lens, out=offsets[1:])
        return np.ascontiguousarray(span[mask]), offsets


@dataclass(frozen=True, eq=False)
class TensorInfo:
    """One entry of the tensor table, with its bytes in the memory map.

    name: GGUF tensor name, e.g. "blk.0.attn_q.weight".
    ggml_type: gguf_spec.GGMLQuantizationType (F32, Q4_K, ...; gguf-py's names and values).
    shape: numpy order, outermost first: a weight is (n_out, n_in), i.e. the
        GGUF `ne` reversed; shape[-1] is the row length in elements.
    offset: absolute byte offset of the data in the file.
    data: uint8 1-D view of the tensor's n_bytes bytes in the memory map (no copy,
        read-only).
    """

    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]
    offset: int
    data: np.ndarray = field(repr=False)

    @property
    def n_elements(self) -> int:
        """Number of elements (product of shape; 1 for a 0-d tensor)."""
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1

    @property
    def row_bytes(self) -> int:
        """Bytes per row of shape[-1] elements: (shape[-1] / block size) * block bytes."""
        block, type_size = GGML_QUANT_SIZES[self.ggml_type]
        return (self.shape[-1] if self.shape else 1) // block * type_size

    def rows(self) -> np.ndarray:
        """uint8 2-D view [n_rows, row_bytes] of the data, n_rows = product of shape[:-1].

        Row r holds the blocks of elements r*shape[-1] .. (r+1)*shape[-1]-1, as ggml
        lays out ne[0]-long rows. A 1-D tensor is one row. No copy.
        """
        rb = self.row_bytes
        return self.data.reshape(-1, rb) if rb else self.data.reshape(0, 0)


REQUIRED = object()  # default= of the Metadata getters: the key must be present


def _type_name(vtype: GGUFValueType, etype: GGUFValueType | None = None) -> str:
    """A GGUF type as llama.cpp's gguf_type_name spells it (upper case here): UINT32, ARRAY of FLOAT32."""
    return f"ARRAY of {etype.name}" if vtype == GGUFValueType.ARRAY and etype is not None else vtype.name


def _types(t) -> tuple[GGUFValueType, ...]:
    return tuple(t) if isinstance(t, (tuple, list, frozenset, set)) else (t,)


# Python value -> GGUF type, for key/values built by hand (Metadata.from_values: tests, tools).
_DTYPE_TO_VTYPE = {np.dtype(d): t for t, d in _NUMERIC.items() if t != GGUFValueType.BOOL}


def _infer_type(v) -> tuple[GGUFValueType, GGUFValueType | None]:
    if isinstance(v, (bool, np.bool_)):
        return GGUFValueType.BOOL, None
    if isinstance(v, str):
        return GGUFValueType.STRING, None
    if isinstance(v, (int, np.integer)):
        v = int(v)
        return (GGUFValueType.UINT32 if 0 <= v < 1 << 32 else
                GGUFValueType.INT64 if -(1 << 63) <= v < 1 << 63 else GGUFValueType.UINT64), None
    if isinstance(v, (float, np.floating)):
        return GGUFValueType.FLOAT32, None
    if isinstance(v, StringArray):
        return GGUFValueType.ARRAY, GGUFValueType.STRING
    if isinstance(v, (list, tuple)):
        if all(isinstance(x, str) for x in v):
            return GGUFValueType.ARRAY, GGUFValueType.STRING
        return _infer_type(np.asarray(v))
    if isinstance(v, np.ndarray) and v.ndim == 1:
        if v.dtype == np.bool_:
            return GGUFValueType.ARRAY, GGUFValueType.BOOL
        et = _DTYPE_TO_VTYPE.get(v.dtype.newbyteorder("<") if v.dtype.byteorder == ">" else v.dtype)
        if et is not None:
            return GGUFValueType.ARRAY, et
    raise TypeError(f"no GGUF type for a value of type {type(v).__name__}")


class Metadata:
    """Typed read access to GGUF key/values: the one way keys are read in synapse_nb.

    Every read states the GGUF type it expects, as llama.cpp's llama_model_loader does
    (GGUFMeta::GKV<T>::get_kv requires the exact type: "key %s has wrong type %s but expected
    type %s"; get_arr checks the element type; get_key_or_arr takes a per-layer array or a scalar).
    A wrong type, element type or length raises SynapseError naming the file, the key, the
    expected and the found type; nothing is converted silently.

    kv: key -> value as GGUFFile.kv; kv_types: key -> (GGUFValueType, element type or None);
    where: prefix of error messages, e.g. "model.gguf: ".
    """

    def __init__(self, kv: dict, kv_types: dict, where: str = ""):
        self.kv, self.kv_types, self.where = kv, kv_types, where

    @classmethod
    def from_values(cls, kv: dict, where: str = "") -> "Metadata":
        """Metadata of a key/value dict built by hand (Python values, no GGUF types): types are
        inferred: bool BOOL, str STRING, int UINT32 (INT64 / UINT64 outside its range), float
        FLOAT32, list[str] ARRAY of STRING, 1-D numpy arrays ARRAY of their dtype."""
        return cls(kv, {k: _infer_type(v) for k, v in kv.items()}, where)

    def __contains__(self, key: str) -> bool:
        return key in self.kv

    def _missing(self, key, default, what="key"):
        if default is REQUIRED:
            raise SynapseError(f"{self.where}missing required {what} {show(key)}")
        return default

    def _wrong(self, key, expected: str):
        vt, et = self.kv_types[key]
        raise SynapseError(f"{self.where}key {show(key)} has wrong type {_type_name(vt, et)} but expected type "
                           f"{expected}")

    def get(self, key: str, vtype, default=REQUIRED):
        """The scalar value of `key`, which must be of GGUF type `vtype` (or one of a tuple of types).

        Returns int (integer types), float (FLOAT32 / FLOAT64), bool (BOOL) or str (STRING);
        `default` when the key is absent (SynapseError "missing required key" without a default).
        Raises SynapseError when the key has another type (an array included).
        """
        if key not in self.kv:
            return self._missing(key, default)
        allowed = _types(vtype)
        if self.kv_types[key][0] not in allowed:
            self._wrong(key, " or ".join(t.name for t in allowed))
        return self.kv[key]

    def get_array(self, key: str, etype, length: int | None = None, min_length: int | None = None,
                  default=REQUIRED):
        """The array value of `key`: elements of GGUF type `etype` (or one of a tuple of types).

        length: exact number of elements required; min_length: at least that many.
        Returns the strings (STRING: a file's StringArray, a dict's list) or a 1-D numpy array
        (numeric; np.bool_ for BOOL);
        `default` when absent. Raises SynapseError for a scalar, another element type or a
        wrong length.
        """
        if key not in self.kv:
            return self._missing(key, default, "array key")
        allowed = _types(etype)
        vt, et = self.kv_types[key]
        if vt != GGUFValueType.ARRAY or et not in allowed:
            self._wrong(key, " or ".join(f"ARRAY of {t.name}" for t in allowed))
        v = self.kv[key]
        if length is not None and len(v) != length:
            raise SynapseError(f"{self.where}key {show(key)} has wrong array length; expected {length}, "
                               f"got {len(v)}")
        if min_length is not None and len(v) < min_length:
            raise SynapseError(f"{self.where}key {show(key)} has {len(v)} elements, expected at least "
                               f"{min_length}")
        return v

    def get_per_layer(self, key: str, n_layer: int, default=REQUIRED) -> list[int]:
        """A per-layer integer (head_count, head_count_kv, feed_forward_length) as n_layer ints.

        llama_model_loader::get_key_or_arr: a UINT32 scalar (repeated for every layer) or an
        array of exactly n_layer INT32 / UINT32 / BOOL elements (get_arr's accepted types).
        `default` (an int) is repeated when the key is absent.
        """
        if key not in self.kv:
            d = self._missing(key, default)
            return d if d is None else [d] * n_layer
        if self.kv_types[key][0] == GGUFValueType.ARRAY:
            a = self.get_array(key, (GGUFValueType.INT32, GGUFValueType.UINT32, GGUFValueType.BOOL), length=n_layer)
            return [int(x) for x in a]
        return [self.get(key, GGUFValueType.UINT32)] * n_layer


@dataclass(eq=False)
class GGUFFile:
    """An opened GGUF file (see open_gguf).

    path: the file.  version: GGUF version (2 or 3).  alignment: data alignment
    in bytes (general.alignment, default 32).  data_offset: absolute offset of
    the tensor data section.
    kv: key -> value, in file order. Scalars are int / float / bool / str;
        arrays of strings are StringArrays (sequences of str, decoded when read); numeric
        arrays are 1-D numpy arrays
        (little-endian, views into the map; bool arrays are copied to np.bool_).
        Strings are UTF-8; invalid bytes are kept as surrogate escapes
        (s.encode("utf-8", "surrogateescape") gives back the exact bytes).
    kv_types: key -> (GGUFValueType, element GGUFValueType for arrays else None).
    tensors: name -> TensorInfo, in table order.
    mapped: the whole file as a read-only uint8 array over the memory map (the
        base of every tensor's data; the mapping lives as long as any view).
    """

    path: Path
    version: int
    alignment: int
    data_offset: int
    kv: dict[str, object]
    kv_types: dict[str, tuple[GGUFValueType, GGUFValueType | None]]
    tensors: dict[str, TensorInfo]
    mapped: np.ndarray = field(repr=False)

    @property
    def arch(self) -> str | None:
        """general.architecture (a string), or None when absent; SynapseError when it is not a string."""
        return self.get(Keys.General.ARCHITECTURE, GGUFValueType.STRING, None)

    @property
    def meta(self) -> "Metadata":
        """The key/values with their GGUF types, for typed reads (Metadata.get / get_array / get_per_layer)."""
        return Metadata(self.kv, self.kv_types, f"{self.path}: ")

    def get(self, key: str, vtype, default=REQUIRED):
        """Metadata.get on this file's key/values (errors name the file)."""
        return self.meta.get(key, vtype, default)

    def get_array(self, key: str, etype, length: int | None = None, min_length: int | None = None,
                  default=REQUIRED):
        """Metadata.get_array on this file's key/values (errors name the file)."""
        return self.meta.get_array(key, etype, length=length, min_length=min_length, default=default)

    def get_per_layer(self, key: str, n_layer: int, default=REQUIRED):
        """Metadata.get_per_layer on this file's key/values (errors name the file)."""
        return self.meta.get_per_layer(key, n_layer, default)

    def tensor(self, name: str) -> TensorInfo:
        """The tensor called `name`; SynapseError naming it and the file when absent."""
        t = self.tensors.get(name)
        if t is None:
            raise SynapseError(f"{self.path}: missing tensor {name}")
        return t


# Arrays of at least this many strings are walked by a compiled loop (gguf_strings; its cache
# load costs ~2 ms, the Python loop 0.2 us a string); None: every array in Python (a process that
# would otherwise compile the loop a second time: compilation.helper)
COMPILED_STRINGS_MIN = 16384


class _Reader:
    """Cursor over the mapped bytes. Every read past the end raises _Truncated."""

    def __init__(self, mv: memoryview):
        self.mv = mv
        self.size = len(mv)
        self.pos = 0
        self.where = "the GGUF header"  # what is being read, for the truncation error

    def take(self, st: struct.Struct):
        try:
            (v,) = st.unpack_from(self.mv, self.pos)
        except struct.error:
            raise _Truncated(self.where) from None
        self.pos += st.size
        return v

    def string(self) -> str:
        n = self.take(_U64)
        end = self.pos + n
        if end > self.size:
            raise _Truncated(self.where)
        s = str(self.mv[self.pos : end], "utf-8", "surrogateescape")
        self.pos = end
        return s

    def strings(self, n: int) -> StringArray:
        # The hot loop of the header (150k tokens + 150k merges on Qwen2.5): locals only, the
        # lengths read and the strings' places recorded (decoded when read: StringArray). A
        # length running past the end is caught by the position check after the loop.
        mv, pos, unpack, size = self.mv, self.pos, _U64.unpack_from, self.size
        if pos + 8 * n > size:  # each string has at least its 8-byte length: a bad count fails here
            raise _Truncated(self.where)
        if COMPILED_STRINGS_MIN is not None and n >= COMPILED_STRINGS_MIN:
            from .gguf_strings import string_bounds

            bounds = np.empty(n + 1, np.int64)
            end = string_bounds(np.frombuffer(mv, np.uint8), pos, size, bounds)
            if end < 0:
                raise _Truncated(self.where)
            self.pos = int(end)
            return StringArray(mv, bounds)
        bounds = [0] * (n + 1)
        try:
            for i in range(n):
                (ln,) = unpack(mv, pos)
                pos += 8
                bounds[i] = pos
                pos += ln
        except (struct.error, OverflowError):  # OverflowError: past a length >= 2**63
            raise _Truncated(self.where) from None
        if pos > size:
            raise _Truncated(self.where)
        bounds[n] = pos + 8
        self.pos = pos
        return StringArray(mv, np.array(bounds, np.int64))

    def array(self, dtype: np.dtype, n: int) -> np.ndarray:
        end = self.pos + n * dtype.itemsize
        if end > self.size:
            raise _Truncated(self.where)
        a = np.frombuffer(self.mv, dtype=dtype, count=n, offset=self.pos)
        self.pos = end
        return a


def _value_type(raw: int, where: str) -> GGUFValueType:
    try:
        return GGUFValueType(raw)
    except ValueError:
        raise SynapseError(f"{where} has unknown GGUF value type {raw}") from None


def _read_value(r: _Reader, vtype: GGUFValueType, where: str):
    """Read one value of type vtype; returns (value, element type or None)."""
    if vtype == GGUFValueType.STRING:
        return r.string(), None
    if vtype == GGUFValueType.BOOL:
        return r.take(_SCALAR[vtype]) != 0, None
    if vtype in _SCALAR:
        v = r.take(_SCALAR[vtype])
        return (float(v) if vtype in (GGUFValueType.FLOAT32, GGUFValueType.FLOAT64) else v), None
    # ARRAY: element type, count, elements (gguf.cpp allows no nested arrays)
    etype = _value_type(r.take(_U32), where + " array")
    n = r.take(_U64)
    if etype == GGUFValueType.STRING:
        return r.strings(n), etype
    if etype == GGUFValueType.ARRAY:
        raise SynapseError(f"{where} is a nested array, which GGUF does not allow")
    a = r.array(_NUMERIC[etype], n)
    return (a != 0 if etype == GGUFValueType.BOOL else a), etype


def open_gguf(path) -> GGUFFile:
    """Open a GGUF file: memory-map it read-only and parse header, key/values and tensor table.

    path: str or Path of a GGUF v2/v3 little-endian file.
    Returns a GGUFFile whose tensors' data are views into the map (no tensor
    bytes are read until used).
    Raises SynapseError (one line, naming the file) on: missing/unreadable file,
    bad magic, unsupported version, truncated header, duplicate key, unknown value
    type, bad general.alignment, duplicate tensor name, tensor name too long,
    n_dims > 4, unknown ggml type id, row length not a multiple of the block size,
    misaligned tensor offset, tensor data past the end of the file.
    Reproduces ggml/src/gguf.cpp gguf_init_from_file_impl (see module docstring).
    """
    path = Path(path)
    try:
        # only a regular file can be mapped; opening a FIFO would wait for a writer
        if path.exists() and not path.is_dir() and not path.is_file():
            raise SynapseError(f"{path}: not a regular file, not a GGUF file")
        with open(path, "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except FileNotFoundError:
        raise SynapseError(f"{path}: no such file") from None
    except (OSError, ValueError) as e:  # directory, permission, empty file (cannot mmap)
        if path.is_file() and path.stat().st_size == 0:
            raise SynapseError(f"{path}: empty file, not a GGUF file") from None
        raise SynapseError(f"{path}: cannot open: {getattr(e, 'strerror', None) or e}") from None
    buf = np.frombuffer(mm, dtype=np.uint8)  # keeps the mapping alive as long as any view
    try:
        return _parse(path, buf)
    except _Truncated as e:
        where = e.args[0] if e.args else "the GGUF header"
        raise SynapseError(f"{path}: truncated file ({buf.size} bytes): {where} runs past the end of the file") \
            from None


def _parse(path: Path, buf: np.ndarray) -> GGUFFile:
    r = _Reader(memoryview(buf))
    if r.size < 4 or _U32.unpack_from(r.mv, 0)[0] != GGUF_MAGIC:
        head = bytes(r.mv[:4])
        raise SynapseError(f"{path}: not a GGUF file (magic {head!r}, expected b'GGUF')")
    if r.size < _HEADER.size:
        raise _Truncated
    _, version, n_tensors, n_kv = _HEADER.unpack_from(r.mv, 0)
    r.pos = _HEADER.size
    if version & 0xFFFF == 0 and version != 0:
        raise SynapseError(f"{path}: GGUF version {version:#x} looks byte-swapped; big-endian GGUF is not supported")
    if version not in GGUF_SUPPORTED_VERSIONS:
        raise SynapseError(f"{path}: unsupported GGUF version {version} (supported: 2, 3)")

    kv: dict[str, object] = {}
    kv_types: dict[str, tuple[GGUFValueType, GGUFValueType | None]] = {}
    for i in range(n_kv):
        r.where = f"key/value {i} of {n_kv}" + (f" (after key {show(key)})" if i else "")
        key = r.string()
        r.where = f"the value of key {show(key)}"
        if not key:
            raise SynapseError(f"{path}: key {i} is empty")
        if key in kv:
            raise SynapseError(f"{path}: duplicate key {show(key)}")
        vtype = _value_type(r.take(_U32), f"{path}: key {show(key)}")
        kv[key], etype = _read_value(r, vtype, f"{path}: key {show(key)}")
        kv_types[key] = (vtype, etype)

    # gguf.cpp: general.alignment must be a UINT32 power of two
    alignment = Metadata(kv, kv_types, f"{path}: ").get(Keys.General.ALIGNMENT, GGUFValueType.UINT32,
                                                          GGUF_DEFAULT_ALIGNMENT)
    if alignment == 0 or alignment & (alignment - 1):
        raise SynapseError(f"{path}: key general.alignment must be a u32 power of two, got {alignment!r}")

    table = []
    names = set()
    for j in range(n_tensors):
        r.where = f"tensor info {j} of {n_tensors}" + (f" (after tensor {show(name)})" if j else "")
        name = r.string()
        r.where = f"the tensor info of {show(name)}"
        if len(name.encode("utf-8", "surrogateescape")) >= GGML_MAX_NAME:
            raise SynapseError(f"{path}: tensor name {show(name)} is {GGML_MAX_NAME} bytes or longer")
        if name in names:
            raise SynapseError(f"{path}: duplicate tensor name {show(name)}")
        names.add(name)
        n_dims = r.take(_U32)
        if n_dims > GGML_MAX_DIMS:
            raise SynapseError(f"{path}: tensor {show(name)} has {n_dims} dimensions (at most {GGML_MAX_DIMS})")
        ne = [r.take(_U64) for _ in range(n_dims)]
        raw_type = r.take(_U32)
        offset = r.take(_U64)
        try:
            ggml_type = GGMLQuantizationType(raw_type)
            block, type_size = GGML_QUANT_SIZES[ggml_type]
        except (ValueError, KeyError):
            raise SynapseError(f"{path}: tensor {show(name)} has unknown ggml type id {raw_type}") from None
        if any(d >= 1 << 63 for d in ne):
            raise SynapseError(f"{path}: tensor {show(name)} has a negative dimension {ne}")
        if ne and ne[0] % block:
            raise SynapseError(
                f"{path}: tensor {show(name)} of type {ggml_type.name} has rows of {ne[0]} elements, "
                f"not a multiple of the block size {block}"
            )
        if offset % alignment:
            raise SynapseError(f"{path}: tensor {show(name)} data offset {offset} is not a multiple of the alignment {alignment}")
        n_elements = int(np.prod(ne, dtype=object)) if ne else 1
        table.append((name, ggml_type, tuple(reversed(ne)), offset, n_elements // block * type_size))

    # The data section starts at the next multiple of the alignment after the table.
    data_offset = -(-r.pos // alignment) * alignment
    if table and data_offset > r.size:
        raise _Truncated("the tensor data section")
    tensors = {}
    for name, ggml_type, shape, offset, n_bytes in table:
        start = data_offset + offset
        if start + n_bytes > r.size:
            raise SynapseError(
                f"{path}: tensor {show(name)} data ({n_bytes} bytes at offset {start}) runs past the end of the file "
                f"({r.size} bytes): truncated file?"
            )
        tensors[name] = TensorInfo(name, ggml_type, shape, start, buf[start : start + n_bytes])
    return GGUFFile(path, version, alignment, data_offset, kv, kv_types, tensors, buf)
