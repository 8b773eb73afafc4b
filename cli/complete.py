"""llama-decode MODEL PROMPT: completion, as llama-completion (and --tokenize, --prefill-check).

The text is streamed to stdout as tokens come (or one JSON object with --json); logs, progress
and timings go to stderr. Load, session, warm-up and generation are synapse_nb.engine's.
"""

from __future__ import annotations

import json
import os
import sys
import time

import click

from .common import (EXIT_INTERRUPTED, Compiling, grammar_matcher, log, parse_token_list, prompt_n_batch, read_prompt,
                     warn_n_ctx)
from .options import refuse_unused

NOT_FINITE = "warning: the logits are not finite (NaN or inf): the model's weights or hyper-parameters are broken"


def run(o) -> int:
    """Completion of o.prompt (or -f, --tokens) by o.model; returns the exit status. Raises
    SynapseError / click errors on bad input. o: the command's options (cli.main)."""
    refuse_unused("complete", o)
    from synapse_nb.jit import fast_start

    fast_start()  # before the first kernel: Numba set up for loading cached kernels (synapse_nb.jit)
    from synapse_nb import engine
    from synapse_nb.grammar import grammar_from_options

    if o.logits_out is not None and not o.logits_out.endswith(".npy"):
        raise click.BadParameter("must end in .npy", param_hint="--logits-out")
    if o.logits_out is not None and not os.path.isdir(os.path.dirname(os.path.abspath(o.logits_out))):
        raise click.BadParameter(f"{o.logits_out}: no such directory", param_hint="--logits-out")
    grammar_text = grammar_from_options(**o.grammar_opts)  # files and schemas checked before the model loads
    if grammar_text is not None and (o.prefill_check or o.tokenize_only):
        raise click.UsageError("a grammar or JSON schema does not apply to --prefill-check or --tokenize")
    t_start = time.perf_counter()
    from synapse_nb.models import resolve_model

    path = resolve_model(o.model)
    if o.logits_out is not None:
        # Checked before any work: the output never replaces an input or an existing file.
        _check_output(o.logits_out, inputs=(str(path), o.file))
    # on a cold cache the compile helper starts at the vocabulary's first compile (engine.compiling_ahead)
    with engine.compiling_ahead(path, o.n_threads) as ahead:
        return _complete(o, path, t_start, grammar_text, ahead)


def _complete(o, path, t_start, grammar_text, ahead) -> int:
    """run's work from the model's load on (t_start: before the model's name resolved), the
    warm-up's compile helper ahead (or None)."""
    from synapse_nb import SynapseError, engine
    from synapse_nb.session import check_n_ctx, check_token_ids, resolve_n_ctx

    model = engine.load_model(path)
    tok, hp = model.tokenizer, model.hparams
    load_ms = round(1e3 * (time.perf_counter() - t_start), 2)
    if o.verbose:
        log(f"loaded {path}: arch {hp.arch}, n_layer {hp.n_layer}, n_embd {hp.n_embd}, n_vocab {hp.n_vocab} "
            f"in {load_ms:.0f} ms")

    # n_ctx before anything sized by it (the prompt read's bound): the KV cache must fit in memory.
    n_ctx_max = check_n_ctx(hp, resolve_n_ctx(hp, o.n_ctx))
    warn_n_ctx(n_ctx_max, hp)
    if o.tokens is not None:  # the prompt as token ids
        if o.prompt is not None or o.file is not None:
            raise click.UsageError("--tokens replaces the prompt text; give one or the other")
        prompt_ids = parse_token_list(o.tokens)
        check_token_ids(prompt_ids, hp.n_vocab, "--tokens")
    else:
        from synapse_nb.inputs import prompt_byte_limit

        text = read_prompt(o.prompt, o.file, prompt_byte_limit(tok, n_ctx_max), n_ctx_max)
        prompt_ids = tok.tokenize(text, add_special=not o.no_add_special, parse_special=not o.no_parse_special)
    if o.tokenize_only:
        click.echo(json.dumps(prompt_ids))
        return 0
    if not prompt_ids:
        if o.prompt is None and o.file is None:
            raise click.UsageError("missing PROMPT: give it as an argument, '-' for standard input, or -f FILE")
        raise SynapseError("the prompt is empty (no tokens to evaluate)")

    # a short prompt of a first run: token by token (not for --prefill-check, which runs both)
    n_batch = o.n_batch if o.prefill_check else prompt_n_batch(model, len(prompt_ids), o.n_batch, o.verbose)
    session = engine.open_session(model, o.n_ctx, o.n_threads, n_batch, o.swa_full)
    n_threads = session.n_threads  # at most Numba's thread count
    session.check_prompt(len(prompt_ids))  # generation then stops when the context is full
    sampler = None
    ignore_eos = o.ignore_eos
    matcher = grammar_matcher(grammar_text, tok, o.verbose)
    if any(v is not None and v != () for v in o.sampling.values()):  # else greedy: no sampling module
        from synapse_nb.sampling import sampler_from_options

        sampler = sampler_from_options(o.sampling, n_vocab=hp.n_vocab, eog_ids=tok.eog_ids,
                                       has_eos=tok.eos_id is not None, ignore_eos=ignore_eos, grammar=matcher)
    if sampler is not None and ignore_eos and tok.eos_id is None:  # as llama.cpp's common_init_from_params
        log("warning: vocab does not have an EOS token, ignoring --ignore-eos")
        ignore_eos = False

    with Compiling(o.verbose) as progress:
        # a cold cache compiles on two cores when the run has two (synapse_nb.compilation.helper);
        # --prefill-check runs batched and token by token: every kernel, else this run's only
        run = {} if o.prefill_check else dict(n_prompt=len(prompt_ids), n_predict=o.n_predict,
                                              n_batch=session.n_batch, n_ctx=session.n_ctx)
        compile_s = engine.warm_up(model, progress=progress, sampler=sampler, jobs=min(2, n_threads),
                                   ahead=ahead, **run)
    if o.prefill_check:
        n_ctx = session.n_ctx
        del session  # prefill_check makes its own two sessions
        return _prefill_check(model, prompt_ids, n_ctx, n_threads, o.n_batch)

    gen, rows = _generate(session, prompt_ids, o, sampler, matcher, ignore_eos, tok)
    if rows is not None:
        import numpy as np

        save_npy(o.logits_out, np.concatenate(rows, axis=0).astype(np.float32))
    timings = {"load_ms": load_ms, "compile_ms": round(1e3 * compile_s, 2), **gen.timings(n_threads)}
    if o.as_json:
        click.echo(json.dumps({
            "model": str(path), "prompt_tokens": prompt_ids, "tokens": gen.tokens,
            "text": tok.detokenize(gen.tokens, special=False), "stop": gen.stop, "timings": timings,
            **({"seed": sampler.seed} if sampler is not None else {}),
        }))
    log(f"load time        = {timings['load_ms']:10.2f} ms")
    if progress.compiles:
        log(f"compile time     = {timings['compile_ms']:10.2f} ms")
    log(f"prompt eval time = {timings['prompt_ms']:10.2f} ms / {len(prompt_ids):5d} tokens"
        f" ({timings['prompt_tokens_per_s'] or 0:8.2f} tokens per second)")
    log(f"       eval time = {timings['eval_ms']:10.2f} ms / {gen.n_evals:5d} runs  "
        f" ({timings['eval_tokens_per_s'] or 0:8.2f} tokens per second)")
    log(f"stop: {gen.stop}, {len(gen.tokens)} tokens generated, {n_threads} thread{'s' if n_threads != 1 else ''}")
    return EXIT_INTERRUPTED if gen.stop == "interrupted" else 0


