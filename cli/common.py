"""What every llama-decode mode shares: exit codes, stderr logging, the integer option type, the
prompt's reading (escapes, token lists, files, stdin), the grammar, and the compile notice.

Start-up stays light: at import time only synapse_nb.errors and synapse_nb.options (pure Python)
are loaded; the library (NumPy, Numba) is imported inside the functions that need it.
"""

from __future__ import annotations

import re
import sys
import threading
import time

import click

from synapse_nb.errors import SynapseError, one_line
from synapse_nb.options import I32_MAX, I32_MIN

EXIT_BAD_INPUT = 2
EXIT_INTERNAL = 1
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143  # SIGTERM


def log(msg: str, end: str = "\n") -> None:
    if sys.stderr is None:
        return
    try:
        sys.stderr.write(msg + end)
        sys.stderr.flush()
    except OSError:  # stderr on a full device or closed: logs are not worth failing the run for
        pass




class AtLeast(click.ParamType):
    """An integer option with a lower bound and an upper one (default: int32's, the type of llama.cpp's
    option and of the kernels' counts), checked where click parses it (one place for every mode:
    completion, chat, batch, perplexity): outside is the one-line usage error "must be >= MIN" or
    "must be <= MAX". Every integer option of the command has one."""

    name = "integer"

    def __init__(self, minimum: int, note: str = "", maximum: int = I32_MAX):
        self.minimum, self.note, self.maximum = minimum, note, maximum

    def convert(self, value, param, ctx):
        v = click.INT.convert(value, param, ctx)
        hint = "/".join(param.opts) if param is not None else None
        if v < self.minimum:  # named as the checks did: "Invalid value for -b/--batch-size: ..."
            raise click.BadParameter(f"must be >= {self.minimum}{self.note}", ctx=ctx, param_hint=hint)
        if v > self.maximum:
            raise click.BadParameter(f"must be <= {self.maximum}", ctx=ctx, param_hint=hint)
        return v


COUNT = AtLeast(1)
INT32 = AtLeast(I32_MIN)


def given(name: str) -> bool:
    """Whether the command line gave option `name` (not its default)."""
    return click.get_current_context().get_parameter_source(name) != click.core.ParameterSource.DEFAULT


def prompt_n_batch(model, n_prompt: int, n_batch: int, verbose: bool) -> int:
    """The batch size for a prompt of n_prompt tokens: n_batch when -b was given, else the engine's
    choice (engine.prompt_n_batch: token by token on a first run), which -v logs."""
    if given("n_batch"):
        return n_batch
    from synapse_nb import engine

    chosen = engine.prompt_n_batch(model, n_prompt, n_batch)
    if verbose and chosen != n_batch:
        log("the prompt is evaluated token by token (the batched forward's kernels are not compiled yet)")
    return chosen


def parse_token_list(text: str) -> list[int]:
    # ids (ASCII digits) separated by one comma and/or whitespace; "1 2" is two ids, never 12
    items = re.split(r"\s*,\s*|\s+", text.strip())
    if items == [""]:
        raise click.BadParameter("empty token list", param_hint="--tokens")
    if not all(re.fullmatch(r"[+-]?[0-9]+", t) for t in items):
        raise click.BadParameter(f"not a comma-separated list of integers: {one_line(text, 80)!r}",
                                 param_hint="--tokens")
    long = next((t for t in items if len(t.lstrip("+-")) > 18), None)  # past int64 (and int()'s digit limit)
    if long is not None:
        raise click.BadParameter(f"token id {long[:20]}... ({len(long)} digits) is outside the vocabulary",
                                 param_hint="--tokens")
    return [int(t) for t in items]


