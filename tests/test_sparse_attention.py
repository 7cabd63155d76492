"""The SparseAttention layer on its PyTorch path: shapes, causality, decoding, gradients,
bad input."""

import copy
import itertools

import pytest
import torch
from torch import nn

from native_sparse_attention import (
    AttentionPoolCompress,
    CompressMLP,
    ConvCompress,
    FullAttention,
    GroupedCompressMLP,
    SparseAttention,
    SparseAttentionCache,
    TransformerCompress,
)
from native_sparse_attention.compress import _TiledWindows, plain_linear, sliding_windows

DIM, DIM_HEAD, HEADS = 32, 8, 4

# (compress_block_size, stride, selection_block_size, sliding_window_size)
BLOCK_CONFIGS = [(4, 2, 4, 3), (8, 4, 8, 5), (4, 4, 8, 2), (6, 2, 6, 0)]


def make_layer(block_config=BLOCK_CONFIGS[0], **kwargs) -> SparseAttention:
    cbs, stride, sbs, window = block_config
    options = dict(
        dim=DIM, dim_head=DIM_HEAD, heads=HEADS, sliding_window_size=window, compress_block_size=cbs,
        compress_block_sliding_stride=stride, selection_block_size=sbs, num_selected_blocks=2, causal=True,
    )
    options.update(kwargs)
    return SparseAttention(**options)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


SHAPE_MATRIX = list(
    itertools.product(
        [True, False],  # causal
        [1, 13, 32, 97],  # seq_len: one token, odd, exact block multiple, many blocks
        [None, 2, 1],  # kv_heads
        [0, 3],  # num_selected_blocks
        [True, False],  # query_heads_share_selected_kv
    )
)


@pytest.mark.parametrize("causal, seq_len, kv_heads, num_selected, share", SHAPE_MATRIX)
@pytest.mark.parametrize("block_config", BLOCK_CONFIGS[:2])
def test_shape_matrix(causal, seq_len, kv_heads, num_selected, share, block_config):
    layer = make_layer(
        block_config, causal=causal, kv_heads=kv_heads, num_selected_blocks=num_selected,
        query_heads_share_selected_kv=share,
    )
    x = torch.randn(2, seq_len, DIM)
    out = layer(x)
    assert out.shape == x.shape
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("block_config", BLOCK_CONFIGS)
@pytest.mark.parametrize("use_diff_topk", [False, True])
def test_diff_topk_and_block_configs(block_config, use_diff_topk):
    layer = make_layer(block_config, use_diff_topk=use_diff_topk, kv_heads=2)
    x = torch.randn(2, 45, DIM, requires_grad=True)
    layer(x).sum().backward()
    assert torch.isfinite(x.grad).all()


@pytest.mark.parametrize("block_config", BLOCK_CONFIGS)
@pytest.mark.parametrize("share", [True, False])
def test_causality(block_config, share):
    layer = make_layer(block_config, kv_heads=2, num_selected_blocks=3, query_heads_share_selected_kv=share)
    x = torch.randn(1, 50, DIM)
    out = layer(x)
    for i in (0, 7, 23, 40):
        changed = x.clone()
        changed[:, i + 1:] = torch.randn_like(changed[:, i + 1:])
        torch.testing.assert_close(layer(changed)[:, : i + 1], out[:, : i + 1], rtol=0, atol=0)


def test_a_prefix_selects_what_the_whole_sequence_selects():
    """Windows longer than a selection block leave blocks that only the same compressed keys
    overlap: exact ties. A token's output must not depend on how many tokens follow it."""
    layer = make_layer((20, 8, 16, 16), heads=9, kv_heads=3, num_selected_blocks=1, num_compressed_mem_kv=3)
    layer.to_qkv.weight.data.mul_(4.0)
    x = torch.randn(2, 63, DIM)
    with torch.no_grad():
        whole = layer(x)
        for length in (33, 34, 36, 40):
            torch.testing.assert_close(layer(x[:, :length]), whole[:, :length], rtol=1e-5, atol=1e-5)


