"""Chat templates and conversations, against llama.cpp.

tests/data/chat/ (see its README): chat_cases.jsonl and templates.json are llama.cpp's renderings
(common_chat_templates_apply, --jinja and --no-jinja) and token ids of 20 conversations for the three
GGUFs that carry a template; llama_cpp_runs.json holds runs of the real llama-completion -cnv on
SmolLM2 (prompt ids, greedy replies, perf totals).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import CHAT, ROOT, VOCAB, real_model, shared_model
from conftest import one_error_line, run_cli
from synapse_nb import SynapseError, load_tokenizer
from synapse_nb.chat import ChatTemplate, render_jinja
from synapse_nb.session import Session

CASES = [json.loads(line) for line in (CHAT / "chat_cases.jsonl").read_text().splitlines() if line.strip()]
TEMPLATES = json.loads((CHAT / "templates.json").read_text())
RUNS = json.loads((CHAT / "llama_cpp_runs.json").read_text())
SMOL = "smollm2-135m-instruct-q4_1"
# fixture file name -> models.txt name or vocab file
SOURCES = {
    "SmolLM2-135M-Instruct.Q4_1.gguf": SMOL,
    "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf": "qwen2.5-coder-0.5b-instruct-q4_k_m",
    "ggml-vocab-qwen2.gguf": VOCAB / "ggml-vocab-qwen2.gguf",
}
_TOKENIZERS: dict = {}


def tokenizer_of(model_file: str):
    if model_file not in _TOKENIZERS:
        src = SOURCES[model_file]
        path = src if isinstance(src, Path) else real_model(src)
        _TOKENIZERS[model_file] = load_tokenizer(path)
    return _TOKENIZERS[model_file]


run = run_cli


def case_id(c):
    return f"{c['model'].split('.')[0]}-{c['case']}"


# ------------------------------------------------------------------------------------ rendering


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_jinja_rendering_and_tokens(case):
    tok = tokenizer_of(case["model"])
    text = tok.apply_chat_template(case["messages"], add_generation_prompt=case["add_generation_prompt"])
    assert text == case["jinja_rendering"]
    assert tok.tokenize(text, add_special=True, parse_special=True) == case["tokens"]


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_builtin_rendering_and_tokens(case):
    tok = tokenizer_of(case["model"])
    text = tok.apply_chat_template(case["messages"], add_generation_prompt=case["add_generation_prompt"], jinja=False)
    assert text == case["builtin_rendering"]
    assert tok.tokenize(text, add_special=True, parse_special=True) == case["builtin_tokens"]


@pytest.mark.parametrize("model_file", sorted(TEMPLATES))
def test_template_and_special_texts_read_from_the_gguf(model_file):
    from synapse_nb.chat import special_texts

    tok = tokenizer_of(model_file)
    ref = TEMPLATES[model_file]
    assert hashlib.sha256(tok.chat_template.encode()).hexdigest() == ref["sha256"]
    assert tok.chat_template == ref["chat_template"]
    assert special_texts(tok) == (ref["bos_token"], ref["eos_token"])
    assert (tok.bos_id, tok.eos_id, tok.add_bos) == (ref["bos_token_id"], ref["eos_token_id"], ref["add_bos"])


def test_bos_eos_stripping_rule():
    # README: with add_bos, a rendering that starts with the bos_token text loses that prefix (for SmolLM2,
    # whose bos_token is <|im_start|>, the first one); with add_eos, a trailing eos_token goes likewise.
    ref = TEMPLATES["SmolLM2-135M-Instruct.Q4_1.gguf"]
    case = next(c for c in CASES if c["model"] == "SmolLM2-135M-Instruct.Q4_1.gguf" and c["case"] == "system_user")
    tmpl = ChatTemplate(ref["chat_template"], "test")
    args = (tmpl, case["messages"], True, ref["bos_token"], ref["eos_token"])
    assert render_jinja(*args) == case["jinja_rendering"]
    assert render_jinja(*args, add_bos=True) == case["jinja_rendering"][len("<|im_start|>"):]
    no_gen = next(c for c in CASES if c["model"] == "SmolLM2-135M-Instruct.Q4_1.gguf"
                  and c["case"] == "assistant_last_no_gen")
    # this rendering ends "<|im_end|>\n", not with the eos text: nothing to strip
    assert render_jinja(tmpl, no_gen["messages"], False, "<|im_start|>", "<|im_end|>", add_eos=True) \
        == no_gen["jinja_rendering"]
    assert render_jinja(ChatTemplate("x{{ eos_token }}", "t"), [], False, "", "</s>", add_eos=True) == "x"
    assert render_jinja(ChatTemplate("x{{ eos_token }}", "t"), [], False, "", "</s>") == "x</s>"


def test_llama_cpp_variables():
    # add_generation_prompt is undefined (not false) when not asked for; tools absent; enable_thinking true
    t = ChatTemplate("{{ add_generation_prompt is defined }} {{ tools is defined }} {{ enable_thinking }} "
                     "{{ bos_token }}{{ eos_token }} {{ messages[0].tool_calls is defined }}", "t")
    msgs = [{"role": "user", "content": "a"}]
    assert render_jinja(t, msgs, False, "<s>", "</s>") == "False False True <s></s> False"
    assert render_jinja(t, msgs, True, "<s>", "</s>").startswith("True ")
    # None content is passed as ""
    assert render_jinja(ChatTemplate("[{{ messages[0].content }}]", "t"), [{"role": "user", "content": None}],
                        True) == "[]"


def test_engine_settings_and_functions():
    # llama.cpp's lexer: trim_blocks + lstrip_blocks, one trailing newline dropped, \r\n read as \n
    t = ChatTemplate("a\r\n  {% if true %}\r\nb\r\n  {% endif %}\r\nc\n", "t")
    assert render_jinja(t, [], True) == "a\nb\nc"
    # tojson as Hugging Face / llama.cpp: plain JSON, no HTML escaping, non-ASCII kept
    t = ChatTemplate("{{ {'a': '<b>&\\'é', 'n': [1, 2]} | tojson }}", "t")
    assert render_jinja(t, [], True) == '{"a": "<b>&\'é", "n": [1, 2]}'
    t = ChatTemplate("{{ strftime_now('%Y') }}", "t")
    import datetime

    assert render_jinja(t, [], True) == str(datetime.date.today().year)
    t = ChatTemplate("{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.role }}"
                     "{% endfor %}", "t")
    assert render_jinja(t, [{"role": "a", "content": ""}, {"role": "b", "content": ""}], True) == "a"


@pytest.mark.parametrize("source,line,what", [
    ("line one\n{% if messages %}\n{{ messages[0].content }\n{% endif %}", 3, "syntax error"),
    ("ok\n{% for m in messages %}\n{% if m.role == 'user' %}{{ raise_exception('roles must alternate') }}"
     "{% endif %}\n{% endfor %}", 3, "roles must alternate"),
    ("a\nb\n{{ messages[0].content + undefined_name.x }}", 3, "undefined"),
    ("{{ messages.append(1) }}", 1, "cannot render"),  # the sandbox: no mutation
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", 1, "cannot render"),
])
def test_template_errors_name_the_file_and_line(source, line, what):
    tok = load_tokenizer(VOCAB / "ggml-vocab-qwen2.gguf")
    with pytest.raises(SynapseError) as e:
        tok.apply_chat_template([{"role": "user", "content": "hi"}], chat_template=source)
    msg = str(e.value)
    assert f"line {line}" in msg and what in msg
    with pytest.raises(SynapseError) as e:
        from synapse_nb.chat import apply_chat_template

        apply_chat_template(tok, [{"role": "user", "content": "hi"}], chat_template=source, origin="my.jinja")
    assert "my.jinja" in str(e.value) and f"line {line}" in str(e.value)


def test_gguf_template_error_names_the_model(tmp_path):
    tok = load_tokenizer(VOCAB / "ggml-vocab-qwen2.gguf")
    tok.chat_template = "{% if %}"
    with pytest.raises(SynapseError, match=r"ggml-vocab-qwen2\.gguf \(tokenizer\.chat_template\), line 1"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


# llama.cpp's ChatML fallback for a model without a template (common/chat.cpp CHATML_TEMPLATE_SRC)
CHATML_HI = "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_no_template_falls_back_to_chatml():
    """As llama.cpp's common_chat_templates_init: a GGUF without a template (Gemma 3 270M base,
    the Llama 3 vocabulary here) is rendered with its built-in ChatML template, Jinja or not."""
    tok = load_tokenizer(VOCAB / "ggml-vocab-llama-bpe.gguf")
    assert tok.chat_template is None
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs) == CHATML_HI
    assert tok.apply_chat_template(msgs, jinja=False) == CHATML_HI
    # an override works on a vocabulary without a template
    src = TEMPLATES["ggml-vocab-qwen2.gguf"]["chat_template"]
    case = next(c for c in CASES if c["model"] == "ggml-vocab-qwen2.gguf" and c["case"] == "system_user")
    assert tok.apply_chat_template(case["messages"], chat_template=src) == case["jinja_rendering"]


def test_builtin_refuses_other_families():
    tok = load_tokenizer(VOCAB / "ggml-vocab-qwen2.gguf")
    with pytest.raises(SynapseError, match="--no-jinja"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}], chat_template="[INST] {{ x }}", jinja=False)


def test_bad_messages():
    tok = load_tokenizer(VOCAB / "ggml-vocab-qwen2.gguf")
    for bad in ("hi", [{"content": "x"}], [{"role": "user", "content": 3}]):
        with pytest.raises(SynapseError):
            tok.apply_chat_template(bad)


# ------------------------------------------------------------------------------------------ CLI


def test_single_turn_json_prompt_tokens_equal_llama_cpp():
    real_model(SMOL)
    ref = RUNS["single_turn"]
    res = run(SMOL, "-st", "-sys", "You are terse.", "-p", "Name a color.", "--json")
    assert res.returncode == 0, res.stderr.decode()
    out = json.loads(res.stdout)
    assert out["prompt_tokens"] == ref["prompt_tokens"]
    assert out["text"] == ref["reply"]  # llama.cpp's greedy reply
    assert out["stop"] == "eog" and out["tokens"][-1] == 2  # <|im_end|>


@pytest.mark.parametrize("jinja", [True, False])
def test_single_turn_renders_as_llama_cpp(jinja):
    real_model(SMOL)
    case = next(c for c in CASES if c["model"] == "SmolLM2-135M-Instruct.Q4_1.gguf" and c["case"] == "single_user")
    res = run(SMOL, "-st", case["messages"][0]["content"], "-n", "1", "--json", "--jinja" if jinja else "--no-jinja")
    assert res.returncode == 0, res.stderr.decode()
    out = json.loads(res.stdout)
    assert out["prompt_tokens"] == case["tokens" if jinja else "builtin_tokens"]
    assert len(out["tokens"]) == 1 and out["stop"] == "length"


def test_no_template_chats_in_chatml_with_a_warning():
    """llama-cli forced into a conversation (-cnv) without a template: ChatML, and its warning."""
    from conftest import tiny

    res = run(tiny("tiny-llama-f32"), "-st", "-sys", "S", "-p", "hi", "-n", "1", "--json")
    assert res.returncode == 0, res.stderr.decode()
    tok = load_tokenizer(tiny("tiny-llama-f32"))
    assert json.loads(res.stdout)["prompt_tokens"] == tok.tokenize(CHATML_HI, add_special=True, parse_special=True)
    assert b"no chat template" in res.stderr and b"ChatML" in res.stderr


def test_bad_template_file_is_one_line_exit_2(tmp_path):
    real_model(SMOL)
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}\n{{ m.content }\n{% endfor %}")
    res = run(SMOL, "-st", "-p", "hi", "--chat-template-file", bad)
    assert res.returncode == 2
    line = one_error_line(res)
    assert line.startswith("error: ") and "bad.jinja" in line and "line 2" in line
    bad.write_text("ok\n{{ raise_exception('no system role') if messages[0].role == 'system' }}")
    res = run(SMOL, "-st", "-sys", "S", "-p", "hi", "--chat-template-file", bad)
    assert res.returncode == 2
    line = one_error_line(res)
    assert "bad.jinja" in line and "line 2" in line and "no system role" in line
    res = run(SMOL, "-st", "-p", "hi", "--chat-template-file", tmp_path / "missing.jinja")
    assert res.returncode == 2 and "missing.jinja" in one_error_line(res)


def test_runaway_template_memory_is_an_error(monkeypatch):
    # a template doubling a string 60 times took the machine's memory (OOM kill); now a one-line error
    import synapse_nb.chat as chat

    monkeypatch.setattr(chat, "RENDER_MEMORY_BYTES", 256 << 20)
    t = ChatTemplate('{% set ns = namespace(s="x") %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}'
                     '{% endfor %}{{ ns.s }}', "t.jinja")
    import resource

    before = resource.getrlimit(resource.RLIMIT_AS)
    with pytest.raises(SynapseError, match="t.jinja: rendering it needs more than 256 MiB of memory"):
        t.render({"messages": []})
    assert resource.getrlimit(resource.RLIMIT_AS) == before  # the limit is lifted after
    assert ChatTemplate("{{ messages | length }}", "ok").render({"messages": [1, 2]}) == "2"


def test_runaway_template_time_is_an_error(monkeypatch):
    # nested loops of 10^10 iterations would hang the chat; now a one-line error after RENDER_SECONDS
    import signal

    import synapse_nb.chat as chat

    monkeypatch.setattr(chat, "RENDER_SECONDS", 0.5)
    t = ChatTemplate("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "t.jinja")
    t0 = time.perf_counter()
    with pytest.raises(SynapseError, match="t.jinja: rendering it takes more than 0.5 s"):
        t.render({"messages": []})
    assert time.perf_counter() - t0 < 10
    assert signal.getitimer(signal.ITIMER_REAL)[0] == 0 and signal.getsignal(signal.SIGALRM) == signal.SIG_DFL


def test_template_file_device_empty_rendering_and_seed_in_json(tmp_path):
    real_model(SMOL)
    res = run(SMOL, "-st", "-p", "hi", "--chat-template-file", "/dev/zero")
    assert res.returncode == 2 and one_error_line(res) == "error: --chat-template-file /dev/zero: not a regular file"
    empty = _write(tmp_path / "empty.jinja", "")
    res = run(SMOL, "-st", "-p", "hi", "-n", "2", "--chat-template-file", empty)
    assert res.returncode == 2
    assert one_error_line(res) == "error: the chat template rendered the conversation as an empty prompt (no tokens)"
    res = run(SMOL, "-st", "-p", "hi", "-n", "2", "--temp", "0.7", "-s", "7", "--json")
    assert res.returncode == 0, res.stderr.decode()
    assert json.loads(res.stdout)["seed"] == 7  # as the README says of --json when sampling


def test_chat_template_file_is_used(tmp_path):
    real_model(SMOL)
    # the qwen2 vocabulary's template (other default system text) on SmolLM2: its rendering, SmolLM2's ids
    qwen = TEMPLATES["ggml-vocab-qwen2.gguf"]["chat_template"]
    f = tmp_path / "t.jinja"
    f.write_text(qwen)
    case = next(c for c in CASES if c["model"] == "ggml-vocab-qwen2.gguf" and c["case"] == "unicode")
    res = run(SMOL, "-st", "-f", _write(tmp_path / "u.txt", case["messages"][0]["content"]), "-n", "1", "--json",
              "--chat-template-file", f)
    assert res.returncode == 0, res.stderr.decode()
    smol = tokenizer_of("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert json.loads(res.stdout)["prompt_tokens"] == smol.tokenize(case["jinja_rendering"], True, True)


def _write(path: Path, text: str) -> Path:
    path.write_bytes(text.encode())
    return path


def test_context_full_stops_the_reply_and_a_turn_that_does_not_fit_is_refused():
    real_model(SMOL)
    ref = RUNS["single_turn"]
    n = len(ref["prompt_tokens"])  # 23
    res = run(SMOL, "-st", "-sys", "You are terse.", "-p", "Name a color.", "--json", "-c", n + 3)
    assert res.returncode == 0, res.stderr.decode()
    out = json.loads(res.stdout)
    # as llama-completion: generation stops when n_past + 1 reaches n_ctx, the last token unevaluated
    assert out["stop"] == "context" and len(out["tokens"]) == 3 and out["n_past"] == n + 2
    assert "context full" in res.stderr.decode()
    res = run(SMOL, "-st", "-sys", "You are terse.", "-p", "Name a color.", "-c", n)
    assert res.returncode == 2
    assert "does not fit" in one_error_line(res) and res.stdout == b""


def test_piped_conversation_reuses_the_cache_and_matches_llama_cpp(tmp_path):
    real_model(SMOL)
    ref = RUNS["two_turn"]
    u1, u2 = ref["user_turns"]
    res = run(SMOL, "-cnv", "--json", "-v", input=f"{u1}\n\n{u2}\n/exit\nnot read\n".encode())
    assert res.returncode == 0, res.stderr.decode()
    t1, t2 = [json.loads(line) for line in res.stdout.decode().splitlines()]
    assert [t1["text"], t2["text"]] == ref["replies"]  # llama.cpp's greedy replies
    assert t1["stop"] == t2["stop"] == "eog"
    smol = tokenizer_of("SmolLM2-135M-Instruct.Q4_1.gguf")
    hist = [{"role": "user", "content": u1}, {"role": "assistant", "content": t1["text"]},
            {"role": "user", "content": u2}]
    full2 = smol.tokenize(smol.apply_chat_template(hist), True, True)
    assert t2["prompt_tokens"] == full2
    # the history's tokens are turn 1's prompt and reply, end-of-generation token included
    n1 = len(t1["prompt_tokens"]) + len(t1["tokens"])
    assert full2[:n1] == t1["prompt_tokens"] + t1["tokens"]
    # turn 2 evaluates reply 1's EOG token (not evaluated while generating) and the new turn only
    assert t1["n_reused"] == 0 and t1["n_evaluated"] == len(t1["prompt_tokens"])
    assert t2["n_reused"] == n1 - 1 == t1["n_past"]
    assert t2["n_evaluated"] == 1 + len(smol.tokenize(
        f"\n<|im_start|>user\n{u2}<|im_end|>\n<|im_start|>assistant\n", True, True))
    # the session's totals equal llama-completion's perf counters for the same conversation
    err = res.stderr.decode()
    assert re.search(rf"prompt eval time = .* / +{ref['prompt_eval_tokens']} tokens", err), err
    assert re.search(rf" eval time = .* / +{ref['eval_runs']} runs", err), err
    # the second reply is what a one-piece run of the whole history gives (main mode, no chat)
    one = run(SMOL, "-f", _write(tmp_path / "h.txt", smol.apply_chat_template(hist)), "--json", "-n", "128")
    assert one.returncode == 0, one.stderr.decode()
    one = json.loads(one.stdout)
    assert one["prompt_tokens"] == full2 and one["tokens"] == t2["tokens"]


def _spawn(args, log: Path):
    pexpect = pytest.importorskip("pexpect")
    cmd = " ".join(shlex.quote(a) for a in [sys.executable, "-m", "cli.main", *map(str, args)])
    env = dict(os.environ, TERM="dumb")
    return pexpect, pexpect.spawn("/bin/sh", ["-c", f"exec {cmd} 2>{shlex.quote(str(log))}"], cwd=str(ROOT),
                                  env=env, timeout=300, encoding="utf-8", echo=False)


def _reply(child, user: str) -> str:
    child.sendline(user)
    child.expect_exact("\r\n> ")
    text = child.before.replace("\r\n", "\n")
    if text.startswith(user + "\n"):  # readline's own echo of the input line
        text = text[len(user) + 1:]
    return text


def test_pty_two_turn_conversation(tmp_path):
    real_model(SMOL)
    ref = RUNS["two_turn"]
    u1, u2 = ref["user_turns"]
    log = tmp_path / "stderr.txt"
    pexpect, child = _spawn([SMOL, "-cnv", "-v"], log)
    child.expect_exact("> ")
    r1 = _reply(child, u1)
    r2 = _reply(child, u2)
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    err = log.read_text()
    assert child.exitstatus == 0, err
    assert [r1, r2] == ref["replies"]
    turns = re.findall(r"chat: turn (\d+): (\d+) prompt tokens, (\d+) reused from the cache, (\d+) evaluated; "
                       r"(\d+) generated, stop (\w+); n_past (\d+)", err)
    assert [t[0] for t in turns] == ["1", "2"], err
    (_, p1, k1, e1, g1, s1, np1), (_, p2, k2, e2, g2, s2, np2) = [tuple(map(_int, t)) for t in turns]
    smol = tokenizer_of("SmolLM2-135M-Instruct.Q4_1.gguf")
    full1 = smol.tokenize(smol.apply_chat_template([{"role": "user", "content": u1}]), True, True)
    hist = [{"role": "user", "content": u1}, {"role": "assistant", "content": r1}, {"role": "user", "content": u2}]
    full2 = smol.tokenize(smol.apply_chat_template(hist), True, True)
    assert (p1, k1, e1) == (len(full1), 0, len(full1))
    assert np1 == p1 + g1 - 1  # the reply's EOG token is chosen, not evaluated
    # the second reply starts from the first one's cache: only its EOG token and the new turn evaluated
    assert (p2, k2) == (len(full2), np1)
    assert e2 == p2 - k2 == 1 + len(smol.tokenize(f"\n<|im_start|>user\n{u2}<|im_end|>\n<|im_start|>assistant\n",
                                                 True, True))
    assert s1 == s2 == "eog"
    # greedy output identical to one single-turn run of the whole two-turn history rendered in one piece
    one = run(SMOL, "-f", _write(tmp_path / "h.txt", smol.apply_chat_template(hist)), "--json")
    assert one.returncode == 0, one.stderr.decode()
    one = json.loads(one.stdout)
    assert one["prompt_tokens"] == full2 and one["text"] == r2 and len(one["tokens"]) == g2


def _int(s):
    return int(s) if s.isdigit() else s


def test_pty_ctrl_c_stops_the_reply_then_exits_130(tmp_path):
    real_model(SMOL)
    log = tmp_path / "stderr.txt"
    pexpect, child = _spawn([SMOL, "-cnv", "-v"], log)
    child.expect_exact("> ")
    child.sendline("Write a very long story about a dragon and a knight, with many chapters.")
    child.expect(r"\w+ \w+ \w+")  # the reply is streaming
    child.sendintr()
    child.expect_exact("\r\n> ")  # the reply stopped, back at the prompt
    # At the prompt: exit. (Not in the same instant the prompt appears: a SIGINT that lands between
    # readline drawing the prompt and its select() is only seen at the next key, a CPython race.)
    time.sleep(0.5)
    child.sendintr()
    child.expect(pexpect.EOF)
    child.close()
    err = log.read_text()
    assert child.exitstatus == 130, err
    assert "stop interrupted" in err


def test_pty_exit_command(tmp_path):
    real_model(SMOL)
    log = tmp_path / "stderr.txt"
    pexpect, child = _spawn([SMOL, "-cnv", "-sys", "You are terse."], log)
    child.expect_exact("> ")
    child.sendline("/exit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0, log.read_text()


def test_conversation_rewinds_to_the_first_differing_token():
    from synapse_nb.chat import Conversation, chat_renderer

    model = shared_model(SMOL)
    tok = model.tokenizer
    conv = Conversation(Session(model, n_ctx=256, n_threads=2), chat_renderer(tok), "You are terse.")
    r1 = conv.reply("Name a color.", n_predict=8)
    assert r1.n_reused == 0 and r1.n_evaluated == len(r1.prompt_tokens)
    conv.messages[-1]["content"] = "Red."  # the history now differs from the cache at the reply's first token
    r2 = conv.reply("Another one.", n_predict=8)
    assert tok.tokenize("Red.", False, False)[0] != r1.tokens[0]
    assert r2.prompt_tokens[:len(r1.prompt_tokens)] == r1.prompt_tokens
    assert r2.n_reused == len(r1.prompt_tokens)  # kept up to the reply, re-evaluated from there
    assert r2.n_evaluated == len(r2.prompt_tokens) - r2.n_reused
    assert r2.n_past == conv.session.n_past == len(conv.cached)
    # the same greedy tokens as a fresh session evaluating the whole prompt at once
    fresh = Session(model, n_ctx=256, n_threads=2)
    assert fresh.generate(r2.prompt_tokens, 8) == r2.tokens


def test_jinja2_is_imported_only_to_render():
    code = ("import sys, synapse_nb, synapse_nb.chat, synapse_nb.tokenizer, cli.main; "
            "assert 'jinja2' not in sys.modules; "
            "t = synapse_nb.load_tokenizer(sys.argv[1]); t.apply_chat_template([{'role': 'user', 'content': 'a'}]); "
            "assert 'jinja2' in sys.modules")
    res = subprocess.run([sys.executable, "-c", code, str(VOCAB / "ggml-vocab-qwen2.gguf")], cwd=ROOT,
                         capture_output=True)
    assert res.returncode == 0, res.stderr.decode()


def test_endless_stdin_turn_is_bad_input():
    # -cnv reading /dev/zero (no newline ever): refused once the byte bound is read, exit 2, one line
    from conftest import real_model

    path = real_model("smollm2-135m-instruct-q4_1")
    with open("/dev/zero", "rb") as zero:
        res = subprocess.run([sys.executable, "-m", "cli.main", str(path), "-cnv", "-c", "256"], stdin=zero,
                             capture_output=True, timeout=300, cwd=ROOT)
    assert res.returncode == 2, res.stderr
    lines = res.stderr.decode().strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: standard input: a turn longer than"), lines
    assert res.stdout == b""


# ------------------------------------------------------------------- bad templates (issue 34)

def _capped(args, timeout=90, input=None):
    """Run a child Python under a 4 GiB address-space cap (a regression fails the test instead of
    taking the machine's memory); TimeoutExpired, a failure, when it hangs."""
    import resource

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))

    return subprocess.run([sys.executable, *map(str, args)], cwd=ROOT, capture_output=True, timeout=timeout,
                          preexec_fn=cap, input=input)


