"""train.py: end-to-end runs on generated corpora, resume, signals, bad input, data
splitting and sampling, the enwik8 download (from a local server), checkpoints, plots."""

import gzip
import hashlib
import http.server
import io
import json
import math
import os
import random
import signal
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

import pytest
import torch

from native_sparse_attention import Transformer, data, evaluate, training
from native_sparse_attention.checkpoint import (
    atomic_write,
    checkpoint_step,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)
from native_sparse_attention.data import DataError, DownloadError, RandomOffsetSampler
from native_sparse_attention.plotting import comparable_runs, plot_runs

REPO_ROOT = Path(__file__).resolve().parent.parent
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
WORDS = "the of sparse attention selects blocks keys values query compressed sliding window gate".split()

# A model small enough for a step of a few milliseconds on the CPU.
SMALL_MODEL = [
    "--preset", "tiny", "--device", "cpu", "--dim", "32", "--depth", "1", "--heads", "2", "--dim-head", "16",
    "--kv-heads", "1", "--seq-len", "64", "--sliding-window", "16", "--compress-block", "8",
    "--compress-stride", "4", "--selection-block", "8", "--num-selected", "2", "--batch-size", "4",
    "--val-batches", "2", "--prime-len", "16", "--sample-len", "16", "--lr", "3e-3", "--warmup-steps", "2",
]