def test_random_configurations_decode_and_pack_documents_as_the_whole_forward_does():
    """``tests/fuzz_layer.py --pytorch-only`` at fixed seeds: decoding against the parallel
    forward and packed documents against each alone, in float64 (seed 228's documents tie
    exactly, which the old tie-break got wrong; at seed 26458 the heads' sum rounded two
    tied blocks apart in the forward but not in a decoding step)."""
    from fuzz_layer import check_pytorch_path

    for seed in [*range(200, 240), 26458]:
        ok, report = check_pytorch_path(seed)
        assert ok, report


def test_non_causal_output_depends_on_the_future():
    layer = make_layer(causal=False)
    x = torch.randn(1, 30, DIM)
    changed = x.clone()
    changed[:, -1] += 1.0
    assert not torch.allclose(layer(x)[:, 0], layer(changed)[:, 0])


def _decode(layer, x, prefill_len):
    out, cache = layer(x[:, :prefill_len], return_cache=True)
    outputs = [out]
    for t in range(prefill_len, x.shape[1]):
        out, cache = layer(x[:, t : t + 1], cache=cache, return_cache=True)
        outputs.append(out)
    return torch.cat(outputs, dim=1), cache


DECODE_CASES = [
    # block_config, kv_heads, share, diff topk, prefill lengths
    (BLOCK_CONFIGS[0], 2, True, False, [1, 6, 17]),
    (BLOCK_CONFIGS[1], None, False, False, [1, 8, 31]),
    (BLOCK_CONFIGS[2], 1, True, True, [3, 16]),
    (BLOCK_CONFIGS[3], 2, False, True, [1, 12, 25]),
]


@pytest.mark.parametrize("block_config, kv_heads, share, diff_topk, prefills", DECODE_CASES)
def test_decoding_equals_parallel_forward(block_config, kv_heads, share, diff_topk, prefills):
    layer = make_layer(
        block_config, kv_heads=kv_heads, query_heads_share_selected_kv=share, use_diff_topk=diff_topk,
        num_selected_blocks=3, num_compressed_mem_kv=2,
    ).eval()
    x = torch.randn(2, 53, DIM)  # crosses many compression and selection block boundaries
    with torch.no_grad():
        parallel = layer(x)
        for prefill in prefills:
            decoded, cache = _decode(layer, x, prefill)
            assert (decoded - parallel).abs().max() <= 1e-5
            assert cache.seq_len == x.shape[1]


@pytest.mark.parametrize("block_config, share, chunks", [
    (BLOCK_CONFIGS[0], True, [7, 1, 16, 3, 9]),  # chunks that complete several compression windows
    (BLOCK_CONFIGS[3], False, [2, 20, 1, 13]),
])
def test_continuing_in_chunks_equals_parallel_forward(block_config, share, chunks):
    layer = make_layer(block_config, kv_heads=2, query_heads_share_selected_kv=share, num_selected_blocks=3,
                       num_compressed_mem_kv=1).eval()
    x = torch.randn(2, 11 + sum(chunks), DIM)
    with torch.no_grad():
        parallel = layer(x)
        out, cache = layer(x[:, :11], return_cache=True)
        outputs, start = [out], 11
        for size in chunks:
            out, cache = layer(x[:, start:start + size], cache=cache, return_cache=True)
            outputs.append(out)
            start += size
        _, prefilled = layer(x, return_cache=True)
    assert (torch.cat(outputs, dim=1) - parallel).abs().max() <= 1e-5
    for name in SparseAttentionCache.__dataclass_fields__:
        torch.testing.assert_close(getattr(cache, name), getattr(prefilled, name), atol=1e-6, rtol=1e-5)


def test_prefill_cache_equals_decoded_cache():
    layer = make_layer(BLOCK_CONFIGS[1], kv_heads=2).eval()
    x = torch.randn(1, 29, DIM)
    with torch.no_grad():
        _, prefilled = layer(x, return_cache=True)
        _, decoded = _decode(layer, x, 1)
    for name in SparseAttentionCache.__dataclass_fields__:
        torch.testing.assert_close(getattr(prefilled, name), getattr(decoded, name), atol=1e-6, rtol=1e-5)


