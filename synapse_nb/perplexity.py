"""Perplexity and KL divergence exactly as llama.cpp's llama-perplexity computes them.

Reproduces tools/perplexity/perplexity.cpp of llama.cpp 0c1e570 (vendored in llama-cpp-python
0.3.36): ``perplexity()`` (the default run, optionally writing a ``--kl-divergence-base`` file)
and ``kl_divergence()`` (``--kl-divergence``), with its float/double arithmetic (see
synapse_nb.kernels.logprob) and its printed formats, so that the digits we print are the digits
it prints when the logits are the same.

Procedure (perplexity.cpp ``perplexity``):
  - the text is tokenized once, with add_special (a BOS only if the vocabulary adds one);
  - n_chunk = len(tokens) // n_ctx (or fewer with ``chunks``); at least 2 * n_ctx tokens are
    required; chunk i is tokens[i*n_ctx : (i+1)*n_ctx], evaluated from an empty KV cache at
    positions 0..n_ctx-1, its first token replaced (not shifted) by BOS when the vocabulary adds
    a BOS;
  - first = n_ctx // 2; the logits at positions p = first .. n_ctx-2 score the token at p+1
    (n_ctx - 1 - first tokens per chunk);
  - sums of NLL and NLL^2 in double over all chunks; after chunk i the running PPL
    exp(sum / count) is printed as ``[i]%.4f,``; the final estimate is exp(mean) with error
    PPL * sqrt((mean(NLL^2) - mean^2) / (count - 1)), printed ``%.4f +/- %.5f``.

The .kld base file (``--kl-divergence-base``, native little-endian):
  ``_logits_``, int32 n_ctx, int32 n_vocab, int32 n_chunk, int32 tokens[n_chunk * n_ctx] (as
  tokenized, no BOS substitution), then per chunk and scored position one record of
  nv = 2*ceil(n_vocab/2) + 4 uint16: float32 scale, float32 min_log_prob, then q_j for each vocab
  entry (padded with a 0 to an even count). With max/min the row's max/min logit,
  lo = max(min, max - 16), lse = ln sum exp(l - max): min_log_prob = lo - max - lse,
  scale = (max - lo)/65535, q_j = round_half_even((l_j - lo) * (1/scale)) if l_j > lo else 0.
  The log-probability decodes as scale * q_j + min_log_prob.

Public API: perplexity, PerplexityResult, kl_divergence, KLDResult, KLDAccumulator, read_kld,
KLDBase, kld_file_size. Errors on bad input (short text, a file that is not a .kld file, another
vocabulary, other tokens) raise SynapseError with one line naming the problem.
"""

from __future__ import annotations

import math
import os
import struct
import time
from dataclasses import dataclass, field

import numpy as np

from .errors import SynapseError
from .options import DEFAULT_N_BATCH

__all__ = ["perplexity", "PerplexityResult", "kl_divergence", "KLDResult", "KLDAccumulator", "read_kld",
           "KLDBase", "kld_file_size", "DEFAULT_N_CTX"]
# The most bytes of text --perplexity reads (1 GiB: about 250M tokens, days of evaluation here).
PPL_TEXT_LIMIT = 1 << 30

DEFAULT_N_CTX = 512  # llama-perplexity sets params.n_ctx = 512 before parsing the options
KLD_MAGIC = b"_logits_"


# ------------------------------------------------------------------------------------ helpers

def _as_model(model):
    from .model import Model

    if isinstance(model, Model):
        return model
    from .engine import load_model

    return load_model(model)


def _n_vocab(model) -> int:
    n = int(model.tokenizer.n_vocab)
    if n != model.hparams.n_vocab:
        raise SynapseError(f"{model.path}: the vocabulary has {n} tokens but the output layer {model.hparams.n_vocab} "
                           f"rows; perplexity needs one logit per token")
    return n


def _scored(n_ctx: int) -> int:
    return n_ctx - 1 - n_ctx // 2


def _check_n_ctx(n_ctx) -> int:
    if not isinstance(n_ctx, (int, np.integer)) or n_ctx < 4:
        raise SynapseError(f"perplexity: n_ctx must be an integer >= 4 (n_ctx/2 - 1 scored tokens per chunk), "
                           f"got {n_ctx!r}")
    return int(n_ctx)


def _tokens_array(tokens, n_vocab: int, what: str) -> np.ndarray:
    ids = np.asarray(tokens)
    if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
        raise SynapseError(f"{what}: tokens must be a 1-D sequence of integer token ids")
    ids = ids.astype(np.int64)
    bad = (ids < 0) | (ids >= n_vocab)
    if bad.any():
        i = int(np.argmax(bad))
        raise SynapseError(f"{what}: token {i} has id {int(ids[i])}, outside the vocabulary [0, {n_vocab})")
    return ids


