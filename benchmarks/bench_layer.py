"""The whole NSA layer against a dense SDPA layer: forward, forward + backward, peak memory.

Configuration (the one the layer issue measured the popular package on): dim 2048, 32
query heads on 2 kv heads of dim 64, sliding window 512, compression blocks of 32 every
16 tokens, selection blocks of 64, 16 selected, causal, bf16 autocast, batch 1; the NSA
layer runs its Triton path (``use_triton_kernel=True``), the dense layer is
``FullAttention`` (SDPA, flash) with the same projections and rotary embeddings.

Timings are CUDA-event medians (``triton.testing.do_bench``) of a training step's
forward (autograd on) and of forward + backward with an fp32 input that requires grad,
launched eagerly and, for forward + backward, also replayed from a CUDA graph (the GPU
time without Python and launch overhead, which dominates short sequences) and run through
``torch.compile(fullgraph=True, mode="reduce-overhead")``, what a training loop gets from
one line.
Peak memory is ``torch.cuda.max_memory_allocated`` over one forward + backward, less what
the process held before the layer was built: the layer, its input and the output gradient
count, the workspaces cuBLAS keeps for each stream it has run on do not (a warm-up run
makes them before the first measured one).
With matplotlib installed, the section's figure (docs/layer_benchmark.png) draws the
speed-ups and memory ratios against n with the targets, and the profiled kernel times.

A lead of a few percent is within what the dense step's median moves between runs, with
the GPU's clock and power state (2% at n = 8192 on an H100). ``--paired`` times the two
layers' replayed and compiled steps alternately in one process, round after round, so
that such drifts fall on both alike (and a third step, the layer made a graphed callable
by ``torch.cuda.make_graphed_callables`` inside an eager step, what an eager training
loop can do), and writes the rounds' spread (section "layer-paired")
and, with matplotlib, each round's speed-up (docs/layer_paired.png).

    python benchmarks/bench_layer.py                 # table + docs/benchmarks.md "layer" + its figure
    python benchmarks/bench_layer.py --profile 8192 65536 --profile-out prof.txt
    python benchmarks/bench_layer.py --paired 8192 --rounds 20
"""

from __future__ import annotations

import gc
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.report import (  # noqa: E402
    BENCHMARKS_DOC, benchmark_arguments, environment_line, markdown_table, median_ms, require_cuda, write_figure,
    write_section,
)
from benchmarks.figures import layer_figure, paired_figure  # noqa: E402
from native_sparse_attention import FullAttention, SparseAttention  # noqa: E402
from native_sparse_attention.cuda_graph import capture  # noqa: E402

DIM, HEADS, KV_HEADS, DIM_HEAD = 2048, 32, 2, 64
NSA_OPTIONS = dict(
    sliding_window_size=512, compress_block_size=32, compress_block_sliding_stride=16,
    selection_block_size=64, num_selected_blocks=16, causal=True, use_triton_kernel=True,
)
SEQ_LENS = (4096, 8192, 16384, 32768, 65536)
PROFILED_STEPS = 5  # compiled steps per profiled length (--profile)
PAIRED_MODES = ("CUDA graph", "torch.compile", "graphed layer")
_COMPILED_WARMUP_MS = 500
GIB = 2**30
FIGURE = BENCHMARKS_DOC.parent / "layer_benchmark.png"
PAIRED_FIGURE = BENCHMARKS_DOC.parent / "layer_paired.png"

# The issue's measurements of the dense layer and of the popular native-sparse-attention-pytorch
# package's layer on one H100 (torch 2.11, triton 3.6): n -> (fwd ms, fwd+bwd ms, peak GB).
ISSUE_DENSE = {4096: (1.41, 2.93, 0.68), 16384: (4.46, 14.0, 1.5)}
ISSUE_POPULAR_TRITON = {4096: (5.76, 29.6, 3.0), 16384: (30.1, 134.8, 12.8)}
ISSUE_POPULAR_PYTORCH = {4096: ("12.1", "38.4", "9.9"), 16384: ("49.1", "out of memory (80 GB)", "")}


@dataclass(frozen=True)
class Heads:
    """The width and heads of both layers (the rest of NSA_OPTIONS is fixed)."""

    dim: int = DIM
    heads: int = HEADS
    kv_heads: int = KV_HEADS
    dim_head: int = DIM_HEAD


