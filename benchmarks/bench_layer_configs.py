"""The NSA layer against the dense layer at several head configurations.

The layer benchmark (``bench_layer.py``) measures one configuration, 32 query heads on 2 kv
heads of dim 64: groups of 16 query heads, as in the NSA paper. Its selection branch runs
query-major: the program of one query position and kv head gathers the key and value rows of
every block that position selected (its own block and the top-n), once for the whole group.
Per token that is ``2 * kv_heads * (top_n + 1) * selection_block * dim_head`` elements,
whatever the group's size, while the dense layer's attention does work in proportion to the
query heads. Smaller groups and wider heads thus give the dense layer less work per
gathered byte. This script measures how far: the same layer options (sliding window 512,
compression 32 / stride 16, selection blocks of 64, 16 selected, causal, bf16 autocast, batch
1) at other widths and head counts, each length's forward + backward replayed from a CUDA
graph (the GPU's time; ``bench_layer.py``'s "CUDA graph" column) and launched eagerly, the
peak memory, and at one length the share of the NSA layer's kernel time spent in the
selection's kernels.

    python benchmarks/bench_layer_configs.py      # table + docs/benchmarks.md "layer-configs" + its figure
"""

from __future__ import annotations

import gc
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_layer import (  # noqa: E402
    NSA_OPTIONS, Heads, Measurement, kernel_group, inputs, make_workspaces, measure, step_fns,
)
from benchmarks.figures import configs_figure  # noqa: E402
from benchmarks.report import (  # noqa: E402
    BENCHMARKS_DOC, benchmark_arguments, environment_line, kernel_times, markdown_table, require_cuda, write_figure,
    write_section,
)

CONFIGS = (
    Heads(),  # the layer benchmark's
    Heads(dim=2048, heads=16, kv_heads=2, dim_head=128),
    Heads(dim=2048, heads=32, kv_heads=8, dim_head=64),
    Heads(dim=4096, heads=32, kv_heads=8, dim_head=128),
)
SEQ_LENS = (8192, 32768, 65536)
PROFILED_LENGTH = 32768
PROFILED_STEPS = 3
# The layer benchmark's kernel group of kernels/selection.py: the selection's forward (with
# the sliding window's forward tiles, which share its kernel), dQ and dK / dV passes.
SELECTION_GROUP = "selected attention fwd + bwd, sliding-window forward (kernels/selection.py)"
FIGURE = BENCHMARKS_DOC.parent / "layer_configs.png"
_BF16_BYTES = 2


@dataclass
class ConfigResult:
    """One configuration's measurements: per length, the dense and the NSA layer's; the
    NSA layer's kernel time at PROFILED_LENGTH, all of it and SELECTION_GROUP's."""

    heads: Heads
    lengths: dict[int, dict[str, Measurement]] = field(default_factory=dict)
    kernels_ms: float | None = None
    selection_ms: float | None = None


def label(heads: Heads) -> str:
    return f"{heads.heads}q / {heads.kv_heads}kv, d {heads.dim_head}, dim {heads.dim}"


def gathered_bytes_per_token(heads: Heads) -> int:
    """Key and value bytes (bf16) the selection's forward gathers per query position: the
    query's own block and the top-n, for each kv head."""
    blocks = NSA_OPTIONS["num_selected_blocks"] + 1
    return 2 * heads.kv_heads * blocks * NSA_OPTIONS["selection_block_size"] * heads.dim_head * _BF16_BYTES


def selection_share(heads: Heads, n: int) -> tuple[float, float]:
    """(all kernels, SELECTION_GROUP's) ms per eager forward + backward of the NSA layer,
    from the profiler over PROFILED_STEPS steps."""
    layer, x, grad_out = inputs("nsa", n, heads)
    step = step_fns(layer, x, grad_out)[1]
    try:
        for _ in range(2):
            step()
        per_kernel = kernel_times(step, PROFILED_STEPS)
        selection = sum(ms for name, ms in per_kernel.items() if kernel_group(name) == SELECTION_GROUP)
        return sum(per_kernel.values()), selection
    finally:
        del layer, x, grad_out, step
        gc.collect()
        torch.cuda.empty_cache()


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _speedup(dense: float | None, nsa: float | None) -> str:
    return "-" if dense is None or nsa is None else f"{dense / nsa:.2f}x"


