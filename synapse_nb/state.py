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