@dataclass
class Measurement:
    fwd_ms: float | None = None
    step_ms: float | None = None
    graph_step_ms: float | None = None
    compiled_step_ms: float | None = None
    peak_gib: float | None = None
    error: str | None = None


def build(kind: str, heads: Heads = Heads()) -> torch.nn.Module:
    if kind == "nsa":
        layer = SparseAttention(heads.dim, heads.dim_head, heads.heads, kv_heads=heads.kv_heads, **NSA_OPTIONS)
    else:
        layer = FullAttention(heads.dim, heads.dim_head, heads.heads, kv_heads=heads.kv_heads, causal=True)
    return layer.cuda()


def inputs(kind: str, n: int, heads: Heads = Heads()):
    """A freshly seeded layer, its input x [1, n, dim] (fp32, requires grad) and an output gradient."""
    torch.manual_seed(0)
    layer = build(kind, heads)
    x = torch.randn(1, n, heads.dim, device="cuda", requires_grad=True)
    grad_out = torch.randn(1, n, heads.dim, device="cuda")
    return layer, x, grad_out


def step_fns(layer, x, grad_out):
    def forward():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return layer(x)

    def forward_backward():
        x.grad = None
        layer.zero_grad(set_to_none=True)
        forward().backward(grad_out)

    return forward, forward_backward


def measure(kind: str, n: int, heads: Heads = Heads()) -> Measurement:
    result = Measurement()
    layer = x = grad_out = None
    held = torch.cuda.memory_allocated()
    try:
        layer, x, grad_out = inputs(kind, n, heads)
        forward, forward_backward = step_fns(layer, x, grad_out)
        forward_backward()  # compile kernels, warm the allocator
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        forward_backward()
        torch.cuda.synchronize()
        result.peak_gib = (torch.cuda.max_memory_allocated() - held) / GIB
        result.fwd_ms = median_ms(forward)
        result.step_ms = median_ms(forward_backward)
        result.graph_step_ms = median_ms(replayed_step(layer, x, grad_out))
    except torch.OutOfMemoryError:
        result.error = "OOM"
    finally:
        del layer, x, grad_out
        gc.collect()
        torch.cuda.empty_cache()
    return result


def make_workspaces() -> None:
    """Measures and discards a short NSA run, eager and replayed. cuBLAS keeps a workspace
    for every stream it has run on (the default one, the layer's side streams, the
    capture's warm-up stream) until the process exits: made before the first measured run,
    they are part of what every run's peak is counted above."""
    measure("nsa", 4096)


def compiled_layer_step(layer: torch.nn.Module, x: torch.Tensor, grad_out: torch.Tensor) -> Callable[[], None]:
    """One forward + backward through ``torch.compile(layer, fullgraph=True,
    mode="reduce-overhead")``.

    ``x`` is marked as a static address, as a model's activations inside its compiled graph
    are: otherwise the CUDA graph that replays the forward reads a copy of it that each step
    writes, 0.05 ms of both layers' steps at n = 8192 on an H100 and 0.4 ms at 65536 (a 512 MB
    float32 input), which the layer in a model does not have."""
    torch._dynamo.mark_static_address(x)
    compiled = torch.compile(layer, fullgraph=True, mode="reduce-overhead", dynamic=False)
    _, forward_backward = step_fns(compiled, x, grad_out)

    def step() -> None:
        torch.compiler.cudagraph_mark_step_begin()
        forward_backward()

    return step


