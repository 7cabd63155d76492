"""Selection-branch Triton kernels (``native_sparse_attend``) against the float64 reference.

Without CUDA the kernels run under the Triton interpreter (``TRITON_INTERPRET=1``, set in
conftest.py) on small float32 / float16 problems; with CUDA the same tests run compiled,
plus the ``gpu`` ones at n >= 4096 in bf16 and fp16. Every buffer the kernels write
starts as NaN, so an element a kernel forgets to write fails the comparison.

The selections are drawn to hit the op's corner cases: duplicate slots, masked slots,
rows whose slots are all masked, negative indices, blocks past the end and, in causal
mode, blocks after the query (which the causal cap must drop).
"""

import math
from dataclasses import dataclass, replace

import pytest
import torch

from native_sparse_attention import native_sparse_attend
from native_sparse_attention.documents import document_bounds
from native_sparse_attention.kernels import selection as selection_kernels
from native_sparse_attention.kernels import selection_inverse
from native_sparse_attention.kernels.selection import LaunchConfig
from native_sparse_attention.reference import selected_attend, sliding_window_attend

from kernel_device import DEVICE, gpu, skip_without_kernels

skip_without_kernels()


@pytest.fixture(autouse=True)
def poisoned_buffers(monkeypatch):
    monkeypatch.setattr(
        selection_kernels, "_empty",
        lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype, device=device),
    )


@dataclass(frozen=True)
class Case:
    """One problem: q [b, hq, n, d], k, v [b, hk, n, d], ``num_slots`` selected blocks."""

    b: int = 1
    hq: int = 4
    hk: int = 2
    n: int = 37
    d: int = 32
    block_size: int = 16
    num_slots: int = 3
    per_query_head: bool = False
    causal: bool = True
    window: int | None = None  # None: no sliding output
    sel_scale: bool = True
    launch: tuple = ()  # LaunchConfig fields as (name, value) pairs; () for the default
    dtype: torch.dtype = torch.float32
    index_dtype: torch.dtype = torch.int64
    heads_last: bool = False  # q, k, v as transposed [b, n, h, d] views
    padded_rows: bool = False  # q, k, v as views of rows 8 elements longer (neither layout)

    @property
    def selection_heads(self) -> int:
        return self.hq if self.per_query_head else self.hk


def random_selection(case: Case, gen: torch.Generator):
    """indices, fmask [b, hs, n, sel] with duplicates, masked slots, all-masked rows and
    out-of-range blocks (negative, past the end, and after the query when causal)."""
    b, hs, n, sel, bs = case.b, case.selection_heads, case.n, case.num_slots, case.block_size
    num_blocks = math.ceil(n / bs)
    own_block = torch.arange(n) // bs
    if case.causal:
        # Mostly blocks up to the query's own one, sometimes later ones the cap must drop.
        upper = torch.where(torch.rand(b, hs, n, sel, generator=gen) < 0.85, own_block[:, None] + 1, num_blocks)
        indices = (torch.rand(b, hs, n, sel, generator=gen) * upper).long()
    else:
        indices = torch.randint(0, num_blocks, (b, hs, n, sel), generator=gen)
    corner = torch.rand(b, hs, n, sel, generator=gen)
    indices = torch.where(corner < 0.05, -1, indices)
    indices = torch.where((corner > 0.95), num_blocks + 1, indices)
    if sel > 1:
        duplicated = torch.rand(b, hs, n, generator=gen) < 0.3
        indices[..., 1] = torch.where(duplicated, indices[..., 0], indices[..., 1])
    fmask = torch.rand(b, hs, n, sel, generator=gen) < 0.8
    fmask &= (torch.rand(b, hs, n, 1, generator=gen) > 0.15)  # some rows with every slot masked
    return indices.to(case.index_dtype), fmask


def make_inputs(case: Case, seed: int):
    """Fresh random q, k, v, indices, fmask, sel_scale (or None) on DEVICE."""
    gen = torch.Generator().manual_seed(seed)

    def rand(h):
        d = case.d + 8 * case.padded_rows
        shape = (case.b, case.n, h, d) if case.heads_last else (case.b, h, case.n, d)
        t = torch.randn(shape, generator=gen).to(DEVICE, case.dtype)[..., : case.d]
        return (t.transpose(1, 2) if case.heads_last else t).requires_grad_()

    q, k, v = rand(case.hq), rand(case.hk), rand(case.hk)
    indices, fmask = random_selection(case, gen)
    sel_scale = None
    if case.sel_scale:
        sel_scale = (0.5 + torch.rand(indices.shape, generator=gen)).to(DEVICE).requires_grad_()
    return q, k, v, indices.to(DEVICE), fmask.to(DEVICE), sel_scale


def run_kernels(case: Case, q, k, v, indices, fmask, sel_scale, monkeypatch=None, documents=None):
    """out, sliding_out (or None), lse of native_sparse_attend; with ``documents``
    (document_start, document_end), of the selection operator itself."""
    if case.launch:
        monkeypatch.setattr(selection_kernels, "default_launch_config", lambda *_, **__: LaunchConfig(**dict(case.launch)))
    if documents is not None:
        return selection_kernels.selection_attention(q, k, v, case.block_size, indices, fmask, sel_scale, case.causal,
                                                     case.window, case.d ** -0.5, 0, *documents)
    sliding = case.window is not None
    outputs = native_sparse_attend(
        q, k, v, case.block_size, indices, fmask, sel_scale=sel_scale, include_block_causal=case.causal,
        return_sliding_window_out=sliding, sliding_window_size=case.window, return_lse=True,
    )
    return (outputs[0], outputs[1], outputs[2]) if sliding else (outputs[0], None, outputs[1])


