"""The fused rotary kernels against the PyTorch rotary embedding in float64: forward and
gradient of ``apply_rotary`` and of ``split_heads_and_rotate``.

Without CUDA the kernel runs under the Triton interpreter (set up in conftest.py) on
float32 and float16 inputs; its output starts as NaN, so an element it forgets to write
fails the comparison. The ``gpu`` test runs the layer's sizes in bf16, fp16 and fp32.
"""

import pytest
import torch
from einops import rearrange

from native_sparse_attention.kernels import rotary as rotary_kernels
from native_sparse_attention.kernels.rotary import apply_rotary, split_heads_and_rotate
from native_sparse_attention.rotary import RotaryEmbedding

from kernel_device import DEVICE, gpu, skip_without_kernels

skip_without_kernels()

# (atol, rtol) against float64: the output's rounding, plus the float32 sine and cosine.
TOLERANCES = {
    torch.float32: (1e-5, 1e-6),
    torch.float16: (1e-5, 1e-3),
    torch.bfloat16: (1e-5, 8e-3),
}


@pytest.fixture(autouse=True)
def poisoned_output(monkeypatch):
    monkeypatch.setattr(
        rotary_kernels, "_empty",
        lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype, device=device),
    )


def projected_heads(b, h, n, d, dtype, seed):
    """[b, h, n, d] as the layer's projection hands it over: a head-splitting view of
    [b, n, (h + 1) * d], whose last head stands for the other projections' columns."""
    gen = torch.Generator().manual_seed(seed)
    projection = torch.randn(b, n, (h + 1) * d, generator=gen).to(DEVICE, dtype)
    return rearrange(projection[..., : h * d], "b n (h d) -> b h n d", h=h)


def check_against_float64(b, h, n, d, offset, dtype, seed=0):
    t = projected_heads(b, h, n, d, dtype, seed).detach().requires_grad_()
    rotary = RotaryEmbedding(d).to(DEVICE)
    out = apply_rotary(t, rotary.inv_freq, offset)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1)).to(DEVICE, dtype)
    out.backward(dout)

    t64 = t.detach().double().requires_grad_()
    expected = rotary(t64, offset)
    expected.backward(dout.double())
    atol, rtol = TOLERANCES[dtype]
    assert out.shape == (b, h, n, d) and out.dtype == dtype and out.is_contiguous()
    torch.testing.assert_close(out.double(), expected, atol=atol, rtol=rtol)
    assert t.grad.dtype == dtype
    torch.testing.assert_close(t.grad.double(), t64.grad, atol=atol, rtol=rtol)


@pytest.mark.parametrize("offsets", [(5, 5), (5, 40_000)])
def test_rotation_at_a_position_read_on_the_device(offsets):
    """Each batch row at the position it reads from the device."""
    t = projected_heads(2, 3, 1, 16, torch.float32, seed=4)
    rotary = RotaryEmbedding(16).to(DEVICE)
    out = rotary_kernels.rotate_at(t, rotary.inv_freq, torch.tensor(offsets, device=DEVICE))
    for row, offset in enumerate(offsets):
        torch.testing.assert_close(out[row:row + 1], apply_rotary(t[row:row + 1], rotary.inv_freq, offset),
                                   atol=0, rtol=0)


