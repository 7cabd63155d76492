"""Decoding with a cache: the NSA layer against the dense layer, one token at a time.

Configuration: the layer benchmark's (``bench_layer.py``: dim 2048, 32 query heads on 2 kv
heads of dim 64, sliding window 512, compression 32 / stride 16, selection blocks of 64, 16
selected), bf16 autocast, batch 1 (``--batch``), no autograd. A prefill of n tokens builds each layer's
cache; then every step feeds the next token with the cache: eagerly, and through a static
cache (``StaticSparseAttentionCache``, the dense layer's ``StaticFullAttentionCache``) with
the step captured in a CUDA graph and replayed; for NSA also with the layer converted to
bf16 (no autocast, so no weight is cast inside the step). Per token: the wall time of 32
steps run back to back (what generation sees: the host issues one step while the GPU runs
the last), and the CUDA kernel time and kernel count of one step (torch.profiler).

    python benchmarks/bench_decode.py           # table + docs/benchmarks.md "decode" + docs/decode.png
    python benchmarks/bench_decode.py --batch 8 --cached-lens 16384 65536   # "decode-batch8", decode_batch8.png
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_layer import DIM, build  # noqa: E402
from benchmarks.figures import decode_figure  # noqa: E402
from benchmarks.report import (  # noqa: E402
    BENCHMARKS_DOC, benchmark_arguments, environment_line, markdown_table, require_cuda, write_figure, write_section,
)
from native_sparse_attention.static_cache import capture_step  # noqa: E402

CACHED_LENS = (4096, 16384, 65536)
WARMUP_STEPS, TIMED_STEPS, TIMED_RUNS = 16, 32, 5
KINDS = ("dense", "dense_graph", "nsa", "nsa_graph", "nsa_graph_bf16")
KIND_NAMES = ("dense", "dense, CUDA graph", "NSA", "NSA, CUDA graph", "NSA, bf16 layer, CUDA graph")
GRAPHED = ("dense_graph", "nsa_graph", "nsa_graph_bf16")


def figure_path(batch: int) -> Path:
    return BENCHMARKS_DOC.parent / ("decode.png" if batch == 1 else f"decode_batch{batch}.png")


@dataclass
class DecodeTiming:
    wall_ms: float
    gpu_ms: float
    kernels: int


def _timed(step: Callable[[], None]) -> DecodeTiming:
    for _ in range(WARMUP_STEPS):
        step()
    run_ms = []
    for _ in range(TIMED_RUNS):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(TIMED_STEPS):
            step()
        torch.cuda.synchronize()
        run_ms.append((time.perf_counter() - start) / TIMED_STEPS * 1e3)
    wall_ms = statistics.median(run_ms)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return DecodeTiming(wall_ms, sum(e.device_time for e in kernels) / 1e3, len(kernels))


def measure(kind: str, n: int, batch: int = 1) -> DecodeTiming:
    """Per-token decoding time of a freshly seeded layer after a prefill of n tokens:
    ``kind`` is one of KINDS: "dense_graph" and "nsa_graph" replay a captured step under
    autocast, "nsa_graph_bf16" the NSA step of the layer converted to bf16, without
    autocast."""
    torch.manual_seed(0)
    layer = build("dense" if kind.startswith("dense") else "nsa").eval()
    bf16_layer = kind == "nsa_graph_bf16"
    if bf16_layer:
        layer = layer.to(torch.bfloat16)
    steps = WARMUP_STEPS + TIMED_RUNS * TIMED_STEPS + 1
    x = torch.randn(batch, n + steps, DIM, device="cuda", dtype=torch.bfloat16 if bf16_layer else torch.float32)
    tokens = iter(range(n, x.shape[1]))
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=not bf16_layer):
        _, cache = layer(x[:, :n], return_cache=True)
        if kind in GRAPHED:
            static = layer.static_cache(cache, n + steps)
            step_input = x[:, n:n + 1].clone()
            graph, _ = capture_step(lambda: layer(step_input, cache=static), [static])

            def step():
                t = next(tokens)
                step_input.copy_(x[:, t:t + 1])
                graph.replay()
        else:
            def step():
                nonlocal cache
                t = next(tokens)
                cache = layer(x[:, t:t + 1], cache=cache, return_cache=True)[1]

        timing = _timed(step)
    del layer, cache, x
    torch.cuda.empty_cache()
    return timing


def figure_data(results: dict[int, dict[str, DecodeTiming]]):
    """``decode_figure``'s series: the replayed steps' GPU time, every kind's wall time."""
    names = dict(zip(KINDS, KIND_NAMES))
    gpu_ms = {names[kind]: {n: timings[kind].gpu_ms for n, timings in results.items()} for kind in GRAPHED}
    wall_ms = {names[kind]: {n: timings[kind].wall_ms for n, timings in results.items()} for kind in KINDS}
    return gpu_ms, wall_ms


