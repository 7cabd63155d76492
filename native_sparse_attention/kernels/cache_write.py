"""Triton kernels that write a decoding step's token into a ``StaticSparseAttentionCache``.

Notation
--------
Z: batch size, H: kv heads, D: head dim, padded to the power of two BLOCK_D.
POSITION: ``[Z]`` int64, each batch row's step token position, read on the device (rows
that decode prompts of different lengths sit at different positions).
WINDOW: tokens per compression window (the layer's compress_block_size), which is also
the length of the ring RECENT_K / RECENT_V ``[Z, H, WINDOW, D]`` that holds the latest
tokens, token t in slot ``t % WINDOW``; BLOCK_W: WINDOW padded to a power of two.
STRIDE: compression stride; NUM_MEM: memory rows that precede the compressed keys;
SPARE_ROW: the last row of the compressed buffers, where windows that are not complete go.

Kernels
-------
``_ring_window_kernel``: puts the token's keys and values into their ring slot and reads
back the window of WINDOW tokens ending at it, oldest first, as the compression input.
``_compressed_row_kernel``: writes that window's compressed key and value into its row when
the window is complete (its first token a multiple of STRIDE), into SPARE_ROW otherwise.

Their four launches per step replace some twenty PyTorch ops on the position and single
rows (modulo, comparisons, ``index_copy_``, ``index_select``), each a kernel of its own
in a replayed step: 61 -> 44 kernels and 0.233 -> 0.200 ms per replayed step of the layer
benchmark's configuration at 64k cached tokens on an H100.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from native_sparse_attention.kernels.launch import launch
from native_sparse_attention.kernels.library import head_pointer, next_power_of_2

__all__ = ["write_compressed_row", "write_ring_and_read_window"]


@triton.jit
def _ring_window_kernel(
    POSITION, NEW, RING, WINDOW_OUT,
    stride_nz, stride_nh, stride_rz, stride_rh, stride_rn,
    H,
    WINDOW: tl.constexpr, BLOCK_W: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # NEW: [Z, H, 1, D] (unit stride on D); RING: [Z, H, WINDOW, D] (unit stride on D);
    # WINDOW_OUT: [Z, H, WINDOW, D], contiguous. One program per (z, h).
    zh = tl.program_id(0)
    z, h = zh // H, zh % H
    position = tl.load(POSITION + z)
    offs_w = tl.arange(0, BLOCK_W)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    new = tl.load(head_pointer(NEW, z, h, stride_nz, stride_nh) + offs_d, mask=d_ok, other=0.0)
    ring = head_pointer(RING, z, h, stride_rz, stride_rh)

    # Window row t holds token position - WINDOW + 1 + t; the last is the new token, whose
    # slot the ring still holds the token WINDOW steps back in.
    slots = (position + 1 + offs_w) % WINDOW
    older = offs_w < WINDOW - 1
    rows = tl.load(ring + slots[:, None] * stride_rn + offs_d[None, :],
                   mask=older[:, None] & d_ok[None, :], other=0.0)
    rows = tl.where(older[:, None], rows, new[None, :].to(rows.dtype))
    out = WINDOW_OUT + zh.to(tl.int64) * WINDOW * D
    tl.store(out + offs_w[:, None] * D + offs_d[None, :], rows,
             mask=(offs_w[:, None] < WINDOW) & d_ok[None, :])
    tl.store(ring + (position % WINDOW) * stride_rn + offs_d, new.to(RING.dtype.element_ty), mask=d_ok)


@triton.jit
def _compressed_row_kernel(
    POSITION, NEW, BUFFER,
    stride_nz, stride_nh, stride_bz, stride_bh, stride_bn,
    H, NUM_MEM, WINDOW, STRIDE, SPARE_ROW,
    D: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # NEW: [Z, H, 1, D]; BUFFER: [Z, H, SPARE_ROW + 1, D] (unit stride on D for both).
    zh = tl.program_id(0)
    z, h = zh // H, zh % H
    start = tl.load(POSITION + z) + 1 - WINDOW
    row = NUM_MEM + start // STRIDE
    # Past the capacity a window's row would lie beyond the buffer: the spare row then.
    complete = (start >= 0) & (start % STRIDE == 0) & (row < SPARE_ROW)
    row = tl.where(complete, row, SPARE_ROW)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    new = tl.load(head_pointer(NEW, z, h, stride_nz, stride_nh) + offs_d, mask=d_ok)
    tl.store(head_pointer(BUFFER, z, h, stride_bz, stride_bh) + row.to(tl.int64) * stride_bn + offs_d,
             new.to(BUFFER.dtype.element_ty), mask=d_ok)


def _empty(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Allocation of every kernel output; tests replace it to fill outputs with NaN first."""
    return torch.empty(shape, dtype=dtype, device=device)


def write_ring_and_read_window(position: torch.Tensor, new: torch.Tensor, ring: torch.Tensor) -> torch.Tensor:
    """Writes ``new: [b, h, 1, d]``, the token at ``position: [b]`` (int64, each row's),
    into ``ring: [b, h, window, d]`` (slot ``position % window``) and returns the window
    ending at it, oldest token first: ``[b, h, 1, window, d]`` in the ring's dtype."""
    b, h, window, d = ring.shape
    assert new.shape == (b, h, 1, d) and new.stride(-1) == 1 and ring.stride(-1) == 1
    out = _empty((b, h, 1, window, d), ring.dtype, ring.device)
    launch(_ring_window_kernel, (b * h,),
        position, new, ring, out, new.stride(0), new.stride(1), *ring.stride()[:3], h,
        WINDOW=window, BLOCK_W=next_power_of_2(window), D=d, BLOCK_D=next_power_of_2(d),
        num_warps=1,
    )
    return out


def write_compressed_row(position: torch.Tensor, new: torch.Tensor, buffer: torch.Tensor, num_mem: int,
                         window: int, stride: int) -> None:
    """Writes ``new: [b, h, 1, d]``, the compression of the window ending at ``position:
    [b]`` (int64, each row's), into ``buffer: [b, h, rows, d]``: row ``num_mem +
    first_token // stride`` when the window is complete, the last (spare) row otherwise."""
    b, h, rows, d = buffer.shape
    assert new.shape == (b, h, 1, d) and new.stride(-1) == 1 and buffer.stride(-1) == 1
    launch(_compressed_row_kernel, (b * h,),
        position, new, buffer, new.stride(0), new.stride(1), *buffer.stride()[:3],
        h, num_mem, window, stride, rows - 1, D=d, BLOCK_D=next_power_of_2(d), num_warps=1,
    )
