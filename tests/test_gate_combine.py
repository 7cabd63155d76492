"""The fused gate combination against its eager formula (float64), forward and gradients.

Without CUDA the kernels run under the Triton interpreter (set up in conftest.py)."""

import os

import pytest
import torch
from einops import rearrange

from native_sparse_attention.kernels.gate_combine import gated_sum

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)


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


def test_rejects_mismatched_shapes():
    branch = torch.zeros(1, 2, 4, 8, device=DEVICE)
    with pytest.raises(ValueError, match="gates"):
        gated_sum(torch.zeros(3, 1, 2, 5, device=DEVICE), branch, branch, branch)
    with pytest.raises(ValueError, match="sliding"):
        gated_sum(torch.zeros(3, 1, 2, 4, device=DEVICE), branch, branch, branch[..., :4])
