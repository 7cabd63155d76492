"""Generation from prompts of different lengths: one batch against one prompt at a time.

``Transformer.sample`` takes a list of prompts of different lengths as one batch: each
prompt is prefilled alone, and the rows decode together at their own positions, every step
replayed from one CUDA graph. This script times that against decoding each prompt by
itself (batch 1, a graph of its own), as a loop without ragged batches would: the
``enwik8`` preset's model of ``train.py`` with random weights, bf16 autocast, greedy
decoding of ``--new-tokens`` bytes per prompt. Each time is the whole ``sample`` call
(prefills, capture and steps), the median of ``--runs`` calls after one untimed; the last
column counts the rows whose bytes are the same both ways.

    python benchmarks/bench_ragged_decode.py    # table + docs/benchmarks.md "ragged-decode"
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.report import (  # noqa: E402
    benchmark_arguments, environment_line, markdown_table, require_cuda, write_section,
)
from native_sparse_attention.training import TrainConfig, build_model  # noqa: E402
from native_sparse_attention.transformer import Transformer, autocast  # noqa: E402

PROMPT_SETS = ((100, 700, 1500, 3000), tuple(range(50, 850, 100)), (64,) * 8)
NEW_TOKENS, RUNS = 256, 5


def seconds(fn: Callable[[], list[torch.Tensor]], runs: int) -> tuple[float, list[torch.Tensor]]:
    """Median wall time of ``runs`` calls of ``fn`` after one untimed, and its last result."""
    result = fn()
    times = []
    for _ in range(runs):
        torch.cuda.synchronize()
        start = time.perf_counter()
        result = fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def measure(model: Transformer, lengths: tuple[int, ...], new_tokens: int, runs: int) -> list:
    prompts = [torch.randint(0, model.config["num_tokens"], (n,), device="cuda") for n in lengths]
    final_lengths = [n + new_tokens for n in lengths]

    def one_batch() -> list[torch.Tensor]:
        return model.sample(prompts, final_lengths, temperature=0.0, use_cuda_graph=True)

    def one_at_a_time() -> list[torch.Tensor]:
        return [model.sample(p, n, temperature=0.0, use_cuda_graph=True) for p, n in zip(prompts, final_lengths)]

    with torch.no_grad(), autocast(torch.device("cuda")):
        batch_s, batch_rows = seconds(one_batch, runs)
        alone_s, alone_rows = seconds(one_at_a_time, runs)
    same = sum(torch.equal(mine, alone) for mine, alone in zip(batch_rows, alone_rows))
    return [", ".join(map(str, lengths)), f"{batch_s:.3f}", f"{alone_s:.3f}", f"{alone_s / batch_s:.2f}x",
            f"{same} of {len(lengths)}"]


def report(new_tokens: int, rows: list[list]) -> str:
    return "\n".join([
        "## Prompts of different lengths (`benchmarks/bench_ragged_decode.py`)",
        "",
        environment_line(),
        "",
        f"The `enwik8` preset's model of `train.py` (random weights), bf16 autocast, {new_tokens} greedy bytes "
        "per prompt, every step replayed from a CUDA graph. One batch: `Transformer.sample` with the list of "
        "prompts, each prefilled alone and the rows decoded together at their own positions; one at a time: "
        "each prompt by itself (batch 1). Seconds per whole call (prefills, capture and steps), medians.",
        "",
        markdown_table(["prompt lengths", "one batch s", "one at a time s", "speed-up", "rows with the same bytes"],
                       rows),
    ])


def main() -> None:
    parser = benchmark_arguments(__doc__)
    parser.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    parser.add_argument("--runs", type=int, default=RUNS)
    args = parser.parse_args()
    require_cuda(parser)
    torch.manual_seed(0)
    model = build_model(TrainConfig(), "triton").cuda().eval()
    rows = []
    for lengths in PROMPT_SETS:
        rows.append(measure(model, lengths, args.new_tokens, args.runs))
        print(rows[-1], flush=True)
    print(report(args.new_tokens, rows))
    if not args.no_write:
        write_section("ragged-decode", report(args.new_tokens, rows))


if __name__ == "__main__":
    main()
