"""Tile steps of flash-style attention shared by the selection kernels
(``kernels/selection.py``) and the sliding-window kernels (``kernels/sliding_window.py``):
row addressing, the online-softmax step of the forward, and the dQ and dK / dV steps of
the backward.

A query tile is any set of rows ``[z, head, position]`` addressed by int64 offsets, so the
same steps serve the selection's tiles (the heads of one group at one position) and the
window's (the heads of one group at neighbouring positions). Notation: as in
``kernels/selection.py``.

Logits are computed in base 2: ``exp2(q.k * scale * sel * log2(e) - lse * log2(e))``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from native_sparse_attention.kernels.library import head_offset

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def program_heads(SEL_SHARED_HEADS: tl.constexpr, GQA_SHARED_HEADS: tl.constexpr):
    """Batch, selection head, kv head and first query head of this program."""
    sel_head = tl.program_id(1)
    z = tl.program_id(2)
    first_head = sel_head * SEL_SHARED_HEADS
    return z, sel_head, first_head // GQA_SHARED_HEADS, first_head


@triton.jit
def strided_rows(z, h, i, stride_z, stride_h, stride_n):
    """int64 offsets of rows ``[z, h, i]`` (h or i may be a vector) of a strided tensor."""
    return head_offset(z, h, stride_z, stride_h) + i.to(tl.int64) * stride_n


@triton.jit
def dense_rows(z, h, i, H, N, D):
    """int64 offsets of rows ``[z, h, i]`` of a contiguous [Z, H, N, D] tensor."""
    return ((z.to(tl.int64) * H + h) * N + i) * D


@triton.jit
def load_tile(base, row_offsets, row_ok, offs_d, d_ok, stride_d):
    """Rows ``base[row_offsets + d]`` as a [len(row_offsets), D_PAD] tile, zeros where masked."""
    ptrs = base + row_offsets[:, None] + offs_d[None, :] * stride_d
    return tl.load(ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)


@triton.jit
def softmax_tile(q, k, v, visible, logit_scale, m_i, l_i, acc, DOT_PRECISION: tl.constexpr):
    """One online-softmax step of a [ROWS, D_PAD] query tile over a [KEYS, D_PAD] tile of
    keys ``k`` and values ``v``.

    ``visible``: [ROWS or 1, KEYS], or None where every key is visible to every row;
    ``logit_scale`` turns q.k into base-2 logits.
    """
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * logit_scale
    if visible is not None:
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row that has seen no key yet keeps m = -inf: shift it by 0 so exp2 gives 0, not NaN.
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_shift[:, None])
    alpha = tl.exp2(m_i - m_shift)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def store_attention(O, LSE, acc, m_i, l_i, out_rows, lse_rows, row_ok, offs_d, d_ok):
    """Normalise and store the outputs and natural-log LSE; a row without keys gets 0 and -inf.
    Returns the output tile as stored, in O's dtype."""
    has_key = l_i > 0.0
    l_safe = tl.where(has_key, l_i, 1.0)
    lse = tl.where(has_key, (m_i + tl.log2(l_safe)) * LN2, float("-inf"))
    out = (acc / l_safe[:, None]).to(O.dtype.element_ty)
    tl.store(O + out_rows[:, None] + offs_d[None, :], out, mask=row_ok[:, None] & d_ok[None, :])
    tl.store(LSE + lse_rows, lse, mask=row_ok)
    return out


@triton.jit
def load_lse2(LSE, offsets, ok):
    """LSE in base 2, +inf where there is no key (or no row), so that every P there is 0."""
    lse2 = tl.load(LSE + offsets, mask=ok, other=float("-inf")) * LOG2E
    return tl.where(lse2 == float("-inf"), float("inf"), lse2)


