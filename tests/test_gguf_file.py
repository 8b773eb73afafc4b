"""open_gguf against gguf.GGUFReader (the reference reader), and its errors on damaged files."""

import numpy as np
import pytest
from conftest import REAL_MODELS, TINY_GGUFS, VOCAB_GGUFS, damaged_copy, part_offset, real_model, tiny
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import quant_shape_to_byte_shape

from synapse_nb.errors import SynapseError
from synapse_nb.gguf_file import StringArray, open_gguf


def _addr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def assert_matches_reader(path):
    """Every key/value and every tensor-table entry of open_gguf equals GGUFReader's."""
    g = open_gguf(path)
    r = GGUFReader(path)
    assert g.version == r.fields["GGUF.version"].contents()
    assert g.alignment == r.alignment
    assert g.data_offset == r.data_offset

    fields = {k: f for k, f in r.fields.items() if not k.startswith("GGUF.")}
    assert list(g.kv) == list(fields)
    for k, f in fields.items():
        vtype, etype = g.kv_types[k]
        assert vtype == f.types[0], k
        v, ref = g.kv[k], f.contents()
        if vtype == GGUFValueType.ARRAY:
            assert etype == f.types[-1], k
            if etype == GGUFValueType.STRING:
                assert isinstance(v, StringArray) and len(v) == len(ref), k
                assert not ref or (v[0], v[-1]) == (ref[0], ref[-1]), k  # decoded one by one
                v = v.tolist()
            else:
                assert isinstance(v, np.ndarray) and v.ndim == 1, k
                v = v.tolist()
        assert type(v) is type(ref), k
        assert v == ref, k

    assert list(g.tensors) == [t.name for t in r.tensors]
    for rt in r.tensors:
        t = g.tensors[rt.name]
        assert t.name == rt.name
        assert t.ggml_type == rt.tensor_type, t.name
        assert t.shape == tuple(reversed(rt.shape.tolist())), t.name
        assert t.offset == rt.data_offset, t.name
        # data: a read-only view at the right place in the map, same bytes as the reference
        assert t.data.dtype == np.uint8 and t.data.ndim == 1 and t.data.size == rt.n_bytes
        assert not t.data.flags.owndata and not t.data.flags.writeable
        assert _addr(t.data) - _addr(g.mapped) == rt.data_offset
        assert np.array_equal(t.data, rt.data.reshape(-1).view(np.uint8)), t.name
        byte_shape = quant_shape_to_byte_shape(t.shape, t.ggml_type) if t.shape else (t.data.size,)
        assert t.rows().shape == (int(np.prod(byte_shape[:-1])), byte_shape[-1]), t.name
        assert np.shares_memory(t.rows(), g.mapped)
    return g


@pytest.mark.parametrize("path", TINY_GGUFS + VOCAB_GGUFS, ids=lambda p: p.name)
def test_matches_gguf_reader(path):
    assert_matches_reader(path)


@pytest.mark.parametrize("name", list(REAL_MODELS))
def test_matches_gguf_reader_real_models(name):
    g = assert_matches_reader(real_model(name))
    n_tokens = {"smollm2-135m-instruct-q4_1": 49152, "qwen2.5-coder-0.5b-instruct-q4_k_m": 151936,
                "gemma-3-270m-q4_k_m": 262144}[name]
    assert len(g.kv["tokenizer.ggml.tokens"]) == n_tokens


def test_fixture_sets_are_present():
    # guards the parametrized tests above against an empty glob
    assert len(TINY_GGUFS) == 23 and len(VOCAB_GGUFS) == 8


def test_all_value_types_and_custom_alignment(tmp_path):
    """A file written by GGUFWriter with every value type, a 64-byte alignment and odd-sized tensors."""
    path = tmp_path / "kitchen-sink.gguf"
    w = GGUFWriter(path, "llama")
    w.add_custom_alignment(64)
    T = GGUFValueType
    scalars = {T.UINT8: 200, T.INT8: -100, T.UINT16: 60000, T.INT16: -30000, T.UINT32: 4_000_000_000,
               T.INT32: -2_000_000_000, T.FLOAT32: 0.1, T.BOOL: True, T.STRING: "héllo ☃",
               T.UINT64: 2**63 + 5, T.INT64: -(2**62), T.FLOAT64: 1e-300}
    for vt, val in scalars.items():
        w.add_key_value(f"test.scalar.{vt.name.lower()}", val, vt)
        if vt != T.STRING:
            w.add_key_value(f"test.array.{vt.name.lower()}", [val, val], T.ARRAY, vt)
    w.add_key_value("test.array.string", ["", "a", "日本語", "x" * 1000], T.ARRAY, T.STRING)
    w.add_tensor("a", np.arange(7, dtype=np.float32))
    w.add_tensor("b", np.ones((3, 5), dtype=np.float16))
    w.add_tensor("c", np.arange(24, dtype=np.int32).reshape(2, 3, 4))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    g = assert_matches_reader(path)
    assert g.alignment == 64 and g.data_offset % 64 == 0
    assert g.kv["test.array.string"] == ["", "a", "日本語", "x" * 1000]
    buf, offsets = open_gguf(path).kv["test.array.string"].utf8()  # bytes read from the file as they are
    assert buf.tobytes() == "a日本語".encode() + b"x" * 1000 and offsets.tolist() == [0, 0, 1, 10, 1010]
    assert g.kv["test.scalar.bool"] is True and g.kv["test.array.bool"].dtype == np.bool_
    assert np.array_equal(g.tensors["b"].data.view(np.float16).reshape(3, 5), np.ones((3, 5), np.float16))
    assert g.tensors["c"].rows().shape == (6, 16)


