"""Decoding in buffers of a fixed capacity, so that a step can be captured in a CUDA graph.

A step of ``SparseAttentionCache`` decoding launches some 20 kernels whose shapes grow
with the cache, and the host issuing them takes several times longer than their work. A
``StaticSparseAttentionCache`` holds every buffer at its final size and each batch row's
position in a device tensor: a step reads the positions on the device (the Triton
kernels, the rotary embedding, the writes into the buffers) and advances them in place, so
the same launches serve every step and one captured graph replays them all
(``capture_step``). Rows need not share a position: ``cat_caches`` joins the caches of
prompts of different lengths into one batch.

Each step compresses the window that ends at its token, whether or not the window is
complete, and writes the result to the window's row when it is and to a spare row
otherwise: no step branches on the host, and causal masking hides every row past the
last window a token may see.

The steps' linear layers (both layers' projections, the sparse layer's gates and default
compression networks) run on ``kernels/decode_linear.py``, which reads each weight in
place in its own dtype, two layers per launch, and computes the compression networks only
for rows that complete a window (the others write zeros to the spare row). Layers
replaced or hooked, or dtypes ``F.linear`` would refuse, keep the modules' forward.
"""

from __future__ import annotations

import numbers
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, TypeVar

import torch
from einops import rearrange
from torch import nn

from native_sparse_attention.compress import CompressMLP, has_hooks, plain_linear
from native_sparse_attention.cuda_graph import capture
from native_sparse_attention.rotary import rotated_query_and_key_heads, split_qkv_heads
from native_sparse_attention.selection import num_compressed_blocks

if TYPE_CHECKING:
    from native_sparse_attention.sparse_attention import SparseAttention, SparseAttentionCache

__all__ = ["StaticKVCache", "StaticSparseAttentionCache", "capture_step", "cat_caches", "static_cache",
           "static_key_values", "static_step"]

T = TypeVar("T")
C = TypeVar("C", bound="StaticKVCache")


@dataclass(frozen=True)
class StaticKVCache:
    """What every layer's static cache holds, in fixed-size buffers that each step updates
    in place.

    position: [b] int64, each batch row's number of tokens cached (its next token's
    position);
    keys (rotary applied), values: [b, hk, capacity, d], rows ``>= position`` unused.
    """

    position: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    @property
    def step_state(self) -> tuple[torch.Tensor, ...]:
        """What a step changes that a later step reads (``capture_step`` restores it after
        the capture's warm-up); the other rows a step writes, each replay rewrites first."""
        return (self.position,)


@dataclass(frozen=True)
class StaticSparseAttentionCache(StaticKVCache):
    """Decoding state of one ``SparseAttention`` layer: ``StaticKVCache``'s, and

    compressed_keys, compressed_values: [b, hk, num_mem + windows + 1, d]: the memory
    key/values, then one row per compression window that fits in ``capacity`` tokens,
    then a spare row that steps completing no window write to;
    recent_keys, recent_values: [b, hk, compress_block_size, d], the raw keys/values of
    the last ``compress_block_size`` tokens, token t in row ``t % compress_block_size``.
    """

    compressed_keys: torch.Tensor
    compressed_values: torch.Tensor
    recent_keys: torch.Tensor
    recent_values: torch.Tensor

    @property
    def step_state(self) -> tuple[torch.Tensor, ...]:
        return self.position, self.recent_keys, self.recent_values


