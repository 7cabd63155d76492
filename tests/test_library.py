"""The kernel launchers as ``torch.library`` operators, the layer under ``torch.compile``, and
the precision of the kernels' float32 dots.

``torch.library.opcheck`` runs each operator for real and checks its schema (no output
aliasing an input or another output, no undeclared mutation) and its fake
implementation (the shapes, dtypes and strides of the real outputs). Without CUDA the
kernels run under the Triton interpreter on small float32 problems.
"""

import copy
import inspect

import pytest
import torch
import triton

from native_sparse_attention import SparseAttention
from native_sparse_attention.kernels import compressed, gate_combine, rotary, selection  # noqa: F401 (registration)
from native_sparse_attention.kernels.selection_inverse import fake_key_block_entries
from native_sparse_attention.kernels.library import (
    NAMESPACE, cdiv, column_sums, dot_precision, next_power_of_2, side_by_side,
)

from kernel_device import DEVICE, skip_without_kernels

skip_without_kernels()

OPS = getattr(torch.ops, NAMESPACE)
# The operators' real and fake outputs, compared; no autograd formula is registered on
# the operators themselves (the autograd.Functions around them carry it).
CHECKS = ("test_schema", "test_faketensor")


def _randn(*shape):
    return torch.randn(*shape, device=DEVICE)


def _selection_inputs(window, with_scale, per_query_head=False):
    b, hq, hk, n, d, slots = 1, 2, 1, 20, 16, 2
    hs = hq if per_query_head else hk
    q, k, v = _randn(b, hq, n, d), _randn(b, hk, n, d), _randn(b, hk, n, d)
    indices = torch.randint(0, 3, (b, hs, n, slots), device=DEVICE)
    fmask = torch.rand(b, hs, n, slots, device=DEVICE) > 0.3
    sel_scale = torch.rand(b, hs, n, slots, device=DEVICE) if with_scale else None
    return q, k, v, indices, fmask, sel_scale, 16, True, window, 0.25


@pytest.mark.parametrize("window, with_scale, per_query_head", [(8, True, False), (None, False, True)])
def test_selection_operators(window, with_scale, per_query_head):
    """The forward with and without the inversion for dK / dV, and the backward with the
    forward's inversion and with its own: the same gradients."""
    inputs = _selection_inputs(window, with_scale, per_query_head)
    inverting = (*inputs, 0, None, None, True)
    for forward_inputs in (inputs, inverting):
        torch.library.opcheck(OPS.selection_forward, forward_inputs, test_utils=CHECKS)
    out, lse, swa_out, swa_lse, _, table = OPS.selection_forward(*inverting)
    assert [t.shape for t in table] == [t.shape for t in fake_key_block_entries(
        selection._problem(*inputs[:2], inputs[3], with_scale, *inputs[6:]), 4, DEVICE)]
    assert OPS.selection_forward(*inputs)[-1] == []
    grads = (torch.randn_like(out), torch.randn_like(swa_out) if window is not None else None)
    backward_inputs = (*inputs[:6], out, lse, swa_out, swa_lse, *grads, *inputs[6:])
    torch.library.opcheck(OPS.selection_backward, (*backward_inputs, table), test_utils=CHECKS)
    for got, want in zip(OPS.selection_backward(*backward_inputs, table), OPS.selection_backward(*backward_inputs, [])):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # dK / dV sum in any order on a GPU


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_selection_forward_with_gates(dtype):
    """With gates and the compressed output the forward also returns the gated sum where
    its launch folds it in (float16 here), else an empty tensor."""
    q, k, v, indices, fmask, _, *options = _selection_inputs(8, False)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    gates = torch.rand(1, 20, 3 * q.shape[1], device=DEVICE, dtype=dtype).unflatten(-1, (-1, 3)).permute(3, 0, 2, 1)
    inputs = (q, k, v, indices, fmask, None, *options, 0, gates, torch.randn_like(q))
    torch.library.opcheck(OPS.selection_forward, inputs, test_utils=CHECKS)
    assert OPS.selection_forward(*inputs)[-2].numel() == (0 if dtype == torch.float32 else q.numel())


