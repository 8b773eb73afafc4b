"""Session: prefill check (batched == token by token, bit for bit), thread independence,
context overflow, reset, logits shapes, greedy generate.

Prefill-check matrix: prompt lengths 1, 63, 64, 65, 130 (around the 64-token batch boundary)
with 1 and 2 Numba threads, on a representative subset of the tiny fixtures covering every
code path of the graph: F32 matmul (tiny-llama-f32), a legacy Q8_0 format (tiny-llama-q8_0),
qwen2 NEOX RoPE + biases (tiny-qwen2-q4_k_m), mistral3 YaRN + temperature (tiny-mistral3-q4_k_m),
Llama 3 rope_freqs + untied output (tiny-llama3-q4_k_m), head_dim 128 with one KV head
(tiny-llama-hd128-q4_k_m). Every other fixture is checked at 130 tokens with 2 threads.
"""

import numba
import numpy as np
import pytest

from synapse_nb import SynapseError
from synapse_nb.model import load_model
from synapse_nb.checks import first_row_diff, prefill_check
from synapse_nb.session import Session
from synapse_nb.compilation.warmup import warmup as session_warmup

from conftest import GOLDENS, shared_model as model, tiny

ALL = sorted(p.stem for p in GOLDENS.glob("*.npz"))
MATRIX = ALL  # every fixture, every length, 1 and 2 threads (issue 4's acceptance)
LENGTHS = [1, 63, 64, 65, 130]
N_VOCAB = 512

def prompt(n, seed=0):
    """BOS then n - 1 fixed pseudo-random ids."""
    rng = np.random.default_rng(seed)
    return [1] + [int(t) for t in rng.integers(3, N_VOCAB, size=n - 1)]


@pytest.fixture
def threads():
    """Restore Numba's thread count after a test that changes it."""
    before = numba.get_num_threads()
    yield
    numba.set_num_threads(before)


@pytest.mark.parametrize("n_threads", [1, pytest.param(2, marks=pytest.mark.threads(2))])
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("name", MATRIX)
def test_prefill_check_matrix(threads, name, n, n_threads):
    res = prefill_check(model(name), prompt(n), n_ctx=256, n_threads=n_threads)
    assert res.ok, str(res)
    assert res.n_tokens == n and res.logits_diff is None and res.cache_diff is None
    assert str(res).startswith("prefill check OK")


@pytest.mark.threads(2)
@pytest.mark.parametrize("name", ["tiny-llama-q4_0", "tiny-mistral3-q4_k_m"])
def test_results_do_not_depend_on_thread_count(threads, name):
    toks = prompt(130, seed=2)
    out = []
    for nt in (1, 2):
        s = Session(model(name), n_ctx=256, n_threads=nt)
        rows = s.eval(toks, all_logits=True)
        nl = s.model.hparams.n_layer
        out.append((rows.view(np.uint32), np.stack([s.cache.k_rows(il, 130) for il in range(nl)]),
                    np.stack([s.cache.v_rows(il, 130) for il in range(nl)])))
    for a, b in zip(out[0], out[1]):
        assert np.array_equal(a, b)


def test_prefill_check_reports_logit_difference(monkeypatch):
    m = model("tiny-llama-f32")
    real = type(m).forward

    def perturbed(self, st, cache, tokens, n_past, all_logits, want_logits=True):
        out = real(self, st, cache, tokens, n_past, all_logits, want_logits)
        if len(tokens) > 1:  # only the batched run: move row 1, logit 5 by one ulp
            out[1, 5] = np.nextafter(out[1, 5], np.float32(np.inf))
        return out

    monkeypatch.setattr(type(m), "forward", perturbed)
    res = prefill_check(m, prompt(10))
    assert not res.ok
    assert res.logits_diff[:2] == (1, 5) and res.cache_diff is None
    assert "position 1" in str(res) and "FAILED" in str(res)


