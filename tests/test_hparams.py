"""HParams.from_gguf on the fixtures (expected values from /work/shared/README.md) and its errors."""

import math

import numpy as np
import pytest
from conftest import TINY_GGUFS, VOCAB, damaged_copy, part_offset, real_model, tiny
from gguf import GGUFReader

from synapse_nb.errors import SynapseError
from synapse_nb.gguf_file import open_gguf
from synapse_nb.hparams import HParams, expected_tensors

f32 = lambda x: float(np.float32(x))  # noqa: E731  the float32 value a GGUF key holds

# What every tiny fixture shares (README "fixtures/tiny"): 512-token vocabulary, n_embd 256,
# 2 layers, 4 query heads, n_ff 768, context 512.
COMMON = dict(n_vocab=512, n_embd=256, n_layer=2, n_head=4, n_ff=768, n_ctx_train=512)
NO_YARN = dict(rope_scaling_type="linear", rope_freq_scale=1.0, yarn_ext_factor=0.0, yarn_attn_factor=1.0,
               yarn_orig_ctx=512, yarn_log_multiplier=0.0, attn_temp_scale=0.0, attn_temp_floor=0)
# Per family, the README's table row.
FAMILIES = {
    # arch llama, normal RoPE, base 10000, GQA 4/2, head_dim 64, tied output
    "tiny-llama-": dict(arch="llama", rope_type="norm", rope_freq_base=10000.0, n_head_kv=2, head_dim_k=64,
                        head_dim_v=64, n_rot=64, tied_output=True, has_rope_freqs=False, has_bias_qkv=False,
                        has_bias_o=False, rms_eps=f32(1e-5), **NO_YARN),
    # Llama 3: rope_freqs.weight divisors, base 500000, untied output.weight
    "tiny-llama3-": dict(arch="llama", rope_type="norm", rope_freq_base=500000.0, n_head_kv=2, head_dim_k=64,
                         n_rot=64, tied_output=False, has_rope_freqs=True, has_bias_qkv=False, **NO_YARN),
    # qwen2: NEOX RoPE, Q/K/V biases, base 1e6, eps 1e-6, untied
    "tiny-qwen2-": dict(arch="qwen2", rope_type="neox", rope_freq_base=1e6, rms_eps=f32(1e-6), n_head_kv=2,
                        head_dim_k=64, n_rot=64, tied_output=False, has_bias_qkv=True, has_bias_o=False,
                        has_rope_freqs=False, **NO_YARN),
    # mistral3: YaRN factor 16, original context 32, beta_fast 32, beta_slow 1, log_mul 1,
    # temperature scale 0.1 with floor length 32
    "tiny-mistral3-": dict(arch="mistral3", rope_type="norm", rope_scaling_type="yarn", rope_freq_scale=1 / 16,
                           yarn_orig_ctx=32, yarn_beta_fast=32.0, yarn_beta_slow=1.0, yarn_log_multiplier=1.0,
                           yarn_ext_factor=1.0, attn_temp_scale=f32(0.1), attn_temp_floor=32, n_head_kv=2,
                           head_dim_k=64, n_rot=64),
    # attention.key_length = 128 while n_embd / n_head = 64; one KV head (GQA 4/1)
    "tiny-llama-hd128-": dict(arch="llama", head_dim_k=128, head_dim_v=128, n_rot=128, n_head_kv=1,
                              tied_output=True, **NO_YARN),
}


def family(path):
    return max((p for p in FAMILIES if path.name.startswith(p)), key=len)


@pytest.mark.parametrize("path", TINY_GGUFS, ids=lambda p: p.name)
def test_tiny_fixture_hparams(path):
    hp = HParams.from_gguf(open_gguf(path))
    expected = {**COMMON, **FAMILIES[family(path)]}
    assert {k: getattr(hp, k) for k in expected} == expected
    assert hp.name == family(path) + "f32"  # quantized fixtures were made from the F32 masters
    assert hp.n_gqa == hp.n_head // hp.n_head_kv


