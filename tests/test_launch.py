"""kernels/launch.py: prepared launches go to the compiled variant that Triton would pick."""

from types import SimpleNamespace

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources
from triton.tools.tensor_descriptor import TensorDescriptor

from native_sparse_attention.kernels import launch as launch_module
from native_sparse_attention.kernels.launch import launch


class FakeKernel:
    """Stands in for a JITFunction: records Triton's own launches and the prepared ones."""

    def __init__(self, params):
        self.params = [SimpleNamespace(name=name, default=default, do_not_specialize=loose)
                       for name, default, loose in params]
        self.slow, self.fast = [], []

    def __getitem__(self, grid):
        def run(*args, **options):
            self.slow.append((grid, args, options))
            return FakeCompiled(self)
        return run


class FakeCompiled:
    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        return lambda *args: self.kernel.fast.append((grid, args))


@pytest.fixture
def fake_kernel(monkeypatch):
    monkeypatch.setattr(launch_module, "JITFunction", FakeKernel)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(launch_module, "_VARIANTS", {})
    empty = launch_module.Parameter.empty
    return FakeKernel([("X", empty, False), ("N", empty, False), ("M", empty, True),
                       ("BLOCK", empty, False), ("FLAG", True, False)])


def test_a_seen_fingerprint_goes_to_the_compiled_variant_with_every_argument_in_order(fake_kernel):
    x = torch.zeros(64)
    launch(fake_kernel, (3,), x, 16, 5, BLOCK=32, num_warps=4)
    assert len(fake_kernel.slow) == 1 and not fake_kernel.fast
    y = torch.ones(64)  # another tensor of the same dtype and alignment
    launch(fake_kernel, (3,), y, 16, 5, BLOCK=32, num_warps=4)
    assert len(fake_kernel.slow) == 1
    (grid, args), = fake_kernel.fast
    assert grid == (3, 1, 1)
    assert args[0] is y and args[1:] == (16, 5, 32, True)  # BLOCK from the options, FLAG's default


def test_what_triton_specializes_on_takes_its_own_path(fake_kernel):
    x = torch.zeros(64)
    launch(fake_kernel, (1,), x, 16, 5, BLOCK=32)
    changed = [
        ((x[1:], 16, 5), dict(BLOCK=32)),  # 4-byte offset: no longer 16-byte aligned
        ((x.double(), 16, 5), dict(BLOCK=32)),  # dtype
        ((x, 17, 5), dict(BLOCK=32)),  # a specialized integer's value
        ((x, 16.0, 5), dict(BLOCK=32)),  # equal, but a float
        ((x, 16, 2**40), dict(BLOCK=32)),  # a loose integer's width
        ((x, 16, 5), dict(BLOCK=64)),  # a constexpr
        ((x, 16, 5), dict(BLOCK=32, num_warps=8)),  # a launch option
    ]
    for args, options in changed:
        launch(fake_kernel, (1,), *args, **options)
    assert len(fake_kernel.slow) == 1 + len(changed) and not fake_kernel.fast


def test_loose_integers_share_their_variant_and_the_variants_stay_bounded(fake_kernel, monkeypatch):
    x = torch.zeros(64)
    for m in range(5, 50):
        launch(fake_kernel, (1,), x, 16, m, BLOCK=32)
    assert len(fake_kernel.slow) == 1 and len(fake_kernel.fast) == 44
    assert [args[2] for _, args in fake_kernel.fast] == list(range(6, 50))
    monkeypatch.setattr(launch_module, "_MAX_VARIANTS", 4)
    for n in range(32):
        launch(fake_kernel, (1,), x, n, 5, BLOCK=32)
    assert len(launch_module._VARIANTS[fake_kernel].compiled) <= 4


def test_interpreted_kernels_take_tritons_path():
    calls = []

    class Interpreted:
        def __getitem__(self, grid):
            return lambda *args, **options: calls.append((grid, args, options))

    launch(Interpreted(), (2, 3), 1, 2, BLOCK=4)
    launch(Interpreted(), (2, 3), 1, 2, BLOCK=4)
    assert calls == [((2, 3), (1, 2), {"enable_fp_fusion": True, "BLOCK": 4})] * 2


def test_kernels_compile_with_fused_multiply_adds_unless_told_otherwise(fake_kernel):
    """Triton 3.10 no longer fuses by default; the kernels were tuned with it."""
    x = torch.zeros(64)
    launch(fake_kernel, (1,), x, 16, 5, BLOCK=32)
    launch(fake_kernel, (1,), x, 16, 5, BLOCK=32, enable_fp_fusion=False)
    assert [options["enable_fp_fusion"] for _, _, options in fake_kernel.slow] == [True, False]


