"""The layers' input projection (``kernels/projection.py``) against ``F.linear`` over the
concatenated weights: the forward against the PyTorch ops in the same dtypes, the
gradients against float64.

Without CUDA the kernel runs under the Triton interpreter on small problems. Every buffer
the kernel writes starts poisoned with NaN.
"""

import pytest
import torch
import torch.nn.functional as F

from native_sparse_attention.kernels import projection
from native_sparse_attention.kernels.projection import project

from kernel_device import DEVICE, gpu, skip_without_kernels

skip_without_kernels()


@pytest.fixture(autouse=True)
def poisoned_buffers(poison):
    poison(projection)


def check(shape, rows, weight_dtype, dtype, seed, tolerance):
    gen = torch.Generator().manual_seed(seed)
    columns = shape[-1]
    x = torch.randn(shape, generator=gen).to(DEVICE, dtype).requires_grad_()
    weights = [(torch.randn(r, columns, generator=gen) * columns**-0.5).to(DEVICE, weight_dtype).requires_grad_()
               for r in rows]
    y = project(x, weights)
    want = F.linear(x.detach(), torch.cat([w.detach() for w in weights]).to(dtype))
    assert y.dtype == dtype and y.shape == (*shape[:-1], sum(rows))
    torch.testing.assert_close(y, want, rtol=tolerance, atol=tolerance)

    grad = torch.randn(y.shape, generator=gen).to(DEVICE, dtype)
    got = torch.autograd.grad(y, (x, *weights), grad)
    leaves = [t.detach().double().requires_grad_() for t in (x, *weights)]
    want = torch.autograd.grad(F.linear(leaves[0], torch.cat(leaves[1:])), leaves, grad.double())
    for index, (g, w, leaf) in enumerate(zip(got, want, (x, *weights))):
        assert g.dtype == leaf.dtype and g.shape == leaf.shape, index
        torch.testing.assert_close(g.double(), w, rtol=tolerance, atol=tolerance * 10, msg=f"input {index}")


@pytest.mark.parametrize("shape, rows", [((2, 9, 24), (40, 6)), ((1, 5, 16), (24,)), ((7, 8), (3, 1))])
def test_matches_linear_over_the_concatenation(shape, rows):
    check(shape, rows, torch.float32, torch.float32, seed=sum(rows), tolerance=1e-5)


@pytest.mark.parametrize("rows", [(40, 6), (24,)])
def test_float32_weights_for_half_inputs(rows):
    # Autocast's case: float32 master weights, cast once; their gradients in float32.
    check((2, 9, 24), rows, torch.float32, torch.float16, seed=3, tolerance=2e-2)


def test_leaves_frozen_weights_without_gradient():
    x = torch.randn(3, 8, device=DEVICE, requires_grad=True)
    weight = torch.randn(5, 8, device=DEVICE)
    (dx,) = torch.autograd.grad(project(x, [weight]).sum(), (x,))
    torch.testing.assert_close(dx, weight.sum(0).expand(3, 8))


def test_rejects_bad_weights():
    x = torch.randn(3, 8, device=DEVICE)
    with pytest.raises(ValueError, match="weights must be"):
        project(x, [torch.randn(5, 7, device=DEVICE)])
    with pytest.raises(TypeError, match="share one dtype"):
        project(x, [torch.randn(5, 8, device=DEVICE), torch.randn(5, 8, device=DEVICE).half()])
    with pytest.raises(ValueError, match="one or two"):
        project(x, [])


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_layer_sizes_on_gpu(dtype):
    # The layer benchmark's sparse projection: 2304 q / k / v and 96 gate rows of 2048.
    check((1, 4096, 2048), (2304, 96), torch.float32, dtype, seed=4, tolerance=3e-2)