def _generate(session, prompt_ids, o, sampler, matcher, ignore_eos, tok):
    """Prefill, then decode with the text streamed as tokens come; (Generation, logits rows or None)."""
    from synapse_nb.engine import generate
    from synapse_nb.inputs import NonFiniteWatch

    rows = [] if o.logits_out is not None else None
    stream = tok.stream_decoder() if not o.as_json else None
    out = sys.stdout.buffer
    watch = NonFiniteWatch()  # NaN / inf weights give NaN / inf logits, as in llama.cpp: say so once
    eog = session.eog_ids(ignore_eos)  # the tokens that end the generation (not printed)

    def on_logits(row):  # the prompt's logits, then each decoded token's
        if watch.check(row):
            log(NOT_FINITE)
        if rows is not None:
            rows.append(row if row.ndim == 2 else row[None, :])

    def on_prompt(logits):
        on_logits(logits)
        if sampler is not None:
            log(f"sampler seed: {sampler.seed}")
            if o.verbose:
                log("sampler chain: logits -> " + " -> ".join(sampler.chain))
        if stream is not None and o.display_prompt:  # --display-prompt, as llama-completion
            out.write(tok.detokenize(prompt_ids, special=False).encode("utf-8", "surrogateescape"))
            out.flush()

    def on_token(t):
        if stream is not None and t not in eog:
            piece = stream.push(tok.token_to_piece(t, special=False))
            if piece:
                out.write(piece)
                out.flush()

    gen = generate(session, prompt_ids, o.n_predict, sampler=sampler, grammar=matcher, ignore_eos=ignore_eos,
                   all_logits=rows is not None, on_prompt=on_prompt, on_token=on_token, on_logits=on_logits,
                   on_prefill=prefill_progress(sys.stderr.isatty()), interruptible=True)
    if stream is not None:
        out.write(stream.flush() + b"\n")
        out.flush()
    return gen, rows


def _prefill_check(model, prompt_ids, n_ctx, n_threads, n_batch) -> int:
    """--prefill-check: batched prefill against token by token; prints the one-line report."""
    from synapse_nb.checks import prefill_check

    log(f"prefill check: {len(prompt_ids)} tokens, batched (n_batch {n_batch}) and one by one, "
        f"compared batch by batch...")
    t_k = time.perf_counter()
    result = prefill_check(model, prompt_ids, n_ctx=n_ctx, n_threads=n_threads, n_batch=n_batch,
                           progress=_check_progress(t_k))
    log(f"prefill check: done in {time.perf_counter() - t_k:.1f} s")
    click.echo(str(result))
    return 0 if result.ok else 1


def prefill_progress(tty: bool, after_s: float = 2.0, clock=time.perf_counter):
    """A long prompt's progress(done, total) on a terminal: once the prompt has taken after_s, the
    line "prompt: done/total tokens, R tok/s" redrawn per batch and cleared at the end (the text
    follows on that line). Not on a terminal: None (nothing printed, clean logs for scripts)."""
    if not tty:
        return None
    t0 = clock()
    shown = [False]

    def progress(done: int, total: int) -> None:
        dt = clock() - t0
        if done >= total:
            if shown[0]:
                log("\r\x1b[K", end="")
        elif dt >= after_s:
            shown[0] = True
            log(f"\rprompt: {done}/{total} tokens, {done / dt:.1f} tok/s\x1b[K", end="")

    return progress


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


def save_npy(dest: str, array) -> None:
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
