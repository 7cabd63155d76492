"""Linear layers over the few rows of a decoding step, up to two in one launch, reading
their weights in place in whatever dtype they are kept.

Notation
--------
M: rows (a decoding step's tokens, or its tokens times kv heads); BLOCK_M of them per
program, padded to at least 16 for the tensor cores.
Segment s = 0, 1: X_s ``[M, K_s]`` (unit stride along K), W_s ``[N_s, K_s]`` (an
``nn.Linear`` weight), B_s ``[N_s]`` or none, Y_s ``[M, N_s]`` contiguous;
``Y_s = act(X_s @ W_s^T + B_s)`` with act the identity, ReLU or the exact GELU (ACTIVATION
"", "relu", "gelu"). The two segments may share X (a query / key / value projection and
the gates' beside it) or not (the key and the value compression networks, or a
feed-forward network's layers, one launch each).
BLOCK_N: output columns per program; program ``pid < TILES_0`` computes columns
``pid * BLOCK_N ..`` of segment 0, the others those of segment 1. BLOCK_K: the reduction
step.
SPLITS: programs per output tile, each summing one of SPLITS ranges of the reduction (of
whole BLOCK_K steps). Each stores its float32 partial tile in PARTIALS
``[tiles, SPLITS, BLOCK_M, BLOCK_N]`` and counts itself in COUNTERS ``[tiles]`` (zeros at
launch); the one that arrives last sums the SPLITS partials in their order, whichever
program that is, so the result does not depend on the programs' timing, and finishes the
tile.
COMPUTE: the dtype the products are taken in, which is Y's: X, W and B are rounded to it
as autocast rounds a linear layer's inputs, products are summed in float32 and rounded
once (GELU: rounded, then its float32 GELU rounded again, as ``nn.GELU`` on the rounded
output of ``F.linear`` computes it).
WINDOW, STRIDE, ROWS_PER_POSITION, POSITION: with ``ONLY_COMPLETE``, row m belongs to the
batch row ``m // ROWS_PER_POSITION`` whose step token sits at ``POSITION[...]``, and only
rows whose compression window (WINDOW tokens ending at that token) is complete are
computed; the others are written as zeros, and a program none of whose rows is complete
reads no weights.

Why not cuBLAS: at a decoding step's few rows a linear layer is a read of its weight, a
few microseconds of bandwidth that a launch of its own roughly doubles. Under autocast
each float32 weight is first cast to a bf16 copy, a kernel that reads it and writes half
of it again, every step of a replayed CUDA graph (whose autocast cannot cache the
copies). Reading the float32 weight in the kernel and rounding it there spares the copy;
two layers per launch spare a launch, and a GELU in the epilogue another.
A layer of few output tiles (a projection of 2048 columns is 64 tiles of 32) leaves most of
the GPU's SMs idle, and each of its programs reads a whole row of weight tiles: splitting
the reduction gives the read to more SMs (``_splits``), for one more read and write of a
float32 tile per program.
``ONLY_COMPLETE`` serves the compression networks, which a decoding step runs on the
window ending at its token: only one step in STRIDE completes a window, and the others
need not read the 2048 x 2048 first layer at all (16 MB in bf16 at the layer benchmark's
configuration, the largest read of a step).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from native_sparse_attention.kernels.cache_write import completes_window
from native_sparse_attention.kernels.launch import launch
from native_sparse_attention.kernels.library import (cdiv, dot_precision, multiprocessors, next_power_of_2,
                                                     unit_stride_last)

__all__ = ["CompleteWindows", "decode_linears"]

# (BLOCK_N, BLOCK_K, stages) by row tile, in four warps. A sweep at 1 to 64 rows of the
# layer benchmark's projection and compression networks alone on an H100 put 32 columns of
# 128-element steps in three stages ahead, but 16 columns at 32 rows. At 16 rows, timed in
# the replayed decoding step of one layer (4k cached tokens; batches of 1 and 8), 64-element
# steps in six stages were ahead of them: the step's linear layers 25.3 -> 22.1 us and
# 27.8 -> 24.7 us (the shapes tried: 16, 32 or 64 columns, 64 to 256 elements, 2 to 8 warps,
# 3 to 6 stages). Its first launch has 75 programs, too few to fill the GPU: finer steps in
# more stages keep more of each program's weight reads in flight.
_TILES = {16: (32, 64, 6), 32: (16, 128, 3), 64: (32, 128, 3)}
_MAX_BLOCK_M = 64
_WARPS = 4
# Launches of at most half as many programs as the GPU has SMs split their reductions, into
# as many splits as make about _SPLIT_PROGRAMS_PER_SM programs per SM, each split at least
# _MIN_SPLIT_STEPS steps of BLOCK_K. Timed alone on an H100 (bf16 rows, float32 weights, us
# per launch replayed from a CUDA graph, 1 and 8 rows, unsplit -> split): 2048 -> 2048
# (64 tiles) 8.5 -> 7.2 in 4 splits, 8192 -> 2048 30.7 -> 28.2, 2048 -> 256 (8 tiles) 8.3 ->
# 5.3 in 8. Launches of more programs lost: the projection with the gates (78 tiles) 8.4 ->
# 10.0 in 4 splits (7.8 in 3), 2048 -> 8192 (256 tiles) 25.8 -> 29.9 in 2, and at 32 rows
# 2048 -> 2048 (128 tiles of 16 columns) 6.7 -> 8.1 in 2: the first wave's programs already
# read near the GPU's bandwidth.
_SPLIT_PROGRAMS_PER_SM = 2
_MIN_SPLIT_STEPS = 4
_SQRT_HALF = tl.constexpr(0.7071067811865476)
_ACTIVATIONS = (None, "relu", "gelu")


@triton.jit
def _rows(POSITION, m_start, M, ROWS_PER_POSITION, WINDOW, STRIDE,
          ONLY_COMPLETE: tl.constexpr, BLOCK_M: tl.constexpr):
    """The program's row offsets and which of them to compute."""
    offs_m = m_start + tl.arange(0, BLOCK_M)
    active = offs_m < M
    if ONLY_COMPLETE:
        position = tl.load(POSITION + offs_m // ROWS_PER_POSITION, mask=active, other=0)
        active = active & completes_window(position, WINDOW, STRIDE)
    return offs_m, active


@triton.jit
def _partial_product(X, W, n_start, offs_m, active, N, K, stride_xm, stride_wn, split,
                     COMPUTE: tl.constexpr, PRECISION: tl.constexpr, SPLITS: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``X[m, k] @ W[n, k]^T`` over the split's range of k, in float32: ``[BLOCK_M, BLOCK_N]``."""
    offs_n = n_start + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    x_rows = X + offs_m[:, None].to(tl.int64) * stride_xm
    w_rows = W + offs_n[:, None].to(tl.int64) * stride_wn
    split_len = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLITS) * BLOCK_K
    k_begin = split * split_len
    k_end = tl.minimum(K, k_begin + split_len)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if tl.max(active.to(tl.int32), 0) > 0:
        for k_start in tl.range(k_begin, k_end, BLOCK_K):
            k_ok = k_start + offs_k < k_end
            x = tl.load(x_rows + k_start + offs_k[None, :], mask=active[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_rows + k_start + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            acc = tl.dot(x.to(COMPUTE), tl.trans(w.to(COMPUTE)), acc, input_precision=PRECISION)
    return acc


@triton.jit
def _summed_partials(PARTIALS, COUNTERS, acc, tile, split, SPLITS: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Stores the program's partial tile and counts it; returns whether the program
    arrived last and, if so, the sum of the tile's SPLITS partials in their order."""
    offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    tile_partials = PARTIALS + tile.to(tl.int64) * (SPLITS * BLOCK_M * BLOCK_N)
    tl.store(tile_partials + split * (BLOCK_M * BLOCK_N) + offs, acc)
    # Every thread's partial stored before the count releases them to the last program.
    tl.debug_barrier()
    last = tl.atomic_add(COUNTERS + tile, 1, sem="acq_rel", scope="gpu") == SPLITS - 1
    total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if last:
        for s in tl.static_range(SPLITS):
            # From L2: other SMs wrote them during this launch.
            total += tl.load(tile_partials + s * (BLOCK_M * BLOCK_N) + offs, cache_modifier=".cg")
    return last, total


@triton.jit
def _finish_tile(B, Y, acc, n_start, offs_m, active, M, N, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
                 COMPUTE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Stores ``Y[m, n] = act(acc + B[n])``, zero in rows not ``active``."""
    offs_n = n_start + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    if HAS_BIAS:
        acc += tl.load(B + offs_n, mask=n_ok, other=0.0).to(COMPUTE).to(tl.float32)[None, :]
    if ACTIVATION == "relu":
        acc = tl.maximum(acc, 0.0)
    elif ACTIVATION == "gelu":
        acc = acc.to(COMPUTE).to(tl.float32)
        acc = 0.5 * acc * (1.0 + tl.math.erf(acc * _SQRT_HALF))
    acc = tl.where(active[:, None], acc, 0.0)
    tl.store(Y + offs_m[:, None].to(tl.int64) * N + offs_n[None, :], acc.to(COMPUTE),
             mask=(offs_m < M)[:, None] & n_ok[None, :])


@triton.jit
def _linear_tile(X, W, B, Y, PARTIALS, COUNTERS, tile, n_start, offs_m, active, M, N, K, stride_xm, stride_wn,
                 HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, PRECISION: tl.constexpr, SPLITS: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The program's share of ``Y[m, n] = act(X[m] @ W[n]^T + B[n])`` on its tile, zero
    in rows not ``active``: all of it, or one split's, the last of which finishes it."""
    compute: tl.constexpr = Y.dtype.element_ty
    split = tl.program_id(2)
    acc = _partial_product(X, W, n_start, offs_m, active, N, K, stride_xm, stride_wn, split, compute, PRECISION,
                           SPLITS, BLOCK_M, BLOCK_N, BLOCK_K)
    if SPLITS == 1:
        _finish_tile(B, Y, acc, n_start, offs_m, active, M, N, HAS_BIAS, ACTIVATION, compute, BLOCK_N)
    else:
        last, total = _summed_partials(PARTIALS, COUNTERS, acc, tile, split, SPLITS, BLOCK_M, BLOCK_N)
        if last:
            _finish_tile(B, Y, total, n_start, offs_m, active, M, N, HAS_BIAS, ACTIVATION, compute, BLOCK_N)


@triton.jit
def _decode_linear_kernel(
    X0, W0, B0, Y0, X1, W1, B1, Y1, POSITION, PARTIALS, COUNTERS,
    stride_x0, stride_w0, stride_x1, stride_w1,
    M, N0, K0, N1, K1, TILES_0, ROWS_PER_POSITION, WINDOW, STRIDE,
    HAS_BIAS_0: tl.constexpr, HAS_BIAS_1: tl.constexpr, ACTIVATION: tl.constexpr, ONLY_COMPLETE: tl.constexpr,
    PRECISION: tl.constexpr, SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_m = tl.program_id(1)
    tile = pid * tl.num_programs(1) + pid_m
    offs_m, active = _rows(POSITION, pid_m * BLOCK_M, M, ROWS_PER_POSITION, WINDOW, STRIDE, ONLY_COMPLETE, BLOCK_M)
    if pid < TILES_0:
        _linear_tile(X0, W0, B0, Y0, PARTIALS, COUNTERS, tile, pid * BLOCK_N, offs_m, active, M, N0, K0, stride_x0,
                     stride_w0, HAS_BIAS_0, ACTIVATION, PRECISION, SPLITS, BLOCK_M, BLOCK_N, BLOCK_K)
    else:
        _linear_tile(X1, W1, B1, Y1, PARTIALS, COUNTERS, tile, (pid - TILES_0) * BLOCK_N, offs_m, active, M, N1, K1,
                     stride_x1, stride_w1, HAS_BIAS_1, ACTIVATION, PRECISION, SPLITS, BLOCK_M, BLOCK_N, BLOCK_K)


@dataclass(frozen=True)
class CompleteWindows:
    """Restricts ``decode_linears`` to the rows whose compression window is complete:
    ``position: [b]`` int64, each batch row's step token; rows ``r * rows_per_position ..``
    belong to batch row r; a window is ``window`` tokens ending at the token, complete
    when its first token is a multiple of ``stride`` (``cache_write.completes_window``)."""

    position: torch.Tensor
    rows_per_position: int
    window: int
    stride: int


def _allocate(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Allocation of every output; tests replace it to fill outputs with NaN first."""
    return torch.empty(shape, dtype=dtype, device=device)


def _splits(programs: int, steps: int, only: CompleteWindows | None, device: torch.device) -> int:
    """Programs per output tile for a launch of ``programs`` tiles whose reductions take
    ``steps`` BLOCK_K steps (see _SPLIT_PROGRAMS_PER_SM).
    The compression networks' launches (``only``) compute at one step in STRIDE and skip
    their weights at the others, which splits would not spare; the interpreter gets one."""
    if only is not None or device.type != "cuda" or 2 * programs > multiprocessors(device):
        return 1
    wanted = _SPLIT_PROGRAMS_PER_SM * multiprocessors(device) // programs
    return max(1, min(wanted, steps // _MIN_SPLIT_STEPS))


def decode_linears(inputs: Sequence[torch.Tensor], weights: Sequence[torch.Tensor],
                   biases: Sequence[torch.Tensor | None], dtype: torch.dtype, activation: str | None = None,
                   only: CompleteWindows | None = None, splits: int | None = None) -> list[torch.Tensor]:
    """``[act(x @ w^T + b) for x, w, b in zip(inputs, weights, biases)]`` in one launch:
    one or two layers; inputs ``[m, k_i]`` with the same m, weights ``[n_i, k_i]``, biases
    ``[n_i]`` or None (copied where not of unit stride along k_i), of any floating
    dtype each. Computed as ``F.linear`` computes in ``dtype`` (autocast's, say): every
    operand rounded to ``dtype``, products summed in float32; returns ``[m, n_i]``
    tensors of ``dtype``. ``activation`` (None, ``"relu"`` or ``"gelu"``, the exact one of
    ``nn.GELU()``) applies to every output; ``only`` computes the rows with a complete
    compression window and writes zeros to the others. ``splits``: programs per output
    tile, each over a range of the reduction (None: ``_splits``'s choice). On CUDA
    tensors, or on CPU tensors under ``TRITON_INTERPRET=1``; forward only, for inputs the
    caller has validated."""
    assert 1 <= len(inputs) == len(weights) == len(biases) <= 2 and activation in _ACTIVATIONS
    inputs, weights = [unit_stride_last(x) for x in inputs], [unit_stride_last(w) for w in weights]
    biases = [None if b is None else b.contiguous() for b in biases]
    m = inputs[0].shape[0]
    for x, w, b in zip(inputs, weights, biases):
        assert x.ndim == w.ndim == 2 and x.shape == (m, w.shape[1])
        assert b is None or b.shape == w.shape[:1]
    device = inputs[0].device
    outputs = [_allocate((m, w.shape[0]), dtype, device) for w in weights]
    block_m = min(max(next_power_of_2(m), 16), _MAX_BLOCK_M)
    block_n, block_k, stages = _TILES[block_m]
    tiles = [cdiv(w.shape[0], block_n) for w in weights]
    grid = (sum(tiles), cdiv(m, block_m))
    if splits is None:
        splits = _splits(grid[0] * grid[1], min(cdiv(w.shape[1], block_k) for w in weights), only, device)
    # Both segments' arguments; a lone layer's second segment is never reached.
    segments = list(zip(inputs, weights, biases, outputs))
    if len(segments) == 1:
        segments.append(segments[0])
    (x0, w0, b0, y0), (x1, w1, b1, y1) = segments
    position = only.position if only is not None else y0  # never read without `only`: any pointer does
    partials = counters = y0  # never touched unsplit
    if splits > 1:
        partials = _allocate((grid[0] * grid[1], splits, block_m, block_n), torch.float32, device)
        counters = torch.zeros(grid[0] * grid[1], dtype=torch.int32, device=device)
    launch(_decode_linear_kernel, (*grid, splits),
        x0, w0, w0 if b0 is None else b0, y0, x1, w1, w1 if b1 is None else b1, y1, position, partials, counters,
        x0.stride(0), w0.stride(0), x1.stride(0), w1.stride(0),
        m, w0.shape[0], w0.shape[1], w1.shape[0], w1.shape[1], tiles[0],
        *((only.rows_per_position, only.window, only.stride) if only is not None else (1, 1, 1)),
        HAS_BIAS_0=b0 is not None, HAS_BIAS_1=b1 is not None, ACTIVATION=activation or "",
        ONLY_COMPLETE=only is not None, PRECISION=dot_precision(dtype), SPLITS=splits,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=_WARPS, num_stages=stages,
    )
    return outputs