def reference(case: Case, q, k, v, indices, fmask, sel_scale, d_out, d_sliding, max_elements=2**27,
              document_start=None):
    """float64 out, sliding_out, lse and gradients of q, k, v, sel_scale; the window kept
    to the queries' documents with ``document_start`` [b, n].

    Runs in chunks of queries small enough for the reference's [chunk, keys, d] tensors,
    with the gradients accumulated over the chunks."""
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    s64 = None if sel_scale is None else sel_scale.detach().double().requires_grad_()
    gathered = case.b * case.hq * (case.num_slots + 1) * case.block_size * case.d
    outs, lses = [], []
    for rows in _chunks(case.n, max_elements // gathered):
        out, lse = selected_attend(
            q64[:, :, rows], k64, v64, case.block_size, indices[:, :, rows], fmask[:, :, rows],
            None if s64 is None else s64[:, :, rows], include_block_causal=case.causal, q_offset=rows.start,
        )
        (out * d_out[:, :, rows].double()).sum().backward()
        outs.append(out.detach()), lses.append(lse)
    slidings = []
    if case.window is not None:
        # A query chunk [start, end) sees only the keys [start - w, end + w).
        w = case.window
        per_row = max_elements / (case.b * case.hq * case.d)  # chunk * (chunk + 2w) elements
        for rows in _chunks(case.n, int(math.sqrt(per_row + w * w) - w)):
            lo, hi = max(rows.start - w, 0), (rows.stop if case.causal else rows.stop + w)
            # The reference compares document starts with positions in k[lo:hi].
            starts = None if document_start is None else document_start[:, rows] - lo
            sliding, _ = sliding_window_attend(q64[:, :, rows], k64[:, :, lo:hi], v64[:, :, lo:hi], w,
                                               causal=case.causal, q_offset=rows.start - lo, document_start=starts)
            (sliding * d_sliding[:, :, rows].double()).sum().backward()
            slidings.append(sliding.detach())
    grads = (q64.grad, k64.grad, v64.grad, None if s64 is None else s64.grad)
    sliding = torch.cat(slidings, 2) if slidings else None
    return torch.cat(outs, 2), sliding, torch.cat(lses, 2), grads


def _chunks(n: int, size: int):
    """Slices covering range(n) in pieces of ``size`` (at least 1) rows."""
    size = max(size, 1)
    return [slice(start, start + size) for start in range(0, n, size)]


def tolerance(dtype: torch.dtype) -> float:
    if dtype == torch.float32:
        return 1e-5  # float32 products on the GPU too, not TF32
    return 2e-2


def assert_close_scaled(actual, expected, tol, name):
    """Elementwise closeness relative to the tensor's own magnitude."""
    assert actual.shape == expected.shape, name
    assert torch.isfinite(actual).all(), f"{name} has non-finite elements"
    scale = expected.abs().max().clamp_min(1e-6).item()
    torch.testing.assert_close(actual.double(), expected, atol=tol * scale, rtol=tol, msg=lambda m: f"{name}: {m}")


def check_against_reference(case: Case, seed: int = 0, monkeypatch=None, document_ids=None):
    """``document_ids`` [b, n]: packed documents, to which the window keeps."""
    q, k, v, indices, fmask, sel_scale = make_inputs(case, seed)
    documents = None if document_ids is None else document_bounds(document_ids.to(DEVICE))
    out, sliding, lse = run_kernels(case, q, k, v, indices, fmask, sel_scale, monkeypatch, documents)
    gen = torch.Generator().manual_seed(seed + 1)
    d_out = torch.randn(out.shape, generator=gen).to(DEVICE, case.dtype)
    d_sliding = torch.randn(out.shape, generator=gen).to(DEVICE, case.dtype)
    loss = (out * d_out).sum() + (0 if sliding is None else (sliding * d_sliding).sum())
    inputs = (q, k, v) + (() if sel_scale is None else (sel_scale,))
    grads = torch.autograd.grad(loss, inputs)
    ref_out, ref_sliding, ref_lse, ref_grads = reference(case, q, k, v, indices, fmask, sel_scale, d_out, d_sliding,
                                                         document_start=None if documents is None else documents[0])
    tol = tolerance(case.dtype)

    assert out.dtype == case.dtype and lse.dtype == torch.float32 and lse.shape == q.shape[:3]
    assert_close_scaled(out, ref_out, tol, "out")
    empty = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), empty), "rows without keys must have LSE -inf"
    torch.testing.assert_close(lse[~empty].double(), ref_lse[~empty], atol=tol * 10, rtol=tol)
    if sliding is not None:
        assert_close_scaled(sliding, ref_sliding, tol, "sliding_out")
    for name, grad, ref_grad in zip(("dq", "dk", "dv", "dsel_scale"), grads, ref_grads):
        assert_close_scaled(grad, ref_grad, tol, name)
    # A query without keys outputs zeros; without a sliding output it also gets zero dq.
    assert (out[empty] == 0).all()
    if sliding is None:
        assert (grads[0][empty] == 0).all()
    if sel_scale is not None:
        # Masked slots and slots whose keys are all dropped do not depend on sel_scale.
        assert (grads[3][~fmask] == 0).all()
    return empty


