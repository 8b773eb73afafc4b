"""Parallel drivers: matmul / matvec / get_rows over GGUF weight rows, one table per ggml type.

DRIVER DESIGN AND ROW-FUNCTION CONTRACT (settled 2026-11-29; the K-quant helper follows it)
------------------------------------------------------------------------------------------
* Numba cannot cache a generic ``@njit(parallel=True, cache=True)`` driver that receives the row
  function as an argument or as a closure variable: both miss the on-disk cache in every new
  process (measured: the dispatcher type / pickled closure differs per process). So each format
  has its own small driver below (``_mm_<type>``, ``_deq_<type>``), written out explicitly; they
  all have the same body. The qtype -> driver choice is made in Python from ``KERNELS``.
* Row functions are plain ``@njit(cache=True)`` functions on raw bytes, output first:
    dequantize_row_T(out: float32[K], w_row: uint8[row_bytes]) -> None
    vec_dot_T(w_row: uint8[row_bytes], a_row: uint8[act_row_bytes], scratch: int32[:]) -> float32
    quantize_row_A(out: uint8[act_row_bytes], x: float32[K]) -> None       (A = vec_dot_type)
  ``scratch`` is a C-contiguous int32 array of at least ``scratch_ints(K) = 2*K + 128`` entries,
  allocated once per parallel chunk and reused for every row of the chunk; a vec_dot may use it
  freely (e.g. the row's int32 products in scratch[:K], float32 views of other parts), it holds
  no state between calls. All slices passed in are C-contiguous 1-D.
  K-quants (kquants.py): ``vec_dot_q2_K_q8_K`` ... ``vec_dot_q6_K_q8_K``, ``vec_dot_iq4_xs_q8_K``
  with the scratch argument above, ``dequantize_row_q2_K`` ... ``dequantize_row_iq4_xs``, and
  ``quantize_row_q8_K(out, x)`` (292 bytes per 256 values: f32 d, int8 qs[256], int16 bsums[16]).
* Vectorization: Numba builds with LLVM's SLP vectorizer off, and 16/32-trip inner loops get fully
  unrolled before the loop vectorizer runs, so per-block inner loops compile to scalar code. The
  legacy formats therefore do each block's integer work in one explicit-vector LLVM intrinsic
  (common.make_block_lanes_fma: vpdpbusd with AVX512-VNNI, else a portable widening multiply);
  check ``inspect_asm()`` of any new row function for zmm/ymm (benchmarks/bench_kernels.py --asm).
  A row function may ignore ``scratch`` and keep small buffers on its stack (an alloca intrinsic).
* Caching hazard: Numba's on-disk cache of a driver is keyed on matmul.py alone; it does not
  notice edits to the row functions it inlined (legacy.py, kquants.py, quant_act.py, common.py).
  ``kernels_for`` therefore drops matmul.py's cache files, once per process, when one of those
  sources is newer than them (see _drop_stale_driver_cache).
* Legacy quant formats with N > 1 go through ``rows_dot_T(y, m, w_row, a)`` (legacy.py): all
  activation rows against one weight row, blocks outer and rows inner so a weight block is decoded
  once for up to 64 rows; per output the operations and their order are exactly vec_dot_T's, which
  N == 1 uses (matmul rows == matvec is tested bitwise for N in 1, 7, 64, 130).
  A K-quant may offer the same later; the drivers then call it instead of the per-pair loop.
* Parallelism: ``prange`` over fixed chunks of ``CHUNK_ROWS`` weight rows; every output element is
  one call of the row function, so results do not depend on the number of threads, and row n of
  ``matmul(W, X)`` is computed by exactly the calls ``matvec(W, X[n])`` makes (matvec is matmul
  with N = 1). Activation rows are converted once per call and reused by every weight row.
"""

import numpy as np
from numba import njit, prange

from ..errors import SynapseError
from . import legacy as L
from . import quant_act as QA

try:  # the K-quant row functions come from kquants.py (written by another helper)
    from . import kquants as KQ
except ModuleNotFoundError as e:  # pragma: no cover - only while kquants.py does not exist yet
    if e.name != __name__.rsplit(".", 1)[0] + ".kquants":
        raise
    KQ = None

CHUNK_ROWS = 16  # weight rows per parallel work item


def scratch_ints(k):
    """int32 scratch entries a vec_dot needs for rows of k weights (per thread)."""
    return 2 * k + 128


