"""llama-decode --server with the real `openai` client and raw httpx: answers equal the CLI's for
the same prompt, options and seed, whatever else runs; OpenAI-shaped errors; the server keeps
serving; clients that leave free their slot; SIGTERM / SIGINT end it with exit 0.

Every server runs on 127.0.0.1 on a free port, and every request loop here is bounded.
"""

import concurrent.futures
import json
import signal
import socket
import time

import httpx
import openai
import pytest

from conftest import real_model, run_cli, tiny

pytestmark = pytest.mark.slow  # a live server on SmolLM2 for the module
from serverproc import ServerProc, cli_json

MODEL = "smollm2-135m-instruct-q4_1"
N_CTX = 512


@pytest.fixture(scope="module")
def server():
    s = ServerProc(real_model(MODEL), "-np", "4", "-c", N_CTX, "--max-queue", "80")
    yield s
    t0 = time.monotonic()
    assert s.stop(signal.SIGTERM) == 0, s.stderr
    assert time.monotonic() - t0 < 20
    assert "Traceback" not in s.stderr


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def _cli(*args):
    return cli_json(real_model(MODEL), N_CTX, *args)


def _finish(cli_stop):
    return {"eog": "stop", "length": "length", "context": "length"}[cli_stop]


def test_completion_equals_cli(client):
    prompt = "The capital of France is"
    for flags, kw in ((["--temp", "0.8", "-s", "42"], dict(temperature=0.8, seed=42)),
                      (["--temp", "0"], dict(temperature=0.0)),
                      (["--temp", "1.1", "--top-k", "0", "--top-p", "0.9", "-s", "7"],
                       dict(temperature=1.1, top_p=0.9, seed=7, extra_body={"top_k": 0}))):
        ref = _cli(prompt, "-n", "24", *flags)
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, **kw)
        assert out.choices[0].text == ref["text"], flags
        assert out.choices[0].finish_reason == _finish(ref["stop"])
        n_gen = len(ref["tokens"]) - (ref["stop"] == "eog")
        assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(ref["prompt_tokens"]), n_gen)


def test_chat_equals_cli_and_stream_equals_whole(client):
    q = "What is the tallest mountain on Earth?"
    ref = _cli("-st", "-p", q, "-n", "32", "--temp", "0.8", "-s", "3")
    msgs = [{"role": "user", "content": q}]
    out = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=32, temperature=0.8, seed=3)
    assert out.choices[0].message.content == ref["text"]
    assert out.choices[0].message.role == "assistant"
    assert out.usage.prompt_tokens == len(ref["prompt_tokens"])
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=32, temperature=0.8, seed=3,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref["text"]
    assert chunks[-1].choices[0].finish_reason == out.choices[0].finish_reason


def test_sse_framing(server):
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                      json={"prompt": "Once upon a time", "max_tokens": 8, "stream": True, "seed": 1}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    objs = [json.loads(e[6:]) for e in events[:-1]]
    assert all(o["object"] == "text_completion" for o in objs)
    assert objs[-1]["choices"][0]["finish_reason"] == "length" and objs[-1]["usage"]["completion_tokens"] == 8


def test_stop_strings_are_cut_as_openai(client):
    prompt = "List three colors: red,"
    ref = _cli(prompt, "-n", "40", "--temp", "0")
    full = ref["text"]
    stop = next(c for c in (",", " e", "e", " ") if full.find(c) > 0)
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0, stop=[stop, "#@!"])
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == full[:full.find(stop)]
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=40, temperature=0, stop=[stop, "#@!"], stream=True))
    assert streamed == out.choices[0].text