CASES = {
    "odd_n_group3_d48_sliding": Case(hq=6, hk=2, n=37, d=48, window=20),
    "per_query_head_fp16": Case(hq=2, hk=1, n=35, per_query_head=True, dtype=torch.float16),
    "group16_block32": Case(hq=16, hk=1, n=45, d=16, block_size=32, num_slots=2),
    "group1_d24_int32_no_sel_scale": Case(hq=1, hk=1, n=33, d=24, sel_scale=False, index_dtype=torch.int32),
    # Fine tiles of 16 keys, and the dK / dV pass cut into chunks of 3 entries, 16 rows a
    # step, so that blocks get several atomically added chunks, launched out of key order.
    "block32_fine16_chunks": Case(hq=2, hk=1, n=40, d=16, block_size=32, num_slots=2,
                                  launch=(("fine_n", 16), ("dkv_chunk", 3), ("dkv_rows", 16))),
    "non_causal_block128": Case(hq=2, hk=1, n=40, d=16, block_size=128, num_slots=2, causal=False),
    "non_causal_sliding_per_head": Case(hq=2, hk=1, n=29, d=16, causal=False, window=6, per_query_head=True),
    "non_causal_block64_fp16_strided": Case(hq=2, hk=1, n=40, block_size=64, causal=False, dtype=torch.float16,
                                            heads_last=True),
    "padded_rows_group2_sliding": Case(b=2, hq=4, hk=2, n=35, d=16, num_slots=2, window=11, padded_rows=True),
    "sliding_fp16_window0_d96": Case(hq=2, hk=1, n=21, d=96, num_slots=2, window=0, dtype=torch.float16),
    # Window tiles of 4 positions x 4 rows (group 3 padded) walking keys 16 at a time, so
    # that tiles start mid-window, cross key tiles and end past n.
    "window_tiles_group3": Case(hq=6, hk=2, n=37, d=16, num_slots=2, window=9,
                                launch=(("window_rows", 16), ("window_n", 16), ("window_dq_rows", 16),
                                        ("window_dq_n", 16))),
    # Windows spanning several query and key tiles of the window's dK / dV pass.
    "window_band_dkv_tiles": Case(hq=2, hk=1, n=90, d=16, num_slots=2, window=37,
                                  launch=(("window_block_n", 16), ("window_block_m", 16))),
    "window_band_dkv_tiles_non_causal": Case(hq=2, hk=1, n=83, d=16, num_slots=2, causal=False, window=29,
                                             launch=(("window_block_n", 16), ("window_block_m", 32))),
    # Steps of 4 positions x 4 rows (group 3 padded), so that a step's padded head rows
    # are masked and the band spans a key tile's 15 steps.
    "window_band_dkv_group3_non_causal": Case(hq=6, hk=2, n=75, d=16, num_slots=2, causal=False, window=21,
                                              launch=(("window_block_n", 16), ("window_block_m", 16))),
    # Windows of several key tiles: tiles of 8 positions (group 2) see 3-4 key tiles of
    # 16, whose inner ones run without masks in the forward and dQ.
    "window_inner_key_tiles": Case(hq=4, hk=2, n=90, d=16, num_slots=2, window=40,
                                   launch=(("window_rows", 16), ("window_n", 16), ("window_dq_rows", 16),
                                           ("window_dq_n", 16))),
    "window_inner_key_tiles_non_causal": Case(hq=4, hk=2, n=77, d=16, num_slots=2, causal=False, window=33,
                                              launch=(("window_rows", 16), ("window_n", 16), ("window_dq_rows", 16),
                                                      ("window_dq_n", 16))),
    # The 2-byte default up to d = 64: the window tiles in a launch of their own.
    "window_own_launch_fp16_group4": Case(hq=8, hk=2, n=43, d=32, num_slots=2, window=13, dtype=torch.float16),
    "window_tiles_non_causal_group3": Case(hq=3, hk=1, n=30, d=16, num_slots=2, causal=False, window=7,
                                           launch=(("window_rows", 32), ("window_n", 16),
                                                   ("window_dq_rows", 16), ("window_dq_n", 32))),
    # The selection's dQ added by the dK / dV pass: with the window's dQ pass adding the
    # rest, without a window (the host scales and casts), over chunks of 3 entries and
    # fine tiles, per query head, non-causal, and with sel_scale (which keeps the dQ pass).
    "atomic_dq_group3_d48_sliding": Case(hq=6, hk=2, n=37, d=48, window=20, sel_scale=False,
                                         launch=(("atomic_dq", True),)),
    "atomic_dq_block32_fine16_chunks": Case(hq=2, hk=1, n=40, d=16, block_size=32, num_slots=2, sel_scale=False,
                                            launch=(("atomic_dq", True), ("fine_n", 16), ("dkv_chunk", 3),
                                                    ("dkv_rows", 16))),
    "atomic_dq_non_causal_sliding_per_head": Case(hq=2, hk=1, n=29, d=16, causal=False, window=6,
                                                  per_query_head=True, sel_scale=False,
                                                  launch=(("atomic_dq", True),)),
    "atomic_dq_fp16_strided_sliding": Case(b=2, hq=4, hk=2, n=35, d=32, num_slots=2, window=11, sel_scale=False,
                                           dtype=torch.float16, heads_last=True, launch=(("atomic_dq", True),)),
    "atomic_dq_with_sel_scale": Case(hq=4, hk=2, n=30, d=16, num_slots=2, window=7,
                                     launch=(("atomic_dq", True),)),
    # The forward key-major over the inverted selection: with sel_scale, a window, chunks of
    # 20 entries in 16-row steps of fine tiles, per query head, non-causal, fp16 strided.
    "key_major_group3_d48_sliding": Case(hq=6, hk=2, n=37, d=48, window=20, launch=(("key_major_forward", True),)),
    "key_major_block32_fine16_chunks": Case(hq=2, hk=1, n=40, d=16, block_size=32, num_slots=2,
                                            launch=(("key_major_forward", True), ("fine_n", 16), ("dkv_chunk", 20),
                                                    ("dkv_rows", 16), ("key_major_rows", 16))),
    "key_major_non_causal_sliding_per_head": Case(hq=2, hk=1, n=29, d=16, causal=False, window=6,
                                                  per_query_head=True, launch=(("key_major_forward", True),)),
    "key_major_group1_d24_int32_indices": Case(hq=2, hk=2, n=33, d=24, num_slots=2, window=5, sel_scale=False,
                                               index_dtype=torch.int32, dtype=torch.float16,
                                               launch=(("key_major_forward", True), ("atomic_dq", True))),
    "key_major_atomic_dq_fp16_strided": Case(b=2, hq=4, hk=2, n=35, d=32, num_slots=2, window=11, sel_scale=False,
                                             dtype=torch.float16, heads_last=True,
                                             launch=(("key_major_forward", True), ("atomic_dq", True))),
    "query_major_dq_group2_sliding_no_sel_scale": Case(hq=4, hk=2, n=37, d=16, num_slots=2, window=9,
                                                       sel_scale=False, launch=(("atomic_dq", False),)),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_matches_reference(case, monkeypatch):
    empty = check_against_reference(case, monkeypatch=monkeypatch)
    if not case.causal:
        assert empty.any(), "the matrix must contain rows without keys"


# Chunks of 3 entries (several a block, launched out of key order), dQ from the dK / dV
# pass and the key-major forward asked for, per query head, non-causal, strided fp16.
DETERMINISTIC_CASES = ("block32_fine16_chunks", "atomic_dq_block32_fine16_chunks", "key_major_group3_d48_sliding",
                       "key_major_non_causal_sliding_per_head", "key_major_atomic_dq_fp16_strided")


@pytest.mark.parametrize("name", DETERMINISTIC_CASES)
def test_deterministic_algorithms_add_no_floats_atomically(name, monkeypatch, deterministic):
    """Under torch.use_deterministic_algorithms, whatever the launch configuration asks:
    the forward stays query-side, dQ comes from the dQ pass, and each dK / dV chunk
    stores a slab of its own (poisoned first), which ``_dkv_partials_kernel`` sums in
    chunk order."""
    from conftest import launched_constexprs

    launches = launched_constexprs(monkeypatch, selection_kernels)
    check_against_reference(CASES[name], monkeypatch=monkeypatch)
    kernels = [launch["kernel"] for launch in launches]
    assert "_key_major_fwd_kernel" not in kernels and kernels.count("_dkv_partials_kernel") == 1
    assert not any(launch.get("ATOMIC_DQ") for launch in launches)
    assert [launch["PARTIALS"] for launch in launches if "PARTIALS" in launch] == [True]


def test_small_groups_take_dq_from_the_dkv_pass():
    for shared_heads, atomic in ((1, True), (4, True), (8, True), (16, False), (32, False)):
        for dtype, head_dim in ((torch.bfloat16, 64), (torch.bfloat16, 128), (torch.float32, 64)):
            config = selection_kernels.default_launch_config(64, head_dim, dtype, True, shared_heads=shared_heads)
            assert config.atomic_dq is atomic, (shared_heads, dtype, head_dim)


def test_small_groups_of_2_byte_inputs_run_the_forward_key_major():
    for shared_heads, key_major in ((1, True), (4, True), (8, False), (16, False)):
        for dtype, head_dim in ((torch.bfloat16, 64), (torch.float16, 128)):
            config = selection_kernels.default_launch_config(64, head_dim, dtype, True, shared_heads=shared_heads)
            assert config.key_major_forward is key_major, (shared_heads, dtype, head_dim)
            decoding = selection_kernels.default_launch_config(64, head_dim, dtype, True, shared_heads=shared_heads,
                                                               queries=1)
            assert not decoding.key_major_forward
            shortest = selection_kernels.KEY_MAJOR_FORWARD_MIN_QUERIES * (2 if head_dim <= 64 else 1)
            for queries in (shortest - 1, shortest):
                config = selection_kernels.default_launch_config(64, head_dim, dtype, True, shared_heads=shared_heads,
                                                                 queries=queries)
                assert config.key_major_forward is (key_major and queries == shortest), (shared_heads, queries)
            for batch in (1, 2):
                config = selection_kernels.default_launch_config(64, head_dim, dtype, True, shared_heads=shared_heads,
                                                                 queries=shortest // 2, batch=batch)
                assert config.key_major_forward is (key_major and batch == 2), (shared_heads, batch)
    assert not selection_kernels.default_launch_config(64, 64, torch.float32, True, shared_heads=1).key_major_forward
    smallest = selection_kernels.KEY_MAJOR_FORWARD_MIN_BLOCK
    for block_size in (smallest // 2, smallest):
        config = selection_kernels.default_launch_config(block_size, 64, torch.bfloat16, True, shared_heads=1)
        assert config.key_major_forward is (block_size == smallest), block_size


# case, q_offset: the last n - q_offset queries of the case, as a decoding step (one query)
# or a chunk that continues a cache would run them.
CONTINUATIONS = {
    "decode_step_group3_sliding": (Case(hq=6, hk=2, n=37, d=48, window=20), 36),
    "decode_step_group16_fp16": (Case(hq=16, hk=1, n=70, d=32, num_slots=2, window=24, dtype=torch.float16), 69),
    # More than FEW_QUERIES queries: the 2-byte default's window launch of its own.
    "chunk_own_window_launch_fp16": (Case(hq=8, hk=2, n=43, d=32, num_slots=2, window=13, dtype=torch.float16), 22),
    "chunk_per_query_head": (Case(hq=2, hk=1, n=50, per_query_head=True, window=9), 21),
    "chunk_window_tiles_group3": (Case(hq=6, hk=2, n=37, d=16, num_slots=2, window=9,
                                       launch=(("window_rows", 16), ("window_n", 16))), 14),
    "non_causal_chunk": (Case(hq=2, hk=1, n=40, d=16, causal=False, window=7), 25),
    "chunk_window_inner_key_tiles": (Case(hq=4, hk=2, n=90, d=16, num_slots=2, window=40,
                                          launch=(("window_rows", 16), ("window_n", 16))), 37),
}


@pytest.mark.parametrize("case, q_offset", CONTINUATIONS.values(), ids=CONTINUATIONS.keys())
def test_queries_continuing_a_sequence_match_reference(case, q_offset, monkeypatch):
    if case.launch:
        monkeypatch.setattr(selection_kernels, "default_launch_config",
                            lambda *_, **__: LaunchConfig(**dict(case.launch)))
    q, k, v, indices, fmask, sel_scale = make_inputs(case, seed=7)
    rows = slice(q_offset, None)
    q, indices, fmask, sel_scale = q[:, :, rows], indices[:, :, rows], fmask[:, :, rows], sel_scale[:, :, rows]
    with torch.no_grad():
        out, sliding, lse = native_sparse_attend(
            q, k, v, case.block_size, indices, fmask, sel_scale=sel_scale, include_block_causal=case.causal,
            return_sliding_window_out=True, sliding_window_size=case.window, return_lse=True, q_offset=q_offset,
        )
    q64, k64, v64, s64 = (t.detach().double() for t in (q, k, v, sel_scale))
    ref_out, ref_lse = selected_attend(q64, k64, v64, case.block_size, indices, fmask, s64,
                                       include_block_causal=case.causal, q_offset=q_offset)
    ref_sliding, _ = sliding_window_attend(q64, k64, v64, case.window, causal=case.causal, q_offset=q_offset)
    tol = tolerance(case.dtype)
    assert out.shape == sliding.shape == q.shape and lse.shape == q.shape[:3]
    assert_close_scaled(out, ref_out, tol, "out")
    assert_close_scaled(sliding, ref_sliding, tol, "sliding_out")
    empty = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), empty)
    torch.testing.assert_close(lse[~empty].double(), ref_lse[~empty], atol=tol * 10, rtol=tol)


@pytest.mark.parametrize("case, q_offset", [CONTINUATIONS["decode_step_group3_sliding"],
                                             CONTINUATIONS["decode_step_group16_fp16"]],
                         ids=["group3", "group16_fp16"])
def test_position_read_on_the_device_matches_q_offset(case, q_offset):
    """The entry point of CUDA-graph decoding: each batch row's position comes from a
    device tensor (the rows of a batch may decode at different positions: here the last
    token and one 7 earlier), and k, v hold spare rows past the queries (finite garbage),
    which causality must hide."""
    q, k, v, indices, fmask, _ = make_inputs(replace(case, b=2), seed=8)
    offsets = (q_offset, q_offset - 7)

    def at_offsets(t):
        return torch.stack([t[row, :, offset] for row, offset in enumerate(offsets)])[:, :, None]

    q, indices, fmask = at_offsets(q.detach()), at_offsets(indices), at_offsets(fmask)
    k, v = k.detach(), v.detach()
    spare = torch.randn(k.shape[0], k.shape[1], 9, k.shape[3], generator=torch.Generator().manual_seed(3))
    spare = spare.to(DEVICE, k.dtype)
    outputs = selection_kernels.selection_attention_at(
        q, torch.cat((k, spare), 2), torch.cat((v, spare), 2), case.block_size, indices, fmask, case.window,
        q.shape[-1] ** -0.5, torch.tensor(offsets, device=DEVICE),
    )
    for row, offset in enumerate(offsets):
        rows = slice(row, row + 1)
        with torch.no_grad():
            keys, values = k[rows, :, :offset + 1], v[rows, :, :offset + 1]
            expected = native_sparse_attend(q[rows], keys, values, case.block_size, indices[rows], fmask[rows],
                                            return_sliding_window_out=True, sliding_window_size=case.window,
                                            q_offset=offset)
        for actual, wanted in zip(outputs, expected):
            torch.testing.assert_close(actual[rows], wanted, atol=0, rtol=0)


@pytest.mark.parametrize("shares", [(1, 1), (2, 3), (5, 1), (40, 40)])
def test_shares_of_the_keys_merge_into_the_whole_outputs(shares, monkeypatch):
    """A decoding step's selection and window in shares of each query's key sets and
    window key tiles (more shares than either too: the spare ones hold no keys): merged,
    the shares give the unsplit outputs and the reference's LSEs. The rows of the batch
    sit at different positions, one of them near the start."""
    case, q_offset = CONTINUATIONS["decode_step_group16_fp16"]
    case = replace(case, b=3, window=40)
    # Window key tiles of 16 keys: three or four of them per row.
    default = selection_kernels.default_launch_config
    monkeypatch.setattr(selection_kernels, "default_launch_config",
                        lambda *args, **kwargs: replace(default(*args, **kwargs), window_n=16))
    q, k, v, indices, fmask, _ = make_inputs(case, seed=9)
    offsets = (q_offset, q_offset - 7, 20)

    def at_offsets(t):
        return torch.stack([t[row, :, offset] for row, offset in enumerate(offsets)])[:, :, None]

    q, indices, fmask = at_offsets(q.detach()), at_offsets(indices), at_offsets(fmask)
    k, v = k.detach(), v.detach()
    args = (q, k, v, case.block_size, indices, fmask, case.window, q.shape[-1] ** -0.5,
            torch.tensor(offsets, device=DEVICE))
    selected, sliding = selection_kernels.selection_attention_partials_at(*args, shares=shares)
    for branch, count in zip((selected, sliding), shares):
        assert branch.out.shape == (3, case.hq, count, 1, case.d) and branch.lse.shape == (3, case.hq, count, 1)
        assert branch.out.dtype == branch.lse.dtype == torch.float32
    tol = tolerance(case.dtype)
    for branch, whole in zip((selected, sliding), selection_kernels.selection_attention_at(*args)):
        torch.testing.assert_close(branch.merge()[0], whole.float(), atol=tol, rtol=tol)
    for row, offset in enumerate(offsets):
        q64, k64, v64 = (t[row:row + 1].double() for t in (q, k[:, :, :offset + 1], v[:, :, :offset + 1]))
        _, ref_lse = selected_attend(q64, k64, v64, case.block_size, indices[row:row + 1], fmask[row:row + 1],
                                     None, include_block_causal=True, q_offset=offset)
        _, ref_sliding_lse = sliding_window_attend(q64, k64, v64, case.window, causal=True, q_offset=offset)
        for branch, ref in ((selected, ref_lse), (sliding, ref_sliding_lse)):
            torch.testing.assert_close(branch.merge()[1][row:row + 1].double(), ref, atol=tol * 10, rtol=tol)
    if shares == (40, 40):
        assert torch.isneginf(selected.lse).any() and torch.isneginf(sliding.lse).any()


def test_query_offset_refuses_gradients():
    kwargs = _valid_arguments()
    kwargs.update(q=torch.zeros(1, 4, 2, 16, requires_grad=True),
                  selected_block_indices=torch.zeros(1, 2, 2, 2, dtype=torch.long),
                  fmask=torch.ones(1, 2, 2, 2, dtype=torch.bool), sel_scale=None, q_offset=30)
    with pytest.raises(ValueError, match="q_offset"):
        native_sparse_attend(**kwargs)


def test_sliding_out_alone_defaults_to_block_size_window():
    """Only the sliding output gets a gradient (the selection's is materialised as zeros),
    the window defaults to block_size, and the selection's LSE is the reference's."""
    case = Case(hq=2, hk=1, n=24, d=16, block_size=16, num_slots=1, window=16, sel_scale=False)
    q, k, v, indices, fmask, _ = make_inputs(case, seed=5)
    out, sliding = native_sparse_attend(q, k, v, 16, indices, fmask, return_sliding_window_out=True)
    sliding.sum().backward()
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref_sliding, _ = sliding_window_attend(q64, k64, v64, 16)
    ref_sliding.sum().backward()
    tol = tolerance(case.dtype)
    assert_close_scaled(sliding, ref_sliding, tol, "sliding_out")
    for name, grad, ref_grad in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad), (q64.grad, k64.grad, v64.grad)):
        assert_close_scaled(grad, ref_grad, tol, name)