@pytest.fixture(autouse=True)
def one_thread():
    """CI runs two test workers on two cores: more threads per worker only contend."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def subprocess_env() -> dict:
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    return {**env, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """60 kB of sentences over a small vocabulary: a model learns it in a few dozen steps."""
    rng = random.Random(0)
    sentences = (" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))).capitalize() + ". "
                 for _ in range(100_000))
    text = "".join(sentences).encode()[:60_000]
    path = tmp_path_factory.mktemp("corpus") / "words.txt"
    path.write_bytes(text)
    return path


def run_train(corpus: Path, run_dir: Path, *flags: str) -> int:
    return training.main([*SMALL_MODEL, "--data", str(corpus), "--run-dir", str(run_dir), *flags])


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# ---------------------------------------------------------------------------- whole runs


def test_tiny_run_writes_config_metrics_plot_samples_and_checkpoints(corpus, tmp_path, capsys):
    run_dir = tmp_path / "run"
    code = run_train(corpus, run_dir, "--steps", "40", "--log-every", "1", "--val-every", "20",
                     "--sample-every", "40", "--checkpoint-every", "20", "--keep-checkpoints", "1")
    assert code == 0
    printed = capsys.readouterr().out
    assert "seq_len            64" in printed and "attention_backend  pytorch" in printed

    config = json.loads((run_dir / "config.json").read_text())
    assert config["dim"] == 32 and config["attn"] == "sparse" and config["data"] == str(corpus)
    assert config["run"]["corpus_bytes"] == 60_000 and config["run"]["tokens_per_step"] == 4 * 64
    assert config["cuda_graph"] is None and config["run"]["cuda_graph"] is False  # the default, on the CPU

    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, 41))
    assert all({"step", "loss", "bpb", "lr", "grad_norm", "tokens_per_s"} <= r.keys() for r in records)
    assert not any("peak_memory_gib" in r for r in records)  # CUDA only
    assert [r["step"] for r in records if "val_bpb" in r] == [20, 40]
    first, last = records[0]["loss"], sum(r["loss"] for r in records[-5:]) / 5
    assert first > 5.0 and last < first - 2.0  # from ln(256) toward the corpus's entropy
    assert records[-1]["val_bpb"] < records[19]["val_bpb"] < 8.0

    assert (run_dir / "loss_curve.png").read_bytes()[:8] == PNG_SIGNATURE
    assert (run_dir / "samples.txt").read_text().startswith("=== step 40\n")

    assert [path.name for path in list_checkpoints(run_dir)] == ["step-00000040.pt"]  # keep 1
    checkpoint = load_checkpoint(latest_checkpoint(run_dir))
    assert {"model", "model_config", "step", "optimizer", "sampler", "rng"} <= checkpoint.keys()
    assert checkpoint["step"] == 40 and checkpoint["sampler"]["batches_drawn"] == 40
    model = Transformer(**checkpoint["model_config"])
    model.load_state_dict(checkpoint["model"])
    ids = torch.tensor([list(b"the sparse attention")])
    assert torch.isfinite(model(ids)).all()

    # The closing lines name the commands that score and continue text with the run, and the
    # scoring one runs on it: the run's corpus and window length, its whole test split.
    assert f"python -m native_sparse_attention.evaluate --checkpoint {run_dir}\n" in printed
    assert f"python -m native_sparse_attention.generate --checkpoint {run_dir} --prompt TEXT" in printed
    assert evaluate.main(["--checkpoint", str(run_dir), "--json"]) == 0
    score = json.loads(capsys.readouterr().out)
    assert score["corpus"] == str(corpus) and score["window"] == 64 and score["scored_bytes"] == 2_999
    assert score["bits_per_byte"] < 8.0


def test_corpus_paths_are_saved_absolute(tmp_path, monkeypatch):
    """So that a resumed run, or the evaluate command, finds the same files from any directory."""
    monkeypatch.chdir(tmp_path)
    config, _, _ = training.resolve_config(["--device", "cpu", "--data", "corpus.bin", "--data-dir", "store"])
    assert config.data == str(tmp_path / "corpus.bin") and config.data_dir == str(tmp_path / "store")
    for name in ("enwik8", "stdlib"):
        assert training.resolve_config(["--device", "cpu", "--data", name])[0].data == name
    assert training.resolve_config(["--device", "cpu"])[0].data_dir == str(tmp_path / "data")


def test_activation_checkpointing_trains_the_same_run(corpus, tmp_path):
    """Recomputed activations on the CPU: the same losses and gradient norms, step by step."""
    flags = ("--steps", "6", "--log-every", "1", "--val-every", "0", "--sample-every", "0", "--checkpoint-every", "0")
    assert run_train(corpus, tmp_path / "kept", *flags) == 0
    assert run_train(corpus, tmp_path / "recomputed", *flags, "--activation-checkpointing") == 0
    kept, recomputed = read_metrics(tmp_path / "kept"), read_metrics(tmp_path / "recomputed")
    assert [(r["loss"], r["grad_norm"]) for r in recomputed] == [(r["loss"], r["grad_norm"]) for r in kept]
    assert json.loads((tmp_path / "recomputed" / "config.json").read_text())["activation_checkpointing"] is True


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
@pytest.mark.parametrize("attn", ["sparse", "full"])
def test_deterministic_runs_repeat_bit_for_bit(device, attn, corpus, tmp_path, monkeypatch):
    """--deterministic holds torch.use_deterministic_algorithms for the run (as the step
    sees it), then restores it; two runs log the same losses and gradient norms. On CUDA
    the sparse layers' kernels then add no floats atomically, and SDPA's backward splits
    no keys."""
    seen = []
    step = training.Trainer._train_step
    monkeypatch.setattr(training.Trainer, "_train_step",
                        lambda self, *args: seen.append(torch.are_deterministic_algorithms_enabled()) or step(self, *args))
    flags = ("--device", device, "--steps", "5", "--log-every", "1", "--val-every", "0", "--sample-every", "0",
             "--checkpoint-every", "0", "--deterministic", "--attn", attn)
    if device == "cuda":  # blocks the kernels take
        flags += ("--compress-block", "16", "--compress-stride", "8", "--selection-block", "16")
    assert run_train(corpus, tmp_path / "first", *flags) == 0
    assert run_train(corpus, tmp_path / "second", *flags) == 0
    assert seen and all(seen) and not torch.are_deterministic_algorithms_enabled()
    first, second = read_metrics(tmp_path / "first"), read_metrics(tmp_path / "second")
    assert [(r["loss"], r["grad_norm"]) for r in first] == [(r["loss"], r["grad_norm"]) for r in second]
    assert json.loads((tmp_path / "first" / "config.json").read_text())["deterministic"] is True


def test_resumed_run_logs_the_losses_of_an_uninterrupted_one(corpus, tmp_path):
    flags = ("--log-every", "1", "--val-every", "10", "--sample-every", "0", "--checkpoint-every", "0")
    assert run_train(corpus, tmp_path / "whole", "--steps", "30", *flags) == 0
    assert run_train(corpus, tmp_path / "parts", "--steps", "18", *flags) == 0
    assert run_train(corpus, tmp_path / "parts", "--steps", "30", "--resume", *flags) == 0

    whole, parts = read_metrics(tmp_path / "whole"), read_metrics(tmp_path / "parts")
    assert [r["step"] for r in parts] == list(range(1, 31))
    assert [r["loss"] for r in parts[18:]] == [r["loss"] for r in whole[18:]]  # steps 19-30, bit for bit
    assert [r["val_bpb"] for r in parts if r["step"] in (20, 30)] == [whole[19]["val_bpb"], whole[29]["val_bpb"]]
    assert json.loads((tmp_path / "parts" / "config.json").read_text())["steps"] == 30


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("attn", ["sparse", "full"])
def test_cuda_graph_steps_match_eager_ones(attn, corpus, tmp_path):
    """On one GPU the steps replay the micro-batches' forward and backward (two per step
    here) from CUDA graphs by default; the losses follow those of eager steps
    (--no-cuda-graph) up to the rounding of atomic float adds."""
    flags = ("--device", "cuda", "--attn", attn, "--compress-block", "16", "--compress-stride", "8",
             "--selection-block", "16", "--steps", "12", "--grad-accum", "2", "--log-every", "1",
             "--val-every", "12", "--sample-every", "12", "--checkpoint-every", "6")
    held_before_gib = torch.cuda.memory_allocated() / 2**30  # by the tests before this one
    assert run_train(corpus, tmp_path / "eager", *flags, "--no-cuda-graph") == 0
    assert run_train(corpus, tmp_path / "graph", *flags) == 0
    for run, graphed in (("eager", False), ("graph", True)):
        assert json.loads((tmp_path / run / "config.json").read_text())["run"]["cuda_graph"] is graphed
    eager, graph = read_metrics(tmp_path / "eager"), read_metrics(tmp_path / "graph")
    assert [r["step"] for r in graph] == list(range(1, 13))
    assert graph[0]["loss"] > graph[-1]["loss"] + 0.5
    losses = [(r["step"], r["loss"], g["loss"]) for r, g in zip(eager, graph)]
    for step, eager_loss, graph_loss in losses:
        assert math.isclose(graph_loss, eager_loss, rel_tol=2e-3), f"step {step}; (step, eager, graph): {losses}"
    assert math.isclose(graph[-1]["val_bpb"], eager[-1]["val_bpb"], rel_tol=2e-3), (graph[-1], eager[-1])
    # Every record holds the peak memory since the one before (the first, since the loop
    # began), which counts what the process held already: a small model adds well under a GiB.
    assert all(0 < r["peak_memory_gib"] < held_before_gib + 1 for r in eager + graph)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_torchrun_replays_graphed_steps_like_ddp_on_two_gpus(corpus, tmp_path):
    """Under torchrun the steps replay from CUDA graphs too, their gradients averaged by
    one all-reduce; the losses follow DistributedDataParallel's eager steps."""
    flags = ("--device", "cuda", "--compress-block", "16", "--compress-stride", "8", "--selection-block", "16",
             "--steps", "12", "--grad-accum", "2", "--log-every", "1", "--val-every", "12", "--sample-every", "12",
             "--checkpoint-every", "12")
    for run, extra in (("ddp", ("--no-cuda-graph",)), ("graph", ())):
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                   str(REPO_ROOT / "train.py"), *SMALL_MODEL, *flags, *extra, "--data", str(corpus),
                   "--run-dir", str(tmp_path / run)]
        result = subprocess.run(command, cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True,
                                timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
        run_info = json.loads((tmp_path / run / "config.json").read_text())["run"]
        assert run_info["world_size"] == 2 and run_info["cuda_graph"] is (run == "graph")
    ddp, graph = read_metrics(tmp_path / "ddp"), read_metrics(tmp_path / "graph")
    assert graph[0]["loss"] > graph[-1]["loss"] + 0.5
    for eager_record, graph_record in zip(ddp, graph):
        assert math.isclose(graph_record["loss"], eager_record["loss"], rel_tol=2e-3), (eager_record, graph_record)
    assert math.isclose(graph[-1]["val_bpb"], ddp[-1]["val_bpb"], rel_tol=2e-3)


def test_cuda_graph_refuses_what_it_cannot_capture():
    check = training._check_cuda_graph
    with pytest.raises(training.UsageError, match="needs a CUDA device"):
        check(training.TrainConfig(cuda_graph=True), use_cuda=False)
    with pytest.raises(training.UsageError, match="contradicts --compile"):
        check(training.TrainConfig(cuda_graph=True, compile=True), use_cuda=True)
    with pytest.raises(training.UsageError, match="not --backend flex"):
        check(training.TrainConfig(cuda_graph=True, backend="flex"), use_cuda=True)
    check(training.TrainConfig(cuda_graph=True, backend="triton"), use_cuda=True)
    check(training.TrainConfig(cuda_graph=True, attn="full"), use_cuda=True)


def test_cuda_graphs_are_the_default_where_they_work():
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    possible = training.cuda_graph_possible
    assert possible(training.TrainConfig(), cuda)
    assert possible(training.TrainConfig(backend="triton"), cuda)
    assert possible(training.TrainConfig(attn="full"), cuda)
    assert not possible(training.TrainConfig(), cpu)
    assert not possible(training.TrainConfig(compile=True), cuda)
    assert not possible(training.TrainConfig(backend="flex"), cuda)


def test_flat_gradients_view_one_aligned_buffer_per_dtype():
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(5, 2, bias=False))
    model[0].bias.requires_grad_(False)
    (buffer,) = training.flat_gradients(model)
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert model[0].bias.grad is None and buffer.numel() == 16 + 12  # 15 -> 16 and 10 -> 12 floats
    assert all(g.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr() for g in grads)
    assert all(g.data_ptr() % 16 == 0 and not g.any() for g in grads)
    model(torch.ones(4, 3)).sum().backward()
    assert buffer.abs().sum() > 0 and all(g.abs().sum() > 0 for g in grads)  # backward added into the views


