"""Training checkpoints: ``<run_dir>/checkpoints/step-XXXXXXXX.pt``.

Each file holds a dict with at least

- ``"model"``: the model's ``state_dict``;
- ``"model_config"``: ``Transformer.config``, so ``Transformer(**model_config)`` rebuilds it;
- ``"step"``: the number of optimizer steps taken;

and, for resuming, the optimizer, sampler and RNG states and the run's settings
(``"train_config"``). Files are written to a temporary name and renamed into place, so a
crash never leaves a truncated checkpoint, and only the newest ``keep`` are kept.
Everything is loadable with ``torch.load(..., weights_only=True)``; ``load_model``
rebuilds the model of a checkpoint file or of a run's latest one.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from native_sparse_attention.transformer import Transformer

__all__ = [
    "atomic_write",
    "checkpoint_path",
    "checkpoint_step",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "load_model",
    "model_from_checkpoint",
    "read_checkpoint",
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


def read_checkpoint(path: str | Path) -> tuple[Path, dict]:
    """The checkpoint file that ``path`` names and its content: ``path`` is a checkpoint
    file (a dict with ``"model"``, the state dict, and ``"model_config"``, the
    ``Transformer`` arguments) or a run directory, whose latest ``checkpoints/step-*.pt`` is
    read. Every failure raises a one-line ``ValueError``."""
    path = _checkpoint_file(Path(path))
    try:
        checkpoint = load_checkpoint(path)
    except Exception as error:  # torch raises several types for foreign or corrupt files
        raise ValueError(
            f"could not read checkpoint {path}: not a torch.save file of tensors and plain Python values "
            f"({_summary(error)})"
        ) from error
    if not isinstance(checkpoint, dict) or not {"model", "model_config"} <= checkpoint.keys():
        raise ValueError(f"{path} is not a train.py checkpoint: expected a dict with 'model' and 'model_config'")
    return path, checkpoint


def model_from_checkpoint(path: Path, checkpoint: dict) -> Transformer:
    """The ``Transformer`` of a checkpoint that ``read_checkpoint`` returned, on CPU in
    eval mode; a one-line ``ValueError`` when this version cannot build it."""
    # Imported here: the data and training utilities that write and read checkpoints stay
    # free of the model.
    from native_sparse_attention.transformer import Transformer

    try:
        model = Transformer(**checkpoint["model_config"])
        model.load_state_dict(checkpoint["model"])
    except (TypeError, ValueError, RuntimeError) as error:
        raise ValueError(f"{path} does not hold a Transformer this version can build ({_summary(error)})") from error
    return model.eval()


def load_model(path: str | Path) -> Transformer:
    """The ``Transformer`` saved by ``train.py`` (a checkpoint file, or a run directory's
    latest checkpoint), on CPU in eval mode; failures raise one-line ``ValueError``s."""
    return model_from_checkpoint(*read_checkpoint(path))


def _checkpoint_file(path: Path) -> Path:
    """``path`` itself, or the latest checkpoint of a run directory (or of its
    ``checkpoints/`` folder)."""
    if path.is_file():
        return path
    if not path.is_dir():
        raise ValueError(f"checkpoint {path} does not exist")
    run_dir = path.parent if path.name == "checkpoints" else path
    latest = latest_checkpoint(run_dir)
    if latest is None:
        raise ValueError(f"{path} holds no checkpoint: expected {checkpoint_path(run_dir, 0).with_name('step-*.pt')}")
    return latest


def _summary(error: Exception) -> str:
    """One line about ``error``: torch's messages run over many lines, and the one that names
    the offending object (weights-only loading) is not the first."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    named = [line.split(". Please")[0] for line in lines if "Unsupported global" in line]
    return f"{type(error).__name__}: {(named or lines or ['no message'])[0]}"