def compiled_step(kind: str, n: int, profiled_steps: int = 0) -> tuple[float | None, dict[str, float]]:
    """Median time of forward + backward through ``torch.compile(layer, fullgraph=True,
    mode="reduce-overhead")`` (one graph each way, replayed from CUDA graphs once warm)
    and, over ``profiled_steps`` more steps under torch.profiler, the CUDA time per step
    of each kernel name (ms); (None, {}) when out of memory."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    layer = x = grad_out = None
    try:
        layer, x, grad_out = inputs(kind, n)
        step = compiled_layer_step(layer, x, grad_out)
        for _ in range(3):  # compile, warm up, record
            step()
        # A longer warm-up than the eager steps': right after compiling, the GPU, idle
        # meanwhile, ran a process's first compiled steps up to 2x slower (1.2 -> 2.35 ms at
        # n = 4096 on an H100) for longer than the default 25 ms.
        ms = median_ms(step, warmup=_COMPILED_WARMUP_MS)
        kernels: dict[str, float] = {}
        if profiled_steps:
            with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(profiled_steps):
                    step()
                torch.cuda.synchronize()
            for event in prof.key_averages():
                if event.device_time_total > 0:
                    kernels[event.key] = event.device_time_total / 1e3 / profiled_steps
        return ms, kernels
    except torch.OutOfMemoryError:
        return None, {}
    finally:
        del layer, x, grad_out
        torch._dynamo.reset()
        gc.collect()
        torch.cuda.empty_cache()


def paired_steps(kind: str, n: int) -> dict[str, Callable[[], None]]:
    """One forward + backward of a fresh ``kind`` layer at length ``n`` per paired mode:
    its ``replayed_step``, its ``compiled_layer_step`` and its ``graphed_layer_step``.
    Each mode has a layer, input and gradient of its own."""
    compiled = compiled_layer_step(*inputs(kind, n))
    for _ in range(3):  # compile, warm up, record
        compiled()
    return {"CUDA graph": replayed_step(*inputs(kind, n)), "torch.compile": compiled,
            "graphed layer": graphed_layer_step(*inputs(kind, n))}


@dataclass(frozen=True)
class ReplayedStep:
    """A forward + backward captured in a CUDA graph; calling it replays the graph.
    ``reads`` holds what the graph reads at fixed addresses without holding it (the
    layer, its input and the output gradient), so that their memory is not handed to a
    later allocation while the graph can replay."""

    graph: torch.cuda.CUDAGraph
    reads: tuple

    def __call__(self) -> None:
        self.graph.replay()


def replayed_step(layer: torch.nn.Module, x: torch.Tensor, grad_out: torch.Tensor) -> ReplayedStep:
    """The eager forward + backward of ``layer`` captured once in a CUDA graph."""
    graph, _ = capture(step_fns(layer, x, grad_out)[1])
    return ReplayedStep(graph, (layer, x, grad_out))


def graphed_layer_step(layer: torch.nn.Module, x: torch.Tensor, grad_out: torch.Tensor) -> Callable[[], None]:
    """An eager forward + backward of ``layer`` made a graphed callable by
    ``torch.cuda.make_graphed_callables``: the layer's forward and backward replay from
    CUDA graphs, the step around them runs eagerly. Captured under bf16 autocast, which
    must not cache its casts of the weights for that."""
    with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
        graphed = torch.cuda.make_graphed_callables(layer, (x,))

    def step() -> None:
        x.grad = None
        graphed.zero_grad(set_to_none=True)
        graphed(x).backward(grad_out)

    return step


def paired(n: int, rounds: int) -> dict[str, list[tuple[float, float]]]:
    """Per paired mode, ``rounds`` pairs (dense ms, NSA ms) of step medians, the two
    layers timed one after the other in each round (dense first in even rounds, NSA
    first in odd ones), all in this process."""
    steps = {kind: paired_steps(kind, n) for kind in ("dense", "nsa")}
    pairs: dict[str, list[tuple[float, float]]] = {mode: [] for mode in PAIRED_MODES}
    try:
        for kind_steps in steps.values():  # warm-up, as compiled_step's
            for step in kind_steps.values():
                median_ms(step, warmup=_COMPILED_WARMUP_MS)
        for round_index in range(rounds):
            order = ("dense", "nsa") if round_index % 2 == 0 else ("nsa", "dense")
            for mode in PAIRED_MODES:
                ms = {kind: median_ms(steps[kind][mode]) for kind in order}
                pairs[mode].append((ms["dense"], ms["nsa"]))
            print(f"n={n} round {round_index + 1}/{rounds}: " + ", ".join(
                f"{mode} dense {pairs[mode][-1][0]:.3f} NSA {pairs[mode][-1][1]:.3f} ms" for mode in PAIRED_MODES),
                flush=True)
    finally:
        del steps
        torch._dynamo.reset()
        gc.collect()
        torch.cuda.empty_cache()
    return pairs


def paired_targets(lengths) -> dict[int, float]:
    """The speed-up over the dense layer that the targets ask for at each of ``lengths``
    that has one: faster from 8192 on, 4x at 65536."""
    return {n: 4.0 if n == 65536 else 1.0 for n in lengths if n >= 8192}


def _spread(values: list[float], digits: int = 3, suffix: str = "") -> str:
    """``median (min - max)`` of ``values``."""
    return (f"{statistics.median(values):.{digits}f}{suffix} "
            f"({min(values):.{digits}f}{suffix} - {max(values):.{digits}f}{suffix})")


def paired_report(results: dict[int, dict[str, list[tuple[float, float]]]], figure: str | None = None) -> str:
    """The markdown section of ``paired``'s rounds at each length; ``figure``: the file
    name of its figure, beside the document."""
    rows = []
    for n, modes in results.items():
        for mode, pairs in modes.items():
            dense, nsa = [d for d, _ in pairs], [s for _, s in pairs]
            speedups = [d / s for d, s in pairs]
            rows.append([n, mode, len(pairs), sum(s > 1 for s in speedups), _spread(dense), _spread(nsa),
                         _spread(speedups, 3, "x")])
    return "\n".join([
        "### NSA and dense alternating (`benchmarks/bench_layer.py --paired`)",
        "",
        environment_line(),
        "",
        "The layers and steps of the table above, both layers' CUDA-graph and torch.compile steps "
        "and their graphed-layer steps (the layer through `torch.cuda.make_graphed_callables`, called "
        "from an eager step: what an eager training loop gets by graphing its attention layers) "
        "built in one process and timed one after the other, round after round (each time a median of "
        "CUDA-event timings, as above), so that the GPU's clock and power state drift alike for both. "
        "Speed-up: the dense step's time over the NSA step's in the same round.",
        "",
        markdown_table(["n", "steps", "rounds", "rounds NSA ahead", "dense ms, median (min - max)",
                        "NSA ms, median (min - max)", "speed-up, median (min - max)"], rows),
    ] + ([] if figure is None else
         ["", "![Each round's speed-up of the NSA layer over the dense one, by launch mode, with the "
              f"target]({figure})"]))


def profile(columns: dict[tuple[str, int], dict[str, float]], steps: dict[tuple[str, int], float | None],
            path: Path | None) -> str:
    """Report of ``compiled_step``'s kernel times: per step of both layers' compiled
    forward + backward at each profiled length (``columns[kind, n]``, step medians
    ``steps[kind, n]``), by group; the NSA layer's largest kernels at the last length."""
    grouped = [_grouped(kernels) for kernels in columns.values()]
    groups = sorted({group for column in grouped for group in column},
                    key=lambda group: -sum(column.get(group, 0.0) for column in grouped))
    header = ["kernels"] + [f"{'NSA' if kind == 'nsa' else 'dense'}, n = {n}" for kind, n in columns]
    rows = [[group] + [_fmt(column.get(group)) for column in grouped] for group in groups]
    rows.append(["all kernels"] + [_fmt(sum(kernels.values()) if kernels else None) for kernels in columns.values()])
    rows.append(["step (CUDA events, median)"] + [_fmt(steps[key]) for key in columns])
    last = max(n for _, n in columns)
    nsa_kernels = columns["nsa", last]
    top_rows = []
    for name, ms in sorted(nsa_kernels.items(), key=lambda item: -item[1])[:8]:
        resources = _triton_resources(name)
        top_rows.append([f"`{name[:60]}`", kernel_group(name).split(" (")[0], f"{ms:.2f}",
                         *(("-", "-") if resources is None else resources)])
    summary = ("Where the time goes: CUDA kernel time per compiled forward + backward (torch.profiler over "
               f"{PROFILED_STEPS} torch.compile steps, ms), by kernel group. A step's median from CUDA events, a separate "
               "run, also holds the gaps between its kernels, less the time of the backward's kernels that "
               "run side by side on their streams.\n\n"
               + markdown_table(header, rows)
               + f"\n\nThe NSA layer's largest kernels at n = {last} (registers per thread and bytes spilled to "
               "local memory: the most over the Triton kernel's compiled variants):\n\n"
               + markdown_table(["kernel", "group", "ms", "registers", "spilled bytes"], top_rows))
    if path is not None:
        listing = [summary]
        for (kind, n), kernels in columns.items():
            listing += ["", f"{kind}, n = {n}, ms per step:"]
            listing += [f"{ms:9.3f}  {name}" for name, ms in sorted(kernels.items(), key=lambda item: -item[1])]
        path.write_text("\n".join(listing) + "\n")
    return summary


