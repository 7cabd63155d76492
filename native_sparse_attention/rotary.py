"""Rotary position embeddings (RoFormer), applied at absolute token positions."""

from __future__ import annotations

from collections.abc import Callable

import torch
from einops import rearrange
from torch import nn

_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def split_qkv_heads(qkv: torch.Tensor, heads: int, kv_heads: int, dim_head: int):
    """qkv: [b, n, (heads + 2 * kv_heads) * dim_head + e]: query heads, key heads, value
    heads, e other columns -> views q: [b, heads, n, d], k, v: [b, kv_heads, n, d], rest: [b, n, e]."""
    q_width, kv_width = heads * dim_head, kv_heads * dim_head
    rest_width = qkv.shape[-1] - q_width - 2 * kv_width
    q, k, v, rest = qkv.split((q_width, kv_width, kv_width, rest_width), dim=-1)
    q = rearrange(q, "b n (h d) -> b h n d", h=heads)
    k, v = (rearrange(t, "b n (h d) -> b h n d", h=kv_heads) for t in (k, v))
    return q, k, v, rest


def rotated_query_and_key_heads(qkv: torch.Tensor, heads: int, kv_heads: int, dim_head: int,
                                rotate: Callable[[torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """rq: [b, heads, n, d], rk: [b, kv_heads, n, d], the query and key heads of ``qkv``
    (``split_qkv_heads``' layout, where the key heads follow the query heads) rotated by
    one call of ``rotate: [b, heads + kv_heads, n, d] -> the same rotated``: one launch
    for both in a decoding step."""
    query_and_key_heads = rearrange(qkv[..., : (heads + kv_heads) * dim_head], "b n (h d) -> b h n d", d=dim_head)
    rotated = rotate(query_and_key_heads)
    return rotated.split((heads, kv_heads), dim=1)


class RotaryEmbedding(nn.Module):
    """Rotates pairs of channels ``(x[i], x[i + d/2])`` by position-dependent angles.

    dim_head must be even. Frequencies are a buffer, so they follow ``.to(device)``.
    CUDA tensors run the fused Triton kernel of ``kernels/rotary.py``; CPU tensors the
    PyTorch formula below, which is the reference the kernel is tested against.
    """

    def __init__(self, dim_head: int, theta: float = 10000.0):
        super().__init__()
        inv_freq = theta ** (-torch.arange(0, dim_head, 2, dtype=torch.float32) / dim_head)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def split_heads(self, qkv: torch.Tensor, heads: int, kv_heads: int, offset: int = 0):
        """Splits the projection ``qkv: [b, n, (heads + 2 * kv_heads) * d + e]`` (query heads,
        then key heads, then value heads, then e >= 0 other columns) into q: [b, heads, n, d],
        k, v: [b, kv_heads, n, d] and rest: [b, n, e], and rotates q and k; returns
        ``(q, k, v, rotary(q), rotary(k), rest)``.

        On CUDA one kernel writes qkv's whole gradient, where autograd would rotate the
        rotated copies' gradients back and then concatenate the pieces in a pass of its own.
        """
        if qkv.is_cuda and qkv.dtype in _KERNEL_DTYPES:
            from native_sparse_attention.kernels.rotary import split_heads_and_rotate

            return split_heads_and_rotate(qkv, heads, kv_heads, self.inv_freq, offset)
        q, k, v, rest = split_qkv_heads(qkv, heads, kv_heads, 2 * self.inv_freq.shape[0])
        return q, k, v, self(q, offset), self(k, offset), rest

    def forward(self, t: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """t: [b, h, n, d] at positions ``offset .. offset + n - 1`` -> rotated [b, h, n, d]."""
        if t.is_cuda and t.dtype in _KERNEL_DTYPES:
            from native_sparse_attention.kernels.rotary import apply_rotary

            return apply_rotary(t, self.inv_freq, offset)
        return self._rotated(t, torch.arange(t.shape[-2], device=t.device, dtype=torch.float32) + offset)

    def at(self, t: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """t: [b, h, n, d], batch row ``r`` at positions ``position[r] ..`` (``position``: [b]
        int64 on t's device, read there: a decoding step that a CUDA graph replays) ->
        rotated [b, h, n, d]. No gradient."""
        if t.is_cuda and t.dtype in _KERNEL_DTYPES:
            from native_sparse_attention.kernels.rotary import rotate_at

            return rotate_at(t, self.inv_freq, position)
        steps = torch.arange(t.shape[-2], device=t.device, dtype=torch.float32)
        return self._rotated(t, (position[:, None].float() + steps)[:, None])

    def _rotated(self, t: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """t: [..., n, d] rotated at ``positions``: [n], or any shape that broadcasts
        against t's leading dims followed by n."""
        angles = positions[..., None] * self.inv_freq
        cos, sin = angles.cos(), angles.sin()
        compute_dtype = torch.promote_types(t.dtype, torch.float32)
        first, second = t.to(compute_dtype).chunk(2, dim=-1)
        rotated = torch.cat((first * cos - second * sin, first * sin + second * cos), dim=-1)
        return rotated.to(t.dtype)
