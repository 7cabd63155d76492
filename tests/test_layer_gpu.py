"""The layer's fast paths against its PyTorch path.

On CUDA both fast paths (Triton selection kernel, FlexAttention) run compiled at long
sequences. Without CUDA the Triton path's glue (compressed kernels, fused selection,
selection kernel, gate combination) runs under the Triton interpreter on a small layer.
Decoding with a cache runs on the Triton kernels too, without gradients.
"""

import copy
import os
from dataclasses import replace

import pytest
import torch

from native_sparse_attention import SparseAttention, sparse_attention
from native_sparse_attention.kernels import selection as selection_kernels

from joined_decoding import decode_joined

CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")

# The PyTorch path's sliding-window reference broadcasts its values to [b, h, n, n, d]:
# 4 heads at n = 4096 keep it (and its gradient) near 20 GB each.
CONFIG = dict(
    dim=512, dim_head=64, heads=4, kv_heads=2, sliding_window_size=128, compress_block_size=32,
    compress_block_sliding_stride=16, selection_block_size=64, num_selected_blocks=4, causal=True,
)
SMALL_CONFIG = dict(
    dim=32, dim_head=16, heads=2, kv_heads=1, sliding_window_size=8, compress_block_size=8,
    compress_block_sliding_stride=4, selection_block_size=16, num_selected_blocks=2,
)


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).norm() / expected.float().norm()).item()


def _run(layer, x, grad_out, autocast: bool | torch.dtype = False):
    """(output, input gradient, parameter gradients) of one step; ``autocast``: True for
    bf16 autocast, or the autocast dtype."""
    x = x.detach().clone().requires_grad_()
    layer.zero_grad(set_to_none=True)
    dtype = autocast if isinstance(autocast, torch.dtype) else torch.bfloat16
    with torch.autocast(x.device.type, dtype=dtype, enabled=autocast is not False):
        out = layer(x)
    out.backward(grad_out)
    grads = {name: p.grad.detach().clone() for name, p in layer.named_parameters()}
    return out.detach().clone(), x.grad.detach().clone(), grads


def _gradient_errors(grads: dict, reference_grads: dict) -> dict:
    """Per parameter, the error relative to its own gradient's norm or, where that is near
    zero, to a thousandth of the whole gradient's: without memory keys, a bias shared by all
    compressed keys shifts every compressed score of a query equally, so its exact gradient
    is 0 and both paths return rounding noise."""
    floor = 1e-3 * torch.stack([grad.norm() for grad in reference_grads.values()]).norm()
    return {name: ((grad - reference_grads[name]).norm() / torch.maximum(reference_grads[name].norm(), floor)).item()
            for name, grad in grads.items()}


def _layer_pair(config, **options):
    """A fast-path layer and a PyTorch-path layer with the same weights."""
    fast_options = {key: value for key, value in options.items() if key.startswith("use_") and key != "use_diff_topk"}
    common = {key: value for key, value in options.items() if key not in fast_options}
    fast = SparseAttention(**config, **common, **fast_options)
    reference = SparseAttention(**config, **common)
    reference.load_state_dict(fast.state_dict())
    return fast, reference


def _sharpened_pair(monkeypatch, config=SMALL_CONFIG, **options):
    """A Triton-path and a PyTorch-path layer (SMALL_CONFIG by default) with the same
    weights, the Triton one taking its fast path on CPU tensors (under the interpreter). A
    sharper compressed attention separates the block scores, so float32 rounding cannot
    reorder the selection."""
    fast, reference = _layer_pair(config, use_triton_kernel=True, **options)
    with torch.no_grad():
        fast.to_qkv.weight.mul_(4.0)
        reference.to_qkv.weight.copy_(fast.to_qkv.weight)
    monkeypatch.setattr(SparseAttention, "_use_fast_path", lambda self, x: self.use_triton_kernel)
    return fast, reference


def _assert_close(fast_run, reference_run, out_tol, dx_tol, grad_tol):
    (out, dx, grads), (ref_out, ref_dx, ref_grads) = fast_run, reference_run
    assert _relative_error(out, ref_out) < out_tol
    assert _relative_error(dx, ref_dx) < dx_tol
    for name, grad in grads.items():
        assert _relative_error(grad, ref_grads[name]) < grad_tol, name


