"""Triton kernels for NSA's selection branch. The sliding window's kernels
(``kernels/sliding_window.py``) run from the same operator: its forward tiles in this
module's forward launch, its backward next to this module's.

Notation (in the style of PyTorch's FlexAttention templates)
-----------------------------------------------------------
Q: query, K: key, V: value, O: output, DO: gradient of O, LSE: natural-log log-sum-exp
Z: batch size, HQ: query heads, HKV: kv heads, HS: selection heads (HKV or HQ)
N: sequence length (queries and keys alike), D: head dim
M, Q_START (forward only): queries and the position of the first; query row r sits at
    position Q_START + r, and the keys at 0 .. N - 1 (Q_START + M <= N). A decoding step
    reads Q_START on the device, one per batch row. The backward takes M = N and
    Q_START = 0.
D_PAD: D rounded up to a power of two (at least 16); the padded columns are masked
GQA_SHARED_HEADS: query heads per kv head (HQ // HKV)
SEL_SHARED_HEADS: query heads that share one selection row (HQ // HS, so GQA_SHARED_HEADS
    when the selection is per kv head, 1 when it is per query head)
ROWS: rows of a program's query tile: SEL_SHARED_HEADS padded up to 16, the smallest M
    of tl.dot; the padded rows load zeros and are never stored
SEL: selection slots per query; NUM_SETS: key sets per query (the own block when CAUSAL,
    then the SEL slots); SETS_PAD: NUM_SETS rounded up to a power of two
BLOCK_SIZE: tokens per selection block; FINE_N: keys per fine block, a multiple of 16
    dividing BLOCK_SIZE; TILES_PER_BLOCK: BLOCK_SIZE // FINE_N
CAUSAL: include_block_causal (also makes the window causal); SLIDING: the launch also
    runs the sliding window (its notation: ``kernels/sliding_window.py``, which also has
    HAS_DOCS, DOC_START and DOC_END: packed documents, which mask the window alone)
Entry: one (query i, selection head, key set) whose key set is a valid block; it owns
    SEL_SHARED_HEADS query rows. Key: one (batch z, kv head, key block), numbered
    (z * HKV + kv_head) * NUM_BLOCKS + block; NUM_KEYS of them.
    M: query rows per step of _dkv_kernel; CHUNK: most entries per _dkv_kernel program
ROW_STATS: ``[Z, N, HQ, 2]`` float32, per query row the base-2 LSE (+inf for a row
    without keys) and delta, which ``_dq_kernel`` leaves for ``_dkv_kernel``
STATS: ``[Z, HQ, N, NUM_SETS, TILES_PER_BLOCK, 2]`` float32, per query row and key tile
    the base-2 maximum and sum of exponentials of a key-major forward's first launch

Work decomposition
------------------
Query side: one program per (query position i, selection head, batch z). Its ROWS rows
are the query heads that read the same kv head and the same selected blocks at position
i, so each key tile is loaded once for the whole group. Every key set is walked as
TILES_PER_BLOCK fine blocks, so any multiple of 16 works as BLOCK_SIZE. (Several
positions per program, one warp each through a batched [positions, ROWS, D] dot, ran
1.6x-1.8x slower than one position per program at 32 heads on 2 kv heads on an H100.)

- ``_fwd_kernel``: online softmax over the key sets' tiles (a decoding step's in shares of
  the sets and of the window's key tiles, which run side by side and leave partial
  outputs for the gated sum to merge: ``selection_attention_partials_at``). With SLIDING
  the same launch can also run the window: its first NUM_WINDOW_TILES programs along axis 0 each take a
  window tile (``sliding_window.window_forward``), the others one query position each.
  Where the window wants other warps than the selection's one-warp programs, the kernel
  is launched twice instead, once for each kind of program: at 32 heads on 2 kv heads,
  d = 64, n = 65536, window 512, bf16 on an H100, the shared launch took 5.96 ms, the
  selection alone 4.22 ms and the window alone 0.96 ms in 8-warp tiles of 128 rows
  (1.56 ms in the shared launch's one-warp tiles of 32 rows). The window's launch then
  comes second, so that its tiles can also write the layer's gated sum of the three
  branches (``sliding_window._store_gated_sum``, for ``gate_combine.gated_branches``):
  at the layer benchmark's n = 65536 on an H100 that added 0.19 ms to the window's
  launch and spared the gated-sum kernel's 0.36 ms. Written by the one-warp selection
  programs instead, each reading its 16 heads' rows of the other two branches as 16
  separate 128-byte runs, the sum added 0.7 ms to their launch (1.0 ms with those rows
  loaded before the key loop).
- ``_dq_kernel``: recomputes P per tile; dQ stays in registers (the program owns all of
  its query's keys, so no atomics), dsel_scale is reduced per slot, and delta =
  rowsum(dO * O) is stored for the key side. With SLIDING it adds the window's dQ, which
  ``window_dq_kernel`` has left in a buffer of the input dtype. It also stores each
  row's base-2 LSE next to its delta, tokens-major (ROW_STATS), so that the key side
  loads both as one 8-byte run per row, an entry's heads side by side. (A float32 buffer, twice
  the bytes to write and read, kept one rounding fewer but cost 0.17-0.2 ms more at the
  layer benchmark's n = 65536 on an H100; the compressed branch's dQ reaches the sum of
  the branches rounded to the input dtype as well.) For selections shared by at most 8
  query heads the key side computes dQ instead (``ATOMIC_DQ``, below) and this pass
  keeps only delta, ROW_STATS and the zeroing.

Key side: a key block is selected by arbitrary queries, so no query-side program owns
its dK / dV. Adding them atomically from the query side costs one float32 atomic per
key element per (query, kv head): far more traffic than the keys themselves. Instead the
selection is inverted on the device (``kernels/selection_inverse.py``: a kernel labels
every entry with its key, a stable sort groups them; in the forward, beside its launches,
where a backward will follow), and

- ``_dkv_kernel``: one program per chunk of the entries of one key block, one fine tile
  of it per grid column. It gathers the entries' q and dO rows M at a time, keeps
  dK / dV of its keys in registers and adds them to float32 accumulators once, atomically
  (several chunks may share a block). Its rows' LSE and delta come as one [M, 2] tile of
  ROW_STATS per step. Read from two [Z, HQ, N] tensors, each step computed their
  pointers in the dots' layout and moved them through shared memory into the layout of
  the asynchronous copies: three barriers and 480 instructions per step of 32 rows
  against 293 (sm_90, triton 3.9), yet took the pass only from 3.60 to 3.47 ms at 32
  heads on 2 kv heads, d = 64 and n = 65536 on an H100 (the dQ pass's extra store:
  +0.02 ms): it waits on its gathers. With every dot taken out of its steps, it still
  took 2.83 of its 3.33 ms; without the exponentials, 3.36. Each step used to load its
  own entries, which made Triton's pipeliner issue the step's gathers only one step
  ahead and wait for every copy in flight at the top of each step. Loaded once per
  program instead, the entries leave the gathers free to go stages ahead: in 64-row
  steps of four stages, the pass took 3.30 -> 2.70 ms (0.420 -> 0.361 ms at n = 8192),
  and 2.58 ms (0.315) once the masked steps took 64 rows as well. Where q and dO outgrow
  L2 many times over, chunks launch in the order of the first query they gather
  (``selection_inverse.orders_chunks``), so that the programs running at the same
  time read q and dO rows of neighbouring queries: a working set
  that L2 holds where whole q and dO tensors may not (at 32 heads on 2 kv heads, d = 64
  and n = 65536, 5.00 -> 4.58 ms on an H100). Ordering the entries themselves by query
  phase did not pay: it cuts chunks short, and the atomic adds grow with their number.
  Computing dQ here as well (``ATOMIC_DQ``, ``LaunchConfig.atomic_dq``) spares
  ``_dq_kernel``'s second gather of the keys and values for a fifth dot per step and a
  float32 atomic add of each entry's dQ rows. The gather reads a kv head's blocks once
  for all the heads of its selection, the adds are per query head: at 32 heads on 2 kv
  heads (groups of 16), d = 64, n = 65536 the adds made the pass 4.05 ms slower, close to
  the 4.5 ms that ``_dq_kernel`` takes (``red.global.add.v4.f32``, four adds to an
  instruction, did not change that), while for groups of 8 and fewer they pay
  (``default_launch_config``). ``_dq_kernel`` then only leaves delta and ROW_STATS and
  zeroes the float32 dQ buffer, and ``window_dq_kernel``, run after this pass, adds the
  window's dQ to it and writes dQ.

With a window, ``window_dkv_kernel`` then adds these float32 accumulators to the window's
dK / dV and writes both in the input dtype; without one, the host casts them.

Float atomic adds land in whatever order the programs reach them, so their sums may
differ in the last bits from run to run. Under ``torch.use_deterministic_algorithms``
(``_Problem.deterministic``) no kernel adds floats atomically: the forward stays
query-side, dQ comes from ``_dq_kernel``, and ``_dkv_kernel`` (PARTIALS) stores each
chunk's dK / dV as a [BLOCK_SIZE, D] slab of its own, which ``_dkv_partials_kernel``
sums per key in chunk order. The slabs take 8 * BLOCK_SIZE * D bytes per chunk: with
256-entry chunks, about (17 / 4 * HS / HKV + 1) times the float32 dK and dV at the
layer benchmark's blocks of 64 and 16 selected.

``_key_major_fwd_kernel`` (``LaunchConfig.key_major_forward``) runs the forward on the
same table and grid, for small groups. The query-side forward loads a selected block's
keys and values for every query that selected it, for only SEL_SHARED_HEADS rows: at
4 heads on a kv head, d = 128, 32 KB of keys and values per entry feed 4 query rows.
Key-major, a program loads its key tile once and gathers the entries' q rows instead
(1 KB per entry there), twice: a first launch leaves each row's base-2 maximum and sum
of exponentials per (key set, tile) in STATS, ``_key_major_lse_kernel`` reduces them
to the rows' LSE, and a second launch adds the rows' normalised P V atomically to a
float32 output. The forward then needs the inverted table before its launches, which
it hands to the backward. The atomic adds grow with the heads of an entry, the
query-side loads do not, so large groups keep the query-side forward
(``default_launch_config``).

The forward, dQ and window kernels load their key and value tiles through TMA tensor
descriptors, which need no address arithmetic or load masks and write the tiles straight
to shared memory, where the dots read them: at 32 heads on 2 kv heads, d = 64, window
512, bf16 on an H100, n = 65536 (8192), the selection's forward took 4.17 -> 4.11 ms
(0.469 -> 0.441), its dQ pass 4.47 -> 4.37 ms (0.579 -> 0.52, see
``default_launch_config``), the window's forward 1.00 -> 0.93 ms (0.130 -> 0.123) and
its dQ 1.07 -> 0.96 ms (0.143 -> 0.128). The dK / dV passes gather rows of arbitrary
queries and keep pointers; the window's, which reads its steps' q and dO rows as
[positions, heads, D] boxes, ran 1.60 -> 1.65 ms with TMA.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from native_sparse_attention.kernels.attention_tiles import (
    LOG2E,
    backward_rows,
    dense_rows,
    dkv_ds_tile,
    dq_tile,
    load_tile,
    program_heads,
    softmax_tile,
    store_attention,
    strided_rows,
)
from native_sparse_attention.kernels.launch import launch
from native_sparse_attention.kernels.library import (
    cdiv, dot_precision, launcher_op, multiprocessors, next_power_of_2, position_in_memory, register_cap, row_tiles,
    side_by_side, start_position,
)
from native_sparse_attention.kernels.selection_inverse import (
    KeyBlockEntries, fake_key_block_entries, key_block_entries,
)
from native_sparse_attention.kernels.sliding_window import window_dkv_kernel, window_dq_kernel, window_forward

__all__ = ["LaunchConfig", "PartialOutputs", "default_launch_config", "selection_attention", "selection_attention_at",
           "selection_attention_partials_at"]

MIN_ROWS = 16  # tl.dot needs M, N and K of at least 16
FEW_QUERIES = 16  # forwards of at most this many queries: see default_launch_config
# Selections shared by at most this many query heads take their dQ from the dK / dV pass
# (LaunchConfig.atomic_dq; measured in default_launch_config's docstring).
ATOMIC_DQ_MAX_SHARED_HEADS = 8
# Training forwards of 2-byte selections shared by at most KEY_MAJOR_FORWARD_MAX_SHARED_HEADS
# query heads, in blocks of at least KEY_MAJOR_FORWARD_MIN_BLOCK keys, run key-major from
# KEY_MAJOR_FORWARD_MIN_QUERIES queries on (over the batch), up to d = 64 from twice as many
# (LaunchConfig.key_major_forward; measured in default_launch_config's docstring).
KEY_MAJOR_FORWARD_MAX_SHARED_HEADS = 4
KEY_MAJOR_FORWARD_MIN_BLOCK = 32
KEY_MAJOR_FORWARD_MIN_QUERIES = 2048
# Memory layouts of the [Z, HQ, N, D] rows that _dkv_kernel gathers (see _gathered_rows).
ROWS_STRIDED = tl.constexpr(0)
ROWS_HEADS_MAJOR = tl.constexpr(1)  # contiguous [Z, HQ, N, D]
ROWS_TOKENS_MAJOR = tl.constexpr(2)  # a [Z, N, HQ, D] tensor with its head and token dims swapped


# ----------------------------------------------------------------------------- helpers


@triton.jit
def _key_sets(
    SEL_IDX, SEL_MASK, SEL_SCALE, sel_row, i, N,
    SEL: tl.constexpr, NUM_SETS: tl.constexpr, SETS_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    HAS_SEL_SCALE: tl.constexpr,
):
    """The query's NUM_SETS key sets in registers, [SETS_PAD] each: the own block first
    when causal (NUM_SETS = SEL + 1), then one set per slot. Returns the block index, the
    logit multiplier, each set's place among the sets that hold keys (-1 for a masked
    slot, a negative index or a block past the end) and the number of those sets.

    Loading them before the key loop leaves the loop's key / value loads depending on
    registers only, which lets the compiler prefetch them stages ahead. The loop walks the
    sets that hold keys alone: a query with fewer selectable blocks than slots (the first
    SEL * BLOCK_SIZE positions of a causal sequence) leaves some slots masked.
    """
    sets = tl.arange(0, SETS_PAD)
    slot = sets - (NUM_SETS - SEL)
    is_slot = (slot >= 0) & (slot < SEL)
    block = tl.load(SEL_IDX + sel_row + slot, mask=is_slot, other=-1).to(tl.int64)
    on = tl.load(SEL_MASK + sel_row + slot, mask=is_slot, other=0) != 0
    block = tl.where(on & (block >= 0), tl.minimum(block, N // BLOCK_SIZE + 1), -1).to(tl.int32)
    if NUM_SETS > SEL:
        block = tl.where(sets == 0, i // BLOCK_SIZE, block)
    if HAS_SEL_SCALE:
        multiplier = tl.load(SEL_SCALE + sel_row + slot, mask=is_slot, other=1.0).to(tl.float32)
    else:
        multiplier = tl.full([SETS_PAD], 1.0, tl.float32)
    has_keys = (block >= 0) & (block < tl.cdiv(N, BLOCK_SIZE))
    order = tl.where(has_keys, tl.cumsum(has_keys.to(tl.int32), 0) - 1, -1)
    return block, multiplier, order, tl.sum(has_keys.to(tl.int32), 0)


@triton.jit
def _pick(values, order, s):
    """The element of a [SETS_PAD] register vector whose ``order`` is s, as a scalar."""
    return tl.sum(tl.where(order == s, values, 0), 0)


@triton.jit
def _set_tile(K_TILES, V_TILES, z, kv_head, blocks, multipliers, order, t, offs_n, key_end, BLOCK_SIZE: tl.constexpr,
              FINE_N: tl.constexpr, D_PAD: tl.constexpr):
    """The t-th FINE_N-key tile of the key sets that hold keys, taken in ``order``: its keys
    and values (through the TMA descriptors K_TILES, V_TILES of [Z, HKV, N, D]; positions
    past N read as zeros), their validity and the set's logit multiplier."""
    TILES_PER_BLOCK: tl.constexpr = BLOCK_SIZE // FINE_N
    s = t // TILES_PER_BLOCK
    start = _pick(blocks, order, s) * BLOCK_SIZE + (t % TILES_PER_BLOCK) * FINE_N
    k = K_TILES.load([z, kv_head, start, 0]).reshape(FINE_N, D_PAD)
    v = V_TILES.load([z, kv_head, start, 0]).reshape(FINE_N, D_PAD)
    return k, v, start + offs_n < key_end, _pick(multipliers, order, s)


