"""llama-decode: greedy decoding (or llama.cpp's sampling) of a GGUF model, as llama.cpp's completion tool.

The command only parses arguments, calls the library and prints: generated
text (or JSON, or token ids) on stdout; logs, progress and timings on stderr.
Exit status: 0 success, 1 internal error, 2 bad input, 130 interrupted, 143 terminated (SIGTERM).
"""

from __future__ import annotations

import errno
import json
import os
import re
import sys
import time

import click

from synapse_nb import __version__

from .common import COUNT, INT32, AtLeast, Compiling, given, log, one_line, parse_token_list, read_prompt
from .server import run_server, server_options

EXIT_BAD_INPUT = 2
EXIT_INTERNAL = 1
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143  # SIGTERM


def _run(model_arg, prompt, file, n_predict, ctx_size, batch_size, threads, ignore_eos,
         no_parse_special, no_add_special, tokens, tokenize_only, as_json, logits_out,
         prefill_check, verbose, sampling=None, chat=None, grammar_opts=None):
    import numpy as np

    from synapse_nb import SynapseError
    from synapse_nb.jit import fast_start
    from synapse_nb.models import resolve_model

    fast_start()  # before the first kernel: Numba set up for loading cached kernels (synapse_nb.jit)
    from synapse_nb.model import load_model
    from synapse_nb.compilation.warmup import warmup as session_warmup
    from synapse_nb.session import Session, check_n_ctx, check_token_ids, resolve_n_ctx

    if chat is not None and (chat["conversation"] or chat["single_turn"]):
        bad = [name for name, v in (("--tokens", tokens), ("--tokenize", tokenize_only), ("--logits-out", logits_out),
                                    ("--prefill-check", prefill_check), ("--no-parse-special", no_parse_special),
                                    ("--no-add-special", no_add_special)) if v]
        if bad:
            raise click.UsageError(f"{bad[0]} does not apply to -cnv/--conversation or -st/--single-turn")
        return _chat(model_arg, prompt, file, n_predict, ctx_size, batch_size, threads, ignore_eos, as_json,
                     verbose, chat, sampling, grammar_opts)
    if chat is not None and (chat["system_prompt"] is not None or chat["chat_template_file"] is not None):
        raise click.UsageError("-sys/--system-prompt and --chat-template-file apply to -cnv/--conversation or "
                               "-st/--single-turn")
    if logits_out is not None and not logits_out.endswith(".npy"):
        raise click.BadParameter("must end in .npy", param_hint="--logits-out")
    if logits_out is not None and not os.path.isdir(os.path.dirname(os.path.abspath(logits_out))):
        raise click.BadParameter(f"{logits_out}: no such directory", param_hint="--logits-out")

    from synapse_nb.grammar import grammar_from_options

    grammar_text = grammar_from_options(**(grammar_opts or {}))  # files and schemas checked before the model loads
    if grammar_text is not None and (prefill_check or tokenize_only):
        raise click.UsageError("a grammar or JSON schema does not apply to --prefill-check or --tokenize")
    t_start = time.perf_counter()
    path = resolve_model(model_arg)
    if logits_out is not None:
        # Checked before any work: the output never replaces an input or an existing file.
        _check_output(logits_out, inputs=(str(path), file))
    model = load_model(path)
    tok = model.tokenizer
    t_loaded = time.perf_counter()
    if verbose:
        hp = model.hparams
        log(f"loaded {path}: arch {hp.arch}, n_layer {hp.n_layer}, n_embd {hp.n_embd}, n_vocab {hp.n_vocab} "
             f"in {1e3 * (t_loaded - t_start):.0f} ms")

    # n_ctx before anything sized by it (the prompt read's bound): the KV cache must fit in memory.
    n_ctx_max = check_n_ctx(model.hparams, resolve_n_ctx(model.hparams, ctx_size))
    _warn_n_ctx(n_ctx_max, model.hparams)
    # The prompt as token ids.
    if tokens is not None:
        if prompt is not None or file is not None:
            raise click.UsageError("--tokens replaces the prompt text; give one or the other")
        prompt_ids = parse_token_list(tokens)
        check_token_ids(prompt_ids, model.hparams.n_vocab, "--tokens")
    else:
        from synapse_nb.inputs import prompt_byte_limit

        text = read_prompt(prompt, file, prompt_byte_limit(tok, n_ctx_max), n_ctx_max)
        prompt_ids = tok.tokenize(text, add_special=not no_add_special, parse_special=not no_parse_special)

    if tokenize_only:
        click.echo(json.dumps(prompt_ids))
        return 0
    if not prompt_ids:
        if prompt is None and file is None:
            raise click.UsageError("missing PROMPT: give it as an argument, '-' for standard input, or -f FILE")
        raise SynapseError("the prompt is empty (no tokens to evaluate)")

    hp = model.hparams
    session = Session(model, n_ctx=ctx_size, n_threads=threads or os.cpu_count() or 1, n_batch=batch_size)
    n_threads = session.n_threads  # at most Numba's thread count
    session.check_prompt(len(prompt_ids))  # generation then stops when the context is full
    n_ctx = session.n_ctx
    sampler = None
    matcher = _grammar_matcher(grammar_text, tok, verbose)
    if any(v is not None and v != () for v in (sampling or {}).values()):  # else greedy: no sampling module
        from synapse_nb.sampling import sampler_from_options

        sampler = sampler_from_options(sampling, n_vocab=hp.n_vocab, eog_ids=tok.eog_ids,
                                       has_eos=tok.eos_id is not None, ignore_eos=ignore_eos, grammar=matcher)
    if sampler is not None and ignore_eos and tok.eos_id is None:  # as llama.cpp's common_init_from_params
        log("warning: vocab does not have an EOS token, ignoring --ignore-eos")
        ignore_eos = False

    t_c = time.perf_counter()
    with Compiling(verbose) as progress:
        # a cold cache compiles on two cores when the run has two (synapse_nb.compilation.helper)
        jobs = min(2, n_threads)
        if prefill_check:  # batched and token by token
            session_warmup(model, progress=progress, jobs=jobs)
        else:  # the kernels of this prompt and generation only
            session_warmup(model, progress=progress, n_prompt=len(prompt_ids), n_predict=n_predict,
                           n_batch=session.n_batch, n_ctx=n_ctx, jobs=jobs)
        if sampler is not None:
            from synapse_nb.sampling import warmup as _sampling_warmup

            _sampling_warmup(sampler)
    n_compiled = progress.compiles
    compile_ms = 1e3 * (time.perf_counter() - t_c)

    if prefill_check:
        from synapse_nb.checks import prefill_check as _check

        del session  # prefill_check makes its own two sessions
        log(f"prefill check: {len(prompt_ids)} tokens, batched (n_batch {batch_size}) and one by one, "
             f"compared batch by batch...")
        t_k = time.perf_counter()
        result = _check(model, prompt_ids, n_ctx=n_ctx, n_threads=n_threads, n_batch=batch_size,
                        progress=_check_progress(t_k))
        log(f"prefill check: done in {time.perf_counter() - t_k:.1f} s")
        click.echo(str(result))
        return 0 if result.ok else 1

    # Prefill, then greedy decode; text streamed as tokens come.
    want_rows = logits_out is not None
    rows = []
    stream = tok.stream_decoder() if not as_json else None
    generated: list[int] = []
    out = sys.stdout.buffer
    t_p0 = time.perf_counter()
    logits = session.eval(prompt_ids, all_logits=want_rows)
    t_p1 = time.perf_counter()
    from synapse_nb.inputs import NonFiniteWatch

    watch = NonFiniteWatch()  # NaN / inf weights give NaN / inf logits, as in llama.cpp: say so once
    if watch.check(logits):
        log("warning: the logits are not finite (NaN or inf): the model's weights or hyper-parameters are broken")
    if want_rows:
        rows.append(logits)
        logits = logits[-1]
    t_e0 = time.perf_counter()
    n_evals = 0

    def on_logits(row):  # one decoded token evaluated
        nonlocal n_evals
        n_evals += 1
        if watch.check(row):
            log("warning: the logits are not finite (NaN or inf): the model's weights or hyper-parameters are broken")
        if want_rows:
            rows.append(row[None, :])

    if sampler is not None:
        log(f"sampler seed: {sampler.seed}")
        if verbose:
            log("sampler chain: logits -> " + " -> ".join(sampler.chain))
        sampler.accept_many(prompt_ids)  # as llama-completion: the prompt fills the penalty window
    eog = session.eog_ids(ignore_eos)  # the tokens that end the generation (not printed)
    if stream is not None and (chat or {}).get("display_prompt"):  # --display-prompt, as llama-completion
        out.write(tok.detokenize(prompt_ids, special=False).encode("utf-8", "surrogateescape"))
        out.flush()
    try:
        for nxt in session.greedy_tokens(logits, n_predict, ignore_eos, on_logits=on_logits, sampler=sampler,
                                         grammar=matcher if sampler is None else None):
            generated.append(nxt)
            if stream is not None and nxt not in eog:
                piece = stream.push(tok.token_to_piece(nxt, special=False))
                if piece:
                    out.write(piece)
                    out.flush()
        stop = session.stop_reason  # "eog", "length" or "context" (cached + generated reached n_ctx)
    except KeyboardInterrupt:
        stop = "interrupted"
    t_e1 = time.perf_counter()
    if stream is not None:
        out.write(stream.flush() + b"\n")
        out.flush()

    if want_rows:
        _save_npy(logits_out, np.concatenate(rows, axis=0).astype(np.float32))

    prompt_ms = 1e3 * (t_p1 - t_p0)
    eval_ms = 1e3 * (t_e1 - t_e0)
    timings = {
        "load_ms": round(1e3 * (t_loaded - t_start), 2),
        "compile_ms": round(compile_ms, 2),
        "prompt_ms": round(prompt_ms, 2),
        "prompt_tokens_per_s": round(len(prompt_ids) / (prompt_ms / 1e3), 2) if prompt_ms > 0 else None,
        "eval_ms": round(eval_ms, 2),
        "eval_tokens_per_s": round(n_evals / (eval_ms / 1e3), 2) if n_evals and eval_ms > 0 else None,
        "n_threads": n_threads,
    }
    if as_json:
        click.echo(json.dumps({
            "model": str(path),
            "prompt_tokens": prompt_ids,
            "tokens": generated,
            "text": tok.detokenize(generated, special=False),
            "stop": stop,
            "timings": timings,
            **({"seed": sampler.seed} if sampler is not None else {}),
        }))
    log(f"load time        = {timings['load_ms']:10.2f} ms")
    if n_compiled:
        log(f"compile time     = {timings['compile_ms']:10.2f} ms")
    log(f"prompt eval time = {prompt_ms:10.2f} ms / {len(prompt_ids):5d} tokens"
         f" ({timings['prompt_tokens_per_s'] or 0:8.2f} tokens per second)")
    log(f"       eval time = {eval_ms:10.2f} ms / {n_evals:5d} runs  "
         f" ({timings['eval_tokens_per_s'] or 0:8.2f} tokens per second)")
    log(f"stop: {stop}, {len(generated)} tokens generated, {n_threads} thread{'s' if n_threads != 1 else ''}")
    return EXIT_INTERRUPTED if stop == "interrupted" else 0