def _grouped(kernels: dict[str, float]) -> dict[str, float]:
    groups: dict[str, float] = {}
    for name, ms in kernels.items():
        group = kernel_group(name)
        groups[group] = groups.get(group, 0.0) + ms
    return groups


def _kernel_names(module) -> set[str]:
    """Names of the Triton kernels a module defines, not those it imports (what the
    profiler reports). Compiled or interpreted (``TRITON_INTERPRET=1``), a kernel wraps
    its Python function as ``fn``."""
    from triton.runtime import KernelInterface

    return {name for name, value in vars(module).items()
            if isinstance(value, KernelInterface) and getattr(value, "fn", None) is not None
            and value.fn.__module__ == module.__name__}


def _triton_resources(name: str) -> tuple[int, int] | None:
    """Most registers per thread and most spilled bytes over the compiled variants of this
    package's Triton kernel ``name``; None for any other kernel. A kernel that spills runs
    several times slower (the compressed dK / dV kernel once went from 5.8 to 26 ms)."""
    from native_sparse_attention.kernels import compressed, gate_combine, rotary, selection, sliding_window

    for module in (compressed, selection, sliding_window, gate_combine, rotary):
        if name in _kernel_names(module):
            # Triton internals (3.6 to 3.9): without them the columns read "-", the run stands.
            try:
                compiled = [kernel for caches in getattr(module, name).device_caches.values()
                            for kernel in caches[0].values()]
                if compiled:
                    return max(k.n_regs for k in compiled), max(k.n_spills for k in compiled)
            except (AttributeError, IndexError, TypeError):
                return None
    return None


