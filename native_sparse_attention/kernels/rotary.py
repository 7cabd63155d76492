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
"""

from __future__ import annotations

import math
import numbers

import torch
import triton
import triton.language as tl

from native_sparse_attention.kernels.library import is_tokens_major, launcher_op, new_heads_tensor

__all__ = ["apply_rotary"]

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


@triton.jit
def _rotary_kernel(
    T, OUT, INV_FREQ,
    stride_tz, stride_th, stride_tn, stride_td,
    stride_oz, stride_oh, stride_on,
    H, N, offset,
    HALF: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_HALF: tl.constexpr,
    HEADS: tl.constexpr, INVERSE: tl.constexpr,
):
    n_start = tl.program_id(0) * BLOCK_N
    head_groups = tl.cdiv(H, HEADS)
    z = tl.program_id(1) // head_groups
    h_start = tl.program_id(1) % head_groups * HEADS
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


_BLOCK_N = 64
# A tile's sine and cosine serve this many heads: fewer would recompute them more often,
# more would shrink the grid of short sequences. At 8 the kernel moved ~2.7 TB/s on an H100.
_HEADS_PER_PROGRAM = 8


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
    b, h, n, d = t.shape
    out = new_heads_tensor(t, tokens_major, lambda shape: _empty(shape, t.dtype, t.device))
    if out.numel() == 0:
        return out
    grid = (triton.cdiv(n, _BLOCK_N), b * triton.cdiv(h, _HEADS_PER_PROGRAM))
    _rotary_kernel[grid](
        t, out, inv_freq, *t.stride(), *out.stride()[:3], h, n, offset,
        HALF=d // 2, BLOCK_N=_BLOCK_N, BLOCK_HALF=triton.next_power_of_2(d // 2),
        HEADS=_HEADS_PER_PROGRAM, INVERSE=inverse,
    )
    return out


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, inv_freq, offset):
        ctx.save_for_backward(inv_freq)
        ctx.offset = offset
        # The gradient takes t's order of heads and tokens: the layer's t is a view of its
        # qkv projection, whose gradient then gathers each token's heads from contiguous
        # rows instead of transposing them (with the compressed branch's dQ likewise, the
        # eager layer's copies at 32 heads, n = 65536 take 0.35 ms less on an H100).
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
