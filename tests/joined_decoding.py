"""Decoding rows that sit at different positions: shared by the layers' tests."""

import torch

from native_sparse_attention.static_cache import cat_caches


def decode_joined(layer, x: torch.Tensor, lengths: tuple[int, ...], steps: int, capacity: int):
    """Row r of ``x: [b, n, dim]`` prefilled alone to ``lengths[r]`` tokens, the rows' static
    caches of ``capacity`` tokens joined, then ``steps`` tokens of every row decoded
    together, one per step. Returns the outputs [b, steps, dim] and the joined cache."""
    with torch.no_grad():
        caches = []
        for row, length in enumerate(lengths):
            _, cache = layer(x[row:row + 1, :length], return_cache=True)
            caches.append(layer.static_cache(cache, capacity))
        joined = cat_caches(caches)
        assert joined.position.tolist() == list(lengths)
        outputs = [layer(torch.stack([x[row, n + t] for row, n in enumerate(lengths)])[:, None], cache=joined)
                   for t in range(steps)]
    assert joined.position.tolist() == [n + steps for n in lengths]
    return torch.cat(outputs, dim=1), joined
