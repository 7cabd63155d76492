"""Plain-PyTorch reference implementations of NSA's three attention branches.

These functions define the semantics that every fast path (the Triton kernels, the
layer's CUDA path, the decoding path) is tested against. They favour clarity over speed,
run on any device and in any floating dtype (half inputs are computed in float32,
float64 inputs stay in float64, autocast or not), and are the layer's CPU path. Each
holds the ``[m, n]`` logits of every query head (never per-query copies of keys or
values), so memory grows at most as ``hq * m * n``.

Shared conventions
------------------
- ``q: [b, hq, m, d]`` holds ``m`` queries whose absolute positions are
  ``q_offset, ..., q_offset + m - 1``; ``k, v: [b, hk, n, d]`` hold keys at positions
  ``0, ..., n - 1``. Query head ``h`` reads kv head ``h // (hq // hk)`` (grouped-query
  attention).
- ``scale`` defaults to ``d ** -0.5``.
- Every function returns ``(out, lse)``: ``out: [b, hq, m, d]`` in the dtype of ``q`` and
  the natural-log log-sum-exp of the scaled logits ``lse: [b, hq, m]`` in the compute
  dtype. A query with no key to attend outputs zeros and has ``lse = -inf``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from einops import rearrange, repeat

__all__ = [
    "compressed_attend",
    "compressed_key_last_positions",
    "selected_attend",
    "sliding_window_attend",
]


def without_autocast(function: Callable) -> Callable:
    """``function(t, ...)`` run with autocast off on the device of its first argument ``t``.

    The reference functions choose their compute dtype themselves. Under autocast their
    matmuls would return bfloat16 or float16 beside float32 softmaxes: CPU autocast then
    fails in ``scatter_add``, which needs one dtype, and CUDA autocast rounds the logits
    and the block scores that decide the selection (the layer's PyTorch path under bf16
    autocast at n = 1024: 2.0% from float32 with them, 0.7% without).
    """

    @functools.wraps(function)
    def run(t: torch.Tensor, *args, **kwargs):
        with torch.autocast(t.device.type, enabled=False):
            return function(t, *args, **kwargs)

    return run


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _grouped_matmul(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``x: [b, hq, m, k] @ y: [b, hk, k, p] -> [b, hq, m, p]``, query head ``h`` against kv
    head ``h // (hq // hk)``. The rows of a group's query heads are stacked into one matrix
    per kv head, so that no kv head's keys or values are copied for each of its query heads."""
    stacked = rearrange(x, "b (hk g) m k -> b hk (g m) k", hk=y.shape[1])
    return rearrange(stacked @ y, "b hk (g m) p -> b (hk g) m p", m=x.shape[2])


def _per_query(document_start: torch.Tensor) -> torch.Tensor:
    """``document_start: [b, m]`` -> ``[b, 1, m, 1]``, to compare with key positions ``[.., keys]``."""
    return document_start.long()[:, None, :, None]


