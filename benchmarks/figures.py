"""Figures of the benchmark scripts (matplotlib, which the package's ``viz`` and ``test``
extras install), drawn from the numbers the scripts also write to docs/benchmarks.md.

``layer_figure``: the layer benchmark's speed-up over the dense layer and peak-memory
ratio against sequence length, with the targets, and where each layer's kernel time goes
at the profiled lengths.
``paired_figure``: the layer benchmark's paired rounds, each round's speed-up per launch
mode at each paired length, with the target there.
``selection_figure``: the selection kernel's forward + backward time against sequence
length beside dense attention's and the PyTorch reference's, over the gather floor.
``decode_figure``: the decoding benchmark's time per step against the cached tokens, as
the GPU spends it (replayed steps) and as generation sees it (eager and replayed).
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["configs_figure", "decode_figure", "layer_figure", "paired_figure", "selection_figure"]


def _matplotlib():
    """pyplot on the non-interactive backend: figures are only written to files."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _length_label(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def _short_group(group: str) -> str:
    """A kernel group without the source file it names: ``matmuls (projections, ...)``
    stays whole, ``compressed ... (kernels/compressed.py)`` loses its file."""
    return group.split(" (kernels/")[0]


def _length_axis(axes, lengths: list[int]) -> None:
    axes.set_xscale("log", base=2)
    axes.set_xticks(lengths, [_length_label(n) for n in lengths])
    axes.minorticks_off()
    axes.set_xlabel("sequence length n")
    axes.grid(alpha=0.3)


def _speedup_panel(axes, speedups: dict[str, dict[int, float | None]], faster_from: int,
                   speedup_target: tuple[int, float]) -> None:
    lengths = sorted({n for values in speedups.values() for n in values})
    for index, (mode, values) in enumerate(speedups.items()):
        points = [(n, values[n]) for n in sorted(values) if values[n] is not None]
        if points:
            axes.plot(*zip(*points), marker="o", color=f"C{index}", label=mode)
    target_n, target_speedup = speedup_target
    covered = [n for n in lengths if n >= faster_from]
    if covered:
        axes.hlines(1.0, covered[0], covered[-1], colors="0.3", linestyles="--",
                    label=f"target: faster than dense from {_length_label(faster_from)}")
    axes.plot([target_n], [target_speedup], marker="*", markersize=14, linestyle="none", color="crimson",
              label=f"target: {target_speedup:g}x at {_length_label(target_n)}")
    _length_axis(axes, lengths)
    axes.set_ylim(0, 1.1 * max([target_speedup] + [v for values in speedups.values() for v in values.values()
                                                   if v is not None]))
    axes.set_ylabel("fwd+bwd speed-up over dense (x)")
    axes.set_title("NSA layer against the dense layer")
    axes.legend(fontsize=8)


def _memory_panel(axes, peak_ratios: dict[int, float | None], memory_limit: float) -> None:
    points = [(n, ratio) for n, ratio in sorted(peak_ratios.items()) if ratio is not None]
    if points:
        axes.plot(*zip(*points), marker="o", color="C0", label="NSA peak / dense peak")
    axes.axhline(memory_limit, color="crimson", linestyle="--", label=f"limit: {memory_limit:g}x")
    _length_axis(axes, sorted(peak_ratios))
    axes.set_ylim(0, 1.15 * max([memory_limit] + [ratio for _, ratio in points]))
    axes.set_ylabel("peak memory ratio (x)")
    axes.set_title("Peak memory of a forward + backward")
    axes.legend(fontsize=8)


def _breakdown_panel(axes, n: int, layers: dict[str, dict[str, float]], colors: dict[str, str]) -> None:
    """Stacked horizontal bars: one per layer, one segment per kernel group."""
    names = list(layers)
    for y, name in zip(reversed(range(len(names))), names):  # the first layer on top
        left = 0.0
        for group, color in colors.items():
            ms = layers[name].get(group, 0.0)
            if ms > 0:
                axes.barh(y, ms, left=left, color=color, edgecolor="white", linewidth=0.5)
                left += ms
        axes.text(left, y, f" {left:.2f} ms", va="center", fontsize=8)
    axes.set_yticks(range(len(names)), names[::-1])
    axes.set_xlim(0, 1.2 * max(sum(groups.values()) for groups in layers.values()))
    axes.set_xlabel("CUDA kernel time per compiled fwd+bwd (ms)")
    axes.set_title(f"Where the time goes, n = {_length_label(n)}")
    axes.grid(axis="x", alpha=0.3)