# ---------------------------------------------------------------------------------------------
# Activation converters: X float32 [N, K] -> A uint8 [N, act_row_bytes], one row per task.
# ---------------------------------------------------------------------------------------------


@njit(parallel=True, cache=True, error_model="numpy")
def _act_q8_0(a, x):
    for n in prange(x.shape[0]):
        QA.quantize_row_q8_0(a[n], x[n])


@njit(parallel=True, cache=True, error_model="numpy")
def _act_q8_1(a, x):
    for n in prange(x.shape[0]):
        QA.quantize_row_q8_1(a[n], x[n])


@njit(parallel=True, cache=True, error_model="numpy")
def _act_f16(a, x):
    for n in prange(x.shape[0]):
        QA.quantize_row_f16(a[n], x[n])


@njit(parallel=True, cache=True, error_model="numpy")
def _act_bf16(a, x):
    for n in prange(x.shape[0]):
        QA.quantize_row_bf16(a[n], x[n])


@njit(parallel=True, cache=True, error_model="numpy")
def _act_f32(a, x):
    for n in prange(x.shape[0]):
        QA.quantize_row_f32(a[n], x[n])


@njit(parallel=True, cache=True, error_model="numpy")
def _act_q8_K(a, x):
    for n in prange(x.shape[0]):
        KQ.quantize_row_q8_K(a[n], x[n])


# ---------------------------------------------------------------------------------------------
# Matmul drivers: y[n, m] = vec_dot(w[m], a[n]). Same body for every format (see header).
# ---------------------------------------------------------------------------------------------


