"""Compressed-branch Triton kernels and the fused block selection against the reference.

Without CUDA the kernels run under the Triton interpreter (``TRITON_INTERPRET=1``, set
in conftest.py before triton is imported, unless the environment already chose) on small float32 /
float16 problems; with CUDA the same tests run compiled, plus the ``gpu`` ones at
n >= 8192 in bf16. Every buffer the kernels write starts poisoned, so an element a
kernel forgets to write shows up as NaN / a bogus index.
"""


import pytest
import torch

from native_sparse_attention.documents import document_bounds  # noqa: E402
from native_sparse_attention.kernels import compressed  # noqa: E402
from native_sparse_attention.kernels.compressed import compressed_attend_and_select  # noqa: E402
from native_sparse_attention.reference import compressed_attend  # noqa: E402
from native_sparse_attention.selection import (  # noqa: E402
    num_compressed_blocks,
    num_selection_blocks,
    selectable_blocks,
    select_blocks,
    selection_block_scores,
)

from kernel_device import DEVICE, gpu, skip_without_kernels

skip_without_kernels()


@pytest.fixture(autouse=True)
def poisoned_buffers(monkeypatch):
    def allocate(shape, dtype, device):
        t = torch.empty(shape, dtype=dtype, device=device)
        if dtype.is_floating_point:
            return t.fill_(float("nan"))
        # A large positive int also outranks every real key of a partial top-n.
        return t.fill_(True) if dtype == torch.bool else t.fill_(torch.iinfo(dtype).max // 3)

    monkeypatch.setattr(compressed, "_allocate", allocate)


def make_inputs(b, hq, hk, n, d, cbs, stride, num_mem, dtype, seed, heads_last=False):
    """Fresh random q [b, hq, n, d], ck, cv [b, hk, num_mem + nc, d] on DEVICE.

    ``heads_last`` builds them as transposed [b, len, h, d] views (non-contiguous)."""
    gen = torch.Generator().manual_seed(seed)
    num_keys = num_mem + num_compressed_blocks(n, cbs, stride)

    def rand(h, length, scale=1.0):
        shape = (b, length, h, d) if heads_last else (b, h, length, d)
        t = (torch.randn(shape, generator=gen) * scale).to(DEVICE, dtype)
        return t.transpose(1, 2) if heads_last else t

    # A larger query scale gives peaked attention, so block importances are well separated.
    return rand(hq, n, 2.0), rand(hk, num_keys), rand(hk, num_keys)


def reference(q, ck, cv, dout, cbs, stride, num_mem, sbs, causal, share, chosen=None,
              document_start=None):
    """float64 out, lse, gradients, and the full importance matrix with its candidates.

    ``chosen = (indices, mask, dscores)`` adds ``sum(dscores * score of each chosen block)``
    to the loss, so the gradients include the path through the selection scores."""
    q64, ck64, cv64 = (t.detach().double().requires_grad_() for t in (q, ck, cv))
    out, lse, probs = compressed_attend(q64, ck64, cv64, cbs, stride, num_mem, causal=causal,
                                        return_probs=True, document_start=document_start)
    n, hk = q.shape[2], ck.shape[1]
    nc, nsel = ck.shape[2] - num_mem, num_selection_blocks(n, sbs)
    scores = selection_block_scores(probs[..., num_mem:], cbs, stride, sbs, nsel,
                                    kv_heads=hk if share else None)
    loss = (out * dout.double()).sum()
    if chosen is not None:
        indices, mask, dscores = (t.to(q.device) for t in chosen)
        chosen_scores = scores.gather(-1, indices).masked_fill(~mask, 0.0)
        loss = loss + (chosen_scores * dscores.double()).sum()
    loss.backward()
    selectable = selectable_blocks(n, 0, nc, cbs, stride, sbs, nsel, causal, q.device, document_start)
    return out, lse, (q64.grad, ck64.grad, cv64.grad), scores.detach(), selectable


def assert_selection_matches(selection, scores, selectable, num_selected, tie_tol, score_tol):
    """The kernel's top-n equals select_blocks' except where candidate scores tie within
    ``tie_tol``; reported scores match the reference's to ``score_tol``."""
    indices, mask, kernel_scores = (t.cpu() for t in selection)
    scores = scores.double().cpu().masked_fill(~selectable.cpu(), float("-inf"))
    expected = select_blocks(scores, selectable.cpu(), num_selected)
    ranked = scores.sort(dim=-1, descending=True).values
    assert torch.equal(mask, expected.mask)
    assert (indices[~mask] == 0).all() and (kernel_scores[~mask] == 0).all()

    # Any valid set of distinct candidates whose sorted scores match the reference top-n.
    chosen = scores.gather(-1, indices).masked_fill(~mask, float("-inf"))
    assert torch.isfinite(chosen[mask]).all(), "a chosen block is not a candidate"
    ordered = indices.masked_fill(~mask, -1).sort(dim=-1).values
    assert not ((ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] >= 0)).any()
    top = min(num_selected, scores.shape[-1])
    gap = (chosen[..., :top] - ranked[..., :top]).nan_to_num(0.0, posinf=0.0, neginf=0.0)
    assert gap.abs().max() <= tie_tol

    # Slots whose reference score is isolated from its neighbours by more than the
    # tolerance must hold exactly the reference's block.
    padded = torch.nn.functional.pad(ranked, (1, 1), value=float("-inf"))
    padded[..., 0] = float("inf")
    isolated = ((padded[..., :-2] - padded[..., 1:-1] > tie_tol)
                & (padded[..., 1:-1] - padded[..., 2:] > tie_tol))[..., :top]
    isolated = torch.nn.functional.pad(isolated, (0, num_selected - top), value=False) & mask
    assert torch.equal(indices[isolated], expected.indices[isolated])
    torch.testing.assert_close(kernel_scores[mask].double(), chosen[mask], atol=score_tol,
                               rtol=score_tol)


