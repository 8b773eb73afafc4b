"""The transformer blocks of the forward as one compiled loop over tables of kernels.

``layers`` runs every block of the graph on n token rows (a prefill batch or a decode row), as
llama.cpp's graph builders do (build_attn, build_ffn; src/models/<arch>.cpp): one call per
forward, not about twenty Python calls per layer (their dispatch and glue were ~0.5 ms of a
4 ms SmolLM2 decode token). It calls the kernels and does the glue itself (bias adds, residual
adds, the attention temperature, the last layer's choice of rows) in float32 in ggml's order.

Which steps a block has is the model's recipe (synapse_nb.arch, read into HParams), given to the
loop as a small record (Block) and per-layer vectors (LayerVectors), never as an architecture
name: every model runs the same compiled loop. The kernels are called through their addresses
(kernels/native.py): ``Tables`` holds them, with the weights' addresses and shapes, in int64
arrays built once per model and batch kind from bound (validated) weights; the loop itself is
compiled once, for every model and batch size.
"""

from typing import NamedTuple

import numpy as np
from numba import types

from . import attention as _attn
from . import ops as _ops
from .decorator import kernel
from .matmul import MATMUL_ARGS, MATVEC_ARGS, MM_CHUNK_SIG, MV_CHUNK_SIG
from .native import WEIGHT_ROWS, call_at, kind, native_fn, rows, weight_rows

# The matmuls of a block, in the order of the matmul table's second axis
WQ, WK, WV, WO, WGATE, WUP, WDOWN = range(7)
MATMULS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
# Fields of a matmul table entry: the weight's rows (address, rows m, bytes per row), the bytes of
# one converted activation row, the entry whose converted activations it reads (itself, or an
# earlier entry of the same input converted to the same bytes), its vec_dot scratch size, then for
# the batch's rows and for one row (a prefill batch's last layer after attention): the matmul
# kernel (matmul.Chunked: its launch, mv_launch or mm_launch, with its chunk kernel in CH_N, CH_1)
# and the converter (0: reads the other entry's conversion); FUSE (on wq's and gate's
# entry; else 0): 3 (2) when one row's matvecs of wq, wk, wv (gate, up) are one call of wq's
# (gate's) kernel, the weights being of one format and n_in and sharing wq's (gate's) conversion;
# ROWS_MV: 1 when MM_N is the one-row (matvec) kernel, run on the batch's rows one after another
# (a batch of a few rows of a format whose matvec_rows covers them: BoundWeight.uses_matvec).
ENTRY_FIELDS = 14
ADDR, M, RB, ARB, SRC, NSC, MM_N, ACT_N, MM_1, ACT_1, FUSE, ROWS_MV, CH_N, CH_1 = range(ENTRY_FIELDS)
# The row-kernel table: [0] for the batch's rows, [1] for one row; columns (SWIGLU: the FFN's
# activation, the geglu kernel when the model's FFN is GEGLU):
# ATTN_SEGS (row 0 only; 0: none): the decode rows of a several-sequence batch in one call
# (attention.decode_segments), the other segments then one call each.
ROW_KERNELS = 6
RMS, ROPE, SWIGLU, STORE, ATTN, ATTN_SEGS = range(ROW_KERNELS)
# The segment table: one row per sequence of a batch (its rows are consecutive): the first row, the
# number of rows, the sequence's KV cache slot, the position of its first row, the attention kernel
# for those rows (see Tables.attention).
SEG_FIELDS = 5
SEG_ROW0, SEG_N, SEG_SLOT, SEG_POS, SEG_ATTN = range(SEG_FIELDS)

