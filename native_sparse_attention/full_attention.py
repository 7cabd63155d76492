"""Full (dense) attention with the same interface as ``SparseAttention``: the baseline."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn
from torch.nn.attention.bias import causal_lower_right

from native_sparse_attention.compress import plain_linear
from native_sparse_attention.documents import checked_document_bounds
from native_sparse_attention.layer_input import check_layer_input
from native_sparse_attention.rotary import RotaryEmbedding, rotated_query_and_key_heads, split_qkv_heads
from native_sparse_attention.static_cache import StaticKVCache, decoding_linear, static_key_values

__all__ = ["FullAttention", "FullAttentionCache", "StaticFullAttentionCache"]


@dataclass(frozen=True)
class FullAttentionCache:
    """keys (rotary applied), values: [b, hk, t, d] of the tokens seen so far."""

    keys: torch.Tensor
    values: torch.Tensor

    @property
    def seq_len(self) -> int:
        return self.keys.shape[2]


@dataclass(frozen=True)
class StaticFullAttentionCache(StaticKVCache):
    """Decoding state of one ``FullAttention`` layer in buffers of a fixed capacity, which
    each step updates in place (``FullAttention.static_cache``; the fields are
    ``StaticKVCache``'s)."""


class FullAttention(nn.Module):
    """RMSNorm, grouped-query attention through ``torch.nn.functional.scaled_dot_product_attention``
    with rotary embeddings, output projection. ``forward(x: [b, n, dim]) -> [b, n, dim]``."""

    def __init__(self, dim: int, dim_head: int, heads: int, kv_heads: int | None = None,
                 causal: bool = True, norm: bool = True):
        super().__init__()
        kv_heads = heads if kv_heads is None else kv_heads
        if heads % kv_heads:
            raise ValueError(f"heads ({heads}) must be divisible by kv_heads ({kv_heads})")
        if dim_head % 2:
            raise ValueError(f"dim_head must be even for rotary embeddings, got {dim_head}")
        self.dim, self.dim_head, self.heads, self.kv_heads, self.causal = dim, dim_head, heads, kv_heads, causal
        self.norm = nn.RMSNorm(dim) if norm else nn.Identity()
        self.to_qkv = nn.Linear(dim, (heads + 2 * kv_heads) * dim_head, bias=False)
        self.rotary = RotaryEmbedding(dim_head)
        self.to_out = nn.Linear(heads * dim_head, dim, bias=False)

    def forward(self, x: torch.Tensor, cache: FullAttentionCache | StaticFullAttentionCache | None = None,
                return_cache: bool = False, document_ids: torch.Tensor | None = None):
        """x: [b, n, dim] -> [b, n, dim] (and the cache when ``return_cache``); with a cache,
        x holds the next tokens (one per row with a ``StaticFullAttentionCache``, which the
        step updates in place). ``document_ids: [b, n]`` (integer) packs documents: a run
        of equal ids is one document, attended causally and alone (causal layers, without a
        cache; on CUDA through FlexAttention, elsewhere through a dense mask)."""
        check_layer_input(x, self.dim, self.to_qkv.weight)
        if isinstance(cache, StaticFullAttentionCache):
            if return_cache or document_ids is not None:
                raise ValueError("a static cache is updated in place: call the layer with it alone")
            return self._static_step(x, cache)
        if document_ids is not None:
            return self._attend_documents(x, document_ids, cache is not None or return_cache)
        offset = 0 if cache is None else cache.seq_len
        normed = self._normed(x)
        # Only the rotated queries and keys are attended.
        _, _, v, q, k, _ = self.rotary.split_heads(self._project(normed), self.heads, self.kv_heads, offset)
        if cache is not None:
            k = torch.cat((cache.keys, k), dim=2)
            v = torch.cat((cache.values, v), dim=2)
        # With a cache every new query may see every cached key: the causal mask is the
        # bottom-right-aligned one, which SDPA's is_causal only gives for square inputs. As a
        # CausalBias it runs on the flash kernel where that can: SDPA's own choice of kernel
        # for a decoding step (one query, a key length that grows every step), with or
        # without a boolean mask, took some 40 ms on an H100 (torch 2.11) for 0.06 ms of
        # attention.
        n_new, n_keys = q.shape[2], k.shape[2]
        mask = causal_lower_right(n_new, n_keys) if self.causal and n_new != n_keys else None
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=self.causal and mask is None,
            enable_gqa=self.heads != self.kv_heads,
        )
        out = self.to_out(rearrange(out, "b h n d -> b n (h d)"))
        return (out, FullAttentionCache(k, v)) if return_cache else out

    def static_cache(self, cache: FullAttentionCache, capacity: int) -> StaticFullAttentionCache:
        """``cache`` moved into buffers of ``capacity`` tokens, which every later step (one
        token per row, rows at positions of their own) updates in place: decoding that a
        CUDA graph can replay, and whose batch rows ``static_cache.cat_caches`` may join from
        prompts of different lengths."""
        if not isinstance(cache, FullAttentionCache):
            raise TypeError(f"cache must be a FullAttentionCache, got {type(cache).__name__}")
        if not self.causal:
            raise ValueError("static caches decode causal layers: build the layer with causal=True")
        return StaticFullAttentionCache(**static_key_values(cache.keys, cache.values, capacity))

    def _static_step(self, x: torch.Tensor, cache: StaticFullAttentionCache) -> torch.Tensor:
        """x: [b, 1, dim], row ``r`` the token at ``cache.position[r]`` -> [b, 1, dim]; writes
        its keys and values and advances the positions. A step past the capacity fails a
        device-side index check."""
        if x.shape[1] != 1:
            raise ValueError(f"a static cache decodes one token per step, got x with seq_len {x.shape[1]}")
        if torch.is_grad_enabled() and any(p.requires_grad for p in self.parameters()):
            raise ValueError("a static cache decodes without gradients: call the layer under torch.no_grad()")
        qkv = decoding_linear(self.to_qkv, self._normed(x))
        _, _, v, _ = split_qkv_heads(qkv, self.heads, self.kv_heads, self.dim_head)
        position, dtype = cache.position, cache.keys.dtype
        rq, rk = rotated_query_and_key_heads(qkv, self.heads, self.kv_heads, self.dim_head,
                                             lambda heads: self.rotary.at(heads, position))
        # scatter_ checks the positions against the capacity on the device.
        rows = position.view(-1, 1, 1, 1).expand_as(rk)
        cache.keys.scatter_(2, rows, rk.to(dtype))
        cache.values.scatter_(2, rows, v.to(dtype))
        visible = torch.arange(cache.capacity, device=x.device) <= position[:, None]
        out = F.scaled_dot_product_attention(
            rq.to(dtype), cache.keys, cache.values, attn_mask=visible[:, None, None],
            enable_gqa=self.heads != self.kv_heads,
        )
        position.add_(1)
        return decoding_linear(self.to_out, rearrange(out, "b h n d -> b n (h d)"))

    def _attend_documents(self, x: torch.Tensor, document_ids: torch.Tensor, cached: bool) -> torch.Tensor:
        if cached:
            raise ValueError("document_ids packs documents for training: it cannot be combined with a cache")
        if not self.causal:
            raise ValueError("document_ids needs a causal layer (causal=True)")
        document_start, _ = checked_document_bounds(document_ids, x)
        _, _, v, q, k, _ = self.rotary.split_heads(self._project(self._normed(x)), self.heads, self.kv_heads, 0)
        if x.is_cuda:
            from native_sparse_attention.flex import flex_document_causal_attention

            out = flex_document_causal_attention(q, k, v, document_start)
        else:
            positions = torch.arange(x.shape[1], device=x.device)
            visible = (positions[None, :] <= positions[:, None]) & (positions >= document_start[:, :, None])
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible[:, None],
                                                 enable_gqa=self.heads != self.kv_heads)
        return self.to_out(rearrange(out, "b h n d -> b n (h d)"))

    def _project(self, normed: torch.Tensor) -> torch.Tensor:
        """The q / k / v projection, on CUDA as the sparse layer projects (its weight cast
        once and its gradient written in float32 by ``kernels/projection.projected``)."""
        if not (plain_linear(self.to_qkv) and self.to_qkv.bias is None):
            return self.to_qkv(normed)
        from native_sparse_attention.kernels.projection import projected

        return projected(normed, (self.to_qkv.weight,))

    def _normed(self, x: torch.Tensor) -> torch.Tensor:
        """The normed input; on CUDA as the sparse layer norms it on its fast paths, so that
        the two layers differ in their attention alone."""
        if not x.is_cuda:
            return self.norm(x)
        from native_sparse_attention.kernels.rms_norm import normed_for_projection

        return normed_for_projection(self.norm, x)