# Kernels that invert the selection for its dK / dV pass: the package's own and the
# sorts, searches and scans of torch.sort / torch.searchsorted / cumsum.
_INVERSION_KERNELS = ("_entry_keys_kernel", "_first_chunks_kernel", "_chunk_keys_kernel")
_INVERSION_MARKERS = ("radix", "RadixSort", "searchsorted", "DeviceScan", "fill_reverse_indices")


def kernel_group(name: str) -> str:
    from native_sparse_attention.kernels import compressed, gate_combine, selection, sliding_window

    if name in _INVERSION_KERNELS or any(marker in name for marker in _INVERSION_MARKERS):
        return "selection inversion for dK / dV (sorts, searches)"
    if any(marker in name for marker in ("cudnn", "fmha", "flash", "sdpa")):
        return "dense attention (SDPA)"
    # The window's forward tiles run inside the selection's forward kernel, so its time
    # counts as selected attention; the window's backward kernels are its own group.
    for group, module in (
        ("compressed attention + block selection (kernels/compressed.py)", compressed),
        ("selected attention fwd + bwd, sliding-window forward (kernels/selection.py)", selection),
        ("sliding-window backward (kernels/sliding_window.py)", sliding_window),
        ("gate combination (kernels/gate_combine.py)", gate_combine),
    ):
        if name in _kernel_names(module):
            return group
    if any(key in name for key in ("gemm", "cutlass", "nvjet", "xmma", "cublas")):
        return "matmuls (projections, compression MLPs)"
    return "elementwise, reductions, copies (rotary, norms, casts, ...)"


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def report(results: dict[int, dict[str, Measurement]], profile_summary: str | None,
           figure: str | None = None) -> str:
    """The markdown section; ``figure``: the file name of the section's figure, beside the
    document."""
    header = ["n", "dense fwd ms", "dense fwd+bwd ms", "dense peak GiB", "NSA fwd ms",
              "NSA fwd+bwd ms", "NSA peak GiB", "fwd+bwd speed-up", "peak ratio",
              "CUDA graph fwd+bwd ms, dense / NSA", "speed-up, CUDA graph",
              "torch.compile fwd+bwd ms, dense / NSA", "speed-up, torch.compile"]
    rows = []
    for n, pair in results.items():
        dense, nsa = pair["dense"], pair["nsa"]
        speedup, ratio, graph_speedup, compiled_speedup = (
            _ratio(pair, attr) for attr in ("step_ms", "peak_gib", "graph_step_ms", "compiled_step_ms"))
        rows.append([
            n,
            dense.error or _fmt(dense.fwd_ms), dense.error or _fmt(dense.step_ms), dense.error or _fmt(dense.peak_gib),
            nsa.error or _fmt(nsa.fwd_ms), nsa.error or _fmt(nsa.step_ms), nsa.error or _fmt(nsa.peak_gib),
            "-" if speedup is None else f"{speedup:.2f}x", _fmt(ratio),
            f"{_fmt(dense.graph_step_ms)} / {_fmt(nsa.graph_step_ms)}",
            "-" if graph_speedup is None else f"{graph_speedup:.2f}x",
            f"{_fmt(dense.compiled_step_ms)} / {_fmt(nsa.compiled_step_ms)}",
            "-" if compiled_speedup is None else f"{compiled_speedup:.2f}x",
        ])
    lines = [
        "## Layer: NSA vs dense attention (`benchmarks/bench_layer.py`)",
        "",
        environment_line(),
        "",
        "dim 2048, 32 query heads, 2 kv heads, head dim 64, sliding window 512, compression 32 / "
        "stride 16, selection blocks 64, 16 selected, causal, bf16 autocast, batch 1. NSA: "
        "`SparseAttention(use_triton_kernel=True)`; dense: `FullAttention` (SDPA; its input normed "
        "by the same RMSNorm node as NSA's in eager steps). Medians of "
        "CUDA-event timings; fwd is a training forward (autograd on); peak is "
        "`torch.cuda.max_memory_allocated` over one forward + backward, less what the process held "
        "before the layer was built (input (fp32, requires grad) and weights included, cuBLAS's "
        "workspaces not). CUDA graph: the eager step captured once "
        "(`native_sparse_attention.cuda_graph.capture`) and replayed; torch.compile: "
        "`torch.compile(layer, fullgraph=True, mode=\"reduce-overhead\")`, whose graphs hold the "
        "kernels as custom operators and replay from CUDA graphs (the input marked as a static "
        "address, as a model's activations are inside its graph, so that no replay copies it). Eager "
        "steps of short sequences are bound by the host's Python and launch time, which varies by 20% "
        "and more between "
        "machines of the same type; the CUDA graph and torch.compile columns do not depend on it.",
        "",
        markdown_table(header, rows),
        "",
        "Targets: " + "; ".join(_targets(results)) + ".",
    ]
    if figure:
        lines += ["", f"![Speed-up and peak memory of the NSA layer against the dense layer by sequence length, "
                      f"with the targets; the kernel time of both layers by group at the profiled lengths]({figure})"]
    if profile_summary:
        lines += ["", profile_summary]
    lines += [
        "",
        "For context, the figures the issue measured on an H100 (torch 2.11, triton 3.6) for the "
        "dense layer and the popular `native-sparse-attention-pytorch` package's layer "
        "(fwd / fwd+bwd ms, peak GB):",
        "",
        markdown_table(
            ["n", "dense SDPA layer", "popular package, Triton selection", "popular package, PyTorch path"],
            [[n, " / ".join(map(str, ISSUE_DENSE[n][:2])) + f", {ISSUE_DENSE[n][2]}",
              " / ".join(map(str, ISSUE_POPULAR_TRITON[n][:2])) + f", {ISSUE_POPULAR_TRITON[n][2]}",
              " / ".join(ISSUE_POPULAR_PYTORCH[n][:2]) + (f", {ISSUE_POPULAR_PYTORCH[n][2]}" if ISSUE_POPULAR_PYTORCH[n][2] else "")]
             for n in ISSUE_DENSE],
        ),
    ]
    return "\n".join(lines)


