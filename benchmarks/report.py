"""Shared helpers for the benchmark scripts: environment description and docs/benchmarks.md.

Each benchmark owns one section of ``docs/benchmarks.md``, delimited by HTML comments, so
scripts can be re-run independently without clobbering each other's results.
"""

from __future__ import annotations

import argparse
import datetime
import re
from pathlib import Path

import torch

BENCHMARKS_DOC = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
_TITLE = "# Benchmarks\n\nEach section is written by the script named in it; re-run it to refresh.\n"


def benchmark_arguments(doc: str) -> argparse.ArgumentParser:
    """The argument parser of a benchmark script: described by the first paragraph of the
    script's docstring ``doc``, with the ``--no-write`` flag every script takes."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    return parser


def require_cuda(parser: argparse.ArgumentParser) -> None:
    """Exits through ``parser`` with a usage error where no CUDA device is available."""
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")


def environment_line() -> str:
    """GPU name, torch and triton versions and today's date, as one markdown line."""
    import triton

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    today = datetime.date.today().isoformat()
    return f"{gpu}, torch {torch.__version__}, triton {triton.__version__}, {today}"


def median_ms(fn, warmup: int = 25, rep: int = 100, min_calls: int = 10) -> float:
    """Median wall time of ``fn()`` in milliseconds, timed with CUDA events by triton over
    ``rep`` ms of calls, and at least about ``min_calls`` of them: triton times
    ``rep / (one call's time)`` calls, which for the dense layer's 145 ms step at n = 65536
    would be a single one, at whatever clock the GPU's power state allowed then."""
    import triton.testing

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    rep = max(rep, 1.2 * min_calls * start.elapsed_time(end))
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def kernel_times(fn, calls: int) -> dict[str, float]:
    """Device time (ms) per call of ``fn`` of each CUDA kernel (and memset / memcpy) it
    runs, by name, from the profiler over ``calls`` calls after a synchronisation."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    times: dict[str, float] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            times[event.name] = times.get(event.name, 0.0) + event.device_time / 1000 / calls
    return times


def write_figure(draw, path: Path) -> Path | None:
    """The matplotlib figure ``draw()`` returns, written to ``path`` as a PNG (atomically);
    None, with a note, where matplotlib is not installed (the tables are written anyway)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(f"matplotlib is not installed: {path.name} not drawn (pip install matplotlib)")
        return None
    import matplotlib.pyplot as plt

    from native_sparse_attention.checkpoint import atomic_write

    figure = draw()
    try:
        with atomic_write(path) as temporary:
            figure.savefig(temporary, format="png", dpi=100)
    finally:
        plt.close(figure)
    return path


def markdown_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def write_section(name: str, markdown: str, path: Path = BENCHMARKS_DOC) -> None:
    """Replace (or append) the section ``name`` of the benchmarks document."""
    begin, end = f"<!-- BEGIN {name} -->", f"<!-- END {name} -->"
    block = f"{begin}\n{markdown.strip()}\n{end}"
    text = path.read_text() if path.exists() else _TITLE
    pattern = re.compile(re.escape(begin) + ".*?" + re.escape(end), re.DOTALL)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)

