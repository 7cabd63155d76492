"""Compiles, without a GPU, the Triton kernels that SparseAttention's training and decoding
steps launch, for a GPU of the compute capability given as the argument (90 by default: an
H100, sm_90a) under the installed Triton; prints the outcome as JSON:
``{"compiled": [kernel names], "failures": {kernel name: error}}``.

    python tests/kernel_build.py 80      # an A100

Nothing runs on a device: Triton's active driver is replaced by one that names that
target, and every kernel launch only compiles (``warmup``). The layer runs on CPU tensors
and takes its kernel path as it does under ``TRITON_INTERPRET=1``, with the interpreter's
launch options; between kernels PyTorch works on zero-filled buffers. The kernels that
the layer launches only for CUDA tensors (the fused projection, rotary embedding and
compression MLP, the decoding caches' writes) or for a position read on the device (the
merges of split decoding work, a static step's linear layers and gated sum) are called
directly. A launch that does not ask for fused
multiply-adds (``kernels.launch`` does; Triton 3.10 no longer fuses by default) fails.
``tests/test_kernel_build.py`` runs this in a subprocess, which keeps the patches out of
its session.
"""

import importlib
import json
import os
import pkgutil
import sys
import traceback

import torch
from triton.backends.compiler import GPUTarget
from triton.runtime import driver
from triton.runtime.jit import JITFunction


class _CompileOnlyDriver:
    """The part of Triton's driver interface that compiling a launch reads."""

    def __init__(self, capability: int):
        self.capability = capability

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", self.capability, 32)

    def get_active_torch_device(self):
        return torch.device("cpu")

    def is_active(self):
        return True


def _import_kernels():
    """Imports every module of the package while ``TRITON_INTERPRET`` is unset, so that
    ``triton.jit`` makes compilable functions rather than interpreted ones."""
    os.environ.pop("TRITON_INTERPRET", None)
    import native_sparse_attention
    import native_sparse_attention.kernels

    for package in (native_sparse_attention, native_sparse_attention.kernels):
        for module in pkgutil.iter_modules(package.__path__):
            importlib.import_module(f"{package.__name__}.{module.name}")
    # Read at call time by the dispatch: CPU tensors take the kernel path.
    os.environ["TRITON_INTERPRET"] = "1"


def _steps() -> None:
    from native_sparse_attention import SparseAttention

    SparseAttention._use_fast_path = lambda self, x: self.use_triton_kernel
    torch.manual_seed(0)
    for options in (dict(), dict(use_diff_topk=True, query_heads_share_selected_kv=False)):
        layer = SparseAttention(dim=64, dim_head=32, heads=4, kv_heads=2, sliding_window_size=32,
                                compress_block_size=16, compress_block_sliding_stride=8,
                                selection_block_size=32, num_selected_blocks=2, causal=True,
                                use_triton_kernel=True, **options)
        x = torch.randn(2, 96, 64, requires_grad=True)
        document_ids = torch.tensor([0] * 64 + [1] * 32).expand(2, -1)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            layer(x).float().sum().backward()
            layer(x, document_ids=document_ids).float().sum().backward()
            if not options:
                # From 4096 queries the selection's forward runs key-major.
                layer(torch.randn(1, 4096, 64, requires_grad=True)).float().sum().backward()
                # No float atomics: the partial sums' stores and their ordered sums.
                torch.use_deterministic_algorithms(True)
                try:
                    layer(x).float().sum().backward()
                finally:
                    torch.use_deterministic_algorithms(False)
            with torch.no_grad():
                _, cache = layer(x, return_cache=True)
                for _ in range(2):
                    _, cache = layer(torch.randn(2, 1, 64), cache=cache, return_cache=True)