_F1 = types.Array(types.float32, 1, "C")
_F2 = types.Array(types.float32, 2, "C")
_U8 = types.Array(types.uint8, 2, "C")
_KV = types.Array(types.uint16, 4, "C")
_KV6 = types.Array(types.uint16, 6, "C")
_I1 = types.Array(types.int64, 1, "C")
# The kernels' signatures, as ``layers`` calls them (each call is checked against these types
# when the loop compiles; every address of a table comes from native_fn with exactly these types).
SIGNATURES = {
    # n > 1 rows: the chunk kernel's address (matmul.mm_launch), out, rows, activations, n_scratch
    "matmul": (types.int64, *MATMUL_ARGS),
    "mm_chunk": MM_CHUNK_SIG,  # a format's matmul chunk kernel: its range of chunks, then as matmul
    # one row: the chunk kernel's address (matmul.mv_launch), out1, rows1, out2, rows2, out3, rows3
    # (0 rows: none), activations, n_scratch
    "matvec": (types.int64, *MATVEC_ARGS),
    "mv_chunk": MV_CHUNK_SIG,  # a format's matvec chunk kernel: its range of chunks, then as matvec
    "convert": (_U8, _F2),  # activations, x
    "rms_norm": (_F2, _F2, _F1, types.float32),  # out, x, w, eps
    "rope": (_F2, _F2, types.int64, types.int64, types.int64, types.boolean),  # x, cache, heads, dim, n_rot, neox
    "swiglu": (_F2, _F2, _F2),  # out, gate, up
    "geglu": (_F2, _F2, _F2, _F1),  # out, gate, up, GELU table (ops.gelu_table)
    "store_kv": (_KV, _KV, _F2, _F2, types.int64),  # k_cache, v_cache, k, v, pos0
    # out, q, k_cache, v_cache, pos0, n_head, n_head_kv, kq_scale, workspace, sliding window (0: none),
    # the attention items' table (Tables.items)
    "attention": (_F2, _F2, _KV, _KV, types.int64, types.int64, types.int64, types.float32, _F1, types.int64, _I1),
    # out, q, k_caches, v_caches (all slots), segments, layer, n_head, n_head_kv, kq_scale, workspace, window,
    # items
    "attention_segs": (_F2, _F2, _KV6, _KV6, types.Array(types.int64, 2, "C"), types.int64, types.int64,
                       types.int64, types.float32, _F1, types.int64, _I1),
    # the attention kernels' items, which they call by address (attention.plan_items)
    **_attn.ITEM_SIGNATURES,
}
# The kind of a matmul driver's chunk kernel (matmul.Chunked)
CHUNK_KINDS = {"matvec": "mv_chunk", "matmul": "mm_chunk"}


def driver_kernels(driver, kind):
    """[(dispatcher, kind)] of a matmul.Chunked driver of kind "matvec" or "matmul": its launch,
    then its chunk kernel (the two addresses a matmul table entry holds: MM_N and CH_N)."""
    return [(driver.launch, kind), (driver.chunk, CHUNK_KINDS[kind])]

KINDS = ("matmul", "matvec", "convert", "rms_norm", "rope", "swiglu", "geglu", "store_kv", "attention",
         "attention_segs")
# The kinds, as constants of the compiled loop (a NativeFn argument would be typed by Python code
# at every call: ~27 us a forward for seven of them)
_K_MM, _K_MV, _K_CV, _K_RMS, _K_ROPE, _K_SWIGLU, _K_GEGLU, _K_STORE, _K_ATTN, _K_ATTN_SEGS = (
    kind(*SIGNATURES[k]) for k in KINDS)


class Block(NamedTuple):
    """A model's block recipe as ``layers`` reads it: scalars and flags, fixed per model.

    Built by Model from its HParams with these exact types (int, bool, numpy.float32), so that
    Numba types it alike for every model and one compiled loop serves all of them. ``layers``
    takes it as a plain tuple (tuple(block): Numba types a named tuple by its field names too,
    ~2 us more a call) and unpacks it in this field order.
    """

    n_head: int  # query heads
    n_head_kv: int  # K/V heads
    head_dim_k: int
    n_rot: int  # rotated dimensions of a head (= head_dim_k)
    neox: bool  # RoPE pairs (i, i + n_rot/2) (LLAMA_ROPE_TYPE_NEOX), else (2i, 2i+1)
    eps: np.float32  # RMS norms' epsilon
    kq_scale: np.float32  # the softmax's scale of q.k (build_attn's kq_scale)
    q_scale: np.float32  # q *= q_scale after RoPE (f_attention_scale); 0: none
    attn_temp: bool  # q scaled by its row's attention temperature after RoPE (inputs' temp)
    has_bias_qkv: bool  # Q, K, V biases added after the projections
    has_bias_o: bool  # output projection bias
    has_qk_norm: bool  # RMS norm of each q and k head after the projections (and biases)
    has_post_norms: bool  # RMS norms of the attention and FFN outputs before their residual adds
    geglu: bool  # FFN GEGLU (ggml's F16-table GELU of gate, times up), else SwiGLU


