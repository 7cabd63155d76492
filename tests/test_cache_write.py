"""The static cache's write kernels against plain PyTorch bookkeeping, token by token.

Without CUDA the kernels run under the Triton interpreter (set up in conftest.py); the
window they return starts as NaN, so a row they forget to write fails the comparison.
"""

import subprocess
import sys

import pytest
import torch

from native_sparse_attention.kernels import cache_write
from native_sparse_attention.kernels.cache_write import write_compressed_rows, write_rings_and_read_windows

from kernel_device import DEVICE, gpu, skip_without_kernels

skip_without_kernels()


@pytest.fixture(autouse=True)
def poisoned_output(monkeypatch):
    monkeypatch.setattr(
        cache_write, "_empty",
        lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype, device=device),
    )


@pytest.mark.parametrize("window, d, dtype, pos_dtype", [
    (6, 24, torch.float32, torch.float32), (8, 16, torch.float16, torch.float32), (8, 16, torch.float16, torch.float16),
])
def test_rings_hold_the_window_ending_at_each_token(window, d, dtype, pos_dtype):
    """Keys and values written one by one, each batch row from a position of its own (0
    and ``window + 3``): each step's windows are the row's last ``window`` keys and values,
    oldest first (zeros before the first token), plus the intra-block positions: in float32
    where the positions are (the layer's parameters under autocast), else rounded as
    PyTorch's sum is. The rings are updated in place for the next step. The new tokens come
    as strided views."""
    b, h, steps = 2, 3, 3 * window + 2
    starts = torch.tensor([0, window + 3])
    gen = torch.Generator().manual_seed(0)
    projected = torch.randn(b, steps, h, 3 * d, generator=gen).to(DEVICE, dtype).transpose(1, 2)
    tokens = {"keys": projected[..., :d], "values": projected[..., d:2 * d]}
    rings = {name: torch.zeros(b, h, window, d, dtype=dtype, device=DEVICE) for name in tokens}
    zeros = torch.zeros(b, h, window - 1, d, dtype=dtype, device=DEVICE)
    history = {name: torch.cat((zeros, t), dim=2) for name, t in tokens.items()}
    positions = {name: torch.randn(h, window, d, generator=gen).to(DEVICE, pos_dtype) for name in tokens}
    for t in range(steps):
        position = (starts + t).to(DEVICE)
        windows = write_rings_and_read_windows(position, tokens["keys"][:, :, t:t + 1],
                                               tokens["values"][:, :, t:t + 1], rings["keys"], rings["values"],
                                               positions["keys"], positions["values"])
        for name, got in zip(tokens, windows):
            assert got.shape == (b, h, 1, window, d) and got.dtype == torch.promote_types(dtype, pos_dtype)
            expected = history[name][:, :, t:t + window] + positions[name]
            assert torch.equal(got[:, :, 0], expected), name
            for row in range(b):
                assert torch.equal(rings[name][row, :, (starts[row] + t) % window], tokens[name][row, :, t])


def test_windows_come_in_the_dtype_asked_for_rounded_once():
    """Asked for float16 windows of float16 rings and float32 positions (the compression
    networks' dtype under autocast): the float32 sum rounded once."""
    b, h, window, d = 1, 2, 8, 16
    gen = torch.Generator().manual_seed(1)
    rings = [torch.randn(b, h, window, d, generator=gen).to(DEVICE, torch.float16) for _ in range(2)]
    tokens = [torch.randn(b, h, 1, d, generator=gen).to(DEVICE, torch.float16) for _ in range(2)]
    positions = [torch.randn(h, window, d, generator=gen).to(DEVICE) for _ in range(2)]
    position = torch.tensor([window - 1], device=DEVICE)
    expected = [(torch.cat((ring[:, :, :-1], token), dim=2) + pos).to(torch.float16)
                for ring, token, pos in zip(rings, tokens, positions)]
    windows = write_rings_and_read_windows(position, *tokens, *rings, *positions, torch.float16)
    for got, want in zip(windows, expected):
        assert got.dtype == torch.float16 and torch.equal(got[:, :, 0], want)


