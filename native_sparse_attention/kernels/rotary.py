"""Triton kernel of the rotary position embedding (RoFormer) the layers apply to queries
and keys.

Notation
--------
Z: batch size, H: heads, N: tokens, D: head dim (even), HALF = D / 2, padded to the
power of two BLOCK_HALF; BLOCK_N: tokens per program; HEADS: heads per program.
T: input ``[Z, H, N, D]`` (any strides); OUT: ``[Z, H, N, D]`` contiguous, T's dtype.
INV_FREQ: ``[HALF]`` float32 frequencies; token n sits at position ``p = OFFSET + n``.
T1, T2: the halves ``T[..., :HALF]`` and ``T[..., HALF:]``; likewise OUT1, OUT2.

Forward:  with ``a = p * INV_FREQ[j]`` rounded to float32 (as the PyTorch path does),
``OUT1 = T1 cos a - T2 sin a`` and ``OUT2 = T1 sin a + T2 cos a``, in float32.
Backward: the rotation by ``-a``, applied to dOUT.

A program computes cos a and sin a of its tokens once and rotates them for HEADS heads.
Against the PyTorch path (a float32 copy of T, four products, two sums, a concatenation
and a cast back, each a full pass over T, and as many again in the backward) this reads
T once and writes OUT once. ``a`` reaches about p radians: it is reduced to [-pi, pi] in
float64 first, since the float32 sine and cosine lose accuracy far from zero.

Split heads (``split_heads_and_rotate``): the layers' q, k and v are head-splitting views
of one projection ``QKV: [Z, N, (HQ + 2 * HKV) * D + E]``, and q and k are also rotated.
HQ, HKV: query / key-value heads; the projection's columns hold HQ query heads, then
HKV key heads, then HKV value heads, D each, then E other columns (REST: the sparse
layer's gate logits, which share the matmul). The gradient of QKV sums, per head, the
gradient of the plain view (dQ, dK, dV) and the inverse rotation of the rotated copy's
(dRQ, dRK), and copies dREST. ``_qkv_grad_kernel`` writes it in one pass, where autograd
would rotate dRQ back into a tensor of its own, then add it to dQ while concatenating the
heads into DQKV. In the compiled NSA layer at 32 / 2 heads of 64, n = 65536 on an H100 it
takes 0.33 ms (about 2.7 TB/s) in place of 0.22 ms of inverse rotations and Inductor's
0.69 ms concatenation.
"""

from __future__ import annotations

import math
import numbers

import torch
import triton
import triton.language as tl

from native_sparse_attention.kernels.launch import launch
from native_sparse_attention.kernels.library import (
    cdiv,
    head_strides,
    is_tokens_major,
    launcher_op,
    new_heads_tensor,
    next_power_of_2,
    position_in_memory,
    start_position,
    unit_stride_last,
)
from native_sparse_attention.rotary import split_qkv_heads

__all__ = ["apply_rotary", "rotate_at", "split_heads_and_rotate"]

_TWO_PI = tl.constexpr(2 * math.pi)
_INV_TWO_PI = tl.constexpr(1 / (2 * math.pi))
_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _cos_sin(INV_FREQ, offset, n_start,
             BLOCK_N: tl.constexpr, BLOCK_HALF: tl.constexpr, HALF: tl.constexpr,
             INVERSE: tl.constexpr):
    """cos a and sin a (sin -a when INVERSE) of the program's tokens, [BLOCK_N, BLOCK_HALF]
    float32."""
    offs_j = tl.arange(0, BLOCK_HALF)
    inv_freq = tl.load(INV_FREQ + offs_j, mask=offs_j < HALF, other=0.0)
    position = (offset + n_start + tl.arange(0, BLOCK_N)).to(tl.float32)
    angle = (position[:, None] * inv_freq[None, :]).to(tl.float64)
    # Python floats enter kernels as float32: the constants must be made float64 here.
    turns = tl.floor(angle * tl.full([], _INV_TWO_PI, tl.float64) + 0.5)
    reduced = (angle - turns * tl.full([], _TWO_PI, tl.float64)).to(tl.float32)
    sin = tl.sin(reduced)
    if INVERSE:
        sin = -sin
    return tl.cos(reduced), sin