# ----------------------------------------------------------------------------- forward


@triton.jit
def _selection_forward(
    Q, K_TILES, V_TILES, SEL_IDX, SEL_MASK, SEL_SCALE, O, LSE, r, split, z, sel_head, kv_head, first_head,
    stride_qz, stride_qh, stride_qn, stride_qd,
    M, Q_START, N, HQ, HS, scale2,
    SEL: tl.constexpr, NUM_SETS: tl.constexpr, SETS_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, FINE_N: tl.constexpr,
    SEL_SHARED_HEADS: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_SEL_SCALE: tl.constexpr, DOT_PRECISION: tl.constexpr, SPLITS: tl.constexpr,
):
    """Selected attention of query row ``r`` (position ``Q_START + r``) for the program's
    ROWS query heads; K_TILES, V_TILES: TMA descriptors of [FINE_N, D_PAD] key and value
    tiles. Over share ``split`` of the SPLITS shares of the row's key sets that hold keys
    (whole sets, as even as they divide; a share without any stores 0 and an LSE of -inf),
    into O [Z, HQ, SPLITS, M, D] and LSE [Z, HQ, SPLITS, M]."""
    TILES_PER_BLOCK: tl.constexpr = BLOCK_SIZE // FINE_N
    i = Q_START + r
    rows = tl.arange(0, ROWS)
    heads = first_head + rows
    row_ok = rows < SEL_SHARED_HEADS
    offs_n = tl.arange(0, FINE_N)
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < D
    q = load_tile(Q, strided_rows(z, heads, r, stride_qz, stride_qh, stride_qn), row_ok, offs_d, d_ok, stride_qd)
    sel_row = ((z.to(tl.int64) * HS + sel_head) * M + r) * SEL

    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, D_PAD], tl.float32)
    blocks, multipliers, order, num_sets = _key_sets(SEL_IDX, SEL_MASK, SEL_SCALE, sel_row, i, N, SEL, NUM_SETS,
                                                     SETS_PAD, BLOCK_SIZE, HAS_SEL_SCALE)
    key_end = i + 1 if CAUSAL else N
    first_set, end_set = split * num_sets // SPLITS, (split + 1) * num_sets // SPLITS
    for t in range(first_set * TILES_PER_BLOCK, end_set * TILES_PER_BLOCK):
        k, v, key_ok, multiplier = _set_tile(K_TILES, V_TILES, z, kv_head, blocks, multipliers, order, t, offs_n,
                                             key_end, BLOCK_SIZE, FINE_N, D_PAD)
        m_i, l_i, acc = softmax_tile(q, k, v, key_ok[None, :], scale2 * multiplier, m_i, l_i, acc, DOT_PRECISION)
    share = heads * SPLITS + split
    out_rows = dense_rows(z, share, r, HQ * SPLITS, M, D)
    lse_rows = (z.to(tl.int64) * HQ * SPLITS + share) * M + r
    store_attention(O, LSE, acc, m_i, l_i, out_rows, lse_rows, row_ok, offs_d, d_ok)


# Decoding steps change M, Q_START and N with every token. Triton would compile a variant
# per divisibility by 16 (and for the value 1) of each; no address here gains from it.
@triton.jit(do_not_specialize=("M", "Q_START", "N"))
def _fwd_kernel(
    Q, K_TILES, V_TILES, WINDOW_K_TILES, WINDOW_V_TILES, SEL_IDX, SEL_MASK, SEL_SCALE, O, LSE, SWA_O, SWA_LSE,
    GATES, OUT_C, MERGED, DOC_START,
    stride_qz, stride_qh, stride_qn, stride_qd,
    stride_gk, stride_gz, stride_gh, stride_gn,
    M, Q_START, Q_START_PTR, N, HQ, HS, NUM_WINDOW_TILES, sm_scale,
    SEL: tl.constexpr, NUM_SETS: tl.constexpr, SETS_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, FINE_N: tl.constexpr,
    SEL_SHARED_HEADS: tl.constexpr, GQA_SHARED_HEADS: tl.constexpr, ROWS: tl.constexpr,
    D: tl.constexpr, D_PAD: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_SEL_SCALE: tl.constexpr,
    SLIDING: tl.constexpr, WINDOW: tl.constexpr, HEADS_PAD: tl.constexpr, WINDOW_ROWS: tl.constexpr,
    WINDOW_N: tl.constexpr, GATED: tl.constexpr, DOT_PRECISION: tl.constexpr, Q_START_IN_MEMORY: tl.constexpr,
    HAS_DOCS: tl.constexpr, SPLITS: tl.constexpr, WINDOW_SPLITS: tl.constexpr,
):
    """Programs [0, NUM_WINDOW_TILES * WINDOW_SPLITS) of axis 0 run the WINDOW_SPLITS
    shares of each window tile, program ``tile * WINDOW_SPLITS + share`` (only with
    SLIDING: they read the keys and values through the TMA descriptors WINDOW_K_TILES and
    WINDOW_V_TILES; SWA_O and SWA_LSE hold each share's output, ``window_forward``), the
    others the SPLITS shares of each query row of the selection, program
    ``NUM_WINDOW_TILES * WINDOW_SPLITS + row * SPLITS + share`` (through K_TILES and
    V_TILES, of FINE_N-key tiles; O and LSE hold each share's output,
    ``_selection_forward``). GATED (a launch of window tiles alone, after the selection's,
    in one share): the window tiles also write the layer's gated sum MERGED [Z, M, HQ * D]
    from GATES [3, Z, HQ, M] (any strides), the compressed branch's OUT_C and the
    selection's O (``window_forward``). HAS_DOCS: the
    window tiles keep to the documents of DOC_START [Z, M]; the selection needs no mask,
    its blocks lying in the query's document."""
    pid = tl.program_id(0)
    z, sel_head, kv_head, first_head = program_heads(SEL_SHARED_HEADS, GQA_SHARED_HEADS)
    Q_START = start_position(Q_START, Q_START_PTR, Q_START_IN_MEMORY, z)
    scale2 = sm_scale * LOG2E
    if pid < NUM_WINDOW_TILES * WINDOW_SPLITS:
        if SLIDING:
            window_forward(
                Q, WINDOW_K_TILES, WINDOW_V_TILES, SWA_O, SWA_LSE, pid // WINDOW_SPLITS, pid % WINDOW_SPLITS, z,
                kv_head, first_head,
                stride_qz, stride_qh, stride_qn, stride_qd, M, Q_START, N, HQ, scale2,
                GATES, OUT_C, O, MERGED, stride_gk, stride_gz, stride_gh, stride_gn, DOC_START,
                SEL_SHARED_HEADS, HEADS_PAD, WINDOW_ROWS, WINDOW_N, D, D_PAD, CAUSAL, WINDOW, GATED, DOT_PRECISION,
                HAS_DOCS, WINDOW_SPLITS,
            )
    else:
        program = pid - NUM_WINDOW_TILES * WINDOW_SPLITS
        _selection_forward(
            Q, K_TILES, V_TILES, SEL_IDX, SEL_MASK, SEL_SCALE, O, LSE, program // SPLITS, program % SPLITS, z,
            sel_head, kv_head, first_head, stride_qz, stride_qh, stride_qn, stride_qd, M, Q_START, N, HQ, HS, scale2,
            SEL, NUM_SETS, SETS_PAD, BLOCK_SIZE, FINE_N, SEL_SHARED_HEADS, ROWS, D, D_PAD, CAUSAL, HAS_SEL_SCALE,
            DOT_PRECISION, SPLITS,
        )


# ----------------------------------------------------------------------------- backward


