"""The static cache's write kernels against plain PyTorch bookkeeping, token by token.

Without CUDA the kernels run under the Triton interpreter (set up in conftest.py); the
window they return starts as NaN, so a row they forget to write fails the comparison.
"""


import pytest
import torch

from native_sparse_attention.kernels import cache_write
from native_sparse_attention.kernels.cache_write import write_compressed_row, write_ring_and_read_window

from kernel_device import DEVICE, skip_without_kernels

skip_without_kernels()


@pytest.fixture(autouse=True)
def poisoned_output(monkeypatch):
    monkeypatch.setattr(
        cache_write, "_empty",
        lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype, device=device),
    )


@pytest.mark.parametrize("window, d, dtype", [(6, 24, torch.float32), (8, 16, torch.float16)])
def test_ring_holds_the_window_ending_at_each_token(window, d, dtype):
    """Tokens written one by one, each batch row from a position of its own (0 and
    ``window + 3``): each step's window is the row's last ``window`` tokens, oldest first
    (zeros before the first token); the ring is updated in place for the next step. The
    new token comes as a strided view."""
    b, h, steps = 2, 3, 3 * window + 2
    starts = torch.tensor([0, window + 3])
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randn(b, steps, h, 2 * d, generator=gen).to(DEVICE, dtype)[..., :d].transpose(1, 2)
    ring = torch.zeros(b, h, window, d, dtype=dtype, device=DEVICE)
    history = torch.cat((torch.zeros(b, h, window - 1, d, dtype=dtype, device=DEVICE), tokens), dim=2)
    for t in range(steps):
        position = (starts + t).to(DEVICE)
        got = write_ring_and_read_window(position, tokens[:, :, t:t + 1], ring)
        assert got.shape == (b, h, 1, window, d)
        assert torch.equal(got[:, :, 0], history[:, :, t:t + window])
        for row in range(b):
            assert torch.equal(ring[row, :, (starts[row] + t) % window], tokens[row, :, t])


def test_compressed_row_goes_to_the_window_row_or_the_spare_row():
    """Complete windows (first token a multiple of the stride) land in row num_mem +
    first // stride; incomplete ones, those between strides and those past the buffer's
    rows in the spare last row. No other row changes. The batch's rows are at positions
    of their own, 1 apart, so that one row's window is complete where the other's is not."""
    b, h, d, num_mem, window, stride = 2, 2, 12, 2, 8, 4
    rows = num_mem + 5 + 1  # five windows, then the spare row
    buffer = torch.randn(b, h, rows, d, device=DEVICE)
    for step in range(0, 40):
        positions = [step, step + 1]
        new = torch.randn(b, h, 1, d, device=DEVICE)
        expected = buffer.clone()
        for row, position in enumerate(positions):
            start = position + 1 - window
            expected_row = rows - 1
            if start >= 0 and start % stride == 0 and num_mem + start // stride < rows - 1:
                expected_row = num_mem + start // stride
            expected[row, :, expected_row] = new[row, :, 0]
        write_compressed_row(torch.tensor(positions, device=DEVICE), new, buffer, num_mem, window, stride)
        assert torch.equal(buffer, expected), positions
