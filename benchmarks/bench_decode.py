"""Decoding with a cache: the NSA layer against the dense layer, one token at a time.

Configuration: the layer benchmark's (``bench_layer.py``: dim 2048, 32 query heads on 2 kv
heads of dim 64, sliding window 512, compression 32 / stride 16, selection blocks of 64, 16
selected), bf16 autocast, batch 1, no autograd. A prefill of n tokens builds each layer's
cache; then every step feeds the next token with the cache. Per token: the wall time of
32 steps run back to back (what generation sees: the host issues one step while the GPU
runs the last), and the CUDA kernel time and kernel count of one step (torch.profiler).

    python benchmarks/bench_decode.py           # table + docs/benchmarks.md "decode"
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_layer import DIM, build  # noqa: E402
from benchmarks.report import (  # noqa: E402
    benchmark_arguments, environment_line, markdown_table, require_cuda, write_section,
)

CACHED_LENS = (4096, 16384, 65536)
WARMUP_STEPS, TIMED_STEPS = 16, 32


@dataclass
class DecodeTiming:
    wall_ms: float
    gpu_ms: float
    kernels: int


def measure(kind: str, n: int) -> DecodeTiming:
    """Per-token decoding time of a freshly seeded ``kind`` layer after a prefill of n tokens."""
    torch.manual_seed(0)
    layer = build(kind).eval()
    x = torch.randn(1, n + WARMUP_STEPS + TIMED_STEPS + 1, DIM, device="cuda")
    tokens = iter(range(n, x.shape[1]))

    def step(cache):
        t = next(tokens)
        return layer(x[:, t:t + 1], cache=cache, return_cache=True)[1]

    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        _, cache = layer(x[:, :n], return_cache=True)
        for _ in range(WARMUP_STEPS):
            cache = step(cache)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(TIMED_STEPS):
            cache = step(cache)
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - start) / TIMED_STEPS * 1e3
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            cache = step(cache)
            torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu_ms = sum(e.device_time for e in kernels) / 1e3
    del layer, cache, x
    torch.cuda.empty_cache()
    return DecodeTiming(wall_ms, gpu_ms, len(kernels))


def report(results: dict[int, dict[str, DecodeTiming]]) -> str:
    rows = []
    for n, pair in results.items():
        dense, nsa = pair["dense"], pair["nsa"]
        rows.append([n, f"{dense.wall_ms:.2f}", f"{dense.gpu_ms:.3f}", dense.kernels,
                     f"{nsa.wall_ms:.2f}", f"{nsa.gpu_ms:.3f}", nsa.kernels])
    header = ["cached tokens", "dense ms / token", "dense GPU ms", "dense kernels",
              "NSA ms / token", "NSA GPU ms", "NSA kernels"]
    return "\n".join([
        "## Decoding (`benchmarks/bench_decode.py`)",
        "",
        environment_line(),
        "",
        "One layer of the layer benchmark's configuration, bf16 autocast, batch 1, no autograd: after a prefill "
        "of n tokens, one token per step through the layer's cache. ms / token: wall time per step over "
        f"{TIMED_STEPS} steps run back to back; GPU ms and kernels: CUDA kernel time and launches of one step. "
        "NSA decodes on its Triton kernels (the compressed branch and block selection, then the selected and "
        "sliding branches in one launch). Both layers' steps are bound by the host issuing their kernels, not by "
        "the GPU, so the wall times vary with the host's CPU by some 30% from one machine to the next.",
        "",
        markdown_table(header, rows),
    ])


def main() -> None:
    parser = benchmark_arguments(__doc__)
    parser.add_argument("--cached-lens", type=int, nargs="+", default=list(CACHED_LENS))
    args = parser.parse_args()
    require_cuda(parser)
    results = {}
    for n in args.cached_lens:
        results[n] = {kind: measure(kind, n) for kind in ("dense", "nsa")}
        print(f"n={n}: {results[n]}", flush=True)
    markdown = report(results)
    print(markdown)
    if not args.no_write:
        write_section("decode", markdown)


if __name__ == "__main__":
    main()