def _pair(dense: Measurement, nsa: Measurement, attr: str) -> str:
    if dense.error or nsa.error:
        return f"{dense.error or _fmt(getattr(dense, attr))} / {nsa.error or _fmt(getattr(nsa, attr))}"
    return f"{_fmt(getattr(dense, attr))} / {_fmt(getattr(nsa, attr))}"


def speedups(results: list[ConfigResult]) -> dict[str, dict[int, float | None]]:
    """Per config label and length, the dense layer's replayed step time over the NSA layer's."""
    out = {}
    for result in results:
        out[label(result.heads)] = {
            n: (None if pair["dense"].graph_step_ms is None or pair["nsa"].graph_step_ms is None
                else pair["dense"].graph_step_ms / pair["nsa"].graph_step_ms)
            for n, pair in result.lengths.items()}
    return out


def report(results: list[ConfigResult], figure: str | None = None) -> str:
    """The markdown section; ``figure``: the file name of its figure, beside the document."""
    rows, shares = [], []
    for result in results:
        heads = result.heads
        for n, pair in result.lengths.items():
            dense, nsa = pair["dense"], pair["nsa"]
            rows.append([
                label(heads), heads.heads // heads.kv_heads, n,
                _pair(dense, nsa, "graph_step_ms"), _speedup(dense.graph_step_ms, nsa.graph_step_ms),
                _pair(dense, nsa, "step_ms"), _speedup(dense.step_ms, nsa.step_ms),
                _pair(dense, nsa, "peak_gib"),
            ])
        share = (None if not result.kernels_ms or result.selection_ms is None
                 else 100 * result.selection_ms / result.kernels_ms)
        shares.append([label(heads), f"{gathered_bytes_per_token(heads) / 2**20:.2f}",
                       _fmt(result.selection_ms), _fmt(result.kernels_ms), _fmt(share, 0)])
    lines = [
        "## Layer at other head configurations (`benchmarks/bench_layer_configs.py`)",
        "",
        environment_line(),
        "",
        "The layer benchmark's options (sliding window 512, compression 32 / stride 16, selection "
        "blocks of 64, 16 selected, causal, bf16 autocast, batch 1) at other widths and heads; the "
        "first configuration is the layer benchmark's. Medians of CUDA-event timings of forward + "
        "backward, replayed from a CUDA graph (the GPU's time) and launched eagerly (bound by the "
        "host's Python at short lengths); peak memory as in the layer benchmark.",
        "",
        markdown_table(["config", "group", "n", "CUDA graph fwd+bwd ms, dense / NSA", "speed-up, CUDA graph",
                        "eager fwd+bwd ms, dense / NSA", "speed-up, eager", "peak GiB, dense / NSA"], rows),
        "",
        f"The selection at n = {PROFILED_LENGTH}: the key / value bytes its forward gathers per token "
        "(`2 * kv_heads * (top_n + 1) * selection_block * dim_head` bf16 elements), and the NSA layer's "
        "kernel time per eager forward + backward in the selection's kernels (its forward, with the "
        "sliding window's forward tiles, which share its kernel, and its dQ and dK / dV passes) against "
        "all its kernels (the profiler's sum, streams added up).",
        "",
        markdown_table(["config", "gathered per token, MiB", "selection kernels ms", "all kernels ms",
                        "share %"], shares),
    ]
    if figure:
        lines += ["", f"![The NSA layer's speed-up over the dense layer by sequence length, one line per "
                      f"head configuration]({figure})"]
    return "\n".join(lines)


def main() -> None:
    parser = benchmark_arguments(__doc__)
    parser.add_argument("--seq-lens", type=int, nargs="+", default=list(SEQ_LENS))
    args = parser.parse_args()
    require_cuda(parser)
    make_workspaces()
    results = []
    for heads in CONFIGS:
        result = ConfigResult(heads)
        for n in args.seq_lens:
            result.lengths[n] = {kind: measure(kind, n, heads) for kind in ("dense", "nsa")}
            print(f"{label(heads)} n={n}: dense {result.lengths[n]['dense']}, nsa {result.lengths[n]['nsa']}",
                  flush=True)
        try:
            result.kernels_ms, result.selection_ms = selection_share(heads, PROFILED_LENGTH)
        except torch.OutOfMemoryError:
            pass
        results.append(result)
    print(report(results))
    if not args.no_write:
        figure = write_figure(lambda: configs_figure(speedups(results)), FIGURE)
        write_section("layer-configs", report(results, figure and figure.name))


if __name__ == "__main__":
    main()
