"""Loss curves of training runs: train and validation bits per byte against step.

A run directory holds ``config.json`` and ``metrics.jsonl`` (one JSON object per logged
step). ``plot_run`` draws a run together with its comparable siblings, the runs side by
side in the same parent directory on the same corpus with the same model size (sparse
against full attention, typically)::

    python -m native_sparse_attention.plotting runs/enwik8-sparse runs/enwik8-full -o curves.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from native_sparse_attention.checkpoint import atomic_write

__all__ = ["comparable_runs", "plot_run", "plot_runs", "read_config", "read_metrics"]

LOSS_CURVE = "loss_curve.png"
# Runs are overlaid only when these agree: same bytes, same model size.
_COMPARABLE_KEYS = ("corpus", "dim", "depth", "seq_len")


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The records of ``run_dir/metrics.jsonl``; a partly written last line is skipped."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def read_config(run_dir: Path) -> dict:
    """config.json's training settings merged with its ``run`` section (what was resolved
    at start: corpus, attention backend, ...)."""
    try:
        config = json.loads((run_dir / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return {**config, **config.get("run", {})}


def comparable_runs(run_dir: str | Path) -> list[Path]:
    """``run_dir`` first, then its siblings with metrics whose config matches it on
    corpus, width, depth and sequence length."""
    run_dir = Path(run_dir)
    config = read_config(run_dir)
    key = [config.get(name) for name in _COMPARABLE_KEYS]
    siblings = [
        path for path in sorted(run_dir.parent.iterdir())
        if path.is_dir() and path.resolve() != run_dir.resolve() and (path / "metrics.jsonl").exists()
        and [read_config(path).get(name) for name in _COMPARABLE_KEYS] == key
    ]
    return [run_dir, *siblings]


def _label(run_dir: Path) -> str:
    config = read_config(run_dir)
    attention = config.get("attn")
    if attention == "sparse" and config.get("attention_backend"):
        attention = f"sparse, {config['attention_backend']}"
    return f"{run_dir.name} ({attention})" if attention else run_dir.name


def plot_runs(run_dirs: list[str | Path], output: str | Path) -> Path:
    """One figure: train bits per byte (line) and validation bits per byte (markers)
    against step for each run, one colour per run. Written atomically to ``output``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 5), layout="constrained")
    for index, run_dir in enumerate(map(Path, run_dirs)):
        records = read_metrics(run_dir)
        color = f"C{index}"
        label = _label(run_dir)
        train = [(r["step"], r["bpb"]) for r in records if "bpb" in r]
        validation = [(r["step"], r["val_bpb"]) for r in records if "val_bpb" in r]
        if train:
            axes.plot(*zip(*train), color=color, alpha=0.5, linewidth=1, label=f"{label} train")
        if validation:
            axes.plot(*zip(*validation), color=color, marker="o", markersize=4, label=f"{label} validation")
    axes.set_xlabel("step")
    axes.set_ylabel("bits per byte")
    axes.grid(alpha=0.3)
    if axes.get_legend_handles_labels()[0]:
        axes.legend()
    try:
        with atomic_write(output) as temporary:
            figure.savefig(temporary, format="png", dpi=120)
    finally:
        plt.close(figure)
    return Path(output)


def plot_run(run_dir: str | Path) -> Path:
    """``run_dir/loss_curve.png`` for the run and its comparable siblings."""
    return plot_runs(comparable_runs(run_dir), Path(run_dir) / LOSS_CURVE)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Overlay the loss curves of train.py runs in one PNG.")
    parser.add_argument("run_dirs", nargs="+", type=Path, help="run directories (with metrics.jsonl)")
    parser.add_argument("-o", "--output", type=Path, default=Path(LOSS_CURVE), help="PNG to write")
    args = parser.parse_args(argv)
    missing = [str(path) for path in args.run_dirs if not (path / "metrics.jsonl").exists()]
    if missing:
        parser.error(f"no metrics.jsonl in {', '.join(missing)}")
    print(plot_runs(args.run_dirs, args.output))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
