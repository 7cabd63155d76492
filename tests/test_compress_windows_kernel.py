"""The compression windows with their positions (``kernels/compress_windows.py``) against
unfold plus the positions in PyTorch: the forward bit for bit against the float32 add and
cast, the gradients of the tokens and the positions against float64.

Without CUDA the kernels run under the Triton interpreter on small problems; the ``gpu``
test runs them at the layer benchmark's sizes. Every buffer the kernels write starts
poisoned with NaN.
"""

import pytest
import torch

from native_sparse_attention.kernels import compress_windows
from native_sparse_attention.kernels.compress_windows import positioned_windows

from kernel_device import DEVICE, gpu, skip_without_kernels

skip_without_kernels()


@pytest.fixture(autouse=True)
def poisoned_buffers(poison):
    poison(compress_windows)


def reference(t, pos, size, stride):
    """unfold's windows plus the positions, [b, h, w, size, d], in t's and pos's
    promoted dtype (as the layer's eager add)."""
    return t.unfold(2, size, stride).transpose(-1, -2) + pos[:, None]


def projection_view(b, h, n, d, dtype, gen):
    """Keys as the layer sees them: heads of a wider [b, n, columns] projection."""
    columns = torch.randn(b, n, (h + 3) * d + 5, generator=gen).to(DEVICE, dtype)
    return columns[..., d: d + h * d].unflatten(-1, (h, d)).transpose(1, 2)


def check(b, h, n, d, size, stride, t_dtype, pos_dtype, out_dtype, seed, needs=("t", "pos")):
    """``needs``: the inputs that require a gradient (the kernel skips the others')."""
    gen = torch.Generator().manual_seed(seed)
    t = projection_view(b, h, n, d, t_dtype, gen)
    pos = (torch.randn(h, size, d, generator=gen) * 0.1).to(DEVICE, pos_dtype)
    t.requires_grad_("t" in needs)
    pos.requires_grad_("pos" in needs)
    out = positioned_windows(t, pos, size, stride, out_dtype)
    want = reference(t.detach(), pos.detach(), size, stride)
    assert out.dtype == out_dtype and out.is_contiguous()
    assert torch.equal(out, want.float().to(out_dtype)), "not the float32 sum rounded once"

    grad = torch.randn(out.shape, generator=gen).to(DEVICE, out_dtype)
    inputs = {"t": t, "pos": pos}
    grads = dict(zip(needs, torch.autograd.grad(out, [inputs[name] for name in needs], grad)))
    t64, pos64 = (x.detach().double().requires_grad_() for x in (t, pos))
    want_dt, want_dpos = torch.autograd.grad(reference(t64, pos64, size, stride), (t64, pos64), grad.double())
    if "pos" in needs:
        dpos = grads["pos"]
        assert dpos.dtype == pos_dtype
        # Each entry sums b * windows gradients (about their square root in size) in
        # float32, in an order the kernel's atomic adds vary.
        exact = pos_dtype == torch.float32
        torch.testing.assert_close(dpos.double(), want_dpos, rtol=1e-5 if exact else 1e-2,
                                   atol=1e-5 * (b * out.shape[2]) ** 0.5 if exact else 1e-2)
    if "t" in needs:
        dt = grads["t"]
        assert dt.dtype == t_dtype
        tolerance = 1e-6 if t_dtype == torch.float32 else 1e-2
        torch.testing.assert_close(dt.double(), want_dt, rtol=tolerance, atol=tolerance)
        # Tokens past the last window get no gradient; every other one some.
        windows = out.shape[2]
        covered = (windows - 1) * stride + size
        assert torch.all(dt[:, :, covered:] == 0)
        assert torch.all(dt[:, :, :covered].abs().amax(-1) > 0)


@pytest.mark.parametrize(
    "b, h, n, d, size, stride",
    [
        (1, 2, 70, 16, 8, 4),  # windows overlapping by half, a partial stride at the end
        (2, 1, 41, 12, 5, 3),  # size not a multiple of stride, d not a power of two
        (1, 3, 33, 16, 8, 8),  # windows side by side
        (1, 1, 7, 8, 7, 2),  # exactly one window
        # Several backward programs along the tokens, each adding its share of the
        # positions' gradient: the layer's windows, then two batches, then strides that
        # are not powers of two (lanes left idle, programs of 48 and 40 tokens), a stride
        # of one, and one wider than a program's 64 tokens.
        (1, 2, 150, 16, 32, 16),
        (2, 2, 131, 8, 12, 4),
        (1, 2, 100, 8, 7, 3),
        (2, 1, 130, 4, 12, 5),
        (1, 1, 140, 4, 3, 1),
        (1, 1, 210, 4, 70, 65),
    ],
)
def test_matches_unfold_plus_positions(b, h, n, d, size, stride):
    check(b, h, n, d, size, stride, torch.float32, torch.float32, torch.float32, seed=n + d)


