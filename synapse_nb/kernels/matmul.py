"""Parallel drivers: matmul / matvec / get_rows over GGUF weight rows, one set per ggml type.

DRIVER DESIGN AND ROW-FUNCTION CONTRACT
---------------------------------------
* Numba cannot cache a generic ``@njit(parallel=True, cache=True)`` driver that receives the row
  function as an argument or as a closure variable: both miss the on-disk cache in every new
  process (the dispatcher type / pickled closure differs per process; numba issues 6264, 2956).
  So each format gets its own small drivers (``_act_<A>``, ``_mv_<T>``, ``_mm_<T>``, ``_deq_<T>``; a
  block format's ``_mv_any_<T>`` for weights of rows not a multiple of 4), but they are written
  once, as the templates below. The matvec and matmul ones are serial kernels of a range of chunks,
  which one parallel launcher for every format (``mv_launch``, ``mm_launch``) calls by address
  (kernels/native.py: an address is an int64 argument, which caches), so that a format does not
  compile a parallel region of its own (``Chunked``). The source of each driver is generated from
  its template with the format's row-function names and compiled with this module's file name, so
  Numba's cache finds it again in a new process (its index key is the function's bytecode, the
  same in every process). The formats, and which module holds each one's row functions, come from
  synapse_nb.formats (the one table of formats); ``KERNELS`` is built from it.
* Row functions are ``@kernel(nested=True)`` functions (called by the drivers, never from Python)
  on raw bytes, output first:
    dequantize_row_T(out: float32[K], w_row: uint8[row_bytes]) -> None
    vec_dot_T(w_row: uint8[row_bytes], a_row: uint8[act_row_bytes], scratch: int32[:]) -> float32
    quantize_row_A(out: uint8[act_row_bytes], x: float32[K]) -> None       (A = vec_dot_type)
  ``scratch`` is a C-contiguous int32 array of at least ``scratch_ints(K) = 2*K + 128`` entries,
  allocated once per parallel chunk that calls the single-row function and reused for its rows; a vec_dot may use it
  freely (e.g. the row's int32 products in scratch[:K], float32 views of other parts), it holds
  no state between calls. All slices passed in are C-contiguous 1-D.
  K-quants (kquants.py): ``vec_dot_q2_K_q8_K`` ... ``vec_dot_q6_K_q8_K``, ``vec_dot_iq4_xs_q8_K``
  with the scratch argument above, their ``rows_dot_*_q8_K`` and ``vec_dot4_*_q8_K`` twins,
  ``dequantize_row_q2_K`` ... ``dequantize_row_iq4_xs``, and
  ``quantize_row_q8_K(out, x)`` (292 bytes per 256 values: f32 d, int8 qs[256], int16 bsums[16]).
* Vectorization: Numba builds with LLVM's SLP vectorizer off, and 16/32-trip inner loops get fully
  unrolled before the loop vectorizer runs, so per-block inner loops compile to scalar code. The
  legacy formats therefore do each block's integer work in one explicit-vector LLVM intrinsic
  (block_ir.make_block_lanes_fma: vpdpbusd with AVX512-VNNI, vpmaddubsw + vpmaddwd with AVX2, else a
  portable widening multiply);
  check ``inspect_asm()`` of any new row function for zmm/ymm (benchmarks/bench_kernels.py --asm).
  A row function may ignore ``scratch`` and keep small buffers on its stack (an alloca intrinsic).
* Caching: a driver inlines row functions from other files; kernels/cache_locators.py makes every cached
  kernel of the package depend on all of synapse_nb/kernels/*.py, so an edit anywhere recompiles.
* Every format of legacy.py and kquants.py with N > 1 goes through
  ``rows_dot_T(y, m, w_row, a)``: all activation rows (uint8 [N, act_row_bytes], C-contiguous)
  against one weight row, blocks outer and rows inner so a weight block (a K-quant's 256 values,
  its scales and mins) is decoded once for up to 64 rows (simd.ROWS_GROUP; the float formats
  have nothing to decode: rows_dot4 below); per output the
  operations and their order are exactly vec_dot_T's, which N == 1 uses (matmul rows == matvec
  is tested bitwise for N in 1, 2, 7, 64, 130). Any format may offer one
  (formats.BlockFormat.rows_dot_name); its driver then calls it for N > 1 instead of the
  per-pair loop.
* Several weight rows per call, found by name like rows_dot: ``vec_dot4_T(y1, m, w, a_row)``
  (y1[m + r] for r < 4, one activation row: N == 1) and ``rows_dot8_T`` / ``rows_dot4_T`` /
  ``rows_dot2_T(y, m, w, a)`` (y[:, m + r] for r < 8 / 4 / 2, all activation rows: N > 1), again
  with vec_dot_T's operations per output; the driver takes them for whole groups of rows in a
  chunk, widest first, and the single-row functions for the rest (_row_groups). The template
  formats of legacy.py have vec_dot4 and rows_dot8, IQ4_NL, F32, F16 and BF16 vec_dot4 and
  rows_dot4, the K-quants vec_dot4, Q4_K and Q6_K rows_dot2 (AVX512-VNNI hosts).
* Parallelism: fixed chunks of ``CHUNK_ROWS`` weight rows, each thread a contiguous range of them
  (as ``prange`` splits them); every output element is
  one call of the row function, so results do not depend on the number of threads, and row n of
  ``matmul(W, X)`` is computed by exactly the calls ``matvec(W, X[n])`` makes (matvec is matmul
  with N = 1). Activation rows are converted once per call and reused by every weight row.
"""

