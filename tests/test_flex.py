"""The FlexAttention backend's BlockMasks, built at tile granularity: every (query, key)
pair its mask_mod admits lies in a listed tile, and every tile listed as full is admitted
whole. Also the forwards on CPU, where flex_attention runs eagerly (no gradients)."""

import pytest
import torch

from native_sparse_attention.documents import document_bounds
from native_sparse_attention.flex import (
    _document_block_mask,
    _selected_block_mask,
    _sliding_block_mask,
    flex_document_causal_attention,
    flex_selected_and_sliding,
)
from native_sparse_attention.reference import selected_attend, sliding_window_attend

TILE = (16, 8)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _tiles(indices_count, indices, b, h, tiles_q):
    """[b, h, tiles_q, tiles_k + 1] bool of the listed tiles (the last column: none)."""
    listed = torch.zeros(b, h, tiles_q, indices.shape[-1] + 1, dtype=torch.bool)
    for bi, hi, qi in torch.cartesian_prod(torch.arange(b), torch.arange(h), torch.arange(tiles_q)).tolist():
        count = indices_count[bi % indices_count.shape[0], hi % indices_count.shape[1], qi]
        listed[bi, hi, qi, indices[bi % indices.shape[0], hi % indices.shape[1], qi, :count]] = True
    return listed


