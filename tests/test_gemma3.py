"""Gemma 3 270M (arch gemma3) on real weights against llama.cpp's goldens (tests/data/real/
gemma-3-270m-q4_k_m.json, llama.cpp 0c1e570 with the full-size SWA cache, swa_full = true).

Rules of shared/README.md ("How to compare with the reference", real models): tol =
max(2 * self_maxrel, 1e-2); greedy tokens identical while the reference's top-2 margin exceeds
2 * tol * |top-1 logit|; our top-1 is the reference's at every prompt position where that margin
is clear. The long-swa case (720 tokens of GPL-3.txt) runs past the 512-token window. Prefill
and token-by-token decoding agree bit for bit on it (logits and the whole K/V cache).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import REAL_MODELS

CASES = json.loads(REAL_MODELS["gemma-3-270m-q4_k_m"].read_text())["cases"]


def test_hparams_from_the_gguf(gemma3):
    hp = gemma3.hparams
    assert (hp.arch, hp.n_layer, hp.n_embd, hp.n_head, hp.n_head_kv, hp.head_dim_k, hp.head_dim_v, hp.n_ff) == \
        ("gemma3", 18, 640, 4, 1, 256, 256, 2048)
    assert (hp.n_vocab, hp.n_ctx_train, hp.tied_output, hp.rope_type) == (262144, 32768, True, "neox")
    assert hp.n_swa == 512 and hp.rope_freq_base == 1e6 and hp.rope_freq_base_swa == 10000.0
    # set_swa_pattern(6): layers 5, 11 and 17 attend everything, the others the window
    assert [il for il in range(18) if not hp.is_swa(il)] == [5, 11, 17]
    assert hp.attn_scale == np.float32(0.0625)  # 1/sqrt(head_dim 256): not the 27B's 1/sqrt(n_embd/n_head)
    assert hp.embd_scale == np.float32(np.sqrt(np.float32(640)))
    assert np.float32(hp.rms_eps) == np.float32(1e-6)
    assert (hp.has_qk_norm, hp.has_post_norms, hp.ffn_act) == (True, True, "gelu")


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_goldens(gemma3, case):
    from synapse_nb.session import Session

    tol = max(2 * case["self_maxrel"], 1e-2)
    toks = case["tokens"]
    s = Session(gemma3, n_ctx=1024, n_threads=2)
    logits = s.eval(toks, all_logits=True)
    for p in range(len(toks)):  # top-1 at every clear prompt position (single-token path reference)
        ids, ref = case["tbt_top_ids"][p], case["tbt_top_logits"][p]
        if ref[0] - ref[1] > 2 * tol * abs(ref[0]):
            assert int(np.argmax(logits[p])) == ids[0], f"prompt position {p}"
    row, ours = logits[-1], []
    for i, ref in enumerate(case["gen_top_logits"]):
        tok = int(np.argmax(row))
        ours.append(tok)
        if ref[0] - ref[1] <= 2 * tol * abs(ref[0]):
            break  # below the margin the continuations may part
        assert tok == case["greedy"][i], f"greedy step {i}: ours {tok}, llama.cpp {case['greedy'][i]}"
        row = s.eval([tok])


@pytest.mark.slow
def test_prefill_equals_token_by_token_past_the_window(gemma3):
    from synapse_nb.checks import prefill_check

    toks = next(c for c in CASES if c["name"] == "long-swa")["tokens"]
    assert len(toks) > gemma3.hparams.n_swa + 64
    res = prefill_check(gemma3, toks, n_ctx=1024, n_threads=2)
    assert res.ok, str(res)


def _rss_shmem_kib() -> int:
    """The process's resident shared-anonymous memory (the KV caches' lazy_zeros mappings), KiB."""
    for line in open("/proc/self/status"):
        if line.startswith("RssShmem:"):
            return int(line.split()[1])
    pytest.skip("no RssShmem in /proc/self/status")


@pytest.mark.slow
def test_window_layers_give_back_what_the_window_no_longer_reads(gemma3):
    """The default cache (the window layers' pages released below their window, state.WindowRelease)
    gives the bits of llama.cpp's --swa-full layout: every logit of the 720-token long-swa case,
    then a decode step; the released K tiles of a window layer read as zero, a full layer's do not."""
    from synapse_nb.session import Session

    toks = next(c for c in CASES if c["name"] == "long-swa")["tokens"]
    full = Session(gemma3, n_ctx=1024, n_threads=2, swa_full=True)
    bounded = Session(gemma3, n_ctx=1024, n_threads=2)
    a, b = full.eval(toks, all_logits=True), bounded.eval(toks, all_logits=True)
    assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
    tok = int(np.argmax(a[-1]))
    assert np.array_equal(full.eval([tok]).view(np.uint32), bounded.eval([tok]).view(np.uint32))
    # 721 positions: a query at 721 reads from 721 - 511 = 210, whose tile starts at 192
    assert not bounded.cache.k[0, :, :3].any() and full.cache.k[0, :, :3].any()
    assert bounded.cache.k[0, :, 3].any()
    assert bounded.cache.k[5, :, :3].any()  # layer 5 attends everything: nothing released


@pytest.mark.slow
def test_going_back_below_the_window_evaluates_again(gemma3):
    """Session.truncate to a position whose window was given back evaluates the kept tokens again:
    the next logits are those of a session that ran the same tokens without going back."""
    from synapse_nb.session import Session

    toks = next(c for c in CASES if c["name"] == "long-swa")["tokens"]
    s = Session(gemma3, n_ctx=1024, n_threads=2)
    s.eval(toks)
    s.truncate(100)
    assert s.n_past == 100
    got = s.eval(toks[100:110], all_logits=True)
    ref = Session(gemma3, n_ctx=1024, n_threads=2).eval(toks[:110], all_logits=True)[100:]
    assert np.array_equal(got.view(np.uint32), ref.view(np.uint32))
    s.truncate(109)  # within what the window kept: no evaluation again, the same next logits
    assert np.array_equal(s.eval([toks[109]]).view(np.uint32), ref[-1].view(np.uint32))


@pytest.mark.slow
def test_window_cache_memory_is_bounded(gemma3):
    """Resident KV memory after a 1,600-token prompt at n_ctx 2048: the 3 full layers hold every
    position, the 15 window layers at most their window, a batch, a tile and a V page each
    (WindowRelease.held_positions); with --swa-full all 18 hold 1,600."""
    from synapse_nb.session import Session
    from synapse_nb.state import WindowRelease

    hp = gemma3.hparams
    n = 1600
    toks = (next(c for c in CASES if c["name"] == "long-swa")["tokens"] * 3)[:n]
    per_pos_kib = hp.n_head_kv * (hp.head_dim_k + hp.head_dim_v) * 2 / 1024  # one layer, one position
    held = WindowRelease.held_positions(hp, 2048, 64)
    assert held < n
    used = {}
    for swa_full in (True, False):
        before = _rss_shmem_kib()
        s = Session(gemma3, n_ctx=2048, n_threads=2, n_batch=64, swa_full=swa_full)
        s.eval(toks)
        used[swa_full] = _rss_shmem_kib() - before
        del s
    assert used[True] >= 18 * n * per_pos_kib
    assert used[False] <= (3 * n + 15 * held) * per_pos_kib < used[True]
