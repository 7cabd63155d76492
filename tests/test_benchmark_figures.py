"""The benchmark scripts' figures, reports and step bookkeeping, from made-up measurements (no GPU)."""

from __future__ import annotations

import pytest

pytest.importorskip("matplotlib")

from benchmarks.bench_layer import FIGURE, Measurement, figure_data, report  # noqa: E402
from benchmarks.figures import layer_figure, selection_figure  # noqa: E402
from benchmarks.report import write_figure  # noqa: E402

MATMUL = "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT"
SDPA = "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x64_1x4x1_cga1x1x1_kernel0_0"


def _results() -> dict[int, dict[str, Measurement]]:
    """Three lengths; the CUDA graph run of the longest failed (None), as after an OOM."""
    return {
        4096: {"dense": Measurement(1.0, 2.0, 2.0, 2.0, 1.0), "nsa": Measurement(2.0, 4.0, 4.0, 5.0, 1.5)},
        8192: {"dense": Measurement(2.0, 6.0, 6.0, 6.0, 2.0), "nsa": Measurement(2.0, 5.0, 4.0, 4.0, 2.4)},
        65536: {"dense": Measurement(40.0, 160.0, None, 150.0, 4.0), "nsa": Measurement(10.0, 40.0, 41.0, 37.5, 4.4)},
    }


def _columns() -> dict[tuple[str, int], dict[str, float]]:
    return {
        ("nsa", 8192): {"_fwd_kernel": 0.6, "_dq_kernel": 0.5, MATMUL: 0.7},
        ("dense", 8192): {SDPA: 2.5, MATMUL: 0.6},
    }


def _lines(axes) -> dict[str, tuple[list, list]]:
    return {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in axes.get_lines()}


def test_figure_data_ratios_and_groups():
    speedups, peak_ratios, breakdown = figure_data(_results(), _columns())
    assert speedups["eager"] == {4096: 0.5, 8192: 1.2, 65536: 4.0}
    assert speedups["CUDA graph"][65536] is None
    assert speedups["torch.compile"] == {4096: 0.4, 8192: 1.5, 65536: 4.0}
    assert peak_ratios == pytest.approx({4096: 1.5, 8192: 1.2, 65536: 1.1})
    assert list(breakdown) == [8192]
    assert list(breakdown[8192]) == ["NSA", "dense"]  # NSA first: the figure's top bar
    nsa, dense = breakdown[8192]["NSA"], breakdown[8192]["dense"]
    assert nsa == pytest.approx({
        "selected attention fwd + bwd, sliding-window forward (kernels/selection.py)": 1.1,
        "matmuls (projections, compression MLPs)": 0.7,
    })
    assert dense == pytest.approx({"dense attention (SDPA)": 2.5, "matmuls (projections, compression MLPs)": 0.6})


def test_layer_figure_plots_every_measured_point_and_the_targets():
    figure = layer_figure(*figure_data(_results(), _columns()))
    speedup_axes, memory_axes, breakdown_axes = figure.axes
    lines = _lines(speedup_axes)
    assert lines["eager"] == ([4096, 8192, 65536], [0.5, 1.2, 4.0])
    assert lines["CUDA graph"] == ([4096, 8192], [0.5, 1.5])  # the failed run is left out
    assert lines["target: 4x at 64k"] == ([65536], [4.0])
    target_line = [c for c in speedup_axes.collections if c.get_label().startswith("target: faster")]
    assert len(target_line) == 1
    (start, level), (end, _) = target_line[0].get_segments()[0]
    assert (start, level, end) == (8192, 1.0, 65536)
    memory = _lines(memory_axes)
    assert memory["NSA peak / dense peak"][1] == pytest.approx([1.5, 1.2, 1.1])
    assert memory["limit: 2x"][1] == [2, 2]
    # One stacked bar per layer, its segments adding up to the layer's kernel time.
    widths: dict[float, float] = {}
    for bar in breakdown_axes.patches:
        y = round(bar.get_y() + bar.get_height() / 2)
        widths[y] = widths.get(y, 0.0) + bar.get_width()
    assert widths == pytest.approx({1: 1.8, 0: 3.1})  # NSA on top (y = 1)
    assert [label.get_text() for label in breakdown_axes.get_yticklabels()] == ["dense", "NSA"]
    assert len(figure.legends) == 1 and len(figure.legends[0].get_texts()) == 3  # kernel groups


