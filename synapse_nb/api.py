"""Llama: an API shaped like llama-cpp-python's ``Llama``, over one ParallelSession.

    from synapse_nb import Llama
    llm = Llama("smollm2-135m-instruct-q4_1", n_ctx=2048, n_parallel=4)
    llm.create_completion("The capital of France is", max_tokens=16, temperature=0.8, seed=42)
    llm.create_chat_completion([{"role": "user", "content": "Hi"}], stream=True)   # chunk iterator

Code written for llama-cpp-python moves over by changing the import: the methods take the same
arguments (create_completion, create_chat_completion, __call__, tokenize, detokenize) and return
OpenAI-shaped dicts, or iterators of chunks with stream=True. Unlike llama-cpp-python (one request
at a time behind a lock), several threads may call one Llama at once: each call is a sequence of
the shared engine (synapse_nb.parallel), decoded in the same steps as the others, and its tokens
are those it gets alone (the engine's guarantee), equal to llama-decode's for the same prompt,
options and seed.

Sampling is llama.cpp's chain (synapse_nb.sampling.Sampler), as llama-server samples: a request's
options (OpenAI / llama-server field names, REQUEST_SAMPLING) over the defaults the Llama was made
with (llama.cpp's: temperature 0.8, top_k 40, top_p 0.95, min_p 0.05, seed -1 = random). The
prompt is tokenized as llama-decode tokenizes it (BOS added, special-token text parsed); a chat is
rendered with the GGUF's template (synapse_nb.chat), as llama-decode -cnv renders it.

The server (synapse_nb.server) is a thin HTTP layer over Job, the handle of one request, which
yields its events to a thread (events) or to an asyncio loop (aget).
"""

from __future__ import annotations

import asyncio
import math
import queue
import sys
import threading
import time
import uuid

import numpy as np

from .errors import SynapseError
from .options import DEFAULT_N_BATCH, FIELDS

# Request field (OpenAI / llama-server names) -> Sampler parameter
REQUEST_SAMPLING = FIELDS  # a request's sampling fields -> Sampler keywords, from the one table (synapse_nb.options)
_FIELD_OF = {key: field for field, key in REQUEST_SAMPLING.items()}  # an error names the request's field
MAX_STOP = 4  # stop strings a request may give (OpenAI's limit)
MAX_TOP_LOGPROBS = 20  # OpenAI's limit of top_logprobs


class ServerBusy(SynapseError):
    """The engine's queue is full (HTTP 503)."""


