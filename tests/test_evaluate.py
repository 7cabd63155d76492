"""Bits per byte over a whole split: ``native_sparse_attention.evaluate``."""

import gzip
import json
import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from native_sparse_attention import data
from native_sparse_attention.evaluate import main, score_bytes, scoring_windows
from run_checkpoints import save_checkpoint, small_model

def random_text(num_bytes: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (num_bytes,), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)


@pytest.mark.parametrize("num_bytes", [2, 3, 17, 64, 65, 100])
@pytest.mark.parametrize("seq_len, stride", [(16, 16), (16, 8), (16, 5), (16, 1), (1, 1)])
def test_windows_score_every_byte_but_the_first_exactly_once(num_bytes, seq_len, stride):
    length = min(seq_len, num_bytes - 1)
    counts = torch.zeros(num_bytes, dtype=torch.long)
    for start, first in scoring_windows(num_bytes, seq_len, stride):
        assert 0 <= start and start + length <= num_bytes - 1 and 0 <= first < length
        counts[start + 1 + first:start + 1 + length] += 1
        if start > 0:  # the scored bytes see at least seq_len - stride bytes before them
            assert first >= length - stride
    assert counts[0] == 0 and (counts[1:] == 1).all()


def test_score_is_each_bytes_loss_given_the_window_that_scores_it():
    """With stride 1 the byte at t > seq_len is predicted from exactly the seq_len bytes
    before it, and earlier bytes from all the bytes before them: a reference that runs the
    model once per byte."""
    model, text, seq_len = small_model(), random_text(30), 12
    losses = []
    for t in range(1, text.numel()):
        context = text[max(0, t - seq_len):t].long()[None]
        with torch.no_grad():
            logits = model(context)[0, -1]
        losses.append(F.cross_entropy(logits[None], text[t].long()[None]).item())
    score = score_bytes(model, text, seq_len, stride=1, batch_size=5)
    assert score.scored_bytes == 29
    assert math.isclose(score.nats, sum(losses) / len(losses), rel_tol=1e-5)
    assert math.isclose(score.bits_per_byte, score.nats / math.log(2), rel_tol=1e-12)


@pytest.mark.parametrize("stride", [5, 7, 12])
def test_each_byte_is_scored_in_the_earliest_window_that_predicts_it(stride):
    """A reference that builds the windows from their definition (starts every stride
    bytes, the last one moved back to end at the text's end) and scores each byte from the
    first window predicting it, one forward per byte: with these strides the last window
    overlaps the one before it by more than the stride."""
    model, text, seq_len = small_model(), random_text(30), 12
    last_start = text.numel() - 1 - seq_len
    starts = sorted({min(k * stride, last_start) for k in range(text.numel())})
    losses = []
    for t in range(1, text.numel()):
        start = next(s for s in starts if s + 1 <= t <= s + seq_len)
        with torch.no_grad():
            logits = model(text[start:t].long()[None])[0, -1]
        losses.append(F.cross_entropy(logits[None], text[t].long()[None]).item())
    score = score_bytes(model, text, seq_len, stride, batch_size=2)
    assert math.isclose(score.nats, sum(losses) / len(losses), rel_tol=1e-5)


def test_strides_outside_the_window_and_empty_batches_are_refused():
    for stride in (0, 17):
        with pytest.raises(ValueError, match=rf"stride must be in \[1, seq_len = 16\], got {stride}"):
            list(scoring_windows(100, 16, stride))
    with pytest.raises(ValueError, match="num_bytes must be at least 2, got 1"):
        list(scoring_windows(1, 16, 8))
    with pytest.raises(ValueError, match="batch_size must be at least 1, got 0"):
        score_bytes(small_model(), random_text(20), 8, 4, batch_size=0)


def test_strides_change_the_context_not_the_bytes_scored():
    model, text = small_model(), random_text(80)
    scores = [score_bytes(model, text, 16, stride) for stride in (16, 8, 3)]
    assert len({score.scored_bytes for score in scores}) == 1
    assert scores[0].nats != scores[1].nats
    # Batching windows together changes nothing.
    assert math.isclose(score_bytes(model, text, 16, 8, batch_size=1).nats, scores[1].nats, rel_tol=1e-6)


def test_corpus_splits_tile_the_corpus():
    corpus = torch.arange(1000) % 256
    parts = [data.corpus_split(corpus, name) for name in data.SPLITS]
    assert [part.numel() for part in parts] == [900, 50, 50]
    assert torch.equal(torch.cat(parts), corpus)
    with pytest.raises(ValueError, match="split must be one of train, validation, test"):
        data.corpus_split(corpus, "dev")


@pytest.fixture
def corpus_file(tmp_path) -> Path:
    path = tmp_path / "corpus.bin"
    path.write_bytes(bytes(random_text(2000, seed=1).tolist()))
    return path