class FailingCapture:
    def __init__(self, *args, **kwargs):
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nmore lines ...")


class EagerStep:
    """Stands in for the captured training micro-step, which the CPU cannot capture."""

    def __init__(self, model, example_ids, loss_scale):
        self.model, self.loss_scale = model, loss_scale

    def __call__(self, ids):
        loss = self.model(ids, return_loss=True)
        (loss * self.loss_scale).backward()
        return loss.detach()


def test_a_failed_default_capture_falls_back_to_eager_steps(corpus, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(training, "cuda_graph_possible", lambda *args: True)
    monkeypatch.setattr(training, "GraphedLossBackward", FailingCapture)
    assert run_train(corpus, tmp_path / "run", "--steps", "3", "--log-every", "1") == 0
    assert ("CUDA graph capture failed (CUDA error: operation not permitted when stream is capturing): "
            "training with eager steps") in capsys.readouterr().out
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2, 3]


def test_a_failed_default_validation_capture_validates_eagerly(corpus, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(training, "cuda_graph_possible", lambda *args: True)
    monkeypatch.setattr(training, "GraphedLossBackward", EagerStep)
    monkeypatch.setattr(training, "GraphedLoss", FailingCapture)
    assert run_train(corpus, tmp_path / "run", "--steps", "2", "--val-every", "1") == 0
    assert capsys.readouterr().out.count("CUDA graph capture of the validation loss failed (CUDA error: "
                                         "operation not permitted when stream is capturing): validating eagerly") == 1
    assert [r["step"] for r in read_metrics(tmp_path / "run") if "val_bpb" in r] == [1, 2]


def test_a_failed_default_decoding_capture_samples_eagerly(corpus, tmp_path, capsys, monkeypatch):
    sample = training.generate_sample

    def generate(model, prompt, config, seed, use_cuda_graph=False):
        if use_cuda_graph:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
        return sample(model, prompt, config, seed)

    monkeypatch.setattr(training, "cuda_graph_possible", lambda *args: True)
    monkeypatch.setattr(training, "attention_backend", lambda config, device: "triton")
    monkeypatch.setattr(training, "GraphedLossBackward", EagerStep)
    monkeypatch.setattr(training, "generate_sample", generate)
    assert run_train(corpus, tmp_path / "run", "--steps", "2", "--sample-every", "1", "--compress-block", "16",
                     "--compress-stride", "8", "--selection-block", "16") == 0
    printed = capsys.readouterr().out
    assert printed.count("CUDA graph capture of a decoding step failed (CUDA error: operation not permitted "
                         "when stream is capturing): sampling eagerly") == 1
    assert (tmp_path / "run" / "samples.txt").read_text().count("=== step") == 2


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_checkpoints_the_last_step_and_the_run_resumes(signum, corpus, tmp_path):
    run_dir = tmp_path / "run"
    command = [sys.executable, str(REPO_ROOT / "train.py"), *SMALL_MODEL, "--data", str(corpus),
               "--run-dir", str(run_dir), "--steps", "100000", "--log-every", "1", "--checkpoint-every", "0"]
    process = subprocess.Popen(command, cwd=tmp_path, env=subprocess_env(), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        assert process.poll() is None and time.monotonic() < deadline, process.stderr.read()
        time.sleep(0.1)
    process.send_signal(signum)
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 128 + signum, stderr
    assert f"stopped by {signum.name}" in stdout and "Traceback" not in stderr

    stopped_at = read_metrics(run_dir)[-1]["step"]
    assert checkpoint_step(latest_checkpoint(run_dir)) == stopped_at
    assert run_train(corpus, run_dir, "--steps", str(stopped_at + 2), "--log-every", "1", "--resume") == 0
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, stopped_at + 3))


