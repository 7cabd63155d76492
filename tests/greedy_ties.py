"""Greedy continuations from two decoding paths under bf16 autocast: shared by the tests."""

from collections.abc import Sequence

import torch


def assert_same_up_to_ties(model, prompts: Sequence[Sequence[int]], got: Sequence[Sequence[int]],
                           expected: Sequence[Sequence[int]]):
    """Each continuation in ``got`` equals the one in ``expected``, or parts from it at a
    token whose bf16 logits nearly tie with the expected one's. Two paths round
    differently (a static step's own linear kernels, its splits of the keys, a batch's
    matmuls), and an untrained model's logits tie to the last bit now and then (an H100
    met one at the 27th byte of a continuation); a wrong step would part at a token that
    the logits do not nearly tie. ``prompts``, ``got`` and ``expected``: token ids (bytes
    or lists), one sequence per row; the logits are the model's forward over the prompt
    and the common prefix, under autocast on the model's device."""
    device = next(model.parameters()).device
    for prompt, ours, theirs in zip(prompts, got, expected, strict=True):
        ours, theirs = list(ours), list(theirs)
        assert len(ours) == len(theirs)
        parted = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
        if parted is None:
            continue
        ids = torch.tensor([list(prompt) + ours[:parted]], device=device)
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
            logits = model(ids)[0, -1].float()
        gap = (logits[ours[parted]] - logits[theirs[parted]]).abs().item()
        tie = 4 * torch.finfo(torch.bfloat16).eps * logits.abs().max().item()
        assert gap <= tie, f"tokens part at {parted} ({ours[parted]} / {theirs[parted]}) with logits {gap} apart"
