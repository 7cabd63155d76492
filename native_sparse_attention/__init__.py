"""Native Sparse Attention (DeepSeek, 2025) in PyTorch with grouped-query Triton kernels."""

from native_sparse_attention.attend import native_sparse_attend
from native_sparse_attention.compress import (
    AttentionPoolCompress,
    CompressMLP,
    ConvCompress,
    GroupedCompressMLP,
    TransformerCompress,
)
from native_sparse_attention.documents import pack_documents
from native_sparse_attention.full_attention import FullAttention, StaticFullAttentionCache
from native_sparse_attention.sparse_attention import SparseAttention, SparseAttentionCache
from native_sparse_attention.static_cache import StaticSparseAttentionCache
from native_sparse_attention.transformer import Transformer

__all__ = [
    "AttentionPoolCompress",
    "CompressMLP",
    "ConvCompress",
    "FullAttention",
    "GroupedCompressMLP",
    "SparseAttention",
    "SparseAttentionCache",
    "StaticFullAttentionCache",
    "StaticSparseAttentionCache",
    "Transformer",
    "TransformerCompress",
    "native_sparse_attend",
    "pack_documents",
]