def _chat(model_arg, prompt, file, n_predict, ctx_size, batch_size, threads, ignore_eos, as_json, verbose, chat,
          sampling=None, grammar_opts=None):
    """-cnv / -st: load, make the session, warm up, then synapse_nb.chat.run_conversation."""
    from synapse_nb.chat import chat_renderer, has_chat_template, read_template_file, run_conversation
    from synapse_nb.model import load_model
    from synapse_nb.compilation.warmup import warmup as session_warmup
    from synapse_nb.session import Session, check_n_ctx, resolve_n_ctx
    from synapse_nb.models import resolve_model

    if click.get_current_context().get_parameter_source("n_predict") == click.core.ParameterSource.DEFAULT:
        n_predict = -1  # llama.cpp's default in conversation: until end-of-generation or a full context
    template = origin = None
    if chat["chat_template_file"] is not None:
        template, origin = read_template_file(chat["chat_template_file"]), chat["chat_template_file"]
    from synapse_nb.grammar import grammar_from_options

    grammar_text = grammar_from_options(**(grammar_opts or {}))
    t_start = time.perf_counter()
    path = resolve_model(model_arg)
    model = load_model(path)
    timings = {"load_ms": round(1e3 * (time.perf_counter() - t_start), 2)}  # as the completion --json's
    hp = model.hparams
    n_ctx = check_n_ctx(hp, resolve_n_ctx(hp, ctx_size))  # before a turn is read with a bound sized by it
    _warn_n_ctx(n_ctx, hp)
    first = None
    if prompt is not None or file is not None:
        from synapse_nb.inputs import prompt_byte_limit

        first = read_prompt(prompt, file, prompt_byte_limit(model.tokenizer, n_ctx), n_ctx)
    chat_renderer(model.tokenizer, template, origin, chat["jinja"], chat["system_prompt"])  # bad template: now
    if template is None and not has_chat_template(model.tokenizer):
        # llama-cli's warning when a conversation is forced without the model's own template
        log("warning: the model has no chat template: using llama.cpp's ChatML fallback, which may give "
             "suboptimal responses (--chat-template-file FILE gives one)")
    session = Session(model, n_ctx=n_ctx, n_threads=threads or os.cpu_count() or 1, n_batch=batch_size)
    n_threads = session.n_threads
    timings.update(compile_ms=0.0, n_threads=n_threads)
    from synapse_nb.sampling import sampler_from_options

    tok = model.tokenizer
    matcher = _grammar_matcher(grammar_text, tok, verbose)
    sampler = sampler_from_options(sampling or {}, n_vocab=hp.n_vocab, eog_ids=tok.eog_ids,
                                   has_eos=tok.eos_id is not None, ignore_eos=ignore_eos, grammar=matcher)
    if sampler is not None:
        log(f"sampler seed: {sampler.seed}")

    def warmup():
        t_c = time.perf_counter()
        _warmup()
        timings["compile_ms"] = round(1e3 * (time.perf_counter() - t_c), 2)

    def _warmup():
        with Compiling(verbose) as progress:
            session_warmup(model, progress=progress, jobs=min(2, n_threads))
            if sampler is not None:
                from synapse_nb.sampling import warmup as _sampling_warmup

                _sampling_warmup(sampler)

    return run_conversation(model, session, first_user=first, system_prompt=chat["system_prompt"],
                            single_turn=chat["single_turn"], n_predict=n_predict, jinja=chat["jinja"],
                            chat_template=template, template_origin=origin, ignore_eos=ignore_eos,
                            as_json=as_json, verbose=verbose, log=log, warmup=warmup, sampler=sampler,
                            grammar=matcher, timings=timings)