@pytest.mark.parametrize("share_selection, tokens_major", [(True, True), (False, False)])
def test_compressed_operators(share_selection, tokens_major):
    # tokens_major: q as the layer's view of its projection, which dQ's layout follows.
    q = _randn(1, 40, 2, 16).transpose(1, 2) if tokens_major else _randn(1, 2, 40, 16)
    ck, cv = _randn(1, 1, 9, 16), _randn(1, 1, 9, 16)
    geometry = (8, 4, 1, True, 0.25, 16, 2, share_selection)
    torch.library.opcheck(OPS.compressed_attend_and_select, (q, ck, cv, *geometry), test_utils=CHECKS)
    out, lse, indices, mask, scores = OPS.compressed_attend_and_select(q, ck, cv, *geometry)
    for dout, dscores in ((torch.randn_like(out), torch.randn_like(scores)), (None, torch.randn_like(scores))):
        backward_inputs = (dout, dscores, q, ck, cv, out, lse, indices, mask, *geometry)
        torch.library.opcheck(OPS.compressed_attend_and_select_backward, backward_inputs, test_utils=CHECKS)


@pytest.mark.parametrize("project", [False, True])
def test_gated_branches_backward_operator(project):
    """The three branches' backward as one operator (the compressed one's launches, and the
    output projection's weight gradient with ``project``, on a side stream on CUDA) against
    the two operators it runs and the projection's matmuls."""
    q = _randn(1, 40, 2, 16).transpose(1, 2)
    ck, cv = _randn(1, 1, 11, 16), _randn(1, 1, 11, 16)
    rq, rk, v = _randn(1, 2, 40, 16), _randn(1, 1, 40, 16), _randn(1, 1, 40, 16)
    compressed_options, selection_options = (8, 4, 1, True, 0.25, 16, 2, True), (16, True, 8, 0.25)
    out_c, lse_c, indices, mask, _ = OPS.compressed_attend_and_select(q, ck, cv, *compressed_options)
    out_s, lse_s, out_w, lse_w, _, table = OPS.selection_forward(rq, rk, v, indices, mask, None,
                                                                 *selection_options, 0, None, None, True)
    merged, weight = _randn(1, 40, 32), _randn(24, 32)
    d_y = _randn(1, 40, 24) if project else _randn(1, 40, 32)
    d_merged = d_y @ weight if project else d_y
    d_out = d_merged.unflatten(-1, (2, 16)).transpose(1, 2)
    inputs = (d_y, weight if project else None, merged if project else None, torch.float32, q, ck, cv, out_c, lse_c,
              rq, rk, v, indices, mask, out_s, lse_s, out_w, lse_w, table, *compressed_options, *selection_options)
    torch.library.opcheck(OPS.gated_branches_backward, inputs, test_utils=CHECKS)
    grads = OPS.gated_branches_backward(*inputs)
    expected = (*OPS.compressed_attend_and_select_backward(d_out, None, q, ck, cv, out_c, lse_c, indices, mask,
                                                           *compressed_options),
                *[t for i, t in enumerate(OPS.selection_backward(rq, rk, v, indices, mask, None, out_s, lse_s, out_w,
                                                                lse_w, d_out, d_out, *selection_options, []))
                  if i != 3],
                d_y.flatten(0, 1).t() @ merged.flatten(0, 1) if project else torch.empty(0, device=DEVICE))
    assert len(grads) == len(expected) == 10
    for got, want in zip(grads, expected):  # the selection's dK / dV sums in any order on a GPU
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_launch_arithmetic_equals_tritons():
    """The launchers' host-side cdiv and next_power_of_2 stand in for Triton's."""
    for a in range(0, 300):
        assert next_power_of_2(a) == triton.next_power_of_2(a)
        for b in (1, 2, 3, 16, 64, 127):
            assert cdiv(a, b) == triton.cdiv(a, b)
    assert next_power_of_2(2**40 + 1) == triton.next_power_of_2(2**40 + 1) == 2**41


