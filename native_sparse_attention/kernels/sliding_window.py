"""Triton kernels for NSA's sliding-window branch, run by the selection operator
(``kernels/selection.py``): the window's output comes from the selection's forward launch.

Notation (that of ``kernels/selection.py``, plus)
------------------------------------------------
WINDOW: the window w; query i sees keys j with 0 <= i - j <= w when CAUSAL, |i - j| <= w
    otherwise
HEADS_PAD: SEL_SHARED_HEADS rounded up to a power of two
WINDOW_ROWS: rows of a window tile, WINDOW_QUERIES (= WINDOW_ROWS // HEADS_PAD) positions of
    HEADS_PAD heads each; WINDOW_N: keys per window key tile
HAS_DOCS: packed documents (causal, queries at every key only): query i also needs
    j >= DOC_START[z, i], which with j <= i is i < DOC_END[z, j] (DOC_START, DOC_END:
    [Z, N] int32, the first position of a token's document and one past its last)

Work decomposition
------------------
Neighbouring queries share almost all of their window, so the window runs flash-style
over WINDOW_ROWS rows = WINDOW_QUERIES consecutive positions x HEADS_PAD heads (the
selection program's heads, padded to a power of two), one key tile of WINDOW_N keys
serving every row. A per-position program would read each window key WINDOW_QUERIES
times as often.

- ``window_forward``: one window tile's online softmax; the selection's ``_fwd_kernel``
  calls it from its first programs. In a launch of its own, after the selection's, it
  can also write the layer's gated sum of the three branches for its rows. The key tiles
  inside every row's window skip the mask (at 32 heads on 2 kv heads, d = 64, window 512,
  n = 65536, bf16 on an H100: 5.10 -> 5.06 ms for the forward's two launches). The same
  split made the dQ and dK / dV passes slower (0.96 -> 1.01 and 1.54 -> 1.65 ms): their
  loops, cut in three or four, each fill and drain their pipelines of copies in flight.
- ``window_dq_kernel``: the window's dQ of one window tile into a buffer, which the
  selection's dQ pass adds to its own, and the window's delta = rowsum(dO * O).
- ``window_dkv_kernel``: one program per (key tile, kv head, batch z); the window is a
  band, so the queries that see a key tile are known and dK / dV of the window are
  accumulated in registers without atomics. Its steps take rows as the window tiles do,
  consecutive positions x the kv head's query heads: at 32 heads on 2 kv heads, d = 64,
  n = 65536, window 512, bf16 on an H100, 1.96 -> 1.79 ms against steps of 32 positions of
  one head at a time. Each program starts its walk over the queries at the multiple of
  its span that its range holds and wraps around, so that the programs of neighbouring
  key tiles read the same query rows at the same time: walked from the first query, the
  pass read q and dO from DRAM (an L2 hit rate of 5% on an H200; same configuration,
  1.83 -> 1.54 ms on an H100). It also adds the selection's float32 accumulators and
  writes dK and dV in the input dtype.
"""

from __future__ import annotations

import triton
import triton.language as tl

from native_sparse_attention.kernels.attention_tiles import (
    LOG2E,
    backward_rows,
    dense_rows,
    dkv_tile,
    dq_tile,
    load_lse2,
    load_tile,
    program_heads,
    softmax_tile,
    store_attention,
    strided_rows,
)
from native_sparse_attention.kernels.library import head_offset


@triton.jit
def _window_rows(tile, first_head, M, SEL_SHARED_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr,
                 WINDOW_ROWS: tl.constexpr):
    """Query rows, query heads and existence of the rows of window tile ``tile``: tile row
    r is head ``r % HEADS_PAD`` of the group at query row ``tile * WINDOW_QUERIES + r // HEADS_PAD``."""
    WINDOW_QUERIES: tl.constexpr = WINDOW_ROWS // HEADS_PAD
    rows = tl.arange(0, WINDOW_ROWS)
    i = tile * WINDOW_QUERIES + rows // HEADS_PAD
    head_in_group = rows % HEADS_PAD
    return i, first_head + head_in_group, (i < M) & (head_in_group < SEL_SHARED_HEADS)


