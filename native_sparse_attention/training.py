"""Byte-level language-model training with NSA or full attention: ``python train.py``.

Settings come from a preset (``enwik8``: the GPU toy run; ``tiny``: a CPU run of a minute
or two) overridden by command-line flags; ``python train.py --help`` lists them. A run writes to
its run directory:

- ``config.json``: the resolved settings, plus a ``run`` section (corpus, device,
  attention backend, CUDA graphs or not, world size, parameter count);
- ``metrics.jsonl``: one JSON object per logged step: ``step``, ``loss`` (nats),
  ``bpb``, ``lr``, ``grad_norm``, ``tokens_per_s``, ``val_loss`` / ``val_bpb`` on
  validation steps, and with CUDA ``peak_memory_gib``, the most memory PyTorch held
  allocated since the record before (the first: since the loop began);
- ``loss_curve.png``: train and validation bits per byte against step, overlaid with the
  comparable runs beside it (see ``plotting.py``);
- ``samples.txt``: text generated with the KV cache from a fixed validation prompt;
- ``checkpoints/step-XXXXXXXX.pt`` (see ``checkpoint.py``): every ``--checkpoint-every``
  steps, at the end, on the first Ctrl-C or SIGTERM (after the step in flight), and when
  the loop crashes.

``--resume`` continues the run from its latest checkpoint: weights, optimizer, data
order and RNG state, so the losses it logs are those of an uninterrupted run (bit for bit
on the CPU). Under ``torchrun`` every rank trains on its own data stream, the gradients
averaged over the ranks (after the replayed steps by one all-reduce, ``flat_gradients``;
eager steps under DistributedDataParallel); rank 0 logs, samples and saves. Usage errors
and unusable data end the program with one line on stderr and exit code 2; a loss that
stops being finite with exit code 1, without checkpointing the broken weights.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist

from native_sparse_attention.checkpoint import (
    atomic_write,
    checkpoint_step,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from native_sparse_attention.data import (
    ENWIK8,
    STDLIB,
    DataError,
    RandomOffsetSampler,
    load_corpus,
    split_corpus,
    validation_offsets,
    windows,
)
from native_sparse_attention.cuda_graph import GraphedLoss, GraphedLossBackward
from native_sparse_attention.generate import generate
from native_sparse_attention.transformer import Transformer, autocast

__all__ = [
    "PRESETS",
    "Diverged",
    "TrainConfig",
    "Trainer",
    "UsageError",
    "autocast",
    "build_model",
    "build_optimizer",
    "cuda_graph_possible",
    "deterministic_algorithms",
    "evaluate",
    "flat_gradients",
    "learning_rate",
    "main",
    "resolve_config",
    "train",
    "train_step",
]

ATTENTIONS = ("sparse", "full")
BACKENDS = ("triton", "flex", "pytorch")
NUM_TOKENS = 256  # bytes
T = TypeVar("T")
MIN_LR_RATIO = 0.1  # where the cosine schedule ends, relative to --lr


class UsageError(Exception):
    """Flags that cannot be honoured; the message is one line meant for the user."""


class Diverged(Exception):
    """The loss or the gradient norm stopped being finite; the weights are no longer worth saving."""


def _setting(default, help: str, type=None, minimum=None, choices=None):
    return field(default=default, metadata=dict(help=help, type=type, minimum=minimum, choices=choices))


@dataclass(frozen=True)
class TrainConfig:
    """Every setting of a run. The defaults are the ``enwik8`` preset."""

    preset: str | None = _setting(None, "enwik8: the GPU toy run; tiny: a small CPU run "
                                        "(default: enwik8 with CUDA, tiny without)", str, choices=None)
    attn: str = _setting("sparse", "sparse: Native Sparse Attention; full: dense attention (SDPA), the baseline",
                         str, choices=ATTENTIONS)
    backend: str | None = _setting(None, "how sparse attention runs: triton kernels, FlexAttention or the "
                                         "PyTorch reference (default: triton with CUDA, pytorch without)",
                                   str, choices=BACKENDS)
    dim: int = _setting(512, "model width", int, 1)
    depth: int = _setting(6, "number of layers", int, 1)
    heads: int = _setting(8, "query heads", int, 1)
    dim_head: int = _setting(64, "width of each head", int, 2)
    kv_heads: int = _setting(4, "key/value heads (grouped-query attention)", int, 1)
    seq_len: int = _setting(512, "bytes per training sequence", int, 1)
    sliding_window: int = _setting(64, "sliding-window size of sparse attention", int, 0)
    compress_block: int = _setting(16, "tokens per compressed block", int, 1)
    compress_stride: int = _setting(8, "distance between compressed blocks", int, 1)
    selection_block: int = _setting(16, "tokens per selectable block", int, 1)
    num_selected: int = _setting(4, "selected blocks per query", int, 0)
    batch_size: int = _setting(16, "sequences per micro-batch (per rank)", int, 1)
    grad_accum: int = _setting(1, "micro-batches per optimizer step", int, 1)
    steps: int = _setting(10_000, "optimizer steps of the whole run", int, 1)
    lr: float = _setting(6e-4, "peak learning rate (AdamW)", float, 0.0)
    lr_schedule: str = _setting("constant", "after warm-up: constant, or cosine decay to "
                                            f"{MIN_LR_RATIO:g} x lr at --steps", str, choices=("constant", "cosine"))
    warmup_steps: int = _setting(100, "linear learning-rate warm-up", int, 0)
    weight_decay: float = _setting(0.1, "AdamW weight decay of the weight matrices", float, 0.0)
    grad_clip: float = _setting(1.0, "gradient-norm clipping threshold (0: no clipping)", float, 0.0)
    compile: bool = _setting(False, "torch.compile the model", bool)
    activation_checkpointing: bool = _setting(False, "recompute each layer's activations in the backward instead "
                                                     "of keeping them: less memory for long sequences, for a "
                                                     "second forward of every layer", bool)
    deterministic: bool = _setting(False, "torch.use_deterministic_algorithms for the run, so that it repeats "
                                          "bit for bit on the same GPU and software (slower: the sparse layers' "
                                          "kernels then add no floats atomically)", bool)
    cuda_graph: bool | None = _setting(None, "replay each micro-batch's forward and backward, the validation "
                                              "batches and the samples' decoding steps from CUDA graphs (CUDA, "
                                              "the triton backend or full attention, no --compile; default: "
                                              "on wherever those hold)", bool)
    data: str | None = _setting(None, "enwik8 (downloaded to DATA_DIR/enwik8.gz when missing), stdlib (the Python "
                                      "standard library's source) or a path to any file of bytes, plain or "
                                      ".gz (default: enwik8, or stdlib when it cannot be downloaded)", str)
    data_dir: str = _setting("data", "folder that keeps enwik8.gz; saved as an absolute path, so that resumed "
                                     "runs and the evaluate command find it from anywhere", str)
    seed: int = _setting(0, "seed of the initialisation and of the data order", int)
    device: str | None = _setting(None, "cuda or cpu (default: cuda when available)", str, choices=("cuda", "cpu"))
    log_every: int = _setting(10, "steps between metrics records", int, 1)
    val_every: int = _setting(250, "steps between validation passes (0: only at the end)", int, 0)
    val_batches: int = _setting(16, "micro-batches per validation pass", int, 1)
    sample_every: int = _setting(1000, "steps between text samples (0: never)", int, 0)
    sample_len: int = _setting(256, "bytes generated per sample", int, 1)
    prime_len: int = _setting(128, "bytes of validation text that prompt each sample", int, 1)
    checkpoint_every: int = _setting(1000, "steps between checkpoints (0: only at the end)", int, 0)
    keep_checkpoints: int = _setting(3, "checkpoints kept (the newest)", int, 1)


PRESETS: dict[str, dict] = {
    "enwik8": {},
    "tiny": dict(
        dim=64, depth=2, heads=4, dim_head=16, kv_heads=2, seq_len=128, sliding_window=32,
        compress_block=16, compress_stride=8, selection_block=16, num_selected=2,
        batch_size=8, steps=50, lr=2e-3, warmup_steps=5, log_every=5, val_every=25, val_batches=4,
        sample_every=50, sample_len=64, prime_len=32, checkpoint_every=25,
    ),
}

# Settings a resumed run cannot change: they shape the weights.
_ARCHITECTURE = ("attn", "dim", "depth", "heads", "dim_head", "kv_heads", "compress_block", "compress_stride",
                 "selection_block", "num_selected", "sliding_window")


# ---------------------------------------------------------------------------- command line


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(message)


def _bounded(kind, minimum):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {kind.__name__}, got {text!r}") from None
        if minimum is not None and value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {text}")
        return value

    parse.__name__ = kind.__name__
    return parse


def _help(name: str, text: str) -> str:
    """The flag's help with the presets' values of its setting."""
    values = {preset: overrides.get(name, TrainConfig.__dataclass_fields__[name].default)
              for preset, overrides in PRESETS.items()}
    distinct = set(map(repr, values.values()))
    if distinct == {"None"}:
        return text
    if len(distinct) == 1:
        return f"{text} [{next(iter(values.values()))}]"
    return f"{text} [{', '.join(f'{preset}: {value}' for preset, value in values.items())}]"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="train.py",
        description="Train a byte-level language model with Native Sparse Attention or full attention. "
                    "Flags override the preset's values, shown in brackets.",
        argument_default=argparse.SUPPRESS,  # only explicit flags override the preset
    )
    for setting in fields(TrainConfig):
        meta = setting.metadata
        flag = "--" + setting.name.replace("_", "-")
        if setting.name == "preset":
            parser.add_argument(flag, choices=sorted(PRESETS), help=meta["help"])
            continue
        help = _help(setting.name, meta["help"])
        if meta["type"] is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, help=help)
        else:
            metavar = None if meta["choices"] else {int: "N", float: "X", str: "SPEC"}[meta["type"]]
            parser.add_argument(flag, type=_bounded(meta["type"], meta["minimum"]), choices=meta["choices"],
                                metavar=metavar, help=help)
    parser.add_argument("--run-dir", type=Path, metavar="DIR",
                        help="where the run writes (default: runs/<preset>-<attn>)")
    parser.add_argument("--resume", action="store_true",
                        help="continue the run in --run-dir from its latest checkpoint")
    return parser


def _cuda_available() -> bool:
    return torch.cuda.is_available()


def _check_cuda_graph(config: TrainConfig, use_cuda: bool) -> None:
    """What ``--cuda-graph`` needs, as ``UsageError``s."""
    if not use_cuda:
        raise UsageError("--cuda-graph needs a CUDA device")
    if config.compile:
        raise UsageError("--cuda-graph contradicts --compile: use one of them")
    if config.attn == "sparse" and config.backend not in (None, "triton"):
        raise UsageError(f"--cuda-graph runs sparse attention on the triton backend, not --backend {config.backend}")


def cuda_graph_possible(config: TrainConfig, device: torch.device) -> bool:
    """Whether a run can replay its steps from CUDA graphs: what ``cuda_graph=None`` (the
    default) turns them on for."""
    return (device.type == "cuda" and not config.compile
            and (config.attn == "full" or config.backend in (None, "triton")))


def resolve_config(argv: list[str] | None) -> tuple[TrainConfig, Path, bool]:
    """Flags -> (settings, run directory, resume). A fresh run starts from its preset; a
    resumed one from the settings saved in its run directory. Raises ``UsageError``."""
    flags = vars(build_parser().parse_args(argv))
    resume = flags.pop("resume", False)
    run_dir = flags.pop("run_dir", None)
    if flags.get("device") == "cuda" and not _cuda_available():
        raise UsageError("--device cuda: no CUDA device is available")
    use_cuda = flags.get("device", "cuda" if _cuda_available() else "cpu") == "cuda"
    preset = flags.get("preset") or ("enwik8" if use_cuda else "tiny")
    if run_dir is None:
        run_dir = Path("runs") / f"{preset}-{flags.get('attn', PRESETS[preset].get('attn', 'sparse'))}"

    checkpoint = latest_checkpoint(run_dir)
    if resume:
        if checkpoint is None:
            raise UsageError(f"--resume: no checkpoint in {run_dir / 'checkpoints'}")
        config = _saved_config(run_dir)
        changed = [name for name in _ARCHITECTURE if name in flags and flags[name] != getattr(config, name)]
        if changed:
            name = changed[0]
            raise UsageError(f"--{name.replace('_', '-')} {flags[name]} contradicts the run being resumed "
                             f"({getattr(config, name)}): a resumed run keeps its architecture")
        config = replace(config, **{name: value for name, value in flags.items() if name != "preset"})
        if checkpoint_step(checkpoint) >= config.steps:
            raise UsageError(f"--resume: {checkpoint} is already at step {checkpoint_step(checkpoint)}; "
                             f"pass --steps greater than that to continue")
    else:
        if checkpoint is not None:
            raise UsageError(f"{run_dir} already holds checkpoints: pass --resume to continue that run, "
                             "or choose another --run-dir")
        config = TrainConfig(**{**PRESETS[preset], **flags, "preset": preset})

    if config.attn == "full" and "backend" in flags:
        raise UsageError(f"--backend {flags['backend']} selects how sparse attention runs; "
                         "it contradicts --attn full")
    if config.backend in ("triton", "flex") and not use_cuda:
        raise UsageError(f"--backend {config.backend} needs a CUDA device; use --backend pytorch on the CPU")
    if config.cuda_graph:
        _check_cuda_graph(config, use_cuda)
    if config.prime_len > config.seq_len:
        raise UsageError(f"--prime-len {config.prime_len} must not exceed --seq-len {config.seq_len}")
    # Absolute, so that the saved settings name the same files from any working directory.
    data = config.data if config.data in (None, ENWIK8, STDLIB) else str(Path(config.data).absolute())
    return replace(config, data=data, data_dir=str(Path(config.data_dir).absolute())), Path(run_dir), resume


def _saved_config(run_dir: Path) -> TrainConfig:
    try:
        saved = json.loads((run_dir / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise UsageError(f"--resume: cannot read {run_dir / 'config.json'}: {error}") from None
    names = {setting.name for setting in fields(TrainConfig)}
    return TrainConfig(**{name: value for name, value in saved.items() if name in names})


# ---------------------------------------------------------------------------- model and optimisation


def attention_backend(config: TrainConfig, device: torch.device) -> str | None:
    """The backend sparse attention runs on (None for full attention)."""
    if config.attn == "full":
        return None
    return config.backend or ("triton" if device.type == "cuda" else "pytorch")


def build_model(config: TrainConfig, backend: str | None) -> Transformer:
    sparse_attn_kwargs = dict(
        sliding_window_size=config.sliding_window,
        compress_block_size=config.compress_block,
        compress_block_sliding_stride=config.compress_stride,
        selection_block_size=config.selection_block,
        num_selected_blocks=config.num_selected,
        use_triton_kernel=backend == "triton",
        use_flex_attention=backend == "flex",
    )
    try:
        return Transformer(
            num_tokens=NUM_TOKENS, dim=config.dim, depth=config.depth, heads=config.heads,
            dim_head=config.dim_head, kv_heads=config.kv_heads, causal=True,
            use_sparse_attn=config.attn == "sparse", sparse_attn_kwargs=sparse_attn_kwargs,
            activation_checkpointing=config.activation_checkpointing,
        )
    except (ValueError, TypeError) as error:
        raise UsageError(f"invalid model settings: {error}") from None


def build_optimizer(model: torch.nn.Module, config: TrainConfig) -> torch.optim.AdamW:
    """AdamW; weight matrices (and embeddings) decay, gains and biases do not."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [dict(params=decay, weight_decay=config.weight_decay), dict(params=no_decay, weight_decay=0.0)]
    fused = next(model.parameters()).is_cuda
    return torch.optim.AdamW(groups, lr=config.lr, betas=(0.9, 0.95), fused=fused)


