"""Triton kernels that write a decoding step's token into a ``StaticSparseAttentionCache``.

Notation
--------
Z: batch size, H: kv heads, D: head dim, padded to the power of two BLOCK_D.
POSITION: ``[Z]`` int64, each batch row's step token position, read on the device (rows
that decode prompts of different lengths sit at different positions).
WINDOW: tokens per compression window (the layer's compress_block_size), which is also
the length of the rings RING_K / RING_V ``[Z, H, WINDOW, D]`` that hold the latest keys
and values, token t in slot ``t % WINDOW``; BLOCK_W: WINDOW padded to a power of two.
POS_K, POS_V: ``[H, WINDOW, D]``, the layer's intra-block positions of keys and values.
STRIDE: compression stride; NUM_MEM: memory rows that precede the compressed keys;
SPARE_ROW: the last row of the compressed buffers, where windows that are not complete go.
CACHE_K, CACHE_V: ``[Z, H, CAPACITY, D]``, the cache's keys (rotated: ROTATED_K is the
token's) and values, token t in row t.

Kernels
-------
Each takes a pair of tensors, the keys' and the values' (program axis 1 picks one).
``_ring_window_kernel``: puts the token's key and value into their ring slots and reads
back the windows of WINDOW tokens ending at it, oldest first, plus the layer's intra-block
positions: the compression networks' input. With WRITE_CACHE it also writes the token's
rotated key and its value into their rows of CACHE_K and CACHE_V, for two ``scatter_``
kernels: the layer benchmark's replayed step 57.9 -> 55.5 us at 4k cached tokens and
75.9 -> 69.5 us for eight sequences of 16k on an H100, the same bits. A position past
CAPACITY fails a device-side assertion (the launch compiles it in) and writes nothing.
``_compressed_row_kernel``: writes those windows' compressed key and value into their row
when the window is complete (its first token a multiple of STRIDE), into SPARE_ROW
otherwise.

Their launches replace some twenty PyTorch ops on the position and single rows (modulo,
comparisons, ``index_copy_``, ``index_select``), each a kernel of its own in a replayed
step: 61 -> 44 kernels and 0.233 -> 0.200 ms per replayed step of the layer benchmark's
configuration at 64k cached tokens on an H100, when they were four launches (one per
tensor). As two, which also add the positions, a replayed step runs 30 kernels, not 34.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from native_sparse_attention.kernels.launch import launch
from native_sparse_attention.kernels.library import head_pointer, next_power_of_2

__all__ = ["completes_window", "write_compressed_rows", "write_rings_and_read_windows"]


@triton.jit
def _pick(which, FIRST, SECOND):
    """FIRST for program row 0 of axis 1, SECOND for row 1."""
    if which == 0:
        return FIRST
    return SECOND


@triton.jit
def completes_window(position, WINDOW, STRIDE):
    """Whether the window of WINDOW tokens ending at ``position`` is complete: its first
    token a multiple of STRIDE (the windows the layer compresses)."""
    start = position + 1 - WINDOW
    return (start >= 0) & (start % STRIDE == 0)


@triton.jit
def _write_cache_row(ROTATED_K, CACHE_K, CACHE_V, new, which, z, h, position, offs_d, d_ok,
                     stride_kz, stride_kh, stride_cz, stride_ch, stride_cn, CAPACITY):
    """The token's rotated key (program row 0 of axis 1) or its value ``new`` (row 1) into
    row ``position`` of the cache, which must hold it."""
    token = new.to(tl.float32)
    if which == 0:
        token = tl.load(head_pointer(ROTATED_K, z, h, stride_kz, stride_kh) + offs_d, mask=d_ok).to(tl.float32)
    # Per lane: the interpreter takes no scalar in a store's mask.
    fits = position + tl.zeros_like(offs_d) < CAPACITY
    tl.device_assert(fits, "a decoding step past the static cache's capacity")
    cache = head_pointer(_pick(which, CACHE_K, CACHE_V), z, h, stride_cz, stride_ch)
    tl.store(cache + position * stride_cn + offs_d, token.to(CACHE_K.dtype.element_ty), mask=d_ok & fits)


@triton.jit
def _ring_window_kernel(
    POSITION, NEW_K, NEW_V, RING_K, RING_V, POS_K, POS_V, WINDOW_OUT, ROTATED_K, CACHE_K, CACHE_V,
    stride_nz, stride_nh, stride_rz, stride_rh, stride_rn, stride_kz, stride_kh, stride_cz, stride_ch, stride_cn,
    Z, H, CAPACITY,
    WINDOW: tl.constexpr, BLOCK_W: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    WRITE_CACHE: tl.constexpr,
):
    # NEW_K, NEW_V: [Z, H, 1, D] (unit stride on D; the same strides); RING_K, RING_V: [Z, H,
    # WINDOW, D] (the same); POS_K, POS_V: [H, WINDOW, D], contiguous, added to the windows;
    # WINDOW_OUT: [2, Z, H, WINDOW, D], contiguous; with WRITE_CACHE ROTATED_K: [Z, H, 1, D]
    # and CACHE_K, CACHE_V (the same strides), unit stride on D. Program (z * H + h,
    # which): the keys (0) or the values (1) of (z, h).
    zh, which = tl.program_id(0), tl.program_id(1)
    z, h = zh // H, zh % H
    position = tl.load(POSITION + z)
    offs_w = tl.arange(0, BLOCK_W)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    new_token = head_pointer(_pick(which, NEW_K, NEW_V), z, h, stride_nz, stride_nh)
    new = tl.load(new_token + offs_d, mask=d_ok, other=0.0)
    ring = head_pointer(_pick(which, RING_K, RING_V), z, h, stride_rz, stride_rh)

    # Window row t holds token position - WINDOW + 1 + t; the last is the new token, whose
    # slot the ring still holds the token WINDOW steps back in.
    slots = (position + 1 + offs_w) % WINDOW
    older = offs_w < WINDOW - 1
    rows = tl.load(ring + slots[:, None] * stride_rn + offs_d[None, :],
                   mask=older[:, None] & d_ok[None, :], other=0.0)
    rows = tl.where(older[:, None], rows, new[None, :].to(rows.dtype))
    in_window = (offs_w[:, None] < WINDOW) & d_ok[None, :]
    window_offsets = offs_w[:, None] * D + offs_d[None, :]
    positions = tl.load(_pick(which, POS_K, POS_V) + h * WINDOW * D + window_offsets, mask=in_window, other=0.0)
    # Rounded once, as PyTorch's sum of the two would be.
    rows = rows.to(tl.float32) + positions.to(tl.float32)
    out = WINDOW_OUT + (which.to(tl.int64) * Z * H + zh) * WINDOW * D
    tl.store(out + window_offsets, rows.to(WINDOW_OUT.dtype.element_ty), mask=in_window)
    tl.store(ring + (position % WINDOW) * stride_rn + offs_d, new.to(RING_K.dtype.element_ty), mask=d_ok)
    if WRITE_CACHE:
        _write_cache_row(ROTATED_K, CACHE_K, CACHE_V, new, which, z, h, position, offs_d, d_ok,
                         stride_kz, stride_kh, stride_cz, stride_ch, stride_cn, CAPACITY)


@triton.jit
def _compressed_row_kernel(
    POSITION, NEW_K, NEW_V, BUFFER_K, BUFFER_V,
    stride_nz, stride_nh, stride_bz, stride_bh, stride_bn,
    H, NUM_MEM, WINDOW, STRIDE, SPARE_ROW,
    D: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # NEW_K, NEW_V: [Z, H, 1, D] (the same strides); BUFFER_K, BUFFER_V: [Z, H, SPARE_ROW + 1,
    # D] (the same); unit stride on D. Program (z * H + h, which) as in _ring_window_kernel.
    zh, which = tl.program_id(0), tl.program_id(1)
    z, h = zh // H, zh % H
    position = tl.load(POSITION + z)
    row = NUM_MEM + (position + 1 - WINDOW) // STRIDE
    # Past the capacity a window's row would lie beyond the buffer: the spare row then.
    complete = completes_window(position, WINDOW, STRIDE) & (row < SPARE_ROW)
    row = tl.where(complete, row, SPARE_ROW)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    new = tl.load(head_pointer(_pick(which, NEW_K, NEW_V), z, h, stride_nz, stride_nh) + offs_d, mask=d_ok)
    buffer = head_pointer(_pick(which, BUFFER_K, BUFFER_V), z, h, stride_bz, stride_bh)
    tl.store(buffer + row.to(tl.int64) * stride_bn + offs_d, new.to(BUFFER_K.dtype.element_ty), mask=d_ok)


def _empty(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Allocation of every kernel output; tests replace it to fill outputs with NaN first."""
    return torch.empty(shape, dtype=dtype, device=device)