def test_cli_scores_the_split_with_the_runs_settings(tmp_path, corpus_file, capsys):
    model = small_model()
    save_checkpoint(model, tmp_path, train_config={"data": str(corpus_file), "seq_len": 24, "batch_size": 4})
    # On the CPU as the expected score is: on CUDA the command scores under bf16 autocast.
    assert main(["--checkpoint", str(tmp_path), "--json", "--device", "cpu"]) == 0
    result = json.loads(capsys.readouterr().out)
    test_split = data.corpus_split(torch.tensor(list(corpus_file.read_bytes()), dtype=torch.uint8), "test")
    expected = score_bytes(model, test_split, 24, 12)
    assert result["split"] == "test" and result["window"] == 24 and result["stride"] == 12
    assert result["scored_bytes"] == 99
    assert math.isclose(result["bits_per_byte"], expected.bits_per_byte, rel_tol=1e-6)

    assert main(["--checkpoint", str(tmp_path), "--split", "validation", "--seq-len", "10", "--stride", "10",
                 "--max-bytes", "50"]) == 0
    line = capsys.readouterr().out
    assert line.count("\n") == 1
    assert re.search(r"\d\.\d{4} bits per byte \(\d\.\d{4} nats\) on the validation split of .*corpus\.bin, "
                     r"49 bytes scored in windows of 10 starting every 10", line)


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--seq-len", "0"], "--seq-len must be at least 1, got 0"),
        (["--stride", "40", "--seq-len", "20"], r"--stride \(40\) must not exceed the window \(20\)"),
        (["--max-bytes", "1"], "holds 1 bytes; scoring needs at least 2"),
        (["--stride", "0"], "--stride must be at least 1, got 0"),
        (["--batch-size", "0"], "--batch-size must be at least 1, got 0"),
        (["--data", "/nonexistent/corpus"], "/nonexistent/corpus"),
    ],
    ids=["seq-len", "stride", "too-few-bytes", "zero-stride", "zero-batch", "missing-corpus"],
)
def test_cli_rejects_bad_input_in_one_line_with_exit_code_2(arguments, message, tmp_path, corpus_file, capsys):
    save_checkpoint(small_model(), tmp_path, train_config={"data": str(corpus_file), "seq_len": 24, "batch_size": 4})
    with pytest.raises(SystemExit) as exit_info:
        main(["--checkpoint", str(tmp_path), *arguments])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and error.startswith("python -m native_sparse_attention.evaluate: error: ")
    assert re.search(message, error)


def test_cli_needs_a_window_length_for_checkpoints_without_training_settings(tmp_path, corpus_file, capsys):
    save_checkpoint(small_model(), tmp_path)
    with pytest.raises(SystemExit):
        main(["--checkpoint", str(tmp_path), "--data", str(corpus_file)])
    assert "does not record its training settings: give --seq-len" in capsys.readouterr().err
    assert main(["--checkpoint", str(tmp_path), "--data", str(corpus_file), "--seq-len", "16", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["stride"] == 8


def test_enwik8_is_read_from_the_runs_data_dir_wherever_the_command_runs(tmp_path, monkeypatch, capsys):
    """The run's absolute data_dir, not ./data: no second download from another directory."""
    store = tmp_path / "store"
    store.mkdir()
    (store / "enwik8.gz").write_bytes(gzip.compress(bytes(random_text(2000, seed=2).tolist())))
    save_checkpoint(small_model(), tmp_path / "run",
                    train_config={"data": "enwik8", "data_dir": str(store), "seq_len": 16})
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert main(["--checkpoint", str(tmp_path / "run"), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["corpus"] == "enwik8" and result["scored_bytes"] == 99
    assert not (elsewhere / "data").exists()


def test_windows_longer_than_the_text_are_reported_as_used(tmp_path, corpus_file, capsys):
    save_checkpoint(small_model(), tmp_path, train_config={"data": str(corpus_file), "seq_len": 24})
    assert main(["--checkpoint", str(tmp_path), "--max-bytes", "6", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["window"] == 5 and result["scored_bytes"] == 5


def test_non_causal_checkpoints_are_refused(tmp_path, corpus_file, capsys):
    save_checkpoint(small_model(causal=False), tmp_path, train_config={"data": str(corpus_file), "seq_len": 16})
    with pytest.raises(SystemExit):
        main(["--checkpoint", str(tmp_path)])
    assert "non-causal model, which does not predict the next byte" in capsys.readouterr().err


def test_bytes_outside_the_vocabulary_are_refused(tmp_path, corpus_file, capsys):
    save_checkpoint(small_model(num_tokens=100), tmp_path, train_config={"data": str(corpus_file), "seq_len": 16})
    with pytest.raises(SystemExit):
        main(["--checkpoint", str(tmp_path)])
    assert re.search(r"holds byte \d+, outside this model's 100-token vocabulary", capsys.readouterr().err)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_scores_on_cuda_with_the_triton_kernels_match_the_cpu():
    kernel_kwargs = dict(sliding_window_size=32, compress_block_size=16, compress_block_sliding_stride=8,
                         selection_block_size=16, num_selected_blocks=2, use_triton_kernel=True)
    model, text = small_model(sparse_attn_kwargs=kernel_kwargs), random_text(3000)
    cpu = score_bytes(model, text, 256, 128)
    cuda = score_bytes(model.cuda(), text, 256, 128, batch_size=8)
    assert cuda.scored_bytes == cpu.scored_bytes
    assert math.isclose(cuda.nats, cpu.nats, rel_tol=1e-2)
