"""The memory key/values before the compressed ones (``kernels/memory_kv.py``) against
``torch.cat`` of the cast and expanded parameter: the forward bit for bit, the gradients
against float64.

Without CUDA the kernels run under the Triton interpreter on small problems. Every
buffer the kernels write starts poisoned with NaN.
"""

import pytest
import torch

from native_sparse_attention.kernels import memory_kv
from native_sparse_attention.kernels.memory_kv import with_memory

from kernel_device import DEVICE, gpu, skip_without_kernels

skip_without_kernels()


@pytest.fixture(autouse=True)
def poisoned_buffers(poison):
    poison(memory_kv)


def reference(mem, ck, cv):
    """The layer's eager concatenation: [b, h, num_mem + nc, d] each, in ck's dtype."""
    mem_k, mem_v = (m.to(ck.dtype).expand(ck.shape[0], -1, -1, -1) for m in mem)
    return torch.cat((mem_k, ck), dim=2), torch.cat((mem_v, cv), dim=2)


def compressed_view(b, h, nc, d, dtype, gen):
    """Compressed rows as a strided view: every other row of a longer tensor."""
    rows = torch.randn(b, h, 2 * nc + 1, d, generator=gen).to(DEVICE, dtype)
    return rows[:, :, 1::2]


def check(b, h, nc, num_mem, d, mem_dtype, dtype, seed, strided=False):
    gen = torch.Generator().manual_seed(seed)
    mem = (torch.randn(2, h, num_mem, d, generator=gen)).to(DEVICE, mem_dtype).requires_grad_()
    if strided:
        ck, cv = (compressed_view(b, h, nc, d, dtype, gen) for _ in range(2))
    else:
        ck, cv = (torch.randn(b, h, nc, d, generator=gen).to(DEVICE, dtype) for _ in range(2))
    ck.requires_grad_()
    cv.requires_grad_()
    out_k, out_v = with_memory(mem, ck, cv)
    want_k, want_v = reference(mem.detach(), ck.detach(), cv.detach())
    assert out_k.dtype == dtype and out_k.is_contiguous() and out_v.is_contiguous()
    assert torch.equal(out_k, want_k) and torch.equal(out_v, want_v)

    grads = [torch.randn(out_k.shape, generator=gen).to(DEVICE, dtype) for _ in range(2)]
    # The consumer's gradients may come in any strides with unit stride along d.
    grads[1] = grads[1].transpose(0, 1).contiguous().transpose(0, 1)
    got = torch.autograd.grad((out_k, out_v), (mem, ck, cv), grads)
    leaves = [t.detach().double().requires_grad_() for t in (mem, ck, cv)]
    want = torch.autograd.grad(reference(*leaves), leaves, [g.double() for g in grads])
    for name, g, w, leaf in zip(("mem", "ck", "cv"), got, want, (mem, ck, cv)):
        assert g.dtype == leaf.dtype, name
        tolerance = 1e-6 if g.dtype == torch.float32 else 2e-3
        torch.testing.assert_close(g.double(), w, rtol=tolerance, atol=tolerance, msg=name)


@pytest.mark.parametrize(
    "b, h, nc, num_mem, d",
    [
        (1, 2, 70, 1, 16),  # the layer's one memory row, two row tiles per head
        (3, 1, 5, 3, 12),  # a batch to sum the memory's gradient over, d not a power of two
        (2, 2, 9, 70, 8),  # memory rows spanning two row tiles
        (2, 1, 0, 2, 8),  # no compressed token yet
    ],
)
def test_matches_concatenation(b, h, nc, num_mem, d):
    check(b, h, nc, num_mem, d, torch.float32, torch.float32, seed=nc + num_mem)


def test_strided_compressed_rows():
    check(2, 2, 20, 1, 16, torch.float32, torch.float32, seed=1, strided=True)


@pytest.mark.parametrize("mem_dtype, dtype", [(torch.float32, torch.float16), (torch.float16, torch.float32)])
def test_mixed_precision(mem_dtype, dtype):
    check(2, 2, 33, 2, 16, mem_dtype, dtype, seed=2)


def test_rejects_mismatched_inputs():
    ck = torch.zeros(1, 2, 4, 8, device=DEVICE)
    with pytest.raises(ValueError, match="mem must be"):
        with_memory(torch.zeros(2, 3, 1, 8, device=DEVICE), ck, ck)
    with pytest.raises(ValueError, match="ck and cv"):
        with_memory(torch.zeros(2, 2, 1, 8, device=DEVICE), ck, ck[:, :, :3])
    with pytest.raises(TypeError, match="ck must be"):
        with_memory(torch.zeros(2, 2, 1, 8, device=DEVICE), ck.long(), ck.long())


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_layer_sizes_on_gpu(dtype):
    # The layer benchmark's n = 65536: 4095 compressed tokens on two kv heads of 64.
    check(1, 2, 4095, 1, 64, torch.float32, dtype, seed=3)