def _masked_softmax(logits: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the last dim of ``logits`` restricted to ``mask``.

    ``logits, mask: [..., L]`` -> (probs [..., L], lse [...]). A fully masked row gets zero
    probabilities and ``lse = -inf``, with finite gradients everywhere.
    """
    any_valid = mask.any(dim=-1, keepdim=True)
    # A row with no valid key would give NaN (and NaN gradients); give it zero logits
    # instead and zero its probabilities afterwards.
    logits = torch.where(any_valid, logits.masked_fill(~mask, float("-inf")), 0.0)
    probs = torch.softmax(logits, dim=-1) * any_valid
    lse = torch.logsumexp(logits, dim=-1).masked_fill(~any_valid.squeeze(-1), float("-inf"))
    return probs, lse


@without_autocast
def sliding_window_attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window_size: int,
    causal: bool = True,
    scale: float | None = None,
    q_offset: int = 0,
    document_start: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sliding-window attention.

    Query at position ``i`` attends the keys ``j`` with ``0 <= i - j <= window_size`` when
    ``causal``, and ``|i - j| <= window_size`` otherwise; with ``document_start`` (``[b, m]``
    integer, the position of the first token of each query's document) only the keys
    ``j >= document_start[i]`` among them.

    q: [b, hq, m, d], k, v: [b, hk, n, d] -> (out [b, hq, m, d], lse [b, hq, m])
    """
    dtype = _compute_dtype(q.dtype)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    m, n = q.shape[2], k.shape[2]
    # Only keys some query's window reaches: a decoding step (m = 1) reads window_size + 1
    # keys, not the whole cache.
    first = min(max(q_offset - window_size, 0), n)
    end = max(min(q_offset + m + (0 if causal else window_size), n), first)
    logits = _grouped_matmul(q.to(dtype), k[:, :, first:end].to(dtype).transpose(-1, -2)) * scale

    q_pos = torch.arange(m, device=q.device)[:, None] + q_offset
    k_pos = torch.arange(first, end, device=q.device)[None, :]
    distance = q_pos - k_pos
    if causal:
        mask = (distance >= 0) & (distance <= window_size)
    else:
        mask = distance.abs() <= window_size
    if document_start is not None:
        mask = mask & (k_pos >= _per_query(document_start))
    probs, lse = _masked_softmax(logits, mask.expand_as(logits))
    return _grouped_matmul(probs, v[:, :, first:end].to(dtype)).to(q.dtype), lse


def compressed_key_last_positions(
    num_compressed: int,
    compress_block_size: int,
    compress_stride: int,
    num_mem: int = 0,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Last token position of each compressed key, memory keys first (position ``-1``).

    Compressed block ``c`` covers tokens ``[c * stride, c * stride + block_size)``.
    Returns ``[num_mem + num_compressed]`` (int64).
    """
    mem = torch.full((num_mem,), -1, dtype=torch.long, device=device)
    blocks = torch.arange(num_compressed, device=device) * compress_stride + compress_block_size - 1
    return torch.cat((mem, blocks))


@without_autocast
def compressed_attend(
    q: torch.Tensor,
    ck: torch.Tensor,
    cv: torch.Tensor,
    compress_block_size: int,
    compress_stride: int,
    num_mem: int = 0,
    causal: bool = True,
    scale: float | None = None,
    q_offset: int = 0,
    return_probs: bool = False,
    document_start: torch.Tensor | None = None,
):
    """Attention over compressed blocks of keys/values plus learned memory key/values.

    ``ck, cv: [b, hk, num_mem + nc, d]`` hold the memory keys first, then the compressed
    block keys in order. Memory keys are seen by every query. When ``causal``, the query at
    position ``i`` sees compressed block ``c`` only when the block's last token
    ``c * compress_stride + compress_block_size - 1`` is ``< i``. With ``document_start``
    (``[b, m]`` integer, the position of the first token of each query's document) it
    also needs the block's first token ``c * compress_stride >= document_start[i]``.

    q: [b, hq, m, d] -> (out [b, hq, m, d], lse [b, hq, m]) and, when ``return_probs``,
    also the attention probabilities ``[b, hq, m, num_mem + nc]`` in the compute dtype
    (differentiable; the selection branch scores blocks from them).
    """
    dtype = _compute_dtype(q.dtype)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    m = q.shape[2]
    num_keys = ck.shape[2]
    logits = _grouped_matmul(q.to(dtype), ck.to(dtype).transpose(-1, -2)) * scale

    if causal:
        last_pos = compressed_key_last_positions(
            num_keys - num_mem, compress_block_size, compress_stride, num_mem, q.device
        )
        q_pos = torch.arange(m, device=q.device)[:, None] + q_offset
        mask = (last_pos[None, :] < q_pos).expand_as(logits)
    else:
        mask = torch.ones_like(logits, dtype=torch.bool)
    if document_start is not None:
        first_pos = torch.arange(num_keys - num_mem, device=q.device) * compress_stride
        in_document = first_pos >= _per_query(document_start)
        memory = in_document.new_ones(()).expand(*in_document.shape[:3], num_mem)
        mask = mask & torch.cat((memory, in_document), dim=-1)

    probs, lse = _masked_softmax(logits, mask)
    out = _grouped_matmul(probs, cv.to(dtype)).to(q.dtype)
    if return_probs:
        return out, lse, probs
    return out, lse


def _selected_key_positions(
    selected_block_indices: torch.Tensor,
    block_size: int,
    m: int,
    q_offset: int,
    include_block_causal: bool,
) -> torch.Tensor:
    """Token positions of every key slot, ``[b, hs, m, (own + sel) * block_size]``.

    The query's own block (when ``include_block_causal``) comes first, then the slots.
    """
    device = selected_block_indices.device
    blocks = selected_block_indices.long()
    if include_block_causal:
        own_block = (torch.arange(m, device=device) + q_offset) // block_size
        own_block = own_block.view(1, 1, m, 1).expand(*blocks.shape[:3], 1)
        blocks = torch.cat((own_block, blocks), dim=-1)
    token_in_block = torch.arange(block_size, device=device)
    positions = blocks.unsqueeze(-1) * block_size + token_in_block
    return rearrange(positions, "b h m s t -> b h m (s t)")


@without_autocast
def selected_attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_size: int,
    selected_block_indices: torch.Tensor,
    fmask: torch.Tensor,
    sel_scale: torch.Tensor | None = None,
    include_block_causal: bool = True,
    scale: float | None = None,
    q_offset: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the query's own block and its selected key blocks.

    For the query at position ``i`` of head ``h`` (kv head ``g = h // (hq // hk)``) the
    softmax runs over the concatenation of key sets: the query's own block (tokens
    ``[i // bs * bs, i // bs * bs + bs)``) when ``include_block_causal``, then, for each
    slot ``s`` whose ``fmask`` is True, the tokens of block ``selected_block_indices[s]``.
    A block chosen twice counts twice. Keys outside ``[0, n)`` are dropped; with
    ``include_block_causal`` no key ``j > i`` is attended, whatever the indices say. The
    logits are ``scale * q.k``, multiplied by ``sel_scale[s]`` for the keys of slot ``s``
    (the own block is not scaled).

    q: [b, hq, m, d], k, v: [b, hk, n, d]; selected_block_indices (integer), fmask (bool),
    sel_scale (float): [b, hs, m, sel] with ``hs`` either ``hk`` (shared by the query heads
    of a group) or ``hq`` (per query head).
    Returns (out [b, hq, m, d], lse [b, hq, m]).
    """
    dtype = _compute_dtype(q.dtype)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    b, hq, m, d = q.shape
    n = k.shape[2]

    positions = _selected_key_positions(
        selected_block_indices, block_size, m, q_offset, include_block_causal
    )
    slot_mask = fmask.bool()
    slot_scale = torch.ones_like(fmask, dtype=dtype) if sel_scale is None else sel_scale.to(dtype)
    if include_block_causal:
        slot_mask = F.pad(slot_mask, (1, 0), value=True)
        slot_scale = F.pad(slot_scale, (1, 0), value=1.0)
    key_mask = repeat(slot_mask, "b h m s -> b h m (s t)", t=block_size)
    key_scale = repeat(slot_scale, "b h m s -> b h m (s t)", t=block_size)

    key_mask = key_mask & (positions >= 0) & (positions < n)
    if include_block_causal:
        q_pos = torch.arange(m, device=q.device).view(1, 1, m, 1) + q_offset
        key_mask = key_mask & (positions <= q_pos)

    if n == 0:
        return q.new_zeros(b, hq, m, d), torch.full((b, hq, m), float("-inf"), dtype=dtype, device=q.device)
    # Logits of every (query, key) pair, then those of the key sets gathered from them:
    # gathered keys would hold d numbers for each of a query's (1 + sel) * block_size key
    # set entries, more than its n logits while n < d * (1 + sel) * block_size.
    hk = k.shape[1]
    all_logits = _grouped_matmul(q.to(dtype), k.to(dtype).transpose(-1, -2))
    all_logits = all_logits.view(b, hk, hq // hk, m, n)

    selections_per_kv_head = positions.shape[1] // hk

    def per_query_head(t: torch.Tensor) -> torch.Tensor:
        """[b, hs, m, keys] -> [b, hk, hs // hk, m, keys], which broadcasts over a group's
        query heads when they share their selection (hs = hk)."""
        return t.view(b, hk, selections_per_kv_head, m, t.shape[-1])

    gather_index = per_query_head(positions.clamp(0, n - 1)).expand(b, hk, hq // hk, m, -1)
    logits = all_logits.gather(-1, gather_index) * scale * per_query_head(key_scale)
    probs, lse = _masked_softmax(logits, per_query_head(key_mask))
    # A key in several sets gets the sum of its probabilities.
    key_probs = torch.zeros_like(all_logits).scatter_add(-1, gather_index, probs)
    out = _grouped_matmul(key_probs.view(b, hq, m, n), v.to(dtype))
    return out.to(q.dtype), lse.reshape(b, hq, m)
