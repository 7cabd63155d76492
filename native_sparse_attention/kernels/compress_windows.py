"""The compression windows with their intra-block positions, ``windows(t) + pos``, as one
autograd node for eager steps on CUDA.

Notation
--------
Z: batch size, H: kv heads, N: tokens, D: head dim (HEAD_DIM), padded to the power of two
BLOCK_D. SIZE, STRIDE: window ``w`` holds tokens ``[w * STRIDE, w * STRIDE + SIZE)``;
W = (N - SIZE) // STRIDE + 1 complete windows. OVERLAP = ceil(SIZE / STRIDE): the most
windows that hold one token.
T: keys or values ``[Z, H, N, D]``, any strides with unit stride along D. POS: the
positions ``[H, SIZE, D]``, contiguous. OUT: ``[Z, H, W, SIZE, D]`` contiguous,
``T[z, h, w * STRIDE + t] + POS[h, t]`` computed in float32 and rounded once to OUT's
dtype. DOUT: OUT's gradient; DT: ``[Z, H, N, D]`` contiguous, the sum over the windows
holding each token (zero past the last window).

Forward: one program per (z, h) and WINDOWS consecutive windows; backward: one program per
(z, h) and BLOCK_N tokens, each token gathering its OVERLAP windows' rows, so nothing is
added atomically. POS's gradient is a sum over (z, w) that torch reduces.

Eager PyTorch ran the same as an add in float32 whose output kept the unfold view's
permuted layout, a copy to make it contiguous, and the compression MLP's cast to bf16;
and backward, the cast's and the add's backward casts, the sum for POS, and unfold's
backward (a zero fill and a scatter). At the layer benchmark's n = 65536 on an H100 (two
kv heads of 64, windows of 32 every 16 tokens, keys and values) that was 0.37 ms of
forward and 0.47 ms of backward kernels per step. Compiled steps keep the PyTorch ops,
which Inductor fuses with their neighbours (``compress.sliding_windows``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from native_sparse_attention.kernels.library import KERNEL_DTYPES

__all__ = ["positioned_windows"]



@triton.jit
def _windows_fwd_kernel(
    T, POS, OUT, stride_tz, stride_th, stride_tn, H, W, SIZE, STRIDE,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr, WINDOWS: tl.constexpr,
):
    zh = tl.program_id(0)
    z = zh // H
    h = zh % H
    rows = tl.arange(0, WINDOWS * BLOCK_T)
    window = tl.program_id(1) * WINDOWS + rows // BLOCK_T
    t = rows % BLOCK_T
    d = tl.arange(0, BLOCK_D)
    mask = ((window < W) & (t < SIZE))[:, None] & (d < HEAD_DIM)[None, :]
    token = (window * STRIDE + t).to(tl.int64)
    src = T + z.to(tl.int64) * stride_tz + h.to(tl.int64) * stride_th + token[:, None] * stride_tn + d[None, :]
    pos = POS + (h * SIZE + t)[:, None] * HEAD_DIM + d[None, :]
    value = tl.load(src, mask=mask).to(tl.float32) + tl.load(pos, mask=mask).to(tl.float32)
    # int64: Z * H * W * SIZE * D passes 2^31 for long batches.
    dst = OUT + ((zh.to(tl.int64) * W + window) * SIZE + t)[:, None] * HEAD_DIM + d[None, :]
    tl.store(dst, value.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _windows_bwd_kernel(
    DOUT, DT, N, W, SIZE, STRIDE,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, OVERLAP: tl.constexpr,
):
    zh = tl.program_id(0).to(tl.int64)
    tokens = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    d_ok = (d < HEAD_DIM)[None, :]
    total = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    # The windows holding token n are the last OVERLAP that start at or before it, less
    # those it lies past the end of.
    latest = tokens // STRIDE
    for back in tl.static_range(OVERLAP):
        window = latest - back
        t = tokens - window * STRIDE
        ok = (window >= 0) & (window < W) & (t < SIZE) & (tokens < N)
        src = DOUT + ((zh * W + window) * SIZE + t)[:, None] * HEAD_DIM + d[None, :]
        total += tl.load(src, mask=ok[:, None] & d_ok, other=0.0).to(tl.float32)
    dst = DT + (zh * N + tokens)[:, None] * HEAD_DIM + d[None, :]
    tl.store(dst, total.to(DT.dtype.element_ty), mask=(tokens < N)[:, None] & d_ok)


def _allocate(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every buffer the kernels write comes from here (tests poison it)."""
    return torch.empty(shape, dtype=dtype, device=device)