def test_layer_figure_without_a_profile_has_only_the_top_row():
    figure = layer_figure(*figure_data(_results(), {}))
    assert len(figure.axes) == 2


def test_report_links_the_figure_only_when_drawn(tmp_path):
    results = _results()
    assert "](layer_benchmark.png)" in report(results, None, figure=FIGURE.name)
    assert "![" not in report(results, None)
    path = write_figure(lambda: layer_figure(*figure_data(results, _columns())), tmp_path / FIGURE.name)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in tmp_path.iterdir()] == [FIGURE.name]  # no temporary file left


def test_write_figure_leaves_nothing_when_drawing_fails(tmp_path):
    def draw():
        raise RuntimeError("no data")

    with pytest.raises(RuntimeError, match="no data"):
        write_figure(draw, tmp_path / "figure.png")
    assert list(tmp_path.iterdir()) == []


def _selection_rows() -> list[dict]:
    """Config A at three lengths (the reference and cuDNN missing at the longest), B at one."""
    return [
        dict(config="A", n=1024, fwd_bwd=1.4, flash=(0.1, 0.4), cudnn=(0.05, 0.25), reference=(4.3, 8.9), gather=0.15),
        dict(config="A", n=8192, fwd_bwd=6.1, flash=(3.3, 12.7), cudnn=(1.9, 7.7), reference=(20.0, 41.0),
             gather=1.65),
        dict(config="A", n=32768, fwd_bwd=25.2, flash=(50.6, 189.2), cudnn=None, reference=None, gather=7.96),
        dict(config="B", n=32768, fwd_bwd=9.6, flash=(7.2, 26.9), cudnn=(4.9, 17.8), reference=None, gather=3.71),
    ]


def test_selection_figure_one_panel_per_config_with_each_measured_time():
    figure = selection_figure(_selection_rows(), {"A": "64 on 4, d = 128", "B": "16 on 4, d = 64", "C": "unmeasured"})
    panel_a, panel_b = figure.axes  # C has no rows: no panel
    assert panel_a.get_title() == "A: 64 on 4, d = 128"
    lines = _lines(panel_a)
    assert lines["NSA selection kernel"] == ([1024, 8192, 32768], [1.4, 6.1, 25.2])
    assert lines["SDPA flash (dense causal)"] == ([1024, 8192, 32768], [0.4, 12.7, 189.2])
    assert lines["SDPA cuDNN (dense causal)"] == ([1024, 8192], [0.25, 7.7])
    assert lines["PyTorch reference"] == ([1024, 8192], [8.9, 41.0])
    assert lines["2 x K/V gather floor (query-side passes)"][1] == pytest.approx([0.3, 3.3, 15.92])
    assert panel_a.get_yscale() == "log"
    assert _lines(panel_b)["NSA selection kernel"] == ([32768], [9.6])


def test_paired_report_counts_the_rounds_each_layer_led():
    from benchmarks.bench_layer import paired_report

    section = paired_report({8192: {"torch.compile": [(3.4, 3.2), (3.3, 3.5), (3.6, 3.0)]}})
    row = next(line for line in section.splitlines() if line.startswith("| 8192"))
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells[:4] == ["8192", "torch.compile", "3", "2"]
    assert cells[4] == "3.400 (3.300 - 3.600)"
    assert cells[5] == "3.200 (3.000 - 3.500)"
    assert cells[6] == "1.062x (0.943x - 1.200x)"


def test_paired_figure_draws_each_round_and_the_targets(tmp_path):
    from benchmarks.bench_layer import paired_report, paired_targets
    from benchmarks.figures import paired_figure

    rounds = {
        4096: {"torch.compile": [(1.2, 1.7)]},
        8192: {"CUDA graph": [(3.3, 3.3), (3.4, 3.2)], "torch.compile": [(3.4, 3.2), (3.3, 3.3)]},
        65536: {"torch.compile": [(148.0, 37.0), (150.0, 36.0), (146.0, 37.0)]},
    }
    targets = paired_targets(rounds)
    assert targets == {8192: 1.0, 65536: 4.0}
    figure = paired_figure(rounds, targets)
    short, middle, long = figure.axes
    assert "target: 1x" not in _lines(short) and len(_lines(short)) == 1
    assert _lines(middle)["torch.compile"][0] == [1, 2]
    assert _lines(middle)["torch.compile"][1] == pytest.approx([3.4 / 3.2, 1.0])
    assert _lines(middle)["target: 1x"][1] == [1.0, 1.0]
    assert _lines(long)["torch.compile"][1] == pytest.approx([4.0, 150.0 / 36.0, 146.0 / 37.0])
    assert _lines(long)["target: 4x"][1] == [4.0, 4.0]
    assert "](layer_paired.png)" in paired_report(rounds, "layer_paired.png")
    assert "![" not in paired_report(rounds)


