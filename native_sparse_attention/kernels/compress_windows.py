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
holding each token (zero past the last window). DPOS: POS's gradient, the sum of DOUT over
(z, w), ``[H, SIZE, D]`` float32 (cast to POS's dtype after).

Forward: one program per (z, h) and WINDOWS consecutive windows. Backward: one program per
(z, h) and BLOCKS blocks of GROUPS whole strides of tokens (BLOCK_S lanes a stride, STRIDE
rounded up to a power of two, so other strides leave lanes idle), each token gathering its
OVERLAP windows' rows, so DT is stored without atomics. The same loads make DPOS, with no
second pass over DOUT: a program sums the rows it reads in float32, one partial per (t, d),
and adds its partial into DPOS (zeroed first) atomically once at its end. The adds' order
varies, so DPOS's last bits may differ between runs; under
``torch.use_deterministic_algorithms`` (PARTIALS) each program stores its partial in a
slab of its own instead, ``[Z * H, programs, SIZE, D]``, which the host sums.

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

from native_sparse_attention.kernels.launch import launch
from native_sparse_attention.kernels.library import KERNEL_DTYPES, cdiv, next_power_of_2

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
    DOUT, DT, DPOS, H, N, W, SIZE, STRIDE, BLOCKS,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, GROUPS: tl.constexpr,
    OVERLAP: tl.constexpr, BLOCK_O: tl.constexpr, TOKEN_GRAD: tl.constexpr, POS_GRAD: tl.constexpr,
    PARTIALS: tl.constexpr,
):
    zh = tl.program_id(0).to(tl.int64)
    h = tl.program_id(0) % H
    lane = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    # DPOS's partial, row back * STRIDE + j of the windows at [back, j].
    backs = tl.arange(0, BLOCK_O)[:, None, None]
    partial = tl.zeros([BLOCK_O, BLOCK_S, BLOCK_D], dtype=tl.float32)
    for block in range(tl.program_id(1) * BLOCKS, (tl.program_id(1) + 1) * BLOCKS):
        # Tokens as GROUPS strides of BLOCK_S lanes (STRIDE of them live): lane j of group
        # g is token (first + g) * STRIDE + j, so its windows are first + g - back and its
        # row in them j + back * STRIDE, whatever the stride, with no division.
        latest = block * GROUPS + tl.arange(0, GROUPS)[:, None]
        tokens = latest * STRIDE + lane[None, :]
        live = (lane < STRIDE)[None, :] & (tokens < N)
        total = tl.zeros([GROUPS, BLOCK_S, BLOCK_D], dtype=tl.float32)
        for back in tl.static_range(OVERLAP):
            window = latest - back
            t = lane + back * STRIDE
            ok = live & (window >= 0) & (window < W) & (t < SIZE)[None, :]
            src = DOUT + ((zh * W + window) * SIZE + t[None, :])[:, :, None] * HEAD_DIM + d[None, None, :]
            rows = tl.load(src, mask=ok[:, :, None] & d_ok[None, None, :], other=0.0).to(tl.float32)
            if TOKEN_GRAD:
                total += rows
            if POS_GRAD:
                # Element (w, t) of DOUT is read once in the grid, by token w * STRIDE + t
                # at back = t // STRIDE (windows < 0 or >= W, rows >= SIZE and idle lanes
                # load 0): summing over the groups counts each once.
                partial += tl.where(backs == back, tl.sum(rows, axis=0)[None, :, :], 0.0)
        if TOKEN_GRAD:
            dst = DT + (zh * N + tokens)[:, :, None] * HEAD_DIM + d[None, None, :]
            tl.store(dst, total.to(DT.dtype.element_ty), mask=live[:, :, None] & d_ok[None, None, :])
    if POS_GRAD:
        # One add per program and element of DPOS, all programs of a head on the same
        # SIZE * D addresses: the adds queue there, hence BLOCKS.
        t = backs * STRIDE + lane[None, :, None]
        ok = (backs < OVERLAP) & (lane < STRIDE)[None, :, None] & (t < SIZE) & d_ok[None, None, :]
        if PARTIALS:
            slab = (zh * tl.num_programs(1) + tl.program_id(1)) * SIZE
            tl.store(DPOS + (slab + t) * HEAD_DIM + d[None, None, :], partial, mask=ok)
        else:
            tl.atomic_add(DPOS + (h * SIZE + t) * HEAD_DIM + d[None, None, :], partial, mask=ok, sem="relaxed")