def _ratio(pair: dict[str, Measurement], attr: str) -> float | None:
    """Dense time over NSA time (``*_ms``) or NSA memory over dense memory (``peak_gib``)."""
    dense, nsa = getattr(pair["dense"], attr), getattr(pair["nsa"], attr)
    if dense is None or nsa is None:
        return None
    return dense / nsa if attr.endswith("_ms") else nsa / dense


def _verdict(values: list, ok) -> str:
    if not values or any(value is None for value in values):
        return "not measured at every n"
    return "met" if all(ok(value) for value in values) else "MISSED"


# The step time of each launch mode, as the report's columns name them.
_MODES = (("eager", "step_ms"), ("CUDA graph", "graph_step_ms"), ("torch.compile", "compiled_step_ms"))


def _targets(results: dict[int, dict[str, Measurement]]) -> list[str]:
    """The issue's targets, the speed ones judged in each launch mode."""
    faster, at_64k = [], []
    for mode, attr in _MODES:
        speedups = {n: _ratio(pair, attr) for n, pair in results.items()}
        verdict = _verdict([s for n, s in speedups.items() if n >= 8192], lambda s: s > 1)
        shortest = min((n for n in speedups if n >= 8192), default=None)
        if shortest is not None and speedups[shortest] is not None:
            verdict += f" ({speedups[shortest]:.2f}x at {shortest})"
        faster.append(f"{mode} {verdict}")
        speedup = speedups.get(65536)
        at_64k.append(f"{mode} " + _verdict([speedup] if 65536 in speedups else [], lambda s: s >= 4)
                      + ("" if speedup is None else f" ({speedup:.2f}x)"))
    peaks = [_ratio(pair, "peak_gib") for pair in results.values()]
    return [
        "fwd+bwd faster than dense from 8k on: " + ", ".join(faster),
        ">= 4x faster at 64k: " + ", ".join(at_64k),
        "peak memory <= 2x dense at every n: " + _verdict(peaks, lambda r: r <= 2),
    ]


