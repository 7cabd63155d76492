"""See what a ``SparseAttention`` layer does: which key blocks each query selects, the
importance scores behind that choice, how the gates weigh the three branches and what the
compressed branch attends.

Recording is opt-in::

    with record(model) as recorders:      # one dict per SparseAttention layer
        model(ids)

or, in one call, ``record_forward(model, ids, layer=0)``, which returns an
``AttentionRecord``. Every ``plot_*`` function takes either such a record or a
``SparseAttention`` layer and its input ``x: [b, n, dim]``, and returns a
``matplotlib.figure.Figure``. Figures are built without pyplot, so a library caller never
accumulates open figures; in a notebook, ``display(fig)`` shows one.

Command line (PNG files for a ``train.py`` checkpoint, or the latest one of a run)::

    python -m native_sparse_attention.viz --checkpoint runs/tiny \\
        --text "Some text" --out figures [--layer 0] [--head 0]
"""

from __future__ import annotations

import argparse
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np
import torch
from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.collections import LineCollection
from matplotlib.colors import ListedColormap, LogNorm
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import FuncFormatter, NullFormatter
from torch import nn

from native_sparse_attention.checkpoint import load_model as load_checkpoint
from native_sparse_attention.cli import checkpoint_parser, exit_with_error
from native_sparse_attention.selection import selectable_blocks
from native_sparse_attention.sparse_attention import SparseAttention

__all__ = [
    "AttentionRecord",
    "byte_labels",
    "encode_text",
    "load_checkpoint",
    "plot_block_scores",
    "plot_compressed_attention",
    "plot_gates",
    "plot_selection_map",
    "record",
    "record_forward",
    "sparse_attention_layers",
]

GATE_NAMES = ("compressed", "selected", "sliding")
# One colour per branch, shared by every figure so the gates plot reads like a legend for the maps.
BRANCH_COLORS = {"compressed": "#7b3294", "selected": "#1f5fa8", "sliding": "#1a9641"}
OWN_BLOCK_COLOR = "#f08c00"
UNAVAILABLE_COLOR = "#d9d9d9"
_SELECTED_MARK_COLOR = "#ff3b3b"
_MEMORY_EDGE_COLOR = "#00b4d8"

# Selection map cell categories, in colormap order.
_NOT_SELECTABLE, _CANDIDATE, _SELECTED, _OWN_BLOCK = range(4)
_SELECTION_CMAP = ListedColormap([UNAVAILABLE_COLOR, "#ffffff", BRANCH_COLORS["selected"], OWN_BLOCK_COLOR])

# Gates often sit on the same value (they start equal): a wide pale line under a dashed one
# keeps both visible where they coincide.
_GATE_LINE_STYLES = {
    "compressed": dict(linewidth=3.0, alpha=0.55),
    "selected": dict(linewidth=1.4, linestyle="--"),
    "sliding": dict(linewidth=1.4),
}
_PANEL_INCHES = 3.8
# Wide enough for the title and legend of a single panel.
_MIN_FIGURE_INCHES = 6.8
# Room for one legend entry, for the legend's number of columns.
_LEGEND_ENTRY_INCHES = 3.0
_MAX_COLUMNS = 4
# Above this many blocks the block-text tick labels would overlap; block numbers only.
_MAX_LABELLED_BLOCKS = 32
# Up to this many tokens every query position is labelled with its character.
_MAX_LABELLED_QUERIES = 64
# Position axes get about this many numbered ticks, on selection block boundaries.
_POSITION_TICKS = 10
# The compressed attention map's log colour scale spans at most this many decades below 1.
_PROB_DECADES = 4


# ---------------------------------------------------------------------------- recording


