"""Random layer configurations: the Triton path (under the interpreter, float32) against the
PyTorch path, for as many seeds as asked. Each seed draws a configuration (head counts and
groups, head dims that are no power of two, compression windows that overlap or not,
selection blocks, windows, memory keys, shared or per-head selections, straight-through
gates, causal or not), a length and a batch, then compares a training step's output and
gradients, for causal layers one with two packed documents, and decoding after a prefill
(token by token, in chunks, or through a static cache whose steps may split their work).

    python tests/fuzz_layer.py --first-seed 0 --seeds 200

``--device cuda`` runs the same comparison with the compiled kernels on a GPU (float32,
whose dots the kernels keep in float32), where ``--max-len`` can draw longer sequences
than the interpreter affords. Each configuration compiles kernels of its own, so a seed
takes about a minute on an H100 (torch 2.11, triton 3.6), almost all of it compiling:

    python tests/fuzz_layer.py --device cuda --max-len 400 --seeds 100

``--deterministic`` runs each comparison under ``torch.use_deterministic_algorithms``,
where the selection's dK / dV chunks store partial sums that a kernel then adds in order;
chunks of 3 or 16 entries, drawn per seed, give blocks several of them (the draw of the
rest is unchanged).

``--pytorch-only`` checks the PyTorch path against itself instead, in float64 and much
faster (hundreds of seeds a minute): decoding after a prefill against the parallel forward
(the same tokens must give the same outputs whatever follows them), and packed documents
against each document alone.

Prints each mismatch or error with the seed that reproduces it (``--first-seed S --seeds 1``)
and exits 1 if there was any. CI runs a few seeds of each mode (``test_layer_gpu.py``,
``test_sparse_attention.py``), so that this stays runnable.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import traceback
from collections.abc import Sequence
from dataclasses import replace

if __name__ == "__main__":
    # Before triton is imported: the Triton path runs under the interpreter, on CPU tensors.
    _device = argparse.ArgumentParser(add_help=False)
    _device.add_argument("--device", default="cpu")
    if _device.parse_known_args()[0].device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import conftest  # noqa: E402,F401 (the interpreter's fixes, as in a test session)
import pytest  # noqa: E402
import torch  # noqa: E402
import test_layer_gpu as layer_tests  # noqa: E402
from tqdm import tqdm  # noqa: E402

from native_sparse_attention import SparseAttention  # noqa: E402
from native_sparse_attention.kernels import compressed  # noqa: E402
from native_sparse_attention.kernels import selection as selection_kernels  # noqa: E402
from native_sparse_attention.training import deterministic_algorithms  # noqa: E402

# Relative errors the float32 paths stay within (as in test_layer_gpu's interpreted tests).
OUTPUT_TOLERANCE, GRADIENT_TOLERANCE = 1e-5, 1e-4
# Decoding steps are the interpreter's slowest part: at most this many after the prefill.
MOST_DECODED = 12


def draw_config(rng: random.Random) -> dict:
    """A valid SparseAttention configuration, small enough for the interpreter."""
    kv_heads = rng.choice([1, 1, 2, 3])
    stride = rng.choice([2, 4, 8])
    selection_block = max(16, stride * rng.choice([2, 4, 8]))
    return dict(
        dim=rng.choice([16, 32, 48]), dim_head=rng.choice([8, 16, 24, 32, 40, 64]),
        heads=kv_heads * rng.choice([1, 2, 3, 4, 5]), kv_heads=kv_heads,
        sliding_window_size=rng.choice([0, 1, 5, 16, 33, 80]),
        compress_block_size=stride * rng.choice([1, 2, 3]) + rng.choice([0, 0, stride // 2]),
        compress_block_sliding_stride=stride, selection_block_size=selection_block - selection_block % stride,
        num_selected_blocks=rng.choice([0, 1, 2, 3, 5]), num_compressed_mem_kv=rng.choice([0, 1, 3]),
        causal=rng.random() < 0.8, query_heads_share_selected_kv=rng.random() < 0.6,
        use_diff_topk=rng.random() < 0.3,
    )


def _document_errors(fast, reference, x, grad_out, cut: int) -> list[str]:
    ids = (torch.arange(x.shape[1], device=x.device) >= cut).long().expand(x.shape[0], -1)
    runs = []
    for layer in (fast, reference):
        inputs = x.detach().clone().requires_grad_()
        out = layer(inputs, document_ids=ids)
        out.backward(grad_out)
        runs.append((out.detach(), inputs.grad))
    (out, dx), (ref_out, ref_dx) = runs
    errors = {"out": layer_tests._relative_error(out, ref_out), "dx": layer_tests._relative_error(dx, ref_dx)}
    return [f"documents split at {cut}: {errors}"] if not max(errors.values()) < OUTPUT_TOLERANCE else []


def _decoding_errors(fast, x, expected, rng: random.Random, monkeypatch) -> list[str]:
    n = x.shape[1]
    prefill = max(rng.randint(1, n - 1), n - MOST_DECODED)
    monkeypatch.setattr(compressed, "_FEW_ROWS_PROGRAMS_PER_SM", rng.choice([2, 64]))
    kind = rng.choice(["tokens", "chunks", "static"])
    fast.eval()
    with torch.no_grad():
        if kind == "tokens" or (kind == "chunks" and n - prefill < 3):
            out = layer_tests._decode(fast, x, prefill)
        elif kind == "chunks":
            out = layer_tests._decode(fast, x, prefill, chunks=(2,))
        else:
            out = layer_tests._decode_static(fast, x, prefill, capacity=n + rng.randint(0, 9))
    error = layer_tests._relative_error(out[:, prefill:], expected[:, prefill:])
    return [f"decoding ({kind}) after {prefill}: {error:.2e}"] if not error < OUTPUT_TOLERANCE else []


def _report(line: str, problems: Sequence[str] = (), error: str | None = None) -> tuple[bool, str]:
    """(whether the seed passed, its line followed by its mismatches or its error)."""
    if error is not None:
        return False, f"{line}\nERROR {error}"
    return not problems, line + "".join(f"\nMISMATCH {problem}" for problem in problems)


def check(seed: int, device: str = "cpu", max_len: int = 70, deterministic: bool = False) -> tuple[bool, str]:
    """(whether the paths agree, a line naming the seed, the draw and any mismatch). The
    draws of a seed do not depend on ``device`` or ``deterministic``; a ``max_len`` other
    than 70 changes them."""
    rng = random.Random(seed)
    config, n, batch = draw_config(rng), rng.randint(1, max_len), rng.choice([1, 2])
    line = f"seed {seed}: n={n} batch={batch} {config}"
    with pytest.MonkeyPatch.context() as monkeypatch, deterministic_algorithms(deterministic):
        try:
            if deterministic:
                chunk = random.Random(-seed - 1).choice([3, 16])
                line += f" deterministic, dK / dV chunks of {chunk}"
                tuned = selection_kernels.default_launch_config
                monkeypatch.setattr(selection_kernels, "default_launch_config",
                                    lambda *args, **kwargs: replace(tuned(*args, **kwargs), dkv_chunk=chunk))
            fast, reference = (layer.to(device) for layer in layer_tests._sharpened_pair(monkeypatch, config))
            torch.manual_seed(seed)
            x = torch.randn(batch, n, config["dim"], device=device)
            grad_out = torch.randn_like(x)
            (out, dx, grads), (ref_out, ref_dx, ref_grads) = (layer_tests._run(layer, x, grad_out)
                                                              for layer in (fast, reference))
            problems = []
            errors = {"out": layer_tests._relative_error(out, ref_out), "dx": layer_tests._relative_error(dx, ref_dx)}
            if not max(errors.values()) < OUTPUT_TOLERANCE:
                problems.append(f"training {errors}")
            gradient_errors = {name: error for name, error in layer_tests._gradient_errors(grads, ref_grads).items()
                               if not error < GRADIENT_TOLERANCE}
            if gradient_errors:
                problems.append(f"parameter gradients {gradient_errors}")
            block = config["selection_block_size"]
            if config["causal"] and n >= 2 * block:
                problems += _document_errors(fast, reference, x, grad_out, block * rng.randint(1, n // block - 1))
            if config["causal"] and n >= 3:
                problems += _decoding_errors(fast, x, ref_out, rng, monkeypatch)
        except Exception:
            return _report(line, error=traceback.format_exc())
    return _report(line, problems)


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """In the tensors' own dtype (test_layer_gpu's casts to float32, whose rounding alone
    exceeds the float64 checks' tolerance)."""
    return ((actual - expected).norm() / expected.norm()).item()