_COMPILE_BOMBS = ["{{ 10 ** 1000000000 }}", "{{ 'a' * 5000000000 }}", "{{ 'a' | center(5000000000) }}",
                  "{{ 'a\nb' | indent(5000000000) }}", "{{ [1] * 5000000000 }}",
                  "{% set ns = namespace(x=3) %}{% for i in range(40) %}{% set ns.x = ns.x * ns.x %}{% endfor %}"
                  "{{ ns.x }}"]


def test_template_compilation_and_integer_operations_are_capped():
    # jinja2 folds constant expressions while compiling, which ran outside the caps: 10 ** 1000000000
    # hung (C code, no signal check), 'a' * 5000000000 took 5 GB. Each is now a one-line error.
    script = ("import json, time\nfrom synapse_nb import SynapseError\nfrom synapse_nb.chat import ChatTemplate\n"
              f"for src in {_COMPILE_BOMBS!r}:\n"
              "    t0 = time.time()\n"
              "    try:\n        ChatTemplate(src, 'bomb.jinja').render({'messages': []}); out = 'rendered'\n"
              "    except SynapseError as e:\n        out = str(e)\n"
              "    print(json.dumps([out, time.time() - t0]), flush=True)\n")
    res = _capped(["-c", script])
    assert res.returncode == 0, res.stderr.decode()[-2000:]
    outs = [json.loads(line) for line in res.stdout.decode().splitlines()]
    assert len(outs) == len(_COMPILE_BOMBS)
    for src, (msg, seconds) in zip(_COMPILE_BOMBS, outs):
        assert msg.startswith("chat template of bomb.jinja") and seconds < 15, (src, msg, seconds)
    assert "more than 65536 bits" in outs[0][0] and "MiB of memory" in outs[1][0]
    # ordinary arithmetic still works
    assert ChatTemplate("{{ 2 ** 10 }} {{ 3 * 4 }} {{ 'ab' * 2 }} {{ 2 ** -1 }} {{ (2 ** 64) * 3 }}",
                        "t").render({}) == "1024 12 abab 0.5 55340232221128654848"