def test_torchrun_trains_with_two_cpu_ranks(corpus, tmp_path):
    run_dir = tmp_path / "ddp"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(REPO_ROOT / "train.py"), *SMALL_MODEL, "--data", str(corpus), "--run-dir", str(run_dir),
               "--steps", "3", "--log-every", "1", "--sample-every", "3", "--grad-accum", "2"]
    result = subprocess.run(command, cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("done: 3 steps") == 1  # rank 0 alone reports
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3]
    config = json.loads((run_dir / "config.json").read_text())
    assert config["run"]["world_size"] == 2 and config["run"]["tokens_per_step"] == 2 * 2 * 4 * 64
    assert checkpoint_step(latest_checkpoint(run_dir)) == 3


GRADIENT_AVERAGING_SCRIPT = """
import torch
import torch.distributed as dist

from native_sparse_attention import training

dist.init_process_group("gloo")
rank = dist.get_rank()
config = training.TrainConfig(dim=32, depth=1, heads=2, dim_head=16, kv_heads=1, seq_len=32, sliding_window=8,
                              compress_block=8, compress_stride=4, selection_block=8, num_selected=2)


def build():
    torch.manual_seed(0)
    model = training.build_model(config, "pytorch")
    return model, training.build_optimizer(model, config)


class EagerStep:
    def __init__(self, model, loss_scale):
        self.model, self.loss_scale = model, loss_scale

    def __call__(self, ids):
        loss = self.model(ids, return_loss=True)
        (loss * self.loss_scale).backward()
        return loss.detach()


ddp_model, ddp_optimizer = build()
ddp = torch.nn.parallel.DistributedDataParallel(ddp_model)
flat_model, flat_optimizer = build()
buffers = training.flat_gradients(flat_model)
start = [p.detach().clone() for p in flat_model.parameters()]
generator = torch.Generator().manual_seed(rank)
for _ in range(2):
    batches = [torch.randint(0, 256, (2, 33), generator=generator) for _ in range(2)]
    training.train_step(ddp, ddp_optimizer, batches, 1.0, ddp.no_sync)
    training.train_step(flat_model, flat_optimizer, batches, 1.0, graphed=EagerStep(flat_model, 0.5),
                        grad_buffers=buffers)
difference = max((a - b).abs().max().item() for a, b in zip(ddp_model.parameters(), flat_model.parameters()))
moved = max((a - b).abs().max().item() for a, b in zip(start, flat_model.parameters()))
print(f"rank {rank}: difference {difference:.3g}, moved {moved:.3g}")
assert difference < 1e-6 < moved, (difference, moved)
"""