def test_prefill_check_reports_cache_difference(monkeypatch):
    m = model("tiny-llama-f32")
    real = type(m).forward

    def perturbed(self, st, cache, tokens, n_past, all_logits, want_logits=True):
        out = real(self, st, cache, tokens, n_past, all_logits, want_logits)
        if len(tokens) > 1:  # only the batched run: flip one V entry of layer 1, position 3 (F16 bits)
            cache.v[cache.v_entry(1, 3, 7)] ^= np.uint16(1)
        return out

    monkeypatch.setattr(type(m), "forward", perturbed)
    res = prefill_check(m, prompt(10))
    assert not res.ok and res.logits_diff is None
    assert res.cache_diff[:4] == ("V", 1, 3, 7)
    assert "layer 1, position 3" in str(res)


def test_first_row_diff_reports_the_first_differing_logit():
    rng = np.random.default_rng(9)
    a = rng.standard_normal(N_VOCAB).astype(np.float32)
    assert first_row_diff(7, a, a.copy()) is None
    b = a.copy()
    b[300] = np.nextafter(b[300], np.float32(np.inf))  # one ulp
    b[400] = -b[400]
    assert first_row_diff(2999, a, b) == (2999, 300, float(a[300]), float(b[300]))
    z, nz = np.zeros(N_VOCAB, np.float32), np.zeros(N_VOCAB, np.float32)
    nz[11] = -0.0  # equal as floats, different bits: a difference
    assert first_row_diff(0, z, nz)[:2] == (0, 11)


def test_prefill_check_compares_batch_by_batch_with_progress():
    calls = []
    res = prefill_check(model("tiny-llama-q8_0"), prompt(150), n_ctx=160, n_batch=64,
                        progress=lambda done, total: calls.append((done, total)))
    assert res.ok, str(res)
    assert calls == [(64, 150), (128, 150), (150, 150)]


def test_prefill_check_reports_a_late_logit_difference(monkeypatch):
    # a difference in the third batch, after two identical ones: reported with its position
    m = model("tiny-llama-f32")
    real = type(m).forward

    def perturbed(self, st, cache, tokens, n_past, all_logits, want_logits=True):
        out = real(self, st, cache, tokens, n_past, all_logits, want_logits)
        if len(tokens) > 1 and n_past == 128:
            out[5, 17] = np.nextafter(out[5, 17], np.float32(-np.inf))
        return out

    monkeypatch.setattr(type(m), "forward", perturbed)
    res = prefill_check(m, prompt(150), n_ctx=160, n_batch=64)
    assert not res.ok and res.cache_diff is None
    assert res.logits_diff[:2] == (133, 17) and res.logits_diff[2] < res.logits_diff[3]
    assert "position 133 (vocab id 17)" in str(res)


def test_eval_shapes_and_n_past():
    m = model("tiny-qwen2-q4_k_m")
    s = Session(m, n_ctx=200)
    assert s.n_ctx == 200 and s.n_past == 0
    last = s.eval(prompt(70))
    assert last.shape == (N_VOCAB,) and last.dtype == np.float32 and s.n_past == 70
    rows = s.eval([5, 6, 7], all_logits=True)
    assert rows.shape == (3, N_VOCAB) and rows.dtype == np.float32 and s.n_past == 73
    one = s.eval([8], all_logits=True)
    assert one.shape == (1, N_VOCAB)


def test_last_row_equals_all_logits_last_row():
    # 100 tokens: the first batch of 64 computes no logits at all, the second only its last row
    m = model("tiny-llama-q4_k")
    toks = prompt(100, seed=3)
    sa, sb = Session(m, n_ctx=128), Session(m, n_ctx=128)
    a = sa.eval(toks)
    b = sb.eval(toks, all_logits=True)
    assert np.array_equal(a.view(np.uint32), b[-1].view(np.uint32))
    assert np.array_equal(sa.cache.k, sb.cache.k) and np.array_equal(sa.cache.v, sb.cache.v)