@pytest.mark.parametrize("rows, columns, dtype", [(7, 9, torch.float32), (5, 13, torch.float16), (1, 3, torch.float32),
                                                  (528, 2048, torch.float32), (1024, 96, torch.bfloat16)])
def test_column_sums_match_torch(rows, columns, dtype):
    """Per-program partial sums added in float32 and written in the gradient's dtype."""
    if rows * columns > 10_000 and not torch.cuda.is_available():
        pytest.skip("the layer's sizes run on the GPU")
    parts = torch.randn(rows, columns, device=DEVICE)
    out = column_sums(parts, torch.full((columns,), float("nan"), dtype=dtype, device=DEVICE))
    want = parts.double().sum(0)
    assert out.dtype == dtype
    tolerance = 1e-5 * rows**0.5 if dtype == torch.float32 else 1e-2 * rows**0.5
    torch.testing.assert_close(out.double(), want, rtol=1e-2 if dtype != torch.float32 else 1e-5, atol=tolerance)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE.type != "cuda", reason="streams need CUDA")
def test_side_by_side_forks_and_joins_streams():
    """The side work sees what was queued before the fork, the caller's stream what it
    wrote, and a nested call gets a stream of its own, an urgent one of higher priority."""
    x = torch.zeros(1 << 24, device=DEVICE)
    x.add_(1.0)
    caller = torch.cuda.current_stream()
    streams = {}

    def side():
        streams["side"] = torch.cuda.current_stream()
        streams["nested"], _ = side_by_side(DEVICE, torch.cuda.current_stream, lambda: None)
        streams["urgent"], _ = side_by_side(DEVICE, torch.cuda.current_stream, lambda: None, urgent=True)
        return x * 2

    def main():
        streams["main"] = torch.cuda.current_stream()
        return x + 2

    doubled, shifted = side_by_side(DEVICE, side, main)
    total = doubled + shifted  # on the caller's stream, after the join
    assert torch.all(total == 5.0)
    assert streams["main"] == caller and streams["side"] != caller
    assert streams["nested"] not in (caller, streams["side"])
    assert streams["urgent"] not in (caller, streams["side"], streams["nested"])
    assert streams["urgent"].priority < streams["nested"].priority == streams["side"].priority == caller.priority
    assert torch.cuda.current_stream() == caller


def test_side_by_side_runs_both_in_turn_without_cuda():
    order = []
    assert side_by_side(torch.device("cpu"), lambda: order.append("side") or 1,
                        lambda: order.append("main") or 2) == (1, 2)
    assert order == ["side", "main"]


def test_rotary_and_gate_operators():
    t = _randn(1, 2, 20, 16).transpose(1, 2).contiguous().transpose(1, 2)  # strided input
    for inverse, tokens_major in ((False, False), (True, True)):
        torch.library.opcheck(OPS.rotary, (t, torch.rand(8, device=DEVICE), 3, inverse, tokens_major),
                              test_utils=CHECKS)
    inv_freq = torch.rand(8, device=DEVICE)
    dq, drq, dk, drk, dv = t, _randn(1, 2, 20, 16), None, _randn(1, 1, 20, 16), _randn(1, 1, 20, 16)
    for drest, width in ((None, 64), (_randn(1, 20, 5), 69)):
        torch.library.opcheck(OPS.qkv_grad, (dq, drq, dk, drk, dv, drest, inv_freq, 3, 1, 20, 2, 1, width,
                                             torch.float32), test_utils=CHECKS)
    gates, branches = torch.rand(3, 1, 2, 20, device=DEVICE), [_randn(1, 2, 20, 16) for _ in range(3)]
    torch.library.opcheck(OPS.gated_sum, (gates, *branches), test_utils=CHECKS)
    torch.library.opcheck(OPS.gated_sum_backward, (gates, *branches, _randn(1, 20, 32)), test_utils=CHECKS)


