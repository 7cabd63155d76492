"""``native_sparse_attend``: NSA's selection branch, and optionally its sliding window.

Inputs are validated once, here, before anything is launched. CUDA tensors run on the
Triton kernels of ``kernels/selection.py``; so do CPU tensors when ``TRITON_INTERPRET=1``
(Triton's interpreter, which the CPU tests use). Any other CPU input falls back to the
PyTorch reference of ``reference.py``, which has the same semantics and is differentiable
the same way, so the function works (slowly) without a GPU or without Triton.
"""

from __future__ import annotations

import math
import numbers
import os

import torch

from native_sparse_attention.reference import selected_attend, sliding_window_attend

__all__ = ["MAX_BLOCK_SIZE", "MAX_GROUP_SIZE", "MAX_HEAD_DIM", "native_sparse_attend"]

MAX_GROUP_SIZE = 16  # query heads per kv head: one program's rows
MAX_BLOCK_SIZE = 128
BLOCK_SIZE_MULTIPLE = 16  # the fine blocks the kernels walk
MAX_HEAD_DIM = 128
# The dK / dV pass packs (selection head, key set) into 32 bits, 16 bits each.
MAX_SELECTION_HEADS = 2**15 - 1
MAX_SLOTS = 2**16 - 2
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)


def native_sparse_attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_size: int,
    selected_block_indices: torch.Tensor,
    fmask: torch.Tensor,
    sel_scale: torch.Tensor | None = None,
    include_block_causal: bool = True,
    return_sliding_window_out: bool = False,
    sliding_window_size: int | None = None,
    scale: float | None = None,
    return_lse: bool = False,
    q_offset: int = 0,
):
    """Attention of each query over its own block and its selected key blocks.

    For query i of head h (kv head ``h // (hq // hk)``) the softmax runs over the query's
    own block ``[i // block_size * block_size, ... + block_size)`` when
    ``include_block_causal``, then over the block ``selected_block_indices[s]`` of every
    slot s whose ``fmask`` is True (a block chosen twice counts twice). Keys at positions
    >= n, and blocks with a negative index, are dropped; with ``include_block_causal`` no
    key j > i is attended. Logits are ``scale * q.k``, times ``sel_scale[s]`` for the keys
    of slot s (differentiable for any value). A query without keys outputs 0 (LSE -inf).

    q: [b, hq, n, d]; k, v: [b, hk, n, d]; selected_block_indices (int32/int64), fmask
    (bool), sel_scale (float): [b, hs, n, sel], hs = hk (shared by a query group) or hq.
    fp16, bf16 and fp32 are computed natively (products in the input dtype, accumulation
    in float32).

    ``q_offset`` continues a sequence, as a decoding step does: q then holds the last m
    positions ``q_offset .. q_offset + m - 1`` of the ``n = q_offset + m`` keys (q, the
    selection tensors and the outputs have m rows), and i above is the position. It runs
    without gradients only.

    Returns ``out`` [b, hq, n, d]; with ``return_sliding_window_out``, ``(out, sliding_out)``
    where ``sliding_out`` is sliding-window attention of the same q, k, v over the keys
    with ``0 <= i - j <= w`` (``|i - j| <= w`` when not ``include_block_causal``),
    ``w = sliding_window_size`` (default ``block_size``), computed in the same launch.
    ``return_lse`` appends the selection's natural-log LSE [b, hq, n] (float32, not
    differentiable): ``(out, lse)`` or ``(out, sliding_out, lse)``.
    """
    _validate(
        q, k, v, block_size, selected_block_indices, fmask, sel_scale,
        include_block_causal, return_sliding_window_out, sliding_window_size, scale, return_lse, q_offset,
    )
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    window = None
    if return_sliding_window_out:
        window = block_size if sliding_window_size is None else sliding_window_size

    if _use_kernels(q):
        from native_sparse_attention.kernels.selection import selection_attention

        out, sliding_out, lse = selection_attention(
            q, k, v, block_size, selected_block_indices, fmask, sel_scale,
            include_block_causal, window, scale, int(q_offset),
        )
    else:
        out, lse = selected_attend(
            q, k, v, block_size, selected_block_indices, fmask, sel_scale,
            include_block_causal=include_block_causal, scale=scale, q_offset=q_offset,
        )
        lse = lse.float()
        sliding_out = None
        if window is not None:
            sliding_out, _ = sliding_window_attend(
                q, k, v, window, causal=include_block_causal, scale=scale, q_offset=q_offset
            )

    outputs = (out,) + ((sliding_out,) if window is not None else ()) + ((lse,) if return_lse else ())
    return outputs[0] if len(outputs) == 1 else outputs


