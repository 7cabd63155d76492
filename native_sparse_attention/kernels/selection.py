"""Triton kernels for NSA's selection branch, with the sliding-window branch fused in.

Notation (in the style of PyTorch's FlexAttention templates)
-----------------------------------------------------------
Q: query, K: key, V: value, O: output, DO: gradient of O, LSE: natural-log log-sum-exp
Z: batch size, HQ: query heads, HKV: kv heads, HS: selection heads (HKV or HQ)
N: sequence length (queries and keys alike), D: head dim
D_PAD: D rounded up to a power of two (at least 16); the padded columns are masked
GQA_SHARED_HEADS: query heads per kv head (HQ // HKV)
SEL_SHARED_HEADS: query heads that share one selection row (HQ // HS, so GQA_SHARED_HEADS
    when the selection is per kv head, 1 when it is per query head)
ROWS: rows of a program's query tile: SEL_SHARED_HEADS padded up to 16, the smallest M
    of tl.dot; the padded rows load zeros and are never stored
SEL: selection slots per query; SEL_PAD: SEL rounded up to a power of two
BLOCK_SIZE: tokens per selection block; FINE_N: keys per fine block, a multiple of 16
    dividing BLOCK_SIZE; TILES_PER_BLOCK: BLOCK_SIZE // FINE_N
WINDOW: the sliding window w; CAUSAL: include_block_causal (also makes the window causal)

Work decomposition
------------------
Forward and main backward: one program per (query position i, batch z, selection head).
Its ROWS rows are the query heads that read the same kv head and the same selected blocks
at position i, so each key tile is loaded once for the whole group. Every coarse block
(the query's own block first, then each slot) is walked as TILES_PER_BLOCK fine blocks:
any multiple of 16 works as BLOCK_SIZE, and the own block stops at the tile holding i.

- ``_fwd_kernel``: online softmax over the selected tiles, then (SLIDING) over the
  window's tiles with a second accumulator, so both outputs come from one launch.
- ``_bwd_kernel``: recomputes P per tile; dQ stays in registers (the program owns all of
  its query's keys), dsel_scale is reduced per slot, and dK / dV of each tile go to
  float32 buffers by atomic adds: a key block is selected by arbitrary queries, so no
  program owns it. The rows of a tile are summed by the dot before the atomic, so a group
  of G heads costs one atomic per key element, not G. With SLIDING it also adds the
  window's dQ and writes delta = rowsum(dO * O) of the window for the kernel below.
- ``_sliding_dkv_kernel``: one program per (key tile, batch z, kv head); the window is a
  band, so the queries that see a key tile are known and dK / dV of the window are
  accumulated in registers without atomics. It also adds the selection's float32
  accumulators and writes dK and dV in the input dtype.

Logits are computed in base 2: ``exp2(q.k * scale * sel * log2(e) - lse * log2(e))``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

__all__ = ["LaunchConfig", "default_launch_config", "selection_attention"]

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
MIN_ROWS = 16  # tl.dot needs M, N and K of at least 16



# ----------------------------------------------------------------------------- helpers


@triton.jit
def _program_rows(SEL_SHARED_HEADS: tl.constexpr, GQA_SHARED_HEADS: tl.constexpr, ROWS: tl.constexpr):
    """Query position, batch, selection head, kv head and query heads of this program."""
    i = tl.program_id(0)
    sel_head = tl.program_id(1)
    z = tl.program_id(2)
    first_head = sel_head * SEL_SHARED_HEADS
    kv_head = first_head // GQA_SHARED_HEADS
    rows = tl.arange(0, ROWS)
    return i, z, sel_head, kv_head, first_head + rows, rows < SEL_SHARED_HEADS


@triton.jit
def _head_offset(z, h, stride_z, stride_h):
    """int64 offset of head ``[z, h]`` of a strided tensor."""
    return z.to(tl.int64) * stride_z + h.to(tl.int64) * stride_h


@triton.jit
def _strided_rows(z, h, i, stride_z, stride_h, stride_n):
    """int64 offsets of rows ``[z, h, i]`` (h or i may be a vector) of a strided tensor."""
    return _head_offset(z, h, stride_z, stride_h) + i.to(tl.int64) * stride_n


@triton.jit
def _dense_rows(z, h, i, H, N, D):
    """int64 offsets of rows ``[z, h, i]`` of a contiguous [Z, H, N, D] tensor."""
    return ((z.to(tl.int64) * H + h) * N + i) * D


@triton.jit
def _load_tile(base, row_offsets, row_ok, offs_d, d_ok, stride_d):
    """Rows ``base[row_offsets + d]`` as a [len(row_offsets), D_PAD] tile, zeros where masked."""
    ptrs = base + row_offsets[:, None] + offs_d[None, :] * stride_d
    return tl.load(ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)


@triton.jit
def _slot(SEL_IDX, SEL_MASK, SEL_SCALE, sel_row, slot, HAS_SEL_SCALE: tl.constexpr):
    """Index of the slot's block, whether the slot is on, and its logit multiplier."""
    block = tl.load(SEL_IDX + sel_row + slot).to(tl.int64)
    on = (tl.load(SEL_MASK + sel_row + slot) != 0) & (block >= 0)
    if HAS_SEL_SCALE:
        multiplier = tl.load(SEL_SCALE + sel_row + slot).to(tl.float32)
    else:
        multiplier = 1.0
    return block, on, multiplier


