"""Training throughput of the ``enwik8`` preset: NSA on its Triton kernels against full
attention (SDPA), plus the learning curves of ``train.py`` runs.

Each configuration is the enwik8 preset's model (dim 512, depth 6, 8 query heads on 4 kv
heads of dim 64, sliding window 64, compression 16 / stride 8, selection blocks of 16, 4
selected) taking whole training steps (``training.train_step``: bf16 autocast, forward,
backward, gradient clipping, fused AdamW) on random bytes, with the batch sized so every
step holds 8192 tokens, launched eagerly (``train.py --no-cuda-graph``) and with the
forward and backward replayed from a CUDA graph (``train.py``'s default on CUDA).
tokens/s comes from the median step time (CUDA events).

With ``--runs``, the section also lists ``train.py`` runs: validation bits per byte at the
last step every run validated, and the median of their logged tokens/s.

    python benchmarks/bench_train.py
    python benchmarks/bench_train.py --runs runs/enwik8-sparse runs/enwik8-full
"""

from __future__ import annotations

import gc
import json
import statistics
import sys
from dataclasses import dataclass, fields, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.report import (  # noqa: E402
    benchmark_arguments, environment_line, markdown_table, median_ms, require_cuda, write_section,
)
from native_sparse_attention.cuda_graph import GraphedLossBackward  # noqa: E402
from native_sparse_attention.plotting import read_config, read_metrics  # noqa: E402
from native_sparse_attention.training import (  # noqa: E402
    PRESETS,
    TrainConfig,
    build_model,
    build_optimizer,
    train_step,
)

TOKENS_PER_STEP = 8192
SEQ_LENS = (512, 4096)
VARIANTS = (("sparse", "triton"), ("full", None))  # (attention, backend)
MODES = (False, True)  # forward and backward replayed from a CUDA graph
GIB = 2**30


@dataclass
class Measurement:
    batch_size: int
    step_ms: float | None = None
    peak_gib: float | None = None
    error: str | None = None

    @property
    def tokens_per_s(self) -> float | None:
        return None if self.step_ms is None else TOKENS_PER_STEP / (self.step_ms / 1e3)