def _use_kernels(q: torch.Tensor) -> bool:
    if q.numel() == 0:
        return False
    return q.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def _validate(
    q, k, v, block_size, indices, fmask, sel_scale,
    include_block_causal, return_sliding_window_out, sliding_window_size, scale, return_lse, q_offset,
) -> None:
    tensors = {"q": q, "k": k, "v": v, "selected_block_indices": indices, "fmask": fmask}
    if sel_scale is not None:
        tensors["sel_scale"] = sel_scale
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D, got shape {tuple(t.shape)}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    for name, flag in (
        ("include_block_causal", include_block_causal),
        ("return_sliding_window_out", return_sliding_window_out),
        ("return_lse", return_lse),
    ):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")

    if q.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"q must be float16, bfloat16 or float32, got {q.dtype}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise ValueError(f"{name} has dtype {t.dtype} but q has {q.dtype}")

    if not isinstance(q_offset, numbers.Integral) or isinstance(q_offset, bool):
        raise TypeError(f"q_offset must be an int, got {type(q_offset).__name__}")
    if q_offset < 0:
        raise ValueError(f"q_offset must be >= 0, got {q_offset}")
    if q_offset and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, sel_scale) if t is not None):
        raise ValueError(
            f"q_offset={q_offset} runs without gradients only (decoding, or prefills that continue a cache): "
            "call it under torch.no_grad() or with inputs that do not require grad"
        )

    b, hq, n, d = q.shape
    hk = k.shape[1]
    if k.shape[0] != b or k.shape[2] != q_offset + n or k.shape[3] != d:
        raise ValueError(
            f"k must be [b, hk, q_offset + n, d] = [{b}, hk, {q_offset + n}, {d}] to match q and q_offset, "
            f"got {tuple(k.shape)}"
        )
    if v.shape != k.shape:
        raise ValueError(f"v must have the shape of k {tuple(k.shape)}, got {tuple(v.shape)}")
    if hk == 0 or hq % hk:
        raise ValueError(f"the query heads of q ({hq}) must be a multiple of the kv heads of k ({hk})")
    if hq // hk > MAX_GROUP_SIZE:
        raise ValueError(f"q has {hq // hk} query heads per kv head; at most {MAX_GROUP_SIZE} are supported")
    if d > MAX_HEAD_DIM:
        raise ValueError(f"q has head dim {d}; at most {MAX_HEAD_DIM} is supported")

    if not isinstance(block_size, numbers.Integral) or isinstance(block_size, bool):
        raise TypeError(f"block_size must be an int, got {type(block_size).__name__}")
    if block_size % BLOCK_SIZE_MULTIPLE or not BLOCK_SIZE_MULTIPLE <= block_size <= MAX_BLOCK_SIZE:
        raise ValueError(
            f"block_size must be a multiple of {BLOCK_SIZE_MULTIPLE} between "
            f"{BLOCK_SIZE_MULTIPLE} and {MAX_BLOCK_SIZE}, got {block_size}"
        )

    hs = indices.shape[1]
    if indices.shape[0] != b or indices.shape[2] != n or hs not in (hk, hq):
        raise ValueError(
            f"selected_block_indices must be [b, hs, n, sel] with b = {b}, n = {n} and hs = {hk} "
            f"(kv heads) or {hq} (query heads), got {tuple(indices.shape)}"
        )
    if hs > MAX_SELECTION_HEADS or indices.shape[3] > MAX_SLOTS:
        raise ValueError(
            f"selected_block_indices may have at most {MAX_SELECTION_HEADS} heads and {MAX_SLOTS} slots, "
            f"got {tuple(indices.shape)}"
        )
    if indices.dtype not in _INDEX_DTYPES:
        raise ValueError(f"selected_block_indices must be int32 or int64, got {indices.dtype}")
    if fmask.shape != indices.shape:
        raise ValueError(f"fmask must have the shape of selected_block_indices {tuple(indices.shape)}, got {tuple(fmask.shape)}")
    if fmask.dtype != torch.bool:
        raise ValueError(f"fmask must be bool, got {fmask.dtype}")
    if sel_scale is not None:
        if sel_scale.shape != indices.shape:
            raise ValueError(
                f"sel_scale must have the shape of selected_block_indices {tuple(indices.shape)}, "
                f"got {tuple(sel_scale.shape)}"
            )
        if not sel_scale.is_floating_point():
            raise ValueError(f"sel_scale must be a floating tensor, got {sel_scale.dtype}")

    if sliding_window_size is not None:
        if not isinstance(sliding_window_size, numbers.Integral) or isinstance(sliding_window_size, bool):
            raise TypeError(f"sliding_window_size must be an int, got {type(sliding_window_size).__name__}")
        if sliding_window_size < 0:
            raise ValueError(f"sliding_window_size must be >= 0, got {sliding_window_size}")
    if scale is not None:
        if not isinstance(scale, numbers.Real) or isinstance(scale, bool):
            raise TypeError(f"scale must be a float, got {type(scale).__name__}")
        if not math.isfinite(scale):
            raise ValueError(f"scale must be finite, got {scale}")