class SharedMemoryBound:
    """Stands in for a kernel whose tiles take ``per_stage`` bytes of shared memory a
    pipeline stage, on a GPU of ``limit`` bytes a block."""

    __name__ = "tiles_kernel"

    def __init__(self, per_stage, limit=100_000, resource="shared memory"):
        self.per_stage, self.limit, self.resource = per_stage, limit, resource
        self.stages = []

    def __getitem__(self, grid):
        def run(*args, num_stages=3, **options):
            self.stages.append(num_stages)
            if self.per_stage * num_stages > self.limit:
                raise OutOfResources(self.per_stage * num_stages, self.limit, self.resource)
        return run


@pytest.mark.parametrize("per_stage, options, stages", [
    (30_000, dict(num_stages=4), [4, 3]),
    (60_000, dict(num_stages=4), [4, 3, 2, 1]),
    (40_000, dict(), [3, 2]),  # Triton's default of three stages, then two
    (10_000, dict(num_stages=2), [2]),
])
def test_variants_too_large_for_shared_memory_take_fewer_stages(per_stage, options, stages):
    kernel = SharedMemoryBound(per_stage)
    launch(kernel, (1,), 7, BLOCK=16, **options)
    assert kernel.stages == stages


def test_a_variant_too_large_in_one_stage_names_the_kernel_and_the_remedy():
    kernel = SharedMemoryBound(150_000)
    with pytest.raises(RuntimeError, match=r"tiles_kernel needs 150000 bytes .* has 100000 .* autocast"):
        launch(kernel, (1,), 7, num_stages=2)
    assert kernel.stages == [2, 1]


def test_other_resources_fail_as_triton_reports_them():
    kernel = SharedMemoryBound(150_000, resource="threads")
    with pytest.raises(OutOfResources, match="threads"):
        launch(kernel, (1,), 7, num_stages=2)
    assert kernel.stages == [2]


@triton.jit
def _stacked_dots_kernel(A, B, C, K, BLOCK: tl.constexpr):
    rows = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK, BLOCK), tl.float32)
    for k in range(0, K, BLOCK):
        a = tl.load(A + rows[:, None] * K + k + rows[None, :])
        b = tl.load(B + (k + rows[:, None]) * BLOCK + rows[None, :])
        acc += tl.dot(a, b)
    tl.store(C + rows[:, None] * BLOCK + rows[None, :], acc)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_launch_too_large_for_shared_memory_runs_in_fewer_stages():
    """float32 tiles of 128 x 128 (64 KB each, two a stage) in six stages need more shared
    memory than any GPU has; the launch still runs, in the stages that fit."""
    torch.manual_seed(0)
    k = 1024
    a, b = torch.randn(128, k, device="cuda"), torch.randn(k, 128, device="cuda")
    c = torch.full((128, 128), float("nan"), device="cuda")
    with pytest.raises(OutOfResources, match="shared memory"):
        _stacked_dots_kernel[(1,)](a, b, c, k, BLOCK=128, num_stages=6)
    launch(_stacked_dots_kernel, (1,), a, b, c, k, BLOCK=128, num_stages=6)
    torch.testing.assert_close(c, a @ b, rtol=1e-2, atol=1e-1)  # TF32 dots