@pytest.mark.parametrize("fast_path", ["use_triton_kernel", "use_flex_attention"])
@pytest.mark.parametrize("share", [True, False])
@pytest.mark.parametrize("use_diff_topk", [False, True])
@pytest.mark.gpu
@requires_cuda
def test_fast_path_matches_pytorch_path(fast_path, share, use_diff_topk):
    torch.manual_seed(0)
    fast, reference = _layer_pair(
        CONFIG, query_heads_share_selected_kv=share, use_diff_topk=use_diff_topk, **{fast_path: True}
    )
    fast, reference = fast.cuda(), reference.cuda()
    x = torch.randn(1, 4096, CONFIG["dim"], device="cuda")
    grad_out = torch.randn_like(x)

    # float32: every dot of the kernels in float32 (no TF32), so the selection is the
    # same up to near-ties and the paths agree to float32 rounding (on an H100: output
    # 3.5e-7, input gradient 5.5e-7, parameter gradients 7.5e-6 at worst).
    ref_run = _run(reference, x, grad_out)
    _assert_close(_run(fast, x, grad_out), ref_run, 1e-5, 1e-5, 1e-4)

    # bf16 autocast: the fast path stays finite and close.
    out_bf16, dx_bf16, _ = _run(fast, x, grad_out, autocast=True)
    assert torch.isfinite(out_bf16).all() and torch.isfinite(dx_bf16).all()
    assert _relative_error(out_bf16, ref_run[0]) < 5e-2


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("fast_path", ["use_triton_kernel", "use_flex_attention"])
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_compiled_fast_path_matches_eager(fast_path, mode):
    """torch.compile with fullgraph=True, which fails on any graph break: the Triton
    kernels are custom operators inside the graph, FlexAttention is traced. With
    mode="reduce-overhead" the third step replays the forward and backward from CUDA
    graphs (the first two warm up and record)."""
    torch.manual_seed(0)
    layer = SparseAttention(**CONFIG, **{fast_path: True}).cuda()
    compiled = copy.deepcopy(layer)
    compiled.compile(fullgraph=True, mode=mode)
    x = torch.randn(2, 2048, CONFIG["dim"], device="cuda")
    grad_out = torch.randn_like(x)
    for _ in range(3):
        torch.compiler.cudagraph_mark_step_begin()
        compiled_run = _run(compiled, x, grad_out, autocast=True)
    _assert_close(compiled_run, _run(layer, x, grad_out, autocast=True), 2e-2, 5e-2, 1e-1)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("fast_path", ["use_triton_kernel", "use_flex_attention"])
@pytest.mark.parametrize("seq_len", [1, 5, CONFIG["compress_block_size"] - 1, CONFIG["compress_block_size"]])
def test_fast_path_at_sequences_of_at_most_one_window(fast_path, seq_len):
    """Below one compression window the compressed branch attends to its memory keys
    alone and the compression networks run on no windows: their gradients are zeros,
    present as on the PyTorch path (DistributedDataParallel fails a step that leaves a
    parameter without one)."""
    torch.manual_seed(0)
    fast, reference = _layer_pair(CONFIG, **{fast_path: True})
    fast, reference = fast.cuda(), reference.cuda()
    x = torch.randn(2, seq_len, CONFIG["dim"], device="cuda")
    grad_out = torch.randn_like(x)
    (out, dx, grads), (ref_out, ref_dx, ref_grads) = _run(fast, x, grad_out), _run(reference, x, grad_out)
    assert _relative_error(out, ref_out) < 1e-5 and _relative_error(dx, ref_dx) < 1e-5
    assert grads.keys() == ref_grads.keys()
    assert max(_gradient_errors(grads, ref_grads).values()) < 1e-4
    if seq_len < CONFIG["compress_block_size"]:
        compression = ("compress_k", "compress_v", "intrablock_pos_k", "intrablock_pos_v")
        assert not any(grad.any() for name, grad in grads.items() if name.startswith(compression))


