"""ParallelSession: a sequence decoded beside others gives, bit for bit, the logits and KV cache of
the same tokens run alone in a Session, whatever the company, the schedule, the step split, a
reused prefix and the thread count.

The reference of every comparison is a lone Session (itself checked against llama.cpp's logits by
test_session / test_real), so a difference here is a dependence on the batch.
"""

import random

import numpy as np
import pytest

from conftest import REAL_MODELS, shared_model
from synapse_nb import Sampler
from synapse_nb.errors import SynapseError
from synapse_nb.parallel import ParallelSession
from synapse_nb.session import Session

# One fixture per architecture and rope / attention variant, F32 and a quantized mix
ARCH_FIXTURES = ["tiny-llama-f32", "tiny-llama-q4_0", "tiny-llama3-q4_k_m", "tiny-qwen2-q4_k_m", "tiny-qwen2-f32",
                 "tiny-mistral3-q4_k_m", "tiny-llama-hd128-q4_k_m"]
N_CTX = 192


def _alone(model, prompt, n_gen, n_ctx=N_CTX, sampler=None):
    """(tokens, logits rows chosen from, Session) of prompt decoded alone, token by token choice as
    ParallelSession makes it (argmax or sampler), the end-of-generation not honoured."""
    s = Session(model, n_ctx=n_ctx)
    if sampler is not None:
        sampler.accept_many(prompt)
    row = s.eval(prompt)
    toks, rows = [], []
    for i in range(n_gen):
        rows.append(row)
        t = int(np.argmax(row)) if sampler is None else sampler.sample(row)
        toks.append(t)
        if i + 1 < n_gen:
            row = s.eval([t])
    return toks, rows, s


