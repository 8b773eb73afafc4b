"""llama-decode --server --ray: the server on Ray Serve (a local Ray, 2 replicas of SmolLM2 with 1
thread each, started once for the module): concurrent chat and completion requests of the `openai`
client give the CLI's text for the same options and seed, a streamed request equals the whole one,
a replica killed mid-request gives its client an error and the next requests succeed, and SIGTERM
ends it with exit 0 and no Ray process left.

Every loop and wait here is bounded.
"""

import concurrent.futures
import json
import os
import signal
import socket
import threading
import time

import httpx
import openai
import pytest

from conftest import real_model, run_cli
from serverproc import ServerProc, cli_json

pytest.importorskip("ray.serve", reason="Ray Serve is not installed: pip install 'synapse_nb[ray]'")
pytestmark = pytest.mark.slow  # a Ray cluster and two Serve replicas for the module

MODEL = "smollm2-135m-instruct-q4_1"
N_CTX = 4096  # room for the LONG requests of the disconnect test


def _proc_table() -> dict:
    """{pid: (ppid, start time, cmdline)} of the running processes, from /proc."""
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        out[int(d)] = (int(fields[1]), fields[19], cmd)
    return out


def _descendants(pid: int) -> dict:
    """{pid: (start time, cmdline)} of every process below pid."""
    table = _proc_table()
    children = {}
    for p, (pp, _, _) in table.items():
        children.setdefault(pp, []).append(p)
    found, todo = {}, [pid]
    while todo:
        for c in children.get(todo.pop(), ()):
            found[c] = table[c][1:]
            todo.append(c)
    return found


def _alive(procs: dict) -> list:
    """The processes of procs ({pid: (start time, cmdline)}) still running (same pid and start time)."""
    table = _proc_table()
    return [cmd for p, (start, cmd) in procs.items() if p in table and table[p][1] == start
            and not cmd.startswith("[")]  # (a zombie's cmdline is empty: not counted either)


@pytest.fixture(scope="module")
def server():
    s = ServerProc(real_model(MODEL), "--ray", "--replicas", "2", "-t", "1", "-np", "2", "-c", N_CTX,
                   start_timeout=300)
    s.ray_procs = _descendants(s.proc.pid)
    yield s
    if s.proc.poll() is None:  # test_sigterm did not run (or failed before)
        s.stop(signal.SIGKILL)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def _cli(*args):
    return cli_json(real_model(MODEL), N_CTX, *args)


def test_startup_line_and_replicas(server):
    assert "2 replicas x 2 slots, 1 threads each" in server.stderr, server.stderr
    assert "Traceback" not in server.stderr and "WARNING" not in server.stderr, server.stderr
    replicas = [c for _, c in server.ray_procs.values() if c.startswith("ray::ServeReplica")]
    assert len(replicas) == 2, replicas


def test_concurrent_requests_equal_cli(client):
    prompt, q = "The capital of France is", "What is the tallest mountain on Earth?"
    ref_c = _cli(prompt, "-n", "16", "--temp", "0.8", "-s", "42")
    ref_chat = _cli("-st", "-p", q, "-n", "16", "--temp", "0.8", "-s", "42")

    def completion(_):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0.8, seed=42)
        return "c", r.choices[0].text

    def chat(_):
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": q}], max_tokens=16,
                                           temperature=0.8, seed=42)
        return "chat", r.choices[0].message.content

    with concurrent.futures.ThreadPoolExecutor(6) as ex:
        futs = [ex.submit(f, i) for i in range(3) for f in (completion, chat)]
        got = [f.result(timeout=180) for f in futs]
    for kind, text in got:
        assert text == (ref_c if kind == "c" else ref_chat)["text"], kind


def test_stream_equals_whole(client):
    msgs = [{"role": "user", "content": "Name three colours."}]
    whole = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=24, temperature=0.8, seed=5)
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=24, temperature=0.8, seed=5,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    pieces = list(client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=0,
                                            stream=True))
    one = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=0)
    assert "".join(p.choices[0].text for p in pieces) == one.choices[0].text