def tolerances(dtype):
    """(output / gradient tolerance, selection tie tolerance, selection score tolerance)."""
    if dtype == torch.float32:
        # float32 products on the GPU too, not TF32. A score sums thousands of
        # probabilities at n = 8192: 3e-6 from float64 at worst on an H100.
        return 2e-5, 1e-6, 1e-5
    return 2e-2, 2e-3, 2e-3


def assert_close_scaled(actual, expected, tol):
    """Elementwise closeness relative to the tensor's own magnitude."""
    assert actual.shape == expected.shape
    if expected.numel() == 0:
        return
    scale = expected.abs().max().clamp_min(1e-6).item()
    torch.testing.assert_close(actual.double(), expected, atol=tol * scale, rtol=tol)


def packed_bounds(lengths_per_row):
    """(document_start, document_end) on DEVICE of rows packing documents of the given
    lengths, each row's lengths summing to n."""
    ids = torch.stack([torch.cat([torch.full((length,), number) for number, length in enumerate(lengths)])
                       for lengths in lengths_per_row])
    return tuple(t.to(DEVICE) for t in document_bounds(ids))


def check_against_reference(b, hq, hk, n, d, cbs, stride, num_mem, sbs, top, causal, share,
                            dtype=torch.float32, seed=0, heads_last=False, score_grad=False,
                            documents=None):
    """Forward, LSE, selection and gradients against the float64 reference; with
    ``score_grad`` the loss also weighs the chosen blocks' scores (differentiable top-n).
    ``documents``: the document lengths of each row, packed (``packed_bounds``)."""
    q, ck, cv = make_inputs(b, hq, hk, n, d, cbs, stride, num_mem, dtype, seed, heads_last)
    q.requires_grad_(), ck.requires_grad_(), cv.requires_grad_()
    document_start, document_end = (None, None) if documents is None else packed_bounds(documents)
    out, lse, selection = compressed_attend_and_select(
        q, ck, cv, cbs, stride, num_mem, sbs, top, causal=causal, share_selection=share,
        document_start=document_start, document_end=document_end,
    )
    gen = torch.Generator().manual_seed(seed + 1)
    dout = torch.randn(out.shape, generator=gen).to(DEVICE, dtype)
    loss = (out * dout).sum()
    chosen = None
    if score_grad:
        # Large enough that the score path dominates the gradients.
        dscores = (torch.randn(selection.scores.shape, generator=gen) * 10).to(DEVICE)
        loss = loss + (selection.scores * dscores).sum()
        chosen = (selection.indices, selection.mask, dscores)
    loss.backward()
    ref_out, ref_lse, ref_grads, scores, selectable = reference(
        q, ck, cv, dout, cbs, stride, num_mem, sbs, causal, share, chosen, document_start
    )
    tol, tie_tol, score_tol = tolerances(dtype)

    assert out.shape == q.shape and out.dtype == dtype
    assert lse.shape == q.shape[:3] and lse.dtype == torch.float32
    assert_close_scaled(out, ref_out, tol)
    empty = torch.isinf(ref_lse)
    assert torch.equal(torch.isneginf(lse), empty)
    torch.testing.assert_close(lse[~empty].double(), ref_lse[~empty], atol=tol * 10, rtol=tol)
    for name, grad, ref_grad in zip(("q", "ck", "cv"), (q.grad, ck.grad, cv.grad), ref_grads):
        assert torch.isfinite(grad).all(), name
        assert_close_scaled(grad, ref_grad, tol)
    # A query that sees no key contributes nothing and gets exactly zero gradient.
    assert (q.grad[empty] == 0).all() and (out[empty] == 0).all()
    hs = hk if share else hq
    assert selection.indices.shape == (b, hs, n, top) and selection.indices.dtype == torch.int64
    assert_selection_matches(selection, scores, selectable, top, tie_tol, score_tol)


