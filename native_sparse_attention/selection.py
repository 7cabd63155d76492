"""Choosing the key blocks of NSA's selection branch from the compressed attention.

Notation: compressed block ``c`` covers tokens ``[c * stride, c * stride + cbs)``;
selection block ``j`` covers tokens ``[j * sbs, (j + 1) * sbs)``. The importance of
selection block ``j`` for a query is the sum of the compressed-branch attention
probabilities of every compressed block whose token span overlaps block ``j`` (the NSA
paper's definition, which lets compression and selection use different sizes). With
shared selection the importance is also summed over the query heads of a GQA group.

A block is a candidate for a query only when at least one compressed block overlapping it
is visible to that query; in causal mode the query's own block is never a candidate
because the selection branch always attends it (the block-causal diagonal).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from native_sparse_attention.reference import compressed_key_last_positions, without_autocast

__all__ = [
    "BlockSelection",
    "block_overlap",
    "num_compressed_blocks",
    "num_selection_blocks",
    "select_blocks",
    "selectable_blocks",
    "selection_block_scores",
]


class BlockSelection(NamedTuple):
    """The top-n blocks chosen per query.

    indices: [b, hs, m, num_selected] (int64), mask: [b, hs, m, num_selected] (bool, False
    for slots left without a valid block), scores: [b, hs, m, num_selected] (the
    importance of each chosen block, 0 where masked; differentiable).
    """

    indices: torch.Tensor
    mask: torch.Tensor
    scores: torch.Tensor


def num_compressed_blocks(seq_len: int, compress_block_size: int, compress_stride: int) -> int:
    """Number of complete compression windows in ``seq_len`` tokens."""
    if seq_len < compress_block_size:
        return 0
    return (seq_len - compress_block_size) // compress_stride + 1


def num_selection_blocks(seq_len: int, selection_block_size: int) -> int:
    """Number of selection blocks covering ``seq_len`` tokens (the last may be partial)."""
    return math.ceil(seq_len / selection_block_size)


def block_overlap(
    num_compressed: int,
    compress_block_size: int,
    compress_stride: int,
    selection_block_size: int,
    num_selection: int,
    device: torch.device | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``[num_compressed, num_selection]``: 1 where compressed block c overlaps selection block j."""
    c_start = torch.arange(num_compressed, device=device)[:, None] * compress_stride
    j_start = torch.arange(num_selection, device=device)[None, :] * selection_block_size
    overlaps = (c_start < j_start + selection_block_size) & (j_start < c_start + compress_block_size)
    return overlaps.to(dtype)


@without_autocast
def selection_block_scores(
    compressed_probs: torch.Tensor,
    compress_block_size: int,
    compress_stride: int,
    selection_block_size: int,
    num_selection: int,
    kv_heads: int | None = None,
) -> torch.Tensor:
    """Importance of every selection block.

    compressed_probs: [b, hq, m, nc], the compressed branch's attention probabilities over
    the compressed blocks (memory keys left out). With ``kv_heads`` given the scores are
    summed over the query heads of each group (shared selection).
    Returns [b, hs, m, num_selection] with ``hs = kv_heads or hq``.

    Each score adds its terms one at a time, element by element, in one order: the
    compressed blocks overlapping the block by ascending index, then the group's heads by
    ascending index. Two blocks that the same visible compressed blocks overlap then
    score the same bits, the other blocks' probabilities being exact zeros, and
    ``select_blocks`` breaks their tie by its rule. A matmul with the 0/1 overlap matrix
    rounded such columns differently wherever they fell in its vector lanes, so that a
    decoded token could break a tie otherwise than the same token in a longer forward.
    """
    num_compressed = compressed_probs.shape[-1]
    scores = compressed_probs.new_zeros(*compressed_probs.shape[:-1], num_selection)
    if num_compressed:
        overlap = block_overlap(num_compressed, compress_block_size, compress_stride, selection_block_size,
                                num_selection, compressed_probs.device, torch.int32)
        # A block's compressed blocks are consecutive: the first of them and how many.
        first, count = overlap.argmax(0), overlap.sum(0)
        most = min(num_compressed, (selection_block_size + compress_block_size) // compress_stride + 1)
        for t in range(most):
            term = compressed_probs.index_select(-1, (first + t).clamp(max=num_compressed - 1))
            scores = scores + torch.where(t < count, term, 0.0)
    if kv_heads is None:
        return scores
    heads = scores.unflatten(1, (kv_heads, -1)).unbind(2)
    shared = heads[0]
    for head in heads[1:]:
        shared = shared + head
    return shared


def selectable_blocks(
    num_queries: int,
    q_offset: int,
    num_compressed: int,
    compress_block_size: int,
    compress_stride: int,
    selection_block_size: int,
    num_selection: int,
    causal: bool,
    device: torch.device | None = None,
    document_start: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[m, num_selection]`` bool: which blocks may be selected by each query; with
    ``document_start`` (``[b, m]`` integer, the first token of each query's document, whose
    compressed blocks the query then sees only from there on) ``[b, 1, m, num_selection]``.

    Query ``r`` sits at position ``q_offset + r``.
    """
    overlap = block_overlap(
        num_compressed,
        compress_block_size,
        compress_stride,
        selection_block_size,
        num_selection,
        device,
    )
    q_pos = torch.arange(num_queries, device=device)[:, None] + q_offset
    if causal:
        last_pos = compressed_key_last_positions(
            num_compressed, compress_block_size, compress_stride, 0, device
        )
        visible = (last_pos[None, :] < q_pos).float()
    else:
        visible = torch.ones(num_queries, num_compressed, device=device)
    if document_start is not None:
        first_pos = torch.arange(num_compressed, device=device) * compress_stride
        visible = (visible * (first_pos >= document_start.long()[:, :, None]))[:, None]
    selectable = (visible @ overlap) > 0
    if causal:
        own_block = q_pos // selection_block_size
        selectable &= torch.arange(num_selection, device=device)[None, :] != own_block
    return selectable


def select_blocks(
    scores: torch.Tensor, selectable: torch.Tensor, num_selected: int
) -> BlockSelection:
    """Top-``num_selected`` selectable blocks by score.

    scores: [b, hs, m, nsb]; selectable: [m, nsb], or any shape that broadcasts to scores'.
    Slots beyond the number of selectable blocks are masked (index 0, mask False).
    """
    *lead, num_blocks = scores.shape
    k = min(num_selected, num_blocks)
    masked_scores = scores.masked_fill(~selectable, float("-inf"))
    # Equal scores go to the later block, as in the kernels (whose sort keys hold the block
    # index below the score). Blocks that the same visible compressed keys overlap score
    # exactly alike, and torch.topk breaks such ties by no fixed rule: a query's choice then
    # changed with the number of blocks after it, and a decoded token's with the sequence's.
    later_first = masked_scores.flip(-1).sort(dim=-1, descending=True, stable=True).indices[..., :k]
    indices = num_blocks - 1 - later_first
    top_scores = masked_scores.gather(-1, indices)
    mask = torch.isfinite(top_scores)
    indices = indices.masked_fill(~mask, 0)
    top_scores = torch.where(mask, top_scores, torch.zeros_like(top_scores))
    if k < num_selected:
        pad = num_selected - k
        indices = torch.cat((indices, indices.new_zeros(*lead, pad)), dim=-1)
        mask = torch.cat((mask, mask.new_zeros(*lead, pad)), dim=-1)
        top_scores = torch.cat((top_scores, top_scores.new_zeros(*lead, pad)), dim=-1)
    return BlockSelection(indices, mask, top_scores)
