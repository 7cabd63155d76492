"""The library's kernels against the general-purpose attention kernels PyTorch ships, on the
two branches those can run: the compressed branch on cuDNN, the sliding window on FlexAttention.

Configuration of the layer benchmark (``bench_layer.py``): 32 query heads on 2 kv heads of
dim 64, compression blocks of 32 every 16 tokens with one memory key, sliding window 512,
bf16, batch 1. Medians (ms, CUDA events) of the forward (no autograd) and of forward +
backward.

- Compressed attention. The query at position t sees the memory key and compressed key c
  once c's last token ``c * 16 + 31 < t``, so the 16 queries t = 16 j .. 16 j + 15 all see
  the memory key and c <= j - 2. Folding each stride's 16 positions into the heads,
  q ``[b, n, hq, d] -> [b, hq * 16, n / 16, d]`` (head h * 16 + r, still grouped by kv
  head), makes that SDPA's top-left causal mask over ``[memory, c_0, c_1, ...]`` once the
  row j = 0 (the memory key alone) is left out. "ours" is the compressed kernels' forward
  and backward without the block selection; "cuDNN, layer layout" includes the permutes
  between the layer's tokens-major q / output / gradients and the fold; "cuDNN alone"
  times SDPA on a q already folded.
- Sliding window. "ours": the selection operator with the window minus the operator
  without it (the window runs inside it); FlexAttention: ``torch.compile``d, over the
  library's window ``BlockMask`` (``flex.py``, 128 x 128 tiles). Both read a
  tokens-major q, as the layer's projection leaves it.

Each alternative's output is compared with ours (largest absolute difference).

    python benchmarks/bench_alternatives.py                     # n = 16384, 65536; docs section "alternatives"
    python benchmarks/bench_alternatives.py --seq-lens 65536 --no-write
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_selection import Config, random_causal_selection  # noqa: E402
from benchmarks.report import (  # noqa: E402
    benchmark_arguments, environment_line, markdown_table, median_ms, require_cuda, write_section,
)
from native_sparse_attention import flex  # noqa: E402
from native_sparse_attention.attend import native_sparse_attend  # noqa: E402
from native_sparse_attention.kernels import compressed  # noqa: E402

HEADS, KV_HEADS, DIM_HEAD = 32, 2, 64
COMPRESS_BLOCK, STRIDE, NUM_MEM = 32, 16, 1
WINDOW, SELECTION_BLOCK, SELECTED = 512, 64, 16
SEQ_LENS = (16384, 65536)
DTYPE = torch.bfloat16


def _random(*shape, generator) -> torch.Tensor:
    return torch.randn(*shape, generator=generator, device="cuda", dtype=DTYPE)


# ----------------------------------------------------------------------------- compressed branch


class CompressedProblem:
    """Tokens-major queries ``[1, n, hq, d]`` (as the layer's projection leaves them),
    memory + compressed keys and values ``[1, hk, 1 + nc, d]`` and an output gradient."""

    def __init__(self, n: int, generator: torch.Generator):
        self.n = n
        num_keys = NUM_MEM + (n - COMPRESS_BLOCK) // STRIDE + 1
        self.q = _random(1, n, HEADS, DIM_HEAD, generator=generator)
        self.ck = _random(1, KV_HEADS, num_keys, DIM_HEAD, generator=generator)
        self.cv = _random(1, KV_HEADS, num_keys, DIM_HEAD, generator=generator)
        self.grad = _random(1, n, HEADS, DIM_HEAD, generator=generator)
        self.scale = DIM_HEAD**-0.5
        self.geometry = compressed._Geometry(
            COMPRESS_BLOCK, STRIDE, NUM_MEM, causal=True, scale=self.scale,
            selection_block_size=SELECTION_BLOCK, num_selected=SELECTED, share_selection=True,
        )

    def ours_forward(self) -> torch.Tensor:
        """out: [1, hq, n, d]."""
        return compressed._attention_forward(self.q.transpose(1, 2), self.ck, self.cv, self.geometry)[0]

    def ours_forward_backward(self) -> None:
        q = self.q.transpose(1, 2)
        out, lse = compressed._attention_forward(q, self.ck, self.cv, self.geometry)
        compressed._attention_backward(self.grad.transpose(1, 2), q, self.ck, self.cv, out, lse, self.geometry)

    def fold(self, q: torch.Tensor) -> torch.Tensor:
        """[1, n, hq, d] -> [1, hq * STRIDE, n / STRIDE - 1, d]: head h * STRIDE + r holds the
        positions j * STRIDE + r, j >= 1."""
        folded = q.view(1, self.n // STRIDE, STRIDE, HEADS, DIM_HEAD).permute(0, 3, 2, 1, 4)
        return folded.reshape(1, HEADS * STRIDE, self.n // STRIDE, DIM_HEAD)[:, :, 1:]

    def unfold(self, out: torch.Tensor) -> torch.Tensor:
        """The inverse of ``fold``, rows j = 0 zero: -> [1, n, hq, d]."""
        out = torch.cat([out.new_zeros(1, HEADS * STRIDE, 1, DIM_HEAD), out], dim=2)
        return out.view(1, HEADS, STRIDE, self.n // STRIDE, DIM_HEAD).permute(0, 3, 2, 1, 4).reshape(
            1, self.n, HEADS, DIM_HEAD)

    def cudnn(self, q: torch.Tensor, ck: torch.Tensor, cv: torch.Tensor) -> torch.Tensor:
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(q, ck, cv, is_causal=True, scale=self.scale, enable_gqa=True)


def measure_compressed(n: int, generator: torch.Generator) -> list:
    problem = CompressedProblem(n, generator)
    with torch.no_grad():
        ours = problem.ours_forward().transpose(1, 2)  # [1, n, hq, d]
        folded_out = problem.unfold(problem.cudnn(problem.fold(problem.q), problem.ck, problem.cv))
        # Rows 0 .. STRIDE - 1 see the memory key alone and are left out of the fold.
        difference = (folded_out[:, STRIDE:].float() - ours[:, STRIDE:].float()).abs().max().item()

        ours_fwd = median_ms(problem.ours_forward)
        layout_fwd = median_ms(lambda: problem.unfold(problem.cudnn(problem.fold(problem.q), problem.ck, problem.cv)))
        folded_q = problem.fold(problem.q).contiguous()
        alone_fwd = median_ms(lambda: problem.cudnn(folded_q, problem.ck, problem.cv))
    ours_step = median_ms(problem.ours_forward_backward)

    q, ck, cv = (t.detach().requires_grad_() for t in (problem.q, problem.ck, problem.cv))
    folded_q = folded_q.detach().requires_grad_()
    folded_grad = problem.fold(problem.grad).contiguous()

    def layout_step():
        out = problem.unfold(problem.cudnn(problem.fold(q), ck, cv))
        torch.autograd.grad(out, (q, ck, cv), problem.grad)

    def alone_step():
        out = problem.cudnn(folded_q, ck, cv)
        torch.autograd.grad(out, (folded_q, ck, cv), folded_grad)

    layout_fwd_bwd, alone_fwd_bwd = median_ms(layout_step), median_ms(alone_step)
    return [f"{ours_fwd:.2f} / {ours_step:.2f}", f"{layout_fwd:.2f} / {layout_fwd_bwd:.2f}",
            f"{alone_fwd:.2f} / {alone_fwd_bwd:.2f}", f"{difference:.3f}"]


# ----------------------------------------------------------------------------- sliding window


def measure_window(n: int, generator: torch.Generator) -> list:
    # Tokens-major q, as the layer's projection leaves it.
    q = _random(1, n, HEADS, DIM_HEAD, generator=generator).transpose(1, 2).requires_grad_()
    k, v = (_random(1, KV_HEADS, n, DIM_HEAD, generator=generator).requires_grad_() for _ in range(2))
    config = Config(batch=1, query_heads=HEADS, kv_heads=KV_HEADS, head_dim=DIM_HEAD,
                    block_size=SELECTION_BLOCK, num_selected=SELECTED)
    indices, fmask = random_causal_selection(config, n, generator, "cuda")
    grads = [_random(1, n, HEADS, DIM_HEAD, generator=generator).transpose(1, 2) for _ in range(2)]

    def selection(window: bool):
        if window:
            return native_sparse_attend(q, k, v, SELECTION_BLOCK, indices, fmask,
                                        return_sliding_window_out=True, sliding_window_size=WINDOW)
        return (native_sparse_attend(q, k, v, SELECTION_BLOCK, indices, fmask),)

    def step(window: bool):
        outputs = selection(window)
        torch.autograd.grad(outputs, (q, k, v), grads[: len(outputs)])

    block_mask = flex._sliding_block_mask(n, WINDOW, True, (128, 128), q.device)
    attend = flex._compiled_flex_attention()

    def flex_forward():
        return attend(q, k, v, block_mask=block_mask, enable_gqa=True)

    def flex_step():
        torch.autograd.grad(flex_forward(), (q, k, v), grads[0])

    with torch.no_grad():
        difference = (flex_forward().float() - selection(True)[1].float()).abs().max().item()
        ours_fwd = median_ms(lambda: selection(True)) - median_ms(lambda: selection(False))
        flex_fwd = median_ms(flex_forward)
    ours_step = median_ms(lambda: step(True)) - median_ms(lambda: step(False))
    return [f"{ours_fwd:.2f} / {ours_step:.2f}", f"{flex_fwd:.2f} / {median_ms(flex_step):.2f}", f"{difference:.3f}"]


# ----------------------------------------------------------------------------- report


def main() -> None:
    parser = benchmark_arguments(__doc__)
    parser.add_argument("--seq-lens", type=int, nargs="+", default=list(SEQ_LENS))
    args = parser.parse_args()
    require_cuda(parser)
    if any(n % STRIDE or n < 2 * COMPRESS_BLOCK for n in args.seq_lens):
        parser.error(f"--seq-lens must be multiples of {STRIDE} of at least {2 * COMPRESS_BLOCK}")

    generator = torch.Generator(device="cuda").manual_seed(0)
    compressed_rows, window_rows = [], []
    for n in args.seq_lens:
        compressed_rows.append([n, *measure_compressed(n, generator)])
        window_rows.append([n, *measure_window(n, generator)])
        print(f"n={n}: compressed {compressed_rows[-1][1:]}, window {window_rows[-1][1:]}", flush=True)

    markdown = "\n\n".join([
        "## Our kernels against cuDNN and FlexAttention (`benchmarks/bench_alternatives.py`)",
        f"{environment_line()}, cuDNN {torch.backends.cudnn.version()}",
        "32 query heads on 2 kv heads of dim 64, bf16, batch 1; fwd / fwd+bwd ms (medians). "
        "Compressed attention: blocks of 32 every 16 tokens plus one memory key, causal at each "
        "block's last token; cuDNN runs it as SDPA's causal mask on queries folded 16 positions "
        "to a head (the script's docstring explains the fold), either with the permutes from and "
        "to the layer's tokens-major tensors or on a q already folded. Sliding window 512: ours is "
        "the selection operator with the window minus without it; FlexAttention is compiled, over "
        "the library's 128 x 128 tile mask. Max |diff|: the alternative's output against ours.",
        markdown_table(
            ["n", "compressed: ours (no block selection)", "cuDNN, layer layout", "cuDNN alone, folded q",
             "max abs diff"],
            compressed_rows,
        ),
        markdown_table(["n", "window 512: ours", "FlexAttention", "max abs diff"], window_rows),
    ])
    print(markdown)
    if not args.no_write:
        write_section("alternatives", markdown)


if __name__ == "__main__":
    main()