@pytest.mark.gpu
@requires_cuda
def test_layer_graphed_by_pytorch_matches_eager():
    """An eager training loop can replay the layer's forward and backward from CUDA graphs
    through torch.cuda.make_graphed_callables (autocast then must not cache its casts of
    the weights while capturing): the Triton path captures, side streams included, and
    replays on new inputs give the eager layer's output and gradients."""
    torch.manual_seed(0)
    layer = SparseAttention(**CONFIG, use_triton_kernel=True).cuda()
    sample = torch.randn(2, 2048, CONFIG["dim"], device="cuda", requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
        graphed = torch.cuda.make_graphed_callables(copy.deepcopy(layer), (sample,))
    for _ in range(2):
        x, grad_out = torch.randn_like(sample), torch.randn_like(sample)
        _assert_close(_run(graphed, x, grad_out), _run(layer, x, grad_out, autocast=True), 2e-2, 5e-2, 1e-1)


@pytest.mark.gpu
@requires_cuda
def test_captures_leave_no_memory_behind():
    """``cuda_graph.capture`` warms a function up on a side stream, and cuBLAS keeps a
    workspace for every stream it has run on: once the first capture has made the side
    stream's, capturing again and dropping the graph gives back all it allocated."""
    from native_sparse_attention.cuda_graph import capture

    a = torch.randn(512, 512, device="cuda")
    graph, product = capture(lambda: a @ a)
    del graph, product
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    for _ in range(3):
        graph, product = capture(lambda: a @ a)
        graph.replay()
        torch.testing.assert_close(product, a @ a)
        del graph, product
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == allocated


@pytest.mark.skipif(CUDA or os.environ.get("TRITON_INTERPRET") != "1", reason="interpreter only")
@pytest.mark.parametrize("share, use_diff_topk, causal, key_major", [
    (True, True, True, False), (False, False, False, False), (True, False, True, True)])
def test_triton_path_matches_pytorch_path_interpreted(monkeypatch, share, use_diff_topk, causal, key_major):
    """``key_major``: the selection's forward runs key-major, which float32 inputs do not by
    default, with the window's launch of its own that writes the gated sum after it."""
    torch.manual_seed(1)
    key_major_runs = []
    if key_major:
        tuned, key_major_forward = selection_kernels.default_launch_config, selection_kernels._key_major_forward
        monkeypatch.setattr(selection_kernels, "default_launch_config",
                            lambda *args, **kwargs: replace(tuned(*args, **kwargs), key_major_forward=True))
        monkeypatch.setattr(selection_kernels, "_key_major_forward",
                            lambda *args, **kwargs: key_major_runs.append(1) or key_major_forward(*args, **kwargs))
    fast, reference = _sharpened_pair(
        monkeypatch, causal=causal, query_heads_share_selected_kv=share, use_diff_topk=use_diff_topk
    )
    x = torch.randn(1, 40, SMALL_CONFIG["dim"])
    grad_out = torch.randn_like(x)
    reference_run = _run(reference, x, grad_out)

    # The fast path never builds the [n, n / stride] probabilities of the PyTorch path.
    def materialising(*args, **kwargs):
        raise AssertionError("the fast path called the PyTorch compressed branch")

    monkeypatch.setattr(sparse_attention, "compressed_attend", materialising)
    monkeypatch.setattr(sparse_attention, "selection_block_scores", materialising)
    _assert_close(_run(fast, x, grad_out), reference_run, 1e-5, 1e-5, 1e-4)
    assert bool(key_major_runs) is key_major


def _half_precision_runs(fast, reference, x, grad_out, dtype):
    """The fast layer cast to ``dtype`` (weights too, no autocast) and the reference
    layer given the same rounded weights in float32: their runs on the same input."""
    fast = fast.to(dtype)
    reference.load_state_dict({name: value.float() for name, value in fast.state_dict().items()})
    return _run(fast, x.to(dtype), grad_out.to(dtype)), _run(reference, x, grad_out)


@pytest.mark.skipif(CUDA or os.environ.get("TRITON_INTERPRET") != "1", reason="interpreter only")
def test_float16_layer_without_autocast_matches_pytorch_path_interpreted(monkeypatch):
    """Weights and activations in float16, as a model cast with ``.half()`` runs: every
    kernel and node of the Triton path takes float16 parameters (the interpreter's bf16
    dots are unreliable; the GPU test runs bf16)."""
    torch.manual_seed(0)
    fast, reference = _sharpened_pair(monkeypatch, causal=True, num_compressed_mem_kv=1)
    x = torch.randn(2, 40, SMALL_CONFIG["dim"])
    (out, dx, grads), reference_run = _half_precision_runs(fast, reference, x, torch.randn_like(x), torch.float16)
    assert out.dtype == dx.dtype == torch.float16
    assert all(grad.dtype == torch.float16 for grad in grads.values())
    _assert_close((out, dx, grads), reference_run, 5e-3, 5e-3, 5e-2)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("precision", ["bfloat16 weights", "float16 autocast"])
def test_half_precision_stays_close_to_pytorch_path(precision):
    """The layer cast to bfloat16 (weights too, no autocast), or under float16 autocast
    (float32 weights), against the float32 PyTorch path. Half-precision scores may rank
    near-tied blocks otherwise than float32's: the output stays close (as in
    test_fast_path_matches_pytorch_path), single gradients need not."""
    torch.manual_seed(0)
    fast, reference = _layer_pair(CONFIG, use_triton_kernel=True)
    fast, reference = fast.cuda(), reference.cuda()
    x = torch.randn(1, 4096, CONFIG["dim"], device="cuda")
    grad_out = torch.randn_like(x)
    if precision == "bfloat16 weights":
        (out, dx, grads), (ref_out, ref_dx, _) = _half_precision_runs(fast, reference, x, grad_out, torch.bfloat16)
        assert out.dtype == dx.dtype == torch.bfloat16
        assert all(grad.dtype == torch.bfloat16 for grad in grads.values())
    else:
        out, dx, grads = _run(fast, x, grad_out, autocast=torch.float16)
        ref_out, ref_dx, _ = _run(reference, x, grad_out)
    assert all(torch.isfinite(grad).all() for grad in grads.values())
    assert _relative_error(out, ref_out) < 5e-2 and _relative_error(dx, ref_dx) < 1e-1


@pytest.mark.skipif(CUDA or os.environ.get("TRITON_INTERPRET") != "1", reason="interpreter only")
def test_triton_path_under_deterministic_algorithms_interpreted(monkeypatch, deterministic):
    """torch.use_deterministic_algorithms: the selection's dK / dV and the windows'
    positions gradient are summed from per-program partials, and the groups of 2 that
    would take dQ from the dK / dV pass keep the dQ pass; the step still matches the
    PyTorch path."""
    from conftest import launched_constexprs

    from native_sparse_attention.kernels import compress_windows

    torch.manual_seed(1)
    fast, reference = _sharpened_pair(monkeypatch, causal=True, num_compressed_mem_kv=1)
    selection_launches = launched_constexprs(monkeypatch, selection_kernels)
    window_launches = launched_constexprs(monkeypatch, compress_windows)
    x = torch.randn(2, 40, SMALL_CONFIG["dim"])
    grad_out = torch.randn_like(x)
    _assert_close(_run(fast, x, grad_out), _run(reference, x, grad_out), 1e-5, 1e-5, 1e-4)
    dq_modes = [launch["ATOMIC_DQ"] for launch in selection_launches if "ATOMIC_DQ" in launch]
    assert dq_modes and not any(dq_modes)
    partials = [launch["PARTIALS"] for launch in selection_launches + window_launches if "PARTIALS" in launch]
    assert partials == [True] * 3  # the selection's dK / dV, the keys' and the values' windows


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("kv_heads", [2, 1])
def test_deterministic_algorithms_give_the_same_bits_at_every_step(deterministic, kv_heads):
    """Under torch.use_deterministic_algorithms two training steps on the same input give
    the same output and gradients, bit for bit: groups of 2 (dQ and the forward would
    otherwise take atomic adds) and of 4, bf16 autocast; and match the default launches."""
    torch.manual_seed(0)
    layer = SparseAttention(**{**CONFIG, "kv_heads": kv_heads}, use_triton_kernel=True).cuda()
    x = torch.randn(2, 4096, CONFIG["dim"], device="cuda")
    grad_out = torch.randn_like(x)
    first, second = (_run(layer, x, grad_out, autocast=True) for _ in range(2))
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    assert all(torch.equal(grad, second[2][name]) for name, grad in first[2].items())
    torch.use_deterministic_algorithms(False)
    _assert_close(_run(layer, x, grad_out, autocast=True), first, 1e-2, 2e-2, 5e-2)


def _decode(layer, x, prefill_len, chunks=()):
    """Outputs [b, n, dim] of a prefill of ``prefill_len`` tokens, then of continuations
    by ``chunks`` tokens each, then one token per step."""
    out, cache = layer(x[:, :prefill_len], return_cache=True)
    outputs, start = [out], prefill_len
    for size in (*chunks, *[1] * (x.shape[1] - prefill_len - sum(chunks))):
        out, cache = layer(x[:, start:start + size], cache=cache, return_cache=True)
        outputs.append(out)
        start += size
    return torch.cat(outputs, dim=1)


@pytest.mark.skipif(CUDA or os.environ.get("TRITON_INTERPRET") != "1", reason="interpreter only")
@pytest.mark.parametrize("share, use_diff_topk", [(True, False), (False, True)])
def test_triton_decoding_matches_pytorch_path_interpreted(monkeypatch, share, use_diff_topk):
    torch.manual_seed(2)
    fast, reference = _sharpened_pair(
        monkeypatch, causal=True, query_heads_share_selected_kv=share, use_diff_topk=use_diff_topk,
        num_compressed_mem_kv=2,
    )
    x = torch.randn(2, 37, SMALL_CONFIG["dim"])
    with torch.no_grad():
        expected = reference(x)

        def materialising(*args, **kwargs):
            raise AssertionError("the fast path called the PyTorch compressed branch")

        with monkeypatch.context() as patch:
            patch.setattr(sparse_attention, "compressed_attend", materialising)
            patch.setattr(sparse_attention, "sliding_window_attend", materialising)
            decoded = _decode(fast, x, 20, chunks=(1, 6, 1, 4))
    assert _relative_error(decoded, expected) < 1e-5
    # With gradients the steps fall back to the PyTorch path and still agree.
    assert _relative_error(_decode(fast, x, 33).detach(), expected) < 1e-5


def _decoding_pair(share: bool):
    """CONFIG layers on CUDA in eval mode: the Triton path and the PyTorch path, same weights."""
    fast, reference = _layer_pair(CONFIG, query_heads_share_selected_kv=share, use_triton_kernel=True)
    return fast.cuda().eval(), reference.cuda().eval()


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("share", [True, False])
def test_triton_decoding_matches_pytorch_path(share):
    torch.manual_seed(3)
    fast, reference = _decoding_pair(share)
    x = torch.randn(1, 4096 + 64, CONFIG["dim"], device="cuda")
    with torch.no_grad():
        expected = reference(x)[:, 4096:]
        decoded = _decode(fast, x, 4096, chunks=(1, 31))[:, 4096:]
        assert _relative_error(decoded, expected) < 1e-2
        with torch.autocast("cuda", dtype=torch.bfloat16):
            decoded_bf16 = _decode(fast, x, 4096)[:, 4096:]
    assert torch.isfinite(decoded_bf16).all()
    assert _relative_error(decoded_bf16, expected) < 5e-2


def _decode_static(layer, x, prefill_len, capacity):
    """Outputs [b, n, dim] of a prefill of ``prefill_len`` tokens, then one token per step
    through a StaticSparseAttentionCache of ``capacity`` tokens."""
    out, cache = layer(x[:, :prefill_len], return_cache=True)
    cache = layer.static_cache(cache, capacity)
    outputs = [out]
    for t in range(prefill_len, x.shape[1]):
        outputs.append(layer(x[:, t:t + 1], cache=cache))
    assert cache.position.tolist() == [x.shape[1]] * x.shape[0]
    return torch.cat(outputs, dim=1)


@pytest.mark.skipif(CUDA or os.environ.get("TRITON_INTERPRET") != "1", reason="interpreter only")
@pytest.mark.parametrize("share, prefill_len, split", [(True, 13, False), (False, 1, False), (True, 5, True)])
def test_static_cache_decoding_matches_pytorch_path_interpreted(monkeypatch, share, prefill_len, split):
    """``split``: the compressed forward and the block selection split each step's work
    among programs, as they do for few queries on a large GPU (denser compressed keys make
    the interpreter's 16-key tiles several)."""
    from native_sparse_attention.kernels import compressed

    torch.manual_seed(4)
    config = SMALL_CONFIG
    if split:
        config = {**SMALL_CONFIG, "compress_block_size": 4, "compress_block_sliding_stride": 2}
        monkeypatch.setattr(compressed, "_FEW_ROWS_PROGRAMS_PER_SM", 64)
    fast, reference = _sharpened_pair(
        monkeypatch, config, causal=True, query_heads_share_selected_kv=share, num_compressed_mem_kv=2
    )
    x = torch.randn(2, 34, SMALL_CONFIG["dim"])
    with torch.no_grad():
        expected = reference(x)
        decoded = _decode_static(fast, x, prefill_len, capacity=37)
    assert _relative_error(decoded, expected) < 1e-5


@pytest.mark.skipif(CUDA or os.environ.get("TRITON_INTERPRET") != "1", reason="interpreter only")
def test_static_steps_keep_the_forward_of_hooked_linear_layers_interpreted(monkeypatch):
    """A static step computes the projections, gates and compression networks in its own
    kernel only where they are plain layers: hooked ones run their forward, hooks and all,
    every step, and the outputs still match the PyTorch path."""
    torch.manual_seed(5)
    fast, reference = _sharpened_pair(monkeypatch, SMALL_CONFIG, causal=True)
    x = torch.randn(2, 20, SMALL_CONFIG["dim"])
    prefill_len = 12
    hooked = {"to_qkv": fast.to_qkv, "gates": fast.to_gates[0], "to_out": fast.to_out,
              "compress_v": fast.compress_v.net[0]}
    calls = dict.fromkeys(hooked, 0)
    for name, module in hooked.items():
        module.register_forward_hook(lambda *_, name=name: calls.__setitem__(name, calls[name] + 1))
    with torch.no_grad():
        expected = reference(x)
        _, cache = fast(x[:, :prefill_len], return_cache=True)
        calls = dict.fromkeys(hooked, 0)
        static = fast.static_cache(cache, 24)
        decoded = torch.cat([fast(x[:, t:t + 1], cache=static) for t in range(prefill_len, x.shape[1])], dim=1)
    assert calls == dict.fromkeys(hooked, x.shape[1] - prefill_len)
    assert _relative_error(decoded, expected[:, prefill_len:]) < 1e-5


# Layer shapes off the beaten track: a top-1 selection, heads in groups of five, no memory
# keys or no window, head dims that are no power of two, windows wider than the sequence,
# overlapping compression windows of stride 2.
ODD_CONFIGS = {
    "groups_of_five_top_one": dict(
        dim=24, dim_head=24, heads=5, kv_heads=1, sliding_window_size=5, compress_block_size=6,
        compress_block_sliding_stride=2, selection_block_size=16, num_selected_blocks=1, causal=True),
    "no_memory_no_window": dict(
        dim=16, dim_head=8, heads=2, kv_heads=1, sliding_window_size=0, compress_block_size=16,
        compress_block_sliding_stride=8, selection_block_size=32, num_selected_blocks=2,
        num_compressed_mem_kv=0, causal=True),
    "per_head_straight_through_wide_window": dict(
        dim=48, dim_head=40, heads=2, kv_heads=1, sliding_window_size=60, compress_block_size=8,
        compress_block_sliding_stride=4, selection_block_size=32, num_selected_blocks=3,
        num_compressed_mem_kv=2, causal=True, query_heads_share_selected_kv=False, use_diff_topk=True),
    "window_one_no_selection": dict(
        dim=32, dim_head=16, heads=2, kv_heads=2, sliding_window_size=1, compress_block_size=12,
        compress_block_sliding_stride=4, selection_block_size=16, num_selected_blocks=0, causal=True),
    "non_causal_groups_of_two": dict(
        dim=24, dim_head=16, heads=6, kv_heads=3, sliding_window_size=7, compress_block_size=4,
        compress_block_sliding_stride=4, selection_block_size=16, num_selected_blocks=2),
}


@pytest.mark.skipif(CUDA or os.environ.get("TRITON_INTERPRET") != "1", reason="interpreter only")
@pytest.mark.parametrize("config", ODD_CONFIGS.values(), ids=ODD_CONFIGS.keys())
def test_odd_configurations_match_pytorch_path_interpreted(monkeypatch, config):
    """Training step, then (causal layers) decoding token by token, in chunks and through a
    static cache whose steps split their work among programs."""
    from native_sparse_attention.kernels import compressed

    torch.manual_seed(6)
    fast, reference = _sharpened_pair(monkeypatch, config)
    x = torch.randn(2, 35, config["dim"])
    grad_out = torch.randn_like(x)
    (out, dx, grads), (ref_out, ref_dx, ref_grads) = _run(fast, x, grad_out), _run(reference, x, grad_out)
    assert _relative_error(out, ref_out) < 1e-5
    assert _relative_error(dx, ref_dx) < 1e-5
    for name, error in _gradient_errors(grads, ref_grads).items():
        assert error < 1e-4, name
    if not config.get("causal", False):
        return

    monkeypatch.setattr(compressed, "_FEW_ROWS_PROGRAMS_PER_SM", 64)
    fast.eval()
    with torch.no_grad():
        expected = ref_out[:, 30:]
        assert _relative_error(_decode(fast, x, 30)[:, 30:], expected) < 1e-5
        assert _relative_error(_decode(fast, x, 30, chunks=(3,))[:, 30:], expected) < 1e-5
        assert _relative_error(_decode_static(fast, x, 30, capacity=37)[:, 30:], expected) < 1e-5


@pytest.mark.skipif(CUDA or os.environ.get("TRITON_INTERPRET") != "1", reason="interpreter only")
def test_one_seed_of_the_random_configurations_interpreted():
    """``tests/fuzz_layer.py`` (random configurations, run by hand for many seeds) at a seed
    that draws a causal layer with memory keys, two documents and decoding steps."""
    from fuzz_layer import check

    ok, report = check(6)
    assert ok, report
    assert "'causal': True" in report and "'num_compressed_mem_kv': 1" in report


@pytest.mark.skipif(CUDA or os.environ.get("TRITON_INTERPRET") != "1", reason="interpreter only")
def test_joined_static_caches_decode_each_row_at_its_own_position_interpreted(monkeypatch):
    """Rows prefilled alone to different lengths (13, 5 and 22 tokens: complete and
    incomplete compression windows, selection blocks of their own) and joined by
    ``cat_caches`` decode together: each row's outputs are the PyTorch path's at its own
    positions."""
    torch.manual_seed(8)
    fast, reference = _sharpened_pair(monkeypatch, SMALL_CONFIG, causal=True, num_compressed_mem_kv=2)
    lengths, steps = (13, 5, 22), 6
    x = torch.randn(len(lengths), 34, SMALL_CONFIG["dim"])
    with torch.no_grad():
        expected = reference(x)
    decoded, _ = decode_joined(fast, x, lengths, steps, capacity=30)
    for row, length in enumerate(lengths):
        assert _relative_error(decoded[row], expected[row, length:length + steps]) < 1e-5


@pytest.mark.skipif(CUDA or os.environ.get("TRITON_INTERPRET") != "1", reason="interpreter only")
def test_cat_caches_rejects_caches_of_other_shapes():
    from native_sparse_attention.static_cache import cat_caches

    layer = SparseAttention(**SMALL_CONFIG, causal=True, use_triton_kernel=True)
    with torch.no_grad():
        _, cache = layer(torch.randn(1, 9, SMALL_CONFIG["dim"]), return_cache=True)
    static = layer.static_cache(cache, 16)
    assert cat_caches([static]).position.tolist() == [9]
    with pytest.raises(ValueError, match="one capacity"):
        cat_caches([static, layer.static_cache(cache, 20)])
    with pytest.raises(TypeError, match=r"caches\[1\] must be a static cache"):
        cat_caches([static, cache])
    with pytest.raises(TypeError, match="non-empty sequence"):
        cat_caches([])


@pytest.mark.skipif(CUDA or os.environ.get("TRITON_INTERPRET") != "1", reason="interpreter only")
def test_static_cache_rejects_what_it_cannot_decode(monkeypatch):
    layer = SparseAttention(**SMALL_CONFIG, causal=True)
    with torch.no_grad():
        _, cache = layer(torch.randn(1, 9, SMALL_CONFIG["dim"]), return_cache=True)
    with pytest.raises(ValueError, match="use_triton_kernel"):
        layer.static_cache(cache, 16)
    layer.use_triton_kernel = True
    with monkeypatch.context() as patch:
        patch.delenv("TRITON_INTERPRET", raising=False)
        with pytest.raises(ValueError, match="CUDA"):
            layer.static_cache(cache, 16)
    with pytest.raises(ValueError, match="capacity"):
        layer.static_cache(cache, 9)
    with pytest.raises(TypeError, match="capacity"):
        layer.static_cache(cache, 16.0)
    static = layer.static_cache(cache, 16)
    with pytest.raises(ValueError, match="no_grad"):
        layer(torch.randn(1, 1, SMALL_CONFIG["dim"]), cache=static)
    with torch.no_grad(), pytest.raises(ValueError, match="one token"):
        layer(torch.randn(1, 2, SMALL_CONFIG["dim"]), cache=static)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("share", [True, False])
def test_cuda_graph_decoding_matches_pytorch_path(share):
    """One step captured in a CUDA graph (bf16 autocast) and replayed for every token."""
    from native_sparse_attention.static_cache import capture_step

    torch.manual_seed(5)
    fast, reference = _decoding_pair(share)
    prefill, steps = 4096, 80
    x = torch.randn(1, prefill + steps, CONFIG["dim"], device="cuda")
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        expected = _decode(fast, x, prefill)[:, prefill:]
        _, cache = fast(x[:, :prefill], return_cache=True)
        static = fast.static_cache(cache, prefill + steps)
        step_input = x[:, prefill:prefill + 1].clone()
        graph, step_output = capture_step(lambda: fast(step_input, cache=static), [static])
        outputs = []
        for t in range(prefill, prefill + steps):
            step_input.copy_(x[:, t:t + 1])
            graph.replay()
            outputs.append(step_output.clone())
    assert static.position.tolist() == [prefill + steps]
    graphed = torch.cat(outputs, dim=1)
    assert _relative_error(graphed, expected) < 1e-2
    with torch.no_grad():
        assert _relative_error(graphed, reference(x)[:, prefill:]) < 5e-2


@pytest.mark.gpu
@requires_cuda
def test_flex_path_runs_at_several_lengths():
    """The FlexAttention path compiled for each sequence length it meets (static shapes),
    two graphs a length (selected and sliding), past Dynamo's recompile limit (here 1)."""
    from torch._dynamo.utils import counters

    limit_hits = sum(count for reason, count in counters["unimplemented"].items() if "recompile limit" in reason)
    torch.manual_seed(0)
    layer = SparseAttention(**CONFIG, use_flex_attention=True).cuda()
    with torch._dynamo.config.patch(recompile_limit=1):  # not monkeypatch: see test_flex.py
        for n in (1024, 640, 2048):
            x = torch.randn(1, n, CONFIG["dim"], device="cuda", requires_grad=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                layer(x).sum().backward()
            assert torch.isfinite(x.grad).all()
    assert sum(count for reason, count in counters["unimplemented"].items() if "recompile limit" in reason) == limit_hits