import threading
from collections.abc import Mapping
from typing import NamedTuple

import numpy as np
from numba import prange, types  # prange: the launchers' and the generated drivers'

from .. import formats as _F
from ..errors import SynapseError
from . import kquants, legacy, quant_act  # noqa: F401  (the generated drivers call into them)
from .decorator import kernel
from .native import WEIGHT_ROWS, call_at, kind, native_fn, thread_count

CHUNK_ROWS = 16  # weight rows per parallel work item


def scratch_ints(k):
    """int32 scratch entries a vec_dot needs for rows of k weights (per thread)."""
    return 2 * k + 128


# ---------------------------------------------------------------------------------------------
# Driver templates. {mod} is a row-function module (legacy, kquants, quant_act), {fn} a row
# function of it, named as synapse_nb.formats documents.
# ---------------------------------------------------------------------------------------------

_DECORATOR = "@kernel(parallel=True)\n"

# Activation converter: X float32 [N, K] -> A uint8 [N, act_row_bytes], one row per task.
_ACT = _DECORATOR + """def {name}(a, x):
    for n in prange(x.shape[0]):
        {mod}.{quantize}(a[n], x[n])
"""

# The same for one row, serial: a decode step's activation is one row, and a parallel region
# for it would only pay the threads' launch (the row function, hence the bytes, are the same).
_ACT1 = '@kernel\n' + """def {name}(a, x):
    for n in range(x.shape[0]):
        {mod}.{quantize}(a[n], x[n])
"""