class Job:
    """One request running on the engine: events to the caller, cancel() to stop it.

    Events (tuples): ("text", delta str, [(token id, piece bytes, logprob entry or None)]), as
    text becomes safe to show (a possible start of a stop string is held back), and last
    ("done", finish_reason, n_prompt_tokens, n_completion_tokens, timings). finish_reason:
    "stop" (end-of-generation token or a stop string), "length" (max_tokens or the context
    full), "cancelled", "error".
    """

    def __init__(self, llama, prompt: list, n_logprobs, stop, loop=None):
        self.llama = llama
        self.prompt = prompt
        self.n_logprobs = n_logprobs
        self.stop = [s for s in stop if s]
        self.loop = loop
        self._q = asyncio.Queue() if loop is not None else queue.SimpleQueue()
        self._dec = llama.tokenizer.stream_decoder(special=False)
        self._text = ""  # decoded text so far
        self._sent = 0  # characters of it given to the caller
        self._pending_tokens = []  # tokens whose text is not out yet
        self._stopped_by_string = False
        self.n_completion = 0
        self.t_start = time.perf_counter()
        self.t_first = None
        self.seq = None

    # ---- engine thread
    def _put(self, ev) -> None:
        if self.loop is not None:
            try:
                self.loop.call_soon_threadsafe(self._q.put_nowait, ev)
            except RuntimeError:  # the loop is closed: nobody listens any more
                pass
        else:
            self._q.put(ev)

    def _on_token(self, seq, tok, row) -> None:
        self.seq = seq  # (submit sets it too, maybe after this first call)
        if self.t_first is None:
            self.t_first = time.perf_counter()
        if self._stopped_by_string:
            return
        lp = _logprob_entry(row, tok, self.n_logprobs, self.llama.tokenizer) if self.n_logprobs is not None else None
        if seq.is_eog(tok):
            piece = b""  # not shown, as llama-decode
        else:
            self.n_completion += 1
            piece = self.llama.tokenizer.token_to_piece(tok, special=False)
            self._text += self._dec.push(piece).decode("utf-8")
        self._pending_tokens.append((tok, piece, lp))
        self._emit(final=False)

    def _emit(self, final: bool) -> None:
        """Send the text that can no longer be part of a stop string (all of it when final); cut
        at the first stop string found (OpenAI: the stop string is not returned)."""
        text = self._text
        end = len(text)
        if self.stop:
            start = max(0, self._sent - max(len(s) for s in self.stop))
            hits = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                end = min(hits)
                self._text = text = text[:end]
                self._stopped_by_string = True
                self.seq._cancel = True  # the engine stops it at its next step
            elif not final:
                end -= _held_back(text, self.stop)
        if end > self._sent or (self._pending_tokens and (final or self._stopped_by_string)):
            delta, self._sent = text[self._sent:end], max(end, self._sent)
            toks, self._pending_tokens = self._pending_tokens, []
            self._put(("text", delta, toks))

    def _on_done(self, seq) -> None:
        if not self._stopped_by_string:
            self._text += self._dec.flush().decode("utf-8")
        self._emit(final=True)
        reason = {"eog": "stop", "length": "length", "context": "length"}.get(seq.stop_reason, seq.stop_reason)
        if self._stopped_by_string:
            reason = "stop"
        t_end = time.perf_counter()
        t_first = self.t_first or t_end
        timings = {"prompt_n": len(self.prompt) - seq.n_reused, "cache_n": seq.n_reused,
                   "prompt_ms": 1e3 * (t_first - self.t_start), "predicted_n": self.n_completion,
                   "predicted_ms": 1e3 * (t_end - t_first)}
        self._put(("done", reason, len(self.prompt), self.n_completion, timings))

    # ---- caller
    def cancel(self) -> None:
        """Stop the sequence (a client that went away): its slot is free at the next step."""
        if self.seq is not None:
            self.llama.engine.cancel(self.seq)

    def events(self):
        """The events, in this thread (blocking)."""
        while True:
            ev = self._q.get()
            yield ev
            if ev[0] == "done":
                return

    async def aget(self):
        """The next event, in the asyncio loop given at creation."""
        return await self._q.get()


def _held_back(text: str, stops) -> int:
    """Characters at the end of text that start some stop string (may still become one)."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


def _logprob_entry(row: np.ndarray, tok: int, n_top: int, tokenizer) -> dict:
    """{"id", "token", "bytes", "logprob", "top": [(id, logprob), ...]} of the chosen token: the
    model's log-softmax of the raw logits (in double), as OpenAI reports them."""
    x = row.astype(np.float64)
    m = x.max()
    lse = m + math.log(np.exp(x - m).sum())
    top = []
    if n_top > 0:
        idx = np.argpartition(-x, n_top - 1)[:n_top]
        idx = idx[np.lexsort((idx, -x[idx]))]
        top = [(int(i), float(x[i] - lse)) for i in idx]
    return {"id": int(tok), "logprob": float(x[tok] - lse), "top": top}


