"""What both fuzzers share: outcome classes, per-case limits and their measurement, the workers'
address-space cap, and llama-decode run in-process.

Every case runs in a worker process (one Python start-up for many cases) and is answered with a
result dict: its outcome class `cls` (one of CLASSES), `s` its wall time and `rss_mb` its peak
resident set size. A case is *flagged* when its class is in FLAGGED, or when it went over one of
issue 34's limits for a bad input: peak RSS over LIMIT_RSS_MB (2 GiB) or wall time over LIMIT_S
(30 s). `summarize` gives the counts per class, the flagged cases and the maxima.
"""

from __future__ import annotations

import io
import json
import os
import resource
import select
import signal
import subprocess
import sys
import time
from collections import Counter

CLASSES = ("ok", "clean", "exception", "signal", "timeout", "memory")
FLAGGED = ("exception", "signal", "timeout", "memory")
LIMIT_RSS_MB = 2048  # peak RSS of one bad-input case, MiB
LIMIT_S = 30.0  # wall time of one case, s
RETIRE_MB = 256  # a worker whose RSS grew this much over its start retires after the case (see PeakRSS)

# ru_maxrss is KiB on Linux, bytes on macOS
_MAXRSS_PER_MB = 1 << 20 if sys.platform == "darwin" else 1 << 10


class CaseTimeout(BaseException):
    """Raised by the per-case alarm (a BaseException, so the CLI's `except Exception` passes it on)."""


def _on_alarm(signum, frame):
    raise CaseTimeout()


def limit_as(mb: int):
    """preexec_fn of a worker: its own process group (killed whole) and an address-space cap of mb MiB."""
    def f():
        os.setsid()
        resource.setrlimit(resource.RLIMIT_AS, (mb << 20, mb << 20))
    return f


class PeakRSS:
    """Peak resident set size of this process (and of its children) during one case, MiB.

    Linux: `start` resets the kernel's high-water mark (writing 5 to /proc/self/clear_refs), so the
    VmHWM that `peak_mb` reads from /proc/self/status is the case's own peak. Where that is not
    possible, getrusage's ru_maxrss: the process's peak so far, an upper bound of the case's.
    Children (--subprocess cases) count through RUSAGE_CHILDREN: the largest child so far, again an
    upper bound. The peak includes what the worker held before the case (the library, the warmed
    kernels, the bases): `start` returns that (VmRSS, MiB; 0 where unknown), so that a result can
    tell a case's own growth from the worker's baseline. What a case leaves behind (memory the
    allocator keeps) would be counted in every later case's peak: `bloated` says when the worker has
    grown RETIRE_MB over its start, and the worker then retires (run_workers starts a fresh one).
    """

    def __init__(self):
        """Made once the worker is set up: its RSS then is the baseline `bloated` compares with."""
        self.exact = self._reset()
        self.base = self._status_mb("VmRSS:") if self.exact else 0.0

    def bloated(self) -> bool:
        return self.exact and self._status_mb("VmRSS:") > self.base + RETIRE_MB

    @staticmethod
    def _reset() -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            return True
        except OSError:
            return False

    def start(self) -> float:
        if not self.exact:
            return 0.0
        self._reset()
        return self._status_mb("VmRSS:")

    @staticmethod
    def _status_mb(field: str) -> float:
        with open("/proc/self/status") as f:
            return round(next(int(ln.split()[1]) for ln in f if ln.startswith(field)) / 1024, 1)

    def peak_mb(self) -> float:
        own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / _MAXRSS_PER_MB
        if self.exact:
            own = self._status_mb("VmHWM:")
        children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / _MAXRSS_PER_MB
        return round(max(own, children), 1)


def _cpu_s() -> float:
    """CPU seconds (user + system) of this process and its waited-for children so far."""
    own, ch = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + ch.ru_utime + ch.ru_stime