def _tiny_with_template(tmp_path, template: str) -> Path:
    """tiny-llama-f32 with `template` as its tokenizer.chat_template (a downloaded model's template)."""
    from conftest import tiny
    from fuzz import gguf as fz

    buf = tiny("tiny-llama-f32").read_bytes()
    lay = fz.parse_layout(buf)
    kvs = fz.replace_kv(lay, b"tokenizer.chat_template", fz.STRING, fz.enc_str(template))
    out = tmp_path / "templated.gguf"
    out.write_bytes(fz.build(lay, buf, kvs=kvs))
    return out


def test_gguf_template_bomb_with_single_turn_is_one_line_exit_2(tmp_path):
    model = _tiny_with_template(tmp_path, "{{ 10 ** 1000000000 }}")
    res = _capped(["-m", "cli.main", model, "-st", "-p", "hi", "-n", "1"], timeout=120)
    assert res.returncode == 2
    assert "templated.gguf (tokenizer.chat_template)" in one_error_line(res)


@pytest.mark.parametrize("source", ["{% if 1 %}" * 3000 + "{% endif %}" * 3000, "{{ " + "[" * 3000 + "]" * 3000 + " }}",
                                    "{{ " + "(" * 3000 + "1" + ")" * 3000 + " }}", "{{ " + "9" * 5000 + " }}"],
                         ids=["if", "lists", "parentheses", "5000-digit-int"])
