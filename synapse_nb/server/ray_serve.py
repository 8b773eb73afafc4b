"""`llama-decode MODEL --server --ray [ADDRESS]`: the server's app (synapse_nb.server.app) on Ray Serve.

Each Serve replica holds one engine (a synapse_nb.Llama: one model load, -np slots, -t Numba
threads, reserving -t CPUs) and serves the same FastAPI app as `--server` through Serve's FastAPI
ingress (the app is built in the replica, over its own Llama: `__serve_build_asgi_app__`). Serve's
HTTP proxy listens on --host/--port and spreads the requests over the replicas; streaming (SSE)
passes through it, and a client that goes away cancels its request on the replica, which frees the
slot (the handlers' `finally: job.cancel()`).

Without ADDRESS a local Ray is started, and shut down at the end; with one, the command joins that
cluster and removes only what it started (its application, or Serve if Serve was not running).
Needs the `ray` extra (Ray Serve): pip install 'synapse_nb[ray]'.
"""

from __future__ import annotations

import os
import sys

from ..errors import SynapseError

INSTALL_HINT = "pip install 'synapse_nb[ray]'"
APP_NAME = "synapse_nb"
DEPLOYMENT_NAME = "llama"


def import_serve():
    """(ray, ray.serve); SynapseError with the install command when Ray Serve does not import."""
    try:
        import ray
        from ray import serve
    except ImportError as e:
        raise SynapseError(f"--server --ray needs Ray Serve ({e.name} is not installed): {INSTALL_HINT}") from None
    return ray, serve


def _log_stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Replica:
    """One Serve replica: one Llama, the FastAPI app over it (wrapped by serve.ingress() at deploy time)."""

    def __init__(self, model_arg: str, llama_kwargs: dict, sampling: dict, app_kwargs: dict):
        from ..api import Llama
        from ..engine import load_model
        from ..sampling import given_options

        model = load_model(model_arg)
        defaults = given_options(sampling, model.hparams.n_vocab)
        seed = defaults.pop("seed", -1)
        self.llama = Llama(model_arg, model=model, seed=seed, sampling=defaults, warmup=True, **llama_kwargs)
        if llama_kwargs.get("chat_template") is not None or model.tokenizer.chat_template is not None:
            self.llama.apply_chat_template([{"role": "user", "content": "Hello"}])  # a bad template: now
        self.app_kwargs = app_kwargs

    def __serve_build_asgi_app__(self):
        from .app import create_app

        return create_app(self.llama, log=_log_stderr, **self.app_kwargs)

    def check_health(self) -> None:
        """Serve's health check: the engine's thread must be alive."""
        if not self.llama._thread.is_alive():
            raise RuntimeError("the engine's thread has stopped")

    def __del__(self):
        llama = getattr(self, "llama", None)
        if llama is not None:
            llama.close(timeout=2.0)


def _free_port(host: str, port: int) -> int:
    """port if it can be listened on now (0: a free one, chosen here); SynapseError otherwise."""
    from . import listen_socket

    sock = listen_socket(host, port)
    try:
        return sock.getsockname()[1]
    finally:
        sock.close()


def _quiet(verbose: bool) -> None:
    import logging

    level = logging.INFO if verbose else logging.WARNING
    for name in ("ray", "ray.serve", "ray.data"):
        logging.getLogger(name).setLevel(level)


def _running_serve_address():
    """(host, port) of the HTTP proxies of a Serve already running on the cluster, or None."""
    try:
        from ray.serve.context import _connect

        client = _connect(raise_if_no_controller_running=False)
    except Exception:
        return None
    if client is None:
        return None
    cfg = client.http_config
    return cfg.host, cfg.port


