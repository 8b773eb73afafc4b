"""Calls from one compiled function to another through an address known only at run time.

Why: the forward's layer loop (kernels/graph.py) is one compiled function calling about twenty
kernels per layer. Called directly, Numba links every callee's LLVM module into the caller and
generates its machine code again (a cold compile of the loop took 6-7 s, the kernels' own time
once more), and the cached caller would embed the callees' code. Called through an address, the
loop (with its helpers) compiles in 1.5-2.6 s, measured on different days, and holds no callee
code: a kernel is compiled (or loaded from the cache) once, by its own dispatcher, and the loop's
cache entry never holds stale code, because the addresses are arguments of each call, not
constants of the compiled loop.

Pieces:
  * ``NativeFn``: one compiled overload of a Numba dispatcher (``native_fn``), its argument
    types and the address of its native entry point (Numba's internal calling convention: status
    code, exception-info pointer, the arguments in Numba's data model).
  * ``NativeFnType(argtypes)``, its Numba type: a NativeFn passed to a compiled function is its
    address (int64), and its type carries the argument types.
  * ``call_at(kind, addr, *args)`` (intrinsic): calls the function at ``addr`` with ``args``. The
    argument types must equal ``kind``'s (a NativeFn, or a ``kind(*argtypes)``; checked when the
    caller compiles, TypingError otherwise), and ``addr`` must be the address of a NativeFn of
    exactly that kind: the tables of addresses are built, and their kinds checked, in Python.
    An exception raised by the callee propagates to the caller as from a direct call.
  * ``weight_rows(addr, m, row_bytes)`` (intrinsic): a read-only uint8 [m, row_bytes] view of
    memory the caller keeps alive (a weight's memory-mapped bytes), with no owner.
  * ``flat(a)``, ``rows(a, n, m)`` (intrinsics): 1-D and [n, m] views of a C-contiguous array.
"""

import numba
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core.errors import TypingError
from numba.core.imputils import lower_constant
from numba.extending import NativeValue, intrinsic, models, register_model, typeof_impl, unbox

# The type of a weight's rows in every kernel signature (what weight_rows returns).
WEIGHT_ROWS = types.Array(types.uint8, 2, "C", readonly=True)


class NativeFnType(types.Type):
    """Numba type of a NativeFn: an int64 address, of a function taking argtypes."""

    def __init__(self, argtypes):
        self.argtypes = tuple(argtypes)
        super().__init__(name="NativeFn(%s)" % ", ".join(map(str, self.argtypes)))


@register_model(NativeFnType)
class _NativeFnModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, ir.IntType(64))


class NativeFn:
    """A compiled overload of a dispatcher: .name, .argtypes (Numba types), .addr (int). Build
    with native_fn (holding the dispatcher, which keeps the code at addr alive), or with kind()."""

    __slots__ = ("name", "argtypes", "addr", "_dispatcher")

    def __init__(self, dispatcher, argtypes, addr):
        self.name = dispatcher.__name__ if dispatcher is not None else "kind"
        self.argtypes, self.addr, self._dispatcher = tuple(argtypes), addr, dispatcher

    def __repr__(self):
        return f"<NativeFn {self.name} at {self.addr:#x}>"


@typeof_impl.register(NativeFn)
def _typeof_native_fn(val, c):
    return NativeFnType(val.argtypes)


@unbox(NativeFnType)
def _unbox_native_fn(typ, obj, c):
    addr = c.pyapi.object_getattr_string(obj, "addr")
    val = c.pyapi.long_as_longlong(addr)
    c.pyapi.decref(addr)
    return NativeValue(val, is_error=c.pyapi.c_api_error())


@lower_constant(NativeFnType)
def _constant_kind(context, builder, ty, pyval):
    # A global NativeFn is frozen into the compiled (and cached) code: only a kind may be, whose
    # address is never called; a real address would be stale in the next process.
    if pyval.addr != 0:
        raise TypingError(f"{pyval!r} is a global of a compiled function: pass it as an argument")
    return context.get_constant(types.int64, 0)


def native_fn(dispatcher, *argtypes) -> NativeFn:
    """The overload of dispatcher (an @njit function) for exactly these Numba argument types,
    compiled or loaded from the cache now, as a NativeFn. Each argument is a Numba type or an
    example value (its numba.typeof)."""
    sig = tuple(a if isinstance(a, types.Type) else numba.typeof(a) for a in argtypes)
    dispatcher.compile(sig)
    cres = dispatcher.overloads[sig]
    return NativeFn(dispatcher, sig, cres.library.get_pointer_to_function(cres.fndesc.llvm_func_name))


def kind(*argtypes) -> NativeFn:
    """A signature as call_at's first argument: a NativeFn of these Numba types at address 0,
    never called (compiles nothing). Unlike a real NativeFn, a kind may be a global of a compiled
    function (a constant: no dispatch cost per call)."""
    return NativeFn(None, argtypes, 0)