def measure(seq_len: int, attn: str, backend: str | None, cuda_graph: bool) -> Measurement:
    config = replace(TrainConfig(**PRESETS["enwik8"]), attn=attn, seq_len=seq_len,
                     batch_size=TOKENS_PER_STEP // seq_len)
    result = Measurement(config.batch_size)
    model = optimizer = ids = graphed = None
    try:
        torch.manual_seed(0)
        model = build_model(config, backend).cuda()
        optimizer = build_optimizer(model, config)
        ids = torch.randint(0, 256, (config.batch_size, seq_len + 1), device="cuda")
        # From here on: a replayed graph allocates nothing, its activations live in the
        # memory pool the capture allocated.
        torch.cuda.reset_peak_memory_stats()
        graphed = GraphedLossBackward(model, ids, loss_scale=1.0) if cuda_graph else None

        def step():
            train_step(model, optimizer, [ids], config.grad_clip, graphed=graphed)

        for _ in range(2):  # compile kernels, create the optimizer state
            step()
        torch.cuda.synchronize()
        result.peak_gib = torch.cuda.max_memory_allocated() / GIB
        result.step_ms = median_ms(step, warmup=200, rep=2000)
    except torch.OutOfMemoryError:
        result.error = "OOM"
    finally:
        del model, optimizer, ids, graphed
        gc.collect()
        torch.cuda.empty_cache()
    return result


def throughput_table(results: dict[tuple[int, str, bool], Measurement]) -> str:
    rows = []
    for seq_len in SEQ_LENS:
        for cuda_graph in MODES:
            full = results[seq_len, "full", cuda_graph]
            for attn, backend in VARIANTS:
                m = results[seq_len, attn, cuda_graph]
                ratio = "-"
                if attn == "sparse" and m.step_ms and full.step_ms:
                    ratio = f"{full.step_ms / m.step_ms:.2f}x"
                label = f"{attn} ({backend})" if backend else f"{attn} (SDPA)"
                rows.append([seq_len, label, "CUDA graph" if cuda_graph else "eager", m.batch_size,
                             m.error or f"{m.step_ms:.1f}", m.error or f"{m.tokens_per_s:,.0f}",
                             m.error or f"{m.peak_gib:.2f}", ratio])
    return markdown_table(["seq len", "attention", "launch", "batch", "ms / step", "tokens/s", "peak GiB",
                           "speed vs full"], rows)


def command_line(settings: dict) -> str:
    """The train.py command that reproduces a run's settings (config.json's, without its
    ``run`` section), up to --run-dir."""
    preset = settings.get("preset") or "enwik8"
    defaults = TrainConfig(**PRESETS[preset])
    flags = [f"--preset {preset}"]
    for setting in fields(TrainConfig):
        value = settings.get(setting.name)
        if setting.name == "preset" or value is None or value == getattr(defaults, setting.name):
            continue
        flag = "--" + setting.name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        else:
            flags.append(f"{flag} {value}")
    return "python train.py " + " ".join(flags)


def _settings(run_dir: Path) -> dict:
    """config.json's settings, without the ``run`` section that read_config merges in."""
    try:
        saved = json.loads((run_dir / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return {name: value for name, value in saved.items() if name != "run"}


def runs_table(run_dirs: list[Path]) -> tuple[str, int | None]:
    """One row per run; validation bpb at the last step all runs validated."""
    metrics = {run_dir: read_metrics(run_dir) for run_dir in run_dirs}
    validated = [{r["step"] for r in records if "val_bpb" in r} for records in metrics.values()]
    common = set.intersection(*validated) if validated else set()
    step = max(common) if common else None
    rows = []
    for run_dir, records in metrics.items():
        config = read_config(run_dir)
        attention = config.get("attn", "?")
        if config.get("attention_backend"):
            attention += f" ({config['attention_backend']})"
        launch = {True: "CUDA graph", False: "eager"}.get(config.get("cuda_graph"), "-")
        val = next((r["val_bpb"] for r in records if r["step"] == step and "val_bpb" in r), None)
        # The first record includes compilation and warm-up.
        speeds = [r["tokens_per_s"] for r in records[1:] if "tokens_per_s" in r]
        corpus = f"{config.get('corpus', '?')} ({config.get('corpus_bytes', 0) / 1e6:.1f} MB)"
        rows.append([run_dir.name, attention, launch, f"{config.get('num_parameters', 0) / 1e6:.1f}M", corpus,
                     records[-1]["step"] if records else 0, "-" if val is None else f"{val:.4f}",
                     f"{statistics.median(speeds):,.0f}" if speeds else "-"])
    header = ["run", "attention", "launch", "parameters", "corpus", "steps", f"val bpb at step {step}",
              "median tokens/s"]
    commands = "\n".join(f"- {run_dir.name}: `{command_line(_settings(run_dir))}`" for run_dir in run_dirs)
    return markdown_table(header, rows) + "\n\n" + commands, step


def main(argv: list[str] | None = None) -> int:
    parser = benchmark_arguments(__doc__)
    parser.add_argument("--runs", nargs="*", type=Path, default=[], help="train.py run directories to list")
    args = parser.parse_args(argv)
    require_cuda(parser)
    missing = [str(path) for path in args.runs if not (path / "metrics.jsonl").exists()]
    if missing:
        parser.error(f"no metrics.jsonl in {', '.join(missing)}")

    results = {}
    for seq_len in SEQ_LENS:
        for cuda_graph in MODES:
            for attn, backend in VARIANTS:
                key = seq_len, attn, cuda_graph
                results[key] = measure(*key[:2], backend, cuda_graph)
                print(f"seq {seq_len} {attn} cuda_graph={cuda_graph}: {results[key]}", flush=True)

    lines = [
        "## Training: enwik8 preset, NSA vs full attention (`benchmarks/bench_train.py`)",
        "",
        environment_line(),
        "",
        f"The `enwik8` preset's model (dim 512, depth 6, 8 query / 4 kv heads of dim 64; NSA: sliding "
        f"window 64, compression 16 / stride 8, selection blocks 16, 4 selected) taking whole training "
        f"steps (bf16 autocast, forward, backward, clipping, fused AdamW) with {TOKENS_PER_STEP} tokens "
        f"per step, launched eagerly (`train.py --no-cuda-graph`) or with each forward and backward replayed "
        f"from a CUDA graph (`train.py`'s default on CUDA); median step time over CUDA events; peak is "
        f"`torch.cuda.max_memory_allocated` over the first two steps (the graph's capture included), "
        f"weights and optimizer state included.",
        "",
        throughput_table(results),
    ]
    if args.runs:
        table, step = runs_table(args.runs)
        lines += [
            "",
            "`train.py` runs (settings in each run's `config.json`; validation bits per byte over the "
            "run's fixed validation windows; tokens/s as logged, which includes reading the batches "
            "and the loss of every step back to the host):",
            "",
            table,
        ]
    markdown = "\n".join(lines)
    print(markdown)
    if not args.no_write:
        write_section("training", markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
