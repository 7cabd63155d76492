"""Rotary position embeddings (RoFormer), applied at absolute token positions."""

from __future__ import annotations

import torch
from torch import nn

_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


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

    def forward(self, t: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """t: [b, h, n, d] at positions ``offset .. offset + n - 1`` -> rotated [b, h, n, d]."""
        if t.is_cuda and t.dtype in _KERNEL_DTYPES:
            from native_sparse_attention.kernels.rotary import apply_rotary

            return apply_rotary(t, self.inv_freq, offset)
        positions = torch.arange(t.shape[-2], device=t.device, dtype=torch.float32) + offset
        angles = positions[:, None] * self.inv_freq[None, :]
        cos, sin = angles.cos(), angles.sin()
        compute_dtype = torch.promote_types(t.dtype, torch.float32)
        first, second = t.to(compute_dtype).chunk(2, dim=-1)
        rotated = torch.cat((first * cos - second * sin, first * sin + second * cos), dim=-1)
        return rotated.to(t.dtype)