@njit(parallel=True, cache=True, error_model="numpy")
def _mm_f32(y, w, a, n_scratch):
    m_rows = w.shape[0]
    for c in prange((m_rows + CHUNK_ROWS - 1) // CHUNK_ROWS):
        scratch = np.empty(n_scratch, np.int32)
        for m in range(c * CHUNK_ROWS, min(m_rows, (c + 1) * CHUNK_ROWS)):
            for n in range(a.shape[0]):
                y[n, m] = L.vec_dot_f32(w[m], a[n], scratch)


@njit(parallel=True, cache=True, error_model="numpy")
def _mm_f16(y, w, a, n_scratch):
    m_rows = w.shape[0]
    for c in prange((m_rows + CHUNK_ROWS - 1) // CHUNK_ROWS):
        scratch = np.empty(n_scratch, np.int32)
        for m in range(c * CHUNK_ROWS, min(m_rows, (c + 1) * CHUNK_ROWS)):
            for n in range(a.shape[0]):
                y[n, m] = L.vec_dot_f16(w[m], a[n], scratch)


@njit(parallel=True, cache=True, error_model="numpy")
def _mm_bf16(y, w, a, n_scratch):
    m_rows = w.shape[0]
    for c in prange((m_rows + CHUNK_ROWS - 1) // CHUNK_ROWS):
        scratch = np.empty(n_scratch, np.int32)
        for m in range(c * CHUNK_ROWS, min(m_rows, (c + 1) * CHUNK_ROWS)):
            for n in range(a.shape[0]):
                y[n, m] = L.vec_dot_bf16(w[m], a[n], scratch)


@njit(parallel=True, cache=True, error_model="numpy")
def _mm_q4_0(y, w, a, n_scratch):
    m_rows = w.shape[0]
    for c in prange((m_rows + CHUNK_ROWS - 1) // CHUNK_ROWS):
        scratch = np.empty(n_scratch, np.int32)
        for m in range(c * CHUNK_ROWS, min(m_rows, (c + 1) * CHUNK_ROWS)):
            if a.shape[0] == 1:  # one token: the pair kernel (accumulators stay in a register)
                y[0, m] = L.vec_dot_q4_0_q8_0(w[m], a[0], scratch)
            else:
                L.rows_dot_q4_0_q8_0(y, m, w[m], a)


@njit(parallel=True, cache=True, error_model="numpy")
def _mm_q4_1(y, w, a, n_scratch):
    m_rows = w.shape[0]
    for c in prange((m_rows + CHUNK_ROWS - 1) // CHUNK_ROWS):
        scratch = np.empty(n_scratch, np.int32)
        for m in range(c * CHUNK_ROWS, min(m_rows, (c + 1) * CHUNK_ROWS)):
            if a.shape[0] == 1:  # one token: the pair kernel (accumulators stay in a register)
                y[0, m] = L.vec_dot_q4_1_q8_1(w[m], a[0], scratch)
            else:
                L.rows_dot_q4_1_q8_1(y, m, w[m], a)


@njit(parallel=True, cache=True, error_model="numpy")
def _mm_q5_0(y, w, a, n_scratch):
    m_rows = w.shape[0]
    for c in prange((m_rows + CHUNK_ROWS - 1) // CHUNK_ROWS):
        scratch = np.empty(n_scratch, np.int32)
        for m in range(c * CHUNK_ROWS, min(m_rows, (c + 1) * CHUNK_ROWS)):
            if a.shape[0] == 1:  # one token: the pair kernel (accumulators stay in a register)
                y[0, m] = L.vec_dot_q5_0_q8_0(w[m], a[0], scratch)
            else:
                L.rows_dot_q5_0_q8_0(y, m, w[m], a)


@njit(parallel=True, cache=True, error_model="numpy")
def _mm_q5_1(y, w, a, n_scratch):
    m_rows = w.shape[0]
    for c in prange((m_rows + CHUNK_ROWS - 1) // CHUNK_ROWS):
        scratch = np.empty(n_scratch, np.int32)
        for m in range(c * CHUNK_ROWS, min(m_rows, (c + 1) * CHUNK_ROWS)):
            if a.shape[0] == 1:  # one token: the pair kernel (accumulators stay in a register)
                y[0, m] = L.vec_dot_q5_1_q8_1(w[m], a[0], scratch)
            else:
                L.rows_dot_q5_1_q8_1(y, m, w[m], a)


@njit(parallel=True, cache=True, error_model="numpy")
def _mm_q8_0(y, w, a, n_scratch):
    m_rows = w.shape[0]
    for c in prange((m_rows + CHUNK_ROWS - 1) // CHUNK_ROWS):
        scratch = np.empty(n_scratch, np.int32)
        for m in range(c * CHUNK_ROWS, min(m_rows, (c + 1) * CHUNK_ROWS)):
            if a.shape[0] == 1:  # one token: the pair kernel (accumulators stay in a register)
                y[0, m] = L.vec_dot_q8_0_q8_0(w[m], a[0], scratch)
            else:
                L.rows_dot_q8_0_q8_0(y, m, w[m], a)


@njit(parallel=True, cache=True, error_model="numpy")
def _mm_iq4_nl(y, w, a, n_scratch):
    m_rows = w.shape[0]
    for c in prange((m_rows + CHUNK_ROWS - 1) // CHUNK_ROWS):
        scratch = np.empty(n_scratch, np.int32)
        for m in range(c * CHUNK_ROWS, min(m_rows, (c + 1) * CHUNK_ROWS)):
            if a.shape[0] == 1:  # one token: the pair kernel (accumulators stay in a register)
                y[0, m] = L.vec_dot_iq4_nl_q8_0(w[m], a[0], scratch)
            else:
                L.rows_dot_iq4_nl_q8_0(y, m, w[m], a)


@njit(parallel=True, cache=True, error_model="numpy")
def _mm_q2_K(y, w, a, n_scratch):
    m_rows = w.shape[0]
    for c in prange((m_rows + CHUNK_ROWS - 1) // CHUNK_ROWS):
        scratch = np.empty(n_scratch, np.int32)
        for m in range(c * CHUNK_ROWS, min(m_rows, (c + 1) * CHUNK_ROWS)):
            for n in range(a.shape[0]):
                y[n, m] = KQ.vec_dot_q2_K_q8_K(w[m], a[n], scratch)


@njit(parallel=True, cache=True, error_model="numpy")
def _mm_q3_K(y, w, a, n_scratch):
    m_rows = w.shape[0]
    for c in prange((m_rows + CHUNK_ROWS - 1) // CHUNK_ROWS):
        scratch = np.empty(n_scratch, np.int32)
        for m in range(c * CHUNK_ROWS, min(m_rows, (c + 1) * CHUNK_ROWS)):
            for n in range(a.shape[0]):
                y[n, m] = KQ.vec_dot_q3_K_q8_K(w[m], a[n], scratch)


@njit(parallel=True, cache=True, error_model="numpy")
def _mm_q4_K(y, w, a, n_scratch):
    m_rows = w.shape[0]
    for c in prange((m_rows + CHUNK_ROWS - 1) // CHUNK_ROWS):
        scratch = np.empty(n_scratch, np.int32)
        for m in range(c * CHUNK_ROWS, min(m_rows, (c + 1) * CHUNK_ROWS)):
            for n in range(a.shape[0]):
                y[n, m] = KQ.vec_dot_q4_K_q8_K(w[m], a[n], scratch)


@njit(parallel=True, cache=True, error_model="numpy")
def _mm_q5_K(y, w, a, n_scratch):
    m_rows = w.shape[0]
    for c in prange((m_rows + CHUNK_ROWS - 1) // CHUNK_ROWS):
        scratch = np.empty(n_scratch, np.int32)
        for m in range(c * CHUNK_ROWS, min(m_rows, (c + 1) * CHUNK_ROWS)):
            for n in range(a.shape[0]):
                y[n, m] = KQ.vec_dot_q5_K_q8_K(w[m], a[n], scratch)


@njit(parallel=True, cache=True, error_model="numpy")
def _mm_q6_K(y, w, a, n_scratch):
    m_rows = w.shape[0]
    for c in prange((m_rows + CHUNK_ROWS - 1) // CHUNK_ROWS):
        scratch = np.empty(n_scratch, np.int32)
        for m in range(c * CHUNK_ROWS, min(m_rows, (c + 1) * CHUNK_ROWS)):
            for n in range(a.shape[0]):
                y[n, m] = KQ.vec_dot_q6_K_q8_K(w[m], a[n], scratch)


@njit(parallel=True, cache=True, error_model="numpy")
def _mm_iq4_xs(y, w, a, n_scratch):
    m_rows = w.shape[0]
    for c in prange((m_rows + CHUNK_ROWS - 1) // CHUNK_ROWS):
        scratch = np.empty(n_scratch, np.int32)
        for m in range(c * CHUNK_ROWS, min(m_rows, (c + 1) * CHUNK_ROWS)):
            for n in range(a.shape[0]):
                y[n, m] = KQ.vec_dot_iq4_xs_q8_K(w[m], a[n], scratch)


# ---------------------------------------------------------------------------------------------
# Row dequantizers (get_rows / dequantize): out[i] = dequantize(w[ids[i]]).
# ---------------------------------------------------------------------------------------------


@njit(parallel=True, cache=True, error_model="numpy")
def _deq_f32(out, w, ids):
    for i in prange(ids.size):
        L.dequantize_row_f32(out[i], w[ids[i]])


@njit(parallel=True, cache=True, error_model="numpy")
def _deq_f16(out, w, ids):
    for i in prange(ids.size):
        L.dequantize_row_f16(out[i], w[ids[i]])


@njit(parallel=True, cache=True, error_model="numpy")
def _deq_bf16(out, w, ids):
    for i in prange(ids.size):
        L.dequantize_row_bf16(out[i], w[ids[i]])


@njit(parallel=True, cache=True, error_model="numpy")
def _deq_q4_0(out, w, ids):
    for i in prange(ids.size):
        L.dequantize_row_q4_0(out[i], w[ids[i]])


@njit(parallel=True, cache=True, error_model="numpy")
def _deq_q4_1(out, w, ids):
    for i in prange(ids.size):
        L.dequantize_row_q4_1(out[i], w[ids[i]])


@njit(parallel=True, cache=True, error_model="numpy")
def _deq_q5_0(out, w, ids):
    for i in prange(ids.size):
        L.dequantize_row_q5_0(out[i], w[ids[i]])


@njit(parallel=True, cache=True, error_model="numpy")
def _deq_q5_1(out, w, ids):
    for i in prange(ids.size):
        L.dequantize_row_q5_1(out[i], w[ids[i]])


@njit(parallel=True, cache=True, error_model="numpy")
def _deq_q8_0(out, w, ids):
    for i in prange(ids.size):
        L.dequantize_row_q8_0(out[i], w[ids[i]])


@njit(parallel=True, cache=True, error_model="numpy")
def _deq_iq4_nl(out, w, ids):
    for i in prange(ids.size):
        L.dequantize_row_iq4_nl(out[i], w[ids[i]])


@njit(parallel=True, cache=True, error_model="numpy")
def _deq_q2_K(out, w, ids):
    for i in prange(ids.size):
        KQ.dequantize_row_q2_K(out[i], w[ids[i]])


@njit(parallel=True, cache=True, error_model="numpy")
def _deq_q3_K(out, w, ids):
    for i in prange(ids.size):
        KQ.dequantize_row_q3_K(out[i], w[ids[i]])


@njit(parallel=True, cache=True, error_model="numpy")
def _deq_q4_K(out, w, ids):
    for i in prange(ids.size):
        KQ.dequantize_row_q4_K(out[i], w[ids[i]])


@njit(parallel=True, cache=True, error_model="numpy")
def _deq_q5_K(out, w, ids):
    for i in prange(ids.size):
        KQ.dequantize_row_q5_K(out[i], w[ids[i]])


@njit(parallel=True, cache=True, error_model="numpy")
def _deq_q6_K(out, w, ids):
    for i in prange(ids.size):
        KQ.dequantize_row_q6_K(out[i], w[ids[i]])


@njit(parallel=True, cache=True, error_model="numpy")
def _deq_iq4_xs(out, w, ids):
    for i in prange(ids.size):
        KQ.dequantize_row_iq4_xs(out[i], w[ids[i]])


# ---------------------------------------------------------------------------------------------
# The table: ggml type name -> (activation format name, activation converter, matmul, dequant).
# Block sizes and byte counts come from synapse_nb.formats.
# ---------------------------------------------------------------------------------------------

_LEGACY = {
    "F32": ("F32", _act_f32, _mm_f32, _deq_f32),
    "F16": ("F16", _act_f16, _mm_f16, _deq_f16),
    "BF16": ("BF16", _act_bf16, _mm_bf16, _deq_bf16),
    "Q4_0": ("Q8_0", _act_q8_0, _mm_q4_0, _deq_q4_0),
    "Q4_1": ("Q8_1", _act_q8_1, _mm_q4_1, _deq_q4_1),
    "Q5_0": ("Q8_0", _act_q8_0, _mm_q5_0, _deq_q5_0),
    "Q5_1": ("Q8_1", _act_q8_1, _mm_q5_1, _deq_q5_1),
    "Q8_0": ("Q8_0", _act_q8_0, _mm_q8_0, _deq_q8_0),
    "IQ4_NL": ("Q8_0", _act_q8_0, _mm_iq4_nl, _deq_iq4_nl),
}
_KQUANTS = {
    "Q2_K": ("Q8_K", _act_q8_K, _mm_q2_K, _deq_q2_K),
    "Q3_K": ("Q8_K", _act_q8_K, _mm_q3_K, _deq_q3_K),
    "Q4_K": ("Q8_K", _act_q8_K, _mm_q4_K, _deq_q4_K),
    "Q5_K": ("Q8_K", _act_q8_K, _mm_q5_K, _deq_q5_K),
    "Q6_K": ("Q8_K", _act_q8_K, _mm_q6_K, _deq_q6_K),
    "IQ4_XS": ("Q8_K", _act_q8_K, _mm_iq4_xs, _deq_iq4_xs),
}
KERNELS = dict(_LEGACY)
if KQ is not None:
    KERNELS.update(_KQUANTS)


_CACHE_CHECKED = False


def _drop_stale_driver_cache():
    """Delete this module's Numba cache files if a module whose functions they inline is newer.

    Numba keys a cached function on its own source file only, so without this an edited row
    kernel would keep running in its old compiled form inside the drivers.
    """
    import glob
    import os

    here = os.path.dirname(os.path.abspath(__file__))
    cached = glob.glob(os.path.join(here, "__pycache__", "matmul.*.nb[ic]"))
    if not cached:
        return
    deps = [os.path.join(here, f) for f in ("legacy.py", "kquants.py", "quant_act.py", "common.py")]
    newest_dep = max((os.path.getmtime(f) for f in deps if os.path.exists(f)), default=0.0)
    if newest_dep > min(os.path.getmtime(f) for f in cached):
        for f in cached:
            try:
                os.remove(f)
            except OSError:
                pass


def ensure_fresh_cache():
    """Run _drop_stale_driver_cache once per process, before any driver is first called."""
    global _CACHE_CHECKED
    if not _CACHE_CHECKED:
        _CACHE_CHECKED = True
        _drop_stale_driver_cache()


def kernels_for(type_name, what="tensor"):
    """(act_type_name, act_driver, matmul_driver, dequant_driver) for a ggml type name.

    Raises SynapseError when the type has no kernels.
    """
    ensure_fresh_cache()
    try:
        return KERNELS[type_name]
    except KeyError:
        raise SynapseError(f"{what}: weight type {type_name} is not supported by the kernels") from None


