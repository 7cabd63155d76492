"""The kernel launchers as ``torch.library`` operators, so that ``torch.compile`` keeps
whole graphs.

Dynamo cannot trace the launchers' host code (launch configurations, the selection's
inversion), and Inductor cannot lower the kernels themselves (they read and write bool
masks, which its Triton wrapper rejects). Registered as custom operators with fake
(shape-only) implementations, each launcher is one opaque node of the compiled graph:
``torch.compile(fullgraph=True)`` compiles the whole layer, and
``mode="reduce-overhead"`` replays it, kernels included, from a CUDA graph.

Eager calls go straight to the Python function: the dispatcher's round trip costs some
15 us per call (measured on the CPU), and eager steps of short sequences are already
bound by their host time.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from native_sparse_attention.kernels.launch import launch

__all__ = ["NAMESPACE", "KERNEL_DTYPES", "cdiv", "next_power_of_2", "device_properties", "multiprocessors",
           "register_cap", "launcher_op", "side_by_side", "is_tokens_major", "new_heads_tensor", "head_strides",
           "unit_stride_last", "row_tiles", "position_in_memory", "start_position", "head_offset", "head_pointer",
           "cast_block", "column_sums", "dot_precision", "matmul_as"]

NAMESPACE = "native_sparse_attention"
# The floating dtypes the elementwise kernels read and write.
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
T = TypeVar("T")
U = TypeVar("U")


# The launchers' own arithmetic. ``triton.cdiv`` and ``triton.next_power_of_2`` are
# constexpr functions, whose wrapper unwraps every argument: about 1 us a call on an H100
# host's CPU against 0.1, and an eager layer step makes some 120 of them.
def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for ``b > 0``, as ``triton.cdiv`` computes it (SymInts too)."""
    return (a + b - 1) // b


def next_power_of_2(n: int) -> int:
    """The smallest power of two ``>= n`` for ``n >= 1`` (0 for 0), as ``triton.next_power_of_2``."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


@functools.cache
def _properties_of(index: int):
    return torch.cuda.get_device_properties(index)


def device_properties(device: torch.device):
    """The CUDA ``device``'s properties, looked up once per device (a query: 1.8 us)."""
    return _properties_of(device.index if device.index is not None else torch.cuda.current_device())


def multiprocessors(device: torch.device) -> int:
    """SMs of the CUDA ``device``."""
    return device_properties(device).multi_processor_count


def capability(device: torch.device) -> tuple[int, int]:
    """Compute capability (major, minor) of the CUDA ``device``."""
    properties = device_properties(device)
    return properties.major, properties.minor


# Registers per thread that the attention kernels ask ptxas for, by compute capability.
# Left to itself, ptxas gives Triton 3.5's and 3.6's code for an A100 (8.0) as few as 32
# registers a thread and spills the rest: in bf16 the compressed dQ and dK / dV spilled
# 8-11 KB a thread at d = 64, half of their main loops' instructions local loads and stores
# (dK / dV 1567 of 3009), and a decoding step's selection forward 10 KB at d = 128; in
# float32 most attention kernels spilled 4 to 123 KB. Capped at 255, none spills more, in
# bf16 or float32, at d = 64 or 128, and those far less (dK / dV 2.6 KB, 339 of its loop's
# 1583 instructions): ptxas's counts for sm_80. The fewer registers would have bought at
# most two or three times the programs per SM, the tiles' shared memory allowing no more.
# The selection's key-major forward goes without: it spills nothing either way, and the
# cap only raised its registers (162 -> 186). GPUs of 8.6 and 8.9 are left alone: ptxas
# gives most kernels 255 there, and a cap moved the compressed dQ's spills from 1.3 to
# 1.5 KB at d = 64. Triton 3.9 gives the compressed backward and the selection's forward
# 255 registers on an A100 by itself. Unmeasured on an A100.
_REGISTER_CAPS = {(8, 0): 255}


def register_cap(device: torch.device) -> dict:
    """The launch options (``maxnreg``) that cap an attention kernel's registers per thread
    on ``device``, where ``_REGISTER_CAPS`` has a cap for it: ``{}`` elsewhere."""
    cap = _REGISTER_CAPS.get(capability(device)) if device.type == "cuda" else None
    return {} if cap is None else {"maxnreg": cap}


