"""The decoder LM: loss, sampling, and cached decoding against recomputation."""

import copy
import gc
import os
import weakref

import pytest
import torch

from native_sparse_attention import FullAttention, SparseAttention, StaticSparseAttentionCache, Transformer
from native_sparse_attention import static_cache as static_cache_module
from native_sparse_attention.static_cache import cat_caches

from greedy_ties import assert_same_up_to_ties
from joined_decoding import decode_joined
from native_sparse_attention.kernels import decode_linear
from native_sparse_attention.transformer import FeedForward, top_k_filter

SPARSE_KWARGS = dict(
    sliding_window_size=6, compress_block_size=4, compress_block_sliding_stride=2,
    selection_block_size=4, num_selected_blocks=2,
)


def make_model(use_sparse_attn=True, sparse_attn_kwargs=SPARSE_KWARGS, **kwargs):
    torch.manual_seed(0)
    return Transformer(
        num_tokens=64, dim=32, depth=2, heads=4, dim_head=8, kv_heads=2,
        use_sparse_attn=use_sparse_attn, sparse_attn_kwargs=sparse_attn_kwargs, **kwargs,
    )


@pytest.mark.parametrize("use_sparse_attn, attention_type", [(True, SparseAttention), (False, FullAttention)])
def test_attention_type_and_loss(use_sparse_attn, attention_type):
    model = make_model(use_sparse_attn)
    assert all(isinstance(attn, attention_type) for attn, _ in model.layers)
    ids = torch.randint(0, 64, (2, 33))
    loss = model(ids, return_loss=True)
    assert loss.ndim == 0 and 3.0 < loss.item() < 5.5  # about log(64) at initialisation
    loss.backward()
    assert model(ids).shape == (2, 33, 64)


# Ops whose CUDA kernels PyTorch refuses under torch.use_deterministic_algorithms (from its
# documentation; cumsum only of floats): train.py --deterministic must reach none of them.
_REFUSED_UNDER_DETERMINISTIC = {"nll_loss2d_forward", "cumsum", "histc", "bincount", "median", "put", "put_",
                                "_embedding_bag"}