def test_graphed_steps_average_gradients_over_ranks_as_ddp_does(tmp_path):
    """Under torchrun, graphed steps (here an eager stand-in) average their gradients with
    one all-reduce per flat buffer: two steps of two micro-batches on two CPU ranks end at
    DistributedDataParallel's weights."""
    script = tmp_path / "average.py"
    script.write_text(GRADIENT_AVERAGING_SCRIPT)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)]
    result = subprocess.run(command, cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("difference") == 2


def test_divergence_stops_without_checkpointing_the_broken_weights(corpus, tmp_path, monkeypatch, capsys):
    real_train_step, calls = training.train_step, []

    def diverging_train_step(*args):
        loss, grad_norm = real_train_step(*args)
        calls.append(loss)
        return (torch.full_like(loss, math.nan) if len(calls) == 3 else loss), grad_norm

    monkeypatch.setattr(training, "train_step", diverging_train_step)
    run_dir = tmp_path / "run"
    assert run_train(corpus, run_dir, "--steps", "5", "--checkpoint-every", "2", "--log-every", "1") == 1
    error = capsys.readouterr().err.splitlines()[-1]  # after the progress bar
    assert error.startswith("train.py: error: training diverged at step 3 (loss nan")
    assert error.endswith("the last checkpoint is from step 2")
    assert [checkpoint_step(path) for path in list_checkpoints(run_dir)] == [2]
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2]


