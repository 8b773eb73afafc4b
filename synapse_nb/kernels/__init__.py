"""Numba kernels on GGUF weights: matmul, matvec, get_rows, dequantize, quantize_activations.

Weights are TensorInfo-like objects (see synapse_nb.gguf_file): ``.name``, ``.ggml_type``
(gguf.GGMLQuantizationType), ``.shape`` (numpy order: a weight is (n_out, n_in) = (M, K)) and
``.data`` (uint8 1-D view of the memory-mapped bytes, never copied). Every wrapper validates
shapes, dtypes and sizes in Python and raises SynapseError (one line naming the tensor) before a
kernel runs; the kernels themselves do not bounds-check.

``bind(w)`` validates a weight once (as the model loader does) and returns a BoundWeight whose
``matmul`` / ``get_rows`` call the kernels directly, with no per-call checks: the caller
guarantees the shapes (Model.forward, whose buffers are sized once per session). The public
``matmul`` / ``matvec`` / ``get_rows`` / ``dequantize`` bind, validate their arguments, then call.

Numerics: activations are converted to the weight's vec_dot_type exactly as ggml-cpu does on x86
(Q8_0 / Q8_1 / Q8_K blocks, F16, BF16, or F32 unchanged), integer block dots are exact and the
float accumulation reproduces ggml's AVX2/AVX-512 lane order (see kernels/legacy.py). Row n of
``matmul(w, X)`` equals ``matvec(w, X[n])`` bit for bit, for any thread count.

Every Numba function of this package is decorated with decorator.kernel, the one policy:
cached (stamped with all of kernels/*.py, see cache_locators.py) and compiled with
``error_model="numpy"``: a division by zero gives inf or nan as in ggml's C, instead of Numba's
default Python semantics, which raise ZeroDivisionError from inside a parallel region (seen with
an inf in a corrupted norm weight: "SystemError ... returned a result with an exception set").
Finite results are unchanged.
"""

import numpy as np

from ..errors import SynapseError
from .. import formats as _F
from . import matmul as _mm

__all__ = ["bind", "BoundWeight", "matmul", "matvec", "get_rows", "dequantize", "quantize_activations",
           "supported_types"]


def supported_types():
    """ggml type names (e.g. 'Q4_0') that have kernels in this build."""
    return sorted(_mm.KERNELS)


def _tname(w):
    return getattr(w, "name", "<tensor>")


def _weight_rows(w):
    """Validate a weight tensor and return (format, kernels, rows uint8 [M, row_bytes], M, K).

    Raises SynapseError naming the tensor."""
    name = _tname(w)
    try:
        fmt = _F.format_of(w.ggml_type)
    except KeyError:
        raise SynapseError(f"tensor {name}: ggml type {w.ggml_type!r} is not supported") from None
    kern = _mm.kernels_for(fmt.name, f"tensor {name}")
    shape = tuple(int(s) for s in w.shape)
    if len(shape) != 2:
        raise SynapseError(f"tensor {name}: expected a 2-D weight (n_out, n_in), got shape {shape}")
    m, k = shape
    if m <= 0 or k <= 0 or k % fmt.block_size:
        raise SynapseError(f"tensor {name}: n_in {k} is not a positive multiple of the {fmt.name} "
                           f"block size {fmt.block_size}")
    rb = fmt.row_bytes(k)
    data = w.data
    if not isinstance(data, np.ndarray) or data.ndim != 1:
        raise SynapseError(f"tensor {name}: data must be a 1-D numpy array")
    if data.dtype != np.uint8:
        data = data.view(np.uint8) if data.flags.c_contiguous else None
        if data is None or data.ndim != 1:
            raise SynapseError(f"tensor {name}: data must be a contiguous byte array")
    if not data.flags.c_contiguous:
        raise SynapseError(f"tensor {name}: data is not contiguous")
    if data.size != m * rb:
        raise SynapseError(f"tensor {name}: {data.size} bytes of data, expected {m} rows x {rb} bytes "
                           f"for {fmt.name} shape {shape}")
    rows = data.reshape(m, rb)
    if rows.flags.writeable:  # the kernels' signatures take read-only rows (native.WEIGHT_ROWS), as mapped
        rows.flags.writeable = False
    return fmt, kern, rows, m, k


def _check_x(name, x, k, ndim):
    if not isinstance(x, np.ndarray) or x.dtype != np.float32:
        raise SynapseError(f"tensor {name}: activations must be a float32 numpy array")
    if x.ndim != ndim:
        raise SynapseError(f"tensor {name}: activations must be {ndim}-D, got shape {x.shape}")
    if not x.flags.c_contiguous:
        raise SynapseError(f"tensor {name}: activations must be C-contiguous")
    if x.shape[-1] != k:
        raise SynapseError(f"tensor {name}: activations have {x.shape[-1]} columns, the weight has n_in {k}")