def test_logprobs(client, server):
    msgs = [{"role": "user", "content": "Say hello."}]
    out = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0, logprobs=True,
                                         top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for e in content:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3
        tops = [t.logprob for t in e.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        assert e.logprob == tops[0] and e.token == e.top_logprobs[0].token  # greedy: the top token
    r = httpx.post(server.url + "/completion", timeout=60,
                   json={"prompt": "Hello", "n_predict": 5, "n_probs": 2, "temperature": 0})
    body = r.json()
    assert r.status_code == 200 and body["stop"] is True and body["tokens_predicted"] == 5
    assert len(body["completion_probabilities"]) == 5
    assert all(len(p["top_logprobs"]) == 2 for p in body["completion_probabilities"])


def test_many_concurrent_streams_equal_lone_runs(client):
    """64 streaming clients at once (4 slots: the rest queue), mixed prompts, seeds and lengths:
    each text equals what the same request gives with nothing else running."""
    prompts = ["The capital of France is", "def fib(n):", "Once upon a time", "The three primary colors are",
               "In 1969,", "import numpy as np\n", "Water boils at", "My favourite food is"]
    reqs = [dict(prompt=prompts[i % 8], max_tokens=8 + i % 9, temperature=0.7 + 0.1 * (i % 3), seed=1000 + i)
            for i in range(64)]
    alone = [client.completions.create(model=MODEL, **r).choices[0].text for r in reqs[:16]]

    def streamed(r):
        return "".join(c.choices[0].text for c in client.completions.create(model=MODEL, stream=True, **r))

    with concurrent.futures.ThreadPoolExecutor(64) as ex:
        got = list(ex.map(streamed, reqs, timeout=300))
    assert got[:16] == alone
    # the other 48: their own lone runs, one at a time, after the load
    assert got[16:] == [client.completions.create(model=MODEL, **r).choices[0].text for r in reqs[16:]]


def _slots_idle(server, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not any(s["is_processing"] for s in httpx.get(server.url + "/slots").json()):
            return True
        time.sleep(0.05)
    return False


def _predicted(server) -> int:
    text = httpx.get(server.url + "/metrics").text
    return int(next(ln.split()[1] for ln in text.splitlines() if ln.startswith("llamacpp:tokens_predicted_total")))


def test_disconnect_frees_the_slot(server):
    """A stream dropped after a few tokens: its sequence stops (far fewer than its 490 tokens are
    generated) and the slot is free."""
    assert _slots_idle(server, 10.0)
    before = _predicted(server)
    body = {"prompt": "Tell me a long story.", "max_tokens": 490, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i >= 4:
                break
    assert _slots_idle(server, 5.0)
    assert _predicted(server) - before < 300


def test_slow_reader_does_not_stall_others(server, client):
    """A client that sends a streaming request and never reads: the others still finish."""
    host, port = server.url[len("http://"):].split(":")
    body = json.dumps({"prompt": "Count: 1, 2, 3,", "max_tokens": 300, "ignore_eos": True, "stream": True})
    s = socket.create_connection((host, int(port)))
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\n\r\n{body}").encode())
    try:
        t0 = time.monotonic()
        ref = _cli("Water boils at", "-n", "20", "--temp", "0")
        out = client.completions.create(model=MODEL, prompt="Water boils at", max_tokens=20, temperature=0)
        assert out.choices[0].text == ref["text"]
        assert time.monotonic() - t0 < 60
    finally:
        s.close()
    assert _slots_idle(server, 10.0)


def _err(r, status):
    assert r.status_code == status, r.text
    e = r.json()["error"]
    assert isinstance(e["message"], str) and e["message"] and e["code"] == status
    return e["message"]


def test_bad_requests_get_openai_errors_and_the_server_goes_on(server):
    u = server.url
    post = lambda path, **kw: httpx.post(u + path, timeout=60, **kw)  # noqa: E731
    assert "JSON" in _err(post("/v1/completions", content=b'{"prompt": "x",', headers={"content-type":
                                                                                       "application/json"}), 400)
    _err(post("/v1/completions", json={"prompt": 5}), 400)
    assert "max_tokens" in _err(post("/v1/completions", json={"prompt": "x", "max_tokens": "5"}), 400)
    assert "bogus" in _err(post("/v1/completions", json={"prompt": "x", "bogus": 1}), 400)
    assert "context" in _err(post("/v1/completions", json={"prompt": "word " * 2000}), 400)
    assert "n = 2" in _err(post("/v1/completions", json={"prompt": "x", "n": 2}), 400)
    assert "vocabulary" in _err(post("/v1/completions", json={"prompt": "x", "logit_bias": {"99999999": 1}}), 400)
    _err(post("/v1/completions", json={"prompt": "x", "top_k": 1.5}), 400)
    _err(post("/v1/chat/completions", json={"messages": []}), 400)
    _err(post("/v1/chat/completions", json={"messages": [{"role": "user"}], "stream": "yes"}), 400)
    _err(post("/v1/completions", content=b"x" * (9 << 20), headers={"content-type": "application/json"}), 413)
    _err(httpx.get(u + "/v1/nothing-here"), 404)
    _err(post("/detokenize", json={"tokens": [-1]}), 400)
    assert httpx.get(u + "/health").json() == {"status": "ok"}
    r = post("/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"]


def test_llama_server_endpoints(server):
    u = server.url
    ref = _cli("Hello world", "--tokenize")
    ids = httpx.post(u + "/tokenize", json={"content": "Hello world", "add_special": True}).json()["tokens"]
    assert ids == ref
    plain = httpx.post(u + "/tokenize", json={"content": "Hello world"}).json()["tokens"]
    assert httpx.post(u + "/detokenize", json={"tokens": plain}).json()["content"] == "Hello world"
    q = "Hi there"
    chat = _cli("-st", "-p", q, "-n", "1")
    prompt = httpx.post(u + "/apply-template", json={"messages": [{"role": "user", "content": q}]}).json()["prompt"]
    assert httpx.post(u + "/tokenize", json={"content": prompt, "add_special": True}).json()["tokens"] == \
        chat["prompt_tokens"]
    props = httpx.get(u + "/props").json()
    assert props["total_slots"] == 4 and props["default_generation_settings"]["n_ctx"] == N_CTX
    slots = httpx.get(u + "/slots").json()
    assert [s["id"] for s in slots] == [0, 1, 2, 3]
    models = httpx.get(u + "/v1/models").json()
    assert models["data"][0]["id"].startswith(MODEL)
    metrics = httpx.get(u + "/metrics").text
    assert "llamacpp:prompt_tokens_total" in metrics and "llamacpp:requests_processing" in metrics
    page = httpx.get(u + "/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]


def test_queue_full_api_key_and_sigint():
    s = ServerProc(real_model(MODEL), "-np", "1", "--max-queue", "0", "-c", N_CTX, "--api-key", "sekret",
                   "--no-webui")
    try:
        u = s.url
        assert httpx.get(u + "/health").status_code == 200  # public
        _err(httpx.get(u + "/v1/models"), 401)
        _err(httpx.get(u + "/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
        auth = {"Authorization": "Bearer sekret"}
        assert httpx.get(u + "/v1/models", headers=auth).status_code == 200
        _err(httpx.get(u + "/", headers=auth), 404)  # --no-webui
        # one slot busy for about 490 tokens (a second or more), no queue: the next request is refused
        body = {"prompt": [1, 5, 6], "max_tokens": 490, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", u + "/v1/completions", json=body, headers=auth, timeout=60) as r:
            lines = r.iter_lines()  # kept: a dropped iterator closes the connection (httpx), cancelling it
            next(lines)
            assert "busy" in _err(httpx.post(u + "/v1/completions", json={"prompt": [1, 7], "max_tokens": 2},
                                             headers=auth, timeout=60), 503)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            r = httpx.post(u + "/v1/completions", json={"prompt": [1, 7], "max_tokens": 2}, headers=auth, timeout=60)
            if r.status_code == 200:
                break
            time.sleep(0.1)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    finally:
        assert s.stop(signal.SIGINT) == 0, s.stderr


def test_server_flags_errors():
    from conftest import one_error_line

    r = run_cli(tiny("tiny-llama-q4_0"), "--server", "--port", "0", "hello")
    assert r.returncode == 2 and "--server takes no prompt" in one_error_line(r)
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    try:
        r = run_cli(tiny("tiny-llama-q4_0"), "--server", "--port", busy.getsockname()[1])
        assert r.returncode == 2 and "cannot listen on 127.0.0.1" in one_error_line(r)
    finally:
        busy.close()
