"""What the command lines that read ``train.py`` checkpoints share (``viz``, ``generate``,
``evaluate``): the ``--checkpoint`` and ``--device`` arguments, and errors reported in one
line on stderr with exit code 2, as argparse reports its own."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import NoReturn

import torch


def checkpoint_parser(module: str, description: str) -> argparse.ArgumentParser:
    """A parser for ``python -m native_sparse_attention.<module>`` that takes ``--checkpoint``."""
    parser = argparse.ArgumentParser(prog=f"python -m native_sparse_attention.{module}", description=description)
    parser.add_argument("--checkpoint", required=True, type=Path,
                        help="checkpoint written by train.py (.pt), or a run directory (its latest checkpoint)")
    return parser


def add_device_argument(parser: argparse.ArgumentParser, purpose: str) -> None:
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None,
                        help=f"where to {purpose} (default: cuda when available)")


def exit_with_error(parser: argparse.ArgumentParser, message: str) -> NoReturn:
    parser.exit(2, f"{parser.prog}: error: {message}\n")


def resolve_device(parser: argparse.ArgumentParser, name: str | None) -> torch.device:
    """The ``--device`` asked for, or CUDA when available; fails when CUDA is asked for and missing."""
    if name == "cuda" and not torch.cuda.is_available():
        exit_with_error(parser, "--device cuda, but CUDA is not available")
    return torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))
