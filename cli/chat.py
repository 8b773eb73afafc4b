"""llama-decode MODEL -cnv / -st: a chat, as llama-cli's conversation mode.

Loads, opens the session and builds the sampler here (synapse_nb.engine); the turns are
synapse_nb.chat.run_conversation's, which warms the kernels up when the first turn is read.
"""

from __future__ import annotations

import time

import click

from .common import Compiling, grammar_matcher, log, prompt_n_batch, read_prompt, warn_n_ctx
from .options import refuse_unused


def run(o) -> int:
    """-cnv / -st with o, the command's options (cli.main); returns the exit status."""
    refuse_unused("chat", o)
    from synapse_nb.jit import fast_start

    fast_start()  # before the first kernel: Numba set up for loading cached kernels (synapse_nb.jit)
    from synapse_nb import engine
    from synapse_nb.chat import chat_renderer, has_chat_template, read_template_file, run_conversation
    from synapse_nb.grammar import grammar_from_options
    from synapse_nb.models import resolve_model
    from synapse_nb.session import check_n_ctx, resolve_n_ctx

    n_predict = o.n_predict
    if click.get_current_context().get_parameter_source("n_predict") == click.core.ParameterSource.DEFAULT:
        n_predict = -1  # llama.cpp's default in conversation: until end-of-generation or a full context
    template = origin = None
    if o.chat_template_file is not None:
        template, origin = read_template_file(o.chat_template_file), o.chat_template_file
    grammar_text = grammar_from_options(**o.grammar_opts)
    t_start = time.perf_counter()
    path = resolve_model(o.model)
    # on a cold cache the compile helper starts at the vocabulary's first compile (engine.compiling_ahead)
    with engine.compiling_ahead(path, o.n_threads) as ahead:
        model = engine.load_model(path)
        timings = {"load_ms": round(1e3 * (time.perf_counter() - t_start), 2)}  # as the completion --json's
        hp, tok = model.hparams, model.tokenizer
        n_ctx = check_n_ctx(hp, resolve_n_ctx(hp, o.n_ctx))  # before a turn is read with a bound sized by it
        warn_n_ctx(n_ctx, hp)
        first = None
        if o.prompt is not None or o.file is not None:
            from synapse_nb.inputs import prompt_byte_limit

            first = read_prompt(o.prompt, o.file, prompt_byte_limit(tok, n_ctx), n_ctx)
        chat_renderer(tok, template, origin, o.jinja, o.system_prompt)  # bad template: now
        if template is None and not has_chat_template(tok):
            # llama-cli's warning when a conversation is forced without the model's own template
            log("warning: the model has no chat template: using llama.cpp's ChatML fallback, which may give "
                "suboptimal responses (--chat-template-file FILE gives one)")
        session = engine.open_session(model, n_ctx, o.n_threads, o.n_batch, o.swa_full)
        n_threads = session.n_threads
        timings.update(compile_ms=0.0, n_threads=n_threads)
        from synapse_nb.sampling import sampler_from_options

        matcher = grammar_matcher(grammar_text, tok, o.verbose)
        sampler = sampler_from_options(o.sampling, n_vocab=hp.n_vocab, eog_ids=tok.eog_ids,
                                       has_eos=tok.eos_id is not None, ignore_eos=o.ignore_eos, grammar=matcher)

        def warmup(n_prompt=None):
            # run_conversation calls this once the first turn is read and known to fit: a turn that
            # does not fit is then the run's one error line, not the second after the seed's.
            # n_prompt: the tokens of a single turn's prompt, given before the run: its run's
            # kernels only, and its prompt token by token on a first run (as a completion's,
            # engine.prompt_n_batch); else every turn's kernels, but neither the head on several
            # rows nor several sequences' attention (a chat reads one row's logits at a time).
            # Returns the batch size of the first turn's prompt (None: the session's).
            if sampler is not None:
                log(f"sampler seed: {sampler.seed}")
            n_batch, run = None, dict(several_rows=False)
            if n_prompt is not None:
                n_batch = prompt_n_batch(model, n_prompt, session.n_batch, o.verbose)
                run = dict(n_prompt=n_prompt, n_predict=n_predict, n_batch=n_batch, n_ctx=session.n_ctx)
            with Compiling(o.verbose) as progress:
                compile_s = engine.warm_up(model, progress=progress, sampler=sampler, jobs=min(2, n_threads),
                                           ahead=ahead, **run)
            timings["compile_ms"] = round(1e3 * compile_s, 2)
            return n_batch

        return run_conversation(model, session, first_user=first, system_prompt=o.system_prompt,
                                single_turn=o.single_turn, n_predict=n_predict, jinja=o.jinja,
                                chat_template=template, template_origin=origin, ignore_eos=o.ignore_eos,
                                as_json=o.as_json, verbose=o.verbose, log=log, warmup=warmup, sampler=sampler,
                                grammar=matcher, timings=timings)
