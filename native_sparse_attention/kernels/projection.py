"""The layers' input projection ``x @ cat(weights)^T`` as one autograd node for eager
steps on CUDA.

The sparse layer projects its normed input through the rows of its q / k / v weight and
of its gates' weight in one matmul; the dense layer through its q / k / v weight alone.
Under autocast the weights are float32 and the matmul runs in bf16 or fp16.

Eager PyTorch concatenated the float32 weights (a copy), cast the concatenation (another),
and in the backward cast the weight's bf16 gradient back to float32 (a third) before
splitting it. Here one kernel (``_cast_concat_kernel``) writes the concatenation in the
matmul's dtype, and cuBLAS writes the weights' gradient in their own dtype (the float32
output of bf16 / fp16 products, ``library.matmul_as``), which the backward hands out as
row slices. At the layer benchmark's n = 8192 on an H100 (2400 rows of 2048 in the sparse
layer) the eager ops took 14, 7 and 17 us of kernels per step. Compiled steps keep the
PyTorch ops, which Inductor fuses with their neighbours.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from native_sparse_attention.kernels.launch import launch
from native_sparse_attention.kernels.library import KERNEL_DTYPES, cast_block, cdiv, matmul_as

__all__ = ["project", "projected"]

# Elements per program of the weights' cast.
_CAST_BLOCK = 4096


@triton.jit
def _cast_concat_kernel(W0, W1, OUT, SIZE0, SIZE1, BLOCK: tl.constexpr):
    # W0, W1: contiguous weights of one row width; OUT: contiguous, W0's rows then W1's, in
    # OUT's dtype. The first cdiv(SIZE0, BLOCK) programs take W0, the others W1.
    block = tl.program_id(0)
    w0_blocks = tl.cdiv(SIZE0, BLOCK)
    if block < w0_blocks:
        cast_block(W0, OUT, block, SIZE0, BLOCK)
    else:
        cast_block(W1, OUT + SIZE0, block - w0_blocks, SIZE1, BLOCK)


def _allocate(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every buffer the kernel writes comes from here (tests poison it)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _concatenated(weights: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The weights' rows, one after the other, contiguous in ``dtype``: one weight
    already in ``dtype`` as it is, anything else written by one kernel."""
    if len(weights) == 1 and weights[0].dtype == dtype:
        return weights[0]
    first, second = (weights[0], weights[0][:0]) if len(weights) == 1 else weights
    out = _allocate((first.shape[0] + second.shape[0], first.shape[1]), dtype, first.device)
    blocks = cdiv(first.numel(), _CAST_BLOCK) + cdiv(second.numel(), _CAST_BLOCK)
    if blocks:
        launch(_cast_concat_kernel, (blocks,), first, second, out, first.numel(), second.numel(),
               BLOCK=_CAST_BLOCK, num_warps=4)
    return out


class _Projection(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, *weights):
        weight = _concatenated(weights, x.dtype)
        ctx.save_for_backward(x, weight)
        ctx.rows = [w.shape[0] for w in weights]
        ctx.weight_dtype = weights[0].dtype
        if torch.is_autocast_enabled(x.device.type):
            # Computed in x's dtype, which autocast would change.
            with torch.autocast(x.device.type, enabled=False):
                return x @ weight.t()
        return x @ weight.t()

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx = dy @ weight if ctx.needs_input_grad[0] else None
        if not any(ctx.needs_input_grad[1:]):
            return dx, *(None for _ in ctx.rows)
        dweight = matmul_as(dy.reshape(-1, dy.shape[-1]).t(), x.reshape(-1, x.shape[-1]), ctx.weight_dtype)
        return dx, *dweight.split(ctx.rows)


def project(x: torch.Tensor, weights: Sequence[torch.Tensor]) -> torch.Tensor:
    """``x @ cat(weights)^T`` in x's dtype: x: [..., in], one or two weights [out_i, in],
    contiguous, of one dtype (x's, or float32 master weights under autocast) -> [..., sum
    out_i]. Differentiable in x and the weights, whose gradients come in their dtype.
    Float16, bfloat16 or float32; on CUDA tensors, or on CPU tensors under
    ``TRITON_INTERPRET=1``.
    """
    if not 1 <= len(weights) <= 2:
        raise ValueError(f"project takes one or two weights, got {len(weights)}")
    for name, value in (("x", x.dtype), *((f"weights[{i}]", w.dtype) for i, w in enumerate(weights))):
        if value not in KERNEL_DTYPES:
            raise TypeError(f"{name} must be float16, bfloat16 or float32, got {value}")
    if len({w.dtype for w in weights}) != 1:
        raise TypeError(f"the weights must share one dtype, got {[w.dtype for w in weights]}")
    if any(w.ndim != 2 or w.shape[1] != x.shape[-1] for w in weights):
        raise ValueError(f"weights must be [out, {x.shape[-1]}] (x's last dim), got {[tuple(w.shape) for w in weights]}")
    return _Projection.apply(x, *(w.contiguous() for w in weights))


def projected(x: torch.Tensor, weights: Sequence[torch.Tensor]) -> torch.Tensor:
    """``F.linear(x, cat(weights))`` as the layers compute it: in eager CUDA steps through
    ``project``, in autocast's dtype where autocast is on; compiled, or elsewhere, through
    the PyTorch ops."""
    device = x.device.type
    autocast = torch.is_autocast_enabled(device) and x.dtype != torch.float64  # autocast leaves float64
    dtype = torch.get_autocast_dtype(device) if autocast else x.dtype
    if (x.is_cuda and not torch.compiler.is_compiling() and dtype in KERNEL_DTYPES
            and all(w.dtype in KERNEL_DTYPES and (autocast or w.dtype == dtype) for w in weights)):
        return project(x.to(dtype), weights)
    return F.linear(x, weights[0] if len(weights) == 1 else torch.cat(tuple(weights)))