def main() -> None:
    parser = benchmark_arguments(__doc__)
    parser.add_argument("--seq-lens", type=int, nargs="+", default=list(SEQ_LENS))
    parser.add_argument("--profile", type=int, nargs="+", default=None,
                        help="also profile both layers' compiled steps at these lengths")
    parser.add_argument("--profile-out", type=Path, default=None, help="file for every kernel's time")
    parser.add_argument("--paired", type=int, nargs="+", default=None, metavar="N",
                        help="instead of the table: time both layers' replayed and compiled steps alternately "
                             "at these lengths (section \"layer-paired\")")
    parser.add_argument("--rounds", type=int, default=10, help="rounds of --paired (default 10)")
    args = parser.parse_args()
    require_cuda(parser)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.paired:
        rounds = {n: paired(n, args.rounds) for n in args.paired}
        figure = None if args.no_write else write_figure(
            lambda: paired_figure(rounds, paired_targets(rounds)), PAIRED_FIGURE)
        section = paired_report(rounds, figure and figure.name)
        print(section)
        if not args.no_write:
            write_section("layer-paired", section)
        return

    make_workspaces()
    results = {}
    for n in args.seq_lens:
        results[n] = {kind: measure(kind, n) for kind in ("dense", "nsa")}
        dense, nsa = results[n]["dense"], results[n]["nsa"]
        print(f"n={n}: dense {dense}, nsa {nsa}", flush=True)
    # Compiled runs come last: run between the eager ones, they lowered the peaks measured
    # after them (both layers', by up to 0.6 GiB). The profiled lengths' runs also time
    # their kernels.
    profiled = sorted(set(args.profile or ()))
    columns, steps = {}, {}
    for n in sorted(set(args.seq_lens) | set(profiled)):
        for kind in ("nsa", "dense"):
            ms, kernels = compiled_step(kind, n, PROFILED_STEPS if n in profiled else 0)
            if n in results:
                results[n][kind].compiled_step_ms = ms
            if n in profiled:
                columns[kind, n], steps[kind, n] = kernels, ms
            print(f"n={n}: {kind} torch.compile fwd+bwd {_fmt(ms)} ms", flush=True)
    profile_summary = profile(columns, steps, args.profile_out) if profiled else None
    print(report(results, profile_summary))
    if not args.no_write:
        figure = write_figure(lambda: layer_figure(*figure_data(results, columns)), FIGURE)
        write_section("layer", report(results, profile_summary, figure and figure.name))


def figure_data(results: dict[int, dict[str, Measurement]], columns: dict[tuple[str, int], dict[str, float]]):
    """``benchmarks.figures.layer_figure``'s arguments: speed-ups per launch mode, peak
    ratios, and the profiled lengths' kernel time by group."""
    speedups = {mode: {n: _ratio(pair, attr) for n, pair in results.items()} for mode, attr in _MODES}
    peak_ratios = {n: _ratio(pair, "peak_gib") for n, pair in results.items()}
    breakdown: dict[int, dict[str, dict[str, float]]] = {}
    for n in sorted({n for _, n in columns}):
        for kind, label in (("nsa", "NSA"), ("dense", "dense")):  # NSA first: the figure's top bar
            if columns.get((kind, n)):
                breakdown.setdefault(n, {})[label] = _grouped(columns[kind, n])
    return speedups, peak_ratios, breakdown


if __name__ == "__main__":
    main()