def test_mistral3_yarn_attn_factor():
    # llama-context.cpp with factor 16 and yarn_log_multiplier 1: get_mscale(16, 1) / get_mscale(16, 1) = 1,
    # times 1 / (1 + 0.1 ln 16) to cancel the magnitude ggml's rope applies itself.
    hp = HParams.from_gguf(open_gguf(tiny("tiny-mistral3-f32")))
    assert hp.yarn_attn_factor == pytest.approx(1 / (1 + 0.1 * math.log(16)), rel=1e-6)


def test_expected_tensors_cover_the_file_exactly():
    for name in ("tiny-llama-q4_k", "tiny-llama3-q4_k_m", "tiny-qwen2-q4_k_m", "tiny-mistral3-f32"):
        g = open_gguf(tiny(name))
        exp = expected_tensors(HParams.from_gguf(g))
        assert {n for n, (_, required) in exp.items() if required} <= set(g.tensors) <= set(exp)


@pytest.mark.parametrize("name, expected", [
    # README "fixtures/real": SmolLM2 arch llama, tied, 30 layers, n_embd 576, 9/3 heads
    ("smollm2-135m-instruct-q4_1", dict(arch="llama", rope_type="norm", tied_output=True, n_layer=30,
                                        n_embd=576, n_head=9, n_head_kv=3, n_vocab=49152)),
    # Qwen2.5-Coder-0.5B: arch qwen2, untied; 151,936 tokens
    ("qwen2.5-coder-0.5b-instruct-q4_k_m", dict(arch="qwen2", rope_type="neox", tied_output=False,
                                                has_bias_qkv=True, n_vocab=151936)),
])
def test_real_model_hparams(name, expected):
    hp = HParams.from_gguf(open_gguf(real_model(name)))
    assert {k: getattr(hp, k) for k in expected} == expected


# ---------------------------------------------------------------- architectures (synapse_nb.arch)

def test_rope_types_are_llama_cpps():
    # llama.cpp src/llama-model.cpp llama_model_rope_type, written out: LLM_ARCH_LLAMA and
    # LLM_ARCH_MISTRAL3 return LLAMA_ROPE_TYPE_NORM, LLM_ARCH_QWEN2 and LLM_ARCH_GEMMA3 LLAMA_ROPE_TYPE_NEOX.
    from synapse_nb.arch import ARCHS

    assert {name: m.RECIPE.rope_type for name, m in ARCHS.items()} == {
        "llama": "norm", "mistral3": "norm", "qwen2": "neox", "gemma3": "neox"}
    assert all(m.NAME == name for name, m in ARCHS.items())


def test_unsupported_architecture_lists_the_registry(tmp_path):
    from synapse_nb.arch import ARCHS

    path = _patch_key(tmp_path, tiny("tiny-llama-f32"), "general.architecture", 4, b"gpt2x")
    assert_error(path, f"(supported: {', '.join(ARCHS)})")


def test_a_new_architecture_is_one_module(tmp_path, monkeypatch):
    """An architecture whose blocks are a recipe of the existing steps is one module registered in
    synapse_nb.arch.ARCHS; nothing else names it. tiny-llama renamed "llamb" (general.architecture
    and every llama.* key), with a module of llama's keys, tensors and recipe, loads and runs as
    tiny-llama, bit for bit."""
    import dataclasses
    import types

    from synapse_nb import arch
    from synapse_nb.arch import llama
    from synapse_nb.model import load_model
    from synapse_nb.session import Session

    src = tiny("tiny-llama-q8_0")
    r = GGUFReader(src)
    patches = [(part_offset(r, f.parts[1]), b"llamb") for f in r.fields.values() if f.name.startswith("llama.")]
    patches.append((part_offset(r, r.fields["general.architecture"].parts[4]), b"llamb"))
    path = damaged_copy(src, tmp_path / "tiny-llamb.gguf", patches)
    with pytest.raises(SynapseError, match="unsupported architecture 'llamb'"):
        HParams.from_gguf(open_gguf(path))
    monkeypatch.setitem(arch.ARCHS, "llamb", types.SimpleNamespace(
        NAME="llamb", RECIPE=llama.RECIPE, KEYS=llama.KEYS, TENSORS=llama.TENSORS, derive=llama.derive))
    m, ref = load_model(path), load_model(src)
    assert m.hparams.arch == "llamb" and dataclasses.replace(m.hparams, arch="llama") == ref.hparams
    tokens = np.array([1, 17, 42, 99, 7], np.int64)
    out, want = (Session(x, n_ctx=16, n_batch=4, n_threads=1).eval(tokens, all_logits=True) for x in (m, ref))
    assert out.tobytes() == want.tobytes()


