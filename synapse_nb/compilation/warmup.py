"""The warm-up: compile (or load from Numba's cache) the kernels a run will call, before it runs.

warmup runs a 1-token and a 2-token forward on a 3-position Session (compilation.forwards),
chosen by run_needs to compile only what a given run calls; on a cold cache with jobs >= 2 a
second process compiles half of them (compilation.helper).
"""

from __future__ import annotations

from ..hparams import HParams
from ..jit import release_library_pages, start_done
from ..kernels import attention as _attn
from ..model import Model
from ..session import DEFAULT_N_BATCH, default_n_ctx
from . import helper as helper_process
from .forwards import batched_layers, compile_attention, compile_segments, table_kernels, warmup_session, warmup_steps


def run_needs(hp: HParams, n_prompt: int, n_predict: int, n_batch: int, n_ctx: int) -> tuple[bool, bool, frozenset]:
    """(batched, single, attention kinds): which warm-up steps a run calls the kernels of.

    The run evaluates a prompt of n_prompt tokens in batches of n_batch (a batch of 1 token runs
    the single-token kernels), then up to n_predict - 1 single tokens (-1: until the context is
    full; the last token is not evaluated, see Session.greedy_tokens) within n_ctx positions.
    Attention kinds: the (decode, parallel) pairs of the attention kernels it calls
    (attention.kernel_for): decode for a one-row call, parallel past
    attention.uses_parallel's threshold. Every layer of a batch attends all its rows, but a batch
    whose logits are not needed stops before its last layer's attention, and the last batch's
    last layer attends its last row only (Model.forward); each decode step attends one row.
    """
    n_batch = min(n_batch, n_ctx)
    last = n_prompt - (n_prompt - 1) % n_batch - 1  # position of the last batch
    n_decode = max(0, n_ctx - n_prompt - 1)
    if n_predict >= 0:
        n_decode = min(n_decode, max(0, n_predict - 1))
    batched = min(n_prompt, n_batch) > 1
    single = n_prompt - last == 1 or n_decode > 0
    calls = [(1, n_prompt - 1)]  # (rows, pos0) of the attention calls
    if hp.n_layer > 1:
        calls += [(min(n_batch, n_prompt - b0), b0) for b0 in range(0, n_prompt, n_batch)]
    if n_decode:  # the threshold grows with the position: the first and last steps decide
        calls += [(1, n_prompt), (1, n_prompt + n_decode - 1)]
    kinds = frozenset((n == 1, _attn.uses_parallel(n, p, hp.n_head, hp.head_dim_k, hp.head_dim_v)) for n, p in calls)
    return batched, single, kinds


# While the batched forward's matmul kernels are not compiled, a completion's prompt is evaluated
# one token at a time (prompt_n_batch) up to SHORT_PROMPT tokens, or more as long as its
# single-token forwards read the model's matmul weights TOKEN_BY_TOKEN_BYTES in all: the same
# logits and cache (a sequence's bits do not depend on its batches), and no compile of the
# batched kernels. Measured on a cold cache (2 cores; a 39-40 token prompt, -n 4; whole run, -b 1
# against the batches): SmolLM2 9.6 s against 14.5, Qwen2.5 16.3 against 21.8, Gemma 3 15.4
# against 23.0, for 1.4 / 8.5 / 2.8 ms a prompt token more (11-22 ms per GB a forward reads).
# 64 GiB: up to ~710 / 175 / 270 tokens, at most ~1-1.5 s more; 16 tokens for a 4 GB model.
SHORT_PROMPT = 16
TOKEN_BY_TOKEN_BYTES = 64 << 30


def step_bytes(model: Model) -> int:
    """The bytes of the matmul weights a single-token forward reads (every layer's and the output
    head's)."""
    from ..kernels.graph import MATMULS

    w = model.weights
    return w.output.rows.nbytes + sum(getattr(L, name).rows.nbytes for L in w.layers for name in MATMULS)


