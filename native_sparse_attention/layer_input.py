"""Validation of an attention layer's input ``x: [b, n, dim]``, shared by ``SparseAttention``
and its dense baseline ``FullAttention`` so that swapping one for the other keeps the errors."""

from __future__ import annotations

import torch

__all__ = ["check_layer_input"]


def check_layer_input(x, dim: int, weight: torch.Tensor) -> None:
    """Raises TypeError / ValueError naming ``x`` unless it is a floating-point [b, n, dim]
    tensor with a token, on ``weight``'s device and, outside autocast, of its dtype."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.ndim != 3:
        raise ValueError(f"x must have shape [batch, seq_len, dim], got {x.ndim} dims {tuple(x.shape)}")
    if x.shape[-1] != dim:
        raise ValueError(f"x must have {dim} features in its last dim (the layer's dim), got {x.shape[-1]}")
    if x.shape[1] == 0:
        raise ValueError("x must hold at least one token (seq_len > 0)")
    if not x.is_floating_point():
        raise TypeError(f"x must be a floating-point tensor, got {x.dtype}")
    if x.device != weight.device:
        raise ValueError(f"x is on {x.device} but the layer's parameters are on {weight.device}")
    if x.dtype != weight.dtype and not torch.is_autocast_enabled(x.device.type):
        raise TypeError(f"x is {x.dtype} but the layer's parameters are {weight.dtype}: cast one to the "
                        "other's dtype, or run the layer under torch.autocast")