def layer_figure(speedups: dict[str, dict[int, float | None]], peak_ratios: dict[int, float | None],
                 breakdown: dict[int, dict[str, dict[str, float]]], *, faster_from: int = 8192,
                 speedup_target: tuple[int, float] = (65536, 4.0), memory_limit: float = 2.0) -> Figure:
    """The layer benchmark in one figure.

    speedups: launch mode -> {n: dense fwd+bwd time / NSA fwd+bwd time, None where
    unmeasured}; peak_ratios: {n: NSA peak memory / dense peak memory}; breakdown:
    profiled n -> layer name -> {kernel group: ms per step} (may be empty). The targets:
    faster than dense from ``faster_from`` on, ``speedup_target = (n, speed-up)``, peak
    memory at most ``memory_limit`` times dense.

    Top row: speed-up and memory ratio against n. Bottom row, one panel per profiled
    length: each layer's kernel time as a bar stacked by group, in the same colours
    across panels, the largest group first.
    """
    plt = _matplotlib()
    profiled = sorted(breakdown)
    columns = max(2, len(profiled))
    rows = 2 if profiled else 1
    figure = plt.figure(figsize=(6 * columns, 4.5 * rows + (1.0 if profiled else 0.0)), layout="constrained")
    grid = figure.add_gridspec(rows, 2 * columns)  # each top panel spans half the width
    _speedup_panel(figure.add_subplot(grid[0, :columns]), speedups, faster_from, speedup_target)
    _memory_panel(figure.add_subplot(grid[0, columns:]), peak_ratios, memory_limit)
    if profiled:
        totals = Counter()
        for layers in breakdown.values():
            for groups in layers.values():
                totals.update(groups)
        order = [group for group, _ in totals.most_common()]
        colors = {group: plt.get_cmap("tab10")(index % 10) for index, group in enumerate(order)}
        width = 2 * columns // len(profiled)
        for index, n in enumerate(profiled):
            _breakdown_panel(figure.add_subplot(grid[1, index * width:(index + 1) * width]), n, breakdown[n], colors)
        handles = [plt.Rectangle((0, 0), 1, 1, color=colors[group]) for group in order]
        figure.legend(handles, [_short_group(group) for group in order], loc="outside lower center",
                      ncols=min(3, len(order)), fontsize=8)
    return figure


def paired_figure(rounds: dict[int, dict[str, list[tuple[float, float]]]], targets: dict[int, float]) -> Figure:
    """The layer benchmark's paired rounds: ``rounds[n][mode]`` lists (dense ms, NSA ms)
    per round; one panel per n, each round's speed-up (dense / NSA) per mode, in order,
    and a line at ``targets[n]`` (the speed-up the target asks for) where there is one."""
    plt = _matplotlib()
    lengths = sorted(rounds)
    figure, panels = plt.subplots(1, len(lengths), figsize=(6 * len(lengths), 4.2), layout="constrained",
                                  squeeze=False)
    for axes, n in zip(panels[0], lengths):
        for index, (mode, pairs) in enumerate(rounds[n].items()):
            speedups = [dense / nsa for dense, nsa in pairs]
            axes.plot(range(1, len(speedups) + 1), speedups, marker="o", color=f"C{index + 1}", label=mode)
        if n in targets:
            axes.axhline(targets[n], color="crimson", linestyle="--", label=f"target: {targets[n]:g}x")
        axes.set_title(f"NSA against dense, alternating rounds, n = {_length_label(n)}")
        axes.set_xlabel("round")
        axes.set_ylabel("fwd+bwd speed-up over dense (x)")
        axes.grid(alpha=0.3)
        axes.legend(fontsize=8)
    return figure