def learning_rate(step: int, config: TrainConfig) -> float:
    """Linear warm-up to ``lr`` over ``warmup_steps``, then constant or cosine decay."""
    warmup = min(1.0, step / config.warmup_steps) if config.warmup_steps else 1.0
    if config.lr_schedule == "constant":
        return config.lr * warmup
    progress = min(1.0, step / config.steps)
    decay = MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * progress))
    return config.lr * warmup * decay


def train_step(model, optimizer, micro_batches: list[torch.Tensor], grad_clip: float, no_sync=None,
               graphed: GraphedLossBackward | None = None, grad_buffers: list[torch.Tensor] | None = None):
    """One optimizer step over ``micro_batches`` (ids [b, n + 1] each, on the model's
    device), gradients averaged over them. ``no_sync`` (DDP's) skips the gradient
    all-reduce of all but the last. ``graphed`` replays each micro-batch's forward and
    backward from its CUDA graph (captured with the loss scale 1 / len(micro_batches)).
    ``grad_buffers`` (``flat_gradients``'s, for a model outside DDP in a distributed run)
    are averaged over the ranks after the last micro-batch.
    Returns (mean loss, gradient norm before clipping), 0-dim tensors."""
    # A graph adds into its own gradient buffers, and flat buffers are views: both stay.
    optimizer.zero_grad(set_to_none=graphed is None and grad_buffers is None)
    total = 0.0
    for index, ids in enumerate(micro_batches):
        if graphed is not None:
            total = total + graphed(ids)
            continue
        last = index == len(micro_batches) - 1
        with nullcontext() if last or no_sync is None else no_sync():
            with autocast(ids.device):
                loss = model(ids, return_loss=True)
            (loss / len(micro_batches)).backward()
        total = total + loss.detach().float()
    if grad_buffers is not None:
        for buffer in grad_buffers:
            dist.all_reduce(buffer)
            buffer.div_(dist.get_world_size())
    max_norm = grad_clip if grad_clip > 0 else math.inf
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    optimizer.step()
    return total / len(micro_batches), grad_norm