def test_a_crash_checkpoints_the_last_finished_step_and_the_run_resumes(corpus, tmp_path, monkeypatch, capsys):
    """An unexpected error (here in the fourth step) propagates after the last finished
    step is saved, however far the last periodic checkpoint lies behind."""
    real_train_step, calls = training.train_step, []

    def crashing_train_step(*args):
        calls.append(None)
        if len(calls) == 4:
            raise RuntimeError("CUDA out of memory (simulated)")
        return real_train_step(*args)

    monkeypatch.setattr(training, "train_step", crashing_train_step)
    run_dir = tmp_path / "run"
    with pytest.raises(RuntimeError, match="simulated"):
        run_train(corpus, run_dir, "--steps", "6", "--checkpoint-every", "0", "--log-every", "1")
    assert "training failed after step 3; saved" in capsys.readouterr().out
    assert [checkpoint_step(path) for path in list_checkpoints(run_dir)] == [3]

    monkeypatch.setattr(training, "train_step", real_train_step)
    assert run_train(corpus, run_dir, "--steps", "6", "--log-every", "1", "--resume") == 0
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, 7))


# ---------------------------------------------------------------------------- bad input


def _write_checkpointed_run(run_dir: Path, corpus: Path) -> None:
    assert run_train(corpus, run_dir, "--steps", "1") == 0


@pytest.mark.parametrize("case", [
    "missing file", "directory", "corrupt gzip", "too short", "resume without checkpoint",
    "backend with full attention", "triton without cuda", "existing run", "resume changes architecture",
    "zero steps", "unknown flag", "bad model", "prompt longer than sequence", "resume already finished",
    "cuda graph without cuda",
])
def test_bad_input_exits_2_with_one_line(case, corpus, tmp_path, capsys):
    run_dir = tmp_path / "run"
    flags, expected = {
        "missing file": (["--data", str(tmp_path / "nope.txt")], "does not exist"),
        "directory": (["--data", str(tmp_path)], "is a directory"),
        "corrupt gzip": (["--data", str(tmp_path / "bad.gz")], "cannot read data file"),
        "too short": (["--data", str(tmp_path / "short.txt")], "too short for seq_len 64"),
        "resume without checkpoint": (["--resume"], "no checkpoint"),
        "backend with full attention": (["--attn", "full", "--backend", "pytorch"], "contradicts --attn full"),
        "triton without cuda": (["--backend", "triton"], "needs a CUDA device"),
        "existing run": ([], "already holds checkpoints"),
        "resume changes architecture": (["--resume", "--dim", "48", "--steps", "5"], "keeps its architecture"),
        "zero steps": (["--steps", "0"], "must be >= 1"),
        "unknown flag": (["--dimm", "8"], "unrecognized arguments"),
        "bad model": (["--heads", "3", "--kv-heads", "2"], "invalid model settings"),
        "prompt longer than sequence": (["--prime-len", "65"], "must not exceed --seq-len"),
        "resume already finished": (["--resume", "--steps", "1"], "already at step 1"),
        "cuda graph without cuda": (["--cuda-graph"], "--cuda-graph needs a CUDA device"),
    }[case]
    (tmp_path / "bad.gz").write_bytes(b"\x1f\x8b" + b"not gzip data" * 10)
    (tmp_path / "short.txt").write_bytes(b"x" * 500)
    if case in ("existing run", "resume changes architecture", "resume already finished"):
        _write_checkpointed_run(run_dir, corpus)
    capsys.readouterr()

    argv = [*SMALL_MODEL, "--data", str(corpus), "--run-dir", str(run_dir), "--steps", "2", *flags]
    assert training.main(argv) == 2
    stderr = capsys.readouterr().err
    assert stderr.count("\n") == 1 and stderr.startswith("train.py: error: ")
    assert expected in stderr


