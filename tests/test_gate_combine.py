"""The fused gate combination against its eager formula (float64), forward and gradients,
and the gated branches (one autograd node, the gates folded into the branches' backward)
against the PyTorch references of the three branches.

Without CUDA the kernels run under the Triton interpreter (set up in conftest.py)."""


import pytest
import torch
from einops import rearrange

from native_sparse_attention.kernels import compressed as compressed_kernels
from native_sparse_attention.kernels import gate_combine
from native_sparse_attention.kernels import selection as selection_kernels
from native_sparse_attention.kernels.gate_combine import gated_branches, gated_sum, gated_sum_of_logits
from native_sparse_attention.reference import compressed_attend, selected_attend, sliding_window_attend
from native_sparse_attention.selection import num_compressed_blocks

from kernel_device import DEVICE, skip_without_kernels

skip_without_kernels()


def eager(gates, compressed, selected, sliding):
    mixed = sum(g[..., None] * t for g, t in zip(gates, (compressed, selected, sliding)))
    return rearrange(mixed, "b h n d -> b n (h d)")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("b, h, n, d", [(2, 3, 70, 16), (1, 2, 5, 48)])
def test_matches_eager_formula(b, h, n, d, dtype):
    gen = torch.Generator().manual_seed(n + d)
    # The layer's gates: a [b, n, 3h] projection seen as [3, b, h, n]; the selected
    # branch as a transposed view, to exercise arbitrary strides.
    logits = torch.randn(b, n, h * 3, generator=gen)
    gates = rearrange(logits, "b n (h s) -> s b h n", s=3).sigmoid().to(DEVICE, dtype)
    compressed = torch.randn(b, h, n, d, generator=gen).to(DEVICE, dtype)
    selected = torch.randn(b, n, h, d, generator=gen).to(DEVICE, dtype).transpose(1, 2)
    sliding = torch.randn(b, h, n, d, generator=gen).to(DEVICE, dtype)
    inputs = [t.detach().requires_grad_() for t in (gates, compressed, selected, sliding)]
    out = gated_sum(*inputs)
    dout = torch.randn(out.shape, generator=gen).to(DEVICE, dtype)
    out.backward(dout)

    ref_inputs = [t.detach().double().requires_grad_() for t in inputs]
    ref = eager(*ref_inputs)
    ref.backward(dout.double())
    tol = 1e-6 if dtype == torch.float32 else 2e-3
    assert out.shape == (b, n, h * d) and out.dtype == dtype and out.is_contiguous()
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    for name, t, ref_t in zip(("gates", "compressed", "selected", "sliding"), inputs, ref_inputs):
        assert t.grad.dtype == dtype, name
        torch.testing.assert_close(t.grad.double(), ref_t.grad, atol=tol * 10, rtol=tol, msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gated_sum_of_logits_takes_the_sigmoid_in_the_kernel(poison, dtype):
    """A decoding step's gates from the projection's gate columns, [b, 1, 3h] seen as [3,
    b, h, 1]: the sum of the eager formula over the gates rounded to the logits' dtype."""
    poison(gate_combine)
    gen = torch.Generator().manual_seed(3)
    b, h, d = 3, 4, 24
    logits = rearrange(torch.randn(b, 1, h * 3, generator=gen).to(DEVICE, dtype), "b n (h s) -> s b h n", s=3)
    branches = [torch.randn(b, h, 1, d, generator=gen).to(DEVICE, dtype) for _ in range(3)]
    out = gated_sum_of_logits(logits, *branches)
    want = eager(logits.sigmoid().double(), *(t.double() for t in branches))
    assert out.shape == (b, 1, h * d) and out.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("sliding_in_shares", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gated_sum_of_logits_merges_branches_in_shares(poison, dtype, sliding_in_shares):
    """The selected (and sliding) branch of a decoding step in shares of its keys
    (``selection.PartialOutputs``): merged by their LSEs in the kernel, rows of three, one
    and no shares with keys, then rounded to the branches' dtype and gated as a whole
    branch would be."""
    poison(gate_combine)
    gen = torch.Generator().manual_seed(4)
    b, h, d = 3, 4, 24
    logits = rearrange(torch.randn(b, 1, h * 3, generator=gen).to(DEVICE, dtype), "b n (h s) -> s b h n", s=3)
    compressed, sliding = (torch.randn(b, h, 1, d, generator=gen).to(DEVICE, dtype) for _ in range(2))

    def shares_and_merged(count):
        out = torch.randn(b, h, count, 1, d, generator=gen)
        lse = torch.randn(b, h, count, 1, generator=gen) * 3
        lse[0, :, 3:] = float("-inf")  # shares without keys
        lse[1, 0, 1:] = float("-inf")
        lse[2, 1] = float("-inf")  # no keys at all
        out[lse.isneginf()] = 0.0
        weights = torch.softmax(lse.double(), dim=2).nan_to_num(0.0)
        merged = (weights[..., None] * out.double()).sum(2)
        shares = selection_kernels.PartialOutputs(out.to(DEVICE), lse.to(DEVICE))
        torch.testing.assert_close(shares.merge()[0].double(), merged.to(DEVICE), atol=1e-6, rtol=1e-6)
        assert torch.equal(shares.merge()[1].isneginf().cpu(), lse.isneginf().all(2))
        return shares, merged.to(DEVICE, dtype)

    selected_shares, selected = shares_and_merged(5)
    sliding_branch = sliding
    if sliding_in_shares:
        sliding_branch, sliding = shares_and_merged(4)
    out = gated_sum_of_logits(logits, compressed, selected_shares, sliding_branch)
    want = eager(logits.sigmoid().double(), compressed.double(), selected.double(), sliding.double())
    assert out.shape == (b, 1, h * d) and out.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)


def test_rejects_mismatched_shapes():
    branch = torch.zeros(1, 2, 4, 8, device=DEVICE)
    with pytest.raises(ValueError, match="gates"):
        gated_sum(torch.zeros(3, 1, 2, 5, device=DEVICE), branch, branch, branch)
    with pytest.raises(ValueError, match="sliding"):
        gated_sum(torch.zeros(3, 1, 2, 4, device=DEVICE), branch, branch, branch[..., :4])


@pytest.mark.parametrize("b, h, n", [(2, 3, 1100), (1, 2, 5)])
def test_folded_lses_match_their_expression(poison, b, h, n):
    poison(gate_combine)
    gen = torch.Generator().manual_seed(n)
    # The layer's gates: a view of [b, n, 3h] sigmoids, some exactly 0; LSEs contiguous,
    # tokens-major and -inf (rows without keys).
    gates = rearrange(torch.rand(b, n, h * 3, generator=gen), "b n (h s) -> s b h n", s=3).to(DEVICE)
    gates[:, :, :, ::7] = 0
    lse_c = torch.randn(b, h, n, generator=gen).to(DEVICE)
    lse_s = torch.randn(b, n, h, generator=gen).to(DEVICE).transpose(1, 2)
    lse_w = torch.randn(b, h, n, generator=gen).to(DEVICE)
    lse_w[:, :, ::5] = float("-inf")
    folded = gate_combine._folded_lses(gates, lse_c, lse_s, lse_w)
    want = torch.where(gates > 0, torch.stack((lse_c, lse_s, lse_w)) - gates.log(), float("inf"))
    assert folded.is_contiguous() and folded.dtype == torch.float32
    torch.testing.assert_close(folded, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(folded.isinf(), want.isinf())


# float16 takes the launch configuration whose window tiles run in a launch of their own,
# so that the selection's launch writes the gated sum itself; float32 runs the gated-sum
# kernel after it.
# project: the node also applies an output projection of float32 weights, as the layer's.
@pytest.mark.parametrize("causal, share_selection, num_mem, dtype, project",
                         [(True, True, 0, torch.float32, False), (False, False, 1, torch.float32, True),
                          (True, True, 0, torch.float16, True), (True, False, 1, torch.float16, False)])
def test_gated_branches_match_references(monkeypatch, poison, causal, share_selection, num_mem, dtype, project):
    poison(selection_kernels, "_empty")
    poison(compressed_kernels)
    poison(gate_combine)
    gated_sum_launches = []
    gated_sum_kernel = gate_combine._forward
    monkeypatch.setattr(gate_combine, "_forward", lambda *args: gated_sum_launches.append(1) or gated_sum_kernel(*args))

    b, hq, hk, n, d = 1, 4, 2, 70, 16
    compress_block, stride, block, num_selected, window = 8, 4, 16, 2, 12
    scale = d**-0.5
    gen = torch.Generator().manual_seed(num_mem)
    num_keys = num_mem + num_compressed_blocks(n, compress_block, stride)
    shapes = dict(q=(b, hq, n, d), ck=(b, hk, num_keys, d), cv=(b, hk, num_keys, d), rq=(b, hq, n, d),
                  rk=(b, hk, n, d), v=(b, hk, n, d))
    tensors = {name: torch.randn(shape, generator=gen) for name, shape in shapes.items()}
    # Closed gates, also on rows without compressed keys (causal, no memory: lse = -inf),
    # must neither leak gradient nor turn anything into NaN.
    gates = torch.rand(3, b, hq, n, generator=gen)
    gates[0, :, :, :6] = 0.0
    gates[1, 0, 1, 40:44] = 0.0
    inputs = {"gates": gates, **tensors}
    inputs = {name: t.to(DEVICE, dtype).requires_grad_() for name, t in inputs.items()}
    # The layer's views: gates of a [b, n, 3 * hq] projection, q of its qkv projection.
    gates_view = rearrange(rearrange(inputs["gates"], "s b h n -> b n (h s)").detach(), "b n (h s) -> s b h n", s=3)
    q_view = inputs["q"].detach().transpose(1, 2).contiguous().transpose(1, 2)
    inputs.update(gates=gates_view.requires_grad_(), q=q_view.requires_grad_())
    # Rounded to dtype (as the node computes with it), held in float32.
    weight = (torch.randn(24, hq * d, generator=gen) / d).to(dtype).to(DEVICE, torch.float32).requires_grad_()
    merged, selection = gated_branches(
        *inputs.values(),
        (compress_block, stride, num_mem, causal, scale, block, num_selected, share_selection),
        (block, causal, window, scale),
        out_weight=weight if project else None,
    )
    dmerged = torch.randn(merged.shape, generator=gen).to(DEVICE, dtype)
    merged.backward(dmerged)

    ref = {name: t.detach().double().requires_grad_() for name, t in inputs.items()}
    compressed_out, _ = compressed_attend(ref["q"], ref["ck"], ref["cv"], compress_block, stride, num_mem,
                                          causal=causal, scale=scale)
    selected_out, _ = selected_attend(ref["rq"], ref["rk"], ref["v"], block, selection.indices, selection.mask,
                                      include_block_causal=causal, scale=scale)
    sliding_out, _ = sliding_window_attend(ref["rq"], ref["rk"], ref["v"], window, causal=causal, scale=scale)
    ref_merged = eager(ref["gates"], compressed_out, selected_out, sliding_out)
    ref_weight = weight.detach().double().requires_grad_()
    if project:
        ref_merged = ref_merged @ ref_weight.T
    ref_merged.backward(dmerged.double())

    assert selection.indices.shape == (b, hk if share_selection else hq, n, num_selected)
    assert merged.shape == (b, n, 24 if project else hq * d) and merged.dtype == dtype
    if project:
        assert weight.grad.dtype == torch.float32
        torch.testing.assert_close(weight.grad.double(), ref_weight.grad, atol=10 * (1e-5 if dtype == torch.float32
                                   else 2e-3) * ref_weight.grad.abs().max().item(), rtol=0)
    else:
        assert weight.grad is None
    assert len(gated_sum_launches) == (dtype == torch.float32)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(merged.double(), ref_merged, atol=tol, rtol=tol)
    for name, t in inputs.items():
        assert torch.isfinite(t.grad).all(), name
        scale = ref[name].grad.abs().max().item()
        torch.testing.assert_close(t.grad.double(), ref[name].grad, atol=10 * tol * scale, rtol=10 * tol, msg=name)