class Llama:
    """A model with its engine: up to n_parallel requests decoded at once, n_ctx positions each.

    model_path: GGUF path or models.txt name. n_ctx: context per sequence (default min(n_ctx_train,
    4096); 0: n_ctx_train); n_threads (default: all cores); n_batch: rows per step; n_parallel:
    sequences decoded together (slots); seed: the default seed of requests that give none (-1:
    random per request); n_predict: default max_tokens of a request without one (-1: until the
    context is full); sampling: default Sampler parameters (the CLI's sampling flags); chat_template
    (text) / jinja: as llama-decode's --chat-template-file / --jinja; max_queue: requests waiting for
    a slot beyond which a new one raises ServerBusy (None: unbounded); swa_full: as Session's.
    warmup compiles the kernels
    now. Raises SynapseError for a bad model or option.
    """

    def __init__(self, model_path, *, n_ctx: int | None = None, n_threads: int | None = None,
                 n_batch: int = DEFAULT_N_BATCH,
                 n_parallel: int = 1, seed: int = -1, n_predict: int = -1, sampling: dict | None = None,
                 chat_template: str | None = None, chat_template_origin: str | None = None, jinja: bool = True,
                 max_queue: int | None = None, warmup: bool = True, verbose: bool = False, model=None,
                 grammar: str | None = None, swa_full: bool = False, **ignored):
        from . import engine
        from .parallel import ParallelSession
        from .sampling import DEFAULTS, Sampler

        if model is None:
            model = engine.load_model(model_path)
        self.model = model
        self.tokenizer = model.tokenizer
        self.model_path = str(model.path)
        self.verbose = verbose
        self.engine = ParallelSession(model, n_seq=n_parallel, n_ctx=n_ctx, n_threads=engine.all_cores(n_threads),
                                      n_batch=n_batch, swa_full=swa_full)
        self.n_ctx = self.engine.n_ctx
        self.n_parallel = self.engine.n_seq
        self.n_threads = self.engine.n_threads
        if not isinstance(n_predict, int) or n_predict < -1:
            raise SynapseError(f"n_predict must be >= -1, got {n_predict!r}")
        self.n_predict = n_predict
        self.max_queue = max_queue
        self.sampling = {k: v for k, v in DEFAULTS.items() if not k.startswith("dry")}
        self.sampling.update(sampling or {})
        self.sampling["seed"] = seed if seed is not None else -1
        Sampler(**{**self.sampling, "seed": 0}, n_vocab=model.hparams.n_vocab)  # bad defaults: now
        self.chat_template, self.chat_template_origin, self.jinja = chat_template, chat_template_origin, jinja
        self._grammars: dict = {}  # GBNF text -> compiled Grammar, shared by the requests that use it
        self._grammar_lock = threading.Lock()
        self.default_grammar = grammar or None  # the CLI's --grammar / -j: for requests without their own
        if self.default_grammar is not None:
            self.grammar({})  # a bad grammar fails now; the vocabulary is indexed once, here
        self._render = None
        self.metrics = {"requests": 0, "prompt_tokens": 0, "predicted_tokens": 0, "errors": 0}
        if warmup:
            engine.warm_up(model, all_samplers=True)
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="synapse_nb-engine", daemon=True)
        self._thread.start()

    # ---- the engine's thread
    def _loop(self) -> None:
        while not self._closed:
            if not self.engine.wait_for_work(0.25):
                continue
            try:
                self.engine.step()
            except Exception as e:  # an internal error: the running requests fail, the engine goes on
                print(f"error: engine step failed: {type(e).__name__}: {e}", file=sys.stderr)
                self.metrics["errors"] += 1
                self.engine.abort_all("error")

    def close(self, timeout: float = 10.0) -> None:
        """Cancel what runs and stop the engine's thread."""
        self.engine.abort_all("cancelled")
        self._closed = True
        self._thread.join(timeout)

    # ---- tokens and templates
    def tokenize(self, text: bytes | str, add_bos: bool = True, special: bool = True) -> list[int]:
        """Token ids of text (llama-cpp-python's signature; special: parse special-token text)."""
        if isinstance(text, bytes):
            text = text.decode("utf-8", "replace")
        return self.tokenizer.tokenize(text, add_special=add_bos, parse_special=special)

    def detokenize(self, tokens, special: bool = False) -> bytes:
        """The bytes of the tokens' pieces."""
        n_vocab = self.model.hparams.n_vocab
        out = []
        for t in tokens:
            if not isinstance(t, (int, np.integer)) or isinstance(t, bool) or not 0 <= t < n_vocab:
                raise SynapseError(f"token id {t!r} is outside the vocabulary [0, {n_vocab})")
            out.append(self.tokenizer.token_to_piece(int(t), special=special))
        return b"".join(out)

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> str:
        """The conversation rendered with the model's template (or the one given), as llama-decode -cnv."""
        if self._render is None:
            from .chat import chat_renderer

            self._render = chat_renderer(self.tokenizer, self.chat_template, self.chat_template_origin, self.jinja)
        return self._render(messages, add_generation_prompt)

    # ---- requests
    def _prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.tokenize(prompt, add_special=True, parse_special=True)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
            n_vocab = self.model.hparams.n_vocab
            bad = [t for t in ids if not 0 <= t < n_vocab]
            if bad:
                raise SynapseError(f"prompt: token id {bad[0]} is outside the vocabulary [0, {n_vocab})")
        else:
            raise SynapseError("prompt must be a string or a list of token ids")
        if not ids:
            raise SynapseError("the prompt is empty (no tokens)")
        if len(ids) >= self.n_ctx:
            raise SynapseError(f"the prompt ({len(ids)} tokens) does not fit in the context of a slot "
                               f"(n_ctx = {self.n_ctx}); shorten it")
        return ids

    def grammar(self, options: dict):
        """The GrammarMatcher of a request, or None, from llama-server's fields: "grammar" (GBNF
        text), "json_schema" (a JSON schema; "grammar" wins when both are given, as in
        llama-server's /completion), "response_format" ({"type": "json_object"[, "schema": ...]}
        or {"type": "json_schema", "json_schema": {"schema": ...}}, as llama-server maps it on
        /v1/chat/completions; with "grammar" it is an error). Raises SynapseError for a bad one."""
        from .grammar import Grammar, GrammarMatcher, json_schema_to_grammar

        text = options.get("grammar")
        schema = options.get("json_schema")
        fmt = options.get("response_format")
        if fmt is not None:
            if not isinstance(fmt, dict):
                raise SynapseError("response_format must be an object")
            kind = fmt.get("type", "")
            if kind == "json_object":
                schema = fmt.get("schema", {})
            elif kind == "json_schema":
                wrapper = fmt.get("json_schema", {})
                schema = wrapper.get("schema", {}) if isinstance(wrapper, dict) else {}
            elif kind not in ("", "text"):
                raise SynapseError(f'response_format type must be one of "text" or "json_object", but got: {kind}')
        if fmt is not None and schema is not None and text is not None:
            raise SynapseError("Cannot use both json_schema and grammar")
        if text is None and schema is not None:
            text = json_schema_to_grammar(schema)
        if text is None and schema is None and fmt is None:
            text = self.default_grammar
        if text is not None and not isinstance(text, str):
            raise SynapseError("grammar must be a string (GBNF text)")
        if not text:
            return None
        with self._grammar_lock:
            g = self._grammars.get(text)
            if g is None:
                if len(self._grammars) >= 32:
                    self._grammars.clear()
                g = self._grammars[text] = Grammar(text, tokenizer=self.tokenizer)
            return GrammarMatcher(g, self.tokenizer)

    def sampler(self, options: dict):
        """The Sampler of a request: its options (REQUEST_SAMPLING names, logit_bias) over the defaults,
        with the request's grammar (see grammar())."""
        from .sampling import build_sampler

        params = dict(self.sampling)
        for field, key in REQUEST_SAMPLING.items():
            v = options.get(field)
            if v is not None:
                params[key] = v
        bias = _logit_bias(options.get("logit_bias"), self.model.hparams.n_vocab)
        params["logit_bias"] = list(params.get("logit_bias") or ()) + bias
        # ignore_eos: every end-of-generation token biased to -inf, as llama-server (an EOS or not)
        return build_sampler(params, n_vocab=self.model.hparams.n_vocab, eog_ids=self.tokenizer.eog_ids,
                             ignore_eos=bool(options.get("ignore_eos")), grammar=self.grammar(options),
                             names=_FIELD_OF)

    def submit(self, prompt, *, max_tokens=None, stop=None, logprobs=None, loop=None, **options) -> Job:
        """Start a request: prompt (text or token ids), max_tokens (None: the default n_predict; -1:
        until the context is full), stop (a string or up to 4), logprobs (None, or the number of
        top alternatives per token, 0..20), sampling options (REQUEST_SAMPLING names, logit_bias,
        ignore_eos). loop: an asyncio loop to receive the events in (Job.aget). Raises
        SynapseError for a bad request and ServerBusy when max_queue requests already wait."""
        ids = self._prompt_ids(prompt)
        if max_tokens is None:
            max_tokens = self.n_predict
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < -1:
            raise SynapseError(f"max_tokens must be an integer >= 0 (or -1), got {max_tokens!r}")
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > MAX_STOP or not all(isinstance(s, str) for s in stops):
            raise SynapseError(f"stop must be a string or a list of at most {MAX_STOP} strings")
        if logprobs is not None and (not isinstance(logprobs, int) or not 0 <= logprobs <= MAX_TOP_LOGPROBS):
            raise SynapseError(f"logprobs / top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}]")
        sampler = self.sampler(options)
        if self.max_queue is not None and self.engine.active >= self.n_parallel + self.max_queue:
            raise ServerBusy(f"the server is busy: {self.n_parallel} slots and {self.max_queue} queued requests; "
                             f"try again later")
        job = Job(self, ids, logprobs, stops, loop=loop)
        job.sampler = sampler
        self.metrics["requests"] += 1
        self.metrics["prompt_tokens"] += len(ids)
        n = max_tokens if max_tokens >= 0 else -1
        job.seq = self.engine.add(ids, n, sampler=sampler, on_token=job._on_token, on_done=job._on_done)
        return job

    def _collect(self, job: Job):
        """(text, [token entries], finish_reason, n_prompt, n_completion) of a finished job."""
        text, toks = [], []
        for ev in job.events():
            if ev[0] == "text":
                text.append(ev[1])
                toks.extend(ev[2])
            else:
                self.metrics["predicted_tokens"] += ev[3]
                return "".join(text), toks, ev[1], ev[2], ev[3]

    def create_completion(self, prompt, suffix=None, max_tokens: int | None = 16, temperature: float = 0.8,
                          top_p: float = 0.95, min_p: float = 0.05, typical_p: float = 1.0, logprobs: int | None = None,
                          echo: bool = False, stop=None, frequency_penalty: float = 0.0, presence_penalty: float = 0.0,
                          repeat_penalty: float = 1.0, top_k: int = 40, stream: bool = False, seed: int | None = None,
                          logit_bias=None, **options):
        """A text completion (llama-cpp-python's create_completion; OpenAI's text_completion
        object, or its chunks with stream=True). max_tokens None or <= 0: until the context is
        full. Raises SynapseError for a bad request."""
        if suffix is not None or echo:
            raise SynapseError("suffix and echo are not supported")
        opts = dict(temperature=temperature, top_p=top_p, min_p=min_p, typical_p=typical_p,
                    frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
                    repeat_penalty=repeat_penalty, top_k=top_k, seed=seed, logit_bias=logit_bias, **options)
        return self._respond(prompt, max_tokens, stop, logprobs, CompletionFormat, stream, opts)

    def create_chat_completion(self, messages, max_tokens: int | None = None, temperature: float = 0.8,
                               top_p: float = 0.95, min_p: float = 0.05, typical_p: float = 1.0, stop=None,
                               stream: bool = False, seed: int | None = None, frequency_penalty: float = 0.0,
                               presence_penalty: float = 0.0, repeat_penalty: float = 1.0, top_k: int = 40,
                               logit_bias=None, logprobs: bool | None = None, top_logprobs: int | None = None,
                               **options):
        """A chat completion (llama-cpp-python's create_chat_completion; OpenAI's chat.completion
        object, or chat.completion.chunk dicts with stream=True)."""
        prompt = self.apply_chat_template(messages, True)
        opts = dict(temperature=temperature, top_p=top_p, min_p=min_p, typical_p=typical_p,
                    frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
                    repeat_penalty=repeat_penalty, top_k=top_k, seed=seed, logit_bias=logit_bias, **options)
        n_lp = (top_logprobs or 0) if logprobs else None
        return self._respond(prompt, max_tokens, stop, n_lp, ChatFormat, stream, opts)

    def _respond(self, prompt, max_tokens, stop, n_logprobs, fmt_cls, stream: bool, opts: dict):
        """Submit a request (max_tokens None or <= 0: until the context is full) and return its
        response in fmt_cls's shape: the whole object, or an iterator of chunks with stream."""
        mt = -1 if max_tokens is None or max_tokens <= 0 else max_tokens
        job = self.submit(prompt, max_tokens=mt, stop=stop, logprobs=n_logprobs, **opts)
        fmt = fmt_cls(self.model_name, n_logprobs is not None, self.tokenizer)
        if stream:
            return (c for ev in job.events() for c in fmt.chunks(ev))
        return fmt.whole(self._collect(job))

    def __call__(self, prompt, **kwargs):
        """create_completion(prompt, ...)."""
        return self.create_completion(prompt, **kwargs)

    @property
    def model_name(self) -> str:
        from pathlib import Path

        return Path(self.model_path).name