def _grammar_text(grammar_opts):
    from synapse_nb.grammar import grammar_from_options

    return grammar_from_options(**grammar_opts)


def _grammar_matcher(grammar_text, tok, verbose):
    """A GrammarMatcher for the grammar text (None: no grammar); the vocabulary's index is built here."""
    if grammar_text is None:
        return None
    from synapse_nb.grammar import Grammar, GrammarMatcher

    t0 = time.perf_counter()
    g = Grammar(grammar_text, tokenizer=tok)
    m = GrammarMatcher(g, tok)
    if verbose:
        log(f"grammar: {len(g.rules)} rules, vocabulary indexed in {1e3 * (time.perf_counter() - t0):.0f} ms")
    return m


def _warn_n_ctx(n_ctx: int, hp) -> None:
    """llama.cpp's warning (llama_context's constructor) when n_ctx exceeds the training context."""
    if n_ctx > hp.n_ctx_train:
        log(f"warning: n_ctx {n_ctx} > n_ctx_train {hp.n_ctx_train} of the model: possible training context overflow")


def _check_progress(t0: float):
    """prefill_check's progress(done, total) on stderr: redrawn per batch on a terminal, else a
    line at every tenth of the prompt."""
    tty = sys.stderr.isatty()
    shown = [0]

    def progress(done: int, total: int) -> None:
        line = f"prefill check: {done}/{total} tokens compared, {time.perf_counter() - t0:.1f} s"
        if tty:
            log("\r" + line + ("\n" if done >= total else "\x1b[K"), end="")
        elif done >= total or done * 10 // total > shown[0]:
            shown[0] = done * 10 // total
            log(line)

    return progress


