"""Training checkpoints: ``<run_dir>/checkpoints/step-XXXXXXXX.pt``.

Each file holds a dict with at least

- ``"model"``: the model's ``state_dict``;
- ``"model_config"``: ``Transformer.config``, so ``Transformer(**model_config)`` rebuilds it;
- ``"step"``: the number of optimizer steps taken;

and, for resuming, the optimizer, sampler and RNG states. Files are written to a temporary
name and renamed into place, so a crash never leaves a truncated checkpoint, and only the
newest ``keep`` are kept. Everything is loadable with ``torch.load(..., weights_only=True)``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

__all__ = [
    "atomic_write",
    "checkpoint_path",
    "checkpoint_step",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "save_checkpoint",
]

_NAME = re.compile(r"step-(\d{8})\.pt")


def checkpoint_path(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step-{step:08d}.pt"


def checkpoint_step(path: str | Path) -> int:
    """The step in a checkpoint's file name."""
    match = _NAME.fullmatch(Path(path).name)
    if match is None:
        raise ValueError(f"{path} is not named like a checkpoint (step-XXXXXXXX.pt)")
    return int(match.group(1))


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """The checkpoints of a run, oldest first."""
    folder = Path(run_dir) / "checkpoints"
    if not folder.is_dir():
        return []
    found = [path for path in folder.iterdir() if _NAME.fullmatch(path.name)]
    return sorted(found, key=checkpoint_step)


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    checkpoints = list_checkpoints(run_dir)
    return checkpoints[-1] if checkpoints else None


@contextmanager
def atomic_write(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside ``path`` to write; on success it replaces ``path`` in
    one rename (readers see the old file or the new one, never a partial one), on failure
    it is removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        yield temporary
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def save_checkpoint(run_dir: str | Path, state: dict, keep: int) -> Path:
    """Write ``state`` (with its ``"step"``) atomically, then delete all but the newest
    ``keep`` checkpoints of the run. Returns the new file's path."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    path = checkpoint_path(run_dir, state["step"])
    with atomic_write(path) as temporary, temporary.open("wb") as file:
        torch.save(state, file)
        file.flush()
        os.fsync(file.fileno())
    for old in list_checkpoints(run_dir)[:-keep]:
        old.unlink(missing_ok=True)
    return path


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict:
    return torch.load(path, map_location=map_location, weights_only=True)