def _allocate(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every buffer the kernels write comes from here (tests poison it)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _zeros(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A buffer the kernels add into: from ``_allocate``, so that a poisoned one shows a
    missing fill."""
    return _allocate(shape, dtype, device).zero_()


# Windows per forward program and at least this many tokens per backward block (whole
# strides): about 4096 elements each at the layer's windows of 32 x 64.
_WINDOWS_PER_PROGRAM = 2
_TOKENS_PER_PROGRAM = 64
# Backward programs to aim for when POS needs a gradient, each looping over its blocks:
# about four an SM of an H100 or H200. Fewer leave too few loads in flight, more queue
# longer on DPOS's adds: on an H200 at 65536 tokens of the layer's keys (2 heads), 512
# took 16 us, 256 and 1024 19 to 20 us, and DT alone 12 us.
_BACKWARD_PROGRAMS = 512


def _forward(t: torch.Tensor, pos: torch.Tensor, size: int, stride: int, dtype: torch.dtype) -> torch.Tensor:
    b, h, n, d = t.shape
    windows = (n - size) // stride + 1
    out = _allocate((b, h, windows, size, d), dtype, t.device)
    block_t = next_power_of_2(size)
    grid = (b * h, cdiv(windows, _WINDOWS_PER_PROGRAM))
    launch(_windows_fwd_kernel, grid,
        t, pos, out, t.stride(0), t.stride(1), t.stride(2), h, windows, size, stride,
        HEAD_DIM=d, BLOCK_D=next_power_of_2(d), BLOCK_T=block_t, WINDOWS=_WINDOWS_PER_PROGRAM,
        num_warps=4,
    )
    return out


def _backward(dout: torch.Tensor, n: int, size: int, stride: int, t_dtype: torch.dtype | None,
              pos_grad: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """DT in ``t_dtype`` (None: not computed) and, if ``pos_grad``, POS's gradient in float32."""
    b, h, windows, _, d = dout.shape
    dt = _allocate((b, h, n, d), t_dtype, dout.device) if t_dtype is not None else None
    block_s = next_power_of_2(stride)
    groups = max(1, _TOKENS_PER_PROGRAM // block_s)
    blocks = cdiv(n, groups * stride)
    per_program = cdiv(blocks, max(1, _BACKWARD_PROGRAMS // (b * h))) if pos_grad else 1
    overlap = cdiv(size, stride)
    grid = (b * h, cdiv(blocks, per_program))
    partials = pos_grad and torch.are_deterministic_algorithms_enabled()
    # float32 whatever the dtypes: every program adds its partial sums into it, or stores
    # them in a slab of its own, every element of which it writes (zeros where it read none).
    dpos = None
    if partials:
        dpos = _allocate((b * h, grid[1], size, d), torch.float32, dout.device)
    elif pos_grad:
        dpos = _zeros((h, size, d), torch.float32, dout.device)
    # An unused buffer's argument is DOUT, never written.
    launch(_windows_bwd_kernel, grid,
        dout, dout if dt is None else dt, dout if dpos is None else dpos, h, n, windows, size, stride, per_program,
        HEAD_DIM=d, BLOCK_D=next_power_of_2(d), BLOCK_S=block_s, GROUPS=groups, OVERLAP=overlap,
        BLOCK_O=next_power_of_2(overlap), TOKEN_GRAD=dt is not None, POS_GRAD=pos_grad, PARTIALS=partials,
        num_warps=8,
    )
    if partials:
        dpos = dpos.view(b, h, grid[1], size, d).sum((0, 2))
    return dt, dpos


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
        dt, dpos = _backward(dout.contiguous(), n, size, stride, t_dtype if ctx.needs_input_grad[0] else None,
                             ctx.needs_input_grad[1])
        return dt, None if dpos is None else dpos.to(pos_dtype), None, None, None


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
