"""llama-decode MODEL --server: llama-server's flags, then synapse_nb.server.serve.

Only parses and calls the library: the model, its engine (synapse_nb.Llama) and the HTTP server.
"""

from __future__ import annotations

import click

from synapse_nb.options import I32_MAX

from .common import Compiling, grammar_text, log
from .options import refuse_unused


def _parse_replicas(ctx, param, value):
    """--replicas N (N >= 1) or MIN:MAX (1 <= MIN <= MAX): an int, a (min, max) pair, or None."""
    if value is None:
        return None
    try:
        parts = [int(v) for v in value.split(":")]
    except ValueError:
        parts = []
    if len(parts) == 1 and parts[0] >= 1:
        return parts[0]
    if len(parts) == 2 and 1 <= parts[0] <= parts[1]:
        return tuple(parts)
    raise click.BadParameter(f"{value!r}: a number N >= 1, or MIN:MAX with 1 <= MIN <= MAX")


def server_options(f):
    """The server's flags (llama-server's names; -np/--parallel is batch mode's too)."""
    opts = [
        click.option("--server", "server", is_flag=True,
                     help="Serve the model over HTTP: OpenAI's /v1/completions, /v1/chat/completions and "
                          "llama-server's endpoints, a chat page at / (pip install 'synapse_nb[server]')."),
        click.option("--host", type=str, default="127.0.0.1", show_default=True, help="Server: address to listen on."),
        click.option("--port", type=click.IntRange(0, 65535), default=8080, show_default=True,
                     help="Server: port (0: a free one, printed at start)."),
        click.option("-np", "--parallel", "n_parallel", type=click.IntRange(1, 256), default=None, metavar="N",
                     help="Sequences decoded at once: server slots, or batch lines [default: server 4, batch 1]."),
        click.option("--api-key", type=str, default=None, metavar="KEY",
                     help="Server: require 'Authorization: Bearer KEY'."),
        click.option("-to", "--timeout", "server_timeout", type=click.IntRange(1, I32_MAX), default=600, show_default=True,
                     metavar="N", help="Server: seconds a request may run before it is cancelled."),
        click.option("--max-queue", type=click.IntRange(0, I32_MAX), default=256, show_default=True, metavar="N",
                     help="Server: requests waiting for a slot before new ones get 503."),
        click.option("--no-webui", is_flag=True, help="Server: do not serve the chat page at /."),
        click.option("--replicas", type=str, default=None, metavar="N|MIN:MAX", callback=_parse_replicas,
                     help="Server on Ray (--server --ray): Serve replicas, each loading the model with -t threads "
                          "[default: the cluster's CPUs / threads]; MIN:MAX: Ray Serve autoscales between them."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def run(o) -> int:
    """--server with o, the command's options (cli.main): run_server; returns the exit status."""
    refuse_unused("server", o)
    return run_server(o.model, host=o.host, port=o.port, n_parallel=o.n_parallel, api_key=o.api_key,
                      timeout=o.server_timeout, max_queue=o.max_queue, no_webui=o.no_webui, ctx_size=o.n_ctx,
                      batch_size=o.n_batch, threads=o.n_threads, n_predict=o.n_predict if o.n_predict_given else -1,
                      sampling=o.sampling, chat_template_file=o.chat_template_file, jinja=o.jinja,
                      verbose=o.verbose, log=log, compiling=Compiling, grammar=grammar_text(o.grammar_opts),
                      ray_address=o.ray_address, replicas=o.replicas, swa_full=o.swa_full)


def run_server(model_arg, *, host, port, n_parallel, api_key, timeout, max_queue, no_webui, ctx_size, batch_size,
               threads, n_predict, sampling, chat_template_file, jinja, verbose, log, compiling, grammar=None,
               ray_address=None, replicas=None, swa_full=False) -> int:
    """Load, warm up, listen, serve until SIGINT / SIGTERM; exit status 0. With ray_address (--ray:
    "local" or a cluster's address) the replicas of Ray Serve load the model and serve instead."""
    from synapse_nb.chat import read_template_file
    from synapse_nb.sampling import given_options
    from synapse_nb.server import check_installed, listen_socket, serve

    if replicas is not None and ray_address is None:
        raise click.UsageError("--replicas goes with --server --ray")
    if ray_address is not None:
        if grammar is not None:
            raise click.UsageError("--grammar / -j as the server's default does not go with --ray: give it per "
                                   "request (grammar, json_schema, response_format)")
        from synapse_nb.server import ray_serve

        ray_serve.import_serve()  # not installed: the install command, before anything else
        check_installed()
        template = read_template_file(chat_template_file) if chat_template_file is not None else None
        return ray_serve.run(model_arg, address=ray_address, replicas=replicas, host=host, port=port,
                             threads=threads, n_parallel=n_parallel or 4, ctx_size=ctx_size, batch_size=batch_size,
                             n_predict=n_predict, sampling=sampling, chat_template=template,
                             chat_template_origin=chat_template_file, jinja=jinja, max_queue=max_queue,
                             api_key=api_key, webui=not no_webui, timeout=timeout, verbose=verbose, log=log)
    check_installed()
    from synapse_nb import engine
    from synapse_nb.api import Llama

    template = read_template_file(chat_template_file) if chat_template_file is not None else None
    sock = listen_socket(host, port)  # before the model loads: a port in use is said at once
    try:
        model = engine.load_model(model_arg)
        defaults = given_options(sampling, model.hparams.n_vocab)
        seed = defaults.pop("seed", -1)
        with compiling(verbose) as progress:
            engine.warm_up(model, progress=progress, all_samplers=True)
        llama = Llama(model_arg, model=model, n_ctx=ctx_size, n_threads=engine.all_cores(threads),
                      n_batch=batch_size, n_parallel=n_parallel or 4, seed=seed, sampling=defaults,
                      n_predict=n_predict, chat_template=template, chat_template_origin=chat_template_file,
                      jinja=jinja, max_queue=max_queue, warmup=False, verbose=verbose, grammar=grammar,
                      swa_full=swa_full)
        if template is not None or model.tokenizer.chat_template is not None:
            llama.apply_chat_template([{"role": "user", "content": "Hello"}])  # a bad template: now
    except BaseException:
        sock.close()
        raise
    return serve(llama, sock, api_key=api_key, webui=not no_webui, timeout=timeout, log=log)
