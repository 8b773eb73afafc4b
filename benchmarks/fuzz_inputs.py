#!/usr/bin/env python3
"""Fuzzer of the inputs that are not GGUF files: chat templates, batch lines, command-line flags.

    python benchmarks/fuzz_inputs.py --kind template --n 2000 [--seed 0]
    python benchmarks/fuzz_inputs.py --kind batch --n 2000
    python benchmarks/fuzz_inputs.py --kind flags --n 2000
    python benchmarks/fuzz_inputs.py --kind template --case 17 --show      # print one case

Case k of (kind, seed) is a pure function of random.Random(f"{kind}/{seed}/{k}"). The mutators
build what issue 34 found by hand, and combinations of it:

  template  a chat template from pieces: integer / string / list bombs (**, *, center, indent,
            format, range), deep nesting (if, for, lists, parentheses, filters), over-long integer
            constants, syntax errors, loops printing megabytes, raise_exception, attribute probes
  batch     one JSONL input line: huge / 5000-digit / float / negative / NaN values for id,
            n_predict, tokens and every sampling key, deep nesting, wrong types, unknown keys
  flags     a command line for the tiny model: every integer option with huge / 5000-digit /
            negative / non-numeric values, float options with inf / nan / 1e39, llama.cpp flags
            (-no-cnv, -fa, -ub, -e, -i, ...), --tokens with hostile items, clashing options

Each case runs in a worker process (RLIMIT_AS --mem-mb, a per-case alarm; the parent kills a worker
that does not answer within --timeout and records a timeout). Outcomes:

  ok        rendered / decoded / exit 0
  clean     one-line SynapseError, or CLI exit 2 with one "error: " stderr line (a bad batch line's
            "error" result counts as clean)
  exception anything else (a traceback, exit 1, a multi-line error)
  signal / timeout / memory   as in fuzz_gguf.py
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import resource
import select
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "tests" / "data" / "tiny" / "tiny-llama-q8_0.gguf"
CLASSES = ("ok", "clean", "exception", "signal", "timeout", "memory")
FLAGGED = ("exception", "signal", "timeout", "memory")

HUGE = ["9" * 5000, "99999999999999999999", str(2**63), str(2**31), "-" + "9" * 30, "1e300", "-1e300",
        "1e39", "nan", "inf", "-inf", "0", "-1", "-2", "x", "", "0x10", "1.5", "\uff11"]


# ------------------------------------------------------------------ templates

def _tmpl_piece(rng, depth=0) -> str:
    big = rng.choice(["1000000000", "5000000000", "9" * 30, "99999", "64"])
    leaves = [
        f"{{{{ 10 ** {big} }}}}", f"{{{{ 'a' * {big} }}}}", f"{{{{ [1] * {big} }}}}",
        f"{{{{ 'a' | center({big}) }}}}", f"{{{{ 'a\\nb' | indent({big}) }}}}", f"{{{{ '%{big}d' % 1 }}}}",
        f"{{{{ '{{:>{big}}}'.format(1) }}}}", f"{{% for i in range({big}) %}}x{{% endfor %}}",
        "{% for i in range(100000) %}{{ 'x' * 900 }}{% endfor %}",
        "{% set ns = namespace(x=3) %}{% for i in range(40) %}{% set ns.x = ns.x * ns.x %}{% endfor %}{{ ns.x }}",
        "{{ " + "9" * rng.choice([100, 4301, 5000]) + " }}", "{{ raise_exception('no') }}",
        "{{ ''.__class__.__mro__ }}", "{{ messages[0].content }}", "{{ undefined.x.y }}", "{% if %}",
        "{{ messages | tojson(indent=" + big + ") }}", "{{ (2 ** 64) * (2 ** 64) }}", "{{ 2 ** -" + big + " }}",
        "{% macro m(n) %}{{ m(n) }}{% endmacro %}{{ m(1) }}", "{{ 'x' ~ 'y' }}", "{{ bos_token }}",
    ]
    if depth < 2 and rng.random() < 0.3:
        n = rng.choice([10, 300, 3000])
        kind = rng.choice(["if", "list", "paren", "filter", "for"])
        if kind == "if":
            return "{% if 1 %}" * n + _tmpl_piece(rng, depth + 1) + "{% endif %}" * n
        if kind == "list":
            return "{{ " + "[" * n + "1" + "]" * n + " }}"
        if kind == "paren":
            return "{{ " + "(" * n + "1" + ")" * n + " }}"
        if kind == "filter":
            return "{{ 'a'" + " | upper" * n + " }}"
        return "{% for a in [1] %}" * min(n, 200) + "x" + "{% endfor %}" * min(n, 200)
    return rng.choice(leaves)


def make_template(rng) -> str:
    return "".join(_tmpl_piece(rng) for _ in range(rng.choice([1, 1, 2, 3])))


def run_template(src: str, lib) -> dict:
    SynapseError, ChatTemplate = lib
    try:
        ChatTemplate(src, "fuzz.jinja").render({"messages": [{"role": "user", "content": "hi"}],
                                                 "bos_token": "<s>", "eos_token": "</s>",
                                                 "add_generation_prompt": True})
        return {"cls": "ok"}
    except SynapseError as e:
        return {"cls": "clean" if "\n" not in str(e) else "exception", "detail": str(e)[:200]}
    except MemoryError:
        return {"cls": "memory", "detail": "MemoryError"}
    except Exception as e:
        return {"cls": "exception", "detail": f"{type(e).__name__}: {str(e)[:200]}"}


# ------------------------------------------------------------------ batch lines

_KEYS = ["n_predict", "temp", "top_k", "top_p", "min_p", "typical_p", "min_keep", "penalty_last_n",
         "repeat_penalty", "frequency_penalty", "presence_penalty", "top_n_sigma", "xtc_probability",
         "xtc_threshold", "dynatemp_range", "dynatemp_exponent", "seed", "logit_bias"]


def _json_value(rng) -> str:
    return rng.choice(["9" * 5000, "99999999999999999999", "-99999999999999999999", "1e300", "-1e300", "1e-320",
                       "NaN", "Infinity", "-Infinity", "0", "-1", "1.5", "true", "null", '"x"', "[]", "{}",
                       "[[1, 1e300]]", "[[" + "9" * 5000 + ", 1]]", "[1, 2]", "[-1]", "[99999999999999999999]",
                       "[" * 5000 + "]" * 5000, '"' + "a" * 100000 + '"', "[1.0]", '[["1", "2"]]'])


def make_batch_line(rng) -> str:
    parts = []
    id_v = rng.choice(['"a"', "1", "-5", "9" * 5000, "1.5", "null", '"' + "x" * 10000 + '"', "[1]", "true"]) \
        if rng.random() < 0.2 else '"a"'
    if rng.random() > 0.03:
        parts.append(f'"id": {id_v}')
    r = rng.random()
    parts.append('"tokens": ' + _json_value(rng) if r < 0.3 else '"prompt": ' +
                 rng.choice(['"hi"', '""', "5", '"' + "a " * 5000 + '"', '"<s></s>"']) if r < 0.9 else '"bogus": 1')
    for k in rng.sample(_KEYS, rng.choice([0, 1, 1, 2, 3])):
        parts.append(f'"{k}": {_json_value(rng)}')
    line = "{" + ", ".join(parts) + "}"
    if rng.random() < 0.05:
        line = rng.choice(["[" * 100000 + "]" * 100000, line[:-1], "not json", '{"id": 1, "id": 2, "tokens": [1]}'])
    return line


def run_batch_line(line: str, lib) -> dict:
    SynapseError, batch, decoder = lib
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        f.write('{"id": "good", "tokens": [1]}\n' + line + "\n")
    try:
        items = batch.read_inputs(f.name)
        results = [decoder.decode(o) for o in items]
        json.dumps(results)  # what the command writes
        return {"cls": "clean" if any("error" in r for r in results) else "ok"}
    except SynapseError as e:
        return {"cls": "clean" if "\n" not in str(e) else "exception", "detail": str(e)[:200]}
    except MemoryError:
        return {"cls": "memory", "detail": "MemoryError"}
    except Exception as e:
        return {"cls": "exception", "detail": f"{type(e).__name__}: {str(e)[:200]}"}
    finally:
        os.unlink(f.name)


# ------------------------------------------------------------------ flags

_INT_FLAGS = ["-n", "-c", "-b", "-t", "--chunks", "--top-k", "--repeat-last-n", "--min-keep", "-s", "-ub", "-ngl"]
_FLOAT_FLAGS = ["--temp", "--top-p", "--min-p", "--typical", "--top-nsigma", "--xtc-probability", "--xtc-threshold",
                "--dynatemp-range", "--dynatemp-exp", "--repeat-penalty", "--presence-penalty",
                "--frequency-penalty"]
_SWITCHES = ["-no-cnv", "--ignore-eos", "--no-parse-special", "--no-add-special", "--json", "--color", "-i",
             "--display-prompt", "--no-escape", "-e", "--prefill-check", "--tokenize", "--no-jinja", "-cnv", "-st"]


def make_flags(rng) -> list[str]:
    args = [str(TINY)]
    if rng.random() < 0.8:
        args += ["-p", rng.choice(["hi", r"a\nb\\", "", r"\x41\q", "x" * 1000])]
    for _ in range(rng.choice([1, 2, 3])):
        r = rng.random()
        if r < 0.4:
            args += [rng.choice(_INT_FLAGS), rng.choice(HUGE + ["1", "64", "2"])]
        elif r < 0.6:
            args += [rng.choice(_FLOAT_FLAGS), rng.choice(HUGE + ["0.5", "1"])]
        elif r < 0.75:
            args.append(rng.choice(_SWITCHES))
        elif r < 0.85:
            args += ["-fa", rng.choice(["on", "off", "auto", "x"])]
        elif r < 0.95:
            args += ["--tokens", rng.choice(["1," + "9" * 5000, "1,99999999999999999999", "-1", "1,,2", "1 2", ""])]
        else:
            args += ["-l", rng.choice(["1+1e39", "1-inf", "99999999999999999999+1", "x", "1+nan"])]
    if "-n" not in args:
        args += ["-n", "1"]
    return args + ["-t", "1"] if "-t" not in args else args


def run_flags(args: list[str], lib) -> dict:
    llama_decode = lib
    import warnings

    out, err = io.TextIOWrapper(io.BytesIO(), encoding="utf-8"), io.StringIO()
    old = sys.stdout, sys.stderr, sys.stdin, warnings.showwarning
    sys.stdout, sys.stderr, sys.stdin = out, err, io.TextIOWrapper(io.BytesIO(b""), encoding="utf-8")
    code = 0
    try:
        from cli.main import main as _main  # noqa: F401  (the entry point's error formatting is below)
        import click

        try:
            llama_decode.main(args, prog_name="llama-decode", standalone_mode=False)
        except click.ClickException as e:
            err.write(f"error: {e.format_message()}\n")
            code = 2
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except MemoryError:
        code = "memory"
    except Exception as e:
        err.write(f"internal error: {type(e).__name__}: {e}\n")
        code = 1
    finally:
        sys.stdout, sys.stderr, sys.stdin, warnings.showwarning = old
    lines = [ln for ln in err.getvalue().splitlines() if ln.strip()]
    if code == "memory":
        return {"cls": "memory", "detail": "MemoryError"}
    if code in (0, 130):
        return {"cls": "ok"}
    errs = [ln for ln in lines if not ln.startswith("warning: ")]
    if code == 2 and len(errs) == 1 and errs[0].startswith("error: "):
        return {"cls": "clean", "detail": errs[0][:200]}
    return {"cls": "exception", "detail": f"exit {code}: " + " | ".join(lines[-3:])[:300]}


# ------------------------------------------------------------------ worker / parent

MAKERS = {"template": make_template, "batch": make_batch_line, "flags": make_flags}


def make_case(kind: str, seed: int, k: int):
    return MAKERS[kind](random.Random(f"{kind}/{seed}/{k}"))


class _Timeout(BaseException):
    pass


def worker_main(args) -> None:
    sys.path.insert(0, str(Path(args.root).resolve()))
    os.chdir(args.root)
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    from synapse_nb import SynapseError

    if args.kind == "template":
        from synapse_nb.chat import ChatTemplate

        lib, run = (SynapseError, ChatTemplate), run_template
    elif args.kind == "batch":
        from synapse_nb import batch

        lib, run = (SynapseError, batch, batch.Decoder(str(TINY), n_predict=1, n_ctx=64, n_threads=1)), run_batch_line
    else:
        from cli.main import llama_decode

        lib, run = llama_decode, run_flags
        run([str(TINY), "-p", "hi", "-n", "1", "-t", "1"], lib)  # kernels loaded before the first case

    def alarm(signum, frame):
        raise _Timeout()

    proto.write(json.dumps({"ready": os.getpid()}) + "\n")
    for line in sys.stdin:
        k = json.loads(line)["case"]
        case = make_case(args.kind, args.seed, k)
        t0 = time.perf_counter()
        old = signal.signal(signal.SIGALRM, alarm)
        signal.setitimer(signal.ITIMER_REAL, args.soft_timeout)
        try:
            res = run(case, lib)
        except _Timeout:
            res = {"cls": "timeout", "detail": f"soft timeout {args.soft_timeout} s"}
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
        res.update(case=k, s=round(time.perf_counter() - t0, 3))
        proto.write(json.dumps(res) + "\n")


def _limit(mb: int):
    def f():
        os.setsid()
        resource.setrlimit(resource.RLIMIT_AS, (mb << 20, mb << 20))
    return f


def run_campaign(args) -> dict:
    todo = list(range(args.start + args.n - 1, args.start - 1, -1))
    results: dict[int, dict] = {}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--kind", args.kind, "--seed", str(args.seed),
           "--soft-timeout", str(args.soft_timeout), "--root", str(args.root)]
    env = dict(os.environ, NUMBA_NUM_THREADS="1")
    t0 = time.monotonic()
    w = None
    while todo or (w is not None and w.get("case") is not None):
        if w is None:
            p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                 preexec_fn=_limit(args.mem_mb), env=env, text=True, bufsize=1)
            w = {"p": p, "case": None, "ready": False}
        if w["ready"] and w["case"] is None and todo:
            w["case"], w["deadline"] = todo.pop(), time.monotonic() + args.timeout
            w["p"].stdin.write(json.dumps({"case": w["case"]}) + "\n")
            w["p"].stdin.flush()
        r, _, _ = select.select([w["p"].stdout], [], [], 0.5)
        if r:
            line = w["p"].stdout.readline()
            if not line:
                code = w["p"].wait()
                if w["case"] is not None:
                    results[w["case"]] = {"case": w["case"], "cls": "signal" if code < 0 else "exception",
                                          "detail": f"worker exit {code}"}
                elif not w["ready"]:
                    raise SystemExit(f"fuzz worker failed to start (exit {code})")
                w = None
                continue
            msg = json.loads(line)
            if "ready" in msg:
                w["ready"] = True
            else:
                results[msg["case"]] = msg
                w["case"] = None
        elif w["case"] is not None and time.monotonic() > w["deadline"]:
            results[w["case"]] = {"case": w["case"], "cls": "timeout", "detail": f"hard timeout {args.timeout} s"}
            os.killpg(w["p"].pid, signal.SIGKILL)
            w["p"].wait()
            w = None
    if w is not None:
        w["p"].stdin.close()
        w["p"].wait(timeout=30)
    counts = Counter(x["cls"] for x in results.values())
    flagged = [results[k] for k in sorted(results) if results[k]["cls"] in FLAGGED]
    return {"kind": args.kind, "seed": args.seed, "n": args.n, "elapsed_s": round(time.monotonic() - t0, 1),
            "counts": {c: counts.get(c, 0) for c in CLASSES}, "flagged": flagged}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kind", choices=sorted(MAKERS), required=True)
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=30.0, help="hard per-case limit, s (worker killed)")
    ap.add_argument("--soft-timeout", type=float, default=20.0, help="per-case alarm in the worker, s")
    ap.add_argument("--mem-mb", type=int, default=4096, help="address-space limit of the worker, MiB")
    ap.add_argument("--root", default=str(ROOT), help="checkout whose synapse_nb and cli are run")
    ap.add_argument("--case", type=int, default=None, help="with --show: print case K")
    ap.add_argument("--show", action="store_true")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker_main(args)
        return 0
    if args.show:
        case = make_case(args.kind, args.seed, args.case or 0)
        print(case if isinstance(case, str) else json.dumps(case))
        return 0
    summary = run_campaign(args)
    print(json.dumps(summary, indent=1))
    return 1 if summary["flagged"] else 0


if __name__ == "__main__":
    sys.exit(main())