def run_case(fn, case, lib, soft_timeout: float, peak: PeakRSS) -> dict:
    """fn(case, lib) under the per-case alarm (soft_timeout s, 0 = none), with its wall time `s`,
    CPU time `cpu_s` (on a busy machine, or under nice, wall time counts the waits as well), peak
    RSS `rss_mb` and the RSS before it `rss0_mb` added to the result; an alarm is a "timeout"
    result."""
    old = signal.signal(signal.SIGALRM, _on_alarm)
    rss0 = peak.start()
    c0 = _cpu_s()
    t0 = time.perf_counter()
    signal.setitimer(signal.ITIMER_REAL, soft_timeout)
    try:
        res = fn(case, lib)
    except CaseTimeout:
        res = {"cls": "timeout", "detail": f"soft timeout {soft_timeout} s"}
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    res.update(s=round(time.perf_counter() - t0, 3), cpu_s=round(_cpu_s() - c0, 3), rss_mb=peak.peak_mb(),
               rss0_mb=rss0)
    if peak.bloated():
        res["retire"] = True  # the worker answers this case, then exits
    return res


def over_limits(res: dict) -> list[str]:
    """The limits a case's result went over, as phrases (empty: within both)."""
    out = []
    if res.get("rss_mb", 0) > LIMIT_RSS_MB:
        out.append(f"peak RSS {res['rss_mb']} MiB > {LIMIT_RSS_MB} MiB")
    if res.get("s", 0) > LIMIT_S:
        out.append(f"{res['s']} s > {LIMIT_S:g} s")
    return out


def summarize(results: dict) -> dict:
    """counts per class, the flagged results (class in FLAGGED or over a limit, with `over` set),
    the largest peak RSS, growth over the worker's baseline (rss_mb - rss0_mb), wall time and CPU
    time of any case, and how many cases went over a limit."""
    flagged, n_over = [], 0
    for k in sorted(results):
        x = results[k]
        over = over_limits(x)
        if over:
            x["over"], n_over = over, n_over + 1
        if over or x["cls"] in FLAGGED:
            flagged.append(x)
    counts = Counter(x["cls"] for x in results.values())
    return {"counts": {c: counts.get(c, 0) for c in CLASSES}, "flagged": flagged,
            "max_rss_mb": max((x.get("rss_mb", 0) for x in results.values()), default=0),
            "max_growth_mb": round(max((x.get("rss_mb", 0) - x.get("rss0_mb", 0) for x in results.values()),
                                       default=0), 1),
            "max_s": max((x.get("s", 0) for x in results.values()), default=0),
            "max_cpu_s": max((x.get("cpu_s", 0) for x in results.values()), default=0), "over_limits": n_over}


def library_outcome(fn, SynapseError) -> dict:
    """fn() called as a library user calls it: its result (None: {"cls": "ok"}), or its exception
    classified: a one-line SynapseError "clean", a multi-line one or any other exception
    "exception" (with where it was raised), MemoryError "memory"; the case's alarm passes."""
    try:
        return fn() or {"cls": "ok"}
    except SynapseError as e:
        msg = str(e)
        return {"cls": "clean", "detail": msg[:200]} if "\n" not in msg else \
            {"cls": "exception", "detail": "multi-line SynapseError: " + msg[:200]}
    except MemoryError:
        return {"cls": "memory", "detail": "MemoryError"}
    except CaseTimeout:
        raise
    except Exception as e:
        import traceback

        tb = traceback.extract_tb(e.__traceback__)[-1]
        return {"cls": "exception", "detail": f"{type(e).__name__}: {str(e)[:150]} at "
                                              f"{os.path.basename(tb.filename)}:{tb.lineno}"}


def run_cli(llama_decode, argv: list[str]) -> tuple[int | str, list[str]]:
    """llama-decode ARGV in this process, as its console entry point runs it: stdout and stdin
    empty buffers, stderr captured; an option error is one "error:" line and exit 2 (cli.main.main's
    formatting). Returns (exit status, or "memory" after a MemoryError; stderr's lines)."""
    import warnings

    import click

    out, err = io.TextIOWrapper(io.BytesIO(), encoding="utf-8"), io.StringIO()
    old = sys.stdout, sys.stderr, sys.stdin, warnings.showwarning
    sys.stdout, sys.stderr, sys.stdin = out, err, io.TextIOWrapper(io.BytesIO(b""), encoding="utf-8")
    code: int | str = 0
    try:
        code = llama_decode.main(argv, prog_name="llama-decode", standalone_mode=False) or 0
    except click.ClickException as e:
        err.write(f"error: {e.format_message()}\n")
        code = 2
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except MemoryError:
        code = "memory"
    except CaseTimeout:
        raise
    except Exception as e:
        err.write(f"internal error: {type(e).__name__}: {e}\n")
        code = 1
    finally:
        sys.stdout, sys.stderr, sys.stdin, warnings.showwarning = old
    return code, err.getvalue().splitlines()


