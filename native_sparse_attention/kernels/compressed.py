"""Triton kernels for NSA's compressed branch and the block selection it drives.

Notation (the one PyTorch's FlexAttention templates use, plus NSA's geometry)
-----------------------------------------------------------------------------
Q: queries ``[Z, HQ, M, D]``; K, V: compressed keys / values ``[Z, HKV, N, D]``;
OUT: ``[Z, HQ, M, D]``; LSE: natural log-sum-exp of the scaled logits, ``[Z, HQ, M]`` fp32.
Z: batch size. HQ, HKV: query / key-value heads. GQA_SHARED_HEADS = HQ // HKV query heads
read one kv head. M: query length; query row ``r`` sits at token position ``Q_START + r``
(``Q_START`` > 0 only in the forward kernels: decoding steps, which read it on the device
per batch row, and prefills that continue a cache).
N = NUM_MEM + NC keys: NUM_MEM learned memory keys (seen by every query), then NC
compressed keys. D: head dim (HEAD_DIM), padded to the power of two BLOCK_D.
CBS, STRIDE: compressed key ``c`` summarises tokens ``[c * STRIDE, c * STRIDE + CBS)``.
Causal: the query at position ``t`` sees compressed key ``c`` iff its last token
``c * STRIDE + CBS - 1 < t``, so the visible compressed keys are the prefix
``c < num_visible(t)``.
DOC_START, DOC_END: with HAS_DOCS, the rows pack documents (training only: ``Q_START`` = 0,
causal): ``[Z, M]`` int32, the first token of token ``t``'s document and one past its last.
The query at ``t`` then sees compressed key ``c`` only if also ``c * STRIDE >=
DOC_START[t]`` (the suffix ``c >= first_in_document(t)`` of the prefix; memory keys stay
visible), i.e. key-side the rows ``c * STRIDE + CBS - 1 < t < DOC_END[c * STRIDE]``.
SBS: selection block size; selection block ``j`` covers tokens ``[j * SBS, (j + 1) * SBS)``;
NSEL = ceil((Q_START + M) / SBS). TOPN: blocks selected per query; TOPN_PAD: TOPN rounded up to
a power of two, at least 2. HS: selection heads (HKV when a group shares its selection, HQ
otherwise); HEADS_PER_SELECTION query heads score each one.
BLOCK_M: query tile; BLOCK_N: key tile; BLOCK_C: compressed keys per scoring tile;
BLOCK_S: lanes of a chunk of selection blocks, S_STEP of them used. HEADS_PAD: a
group's query heads padded to a tile's rows (at least 16), where one query's heads are
the rows of a tile. NUM_CHUNKS: chunks of S_STEP selection blocks in NSEL.
SEL, DSCORE: the chosen blocks ``[Z, HS, M, TOPN]`` and the gradient of their scores;
G = dL/dP that DSCORE adds (nonzero on the compressed keys overlapping chosen blocks);
KEYS_PER_BLOCK: compressed keys overlapping one selection block, at most; BLOCK_J:
selection blocks that can overlap one key tile, padded. QUERY_SPLITS: programs that
share the query rows of one dK / dV key tile (grid axis 2).

Kernels
-------
``_attention_fwd_kernel``: flash forward over memory + compressed keys -> OUT, LSE.
``_one_query_fwd_kernel``: the same for one query whose kv heads are shared (a decoding
step), the heads of each kv head as the rows of one tile.
``_attention_bwd_dq_kernel``: dQ, and DELTA = rowsum(dOUT * OUT), the softmax-backward
correction, from the dOUT tile it loads anyway (at the layer benchmark's n = 65536 on an
H100 a pass of its own took 0.19 ms and one more launch; the OUT tile took dQ from 2.62
to 2.65-2.71 ms); with SCORE_GRAD it first gathers the chosen blocks' keys for the
scores' share of dQ and adds rowsum(P * G) to DELTA. With documents it also leaves each
query tile's share of the memory keys' dK, dV, which every row sees (``_dq_memory_step``).
``_attention_bwd_dkdv_kernel``: per query head partial dK, dV (no atomics, so the result
is deterministic); with SCORE_GRAD, dP gains G per tile. Short sequences have too few
(head, key tile) pairs to fill the GPU, so the rows that see a key tile are also split
among QUERY_SPLITS programs, each with its own partial.
``_sum_partials_kernel``: the sums of those partials over each kv head's group and the
splits, in a fixed order, cast to the keys' dtype.
``_select_blocks_kernel``: recomputes the probabilities ``exp(s - LSE)`` tile by tile, adds
them into the selection blocks they overlap, and keeps a running top-n per query, so the
``[M, NC]`` probabilities and the ``[M, NSEL]`` importances never reach memory.
``_one_query_scores_kernel``, ``_one_query_finish_kernel``: one query whose kv heads
share their selection (a decoding step), forward and selection from one pass over the
keys: each tile of scores takes a softmax step and adds into the blocks it overlaps,
per head, against the running maximum; the chunks' importances reach memory (a
decoding step's are a few KB), and the second kernel scales them by the final LSE and
picks the top-n, beside merging the outputs of the programs that shared the keys.

Forwards of at most _FEW_ROWS queries (decoding steps) would run one program per head, each
walking the whole cache, on a GPU of a hundred SMs and more. For the steps that CUDA graphs
replay (the query position read on the device), the forward and the selection split each
query tile's key tiles (chunks of selection blocks) among the programs of grid axis 2,
each leaving a partial result: (output, LSE) for ``_merge_partial_outputs_kernel`` (for
one query ``_merge_one_query_partials_kernel``), a top-n for
``_merge_partial_tops_kernel``. At 64k cached tokens on an H100 this took a layer's
replayed decoding step from 0.51 to 0.23 ms. A one-query step whose kv heads are shared
pads no rows: its tiles take the group's query heads as their rows, one dot per key tile
for all of them where a program per head would pad its one row to 16: the one-query
kernels above where the group shares its selection, ``_one_query_fwd_kernel`` (and
per-head selections) where it does not. Training-time selections of too few
programs to fill the GPU split their chunks the same way (``_SELECT_PROGRAMS_PER_SM``).

Programs walk query tiles last-to-first: in causal mode the last tiles see the most keys,
and launching them first shortens the tail of the grid.

The exponentials stay on the hardware ``exp2``: computing all or half of them as a
polynomial on the FMA units (FlashAttention-4's trick against a saturated MUFU) made the
forward 1.4x (1.2x) and the selection 1.5x (1.25x) slower at the layer benchmark's
n = 65536 on an H100, and computing them in pairs in half precision (``ex2.approx.f16x2``
and its conversions) made dK / dV 5.06 -> 6.54 ms: the kernels are not bound by the
exponentials' throughput.

The attention kernels load their q / dO / key / value tiles through TMA tensor
descriptors (``_load_tile``), which also need no load masks: in the layer at n = 65536
on an H100 the forward took 2.93 -> 2.63 ms and dQ 3.09 -> 2.57 ms with them, dK / dV
the same 5.0 ms. The selection kernel keeps pointer loads, with which it ran 2.80 ms
against 2.88.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.standard import bitonic_merge

from native_sparse_attention.kernels.launch import launch
from native_sparse_attention.kernels.library import (
    cdiv,
    dot_precision,
    head_pointer,
    head_strides,
    is_tokens_major,
    launcher_op,
    merge_share,
    multiprocessors,
    new_heads_tensor,
    next_power_of_2,
    position_in_memory,
    register_cap,
    row_tiles,
    start_position,
    unit_stride_last,
)
from native_sparse_attention.reference import compressed_attend
from native_sparse_attention.selection import (
    BlockSelection,
    num_selection_blocks,
    select_blocks,
    selectable_blocks,
    selection_block_scores,
)

__all__ = ["compressed_attend_and_select", "compressed_attend_and_select_at"]

LOG2E = 1.4426950408889634
# The same constant for kernels, which may only read constexpr globals.
_KERNEL_LOG2E = tl.constexpr(LOG2E)
_SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_MAX_HEAD_DIM = 128


# ---------------------------------------------------------------------------------------
# Shared device helpers
# ---------------------------------------------------------------------------------------


@triton.jit
def _num_visible(positions, NC, CBS, STRIDE, IS_CAUSAL: tl.constexpr):
    """Number of compressed keys (a prefix) the queries at ``positions`` may attend."""
    if IS_CAUSAL:
        # Clamp before dividing: integer division truncates toward zero.
        return tl.minimum(tl.maximum(positions - CBS + STRIDE, 0) // STRIDE, NC)
    else:
        return positions * 0 + NC


@triton.jit
def _candidate_blocks(visible, CBS, STRIDE, SBS, NSEL):
    """Selection blocks that overlap one of the first ``visible`` compressed keys, i.e. start
    before the end of the last of them: the candidates are the blocks ``< result``."""
    return tl.minimum(tl.where(visible > 0, ((visible - 1) * STRIDE + CBS + SBS - 1) // SBS, 0), NSEL)


@triton.jit
def _load_rows(ptr, start, row_stride, num_rows, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr,
               HEAD_DIM: tl.constexpr):
    """Rows ``start .. start + BLOCK`` of a ``[num_rows, HEAD_DIM]`` matrix, zero padded to
    ``[BLOCK, BLOCK_D]``. The tile start is applied in int64 so huge tensors stay addressable.
    """
    offs = tl.arange(0, BLOCK)
    offs_d = tl.arange(0, BLOCK_D)
    base = ptr + tl.cast(start, tl.int64) * row_stride
    mask = (start + offs[:, None] < num_rows) & (offs_d[None, :] < HEAD_DIM)
    return tl.load(base + offs[:, None] * row_stride + offs_d[None, :], mask=mask, other=0.0)


@triton.jit
def _heads_of_one_query(Q, z, first_head, stride_qz, stride_qh, stride_qm, m, NUM_HEADS: tl.constexpr,
                        HEADS_PAD: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Query row ``m`` of heads ``first_head ..`` (NUM_HEADS of them) as the rows of one
    ``[HEADS_PAD, BLOCK_D]`` tile, padding heads zero."""
    heads = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    rows = (Q + z.to(tl.int64) * stride_qz + tl.cast(m, tl.int64) * stride_qm
            + (first_head + heads)[:, None].to(tl.int64) * stride_qh)
    return tl.load(rows + offs_d[None, :], mask=(heads[:, None] < NUM_HEADS) & (offs_d[None, :] < HEAD_DIM),
                   other=0.0)


