"""The decoding steps' linear layers (``kernels/decode_linear.py``) against ``F.linear``:
one or two layers per launch, shared or separate inputs, biases or none, weights kept in
another dtype than the one computed in, ReLU and GELU, and the compression networks' restriction
to rows whose window is complete.

Without CUDA the kernel runs under the Triton interpreter on small problems. Every output
starts poisoned with NaN.
"""

import pytest
import torch
import torch.nn.functional as F

from native_sparse_attention.kernels import decode_linear
from native_sparse_attention.kernels.decode_linear import CompleteWindows, decode_linears

from kernel_device import DEVICE, gpu, skip_without_kernels

skip_without_kernels()


@pytest.fixture(autouse=True)
def poisoned_buffers(poison):
    poison(decode_linear)


def _random(shape, generator, dtype, scale=1.0):
    return (torch.randn(shape, generator=generator) * scale).to(DEVICE, dtype)


def _reference(x, w, b, dtype, activation=None):
    """F.linear with every operand rounded to dtype, computed in float64, then the
    activation (GELU, as ``nn.GELU`` after ``F.linear``: of the output rounded to dtype)."""
    y = F.linear(*(None if t is None else t.to(dtype).double() for t in (x, w, b)))
    if activation == "gelu":
        return F.gelu(y.to(dtype).double())
    return y.relu() if activation == "relu" else y