def test_template_parse_failures_are_bad_input(source):
    # RecursionError (deep nesting) and ValueError (Python's int-string limit) came out of jinja2's parser
    with pytest.raises(SynapseError, match=r"chat template of deep\.jinja.*(nested too deeply|cannot compile)"):
        ChatTemplate(source, "deep.jinja").compile()


def test_huge_rendering_is_refused_before_tokenizing(tmp_path):
    # a 65-byte template printing 90 MB was tokenized whole (5.7 GB) before "does not fit"
    from conftest import tiny

    t = _write(tmp_path / "big.jinja", "{% for i in range(100000) %}{{ 'x' * 900 }}{% endfor %}")
    res = _capped(["-m", "cli.main", tiny("tiny-llama-f32"), "-st", "-p", "hi", "-n", "1", "-c", "64",
                   "--chat-template-file", t], timeout=120)
    assert res.returncode == 2
    line = one_error_line(res)
    assert "renders to more than" in line and "n_ctx = 64" in line


def test_single_turn_json_timings_have_the_completion_keys(tmp_path):
    # -st --json lacked load_ms, compile_ms and n_threads, which the completion JSON has
    from conftest import tiny

    t = tiny("tiny-llama-f32")
    tmpl = _write(tmp_path / "t.jinja", "{% for m in messages %}{{ m.content }}{% endfor %}")
    res = run(t, "-st", "-p", "hi", "-n", "2", "-t", "1", "--json", "--chat-template-file", tmpl, "-c", "64")
    assert res.returncode == 0, res.stderr.decode()
    turn = json.loads(res.stdout)
    done = json.loads(run(t, "-p", "hi", "-n", "2", "-t", "1", "--json", "-c", "64").stdout)
    assert list(turn["timings"]) == list(done["timings"])
    assert turn["timings"]["n_threads"] == 1