def test_default_n_ctx():
    s = Session(model("tiny-llama-f32"))
    assert s.n_ctx == min(512, 4096)


def test_context_overflow_is_a_clear_error():
    m = model("tiny-llama-f32")
    s = Session(m, n_ctx=64)
    s.eval(prompt(60))
    with pytest.raises(SynapseError, match="n_ctx = 64"):
        s.eval([3, 4, 5, 6, 7])
    assert s.n_past == 60  # nothing was appended
    s.eval([3, 4, 5, 6])  # exactly fills the cache
    assert s.n_past == 64
    with pytest.raises(SynapseError, match="context full"):
        s.eval([3])
    s.reset()
    with pytest.raises(SynapseError, match="exceed n_ctx = 64"):
        s.generate(prompt(65), n_predict=1, ignore_eos=True)  # only a prompt that does not fit is refused
    assert s.n_past == 0
    with pytest.raises(SynapseError, match="n_predict"):
        s.generate(prompt(5), n_predict=-2)
    assert s.n_past == 0


def test_bad_inputs_are_clear_errors():
    m = model("tiny-llama-f32")
    s = Session(m, n_ctx=32)
    with pytest.raises(SynapseError, match="outside the vocabulary"):
        s.eval([1, N_VOCAB])
    with pytest.raises(SynapseError, match="outside the vocabulary"):
        s.eval([-1])
    with pytest.raises(SynapseError, match="non-empty"):
        s.eval([])
    with pytest.raises(SynapseError, match="integers"):
        s.eval([1.5])
    assert s.n_past == 0
    with pytest.raises(SynapseError, match="n_ctx"):
        Session(m, n_ctx=-1)
    assert Session(m, n_ctx=0).n_ctx == m.hparams.n_ctx_train  # llama.cpp's n_ctx 0: from the model
    with pytest.raises(SynapseError, match="n_threads"):
        Session(m, n_threads=0)
    with pytest.raises(SynapseError, match="n_batch"):
        Session(m, n_batch=0)


def test_reset_gives_a_fresh_cache():
    m = model("tiny-mistral3-q4_k_m")
    toks = prompt(80, seed=4)
    fresh = Session(m, n_ctx=128).eval(toks, all_logits=True)
    s = Session(m, n_ctx=128)
    s.eval(prompt(100, seed=5))
    s.reset()
    assert s.n_past == 0
    again = s.eval(toks, all_logits=True)
    assert np.array_equal(fresh.view(np.uint32), again.view(np.uint32))


def test_batch_size_does_not_change_results():
    m = model("tiny-llama3-q4_k_m")
    toks = prompt(100, seed=6)
    a = Session(m, n_ctx=128, n_batch=64).eval(toks, all_logits=True)
    b = Session(m, n_ctx=128, n_batch=7).eval(toks, all_logits=True)
    assert np.array_equal(a.view(np.uint32), b.view(np.uint32))


def test_generate_is_greedy_argmax():
    m = model("tiny-llama-q8_0")
    toks = prompt(20, seed=7)
    seen = []
    got = Session(m, n_ctx=64).generate(toks, 12, ignore_eos=True, on_token=seen.append)
    # the same loop by hand
    s = Session(m, n_ctx=64)
    logits = s.eval(toks)
    want = []
    for _ in range(12):
        want.append(int(np.argmax(logits)))
        logits = s.eval([want[-1]])
    assert got == want and seen == want


def test_generate_matches_golden_greedy_while_clear():
    # text prompt of tiny-qwen2-f32: llama.cpp's greedy continuation has clear margins throughout
    name = "tiny-qwen2-f32"
    g = np.load(GOLDENS / f"{name}.npz")
    got = Session(model(name), n_ctx=128).generate(g["text_tokens"].tolist(), 32, ignore_eos=True)
    assert got == g["text_greedy"].tolist()