def _check_output(dest: str, inputs) -> None:
    """--logits-out must not be an input (the model, the -f prompt file) nor any existing file."""
    from synapse_nb import SynapseError

    real = os.path.realpath(dest)
    if any(p is not None and os.path.exists(p) and os.path.realpath(p) == real for p in inputs):
        raise SynapseError(f"--logits-out {dest} is one of the inputs; it is not overwritten")
    if os.path.lexists(dest):
        raise SynapseError(f"--logits-out {dest} already exists; it is not overwritten (remove it or choose "
                           f"another name)")
    from synapse_nb.inputs import check_writable

    check_writable(dest, "--logits-out")  # a read-only directory is found now, not after the generation


def _save_npy(dest: str, array) -> None:
    """Write ``array`` to ``dest`` (synapse_nb.inputs.NewFile: written unnamed, then linked; never
    replaces an existing file; a killed run leaves nothing)."""
    import numpy as np

    from synapse_nb import SynapseError
    from synapse_nb.inputs import NewFile

    out = NewFile(dest, "--logits-out")
    try:
        np.save(out.f, array)
    except OSError as e:
        out.abort()
        raise SynapseError(f"--logits-out {dest}: {e.strerror or e}") from None
    out.commit()


def _sampling_options(f):
    """The sampling options (llama.cpp's names and meanings), passed to the command as **sampling.

    Any of them switches from greedy decoding to llama.cpp's sampler chain (synapse_nb.sampling),
    the options not given taking llama.cpp's defaults.
    """
    F = dict(type=float, default=None, metavar="N")
    opts = [
        click.option("--temp", **F, help="Sampling temperature [0.8]."),
        click.option("--top-k", type=INT32, default=None, metavar="N", help="Top-k sampling, 0 = off [40]."),
        click.option("--top-p", **F, help="Top-p sampling, 1.0 = off [0.95]."),
        click.option("--min-p", **F, help="Min-p sampling, 0.0 = off [0.05]."),
        click.option("--typical", "typical_p", **F, help="Locally typical sampling p, 1.0 = off [1.0]."),
        click.option("--top-nsigma", "top_n_sigma", **F, help="Top-n-sigma sampling, -1 = off [-1]."),
        click.option("--xtc-probability", **F, help="XTC probability, 0.0 = off [0.0]."),
        click.option("--xtc-threshold", **F, help="XTC threshold, > 0.5 = off [0.1]."),
        click.option("--dynatemp-range", **F, help="Dynamic temperature range, 0.0 = off [0.0]."),
        click.option("--dynatemp-exp", "dynatemp_exponent", **F, help="Dynamic temperature exponent [1.0]."),
        click.option("--repeat-penalty", **F, help="Repeat penalty, 1.0 = off [1.0]."),
        click.option("--repeat-last-n", "penalty_last_n", type=INT32, default=None, metavar="N",
                     help="Last N tokens (prompt included) to penalize, 0 = off [64]."),
        click.option("--presence-penalty", **F, help="Presence penalty, 0.0 = off [0.0]."),
        click.option("--frequency-penalty", **F, help="Frequency penalty, 0.0 = off [0.0]."),
        click.option("--min-keep", type=AtLeast(0), default=None, metavar="N",
                     help="Minimum candidates each sampler keeps [0]."),
        click.option("-s", "--seed", type=AtLeast(-1, " (-1: random)", maximum=2**32 - 1), default=None,
                     metavar="SEED",
                     help="RNG seed, -1 = random (the seed used is printed on stderr) [-1]."),
        click.option("-l", "--logit-bias", multiple=True, metavar="TOKEN(+|-)BIAS",
                     help="Add BIAS to TOKEN's logit, e.g. 15043+1 or 15043-inf (repeatable)."),
    ]
    refused = ["--dry-multiplier", "--dry-base", "--dry-allowed-length", "--dry-penalty-last-n",
               "--dry-sequence-breaker", "--mirostat", "--mirostat-lr", "--mirostat-ent"]
    opts += [click.option(name, type=str, default=None, hidden=True) for name in refused]
    for o in reversed(opts):
        f = o(f)
    return f


