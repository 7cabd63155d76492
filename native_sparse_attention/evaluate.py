"""Bits per byte of a ``train.py`` checkpoint over a whole split of a corpus.

Command line (a checkpoint, or the latest one of a run directory)::

    python -m native_sparse_attention.evaluate --checkpoint runs/enwik8-sparse --split test

``train.py`` validates on a fixed sample of windows; this scores every byte of the split
once: windows of ``seq_len`` bytes start every ``stride`` bytes, and each scores only the
bytes the window before it did not (the first scores all of its own), so that every byte
after the first window is scored with at least ``seq_len - stride`` bytes of context. For enwik8 the test split is the customary held-out
``[95M, 100M)``. The corpus, the window length and the batch size default to the run's
training settings, saved in its checkpoints.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from functools import partial
from typing import Sequence

import torch
import torch.nn.functional as F

from native_sparse_attention.checkpoint import model_from_checkpoint, read_checkpoint
from native_sparse_attention.cli import add_device_argument, checkpoint_parser, exit_with_error, resolve_device
from native_sparse_attention.data import SPLITS, DataError, corpus_split, load_corpus
from native_sparse_attention.transformer import Transformer, autocast

__all__ = ["Score", "score_bytes", "scoring_windows", "main"]

@dataclass(frozen=True)
class Score:
    """nats: mean loss per scored byte; bits_per_byte = nats / ln 2; scored_bytes: every
    byte of the text but its first, which has no context; window, stride: the windows'
    length (seq_len, or the text's length - 1 when shorter) and the distance between
    their starts."""

    nats: float
    bits_per_byte: float
    scored_bytes: int
    window: int
    stride: int


def scoring_windows(num_bytes: int, seq_len: int, stride: int) -> Iterator[tuple[int, int]]:
    """``(start, first)`` for each window of a text of ``num_bytes`` bytes: the window reads
    bytes ``[start, start + L)`` (L = the shorter of seq_len and num_bytes - 1) and predicts
    each next byte, ``[start + 1, start + L]``, of which it scores ``[start + first + 1,
    start + L]``. Every byte but the first is scored exactly once; after the first window,
    each with at least ``L - stride`` bytes of context."""
    if num_bytes < 2:
        raise ValueError(f"num_bytes must be at least 2, got {num_bytes}")
    if not 1 <= stride <= seq_len:
        raise ValueError(f"stride must be in [1, seq_len = {seq_len}], got {stride}: a longer one leaves bytes "
                         "unscored")
    length = min(seq_len, num_bytes - 1)
    last_start = num_bytes - 1 - length
    start, scored_up_to = 0, 0  # bytes [1, scored_up_to] are scored
    while scored_up_to < num_bytes - 1:
        yield start, scored_up_to - start
        scored_up_to = start + length
        start = min(start + stride, last_start)


def score_bytes(model: Transformer, text: torch.Tensor, seq_len: int, stride: int, batch_size: int = 16,
                progress: bool = False) -> Score:
    """text: [n] uint8 -> the model's loss on each byte of ``text`` after the first, each
    predicted in the window of ``scoring_windows`` that scores it; batches of ``batch_size``
    windows on the model's device (bf16 autocast on CUDA). ``progress``: a progress bar on
    stderr, where it is a terminal."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    windows = list(scoring_windows(text.numel(), seq_len, stride))
    device = next(model.parameters()).device
    length = min(seq_len, text.numel() - 1)
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    scored_sum = torch.zeros((), dtype=torch.long, device=device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), autocast(device), _progress(len(windows), progress) as bar:
            for batch in range(0, len(windows), batch_size):
                starts, firsts = (torch.tensor(column) for column in zip(*windows[batch:batch + batch_size]))
                ids = text[starts[:, None] + torch.arange(length + 1)].long().to(device)
                logits = model(ids[:, :-1]).float()
                losses = F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
                scored = torch.arange(length, device=device) >= firsts.to(device)[:, None]
                loss_sum += (losses * scored).sum(dtype=torch.float64)
                scored_sum += scored.sum()
                bar.update(len(starts))
    finally:
        model.train(was_training)
    assert scored_sum.item() == text.numel() - 1, "the windows must score every byte but the first once"
    nats = loss_sum.item() / (text.numel() - 1)
    return Score(nats=nats, bits_per_byte=nats / math.log(2), scored_bytes=text.numel() - 1, window=length,
                 stride=stride)


def _progress(total: int, enabled: bool):
    from tqdm.auto import tqdm

    # disable=None: tqdm's own test, off where stderr is not a terminal (logs, pipes).
    return tqdm(total=total, disable=None if enabled else True, unit="window", dynamic_ncols=True, file=sys.stderr)


def _parse_args(argv: Sequence[str] | None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    parser = checkpoint_parser(
        "evaluate", "Score every byte of a corpus split with a train.py checkpoint and print its bits per byte."
    )
    parser.add_argument("--split", choices=SPLITS, default="test", help="part of the corpus to score: train "
                        "[0, 90%%), validation [90%%, 95%%) or test [95%%, 100%%) (default: test)")
    parser.add_argument("--data", default=None, help="enwik8, stdlib or a path to a file of bytes (default: the "
                        "corpus the run trained on, or enwik8 when it is available and stdlib when not)")
    parser.add_argument("--data-dir", default=None, help="folder that keeps enwik8.gz (default: the run's, else "
                        "data)")
    parser.add_argument("--seq-len", type=int, default=None, help="bytes per window (default: the run's)")
    parser.add_argument("--stride", type=int, default=None,
                        help="bytes between window starts; every byte is scored with at least SEQ_LEN - STRIDE "
                        "bytes of context (default: half the window)")
    parser.add_argument("--batch-size", type=int, default=None, help="windows per forward pass (default: the run's)")
    parser.add_argument("--max-bytes", type=int, default=None, help="score only the split's first MAX_BYTES bytes")
    add_device_argument(parser, "run the model")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")
    return parser, parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    parser, args = _parse_args(argv)
    fail = partial(exit_with_error, parser)
    for name in ("seq_len", "stride", "batch_size", "max_bytes"):
        value = getattr(args, name)
        if value is not None and value < 1:
            fail(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    device = resolve_device(parser, args.device)
    try:
        path, checkpoint = read_checkpoint(args.checkpoint)
        model = model_from_checkpoint(path, checkpoint)
    except ValueError as error:
        fail(str(error))
    settings = checkpoint.get("train_config")
    settings = settings if isinstance(settings, dict) else {}
    if not model.causal:
        fail(f"{args.checkpoint} holds a non-causal model, which does not predict the next byte")
    seq_len = args.seq_len or settings.get("seq_len")
    if seq_len is None:
        fail(f"{args.checkpoint} does not record its training settings: give --seq-len")
    stride = args.stride or max(1, seq_len // 2)
    if stride > seq_len:
        fail(f"--stride ({stride}) must not exceed the window ({seq_len}), or bytes between windows would go unscored")
    batch_size = args.batch_size or settings.get("batch_size") or 16

    try:
        corpus = load_corpus(args.data or settings.get("data"), args.data_dir or settings.get("data_dir", "data"),
                             announce=lambda line: print(line, file=sys.stderr))
    except DataError as error:
        fail(str(error))
    text = corpus_split(corpus.data, args.split)[:args.max_bytes]
    if text.numel() < 2:
        fail(f"the {args.split} split of {corpus.name} holds {text.numel()} bytes; scoring needs at least 2")
    num_tokens = model.config["num_tokens"]
    if int(text.max()) >= num_tokens:
        fail(f"{corpus.name} holds byte {int(text.max())}, outside this model's {num_tokens}-token vocabulary")

    score = score_bytes(model.to(device), text, seq_len, stride, batch_size, progress=not args.json)
    if args.json:
        print(json.dumps({"checkpoint": str(args.checkpoint), "corpus": corpus.name, "split": args.split,
                          **asdict(score)}))
    else:
        print(f"{args.checkpoint}: {score.bits_per_byte:.4f} bits per byte ({score.nats:.4f} nats) on the "
              f"{args.split} split of {corpus.name}, {score.scored_bytes:,} bytes scored in windows of "
              f"{score.window} starting every {score.stride}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