# The launchers read any strides, and the fakes derive their outputs' layouts from the
# inputs' order of dims alone, so Inductor may hand over its own layouts as long as it keeps
# that order. Under its default, exact strides, it copies every input whose strides it
# padded: with the sparse layer's projection rows of 2400 bf16 padded to 2432 (128 bytes),
# the compiled layer copied q, k and v in the forward and q again in the backward, 0.46 ms
# at n = 65536 on an H100. Older PyTorch, whose custom_op takes no tags, keeps the order
# by default.
_LAYOUT_TAGS = (
    {"tags": (torch.Tag.needs_fixed_stride_order,)}
    if "tags" in inspect.signature(torch.library.custom_op).parameters else {}
)


def dot_precision(dtype: torch.dtype) -> str:
    """``input_precision`` of the kernels' dots over ``dtype`` tiles.

    float32 tiles follow PyTorch's switch for float32 matmuls, read as FlexAttention reads
    it: float32 products by default, TF32 once allowed (``torch.set_float32_matmul_precision
    ("high")``, ``torch.backends.cuda.matmul.allow_tf32`` or ``fp32_precision = "tf32"``).
    With TF32 in its compressed branch, a float32 layer's output on an H100 was 0.26% from
    float64 (5e-6 without), and with straight-through selection its compressor's
    gradients 4.5%. 16-bit operands are exact either way.
    """
    if dtype != torch.float32:
        return "tf32"
    # "none" defers to the older global setting.
    precision = torch.backends.cuda.matmul.fp32_precision
    if precision != "none":
        return "tf32" if precision == "tf32" else "ieee"
    return "ieee" if torch.get_float32_matmul_precision() == "highest" else "tf32"