def test_invalid_utf8_is_kept_as_surrogate_escapes(tmp_path):
    path = tmp_path / "bad-utf8.gguf"
    w = GGUFWriter(path, "llama")
    w.add_key_value("test.tokens", [b"ok", b"\xff\xfe", b"\xe2\x82"], GGUFValueType.ARRAY, GGUFValueType.STRING)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    toks = open_gguf(path).kv["test.tokens"]
    assert toks[1].encode("utf-8", "surrogateescape") == b"\xff\xfe"
    assert [t.encode("utf-8", "surrogateescape") for t in toks] == [b"ok", b"\xff\xfe", b"\xe2\x82"]
    buf, offsets = toks.utf8()  # the file's bytes, never decoded
    assert buf.tobytes() == b"ok\xff\xfe\xe2\x82" and offsets.tolist() == [0, 2, 4, 6]


# ---------------------------------------------------------------- damaged files

SRC = tiny("tiny-llama-f32")


def _damaged(tmp_path, patches=(), size=None, src=SRC):
    return damaged_copy(src, tmp_path / f"damaged-{src.name}", patches, size)


def _tensor_part(name, index, src=SRC):
    """(file offset, value) of part `index` of a tensor's info: 1 name, 2 n_dims, 3 dims, 4 type, 5 offset."""
    r = GGUFReader(src)
    part = next(t for t in r.tensors if t.name == name).field.parts[index]
    return part_offset(r, part), int(part[0])


def assert_error(path, *words):
    with pytest.raises(SynapseError) as e:
        open_gguf(path)
    msg = str(e.value)
    assert str(path) in msg, msg
    assert "\n" not in msg
    for w in words:
        assert w in msg, msg
    return msg


def test_bad_magic(tmp_path):
    assert_error(_damaged(tmp_path, [(0, b"GGML")]), "not a GGUF file")


@pytest.mark.parametrize("version", [0, 1, 4])
def test_unsupported_version(tmp_path, version):
    assert_error(_damaged(tmp_path, [(4, version.to_bytes(4, "little"))]), f"unsupported GGUF version {version}")


def test_byte_swapped_version(tmp_path):
    assert_error(_damaged(tmp_path, [(4, (3).to_bytes(4, "big"))]), "big-endian")


@pytest.mark.parametrize("size", [2, 10, 23, 100, 5000])
def test_truncated_header(tmp_path, size):
    msg = assert_error(_damaged(tmp_path, size=size))
    assert ("truncated" in msg) if size >= 4 else ("not a GGUF" in msg)


def test_huge_array_count(tmp_path):
    r = GGUFReader(SRC)
    off = part_offset(r, r.fields["tokenizer.ggml.tokens"].parts[4])  # parts: klen, key, type, etype, count
    assert_error(_damaged(tmp_path, [(off, (2**60).to_bytes(8, "little"))]), "truncated")


def test_tensor_data_past_end_of_file(tmp_path):
    size = SRC.stat().st_size
    assert_error(_damaged(tmp_path, size=size - 1), "blk.1.ffn_down.weight", "past the end of the file")


def test_empty_and_missing_files(tmp_path):
    (tmp_path / "empty.gguf").write_bytes(b"")
    assert_error(tmp_path / "empty.gguf", "empty file")
    assert_error(tmp_path / "missing.gguf", "no such file")
    assert_error(tmp_path, "cannot open")


@pytest.mark.parametrize("type_id", [4, 5, 31, 99, 2**31])
def test_unknown_ggml_type(tmp_path, type_id):
    off, _ = _tensor_part("blk.0.attn_q.weight", 4)
    assert_error(_damaged(tmp_path, [(off, type_id.to_bytes(4, "little"))]),
                 "blk.0.attn_q.weight", f"unknown ggml type id {type_id}")


def test_unaligned_tensor_offset(tmp_path):
    off, rel = _tensor_part("blk.0.attn_k.weight", 5)
    assert_error(_damaged(tmp_path, [(off, (rel + 4).to_bytes(8, "little"))]),
                 "blk.0.attn_k.weight", "not a multiple of the alignment 32")


