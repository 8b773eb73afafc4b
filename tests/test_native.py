"""synapse_nb.kernels.native: calls through run-time addresses, and the compiled layer loop."""

import pickle

import numpy as np
import pytest
from numba import njit, prange, types
from numba.core.errors import TypingError

from synapse_nb.kernels import native as N

F1 = types.Array(types.float32, 1, "C")


@njit(cache=False)
def _axpy(y, x, c):
    for i in range(y.shape[0]):
        y[i] += x[i] * c


@njit(cache=False, parallel=True)
def _axpy_par(y, x, c):
    for i in prange(y.shape[0]):
        y[i] += x[i] * c


@njit(cache=False)
def _fails(y, x, c):
    if c < 0:
        raise ValueError("negative scale")
    y[0] = c


@njit(cache=False)
def _caller(kind, addr, y, x, c, n):
    for _ in range(n):
        N.call_at(kind, addr, y, x, c)


@njit(cache=False)
def _caller_f64(kind, addr, y, x):
    N.call_at(kind, addr, y, x, 2.0)  # a float64 where the kind has float32


@njit(cache=False)
def _rows(addr, m, rb):
    return N.weight_rows(addr, m, rb).copy()


@njit(cache=False)
def _write_row(addr):
    N.weight_rows(addr, 1, 1)[0, 0] = 1


@pytest.mark.parametrize("fn", [_axpy, _axpy_par])
def test_call_at_runs_the_function_at_the_address(fn):
    y, x = np.zeros(37, np.float32), np.arange(37, dtype=np.float32)
    f = N.native_fn(fn, F1, F1, types.float32)
    _caller(N.kind(F1, F1, types.float32), f.addr, y, x, np.float32(0.5), 3)
    want = np.zeros(37, np.float32)
    for _ in range(3):
        fn(want, x, np.float32(0.5))
    assert np.array_equal(y, want) and y[36] == np.float32(3 * 18.0)


def test_arguments_of_another_signature_do_not_compile():
    f = N.native_fn(_axpy, F1, F1, types.float32)
    y = np.zeros(4, np.float32)
    with pytest.raises(TypingError, match="do not match"):
        _caller_f64(N.kind(F1, F1, types.float32), f.addr, y, y)


def test_an_exception_in_the_callee_reaches_the_caller():
    f = N.native_fn(_fails, F1, F1, types.float32)
    y = np.zeros(2, np.float32)
    _caller(N.kind(F1, F1, types.float32), f.addr, y, y, np.float32(2.0), 1)
    assert y[0] == 2.0
    with pytest.raises(ValueError, match="negative scale"):
        _caller(N.kind(F1, F1, types.float32), f.addr, y, y, np.float32(-1.0), 1)


def test_weight_rows_views_the_bytes_at_the_address():
    data = np.arange(6 * 10, dtype=np.uint8).reshape(6, 10)
    got = _rows(data.ctypes.data, 6, 10)
    assert got.shape == (6, 10) and np.array_equal(got, data)
    with pytest.raises(TypingError):  # read-only: a kernel cannot write into a weight
        _write_row(data.ctypes.data)


@njit(cache=False)
def _views(a, n, m):
    f = N.flat(a).copy()
    r = N.rows(a, n, m)
    r[n - 1, m - 1] = -1.0  # a view: the write reaches a
    return f, r.copy()


def test_flat_and_rows_view_a_c_array():
    a = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    f, r = _views(a, 5, 4)
    assert np.array_equal(f, np.arange(24, dtype=np.float32))
    want = np.arange(20, dtype=np.float32).reshape(5, 4)
    want[4, 3] = -1.0
    assert r.shape == (5, 4) and np.array_equal(r, want) and a.ravel()[19] == -1.0 and a.ravel()[20] == 20.0
    with pytest.raises(ValueError, match="larger than its array"):
        _views(a, 5, 5)


def test_a_native_fn_type_pickles_and_is_its_signature():
    f = N.native_fn(_axpy, F1, F1, types.float32)
    t = N.NativeFnType(f.argtypes)
    assert pickle.loads(pickle.dumps(t)) == t  # Numba's cache index pickles the caller's signature
    assert N.NativeFnType((F1, F1, types.float32)) == t != N.NativeFnType((F1, F1, types.float64))


def test_the_layer_loop_compiles_once_for_batches_and_decode_steps():
    """One signature of graph.layers serves prefill batches (all logits or the last row), a
    prefill batch whose logits are not needed, and decode steps."""
    from conftest import shared_model
    from synapse_nb.kernels import graph
    from synapse_nb.session import Session

    m = shared_model("tiny-llama-q4_0")
    s = Session(m, n_ctx=64, n_batch=4, n_threads=1)
    s.eval(np.arange(1, 11, dtype=np.int64))  # batches of 4, 4 (logits unused) and 2
    s.eval(np.array([5], np.int64))
    assert len(graph.layers.signatures) == 1