class LayerVectors(NamedTuple):
    """A model's vectors per layer (and the GELU table), as ``layers`` reads them (as a plain
    tuple, unpacked in this field order, like Block).

    norms       float32 [n_layer, 2, n_embd]: attn_norm, ffn_norm
    qk_norms    float32 [n_layer, 2, head_dim_k]: attn_q_norm, attn_k_norm ([n_layer, 0, 1] without)
    post_norms  float32 [n_layer, 2, n_embd]: post_attention_norm, post_ffw_norm ([n_layer, 0, 1])
    bias_q, bias_k, bias_v, bias_o  float32 [n_layer, d] ([n_layer, 0] without)
    swa         int64 [n_layer]: each layer's sliding window (0: full attention)
    gelu_table  float32 [65536] (ops.gelu_table) for a GEGLU FFN, else [0]
    """

    norms: np.ndarray
    qk_norms: np.ndarray
    post_norms: np.ndarray
    bias_q: np.ndarray
    bias_k: np.ndarray
    bias_v: np.ndarray
    bias_o: np.ndarray
    swa: np.ndarray
    gelu_table: np.ndarray


@kernel(nested=True)
def _matmul(e, one, out, x, abuf):
    """out[n] = W . x[n] for matmul table entry e (int64 [ENTRY_FIELDS]); one: the one-row kernels.
    x is converted to W's vec_dot_type into abuf[e[SRC]] (unless another entry did already)."""
    n = x.shape[0]
    a = rows(abuf[e[SRC]], n, e[ARB])
    cv = e[ACT_1] if one else e[ACT_N]
    if cv != 0:
        call_at(_K_CV, cv, a, x)
    w = weight_rows(e[ADDR], e[M], e[RB])
    if one or n == 1 or e[ROWS_MV] != 0:
        none = weight_rows(e[ADDR], 0, e[RB])
        call_at(_K_MV, e[MM_1] if one else e[MM_N], e[CH_1] if one else e[CH_N], out, w, out[:0], none, out[:0],
                none, a, e[NSC])
    else:
        call_at(_K_MM, e[MM_N], e[CH_N], out, w, a, e[NSC])


@kernel(nested=True)
def _matvecs(ea, eb, ec, n_w, one, ya, yb, yc, x, abuf):
    """ya, yb (and yc when n_w is 3) = W . x for one row x and the entries ea, eb, ec fused into
    one call of ea's kernel (ea[FUSE]): x converted once, by ea's converter."""
    a = rows(abuf[ea[SRC]], 1, ea[ARB])
    cv = ea[ACT_1] if one else ea[ACT_N]
    if cv != 0:
        call_at(_K_CV, cv, a, x)
    wa, wb = weight_rows(ea[ADDR], ea[M], ea[RB]), weight_rows(eb[ADDR], eb[M], eb[RB])
    if n_w == 3:
        wc, yc = weight_rows(ec[ADDR], ec[M], ec[RB]), yc
    else:
        wc, yc = weight_rows(ea[ADDR], 0, ea[RB]), ya[:0]
    call_at(_K_MV, ea[MM_1] if one else ea[MM_N], ea[CH_1] if one else ea[CH_N], ya, wa, yb, wb, yc, wc, a,
            ea[NSC])


@kernel(nested=True)
def _add_rows(y, b):
    """y[t] += b for every row t (numpy's y += b: float32 adds)."""
    for t in range(y.shape[0]):
        for i in range(y.shape[1]):
            y[t, i] += b[i]


@kernel(nested=True)
def _add_rows_2d(y, b):
    """y += b elementwise, both float32 [n, d]."""
    for t in range(y.shape[0]):
        for i in range(y.shape[1]):
            y[t, i] += b[t, i]


@kernel(nested=True)
def _scale_all(y, s):
    """y *= s (float32 scalar): ggml_scale."""
    for t in range(y.shape[0]):
        for i in range(y.shape[1]):
            y[t, i] *= s


@kernel(nested=True)
def _head_norms(rms, y, n_heads, head_dim, w, eps):
    """RMS norm of every head of y (float32 [n, n_heads * head_dim]) in place, weight w
    [head_dim]: ggml_rms_norm over ne0 = head_dim of the [head_dim, n_heads, n] view, then the MUL."""
    yh = rows(y, y.shape[0] * n_heads, head_dim)
    call_at(_K_RMS, rms, yh, yh, w, eps)


