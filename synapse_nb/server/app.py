"""The HTTP server: OpenAI's and llama-server's endpoints over one synapse_nb.Llama.

Endpoints (request fields and response shapes of the OpenAI API and of llama-server):
  GET  /health, /v1/models (/models), /props, /slots, /metrics (Prometheus text)
  POST /v1/completions (/completions), /v1/chat/completions (/chat/completions): stream (SSE, then
       "data: [DONE]"), max_tokens, sampling fields, stop, logprobs / top_logprobs, n = 1, usage
  POST /completion (llama-server: n_predict, n_probs, cache_prompt, stream), /tokenize,
       /detokenize, /apply-template
  GET  /  the chat page (static files of synapse_nb/server/static; --no-webui turns it off)

The handlers are thin: each request becomes a Job of the Llama (synapse_nb.api), whose engine
decodes every request in the same steps; a request's tokens do not depend on what else runs.
Errors are OpenAI error objects: 400 bad JSON / wrong types / unknown fields / a prompt too long
/ a bad value, 401 a missing or wrong API key, 404 unknown path, 413 a body over MAX_BODY_BYTES,
503 the queue is full; the server keeps serving after each. A client that goes away cancels
its sequence (the slot is free at the next step).
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any, Literal, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, create_model
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..api import ChatFormat, CompletionFormat, Llama, ServerBusy
from ..errors import SynapseError
from ..options import BY_KEY, FIELDS

MAX_BODY_BYTES = 8 << 20  # a request body larger than this is refused with 413
STATIC = Path(__file__).parent / "static"


# ---------------------------------------------------------------- request bodies

class _Strict(BaseModel):
    # unknown fields and wrong types are errors (400), not silently ignored or converted
    model_config = ConfigDict(extra="forbid", strict=True)


# A request's sampling fields (float or int, optional), from the one parameter table.
_SamplingFields = create_model("_SamplingFields", __base__=_Strict,
                               **{f: ((float if BY_KEY[k].kind == "float" else int) | None, None)
                                  for f, k in FIELDS.items()})


class _Sampling(_SamplingFields):
    model: str | None = None
    logit_bias: Union[dict[str, Union[float, bool]], list[list[Union[int, float, bool]]], None] = None
    ignore_eos: bool = False
    stop: Union[str, list[str], None] = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    user: str | None = None
    n: int = 1
    cache_prompt: bool = True  # llama-server's; the prefix cache never changes results here
    grammar: str | None = None  # GBNF text (llama-server's field)
    json_schema: Union[dict[str, Any], bool, None] = None  # a JSON schema (llama-server's field)

    def sampling(self) -> dict:
        keys = (*FIELDS, "logit_bias", "ignore_eos", "grammar", "json_schema")
        return {k: getattr(self, k) for k in keys
                if k not in ("grammar", "json_schema") or getattr(self, k) is not None}


class CompletionRequest(_Sampling):
    prompt: Union[str, list[int]]
    max_tokens: int | None = None
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None


class ContentPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: str
    content: Union[str, list[ContentPart], None] = None
    name: str | None = None

    def plain(self) -> dict:
        c = self.content
        if isinstance(c, list):
            c = "".join(p.text for p in c)
        return {"role": self.role, "content": c or ""}


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None  # {"type": "json_object"} or {"type": "json_schema", ...}

    def sampling(self) -> dict:
        out = super().sampling()
        if self.response_format is not None:
            out["response_format"] = self.response_format
        return out


class LlamaCompletionRequest(_Sampling):
    """llama-server's /completion."""
    prompt: Union[str, list[int]]
    n_predict: int | None = None
    n_probs: int = 0


class TokenizeRequest(_Strict):
    content: str
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False


class DetokenizeRequest(_Strict):
    tokens: list[int]


class ApplyTemplateRequest(_Strict):
    messages: list[Message] = Field(min_length=1)


# ---------------------------------------------------------------- errors

