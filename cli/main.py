"""llama-decode: greedy decoding (or llama.cpp's sampling) of a GGUF model, as llama.cpp's completion tool.

This module only parses the command line and dispatches to the mode's module: completion
(cli/complete.py), chat (cli/chat.py), batch (cli/batch.py), perplexity (cli/perplexity.py) and
the server (cli/server.py); what a mode does with a flag it does not use is cli/options.py's
table. Generated text (or JSON, or token ids) goes to stdout; logs, progress and timings to stderr.
Exit status: 0 success, 1 internal error, 2 bad input, 130 interrupted, 143 terminated (SIGTERM).
"""

from __future__ import annotations

import errno
import os
import re
import sys
from types import SimpleNamespace

import click

from synapse_nb import __version__
from synapse_nb.options import REFUSED as REFUSED_SAMPLERS, SAMPLING

from . import batch, chat, complete, perplexity, server
from . import options as O
from .common import EXIT_BAD_INPUT, EXIT_INTERNAL, EXIT_INTERRUPTED, EXIT_TERMINATED, given, log, one_line, \
    process_escapes

# Each mode's module (all light to import: the library is imported when a mode runs).
RUN = {"complete": complete.run, "chat": chat.run, "batch": batch.run, "perplexity": perplexity.run,
       "server": server.run}
_SAMPLING_KEYS = {p.key for p in SAMPLING} | set(REFUSED_SAMPLERS)
_save_npy = complete.save_npy  # a .npy written the way the CLI writes it (tests kill it midway)
__all__ = ["llama_decode", "main", "process_escapes"]