def test_replayed_step_holds_what_its_graph_reads(monkeypatch):
    """A CUDA graph reads the layer's weights, input and output gradient at the addresses
    they had at capture without holding them: freed, their memory would go to the next
    allocation and the replays would time garbage. The replayed step holds them."""
    import gc
    import weakref
    from types import SimpleNamespace

    import torch

    from benchmarks import bench_layer

    monkeypatch.setattr(bench_layer, "capture", lambda step: (SimpleNamespace(replay=lambda: None), None))
    layer, x, grad_out = torch.nn.Linear(4, 4), torch.randn(2, 4, requires_grad=True), torch.randn(2, 4)
    refs = [weakref.ref(obj) for obj in (layer, x, grad_out)]
    step = bench_layer.replayed_step(layer, x, grad_out)
    del layer, x, grad_out
    gc.collect()
    assert all(ref() is not None for ref in refs)
    step()
    del step
    gc.collect()
    assert all(ref() is None for ref in refs)


def test_train_runs_table_gives_each_runs_launch_and_command(tmp_path):
    import json

    from benchmarks.bench_train import runs_table

    for name, settings, graphed in (("sparse", {"attn": "sparse"}, True),
                                    ("full", {"attn": "full", "cuda_graph": False, "compile": True}, False)):
        run_dir = tmp_path / name
        run_dir.mkdir()
        config = {"preset": "enwik8", "steps": 200, "cuda_graph": None, **settings,
                  "run": {"attention_backend": "triton" if name == "sparse" else None, "cuda_graph": graphed,
                          "corpus": "stdlib", "corpus_bytes": 10_700_000, "num_parameters": 31_100_000}}
        (run_dir / "config.json").write_text(json.dumps(config))
        records = [{"step": 1, "loss": 5.0, "tokens_per_s": 10.0}, {"step": 2, "loss": 4.0, "tokens_per_s": 700.0,
                                                                     "val_bpb": 3.0}]
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    table, step = runs_table([tmp_path / "sparse", tmp_path / "full"])
    assert step == 2
    assert "| sparse | sparse (triton) | CUDA graph | 31.1M | stdlib (10.7 MB) | 2 | 3.0000 | 700 |" in table
    assert "| full | full | eager |" in table
    assert "- sparse: `python train.py --preset enwik8 --steps 200`" in table
    assert "- full: `python train.py --preset enwik8 --attn full --steps 200 --compile --no-cuda-graph`" in table


def _config_results():
    """Two configurations; the wider one's longest NSA run was out of memory and it was
    not profiled."""
    from benchmarks.bench_layer import Heads
    from benchmarks.bench_layer_configs import ConfigResult

    narrow = ConfigResult(Heads(), kernels_ms=40.0, selection_ms=10.0)
    narrow.lengths = {
        8192: {"dense": Measurement(1.0, 3.3, 3.2, None, 0.9), "nsa": Measurement(2.0, 6.0, 3.2, None, 1.0)},
        65536: {"dense": Measurement(40.0, 150.0, 148.0, None, 4.8), "nsa": Measurement(10.0, 37.0, 37.0, None, 5.5)},
    }
    wide = ConfigResult(Heads(dim=4096, heads=32, kv_heads=8, dim_head=128))
    wide.lengths = {
        8192: {"dense": Measurement(2.0, 7.5, 7.2, None, 1.4), "nsa": Measurement(6.0, 15.6, 14.4, None, 2.1)},
        65536: {"dense": Measurement(65.0, 250.0, 250.0, None, 9.3), "nsa": Measurement(error="OOM")},
    }
    return [narrow, wide]


