"""The compiled walk over a GGUF array of strings (gguf_file._Reader.strings for long arrays).

A GGUF ARRAY of STRING is n (8-byte little-endian length, bytes) records back to back; where
each string starts is known only after every length before it is read. Gemma 3's 262,144 tokens
took 45 ms as a Python loop at every start; this loop takes about 1 ms. Imported only by
gguf_file, only for an array long enough to be worth a kernel load.
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True)
def string_bounds(buf, pos, size, bounds):
    """Fill bounds (int64 [n + 1]) so that string i is buf[bounds[i] : bounds[i + 1] - 8]; returns
    where the array ends (bounds[n] = end + 8, as gguf_file.StringArray keeps them). buf: uint8
    [>= size], the mapped file; pos: the first length's offset. Returns -1 when a length or a
    string runs past size (a truncated or damaged file; the caller raises). The caller allocates
    bounds: an allocation here would compile NumPy's np.empty into the kernel (0.1 s a first run)."""
    n = bounds.shape[0] - 1
    for i in range(n):
        if pos + 8 > size:
            return -1
        ln = np.uint64(0)
        for k in range(8):
            ln |= np.uint64(buf[pos + k]) << np.uint64(8 * k)
        pos += 8
        bounds[i] = pos
        if ln > np.uint64(size - pos):
            return -1
        pos += np.int64(ln)
    bounds[n] = pos + 8
    return pos