def error_response(status: int, message: str, type_: str = "invalid_request_error") -> JSONResponse:
    """An OpenAI-style error object."""
    return JSONResponse({"error": {"message": message, "type": type_, "param": None, "code": status}},
                        status_code=status)


def _validation_message(exc: RequestValidationError) -> str:
    errs = exc.errors()
    if not errs:
        return "invalid request"
    e = errs[0]
    if e.get("type") == "json_invalid":
        return f"the body is not valid JSON: {e.get('ctx', {}).get('error', e.get('msg'))}"
    loc = ".".join(str(p) for p in e.get("loc", ()) if p != "body")
    return f"{loc or 'body'}: {e.get('msg')}"


class _BodyLimit:
    """ASGI middleware (the app's outermost, added by create_app): a request body over max_bytes (by
    Content-Length, or as it streams in) is answered 413 before the application reads it."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for k, v in scope.get("headers", ()):
            if k == b"content-length":
                try:
                    too_big = int(v) > self.max_bytes
                except ValueError:
                    too_big = False
                if too_big:
                    return await self._reject(scope, receive, send)
        seen = 0

        async def limited():
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.max_bytes:
                    raise _TooLarge()
            return msg

        await self.app(scope, limited, send)  # the app answers _TooLarge with 413

    async def _reject(self, scope, receive, send):
        resp = error_response(413, f"the request body is larger than {self.max_bytes} bytes")
        await resp(scope, receive, send)


class _TooLarge(Exception):
    pass


# ---------------------------------------------------------------- the app

def create_app(llama: Llama, *, api_key: str | None = None, webui: bool = True, timeout: float | None = None,
               log=None) -> FastAPI:
    """The FastAPI application serving `llama` (served by uvicorn for --server, and by each Ray Serve
    replica for --server --ray, synapse_nb.server.ray_serve). api_key: required as "Authorization: Bearer KEY"
    on every endpoint but /health and the page; timeout: seconds a request may run before it is
    cancelled (its finish_reason is then "length"); log(str): one line per request error."""
    app = FastAPI(title="synapse_nb", docs_url=None, redoc_url=None, openapi_url=None)
    public = {"/health", "/v1/health", "/", "/index.html", "/favicon.ico"}
    started = time.time()

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if api_key is not None and request.url.path not in public and not request.url.path.startswith("/static/"):
            given = request.headers.get("authorization", "")
            if given != f"Bearer {api_key}" and request.headers.get("x-api-key") != api_key:
                return error_response(401, "invalid or missing API key", "authentication_error")
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def _bad_request(request, exc):
        return error_response(400, _validation_message(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(exc.status_code, str(exc.detail), kind)

    @app.exception_handler(_TooLarge)
    async def _too_large(request, exc):
        return error_response(413, f"the request body is larger than {MAX_BODY_BYTES} bytes")

    @app.exception_handler(ServerBusy)
    async def _busy(request, exc):
        return error_response(503, str(exc), "unavailable_error")

    @app.exception_handler(SynapseError)
    async def _synapse_error(request, exc):
        return error_response(400, str(exc))

    @app.exception_handler(Exception)
    async def _internal(request, exc):
        if log:
            log(f"error: internal error on {request.url.path}: {type(exc).__name__}: {exc}")
        return error_response(500, f"internal error: {type(exc).__name__}", "server_error")

    async def _start(prompt, req, max_tokens, logprobs):
        if req.n != 1:
            raise SynapseError(f"n = {req.n}: only n = 1 is supported")
        loop = asyncio.get_running_loop()
        return llama.submit(prompt, max_tokens=max_tokens, stop=req.stop, logprobs=logprobs, loop=loop,
                            **req.sampling())

    async def _events(job, request: Request | None):
        """The job's events; cancels it when the client goes away or the timeout passes."""
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while True:
                try:  # (cancelling a queue's get loses nothing; cancelling an async generator would end it)
                    ev = await asyncio.wait_for(job.aget(), 1.0)
                except asyncio.TimeoutError:
                    if request is not None and await request.is_disconnected():
                        job.cancel()
                        return
                    if deadline is not None and time.monotonic() > deadline:
                        job.cancel()
                    continue
                if ev[0] == "done" and ev[1] == "cancelled" and deadline is not None and time.monotonic() > deadline:
                    ev = ("done", "length", *ev[2:])
                if ev[0] == "done":
                    llama.metrics["predicted_tokens"] += ev[3]
                yield ev
                if ev[0] == "done":
                    return
        finally:
            job.cancel()  # a finished job: nothing happens; a dropped stream: its slot is freed

    def _sse(gen):
        async def body():
            async for obj in gen:
                yield f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(body(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _collect(job, request: Request):
        """(text pieces, token entries, the "done" event or None if the client went away) of a job."""
        text, toks, res = [], [], None
        async for ev in _events(job, request):
            if ev[0] == "text":
                text.append(ev[1])
                toks.extend(ev[2])
            else:
                res = ev
        return text, toks, res

    async def _respond(job, fmt, stream: bool, request: Request):
        if stream:
            async def chunks():
                async for ev in _events(job, None):
                    for c in fmt.chunks(ev):
                        yield c
            return _sse(chunks())
        text, toks, res = await _collect(job, request)
        if res is None:  # the client went away
            return Response(status_code=499)
        if res[1] == "error":
            return error_response(500, "the engine failed on this request", "server_error")
        return JSONResponse(fmt.whole(("".join(text), toks, res[1], res[2], res[3])))

    @app.get("/health")
    @app.get("/v1/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    @app.get("/models")
    async def models():
        hp = llama.model.hparams
        return {"object": "list", "data": [{
            "id": llama.model_name, "object": "model", "created": int(started), "owned_by": "synapse_nb",
            "meta": {"n_ctx_train": hp.n_ctx_train, "n_vocab": hp.n_vocab, "n_embd": hp.n_embd,
                     "n_ctx": llama.n_ctx, "n_parallel": llama.n_parallel}}]}

    @app.post("/v1/completions")
    @app.post("/completions")
    async def completions(req: CompletionRequest, request: Request):
        if req.echo or req.suffix is not None:
            raise SynapseError("echo and suffix are not supported")
        job = await _start(req.prompt, req, req.max_tokens, req.logprobs)
        return await _respond(job, CompletionFormat(llama.model_name, req.logprobs is not None, llama.tokenizer),
                              req.stream, request)

    @app.post("/v1/chat/completions")
    @app.post("/chat/completions")
    async def chat_completions(req: ChatRequest, request: Request):
        prompt = llama.apply_chat_template([m.plain() for m in req.messages], True)
        n_lp = (req.top_logprobs or 0) if req.logprobs else None
        mt = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        job = await _start(prompt, req, mt, n_lp)
        return await _respond(job, ChatFormat(llama.model_name, n_lp is not None, llama.tokenizer), req.stream,
                              request)

    @app.post("/completion")
    async def llama_completion(req: LlamaCompletionRequest, request: Request):
        if not 0 <= req.n_probs <= 20:
            raise SynapseError("n_probs must be in [0, 20]")
        job = await _start(req.prompt, req, req.n_predict, req.n_probs if req.n_probs > 0 else None)
        tok = llama.tokenizer

        def probs(toks):
            out = []
            for tid, _, e in toks:
                if e is None:
                    continue
                piece = tok.token_to_piece(tid, special=True).decode("utf-8", "replace")
                out.append({"id": tid, "token": piece, "logprob": e["logprob"],
                            "top_logprobs": [{"id": i, "token": tok.token_to_piece(i, special=True).decode(
                                "utf-8", "replace"), "logprob": p} for i, p in e["top"]]})
            return out

        def final(ev, content):
            _, reason, n_prompt, n_completion, timings = ev
            return {"content": content, "stop": True, "model": llama.model_name, "tokens_predicted": n_completion,
                    "tokens_evaluated": n_prompt, "tokens_cached": timings["cache_n"],
                    "stop_type": {"stop": "eos", "length": "limit"}.get(reason, reason), "timings": timings,
                    "id_slot": job.seq.slot if job.seq is not None else -1}

        if req.stream:
            async def chunks():
                async for ev in _events(job, None):
                    if ev[0] == "text":
                        c = {"content": ev[1], "stop": False}
                        if req.n_probs:
                            c["completion_probabilities"] = probs(ev[2])
                        yield c
                    else:
                        yield final(ev, "")

            async def body():
                async for obj in chunks():
                    yield f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

            return StreamingResponse(body(), media_type="text/event-stream")
        text, toks, res = await _collect(job, request)
        if res is None:
            return Response(status_code=499)
        out = final(res, "".join(text))
        if req.n_probs:
            out["completion_probabilities"] = probs(toks)
        return out

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        ids = llama.tokenizer.tokenize(req.content, add_special=req.add_special, parse_special=req.parse_special)
        if req.with_pieces:
            return {"tokens": [{"id": i, "piece": llama.tokenizer.token_to_piece(i, special=True).decode(
                "utf-8", "replace")} for i in ids]}
        return {"tokens": ids}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        return {"content": llama.detokenize(req.tokens, special=True).decode("utf-8", "replace")}

    @app.post("/apply-template")
    async def apply_template(req: ApplyTemplateRequest):
        return {"prompt": llama.apply_chat_template([m.plain() for m in req.messages], True)}

    @app.get("/props")
    async def props():
        s = llama.sampling
        return {
            "default_generation_settings": {
                "n_ctx": llama.n_ctx, "n_predict": llama.n_predict,
                "params": {"temperature": s["temp"], "top_k": s["top_k"], "top_p": s["top_p"], "min_p": s["min_p"],
                           "seed": s["seed"], "max_tokens": llama.n_predict, "repeat_penalty": s["repeat_penalty"],
                           "repeat_last_n": s["penalty_last_n"]}},
            "total_slots": llama.n_parallel, "model_path": llama.model_path, "model_alias": llama.model_name,
            "chat_template": llama.chat_template or getattr(llama.tokenizer, "chat_template", None) or "",
            "build_info": "synapse_nb", "webui": webui,
        }

    @app.get("/slots")
    async def slots():
        return [{**s, "n_ctx": llama.n_ctx} for s in llama.engine.slots()]

    @app.get("/metrics")
    async def metrics():
        m = llama.metrics
        busy = sum(s["is_processing"] for s in llama.engine.slots())
        lines = [
            "# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.",
            "# TYPE llamacpp:prompt_tokens_total counter", f"llamacpp:prompt_tokens_total {m['prompt_tokens']}",
            "# HELP llamacpp:tokens_predicted_total Number of generation tokens processed.",
            "# TYPE llamacpp:tokens_predicted_total counter",
            f"llamacpp:tokens_predicted_total {m['predicted_tokens']}",
            "# HELP llamacpp:requests_total Number of requests accepted.",
            "# TYPE llamacpp:requests_total counter", f"llamacpp:requests_total {m['requests']}",
            "# HELP llamacpp:requests_processing Number of requests processing.",
            "# TYPE llamacpp:requests_processing gauge", f"llamacpp:requests_processing {busy}",
            "# HELP llamacpp:requests_deferred Number of requests deferred.",
            "# TYPE llamacpp:requests_deferred gauge",
            f"llamacpp:requests_deferred {max(0, llama.engine.active - busy)}",
        ]
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    if webui:
        @app.get("/")
        @app.get("/index.html")
        async def index():
            return HTMLResponse((STATIC / "index.html").read_text(encoding="utf-8"),
                                headers={"Cache-Control": "no-cache"})

    app.add_middleware(_BodyLimit, max_bytes=MAX_BODY_BYTES)  # added last: outside the others
    return app