def _prompts(rng, n_vocab, count, max_len=100):
    ps = [[rng.randrange(3, n_vocab) for _ in range(rng.randrange(1, max_len))] for _ in range(count)]
    ps[-1] = ps[0][: len(ps[0]) // 2] + ps[-1][:5]  # shares a prefix with the first
    return ps


def _assert_same(seq, ref, what):
    toks, rows, _ = ref
    assert seq.tokens == toks, what
    assert len(seq.logits) == len(rows)
    for i, (a, b) in enumerate(zip(seq.logits, rows)):
        assert np.array_equal(a, b), f"{what}: logits of generated step {i} differ"


@pytest.mark.parametrize("name", ARCH_FIXTURES)
def test_random_arrivals_and_splits_equal_lone_runs(name):
    """Sequences arriving at random steps, prompts split into random chunks, fewer slots than
    sequences (so slots are reused, with prefixes): every logits row equals the lone run's."""
    m = shared_model(name)
    rng = random.Random(hash(name) & 0xFFFF)
    prompts = _prompts(rng, m.hparams.n_vocab, 7)
    n_gen = 8
    refs = [_alone(m, p, n_gen) for p in prompts]
    ps = ParallelSession(m, n_seq=3, n_ctx=N_CTX, n_batch=48)
    arrivals = sorted(rng.randrange(0, 12) for _ in prompts)
    seqs, step = [], 0
    while len(seqs) < len(prompts) or ps.active:
        while len(seqs) < len(prompts) and arrivals[len(seqs)] <= step:
            seqs.append(ps.add(prompts[len(seqs)], n_gen, ignore_eos=True, keep_logits=True))
        ps.step(max_rows=rng.randrange(1, 49), chunk=lambda s, n: rng.randrange(1, n + 1))
        step += 1
    for i, (seq, ref) in enumerate(zip(seqs, refs)):
        assert seq.stop_reason == "length"
        _assert_same(seq, ref, f"{name} sequence {i}")


@pytest.mark.parametrize("name", ["tiny-llama-q4_k", "tiny-mistral3-f32"])
def test_kv_cache_bits_equal_lone_runs(name):
    """One slot per sequence: after the run, each slot's K/V at every position it wrote are the
    lone Session's cache bits (mistral3: positions past its temperature floor of 32)."""
    m = shared_model(name)
    rng = random.Random(7)
    prompts = [[rng.randrange(3, m.hparams.n_vocab) for _ in range(n)] for n in (70, 1, 33, 64)]
    n_gen = 6
    refs = [_alone(m, p, n_gen) for p in prompts]
    ps = ParallelSession(m, n_seq=len(prompts), n_ctx=N_CTX, n_batch=40)
    seqs = [ps.add(p, n_gen, ignore_eos=True, keep_logits=True) for p in prompts]
    ps.run()
    for seq, ref in zip(seqs, refs):
        _assert_same(seq, ref, name)
        s = ref[2]
        for il in range(m.hparams.n_layer):
            k, v = ps.kv_rows(seq, il, s.n_past)
            assert np.array_equal(k, s.cache.k_rows(il, s.n_past))
            assert np.array_equal(v, s.cache.v_rows(il, s.n_past))


def test_prefix_reuse_gives_the_same_bits():
    """A prompt that extends a finished sequence's tokens takes its slot and reuses those
    positions; its logits equal a lone run's."""
    m = shared_model("tiny-llama-q8_0")
    rng = random.Random(3)
    base = [rng.randrange(3, 512) for _ in range(50)]
    ps = ParallelSession(m, n_seq=2, n_ctx=N_CTX)
    first = ps.add(base, 4, ignore_eos=True)
    ps.run()
    follow = base + first.tokens[:3] + [11, 12]
    seq = ps.add(follow, 5, ignore_eos=True, keep_logits=True)
    ps.run()
    assert seq.n_reused == len(base) + 3 and seq.slot == first.slot
    _assert_same(seq, _alone(m, follow, 5), "prefix reuse")
    # an identical prompt reuses all but its last token
    again = ps.add(follow, 5, ignore_eos=True, keep_logits=True)
    ps.run()
    assert again.n_reused == len(follow) - 1
    _assert_same(again, _alone(m, follow, 5), "whole-prompt reuse")


@pytest.mark.threads(2)
def test_thread_count_does_not_change_bits():
    m = shared_model("tiny-qwen2-q4_k_m")
    rng = random.Random(5)
    prompts = _prompts(rng, m.hparams.n_vocab, 4)
    out = []
    for t in (1, 2):
        ps = ParallelSession(m, n_seq=4, n_ctx=N_CTX, n_threads=t)
        seqs = [ps.add(p, 6, ignore_eos=True, keep_logits=True) for p in prompts]
        ps.run()
        out.append(seqs)
    for a, b in zip(*out):
        assert a.tokens == b.tokens
        assert all(np.array_equal(x, y) for x, y in zip(a.logits, b.logits))


def test_samplers_per_sequence():
    """Each sequence draws with its own seeded sampler: the same tokens as alone."""
    m = shared_model("tiny-llama-q4_1")
    rng = random.Random(11)
    prompts = _prompts(rng, m.hparams.n_vocab, 4)
    refs = [_alone(m, p, 10, sampler=Sampler(temp=1.5, seed=100 + i))[0] for i, p in enumerate(prompts)]
    ps = ParallelSession(m, n_seq=4, n_ctx=N_CTX)
    seqs = [ps.add(p, 10, sampler=Sampler(temp=1.5, seed=100 + i), ignore_eos=True) for i, p in enumerate(prompts)]
    ps.run()
    assert [s.tokens for s in seqs] == refs


def test_stops_cancel_and_slots():
    m = shared_model("tiny-llama-q4_0")
    ps = ParallelSession(m, n_seq=2, n_ctx=40)
    eog = m.tokenizer.eog_ids
    a = ps.add([1, 50, 60], -1, ignore_eos=True)  # runs until its context is full
    b = ps.add([1, 70], 100, ignore_eos=True)
    c = ps.add([1, 80, 81], 0)  # waits for a slot; evaluates its prompt, generates nothing
    ps.step()
    assert [s["is_processing"] for s in ps.slots()] == [True, True]
    ps.cancel(b)
    ps.run()
    assert a.stop_reason == "context" and len(a.tokens) == 40 - 3
    assert b.stop_reason == "cancelled" and len(b.tokens) == 1
    assert c.stop_reason == "length" and c.tokens == []
    assert not any(s["is_processing"] for s in ps.slots())
    full = ps.add(list(range(3, 43)), 5)  # a prompt of exactly n_ctx: no token (as Session)
    ps.run()
    assert full.stop_reason == "context" and full.tokens == []
    # greedy with end-of-generation honoured: the lone run's tokens up to and including the EOG
    ps2 = ParallelSession(m, n_seq=1, n_ctx=N_CTX)
    s = Session(m, n_ctx=N_CTX)
    want = s.generate([1, 5, 6], 30)
    got = ps2.add([1, 5, 6], 30)
    ps2.run()
    assert got.tokens == want and got.stop_reason == s.stop_reason
    assert got.stop_reason != "eog" or got.tokens[-1] in eog


def test_bad_arguments():
    m = shared_model("tiny-llama-q4_0")
    with pytest.raises(SynapseError, match="n_seq"):
        ParallelSession(m, n_seq=0)
    ps = ParallelSession(m, n_seq=1, n_ctx=16)
    with pytest.raises(SynapseError, match="vocabulary"):
        ps.add([1, 99999])
    with pytest.raises(SynapseError, match="exceeds the context"):
        ps.add(list(range(3, 20)))
    with pytest.raises(SynapseError, match="empty"):
        ps.add([])
    with pytest.raises(SynapseError, match="n_predict"):
        ps.add([1], n_predict=-2)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(REAL_MODELS))