@kernel(nested=True)
def _scale_rows(y, s):
    """y[t] *= s[t, 0] for every row t (numpy's y *= s, s float32 [n, 1])."""
    for t in range(y.shape[0]):
        for i in range(y.shape[1]):
            y[t, i] *= s[t, 0]


@kernel
def layers(acts, inputs, cache, scratch, kernels, vecs, segs, blk, want_logits, all_logits):
    """Every transformer block on the n rows of x, appending each row's K/V to its sequence's cache.

    The rows are segments of one or more sequences, segs: int64 [n_seg, SEG_FIELDS] (first row,
    rows, KV slot, first position, attention kernel). Everything but the K/V store and the attention
    is row by row, so a row's bits do not depend on the other rows of the batch; the store and the
    attention run per segment on that sequence's cache kc[slot], vc[slot] over its positions
    0..pos, exactly as for the sequence alone.

    acts: (x, h, q, k, v, attn, o, gate, up, act), float32 [n, .] C, ForwardState's rows (x the
    residual stream, in and out). inputs: (rope, rope_swa, temp), float32 [n, .] per row: the
    RoPE cos/sin [n, n_rot] of the full-attention layers and of the sliding-window ones, the q
    temperature [n, 1] (read when blk.attn_temp). cache: (kc, vc), uint16 [n_slot, n_layer, ...],
    the KV caches of the slots (each one session.KVCache's 5-D arrays). scratch: (abuf, ws): uint8
    [7, >= n * act_row_bytes], the converted activations, and the attention Workspace's buffer.
    kernels: (mt, rk, items) (Tables): int64 [n_layer, 7, ENTRY_FIELDS] matmul entries, int64
    [2, ROW_KERNELS] row kernels and the attention kernels' item table. vecs: tuple(LayerVectors);
    blk: tuple(Block), the recipe (which steps run).

    Stops after the last layer's K/V are stored when not want_logits; with one segment,
    all_logits false and n > 1, the last layer after its K/V goes on with the last row only
    (llama.cpp's inp_out_ids; rows are independent); with several segments every row goes on (the
    caller picks the rows it wants).
    """
    x, h, q, k, v, attn, o, gate, up, act = acts
    rope, rope_swa, temp = inputs
    kc, vc = cache
    abuf, ws = scratch
    mt, rk, items = kernels
    (n_head, n_head_kv, head_dim_k, n_rot, neox, eps, kq_scale, q_scale, attn_temp, has_bias_qkv, has_bias_o,
     has_qk_norm, has_post_norms, geglu) = blk  # Block's fields, in order
    norms, qk_norms, post_norms, bias_q, bias_k, bias_v, bias_o, swa, gelu_table = vecs  # LayerVectors' fields
    n = x.shape[0]
    n_layer = mt.shape[0]
    n_seg = segs.shape[0]
    for il in range(n_layer):
        e = mt[il]
        one = n == 0  # False: a run-time bool, not the literal, so each helper compiles once
        # Attention RMSNorm: x / sqrt(mean(x^2) + eps) * attn_norm
        call_at(_K_RMS, rk[0, RMS], h, x, norms[il, 0], eps)
        # Q, K, V projections (+ biases); h is converted once for the weights sharing it
        if n == 1 and e[WQ, FUSE] != 0:
            _matvecs(e[WQ], e[WK], e[WV], e[WQ, FUSE], one, q, k, v, h, abuf)
        else:
            _matmul(e[WQ], one, q, h, abuf)
            _matmul(e[WK], one, k, h, abuf)
            _matmul(e[WV], one, v, h, abuf)
        if has_bias_qkv:
            _add_rows(q, bias_q[il])
            _add_rows(k, bias_k[il])
            _add_rows(v, bias_v[il])
        # RMS norm of each q and k head (attn_q_norm, attn_k_norm)
        if has_qk_norm:
            _head_norms(rk[0, RMS], q, n_head, head_dim_k, qk_norms[il, 0], eps)
            _head_norms(rk[0, RMS], k, n_head_kv, head_dim_k, qk_norms[il, 1], eps)
        # RoPE on q and k (normal: pairs (2i, 2i+1); NEOX: (i, i + n_rot/2)); an SWA layer's own table
        rp = rope_swa if swa[il] > 0 else rope
        call_at(_K_ROPE, rk[0, ROPE], q, rp, n_head, head_dim_k, n_rot, neox)
        call_at(_K_ROPE, rk[0, ROPE], k, rp, n_head_kv, head_dim_k, n_rot, neox)
        # q scaled by the attention temperature of its position (after RoPE)
        if attn_temp:
            _scale_rows(q, temp)
        # q scaled by f_attention_scale (the softmax's kq_scale is then 1)
        if q_scale != 0:
            _scale_all(q, q_scale)
        # Append k, v to each sequence's cache of this layer as F16
        for s in range(n_seg):
            r0, m, slot = segs[s, SEG_ROW0], segs[s, SEG_N], segs[s, SEG_SLOT]
            call_at(_K_STORE, rk[0, STORE], kc[slot, il], vc[slot, il], k[r0:r0 + m], v[r0:r0 + m], segs[s, SEG_POS])
        if il == n_layer - 1:
            if not want_logits:
                return  # the cache is complete; nothing after this feeds it
            if not all_logits and n > 1 and n_seg == 1:
                # Last layer: only the row that produces logits goes on
                q, attn, x, h, o, gate, up, act = (q[n - 1:], attn[n - 1:], x[n - 1:], h[n - 1:], o[n - 1:],
                                                   gate[n - 1:], up[n - 1:], act[n - 1:])
                one = True
        r = 1 if one else 0
        # Causal attention of each sequence's rows over its positions 0..p (p - swa + 1..p on a
        # sliding-window layer): F16 q.k, softmax, F16 probabilities . V
        if one:
            slot, pos_q = segs[0, SEG_SLOT], segs[0, SEG_POS] + n - 1
            call_at(_K_ATTN, rk[1, ATTN], attn, q, kc[slot, il], vc[slot, il], pos_q, n_head, n_head_kv, kq_scale, ws,
                    swa[il], items)
        else:
            together = rk[0, ATTN_SEGS] != 0  # the decode rows in one parallel call
            if together:
                call_at(_K_ATTN_SEGS, rk[0, ATTN_SEGS], attn, q, kc, vc, segs, il, n_head, n_head_kv, kq_scale, ws,
                        swa[il], items)
            for s in range(n_seg):
                r0, m, slot = segs[s, SEG_ROW0], segs[s, SEG_N], segs[s, SEG_SLOT]
                if together and m == 1:
                    continue
                call_at(_K_ATTN, segs[s, SEG_ATTN], attn[r0:r0 + m], q[r0:r0 + m], kc[slot, il], vc[slot, il],
                        segs[s, SEG_POS], n_head, n_head_kv, kq_scale, ws, swa[il], items)
        # Output projection (+ bias)
        _matmul(e[WO], one, o, attn, abuf)
        if has_bias_o:
            _add_rows(o, bias_o[il])
        # RMS norm of the attention output (post_attention_norm)
        if has_post_norms:
            call_at(_K_RMS, rk[r, RMS], o, o, post_norms[il, 0], eps)
        # Residual: ffn_inp = attn_out + x
        _add_rows_2d(x, o)
        # FFN RMSNorm
        call_at(_K_RMS, rk[r, RMS], h, x, norms[il, 1], eps)
        # FFN: down(silu(gate(h)) * up(h)) (SwiGLU) or down(gelu(gate(h)) * up(h)) (GEGLU)
        if (one or n == 1) and e[WGATE, FUSE] != 0:
            _matvecs(e[WGATE], e[WUP], e[WUP], e[WGATE, FUSE], one, gate, up, up, h, abuf)
        else:
            _matmul(e[WGATE], one, gate, h, abuf)
            _matmul(e[WUP], one, up, h, abuf)
        if geglu:  # ggml's F16-table GELU of gate, times up
            call_at(_K_GEGLU, rk[r, SWIGLU], act, gate, up, gelu_table)
        else:
            call_at(_K_SWIGLU, rk[r, SWIGLU], act, gate, up)
        _matmul(e[WDOWN], one, o, act, abuf)
        # RMS norm of the FFN output (post_ffw_norm)
        if has_post_norms:
            call_at(_K_RMS, rk[r, RMS], o, o, post_norms[il, 1], eps)
        # Residual: x = ffn_out + ffn_inp
        _add_rows_2d(x, o)