def check_length(n_tokens: int, n_ctx: int) -> None:
    """Raise SynapseError unless n_tokens >= 2 * n_ctx (llama-perplexity's rule)."""
    if n_tokens < 2 * n_ctx:
        raise SynapseError(f"perplexity: the text tokenizes to only {n_tokens} tokens; a context of {n_ctx} needs "
                           f"at least {2 * n_ctx} (2 * n_ctx)")


class _Evaluator:
    """Chunk evaluation as llama-perplexity does it: empty cache, positions 0..n_ctx-1, BOS in front
    when the vocabulary adds one, logits requested only at positions >= n_ctx/2."""

    def __init__(self, model, n_ctx: int, n_batch: int, n_threads):
        from .session import Session

        self.model = model
        self.session = Session(model, n_ctx=n_ctx, n_threads=n_threads, n_batch=n_batch)
        self.n_ctx = n_ctx
        self.first = n_ctx // 2
        tok = model.tokenizer
        self.bos = tok.bos_id if tok.add_bos else None

    def logits(self, chunk: np.ndarray) -> np.ndarray:
        """float32 [n_ctx - 1 - first, n_vocab]: the logits at positions first .. n_ctx-2."""
        import numba

        s = self.session
        if s.n_threads is not None:
            numba.set_num_threads(s.n_threads)
        chunk = np.array(chunk, dtype=np.int64)
        if self.bos is not None:
            chunk[0] = self.bos  # replaced for the evaluation only, not shifted
        rows = []
        nb = s.n_batch
        for b0 in range(0, self.n_ctx, nb):
            batch = chunk[b0:b0 + nb]
            need = b0 + len(batch) > self.first
            out = self.model.forward(s.state, s.cache, batch, b0, all_logits=need, want_logits=need)
            if need:
                rows.append(out[max(0, self.first - b0):])
        out = np.concatenate(rows, axis=0) if len(rows) > 1 else rows[0]
        return np.ascontiguousarray(out[:_scored(self.n_ctx)], dtype=np.float32)


def _c_float(x: float, spec: str) -> str:
    """printf("%<spec>f") of a double as glibc prints it (a NaN with the sign bit set is "-nan")."""
    x = float(x)
    if math.isnan(x):
        width = spec.split(".")[0].lstrip("-")
        s = "-nan" if math.copysign(1.0, x) < 0 else "nan"
        return s.rjust(int(width)) if width else s
    return f"%{spec}f" % x


# ------------------------------------------------------------------------------------ perplexity

@dataclass(frozen=True)
class PerplexityResult:
    """Result of perplexity().

    n_ctx, n_batch: as run; n_tokens: tokens of the text; n_chunk: chunks evaluated;
    scored_per_chunk: n_ctx - 1 - n_ctx//2; count: tokens scored in all.
    per_chunk_ppl: running PPL after chunk i (over chunks 1..i), the ``[i]`` values.
    running_mean_nll, running_stderr_mean_nll: the two last columns of --ppl-output-type 1
    (stderr as llama.cpp computes it: left as the variance estimate when that is <= 0).
    chunk_seconds: wall time per chunk. ppl, err: the final estimate (err None when the variance
    is not positive, where llama-perplexity prints an error instead). nll_sum, nll2_sum: the double
    sums. kld_base: path of the .kld file written, or None.
    """

    n_ctx: int
    n_batch: int
    n_tokens: int
    n_chunk: int
    scored_per_chunk: int
    count: int
    per_chunk_ppl: tuple
    running_mean_nll: tuple
    running_stderr_mean_nll: tuple
    chunk_seconds: tuple
    ppl: float
    err: float | None
    nll_sum: float
    nll2_sum: float
    kld_base: str | None = None

    def running_text(self) -> str:
        """The running values as llama-perplexity prints them: ``[1]x,[2]y,...,`` (no newline)."""
        return "".join(f"[{i + 1}]{v:.4f}," for i, v in enumerate(self.per_chunk_ppl))

    def final_text(self) -> str:
        """``Final estimate: PPL = X +/- Y`` as llama-perplexity prints it (or its error line)."""
        if self.err is None:
            return "Unexpected negative standard deviation of log(prob)"
        return f"Final estimate: PPL = {self.ppl:.4f} +/- {self.err:.5f}"

    def to_dict(self) -> dict:
        return {
            "n_ctx": self.n_ctx, "n_batch": self.n_batch, "n_tokens": self.n_tokens, "n_chunk": self.n_chunk,
            "scored_per_chunk": self.scored_per_chunk, "count": self.count,
            "per_chunk_ppl": list(self.per_chunk_ppl), "running_mean_nll": list(self.running_mean_nll),
            "running_stderr_mean_nll": list(self.running_stderr_mean_nll),
            "final_ppl": self.ppl, "final_err": self.err, "nll_sum": self.nll_sum, "nll2_sum": self.nll2_sum,
            "chunk_seconds": list(self.chunk_seconds), "kld_base": self.kld_base,
        }