def test_real_models_parallel_equal_lone(name):
    """Every real model: 4 prompts of its goldens, 3 slots, random splits."""
    import json

    m = shared_model(name)
    cases = json.loads(REAL_MODELS[name].read_text())["cases"]
    prompts = [c["tokens"] for c in cases][:4]
    n_gen = 6
    n_ctx = max(map(len, prompts)) + n_gen + 8  # gemma's long-swa case: 720 tokens, past its 512 window
    refs = [_alone(m, p, n_gen, n_ctx=n_ctx) for p in prompts]
    rng = random.Random(1)
    ps = ParallelSession(m, n_seq=3, n_ctx=n_ctx, n_batch=64)
    seqs = [ps.add(p, n_gen, ignore_eos=True, keep_logits=True) for p in prompts]
    ps.run(chunk=lambda s, n: rng.randrange(1, n + 1))
    for i, (seq, ref) in enumerate(zip(seqs, refs)):
        _assert_same(seq, ref, f"{name} case {i}")


@pytest.mark.slow
def test_reused_prefix_past_a_released_window(gemma3):
    """Gemma 3's window layers give back positions below their 512-token window: a slot's cached
    prefix is reused when what the new prompt's next rows read is still held (the prompt's first
    715 tokens after a 722-position run), and evaluated again otherwise (its first 300 tokens);
    both equal the prompts decoded alone, bit for bit."""
    import json

    long = next(c for c in json.loads(REAL_MODELS["gemma-3-270m-q4_k_m"].read_text())["cases"]
                if c["name"] == "long-swa")["tokens"]
    n_ctx = 768
    ps = ParallelSession(gemma3, n_seq=1, n_ctx=n_ctx, n_batch=64)
    ps.add(long, 2, ignore_eos=True)
    ps.run()
    for keep, reused in ((715, 715), (300, 0)):
        prompt = long[:keep] + [236761, 107, 236761]
        seq = ps.add(prompt, 3, ignore_eos=True, keep_logits=True)
        ps.run()
        assert seq.n_reused == reused, keep
        _assert_same(seq, _alone(gemma3, prompt, 3, n_ctx=n_ctx), f"prefix {keep}")