def short_prompt(model: Model) -> int:
    """The most prompt tokens prompt_n_batch evaluates one at a time on a first run (see
    TOKEN_BY_TOKEN_BYTES)."""
    return max(SHORT_PROMPT, TOKEN_BY_TOKEN_BYTES // max(1, step_bytes(model)))


def batched_compiled(model: Model) -> bool:
    """Whether the batched forward's matmul drivers and activation conversions (graph.Tables.matmuls
    of several rows: most of its compile) are compiled or in Numba's cache (jit.in_cache; nothing
    is compiled or loaded)."""
    from ..jit import in_cache
    from ..kernels.graph import SIGNATURES

    return all(in_cache(d, tuple(SIGNATURES[k])) for d, k in table_kernels(model, lambda t: t.matmuls(True, False)))


def prompt_n_batch(model: Model, n_prompt: int, n_batch: int) -> int:
    """The batch size to evaluate a completion's prompt of n_prompt tokens with: 1 for a short
    prompt (2 to short_prompt(model) tokens) while the batched forward's kernels are not compiled
    (batched_compiled), so that a first run compiles the single-token forward only; else n_batch."""
    if 1 < n_prompt <= short_prompt(model) and n_batch > 1 and not batched_compiled(model):
        return 1
    return n_batch


def _helper(ahead, path, override: dict, rest, batched: bool, head: bool) -> helper_process.Helper:
    """The warm-up's Helper (its share of the kernels: forwards.warmup_steps of batched and
    head): ahead told its work, or a new one."""
    if ahead is None:
        return helper_process.Helper(path, override, rest, batched, head)
    ahead.tell(override, rest, batched, head)
    return ahead


ALL_KINDS = frozenset((d, p) for d in (False, True) for p in (False, True))


def _compiles(model: Model, s) -> bool:
    """Compile (or load) the block loop for s's forwards; whether Numba compiled anything."""
    from ..jit import watch_compiles

    seen = []
    with watch_compiles(seen.append):
        model.compile_layers(s.state, s.cache)
    return bool(seen)


def warmup(model: Model, progress=None, n_prompt: int | None = None, n_predict: int = -1,
           n_batch: int = DEFAULT_N_BATCH, n_ctx: int | None = None, jobs: int = 1,
           ahead: helper_process.Helper | None = None, several_rows: bool | None = None) -> None:
    """Compile (or load from Numba's cache) the kernels the forward uses, with 1- and 2-token forwards.

    model: a loaded Model. progress: optional callable(done, total, name) called before each step.
    By default every kernel any run may call. Given n_prompt (a run that evaluates a prompt of
    n_prompt tokens in batches of n_batch, then decodes up to n_predict tokens, -1: until n_ctx
    is full, n_ctx defaulting as Session's), only the kernels of that run (run_needs): a
    one-token prompt skips the batched (parallel) kernels, and attention compiles the one to
    four kernels (decode or prefill, serial or parallel) the run calls, which cost as much to
    load as to compile when unused. A kernel left out still compiles (or loads) on its first call.
    jobs: with 2 or more, when the warm-up compiles (a cold cache) a second process compiles part
    of the kernels (synapse_nb.compilation.helper): the block loop, then the list of the forwards'
    kernels (forwards.warmup_steps: the batched forward's, which a batch's last row follows with
    the one-row kernels, then the single-token forward's) from its last while this process
    compiles it from its first, each kernel once (helper.Helper.share), the attention kinds of
    the last step among them. The kernels and the cache are the same either way. ahead: the
    Helper.ahead of model's path that the run started watching before its model load
    (engine.compiling_ahead), used as that process (told its work, or cancelled when there is
    none); a started one means a cold cache. several_rows: whether the output head's batch
    matmul and several sequences' attention are compiled too, the kernels of runs that read the
    logits of several rows or step several sequences (a server's, perplexity's, --batch's; a
    chat reads one row's logits at a time: False); by default when n_prompt is None.
    """
    hp = model.hparams
    if n_prompt is None:
        batched = single = True
        kinds = ALL_KINDS
    else:
        batched, single, kinds = run_needs(hp, n_prompt, n_predict, n_batch,
                                            default_n_ctx(hp) if n_ctx is None else n_ctx)
    release_library_pages()  # LLVM's pages touched by the imports and the model's load
    # the warm-up forwards' attention takes a kind the run uses (per decode / prefill), the
    # others run on their own in the last step
    override = dict(sorted(kinds))
    rest = kinds - set(override.items())
    head = n_prompt is None if several_rows is None else several_rows  # the head's batch matmul, segments
    s = warmup_session(model, override)
    helper = None
    # A batched forward also calls the one-row kernels (its last layer computes its last row
    # alone), so the helper compiles those whenever there is one. Without a single-token step
    # (a run of one token, -n 1) the helper is used only when the block loop itself compiles (a
    # cold cache), so that a warm run's warm-up stays the one forward the run makes.
    started = ahead is not None and ahead.started  # it compiles the block loop already
    if jobs > 1 and helper_process.available():
        if batched and (single or started or _compiles(model, s)):
            helper = _helper(ahead, model.path, override, rest, True, head)
        elif single and not batched:
            # a one-token prompt: the helper compiles the block loop, then the single-token
            # forward's kernels and the other attention kinds from the last while this process
            # compiles them from the first (Helper.share)
            helper = _helper(ahead, model.path, override, rest, False, False)
    if ahead is not None and helper is not ahead:
        ahead.cancel()

    def run_batched():
        if helper is None:
            s.eval([0, 0])
            return
        # the kernels shared with the helper (this process from the batched forward's first, the
        # helper from the single-token forward's last), then every row through the last layer
        # (the one-row calls: the run's last batch makes those on its last layer, which the
        # single-token forward also makes). The head's batch matmul only with several_rows.
        helper.beside(lambda: helper.share(warmup_steps(model, s, True, head, rest)))
        batched_layers(model, s, head=head)
        if not single and helper.started:  # no single-token step to load them: the run's forward
            s.truncate(0)
            s.eval([0, 0])

    def run_single():
        if helper is not None and not batched:  # its share of the kernels, then the helper's from the cache
            helper.beside(lambda: helper.share(warmup_steps(model, s, False, rest=rest)))
        s.eval([0])

    steps = [
        ("batched forward (parallel kernels)", run_batched) if batched else None,
        ("single-token forward (serial kernels)", run_single) if single else None,
        ("attention kernels", lambda: compile_attention(model, s, rest)) if rest else None,
        # a server's, --batch's (several sequences decoding in one step)
        ("several sequences' attention", lambda: compile_segments(model, s)) if head else None,
    ]
    steps = [st for st in steps if st is not None]
    for i, (name, run) in enumerate(steps):
        if progress:
            progress(i, len(steps), name)
        run()
    release_library_pages()  # and by the kernels' loads: a forward runs none of that code
    start_done()  # the garbage collector, paused by a command-line run's fast_start, resumes
    if progress:
        progress(len(steps), len(steps), "done")
