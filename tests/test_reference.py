"""The reference branches and the block selection against brute-force loops over queries."""

import math

import pytest
import torch

from native_sparse_attention.reference import compressed_attend, selected_attend, sliding_window_attend
from native_sparse_attention.selection import (
    block_overlap,
    num_compressed_blocks,
    select_blocks,
    selectable_blocks,
    selection_block_scores,
)


def _brute_attend(q_row, keys, values, logit_scales, scale):
    """q_row: [d]; keys, values: [L, d]; logit_scales: [L] -> (out [d], lse)."""
    if len(keys) == 0:
        return torch.zeros_like(q_row), float("-inf")
    logits = (keys @ q_row) * scale * logit_scales
    lse = torch.logsumexp(logits, 0)
    return torch.softmax(logits, 0) @ values, lse.item()


def _rand(*shape):
    return torch.randn(*shape, dtype=torch.float64)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("m, q_offset", [(11, 0), (11, 5), (1, 20)])  # (1, 20): a decoding step
def test_sliding_window_matches_brute_force(causal, m, q_offset):
    b, hq, hk, d, window = 2, 6, 3, 8, 3
    n = m + q_offset
    q, k, v = _rand(b, hq, m, d), _rand(b, hk, n, d), _rand(b, hk, n, d)
    out, lse = sliding_window_attend(q, k, v, window, causal=causal, q_offset=q_offset)
    for bi in range(b):
        for h in range(hq):
            g = h // (hq // hk)
            for r in range(m):
                i = r + q_offset
                keys = [j for j in range(n) if (0 <= i - j <= window if causal else abs(i - j) <= window)]
                o, l = _brute_attend(q[bi, h, r], k[bi, g, keys], v[bi, g, keys], torch.ones(len(keys)), d**-0.5)
                torch.testing.assert_close(out[bi, h, r], o)
                assert math.isclose(lse[bi, h, r].item(), l, rel_tol=1e-9)


