"""Fuzzer of the inputs that are not GGUF files: chat templates, batch lines, command-line flags.

From the repository root:

    python -m fuzz.inputs --kind template --n 2000 [--seed 0] [--start 0] [--jobs 1]
    python -m fuzz.inputs --kind batch --n 2000
    python -m fuzz.inputs --kind flags --n 2000
    python -m fuzz.inputs --kind template --case 17 --show      # print one case

Seeds used so far: 34 (the first campaign), 1 (tests/test_fuzz.py's subsets), 34034 (issue 34's
campaign); take a new one for a new campaign.

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
that does not answer within --timeout and records a timeout). Each case's wall time and peak RSS
are measured (fuzz.harness.PeakRSS); a case over 30 s or 2 GiB is flagged whatever its outcome, and
the summary gives the largest of each. Outcomes:

  ok        rendered / decoded / exit 0
  clean     one-line SynapseError, or CLI exit 2 with one "error: " stderr line (a bad batch line's
            "error" result counts as clean)
  exception anything else (a traceback, exit 1, a multi-line error)
  signal / timeout / memory   as in fuzz/gguf.py
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

from fuzz.harness import PeakRSS, Worker, library_outcome, run_case, run_cli, run_workers, summarize

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "tests" / "data" / "tiny" / "tiny-llama-q8_0.gguf"

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

    def run():
        ChatTemplate(src, "fuzz.jinja").render({"messages": [{"role": "user", "content": "hi"}], "bos_token": "<s>",
                                                "eos_token": "</s>", "add_generation_prompt": True})

    return library_outcome(run, SynapseError)


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

    def run():
        results = [decoder.decode(o) for o in batch.read_inputs(f.name)]
        json.dumps(results)  # what the command writes
        return {"cls": "clean" if any("error" in r for r in results) else "ok"}

    try:
        return library_outcome(run, SynapseError)
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
    code, lines = run_cli(lib, args)
    lines = [ln for ln in lines if ln.strip()]
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

    peak = PeakRSS()
    proto.write(json.dumps({"ready": os.getpid()}) + "\n")
    for line in sys.stdin:
        k = json.loads(line)["case"]
        res = run_case(run, make_case(args.kind, args.seed, k), lib, args.soft_timeout, peak)
        res.update(case=k)
        proto.write(json.dumps(res) + "\n")
        if res.get("retire"):  # grown too much to measure the next case: a fresh worker will
            break


def run_campaign(args) -> dict:
    """Run cases start .. start + n - 1 in args.jobs workers; returns the summary: counts per class,
    flagged cases, the largest case, elapsed time."""
    cmd = [sys.executable, "-m", "fuzz.inputs", "--worker", "--kind", args.kind, "--seed", str(args.seed),
           "--soft-timeout", str(args.soft_timeout), "--root", str(args.root)]
    env = dict(os.environ, NUMBA_NUM_THREADS="1")
    t0 = time.monotonic()
    # cwd: this checkout, where `fuzz` is importable (the worker then runs --root's code)
    results = run_workers(lambda: Worker(cmd, env, args.mem_mb, ROOT), args.jobs,
                          list(range(args.start, args.start + args.n)), args.timeout, first_extra=0,
                          hint=f"check --root {args.root}")
    # counts, flagged, the largest case's RSS and time
    return {"kind": args.kind, "seed": args.seed, "start": args.start, "n": args.n,
            "elapsed_s": round(time.monotonic() - t0, 1), **summarize(results)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kind", choices=sorted(MAKERS), required=True)
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=1, help="worker processes")
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
