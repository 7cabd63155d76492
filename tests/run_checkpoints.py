"""Small byte-level models saved as ``train.py`` saves them, for the tests of the command
lines that read checkpoints."""

from pathlib import Path

import torch

from native_sparse_attention.transformer import Transformer

SPARSE_KWARGS = dict(sliding_window_size=8, compress_block_size=8, compress_block_sliding_stride=4,
                     selection_block_size=8, num_selected_blocks=2)


def small_model(**overrides) -> Transformer:
    """A two-layer model over bytes, seeded, in eval mode; ``overrides`` replace its arguments."""
    torch.manual_seed(0)
    config = dict(num_tokens=256, dim=32, depth=2, heads=4, dim_head=8, kv_heads=2, sparse_attn_kwargs=SPARSE_KWARGS)
    return Transformer(**{**config, **overrides}).eval()


def save_checkpoint(model: Transformer, run_dir: Path, step: int = 0, train_config: dict | None = None) -> Path:
    """What train.py writes, <run_dir>/checkpoints/step-XXXXXXXX.pt (with its settings when given)."""
    path = run_dir / "checkpoints" / f"step-{step:08d}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {"model": model.state_dict(), "model_config": model.config, "step": step}
    if train_config is not None:
        state["train_config"] = train_config
    torch.save(state, path)
    return path