def check_pytorch_path(seed: int) -> tuple[bool, str]:
    """``check``'s counterpart for ``--pytorch-only``: the PyTorch path against itself."""
    rng = random.Random(seed)
    config, n, batch = draw_config(rng), rng.randint(2, 70), rng.choice([1, 2])
    config["causal"] = True
    line = f"seed {seed}: n={n} batch={batch} {config}"
    try:
        torch.manual_seed(seed)
        layer = SparseAttention(**config).double().eval()
        problems = []
        with torch.no_grad():
            layer.to_qkv.weight.mul_(4.0)
            x = torch.randn(batch, n, config["dim"], dtype=torch.float64)
            whole = layer(x)
            prefill = rng.randint(1, n - 1)
            chunks = (rng.randint(2, n - prefill - 1),) if n - prefill >= 4 and rng.random() < 0.5 else ()
            error = _relative_error(layer_tests._decode(layer, x, prefill, chunks)[:, prefill:], whole[:, prefill:])
            if not error < 1e-9:
                problems.append(f"decoding after {prefill} (chunks {chunks}): {error:.2e}")
            problems += _documents_alone_errors(layer, config, rng)
    except Exception:
        return _report(line, error=traceback.format_exc())
    return _report(line, problems)


def _documents_alone_errors(layer, config: dict, rng: random.Random) -> list[str]:
    """2 to 4 documents of random lengths packed in one row, each starting at a multiple of
    the selection block, against each document alone."""
    block = config["selection_block_size"]
    lengths = [rng.randint(1, 3 * block) for _ in range(rng.randint(2, 4))]
    spans = [-(-length // block) * block for length in lengths]
    starts = [sum(spans[:i]) for i in range(len(spans))]
    x = torch.randn(1, sum(spans), config["dim"], dtype=torch.float64)
    document_ids = torch.repeat_interleave(torch.arange(len(spans)), torch.tensor(spans))[None]
    packed = layer(x, document_ids=document_ids)
    errors = [_relative_error(packed[:, start:start + length], layer(x[:, start:start + length]))
              for start, length in zip(starts, lengths)]
    return [f"documents {lengths} packed against alone: {max(errors):.2e}"] if not max(errors) < 1e-9 else []


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--seeds", type=int, default=100, help="how many seeds, from the first")
    parser.add_argument("--verbose", action="store_true", help="print every seed, not only failures")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cpu: the kernels under the Triton interpreter; cuda: compiled, on the GPU")
    parser.add_argument("--max-len", type=int, default=70, help="the longest sequence drawn")
    parser.add_argument("--deterministic", action="store_true",
                        help="under torch.use_deterministic_algorithms, in small dK / dV chunks (module docstring)")
    parser.add_argument("--pytorch-only", action="store_true",
                        help="the PyTorch path against itself: decoding and documents (module docstring)")
    args = parser.parse_args(argv)
    if args.pytorch_only and (args.device != "cpu" or args.max_len != 70 or args.deterministic):
        parser.error("--pytorch-only draws its own lengths and runs on the CPU, without the kernels")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA device")
    if args.max_len < 1:
        parser.error("--max-len must be at least 1")
    if args.pytorch_only:
        check_seed = check_pytorch_path
    else:
        def check_seed(seed):
            return check(seed, args.device, args.max_len, args.deterministic)
    failures = 0
    for seed in tqdm(range(args.first_seed, args.first_seed + args.seeds), unit="seed"):
        ok, line = check_seed(seed)
        failures += not ok
        if args.verbose or not ok:
            tqdm.write(line)
    print(f"{failures} of {args.seeds} seeds failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