@pytest.mark.parametrize("use_sparse_attn", [True, False])
def test_loss_runs_no_op_that_deterministic_cuda_refuses(use_sparse_attn):
    """Recorded on the CPU, where PyTorch does not refuse them: the loss over [b * n, vocab]
    rows is nll_loss_forward; over [b, vocab, n] it was nll_loss2d_forward."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Recorder(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func._schema.name.split("::")[-1]
            if name == "cumsum" and not args[0].is_floating_point():
                name = "cumsum of integers"  # refused for floats only
            self.ops.add(name)
            return func(*args, **(kwargs or {}))

    model = make_model(use_sparse_attn)
    ids = torch.randint(0, 64, (2, 33))
    with Recorder() as recorder:
        model(ids, return_loss=True).backward()
    assert "nll_loss_forward" in recorder.ops
    assert not recorder.ops & _REFUSED_UNDER_DETERMINISTIC, recorder.ops & _REFUSED_UNDER_DETERMINISTIC


@pytest.mark.parametrize("use_sparse_attn", [True, False])
def test_greedy_sampling_with_cache_equals_without(use_sparse_attn):
    model = make_model(use_sparse_attn)
    prompt = torch.randint(0, 64, (2, 5))
    without_cache = model.sample(prompt, 45, temperature=0.0)
    with_cache = model.sample(prompt, 45, temperature=0.0, use_cache_kv=True)
    assert without_cache.shape == (2, 40)
    assert torch.equal(with_cache, without_cache)


def _each_alone(model, prompts, seq_len, **kwargs):
    return [model.sample(p, seq_len, temperature=0.0, **kwargs) for p in prompts]


@pytest.mark.parametrize("use_sparse_attn", [True, False])
def test_prompts_of_different_lengths_decode_as_one_batch(use_sparse_attn):
    """Without caches the rows are padded on the right: each row's greedy continuation is
    the one it gets alone, ``seq_len - p`` tokens long, and ``on_token`` shows -1 for the
    rows already complete (the longest prompt here needs 2 tokens, the shortest 17)."""
    model = make_model(use_sparse_attn)
    prompts = [torch.randint(0, 64, (n,)) for n in (3, 18, 9)]
    streamed = []
    got = model.sample(prompts, 20, temperature=0.0, on_token=lambda tokens: streamed.append(tokens.clone()))
    assert [len(g) for g in got] == [17, 2, 11]
    for mine, alone in zip(got, _each_alone(model, prompts, 20)):
        assert torch.equal(mine, alone)
    streamed = torch.stack(streamed, dim=1)
    assert streamed.shape == (3, 17)
    for row, generated in zip(streamed, got):
        assert torch.equal(row[: len(generated)], generated) and (row[len(generated):] == -1).all()
    # A prompt as long as seq_len gets nothing; temperature > 0 draws.
    drawn = model.sample([prompts[0], torch.randint(0, 64, (20,))], 20, temperature=1.0)
    assert [len(g) for g in drawn] == [17, 0]
    if not use_sparse_attn:  # full attention's static caches are plain PyTorch
        cached = model.sample(prompts, 20, temperature=0.0, use_cache_kv=True)
        assert all(torch.equal(mine, uncached) for mine, uncached in zip(cached, got))
    # One final length per prompt.
    shorter = model.sample(prompts, [8, 20, 13], temperature=0.0)
    assert [len(g) for g in shorter] == [5, 2, 4]
    assert all(torch.equal(mine, longer[: len(mine)]) for mine, longer in zip(shorter, got))


@pytest.mark.skipif(torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
                    reason="interpreter only")
def test_prompts_of_different_lengths_decode_through_static_caches_interpreted():
    """Through caches each prompt is prefilled alone and the rows decode at their own
    positions: each row's greedy continuation is the one it gets alone from the layers'
    dynamic caches."""
    model = make_model(sparse_attn_kwargs=dict(
        sliding_window_size=16, compress_block_size=8, compress_block_sliding_stride=4,
        selection_block_size=16, num_selected_blocks=2, use_triton_kernel=True,
    )).eval()
    prompts = [torch.randint(0, 64, (n,)) for n in (9, 20, 14)]
    got = model.sample(prompts, 27, temperature=0.0, use_cache_kv=True)
    assert [len(g) for g in got] == [18, 7, 13]
    for mine, alone in zip(got, _each_alone(model, prompts, 27, use_cache_kv=True)):
        assert torch.equal(mine, alone)


def test_prompts_of_different_lengths_are_checked():
    model = make_model()
    with pytest.raises(ValueError, match="Triton"):
        model.sample([torch.zeros(2, dtype=torch.long), torch.zeros(3, dtype=torch.long)], 6, use_cache_kv=True)
    with pytest.raises(ValueError, match="at least one prompt"):
        model.sample([], 6)
    with pytest.raises(ValueError, match=r"prompt\[1\] must be a non-empty 1-d integer tensor"):
        model.sample([torch.zeros(2, dtype=torch.long), torch.zeros(1, 3, dtype=torch.long)], 6)
    with pytest.raises(ValueError, match=r"prompt\[0\] must be a non-empty"):
        model.sample([torch.zeros(0, dtype=torch.long)], 6)
    with pytest.raises(TypeError, match=r"prompt\[0\] must be a torch.Tensor"):
        model.sample([[1, 2]], 6)
    two = [torch.zeros(2, dtype=torch.long), torch.zeros(3, dtype=torch.long)]
    with pytest.raises(ValueError, match="one length per prompt: 2 prompts, 3 lengths"):
        model.sample(two, [5, 6, 7])
    with pytest.raises(TypeError, match="sequence of ints"):
        model.sample(two, [5, 6.0])
    with pytest.raises(TypeError, match="list of prompts"):
        model.sample(two[0], [5])


def test_cuda_graph_sampling_needs_cuda_and_triton_layers():
    triton_kwargs = {**SPARSE_KWARGS, "selection_block_size": 16, "use_triton_kernel": True}
    assert make_model(sparse_attn_kwargs=triton_kwargs).has_graphable_decoding()
    assert not make_model().has_graphable_decoding()
    assert make_model(use_sparse_attn=False).has_graphable_decoding()  # static caches of plain PyTorch
    prompt = torch.randint(0, 64, (1, 5))
    with pytest.raises(ValueError, match="CUDA"):
        make_model().sample(prompt, 9, use_cuda_graph=True)
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="use_triton_kernel"):
            make_model().cuda().sample(prompt.cuda(), 9, use_cuda_graph=True)


@pytest.mark.skipif(torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
                    reason="interpreter only")
@pytest.mark.parametrize("use_sparse_attn", [True, False])
def test_graphed_steps_equal_cached_steps_interpreted(monkeypatch, use_sparse_attn):
    """The model's graphed decoding step with the capture replaced by plain calls (the
    interpreter has no graphs): its static caches stay alive with it, and its logits equal
    those of eager cached steps; with sparse layers and with full attention."""

    class Replayed:
        def __init__(self, step):
            self.step, self.out = step, step()

        def replay(self):
            self.out.copy_(self.step())

    def run_instead_of_capturing(step, warmup_steps=3):
        for _ in range(warmup_steps):
            step()
        graph = Replayed(step)
        return graph, graph.out

    monkeypatch.setattr(static_cache_module, "capture", run_instead_of_capturing)
    model = make_model(use_sparse_attn, sparse_attn_kwargs=dict(
        sliding_window_size=16, compress_block_size=8, compress_block_sliding_stride=4,
        selection_block_size=16, num_selected_blocks=2, use_triton_kernel=True,
    )).eval()
    ids = torch.randint(0, 64, (2, 27))
    with torch.no_grad():
        _, caches = model(ids[:, :19], return_caches=True)
        step = model._graphed_step(caches, capacity=ids.shape[1], example_ids=ids[:, 18:19])
        static = [weakref.ref(cache.position) for cache in step.caches]
        gc.collect()
        assert all(ref() is not None for ref in static)
        for t in range(19, ids.shape[1]):
            graphed = step(ids[:, t:t + 1]).clone()
            cached, caches = model(ids[:, t:t + 1], caches=caches, return_caches=True)
            torch.testing.assert_close(graphed, cached, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
                    reason="interpreter only")
def test_feed_forward_decoding_rows_run_on_the_decoding_kernel_hooks_and_all(monkeypatch):
    """A static decoding step's feed-forward network: both layers on ``decode_linears``,
    the GELU in the first one's launch, the same output as its forward; a hooked GELU
    runs as a module (hook and all), a hooked network as a whole."""
    torch.manual_seed(1)
    ff = FeedForward(40, expansion=2.5)
    x = torch.randn(3, 1, 40)
    activations = []
    kernel = decode_linear.decode_linears
    monkeypatch.setattr(decode_linear, "decode_linears",
                        lambda *args, **kwargs: activations.append(kwargs.get("activation")) or kernel(*args, **kwargs))
    with torch.no_grad():
        expected = ff(x)
        assert activations == []
        torch.testing.assert_close(ff(x, decoding=True), expected, atol=1e-5, rtol=1e-5)
        assert activations == ["gelu", None]

        gelu_calls = []
        gelu_hook = ff.net[2].register_forward_hook(lambda *_: gelu_calls.append(1))
        activations.clear()
        torch.testing.assert_close(ff(x, decoding=True), expected, atol=1e-5, rtol=1e-5)
        assert activations == [None, None] and gelu_calls == [1]
        gelu_hook.remove()

        ff.net.register_forward_hook(lambda *_: gelu_calls.append(2))
        activations.clear()
        torch.testing.assert_close(ff(x, decoding=True), expected, atol=1e-5, rtol=1e-5)
        assert activations == [] and gelu_calls == [1, 2]


def _cuda_model(use_sparse_attn=True):
    torch.manual_seed(0)
    return Transformer(
        num_tokens=64, dim=64, depth=2, heads=4, dim_head=16, kv_heads=2, use_sparse_attn=use_sparse_attn,
        sparse_attn_kwargs=dict(
            sliding_window_size=32, compress_block_size=16, compress_block_sliding_stride=8,
            selection_block_size=16, num_selected_blocks=2, use_triton_kernel=True,
        ),
    ).cuda().eval()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("use_sparse_attn", [True, False])
def test_cuda_graph_steps_equal_cached_steps(autocast, use_sparse_attn):
    """The logits of graph replays against those of eager cached steps, token for token,
    for sparse layers on the Triton kernels and for full attention."""
    model = _cuda_model(use_sparse_attn)
    ids = torch.randint(0, 64, (2, 237), device="cuda")
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        _, caches = model(ids[:, :37], return_caches=True)
        replay = model._graphed_step(caches, capacity=ids.shape[1], example_ids=ids[:, 36:37])
        for t in range(37, ids.shape[1]):
            graphed = replay(ids[:, t:t + 1]).float()
            cached, caches = model(ids[:, t:t + 1], caches=caches, return_caches=True)
            torch.testing.assert_close(graphed, cached.float(), atol=2e-2 if autocast else 1e-4, rtol=0)
        generated = model.sample(ids[:, :37], 60, temperature=1.0, use_cuda_graph=True)
    assert generated.shape == (2, 23) and generated.dtype == torch.long


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("use_sparse_attn", [True, False])
def test_prompts_of_different_lengths_replay_from_a_cuda_graph(autocast, use_sparse_attn):
    """Rows at their own positions in one captured step, of sparse or full attention: in
    float32 each row's greedy continuation is the one it gets alone; under bf16 autocast,
    where the batch's size changes the matmuls' rounding, the replayed steps give the
    eager steps' tokens up to ties of the logits."""
    model = _cuda_model(use_sparse_attn)
    prompts = [torch.randint(0, 64, (n,), device="cuda") for n in (37, 301, 150, 16)]
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        got = model.sample(prompts, 420, temperature=0.0, use_cuda_graph=True)
        if autocast:
            expected = model.sample(prompts, 420, temperature=0.0, use_cache_kv=True)
        else:
            expected = _each_alone(model, prompts, 420, use_cuda_graph=True)
    assert [len(g) for g in got] == [383, 119, 270, 404]
    if autocast:
        assert_same_up_to_ties(model, [p.tolist() for p in prompts], [g.tolist() for g in got],
                               [e.tolist() for e in expected])
    else:
        for mine, wanted in zip(got, expected):
            assert torch.equal(mine, wanted)