@pytest.mark.parametrize("size, stride", [(32, 16), (7, 3), (12, 5)])
def test_programs_of_several_blocks(monkeypatch, size, stride):
    # What long sequences get: each backward program loops over blocks of tokens (here 2;
    # at stride 16 the last program's second lies past the end) before its one add into
    # the positions' gradient.
    monkeypatch.setattr(compress_windows, "_BACKWARD_PROGRAMS", 8)
    check(2, 2, 150, 8, size, stride, torch.float32, torch.float32, torch.float32, seed=stride)


@pytest.mark.parametrize("b, size, stride", [(2, 32, 16), (1, 7, 3)])
def test_deterministic_positions_gradient(monkeypatch, deterministic, b, size, stride):
    """Under torch.use_deterministic_algorithms each backward program stores its share of
    the positions' gradient in a slab of its own (every element written: the slabs start
    poisoned), which the host sums: the same bits at every run, the same values as the
    atomic adds'."""
    from conftest import launched_constexprs

    monkeypatch.setattr(compress_windows, "_BACKWARD_PROGRAMS", 8)
    launches = launched_constexprs(monkeypatch, compress_windows)
    check(b, 2, 150, 8, size, stride, torch.float32, torch.float32, torch.float32, seed=stride)
    assert [launch["PARTIALS"] for launch in launches if "PARTIALS" in launch] == [True]
    gen = torch.Generator().manual_seed(1)
    t = projection_view(b, 2, 150, 8, torch.float32, gen).requires_grad_()
    pos = (torch.randn(2, size, 8, generator=gen) * 0.1).to(DEVICE).requires_grad_()
    grad = torch.randn(positioned_windows(t, pos, size, stride, torch.float32).shape, generator=gen).to(DEVICE)
    runs = [torch.autograd.grad(positioned_windows(t, pos, size, stride, torch.float32), (t, pos), grad)
            for _ in range(3)]
    for run in runs[1:]:
        assert all(torch.equal(grad, first) for grad, first in zip(run, runs[0]))


@pytest.mark.parametrize("needs", [("t",), ("pos",)], ids=["t", "pos"])
@pytest.mark.parametrize("size, stride", [(32, 16), (7, 3)])
def test_one_input_needs_grad(needs, size, stride):
    # Frozen positions, or frozen keys: the other gradient alone, still exact.
    check(2, 2, 150, 8, size, stride, torch.float32, torch.float32, torch.float32, seed=size, needs=needs)


@pytest.mark.parametrize("t_dtype, out_dtype", [(torch.float16, torch.float16), (torch.float16, torch.float32),
                                                (torch.float32, torch.float16)])
def test_mixed_precision(t_dtype, out_dtype):
    # The layer under autocast: 16-bit keys, float32 positions, rows for a 16-bit MLP.
    check(1, 2, 45, 16, 8, 4, t_dtype, torch.float32, out_dtype, seed=3)


def test_rejects_what_it_cannot_window():
    t = torch.zeros(1, 2, 10, 8, device=DEVICE)
    pos = torch.zeros(2, 4, 8, device=DEVICE)
    with pytest.raises(ValueError, match="pos"):
        positioned_windows(t, pos[:1], 4, 2, torch.float32)
    with pytest.raises(ValueError, match="stride"):
        positioned_windows(t, pos, 4, 5, torch.float32)
    with pytest.raises(ValueError, match="tokens"):
        positioned_windows(t[:, :, :3], pos, 4, 2, torch.float32)
    with pytest.raises(TypeError, match="dtype"):
        positioned_windows(t, pos, 4, 2, torch.float64)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [8192 + 5, 65536 + 5])  # one block a backward program, then 4
def test_layer_benchmark_sizes(dtype, n):
    check(1, 2, n, 64, 32, 16, dtype, torch.float32, dtype, seed=0)
