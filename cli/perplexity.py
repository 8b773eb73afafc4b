"""llama-decode --perplexity / --kl-divergence-base / --kl-divergence: printing glue only.

The computation is synapse_nb.perplexity. stdout carries what llama-perplexity prints as its
output (the running ``[i]`` values and the final estimate; the KL divergence table and
statistics), or one JSON object with --json; progress and timings go to stderr.
"""

from __future__ import annotations

import json
import sys
import time

import click

from .common import Compiling, log, parse_token_list, read_prompt
from .options import refuse_unused


def run(o) -> int:
    """Run the perplexity tool with o, the command's options (cli.main); returns the exit status.
    Raises SynapseError / click errors on bad input."""
    refuse_unused("perplexity", o)
    prompt, file, ctx_size, batch_size, chunks, kld_base, kl_divergence, tokens, as_json, verbose = (
        o.prompt, o.file, o.n_ctx, o.n_batch, o.chunks, o.kld_base, o.kl_div, o.tokens, o.as_json, o.verbose)
    from synapse_nb.jit import fast_start

    fast_start()  # before Numba loads (synapse_nb.jit)
    from synapse_nb import SynapseError, engine
    from synapse_nb import perplexity as P
    from synapse_nb.models import resolve_model
    from synapse_nb.session import check_n_ctx, resolve_n_ctx, usable_threads

    if chunks is not None and chunks == 0:
        raise click.BadParameter("must be >= 1 (or -1 for all)", param_hint="--chunks")
    if kl_divergence and kld_base is None:
        raise click.UsageError("--kl-divergence needs --kl-divergence-base FILE (the base model's log-probabilities)")
    if kld_base is not None and not kl_divergence:
        P._check_new_file(kld_base)  # before any work: an existing file is never replaced
    kb = P.read_kld(kld_base) if kl_divergence else None

    t0 = time.perf_counter()
    path = resolve_model(o.model)
    model = engine.load_model(path)
    n_threads = usable_threads(engine.all_cores(o.n_threads))
    if ctx_size is not None:  # -c 0: the model's training context (a Session's n_ctx 0)
        ctx_size = check_n_ctx(model.hparams, resolve_n_ctx(model.hparams, ctx_size))
    if kb is not None:  # the base file's header sets the workload: checked against the model first
        P.check_kld_header(model, kb)
    if kb is not None and ctx_size is not None and ctx_size < kb.n_ctx:
        raise SynapseError(f"{kld_base} has been computed with n_ctx {kb.n_ctx}, while -c is {ctx_size}; increase it "
                           f"(or omit -c)")
    n_ctx = kb.n_ctx if kb is not None else (ctx_size if ctx_size is not None else P.DEFAULT_N_CTX)
    if n_ctx > model.hparams.n_ctx_train:
        log(f"warning: model was trained on only {model.hparams.n_ctx_train} context tokens ({n_ctx} specified)")

    # The text, tokenized once with add_special (llama-perplexity: common_tokenize(ctx, prompt, true)).
    ids = None
    if tokens is not None:
        if prompt is not None or file is not None:
            raise click.UsageError("--tokens replaces the text; give one or the other")
        ids = parse_token_list(tokens)
    elif prompt is not None or file is not None:
        # A perplexity text spans many contexts; it is still read bounded (-f /dev/zero fails at once):
        # PPL_TEXT_LIMIT bytes, far more than any evaluation here reads in reasonable time.
        text = read_prompt(prompt, file, P.PPL_TEXT_LIMIT, n_ctx)
        if file is not None and text.endswith("\n"):
            text = text[:-1]  # -f drops exactly one trailing newline, as llama.cpp's -f does
        t_tok = time.perf_counter()
        ids = model.tokenizer.tokenize(text, add_special=True, parse_special=False)
        if verbose:
            log(f"perplexity: tokenization took {1e3 * (time.perf_counter() - t_tok):.2f} ms ({len(ids)} tokens)")
    elif kb is None:
        raise click.UsageError("--perplexity needs a text: -f FILE, PROMPT, or '-' for standard input")
    if kb is None:  # checked before the kernels are compiled
        P.check_length(len(ids), n_ctx)
    else:
        P.check_kld_base(model, kb, ids)
    t_loaded = time.perf_counter()

    with Compiling(verbose) as progress:
        compile_s = engine.warm_up(model, progress=progress)

    out = sys.stdout
    t_run = time.perf_counter()
    state = {"t": t_run}

    def on_chunk(done, total, text):
        now = time.perf_counter()
        if done == 1:
            per = now - state["t"]
            log(f"perplexity: {per:.2f} seconds per pass - ETA {per * total / 60:.2f} minutes")
            if kb is not None and not as_json:
                out.write("\n" + P.KLD_HEADER + "\n")
        if not as_json:
            out.write(text + ("\n" if kb is not None else ""))
            out.flush()

    if kb is None:
        if len(ids) >= 2 * n_ctx:
            n_chunk = len(ids) // n_ctx if chunks is None or chunks < 0 else min(chunks, len(ids) // n_ctx)
            log(f"perplexity: calculating perplexity over {n_chunk} chunks, n_ctx={n_ctx}, batch_size="
                 f"{min(batch_size, n_ctx)}, {n_threads} threads" + (f", saving all logits to {kld_base}"
                                                                      if kld_base else ""))
        res = P.perplexity(model, ids, n_ctx=n_ctx, n_batch=batch_size, n_threads=n_threads, progress=on_chunk,
                           chunks=chunks, kld_base=kld_base)
        n_eval = res.n_chunk * n_ctx
        if as_json:
            d = {"model": str(path), **res.to_dict()}
        else:
            out.write("\n" + res.final_text() + "\n")
    else:
        log(f"kl_divergence: computing over {kb.n_chunk if chunks is None or chunks < 0 else min(chunks, kb.n_chunk)}"
             f" chunks, n_ctx={kb.n_ctx}, batch_size={min(batch_size, kb.n_ctx)}, {n_threads} threads")
        res = P.kl_divergence(model, kb, n_batch=batch_size, n_threads=n_threads, progress=on_chunk, tokens=ids,
                              chunks=chunks)
        n_eval = res.n_chunk * kb.n_ctx
        if as_json:
            d = {"model": str(path), "base": str(kld_base), **res.to_dict()}
        else:
            stats = res.statistics_text()
            out.write("\n" + (stats + "\n\n" if stats else "\n"))  # perplexity.cpp ends with LOG("\n") twice
            if not stats:
                log(f"kl_divergence: {res.count} scored tokens (< 100): no statistics, as llama-perplexity")
    t_end = time.perf_counter()
    run_s = t_end - t_run
    timings = {"load_ms": round(1e3 * (t_loaded - t0), 2), "compile_ms": round(1e3 * compile_s, 2),
               "eval_ms": round(1e3 * run_s, 2), "tokens_per_s": round(n_eval / run_s, 2) if run_s > 0 else None,
               "n_threads": n_threads}
    if as_json:
        d["timings"] = timings
        out.write(json.dumps(d) + "\n")
    out.flush()
    log(f"load time        = {timings['load_ms']:10.2f} ms")
    if compile_s >= 0.5:
        log(f"compile time     = {timings['compile_ms']:10.2f} ms")
    log(f"perplexity time  = {timings['eval_ms']:10.2f} ms / {n_eval:5d} tokens"
         f" ({timings['tokens_per_s'] or 0:8.2f} tokens per second)")
    return 0