@pytest.mark.parametrize("chunk", [1, 5])
def test_full_attention_continues_from_a_cache(chunk):
    torch.manual_seed(0)
    attn = FullAttention(dim=32, dim_head=8, heads=4, kv_heads=2)
    x = torch.randn(2, 12, 32)
    _, cache = attn(x[:, :7], return_cache=True)
    out, cache = attn(x[:, 7:7 + chunk], cache=cache, return_cache=True)
    torch.testing.assert_close(out, attn(x[:, :7 + chunk])[:, 7:])
    assert cache.seq_len == 7 + chunk


def test_full_attention_static_cache_decodes_rows_at_their_own_positions():
    """Rows prefilled alone to 5, 12 and 9 tokens, joined, then decoded together one token
    per step: each row's outputs are those of the whole sequence at its positions."""
    torch.manual_seed(0)
    attn = FullAttention(dim=32, dim_head=8, heads=4, kv_heads=2).eval()
    lengths, steps = (5, 12, 9), 6
    x = torch.randn(3, 20, 32)
    with torch.no_grad():
        expected = attn(x)
    decoded, _ = decode_joined(attn, x, lengths, steps, capacity=20)
    for row, length in enumerate(lengths):
        torch.testing.assert_close(decoded[row], expected[row, length:length + steps], atol=1e-5, rtol=1e-5)


