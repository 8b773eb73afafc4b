"""`llama-decode MODEL --server`: an OpenAI-compatible HTTP server (synapse_nb.server.app) on uvicorn.

Needs the `server` extra (FastAPI, uvicorn, pydantic): pip install 'synapse_nb[server]'.
"""

from __future__ import annotations

from ..errors import SynapseError

INSTALL_HINT = "pip install 'synapse_nb[server]'"


def check_installed() -> None:
    """Raise SynapseError with the install command unless FastAPI and uvicorn import."""
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise SynapseError(f"--server needs FastAPI and uvicorn ({e.name} is not installed): {INSTALL_HINT}") \
            from None


def listen_socket(host: str, port: int):
    """A listening TCP socket on host:port (port 0: a free one). Raises SynapseError naming the
    address when it cannot be had (in use, not this machine's)."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise SynapseError(f"--host {host}: {e.strerror}") from None
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise SynapseError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    return sock


def serve(llama, sock, *, api_key=None, webui=True, timeout=None, log=print, graceful_seconds: float = 5.0) -> int:
    """Serve llama on the listening socket until SIGINT or SIGTERM; then stop accepting, let running
    requests finish for up to graceful_seconds (then cancel them), stop the engine, return 0."""
    import signal

    import uvicorn

    from .app import create_app

    app = create_app(llama, api_key=api_key, webui=webui, timeout=timeout, log=log)
    config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=graceful_seconds,
                            lifespan="off")
    server = uvicorn.Server(config)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    log(f"server listening on http://{shown}:{port}/ ({llama.model_name}, {llama.n_parallel} slots of "
        f"{llama.n_ctx} tokens, {llama.n_threads} threads)")
    # uvicorn re-raises the signal that stopped it once it is done: ignored here, so that a
    # stop by SIGINT / SIGTERM is a clean exit 0
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run(sockets=[sock])
    finally:
        llama.close()
        for s, h in previous.items():
            signal.signal(s, h)
    log("server stopped")
    return 0
