"""The compressed keys and values behind their learned memory rows, as one autograd node
for eager steps on CUDA.

Notation
--------
Z: batch size, H: kv heads, NC: compressed tokens, NUM_MEM: memory rows, D: head dim
(HEAD_DIM), padded to the power of two BLOCK_D; R = NUM_MEM + NC rows per head.
MEM: the memory key/values ``[2, H, NUM_MEM, D]`` contiguous (the layer's parameter,
keys first), any kernel dtype. CK, CV: ``[Z, H, NC, D]``, any strides with unit stride
along D. OUT_K, OUT_V: ``[Z, H, R, D]`` contiguous in CK's dtype, ``MEM[0, h]`` (rounded to
that dtype) then ``CK[z, h]``, and likewise for the values. DOUT_K, DOUT_V: their
gradients, any strides with unit stride along D. DCK, DCV: ``[Z, H, NC, D]`` contiguous,
the gradients' compressed rows; DMEM: MEM's gradient, the memory rows' gradients summed
over Z in float32 and written in MEM's dtype.

Forward and backward: one launch each for keys and values together, one program per
(z, h, BLOCK_R rows); in the backward the programs of z = 0 also add up the memory rows of
every batch. Eager PyTorch took eleven kernels for the same (two casts and two
concatenations forward; two sums over the expanded batch, two casts to the parameter's
dtype, two copies making the compressed rows' gradients contiguous for the compression
network's view, and the stack of the unbound parameter), about 25 us per step at the
layer benchmark's n = 8192 on an H100. Compiled steps keep the PyTorch ops, which
Inductor fuses with their neighbours.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from native_sparse_attention.kernels.launch import launch
from native_sparse_attention.kernels.library import KERNEL_DTYPES, cdiv, next_power_of_2

__all__ = ["with_memory"]

# Rows per program: the layer's compressed rows of 64 features in 8 KiB tiles.
_BLOCK_R = 64


@triton.jit
def _row_tile(R, NUM_MEM, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr):
    """This program's rows of one head, which of them are memory rows, and the columns' mask."""
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    d_ok = (d < HEAD_DIM)[None, :]
    return rows, d, (rows < NUM_MEM)[:, None] & d_ok, ((rows >= NUM_MEM) & (rows < R))[:, None] & d_ok


@triton.jit
def _with_memory_fwd_kernel(
    MEM, CK, CV, OUT_K, OUT_V,
    stride_kz, stride_kh, stride_kn, stride_vz, stride_vh, stride_vn,
    H, R, NUM_MEM,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
):
    zh = tl.program_id(0)
    z = (zh // H).to(tl.int64)
    h = (zh % H).to(tl.int64)
    rows, d, mem_ok, c_ok = _row_tile(R, NUM_MEM, BLOCK_R, BLOCK_D, HEAD_DIM)
    mem_rows = (h * NUM_MEM + rows)[:, None] * HEAD_DIM + d[None, :]
    c_rows = (rows - NUM_MEM).to(tl.int64)[:, None]
    key = tl.where(mem_ok, tl.load(MEM + mem_rows, mask=mem_ok),
                   tl.load(CK + z * stride_kz + h * stride_kh + c_rows * stride_kn + d[None, :], mask=c_ok))
    value = tl.where(mem_ok, tl.load(MEM + H * NUM_MEM * HEAD_DIM + mem_rows, mask=mem_ok),
                     tl.load(CV + z * stride_vz + h * stride_vh + c_rows * stride_vn + d[None, :], mask=c_ok))
    out = (zh.to(tl.int64) * R + rows)[:, None] * HEAD_DIM + d[None, :]
    tl.store(OUT_K + out, key.to(OUT_K.dtype.element_ty), mask=mem_ok | c_ok)
    tl.store(OUT_V + out, value.to(OUT_V.dtype.element_ty), mask=mem_ok | c_ok)


@triton.jit
def _memory_rows_grad(DOUT, h, rows, d, mem_ok, stride_z, stride_h, stride_n, Z,
                      BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """A head's memory rows' gradients summed over the batch, in float32."""
    ptrs = DOUT + h * stride_h + rows.to(tl.int64)[:, None] * stride_n + d[None, :]
    total = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    for _ in range(Z):
        total += tl.load(ptrs, mask=mem_ok, other=0.0).to(tl.float32)
        ptrs += stride_z
    return total


@triton.jit
def _with_memory_bwd_kernel(
    DOUT_K, DOUT_V, DCK, DCV, DMEM,
    stride_kz, stride_kh, stride_kn, stride_vz, stride_vh, stride_vn,
    Z, H, R, NUM_MEM,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
):
    zh = tl.program_id(0)
    z = (zh // H).to(tl.int64)
    h = (zh % H).to(tl.int64)
    rows, d, mem_ok, c_ok = _row_tile(R, NUM_MEM, BLOCK_R, BLOCK_D, HEAD_DIM)
    row_offsets = rows.to(tl.int64)[:, None]
    dk = tl.load(DOUT_K + z * stride_kz + h * stride_kh + row_offsets * stride_kn + d[None, :], mask=c_ok)
    dv = tl.load(DOUT_V + z * stride_vz + h * stride_vh + row_offsets * stride_vn + d[None, :], mask=c_ok)
    c_rows = (zh.to(tl.int64) * (R - NUM_MEM) + rows - NUM_MEM)[:, None] * HEAD_DIM + d[None, :]
    tl.store(DCK + c_rows, dk.to(DCK.dtype.element_ty), mask=c_ok)
    tl.store(DCV + c_rows, dv.to(DCV.dtype.element_ty), mask=c_ok)
    if z == 0 and tl.program_id(1) * BLOCK_R < NUM_MEM:
        mem_rows = (h * NUM_MEM + rows)[:, None] * HEAD_DIM + d[None, :]
        dmem_k = _memory_rows_grad(DOUT_K, h, rows, d, mem_ok, stride_kz, stride_kh, stride_kn, Z,
                                   BLOCK_R, BLOCK_D)
        dmem_v = _memory_rows_grad(DOUT_V, h, rows, d, mem_ok, stride_vz, stride_vh, stride_vn, Z,
                                   BLOCK_R, BLOCK_D)
        tl.store(DMEM + mem_rows, dmem_k.to(DMEM.dtype.element_ty), mask=mem_ok)
        tl.store(DMEM + H * NUM_MEM * HEAD_DIM + mem_rows, dmem_v.to(DMEM.dtype.element_ty), mask=mem_ok)


def _allocate(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every buffer the kernels write comes from here (tests poison it)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _strides(t: torch.Tensor) -> tuple[int, int, int]:
    return t.stride(0), t.stride(1), t.stride(2)


def _grid(z: int, h: int, rows: int) -> tuple[int, int]:
    return z * h, cdiv(rows, _BLOCK_R)


def _tile(d: int) -> dict:
    return dict(HEAD_DIM=d, BLOCK_D=next_power_of_2(d), BLOCK_R=_BLOCK_R)


class _WithMemory(torch.autograd.Function):
    @staticmethod
    def forward(ctx, mem, ck, cv):
        z, h, nc, d = ck.shape
        num_mem = mem.shape[2]
        rows = num_mem + nc
        out_k = _allocate((z, h, rows, d), ck.dtype, ck.device)
        out_v = _allocate((z, h, rows, d), ck.dtype, ck.device)
        if out_k.numel():
            launch(_with_memory_fwd_kernel, _grid(z, h, rows),
                mem, ck, cv, out_k, out_v, *_strides(ck), *_strides(cv), h, rows, num_mem, **_tile(d),
            )
        ctx.num_mem, ctx.mem_dtype = num_mem, mem.dtype
        return out_k, out_v

    @staticmethod
    def backward(ctx, dout_k, dout_v):
        z, h, rows, d = dout_k.shape
        dout_k, dout_v = (t if t.stride(-1) == 1 else t.contiguous() for t in (dout_k, dout_v))
        dck = _allocate((z, h, rows - ctx.num_mem, d), dout_k.dtype, dout_k.device)
        dcv = _allocate((z, h, rows - ctx.num_mem, d), dout_k.dtype, dout_k.device)
        dmem = _allocate((2, h, ctx.num_mem, d), ctx.mem_dtype, dout_k.device)
        if not dout_k.numel():
            return dmem.zero_(), dck, dcv
        launch(_with_memory_bwd_kernel, _grid(z, h, rows),
            dout_k, dout_v, dck, dcv, dmem, *_strides(dout_k), *_strides(dout_v), z, h, rows, ctx.num_mem, **_tile(d),
        )
        return dmem, dck, dcv


def with_memory(mem: torch.Tensor, ck: torch.Tensor, cv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``mem: [2, h, num_mem, d]`` (memory keys, then values) before ``ck, cv: [b, h, nc, d]``
    along the rows: ``[b, h, num_mem + nc, d]`` each, contiguous in ck's dtype (the memory
    rows rounded to it, as ``mem.to(ck.dtype)`` rounds them). Differentiable in all three;
    mem's gradient comes in mem's dtype, summed over the batch in float32. Any kernel dtype
    (float16, bfloat16, float32); ck and cv share theirs and their shape, with unit stride
    along d where they are not contiguous. On CUDA tensors, or on CPU tensors under
    ``TRITON_INTERPRET=1``.
    """
    for name, value in (("mem", mem.dtype), ("ck", ck.dtype), ("cv", cv.dtype)):
        if value not in KERNEL_DTYPES:
            raise TypeError(f"{name} must be float16, bfloat16 or float32, got {value}")
    if ck.ndim != 4 or cv.shape != ck.shape or cv.dtype != ck.dtype:
        raise ValueError(f"ck and cv must be [b, h, nc, d] of one shape and dtype, got {tuple(ck.shape)} {ck.dtype} "
                         f"and {tuple(cv.shape)} {cv.dtype}")
    if mem.ndim != 4 or mem.shape != (2, ck.shape[1], mem.shape[2], ck.shape[3]):
        raise ValueError(f"mem must be [2, {ck.shape[1]}, num_mem, {ck.shape[3]}], got {tuple(mem.shape)}")
    ck, cv = (t if t.stride(-1) == 1 else t.contiguous() for t in (ck, cv))
    return _WithMemory.apply(mem.contiguous(), ck, cv)