def _llama_cpp_options(f):
    """llama-completion's common flags that a llama.cpp user types, with llama.cpp's meanings (or
    refused by their own name). Passed to the command as compat_* in **sampling, taken out first."""
    opts = [
        click.option("-no-cnv", "--no-conversation", "compat_no_cnv", is_flag=True,
                     help="No conversation mode (the default here, as llama-completion's -no-cnv)."),
        click.option("-fa", "--flash-attn", "compat_flash_attn", type=click.Choice(["on", "off", "auto"]),
                     default=None, help="Flash attention: off or auto (computed without it); on is refused."),
        click.option("-ub", "--ubatch-size", "compat_ubatch", type=COUNT, default=None, metavar="N",
                     help="Accepted for llama.cpp's command lines and ignored: results do not depend on it."),
        click.option("--display-prompt/--no-display-prompt", "compat_display_prompt", default=False,
                     show_default=True, help="Print the prompt before the generated text (llama.cpp's default "
                                             "is to print it)."),
        click.option("-e", "--escape/--no-escape", "compat_escape", default=True, show_default=True,
                     help="Process escapes (\\n, \\t, \\\\, \\', \\\", \\xNN) in -p, as llama.cpp does by default."),
        click.option("--color", "compat_color", is_flag=True, hidden=True),
        click.option("-i", "--interactive", "compat_interactive", is_flag=True, hidden=True),
        click.option("-if", "--interactive-first", "compat_interactive_first", is_flag=True, hidden=True),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def _apply_llama_cpp_options(compat: dict, conversation: bool):
    """(conversation, display_prompt) after llama-completion's flags; UsageError for the refused ones."""
    if compat["flash_attn"] == "on":
        raise click.UsageError("-fa/--flash-attn on: flash attention is not implemented; llama-decode computes "
                               "as llama.cpp with -fa off (give off or auto, or leave it out)")
    if compat["interactive"] or compat["interactive_first"]:
        raise click.UsageError("-i/--interactive is not supported; use -cnv/--conversation for a chat")
    if compat["ubatch"] is not None:
        log("warning: -ub/--ubatch-size is ignored: llama-decode's results do not depend on the batch sizes "
             "(-b sets the prefill batch)")
    # --color: accepted, nothing is colored. -no-cnv: conversation off, whatever -cnv said
    return conversation and not compat["no_cnv"], compat["display_prompt"]


_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "'": "'", '"': '"', "\\": "\\", "a": "\a", "b": "\b",
            "f": "\f", "v": "\v", "?": "?"}


