"""Batch mode: many prompts, one model load, results written as they come, resumable.

One input per JSONL line, one output line per input:

  in:  {"id": ID, "prompt": "text"}  or  {"id": ID, "tokens": [1, 2, 3]}
       optional per line: "n_predict" (int >= 0) and sampling options named as the
       parameters of synapse_nb.Sampler (temp, top_k, top_p, min_p, typical_p, min_keep,
       penalty_last_n, repeat_penalty, frequency_penalty, presence_penalty, top_n_sigma,
       xtc_probability, xtc_threshold, dynatemp_range, dynatemp_exponent, seed, logit_bias);
       "grammar" (GBNF text) or "json_schema" (a JSON schema, object or text) to constrain the
       output as llama.cpp does (synapse_nb.grammar), instead of the run's grammar.
  out: {"id", "prompt_tokens", "tokens", "text", "stop", "timings"}   (as llama-decode --json)
       {"id", "error"}                                               (a bad line; the run goes on)

ID is a JSON string or integer, unique in the file. "prompt" is tokenized as the CLI does
(BOS added, special-token text parsed, unless the run says otherwise); "tokens" are used as
given. "tokens" in the output include the end-of-generation token when one stopped the run,
"text" never shows it, "stop" is "eog" or "length"; "timings" has the per-prompt keys of
--json's timings (prompt_ms, prompt_tokens_per_s, eval_ms, eval_tokens_per_s, n_threads): load
and compile happen once per worker, not per prompt.

Three ways to run the same decoding (Decoder.decode, one line at a time, in all three):
  run(model, inputs)                  in this process
  run(model, inputs, workers=N)       N spawned processes, each loading the model once
  run(model, inputs, ray_address=..)  a Ray cluster: ray.data + an actor class per model copy
and run_file(model, IN, OUT), the `llama-decode MODEL --batch IN --output OUT` command:
validates IN, skips the ids already in OUT, appends each result to OUT as one line.

Decoding is greedy unless a line (or run's `sampling`) gives sampling options; every line gets a
fresh Sampler, so results never depend on the order, the worker or the number of workers.
Greedy results equal those of one `llama-decode ... --json` run per prompt, token for token,
whatever the worker and thread counts (the kernels do not depend on the thread count).
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import time
from pathlib import Path

from .errors import SynapseError, one_line as _one_line
from .options import DEFAULT_N_BATCH, KEYS as SAMPLING_KEYS  # the sampling keys a line may carry: the Sampler's keywords
INPUT_KEYS = ("id", "prompt", "tokens", "n_predict") + SAMPLING_KEYS + ("grammar", "json_schema")
DECODER_OPTIONS = ("n_predict", "n_ctx", "n_batch", "ignore_eos", "add_special", "parse_special", "sampling",
                   "grammar")
RESULT_KEYS = ("id", "prompt_tokens", "tokens", "text", "stop", "timings")
# The longest line of IN or OUT read (a prompt that fits a 128k context is at most 8 MiB of text,
# see inputs.BYTES_PER_TOKEN; JSON escapes can make it a few times longer): a longer line, or a
# device that never ends one (/dev/zero), is an error, not an unbounded read.
LINE_BYTES = 64 << 20


def _lines(f, what: str):
    """(line number, bytes) of each line of the binary file f, read one at a time (at most
    LINE_BYTES each, else SynapseError naming `what`); the last may lack its newline."""
    n = 0
    while True:
        raw = f.readline(LINE_BYTES + 1)
        if not raw:
            return
        n += 1
        if len(raw) > LINE_BYTES:
            raise SynapseError(f"{what} line {n}: longer than {LINE_BYTES >> 20} MiB")
        yield n, raw



def _parse_int(digits: str):
    """json's parse_int: an integer of more than 4000 digits (past Python's int-string limit, and any
    range a line's value may have) becomes inf, so that its key gets the usual "must be an integer"
    error instead of a ValueError stopping the whole run."""
    return int(digits) if len(digits) <= 4000 else float("-inf" if digits.startswith("-") else "inf")


def _json_line(text: str):
    """One JSON line parsed (json.loads with _parse_int). Raises ValueError (JSONDecodeError) or
    RecursionError (nested too deeply) when it cannot be read."""
    return json.loads(text, parse_int=_parse_int)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _valid_id(v) -> bool:
    return isinstance(v, str) or _is_int(v)


def _log(msg: str, end: str = "\n") -> None:
    _write_stderr(sys.stderr, msg + end)


def _write_stderr(stream, text: str) -> None:
    """Write progress or a log line; a failing stderr (a full device, closed) is not worth
    failing a batch for: the results go to --output."""
    if stream is None:
        return
    try:
        stream.write(text)
        stream.flush()
    except (OSError, ValueError):
        pass


# ---------------------------------------------------------------- input

def check_ids(inputs, where: str = "input") -> list[dict]:
    """The inputs as a list, after checking that each is a dict with a unique string/int "id".

    inputs: iterable of dicts. Raises SynapseError naming the first offending input (1-based),
    so nothing is decoded when an id is missing or repeated (ids are what resuming relies on).
    """
    items = list(inputs)
    seen: dict = {}
    for n, obj in enumerate(items, 1):
        if not isinstance(obj, dict):
            raise SynapseError(f"{where} {n}: not a JSON object")
        if "id" not in obj:
            raise SynapseError(f"{where} {n}: no \"id\"")
        if not _valid_id(obj["id"]):
            raise SynapseError(f"{where} {n}: \"id\" must be a string or an integer, got {json.dumps(obj['id'])}")
        if obj["id"] in seen:
            raise SynapseError(f"{where} {n}: duplicate id {json.dumps(obj['id'])} (first at {where} "
                               f"{seen[obj['id']]}); ids must be unique")
        seen[obj["id"]] = n
    return items


def read_inputs(path) -> list[dict]:
    """Read a JSONL input file: one JSON object with an "id" per line; blank lines are skipped.

    Returns the objects in file order. Only what identifies a line is checked here; a line
    that cannot be identified (not UTF-8, not JSON, not an object, no or bad "id", an id
    already used) raises SynapseError naming the line, before anything runs. Everything else
    ("prompt"/"tokens", "n_predict", sampling options) is checked when the line is decoded,
    and a bad value gives that line an "error" result.
    """
    from .inputs import check_regular_file

    check_regular_file(path, "--batch", pipes=True)
    try:
        with open(path, "rb") as f:
            lines = list(_lines(f, f"--batch {path}"))
    except OSError as e:
        raise SynapseError(f"--batch {path}: {e.strerror}") from None
    items, seen = [], {}
    for n, raw in lines:
        if not raw.strip():
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise SynapseError(f"--batch {path} line {n}: not valid UTF-8 (offset {e.start})") from None
        try:
            obj = _json_line(text)
        except json.JSONDecodeError as e:
            raise SynapseError(f"--batch {path} line {n}: not JSON ({e.msg}, column {e.colno}); each line must "
                               f"be one JSON object with an \"id\"") from None
        except (ValueError, RecursionError) as e:
            what = "nested too deeply" if isinstance(e, RecursionError) else _one_line(e, 100)
            raise SynapseError(f"--batch {path} line {n}: cannot be read as JSON ({what}); each line must be one "
                               f"JSON object with an \"id\"") from None
        if not isinstance(obj, dict):
            raise SynapseError(f"--batch {path} line {n}: not a JSON object")
        if "id" not in obj:
            raise SynapseError(f"--batch {path} line {n}: no \"id\"")
        if not _valid_id(obj["id"]):
            raise SynapseError(f"--batch {path} line {n}: \"id\" must be a string or an integer, got "
                               f"{json.dumps(obj['id'])}")
        if obj["id"] in seen:
            raise SynapseError(f"--batch {path} line {n}: duplicate id {json.dumps(obj['id'])} (first on line "
                               f"{seen[obj['id']]}); ids must be unique")
        seen[obj["id"]] = n
        items.append(obj)
    return items


# ---------------------------------------------------------------- decoding

class Decoder:
    """One loaded model and one Session (KV cache), decoding batch inputs one at a time.

    model: a loaded synapse_nb Model, or a GGUF path / models.txt name to load.
    n_predict: tokens to generate for a line without its own "n_predict" (CLI -n).
    n_ctx: context size (default min(n_ctx_train, 4096), as the CLI); n_batch: prefill batch;
    n_threads: Numba threads (default: Numba's setting). ignore_eos, add_special, parse_special:
    as the CLI's --ignore-eos, --no-add-special, --no-parse-special. sampling: default sampling
    options (Sampler parameter names) that a line's own keys override; empty means greedy.
    grammar: GBNF text constraining every line without its own "grammar" / "json_schema" (None:
    unconstrained). Loads and warms up the kernels on construction; raises SynapseError for a bad model/option.
    """

    def __init__(self, model, *, n_predict: int = 128, n_ctx: int | None = None, n_batch: int = DEFAULT_N_BATCH,
                 n_threads: int | None = None, ignore_eos: bool = False, add_special: bool = True,
                 parse_special: bool = True, sampling: dict | None = None, grammar: str | None = None):
        # Imported here, not at the top: a worker process sets NUMBA_NUM_THREADS before Numba loads.
        from . import engine

        self.model = engine.load_model(model) if isinstance(model, (str, os.PathLike)) else model
        if not _is_int(n_predict) or n_predict < 0:
            raise SynapseError(f"n_predict must be an integer >= 0, got {n_predict!r}")
        bad = sorted(set(sampling or {}) - set(SAMPLING_KEYS))
        if bad:
            raise SynapseError(f"unknown sampling option {bad[0]!r} (known: {', '.join(SAMPLING_KEYS)})")
        self.n_predict = n_predict
        self.ignore_eos = ignore_eos
        self.add_special = add_special
        self.parse_special = parse_special
        self.sampling = dict(sampling or {})
        self._grammars: dict = {}  # GBNF text -> compiled Grammar (its transitions cached across lines)
        self.grammar = grammar or None
        if self.grammar is not None:
            self._grammar(self.grammar)  # a bad grammar fails the run, not each line
        from .session import Session

        self.session = Session(self.model, n_ctx=n_ctx, n_threads=n_threads, n_batch=n_batch)
        self.n_threads = self.session.n_threads or _numba_threads()
        engine.warm_up(self.model)

    def _grammar(self, text: str):
        g = self._grammars.get(text)
        if g is None:
            from .grammar import Grammar

            if len(self._grammars) >= 16:
                self._grammars.clear()
            g = self._grammars[text] = Grammar(text, tokenizer=self.model.tokenizer)
        return g

    def _matcher(self, obj: dict):
        """The line's GrammarMatcher ("grammar", "json_schema", else the run's grammar), or None."""
        if "grammar" in obj and "json_schema" in obj:
            raise SynapseError("give at most one of \"grammar\" and \"json_schema\"")
        text = self.grammar
        if "grammar" in obj:
            if not isinstance(obj["grammar"], str):
                raise SynapseError("\"grammar\" must be a string (GBNF text)")
            text = obj["grammar"] or None
        elif "json_schema" in obj:
            from .grammar import json_schema_to_grammar

            text = json_schema_to_grammar(obj["json_schema"])
        if text is None:
            return None
        from .grammar import GrammarMatcher

        return GrammarMatcher(self._grammar(text), self.model.tokenizer)

    def _parse(self, obj: dict):
        """(prompt ids, n_predict, sampler or None, grammar matcher or None) of one input;
        SynapseError for a bad value."""
        hp = self.model.hparams
        unknown = [k for k in obj if k not in INPUT_KEYS]
        if unknown:
            raise SynapseError(f"unknown key {unknown[0]!r} (allowed: {', '.join(INPUT_KEYS)})")
        if ("prompt" in obj) == ("tokens" in obj):
            raise SynapseError("give exactly one of \"prompt\" (text) or \"tokens\" (token ids)")
        if "prompt" in obj:
            if not isinstance(obj["prompt"], str):
                raise SynapseError("\"prompt\" must be a string")
            ids = self.model.tokenizer.tokenize(obj["prompt"], add_special=self.add_special,
                                                parse_special=self.parse_special)
        else:
            ids = obj["tokens"]
            if not isinstance(ids, list) or not all(_is_int(t) for t in ids):
                raise SynapseError("\"tokens\" must be a list of integer token ids")
            bad = [t for t in ids if not 0 <= t < hp.n_vocab]
            if bad:
                raise SynapseError(f"\"tokens\": id {bad[0]} is outside the vocabulary [0, {hp.n_vocab})")
        if not ids:
            raise SynapseError("the prompt is empty (no tokens to evaluate)")
        n_predict = obj.get("n_predict", self.n_predict)
        if not _is_int(n_predict) or n_predict < 0:
            raise SynapseError(f"\"n_predict\" must be an integer >= 0, got {json.dumps(n_predict)}")
        need = len(ids) + n_predict
        if need > self.session.n_ctx:
            raise SynapseError(f"prompt ({len(ids)} tokens) + n_predict ({n_predict}) = {need} exceeds the context "
                               f"size n_ctx = {self.session.n_ctx}")
        params = {**self.sampling, **{k: obj[k] for k in SAMPLING_KEYS if k in obj}}
        matcher = self._matcher(obj)
        sampler = None
        if params:
            from .sampling import build_sampler

            tok = self.model.tokenizer
            # as llama.cpp's --ignore-eos when sampling (common_init_from_params): every
            # end-of-generation token biased to -inf after the line's own biases, if there is an EOS
            sampler = build_sampler(params, n_vocab=hp.n_vocab, eog_ids=tok.eog_ids if tok.eos_id is not None else (),
                                    ignore_eos=self.ignore_eos, grammar=matcher)
        return list(ids), n_predict, sampler, matcher

    def decode(self, obj: dict) -> dict:
        """Decode one input (a dict as read_inputs returns) into its result dict.

        Returns {"id", "prompt_tokens", "tokens", "text", "stop", "timings"}, or {"id", "error"}
        (one line) when the input is bad (unknown key, no prompt, empty prompt, token id outside
        the vocabulary, bad n_predict, prompt + n_predict > n_ctx, bad sampling options).
        Internal errors are raised.
        """
        from .engine import generate

        try:
            ids, n_predict, sampler, matcher = self._parse(obj)
        except SynapseError as e:
            return {"id": obj.get("id"), "error": _one_line(e)}
        self.session.reset()
        try:
            gen = generate(self.session, ids, n_predict, sampler=sampler, grammar=matcher, ignore_eos=self.ignore_eos)
        except SynapseError as e:
            return {"id": obj.get("id"), "error": _one_line(e)}
        stop = "eog" if gen.stop == "eog" else "length"  # the prompt + n_predict fit: never "context"
        return self._result(obj, ids, gen.tokens, stop, sampler, gen.prompt_s, gen.eval_s, gen.n_evals)

    def _result(self, obj, ids, generated, stop, sampler, prompt_s, eval_s, n_evals) -> dict:
        """The result dict of one input (see decode)."""
        from .timings import timings

        out = {"id": obj["id"], "prompt_tokens": ids, "tokens": generated,
               "text": self.model.tokenizer.detokenize(generated, special=False), "stop": stop,
               "timings": timings(len(ids), prompt_s, n_evals, eval_s, self.n_threads)}
        if sampler is not None:
            out["seed"] = sampler.seed  # as --json when sampling: the seed that reproduces the line
        return out

    def decode_parallel(self, objs, n_parallel: int):
        """Decode inputs n_parallel at a time in one ParallelSession (-np): yields each result dict
        (as decode's) when its sequence stops, so in completion order. Each line's tokens are
        those decode gives it alone (the engine's guarantee). Timings are the line's own wall
        time: prompt from its arrival to its first token, eval after that (shared steps)."""
        from time import perf_counter

        from .parallel import ParallelSession

        ps = ParallelSession(self.model, n_seq=n_parallel, n_ctx=self.session.n_ctx, n_threads=self.n_threads,
                             n_batch=self.session.n_batch)
        it = iter(objs)
        running = {}  # Sequence -> (obj, ids, sampler, t_added, t_first)
        exhausted = False
        while True:
            while not exhausted and len(running) < n_parallel:
                obj = next(it, None)
                if obj is None:
                    exhausted = True
                    break
                try:
                    ids, n_predict, sampler, matcher = self._parse(obj)
                except SynapseError as e:
                    yield {"id": obj.get("id"), "error": _one_line(e)}
                    continue
                seq = ps.add(ids, n_predict, sampler=sampler, ignore_eos=self.ignore_eos,
                             grammar=matcher if sampler is None else None)
                running[seq] = [obj, ids, sampler, perf_counter(), None]
            if not running:
                return
            ps.step()
            now = perf_counter()
            for seq in list(running):
                info = running[seq]
                if info[4] is None and (seq.tokens or seq.done):
                    info[4] = now
                if seq.done:
                    del running[seq]
                    obj, ids, sampler, t0, t1 = info
                    stop = "eog" if seq.stop_reason == "eog" else "length"
                    yield self._result(obj, ids, seq.tokens, stop, sampler, t1 - t0, now - t1,
                                       max(0, len(seq.tokens) - 1))


def _numba_threads() -> int:
    import numba

    return numba.get_num_threads()


def result_line(result: dict) -> bytes:
    """A result dict as one JSONL line (json.dumps as --json, ASCII, so never a raw newline inside)."""
    return (json.dumps(result) + "\n").encode("ascii")


# ---------------------------------------------------------------- the three paths

def run(model, inputs, *, workers: int | None = None, n_threads: int | None = None, ray_address: str | None = None,
        skip_ids=(), n_parallel: int = 1, **options):
    """Decode many inputs with one model load per worker; yield a result dict per input as it is done.

    model: GGUF path or models.txt name (a loaded Model is accepted only in this process:
    workers in (None, 1) and no Ray). inputs: an iterable of dicts ({"id", "prompt"|"tokens",
    optional "n_predict" and sampling options}; ids are checked up front, see check_ids), or the
    path of a JSONL file (read_inputs). skip_ids: ids not to decode (those already done).
    options: Decoder's keyword options (n_predict, n_ctx, n_batch, ignore_eos, add_special,
    parse_special, sampling). n_parallel (-np): inputs decoded at once in one process
    (Decoder.decode_parallel); each line's tokens are the same as alone.

    Where it runs:
      ray_address None, workers None/1: in this process, n_threads threads (default: all cores).
      ray_address None, workers N > 1: N spawned processes, each loading the model once, with
        n_threads threads each (default max(1, cores // N)); results in completion order.
      ray_address "" or "local" (start a local Ray, or use the one already initialised in this
        process) or "host:port" (join that cluster): ray.data with one actor per model copy. n_threads
        Numba threads and num_cpus per actor (default 1); workers actors (default: the cluster's
        CPUs // n_threads).
    Yields result dicts (Decoder.decode). Raises SynapseError for bad ids, a missing model, or
    --ray without Ray installed; an internal error of a worker is raised as RuntimeError.
    """
    unknown = sorted(set(options) - set(DECODER_OPTIONS))
    if unknown:
        raise TypeError(f"run() got an unexpected option {unknown[0]!r} (options: {', '.join(DECODER_OPTIONS)})")
    if workers is not None and (not _is_int(workers) or workers < 1):
        raise SynapseError(f"--workers must be >= 1, got {workers!r}")
    _check_parallel(n_parallel, workers, ray_address)
    if n_threads is not None and (not _is_int(n_threads) or n_threads < 1):
        raise SynapseError(f"-t/--threads must be >= 1, got {n_threads!r}")
    if isinstance(inputs, (str, os.PathLike)):
        items = read_inputs(inputs)
    else:
        items = check_ids(inputs)
    skip = set(skip_ids)
    pending = [o for o in items if o["id"] not in skip]
    if ray_address is not None:
        return _run_ray(_import_ray(), model, pending, ray_address, workers, n_threads, options)
    if not pending:
        return iter(())
    if n_threads is not None:  # this machine's processes: at most its cores (as Session and Numba)
        n_threads = min(n_threads, os.cpu_count() or 1)
    if workers in (None, 1):
        return _run_here(model, pending, n_threads, n_parallel, options)
    return _run_processes(model, pending, workers, n_threads, options)


def _check_parallel(n_parallel, workers, ray_address) -> None:
    if not _is_int(n_parallel) or n_parallel < 1:
        raise SynapseError(f"-np/--parallel must be >= 1, got {n_parallel!r}")
    if n_parallel > 1 and (ray_address is not None or workers not in (None, 1)):
        raise SynapseError("-np/--parallel decodes several lines in one process: it does not combine with "
                           "--workers or --ray")


def _run_here(model, pending, n_threads, n_parallel, options):
    dec = Decoder(model, n_threads=n_threads or os.cpu_count() or 1, **options)
    if n_parallel > 1:
        yield from dec.decode_parallel(pending, n_parallel)
        return
    for obj in pending:
        yield dec.decode(obj)


def worker_model_arg(model) -> str:
    """The model as a string another process can load: an existing file as an absolute path, else
    the models.txt name as given (resolved there)."""
    if not isinstance(model, (str, os.PathLike)):
        raise SynapseError("workers and Ray load the model themselves: give its path or name, not a Model")
    return os.path.abspath(model) if os.path.isfile(model) else os.fspath(model)


# ---- local worker processes

def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies (a killed batch run leaves no workers)."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes
            import signal

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
        except (OSError, AttributeError):
            pass


def _worker_main(model_arg, options, n_threads, conn, parent_pid) -> None:
    """A worker process: load the model once, then decode the tasks received on conn (its end of a
    Pipe) until it gets None (or the parent is gone)."""
    import signal
    import traceback

    # Numba's thread pool is sized from this before numba is first imported: n_threads, not all cores.
    os.environ["NUMBA_NUM_THREADS"] = str(n_threads)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    _die_with_parent()
    try:
        dec = Decoder(model_arg, n_threads=n_threads, **options)
    except SynapseError as e:
        conn.send(("bad-input", str(e)))
        return
    except BaseException:
        conn.send(("internal", traceback.format_exc()))
        return
    conn.send(("ready", None))
    while True:
        try:
            if not conn.poll(1.0):
                if os.getppid() != parent_pid:
                    return
                continue
            task = conn.recv()
        except (EOFError, OSError):  # the parent is gone
            return
        if task is None:
            return
        try:
            conn.send(("result", dec.decode(task)))
        except BaseException:
            conn.send(("internal", traceback.format_exc()))
            return


class _StubMain(type(sys)):
    """What a spawned worker is told the parent's __main__ is: a module with no file and no spec."""


def _caller_main_hidden():
    """A context in which multiprocessing's spawn does not see the caller's __main__ module.

    A spawned child imports the parent's main script again (as __mp_main__) before it runs its
    target; a script calling run(..., workers=N) at its top level, without the
    `if __name__ == "__main__":` guard, would call run again in each child (multiprocessing's
    "bootstrapping phase" error). The workers' code is this module's, so they need nothing from the
    caller's script: while they start, __main__ is a stub without __file__ or __spec__, and the
    children import nothing of the caller's."""
    from contextlib import contextmanager

    @contextmanager
    def hidden():
        real = sys.modules.get("__main__")
        stub = _StubMain("__main__")
        stub.__spec__ = None
        sys.modules["__main__"] = stub
        try:
            yield
        finally:
            if real is not None:
                sys.modules["__main__"] = real
            else:
                del sys.modules["__main__"]

    return hidden()


def _run_processes(model, pending, workers, n_threads, options):
    """Spawned workers, one Pipe each, one task in flight per worker (what a kill can lose). Pipes,
    not multiprocessing Queues: a Queue's semaphores are registered with the resource tracker, which
    printed a "leaked semaphore" warning after the run was killed (kill -9)."""
    import multiprocessing as mp
    from multiprocessing.connection import wait

    model_arg = worker_model_arg(model)
    n_workers = min(workers, len(pending))
    n_threads = n_threads or max(1, (os.cpu_count() or 1) // workers)
    ctx = mp.get_context("spawn")
    conns, procs = [], []
    for i in range(n_workers):
        here, there = ctx.Pipe()
        conns.append(here)
        procs.append(ctx.Process(target=_worker_main, args=(model_arg, options, n_threads, there, os.getpid()),
                                 daemon=True, name=f"synapse_nb-batch-{i}"))
    with _caller_main_hidden():
        for p in procs:
            p.start()
    try:
        it = iter(pending)
        busy = {}  # conn -> True while it has a task
        live = set(conns)
        while live:
            ready = wait(list(live), timeout=1.0)
            if not ready:
                dead = [p for p in procs if p.exitcode is not None]
                if dead:
                    raise RuntimeError(f"batch worker {dead[0].name} died (exit code {dead[0].exitcode})")
                continue
            for c in ready:
                try:
                    kind, payload = c.recv()
                except (EOFError, OSError):
                    p = procs[conns.index(c)]
                    p.join(timeout=5)
                    raise RuntimeError(f"batch worker {p.name} died (exit code {p.exitcode})") from None
                if kind == "bad-input":
                    raise SynapseError(payload)
                if kind == "internal":
                    raise RuntimeError("batch worker failed: " + payload.strip().splitlines()[-1])
                if kind == "result":
                    busy[c] = False
                    yield payload
                nxt = next(it, None)
                if nxt is not None:
                    c.send(nxt)
                    busy[c] = True
                elif not busy.get(c):
                    c.send(None)
                    live.discard(c)
        for p in procs:
            p.join(timeout=10)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        for c in conns:
            c.close()


# ---- Ray

RAY_INSTALL_HINT = "pip install 'synapse_nb[ray]'"


class RayDecoder:
    """The Ray actor: one Decoder (one model load) per actor; a batch of JSON input lines in,
    a batch of JSON result lines out ({"line": [...]} -> {"result": [...]}, numpy batch format).

    Lines travel as JSON text, not as Arrow columns: the inputs' keys differ from line to line
    (prompt or tokens, optional n_predict and sampling options), which one Arrow schema cannot hold.
    """

    def __init__(self, model_arg: str, options: dict, n_threads: int):
        os.environ.setdefault("NUMBA_NUM_THREADS", str(n_threads))
        _die_with_parent()  # the raylet: when ray.shutdown() ends it, this actor's process goes at once
        self.decoder = Decoder(model_arg, n_threads=n_threads, **options)

    def __call__(self, batch):
        import numpy as np

        out = [json.dumps(self.decoder.decode(json.loads(str(line)))) for line in batch["line"]]
        return {"result": np.array(out, dtype=object)}


def _import_ray():
    try:
        import ray
        import ray.data
    except ImportError:
        raise SynapseError(f"--ray needs Ray, which is not installed: {RAY_INSTALL_HINT}") from None
    return ray


def package_root() -> str | None:
    """The directory holding this synapse_nb package when it is a source checkout (not an
    installed package), put on Ray workers' PYTHONPATH so that they import the same synapse_nb
    as the driver: Ray starts its workers without the driver's sys.path. None when installed."""
    import site

    root = Path(__file__).resolve().parents[1]
    installed = {Path(p).resolve() for p in site.getsitepackages() + [site.getusersitepackages()]}
    return None if root in installed else str(root)


def _run_ray(ray, model, pending, address, workers, n_threads, options):
    model_arg = worker_model_arg(model)
    if not pending:
        return
    n_threads = n_threads or 1
    pythonpath = os.pathsep.join(p for p in (package_root(), os.environ.get("PYTHONPATH")) if p)
    env = {"env_vars": {"NUMBA_NUM_THREADS": str(n_threads), **({"PYTHONPATH": pythonpath} if pythonpath else {})}}
    started = False
    if not ray.is_initialized():
        # Ray's own Python logging stays quiet (our progress line is the output): errors only (its
        # token-authentication warning was printed on every run).
        import logging

        logging.getLogger("ray").setLevel(logging.ERROR)
        ray.init(address=None if address in ("", "local") else address, include_dashboard=False,
                 logging_level="ERROR", log_to_driver=False)
        started = True
    try:
        import ray.data

        import logging

        # Our progress line is the one on stderr: no Ray Data bars nor per-dataset INFO lines.
        ctx = ray.data.DataContext.get_current()
        ctx.enable_progress_bars = False
        ctx.print_on_execution_start = False
        logging.getLogger("ray.data").setLevel(logging.ERROR)
        n_actors = workers or max(1, int(ray.cluster_resources().get("CPU", 1)) // n_threads)
        n_actors = min(n_actors, len(pending))
        # The driver has read and checked IN (ids, duplicates, what OUT already holds), so the lines
        # to do go to Ray from here: nothing to read on the nodes (no shared storage needed), and no
        # read task competing for the CPUs that the actors hold. Small blocks: results come back as
        # blocks finish, and a kill loses only the blocks in flight.
        ds = ray.data.from_items([{"line": json.dumps(o)} for o in pending],
                                 override_num_blocks=min(len(pending), 2000))
        map_args = dict(fn_constructor_kwargs={"model_arg": model_arg, "options": options, "n_threads": n_threads},
                        batch_size=1, batch_format="numpy", num_cpus=n_threads, runtime_env=env)
        if hasattr(ray.data, "ActorPoolStrategy"):
            map_args["compute"] = ray.data.ActorPoolStrategy(size=n_actors)
        else:
            map_args["concurrency"] = n_actors
        import warnings

        try:
            # Actors not restarted (one that dies is an internal error of the run): Ray's core printed an
            # "E core_worker" line on every run for restartable actors whose constructor arguments are in
            # its object store. Passed as a remote argument, which this Ray deprecates (quietly here).
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                ds = ds.map_batches(RayDecoder, **map_args, max_restarts=0)
        except TypeError:  # a Ray without remote arguments in map_batches
            ds = ds.map_batches(RayDecoder, **map_args)
        for row in ds.iter_rows():
            yield json.loads(row["result"])
    finally:
        if started:
            ray.shutdown()


# ---------------------------------------------------------------- the command

class Progress:
    """done/total, generated tokens/s and ETA on stderr: one line redrawn on a terminal, else a
    plain line every `interval` seconds and at the end.

    Rate and ETA are measured over wall time from the first decode on: a result's decode started
    its timings' prompt_ms + eval_ms before it arrived, so that model loading and kernel
    compilation (once per worker, before any decode) do not count as decoding time, and results
    of parallel workers arriving together do not make the time look short.
    """

    def __init__(self, total: int, stream=None, interval: float = 10.0):
        self.total, self.done, self.tokens, self.errors = total, 0, 0, 0
        self.stream = stream if stream is not None else sys.stderr
        try:
            self.tty = self.stream is not None and self.stream.isatty()
        except (OSError, ValueError):
            self.tty = False
        self.interval = interval
        self.t_first = None  # when the first decode started (perf_counter)
        self.last = time.perf_counter()

    def line(self) -> str:
        rate = eta = math.nan
        if self.t_first is not None and self.done:
            dt = time.perf_counter() - self.t_first
            if dt > 0:
                rate = self.tokens / dt
                eta = dt / self.done * (self.total - self.done)
        err = f", {self.errors} error{'s' if self.errors != 1 else ''}" if self.errors else ""
        rate_s = f"{rate:.1f}" if math.isfinite(rate) else "?"
        return (f"batch: {self.done}/{self.total} done{err}, {rate_s} tokens/s, "
                f"ETA {_fmt_s(eta) if self.done < self.total else '0s'}")

    def update(self, result: dict) -> None:
        self.done += 1
        self.tokens += len(result.get("tokens", ()))
        self.errors += "error" in result
        now = time.perf_counter()
        t = result.get("timings") or {}
        try:
            began = now - (float(t.get("prompt_ms") or 0) + float(t.get("eval_ms") or 0)) / 1e3
        except (TypeError, ValueError):
            began = now
        if self.t_first is None or began < self.t_first:
            self.t_first = began
        if self.tty:
            _write_stderr(self.stream, "\r" + self.line() + "\x1b[K")
        elif now - self.last >= self.interval or self.done == self.total:
            _write_stderr(self.stream, self.line() + "\n")
            self.last = now

    def close(self) -> None:
        if self.tty and self.done:
            _write_stderr(self.stream, "\n")


def _fmt_s(s: float) -> str:
    if not math.isfinite(s):
        return "?"
    s = int(round(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def read_done(out_path) -> tuple[set, int]:
    """Ids already in a batch output file, and the byte length of its complete lines.

    A last line without its newline was being written when a run was killed: it is not a result
    (the caller truncates it away). Raises SynapseError, touching nothing, when a complete line
    is not a result line (JSON object with an id) or the unfinished one does not start as ours:
    the file is then not a batch output, and it is not modified.
    """
    done, end, last = set(), 0, b""
    try:
        with open(out_path, "rb") as f:
            for n, raw in _lines(f, f"--output {out_path}"):
                if not raw.endswith(b"\n"):
                    last = raw  # unfinished: checked below
                    break
                end += len(raw)
                if not raw.strip():
                    continue
                try:
                    obj = _json_line(raw.decode("utf-8"))
                except (ValueError, UnicodeDecodeError, RecursionError):
                    obj = None
                if not _is_result(obj):
                    raise SynapseError(f"--output {out_path} line {n} is not a batch result line; the file is not "
                                       f"modified (give another --output)")
                done.add(obj["id"])
    except FileNotFoundError:
        return set(), 0
    except OSError as e:
        raise SynapseError(f"--output {out_path}: {e.strerror}") from None
    if last and not _our_partial_line(last):
        raise SynapseError(f"--output {out_path} ends in a line that is not a batch result; the file is not "
                           f"modified (give another --output)")
    return done, end


_PARTIAL_ID = re.compile(rb'\{"id": (?:"(?:[^"\\]|\\.)*"|-?[0-9]+)')
_PARTIAL_ID_CUT = re.compile(rb'\{"id": (?:"(?:[^"\\]|\\.)*\\?|-?[0-9]*)\Z')
_RESULT_SECOND_KEYS = (b', "prompt_tokens": [', b', "error": "')


def _our_partial_line(last: bytes) -> bool:
    """Whether an unfinished last line of OUT can be the start of a line result_line wrote: ASCII,
    '{"id": ' + the id (perhaps cut) + ', "prompt_tokens": [' or ', "error": "' (perhaps cut).
    Anything else (a user's {"id": 5, "name": ...} without its newline) means the file is not ours."""
    if not last.isascii():
        return False
    if b'{"id": '.startswith(last) or _PARTIAL_ID_CUT.match(last):
        return True
    m = _PARTIAL_ID.match(last)
    if m is None:
        return False
    rest = last[m.end():]
    return any(k.startswith(rest) or rest.startswith(k) for k in _RESULT_SECOND_KEYS)


def _is_result(obj) -> bool:
    """Whether a parsed OUT line is one of our result lines: {"id", "error"} or a result with
    "text" and "stop" (Decoder.decode), never an input line (those have "prompt" or neither)."""
    if not isinstance(obj, dict) or not _valid_id(obj.get("id")) or "prompt" in obj:
        return False
    return set(obj) == {"id", "error"} or ("text" in obj and "stop" in obj)


def _same_file(a: str, b) -> bool:
    try:
        return b is not None and os.path.exists(b) and (os.path.realpath(a) == os.path.realpath(b)
                                                        or os.path.samefile(a, b))
    except OSError:
        return False


def run_file(model, in_path, out_path, *, workers: int | None = None, n_threads: int | None = None,
             ray_address: str | None = None, progress: bool = True, n_parallel: int = 1, **options) -> int:
    """`llama-decode MODEL --batch IN --output OUT`: decode every line of IN not yet in OUT.

    Checks up front: OUT is neither IN nor the model; IN's lines have unique ids (read_inputs);
    OUT, if it exists, holds only result lines (read_done). An unfinished last line of OUT (a
    killed run) is truncated away and its input decoded again. Each result is appended to OUT
    as one line with a single write() and fsync'd, so a SIGKILL at any moment loses at most the
    inputs in flight. Another run holding OUT (flock) is an error. Progress goes to stderr.
    Other arguments as run(). Returns the exit status (0; lines with an "error" field are results).
    Raises SynapseError for bad input.
    """
    from .inputs import check_regular_file
    from .models import resolve_model

    _check_parallel(n_parallel, workers, ray_address)
    model_path = resolve_model(model)
    if _same_file(out_path, in_path):
        raise SynapseError(f"--output {out_path} is the input file --batch; it is not overwritten")
    if _same_file(out_path, str(model_path)):
        raise SynapseError(f"--output {out_path} is the model file; it is not overwritten")
    if os.path.isdir(out_path):
        raise SynapseError(f"--output {out_path} is a directory")
    check_regular_file(out_path, "--output", why=" (results are appended to a file and resumed from it)")
    if not os.path.isdir(os.path.dirname(os.path.abspath(out_path))):
        raise SynapseError(f"--output {out_path}: no such directory")
    items = read_inputs(in_path)
    if ray_address is not None:
        _import_ray()  # before OUT is created: say how to install it
    fd, created = _open_locked(out_path)
    wrote = False
    try:
        done, end = read_done(out_path)
        size = os.fstat(fd).st_size
        if end < size:
            os.ftruncate(fd, end)
            _log(f"batch: --output {out_path}: dropped an unfinished last line ({size - end} bytes) left by an "
                 f"interrupted run; that input is decoded again")
        ids = {o["id"] for o in items}
        n_done = len(ids & done)
        todo = len(items) - n_done
        where = (f"Ray ({ray_address or 'local'})" if ray_address is not None else
                 f"{min(workers, todo)} worker process{'es' if min(workers, todo) > 1 else ''}"
                 if workers not in (None, 1) else "1 process" + (f", {n_parallel} sequences at once" if n_parallel > 1
                                                                  else ""))
        _log(f"batch: {len(items)} inputs, {n_done} already in {out_path}, {todo} to do on {where}")
        if todo == 0:
            return 0
        prog = Progress(todo) if progress else None
        try:
            for res in run(model_path if ray_address is None else model, items, workers=workers,
                           n_threads=n_threads, ray_address=ray_address, skip_ids=done, n_parallel=n_parallel,
                           **options):
                line = result_line(res)
                try:
                    n = os.write(fd, line)  # one write of the whole line: O_APPEND, never interleaved
                    while n < len(line):  # a short write (disk full): finish the line
                        n += os.write(fd, line[n:])
                    os.fsync(fd)
                except OSError as e:  # the next run drops an unfinished last line and goes on from there
                    raise SynapseError(f"--output {out_path}: {e.strerror or e}") from None
                wrote = True
                if prog is not None:
                    prog.update(res)
        finally:
            if prog is not None:
                prog.close()
        return 0
    finally:
        # A run that failed before any result leaves nothing behind: the empty OUT it created itself
        # is removed while its lock is still held (never a file another run holds or made).
        if created and not wrote and os.fstat(fd).st_size == 0:
            os.unlink(out_path)
        os.close(fd)


def _open_locked(out_path):
    """OUT opened for appending (created if missing) with its exclusive lock held: (fd, created).
    created: this run created the file (so it may remove it, empty, on failure). The lock is
    taken on the file at OUT's path: if OUT was removed or replaced between open and lock (another
    run's clean-up), it is opened again. Raises SynapseError when another run holds the lock."""
    import fcntl

    while True:
        created = False
        try:
            fd = os.open(out_path, os.O_RDWR | os.O_APPEND)
        except FileNotFoundError:
            try:
                fd = os.open(out_path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_EXCL, 0o644)
                created = True
            except FileExistsError:
                continue
            except OSError as e:
                raise SynapseError(f"--output {out_path}: {e.strerror}") from None
        except OSError as e:
            raise SynapseError(f"--output {out_path}: {e.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)  # never remove a file whose lock another run holds
            raise SynapseError(f"--output {out_path} is being written by another batch run") from None
        try:
            st, now = os.fstat(fd), os.stat(out_path)
            same = (st.st_dev, st.st_ino) == (now.st_dev, now.st_ino)
        except FileNotFoundError:
            same = False
        if same:
            return fd, created
        os.close(fd)  # OUT was removed or replaced meanwhile: lock the file now at its path