@triton.jit
def _load_tile(desc, z, h, start, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rows ``start .. start + BLOCK`` of head ``[z, h]`` through a ``[Z, H, rows, D]`` TMA
    descriptor of ``[BLOCK, BLOCK_D]`` tiles; rows and columns past the end read as zero."""
    return desc.load([z, h, start, 0]).reshape(BLOCK, BLOCK_D)


@triton.jit
def _store_rows(ptr, start, row_stride, num_rows, value, BLOCK: tl.constexpr,
                BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Inverse of ``_load_rows``: writes the valid part of ``value: [BLOCK, BLOCK_D]``."""
    offs = tl.arange(0, BLOCK)
    offs_d = tl.arange(0, BLOCK_D)
    base = ptr + tl.cast(start, tl.int64) * row_stride
    mask = (start + offs[:, None] < num_rows) & (offs_d[None, :] < HEAD_DIM)
    tl.store(base + offs[:, None] * row_stride + offs_d[None, :],
             value.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _load_lse_log2(lse_ptr, rows, M):
    """LSE of ``rows`` in base 2, with empty rows (-inf) mapped to +inf so that
    ``exp2(s - lse)`` is 0 for them instead of NaN."""
    lse = tl.load(lse_ptr + rows, mask=rows < M, other=float("inf")) * _KERNEL_LOG2E
    return tl.where(lse == float("-inf"), float("inf"), lse)


@triton.jit
def _query_key_ranges(m_start, M, Q_START, NUM_MEM, NC, CBS, STRIDE, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr):
    """Key loop bounds for the query tile starting at row ``m_start``: tiles below
    ``full_end`` are visible to every row, tiles in ``[full_end, keys_end)`` need a mask."""
    first_row = m_start
    last_row = tl.minimum(m_start + BLOCK_M, M) - 1
    full_keys = NUM_MEM + _num_visible(Q_START + first_row, NC, CBS, STRIDE, IS_CAUSAL)
    keys_end = NUM_MEM + _num_visible(Q_START + last_row, NC, CBS, STRIDE, IS_CAUSAL)
    return full_keys // BLOCK_N * BLOCK_N, keys_end


@triton.jit
def _first_key_in_document(doc_start_ptr, rows, M, NUM_MEM, STRIDE):
    """Per row, the first key whose compressed window starts inside the row's document:
    the row's visible keys are ``[0, NUM_MEM)`` and ``[first, key_limit)``."""
    start = tl.load(doc_start_ptr + rows, mask=rows < M, other=0)
    return NUM_MEM + tl.cdiv(start, STRIDE)


@triton.jit
def _key_visible(keys, key_low, key_limit, NUM_MEM, HAS_DOCS: tl.constexpr):
    """Whether rows see ``keys`` (the operands broadcast): below ``key_limit`` and, with
    documents, memory keys or at least ``key_low``. Without documents ``key_low`` is unread."""
    visible = keys < key_limit
    if HAS_DOCS:
        visible = visible & ((keys >= key_low) | (keys < NUM_MEM))
    return visible


@triton.jit
def _document_key_ranges(key_low, rows, M, NUM_MEM, keys_end, BLOCK_N: tl.constexpr):
    """With documents, where a query tile's key loop goes before the loop it has without
    them: masked steps over ``[0, memory_end)`` (memory keys, always visible), none over
    ``[memory_end, low_begin)`` (keys before every row's document: packed short documents
    must not cost causal work), masked steps over ``[low_begin, low_end)``, where some
    rows' documents start. From ``low_end`` on the loop is the one without documents."""
    valid = rows < M
    low_min = tl.min(tl.where(valid, key_low, 0x7FFFFFFF), 0)
    low_max = tl.max(tl.where(valid, key_low, 0), 0)
    memory_end = tl.minimum(tl.cdiv(NUM_MEM, BLOCK_N) * BLOCK_N, keys_end)
    low_begin = tl.maximum(memory_end, low_min // BLOCK_N * BLOCK_N)
    low_end = tl.maximum(low_begin, tl.minimum(tl.cdiv(low_max, BLOCK_N) * BLOCK_N, keys_end))
    return memory_end, low_begin, low_end


# ---------------------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------------------


@triton.jit
def _online_softmax_step(acc, m_i, l_i, q, k, v, key_start, key_low, key_limit, NUM_MEM, qk_scale,
                         BLOCK_N: tl.constexpr, MASKED: tl.constexpr, HAS_DOCS: tl.constexpr,
                         DOT_PRECISION: tl.constexpr):
    """Folds one key tile into the running (acc, row max, row sum), all in base 2.

    The row max is taken over the unscaled q.k (qk_scale > 0), so that each logit's
    exponent argument is one fused multiply-add: 30 of the key loop's 334 instructions
    fewer, and 2.73 -> 2.62 ms at the layer benchmark's n = 65536 on an H100. The same
    order in ``attention_tiles.softmax_tile`` made the window's forward slower (the
    forward launches 5.49 -> 5.97 ms) and the selection's no faster, so it keeps the
    scaled logits.
    """
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    if MASKED:
        cols = key_start + tl.arange(0, BLOCK_N)
        visible = _key_visible(cols[None, :], key_low[:, None], key_limit[:, None], NUM_MEM, HAS_DOCS)
        qk = tl.where(visible, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    # A row that has seen no key keeps max -inf; exponentiate against 0 to avoid NaN.
    m_base = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_base)
    p = tl.exp2(qk * qk_scale - m_base[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _forward_tile(acc, m_i, l_i, q, K_TILES, V_TILES, z, kv_head, key_start, key_low, key_limit,
                  NUM_MEM, qk_scale, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                  MASKED: tl.constexpr, HAS_DOCS: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """``_online_softmax_step`` over the key tile at ``key_start``."""
    k = _load_tile(K_TILES, z, kv_head, key_start, BLOCK_N, BLOCK_D)
    v = _load_tile(V_TILES, z, kv_head, key_start, BLOCK_N, BLOCK_D)
    return _online_softmax_step(acc, m_i, l_i, q, k, v, key_start, key_low, key_limit, NUM_MEM,
                                qk_scale, BLOCK_N, MASKED, HAS_DOCS, DOT_PRECISION)


@triton.jit
def _document_forward_loop(acc, m_i, l_i, q, K_TILES, V_TILES, z, kv_head, rows, M, key_low,
                           key_limit, NUM_MEM, full_end, keys_end, qk_scale, BLOCK_N: tl.constexpr,
                           BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """The forward's key loop with documents (``_document_key_ranges``), unsplit: documents
    come only with queries at position 0, whose forwards never split."""
    memory_end, low_begin, low_end = _document_key_ranges(key_low, rows, M, NUM_MEM, keys_end, BLOCK_N)
    for key_start in range(0, memory_end, BLOCK_N):
        acc, m_i, l_i = _forward_tile(acc, m_i, l_i, q, K_TILES, V_TILES, z, kv_head, key_start, key_low,
                                      key_limit, NUM_MEM, qk_scale, BLOCK_N, BLOCK_D, True, True,
                                      DOT_PRECISION)
    for key_start in range(low_begin, low_end, BLOCK_N):
        acc, m_i, l_i = _forward_tile(acc, m_i, l_i, q, K_TILES, V_TILES, z, kv_head, key_start, key_low,
                                      key_limit, NUM_MEM, qk_scale, BLOCK_N, BLOCK_D, True, True,
                                      DOT_PRECISION)
    for key_start in range(low_end, full_end, BLOCK_N):
        acc, m_i, l_i = _forward_tile(acc, m_i, l_i, q, K_TILES, V_TILES, z, kv_head, key_start, key_low,
                                      key_limit, NUM_MEM, qk_scale, BLOCK_N, BLOCK_D, False, True,
                                      DOT_PRECISION)
    for key_start in range(tl.maximum(low_end, full_end), keys_end, BLOCK_N):
        acc, m_i, l_i = _forward_tile(acc, m_i, l_i, q, K_TILES, V_TILES, z, kv_head, key_start, key_low,
                                      key_limit, NUM_MEM, qk_scale, BLOCK_N, BLOCK_D, True, True,
                                      DOT_PRECISION)
    return acc, m_i, l_i


# Lengths and positions change with every decoding step. Triton would compile a variant per
# divisibility by 16 (and for the value 1) of each; no address in these kernels gains from it.
_STEP_VARYING = ("M", "Q_START", "N")


@triton.jit(do_not_specialize=_STEP_VARYING)
def _attention_fwd_kernel(
    Q_TILES, K_TILES, V_TILES, OUT, LSE, PARTIAL_OUT, PARTIAL_LSE, DOC_START,
    stride_oz, stride_oh, stride_om,
    HQ, M, Q_START, Q_START_PTR, N, NUM_MEM, CBS, STRIDE, qk_scale,
    GQA_SHARED_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, IS_CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    Q_START_IN_MEMORY: tl.constexpr, PARTIAL_OUTPUT: tl.constexpr, HAS_DOCS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # Program (zh, tile, split) attends the split-th of tl.num_programs(2) shares of the
    # query tile's key tiles. With PARTIAL_OUTPUT it leaves its normalised output and
    # LSE in PARTIAL_OUT [splits, Z * HQ, M, D] and PARTIAL_LSE [splits, Z * HQ, M]
    # (float32) for _merge_partial_outputs_kernel.
    zh = tl.program_id(0)
    z, h = zh // HQ, zh % HQ
    Q_START = start_position(Q_START, Q_START_PTR, Q_START_IN_MEMORY, z)
    m_start = (tl.num_programs(1) - 1 - tl.program_id(1)) * BLOCK_M
    kv_head = h // GQA_SHARED_HEADS

    rows = m_start + tl.arange(0, BLOCK_M)
    key_limit = NUM_MEM + _num_visible(Q_START + rows, N - NUM_MEM, CBS, STRIDE, IS_CAUSAL)
    full_end, keys_end = _query_key_ranges(m_start, M, Q_START, NUM_MEM, N - NUM_MEM, CBS, STRIDE,
                                           BLOCK_M, BLOCK_N, IS_CAUSAL)
    share = tl.cdiv(tl.cdiv(keys_end, BLOCK_N), tl.num_programs(2)) * BLOCK_N
    share_start = tl.program_id(2) * share
    share_end = tl.minimum(share_start + share, keys_end)
    q = _load_tile(Q_TILES, z, h, m_start, BLOCK_M, BLOCK_D)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if HAS_DOCS:
        key_low = _first_key_in_document(DOC_START + z.to(tl.int64) * M, rows, M, NUM_MEM, STRIDE)
        acc, m_i, l_i = _document_forward_loop(acc, m_i, l_i, q, K_TILES, V_TILES, z, kv_head, rows, M,
                                               key_low, key_limit, NUM_MEM, full_end, keys_end, qk_scale,
                                               BLOCK_N, BLOCK_D, DOT_PRECISION)
    else:
        for key_start in range(share_start, tl.minimum(full_end, share_end), BLOCK_N):
            acc, m_i, l_i = _forward_tile(acc, m_i, l_i, q, K_TILES, V_TILES, z, kv_head, key_start,
                                          key_limit, key_limit, NUM_MEM, qk_scale, BLOCK_N, BLOCK_D,
                                          False, False, DOT_PRECISION)
        for key_start in range(tl.maximum(full_end, share_start), share_end, BLOCK_N):
            acc, m_i, l_i = _forward_tile(acc, m_i, l_i, q, K_TILES, V_TILES, z, kv_head, key_start,
                                          key_limit, key_limit, NUM_MEM, qk_scale, BLOCK_N, BLOCK_D,
                                          True, False, DOT_PRECISION)

    has_keys = l_i > 0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    lse = tl.where(has_keys, (m_i + tl.log2(tl.where(has_keys, l_i, 1.0))) / _KERNEL_LOG2E,
                   float("-inf"))
    if PARTIAL_OUTPUT:
        part = (tl.program_id(2) * tl.num_programs(0) + zh).to(tl.int64) * M
        _store_rows(PARTIAL_OUT + part * HEAD_DIM, m_start, HEAD_DIM, M, out, BLOCK_M, BLOCK_D,
                    HEAD_DIM)
        tl.store(PARTIAL_LSE + part + rows, lse, mask=rows < M)
    else:
        o_ptr = head_pointer(OUT, z, h, stride_oz, stride_oh)
        _store_rows(o_ptr, m_start, stride_om, M, out, BLOCK_M, BLOCK_D, HEAD_DIM)
        tl.store(LSE + zh.to(tl.int64) * M + rows, lse, mask=rows < M)


@triton.jit(do_not_specialize=("Q_START", "N"))
def _one_query_fwd_kernel(
    Q, K_TILES, V_TILES, OUT, LSE, PARTIAL_OUT, PARTIAL_LSE,
    stride_qz, stride_qh, stride_oz, stride_oh,
    HQ, Q_START, Q_START_PTR, N, NUM_MEM, CBS, STRIDE, qk_scale,
    GQA_SHARED_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, IS_CAUSAL: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, Q_START_IN_MEMORY: tl.constexpr,
    PARTIAL_OUTPUT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # A forward of one query (a decoding step, no documents) whose kv heads are
    # shared: program (z * HKV + kv head, 0, split) attends the split-th share of the key
    # tiles with the GQA_SHARED_HEADS query heads as the rows of one tile, each key and
    # value tile loaded once for all of them. Outputs and partials as in
    # _attention_fwd_kernel, whose per-head programs would each pad their one row to a tile.
    zk = tl.program_id(0)
    hk = HQ // GQA_SHARED_HEADS
    z, kv_head = zk // hk, zk % hk
    Q_START = start_position(Q_START, Q_START_PTR, Q_START_IN_MEMORY, z)
    heads = kv_head * GQA_SHARED_HEADS + tl.arange(0, HEADS_PAD)
    head_ok = tl.arange(0, HEADS_PAD) < GQA_SHARED_HEADS
    offs_d = tl.arange(0, BLOCK_D)
    q = _heads_of_one_query(Q, z, kv_head * GQA_SHARED_HEADS, stride_qz, stride_qh, 0, 0, GQA_SHARED_HEADS,
                            HEADS_PAD, BLOCK_D, HEAD_DIM)
    keys_end = NUM_MEM + _num_visible(Q_START, N - NUM_MEM, CBS, STRIDE, IS_CAUSAL)
    key_limit = tl.full([HEADS_PAD], 0, tl.int32) + keys_end
    full_end = keys_end // BLOCK_N * BLOCK_N
    share = tl.cdiv(tl.cdiv(keys_end, BLOCK_N), tl.num_programs(2)) * BLOCK_N
    share_start = tl.program_id(2) * share
    share_end = tl.minimum(share_start + share, keys_end)
    acc = tl.zeros([HEADS_PAD, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([HEADS_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([HEADS_PAD], dtype=tl.float32)
    for key_start in range(share_start, tl.minimum(full_end, share_end), BLOCK_N):
        acc, m_i, l_i = _forward_tile(acc, m_i, l_i, q, K_TILES, V_TILES, z, kv_head, key_start, key_limit,
                                      key_limit, NUM_MEM, qk_scale, BLOCK_N, BLOCK_D, False, False, DOT_PRECISION)
    for key_start in range(tl.maximum(full_end, share_start), share_end, BLOCK_N):
        acc, m_i, l_i = _forward_tile(acc, m_i, l_i, q, K_TILES, V_TILES, z, kv_head, key_start, key_limit,
                                      key_limit, NUM_MEM, qk_scale, BLOCK_N, BLOCK_D, True, False, DOT_PRECISION)

    has_keys = l_i > 0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    lse = tl.where(has_keys, (m_i + tl.log2(tl.where(has_keys, l_i, 1.0))) / _KERNEL_LOG2E, float("-inf"))
    out_mask = head_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    zh = z.to(tl.int64) * HQ + heads
    if PARTIAL_OUTPUT:
        part = tl.program_id(2).to(tl.int64) * tl.num_programs(0) * GQA_SHARED_HEADS + zh
        tl.store(PARTIAL_OUT + part[:, None] * HEAD_DIM + offs_d[None, :], out, mask=out_mask)
        tl.store(PARTIAL_LSE + part, lse, mask=head_ok)
    else:
        o_ptr = OUT + z.to(tl.int64) * stride_oz + heads[:, None].to(tl.int64) * stride_oh + offs_d[None, :]
        tl.store(o_ptr, out.to(OUT.dtype.element_ty), mask=out_mask)
        tl.store(LSE + zh, lse, mask=head_ok)


@triton.jit(do_not_specialize=("M", "SPLITS"))
def _merge_partial_outputs_kernel(
    PARTIAL_OUT, PARTIAL_LSE, OUT, LSE,
    stride_oz, stride_oh, stride_om,
    HQ, M, SPLITS,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """OUT and LSE over the keys of all SPLITS shares, from their partial outputs and LSEs
    (``_attention_fwd_kernel``'s layouts): share s weighs ``exp(lse_s - lse)``."""
    zh = tl.program_id(0)
    z, h = zh // HQ, zh % HQ
    m_start = tl.program_id(1) * BLOCK_M
    rows = m_start + tl.arange(0, BLOCK_M)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for split in range(SPLITS):
        part = (split * tl.num_programs(0) + zh).to(tl.int64) * M
        share_lse = tl.load(PARTIAL_LSE + part + rows, mask=rows < M, other=float("-inf"))
        share_out = _load_rows(PARTIAL_OUT + part * HEAD_DIM, m_start, HEAD_DIM, M, BLOCK_M,
                               BLOCK_D, HEAD_DIM)
        m_i, l_i, acc = merge_share(m_i, l_i, acc, share_lse, share_out)
    has_keys = l_i > 0
    acc = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    lse = tl.where(has_keys, m_i + tl.log(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    _store_rows(head_pointer(OUT, z, h, stride_oz, stride_oh), m_start, stride_om, M, acc,
                BLOCK_M, BLOCK_D, HEAD_DIM)
    tl.store(LSE + zh.to(tl.int64) * M + rows, lse, mask=rows < M)


@triton.jit(do_not_specialize=("SPLITS",))
def _merge_one_query_partials_kernel(
    PARTIAL_OUT, PARTIAL_LSE, OUT, LSE, stride_oz, stride_oh, HQ, SPLITS,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS_PAD: tl.constexpr,
):
    """``_merge_partial_outputs_kernel`` for one query (M = 1), all SPLITS shares at once:
    one maximum and one weighted sum over a ``[SPLITS_PAD, BLOCK_D]`` tile instead of a
    chain of SPLITS dependent merges."""
    zh = tl.program_id(0)
    z, h = zh // HQ, zh % HQ
    splits = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    part = splits.to(tl.int64) * tl.num_programs(0) + zh
    share_lse = tl.load(PARTIAL_LSE + part, mask=splits < SPLITS, other=float("-inf"))
    share_out = tl.load(PARTIAL_OUT + part[:, None] * HEAD_DIM + offs_d[None, :],
                        mask=(splits[:, None] < SPLITS) & (offs_d[None, :] < HEAD_DIM), other=0.0)
    m = tl.max(share_lse, 0)
    # Without keys in any share the maximum is -inf: weigh against 0, not NaN.
    weight = tl.exp(share_lse - tl.where(m == float("-inf"), 0.0, m))
    total = tl.sum(weight, 0)
    has_keys = total > 0
    out = tl.sum(share_out * weight[:, None], 0) / tl.where(has_keys, total, 1.0)
    lse = tl.where(has_keys, m + tl.log(tl.where(has_keys, total, 1.0)), float("-inf"))
    o_ptr = OUT + z.to(tl.int64) * stride_oz + h.to(tl.int64) * stride_oh
    tl.store(o_ptr + offs_d, out.to(OUT.dtype.element_ty), mask=offs_d < HEAD_DIM)
    tl.store(LSE + zh, lse)


# ---------------------------------------------------------------------------------------
# Backward
# ---------------------------------------------------------------------------------------


@triton.jit
def _score_grad_t(sel_ptr, dscore_ptr, rows, M, key_start, NUM_MEM, CBS, STRIDE, SBS,
                  TOPN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_J: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """G^T, with G = dL/dP that the selection scores add, for one (key tile, query tile):
    ``[BLOCK_N, BLOCK_M]``.

    A chosen block's score sums the probabilities of the compressed keys overlapping it,
    so ``G[r, key]`` is the sum of DSCORE[r, s] over the slots ``s`` whose block overlaps
    compressed key ``key - NUM_MEM``; memory keys get 0. Computed as a dot: the tile's keys'
    0/1 overlap with the BLOCK_J blocks that can overlap them (``[BLOCK_N, BLOCK_J]``),
    times those blocks' score gradients (``[BLOCK_J, BLOCK_M]``). ``sel_ptr``,
    ``dscore_ptr``: the ``[TOPN, M]`` (slot-major) int32 indices and score gradients of the
    selection head, each row's slots in ascending block order.

    The sorted order makes the slots of a row whose blocks fall in the tile's BLOCK_J
    lanes consecutive: one pass over the slots counts, per row, the slots before the
    window and those inside, and only as many [BLOCK_J, BLOCK_M] scatters run as the
    fullest row has slots inside (with random selections a few of TOPN).
    """
    comp = key_start - NUM_MEM + tl.arange(0, BLOCK_N)
    first_block = tl.maximum(key_start - NUM_MEM, 0) * STRIDE // SBS
    lanes = tl.arange(0, BLOCK_J)
    row_ok = rows < M
    before = tl.zeros([BLOCK_M], dtype=tl.int32)
    inside = tl.zeros([BLOCK_M], dtype=tl.int32)
    for slot in tl.static_range(TOPN):
        lane = tl.load(sel_ptr + slot * M + rows, mask=row_ok, other=-1) - first_block
        before += (lane < 0).to(tl.int32)
        inside += ((lane >= 0) & (lane < BLOCK_J)).to(tl.int32)
    block_grad = tl.zeros([BLOCK_J, BLOCK_M], dtype=tl.float32)
    for k in range(tl.max(inside, 0)):
        slot_ok = row_ok & (k < inside)
        hit = before + k
        lane = tl.load(sel_ptr + hit * M + rows, mask=slot_ok, other=-1) - first_block
        dscore = tl.load(dscore_ptr + hit * M + rows, mask=slot_ok, other=0.0)
        block_grad += tl.where(lanes[:, None] == lane[None, :], dscore[None, :], 0.0)
    blocks = first_block + lanes
    overlap = ((comp[:, None] >= 0)
               & (comp[:, None] * STRIDE < (blocks[None, :] + 1) * SBS)
               & (blocks[None, :] * SBS < comp[:, None] * STRIDE + CBS))
    return tl.dot(overlap.to(tl.float32), block_grad, input_precision=DOT_PRECISION)


@triton.jit
def _selection_pointers(SEL, DSCORE, z, h, M, HQ, HEADS_PER_SELECTION: tl.constexpr,
                        TOPN: tl.constexpr):
    """Selection head ``h // HEADS_PER_SELECTION`` of slot-major ``[Z, HS, TOPN, M]`` tensors."""
    head = z.to(tl.int64) * (HQ // HEADS_PER_SELECTION) + h // HEADS_PER_SELECTION
    offset = head * M * TOPN
    return SEL + offset, DSCORE + offset


@triton.jit
def _dkdv_step(dk, dv, k, v, Q_TILES, DO_TILES, z, h, lse_ptr, delta_ptr, sel_ptr, dscore_ptr,
               m_start, M, key_start, key_rows_end, NUM_MEM, NC, CBS, STRIDE, SBS, qk_scale,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
               IS_CAUSAL: tl.constexpr, MASKED: tl.constexpr, SCORE_GRAD: tl.constexpr,
               TOPN: tl.constexpr, BLOCK_J: tl.constexpr, HAS_DOCS: tl.constexpr,
               DOT_PRECISION: tl.constexpr):
    """Adds one query tile's contribution to the key tile's dK (unscaled) and dV;
    ``key_rows_end`` (with documents): ``_key_rows_end``.

    Works on the transposed scores ``[BLOCK_N, BLOCK_M]``: P^T and dS^T then come out of
    their dots in the layout the next dot reads them in, where P and dS would have to be
    transposed in registers (a trip through shared memory per dot).
    """
    rows = m_start + tl.arange(0, BLOCK_M)
    q = _load_tile(Q_TILES, z, h, m_start, BLOCK_M, BLOCK_D)
    do = _load_tile(DO_TILES, z, h, m_start, BLOCK_M, BLOCK_D)
    lse = _load_lse_log2(lse_ptr, rows, M)
    delta = tl.load(delta_ptr + rows, mask=rows < M, other=0.0)
    # Both score dots go out before the exponentials, so that the tensor cores compute
    # dP^T while P^T is exponentiated (the layer at n = 65536 on an H100: 5.20 -> 4.96-5.00
    # ms). The same order made the dQ passes here and in attention_tiles.dq_tile slower.
    qk_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)
    dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
    p_t = tl.exp2(qk_t * qk_scale - lse[None, :])
    if MASKED:
        key_limit = NUM_MEM + _num_visible(rows, NC, CBS, STRIDE, IS_CAUSAL)
        cols = key_start + tl.arange(0, BLOCK_N)
        visible = cols[:, None] < key_limit[None, :]
        if HAS_DOCS:
            visible = visible & (rows[None, :] < key_rows_end[:, None])
        p_t = tl.where(visible, p_t, 0.0)
    dv += tl.dot(p_t.to(do.dtype), do, input_precision=DOT_PRECISION)
    if SCORE_GRAD:
        dp_t += _score_grad_t(sel_ptr, dscore_ptr, rows, M, key_start, NUM_MEM, CBS, STRIDE,
                              SBS, TOPN, BLOCK_M, BLOCK_N, BLOCK_J, DOT_PRECISION)
    ds_t = p_t * (dp_t - delta[None, :])
    dk += tl.dot(ds_t.to(q.dtype), q, input_precision=DOT_PRECISION)
    return dk, dv


@triton.jit
def _first_row_seeing(key, NUM_MEM, CBS, STRIDE, IS_CAUSAL: tl.constexpr):
    """First query row that attends key index ``key`` (memory or compressed)."""
    if IS_CAUSAL:
        return tl.where(key < NUM_MEM, 0, (key - NUM_MEM) * STRIDE + CBS)
    else:
        return key * 0


@triton.jit
def _key_rows_end(doc_end_ptr, key_start, M, N, NUM_MEM, STRIDE, BLOCK_N: tl.constexpr):
    """Per key of the tile at ``key_start``, one past the last row whose share of its dK, dV
    this kernel computes: the end of the document holding the compressed window's first
    token (the window sees nothing when it crosses that end); 0 for memory keys, whose
    share the dQ kernel computes (``_dq_memory_step``), and past the keys."""
    keys = key_start + tl.arange(0, BLOCK_N)
    first_token = (keys - NUM_MEM) * STRIDE
    compressed = (keys >= NUM_MEM) & (keys < N) & (first_token < M)
    return tl.load(doc_end_ptr + first_token, mask=compressed, other=0)


@triton.jit
def _document_rows(doc_end_ptr, key_start, M, N, NUM_MEM, STRIDE, rows_begin,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """With documents, the rows of a dK / dV key tile: ``(key_rows_end, rows_stop,
    rows_docs)``: no row from ``rows_stop`` on sees the tile's compressed keys (the query
    loop ends there, so short documents cost short loops), and the query tiles from
    ``rows_docs`` on hold rows past some compressed key's document, which need the mask.

    Memory keys count for neither: the unmasked steps give them a share that the kernel
    drops before storing (the dQ kernel computes theirs). Counted, they sent every row of
    a long document through masked steps (about twice an unmasked step's instructions) in
    the tile holding them, already the one with the most rows: in the layer benchmark's
    step at n = 65536 in one document on an H100 this kernel took 6.9 ms against 5.0
    without documents, and 4.9 when the masked rows of that tile were skipped."""
    key_rows_end = _key_rows_end(doc_end_ptr, key_start, M, N, NUM_MEM, STRIDE, BLOCK_N)
    keys = key_start + tl.arange(0, BLOCK_N)
    rows_stop = tl.maximum(tl.max(key_rows_end, 0), rows_begin)
    compressed = (keys >= NUM_MEM) & (keys < N)
    rows_docs = tl.min(tl.where(compressed, key_rows_end, M), 0) // BLOCK_M * BLOCK_M
    return key_rows_end, rows_stop, rows_docs


@triton.jit
def _attention_bwd_dkdv_kernel(
    Q_TILES, K_TILES, V_TILES, DO_TILES, LSE, DELTA, SEL, DSCORE, DOC_END, DK, DV,
    HQ, M, N, NUM_MEM, CBS, STRIDE, SBS, qk_scale, sm_scale,
    GQA_SHARED_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, IS_CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    SCORE_GRAD: tl.constexpr, HEADS_PER_SELECTION: tl.constexpr, TOPN: tl.constexpr,
    BLOCK_J: tl.constexpr, HAS_DOCS: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # DK, DV: [QUERY_SPLITS, Z, HQ, N, D] fp32 partials of this query head and share of
    # the rows (program_id(2)), contiguous.
    zh = tl.program_id(0)
    z, h = zh // HQ, zh % HQ
    key_start = tl.program_id(1) * BLOCK_N
    split = tl.program_id(2)
    NC = N - NUM_MEM
    lse_ptr = LSE + zh.to(tl.int64) * M
    delta_ptr = DELTA + zh.to(tl.int64) * M
    sel_ptr, dscore_ptr = _selection_pointers(SEL, DSCORE, z, h, M, HQ, HEADS_PER_SELECTION, TOPN)
    k = _load_tile(K_TILES, z, h // GQA_SHARED_HEADS, key_start, BLOCK_N, BLOCK_D)
    v = _load_tile(V_TILES, z, h // GQA_SHARED_HEADS, key_start, BLOCK_N, BLOCK_D)

    # Rows before the first key's first viewer see nothing of this tile; rows from the
    # last key's first viewer on see all of it.
    last_key = tl.minimum(key_start + BLOCK_N, N) - 1
    rows_begin = _first_row_seeing(key_start, NUM_MEM, CBS, STRIDE, IS_CAUSAL) // BLOCK_M * BLOCK_M
    rows_full = tl.cdiv(_first_row_seeing(last_key, NUM_MEM, CBS, STRIDE, IS_CAUSAL), BLOCK_M) * BLOCK_M
    rows_full = tl.minimum(tl.maximum(rows_full, rows_begin), M)
    rows_stop = M
    key_rows_end = M  # unread without documents
    if HAS_DOCS:
        key_rows_end, rows_stop, rows_docs = _document_rows(DOC_END + z.to(tl.int64) * M, key_start, M,
                                                            N, NUM_MEM, STRIDE, rows_begin, BLOCK_M, BLOCK_N)
    # This program's share of [rows_begin, rows_stop): whole query tiles, the last share shorter.
    split_rows = tl.cdiv(tl.cdiv(rows_stop - rows_begin, BLOCK_M), tl.num_programs(2)) * BLOCK_M
    rows_lo = rows_begin + split * split_rows
    rows_hi = tl.minimum(rows_lo + split_rows, rows_stop)
    rows_masked_end = tl.minimum(tl.maximum(rows_full, rows_lo), rows_hi)
    # Tiles of rows that see every key of the tile (by causality, and by documents up to
    # rows_docs) skip the mask.
    unmasked_start = tl.maximum(rows_full, rows_lo)
    rows_unmasked_end = rows_hi
    if HAS_DOCS:
        rows_unmasked_end = tl.minimum(tl.maximum(tl.maximum(rows_docs, rows_full), rows_lo), rows_hi)
        # Rows past some key's document (from rows_unmasked_end on) go through the masked
        # loop with the causal ones, and then so do all the share's rows. They only follow
        # unmasked rows where a document ends inside a query tile (selection blocks shorter
        # than BLOCK_M): in a key tile that straddles two documents, the causal rows of its
        # last keys already reach past the first. A third loop for them made ptxas spill in
        # the unmasked loop (20 loads and 13 stores an iteration at 255 registers, Triton 3.6).
        tail = rows_unmasked_end < rows_hi
        rows_masked_end = tl.where(tail, rows_hi, rows_masked_end)
        rows_unmasked_end = tl.where(tail, unmasked_start, rows_unmasked_end)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    for m_start in range(rows_lo, rows_masked_end, BLOCK_M):
        dk, dv = _dkdv_step(dk, dv, k, v, Q_TILES, DO_TILES, z, h, lse_ptr, delta_ptr, sel_ptr,
                            dscore_ptr, m_start, M, key_start, key_rows_end, NUM_MEM, NC, CBS, STRIDE,
                            SBS, qk_scale, BLOCK_M, BLOCK_N, BLOCK_D, IS_CAUSAL, True, SCORE_GRAD,
                            TOPN, BLOCK_J, HAS_DOCS, DOT_PRECISION)
    for m_start in range(unmasked_start, rows_unmasked_end, BLOCK_M):
        dk, dv = _dkdv_step(dk, dv, k, v, Q_TILES, DO_TILES, z, h, lse_ptr, delta_ptr, sel_ptr,
                            dscore_ptr, m_start, M, key_start, key_rows_end, NUM_MEM, NC, CBS, STRIDE,
                            SBS, qk_scale, BLOCK_M, BLOCK_N, BLOCK_D, IS_CAUSAL, False, SCORE_GRAD,
                            TOPN, BLOCK_J, HAS_DOCS, DOT_PRECISION)
    if HAS_DOCS:
        memory = (key_start + tl.arange(0, BLOCK_N) < NUM_MEM)[:, None]
        dk = tl.where(memory, 0.0, dk)
        dv = tl.where(memory, 0.0, dv)
    part = (split.to(tl.int64) * tl.num_programs(0) + zh) * N * HEAD_DIM
    _store_rows(DK + part, key_start, HEAD_DIM, N, dk * sm_scale, BLOCK_N, BLOCK_D, HEAD_DIM)
    _store_rows(DV + part, key_start, HEAD_DIM, N, dv, BLOCK_N, BLOCK_D, HEAD_DIM)


@triton.jit
def _dq_step(dq, q, do, lse, delta, K_TILES, V_TILES, z, kv_head, key_start, key_low, key_limit,
             NUM_MEM, qk_scale, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, MASKED: tl.constexpr,
             HAS_DOCS: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Adds one key tile's contribution to the query tile's dQ (unscaled)."""
    k, _, ds = _dq_scores(q, do, lse, delta, K_TILES, V_TILES, z, kv_head, key_start, key_low,
                          key_limit, NUM_MEM, qk_scale, BLOCK_N, BLOCK_D, MASKED, HAS_DOCS,
                          DOT_PRECISION)
    return dq + tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)


@triton.jit
def _dq_scores(q, do, lse, delta, K_TILES, V_TILES, z, kv_head, key_start, key_low, key_limit,
               NUM_MEM, qk_scale, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
               MASKED: tl.constexpr, HAS_DOCS: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """(K, P, dS) of the query tile and the key tile at ``key_start``."""
    k = _load_tile(K_TILES, z, kv_head, key_start, BLOCK_N, BLOCK_D)
    v = _load_tile(V_TILES, z, kv_head, key_start, BLOCK_N, BLOCK_D)
    p = tl.exp2(tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale - lse[:, None])
    if MASKED:
        cols = key_start + tl.arange(0, BLOCK_N)
        visible = _key_visible(cols[None, :], key_low[:, None], key_limit[:, None], NUM_MEM, HAS_DOCS)
        p = tl.where(visible, p, 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
    ds = p * (dp - delta[:, None])
    return k, p, ds


@triton.jit
def _dq_memory_step(dq, q, do, lse, delta, K_TILES, V_TILES, z, kv_head, key_start, key_low,
                    key_limit, NUM_MEM, qk_scale, sm_scale, dk_mem_ptr, dv_mem_ptr,
                    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                    DOT_PRECISION: tl.constexpr):
    """``_dq_step`` over a key tile holding memory keys, with documents: it also leaves this
    query tile's share of the memory keys' dK, dV in ``dk_mem_ptr``, ``dv_mem_ptr``
    (``[NUM_MEM, HEAD_DIM]`` float32). Every row sees the memory keys, so in the dK / dV
    kernel the key tile holding them would walk all M rows alone while the other tiles
    stop at their documents' ends: at n = 65536 in documents of 1024 tokens on an H200
    that tile made the pass 3.2 ms long, 0.54 ms with the memory keys' share here."""
    k, p, ds = _dq_scores(q, do, lse, delta, K_TILES, V_TILES, z, kv_head, key_start, key_low,
                          key_limit, NUM_MEM, qk_scale, BLOCK_N, BLOCK_D, True, True, DOT_PRECISION)
    dk = tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=DOT_PRECISION)
    dv = tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=DOT_PRECISION)
    _store_rows(dk_mem_ptr, key_start, HEAD_DIM, NUM_MEM, dk * sm_scale, BLOCK_N, BLOCK_D, HEAD_DIM)
    _store_rows(dv_mem_ptr, key_start, HEAD_DIM, NUM_MEM, dv, BLOCK_N, BLOCK_D, HEAD_DIM)
    return dq + tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)


@triton.jit
def _document_dq_loop(dq, q, do, lse, delta, K_TILES, V_TILES, z, kv_head, rows, M, key_low,
                      key_limit, NUM_MEM, full_end, keys_end, qk_scale, sm_scale, dk_mem_ptr,
                      dv_mem_ptr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """dQ's key loop with documents: the forward's (``_document_forward_loop``), whose
    memory tiles also give the memory keys' dK, dV (``_dq_memory_step``)."""
    memory_end, low_begin, low_end = _document_key_ranges(key_low, rows, M, NUM_MEM, keys_end, BLOCK_N)
    for key_start in range(0, memory_end, BLOCK_N):
        dq = _dq_memory_step(dq, q, do, lse, delta, K_TILES, V_TILES, z, kv_head, key_start, key_low,
                             key_limit, NUM_MEM, qk_scale, sm_scale, dk_mem_ptr, dv_mem_ptr, HEAD_DIM,
                             BLOCK_N, BLOCK_D, DOT_PRECISION)
    for key_start in range(low_begin, low_end, BLOCK_N):
        dq = _dq_step(dq, q, do, lse, delta, K_TILES, V_TILES, z, kv_head, key_start, key_low, key_limit,
                      NUM_MEM, qk_scale, BLOCK_N, BLOCK_D, True, True, DOT_PRECISION)
    for key_start in range(low_end, full_end, BLOCK_N):
        dq = _dq_step(dq, q, do, lse, delta, K_TILES, V_TILES, z, kv_head, key_start, key_low, key_limit,
                      NUM_MEM, qk_scale, BLOCK_N, BLOCK_D, False, True, DOT_PRECISION)
    for key_start in range(tl.maximum(low_end, full_end), keys_end, BLOCK_N):
        dq = _dq_step(dq, q, do, lse, delta, K_TILES, V_TILES, z, kv_head, key_start, key_low, key_limit,
                      NUM_MEM, qk_scale, BLOCK_N, BLOCK_D, True, True, DOT_PRECISION)
    return dq


@triton.jit
def _score_path(q, lse, rows, M, k_ptr, stride_kn, sel_ptr, dscore_ptr, key_low, key_limit, NUM_MEM,
                CBS, STRIDE, SBS, qk_scale, TOPN: tl.constexpr, KEYS_PER_BLOCK: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
                HAS_DOCS: tl.constexpr):
    """The selection scores' share of a query tile's dQ: ``(sum_c P G K, rowsum(P * G))``.

    G (``_score_grad_t``) is nonzero only on the few compressed keys overlapping the chosen
    blocks, so they are gathered slot by slot (KEYS_PER_BLOCK at most per block) instead
    of being found in every key tile. A chosen block may overlap windows that start
    before the row's document (``key_low``): they have no probability.
    """
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = rows < M
    qf = q.to(tl.float32)
    pgk = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    pg = tl.zeros([BLOCK_M], dtype=tl.float32)
    for slot in range(TOPN):
        block = tl.load(sel_ptr + slot * M + rows, mask=row_ok, other=0)
        dscore = tl.load(dscore_ptr + slot * M + rows, mask=row_ok, other=0.0)
        first = tl.where(block * SBS >= CBS, (block * SBS - CBS) // STRIDE + 1, 0)
        last = ((block + 1) * SBS - 1) // STRIDE
        for i in range(KEYS_PER_BLOCK):
            key = NUM_MEM + first + i
            valid = row_ok & (first + i <= last) & (key < key_limit)
            if HAS_DOCS:
                valid = valid & (key >= key_low)
            k = tl.load(k_ptr + key[:, None].to(tl.int64) * stride_kn + offs_d[None, :],
                        mask=valid[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
            k = k.to(tl.float32)
            p = tl.exp2(tl.sum(qf * k, 1) * qk_scale - lse)
            weight = tl.where(valid, dscore * p, 0.0)
            pgk += weight[:, None] * k
            pg += weight
    return pgk, pg


@triton.jit
def _attention_bwd_dq_kernel(
    Q_TILES, K_TILES, V_TILES, DO_TILES, OUT_TILES, K, LSE, DELTA, SEL, DSCORE, DOC_START, DK_MEM,
    DV_MEM, DQ,
    stride_kz, stride_kh, stride_kn,
    stride_gz, stride_gh, stride_gm,
    HQ, M, N, NUM_MEM, CBS, STRIDE, SBS, qk_scale, sm_scale,
    GQA_SHARED_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, IS_CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    SCORE_GRAD: tl.constexpr, HEADS_PER_SELECTION: tl.constexpr, TOPN: tl.constexpr,
    KEYS_PER_BLOCK: tl.constexpr, HAS_DOCS: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # dS = P * (dP - delta) with delta = rowsum(dO * O), and with SCORE_GRAD
    # P * (dP + G - delta - rowsum(P * G)): this kernel computes delta, with the last
    # term, and stores it in DELTA for the dK / dV kernel that runs after it (and the
    # caller). K (with its strides) is the pointer that path gathers single keys through.
    # DK_MEM, DV_MEM (with documents): [Z, HQ, query tiles, NUM_MEM, D] float32, each
    # query tile's share of the memory keys' dK, dV (_dq_memory_step).
    zh = tl.program_id(0)
    z, h = zh // HQ, zh % HQ
    m_start = (tl.num_programs(1) - 1 - tl.program_id(1)) * BLOCK_M
    kv_head = h // GQA_SHARED_HEADS
    rows = m_start + tl.arange(0, BLOCK_M)
    q = _load_tile(Q_TILES, z, h, m_start, BLOCK_M, BLOCK_D)
    do = _load_tile(DO_TILES, z, h, m_start, BLOCK_M, BLOCK_D)
    lse = _load_lse_log2(LSE + zh.to(tl.int64) * M, rows, M)
    o = _load_tile(OUT_TILES, z, h, m_start, BLOCK_M, BLOCK_D)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    key_limit = NUM_MEM + _num_visible(rows, N - NUM_MEM, CBS, STRIDE, IS_CAUSAL)
    key_low = key_limit  # unread without documents
    if HAS_DOCS:
        key_low = _first_key_in_document(DOC_START + z.to(tl.int64) * M, rows, M, NUM_MEM, STRIDE)

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if SCORE_GRAD:
        sel_ptr, dscore_ptr = _selection_pointers(SEL, DSCORE, z, h, M, HQ,
                                                  HEADS_PER_SELECTION, TOPN)
        k_ptr = head_pointer(K, z, kv_head, stride_kz, stride_kh)
        dq, pg = _score_path(q, lse, rows, M, k_ptr, stride_kn, sel_ptr, dscore_ptr, key_low,
                             key_limit, NUM_MEM, CBS, STRIDE, SBS, qk_scale, TOPN,
                             KEYS_PER_BLOCK, BLOCK_M, BLOCK_D, HEAD_DIM, HAS_DOCS)
        delta += pg
    tl.store(DELTA + zh.to(tl.int64) * M + rows, delta, mask=rows < M)

    full_end, keys_end = _query_key_ranges(m_start, M, 0, NUM_MEM, N - NUM_MEM, CBS, STRIDE,
                                           BLOCK_M, BLOCK_N, IS_CAUSAL)
    if HAS_DOCS:
        part = (zh.to(tl.int64) * tl.num_programs(1) + m_start // BLOCK_M) * NUM_MEM * HEAD_DIM
        dq = _document_dq_loop(dq, q, do, lse, delta, K_TILES, V_TILES, z, kv_head, rows, M, key_low,
                               key_limit, NUM_MEM, full_end, keys_end, qk_scale, sm_scale,
                               DK_MEM + part, DV_MEM + part, HEAD_DIM, BLOCK_N, BLOCK_D, DOT_PRECISION)
    else:
        for key_start in range(0, full_end, BLOCK_N):
            dq = _dq_step(dq, q, do, lse, delta, K_TILES, V_TILES, z, kv_head, key_start, key_low,
                          key_limit, NUM_MEM, qk_scale, BLOCK_N, BLOCK_D, False, False, DOT_PRECISION)
        for key_start in range(full_end, keys_end, BLOCK_N):
            dq = _dq_step(dq, q, do, lse, delta, K_TILES, V_TILES, z, kv_head, key_start, key_low,
                          key_limit, NUM_MEM, qk_scale, BLOCK_N, BLOCK_D, True, False, DOT_PRECISION)
    _store_rows(head_pointer(DQ, z, h, stride_gz, stride_gh), m_start, stride_gm, M,
                dq * sm_scale, BLOCK_M, BLOCK_D, HEAD_DIM)


@triton.jit
def _sum_partials_kernel(DK_PART, DV_PART, DK, DV, SIZE, PARTS: tl.constexpr, GROUP: tl.constexpr,
                         BLOCK: tl.constexpr):
    """DK, DV ``[Z * HKV, SIZE]`` (in their dtype): the sums of the float32 partials
    DK_PART, DV_PART ``[PARTS, Z * HKV, GROUP, SIZE]`` over the parts and the GROUP query
    heads of each kv head, in a fixed order. Program (zk, block, tensor) sums BLOCK
    elements of kv head ``zk`` of DK (tensor 0) or DV (tensor 1); its PARTS * GROUP loads
    are unrolled, so that they are all in flight at once."""
    zk = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < SIZE
    if tl.program_id(2) == 0:
        part_ptr, out_ptr = DK_PART, DK
    else:
        part_ptr, out_ptr = DV_PART, DV
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for part in tl.static_range(PARTS):
        first_row = (part * tl.num_programs(0) + zk).to(tl.int64) * GROUP
        for g in tl.static_range(GROUP):
            acc += tl.load(part_ptr + (first_row + g) * SIZE + offs, mask=ok, other=0.0)
    tl.store(out_ptr + zk.to(tl.int64) * SIZE + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


# ---------------------------------------------------------------------------------------
# Block importance and top-n selection
# ---------------------------------------------------------------------------------------


@triton.jit
def _zero_pad_cols(x, WIDTH: tl.constexpr):
    """``x: [BM, C]`` widened to ``[BM, WIDTH]`` (powers of two) with zero columns, in no
    particular column order."""
    for _ in tl.static_range(16):  # doublings; unrolled, so each may change the shape
        if x.shape[1] < WIDTH:
            x = tl.reshape(tl.join(x, tl.zeros_like(x)), [x.shape[0], 2 * x.shape[1]])
    return x


@triton.jit
def _merge_top(top, cand):
    """The largest ``TOPN_PAD`` keys per row of ``top: [BM, TOPN_PAD]`` (descending) and
    ``cand: [BM, BLOCK_S]``, descending, as ``[BM, TOPN_PAD]``. Keys are unique, 0 = empty.

    A bitonic top-k of the candidates alone, then one bitonic merge: the elementwise
    maximum of a descending and an ascending run holds the top of both as a bitonic
    sequence. Picking the row maximum TOPN times instead, a row reduction per pick, made
    the whole kernel 1.15x slower at 32 query heads on 2 kv heads, d = 64, n = 65536,
    top 16 of selection blocks of 64 (1.8x with a selection per query head).
    """
    width: tl.constexpr = max(top.shape[1], cand.shape[1])
    best = tl.topk(_zero_pad_cols(cand, width), top.shape[1])
    return bitonic_merge(tl.maximum(top, tl.flip(best, 1)), descending=True)


@triton.jit
def _merge_candidates(top, importance, blocks, selectable, TOPN: tl.constexpr):
    """``top: [R, TOPN_PAD]`` (``_merge_top``'s keys) with the ``selectable`` ones of
    ``blocks`` merged in by their ``importance: [R, BLOCK_S]`` (``blocks`` and
    ``selectable`` broadcast against it); no merge where none beats its row's weakest."""
    # Importances are >= 0 (the clamp removes rounding below 0), so their fp32 bit
    # patterns order like the values; the block index in the low word makes every key
    # unique. 0 marks "no candidate".
    score_bits = tl.maximum(importance, 0.0).to(tl.int32, bitcast=True).to(tl.int64) + 1
    cand = tl.where(selectable, (score_bits << 32) | blocks.to(tl.int64), 0)
    weakest = tl.min(tl.where(tl.arange(0, top.shape[1])[None, :] < TOPN, top, 0x7FFFFFFFFFFFFFFF), 1)
    if tl.max((tl.max(cand, 1) > weakest).to(tl.int32), 0) > 0:
        top = _merge_top(top, cand)
    return top


@triton.jit
def _head_probabilities(Q, z, head, stride_qz, stride_qh, stride_qm, lse_ptr, M, k, m_start, qk_scale,
                        BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
                        DOT_PRECISION: tl.constexpr):
    """``exp(s - lse)`` of query head ``head``'s rows against the tile's keys k."""
    q = _load_rows(head_pointer(Q, z, head, stride_qz, stride_qh), m_start, stride_qm, M, BLOCK_M, BLOCK_D, HEAD_DIM)
    lse = _load_lse_log2(lse_ptr, m_start + tl.arange(0, BLOCK_M), M)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    return tl.exp2(s * qk_scale - lse[:, None])


@triton.jit
def _overlap_operand(overlap, SPLIT_HALF: tl.constexpr):
    """The 0/1 ``overlap: [BLOCK_C, BLOCK_S]`` (bool) as ``_overlap_sums`` takes it. Converted
    where it is computed: converted inside ``_overlap_sums``, after the loop over the
    heads, the block selection read shared memory out of range on an H100 (Triton 3.6)."""
    dtype: tl.constexpr = tl.float16 if SPLIT_HALF else tl.float32
    return overlap.to(dtype)


@triton.jit
def _overlap_sums(p, overlap, acc, SPLIT_HALF: tl.constexpr):
    """``acc + p @ overlap`` for probabilities ``p: [R, BLOCK_C]`` and the 0/1 ``overlap:
    [BLOCK_C, BLOCK_S]`` (``_overlap_operand``). The dot's precision decides near-ties
    between blocks, so it keeps about float32's: SPLIT_HALF writes ``p = hi + lo`` as two
    fp16 terms (some 22 bits of p, two fp16 dots, the overlap exact); otherwise tf32x3."""
    if SPLIT_HALF:
        hi = p.to(tl.float16)
        lo = (p - hi.to(tl.float32)).to(tl.float16)
        acc = tl.dot(lo, overlap, tl.dot(hi, overlap, acc))
    else:
        acc = tl.dot(p, overlap, acc, input_precision="tf32x3")
    return acc


@triton.jit
def _chunk_importance(Q, z, first_head, stride_qz, stride_qh, stride_qm, lse_ptr, M, k,
                      comp_visible, overlap, m_start, qk_scale, acc,
                      HEADS_PER_SELECTION: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
                      SPLIT_HALF: tl.constexpr, DOT_PRECISION: tl.constexpr, UNROLL_HEADS: tl.constexpr):
    """Adds ``p @ overlap`` for one tile of compressed keys, ``p = exp(s - lse)`` (the
    forward's probabilities) summed over the heads that share the selection.

    The heads' probabilities are summed in the accumulator layout of ``q @ k^T`` before
    a single overlap dot per tile (a dot per head, each converting its ``p`` to an
    operand layout, made the kernel 1.24x slower at 16 heads). UNROLL_HEADS (decoding
    steps: a tile or two per program) unrolls the loop over the heads, so that their loads
    need not wait for one another."""
    p = tl.zeros([BLOCK_M, BLOCK_C], dtype=tl.float32)
    if UNROLL_HEADS:
        for g in tl.static_range(HEADS_PER_SELECTION):
            p += _head_probabilities(Q, z, first_head + g, stride_qz, stride_qh, stride_qm, lse_ptr + g * M, M, k,
                                     m_start, qk_scale, BLOCK_M, BLOCK_D, HEAD_DIM, DOT_PRECISION)
    else:
        for g in range(HEADS_PER_SELECTION):
            p += _head_probabilities(Q, z, first_head + g, stride_qz, stride_qh, stride_qm, lse_ptr + g * M, M, k,
                                     m_start, qk_scale, BLOCK_M, BLOCK_D, HEAD_DIM, DOT_PRECISION)
    return _overlap_sums(tl.where(comp_visible, p, 0.0), overlap, acc, SPLIT_HALF)


@triton.jit
def _store_selection(top, INDICES, MASK, SCORES, zs, rows, M, TOPN: tl.constexpr):
    """Unpacks the first TOPN keys of ``top: [BLOCK_M, TOPN_PAD]`` into the ``[Z * HS, M,
    TOPN]`` outputs of selection head ``zs``."""
    found = top > 0
    index = tl.where(found, top - ((top >> 32) << 32), 0)
    score = ((top >> 32) - 1).to(tl.int32).to(tl.float32, bitcast=True)
    score = tl.where(found, score, 0.0)
    slots = tl.arange(0, top.shape[1])
    offs = (zs.to(tl.int64) * M + rows[:, None]) * TOPN + slots[None, :]
    store_mask = (rows[:, None] < M) & (slots[None, :] < TOPN)
    tl.store(INDICES + offs, index, mask=store_mask)
    tl.store(MASK + offs, found, mask=store_mask)
    tl.store(SCORES + offs, score, mask=store_mask)


@triton.jit
def _document_blocks(doc_start_ptr, rows, M, visible, block_limit, STRIDE, SBS):
    """With documents, each row's candidates are the blocks overlapping its visible windows
    ``[comp_low, visible)``: ``[comp_low * STRIDE // SBS, block_limit)``, or none when no
    window lies inside the row's document (``block_limit`` alone would still count the
    blocks of earlier documents' windows). -> (comp_low, block_limit, first_block), the
    last the tile's first candidate, where its chunks start: rows late in short documents
    must not score every block before them."""
    comp_low = tl.cdiv(tl.load(doc_start_ptr + rows, mask=rows < M, other=0), STRIDE)
    block_limit = tl.where(comp_low < visible, block_limit, 0)
    first_block = tl.min(tl.where(rows < M, comp_low * STRIDE // SBS, 0x7FFFFFFF), 0)
    return comp_low, block_limit, tl.minimum(first_block, tl.max(block_limit, 0))


@triton.jit(do_not_specialize=(*_STEP_VARYING, "NSEL"))
def _select_blocks_kernel(
    Q, K, LSE, INDICES, MASK, SCORES, PARTIAL_TOP, DOC_START,
    stride_qz, stride_qh, stride_qm,
    stride_kz, stride_kh, stride_kn,
    HS, M, Q_START, Q_START_PTR, N, NUM_MEM, CBS, STRIDE, SBS, NSEL, qk_scale,
    GQA_SHARED_HEADS: tl.constexpr, HEADS_PER_SELECTION: tl.constexpr,
    HEAD_DIM: tl.constexpr, IS_CAUSAL: tl.constexpr, TOPN: tl.constexpr, TOPN_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr,
    S_STEP: tl.constexpr, NUM_C_TILES: tl.constexpr, BLOCK_D: tl.constexpr,
    SPLIT_HALF: tl.constexpr, Q_START_IN_MEMORY: tl.constexpr, PARTIAL_OUTPUT: tl.constexpr,
    HAS_DOCS: tl.constexpr, DOT_PRECISION: tl.constexpr, UNROLL_HEADS: tl.constexpr,
):
    # INDICES, MASK, SCORES: [Z, HS, M, TOPN], contiguous. Program (zs, tile, split)
    # scores the split-th of tl.num_programs(2) shares of the chunks of selection blocks;
    # with PARTIAL_OUTPUT it leaves its top in PARTIAL_TOP [splits, Z * HS, M, TOPN_PAD] for
    # _merge_partial_tops_kernel (the shares hold disjoint blocks, so keys stay unique).
    zs = tl.program_id(0)
    z, hs = zs // HS, zs % HS
    Q_START = start_position(Q_START, Q_START_PTR, Q_START_IN_MEMORY, z)
    m_start = (tl.num_programs(1) - 1 - tl.program_id(1)) * BLOCK_M
    NC = N - NUM_MEM
    first_head = hs * HEADS_PER_SELECTION
    k_ptr = head_pointer(K, z, first_head // GQA_SHARED_HEADS, stride_kz, stride_kh)
    lse_ptr = LSE + (z.to(tl.int64) * HS * HEADS_PER_SELECTION + first_head) * M

    rows = m_start + tl.arange(0, BLOCK_M)
    visible = _num_visible(Q_START + rows, NC, CBS, STRIDE, IS_CAUSAL)
    # Never the query's own block in causal mode.
    block_limit = tl.where(rows < M, _candidate_blocks(visible, CBS, STRIDE, SBS, NSEL), 0)
    own_block = (Q_START + rows) // SBS
    first_block = 0
    comp_low = visible  # unread without documents
    if HAS_DOCS:
        comp_low, block_limit, first_block = _document_blocks(DOC_START + z.to(tl.int64) * M, rows, M,
                                                              visible, block_limit, STRIDE, SBS)

    lanes = tl.arange(0, BLOCK_S)
    top = tl.zeros([BLOCK_M, TOPN_PAD], dtype=tl.int64)
    blocks_end = tl.max(block_limit, 0)
    split_blocks = tl.cdiv(tl.cdiv(blocks_end - first_block, S_STEP), tl.num_programs(2)) * S_STEP
    blocks_begin = first_block + tl.program_id(2) * split_blocks
    blocks_end = tl.minimum(blocks_end, blocks_begin + split_blocks)
    for block_start in range(blocks_begin, blocks_end, S_STEP):
        blocks = block_start + lanes
        block_used = (lanes < S_STEP) & (blocks < NSEL)
        token_start = block_start * SBS - CBS
        comp_start = tl.where(token_start >= 0, token_start // STRIDE + 1, 0)
        acc = tl.zeros([BLOCK_M, BLOCK_S], dtype=tl.float32)
        for tile in tl.static_range(NUM_C_TILES):
            comp = comp_start + tile * BLOCK_C + tl.arange(0, BLOCK_C)
            k = _load_rows(k_ptr, NUM_MEM + comp_start + tile * BLOCK_C, stride_kn, N,
                           BLOCK_C, BLOCK_D, HEAD_DIM)
            overlap = ((comp[:, None] * STRIDE < (blocks[None, :] + 1) * SBS)
                       & (blocks[None, :] * SBS < comp[:, None] * STRIDE + CBS)
                       & block_used[None, :] & (comp[:, None] < NC))
            overlap = _overlap_operand(overlap, SPLIT_HALF)
            comp_visible = comp[None, :] < visible[:, None]
            if HAS_DOCS:
                comp_visible = comp_visible & (comp[None, :] >= comp_low[:, None])
            acc = _chunk_importance(Q, z, first_head, stride_qz, stride_qh, stride_qm, lse_ptr,
                                    M, k, comp_visible, overlap, m_start, qk_scale, acc,
                                    HEADS_PER_SELECTION, BLOCK_M, BLOCK_C, BLOCK_D, HEAD_DIM,
                                    SPLIT_HALF, DOT_PRECISION, UNROLL_HEADS)

        selectable = block_used[None, :] & (blocks[None, :] < block_limit[:, None])
        if IS_CAUSAL:
            selectable &= blocks[None, :] != own_block[:, None]
        if HAS_DOCS:
            selectable &= blocks[None, :] >= (comp_low * STRIDE // SBS)[:, None]
        top = _merge_candidates(top, acc, blocks[None, :], selectable, TOPN)

    if PARTIAL_OUTPUT:
        slots = tl.arange(0, TOPN_PAD)
        part = (tl.program_id(2) * tl.num_programs(0) + zs).to(tl.int64) * M
        tl.store(PARTIAL_TOP + (part + rows[:, None]) * TOPN_PAD + slots[None, :], top,
                 mask=rows[:, None] < M)
    else:
        _store_selection(top, INDICES, MASK, SCORES, zs, rows, M, TOPN)


@triton.jit(do_not_specialize=("M", "SPLITS"))
def _merge_partial_tops_kernel(
    PARTIAL_TOP, INDICES, MASK, SCORES, M, SPLITS,
    TOPN: tl.constexpr, TOPN_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
    MAX_SPLITS: tl.constexpr,
):
    """The top of each row over the SPLITS (at most MAX_SPLITS, a power of two) partial
    tops ``_select_blocks_kernel`` left (same layouts as there), unpacked into the
    selection outputs, by one top-k over all of a row's candidates.

    Merging the shares one after another took 26 us for a decoding step's 34 on an H100
    (the scoring itself 19 us); the top-k over 16-row tiles, 79 us."""
    zs = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    lanes = tl.arange(0, MAX_SPLITS * TOPN_PAD)
    split, slot = lanes // TOPN_PAD, lanes % TOPN_PAD
    row_offs = (split[None, :] * tl.num_programs(0) + zs).to(tl.int64) * M + rows[:, None]
    cand = tl.load(PARTIAL_TOP + row_offs * TOPN_PAD + slot[None, :],
                   mask=(rows[:, None] < M) & (split[None, :] < SPLITS), other=0)
    _store_selection(tl.topk(cand, TOPN_PAD), INDICES, MASK, SCORES, zs, rows, M, TOPN)


# ---------------------------------------------------------------------------------------
# One query: the forward and the block selection in one pass over the keys
# ---------------------------------------------------------------------------------------


@triton.jit
def _one_query_softmax_step(acc, m_i, l_i, s, seen, owned, v, qk_scale, DOT_PRECISION: tl.constexpr):
    """``_online_softmax_step`` for a tile of one query's heads (``s: [HEADS_PAD,
    BLOCK_C]`` unscaled scores) whose ``owned`` keys go into the output and whose ``seen``
    keys (a superset) set the running maximum. -> (acc, m, l, p, alpha): ``p = exp(s -
    m)`` on the seen keys (0 elsewhere), and alpha, the factor that took everything
    accumulated before to the new maximum."""
    s = tl.where(seen[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    m_base = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_base)
    p = tl.exp2(s * qk_scale - m_base[:, None])
    p_owned = tl.where(owned[None, :], p, 0.0)
    l_i = l_i * alpha + tl.sum(p_owned, 1)
    acc = acc * alpha[:, None] + tl.dot(p_owned.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i, p, alpha


@triton.jit(do_not_specialize=("Q_START", "N", "NSEL", "NUM_CHUNKS"))
def _one_query_scores_kernel(
    Q, K, V, PARTIAL_OUT, PARTIAL_LSE, IMPORTANCE, CHUNK_BASE,
    stride_qz, stride_qh, stride_kz, stride_kh, stride_kn, stride_vz, stride_vh, stride_vn,
    HQ, Q_START, Q_START_PTR, N, NUM_MEM, CBS, STRIDE, SBS, NSEL, NUM_CHUNKS, qk_scale,
    GQA_SHARED_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    IS_CAUSAL: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr, S_STEP: tl.constexpr,
    NUM_C_TILES: tl.constexpr, BLOCK_D: tl.constexpr, Q_START_IN_MEMORY: tl.constexpr,
    SPLIT_HALF: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # One query (a decoding step) whose kv heads share their selection: program (z * HKV +
    # kv head, split) walks the split-th share of the chunks of candidate blocks with the
    # group's query heads as the rows of one tile, and from each tile of scores takes both
    # the forward's softmax step and the chunk's per-head block importances, so that the
    # scores are computed once. Chunks overlap by the keys that straddle their border:
    # each key's output share goes to the chunk of its first token's block.
    # PARTIAL_OUT: [splits, Z * HKV, HEADS_PAD, BLOCK_D] normalised outputs, PARTIAL_LSE
    # [splits, Z * HKV, HEADS_PAD] their base-2 LSEs (the memory keys in split 0's);
    # IMPORTANCE: [Z * HKV, NUM_CHUNKS, HEADS_PAD, BLOCK_S] each chunk's block importances
    # per head as exp2(s - CHUNK_BASE) sums, CHUNK_BASE [Z * HKV, NUM_CHUNKS, HEADS_PAD]:
    # the final LSE is not known until every share is done (_one_query_finish_kernel).
    zk = tl.program_id(0)
    hk = HQ // GQA_SHARED_HEADS
    z, kv_head = zk // hk, zk % hk
    Q_START = start_position(Q_START, Q_START_PTR, Q_START_IN_MEMORY, z)
    heads = tl.arange(0, HEADS_PAD)
    lanes = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    q = _heads_of_one_query(Q, z, kv_head * GQA_SHARED_HEADS, stride_qz, stride_qh, 0, 0, GQA_SHARED_HEADS,
                            HEADS_PAD, BLOCK_D, HEAD_DIM)
    k_ptr = head_pointer(K, z, kv_head, stride_kz, stride_kh)
    v_ptr = head_pointer(V, z, kv_head, stride_vz, stride_vh)
    visible = _num_visible(Q_START, N - NUM_MEM, CBS, STRIDE, IS_CAUSAL)
    chunks = tl.cdiv(_candidate_blocks(visible, CBS, STRIDE, SBS, NSEL), S_STEP)
    share = tl.cdiv(chunks, tl.num_programs(1))
    chunk_begin = tl.program_id(1) * share
    chunk_end = tl.minimum(chunk_begin + share, chunks)

    acc = tl.zeros([HEADS_PAD, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([HEADS_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([HEADS_PAD], dtype=tl.float32)
    for key_start in range(0, tl.where(tl.program_id(1) == 0, NUM_MEM, 0), BLOCK_C):
        memory = key_start + tl.arange(0, BLOCK_C) < NUM_MEM
        k = _load_rows(k_ptr, key_start, stride_kn, NUM_MEM, BLOCK_C, BLOCK_D, HEAD_DIM)
        v = _load_rows(v_ptr, key_start, stride_vn, NUM_MEM, BLOCK_C, BLOCK_D, HEAD_DIM)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        acc, m_i, l_i, _, _ = _one_query_softmax_step(acc, m_i, l_i, s, memory, memory, v, qk_scale,
                                                      DOT_PRECISION)
    for chunk in range(chunk_begin, chunk_end):
        block_start = chunk * S_STEP
        blocks = block_start + lanes
        token_start = block_start * SBS - CBS
        comp_start = tl.where(token_start >= 0, token_start // STRIDE + 1, 0)
        owned_begin = tl.cdiv(block_start * SBS, STRIDE)
        owned_end = tl.cdiv((block_start + S_STEP) * SBS, STRIDE)
        importance = tl.zeros([HEADS_PAD, BLOCK_S], dtype=tl.float32)
        for tile in tl.static_range(NUM_C_TILES):
            tile_start = comp_start + tile * BLOCK_C
            comp = tile_start + tl.arange(0, BLOCK_C)
            k = _load_rows(k_ptr, NUM_MEM + tile_start, stride_kn, N, BLOCK_C, BLOCK_D, HEAD_DIM)
            v = _load_rows(v_ptr, NUM_MEM + tile_start, stride_vn, N, BLOCK_C, BLOCK_D, HEAD_DIM)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
            seen = comp < visible
            owned = seen & (comp >= owned_begin) & (comp < owned_end)
            acc, m_i, l_i, p, alpha = _one_query_softmax_step(acc, m_i, l_i, s, seen, owned, v, qk_scale,
                                                              DOT_PRECISION)
            overlap = ((comp[:, None] * STRIDE < (blocks[None, :] + 1) * SBS)
                       & (blocks[None, :] * SBS < comp[:, None] * STRIDE + CBS) & (lanes < S_STEP)[None, :])
            importance = _overlap_sums(p, _overlap_operand(overlap, SPLIT_HALF), importance * alpha[:, None],
                                       SPLIT_HALF)
        chunk_row = zk.to(tl.int64) * NUM_CHUNKS + chunk
        tl.store(IMPORTANCE + (chunk_row * HEADS_PAD + heads[:, None]) * BLOCK_S + lanes[None, :], importance)
        tl.store(CHUNK_BASE + chunk_row * HEADS_PAD + heads, tl.where(m_i == float("-inf"), 0.0, m_i))

    has_keys = l_i > 0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    part = (tl.program_id(1).to(tl.int64) * tl.num_programs(0) + zk) * HEADS_PAD + heads
    tl.store(PARTIAL_OUT + part[:, None] * BLOCK_D + offs_d[None, :], out)
    tl.store(PARTIAL_LSE + part, lse)


@triton.jit
def _one_query_outputs(PARTIAL_OUT, PARTIAL_LSE, OUT, LSE, stride_oz, stride_oh, z, zk, first_head, m_base,
                       total, HQ, SPLITS, GQA_SHARED_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr,
                       HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """OUT and LSE of the group's heads from the shares' partials, share s weighing
    ``exp2(lse_s - m_base)`` of ``total``."""
    heads = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    out = tl.zeros([HEADS_PAD, BLOCK_D], dtype=tl.float32)
    for split in range(SPLITS):
        part = (split * tl.num_programs(0) + zk).to(tl.int64) * HEADS_PAD + heads
        weight = tl.exp2(tl.load(PARTIAL_LSE + part) - m_base)
        out += weight[:, None] * tl.load(PARTIAL_OUT + part[:, None] * BLOCK_D + offs_d[None, :])
    has_keys = total > 0
    out = out / tl.where(has_keys, total, 1.0)[:, None]
    lse = tl.where(has_keys, (m_base + tl.log2(tl.where(has_keys, total, 1.0))) / _KERNEL_LOG2E, float("-inf"))
    head_ok = heads < GQA_SHARED_HEADS
    o_ptr = OUT + z.to(tl.int64) * stride_oz + (first_head + heads)[:, None].to(tl.int64) * stride_oh
    tl.store(o_ptr + offs_d[None, :], out.to(OUT.dtype.element_ty),
             mask=head_ok[:, None] & (offs_d[None, :] < HEAD_DIM))
    tl.store(LSE + z.to(tl.int64) * HQ + first_head + heads, lse, mask=head_ok)


@triton.jit
def _one_query_top(IMPORTANCE, CHUNK_BASE, INDICES, MASK, SCORES, zk, lse, Q_START, N, NUM_MEM, CBS,
                   STRIDE, SBS, NSEL, NUM_CHUNKS, IS_CAUSAL: tl.constexpr, HEADS_PAD: tl.constexpr,
                   BLOCK_S: tl.constexpr, S_STEP: tl.constexpr, TOPN: tl.constexpr,
                   TOPN_PAD: tl.constexpr, CHUNK_ROWS: tl.constexpr):
    """The query's top-TOPN blocks from the chunks' importances, each head's scaled by
    ``exp2(CHUNK_BASE - lse)`` (``lse: [HEADS_PAD]`` base 2, +inf for heads that do not
    count). Row r of the tile keeps the top of chunks r, r + CHUNK_ROWS, ..., so that
    CHUNK_ROWS chunks are merged at once; one top-n over the rows' tops ends it."""
    heads = tl.arange(0, HEADS_PAD)
    lanes = tl.arange(0, BLOCK_S)
    rows = tl.arange(0, CHUNK_ROWS)
    block_limit = _candidate_blocks(_num_visible(Q_START, N - NUM_MEM, CBS, STRIDE, IS_CAUSAL), CBS, STRIDE,
                                    SBS, NSEL)
    chunks = tl.cdiv(block_limit, S_STEP)
    top = tl.zeros([CHUNK_ROWS, TOPN_PAD], dtype=tl.int64)
    for first_chunk in range(0, chunks, CHUNK_ROWS):
        chunk = first_chunk + rows
        chunk_ok = chunk < chunks
        chunk_row = zk.to(tl.int64) * NUM_CHUNKS + chunk
        base = tl.load(CHUNK_BASE + chunk_row[:, None] * HEADS_PAD + heads[None, :], mask=chunk_ok[:, None],
                       other=0.0)
        importance = tl.load(IMPORTANCE + (chunk_row[:, None, None] * HEADS_PAD + heads[None, :, None]) * BLOCK_S
                             + lanes[None, None, :], mask=chunk_ok[:, None, None], other=0.0)
        importance = tl.sum(importance * tl.exp2(base - lse[None, :])[:, :, None], 1)
        blocks = chunk[:, None] * S_STEP + lanes[None, :]
        selectable = chunk_ok[:, None] & (lanes < S_STEP)[None, :] & (blocks < block_limit)
        if IS_CAUSAL:
            selectable &= blocks != Q_START // SBS
        top = _merge_candidates(top, importance, blocks, selectable, TOPN)
    best = tl.topk(tl.reshape(top, [1, CHUNK_ROWS * TOPN_PAD]), TOPN_PAD)
    _store_selection(best, INDICES, MASK, SCORES, zk, tl.arange(0, 1), 1, TOPN)


@triton.jit(do_not_specialize=("Q_START", "N", "NSEL", "NUM_CHUNKS", "SPLITS"))
def _one_query_finish_kernel(
    PARTIAL_OUT, PARTIAL_LSE, IMPORTANCE, CHUNK_BASE, OUT, LSE, INDICES, MASK, SCORES,
    stride_oz, stride_oh,
    HQ, Q_START, Q_START_PTR, N, NUM_MEM, CBS, STRIDE, SBS, NSEL, NUM_CHUNKS, SPLITS,
    GQA_SHARED_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    IS_CAUSAL: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, S_STEP: tl.constexpr,
    TOPN: tl.constexpr, TOPN_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr, CHUNK_ROWS: tl.constexpr,
    Q_START_IN_MEMORY: tl.constexpr,
):
    # After _one_query_scores_kernel (its layouts): program (z * HKV + kv head, 0) merges
    # the shares' outputs into OUT [Z, HQ, 1, D] and LSE [Z, HQ, 1]; program (.., 1) picks
    # the selection [Z, HKV, 1, TOPN]. Both take the final LSE from the shares' LSEs.
    zk = tl.program_id(0)
    hk = HQ // GQA_SHARED_HEADS
    z = zk // hk
    heads = tl.arange(0, HEADS_PAD)
    splits = tl.arange(0, SPLITS_PAD)
    parts = (splits.to(tl.int64) * tl.num_programs(0) + zk) * HEADS_PAD
    share_lse = tl.load(PARTIAL_LSE + parts[:, None] + heads[None, :], mask=(splits < SPLITS)[:, None],
                        other=float("-inf"))
    m = tl.max(share_lse, 0)
    m_base = tl.where(m == float("-inf"), 0.0, m)
    total = tl.sum(tl.exp2(share_lse - m_base[None, :]), 0)
    if tl.program_id(1) == 0:
        _one_query_outputs(PARTIAL_OUT, PARTIAL_LSE, OUT, LSE, stride_oz, stride_oh, z, zk,
                           (zk % hk) * GQA_SHARED_HEADS, m_base, total, HQ, SPLITS, GQA_SHARED_HEADS, HEADS_PAD,
                           HEAD_DIM, BLOCK_D)
    else:
        Q_START = start_position(Q_START, Q_START_PTR, Q_START_IN_MEMORY, z)
        # Padding heads and heads without keys weigh nothing.
        counts = (heads < GQA_SHARED_HEADS) & (total > 0)
        lse = tl.where(counts, m_base + tl.log2(tl.where(counts, total, 1.0)), float("inf"))
        _one_query_top(IMPORTANCE, CHUNK_BASE, INDICES, MASK, SCORES, zk, lse, Q_START, N, NUM_MEM, CBS, STRIDE,
                       SBS, NSEL, NUM_CHUNKS, IS_CAUSAL, HEADS_PAD, BLOCK_S, S_STEP, TOPN, TOPN_PAD, CHUNK_ROWS)


# ---------------------------------------------------------------------------------------
# Host side
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Geometry:
    compress_block_size: int
    compress_stride: int
    num_mem: int
    causal: bool
    scale: float
    selection_block_size: int
    num_selected: int
    share_selection: bool
    # Position of query row 0; the backward kernels assume 0.
    q_offset: int = 0


@dataclass(frozen=True)
class _Launch:
    """Tiles and launch options of one kernel: ``block_m`` query rows, ``block_n`` keys
    (BLOCK_C, the compressed keys of a scoring tile, for the selection)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


# Per kernel on CUDA: the fastest of a few tile shapes timed on an H100 at the layer
# benchmark's configuration (n = 65536, 32 query heads on 2 kv heads, d = 64, bf16).
_CUDA_LAUNCH = {
    # The forward's 64 x 64 tiles in four warps and two stages (against 128 x 64 in
    # eight warps and three) and dQ's two stages (against three) ran as fast at
    # n = 65536 and faster at 8192 and 16384: forward 0.076 -> 0.069 ms, 0.217 -> 0.207;
    # dQ 0.094 -> 0.088 ms, 0.240 -> 0.230 (2.73 -> 2.71 at 65536).
    "forward": _Launch(64, 64, 4, 2),
    "backward_dq": _Launch(64, 64, 4, 2),
    # 32-row steps: with 64 the kernel needs more than the 255 registers a thread has and
    # spills (26 ms instead of 4.9 at n = 65536 once the query splits added a few live
    # values; 5.8 before them, already spilling). Eight warps, whose accumulators fit
    # 64- and 128-row steps or 256-key tiles, ran 1.35x-1.46x slower.
    "backward_dkdv": _Launch(32, 128, 4, 3),
    # dK / dV with the selection scores' gradient: its [BLOCK_J, BLOCK_M] and
    # [BLOCK_N, BLOCK_J] float32 dot operands overflow shared memory at 128-key tiles in
    # three stages, and in two those tiles ran 2x slower than these.
    "backward_dkdv_scores": _Launch(64, 64, 4, 3),
    "select": _Launch(64, 128, 4, 2),
    # Selections scored by a single query head: twice the chunks of 64-key tiles, but
    # half-width top-n merges, which then dominate (14.1 -> 11.7 ms with one selection
    # per query head).
    "select_one_head": _Launch(64, 64, 4, 2),
    # _one_query_scores_kernel: its rows are a query's heads, not BLOCK_M queries.
    "one_query": _Launch(16, 128, 4, 2),
}
# Rows wider than 64 bf16 values: fewer rows and stages keep the pipelined tiles inside
# shared memory (dK / dV also fewer keys: at d = 128 its 128-key tiles ran 1.7x slower).
_CUDA_LAUNCH_WIDE_ROWS = {
    "forward": _Launch(64, 64, 4, 2),
    "backward_dq": _Launch(64, 64, 4, 2),
    "backward_dkdv": _Launch(64, 64, 4, 2),
    "backward_dkdv_scores": _Launch(64, 64, 4, 2),
    "select": _Launch(64, 128, 4, 2),
    "select_one_head": _Launch(64, 128, 4, 2),  # not timed apart at these widths
    "one_query": _Launch(16, 128, 4, 2),
}
# Decoding steps and other forwards of at most this many query rows take tiles of
# _FEW_ROWS rows: a full tile would spend its dots and exponentials on padding.
_FEW_ROWS = 16
_FEW_ROWS_KERNELS = ("forward", "select", "select_one_head")
# Their stages where they differ from the kernel's: a decoding step's programs each walk
# one long chain of key tiles, bound by its latency, and the forward's keep three (at 64k
# cached tokens on an H100 an eager step's kernels took 0.415 ms with two, 0.403 with three).
_FEW_ROWS_STAGES = {"forward": 3}
# Most selection blocks scored per chunk: more lanes mean fewer top-n merges per row, but
# each merge then works on a wider [BLOCK_M, BLOCK_S] candidate tile.
_MAX_SELECTION_LANES = 32
# dK / dV programs per SM that the query splits aim for: as many as fit (255 registers a
# thread). Aiming for 4 made twice the float32 partials to write and sum for no more
# programs in flight: at n = 16384 in the layer benchmark's configuration on an H100 the
# pass and the sum of its partials took 0.435 ms against 0.369 ms.
_DKDV_PROGRAMS_PER_SM = 2
# Elements per program of the partials' sum.
_SUM_BLOCK = 256
# Forward programs per SM that splitting a few queries' work aims for (_few_rows_splits),
# and the most shares of one query tile's work.
_FEW_ROWS_PROGRAMS_PER_SM = 2
# Training-time block selections of too few (selection head, query tile) programs to fill
# the GPU split each tile's chunks the same way, for these many programs per SM, at most
# _MAX_SELECT_SPLITS shares. At the layer benchmark's n = 8192 on an H100 (256 programs:
# one wave, each as long as its row) the selection took 0.096 -> 0.076 ms plus 0.006 for
# the merge; aiming for 4 programs per SM split n = 16384 too, 0.196 -> 0.218 ms.
_SELECT_PROGRAMS_PER_SM = 2
_MAX_SELECT_SPLITS = 4
# Rows per program of the partial tops' merge.
_MERGE_ROWS = 64
_MAX_FEW_ROWS_SPLITS = 32
# Selections of at most this many queries (decoding steps) unroll their loop over the heads
# (``_chunk_importance``): in replayed decoding steps of the layer benchmark's layer on an
# H100 the selection took 10.7 -> 9.8 us at 4k cached tokens and 19.5 -> 17.4 us at 64k
# (the step 84.7 -> 78.5 us there), the same blocks.
_UNROLLED_HEADS_MAX_ROWS = _FEW_ROWS
# Forwards of one query (a decoding step's) whose kv heads are shared take the group's
# query heads as the rows of one tile: one dot per key tile for all of them. In replayed
# decoding steps of the layer benchmark's layer on an H100 (us, per head -> heads as
# rows): the selection 9.7 -> 4.9 and the forward 4.0 -> 3.4 at 4k cached tokens, 17.0 ->
# 7.5 and 10.2 -> 5.3 at 64k; the step 64.1 -> 56.7 and 79.5 -> 63.6, and 88.9 -> 75.7 for
# a batch of 8 at 16k. Where the group also shares its selection, the forward and the
# selection then became one pass over the keys (``_one_query_attend_and_select``): the
# step 59.3 -> 56.4 us at 4k, 69.0 -> 64.2 us for 8 at 16k, 64.1 -> 63.8 us at 64k, where
# the second kernel took 7.6 us (4 programs: the top-n of 34 chunks, and the outputs of
# 32 shares merged one share after another). Its top-n is what takes the time: merging
# each head's outputs in a program of its own, all shares at once, took it to 7.5 us, and
# a top-n that summed the heads one after another over all 34 chunks in a single round
# (64 chunk rows, no head axis in the tile) to 33.3 us (the step 63.9 -> 88.3 us).
_HEADS_AS_ROWS_MAX_ROWS = 1


def _launch(kernel: str, q: torch.Tensor) -> _Launch:
    """Launch options of ``kernel`` for queries like ``q`` ([b, h, n, d])."""
    if q.device.type != "cuda":
        # Interpreter: small tiles so that short test sequences still span several tiles.
        return _Launch(block_m=16, block_n=16, num_warps=1, num_stages=1)
    wide_rows = _block_d(q.shape[-1]) * q.element_size() > 128
    tiles = (_CUDA_LAUNCH_WIDE_ROWS if wide_rows else _CUDA_LAUNCH)[kernel]
    if q.shape[2] <= _FEW_ROWS and kernel in _FEW_ROWS_KERNELS:
        stages = tiles.num_stages if wide_rows else _FEW_ROWS_STAGES.get(kernel, tiles.num_stages)
        return dataclasses.replace(tiles, block_m=_FEW_ROWS, num_warps=min(tiles.num_warps, 4), num_stages=stages)
    return tiles


def _multiprocessors(device: torch.device) -> int:
    if device.type == "cuda":
        return multiprocessors(device)
    # Interpreter: a pretend GPU of two SMs, so that short test sequences split too.
    return 2


def _dkdv_query_splits(programs: int, row_tiles: int, device: torch.device) -> int:
    """QUERY_SPLITS of a dK / dV launch of ``programs`` (head, key tile) pairs over
    ``row_tiles`` query tiles: enough for ``_DKDV_PROGRAMS_PER_SM`` programs per SM, at
    most one per query tile. Without it a short sequence leaves most SMs idle (n = 8192 at
    the layer benchmark's 32 heads: 160 programs of up to 128 query tiles each)."""
    return _shares(programs, row_tiles, _DKDV_PROGRAMS_PER_SM, device)


def _few_rows_splits(rows: int, programs: int, parts: int, device: torch.device) -> int:
    """Programs that share the work of one query tile, for a forward launch of
    ``programs`` (head, query tile) pairs over ``rows`` queries whose longest row has
    ``parts`` pieces of work (key tiles, chunks of selection blocks), each share left as a
    partial result that a second kernel merges. Only forwards of at most _FEW_ROWS queries
    split: a decoding step is a handful of programs, each walking the whole cache.

    The launchers whose shares need a merge kernel of their own split only for queries
    whose position is read on the device, the steps that CUDA graphs replay. An eager step
    is bound by the host issuing its kernels: the merge kernels' launches made it 0.2-0.5 ms
    slower on an H100 (of about 2.5 ms), more than the split saved on the GPU. The
    one-query pass (``_one_query_attend_and_select``) splits in both, its second kernel
    running either way."""
    if rows > _FEW_ROWS:
        return 1
    return _shares(programs, parts, _FEW_ROWS_PROGRAMS_PER_SM, device, _MAX_FEW_ROWS_SPLITS)


def _shares(programs: int, parts: int, programs_per_sm: int, device: torch.device, most: int | None = None) -> int:
    """Into how many shares to split each of a launch's ``programs`` programs, whose
    longest has ``parts`` pieces of work, for ``programs_per_sm`` programs per SM: at
    least 1, at most ``parts`` and ``most``."""
    wanted = cdiv(programs_per_sm * _multiprocessors(device), max(programs, 1))
    return max(1, min(parts, wanted, parts if most is None else most))


def _allocate(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every buffer a kernel writes comes from here (tests poison it)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _block_d(head_dim: int) -> int:
    # tl.dot needs every dimension >= 16.
    return max(16, next_power_of_2(head_dim))


def _or_unread(tensor: torch.Tensor | None, stand_in: torch.Tensor) -> torch.Tensor:
    """``tensor``, or for an absent one ``stand_in``: any valid pointer does where the
    kernel's HAS_* flag keeps it unread."""
    return stand_in if tensor is None else tensor


def _launch_meta(tiles: _Launch, device: torch.device) -> dict:
    """An attention kernel's tiles and launch options on ``device``."""
    return dict(BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, num_warps=tiles.num_warps,
                num_stages=tiles.num_stages, **register_cap(device))


def _attention_forward(q, ck, cv, geo: _Geometry, position: torch.Tensor | None = None,
                       document_start: torch.Tensor | None = None):
    """q: [b, hq, n, d], ck, cv: [b, hk, N, d] -> (out [b, hq, n, d], lse [b, hq, n] fp32).

    ``position``: a ``[b]`` int64 device tensor holding each batch row's position of query
    row 0, read by the kernel in place of ``geo.q_offset``. ``document_start``: [b, n] int32
    contiguous when the rows pack documents (no ``position``, ``q_offset`` 0)."""
    b, hq, n, d = q.shape
    hk, num_keys = ck.shape[1], ck.shape[2]
    tiles = _launch("forward", q)
    out = _allocate((b, hq, n, d), q.dtype, q.device)
    lse = _allocate((b, hq, n), torch.float32, q.device)
    if n <= _HEADS_AS_ROWS_MAX_ROWS and hq > hk and document_start is None:
        _one_query_forward(q, ck, cv, out, lse, geo, position, tiles)
        return out, lse
    grid = (b * hq, cdiv(n, tiles.block_m))
    splits = 1
    if position is not None:
        splits = _few_rows_splits(n, math.prod(grid), cdiv(num_keys, tiles.block_n), q.device)
    if splits > 1:
        partial_out = _allocate((splits, b * hq, n, d), torch.float32, q.device)
        partial_lse = _allocate((splits, b * hq, n), torch.float32, q.device)
    else:
        partial_out, partial_lse = out, lse  # never read: any valid pointers do
    block_d = _block_d(d)
    start, start_ptr, in_memory = position_in_memory(geo.q_offset if position is None else position, lse)
    launch(_attention_fwd_kernel, (*grid, splits),
        row_tiles(q, tiles.block_m, block_d), row_tiles(ck, tiles.block_n, block_d),
        row_tiles(cv, tiles.block_n, block_d), out, lse, partial_out, partial_lse,
        _or_unread(document_start, lse), *head_strides(out), hq, n, start, start_ptr, num_keys,
        geo.num_mem, geo.compress_block_size, geo.compress_stride, geo.scale * LOG2E,
        GQA_SHARED_HEADS=hq // hk, HEAD_DIM=d, IS_CAUSAL=geo.causal, BLOCK_D=block_d,
        Q_START_IN_MEMORY=in_memory, PARTIAL_OUTPUT=splits > 1, HAS_DOCS=document_start is not None,
        DOT_PRECISION=dot_precision(q.dtype), **_launch_meta(tiles, q.device),
    )
    if splits > 1:
        _merge_partials(partial_out, partial_lse, out, lse, splits)
    return out, lse


def _merge_partials(partial_out, partial_lse, out, lse, splits: int) -> None:
    """``out: [b, hq, n, d]`` and ``lse: [b, hq, n]`` from the forward's ``splits`` partial
    outputs ``[splits, b * hq, n, d]`` and LSEs ``[splits, b * hq, n]`` (float32)."""
    b, hq, n, d = out.shape
    block_d = _block_d(d)
    if n == 1:
        # At 64k cached tokens a decoding step's 32 shares took 8.4 us to merge one after
        # another on an H100.
        launch(_merge_one_query_partials_kernel, (b * hq,),
            partial_out, partial_lse, out, lse, out.stride(0), out.stride(1), hq, splits,
            HEAD_DIM=d, BLOCK_D=block_d, SPLITS_PAD=next_power_of_2(splits), num_warps=4,
        )
        return
    merge_rows = next_power_of_2(n)
    launch(_merge_partial_outputs_kernel, (b * hq, cdiv(n, merge_rows)),
        partial_out, partial_lse, out, lse, *head_strides(out), hq, n, splits,
        HEAD_DIM=d, BLOCK_M=merge_rows, BLOCK_D=block_d, num_warps=4,
    )


def _one_query_forward(q, ck, cv, out, lse, geo: _Geometry, position: torch.Tensor | None, tiles: _Launch) -> None:
    """``_attention_forward`` of one query (q: [b, hq, 1, d]) whose kv heads are shared,
    into ``out`` and ``lse``: each kv head's query heads as the rows of one tile
    (``_one_query_fwd_kernel``), its key tiles split among programs where the position is
    read on the device (``_few_rows_splits``)."""
    b, hq, _, d = q.shape
    hk, num_keys = ck.shape[1], ck.shape[2]
    q = unit_stride_last(q)
    block_d = _block_d(d)
    splits = 1
    if position is not None:
        splits = _few_rows_splits(1, b * hk, cdiv(num_keys, tiles.block_n), q.device)
    start, start_ptr, in_memory = position_in_memory(geo.q_offset if position is None else position, lse)
    if splits > 1:
        partial_out = _allocate((splits, b * hq, 1, d), torch.float32, q.device)
        partial_lse = _allocate((splits, b * hq, 1), torch.float32, q.device)
    else:
        partial_out, partial_lse = out, lse  # never read: any valid pointers do
    launch(_one_query_fwd_kernel, (b * hk, 1, splits),
        q, row_tiles(ck, tiles.block_n, block_d), row_tiles(cv, tiles.block_n, block_d), out, lse, partial_out,
        partial_lse, q.stride(0), q.stride(1), out.stride(0), out.stride(1), hq, start, start_ptr, num_keys,
        geo.num_mem, geo.compress_block_size, geo.compress_stride, geo.scale * LOG2E,
        GQA_SHARED_HEADS=hq // hk, HEADS_PAD=max(16, next_power_of_2(hq // hk)), HEAD_DIM=d,
        IS_CAUSAL=geo.causal, BLOCK_N=tiles.block_n, BLOCK_D=block_d, Q_START_IN_MEMORY=in_memory,
        PARTIAL_OUTPUT=splits > 1, DOT_PRECISION=dot_precision(q.dtype), num_warps=tiles.num_warps,
        num_stages=tiles.num_stages, **register_cap(q.device),
    )
    if splits > 1:
        _merge_partials(partial_out, partial_lse, out, lse, splits)


def _keys_per_block(geo: _Geometry) -> int:
    """Most compressed keys that overlap one selection block."""
    return (geo.selection_block_size + geo.compress_block_size - 2) // geo.compress_stride + 1


def _blocks_per_key_tile(block_n: int, geo: _Geometry) -> int:
    """BLOCK_J: selection blocks that can overlap a tile of ``block_n`` compressed keys,
    padded for ``tl.dot``."""
    span = ((block_n - 1) * geo.compress_stride + geo.compress_block_size - 1) // geo.selection_block_size + 2
    return max(16, next_power_of_2(span))


def _query_and_key_tiles(q, dout, ck, cv, tiles: _Launch, block_d: int):
    """TMA descriptors of the backward kernels' tiles, in their argument order:
    (q, ck, cv, dout)."""
    return (row_tiles(q, tiles.block_m, block_d), row_tiles(ck, tiles.block_n, block_d),
            row_tiles(cv, tiles.block_n, block_d), row_tiles(dout, tiles.block_m, block_d))


def _attention_backward(dout, q, ck, cv, out, lse, geo: _Geometry, indices=None,
                        score_grad=None, document_start=None, document_end=None):
    """Gradients of ``_attention_forward``: (dq [b, hq, n, d] in q's memory order of heads
    and tokens, dck, dcv [b, hk, N, d], delta [b, hq, n] float32), where delta is the
    softmax-backward correction rowsum(dout * out) (plus the scores' rowsum(P * G) with
    ``score_grad``).

    ``score_grad: [b, hs, n, num_selected]`` (float32, 0 on masked slots), the gradient
    of the selection scores of ``indices``, adds their path through the probabilities.
    ``document_start``, ``document_end``: [b, n] int32 contiguous each, when the rows pack
    documents (both, or neither).
    """
    b, hq, n, d = q.shape
    hk, num_keys = ck.shape[1], ck.shape[2]
    assert geo.q_offset == 0, "the backward kernels take queries at positions 0 .. n - 1"
    has_score_grad = score_grad is not None
    dq_tiles = _launch("backward_dq", q)
    dkdv_tiles = _launch("backward_dkdv_scores" if has_score_grad else "backward_dkdv", q)
    block_d = _block_d(d)

    delta = _allocate((b, hq, n), torch.float32, q.device)
    if has_score_grad:
        # Each row's slots in ascending block order (what _score_grad_t relies on), slots
        # without a gradient moved last as the first block past the end, which overlaps
        # no compressed key. Slot-major, so that the kernels read one slot of a query
        # tile as one contiguous run instead of BLOCK_M strided elements.
        no_block = num_selection_blocks(n, geo.selection_block_size)
        blocks, order = torch.where(score_grad != 0, indices, no_block).to(torch.int32).sort(dim=-1)
        selection = (blocks.transpose(-1, -2).contiguous(),
                     score_grad.gather(-1, order).transpose(-1, -2).contiguous())
        selection_meta = dict(SCORE_GRAD=True, HEADS_PER_SELECTION=hq // indices.shape[1],
                              TOPN=indices.shape[-1])
    else:
        # Never read: any valid pointers do.
        selection = (lse, lse)
        selection_meta = dict(SCORE_GRAD=False, HEADS_PER_SELECTION=1, TOPN=1)
    geometry = (hq, n, num_keys, geo.num_mem, geo.compress_block_size, geo.compress_stride,
                geo.selection_block_size, geo.scale * LOG2E, geo.scale)
    meta = dict(GQA_SHARED_HEADS=hq // hk, IS_CAUSAL=geo.causal, HEAD_DIM=d, BLOCK_D=block_d,
                HAS_DOCS=document_start is not None, DOT_PRECISION=dot_precision(q.dtype),
                **selection_meta)

    # dQ first: it computes delta, which dK / dV read.
    dq = new_heads_tensor(q, is_tokens_major(q), lambda shape: _allocate(shape, q.dtype, q.device))
    dq_grid = (b * hq, cdiv(n, dq_tiles.block_m))
    # With documents the memory keys' dK, dV come from dQ's query tiles (_dq_memory_step).
    memory_parts = lse, lse  # never read: any valid pointers do
    if document_start is not None and geo.num_mem > 0:
        memory_parts = tuple(_allocate((b, hq, dq_grid[1], geo.num_mem, d), torch.float32, q.device)
                             for _ in range(2))
    launch(_attention_bwd_dq_kernel, dq_grid,
        *_query_and_key_tiles(q, dout, ck, cv, dq_tiles, block_d), row_tiles(out, dq_tiles.block_m, block_d),
        ck, lse, delta, *selection, _or_unread(document_start, lse), *memory_parts, dq, *head_strides(ck),
        *head_strides(dq), *geometry,
        KEYS_PER_BLOCK=_keys_per_block(geo), **meta, **_launch_meta(dq_tiles, q.device),
    )
    # Partials per query head and share of the rows, summed below over each group and
    # the shares: no atomics, deterministic.
    key_tiles = cdiv(num_keys, dkdv_tiles.block_n)
    splits = _dkdv_query_splits(b * hq * key_tiles, cdiv(n, dkdv_tiles.block_m), q.device)
    dk_part = _allocate((splits, b, hq, num_keys, d), torch.float32, q.device)
    dv_part = _allocate((splits, b, hq, num_keys, d), torch.float32, q.device)
    if num_keys > 0:
        launch(_attention_bwd_dkdv_kernel, (b * hq, key_tiles, splits),
            *_query_and_key_tiles(q, dout, ck, cv, dkdv_tiles, block_d), lse, delta, *selection,
            _or_unread(document_end, lse), dk_part, dv_part, *geometry,
            BLOCK_J=_blocks_per_key_tile(dkdv_tiles.block_n, geo), **meta,
            **_launch_meta(dkdv_tiles, q.device),
        )
    if memory_parts[0] is not lse:
        # dK / dV left the memory keys' rows 0.
        for part, memory_part in zip((dk_part, dv_part), memory_parts):
            part[0, :, :, :geo.num_mem] += memory_part.sum(2)
    dck = _allocate((b, hk, num_keys, d), ck.dtype, q.device)
    dcv = _allocate((b, hk, num_keys, d), cv.dtype, q.device)
    if num_keys > 0:
        # One pass over the partials with the cast: 0.007 ms at the layer benchmark's
        # n = 8192 and 0.026 ms at 65536 on an H100, where torch's strided sum and a cast
        # took 0.025 and 0.037 ms.
        size = num_keys * d
        launch(_sum_partials_kernel, (b * hk, cdiv(size, _SUM_BLOCK), 2),
            dk_part, dv_part, dck, dcv, size, PARTS=splits, GROUP=hq // hk, BLOCK=_SUM_BLOCK, num_warps=4,
        )
    return dq, dck, dcv, delta


def _chunk_layout(compress_block_size, compress_stride, selection_block_size, block_c: int):
    """(S_STEP, NUM_C_TILES, BLOCK_S): selection blocks per chunk, the compressed-key
    tiles that cover the compressed keys overlapping them (chosen to waste as few keys as
    possible), and the chunk's lanes, S_STEP padded to a power of two."""

    def span(num_blocks: int) -> int:
        # Upper bound on the compressed keys overlapping num_blocks consecutive blocks.
        return (num_blocks * selection_block_size + compress_block_size - 1) // compress_stride + 1

    num_c_tiles = math.ceil(span(1) / block_c)
    s_step = max(s for s in range(1, _MAX_SELECTION_LANES + 1) if span(s) <= num_c_tiles * block_c)
    return s_step, num_c_tiles, max(16, next_power_of_2(s_step))


def _select(q, ck, lse, geo: _Geometry, position: torch.Tensor | None = None,
            document_start: torch.Tensor | None = None) -> BlockSelection:
    """Top-``num_selected`` selection blocks per query from the forward's ``lse``.

    q: [b, hq, n, d] (at positions ``geo.q_offset ..``, or ``position ..``; ``document_start``
    as there: see ``_attention_forward``), ck: [b, hk, N, d], lse: [b, hq, n] ->
    BlockSelection of [b, hs, n, num_selected] tensors.
    """
    b, hq, n, d = q.shape
    hk, num_keys = ck.shape[1], ck.shape[2]
    hs = hk if geo.share_selection else hq
    shape = (b, hs, n, geo.num_selected)
    indices = _allocate(shape, torch.int64, q.device)
    mask = _allocate(shape, torch.bool, q.device)
    scores = _allocate(shape, torch.float32, q.device)
    if geo.num_selected == 0:
        return BlockSelection(indices, mask, scores)
    tiles = _launch("select" if hq > hs else "select_one_head", q)
    s_step, num_c_tiles, block_s = _chunk_layout(
        geo.compress_block_size, geo.compress_stride, geo.selection_block_size, tiles.block_n
    )
    if position is None:
        num_tokens = geo.q_offset + n
    else:
        # Past the last token any compressed key covers, which bounds the visible blocks.
        num_tokens = (num_keys - geo.num_mem) * geo.compress_stride + geo.compress_block_size
    num_blocks = num_selection_blocks(num_tokens, geo.selection_block_size)
    tops = (b * hs, cdiv(n, tiles.block_m))
    chunks = cdiv(num_blocks, s_step)
    if position is None:
        splits = _shares(math.prod(tops), chunks, _SELECT_PROGRAMS_PER_SM, q.device, _MAX_SELECT_SPLITS)
    else:
        splits = _few_rows_splits(n, math.prod(tops), chunks, q.device)
    # At least 2: triton 3.6 fails to compile tl.topk(x, 1) of a single-row x, the merge
    # of a one-query step's partial tops.
    topn_pad = max(2, next_power_of_2(geo.num_selected))
    # Never read without splits: any valid pointer does.
    partial_tops = indices if splits == 1 else _allocate((splits, b * hs, n, topn_pad), torch.int64, q.device)
    start, start_ptr, in_memory = position_in_memory(geo.q_offset if position is None else position, lse)
    launch(_select_blocks_kernel, (*tops, splits),
        q, ck, lse, indices, mask, scores, partial_tops, _or_unread(document_start, lse),
        *head_strides(q), *head_strides(ck),
        hs, n, start, start_ptr, num_keys, geo.num_mem, geo.compress_block_size, geo.compress_stride,
        geo.selection_block_size, num_blocks, geo.scale * LOG2E,
        GQA_SHARED_HEADS=hq // hk, HEADS_PER_SELECTION=hq // hs, HEAD_DIM=d,
        IS_CAUSAL=geo.causal, TOPN=geo.num_selected, TOPN_PAD=topn_pad,
        BLOCK_M=tiles.block_m, BLOCK_C=tiles.block_n, BLOCK_S=block_s,
        S_STEP=s_step, NUM_C_TILES=num_c_tiles, BLOCK_D=_block_d(d),
        SPLIT_HALF=q.dtype != torch.float32, Q_START_IN_MEMORY=in_memory,
        PARTIAL_OUTPUT=splits > 1, HAS_DOCS=document_start is not None,
        DOT_PRECISION=dot_precision(q.dtype), UNROLL_HEADS=n <= _UNROLLED_HEADS_MAX_ROWS,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        **register_cap(q.device),
    )
    if splits > 1:
        # Rows of their own, not the scoring tile's: a decoding step's merge is one row.
        merge_rows = min(next_power_of_2(n), _MERGE_ROWS)
        launch(_merge_partial_tops_kernel, (b * hs, cdiv(n, merge_rows)),
            partial_tops, indices, mask, scores, n, splits,
            TOPN=geo.num_selected, TOPN_PAD=topn_pad, BLOCK_M=merge_rows,
            MAX_SPLITS=_MAX_FEW_ROWS_SPLITS if position is not None else next_power_of_2(splits), num_warps=4,
        )
    return BlockSelection(indices, mask, scores)


def _fuses_one_query(q, ck, geo: _Geometry, document_start: torch.Tensor | None) -> bool:
    """Whether ``_one_query_attend_and_select`` takes this forward: one query whose kv
    heads are shared and share their selection, with blocks to select and no documents."""
    return (q.shape[2] == 1 and q.shape[1] > ck.shape[1] and geo.share_selection and geo.num_selected > 0
            and document_start is None)


def _one_query_attend_and_select(q, ck, cv, geo: _Geometry, position: torch.Tensor | None = None):
    """``_attention_forward`` and ``_select`` of one query (q: [b, hq, 1, d]) whose kv heads
    are shared and share their selection (``_fuses_one_query``), in two launches: the scores
    of each key tile serve both the softmax and the block importances
    (``_one_query_scores_kernel``, its chunks split among programs as ``_few_rows_splits``
    says), then the outputs and the top-n (``_one_query_finish_kernel``).

    -> (out [b, hq, 1, d], lse [b, hq, 1], BlockSelection of [b, hk, 1, num_selected])."""
    b, hq, _, d = q.shape
    hk, num_keys = ck.shape[1], ck.shape[2]
    group = hq // hk
    heads_pad = max(16, next_power_of_2(group))
    tiles = _launch("one_query", q)
    s_step, num_c_tiles, block_s = _chunk_layout(
        geo.compress_block_size, geo.compress_stride, geo.selection_block_size, tiles.block_n
    )
    if position is None:
        num_tokens = geo.q_offset + 1
    else:
        num_tokens = (num_keys - geo.num_mem) * geo.compress_stride + geo.compress_block_size
    num_blocks = num_selection_blocks(num_tokens, geo.selection_block_size)
    num_chunks = cdiv(num_blocks, s_step)
    splits = _few_rows_splits(1, b * hk, num_chunks, q.device)
    block_d = _block_d(d)
    partial_out = _allocate((splits, b * hk, heads_pad, block_d), torch.float32, q.device)
    partial_lse = _allocate((splits, b * hk, heads_pad), torch.float32, q.device)
    importance = _allocate((b * hk, max(num_chunks, 1), heads_pad, block_s), torch.float32, q.device)
    chunk_base = _allocate((b * hk, max(num_chunks, 1), heads_pad), torch.float32, q.device)
    out = _allocate((b, hq, 1, d), q.dtype, q.device)
    lse = _allocate((b, hq, 1), torch.float32, q.device)
    shape = (b, hk, 1, geo.num_selected)
    indices = _allocate(shape, torch.int64, q.device)
    mask = _allocate(shape, torch.bool, q.device)
    scores = _allocate(shape, torch.float32, q.device)
    start, start_ptr, in_memory = position_in_memory(geo.q_offset if position is None else position, lse)
    geometry = (hq, start, start_ptr, num_keys, geo.num_mem, geo.compress_block_size, geo.compress_stride,
                geo.selection_block_size, num_blocks, num_chunks)
    common = dict(GQA_SHARED_HEADS=group, HEADS_PAD=heads_pad, HEAD_DIM=d, IS_CAUSAL=geo.causal, BLOCK_S=block_s,
                  S_STEP=s_step, BLOCK_D=block_d, Q_START_IN_MEMORY=in_memory)
    launch(_one_query_scores_kernel, (b * hk, splits),
        q, ck, cv, partial_out, partial_lse, importance, chunk_base, q.stride(0), q.stride(1),
        *head_strides(ck), *head_strides(cv), *geometry, geo.scale * LOG2E,
        BLOCK_C=tiles.block_n, NUM_C_TILES=num_c_tiles, SPLIT_HALF=q.dtype != torch.float32,
        DOT_PRECISION=dot_precision(q.dtype), num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        **register_cap(q.device), **common,
    )
    # At least 2: triton 3.6 fails to compile tl.topk(x, 1) of a single-row x.
    topn_pad = max(2, next_power_of_2(geo.num_selected))
    launch(_one_query_finish_kernel, (b * hk, 2),
        partial_out, partial_lse, importance, chunk_base, out, lse, indices, mask, scores,
        out.stride(0), out.stride(1), *geometry, splits,
        TOPN=geo.num_selected, TOPN_PAD=topn_pad, SPLITS_PAD=next_power_of_2(splits),
        CHUNK_ROWS=max(1, 256 // heads_pad), num_warps=4, **common,
    )
    return out, lse, BlockSelection(indices, mask, scores)


def _fake_attend_and_select(q, ck, cv, compress_block_size, compress_stride, num_mem, causal, scale,
                            selection_block_size, num_selected, share_selection, q_offset=0,
                            document_start=None, document_end=None):
    b, hq, n, _ = q.shape
    shape = (b, ck.shape[1] if share_selection else hq, n, num_selected)
    return (q.new_empty(q.shape), q.new_empty((b, hq, n), dtype=torch.float32),
            q.new_empty(shape, dtype=torch.int64), q.new_empty(shape, dtype=torch.bool),
            q.new_empty(shape, dtype=torch.float32))


@launcher_op("compressed_attend_and_select", _fake_attend_and_select)
def _attend_and_select_forward(
    q: torch.Tensor, ck: torch.Tensor, cv: torch.Tensor, compress_block_size: int,
    compress_stride: int, num_mem: int, causal: bool, scale: float, selection_block_size: int,
    num_selected: int, share_selection: bool, q_offset: int = 0,
    document_start: torch.Tensor | None = None, document_end: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (out, lse, indices, mask, scores); the arguments from compress_block_size to
    q_offset are _Geometry's fields. ``document_start``, ``document_end``: [b, n] int32
    contiguous each when the rows pack documents (``q_offset`` 0, causal); the forward
    reads only the starts."""
    geo = _Geometry(compress_block_size, compress_stride, num_mem, causal, scale,
                    selection_block_size, num_selected, share_selection, q_offset)
    if _fuses_one_query(q, ck, geo, document_start):
        out, lse, selection = _one_query_attend_and_select(q, ck, cv, geo)
        return (out, lse, *selection)
    out, lse = _attention_forward(q, ck, cv, geo, document_start=document_start)
    return (out, lse, *_select(q, ck, lse, geo, document_start=document_start))


def _fake_attend_and_select_backward(dout, dscores, q, ck, cv, *_, **__):
    return (new_heads_tensor(q, is_tokens_major(q), q.new_empty), ck.new_empty(ck.shape),
            cv.new_empty(cv.shape), q.new_empty(q.shape[:3], dtype=torch.float32))


@launcher_op("compressed_attend_and_select_backward", _fake_attend_and_select_backward)
def _attend_and_select_backward(
    dout: torch.Tensor | None, dscores: torch.Tensor | None, q: torch.Tensor, ck: torch.Tensor,
    cv: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, indices: torch.Tensor,
    mask: torch.Tensor, compress_block_size: int, compress_stride: int, num_mem: int,
    causal: bool, scale: float, selection_block_size: int, num_selected: int,
    share_selection: bool, q_offset: int = 0, document_start: torch.Tensor | None = None,
    document_end: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (dq, dck, dcv, delta) from the gradients of out and of the selection scores;
    delta: ``_attention_backward``'s. Documents as in ``_attend_and_select_forward``, both
    bounds needed here."""
    if (document_start is None) != (document_end is None):
        raise ValueError("the backward needs both document_start and document_end, or neither")
    geo = _Geometry(compress_block_size, compress_stride, num_mem, causal, scale,
                    selection_block_size, num_selected, share_selection, q_offset)
    dout = torch.zeros_like(out) if dout is None else unit_stride_last(dout)
    score_grad = None
    if dscores is not None and dscores.numel() > 0:
        score_grad = torch.where(mask, dscores, 0.0).float()
    return _attention_backward(dout, q, ck, cv, out, lse, geo, indices, score_grad, document_start,
                               document_end)


class _CompressedAttendAndSelect(torch.autograd.Function):
    """Flash-style compressed attention and the fused block selection.

    Differentiable outputs: ``out`` and, when ``scores_require_grad``, the selection
    ``scores`` (both w.r.t. q, ck, cv); ``lse``, ``indices`` and ``mask`` are not.
    ``geometry``: _Geometry's fields; ``document_start``, ``document_end``: the packed
    documents' bounds or None (``_attend_and_select_forward``).
    """

    @staticmethod
    def forward(ctx, q, ck, cv, scores_require_grad, document_start, document_end, *geometry):
        out, lse, indices, mask, scores = _attend_and_select_forward(
            q, ck, cv, *geometry, document_start=document_start, document_end=document_end
        )
        ctx.save_for_backward(q, ck, cv, out, lse, indices, mask, document_start, document_end)
        ctx.geometry = geometry
        ctx.scores_require_grad = scores_require_grad
        ctx.mark_non_differentiable(lse, indices, mask)
        if not scores_require_grad:
            ctx.mark_non_differentiable(scores)
        ctx.set_materialize_grads(False)
        return out, lse, indices, mask, scores

    @staticmethod
    def backward(ctx, dout, _dlse, _dindices, _dmask, dscores):
        # Compiled graphs hand zeros, not None, for gradients nobody produced: a zero
        # dscores would still run the scores' (slower) backward path.
        if not ctx.scores_require_grad:
            dscores = None
        no_grads = (None,) * (3 + len(ctx.geometry))
        if dout is None and dscores is None:
            return None, None, None, *no_grads
        *saved, document_start, document_end = ctx.saved_tensors
        dq, dck, dcv, _ = _attend_and_select_backward(dout, dscores, *saved, *ctx.geometry,
                                                      document_start=document_start,
                                                      document_end=document_end)
        return dq, dck, dcv, *no_grads


def _reference_attend_and_select(q, ck, cv, geo: _Geometry, document_start=None):
    """The CPU path: the PyTorch reference, which materialises [n, nc] probabilities."""
    out, lse, probs = compressed_attend(
        q, ck, cv, geo.compress_block_size, geo.compress_stride, geo.num_mem,
        causal=geo.causal, scale=geo.scale, q_offset=geo.q_offset, return_probs=True,
        document_start=document_start,
    )
    hk, num_keys = ck.shape[1], ck.shape[2]
    n = q.shape[2]
    num_compressed = num_keys - geo.num_mem
    num_selection = num_selection_blocks(geo.q_offset + n, geo.selection_block_size)
    scores = selection_block_scores(
        probs[..., geo.num_mem:], geo.compress_block_size, geo.compress_stride,
        geo.selection_block_size, num_selection, kv_heads=hk if geo.share_selection else None,
    )
    selectable = selectable_blocks(
        n, geo.q_offset, num_compressed, geo.compress_block_size, geo.compress_stride,
        geo.selection_block_size, num_selection, geo.causal, q.device, document_start,
    )
    selection = select_blocks(scores.float(), selectable, geo.num_selected)
    return out, lse.float(), selection


def _use_kernels(device: torch.device) -> bool:
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def _check_positive(name: str, value, minimum: int = 1) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def _validate(q, ck, cv, compress_block_size, compress_stride, num_mem,
              selection_block_size, num_selected, scale, q_offset) -> None:
    for name, t in (("q", q), ("ck", ck), ("cv", cv)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-d tensor [b, h, len, d], got "
                             f"{getattr(t, 'shape', type(t))}")
        if t.dtype not in _SUPPORTED_DTYPES:
            raise ValueError(f"{name} must be bfloat16, float16 or float32, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
    b, hq, n, d = q.shape
    if n == 0:
        raise ValueError("q must hold at least one query")
    if cv.shape != ck.shape:
        raise ValueError(f"cv must have the shape of ck {tuple(ck.shape)}, got {tuple(cv.shape)}")
    if ck.dtype != q.dtype or cv.dtype != q.dtype:
        raise ValueError(f"ck and cv must have q's dtype {q.dtype}, got {ck.dtype}, {cv.dtype}")
    if ck.shape[0] != b or ck.shape[3] != d:
        raise ValueError(f"ck must be [b={b}, hk, len, d={d}], got {tuple(ck.shape)}")
    if ck.shape[1] == 0 or hq % ck.shape[1] != 0:
        raise ValueError(f"ck's {ck.shape[1]} heads must divide q's {hq} heads")
    if not 1 <= d <= _MAX_HEAD_DIM:
        raise ValueError(f"q's head dim must be in [1, {_MAX_HEAD_DIM}], got {d}")
    _check_positive("compress_block_size", compress_block_size)
    _check_positive("compress_stride", compress_stride)
    _check_positive("selection_block_size", selection_block_size)
    _check_positive("num_mem", num_mem, minimum=0)
    _check_positive("num_selected", num_selected, minimum=0)
    if compress_stride > compress_block_size:
        # Windows then leave gaps, and a block between two windows could be ranked
        # although no compressed key covers it.
        raise ValueError(f"compress_stride ({compress_stride}) must not exceed "
                         f"compress_block_size ({compress_block_size})")
    if num_mem > ck.shape[2]:
        raise ValueError(f"num_mem={num_mem} exceeds ck's {ck.shape[2]} keys")
    if scale is not None and not (isinstance(scale, (int, float)) and scale > 0):
        raise ValueError(f"scale must be a positive number or None, got {scale!r}")
    _check_positive("q_offset", q_offset, minimum=0)
    if q_offset and torch.is_grad_enabled() and any(t.requires_grad for t in (q, ck, cv)):
        raise ValueError(
            f"q_offset={q_offset} runs without gradients only (decoding, or prefills that continue "
            "a cache): call it under torch.no_grad() or with inputs that do not require grad"
        )


def _validated_documents(q, document_start, document_end, causal, q_offset):
    """(document_start, document_end) as the kernels read them, [b, n] int32 contiguous,
    or None without documents."""
    if document_start is None and document_end is None:
        return None
    if document_start is None or document_end is None:
        raise ValueError("document_start and document_end go together: pass both or neither")
    if not causal or q_offset:
        raise ValueError(f"document_start / document_end need causal queries at q_offset 0, got "
                         f"causal={causal}, q_offset={q_offset}")
    b, _, n, _ = q.shape
    for name, t in (("document_start", document_start), ("document_end", document_end)):
        if (not isinstance(t, torch.Tensor) or t.dtype.is_floating_point or t.dtype.is_complex
                or t.dtype == torch.bool):
            raise ValueError(f"{name} must be an integer tensor, got {getattr(t, 'dtype', type(t))}")
        if tuple(t.shape) != (b, n):
            raise ValueError(f"{name} must be [b={b}, n={n}], got {tuple(t.shape)}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
    return tuple(t.to(torch.int32).contiguous() for t in (document_start, document_end))


def compressed_attend_and_select(
    q: torch.Tensor,
    ck: torch.Tensor,
    cv: torch.Tensor,
    compress_block_size: int,
    compress_stride: int,
    num_mem: int,
    selection_block_size: int,
    num_selected: int,
    causal: bool = True,
    share_selection: bool = True,
    scale: float | None = None,
    scores_require_grad: bool = True,
    q_offset: int = 0,
    document_start: torch.Tensor | None = None,
    document_end: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, BlockSelection]:
    """Compressed-branch attention and the selection blocks it ranks, without ever
    materialising the ``[n, nc]`` probabilities.

    q: [b, hq, n, d] for queries at positions ``q_offset .. q_offset + n - 1`` (a
    ``q_offset`` above 0, for decoding steps, runs without gradients only);
    ck, cv: [b, hk, num_mem + nc, d]
    (memory keys first; compressed key ``c`` covers tokens
    ``[c * compress_stride, c * compress_stride + compress_block_size)``,
    ``compress_stride <= compress_block_size``), all of one dtype among bf16 / fp16 / fp32,
    ``d <= 128``, ``hq % hk == 0``.

    Returns ``out: [b, hq, n, d]`` (q's dtype), ``lse: [b, hq, n]`` float32 (``-inf`` for
    a query with no key, whose output is 0; not differentiable), and the
    ``BlockSelection`` of ``num_selected`` blocks of ``selection_block_size`` tokens per
    query, as ``selection.select_blocks`` defines it: ``[b, hs, n, num_selected]`` with
    ``hs = hk`` when ``share_selection`` (importance summed over the group) else ``hq``.
    ``out`` and the selection's ``scores`` (float32) are differentiable w.r.t. q, ck and
    cv, the scores through the probabilities they sum (what NSA's differentiable top-n
    needs); ``scores_require_grad=False`` detaches the scores, which also keeps compiled
    graphs off the scores' backward path. fp32 inputs take TF32 dots only where PyTorch's
    float32 matmuls would (``library.dot_precision``).

    ``document_start``, ``document_end``: ``[b, n]`` integer tensors (both or neither;
    ``documents.document_bounds``) when each row packs several documents, for causal
    queries at ``q_offset`` 0: the first token of each token's document and one past its
    last. A query then also needs ``c * compress_stride >= document_start`` to see
    compressed key ``c`` (memory keys stay visible), and ranks only the blocks that
    overlap the keys it sees.

    CUDA tensors (or any tensors with ``TRITON_INTERPRET=1``) run the Triton kernels;
    other CPU tensors fall back to the PyTorch reference and ``selection.py``, which do
    materialise ``[b, hq, n, nc]``.
    """
    _validate(q, ck, cv, compress_block_size, compress_stride, num_mem,
              selection_block_size, num_selected, scale, q_offset)
    documents = _validated_documents(q, document_start, document_end, causal, q_offset)
    document_start, document_end = (None, None) if documents is None else documents
    geometry = (compress_block_size, compress_stride, num_mem, bool(causal),
                float(q.shape[-1] ** -0.5 if scale is None else scale),
                selection_block_size, num_selected, bool(share_selection), q_offset)
    geo = _Geometry(*geometry)
    if not _use_kernels(q.device):
        out, lse, selection = _reference_attend_and_select(q, ck, cv, geo, document_start)
        if not scores_require_grad:
            selection = selection._replace(scores=selection.scores.detach())
        return out, lse, selection
    q, ck, cv = (unit_stride_last(t) for t in (q, ck, cv))
    out, lse, indices, mask, scores = _CompressedAttendAndSelect.apply(
        q, ck, cv, bool(scores_require_grad), document_start, document_end, *geometry
    )
    return out, lse, BlockSelection(indices, mask, scores)


def compressed_attend_and_select_at(
    q: torch.Tensor,
    ck: torch.Tensor,
    cv: torch.Tensor,
    position: torch.Tensor,
    compress_block_size: int,
    compress_stride: int,
    num_mem: int,
    selection_block_size: int,
    num_selected: int,
    share_selection: bool = True,
    scale: float | None = None,
) -> tuple[torch.Tensor, BlockSelection]:
    """``compressed_attend_and_select`` of causal queries at the positions that the int64
    tensor ``position: [b]`` holds (each batch row's first query), read on the device: a
    step that a CUDA graph replays. Forward only, on the kernels (CUDA, or ``TRITON_INTERPRET=1``), for
    inputs the caller has validated.

    q: [b, hq, m, d]; ck, cv: [b, hk, num_mem + capacity, d], whose compressed keys past
    those the queries see (by causality) may hold anything. Returns (out [b, hq, m, d],
    BlockSelection of [b, hs, m, num_selected] tensors).
    """
    geo = _Geometry(compress_block_size, compress_stride, num_mem, True,
                    float(q.shape[-1] ** -0.5 if scale is None else scale),
                    selection_block_size, num_selected, bool(share_selection))
    q, ck, cv = (unit_stride_last(t) for t in (q, ck, cv))
    if _fuses_one_query(q, ck, geo, None):
        out, _, selection = _one_query_attend_and_select(q, ck, cv, geo, position)
        return out, selection
    out, lse = _attention_forward(q, ck, cv, geo, position)
    return out, _select(q, ck, lse, geo, position)
