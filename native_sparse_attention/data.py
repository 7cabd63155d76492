"""Byte corpora for language-model training: enwik8, any file of bytes, and an offline
fallback; the train/validation split and the random-window sampler.

enwik8 is the first 100M bytes of an English Wikipedia dump (the Hutter Prize file). It is
kept as ``data/enwik8.gz``; when missing it is downloaded from the prize's archive, checked
against its published MD5 and size, and converted. Customarily bytes ``[0, 90M)`` train,
``[90M, 95M)`` validate and ``[95M, 100M)`` are held out for testing; other corpora are
split in the same proportions.

Where enwik8 cannot be had (no network), training falls back to the source text of the
Python standard library, which every machine that runs this code has.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import sysconfig
import zipfile
from dataclasses import dataclass
from pathlib import Path
from urllib.error import HTTPError, URLError
from urllib.request import urlopen

import torch

from native_sparse_attention.checkpoint import atomic_write

__all__ = [
    "Corpus",
    "DataError",
    "DownloadError",
    "ENWIK8_MD5",
    "ENWIK8_SIZE",
    "ENWIK8_URL",
    "RandomOffsetSampler",
    "SPLITS",
    "corpus_split",
    "download_enwik8",
    "load_corpus",
    "read_bytes",
    "split_corpus",
    "stdlib_corpus",
    "validation_offsets",
    "windows",
]

ENWIK8_URL = "https://mattmahoney.net/dc/enwik8.zip"
ENWIK8_MD5 = "a1fa5ffddb56f4953e226637dabbb36a"  # of the 100M-byte member, as published
ENWIK8_SIZE = 100_000_000
ENWIK8 = "enwik8"
STDLIB = "stdlib"

TRAIN_PERCENT = 90
VALIDATION_PERCENT = 5
SPLITS = ("train", "validation", "test")

_GZIP_MAGIC = b"\x1f\x8b"
_CHUNK = 1 << 20


class DataError(Exception):
    """A corpus cannot be read or used; the message is one line meant for the user."""


class DownloadError(DataError):
    """enwik8 could not be downloaded or failed its check."""


@dataclass(frozen=True)
class Corpus:
    """name: what the bytes are (``enwik8``, ``stdlib`` or a path); data: [num_bytes] uint8."""

    name: str
    data: torch.Tensor


# ---------------------------------------------------------------------------- reading


def read_bytes(path: str | Path) -> bytes:
    """The bytes of ``path``, gunzipped when the file is gzip-compressed (whatever its name)."""
    path = Path(path)
    try:
        with path.open("rb") as file:
            raw = file.read()
        return gzip.decompress(raw) if raw[:2] == _GZIP_MAGIC else raw
    except FileNotFoundError:
        raise DataError(f"data file {path} does not exist") from None
    except IsADirectoryError:
        raise DataError(f"data path {path} is a directory, not a file of bytes") from None
    except (OSError, EOFError, gzip.BadGzipFile) as error:
        raise DataError(f"cannot read data file {path}: {error}") from None


def stdlib_corpus() -> bytes:
    """The ``.py`` files of the running Python's standard library (site-packages excluded),
    concatenated in path order: about 30 MB of text on any machine with Python."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts = []
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "dist-packages" in path.parts:
            continue
        try:
            parts.append(path.read_bytes())
        except OSError:
            continue
    return b"".join(parts)


def _as_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


# ---------------------------------------------------------------------------- enwik8


def download_enwik8(
    destination: str | Path,
    url: str = ENWIK8_URL,
    md5: str = ENWIK8_MD5,
    size: int = ENWIK8_SIZE,
    timeout: float = 30.0,
) -> Path:
    """Download the enwik8 archive from ``url`` with a progress bar, check the member's MD5
    and size, and write it gzip-compressed to ``destination`` (atomically). Raises
    ``DownloadError`` saying why on any failure."""
    destination = Path(destination)
    archive = _fetch(url, timeout)
    try:
        with zipfile.ZipFile(io.BytesIO(archive)) as zipped:
            data = zipped.read(ENWIK8)
    except (zipfile.BadZipFile, KeyError) as error:
        raise DownloadError(f"{url} is not the enwik8 archive: {error}") from None
    digest = hashlib.md5(data, usedforsecurity=False).hexdigest()
    if len(data) != size or digest != md5:
        raise DownloadError(
            f"checksum mismatch for {url}: got {len(data)} bytes with MD5 {digest}, "
            f"expected {size} bytes with MD5 {md5}"
        )
    with atomic_write(destination) as temporary, gzip.GzipFile(temporary, mode="wb", mtime=0) as compressed:
        compressed.write(data)
    return destination


def _fetch(url: str, timeout: float) -> bytes:
    from tqdm.auto import tqdm

    try:
        with urlopen(url, timeout=timeout) as response:
            total = int(response.headers.get("Content-Length") or 0) or None
            buffer = bytearray()
            with tqdm(total=total, unit="B", unit_scale=True, desc=f"downloading {url}") as progress:
                while chunk := response.read(_CHUNK):
                    buffer += chunk
                    progress.update(len(chunk))
    except HTTPError as error:
        raise DownloadError(f"could not download {url}: HTTP {error.code} {error.reason}") from None
    except URLError as error:
        raise DownloadError(f"could not download {url}: {error.reason}") from None
    except (OSError, ValueError) as error:
        raise DownloadError(f"could not download {url}: {error}") from None
    if total is not None and len(buffer) != total:
        raise DownloadError(f"download of {url} was cut short: {len(buffer)} of {total} bytes")
    return bytes(buffer)