@triton.jit
def _window_keys(tile, M, Q_START, N, WINDOW: tl.constexpr, CAUSAL: tl.constexpr, WINDOW_QUERIES: tl.constexpr,
                 WINDOW_N: tl.constexpr):
    """The WINDOW_N-aligned start and the end of the keys any row of window tile ``tile`` sees."""
    first_query = Q_START + tile * WINDOW_QUERIES
    last_query = Q_START + tl.minimum(tile * WINDOW_QUERIES + WINDOW_QUERIES, M) - 1
    if CAUSAL:
        hi = last_query + 1
    else:
        hi = tl.minimum(last_query + WINDOW + 1, N)
    return (tl.maximum(first_query - WINDOW, 0) // WINDOW_N) * WINDOW_N, hi


@triton.jit
def _window_key_tiles(tile, M, Q_START, N, WINDOW: tl.constexpr, CAUSAL: tl.constexpr,
                      WINDOW_QUERIES: tl.constexpr, WINDOW_N: tl.constexpr):
    """(first, full_lo, full_hi, hi): window tile ``tile`` walks the key tiles starting at
    first, first + WINDOW_N, .. below hi (``_window_keys``); those starting in
    [full_lo, full_hi) lie in the window of each of its rows and need no mask (7 of 9 key
    tiles at a window of 512, 8 positions per window tile)."""
    first, hi = _window_keys(tile, M, Q_START, N, WINDOW, CAUSAL, WINDOW_QUERIES, WINDOW_N)
    first_query = Q_START + tile * WINDOW_QUERIES
    # The tile's last position even where it runs past M: a stricter bound, never a wrong one.
    last_query = first_query + WINDOW_QUERIES - 1
    if CAUSAL:
        last_key = first_query
    else:
        last_key = first_query + WINDOW
    full_lo = tl.minimum(tl.cdiv(tl.maximum(last_query - WINDOW, 0), WINDOW_N) * WINDOW_N, hi)
    full_hi = tl.maximum(tl.minimum(last_key + 1, hi) // WINDOW_N * WINDOW_N, full_lo)
    return first, full_lo, full_hi, hi


@triton.jit
def _in_band(distance, WINDOW: tl.constexpr, CAUSAL: tl.constexpr):
    """Whether a key lies in a query's window, from ``distance`` = query position - key
    position (any shape)."""
    if CAUSAL:
        return (distance >= 0) & (distance <= WINDOW)
    return (distance >= -WINDOW) & (distance <= WINDOW)


@triton.jit
def _in_window(i, pos, WINDOW: tl.constexpr, CAUSAL: tl.constexpr):
    """[len(i), len(pos)]: key ``pos`` lies in query ``i``'s window."""
    return _in_band(i[:, None] - pos[None, :], WINDOW, CAUSAL)


@triton.jit
def _visible(i, pos, hi, doc_start, WINDOW: tl.constexpr, CAUSAL: tl.constexpr):
    """[len(i), len(pos)]: key ``pos`` (below hi) lies in query ``i``'s window, and in its
    document where ``doc_start`` (the rows' DOC_START) is not None."""
    visible = _in_window(i, pos, WINDOW, CAUSAL) & (pos < hi)[None, :]
    if doc_start is not None:
        visible &= pos[None, :] >= doc_start[:, None]
    return visible


@triton.jit
def _document_starts(DOC_START, z, r, row_ok, N):
    """(DOC_START of query rows ``r`` of batch z, the smallest of them over the rows that
    exist); a row that does not exist reads 0."""
    doc_start = tl.load(DOC_START + z.to(tl.int64) * N + r, mask=row_ok, other=0)
    return doc_start, tl.min(tl.where(row_ok, doc_start, N), 0)


@triton.jit
def _document_key_tiles(first, full_lo, full_hi, hi, doc_lo, doc_hi, WINDOW_N: tl.constexpr):
    """``_window_key_tiles``' (first, full_lo, full_hi) for rows whose documents start
    between doc_lo and doc_hi: no row sees a key tile below doc_lo's, and a tile can skip
    the mask only once every row's document has started, from doc_hi on (so the tiles
    from full_hi on need the window's mask alone)."""
    first = tl.maximum(first, doc_lo // WINDOW_N * WINDOW_N)
    full_lo = tl.minimum(tl.maximum(full_lo, tl.cdiv(doc_hi, WINDOW_N) * WINDOW_N), hi)
    return first, full_lo, tl.maximum(full_hi, full_lo)


@triton.jit
def _key_tiles(K_TILES, V_TILES, z, kv_head, start, WINDOW_N: tl.constexpr, D_PAD: tl.constexpr):
    """The window's keys and values ``start .. start + WINDOW_N`` of kv head ``[z, kv_head]``
    through TMA descriptors of [Z, HKV, N, D] (zeros past N or D)."""
    k = K_TILES.load([z, kv_head, start, 0]).reshape(WINDOW_N, D_PAD)
    v = V_TILES.load([z, kv_head, start, 0]).reshape(WINDOW_N, D_PAD)
    return k, v


@triton.jit
def _forward_step(q, i, m_i, l_i, acc, K_TILES, V_TILES, z, kv_head, start, hi, doc_start, scale2,
                  WINDOW: tl.constexpr, CAUSAL: tl.constexpr, WINDOW_N: tl.constexpr, D_PAD: tl.constexpr,
                  DOT_PRECISION: tl.constexpr, MASKED: tl.constexpr):
    """``softmax_tile`` of the window tile's rows ``i`` over the key tile at ``start``,
    masked (``_visible``) where MASKED."""
    k, v = _key_tiles(K_TILES, V_TILES, z, kv_head, start, WINDOW_N, D_PAD)
    if MASKED:
        visible = _visible(i, start + tl.arange(0, WINDOW_N), hi, doc_start, WINDOW, CAUSAL)
        m_i, l_i, acc = softmax_tile(q, k, v, visible, scale2, m_i, l_i, acc, DOT_PRECISION)
    else:
        m_i, l_i, acc = softmax_tile(q, k, v, None, scale2, m_i, l_i, acc, DOT_PRECISION)
    return m_i, l_i, acc


@triton.jit
def window_forward(
    Q, K_TILES, V_TILES, SWA_O, SWA_LSE, tile, split, z, kv_head, first_head,
    stride_qz, stride_qh, stride_qn, stride_qd,
    M, Q_START, N, HQ, scale2,
    GATES, OUT_C, OUT_S, MERGED, stride_gk, stride_gz, stride_gh, stride_gn, DOC_START,
    SEL_SHARED_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, WINDOW_ROWS: tl.constexpr, WINDOW_N: tl.constexpr,
    D: tl.constexpr, D_PAD: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, GATED: tl.constexpr,
    DOT_PRECISION: tl.constexpr, HAS_DOCS: tl.constexpr, SPLITS: tl.constexpr,
):
    """Sliding-window attention of the WINDOW_ROWS rows of window tile ``tile``; with
    GATED also the layer's gated sum of those rows (``_store_gated_sum``). K_TILES,
    V_TILES: TMA descriptors of [WINDOW_N, D_PAD] tiles of the keys and values. HAS_DOCS
    (Q_START = 0): DOC_START [Z, M]. Over share ``split`` of SPLITS shares of the tile's
    key tiles (consecutive runs, as even as they divide), into SWA_O [Z, HQ, SPLITS, M, D]
    and SWA_LSE [Z, HQ, SPLITS, M]; GATED takes one share."""
    r, heads, row_ok = _window_rows(tile, first_head, M, SEL_SHARED_HEADS, HEADS_PAD, WINDOW_ROWS)
    i = Q_START + r
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < D
    q = load_tile(Q, strided_rows(z, heads, r, stride_qz, stride_qh, stride_qn), row_ok, offs_d, d_ok, stride_qd)

    m_i = tl.full([WINDOW_ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([WINDOW_ROWS], tl.float32)
    acc = tl.zeros([WINDOW_ROWS, D_PAD], tl.float32)
    first, full_lo, full_hi, hi = _window_key_tiles(tile, M, Q_START, N, WINDOW, CAUSAL, WINDOW_ROWS // HEADS_PAD,
                                                     WINDOW_N)
    doc_start = None
    if HAS_DOCS:
        doc_start, doc_lo = _document_starts(DOC_START, z, r, row_ok, M)
        first, full_lo, full_hi = _document_key_tiles(first, full_lo, full_hi, hi, doc_lo, tl.max(doc_start, 0),
                                                      WINDOW_N)
    key_tiles = tl.cdiv(hi - first, WINDOW_N)
    share_lo = first + split * key_tiles // SPLITS * WINDOW_N
    share_hi = tl.minimum(first + (split + 1) * key_tiles // SPLITS * WINDOW_N, hi)
    for start in range(tl.maximum(first, share_lo), tl.minimum(full_lo, share_hi), WINDOW_N):
        m_i, l_i, acc = _forward_step(q, i, m_i, l_i, acc, K_TILES, V_TILES, z, kv_head, start, hi, doc_start,
                                      scale2, WINDOW, CAUSAL, WINDOW_N, D_PAD, DOT_PRECISION, True)
    # From full_lo on every key lies in each row's document (``_document_key_tiles``).
    for start in range(tl.maximum(full_lo, share_lo), tl.minimum(full_hi, share_hi), WINDOW_N):
        m_i, l_i, acc = _forward_step(q, i, m_i, l_i, acc, K_TILES, V_TILES, z, kv_head, start, hi, None,
                                      scale2, WINDOW, CAUSAL, WINDOW_N, D_PAD, DOT_PRECISION, False)
    for start in range(tl.maximum(full_hi, share_lo), share_hi, WINDOW_N):
        m_i, l_i, acc = _forward_step(q, i, m_i, l_i, acc, K_TILES, V_TILES, z, kv_head, start, hi, None,
                                      scale2, WINDOW, CAUSAL, WINDOW_N, D_PAD, DOT_PRECISION, True)
    share = heads * SPLITS + split
    out_rows = dense_rows(z, share, r, HQ * SPLITS, M, D)
    lse_rows = (z.to(tl.int64) * HQ * SPLITS + share) * M + r
    out = store_attention(SWA_O, SWA_LSE, acc, m_i, l_i, out_rows, lse_rows, row_ok, offs_d, d_ok)
    if GATED:
        _store_gated_sum(MERGED, GATES, OUT_C, OUT_S, out, out_rows, z, heads, r, row_ok, offs_d, d_ok, M, HQ, D,
                         stride_gk, stride_gz, stride_gh, stride_gn)


@triton.jit
def _store_gated_sum(
    MERGED, GATES, OUT_C, OUT_S, sliding, out_rows, z, heads, r, row_ok, offs_d, d_ok, M, HQ, D: tl.constexpr,
    stride_gk, stride_gz, stride_gh, stride_gn,
):
    """The layer's gated sum of the rows ``[z, heads, r]``, heads merged:
    ``MERGED[z, r, h * D + d] = sum_k GATES[k, z, h, r] * branch_k[z, h, r, d]`` over the
    compressed (OUT_C), selected (OUT_S) and sliding (``sliding``, as stored) branches, in
    float32 and in the order of ``kernels/gate_combine.py``'s kernel, which it replaces
    in the layer: a pass of its own over the three outputs, bound by memory bandwidth.
    OUT_C and OUT_S are contiguous [Z, HQ, M, D], written by earlier launches.
    """
    gate_rows = head_offset(z, heads, stride_gz, stride_gh) + r.to(tl.int64) * stride_gn
    gate_c = tl.load(GATES + gate_rows, mask=row_ok).to(tl.float32)
    gate_s = tl.load(GATES + gate_rows + stride_gk, mask=row_ok).to(tl.float32)
    gate_w = tl.load(GATES + gate_rows + 2 * stride_gk, mask=row_ok).to(tl.float32)
    merged = (gate_c[:, None] * load_tile(OUT_C, out_rows, row_ok, offs_d, d_ok, 1).to(tl.float32)
              + gate_s[:, None] * load_tile(OUT_S, out_rows, row_ok, offs_d, d_ok, 1).to(tl.float32)
              + gate_w[:, None] * sliding.to(tl.float32))
    merged_rows = ((z.to(tl.int64) * M + r) * HQ + heads) * D
    tl.store(MERGED + merged_rows[:, None] + offs_d[None, :], merged.to(MERGED.dtype.element_ty),
             mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def window_dq_kernel(
    Q, K_TILES, V_TILES, SWA_O, SWA_DO, SWA_LSE, SWA_DELTA, DQ_WINDOW, DQ_ACC, DOC_START,
    stride_qz, stride_qh, stride_qn, stride_qd,
    stride_sdoz, stride_sdoh, stride_sdon, stride_sdod,
    N, HQ, sm_scale,
    SEL_SHARED_HEADS: tl.constexpr, GQA_SHARED_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr,
    WINDOW_ROWS: tl.constexpr, WINDOW_N: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, ADD_ACC: tl.constexpr, DOT_PRECISION: tl.constexpr,
    HAS_DOCS: tl.constexpr,
):
    """The window's dQ (into DQ_WINDOW, in its dtype) and delta of window tile
    ``program_id(0)``; K_TILES, V_TILES as in ``window_forward``. ADD_ACC: DQ_WINDOW gets
    the sum of that dQ and the dQ the selection left, without sm_scale, in DQ_ACC
    ([Z, HQ, N, D] float32). HAS_DOCS: DOC_START [Z, N]."""
    z, sel_head, kv_head, first_head = program_heads(SEL_SHARED_HEADS, GQA_SHARED_HEADS)
    tile = tl.program_id(0)
    i, heads, row_ok = _window_rows(tile, first_head, N, SEL_SHARED_HEADS, HEADS_PAD, WINDOW_ROWS)
    offs_n = tl.arange(0, WINDOW_N)
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < D
    q, do, delta, lse2, out_rows = backward_rows(
        Q, SWA_O, SWA_DO, SWA_LSE, SWA_DELTA, z, heads, i, row_ok, stride_qz, stride_qh, stride_qn, stride_qd,
        stride_sdoz, stride_sdoh, stride_sdon, stride_sdod, N, HQ, D, D_PAD,
    )

    dq = tl.zeros([WINDOW_ROWS, D_PAD], tl.float32)
    first, hi = _window_keys(tile, N, 0, N, WINDOW, CAUSAL, WINDOW_ROWS // HEADS_PAD, WINDOW_N)
    doc_start = None
    if HAS_DOCS:
        doc_start, doc_lo = _document_starts(DOC_START, z, i, row_ok, N)
        first = tl.maximum(first, doc_lo // WINDOW_N * WINDOW_N)
    for start in range(first, hi, WINDOW_N):
        pos = start + offs_n
        k, v = _key_tiles(K_TILES, V_TILES, z, kv_head, start, WINDOW_N, D_PAD)
        visible = _visible(i, pos, hi, doc_start, WINDOW, CAUSAL)
        dq, _ = dq_tile(q, do, lse2, delta, k, v, visible, sm_scale * LOG2E, 1.0, dq, DOT_PRECISION)
    if ADD_ACC:
        dq += load_tile(DQ_ACC, out_rows, row_ok, offs_d, d_ok, 1)
    dq *= sm_scale  # d(logit)/d(q.k), once instead of per score
    tl.store(DQ_WINDOW + out_rows[:, None] + offs_d[None, :], dq.to(DQ_WINDOW.dtype.element_ty),
             mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _document_query_steps(DOC_END, z, pos, key_ok, N, q_lo, q_hi, first_step, POSITIONS: tl.constexpr):
    """(DOC_END of keys ``pos``, q_hi, steps, first step) of ``window_dkv_kernel`` where the
    keys' documents end before q_hi: the steps past the last document's end see none of
    the keys and are left out. The walk keeps its wrap-around order minus those steps."""
    doc_end = tl.load(DOC_END + z.to(tl.int64) * N + pos, mask=key_ok, other=0)
    q_hi = tl.minimum(q_hi, tl.max(doc_end, 0))
    steps = tl.cdiv(q_hi - q_lo, POSITIONS)
    return doc_end, q_hi, steps, tl.where(first_step < steps, first_step, 0)


@triton.jit
def window_dkv_kernel(
    Q, K, V, SWA_DO, SWA_LSE, SWA_DELTA, DK_ACC, DV_ACC, DK, DV, DOC_END,
    stride_qz, stride_qh, stride_qn, stride_qd,
    stride_kz, stride_kh, stride_kn, stride_kd,
    stride_vz, stride_vh, stride_vn, stride_vd,
    stride_sdoz, stride_sdoh, stride_sdon, stride_sdod,
    N, HQ, HKV, sm_scale,
    GQA_SHARED_HEADS: tl.constexpr, GQA_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
    D: tl.constexpr, D_PAD: tl.constexpr, CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr, QUERY_STEPS: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_DOCS: tl.constexpr,
):
    """dK, dV of the sliding window for BLOCK_N keys of one kv head, plus the selection's
    float32 accumulators, written in the input dtype. A step takes BLOCK_M query rows:
    BLOCK_M // GQA_PAD consecutive positions of all the kv head's query heads. HAS_DOCS:
    DOC_END [Z, N]."""
    POSITIONS: tl.constexpr = BLOCK_M // GQA_PAD
    key_start = tl.program_id(0) * BLOCK_N
    kv_head = tl.program_id(1)
    z = tl.program_id(2)
    pos = key_start + tl.arange(0, BLOCK_N)
    key_ok = pos < N
    rows = tl.arange(0, BLOCK_M)
    head = kv_head * GQA_SHARED_HEADS + rows % GQA_PAD
    head_ok = rows % GQA_PAD < GQA_SHARED_HEADS
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < D
    k = load_tile(K, strided_rows(z, kv_head, pos, stride_kz, stride_kh, stride_kn), key_ok, offs_d, d_ok, stride_kd)
    v = load_tile(V, strided_rows(z, kv_head, pos, stride_vz, stride_vh, stride_vn), key_ok, offs_d, d_ok, stride_vd)
    scale2 = sm_scale * LOG2E

    # Queries that see at least one of these keys: i - j in [0, WINDOW] (causal) or |i - j| <= WINDOW.
    if CAUSAL:
        q_lo = key_start
    else:
        q_lo = tl.maximum(key_start - WINDOW, 0)
    q_hi = tl.minimum(key_start + BLOCK_N + WINDOW, N)
    # Start at the multiple of the span in [q_lo, q_lo + span) and wrap around: the
    # programs of neighbouring key tiles then read each query row together, while L2 holds it.
    span: tl.constexpr = QUERY_STEPS * POSITIONS
    first_step = (span - q_lo % span) % span // POSITIONS
    steps = QUERY_STEPS
    if HAS_DOCS:
        doc_end, q_hi, steps, first_step = _document_query_steps(DOC_END, z, pos, key_ok, N, q_lo, q_hi,
                                                                 first_step, POSITIONS)
    dk = tl.zeros([BLOCK_N, D_PAD], tl.float32)
    dv = tl.zeros([BLOCK_N, D_PAD], tl.float32)
    for t in range(0, steps):
        if HAS_DOCS:
            step = t + first_step
            step = tl.where(step >= steps, step - steps, step)
        else:
            step = (t + first_step) % QUERY_STEPS
        q_pos = q_lo + step * POSITIONS + rows // GQA_PAD
        q_ok = head_ok & (q_pos < q_hi)
        q_rows = strided_rows(z, head, q_pos, stride_qz, stride_qh, stride_qn)
        do_rows = strided_rows(z, head, q_pos, stride_sdoz, stride_sdoh, stride_sdon)
        q = load_tile(Q, q_rows, q_ok, offs_d, d_ok, stride_qd)
        do = load_tile(SWA_DO, do_rows, q_ok, offs_d, d_ok, stride_sdod)
        lse_rows = (z.to(tl.int64) * HQ + head) * N + q_pos
        lse2 = load_lse2(SWA_LSE, lse_rows, q_ok)
        delta = tl.load(SWA_DELTA + lse_rows, mask=q_ok, other=0.0)
        visible = _in_band(q_pos[None, :] - pos[:, None], WINDOW, CAUSAL) & key_ok[:, None] & q_ok[None, :]
        if HAS_DOCS:
            visible &= q_pos[None, :] < doc_end[:, None]
        dk, dv = dkv_tile(k, v, q, do, lse2, delta, visible, scale2, 1.0, dk, dv, DOT_PRECISION)
    acc_rows = dense_rows(z, kv_head, pos, HKV, N, D)
    dk = dk * sm_scale + load_tile(DK_ACC, acc_rows, key_ok, offs_d, d_ok, 1)
    dv = dv + load_tile(DV_ACC, acc_rows, key_ok, offs_d, d_ok, 1)
    mask = key_ok[:, None] & d_ok[None, :]
    tl.store(DK + acc_rows[:, None] + offs_d[None, :], dk.to(DK.dtype.element_ty), mask=mask)
    tl.store(DV + acc_rows[:, None] + offs_d[None, :], dv.to(DV.dtype.element_ty), mask=mask)