def test_duplicate_tensor_name(tmp_path):
    off, _ = _tensor_part("blk.0.attn_k.weight", 1)
    assert_error(_damaged(tmp_path, [(off, b"blk.0.attn_q.weight")]), "duplicate tensor name blk.0.attn_q.weight")


def test_too_many_dims(tmp_path):
    off, _ = _tensor_part("blk.0.attn_q.weight", 2)
    assert_error(_damaged(tmp_path, [(off, (5).to_bytes(4, "little"))]), "blk.0.attn_q.weight", "5 dimensions")


def test_row_not_multiple_of_block(tmp_path):
    src = tiny("tiny-llama-q4_0")
    off, _ = _tensor_part("blk.0.attn_q.weight", 3, src)
    assert_error(_damaged(tmp_path, [(off, (250).to_bytes(8, "little"))], src=src),
                 "blk.0.attn_q.weight", "Q4_0", "not a multiple of the block size 32")


def test_duplicate_key(tmp_path):
    r = GGUFReader(SRC)
    off = part_offset(r, r.fields["tokenizer.ggml.eos_token_id"].parts[1])
    assert_error(_damaged(tmp_path, [(off, b"tokenizer.ggml.bos_token_id")]), "duplicate key tokenizer.ggml.bos_token_id")


def test_unknown_value_type(tmp_path):
    r = GGUFReader(SRC)
    off = part_offset(r, r.fields["llama.block_count"].parts[2])
    assert_error(_damaged(tmp_path, [(off, (13).to_bytes(4, "little"))]), "llama.block_count", "unknown GGUF value type 13")


def test_bad_alignment_key(tmp_path):
    path = tmp_path / "align48.gguf"
    w = GGUFWriter(path, "llama")
    w.add_uint32("general.alignment", 48)
    w.add_tensor("a", np.zeros(8, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert_error(path, "general.alignment", "power of two")


# ---------------------------------------------------------------- fuzz findings (bad-input pass)


def test_string_length_of_2_63_in_a_string_array(tmp_path):
    # A string length >= 2**63 inside tokenizer.ggml.tokens made memoryview slicing raise
    # OverflowError (an internal error with traceback) instead of the truncation error.
    r = GGUFReader(SRC)
    off = part_offset(r, r.fields["tokenizer.ggml.tokens"].parts[5])  # length of the first token
    for n in (2**63, 2**64 - 1):
        assert_error(_damaged(tmp_path, [(off, n.to_bytes(8, "little"))]), "truncated")


def test_corrupt_key_length_gives_a_printable_one_line_error(tmp_path):
    # A key whose length swallows the bytes that follow it (its type, value, the next key's length):
    # the error names the key, and its control bytes (NULs, possibly newlines) are escaped.
    r = GGUFReader(SRC)
    field = r.fields["tokenizer.ggml.unknown_token_id"]
    off = part_offset(r, field.parts[0])
    n = len("tokenizer.ggml.unknown_token_id") + 20
    msg = assert_error(_damaged(tmp_path, [(off, n.to_bytes(8, "little"))]), "tokenizer.ggml.unknown_token_id")
    assert msg.isprintable(), msg
    assert "\\x00" in msg  # shown escaped, as repr() does


def test_truncation_error_names_the_section(tmp_path):
    # was always "the GGUF header runs past the end of the file", wherever the cut was
    off, _ = _tensor_part("blk.0.attn_k.weight", 3)  # inside its dims
    assert_error(_damaged(tmp_path, size=off + 4), "truncated file", "the tensor info of blk.0.attn_k.weight")
    r = GGUFReader(SRC)
    off = part_offset(r, r.fields["tokenizer.ggml.scores"].parts[-1])
    assert_error(_damaged(tmp_path, size=off), "truncated file", "the value of key tokenizer.ggml.scores")


def test_gguf_spec_agrees_with_the_gguf_package():
    """synapse_nb.gguf_spec (read by the loader instead of importing gguf) has gguf's names and values."""
    import gguf

    from synapse_nb import gguf_spec as S

    for t in S.GGMLQuantizationType:
        g = gguf.GGMLQuantizationType[t.name]
        assert int(g) == int(t) and gguf.GGML_QUANT_SIZES[g] == S.GGML_QUANT_SIZES[t], t
    assert len(S.GGML_QUANT_SIZES) == len(S.GGMLQuantizationType)
    assert [(t.name, int(t)) for t in S.GGUFValueType] == [(t.name, int(t)) for t in gguf.GGUFValueType]
    assert (S.GGUF_MAGIC, S.GGUF_DEFAULT_ALIGNMENT) == (gguf.GGUF_MAGIC, gguf.GGUF_DEFAULT_ALIGNMENT)
    n = 0
    for group in ("General", "LLM", "Attention", "Rope", "Tokenizer"):
        for key, value in vars(getattr(S.Keys, group)).items():
            if not key.startswith("_"):
                assert getattr(getattr(gguf.Keys, group), key) == value, (group, key)
                n += 1
    assert n > 40
