"""Compression networks: each maps a window of keys (or values) to one compressed token.

Every network takes ``windows: [b, h, w, block_size, d]`` (``w`` windows of ``block_size``
tokens per head, intra-block position embeddings already added) and returns
``[b, h, w, d]``. Pass one as ``SparseAttention(compress_mlp=...)``; the layer makes an
independent copy for keys and for values.

- ``CompressMLP``: one MLP over the flattened window, shared by all heads (the default);
  on CUDA one autograd node (``kernels/compress_mlp.py``).
- ``GroupedCompressMLP``: the same with separate weights per kv head.
- ``ConvCompress``: a per-head convolution whose kernel spans the window.
- ``AttentionPoolCompress``: softmax-weighted pooling with learned, content-dependent scores.
- ``TransformerCompress``: a small transformer over the window, read out through a summary token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

__all__ = [
    "AttentionPoolCompress",
    "CompressMLP",
    "ConvCompress",
    "GroupedCompressMLP",
    "TransformerCompress",
]


def sliding_windows(t: torch.Tensor, size: int, stride: int) -> torch.Tensor:
    """t: [b, h, n, d] -> its complete windows ``t[:, :, w * stride : w * stride + size]``,
    [b, h, w, size, d]: a view of t in eager mode, a new tensor when compiled.

    Compiled, unfold's backward becomes a zero fill and a scatter of atomic adds (0.06 ms
    of the layer benchmark's step at n = 65536 on an H100), so windows made of whole
    strides take a backward that gathers each stride's gradient from the ``size // stride``
    windows holding it; eager mode keeps unfold and its native backward kernel.
    """
    if torch.compiler.is_compiling() and size % stride == 0 and t.shape[2] >= size:
        return _TiledWindows.apply(t, size, stride)
    return rearrange(t.unfold(2, size, stride), "b h w d t -> b h w t d")


class _TiledWindows(torch.autograd.Function):
    """``sliding_windows`` for windows of whole strides. The forward copies: returned as a
    view of the input, a compiled graph's output got a wrong gradient (torch 2.13), while
    inside a graph the copy fuses with whatever reads the windows. It clones rather than
    calling ``contiguous``, which returns the view itself where the windows already lie
    contiguously (size == stride, or a single window); as a graph's output, torch 2.11
    gave those a zero gradient."""

    @staticmethod
    def forward(t: torch.Tensor, size: int, stride: int) -> torch.Tensor:
        windows = rearrange(t.unfold(2, size, stride), "b h w d t -> b h w t d")
        return windows.clone(memory_format=torch.contiguous_format)

    @staticmethod
    def setup_context(ctx, inputs, output):
        t, ctx.size, ctx.stride = inputs
        ctx.length = t.shape[2]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        windows = grad.shape[2]
        # Stride j of window w is stride w + j of t: shift each window part into place.
        parts = rearrange(grad, "b h w (j s) d -> j b h (w s) d", s=ctx.stride)
        dt = sum(F.pad(part, (0, 0, j * ctx.stride, ctx.length - (windows + j) * ctx.stride))
                 for j, part in enumerate(parts))
        return dt, None, None


def _hidden_size(block_size: int, dim_head: int, expand_factor: float) -> int:
    if expand_factor <= 0:
        raise ValueError(f"expand_factor must be > 0, got {expand_factor}")
    return max(1, int(block_size * dim_head * expand_factor))


def has_hooks(module: nn.Module) -> bool:
    """Whether ``module`` itself carries forward or backward hooks: code that bypasses its
    forward (to fold or fuse its work) would skip them."""
    return any((module._forward_hooks, module._forward_pre_hooks, module._backward_hooks,
                module._backward_pre_hooks))


def plain_linear(module: nn.Module) -> bool:
    """Whether ``module`` is an ``nn.Linear`` as constructed, without hooks: one whose
    matmul a layer may fold into its own (a subclass, or a hook, expects its forward)."""
    return type(module) is nn.Linear and not has_hooks(module)


class CompressMLP(nn.Module):
    """``Linear(block_size * d -> hidden) -> ReLU -> Linear(hidden -> d)``, shared by all heads."""

    def __init__(self, block_size: int, dim_head: int, expand_factor: float = 1.0):
        super().__init__()
        hidden = _hidden_size(block_size, dim_head, expand_factor)
        self.net = nn.Sequential(
            nn.Linear(block_size * dim_head, hidden), nn.ReLU(), nn.Linear(hidden, dim_head)
        )

    def forward(self, windows: torch.Tensor) -> torch.Tensor:
        """windows: [b, h, w, block_size, d] -> [b, h, w, d]"""
        flat = rearrange(windows, "b h w t d -> b h w (t d)")
        # No windows (a sequence shorter than one): the plain layers, whose zero gradients
        # need no kernel launches.
        if not flat.is_cuda or not self.fusable() or flat.numel() == 0:
            return self.net(flat)
        # On CUDA, one autograd node with the ReLU fused into both passes
        # (kernels/compress_mlp.py), in the dtype autocast would give the Linear layers.
        from native_sparse_attention.kernels.compress_mlp import relu_mlp

        rows = flat.reshape(-1, flat.shape[-1]).to(self.compute_dtype(flat.dtype)).contiguous()
        first, _, second = self.net
        out = relu_mlp(rows, *(p.contiguous() for p in (first.weight, first.bias, second.weight, second.bias)))
        return out.view(*flat.shape[:-1], out.shape[-1])

    def compute_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype in which the fused node computes on CUDA windows of ``dtype``: the one
        autocast would give the Linear layers."""
        autocast = torch.is_autocast_enabled("cuda") and dtype != torch.float64  # autocast leaves float64
        return torch.get_autocast_dtype("cuda") if autocast else dtype

    def fusable(self) -> bool:
        """Whether ``net`` is as constructed, so that ``relu_mlp`` computes its forward: a
        layer replaced or hooked expects its own."""
        first, activation, second = self.net
        return (type(first) is nn.Linear and type(activation) is nn.ReLU and type(second) is nn.Linear
                and not any(map(has_hooks, (self.net, first, activation, second))))