# ---------------------------------------------------------------- bad models

def _patch_key(tmp_path, src, key, part, data):
    """Copy of src with part `part` of key `key` (0 key length, 1 key name, 2 type, 3.. value) overwritten."""
    r = GGUFReader(src)
    off = part_offset(r, r.fields[key].parts[part])
    return damaged_copy(src, tmp_path / src.name, [(off, data)])


def _patch_tensor(tmp_path, src, name, part, data):
    """Copy of src with part `part` of a tensor's info (1 name, 2 n_dims, 3 dims, 4 type, 5 offset) overwritten."""
    r = GGUFReader(src)
    t = next(t for t in r.tensors if t.name == name)
    return damaged_copy(src, tmp_path / src.name, [(part_offset(r, t.field.parts[part]), data)])


def assert_error(path, *words):
    g = open_gguf(path)  # the file itself is a valid GGUF
    with pytest.raises(SynapseError) as e:
        HParams.from_gguf(g)
    msg = str(e.value)
    assert str(path) in msg and "\n" not in msg, msg
    for w in words:
        assert w in msg, msg


@pytest.mark.parametrize("key", ["llama.block_count", "llama.attention.layer_norm_rms_epsilon",
                                 "llama.embedding_length", "llama.context_length"])
def test_missing_required_key(tmp_path, key):
    renamed = key[:-1] + ("X" if key[-1] != "X" else "Y")
    path = _patch_key(tmp_path, tiny("tiny-llama-f32"), key, 1, renamed.encode())
    assert_error(path, "missing required key", key)


def test_unknown_architecture(tmp_path):
    path = _patch_key(tmp_path, tiny("tiny-llama-f32"), "general.architecture", 4, b"gpt2x")
    assert_error(path, "unsupported architecture", "gpt2x")


def test_key_of_wrong_type(tmp_path):
    path = _patch_key(tmp_path, tiny("tiny-llama-f32"), "llama.block_count", 2, (6).to_bytes(4, "little"))  # FLOAT32
    assert_error(path, "key llama.block_count has wrong type FLOAT32 but expected type UINT32")


def test_vocab_size_disagrees_with_token_list(tmp_path):
    path = _patch_key(tmp_path, tiny("tiny-llama-f32"), "llama.vocab_size", 3, (511).to_bytes(4, "little"))
    assert_error(path, "llama.vocab_size = 511", "512 tokens")


def test_n_rot_differs_from_head_dim(tmp_path):
    path = _patch_key(tmp_path, tiny("tiny-llama-f32"), "llama.rope.dimension_count", 3, (32).to_bytes(4, "little"))
    assert_error(path, "n_rot 32", "head_dim_k 64")


def test_wrong_tensor_shape(tmp_path):
    # blk.1.attn_k.weight ne = [256, 128] -> [256, 64]: numpy shape (64, 256), expected (n_head_kv*head_dim, n_embd)
    path = _patch_tensor(tmp_path, tiny("tiny-llama-f32"), "blk.1.attn_k.weight", 3,
                         np.array([256, 64], "<u8").tobytes())
    assert_error(path, "blk.1.attn_k.weight", "shape [64, 256]", "expected [128, 256]")


def test_wrong_embedding_shape_quantized(tmp_path):
    # token_embd.weight of a Q4_K file with 256 rows instead of 512 (n_vocab)
    path = _patch_tensor(tmp_path, tiny("tiny-llama-q4_k"), "token_embd.weight", 3,
                         np.array([256, 256], "<u8").tobytes())
    assert_error(path, "token_embd.weight", "shape [256, 256]", "expected [512, 256]")