def test_the_script_reports_errors_without_a_traceback(tmp_path):
    result = subprocess.run([sys.executable, str(REPO_ROOT / "train.py"), "--data", str(tmp_path / "missing")],
                            cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [f"train.py: error: data file {tmp_path / 'missing'} does not exist"]


def test_presets_and_flags_resolve_with_flags_winning(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config, run_dir, resume = training.resolve_config(["--preset", "enwik8", "--device", "cpu", "--steps", "7",
                                                       "--attn", "full"])
    assert (config.dim, config.depth, config.heads, config.kv_heads, config.seq_len) == (512, 6, 8, 4, 512)
    assert (config.sliding_window, config.compress_block, config.compress_stride) == (64, 16, 8)
    assert (config.selection_block, config.num_selected) == (16, 4)
    assert (config.steps, config.attn, config.preset) == (7, "full", "enwik8")
    assert run_dir == Path("runs/enwik8-full") and not resume
    tiny, run_dir, _ = training.resolve_config(["--device", "cpu", "--run-dir", str(tmp_path)])
    assert tiny.preset == "tiny" and tiny.steps == 50 and run_dir == tmp_path


def test_learning_rate_warms_up_then_holds_or_decays():
    config = training.TrainConfig(lr=1.0, warmup_steps=10, steps=100)
    assert [training.learning_rate(step, config) for step in (1, 5, 10, 50, 100)] == [0.1, 0.5, 1.0, 1.0, 1.0]
    cosine = training.TrainConfig(lr=1.0, warmup_steps=0, steps=100, lr_schedule="cosine")
    rates = [training.learning_rate(step, cosine) for step in (1, 50, 100)]
    assert rates[0] > 0.99 and rates[1] == pytest.approx(0.55) and rates[2] == pytest.approx(training.MIN_LR_RATIO)


# ---------------------------------------------------------------------------- data


def test_split_is_90_and_5_percent_of_the_corpus():
    enwik8_sized = torch.empty(data.ENWIK8_SIZE, dtype=torch.uint8)
    train, validation = data.split_corpus(enwik8_sized, seq_len=512)
    assert train.numel() == 90_000_000 and validation.numel() == 5_000_000
    assert train.data_ptr() == enwik8_sized.data_ptr()
    assert validation.data_ptr() == enwik8_sized.data_ptr() + 90_000_000

    small = torch.arange(1000) % 256
    train, validation = data.split_corpus(small.to(torch.uint8), seq_len=10)
    assert torch.equal(train, small[:900].to(torch.uint8)) and torch.equal(validation, small[900:950].to(torch.uint8))
    with pytest.raises(DataError, match="too short"):
        data.split_corpus(small.to(torch.uint8), seq_len=50)


def test_sampler_offsets_are_uniform_seeded_per_rank_and_resumable():
    sampler = RandomOffsetSampler(num_bytes=40, seq_len=7, batch_size=512, seed=3)
    first = sampler.next_offsets()
    assert first.dtype == torch.int64 and first.shape == (512,)
    assert set(first.tolist()) == set(range(40 - 8 + 1))  # every window start, none past the end
    assert torch.equal(first, RandomOffsetSampler(40, 7, 512, seed=3).offsets(0))
    assert not torch.equal(first, RandomOffsetSampler(40, 7, 512, seed=4).offsets(0))
    assert not torch.equal(first, RandomOffsetSampler(40, 7, 512, seed=3, rank=1).offsets(0))
    assert not torch.equal(first, sampler.offsets(1))

    sampler.next_offsets()
    restored = RandomOffsetSampler(40, 7, 512, seed=0)
    restored.load_state_dict(sampler.state_dict())
    assert restored.batches_drawn == 2 and torch.equal(restored.next_offsets(), sampler.next_offsets())


def test_windows_and_validation_offsets():
    corpus = (torch.arange(100) % 256).to(torch.uint8)
    ids = data.windows(corpus, torch.tensor([0, 37, 91]), seq_len=8)
    assert ids.dtype == torch.int64 and ids.shape == (3, 9)
    assert ids[1].tolist() == list(range(37, 46)) and ids[2, -1] == 99
    offsets = data.validation_offsets(100, seq_len=8, count=5)
    assert offsets.tolist() == [0, 23, 46, 68, 91]


def test_read_bytes_takes_plain_and_gzip_files(tmp_path):
    (tmp_path / "plain").write_bytes(b"hello bytes")
    (tmp_path / "packed.bin").write_bytes(gzip.compress(b"hello gzip"))
    assert data.read_bytes(tmp_path / "plain") == b"hello bytes"
    assert data.read_bytes(tmp_path / "packed.bin") == b"hello gzip"


def test_stdlib_corpus_is_python_source():
    text = data.stdlib_corpus()
    assert len(text) > 5_000_000 and b"def " in text and b"import " in text


# ---------------------------------------------------------------------------- enwik8 download


@pytest.fixture
def server(tmp_path):
    """An HTTP server on localhost serving ``tmp_path / "www"``; yields its base URL."""
    root = tmp_path / "www"
    root.mkdir()

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=str(root), **kwargs)

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield root, f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def fake_enwik8_archive(content: bytes) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("enwik8", content)
    return buffer.getvalue()


def test_download_checks_the_archive_and_writes_gzip(server, tmp_path):
    root, url = server
    content = b"<mediawiki> enwik8 stand-in </mediawiki>" * 1000
    (root / "enwik8.zip").write_bytes(fake_enwik8_archive(content))
    destination = tmp_path / "data" / "enwik8.gz"
    md5 = hashlib.md5(content).hexdigest()
    assert data.download_enwik8(destination, url=f"{url}/enwik8.zip", md5=md5, size=len(content)) == destination
    assert gzip.decompress(destination.read_bytes()) == content
    assert sorted(p.name for p in destination.parent.iterdir()) == ["enwik8.gz"]


def test_download_failures_say_why(server, tmp_path):
    root, url = server
    content = b"some bytes" * 100
    (root / "enwik8.zip").write_bytes(fake_enwik8_archive(content))
    (root / "page.html").write_bytes(b"<html>not an archive</html>")
    destination = tmp_path / "data" / "enwik8.gz"

    with pytest.raises(DownloadError, match=r"checksum mismatch .* expected 1000 bytes with MD5 0{32}"):
        data.download_enwik8(destination, url=f"{url}/enwik8.zip", md5="0" * 32, size=len(content))
    with pytest.raises(DownloadError, match="is not the enwik8 archive"):
        data.download_enwik8(destination, url=f"{url}/page.html")
    with pytest.raises(DownloadError, match="could not download .*404"):
        data.download_enwik8(destination, url=f"{url}/missing.zip")
    with pytest.raises(DownloadError, match="could not download http://127.0.0.1:1/"):
        data.download_enwik8(destination, url="http://127.0.0.1:1/enwik8.zip", timeout=5)
    assert not destination.parent.exists() or not any(destination.parent.iterdir())


def test_enwik8_falls_back_to_the_standard_library_offline(tmp_path, monkeypatch):
    def offline(destination):
        raise DownloadError("could not download https://example.invalid/enwik8.zip: no network")

    monkeypatch.setattr(data, "download_enwik8", offline)
    monkeypatch.setattr(data, "stdlib_corpus", lambda: b"import os\n" * 100)
    announced = []
    corpus = data.load_corpus(None, tmp_path, announce=announced.append)
    assert corpus.name == "stdlib" and corpus.data.numel() == 1000
    assert len(announced) == 1 and "\n" not in announced[0]
    assert announced[0].startswith("enwik8 unavailable (could not download") and "standard library" in announced[0]
    with pytest.raises(DownloadError, match="no network"):
        data.load_corpus("enwik8", tmp_path)

    (tmp_path / "enwik8.gz").write_bytes(gzip.compress(b"cached enwik8"))
    assert data.load_corpus(None, tmp_path).name == "enwik8"
    assert bytes(data.load_corpus("enwik8", tmp_path).data.tolist()) == b"cached enwik8"


# ---------------------------------------------------------------------------- checkpoints and plots


def test_checkpoints_are_atomic_sorted_and_pruned(tmp_path):
    for step in (5, 10, 100, 1000):
        save_checkpoint(tmp_path, {"step": step, "model": {"w": torch.full((2,), float(step))}}, keep=2)
    assert [checkpoint_step(path) for path in list_checkpoints(tmp_path)] == [100, 1000]
    assert load_checkpoint(latest_checkpoint(tmp_path))["model"]["w"].tolist() == [1000.0, 1000.0]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-00000100.pt", "step-00001000.pt"]
    assert latest_checkpoint(tmp_path / "elsewhere") is None

    target = tmp_path / "file.txt"
    target.write_text("old")
    with pytest.raises(RuntimeError), atomic_write(target) as temporary:
        temporary.write_text("half")
        raise RuntimeError("crash while writing")
    assert target.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints", "file.txt"]


def _fake_run(run_dir: Path, attn: str, corpus: str = "words") -> Path:
    run_dir.mkdir(parents=True)
    config = dict(attn=attn, dim=32, depth=1, seq_len=64, run=dict(corpus=corpus, attention_backend="pytorch"))
    (run_dir / "config.json").write_text(json.dumps(config))
    records = [dict(step=s, loss=1.0, bpb=3.0 - s / 10, **({"val_bpb": 3.1 - s / 10} if s % 5 == 0 else {}))
               for s in range(1, 11)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + '{"step": 11, "lo')
    return run_dir


def test_plots_overlay_comparable_sibling_runs(tmp_path):
    sparse = _fake_run(tmp_path / "runs" / "sparse", "sparse")
    full = _fake_run(tmp_path / "runs" / "full", "full")
    _fake_run(tmp_path / "runs" / "other-data", "full", corpus="enwik8")
    assert comparable_runs(sparse) == [sparse, full]
    output = plot_runs(comparable_runs(sparse), tmp_path / "curves.png")
    assert output.read_bytes()[:8] == PNG_SIGNATURE and output.stat().st_size > 10_000