def assert_chunk_table(table, chunk: int):
    """Key k's chunks are numbered from the chunks of the keys before it, and every chunk
    maps back to its key, the spare ones to num_keys."""
    chunks = (table.first_entry.diff() + chunk - 1) // chunk
    assert (chunks > 1).any()
    assert table.first_chunk.tolist() == [0] + chunks.cumsum(0).tolist()
    owners = torch.repeat_interleave(torch.arange(table.num_keys), chunks.cpu())
    spares = torch.full((table.chunk_key.numel() - owners.numel(),), table.num_keys)
    assert table.chunk_key.tolist() == torch.cat((owners, spares)).tolist()
    return chunks


def test_dkv_chunk_table_skips_unselected_blocks():
    """Blocks that no query selects own no chunk (non-causal: no own block either)."""
    case = Case(b=2, hq=2, hk=1, n=64, d=16, num_slots=2, causal=False)
    q, k, _, indices, fmask, _ = make_inputs(case, seed=4)
    indices = torch.where(indices == 1, 0, indices)
    problem = replace(
        selection_kernels._problem(q, k, indices, True, case.block_size, False, None, 0.25),
        config=LaunchConfig(dkv_chunk=4),
    )
    table = selection_inverse.key_block_entries(problem, indices.contiguous(), fmask.contiguous().view(torch.uint8),
                                                q.element_size())
    chunks = assert_chunk_table(table, chunk=4)
    assert (chunks == 0).sum() >= case.b


