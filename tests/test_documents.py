"""Packed sequences: ``SparseAttention(x, document_ids=...)`` attends each document as if
it ran alone, and the packing helpers."""

import copy
import os

import pytest
import torch

from native_sparse_attention import SparseAttention
from native_sparse_attention.documents import document_bounds, pack_documents
from native_sparse_attention.reference import compressed_attend, sliding_window_attend
from native_sparse_attention.selection import num_compressed_blocks, selectable_blocks

DIM, DIM_HEAD, HEADS = 32, 8, 4


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def make_layer(**kwargs) -> SparseAttention:
    options = dict(dim=DIM, dim_head=DIM_HEAD, heads=HEADS, kv_heads=2, sliding_window_size=5, compress_block_size=8,
                   compress_block_sliding_stride=4, selection_block_size=8, num_selected_blocks=2, causal=True,
                   num_compressed_mem_kv=1)
    options.update(kwargs)
    return SparseAttention(**options)


def ids_of(lengths_per_row: list[list[int]]) -> torch.Tensor:
    """document_ids [b, n] with the given document lengths per row (same total per row)."""
    rows = [torch.cat([torch.full((length,), number) for number, length in enumerate(lengths)])
            for lengths in lengths_per_row]
    return torch.stack(rows)


def test_document_bounds():
    ids = torch.tensor([[3, 3, 3, 7, 7, 3, 3, 3], [1, 1, 1, 1, 1, 1, 1, 1]])
    start, end = document_bounds(ids)
    assert start.dtype == end.dtype == torch.int32 and start.is_contiguous() and end.is_contiguous()
    assert start.tolist() == [[0, 0, 0, 3, 3, 5, 5, 5], [0] * 8]
    assert end.tolist() == [[3, 3, 3, 5, 5, 8, 8, 8], [8] * 8]


@pytest.mark.parametrize("share", [True, False])
@pytest.mark.parametrize("use_diff_topk", [False, True])
def test_packed_documents_attend_as_if_alone(share, use_diff_topk):
    """Each document's outputs and input gradients equal those of the document run alone,
    and the layer's parameters get the sum of the documents' gradients."""
    layer = make_layer(query_heads_share_selected_kv=share, use_diff_topk=use_diff_topk).double()
    lengths = [[24, 8, 40], [72]]  # one document of one block, one longer than the window ranges
    ids = ids_of(lengths)
    x = torch.randn(2, 72, DIM, dtype=torch.float64, requires_grad=True)
    out = layer(x, document_ids=ids)
    weights = torch.randn_like(out)
    (out * weights).sum().backward()
    packed_grads = {name: p.grad.clone() for name, p in layer.named_parameters()}
    layer.zero_grad()

    for row, row_lengths in enumerate(lengths):
        start = 0
        for length in row_lengths:
            alone_x = x.detach()[row:row + 1, start:start + length].clone().requires_grad_()
            alone = layer(alone_x)
            torch.testing.assert_close(out[row:row + 1, start:start + length], alone, rtol=1e-9, atol=1e-9)
            (alone * weights[row:row + 1, start:start + length]).sum().backward()
            torch.testing.assert_close(x.grad[row:row + 1, start:start + length], alone_x.grad, rtol=1e-9, atol=1e-9)
            start += length
    for name, p in layer.named_parameters():
        torch.testing.assert_close(packed_grads[name], p.grad, rtol=1e-8, atol=1e-10, msg=name)


def test_reference_branches_mask_other_documents():
    """No branch's output moves when another document's tokens change."""
    b, hq, hk, n, d = 1, 4, 2, 48, 8
    ids = ids_of([[16, 32]])
    start, _ = document_bounds(ids)
    q, k, v = (torch.randn(b, h, n, d, dtype=torch.float64) for h in (hq, hk, hk))
    k2, v2 = k.clone(), v.clone()
    k2[:, :, :16], v2[:, :, :16] = torch.randn(2, b, hk, 16, d, dtype=torch.float64)
    window = sliding_window_attend(q, k, v, 20, document_start=start)[0]
    window2 = sliding_window_attend(q, k2, v2, 20, document_start=start)[0]
    assert (window[:, :, 16:] == window2[:, :, 16:]).all()
    assert not torch.allclose(window[:, :, :16], window2[:, :, :16])

    cbs, stride = 8, 4
    nc = num_compressed_blocks(n, cbs, stride)
    ck, cv = (torch.randn(b, hk, 1 + nc, d, dtype=torch.float64) for _ in range(2))
    ck2, cv2 = ck.clone(), cv.clone()
    first_of_second = 16 // stride  # compressed keys from the second document's first token on
    ck2[:, :, 1:1 + first_of_second], cv2[:, :, 1:1 + first_of_second] = torch.randn(
        2, b, hk, first_of_second, d, dtype=torch.float64)
    out, _, probs = compressed_attend(q, ck, cv, cbs, stride, num_mem=1, return_probs=True, document_start=start)
    out2, _ = compressed_attend(q, ck2, cv2, cbs, stride, num_mem=1, document_start=start)
    assert (out[:, :, 16:] == out2[:, :, 16:]).all()
    assert (probs[:, :, 16:, 1:1 + first_of_second] == 0).all()
    assert (probs[:, :, 16:, 0] > 0).all()  # the memory key stays visible

    selectable = selectable_blocks(n, 0, nc, cbs, stride, 8, 6, True, document_start=start)
    assert selectable.shape == (1, 1, n, 6)
    assert not selectable[0, 0, 16:, :2].any()
    assert selectable[0, 0, 47, 2:5].all()