def test_gradient_keeps_the_input_order_of_heads_and_tokens():
    """The layer's q and k are head-splitting views of its projection: their gradients come
    back laid out as [b, n, h, d], so that the projection's gradient reads them without a
    transpose; a contiguous input gets a contiguous gradient, with the same values."""
    b, h, n, d = 2, 3, 20, 16
    inv_freq = RotaryEmbedding(d).inv_freq.to(DEVICE)
    view = projected_heads(b, h, n, d, torch.float32, seed=5).detach().requires_grad_()
    dout = torch.randn(b, h, n, d, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    (view_grad,) = torch.autograd.grad(apply_rotary(view, inv_freq, 7), view, dout)
    dense = view.detach().contiguous().requires_grad_()
    (dense_grad,) = torch.autograd.grad(apply_rotary(dense, inv_freq, 7), dense, dout)
    assert view_grad.stride() == (n * h * d, d, h * d, 1)
    assert dense_grad.is_contiguous()
    torch.testing.assert_close(view_grad, dense_grad, atol=0, rtol=0)


# Two tiles of tokens with an odd tail; 9 heads fill one program and part of another;
# a decoding step (one token far into the sequence, where the angles need reducing).
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("b, h, n, d, offset", [
    (2, 3, 77, 64, 0),
    (1, 9, 45, 48, 40_000),
    (2, 2, 1, 64, 65_535),
])
def test_matches_pytorch_rotary(b, h, n, d, offset, dtype):
    check_against_float64(b, h, n, d, offset, dtype)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("offset", [0, 57_344])
def test_matches_pytorch_rotary_at_layer_size(dtype, offset):
    check_against_float64(1, 32, 8192, 64, offset, dtype)


SPLIT_OUTPUTS = ("q", "k", "v", "rq", "rk", "rest")


def check_split_against_float64(b, n, heads, kv_heads, d, rest, offset, dtype, used, seed=0):
    """``rest``: the projection's columns past the heads; ``used``: the outputs that the
    loss reads, the others' gradients are None, which the kernel must treat as zeros."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(b, n, (heads + 2 * kv_heads) * d + rest, generator=gen).to(DEVICE, dtype).requires_grad_()
    rotary = RotaryEmbedding(d).to(DEVICE)
    outputs = split_heads_and_rotate(qkv, heads, kv_heads, rotary.inv_freq, offset)
    qkv64 = qkv.detach().double().requires_grad_()
    expected = rotary.split_heads(qkv64, heads, kv_heads, offset)

    atol, rtol = TOLERANCES[dtype]
    for name, out, reference in zip(SPLIT_OUTPUTS, outputs, expected):
        assert out.shape == reference.shape and out.dtype == dtype, name
        torch.testing.assert_close(out.double(), reference, atol=atol, rtol=rtol, msg=name)
    for view in (*outputs[:3], outputs[5]):
        assert view.untyped_storage().data_ptr() == qkv.untyped_storage().data_ptr()
    rq, rk = outputs[3], outputs[4]
    assert rq.transpose(1, 2).is_contiguous() and rk.is_contiguous(), "rq tokens-major, rk heads-major"

    douts = [torch.randn(out.shape, generator=gen).to(DEVICE, dtype) for out in outputs]
    picked = [SPLIT_OUTPUTS.index(name) for name in used]
    (grad,) = torch.autograd.grad([outputs[i] for i in picked], qkv, [douts[i] for i in picked])
    (grad64,) = torch.autograd.grad([expected[i] for i in picked], qkv64,
                                    [douts[i].double() for i in picked])
    assert grad.dtype == dtype and grad.is_contiguous()
    torch.testing.assert_close(grad.double(), grad64, atol=atol, rtol=rtol)


# All outputs used with rest columns in several tiles (the sparse layer's gate logits), only
# v and the rotated ones (the dense layer), and a lone query view whose other columns must
# come back as zeros (d = 48: half rows padded to a power of two); 9 query heads fill one
# program and part of another; a decoding step far into the sequence.
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("b, n, heads, kv_heads, d, rest, offset, used", [
    (2, 77, 4, 2, 32, 150, 0, SPLIT_OUTPUTS),
    (1, 45, 9, 3, 16, 0, 40_000, ("v", "rq", "rk")),
    (2, 70, 2, 1, 48, 6, 3, ("q",)),
    (2, 1, 4, 1, 64, 12, 65_535, SPLIT_OUTPUTS),
])
def test_split_heads_and_rotate_matches_pytorch(b, n, heads, kv_heads, d, rest, offset, used, dtype):
    check_split_against_float64(b, n, heads, kv_heads, d, rest, offset, dtype, used)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_split_heads_and_rotate_at_layer_size(dtype):
    check_split_against_float64(1, 8192, 32, 2, 64, 96, 0, dtype, SPLIT_OUTPUTS)


def test_cpu_tensors_take_the_pytorch_path(monkeypatch):
    def no_kernel(*args, **kwargs):
        raise AssertionError("the rotary kernel ran on a CPU tensor")

    monkeypatch.setattr(rotary_kernels, "apply_rotary", no_kernel)
    monkeypatch.setattr(rotary_kernels, "split_heads_and_rotate", no_kernel)
    t = torch.randn(1, 2, 5, 8)
    assert RotaryEmbedding(8)(t, offset=3).shape == t.shape
    shapes = [out.shape for out in RotaryEmbedding(8).split_heads(torch.randn(1, 5, 35), 2, 1)]
    assert shapes == [(1, 2, 5, 8), (1, 1, 5, 8), (1, 1, 5, 8), (1, 2, 5, 8), (1, 1, 5, 8), (1, 5, 3)]


@pytest.mark.parametrize("change, error, message", [
    (dict(d=7), ValueError, "even d"),
    (dict(dtype=torch.float64), ValueError, "float16"),
    (dict(freqs=3), ValueError, "inv_freq"),
    (dict(offset=1.0), TypeError, "offset"),
])
def test_rejects_invalid_arguments(change, error, message):
    d = change.get("d", 8)
    t = torch.zeros(1, 2, 3, d, dtype=change.get("dtype", torch.float32), device=DEVICE)
    inv_freq = torch.ones(change.get("freqs", d // 2), device=DEVICE)
    with pytest.raises(error, match=message):
        apply_rotary(t, inv_freq, change.get("offset", 0))


@pytest.mark.parametrize("change, error, message", [
    (dict(width=30), ValueError, "at least 32 columns"),
    (dict(dtype=torch.float64), ValueError, "float16"),
    (dict(freqs=0), ValueError, "inv_freq"),
    (dict(heads=0), ValueError, "positive"),
    (dict(kv_heads=1.0), TypeError, "kv_heads"),
    (dict(offset=True), TypeError, "offset"),
])
def test_split_heads_and_rotate_rejects_invalid_arguments(change, error, message):
    qkv = torch.zeros(1, 3, change.get("width", 32), dtype=change.get("dtype", torch.float32), device=DEVICE)
    inv_freq = torch.ones(change.get("freqs", 4), device=DEVICE)
    with pytest.raises(error, match=message):
        split_heads_and_rotate(qkv, change.get("heads", 2), change.get("kv_heads", 1), inv_freq,
                               change.get("offset", 0))
