"""The gates' node (``kernels/gate_sigmoid.py``) against the layer's eager ops: the
forward against ``(logits + bias.to(logits.dtype)).sigmoid()`` rearranged branch-major,
the gradients of the logits and the bias against float64, the bias's also against the
float64 sum of the logits' gradient, with enough tokens for several backward programs.

Without CUDA the kernels run under the Triton interpreter. Every buffer the kernels write
starts poisoned with NaN.
"""


import pytest
import torch
from einops import rearrange

from native_sparse_attention.kernels import gate_sigmoid
from native_sparse_attention.kernels.gate_sigmoid import gate_sigmoids

from kernel_device import DEVICE, skip_without_kernels

skip_without_kernels()


@pytest.fixture(autouse=True)
def poisoned_buffers(poison):
    poison(gate_sigmoid)


def eager(logits, bias):
    if bias is not None:
        logits = logits + bias.to(logits.dtype)
    return rearrange(logits, "b n (h s) -> s b h n", s=3).sigmoid()


# Rows b * n over gate_sigmoid._BLOCK_R (64) give the backward several programs, whose
# partial sums of the bias's gradient library.column_sums adds: 3, 7 and 11 of them, with 9, 12
# and 15 columns, so that its interpreter tiles (2 rows x 4 columns) end part-filled.
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("b, n, h, bias_dtype", [
    (2, 70, 3, torch.float32), (1, 5, 1, None), (3, 131, 4, torch.float16), (2, 333, 5, torch.float32),
])
def test_matches_eager_ops(b, n, h, bias_dtype, dtype):
    with_bias = bias_dtype is not None
    gen = torch.Generator().manual_seed(n + h)
    # The layer's logits: the last columns of a wider projection.
    projection = (torch.randn(b, n, 7 + 3 * h, generator=gen) * 3).to(DEVICE, dtype)
    logits = projection[..., 7:].requires_grad_()
    bias = torch.randn(3 * h, generator=gen).to(DEVICE, bias_dtype).requires_grad_() if with_bias else None
    gates = gate_sigmoids(logits, bias)
    assert gates.shape == (3, b, h, n) and gates.is_contiguous() and gates.dtype == dtype
    tolerance = 1e-6 if dtype == torch.float32 else 1e-3
    torch.testing.assert_close(gates, eager(logits.detach(), None if bias is None else bias.detach()),
                               rtol=tolerance, atol=tolerance)

    dgates = torch.randn(gates.shape, generator=gen).to(DEVICE, dtype)
    inputs = (logits,) if bias is None else (logits, bias)
    grads = torch.autograd.grad(gates, inputs, dgates)
    inputs64 = tuple(t.detach().double().requires_grad_() for t in inputs)
    logits64 = inputs64[0] + (inputs64[1] if with_bias else 0)
    want = torch.autograd.grad(rearrange(logits64, "b n (h s) -> s b h n", s=3).sigmoid(), inputs64, dgates.double())
    for got, expected, source in zip(grads, want, inputs):
        assert got.dtype == source.dtype
        scale = expected.abs().max()
        tolerance = 1e-5 if {dtype, source.dtype} == {torch.float32} else 1e-2
        assert (got.double() - expected).abs().max() / scale < tolerance
    if with_bias:
        # The sum alone: float32 partials, then one rounding to the bias's dtype.
        dlogits, dbias = grads
        expected = dlogits.double().sum((0, 1))
        error = (dbias.double() - expected).abs().max() / expected.abs().max()
        assert error < (1e-6 if bias_dtype == torch.float32 else 1e-3)


def test_rejects_what_it_cannot_gate():
    with pytest.raises(ValueError, match="3 \\* h"):
        gate_sigmoids(torch.zeros(1, 4, 5, device=DEVICE), None)
    with pytest.raises(TypeError, match="float16"):
        gate_sigmoids(torch.zeros(1, 4, 6, device=DEVICE, dtype=torch.float64), None)
