"""A decoder-only language model whose attention is ``SparseAttention`` or, as the
baseline, full attention."""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from native_sparse_attention.compress import has_hooks
from native_sparse_attention.full_attention import FullAttention
from native_sparse_attention.sparse_attention import SparseAttention
from native_sparse_attention.static_cache import StaticKVCache, capture_step, cat_caches, decoding_linear

__all__ = ["Transformer", "DEFAULT_SPARSE_ATTN_KWARGS"]

DEFAULT_SPARSE_ATTN_KWARGS = dict(
    sliding_window_size=64,
    compress_block_size=16,
    compress_block_sliding_stride=8,
    selection_block_size=16,
    num_selected_blocks=4,
)


class FeedForward(nn.Module):
    """Pre-norm GELU MLP: [b, n, dim] -> [b, n, dim]."""

    def __init__(self, dim: int, expansion: float = 4.0):
        super().__init__()
        hidden = int(dim * expansion)
        self.net = nn.Sequential(nn.RMSNorm(dim), nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))

    def forward(self, x: torch.Tensor, decoding: bool = False) -> torch.Tensor:
        """``decoding``: x holds a static-cache decoding step's rows ``[b, 1, dim]``, whose
        linear layers then read their weights in place, the GELU computed with the first
        (``static_cache.decoding_linear``)."""
        if not decoding or has_hooks(self.net):
            return self.net(x)
        norm, first, gelu, second = self.net
        return decoding_linear(second, decoding_linear(first, norm(x), activation=gelu))


def autocast(device: torch.device):
    """The precision the language model runs in: bf16 autocast on CUDA, full precision on
    the CPU (training, sampling and scoring alike)."""
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()


# The label cross_entropy skips: targets left out by loss_mask or starting a document.
_IGNORED = -100


def _block(attn: nn.Module, ff: nn.Module, x: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor:
    """One pre-norm block without a cache: x: [b, n, dim] -> [b, n, dim]."""
    x = x + (attn(x) if document_ids is None else attn(x, document_ids=document_ids))
    return x + ff(x)


def top_k_filter(logits: torch.Tensor, filter_thres: float) -> torch.Tensor:
    """Keep the largest ``round((1 - filter_thres) * vocab)`` logits (at least one) of each row, -inf elsewhere."""
    k = max(1, int(round((1.0 - filter_thres) * logits.shape[-1])))
    values, indices = logits.topk(k, dim=-1)
    return torch.full_like(logits, float("-inf")).scatter(-1, indices, values)


def _next_token(logits: torch.Tensor, temperature: float, filter_thres: float) -> torch.Tensor:
    """logits: [b, num_tokens] -> the next tokens [b, 1]: the most likely at temperature 0,
    else drawn from the top ``1 - filter_thres`` fraction."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    kept = top_k_filter(logits, filter_thres)
    # Shifted by the largest logit first, so that a tiny temperature divides only values
    # <= 0 and the softmax sees 0 and -inf, never inf - inf.
    probs = F.softmax((kept - kept.amax(dim=-1, keepdim=True)) / temperature, dim=-1)
    return torch.multinomial(probs, 1)


def _checked_prompts(prompts: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``sample``'s list of prompts: non-empty 1-d integer tensors on one device."""
    if not prompts:
        raise ValueError("prompt must hold at least one prompt")
    for index, p in enumerate(prompts):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"prompt[{index}] must be a torch.Tensor, got {type(p).__name__}")
        if p.ndim != 1 or p.dtype not in (torch.int64, torch.int32) or len(p) == 0:
            raise ValueError(f"prompt[{index}] must be a non-empty 1-d integer tensor, got {p.dtype} "
                             f"{tuple(p.shape)}")
        if p.device != prompts[0].device:
            raise ValueError(f"prompt[{index}] is on {p.device} but prompt[0] is on {prompts[0].device}")
    return list(prompts)