def configs_figure(speedups: dict[str, dict[int, float | None]]) -> Figure:
    """The layer at several head configurations: ``speedups[config][n]``, the dense
    layer's replayed forward + backward time over the NSA layer's (None where not
    measured), one line per config against n, and the line where the two are level."""
    plt = _matplotlib()
    figure, axes = plt.subplots(figsize=(7.5, 4.5), layout="constrained")
    lengths = sorted({n for values in speedups.values() for n in values})
    for index, (config, values) in enumerate(speedups.items()):
        points = [(n, values[n]) for n in sorted(values) if values[n] is not None]
        if points:
            axes.plot(*zip(*points), marker="o", color=f"C{index}", label=config)
    axes.axhline(1.0, color="0.3", linestyle="--", label="level with dense")
    _length_axis(axes, lengths)
    axes.set_ylim(bottom=0)
    axes.set_ylabel("fwd+bwd speed-up over dense (x), CUDA graph")
    axes.set_title("NSA layer against the dense layer by head configuration")
    axes.legend(fontsize=8)
    return figure


# The selection benchmark's timings, as its rows name them: (label, key, index of the
# fwd+bwd time in the row's (fwd, fwd+bwd) pair, None where the value is that time).
_SELECTION_SERIES = (
    ("NSA selection kernel", "fwd_bwd", None),
    ("SDPA flash (dense causal)", "flash", 1),
    ("SDPA cuDNN (dense causal)", "cudnn", 1),
    ("PyTorch reference", "reference", 1),
)


def selection_figure(rows: list[dict], configs: dict[str, str]) -> Figure:
    """One panel per config: forward + backward ms against n on log-log axes.

    rows: the selection benchmark's measurements, each with ``config``, ``n``,
    ``fwd_bwd`` (NSA), ``flash`` / ``cudnn`` / ``reference`` ((fwd, fwd+bwd) or None
    where not run) and ``gather`` (the forward's K/V gather floor, ms); configs: config
    name -> its description for the panel's title. The dotted line is twice the gather
    floor, what the forward and the dQ pass need just to read their keys and values.
    """
    plt = _matplotlib()
    names = [name for name in configs if any(row["config"] == name for row in rows)]
    figure, axes_row = plt.subplots(1, len(names), figsize=(6 * len(names), 4.5), layout="constrained",
                                    squeeze=False)
    for axes, name in zip(axes_row[0], names):
        config_rows = sorted((row for row in rows if row["config"] == name), key=lambda row: row["n"])
        lengths = [row["n"] for row in config_rows]
        for index, (label, key, position) in enumerate(_SELECTION_SERIES):
            points = []
            for row in config_rows:
                value = row.get(key)
                value = value if position is None or value is None else value[position]
                if value is not None:
                    points.append((row["n"], value))
            if points:
                axes.plot(*zip(*points), marker="o", color=f"C{index}", label=label)
        axes.plot(lengths, [2 * row["gather"] for row in config_rows], ":", color="0.3",
                  label="2 x K/V gather floor (query-side passes)")
        _length_axis(axes, lengths)
        axes.set_yscale("log")
        axes.set_ylabel("forward + backward (ms)")
        axes.set_title(f"{name}: {configs[name]}")
        axes.legend(fontsize=8)
    return figure


def decode_figure(gpu_ms: dict[str, dict[int, float]], wall_ms: dict[str, dict[int, float]], unit: str) -> Figure:
    """The decoding benchmark: ``gpu_ms[label][n]``, the kernel time of one replayed step
    after n cached tokens, and ``wall_ms[label][n]``, the wall time per step of steps run
    back to back (log scale: eager steps take tens of times longer), one line per launch
    mode and layer; ``unit``: what a step decodes ("token", or "step" for a batch)."""
    plt = _matplotlib()
    figure, (gpu_axes, wall_axes) = plt.subplots(1, 2, figsize=(12, 4.5), layout="constrained")
    colors = {label: f"C{index}" for index, label in enumerate(dict.fromkeys([*wall_ms, *gpu_ms]))}
    for axes, series, title in ((gpu_axes, gpu_ms, "GPU time of a replayed step"),
                                (wall_axes, wall_ms, "wall time, steps back to back")):
        lengths = sorted({n for values in series.values() for n in values})
        for label, values in series.items():
            linestyle = "--" if label.startswith("dense") else "-"
            axes.plot(sorted(values), [values[n] for n in sorted(values)], marker="o", linestyle=linestyle,
                      color=colors[label], label=label)
        _length_axis(axes, lengths)
        axes.set_xlabel("cached tokens")
        axes.set_ylabel(f"ms / {unit}")
        axes.set_title(title)
        axes.legend(fontsize=8)
    gpu_axes.set_ylim(bottom=0)
    wall_axes.set_yscale("log")
    return figure
