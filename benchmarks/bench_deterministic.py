"""What deterministic steps cost: the layer benchmark's NSA layer with and without
``torch.use_deterministic_algorithms(True)``.

    python benchmarks/bench_deterministic.py [--seq-lens 8192 65536] [--rounds 3] [--no-write]

For each head configuration and length, alternating the two modes round after round (so
that the GPU's clock drifts alike for both): the forward + backward replayed from a CUDA
graph (captured in that mode; CUDA-event medians), the peak memory of an eager step above
what the process held before, and whether three eager steps on the same input gave the same
output and gradients bit for bit. The configurations: the layer benchmark's 32 query heads
on 2 kv heads (selections shared by 16 heads: only the selection's dK / dV and the windows'
position gradients add atomically by default) and 32 on 8 (groups of 4, whose dQ and, from
2048 queries, forward add atomically too). Deterministic mode also makes PyTorch fill every
``torch.empty`` (``torch.utils.deterministic.fill_uninitialized_memory``), which the times
include, as a user's run would. Writes the section "deterministic" of docs/benchmarks.md.
"""

from __future__ import annotations

import gc
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_layer import GIB, Heads, inputs, replayed_step, step_fns  # noqa: E402
from benchmarks.report import (  # noqa: E402
    benchmark_arguments, environment_line, markdown_table, median_ms, require_cuda, write_section,
)
from native_sparse_attention.training import deterministic_algorithms  # noqa: E402

CONFIGS = {"32 on 2 kv heads": Heads(), "32 on 8 kv heads": Heads(kv_heads=8)}
MODES = ("default", "deterministic")
REPEATED_STEPS = 3


def _step_results(layer, x, grad_out) -> list[torch.Tensor]:
    """The output and every gradient of one eager forward + backward."""
    forward, _ = step_fns(layer, x, grad_out)
    x.grad = None
    layer.zero_grad(set_to_none=True)
    out = forward()
    out.backward(grad_out)
    return [out.detach().clone(), x.grad.clone(), *(p.grad.clone() for p in layer.parameters())]


def measure_once(heads: Heads, n: int, mode: str) -> dict:
    """One round of ``mode``: replayed step ms, eager peak GiB and bit-for-bit repetition."""
    held = torch.cuda.memory_allocated()
    layer = x = grad_out = None
    try:
        with deterministic_algorithms(mode == "deterministic"):
            layer, x, grad_out = inputs("nsa", n, heads)
            first = _step_results(layer, x, grad_out)  # compiles the kernels
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            repeats = [_step_results(layer, x, grad_out) for _ in range(REPEATED_STEPS - 1)]
            torch.cuda.synchronize()
            peak = (torch.cuda.max_memory_allocated() - held) / GIB
            same = all(torch.equal(a, b) for repeat in repeats for a, b in zip(first, repeat))
            del first, repeats
            step_ms = median_ms(replayed_step(layer, x, grad_out))
        return {"ms": step_ms, "peak": peak, "same": same}
    finally:
        del layer, x, grad_out
        gc.collect()
        torch.cuda.empty_cache()


def measure(heads: Heads, n: int, rounds: int) -> dict[str, dict]:
    runs = {mode: [] for mode in MODES}
    for round_index in range(rounds):
        for mode in MODES if round_index % 2 == 0 else reversed(MODES):
            runs[mode].append(measure_once(heads, n, mode))
    return {mode: {"ms": statistics.median(r["ms"] for r in results), "peak": max(r["peak"] for r in results),
                   "same": all(r["same"] for r in results), "rounds": len(results)}
            for mode, results in runs.items()}


def report(results: dict[tuple[str, int], dict[str, dict]]) -> str:
    rows = []
    for (config, n), modes in results.items():
        default, deterministic = modes["default"], modes["deterministic"]
        rows.append([
            config, n, f"{default['ms']:.2f}", f"{deterministic['ms']:.2f}",
            f"{deterministic['ms'] / default['ms']:.2f}x", f"{default['peak']:.2f}", f"{deterministic['peak']:.2f}",
            "yes" if default["same"] else "no", "yes" if deterministic["same"] else "no",
        ])
    header = ["config", "n", "default ms", "deterministic ms", "time ratio", "default peak GiB",
              "deterministic peak GiB", f"default: same bits in {REPEATED_STEPS} steps",
              f"deterministic: same bits in {REPEATED_STEPS} steps"]
    rounds = next(iter(results.values()))["default"]["rounds"]
    return "\n\n".join([
        "## Deterministic steps (`benchmarks/bench_deterministic.py`)",
        environment_line(),
        "The layer benchmark's NSA layer (dim 2048, 32 query heads, head dim 64, window 512, compression 32 / 16, "
        "selection blocks of 64, 16 selected, causal, bf16 autocast, batch 1) with 2 or 8 kv heads, with and "
        "without `torch.use_deterministic_algorithms(True)`. Times: the forward + backward replayed from a CUDA "
        f"graph captured in that mode, medians of CUDA-event timings, the median over {rounds} rounds alternating "
        "the modes; peak: the most an eager step allocated above what the process held before; same bits: "
        f"whether {REPEATED_STEPS} eager steps on one input gave the same output and gradients, bit for bit.",
        markdown_table(header, rows),
    ])


def main() -> None:
    parser = benchmark_arguments(__doc__)
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[8192, 65536])
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each mode (default 3)")
    args = parser.parse_args()
    require_cuda(parser)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    # cuBLAS needs a fixed workspace under deterministic algorithms; PyTorch reads this
    # before each matmul, cuBLAS when the process first makes its handle.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    results = {}
    for config, heads in CONFIGS.items():
        for n in args.seq_lens:
            results[config, n] = measure(heads, n, args.rounds)
            print(config, n, results[config, n], flush=True)
    section = report(results)
    print(section)
    if not args.no_write:
        write_section("deterministic", section)


if __name__ == "__main__":
    main()