@triton.jit
def _window_bounds(i, N, WINDOW: tl.constexpr, CAUSAL: tl.constexpr, FINE_N: tl.constexpr):
    """Keys ``[lo, hi)`` of query i's sliding window and the FINE_N-aligned start of its first tile."""
    lo = tl.maximum(i - WINDOW, 0)
    if CAUSAL:
        hi = i + 1
    else:
        hi = tl.minimum(i + WINDOW + 1, N)
    return lo, hi, (lo // FINE_N) * FINE_N


@triton.jit
def _softmax_tile(
    q, k_cols, v_cols, pos, key_ok, kv_mask, stride_kn, stride_vn, logit_scale, m_i, l_i, acc,
    DOT_PRECISION: tl.constexpr,
):
    """One online-softmax step of a [ROWS, D_PAD] query tile over the keys at ``pos``.

    ``k_cols``, ``v_cols``: [1, D_PAD] pointers to the head's first key / value row;
    ``kv_mask``: [FINE_N, D_PAD]; ``logit_scale`` turns q.k into base-2 logits.
    """
    rows = pos.to(tl.int64)[:, None]
    k = tl.load(k_cols + rows * stride_kn, mask=kv_mask, other=0.0)
    v = tl.load(v_cols + rows * stride_vn, mask=kv_mask, other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * logit_scale
    s = tl.where(key_ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row that has seen no key yet keeps m = -inf: shift it by 0 so exp2 gives 0, not NaN.
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_shift[:, None])
    alpha = tl.exp2(m_i - m_shift)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _store_attention(O, LSE, acc, m_i, l_i, out_rows, lse_rows, row_ok, offs_d, d_ok):
    """Normalise and store the outputs and natural-log LSE; a row without keys gets 0 and -inf."""
    has_key = l_i > 0.0
    l_safe = tl.where(has_key, l_i, 1.0)
    lse = tl.where(has_key, (m_i + tl.log2(l_safe)) * LN2, float("-inf"))
    out = acc / l_safe[:, None]
    tl.store(O + out_rows[:, None] + offs_d[None, :], out.to(O.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    tl.store(LSE + lse_rows, lse, mask=row_ok)


@triton.jit
def _load_lse2(LSE, offsets, ok):
    """LSE in base 2, +inf where there is no key (or no row), so that every P there is 0."""
    lse2 = tl.load(LSE + offsets, mask=ok, other=float("-inf")) * LOG2E
    return tl.where(lse2 == float("-inf"), float("inf"), lse2)


# ----------------------------------------------------------------------------- forward


@triton.jit
def _fwd_kernel(
    Q, K, V, SEL_IDX, SEL_MASK, SEL_SCALE, O, LSE, SWA_O, SWA_LSE,
    stride_qz, stride_qh, stride_qn, stride_qd,
    stride_kz, stride_kh, stride_kn, stride_kd,
    stride_vz, stride_vh, stride_vn, stride_vd,
    N, HQ, HS, sm_scale,
    SEL: tl.constexpr, BLOCK_SIZE: tl.constexpr, FINE_N: tl.constexpr,
    SEL_SHARED_HEADS: tl.constexpr, GQA_SHARED_HEADS: tl.constexpr, ROWS: tl.constexpr,
    D: tl.constexpr, D_PAD: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_SEL_SCALE: tl.constexpr,
    SLIDING: tl.constexpr, WINDOW: tl.constexpr, WINDOW_TILES: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    TILES_PER_BLOCK: tl.constexpr = BLOCK_SIZE // FINE_N
    i, z, sel_head, kv_head, heads, row_ok = _program_rows(SEL_SHARED_HEADS, GQA_SHARED_HEADS, ROWS)
    offs_n = tl.arange(0, FINE_N)
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < D
    q = _load_tile(Q, _strided_rows(z, heads, i, stride_qz, stride_qh, stride_qn), row_ok, offs_d, d_ok, stride_qd)
    k_cols = K + _head_offset(z, kv_head, stride_kz, stride_kh) + offs_d[None, :] * stride_kd
    v_cols = V + _head_offset(z, kv_head, stride_vz, stride_vh) + offs_d[None, :] * stride_vd
    sel_row = ((z.to(tl.int64) * HS + sel_head) * N + i) * SEL
    scale2 = sm_scale * LOG2E

    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, D_PAD], tl.float32)
    key_end = N
    if CAUSAL:
        key_end = i + 1
        own_start = (i // BLOCK_SIZE) * BLOCK_SIZE
        for t in range(0, TILES_PER_BLOCK):
            pos = own_start + t * FINE_N + offs_n
            key_ok = pos < key_end
            m_i, l_i, acc = _softmax_tile(
                q, k_cols, v_cols, pos, key_ok, key_ok[:, None] & d_ok[None, :], stride_kn, stride_vn,
                scale2, m_i, l_i, acc, DOT_PRECISION,
            )
    for t in range(0, SEL * TILES_PER_BLOCK):
        block, on, multiplier = _slot(SEL_IDX, SEL_MASK, SEL_SCALE, sel_row, t // TILES_PER_BLOCK, HAS_SEL_SCALE)
        pos = block * BLOCK_SIZE + (t % TILES_PER_BLOCK) * FINE_N + offs_n
        key_ok = on & (pos < key_end)
        m_i, l_i, acc = _softmax_tile(
            q, k_cols, v_cols, pos, key_ok, key_ok[:, None] & d_ok[None, :], stride_kn, stride_vn,
            scale2 * multiplier, m_i, l_i, acc, DOT_PRECISION,
        )
    out_rows = _dense_rows(z, heads, i, HQ, N, D)
    lse_rows = (z.to(tl.int64) * HQ + heads) * N + i
    _store_attention(O, LSE, acc, m_i, l_i, out_rows, lse_rows, row_ok, offs_d, d_ok)

    if SLIDING:
        lo, hi, first = _window_bounds(i, N, WINDOW, CAUSAL, FINE_N)
        m_i = tl.full([ROWS], float("-inf"), tl.float32)
        l_i = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, D_PAD], tl.float32)
        for t in range(0, WINDOW_TILES):
            pos = first + t * FINE_N + offs_n
            key_ok = (pos >= lo) & (pos < hi)
            m_i, l_i, acc = _softmax_tile(
                q, k_cols, v_cols, pos, key_ok, key_ok[:, None] & d_ok[None, :], stride_kn, stride_vn,
                scale2, m_i, l_i, acc, DOT_PRECISION,
            )
        _store_attention(SWA_O, SWA_LSE, acc, m_i, l_i, out_rows, lse_rows, row_ok, offs_d, d_ok)


# ----------------------------------------------------------------------------- backward


@triton.jit
def _bwd_tile(
    q, do, lse2, delta, k_cols, v_cols, dk_cols, dv_cols, pos, key_ok, kv_mask, stride_kn, stride_vn,
    logit_scale, ds_scale, dq,
    D: tl.constexpr, ACCUMULATE_KV: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Gradients of a [ROWS, D_PAD] query tile through the keys at ``pos``.

    ``k_cols``, ``v_cols``: [1, D_PAD] pointers to the head's first key / value row;
    ``dk_cols``, ``dv_cols``: the same in the float32 [Z, HKV, N, D] accumulators, which
    get this tile's dK = dS^T Q and dV = P^T dO (summed over the rows by the dots) when
    ACCUMULATE_KV. ``logit_scale`` turns q.k into base-2 logits, ``ds_scale`` is
    d(logit)/d(q.k). Returns the updated dQ accumulator and sum(dL/dlogit * q.k), this
    tile's dL/d(multiplier) up to the factor sm_scale.
    """
    rows = pos.to(tl.int64)[:, None]
    k = tl.load(k_cols + rows * stride_kn, mask=kv_mask, other=0.0)
    v = tl.load(v_cols + rows * stride_vn, mask=kv_mask, other=0.0)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    p = tl.where(key_ok[None, :], tl.exp2(qk * logit_scale - lse2[:, None]), 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
    dlogit = p * (dp - delta[:, None])
    ds = (dlogit * ds_scale).to(k.dtype)
    dq += tl.dot(ds, k, input_precision=DOT_PRECISION)
    if ACCUMULATE_KV:
        dk = tl.dot(tl.trans(ds), q, input_precision=DOT_PRECISION)
        dv = tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=DOT_PRECISION)
        tl.atomic_add(dk_cols + rows * D, dk, mask=kv_mask, sem="relaxed")
        tl.atomic_add(dv_cols + rows * D, dv, mask=kv_mask, sem="relaxed")
    return dq, tl.sum(tl.sum(dlogit * qk, 1), 0)


@triton.jit
def _bwd_kernel(
    Q, K, V, O, DO, LSE, SEL_IDX, SEL_MASK, SEL_SCALE, DQ, DSEL, DK_ACC, DV_ACC,
    SWA_O, SWA_DO, SWA_LSE, SWA_DELTA,
    stride_qz, stride_qh, stride_qn, stride_qd,
    stride_kz, stride_kh, stride_kn, stride_kd,
    stride_vz, stride_vh, stride_vn, stride_vd,
    stride_doz, stride_doh, stride_don, stride_dod,
    stride_sdoz, stride_sdoh, stride_sdon, stride_sdod,
    N, HQ, HKV, HS, sm_scale,
    SEL: tl.constexpr, SEL_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, FINE_N: tl.constexpr,
    SEL_SHARED_HEADS: tl.constexpr, GQA_SHARED_HEADS: tl.constexpr, ROWS: tl.constexpr,
    D: tl.constexpr, D_PAD: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_SEL_SCALE: tl.constexpr,
    SLIDING: tl.constexpr, WINDOW: tl.constexpr, WINDOW_TILES: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    TILES_PER_BLOCK: tl.constexpr = BLOCK_SIZE // FINE_N
    i, z, sel_head, kv_head, heads, row_ok = _program_rows(SEL_SHARED_HEADS, GQA_SHARED_HEADS, ROWS)
    offs_n = tl.arange(0, FINE_N)
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < D
    out_rows = _dense_rows(z, heads, i, HQ, N, D)
    lse_rows = (z.to(tl.int64) * HQ + heads) * N + i
    q = _load_tile(Q, _strided_rows(z, heads, i, stride_qz, stride_qh, stride_qn), row_ok, offs_d, d_ok, stride_qd)
    do = _load_tile(DO, _strided_rows(z, heads, i, stride_doz, stride_doh, stride_don), row_ok, offs_d, d_ok, stride_dod)
    o = _load_tile(O, out_rows, row_ok, offs_d, d_ok, 1)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    lse2 = _load_lse2(LSE, lse_rows, row_ok)
    k_cols = K + _head_offset(z, kv_head, stride_kz, stride_kh) + offs_d[None, :] * stride_kd
    v_cols = V + _head_offset(z, kv_head, stride_vz, stride_vh) + offs_d[None, :] * stride_vd
    acc_cols = _dense_rows(z, kv_head, 0, HKV, N, D) + offs_d[None, :]
    dk_cols = DK_ACC + acc_cols
    dv_cols = DV_ACC + acc_cols
    sel_row = ((z.to(tl.int64) * HS + sel_head) * N + i) * SEL
    scale2 = sm_scale * LOG2E

    dq = tl.zeros([ROWS, D_PAD], tl.float32)
    key_end = N
    if CAUSAL:
        key_end = i + 1
        own_start = (i // BLOCK_SIZE) * BLOCK_SIZE
        for t in range(0, TILES_PER_BLOCK):
            pos = own_start + t * FINE_N + offs_n
            key_ok = pos < key_end
            dq, _ = _bwd_tile(
                q, do, lse2, delta, k_cols, v_cols, dk_cols, dv_cols, pos, key_ok, key_ok[:, None] & d_ok[None, :],
                stride_kn, stride_vn, scale2, sm_scale, dq, D, True, DOT_PRECISION,
            )
    slots = tl.arange(0, SEL_PAD)
    dsel = tl.zeros([SEL_PAD], tl.float32)
    for t in range(0, SEL * TILES_PER_BLOCK):
        slot = t // TILES_PER_BLOCK
        block, on, multiplier = _slot(SEL_IDX, SEL_MASK, SEL_SCALE, sel_row, slot, HAS_SEL_SCALE)
        pos = block * BLOCK_SIZE + (t % TILES_PER_BLOCK) * FINE_N + offs_n
        key_ok = on & (pos < key_end)
        dq, dmult = _bwd_tile(
            q, do, lse2, delta, k_cols, v_cols, dk_cols, dv_cols, pos, key_ok, key_ok[:, None] & d_ok[None, :],
            stride_kn, stride_vn, scale2 * multiplier, sm_scale * multiplier, dq, D, True, DOT_PRECISION,
        )
        dsel += tl.where(slots == slot, dmult, 0.0)
    if HAS_SEL_SCALE:
        tl.store(DSEL + sel_row + slots, dsel * sm_scale, mask=slots < SEL)

    if SLIDING:
        # The window's dK / dV come from _sliding_dkv_kernel; here only its dQ and delta.
        swa_do = _load_tile(
            SWA_DO, _strided_rows(z, heads, i, stride_sdoz, stride_sdoh, stride_sdon), row_ok, offs_d, d_ok, stride_sdod
        )
        swa_o = _load_tile(SWA_O, out_rows, row_ok, offs_d, d_ok, 1)
        swa_delta = tl.sum(swa_o.to(tl.float32) * swa_do.to(tl.float32), 1)
        tl.store(SWA_DELTA + lse_rows, swa_delta, mask=row_ok)
        swa_lse2 = _load_lse2(SWA_LSE, lse_rows, row_ok)
        lo, hi, first = _window_bounds(i, N, WINDOW, CAUSAL, FINE_N)
        for t in range(0, WINDOW_TILES):
            pos = first + t * FINE_N + offs_n
            key_ok = (pos >= lo) & (pos < hi)
            dq, _ = _bwd_tile(
                q, swa_do, swa_lse2, swa_delta, k_cols, v_cols, dk_cols, dv_cols, pos, key_ok,
                key_ok[:, None] & d_ok[None, :], stride_kn, stride_vn, scale2, sm_scale, dq, D, False, DOT_PRECISION,
            )
    tl.store(DQ + out_rows[:, None] + offs_d[None, :], dq.to(DQ.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _sliding_dkv_kernel(
    Q, K, V, SWA_DO, SWA_LSE, SWA_DELTA, DK_ACC, DV_ACC, DK, DV,
    stride_qz, stride_qh, stride_qn, stride_qd,
    stride_kz, stride_kh, stride_kn, stride_kd,
    stride_vz, stride_vh, stride_vn, stride_vd,
    stride_sdoz, stride_sdoh, stride_sdon, stride_sdod,
    N, HQ, HKV, sm_scale,
    GQA_SHARED_HEADS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
    D: tl.constexpr, D_PAD: tl.constexpr, CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr, QUERY_TILES: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """dK, dV of the sliding window for BLOCK_N keys of one kv head, plus the selection's
    float32 accumulators, written in the input dtype."""
    key_start = tl.program_id(0) * BLOCK_N
    kv_head = tl.program_id(1)
    z = tl.program_id(2)
    pos = key_start + tl.arange(0, BLOCK_N)
    key_ok = pos < N
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < D
    k = _load_tile(K, _strided_rows(z, kv_head, pos, stride_kz, stride_kh, stride_kn), key_ok, offs_d, d_ok, stride_kd)
    v = _load_tile(V, _strided_rows(z, kv_head, pos, stride_vz, stride_vh, stride_vn), key_ok, offs_d, d_ok, stride_vd)
    scale2 = sm_scale * LOG2E

    # Queries that see at least one of these keys: i - j in [0, WINDOW] (causal) or |i - j| <= WINDOW.
    if CAUSAL:
        q_lo = key_start
    else:
        q_lo = tl.maximum(key_start - WINDOW, 0)
    q_hi = tl.minimum(key_start + BLOCK_N + WINDOW, N)
    first = (q_lo // BLOCK_M) * BLOCK_M
    dk = tl.zeros([BLOCK_N, D_PAD], tl.float32)
    dv = tl.zeros([BLOCK_N, D_PAD], tl.float32)
    for g in range(0, GQA_SHARED_HEADS):
        head = kv_head * GQA_SHARED_HEADS + g
        for t in range(0, QUERY_TILES):
            q_pos = first + t * BLOCK_M + offs_m
            q_ok = q_pos < q_hi
            q = _load_tile(Q, _strided_rows(z, head, q_pos, stride_qz, stride_qh, stride_qn), q_ok, offs_d, d_ok, stride_qd)
            do = _load_tile(
                SWA_DO, _strided_rows(z, head, q_pos, stride_sdoz, stride_sdoh, stride_sdon), q_ok, offs_d, d_ok, stride_sdod
            )
            lse_rows = (z.to(tl.int64) * HQ + head) * N + q_pos
            lse2 = _load_lse2(SWA_LSE, lse_rows, q_ok)
            delta = tl.load(SWA_DELTA + lse_rows, mask=q_ok, other=0.0)
            distance = q_pos[None, :] - pos[:, None]
            if CAUSAL:
                in_window = (distance >= 0) & (distance <= WINDOW)
            else:
                in_window = (distance >= -WINDOW) & (distance <= WINDOW)
            qk_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)
            p_t = tl.where(in_window & key_ok[:, None] & q_ok[None, :], tl.exp2(qk_t * scale2 - lse2[None, :]), 0.0)
            dv += tl.dot(p_t.to(do.dtype), do, input_precision=DOT_PRECISION)
            dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
            ds_t = p_t * (dp_t - delta[None, :])
            dk += tl.dot(ds_t.to(q.dtype), q, input_precision=DOT_PRECISION)
    acc_rows = _dense_rows(z, kv_head, pos, HKV, N, D)
    dk = dk * sm_scale + _load_tile(DK_ACC, acc_rows, key_ok, offs_d, d_ok, 1)
    dv = dv + _load_tile(DV_ACC, acc_rows, key_ok, offs_d, d_ok, 1)
    mask = key_ok[:, None] & d_ok[None, :]
    tl.store(DK + acc_rows[:, None] + offs_d[None, :], dk.to(DK.dtype.element_ty), mask=mask)
    tl.store(DV + acc_rows[:, None] + offs_d[None, :], dv.to(DV.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------- launch


@dataclass(frozen=True)
class LaunchConfig:
    """Tile sizes and launch parameters of the three kernels.

    ``fine_n`` is an upper bound: the kernels use the largest multiple of 16 that divides
    ``block_size`` by halving it, so every block size that is a multiple of 16 works.
    """

    fine_n: int = 64
    fwd_warps: int = 4
    fwd_stages: int = 3
    bwd_warps: int = 4
    bwd_stages: int = 2
    dkv_block_n: int = 64
    dkv_block_m: int = 64
    dkv_warps: int = 4
    dkv_stages: int = 2


def default_launch_config(block_size: int, head_dim: int, dtype: torch.dtype) -> LaunchConfig:
    """The configuration measured fastest on an H100 for this shape (see docs/kernel_notes.md)."""
    return LaunchConfig()


def _fine_block(block_size: int, preferred: int) -> int:
    fine = preferred
    while block_size % fine:
        fine //= 2
    return fine


def _padded_head_dim(d: int) -> int:
    return max(MIN_ROWS, triton.next_power_of_2(d))


def _empty(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Allocation of every kernel output; tests replace it to fill outputs with NaN first."""
    return torch.empty(shape, dtype=dtype, device=device)


def _strides(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.stride())


@dataclass(frozen=True)
class _Problem:
    """Shapes and options shared by the forward and backward launches."""

    batch: int
    query_heads: int
    kv_heads: int
    selection_heads: int
    seq_len: int
    head_dim: int
    num_slots: int
    block_size: int
    causal: bool
    window: int | None
    scale: float
    has_sel_scale: bool
    config: LaunchConfig

    @property
    def constexprs(self) -> dict:
        return dict(
            SEL=self.num_slots,
            BLOCK_SIZE=self.block_size,
            FINE_N=self.fine_n,
            SEL_SHARED_HEADS=self.query_heads // self.selection_heads,
            GQA_SHARED_HEADS=self.query_heads // self.kv_heads,
            ROWS=MIN_ROWS,
            D=self.head_dim,
            D_PAD=_padded_head_dim(self.head_dim),
            CAUSAL=self.causal,
            HAS_SEL_SCALE=self.has_sel_scale,
        )

    @property
    def fine_n(self) -> int:
        return _fine_block(self.block_size, self.config.fine_n)

    def window_constexprs(self, sliding: bool) -> dict:
        """The window and how many FINE_N tiles cover it from an aligned start.

        A window of keys [lo, hi) starts its first tile at most FINE_N - 1 keys before lo.
        """
        if not sliding:
            return dict(SLIDING=False, WINDOW=0, WINDOW_TILES=0)
        span = (self.window + 1) if self.causal else (2 * self.window + 1)
        return dict(SLIDING=True, WINDOW=self.window, WINDOW_TILES=triton.cdiv(span + self.fine_n - 1, self.fine_n))

    @property
    def sliding_query_tiles(self) -> int:
        """Query tiles of _sliding_dkv_kernel that cover every query seeing a key tile."""
        block_n, block_m = self.config.dkv_block_n, self.config.dkv_block_m
        span = block_n + self.window if self.causal else block_n + 2 * self.window
        # Causal spans start at the key tile, which is block_m-aligned when block_m divides block_n.
        slack = 0 if self.causal and block_n % block_m == 0 else block_m - 1
        return triton.cdiv(span + slack, block_m)

    @property
    def grid(self) -> tuple[int, int, int]:
        return (self.seq_len, self.selection_heads, self.batch)


def _dot_precision(dtype: torch.dtype) -> str:
    # float32 inputs get exact float32 products rather than TF32's 10-bit mantissa.
    return "ieee" if dtype == torch.float32 else "tf32"


def _selection_operands(indices, fmask, sel_scale, fallback: torch.Tensor):
    """Contiguous selection tensors; an empty selection is replaced by a valid dummy pointer
    (the kernels never read it)."""
    if indices.numel() == 0:
        return fallback, fallback, fallback
    sel_scale = indices if sel_scale is None else sel_scale.contiguous()
    return indices.contiguous(), fmask.contiguous().view(torch.uint8), sel_scale


def _forward(problem: _Problem, q, k, v, indices, fmask, sel_scale):
    b, hq, n, d = problem.batch, problem.query_heads, problem.seq_len, problem.head_dim
    out = _empty((b, hq, n, d), q.dtype, q.device)
    lse = _empty((b, hq, n), torch.float32, q.device)
    sliding = problem.window is not None
    swa_out = _empty((b, hq, n, d), q.dtype, q.device) if sliding else out
    swa_lse = _empty((b, hq, n), torch.float32, q.device) if sliding else lse
    sel_idx, sel_mask, sel_scale = _selection_operands(indices, fmask, sel_scale, lse)
    _fwd_kernel[problem.grid](
        q, k, v, sel_idx, sel_mask, sel_scale, out, lse, swa_out, swa_lse,
        *_strides(q), *_strides(k), *_strides(v),
        n, hq, problem.selection_heads, problem.scale,
        **problem.constexprs,
        **problem.window_constexprs(sliding),
        DOT_PRECISION=_dot_precision(q.dtype),
        num_warps=problem.config.fwd_warps,
        num_stages=problem.config.fwd_stages,
    )
    return out, lse, (swa_out if sliding else None), (swa_lse if sliding else None)


def _backward(problem: _Problem, saved, d_out, d_swa_out):
    q, k, v, indices, fmask, sel_scale, out, lse, swa_out, swa_lse = saved
    b, hq, hk, n, d = problem.batch, problem.query_heads, problem.kv_heads, problem.seq_len, problem.head_dim
    config = problem.config
    sliding = problem.window is not None and d_swa_out is not None
    if d_out is None:
        d_out = torch.zeros_like(out)
    dq = _empty((b, hq, n, d), q.dtype, q.device)
    dsel = _empty(indices.shape, torch.float32, q.device) if problem.has_sel_scale else None
    dk_acc = torch.zeros((b, hk, n, d), dtype=torch.float32, device=q.device)
    dv_acc = torch.zeros_like(dk_acc)
    swa_delta = _empty((b, hq, n), torch.float32, q.device) if sliding else lse
    swa_out, swa_lse, d_swa_out = (swa_out, swa_lse, d_swa_out) if sliding else (out, lse, d_out)
    sel_idx, sel_mask, sel_scale_arg = _selection_operands(indices, fmask, sel_scale, lse)
    _bwd_kernel[problem.grid](
        q, k, v, out, d_out, lse, sel_idx, sel_mask, sel_scale_arg, dq,
        dsel if dsel is not None and dsel.numel() else lse, dk_acc, dv_acc,
        swa_out, d_swa_out, swa_lse, swa_delta,
        *_strides(q), *_strides(k), *_strides(v), *_strides(d_out), *_strides(d_swa_out),
        n, hq, hk, problem.selection_heads, problem.scale,
        **problem.constexprs,
        **problem.window_constexprs(sliding),
        SEL_PAD=triton.next_power_of_2(max(problem.num_slots, 1)),
        DOT_PRECISION=_dot_precision(q.dtype),
        num_warps=config.bwd_warps,
        num_stages=config.bwd_stages,
    )
    if sliding:
        dk = _empty((b, hk, n, d), k.dtype, k.device)
        dv = _empty((b, hk, n, d), v.dtype, v.device)
        grid = (triton.cdiv(n, config.dkv_block_n), hk, b)
        _sliding_dkv_kernel[grid](
            q, k, v, d_swa_out, swa_lse, swa_delta, dk_acc, dv_acc, dk, dv,
            *_strides(q), *_strides(k), *_strides(v), *_strides(d_swa_out),
            n, hq, hk, problem.scale,
            GQA_SHARED_HEADS=hq // hk,
            BLOCK_N=config.dkv_block_n,
            BLOCK_M=config.dkv_block_m,
            D=d,
            D_PAD=_padded_head_dim(d),
            CAUSAL=problem.causal,
            WINDOW=problem.window,
            QUERY_TILES=problem.sliding_query_tiles,
            DOT_PRECISION=_dot_precision(q.dtype),
            num_warps=config.dkv_warps,
            num_stages=config.dkv_stages,
        )
    else:
        dk, dv = dk_acc.to(k.dtype), dv_acc.to(v.dtype)
    if dsel is not None:
        dsel = dsel.to(sel_scale.dtype)
    return dq, dk, dv, dsel


class _SelectionAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sel_scale, indices, fmask, problem: _Problem):
        out, lse, swa_out, swa_lse = _forward(problem, q, k, v, indices, fmask, sel_scale)
        ctx.problem = problem
        ctx.save_for_backward(q, k, v, indices, fmask, sel_scale, out, lse, swa_out, swa_lse)
        ctx.mark_non_differentiable(lse)
        return out, swa_out, lse

    @staticmethod
    def backward(ctx, d_out, d_swa_out, _d_lse):
        dq, dk, dv, dsel = _backward(ctx.problem, ctx.saved_tensors, d_out, d_swa_out)
        return dq, dk, dv, dsel, None, None, None


def selection_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_size: int,
    selected_block_indices: torch.Tensor,
    fmask: torch.Tensor,
    sel_scale: torch.Tensor | None,
    include_block_causal: bool,
    sliding_window_size: int | None,
    scale: float,
    config: LaunchConfig | None = None,
):
    """Selected attention (and, when ``sliding_window_size`` is given, sliding-window
    attention) on the Triton kernels; differentiable in q, k, v and sel_scale.

    Expects inputs already validated by ``native_sparse_attend``.
    q: [b, hq, n, d], k, v: [b, hk, n, d]; selected_block_indices, fmask, sel_scale:
    [b, hs, n, sel] with hs in {hk, hq}.
    Returns (out [b, hq, n, d], sliding_out [b, hq, n, d] or None, lse [b, hq, n] float32).
    """
    b, hq, n, d = q.shape
    if config is None:
        config = default_launch_config(block_size, d, q.dtype)
    problem = _Problem(
        batch=b,
        query_heads=hq,
        kv_heads=k.shape[1],
        selection_heads=selected_block_indices.shape[1],
        seq_len=n,
        head_dim=d,
        num_slots=selected_block_indices.shape[-1],
        block_size=block_size,
        causal=include_block_causal,
        window=sliding_window_size,
        scale=scale,
        has_sel_scale=sel_scale is not None,
        config=config,
    )
    return _SelectionAttention.apply(q, k, v, sel_scale, selected_block_indices, fmask, problem)