def test_full_attention_static_cache_rejects_what_it_cannot_decode():
    attn = FullAttention(dim=32, dim_head=8, heads=4, kv_heads=2)
    with torch.no_grad():
        _, cache = attn(torch.randn(1, 9, 32), return_cache=True)
    with pytest.raises(ValueError, match="capacity"):
        attn.static_cache(cache, 9)
    with pytest.raises(TypeError, match="capacity"):
        attn.static_cache(cache, 16.0)
    with pytest.raises(TypeError, match="FullAttentionCache"):
        attn.static_cache(static_cache_module, 16)
    with pytest.raises(ValueError, match="causal"):
        FullAttention(dim=32, dim_head=8, heads=4, causal=False).static_cache(cache, 16)
    static = attn.static_cache(cache, 16)
    with pytest.raises(ValueError, match="no_grad"):
        attn(torch.randn(1, 1, 32), cache=static)
    with torch.no_grad():
        with pytest.raises(ValueError, match="one token"):
            attn(torch.randn(1, 2, 32), cache=static)
        with pytest.raises(ValueError, match="in place"):
            attn(torch.randn(1, 1, 32), cache=static, return_cache=True)
    sparse = StaticSparseAttentionCache(*static.step_state, static.keys, static.values, *[static.keys] * 4)
    with pytest.raises(TypeError, match=r"caches\[1\] is a StaticFullAttentionCache"):
        cat_caches([sparse, static])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("autocast", [False, True])