_KIND = N.kind(F1, F1, types.float32)
_REAL = None  # set by the test below to a real NativeFn


@njit(cache=False)
def _caller_global_kind(addr, y, x, c):
    N.call_at(_KIND, addr, y, x, c)


@njit(cache=False)
def _caller_global_real(y, x, c):
    N.call_at(_REAL, 0, y, x, c)


def test_a_kind_may_be_a_global_but_a_real_function_may_not():
    """A global is frozen into the compiled code (and Numba's cache): harmless for a kind, whose
    address is never called; a real address would be stale in the next process."""
    global _REAL
    f = N.native_fn(_axpy, F1, F1, types.float32)
    y, x = np.zeros(3, np.float32), np.ones(3, np.float32)
    _caller_global_kind(f.addr, y, x, np.float32(2.0))
    assert list(y) == [2.0, 2.0, 2.0]
    _REAL = f
    with pytest.raises(Exception, match="global of a compiled function"):
        _caller_global_real(y, x, np.float32(2.0))


def test_compile_layers_compiles_the_signature_the_forward_calls():
    """Model.compile_layers (the compile helper's first step) compiles graph.layers without
    running it; the forward then calls that very signature (one signature in all)."""
    from conftest import tiny
    from synapse_nb.kernels import graph
    from synapse_nb.model import load_model
    from synapse_nb.session import Session

    m = load_model(tiny("tiny-llama-q4_0"))  # its own load: no kernel table built yet
    s = Session(m, n_ctx=16, n_batch=4, n_threads=1)
    m.compile_layers(s.state, s.cache)
    assert m._tables is not None and m._tables._mt == {}  # no kernel table built, no kernel compiled
    s.eval(np.arange(1, 7, dtype=np.int64))
    s.eval(np.array([3], np.int64))
    assert len(graph.layers.signatures) == 1


def test_one_layer_loop_for_every_architecture():
    """Every architecture's recipe reaches graph.layers as values of the same types (graph.Block,
    LayerVectors), so one compiled loop serves them all: compile_layers for a model of each
    architecture (tiny fixtures; Gemma 3 real) leaves one signature."""
    from pathlib import Path

    from conftest import real_model

    from synapse_nb.arch import ARCHS
    from synapse_nb.kernels import graph
    from synapse_nb.model import load_model
    from synapse_nb.session import Session

    tiny = Path(__file__).parent / "data" / "tiny"
    paths = [tiny / f"{n}.gguf" for n in ("tiny-llama-q4_0", "tiny-llama3-q4_k_m", "tiny-qwen2-q4_k_m",
                                           "tiny-mistral3-q4_k_m")] + [real_model("gemma-3-270m-q4_k_m")]
    archs = set()
    for path in paths:
        m = load_model(path)
        archs.add(m.hparams.arch)
        s = Session(m, n_ctx=8, n_batch=2, n_threads=1)
        m.compile_layers(s.state, s.cache)
    assert archs == set(ARCHS)
    assert len(graph.layers.signatures) == 1


def test_a_nested_kernel_is_called_by_kernels_and_by_address_never_from_python():
    """kernel(nested=True) (decorator.NestedDispatcher, here graph._add_rows): compiled without
    Numba's Python wrapper; a kernel calls it, directly or at its address, with its results; a
    call from Python, which would jump to the missing wrapper, raises TypeError."""
    from synapse_nb.kernels import graph as G
    from synapse_nb.kernels.decorator import NestedDispatcher

    F2 = types.Array(types.float32, 2, "C")
    assert isinstance(G._add_rows, NestedDispatcher)
    y, b = np.ones((2, 3), np.float32), np.arange(3, dtype=np.float32)
    with pytest.raises(TypeError, match="graph._add_rows is a nested kernel"):
        G._add_rows(y, b)
    f = N.native_fn(G._add_rows, F2, F1)
    cres = G._add_rows.overloads[(F2, F1)]
    assert cres.library.get_pointer_to_function(cres.fndesc.llvm_cpython_wrapper_name) == 0 != f.addr

    @njit(cache=False)
    def direct(y, b):
        G._add_rows(y, b)

    @njit(cache=False)
    def at(kind, addr, y, b):
        N.call_at(kind, addr, y, b)

    direct(y, b)
    at(N.kind(F2, F1), f.addr, y, b)
    assert np.array_equal(y, 1 + 2 * np.stack([b, b]))
