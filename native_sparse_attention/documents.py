"""Packed sequences: several documents in one row of a batch, attended separately.

``SparseAttention(x, document_ids=...)`` takes ``document_ids: [b, n]``, an integer per
token; a run of equal ids along ``n`` is one document, and no query attends a token of
another document in any branch. Documents start at multiples of the layer's
``selection_block_size`` (``pack_documents`` pads them so): then every selection block
and every compression window a query may see lies in the query's document, and each
document is attended exactly as it would be alone at the start of a sequence (rotary
embeddings depend on distances only).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

__all__ = ["PackedDocuments", "checked_document_bounds", "document_bounds", "pack_documents"]


def _starts_here(document_ids: torch.Tensor) -> torch.Tensor:
    """[b, n] bool: True at each document's first token."""
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    return starts


def document_bounds(document_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``document_ids: [b, n]`` -> ``(document_start, document_end)``, both ``[b, n]`` int32:
    the position of the first token of each token's document, and one past its last."""
    n = document_ids.shape[1]
    positions = torch.arange(n, device=document_ids.device).expand_as(document_ids)
    starts = _starts_here(document_ids)
    document_start = torch.where(starts, positions, 0).cummax(dim=1).values
    ends = torch.ones_like(starts)
    ends[:, :-1] = starts[:, 1:]
    document_end = torch.where(ends, positions + 1, n).flip(1).cummin(dim=1).values.flip(1)
    return document_start.to(torch.int32).contiguous(), document_end.to(torch.int32).contiguous()


def _check_format(document_ids, x: torch.Tensor) -> None:
    if not isinstance(document_ids, torch.Tensor):
        raise TypeError(f"document_ids must be a tensor, got {type(document_ids).__name__}")
    if document_ids.dtype.is_floating_point or document_ids.dtype.is_complex or document_ids.dtype == torch.bool:
        raise TypeError(f"document_ids must hold integers, got {document_ids.dtype}")
    if tuple(document_ids.shape) != tuple(x.shape[:2]):
        raise ValueError(f"document_ids must have shape [batch, seq_len] = {list(x.shape[:2])}, "
                         f"got {list(document_ids.shape)}")
    if document_ids.device != x.device:
        raise ValueError(f"document_ids must be on {x.device}, the input's device, got {document_ids.device}")


def _check_alignment(document_start: torch.Tensor, alignment: int) -> None:
    misaligned = (document_start % alignment != 0).nonzero()
    if len(misaligned):
        row, position = misaligned[0].tolist()
        raise ValueError(
            f"document_ids: a document starts at position {document_start[row, position].item()} of row {row}, "
            f"which is not a multiple of selection_block_size ({alignment}); pad each document to a multiple of "
            f"it (native_sparse_attention.pack_documents does)"
        )


@dataclass
class _Checked:
    ids: weakref.ref
    version: int
    bounds: tuple[torch.Tensor, torch.Tensor]
    alignments: set[int]


# The ids a layer has checked, by id(): the layers of a model share them, and each check
# of an alignment waits for the GPU. An entry lasts as long as its tensor, unmodified.
_CHECKED: dict[int, _Checked] = {}


def checked_document_bounds(document_ids, x: torch.Tensor, alignment: int | None = None):
    """``document_bounds(document_ids)`` for a layer's input ``x: [b, n, dim]``, after
    checking the ids: ``TypeError`` / ``ValueError`` naming ``document_ids`` unless it is an
    integer ``[b, n]`` tensor on ``x``'s device whose documents start at multiples of
    ``alignment`` (when given). The alignment is checked on the host, which waits for the
    GPU, once per tensor (and after each change to it); it is skipped while compiling or
    capturing a CUDA graph, whose bounds are computed in the graph."""
    _check_format(document_ids, x)
    if torch.compiler.is_compiling() or (x.is_cuda and torch.cuda.is_current_stream_capturing()):
        return document_bounds(document_ids)
    if document_ids.is_inference():
        # No version counter to tell a changed tensor by: checked at every call.
        bounds = document_bounds(document_ids)
        if alignment is not None:
            _check_alignment(bounds[0], alignment)
        return bounds
    entry = _CHECKED.get(id(document_ids))
    if entry is None or entry.ids() is not document_ids or entry.version != document_ids._version:
        entry = _Checked(weakref.ref(document_ids), document_ids._version, document_bounds(document_ids), set())
        _CHECKED[id(document_ids)] = entry
        weakref.finalize(document_ids, _CHECKED.pop, id(document_ids), None)
    if alignment is not None and alignment not in entry.alignments:
        _check_alignment(entry.bounds[0], alignment)
        entry.alignments.add(alignment)
    return entry.bounds


class PackedDocuments(NamedTuple):
    """Rows of packed documents.

    tokens: [b, seq_len] (``pad_id`` after each document up to the next multiple of the
    alignment); document_ids: [b, seq_len], counting the documents of each row from 0
    (padding belongs to the document before it); is_token: [b, seq_len] bool, False on
    padding and on the rows' unused tails.
    """

    tokens: torch.Tensor
    document_ids: torch.Tensor
    is_token: torch.Tensor


def pack_documents(documents: Sequence[torch.Tensor], seq_len: int, alignment: int, pad_id: int = 0) -> PackedDocuments:
    """Packs 1-d token tensors, in order, into rows of ``seq_len`` tokens, each document
    starting at a multiple of ``alignment`` (a layer's ``selection_block_size``; for a
    model, the largest of its layers'). A document that does not fit in the rest of a
    row starts the next one; one longer than ``seq_len`` is cut into pieces of
    ``seq_len`` tokens, each its own document."""
    if not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
    if not isinstance(alignment, int) or alignment < 1 or seq_len % alignment:
        raise ValueError(f"alignment must be a positive int dividing seq_len ({seq_len}), got {alignment!r}")
    pieces = []
    for index, document in enumerate(documents):
        if not isinstance(document, torch.Tensor) or document.ndim != 1:
            raise ValueError(f"documents[{index}] must be a 1-d tensor of tokens")
        pieces.extend(piece for piece in document.split(seq_len) if len(piece))
    rows: list[list[torch.Tensor]] = []
    used = seq_len
    for piece in pieces:
        if used + _padded(len(piece), alignment) > seq_len:
            rows.append([])
            used = 0
        rows[-1].append(piece)
        used += _padded(len(piece), alignment)
    dtype = pieces[0].dtype if pieces else torch.long
    tokens = torch.full((len(rows), seq_len), pad_id, dtype=dtype)
    document_ids = torch.zeros(len(rows), seq_len, dtype=torch.long)
    is_token = torch.zeros(len(rows), seq_len, dtype=torch.bool)
    for row, row_pieces in enumerate(rows):
        start = 0
        for number, piece in enumerate(row_pieces):
            tokens[row, start:start + len(piece)] = piece
            is_token[row, start:start + len(piece)] = True
            document_ids[row, start:] = number
            start += _padded(len(piece), alignment)
    return PackedDocuments(tokens, document_ids, is_token)


def _padded(length: int, alignment: int) -> int:
    return -(-length // alignment) * alignment