COMPRESSORS = {
    "mlp": lambda: CompressMLP(4, DIM_HEAD, expand_factor=2.0),
    "grouped_mlp": lambda: GroupedCompressMLP(2, 4, DIM_HEAD),
    "conv": lambda: ConvCompress(2, 4, DIM_HEAD),
    "attention_pool": lambda: AttentionPoolCompress(4, DIM_HEAD),
    "transformer": lambda: TransformerCompress(4, DIM_HEAD, depth=1, heads=2),
}


@pytest.mark.parametrize("compressor", sorted(COMPRESSORS))
@pytest.mark.parametrize("use_diff_topk", [False, True])
def test_every_parameter_gets_a_finite_gradient(compressor, use_diff_topk):
    layer = make_layer(kv_heads=2, compress_mlp=COMPRESSORS[compressor](), use_diff_topk=use_diff_topk)
    x = torch.randn(2, 37, DIM)
    layer(x).pow(2).mean().backward()
    for name, parameter in layer.named_parameters():
        assert parameter.grad is not None, name
        assert torch.isfinite(parameter.grad).all(), name
        assert parameter.grad.abs().sum() > 0, name


@pytest.mark.parametrize("compressor", sorted(COMPRESSORS))
def test_a_sequence_shorter_than_a_window_still_gives_every_parameter_a_gradient(compressor):
    """No window is complete, so the compressed branch sees only its memory keys; the
    compression networks' gradients are then zeros, not missing (DistributedDataParallel
    fails a step that leaves a parameter without a gradient)."""
    layer = make_layer(kv_heads=2, compress_mlp=COMPRESSORS[compressor]())
    x = torch.randn(2, layer.compress_block_size - 1, DIM)
    layer(x).pow(2).mean().backward()
    compression = ("compress_k", "compress_v", "intrablock_pos_k", "intrablock_pos_v")
    for name, parameter in layer.named_parameters():
        assert parameter.grad is not None, name
        if name.startswith(compression):
            assert not parameter.grad.any(), name


@pytest.mark.parametrize("length, size, stride", [(37, 4, 2), (40, 8, 4), (24, 8, 8), (30, 6, 4), (8, 8, 4)])
def test_compiled_sliding_windows_match_unfold_with_gradients(length, size, stride):
    """Compiled, whole-stride windows take their own backward (a sum of shifted slices),
    others unfold's: both must match unfold, the positions past the last window included,
    also where the windows are the graph's output."""
    t = torch.randn(2, 3, length, 5, dtype=torch.float64, requires_grad=True)
    expected = t.unfold(2, size, stride).transpose(-1, -2)
    grad = torch.randn_like(expected)
    (expected_grad,) = torch.autograd.grad(expected, t, grad)
    compiled = torch.compile(sliding_windows, fullgraph=True)
    for windows in (sliding_windows(t, size, stride), compiled(t, size, stride)):
        assert torch.equal(windows, expected)
        (t_grad,) = torch.autograd.grad(windows, t, grad)
        torch.testing.assert_close(t_grad, expected_grad, rtol=0, atol=1e-12)


@pytest.mark.parametrize("length, size, stride", [(24, 8, 8), (8, 8, 4), (40, 8, 4)])
def test_compiled_windows_never_alias_their_input(length, size, stride):
    """Windows that already lie contiguously (size == stride, or one window) are copied
    too: returned as a view of the input, torch 2.11's compiled graphs gave them a zero
    gradient, which the test above shows only on that version."""
    t = torch.randn(2, 3, length, 5)
    windows = _TiledWindows.forward(t, size, stride)
    assert torch.equal(windows, t.unfold(2, size, stride).transpose(-1, -2))
    assert windows.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()


