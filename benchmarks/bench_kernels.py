"""Kernel throughput: matvec GB/s of weight bytes and matmul(N=64) GFLOP/s, per weight format,
on the matrix shapes of the real models, next to this machine's memory read bandwidth and its
int8 dot peak (measured: vpdpbusd with AVX512-VNNI, else AVX2's vpmaddubsw + vpmaddwd; the last
column is the matmul's share of it).

    python benchmarks/bench_kernels.py                 # all formats, default shapes
    python benchmarks/bench_kernels.py --formats Q4_0,Q4_K --threads 1
    python benchmarks/bench_kernels.py --asm           # also: vector registers in each row kernel
    python benchmarks/bench_kernels.py --stream        # also: matvec streamed from memory, 1 and N threads

Shapes are M x K (n_out x n_in): SmolLM2-135M 576x1536, 1536x576, output 49152x576;
Qwen2.5-0.5B 896x4864, 4864x896, output 151936x896 (the smaller ones stay in the L2 / L3 caches
between repetitions). --stream adds each format's matvec on matrices of --stream-mb (beyond the
L3 cache, so every repetition reads them from memory, as a decode step does) with rows of 1024 and
of 4864 values (valid for every format), on 1 thread and on --threads, beside the machine's read.
Weights are random blocks with valid scales (throughput does not depend on the values). Numbers are printed, never asserted; the machine is
shared, so the load average is printed too and best-of-N timings are reported.
"""

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from synapse_nb.formats import weight_formats  # noqa: E402  (no kernels compiled by this import)

SHAPES = [(576, 1536), (1536, 576), (896, 4864), (4864, 896), (49152, 576), (151936, 896)]
FORMATS = [f.name for f in weight_formats()]  # the one table of formats


def parse():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--formats", default=",".join(FORMATS))
    p.add_argument("--threads", type=int, default=0, help="Numba threads (0: Numba's default)")
    p.add_argument("--reps", type=int, default=7, help="timed repetitions (best is reported)")
    p.add_argument("--max-mb", type=float, default=160.0, help="skip matrices larger than this (MB)")
    p.add_argument("--matmul-shapes", default="layers", choices=["layers", "all", "none"],
                   help="shapes for matmul(N=64): the four layer shapes, all, or none")
    p.add_argument("--asm", action="store_true", help="count vector instructions in each row kernel")
    p.add_argument("--stream", action="store_true", help="matvec GB/s on matrices beyond the L3 cache")
    p.add_argument("--stream-mb", type=float, default=120.0, help="size of each --stream matrix (MB)")
    return p.parse_args()