def sparse_attention_layers(module: nn.Module) -> list[SparseAttention]:
    """The ``SparseAttention`` layers inside ``module`` (itself included), in forward order
    for a ``Transformer``."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"expected an nn.Module, got {type(module).__name__}")
    return [m for m in module.modules() if isinstance(m, SparseAttention)]


@contextmanager
def record(module: nn.Module) -> Iterator[list[dict]]:
    """Record the intermediates of every ``SparseAttention`` layer in ``module`` while the
    context is open.

    Yields one dict per layer (the order of ``sparse_attention_layers``); each forward pass
    overwrites its layer's dict with detached tensors. The layers' previous recorders are
    restored on exit, so recording is off again afterwards.
    """
    layers = sparse_attention_layers(module)
    if not layers:
        raise ValueError(f"{type(module).__name__} holds no SparseAttention layer to record")
    previous = [layer.recorder for layer in layers]
    recorders = [{} for _ in layers]
    try:
        for layer, recorder in zip(layers, recorders):
            layer.recorder = recorder
        yield recorders
    finally:
        for layer, recorder in zip(layers, previous):
            layer.recorder = recorder


@dataclass(frozen=True)
class AttentionRecord:
    """What one ``SparseAttention`` forward pass computed for one sequence of ``n`` tokens.

    compressed_probs: [hq, n, num_mem + nc], compressed-branch attention (memory keys first).
    block_scores: [hs, n, nsb], importance of each selection block (0 where not selectable).
    selected_indices, selected_mask: [hs, n, num_selected], the top-n blocks per query.
    gates: [3, hq, n], the compressed, selected and sliding gate values.
    tokens: one display label per position, or None.

    ``hs`` is ``kv_heads`` when the query heads of a GQA group share their selection
    (``shared_selection``), ``heads`` otherwise. The remaining fields copy the layer's
    geometry so a record can be plotted without its layer.
    """

    compressed_probs: torch.Tensor
    block_scores: torch.Tensor
    selected_indices: torch.Tensor
    selected_mask: torch.Tensor
    gates: torch.Tensor
    heads: int
    kv_heads: int
    shared_selection: bool
    selection_block_size: int
    compress_block_size: int
    compress_stride: int
    num_mem: int
    sliding_window_size: int
    causal: bool
    tokens: tuple[str, ...] | None = None

    @classmethod
    def from_layer(
        cls,
        layer: SparseAttention,
        recorder: dict,
        batch_index: int = 0,
        tokens: Sequence[str] | None = None,
    ) -> "AttentionRecord":
        """Take sequence ``batch_index`` out of what ``layer`` wrote into ``recorder``."""
        needed = ("compressed_probs", "block_scores", "selected_indices", "selected_mask", "gates")
        missing = [name for name in needed if name not in recorder]
        if missing:
            raise ValueError(
                f"the recorder lacks {', '.join(missing)}: run a full forward pass on the PyTorch path "
                "(on the CPU, or with use_triton_kernel and use_flex_attention off; the CUDA kernels "
                "never materialise them)"
            )
        batch_size = recorder["gates"].shape[1]
        if not 0 <= batch_index < batch_size:
            raise ValueError(f"batch_index must be in [0, {batch_size}), got {batch_index}")
        seq_len = recorder["gates"].shape[-1]
        if tokens is not None and len(tokens) != seq_len:
            raise ValueError(f"tokens must hold one label per position ({seq_len}), got {len(tokens)}")
        return cls(
            compressed_probs=recorder["compressed_probs"][batch_index].float().cpu(),
            block_scores=recorder["block_scores"][batch_index].float().cpu(),
            selected_indices=recorder["selected_indices"][batch_index].cpu(),
            selected_mask=recorder["selected_mask"][batch_index].cpu(),
            gates=recorder["gates"][:, batch_index].float().cpu(),
            heads=layer.heads,
            kv_heads=layer.kv_heads,
            shared_selection=layer.share_selection,
            selection_block_size=layer.selection_block_size,
            compress_block_size=layer.compress_block_size,
            compress_stride=layer.compress_stride,
            num_mem=layer.num_mem,
            sliding_window_size=layer.sliding_window_size,
            causal=layer.causal,
            tokens=None if tokens is None else tuple(tokens),
        )

    @property
    def seq_len(self) -> int:
        return self.gates.shape[-1]

    @property
    def num_blocks(self) -> int:
        return self.block_scores.shape[-1]

    @property
    def num_compressed(self) -> int:
        return self.compressed_probs.shape[-1] - self.num_mem

    @property
    def selection_heads(self) -> int:
        return self.block_scores.shape[0]

    @property
    def group_size(self) -> int:
        """Query heads per kv head."""
        return self.heads // self.kv_heads

    def selectable(self) -> np.ndarray:
        """[n, nsb] bool: the blocks each query could have selected."""
        return selectable_blocks(
            self.seq_len, 0, self.num_compressed, self.compress_block_size, self.compress_stride,
            self.selection_block_size, self.num_blocks, self.causal,
        ).numpy()

    def selection_categories(self, selection_head: int) -> np.ndarray:
        """[n, nsb] int: not selectable, candidate, selected or own block, per query and block."""
        grid = np.where(self.selectable(), _CANDIDATE, _NOT_SELECTABLE)
        indices = self.selected_indices[selection_head].numpy()
        mask = self.selected_mask[selection_head].numpy()
        rows, slots = np.nonzero(mask)
        grid[rows, indices[rows, slots]] = _SELECTED
        if self.causal:
            # The selection branch always attends the query's own block (it is never a candidate).
            positions = np.arange(self.seq_len)
            grid[positions, positions // self.selection_block_size] = _OWN_BLOCK
        return grid


def record_forward(
    module: nn.Module,
    inputs: torch.Tensor,
    layer: int = 0,
    batch_index: int = 0,
    tokens: Sequence[str] | None = None,
) -> AttentionRecord:
    """Run ``module(inputs)`` without gradients and return the record of its ``layer``-th
    ``SparseAttention`` layer for sequence ``batch_index``.

    ``module`` is a ``SparseAttention`` (``inputs: [b, n, dim]``) or a model holding some,
    such as a ``Transformer`` (``inputs``: token ids ``[b, n]``).
    """
    layers = sparse_attention_layers(module)
    if not 0 <= layer < len(layers):
        raise ValueError(f"layer must be in [0, {len(layers)}) for this model, got {layer}")
    with record(module) as recorders, torch.no_grad():
        module(inputs)
    return AttentionRecord.from_layer(layers[layer], recorders[layer], batch_index, tokens)


def _as_record(source, x: torch.Tensor | None) -> AttentionRecord:
    if isinstance(source, AttentionRecord):
        if x is not None:
            raise ValueError("pass x only with a SparseAttention layer; a record already holds its forward pass")
        return source
    if isinstance(source, SparseAttention):
        if x is None:
            raise ValueError("plotting a SparseAttention layer needs its input x: [b, n, dim]")
        return record_forward(source, x)
    raise TypeError(f"expected an AttentionRecord or a SparseAttention layer, got {type(source).__name__}")


# ---------------------------------------------------------------------------- text helpers


def encode_text(text: str) -> torch.Tensor:
    """UTF-8 bytes of ``text`` as byte-level token ids, ``[n]`` (int64)."""
    if not isinstance(text, str) or not text:
        raise ValueError("text must be a non-empty string")
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def byte_labels(ids: torch.Tensor) -> list[str]:
    """One printable character per byte token: '·' for a space, '↵' for a newline, '?' for
    anything outside printable ASCII."""
    labels = []
    for byte in ids.tolist():
        if byte == ord(" "):
            labels.append("·")
        elif byte == ord("\n"):
            labels.append("↵")
        elif 33 <= byte < 127:
            labels.append(chr(byte))
        else:
            labels.append("?")
    return labels


# ---------------------------------------------------------------------------- figure helpers


def _panels(num_panels: int, aspect: float = 1.0) -> tuple[Figure, list[Axes]]:
    """A figure with one panel per head or group, sharing both axes, two columns up to four
    panels (so a figure stays readable at page width) and ``_MAX_COLUMNS`` beyond."""
    columns = min(num_panels, 2 if num_panels <= 4 else _MAX_COLUMNS)
    rows = -(-num_panels // columns)
    width = max(_PANEL_INCHES * columns + 1.2, _MIN_FIGURE_INCHES)
    fig = Figure(figsize=(width, _PANEL_INCHES * aspect * rows + 1.0), layout="constrained")
    grid = fig.subplots(rows, columns, squeeze=False, sharex=True, sharey=True)
    for ax in grid.flat[num_panels:]:
        fig.delaxes(ax)
    return fig, list(grid.flat[:num_panels])


def _label_outer(axes: list[Axes]) -> None:
    """Keep tick labels and axis labels on the left column and on the lowest panel of each
    column only (``Axes.label_outer`` would also strip a panel whose lower neighbour was
    removed from an incomplete last row)."""
    columns = axes[0].get_subplotspec().get_gridspec().ncols
    for index, ax in enumerate(axes):
        if index + columns < len(axes):
            ax.tick_params(labelbottom=False)
            ax.set_xlabel("")
        if index % columns:
            ax.tick_params(labelleft=False)
            ax.set_ylabel("")


def _check_head(head: int | None, heads: int) -> None:
    if head is None:
        return
    if isinstance(head, bool) or not isinstance(head, int):
        raise TypeError(f"head must be an int or None, got {type(head).__name__}")
    if not 0 <= head < heads:
        raise ValueError(f"head must be in [0, {heads}) (the layer's query heads), got {head}")


def _selection_panels(rec: AttentionRecord, head: int | None) -> list[tuple[int, str]]:
    """(selection head, panel title) pairs; ``head`` is a query head, mapped to its GQA
    group when the group shares one selection."""
    _check_head(head, rec.heads)
    if rec.shared_selection:
        groups = range(rec.kv_heads) if head is None else [head // rec.group_size]
        if rec.group_size == 1:
            return [(g, f"head {g}") for g in groups]
        return [
            (g, f"GQA group {g} (query heads {g * rec.group_size}–{(g + 1) * rec.group_size - 1})")
            for g in groups
        ]
    heads = range(rec.heads) if head is None else [head]
    return [(h, f"head {h}") for h in heads]


def _query_heads(rec: AttentionRecord, head: int | None) -> list[int]:
    _check_head(head, rec.heads)
    return list(range(rec.heads)) if head is None else [head]


def _block_texts(rec: AttentionRecord) -> list[str] | None:
    if rec.tokens is None or rec.num_blocks > _MAX_LABELLED_BLOCKS:
        return None
    size = rec.selection_block_size
    return ["".join(rec.tokens[j * size:(j + 1) * size]) for j in range(rec.num_blocks)]


def _label_block_axis(ax: Axes, rec: AttentionRecord) -> None:
    """Key blocks on the x axis, centred on their cells, with their text when known."""
    texts = _block_texts(rec)
    blocks = np.arange(rec.num_blocks)
    if texts is None:
        step = max(1, rec.num_blocks // 12)
        ax.set_xticks(blocks[::step] + 0.5, [str(j) for j in blocks[::step]])
    else:
        ax.set_xticks(blocks + 0.5, [f"{j} {text}" for j, text in zip(blocks, texts)],
                      rotation=90, fontsize=6, family="monospace")
    ax.set_xlabel(f"key block ({rec.selection_block_size} tokens each)")


def _label_position_axis(axis, rec: AttentionRecord) -> None:
    """Token positions on ``axis`` (``ax.xaxis`` or ``ax.yaxis``). Numbered ticks fall on
    selection block boundaries, where the block-causal diagonal steps; a short text has
    every position labelled with its character instead."""
    size, seq_len = rec.selection_block_size, rec.seq_len
    if rec.tokens is not None and seq_len <= _MAX_LABELLED_QUERIES:
        labels = [f"{i} {token}" if i % size == 0 else token for i, token in enumerate(rec.tokens)]
        axis.set_ticks(np.arange(seq_len), labels, fontsize=6, family="monospace")
        if axis is axis.axes.xaxis:
            axis.set_tick_params(rotation=90)
        return
    step = size * max(1, -(-seq_len // (size * _POSITION_TICKS)))
    axis.set_ticks(np.arange(0, seq_len, step))


def _label_compressed_axis(ax: Axes, rec: AttentionRecord) -> None:
    """Memory keys under one "mem" tick, then compression windows by index."""
    step = max(1, -(-rec.num_compressed // _POSITION_TICKS))
    # With thinned ticks, window 0 would crowd the "mem" tick next to it.
    windows = np.arange(step if rec.num_mem and step > 1 else 0, rec.num_compressed, step)
    ticks, labels = list(rec.num_mem + windows), [str(c) for c in windows]
    if rec.num_mem:
        ticks.insert(0, (rec.num_mem - 1) / 2)
        labels.insert(0, "mem")
    ax.set_xticks(ticks, labels)
    ax.set_xlabel("compressed key (memory, then window c)")


def _block_image_extent(rec: AttentionRecord) -> tuple[float, float, float, float]:
    # Block j spans x in [j, j + 1); query i is the row centred on y = i, earliest at the top.
    return (0.0, float(rec.num_blocks), rec.seq_len - 0.5, -0.5)


def _draw_block_map(ax: Axes, rec: AttentionRecord, title: str) -> None:
    """Limits, ticks and labels shared by the query × key block maps."""
    ax.set_xlim(0, rec.num_blocks)
    ax.set_ylim(rec.seq_len - 0.5, -0.5)
    _label_block_axis(ax, rec)
    _label_position_axis(ax.yaxis, rec)
    ax.set_ylabel("query position")
    ax.set_title(title, fontsize=10)


def _draw_sliding_window(ax: Axes, rec: AttentionRecord) -> None:
    """Outline the keys each query's sliding window covers, in block units."""
    positions = np.arange(rec.seq_len)
    window = rec.sliding_window_size
    first = np.maximum(positions - window, 0)
    last = positions if rec.causal else np.minimum(positions + window, rec.seq_len - 1)
    size = rec.selection_block_size
    color = BRANCH_COLORS["sliding"]
    ax.fill_betweenx(positions, first / size, (last + 1) / size, facecolor="none",
                     edgecolor=color, hatch="////", linewidth=0, alpha=0.45)
    ax.plot(first / size, positions, color=color, linewidth=1.2)
    ax.plot((last + 1) / size, positions, color=color, linewidth=1.2)