# Matmul: y[n, m] = vec_dot(w[m], a[n]), every output one call of the row function (or of its
# rows_dot / vec_dot4 twins, which make the same operations per output). Two drivers per format,
# so that a run compiles (and loads) only the ones it calls: _mv_ for one token (N == 1: the pair
# kernel, or vec_dot4, four weight rows at once, where the format has it; up to three weights),
# _mm_ for several (rows_dot, each weight block decoded once for all activation rows, where it
# has it). Each is a Chunked: the parallel region (mv_launch, mm_launch) is one kernel for every
# format, which gives each thread one contiguous range of the weight rows' chunks of CHUNK_ROWS
# (as a prange over the chunks is split) and calls the format's serial chunk kernel (the
# templates below) by address, one call a thread (a call a chunk was 2-7 % slower). A parallel
# driver per format compiled its region each time: 0.7-1.6 s more than its serial chunk kernel
# (a first run of Qwen2.5 compiles four formats' matvecs).
# The matmul's chunk takes the activation rows ACT_BLOCK at a time (all its weight rows against
# one block, then the next): a block's converted rows stay in L2 for the chunk's weight rows, where
# all 512 rows of a default batch (0.5-2.8 MB) were streamed again for every weight row. Each
# output is the same call's operations whatever the block (the row functions' outputs do not
# depend on the other activation rows they are given).
ACT_BLOCK = 64
_MM_CHUNK = "@kernel(nested=True)\n" + """def {name}(c0, c1, y_all, w, a_all, n_scratch):
    m_rows = w.shape[0]
    for c in range(c0, c1):
        m0 = c * CHUNK_ROWS
        m1 = min(m_rows, m0 + CHUNK_ROWS)
        for n0 in range(0, a_all.shape[0], ACT_BLOCK):
            y = y_all[n0:n0 + ACT_BLOCK]
            a = a_all[n0:n0 + ACT_BLOCK]
{rows}"""
# Matvec of up to three weights that read the same activation row (wq, wk, wv; gate, up; or one
# weight and two of 0 rows): their chunks in one parallel region, each output the same call of
# the row function as alone (a region per weight cost a launch and a wait for the slower thread
# each: ~2 us of a 4 us wk matvec at 2 threads).
_MV_CHUNK = "@kernel(nested=True)\n" + """def {name}(c0, c1, y1, w1, y2, w2, y3, w3, a, n_scratch):
    n1 = (w1.shape[0] + CHUNK_ROWS - 1) // CHUNK_ROWS
    n2 = (w2.shape[0] + CHUNK_ROWS - 1) // CHUNK_ROWS
    for c in range(c0, c1):
        k = c
        if k < n1:
            y, w = y1, w1
        elif k < n1 + n2:
            y, w, k = y2, w2, k - n1
        else:
            y, w, k = y3, w3, k - n1 - n2
        m0 = k * CHUNK_ROWS
        m1 = min(np.int64(w.shape[0]), m0 + CHUNK_ROWS)
{rows}"""
# A legacy format's chunk kernel is a call of the template's kernel (_mv_body_<stem>,
# _mm_body_<stem>): LLVM then optimizes the body's code a second time, in the caller's module, as
# it did a parallel region's, and inlines the row functions (vec_dot4, rows_dot8) that it left a
# call of the first time (Q5_0's and Q4_1's matvecs were 3-4 % slower with the call). A K-quant's
# are too large to be inlined either way (the parallel drivers called them too): no second pass
# (0.4 s of compile).
_OUTER = "@kernel(nested=True)\n" + """def {name}(c0, c1, {args}):
    {body}(c0, c1, {args})
"""

# The drivers' arguments, as graph.SIGNATURES has them after the chunk kernel's address; a chunk
# kernel takes its range of chunks c0, c1, then the same.
_F2 = types.Array(types.float32, 2, "C")
_U8 = types.Array(types.uint8, 2, "C")
MATVEC_ARGS = (_F2, WEIGHT_ROWS, _F2, WEIGHT_ROWS, _F2, WEIGHT_ROWS, _U8, types.int64)  # y1, w1, ..., a, n_scratch
MATMUL_ARGS = (_F2, WEIGHT_ROWS, _U8, types.int64)  # y, w, a, n_scratch
MV_CHUNK_SIG = (types.int64, types.int64, *MATVEC_ARGS)
MM_CHUNK_SIG = (types.int64, types.int64, *MATMUL_ARGS)
_K_MV_CHUNK = kind(*MV_CHUNK_SIG)
_K_MM_CHUNK = kind(*MM_CHUNK_SIG)


