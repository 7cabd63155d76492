"""Generating text from a train.py checkpoint: ``native_sparse_attention.generate``."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from native_sparse_attention import generate as generate_module
from native_sparse_attention.generate import generate, main
from greedy_ties import assert_same_up_to_ties
from run_checkpoints import save_checkpoint, small_model

@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("run")
    save_checkpoint(small_model(), run_dir)
    return run_dir


def test_greedy_generation_is_the_models_greedy_sample():
    model, prompt = small_model(), "Sparse ".encode()
    expected = model.sample(torch.tensor(list(prompt)), len(prompt) + 12, temperature=0.0)
    assert generate(model, prompt, 12, temperature=0.0) == [bytes(expected.tolist())]


def test_continuations_may_part_only_where_the_logits_tie():
    """The check of the GPU tests that compare greedy continuations of two paths: it fails
    where they part at a token whose logit is far from the other's, not where all tie."""
    model, prompt = small_model(), b"Sparse "
    greedy = generate(model, prompt, 12, temperature=0.0)[0]
    assert_same_up_to_ties(model, [prompt], [greedy], [greedy])
    with torch.no_grad():
        least_likely = model(torch.tensor([list(prompt + greedy[:5])]))[0, -1].argmin().item()
    parted = greedy[:5] + bytes([least_likely]) + greedy[6:]
    with pytest.raises(AssertionError, match="part at 5"):
        assert_same_up_to_ties(model, [prompt], [parted], [greedy])
    with torch.no_grad():
        model.to_logits.weight.zero_()
    assert_same_up_to_ties(model, [prompt], [parted], [greedy])


def test_samples_depend_on_the_seed_alone_and_leave_the_callers_rng_alone():
    model, prompt = small_model(), b"abc"
    torch.manual_seed(123)
    state = torch.get_rng_state()
    first = generate(model, prompt, 20, samples=3, seed=5)
    assert torch.equal(torch.get_rng_state(), state)
    assert generate(model, prompt, 20, samples=3, seed=5) == first
    assert generate(model, prompt, 20, samples=3, seed=6) != first
    assert len(first) == 3 and all(len(text) == 20 for text in first)
    assert len(set(first)) > 1  # a batch of samples, not one sample repeated


def test_each_steps_bytes_reach_the_callback_as_they_are_drawn():
    model, steps = small_model(), []
    texts = generate(model, b"abc", 9, samples=2, seed=3, on_bytes=steps.append)
    assert len(steps) == 9 and all(len(step) == 2 for step in steps)
    assert [bytes(column) for column in zip(*steps)] == texts == generate(model, b"abc", 9, samples=2, seed=3)


def test_prompts_of_different_lengths_get_their_own_continuations():
    model = small_model()
    texts = generate(model, [b"ab", b"Hello ", b"xyz"], 7, samples=2, temperature=0.0)
    assert len(texts) == 6 and all(len(text) == 7 for text in texts)
    for index, prompt in enumerate([b"ab", b"Hello ", b"xyz"]):
        assert texts[2 * index: 2 * index + 2] == generate(model, prompt, 7, samples=2, temperature=0.0)


def test_cli_decodes_several_prompts(run_dir, capsys):
    assert main(["--checkpoint", str(run_dir), "--prompt", "Hi", "--prompt", "Hello", "--length", "5",
                 "--samples", "2", "--temperature", "0"]) == 0
    printed = capsys.readouterr().out
    texts = generate(small_model(), [b"Hi", b"Hello"], 5, samples=2, temperature=0.0)
    expected = "".join(
        f"--- prompt {p + 1} of 2, sample {s + 1} of 2\n" + (prompt + texts[2 * p + s]).decode(errors="replace") + "\n"
        for p, prompt in enumerate([b"Hi", b"Hello"]) for s in range(2)
    )
    assert printed == expected
    assert main(["--checkpoint", str(run_dir), "--prompt", "Hi", "--prompt", "Hello", "--length", "5"]) == 0
    assert capsys.readouterr().out.startswith("--- prompt 1 of 2\nHi")


def test_cli_prints_the_prompt_and_its_continuation(run_dir, capsys):
    """One sample streams out byte by byte; the text is the whole continuation's decoding."""
    assert main(["--checkpoint", str(run_dir), "--prompt", "Hello", "--length", "16", "--temperature", "0"]) == 0
    printed = capsys.readouterr().out
    continuation = generate(small_model(), b"Hello", 16, temperature=0.0)[0]
    assert printed == (b"Hello" + continuation).decode("utf-8", errors="replace") + "\n"