def _check(outputs, wanted, dtype, tolerance):
    for got, want in zip(outputs, wanted, strict=True):
        assert got.dtype == dtype and got.shape == want.shape
        torch.testing.assert_close(got.double(), want, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("rows, dtype, weight_dtype, tolerance", [
    (1, torch.float32, torch.float32, 1e-5),
    (3, torch.float16, torch.float32, 2e-3),  # float32 master weights, computed in float16
    (21, torch.float16, torch.float16, 2e-3),
    (70, torch.float32, torch.float16, 1e-5),  # two row tiles
])
def test_two_layers_on_one_input_match_f_linear(rows, dtype, weight_dtype, tolerance):
    """The projection and the gates beside it: one input, two weights of odd widths (the
    second with a bias, the first without), every operand rounded to the compute dtype."""
    gen = torch.Generator().manual_seed(rows)
    k = 300  # not a multiple of the reduction step
    x = _random((rows, k), gen, torch.float32)
    weights = [_random((n, k), gen, weight_dtype, k**-0.5) for n in (37, 9)]
    biases = [None, _random((9,), gen, torch.float32)]
    outputs = decode_linears([x, x], weights, biases, dtype)
    _check(outputs, [_reference(x, w, b, dtype) for w, b in zip(weights, biases)], dtype, tolerance)


@pytest.mark.parametrize("splits", [2, 3, 6])
@pytest.mark.parametrize("activation", [None, "gelu"])
def test_split_reductions_match_f_linear(splits, activation):
    """Reductions split over several programs per output tile, whose last one sums the
    partials and finishes the tile: 5 steps of 64 in 3 splits (2, 2, 1 steps) and in 6
    (the last one empty), two segments of odd widths, two row tiles, GELU after the sum."""
    gen = torch.Generator().manual_seed(splits)
    k, dtype = 300, torch.float16
    x = _random((20, k), gen, torch.float32)
    weights = [_random((n, k), gen, torch.float32, k**-0.5) for n in (70, 9)]
    biases = [_random((70,), gen, torch.float32), None]
    outputs = decode_linears([x, x], weights, biases, dtype, activation=activation, splits=splits)
    _check(outputs, [_reference(x, w, b, dtype, activation) for w, b in zip(weights, biases)], dtype, 2e-3)


def test_split_reductions_are_deterministic():
    """The last program sums the partials in their order whichever program it is: two
    launches give the same bits, and the same result split as unsplit to float32's rounding."""
    gen = torch.Generator().manual_seed(9)
    x = _random((3, 512), gen, torch.float32)
    w = _random((40, 512), gen, torch.float32, 512**-0.5)
    first, second = (decode_linears([x], [w], [None], torch.float32, splits=4)[0] for _ in range(2))
    assert torch.equal(first, second)
    torch.testing.assert_close(first, decode_linears([x], [w], [None], torch.float32, splits=1)[0])


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
def test_two_layers_on_their_own_inputs_with_relu(dtype, tolerance):
    """The key and the value compression networks' first layers: separate inputs of
    different widths, both biased, ReLU on both."""
    gen = torch.Generator().manual_seed(1)
    inputs = [_random((5, 64), gen, dtype), _random((5, 48), gen, dtype)]
    weights = [_random((40, 64), gen, dtype, 64**-0.5), _random((24, 48), gen, dtype, 48**-0.5)]
    biases = [_random((40,), gen, dtype), _random((24,), gen, dtype)]
    outputs = decode_linears(inputs, weights, biases, dtype, activation="relu")
    _check(outputs, [_reference(*args, dtype, "relu") for args in zip(inputs, weights, biases)], dtype, tolerance)


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
def test_a_feed_forward_networks_layers_with_gelu(dtype, tolerance):
    """A transformer block's feed-forward network at a decoding step: its first layer
    with GELU on float32 master weights (the values span GELU's curved middle), then its
    second layer on the first's output."""
    gen = torch.Generator().manual_seed(3)
    x = _random((4, 96), gen, torch.float32)
    w1, b1 = _random((130, 96), gen, torch.float32, 96**-0.5), _random((130,), gen, torch.float32)
    w2, b2 = _random((96, 130), gen, torch.float32, 130**-0.5), _random((96,), gen, torch.float32)
    (hidden,) = decode_linears([x], [w1], [b1], dtype, activation="gelu")
    _check([hidden], [_reference(x, w1, b1, dtype, "gelu")], dtype, tolerance)
    assert (hidden < 0).any() and (hidden > 0).any()
    (y,) = decode_linears([hidden], [w2], [b2], dtype)
    _check([y], [_reference(hidden, w2, b2, dtype)], dtype, tolerance)


def test_one_layer_on_rows_with_a_gap():
    gen = torch.Generator().manual_seed(2)
    x, w = _random((2, 50), gen, torch.float32)[:, :40], _random((33, 40), gen, torch.float32, 40**-0.5)
    (y,) = decode_linears([x], [w], [None], torch.float32)
    _check([y], [_reference(x, w, None, torch.float32)], torch.float32, 1e-5)


@pytest.mark.parametrize("window, stride", [(8, 4), (6, 6)])
def test_only_rows_of_complete_windows_are_computed(window, stride):
    """Rows of batch rows whose window ending at their position is complete get the
    layer's output, the others zeros (also a row tile with no complete row, which reads
    no weights): positions before the first window, between windows and on them."""
    gen = torch.Generator().manual_seed(window)
    rows_per_position = 3
    position = torch.tensor([0, window - 2, window - 1, window, window - 1 + stride, 40 * stride + window - 1],
                            device=DEVICE)
    rows = rows_per_position * len(position)
    inputs = [_random((rows, 32), gen, torch.float32) for _ in range(2)]
    weights = [_random((20, 32), gen, torch.float32, 32**-0.5) for _ in range(2)]
    biases = [_random((20,), gen, torch.float32) for _ in range(2)]
    only = CompleteWindows(position, rows_per_position, window, stride)
    outputs = decode_linears(inputs, weights, biases, torch.float32, activation="relu", only=only)
    start = position.cpu() + 1 - window
    complete = ((start >= 0) & (start % stride == 0)).repeat_interleave(rows_per_position)
    assert complete.tolist().count(True) == 3 * rows_per_position
    wanted = [_reference(*args, torch.float32, "relu") * complete[:, None].to(DEVICE) for args in
              zip(inputs, weights, biases)]
    _check(outputs, wanted, torch.float32, 1e-5)

    none_complete = CompleteWindows(torch.tensor([1, 2], device=DEVICE), rows_per_position, window, stride)
    for y in decode_linears([t[:6] for t in inputs], weights, biases, torch.float32, only=none_complete):
        assert torch.equal(y, torch.zeros_like(y))


@gpu
@pytest.mark.parametrize("rows", [1, 8, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_the_layer_benchmarks_projections(rows, dtype):
    """At the layer benchmark's sizes, with float32 master weights (autocast's case):
    the projection with the gates, and a compression network's first layer."""
    gen = torch.Generator().manual_seed(rows)
    x = _random((rows, 2048), gen, dtype)
    weights = [_random((2304, 2048), gen, torch.float32, 2048**-0.5), _random((96, 2048), gen, torch.float32,
                                                                              2048**-0.5)]
    biases = [None, _random((96,), gen, torch.float32)]
    outputs = decode_linears([x, x], weights, biases, dtype)
    _check(outputs, [_reference(x, w, b, dtype) for w, b in zip(weights, biases)], dtype, 2e-2)
    windows = [_random((rows, 2048), gen, torch.float32) for _ in range(2)]
    first = [_random((2048, 2048), gen, torch.float32, 2048**-0.5) for _ in range(2)]
    first_biases = [_random((2048,), gen, torch.float32) for _ in range(2)]
    outputs = decode_linears(windows, first, first_biases, dtype, activation="relu")
    _check(outputs, [_reference(*args, dtype, "relu") for args in zip(windows, first, first_biases)], dtype, 2e-2)
    # A feed-forward network's first layer (dim 2048, expansion 4), with GELU.
    w1, b1 = _random((8192, 2048), gen, torch.float32, 2048**-0.5), _random((8192,), gen, torch.float32)
    (hidden,) = decode_linears([x], [w1], [b1], dtype, activation="gelu")
    _check([hidden], [_reference(x, w1, b1, dtype, "gelu")], dtype, 2e-2)


@gpu
@pytest.mark.parametrize("rows", [1, 8])
def test_gpu_split_reductions(rows):
    """Layers of few output tiles, whose reductions the launch splits over several
    programs: a feed-forward network's second layer (8192 -> 2048) and a byte-level
    model's logits (2048 -> 256), against F.linear and bit for bit across launches."""
    gen = torch.Generator().manual_seed(rows)
    dtype = torch.bfloat16
    for k, n in ((8192, 2048), (2048, 256)):
        x = _random((rows, k), gen, dtype)
        w, b = _random((n, k), gen, torch.float32, k**-0.5), _random((n,), gen, torch.float32)
        block_n, block_k, _ = decode_linear._TILES[16]
        assert decode_linear._splits(n // block_n, k // block_k, None, x.device) > 1
        (y,) = decode_linears([x], [w], [b], dtype)
        _check([y], [_reference(x, w, b, dtype)], dtype, 2e-2)
        for _ in range(20):
            assert torch.equal(decode_linears([x], [w], [b], dtype)[0], y)