def report(results: dict[int, dict[str, DecodeTiming]], batch: int, figure: str | None = None) -> str:
    """The markdown section; ``figure``: the file name of its figure, beside the document."""
    rows = []
    for n, timings in results.items():
        row = [n]
        for kind in KINDS:
            row += [f"{timings[kind].wall_ms:.2f}", f"{timings[kind].gpu_ms:.3f}", timings[kind].kernels]
        rows.append(row)
    unit = "token" if batch == 1 else "step"
    header = ["cached tokens"]
    for name in KIND_NAMES:
        header += [f"{name} ms / {unit}", f"{name} GPU ms", f"{name} kernels"]
    return "\n".join([
        "## Decoding (`benchmarks/bench_decode.py`)" if batch == 1 else
        f"## Decoding a batch of {batch} (`benchmarks/bench_decode.py --batch {batch}`)",
        "",
        environment_line(),
        "",
        f"One layer of the layer benchmark's configuration, bf16 autocast, batch {batch}, no autograd: after a prefill "
        f"of n tokens, one token per {'step' if batch == 1 else 'row and step'} through the layer's cache. "
        f"ms / {unit}: wall time per step over "
        f"{TIMED_STEPS} steps run back to back, the median of {TIMED_RUNS} such runs; GPU ms and kernels: CUDA kernel time and launches of one step. "
        "NSA decodes on its Triton kernels (the compressed branch and block selection, then the selected and "
        "sliding branches in one launch). Eager steps of both layers are bound by the host issuing their "
        "kernels, not by the GPU, so their wall times vary with the host's CPU by some 30% from one machine to "
        "the next. \"CUDA graph\" replays one captured step through a static cache, whose buffers have their "
        "final size from the start (`StaticSparseAttentionCache`; the dense layer's `StaticFullAttentionCache`, "
        "whose step attends its whole buffer under a mask of the cached rows). Both static steps take their "
        "linear layers from `kernels/decode_linear.py`, which under autocast reads the float32 weights in "
        "place; \"bf16 layer\" is the layer converted with `.to(torch.bfloat16)`, run without autocast.",
        "",
        markdown_table(header, rows),
        *([] if figure is None else ["", f"![Time per {unit} of the NSA and dense layers against the cached tokens: the "
                                         f"GPU time of a replayed step, and the wall time of eager and replayed steps]"
                                         f"({figure})"]),
    ])


def main() -> None:
    parser = benchmark_arguments(__doc__)
    parser.add_argument("--cached-lens", type=int, nargs="+", default=list(CACHED_LENS))
    parser.add_argument("--batch", type=int, default=1, help="sequences decoded together (default: 1)")
    args = parser.parse_args()
    require_cuda(parser)
    results = {}
    for n in args.cached_lens:
        results[n] = {kind: measure(kind, n, args.batch) for kind in KINDS}
        print(f"n={n}: {results[n]}", flush=True)
    print(report(results, args.batch))
    if not args.no_write:
        unit = "token" if args.batch == 1 else "step"
        figure = write_figure(lambda: decode_figure(*figure_data(results), unit), figure_path(args.batch))
        write_section("decode" if args.batch == 1 else f"decode-batch{args.batch}",
                      report(results, args.batch, figure and figure.name))


if __name__ == "__main__":
    main()