def test_generate_stops_at_end_of_generation(monkeypatch):
    m = model("tiny-llama-f32")
    eos = 2
    assert eos in m.tokenizer.eog_ids
    real = Session.eval

    def eos_after_3(self, tokens, all_logits=False):
        out = real(self, tokens, all_logits)
        if self.n_past >= 23:  # from the third generated token on, make </s> the argmax
            out = out.copy()
            out[..., eos] = out.max() + 1
        return out

    monkeypatch.setattr(Session, "eval", eos_after_3)
    seen = []
    s = Session(m, n_ctx=64)
    got = s.generate(prompt(20), 10, on_token=seen.append)
    assert got[-1] == eos and len(got) == 4 and seen == got[:-1] and s.stop_reason == "eog"
    got = Session(m, n_ctx=64).generate(prompt(20), 10, ignore_eos=True)
    assert len(got) == 10 and got[3:] == [eos] * 7


def test_generate_stops_when_the_context_is_full():
    # llama.cpp's greedy continuation of the text prompt (59 tokens): clear margins throughout.
    # As llama-completion without context shift: cached + generated tokens <= n_ctx.
    name = "tiny-qwen2-f32"
    g = np.load(GOLDENS / f"{name}.npz")
    toks, want = g["text_tokens"].tolist(), g["text_greedy"].tolist()
    s = Session(model(name), n_ctx=len(toks) + 7)
    got = s.generate(toks, 30, ignore_eos=True)
    assert got == want[:7] and s.stop_reason == "context"
    assert s.n_past == len(toks) + 6  # the last token takes the last position and is not evaluated
    s = Session(model(name), n_ctx=len(toks) + 7)  # -1: no limit, the context decides
    assert s.generate(toks, -1, ignore_eos=True) == want[:7] and s.stop_reason == "context"
    s = Session(model(name), n_ctx=len(toks) + 7)  # both limits at once: n_predict wins, as llama.cpp
    assert s.generate(toks, 7, ignore_eos=True) == want[:7] and s.stop_reason == "length"
    s = Session(model(name), n_ctx=len(toks) + 7)
    assert s.generate(toks, 6, ignore_eos=True) == want[:6] and s.stop_reason == "length"
    s = Session(model(name), n_ctx=len(toks))  # a prompt that fills the context: nothing generated
    assert s.generate(toks, 5, ignore_eos=True) == [] and s.stop_reason == "context"
    s = Session(model(name), n_ctx=len(toks) + 1)
    assert s.generate(toks, 5, ignore_eos=True) == want[:1] and s.stop_reason == "context"
    assert s.n_past == len(toks)


def test_warmup_reports_progress_and_leaves_no_state():
    m = model("tiny-llama-hd128-q4_k_m")
    calls = []
    session_warmup(m, progress=lambda done, total, name: calls.append((done, total, name)))
    assert calls[0][0] == 0 and calls[-1][0] == calls[-1][1] == len(calls) - 1
    assert "several sequences' attention" in [c[2] for c in calls]  # every kernel: a server's too
    s = Session(m, n_ctx=16)
    assert s.n_past == 0