def test_pack_documents():
    documents = [torch.arange(1, 6), torch.arange(10, 13), torch.arange(20, 31), torch.arange(40, 42)]
    packed = pack_documents(documents, seq_len=12, alignment=4, pad_id=-1)
    assert packed.tokens.tolist() == [
        [1, 2, 3, 4, 5, -1, -1, -1, 10, 11, 12, -1],
        [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, -1],
        [40, 41, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1],
    ]
    assert packed.document_ids.tolist() == [[0] * 8 + [1] * 4, [0] * 12, [0] * 12]
    assert packed.is_token.tolist() == [[t != -1 for t in row] for row in packed.tokens.tolist()]
    long = pack_documents([torch.arange(30)], seq_len=12, alignment=4)
    assert long.tokens[:, :].flatten()[:30].tolist() == list(range(30))
    assert long.is_token.sum() == 30


@pytest.mark.parametrize("document_ids, error, message", [
    ([[0] * 16], TypeError, "document_ids must be a tensor"),
    (torch.zeros(1, 16), TypeError, "integers"),
    (torch.zeros(2, 16, dtype=torch.long), ValueError, r"shape \[batch, seq_len\]"),
    (ids_of([[4, 12]]), ValueError, "starts at position 4 of row 0"),
])
def test_bad_document_ids_are_rejected(document_ids, error, message):
    layer = make_layer()
    with pytest.raises(error, match=message):
        layer(torch.randn(1, 16, DIM), document_ids=document_ids)


def test_documents_need_a_causal_layer_without_cache():
    ids = ids_of([[8, 8]])
    with pytest.raises(ValueError, match="causal"):
        make_layer(causal=False)(torch.randn(1, 16, DIM), document_ids=ids)
    layer = make_layer()
    with pytest.raises(ValueError, match="cannot be combined with a cache"):
        layer(torch.randn(1, 16, DIM), document_ids=ids, return_cache=True)
    _, cache = layer(torch.randn(1, 16, DIM), return_cache=True)
    with pytest.raises(ValueError, match="cannot be combined with a cache"):
        layer(torch.randn(1, 16, DIM), cache=cache, document_ids=ids)


@pytest.mark.parametrize("use_sparse_attn, activation_checkpointing", [(True, False), (False, False), (True, True)])
def test_packed_language_model_loss_is_the_documents_loss(use_sparse_attn, activation_checkpointing):
    """A packed batch's loss is the mean over the documents' own next-token targets: padding
    and each document's first token are no targets, and no layer looks across documents."""
    from native_sparse_attention import Transformer

    kwargs = dict(sliding_window_size=5, compress_block_size=8, compress_block_sliding_stride=4,
                  selection_block_size=8, num_selected_blocks=2)
    model = Transformer(num_tokens=50, dim=DIM, depth=2, heads=HEADS, dim_head=DIM_HEAD, kv_heads=2,
                        use_sparse_attn=use_sparse_attn, sparse_attn_kwargs=kwargs,
                        activation_checkpointing=activation_checkpointing).double()
    documents = [torch.randint(0, 50, (length,)) for length in (16, 13, 24, 9)]
    packed = pack_documents(documents, seq_len=40, alignment=8)
    loss = model(packed.tokens, return_loss=True, document_ids=packed.document_ids, loss_mask=packed.is_token)
    alone = [model(document[None], return_loss=True) for document in documents]
    targets = torch.tensor([len(document) - 1 for document in documents], dtype=torch.float64)
    torch.testing.assert_close(loss, (torch.stack(alone) * targets).sum() / targets.sum())
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_language_model_rejects_bad_document_arguments():
    from native_sparse_attention import Transformer

    model = Transformer(num_tokens=50, dim=DIM, depth=1, heads=HEADS, dim_head=DIM_HEAD, use_sparse_attn=False)
    ids = torch.randint(0, 50, (1, 16))
    with pytest.raises(ValueError, match="document_ids must be a tensor of the shape of ids"):
        model(ids, return_loss=True, document_ids=ids_of([[8, 7]]))
    with pytest.raises(ValueError, match="loss_mask needs return_loss"):
        model(ids, loss_mask=torch.ones(1, 16, dtype=torch.bool))
    with pytest.raises(ValueError, match="cannot be combined with caches"):
        model(ids, return_caches=True, document_ids=ids_of([[8, 8]]))


