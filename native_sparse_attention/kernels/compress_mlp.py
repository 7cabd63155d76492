"""The compression MLP ``relu(x @ W1^T + b1) @ W2^T + b2`` as one autograd node, for
``CompressMLP`` on CUDA tensors.

Notation
--------
R: rows (windows of all batches and heads), I: input features (a flattened window),
H: hidden features, O: output features (the head dim), padded to the power of two BLOCK_O.
X: ``[R, I]``, W1: ``[H, I]``, B1: ``[H]``, W2: ``[O, H]``, B2: ``[O]``, the weights cast
to X's dtype.
HID: ``relu(X @ W1^T + B1)``, ``[R, H]``, the hidden activations saved for the backward.
DY: ``[R, O]``, the output gradient.

Forward: two cuBLAS matmuls, the ReLU in the first one's epilogue
(``torch._addmm_activation``). Compiled as separate ops, the ReLU was a kernel of its own
that also wrote a boolean mask of the negative activations for the backward.

Backward: ``_hidden_grad_kernel`` computes ``DH = (DY @ W2) * (HID > 0)`` tile by tile,
with the column sums of each row tile (B1's gradient), in one pass over HID: the product
has only O terms per entry, so the kernel is bound by reading HID and writing DH. The
weight and input gradients are cuBLAS matmuls. Compiled as separate ops, DY @ W2 was
written, read back, masked and written again, and summed in a kernel of its own: at the
layer benchmark's configuration (two MLPs of 2048 -> 2048 -> 64 over 8190 windows,
n = 65536, bf16, H100) the ReLU and mask kernels took 0.13 ms of each step.

Mixed precision: the weights may come in another dtype than X, float32 master weights
under autocast. The node casts all four to X's dtype in one launch (``_cast_kernel``),
its matmuls write the weights' gradients in the weights' dtype (cuBLAS's float32 output
of bf16 / fp16 products) where autograd would otherwise cast each one, and
``_bias_grads_kernel`` sums both biases' gradients in it.
The casts that autocast and Inductor make instead cost eight kernels per MLP in each
compiled training step, four of them a few microseconds over a handful of bias elements.
In the layer benchmark's compiled step on an H100 (two MLPs of 2048 -> 2048 -> 64 over
1022 windows at n = 8192) that took 3.37-3.39 -> 3.33 ms (medians of 40 steps, three runs
each); at 65536 the difference was inside the runs' spread.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from native_sparse_attention.kernels.launch import launch
from native_sparse_attention.kernels.library import (
    cast_block, cdiv, dot_precision, launcher_op, matmul_as, next_power_of_2,
)

__all__ = ["relu_mlp"]


@triton.jit
def _hidden_grad_kernel(
    DY, W2, HID, DH, BIAS_PARTS, R, H,
    O: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # DY: [R, O], W2: [O, H], HID, DH: [R, H], all contiguous; BIAS_PARTS: [cdiv(R, BLOCK_R),
    # H + O] float32, the column sums of each row tile's DH, then of its DY (the biases'
    # gradients, summed over the row tiles by _bias_grads_kernel). One program per (row tile,
    # column tile).
    row_tile = tl.program_id(0)
    col_tile = tl.program_id(1)
    rows = row_tile * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = col_tile * BLOCK_H + tl.arange(0, BLOCK_H)
    outs = tl.arange(0, BLOCK_O)
    row_ok = rows < R
    col_ok = cols < H
    out_ok = outs < O
    # int64: R * H may pass 2^31 (a batch of long sequences).
    row_offsets = rows.to(tl.int64)[:, None]
    dy = tl.load(DY + row_offsets * O + outs[None, :], mask=row_ok[:, None] & out_ok[None, :], other=0.0)
    w2 = tl.load(W2 + outs[:, None] * H + cols[None, :], mask=out_ok[:, None] & col_ok[None, :], other=0.0)
    tile = row_ok[:, None] & col_ok[None, :]
    hidden = tl.load(HID + row_offsets * H + cols[None, :], mask=tile, other=0.0)
    dh = tl.where(hidden > 0, tl.dot(dy, w2, input_precision=DOT_PRECISION), 0.0)
    tl.store(DH + row_offsets * H + cols[None, :], dh.to(DH.dtype.element_ty), mask=tile)
    parts = BIAS_PARTS + row_tile * (H + O)
    tl.store(parts + cols, tl.sum(dh, 0), mask=col_ok)
    if col_tile == 0:
        tl.store(parts + H + outs, tl.sum(dy.to(tl.float32), 0), mask=out_ok)


@triton.jit
def _bias_grads_kernel(BIAS_PARTS, DB1, DB2, ROW_TILES, H, O, BLOCK: tl.constexpr):
    # BIAS_PARTS: [ROW_TILES, H + O] float32 (``_hidden_grad_kernel``) -> DB1 [H], DB2 [O],
    # the sums over the row tiles in a fixed order, in the weights' dtype.
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    width = H + O
    total = tl.zeros([BLOCK], tl.float32)
    for tile in range(ROW_TILES):
        total += tl.load(BIAS_PARTS + tile * width + cols, mask=cols < width, other=0.0)
    tl.store(DB1 + cols, total.to(DB1.dtype.element_ty), mask=cols < H)
    tl.store(DB2 + (cols - H), total.to(DB2.dtype.element_ty), mask=(cols >= H) & (cols < width))


@triton.jit
def _cast_kernel(W1, B1, W2, B2, W1_OUT, B1_OUT, W2_OUT, B2_OUT, W1_SIZE, B1_SIZE, W2_SIZE, B2_SIZE,
                 BLOCK: tl.constexpr):
    # The four weights (contiguous) into copies of another dtype: the first
    # cdiv(W1_SIZE, BLOCK) programs take W1, the next ones B1, then W2, then B2.
    block = tl.program_id(0)
    w1_blocks = tl.cdiv(W1_SIZE, BLOCK)
    b1_blocks = tl.cdiv(B1_SIZE, BLOCK)
    w2_blocks = tl.cdiv(W2_SIZE, BLOCK)
    if block < w1_blocks:
        cast_block(W1, W1_OUT, block, W1_SIZE, BLOCK)
    elif block < w1_blocks + b1_blocks:
        cast_block(B1, B1_OUT, block - w1_blocks, B1_SIZE, BLOCK)
    elif block < w1_blocks + b1_blocks + w2_blocks:
        cast_block(W2, W2_OUT, block - w1_blocks - b1_blocks, W2_SIZE, BLOCK)
    else:
        cast_block(B2, B2_OUT, block - w1_blocks - b1_blocks - w2_blocks, B2_SIZE, BLOCK)


def _tiles(device: torch.device) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_H, num_warps) of ``_hidden_grad_kernel``."""
    if device.type != "cuda":
        return 16, 16, 1  # interpreter: small tiles, so that test sizes span several
    return 128, 64, 4


