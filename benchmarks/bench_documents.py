"""Packed documents: the NSA layer and the dense layer on rows that pack many documents.

Training on documents shorter than the sequence packs several of them in one row and masks
attention between them (``document_ids``). Packed, a layer should cost what the same
documents cost as a batch of separate sequences: every branch then skips the keys of
earlier documents instead of masking them. This script measures, for one row of ``--tokens``
tokens cut into documents of each length, the forward + backward (bf16 autocast, replayed
from a CUDA graph) of the layer benchmark's NSA layer and of the dense layer, packed with
``document_ids`` and as a batch of the documents, and the NSA layer's peak memory packed.
The dense layer attends packed documents through FlexAttention and a batch through SDPA.

    python benchmarks/bench_documents.py      # table + docs/benchmarks.md "documents"
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_layer import GIB, Heads, build, make_workspaces  # noqa: E402
from benchmarks.report import (  # noqa: E402
    benchmark_arguments, environment_line, markdown_table, median_ms, require_cuda, write_section,
)
from native_sparse_attention.cuda_graph import capture  # noqa: E402

TOKENS = 65536
DOCUMENT_LENGTHS = (65536, 16384, 4096, 1024)


def step(layer: torch.nn.Module, x: torch.Tensor, grad_out: torch.Tensor,
         document_ids: torch.Tensor | None) -> Callable[[], None]:
    def forward_backward() -> None:
        x.grad = None
        layer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = layer(x) if document_ids is None else layer(x, document_ids=document_ids)
        out.backward(grad_out)

    return forward_backward


def measure(kind: str, tokens: int, length: int, packed: bool) -> tuple[float | str, float | None]:
    """(replayed forward + backward ms, peak GiB of one eager step) of ``kind``'s layer on
    ``tokens`` tokens in documents of ``length``, packed in one row or as a batch."""
    held = torch.cuda.memory_allocated()
    torch.manual_seed(0)
    layer = build(kind, Heads())
    shape = (1, tokens) if packed else (tokens // length, length)
    x = torch.randn(*shape, layer.dim, device="cuda", requires_grad=True)
    grad_out = torch.randn_like(x)
    document_ids = None
    if packed:
        document_ids = (torch.arange(tokens, device="cuda") // length)[None]
    forward_backward = step(layer, x, grad_out, document_ids)
    try:
        forward_backward()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        forward_backward()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - held) / GIB
        graph, _ = capture(forward_backward)
        return median_ms(graph.replay), peak
    except torch.OutOfMemoryError:
        return "OOM", None
    finally:
        del layer, x, grad_out, forward_backward
        gc.collect()
        torch.cuda.empty_cache()


def _fmt(value: float | str | None, digits: int = 2) -> str:
    if value is None or isinstance(value, str):
        return value or "-"
    return f"{value:.{digits}f}"


def report(tokens: int, rows: list[list]) -> str:
    return "\n".join([
        "## Packed documents (`benchmarks/bench_documents.py`)",
        "",
        environment_line(),
        "",
        f"{tokens} tokens cut into documents of one length, packed in one row (`document_ids`) or as a "
        "batch of the documents; the layer benchmark's layers (dim 2048, 32 query heads on 2 kv heads of "
        "dim 64; NSA: window 512, compression 32 / 16, selection blocks of 64, 16 selected), bf16 autocast, "
        "forward + backward replayed from a CUDA graph (medians of CUDA-event timings). The dense layer "
        "attends packed documents through FlexAttention (compiled, a document-causal block mask of 128 x 128 "
        "tiles) and a batch through SDPA. NSA peak: `torch.cuda.max_memory_allocated` over one eager "
        "forward + backward, packed, less what the process held before the layer was built (as in the "
        "layer benchmark).",
        "",
        markdown_table(["document length", "documents", "NSA packed ms", "NSA batch ms", "dense packed ms",
                        "dense batch ms", "NSA peak GiB, packed", "speed-up packed, dense / NSA"], rows),
    ])


def main() -> None:
    parser = benchmark_arguments(__doc__)
    parser.add_argument("--tokens", type=int, default=TOKENS)
    parser.add_argument("--lengths", type=int, nargs="+", default=list(DOCUMENT_LENGTHS))
    args = parser.parse_args()
    require_cuda(parser)
    make_workspaces()
    rows = []
    for length in args.lengths:
        nsa_packed, peak = measure("nsa", args.tokens, length, packed=True)
        nsa_batch, _ = measure("nsa", args.tokens, length, packed=False)
        dense_packed, _ = measure("dense", args.tokens, length, packed=True)
        dense_batch, _ = measure("dense", args.tokens, length, packed=False)
        speedup = (f"{dense_packed / nsa_packed:.2f}x"
                   if isinstance(dense_packed, float) and isinstance(nsa_packed, float) else "-")
        rows.append([length, args.tokens // length, _fmt(nsa_packed), _fmt(nsa_batch), _fmt(dense_packed),
                     _fmt(dense_batch), _fmt(peak), speedup])
        print(rows[-1], flush=True)
    print(report(args.tokens, rows))
    if not args.no_write:
        write_section("documents", report(args.tokens, rows))


if __name__ == "__main__":
    main()