# b, hq, hk, n, d, cbs, stride, num_mem, sbs, top, causal, share
CASES = {
    "odd_n_no_memory": (1, 2, 1, 67, 32, 8, 4, 0, 16, 3, True, True),
    "group3_d48_per_head": (2, 6, 2, 50, 48, 8, 4, 2, 16, 2, True, False),
    "non_causal": (1, 4, 4, 40, 16, 4, 2, 1, 8, 4, False, True),
    "non_causal_per_head_d96": (1, 2, 1, 29, 96, 6, 3, 0, 8, 3, False, False),
    "shorter_than_block_no_keys": (1, 2, 1, 5, 16, 8, 4, 0, 4, 2, True, True),
    "shorter_than_block_memory_only": (1, 2, 2, 6, 24, 8, 4, 3, 4, 2, True, False),
    "ragged_geometry_group3": (1, 3, 1, 45, 16, 7, 5, 1, 12, 3, True, True),
    "wide_selection_blocks": (1, 2, 1, 70, 16, 4, 2, 0, 32, 2, True, True),
    "group16_more_slots_than_blocks": (1, 16, 1, 33, 16, 8, 8, 0, 8, 8, True, True),
    # The running top-n is narrower, then wider than a chunk's 16 lanes.
    "one_slot_per_head": (1, 2, 1, 40, 16, 4, 4, 1, 4, 1, True, False),
    "more_slots_than_lanes": (1, 2, 1, 100, 16, 4, 2, 0, 4, 20, True, True),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_matches_reference(case):
    check_against_reference(*case)


# b, hq, hk, n, d, cbs, stride, num_mem, sbs, top, causal, share
SCORE_GRAD_CASES = {
    "shared_group4_memory": (1, 4, 1, 53, 16, 8, 4, 2, 16, 3, True, True),
    "per_head_group2": (1, 4, 2, 40, 32, 8, 8, 1, 8, 2, True, False),
    "non_causal_no_memory": (1, 2, 1, 37, 16, 4, 2, 0, 8, 3, False, True),
}


@pytest.mark.parametrize("case", SCORE_GRAD_CASES.values(), ids=SCORE_GRAD_CASES.keys())
def test_score_gradients_match_reference(case):
    check_against_reference(*case, seed=5, score_grad=True)


# b, hq, hk, n, d, cbs, stride, num_mem, sbs, top, share, document lengths of each row
DOCUMENT_CASES = {
    # Windows of two blocks: the 16-token documents hold no whole window, and windows
    # that cross a document's end are seen by nobody.
    "windows_of_two_blocks_group2": (2, 4, 2, 112, 16, 32, 8, 1, 16, 3, True, [[16, 48, 48], [64, 16, 32]]),
    "one_window_per_block_per_head": (2, 4, 2, 96, 32, 16, 8, 2, 16, 2, False, [[48, 16, 32], [96]]),
    # Without memory keys, the queries of a document's first window see no key at all.
    "no_memory_group3": (1, 3, 1, 128, 16, 16, 8, 0, 16, 4, True, [[32, 16, 80]]),
    # Stride 2: 63 compressed keys in four key tiles (16 keys under the interpreter) and
    # chunks of 3 blocks, so documents start inside key tiles and query tiles, and the
    # loops skip, mask and run unmasked tiles.
    "many_key_tiles": (2, 2, 1, 128, 16, 4, 2, 1, 8, 3, True, [[40, 8, 80], [16, 56, 8, 48]]),
    "many_key_tiles_per_head_no_memory": (1, 4, 2, 128, 16, 8, 2, 0, 8, 2, False, [[24, 104]]),
    # A document ending inside a query tile (at 88) that key tiles' unmasked rows precede.
    "document_ends_inside_query_tiles": (1, 2, 1, 128, 16, 4, 2, 1, 8, 3, True, [[88, 40]]),
}


@pytest.mark.parametrize("case", DOCUMENT_CASES.values(), ids=DOCUMENT_CASES.keys())
def test_packed_documents_match_reference(case):
    *geometry, share, documents = case
    check_against_reference(*geometry, True, share, seed=21, documents=documents)


@pytest.mark.parametrize("case", ["windows_of_two_blocks_group2", "many_key_tiles_per_head_no_memory"])
def test_packed_documents_score_gradients_match_reference(case):
    *geometry, share, documents = DOCUMENT_CASES[case]
    check_against_reference(*geometry, True, share, seed=22, score_grad=True, documents=documents)


def test_packed_documents_float16():
    check_against_reference(2, 4, 2, 96, 32, 16, 8, 1, 16, 3, True, True, dtype=torch.float16, seed=23,
                            documents=[[16, 48, 32], [32, 64]])


def test_packed_documents_split_among_programs(monkeypatch):
    """Rows of documents whose selection chunks and dK / dV query tiles several programs
    share (short training sequences on a big GPU), at the interpreter's tiles."""
    shares = []

    def three_shares(programs, parts, *_):
        shares.append(min(parts, 3))
        return shares[-1]

    monkeypatch.setattr(compressed, "_shares", three_shares)
    small = compressed._Launch(block_m=16, block_n=16, num_warps=1, num_stages=1)
    monkeypatch.setattr(compressed, "_launch", lambda kernel, q: small)
    *geometry, share, documents = DOCUMENT_CASES["many_key_tiles"]
    check_against_reference(*geometry, True, share, seed=24, score_grad=True, documents=documents)
    assert len(shares) == 2 and min(shares) > 1


def test_documents_none_changes_nothing_and_one_document_per_row_little():
    """Passing None documents gives the bits of leaving them out; one document per row,
    the same values (the memory keys' gradients are summed in another order). At 128
    tokens the key tile holding the memory key has rows that see all of it, whose unmasked
    steps must leave the memory key's share to the dQ kernel."""
    q, ck, cv = make_inputs(2, 4, 2, 128, 16, 8, 4, 1, torch.float32, seed=25)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(26)).to(DEVICE)
    runs = []
    for documents in ({}, dict(document_start=None, document_end=None),
                      dict(zip(("document_start", "document_end"), packed_bounds([[128], [128]])))):
        inputs = [t.detach().clone().requires_grad_() for t in (q, ck, cv)]
        out, lse, selection = compressed_attend_and_select(*inputs, 8, 4, 1, 16, 3, **documents)
        (out * dout).sum().backward()
        runs.append((out, lse, *selection, *(t.grad for t in inputs)))
    for expected, actual in zip(runs[0], runs[1]):
        assert torch.equal(expected, actual)
    # The memory keys' dK / dV sum 512 rows' shares: on an H200 2.7e-6 (relative) apart in the two orders.
    for expected, actual in zip(runs[0], runs[2]):
        torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


