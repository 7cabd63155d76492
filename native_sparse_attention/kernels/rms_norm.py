"""RMSNorm that writes its output in another dtype (autocast's), as one autograd node for
eager steps on CUDA.

Notation
--------
R: rows (tokens of all batches), C: features (COLUMNS), padded to the power of two BLOCK_C.
X: ``[R, C]`` contiguous; W: the weight ``[C]``; Y: ``[R, C]`` in the output dtype,
``X * RSTD * W`` computed in float32 with ``RSTD = 1 / sqrt(mean(X^2) + EPS)`` per row,
kept ``[R]`` float32 for the backward. DY: Y's gradient; DX: ``[R, C]`` in X's dtype,
``RSTD * (W * DY - XHAT * mean(XHAT * W * DY))`` with ``XHAT = X * RSTD``; DW: the sum of
``DY * XHAT`` over the rows: each backward program walks every P-th row, keeps its own
partial sum ``[P, C]`` float32, and ``library.column_sums`` adds the P partials into W's
dtype (torch's sum and cast took 18 us at the layer benchmark's n = 8192 on an H100).

The layer norms its float32 input and its projections read the result in bf16 under
autocast. Eager PyTorch wrote the float32 norm, cast it, and in the backward cast the
gradient back to float32 before the norm's own two kernels: at the layer benchmark's
n = 65536 (dim 2048) on an H100, 0.72 ms of forward and 1.65 ms of backward kernels per
step, against the 0.26 and 0.47 ms of the single passes that Inductor compiles (which
compiled steps keep).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import nn

from native_sparse_attention.compress import has_hooks
from native_sparse_attention.kernels.launch import launch
from native_sparse_attention.kernels.library import KERNEL_DTYPES, column_sums, multiprocessors, next_power_of_2

__all__ = ["rms_norm", "normed_for_projection", "MAX_COLUMNS"]

# Rows are held whole in registers; wider ones take PyTorch's norm.
MAX_COLUMNS = 16384


@triton.jit
def _rms_norm_fwd_kernel(X, W, Y, RSTD, R, EPS, COLUMNS: tl.constexpr, BLOCK_C: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_C)
    ok = cols < COLUMNS
    x = tl.load(X + row * COLUMNS + cols, mask=ok, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / COLUMNS + EPS)
    w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(Y + row * COLUMNS + cols, (x * rstd * w).to(Y.dtype.element_ty), mask=ok)
    tl.store(RSTD + row, rstd)


@triton.jit
def _rms_norm_bwd_kernel(X, W, DY, RSTD, DX, DW_PARTS, R, COLUMNS: tl.constexpr, BLOCK_C: tl.constexpr):
    program = tl.program_id(0)
    programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_C)
    ok = cols < COLUMNS
    w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_C], dtype=tl.float32)
    for step in range(0, tl.cdiv(R - program, programs)):
        row = program.to(tl.int64) + step * programs
        offsets = row * COLUMNS + cols
        x = tl.load(X + offsets, mask=ok, other=0.0).to(tl.float32)
        dy = tl.load(DY + offsets, mask=ok, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row)
        x_hat = x * rstd
        w_dy = w * dy
        correction = tl.sum(x_hat * w_dy, 0) / COLUMNS
        tl.store(DX + offsets, (rstd * (w_dy - x_hat * correction)).to(DX.dtype.element_ty), mask=ok)
        dw += dy * x_hat
    tl.store(DW_PARTS + program * COLUMNS + cols, dw, mask=ok)


def _allocate(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every buffer the kernels write comes from here (tests poison it)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _num_warps(block_c: int) -> int:
    return min(16, max(1, block_c // 256))


def _backward_programs(rows: int, device: torch.device) -> int:
    """Four programs per SM (each walking every P-th row), at most one per row."""
    if device.type != "cuda":
        return min(rows, 3)  # interpreter: a few, so that tests walk several rows each
    return max(1, min(rows, 4 * multiprocessors(device)))


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, dtype):
        rows, columns = x.shape
        y = _allocate((rows, columns), dtype, x.device)
        rstd = _allocate((rows,), torch.float32, x.device)
        block_c = next_power_of_2(columns)
        if rows:
            launch(_rms_norm_fwd_kernel, (rows,), x, weight, y, rstd, rows, eps, COLUMNS=columns, BLOCK_C=block_c,
                   num_warps=_num_warps(block_c))
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        rows, columns = x.shape
        dy = dy.contiguous()
        programs = _backward_programs(rows, x.device)
        dx = _allocate((rows, columns), x.dtype, x.device)
        if not rows:
            return dx, torch.zeros_like(weight), None, None
        parts = _allocate((programs, columns), torch.float32, x.device)
        block_c = next_power_of_2(columns)
        launch(_rms_norm_bwd_kernel, (programs,), x, weight, dy, rstd, dx, parts, rows, COLUMNS=columns,
               BLOCK_C=block_c, num_warps=_num_warps(block_c))
        return dx, column_sums(parts, _allocate((columns,), weight.dtype, x.device)), None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """``x * rsqrt(mean(x^2, -1) + eps) * weight`` in float32, written in ``dtype``:
    x: [..., C], weight: [C] -> [..., C]. Differentiable in x and weight (their gradients in
    their own dtypes). x, weight and ``dtype`` float16, bfloat16 or float32, C at most
    ``MAX_COLUMNS``; on CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1``.
    """
    for name, value in (("x", x.dtype), ("weight", weight.dtype), ("dtype", dtype)):
        if value not in KERNEL_DTYPES:
            raise TypeError(f"{name} must be float16, bfloat16 or float32, got {value}")
    columns = x.shape[-1]
    if weight.shape != (columns,) or not 1 <= columns <= MAX_COLUMNS:
        raise ValueError(f"weight must be [{columns}] (x's last dim, at most {MAX_COLUMNS}), "
                         f"got {tuple(weight.shape)}")
    y = _RMSNorm.apply(x.reshape(-1, columns).contiguous(), weight.contiguous(), eps, dtype)
    return y.view(x.shape)


def normed_for_projection(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``norm(x)`` in autocast's dtype where autocast is on, the input the layers'
    projections read; written by ``rms_norm`` in eager steps where ``norm`` is an
    ``nn.RMSNorm`` as constructed (a subclass or a hook expects its forward) and the
    input one it takes: float32 under autocast (which leaves the norm itself in float32),
    any kernel dtype without. x: [..., C].

    One copy in autocast's dtype serves every projection that reads it: left to autocast,
    each projection makes its own (a pass over x), and the backward casts each gradient to
    float32 to sum them; with one copy they are summed in autocast's dtype and cast once.
    """
    device = x.device.type
    autocast = torch.is_autocast_enabled(device)
    dtype = torch.get_autocast_dtype(device) if autocast else x.dtype
    if (type(norm) is nn.RMSNorm and not has_hooks(norm) and norm.weight is not None
            and norm.weight.dtype in KERNEL_DTYPES and not torch.compiler.is_compiling()
            and (x.dtype == torch.float32 if autocast else x.dtype in KERNEL_DTYPES) and x.shape[-1] <= MAX_COLUMNS):
        eps = norm.eps if norm.eps is not None else torch.finfo(x.dtype).eps
        return rms_norm(x, norm.weight, eps, dtype)
    normed = norm(x)
    return normed.to(dtype) if autocast else normed