def flat_gradients(model: torch.nn.Module) -> list[torch.Tensor]:
    """Gives each parameter of ``model`` that requires a gradient a zero ``.grad`` viewing
    one flat buffer per dtype, and returns the buffers: a replayed graph's backward adds
    into the views, and one all-reduce per buffer averages a step's gradients over the
    ranks, which DistributedDataParallel cannot do for a graph (its hooks run at capture
    only). Each view starts on a 16-byte boundary, as fused optimizers' vector loads want."""
    parameters: dict[torch.dtype, list[torch.nn.Parameter]] = {}
    for parameter in model.parameters():
        if parameter.requires_grad:
            parameters.setdefault(parameter.dtype, []).append(parameter)
    buffers = []
    for dtype, group in parameters.items():
        align = max(1, 16 // group[0].element_size())
        sizes = [-(-parameter.numel() // align) * align for parameter in group]
        buffer = torch.zeros(sum(sizes), dtype=dtype, device=group[0].device)
        offset = 0
        for parameter, size in zip(group, sizes):
            parameter.grad = buffer[offset:offset + parameter.numel()].view_as(parameter)
            offset += size
        buffers.append(buffer)
    return buffers


@torch.no_grad()
def evaluate(model: Transformer, data: torch.Tensor, offsets: torch.Tensor, config: TrainConfig,
             device: torch.device, loss: Callable[[torch.Tensor], torch.Tensor] | None = None) -> float:
    """Mean loss (nats per byte) over the windows at ``offsets``, summed over all ranks;
    each batch's loss from ``loss(ids)`` where given (a replayed graph), else from the model."""
    was_training = model.training
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # loss sum, windows
    for chunk in offsets.split(config.batch_size):
        ids = windows(data, chunk, config.seq_len).to(device)
        if loss is not None:
            batch_loss = loss(ids)
        else:
            with autocast(device):
                batch_loss = model(ids, return_loss=True)
        totals += torch.stack((batch_loss.double() * len(chunk), torch.tensor(len(chunk), device=device)))
    if dist.is_initialized():
        dist.all_reduce(totals)
    model.train(was_training)
    return (totals[0] / totals[1]).item()


def generate_sample(model: Transformer, prompt: torch.Tensor, config: TrainConfig, seed: int,
                    use_cuda_graph: bool = False) -> str:
    """Continue ``prompt: [p]`` by ``sample_len`` bytes (``generate.generate``, each decoding
    step replayed from a CUDA graph with ``use_cuda_graph``), leaving the training RNG untouched."""
    text = generate(model, bytes(prompt.tolist()), config.sample_len, seed=seed, use_cuda_graph=use_cuda_graph)[0]
    return text.decode("utf-8", errors="replace")


# ---------------------------------------------------------------------------- run bookkeeping


@dataclass(frozen=True)
class Runtime:
    """Where this process trains: its device and its place in a distributed run."""

    device: torch.device
    rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def start_runtime(config: TrainConfig) -> Runtime:
    """Join the process group when started by torchrun (NCCL on CUDA, gloo on the CPU)."""
    use_cuda = (config.device or ("cuda" if _cuda_available() else "cpu")) == "cuda"
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if world_size == 1:
        return Runtime(torch.device("cuda" if use_cuda else "cpu"))
    local_rank = int(os.environ["LOCAL_RANK"])
    if use_cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if use_cuda else "gloo")
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    return Runtime(device, dist.get_rank(), dist.get_world_size())


def _load_corpus(config: TrainConfig, runtime: Runtime, announce):
    """Rank 0 finds the corpus (downloading or falling back); the other ranks then read the
    same one, or raise the same error."""
    if not runtime.distributed:
        return load_corpus(config.data, config.data_dir, announce=announce)
    message = [None]
    corpus = None
    if runtime.is_main:
        try:
            corpus = load_corpus(config.data, config.data_dir, announce=announce)
            message = [("ok", corpus.name)]
        except DataError as error:
            message = [("error", str(error))]
    dist.broadcast_object_list(message, src=0)
    status, value = message[0]
    if status == "error":
        raise DataError(value)
    return corpus if runtime.is_main else load_corpus(value, config.data_dir)


class StopSignals:
    """The first SIGINT or SIGTERM asks the loop to stop after the step in flight (it then
    checkpoints and exits); the same signal again acts as usual. Under torchrun a Ctrl-C
    reaches the workers as SIGINT followed by SIGTERM, which therefore still only asks."""

    def __init__(self):
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, self._request)
        return self

    def _request(self, signum, frame) -> None:
        if self.signum is None:
            self.signum = signum
        signal.signal(signum, self._previous[signum])

    def __exit__(self, *exc_info) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


def _append_jsonl(path: Path, record: dict) -> None:
    with path.open("a") as file:
        file.write(json.dumps(record) + "\n")


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop the records a resumed run will log again (those after its checkpoint)."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= step:
                kept.append(line + "\n")
        except (json.JSONDecodeError, KeyError, TypeError):
            continue
    with atomic_write(path) as temporary:
        temporary.write_text("".join(kept))


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _due(step: int, every: int) -> bool:
    return every > 0 and step % every == 0


def describe(config: TrainConfig, run: dict, run_dir: Path) -> str:
    lines = [f"run directory: {run_dir}"]
    lines += [f"  {name:<19}{value}" for name, value in {**asdict(config), **run}.items()]
    return "\n".join(lines)


# ---------------------------------------------------------------------------- the loop


def train(config: TrainConfig, run_dir: Path, resume: bool) -> int:
    """Train as ``config`` says; returns the exit code (0, or 128 + signal number when
    stopped by a signal)."""
    with deterministic_algorithms(config.deterministic):
        runtime = start_runtime(config)
        try:
            return Trainer(config, run_dir, resume, runtime).run()
        finally:
            if runtime.distributed:
                dist.destroy_process_group()


@contextmanager
def deterministic_algorithms(enabled: bool):
    """``torch.use_deterministic_algorithms(True)`` inside when ``enabled``, then as before.
    cuBLAS then needs a fixed workspace, which PyTorch reads from the environment."""
    if not enabled:
        yield
        return
    previous = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])


