"""A llama-decode --server subprocess on a free 127.0.0.1 port, for the server and page tests."""

import json
import re
import signal
import subprocess
import sys
import time

from conftest import ROOT


class ServerProc:
    """`python -m cli.main MODEL --server --port 0 ARGS...` from the repository root; .url once it
    listens (read from its start-up line on stderr); stop() sends SIGTERM and returns the exit code."""

    def __init__(self, model, *args, start_timeout: float = 300.0):
        self.proc = subprocess.Popen([sys.executable, "-m", "cli.main", str(model), "--server", "--port", "0",
                                      *map(str, args)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True)
        self.stderr_lines = []
        deadline = time.monotonic() + start_timeout
        self.url = None
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            if not line:
                break
            self.stderr_lines.append(line)
            m = re.search(r"server listening on (http://\S+/)", line)
            if m:
                self.url = m.group(1).rstrip("/")
                break
        if self.url is None:
            self.proc.kill()
            raise RuntimeError("the server did not start:\n" + "".join(self.stderr_lines) + self.proc.stderr.read())

    def stop(self, sig=signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        self.stderr_lines.append(self.proc.stderr.read())
        return code

    @property
    def stderr(self) -> str:
        return "".join(self.stderr_lines)


def cli_json(model, n_ctx, *args):
    """The --json document of `llama-decode MODEL ARGS... -c n_ctx --json` (asserting exit 0)."""
    from conftest import run_cli

    r = run_cli(model, *args, "-c", n_ctx, "--json")
    assert r.returncode == 0, r.stderr.decode()
    return json.loads(r.stdout)