@triton.jit
def dq_tile(q, do, lse2, delta, k, v, visible, logit_scale, ds_scale, dq, DOT_PRECISION: tl.constexpr):
    """dQ of a [ROWS, D_PAD] query tile through a [KEYS, D_PAD] tile of keys ``k`` and
    values ``v``.

    ``visible``: [ROWS or 1, KEYS]; ``logit_scale`` turns q.k into base-2 logits,
    ``ds_scale`` is d(logit)/d(q.k), or 1.0 where it is the same for every tile and the
    caller scales the finished accumulator instead (a multiply per score fewer). Returns
    the updated dQ accumulator and sum(dL/dlogit * q.k), the tile's dL/d(multiplier) up
    to the factor sm_scale.
    """
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    p = tl.where(visible, tl.exp2(qk * logit_scale - lse2[:, None]), 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
    dlogit = p * (dp - delta[:, None])
    dq += tl.dot((dlogit * ds_scale).to(k.dtype), k, input_precision=DOT_PRECISION)
    return dq, tl.sum(tl.sum(dlogit * qk, 1), 0)


@triton.jit
def store_delta(DELTA, O, do, out_rows, lse_rows, row_ok, offs_d, d_ok):
    """delta = rowsum(dO * O) of the rows (the softmax backward's correction), stored for
    the key-side kernels and returned."""
    o = load_tile(O, out_rows, row_ok, offs_d, d_ok, 1)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + lse_rows, delta, mask=row_ok)
    return delta


@triton.jit
def backward_rows(
    Q, O, DO, LSE, DELTA, z, heads, i, row_ok,
    stride_qz, stride_qh, stride_qn, stride_qd,
    stride_doz, stride_doh, stride_don, stride_dod,
    N, HQ, D: tl.constexpr, D_PAD: tl.constexpr,
):
    """Query-side state of a backward program's rows ``[z, heads, i]``: q, dO, delta (also
    stored), base-2 LSE and the rows' offsets in the dense [Z, HQ, N, D] outputs."""
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < D
    out_rows = dense_rows(z, heads, i, HQ, N, D)
    lse_rows = (z.to(tl.int64) * HQ + heads) * N + i
    q = load_tile(Q, strided_rows(z, heads, i, stride_qz, stride_qh, stride_qn), row_ok, offs_d, d_ok, stride_qd)
    do = load_tile(DO, strided_rows(z, heads, i, stride_doz, stride_doh, stride_don), row_ok, offs_d, d_ok,
                   stride_dod)
    delta = store_delta(DELTA, O, do, out_rows, lse_rows, row_ok, offs_d, d_ok)
    lse2 = load_lse2(LSE, lse_rows, row_ok)
    return q, do, delta, lse2, out_rows


@triton.jit
def dkv_tile(k, v, q, do, lse2, delta, visible, logit_scale, ds_scale, dk, dv, DOT_PRECISION: tl.constexpr):
    """dK, dV of a [BLOCK_N, D_PAD] key tile through a [M, D_PAD] tile of query rows
    (``dkv_ds_tile`` without its dS)."""
    dk, dv, _ = dkv_ds_tile(k, v, q, do, lse2, delta, visible, logit_scale, ds_scale, dk, dv, DOT_PRECISION)
    return dk, dv


@triton.jit
def dkv_ds_tile(k, v, q, do, lse2, delta, visible, logit_scale, ds_scale, dk, dv, DOT_PRECISION: tl.constexpr):
    """dK, dV of a [BLOCK_N, D_PAD] key tile through a [M, D_PAD] tile of query rows, and
    the tile's transposed score gradient dS^T [BLOCK_N, M] (float32, times ``ds_scale``).

    ``visible``: [BLOCK_N, M]; ``lse2``, ``delta``, ``logit_scale``, ``ds_scale``: [M],
    per query row (the last two may be scalars). Works on the transposed scores
    [BLOCK_N, M], so that dK and dV come out of the dots as [BLOCK_N, D_PAD].
    """
    # Both score dots are issued before the exponentials, so that the tensor cores run
    # dP while the exponentials of P are computed: the pass is bound by issue latency,
    # not by the tensor cores (config A at 32k on an H100: 7.52 -> 7.16 ms).
    qk_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)
    dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
    p_t = tl.where(visible, tl.exp2(qk_t * logit_scale - lse2[None, :]), 0.0)
    dv += tl.dot(p_t.to(do.dtype), do, input_precision=DOT_PRECISION)
    ds_t = p_t * (dp_t - delta[None, :]) * ds_scale
    dk += tl.dot(ds_t.to(q.dtype), q, input_precision=DOT_PRECISION)
    return dk, dv, ds_t
