"""FlexAttention backend for NSA's selected-block and sliding-window branches.

``torch.nn.attention.flex_attention`` runs attention over a ``BlockMask``: a list of
``(Q_TILE, KV_TILE)`` tiles per query tile (the kernel skips every other tile), refined
inside the listed tiles by a ``mask_mod`` evaluated per (query, key) pair. Both masks here
are built at tile granularity straight from their definition, never from an ``n x n``
boolean mask (``create_block_mask`` evaluates the mask_mod densely unless compiled):

- selected branch: the tiles of a query tile are the union over its queries of the tiles
  overlapping the query's own block (causal) and its unmasked selected blocks; the
  mask_mod then checks the exact key set of each query against its ``sel`` slots;
- sliding branch: tiles follow from the range of ``i - j`` inside a tile, and tiles that
  lie wholly inside the window are passed as "full" tiles, which skip the mask_mod.

Tile sizes. On CUDA the Triton kernels tile each flex tile with their own ``BLOCK_M x
BLOCK_N`` and require ``Q_TILE % BLOCK_M == 0`` and ``KV_TILE % BLOCK_N == 0``. The
forward raises when its default config does not divide the tiles, and the backward drops
every config that does not (before ``kernel_options`` can override it), so with the
default heuristics only 128 x 128 tiles are safe on every GPU (e.g. sm90 bf16, head dim
64-128 backward uses ``BLOCK_N1 = 128``). Tiles therefore default to ``(128, 128)``
whatever the selection block size: for blocks smaller than 128 keys a listed tile holds
keys outside the selection, masked by the mask_mod (up to ``128 / block_size`` times
the useful work). Any tile sizes work in eager mode.

Eager mode (CPU tests) ignores the tiles and evaluates the mask_mod over all ``n x n``
pairs, so it checks the semantics only; ``tests/test_flex.py`` checks the tile lists
separately. FlexAttention rejects CPU inputs that require grad (the compiled CPU backend
is inference-only, pytorch/pytorch#169646), so this module's backward needs CUDA.
"""

from __future__ import annotations

import functools

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

__all__ = ["flex_document_causal_attention", "flex_selected_and_sliding"]

# With the sel_scale score_mod under bf16, the default three-stage forward config needs
# 247,808 bytes of shared memory on an H100 (limit 232,448; torch 2.11); two stages fit.
_SCORE_MOD_KERNEL_OPTIONS = {"fwd_num_stages": 2, "bwd_num_stages": 2}


# Static shapes give flex_attention one compiled graph per (shape, dtype, mask and score
# function) it meets: a layer takes two per sequence length (selected and sliding), more
# with documents or under autocast. Past Dynamo's recompile limit (8 by default) a call
# silently runs the unfused flex_attention, which materialises every [n, n] score matrix:
# slow, and out of memory at long sequences. The limit is raised for these calls alone.
_FLEX_RECOMPILE_LIMIT = 256


@functools.cache
def _compiled_flex_attention():
    # Static shapes: a call at a second sequence length would otherwise recompile with the
    # length symbolic, which Inductor's flex template rejected (NoValidChoicesError, torch
    # 2.11, H100) when the layer ran a packed row and then each document alone.
    compiled = torch.compile(flex_attention, dynamic=False)

    def attend(*args, **kwargs):
        with torch._dynamo.config.patch(recompile_limit=_FLEX_RECOMPILE_LIMIT):
            return compiled(*args, **kwargs)

    return attend


def _attend(q, k, v, **kwargs) -> torch.Tensor:
    # Uncompiled flex_attention materialises the full score matrix: fine for CPU tests,
    # far too slow and memory-hungry for training on a GPU. Inside a graph being compiled
    # Dynamo lowers flex_attention itself, and the cached wrapper would only be traced
    # through.
    compiled = q.is_cuda and not torch.compiler.is_compiling()
    fn = _compiled_flex_attention() if compiled else flex_attention
    return fn(q, k, v, enable_gqa=True, **kwargs)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _tiles_to_block_mask(
    tiles: torch.Tensor,
    full_tiles: torch.Tensor | None,
    tile_size: tuple[int, int],
    seq_len: int,
    mask_mod,
) -> BlockMask:
    """BlockMask from tile-level masks ``[B, H, num_q_tiles, num_kv_tiles]`` (bool).

    ``tiles`` lists the tiles refined by ``mask_mod``; ``full_tiles`` (disjoint from
    ``tiles``) those attended entirely.
    """

    def ordered(t):
        # Stable descending sort puts the listed tiles first, in increasing kv order.
        counts = t.sum(-1, dtype=torch.int32)
        indices = t.to(torch.int8).argsort(dim=-1, descending=True, stable=True).to(torch.int32)
        return counts, indices

    full = (None, None) if full_tiles is None else ordered(full_tiles)
    return BlockMask.from_kv_blocks(
        *ordered(tiles), *full, BLOCK_SIZE=tile_size, mask_mod=mask_mod, seq_lengths=(seq_len, seq_len)
    )


