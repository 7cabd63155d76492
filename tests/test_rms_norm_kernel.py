"""The RMSNorm node (``kernels/rms_norm.py``) against the norm in float64 PyTorch: output,
and the gradients of the input and the weight.

Without CUDA the kernels run under the Triton interpreter on small problems; the ``gpu``
test runs them at the layer benchmark's sizes. Every buffer the kernels write starts
poisoned with NaN.
"""


import pytest
import torch

from native_sparse_attention.kernels import rms_norm as rms_norm_kernels
from native_sparse_attention.kernels.rms_norm import rms_norm

from kernel_device import DEVICE, gpu, skip_without_kernels

skip_without_kernels()

EPS = 1e-6


@pytest.fixture(autouse=True)
def poisoned_buffers(poison):
    poison(rms_norm_kernels)


def check(shape, x_dtype, out_dtype, seed, tolerance):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=gen) * 3).to(DEVICE, x_dtype).requires_grad_()
    weight = (1 + 0.3 * torch.randn(shape[-1], generator=gen)).to(DEVICE).requires_grad_()
    dy = torch.randn(shape, generator=gen).to(DEVICE, out_dtype)
    y = rms_norm(x, weight, EPS, out_dtype)
    dx, dweight = torch.autograd.grad(y, (x, weight), dy)

    x64, weight64 = (t.detach().double().requires_grad_() for t in (x, weight))
    want = torch.nn.functional.rms_norm(x64, (shape[-1],), weight64, EPS)
    want_dx, want_dweight = torch.autograd.grad(want, (x64, weight64), dy.double())
    assert (y.dtype, dx.dtype, dweight.dtype) == (out_dtype, x_dtype, weight.dtype)
    for got, expected in ((y, want), (dx, want_dx), (dweight, want_dweight)):
        error = (got.double() - expected).abs().max() / expected.abs().max()
        assert error < tolerance


@pytest.mark.parametrize("shape", [(2, 5, 48), (7, 100), (1, 1, 16)])
def test_matches_float64(shape):
    check(shape, torch.float32, torch.float32, seed=shape[-1], tolerance=1e-5)


@pytest.mark.parametrize("x_dtype, out_dtype", [(torch.float32, torch.bfloat16), (torch.float32, torch.float16),
                                                (torch.float16, torch.float16)])
def test_mixed_precision(x_dtype, out_dtype):
    # The layer under autocast: a float32 input normed into the projections' 16-bit dtype.
    check((3, 9, 64), x_dtype, out_dtype, seed=4, tolerance=1e-2)


def test_empty_input():
    x = torch.zeros(1, 0, 8, device=DEVICE, requires_grad=True)
    weight = torch.ones(8, device=DEVICE, requires_grad=True)
    y = rms_norm(x, weight, EPS, torch.float32)
    y.sum().backward()
    assert y.shape == x.shape and torch.equal(weight.grad, torch.zeros(8, device=DEVICE))


def test_rejects_what_it_cannot_norm():
    x = torch.zeros(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, torch.ones(7, device=DEVICE), EPS, torch.float32)
    with pytest.raises(TypeError, match="dtype"):
        rms_norm(x, torch.ones(8, device=DEVICE), EPS, torch.float64)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_layer_benchmark_sizes(dtype):
    check((1, 8192, 2048), torch.float32, dtype, seed=0, tolerance=1e-2)