def test_cli_reads_the_prompt_from_a_file_and_numbers_several_samples(run_dir, tmp_path, capsys):
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_bytes("naïve\n".encode())
    assert main(["--checkpoint", str(run_dir), "--prompt-file", str(prompt_file), "--length", "8",
                 "--samples", "2"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("--- sample 1 of 2\nnaïve\n")
    assert "--- sample 2 of 2\nnaïve\n" in printed


def test_prompts_keep_bytes_that_are_not_utf8(run_dir, capsys):
    """The command line hands such bytes over as surrogate escapes; they are the prompt."""
    prompt = os.fsdecode(b"\xffab")
    assert main(["--checkpoint", str(run_dir), "--prompt", prompt, "--length", "4", "--temperature", "0"]) == 0
    continuation = generate(small_model(), b"\xffab", 4, temperature=0.0)[0]
    assert capsys.readouterr().out == (b"\xffab" + continuation).decode("utf-8", errors="replace") + "\n"


def test_a_tiny_temperature_samples_the_greedy_bytes():
    model, prompt = small_model(), b"tiny "
    assert generate(model, prompt, 16, temperature=1e-45) == generate(model, prompt, 16, temperature=0.0)


def test_cli_runs_as_a_module(run_dir):
    result = subprocess.run(
        [sys.executable, "-m", "native_sparse_attention.generate", "--checkpoint", str(run_dir),
         "--prompt", "x", "--length", "4"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("x")


def full_attention_run(tmp_path: Path) -> Path:
    save_checkpoint(small_model(use_sparse_attn=False, num_tokens=100), tmp_path)
    return tmp_path


@pytest.mark.parametrize(
    "overrides, message",
    [
        (lambda run, tmp: {"--length": "0"}, "--length must be at least 1, got 0"),
        (lambda run, tmp: {"--samples": "0"}, "--samples must be at least 1, got 0"),
        (lambda run, tmp: {"--temperature": "-1"}, "--temperature must be a finite number >= 0, got -1.0"),
        (lambda run, tmp: {"--temperature": "nan"}, "--temperature must be a finite number >= 0, got nan"),
        (lambda run, tmp: {"--filter-thres": "1"}, r"--filter-thres must be in \[0, 1\), got 1.0"),
        (lambda run, tmp: {"--prompt": ""}, "the prompt must not be empty"),
        (lambda run, tmp: {"--prompt": None, "--prompt-file": str(tmp / "missing.txt")},
         "could not read --prompt-file: No such file or directory"),
        (lambda run, tmp: {"--checkpoint": str(tmp / "missing.pt")}, "missing.pt does not exist"),
        (lambda run, tmp: {"--checkpoint": str(tmp)}, "holds no checkpoint"),
        (lambda run, tmp: {"--checkpoint": str(full_attention_run(tmp)), "--prompt": "é"},
         "the prompt holds byte 195, outside this model's 100-token vocabulary"),
        (lambda run, tmp: {"--device": "cpu", "--cuda-graph": True}, "--cuda-graph needs CUDA"),
    ],
    ids=["length", "samples", "temperature", "nan-temperature", "filter-thres", "empty-prompt", "missing-prompt-file",
         "missing-checkpoint", "run-without-checkpoint", "byte-outside-vocabulary", "cuda-graph-on-cpu"],
)
def test_cli_rejects_bad_input_in_one_line_with_exit_code_2(overrides, message, run_dir, tmp_path, capsys):
    """``overrides`` of the valid arguments: None drops a flag, True passes it bare."""
    flags = {"--checkpoint": str(run_dir), "--prompt": "hi", **overrides(run_dir, tmp_path)}
    argv = []
    for flag, value in flags.items():
        argv += [] if value is None else [flag] if value is True else [flag, value]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1
    assert error.startswith("python -m native_sparse_attention.generate: error: ")
    assert re.search(message, error)


def test_non_causal_checkpoints_are_refused(tmp_path, capsys):
    save_checkpoint(small_model(causal=False), tmp_path)
    with pytest.raises(SystemExit):
        main(["--checkpoint", str(tmp_path), "--prompt", "hi"])
    assert "non-causal model, which cannot generate" in capsys.readouterr().err


def test_graphs_are_the_default_only_where_they_can_run(monkeypatch, run_dir):
    """On the CPU the default decodes eagerly; asking for graphs there is refused above."""
    used = []
    monkeypatch.setattr(generate_module, "generate", lambda *args, **kwargs: used.append(kwargs) or [b""])
    main(["--checkpoint", str(run_dir), "--prompt", "hi", "--device", "cpu"])
    assert used[0]["use_cuda_graph"] is False


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graphed_decoding_on_cuda_gives_the_eager_bytes():
    """Triton layers decode each step from a CUDA graph by default; greedy decoding makes
    the same bytes as eager cached steps, up to ties of the logits."""
    kernel_kwargs = dict(sliding_window_size=32, compress_block_size=16, compress_block_sliding_stride=8,
                         selection_block_size=16, num_selected_blocks=2, use_triton_kernel=True)
    model = small_model(sparse_attn_kwargs=kernel_kwargs).cuda()
    assert model.has_graphable_decoding()
    prompt = b"The sparse layer "
    graphed = generate(model, prompt, 60, temperature=0.0, use_cuda_graph=True)
    assert_same_up_to_ties(model, [prompt], graphed, generate(model, prompt, 60, temperature=0.0))
    # Prompts of different lengths decode as one batch, replayed or eagerly alike.
    prompts = [prompt, b"A", b"Decoding with a cache of its own, row by row "]
    graphed = generate(model, prompts, 40, temperature=0.0, use_cuda_graph=True)
    assert [len(text) for text in graphed] == [40, 40, 40]
    assert_same_up_to_ties(model, prompts, graphed, generate(model, prompts, 40, temperature=0.0))
