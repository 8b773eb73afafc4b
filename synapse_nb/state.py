"""The state of a sequence being decoded: its F16 KV cache and the forward's activation buffers.

KVCache holds llama.cpp's cache bytes in the layouts the attention kernels stream
(synapse_nb.kernels.attention); ForwardState the activations of one batch. Both are allocated
once per Session (synapse_nb.session) or ParallelSession (synapse_nb.parallel).
"""

from __future__ import annotations

import mmap

import numpy as np

from .hparams import HParams
from .kernels import attention as _attn


def lazy_zeros(shape, dtype) -> np.ndarray:
    """A zeroed array backed by an anonymous mapping, committed 4 KiB page by page as it is written.

    numpy's allocator asks for transparent huge pages, so the first write to each channel row of a
    transposed cache would commit 2 MiB: 235 MB for SmolLM2 at n_ctx 4096 after a 5-token prompt.
    """
    count = int(np.prod(shape))
    buf = mmap.mmap(-1, max(count * np.dtype(dtype).itemsize, 1))
    return np.frombuffer(buf, dtype=dtype, count=count).reshape(shape)


# ---------------------------------------------------------------- a sliding window's bounded cache
# A sliding-window layer's query at position p reads keys from p - n_swa + 1 on, and the attention
# kernels start at that position's 64-tile. Once n_past positions are written, later queries are at
# n_past or beyond, so the tiles below swa_floor(n_past, n_swa) are never read again: their pages
# are given back to the system (MADV_REMOVE on the shared anonymous mapping: its bytes read as zero
# again). Positions stay where they are, so every kernel reads the same cells in the same order, and
# the bits are those of a full-size cache (llama.cpp's --swa-full layout the goldens use); only the
# memory a sliding-window layer holds is bounded: its window and the batch being written, plus the
# 64-position tile and the page each release rounds to. Going back (Session.truncate, a reused
# prefix) below what the window kept needs those positions evaluated again, as llama.cpp's SWA cache
# makes a server re-process a prompt.

def swa_floor(n_past: int, n_swa: int) -> int:
    """The lowest position a sliding window of n_swa (> 0) still reads once n_past positions are
    written, rounded down to the attention kernels' 64-position tile: keys below it can go."""
    return max(0, n_past - n_swa + 1) // _attn.KT * _attn.KT


def _mapping(a: np.ndarray) -> tuple:
    """(the anonymous mapping under a lazy_zeros array or a view of one, its first byte's address)."""
    x = a
    while isinstance(x, np.ndarray):
        root, x = x, x.base
    if not isinstance(x, memoryview) or not isinstance(x.obj, mmap.mmap):
        raise TypeError("not a view of a lazy_zeros array")
    return x.obj, root.ctypes.data