# ------------------------------------------------------------------ the parent's side

class Worker:
    """A worker process: `cmd` in its own process group under limit_as(mem_mb), its stderr dropped.
    It answers {"ready": pid} once set up, then one JSON result line per job line on its stdin; a
    result with "retire" set is its last (it exits after it, and is replaced)."""

    def __init__(self, cmd: list[str], env: dict, mem_mb: int, cwd):
        self.p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                  preexec_fn=limit_as(mem_mb), env=env, text=True, bufsize=1, cwd=cwd)
        self.case = None
        self.deadline = None
        self.ready = False
        self.first = True  # its first case may load (or compile) kernels the warm-up did not

    def send(self, job: dict, timeout: float) -> None:
        self.case, self.deadline = job["case"], time.monotonic() + timeout
        self.p.stdin.write(json.dumps(job) + "\n")
        self.p.stdin.flush()

    def kill(self) -> None:
        try:
            os.killpg(self.p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.p.wait()


def run_workers(spawn, jobs: int, cases: list[int], timeout: float, job_of=None, progress: bool = False,
                first_extra: float = 60.0, hint: str = "") -> dict[int, dict]:
    """Run `cases` (in order) on `jobs` workers made by spawn() -> Worker; returns the results by case.

    job_of(k): the job line of case k (default {"case": k}). A case not answered within timeout s
    (timeout + first_extra for a worker's first case) is a "timeout" and its worker is replaced; a
    worker that dies on a case gives it "signal" (killed by one), "memory" (exit 137) or
    "exception", and is replaced. A worker that dies before it is ready ends the run (SystemExit
    with `hint`). progress: counts on stderr every 30 s.
    """
    todo = list(reversed(cases))
    results: dict[int, dict] = {}
    workers = [spawn() for _ in range(jobs)]
    t0 = last_print = time.monotonic()
    try:
        while len(results) < len(cases):
            for w in workers:
                if w.ready and w.case is None and todo:
                    k = todo.pop()
                    w.send(job_of(k) if job_of else {"case": k}, timeout + (first_extra if w.first else 0))
            fds = {w.p.stdout.fileno(): w for w in workers}
            for fd in select.select(list(fds), [], [], 0.5)[0]:
                w = fds[fd]
                line = w.p.stdout.readline()
                if not line:  # the worker died
                    code = w.p.wait()
                    if not w.ready:
                        raise SystemExit(f"fuzz worker failed to start (exit {code}); {hint}")
                    if w.case is not None:
                        cls = "signal" if code < 0 else "memory" if code == 137 else "exception"
                        results[w.case] = {"case": w.case, "cls": cls, "detail": f"worker exit {code}"}
                    workers[workers.index(w)] = spawn()
                    continue
                msg = json.loads(line)
                if "ready" in msg:
                    w.ready = True
                    continue
                results[msg["case"]] = msg
                w.case, w.first = None, False
                if msg.pop("retire", False):
                    w.p.stdin.close()
                    w.p.wait(timeout=30)
                    workers[workers.index(w)] = spawn()
            now = time.monotonic()
            for i, w in enumerate(workers):
                if w.case is not None and now > w.deadline:
                    results[w.case] = {"case": w.case, "cls": "timeout", "detail": f"hard timeout {timeout} s",
                                       "s": timeout}
                    w.kill()
                    workers[i] = spawn()
                elif not w.ready and w.p.poll() is not None:
                    raise SystemExit(f"fuzz worker failed to start (exit {w.p.returncode}); {hint}")
            if progress and now - last_print > 30:
                last_print = now
                c = Counter(x["cls"] for x in results.values())
                print(f"[{now - t0:6.0f} s] {len(results)}/{len(cases)} {dict(c)}", file=sys.stderr, flush=True)
        for w in workers:
            w.p.stdin.close()
            w.p.wait(timeout=30)
    finally:
        for w in workers:
            if w.p.poll() is None:
                w.kill()
    return results
