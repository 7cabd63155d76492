"""The Native Sparse Attention layer.

Three branches read the same queries and their outputs are mixed by learned per-head
sigmoid gates:

- compressed: attention over learned memory key/values plus one key/value per window of
  ``compress_block_size`` tokens taken every ``compress_block_sliding_stride`` tokens;
- selected: attention over the query's own block and the top-n key blocks of
  ``selection_block_size`` tokens, ranked by the compressed branch's attention;
- sliding window: attention over the last ``sliding_window_size`` tokens.

On CPU (and whenever neither fast path is chosen) every branch runs through the plain
PyTorch reference in ``reference.py``. The CUDA fast paths run the compressed branch and
the block selection on the Triton kernels of ``kernels/compressed.py`` (which never
materialise the ``[n, n / stride]`` attention), the selected + sliding branches on the
Triton selection kernel (``use_triton_kernel``) or FlexAttention (``use_flex_attention``),
and mix the branches with one fused kernel (``kernels/gate_combine.py``). With the Triton
kernels and no score gradient (``use_diff_topk=False``) the branches and the mixing are
one autograd node whose backward folds each gate into its branch's backward.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from einops import rearrange
from einops.layers.torch import Rearrange
from torch import nn

from native_sparse_attention.compress import CompressMLP, has_hooks, plain_linear, sliding_windows
from native_sparse_attention.documents import checked_document_bounds
from native_sparse_attention.layer_input import check_layer_input
from native_sparse_attention.reference import (
    compressed_attend,
    selected_attend,
    sliding_window_attend,
)
from native_sparse_attention.rotary import RotaryEmbedding
from native_sparse_attention.selection import (
    BlockSelection,
    num_compressed_blocks,
    num_selection_blocks,
    select_blocks,
    selectable_blocks,
    selection_block_scores,
)
from native_sparse_attention.static_cache import StaticSparseAttentionCache, static_cache, static_step

__all__ = ["SparseAttention", "SparseAttentionCache"]

# Initial gate biases (compressed, selected, sliding): sigmoid(2) ~ 0.88 lets the sliding
# branch carry the signal while the selection learns what to pick.
_INITIAL_GATE_BIAS = (-2.0, -2.0, 2.0)

# Limits of the Triton selection kernel (see kernels/selection.py).
_KERNEL_BLOCK_MULTIPLE = 16
_KERNEL_MAX_BLOCK = 128
_KERNEL_MAX_DIM_HEAD = 128
_KERNEL_MAX_GROUP = 16


@dataclass(frozen=True)
class SparseAttentionCache:
    """Decoding state of one ``SparseAttention`` layer after ``seq_len`` tokens.

    keys: [b, hk, t, d] (rotary applied), values: [b, hk, t, d];
    compressed_keys, compressed_values: [b, hk, nc, d], the complete compression windows
    (memory key/values are parameters and not cached);
    buffer_keys, buffer_values: [b, hk, r, d], the raw keys/values of the tokens since the
    start of the next compression window (``r = t - nc * stride``): each window that new
    tokens complete is compressed into the next block, and the tokens before the start of
    the window after it leave the buffer.
    """

    keys: torch.Tensor
    values: torch.Tensor
    compressed_keys: torch.Tensor
    compressed_values: torch.Tensor
    buffer_keys: torch.Tensor
    buffer_values: torch.Tensor

    @property
    def seq_len(self) -> int:
        return self.keys.shape[2]


def _check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _straight_through(scores: torch.Tensor) -> torch.Tensor:
    """Equals 1 in the forward pass; passes the gradient to ``scores`` unchanged."""
    return scores + (1.0 - scores).detach()


class SparseAttention(nn.Module):
    """Native Sparse Attention (DeepSeek, 2025).

    Args:
        dim: model width; ``forward`` takes ``x: [b, n, dim]``.
        dim_head: width of each attention head (even, for rotary embeddings).
        heads: number of query heads.
        sliding_window_size: query ``i`` of the sliding branch sees keys ``j`` with
            ``0 <= i - j <= sliding_window_size`` (``|i - j| <=`` when not causal).
        compress_block_size: tokens per compression window.
        compress_block_sliding_stride: distance between the starts of consecutive windows
            (windows overlap when it is smaller than ``compress_block_size``).
        selection_block_size: tokens per selectable key block; a multiple of the stride.
        num_selected_blocks: top-n blocks attended per query, besides its own block.
        kv_heads: key/value heads (grouped-query attention); defaults to ``heads``.
        num_compressed_mem_kv: learned memory key/values every compressed query sees.
        causal: autoregressive masking in every branch.
        norm: RMSNorm the input before projecting it.
        use_diff_topk: scale the selected blocks' logits by a straight-through gate equal
            to 1, so the compressed branch also learns from the selection branch.
        use_triton_kernel: on CUDA run the branches on the Triton kernels (the PyTorch
            path is used on CPU).
        query_heads_share_selected_kv: one selection per kv head (summing the importance
            over its query heads) instead of one per query head.
        compress_mlp: compression network mapping ``[b, h, w, compress_block_size, dim_head]``
            to ``[b, h, w, dim_head]``; see ``compress.py``. Defaults to ``CompressMLP``.
            Keys and values get independent copies.
        compress_mlp_expand_factor: hidden width of the default compression MLP relative
            to its input (``compress_block_size * dim_head``).
        strategy_combine_mlp: module mapping the normed input ``[b, n, dim]`` to the gate
            logits ``[b, n, 3 * heads]``; defaults to a linear layer. Under autocast the
            fast paths hand it the normed input already in autocast's dtype.
        use_flex_attention: on CUDA run the selected and sliding branches through PyTorch
            FlexAttention block masks (an alternative to ``use_triton_kernel``; the
            compressed branch and the selection still run on the Triton kernels).
    """

    def __init__(
        self,
        dim: int,
        dim_head: int,
        heads: int,
        sliding_window_size: int,
        compress_block_size: int,
        compress_block_sliding_stride: int,
        selection_block_size: int,
        num_selected_blocks: int,
        kv_heads: int | None = None,
        num_compressed_mem_kv: int = 1,
        causal: bool = False,
        norm: bool = True,
        use_diff_topk: bool = False,
        use_triton_kernel: bool = False,
        query_heads_share_selected_kv: bool = True,
        compress_mlp: nn.Module | None = None,
        compress_mlp_expand_factor: float = 1.0,
        strategy_combine_mlp: nn.Module | None = None,
        use_flex_attention: bool = False,
    ):
        super().__init__()
        kv_heads = heads if kv_heads is None else kv_heads
        self._validate_config(
            dim=dim,
            dim_head=dim_head,
            heads=heads,
            kv_heads=kv_heads,
            sliding_window_size=sliding_window_size,
            compress_block_size=compress_block_size,
            compress_block_sliding_stride=compress_block_sliding_stride,
            selection_block_size=selection_block_size,
            num_selected_blocks=num_selected_blocks,
            num_compressed_mem_kv=num_compressed_mem_kv,
            use_triton_kernel=use_triton_kernel,
            compress_mlp=compress_mlp,
            strategy_combine_mlp=strategy_combine_mlp,
            use_flex_attention=use_flex_attention,
        )
        self.dim = dim
        self.dim_head = dim_head
        self.heads = heads
        self.kv_heads = kv_heads
        self.sliding_window_size = sliding_window_size
        self.compress_block_size = compress_block_size
        self.compress_stride = compress_block_sliding_stride
        self.selection_block_size = selection_block_size
        self.num_selected_blocks = num_selected_blocks
        self.num_mem = num_compressed_mem_kv
        self.causal = causal
        self.use_diff_topk = use_diff_topk
        self.use_triton_kernel = use_triton_kernel
        self.use_flex_attention = use_flex_attention
        self.share_selection = query_heads_share_selected_kv
        # Set to a dict to capture the intermediate tensors of the next forward passes
        # (see viz.py); None costs nothing.
        self.recorder: dict | None = None

        self.norm = nn.RMSNorm(dim) if norm else nn.Identity()
        self.to_qkv = nn.Linear(dim, (heads + 2 * kv_heads) * dim_head, bias=False)
        self.rotary = RotaryEmbedding(dim_head)

        self.intrablock_pos_k = nn.Parameter(torch.randn(kv_heads, compress_block_size, dim_head) * 0.02)
        self.intrablock_pos_v = nn.Parameter(torch.randn(kv_heads, compress_block_size, dim_head) * 0.02)
        self.mem_kv = nn.Parameter(torch.randn(2, kv_heads, num_compressed_mem_kv, dim_head) * 0.02)
        if compress_mlp is None:
            compress_mlp = CompressMLP(compress_block_size, dim_head, compress_mlp_expand_factor)
        self.compress_k = compress_mlp
        self.compress_v = copy.deepcopy(compress_mlp)

        if strategy_combine_mlp is None:
            strategy_combine_mlp = nn.Linear(dim, 3 * heads)
            nn.init.zeros_(strategy_combine_mlp.weight)
            with torch.no_grad():
                strategy_combine_mlp.bias.copy_(torch.tensor(_INITIAL_GATE_BIAS).repeat(heads))
        self.to_gates = nn.Sequential(
            strategy_combine_mlp, Rearrange("b n (h s) -> s b h n 1", s=3), nn.Sigmoid()
        )
        self.to_out = nn.Linear(heads * dim_head, dim, bias=False)

    @staticmethod
    def _validate_config(**config) -> None:
        for name in ("dim", "dim_head", "heads", "kv_heads", "compress_block_size",
                     "compress_block_sliding_stride", "selection_block_size"):
            _check_int(name, config[name], 1)
        for name in ("sliding_window_size", "num_selected_blocks", "num_compressed_mem_kv"):
            _check_int(name, config[name], 0)
        if config["dim_head"] % 2:
            raise ValueError(f"dim_head must be even for rotary embeddings, got {config['dim_head']}")
        if config["heads"] % config["kv_heads"]:
            raise ValueError(
                f"heads ({config['heads']}) must be divisible by kv_heads ({config['kv_heads']})"
            )
        stride = config["compress_block_sliding_stride"]
        if config["compress_block_size"] < stride:
            raise ValueError(
                f"compress_block_size ({config['compress_block_size']}) must be >= "
                f"compress_block_sliding_stride ({stride}), or tokens would be skipped"
            )
        if config["selection_block_size"] % stride:
            raise ValueError(
                f"selection_block_size ({config['selection_block_size']}) must be a multiple of "
                f"compress_block_sliding_stride ({stride})"
            )
        for name in ("compress_mlp", "strategy_combine_mlp"):
            if config[name] is not None and not isinstance(config[name], nn.Module):
                raise TypeError(f"{name} must be an nn.Module or None, got {type(config[name]).__name__}")
        if config["use_triton_kernel"] and config["use_flex_attention"]:
            raise ValueError("use_triton_kernel and use_flex_attention are alternatives: set at most one")
        if (config["use_triton_kernel"] or config["use_flex_attention"]) and config["dim_head"] > _KERNEL_MAX_DIM_HEAD:
            option = "use_triton_kernel" if config["use_triton_kernel"] else "use_flex_attention"
            raise ValueError(f"{option} supports dim_head up to {_KERNEL_MAX_DIM_HEAD}, got {config['dim_head']}")
        if config["use_triton_kernel"]:
            block = config["selection_block_size"]
            if block % _KERNEL_BLOCK_MULTIPLE or block > _KERNEL_MAX_BLOCK:
                raise ValueError(
                    f"use_triton_kernel needs selection_block_size to be a multiple of "
                    f"{_KERNEL_BLOCK_MULTIPLE} up to {_KERNEL_MAX_BLOCK}, got {block}"
                )
            if config["heads"] // config["kv_heads"] > _KERNEL_MAX_GROUP:
                raise ValueError(
                    f"use_triton_kernel supports up to {_KERNEL_MAX_GROUP} query heads per kv head, "
                    f"got heads / kv_heads = {config['heads'] // config['kv_heads']}"
                )

    # ------------------------------------------------------------------ forward

    def forward(
        self,
        x: torch.Tensor,
        cache: SparseAttentionCache | None = None,
        return_cache: bool = False,
        document_ids: torch.Tensor | None = None,
    ):
        """x: [b, n, dim] -> [b, n, dim], or ``(out, cache)`` when ``return_cache``.

        ``document_ids: [b, n]`` (integer) packs several documents in a row: a run of equal
        ids is one document, and no branch attends across documents. Each document must
        start at a multiple of ``selection_block_size`` (``pack_documents`` pads them so),
        which is checked by reading the ids back to the host once per ids tensor (the layers
        of a model share the check), except while compiling or capturing a CUDA graph.
        Causal layers, without a cache.

        With a ``cache`` from an earlier call, ``x`` holds the tokens that follow it: one
        per decoding step, or any number (the next chunk of a long prompt, draft tokens to
        verify). The result equals that of running the whole sequence at once. With a
        ``StaticSparseAttentionCache`` (``static_cache``) x is one token, the step updates
        the cache in place, and it can be captured in a CUDA graph.
        """
        check_layer_input(x, self.dim, self.to_qkv.weight)
        documents = self._documents(x, document_ids, cache is not None or return_cache)
        if isinstance(cache, StaticSparseAttentionCache):
            out = static_step(self, x, cache)
            return (out, cache) if return_cache else out
        if cache is not None:
            out, cache = self._continue(x, cache)
            return (out, cache) if return_cache else out
        if return_cache and not self.causal:
            raise ValueError("return_cache needs a causal layer (causal=True)")

        fast = self._use_fast_path(x)
        q, k, v, rq, rk, gates = self._project(self._normed(x, fast))
        ck, cv = self._compress(k, v)

        if fast and self.use_triton_kernel and not self.use_diff_topk:
            out = self._kernel_gated_branches(gates, q, ck, cv, rq, rk, v, documents)
        else:
            if fast:
                compressed_out, selection = self._kernel_compressed_branch(q, ck, cv, documents=documents)
                branches = self._kernel_branches if self.use_triton_kernel else self._flex_branches
                selected_out, sliding_out = branches(rq, rk, v, selection, documents=documents)
            else:
                document_start = None if documents is None else documents[0]
                compressed_out, selection = self._compressed_branch(q, ck, cv, 0, document_start)
                selected_out = self._selected_branch(rq, rk, v, selection, q_offset=0)
                sliding_out, _ = sliding_window_attend(rq, rk, v, self.sliding_window_size, self.causal,
                                                       document_start=document_start)
            out = self._combine(gates, compressed_out, selected_out, sliding_out, fused=fast)
        if not return_cache:
            return out
        return out, self._prefill_cache(rk, v, k, ck, cv)

    def _documents(self, x: torch.Tensor, document_ids, cached: bool):
        """(document_start, document_end): [b, n] int32 each, from ``document_ids``
        (``documents.document_bounds``), or None without documents."""
        if document_ids is None:
            return None
        if cached:
            raise ValueError("document_ids packs documents for training: it cannot be combined with a cache")
        if not self.causal:
            raise ValueError("document_ids needs a causal layer (causal=True)")
        return checked_document_bounds(document_ids, x, self.selection_block_size)

    def _use_fast_path(self, x: torch.Tensor) -> bool:
        return (self.use_triton_kernel or self.use_flex_attention) and x.is_cuda

    def _normed(self, x: torch.Tensor, fast: bool) -> torch.Tensor:
        """The normed input [b, n, dim]; on the fast paths in autocast's dtype
        (``kernels/rms_norm.normed_for_projection``)."""
        if not fast:
            return self.norm(x)
        from native_sparse_attention.kernels.rms_norm import normed_for_projection

        return normed_for_projection(self.norm, x)

    def _project(self, x_normed: torch.Tensor, offset: int = 0, fold_gates: bool = True):
        """x_normed: [b, n, dim] at positions ``offset ..`` -> q: [b, hq, n, d], k, v: [b, hk, n, d],
        the rotary embeddings rq of q and rk of k, and the branches' gates [3, b, hq, n].

        ``fold_gates``: a plain linear gate projection (the default one) shares the qkv
        matmul, which then reads x_normed once each way instead of twice and spares two
        small matmuls and a sum of their input gradients. Decoding steps keep separate
        matmuls: folded, every token would concatenate the weights anew.
        """
        from native_sparse_attention.kernels.projection import projected

        gate_projection = self.to_gates[0]
        fold_gates = (fold_gates and plain_linear(gate_projection) and plain_linear(self.to_qkv)
                      and self.to_qkv.bias is None)
        if fold_gates:
            projection = projected(x_normed, (self.to_qkv.weight, gate_projection.weight))
        else:
            projection = self.to_qkv(x_normed)
        q, k, v, rq, rk, logits = self.rotary.split_heads(projection, self.heads, self.kv_heads, offset)
        if fold_gates:
            return q, k, v, rq, rk, self._gates(logits, gate_projection.bias)
        return q, k, v, rq, rk, self._gates(gate_projection(x_normed))

    def _compress_windows(self, k_windows: torch.Tensor, v_windows: torch.Tensor):
        """k_windows, v_windows: [b, hk, w, compress_block_size, d] -> ck, cv: [b, hk, w, d]."""
        ck = self.compress_k(k_windows + self.intrablock_pos_k[:, None])
        cv = self.compress_v(v_windows + self.intrablock_pos_v[:, None])
        return ck, cv

    def _compress(self, k: torch.Tensor, v: torch.Tensor):
        """k, v: [b, hk, n, d] -> ck, cv: [b, hk, nc, d], one token per complete window."""
        num_windows = num_compressed_blocks(k.shape[2], self.compress_block_size, self.compress_stride)
        if num_windows == 0:
            # The networks still run, on no windows, so that their parameters get a (zero)
            # gradient: DistributedDataParallel fails a step that leaves one without any.
            no_windows = k.new_empty(*k.shape[:2], 0, self.compress_block_size, k.shape[-1])
            return self._compress_windows(no_windows, v.new_empty(no_windows.shape))
        if self._kernel_windows(k, v):
            return self._compress_kernel_windows(k, v)
        k_windows, v_windows = (sliding_windows(t, self.compress_block_size, self.compress_stride) for t in (k, v))
        return self._compress_windows(k_windows, v_windows)

    def _kernel_windows(self, k: torch.Tensor, v: torch.Tensor) -> bool:
        """Whether eager steps of the fast path make the windows with their positions on
        the Triton kernels (compiled ones leave them to Inductor, which fuses them)."""
        from native_sparse_attention.kernels.library import KERNEL_DTYPES

        tensors = (k, v, self.intrablock_pos_k, self.intrablock_pos_v)
        return (self._use_fast_path(k) and not torch.compiler.is_compiling()
                and all(t.dtype in KERNEL_DTYPES for t in tensors))

    def _compress_kernel_windows(self, k: torch.Tensor, v: torch.Tensor):
        """``_compress`` with each window and its positions written by one kernel, in the
        dtype the compression network computes in where that is a fused ``CompressMLP``."""
        from native_sparse_attention.kernels.compress_windows import positioned_windows

        def compress(t, pos, network):
            dtype = torch.promote_types(t.dtype, pos.dtype)
            if isinstance(network, CompressMLP) and t.is_cuda and network.fusable():
                dtype = network.compute_dtype(dtype)
            return network(positioned_windows(t, pos, self.compress_block_size, self.compress_stride, dtype))

        return compress(k, self.intrablock_pos_k, self.compress_k), compress(v, self.intrablock_pos_v, self.compress_v)

    def _with_memory(self, ck: torch.Tensor, cv: torch.Tensor):
        """Prepend the memory key/values: [b, hk, nc, d] -> [b, hk, num_mem + nc, d]. Eager
        steps of the fast paths take them from one Triton node (``kernels/memory_kv.py``)."""
        from native_sparse_attention.kernels.library import KERNEL_DTYPES

        if (self._use_fast_path(ck) and not torch.compiler.is_compiling()
                and all(t.dtype in KERNEL_DTYPES for t in (ck, cv, self.mem_kv))):
            from native_sparse_attention.kernels.memory_kv import with_memory

            return with_memory(self.mem_kv, ck, cv)
        mem_k, mem_v = (m.to(ck.dtype).expand(ck.shape[0], -1, -1, -1) for m in self.mem_kv)
        return torch.cat((mem_k, ck), dim=2), torch.cat((mem_v, cv), dim=2)

    def _compressed_branch(self, q: torch.Tensor, ck: torch.Tensor, cv: torch.Tensor, q_offset: int,
                           document_start: torch.Tensor | None = None):
        """PyTorch path of the compressed branch and the block selection.

        q: [b, hq, m, d] at positions ``q_offset..``; ck, cv: [b, hk, nc, d]; document_start:
        [b, m], the first token of each query's document (``q_offset`` 0).
        Returns (out [b, hq, m, d], BlockSelection).
        """
        ck_all, cv_all = self._with_memory(ck, cv)
        out, _, probs = compressed_attend(
            q, ck_all, cv_all, self.compress_block_size, self.compress_stride,
            num_mem=self.num_mem, causal=self.causal, q_offset=q_offset, return_probs=True,
            document_start=document_start,
        )
        num_keys = q_offset + q.shape[2]
        num_blocks = num_selection_blocks(num_keys, self.selection_block_size)
        block_probs = probs[..., self.num_mem:]
        if not self.use_diff_topk:
            block_probs = block_probs.detach()
        scores = selection_block_scores(
            block_probs, self.compress_block_size, self.compress_stride, self.selection_block_size,
            num_blocks, kv_heads=self.kv_heads if self.share_selection else None,
        )
        selectable = selectable_blocks(
            q.shape[2], q_offset, ck.shape[2], self.compress_block_size, self.compress_stride,
            self.selection_block_size, num_blocks, self.causal, q.device, document_start,
        )
        selection = select_blocks(scores, selectable, self.num_selected_blocks)
        if self.recorder is not None:
            self._record(compressed_probs=probs, block_scores=scores.masked_fill(~selectable, 0))
        return out, selection

    def _selection_scale(self, selection: BlockSelection) -> torch.Tensor | None:
        return _straight_through(selection.scores) if self.use_diff_topk else None

    def _selected_branch(self, rq, rk, v, selection: BlockSelection, q_offset: int) -> torch.Tensor:
        """PyTorch path of the selection branch: rq: [b, hq, m, d], rk, v: [b, hk, n, d]."""
        if self.recorder is not None:
            self._record(selected_indices=selection.indices, selected_mask=selection.mask)
        out, _ = selected_attend(
            rq, rk, v, self.selection_block_size, selection.indices, selection.mask,
            sel_scale=self._selection_scale(selection), include_block_causal=self.causal, q_offset=q_offset,
        )
        return out

    def _kernel_compressed_branch(self, q: torch.Tensor, ck: torch.Tensor, cv: torch.Tensor, q_offset: int = 0,
                                  documents: tuple[torch.Tensor, torch.Tensor] | None = None):
        """Fast path of the compressed branch and the block selection (Triton kernels).

        q: [b, hq, m, d] at positions ``q_offset ..``, ck, cv: [b, hk, nc, d], documents:
        ``(document_start, document_end)`` ([b, m] int32 each, ``q_offset`` 0) or None
        -> (out [b, hq, m, d], BlockSelection). The selection's scores are differentiable
        when ``use_diff_topk`` needs them (and ``q_offset`` is 0).
        """
        from native_sparse_attention.kernels.compressed import compressed_attend_and_select

        ck_all, cv_all = self._with_memory(ck, cv)
        document_start, document_end = (None, None) if documents is None else documents
        out, _, selection = compressed_attend_and_select(
            q, ck_all, cv_all, self.compress_block_size, self.compress_stride, self.num_mem,
            self.selection_block_size, self.num_selected_blocks, causal=self.causal,
            share_selection=self.share_selection, scores_require_grad=self.use_diff_topk, q_offset=q_offset,
            document_start=document_start, document_end=document_end,
        )
        if self.recorder is not None:
            self._record(selected_indices=selection.indices, selected_mask=selection.mask)
        return out, selection

    def _kernel_branches(self, rq, rk, v, selection: BlockSelection, q_offset: int = 0,
                         documents: tuple[torch.Tensor, torch.Tensor] | None = None):
        """Selected and sliding branches from one launch of the Triton selection kernel:
        rq: [b, hq, m, d] at positions ``q_offset ..``, rk, v: [b, hk, q_offset + m, d]
        (any strides), documents as ``_kernel_compressed_branch``'s -> two [b, hq, m, d]."""
        from native_sparse_attention.attend import native_sparse_attend

        if documents is None:
            return native_sparse_attend(
                rq, rk, v, self.selection_block_size, selection.indices, selection.mask,
                sel_scale=self._selection_scale(selection), include_block_causal=self.causal,
                return_sliding_window_out=True, sliding_window_size=self.sliding_window_size, q_offset=q_offset,
            )
        # The public op has no documents: its selections are the caller's, which could name
        # blocks of other documents. The layer's own never do.
        from native_sparse_attention.kernels.selection import selection_attention

        selected_out, sliding_out, _ = selection_attention(
            rq, rk, v, self.selection_block_size, selection.indices, selection.mask, self._selection_scale(selection),
            self.causal, self.sliding_window_size, self.dim_head**-0.5, q_offset,
            document_start=documents[0], document_end=documents[1],
        )
        return selected_out, sliding_out

    def _flex_branches(self, rq, rk, v, selection: BlockSelection,
                       documents: tuple[torch.Tensor, torch.Tensor] | None = None):
        """Selected and sliding branches through FlexAttention: rq: [b, hq, n, d], rk, v: [b, hk, n, d]."""
        from native_sparse_attention.flex import flex_selected_and_sliding

        return flex_selected_and_sliding(
            rq, rk, v, self.selection_block_size, selection.indices, selection.mask,
            self.sliding_window_size, causal=self.causal, sel_scale=self._selection_scale(selection),
            document_start=None if documents is None else documents[0],
        )

    def _kernel_gated_branches(self, gates, q, ck, cv, rq, rk, v,
                               documents: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """The Triton path when the selection scores need no gradient: the three branches
        and their gated sum as one autograd node, whose backward folds the gates into the
        branches' instead of writing a gated output gradient per branch
        (``kernels/gate_combine.py``). Shapes as ``forward``'s; returns the projected output.
        """
        from native_sparse_attention.kernels.gate_combine import gated_branches

        ck_all, cv_all = self._with_memory(ck, cv)
        scale = self.dim_head**-0.5
        compressed_options = (self.compress_block_size, self.compress_stride, self.num_mem, self.causal, scale,
                              self.selection_block_size, self.num_selected_blocks, self.share_selection)
        selection_options = (self.selection_block_size, self.causal, self.sliding_window_size, scale)
        # A plain output projection joins the node, whose backward then computes its
        # weight's gradient beside the selected and sliding branches' backward.
        project = plain_linear(self.to_out) and self.to_out.bias is None
        out, selection = gated_branches(
            gates, q, ck_all, cv_all, rq, rk, v, compressed_options, selection_options,
            out_weight=self.to_out.weight if project else None, documents=documents,
        )
        if self.recorder is not None:
            self._record(selected_indices=selection.indices, selected_mask=selection.mask)
        return out if project else self.to_out(out)

    def _gates(self, logits: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """The gate logits [b, n, 3 * h] and their bias [3 * h] (none where the projection
        added its own) -> the branches' gates [3, b, h, n] (compressed, selected, sliding).
        Eager steps of the fast paths take them from one Triton node
        (``kernels/gate_sigmoid.py``)."""
        if self._kernel_gates(logits, bias):
            from native_sparse_attention.kernels.gate_sigmoid import gate_sigmoids

            gates = gate_sigmoids(logits, bias)
        else:
            _, to_branches_first, sigmoid = self.to_gates
            if bias is not None:
                logits = logits + bias.to(logits.dtype)
            logits = to_branches_first(logits)
            if torch.compiler.is_compiling():
                # Stored branch-major, the layout of the LSEs the gates are folded into
                # (gate_combine), by the kernel that takes the sigmoid: compiled, a sigmoid
                # computed through the rearranged view moved 6 of every 192 bytes it read
                # (0.07 ms at n = 65536 on an H100).
                logits = logits.contiguous()
            gates = sigmoid(logits).squeeze(-1)
        if self.recorder is not None:
            self._record(gates=gates)
        return gates

    def _kernel_gates(self, logits: torch.Tensor, bias: torch.Tensor | None) -> bool:
        """Whether eager steps of the fast path take the gates from the Triton node
        (compiled ones leave the PyTorch ops to Inductor, which fuses them)."""
        from native_sparse_attention.kernels.library import KERNEL_DTYPES

        return (self._use_fast_path(logits) and not torch.compiler.is_compiling() and not has_hooks(self.to_gates[2])
                and logits.dtype in KERNEL_DTYPES and (bias is None or bias.dtype in KERNEL_DTYPES))

    def _combine(self, gates, compressed_out, selected_out, sliding_out, fused: bool = False) -> torch.Tensor:
        """Gate ([3, b, hq, n]) and sum the branch outputs ([b, hq, n, d] each), merge heads,
        project.

        ``fused`` does it in one Triton kernel that writes the merged heads directly.
        """
        if fused:
            from native_sparse_attention.kernels.gate_combine import gated_sum

            merged = gated_sum(gates, compressed_out, selected_out, sliding_out)
        else:
            gate_compressed, gate_selected, gate_sliding = gates.unsqueeze(-1)
            out = gate_compressed * compressed_out + gate_selected * selected_out + gate_sliding * sliding_out
            merged = rearrange(out, "b h n d -> b n (h d)")
        return self.to_out(merged)

    def _record(self, **tensors: torch.Tensor) -> None:
        self.recorder.update({name: t.detach() for name, t in tensors.items()})

    # ------------------------------------------------------------------ decoding

    def static_cache(self, cache: SparseAttentionCache, capacity: int) -> StaticSparseAttentionCache:
        """``cache`` moved into buffers of ``capacity`` tokens that decoding steps update in
        place, so that a step can be captured in a CUDA graph (see ``static_cache.py``).
        Decodes on the Triton kernels (``use_triton_kernel``), without gradients."""
        return static_cache(self, cache, capacity)

    def _prefill_cache(self, rk, v, k, ck, cv) -> SparseAttentionCache:
        buffer_start = ck.shape[2] * self.compress_stride
        return SparseAttentionCache(
            keys=rk, values=v, compressed_keys=ck, compressed_values=cv,
            buffer_keys=k[:, :, buffer_start:], buffer_values=v[:, :, buffer_start:],
        )

    def _check_cache(self, x: torch.Tensor, cache) -> None:
        if not isinstance(cache, SparseAttentionCache):
            raise TypeError(f"cache must be a SparseAttentionCache, got {type(cache).__name__}")
        if not self.causal:
            raise ValueError("decoding with a cache needs a causal layer (causal=True)")
        self._check_cache_keys(x, cache.keys)
        num_windows = num_compressed_blocks(cache.seq_len, self.compress_block_size, self.compress_stride)
        buffered = cache.seq_len - num_windows * self.compress_stride
        if cache.compressed_keys.shape[2] != num_windows or cache.buffer_keys.shape[2] != buffered:
            raise ValueError(
                "cache does not fit this layer: its compressed blocks and buffer do not match "
                f"compress_block_size={self.compress_block_size}, "
                f"compress_block_sliding_stride={self.compress_stride} after {cache.seq_len} tokens"
            )

    def _check_cache_keys(self, x: torch.Tensor, keys: torch.Tensor) -> None:
        """A cache's keys [b, hk, t, d] fit this layer, the input's batch and its device."""
        expected = (x.shape[0], self.kv_heads, self.dim_head)
        found = (keys.shape[0], keys.shape[1], keys.shape[3])
        if found != expected:
            raise ValueError(
                f"cache does not fit this layer and input: it holds (batch, kv_heads, dim_head) = {found}, "
                f"expected {expected}"
            )
        if keys.device != x.device:
            raise ValueError(f"cache is on {keys.device} but x is on {x.device}")

    def _continue(self, x: torch.Tensor, cache: SparseAttentionCache):
        """x: [b, m, dim], the tokens at positions ``cache.seq_len ..`` -> (out [b, m, dim], cache)."""
        self._check_cache(x, cache)
        position = cache.seq_len
        fast = self.use_triton_kernel and self._use_fast_path(x)
        q, k, v, rq, rk, gates = self._project(self._normed(x, fast), offset=position, fold_gates=False)
        keys = torch.cat((cache.keys, rk), dim=2)
        values = torch.cat((cache.values, v), dim=2)
        # Blocks that x completes are compressed before attending: causal masking shows each
        # only to the tokens after its last.
        cache = self._advance_cache(cache, keys, values, k, v)
        ck, cv = cache.compressed_keys, cache.compressed_values

        # The kernels take queries past position 0 without gradients only, and one dtype.
        tensors = (q, rq, keys, values, ck, cv)
        if fast and not any(t.requires_grad for t in tensors) and len({t.dtype for t in tensors}) == 1:
            compressed_out, selection = self._kernel_compressed_branch(q, ck, cv, q_offset=position)
            selected_out, sliding_out = self._kernel_branches(rq, keys, values, selection, q_offset=position)
        else:
            compressed_out, selection = self._compressed_branch(q, ck, cv, q_offset=position)
            selected_out = self._selected_branch(rq, keys, values, selection, q_offset=position)
            sliding_out, _ = sliding_window_attend(
                rq, keys, values, self.sliding_window_size, causal=True, q_offset=position
            )
            fast = False
        out = self._combine(gates, compressed_out, selected_out, sliding_out, fused=fast)
        return out, cache

    def _advance_cache(self, cache, keys, values, k, v) -> SparseAttentionCache:
        """The cache after the new tokens: their rotated keys and values already appended
        (``keys``, ``values``), their raw keys ``k`` and values ``v``: [b, hk, m, d]
        buffered, and every compression window they complete compressed."""
        buffer_k = torch.cat((cache.buffer_keys, k), dim=2)
        buffer_v = torch.cat((cache.buffer_values, v), dim=2)
        ck, cv = cache.compressed_keys, cache.compressed_values
        # The buffer starts at the next window's first token, so its windows are the next ones.
        new_ck, new_cv = self._compress(buffer_k, buffer_v)
        if new_ck.shape[2]:
            ck, cv = torch.cat((ck, new_ck), dim=2), torch.cat((cv, new_cv), dim=2)
            consumed = new_ck.shape[2] * self.compress_stride
            buffer_k, buffer_v = buffer_k[:, :, consumed:], buffer_v[:, :, consumed:]
        return SparseAttentionCache(keys, values, ck, cv, buffer_k, buffer_v)