def main():
    args = parse()
    if args.asm:  # inspect_asm() only works on freshly compiled code: compile into a scratch cache
        os.environ["NUMBA_CACHE_DIR"] = tempfile.mkdtemp(prefix="bench_kernels_numba_")

    import numba
    import numpy as np

    from synapse_nb import formats as F
    from synapse_nb.kernels import matmul, matvec, supported_types

    if args.threads:
        numba.set_num_threads(args.threads)
    nthreads = numba.get_num_threads()

    from _read_bandwidth import read_kernel

    read_sum = read_kernel()

    def best_time(fn, reps):
        fn()
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
        return best

    print(f"numba {numba.__version__}, threads {nthreads}, load average {os.getloadavg()[0]:.1f} "
          f"on {os.cpu_count()} CPUs", flush=True)

    # memory read bandwidth, measured here the same way (a streaming parallel sum over 512 MiB)
    buf = np.ones((4096, 16384), np.uint64)  # 512 MiB, rows of 128 KiB
    sums = np.zeros(4096, np.uint64)
    for nt, label in ((1, "1 thread"), (nthreads, f"{nthreads} threads")):
        numba.set_num_threads(nt)
        t = best_time(lambda: read_sum(buf, sums), max(3, args.reps // 2))
        print(f"memory read bandwidth ({label}): {buf.nbytes / t / 1e9:.1f} GB/s", flush=True)
    numba.set_num_threads(nthreads)
    print(f"threading layer: {numba.threading_layer()}")
    del buf
    peak = int8_dot_peak(nthreads, best_time)
    if peak:
        peak, what = peak
        print(f"int8 dot peak ({nthreads} threads): {peak:.0f} GOP/s (measured: {what}, register "
              "operands; what a matmul could reach if it did nothing but its integer dots)")

    rng = np.random.default_rng(0)
    avail = set(supported_types())

    class W:  # TensorInfo stand-in
        def __init__(self, name, m, k):
            fmt = F.format_of(name)
            self.name, self.ggml_type, self.shape = f"bench.{name}", fmt.ggml_type, (m, k)
            nb = m * k // fmt.block_size
            if name == "F32":
                self.data = rng.standard_normal(m * k, np.float32).view(np.uint8)
                return
            b = rng.integers(0, 256, (nb, fmt.type_size), dtype=np.uint8)
            if name in ("F16", "BF16"):
                b[:, 1] &= 0x3F  # finite, modest values
            elif fmt.block_size == 32:
                b[:, 0:2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
            else:  # K-quants / IQ4_XS: put finite F16 super-block scales where they live
                for off in fmt.f16_fields:
                    b[:, off:off + 2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
            self.data = b.reshape(-1)

    print(f"\n{'format':7} {'shape':>12} {'MB':>7} {'matvec ms':>10} {'GB/s':>7} {'matmul64 ms':>12} {'GFLOP/s':>8}")
    for name in [f.strip().upper() for f in args.formats.split(",") if f.strip()]:
        if name not in avail:
            print(f"{name:7} (no kernels in this build)")
            continue
        for si, (m, k) in enumerate(SHAPES):
            fmt = F.format_of(name)
            if k % fmt.block_size:
                print(f"{name:7} {m:>6}x{k:<5}   (n_in not a multiple of {fmt.block_size}: not a valid {name} matrix)")
                continue
            mb = fmt.row_bytes(k) * m / 1e6
            if mb > args.max_mb:
                print(f"{name:7} {m:>6}x{k:<5} {mb:7.1f}   (skipped: > --max-mb)")
                continue
            w = W(name, m, k)
            x = rng.standard_normal(k).astype(np.float32)
            t = best_time(lambda: matvec(w, x), args.reps)
            line = f"{name:7} {m:>6}x{k:<5} {mb:7.1f} {t * 1e3:10.3f} {mb / 1e3 / t:7.2f}"
            if args.matmul_shapes == "all" or (args.matmul_shapes == "layers" and si < 4):
                X = rng.standard_normal((64, k)).astype(np.float32)
                tm = best_time(lambda: matmul(w, X), max(2, args.reps // 3))
                gf = 2.0 * m * k * 64 / tm / 1e9
                line += f" {tm * 1e3:12.2f} {gf:8.1f}" + (f" {100 * gf / peak:5.1f}%" if peak else "")
            print(line, flush=True)
            del w

    if args.stream:
        print(f"\nmatvec streamed from memory ({args.stream_mb:.0f} MB matrices; GB/s of weight bytes, best of "
              f"{args.reps}):\n{'format':7} {'n_in':>5} {'1 thread':>9} {f'{nthreads} threads':>10}")
        for name in [f.strip().upper() for f in args.formats.split(",") if f.strip()]:
            if name not in avail:
                continue
            fmt = F.format_of(name)
            for k in (1024, 4864):
                w = W(name, int(args.stream_mb * 1e6 // fmt.row_bytes(k)) // 64 * 64, k)
                x = rng.standard_normal(k).astype(np.float32)
                gbs = []
                for nt in (1, nthreads):
                    numba.set_num_threads(nt)
                    gbs.append(w.data.nbytes / best_time(lambda: matvec(w, x), args.reps) / 1e9)
                numba.set_num_threads(nthreads)
                print(f"{name:7} {k:>5} {gbs[0]:9.1f} {gbs[1]:10.1f}", flush=True)
                del w

    if args.asm:
        print("\nvector code in the row kernels (fresh compile, counts of lines in inspect_asm()):")
        from numba import types

        import importlib

        u8 = types.Array(types.uint8, 1, "C")
        sig = (u8, u8, types.Array(types.int32, 1, "C"))
        # rows_dot(y, m, w_row, a): the matmul drivers' kernel for N > 1, where a format has one
        rows_sig = (types.Array(types.float32, 2, "C"), types.int64, u8, types.Array(types.uint8, 2, "C"))
        for f in weight_formats():
            mod = importlib.import_module(f"synapse_nb.kernels.{f.kernels}")
            for fname, s in ((f.vec_dot_name(), sig), (f.rows_dot_name(), rows_sig)):
                fn = getattr(mod, fname, None)
                if fn is None:
                    continue
                fn.compile(s)
                lines = fn.inspect_asm(s).splitlines()

                def count(tok):
                    return sum(tok in ln for ln in lines)

                print(f"  {f.name:7} {fname.split('_')[0]:8} zmm {count('%zmm'):4}  ymm {count('%ymm'):4}  "
                      f"vpmaddwd {count('vpmaddwd'):3}  vpdpbusd {count('vpdpbusd'):3}  vpmulld {count('vpmulld'):3}  "
                      f"vfmadd {count('vfmadd'):3}  ({len(lines)} lines)")


def int8_dot_peak(nthreads, best_time):
    """(GOP/s, what was measured) of this CPU's int8 dot, the instruction sequence our kernels'
    integer lanes use, or None on a host with neither form:
      * AVX512-VNNI: vpdpbusd (u8 x s8, 4 products summed into each of 16 int32 lanes);
      * AVX2: vpmaddubsw + vpmaddwd with ones + vpaddd (ggml's AVX2 dot: 32 u8 x s8 products
        summed into 8 int32 lanes, then accumulated).
    8 independent accumulators so that throughput, not latency, limits; one operand differs per
    accumulator and step for AVX2 (a vpxor with the step number: without it the compiler computes
    one product for all of them, once), the other in a register. 1 op = one multiply or one add."""
    from synapse_nb.kernels.simd import HAS_AVX2, HAS_VNNI512
    if HAS_VNNI512:
        return _dot_peak(nthreads, best_time, "vnni"), ("vpdpbusd on 8 independent zmm accumulators, "
                                                        "64 multiply-adds = 128 ops each")
    if HAS_AVX2:
        return _dot_peak(nthreads, best_time, "avx2"), ("vpmaddubsw + vpmaddwd + vpaddd (+ a vpxor) on 8 independent "
                                                        "ymm accumulators, 32 multiply-adds = 64 ops each")
    return None


def _dot_peak(nthreads, best_time, kind):
    """GOP/s of int8_dot_peak's loop of the given kind ("vnni" or "avx2") on nthreads threads."""
    import numpy as np
    from llvmlite import ir
    from numba import njit, prange, types
    from numba.core import cgutils
    from numba.extending import intrinsic

    from synapse_nb.kernels.simd import ir_splat

    i8, i16, i32, i64 = (ir.IntType(b) for b in (8, 16, 32, 64))
    lanes = 16 if kind == "vnni" else 8
    vacc = ir.VectorType(i32, lanes)

    @intrinsic
    def dot8(typingctx, acc, n):
        def codegen(context, builder, sig, args):
            if kind == "vnni":
                dp = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vacc, [vacc] * 3),
                                                    "llvm.x86.avx512.vpdpbusd.512")
            else:
                v32i8, v16i16 = ir.VectorType(i8, 32), ir.VectorType(i16, 16)
                mub = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v16i16, [v32i8] * 2),
                                                     "llvm.x86.avx2.pmadd.ub.sw")
                mwd = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vacc, [v16i16] * 2),
                                                     "llvm.x86.avx2.pmadd.wd")
                ones = ir.Constant(v16i16, [1] * 16)
            ptr = builder.bitcast(context.make_array(sig.args[0])(context, builder, args[0]).data, vacc.as_pointer())
            slots = [builder.gep(ptr, [ir.Constant(i64, i)]) for i in range(10)]
            init = [builder.load(p, align=4) for p in slots]
            pre = builder.block
            loop = builder.append_basic_block("dot8.loop")
            done = builder.append_basic_block("dot8.done")
            builder.branch(loop)
            builder.position_at_end(loop)
            k = builder.phi(i64)
            k.add_incoming(ir.Constant(i64, 0), pre)
            phis = []
            for i in range(8):  # 8 independent chains; init[8], init[9] are the operands
                ph = builder.phi(vacc)
                ph.add_incoming(init[i], pre)
                phis.append(ph)
            if kind == "vnni":
                nxt = [builder.call(dp, [ph, init[8], init[9]]) for ph in phis]
            else:
                x, y = (builder.bitcast(v, v32i8) for v in init[8:10])
                kv = builder.bitcast(ir_splat(builder, k, 4), v32i8)
                nxt = []
                for ph in phis:
                    x = builder.add(x, y)  # (out of the loop: each chain its own operand)
                    xk = builder.xor(x, kv)  # (one vpxor: a product of the step, not of the loop)
                    nxt.append(builder.add(ph, builder.call(mwd, [builder.call(mub, [xk, y]), ones])))
            k1 = builder.add(k, ir.Constant(i64, 1))
            k.add_incoming(k1, loop)
            for ph, v in zip(phis, nxt):
                ph.add_incoming(v, loop)
            builder.cbranch(builder.icmp_signed("<", k1, args[1]), loop, done)
            builder.position_at_end(done)
            for p, v in zip(slots, nxt):
                builder.store(v, p, align=4)
            return context.get_dummy_value()
        return types.void(acc, types.intp), codegen

    @njit(parallel=True, cache=False)
    def run(accs, n):
        for t in prange(accs.shape[0]):
            dot8(accs[t], n)

    reps = 200_000
    accs = np.ones((nthreads, 10 * lanes), np.int32)
    run(accs, 10)
    t = best_time(lambda: run(accs, reps), 3)
    return nthreads * reps * 8 * lanes * 4 * 2 / t / 1e9


if __name__ == "__main__":
    main()