def _slots_busy(url) -> set:
    """The is_processing tuples of /slots over 10 requests (Serve spreads them over the replicas)."""
    return {tuple(x["is_processing"] for x in httpx.get(url + "/slots", timeout=30).json()) for _ in range(10)}


def test_client_disconnect_cancels_on_the_replica(server):
    # 4 long streams on the 2 x 2 slots, then 4 requests that are not streamed, each dropped by its
    # client while it is being generated: every slot is free again and the replicas idle within
    # CANCELLED_WITHIN seconds, far sooner than the ~LONG tokens left would take on any host
    replicas = _replica_pids(server)
    body = {"max_tokens": LONG, "ignore_eos": True}
    with httpx.Client(timeout=60) as cl:
        streams, lines = [], []
        for i in range(4):
            cm = cl.stream("POST", server.url + "/v1/completions", json={"prompt": [1, 5 + i], "stream": True, **body})
            r = cm.__enter__()
            lines.append(r.iter_lines())
            next(lines[-1])
            streams.append(cm)
        assert _computing(replicas)
        for cm in streams:
            cm.__exit__(None, None, None)
    _assert_cancelled(server, replicas)
    socks = [_post_raw(server.url, {"prompt": [1, 9 + i], **body}) for i in range(4)]
    try:
        assert _within(60, lambda: _computing(replicas)), [_received(s) for s in socks]
        for s in socks:
            s.setblocking(False)
            with pytest.raises(BlockingIOError):  # nothing received: the request is still being generated
                s.recv(1)
    finally:
        for s in socks:
            s.close()
    _assert_cancelled(server, replicas)


# Tokens of a request that its client drops: at 300 tokens/s (twice the 154 measured here for one
# stream alone on a replica) still 13 s of generation, against CANCELLED_WITHIN.
LONG = 4000
CANCELLED_WITHIN = 8
BUSY_CPU = 0.1  # CPU seconds over _cpu_used's 0.3 s: a replica that computes (an idle one: ~0)


def _replica_pids(server) -> list:
    """The pids of the Serve replicas started with the server (server.ray_procs)."""
    return [p for p, (_, c) in server.ray_procs.items() if c.startswith("ray::ServeReplica")]


def _within(seconds: float, cond) -> bool:
    """cond() again and again until it is true or `seconds` have passed; its last value."""
    deadline = time.monotonic() + seconds
    while not (ok := cond()) and time.monotonic() < deadline:
        pass
    return ok


def _computing(replicas) -> bool:
    """Whether some replica uses more than BUSY_CPU CPU seconds over the next 0.3 s."""
    return max(_cpu_used(replicas).values()) > BUSY_CPU


def _cpu_used(pids, dt: float = 0.3) -> dict:
    """{pid: CPU seconds (user + system) the process used over the next dt seconds}."""
    before = {p: _cpu_seconds(p) for p in pids}
    time.sleep(dt)
    return {p: _cpu_seconds(p) - before[p] for p in pids}


def _cpu_seconds(pid: int) -> float:
    """The process's user + system CPU time so far, in seconds (/proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _assert_cancelled(server, replicas):
    """Within CANCELLED_WITHIN seconds, /slots shows every slot free and no replica computes."""
    if not _within(CANCELLED_WITHIN, lambda: _slots_busy(server.url) == {(False, False)} and not _computing(replicas)):
        raise AssertionError(f"still busy {CANCELLED_WITHIN} s after the clients left: "
                             f"{_slots_busy(server.url)}, CPU seconds {_cpu_used(replicas)}")


def _received(s: socket.socket) -> bytes:
    """What s has received so far (for a failure's message)."""
    s.settimeout(1)
    try:
        return s.recv(4096)
    except OSError as e:
        return repr(e).encode()


def _post_raw(url, body) -> socket.socket:
    """A socket that has sent POST /v1/completions with the JSON body and reads nothing: closing it is
    a client that gives up (as one that times out does), whatever the server's speed."""
    u = httpx.URL(url)
    s = socket.create_connection((u.host, u.port), timeout=30)
    data = json.dumps(body).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (u.host.encode(), u.port, len(data), data))
    return s


