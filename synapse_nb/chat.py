"""Chat: a GGUF's chat template rendered as llama.cpp renders it, and a conversation loop.

Rendering (what llama.cpp's common/chat.cpp does for `--jinja` and `--no-jinja`):

- render_jinja(template, messages, ...): the template (the GGUF key tokenizer.chat_template, or a
  --chat-template-file) run by jinja2 in an ImmutableSandboxedEnvironment (templates come from
  downloaded files) with llama.cpp's engine settings (trim_blocks, lstrip_blocks, one trailing newline
  of the source dropped, \\r\\n read as \\n) and the variables its Jinja path passes: `messages`,
  `bos_token`, `eos_token` (the BOS/EOS pieces, special text rendered), `enable_thinking` = true,
  `add_generation_prompt` (defined only when true), `datetime` / `date_string` (today), plus the
  globals real templates call (raise_exception, strftime_now, namespace) and an unescaped `tojson`.
  Then llama.cpp's BOS/EOS rule: when the vocabulary adds BOS (add_bos) and the text starts with the
  bos_token text, that prefix is cut (the tokenizer adds the BOS id); likewise a trailing eos_token
  when it adds EOS.
- render_builtin(template, messages, ...): llama_chat_apply_template's built-in formats, picked from
  substrings of the template as llm_chat_detect_template does; only ChatML (`<|im_start|>`) here:
  `<|im_start|>{role}\\n{content}<|im_end|>\\n` per message, `<|im_start|>assistant\\n` when
  add_generation_prompt.

The rendered text is tokenized with add_special=True, parse_special=True (common_tokenize as
llama-completion, llama-cli and llama-server call it): markup typed in a message becomes real
special tokens, as in llama.cpp.

Conversation (llama-server's prompt cache, on the one sequence of a Session): each turn renders the
whole conversation, tokenizes it, keeps the longest prefix already in the KV cache and evaluates only
the rest (from the first differing token, if a reply does not re-tokenize to the tokens generated).
A reply ends at an end-of-generation token, which stays in the history as in llama.cpp (evaluated
with the next turn), at -n tokens, or when the context is full (stop "context"; the history is never
truncated). run_conversation is the CLI's -cnv / -st.

jinja2 is imported only when a template is rendered.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

from .errors import SynapseError

# --------------------------------------------------------------------------------------------- templates


def _template_line(exc: BaseException):
    """Line of the template where a jinja2 error was raised (jinja2 rewrites the traceback so that
    template frames carry the template's own line numbers, filename '<template>')."""
    lineno = getattr(exc, "lineno", None)
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            lineno = tb.tb_lineno
        tb = tb.tb_next
    return lineno


class _TemplateRaised(Exception):
    """raise_exception(message) called by a template."""


def _raise_exception(message=""):
    raise _TemplateRaised(str(message))


def _tojson(value, indent=None, separators=None, sort_keys=False, ensure_ascii=False):
    # Hugging Face's / llama.cpp's tojson: plain JSON, no HTML escaping (jinja2's own escapes <>&').
    return json.dumps(value, indent=indent, separators=separators, sort_keys=sort_keys,
                      ensure_ascii=ensure_ascii)


def _strftime_now(fmt):
    return _dt.datetime.now().strftime(fmt)


# The largest integer result of ** or * in a template, in bits (real templates count messages).
TEMPLATE_INT_BITS = 1 << 16


class _TemplateLimit(Exception):
    """An operation of a template refused for its size (_check_binop)."""


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_binop(operator: str, left, right) -> None:
    """Refuse ** and * of integers whose result would exceed TEMPLATE_INT_BITS (bounded before
    CPython computes it: an integer power or product runs in C, uninterruptible)."""
    if not (_is_int(left) and _is_int(right)):
        return
    a, b = abs(left).bit_length(), abs(right).bit_length()
    if operator == "**":
        if right <= 0 or abs(left) <= 1:
            return  # a float (negative power) or |result| <= 1
        bits = a * right
    else:
        bits = a + b
    if bits > TEMPLATE_INT_BITS:
        what = f"{a}-bit integer to the power {right}" if operator == "**" else f"{a}-bit times {b}-bit integer"
        raise _TemplateLimit(f"{what}: more than {TEMPLATE_INT_BITS} bits")


_ENV = None


def _environment():
    """The one sandboxed jinja2 environment (built on first use; jinja2 imported here)."""
    global _ENV
    if _ENV is None:
        try:
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError:  # pragma: no cover - a dependency of the package
            raise SynapseError("rendering a chat template needs jinja2 (pip install jinja2)") from None
        class _Environment(ImmutableSandboxedEnvironment):
            # ** and * go through call_binop, which refuses huge integers: CPython computes them in C
            # without checking signals, so the time cap could not stop `10 ** 1000000000`. An
            # intercepted operator is also never constant-folded when the template is compiled.
            intercepted_binops = frozenset(["**", "*"])

            def call_binop(self, context, operator, left, right):
                _check_binop(operator, left, right)
                return super().call_binop(context, operator, left, right)

        env = _Environment(trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=False,
                           extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        _ENV = env
    return _ENV


# The address space one rendering may add (strings a template builds, e.g. by doubling one in a
# loop): past it the rendering fails with a one-line error instead of taking the machine's memory.
# Real templates use kilobytes.
RENDER_MEMORY_BYTES = 1 << 30
# The longest one rendering may run (real templates take milliseconds; a downloaded one with
# nested loops could otherwise hang the chat): past it, a one-line error.
RENDER_SECONDS = 10.0
# The largest --chat-template-file read (real templates are a few KiB; GGUF keys hold them whole).
TEMPLATE_FILE_BYTES = 1 << 20


class _RenderTimeout(Exception):
    pass


@contextmanager
def _time_cap(seconds: float):
    """Raise _RenderTimeout in the block once it has run `seconds` (SIGALRM, ITIMER_REAL). Only in
    the main thread and when no other real-time timer is set; elsewhere nothing is limited."""
    import signal
    import threading

    if (threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer")
            or signal.getitimer(signal.ITIMER_REAL)[0] > 0):
        yield
        return

    def expired(signum, frame):
        raise _RenderTimeout()

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _address_space() -> int | None:
    """This process's mapped address space in bytes (Linux /proc/self/statm), None elsewhere."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


@contextmanager
def _memory_cap(extra: int):
    """Limit this process's address space (RLIMIT_AS) to its current size + extra bytes for the
    block, so that a runaway allocation raises MemoryError; the limit is restored after. Nothing
    is limited where RLIMIT_AS or /proc/self/statm is missing, or a tighter limit is already set."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not Linux
        yield
        return
    now = _address_space()
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = None if now is None else now + extra
    if cap is not None and hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    if cap is None or (soft != resource.RLIM_INFINITY and soft <= cap):
        yield
        return
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


class ChatTemplate:
    """A Jinja chat template and where it came from (for error messages).

    source: the template text (str). origin: e.g. "model.gguf (tokenizer.chat_template)" or the
    --chat-template-file path. compile() parses it (cached); render(variables) runs it.
    Errors: SynapseError "chat template of ORIGIN, line N: ..." for a syntax error, a render
    error (undefined variable, type error, the template's raise_exception), a sandbox violation,
    or a rendering that needs more than RENDER_MEMORY_BYTES of memory or RENDER_SECONDS.
    """

    def __init__(self, source: str, origin: str):
        if not isinstance(source, str):
            raise SynapseError(f"chat template of {origin}: not a string")
        self.source = source.replace("\r\n", "\n")
        self.origin = origin
        self._compiled = None

    def _error(self, exc: BaseException, what: str) -> SynapseError:
        line = _template_line(exc)
        where = f", line {line}" if line else ""
        msg = getattr(exc, "message", None) or str(exc) or type(exc).__name__
        return SynapseError(f"chat template of {self.origin}{where}: {what}: {msg}")

    def _limited(self, fn, doing: str):
        """fn() under the memory and time caps of a rendering; the ways a template can fail, as
        SynapseError. doing: "compiling" or "rendering" (for the messages)."""
        try:
            with _memory_cap(RENDER_MEMORY_BYTES), _time_cap(RENDER_SECONDS):
                return fn()
        except MemoryError:
            raise SynapseError(f"chat template of {self.origin}: {doing} it needs more than "
                               f"{RENDER_MEMORY_BYTES >> 20} MiB of memory") from None
        except _RenderTimeout:
            raise SynapseError(f"chat template of {self.origin}: {doing} it takes more than "
                               f"{RENDER_SECONDS:g} s") from None
        except _TemplateRaised as e:
            raise self._error(e, "raise_exception") from None
        except _TemplateLimit as e:
            raise self._error(e, "too large") from None
        except RecursionError as e:
            raise self._error(e, "nested too deeply" if doing == "compiling" else "recursion too deep") from None
        except Exception as e:  # jinja2.TemplateError, SecurityError, TypeError, ... from the template
            import jinja2

            if isinstance(e, jinja2.TemplateSyntaxError):
                raise self._error(e, "syntax error") from None
            what = "cannot compile" if doing == "compiling" else "cannot render"
            raise self._error(e, f"{what} ({type(e).__name__})") from None

    def compile(self):
        """Parse the template (once), under the same memory and time caps as a rendering (jinja2
        evaluates constant expressions while compiling). Raises SynapseError on a syntax error
        (naming its line), a template nested too deeply, or one past the caps."""
        if self._compiled is None:
            env = _environment()
            self._compiled = self._limited(lambda: env.from_string(self.source), "compiling")
        return self._compiled

    def render(self, variables: dict) -> str:
        """The template rendered with `variables`. Raises SynapseError naming the template line."""
        tmpl = self.compile()
        return self._limited(lambda: tmpl.render(**variables), "rendering")


def check_messages(messages) -> list[dict]:
    """messages as llama.cpp passes them: a list of dicts with str `role` and str `content`
    (other keys, e.g. tool_calls, kept as given). Returns plain copies. Raises SynapseError."""
    if not isinstance(messages, (list, tuple)):
        raise SynapseError("chat messages must be a list of {'role': ..., 'content': ...} dicts")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise SynapseError(f"chat message {i}: must be a dict with a string 'role'")
        content = m.get("content", "")
        if content is None:
            content = ""  # llama.cpp passes an empty content as ""
        if not isinstance(content, str):
            raise SynapseError(f"chat message {i}: 'content' must be a string")
        d = dict(m)
        d["content"] = content
        out.append(d)
    return out


def render_jinja(template: ChatTemplate, messages, add_generation_prompt: bool = True, bos_token: str = "",
                 eos_token: str = "", add_bos: bool = False, add_eos: bool = False) -> str:
    """common_chat_templates_apply with use_jinja=true: the template rendered with llama.cpp's
    variables, then the BOS/EOS prefix/suffix rule (see the module docstring). Returns str."""
    msgs = check_messages(messages)
    today = _dt.date.today()
    variables = {
        "messages": msgs,
        "bos_token": bos_token,
        "eos_token": eos_token,
        "enable_thinking": True,
        "datetime": today.strftime("%b %d %Y"),
        "date_string": today.strftime("%d %b %Y"),
    }
    if add_generation_prompt:  # llama.cpp leaves it undefined when false
        variables["add_generation_prompt"] = True
    text = template.render(variables)
    if add_bos and bos_token and text.startswith(bos_token):
        text = text[len(bos_token):]
    if add_eos and eos_token and text.endswith(eos_token):
        text = text[:-len(eos_token)]
    return text


def builtin_family(template_source: str) -> str | None:
    """llm_chat_detect_template, for the one built-in family supported here: "chatml" when the
    template contains <|im_start|> (and not the Phi-4 / SmolVLM markers llama.cpp checks first), else None."""
    if "<|im_start|>" in template_source and "<|im_sep|>" not in template_source \
            and "<end_of_utterance>" not in template_source:
        return "chatml"
    return None


def render_builtin(template_source: str, messages, add_generation_prompt: bool = True, origin: str = "") -> str:
    """llama_chat_apply_template (the --no-jinja path): the template is not run, its family is
    detected from substrings. Only ChatML is built in; another family raises SynapseError."""
    if builtin_family(template_source) != "chatml":
        raise SynapseError(f"chat template of {origin}: --no-jinja knows only the ChatML format (<|im_start|>) "
                           f"here; use --jinja to run the template itself")
    parts = [f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in check_messages(messages)]
    if add_generation_prompt:
        parts.append("<|im_start|>assistant\n")
    return "".join(parts)


def apply_chat_template(tokenizer, messages, add_generation_prompt: bool = True, chat_template: str | None = None,
                        jinja: bool = True, origin: str | None = None) -> str:
    """The conversation `messages` rendered by `tokenizer`'s template, as llama.cpp renders it.

    tokenizer: a synapse_nb Tokenizer (its chat_template, BOS/EOS pieces and add_bos/add_eos are
    used). chat_template: another template's text instead of the GGUF's (origin names it in errors).
    jinja: True runs the template (llama.cpp --jinja), False uses the built-in format (--no-jinja).
    Returns the prompt text (tokenize it with add_special=True, parse_special=True).
    Raises SynapseError when there is no template, or it fails to parse or render.
    """
    tmpl = chat_template_of(tokenizer, chat_template, origin)
    if not jinja:
        return render_builtin(tmpl.source, messages, add_generation_prompt, tmpl.origin)
    return render_jinja(tmpl, messages, add_generation_prompt, *special_texts(tokenizer),
                        add_bos=tokenizer.add_bos, add_eos=tokenizer.add_eos)


def special_texts(tokenizer) -> tuple[str, str]:
    """(bos_token, eos_token): the pieces of the vocabulary's BOS/EOS ids, special text rendered
    (common_token_to_piece(vocab, id, true)); "" for a missing id."""
    out = []
    for tid in (tokenizer.bos_id, tokenizer.eos_id):
        ok = tid is not None and 0 <= tid < tokenizer.n_vocab
        out.append(tokenizer.token_to_piece(tid, special=True).decode("utf-8", "replace") if ok else "")
    return out[0], out[1]


# llama.cpp's fallback for a model without a chat template (common/chat.cpp CHATML_TEMPLATE_SRC,
# taken by common_chat_templates_init when the GGUF has none or its template is the string "chatml")
CHATML_TEMPLATE_SRC = (
    "{%- for message in messages -%}\n"
    "  {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' -}}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "  {{- '<|im_start|>assistant\n' -}}\n"
    "{%- endif -%}"
)


def has_chat_template(tokenizer) -> bool:
    """Whether the GGUF has its own chat template (llama.cpp's common_chat_templates_was_explicit):
    without one, chat_template_of falls back to ChatML, as llama.cpp does."""
    src = getattr(tokenizer, "chat_template", None)
    return src is not None and src != "" and src != "chatml"


def chat_template_of(tokenizer, chat_template: str | None = None, origin: str | None = None) -> ChatTemplate:
    """The ChatTemplate to use: `chat_template` (an override's text) or the tokenizer's GGUF template
    (cached on the tokenizer); for a GGUF without one (or whose template is the string "chatml"),
    llama.cpp's ChatML fallback (CHATML_TEMPLATE_SRC), as common_chat_templates_init picks it."""
    if chat_template is not None:
        return ChatTemplate(chat_template, origin or "the given template")
    src = getattr(tokenizer, "chat_template", None)
    name = getattr(tokenizer, "source_name", "") or "the model"
    if not has_chat_template(tokenizer):
        return ChatTemplate(CHATML_TEMPLATE_SRC, f"llama.cpp's ChatML fallback ({name} has no chat template)")
    cached = getattr(tokenizer, "_chat_template_obj", None)
    if cached is not None and cached[0] is src:  # parsed once per template text
        return cached[1]
    tmpl = ChatTemplate(src, f"{name} (tokenizer.chat_template)")
    tokenizer._chat_template_obj = (src, tmpl)
    return tmpl


def chat_renderer(tokenizer, chat_template: str | None = None, origin: str | None = None, jinja: bool = True,
                  system_prompt: str | None = None):
    """render(messages, add_generation_prompt) -> str for a conversation with `tokenizer`, checked up
    front: the template exists, parses, and renders a first turn ([system_prompt,] user) without
    error, so that a bad template is reported before the model is warmed up.
    Raises SynapseError (no template: names --chat-template-file; bad template: names its line)."""
    tmpl = chat_template_of(tokenizer, chat_template, origin)
    if jinja:
        bos, eos = special_texts(tokenizer)

        def render(msgs, add_gen):
            return render_jinja(tmpl, msgs, add_gen, bos, eos, add_bos=tokenizer.add_bos, add_eos=tokenizer.add_eos)
    else:
        def render(msgs, add_gen):
            return render_builtin(tmpl.source, msgs, add_gen, tmpl.origin)

    trial = ([{"role": "system", "content": system_prompt}] if system_prompt is not None else [])
    render(trial + [{"role": "user", "content": "Hello"}], True)
    return render


def read_template_file(path: str) -> str:
    """--chat-template-file: the file's text (UTF-8, at most TEMPLATE_FILE_BYTES). Raises
    SynapseError naming the file (also for a device or a FIFO: only regular files are read)."""
    from .inputs import check_regular_file

    check_regular_file(path, "--chat-template-file")
    try:
        with open(path, "rb") as f:
            data = f.read(TEMPLATE_FILE_BYTES + 1)
    except OSError as e:
        raise SynapseError(f"--chat-template-file {path}: {e.strerror}") from None
    if len(data) > TEMPLATE_FILE_BYTES:
        raise SynapseError(f"--chat-template-file {path}: larger than {TEMPLATE_FILE_BYTES >> 20} MiB; not a chat "
                           f"template")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SynapseError(f"--chat-template-file {path}: not valid UTF-8 (offset {e.start})") from None


# ------------------------------------------------------------------------------------------ conversation


@dataclass
class TurnResult:
    """One reply. prompt_tokens: the whole rendered conversation's tokens for this turn; n_reused:
    of them, the prefix already in the KV cache; n_evaluated: tokens evaluated before the reply
    (len(prompt_tokens) - n_reused); tokens: the generated ids (an end-of-generation token last
    when stop == "eog"); text: the reply (special tokens not rendered); stop: "eog", "length",
    "context" or "interrupted"; n_past: cache positions after the reply; prompt_ms, eval_ms:
    wall time of the prompt evaluation and of the generation; n_decoded: single-token evaluations."""

    prompt_tokens: list[int]
    n_reused: int
    n_evaluated: int
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    stop: str = "length"
    n_past: int = 0
    prompt_ms: float = 0.0
    eval_ms: float = 0.0
    n_decoded: int = 0


class Conversation:
    """A chat held on one Session: the messages so far and the tokens in its KV cache.

    session: a synapse_nb Session (its cache is used from position 0 on; it is rewound when the
    rendered conversation stops matching what it holds). render(messages, add_generation_prompt)
    -> str renders the conversation (chat_renderer(tokenizer) gives llama.cpp's rendering).
    system_prompt: an optional first system message; ignore_eos: replies do not end at
    end-of-generation tokens. Attributes: messages (the history, [{"role", "content"}]), cached
    (the token ids in the KV cache, len == session.n_past).
    """

    def __init__(self, session, render, system_prompt: str | None = None, ignore_eos: bool = False,
                 sampler=None, grammar=None):
        self.session = session
        self.sampler = sampler  # None: greedy; else a synapse_nb.Sampler (llama.cpp's chain)
        # a synapse_nb.grammar.GrammarMatcher constraining every reply (from its start), or None;
        # with a sampler, the sampler's own (sampler.grammar)
        self.grammar = grammar if sampler is None else getattr(sampler, "grammar", None)
        self.tokenizer = session.model.tokenizer
        self.render = render
        self.ignore_eos = ignore_eos
        self.messages: list[dict] = []
        if system_prompt is not None:
            self.messages.append({"role": "system", "content": system_prompt})
        self.cached: list[int] = []  # the tokens in the KV cache, len == session.n_past
        self._byte_limit = None  # the most bytes a rendering can have and fit in n_ctx (prompt_tokens)
        session.reset()

    def prompt_tokens(self, user_text: str) -> list[int]:
        """The conversation with a new user turn, rendered with the generation prompt, as token ids.
        Raises SynapseError, before tokenizing, when the rendering has more bytes than n_ctx tokens
        can hold (synapse_nb.inputs.prompt_byte_limit, as for a -f prompt)."""
        text = self.render(self.messages + [{"role": "user", "content": user_text}], True)
        if self._byte_limit is None:
            from .inputs import prompt_byte_limit

            self._byte_limit = prompt_byte_limit(self.tokenizer, self.session.n_ctx)
        # a str has at most 4 UTF-8 bytes per character: the encoding is only needed near the limit
        if len(text) > self._byte_limit // 4 and len(text.encode("utf-8", "surrogatepass")) > self._byte_limit:
            raise SynapseError(f"the conversation with this turn renders to more than {self._byte_limit} bytes, more "
                               f"than the context (n_ctx = {self.session.n_ctx} tokens) can hold; start a new "
                               f"conversation, raise -c/--ctx-size, or check the chat template")
        return self.tokenizer.tokenize(text, add_special=True, parse_special=True)

    def check_fits(self, full: list[int]) -> None:
        """Raise SynapseError unless the rendered conversation `full` (token ids) leaves at least
        one context position for the reply."""
        if len(full) >= self.session.n_ctx:
            raise SynapseError(f"the conversation with this turn is {len(full)} tokens, it does not fit in the "
                               f"context (n_ctx = {self.session.n_ctx}); start a new conversation or raise "
                               f"-c/--ctx-size")

    def reply(self, user_text: str, n_predict: int = -1, on_piece=None, prompt_batch: int | None = None) -> TurnResult:
        """Add a user turn, evaluate the tokens not cached yet, generate the reply greedily.

        n_predict: most tokens to generate (< 0: no limit but the context). on_piece(bytes) gets
        the reply's text as it comes (whole UTF-8 characters). prompt_batch: evaluate the new
        tokens this many at a time (None: the session's batches; the logits are the same either
        way, a sequence's bits not depending on its batches). A KeyboardInterrupt during the reply
        stops it (stop "interrupted"); what was generated stays in the history.
        Raises SynapseError when the conversation with this turn does not fit in the context (at
        least one free position is needed for the reply); the turn is then not added.
        """
        s = self.session
        full = self.prompt_tokens(user_text)
        if not full:
            raise SynapseError("the chat template rendered the conversation as an empty prompt (no tokens)")
        n_ctx = s.n_ctx
        self.check_fits(full)
        k = 0
        lim = min(len(self.cached), len(full))
        while k < lim and self.cached[k] == full[k]:
            k += 1
        if k == len(full):
            k -= 1  # everything cached: re-evaluate the last token for its logits
        s.truncate(k)
        self.messages.append({"role": "user", "content": user_text})
        res = TurnResult(prompt_tokens=full, n_reused=k, n_evaluated=len(full) - k)
        evaluated = list(full)  # the cache's tokens in order: the prompt, then each reply token decoded
        gen = res.tokens
        stream = self.tokenizer.stream_decoder(special=False)
        res.stop = None
        t0 = t1 = time.perf_counter()
        try:
            step = prompt_batch or len(full) - k
            for i in range(k, len(full), step):
                logits = s.eval(full[i:i + step])
            t1 = time.perf_counter()
            if self.sampler is not None:  # as llama-completion: the turn's input tokens fill the penalty window
                self.sampler.accept_many(full[k:])
            if self.grammar is not None:
                self.grammar.reset()  # each reply follows the grammar from its start
            # llama-completion stops when n_past + 1 >= n_ctx: the last position stays free, and the
            # token chosen from the logits before it is the reply's last.
            room = n_ctx - s.n_past
            cap = room if n_predict < 0 else min(n_predict, room)
            eog = s.eog_ids(self.ignore_eos)

            def on_logits(_row):
                evaluated.append(gen[-1])
                res.n_decoded += 1

            for tok in s.greedy_tokens(logits, cap, self.ignore_eos, on_logits=on_logits, sampler=self.sampler,
                                       grammar=self.grammar if self.sampler is None else None):
                gen.append(tok)
                if tok in eog:
                    res.stop = "eog"
                    break
                piece = stream.push(self.tokenizer.token_to_piece(tok, special=False))
                if piece and on_piece is not None:
                    on_piece(piece)
            if res.stop is None:
                res.stop = "length" if 0 <= n_predict <= len(gen) else "context"
        except KeyboardInterrupt:
            res.stop = "interrupted"
        finally:
            # Evaluation is in order and n_past counts complete batches only, so the cache holds the
            # first n_past tokens of `evaluated`, even after an interrupt.
            self.cached = evaluated[:s.n_past]
            t2 = time.perf_counter()
            res.prompt_ms = 1e3 * (t1 - t0)
            res.eval_ms = 1e3 * (t2 - t1)
        tail = stream.flush()
        if tail and on_piece is not None:
            on_piece(tail)
        # As llama.cpp's assistant_ss: the reply's pieces (special=false) without the end-of-generation token.
        res.text = self.tokenizer.detokenize(gen[:-1] if res.stop == "eog" else gen, special=False)
        res.n_past = s.n_past
        self.messages.append({"role": "assistant", "content": res.text})
        return res


def _read_turn(prompt_on_tty: bool, limit: int | None = None):
    """One user turn from standard input: a line without its newline, or None at EOF.
    On a terminal the prompt "> " is shown (stdout when it is the terminal too, else stderr).
    limit: most bytes a line may have (synapse_nb.inputs.prompt_byte_limit); a longer line (or
    endless input without a newline, such as /dev/zero) raises SynapseError once limit + 1 bytes
    are read."""
    if sys.stdin is None:  # started with stdin closed: no turns
        return None
    if prompt_on_tty and sys.stdin.isatty():
        if sys.stdout.isatty():
            try:
                import readline  # noqa: F401  line editing and history; input() then prompts on stdout
            except ImportError:  # without it CPython writes input()'s prompt to stderr
                sys.stdout.write("> ")
                sys.stdout.flush()
                prompt = ""
            else:
                prompt = "> "
            try:
                return input(prompt)
            except EOFError:
                return None
        sys.stderr.write("> ")
        sys.stderr.flush()
    line = sys.stdin.buffer.readline(-1 if limit is None else limit + 1)
    if not line:
        return None
    if limit is not None and len(line) > limit and not (len(line) == limit + 1 and line.endswith(b"\n")):
        raise SynapseError(f"standard input: a turn longer than {limit} bytes cannot fit in the context "
                           f"(n_ctx tokens); nothing was read past that")
    if line.endswith(b"\n"):
        line = line[:-1]
        if line.endswith(b"\r"):
            line = line[:-1]
    try:
        return line.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SynapseError(f"standard input: not valid UTF-8 (byte offset {e.start} of the line)") from None


def _turn_timings(res: TurnResult, run_wide: dict | None) -> dict:
    """A turn's JSON timings, with the keys of the completion --json: load_ms, compile_ms (run-wide,
    when given), prompt_ms, prompt_tokens_per_s, eval_ms, eval_tokens_per_s, n_threads."""
    from .timings import timings

    run_wide = run_wide or {}
    out = {k: run_wide[k] for k in ("load_ms", "compile_ms") if k in run_wide}
    out.update(timings(res.n_evaluated, res.prompt_ms / 1e3, res.n_decoded, res.eval_ms / 1e3,
                       run_wide.get("n_threads")))
    if "n_threads" not in run_wide:
        del out["n_threads"]
    return out


def run_conversation(model, session, *, first_user: str | None = None, system_prompt: str | None = None,
                     single_turn: bool = False, n_predict: int = -1, jinja: bool = True,
                     chat_template: str | None = None, template_origin: str | None = None,
                     ignore_eos: bool = False, as_json: bool = False, verbose: bool = False,
                     log=None, warmup=None, sampler=None, grammar=None, timings: dict | None = None) -> int:
    """The CLI's -cnv (conversation) and -st (single turn); returns the exit status.

    Turns: first_user (PROMPT/-p/-f) if given, then one line of standard input per turn ("> " on a
    terminal), until EOF or "/exit" (exit 0); with single_turn, only the first turn (read from stdin
    when first_user is None). Replies stream to stdout (a newline after each); with as_json, one JSON
    object per turn instead (model, prompt_tokens: the rendered conversation's ids, tokens, text, stop,
    n_reused, n_evaluated, n_past, timings, and seed when sampling). Ctrl-C stops the current reply;
    Ctrl-C at the prompt raises KeyboardInterrupt (the CLI exits 130). log(str) writes stderr lines; verbose logs each
    turn's cache reuse. warmup(n_prompt), if given, is called once the template and a given first
    turn are checked, before anything is evaluated (the CLI compiles the kernels there); n_prompt
    is the first turn's prompt length when it is the run's only turn (single_turn and first_user),
    else None, and it returns the batch size to evaluate that prompt in (None: the session's).
    sampler: a
    synapse_nb.Sampler for sampled replies (None: greedy); each turn's new input tokens are passed
    to its accept before the reply, as llama-completion does. timings: run-wide entries (the CLI's
    load_ms, compile_ms, n_threads, as its completion --json has them) added to each turn's JSON
    timings; read when a turn is printed (warmup may fill compile_ms). Raises SynapseError for
    a missing/bad template or a turn that does not fit.
    """
    tok = model.tokenizer
    log = log or (lambda m: (sys.stderr.write(m + "\n"), sys.stderr.flush()))
    render = chat_renderer(tok, chat_template, template_origin, jinja, system_prompt)
    conv = Conversation(session, render, system_prompt, ignore_eos=ignore_eos, sampler=sampler, grammar=grammar)
    n_first = first_batch = None
    if first_user is not None:
        first = conv.prompt_tokens(first_user)
        conv.check_fits(first)  # before the wait for the kernels
        n_first = len(first) if single_turn else None
    if warmup is not None:
        first_batch = warmup(n_first)
    out = sys.stdout.buffer

    def on_piece(b):
        out.write(b)
        out.flush()

    from .inputs import prompt_byte_limit

    turn_limit = prompt_byte_limit(tok, session.n_ctx)
    totals = {"prompt_ms": 0.0, "n_prompt": 0, "eval_ms": 0.0, "n_decoded": 0}
    turn = 0
    pending = first_user
    while True:
        if pending is None:
            if single_turn and turn:
                break
            tty = sys.stdin is not None and sys.stdin.isatty()
            text = _read_turn(prompt_on_tty=not as_json or tty, limit=turn_limit)
            if text is None:
                if tty and sys.stdout.isatty():
                    out.write(b"\n")
                    out.flush()
                break
            if text.strip() == "/exit":
                break
            if text == "":
                continue
        else:
            text, pending = pending, None
        turn += 1
        res = conv.reply(text, n_predict, on_piece=None if as_json else on_piece,
                         prompt_batch=first_batch if turn == 1 else None)
        totals["prompt_ms"] += res.prompt_ms
        totals["n_prompt"] += res.n_evaluated
        totals["eval_ms"] += res.eval_ms
        totals["n_decoded"] += res.n_decoded
        if as_json:
            out.write((json.dumps({
                "model": str(model.path), "turn": turn, "prompt_tokens": res.prompt_tokens, "tokens": res.tokens,
                "text": res.text, "stop": res.stop, "n_reused": res.n_reused, "n_evaluated": res.n_evaluated,
                "n_past": res.n_past,
                "timings": _turn_timings(res, timings),
                **({"seed": sampler.seed} if sampler is not None else {}),
            }) + "\n").encode())
        else:
            out.write(b"\n")
        out.flush()
        if verbose:
            log(f"chat: turn {turn}: {len(res.prompt_tokens)} prompt tokens, {res.n_reused} reused from the cache, "
                f"{res.n_evaluated} evaluated; {len(res.tokens)} generated, stop {res.stop}; n_past {res.n_past}")
        if res.stop == "context":
            log(f"chat: context full (n_ctx {session.n_ctx}): reply stopped")
    pm, em = totals["prompt_ms"], totals["eval_ms"]
    log(f"prompt eval time = {pm:10.2f} ms / {totals['n_prompt']:5d} tokens"
        f" ({(totals['n_prompt'] / (pm / 1e3)) if pm > 0 else 0:8.2f} tokens per second)")
    log(f"       eval time = {em:10.2f} ms / {totals['n_decoded']:5d} runs  "
        f" ({(totals['n_decoded'] / (em / 1e3)) if em > 0 and totals['n_decoded'] else 0:8.2f} tokens per second)")
    log(f"chat: {turn} turn{'s' if turn != 1 else ''}")
    return 0