def test_packed_documents_cpu_fallback_matches_kernels(monkeypatch):
    q, ck, cv = make_inputs(2, 4, 2, 64, 16, 16, 8, 1, torch.float32, seed=27)
    documents = dict(zip(("document_start", "document_end"), packed_bounds([[16, 48], [32, 32]])))
    args = (q, ck, cv, 16, 8, 1, 16, 2)
    out, lse, selection = compressed_attend_and_select(*args, share_selection=False, **documents)
    monkeypatch.setattr(compressed, "_use_kernels", lambda device: False)
    ref_out, ref_lse, ref_selection = compressed_attend_and_select(*args, share_selection=False, **documents)
    tol = tolerances(torch.float32)[0]
    torch.testing.assert_close(out, ref_out, atol=tol, rtol=tol)
    torch.testing.assert_close(lse, ref_lse, atol=tol, rtol=tol)
    assert torch.equal(selection.mask, ref_selection.mask)
    assert torch.equal(selection.indices, ref_selection.indices)


@pytest.mark.parametrize("change, message", [
    (dict(document_end=None), "both or neither"),
    (dict(q_offset=16), "q_offset"),
    (dict(causal=False), "causal"),
    (dict(document_start=torch.zeros(1, 31, dtype=torch.int32)), r"document_start must be \[b=1, n=32\]"),
    (dict(document_end=torch.zeros(1, 32)), "document_end must be an integer tensor"),
])
def test_invalid_documents_name_the_problem(change, message):
    kwargs = dict(q=torch.zeros(1, 2, 32, 16), ck=torch.zeros(1, 1, 7, 16), cv=torch.zeros(1, 1, 7, 16),
                  compress_block_size=8, compress_stride=4, num_mem=0, selection_block_size=8,
                  num_selected=2, document_start=torch.zeros(1, 32, dtype=torch.int32),
                  document_end=torch.full((1, 32), 32, dtype=torch.int32))
    kwargs.update(change)
    with torch.no_grad(), pytest.raises(ValueError, match=message):
        compressed_attend_and_select(**kwargs)