def matmul_as(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``a @ b`` (2-d) as ``dtype``: written in it by cuBLAS where it can, cast otherwise.
    A float32 weight's gradient from bf16 / fp16 operands then takes no cast kernel."""
    if a.dtype == dtype:
        return a @ b
    # aten::mm.dtype (CUDA only): 16-bit products summed into a float32 output.
    if a.is_cuda and dtype == torch.float32 and a.dtype in (torch.float16, torch.bfloat16):
        return torch.mm(a, b, out_dtype=dtype)
    return (a @ b).to(dtype)


def launcher_op(name: str, fake: Callable) -> Callable[[Callable], Callable]:
    """Decorator: registers ``launcher`` (fully type-annotated, returning fresh tensors
    only) as the operator ``native_sparse_attention::<name>`` with the fake
    implementation ``fake``, and returns a function that calls the operator while
    compiling and ``launcher`` itself otherwise."""

    def register(launcher: Callable) -> Callable:
        op = torch.library.custom_op(f"{NAMESPACE}::{name}", launcher, mutates_args=(), **_LAYOUT_TAGS)
        op.register_fake(fake)

        @functools.wraps(launcher)
        def call(*args, **kwargs):
            if torch.compiler.is_compiling():
                return op(*args, **kwargs)
            return launcher(*args, **kwargs)

        return call

    return register


class _SideStreams(threading.local):
    """Per thread: the side streams by (device, nesting level, urgency), and the level of
    the ``side_by_side`` calls in progress."""

    def __init__(self):
        self.streams: dict[tuple[torch.device, int, bool], torch.cuda.Stream] = {}
        self.level = 0


_SIDE_STREAMS = _SideStreams()


def side_by_side(device: torch.device, side: Callable[[], T], main: Callable[[], U],
                 urgent: bool = False) -> tuple[T, U]:
    """``(side(), main())``, with ``side``'s kernels on a stream of their own on CUDA, so
    that the two launch sequences share the GPU: each one's short launches and the tails
    of its grids leave SMs idle that the other's programs take.

    The side stream starts after all work queued so far and the current stream waits for
    it before anything queued after: inside a CUDA graph's capture both branches are
    captured, as a fork and a join. Calls nested in ``main`` or ``side`` take another
    stream, so that their side work does not queue behind this call's. Tensors that
    ``side`` allocates belong to its stream's pool; freed later, they are reused only by
    later work on that stream, which is queued after every kernel queued before that
    work's fork, so no kernel still reading them is overtaken.

    ``urgent``: the side stream has a higher priority than the others, so that the block
    scheduler starts its kernels' programs as soon as SMs free up instead of after the
    programs already queued: for short work that later work waits for, which would
    otherwise wait for a long grid of ``main``'s to drain. (PyTorch instantiates CUDA
    graphs with ``cudaGraphInstantiateFlagUseNodePriority``, so replays keep the
    priorities of the streams the kernels were captured on.)
    """
    if device.type != "cuda":
        return side(), main()
    key = (device, _SIDE_STREAMS.level, urgent)
    stream = _SIDE_STREAMS.streams.get(key)
    if stream is None:
        stream = _SIDE_STREAMS.streams[key] = torch.cuda.Stream(device, priority=-1 if urgent else 0)
    current = torch.cuda.current_stream(device)
    _SIDE_STREAMS.level += 1
    try:
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            side_result = side()
        main_result = main()
        current.wait_stream(stream)
    finally:
        _SIDE_STREAMS.level -= 1
    return side_result, main_result


def is_tokens_major(t: torch.Tensor) -> bool:
    """Whether ``t: [b, h, n, d]`` keeps each token's heads together in memory, as the
    layer's head-splitting views of its qkv projection do."""
    return t.stride(1) < t.stride(2)


def new_heads_tensor(t: torch.Tensor, tokens_major: bool, new: Callable) -> torch.Tensor:
    """A tensor of ``t``'s [b, h, n, d] shape from ``new(shape)``, laid out as [b, n, h, d]
    when ``tokens_major``. A gradient in that layout lets the projection's gradient
    gather each token's heads without a transpose; an operator's real and fake
    implementations both call this, so that their strides agree."""
    b, h, n, d = t.shape
    if tokens_major:
        return new((b, n, h, d)).transpose(1, 2)
    return new((b, h, n, d))


def head_strides(t: torch.Tensor | None) -> tuple[int, int, int]:
    """Strides of the batch, head and row dims of ``t: [b, h, rows, ...]``; zeros for an
    absent tensor, which a kernel then never reads."""
    return (0, 0, 0) if t is None else (t.stride(0), t.stride(1), t.stride(2))


def unit_stride_last(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t``, or a contiguous copy where its last dim is strided: the kernels address rows
    by stride and assume unit stride along them. None passes through."""
    return t if t is None or t.stride(-1) == 1 else t.contiguous()


def _tma_addressable(t: torch.Tensor) -> bool:
    """Whether the tensor memory accelerator can read ``t``: unit stride along the last
    dim, the start and every other stride on 16-byte boundaries."""
    size = t.element_size()
    return (t.stride(-1) == 1 and t.data_ptr() % 16 == 0
            and all(stride * size % 16 == 0 for stride in t.stride()[:-1]))


def row_tiles(t: torch.Tensor, block_rows: int, block_d: int) -> TensorDescriptor:
    """Descriptor of ``t: [b, h, rows, d]`` for loading ``[block_rows, block_d]`` tiles of
    one head with the tensor memory accelerator (TMA): ``desc.load([z, h, row, 0])``.
    Rows and columns past the end read as zeros, so kernels need no load masks.

    A tensor whose rows TMA cannot address (a head dim of an odd byte width, say) is
    read from a copy with padded rows; an empty one, which kernels never read, by a
    one-row stand-in (descriptors need positive sizes).
    """
    if t.numel() == 0:
        t = t.new_zeros(1, 1, 1, t.shape[-1])
    elif not _tma_addressable(t):
        d = t.shape[-1]
        t = F.pad(t, (0, -d % (16 // t.element_size())))[..., :d]
    return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, block_rows, block_d])


@triton.jit
def head_offset(z, h, stride_z, stride_h):
    """int64 offset of head ``[z, h]`` of a strided tensor, so that huge tensors stay addressable."""
    return z.to(tl.int64) * stride_z + h.to(tl.int64) * stride_h


@triton.jit
def head_pointer(ptr, z, h, stride_z, stride_h):
    """``ptr`` advanced to head ``[z, h]`` (``head_offset``)."""
    return ptr + head_offset(z, h, stride_z, stride_h)


@triton.jit
def merge_share(m_i, l_i, acc, share_lse, share_out):
    """One share's rows into a running merge of attention over disjoint shares of the keys:
    (maximum, sum of weights, weighted output) with the share's natural-log LSE ``[R]`` and
    normalised output ``[R, C]``, share s weighing ``exp(lse_s - max)``; the merged output
    is ``acc / l_i``."""
    m_new = tl.maximum(m_i, share_lse)
    # Rows without keys so far keep a maximum of -inf: weigh against 0, not NaN.
    m_base = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_base)
    weight = tl.exp(share_lse - m_base)
    return m_new, l_i * alpha + weight, acc * alpha[:, None] + share_out * weight[:, None]


@triton.jit
def cast_block(SRC, DST, block, size, BLOCK: tl.constexpr):
    """Elements ``block * BLOCK ..`` of the flat ``SRC`` (``size`` in all) into ``DST``'s dtype."""
    offsets = block.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    values = tl.load(SRC + offsets, mask=offsets < size)
    tl.store(DST + offsets, values.to(DST.dtype.element_ty), mask=offsets < size)


@triton.jit
def _column_sums_kernel(PARTS, OUT, ROWS, C, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    # PARTS: [ROWS, C] float32 contiguous -> OUT [C], each program BLOCK_C columns down all
    # the rows, BLOCK_R of them an iteration, in a fixed order: the same bits every run,
    # which atomic adds would not give.
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    total = tl.zeros([BLOCK_R, BLOCK_C], tl.float32)
    for start in range(0, ROWS, BLOCK_R):
        rows = start + tl.arange(0, BLOCK_R)
        total += tl.load(PARTS + rows.to(tl.int64)[:, None] * C + cols[None, :],
                         mask=(rows < ROWS)[:, None] & (cols < C)[None, :], other=0.0)
    tl.store(OUT + cols, tl.sum(total, 0).to(OUT.dtype.element_ty), mask=cols < C)


def column_sums(parts: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``parts.sum(0)`` written into ``out: [C]`` in its dtype, from ``parts: [P, C]``
    float32 contiguous: the per-program partial sums of a weight's or bias's gradient.
    One launch where torch takes a reduction and a cast. Each program walks a few columns
    down all P rows: narrow column tiles spread the pass over more SMs (on an H200, 4
    columns of [1024, 96] partials took 2.2 us, 16 and 32 columns 3.6 and 7.0 us)."""
    rows, columns = parts.shape
    if parts.device.type != "cuda":
        block_r, block_c = 2, 4  # interpreter: small tiles, so that test sizes span several
    else:
        block_c = max(4, min(64, next_power_of_2(cdiv(columns, 128))))
        block_r = 1024 // block_c
    launch(_column_sums_kernel, (cdiv(columns, block_c),), parts, out, rows, columns, BLOCK_R=block_r,
           BLOCK_C=block_c)
    return out


@triton.jit
def start_position(START, START_PTR, IN_MEMORY: tl.constexpr, z):
    """Batch row ``z``'s first position: ``START``, or with ``IN_MEMORY`` element ``z`` of
    the int64 ``[Z]`` that ``START_PTR`` points to, which a replayed CUDA graph reads anew
    every step (the rows of a batch decoding prompts of different lengths)."""
    start = START
    if IN_MEMORY:
        start = tl.load(START_PTR + z).to(tl.int32)
    return start


def position_in_memory(position: int | torch.Tensor, fallback: torch.Tensor) -> tuple[int, torch.Tensor, bool]:
    """``start_position``'s (START, START_PTR, IN_MEMORY) for ``position``: an int, or a
    contiguous ``[b]`` int64 tensor on the kernel's device, one position per batch row.
    ``fallback`` is any tensor, passed as the pointer that goes unread."""
    if isinstance(position, torch.Tensor):
        return 0, position, True
    return position, fallback, False