def test_split_heads_and_rotate_compiles_to_one_graph():
    """q, k and v come back as views of the projection from inside an autograd.Function;
    compiled, the Function must stay one graph and give eager's values and gradient."""
    qkv = _randn(2, 30, 4 * 16 + 6)
    inv_freq = torch.rand(8, device=DEVICE)

    def loss(qkv):
        q, k, v, rq, rk, rest = rotary.split_heads_and_rotate(qkv, 2, 1, inv_freq, 5)
        return (q * rq).sum() + (k * rk * v).sum() + rest.sigmoid().sum()

    results = []
    for fn in (loss, torch.compile(loss, fullgraph=True, backend="aot_eager")):
        leaf = qkv.clone().requires_grad_()
        value = fn(leaf)
        value.backward()
        results.append((value, leaf.grad))
    torch.testing.assert_close(results[1], results[0], rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(DEVICE.type == "cuda", reason="the GPU tests compile the layer with Inductor")
@pytest.mark.parametrize("use_diff_topk", [True, False])
def test_fast_path_layer_compiles_to_one_graph(monkeypatch, use_diff_topk):
    """fullgraph=True fails on any graph break; the compiled layer runs the same kernels,
    and without use_diff_topk its backward skips the selection scores' gradient path
    (compiled graphs pass zeros where eager autograd passes None)."""
    config = dict(
        dim=32, dim_head=16, heads=2, kv_heads=1, sliding_window_size=8, compress_block_size=8,
        compress_block_sliding_stride=4, selection_block_size=16, num_selected_blocks=2,
    )
    monkeypatch.setattr(SparseAttention, "_use_fast_path", lambda self, x: self.use_triton_kernel)
    score_grads = []
    attention_backward = compressed._attention_backward

    def recording_backward(*args, **kwargs):
        score_grads.append(inspect.signature(attention_backward).bind(*args, **kwargs).arguments.get("score_grad"))
        return attention_backward(*args, **kwargs)

    monkeypatch.setattr(compressed, "_attention_backward", recording_backward)
    torch.manual_seed(0)
    layer = SparseAttention(**config, use_triton_kernel=True, use_diff_topk=use_diff_topk)
    compiled = copy.deepcopy(layer)
    compiled.compile(fullgraph=True, backend="aot_eager")
    x = torch.randn(1, 40, config["dim"])
    results = []
    for module in (layer, compiled):
        x_in = x.clone().requires_grad_()
        module(x_in).square().sum().backward()
        results.append([x_in.grad, *(p.grad for p in module.parameters())])
    for eager_grad, compiled_grad in zip(*results):
        torch.testing.assert_close(compiled_grad, eager_grad, rtol=1e-5, atol=1e-6)
    assert len(score_grads) == 2
    assert all((grad is not None) == use_diff_topk for grad in score_grads)


@pytest.fixture
def float32_matmul_precision():
    """Restores PyTorch's float32 matmul settings, old and new API, after the test."""
    legacy = torch.get_float32_matmul_precision()
    backend = torch.backends.cuda.matmul.fp32_precision
    yield
    torch.set_float32_matmul_precision(legacy)
    torch.backends.cuda.matmul.fp32_precision = backend


def _set_matmul_precision(setting: str) -> None:
    api, value = setting.split("=")
    if api == "legacy":
        torch.set_float32_matmul_precision(value)
    else:
        torch.backends.cuda.matmul.fp32_precision = value


@pytest.mark.parametrize("settings, expected", [
    ((), "ieee"),
    (("legacy=high",), "tf32"),
    (("legacy=medium",), "tf32"),
    (("legacy=high", "legacy=highest"), "ieee"),
    (("backend=tf32",), "tf32"),
    (("legacy=high", "backend=ieee"), "ieee"),
])
def test_float32_dots_follow_pytorch_matmul_precision(float32_matmul_precision, settings, expected):
    """float32 tiles take TF32 exactly where PyTorch's own float32 matmuls would (and
    FlexAttention's dots); 16-bit tiles are exact whatever the setting."""
    for setting in settings:
        _set_matmul_precision(setting)
    assert dot_precision(torch.float32) == expected
    assert dot_precision(torch.bfloat16) == dot_precision(torch.float16) == "tf32"