def test_full_attention_on_cuda_matches_the_cpu(autocast):
    """On CUDA the dense layer norms its input with the RMSNorm kernel node: its output
    and gradients against the same layer's PyTorch ops on the CPU."""
    torch.manual_seed(0)
    layer = FullAttention(dim=256, dim_head=64, heads=4, kv_heads=2)
    with torch.no_grad():
        layer.norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 300, 256)
    runs = []
    for device in ("cpu", "cuda"):
        model = copy.deepcopy(layer).to(device)
        inputs = x.detach().to(device).requires_grad_()
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            out = model(inputs)
        out.float().square().sum().backward()
        runs.append([out.float(), inputs.grad, *(p.grad for p in model.parameters())])
    tolerance = 3e-2 if autocast else 1e-4
    for cpu, cuda in zip(*runs):
        error = (cuda.cpu() - cpu).abs().max() / cpu.abs().max()
        assert error < tolerance


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_compiled_full_attention_matches_eager(mode):
    """The dense layer, the benchmarks' baseline, compiled with fullgraph=True (its norm
    node and weight concatenation are custom operators): output and gradients of the
    third step (replayed from CUDA graphs with reduce-overhead) against eager steps."""
    torch.manual_seed(0)
    layer = FullAttention(dim=256, dim_head=64, heads=4, kv_heads=2).cuda()
    with torch.no_grad():
        layer.norm.weight.uniform_(0.5, 1.5)
    compiled = copy.deepcopy(layer)
    compiled.compile(fullgraph=True, mode=mode)
    x = torch.randn(2, 1000, 256, device="cuda")
    grad_out = torch.randn_like(x)

    def run(model):
        model.zero_grad(set_to_none=True)
        inputs = x.detach().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(inputs)
        out.backward(grad_out)
        # Cloned: a replayed graph's next step overwrites its outputs.
        return [out.float().clone(), inputs.grad.clone(), *(p.grad.clone() for p in model.parameters())]

    for _ in range(3):
        torch.compiler.cudagraph_mark_step_begin()
        compiled_run = run(compiled)
    for got, expected in zip(compiled_run, run(layer), strict=True):
        assert (got - expected).abs().max() / expected.abs().max() < 2e-2


