"""The machine's memory read bandwidth, measured one way for every benchmark (bench_kernels.py,
bench.py --only scaling): a streaming sum of a uint64 [rows, cols] array, its rows in parallel."""


def read_kernel():
    """read_sum(a, out): out[r] = the sum of row r of a (uint64 [rows, cols], C), rows over Numba's
    threads; the row sum is a plain function called per row, like the matmul drivers' row kernels
    (LLVM vectorises it). Compiled on first call, not cached."""
    import numpy as np
    from numba import njit, prange

    @njit(cache=False)
    def sum_row(row):
        s = np.uint64(0)
        for i in range(row.size):
            s += row[i]
        return s

    @njit(parallel=True, cache=False)
    def read_sum(a, out):
        for r in prange(a.shape[0]):
            out[r] = sum_row(a[r])

    return read_sum