@intrinsic
def call_at(typingctx, kind, addr, *args):
    """call_at(kind, addr, *args): call the function at addr (of kind's signature) with args."""
    if not isinstance(kind, NativeFnType) or not isinstance(addr, types.Integer):
        return None
    args = tuple(args)
    if args != kind.argtypes:
        raise TypingError(f"call_at: arguments ({', '.join(map(str, args))}) do not match {kind}")
    sig = types.none(kind, addr, types.StarArgTuple(args))

    def codegen(context, builder, signature, llargs):
        # Numba's CPUCallConv.call_function, on a function pointer instead of a declared function
        cc = context.call_conv
        fnty = cc.get_function_type(types.none, args)
        fn = builder.inttoptr(llargs[1], fnty.as_pointer())
        ret = cgutils.alloca_once(builder, cc.get_return_type(types.none).pointee)
        builder.store(cgutils.get_null_value(ret.type.pointee), ret)
        excinfo = cgutils.alloca_once(builder, fnty.args[1].pointee, name="excinfo")
        packed = cc._get_arg_packer(args).as_arguments(builder, cgutils.unpack_tuple(builder, llargs[2]))
        code = builder.call(fn, [ret, excinfo] + list(packed))
        status = cc._get_return_status(builder, code, builder.load(excinfo))
        with cgutils.if_unlikely(builder, status.is_error):
            cc.return_status_propagate(builder, status)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def thread_count(typingctx):
    """thread_count(): the calling thread's Numba thread count (numba.get_num_threads()), read as
    Numba's parfor lowering reads it: a call of the threading layer's get_num_threads symbol,
    resolved when the code is linked. numba.get_num_threads() in a kernel holds a ctypes pointer,
    and Numba does not cache a kernel that does. For parallel kernels (whose load from the cache
    starts the threading layer, which defines the symbol)."""
    numba.get_num_threads()  # starts the threading layer (defines the symbol) before this compiles

    def codegen(context, builder, signature, llargs):
        intp = context.get_value_type(types.intp)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(intp, []), "get_num_threads")
        return builder.call(fn, [])

    return types.intp(), codegen


def _view_codegen(a, rt, dims):
    """The codegen of a C view rt of the C array a (its first prod(dims) elements, dims(builder,
    llargs) -> the view's shape as intp values), sharing a's memory and owner; ValueError when a
    holds fewer elements."""

    def codegen(context, builder, signature, llargs):
        from numba.core.imputils import impl_ret_borrowed
        from numba.np.arrayobj import make_array, populate_array

        src = make_array(a)(context, builder, llargs[0])
        dst = make_array(rt)(context, builder)
        shape = dims(context, builder, signature, llargs, src)
        total = shape[0]
        for d in shape[1:]:
            total = builder.mul(total, d)
        with cgutils.if_unlikely(builder, builder.icmp_unsigned(">", total, src.nitems)):
            context.call_conv.return_user_exc(builder, ValueError, ("view larger than its array",))
        strides, step = [], src.itemsize
        for d in reversed(shape):
            strides.insert(0, step)
            step = builder.mul(step, d)
        populate_array(dst, data=src.data, shape=cgutils.pack_array(builder, shape),
                       strides=cgutils.pack_array(builder, strides), itemsize=src.itemsize,
                       meminfo=src.meminfo, parent=src.parent)
        return impl_ret_borrowed(context, builder, rt, dst._getvalue())

    return codegen


@intrinsic
def flat(typingctx, a):
    """flat(a): the 1-D view of a C-contiguous array a (a.ravel()). Here, and in rows, without
    Numba's reshape, whose shape check each new process compiles anew (0.1-0.2 s per tuple
    length: most of a first run's compile of the decode attention, before it took flat)."""
    if not isinstance(a, types.Array) or a.layout != "C":
        return None
    rt = a.copy(ndim=1, layout="C")
    return rt(a), _view_codegen(a, rt, lambda context, builder, sig, llargs, src: [src.nitems])


@intrinsic
def rows(typingctx, a, n, m):
    """rows(a, n, m): the C [n, m] view of the first n * m elements of a C-contiguous array a
    (a.ravel()[:n * m].reshape((n, m))); ValueError when a has fewer."""
    if not isinstance(a, types.Array) or a.layout != "C" or not all(isinstance(t, types.Integer) for t in (n, m)):
        return None
    rt = a.copy(ndim=2, layout="C")

    def dims(context, builder, sig, llargs, src):
        return [context.cast(builder, v, t, types.intp) for v, t in zip(llargs[1:], sig.args[1:])]

    return rt(a, n, m), _view_codegen(a, rt, dims)


@intrinsic
def weight_rows(typingctx, addr, m, row_bytes):
    """weight_rows(addr, m, row_bytes): read-only uint8 [m, row_bytes] C array at addr, no owner."""
    if not all(isinstance(a, types.Integer) for a in (addr, m, row_bytes)):
        return None
    sig = WEIGHT_ROWS(addr, m, row_bytes)

    def codegen(context, builder, signature, llargs):
        from numba.np.arrayobj import make_array, populate_array

        intp = context.get_value_type(types.intp)
        a, rows, rb = (context.cast(builder, v, t, types.intp) for v, t in zip(llargs, signature.args))
        ary = make_array(WEIGHT_ROWS)(context, builder)
        populate_array(ary, data=builder.inttoptr(a, context.get_value_type(types.CPointer(types.uint8))),
                       shape=cgutils.pack_array(builder, [rows, rb]),
                       strides=cgutils.pack_array(builder, [rb, ir.Constant(intp, 1)]),
                       itemsize=ir.Constant(intp, 1), meminfo=None)
        return ary._getvalue()

    return sig, codegen