def test_compressors_are_independent_for_keys_and_values():
    layer = make_layer(compress_mlp=CompressMLP(4, DIM_HEAD))
    assert layer.compress_k is not layer.compress_v
    assert all(
        a.data_ptr() != b.data_ptr() for a, b in zip(layer.compress_k.parameters(), layer.compress_v.parameters())
    )


def test_diff_topk_lets_the_selection_train_the_compression():
    """With the compressed branch gated off, the compression networks only learn through
    the straight-through selection gates."""
    grads = {}
    for use_diff_topk in (False, True):
        torch.manual_seed(0)
        layer = make_layer(kv_heads=2, use_diff_topk=use_diff_topk)
        with torch.no_grad():
            layer.to_gates[0].bias[0::3] = -100.0
        layer(torch.randn(2, 40, DIM)).pow(2).sum().backward()
        grads[use_diff_topk] = sum(p.grad.abs().sum() for p in layer.compress_k.parameters())
    assert grads[False] < 1e-20
    assert grads[True] > 1e-6


def test_gates_start_favouring_the_sliding_branch():
    layer = make_layer()
    recorded = {}
    layer.recorder = recorded
    layer(torch.randn(1, 10, DIM))
    compressed, selected, sliding = recorded["gates"].unbind(0)
    assert (sliding > 0.8).all() and (compressed < 0.2).all() and (selected < 0.2).all()


def test_a_custom_strategy_combine_mlp_is_used():
    combine = nn.Sequential(nn.Linear(DIM, 16), nn.Tanh(), nn.Linear(16, 3 * HEADS))
    layer = make_layer(strategy_combine_mlp=combine)
    layer(torch.randn(1, 9, DIM)).sum().backward()
    assert combine[0].weight.grad is not None


class _LinearSubclass(nn.Linear):
    """A linear layer whose forward could be overridden: the layer must call it."""


def test_the_gate_projection_shares_the_qkv_matmul():
    """The default (plain linear) gate projection is folded into the qkv matmul; a subclass
    is called as a module. Both give the same output and gradients."""
    folded = make_layer(kv_heads=2)
    nn.init.normal_(folded.to_gates[0].weight, std=0.5)
    separate = copy.deepcopy(folded)
    plain = separate.to_gates[0]
    separate.to_gates[0] = _LinearSubclass(plain.in_features, plain.out_features)
    separate.to_gates[0].load_state_dict(plain.state_dict())
    calls = []
    separate.to_gates[0].register_forward_hook(lambda *args: calls.append(1))
    x = torch.randn(2, 40, DIM)
    for layer in (folded, separate):
        layer(x).pow(2).sum().backward()
    assert calls == [1]
    torch.testing.assert_close(folded(x), separate(x))
    for (name, p_folded), p_separate in zip(folded.named_parameters(), separate.parameters()):
        torch.testing.assert_close(p_folded.grad, p_separate.grad, msg=name)



def test_hooked_projections_run_as_modules():
    """A plain linear qkv, gate or output projection that carries a hook is called as a
    module: neither the qkv matmul (the gates) nor the Triton path's gated node (the output
    projection) folds it in."""
    layer = make_layer(kv_heads=2)
    hooked = (layer.to_qkv, layer.to_gates[0], layer.to_out)
    assert all(map(plain_linear, hooked))
    calls = []
    for module in hooked:
        module.register_forward_hook(lambda module, args, out: calls.append(module))
    assert not any(map(plain_linear, hooked))
    layer(torch.randn(1, 20, DIM))
    assert calls == list(hooked)
    assert not plain_linear(_LinearSubclass(4, 4))

# ---------------------------------------------------------------------------- bad input