def _release(mm: mmap.mmap, start: int, lo: int, hi: int) -> None:
    """Give back the whole pages inside bytes [lo, hi) (addresses) of mm, which begins at start."""
    lo = -(-(lo - start) // mmap.PAGESIZE) * mmap.PAGESIZE
    hi = (hi - start) // mmap.PAGESIZE * mmap.PAGESIZE
    if hi > lo and hasattr(mmap, "MADV_REMOVE"):  # Linux; elsewhere the pages stay (the same bits)
        try:
            mm.madvise(mmap.MADV_REMOVE, lo, hi - lo)
        except OSError:
            pass  # not given back: more memory, nothing else changes


def release_positions(k_layer: np.ndarray, v_layer: np.ndarray, n_pos: int) -> None:
    """Give back the memory of positions 0..n_pos-1 (a multiple of 64) of one layer's cache, views of
    lazy_zeros arrays: k_layer uint16 [n_head_kv, n_ctx / 64, head_dim_k, 64], v_layer uint16
    [n_head_kv, 64, n_ctx / 64, head_dim_v] (KVCache's layouts). Their entries read as zero after.
    K's tiles are 64 x head_dim_k x 2 bytes in a row; V holds each lane's tiles in a row, so its
    release is in whole pages of one lane (4096 / (2 head_dim_v) tiles)."""
    tiles = n_pos // _attn.KT
    if tiles <= 0:
        return
    mm, start = _mapping(k_layer)
    for g in range(k_layer.shape[0]):
        lo = k_layer[g].ctypes.data
        _release(mm, start, lo, lo + tiles * k_layer.strides[1])
    mm, start = _mapping(v_layer)
    for g in range(v_layer.shape[0]):
        for lane in range(v_layer.shape[1]):
            lo = v_layer[g, lane].ctypes.data
            _release(mm, start, lo, lo + tiles * v_layer.strides[2])


class WindowRelease:
    """What a cache's sliding-window layers have given back (release_positions), per cache slot:
    made by a Session (one slot) or a ParallelSession (n_seq). swa_full (llama.cpp's --swa-full)
    keeps every position, as the full-attention layers do."""

    def __init__(self, hp: HParams, n_slot: int = 1, swa_full: bool = False):
        self.n_swa = hp.n_swa
        self.layers = [] if swa_full or hp.n_swa <= 0 else [il for il in range(hp.n_layer) if hp.is_swa(il)]
        self.released = [0] * n_slot  # positions below this are gone from the slot's window layers

    def after_write(self, k: np.ndarray, v: np.ndarray, slot: int, n_past: int) -> None:
        """Release what no later query reads, after the slot's first n_past positions are written;
        k, v: that slot's KVCache.k / .v ([n_layer, ...])."""
        if not self.layers:
            return
        floor = swa_floor(n_past, self.n_swa)
        if floor > self.released[slot]:
            for il in self.layers:
                release_positions(k[il], v[il], floor)
            self.released[slot] = floor

    def can_keep(self, slot: int, n_past: int) -> bool:
        """Whether the slot can go back to n_past cached positions and go on from there: what a query
        at n_past reads is still held (else those positions must be evaluated again)."""
        return not self.layers or swa_floor(n_past, self.n_swa) >= self.released[slot]

    def reset(self, slot: int) -> None:
        """The slot starts again from position 0 (its released pages read as zero until rewritten)."""
        self.released[slot] = 0

    @staticmethod
    def held_positions(hp: HParams, n_ctx: int, n_batch: int, swa_full: bool = False) -> int:
        """Most positions a sliding-window layer holds at once: its window, a batch, the tile the
        release rounds to and V's page (a bound; check_n_ctx does not use it and still counts every
        position of every layer)."""
        if swa_full or hp.n_swa <= 0:
            return n_ctx
        page_tiles = max(1, mmap.PAGESIZE // (2 * hp.head_dim_v))
        return min(n_ctx, hp.n_swa + n_batch + _attn.KT * (1 + page_tiles))


def k_rows(k: np.ndarray, il: int, n: int) -> np.ndarray:
    """K of layer il at positions 0..n-1 as F16 bits, uint16 [n, n_embd_k] (a copy), from a cache's
    k (KVCache.k's layout: uint16 [n_layer, n_head_kv, ceil(n_ctx / 64), head_dim_k, 64])."""
    kt = k[il]  # [g, tile, i, j] -> [tile, j, g, i]
    return np.ascontiguousarray(kt.transpose(1, 3, 0, 2).reshape(kt.shape[1] * kt.shape[3], -1)[:n])


def v_rows(v: np.ndarray, il: int, n: int) -> np.ndarray:
    """V of layer il at positions 0..n-1 as F16 bits, uint16 [n, n_embd_v] (a copy), from a cache's
    v (KVCache.v's layout: uint16 [n_layer, n_head_kv, 64, ceil(n_ctx / 64), head_dim_v])."""
    vt = v[il]  # [g, l, m, c] -> [m, l, g, c]
    return np.ascontiguousarray(vt.transpose(2, 1, 0, 3).reshape(vt.shape[1] * vt.shape[2], -1)[:n])


class KVCache:
    """The F16 KV cache of a session, in llama.cpp's bytes: every entry rounded to F16 as
    llama.cpp's cache stores it, kept as F16 bits.

    k: uint16 [n_layer, n_head_kv, ceil(n_ctx / 64), head_dim_k, 64]: per KV head, K in tiles of 64
    positions (position p, dim i of head g at k[il, g, p // 64, i, p % 64]);
    v: uint16 [n_layer, n_head_kv, 64, ceil(n_ctx / 64), head_dim_v]: per KV head, the positions
    p = 64 m + l in order of (l, m) (channel c at v[il, g, p % 64, p // 64, c]): the layouts the
    attention kernels read as sequential streams (synapse_nb.kernels.attention). n_layer x n_ctx x
    (n_embd_k + n_embd_v) x 2 bytes (n_ctx rounded up to 64), zero-initialised like llama.cpp's
    buffer clear, committed page by page as positions are written (lazy_zeros).
    """

    def __init__(self, hp: HParams, n_ctx: int):
        self.n_ctx = n_ctx
        ks, vs = _attn.kv_shapes(n_ctx, hp.n_head_kv, hp.head_dim_k, hp.head_dim_v)
        self.k = lazy_zeros((hp.n_layer, *ks), np.uint16)
        self.v = lazy_zeros((hp.n_layer, *vs), np.uint16)

    @staticmethod
    def nbytes(hp: HParams, n_ctx: int) -> int:
        """Bytes of the cache at n_ctx positions: n_layer x n_ctx x (n_embd_k + n_embd_v) x 2 (F16)."""
        return hp.n_layer * n_ctx * hp.n_head_kv * (hp.head_dim_k + hp.head_dim_v) * 2

    def k_rows(self, il: int, n: int) -> np.ndarray:
        """K of layer il at positions 0..n-1 as F16 bits, uint16 [n, n_embd_k] (a copy)."""
        return k_rows(self.k, il, n)

    def v_rows(self, il: int, n: int) -> np.ndarray:
        """V of layer il at positions 0..n-1 as F16 bits, uint16 [n, n_embd_v] (a copy)."""
        return v_rows(self.v, il, n)

    def v_entry(self, il: int, p: int, c: int) -> tuple:
        """Index into v of layer il, position p, channel c of n_embd_v (e.g. for a test's write)."""
        hd = self.v.shape[4]
        return (il, c // hd, p % 64, p // 64, c % hd)


class ForwardState:
    """Activation buffers for batches of up to n_batch tokens, allocated once per session."""

    def __init__(self, hp: HParams, n_batch: int, n_ctx: int):
        n, E, F = n_batch, hp.n_embd, hp.n_ff
        self.n_batch = n_batch
        self.x = np.empty((n, E), np.float32)  # residual stream
        self.h = np.empty((n, E), np.float32)  # normed input of a sub-block
        self.q = np.empty((n, hp.n_head * hp.head_dim_k), np.float32)
        self.k = np.empty((n, hp.n_head_kv * hp.head_dim_k), np.float32)
        self.v = np.empty((n, hp.n_head_kv * hp.head_dim_v), np.float32)
        self.attn = np.empty((n, hp.n_head * hp.head_dim_v), np.float32)  # attention output (kqv)
        self.o = np.empty((n, E), np.float32)  # output of a sub-block (wo or ffn_down)
        self.gate = np.empty((n, F), np.float32)
        self.up = np.empty((n, F), np.float32)
        self.act = np.empty((n, F), np.float32)  # silu(gate) * up
        self.rope = np.empty((n, hp.n_rot), np.float32)  # cos/sin per position
        # the SWA layers' cos/sin (their own RoPE base: the recipe's rope_freq_base_swa); no rows without a window
        self.rope_swa = np.empty((n if hp.n_swa > 0 else 0, hp.n_rot), np.float32)
        self.temp = np.empty((n, 1), np.float32)  # the attention temperature per position (when the recipe has one)
        # scratch of the attention kernels for n_ctx positions
        self.attn_ws = _attn.Workspace(n_ctx, hp.n_head, hp.n_head_kv, hp.head_dim_k, hp.head_dim_v)
        self.abuf = None  # uint8 [7, n_batch * act_row_bytes]: converted activations (Model.forward)

    def activations(self, n: int) -> tuple:
        """The first n rows of x, h, q, k, v, attn, o, gate, up, act (graph.layers' order)."""
        return tuple(a[:n] for a in (self.x, self.h, self.q, self.k, self.v, self.attn, self.o, self.gate, self.up,
                                     self.act))