def test_compressed_row_goes_to_the_window_row_or_the_spare_row():
    """Complete windows (first token a multiple of the stride) land in row num_mem +
    first // stride; incomplete ones, those between strides and those past the buffer's
    rows in the spare last row. No other row changes. The batch's rows are at positions
    of their own, 1 apart, so that one row's window is complete where the other's is not."""
    b, h, d, num_mem, window, stride = 2, 2, 12, 2, 8, 4
    rows = num_mem + 5 + 1  # five windows, then the spare row
    buffers = torch.randn(2, b, h, rows, d, device=DEVICE)
    for step in range(0, 40):
        positions = [step, step + 1]
        new = torch.randn(b, h, 1, 2 * d, device=DEVICE)
        new_k, new_v = new[..., :d], new[..., d:]
        expected = buffers.clone()
        for row, position in enumerate(positions):
            start = position + 1 - window
            expected_row = rows - 1
            if start >= 0 and start % stride == 0 and num_mem + start // stride < rows - 1:
                expected_row = num_mem + start // stride
            expected[0, row, :, expected_row] = new_k[row, :, 0]
            expected[1, row, :, expected_row] = new_v[row, :, 0]
        write_compressed_rows(torch.tensor(positions, device=DEVICE), new_k, new_v, *buffers, num_mem, window, stride)
        assert torch.equal(buffers, expected), positions


def test_cache_rows_take_the_rotated_key_and_the_value():
    """With ``cache_rows`` the launch also writes each batch row's rotated key and value
    into row ``position`` of the cache's keys and values (rounded to their dtype), and no
    other row; the rings and windows are as without it."""
    b, h, window, d, capacity = 2, 2, 4, 16, 12
    gen = torch.Generator().manual_seed(2)
    rings = [torch.zeros(b, h, window, d, device=DEVICE) for _ in range(2)]
    positions = [torch.zeros(h, window, d, device=DEVICE) for _ in range(2)]
    cache = [torch.randn(b, h, capacity, d, generator=gen).to(DEVICE, torch.float16) for _ in range(2)]
    for step in range(3):
        position = torch.tensor([step, 2 * step + 5], device=DEVICE)
        new_k, new_v, rotated_k = (torch.randn(b, h, 1, d, generator=gen).to(DEVICE) for _ in range(3))
        expected = [c.clone() for c in cache]
        for row, at in enumerate(position.tolist()):
            expected[0][row, :, at] = rotated_k[row, :, 0].half()
            expected[1][row, :, at] = new_v[row, :, 0].half()
        windows = write_rings_and_read_windows(position, new_k, new_v, *rings, *positions,
                                               cache_rows=(rotated_k, *cache))
        assert torch.equal(windows[0][:, :, 0, -1], new_k[:, :, 0]) and torch.equal(windows[1][:, :, 0, -1],
                                                                                   new_v[:, :, 0])
        for got, want in zip(cache, expected):
            assert torch.equal(got, want), step


@gpu
def test_gpu_a_position_past_the_capacity_fails_the_assertion(tmp_path):
    """Past the cache's capacity the write fails a device-side assertion, which ends the
    process's CUDA context: run in a process of its own."""
    script = tmp_path / "overflow.py"
    script.write_text(
        "import torch\n"
        "from native_sparse_attention.kernels.cache_write import write_rings_and_read_windows\n"
        "z = lambda *shape: torch.zeros(*shape, device='cuda')\n"
        "write_rings_and_read_windows(torch.tensor([12], device='cuda'), z(1, 1, 1, 16), z(1, 1, 1, 16),\n"
        "                             z(1, 1, 4, 16), z(1, 1, 4, 16), z(1, 4, 16), z(1, 4, 16),\n"
        "                             cache_rows=(z(1, 1, 1, 16), z(1, 1, 12, 16), z(1, 1, 12, 16)))\n"
        "torch.cuda.synchronize()\n"
    )
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert "past the static cache's capacity" in result.stderr + result.stdout