class Tables:
    """What ``layers`` needs of a model besides the rows it runs on: the matmul tables (one per
    batch kind, built on first use, compiling or loading only the kernels that kind calls), the
    row-kernel tables, and the per-layer vectors (``vectors``: LayerVectors).

    layer_weights: a model's LayerWeights (BoundWeight matmuls: validated, so their addresses and
    shapes are the bytes of the tensor); hp: its HParams, for the recipe values (its norms and
    biases present, sliding-window layers, FFN activation). The arrays here are made once; the
    caller keeps the weights alive. lookup: None, or a callable(dispatcher, kind) -> int that
    stands in for compiling each kernel the tables name (a warm-up listing them without compiling:
    compilation.forwards.table_kernels); its tables are then not meant to run.
    """

    def __init__(self, layer_weights, hp, lookup=None):
        self._layers = layer_weights
        self._lookup = lookup
        n_layer = len(layer_weights)

        def stacked(*names):
            """float32 C [n_layer, d] (one name) or [n_layer, len(names), d]: LayerWeights' vectors."""
            rows = [getattr(L, names[0]) if len(names) == 1 else np.stack([getattr(L, a) for a in names])
                    for L in layer_weights]
            return np.ascontiguousarray(np.stack(rows), dtype=np.float32)

        none = np.zeros((n_layer, 0, 1), np.float32)
        bias = [stacked(name) if getattr(layer_weights[0], name) is not None else np.zeros((n_layer, 0), np.float32)
                for name in ("bq", "bk", "bv", "bo")]
        self.geglu = hp.ffn_act == "gelu"
        self.vectors = LayerVectors(
            norms=stacked("attn_norm", "ffn_norm"),
            qk_norms=stacked("q_norm", "k_norm") if hp.has_qk_norm else none,
            post_norms=stacked("post_attn_norm", "post_ffn_norm") if hp.has_post_norms else none,
            bias_q=bias[0], bias_k=bias[1], bias_v=bias[2], bias_o=bias[3],
            swa=np.array([hp.n_swa if hp.is_swa(il) else 0 for il in range(n_layer)], np.int64),
            gelu_table=_ops.gelu_table() if self.geglu else np.zeros(0, np.float32),
        )
        self.vector_args = tuple(self.vectors)  # as ``layers`` takes them
        # bytes of one converted activation row, the most of any matmul (``layers``' abuf holds 7
        # converted inputs of up to n_batch rows: ForwardState.abuf, one per session)
        self.act_row_bytes = max(getattr(L, w).act_row_bytes for L in layer_weights for w in MATMULS)
        self._mt = {}  # (multi, last_row) -> int64 [n_layer, 7, ENTRY_FIELDS]
        self._fns = {}  # dispatcher -> its NativeFn of its kind's signature
        # the attention kernels' item table (layers' last kernel table): int64 [attention.N_ITEMS],
        # the addresses of the items of the attention kernels looked up so far (attention)
        self.items = np.zeros(_attn.N_ITEMS, np.int64)

    def _fn(self, dispatcher, kind):
        if self._lookup is not None:
            return self._lookup(dispatcher, kind)
        f = self._fns.get(dispatcher)
        if f is None:
            f = self._fns[dispatcher] = native_fn(dispatcher, *SIGNATURES[kind])
        return f.addr

    def _fns_of(self, driver, kind):
        """The addresses of a matmul.Chunked driver's launch and chunk kernel (driver_kernels)."""
        return [self._fn(d, k) for d, k in driver_kernels(driver, kind)]

    def matmuls(self, multi, last_row, n=None):
        """int64 [n_layer, 7, ENTRY_FIELDS]: the matmul entries for a batch of several rows
        (multi) or one, with the one-row kernels filled in when last_row (a batch whose last layer
        continues with its last row; zero otherwise, and never read). n: the batch's rows; up to
        ops.SERIAL_ROWS, several rows are converted on the calling thread (the same bytes; a
        ParallelSession step passes it, a Session's forward does not), and a weight whose
        format runs n rows faster by its matvec kernel gets that (ROWS_MV)."""
        small = bool(multi) and n is not None and n <= _ops.SERIAL_ROWS
        key = (bool(multi), bool(last_row) and bool(multi), n if small else 0)
        t = self._mt.get(key)
        if t is None:
            t = np.zeros((len(self._layers), len(MATMULS), ENTRY_FIELDS), np.int64)
            for il, L in enumerate(self._layers):
                ws = [getattr(L, name) for name in MATMULS]
                for j, w in enumerate(ws):
                    # q, k, v read h; gate, up read the FFN's h: a conversion to the same bytes is shared
                    group = (WQ, WK, WV) if j <= WV else (WGATE, WUP) if j in (WGATE, WUP) else (j,)
                    src = next(i for i in group if i <= j and ws[i].shares_activation(w))
                    t[il, j, :NSC + 1] = (w.rows.ctypes.data, w.m, w.rows.shape[1], w.act_row_bytes, src, w.n_scratch)
                    rows_mv = small and w.uses_matvec(n)
                    mv = not multi or rows_mv  # the one-row (matvec) kernel
                    mm = w.drivers(1 if mv else 2)[0]
                    cv = w.drivers(2 if multi and not small else 1)[1]  # small: the serial converter (same bytes)
                    t[il, j, ROWS_MV] = rows_mv
                    t[il, j, MM_N], t[il, j, CH_N] = self._fns_of(mm, "matvec" if mv else "matmul")
                    t[il, j, ACT_N] = self._fn(cv, "convert") if src == j else 0
                    if key[1] and j >= WO:
                        mm1, cv1 = w.drivers(1)
                        t[il, j, MM_1], t[il, j, CH_1] = self._fns_of(mm1, "matvec")
                        t[il, j, ACT_1] = self._fn(cv1, "convert") if src == j else 0
                for group in ((WQ, WK, WV), (WGATE, WUP)):
                    # one call when the group's weights share one kernel (format and row count's
                    # variant: BoundWeight.drivers) and conversion
                    g0, first = group[0], ws[group[0]]
                    if all(ws[j].fmt is first.fmt and t[il, j, SRC] == g0 and ws[j].n_scratch == first.n_scratch
                           and t[il, j, CH_N] == t[il, g0, CH_N] and t[il, j, CH_1] == t[il, g0, CH_1]
                           for j in group):
                        t[il, group[0], FUSE] = len(group)
            self._mt[key] = t
        return t

    def rows(self, ws, n, n_past, last_row, hp, serial_upto=1, decode_rows=False):
        """int64 [2, ROW_KERNELS]: the row kernels for n rows at positions n_past.. (and for the
        last row of the last layer when last_row and n > 1; zero otherwise, and never read), the
        attention kernel as attention_rows chooses it; with decode_rows (a batch of several
        sequences, two or more of them one row each) and the vector kernels, ATTN_SEGS."""
        t = np.zeros((2, ROW_KERNELS), np.int64)
        if decode_rows and ws.plan is not None:
            t[0, ATTN_SEGS] = self._fn(_attn.decode_segments, "attention_segs")
            self._items(ws, True)
        variants = [(n, n_past)] + ([(1, n_past + n - 1)] if last_row and n > 1 else [])
        for r, (m, pos) in enumerate(variants):
            rows = _ops.row_kernels(m, serial_upto)
            if r == 0:  # the last row goes on after RoPE and the K/V store
                t[r, ROPE] = self._fn(rows.rope, "rope")
                t[r, STORE] = self._fn(_attn.store_kv_kernel, "store_kv")
            t[r, RMS] = self._fn(rows.rms_norm, "rms_norm")
            t[r, SWIGLU] = self._fn(rows.geglu, "geglu") if self.geglu else self._fn(rows.swiglu, "swiglu")
            t[r, ATTN] = self.attention(ws, m, pos, hp)
        return t

    def attention(self, ws, n, pos0, hp):
        """The address of the attention kernel for n query rows at positions pos0.. (as
        attention_rows chooses it: attention.kernel_for), its items entered in the item table."""
        self._items(ws, n == 1)
        return self._fn(_attn.kernel_for(ws, n, pos0, hp.n_head, hp.head_dim_k, hp.head_dim_v), "attention")

    def _items(self, ws, decode):
        """Enter the items of ws's vector kernel for a decode row (decode) or a prefill batch
        (attention.item_kernels) in the item table, items."""
        for i, d, k in _attn.item_kernels(ws, decode):
            self.items[i] = self._fn(d, k)