def test_killed_replica_gives_an_error_then_requests_succeed(server, client):
    replicas = _replica_pids(server)

    started = threading.Semaphore(0)

    def long_stream(i):
        n = 0
        try:
            for _ in client.completions.create(model=MODEL, prompt=[1, 5 + i], max_tokens=400, temperature=0,
                                               extra_body={"ignore_eos": True}, stream=True):
                n += 1
                if n == 1:
                    started.release()
        except openai.APIError as e:  # the broken stream: an error the client can handle
            return "error", type(e).__name__
        except Exception as e:  # noqa: BLE001 - reported: the test fails on anything else
            return "other", f"{type(e).__name__}: {e}"
        return "done", n

    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        futs = [ex.submit(long_stream, i) for i in range(4)]  # 4 streams on the 2 x 2 slots
        # Serve routes the streams by load (2 + 2, or 3 + 1 with one queued): once two have their
        # first token, the replica that is computing (its CPU time grows) is killed mid-generation,
        # ~400 tokens before its streams end, whatever the host's speed (a fixed wait let a fast host
        # finish them first)
        for _ in range(2):
            assert started.acquire(timeout=120)
        used = _cpu_used(replicas)
        busy = max(used, key=used.get)
        os.kill(busy, signal.SIGKILL)
        results = [f.result(timeout=240) for f in futs]
    assert not [r for r in results if r[0] == "other"], results
    assert [r for r in results if r[0] == "error"], results  # the killed replica's clients
    # the surviving replica serves; Ray restarts the killed one (bounded: 120 s)
    ok, deadline, errors = 0, time.monotonic() + 120, []
    while ok < 4 and time.monotonic() < deadline:
        try:
            r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0)
            ok += r.choices[0].text != ""
        except openai.APIError as e:
            errors.append(type(e).__name__)
            ok = 0
            time.sleep(1)
    assert ok == 4, errors
    # Ray Serve starts a new replica in place of the killed one (bounded: 120 s)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        now = {p: v for p, v in _descendants(server.proc.pid).items() if v[1].startswith("ray::ServeReplica")}
        if len(now) == 2 and set(now) != set(replicas):
            break
        time.sleep(1)
    assert len(now) == 2 and busy not in now, now
    server.ray_procs.update(_descendants(server.proc.pid))  # the new replica: to be gone after SIGTERM too


def test_sigterm_stops_everything(server):
    t0 = time.monotonic()
    assert server.stop(signal.SIGTERM, timeout=90) == 0, server.stderr
    assert time.monotonic() - t0 < 90
    assert "Traceback" not in server.stderr
    assert server.stderr.rstrip().endswith("server stopped"), server.stderr
    left, deadline = _alive(server.ray_procs), time.monotonic() + 15
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = _alive(server.ray_procs)
    assert not left, left


def test_without_ray_serve_exits_2(tmp_path):
    # Ray not importable (a `ray` package that fails first on the path): one error line with the
    # install command, exit 2
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'ray'\", name='ray')\n")
    r = run_cli(MODEL, "--server", "--ray", timeout=120, env={**os.environ, "PYTHONPATH": str(tmp_path)})
    err = r.stderr.decode()
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert r.returncode == 2, err
    assert len(lines) == 1 and lines[0].startswith("error:") and "pip install 'synapse_nb[ray]'" in lines[0], err


def test_replicas_flag_errors():
    from conftest import one_error_line

    for args in (["--server", "--ray", "--replicas", "0"], ["--server", "--ray", "--replicas", "3:2"],
                 ["--server", "--ray", "--replicas", "two"], ["--server", "--replicas", "2"]):
        r = run_cli(MODEL, *args, timeout=120)
        assert r.returncode == 2, args
        assert "--replicas" in one_error_line(r), args
