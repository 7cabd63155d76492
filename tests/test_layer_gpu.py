"""The layer's CUDA fast paths against its PyTorch path (skipped without CUDA)."""

import pytest
import torch

from native_sparse_attention import SparseAttention

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CONFIG = dict(
    dim=512, dim_head=64, heads=8, kv_heads=2, sliding_window_size=128, compress_block_size=32,
    compress_block_sliding_stride=16, selection_block_size=64, num_selected_blocks=4, causal=True,
)


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).norm() / expected.float().norm()).item()


def _run(layer, x, grad_out, autocast=False):
    x = x.detach().clone().requires_grad_()
    layer.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        out = layer(x)
    out.backward(grad_out)
    grads = {name: p.grad.detach().clone() for name, p in layer.named_parameters()}
    return out.detach(), x.grad.detach(), grads


@pytest.mark.parametrize("fast_path", ["use_triton_kernel", "use_flex_attention"])
@pytest.mark.parametrize("share", [True, False])
@pytest.mark.parametrize("use_diff_topk", [False, True])
def test_fast_path_matches_pytorch_path(fast_path, share, use_diff_topk):
    torch.manual_seed(0)
    fast = SparseAttention(
        **CONFIG, query_heads_share_selected_kv=share, use_diff_topk=use_diff_topk, **{fast_path: True}
    ).cuda()
    reference = SparseAttention(**CONFIG, query_heads_share_selected_kv=share, use_diff_topk=use_diff_topk).cuda()
    reference.load_state_dict(fast.state_dict())
    n = 8192 if share else 4096
    x = torch.randn(1, n, CONFIG["dim"], device="cuda")
    grad_out = torch.randn_like(x)

    # float32: the selection is the same up to near-ties, so the paths agree closely.
    out, dx, grads = _run(fast, x, grad_out)
    ref_out, ref_dx, ref_grads = _run(reference, x, grad_out)
    assert _relative_error(out, ref_out) < 1e-2
    assert _relative_error(dx, ref_dx) < 2e-2
    for name, grad in grads.items():
        assert _relative_error(grad, ref_grads[name]) < 5e-2, name

    # bf16 autocast: the fast path stays finite and close.
    out_bf16, dx_bf16, _ = _run(fast, x, grad_out, autocast=True)
    assert torch.isfinite(out_bf16).all() and torch.isfinite(dx_bf16).all()
    assert _relative_error(out_bf16, ref_out) < 5e-2