def static_cache(layer: SparseAttention, cache: SparseAttentionCache, capacity: int) -> StaticSparseAttentionCache:
    """A ``StaticSparseAttentionCache`` of ``capacity`` tokens holding ``cache``'s state.

    The memory key/values are copied from the layer's parameters: build the cache anew
    after changing them.
    """
    from native_sparse_attention.sparse_attention import SparseAttentionCache

    if not isinstance(cache, SparseAttentionCache):
        raise TypeError(f"cache must be a SparseAttentionCache, got {type(cache).__name__}")
    key_values = static_key_values(cache.keys, cache.values, capacity)
    if not layer.use_triton_kernel:
        raise ValueError("static caches decode on the Triton kernels: build the layer with use_triton_kernel=True")
    if not (cache.keys.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        raise ValueError(f"static caches decode on the Triton kernels, which need CUDA; the cache is on "
                         f"{cache.keys.device}")
    b, hk, seq_len, d = cache.keys.shape
    dtype, device = cache.keys.dtype, cache.keys.device
    num_mem, window = layer.num_mem, layer.compress_block_size
    rows = num_mem + num_compressed_blocks(capacity, window, layer.compress_stride) + 1
    mem_k, mem_v = (m.detach().to(dtype).expand(b, -1, -1, -1) for m in layer.mem_kv)
    compressed_keys = _grown(torch.cat((mem_k, cache.compressed_keys), dim=2), rows)
    compressed_values = _grown(torch.cat((mem_v, cache.compressed_values), dim=2), rows)

    # The buffer starts at the next window's first token: every token a future window
    # reads is in it or yet to come.
    recent_keys, recent_values = (torch.zeros(b, hk, window, d, dtype=dtype, device=device) for _ in range(2))
    buffered = torch.arange(seq_len - cache.buffer_keys.shape[2], seq_len, device=device) % window
    recent_keys[:, :, buffered] = cache.buffer_keys
    recent_values[:, :, buffered] = cache.buffer_values
    return StaticSparseAttentionCache(
        **key_values,
        compressed_keys=compressed_keys,
        compressed_values=compressed_values,
        recent_keys=recent_keys,
        recent_values=recent_values,
    )


def static_key_values(keys: torch.Tensor, values: torch.Tensor, capacity: int) -> dict[str, torch.Tensor]:
    """``StaticKVCache``'s fields for the cached ``keys, values: [b, hk, t, d]`` in buffers
    of ``capacity`` tokens (an int above t, checked here: the layers' ``static_cache``
    arguments)."""
    if not isinstance(capacity, numbers.Integral) or isinstance(capacity, bool):
        raise TypeError(f"capacity must be an int, got {type(capacity).__name__}")
    b, _, cached, _ = keys.shape
    if capacity <= cached:
        raise ValueError(f"capacity must exceed the {cached} cached tokens, got {capacity}")
    return dict(position=torch.full((b,), cached, dtype=torch.int64, device=keys.device),
                keys=_grown(keys, capacity), values=_grown(values, capacity))


def _grown(prefix: torch.Tensor, rows: int) -> torch.Tensor:
    """prefix: [b, h, t, d] at the start of zeros [b, h, rows, d]."""
    out = prefix.new_zeros(*prefix.shape[:2], rows, prefix.shape[3])
    out[:, :, : prefix.shape[2]] = prefix
    return out


def cat_caches(caches: Sequence[C]) -> C:
    """One cache whose batch rows are those of ``caches`` in order, each row keeping its
    position: the layer's cache for a batch of prompts of different lengths, each
    prefilled alone (``Transformer.sample`` does this for a model). ``caches``: static
    caches of one layer (``StaticSparseAttentionCache``, or ``StaticFullAttentionCache``
    of the dense layer), with the same capacity, dtype and device."""
    if not isinstance(caches, Sequence) or not caches:
        raise TypeError("caches must be a non-empty sequence of static caches")
    for index, cache in enumerate(caches):
        if not isinstance(cache, StaticKVCache):
            raise TypeError(f"caches[{index}] must be a static cache (StaticSparseAttentionCache, "
                            f"StaticFullAttentionCache), got {type(cache).__name__}")
        if type(cache) is not type(caches[0]):
            raise TypeError(f"caches[{index}] is a {type(cache).__name__}, caches[0] a {type(caches[0]).__name__}")
    first = caches[0]
    for index, cache in enumerate(caches[1:], start=1):
        for name in (field.name for field in fields(first) if field.name != "position"):
            mine, theirs = getattr(cache, name), getattr(first, name)
            if (mine.shape[1:], mine.dtype, mine.device) != (theirs.shape[1:], theirs.dtype, theirs.device):
                raise ValueError(
                    f"caches[{index}].{name} is {tuple(mine.shape)} {mine.dtype} on {mine.device}, but caches[0]."
                    f"{name} is {tuple(theirs.shape)} {theirs.dtype} on {theirs.device}: the caches must be of one "
                    "layer, with one capacity"
                )
    return type(first)(**{
        field.name: torch.cat([getattr(cache, field.name) for cache in caches]) for field in fields(first)
    })


def static_step(layer: SparseAttention, x: torch.Tensor, cache: StaticSparseAttentionCache) -> torch.Tensor:
    """One decoding step: x: [b, 1, dim], each row at its position ``cache.position[row]``
    -> [b, 1, dim]; writes the tokens into ``cache`` and advances the positions. A step
    past the capacity fails a device-side assertion."""
    from native_sparse_attention.kernels.compressed import compressed_attend_and_select_at
    from native_sparse_attention.kernels.gate_combine import gated_sum, gated_sum_of_logits
    from native_sparse_attention.kernels.rotary import rotate_at
    from native_sparse_attention.kernels.selection import selection_attention_at, selection_attention_partials_at
    from native_sparse_attention.kernels.rms_norm import normed_for_projection

    _check(layer, x, cache)
    position = cache.position
    x_normed = normed_for_projection(layer.norm, x)
    qkv, gate_logits = _projections(layer, x_normed)
    q, k, v, _ = split_qkv_heads(qkv, layer.heads, layer.kv_heads, layer.dim_head)
    rq, rk = rotated_query_and_key_heads(qkv, layer.heads, layer.kv_heads, layer.dim_head,
                                         lambda heads: rotate_at(heads, layer.rotary.inv_freq, position))
    gates = layer._gates(layer.to_gates[0](x_normed)) if gate_logits is None else None
    _write(layer, cache, rk, k, v)

    dtype = cache.keys.dtype
    q, rq = q.to(dtype), rq.to(dtype)
    compressed_out, selection = compressed_attend_and_select_at(
        q, cache.compressed_keys, cache.compressed_values, position, layer.compress_block_size,
        layer.compress_stride, layer.num_mem, layer.selection_block_size, layer.num_selected_blocks,
        share_selection=layer.share_selection,
    )
    if layer.recorder is not None:
        layer._record(selected_indices=selection.indices, selected_mask=selection.mask)
    # The gated sum of the logits merges the selected and sliding branches from shares of
    # their keys: a decoding step's launch is otherwise a few long chains of key tiles.
    attend = selection_attention_at if gates is not None else selection_attention_partials_at
    selected_out, sliding_out = attend(
        rq, cache.keys, cache.values, layer.selection_block_size, selection.indices, selection.mask,
        layer.sliding_window_size, layer.dim_head**-0.5, position,
    )
    if gates is None:
        merged = gated_sum_of_logits(gate_logits, compressed_out, selected_out, sliding_out)
    else:
        merged = gated_sum(gates, compressed_out, selected_out, sliding_out)
    position.add_(1)
    return decoding_linear(layer.to_out, merged)


def _projections(layer: SparseAttention, x_normed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x_normed: [b, 1, dim] -> the q / k / v projection [b, 1, (hq + 2 hk) d] and, where
    its kernel computes them too, the gates' logits [3, b, hq, 1] (else None: the layer's
    ``_gates`` takes over)."""
    from native_sparse_attention.kernels.decode_linear import decode_linears

    gate_projection, _, sigmoid = layer.to_gates
    modules = (layer.to_qkv, gate_projection)
    dtype = decoding_linear_dtype(x_normed, *modules)
    if dtype is None or has_hooks(sigmoid):
        return decoding_linear(layer.to_qkv, x_normed), None
    rows = x_normed.flatten(0, 1)
    qkv, logits = decode_linears((rows, rows), *_weights_and_biases(modules), dtype)
    logits = rearrange(logits, "b (h s) -> s b h 1", s=3)
    if layer.recorder is not None:
        layer._record(gates=logits.sigmoid())
    return qkv.view(*x_normed.shape[:2], -1), logits


def decoding_linear_dtype(x: torch.Tensor, *modules: nn.Module) -> torch.dtype | None:
    """The dtype in which ``F.linear`` would compute each of ``modules`` (``nn.Linear`` as
    constructed) on the rows x: [b, 1, dim], where ``decode_linears`` can compute them in
    one launch: autocast's, or the one dtype of x and the parameters; None otherwise."""
    from native_sparse_attention.kernels.library import KERNEL_DTYPES

    tensors = [x, *(p for module in modules for p in module.parameters())]
    if not all(plain_linear(module) for module in modules) or any(t.dtype not in KERNEL_DTYPES for t in tensors):
        return None
    if not (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        return None
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    dtypes = {t.dtype for t in tensors}
    return dtypes.pop() if len(dtypes) == 1 else None


def decoding_linear(module: nn.Module, x: torch.Tensor, activation: nn.Module | None = None) -> torch.Tensor:
    """``module(x)`` (``activation(module(x))`` given one) of a decoding step's rows x:
    [b, 1, dim], through ``decode_linears`` where it can compute it
    (``decoding_linear_dtype``): under autocast, a replayed step then reads the float32
    weight instead of casting it to a copy first. An ``nn.ReLU`` or exact ``nn.GELU``
    without hooks runs in the same launch."""
    from native_sparse_attention.kernels.decode_linear import decode_linears

    dtype = decoding_linear_dtype(x, module)
    fused = _fused_activation(activation)
    if dtype is None:
        y = module(x)
        return y if activation is None else activation(y)
    (y,) = decode_linears((x.flatten(0, 1),), *_weights_and_biases((module,)), dtype, activation=fused)
    y = y.view(*x.shape[:2], -1)
    return y if activation is None or fused is not None else activation(y)


def _fused_activation(activation: nn.Module | None) -> str | None:
    """The name ``decode_linears`` computes ``activation`` by, or None where it does not."""
    if activation is None or has_hooks(activation):
        return None
    if type(activation) is nn.ReLU:
        return "relu"
    if type(activation) is nn.GELU and activation.approximate == "none":
        return "gelu"
    return None


def _weights_and_biases(linears: Sequence[nn.Linear]) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    return [module.weight for module in linears], [module.bias for module in linears]


def _write(layer: SparseAttention, cache: StaticSparseAttentionCache, rk, k, v) -> None:
    """Writes the token's keys and values ([b, hk, 1, d] each) at ``cache.position`` and
    compresses the window ending there into its row (the spare row if incomplete)."""
    from native_sparse_attention.kernels.cache_write import write_compressed_rows, write_rings_and_read_windows

    position = cache.position
    # The windows come with the intra-block positions added (``layer._compress_windows``' sums),
    # in the dtype the fused compression networks compute in where they run. The same launch
    # writes the token's rows of the cache, asserting on the device that they fit.
    windows_dtype = torch.promote_types(k.dtype, layer.intrablock_pos_k.dtype)
    fused_dtype = _fused_compression_dtype(layer, windows_dtype)
    windows_k, windows_v = write_rings_and_read_windows(position, k, v, cache.recent_keys, cache.recent_values,
                                                        layer.intrablock_pos_k, layer.intrablock_pos_v,
                                                        fused_dtype or windows_dtype,
                                                        cache_rows=(rk, cache.keys, cache.values))
    if fused_dtype is None:
        new_ck, new_cv = layer.compress_k(windows_k), layer.compress_v(windows_v)
    else:
        new_ck, new_cv = _fused_compression(layer, position, windows_k, windows_v)
    write_compressed_rows(position, new_ck, new_cv, cache.compressed_keys, cache.compressed_values, layer.num_mem,
                          layer.compress_block_size, layer.compress_stride)


def _fused_compression_dtype(layer: SparseAttention, windows_dtype: torch.dtype) -> torch.dtype | None:
    """The dtype in which ``_fused_compression`` computes the compression networks on
    windows of ``windows_dtype``, the one their fused training node computes in (and
    ``F.linear`` under autocast); None where the networks are not default ``CompressMLP``s
    of kernel dtypes."""
    from native_sparse_attention.kernels.library import KERNEL_DTYPES

    networks = (layer.compress_k, layer.compress_v)
    parameters = [p for network in networks for p in network.parameters()]
    if not (all(type(network) is CompressMLP and network.fusable() for network in networks)
            and all(dtype in KERNEL_DTYPES for dtype in (windows_dtype, *(p.dtype for p in parameters)))):
        return None
    return layer.compress_k.compute_dtype(windows_dtype)


def _fused_compression(layer: SparseAttention, position: torch.Tensor, windows_k: torch.Tensor,
                       windows_v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The default compression networks on the windows ending at the step's tokens ([b,
    hk, 1, window, d] each, in the dtype they compute in) -> [b, hk, 1, d] each: both
    networks' first layers in one launch, their second layers in another, each computing
    only the rows whose window is complete (the others go to the spare row, as zeros)."""
    from native_sparse_attention.kernels.decode_linear import CompleteWindows, decode_linears

    b, hk, _, window, d = windows_k.shape
    only = CompleteWindows(position, hk, window, layer.compress_stride)
    first, second = ([network.net[i] for network in (layer.compress_k, layer.compress_v)] for i in (0, 2))
    rows = [w.reshape(b * hk, window * d) for w in (windows_k, windows_v)]
    hidden = decode_linears(rows, *_weights_and_biases(first), windows_k.dtype, activation="relu", only=only)
    new_ck, new_cv = decode_linears(hidden, *_weights_and_biases(second), windows_k.dtype, only=only)
    return new_ck.view(b, hk, 1, d), new_cv.view(b, hk, 1, d)


def _check(layer: SparseAttention, x: torch.Tensor, cache: StaticSparseAttentionCache) -> None:
    if x.shape[1] != 1:
        raise ValueError(f"a static cache decodes one token per step, got x with seq_len {x.shape[1]}")
    layer._check_cache_keys(x, cache.keys)
    if torch.is_grad_enabled() and any(p.requires_grad for p in layer.parameters()):
        raise ValueError("a static cache decodes without gradients: call the layer under torch.no_grad()")


def capture_step(step: Callable[[], T], caches: Sequence, warmup_steps: int = 3) -> tuple[torch.cuda.CUDAGraph, T]:
    """Captures ``step``, a decoding step through ``caches`` (a model's, say, reading its
    input from a fixed tensor; ``StaticSparseAttentionCache`` or the dense layer's
    ``StaticFullAttentionCache``), into a CUDA graph; returns the graph and what the
    captured call returned, which every ``graph.replay()`` rewrites.

    The graph reads and writes the caches' buffers and the step's inputs in place: keep
    them alive as long as the graph, or their memory is reused under it. The warm-up runs
    the step for real: what it changed that a later step reads (each cache's
    ``step_state``: the positions, the sparse layer's recent tokens) is restored
    afterwards, and whatever else it wrote sits in rows that each replay rewrites before
    reading them.
    Autocast, if on, runs without its cast cache, whose copies of the weights would be
    freed when its context ends.
    """
    saved = [[t.clone() for t in cache.step_state] for cache in caches]
    if torch.is_autocast_enabled("cuda"):
        dtype = torch.get_autocast_dtype("cuda")
        inner = step

        def step():
            with torch.autocast("cuda", dtype=dtype, cache_enabled=False):
                return inner()

    graph, result = capture(step, warmup_steps)
    for cache, state in zip(caches, saved):
        for tensor, before in zip(cache.step_state, state):
            tensor.copy_(before)
    return graph, result
