"""The chat page at / in a real headless Chromium (Debian's chromium + chromium-driver, driven by
selenium), against llama-decode --server with SmolLM2 on a free 127.0.0.1 port.

Replies equal the CLI's for the same conversation and settings (greedy), Stop frees the slot,
model text is never run as HTML, conversations live in localStorage, errors are said plainly,
and the page fits a phone's width. A screenshot of each state is written to the test's tmp dir.
"""

import json
import shutil
import signal
import time

import httpx
import pytest

from conftest import real_model, run_cli

pytestmark = pytest.mark.slow  # a live server and headless Chromium for the module
from serverproc import ServerProc

MODEL = "smollm2-135m-instruct-q4_1"
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"


@pytest.fixture(scope="module")
def server():
    s = ServerProc(real_model(MODEL), "-np", "2", "-c", "512", "--max-queue", "0")
    yield s
    s.stop(signal.SIGTERM)


@pytest.fixture(scope="module")
def browser():
    if not (shutil.which(CHROMIUM) and shutil.which(CHROMEDRIVER)):
        pytest.fail("the browser test needs Debian's chromium and chromium-driver: "
                    "apt-get install -y chromium chromium-driver (.ci/run installs them)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    # headless, no network of its own beyond our 127.0.0.1 server
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
              "--disable-background-networking", "--disable-component-update", "--disable-sync",
              "--window-size=1200,850"):
        opts.add_argument(a)
    d = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    d.set_script_timeout(30)
    yield d
    d.quit()


def _by(d, css):
    from selenium.webdriver.common.by import By

    return d.find_elements(By.CSS_SELECTOR, css)