def process_escapes(text: str) -> str:
    """llama.cpp's string_process_escapes: \\n \\r \\t \\' \\" \\\\ \\a \\b \\f \\v \\? and \\xNN (an
    ASCII code) replaced; any other backslash sequence, and a final lone backslash, kept as written."""
    if "\\" not in text:
        return text
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if c == "\\" and i + 1 < n:
            nxt = text[i + 1]
            if nxt in _ESCAPES:
                out.append(_ESCAPES[nxt])
                i += 2
                continue
            hx = text[i + 2:i + 4]
            if nxt == "x" and len(hx) == 2 and all(h in "0123456789abcdefABCDEF" for h in hx) and int(hx, 16) < 0x80:
                out.append(chr(int(hx, 16)))
                i += 4
                continue
        out.append(c)
        i += 1
    return "".join(out)


def _run_batch(model, batch_in, batch_out, workers, ray_address, threads, n_parallel, single, **options):
    """--batch IN --output OUT [--workers N] [--ray [ADDRESS]]: synapse_nb.batch.run_file does the work."""
    from synapse_nb.batch import run_file

    if batch_in is None or batch_out is None:
        raise click.UsageError("batch mode needs both --batch IN.jsonl and --output OUT.jsonl")
    given = [name for name, v in single.items() if v not in (None, False)]
    if given:
        raise click.UsageError(f"{given[0]} does not go with --batch (the prompts are the lines of IN)")
    if options["n_predict"] < 0:  # a batch line always has a limit (-1 is for one interactive run)
        raise click.BadParameter("must be >= 0", param_hint="-n/--n-predict")
    return run_file(model, batch_in, batch_out, workers=workers, n_threads=threads, ray_address=ray_address,
                    n_parallel=n_parallel, **options)