def test_inference_mode_ids_are_checked_at_every_call():
    layer = make_layer()
    x = torch.randn(1, 16, DIM)
    with torch.inference_mode():
        ids = ids_of([[8, 8]])
        torch.testing.assert_close(layer(x, document_ids=ids), layer(x, document_ids=ids.clone()))
        ids[0, 8:12] = 0
        with pytest.raises(ValueError, match="starts at position 12"):
            layer(x, document_ids=ids)


def test_checked_ids_are_checked_again_after_a_change():
    layer = make_layer()
    x = torch.randn(1, 16, DIM)
    ids = ids_of([[8, 8]])
    layer(x, document_ids=ids)
    ids[0, 8:12] = 0  # the second document now starts at 12
    with pytest.raises(ValueError, match="starts at position 12"):
        layer(x, document_ids=ids)


def _packed_and_alone_runs(layer, x, grad_out, lengths, autocast=False):
    """(out, dx) of ``layer`` on the packed row ``x: [1, n, dim]`` with documents of
    ``lengths``, and the same of each document run alone, concatenated."""
    def run(inputs, gradient, **kwargs):
        inputs = inputs.detach().clone().requires_grad_()
        with torch.autocast(inputs.device.type, dtype=torch.bfloat16, enabled=autocast):
            out = layer(inputs, **kwargs)
        out.backward(gradient)
        return out.detach().float(), inputs.grad.float()

    packed = run(x, grad_out, document_ids=ids_of([lengths]).to(x.device))
    alone, start = [], 0
    for length in lengths:
        alone.append(run(x[:, start:start + length], grad_out[:, start:start + length]))
        start += length
    return packed, tuple(torch.cat(parts, dim=1) for parts in zip(*alone))


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).norm() / expected.float().norm()).item()


INTERPRETED = not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") == "1"
SMALL_CONFIG = dict(dim=32, dim_head=16, heads=2, kv_heads=1, sliding_window_size=8, compress_block_size=8,
                    compress_block_sliding_stride=4, selection_block_size=16, num_selected_blocks=2,
                    num_compressed_mem_kv=1, causal=True)


@pytest.mark.skipif(not INTERPRETED, reason="interpreter only")
@pytest.mark.parametrize("share, use_diff_topk", [(True, False), (False, False), (True, True)])
def test_triton_path_with_documents_matches_pytorch_path_interpreted(monkeypatch, share, use_diff_topk):
    """The layer's Triton path (kernels under the interpreter) with packed documents
    against its PyTorch path with them, and each document against itself alone."""
    torch.manual_seed(1)
    options = dict(SMALL_CONFIG, query_heads_share_selected_kv=share, use_diff_topk=use_diff_topk)
    fast = SparseAttention(**options, use_triton_kernel=True)
    with torch.no_grad():
        fast.to_qkv.weight.mul_(4.0)  # sharper compressed attention: no near-ties in the selection
    reference = SparseAttention(**options)
    reference.load_state_dict(fast.state_dict())
    monkeypatch.setattr(SparseAttention, "_use_fast_path", lambda self, x: self.use_triton_kernel)
    lengths = [16, 48, 32]
    x = torch.randn(1, sum(lengths), SMALL_CONFIG["dim"])
    grad_out = torch.randn_like(x)
    (out, dx), (alone_out, alone_dx) = _packed_and_alone_runs(fast, x, grad_out, lengths)
    (ref_out, ref_dx), _ = _packed_and_alone_runs(reference, x, grad_out, lengths)
    assert _relative_error(out, ref_out) < 1e-5 and _relative_error(dx, ref_dx) < 1e-5
    assert _relative_error(out, alone_out) < 1e-5 and _relative_error(dx, alone_dx) < 1e-5

    # Rows of a batch with documents of their own.
    ids = ids_of([[16, 48, 32], [64, 32]])
    x = torch.randn(2, 96, SMALL_CONFIG["dim"])
    outputs = [layer(x, document_ids=ids) for layer in (fast, reference)]
    assert _relative_error(*outputs) < 1e-5


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
GPU_CONFIG = dict(dim=512, dim_head=64, heads=16, kv_heads=1, sliding_window_size=512, compress_block_size=32,
                  compress_block_sliding_stride=16, selection_block_size=64, num_selected_blocks=16, causal=True)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("share", [True, False])