def _wait(cond, timeout=60.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _open(d, server, clear=True):
    d.get(server.url + "/")
    if clear:
        d.execute_script("localStorage.clear()")
        d.get(server.url + "/")
    _wait(lambda: "context 512" in _by(d, "#model-info")[0].text, 20, "the model line from /props")


def _set(d, field, value):
    d.execute_script("const e = document.getElementById(arguments[0]); e.value = arguments[1];"
                     "e.dispatchEvent(new Event('change'));", field, str(value))


def _send(d, text):
    from selenium.webdriver.common.keys import Keys

    box = _by(d, "#input")[0]
    box.send_keys(text)
    box.send_keys(Keys.ENTER)


def _idle(d):
    return d.execute_script("return document.getElementById('send').disabled === false")


def _stored(d):
    chats = json.loads(d.execute_script("return localStorage.getItem('synapse_nb.chats')"))
    cur = d.execute_script("return localStorage.getItem('synapse_nb.current')")
    return next(c for c in chats if c["id"] == cur)


def test_two_turns_equal_the_cli(server, browser, tmp_path):
    d = browser
    _open(d, server)
    _set(d, "temperature", 0)
    _set(d, "max_tokens", 24)
    turns = ["What is the capital of France?", "And of Italy?"]
    _send(d, turns[0])
    _wait(lambda: len(_by(d, ".msg.assistant .stats")) == 1 and _idle(d), what="the first reply")
    first_on_screen = _by(d, ".msg.assistant .content")[0].text
    _send(d, turns[1])
    _wait(lambda: len(_by(d, ".msg.assistant")) == 2 and _idle(d) and "stop:" in _by(d, ".msg.assistant .stats")[-1].text,
          what="the second reply")
    d.save_screenshot(str(tmp_path / "two-turns.png"))
    replies = [m["content"] for m in _stored(d)["messages"] if m["role"] == "assistant"]
    r = run_cli(real_model(MODEL), "-cnv", "--temp", "0", "-n", "24", "-c", "512", "--json",
                input="\n".join(turns).encode() + b"\n")
    assert r.returncode == 0, r.stderr.decode()
    cli = [json.loads(line)["text"] for line in r.stdout.decode().splitlines()]
    assert replies == cli
    assert first_on_screen.split() == cli[0].replace("**", "").split()  # shown (Markdown rendered) as streamed
    stats = _by(d, ".msg.assistant .stats")[-1].text
    assert "tokens/s" in stats and "stop:" in stats


def test_stop_cancels_the_reply_and_frees_the_slot(server, browser):
    d = browser
    _open(d, server)
    _set(d, "max_tokens", 480)
    _set(d, "temperature", 0.8)
    before = _predicted(server)
    _send(d, "Write a very long story about a dragon who learns to bake bread, with many chapters.")
    _wait(lambda: _by(d, ".msg.assistant .content") and _by(d, ".msg.assistant .content")[0].text.strip(),
          what="the first streamed words")
    _by(d, "#stop")[0].click()
    _wait(lambda: "stop: stopped" in _by(d, ".msg.assistant .stats")[0].text, 10, "the stopped reply")
    _wait(lambda: not any(s["is_processing"] for s in httpx.get(server.url + "/slots").json()), 5, "a free slot")
    assert _predicted(server) - before < 400  # cancelled, not run to its 480 tokens
    assert _idle(d)


def _predicted(server) -> int:
    text = httpx.get(server.url + "/metrics").text
    return int(next(ln.split()[1] for ln in text.splitlines() if ln.startswith("llamacpp:tokens_predicted_total")))


def test_model_text_is_never_html(server, browser, tmp_path):
    """A stored reply (as the model could write it) with a script, an onerror image and Markdown:
    shown as text, nothing runs."""
    d = browser
    _open(d, server)
    evil = ('Here: <script>window.__xss = 1</script> <img src=x onerror="window.__xss = 2"> '
            '**bold** and `code`\n\n```\n<b>not bold</b>\n```')
    chat = {"id": "c1", "title": "<img src=y onerror=\"window.__xss = 3\">", "system": "",
            "messages": [{"role": "user", "content": "<i>hi</i>"}, {"role": "assistant", "content": evil}]}
    d.execute_script("localStorage.setItem('synapse_nb.chats', arguments[0]);"
                     "localStorage.setItem('synapse_nb.current', 'c1');", json.dumps([chat]))
    _open(d, server, clear=False)
    time.sleep(0.5)
    assert d.execute_script("return window.__xss") is None
    assert not _by(d, ".msg img") and not _by(d, ".msg script") and not _by(d, "#conversations img")
    content = _by(d, ".msg.assistant .content")[0]
    assert "<script>window.__xss = 1</script>" in content.text and "<b>not bold</b>" in content.text
    assert _by(d, ".msg.assistant strong")[0].text == "bold" and _by(d, ".msg.assistant code")[0].text == "code"
    assert _by(d, ".msg.user .content")[0].text == "<i>hi</i>"
    d.save_screenshot(str(tmp_path / "escaped.png"))


def test_conversations_are_kept_switched_and_deleted(server, browser):
    d = browser
    _open(d, server)
    _set(d, "max_tokens", 4)
    _send(d, "First conversation")
    _wait(lambda: _by(d, ".msg.assistant .stats") and _idle(d), what="a reply")
    _by(d, "#new-chat")[0].click()
    _send(d, "Second conversation")
    _wait(lambda: _by(d, ".msg.assistant .stats") and _idle(d), what="a reply")
    d.refresh()  # kept in localStorage across a reload
    titles = [e.text for e in _by(d, "#conversations .title")]
    assert titles == ["Second conversation", "First conversation"]
    assert _by(d, ".msg.user .content")[0].text == "Second conversation"
    _by(d, "#conversations .title")[1].click()
    assert _by(d, ".msg.user .content")[0].text == "First conversation"
    _by(d, "#conversations li button")[1].click()  # delete the first (current) one
    assert [e.text for e in _by(d, "#conversations .title")] == ["Second conversation"]
    assert _by(d, ".msg.user .content")[0].text == "Second conversation"


def test_enter_sends_shift_enter_is_a_new_line(server, browser):
    from selenium.webdriver.common.keys import Keys

    d = browser
    _open(d, server)
    _set(d, "max_tokens", 2)
    box = _by(d, "#input")[0]
    box.send_keys("line one")
    box.send_keys(Keys.SHIFT, Keys.ENTER)
    box.send_keys("line two")
    assert box.get_attribute("value") == "line one\nline two" and not _by(d, ".msg.user")
    box.send_keys(Keys.ENTER)
    _wait(lambda: _by(d, ".msg.assistant .stats") and _idle(d), what="a reply")
    assert _stored(d)["messages"][0]["content"] == "line one\nline two"


def test_busy_too_long_and_unreachable_are_said(server, browser, tmp_path):
    d = browser
    _open(d, server)
    _set(d, "max_tokens", 4)
    _send(d, "word " * 700)  # 700+ tokens: more than the 512 of a slot
    _wait(lambda: _by(d, ".notice"), 30, "the context message")
    assert "no longer fits in the model's context (512 tokens)" in _by(d, ".notice")[0].text
    assert not _by(d, ".msg.user")  # the turn is not kept; its text is back in the box
    assert _by(d, "#input")[0].get_attribute("value").startswith("word word")
    _by(d, "#input")[0].clear()
    # both slots kept busy (no queue) by clients that resend as soon as theirs ends: the page says
    # the server is busy (a send that slips into a free slot between two of theirs is sent again)
    import threading

    stop = threading.Event()

    def occupy():
        body = {"prompt": "Tell me a long story.", "max_tokens": 200, "ignore_eos": True}
        while not stop.is_set():
            httpx.post(server.url + "/v1/completions", json=body, timeout=60)

    workers = [threading.Thread(target=occupy) for _ in range(4)]
    for w in workers:
        w.start()
    try:
        _wait(lambda: all(s["is_processing"] for s in httpx.get(server.url + "/slots").json()), 30, "busy slots")
        for _ in range(5):
            _by(d, "#input")[0].clear()
            _send(d, "Hello?")
            _wait(lambda: _idle(d), 60, "the page to finish its request")
            if any("The server is busy" in n.text for n in _by(d, ".notice")):
                break
        assert any("The server is busy" in n.text for n in _by(d, ".notice"))
    finally:
        stop.set()
        for w in workers:
            w.join(120)
    d.save_screenshot(str(tmp_path / "busy.png"))
    # phone width: nothing wider than the screen
    d.set_window_size(390, 844)
    assert d.execute_script("return document.documentElement.scrollWidth <= window.innerWidth")
    d.save_screenshot(str(tmp_path / "phone.png"))
    d.set_window_size(1200, 850)
    # the server gone: said so
    server.stop(signal.SIGTERM)
    _by(d, "#input")[0].clear()
    _send(d, "Anyone there?")
    _wait(lambda: any("Cannot reach the server" in n.text for n in _by(d, ".notice")), 30, "the unreachable message")