# ---------------------------------------------------------------------------- choosing a corpus


def load_corpus(spec: str | None, data_dir: str | Path = "data", announce=print) -> Corpus:
    """The corpus named by ``spec``.

    - ``None``: enwik8 when it can be had, else the standard-library fallback (announced
      in one line through ``announce``);
    - ``"enwik8"``: ``data_dir/enwik8.gz``, downloaded when missing; no fallback;
    - ``"stdlib"``: the standard-library source text;
    - anything else: a path to a file of bytes, plain or gzip-compressed (named by its
      absolute path).

    Raises ``DataError`` when the corpus cannot be read.
    """
    if spec == STDLIB:
        return Corpus(STDLIB, _as_tensor(stdlib_corpus()))
    if spec not in (None, ENWIK8):
        return Corpus(str(Path(spec).absolute()), _as_tensor(read_bytes(spec)))
    path = Path(data_dir) / "enwik8.gz"
    if not path.exists():
        try:
            download_enwik8(path)
        except DownloadError as error:
            if spec == ENWIK8:
                raise
            data = stdlib_corpus()
            announce(f"enwik8 unavailable ({error}); using the Python standard library "
                     f"source instead ({len(data) / 1e6:.1f} MB)")
            return Corpus(STDLIB, _as_tensor(data))
    return Corpus(ENWIK8, _as_tensor(read_bytes(path)))


def corpus_split(data: torch.Tensor, name: str) -> torch.Tensor:
    """data: [n] -> the split ``name``, a view of ``data``: ``"train"`` ``[0, 0.9 n)``,
    ``"validation"`` ``[0.9 n, 0.95 n)``, ``"test"`` ``[0.95 n, n)``."""
    n = data.numel()
    bounds = (0, n * TRAIN_PERCENT // 100, n * (TRAIN_PERCENT + VALIDATION_PERCENT) // 100, n)
    if name not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {name!r}")
    index = SPLITS.index(name)
    return data[bounds[index]:bounds[index + 1]]


def split_corpus(data: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """data: [n] -> (train [0, 0.9 n), validation [0.9 n, 0.95 n)), views of ``data``: for
    enwik8 the customary 90M / 5M bytes. Raises ``DataError`` when a split is shorter than
    one training window (``seq_len + 1`` bytes)."""
    train, validation = corpus_split(data, "train"), corpus_split(data, "validation")
    shortest = min(train.numel(), validation.numel())
    if shortest < seq_len + 1:
        raise DataError(
            f"corpus of {data.numel()} bytes is too short for seq_len {seq_len}: its validation split "
            f"({VALIDATION_PERCENT}%) must hold at least one sequence of {seq_len + 1} bytes, "
            f"so the corpus needs about {(seq_len + 1) * 100 // VALIDATION_PERCENT} bytes"
        )
    return train, validation


# ---------------------------------------------------------------------------- windows and sampling


def windows(data: torch.Tensor, offsets: torch.Tensor, seq_len: int) -> torch.Tensor:
    """data: [n] uint8, offsets: [b] -> ids [b, seq_len + 1] int64: the model reads
    ``seq_len`` bytes and predicts each next one."""
    positions = offsets[:, None] + torch.arange(seq_len + 1)
    return data[positions].long()


def validation_offsets(num_bytes: int, seq_len: int, count: int) -> torch.Tensor:
    """``count`` window starts spread evenly over a split of ``num_bytes``: [count] int64.
    Fixed, so every validation pass scores the same bytes."""
    last = num_bytes - (seq_len + 1)
    return torch.linspace(0, last, count, dtype=torch.float64).round().long()


class RandomOffsetSampler:
    """Uniformly random window starts in a split of ``num_bytes``, ``batch_size`` at a time.

    Batch ``i`` of a stream is a pure function of ``(seed, rank, i)``: the state is just
    the number of batches drawn, so a checkpoint restores the data order exactly, and
    every rank of a distributed run reads its own stream.
    """

    def __init__(self, num_bytes: int, seq_len: int, batch_size: int, seed: int, rank: int = 0):
        if num_bytes < seq_len + 1:
            raise ValueError(f"num_bytes ({num_bytes}) must hold one window of seq_len + 1 = {seq_len + 1} bytes")
        self.num_offsets = num_bytes - seq_len  # starts 0 .. num_bytes - (seq_len + 1)
        self.batch_size = batch_size
        self.seed = seed
        self.rank = rank
        self.batches_drawn = 0

    def offsets(self, index: int) -> torch.Tensor:
        """Window starts of batch ``index``: [batch_size] int64."""
        key = f"{self.seed}:{self.rank}:{index}".encode()
        stream_seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
        generator = torch.Generator().manual_seed(stream_seed)
        return torch.randint(self.num_offsets, (self.batch_size,), generator=generator)

    def next_offsets(self) -> torch.Tensor:
        offsets = self.offsets(self.batches_drawn)
        self.batches_drawn += 1
        return offsets

    def state_dict(self) -> dict:
        return {"seed": self.seed, "batches_drawn": self.batches_drawn}

    def load_state_dict(self, state: dict) -> None:
        self.seed = state["seed"]
        self.batches_drawn = state["batches_drawn"]