def check_continuation(b, hq, hk, n, d, cbs, stride, num_mem, sbs, top, causal, share, offset,
                       dtype=torch.float32, seed=0, position_on_device=False):
    """The last ``n - offset`` queries against every compressed key of the n tokens, with
    ``q_offset=offset`` (a decoding step or a chunk that continues a cache), against the
    reference at the same positions. ``position_on_device``: through
    ``compressed_attend_and_select_at`` (causal only; no LSE to check)."""
    q, ck, cv = make_inputs(b, hq, hk, n, d, cbs, stride, num_mem, dtype, seed)
    q = q[:, :, offset:]
    with torch.no_grad():
        if position_on_device:
            assert causal
            out, selection = compressed.compressed_attend_and_select_at(
                q, ck, cv, torch.full((b,), offset, device=DEVICE), cbs, stride, num_mem, sbs, top,
                share_selection=share,
            )
            lse = None
        else:
            out, lse, selection = compressed_attend_and_select(
                q, ck, cv, cbs, stride, num_mem, sbs, top, causal=causal, share_selection=share,
                q_offset=offset,
            )
    ref_out, ref_lse, probs = compressed_attend(q.double(), ck.double(), cv.double(), cbs, stride,
                                                num_mem, causal=causal, q_offset=offset,
                                                return_probs=True)
    nc, nsel = ck.shape[2] - num_mem, num_selection_blocks(n, sbs)
    scores = selection_block_scores(probs[..., num_mem:], cbs, stride, sbs, nsel,
                                    kv_heads=hk if share else None)
    selectable = selectable_blocks(n - offset, offset, nc, cbs, stride, sbs, nsel, causal, q.device)
    tol, tie_tol, score_tol = tolerances(dtype)
    assert_close_scaled(out, ref_out, tol)
    if lse is not None:
        empty = torch.isinf(ref_lse)
        assert torch.equal(torch.isneginf(lse), empty)
        torch.testing.assert_close(lse[~empty].double(), ref_lse[~empty], atol=tol * 10, rtol=tol)
    assert selection.indices.shape == (b, hk if share else hq, n - offset, top)
    assert_selection_matches(selection, scores, selectable, top, tie_tol, score_tol)


# b, hq, hk, n, d, cbs, stride, num_mem, sbs, top, causal, share, offset
CONTINUATION_CASES = {
    "decode_step": (1, 4, 2, 97, 16, 8, 4, 1, 16, 3, True, True, 96),
    "decode_step_per_head_no_memory": (2, 2, 1, 64, 32, 8, 4, 0, 8, 4, True, False, 63),
    "decode_step_first_block": (1, 2, 1, 9, 16, 8, 4, 1, 4, 2, True, True, 8),
    "chunk_across_blocks": (1, 4, 1, 75, 16, 8, 4, 2, 16, 2, True, True, 51),
    "non_causal_chunk": (1, 2, 2, 40, 16, 4, 2, 1, 8, 3, False, True, 17),
    "decode_step_top_one": (2, 1, 1, 70, 16, 8, 4, 1, 16, 1, True, False, 69),
    # A one-query selection scores its group's heads as the rows of one tile, here 3 of 16.
    "decode_step_group_of_three": (2, 6, 2, 83, 16, 8, 4, 1, 16, 3, True, True, 82),
    "decode_step_group_of_32": (1, 32, 1, 70, 16, 8, 4, 1, 16, 2, True, True, 69),  # a tile of 32 rows
    # More chunks of blocks than the top-n's tile has rows: its rows take turns.
    "decode_step_many_chunks": (1, 4, 2, 600, 16, 4, 2, 1, 4, 3, True, True, 599),
    "non_causal_one_query": (1, 4, 2, 40, 16, 4, 2, 1, 8, 3, False, True, 39),
}


@pytest.mark.parametrize("case", CONTINUATION_CASES.values(), ids=CONTINUATION_CASES.keys())
def test_queries_continuing_a_sequence_match_reference(case):
    check_continuation(*case)