def test_dkv_chunks_launch_by_first_query(monkeypatch):
    """Program p of the dK / dV pass takes chunk ``chunk_order[p]``: every chunk once, the
    chunks of each (batch, kv head) together, ordered by the query of their first entry.
    On a GPU only problems many times L2's size order their chunks: this one is made to."""
    monkeypatch.setattr(selection_inverse, "ORDERED_CHUNKS_MIN_L2_FILLS", 0)
    case = Case(b=2, hq=4, hk=2, n=45, d=16, num_slots=3)
    q, k, _, indices, fmask, _ = make_inputs(case, seed=3)
    problem = replace(
        selection_kernels._problem(q, k, indices, True, case.block_size, True, None, 0.25),
        config=LaunchConfig(dkv_chunk=4),
    )
    table = selection_inverse.key_block_entries(problem, indices.contiguous(), fmask.contiguous().view(torch.uint8),
                                                q.element_size())
    num_chunks = table.chunk_key.numel()
    assert_chunk_table(table, chunk=4)
    assert sorted(table.chunk_order.tolist()) == list(range(num_chunks))
    launched = []
    for chunk in table.chunk_order.tolist():
        key = int(table.chunk_key[chunk])
        if key == table.num_keys:
            launched.append((math.inf, math.inf))
            continue
        first = int(table.first_entry[key]) + (chunk - int(table.first_chunk[key])) * 4
        assert first < int(table.first_entry[key + 1])
        launched.append((key // problem.num_blocks, int(table.entries[first]) >> 32))
    assert launched == sorted(launched)
    real = [position for position in launched if position[0] != math.inf]
    assert len({head for head, _ in real}) == case.b * case.hk
    assert len({query for _, query in real}) > 1


@pytest.mark.parametrize("name", ["block32_fine16_chunks", "per_query_head_fp16", "padded_rows_group2_sliding"])
def test_dkv_chunks_in_key_order_match_reference(name, monkeypatch):
    """Where q and dO fit in L2 a few times over, the chunks launch in key order."""
    monkeypatch.setattr(selection_inverse, "orders_chunks", lambda *_: False)
    check_against_reference(CASES[name], monkeypatch=monkeypatch)


def test_kernels_match_cpu_fallback(monkeypatch):
    """The PyTorch fallback (CPU without the interpreter) has the kernels' semantics."""
    case = Case(hq=2, hk=1, n=20, d=16, num_slots=2, window=5)
    q, k, v, indices, fmask, sel_scale = make_inputs(case, seed=7)
    args = (q, k, v, case.block_size, indices, fmask, sel_scale)
    kwargs = dict(return_sliding_window_out=True, sliding_window_size=5, return_lse=True)
    kernel_outputs = native_sparse_attend(*args, **kwargs)
    monkeypatch.setattr("native_sparse_attention.attend._use_kernels", lambda q: False)
    fallback_outputs = native_sparse_attend(*args, **kwargs)
    tol = tolerance(case.dtype)
    for name, actual, expected in zip(("out", "sliding_out", "lse"), kernel_outputs, fallback_outputs):
        assert expected.dtype == actual.dtype, name
        torch.testing.assert_close(actual, expected, atol=tol, rtol=tol)


# --- packed documents: the window keeps to each query's document -------------------------


def document_ids(n: int, *starts: tuple[int, ...]) -> torch.Tensor:
    """[len(starts), n]: the documents of row r start at ``starts[r]`` (the first at 0)."""
    ids = torch.zeros(len(starts), n, dtype=torch.long)
    for row, row_starts in enumerate(starts):
        for start in row_starts[1:]:
            ids[row, start:] += 1
    return ids


SMALL_WINDOW_TILES = (("window_rows", 16), ("window_n", 16), ("window_dq_rows", 16), ("window_dq_n", 16),
                      ("window_block_n", 16), ("window_block_m", 16))

# case, the documents' starts in each row (multiples of the block size, as the layer has them)
DOCUMENT_CASES = {
    # Window tiles of 4 positions x 4 rows (group 3 padded) over 16-key steps: each tile
    # inside one document, its walk starting at the document's first key tile; documents of
    # 4 to 48 tokens, several shorter than the window, other boundaries in the second row.
    "group3_d48_small_tiles": (Case(b=2, hq=6, hk=2, n=84, d=48, num_slots=2, window=24, launch=SMALL_WINDOW_TILES),
                               ((0, 32, 48, 80), (0, 16, 64))),
    # Tiles across documents: window tiles of 32 positions, forward steps of 64 keys (some
    # documents start inside one), dK / dV tiles of 32 keys from two documents, a window
    # longer than most documents.
    "group2_straddling_tiles": (Case(b=2, hq=4, hk=2, n=100, d=32, num_slots=2, window=40,
                                     launch=(("window_rows", 64), ("window_n", 64), ("window_dq_rows", 64),
                                             ("window_dq_n", 32), ("window_block_n", 32), ("window_block_m", 16))),
                                ((0, 16, 48, 64, 96), (0, 80))),
    # The 2-byte defaults: window tiles of 8 positions x 16 heads, in a launch of their own.
    "group16_fp16_defaults": (Case(hq=16, hk=1, n=80, d=16, num_slots=2, window=20, dtype=torch.float16),
                              ((0, 16, 32, 64),)),
    # The window's tiles after a key-major forward; dQ from the dK / dV pass.
    "key_major_atomic_dq": (Case(hq=2, hk=1, n=64, d=16, num_slots=2, window=24, sel_scale=False,
                                 launch=(("key_major_forward", True), ("atomic_dq", True))), ((0, 32, 48),)),
}


@pytest.mark.parametrize("case, starts", DOCUMENT_CASES.values(), ids=DOCUMENT_CASES.keys())
def test_documents_match_reference(case, starts, monkeypatch):
    """The window keeps to each query's document in the forward and the gradients; the
    selection, whose blocks a document-aware selection would pick, is left as it is."""
    check_against_reference(case, seed=12, monkeypatch=monkeypatch, document_ids=document_ids(case.n, *starts))


def test_documents_window_lse_and_gated_sum(monkeypatch):
    """The window's LSE keeps to the documents too, and the gated sum that the window's
    launch writes takes the window's masked output and the other branches as they are."""
    monkeypatch.setattr(selection_kernels, "default_launch_config",
                        lambda *_, **__: LaunchConfig(window_fwd_warps=4, window_rows=32, window_n=32))
    case = Case(b=2, hq=4, hk=2, n=64, d=16, num_slots=2, window=24)
    q, k, v, indices, fmask, _ = (t.detach() for t in make_inputs(replace(case, sel_scale=True), seed=13))
    documents = document_bounds(document_ids(case.n, (0, 16, 48), (0, 32)).to(DEVICE))
    gen = torch.Generator().manual_seed(14)
    gates = torch.rand(3, case.b, case.hq, case.n, generator=gen).to(DEVICE)
    out_c = torch.randn(q.shape, generator=gen).to(DEVICE)
    out, _, swa_out, swa_lse, merged, _ = selection_kernels._launch_forward(
        q, k, v, indices, fmask, None, case.block_size, True, case.window, case.d ** -0.5, 0, gates, out_c, False,
        *documents,
    )
    ref, ref_lse = sliding_window_attend(q.double(), k.double(), v.double(), case.window, document_start=documents[0])
    tol = tolerance(case.dtype)
    assert_close_scaled(swa_out, ref, tol, "sliding_out")
    torch.testing.assert_close(swa_lse.double(), ref_lse, atol=tol * 10, rtol=tol)
    expected = gates[0, ..., None] * out_c + gates[1, ..., None] * out + gates[2, ..., None] * swa_out
    torch.testing.assert_close(merged, expected.transpose(1, 2).flatten(2), atol=1e-6, rtol=1e-6)


def test_one_document_is_no_documents_bit_for_bit(monkeypatch):
    """A document spanning each row masks nothing: the same outputs and gradients, bit for
    bit, as the call without documents (whose kernels are the ones from before documents)."""
    monkeypatch.setattr(selection_kernels, "default_launch_config",
                        lambda *_, **__: LaunchConfig(**dict(SMALL_WINDOW_TILES)))
    case = Case(hq=4, hk=2, n=64, d=16, num_slots=2, window=24)
    q, k, v, indices, fmask, sel_scale = make_inputs(case, seed=15)
    args = (q, k, v, case.block_size, indices, fmask, sel_scale, True, case.window, case.d ** -0.5)
    one_document = document_bounds(torch.zeros(case.b, case.n, dtype=torch.long, device=DEVICE))
    gen = torch.Generator().manual_seed(16)
    d_out, d_sliding = (torch.randn(q.shape, generator=gen).to(DEVICE) for _ in range(2))
    results = []
    for documents in ((), (0, *one_document)):
        out, sliding, lse = selection_kernels.selection_attention(*args, *documents)
        grads = torch.autograd.grad((out * d_out).sum() + (sliding * d_sliding).sum(), (q, k, v, sel_scale))
        results.append((out, sliding, lse, *grads))
    for name, without, with_one in zip(("out", "sliding_out", "lse", "dq", "dk", "dv", "dsel_scale"), *results):
        assert torch.equal(without, with_one), name


# --- input validation --------------------------------------------------------------------


def _valid_arguments():
    q, k, v = torch.zeros(1, 4, 32, 16), torch.zeros(1, 2, 32, 16), torch.zeros(1, 2, 32, 16)
    indices = torch.zeros(1, 2, 32, 2, dtype=torch.long)
    return dict(q=q, k=k, v=v, block_size=16, selected_block_indices=indices,
                fmask=torch.ones(1, 2, 32, 2, dtype=torch.bool), sel_scale=torch.ones(1, 2, 32, 2))


INVALID = {
    "q_not_tensor": (dict(q=[[0.0]]), TypeError, "q"),
    "q_3d": (dict(q=torch.zeros(4, 32, 16)), ValueError, "q"),
    "q_float64": (dict(q=torch.zeros(1, 4, 32, 16, dtype=torch.float64)), ValueError, "q"),
    "k_dtype": (dict(k=torch.zeros(1, 2, 32, 16, dtype=torch.float16)), ValueError, "k"),
    "k_length": (dict(k=torch.zeros(1, 2, 31, 16)), ValueError, "k"),
    "v_shape": (dict(v=torch.zeros(1, 2, 32, 8)), ValueError, "v"),
    "heads_not_multiple": (dict(k=torch.zeros(1, 3, 32, 16), v=torch.zeros(1, 3, 32, 16)), ValueError, "heads"),
    "group_17": (dict(q=torch.zeros(1, 17, 32, 16), k=torch.zeros(1, 1, 32, 16), v=torch.zeros(1, 1, 32, 16),
                      selected_block_indices=torch.zeros(1, 1, 32, 2, dtype=torch.long),
                      fmask=torch.ones(1, 1, 32, 2, dtype=torch.bool), sel_scale=None), ValueError, "query heads"),
    "head_dim_160": (dict(q=torch.zeros(1, 4, 32, 160), k=torch.zeros(1, 2, 32, 160), v=torch.zeros(1, 2, 32, 160)),
                     ValueError, "head dim"),
    "block_size_24": (dict(block_size=24), ValueError, "block_size"),
    "block_size_256": (dict(block_size=256), ValueError, "block_size"),
    "block_size_float": (dict(block_size=16.0), TypeError, "block_size"),
    "indices_heads": (dict(selected_block_indices=torch.zeros(1, 3, 32, 2, dtype=torch.long)), ValueError,
                      "selected_block_indices"),
    "indices_too_many_slots": (dict(selected_block_indices=torch.zeros(1, 2, 32, 2**16 - 1, dtype=torch.long),
                                    fmask=torch.ones(1, 2, 32, 2**16 - 1, dtype=torch.bool), sel_scale=None),
                               ValueError, "selected_block_indices"),
    "indices_float": (dict(selected_block_indices=torch.zeros(1, 2, 32, 2)), ValueError, "selected_block_indices"),
    "fmask_not_bool": (dict(fmask=torch.ones(1, 2, 32, 2)), ValueError, "fmask"),
    "fmask_shape": (dict(fmask=torch.ones(1, 2, 32, 3, dtype=torch.bool)), ValueError, "fmask"),
    "sel_scale_shape": (dict(sel_scale=torch.ones(1, 2, 32, 1)), ValueError, "sel_scale"),
    "sel_scale_integer": (dict(sel_scale=torch.ones(1, 2, 32, 2, dtype=torch.long)), ValueError, "sel_scale"),
    "sel_scale_device": (dict(sel_scale=torch.ones(1, 2, 32, 2, device="meta")), ValueError, "sel_scale"),
    "window_negative": (dict(return_sliding_window_out=True, sliding_window_size=-1), ValueError,
                        "sliding_window_size"),
    "window_float": (dict(return_sliding_window_out=True, sliding_window_size=4.0), TypeError,
                     "sliding_window_size"),
    "scale_infinite": (dict(scale=float("inf")), ValueError, "scale"),
    "scale_string": (dict(scale="0.1"), TypeError, "scale"),
    "causal_not_bool": (dict(include_block_causal=1), TypeError, "include_block_causal"),
    "return_lse_not_bool": (dict(return_lse=None), TypeError, "return_lse"),
    "q_offset_negative": (dict(q_offset=-1), ValueError, "q_offset"),
    "q_offset_float": (dict(q_offset=1.0), TypeError, "q_offset"),
    "q_offset_beyond_keys": (dict(q_offset=1), ValueError, "k must be"),
}


@pytest.mark.parametrize("change, error, name", INVALID.values(), ids=INVALID.keys())
def test_invalid_arguments_raise_before_launch(change, error, name, monkeypatch):
    def no_launch(*args, **kwargs):
        raise AssertionError("launched before validation")

    monkeypatch.setattr(selection_kernels, "selection_attention", no_launch)
    kwargs = _valid_arguments()
    kwargs.update(change)
    with pytest.raises(error, match=name):
        native_sparse_attend(**kwargs)


# --- GPU (compiled kernels at realistic sizes) -------------------------------------------------


GPU_CASES = {
    "shared_group4_d64_sliding_bf16": Case(hq=16, hk=4, n=4096, d=64, block_size=64, num_slots=16, window=256,
                                           dtype=torch.bfloat16),
    "per_head_group3_d48_non_causal_fp16": Case(b=2, hq=6, hk=2, n=4100, d=48, block_size=32, num_slots=8,
                                                per_query_head=True, causal=False, window=100,
                                                dtype=torch.float16),
    "group16_d128_block128_bf16": Case(hq=16, hk=1, n=4096, d=128, block_size=128, num_slots=8,
                                       dtype=torch.bfloat16),
    "group1_d96_fp16_int32": Case(hq=4, hk=4, n=4099, d=96, block_size=16, num_slots=12, sel_scale=False,
                                  index_dtype=torch.int32, dtype=torch.float16, heads_last=True),
    # float32 at the largest head dim: the most shared memory per pipeline stage.
    "group8_d128_sliding_fp32": Case(hq=8, hk=1, n=2048, d=128, block_size=64, num_slots=8, window=128),
    # The layer benchmark's heads: two entries of 16 rows per dK / dV step.
    "group16_d64_sliding_fp16": Case(hq=32, hk=2, n=4096, d=64, block_size=64, num_slots=16, window=512,
                                     dtype=torch.float16),
    # Groups of at most 8 without sel_scale: the dK / dV pass adds dQ (the default there).
    "atomic_dq_group4_d128_sliding_bf16": Case(hq=16, hk=4, n=4096, d=128, block_size=64, num_slots=16,
                                               window=512, sel_scale=False, dtype=torch.bfloat16),
    "atomic_dq_group8_d64_fp16_strided": Case(b=2, hq=16, hk=2, n=4100, d=64, block_size=64, num_slots=16,
                                              sel_scale=False, dtype=torch.float16, heads_last=True),
}


@gpu
@pytest.mark.parametrize("case", GPU_CASES.values(), ids=GPU_CASES.keys())
def test_gpu_long_sequences(case):
    check_against_reference(case, seed=11)


# case, the documents' starts in each row
GPU_DOCUMENT_CASES = {
    # Groups of 4: the key-major forward and dQ from the dK / dV pass (the defaults there).
    "group4_d64_bf16": (Case(b=2, hq=16, hk=4, n=4096, d=64, block_size=64, num_slots=16, window=512,
                             sel_scale=False, dtype=torch.bfloat16),
                        ((0, 64, 640, 1024, 2048, 2112, 2944), (0, 1536, 4032))),
    # Groups of 16: the query-side forward, the window in a launch of its own, the dQ pass.
    "group16_d64_fp16": (Case(hq=32, hk=2, n=4100, d=64, block_size=64, num_slots=16, window=512,
                              dtype=torch.float16), ((0, 128, 192, 1280, 3968, 4032),)),
    # d = 128: the window tiles in the selection's launch.
    "group8_d128_bf16": (Case(hq=8, hk=1, n=4096, d=128, block_size=64, num_slots=8, window=256,
                              dtype=torch.bfloat16), ((0, 320, 384, 2560),)),
}


@gpu
@pytest.mark.parametrize("case, starts", GPU_DOCUMENT_CASES.values(), ids=GPU_DOCUMENT_CASES.keys())
def test_gpu_documents(case, starts):
    check_against_reference(case, seed=11, document_ids=document_ids(case.n, *starts))


def _key_major_forward(monkeypatch, key_major: bool):
    """Keeps the tuned defaults but runs every training forward key-major or query-side."""
    tuned = selection_kernels.default_launch_config
    monkeypatch.setattr(selection_kernels, "default_launch_config",
                        lambda *args, **kwargs: replace(tuned(*args, **kwargs), key_major_forward=key_major))


# The tuned 2-byte defaults take the key-major forward only for groups of at most 4 from
# KEY_MAJOR_FORWARD_MIN_QUERIES queries on; these cases force it whatever their group and length.
KEY_MAJOR_GPU_CASES = ("shared_group4_d64_sliding_bf16", "per_head_group3_d48_non_causal_fp16",
                       "group1_d96_fp16_int32", "atomic_dq_group4_d128_sliding_bf16")


@gpu
@pytest.mark.parametrize("name", KEY_MAJOR_GPU_CASES)
def test_gpu_key_major_forward(name, monkeypatch):
    _key_major_forward(monkeypatch, True)
    check_against_reference(GPU_CASES[name], seed=11)


@gpu
@pytest.mark.parametrize("with_sel_scale", [True, False], ids=["query_major", "key_major"])
@pytest.mark.usefixtures("large_gpu_memory")
def test_gpu_int64_offsets(with_sel_scale, monkeypatch):
    """b * hq * n * d > 2**31: every kernel must address past the int32 range. With
    sel_scale, the query-side forward and the dQ pass; without, the key-major forward and
    dQ from the dK / dV pass (the group of 4's default), both into float32 buffers."""
    _key_major_forward(monkeypatch, not with_sel_scale)
    case = Case(b=4100, hq=8, hk=2, n=1024, d=64, block_size=64, num_slots=4, window=64, dtype=torch.bfloat16,
                sel_scale=with_sel_scale)
    assert case.b * case.hq * case.n * case.d > 2**31
    q, k, v, indices, fmask, sel_scale = make_inputs(replace(case, b=1), seed=3)
    expand = lambda t: t.detach().expand(case.b, *t.shape[1:]).contiguous()  # noqa: E731
    q, k, v = (expand(t).requires_grad_() for t in (q, k, v))
    if sel_scale is not None:
        sel_scale = expand(sel_scale).requires_grad_()
    indices, fmask = expand(indices), expand(fmask)
    # Only the last batch element gets gradient: its rows sit past 2**31 elements.
    d_out = torch.zeros_like(q)
    d_out[-1].normal_()
    d_sliding = torch.zeros_like(q)
    d_sliding[-1].normal_()
    out, sliding, lse = run_kernels(case, q, k, v, indices, fmask, sel_scale)
    ((out * d_out).sum() + (sliding * d_sliding).sum()).backward()
    last = slice(case.b - 1, case.b)
    one = replace(case, b=1)
    ref_out, ref_sliding, ref_lse, ref_grads = reference(
        one, q[last], k[last], v[last], indices[last], fmask[last], None if sel_scale is None else sel_scale[last],
        d_out[last], d_sliding[last],
    )
    tol = tolerance(case.dtype)
    assert_close_scaled(out[last], ref_out, tol, "out")
    assert_close_scaled(sliding[last], ref_sliding, tol, "sliding_out")
    torch.testing.assert_close(lse[last].double(), ref_lse, atol=tol, rtol=tol)
    grads = (q.grad, k.grad, v.grad, None if sel_scale is None else sel_scale.grad)
    for name, grad, ref_grad in zip(("dq", "dk", "dv", "dsel_scale"), grads, ref_grads):
        if ref_grad is None:
            continue
        assert_close_scaled(grad[last], ref_grad, tol, name)