def check_tiles(block_mask, b: int, h: int, n: int, tile=TILE):
    """Asserts the tile lists of ``block_mask`` against its mask_mod evaluated densely."""
    q_idx, kv_idx = torch.arange(n)[:, None], torch.arange(n)[None, :]
    admitted = torch.stack([torch.stack([block_mask.mask_mod(torch.tensor(bi), torch.tensor(hi), q_idx, kv_idx)
                                         for hi in range(h)]) for bi in range(b)])
    tiles_q = -(-n // tile[0])
    partial = _tiles(block_mask.kv_num_blocks, block_mask.kv_indices, b, h, tiles_q)
    full = torch.zeros_like(partial)
    if block_mask.full_kv_num_blocks is not None:
        full = _tiles(block_mask.full_kv_num_blocks, block_mask.full_kv_indices, b, h, tiles_q)
    assert not (partial & full).any()
    pair_tile = (q_idx // tile[0], kv_idx // tile[1])
    listed = (partial | full)[:, :, pair_tile[0], pair_tile[1]]
    assert not (admitted & ~listed).any(), "an admitted pair outside every listed tile"
    in_full = full[:, :, pair_tile[0], pair_tile[1]]
    assert admitted[in_full].all(), "a full tile with a pair the mask_mod rejects"
    return admitted, partial, full


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window", [0, 9, 40])  # 9: a tile admits only its corner pair
def test_sliding_tiles(causal, window):
    n = 61
    admitted, _, full = check_tiles(_sliding_block_mask(n, window, causal, TILE, torch.device("cpu")), 1, 1, n)
    distance = torch.arange(n)[:, None] - torch.arange(n)[None, :]
    expected = (distance >= 0) & (distance <= window) if causal else distance.abs() <= window
    assert torch.equal(admitted[0, 0], expected)
    # A tile spans distances over TILE[0] + TILE[1] - 2: wider windows hold whole tiles.
    assert full.any() == (window >= TILE[0] + TILE[1] - 2)


def test_sliding_tiles_with_documents():
    n = 64
    ids = torch.tensor([[0] * 16 + [1] * 40 + [2] * 8, [0] * 48 + [1] * 16])
    start, _ = document_bounds(ids)
    admitted, partial, full = check_tiles(_sliding_block_mask(n, 20, True, TILE, torch.device("cpu"), start), 2, 1, n)
    distance = torch.arange(n)[:, None] - torch.arange(n)[None, :]
    expected = (distance >= 0) & (distance <= 20) & (torch.arange(n)[None, None, :] >= start[:, :, None])
    assert torch.equal(admitted[:, 0], expected)
    assert not full.any()


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("hs", [1, 2])
def test_selected_tiles(causal, hs):
    b, hq, n, block, sel = 2, 2, 50, 8, 3
    blocks = torch.randint(0, -(-n // block), (b, hs, n, sel))
    slot_blocks = torch.where(torch.rand(b, hs, n, sel) < 0.7, blocks, -1).int()
    check_tiles(_selected_block_mask(slot_blocks, hq, n, block, causal, TILE), b, hq, n)


def test_document_causal_tiles():
    n = 70
    ids = torch.tensor([[0] * 10 + [1] * 37 + [2] * 23, [5] * 70])
    start, _ = document_bounds(ids)
    admitted, _, full = check_tiles(_document_block_mask(start, TILE), 2, 1, n)
    positions = torch.arange(n)
    expected = (positions[None, :] <= positions[:, None]) & (positions[None, None, :] >= start[:, :, None])
    assert torch.equal(admitted[:, 0], expected)
    assert full[1].any()


def test_document_causal_attention_forward():
    b, hq, hk, n, d = 2, 4, 2, 40, 8
    ids = torch.tensor([[0] * 9 + [1] * 31, [0] * 25 + [1] * 15])
    start, _ = document_bounds(ids)
    q, k, v = (torch.randn(b, h, n, d) for h in (hq, hk, hk))
    out = flex_document_causal_attention(q, k, v, start, tile_size=TILE)
    positions = torch.arange(n)
    visible = (positions[None, :] <= positions[:, None]) & (positions[None, None, :] >= start[:, :, None])
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=visible[:, None], enable_gqa=True)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_selected_and_sliding_forward_with_documents():
    b, hq, hk, n, d, block, sel, window = 1, 4, 2, 48, 8, 16, 2, 10
    ids = torch.tensor([[0] * 16 + [1] * 32])
    start, _ = document_bounds(ids)
    q, k, v = (torch.randn(b, h, n, d) for h in (hq, hk, hk))
    # Each query's slots: distinct blocks before its own, inside its document.
    own = torch.arange(n) // block
    first = start[0].long() // block
    indices = torch.stack([first, first + 1], -1).expand(b, hk, n, sel).clone()
    fmask = indices < own[None, None, :, None]
    selected, sliding = flex_selected_and_sliding(q, k, v, block, indices, fmask, window, document_start=start,
                                                  tile_size=TILE)
    expected_selected, _ = selected_attend(q, k, v, block, indices, fmask)
    expected_sliding, _ = sliding_window_attend(q, k, v, window, document_start=start)
    torch.testing.assert_close(selected, expected_selected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sliding, expected_sliding, rtol=1e-5, atol=1e-5)


def test_compiled_flex_attention_stays_compiled_past_dynamos_recompile_limit():
    """Each sequence length compiles its own graph; past Dynamo's recompile limit a call
    would run the unfused flex_attention, which materialises the [n, n] scores. Here the
    global limit is 1 and three lengths must still compile flex_attention three times
    (CPU inference: the compiled CPU backend has no backward)."""
    from torch._dynamo.utils import counters
    from torch.nn.attention.flex_attention import create_block_mask

    from native_sparse_attention import flex

    # Not monkeypatch: its undo deletes the setting, which hides it from Dynamo for the
    # rest of the session (torch 2.10).
    with torch._dynamo.config.patch(recompile_limit=1):
        attend = flex._compiled_flex_attention()
        compiled_frames = counters["frames"]["ok"]
        for n in (32, 48, 64):
            q, k, v = torch.randn(1, 4, n, 16), torch.randn(1, 2, n, 16), torch.randn(1, 2, n, 16)
            block_mask = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, 1, 1, n, n, device="cpu",
                                           BLOCK_SIZE=16)
            with torch.no_grad():
                out = attend(q, k, v, block_mask=block_mask, enable_gqa=True)
            expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        assert counters["frames"]["ok"] - compiled_frames == 3
        assert torch._dynamo.config.recompile_limit == 1