def _logit_bias(bias, n_vocab: int) -> list:
    """OpenAI's logit_bias ({"token id": bias}) or llama-server's ([[id, bias], ...]; bias false:
    never) as (id, bias) pairs."""
    if bias is None:
        return []
    items = bias.items() if isinstance(bias, dict) else bias
    out = []
    try:
        for k, v in items:
            tok = int(k) if not isinstance(k, bool) else None
            if tok is None or not 0 <= tok < n_vocab:
                raise SynapseError(f"logit_bias: token id {k!r} is outside the vocabulary [0, {n_vocab})")
            b = float("-inf") if v is False else v
            if isinstance(b, bool) or not isinstance(b, (int, float)):
                raise SynapseError(f"logit_bias: the bias of token {k} must be a number")
            out.append((tok, float(b)))
    except (TypeError, ValueError):
        raise SynapseError("logit_bias must map token ids to numbers") from None
    return out


# ---------------------------------------------------------------- OpenAI shapes

class _Format:
    """Builds OpenAI response objects from a Job's events (chunks) or its collected result (whole)."""

    object_whole = object_chunk = prefix = ""

    def __init__(self, model: str, logprobs: bool, tokenizer):
        self.id = f"{self.prefix}-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())
        self.model = model
        self.logprobs = logprobs
        self.tok = tokenizer
        self.started = False

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    @staticmethod
    def usage(n_prompt: int, n_completion: int) -> dict:
        return {"prompt_tokens": n_prompt, "completion_tokens": n_completion, "total_tokens": n_prompt + n_completion}

    def _piece(self, tid: int) -> str:
        return self.tok.token_to_piece(tid, special=True).decode("utf-8", "replace")