def test_missing_tensor(tmp_path):
    path = _patch_tensor(tmp_path, tiny("tiny-llama-f32"), "output_norm.weight", 1, b"output_norX.weight")
    assert_error(path, "missing tensor output_norm.weight")


def test_qwen2_requires_qkv_biases(tmp_path):
    path = _patch_tensor(tmp_path, tiny("tiny-qwen2-f32"), "blk.0.attn_q.bias", 1, b"blk.0.attn_q.biaX")
    assert_error(path, "missing tensor blk.0.attn_q.bias")


def test_unexpected_tensor(tmp_path):
    path = _patch_tensor(tmp_path, tiny("tiny-llama3-f32"), "rope_freqs.weight", 1, b"rope_freqX.weight")
    assert_error(path, "rope_freqX.weight", "not used by arch llama")


# ---------------------------------------------------------------- bad-input pass findings


@pytest.mark.parametrize("n_layer", [3, 2**31, 2**32 - 1])
def test_block_count_larger_than_the_tensor_table(tmp_path, n_layer):
    # block_count 2**31 made expected_tensors build a table of 2**31 * 9 names (tens of GB, then
    # the OOM killer); now refused before any per-layer loop.
    path = _patch_key(tmp_path, tiny("tiny-llama-q4_k"), "llama.block_count", 3, n_layer.to_bytes(4, "little"))
    assert_error(path, f"llama.block_count = {n_layer}", "the file has 20")


def test_vocab_only_file_is_not_a_model():
    path = VOCAB / "ggml-vocab-llama-bpe.gguf"
    assert_error(path, "vocabulary-only")


@pytest.mark.parametrize("tensor, ggml_type", [("blk.0.attn_q.weight", "Q8_1"), ("token_embd.weight", "Q8_K"),
                                               ("blk.1.ffn_down.weight", "IQ2_XXS"), ("output_norm.weight", "Q8_0"),
                                               ("blk.0.attn_norm.weight", "BF16")])
def test_unsupported_tensor_type_refused_at_load(tmp_path, tensor, ggml_type):
    # Was accepted by load_model and only failed inside the first forward, with a message that
    # named neither the file nor a readable type.
    from gguf import GGMLQuantizationType

    path = _patch_tensor(tmp_path, tiny("tiny-llama-q4_k"), tensor, 4,
                         int(GGMLQuantizationType[ggml_type]).to_bytes(4, "little"))
    assert_error(path, tensor, f"ggml type {ggml_type}", "not supported")


def test_weight_types_are_the_kernels_types():
    from synapse_nb.hparams import VECTOR_TYPES, WEIGHT_TYPES
    from synapse_nb.kernels import supported_types

    assert WEIGHT_TYPES == set(supported_types())
    assert VECTOR_TYPES <= WEIGHT_TYPES


def test_unexpected_tensor_name_with_control_bytes_is_escaped(tmp_path):
    # a corrupted name ("ro\x01\x02_freqs.weight") went raw into the message
    path = _patch_tensor(tmp_path, tiny("tiny-llama3-f32"), "rope_freqs.weight", 1, b"ro\x01\x02_freqs.weight")
    assert_error(path, "'ro\\x01\\x02_freqs.weight'", "not used by arch llama")


@pytest.mark.parametrize("factor", [1e-45, 3e38])
def test_extreme_rope_scaling_factor_is_not_a_warning(tmp_path, factor):
    """A downloaded file's rope.scaling.factor of 1e-45 (its reciprocal overflows) or 3e38 gives
    llama.cpp's float results (inf, 0) without a NumPy warning on stderr (found by fuzz.gguf seed
    34035, case 9: a warning line before the file's error line)."""
    import struct
    import warnings

    src = next(p for p in TINY_GGUFS if p.name.startswith("tiny-mistral3-"))
    path = _patch_key(tmp_path, src, "mistral3.rope.scaling.factor", 3, struct.pack("<f", factor))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hp = HParams.from_gguf(open_gguf(path))
    assert hp.rope_freq_scale == (np.inf if factor < 1 else np.float32(1) / np.float32(factor))
