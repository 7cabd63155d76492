"""Continue a text with a byte-level language model that ``train.py`` saved.

Command line (a checkpoint, or the latest one of a run directory)::

    python -m native_sparse_attention.generate --checkpoint runs/enwik8-sparse \\
        --prompt "The history of " --length 512
    python -m native_sparse_attention.generate --checkpoint runs/enwik8-sparse \\
        --prompt "The history of " --prompt "In 1905, " --length 256 --samples 2

prints the prompt followed by what the model writes after it, byte by byte as it is drawn
(with ``--samples`` above 1, or several ``--prompt``, each continuation once all are
done). Decoding runs one byte per step through the layers' caches, the prompts' samples
in one batch where the model allows (``generate``); on CUDA, with full attention or sparse
layers on the Triton kernels, each step replays from a CUDA graph (``Transformer.sample``).
Invalid arguments end the program with one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import codecs
import math
import os
import sys
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

import torch

from native_sparse_attention.checkpoint import load_model
from native_sparse_attention.cli import add_device_argument, checkpoint_parser, exit_with_error, resolve_device
from native_sparse_attention.transformer import Transformer, autocast

__all__ = ["generate", "main"]


def generate(model: Transformer, prompt: bytes | Sequence[bytes], length: int, *, samples: int = 1,
             temperature: float = 1.0, filter_thres: float = 0.9, seed: int = 0, use_cuda_graph: bool = False,
             on_bytes: Callable[[list[int]], None] | None = None) -> list[bytes]:
    """``samples`` continuations of ``prompt``, or of each of several prompts, ``length``
    bytes each, from ``model`` on its device (bf16 autocast on CUDA): every prompt's
    samples in turn. Prompts of one length decode as one batch, and so do prompts of
    different lengths with full attention, and on CUDA with sparse layers on the Triton
    kernels; elsewhere each prompt's samples are a batch of their own. The same seed gives
    the same bytes on the same device; the caller's random state is left as it was.
    ``on_bytes`` receives each step's byte of every sample of the batch as it is drawn."""
    prompts = [prompt] if isinstance(prompt, bytes) else list(prompt)
    device = next(model.parameters()).device
    rows = [torch.tensor(list(p), dtype=torch.long, device=device) for p in prompts for _ in range(samples)]
    options = dict(temperature=temperature, filter_thres=filter_thres, use_cache_kv=True,
                   use_cuda_graph=use_cuda_graph,
                   on_token=None if on_bytes is None else lambda tokens: on_bytes(tokens.tolist()))
    # manual_seed seeds every GPU, so every GPU's state is put back.
    gpus = list(range(torch.cuda.device_count())) if device.type == "cuda" else []
    with torch.random.fork_rng(devices=gpus), autocast(device):
        torch.manual_seed(seed)
        if len({len(p) for p in prompts}) == 1:
            batches = [torch.stack(rows)]
        elif model.has_graphable_decoding() and (device.type == "cuda" or not model.config["use_sparse_attn"]):
            batches = [rows]
        else:
            batches = [torch.stack(rows[start:start + samples]) for start in range(0, len(rows), samples)]
        generated = []
        for batch in batches:
            final_lengths = [len(row) + length for row in batch]
            generated += model.sample(batch, final_lengths if isinstance(batch, list) else final_lengths[0], **options)
    return [bytes(row.tolist()) for row in generated]


def _parse_args(argv: Sequence[str] | None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    parser = checkpoint_parser(
        "generate", "Continue a text with a train.py checkpoint and print the prompt and its continuation."
    )
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", action="append", help="text to continue (its UTF-8 bytes are the tokens); "
                        "repeat it for several prompts, decoded as one batch")
    prompt.add_argument("--prompt-file", type=Path, action="append", help="file whose bytes are the text to "
                        "continue; repeat it for several prompts")
    parser.add_argument("--length", type=int, default=256, help="bytes to generate (default: 256)")
    parser.add_argument("--samples", type=int, default=1, help="continuations of the prompt, decoded as one batch "
                        "(default: 1)")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature; 0 decodes greedily "
                        "(default: 1.0)")
    parser.add_argument("--filter-thres", type=float, default=0.9, help="sample among the top 1 - FILTER_THRES "
                        "fraction of the bytes (default: 0.9)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling (default: 0)")
    add_device_argument(parser, "decode")
    parser.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=None,
                        help="replay each decoding step from a CUDA graph (CUDA, with full attention or sparse "
                        "layers on the triton backend; default: on wherever those hold)")
    return parser, parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    parser, args = _parse_args(argv)
    fail = partial(exit_with_error, parser)
    if args.length < 1:
        fail(f"--length must be at least 1, got {args.length}")
    if args.samples < 1:
        fail(f"--samples must be at least 1, got {args.samples}")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        fail(f"--temperature must be a finite number >= 0, got {args.temperature}")
    if not 0 <= args.filter_thres < 1:
        fail(f"--filter-thres must be in [0, 1), got {args.filter_thres}")
    device = resolve_device(parser, args.device)
    if args.prompt_file is not None:
        prompts = []
        for path in args.prompt_file:
            try:
                prompts.append(path.read_bytes())
            except OSError as error:
                fail(f"could not read --prompt-file: {error.strerror}: {path}")
    else:
        prompts = [os.fsencode(text) for text in args.prompt]  # the bytes given, even those that are not UTF-8
    if not all(prompts):
        fail("the prompt must not be empty")

    try:
        model = load_model(args.checkpoint)
    except ValueError as error:
        fail(str(error))
    if not model.causal:
        fail(f"{args.checkpoint} holds a non-causal model, which cannot generate")
    num_tokens = model.config["num_tokens"]
    largest = max(max(prompt) for prompt in prompts)
    if largest >= num_tokens:
        fail(f"the prompt holds byte {largest}, outside this model's {num_tokens}-token vocabulary")
    graphable = device.type == "cuda" and model.has_graphable_decoding()
    if args.cuda_graph and not graphable:
        fail("--cuda-graph needs CUDA, and a model whose sparse attention (if any) runs on the triton backend")
    use_cuda_graph = graphable if args.cuda_graph is None else args.cuda_graph

    options = dict(samples=args.samples, temperature=args.temperature, filter_thres=args.filter_thres,
                   seed=args.seed, use_cuda_graph=use_cuda_graph)
    if args.samples == 1 and len(prompts) == 1:
        # One continuation streams out byte by byte, decoded as UTF-8 once its sequences complete.
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        write = partial(_write, decoder)
        write(prompts[0])
        generate(model.to(device), prompts[0], args.length, on_bytes=lambda step: write(bytes(step)), **options)
        write(b"", final=True)
        print(flush=True)
        return 0
    texts = iter(generate(model.to(device), prompts, args.length, **options))
    for prompt_index, prompt in enumerate(prompts):
        for sample_index in range(args.samples):
            headings = [f"prompt {prompt_index + 1} of {len(prompts)}"] if len(prompts) > 1 else []
            if args.samples > 1:
                headings.append(f"sample {sample_index + 1} of {args.samples}")
            print(f"--- {', '.join(headings)}")
            print((prompt + next(texts)).decode("utf-8", errors="replace"), flush=True)
    return 0


def _write(decoder: codecs.IncrementalDecoder, data: bytes, final: bool = False) -> None:
    sys.stdout.write(decoder.decode(data, final=final))
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
