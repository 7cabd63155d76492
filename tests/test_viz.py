"""Recording, plotting helpers, CLI and notebook of native_sparse_attention.viz (CPU)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("matplotlib")

from matplotlib.figure import Figure  # noqa: E402

from native_sparse_attention import viz  # noqa: E402
from native_sparse_attention.sparse_attention import SparseAttention  # noqa: E402
from native_sparse_attention.transformer import Transformer  # noqa: E402
from run_checkpoints import save_checkpoint  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = REPO_ROOT / "notebooks" / "visualize_selected_blocks.ipynb"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

HEADS, KV_HEADS, SEQ_LEN, DIM = 4, 2, 70, 32
ATTN_KWARGS = dict(
    sliding_window_size=24,
    compress_block_size=16,
    compress_block_sliding_stride=8,
    selection_block_size=16,
    num_selected_blocks=2,
)


def make_layer(share_selection: bool = True, causal: bool = True) -> SparseAttention:
    torch.manual_seed(0)
    layer = SparseAttention(dim=DIM, dim_head=8, heads=HEADS, kv_heads=KV_HEADS, causal=causal,
                            query_heads_share_selected_kv=share_selection, **ATTN_KWARGS)
    # Random gate weights, so the gates vary along the sequence as in a trained layer.
    torch.nn.init.normal_(layer.to_gates[0].weight, std=0.5)
    return layer


def make_model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(num_tokens=256, dim=DIM, depth=2, heads=HEADS, dim_head=8, kv_heads=KV_HEADS,
                       sparse_attn_kwargs=ATTN_KWARGS)


def layer_input() -> torch.Tensor:
    return torch.randn(2, SEQ_LEN, DIM, generator=torch.Generator().manual_seed(1))


def data_axes(fig: Figure):
    return [ax for ax in fig.axes if ax.get_label() != "<colorbar>"]


def colorbars(fig: Figure):
    return [ax for ax in fig.axes if ax.get_label() == "<colorbar>"]


# ---------------------------------------------------------------------------- recording


@pytest.mark.parametrize("share_selection", [True, False])
def test_recording_leaves_layer_output_bit_identical(share_selection):
    layer, x = make_layer(share_selection), layer_input()
    expected = layer(x)
    with viz.record(layer) as recorders:
        recorded = layer(x)
    assert torch.equal(recorded, expected)
    assert recorders[0]["gates"].shape == (3, 2, HEADS, SEQ_LEN)
    assert layer.recorder is None


def test_recording_leaves_model_output_and_gradients_bit_identical():
    model, ids = make_model(), torch.randint(0, 256, (2, SEQ_LEN), generator=torch.Generator().manual_seed(2))
    loss = model(ids, return_loss=True)
    loss.backward()
    expected_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with viz.record(model) as recorders:
        recorded_loss = model(ids, return_loss=True)
        recorded_loss.backward()
    assert torch.equal(recorded_loss, loss)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), expected_grads))
    assert len(recorders) == 2 and all("selected_indices" in r for r in recorders)
    assert all(layer.recorder is None for layer in viz.sparse_attention_layers(model))


def test_without_recording_the_layer_does_no_recording_work(monkeypatch):
    def refuse(self, **tensors):
        raise AssertionError("recorded although recording is off")

    monkeypatch.setattr(SparseAttention, "_record", refuse)
    layer = make_layer()
    layer(layer_input())
    with pytest.raises(AssertionError, match="recording is off"), viz.record(layer):
        layer(layer_input())


def test_record_restores_recorders_after_an_error():
    layer = make_layer()
    with pytest.raises(ValueError), viz.record(layer):
        layer(torch.zeros(1, SEQ_LEN, DIM + 1))
    assert layer.recorder is None


def test_record_rejects_a_model_without_sparse_attention():
    with pytest.raises(ValueError, match="no SparseAttention"):
        with viz.record(torch.nn.Linear(2, 2)):
            pass


def test_record_forward_takes_one_sequence_of_one_layer():
    model, ids = make_model(), torch.randint(0, 256, (2, SEQ_LEN))
    labels = viz.byte_labels(ids[1])
    rec = viz.record_forward(model, ids, layer=1, batch_index=1, tokens=labels)
    num_blocks = -(-SEQ_LEN // ATTN_KWARGS["selection_block_size"])
    assert rec.compressed_probs.shape == (HEADS, SEQ_LEN, 1 + (SEQ_LEN - 16) // 8 + 1)
    assert rec.block_scores.shape == (KV_HEADS, SEQ_LEN, num_blocks)
    assert rec.selected_indices.shape == rec.selected_mask.shape == (KV_HEADS, SEQ_LEN, 2)
    assert rec.gates.shape == (3, HEADS, SEQ_LEN)
    assert rec.tokens == tuple(labels)
    with pytest.raises(ValueError, match="layer must be in"):
        viz.record_forward(model, ids, layer=2)
    with pytest.raises(ValueError, match="batch_index"):
        viz.record_forward(model, ids, batch_index=2)


def test_selection_categories_match_the_recorded_selection():
    rec = viz.record_forward(make_layer(), layer_input())
    grid = rec.selection_categories(0)
    positions = torch.arange(SEQ_LEN)
    assert (grid[positions, positions // 16] == 3).all(), "own block on the block-causal diagonal"
    chosen = rec.selected_indices[0][rec.selected_mask[0]]
    assert (grid == 2).sum() == len(chosen)
    assert not rec.selectable()[:15].any(), "no compressed block is complete before token 15"


def test_byte_labels_keep_one_printable_character_per_byte():
    ids = viz.encode_text("a b\né")
    assert viz.byte_labels(ids) == ["a", "·", "b", "↵", "?", "?"]
    with pytest.raises(ValueError, match="non-empty"):
        viz.encode_text("")


# ---------------------------------------------------------------------------- plots

SELECTION_PLOTS = [viz.plot_selection_map, viz.plot_block_scores]
PER_HEAD_PLOTS = [viz.plot_gates, viz.plot_compressed_attention]
EXPECTED_LABELS = {
    viz.plot_selection_map: ("key block (16 tokens each)", "query position"),
    viz.plot_block_scores: ("key block (16 tokens each)", "query position"),
    viz.plot_gates: ("query position", "gate value"),
    viz.plot_compressed_attention: ("compressed key (memory, then window c)", "query position"),
}
EXPECTED_COLORBARS = {viz.plot_selection_map: 0, viz.plot_block_scores: 1, viz.plot_gates: 0,
                      viz.plot_compressed_attention: 1}


@pytest.fixture(scope="module")
def shared_record():
    ids = torch.randint(0, 256, (1, SEQ_LEN), generator=torch.Generator().manual_seed(3))
    return viz.record_forward(make_model(), ids, tokens=viz.byte_labels(ids[0]))


@pytest.mark.parametrize("plot", SELECTION_PLOTS + PER_HEAD_PLOTS, ids=lambda f: f.__name__)
def test_plot_draws_one_labelled_panel_per_head_or_group(plot, shared_record):
    fig = plot(shared_record)
    assert isinstance(fig, Figure)
    axes = data_axes(fig)
    if plot in SELECTION_PLOTS:
        assert [ax.get_title() for ax in axes] == ["GQA group 0 (query heads 0–1)", "GQA group 1 (query heads 2–3)"]
    else:
        assert [ax.get_title() for ax in axes] == [f"head {h}" for h in range(HEADS)]
    xlabel, ylabel = EXPECTED_LABELS[plot]
    # Shared axes show their labels only on the outer panels.
    assert {ax.get_xlabel() for ax in axes} - {""} == {xlabel}
    assert {ax.get_ylabel() for ax in axes} - {""} == {ylabel}
    assert len(colorbars(fig)) == EXPECTED_COLORBARS[plot]
    assert fig.get_suptitle().startswith("NSA ")
    assert fig.legends, "every figure explains its colours or lines"


@pytest.mark.parametrize("plot", SELECTION_PLOTS + PER_HEAD_PLOTS, ids=lambda f: f.__name__)
def test_plot_with_a_head_draws_that_head_or_its_group(plot, shared_record):
    axes = data_axes(plot(shared_record, head=3))
    assert [ax.get_title() for ax in axes] == (
        ["GQA group 1 (query heads 2–3)"] if plot in SELECTION_PLOTS else ["head 3"]
    )


@pytest.mark.parametrize("plot", SELECTION_PLOTS, ids=lambda f: f.__name__)
def test_selection_plots_are_per_query_head_without_shared_selection(plot):
    fig = plot(make_layer(share_selection=False), layer_input())
    assert [ax.get_title() for ax in data_axes(fig)] == [f"head {h}" for h in range(HEADS)]


def test_selection_map_labels_key_blocks_with_their_text(shared_record):
    ax = data_axes(viz.plot_selection_map(shared_record, head=0))[0]
    labels = [tick.get_text() for tick in ax.get_xticklabels()]
    first_block = "".join(shared_record.tokens[:16])
    assert labels[0] == f"0 {first_block}"
    assert len(labels) == shared_record.num_blocks


def test_selection_map_overlays_the_sliding_window(shared_record):
    ax = data_axes(viz.plot_selection_map(shared_record, head=0))[0]
    first_edge, last_edge = (line.get_xdata() for line in ax.lines)
    positions = torch.arange(SEQ_LEN).numpy()
    window, size = ATTN_KWARGS["sliding_window_size"], ATTN_KWARGS["selection_block_size"]
    assert (first_edge == (positions - window).clip(min=0) / size).all()
    assert (last_edge == (positions + 1) / size).all(), "a causal window ends at the query itself"


def test_block_scores_mark_exactly_the_selected_cells(shared_record):
    ax = data_axes(viz.plot_block_scores(shared_record, head=0))[0]
    (marks,) = [c for c in ax.collections if c.get_segments()]
    marked_cells = sum(abs(seg[1, 1] - seg[0, 1]) for seg in marks.get_segments())
    assert marked_cells == (shared_record.selection_categories(0) == 2).sum() > 0


def test_block_scores_are_relative_to_each_querys_best_block_unless_asked_otherwise(shared_record):
    relative = data_axes(viz.plot_block_scores(shared_record, head=0))[0].images[0].get_array()
    absolute = data_axes(viz.plot_block_scores(shared_record, head=0, relative=False))[0].images[0].get_array()
    scores, selectable = shared_record.block_scores[0].numpy(), shared_record.selectable()
    assert (absolute.mask == ~selectable).all() and (absolute.compressed() == scores[selectable]).all()
    rows = selectable.any(axis=1)
    assert torch.allclose(torch.from_numpy(relative.max(axis=1).filled(0)[rows]), torch.ones(rows.sum()))
    with pytest.raises(TypeError, match="relative must be a bool"):
        viz.plot_block_scores(shared_record, relative="yes")


def test_short_text_labels_every_query_with_its_byte():
    ids = viz.encode_text("Sparse attentions read short texts.")
    rec = viz.record_forward(make_model(), ids[None], tokens=viz.byte_labels(ids))
    ax = data_axes(viz.plot_selection_map(rec, head=0))[0]
    labels = [tick.get_text() for tick in ax.get_yticklabels()]
    # Block starts (every 16 bytes) carry their position too; spaces show as '·'.
    assert labels[:3] == ["0 S", "p", "a"] and labels[6] == "·" and labels[16:18] == ["16 s", "·"]
    assert len(labels) == len(ids)
    gate_ax = data_axes(viz.plot_gates(rec, head=0))[0]
    assert [tick.get_text() for tick in gate_ax.get_xticklabels()][:2] == ["0 S", "p"]


def test_long_text_numbers_queries_on_block_boundaries(shared_record):
    ax = data_axes(viz.plot_compressed_attention(shared_record, head=0))[0]
    assert list(ax.get_yticks()) == [0, 16, 32, 48, 64]


def test_only_the_outer_panels_keep_tick_labels(shared_record):
    axes = data_axes(viz.plot_gates(shared_record))  # 4 heads: 2 × 2 panels
    assert [ax.xaxis.get_tick_params()["labelbottom"] for ax in axes] == [False, False, True, True]
    assert [ax.yaxis.get_tick_params()["labelleft"] for ax in axes] == [True, False, True, False]


def test_plots_accept_a_non_causal_layer():
    layer, x = make_layer(causal=False), layer_input()
    for plot in SELECTION_PLOTS + PER_HEAD_PLOTS:
        assert isinstance(plot(layer, x, head=0), Figure)


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda rec, layer: viz.plot_gates(rec, head=HEADS), ValueError, r"head must be in \[0, 4\)"),
        (lambda rec, layer: viz.plot_selection_map(rec, head=-1), ValueError, "head must be in"),
        (lambda rec, layer: viz.plot_block_scores(rec, head=1.0), TypeError, "head must be an int"),
        (lambda rec, layer: viz.plot_gates(layer), ValueError, "needs its input x"),
        (lambda rec, layer: viz.plot_gates(rec, layer_input()), ValueError, "pass x only with"),
        (lambda rec, layer: viz.plot_gates("not a layer"), TypeError, "AttentionRecord or a SparseAttention"),
    ],
)
def test_plots_reject_bad_input_with_clear_messages(call, error, message, shared_record):
    with pytest.raises(error, match=message):
        call(shared_record, make_layer())


def test_record_from_kernel_path_explains_what_is_missing():
    layer = make_layer()
    with pytest.raises(ValueError, match="use_triton_kernel and use_flex_attention off"):
        viz.AttentionRecord.from_layer(layer, {"gates": torch.zeros(3, 1, HEADS, SEQ_LEN)})


# ---------------------------------------------------------------------------- CLI


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_checkpoint(make_model(), tmp_path_factory.mktemp("run"), step=0)


def test_load_checkpoint_takes_a_file_or_the_latest_step_of_a_run(tmp_path):
    model, ids = make_model(), torch.randint(0, 256, (1, 20))
    save_checkpoint(model, tmp_path, step=9)
    with torch.no_grad():
        model.to_logits.weight.add_(1.0)
    latest = save_checkpoint(model, tmp_path, step=10)
    expected = model(ids)
    for path in (tmp_path, tmp_path / "checkpoints", latest):
        loaded = viz.load_checkpoint(path)
        assert not loaded.training
        assert torch.equal(loaded(ids), expected)
    assert not torch.equal(viz.load_checkpoint(tmp_path / "checkpoints" / "step-00000009.pt")(ids), expected)


def test_load_checkpoint_failures_are_one_line_value_errors(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "text.pt").write_text("not a checkpoint")
    model = make_model()
    torch.save({"model": model.state_dict(), "model_config": {**model.config, "depth": 3}}, tmp_path / "wrong.pt")
    cases = [
        (tmp_path / "missing.pt", "does not exist"),
        (tmp_path / "empty", "holds no checkpoint"),
        (tmp_path / "text.pt", "not a torch.save file"),
        (tmp_path / "wrong.pt", "does not hold a Transformer this version can build"),
    ]
    for path, message in cases:
        with pytest.raises(ValueError, match=message) as error:
            viz.load_checkpoint(path)
        assert "\n" not in str(error.value)


def test_cli_writes_non_empty_pngs(checkpoint, tmp_path):
    out = tmp_path / "figures"
    result = subprocess.run(
        [sys.executable, "-m", "native_sparse_attention.viz", "--checkpoint", str(checkpoint),
         "--text", "Sparse attention picks the blocks that matter. " * 2, "--out", str(out),
         "--layer", "1", "--head", "2"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "MPLBACKEND": "TkAgg"},  # a GUI backend must not be needed
    )
    assert result.returncode == 0, result.stderr
    for name in viz.PLOTS:
        png = out / f"{name}.png"
        assert png.read_bytes()[:8] == PNG_SIGNATURE
        assert png.stat().st_size > 10_000
    assert result.stdout.split() == [str(out / f"{name}.png") for name in viz.PLOTS]


def test_cli_help_describes_its_options(capsys):
    # The module entry point itself runs in test_cli_writes_non_empty_pngs; in-process is enough here.
    with pytest.raises(SystemExit) as exit_info:
        viz.main(["--help"])
    assert exit_info.value.code == 0
    help_text = " ".join(capsys.readouterr().out.split())  # undo argparse's line wrapping
    assert help_text.startswith("usage: python -m native_sparse_attention.viz")
    for option in ("--checkpoint", "--text", "--out", "--layer", "--head", "run directory"):
        assert option in help_text


def full_attention_checkpoint(tmp_path: Path) -> Path:
    model = Transformer(num_tokens=256, dim=16, depth=1, heads=2, dim_head=8, use_sparse_attn=False)
    return save_checkpoint(model, tmp_path, step=0)


@pytest.mark.parametrize(
    "arguments, message",
    [
        (lambda ckpt, tmp: ["--layer", "2"], r"--layer must be in \[0, 2\) for this model, got 2"),
        (lambda ckpt, tmp: ["--head", "4"], r"--head must be in \[0, 4\) for this model, got 4"),
        (lambda ckpt, tmp: ["--text", ""], "--text must not be empty"),
        (lambda ckpt, tmp: ["--checkpoint", str(tmp / "missing.pt")], "missing.pt does not exist"),
        (lambda ckpt, tmp: ["--checkpoint", str(tmp)], "holds no checkpoint"),
        (lambda ckpt, tmp: ["--checkpoint", str(full_attention_checkpoint(tmp))], "full-attention model"),
    ],
    ids=["layer", "head", "empty-text", "missing-checkpoint", "run-without-checkpoint", "full-attention"],
)
def test_cli_rejects_bad_input_in_one_line_with_exit_code_2(arguments, message, checkpoint, tmp_path, capsys):
    argv = ["--checkpoint", str(checkpoint), "--text", "abc", "--out", str(tmp_path / "figures"),
            *arguments(checkpoint, tmp_path)]
    with pytest.raises(SystemExit) as exit_info:
        viz.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("python -m native_sparse_attention.viz: error: ")
    assert re.search(message, err)
    assert not (tmp_path / "figures").exists()


def test_cli_rejects_a_file_that_is_not_a_checkpoint(tmp_path, capsys):
    not_a_checkpoint = tmp_path / "notes.pt"
    torch.save({"weights": torch.zeros(1)}, not_a_checkpoint)
    with pytest.raises(SystemExit):
        viz.main(["--checkpoint", str(not_a_checkpoint), "--text", "abc", "--out", str(tmp_path)])
    assert "is not a train.py checkpoint: expected a dict with 'model' and 'model_config'" in capsys.readouterr().err


# ---------------------------------------------------------------------------- notebook


def test_notebook_is_committed_without_outputs():
    notebook = json.loads(NOTEBOOK.read_text())
    code_cells = [cell for cell in notebook["cells"] if cell["cell_type"] == "code"]
    assert code_cells
    assert all(cell["outputs"] == [] and cell["execution_count"] is None for cell in code_cells)


def test_notebook_executes_headless_and_draws_its_figures(tmp_path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    if not (REPO_ROOT / "train.py").exists():
        pytest.skip("the notebook trains through train.py, which this checkout lacks")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("The harbour master kept a ledger of every ship that entered the bay. " * 400)
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    parameters = next(index for index, cell in enumerate(notebook.cells) if "parameters" in cell.metadata.get("tags", []))
    # Overrides go in a cell after the parameters cell (as papermill injects them): a short
    # run on a small corpus, since this checks the notebook's mechanics, not the model.
    overrides = f"TRAIN_STEPS = 3\nDATA = {str(corpus)!r}\nRUN_DIR = {str(tmp_path / 'run')!r}"
    notebook.cells.insert(parameters + 1, nbformat.v4.new_code_cell(overrides))
    client = nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(NOTEBOOK.parent)}})
    client.execute()

    def images(cell):
        return [output for output in cell.outputs if "image/png" in output.get("data", {})]

    code_cells = [cell for cell in notebook.cells if cell.cell_type == "code"]
    plot_cells = [cell for cell in code_cells if cell.source.startswith("viz.plot_")]
    assert [cell.source.split("(")[0] for cell in plot_cells] == [f"viz.plot_{name}" for name in viz.PLOTS]
    assert all(len(images(cell)) == 1 for cell in plot_cells)
    training_cell = next(cell for cell in code_cells if "train_tiny(" in cell.source)
    assert len(images(training_cell)) == 1, "the loss curve of the run it trained"
    assert (tmp_path / "run" / "checkpoints" / "step-00000003.pt").is_file()