@pytest.mark.parametrize("include_block_causal", [True, False])
@pytest.mark.parametrize("shared", [True, False])
def test_selected_attend_matches_brute_force(include_block_causal, shared):
    b, hq, hk, n, d, bs, sel = 1, 4, 2, 21, 8, 4, 3
    hs = hk if shared else hq
    q, k, v = _rand(b, hq, n, d), _rand(b, hk, n, d), _rand(b, hk, n, d)
    num_blocks = math.ceil(n / bs)
    indices = torch.randint(0, num_blocks, (b, hs, n, sel))
    indices[..., 1] = indices[..., 0]  # duplicates count twice
    fmask = torch.rand(b, hs, n, sel) > 0.3
    fmask[:, :, 3] = False  # a row whose slots are all masked
    sel_scale = torch.rand(b, hs, n, sel, dtype=torch.float64) + 0.5
    out, lse = selected_attend(q, k, v, bs, indices, fmask, sel_scale, include_block_causal=include_block_causal)
    for h in range(hq):
        g = h // (hq // hk)
        hsel = g if shared else h
        for i in range(n):
            keys, scales = [], []
            if include_block_causal:
                own = range(i // bs * bs, i // bs * bs + bs)
                keys += list(own)
                scales += [1.0] * bs
            for s in range(sel):
                if fmask[0, hsel, i, s]:
                    block = indices[0, hsel, i, s].item()
                    keys += list(range(block * bs, block * bs + bs))
                    scales += [sel_scale[0, hsel, i, s].item()] * bs
            kept = [(j, sc) for j, sc in zip(keys, scales) if j < n and (not include_block_causal or j <= i)]
            key_ids = [j for j, _ in kept]
            o, l = _brute_attend(
                q[0, h, i], k[0, g, key_ids], v[0, g, key_ids],
                torch.tensor([sc for _, sc in kept], dtype=torch.float64), d**-0.5,
            )
            torch.testing.assert_close(out[0, h, i], o)
            if l == float("-inf"):
                assert lse[0, h, i] == float("-inf")
            else:
                assert math.isclose(lse[0, h, i].item(), l, rel_tol=1e-9)


def test_selected_attend_empty_rows_have_finite_gradients():
    q, k, v = (_rand(1, 2, 9, 4).requires_grad_() for _ in range(3))
    indices = torch.zeros(1, 2, 9, 2, dtype=torch.long)
    fmask = torch.zeros(1, 2, 9, 2, dtype=torch.bool)
    out, lse = selected_attend(q, k, v, 4, indices, fmask, include_block_causal=False)
    assert (out == 0).all() and (lse == float("-inf")).all()
    out.sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()


@pytest.mark.parametrize("causal", [True, False])
def test_compressed_attend_matches_brute_force(causal):
    b, hq, hk, m, d, cbs, stride, num_mem = 1, 4, 2, 23, 8, 4, 2, 2
    nc = num_compressed_blocks(m, cbs, stride)
    q, ck, cv = _rand(b, hq, m, d), _rand(b, hk, num_mem + nc, d), _rand(b, hk, num_mem + nc, d)
    out, lse, probs = compressed_attend(q, ck, cv, cbs, stride, num_mem, causal=causal, return_probs=True)
    for h in range(hq):
        g = h // (hq // hk)
        for i in range(m):
            keys = list(range(num_mem)) + [
                num_mem + c for c in range(nc) if not causal or c * stride + cbs - 1 < i
            ]
            o, l = _brute_attend(q[0, h, i], ck[0, g, keys], cv[0, g, keys], torch.ones(len(keys)), d**-0.5)
            torch.testing.assert_close(out[0, h, i], o)
            assert math.isclose(lse[0, h, i].item(), l, rel_tol=1e-9)
    torch.testing.assert_close(probs.sum(-1), torch.ones_like(lse))


@pytest.mark.parametrize("cbs, stride, sbs", [(24, 8, 16), (20, 8, 16), (12, 4, 8), (40, 8, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_blocks_that_the_same_visible_compressed_blocks_overlap_score_the_same_bits(cbs, stride, sbs, dtype):
    """Windows longer than a selection block make exact ties (``select_blocks`` gives them
    to the later block): their scores must be equal bit for bit in every row of any
    length, or a token's choice depends on how many tokens share its forward. (Summed over
    the heads by ``torch.sum``, whose vectorised and remaining elements add in different
    orders, two such blocks of row 37 at n = 42 differed in their last bit.)"""
    hq, hk = 10, 2
    for n in (42, 45, 130, 257):
        nc = num_compressed_blocks(n, cbs, stride)
        num_blocks = math.ceil(n / sbs)
        last = torch.arange(nc) * stride + cbs - 1
        visible = last[None, :] < torch.arange(n)[:, None]
        # As the layer passes them: a view past the memory keys' column.
        with_memory = torch.rand(2, hq, n, 1 + nc, dtype=dtype)
        with_memory[..., 1:].masked_fill_(~visible, 0.0)
        probs = with_memory[..., 1:]
        scores = selection_block_scores(probs, cbs, stride, sbs, num_blocks, kv_heads=hk)
        overlap = block_overlap(nc, cbs, stride, sbs, num_blocks, dtype=torch.bool)
        ties = 0
        for i in range(n):
            sets = [tuple((overlap[:, j] & visible[i]).nonzero().flatten().tolist()) for j in range(num_blocks)]
            for j in range(1, num_blocks):
                if sets[j] and sets[j] == sets[j - 1]:
                    ties += 1
                    assert torch.equal(scores[:, :, i, j], scores[:, :, i, j - 1]), (n, i, j)
        assert ties


@pytest.mark.parametrize("cbs, stride, sbs", [(4, 2, 4), (4, 4, 8), (6, 2, 4), (8, 4, 4)])
@pytest.mark.parametrize("shared", [True, False])
def test_selection_follows_the_paper_definition(cbs, stride, sbs, shared):
    hq, hk, n, num_selected = 4, 2, 37, 3
    nc = num_compressed_blocks(n, cbs, stride)
    num_blocks = math.ceil(n / sbs)
    probs = torch.rand(1, hq, n, nc, dtype=torch.float64)
    scores = selection_block_scores(probs, cbs, stride, sbs, num_blocks, kv_heads=hk if shared else None)
    selectable = selectable_blocks(n, 0, nc, cbs, stride, sbs, num_blocks, causal=True)
    chosen = select_blocks(scores, selectable, num_selected)

    heads_of = (lambda hs: range(hs * (hq // hk), (hs + 1) * (hq // hk))) if shared else (lambda hs: [hs])
    for hs in range(scores.shape[1]):
        for i in range(n):
            expected_scores, candidates = {}, []
            for j in range(num_blocks):
                overlapping = [c for c in range(nc) if c * stride < (j + 1) * sbs and j * sbs < c * stride + cbs]
                expected_scores[j] = sum(probs[0, h, i, c].item() for h in heads_of(hs) for c in overlapping)
                visible = [c for c in overlapping if c * stride + cbs - 1 < i]
                if visible and j != i // sbs:
                    candidates.append(j)
                assert math.isclose(scores[0, hs, i, j].item(), expected_scores[j], rel_tol=1e-9, abs_tol=1e-12)
            best = sorted(candidates, key=lambda j: -expected_scores[j])[:num_selected]
            got = chosen.indices[0, hs, i][chosen.mask[0, hs, i]].tolist()
            assert sorted(got) == sorted(best)
            assert chosen.mask[0, hs, i].sum() == min(num_selected, len(candidates))


def test_equal_scores_go_to_the_later_block_however_many_follow():
    """Blocks that the same visible compressed keys overlap score exactly alike. The later
    one wins, as in the kernels, whatever the width of the row: torch.topk alone broke such
    ties by the row's width, so that a prefix could select otherwise than the whole."""
    for width in range(3, 10):
        scores = torch.zeros(1, 1, 1, width)
        scores[..., :3] = torch.tensor([0.7, 0.7, 0.2])
        selectable = torch.arange(width) < 3
        chosen = select_blocks(scores, selectable, 2)
        assert chosen.indices.flatten().tolist() == [1, 0], width
        assert chosen.scores.flatten().tolist() == pytest.approx([0.7, 0.7])


def test_non_causal_selection_allows_every_covered_block():
    n, cbs, stride, sbs = 20, 4, 4, 4
    nc = num_compressed_blocks(n, cbs, stride)
    selectable = selectable_blocks(n, 0, nc, cbs, stride, sbs, 5, causal=False)
    assert selectable.all()
    # The tail of an n that no window covers is never selectable.
    selectable = selectable_blocks(22, 0, num_compressed_blocks(22, cbs, stride), cbs, stride, sbs, 6, causal=False)
    assert selectable[:, :5].all() and not selectable[:, 5].any()


def test_autocast_leaves_the_reference_in_float32():
    """Under autocast the branches and the block scores compute as without it: float32
    matmuls, not bfloat16 ones beside float32 softmaxes (under CPU autocast the mixed
    dtypes made ``selected_attend``'s scatter_add fail; CUDA's promotes them)."""
    b, hq, hk, n, d, cbs, stride, sbs = 2, 4, 2, 29, 8, 4, 2, 4
    q, k, v = (torch.randn(b, h, n, d) for h in (hq, hk, hk))
    ck, cv = (torch.randn(b, hk, 1 + num_compressed_blocks(n, cbs, stride), d) for _ in range(2))
    probs = torch.rand(b, hq, n, ck.shape[2] - 1)
    num_blocks = math.ceil(n / sbs)
    indices = torch.randint(0, num_blocks, (b, hk, n, 3))

    def branches():
        return (
            *sliding_window_attend(q, k, v, 5),
            *compressed_attend(q, ck, cv, cbs, stride, num_mem=1),
            *selected_attend(q, k, v, sbs, indices, torch.ones_like(indices, dtype=torch.bool)),
            selection_block_scores(probs, cbs, stride, sbs, num_blocks, kv_heads=hk),
        )

    expected = branches()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        found = branches()
    for got, want in zip(found, expected, strict=True):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, atol=0, rtol=0)