@click.command(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@O.prompt_options
@O.run_options
@O.completion_options
@O.chat_options
@O.batch_options
@O.perplexity_options
@O.grammar_options
@O.sampling_options
@O.llama_cpp_options
@server.server_options
@click.version_option(version=__version__, prog_name="llama-decode", message="%(prog)s %(version)s")
def llama_decode(**kw):
    """Continuation of PROMPT by the GGUF model MODEL (greedy unless sampling), streamed to stdout.

    MODEL is a GGUF file or a name from models.txt (fetch it first with
    `python -m synapse_nb.models fetch NAME`). PROMPT '-' reads standard input.

    Decoding is greedy by default (argmax, lowest id on ties, no RNG), unlike
    llama-completion, which samples by default. Any sampling option (--temp,
    --top-k, ..., -s/--seed, -l/--logit-bias) switches to llama.cpp's sampler
    chain, token for token as llama.cpp samples, the options not given taking
    llama.cpp's defaults (shown in brackets: top-k 40, top-p 0.95, min-p 0.05,
    temp 0.8, seed -1 = random). With it, --ignore-eos biases end-of-generation
    tokens to -inf, as llama-completion does. DRY and mirostat are not supported.

    \b
    Examples:
      llama-decode smollm2-135m-instruct-q4_1 "The capital of France is" -n 32
      llama-decode model.gguf -f prompt.txt --json
      llama-decode model.gguf "Hello" --prefill-check
      llama-decode model.gguf "Once upon a time" --temp 0.8 --seed 42
    """
    from synapse_nb import SynapseError

    import warnings

    def _warn(message, category, filename, lineno, file=None, line=None):
        # numpy RuntimeWarnings (a corrupt file's NaN scores, inf weights): one line, not two
        log(one_line(f"warning: {category.__name__}: {message}"))

    warnings.showwarning = _warn
    o = SimpleNamespace(**kw)
    try:
        code = _dispatch(o)
    except click.ClickException:
        raise
    except SynapseError as e:
        if o.verbose:
            import traceback

            traceback.print_exc()
        log(one_line(f"error: {e}"))
        sys.exit(EXIT_BAD_INPUT)
    except KeyboardInterrupt:
        log("interrupted")
        sys.exit(EXIT_INTERRUPTED)
    except BrokenPipeError:
        # stdout closed by the reader (e.g. `| head`): not an error of ours.
        try:
            sys.stdout = open(os.devnull, "w")
        finally:
            sys.exit(0)
    except Exception as e:  # an internal error: one line, traceback only with --verbose
        if isinstance(e, OSError) and e.filename is None and e.errno in _FULL_ERRNOS:
            # stdout on a full device (>/dev/full): every file we write ourselves names itself
            log(one_line(f"error: cannot write to standard output: {e.strerror or e}"))
            sys.stdout = open(os.devnull, "w")  # nothing more to flush at exit
            sys.exit(EXIT_BAD_INPUT)
        if o.verbose:
            import traceback

            traceback.print_exc()
        log(one_line(f"internal error: {type(e).__name__}: {e}"))
        sys.exit(EXIT_INTERNAL)
    sys.exit(code)


def _dispatch(o) -> int:
    """Normalise the options (MODEL / -m, PROMPT / -p, -t, -ngl, llama.cpp's flags, the sampling and
    grammar groups), then run the mode they ask for; returns its exit status."""
    from synapse_nb import SynapseError

    if o.model_opt is not None:  # -m: the arguments are PROMPT only
        if o.prompt is not None:
            raise click.UsageError("with -m/--model, give at most one argument (PROMPT)")
        o.model, o.prompt = o.model_opt, o.model
    if o.model is None:
        raise click.UsageError("missing MODEL: give a GGUF file or a models.txt name (or -m FNAME)")
    if o.gpu_layers is not None:
        if o.gpu_layers not in ("auto", "all") and not re.fullmatch(r"-?[0-9]+", o.gpu_layers):
            raise click.BadParameter(f"{o.gpu_layers!r}: an integer, 'auto' or 'all'", param_hint="-ngl/--gpu-layers")
        log("warning: llama-decode runs on the CPU only: -ngl/--gpu-layers is ignored")
    if o.n_threads is not None and o.n_threads <= 0:
        o.n_threads = None  # llama.cpp: -t <= 0 is every core
    if sys.stdout is None:  # started with stdout closed (>&-)
        if o.batch_in is None:
            raise SynapseError("standard output is closed: nothing to print the output to")
        sys.stdout = open(os.devnull, "w")  # batch mode writes --output; nothing goes to stdout
    kw = vars(o)
    compat = {k[len("compat_"):]: kw.pop(k) for k in list(kw) if k.startswith("compat_")}
    o.sampling = {k: kw.pop(k) for k in list(kw) if k in _SAMPLING_KEYS}
    o.conversation, o.display_prompt = O.apply_llama_cpp_options(compat, o.conversation)
    if o.prompt_opt is not None:
        if o.prompt is not None:
            raise click.UsageError("give the prompt either as PROMPT or with -p/--prompt, not both")
        # llama.cpp processes escapes in -p by default (-e/--escape; --no-escape keeps it as given)
        o.prompt = process_escapes(o.prompt_opt) if compat["escape"] else o.prompt_opt
    o.grammar_opts = dict(grammar=o.grammar, grammar_file=o.grammar_file, json_schema=o.json_schema,
                          json_schema_file=o.json_schema_file)
    o.n_predict_given = given("n_predict")
    return RUN[O.mode_of(o)](o)


# Errors of a write to a full device. Every file llama-decode writes (--logits-out, .kld, batch
# --output) turns them into an error naming the file, so one reaching the top unnamed is stdout's.
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def _on_sigterm(signum, frame):
    # SIGTERM unwinds like an exception, so that partial results are removed (a .kld or .npy being
    # written, an empty batch --output) before the process ends with 128 + 15
    log("terminated")
    raise SystemExit(EXIT_TERMINATED)


def main() -> None:
    """Console-script entry point of llama-decode.

    Option errors are one line on stderr ("error: Invalid value for ...") with exit status 2,
    not click's three-line usage block; Ctrl-C while click parses exits 130; SIGTERM ends the run
    with 143 after the same clean-up as an error.
    """
    import signal

    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        try:
            code = llama_decode.main(prog_name="llama-decode", standalone_mode=False)
        except click.ClickException as e:
            log(one_line(f"error: {e.format_message()} (see llama-decode --help)"))
            sys.exit(e.exit_code)
        except click.exceptions.Abort:
            log("interrupted")
            sys.exit(EXIT_INTERRUPTED)
    except SystemExit as e:
        code = e.code
    _exit(code or 0)


def _exit(code) -> None:
    """End the process with status code once the run is over, without the interpreter's teardown.

    Python's finalization after a run frees Numba's and LLVM's objects one by one (the compiled
    kernels, their typing tables, LLVM's own destructors): 0.10-0.14 s of a 0.55 s warm
    one-token run (measured with strace and timestamps, SmolLM2), which a run's output never
    needs. So: stdout and stderr are flushed and the atexit functions run (Ray's shutdown,
    temporary files' finalizers) as at a normal exit, then os._exit(code). Every file a mode
    writes is closed or committed before it returns (inputs.NewFile, batch's descriptor). Falls
    back to the normal exit (sys.exit) when a thread that is not a daemon still runs (the
    interpreter would join it), when code is not an int (a message), or when a flush fails (Python's
    exit then reports it as before).
    """
    import atexit
    import threading

    others = [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
    if others or not isinstance(code, int):
        sys.exit(code)
    try:
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
    except Exception:  # noqa: BLE001 - the normal exit flushes again and reports it
        sys.exit(code)
    atexit._run_exitfuncs()
    os._exit(code)


if __name__ == "__main__":
    main()