def test_triton_path_with_documents_matches_documents_alone(share):
    """bf16 at 16384 packed tokens: documents shorter and longer than the window, one of a
    single selection block, against each document run alone."""
    torch.manual_seed(0)
    layer = SparseAttention(**GPU_CONFIG, query_heads_share_selected_kv=share, use_triton_kernel=True).cuda()
    lengths = [4096, 64, 640, 8192, 3456]
    x = torch.randn(1, sum(lengths), GPU_CONFIG["dim"], device="cuda")
    grad_out = torch.randn_like(x)
    (out, dx), (alone_out, alone_dx) = _packed_and_alone_runs(layer, x, grad_out, lengths, autocast=True)
    assert _relative_error(out, alone_out) < 1e-2
    assert _relative_error(dx, alone_dx) < 2e-2


@pytest.mark.gpu
@requires_cuda
def test_flex_path_with_documents_matches_triton_path():
    """The FlexAttention path packed against the Triton path packed (each run alone would
    compile FlexAttention anew for every length)."""
    torch.manual_seed(0)
    flex = SparseAttention(**GPU_CONFIG, use_flex_attention=True).cuda()
    triton_layer = SparseAttention(**GPU_CONFIG, use_triton_kernel=True).cuda()
    triton_layer.load_state_dict(flex.state_dict())
    ids = ids_of([[4096, 64, 640, 8192, 3456]]).cuda()
    x = torch.randn(1, 16448, GPU_CONFIG["dim"], device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        assert _relative_error(flex(x, document_ids=ids), triton_layer(x, document_ids=ids)) < 1e-2


@pytest.mark.gpu
@requires_cuda
def test_fast_path_with_documents_matches_pytorch_path():
    """float32 (no TF32) at 2048 tokens: the Triton path with documents against the PyTorch path."""
    torch.manual_seed(0)
    fast = SparseAttention(**dict(GPU_CONFIG, heads=4, sliding_window_size=128), use_triton_kernel=True).cuda()
    reference = SparseAttention(**dict(GPU_CONFIG, heads=4, sliding_window_size=128)).cuda()
    reference.load_state_dict(fast.state_dict())
    lengths = [640, 64, 1344]
    x = torch.randn(1, sum(lengths), GPU_CONFIG["dim"], device="cuda")
    grad_out = torch.randn_like(x)
    (out, dx), _ = _packed_and_alone_runs(fast, x, grad_out, lengths)
    (ref_out, ref_dx), _ = _packed_and_alone_runs(reference, x, grad_out, lengths)
    assert _relative_error(out, ref_out) < 1e-5 and _relative_error(dx, ref_dx) < 1e-5


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_compiled_layer_with_documents_matches_eager(mode):
    torch.manual_seed(0)
    layer = SparseAttention(**GPU_CONFIG, use_triton_kernel=True).cuda()
    compiled = copy.deepcopy(layer)
    compiled.compile(fullgraph=True, mode=mode)
    ids = ids_of([[1024, 3072], [2048, 2048]]).cuda()
    x = torch.randn(2, 4096, GPU_CONFIG["dim"], device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        expected = layer(x, document_ids=ids)
        for _ in range(3):
            torch.compiler.cudagraph_mark_step_begin()
            out = compiled(x, document_ids=ids)
    assert _relative_error(out, expected) < 1e-2


@pytest.mark.gpu
@requires_cuda
def test_dense_layer_with_documents_matches_documents_alone():
    from native_sparse_attention import FullAttention

    torch.manual_seed(0)
    layer = FullAttention(dim=512, dim_head=64, heads=8, kv_heads=2).cuda()
    lengths = [1000, 24, 3072]
    x = torch.randn(1, sum(lengths), 512, device="cuda")
    grad_out = torch.randn_like(x)
    (out, dx), (alone_out, alone_dx) = _packed_and_alone_runs(layer, x, grad_out, lengths, autocast=True)
    assert _relative_error(out, alone_out) < 1e-2 and _relative_error(dx, alone_dx) < 2e-2


@pytest.mark.skipif(not INTERPRETED, reason="interpreter only")
def test_layer_with_documents_compiles_to_one_graph(monkeypatch):
    """fullgraph=True through the kernels' custom operators with the documents' bounds,
    which the compiled graph computes itself (its alignment check is skipped)."""
    torch.manual_seed(0)
    layer = SparseAttention(**SMALL_CONFIG, use_triton_kernel=True)
    monkeypatch.setattr(SparseAttention, "_use_fast_path", lambda self, x: self.use_triton_kernel)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    ids = ids_of([[16, 32, 16]])
    x = torch.randn(1, 64, SMALL_CONFIG["dim"])
    runs = []
    for module in (layer, compiled):
        x_in = x.clone().requires_grad_()
        out = module(x_in, document_ids=ids)
        out.square().sum().backward()
        runs.append((out, x_in.grad))
    for eager, compiled_result in zip(*runs):
        torch.testing.assert_close(compiled_result, eager, rtol=1e-5, atol=1e-6)
