"""The kernel launchers as ``torch.library`` operators, so that ``torch.compile`` keeps
whole graphs.

Dynamo cannot trace the launchers' host code (launch configurations, the selection's
inversion), and Inductor cannot lower the kernels themselves (they read and write bool
masks, which its Triton wrapper rejects). Registered as custom operators with fake
(shape-only) implementations, each launcher is one opaque node of the compiled graph:
``torch.compile(fullgraph=True)`` compiles the whole layer, and
``mode="reduce-overhead"`` replays it, kernels included, from a CUDA graph.

Eager calls go straight to the Python function: the dispatcher's round trip costs some
15 us per call (measured on the CPU), and eager steps of short sequences are already
bound by their host time.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

__all__ = ["NAMESPACE", "launcher_op", "is_tokens_major", "new_heads_tensor"]

NAMESPACE = "native_sparse_attention"


def launcher_op(name: str, fake: Callable) -> Callable[[Callable], Callable]:
    """Decorator: registers ``launcher`` (fully type-annotated, returning fresh tensors
    only) as the operator ``native_sparse_attention::<name>`` with the fake
    implementation ``fake``, and returns a function that calls the operator while
    compiling and ``launcher`` itself otherwise."""

    def register(launcher: Callable) -> Callable:
        op = torch.library.custom_op(f"{NAMESPACE}::{name}", launcher, mutates_args=())
        op.register_fake(fake)

        @functools.wraps(launcher)
        def call(*args, **kwargs):
            if torch.compiler.is_compiling():
                return op(*args, **kwargs)
            return launcher(*args, **kwargs)

        return call

    return register


def is_tokens_major(t: torch.Tensor) -> bool:
    """Whether ``t: [b, h, n, d]`` keeps each token's heads together in memory, as the
    layer's head-splitting views of its qkv projection do."""
    return t.stride(1) < t.stride(2)


def new_heads_tensor(t: torch.Tensor, tokens_major: bool, new: Callable) -> torch.Tensor:
    """A tensor of ``t``'s [b, h, n, d] shape from ``new(shape)``, laid out as [b, n, h, d]
    when ``tokens_major``. A gradient in that layout lets the projection's gradient
    gather each token's heads without a transpose; an operator's real and fake
    implementations both call this, so that their strides agree."""
    b, h, n, d = t.shape
    if tokens_major:
        return new((b, n, h, d)).transpose(1, 2)
    return new((b, h, n, d))