class Trainer:
    """One run: its data, model, optimizer and run directory, built from the settings (and
    restored from the latest checkpoint when resuming)."""

    def __init__(self, config: TrainConfig, run_dir: Path, resume: bool, runtime: Runtime):
        from tqdm.auto import tqdm

        self.runtime, self.run_dir = runtime, run_dir
        # Eager steps of short sequences wait on Python launching the kernels (on an H100 the
        # enwik8 preset's step takes 54.7 ms eagerly, 10.0 ms replayed), so graphs are the
        # default wherever they work; a failed capture then falls back to eager steps.
        self.cuda_graph = config.cuda_graph
        if self.cuda_graph is None:
            self.cuda_graph = cuda_graph_possible(config, runtime.device)
        self.device, self.is_main = runtime.device, runtime.is_main
        self.log = tqdm.write if self.is_main else (lambda message: None)
        self.plotting = importlib.util.find_spec("matplotlib") is not None
        if not self.plotting:
            self.log("matplotlib is not installed: no loss-curve PNG (pip install matplotlib)")

        corpus = _load_corpus(config, runtime, self.log)
        self.config = config = replace(config, data=corpus.name)  # a resumed run reads the same bytes
        self.train_data, self.val_data = split_corpus(corpus.data, config.seq_len)
        self.backend = attention_backend(config, self.device)
        torch.manual_seed(config.seed)
        self.model = build_model(config, self.backend).to(self.device)
        self.optimizer = build_optimizer(self.model, config)
        self.sampler = RandomOffsetSampler(self.train_data.numel(), config.seq_len, config.batch_size,
                                           config.seed, runtime.rank)
        offsets = validation_offsets(self.val_data.numel(), config.seq_len, config.val_batches * config.batch_size)
        self.val_offsets = offsets[runtime.rank::runtime.world_size]
        self.prompt = self.val_data[:config.prime_len].long().to(self.device)
        self.tokens_per_step = config.batch_size * config.grad_accum * config.seq_len * runtime.world_size

        self.start_step = self._restore() if resume else 0
        # The state after the last completed step, which is what a checkpoint may hold.
        self.done_step, self.saved_step = self.start_step, self.start_step
        self.done_sampler_state = self.sampler.state_dict()
        self._write_run_files(corpus, resume)

        self.step_model, self.no_sync, self.grad_buffers = self.model, None, None
        if runtime.distributed and self.cuda_graph:
            # Graphed steps average their gradients themselves (flat_gradients), from the
            # same weights on every rank, as DistributedDataParallel would broadcast them.
            for parameter in self.model.parameters():
                dist.broadcast(parameter.data, src=0)
            self.grad_buffers = flat_gradients(self.model)
        elif runtime.distributed:
            self.step_model = torch.nn.parallel.DistributedDataParallel(
                self.model, device_ids=[self.device.index] if self.device.type == "cuda" else None
            )
            self.no_sync = self.step_model.no_sync
        self.graphed: GraphedLossBackward | None = None  # captured at the first step
        self.graphed_validation: GraphedLoss | None = None  # at the first validation pass
        if config.compile:
            self.step_model = torch.compile(self.step_model)

    @property
    def metrics_path(self) -> Path:
        return self.run_dir / "metrics.jsonl"

    def _restore(self) -> int:
        path = latest_checkpoint(self.run_dir)
        checkpoint = load_checkpoint(path)
        self.model.load_state_dict(checkpoint["model"])
        self.optimizer.load_state_dict(checkpoint["optimizer"])
        self.sampler.load_state_dict(checkpoint["sampler"])
        torch.set_rng_state(checkpoint["rng"]["torch"])
        if self.device.type == "cuda" and checkpoint["rng"].get("cuda") is not None:
            torch.cuda.set_rng_state(checkpoint["rng"]["cuda"], self.device)
        self.log(f"resuming from {path} (step {checkpoint['step']})")
        return checkpoint["step"]

    def _write_run_files(self, corpus, resume: bool) -> None:
        run = dict(
            corpus=corpus.name, corpus_bytes=corpus.data.numel(), torch_device=str(self.device),
            attention_backend=self.backend, cuda_graph=self.cuda_graph, world_size=self.runtime.world_size,
            num_parameters=sum(p.numel() for p in self.model.parameters()),
            tokens_per_step=self.tokens_per_step, torch=torch.__version__,
        )
        if not self.is_main:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.json").write_text(json.dumps({**asdict(self.config), "run": run}, indent=2) + "\n")
        if resume:
            _truncate_metrics(self.metrics_path, self.start_step)
        else:
            self.metrics_path.write_text("")
        print(describe(self.config, run, self.run_dir), flush=True)

    # ------------------------------------------------------------------ one step of each kind

    def _train_step(self, step: int, stop: StopSignals) -> tuple[float, float, bool]:
        """-> (loss averaged over ranks, gradient norm, whether any rank was asked to stop)."""
        lr = learning_rate(step, self.config)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        micro_batches = [
            windows(self.train_data, self.sampler.next_offsets(), self.config.seq_len).to(self.device)
            for _ in range(self.config.grad_accum)
        ]
        if self.cuda_graph and self.graphed is None:
            self.graphed = self._capture(micro_batches[0], 1 / len(micro_batches))
        loss, grad_norm = train_step(self.step_model, self.optimizer, micro_batches, self.config.grad_clip,
                                     self.no_sync, self.graphed, self.grad_buffers)
        stats = torch.stack((loss, torch.tensor(float(stop.signum is not None), device=self.device)))
        if self.runtime.distributed:
            dist.all_reduce(stats)
            stats[0] /= self.runtime.world_size
        loss_value, grad_norm_value = stats[0].item(), grad_norm.item()
        if not (math.isfinite(loss_value) and math.isfinite(grad_norm_value)):
            raise Diverged(f"training diverged at step {step} (loss {loss_value}, gradient norm "
                           f"{grad_norm_value}); the last checkpoint is from step {self.saved_step}")
        self.done_step, self.done_sampler_state = step, self.sampler.state_dict()
        return loss_value, grad_norm_value, stats[1].item() > 0

    def _try_graph(self, capture: Callable[[], T], what: str, instead: str) -> T | None:
        """``capture()``, which captures a CUDA graph. Where graphs were only the default and
        it fails, None after one line (the capture of ``what`` failed, ``instead`` goes on),
        and no more captures in this run."""
        try:
            return capture()
        except RuntimeError as error:
            if self.config.cuda_graph:
                raise
            self.log(f"CUDA graph capture{what} failed ({_first_line(error)}): {instead}")
            self.cuda_graph = False
            return None

    def _capture(self, example_ids: torch.Tensor, loss_scale: float) -> GraphedLossBackward | None:
        return self._try_graph(lambda: GraphedLossBackward(self.model, example_ids, loss_scale), "",
                               "training with eager steps (--no-cuda-graph skips the attempt)")

    def _validation_loss(self, ids: torch.Tensor) -> torch.Tensor:
        """A validation batch's loss, replayed from a graph captured at the first batch
        (batches of other shapes, and all of them if that capture fails, run eagerly)."""
        if self.graphed_validation is None and self.cuda_graph:
            self.graphed_validation = self._try_graph(lambda: GraphedLoss(self.model, ids),
                                                      " of the validation loss", "validating eagerly")
        if self.graphed_validation is not None and ids.shape == self.graphed_validation.ids.shape:
            return self.graphed_validation(ids)
        with autocast(ids.device):
            return self.model(ids, return_loss=True)

    def _sample(self, step: int) -> None:
        seed = self.config.seed + step
        text = None
        # The samples decode from CUDA graphs too, where the steps do and the layers can (full
        # attention, or sparse layers on the Triton kernels).
        if self.cuda_graph and self.model.has_graphable_decoding():
            text = self._try_graph(lambda: generate_sample(self.model, self.prompt, self.config, seed, True),
                                   " of a decoding step", "sampling eagerly")
        if text is None:
            text = generate_sample(self.model, self.prompt, self.config, seed)
        prompt_text = bytes(self.prompt.tolist()).decode("utf-8", errors="replace")
        self.log(f"step {step} sample:\n{prompt_text}\u2502{text}")
        with (self.run_dir / "samples.txt").open("a") as file:
            file.write(f"=== step {step}\n{prompt_text}\u2502{text}\n")

    def _save(self) -> Path | None:
        """Checkpoint the last completed step (rank 0 writes)."""
        self.saved_step = self.done_step
        if not self.is_main:
            return None
        cuda_rng = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        state = dict(
            model=self.model.state_dict(), model_config=self.model.config, step=self.done_step,
            optimizer=self.optimizer.state_dict(), sampler=self.done_sampler_state,
            rng=dict(torch=torch.get_rng_state(), cuda=cuda_rng), train_config=asdict(self.config),
        )
        return save_checkpoint(self.run_dir, state, self.config.keep_checkpoints)

    # ------------------------------------------------------------------ the loop

    def run(self) -> int:
        from tqdm.auto import tqdm

        from native_sparse_attention.plotting import plot_run

        config = self.config
        window_tokens, window_seconds = 0, 0.0
        if self.device.type == "cuda":
            # The first record's peak counts from here, not from whatever the process ran before.
            torch.cuda.reset_peak_memory_stats(self.device)
        progress = tqdm(total=config.steps, initial=self.start_step, disable=not self.is_main,
                        dynamic_ncols=True, unit="step", desc=self.run_dir.name)
        stop = StopSignals()
        try:
            with stop, progress:
                for step in range(self.start_step + 1, config.steps + 1):
                    started = time.perf_counter()
                    loss, grad_norm, stop_requested = self._train_step(step, stop)
                    step_seconds = time.perf_counter() - started
                    window_tokens, window_seconds = window_tokens + self.tokens_per_step, window_seconds + step_seconds
                    last = step == config.steps or stop_requested

                    record = dict(step=step, loss=loss, bpb=loss / math.log(2), lr=learning_rate(step, config),
                                  grad_norm=grad_norm)
                    if _due(step, config.val_every) or last:
                        val_loss = evaluate(self.model, self.val_data, self.val_offsets, config, self.device,
                                            self._validation_loss if self.cuda_graph else None)
                        record.update(val_loss=val_loss, val_bpb=val_loss / math.log(2))
                        self.log(f"step {step}: validation {record['val_bpb']:.4f} bits per byte "
                                 f"(train {record['bpb']:.4f})")
                    if _due(step, config.log_every) or "val_bpb" in record or last:
                        record["tokens_per_s"] = window_tokens / window_seconds
                        window_tokens, window_seconds = 0, 0.0
                        if self.device.type == "cuda":
                            record["peak_memory_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
                            torch.cuda.reset_peak_memory_stats(self.device)
                        if self.is_main:
                            _append_jsonl(self.metrics_path, record)
                    progress.set_postfix(loss=f"{loss:.3f}", bpb=f"{record['bpb']:.3f}",
                                         tok_s=f"{self.tokens_per_step / step_seconds:.0f}", refresh=False)
                    progress.update(1)

                    if self.is_main and _due(step, config.sample_every):
                        self._sample(step)
                    if self.is_main and self.plotting and "val_bpb" in record:
                        plot_run(self.run_dir)
                    if _due(step, config.checkpoint_every) or last:
                        path = self._save()
                        if path is not None and stop_requested:
                            name = signal.Signals(stop.signum).name if stop.signum else "a signal on another rank"
                            self.log(f"stopped by {name} after step {step}; saved {path}; continue with --resume")
                    if stop_requested:
                        return 128 + (stop.signum or signal.SIGTERM)
        except Diverged:
            raise  # the weights are not finite: the last checkpoint stays the newest
        except Exception:
            if self.done_step > self.saved_step:
                path = self._save()
                if path is not None:
                    self.log(f"training failed after step {self.done_step}; saved {path}")
            raise
        if self.is_main:
            print(f"done: {config.steps} steps; checkpoints in {self.run_dir / 'checkpoints'}\n"
                  f"score the test split: python -m native_sparse_attention.evaluate --checkpoint {self.run_dir}\n"
                  f"continue a text: python -m native_sparse_attention.generate --checkpoint {self.run_dir} "
                  f"--prompt TEXT", flush=True)
        return 0


def main(argv: list[str] | None = None) -> int:
    """``train.py``'s entry point: returns the exit code."""
    try:
        config, run_dir, resume = resolve_config(argv)
        return train(config, run_dir, resume)
    except (UsageError, DataError, Diverged) as error:
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"train.py: error: {error}", file=sys.stderr)
        return 1 if isinstance(error, Diverged) else 2
