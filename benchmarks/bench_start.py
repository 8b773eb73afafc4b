"""Start-up of a warm one-token run by phase: where llama-decode's wall time goes before and after
the model's one forward. Printed, not asserted.

Two measurements, in fresh processes, rounds interleaved (the host's speed drifts; medians):
  * the import phases, each the difference between two commands that stop one step apart:
    the interpreter and site (`python -c pass`), click and the CLI's modules (`import
    synapse_nb.cli.main`), NumPy and Numba as llama-decode imports them (`fast_start()`), the
    kernel modules (`import synapse_nb.engine, synapse_nb.cli.complete`), and the whole run
    (`llama-decode MODEL "Hello" -n 1 -c 512`, its own script run by this interpreter); each
    step ends with os._exit, as llama-decode's run does (no interpreter teardown);
  * the run's own phases after its imports, timed inside the run: the model's map and
    hyper-parameters (engine.load_model), the vocabulary and the prompt (to the session's
    creation), the session, the warm-up (its kernels loaded from Numba's cache and one
    forward), the prompt's forward and the rest of the generation, and the exit (from the
    generation's end to the process's end, seen by this process).
The cache must be warm: run the command once first (this script does, and says so when that
first run compiled).

usage: python benchmarks/bench_start.py [MODEL] [--rounds 9]
MODEL: a models.txt name or a GGUF path (default smollm2-135m-instruct-q4_1).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

# The run's phases: llama-decode's main with engine.load_model, engine.open_session,
# engine.warm_up and engine.generate wrapped by timers (their callers look them up at
# call time), each mark printed as seconds since this process's first line; the exit is the
# parent's wall time after the last mark.
_PHASES = r"""
import time
T0, W0 = time.perf_counter(), time.time()
import json, os, sys
marks = {"t0": W0, "start": 0.0}  # t0: the wall clock at the first line; the rest since it
def mark(name):
    marks[name] = time.perf_counter() - T0
sys.argv = ["llama-decode"] + sys.argv[1:]
import synapse_nb.cli.main as cli_main
mark("cli")
from synapse_nb.jit import fast_start
fast_start()
mark("numba")
from synapse_nb import engine
import synapse_nb.cli.complete  # noqa: F401
mark("modules")

def timed(obj, name, before=None, after=None):
    fn = getattr(obj, name)
    def wrapper(*a, **k):
        if before: mark(before)
        r = fn(*a, **k)
        if after: mark(after)
        return r
    setattr(obj, name, wrapper)

timed(engine, "load_model", "load0", "load1")
timed(engine, "open_session", "session0", "session1")
timed(engine, "warm_up", "warmup0", "warmup1")
timed(engine, "generate", "generate0", "generate1")
exit_ = cli_main._exit
def _exit(code):
    mark("end")
    marks["end_wall"] = time.time()
    os.write(int(os.environ["BENCH_START_FD"]), json.dumps(marks).encode())
    exit_(code)
cli_main._exit = _exit
cli_main.main()
"""

_STEPS = [  # (name, python -c code) of the import phases, each a step beyond the one before
    ("interpreter and site", "pass"),
    ("click and the CLI's modules", "import synapse_nb.cli.main"),
    ("NumPy and Numba (fast_start)", "import synapse_nb.cli.main; from synapse_nb.jit import fast_start; fast_start()"),
    ("kernel modules (engine, completion)",
     "import synapse_nb.cli.main; from synapse_nb.jit import fast_start; fast_start(); "
     "import synapse_nb.engine, synapse_nb.cli.complete"),
]


def _wall(cmd, env) -> float:
    t = time.perf_counter()
    subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    return time.perf_counter() - t


def _script() -> str:
    beside = Path(sys.executable).parent / "llama-decode"
    if not beside.is_file():
        sys.exit(f"error: no llama-decode beside {sys.executable} (pip install the package)")
    return str(beside)


def _phases_run(args, env) -> tuple[dict, tuple[float, float]]:
    """One instrumented run: its marks (seconds since its first line), and (seconds from its
    start to its first line, seconds from its last mark to its end), by the wall clock."""
    r, w = os.pipe()
    t = time.time()
    p = subprocess.Popen([sys.executable, "-c", _PHASES, *args], env=dict(env, BENCH_START_FD=str(w)),
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, pass_fds=(w,))
    os.close(w)
    data = os.read(r, 1 << 16)
    p.wait()
    done = time.time()
    os.close(r)
    if p.returncode != 0 or not data:
        sys.exit(f"error: the instrumented run failed (exit {p.returncode})")
    m = json.loads(data)
    return m, (m["t0"] - t, done - m["end_wall"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default="smollm2-135m-instruct-q4_1")
    ap.add_argument("--rounds", type=int, default=9)
    a = ap.parse_args()
    env = dict(os.environ)
    run_args = [a.model, "Hello", "-n", "1", "-c", "512"]
    script = _script()
    first = subprocess.run([script, *run_args, "-v"], env=env, capture_output=True, text=True)
    if first.returncode != 0:
        sys.exit(f"error: {first.stderr.strip().splitlines()[-1] if first.stderr.strip() else 'the run failed'}")
    if "compil" in first.stderr:
        print("(the first run compiled kernels; the rounds below load them from the cache)")
    walls = {name: [] for name, _ in _STEPS}
    walls["whole run (llama-decode)"] = []
    marks, outside = [], []
    for _ in range(a.rounds):  # interleaved: every phase sees the same drift of the host
        for name, code in _STEPS:
            walls[name].append(_wall([sys.executable, "-c", code + "; import os; os._exit(0)"], env))
        walls["whole run (llama-decode)"].append(_wall([sys.executable, script, *run_args], env))
        m, o = _phases_run(run_args, env)
        marks.append(m)
        outside.append(o)
    med = {k: statistics.median(v) for k, v in walls.items()}
    print(f"warm 1-token run of {a.model}, {a.rounds} rounds, medians (ms)")
    print(f"{'import phase':44s} {'ms':>7s}")
    prev = 0.0
    for name, _ in _STEPS:
        print(f"{name:44s} {1e3 * (med[name] - prev):7.1f}")
        prev = med[name]
    whole = med["whole run (llama-decode)"]
    print(f"{'the run after its imports':44s} {1e3 * (whole - prev):7.1f}")
    print(f"{'whole run (wall)':44s} {1e3 * whole:7.1f}")

    def span(k0, k1):
        return statistics.median(m[k1] - m[k0] for m in marks) * 1e3

    print(f"\n{'the same run, timed inside it':44s} {'ms':>7s}")
    print(f"{'its start to its first line (seen outside)':44s} {statistics.median(o[0] for o in outside) * 1e3:7.1f}")
    rows = [("click and the CLI's modules", "start", "cli"),
            ("NumPy and Numba (fast_start)", "cli", "numba"),
            ("kernel modules (engine, completion)", "numba", "modules"),
            ("to the model's load (options, model name)", "modules", "load0"),
            ("model map and hyper-parameters (load_model)", "load0", "load1"),
            ("vocabulary and prompt (to the session)", "load1", "session0"),
            ("session", "session0", "session1"),
            ("warm-up: kernels from the cache, one forward", "warmup0", "warmup1"),
            ("the prompt's forward and the generation", "generate0", "generate1"),
            ("output and timings", "generate1", "end")]
    for name, k0, k1 in rows:
        print(f"{name:44s} {span(k0, k1):7.1f}")
    print(f"{'exit (its last mark to its end, seen outside)':44s} {statistics.median(o[1] for o in outside) * 1e3:7.1f}")


if __name__ == "__main__":
    main()