def run(model_arg: str, *, address: str, replicas: int | tuple | None, host: str, port: int, threads: int | None,
        n_parallel: int, ctx_size, batch_size: int, n_predict: int, sampling: dict, chat_template,
        chat_template_origin, jinja: bool, max_queue: int, api_key, webui: bool, timeout, verbose: bool,
        log=_log_stderr, stop_event=None) -> int:
    """Deploy the replicas (replicas: a number, (min, max) for Serve's autoscaling, or None: the
    cluster's CPUs / threads) behind Serve's proxy on host:port, log the start-up line, serve until
    SIGINT / SIGTERM (or stop_event), then remove the deployment (and the local Ray); return 0."""
    import signal
    import threading

    from ..batch import worker_model_arg, package_root
    from ..sampling import given_options

    ray, serve = import_serve()
    given_options(sampling)  # refused flags (DRY, mirostat), malformed biases: before Ray starts
    local = address in (None, "", "local")
    if local:
        from ..models import resolve_model

        resolve_model(model_arg)  # a missing file / an unfetched name: said now (each node loads its own)
    model_arg = worker_model_arg(model_arg)
    port = _free_port(host, port)
    n_threads = threads or 1
    pythonpath = os.pathsep.join(p for p in (package_root(), os.environ.get("PYTHONPATH")) if p)
    env = {"env_vars": {"NUMBA_NUM_THREADS": str(n_threads), **({"PYTHONPATH": pythonpath} if pythonpath else {})}}

    stop = stop_event or threading.Event()
    previous = {}
    started_ray = False
    started_serve = deployed = False
    try:
        _quiet(verbose)
        if not ray.is_initialized():
            try:
                ray.init(address=None if local else address, include_dashboard=False,
                         logging_level="INFO" if verbose else "ERROR", log_to_driver=verbose)
            except ConnectionError as e:  # no cluster there, or one that refuses us (Ray's auth token)
                raise SynapseError(f"--ray {address}: cannot join the Ray cluster: {e}") from None
            started_ray = True
        logging_config = {"log_level": "INFO" if verbose else "WARNING", "enable_access_log": verbose}
        running = None if local else _running_serve_address()
        if running is None:
            started_serve = True
            serve.start(http_options={"host": host, "port": port}, logging_config=logging_config)
        elif running != (host, port):  # Serve's proxies are the cluster's: ours joins them where they are
            host, port = running
            log(f"warning: Ray Serve already runs on the cluster, its proxies on {host}:{port}: serving there")
        if isinstance(replicas, tuple):  # MIN:MAX: Serve's autoscaling, on the requests per replica
            lo, hi = replicas
            scaling = {"autoscaling_config": {"min_replicas": lo, "max_replicas": hi, "initial_replicas": lo,
                                              "target_ongoing_requests": n_parallel}}
            shown_replicas = f"{lo} to {hi} replicas (autoscaling)"
        else:
            n = replicas or max(1, int(ray.cluster_resources().get("CPU", 1)) // n_threads)
            scaling = {"num_replicas": n}
            shown_replicas = f"{n} replicas"
        deployment = serve.deployment(
            serve.ingress()(Replica), name=DEPLOYMENT_NAME, **scaling,
            ray_actor_options={"num_cpus": n_threads, "runtime_env": env},
            # each replica as one --server: its slots, then its engine's queue of max_queue (then 503,
            # an OpenAI error); 8 more for the light endpoints (/health, /slots, /tokenize ...), which
            # Serve counts as requests too: without them they would wait behind the generations
            max_ongoing_requests=n_parallel + max_queue + 8, graceful_shutdown_timeout_s=5,
            max_constructor_retry_count=1, logging_config=logging_config)
        llama_kwargs = dict(n_ctx=ctx_size, n_threads=n_threads, n_batch=batch_size, n_parallel=n_parallel,
                            n_predict=n_predict, chat_template=chat_template,
                            chat_template_origin=chat_template_origin, jinja=jinja, max_queue=max_queue,
                            verbose=verbose)
        app_kwargs = dict(api_key=api_key, webui=webui, timeout=timeout)
        deployed = True
        try:
            serve.run(deployment.bind(model_arg, llama_kwargs, sampling, app_kwargs), name=APP_NAME,
                      route_prefix="/", blocking=False)
        except RuntimeError as e:
            raise SynapseError(f"the replicas did not start: {_last_error(str(e))}") from None
        shown = f"[{host}]" if ":" in host else host
        where = "a local Ray" if local else f"the Ray cluster at {address}"
        log(f"server listening on http://{shown}:{port}/ ({os.path.basename(model_arg)}, Ray Serve on {where}: "
            f"{shown_replicas} x {n_parallel} slots, {n_threads} threads each)")
        if stop_event is None:
            previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
        while not stop.wait(0.5):
            pass
    finally:
        try:
            if started_serve:
                serve.shutdown()
            elif deployed:
                serve.delete(APP_NAME)
        finally:
            if started_ray:
                ray.shutdown()
            for s, h in previous.items():
                signal.signal(s, h)
    log("server stopped")
    return 0


def _last_error(text: str) -> str:
    """The last line of a Serve deployment failure that names an error (its traceback's last line)."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if "Error" in ln or "error" in ln:
            return ln
    return lines[-1] if lines else "unknown error"