@kernel(parallel=True)
def mv_launch(chunk, y1, w1, y2, w2, y3, w3, a, n_scratch):
    """The matvec of up to three weights: chunk(c0, c1, y1, w1, ..., n_scratch) (the address of a
    format's _mv_ chunk kernel; MV_CHUNK_SIG) on the threads, each its own range c0..c1-1 of the
    chunks of CHUNK_ROWS rows of w1, w2 and w3 in turn. The outputs are the chunk kernel's,
    whatever the thread count."""
    n = ((w1.shape[0] + CHUNK_ROWS - 1) // CHUNK_ROWS + (w2.shape[0] + CHUNK_ROWS - 1) // CHUNK_ROWS
         + (w3.shape[0] + CHUNK_ROWS - 1) // CHUNK_ROWS)
    nt = min(np.int64(thread_count()), n)
    for t in prange(nt):
        call_at(_K_MV_CHUNK, chunk, n * t // nt, n * (t + 1) // nt, y1, w1, y2, w2, y3, w3, a, n_scratch)


@kernel(parallel=True)
def mm_launch(chunk, y, w, a, n_scratch):
    """The matmul y = w . a of several activation rows: chunk(c0, c1, y, w, a, n_scratch) (the
    address of a format's _mm_ chunk kernel; MM_CHUNK_SIG) on the threads, each its own range
    c0..c1-1 of the chunks of CHUNK_ROWS rows of w. The outputs are the chunk kernel's, whatever
    the thread count."""
    n = (w.shape[0] + CHUNK_ROWS - 1) // CHUNK_ROWS
    nt = min(np.int64(thread_count()), n)
    for t in prange(nt):
        call_at(_K_MM_CHUNK, chunk, n * t // nt, n * (t + 1) // nt, y, w, a, n_scratch)


class Chunked:
    """A driver in two kernels: ``launch`` (mv_launch or mm_launch: the parallel region, one for
    every format, compiled once) and ``chunk`` (the format's serial kernel of a range of chunks, of
    the signature ``sig``: MV_CHUNK_SIG or MM_CHUNK_SIG), which launch calls by address. Called as
    the driver (MATVEC_ARGS or MATMUL_ARGS, of exactly these types), it compiles or loads the
    chunk kernel on its first call. The layer loop calls launch with the chunk kernel's address
    from its tables (graph.Tables)."""

    __slots__ = ("launch", "chunk", "sig", "_fn")

    def __init__(self, launch, chunk, sig):
        self.launch, self.chunk, self.sig, self._fn = launch, chunk, sig, None

    def __call__(self, *args):
        if self._fn is None:
            self._fn = native_fn(self.chunk, *self.sig)
        self.launch(self._fn.addr, *args)

    def __repr__(self):
        return f"<Chunked {self.chunk.__name__}>"


_MM_PAIRS = """        scratch = np.empty(n_scratch, np.int32)
        for m in range(m0, m1):
            for n in range(a.shape[0]):
                y[n, m] = {mod}.{dot}(w[m], a[n], scratch)
"""


def _row_groups(groups, single, per_row=False):
    """Driver source for the rows m0..m1 of a chunk: whole groups of each (width, call) in groups,
    widest first, then the rows left one by one by ``single`` (calls written with m, resp. r).
    per_row: all that for each activation row n in turn (calls written with n too), the chunk's
    weights read from memory once and from the cache for the next rows. ``single`` None (one
    group, per_row, its call written as ``dot4(y[n], m, w, a[n])``): the rows left, fewer than
    the group's width, are computed by the same call on a copy of them padded to the width with
    the last one, and copied out (the same operations per row; a driver then holds one row
    function, not two: the single-row function was about a third of a K-quant decode driver's
    compile). ``single`` "": no rows are left (the caller's weights have a multiple of the
    widths' rows, as CHUNK_ROWS is)."""
    if single is None:
        # one call site (a second one doubled the driver's compile); plain loops (Numba's slice
        # assignment is seconds of compile)
        (width, call), = groups
        src = (f"yr, wr, mr = y[n], w, m\nwhile m < m1:\n    if m + {width} > m1:\n"
               f"        wr = np.empty(({width}, w.shape[1]), np.uint8)\n"
               f"        for i in range({width}):\n            for j in range(w.shape[1]):\n"
               f"                wr[i, j] = w[min(m + i, m1 - 1), j]\n"
               f"        yr, mr = np.empty({width}, np.float32), 0\n"
               f"    {call.replace('(y[n], m, w,', '(yr, mr, wr,')}\n"
               f"    if m + {width} > m1:\n        for i in range(m1 - m):\n            y[n, m + i] = yr[i]\n"
               f"    m += {width}\n    mr += {width}\n")
    else:
        src = "".join(f"while m + {width} <= m1:\n    {call}\n    m += {width}\n" for width, call in groups)
        if single:
            # the single-row calls' scratch, allocated only by a chunk that has such rows (an
            # allocation per chunk was ~10 % of a decode matvec of 576-value rows)
            src += (f"if m < m1:\n    scratch = np.empty(n_scratch, np.int32)\n    for r in range(m, m1):\n"
                    f"        {single}\n")
    if per_row:
        src = "for n in range(a.shape[0]):\n    m = m0\n" + "".join(f"    {line}\n" for line in src.splitlines())
    else:
        src = "m = m0\n" + src
    return "".join(f"        {line}\n" for line in src.splitlines())


# Row dequantizer (get_rows / dequantize): out[i] = dequantize(w[ids[i]]). Serial: a forward's
# embedding rows take well under a millisecond (512 rows of Qwen2.5's Q5_0 0.11 ms, 0.06 ms on two
# threads), and a parallel region cost a first run 0.3-0.6 s more compile.
_DEQ = "@kernel\n" + """def {name}(out, w, ids):
    for i in range(ids.size):
        {mod}.{deq}(out[i], w[ids[i]])
"""


def _define(src):
    """Compile generated driver source into this module under this file's name (for the cache)."""
    exec(compile(src, __file__, "exec"), globals())


class Kernels(NamedTuple):
    """The drivers of one weight type: its activation type's name (vec_dot_type) and converter
    (act: X float32 [N, K] -> uint8 [N, act_row_bytes]), matmul (mm: N > 1 rows, a Chunked) as (y
    float32 [N, M], w uint8 [M, row_bytes], a, n_scratch), matvec (mv: one activation row, a Chunked) as
    (y1, w1, y2, w2, y3, w3, a, n_scratch), y_i = w_i . a for three weights of this type and n_in
    (a weight of 0 rows and a y of 0 rows for none) whose rows are each a multiple of mv_rows
    (else mv_any, the same bits), and the row dequantizer (deq: out float32 [len(ids), K], w, ids
    int64)."""

    act_type: str
    act: object
    mv: object
    mm: object
    deq: object
    mv_rows: int  # mv takes weights of a multiple of this many rows (1: any)
    mv_any: object  # the matvec of any other weight (mv itself when mv_rows is 1)


class _Drivers(Mapping):
    """A read-only mapping of ggml type names to drivers, each generated and compiled into this
    module on its first lookup (``make(fmt)`` of the name's format, from ``formats``: name ->
    formats.BlockFormat): a run generates only its model's formats' (all of them were 17 ms of
    every start). Keys: every type that has drivers. Thread-safe."""

    def __init__(self, formats: dict, make):
        self._formats, self._make, self._made, self._lock = formats, make, {}, threading.Lock()

    def __getitem__(self, name):
        got = self._made.get(name)
        if got is None:
            fmt = self._formats[name]  # KeyError for a type without drivers
            with self._lock:
                got = self._made.get(name)
                if got is None:
                    got = self._made[name] = self._make(fmt)
        return got

    def __iter__(self):
        return iter(self._formats)

    def __len__(self) -> int:
        return len(self._formats)


_MODS = {"legacy": legacy, "kquants": kquants, "quant_act": quant_act}


def _act_driver(fmt, template: str, prefix: str):
    _define(template.format(name=f"{prefix}{fmt.stem}", mod=fmt.quantize_kernels, quantize=f"quantize_row_{fmt.stem}"))
    return globals()[f"{prefix}{fmt.stem}"]


def _chunk_kernel(template, prefix, stem, rows, mod, args):
    """Define the chunk kernel <prefix><stem> from template with the chunk's rows: for a legacy
    format, a call of <prefix>body_<stem> so defined (see _OUTER)."""
    if mod == "kquants":
        _define(template.format(name=f"{prefix}{stem}", rows=rows))
    else:
        _define(template.format(name=f"{prefix}body_{stem}", rows=rows))
        _define(_OUTER.format(name=f"{prefix}{stem}", body=f"{prefix}body_{stem}", args=args))


def _weight_kernels(fmt) -> Kernels:
    mod = fmt.kernels
    m_ = _MODS[mod]
    dot, dot4, rows = fmt.vec_dot_name(), fmt.vec_dot4_name(), fmt.rows_dot_name()
    # a K-quant's rows left over are computed by its vec_dot4 too (a padded group): its
    # single-row function was 1-2.5 s of its decode driver's 5-7 s of compile; a block format's
    # is small, and the padding's code cost its driver 0.5 s more than it saved
    groups = [(4, f"{mod}.{dot4}(y[n], m, w, a[n])")] if hasattr(m_, dot4) else []
    single = None if groups and mod == "kquants" else f"y[n, r] = {mod}.{dot}(w[r], a[n], scratch)"
    one = _row_groups(groups, single, per_row=True)
    # a block format's matvec of whole four-row groups, without the single-row function (0.27-0.29
    # s of its compile, for a weight whose rows are not a multiple of 4: no real model's so far),
    # beside the one with it, compiled only for a model that has such a weight (mv_rows: the
    # group's width, which mv's rows must be a multiple of, as no row is left to a single call)
    mv_rows = groups[0][0] if groups and single is not None else 1
    if mv_rows > 1:
        _chunk_kernel(_MV_CHUNK, "_mv_any_", fmt.stem, one, mod, "y1, w1, y2, w2, y3, w3, a, n_scratch")
        one = _row_groups(groups, "", per_row=True)
    if hasattr(m_, rows):
        wide = [(k, rows.replace("rows_dot_", f"rows_dot{k}_", 1)) for k in (8, 4, 2)]
        many = _row_groups([(k, f"{mod}.{fn}(y, m, w, a)") for k, fn in wide if hasattr(m_, fn)],
                           f"{mod}.{rows}(y, r, w[r], a)")
    else:
        many = _MM_PAIRS.format(mod=mod, dot=dot)
    _chunk_kernel(_MV_CHUNK, "_mv_", fmt.stem, one, mod, "y1, w1, y2, w2, y3, w3, a, n_scratch")
    _chunk_kernel(_MM_CHUNK, "_mm_", fmt.stem, "".join(f"    {line}\n" for line in many.splitlines()), mod,
                  "y_all, w, a_all, n_scratch")
    _define(_DEQ.format(name=f"_deq_{fmt.stem}", mod=mod, deq=f"dequantize_row_{fmt.stem}"))
    mv = Chunked(mv_launch, globals()[f"_mv_{fmt.stem}"], MV_CHUNK_SIG)
    return Kernels(fmt.vec_dot_type, ACT_DRIVERS[fmt.vec_dot_type], mv,
                   Chunked(mm_launch, globals()[f"_mm_{fmt.stem}"], MM_CHUNK_SIG), globals()[f"_deq_{fmt.stem}"],
                   mv_rows, Chunked(mv_launch, globals()[f"_mv_any_{fmt.stem}"], MV_CHUNK_SIG) if mv_rows > 1 else mv)


def _build_tables():
    acts = {fmt.name: fmt for fmt in _F.registered_formats().values() if fmt.quantize_kernels is not None}
    weights = {fmt.name: fmt for fmt in _F.weight_formats()}
    for fmt in weights.values():
        m_ = _MODS[fmt.kernels]
        for fn in (fmt.vec_dot_name(), f"dequantize_row_{fmt.stem}"):
            if not hasattr(m_, fn):  # a format registered without its row functions: at import, not at first use
                raise ImportError(f"synapse_nb.kernels.{fmt.kernels} has no {fn} (formats.{fmt.name}.kernels)")
    return (_Drivers(acts, lambda fmt: _act_driver(fmt, _ACT, "_act_")),
            _Drivers(acts, lambda fmt: _act_driver(fmt, _ACT1, "_act1_")),
            _Drivers(weights, _weight_kernels))


# ggml activation type name -> converter (ACT1_DRIVERS: its serial twin for one row); ggml weight
# type name -> its Kernels. Each generated on first lookup (_Drivers).
# Block sizes and byte counts: formats.py.
ACT_DRIVERS, ACT1_DRIVERS, KERNELS = _build_tables()


def kernels_for(type_name, what="tensor"):
    """The Kernels of a ggml type name.

    Raises SynapseError when the type has no kernels.
    """
    try:
        return KERNELS[type_name]
    except KeyError:
        raise SynapseError(f"{what}: weight type {type_name} is not supported by the kernels") from None