def _check_out(name, out, shape):
    if out is None:
        return np.empty(shape, np.float32)
    if (not isinstance(out, np.ndarray) or out.dtype != np.float32 or out.shape != shape
            or not out.flags.c_contiguous or not out.flags.writeable):
        raise SynapseError(f"tensor {name}: out must be a writable C-contiguous float32 array of shape {shape}")
    return out


def quantize_activations(x, act_type):
    """Convert float32 activations to a vec_dot_type ('Q8_0', 'Q8_1', 'Q8_K', 'F16', 'BF16', 'F32').

    x: float32 C-contiguous [K] or [N, K], K a multiple of the block size (32, or 256 for Q8_K).
    Returns uint8 [act_row_bytes] or [N, act_row_bytes]: ggml's block bytes, reproducing
    ggml-cpu's from_float (x86 quantize_row_q8_0 / quantize_row_q8_1 / quantize_row_q8_K,
    ggml_cpu_fp32_to_fp16 / _bf16). Raises SynapseError on bad input.
    """
    try:
        afmt = _F.format_of(act_type)
    except KeyError:
        raise SynapseError(f"activation type {act_type!r} is not supported") from None
    drv = _mm.ACT_DRIVERS.get(afmt.name)
    if drv is None:
        raise SynapseError(f"activation type {afmt.name} has no converter")
    if not isinstance(x, np.ndarray) or x.dtype != np.float32 or x.ndim not in (1, 2) or not x.flags.c_contiguous:
        raise SynapseError("activations must be a C-contiguous float32 array of 1 or 2 dimensions")
    k = x.shape[-1]
    if k == 0 or k % afmt.block_size:
        raise SynapseError(f"activations: {k} values is not a multiple of the {afmt.name} block size {afmt.block_size}")
    x2 = x.reshape(-1, k)
    a = np.empty((x2.shape[0], afmt.row_bytes(k)), np.uint8)
    drv(a, x2)
    return a[0] if x.ndim == 1 else a


class BoundWeight:
    """A weight tensor validated once, with its kernels chosen: what the forward calls.

    Attributes: name; fmt and act_fmt (synapse_nb.formats formats of the weight and of its
    vec_dot_type); rows (uint8 [m, row_bytes], a view of the tensor's bytes, never copied);
    m, k (n_out, n_in); act_row_bytes (bytes of one converted activation row); n_scratch (int32
    scratch entries per thread). Build with bind(w).

    The methods do NOT validate their arguments (Numba does not bounds-check either): x must be
    float32 C-contiguous [n, k] with n >= 1, out float32 C-contiguous writable [n, m], ids int64
    C-contiguous in [0, m). Use the module-level matmul / get_rows for checked calls.
    """

    __slots__ = ("name", "fmt", "act_fmt", "rows", "m", "k", "act_row_bytes", "n_scratch",
                 "_act", "_act1", "_mv", "_mm", "_deq")

    def __init__(self, w):
        fmt, kern, rows, m, k = _weight_rows(w)
        self.name = _tname(w)
        self.fmt, self.act_fmt = fmt, _F.format_of(kern.act_type)
        self.rows, self.m, self.k = rows, m, k
        self.act_row_bytes = self.act_fmt.row_bytes(k)
        self.n_scratch = _mm.scratch_ints(k)
        self._act, self._mm, self._deq = kern.act, kern.mm, kern.deq
        self._mv = kern.mv if m % kern.mv_rows == 0 else kern.mv_any
        self._act1 = _mm.ACT1_DRIVERS[kern.act_type]

    def shares_activation(self, other: "BoundWeight") -> bool:
        """True when other converts its input to the same bytes (same vec_dot_type and n_in), so
        one quantize() serves both (ggml converts the same values the same way each time)."""
        return self.act_fmt is other.act_fmt and self.k == other.k

    def drivers(self, n):
        """(matmul, convert), the kernels for n activation rows: convert(a uint8 [n,
        act_row_bytes], x float32 [n, k]) (ggml's from_float) and, for n > 1, the rows_dot driver
        matmul(out float32 [n, m], rows, a, n_scratch) with the parallel converter; for one row,
        the vec_dot4 / vec_dot driver matmul(out1, rows1, out2, rows2, out3, rows3, a, n_scratch)
        (up to three weights of this format and n_in; see matmul.Kernels) with the serial
        converter (no parallel launch). Unchecked, like the methods. (uses_matvec(n): whether a
        batch of n rows is better run by the matvec driver, one row after another.)"""
        return (self._mv, self._act1) if n == 1 else (self._mm, self._act)

    def uses_matvec(self, n):
        """True when n activation rows run fastest through the matvec driver, row after row
        (n <= the format's matvec_rows; the bits are the same either way)."""
        return n <= self.fmt.matvec_rows

    def quantize(self, x):
        """x float32 [N, K] converted to this weight's vec_dot_type: uint8 [N, act_row_bytes]."""
        a = np.empty((x.shape[0], self.act_row_bytes), np.uint8)
        self.drivers(x.shape[0])[1](a, x)
        return a

    def matmul_q(self, a, out):
        """out[N, M] = W . a for activations already converted by quantize() (of this weight or of
        one that shares_activation with it). Returns out."""
        if self.uses_matvec(a.shape[0]):
            none_out, none_rows = out[:0], self.rows[:0]
            self._mv(out, self.rows, none_out, none_rows, none_out, none_rows, a, self.n_scratch)
        else:
            self._mm(out, self.rows, a, self.n_scratch)
        return out

    def matmul(self, x, out=None):
        """out[N, M] = x[N, K] W^T (see matmul()); out allocated when None. Returns out."""
        if out is None:
            out = np.empty((x.shape[0], self.m), np.float32)
        return self.matmul_q(self.quantize(x), out)

    def get_rows(self, ids, out):
        """out[i] = dequantize(W[ids[i]]) (see get_rows()); out float32 [len(ids), K]. Returns out."""
        self._deq(out, self.rows, ids)
        return out

    def __repr__(self):
        return f"<BoundWeight {self.name}: {self.fmt.name} {self.m}x{self.k}>"