class GroupedCompressMLP(nn.Module):
    """A two-layer MLP over the flattened window with separate weights for each of ``heads``."""

    def __init__(self, heads: int, block_size: int, dim_head: int, expand_factor: float = 1.0):
        super().__init__()
        hidden = _hidden_size(block_size, dim_head, expand_factor)
        fan_in = block_size * dim_head
        self.w1 = nn.Parameter(torch.randn(heads, fan_in, hidden) * fan_in**-0.5)
        self.b1 = nn.Parameter(torch.zeros(heads, 1, hidden))
        self.w2 = nn.Parameter(torch.randn(heads, hidden, dim_head) * hidden**-0.5)
        self.b2 = nn.Parameter(torch.zeros(heads, 1, dim_head))

    def forward(self, windows: torch.Tensor) -> torch.Tensor:
        """windows: [b, h, w, block_size, d] -> [b, h, w, d]"""
        flat = rearrange(windows, "b h w t d -> b h w (t d)")
        hidden = torch.relu(torch.einsum("bhwi,hio->bhwo", flat, self.w1) + self.b1)
        return torch.einsum("bhwi,hio->bhwo", hidden, self.w2) + self.b2


class ConvCompress(nn.Module):
    """A grouped 1-d convolution (one group per head) whose kernel covers the whole window."""

    def __init__(self, heads: int, block_size: int, dim_head: int):
        super().__init__()
        self.heads = heads
        self.conv = nn.Conv1d(heads * dim_head, heads * dim_head, block_size, groups=heads)

    def forward(self, windows: torch.Tensor) -> torch.Tensor:
        """windows: [b, h, w, block_size, d] -> [b, h, w, d]"""
        batch, heads = windows.shape[:2]
        if heads != self.heads:
            raise ValueError(f"ConvCompress was built for {self.heads} heads, got {heads}")
        channels = rearrange(windows, "b h w t d -> (b w) (h d) t")
        out = self.conv(channels)
        return rearrange(out, "(b w) (h d) 1 -> b h w d", b=batch, h=heads)


class AttentionPoolCompress(nn.Module):
    """Softmax pooling over the window: ``sum_t softmax_t(score(x_t)) * proj(x_t)``."""

    def __init__(self, block_size: int, dim_head: int):
        super().__init__()
        self.to_score = nn.Linear(dim_head, 1, bias=False)  # a bias cancels in the softmax
        self.position_bias = nn.Parameter(torch.zeros(block_size))
        self.to_value = nn.Linear(dim_head, dim_head)

    def forward(self, windows: torch.Tensor) -> torch.Tensor:
        """windows: [b, h, w, block_size, d] -> [b, h, w, d]"""
        scores = self.to_score(windows).squeeze(-1) + self.position_bias
        weights = scores.softmax(dim=-1)
        return torch.einsum("bhwt,bhwtd->bhwd", weights, self.to_value(windows))


class TransformerCompress(nn.Module):
    """A small pre-norm transformer encoder over the window tokens plus a learned summary
    token, whose final state is the compressed token."""

    def __init__(self, block_size: int, dim_head: int, depth: int = 1, heads: int = 4):
        super().__init__()
        if dim_head % heads != 0:
            raise ValueError(f"dim_head ({dim_head}) must be divisible by heads ({heads})")
        self.summary = nn.Parameter(torch.randn(dim_head) * 0.02)
        layer = nn.TransformerEncoderLayer(
            dim_head, heads, dim_feedforward=2 * dim_head, dropout=0.0, batch_first=True, norm_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim_head)

    def forward(self, windows: torch.Tensor) -> torch.Tensor:
        """windows: [b, h, w, block_size, d] -> [b, h, w, d]"""
        batch, heads, num_windows = windows.shape[:3]
        tokens = rearrange(windows, "b h w t d -> (b h w) t d")
        summary = self.summary.expand(tokens.shape[0], 1, -1).to(tokens.dtype)
        encoded = self.encoder(torch.cat((summary, tokens), dim=1))
        return rearrange(self.norm(encoded[:, 0]), "(b h w) d -> b h w d", b=batch, h=heads)
