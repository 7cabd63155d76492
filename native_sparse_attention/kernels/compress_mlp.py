"""The compression MLP ``relu(x @ W1^T + b1) @ W2^T + b2`` as one autograd node, for
``CompressMLP`` on CUDA tensors.

Notation
--------
R: rows (windows of all batches and heads), I: input features (a flattened window),
H: hidden features, O: output features (the head dim), padded to the power of two BLOCK_O.
X: ``[R, I]``, W1: ``[H, I]``, B1: ``[H]``, W2: ``[O, H]``, B2: ``[O]``, all of one dtype.
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
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from native_sparse_attention.kernels.library import dot_precision, launcher_op

__all__ = ["relu_mlp"]


@triton.jit
def _hidden_grad_kernel(
    DY, W2, HID, DH, BIAS_PARTS, R, H,
    O: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # DY: [R, O], W2: [O, H], HID, DH: [R, H], all contiguous; BIAS_PARTS: [cdiv(R, BLOCK_R),
    # H + O] float32, the column sums of each row tile's DH, then of its DY (the biases'
    # gradients, summed over the row tiles by the launcher). One program per (row tile,
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


def _tiles(device: torch.device) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_H, num_warps) of ``_hidden_grad_kernel``."""
    if device.type != "cuda":
        return 16, 16, 1  # interpreter: small tiles, so that test sizes span several
    return 128, 64, 4


def _allocate(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every buffer the kernel writes comes from here (tests poison it)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _fake_forward(x, w1, b1, w2, b2):
    return x.new_empty((x.shape[0], w2.shape[0])), x.new_empty((x.shape[0], w1.shape[0]))


@launcher_op("relu_mlp_forward", _fake_forward)
def _forward(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor,
             b2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [R, I] -> (y [R, O], hidden [R, H])"""
    hidden = torch._addmm_activation(b1, x, w1.t())
    return torch.addmm(b2, hidden, w2.t()), hidden


def _fake_backward(dy, x, hidden, w1, w2):
    return (x.new_empty(x.shape), w1.new_empty(w1.shape), w1.new_empty(w1.shape[:1]),
            w2.new_empty(w2.shape), w2.new_empty(w2.shape[:1]))


@launcher_op("relu_mlp_backward", _fake_backward)
def _backward(dy: torch.Tensor, x: torch.Tensor, hidden: torch.Tensor, w1: torch.Tensor,
              w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """dy: [R, O] -> (dx [R, I], dw1 [H, I], db1 [H], dw2 [O, H], db2 [O])"""
    rows, hidden_size = hidden.shape
    outputs = dy.shape[1]
    dy = dy.contiguous()
    block_r, block_h, warps = _tiles(dy.device)
    dh = _allocate(hidden.shape, hidden.dtype, dy.device)
    bias_parts = _allocate((triton.cdiv(rows, block_r), hidden_size + outputs), torch.float32, dy.device)
    if rows > 0:
        _hidden_grad_kernel[(triton.cdiv(rows, block_r), triton.cdiv(hidden_size, block_h))](
            dy, w2.contiguous(), hidden, dh, bias_parts, rows, hidden_size,
            O=outputs, BLOCK_O=max(16, triton.next_power_of_2(outputs)), BLOCK_R=block_r, BLOCK_H=block_h,
            DOT_PRECISION=dot_precision(dy.dtype), num_warps=warps,
        )
    bias_grads = bias_parts.sum(0)
    # Copies: an operator's outputs may not be views of one another.
    db1 = bias_grads[:hidden_size].to(w1.dtype, copy=True)
    db2 = bias_grads[hidden_size:].to(w2.dtype, copy=True)
    return dh @ w1, dh.t() @ x, db1, dy.t() @ hidden, db2


class _ReluMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w1, b1, w2, b2):
        y, hidden = _forward(x, w1, b1, w2, b2)
        ctx.save_for_backward(x, hidden, w1, w2)
        return y

    @staticmethod
    def backward(ctx, dy):
        return _backward(dy, *ctx.saved_tensors)


def relu_mlp(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor) -> torch.Tensor:
    """``relu(x @ w1^T + b1) @ w2^T + b2`` and its gradients (see the module docstring):
    x: [R, I], w1: [H, I], b1: [H], w2: [O, H], b2: [O], contiguous, of one dtype, on CUDA
    (or on the CPU under ``TRITON_INTERPRET=1``) -> [R, O]."""
    return _ReluMLP.apply(x, w1, b1, w2, b2)