def decode_utf8(data: bytes, what: str) -> str:
    """The prompt bytes as text; invalid UTF-8 is an error naming the source and the byte offset
    (not silently replaced: the model would see U+FFFD where the user meant something else)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SynapseError(f"{what}: not valid UTF-8 (byte {data[e.start]:#04x} at offset {e.start}: {e.reason})") \
            from None


def read_prompt(prompt: str | None, file: str | None, limit: int, n_ctx: int) -> str:
    # Files and stdin are read up to `limit` bytes (synapse_nb.inputs): `-f /dev/zero` fails at once.
    from synapse_nb.inputs import read_bounded

    if file is not None and prompt is not None:
        raise click.UsageError("give the prompt either as an argument or with -f/--file, not both")
    if file is not None:
        try:
            with open(file, "rb") as f:
                data = read_bounded(f, limit, f"-f/--file {file}", n_ctx)
        except OSError as e:
            raise click.BadParameter(f"{file}: {e.strerror}", param_hint="-f/--file")
        return decode_utf8(data, f"-f/--file {file}")
    if prompt == "-":
        if sys.stdin is None:
            raise click.BadParameter("standard input is closed", param_hint="PROMPT '-'")
        return decode_utf8(read_bounded(sys.stdin.buffer, limit, "standard input", n_ctx), "standard input")
    return prompt if prompt is not None else ""


class Compiling:
    """stderr notice while kernels compile (a first run, or after the package changed).

    Loading kernels from Numba's cache compiles nothing and prints nothing: the notice is
    shown only once a real compilation (synapse_nb.jit) has run for 0.5 s (at once with
    -v). On a terminal the line is redrawn per warm-up step; into a file it is one line at the
    start and one at the end. Use as a context manager around the warm-up; call it with
    (done, total, name) per step.
    """

    DELAY_S = 0.5

    def __init__(self, verbose: bool):
        self.verbose = verbose
        self.tty = sys.stderr.isatty()
        self.shown = False
        self.compiles = 0
        self.step = (0, 1, "")
        self.timer = None
        self.lock = threading.Lock()
        self.t0 = time.perf_counter()
        self._watch = None

    def __enter__(self):
        from synapse_nb.jit import watch_compiles

        self._watch = watch_compiles(self._on_compile)
        self._watch.__enter__()
        return self

    def __exit__(self, *exc):
        self._watch.__exit__(*exc)
        if self.timer is not None:
            self.timer.cancel()
        with self.lock:
            if self.shown and exc[0] is None:
                log(("\r" if self.tty else "") + "compiling kernels, first run only: done in "
                     f"{time.perf_counter() - self.t0:.1f} s" + ("\x1b[K" if self.tty else ""))
            elif self.shown and self.tty:
                log("")
        return False

    def _on_compile(self, name: str) -> None:
        self.compiles += 1
        if self.shown or self.timer is not None:
            return
        if self.verbose:
            self._show()
        else:
            self.timer = threading.Timer(self.DELAY_S, self._show)
            self.timer.daemon = True
            self.timer.start()

    def _show(self) -> None:
        with self.lock:
            done, total, name = self.step
            if self.tty:
                log(f"\rcompiling kernels, first run only: step {done + 1}/{total}, {name}...\x1b[K", end="")
            elif not self.shown:
                log("compiling kernels, first run only...")
            self.shown = True

    def __call__(self, done: int, total: int, name: str) -> None:
        self.step = (done, total, name)
        if self.shown and self.tty and done < total:
            self._show()


def grammar_text(grammar_opts):
    """The GBNF text of --grammar / --grammar-file / -j / -jf (grammar_opts by those names), or None."""
    from synapse_nb.grammar import grammar_from_options

    return grammar_from_options(**grammar_opts)


def grammar_matcher(text, tok, verbose):
    """A GrammarMatcher for the grammar text (None: no grammar); the vocabulary's index is built here."""
    if text is None:
        return None
    from synapse_nb.grammar import Grammar, GrammarMatcher

    t0 = time.perf_counter()
    g = Grammar(text, tokenizer=tok)
    m = GrammarMatcher(g, tok)
    if verbose:
        log(f"grammar: {len(g.rules)} rules, vocabulary indexed in {1e3 * (time.perf_counter() - t0):.0f} ms")
    return m


def warn_n_ctx(n_ctx: int, hp) -> None:
    """llama.cpp's warning (llama_context's constructor) when n_ctx exceeds the training context."""
    if n_ctx > hp.n_ctx_train:
        log(f"warning: n_ctx {n_ctx} > n_ctx_train {hp.n_ctx_train} of the model: possible training context overflow")


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