class CompletionFormat(_Format):
    object_whole = object_chunk = "text_completion"
    prefix = "cmpl"

    def _lp(self, toks, offset: int = 0):
        if not self.logprobs:
            return None
        entries = [lp for _, _, lp in toks if lp is not None]
        return {"tokens": [self._piece(e["id"]) for e in entries],
                "token_logprobs": [e["logprob"] for e in entries],
                "top_logprobs": [{self._piece(i): p for i, p in e["top"]} for e in entries],
                "text_offset": [offset + i for i in range(len(entries))]}

    def chunks(self, ev):
        if ev[0] == "text":
            return [{**self._head(self.object_chunk),
                     "choices": [{"text": ev[1], "index": 0, "logprobs": self._lp(ev[2]), "finish_reason": None}]}]
        _, reason, n_prompt, n_completion, _ = ev
        return [{**self._head(self.object_chunk),
                 "choices": [{"text": "", "index": 0, "logprobs": None, "finish_reason": reason}],
                 "usage": self.usage(n_prompt, n_completion)}]

    def whole(self, res) -> dict:
        text, toks, reason, n_prompt, n_completion = res
        return {**self._head(self.object_whole),
                "choices": [{"text": text, "index": 0, "logprobs": self._lp(toks), "finish_reason": reason}],
                "usage": self.usage(n_prompt, n_completion)}