# Elements per program of the weights' cast and of the biases' gradients.
_CAST_BLOCK = 4096
_BIAS_BLOCK = 512


def _allocate(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every buffer the kernel writes comes from here (tests poison it)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _fake_cast(w1, b1, w2, b2, dtype):
    return tuple(w.new_empty(w.shape, dtype=dtype) for w in (w1, b1, w2, b2))


@launcher_op("cast_weights", _fake_cast)
def _cast(w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor,
          dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Copies of the four weights (contiguous) in ``dtype``, written by one kernel.
    (``torch._foreach_copy_`` launches one too, but its chunks of a few thousand elements
    moved W1 at half the bandwidth: 0.021 against 0.010 ms for 2048 x 2048 float32 to
    bf16 on an H100.)"""
    weights = (w1, b1, w2, b2)
    copies = tuple(_allocate(w.shape, dtype, w.device) for w in weights)
    blocks = sum(cdiv(w.numel(), _CAST_BLOCK) for w in weights)
    launch(_cast_kernel, (blocks,), *weights, *copies, *(w.numel() for w in weights), BLOCK=_CAST_BLOCK, num_warps=4)
    return copies


def _fake_forward(x, w1, b1, w2, b2):
    return x.new_empty((x.shape[0], w2.shape[0])), x.new_empty((x.shape[0], w1.shape[0]))


@launcher_op("relu_mlp_forward", _fake_forward)
def _forward(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor,
             b2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [R, I] -> (y [R, O], hidden [R, H]); the weights in x's dtype."""
    hidden = torch._addmm_activation(b1, x, w1.t())
    return torch.addmm(b2, hidden, w2.t()), hidden


def _fake_backward(dy, x, hidden, w1, w2, weight_dtype):
    return (x.new_empty(x.shape), w1.new_empty(w1.shape, dtype=weight_dtype),
            w1.new_empty(w1.shape[:1], dtype=weight_dtype), w2.new_empty(w2.shape, dtype=weight_dtype),
            w2.new_empty(w2.shape[:1], dtype=weight_dtype))


@launcher_op("relu_mlp_backward", _fake_backward)
def _backward(dy: torch.Tensor, x: torch.Tensor, hidden: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
              weight_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                  torch.Tensor]:
    """dy: [R, O]; w1, w2 in x's dtype -> (dx [R, I], dw1 [H, I], db1 [H], dw2 [O, H], db2 [O]),
    the weights' gradients in ``weight_dtype``."""
    rows, hidden_size = hidden.shape
    outputs = dy.shape[1]
    dy = dy.contiguous()
    block_r, block_h, warps = _tiles(dy.device)
    dh = _allocate(hidden.shape, hidden.dtype, dy.device)
    bias_parts = _allocate((cdiv(rows, block_r), hidden_size + outputs), torch.float32, dy.device)
    if rows > 0:
        launch(_hidden_grad_kernel, (cdiv(rows, block_r), cdiv(hidden_size, block_h)),
            dy, w2.contiguous(), hidden, dh, bias_parts, rows, hidden_size,
            O=outputs, BLOCK_O=max(16, next_power_of_2(outputs)), BLOCK_R=block_r, BLOCK_H=block_h,
            DOT_PRECISION=dot_precision(dy.dtype), num_warps=warps,
        )
    db1 = _allocate((hidden_size,), weight_dtype, dy.device)
    db2 = _allocate((outputs,), weight_dtype, dy.device)
    launch(_bias_grads_kernel, (cdiv(hidden_size + outputs, _BIAS_BLOCK),),
        bias_parts, db1, db2, bias_parts.shape[0], hidden_size, outputs, BLOCK=_BIAS_BLOCK,
    )
    return (dh @ w1, matmul_as(dh.t(), x, weight_dtype), db1, matmul_as(dy.t(), hidden, weight_dtype), db2)


class _ReluMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w1, b1, w2, b2):
        weights = (w1, b1, w2, b2)
        if any(w.dtype != x.dtype for w in weights):
            weights = _cast(*weights, x.dtype)
        y, hidden = _forward(x, *weights)
        ctx.save_for_backward(x, hidden, weights[0], weights[2])
        ctx.weight_dtype = w1.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        return _backward(dy, *ctx.saved_tensors, ctx.weight_dtype)


def relu_mlp(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor) -> torch.Tensor:
    """``relu(x @ w1^T + b1) @ w2^T + b2`` and its gradients (see the module docstring):
    x: [R, I], w1: [H, I], b1: [H], w2: [O, H], b2: [O], contiguous, on CUDA (or on the
    CPU under ``TRITON_INTERPRET=1``) -> [R, O] in x's dtype, computed in it. The weights
    share one floating dtype, x's or another (float32 master weights under autocast); their
    gradients come in it."""
    return _ReluMLP.apply(x, w1, b1, w2, b2)