def _checked_lengths(seq_len: int | Sequence[int], rows: int) -> torch.Tensor:
    """``sample``'s final lengths of ``rows`` prompts: one int for all, or one per prompt."""
    lengths = seq_len if isinstance(seq_len, (list, tuple)) else [seq_len] * rows
    if not all(isinstance(length, numbers.Integral) and not isinstance(length, bool) for length in lengths):
        raise TypeError(f"seq_len must be an int or a sequence of ints, one per prompt, got {seq_len!r}")
    if len(lengths) != rows:
        raise ValueError(f"seq_len must give one length per prompt: {rows} prompts, {len(lengths)} lengths")
    return torch.tensor([int(length) for length in lengths])


class Transformer(nn.Module):
    """Token embedding, ``depth`` pre-norm blocks of attention + feed-forward, final norm,
    logits.

    Args:
        num_tokens: vocabulary size.
        dim, depth, heads, dim_head, kv_heads: model width, layers, attention heads, head
            width and key/value heads (grouped-query attention; defaults to ``heads``).
        causal: autoregressive model (needed for ``sample`` and the loss).
        use_sparse_attn: ``SparseAttention`` layers when True, full attention otherwise.
        sparse_attn_kwargs: the remaining ``SparseAttention`` arguments (block sizes, ...).
        ff_expansion: hidden width of the feed-forward blocks relative to ``dim``.
        activation_checkpointing: in training forwards (gradients on, no caches) each
            block's activations are recomputed during the backward instead of kept, so
            that the stored activations shrink to each block's input (``torch.utils.checkpoint``).
            A training setting, not part of ``config``: checkpoints rebuild without it.
    """

    def __init__(
        self,
        num_tokens: int,
        dim: int,
        depth: int,
        heads: int = 8,
        dim_head: int = 64,
        kv_heads: int | None = None,
        causal: bool = True,
        use_sparse_attn: bool = True,
        sparse_attn_kwargs: dict | None = None,
        ff_expansion: float = 4.0,
        activation_checkpointing: bool = False,
    ):
        super().__init__()
        sparse_attn_kwargs = dict(DEFAULT_SPARSE_ATTN_KWARGS if sparse_attn_kwargs is None else sparse_attn_kwargs)
        for name, value in (("num_tokens", num_tokens), ("dim", dim), ("depth", depth)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.config = dict(
            num_tokens=num_tokens, dim=dim, depth=depth, heads=heads, dim_head=dim_head, kv_heads=kv_heads,
            causal=causal, use_sparse_attn=use_sparse_attn, sparse_attn_kwargs=sparse_attn_kwargs,
            ff_expansion=ff_expansion,
        )
        self.causal = causal
        self.activation_checkpointing = activation_checkpointing
        self.token_emb = nn.Embedding(num_tokens, dim)
        self.layers = nn.ModuleList()
        for _ in range(depth):
            if use_sparse_attn:
                attn = SparseAttention(
                    dim=dim, dim_head=dim_head, heads=heads, kv_heads=kv_heads, causal=causal, **sparse_attn_kwargs
                )
            else:
                attn = FullAttention(dim=dim, dim_head=dim_head, heads=heads, kv_heads=kv_heads, causal=causal)
            self.layers.append(nn.ModuleList([attn, FeedForward(dim, ff_expansion)]))
        self.norm = nn.RMSNorm(dim)
        self.to_logits = nn.Linear(dim, num_tokens, bias=False)

    def forward(self, ids: torch.Tensor, return_loss: bool = False, caches: list | None = None,
                return_caches: bool = False, document_ids: torch.Tensor | None = None,
                loss_mask: torch.Tensor | None = None):
        """ids: [b, n] (int64) -> logits [b, n, num_tokens].

        With ``return_loss`` the model predicts ``ids[:, 1:]`` from ``ids[:, :-1]`` and
        returns the mean cross-entropy (nats) over the targets that ``loss_mask: [b, n]``
        (bool, default all) keeps. ``caches`` (one per layer, from an earlier call with
        ``return_caches``) continue decoding from the given tokens.

        ``document_ids: [b, n]`` packs documents in each row (``documents.pack_documents``
        makes both it and a ``loss_mask`` of the real tokens): no layer attends across
        documents, and no document's first token is a target.
        """
        if ids.ndim != 2 or ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"ids must be an integer tensor of shape [batch, seq_len], got {ids.dtype} {tuple(ids.shape)}")
        if loss_mask is not None:
            if not return_loss:
                raise ValueError("loss_mask needs return_loss=True")
            if not isinstance(loss_mask, torch.Tensor) or loss_mask.dtype != torch.bool or loss_mask.shape != ids.shape:
                raise ValueError(f"loss_mask must be a bool tensor of the shape of ids {tuple(ids.shape)}")
        if document_ids is not None:
            if caches is not None or return_caches:
                raise ValueError("document_ids packs documents for training: it cannot be combined with caches")
            if not isinstance(document_ids, torch.Tensor) or document_ids.shape != ids.shape:
                raise ValueError(f"document_ids must be a tensor of the shape of ids {tuple(ids.shape)}")
        if return_loss:
            if not self.causal:
                raise ValueError("return_loss (next-token prediction) needs a causal model")
            ids, labels = ids[:, :-1], ids[:, 1:]
            targets = torch.ones_like(labels, dtype=torch.bool) if loss_mask is None else loss_mask[:, 1:]
            if document_ids is not None:
                targets = targets & (document_ids[:, 1:] == document_ids[:, :-1])
                document_ids = document_ids[:, :-1]
            if loss_mask is not None or document_ids is not None:
                labels = labels.masked_fill(~targets, _IGNORED)
        x = self.token_emb(ids)
        new_caches = []
        recompute = self.activation_checkpointing and torch.is_grad_enabled()
        # A step through static caches: one token per row, whose linear layers read their
        # weights in place.
        static = caches is not None and all(isinstance(cache, StaticKVCache) for cache in caches)
        for index, (attn, ff) in enumerate(self.layers):
            if caches is None and not return_caches:
                # No RNG in the blocks to replay, and CUDA graph captures cannot read the RNG state.
                x = (checkpoint(_block, attn, ff, x, document_ids, use_reentrant=False, preserve_rng_state=False)
                     if recompute else _block(attn, ff, x, document_ids))
                continue
            layer_cache = None if caches is None else caches[index]
            if return_caches:
                attn_out, layer_cache = attn(x, cache=layer_cache, return_cache=True)
                new_caches.append(layer_cache)
            else:
                attn_out = attn(x, cache=layer_cache)
            x = x + attn_out
            x = x + ff(x, decoding=static)
        logits = decoding_linear(self.to_logits, self.norm(x)) if static else self.to_logits(self.norm(x))
        if return_loss:
            # Rows of [b * n, vocab], not [b, vocab, n]: that layout is nll_loss2d, whose CUDA mean
            # adds atomically and is refused under torch.use_deterministic_algorithms.
            return F.cross_entropy(logits.flatten(0, 1), labels.flatten().long(), ignore_index=_IGNORED)
        return (logits, new_caches) if return_caches else logits

    @torch.no_grad()
    def sample(self, prompt: torch.Tensor | Sequence[torch.Tensor], seq_len: int | Sequence[int],
               temperature: float = 1.0, filter_thres: float = 0.9, use_cache_kv: bool = False,
               use_cuda_graph: bool = False, on_token: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor | list[torch.Tensor]:
        """Continue ``prompt: [b, p]`` (or ``[p]``) until it is ``seq_len`` tokens long.

        Sampling keeps the top ``1 - filter_thres`` fraction of the logits; ``temperature=0``
        is greedy decoding. Returns only the generated tokens, ``[b, seq_len - p]``.
        ``use_cache_kv`` decodes one token per step through the layers' caches;
        ``use_cuda_graph`` also captures that step in a CUDA graph and replays it (CUDA,
        with any sparse layers on the Triton kernels), after a prefill of the prompt.
        ``on_token`` is called with each step's tokens, ``[b]`` (streaming them out).

        ``prompt`` may also be a list of 1-d prompts of different lengths, decoded as one
        batch: each is continued until it is ``seq_len`` tokens long (or ``seq_len[i]``,
        given one length per prompt), and the list of their continuations is returned
        (``seq_len - p_i`` tokens each). The batch runs until its last row is done;
        ``on_token`` sees -1 for rows already complete. Through caches each prompt is
        prefilled alone and the rows decode at their own positions
        (``static_cache.cat_caches``), which needs the sparse layers on the Triton kernels
        (CUDA, or ``TRITON_INTERPRET=1``; full attention decodes so anywhere); without
        caches each step reads the batch padded on the right, which causal layers never see.
        """
        if not self.causal:
            raise ValueError("sample needs a causal model")
        if not 0.0 <= filter_thres < 1.0:
            raise ValueError(f"filter_thres must be in [0, 1), got {filter_thres}")

        def pick(logits: torch.Tensor) -> torch.Tensor:
            return _next_token(logits, temperature, filter_thres)

        if isinstance(prompt, (list, tuple)):
            prompts = _checked_prompts(prompt)
            lengths = _checked_lengths(seq_len, len(prompts))
            return self._sample_ragged(prompts, lengths, pick, use_cache_kv, use_cuda_graph, on_token)
        if isinstance(seq_len, (list, tuple)):
            raise TypeError("seq_len is one int for a tensor prompt; one length per prompt needs a list of prompts")
        squeeze = prompt.ndim == 1
        out = prompt[None] if squeeze else prompt
        prompt_len = out.shape[1]
        if prompt_len == 0:
            raise ValueError("prompt must hold at least one token")
        if use_cuda_graph:
            self._check_graphable(out)
        was_training = self.training
        self.eval()
        caches, replay = None, None
        for _ in range(max(0, seq_len - prompt_len)):
            if replay is not None:
                logits = replay(out[:, -1:])
            elif use_cache_kv or use_cuda_graph:
                step_input = out if caches is None else out[:, -1:]
                logits, caches = self(step_input, caches=caches, return_caches=True)
                if use_cuda_graph:
                    replay = self._graphed_step(caches, capacity=seq_len, example_ids=out[:, -1:])
            else:
                logits = self(out)
            next_token = pick(logits[:, -1])
            out = torch.cat((out, next_token), dim=1)
            if on_token is not None:
                on_token(next_token[:, 0])
        self.train(was_training)
        generated = out[:, prompt_len:]
        return generated[0] if squeeze else generated

    def _sample_ragged(self, prompts: list[torch.Tensor], seq_lens: torch.Tensor,
                       pick: Callable[[torch.Tensor], torch.Tensor], use_cache_kv: bool, use_cuda_graph: bool,
                       on_token: Callable[[torch.Tensor], None] | None) -> list[torch.Tensor]:
        """``sample`` of prompts of different lengths (1-d each) as one batch."""
        if use_cuda_graph:
            self._check_graphable(prompts[0][None])
        elif use_cache_kv and not self.has_graphable_decoding():
            raise ValueError("prompts of different lengths decode through caches only where the sparse attention "
                             "layers run on the Triton kernels (use_triton_kernel=True); without caches "
                             "(use_cache_kv=False) any model decodes them")
        device = prompts[0].device
        lengths = torch.tensor([len(p) for p in prompts])
        wanted = (seq_lens - lengths).clamp(min=0)
        steps = int(wanted.max())
        complete = (torch.arange(steps)[None, :] >= wanted[:, None]).to(device)
        generated = torch.full((len(prompts), steps), -1, dtype=torch.long, device=device)
        was_training = self.training
        self.eval()
        if steps:
            if use_cache_kv or use_cuda_graph:
                logits, step = self._static_decoding(prompts, steps, use_cuda_graph)
            else:
                logits, step = self._padded_decoding(prompts, steps)
            for t in range(steps):
                next_token = pick(logits)
                generated[:, t] = next_token[:, 0].masked_fill(complete[:, t], -1)
                if on_token is not None:
                    on_token(generated[:, t])
                if t + 1 < steps:
                    logits = step(next_token)
        self.train(was_training)
        return [row[:count] for row, count in zip(generated, wanted.tolist())]

    def _static_decoding(self, prompts: list[torch.Tensor], steps: int, use_cuda_graph: bool):
        """Each prompt prefilled alone and its caches moved into static ones with room for
        ``steps`` more tokens, joined into one batch whose rows sit at their own positions.
        Returns the prefills' last logits ``[b, num_tokens]`` and the step ``[b, 1] ids ->
        [b, num_tokens]`` that continues them."""
        capacity = max(len(p) for p in prompts) + steps
        last_logits, static = [], []
        for p in prompts:
            logits, caches = self(p[None], return_caches=True)
            last_logits.append(logits[:, -1])
            static.append(self._static_caches(caches, capacity))
        static = [cat_caches(layer_caches) for layer_caches in zip(*static)]
        if use_cuda_graph:
            graphed = self._capture(static, torch.stack([p[-1:] for p in prompts]))
            return torch.cat(last_logits), lambda ids: graphed(ids)[:, -1]
        return torch.cat(last_logits), lambda ids: self(ids, caches=static)[:, -1]

    def _padded_decoding(self, prompts: list[torch.Tensor], steps: int):
        """The prompts padded on the right into one batch, every step run over the whole of
        it: a causal model's logits at a row's last token never see the padding. Returns
        the first logits ``[b, num_tokens]`` and the step ``[b, 1] ids -> [b, num_tokens]``."""
        device = prompts[0].device
        ends = torch.tensor([len(p) for p in prompts], device=device)
        width = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), width + steps, dtype=torch.long, device=device)
        for row, p in enumerate(prompts):
            ids[row, : len(p)] = p
        rows = torch.arange(len(prompts), device=device)
        # The longest row's length, kept on the host: every row grows by one token a step.
        filled = width

        def last_logits() -> torch.Tensor:
            return self(ids[:, :filled])[rows, ends - 1]

        def step(next_ids: torch.Tensor) -> torch.Tensor:
            nonlocal filled
            ids[rows, ends] = next_ids[:, 0]
            ends.add_(1)
            filled += 1
            return last_logits()

        return last_logits(), step

    def has_graphable_decoding(self) -> bool:
        """Whether ``sample(..., use_cuda_graph=True)`` can run on CUDA ids: every attention
        layer has static caches (``static_cache``), the sparse ones on the Triton kernels."""
        return all(isinstance(attn, FullAttention) or attn.use_triton_kernel for attn, _ in self.layers)

    def _check_graphable(self, ids: torch.Tensor) -> None:
        if not ids.is_cuda:
            raise ValueError(f"use_cuda_graph needs CUDA ids, got ids on {ids.device}")
        if not self.has_graphable_decoding():
            raise ValueError("use_cuda_graph needs sparse attention layers with use_triton_kernel=True")

    def _graphed_step(self, caches: list, capacity: int, example_ids: torch.Tensor) -> _GraphedStep:
        """One decoding step through static copies of ``caches``, captured in a CUDA graph."""
        return self._capture(self._static_caches(caches, capacity), example_ids)

    def _static_caches(self, caches: list, capacity: int) -> list:
        """The layers' ``caches`` moved into static ones of ``capacity`` tokens."""
        return [attn.static_cache(cache, capacity) for (attn, _), cache in zip(self.layers, caches)]

    def _capture(self, static: list, example_ids: torch.Tensor) -> _GraphedStep:
        ids = example_ids.clone()
        graph, logits = capture_step(lambda: self(ids, caches=static), static)
        return _GraphedStep(graph, ids, logits, static)


class _GraphedStep:
    """``ids [b, 1] -> logits [b, 1, num_tokens]`` by replaying a captured decoding step.

    Holds every tensor the graph reads or writes beyond its own pool: the input ids and
    the static caches, whose memory would otherwise be freed and reused under it."""

    def __init__(self, graph: torch.cuda.CUDAGraph, ids: torch.Tensor, logits: torch.Tensor, caches: list):
        self.graph, self.ids, self.logits, self.caches = graph, ids, logits, caches

    def __call__(self, next_ids: torch.Tensor) -> torch.Tensor:
        self.ids.copy_(next_ids)
        self.graph.replay()
        return self.logits
