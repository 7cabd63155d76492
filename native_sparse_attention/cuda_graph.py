"""A training micro-step (forward, loss, backward), or a validation batch's loss, captured
once into a CUDA graph.

Short sequences leave the GPU waiting on Python: an NSA layer launches well over a
hundred kernels per forward and backward, and at a few thousand tokens their launch takes
longer than their work. Replaying a captured graph launches them all at once.
"""

from __future__ import annotations

import functools
from typing import Callable, TypeVar

import torch
from torch import nn

T = TypeVar("T")

__all__ = ["GraphedLoss", "GraphedLossBackward", "capture"]


@functools.cache
def _warmup_stream(device: int) -> torch.cuda.Stream:
    # cuBLAS keeps a workspace for every stream it has run on until the process exits
    # (32 MiB on Hopper, as much again for cuBLASLt): a new stream per capture would leak
    # them each time.
    return torch.cuda.Stream(device)


def capture(fn: Callable[[], T], warmup_steps: int = 3) -> tuple[torch.cuda.CUDAGraph, T]:
    """Runs ``fn`` ``warmup_steps`` times, then captures one more call into a CUDA graph.

    Returns the graph and what the captured call returned (tensors the replays rewrite).
    The graph reads and writes the tensors ``fn`` uses at their addresses without holding
    them: the caller keeps them alive as long as the graph may replay.
    """
    # Capture needs the allocator and cuBLAS workspaces warmed up off the default stream.
    side = _warmup_stream(torch.cuda.current_device())
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup_steps):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = fn()
    return graph, result


class _ReplayedLoss:
    """A loss captured for ids of one shape: ``self.ids``, the graph and the loss it writes."""

    ids: torch.Tensor
    graph: torch.cuda.CUDAGraph
    loss: torch.Tensor

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """ids: [b, n + 1] of the captured shape -> the loss (a 0-dim copy)."""
        if ids.shape != self.ids.shape:
            raise ValueError(f"ids must have the captured shape {tuple(self.ids.shape)}, got {tuple(ids.shape)}")
        self.ids.copy_(ids)
        self.graph.replay()
        return self.loss.clone()


class GraphedLossBackward(_ReplayedLoss):
    """``model(ids, return_loss=True)`` under bf16 autocast and the backward of
    ``loss * loss_scale``, for ids of ``example_ids``'s shape, replayed from a CUDA graph.

    The replay reads the parameters where they are (an optimizer may update them in
    place) and adds the gradients into the ``.grad`` tensors that exist at capture (zeros
    are created where missing): clear them in place between steps
    (``optimizer.zero_grad(set_to_none=False)``), never set them to None. Construction
    runs the step a few times (warm-up) and leaves garbage in those gradients.
    """

    def __init__(self, model: nn.Module, example_ids: torch.Tensor, loss_scale: float, warmup_steps: int = 3):
        if not example_ids.is_cuda:
            raise ValueError(f"CUDA graphs need CUDA inputs, got ids on {example_ids.device}")
        self.model, self.loss_scale = model, loss_scale
        self.ids = example_ids.clone()
        for parameter in model.parameters():
            if parameter.requires_grad and parameter.grad is None:
                parameter.grad = torch.zeros_like(parameter)
        self.graph, self.loss = capture(self._step, warmup_steps)

    def _step(self) -> torch.Tensor:
        # Autocast caches its casts of the weights and frees them when its context ends:
        # a graph that captured a cached cast would keep reading freed memory.
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
            loss = self.model(self.ids, return_loss=True)
        (loss * self.loss_scale).backward()
        return loss.detach()


class GraphedLoss(_ReplayedLoss):
    """``model(ids, return_loss=True)`` without gradients under bf16 autocast, for ids of
    ``example_ids``'s shape, replayed from a CUDA graph: a validation pass's batches."""

    def __init__(self, model: nn.Module, example_ids: torch.Tensor, warmup_steps: int = 1):
        if not example_ids.is_cuda:
            raise ValueError(f"CUDA graphs need CUDA inputs, got ids on {example_ids.device}")
        self.model = model
        self.ids = example_ids.clone()
        self.graph, self.loss = capture(self._loss, warmup_steps)

    @torch.no_grad()
    def _loss(self) -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
            return self.model(self.ids, return_loss=True)