def _direct_calls() -> None:
    from native_sparse_attention.kernels.cache_write import write_compressed_rows, write_rings_and_read_windows
    from native_sparse_attention.kernels.compressed import compressed_attend_and_select_at
    from native_sparse_attention.kernels.compress_mlp import relu_mlp
    from native_sparse_attention.kernels.decode_linear import CompleteWindows, decode_linears
    from native_sparse_attention.kernels.gate_combine import gated_sum_of_logits
    from native_sparse_attention.kernels.selection import PartialOutputs, selection_attention_partials_at
    from native_sparse_attention.kernels.projection import project
    from native_sparse_attention.kernels.rotary import apply_rotary, split_heads_and_rotate

    dtype = torch.bfloat16
    x = torch.randn(2, 8, 64, dtype=dtype, requires_grad=True)
    weights = [torch.randn(96, 64, requires_grad=True), torch.randn(32, 64, requires_grad=True)]
    project(x, weights).float().sum().backward()
    windows = torch.randn(16, 4 * 32, dtype=dtype, requires_grad=True)
    mlp = [torch.randn(64, 128), torch.randn(64), torch.randn(32, 64), torch.randn(32)]
    relu_mlp(windows, *(w.requires_grad_() for w in mlp)).float().sum().backward()  # float32 master weights
    inv_freq = torch.rand(16)
    heads = torch.randn(2, 4, 8, 32, dtype=dtype, requires_grad=True)
    apply_rotary(heads, inv_freq).float().sum().backward()
    qkv = torch.randn(2, 8, (4 + 2 * 2) * 32 + 8, dtype=dtype, requires_grad=True)
    sum(t.float().sum() for t in split_heads_and_rotate(qkv, 4, 2, inv_freq)).backward()
    position, token = torch.tensor([5, 9]), torch.randn(2, 2, 1, 32, dtype=dtype)
    write_rings_and_read_windows(position, token, token, *torch.zeros(2, 2, 2, 8, 32, dtype=dtype),
                                 *torch.zeros(2, 2, 8, 32))
    write_compressed_rows(position, token, token, *torch.zeros(2, 2, 2, 6, 32, dtype=dtype), 1, 4, 2)
    # A static step's write: the cache's rows too, the capacity's assertion compiled in.
    write_rings_and_read_windows(position, token, token, *torch.zeros(2, 2, 2, 8, 32, dtype=dtype),
                                 *torch.zeros(2, 2, 8, 32), cache_rows=(token, *torch.zeros(2, 2, 2, 16, 32, dtype=dtype)))
    # A static step's linear layers: float32 master weights under autocast, both segments.
    rows, weight = torch.randn(4, 64, dtype=dtype), torch.randn(48, 64)
    decode_linears((rows, rows), (weight, weight[:16]), (None, torch.randn(16)), dtype)
    decode_linears((rows, rows), (weight, weight), (torch.randn(48),) * 2, dtype, activation="relu",
                   only=CompleteWindows(position, 2, 4, 2))
    decode_linears((rows,), (weight,), (torch.randn(48),), dtype, activation="gelu")
    decode_linears((rows,), (weight,), (None,), dtype, splits=2)  # as on GPUs, few output tiles
    logits = torch.randn(3, 2, 4, 1, dtype=dtype)
    gated_sum_of_logits(logits, *torch.randn(3, 2, 4, 1, 32, dtype=dtype))
    branch = torch.randn(2, 4, 1, 32, dtype=dtype)
    shares = PartialOutputs(torch.randn(2, 4, 3, 1, 32), torch.randn(2, 4, 3, 1))
    gated_sum_of_logits(logits, branch, shares, shares)
    # A static step's selection and window in shares of their keys.
    keys, selected = torch.randn(2, 2, 70, 32, dtype=dtype), torch.tensor([0, 1]).expand(2, 2, 1, 2)
    selection_attention_partials_at(branch, keys, keys, 32, selected, torch.ones(2, 2, 1, 2, dtype=torch.bool), 16,
                                    32**-0.5, position, shares=(2, 2))
    # One query on one kv head: few programs, so the key tiles and selection blocks split;
    # the query's two heads as the rows of one tile, in one pass for both with a shared
    # selection, in the forward's own with a selection per head.
    query, keys = torch.randn(1, 2, 1, 32, dtype=dtype), torch.randn(1, 1, 70, 32, dtype=dtype)
    for share in (True, False):
        compressed_attend_and_select_at(query, keys, keys, torch.tensor([500]), 16, 8, 1, 32, 2,
                                        share_selection=share)
    # Two queries: a program per head, whose partial outputs merge row by row.
    compressed_attend_and_select_at(torch.randn(1, 2, 2, 32, dtype=dtype), keys, keys, torch.tensor([500]), 16, 8,
                                    1, 32, 2, share_selection=True)


def main(capability: int) -> None:
    driver.set_active(_CompileOnlyDriver(capability))
    _import_kernels()
    compiled, failures = set(), {}
    compile_launch = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        name = self.fn.__name__
        # Compiled as on a GPU: Triton reads TRITON_INTERPRET while compiling too.
        os.environ.pop("TRITON_INTERPRET")
        try:
            if kwargs.get("enable_fp_fusion") is not True:
                raise RuntimeError("launched without enable_fp_fusion=True (kernels.launch passes it)")
            compile_launch(self, *args, grid=grid, warmup=True, **kwargs)
            compiled.add(name)
        except Exception as error:  # noqa: BLE001 - every failure is reported
            failures.setdefault(name, "".join(traceback.format_exception(error))[-4000:])
        finally:
            os.environ["TRITON_INTERPRET"] = "1"

    JITFunction.run = compile_only
    torch.cuda.current_device = lambda: 0  # the launch cache's key
    empty = torch.empty
    # Kernel outputs stay unwritten: zeros keep the indices PyTorch gathers by in range.
    torch.empty = lambda *args, **kwargs: torch.zeros(*args, **kwargs)
    try:
        _steps()
        _direct_calls()
    finally:
        torch.empty = empty
    json.dump({"compiled": sorted(compiled), "failures": failures}, sys.stdout)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 90)
