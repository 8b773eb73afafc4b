"""The engine layer every mode calls: the model by name or path, its Session, the warm-up, and a
generation with its stop reason and timings.

Completion and chat (cli/), batch lines (synapse_nb.batch), perplexity and the server
(synapse_nb.api) load, open sessions, warm up and time their generations here, so that each is
done one way whatever the mode. The sampler is built from options through the one parameter
table (synapse_nb.options, sampling.build_sampler). Nothing here prints: the modes do.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field

from .model import Model
from .model import load_model as _load_gguf
from .models import resolve_model
from .session import DEFAULT_N_BATCH, Session
from .timings import timings


def load_model(name_or_path) -> Model:
    """Load a GGUF model given its path or a models.txt name (synapse_nb.models.resolve_model,
    then synapse_nb.model.load_model). Raises SynapseError when the file is missing (or the name
    not fetched) or unreadable."""
    return _load_gguf(resolve_model(name_or_path))


def all_cores(n_threads: int | None) -> int:
    """n_threads, or every core when None or <= 0 (llama.cpp's -t default and -t <= 0)."""
    return n_threads if n_threads is not None and n_threads > 0 else (os.cpu_count() or 1)


def open_session(model: Model, n_ctx: int | None = None, n_threads: int | None = None,
                 n_batch: int = DEFAULT_N_BATCH, swa_full: bool = False) -> Session:
    """A Session of model (n_ctx and swa_full as Session takes them) on n_threads threads (all_cores' count)."""
    return Session(model, n_ctx=n_ctx, n_threads=all_cores(n_threads), n_batch=n_batch, swa_full=swa_full)


def prompt_n_batch(model: Model, n_prompt: int, n_batch: int) -> int:
    """The batch size for a completion's prompt of n_prompt tokens when the user did not choose
    one (n_batch: the default): 1 for a short prompt while the batched forward's kernels are not
    compiled, else n_batch (compilation.warmup.prompt_n_batch; the results are the same)."""
    from .compilation.warmup import prompt_n_batch as choose

    return choose(model, n_prompt, n_batch)


@contextlib.contextmanager
def compiling_ahead(path, n_threads: int | None = None):
    """Within the block (a completion's or a chat's model load and tokenization, up to its
    warm_up), a cold cache's first compile starts the warm-up's compile helper at once
    (compilation.helper, Helper.ahead): it compiles the block loop while this process compiles
    the vocabulary's kernels, then the part of the warm-up that warm_up(..., ahead=helper) tells
    it. Yields that Helper, or None when the run has one thread (all_cores(n_threads), at most
    Numba's pool) or no helper can run here. At the block's end a helper the warm-up did not take
    is killed (the run ended before its warm-up: an error, --tokenize).
    """
    from .compilation import helper as helper_process
    from .session import usable_threads

    if usable_threads(all_cores(n_threads)) < 2 or not helper_process.available():
        yield None
        return
    ahead = helper_process.Helper.ahead(path)
    ahead.start_on_first_compile()
    try:
        yield ahead
    finally:
        ahead.cancel(kill=True)


def warm_up(model: Model, *, progress=None, sampler=None, all_samplers: bool = False, jobs: int = 1,
            ahead=None, **run) -> float:
    """Compile (or load from Numba's cache) the kernels a run calls; returns the seconds it took.

    The forward's kernels (synapse_nb.compilation.warmup.warmup with progress, jobs and `run`:
    n_prompt, n_predict, n_batch, n_ctx to compile only what that run calls, several_rows False
    to leave out the head on several rows and several sequences' attention; ahead, the Helper
    of compiling_ahead), then those of `sampler`'s chain (a Sampler), or of every chain with
    all_samplers (a server: any request's).
    """
    from .compilation.warmup import warmup
    from .sampling import warmup as sampling_warmup

    t0 = time.perf_counter()
    warmup(model, progress=progress, jobs=jobs, ahead=ahead, **run)
    if sampler is not None or all_samplers:
        sampling_warmup(sampler)
    return time.perf_counter() - t0


@dataclass
class Generation:
    """What generate did: tokens (the end-of-generation token included, as Session.generate),
    stop ("eog", "length", "context", or "interrupted" by Ctrl-C), the prompt's length and its
    evaluation time, and the decode's time and evaluated tokens (the last token is not)."""

    prompt: list
    tokens: list = field(default_factory=list)
    stop: str | None = None
    prompt_s: float = 0.0
    eval_s: float = 0.0
    n_evals: int = 0

    def timings(self, n_threads: int) -> dict:
        return timings(len(self.prompt), self.prompt_s, self.n_evals, self.eval_s, n_threads)


def generate(session: Session, prompt: list, n_predict: int, *, sampler=None, grammar=None, ignore_eos: bool = False,
             all_logits: bool = False, on_prompt=None, on_token=None, on_logits=None, on_prefill=None,
             interruptible: bool = False) -> Generation:
    """Evaluate prompt on session (after its cached positions), then generate up to n_predict tokens.

    The tokens are chosen as Session.greedy_tokens chooses them: argmax, or sampler (which first
    accepts the prompt, as llama-completion), grammar constraining argmax (a sampler holds its
    own). on_prompt(logits) gets the prompt's logits (float32 [n_vocab], or [len(prompt),
    n_vocab] with all_logits) before the first token; on_prefill(done, total) the prompt's progress
    after each batch (Session.eval's progress); on_token(token) each token as it is chosen
    (end-of-generation ones too); on_logits(row) each decoded token's logits. With interruptible,
    Ctrl-C ends the generation with stop "interrupted" instead of raising. Raises SynapseError as
    Session.eval does (bad ids, a full context).
    """
    gen = Generation(prompt=list(prompt))
    t0 = time.perf_counter()
    logits = session.eval(gen.prompt, all_logits=all_logits, progress=on_prefill)
    t1 = time.perf_counter()
    gen.prompt_s = t1 - t0
    if on_prompt is not None:
        on_prompt(logits)
    if all_logits:
        logits = logits[-1]
    if sampler is not None:
        sampler.accept_many(gen.prompt)  # as llama-completion: the prompt fills the penalty window
    n_past = session.n_past  # each decoded token evaluated adds one: no counting in the loop
    t1 = time.perf_counter()
    try:
        for tok in session.greedy_tokens(logits, n_predict, ignore_eos, on_logits=on_logits, sampler=sampler,
                                         grammar=grammar if sampler is None else None):
            gen.tokens.append(tok)
            if on_token is not None:
                on_token(tok)
        gen.stop = session.stop_reason
    except KeyboardInterrupt:
        if not interruptible:
            raise
        gen.stop = "interrupted"
    gen.eval_s = time.perf_counter() - t1
    gen.n_evals = session.n_past - n_past
    return gen