def _selected_segments(selected: np.ndarray) -> list[tuple[tuple[float, float], tuple[float, float]]]:
    """One vertical segment through the middle of each run of consecutive queries that
    selected the same block; ``selected: [n, nsb]`` bool."""
    segments = []
    for block, column in enumerate(selected.T):
        edges = np.flatnonzero(np.diff(np.concatenate(([0], column.astype(np.int8), [0]))))
        for start, stop in zip(edges[::2], edges[1::2]):
            segments.append(((block + 0.5, start - 0.5), (block + 0.5, stop - 0.5)))
    return segments


def _legend(fig: Figure, handles: list) -> None:
    """The figure's legend below its panels, in as many columns as its width holds."""
    columns = min(len(handles), max(1, int(fig.get_figwidth() / _LEGEND_ENTRY_INCHES)))
    fig.legend(handles=handles, loc="outside lower center", ncols=columns, fontsize=8, frameon=False)


def _masked_cmap(name: str):
    return colormaps[name].with_extremes(bad=UNAVAILABLE_COLOR)


# ---------------------------------------------------------------------------- plots


def plot_selection_map(source, x: torch.Tensor | None = None, *, head: int | None = None) -> Figure:
    """Which key blocks each query attends in the selection branch.

    Rows are query positions, columns key blocks: the top-n selected blocks, the query's own
    block (the block-causal diagonal, always attended in a causal layer), blocks that could
    have been chosen but were not, and blocks no query could see yet. The sliding window's
    span is hatched on top. One panel per GQA group when the group shares its selection,
    per query head otherwise; ``head`` (a query head) keeps only its panel.
    """
    rec = _as_record(source, x)
    panels = _selection_panels(rec, head)
    fig, axes = _panels(len(panels), aspect=1.15)
    for ax, (selection_head, title) in zip(axes, panels):
        ax.imshow(rec.selection_categories(selection_head), cmap=_SELECTION_CMAP, vmin=-0.5, vmax=3.5,
                  interpolation="nearest", aspect="auto", extent=_block_image_extent(rec))
        _draw_sliding_window(ax, rec)
        _draw_block_map(ax, rec, title)
    _label_outer(axes)
    handles = [
        Patch(facecolor=BRANCH_COLORS["selected"], label=f"selected (top {rec.selected_indices.shape[-1]})"),
        Patch(facecolor="#ffffff", edgecolor="#999999", label="candidate, not selected"),
        Patch(facecolor=UNAVAILABLE_COLOR, label="not selectable (no complete window yet)"),
        Patch(facecolor="none", edgecolor=BRANCH_COLORS["sliding"], hatch="////",
              label=f"sliding window ({rec.sliding_window_size} tokens)"),
    ]
    if rec.causal:
        handles.insert(1, Patch(facecolor=OWN_BLOCK_COLOR, label="own block (block-causal diagonal)"))
    _legend(fig, handles)
    fig.suptitle("NSA selection map: key blocks attended by each query")
    return fig