@triton.jit
def _dq_kernel(
    Q, K_TILES, V_TILES, O, DO, LSE, SEL_IDX, SEL_MASK, SEL_SCALE, DQ, DSEL, DELTA, ROW_STATS, DQ_WINDOW,
    DK_ACC, DV_ACC,
    stride_qz, stride_qh, stride_qn, stride_qd,
    stride_doz, stride_doh, stride_don, stride_dod,
    N, HQ, HS, sm_scale,
    SEL: tl.constexpr, NUM_SETS: tl.constexpr, SETS_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, FINE_N: tl.constexpr,
    SEL_SHARED_HEADS: tl.constexpr, GQA_SHARED_HEADS: tl.constexpr, ROWS: tl.constexpr,
    D: tl.constexpr, D_PAD: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_SEL_SCALE: tl.constexpr, SLIDING: tl.constexpr, ATOMIC_DQ: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """dQ, dsel_scale and delta (also into ROW_STATS, with the base-2 LSE) of the
    selection for query position ``program_id(0)``; with SLIDING, dQ also gets the
    window's part from the buffer DQ_WINDOW. K_TILES, V_TILES: TMA descriptors of
    [FINE_N, D_PAD] key and value tiles.

    It also zeroes row ``program_id(0)`` of its kv head in DK_ACC and DV_ACC ([Z, HKV, N, D]
    float32), the accumulators that ``_dkv_kernel`` adds to next, which spares a fill
    kernel (0.02 ms at 2 kv heads, d = 64, n = 65536 on an H100) for stores the pass
    hides: it took 4.44-4.48 against 4.45-4.46 ms there, 0.529-0.531 against
    0.525-0.531 ms at 8192.

    ATOMIC_DQ: ``_dkv_kernel`` adds the selection's dQ instead; this program only leaves
    delta and ROW_STATS, zeroes the accumulators, its rows of DQ ([Z, HQ, N, D] float32)
    among them, and walks no keys."""
    i = tl.program_id(0)
    z, sel_head, kv_head, first_head = program_heads(SEL_SHARED_HEADS, GQA_SHARED_HEADS)
    rows = tl.arange(0, ROWS)
    heads = first_head + rows
    row_ok = rows < SEL_SHARED_HEADS
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < D
    q, do, delta, lse2, out_rows = backward_rows(
        Q, O, DO, LSE, DELTA, z, heads, i, row_ok, stride_qz, stride_qh, stride_qn, stride_qd,
        stride_doz, stride_doh, stride_don, stride_dod, N, HQ, D, D_PAD,
    )
    tl.store(ROW_STATS + _row_stats_offsets(z, heads, i, N, HQ), tl.join(lse2, delta), mask=row_ok[:, None])
    if ATOMIC_DQ:
        tl.store(DQ + out_rows[:, None] + offs_d[None, :], tl.zeros([ROWS, D_PAD], tl.float32),
                 mask=row_ok[:, None] & d_ok[None, :])
    else:
        _selection_dq(K_TILES, V_TILES, SEL_IDX, SEL_MASK, SEL_SCALE, DQ, DSEL, DQ_WINDOW, q, do, lse2, delta, out_rows,
                      z, sel_head, kv_head, i, row_ok, offs_d, d_ok, N, HS, sm_scale, SEL, NUM_SETS, SETS_PAD,
                      BLOCK_SIZE, FINE_N, ROWS, D_PAD, CAUSAL, HAS_SEL_SCALE, SLIDING, DOT_PRECISION)
    if first_head % GQA_SHARED_HEADS == 0:  # one program per (z, kv head, position)
        acc_row = dense_rows(z, kv_head, i, HQ // GQA_SHARED_HEADS, N, D)
        zeros = tl.zeros([D_PAD], tl.float32)
        tl.store(DK_ACC + acc_row + offs_d, zeros, mask=d_ok)
        tl.store(DV_ACC + acc_row + offs_d, zeros, mask=d_ok)


@triton.jit
def _selection_dq(
    K_TILES, V_TILES, SEL_IDX, SEL_MASK, SEL_SCALE, DQ, DSEL, DQ_WINDOW, q, do, lse2, delta, out_rows,
    z, sel_head, kv_head, i, row_ok, offs_d, d_ok, N, HS, sm_scale,
    SEL: tl.constexpr, NUM_SETS: tl.constexpr, SETS_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, FINE_N: tl.constexpr,
    ROWS: tl.constexpr, D_PAD: tl.constexpr, CAUSAL: tl.constexpr, HAS_SEL_SCALE: tl.constexpr,
    SLIDING: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """``_dq_kernel``'s walk over the key sets of query ``i``: dQ (plus the window's from
    DQ_WINDOW with SLIDING) into DQ, dsel_scale into DSEL."""
    TILES_PER_BLOCK: tl.constexpr = BLOCK_SIZE // FINE_N
    offs_n = tl.arange(0, FINE_N)
    sel_row = ((z.to(tl.int64) * HS + sel_head) * N + i) * SEL
    scale2 = sm_scale * LOG2E

    dq = tl.zeros([ROWS, D_PAD], tl.float32)
    blocks, multipliers, order, num_sets = _key_sets(SEL_IDX, SEL_MASK, SEL_SCALE, sel_row, i, N, SEL, NUM_SETS,
                                                     SETS_PAD, BLOCK_SIZE, HAS_SEL_SCALE)
    sets = tl.arange(0, SETS_PAD)
    dsel = tl.zeros([SETS_PAD], tl.float32)
    key_end = i + 1 if CAUSAL else N
    for t in range(0, num_sets * TILES_PER_BLOCK):
        k, v, key_ok, multiplier = _set_tile(K_TILES, V_TILES, z, kv_head, blocks, multipliers, order, t, offs_n,
                                             key_end, BLOCK_SIZE, FINE_N, D_PAD)
        if HAS_SEL_SCALE:
            dq, dmult = dq_tile(q, do, lse2, delta, k, v, key_ok[None, :], scale2 * multiplier,
                                sm_scale * multiplier, dq, DOT_PRECISION)
            dsel += tl.where(order == t // TILES_PER_BLOCK, dmult, 0.0)
        else:
            # Without multipliers d(logit)/d(q.k) is sm_scale for every tile: dQ takes it
            # once, after the loop, instead of a multiply per score.
            dq, _ = dq_tile(q, do, lse2, delta, k, v, key_ok[None, :], scale2, 1.0, dq, DOT_PRECISION)
    if HAS_SEL_SCALE:
        slot = sets - (NUM_SETS - SEL)
        tl.store(DSEL + sel_row + slot, dsel * sm_scale, mask=(slot >= 0) & (slot < SEL))
    else:
        dq *= sm_scale
    if SLIDING:
        dq += load_tile(DQ_WINDOW, out_rows, row_ok, offs_d, d_ok, 1)
    tl.store(DQ + out_rows[:, None] + offs_d[None, :], dq.to(DQ.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _entry_rows(chunk_entries, start, e0, end, rows, z, N, HS, SEL: tl.constexpr, NUM_SETS: tl.constexpr,
                SEL_SHARED_HEADS: tl.constexpr, ROWS_PER_ENTRY: tl.constexpr):
    """Query rows of the entries ``[e0, e0 + M // ROWS_PER_ENTRY)`` (clipped at ``end``),
    picked from ``chunk_entries``, the program's chunk of ENTRIES from entry ``start`` on.

    An entry is one (query i, selection head, key set) of batch z, packed as
    ``i << 32 | sel_head << 16 | key_set`` so that decoding is shifts and masks: a
    division by a run-time value costs ~100 instructions, and even the one by the
    constexpr NUM_SETS was a multiply-high and fix-ups per row of every step.
    It owns SEL_SHARED_HEADS query rows, laid out at ROWS_PER_ENTRY (a power of two) rows
    per entry. Returns per row: query position, query head, offset of the entry's slot in
    the [Z, HS, N, SEL] selection tensors (-1 for the own block), whether the row exists
    and the entry's key set.
    """
    entry = e0 + rows // ROWS_PER_ENTRY
    in_entry = rows % ROWS_PER_ENTRY
    ok = (entry < end) & (in_entry < SEL_SHARED_HEADS)
    in_chunk = tl.minimum(entry - start, chunk_entries.shape[0] - 1).to(tl.int32)
    packed = tl.gather(chunk_entries, in_chunk, 0)
    i = (packed >> 32).to(tl.int32)
    head_and_set = packed.to(tl.int32)  # the low 32 bits
    sel_head = head_and_set >> 16
    slot = (head_and_set & 0xFFFF) - (NUM_SETS - SEL)
    query = (z.to(tl.int64) * HS + sel_head) * N + i
    slot_offset = tl.where(slot >= 0, query * SEL + slot, -1)
    return i, sel_head * SEL_SHARED_HEADS + in_entry, slot_offset, ok, slot + (NUM_SETS - SEL)


@triton.jit
def _gathered_rows(z, head, i, lse_rows, N, HQ, D, stride_z, stride_h, stride_n, LAYOUT: tl.constexpr):
    """int64 offsets of rows ``[z, head, i]`` whose LSE offsets are ``lse_rows``. The two
    dense layouts take one or two products per row where strides take three: a sizeable
    part of a pass bound by instruction issue (config A at 32k on an H100, heads-major
    against strides: 7.10 -> 6.71 ms)."""
    if LAYOUT == ROWS_HEADS_MAJOR:
        return lse_rows * D
    elif LAYOUT == ROWS_TOKENS_MAJOR:
        return ((z.to(tl.int64) * N + i) * HQ + head) * D
    else:
        return strided_rows(z, head, i, stride_z, stride_h, stride_n)


@triton.jit
def _first_entry_from(ENTRIES, lo, hi, position):
    """The first of the entries ``[lo, hi)``, whose queries ascend, that queries ``position``
    or later; ``hi`` when none does."""
    while lo < hi:
        mid = (lo + hi) // 2
        if (tl.load(ENTRIES + mid) >> 32) < position:
            lo = mid + 1
        else:
            hi = mid
    return lo


@triton.jit
def _chunk_of_entries(ENTRIES, KEY_FIRST_ENTRY, KEY_FIRST_CHUNK, key, chunk, tile_end, CHUNK: tl.constexpr,
                      CHUNK_PAD: tl.constexpr, CAUSAL: tl.constexpr, QUERY_ORDERED: tl.constexpr):
    """(start, end, unmasked, chunk_entries) of key ``key``'s chunk ``chunk``: its entries
    ``[start, end)``, loaded once as CHUNK_PAD values (0 past ``end``), and ``unmasked``,
    the first of them whose query comes at or after ``tile_end`` and so sees every key of
    a tile ending there (``start`` when not CAUSAL; ``end`` where the queries need not
    ascend, not QUERY_ORDERED, so that every step masks)."""
    start = tl.load(KEY_FIRST_ENTRY + key) + (chunk - tl.load(KEY_FIRST_CHUNK + key)) * CHUNK
    end = tl.minimum(start + CHUNK, tl.load(KEY_FIRST_ENTRY + key + 1))
    if not CAUSAL:
        unmasked = start
    elif QUERY_ORDERED:
        unmasked = _first_entry_from(ENTRIES, start, end, tile_end)
    else:
        unmasked = end
    in_chunk = tl.arange(0, CHUNK_PAD)
    chunk_entries = tl.load(ENTRIES + start + in_chunk, mask=start + in_chunk < end, other=0)
    return start, end, unmasked, chunk_entries


@triton.jit
def _program_key_tile(CHUNK_KEY, CHUNK_ORDER, HKV, NUM_BLOCKS, BLOCK_SIZE: tl.constexpr, FINE_N: tl.constexpr,
                      CHUNKS_ORDERED: tl.constexpr):
    """(chunk, key, z, kv_head, tile_start, pos) of this program of the key-side grid
    (``_key_side_launch``): program (p, t) takes chunk CHUNK_ORDER[p] (p when not
    CHUNKS_ORDERED) of key ``key`` = (z * HKV + kv_head) * NUM_BLOCKS + block, and the
    block's fine tile t, keys ``pos`` [FINE_N] from ``tile_start``. ``key`` is NUM_KEYS or
    more for a spare program past the last chunk."""
    chunk = tl.load(CHUNK_ORDER + tl.program_id(0)) if CHUNKS_ORDERED else tl.program_id(0)
    key = tl.load(CHUNK_KEY + chunk)
    z = key // (HKV * NUM_BLOCKS)
    kv_head = (key // NUM_BLOCKS) % HKV
    tile_start = (key % NUM_BLOCKS) * BLOCK_SIZE + tl.program_id(1) * FINE_N
    return chunk, key, z, kv_head, tile_start, tile_start + tl.arange(0, FINE_N)


@triton.jit
def _row_stats_offsets(z, head, i, N, HQ):
    """[len(head), 2] offsets of rows ``[z, head, i]``'s (base-2 LSE, delta) pair in ROW_STATS."""
    return ((z.to(tl.int64) * N + i) * HQ + head)[:, None] * 2 + tl.arange(0, 2)[None, :]


@triton.jit
def _dkv_step(
    Q, DO, ROW_STATS, SEL_SCALE, DQ_ACC, chunk_entries, start, e0, end, rows, z, pos, k, v, dk, dv,
    stride_qz, stride_qh, stride_qn, stride_qd, stride_doz, stride_doh, stride_don, stride_dod,
    N, HQ, HS, sm_scale, scale2, offs_d, d_ok,
    SEL: tl.constexpr, NUM_SETS: tl.constexpr, SEL_SHARED_HEADS: tl.constexpr, ROWS_PER_ENTRY: tl.constexpr,
    D: tl.constexpr, HAS_SEL_SCALE: tl.constexpr, Q_ROWS: tl.constexpr, DO_ROWS: tl.constexpr,
    MASKED: tl.constexpr, ATOMIC_DQ: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """dK, dV of the key tile at ``pos`` through the entries ``[e0, e0 + len(rows) //
    ROWS_PER_ENTRY)`` (clipped at ``end``). Without MASKED every key of the tile must be
    visible to every entry's query: rows past ``end`` load zeros and an infinite LSE, so
    they add nothing, and keys past N accumulate into rows that are never stored.
    ATOMIC_DQ (never with HAS_SEL_SCALE): also adds the rows' dQ through these keys,
    without sm_scale, to DQ_ACC [Z, HQ, N, D] float32."""
    i, head, slot_offset, row_ok, _ = _entry_rows(chunk_entries, start, e0, end, rows, z, N, HS, SEL, NUM_SETS,
                                                  SEL_SHARED_HEADS, ROWS_PER_ENTRY)
    lse_rows = (z.to(tl.int64) * HQ + head) * N + i
    q_rows = _gathered_rows(z, head, i, lse_rows, N, HQ, D, stride_qz, stride_qh, stride_qn, Q_ROWS)
    do_rows = _gathered_rows(z, head, i, lse_rows, N, HQ, D, stride_doz, stride_doh, stride_don, DO_ROWS)
    q = load_tile(Q, q_rows, row_ok, offs_d, d_ok, stride_qd)
    do = load_tile(DO, do_rows, row_ok, offs_d, d_ok, stride_dod)
    stats = tl.load(ROW_STATS + _row_stats_offsets(z, head, i, N, HQ), mask=row_ok[:, None], other=0.0)
    lse2, delta = tl.split(stats)
    lse2 = tl.where(row_ok, lse2, float("inf"))
    if HAS_SEL_SCALE:
        multiplier = tl.load(SEL_SCALE + slot_offset, mask=row_ok & (slot_offset >= 0), other=1.0)
        multiplier = multiplier.to(tl.float32)
        logit_scale, ds_scale = scale2 * multiplier, sm_scale * multiplier
    else:
        # sm_scale is applied to the chunk's dK once, by the caller.
        logit_scale, ds_scale = scale2, 1.0
    if MASKED:
        # A key is visible to the rows at or after it; rows past the chunk see none.
        visible = pos[:, None] <= tl.where(row_ok, i, -1)[None, :]
    else:
        visible = True  # the select on a constant folds away
    dk, dv, ds_t = dkv_ds_tile(k, v, q, do, lse2, delta, visible, logit_scale, ds_scale, dk, dv, DOT_PRECISION)
    if ATOMIC_DQ:
        dq = tl.dot(tl.trans(ds_t.to(k.dtype)), k, input_precision=DOT_PRECISION)
        tl.atomic_add(DQ_ACC + lse_rows[:, None] * D + offs_d[None, :], dq, mask=row_ok[:, None] & d_ok[None, :],
                      sem="relaxed")
    return dk, dv


@triton.jit
def _dkv_kernel(
    Q, K, V, DO, ROW_STATS, SEL_SCALE, ENTRIES, KEY_FIRST_ENTRY, KEY_FIRST_CHUNK, CHUNK_KEY, CHUNK_ORDER,
    DK_ACC, DV_ACC, DQ_ACC,
    stride_qz, stride_qh, stride_qn, stride_qd,
    stride_kz, stride_kh, stride_kn, stride_kd,
    stride_vz, stride_vh, stride_vn, stride_vd,
    stride_doz, stride_doh, stride_don, stride_dod,
    N, HQ, HKV, HS, NUM_BLOCKS, NUM_KEYS, sm_scale,
    SEL: tl.constexpr, NUM_SETS: tl.constexpr, BLOCK_SIZE: tl.constexpr, FINE_N: tl.constexpr,
    SEL_SHARED_HEADS: tl.constexpr, ROWS_PER_ENTRY: tl.constexpr, M: tl.constexpr,
    CHUNK: tl.constexpr, CHUNK_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_SEL_SCALE: tl.constexpr, QUERY_ORDERED: tl.constexpr, CHUNKS_ORDERED: tl.constexpr,
    Q_ROWS: tl.constexpr, DO_ROWS: tl.constexpr, ATOMIC_DQ: tl.constexpr, PARTIALS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """dK, dV of the selection for one fine tile of one key block, from one chunk of the
    entries that attend the block, added to the float32 accumulators, or with PARTIALS
    stored as the chunk's own [BLOCK_SIZE, D] rows of DK_ACC and DV_ACC, which then hold
    one such slab per chunk for ``_dkv_partials_kernel`` to sum in order.

    QUERY_ORDERED: a key's entries come from one selection head, so their queries
    ascend. Causal entries then query the block's own rows first, the only ones that see
    part of a tile; the steps after them skip the mask (at 32 heads on 2 kv heads, d = 64,
    n = 65536 on an H100, the mask took 0.5 of the pass's 4.4 ms). The masked steps take
    M rows like the others: 16-row masked steps, which kept the mask's registers out of
    a 128-register cap that the pass no longer has, took it from 2.58 to 2.77 ms there
    (0.32 to 0.36-0.38 ms at n = 8192).
    The chunk's entries are loaded once, before the steps, so that a step's gathers
    depend on no load in the loop and Triton's pipeliner can issue them stages ahead;
    with each step loading its own entries, it issued the gathers one step ahead and
    waited for every copy in flight at the top of each step (CHUNK_PAD: CHUNK rounded up
    to a power of two).
    Q_ROWS, DO_ROWS: the memory layouts of q and dO (ROWS_*). CHUNKS_ORDERED: program p
    takes chunk CHUNK_ORDER[p], else chunk p (``KeyBlockEntries``). ATOMIC_DQ: the steps
    also add their rows' dQ to DQ_ACC (``_dkv_step``)."""
    chunk, key, z, kv_head, tile_start, pos = _program_key_tile(CHUNK_KEY, CHUNK_ORDER, HKV, NUM_BLOCKS, BLOCK_SIZE,
                                                                FINE_N, CHUNKS_ORDERED)
    if key < NUM_KEYS:  # else a spare program past the last chunk
        key_ok = pos < N
        offs_d = tl.arange(0, D_PAD)
        d_ok = offs_d < D
        k = load_tile(K, strided_rows(z, kv_head, pos, stride_kz, stride_kh, stride_kn), key_ok, offs_d, d_ok,
                      stride_kd)
        v = load_tile(V, strided_rows(z, kv_head, pos, stride_vz, stride_vh, stride_vn), key_ok, offs_d, d_ok,
                      stride_vd)
        start, end, unmasked, chunk_entries = _chunk_of_entries(
            ENTRIES, KEY_FIRST_ENTRY, KEY_FIRST_CHUNK, key, chunk, tile_start + FINE_N, CHUNK, CHUNK_PAD, CAUSAL,
            QUERY_ORDERED)
        STEP: tl.constexpr = M // ROWS_PER_ENTRY
        scale2 = sm_scale * LOG2E
        dk = tl.zeros([FINE_N, D_PAD], tl.float32)
        dv = tl.zeros([FINE_N, D_PAD], tl.float32)
        for e0 in range(start, unmasked, STEP):
            dk, dv = _dkv_step(Q, DO, ROW_STATS, SEL_SCALE, DQ_ACC, chunk_entries, start, e0, end, tl.arange(0, M),
                               z, pos, k, v, dk, dv,
                               stride_qz, stride_qh, stride_qn, stride_qd, stride_doz, stride_doh, stride_don,
                               stride_dod, N, HQ, HS, sm_scale, scale2, offs_d, d_ok, SEL, NUM_SETS,
                               SEL_SHARED_HEADS, ROWS_PER_ENTRY, D, HAS_SEL_SCALE, Q_ROWS, DO_ROWS, True,
                               ATOMIC_DQ, DOT_PRECISION)
        for e0 in range(start + tl.cdiv(unmasked - start, STEP) * STEP, end, STEP):
            dk, dv = _dkv_step(Q, DO, ROW_STATS, SEL_SCALE, DQ_ACC, chunk_entries, start, e0, end, tl.arange(0, M),
                               z, pos, k, v, dk, dv,
                               stride_qz, stride_qh, stride_qn, stride_qd, stride_doz, stride_doh, stride_don,
                               stride_dod, N, HQ, HS, sm_scale, scale2, offs_d, d_ok, SEL, NUM_SETS,
                               SEL_SHARED_HEADS, ROWS_PER_ENTRY, D, HAS_SEL_SCALE, Q_ROWS, DO_ROWS, False,
                               ATOMIC_DQ, DOT_PRECISION)
        if not HAS_SEL_SCALE:
            dk *= sm_scale
        mask = key_ok[:, None] & d_ok[None, :]
        if PARTIALS:
            slab = (chunk.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE) * D
            tl.store(DK_ACC + slab[:, None] + offs_d[None, :], dk, mask=mask)
            tl.store(DV_ACC + slab[:, None] + offs_d[None, :], dv, mask=mask)
        else:
            acc = dense_rows(z, kv_head, pos, HKV, N, D)[:, None] + offs_d[None, :]
            tl.atomic_add(DK_ACC + acc, dk, mask=mask, sem="relaxed")
            tl.atomic_add(DV_ACC + acc, dv, mask=mask, sem="relaxed")


@triton.jit
def _dkv_partials_kernel(
    PARTIAL_DK, PARTIAL_DV, KEY_FIRST_CHUNK, DK_ACC, DV_ACC, N, HKV, NUM_BLOCKS,
    BLOCK_SIZE: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
):
    """Rows of dK, dV ([Z, HKV, N, D] float32): ROWS rows of key block ``program_id(0)``
    (the Key notation), from row ``program_id(1) * ROWS`` of the block on, each the sum of
    that row in the block's chunks' slabs (``_dkv_kernel`` with PARTIALS; [chunks,
    BLOCK_SIZE, D]) in chunk order, the same bits at every run. A block that no entry
    attends gets zeros."""
    key = tl.program_id(0)
    z = key // (HKV * NUM_BLOCKS)
    kv_head = (key // NUM_BLOCKS) % HKV
    in_block = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
    pos = (key % NUM_BLOCKS) * BLOCK_SIZE + in_block
    offs_d = tl.arange(0, D_PAD)
    mask = (pos < N)[:, None] & (offs_d < D)[None, :]
    dk = tl.zeros([ROWS, D_PAD], tl.float32)
    dv = tl.zeros([ROWS, D_PAD], tl.float32)
    first_chunk = tl.load(KEY_FIRST_CHUNK + key)
    slab = ((first_chunk.to(tl.int64) * BLOCK_SIZE + in_block) * D)[:, None] + offs_d[None, :]
    for _ in range(first_chunk, tl.load(KEY_FIRST_CHUNK + key + 1)):
        dk += tl.load(PARTIAL_DK + slab, mask=mask, other=0.0)
        dv += tl.load(PARTIAL_DV + slab, mask=mask, other=0.0)
        slab += BLOCK_SIZE * D
    acc = dense_rows(z, kv_head, pos, HKV, N, D)[:, None] + offs_d[None, :]
    tl.store(DK_ACC + acc, dk, mask=mask)
    tl.store(DV_ACC + acc, dv, mask=mask)


# ----------------------------------------------------------------------------- key-major forward


@triton.jit
def _key_major_step(
    Q, SEL_SCALE, STATS, LSE2, O_ACC, chunk_entries, start, e0, end, rows, z, pos, key_ok, k, v, tile,
    stride_qz, stride_qh, stride_qn, stride_qd, N, HQ, HS, scale2, offs_d, d_ok,
    SEL: tl.constexpr, NUM_SETS: tl.constexpr, TILES_PER_BLOCK: tl.constexpr, SEL_SHARED_HEADS: tl.constexpr,
    ROWS_PER_ENTRY: tl.constexpr, D: tl.constexpr, HAS_SEL_SCALE: tl.constexpr, Q_ROWS: tl.constexpr,
    MASKED: tl.constexpr, OUTPUT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One step of ``_key_major_fwd_kernel`` over the entries ``[e0, e0 + len(rows) //
    ROWS_PER_ENTRY)`` (clipped at ``end``): without OUTPUT, each row's base-2 maximum and
    sum of exponentials over the tile's keys into STATS; with OUTPUT, the rows' P V over
    them, normalised by LSE2, added to O_ACC."""
    i, head, slot_offset, row_ok, key_set = _entry_rows(chunk_entries, start, e0, end, rows, z, N, HS, SEL,
                                                        NUM_SETS, SEL_SHARED_HEADS, ROWS_PER_ENTRY)
    lse_rows = (z.to(tl.int64) * HQ + head) * N + i
    q_rows = _gathered_rows(z, head, i, lse_rows, N, HQ, D, stride_qz, stride_qh, stride_qn, Q_ROWS)
    q = load_tile(Q, q_rows, row_ok, offs_d, d_ok, stride_qd)
    logit_scale = scale2
    if HAS_SEL_SCALE:
        multiplier = tl.load(SEL_SCALE + slot_offset, mask=row_ok & (slot_offset >= 0), other=1.0)
        logit_scale = scale2 * multiplier.to(tl.float32)
    s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * logit_scale
    visible = key_ok[:, None] & row_ok[None, :]
    if MASKED:
        visible &= pos[:, None] <= i[None, :]
    if OUTPUT:
        lse2 = tl.load(LSE2 + lse_rows, mask=row_ok, other=float("inf"))
        p_t = tl.where(visible, tl.exp2(s_t - lse2[None, :]), 0.0)
        o = tl.dot(tl.trans(p_t.to(v.dtype)), v, input_precision=DOT_PRECISION)
        tl.atomic_add(O_ACC + lse_rows[:, None] * D + offs_d[None, :], o, mask=row_ok[:, None] & d_ok[None, :],
                      sem="relaxed")
    else:
        s_t = tl.where(visible, s_t, float("-inf"))
        m = tl.max(s_t, 0)
        l = tl.sum(tl.exp2(s_t - tl.where(m == float("-inf"), 0.0, m)[None, :]), 0)
        stats = (lse_rows * NUM_SETS + key_set) * TILES_PER_BLOCK + tile
        tl.store(STATS + stats[:, None] * 2 + tl.arange(0, 2)[None, :], tl.join(m, l), mask=row_ok[:, None])


@triton.jit
def _key_major_fwd_kernel(
    Q, K, V, SEL_SCALE, ENTRIES, KEY_FIRST_ENTRY, KEY_FIRST_CHUNK, CHUNK_KEY, CHUNK_ORDER, STATS, LSE2, O_ACC,
    stride_qz, stride_qh, stride_qn, stride_qd,
    stride_kz, stride_kh, stride_kn, stride_kd,
    stride_vz, stride_vh, stride_vn, stride_vd,
    N, HQ, HKV, HS, NUM_BLOCKS, NUM_KEYS, sm_scale,
    SEL: tl.constexpr, NUM_SETS: tl.constexpr, BLOCK_SIZE: tl.constexpr, FINE_N: tl.constexpr,
    SEL_SHARED_HEADS: tl.constexpr, ROWS_PER_ENTRY: tl.constexpr, M: tl.constexpr,
    CHUNK: tl.constexpr, CHUNK_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_SEL_SCALE: tl.constexpr, QUERY_ORDERED: tl.constexpr, CHUNKS_ORDERED: tl.constexpr,
    Q_ROWS: tl.constexpr, OUTPUT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """The selection's forward key-major, for one fine tile of one key block through one chunk
    of the entries that attend the block (the grid and table of ``_dkv_kernel``), in two
    launches: without OUTPUT the rows' per-tile maxima and sums of exponentials
    (STATS [Z, HQ, N, NUM_SETS, TILES_PER_BLOCK, 2] float32, base 2), which
    ``_key_major_lse_kernel`` reduces to the rows' LSE2 [Z, HQ, N]; with OUTPUT the rows'
    normalised P V, added to
    O_ACC [Z, HQ, N, D] float32. Each key tile is loaded once for all the queries that
    selected it, where the query-major ``_fwd_kernel`` gathers it once per query."""
    chunk, key, z, kv_head, tile_start, pos = _program_key_tile(CHUNK_KEY, CHUNK_ORDER, HKV, NUM_BLOCKS, BLOCK_SIZE,
                                                                FINE_N, CHUNKS_ORDERED)
    if key < NUM_KEYS:  # else a spare program past the last chunk
        tile = tl.program_id(1)
        key_ok = pos < N
        offs_d = tl.arange(0, D_PAD)
        d_ok = offs_d < D
        k = load_tile(K, strided_rows(z, kv_head, pos, stride_kz, stride_kh, stride_kn), key_ok, offs_d, d_ok,
                      stride_kd)
        v = k  # the statistics launch reads no values; Triton needs v bound on both branches
        if OUTPUT:
            v = load_tile(V, strided_rows(z, kv_head, pos, stride_vz, stride_vh, stride_vn), key_ok, offs_d, d_ok,
                          stride_vd)
        start, end, unmasked, chunk_entries = _chunk_of_entries(
            ENTRIES, KEY_FIRST_ENTRY, KEY_FIRST_CHUNK, key, chunk, tile_start + FINE_N, CHUNK, CHUNK_PAD, CAUSAL,
            QUERY_ORDERED)
        STEP: tl.constexpr = M // ROWS_PER_ENTRY
        TILES_PER_BLOCK: tl.constexpr = BLOCK_SIZE // FINE_N
        scale2 = sm_scale * LOG2E
        for e0 in range(start, unmasked, STEP):
            _key_major_step(Q, SEL_SCALE, STATS, LSE2, O_ACC, chunk_entries, start, e0, end, tl.arange(0, M), z, pos,
                            key_ok, k, v, tile, stride_qz, stride_qh, stride_qn, stride_qd, N, HQ, HS, scale2, offs_d,
                            d_ok, SEL, NUM_SETS, TILES_PER_BLOCK, SEL_SHARED_HEADS, ROWS_PER_ENTRY, D, HAS_SEL_SCALE,
                            Q_ROWS, True, OUTPUT, DOT_PRECISION)
        for e0 in range(start + tl.cdiv(unmasked - start, STEP) * STEP, end, STEP):
            _key_major_step(Q, SEL_SCALE, STATS, LSE2, O_ACC, chunk_entries, start, e0, end, tl.arange(0, M), z, pos,
                            key_ok, k, v, tile, stride_qz, stride_qh, stride_qn, stride_qd, N, HQ, HS, scale2, offs_d,
                            d_ok, SEL, NUM_SETS, TILES_PER_BLOCK, SEL_SHARED_HEADS, ROWS_PER_ENTRY, D, HAS_SEL_SCALE,
                            Q_ROWS, False, OUTPUT, DOT_PRECISION)


@triton.jit
def _key_major_lse_kernel(
    SEL_IDX, SEL_MASK, STATS, LSE2, LSE, N, HQ, HS,
    SEL: tl.constexpr, NUM_SETS: tl.constexpr, SETS_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    TILES_PER_BLOCK: tl.constexpr, SEL_SHARED_HEADS: tl.constexpr, GQA_SHARED_HEADS: tl.constexpr,
    ROWS: tl.constexpr, CAUSAL: tl.constexpr,
):
    """The LSE of query position ``program_id(0)``'s rows (base 2 into LSE2, natural into
    LSE, [Z, HQ, N]) from the per-tile statistics ``_key_major_fwd_kernel`` left in STATS,
    read only for the key sets that have entries (those that hold keys, and when causal
    none after the query's block: no program wrote the others'); -inf for a row without
    keys."""
    i = tl.program_id(0)
    z, sel_head, kv_head, first_head = program_heads(SEL_SHARED_HEADS, GQA_SHARED_HEADS)
    rows = tl.arange(0, ROWS)
    row_ok = rows < SEL_SHARED_HEADS
    lse_rows = (z.to(tl.int64) * HQ + first_head + rows) * N + i
    sel_row = ((z.to(tl.int64) * HS + sel_head) * N + i) * SEL
    blocks, _, order, _ = _key_sets(SEL_IDX, SEL_MASK, SEL_MASK, sel_row, i, N, SEL, NUM_SETS, SETS_PAD, BLOCK_SIZE,
                                    False)
    has_entry = order >= 0
    if CAUSAL:
        has_entry &= blocks <= i // BLOCK_SIZE
    lanes = tl.arange(0, SETS_PAD * TILES_PER_BLOCK)
    has_keys = tl.gather(has_entry.to(tl.int32), lanes // TILES_PER_BLOCK, 0) != 0
    read = row_ok[:, None] & has_keys[None, :] & (lanes < NUM_SETS * TILES_PER_BLOCK)[None, :]
    stats = (lse_rows[:, None] * NUM_SETS * TILES_PER_BLOCK + lanes[None, :]) * 2
    maxima = tl.load(STATS + stats, mask=read, other=float("-inf"))
    sums = tl.load(STATS + stats + 1, mask=read, other=0.0)
    top = tl.max(maxima, 1)
    top = tl.where(top == float("-inf"), 0.0, top)
    total = tl.sum(sums * tl.exp2(maxima - top[:, None]), 1)
    lse2 = tl.where(total > 0, tl.log2(tl.maximum(total, 1e-30)) + top, float("-inf"))
    tl.store(LSE2 + lse_rows, lse2, mask=row_ok)
    tl.store(LSE + lse_rows, lse2 / LOG2E, mask=row_ok)


# ----------------------------------------------------------------------------- launch


@dataclass(frozen=True)
class LaunchConfig:
    """Tile sizes and launch parameters of the kernels.

    ``fine_n`` (forward and dK / dV) and ``dq_fine_n`` (dQ) are upper bounds: the kernels
    use the largest multiple of 16 that divides ``block_size`` by halving it, so every
    block size that is a multiple of 16 works.
    ``dkv_chunk`` entries (query, key set) of one key block go to one program of
    ``_dkv_kernel``, ``dkv_rows`` query rows per step. The forward's window tiles have
    ``window_rows`` rows (raised to the padded group when smaller) and walk keys
    ``window_n`` at a time with the launch's warps;
    ``window_dq_rows`` and ``window_dq_n`` are the same for ``window_dq_kernel``.
    ``window_fwd_warps`` None runs the window tiles in the selection's forward launch,
    with its warps and stages; a number gives them a launch of their own with that many
    warps and ``window_fwd_stages`` stages.
    ``window_dkv_kernel`` takes ``window_block_n`` keys and ``window_block_m`` query
    rows per step (at least the kv head's query heads, padded to a power of two).
    ``dkv_max_registers``: a cap on ``_dkv_kernel``'s registers per thread (None: the
    compiler's choice, or ``library.register_cap``'s on GPUs it caps), which sets how many
    of its programs an SM holds.
    ``atomic_dq``: the backward computes the selection's dQ in the key-major dK / dV pass,
    adding each entry's rows atomically to a float32 buffer, instead of in a query-major
    pass that gathers every selected block's keys and values again (only without
    sel_scale; see ``default_launch_config``).
    ``key_major_forward``: a training forward (queries at every key) runs the selection
    key-major (``_key_major_fwd_kernel``) over the inverted selection, which it then
    computes first, instead of gathering each query's blocks; its programs take
    ``key_major_rows`` query rows per step, in ``key_major_warps`` warps and
    ``key_major_stages`` stages (and the dK / dV pass's ``dkv_chunk`` entries).
    """

    fine_n: int = 64
    dq_fine_n: int = 64
    fwd_warps: int = 4
    fwd_stages: int = 2
    dq_warps: int = 2
    dq_stages: int = 2
    dkv_chunk: int = 256
    dkv_rows: int = 32
    dkv_warps: int = 4
    dkv_stages: int = 2
    dkv_max_registers: int | None = None
    window_rows: int = 64
    window_n: int = 32
    window_fwd_warps: int | None = None
    window_fwd_stages: int = 2
    window_dq_rows: int = 64
    window_dq_n: int = 64
    window_dq_warps: int = 4
    window_dq_stages: int = 2
    window_block_n: int = 64
    window_block_m: int = 64
    window_warps: int = 4
    window_stages: int = 2
    atomic_dq: bool = False
    key_major_forward: bool = False
    key_major_rows: int = 64
    key_major_warps: int = 4
    key_major_stages: int = 2


def default_launch_config(block_size: int, head_dim: int, dtype: torch.dtype, sliding: bool = False,
                          shared_heads: int = 1, queries: int | None = None, batch: int = 1) -> LaunchConfig:
    """The configuration measured fastest on an H100 for the benchmarks' configurations
    (docs/benchmarks.md), ``shared_heads`` being the query heads of one selection and
    ``queries`` the length of each of ``batch`` sequences.

    A forward of at most ``FEW_QUERIES`` ``queries`` (a decoding step) runs its window in
    the selection's launch, one position per window tile: a launch of its own would cost
    more host time than its work. Such a launch is a few programs, each bound by the
    latency of its chain of key tiles: with 2-byte inputs up to d = 64 four warps and three
    stages, and 128-key window steps, halved it (decoding at 32 heads on 2 kv heads,
    window 512, 64k cached tokens on an H100: 27 -> 13.5 us).

    Up to d = 64, with 2-byte inputs, one warp per program streams the selection's key
    tiles best in the forward and the dQ pass: a 16-row tile then needs no cross-warp
    reductions or barriers, and more programs fit on an SM. At 32 heads on 2 kv heads,
    n = 65536, window 512, bf16: forward 6.74 -> 5.98 ms (with 32-row window tiles of
    32-key steps, what one warp holds; 5.13 ms with the window in a launch of its own,
    128-row tiles of 64-key steps, eight warps and three stages, the fastest of the
    shapes from 32 to 256 rows, 32 to 128 keys and 1 to 8 warps), dQ 4.88 -> 4.52 ms
    (16-key steps, three stages, loads through pointers; 4.37 ms once its key and value
    tiles came through TMA descriptors, in 64-key steps: 16-key ones took 4.97 ms, 32-key
    ones 4.37 ms, but 0.535 against 0.52 ms at n = 8192, and four stages 5.1 ms), the
    window's dK / dV 2.17 -> 2.09 ms (three stages), then 1.97 ms in 32-row steps of four
    stages (at d = 128, n = 32768: 1.80 -> 1.42 ms; 32-row steps pay only in four stages,
    and 128-key tiles or a mask skipped in the band's inner tiles did not), 1.79 ms once a
    step's rows span the group's heads (64-row steps ran as fast, eight warps 2x slower).
    The window's dQ keeps 64-row tiles of 64 keys in four warps and two stages (1.07 ms;
    128 rows in eight warps 1.17 ms, three stages 1.10 ms; with TMA descriptors 0.96 ms,
    again the fastest of 32 to 128 rows and keys, four or eight warps, two or three
    stages). The selection's dK / dV pass gathers 64 query rows per step (four entries of
    16 heads, sixteen of 4) through four stages: once its gathers could be issued stages
    ahead (``_dkv_kernel``), longer steps with more of them in flight paid, and a register
    cap no longer did. At 32 heads on 2 kv heads, random selections, n = 65536 (8192):
    2.70 ms (0.361) against 3.30 (0.420) for the 32-row, two-stage steps capped at 128
    registers that were fastest before; three stages 2.74 (0.359), five 2.75, six 3.73,
    chunks of 128 or 512 entries 2.79 or 2.69 (0.353, 0.356), 32-row steps in three or
    four stages 3.05-3.17 (0.40-0.41), 128-row steps 7.0-7.1, eight warps 5.7-7.3 ms. At
    16 heads on 4 kv heads, n = 32768: 0.85 ms against 1.13; three stages 0.83, 16- or
    32-row steps 1.01-1.14 ms. At d = 128 the dK / dV pass keeps 32-row steps of three
    stages (config A at 32k: 6.34 -> 4.82 ms with the pipelined gathers; four stages 4.88,
    64-row steps 5.8-7.1 ms), and the forward takes a third stage only when the launch
    also runs window tiles, which stay in its launch there (launches of their own, 4 or 8
    warps, ran 2.5%-20% slower at n = 32768).

    float32 tiles are twice as wide: they keep two warps (at n = 4096 the forward takes
    1.5x as long on one), and at every d the window's dK / dV takes 32-key, 32-row steps
    (the 64 x 64 ones spill: 84 -> 3.2 ms at d = 64, n = 4096; 99 -> 3.8 ms at d = 128,
    n = 2048).

    Selections shared by at most ATOMIC_DQ_MAX_SHARED_HEADS query heads take their dQ from
    the dK / dV pass (``atomic_dq``; with sel_scale the dQ pass stays). The op's forward +
    backward on random causal selections (16 blocks of 64, bf16, H100), dQ pass against
    atomic dQ, without / with a window of 512, n = 32768 (8192): 16 heads on 4 kv heads,
    d = 64: 9.03 -> 6.06 / 10.15 -> 7.08 ms (1.96 -> 1.99 / 2.27 -> 2.23); 32 on 8, d = 64:
    18.0 -> 12.1 / 20.2 -> 14.0 ms (3.83 -> 2.56 / 4.47 -> 3.08); 32 on 8, d = 128: 39.1 ->
    27.8 / 42.8 -> 31.1 ms (8.88 -> 6.54 / 9.93 -> 7.42), then 28.5 ms with a window in the
    16-row dK / dV steps it now takes at d = 128 (32-row steps 31.4, 64-row 32.4-34.1,
    eight warps 31.8-35.7); groups of 8: 32 on 4, d = 64: 9.79 -> 8.22 / 11.8 -> 9.89 ms
    (2.12 -> 2.10 / 2.66 -> 2.11); 16 on 2, d = 128: 10.2 -> 9.42 / 11.9 -> 10.8 ms (2.36 ->
    2.04 / 2.82 -> 2.40). Groups of 16 lose: 32 on 2, d = 64: 5.53 -> 7.07 / 7.49 -> 8.63
    ms; 64 on 4, d = 128: 23.0 -> 23.3 / 30.5 -> 28.9 ms, but 5.22 -> 6.52 / 6.88 -> 7.82 at
    8192. The gradients of the two ways differ by 1e-4 to 3e-3 of their largest entry,
    bf16's rounding.

    Training forwards whose 2-byte selections are shared by at most
    KEY_MAJOR_FORWARD_MAX_SHARED_HEADS query heads, in blocks of at least
    KEY_MAJOR_FORWARD_MIN_BLOCK keys, run key-major (``key_major_forward``, on the dK / dV
    pass's chunks) from KEY_MAJOR_FORWARD_MIN_QUERIES queries on, up to d = 64 from twice as
    many, counting the queries of every sequence of the batch. The op's forward / forward +
    backward, query-side against key-major, same selections with a window of 512, n = 32768
    (8192): 16 heads on 4 kv heads, d = 64: 4.34 -> 3.31 / 7.08 -> 6.00 ms (0.90 -> 0.89 /
    1.82 -> 1.55); 32 on 8, d = 128: 18.2 -> 8.49 / 28.4 -> 18.5 ms (4.13 -> 2.18 / 6.60 ->
    4.66). Groups of 8 lose: 16 on 2, d = 128: 4.68 -> 5.88 / 10.5 -> 11.6 ms (1.07 -> 1.26
    / 2.35 -> 2.52); so do groups of 16: 32 on 2, d = 64: 2.54 -> 6.42 / 7.49 -> 11.2 ms.
    Those figures ran on the dK / dV pass's rows, warps and stages; the key-major forward's
    own, 64-row steps in four warps and two stages, took them to 2.80 / 5.42 ms (0.77 /
    2.44) at 16 on 4, d = 64, and 7.82 / 17.6 ms (2.00 / 4.44) at 32 on 8, d = 128. Forward
    alone without a window, 32 on 8, d = 128 (16 on 4, d = 64), n = 32768: 7.69 (3.04) ms on
    the dK / dV pass's 16-row (64-row) steps of three (four) stages, 7.05 (2.56) on 64-row
    steps of two; 32-row steps of two stages 7.62 (2.54), 128-row ones 10.4 (2.46), three
    stages 8.26 (2.97), eight warps 9.9-12.5 ms at d = 128.

    The key-major forward issues the selection's inversion and three launches: about 1.0 ms
    of host time per call against 0.2-0.4 ms, which a step launched eagerly from Python
    pays at every length, and a step replayed from a CUDA graph or compiled does not. On
    the GPU it is ahead from 2048 queries on: the layer's forward + backward replayed from
    a CUDA graph (an H100; dim 2048 at d = 64, 4096 at d = 128, window 512), query-side ->
    key-major, n = 2048 / 4096 / 8192: 32 on 8, d = 64: 1.28 -> 1.24 / 2.49 -> 2.28 / 5.12
    -> 4.47 ms; 16 on 4, d = 64, n = 4096 / 8192: 1.40 -> 1.34 / 2.72 -> 2.46 ms; 32 on 8,
    d = 128, n = 2048 / 4096: 3.07 -> 2.70 / 6.23 -> 5.25 ms. The eager steps of those
    lengths are bound by the host (6-11 ms issued for 1.2-6 ms of GPU work), and a d = 64
    step at 2048 gains 0.04 ms for the extra 0.7 ms, so d = 64 waits for 4096 queries.
    Blocks of 16 keys lose at every length: each entry's output takes an atomic add per 16
    keys, and a step's dots are 16 keys wide
    (an H200, the same steps, window 64 and 4 selected or window 512 and 16 selected; 8
    query heads on 4 kv heads of d = 64 at dim 512, the ``enwik8`` preset's layer: 0.57 ->
    0.59 ms at 4096, 2.12 -> 2.14 at 16384; 32 on 8, d = 64: 2.72 -> 2.85 and 3.80 -> 3.96
    at 8192, 16.9 -> 17.2 and 19.9 -> 20.2 at 32768), and so did the preset's training
    step (9.30 -> 9.48 ms at 4096 tokens, replayed). Blocks of 32 (8 selected, window 256)
    gain: 32 on 8, d = 64: 3.19 -> 3.15 ms at 8192, 15.6 -> 15.4 at 32768; d = 128 (dim
    4096): 9.16 -> 8.40 at 8192.

    The host time is per call and the gain grows with the rows of the whole batch, so the
    threshold counts ``batch * queries`` (H100, replayed, four to six alternating rounds):
    sequences of 2048 at d = 64, 32 on 8 kv heads: 2.28 -> 2.13 ms in a batch of 2, 4.27 ->
    3.94 in a batch of 4; 16 on 4: 2.30 -> 2.21 ms in a batch of 4; sequences of 1024, 32 on
    8, d = 64: 1.97 -> 1.89 ms in a batch of 4, 3.68 -> 3.43 in a batch of 8; d = 128 (dim
    4096): 2.66 -> 2.43 ms in a batch of 2."""
    if queries is not None and queries <= FEW_QUERIES:
        config = default_launch_config(block_size, head_dim, dtype, sliding, shared_heads)
        config = replace(config, window_fwd_warps=None, window_rows=MIN_ROWS, key_major_forward=False)
        if dtype.itemsize == 2 and head_dim <= 64:
            return replace(config, fwd_warps=4, fwd_stages=3, window_n=128)
        return replace(config, window_n=64 if dtype.itemsize == 2 else 32)
    dkv_rows = 32 if shared_heads > 8 else 16
    atomic_dq = shared_heads <= ATOMIC_DQ_MAX_SHARED_HEADS
    if dtype.itemsize == 2:
        min_queries = KEY_MAJOR_FORWARD_MIN_QUERIES * (2 if head_dim <= 64 else 1)
        key_major = (shared_heads <= KEY_MAJOR_FORWARD_MAX_SHARED_HEADS and block_size >= KEY_MAJOR_FORWARD_MIN_BLOCK
                     and (queries is None or batch * queries >= min_queries))
        if head_dim <= 64:
            return LaunchConfig(
                fwd_warps=1, window_rows=128, window_n=64, window_fwd_warps=8, window_fwd_stages=3, dq_warps=1,
                dq_stages=3, dkv_rows=64, dkv_stages=4, window_block_m=32, window_stages=4, atomic_dq=atomic_dq,
                key_major_forward=key_major,
            )
        return LaunchConfig(fwd_stages=3 if sliding else 2, dkv_rows=16 if atomic_dq else 32, dkv_stages=3,
                            window_block_m=32, window_stages=4, atomic_dq=atomic_dq, key_major_forward=key_major)
    window_steps = dict(window_block_n=32, window_block_m=32, atomic_dq=atomic_dq)
    if head_dim <= 64:
        return LaunchConfig(fwd_warps=2, window_rows=32, window_n=64, dkv_rows=dkv_rows, **window_steps)
    return LaunchConfig(fwd_stages=3 if sliding else 2, dkv_stages=3, **window_steps)


def _fine_block(block_size: int, preferred: int) -> int:
    fine = preferred
    while block_size % fine:
        fine //= 2
    return fine


def _padded_head_dim(d: int) -> int:
    return max(MIN_ROWS, next_power_of_2(d))


def _empty(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Allocation of every kernel output; tests replace it to fill outputs with NaN first."""
    return torch.empty(shape, dtype=dtype, device=device)


def _row_layout(t: torch.Tensor) -> int:
    """The ROWS_* layout of ``t: [b, h, n, d]``."""
    if t.is_contiguous():
        return ROWS_HEADS_MAJOR.value
    if t.transpose(1, 2).is_contiguous():
        return ROWS_TOKENS_MAJOR.value
    return ROWS_STRIDED.value


def _strides(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.stride())


@dataclass(frozen=True)
class _Problem:
    """Shapes and options shared by the forward and backward launches."""

    batch: int
    query_heads: int
    kv_heads: int
    selection_heads: int
    seq_len: int  # query rows
    head_dim: int
    num_slots: int
    block_size: int
    causal: bool
    window: int | None
    scale: float
    has_sel_scale: bool
    config: LaunchConfig
    num_keys: int
    q_offset: int  # position of query row 0
    # torch.use_deterministic_algorithms: no float atomics, each result the same bits at
    # every run (see _problem).
    deterministic: bool = False

    @cached_property  # read by every launch of a step; the host bounds short sequences
    def constexprs(self) -> dict:
        return dict(
            SEL=self.num_slots,
            NUM_SETS=self.num_slots + self.causal,
            SETS_PAD=next_power_of_2(self.num_slots + self.causal) if self.num_slots + self.causal else 1,
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

    @property
    def dq_fine_n(self) -> int:
        return _fine_block(self.block_size, self.config.dq_fine_n)

    @property
    def heads_pad(self) -> int:
        return next_power_of_2(self.query_heads // self.selection_heads)

    def window_tile(self, for_dq: bool) -> tuple[int, int]:
        """Rows and key tile of the forward's (or window_dq_kernel's) window tiles."""
        config = self.config
        rows, keys = (config.window_dq_rows, config.window_dq_n) if for_dq else (config.window_rows, config.window_n)
        return max(rows, MIN_ROWS, self.heads_pad), keys

    def num_window_tiles(self, for_dq: bool) -> int:
        return cdiv(self.seq_len, self.window_tile(for_dq)[0] // self.heads_pad)

    def window_constexprs(self, for_dq: bool) -> dict:
        rows, keys = self.window_tile(for_dq)
        return dict(WINDOW=self.window, HEADS_PAD=self.heads_pad, WINDOW_ROWS=rows, WINDOW_N=keys)

    @property
    def gqa_pad(self) -> int:
        return next_power_of_2(self.query_heads // self.kv_heads)

    @property
    def window_dkv_rows(self) -> int:
        """Query rows per step of window_dkv_kernel: whole groups of the kv head's heads."""
        return max(self.config.window_block_m, self.gqa_pad)

    @property
    def window_dkv_steps(self) -> int:
        """Steps of window_dkv_kernel that cover every query seeing a key tile."""
        span = self.config.window_block_n + (self.window if self.causal else 2 * self.window)
        return cdiv(span, self.window_dkv_rows // self.gqa_pad)

    @property
    def grid(self) -> tuple[int, int, int]:
        return (self.seq_len, self.selection_heads, self.batch)

    @property
    def key_major_forward(self) -> bool:
        """Whether the forward runs the selection key-major (``LaunchConfig.key_major_forward``):
        only with queries at every key and some key sets."""
        return (self.config.key_major_forward and not self.deterministic and self.q_offset == 0
                and self.num_keys == self.seq_len and self.constexprs["NUM_SETS"] > 0)

    @property
    def atomic_dq(self) -> bool:
        """Whether the dK / dV pass adds the selection's dQ (``LaunchConfig.atomic_dq``): not
        with sel_scale, whose gradient the dQ pass reduces per slot, nor without key sets."""
        return (self.config.atomic_dq and not self.deterministic and not self.has_sel_scale
                and self.constexprs["NUM_SETS"] > 0)

    @property
    def num_blocks(self) -> int:
        return cdiv(self.seq_len, self.block_size)

    @property
    def num_key_blocks(self) -> int:
        """Key blocks of all batches and kv heads: the keys the inversion sorts entries by."""
        return self.batch * self.kv_heads * self.num_blocks


def _key_tiles(k: torch.Tensor, v: torch.Tensor, d: int):
    """``tiles(rows)``: the TMA descriptors of [rows, D_PAD] tiles of the keys and values
    ([b, hk, n, d]), built once per tile height (with the layer's defaults the selection's
    and the window's tiles share them)."""
    built = {}

    def tiles(rows: int):
        if rows not in built:
            built[rows] = tuple(row_tiles(t, rows, _padded_head_dim(d)) for t in (k, v))
        return built[rows]

    return tiles


def _selection_operands(indices, fmask, sel_scale, fallback: torch.Tensor):
    """Contiguous selection tensors; an empty selection is replaced by a valid dummy pointer
    (the kernels never read it)."""
    if indices.numel() == 0:
        return fallback, fallback, fallback
    sel_scale = indices if sel_scale is None else sel_scale.contiguous()
    return indices.contiguous(), fmask.contiguous().view(torch.uint8), sel_scale


def _folds_gates(problem: _Problem) -> bool:
    """Whether the forward can write the layer's gated sum: where the window's tiles run
    in a launch of their own, after the selection's, at the keys' positions."""
    return problem.window is not None and problem.config.window_fwd_warps is not None and problem.q_offset == 0


def _merged_dtype(gates: torch.Tensor, q: torch.Tensor) -> torch.dtype:
    return torch.promote_types(gates.dtype, q.dtype)


def _forward(problem: _Problem, q, k, v, indices, fmask, sel_scale, position: torch.Tensor | None = None,
             gates: torch.Tensor | None = None, compressed_out: torch.Tensor | None = None,
             table: KeyBlockEntries | None = None, document_start: torch.Tensor | None = None,
             shares: tuple[int, int] | None = None):
    """(out, lse, swa_out, swa_lse, merged); the window's two are empty without a window.
    ``table``: the selection's inversion, which a key-major forward reads.
    ``document_start``: see ``_launch_forward``. ``shares`` (query-side, ungated): the
    selection's and the window's outputs in (selection, window) shares of their keys, out
    and lse float32 [b, hq, shares, n, d] and [b, hq, shares, n], as swa_out and swa_lse
    (``_selection_forward``, ``sliding_window.window_forward``).

    ``position``: a ``[b]`` int64 device tensor holding each batch row's position of query
    row 0, read by the kernel in place of ``problem.q_offset``.
    ``gates`` [3, b, hq, n] and ``compressed_out`` (contiguous [b, hq, n, d]): where
    ``_folds_gates``, ``merged`` is the layer's gated sum [b, n, hq * d]; else empty."""
    b, hq, n, d = problem.batch, problem.query_heads, problem.seq_len, problem.head_dim
    sliding = problem.window is not None
    if shares is not None:
        assert gates is None and not problem.key_major_forward
        splits, window_splits = shares
        out = _empty((b, hq, splits, n, d), torch.float32, q.device)
        lse = _empty((b, hq, splits, n), torch.float32, q.device)
        swa_out = _empty((b, hq, window_splits, n, d) if sliding else (0,), torch.float32, q.device)
        swa_lse = _empty((b, hq, window_splits, n) if sliding else (0,), torch.float32, q.device)
    else:
        splits = window_splits = 1
        out = _empty((b, hq, n, d), q.dtype, q.device)
        lse = _empty((b, hq, n), torch.float32, q.device)
        swa_out = _empty((b, hq, n, d) if sliding else (0,), q.dtype, q.device)
        swa_lse = _empty((b, hq, n) if sliding else (0,), torch.float32, q.device)
    gated = gates is not None and _folds_gates(problem)
    if gated:
        assert compressed_out.is_contiguous() and compressed_out.shape == q.shape
        merged = _empty((b, n, hq * d), _merged_dtype(gates, q), q.device)
        gate_strides = gates.stride()
    else:
        merged = _empty((0,), q.dtype, q.device)
        gates = compressed_out = lse  # never read: any valid pointers do
        gate_strides = (0, 0, 0, 0)
    sel_idx, sel_mask, sel_scale = _selection_operands(indices, fmask, sel_scale, lse)
    config = problem.config
    start, start_ptr, in_memory = position_in_memory(problem.q_offset if position is None else position, lse)

    key_tiles = _key_tiles(k, v, d)

    def launch_programs(window_tiles: int, positions: int, num_warps: int, num_stages: int) -> None:
        if window_tiles:
            window = problem.window_constexprs(for_dq=False)
            window_key_tiles = key_tiles(window["WINDOW_N"])
        else:
            window = dict(WINDOW=0, HEADS_PAD=1, WINDOW_ROWS=1, WINDOW_N=1)
            window_key_tiles = key_tiles(problem.fine_n)  # never read: any valid descriptors do
        launch(_fwd_kernel, (window_tiles * window_splits + positions * splits, problem.selection_heads, b),
            q, *key_tiles(problem.fine_n), *window_key_tiles, sel_idx, sel_mask, sel_scale, out, lse,
            swa_out if sliding else out, swa_lse if sliding else lse,
            gates, compressed_out, merged if gated else lse, document_start if window_tiles else None,
            *_strides(q), *gate_strides,
            n, start, start_ptr, problem.num_keys, hq, problem.selection_heads, window_tiles, problem.scale,
            **problem.constexprs,
            **window,
            SLIDING=window_tiles > 0,
            GATED=gated and positions == 0,
            DOT_PRECISION=dot_precision(q.dtype),
            Q_START_IN_MEMORY=in_memory,
            HAS_DOCS=document_start is not None and window_tiles > 0,
            SPLITS=splits,
            WINDOW_SPLITS=window_splits,
            num_warps=num_warps,
            num_stages=num_stages,
            **register_cap(q.device),
        )

    window_tiles = problem.num_window_tiles(for_dq=False) if sliding else 0
    if problem.key_major_forward:
        out, lse = _key_major_forward(problem, q, k, v, sel_idx, sel_mask, sel_scale, table)
        if window_tiles:
            warps, stages = config.window_fwd_warps, config.window_fwd_stages
            if warps is None:
                warps, stages = config.fwd_warps, config.fwd_stages
            launch_programs(window_tiles, 0, warps, stages)
    elif window_tiles and config.window_fwd_warps is not None:
        launch_programs(0, n, config.fwd_warps, config.fwd_stages)
        launch_programs(window_tiles, 0, config.window_fwd_warps, config.window_fwd_stages)
    else:
        launch_programs(window_tiles, n, config.fwd_warps, config.fwd_stages)
    return out, lse, swa_out, swa_lse, merged


def _key_side_launch(problem: _Problem, table: KeyBlockEntries,
                     q: torch.Tensor) -> tuple[tuple[int, int], tuple, dict]:
    """(grid, table operands, constexprs) that the kernels over the inverted selection
    (``_key_major_fwd_kernel``, ``_dkv_kernel``) share: a program per chunk of a key
    block's entries and fine tile of the block, ``dkv_chunk`` entries a chunk."""
    ordered = table.chunk_order is not None
    grid = (table.chunk_key.numel(), problem.block_size // problem.fine_n)
    operands = (table.entries, table.first_entry, table.first_chunk, table.chunk_key,
                table.chunk_order if ordered else table.chunk_key)
    names = ("SEL", "NUM_SETS", "BLOCK_SIZE", "FINE_N", "SEL_SHARED_HEADS", "D", "D_PAD", "CAUSAL", "HAS_SEL_SCALE")
    chunk = problem.config.dkv_chunk
    constexprs = dict(
        {name: problem.constexprs[name] for name in names},
        ROWS_PER_ENTRY=next_power_of_2(problem.query_heads // problem.selection_heads),
        QUERY_ORDERED=problem.selection_heads == problem.kv_heads,
        CHUNKS_ORDERED=ordered,
        Q_ROWS=_row_layout(q),
        CHUNK=chunk,
        CHUNK_PAD=next_power_of_2(chunk),
        DOT_PRECISION=dot_precision(q.dtype),
    )
    return grid, operands, constexprs


def _key_major_forward(problem: _Problem, q, k, v, indices, fmask, sel_scale, table: KeyBlockEntries):
    """(out [b, hq, n, d], lse [b, hq, n] float32) of the selection, key-major: the rows'
    statistics per key tile, their LSE, then P V added per key tile (``_key_major_fwd_kernel``)."""
    b, hq, hk, n, d = problem.batch, problem.query_heads, problem.kv_heads, problem.seq_len, problem.head_dim
    hs, config, constexprs = problem.selection_heads, problem.config, problem.constexprs
    tiles_per_block = problem.block_size // problem.fine_n
    stats = _empty((b, hq, n, constexprs["NUM_SETS"] * tiles_per_block, 2), torch.float32, q.device)
    lse2 = _empty((b, hq, n), torch.float32, q.device)
    lse = _empty((b, hq, n), torch.float32, q.device)
    out_acc = torch.zeros((b, hq, n, d), dtype=torch.float32, device=q.device)
    grid, table_operands, shared = _key_side_launch(problem, table, q)

    def run(output: bool) -> None:
        launch(_key_major_fwd_kernel, grid,
            q, k, v, sel_scale, *table_operands, stats, lse2, out_acc,
            *_strides(q), *_strides(k), *_strides(v),
            n, hq, hk, hs, problem.num_blocks, table.num_keys, problem.scale,
            **shared,
            OUTPUT=output,
            M=max(config.key_major_rows, shared["ROWS_PER_ENTRY"]),
            num_warps=config.key_major_warps,
            num_stages=config.key_major_stages,
        )

    run(output=False)
    launch(_key_major_lse_kernel, problem.grid,
        indices, fmask, stats, lse2, lse, n, hq, hs,
        **{name: constexprs[name] for name in ("SEL", "NUM_SETS", "SETS_PAD", "BLOCK_SIZE", "SEL_SHARED_HEADS",
                                                "GQA_SHARED_HEADS", "ROWS", "CAUSAL")},
        TILES_PER_BLOCK=tiles_per_block,
        num_warps=1,
    )
    run(output=True)
    return out_acc.to(q.dtype), lse


def _backward(problem: _Problem, saved, d_out, d_swa_out, table: KeyBlockEntries | None = None,
              document_start: torch.Tensor | None = None, document_end: torch.Tensor | None = None):
    """``table``: the selection's inversion for dK / dV, computed here (beside the dQ
    passes) where None. ``document_start``, ``document_end``: see ``_launch_forward``."""
    q, k, v, indices, fmask, sel_scale, out, lse, swa_out, swa_lse = saved
    assert problem.q_offset == 0 and problem.num_keys == problem.seq_len, "the backward takes queries at every key"
    b, hq, hk, n, d = problem.batch, problem.query_heads, problem.kv_heads, problem.seq_len, problem.head_dim
    hs, config = problem.selection_heads, problem.config
    sliding = problem.window is not None and d_swa_out is not None
    precision = dot_precision(q.dtype)
    if d_out is None:
        d_out = torch.zeros_like(out)
    atomic_dq = problem.atomic_dq
    dq = _empty((b, hq, n, d), q.dtype, q.device)
    # With atomic_dq the dK / dV pass adds the selection's dQ here, the window's dQ pass the rest.
    dq_acc = _empty((b, hq, n, d), torch.float32, q.device) if atomic_dq else None
    dsel = _empty(indices.shape, torch.float32, q.device) if problem.has_sel_scale else None
    delta = _empty((b, hq, n), torch.float32, q.device)
    row_stats = _empty((b, n, hq, 2), torch.float32, q.device)
    swa_delta = _empty((b, hq, n), torch.float32, q.device) if sliding else None
    sel_idx, sel_mask, sel_scale_arg = _selection_operands(indices, fmask, sel_scale, lse)
    dk_acc, dv_acc = _empty((2, b, hk, n, d), torch.float32, q.device)  # zeroed by _dq_kernel
    key_tiles = _key_tiles(k, v, d)

    def window_dq(dq_window: torch.Tensor) -> None:
        launch(window_dq_kernel, (problem.num_window_tiles(for_dq=True), hs, b),
            q, *key_tiles(problem.window_tile(for_dq=True)[1]), swa_out, d_swa_out, swa_lse,
            swa_delta, dq_window, lse if dq_acc is None else dq_acc, document_start,
            *_strides(q), *_strides(d_swa_out),
            n, hq, problem.scale,
            SEL_SHARED_HEADS=hq // hs, GQA_SHARED_HEADS=hq // hk,
            **problem.window_constexprs(for_dq=True),
            D=d, D_PAD=_padded_head_dim(d), CAUSAL=problem.causal,
            ADD_ACC=atomic_dq,
            DOT_PRECISION=precision,
            HAS_DOCS=document_start is not None,
            num_warps=config.window_dq_warps,
            num_stages=config.window_dq_stages,
            **register_cap(q.device),
        )

    def dq_launches():
        dq_window = lse  # never read without the window: any valid pointer does
        if sliding and not atomic_dq:
            dq_window = _empty((b, hq, n, d), q.dtype, q.device)
            window_dq(dq_window)
        launch(_dq_kernel, problem.grid,
            q, *key_tiles(problem.dq_fine_n), out, d_out, lse, sel_idx, sel_mask, sel_scale_arg,
            dq if dq_acc is None else dq_acc,
            dsel if dsel is not None and dsel.numel() else lse, delta, row_stats, dq_window, dk_acc, dv_acc,
            *_strides(q), *_strides(d_out),
            n, hq, hs, problem.scale,
            **{**problem.constexprs, "FINE_N": problem.dq_fine_n},
            SLIDING=sliding,
            ATOMIC_DQ=atomic_dq,
            DOT_PRECISION=precision,
            num_warps=config.dq_warps,
            num_stages=config.dq_stages,
            **register_cap(q.device),
        )

    constexprs = problem.constexprs
    if table is None:
        # Not inverted in the forward: the inversion reads only the selection, so it runs
        # beside the dQ passes, as far as their grids leave it SMs (``_launch_forward``).
        table, _ = side_by_side(q.device, lambda: _invert(problem, indices, fmask, q.element_size()), dq_launches,
                                urgent=True)
    else:
        dq_launches()
    if constexprs["NUM_SETS"]:
        grid, table_operands, shared = _key_side_launch(problem, table, q)
        partials = problem.deterministic
        # Deterministic: one [block_size, d] slab per chunk, summed in order below.
        dk_out, dv_out = (_empty((2, table.chunk_key.numel(), problem.block_size, d), torch.float32, q.device)
                          if partials else (dk_acc, dv_acc))
        launch(_dkv_kernel, grid,
            q, k, v, d_out, row_stats, sel_scale_arg, *table_operands, dk_out, dv_out,
            dk_acc if dq_acc is None else dq_acc,
            *_strides(q), *_strides(k), *_strides(v), *_strides(d_out),
            n, hq, hk, hs, problem.num_blocks, table.num_keys, problem.scale,
            **shared,
            DO_ROWS=_row_layout(d_out),
            ATOMIC_DQ=atomic_dq,
            PARTIALS=partials,
            M=max(config.dkv_rows, shared["ROWS_PER_ENTRY"]),
            num_warps=config.dkv_warps,
            num_stages=config.dkv_stages,
            **(register_cap(q.device) if config.dkv_max_registers is None else {"maxnreg": config.dkv_max_registers}),
        )
        if partials:
            rows = problem.fine_n
            launch(_dkv_partials_kernel, (table.num_keys, problem.block_size // rows),
                dk_out, dv_out, table.first_chunk, dk_acc, dv_acc, n, hk, problem.num_blocks,
                BLOCK_SIZE=problem.block_size, ROWS=rows, D=d, D_PAD=_padded_head_dim(d),
                num_warps=4,
            )
    if atomic_dq:
        if sliding:
            window_dq(dq)
        else:
            torch.mul(dq_acc, problem.scale, out=dq_acc)
            dq.copy_(dq_acc)
    if sliding:
        dk = _empty((b, hk, n, d), k.dtype, k.device)
        dv = _empty((b, hk, n, d), v.dtype, v.device)
        grid = (cdiv(n, config.window_block_n), hk, b)
        launch(window_dkv_kernel, grid,
            q, k, v, d_swa_out, swa_lse, swa_delta, dk_acc, dv_acc, dk, dv, document_end,
            *_strides(q), *_strides(k), *_strides(v), *_strides(d_swa_out),
            n, hq, hk, problem.scale,
            GQA_SHARED_HEADS=hq // hk,
            GQA_PAD=problem.gqa_pad,
            BLOCK_N=config.window_block_n,
            BLOCK_M=problem.window_dkv_rows,
            D=d,
            D_PAD=_padded_head_dim(d),
            CAUSAL=problem.causal,
            WINDOW=problem.window,
            QUERY_STEPS=problem.window_dkv_steps,
            DOT_PRECISION=precision,
            HAS_DOCS=document_end is not None,
            num_warps=config.window_warps,
            num_stages=config.window_stages,
            **register_cap(q.device),
        )
    else:
        # Copies even in float32: the operator's outputs must not share the accumulators' storage.
        dk, dv = dk_acc.to(k.dtype, copy=True), dv_acc.to(v.dtype, copy=True)
    dsel = _empty((0,), q.dtype, q.device) if dsel is None else dsel.to(sel_scale.dtype)
    return dq, dk, dv, dsel, delta, _empty((0,), torch.float32, q.device) if swa_delta is None else swa_delta


def _problem(q, k, indices, has_sel_scale: bool, block_size: int, causal: bool, window: int | None,
             scale: float, q_offset: int = 0) -> _Problem:
    b, hq, n, d = q.shape
    hs = indices.shape[1]
    return _Problem(
        batch=b,
        query_heads=hq,
        kv_heads=k.shape[1],
        selection_heads=hs,
        seq_len=n,
        head_dim=d,
        num_slots=indices.shape[-1],
        block_size=block_size,
        causal=causal,
        window=window,
        scale=scale,
        has_sel_scale=has_sel_scale,
        config=default_launch_config(block_size, d, q.dtype, window is not None, shared_heads=hq // hs,
                                     queries=n, batch=b),
        num_keys=k.shape[2],
        q_offset=q_offset,
        # Read at every call, as PyTorch's own operators do: the forward leaves out the
        # key-major forward's atomic adds, the backward the atomic dQ and sums the dK / dV
        # chunks' partials in order.
        deterministic=torch.are_deterministic_algorithms_enabled(),
    )


def _invert(problem: _Problem, indices: torch.Tensor, fmask: torch.Tensor,
            element_size: int) -> KeyBlockEntries | None:
    """The selection's inversion for dK / dV (``key_block_entries``; ``element_size``:
    bytes per element of q and dO), None without key sets."""
    if not problem.constexprs["NUM_SETS"]:
        return None
    sel_idx, sel_mask, _ = _selection_operands(indices, fmask, None, indices)
    return key_block_entries(problem, sel_idx, sel_mask, element_size)


def _check_documents(problem: _Problem, document_start: torch.Tensor | None,
                     document_end: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(document_start, document_end) where the window reads them, (None, None) where there
    is no window to mask; asserts what the kernels assume of them (``_launch_forward``)."""
    if document_start is None and document_end is None:
        return None, None
    assert problem.causal and problem.q_offset == 0 and problem.num_keys == problem.seq_len, \
        "documents need a causal operator with queries at every key"
    for t in (document_start, document_end):
        assert (t is not None and t.dtype == torch.int32 and t.is_contiguous()
                and tuple(t.shape) == (problem.batch, problem.seq_len)), "documents: two [b, n] int32 tensors"
    return (document_start, document_end) if problem.window is not None else (None, None)


def _fake_forward(q, k, v, indices, fmask, sel_scale, block_size, causal, window, scale, q_offset=0,
                  gates=None, compressed_out=None, invert=False, document_start=None, document_end=None):
    b, hq, n, d = q.shape
    problem = _problem(q, k, indices, sel_scale is not None, block_size, causal, window, scale, q_offset)
    lse = q.new_empty((b, hq, n), dtype=torch.float32)
    merged = q.new_empty(0)
    if gates is not None and _folds_gates(problem):
        merged = q.new_empty((b, n, hq * d), dtype=_merged_dtype(gates, q))
    table = (fake_key_block_entries(problem, q.element_size(), q.device)
             if invert and problem.constexprs["NUM_SETS"] else [])
    if window is None:
        return q.new_empty(q.shape), lse, q.new_empty(0), lse.new_empty(0), merged, table
    return q.new_empty(q.shape), lse, q.new_empty(q.shape), lse.new_empty(lse.shape), merged, table


@launcher_op("selection_forward", _fake_forward)
def _launch_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor, fmask: torch.Tensor,
    sel_scale: torch.Tensor | None, block_size: int, causal: bool, window: int | None, scale: float,
    q_offset: int = 0, gates: torch.Tensor | None = None, compressed_out: torch.Tensor | None = None,
    invert: bool = False, document_start: torch.Tensor | None = None, document_end: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """-> (out, lse, swa_out, swa_lse, merged, table); swa_out and swa_lse are empty when
    window is None. With ``gates`` [3, b, hq, n] and the compressed branch's
    ``compressed_out`` (contiguous, q's shape), ``merged`` is the layer's gated sum
    [b, n, hq * d] where the launch can fold it in (``_folds_gates``), empty otherwise.
    ``invert``: ``table`` is the selection's inversion for the backward's dK / dV pass
    (``KeyBlockEntries.tensors()``, or none without key sets), computed beside the
    forward's launches; empty otherwise. ``document_start``, ``document_end``: packed
    documents, [b, n] int32 contiguous (``documents.document_bounds``), both or neither,
    only causal with q_offset 0: the window keeps to each query's document, the selection
    is left as it is (``_check_documents``). The backward takes them too.

    Queued beside the backward's dQ pass, the inversion waited for SMs: its sort's memset
    nodes wait for the pass's grid to drain, also from a stream of higher priority, so
    the sort ran between the dQ and the dK / dV passes (0.11 ms of a compiled step at
    n = 8192 on an H100, 32 heads on 2 kv heads). Beside the forward's launches it has
    the rest of the forward to finish in: the layer benchmark's compiled step took
    3.288-3.317 -> 3.271-3.285 ms at 8192 (medians of 40 steps, three runs each; at 65536
    no difference beyond the runs' spread). The backward's GPU is busy throughout, so
    most of what the sort left idle went to the kernels beside the dK / dV pass.
    """
    problem = _problem(q, k, indices, sel_scale is not None, block_size, causal, window, scale, q_offset)
    document_start, _ = _check_documents(problem, document_start, document_end)

    if problem.key_major_forward:
        table = _invert(problem, indices, fmask, q.element_size())
        outputs = _forward(problem, q, k, v, indices, fmask, sel_scale, gates=gates, compressed_out=compressed_out,
                           table=table, document_start=document_start)
        return *outputs, (table.tensors() if invert else [])

    def forward():
        return _forward(problem, q, k, v, indices, fmask, sel_scale, gates=gates, compressed_out=compressed_out,
                        document_start=document_start)

    if not invert:
        return *forward(), []
    table, outputs = side_by_side(q.device, lambda: _invert(problem, indices, fmask, q.element_size()), forward,
                                   urgent=True)
    return *outputs, ([] if table is None else table.tensors())


def _fake_backward(q, k, v, indices, fmask, sel_scale, out, lse, swa_out, swa_lse, d_out, d_swa_out,
                   block_size, causal, window, scale, table, document_start=None, document_end=None):
    dsel = q.new_empty(0) if sel_scale is None else sel_scale.new_empty(indices.shape)
    delta = lse.new_empty(lse.shape)
    swa_delta = lse.new_empty(lse.shape if window is not None and d_swa_out is not None else (0,))
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dsel, delta, swa_delta


@launcher_op("selection_backward", _fake_backward)
def _launch_backward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor, fmask: torch.Tensor,
    sel_scale: torch.Tensor | None, out: torch.Tensor, lse: torch.Tensor, swa_out: torch.Tensor,
    swa_lse: torch.Tensor, d_out: torch.Tensor | None, d_swa_out: torch.Tensor | None,
    block_size: int, causal: bool, window: int | None, scale: float, table: list[torch.Tensor],
    document_start: torch.Tensor | None = None, document_end: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (dq, dk, dv, dsel_scale, delta, swa_delta); dsel_scale is empty when sel_scale is
    None, swa_delta without the window's gradient. delta, swa_delta: [b, hq, n] float32,
    the softmax-backward corrections rowsum(d_out * out) and rowsum(d_swa_out * swa_out).
    ``table``: the forward's inversion (``_launch_forward(..., invert=True)``), or none.
    ``document_start``, ``document_end``: those of the forward."""
    problem = _problem(q, k, indices, sel_scale is not None, block_size, causal, window, scale)
    documents = _check_documents(problem, document_start, document_end)
    saved = (q, k, v, indices, fmask, sel_scale, out, lse, swa_out, swa_lse)
    inverted = KeyBlockEntries.from_tensors(table, problem.num_key_blocks) if table else None
    return _backward(problem, saved, d_out, d_swa_out, inverted, *documents)


class _SelectionAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sel_scale, indices, fmask, block_size, causal, window, scale, q_offset, invert,
                document_start, document_end):
        options = (block_size, causal, window, scale)
        out, lse, swa_out, swa_lse, _, table = _launch_forward(
            q, k, v, indices, fmask, sel_scale, *options, q_offset, invert=invert, document_start=document_start,
            document_end=document_end,
        )
        ctx.options = options
        ctx.save_for_backward(q, k, v, indices, fmask, sel_scale, out, lse, swa_out, swa_lse, document_start,
                              document_end, *table)
        ctx.mark_non_differentiable(lse)
        return out, (swa_out if window is not None else None), lse

    @staticmethod
    def backward(ctx, d_out, d_swa_out, _d_lse):
        saved, documents, table = ctx.saved_tensors[:10], ctx.saved_tensors[10:12], list(ctx.saved_tensors[12:])
        dq, dk, dv, dsel, _, _ = _launch_backward(*saved, d_out, d_swa_out, *ctx.options, table, *documents)
        has_sel_scale = saved[5] is not None
        return dq, dk, dv, (dsel if has_sel_scale else None), *(None,) * 10


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
    q_offset: int = 0,
    document_start: torch.Tensor | None = None,
    document_end: torch.Tensor | None = None,
):
    """Selected attention (and, when ``sliding_window_size`` is given, sliding-window
    attention) on the Triton kernels; differentiable in q, k, v and sel_scale when the
    queries are at the keys' positions (``q_offset = 0``, m = n).
    ``document_start``, ``document_end``: packed documents (``_launch_forward``); they mask
    the sliding window only.

    Expects inputs already validated by ``native_sparse_attend``.
    q: [b, hq, m, d] at positions ``q_offset .. q_offset + m - 1``, k, v: [b, hk, n, d];
    selected_block_indices, fmask, sel_scale: [b, hs, m, sel] with hs in {hk, hq}.
    Returns (out [b, hq, m, d], sliding_out [b, hq, m, d] or None, lse [b, hq, m] float32).
    """
    # The backward's inversion runs beside the forward's launches where a backward will follow.
    invert = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, sel_scale))
    return _SelectionAttention.apply(
        q, k, v, sel_scale, selected_block_indices, fmask, block_size, include_block_causal,
        sliding_window_size, scale, q_offset, invert, document_start, document_end,
    )


def selection_attention_at(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_size: int,
    selected_block_indices: torch.Tensor,
    fmask: torch.Tensor,
    sliding_window_size: int,
    scale: float,
    position: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal selected and sliding-window attention of queries at the positions that the
    int64 tensor ``position: [b]`` holds (each batch row's first query), read on the
    device: a step that a CUDA graph replays. Forward only, for inputs the caller has
    validated.

    q: [b, hq, m, d]; k, v: [b, hk, capacity, d], whose keys past the queries may hold
    anything; selected_block_indices, fmask: [b, hs, m, sel]. Returns (out, sliding_out),
    [b, hq, m, d] each.
    """
    problem = _problem(q, k, selected_block_indices, False, block_size, True, sliding_window_size, scale)
    out, _, swa_out, _, _ = _forward(problem, q, k, v, selected_block_indices, fmask, None, position)
    return out, swa_out


class PartialOutputs(NamedTuple):
    """Attention over disjoint shares of each query's keys, which together are all of them:
    ``out``: [b, h, splits, n, d] float32, each share's normalised output; ``lse``: [b, h,
    splits, n] float32, its natural log-sum-exp (-inf for a share without keys). The whole
    output weighs share s by ``exp(lse_s - logsumexp_s(lse))`` (``merge``)."""

    out: torch.Tensor
    lse: torch.Tensor

    def merge(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(out [b, h, n, d], lse [b, h, n]) over all shares, float32; rows without keys
        get 0 and -inf."""
        lse = torch.logsumexp(self.lse, dim=2)
        weights = torch.exp(self.lse - torch.where(torch.isneginf(lse), 0.0, lse)[:, :, None])
        return (weights[..., None] * self.out).sum(2), lse


def selection_attention_partials_at(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_size: int,
    selected_block_indices: torch.Tensor,
    fmask: torch.Tensor,
    sliding_window_size: int,
    scale: float,
    position: torch.Tensor,
    shares: tuple[int, int] | None = None,
) -> tuple[PartialOutputs, PartialOutputs]:
    """``selection_attention_at`` with both outputs left in shares of each query's keys, for
    a consumer that merges them (``gate_combine.gated_sum_of_logits``): ``shares`` =
    (selection, window) shares of the selection's key sets and of the window's key tiles
    (``_decoding_shares`` by default). Returns the selected and the sliding branch.

    Unsplit, a decoding step's launch is a few programs, one window tile and one query row
    of the selection per selection head and batch row, each bound by the latency of its
    chain of key tiles (17 blocks of 64 keys, five window tiles of 128). Shares of the
    chains run side by side: at the layer benchmark's configuration on an H100 (replayed
    steps, 4k cached tokens, batch 1) the launch took 14.1 -> 4.2 us and the gated sum
    1.3 -> 3.9 us, the step 72.1 -> 66.8 us (16k: 78.2 -> 70.3, 64k: 91.9 -> 85.1; batches
    of 8 at 16k: 94.4 -> 89.2, of 32 at 4k: 108.0 -> 105.5)."""
    problem = _problem(q, k, selected_block_indices, False, block_size, True, sliding_window_size, scale)
    out, lse, swa_out, swa_lse, _ = _forward(problem, q, k, v, selected_block_indices, fmask, None, position,
                                             shares=shares or _decoding_shares(problem, q.device))
    return PartialOutputs(out, lse), PartialOutputs(swa_out, swa_lse)


def _decoding_shares(problem: _Problem, device: torch.device) -> tuple[int, int]:
    """(selection, window) shares of a decoding step's chains of key tiles: as many as give
    about one program per SM, at most one per key set or window key tile."""
    rows = problem.batch * problem.selection_heads
    # The interpreter's: two each, so that short tests cover the shares.
    per_row = multiprocessors(device) // rows if device.type == "cuda" else 2
    window_n = problem.window_tile(for_dq=False)[1]
    window_key_tiles = cdiv(problem.window + window_n, window_n)
    return max(1, min(problem.constexprs["NUM_SETS"], per_row)), max(1, min(window_key_tiles, per_row))