def test_a_first_runs_prompt_is_evaluated_token_by_token_up_to_64_gib_of_weight_reads(monkeypatch):
    """prompt_n_batch: while the batched kernels are not compiled, a prompt of 2 up to
    max(16, 64 GiB / the bytes a forward's matmuls read) tokens is evaluated one token at a time
    (each token reads every matmul weight once); a longer one, a one-token one, or -b 1 keep n_batch."""
    from synapse_nb.compilation import warmup as W

    m = model("tiny-llama-hd128-q4_k_m")
    w = m.weights
    assert W.step_bytes(m) == w.output.rows.nbytes + sum(
        getattr(L, name).rows.nbytes for L in w.layers for name in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"))
    monkeypatch.setattr(W, "batched_compiled", lambda model: False)
    for step, limit in ((1 << 30, 64), (3 << 30, 21), (8 << 30, 16)):  # 64 GiB / step, at least 16
        monkeypatch.setattr(W, "step_bytes", lambda model, step=step: step)
        assert W.short_prompt(m) == limit
        assert [W.prompt_n_batch(m, n, 512) for n in (1, 2, limit, limit + 1)] == [512, 1, 1, 512]
        assert W.prompt_n_batch(m, 2, 1) == 1
    monkeypatch.setattr(W, "batched_compiled", lambda model: True)
    assert W.prompt_n_batch(m, 2, 512) == 512


def test_warmup_of_a_run_takes_the_steps_the_run_uses():
    """warmup(n_prompt=...) runs only the steps whose kernels the run calls (the rest would load or
    compile for nothing): a 1-token prompt and no decode step is the serial forward alone."""
    from synapse_nb.kernels.attention import uses_parallel
    from synapse_nb.compilation.warmup import run_needs as _run_needs

    m = model("tiny-llama-hd128-q4_k_m")
    hp = m.hparams
    ser, par = (True, False), (True, True)  # decode-row kinds (decode, parallel)
    assert _run_needs(hp, 1, 1, 64, 512) == (False, True, {ser})  # "Hello" -n 1
    assert _run_needs(hp, 1, 0, 64, 512) == (False, True, {ser})
    assert _run_needs(hp, 5, 1, 64, 512) == (True, False, {ser, (False, False)})  # no decode step: no serial forward
    assert _run_needs(hp, 5, 2, 64, 512)[:2] == (True, True)
    assert _run_needs(hp, 65, 1, 64, 512)[:2] == (True, True)  # the last batch is 1 token
    # parallel attention: as attention_rows decides, for each batch and decode step
    big = next(p for p in range(1, 1 << 20) if uses_parallel(1, p, hp.n_head, hp.head_dim_k, hp.head_dim_v))
    assert 1 < big <= 63  # -b 1: every batch is 1 token, the rows at positions big.. parallel
    assert _run_needs(hp, 64, 1, 1, 512) == (False, True, {ser, par})
    assert _run_needs(hp, big, 1, 1, 512) == (False, True, {ser})
    assert _run_needs(hp, 1, 8, 64, big + 10)[2] == {ser}
    assert _run_needs(hp, 1, -1, 64, big + 10)[2] == {ser, par}  # -n -1: to the end of the context
    assert _run_needs(hp, 1, big + 1, 64, big + 10)[2] == {ser, par}  # the last step is evaluated at position big
    assert _run_needs(hp, 1, big, 64, big + 10)[2] == {ser}  # at big - 1
    kinds = _run_needs(hp, big + 1, 2, 64, big + 10)[2]  # the prompt's last row at big, one step after it
    assert par in kinds and ser not in kinds
    n = next(n for n in range(2, 65) if uses_parallel(n, 0, hp.n_head, hp.head_dim_k, hp.head_dim_v))
    assert (False, True) in _run_needs(hp, n, 1, 64, 512)[2]
    assert (False, False) in _run_needs(hp, n - 1, 1, 64, 512)[2] - {(False, True)}
    # batches of n - 1 rows: the first serial, the fourth (at position 3 (n - 1): 4x the work) parallel
    assert _run_needs(hp, 4 * (n - 1), 1, n - 1, 512)[2] >= {(False, True), (False, False)}
    calls = []
    session_warmup(m, progress=lambda done, total, name: calls.append((done, total, name)),
                   n_prompt=1, n_predict=1, n_ctx=64)
    assert [c[2] for c in calls] == ["single-token forward (serial kernels)", "done"]


def test_inf_in_weights_gives_no_exception(tmp_path):
    """ggml computes through inf/nan; our kernels must not raise (Numba's default error model would:
    Q8_K's d = 1/iscale divides by zero when a row's largest value is inf)."""
    src = tiny("tiny-llama-hd128-q4_k_m")
    g = model("tiny-llama-hd128-q4_k_m").gguf
    t = g.tensors["output_norm.weight"]
    data = bytearray(src.read_bytes())
    data[t.offset:t.offset + 4] = np.array([np.inf], np.float32).tobytes()
    bad = tmp_path / "inf.gguf"
    bad.write_bytes(bytes(data))
    logits = Session(load_model(bad), n_ctx=16).eval([1, 5, 9])
    assert logits.shape == (512,)


def _decode_steps(d, n, t2, t1, rng=None):
    """Drive DecodeThreads d for n steps whose 2-thread steps take t2 and 1-thread ones t1 (times
    +-10 % noise from rng, when given); the thread count of each step."""
    used = []
    for _ in range(n):
        t = d.threads()
        used.append(t)
        d.record(t, (t2 if t == 2 else t1) * (rng.uniform(0.9, 1.1) if rng else 1.0))
    return used


def test_decode_threads_switch_only_when_the_other_count_is_faster():
    """DecodeThreads: on an idle machine (1 thread 1.45x slower, noise of +-10%) it stays on n
    threads; when n-thread steps slow down 2.5x (a busy neighbour) it moves to 1 within a period,
    and back once the load is gone. Every step's count is one it reports with threads()."""
    import random

    from synapse_nb.decode_threads import DecodeThreads

    rng = random.Random(0)
    d = DecodeThreads(2)
    P = d.PERIOD

    def run(periods, t2, t1):
        return _decode_steps(d, periods * P, t2, t1, rng)

    first = _decode_steps(d, d.FIRST_PERIOD, 4.3, 6.2, rng)  # the short first period; then periods of P steps
    assert d.current == 2 and first == [2] * (d.FIRST_PERIOD - d.PROBES) + [1] * d.PROBES
    idle = run(5, 4.3, 6.2)
    assert d.current == 2 and idle.count(1) == 5 * d.PROBES  # only the probes ran on 1 thread
    busy = run(3, 15.0, 6.2)
    assert d.current == 1 and busy[:P].count(2) == P - d.PROBES and busy[2 * P:].count(1) == P - d.PROBES
    again = run(2, 4.3, 6.2)
    assert d.current == 2 and again[P:].count(2) == P - d.PROBES


def test_decode_threads_see_a_busy_machine_within_the_first_period():
    """A run that starts on a busy machine (n-thread steps 2.5x slower than 1-thread ones) moves
    to 1 thread after FIRST_PERIOD steps, not after a whole PERIOD, and not before its probes."""
    from synapse_nb.decode_threads import DecodeThreads

    d = DecodeThreads(2)
    assert d.FIRST_PERIOD < d.PERIOD
    F = d.FIRST_PERIOD
    used = _decode_steps(d, F + 20, 15.0, 6.2)
    assert used[:F] == [2] * (F - d.PROBES) + [1] * d.PROBES and used[F:] == [1] * 20 and d.current == 1


@pytest.mark.threads(2)  # (Session caps n_threads at Numba's pool)
def test_decode_steps_on_chosen_threads_give_the_same_tokens():
    """A Session whose decode steps alternate between 1 and 2 threads (DecodeThreads probing on
    every other step) produces the same greedy tokens and logits as one on 1 thread."""
    from synapse_nb import decode_threads as D

    m = model("tiny-llama-q4_0")
    ref = Session(m, n_ctx=64, n_threads=1)
    want = ref.generate([1, 2, 3], 12, ignore_eos=True)
    old = D.DecodeThreads.PERIOD, D.DecodeThreads.FIRST_PERIOD, D.DecodeThreads.PROBES
    D.DecodeThreads.PERIOD, D.DecodeThreads.FIRST_PERIOD, D.DecodeThreads.PROBES = 2, 2, 1
    try:
        s = Session(m, n_ctx=64, n_threads=2)
        assert s.generate([1, 2, 3], 12, ignore_eos=True) == want
        assert s._decode_threads is not None and s._decode_threads._step > 0
    finally:
        D.DecodeThreads.PERIOD, D.DecodeThreads.FIRST_PERIOD, D.DecodeThreads.PROBES = old
