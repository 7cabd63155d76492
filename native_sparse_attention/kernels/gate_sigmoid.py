"""The branches' gates ``sigmoid(logits + bias)``, rearranged branch-major, as one
autograd node for eager steps on CUDA.

Notation
--------
R: tokens of all batches (Z * N), C = 3 * H gate columns, padded to the power of two
BLOCK_C: column ``h * 3 + s`` is head h's gate of branch s (compressed, selected,
sliding). LOGITS: ``[R, C]``, any row stride (the layer's gate columns of its projection);
BIAS: ``[C]`` or none (HAS_BIAS). G: the gates ``[3, Z, H, N]`` contiguous in LOGITS'
dtype, ``sigmoid(round(LOGITS + round(BIAS)))`` with the sum and the sigmoid rounded to
that dtype as the eager ops round them. DG: G's gradient (any dtype, contiguous);
DLOGITS: ``[R, C]`` contiguous, ``DG * G * (1 - G)``; each backward program leaves the
column sums of its BLOCK_R rows in ``DBIAS_PARTS`` ``[cdiv(R, BLOCK_R), C]`` float32, which
``library.column_sums`` adds over the programs in a fixed order into the bias's gradient,
in the bias's dtype.

Eager PyTorch took five kernels over strided views (the bias's add, the sigmoid, its
backward, a copy of the gradient back into the logits' layout and the bias's sum): 0.15 ms
at the layer benchmark's n = 65536 on an H100. Compiled steps keep them, fused by Inductor.
The bias's sum was torch's ``sum(0)`` and a cast after the backward kernel; on an H200
(CUDA graphs, [128, 96] -> [96] and [1024, 96] -> [96] partials) they took 3.8 and 9.5 us,
``column_sums`` 1.6 and 2.2 us.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from native_sparse_attention.kernels.launch import launch
from native_sparse_attention.kernels.library import KERNEL_DTYPES, cdiv, column_sums, next_power_of_2

__all__ = ["gate_sigmoids"]



@triton.jit
def _gate_offsets(rows, cols, R, N, H, C: tl.constexpr):
    """Offsets into [3, Z, H, N] of token rows x gate columns, and their mask."""
    z = rows // N
    n = rows % N
    h = cols // 3
    branch = cols % 3
    token = (z * H).to(tl.int64) * N + n
    offsets = token[:, None] + ((branch * H).to(tl.int64) * R + h.to(tl.int64) * N)[None, :]
    return offsets, (rows < R)[:, None] & (cols < C)[None, :]


@triton.jit
def _gate_sigmoid_fwd_kernel(
    LOGITS, BIAS, G, stride_r, R, N, H,
    C: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_C)
    offsets, mask = _gate_offsets(rows, cols, R, N, H, C)
    logits = tl.load(LOGITS + rows.to(tl.int64)[:, None] * stride_r + cols[None, :], mask=mask, other=0.0)
    x = logits.to(tl.float32)
    if HAS_BIAS:
        bias = tl.load(BIAS + cols, mask=cols < C, other=0.0).to(G.dtype.element_ty)
        x = (x + bias.to(tl.float32)[None, :]).to(G.dtype.element_ty).to(tl.float32)
    tl.store(G + offsets, tl.sigmoid(x).to(G.dtype.element_ty), mask=mask)


@triton.jit
def _gate_sigmoid_bwd_kernel(
    G, DG, DLOGITS, DBIAS_PARTS, R, N, H,
    C: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_C)
    offsets, mask = _gate_offsets(rows, cols, R, N, H, C)
    g = tl.load(G + offsets, mask=mask, other=0.0).to(tl.float32)
    dg = tl.load(DG + offsets, mask=mask, other=0.0).to(tl.float32)
    dlogits = (dg * g * (1.0 - g)).to(DLOGITS.dtype.element_ty)
    tl.store(DLOGITS + rows.to(tl.int64)[:, None] * C + cols[None, :], dlogits, mask=mask)
    if HAS_BIAS:
        tl.store(DBIAS_PARTS + tl.program_id(0) * C + cols, tl.sum(dlogits.to(tl.float32), 0), mask=cols < C)


def _allocate(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every buffer the kernels write comes from here (tests poison it)."""
    return torch.empty(shape, dtype=dtype, device=device)


_BLOCK_R = 64


class _GateSigmoids(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, bias):
        b, n, columns = logits.shape
        rows = logits.flatten(0, 1)
        gates = _allocate((3, b, columns // 3, n), logits.dtype, logits.device)
        grid = (cdiv(b * n, _BLOCK_R),)
        launch(_gate_sigmoid_fwd_kernel, grid,
            rows, bias if bias is not None else rows, gates, rows.stride(0), b * n, n, columns // 3,
            C=columns, HAS_BIAS=bias is not None, BLOCK_R=_BLOCK_R, BLOCK_C=next_power_of_2(columns),
        )
        ctx.save_for_backward(gates)
        ctx.bias_dtype = None if bias is None else bias.dtype
        return gates

    @staticmethod
    def backward(ctx, dgates):
        (gates,) = ctx.saved_tensors
        _, b, heads, n = gates.shape
        columns = 3 * heads
        dgates = dgates.contiguous()
        dlogits = _allocate((b, n, columns), gates.dtype, gates.device)
        programs = cdiv(b * n, _BLOCK_R)
        has_bias = ctx.bias_dtype is not None
        parts = _allocate((programs, columns) if has_bias else (0,), torch.float32, gates.device)
        launch(_gate_sigmoid_bwd_kernel, (programs,),
            gates, dgates, dlogits, parts, b * n, n, heads,
            C=columns, HAS_BIAS=has_bias, BLOCK_R=_BLOCK_R, BLOCK_C=next_power_of_2(columns),
        )
        if not has_bias:
            return dlogits, None
        return dlogits, column_sums(parts, _allocate((columns,), ctx.bias_dtype, gates.device))


def gate_sigmoids(logits: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``sigmoid(logits + bias)`` rearranged ``b n (h s) -> s b h n``: logits [b, n, 3 * h]
    (unit stride along the columns and between tokens of a batch row, any row stride),
    bias [3 * h] or None -> the gates [3, b, h, n] contiguous in logits' dtype, rounded as
    eager ``(logits + bias.to(logits.dtype)).sigmoid()``. Differentiable in logits and
    bias. float16, bfloat16 or float32; on CUDA tensors, or on CPU tensors under
    ``TRITON_INTERPRET=1``.
    """
    if logits.dtype not in KERNEL_DTYPES or (bias is not None and bias.dtype not in KERNEL_DTYPES):
        raise TypeError(f"logits and bias must be float16, bfloat16 or float32, got {logits.dtype}"
                        f"{'' if bias is None else f' and {bias.dtype}'}")
    if logits.ndim != 3 or logits.shape[-1] % 3 or (bias is not None and bias.shape != logits.shape[-1:]):
        raise ValueError(f"logits must be [b, n, 3 * h] and bias [3 * h], got {tuple(logits.shape)}"
                         f"{'' if bias is None else f' and {tuple(bias.shape)}'}")
    if logits.stride(-1) != 1 or logits.stride(0) != logits.shape[1] * logits.stride(1):
        logits = logits.contiguous()
    return _GateSigmoids.apply(logits, bias)