BAD_CONFIGS = [
    (dict(heads=4, kv_heads=3), ValueError, "divisible by kv_heads"),
    (dict(compress_block_sliding_stride=4, selection_block_size=6), ValueError, "multiple of compress_block_sliding_stride"),
    (dict(compress_block_size=2, compress_block_sliding_stride=4, selection_block_size=8), ValueError, "compress_block_size"),
    (dict(dim_head=7), ValueError, "dim_head must be even"),
    (dict(dim=0), ValueError, "dim must be >= 1"),
    (dict(num_selected_blocks=-1), ValueError, "num_selected_blocks"),
    (dict(heads=2.0), TypeError, "heads must be an int"),
    (dict(compress_mlp="mlp"), TypeError, "compress_mlp must be an nn.Module"),
    (dict(use_triton_kernel=True, selection_block_size=8, compress_block_sliding_stride=4), ValueError, "multiple of 16"),
    (dict(use_triton_kernel=True, use_flex_attention=True), ValueError, "at most one"),
]


@pytest.mark.parametrize("overrides, error, message", BAD_CONFIGS)
def test_bad_configuration_is_rejected(overrides, error, message):
    with pytest.raises(error, match=message):
        make_layer(**overrides)


@pytest.mark.parametrize(
    "x, error, message",
    [
        (torch.randn(4, DIM), ValueError, r"shape \[batch, seq_len, dim\]"),
        (torch.randn(1, 4, DIM + 1), ValueError, "32 features in its last dim.*got 33"),
        (torch.randn(1, 0, DIM), ValueError, "at least one token"),
        (torch.ones(1, 4, DIM, dtype=torch.long), TypeError, "floating-point"),
        (torch.randn(1, 4, DIM, dtype=torch.float64), TypeError, "x is torch.float64 but .* torch.float32"),
        (torch.randn(1, 4, DIM, device="meta"), ValueError, "x is on meta but .* on cpu"),
        ([[0.0] * DIM], TypeError, "torch.Tensor"),
    ],
)
@pytest.mark.parametrize("kind", ["sparse", "full"])
def test_bad_input_is_rejected(x, error, message, kind):
    """The dense baseline rejects what the sparse layer does, with the same messages."""
    layer = make_layer() if kind == "sparse" else FullAttention(DIM, DIM_HEAD, HEADS)
    with pytest.raises(error, match=message):
        layer(x)


def test_autocast_takes_inputs_of_other_dtypes():
    layer = make_layer()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(torch.randn(1, 4, DIM, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16


def test_a_cache_that_does_not_fit_is_rejected():
    layer = make_layer(kv_heads=2)
    _, cache = layer(torch.randn(1, 9, DIM), return_cache=True)
    with pytest.raises(ValueError, match="does not fit"):
        layer(torch.randn(2, 1, DIM), cache=cache)
    other = make_layer(kv_heads=4)
    with pytest.raises(ValueError, match="does not fit"):
        other(torch.randn(1, 1, DIM), cache=cache)
    other_blocks = make_layer(BLOCK_CONFIGS[1], kv_heads=2)
    with pytest.raises(ValueError, match="compressed blocks and buffer"):
        other_blocks(torch.randn(1, 1, DIM), cache=cache)
    with pytest.raises(TypeError, match="SparseAttentionCache"):
        layer(torch.randn(1, 1, DIM), cache={"keys": None})
    with pytest.raises(ValueError, match="causal"):
        make_layer(causal=False)(torch.randn(1, 3, DIM), return_cache=True)


def test_autocast_trains_and_decodes_on_the_pytorch_path():
    """bfloat16 autocast (here the CPU's) over the PyTorch path: the projections run in
    bfloat16, the branches in float32; a training step and decoding stay close to float32."""
    layer = make_layer(BLOCK_CONFIGS[1], kv_heads=2, num_selected_blocks=3)
    x = torch.randn(2, 41, DIM, requires_grad=True)
    expected = layer(x)
    expected.sum().backward()
    expected_grad, x.grad = x.grad, None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x)
        out.float().sum().backward()
        with torch.no_grad():
            decoded, _ = _decode(layer.eval(), x.detach(), 30)
    assert out.dtype == torch.bfloat16
    for got, want in ((out, expected), (x.grad, expected_grad), (decoded, expected)):
        assert torch.isfinite(got).all()
        assert ((got.float() - want).norm() / want.norm()).item() < 3e-2