@triton.jit
def _scaled_copy_kernel(SRC, DST, N, scale, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(DST + offsets, tl.load(SRC + offsets, mask=offsets < N) * scale, mask=offsets < N)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_prepared_launches_on_the_gpu_match_tritons():
    """Fresh tensors, an unaligned view and two dtypes through launch(): every result as
    Triton's own launch gives it, one compiled variant per specialization."""
    torch.manual_seed(0)
    variants = set()
    for dtype in (torch.float32, torch.float16):
        for offset in (0, 0, 3, 0):
            base = torch.randn(1000 + offset, device="cuda", dtype=dtype)
            src = base[offset:]
            dst = torch.full_like(src, float("nan"))
            launch(_scaled_copy_kernel, (triton.cdiv(1000, 128),), src, dst, 1000, 0.5, BLOCK=128)
            torch.testing.assert_close(dst, src * 0.5, rtol=0, atol=0)
            variants.add((dtype, offset == 0))
    assert len(launch_module._VARIANTS[_scaled_copy_kernel].compiled) == len(variants)


@pytest.mark.skipif(torch.cuda.is_available(), reason="records the interpreter's launches")
def test_every_launch_of_a_layer_step_binds_as_triton_does_and_repeats_its_fingerprint(monkeypatch):
    """For each kernel launch of two fast-path layer steps: the argument list that a
    prepared launch hands the compiled kernel is the one Triton's binding gives, and the
    second step's launch has the first one's fingerprint, so that it would be prepared."""
    import inspect

    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    from native_sparse_attention import SparseAttention

    records = []
    run = InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **options):
        records.append((self, args, options))
        return run(self, *args, grid=grid, warmup=warmup, **options)

    monkeypatch.setattr(InterpretedFunction, "run", recording_run)
    monkeypatch.setattr(SparseAttention, "_use_fast_path", lambda self, x: self.use_triton_kernel)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    torch.manual_seed(0)
    layer = SparseAttention(dim=32, dim_head=16, heads=4, kv_heads=2, sliding_window_size=8, compress_block_size=8,
                            compress_block_sliding_stride=4, selection_block_size=16, num_selected_blocks=2,
                            use_triton_kernel=True)
    steps = []
    for _ in range(2):
        records.clear()
        x = torch.randn(1, 40, 32, requires_grad=True)
        layer(x).square().sum().backward()
        steps.append(list(records))
    first, second = steps
    assert len(first) == len(second) > 10
    for (kernel, args, options), (kernel_again, args_again, options_again) in zip(first, second):
        assert kernel_again is kernel
        assert not any(isinstance(value, (torch.Tensor, TensorDescriptor)) for value in options.values())
        variants = launch_module._Variants.of(JITFunction(kernel.fn, **kernel.kwargs))
        signature = inspect.signature(kernel.fn)
        bound = signature.bind(*args, **{name: value for name, value in options.items()
                                         if name in signature.parameters})
        bound.apply_defaults()
        assert variants.arguments(args, options) == list(bound.arguments.values()), kernel.fn.__name__
        assert variants.fingerprint(args_again, options_again) == variants.fingerprint(args, options), \
            kernel.fn.__name__


@pytest.mark.parametrize("compute_capability, options", [
    ((8, 0), {"maxnreg": 255}),  # an A100: ptxas would give several kernels 32 registers
    ((8, 6), {}),
    ((9, 0), {}),
])
def test_register_cap_by_compute_capability(monkeypatch, compute_capability, options):
    from native_sparse_attention.kernels import library

    monkeypatch.setattr(library, "capability", lambda device: compute_capability)
    assert library.register_cap(torch.device("cuda")) == options
    assert library.register_cap(torch.device("cpu")) == {}


# The kernels whose launches take library.register_cap's options: the attention kernels
# but the selection's key-major forward.
ATTENTION_KERNELS = {
    "_attention_fwd_kernel", "_attention_bwd_dq_kernel", "_attention_bwd_dkdv_kernel", "_select_blocks_kernel",
    "_fwd_kernel", "_dq_kernel", "_dkv_kernel", "window_dq_kernel", "window_dkv_kernel",
}


@pytest.mark.skipif(torch.cuda.is_available(), reason="records the interpreter's launches")
@pytest.mark.parametrize("heads", [4, 16], ids=["key-major forward", "query-side forward"])
def test_the_attention_kernels_and_only_they_take_the_register_cap(monkeypatch, heads):
    from triton.runtime.interpreter import InterpretedFunction

    from native_sparse_attention import SparseAttention
    from native_sparse_attention.kernels import compressed, selection

    for module in (compressed, selection):
        monkeypatch.setattr(module, "register_cap", lambda device: {"maxnreg": 255})
    monkeypatch.setattr(selection, "KEY_MAJOR_FORWARD_MIN_QUERIES", 1)
    monkeypatch.setattr(selection, "KEY_MAJOR_FORWARD_MIN_BLOCK", 16)
    launched = []
    run = InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **options):
        launched.append((self.fn.__name__, options.get("maxnreg")))
        return run(self, *args, grid=grid, warmup=warmup, **options)

    monkeypatch.setattr(InterpretedFunction, "run", recording_run)
    monkeypatch.setattr(SparseAttention, "_use_fast_path", lambda self, x: self.use_triton_kernel)
    torch.manual_seed(0)
    layer = SparseAttention(dim=32, dim_head=16, heads=heads, kv_heads=2, sliding_window_size=8,
                            compress_block_size=8, compress_block_sliding_stride=4, selection_block_size=16,
                            num_selected_blocks=2, use_triton_kernel=True)
    x = torch.randn(1, 40, 32, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.float16):  # the key-major forward takes 2-byte inputs
        out = layer(x)
    out.float().square().sum().backward()
    capped = {name for name, cap in launched if cap == 255}
    assert not {name for name, cap in launched if cap not in (None, 255)}
    assert capped == ATTENTION_KERNELS & {name for name, _ in launched}
    assert {"_attention_fwd_kernel", "_attention_bwd_dkdv_kernel", "_select_blocks_kernel", "_fwd_kernel",
            "_dkv_kernel", "window_dkv_kernel"} <= capped
    assert ("_key_major_fwd_kernel" in {name for name, _ in launched}) == (heads == 4)