def plot_block_scores(
    source, x: torch.Tensor | None = None, *, head: int | None = None, relative: bool = True
) -> Figure:
    """The importance score of every key block for every query, from which the top-n
    selection is taken: the compressed-branch attention mass on the compressed blocks that
    overlap the key block (summed over the GQA group when it shares its selection).
    A red line runs through the blocks that were selected; grey cells could not be selected.

    With ``relative`` (the default) each query's scores are divided by its best one: the
    selection only compares blocks within a row, and the raw mass of a late query, spread
    over many blocks, would otherwise be too faint to read next to an early one's.
    """
    if not isinstance(relative, bool):
        raise TypeError(f"relative must be a bool, got {type(relative).__name__}")
    rec = _as_record(source, x)
    panels = _selection_panels(rec, head)
    fig, axes = _panels(len(panels), aspect=1.15)
    selectable = rec.selectable()
    scores = rec.block_scores.numpy()
    if relative:
        best = scores.max(axis=-1, keepdims=True)
        scores = np.divide(scores, best, out=np.zeros_like(scores), where=best > 0)
    vmax = max(float(scores.max()), 1e-6)
    image = None
    for ax, (selection_head, title) in zip(axes, panels):
        image = ax.imshow(np.ma.masked_where(~selectable, scores[selection_head]), cmap=_masked_cmap("viridis"),
                          vmin=0.0, vmax=vmax, interpolation="nearest", aspect="auto",
                          extent=_block_image_extent(rec))
        selected = rec.selection_categories(selection_head) == _SELECTED
        ax.add_collection(LineCollection(_selected_segments(selected), colors=_SELECTED_MARK_COLOR,
                                         linewidths=1.8, capstyle="butt"))
        _draw_block_map(ax, rec, title)
    _label_outer(axes)
    if relative:
        label = "importance / the query's best block"
    else:
        label = "importance, summed over the group" if rec.shared_selection and rec.group_size > 1 else "importance"
    fig.colorbar(image, ax=axes, shrink=0.8, label=label)
    handles = [
        Line2D([], [], color=_SELECTED_MARK_COLOR, linewidth=1.8, label="selected block"),
        Patch(facecolor=UNAVAILABLE_COLOR, label="not selectable"),
    ]
    _legend(fig, handles)
    fig.suptitle("NSA block importance: compressed attention mass per key block")
    return fig