# Windows per forward program and tokens per backward program: about 4096 elements each
# at the layer's windows of 32 x 64.
_WINDOWS_PER_PROGRAM = 2
_TOKENS_PER_PROGRAM = 64


def _forward(t: torch.Tensor, pos: torch.Tensor, size: int, stride: int, dtype: torch.dtype) -> torch.Tensor:
    b, h, n, d = t.shape
    windows = (n - size) // stride + 1
    out = _allocate((b, h, windows, size, d), dtype, t.device)
    block_t = triton.next_power_of_2(size)
    grid = (b * h, triton.cdiv(windows, _WINDOWS_PER_PROGRAM))
    _windows_fwd_kernel[grid](
        t, pos, out, t.stride(0), t.stride(1), t.stride(2), h, windows, size, stride,
        HEAD_DIM=d, BLOCK_D=triton.next_power_of_2(d), BLOCK_T=block_t, WINDOWS=_WINDOWS_PER_PROGRAM,
        num_warps=4,
    )
    return out


def _backward(dout: torch.Tensor, n: int, size: int, stride: int, dtype: torch.dtype) -> torch.Tensor:
    b, h, windows, _, d = dout.shape
    dt = _allocate((b, h, n, d), dtype, dout.device)
    grid = (b * h, triton.cdiv(n, _TOKENS_PER_PROGRAM))
    _windows_bwd_kernel[grid](
        dout, dt, n, windows, size, stride,
        HEAD_DIM=d, BLOCK_D=triton.next_power_of_2(d), BLOCK_N=_TOKENS_PER_PROGRAM,
        OVERLAP=triton.cdiv(size, stride), num_warps=4,
    )
    return dt


class _PositionedWindows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, pos, size, stride, dtype):
        ctx.geometry = t.shape[2], size, stride
        ctx.dtypes = t.dtype, pos.dtype
        return _forward(t, pos, size, stride, dtype)

    @staticmethod
    def backward(ctx, dout):
        n, size, stride = ctx.geometry
        t_dtype, pos_dtype = ctx.dtypes
        dout = dout.contiguous()
        dt = _backward(dout, n, size, stride, t_dtype) if ctx.needs_input_grad[0] else None
        dpos = dout.sum((0, 2), dtype=torch.float32).to(pos_dtype) if ctx.needs_input_grad[1] else None
        return dt, dpos, None, None, None


def positioned_windows(t: torch.Tensor, pos: torch.Tensor, size: int, stride: int,
                       dtype: torch.dtype) -> torch.Tensor:
    """The complete windows of ``t: [b, h, n, d]`` plus their positions ``pos: [h, size, d]``,
    ``[b, h, w, size, d]`` contiguous in ``dtype``: ``t[:, :, i * stride + j] + pos[:, j]``
    in window i, computed in float32 and rounded once (what the float32 add and the cast
    after it give). Differentiable in ``t`` and ``pos``.

    t: any strides with unit stride along d; t, pos and ``dtype`` float16, bfloat16 or
    float32; at least ``size`` tokens, ``size >= stride``. On CUDA tensors, or on CPU
    tensors under ``TRITON_INTERPRET=1``.
    """
    for name, value in (("t", t.dtype), ("pos", pos.dtype), ("dtype", dtype)):
        if value not in KERNEL_DTYPES:
            raise TypeError(f"{name} must be float16, bfloat16 or float32, got {value}")
    if t.ndim != 4 or pos.shape != (t.shape[1], size, t.shape[3]):
        raise ValueError(f"t must be [b, h, n, d] and pos [h, size, d] = [{t.shape[1] if t.ndim == 4 else 'h'}, "
                         f"{size}, {t.shape[-1]}], got t {tuple(t.shape)} and pos {tuple(pos.shape)}")
    if not 1 <= stride <= size <= t.shape[2]:
        raise ValueError(f"need 1 <= stride ({stride}) <= size ({size}) <= tokens ({t.shape[2]})")
    if t.stride(-1) != 1:
        t = t.contiguous()
    return _PositionedWindows.apply(t, pos.contiguous(), size, stride, dtype)