@pytest.mark.parametrize("share", [True, False])
def test_position_read_on_the_device_matches_q_offset(share):
    """The entry point of CUDA-graph decoding: each batch row's position comes from a
    device tensor (the rows of a batch may decode at different positions), and ck, cv hold
    spare rows past the compressed keys (finite garbage), which the causal mask must
    hide."""
    b, hq, hk, n, d, cbs, stride, num_mem, sbs, top = 3, 4, 2, 90, 16, 8, 4, 1, 16, 3
    q, ck, cv = make_inputs(b, hq, hk, n, d, cbs, stride, num_mem, torch.float32, seed=9)
    spare = torch.randn(b, hk, 7, d, generator=torch.Generator().manual_seed(10)).to(DEVICE)
    for offsets in ((n - 1, n - 1, n - 1), (n - 3, 40, n - 1)):
        queries = torch.stack([q[row, :, offset] for row, offset in enumerate(offsets)])[:, :, None]
        out, selection = compressed.compressed_attend_and_select_at(
            queries, torch.cat((ck, spare), 2), torch.cat((cv, spare), 2),
            torch.tensor(offsets, device=DEVICE), cbs, stride, num_mem, sbs, top, share_selection=share,
        )
        for row, offset in enumerate(offsets):
            rows = slice(row, row + 1)
            expected_out, _, expected = compressed_attend_and_select(
                queries[rows], ck[rows], cv[rows], cbs, stride, num_mem, sbs, top, share_selection=share,
                q_offset=offset,
            )
            torch.testing.assert_close(out[rows], expected_out, atol=1e-6, rtol=1e-6)
            assert torch.equal(selection.mask[rows], expected.mask)
            assert torch.equal(selection.indices[rows], expected.indices)
            torch.testing.assert_close(selection.scores[rows], expected.scores, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("splits", [2, 5])
@pytest.mark.parametrize("case, launches", [
    ("decode_step", 1),  # one query whose kv heads share a selection: one pass for both
    ("decode_step_group_of_three", 1),
    ("decode_step_per_head_no_memory", 2),
    ("chunk_across_blocks", 2),
    ("decode_step_top_one", 2),
])
def test_few_query_forwards_split_among_programs(monkeypatch, case, launches, splits):
    """Few queries' key tiles and selection blocks shared by several programs per query
    tile (decoding steps that read their position on the device), their partial outputs
    and top-n merged: more shares than work leave some empty."""
    parts = []

    def few_rows_splits(rows, programs, work, device):
        parts.append(work)
        return splits

    monkeypatch.setattr(compressed, "_few_rows_splits", few_rows_splits)
    check_continuation(*CONTINUATION_CASES[case], position_on_device=True)
    assert len(parts) == launches, "every launch over the keys should split"
    if splits == 5:
        assert min(parts) < splits, "every share had work"


@pytest.mark.parametrize("rows, programs, parts, splits", [
    (1, 2, 30, 30),     # a decoding step's selection at 60k tokens: one chunk per program
    (1, 2, 500, 32),    # a longer cache: at most 32 shares
    (16, 32, 10, 5),    # as many programs as SMs
    (17, 2, 34, 1),     # more queries than a few-row tile: one program per tile
    (1, 2, 1, 1),
])
def test_few_rows_splits_fill_the_gpu(monkeypatch, rows, programs, parts, splits):
    monkeypatch.setattr(compressed, "multiprocessors", lambda device: 132)
    monkeypatch.setattr(compressed, "_FEW_ROWS_PROGRAMS_PER_SM", 1)
    assert compressed._few_rows_splits(rows, programs, parts, torch.device("cuda")) == splits


def test_query_offset_refuses_gradients():
    q, ck, cv = make_inputs(1, 2, 1, 40, 16, 8, 4, 1, torch.float32, seed=2)
    q = q[:, :, 30:].requires_grad_()
    with pytest.raises(ValueError, match="q_offset"):
        compressed_attend_and_select(q, ck, cv, 8, 4, 1, 16, 2, q_offset=30)


def test_selection_chunks_of_32_blocks(monkeypatch):
    """The scoring tiles CUDA uses (64+ compressed keys) can hold 32 selection blocks per
    chunk: padded lanes, several chunks per row, the top-n merged across them."""
    wide = compressed._Launch(block_m=16, block_n=64, num_warps=1, num_stages=1)
    launch = compressed._launch
    monkeypatch.setattr(compressed, "_launch",
                        lambda kernel, q: wide if kernel == "select" else launch(kernel, q))
    assert compressed._chunk_layout(4, 4, 4, wide.block_n) == (32, 1, 32)
    check_against_reference(1, 4, 2, 140, 16, 4, 4, 1, 4, 5, True, True)


@pytest.mark.parametrize("programs, row_tiles, splits", [
    (160, 128, 2),   # the layer benchmark's 8k: 160 (head, key tile) programs, 264 wanted
    (288, 512, 1),   # its 16k: 288 programs already fill two per SM
    (96, 2, 2),      # no more shares than query tiles
    (1024, 1024, 1),  # a long sequence fills the GPU unsplit
    (0, 1, 1),       # no compressed key: nothing to launch, one (empty) share
])
def test_dkdv_query_splits_fill_the_gpu(monkeypatch, programs, row_tiles, splits):
    monkeypatch.setattr(compressed, "multiprocessors", lambda device: 132)
    assert compressed._dkdv_query_splits(programs, row_tiles, torch.device("cuda")) == splits


@pytest.mark.parametrize("parts, kv_heads, group, size, dtype", [
    (1, 2, 16, 300, torch.float32),  # one share; the last block of elements partly past the end
    (3, 1, 4, 1030, torch.float16),
])
def test_dkdv_partials_sum_like_float64(parts, kv_heads, group, size, dtype):
    gen = torch.Generator().manual_seed(parts * 1000 + size)
    dk_part, dv_part = torch.randn(2, parts, kv_heads, group, size, generator=gen).to(DEVICE)
    dk = compressed._allocate((kv_heads, size), dtype, DEVICE)
    dv = compressed._allocate((kv_heads, size), dtype, DEVICE)
    block = 256
    compressed._sum_partials_kernel[(kv_heads, -(-size // block), 2)](
        dk_part, dv_part, dk, dv, size, PARTS=parts, GROUP=group, BLOCK=block,
    )
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-3, atol=1e-3)
    for partials, total in ((dk_part, dk), (dv_part, dv)):
        expected = partials.double().sum((0, 2)).to(dtype)
        torch.testing.assert_close(total.double(), expected.double(), **tolerance)


def test_float16_and_strided_inputs():
    check_against_reference(1, 4, 2, 48, 32, 8, 4, 1, 16, 3, True, True, dtype=torch.float16,
                            heads_last=True)


def test_query_gradient_keeps_the_query_order_of_heads_and_tokens():
    """The layer's q is a head-splitting view of its projection: dQ comes back laid out as
    [b, n, h, d] for such a q (contiguous for a contiguous one), with the same values."""
    b, h, n, d = 1, 4, 40, 16
    view, ck, cv = make_inputs(b, h, 2, n, d, 8, 4, 1, torch.float32, seed=4, heads_last=True)
    dout = torch.randn(b, h, n, d, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    grads = []
    for q in (view, view.contiguous()):
        q = q.detach().requires_grad_()
        out, _, _ = compressed_attend_and_select(q, ck, cv, 8, 4, 1, 16, 2)
        grads.append(torch.autograd.grad(out, q, dout)[0])
    assert grads[0].stride() == (n * h * d, d, h * d, 1)
    assert grads[1].is_contiguous()
    torch.testing.assert_close(grads[0], grads[1], atol=0, rtol=0)


def test_selection_runs_without_grad_and_matches_cpu_fallback(monkeypatch):
    q, ck, cv = make_inputs(1, 4, 2, 40, 16, 8, 4, 1, torch.float32, seed=3)
    args = (q, ck, cv, 8, 4, 1, 16, 2)
    out, lse, selection = compressed_attend_and_select(*args, share_selection=False)
    monkeypatch.setattr(compressed, "_use_kernels", lambda device: False)
    ref_out, ref_lse, ref_selection = compressed_attend_and_select(*args, share_selection=False)
    tol = tolerances(torch.float32)[0]
    torch.testing.assert_close(out, ref_out, atol=tol, rtol=tol)
    torch.testing.assert_close(lse, ref_lse, atol=tol, rtol=tol)
    assert torch.equal(selection.mask, ref_selection.mask)
    assert torch.equal(selection.indices, ref_selection.indices)


@pytest.mark.parametrize(
    "change, name",
    [
        (dict(q=torch.zeros(1, 2, 8)), "q"),
        (dict(ck=torch.zeros(1, 3, 4, 16)), "ck"),
        (dict(cv=torch.zeros(1, 1, 5, 16)), "cv"),
        (dict(q=torch.zeros(1, 2, 8, 16, dtype=torch.float64)), "q"),
        (dict(q=torch.zeros(1, 2, 8, 160), ck=torch.zeros(1, 1, 4, 160),
              cv=torch.zeros(1, 1, 4, 160)), "head dim"),
        (dict(compress_stride=0), "compress_stride"),
        (dict(compress_stride=5), "compress_stride"),
        (dict(num_mem=5), "num_mem"),
        (dict(num_selected=-1), "num_selected"),
        (dict(selection_block_size=2.0), "selection_block_size"),
        (dict(q_offset=-1), "q_offset"),
    ],
)
def test_invalid_arguments_name_the_argument(change, name):
    kwargs = dict(q=torch.zeros(1, 2, 8, 16), ck=torch.zeros(1, 1, 4, 16),
                  cv=torch.zeros(1, 1, 4, 16), compress_block_size=4, compress_stride=2,
                  num_mem=1, selection_block_size=4, num_selected=2)
    kwargs.update(change)
    with pytest.raises(ValueError, match=name):
        compressed_attend_and_select(**kwargs)


# --- GPU (compiled kernels at realistic sizes) -----------------------------------------


@gpu
@pytest.mark.parametrize(
    "case",
    [
        # The layer configuration (32 query heads on 2 kv heads, shared selection).
        (1, 32, 2, 8192, 64, 32, 16, 1, 64, 16, True, True, torch.bfloat16),
        (1, 8, 1, 8200, 128, 32, 16, 0, 64, 16, True, False, torch.float16),
        (1, 4, 2, 8192, 64, 32, 16, 1, 64, 16, True, False, torch.bfloat16),
        (2, 6, 2, 8192, 48, 16, 8, 2, 32, 8, False, True, torch.bfloat16),
        # float32 at the float32 tolerances: no TF32 in any dot.
        (1, 8, 2, 8192, 64, 32, 16, 1, 64, 16, True, True, torch.float32),
    ],
    ids=["issue_config_bf16", "d128_per_head_fp16", "d64_per_head_bf16", "non_causal_group3_d48_bf16",
         "group4_fp32"],
)
@pytest.mark.parametrize("score_grad", [False, True], ids=["plain", "score_grad"])
def test_gpu_long_sequences(case, score_grad):
    """With ``score_grad`` the dK / dV kernel runs the differentiable top-n's own tiles."""
    *geometry, dtype = case
    check_against_reference(*geometry, dtype=dtype, seed=11, score_grad=score_grad)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("position_on_device", [False, True], ids=["q_offset", "position_on_device"])
def test_gpu_one_query_at_a_long_cache(dtype, position_on_device):
    """A decoding step of the issue's configuration after 65535 tokens, at the compiled
    kernels' tiles: 34 chunks of up to 31 blocks (more than the top-n's tile has rows),
    split among programs."""
    check_continuation(1, 32, 2, 65536, 64, 32, 16, 1, 64, 16, True, True, 65535, dtype=dtype, seed=13,
                       position_on_device=position_on_device)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("score_grad", [False, True], ids=["plain", "score_grad"])
def test_gpu_packed_documents(dtype, score_grad):
    """Documents from one selection block to half the row, at the compiled kernels' tiles."""
    lengths = [64, 704, 128, 2048, 192, 4096, 960]
    check_against_reference(2, 8, 2, 8192, 64, 32, 16, 1, 64, 16, True, True, dtype=dtype, seed=12,
                            score_grad=score_grad, documents=[lengths, lengths[::-1]])


@gpu
@pytest.mark.usefixtures("large_gpu_memory")
def test_gpu_int64_offsets():
    """b * hq * n * d > 2**31: every kernel must address past the int32 range."""
    b, hq, hk, n, d, cbs, stride, num_mem, sbs, top = 4100, 8, 2, 1024, 64, 32, 16, 1, 64, 4
    assert b * hq * n * d > 2**31
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    num_keys = num_mem + num_compressed_blocks(n, cbs, stride)
    q = torch.randn(b, hq, n, d, device=DEVICE, dtype=torch.bfloat16, generator=gen)
    ck, cv = (torch.randn(b, hk, num_keys, d, device=DEVICE, dtype=torch.bfloat16, generator=gen)
              for _ in range(2))
    q.requires_grad_(), ck.requires_grad_(), cv.requires_grad_()
    out, lse, selection = compressed_attend_and_select(q, ck, cv, cbs, stride, num_mem, sbs, top)
    dout = torch.randn(out.shape, device=DEVICE, dtype=torch.bfloat16, generator=gen)
    out.backward(dout)
    tol = tolerances(torch.bfloat16)[0]
    last = slice(b - 1, b)
    ref_out, ref_lse, ref_grads, scores, selectable = reference(
        q[last], ck[last], cv[last], dout[last], cbs, stride, num_mem, sbs, True, True
    )
    assert_close_scaled(out[last], ref_out, tol)
    torch.testing.assert_close(lse[last].double(), ref_lse, atol=tol, rtol=tol)
    for grad, ref_grad in zip((q.grad, ck.grad, cv.grad), ref_grads):
        assert_close_scaled(grad[last], ref_grad, tol)
    assert_selection_matches(tuple(t[last] for t in selection), scores, selectable, top,
                             *tolerances(torch.bfloat16)[1:])