def test_configs_report_gives_each_config_and_length_its_row():
    from benchmarks.bench_layer_configs import report

    section = report(_config_results(), figure="layer_configs.png")
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in section.splitlines()
            if line.startswith("| 32q")]
    assert rows[0] == ["32q / 2kv, d 64, dim 2048", "16", "8192", "3.20 / 3.20", "1.00x", "3.30 / 6.00",
                       "0.55x", "0.90 / 1.00"]
    assert rows[1][2:5] == ["65536", "148.00 / 37.00", "4.00x"]
    assert rows[2][:5] == ["32q / 8kv, d 128, dim 4096", "4", "8192", "7.20 / 14.40", "0.50x"]
    assert rows[3][3:] == ["250.00 / OOM", "-", "250.00 / OOM", "-", "9.30 / OOM"]
    # The query-side table: 2 * kv_heads * 17 blocks * 64 tokens * d * 2 bytes per token.
    assert rows[4] == ["32q / 2kv, d 64, dim 2048", "0.53", "10.00", "40.00", "25"]
    assert rows[5] == ["32q / 8kv, d 128, dim 4096", "4.25", "-", "-", "-"]
    assert "![" in section and "(layer_configs.png)" in section
    assert "![" not in report(_config_results())


def test_configs_figure_one_line_per_config_without_failed_points():
    from benchmarks.bench_layer_configs import speedups
    from benchmarks.figures import configs_figure

    figure = configs_figure(speedups(_config_results()))
    lines = _lines(figure.axes[0])
    assert lines["32q / 2kv, d 64, dim 2048"] == ([8192, 65536], [1.0, 4.0])
    assert lines["32q / 8kv, d 128, dim 4096"] == ([8192], [0.5])
    assert "level with dense" in lines


def _decode_results():
    """Two lengths; each kind's wall and GPU ms grow with the cached tokens."""
    from benchmarks.bench_decode import KINDS, DecodeTiming

    return {n: {kind: DecodeTiming(wall_ms=(index + 1) * scale, gpu_ms=(index + 1) * scale / 10, kernels=16 + index)
                for index, kind in enumerate(KINDS)}
            for n, scale in ((4096, 1.0), (65536, 2.0))}


def test_decode_figure_plots_replayed_gpu_time_and_every_wall_time(tmp_path):
    from benchmarks.bench_decode import figure_data, figure_path
    from benchmarks.figures import decode_figure

    figure = decode_figure(*figure_data(_decode_results()), "token")
    gpu_axes, wall_axes = figure.axes
    gpu = _lines(gpu_axes)
    assert list(gpu) == ["dense, CUDA graph", "NSA, CUDA graph", "NSA, bf16 layer, CUDA graph"]
    assert gpu["NSA, CUDA graph"] == ([4096, 65536], pytest.approx([0.4, 0.8]))
    wall = _lines(wall_axes)
    assert wall["dense"] == ([4096, 65536], pytest.approx([1.0, 2.0]))
    assert len(wall) == 5 and wall_axes.get_yscale() == "log"
    assert gpu_axes.get_ylabel() == "ms / token"
    colors = [{line.get_label(): line.get_color() for line in axes.get_lines()} for axes in (gpu_axes, wall_axes)]
    assert all(colors[1][label] == color for label, color in colors[0].items())  # a series keeps its color
    assert figure_path(1).name == "decode.png" and figure_path(8).name == "decode_batch8.png"


def test_decode_report_links_the_figure_only_when_drawn():
    from benchmarks.bench_decode import report

    assert "](decode_batch8.png)" in report(_decode_results(), 8, figure="decode_batch8.png")
    assert "![" not in report(_decode_results(), 1)


def test_deterministic_report_alternates_the_modes_and_compares_them(monkeypatch):
    from benchmarks import bench_deterministic

    calls = []

    def fake_measure_once(heads, n, mode):
        calls.append(mode)
        ms = {"default": 4.0, "deterministic": 5.0}[mode] + len(calls) / 100
        return {"ms": ms, "peak": 1.0 if mode == "default" else 1.25, "same": mode == "deterministic"}

    monkeypatch.setattr(bench_deterministic, "measure_once", fake_measure_once)
    modes = bench_deterministic.measure(bench_deterministic.CONFIGS["32 on 2 kv heads"], 8192, rounds=3)
    assert calls == ["default", "deterministic", "deterministic", "default", "default", "deterministic"]
    assert modes["default"]["ms"] == pytest.approx(4.04) and modes["deterministic"]["ms"] == pytest.approx(5.03)
    section = bench_deterministic.report({("32 on 2 kv heads", 8192): modes})
    row = next(line for line in section.splitlines() if line.startswith("| 32 on 2"))
    assert row.split(" | ")[1:] == ["8192", "4.04", "5.03", "1.25x", "1.00", "1.25", "no", "yes |"]
    assert "3 rounds" in section