def _saved_bytes_and_grads(model: Transformer, ids: torch.Tensor):
    """Bytes of the tensors autograd saves for the backward of one loss, and the gradients."""
    saved = []

    def pack(tensor):
        saved.append(tensor.numel() * tensor.element_size())
        return tensor

    model.zero_grad(set_to_none=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(ids, return_loss=True)
    loss.backward()
    return sum(saved), loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("use_sparse_attn", [True, False])
def test_activation_checkpointing_keeps_the_gradients_and_saves_less(use_sparse_attn):
    """Each block recomputed in the backward: the same loss and gradients (the CPU path is
    deterministic), from a fraction of the saved activations."""
    model = make_model(use_sparse_attn=use_sparse_attn)
    ids = torch.randint(0, 64, (2, 41), generator=torch.Generator().manual_seed(0))
    kept_bytes, loss, grads = _saved_bytes_and_grads(model, ids)
    model.activation_checkpointing = True
    recomputed_bytes, recomputed_loss, recomputed_grads = _saved_bytes_and_grads(model, ids)
    assert torch.equal(recomputed_loss, loss)
    for grad, recomputed in zip(grads, recomputed_grads, strict=True):
        torch.testing.assert_close(recomputed, grad, rtol=0, atol=0)
    assert recomputed_bytes < kept_bytes / 3
    # Inference and decoding keep their own paths.
    with torch.no_grad():
        assert torch.equal(model(ids), make_model(use_sparse_attn=use_sparse_attn)(ids))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_activation_checkpointing_on_the_triton_path():
    """On the kernels under bf16 autocast: gradients close to those of kept activations
    (the recomputed forward may round its atomic adds differently), at a lower peak."""
    kwargs = dict(sliding_window_size=64, compress_block_size=16, compress_block_sliding_stride=8,
                  selection_block_size=16, num_selected_blocks=4, use_triton_kernel=True)
    torch.manual_seed(0)
    model = Transformer(num_tokens=256, dim=256, depth=4, heads=8, dim_head=32, kv_heads=4,
                        sparse_attn_kwargs=kwargs).cuda()
    ids = torch.randint(0, 256, (2, 4097), device="cuda")
    runs = []
    for recompute in (False, True):
        model.activation_checkpointing = recompute
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(ids, return_loss=True)
        loss.backward()
        runs.append((torch.cuda.max_memory_allocated(), loss.item(), [p.grad.float() for p in model.parameters()]))
    (kept_peak, kept_loss, kept_grads), (peak, recomputed_loss, grads) = runs
    assert recomputed_loss == pytest.approx(kept_loss, rel=1e-3)
    for grad, kept in zip(grads, kept_grads, strict=True):
        assert (grad - kept).abs().max() <= 2e-2 * kept.abs().max()
    assert peak < 0.6 * kept_peak


def test_sampling_respects_the_filter_and_restores_training_mode():
    model = make_model().train()
    out = model.sample(torch.randint(0, 64, (7,)), 12, temperature=1.0, filter_thres=0.9, use_cache_kv=True)
    assert out.shape == (5,) and out.dtype == torch.long
    assert model.training


def test_top_k_filter_keeps_the_largest_logits():
    logits = torch.arange(10.0).repeat(2, 1)
    filtered = top_k_filter(logits, 0.8)
    assert torch.isfinite(filtered).sum(-1).tolist() == [2, 2]
    assert torch.isfinite(filtered[:, -2:]).all()


def test_the_config_rebuilds_the_model():
    model = make_model()
    clone = Transformer(**model.config)
    clone.load_state_dict(model.state_dict())
    ids = torch.randint(0, 64, (1, 20))
    torch.testing.assert_close(clone(ids), model(ids))


def test_bad_input_is_rejected():
    model = make_model()
    with pytest.raises(ValueError, match="integer tensor"):
        model(torch.randn(1, 4))
    with pytest.raises(ValueError, match="filter_thres"):
        model.sample(torch.zeros(1, 2, dtype=torch.long), 4, filter_thres=1.0)
    with pytest.raises(ValueError, match="causal"):
        make_model(causal=False).sample(torch.zeros(1, 2, dtype=torch.long), 4)