def write_rings_and_read_windows(position: torch.Tensor, new_k: torch.Tensor, new_v: torch.Tensor,
                                 ring_k: torch.Tensor, ring_v: torch.Tensor, pos_k: torch.Tensor,
                                 pos_v: torch.Tensor, dtype: torch.dtype | None = None,
                                 cache_rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Writes ``new_k, new_v: [b, h, 1, d]``, the token at ``position: [b]`` (int64, each
    row's), into ``ring_k, ring_v: [b, h, window, d]`` (slot ``position % window``) and
    returns the windows ending at it, oldest token first, plus the intra-block positions
    ``pos_k, pos_v: [h, window, d]``: ``[b, h, 1, window, d]`` each (the compression
    networks' input), in ``dtype``, by default the dtype of the rings' and the positions'
    sum; either way rounded once from the float32 sum, as ``(ring + pos).to(dtype)``.
    ``cache_rows``: ``(rotated_k [b, h, 1, d], keys, values [b, h, capacity, d])``, into
    whose row ``position`` the rotated key and ``new_v`` also go, in the cache's dtype; a
    position past the capacity fails a device-side assertion on CUDA."""
    b, h, window, d = ring_k.shape
    assert new_k.shape == new_v.shape == (b, h, 1, d) and new_k.stride() == new_v.stride() and new_k.stride(-1) == 1
    assert ring_v.shape == ring_k.shape and ring_k.stride() == ring_v.stride() and ring_k.stride(-1) == 1
    assert ring_k.dtype == ring_v.dtype and pos_k.dtype == pos_v.dtype
    assert pos_k.shape == pos_v.shape == (h, window, d) and pos_k.is_contiguous() and pos_v.is_contiguous()
    out = _empty((2, b, h, 1, window, d), dtype or torch.promote_types(ring_k.dtype, pos_k.dtype), ring_k.device)
    rotated_k, keys, values = cache_rows if cache_rows is not None else (new_k, ring_k, ring_v)
    if cache_rows is not None:
        assert rotated_k.shape == (b, h, 1, d) and rotated_k.stride(-1) == 1
        assert keys.shape == values.shape and keys.shape[:2] == (b, h) and keys.shape[3] == d
        assert keys.stride() == values.stride() and keys.stride(-1) == 1 and keys.dtype == values.dtype
    launch(_ring_window_kernel, (b * h, 2),
        position, new_k, new_v, ring_k, ring_v, pos_k, pos_v, out, rotated_k, keys, values,
        new_k.stride(0), new_k.stride(1), *ring_k.stride()[:3], rotated_k.stride(0), rotated_k.stride(1),
        *keys.stride()[:3], b, h, keys.shape[2],
        WINDOW=window, BLOCK_W=next_power_of_2(window), D=d, BLOCK_D=next_power_of_2(d),
        WRITE_CACHE=cache_rows is not None, num_warps=1,
        # Compiles the capacity's assertion in (Triton drops device assertions otherwise).
        debug=cache_rows is not None,
    )
    return out[0], out[1]



def write_compressed_rows(position: torch.Tensor, new_k: torch.Tensor, new_v: torch.Tensor,
                          buffer_k: torch.Tensor, buffer_v: torch.Tensor, num_mem: int, window: int,
                          stride: int) -> None:
    """Writes ``new_k, new_v: [b, h, 1, d]``, the compressions of the windows ending at
    ``position: [b]`` (int64, each row's), into ``buffer_k, buffer_v: [b, h, rows, d]``:
    row ``num_mem + first_token // stride`` when the window is complete, the last (spare)
    row otherwise."""
    b, h, rows, d = buffer_k.shape
    assert new_k.shape == new_v.shape == (b, h, 1, d) and new_k.stride() == new_v.stride() and new_k.stride(-1) == 1
    assert buffer_v.shape == buffer_k.shape and buffer_k.stride() == buffer_v.stride() and buffer_k.stride(-1) == 1
    launch(_compressed_row_kernel, (b * h, 2),
        position, new_k, new_v, buffer_k, buffer_v, new_k.stride(0), new_k.stride(1), *buffer_k.stride()[:3],
        h, num_mem, window, stride, rows - 1, D=d, BLOCK_D=next_power_of_2(d), num_warps=1,
    )