@triton.jit
def _half_rows(z, h, n_start, stride_z, stride_h, stride_n, stride_d, N,
               BLOCK_N: tl.constexpr, BLOCK_HALF: tl.constexpr, HALF: tl.constexpr):
    """int64 offsets of the first halves of rows ``n_start .. n_start + BLOCK_N`` of head
    ``[z, h]``, and their mask."""
    offs_n = n_start + tl.arange(0, BLOCK_N)
    offs_j = tl.arange(0, BLOCK_HALF)
    head = tl.cast(z, tl.int64) * stride_z + tl.cast(h, tl.int64) * stride_h
    offsets = head + offs_n[:, None].to(tl.int64) * stride_n + offs_j[None, :].to(tl.int64) * stride_d
    return offsets, (offs_n[:, None] < N) & (offs_j[None, :] < HALF)


# Decoding steps rotate at a new offset every token: Triton would compile a variant per
# divisibility by 16 of it, stalling the first steps that hit each.
@triton.jit(do_not_specialize=("offset",))
def _rotary_kernel(
    T, OUT, INV_FREQ,
    stride_tz, stride_th, stride_tn, stride_td,
    stride_oz, stride_oh, stride_on,
    H, N, offset, OFFSET_PTR,
    HALF: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_HALF: tl.constexpr,
    HEADS: tl.constexpr, INVERSE: tl.constexpr, OFFSET_IN_MEMORY: tl.constexpr,
):
    n_start = tl.program_id(0) * BLOCK_N
    head_groups = tl.cdiv(H, HEADS)
    z = tl.program_id(1) // head_groups
    h_start = tl.program_id(1) % head_groups * HEADS
    offset = start_position(offset, OFFSET_PTR, OFFSET_IN_MEMORY, z)
    cos, sin = _cos_sin(INV_FREQ, offset, n_start, BLOCK_N, BLOCK_HALF, HALF, INVERSE)
    for h in range(h_start, tl.minimum(h_start + HEADS, H)):
        src, mask = _half_rows(z, h, n_start, stride_tz, stride_th, stride_tn, stride_td, N,
                               BLOCK_N, BLOCK_HALF, HALF)
        first = tl.load(T + src, mask=mask).to(tl.float32)
        second = tl.load(T + src + HALF * stride_td, mask=mask).to(tl.float32)
        dst, _ = _half_rows(z, h, n_start, stride_oz, stride_oh, stride_on, 1, N,
                            BLOCK_N, BLOCK_HALF, HALF)
        tl.store(OUT + dst, (first * cos - second * sin).to(OUT.dtype.element_ty), mask=mask)
        tl.store(OUT + dst + HALF, (first * sin + second * cos).to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _head_grad(PLAIN, ROTATED, OUT, z, h, out_col, n_start, cos, sin, N,
               stride_pz, stride_ph, stride_pn, stride_rz, stride_rh, stride_rn, stride_on,
               HALF: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_HALF: tl.constexpr,
               HAS_PLAIN: tl.constexpr, HAS_ROTATED: tl.constexpr):
    """OUT's column block ``out_col`` of the program's tokens: PLAIN's head ``[z, h]`` plus
    ROTATED's, rotated by the angles whose ``cos`` and ``sin`` are given."""
    first = tl.zeros([BLOCK_N, BLOCK_HALF], dtype=tl.float32)
    second = tl.zeros([BLOCK_N, BLOCK_HALF], dtype=tl.float32)
    if HAS_ROTATED:
        src, mask = _half_rows(z, h, n_start, stride_rz, stride_rh, stride_rn, 1, N,
                               BLOCK_N, BLOCK_HALF, HALF)
        rotated_first = tl.load(ROTATED + src, mask=mask).to(tl.float32)
        rotated_second = tl.load(ROTATED + src + HALF, mask=mask).to(tl.float32)
        first = rotated_first * cos - rotated_second * sin
        second = rotated_first * sin + rotated_second * cos
    if HAS_PLAIN:
        src, mask = _half_rows(z, h, n_start, stride_pz, stride_ph, stride_pn, 1, N,
                               BLOCK_N, BLOCK_HALF, HALF)
        first += tl.load(PLAIN + src, mask=mask).to(tl.float32)
        second += tl.load(PLAIN + src + HALF, mask=mask).to(tl.float32)
    dst, mask = _half_rows(z, 0, n_start, tl.cast(N, tl.int64) * stride_on, 0, stride_on, 1, N,
                           BLOCK_N, BLOCK_HALF, HALF)
    dst += out_col * (2 * HALF)
    tl.store(OUT + dst, first.to(OUT.dtype.element_ty), mask=mask)
    tl.store(OUT + dst + HALF, second.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _rest_grad(DREST, OUT, z, n_start, N, stride_ez, stride_en, stride_on, col_start, E,
               BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, HAS_DREST: tl.constexpr):
    """OUT's columns ``col_start ..`` of the program's tokens: DREST's ``E`` columns, or
    zeros."""
    offs_n = n_start + tl.arange(0, BLOCK_N)
    rows = tl.cast(z, tl.int64) * N + offs_n[:, None].to(tl.int64)
    for e_start in range(0, E, BLOCK_E):
        offs_e = e_start + tl.arange(0, BLOCK_E)
        mask = (offs_n[:, None] < N) & (offs_e[None, :] < E)
        if HAS_DREST:
            src = (tl.cast(z, tl.int64) * stride_ez + offs_n[:, None].to(tl.int64) * stride_en
                   + offs_e[None, :])
            values = tl.load(DREST + src, mask=mask)
        else:
            values = tl.zeros([BLOCK_N, BLOCK_E], dtype=tl.float32)
        tl.store(OUT + rows * stride_on + col_start + offs_e[None, :],
                 values.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _qkv_grad_kernel(
    DQ, DRQ, DK, DRK, DV, DREST, DQKV, INV_FREQ,
    stride_qz, stride_qh, stride_qn, stride_rqz, stride_rqh, stride_rqn,
    stride_kz, stride_kh, stride_kn, stride_rkz, stride_rkh, stride_rkn,
    stride_vz, stride_vh, stride_vn, stride_ez, stride_en,
    HQ, HKV, E, N, offset,
    HALF: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_HALF: tl.constexpr, HEADS: tl.constexpr,
    BLOCK_E: tl.constexpr,
    HAS_DQ: tl.constexpr, HAS_DRQ: tl.constexpr, HAS_DK: tl.constexpr, HAS_DRK: tl.constexpr,
    HAS_DV: tl.constexpr, HAS_DREST: tl.constexpr, REST_GROUPS: tl.constexpr,
):
    # DQ, DRQ: [Z, HQ, N, D]; DK, DRK, DV: [Z, HKV, N, D], each with unit stride along D;
    # DREST: [Z, N, E] with unit stride along E (each absent where its HAS_ flag is off);
    # DQKV: [Z, N, (HQ + 2 * HKV) * D + E] contiguous.
    # Axis 1 walks, per batch, the groups of HEADS query heads, then of key heads, then
    # of value heads, then (when E > 0) the rest columns: a program's heads are all of one
    # kind.
    n_start = tl.program_id(0) * BLOCK_N
    q_groups = tl.cdiv(HQ, HEADS)
    kv_groups = tl.cdiv(HKV, HEADS)
    groups = q_groups + 2 * kv_groups + REST_GROUPS
    z = tl.program_id(1) // groups
    group = tl.program_id(1) % groups
    stride_on = (HQ + 2 * HKV) * 2 * HALF + E
    cos, sin = _cos_sin(INV_FREQ, offset, n_start, BLOCK_N, BLOCK_HALF, HALF, INVERSE=True)
    if group < q_groups:
        h_start = group * HEADS
        for h in range(h_start, tl.minimum(h_start + HEADS, HQ)):
            _head_grad(DQ, DRQ, DQKV, z, h, h, n_start, cos, sin, N,
                       stride_qz, stride_qh, stride_qn, stride_rqz, stride_rqh, stride_rqn, stride_on,
                       HALF, BLOCK_N, BLOCK_HALF, HAS_DQ, HAS_DRQ)
    elif group < q_groups + kv_groups:
        h_start = (group - q_groups) * HEADS
        for h in range(h_start, tl.minimum(h_start + HEADS, HKV)):
            _head_grad(DK, DRK, DQKV, z, h, HQ + h, n_start, cos, sin, N,
                       stride_kz, stride_kh, stride_kn, stride_rkz, stride_rkh, stride_rkn, stride_on,
                       HALF, BLOCK_N, BLOCK_HALF, HAS_DK, HAS_DRK)
    elif group < q_groups + 2 * kv_groups:
        h_start = (group - q_groups - kv_groups) * HEADS
        for h in range(h_start, tl.minimum(h_start + HEADS, HKV)):
            _head_grad(DV, DV, DQKV, z, h, HQ + HKV + h, n_start, cos, sin, N,
                       stride_vz, stride_vh, stride_vn, 0, 0, 0, stride_on,
                       HALF, BLOCK_N, BLOCK_HALF, HAS_DV, False)
    else:
        _rest_grad(DREST, DQKV, z, n_start, N, stride_ez, stride_en, stride_on,
                   (HQ + 2 * HKV) * 2 * HALF, E, BLOCK_N, BLOCK_E, HAS_DREST)


_BLOCK_N = 64
# A tile's sine and cosine serve this many heads: fewer would recompute them more often,
# more would shrink the grid of short sequences. At 8 the kernel moved ~2.7 TB/s on an H100.
_HEADS_PER_PROGRAM = 8
# Columns of the projection past the heads (the layer's gate logits) copied per step.
_BLOCK_REST = 64


def _empty(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Allocation of the kernel's output; tests replace it to fill it with NaN first."""
    return torch.empty(shape, dtype=dtype, device=device)


def _fake_rotate(t, inv_freq, offset, inverse, tokens_major):
    return new_heads_tensor(t, tokens_major, t.new_empty)


@launcher_op("rotary", _fake_rotate)
def _rotate(t: torch.Tensor, inv_freq: torch.Tensor, offset: int, inverse: bool,
            tokens_major: bool) -> torch.Tensor:
    """t: [b, h, n, d] (any strides) -> [b, h, n, d] rotated by +a (-a if inverse),
    contiguous, or laid out as [b, n, h, d] when ``tokens_major``."""
    return _launch_rotary(t, inv_freq, offset, inverse, tokens_major)


def _launch_rotary(t: torch.Tensor, inv_freq: torch.Tensor, offset: int | torch.Tensor, inverse: bool,
                   tokens_major: bool) -> torch.Tensor:
    """``_rotate``, with ``offset`` an int or a ``[b]`` int64 device tensor (each row's)."""
    b, h, n, d = t.shape
    out = new_heads_tensor(t, tokens_major, lambda shape: _empty(shape, t.dtype, t.device))
    if out.numel() == 0:
        return out
    # Fewer tokens than a tile (decoding steps): one head per program and no padded rows,
    # since the sines and cosines of so few rows cost less than a longer chain of heads.
    block_n, heads = (_BLOCK_N, _HEADS_PER_PROGRAM) if n >= _BLOCK_N else (next_power_of_2(n), 1)
    grid = (cdiv(n, block_n), b * cdiv(h, heads))
    start, start_ptr, in_memory = position_in_memory(offset, inv_freq)
    launch(_rotary_kernel, grid,
        t, out, inv_freq, *t.stride(), *out.stride()[:3], h, n, start, start_ptr,
        HALF=d // 2, BLOCK_N=block_n, BLOCK_HALF=next_power_of_2(d // 2),
        HEADS=heads, INVERSE=inverse, OFFSET_IN_MEMORY=in_memory,
    )
    return out


def rotate_at(t: torch.Tensor, inv_freq: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """``apply_rotary`` of each batch row at the positions ``position[row] ..``, where
    ``position: [b]`` is an int64 device tensor read on the device (a step that a CUDA
    graph replays). Forward only, for inputs the caller has validated: t: [b, h, n, d],
    inv_freq: [d / 2] float32 -> contiguous [b, h, n, d]."""
    return _launch_rotary(t, inv_freq, position, inverse=False, tokens_major=False)


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, inv_freq, offset):
        ctx.save_for_backward(inv_freq)
        ctx.offset = offset
        # The gradient takes t's order of heads and tokens: where t is a head-splitting
        # view of a projection, the projection's gradient then gathers each token's heads
        # from contiguous rows instead of transposing them.
        ctx.tokens_major = is_tokens_major(t)
        return _rotate(t, inv_freq, offset, inverse=False, tokens_major=False)

    @staticmethod
    def backward(ctx, dout):
        (inv_freq,) = ctx.saved_tensors
        return _rotate(dout, inv_freq, ctx.offset, inverse=True, tokens_major=ctx.tokens_major), None, None


def apply_rotary(t: torch.Tensor, inv_freq: torch.Tensor, offset: int = 0) -> torch.Tensor:
    """Rotary embedding of ``t: [b, h, n, d]`` at positions ``offset .. offset + n - 1``.

    The pair ``(t[..., j], t[..., j + d / 2])`` of token i is rotated by the angle
    ``(offset + i) * inv_freq[j]``. t: any strides, float16, bfloat16 or float32, d even;
    inv_freq: [d / 2]. Returns a contiguous [b, h, n, d] tensor of t's dtype, computed in
    float32 with cos and sin of the float32 angle; differentiable in t, whose gradient
    keeps t's memory order of heads and tokens.
    Runs on CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1``.
    """
    if not isinstance(t, torch.Tensor) or not isinstance(inv_freq, torch.Tensor):
        raise TypeError(f"t and inv_freq must be torch.Tensors, got {type(t).__name__} and "
                        f"{type(inv_freq).__name__}")
    if isinstance(offset, bool) or not isinstance(offset, numbers.Integral):
        raise TypeError(f"offset must be an int, got {type(offset).__name__}")
    if t.ndim != 4 or t.shape[-1] % 2:
        raise ValueError(f"t must be [b, h, n, d] with an even d, got shape {tuple(t.shape)}")
    if t.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"t must be float16, bfloat16 or float32, got {t.dtype}")
    if inv_freq.shape != (t.shape[-1] // 2,) or inv_freq.device != t.device:
        raise ValueError(f"inv_freq must be [d / 2] = [{t.shape[-1] // 2}] on {t.device}, got "
                         f"{tuple(inv_freq.shape)} on {inv_freq.device}")
    return _Rotary.apply(t, inv_freq.float().contiguous(), int(offset))


def _fake_qkv_grad(dq, drq, dk, drk, dv, drest, inv_freq, offset, batch, seq_len, heads, kv_heads,
                   width, dtype):
    return inv_freq.new_empty((batch, seq_len, width), dtype=dtype)


@launcher_op("qkv_grad", _fake_qkv_grad)
def _qkv_grad(dq: torch.Tensor | None, drq: torch.Tensor | None, dk: torch.Tensor | None,
              drk: torch.Tensor | None, dv: torch.Tensor | None, drest: torch.Tensor | None,
              inv_freq: torch.Tensor, offset: int, batch: int, seq_len: int, heads: int,
              kv_heads: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    """The gradient ``[b, n, width]`` of the projection that ``split_heads_and_rotate``
    split, of dtype ``dtype``: dq, drq: [b, hq, n, d], dk, drk, dv: [b, hk, n, d] (any
    strides), drest: [b, n, width - (hq + 2 * hk) * d]; None where a gradient is zero."""
    half = inv_freq.shape[0]
    rest = width - (heads + 2 * kv_heads) * 2 * half
    out = _empty((batch, seq_len, width), dtype, inv_freq.device)
    if out.numel() == 0:
        return out
    dq, drq, dk, drk, dv, drest = (unit_stride_last(t) for t in (dq, drq, dk, drk, dv, drest))
    groups = (cdiv(heads, _HEADS_PER_PROGRAM) + 2 * cdiv(kv_heads, _HEADS_PER_PROGRAM)
              + int(rest > 0))
    grid = (cdiv(seq_len, _BLOCK_N), batch * groups)
    launch(_qkv_grad_kernel, grid,
        dq, drq, dk, drk, dv, drest, out, inv_freq,
        *head_strides(dq), *head_strides(drq), *head_strides(dk), *head_strides(drk),
        *head_strides(dv), *((0, 0) if drest is None else drest.stride()[:2]),
        heads, kv_heads, rest, seq_len, offset,
        HALF=half, BLOCK_N=_BLOCK_N, BLOCK_HALF=next_power_of_2(half),
        HEADS=_HEADS_PER_PROGRAM, BLOCK_E=_BLOCK_REST, HAS_DQ=dq is not None,
        HAS_DRQ=drq is not None, HAS_DK=dk is not None, HAS_DRK=drk is not None,
        HAS_DV=dv is not None, HAS_DREST=drest is not None, REST_GROUPS=int(rest > 0),
    )
    return out


class _SplitRotate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, inv_freq, heads, kv_heads, offset):
        ctx.save_for_backward(inv_freq)
        ctx.heads, ctx.kv_heads, ctx.offset = heads, kv_heads, offset
        ctx.shape, ctx.dtype = qkv.shape, qkv.dtype
        # Gradients of outputs that the caller never used arrive as None, and the kernel
        # skips them, rather than as zero tensors it would have to read.
        ctx.set_materialize_grads(False)
        q, k, v, rest = split_qkv_heads(qkv, heads, kv_heads, 2 * inv_freq.shape[0])
        # Tokens-major rq: the selection's dK / dV pass gathers all heads of a query at
        # once, one run of bytes instead of one row per head (the layer benchmark's compiled
        # step on an H100: that pass 3.86 -> 3.66 ms at n = 65536, 0.472 -> 0.449 at 8192).
        rq = _rotate(q, inv_freq, offset, inverse=False, tokens_major=True)
        rk = _rotate(k, inv_freq, offset, inverse=False, tokens_major=False)
        return q, k, v, rq, rk, rest

    @staticmethod
    def backward(ctx, dq, dk, dv, drq, drk, drest):
        (inv_freq,) = ctx.saved_tensors
        batch, seq_len, width = ctx.shape
        dqkv = _qkv_grad(dq, drq, dk, drk, dv, drest, inv_freq, ctx.offset, batch, seq_len,
                         ctx.heads, ctx.kv_heads, width, ctx.dtype)
        return dqkv, None, None, None, None


def split_heads_and_rotate(qkv: torch.Tensor, heads: int, kv_heads: int, inv_freq: torch.Tensor,
                           offset: int = 0):
    """Splits the projection ``qkv: [b, n, (heads + 2 * kv_heads) * d + e]`` (query heads,
    then key heads, then value heads, then e >= 0 other columns) into heads and rotates
    the queries and keys; d is ``2 * len(inv_freq)``.

    Returns ``(q, k, v, rq, rk, rest)``: q: [b, heads, n, d], k, v: [b, kv_heads, n, d] and
    rest: [b, n, e], views of qkv; rq, rk: rotary embeddings of q and k at positions
    ``offset .. offset + n - 1``, as ``apply_rotary`` computes them, rq laid out as
    [b, n, heads, d] and rk contiguous. The
    gradient of qkv is written by one kernel, in qkv's dtype (float16, bfloat16 or
    float32). Runs on CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1``.
    """
    if not isinstance(qkv, torch.Tensor) or not isinstance(inv_freq, torch.Tensor):
        raise TypeError(f"qkv and inv_freq must be torch.Tensors, got {type(qkv).__name__} and "
                        f"{type(inv_freq).__name__}")
    for name, value in (("heads", heads), ("kv_heads", kv_heads), ("offset", offset)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if heads < 1 or kv_heads < 1:
        raise ValueError(f"heads and kv_heads must be positive, got {heads} and {kv_heads}")
    if inv_freq.ndim != 1 or inv_freq.numel() == 0 or inv_freq.device != qkv.device:
        raise ValueError(f"inv_freq must be a non-empty [d / 2] tensor on {qkv.device}, got "
                         f"{tuple(inv_freq.shape)} on {inv_freq.device}")
    heads_width = (heads + 2 * kv_heads) * 2 * inv_freq.shape[0]
    if qkv.ndim != 3 or qkv.shape[-1] < heads_width:
        raise ValueError(f"qkv must be [b, n, (heads + 2 * kv_heads) * d + e] with at least "
                         f"{heads_width} columns for heads={heads}, kv_heads={kv_heads} and "
                         f"d = 2 * len(inv_freq) = {2 * inv_freq.shape[0]}; got shape {tuple(qkv.shape)}")
    if qkv.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"qkv must be float16, bfloat16 or float32, got {qkv.dtype}")
    return _SplitRotate.apply(qkv, inv_freq.float().contiguous(), int(heads), int(kv_heads), int(offset))