class ChatFormat(_Format):
    object_whole, object_chunk = "chat.completion", "chat.completion.chunk"
    prefix = "chatcmpl"

    def _lp(self, toks):
        if not self.logprobs:
            return None

        def item(tid, p):
            s = self._piece(tid)
            return {"token": s, "logprob": p, "bytes": list(s.encode("utf-8"))}

        return {"content": [{**item(e["id"], e["logprob"]), "top_logprobs": [item(i, p) for i, p in e["top"]]}
                            for _, _, e in toks if e is not None]}

    def chunks(self, ev):
        out = []
        if not self.started:
            self.started = True
            out.append({**self._head(self.object_chunk),
                        "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                     "finish_reason": None}]})
        if ev[0] == "text":
            if ev[1] or self.logprobs:
                out.append({**self._head(self.object_chunk),
                            "choices": [{"index": 0, "delta": {"content": ev[1]}, "logprobs": self._lp(ev[2]),
                                         "finish_reason": None}]})
            return out
        _, reason, n_prompt, n_completion, _ = ev
        out.append({**self._head(self.object_chunk),
                    "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": reason}],
                    "usage": self.usage(n_prompt, n_completion)})
        return out

    def whole(self, res) -> dict:
        text, toks, reason, n_prompt, n_completion = res
        return {**self._head(self.object_whole),
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                             "logprobs": self._lp(toks), "finish_reason": reason}],
                "usage": self.usage(n_prompt, n_completion)}