@click.command(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.argument("model", required=False)
@click.argument("prompt", required=False)
@click.option("-m", "--model", "model_opt", type=str, default=None, metavar="FNAME",
              help="The model (llama.cpp's -m), instead of MODEL: then the first argument is PROMPT.")
@click.option("-f", "--file", type=str, default=None, metavar="FILE", help="Read the prompt from this file.")
@click.option("-n", "--n-predict", type=AtLeast(-1, " (-1: no limit)"), default=128, show_default=True,
              help="Tokens to generate; -1: until end of generation or a full context.")
@click.option("-c", "--ctx-size", type=AtLeast(0), default=None,
              help="Context size n_ctx in tokens, 0 = the model's n_ctx_train [default: min(n_ctx_train, 4096)].")
@click.option("-b", "--batch-size", type=COUNT, default=64, show_default=True, help="Prefill batch size.")
@click.option("-t", "--threads", type=INT32, default=None, metavar="N",
              help="Threads, <= 0 = all cores [default: all cores].")
@click.option("-ngl", "--gpu-layers", "--n-gpu-layers", "gpu_layers", type=str, default=None, metavar="N",
              help="Accepted for llama.cpp's scripts and ignored: no GPU offload (a CPU decoder).")
@click.option("--ignore-eos", is_flag=True, help="Do not stop at end-of-generation tokens.")
@click.option("--no-parse-special", is_flag=True, help="Treat special-token text in the prompt as plain text.")
@click.option("--no-add-special", is_flag=True, help="Do not add BOS/EOS to the prompt.")
@click.option("--tokens", type=str, default=None, metavar="ID,ID,...",
              help="Prompt as token ids, used exactly as given (no BOS added).")
@click.option("--tokenize", "tokenize_only", is_flag=True, help="Print the prompt's token ids as JSON and exit.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of streaming text.")
@click.option("--logits-out", type=str, default=None, metavar="PATH.npy",
              help="Save float32 logits [n_prompt + n_generated - 1, n_vocab] (never overwrites).")
@click.option("--prefill-check", is_flag=True,
              help="Check that batched prefill equals token-by-token decoding bit for bit; exit 1 if not.")
@click.option("-v", "--verbose", is_flag=True, help="More logs on stderr; tracebacks on errors.")
@click.option("-p", "--prompt", "prompt_opt", type=str, default=None, metavar="TEXT",
              help="The prompt (llama.cpp's -p), instead of PROMPT; the first user turn with -cnv/-st.")
@click.option("-cnv", "--conversation", is_flag=True,
              help="Chat: one user turn per line of stdin ('> ' on a terminal), replies streamed; /exit or EOF ends.")
@click.option("-st", "--single-turn", is_flag=True,
              help="Chat for one turn: PROMPT/-p/-f (else one stdin line) as the user message, then exit.")
@click.option("-sys", "--system-prompt", type=str, default=None, metavar="TEXT",
              help="System message at the start of the chat (-cnv/-st).")
@click.option("--chat-template-file", type=str, default=None, metavar="FILE",
              help="Jinja chat template to use instead of the model's tokenizer.chat_template.")
@click.option("--jinja/--no-jinja", default=True, show_default=True,
              help="Run the chat template (--jinja), or use the built-in ChatML format (--no-jinja).")
@click.option("--batch", "batch_in", type=str, default=None, metavar="IN.jsonl",
              help='Batch mode: one input per line, {"id": ..., "prompt": "..."} or {"id": ..., "tokens": [...]}.')
@click.option("--output", "batch_out", type=str, default=None, metavar="OUT.jsonl",
              help="Batch results, one line per input, appended as they are done; a re-run skips ids already in it.")
@click.option("--workers", type=COUNT, default=None,
              help="Batch mode: worker processes, each loading the model [default: 1; with --ray: CPUs / threads].")
@click.option("--ray", "ray_address", is_flag=False, flag_value="local", default=None, metavar="[ADDRESS]",
              help="Batch mode or --server on Ray: a local Ray, or join the cluster at ADDRESS "
                   "(pip install 'synapse_nb[ray]').")
@click.option("--perplexity", "ppl", is_flag=True,
              help="Perplexity of the -f text as llama-perplexity computes it (-c default 512).")
@click.option("--kl-divergence-base", "kld_base", type=str, default=None, metavar="FILE",
              help="Alone: also write our log-probabilities to FILE (llama.cpp .kld, never overwrites); "
                   "with --kl-divergence: the base file to compare against.")
@click.option("--kl-divergence", "kl_div", is_flag=True,
              help="KL divergence of our token distributions against --kl-divergence-base FILE.")
@click.option("--chunks", type=INT32, default=None, metavar="N", help="Perplexity: at most N chunks [default: all].")
@click.option("--grammar", type=str, default=None, metavar="GBNF",
              help="Constrain the output with this GBNF grammar (llama.cpp's grammar syntax).")
@click.option("--grammar-file", type=str, default=None, metavar="FILE", help="The GBNF grammar from FILE.")
@click.option("-j", "--json-schema", type=str, default=None, metavar="SCHEMA",
              help="Constrain the output to JSON of this JSON schema (converted to GBNF as llama.cpp does).")
@click.option("-jf", "--json-schema-file", type=str, default=None, metavar="FILE", help="The JSON schema from FILE.")
@_sampling_options
@_llama_cpp_options
@server_options
@click.version_option(version=__version__, prog_name="llama-decode", message="%(prog)s %(version)s")
def llama_decode(model, prompt, model_opt, file, n_predict, ctx_size, batch_size, threads, gpu_layers, ignore_eos,
                 no_parse_special, no_add_special, tokens, tokenize_only, as_json, logits_out, prefill_check, verbose,
                 prompt_opt, conversation, single_turn, system_prompt, chat_template_file, jinja, batch_in, batch_out,
                 workers, ray_address, ppl, kld_base, kl_div, chunks, grammar, grammar_file, json_schema,
                 json_schema_file, server, host, port, n_parallel, api_key, server_timeout, max_queue, no_webui,
                 replicas, **sampling):
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
    grammar_opts = dict(grammar=grammar, grammar_file=grammar_file, json_schema=json_schema,
                        json_schema_file=json_schema_file)
    try:
        if model_opt is not None:  # -m: the arguments are PROMPT only
            if prompt is not None:
                raise click.UsageError("with -m/--model, give at most one argument (PROMPT)")
            model, prompt = model_opt, model
        if model is None:
            raise click.UsageError("missing MODEL: give a GGUF file or a models.txt name (or -m FNAME)")
        if gpu_layers is not None:
            if gpu_layers not in ("auto", "all") and not re.fullmatch(r"-?[0-9]+", gpu_layers):
                raise click.BadParameter(f"{gpu_layers!r}: an integer, 'auto' or 'all'", param_hint="-ngl/--gpu-layers")
            log("warning: llama-decode runs on the CPU only: -ngl/--gpu-layers is ignored")
        if threads is not None and threads <= 0:
            threads = None  # llama.cpp: -t <= 0 is every core
        if sys.stdout is None:  # started with stdout closed (>&-)
            if batch_in is None:
                raise SynapseError("standard output is closed: nothing to print the output to")
            sys.stdout = open(os.devnull, "w")  # batch mode writes --output; nothing goes to stdout
        compat = {k[len("compat_"):]: sampling.pop(k) for k in list(sampling) if k.startswith("compat_")}
        conversation, display_prompt = _apply_llama_cpp_options(compat, conversation)
        if prompt_opt is not None:
            if prompt is not None:
                raise click.UsageError("give the prompt either as PROMPT or with -p/--prompt, not both")
            # llama.cpp processes escapes in -p by default (-e/--escape; --no-escape keeps it as given)
            prompt = process_escapes(prompt_opt) if compat["escape"] else prompt_opt
        if replicas is not None and not (server and ray_address is not None):
            raise click.UsageError("--replicas goes with --server --ray")
        if server:
            if prompt is not None or file is not None or batch_in is not None or ppl or conversation or single_turn:
                raise click.UsageError("--server takes no prompt and does not combine with --batch, --perplexity, "
                                       "-cnv or -st (requests bring the prompts)")
            code = run_server(model, host=host, port=port, n_parallel=n_parallel, api_key=api_key,
                              timeout=server_timeout, max_queue=max_queue, no_webui=no_webui, ctx_size=ctx_size,
                              batch_size=batch_size, threads=threads,
                              n_predict=n_predict if given("n_predict") else -1, sampling=sampling,
                              chat_template_file=chat_template_file, jinja=jinja, verbose=verbose, log=log,
                              compiling=Compiling, grammar=_grammar_text(grammar_opts), ray_address=ray_address,
                              replicas=replicas)
        elif ppl or kl_div or kld_base is not None:  # the perplexity tool (cli/perplexity.py)
            from . import perplexity as _ppl

            if logits_out is not None or prefill_check or tokenize_only:
                raise click.UsageError("--perplexity / --kl-divergence do not combine with --logits-out, "
                                       "--prefill-check or --tokenize")
            if any(v is not None for v in grammar_opts.values()):
                raise click.UsageError("a grammar or JSON schema does not apply to --perplexity / --kl-divergence")

            code = _ppl.run(model, prompt, file, ctx_size, batch_size, threads, chunks, kld_base, kl_div, tokens,
                            as_json, verbose)
        elif batch_in is not None or batch_out is not None or workers is not None or ray_address is not None:
            from synapse_nb.sampling import given_options

            from synapse_nb.grammar import grammar_from_options

            code = _run_batch(model, batch_in, batch_out, workers, ray_address, threads, n_parallel or 1,
                              n_predict=n_predict, grammar=grammar_from_options(**grammar_opts),
                              n_ctx=ctx_size, n_batch=batch_size, ignore_eos=ignore_eos,
                              add_special=not no_add_special, parse_special=not no_parse_special,
                              sampling=given_options(sampling) or None,
                              single=dict(PROMPT=prompt, **{"-f/--file": file, "--tokens": tokens,
                                          "--tokenize": tokenize_only, "--json": as_json,
                                          "--logits-out": logits_out, "--prefill-check": prefill_check,
                                          "-cnv/--conversation": conversation, "-st/--single-turn": single_turn,
                                          "-sys/--system-prompt": system_prompt,
                                          "--chat-template-file": chat_template_file}))
        else:
            chat = dict(conversation=conversation, single_turn=single_turn, system_prompt=system_prompt,
                        chat_template_file=chat_template_file, jinja=jinja, display_prompt=display_prompt)
            code = _run(model, prompt, file, n_predict, ctx_size, batch_size, threads, ignore_eos, no_parse_special,
                        no_add_special, tokens, tokenize_only, as_json, logits_out, prefill_check, verbose,
                        sampling=sampling, chat=chat, grammar_opts=grammar_opts)
    except click.ClickException:
        raise
    except SynapseError as e:
        if verbose:
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
        if verbose:
            import traceback

            traceback.print_exc()
        log(one_line(f"internal error: {type(e).__name__}: {e}"))
        sys.exit(EXIT_INTERNAL)
    sys.exit(code)


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
        code = llama_decode.main(prog_name="llama-decode", standalone_mode=False)
    except click.ClickException as e:
        log(one_line(f"error: {e.format_message()} (see llama-decode --help)"))
        sys.exit(e.exit_code)
    except click.exceptions.Abort:
        log("interrupted")
        sys.exit(EXIT_INTERRUPTED)
    sys.exit(code or 0)


if __name__ == "__main__":
    main()