def bind(w):
    """Validate a GGUF weight tensor (TensorInfo-like, 2-D (M, K)) once and return its BoundWeight.

    Raises SynapseError (naming the tensor) on an unsupported type, a bad shape, or data that is
    not a contiguous byte array of exactly M rows of the format's row size.
    """
    return w if isinstance(w, BoundWeight) else BoundWeight(w)


def matmul(w, x, out=None):
    """Y[N, M] = X[N, K] W^T for a GGUF weight W of shape (M, K) in any supported type.

    w: a weight tensor (or a BoundWeight). x: float32 C-contiguous [N, K] (N >= 1; the decoder
    uses up to 64). Each activation row is converted once to W's vec_dot_type and reused by every
    weight row; each output element is ggml's vec_dot of one weight row with one converted
    activation row (ggml_compute_forward_mul_mat without repacking). out: optional float32 [N, M]
    to write into. Returns float32 [N, M].
    Raises SynapseError on unsupported type or inconsistent shapes.
    """
    b = bind(w)
    _check_x(b.name, x, b.k, 2)
    n = x.shape[0]
    if n == 0:
        raise SynapseError(f"tensor {b.name}: matmul of 0 activation rows")
    return b.matmul(x, _check_out(b.name, out, (n, b.m)))


def matvec(w, x, out=None):
    """y[M] = W[M, K] x[K] (float32 [K] C-contiguous); exactly row 0 of matmul(w, x[None]).

    Reproduces ggml's mul_mat for one token (ggml-cpu vec_dot per weight row). Returns float32 [M].
    Raises SynapseError on unsupported type or inconsistent shapes.
    """
    name = _tname(w)
    if not isinstance(x, np.ndarray) or x.ndim != 1:
        raise SynapseError(f"tensor {name}: matvec needs a 1-D activation vector")
    if out is not None:
        if not isinstance(out, np.ndarray) or out.ndim != 1:
            raise SynapseError(f"tensor {name}: out must be a 1-D float32 array")
        out = out.reshape(1, -1)
    return matmul(w, x.reshape(1, -1), out)[0]


def get_rows(w, ids):
    """Embedding lookup: float32 [len(ids), K], row i = dequantize(W[ids[i]]).

    Reproduces ggml_compute_forward_get_rows (the row's to_float, ggml-quants.c dequantize_row_*).
    ids: integer sequence or array, each in [0, M). Raises SynapseError on out-of-range ids.
    """
    b = bind(w)
    ids = np.ascontiguousarray(np.asarray(ids).reshape(-1))
    if ids.size and not np.issubdtype(ids.dtype, np.integer):
        raise SynapseError(f"tensor {b.name}: row ids must be integers")
    ids = ids.astype(np.int64, copy=False)
    if ids.size and (ids.min() < 0 or ids.max() >= b.m):
        bad = int(ids[(ids < 0) | (ids >= b.m)][0])
        raise SynapseError(f"tensor {b.name}: row id {bad} out of range [0, {b.m})")
    out = np.empty((ids.size, b.k), np.float32)
    if ids.size:
        b.get_rows(ids, out)
    return out


class _AsRow:
    """A 1-D tensor seen as one row (for dequantize of norm vectors)."""

    def __init__(self, w):
        self.name, self.ggml_type, self.data = _tname(w), w.ggml_type, w.data
        self.shape = (1, int(w.shape[0]))


def dequantize(w):
    """The whole tensor as float32: [M, K] for a weight, [K] for a 1-D tensor (norms).

    For tests and tools; the decoder never dequantizes weights up front. Bit-exact with
    gguf.quants.dequantize / ggml-quants.c dequantize_row_*. Raises SynapseError on bad input.
    """
    one_d = len(tuple(w.shape)) == 1
    b = bind(_AsRow(w) if one_d else w)
    out = b.get_rows(np.arange(b.m, dtype=np.int64), np.empty((b.m, b.k), np.float32))
    return out[0] if one_d else out
