"""The compression MLP's fused autograd node (``kernels/compress_mlp.py``) against the
same MLP in float64 PyTorch: output and the gradients of the input and every weight.

Without CUDA the backward's Triton kernel runs under the interpreter on small float32 /
float16 problems; the ``gpu`` tests run it compiled at the layer benchmark's sizes, and
``CompressMLP`` on CUDA against its own modules. Every buffer the kernel writes starts
poisoned with NaN.
"""


import pytest
import torch
from torch import nn

from native_sparse_attention import CompressMLP
from native_sparse_attention.kernels import compress_mlp
from native_sparse_attention.kernels.compress_mlp import relu_mlp

from kernel_device import DEVICE, gpu, skip_without_kernels

skip_without_kernels()


@pytest.fixture(autouse=True)
def poisoned_buffers(poison):
    poison(compress_mlp)


def reference(x, w1, b1, w2, b2, dy):
    """Output and (dx, dw1, db1, dw2, db2) in float64."""
    inputs = [t.detach().double().requires_grad_() for t in (x, w1, b1, w2, b2)]
    x64, w164, b164, w264, b264 = inputs
    y = torch.relu(x64 @ w164.T + b164) @ w264.T + b264
    return y, torch.autograd.grad(y, inputs, dy.double())


def inputs(rows, features, hidden, outputs, dtype, gen):
    """x, w1, b1, w2, b2, dy on DEVICE; a quarter of the hidden units always dead, the
    others alive about half the time."""
    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(DEVICE, dtype)

    x = rand(rows, features)
    w1 = rand(hidden, features, scale=features**-0.5)
    b1 = rand(hidden, scale=0.5)
    b1[: hidden // 4] = -100.0
    return x, w1, b1, rand(outputs, hidden, scale=hidden**-0.5), rand(outputs), rand(rows, outputs)


def relative_error(got, want):
    """Largest error relative to the largest entry (at least 1)."""
    if not want.numel():
        return 0.0
    return ((got.double() - want).abs().max() / max(want.abs().max().item(), 1.0)).item()


def check(rows, features, hidden, outputs, dtype, seed, atol, weight_dtype=None):
    """The node against float64; ``weight_dtype``: the weights' dtype where it is not x's
    (the node computes in x's dtype from copies of them)."""
    x, w1, b1, w2, b2, dy = inputs(rows, features, hidden, outputs, dtype, torch.Generator().manual_seed(seed))
    weight_dtype = weight_dtype or dtype
    # The weights rounded to x's dtype, as the node computes with them, then held in theirs.
    w1, b1, w2, b2 = (w.to(weight_dtype) for w in (w1, b1, w2, b2))
    leaves = [t.requires_grad_() for t in (x, w1, b1, w2, b2)]
    y = relu_mlp(*leaves)
    assert y.dtype == dtype
    grads = torch.autograd.grad(y, leaves, dy)
    expected_y, expected_grads = reference(x, w1, b1, w2, b2, dy)
    assert relative_error(y, expected_y) <= atol, "y"
    for name, got, want, leaf in zip(("x", "w1", "b1", "w2", "b2"), grads, expected_grads, leaves):
        assert got.dtype == leaf.dtype and got.shape == want.shape, name
        assert relative_error(got, want) <= atol, name


@pytest.mark.parametrize(
    "rows, features, hidden, outputs, dtype",
    [
        (37, 24, 40, 12, torch.float32),  # odd sizes: partial row and column tiles, O padded to 16
        (16, 32, 16, 16, torch.float32),  # one tile
        (50, 48, 70, 24, torch.float16),
        (0, 16, 16, 8, torch.float32),  # no windows yet
    ],
)
def test_matches_float64(rows, features, hidden, outputs, dtype):
    check(rows, features, hidden, outputs, dtype, seed=rows + hidden, atol=2e-5 if dtype == torch.float32 else 5e-3)


@pytest.mark.parametrize("rows", [45, 0])
def test_float32_weights_with_half_inputs(rows):
    """Master weights in float32 with float16 rows, as under autocast: the node computes in
    float16 and hands back the weights' gradients in float32."""
    check(rows, 40, 56, 20, torch.float16, seed=rows + 1, atol=5e-3, weight_dtype=torch.float32)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_layer_benchmark_sizes_as_accurate_as_pytorch(dtype):
    """Two kv heads' 4095 windows of 32 x 64 values through 2048 hidden units: against
    float64, the node's output and gradients err no more than the same MLP's PyTorch ops
    in ``dtype`` (whose bf16 dx is off by 5% of its largest entry at these sizes)."""
    gen = torch.Generator().manual_seed(3)
    rows, features, hidden, outputs = 8190, 2048, 2048, 64
    x, w1, b1, w2, b2, dy = inputs(rows, features, hidden, outputs, dtype, gen)
    leaves = [t.requires_grad_() for t in (x, w1, b1, w2, b2)]
    expected = reference(x, w1, b1, w2, b2, dy)
    errors = {}
    for name, mlp in (("node", relu_mlp), ("pytorch", lambda x, w1, b1, w2, b2: torch.relu(x @ w1.T + b1) @ w2.T + b2)):
        y = mlp(*leaves)
        got = (y, *torch.autograd.grad(y, leaves, dy))
        errors[name] = [relative_error(a, b) for a, b in zip(got, (expected[0], *expected[1]))]
    for what, node, pytorch in zip(("y", "x", "w1", "b1", "w2", "b2"), errors["node"], errors["pytorch"]):
        assert node <= 1.25 * pytorch + 1e-3, (what, node, pytorch)


@gpu
def test_gpu_compress_mlp_matches_its_modules_under_autocast():
    torch.manual_seed(0)
    mlp = CompressMLP(32, 64).cuda()
    windows = torch.randn(2, 2, 300, 32, 64, device="cuda", requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        fused = mlp(windows)
        plain = mlp.net(windows.flatten(-2))
    assert fused.dtype == plain.dtype == torch.bfloat16
    dy = torch.randn_like(plain)
    fused_grads = torch.autograd.grad(fused, [windows, *mlp.parameters()], dy)
    plain_grads = torch.autograd.grad(plain, [windows, *mlp.parameters()], dy)
    torch.testing.assert_close(fused, plain, rtol=0, atol=2e-2)
    for got, want in zip(fused_grads, plain_grads):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


class _Linear(nn.Linear):
    """A linear layer whose forward could be overridden: the MLP must call it."""


@pytest.mark.parametrize("change", ["activation", "subclass", "hook on a layer", "hook on net"])
def test_changed_networks_keep_the_modules(change):
    """Another activation, a replaced layer or a hook on the network or one of its layers
    keeps the modules' forward (a hooked one called) instead of the fused node."""
    mlp = CompressMLP(4, 8).to(DEVICE)
    assert mlp.fusable()
    calls = []
    if change == "activation":
        mlp.net[1] = nn.GELU()
    elif change == "subclass":
        mlp.net[2] = _Linear(mlp.net[2].in_features, mlp.net[2].out_features).to(DEVICE)
    else:
        hooked = mlp.net[0] if change == "hook on a layer" else mlp.net
        hooked.register_forward_hook(lambda *args: calls.append(1))
    assert not mlp.fusable()
    windows = torch.randn(1, 2, 3, 4, 8, device=DEVICE)
    torch.testing.assert_close(mlp(windows), mlp.net(windows.flatten(-2)))
    assert len(calls) == (2 if change.startswith("hook") else 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_compiled_node_matches_eager(dtype):
    """Compiled, the node runs as custom operators, whose fake implementations must give
    the real outputs' shapes and dtypes: with float32 weights and rows of ``dtype``."""
    torch.manual_seed(0)
    x = torch.randn(37, 24, device=DEVICE).to(dtype).requires_grad_()
    params = [torch.randn(40, 24, device=DEVICE) * 0.2, torch.randn(40, device=DEVICE),
              torch.randn(12, 40, device=DEVICE) * 0.2, torch.randn(12, device=DEVICE)]
    params = [p.requires_grad_() for p in params]
    dy = torch.randn(37, 12, device=DEVICE).to(dtype)

    def run(fn):
        y = fn(x, *params)
        return (y, *torch.autograd.grad(y, [x, *params], dy))

    for got, want in zip(run(torch.compile(relu_mlp, fullgraph=True)), run(relu_mlp)):
        torch.testing.assert_close(got, want)