def _check_new_file(dest) -> None:
    """SynapseError unless dest can be created as a new file (it does not exist, its directory
    takes a new file: /proc or a read-only directory is found now, before any work)."""
    from .inputs import check_writable

    if os.path.lexists(dest):
        raise SynapseError(f"{dest} already exists; it is not overwritten (remove it or choose another name)")
    d = os.path.dirname(os.path.abspath(dest))
    if not os.path.isdir(d):
        raise SynapseError(f"{dest}: no such directory")
    check_writable(dest, "--kl-divergence-base")


class _NewFile:
    """The .kld base being written: synapse_nb.inputs.NewFile (written unnamed, linked to its final
    name at the end, never replacing an existing file; a killed run leaves nothing)."""

    def __init__(self, dest):
        from .inputs import NewFile

        _check_new_file(str(dest))
        self._file = NewFile(dest, "--kl-divergence-base")
        self.dest, self.tmp = self._file.dest, self._file.tmp

    def write(self, data) -> None:
        self._file.write(data)

    def commit(self) -> None:
        self._file.commit()

    def abort(self) -> None:
        self._file.abort()


def perplexity(model, tokens, n_ctx: int = DEFAULT_N_CTX, n_batch: int = DEFAULT_N_BATCH, n_threads: int | None = None,
               progress=None, chunks: int | None = None, kld_base=None) -> PerplexityResult:
    """llama-perplexity's default run (tools/perplexity/perplexity.cpp ``perplexity``).

    model: a Model, or a GGUF path / models.txt name. tokens: the text's token ids as tokenized
    once with add_special (``model.tokenizer.tokenize(text, add_special=True, parse_special=False)``);
    at least 2 * n_ctx of them. n_ctx: chunk size (llama-perplexity's -c, default 512); n_batch:
    tokens per forward (results do not depend on it); n_threads: Numba threads. chunks: evaluate
    at most this many chunks (--chunks). progress: callable(done, n_chunk, text) after each chunk,
    text being what llama-perplexity prints for it (``[i]x,``). kld_base: a path; also write the
    .kld base file of --kl-divergence-base there (never replacing an existing file: written to a
    temporary name, linked at the end). As llama.cpp, the NLL of that run is then the float value
    its writer returns, not the double of the plain run.

    Returns a PerplexityResult. Raises SynapseError on a short text, bad ids or bad options.
    """
    from .kernels import logprob as K

    model = _as_model(model)
    n_ctx = _check_n_ctx(n_ctx)
    n_vocab = _n_vocab(model)
    ids = _tokens_array(tokens, n_vocab, "perplexity")
    n_tok = int(ids.size)
    check_length(n_tok, n_ctx)
    n_chunk = n_tok // n_ctx
    if chunks is not None and chunks >= 0:
        n_chunk = min(int(chunks), n_chunk)
    if n_chunk < 1:
        raise SynapseError("perplexity: --chunks must be >= 1")
    ev = _Evaluator(model, n_ctx, n_batch, n_threads)
    first, n_sc = ev.first, _scored(n_ctx)

    writer = None
    if kld_base is not None:
        writer = _NewFile(kld_base)
        writer.write(KLD_MAGIC + struct.pack("<iii", n_ctx, n_vocab, n_chunk))
        writer.write(ids[:n_chunk * n_ctx].astype("<i4").tobytes())
        nv = 2 * ((n_vocab + 1) // 2) + 4
        rec = np.zeros((n_sc, nv), np.uint16)
        rec_f32 = rec.view(np.float32)
    try:
        nll = nll2 = 0.0
        count = 0
        per_chunk, means, stderrs, secs = [], [], [], []
        v = np.empty(n_sc, np.float64)
        for i in range(n_chunk):
            t0 = time.perf_counter()
            start = i * n_ctx
            logits = ev.logits(ids[start:start + n_ctx])
            targets = np.ascontiguousarray(ids[start + first + 1:start + n_ctx])
            if writer is not None:
                K.kld_base_rows(v, rec, rec_f32, logits, targets)
                writer.write(rec.tobytes())
            else:
                K.nll_rows(v, logits, targets)
            for x in v.tolist():  # double sums in position order, as one C++ thread adds them
                nll += x
                nll2 += x * x
            count += n_sc
            ppl_i = math.exp(nll / count)
            av = nll / count
            av2 = nll2 / count - av * av
            if av2 > 0:
                av2 = math.sqrt(av2 / (count - 1))
            per_chunk.append(ppl_i)
            means.append(av)
            stderrs.append(av2)
            secs.append(time.perf_counter() - t0)
            if progress is not None:
                progress(i + 1, n_chunk, f"[{i + 1}]{ppl_i:.4f},")
        if writer is not None:
            writer.commit()
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    mean = nll / count
    ppl = math.exp(mean)
    var = nll2 / count - mean * mean
    err = math.sqrt(var / (count - 1)) * ppl if var > 0 else None
    return PerplexityResult(n_ctx=n_ctx, n_batch=ev.session.n_batch, n_tokens=n_tok, n_chunk=n_chunk,
                            scored_per_chunk=n_sc, count=count, per_chunk_ppl=tuple(per_chunk),
                            running_mean_nll=tuple(means), running_stderr_mean_nll=tuple(stderrs),
                            chunk_seconds=tuple(secs), ppl=ppl, err=err, nll_sum=nll, nll2_sum=nll2,
                            kld_base=None if kld_base is None else str(kld_base))


# ------------------------------------------------------------------------------------ .kld files

def kld_file_size(n_ctx: int, n_vocab: int, n_chunk: int) -> int:
    """Bytes of a .kld base file: 20 + 4*n_chunk*n_ctx + 2*n_chunk*(n_ctx-1-n_ctx/2)*nv."""
    nv = 2 * ((n_vocab + 1) // 2) + 4
    return 20 + 4 * n_chunk * n_ctx + 2 * n_chunk * _scored(n_ctx) * nv


@dataclass(frozen=True)
class KLDBase:
    """A .kld base file, memory-mapped. tokens int32 [n_chunk * n_ctx];
    records uint16 [n_chunk, n_ctx-1-n_ctx/2, nv] (see the module docstring for the layout)."""

    path: str
    n_ctx: int
    n_vocab: int
    n_chunk: int
    tokens: np.ndarray
    records: np.ndarray


def read_kld(path) -> KLDBase:
    """Open a .kld base file written by llama-perplexity --kl-divergence-base (or by perplexity()).

    Raises SynapseError when the file is missing, is not a .kld file (magic), has impossible
    header values, or its size is not the one its header implies (truncated or padded).
    """
    path = str(path)
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(20)
    except OSError as e:
        raise SynapseError(f"{path}: {e.strerror}") from None
    if len(head) < 20 or head[:8] != KLD_MAGIC:
        raise SynapseError(f"{path} does not look like a file containing log-probabilities (no '_logits_' header)")
    n_ctx, n_vocab, n_chunk = struct.unpack("<iii", head[8:20])
    if n_ctx < 4 or n_vocab < 1 or n_chunk < 1:
        raise SynapseError(f"{path}: bad header (n_ctx {n_ctx}, n_vocab {n_vocab}, n_chunk {n_chunk})")
    want = kld_file_size(n_ctx, n_vocab, n_chunk)
    if size != want:
        raise SynapseError(f"{path}: {size} bytes, but its header (n_ctx {n_ctx}, n_vocab {n_vocab}, n_chunk "
                           f"{n_chunk}) implies {want}; the file is {'truncated' if size < want else 'too long'}")
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    tokens = mm[20:20 + 4 * n_chunk * n_ctx].view("<i4")
    nv = 2 * ((n_vocab + 1) // 2) + 4
    records = mm[20 + 4 * n_chunk * n_ctx:].view("<u2").reshape(n_chunk, _scored(n_ctx), nv)
    return KLDBase(path=path, n_ctx=n_ctx, n_vocab=n_vocab, n_chunk=n_chunk, tokens=tokens, records=records)


# ------------------------------------------------------------------------------------ KL divergence

KLD_HEADER = ("chunk             PPL               ln(PPL(Q)/PPL(base))          KL Divergence              "
              "\u0394p RMS            Same top p")


def _mean_unc(s, s2, count):
    """mean_and_uncertainty of kl_divergence(): uncertainty 0 until count > 10."""
    if count < 1:
        return 0.0, 0.0
    f = s / count
    df = s2 / count - f * f
    df = float(np.sqrt(np.float64(df / (count - 1)))) if df > 0 and count > 10 else 0.0
    return f, df


def _cov(a, b, ab, count):
    if count < 10:
        return 0.0
    return (ab / count - (a / count) * (b / count)) / (count - 1)


def _percentile(values: np.ndarray, fraction: float) -> np.float32:
    """perplexity.cpp's percentile() on sorted float32 values, in float as there."""
    f = np.float32(fraction)
    if f <= 0:
        return values[0]
    if f >= 1:
        return values[-1]
    p = np.float32(f * np.float32(values.size - 1))
    ip = int(p)
    p = np.float32(p - np.float32(ip))
    return np.float32(np.float32((np.float32(1) - p) * values[ip]) + np.float32(p * values[min(ip + 1, values.size - 1)]))


def _median(values: np.ndarray) -> np.float32:
    n = values.size
    if n % 2 == 0:
        return np.float32(np.float32(0.5) * np.float32(values[n // 2] + values[n // 2 - 1]))
    return values[n // 2]


_PCTS_KLD = ((0.999, "99.9%"), (0.990, "99.0%"), (0.950, "95.0%"), (0.900, "90.0%"))
_PCTS_KLD_LO = ((0.100, "10.0%"), (0.050, " 5.0%"), (0.010, " 1.0%"), (0.001, " 0.1%"))
_PCTS_DP = ((0.999, "99.9%"), (0.990, "99.0%"), (0.950, "95.0%"), (0.900, "90.0%"), (0.750, "75.0%"))
_PCTS_DP_LO = ((0.250, "25.0%"), (0.100, "10.0%"), (0.050, " 5.0%"), (0.010, " 1.0%"), (0.001, " 0.1%"))


@dataclass
class KLDResult:
    """Result of kl_divergence() / KLDAccumulator.result().

    n_ctx, n_vocab, n_chunk, count: as run; chunk_lines: the per-chunk table rows as printed;
    chunk_values: per chunk a dict of the row's numbers; statistics: a dict of every final value
    (None when count < 100, where llama-perplexity prints no statistics); sums: the raw sums.
    """

    n_ctx: int
    n_vocab: int
    n_chunk: int
    count: int
    chunk_lines: list = field(default_factory=list)
    chunk_values: list = field(default_factory=list)
    statistics: dict | None = None
    sums: dict | None = None
    chunk_seconds: list = field(default_factory=list)

    def statistics_text(self) -> str:
        """The three statistics blocks as llama-perplexity prints them ('' when count < 100)."""
        st = self.statistics
        if st is None:
            return ""
        f = _c_float
        L = ["====== Perplexity statistics ======"]
        L.append(f"Mean PPL(Q)                   : {f(st['ppl_q'], '10.6')} \u00b1 {f(st['ppl_q_unc'], '10.6')}")
        L.append(f"Mean PPL(base)                : {f(st['ppl_base'], '10.6')} \u00b1 {f(st['ppl_base_unc'], '10.6')}")
        L.append(f"Cor(ln(PPL(Q)), ln(PPL(base))): {f(100.0 * st['ln_ppl_cor'], '6.2')}%")
        L.append(f"Mean ln(PPL(Q)/PPL(base))     : {f(st['ln_ppl_ratio'], '10.6')} \u00b1 "
                 f"{f(st['ln_ppl_ratio_unc'], '10.6')}")
        L.append(f"Mean PPL(Q)/PPL(base)         : {f(st['ppl_ratio'], '10.6')} \u00b1 {f(st['ppl_ratio_unc'], '10.6')}")
        L.append(f"Mean PPL(Q)-PPL(base)         : {f(st['ppl_diff'], '10.6')} \u00b1 {f(st['ppl_diff_unc'], '10.6')}")
        L.append("")
        L.append("====== KL divergence statistics ======")
        L.append(f"Mean    KLD: {f(st['kld_mean'], '10.6')} \u00b1 {f(st['kld_unc'], '10.6')}")
        _order_stats(L, st, "KLD", "kld", 1.0, "10.6", "", _PCTS_KLD, _PCTS_KLD_LO, f)
        L.append("")
        L.append("====== Token probability statistics ======")
        L.append(f"Mean    \u0394p: {f(100.0 * st['dp_mean'], '6.3')} \u00b1 {f(100.0 * st['dp_unc'], '5.3')} %")
        _order_stats(L, st, "\u0394p", "dp", 100.0, "6.3", "%", _PCTS_DP, _PCTS_DP_LO, f)
        L.append(f"RMS \u0394p    : {f(100.0 * st['dp_rms'], '6.3')} \u00b1 {f(100.0 * st['dp_rms_unc'], '5.3')} %")
        L.append(f"Same top p: {f(100.0 * st['same_top'], '6.3')} \u00b1 {f(100.0 * st['same_top_unc'], '5.3')} %")
        return "\n".join(L)

    def to_dict(self) -> dict:
        return {"n_ctx": self.n_ctx, "n_vocab": self.n_vocab, "n_chunk": self.n_chunk, "count": self.count,
                "per_chunk": self.chunk_values, "statistics": self.statistics, "sums": self.sums,
                "chunk_seconds": self.chunk_seconds}


class KLDAccumulator:
    """The --kl-divergence sums of llama-perplexity, fed one chunk at a time.

    add_chunk(logits float32 [n, n_vocab] at the scored positions, targets int [n], records
    uint16 [n, nv] of the base file for the same positions) returns the chunk's table row as
    printed; result() gives the KLDResult (statistics only when count >= 100, as llama.cpp).
    Usable without a model (tests feed it hand-made logits and records).
    """

    _NAMES = ("nll", "nll2", "nll_base", "nll_base2", "nll_nll_base", "kld", "kld2", "p_diff", "p_diff2",
              "p_diff4", "max_p_diff", "n_same_top", "count")

    def __init__(self, n_ctx: int, n_vocab: int, n_chunk: int):
        self.n_ctx, self.n_vocab, self.n_chunk = n_ctx, n_vocab, n_chunk
        self.nv = 2 * ((n_vocab + 1) // 2) + 4
        self.sums = np.zeros(13, np.float64)
        self.kld_values: list = []
        self.p_diff_values: list = []
        self.lines: list = []
        self.values: list = []

    def add_chunk(self, logits, targets, records) -> str:
        from .kernels import logprob as K

        logits = np.ascontiguousarray(logits, dtype=np.float32)
        n = logits.shape[0]
        if logits.ndim != 2 or logits.shape[1] != self.n_vocab:
            raise SynapseError(f"kl_divergence: logits must be [n, {self.n_vocab}], got {list(logits.shape)}")
        targets = _tokens_array(targets, self.n_vocab, "kl_divergence")
        rec = np.ascontiguousarray(records, dtype=np.uint16)
        if targets.shape != (n,) or rec.shape != (n, self.nv):
            raise SynapseError(f"kl_divergence: {n} logit rows need {n} targets and [{n}, {self.nv}] records")
        rec_f32 = rec.view(np.float32)
        nll = np.empty(n, np.float32)
        nll_base = np.empty(n, np.float32)
        kld = np.empty(n, np.float64)
        pdiff = np.empty(n, np.float32)
        same = np.empty(n, np.uint8)
        K.kld_rows(nll, nll_base, kld, pdiff, same, logits, targets, rec, rec_f32)
        K.kld_accumulate(self.sums, nll, nll_base, kld, pdiff, same)
        self.kld_values.append(kld.astype(np.float32))
        self.p_diff_values.append(pdiff)
        return self._row()

    def _row(self) -> str:
        s = self.sums
        cnt = int(s[12])
        i = len(self.lines) + 1
        with np.errstate(all="ignore"):
            lp, lpu = _mean_unc(s[0], s[1], cnt)
            ppl = math.exp(lp)
            ppl_unc = ppl * lpu
            lb, lbu = _mean_unc(s[2], s[3], cnt)
            cov = _cov(s[0], s[2], s[4], cnt)
            ratio = lp - lb
            ratio_unc = float(np.sqrt(np.float64(lpu * lpu + lbu * lbu - 2.0 * cov)))
            kl, klu = _mean_unc(s[5], s[6], cnt)
            mse, mseu = _mean_unc(s[8], s[9], cnt)
            rms = float(np.sqrt(np.float64(mse)))
            rms_unc = float(np.float64(0.5) / np.float64(rms) * np.float64(mseu))
            top = 1.0 * s[11] / cnt
            top_unc = float(np.sqrt(np.float64(top * (1 - top) / (cnt - 1)))) if cnt > 1 else float("nan")
        f = _c_float
        line = (f"{i:4d}    {f(ppl, '9.4')} \u00b1 {f(ppl_unc, '9.4')}    {f(ratio, '10.5')} \u00b1 {f(ratio_unc, '10.5')}"
                f"    {f(kl, '10.5')} \u00b1 {f(klu, '10.5')}    {f(100.0 * rms, '6.3')} \u00b1 {f(100.0 * rms_unc, '6.3')} %"
                f"    {f(100.0 * top, '6.3')} \u00b1 {f(100.0 * top_unc, '6.3')} %")
        self.lines.append(line)
        self.values.append({"chunk": i, "ppl_q": ppl, "ppl_q_unc": ppl_unc, "ln_ppl_ratio": ratio,
                            "ln_ppl_ratio_unc": ratio_unc, "kld": kl, "kld_unc": klu, "dp_rms": rms,
                            "dp_rms_unc": rms_unc, "same_top": top, "same_top_unc": top_unc})
        return line

    def result(self) -> KLDResult:
        s = self.sums
        cnt = int(s[12])
        sums = {k: float(v) for k, v in zip(self._NAMES, s)}
        res = KLDResult(n_ctx=self.n_ctx, n_vocab=self.n_vocab, n_chunk=len(self.lines), count=cnt,
                        chunk_lines=list(self.lines), chunk_values=list(self.values), sums=sums)
        if cnt < 100:  # "we do not wish to do statistics on so few values"
            return res
        kv = np.sort(np.concatenate(self.kld_values))
        pv = np.sort(np.concatenate(self.p_diff_values))
        st: dict = {}
        with np.errstate(all="ignore"):
            lp, lpu = _mean_unc(s[0], s[1], cnt)
            ppl = math.exp(lp)
            st["ppl_q"], st["ppl_q_unc"] = ppl, ppl * lpu
            lb, lbu = _mean_unc(s[2], s[3], cnt)
            pb = math.exp(lb)
            st["ppl_base"], st["ppl_base_unc"] = pb, pb * lbu
            cov = _cov(s[0], s[2], s[4], cnt)
            st["ln_ppl_cor"] = float(np.float64(cov) / np.float64(lpu * lbu))
            ratio = lp - lb
            ratio_unc = float(np.sqrt(np.float64(lpu * lpu + lbu * lbu - 2.0 * cov)))
            st["ln_ppl_ratio"], st["ln_ppl_ratio_unc"] = ratio, ratio_unc
            r = math.exp(ratio)
            st["ppl_ratio"], st["ppl_ratio_unc"] = r, r * ratio_unc
            pcov = ppl * pb * cov
            st["ppl_diff"] = ppl - pb
            pu, pbu = st["ppl_q_unc"], st["ppl_base_unc"]
            st["ppl_diff_unc"] = float(np.sqrt(np.float64(pu * pu + pbu * pbu - 2.0 * pcov)))
            st["kld_mean"], st["kld_unc"] = _mean_unc(s[5], s[6], cnt)
            st["kld_max"], st["kld_min"] = float(kv[-1]), float(kv[0])
            st["kld_median"] = float(_median(kv))
            st["kld_pct"] = {name.strip(): float(_percentile(kv, q)) for q, name in _PCTS_KLD + _PCTS_KLD_LO}
            st["dp_mean"], st["dp_unc"] = _mean_unc(s[7], s[8], cnt)
            st["dp_max"], st["dp_min"] = float(pv[-1]), float(pv[0])
            st["dp_median"] = float(_median(pv))
            st["dp_pct"] = {name.strip(): float(_percentile(pv, q)) for q, name in _PCTS_DP + _PCTS_DP_LO}
            mse, mseu = _mean_unc(s[8], s[9], cnt)
            rms = float(np.sqrt(np.float64(mse)))
            st["dp_rms"], st["dp_rms_unc"] = rms, float(np.float64(0.5) / np.float64(rms) * np.float64(mseu))
            st["max_abs_dp"] = float(s[10])
            top = 1.0 * s[11] / cnt
            st["same_top"] = top
            st["same_top_unc"] = float(np.sqrt(np.float64(top * (1.0 - top) / (cnt - 1))))
        res.statistics = st
        return res


def check_kld_header(model, kb: KLDBase) -> None:
    """The base file's header against the model, before any work it sets: the same vocabulary size,
    and an n_ctx within the model's training context whose KV cache fits in memory (a header is
    untrusted input: n_ctx 4194304 would make one chunk minutes of work, or more memory than the
    machine has). llama-perplexity only warns for n_ctx > n_ctx_train; a base file computed on a
    model of this vocabulary with a longer context than this model's is refused here."""
    from .session import check_n_ctx

    n_vocab = _n_vocab(model)
    if kb.n_vocab != n_vocab:
        raise SynapseError(f"{kb.path}: inconsistent vocabulary: the base file has {kb.n_vocab} tokens, the model "
                           f"{model.path.name} {n_vocab}; it was computed with another model's vocabulary")
    n_ctx_train = model.hparams.n_ctx_train
    if kb.n_ctx > n_ctx_train:
        raise SynapseError(f"{kb.path}: computed with n_ctx {kb.n_ctx}, more than the model's training context "
                           f"(n_ctx_train {n_ctx_train}); not a base file for this model")
    check_n_ctx(model.hparams, kb.n_ctx, what=f"{kb.path}: n_ctx")


def check_kld_base(model, kb: KLDBase, tokens=None) -> np.ndarray:
    """The base file's tokens (int64), after checking that they fit the model: same vocabulary size,
    ids inside it, and (when ``tokens`` is given) the same as the text's tokens. Raises SynapseError."""
    n_vocab = _n_vocab(model)
    if kb.n_vocab != n_vocab:
        raise SynapseError(f"{kb.path}: inconsistent vocabulary: the base file has {kb.n_vocab} tokens, the model "
                           f"{model.path.name} {n_vocab}; it was computed with another model's vocabulary")
    ftoks = np.asarray(kb.tokens, dtype=np.int64)
    if tokens is not None:
        ids = _tokens_array(tokens, n_vocab, "kl_divergence")
        n = min(ids.size, ftoks.size)
        diff = np.flatnonzero(ids[:n] != ftoks[:n])
        if diff.size or ids.size < ftoks.size:
            at = int(diff[0]) if diff.size else n
            raise SynapseError(f"{kb.path}: the base file's tokens are not this text's tokens (they differ from "
                               f"token {at} on): it was computed on another text or with another tokenizer")
    _tokens_array(ftoks, n_vocab, kb.path)
    return ftoks


def kl_divergence(model, base, n_batch: int = DEFAULT_N_BATCH, n_threads: int | None = None, progress=None,
                  tokens=None, chunks: int | None = None) -> KLDResult:
    """llama-perplexity --kl-divergence against a base file (perplexity.cpp ``kl_divergence``).

    model: a Model or a GGUF path / models.txt name; base: a path or a KLDBase (read_kld). The
    evaluated tokens and n_ctx come from the file. tokens: optionally the text's tokenization
    (as for perplexity()); it must start with the file's tokens, else SynapseError (the base
    was computed on another text or with another tokenizer). chunks: at most this many chunks.
    progress: callable(done, n_chunk, line) after each chunk, line being the table row printed.

    Raises SynapseError when the file's vocabulary size differs from the model's, or its tokens
    are outside the model's vocabulary or differ from ``tokens``.
    """
    model = _as_model(model)
    kb = base if isinstance(base, KLDBase) else read_kld(base)
    ftoks = check_kld_base(model, kb, tokens)
    n_vocab = kb.n_vocab
    n_chunk = kb.n_chunk if chunks is None or chunks < 0 else min(int(chunks), kb.n_chunk)
    if n_chunk < 1:
        raise SynapseError("kl_divergence: --chunks must be >= 1")
    ev = _Evaluator(model, kb.n_ctx, n_batch, n_threads)
    acc = KLDAccumulator(kb.n_ctx, n_vocab, n_chunk)
    secs = []
    for i in range(n_chunk):
        t0 = time.perf_counter()
        start = i * kb.n_ctx
        logits = ev.logits(ftoks[start:start + kb.n_ctx])
        targets = ftoks[start + ev.first + 1:start + kb.n_ctx]
        line = acc.add_chunk(logits, targets, np.asarray(kb.records[i]))
        secs.append(time.perf_counter() - t0)
        if progress is not None:
            progress(i + 1, n_chunk, line)
    res = acc.result()
    res.chunk_seconds = secs
    return res


class _CallableModule(type(os)):
    """``synapse_nb.perplexity(model, tokens, ...)`` calls perplexity(): the package exports the
    function under the name of this module, and importing a submodule binds its name in the
    package to the module, so the module itself is the callable."""

    def __call__(self, *args, **kwargs):
        return perplexity(*args, **kwargs)


import sys as _sys  # noqa: E402

_sys.modules[__name__].__class__ = _CallableModule


def _order_stats(L, st, label, key, scale, spec, unit, pcts_hi, pcts_lo, f):
    """Append llama-perplexity's Maximum / high percentiles / Median / low percentiles / Minimum
    lines of one statistic (KLD or Δp) to L, in its order and format."""
    L.append(f"Maximum {label}: {f(scale * st[key + '_max'], spec)}{unit}")
    for _, name in pcts_hi:
        L.append(f"{name}   {label}: {f(scale * st[key + '_pct'][name.strip()], spec)}{unit}")
    L.append(f"Median  {label}: {f(scale * st[key + '_median'], spec)}{unit}")
    for _, name in pcts_lo:
        L.append(f"{name}   {label}: {f(scale * st[key + '_pct'][name.strip()], spec)}{unit}")
    L.append(f"Minimum {label}: {f(scale * st[key + '_min'], spec)}{unit}")