def plot_gates(source, x: torch.Tensor | None = None, *, head: int | None = None) -> Figure:
    """The three sigmoid gates (compressed, selected, sliding) along the sequence, one panel
    per query head (or only ``head``)."""
    rec = _as_record(source, x)
    heads = _query_heads(rec, head)
    columns = min(len(heads), 2)
    rows = -(-len(heads) // columns)
    fig = Figure(figsize=(6.0 * columns + 0.5, 2.2 * rows + 1.2), layout="constrained")
    grid = fig.subplots(rows, columns, squeeze=False, sharex=True, sharey=True)
    for ax in grid.flat[len(heads):]:
        fig.delaxes(ax)
    axes = list(grid.flat[:len(heads)])
    positions = np.arange(rec.seq_len)
    for ax, h in zip(axes, heads):
        for gate, name in enumerate(GATE_NAMES):
            ax.plot(positions, rec.gates[gate, h].numpy(), color=BRANCH_COLORS[name], **_GATE_LINE_STYLES[name])
        ax.set_ylim(-0.03, 1.03)
        ax.set_xlim(-0.5, rec.seq_len - 0.5)
        _label_position_axis(ax.xaxis, rec)
        ax.grid(alpha=0.3)
        ax.set_title(f"head {h}", fontsize=10)
        ax.set_xlabel("query position")
        ax.set_ylabel("gate value")
    _label_outer(axes)
    handles = [Line2D([], [], color=BRANCH_COLORS[name], label=f"{name} branch", **_GATE_LINE_STYLES[name])
               for name in GATE_NAMES]
    _legend(fig, handles)
    fig.suptitle("NSA gates: how much each branch contributes to each query")
    return fig


def plot_compressed_attention(source, x: torch.Tensor | None = None, *, head: int | None = None) -> Figure:
    """The compressed branch's attention probabilities: query position × compressed key
    (the learned memory keys first, then one key per compression window), on a log colour
    scale. Grey cells are windows a causal query cannot see yet."""
    rec = _as_record(source, x)
    heads = _query_heads(rec, head)
    fig, axes = _panels(len(heads), aspect=1.15)
    num_keys = rec.num_mem + rec.num_compressed
    probs = rec.compressed_probs[heads].numpy()
    # Exact zeros are the causal mask; the scale starts at the decade of the smallest
    # probability shown, within _PROB_DECADES of 1.
    smallest = probs[probs > 0].min(initial=1.0)
    norm = LogNorm(vmin=10.0 ** max(np.floor(np.log10(smallest)), -_PROB_DECADES), vmax=1.0)
    image = None
    for ax, h, head_probs in zip(axes, heads, probs):
        shown = np.ma.masked_equal(head_probs, 0.0).clip(norm.vmin, 1.0)
        image = ax.imshow(shown, cmap=_masked_cmap("magma"), norm=norm, interpolation="nearest",
                          aspect="auto", extent=(-0.5, num_keys - 0.5, rec.seq_len - 0.5, -0.5))
        if rec.num_mem:
            ax.axvline(rec.num_mem - 0.5, color=_MEMORY_EDGE_COLOR, linewidth=1.0)
        _label_compressed_axis(ax, rec)
        _label_position_axis(ax.yaxis, rec)
        ax.set_ylabel("query position")
        ax.set_title(f"head {h}", fontsize=10)
    _label_outer(axes)
    colorbar = fig.colorbar(image, ax=axes, shrink=0.8, label="attention probability (log scale)")
    # Plain decimals ("0.3", "0.01") read faster than powers of ten on a probability scale;
    # the ticks between the decades are labelled only when the scale spans a single decade.
    decimal = FuncFormatter(lambda value, _: f"{value:g}")
    colorbar.ax.yaxis.set_major_formatter(decimal)
    colorbar.ax.yaxis.set_minor_formatter(decimal if norm.vmin >= 0.1 else NullFormatter())
    handles = [Patch(facecolor=UNAVAILABLE_COLOR, label="not visible (window not complete before the query)")]
    if rec.num_mem:
        handles.append(Line2D([], [], color=_MEMORY_EDGE_COLOR, label=f"end of the memory keys ({rec.num_mem})"))
    _legend(fig, handles)
    fig.suptitle(f"NSA compressed attention: window c covers tokens "
                 f"[{rec.compress_stride}c, {rec.compress_stride}c + {rec.compress_block_size})")
    return fig


# ---------------------------------------------------------------------------------------- CLI


PLOTS: dict[str, Callable[..., Figure]] = {
    "selection_map": plot_selection_map,
    "block_scores": plot_block_scores,
    "gates": plot_gates,
    "compressed_attention": plot_compressed_attention,
}


def _parse_args(argv: Sequence[str] | None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    parser = checkpoint_parser(
        "viz", "Run a text through a train.py checkpoint and write PNG figures of one NSA layer: "
        + ", ".join(f"{name}.png" for name in PLOTS) + ".",
    )
    parser.add_argument("--text", required=True, help="text to run through the model (UTF-8 bytes are the tokens)")
    parser.add_argument("--out", required=True, type=Path, help="directory for the PNG files (created if missing)")
    parser.add_argument("--layer", type=int, default=0, help="index of the attention layer to plot (default: 0)")
    parser.add_argument("--head", type=int, default=None,
                        help="query head to plot (default: all heads; selection plots show its GQA group)")
    parser.add_argument("--dpi", type=int, default=120, help="resolution of the PNG files (default: 120)")
    return parser, parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    parser, args = _parse_args(argv)
    import matplotlib

    # Files only: never let a configured interactive backend look for a display.
    matplotlib.use("Agg")

    fail = partial(exit_with_error, parser)

    if not args.text:
        fail("--text must not be empty")
    if args.dpi < 20:
        fail(f"--dpi must be at least 20, got {args.dpi}")
    try:
        model = load_checkpoint(args.checkpoint)
    except ValueError as error:
        fail(str(error))
    layers = sparse_attention_layers(model)
    if not layers:
        fail(f"{args.checkpoint} holds a full-attention model; there is no sparse attention to plot")
    if not 0 <= args.layer < len(layers):
        fail(f"--layer must be in [0, {len(layers)}) for this model, got {args.layer}")
    heads = layers[args.layer].heads
    if args.head is not None and not 0 <= args.head < heads:
        fail(f"--head must be in [0, {heads}) for this model, got {args.head}")
    ids = encode_text(args.text)
    num_tokens = model.config["num_tokens"]
    if int(ids.max()) >= num_tokens:
        fail(f"--text holds byte {int(ids.max())}, outside this model's {num_tokens}-token vocabulary")

    rec = record_forward(model, ids[None], layer=args.layer, tokens=byte_labels(ids))
    args.out.mkdir(parents=True, exist_ok=True)
    for name, plot in PLOTS.items():
        path = args.out / f"{name}.png"
        plot(rec, head=args.head).savefig(path, dpi=args.dpi)
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