def _selected_tiles(
    slot_blocks: torch.Tensor, n: int, block_size: int, causal: bool, tile_size: tuple[int, int]
) -> torch.Tensor:
    """Tiles touched by some query of each query tile, ``[b, hs, num_q_tiles, num_kv_tiles]``.

    slot_blocks: [b, hs, n, sel], the selected block of each slot, -1 where masked.
    """
    q_tile, kv_tile = tile_size
    b, hs = slot_blocks.shape[:2]
    device = slot_blocks.device
    num_q_tiles, num_kv_tiles = _cdiv(n, q_tile), _cdiv(n, kv_tile)
    q_pos = torch.arange(n, device=device).view(1, 1, n, 1)

    blocks = slot_blocks.long()
    if causal:
        blocks = torch.cat((blocks, (q_pos // block_size).expand(b, hs, n, 1)), dim=-1)
    first = blocks * block_size // kv_tile
    last = ((blocks + 1) * block_size).clamp(max=n) - 1
    if causal:
        # Keys after the query are never attended: this trims the own block's tiles.
        last = torch.minimum(last, q_pos)
    last = last // kv_tile
    # A block of block_size keys straddles at most this many kv tiles.
    span = (block_size + kv_tile - 2) // kv_tile + 1
    tile = first.unsqueeze(-1) + torch.arange(span, device=device)
    valid = (blocks >= 0).unsqueeze(-1) & (tile <= last.unsqueeze(-1))

    # Scatter (query tile, kv tile) hits into a dense tile grid; invalid hits go to an
    # extra column that is dropped, which avoids a data-dependent (syncing) filter.
    tile = torch.where(valid, tile, num_kv_tiles)
    row = (torch.arange(n, device=device) // q_tile).view(1, 1, n, 1, 1)
    flat = (row * (num_kv_tiles + 1) + tile).view(b, hs, -1)
    grid = torch.zeros(b, hs, num_q_tiles * (num_kv_tiles + 1), dtype=torch.bool, device=device)
    grid.scatter_(2, flat, True)
    return grid.view(b, hs, num_q_tiles, num_kv_tiles + 1)[..., :num_kv_tiles]


def _selected_block_mask(
    slot_blocks: torch.Tensor, hq: int, n: int, block_size: int, causal: bool, tile_size: tuple[int, int]
) -> BlockMask:
    """slot_blocks: [b, hs, n, sel] (-1 where masked) -> BlockMask over ``[b, hq, n, n]``."""
    hs, num_slots = slot_blocks.shape[1], slot_blocks.shape[-1]
    group = hq // hs

    def mask_mod(b, h, q_idx, kv_idx):
        block = kv_idx // block_size
        head = h // group
        hit = block == q_idx // block_size if causal else torch.zeros_like(block, dtype=torch.bool)
        # The row first, then its slots: torch 2.10 fails to trace the four-index read when
        # eager FlexAttention builds its masks.
        slots = slot_blocks[b, head, q_idx]
        for s in range(num_slots):
            hit = hit | (slots[..., s] == block)
        return hit & (kv_idx <= q_idx) if causal else hit

    tiles = _selected_tiles(slot_blocks, n, block_size, causal, tile_size)
    # A BlockMask's head dim must be 1 or hq: shared selections repeat over their group.
    tiles = tiles.repeat_interleave(group, dim=1)
    return _tiles_to_block_mask(tiles, None, tile_size, n, mask_mod)


def _selected_score_mod(
    slot_blocks: torch.Tensor, sel_scale: torch.Tensor, hq: int, block_size: int, causal: bool, dtype: torch.dtype
):
    """score_mod multiplying the logits of the keys of slot ``s`` by ``sel_scale[..., s]``."""
    hs, num_slots = slot_blocks.shape[1], slot_blocks.shape[-1]
    group = hq // hs
    # Column num_slots holds 1: the scale of the own block. The score_mod must index a
    # tensor that requires grad only once (Inductor's backward rejects repeated indexing
    # of such a tensor), so the slot is found first on the integer block table.
    scales = torch.cat((sel_scale.to(dtype), sel_scale.new_ones(*sel_scale.shape[:-1], 1, dtype=dtype)), -1)

    def score_mod(score, b, h, q_idx, kv_idx):
        block = kv_idx // block_size
        head = h // group
        slot = torch.full_like(block, num_slots)
        for s in range(num_slots):
            slot = torch.where(slot_blocks[b, head, q_idx, s] == block, s, slot)
        if causal:
            slot = torch.where(block == q_idx // block_size, num_slots, slot)
        return score * scales[b, head, q_idx, slot]

    return score_mod


def _sliding_block_mask(
    n: int, window: int, causal: bool, tile_size: tuple[int, int], device: torch.device,
    document_start: torch.Tensor | None = None,
) -> BlockMask:
    """Sliding window ``0 <= i - j <= window`` (causal) or ``|i - j| <= window`` as a BlockMask
    ``[1, 1, n, n]``; with ``document_start: [b, n]`` (int32, causal) only keys
    ``j >= document_start[b, i]``, which a tile's own mask checks: no tile is full then."""
    lowest = 0 if causal else -window

    def mask_mod(b, h, q_idx, kv_idx):
        distance = q_idx - kv_idx
        in_window = (distance >= lowest) & (distance <= window)
        if document_start is None:
            return in_window
        return in_window & (kv_idx >= document_start[b, q_idx])

    q_tile, kv_tile = tile_size
    q_start = torch.arange(0, n, q_tile, device=device)
    kv_start = torch.arange(0, n, kv_tile, device=device)
    q_end = (q_start + q_tile).clamp(max=n) - 1
    kv_end = (kv_start + kv_tile).clamp(max=n) - 1
    # Range of i - j over the (query, key) pairs of each tile.
    d_min = q_start[:, None] - kv_end[None, :]
    d_max = q_end[:, None] - kv_start[None, :]
    touched = (d_max >= lowest) & (d_min <= window)
    full = (d_min >= lowest) & (d_max <= window) & (document_start is None)
    return _tiles_to_block_mask((touched & ~full)[None, None], full[None, None], tile_size, n, mask_mod)


def flex_selected_and_sliding(
    rq: torch.Tensor,
    rk: torch.Tensor,
    v: torch.Tensor,
    block_size: int,
    selected_block_indices: torch.Tensor,
    fmask: torch.Tensor,
    sliding_window_size: int,
    causal: bool = True,
    sel_scale: torch.Tensor | None = None,
    *,
    tile_size: tuple[int, int] = (128, 128),
    document_start: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """NSA's selected-block and sliding-window branches through FlexAttention.

    rq: [b, hq, n, d]; rk, v: [b, hk, n, d] (query head ``h`` reads kv head
    ``h // (hq // hk)``); selected_block_indices (integer, in ``[0, ceil(n / block_size))``),
    fmask (bool), sel_scale (float, optional): [b, hs, n, sel] with ``hs`` either ``hk``
    (one selection shared by the query heads of a group) or ``hq``.
    Returns (selected_out, sliding_out), both [b, hq, n, d] in the dtype of ``rq``.

    The selected branch matches ``reference.selected_attend(..., include_block_causal=causal)``
    whenever the unmasked slots of a row hold distinct blocks, as the layer's top-n
    selection guarantees: the query at ``i`` attends its own block up to ``i`` when
    ``causal``, plus every unmasked selected block (keys ``<= i`` when ``causal``), with
    the logits of the keys of slot ``s`` multiplied by ``sel_scale[..., s]``. Being a
    mask, it attends a key once however many slots name its block, where the reference
    counts a block once per slot; such a key takes the scale of the last slot naming it,
    and the own block (never selected in the causal layer) stays unscaled. A query with
    no key to attend (non-causal, every slot masked) outputs zeros.

    The sliding branch matches ``reference.sliding_window_attend``: keys ``j`` with
    ``0 <= i - j <= sliding_window_size`` when ``causal``, else ``|i - j| <=
    sliding_window_size``; with ``document_start`` (``[b, n]`` int32, causal only: the
    first token of each query's document) only the keys ``j >= document_start[i]``.

    ``sel_scale`` is differentiable. Each score evaluates ``sel`` slot
    comparisons in the mask_mod and, with ``sel_scale``, as many in the score_mod.
    ``tile_size`` is the (query, key) tile of the BlockMasks; see the module docstring
    for the constraints on CUDA. On CUDA flex_attention is compiled on first use; on CPU
    it runs eagerly, forward only (FlexAttention refuses CPU inputs that require grad).
    """
    b, hq, n, _ = rq.shape
    hk, hs = rk.shape[1], selected_block_indices.shape[1]
    if hq % hk:
        raise ValueError(f"query heads ({hq}) must be a multiple of kv heads ({hk})")
    if hs not in (hk, hq):
        raise ValueError(f"selection heads ({hs}) must equal the kv heads ({hk}) or the query heads ({hq})")
    if selected_block_indices.shape[:3] != (b, hs, n) or fmask.shape != selected_block_indices.shape:
        raise ValueError(
            f"selected_block_indices {tuple(selected_block_indices.shape)} and fmask {tuple(fmask.shape)} "
            f"must both be [b, hs, n, sel] = [{b}, {hs}, {n}, sel]"
        )
    if sel_scale is not None and sel_scale.shape != fmask.shape:
        raise ValueError(f"sel_scale {tuple(sel_scale.shape)} must match fmask {tuple(fmask.shape)}")
    if block_size < 1 or sliding_window_size < 0:
        raise ValueError(f"need block_size >= 1 and sliding_window_size >= 0, got {block_size} and {sliding_window_size}")

    # -1 never equals a block number, so masked slots drop out of every comparison.
    slot_blocks = torch.where(fmask.bool(), selected_block_indices, -1).to(torch.int32).contiguous()
    selected_mask = _selected_block_mask(slot_blocks, hq, n, block_size, causal, tile_size)
    score_mod = None
    if sel_scale is not None:
        scale_dtype = torch.float64 if rq.dtype == torch.float64 else torch.float32
        score_mod = _selected_score_mod(slot_blocks, sel_scale, hq, block_size, causal, scale_dtype)
    selected_out = _attend(rq, rk, v, score_mod=score_mod, block_mask=selected_mask,
                           kernel_options=_SCORE_MOD_KERNEL_OPTIONS if score_mod is not None else None)

    sliding_mask = _sliding_block_mask(n, sliding_window_size, causal, tile_size, rq.device, document_start)
    sliding_out = _attend(rq, rk, v, block_mask=sliding_mask)
    return selected_out, sliding_out


def _document_block_mask(document_start: torch.Tensor, tile_size: tuple[int, int]) -> BlockMask:
    """Causal attention within documents as a BlockMask ``[b, 1, n, n]``: query ``i`` sees
    the keys ``document_start[i] <= j <= i``. document_start: [b, n] (int32), non-decreasing
    along n, so a tile's rows see from their first row's start on, at least."""
    b, n = document_start.shape
    q_tile, kv_tile = tile_size
    device = document_start.device

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (kv_idx >= document_start[b, q_idx])

    q_start = torch.arange(0, n, q_tile, device=device)
    q_end = (q_start + q_tile).clamp(max=n) - 1
    kv_start = torch.arange(0, n, kv_tile, device=device)
    kv_end = (kv_start + kv_tile).clamp(max=n) - 1
    lowest_start = document_start[:, q_start, None]
    highest_start = document_start[:, q_end, None]
    touched = (kv_start[None, None, :] <= q_end[None, :, None]) & (kv_end[None, None, :] >= lowest_start)
    full = (kv_end[None, None, :] <= q_start[None, :, None]) & (kv_start[None, None, :] >= highest_start)
    return _tiles_to_block_mask((touched & ~full)[:, None], full[:, None], tile_size, n, mask_mod)


def flex_document_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, document_start: torch.Tensor,
                                   tile_size: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """Causal attention within packed documents: q: [b, hq, n, d], k, v: [b, hk, n, d],
    document_start: [b, n] int32 (``documents.document_bounds``) -> [b, hq, n, d]. Tiles
    before a query tile's documents are skipped, so packed short documents cost what they
    would alone."""
    return _attend(q, k, v, block_mask=_document_block_mask(document_start, tile_size))
