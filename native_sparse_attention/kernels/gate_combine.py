"""Triton kernels that mix NSA's three branch outputs by their gates and merge the heads.

Notation
--------
Z: batch size, H: heads, N: tokens, D: head dim (HEAD_DIM), padded to the power of two
BLOCK_D; BLOCK_N: tokens per program.
G: gates ``[3, Z, H, N]`` (any strides), one per branch (compressed, selected, sliding).
B0, B1, B2: branch outputs ``[Z, H, N, D]`` (any strides, unit stride along D).
OUT: ``[Z, N, H * D]`` contiguous, the layout the output projection reads, so heads are
merged without a transpose copy.

Forward:  ``OUT[z, n, h * D + d] = sum_k G[k, z, h, n] * Bk[z, h, n, d]``, in float32.
A decoding step's B1 and B2 may come in SHARES_1, SHARES_2 > 0 shares of their keys
(``selection.PartialOutputs``: Bk ``[Z, H, SHARES_k, N, D]`` and LSEk ``[Z, H, SHARES_k, N]``
float32, contiguous), which the forward merges and rounds to B0's dtype, as the unsplit
branches store their outputs, before weighing them.
Backward: ``dBk = G[k] * dOUT`` and ``dG[k] = sum_d dOUT * Bk``, one pass over dOUT.

Against the eager formula (three products, two sums and a head-merging copy, each a
full-size tensor) this reads each branch once and writes the output once.

``gated_branches`` goes further for the layer's kernel path: the branches and their
gated sum form one autograd node, whose backward never writes the branches' output
gradients ``dBk = G[k] * dOUT``. Each branch's backward gets dOUT itself, with its gate
folded into its LSE: ``exp(s - (lse - log g)) = g * P``, so with the correction
``rowsum(dOUT * Bk)`` every gradient of the branch (dV = (gP)^T dOUT, dS = gP * (dP -
rowsum(dOUT * Bk)), hence dQ and dK) equals the one from ``g * dOUT``; that correction,
which the branch's backward computes anyway, is also the gate's gradient ``dG[k]``. Its
forward takes the gated sum from the selection's forward launch where the window's tiles
run in a launch of their own (``sliding_window._store_gated_sum``), and from this
module's kernel otherwise, and where a backward will follow, the selection's inversion
for dK / dV beside the selection's launches (``selection._launch_forward``). Its backward
runs the compressed branch's launches on a side stream, beside the selected and sliding
branches' (``_branches_backward``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from einops import rearrange

from native_sparse_attention.kernels import compressed as compressed_kernels
from native_sparse_attention.kernels import selection as selection_kernels
from native_sparse_attention.kernels.launch import launch
from native_sparse_attention.kernels.library import (
    cdiv, head_strides, launcher_op, matmul_as, merge_share, next_power_of_2, side_by_side, unit_stride_last,
)
from native_sparse_attention.kernels.selection import PartialOutputs
from native_sparse_attention.selection import BlockSelection

__all__ = ["gated_branches", "gated_sum", "gated_sum_of_logits"]


@triton.jit
def _rows(z, h, n_start, stride_z, stride_h, stride_n, N,
          BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr):
    """int64 offsets and mask of rows ``n_start .. n_start + BLOCK_N`` of head ``[z, h]``."""
    offs_n = n_start + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    head = z.to(tl.int64) * stride_z + h.to(tl.int64) * stride_h
    offsets = head + offs_n[:, None].to(tl.int64) * stride_n + offs_d[None, :]
    return offsets, (offs_n[:, None] < N) & (offs_d[None, :] < HEAD_DIM)


@triton.jit
def _program_tile(H, BLOCK_N: tl.constexpr):
    """(z * H + h, z, h, first token) of this program."""
    zh = tl.program_id(0)
    return zh, zh // H, zh % H, tl.program_id(1) * BLOCK_N


@triton.jit
def _load_gates(G, z, h, n_start, stride_gk, stride_gz, stride_gh, stride_gn, N,
                BLOCK_N: tl.constexpr, SIGMOID: tl.constexpr = False):
    """The three branches' gates of the program's tokens, in float32; with SIGMOID, G
    holds their logits, and the gates are their sigmoids rounded to G's dtype."""
    offs_n = n_start + tl.arange(0, BLOCK_N)
    ptrs = G + z.to(tl.int64) * stride_gz + h.to(tl.int64) * stride_gh + offs_n.to(tl.int64) * stride_gn
    mask = offs_n < N
    return (_gate(tl.load(ptrs, mask=mask), SIGMOID), _gate(tl.load(ptrs + stride_gk, mask=mask), SIGMOID),
            _gate(tl.load(ptrs + 2 * stride_gk, mask=mask), SIGMOID))


@triton.jit
def _gate(g, SIGMOID: tl.constexpr):
    if SIGMOID:
        return tl.sigmoid(g.to(tl.float32)).to(g.dtype).to(tl.float32)
    return g.to(tl.float32)


@triton.jit
def _branch_offsets(z, h, n_start,
                    stride_0z, stride_0h, stride_0n,
                    stride_1z, stride_1h, stride_1n,
                    stride_2z, stride_2h, stride_2n,
                    N, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Offsets of the program's rows in the three branch outputs, and their mask."""
    o0, mask = _rows(z, h, n_start, stride_0z, stride_0h, stride_0n, N, BLOCK_N, BLOCK_D, HEAD_DIM)
    o1, _ = _rows(z, h, n_start, stride_1z, stride_1h, stride_1n, N, BLOCK_N, BLOCK_D, HEAD_DIM)
    o2, _ = _rows(z, h, n_start, stride_2z, stride_2h, stride_2n, N, BLOCK_N, BLOCK_D, HEAD_DIM)
    return o0, o1, o2, mask


@triton.jit
def _branch(B, LSE, offsets, mask, z, h, n_start, H, N, SHARES: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr, DTYPE: tl.constexpr):
    """A branch's output rows in float32: loaded at ``offsets``, or with SHARES > 0 merged
    from its shares and rounded to DTYPE."""
    if SHARES > 0:
        return _merged_shares(B, LSE, z, h, n_start, H, N, SHARES, BLOCK_N, BLOCK_D, HEAD_DIM).to(DTYPE).to(tl.float32)
    return tl.load(B + offsets, mask=mask).to(tl.float32)


@triton.jit
def _merged_shares(B, LSE, z, h, n_start, H, N, SHARES: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr):
    """The output over all SHARES shares of the rows ``n_start ..`` of head [z, h], float32
    (0 where no share has keys): share s weighs ``exp(lse_s - lse)``."""
    offs_n = n_start + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_n < N
    mask = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    first_share = (z.to(tl.int64) * H + h) * SHARES
    m_i = tl.full([BLOCK_N], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_N], tl.float32)
    acc = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    # Unrolled: a loop would wait for each share's loads in turn.
    for share in tl.static_range(SHARES):
        rows = (first_share + share) * N + offs_n
        share_lse = tl.load(LSE + rows, mask=row_ok, other=float("-inf"))
        share_out = tl.load(B + rows[:, None] * HEAD_DIM + offs_d[None, :], mask=mask, other=0.0)
        m_i, l_i, acc = merge_share(m_i, l_i, acc, share_lse, share_out)
    return acc / tl.where(l_i > 0, l_i, 1.0)[:, None]


@triton.jit
def _gated_sum_fwd_kernel(
    G, B0, B1, B2, OUT, LSE1, LSE2,
    stride_gk, stride_gz, stride_gh, stride_gn,
    stride_0z, stride_0h, stride_0n,
    stride_1z, stride_1h, stride_1n,
    stride_2z, stride_2h, stride_2n,
    H, N,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, SIGMOID: tl.constexpr = False,
    SHARES_1: tl.constexpr = 0, SHARES_2: tl.constexpr = 0,
):
    _, z, h, n_start = _program_tile(H, BLOCK_N)
    g0, g1, g2 = _load_gates(G, z, h, n_start, stride_gk, stride_gz, stride_gh, stride_gn, N,
                             BLOCK_N, SIGMOID)
    o0, o1, o2, mask = _branch_offsets(z, h, n_start, stride_0z, stride_0h, stride_0n,
                                       stride_1z, stride_1h, stride_1n, stride_2z, stride_2h,
                                       stride_2n, N, BLOCK_N, BLOCK_D, HEAD_DIM)
    dtype = B0.dtype.element_ty
    selected = _branch(B1, LSE1, o1, mask, z, h, n_start, H, N, SHARES_1, BLOCK_N, BLOCK_D, HEAD_DIM, dtype)
    sliding = _branch(B2, LSE2, o2, mask, z, h, n_start, H, N, SHARES_2, BLOCK_N, BLOCK_D, HEAD_DIM, dtype)
    out = g0[:, None] * tl.load(B0 + o0, mask=mask).to(tl.float32) + g1[:, None] * selected + g2[:, None] * sliding
    # OUT is [Z, N, H, D]: head h of token n at (z * N + n) * H * D + h * HEAD_DIM.
    o_out, _ = _rows(z, h, n_start, N * H * HEAD_DIM, HEAD_DIM, H * HEAD_DIM, N, BLOCK_N,
                     BLOCK_D, HEAD_DIM)
    tl.store(OUT + o_out, out.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _branch_grad(g_k, B_k, DB_k, dout, mask):
    """Writes ``dB_k = g_k * dOUT`` and returns ``dG_k = rowsum(dOUT * B_k)``."""
    tl.store(DB_k, (g_k[:, None] * dout).to(DB_k.dtype.element_ty), mask=mask)
    return tl.sum(dout * tl.load(B_k, mask=mask).to(tl.float32), 1)


@triton.jit
def _gated_sum_bwd_kernel(
    G, B0, B1, B2, DOUT, DB0, DB1, DB2, DG,
    stride_gk, stride_gz, stride_gh, stride_gn,
    stride_0z, stride_0h, stride_0n,
    stride_1z, stride_1h, stride_1n,
    stride_2z, stride_2h, stride_2n,
    stride_dz, stride_dn,
    H, N,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # DB0, DB1, DB2: [Z, H, N, D] contiguous; DG: [3, Z, H, N] float32 contiguous.
    zh, z, h, n_start = _program_tile(H, BLOCK_N)
    g0, g1, g2 = _load_gates(G, z, h, n_start, stride_gk, stride_gz, stride_gh, stride_gn, N,
                             BLOCK_N)
    o0, o1, o2, mask = _branch_offsets(z, h, n_start, stride_0z, stride_0h, stride_0n,
                                       stride_1z, stride_1h, stride_1n, stride_2z, stride_2h,
                                       stride_2n, N, BLOCK_N, BLOCK_D, HEAD_DIM)
    o_dout, _ = _rows(z, h, n_start, stride_dz, HEAD_DIM, stride_dn, N, BLOCK_N, BLOCK_D,
                      HEAD_DIM)
    dout = tl.load(DOUT + o_dout, mask=mask).to(tl.float32)
    o_grad, _ = _rows(z, h, n_start, H * N * HEAD_DIM, N * HEAD_DIM, HEAD_DIM, N, BLOCK_N,
                      BLOCK_D, HEAD_DIM)
    dg0 = _branch_grad(g0, B0 + o0, DB0 + o_grad, dout, mask)
    dg1 = _branch_grad(g1, B1 + o1, DB1 + o_grad, dout, mask)
    dg2 = _branch_grad(g2, B2 + o2, DB2 + o_grad, dout, mask)
    rows = n_start + tl.arange(0, BLOCK_N)
    dg_ptrs = DG + zh.to(tl.int64) * N + rows
    branch_stride = tl.num_programs(0).to(tl.int64) * N
    tl.store(dg_ptrs, dg0, mask=rows < N)
    tl.store(dg_ptrs + branch_stride, dg1, mask=rows < N)
    tl.store(dg_ptrs + 2 * branch_stride, dg2, mask=rows < N)


@triton.jit
def _fold_into_lse(g, LSE, z, h, rows, stride_z, stride_h, stride_n, N):
    """``lse - log(g)`` of the rows, +inf where the gate is 0."""
    lse = tl.load(LSE + z.to(tl.int64) * stride_z + h.to(tl.int64) * stride_h + rows.to(tl.int64) * stride_n,
                  mask=rows < N)
    return tl.where(g > 0, lse - tl.log(g), float("inf"))


@triton.jit
def _folded_lses_kernel(
    G, L0, L1, L2, OUT,
    stride_gk, stride_gz, stride_gh, stride_gn,
    stride_0z, stride_0h, stride_0n,
    stride_1z, stride_1h, stride_1n,
    stride_2z, stride_2h, stride_2n,
    H, N, BLOCK_N: tl.constexpr,
):
    # L0, L1, L2: the branches' LSEs [Z, H, N] float32; OUT: [3, Z, H, N] float32 contiguous.
    zh, z, h, n_start = _program_tile(H, BLOCK_N)
    g0, g1, g2 = _load_gates(G, z, h, n_start, stride_gk, stride_gz, stride_gh, stride_gn, N, BLOCK_N)
    rows = n_start + tl.arange(0, BLOCK_N)
    out = OUT + zh.to(tl.int64) * N + rows
    branch_stride = tl.num_programs(0).to(tl.int64) * N
    tl.store(out, _fold_into_lse(g0, L0, z, h, rows, stride_0z, stride_0h, stride_0n, N), mask=rows < N)
    tl.store(out + branch_stride, _fold_into_lse(g1, L1, z, h, rows, stride_1z, stride_1h, stride_1n, N),
             mask=rows < N)
    tl.store(out + 2 * branch_stride, _fold_into_lse(g2, L2, z, h, rows, stride_2z, stride_2h, stride_2n, N),
             mask=rows < N)


_BLOCK_N = 64
_LSE_BLOCK_N = 1024


def _allocate(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The folded LSEs' buffer comes from here (tests poison it)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _block_d(head_dim: int) -> int:
    return next_power_of_2(head_dim)


def _fake_forward(gates, branch0, branch1, branch2):
    b, h, n, d = branch0.shape
    return branch0.new_empty((b, n, h * d), dtype=torch.promote_types(gates.dtype, branch0.dtype))


def _launch_forward(gates: torch.Tensor, branch0: torch.Tensor, branch1: torch.Tensor | PartialOutputs,
                    branch2: torch.Tensor | PartialOutputs, sigmoid: bool) -> torch.Tensor:
    b, h, n, d = branch0.shape
    out_dtype = torch.promote_types(gates.dtype, branch0.dtype)
    out = _allocate((b, n, h * d), out_dtype, branch0.device)
    block_n = min(_BLOCK_N, next_power_of_2(n))
    grid = (b * h, cdiv(n, block_n))
    (branch1, lse1, strides1, shares1), (branch2, lse2, strides2, shares2) = (
        _branch_operands(branch, out) for branch in (branch1, branch2))
    launch(_gated_sum_fwd_kernel, grid,
        gates, branch0, branch1, branch2, out, lse1, lse2,
        *gates.stride(),
        *head_strides(branch0), *strides1, *strides2,
        h, n, HEAD_DIM=d, BLOCK_N=block_n, BLOCK_D=_block_d(d), SIGMOID=sigmoid, SHARES_1=shares1, SHARES_2=shares2,
    )
    return out


def _branch_operands(branch: torch.Tensor | PartialOutputs, unread: torch.Tensor):
    """(output, LSE, head strides, SHARES) of a branch for ``_gated_sum_fwd_kernel``."""
    if isinstance(branch, PartialOutputs):
        # The shares' layout is fixed: their strides go unread.
        return branch.out.contiguous(), branch.lse.contiguous(), (0, 0, 0), branch.out.shape[2]
    return branch, unread, head_strides(branch), 0


@launcher_op("gated_sum", _fake_forward)
def _forward(gates: torch.Tensor, branch0: torch.Tensor, branch1: torch.Tensor,
             branch2: torch.Tensor) -> torch.Tensor:
    """gates: [3, b, h, n], branches: [b, h, n, d] -> [b, n, h * d]"""
    return _launch_forward(gates, branch0, branch1, branch2, sigmoid=False)


def _fake_backward(gates, branch0, branch1, branch2, dout):
    return (gates.new_empty(gates.shape), branch0.new_empty(branch0.shape),
            branch1.new_empty(branch1.shape), branch2.new_empty(branch2.shape))


@launcher_op("gated_sum_backward", _fake_backward)
def _backward(gates: torch.Tensor, branch0: torch.Tensor, branch1: torch.Tensor, branch2: torch.Tensor,
              dout: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """dout: [b, n, h * d] -> (dgates [3, b, h, n], dbranch0, dbranch1, dbranch2 [b, h, n, d])"""
    branches = (branch0, branch1, branch2)
    b, h, n, d = branch0.shape
    dout = dout.contiguous()
    grads = [torch.empty(b, h, n, d, dtype=t.dtype, device=t.device) for t in branches]
    dgates = torch.empty(3, b, h, n, dtype=torch.float32, device=dout.device)
    grid = (b * h, cdiv(n, _BLOCK_N))
    launch(_gated_sum_bwd_kernel, grid,
        gates, *branches, dout, *grads, dgates,
        *gates.stride(),
        *(stride for t in branches for stride in head_strides(t)),
        dout.stride(0), dout.stride(1),
        h, n, HEAD_DIM=d, BLOCK_N=_BLOCK_N, BLOCK_D=_block_d(d),
    )
    return (dgates.to(gates.dtype), *grads)


class _GatedSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gates, branch0, branch1, branch2):
        ctx.save_for_backward(gates, branch0, branch1, branch2)
        return _forward(gates, branch0, branch1, branch2)

    @staticmethod
    def backward(ctx, dout):
        return _backward(*ctx.saved_tensors, dout)


def gated_sum(gates: torch.Tensor, compressed: torch.Tensor, selected: torch.Tensor,
              sliding: torch.Tensor) -> torch.Tensor:
    """``sum_k gates[k] * branch_k`` with the heads merged: the layer's gate combination.

    gates: [3, b, h, n] (compressed, selected, sliding; any strides); compressed, selected,
    sliding: [b, h, n, d] (any strides). Returns [b, n, h * d] in the promoted dtype of
    the gates and the branches, computed in float32; differentiable in all four inputs.
    Runs on CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1``.
    """
    branches = tuple(unit_stride_last(t) for t in (compressed, selected, sliding))
    if gates.shape != (3, *branches[0].shape[:3]):
        raise ValueError(f"gates must be [3, b, h, n] = [3, {', '.join(map(str, branches[0].shape[:3]))}], "
                         f"got {tuple(gates.shape)}")
    for name, t in zip(("selected", "sliding"), branches[1:]):
        if t.shape != branches[0].shape or t.dtype != branches[0].dtype:
            raise ValueError(f"{name} must match compressed {tuple(branches[0].shape)} "
                             f"{branches[0].dtype}, got {tuple(t.shape)} {t.dtype}")
    return _GatedSum.apply(gates, *branches)


def gated_sum_of_logits(logits: torch.Tensor, compressed: torch.Tensor, selected: torch.Tensor | PartialOutputs,
                        sliding: torch.Tensor | PartialOutputs) -> torch.Tensor:
    """``gated_sum(logits.sigmoid(), ...)`` with the sigmoid taken in the kernel: a
    decoding step's gates without a launch of their own. logits: [3, b, h, n], any strides
    (the projection's gate columns rearranged ``b n (h s) -> s b h n``); the gates are
    rounded to its dtype. ``selected`` and ``sliding`` may come in shares of their keys
    (``selection.selection_attention_partials_at``), merged here and rounded to the
    compressed branch's dtype. Forward only, for inputs the caller has validated."""
    selected, sliding = (branch if isinstance(branch, PartialOutputs) else unit_stride_last(branch)
                         for branch in (selected, sliding))
    return _launch_forward(logits, unit_stride_last(compressed), selected, sliding, sigmoid=True)


def _folded_lses(gates: torch.Tensor, *lses: torch.Tensor) -> torch.Tensor:
    """``lse_k - log(gate_k)`` of the three branches, [3, b, h, n] float32 contiguous: +inf
    (every P = 0) where the gate is 0, so that no row turns into NaN, also where lse is
    -inf (a row without keys); gates: [3, b, h, n], lses: three [b, h, n] float32, any
    strides. Compiled, one expression that Inductor fuses into one kernel; eager, one
    launch of ``_folded_lses_kernel`` where the expression took seven (0.23 ms of kernels
    at the layer benchmark's n = 65536 on an H100)."""
    if torch.compiler.is_compiling():
        return torch.where(gates > 0, torch.stack(lses) - gates.float().log(), float("inf")).contiguous()
    _, b, h, n = gates.shape
    folded = _allocate((3, b, h, n), torch.float32, gates.device)
    launch(_folded_lses_kernel, (b * h, cdiv(n, _LSE_BLOCK_N)),
        gates, *lses, folded, *gates.stride(), *(stride for lse in lses for stride in lse.stride()), h, n,
        BLOCK_N=_LSE_BLOCK_N,
    )
    return folded


def _fake_branches_backward(d_y, out_weight, merged, weight_dtype, q, ck, cv, out_c, folded_c, rq, rk, v, indices,
                            mask, out_s, folded_s, out_w, folded_w, table, *options, document_start=None,
                            document_end=None):
    d_out = out_c.new_empty(out_c.shape)
    compressed = compressed_kernels._fake_attend_and_select_backward(d_out, None, q, ck, cv)
    drq, drk, dv, _, dgate_s, dgate_w = selection_kernels._fake_backward(
        rq, rk, v, indices, mask, None, out_s, folded_s, out_w, folded_w, d_out, d_out, *options[-4:], table
    )
    d_weight = d_y.new_empty((0,) if out_weight is None else out_weight.shape, dtype=weight_dtype)
    return (*compressed, drq, drk, dv, dgate_s, dgate_w, d_weight)


@launcher_op("gated_branches_backward", _fake_branches_backward)
def _branches_backward(
    d_y: torch.Tensor, out_weight: torch.Tensor | None, merged: torch.Tensor | None, weight_dtype: torch.dtype,
    q: torch.Tensor, ck: torch.Tensor, cv: torch.Tensor, out_c: torch.Tensor,
    folded_c: torch.Tensor, rq: torch.Tensor, rk: torch.Tensor, v: torch.Tensor, indices: torch.Tensor,
    mask: torch.Tensor, out_s: torch.Tensor, folded_s: torch.Tensor, out_w: torch.Tensor, folded_w: torch.Tensor,
    table: list[torch.Tensor], compress_block_size: int, compress_stride: int, num_mem: int, causal: bool, scale: float,
    selection_block_size: int, num_selected: int, share_selection: bool,
    block_size: int, selection_causal: bool, window: int | None, selection_scale: float,
    document_start: torch.Tensor | None = None, document_end: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor, torch.Tensor, torch.Tensor]:
    """The branches' backward, gates folded into the LSEs (``folded_*``), from ``d_y``,
    the gradient of the gated sum [b, n, hq * d], or with ``out_weight`` [dim, hq * d] (in
    the gated sum's dtype) of its projection ``merged @ out_weight^T`` [b, n, dim]: (dq, dck,
    dcv, dgate_c) of the compressed branch, (drq, drk, dv, dgate_s, dgate_w) of the
    selected and sliding ones, and the gradient of the projection's weight in
    ``weight_dtype`` (empty without one). ``table``: the selection forward's inversion
    for dK / dV, or none. The compressed branch's launches and the weight's gradient run
    beside the others (the arguments after ``table``: the two operators' options, in
    order, then the packed documents' bounds, ``[b, n]`` int32 each, or None).

    The compressed branch's backward runs at half its n = 65536 rate at 8192, its loops
    short and its grids' tails long. Side by side, the layer benchmark's compiled step at
    n = 8192 on an H100 (32 heads on 2 kv heads, d = 64) took 3.432-3.438 -> 3.418-3.425
    ms (medians of 40 steps, three runs each); at 65536 the difference was inside the
    runs' spread.
    """
    d_merged = d_y if out_weight is None else d_y @ out_weight
    # A view, tokens-major: every kernel of the branches reads dO through strides or TMA
    # descriptors, and the selection's dK / dV pass has an offset path for this layout,
    # so no heads-major copy is made.
    d_out = rearrange(d_merged, "b n (h d) -> b h n d", h=out_c.shape[1])

    def compressed():
        grads = compressed_kernels._attend_and_select_backward(
            d_out, None, q, ck, cv, out_c, folded_c, indices, mask, compress_block_size, compress_stride, num_mem,
            causal, scale, selection_block_size, num_selected, share_selection,
            document_start=document_start, document_end=document_end,
        )
        if out_weight is None:
            return grads, d_y.new_empty(0, dtype=weight_dtype)
        return grads, matmul_as(d_y.flatten(0, 1).t(), merged.flatten(0, 1), weight_dtype)

    def selected():
        drq, drk, dv, _, dgate_s, dgate_w = selection_kernels._launch_backward(
            rq, rk, v, indices, mask, None, out_s, folded_s, out_w, folded_w, d_out, d_out,
            block_size, selection_causal, window, selection_scale, table,
            document_start=document_start, document_end=document_end,
        )
        return drq, drk, dv, dgate_s, dgate_w

    (compressed_grads, d_weight), selected_grads = side_by_side(q.device, compressed, selected)
    return (*compressed_grads, *selected_grads, d_weight)


class _GatedBranches(torch.autograd.Function):
    """The compressed branch with its block selection, the selected and sliding branches,
    and their gated sum, projected by ``out_weight`` unless it is None, as one node (see
    the module docstring). ``compressed_options``: the compressed operator's geometry;
    ``selection_options``: (block_size, causal, window, scale) of the selection operator.
    ``invert``: a backward will follow, whose inversion of the selection for dK / dV the
    forward computes beside its selection launches. ``document_start``, ``document_end``:
    the packed documents' bounds, [b, n] int32 each, or None."""

    @staticmethod
    def forward(ctx, gates, q, ck, cv, rq, rk, v, out_weight, compressed_options, selection_options, invert,
                document_start, document_end):
        documents = dict(document_start=document_start, document_end=document_end)
        out_c, lse_c, indices, mask, scores = compressed_kernels._attend_and_select_forward(
            q, ck, cv, *compressed_options, **documents
        )
        out_s, lse_s, out_w, lse_w, merged, table = selection_kernels._launch_forward(
            rq, rk, v, indices, mask, None, *selection_options, 0, gates, out_c, invert, **documents
        )
        if merged.numel() == 0:  # the selection's launch could not fold the sum in
            merged = _forward(gates, out_c, out_s, out_w)
        out, weight = merged, None
        if out_weight is not None:
            weight = out_weight.to(merged.dtype)
            out = merged @ weight.t()
        ctx.save_for_backward(gates, q, ck, cv, rq, rk, v, indices, mask, out_c, lse_c, out_s, lse_s, out_w, lse_w,
                              merged if weight is not None else None, weight, *table)
        ctx.options = compressed_options, selection_options
        ctx.documents = documents
        ctx.weight_dtype = out_weight.dtype if out_weight is not None else merged.dtype
        ctx.mark_non_differentiable(indices, mask, scores)
        return out, indices, mask, scores

    @staticmethod
    def backward(ctx, d_out, _d_indices, _d_mask, _d_scores):
        (gates, q, ck, cv, rq, rk, v, indices, mask, out_c, lse_c, out_s, lse_s, out_w, lse_w,
         merged, weight, *table) = ctx.saved_tensors
        compressed_options, selection_options = ctx.options
        folded_c, folded_s, folded_w = _folded_lses(gates, lse_c, lse_s, lse_w)
        dq, dck, dcv, dgate_c, drq, drk, dv, dgate_s, dgate_w, d_weight = _branches_backward(
            d_out, weight, merged, ctx.weight_dtype, q, ck, cv, out_c, folded_c, rq, rk, v, indices, mask, out_s,
            folded_s, out_w, folded_w, table, *compressed_options, *selection_options, **ctx.documents,
        )
        dgates = torch.stack((dgate_c, dgate_s, dgate_w)).to(gates.dtype)
        d_weight = d_weight if weight is not None else None
        return dgates, dq, dck, dcv, drq, drk, dv, d_weight, None, None, None, None, None


def gated_branches(gates: torch.Tensor, q: torch.Tensor, ck: torch.Tensor, cv: torch.Tensor, rq: torch.Tensor,
                   rk: torch.Tensor, v: torch.Tensor, compressed_options: tuple, selection_options: tuple,
                   out_weight: torch.Tensor | None = None,
                   documents: tuple[torch.Tensor, torch.Tensor] | None = None):
    """NSA's three branches on the Triton kernels, mixed by their gates: the layer's kernel
    path when the selection scores need no gradient.

    gates: [3, b, hq, n]; q, rq (with rotary): [b, hq, n, d]; ck, cv: [b, hk, num_mem + nc, d]
    (unit stride along d); rk (with rotary), v: [b, hk, n, d]. ``compressed_options``:
    (compress_block_size, compress_stride, num_mem, causal, scale, selection_block_size,
    num_selected, share_selection); ``selection_options``: (selection_block_size, causal,
    sliding_window_size, scale), all already validated. Returns the gated sum with the heads
    merged, [b, n, hq * d], or with ``out_weight`` [dim, hq * d] its projection
    ``merged @ out_weight^T`` [b, n, dim] (differentiable in every tensor input), and the
    ``BlockSelection`` the compressed branch chose (not differentiable). ``documents``:
    ``(document_start, document_end)``, [b, n] int32 each, when the rows pack documents
    (``documents.document_bounds``).

    Projected here, the weight's gradient runs beside the selected and sliding branches'
    backward instead of before it: the layer passes its output projection's weight. In
    the layer benchmark's compiled step on an H100 that took 3.33-3.34 -> 3.29-3.30 ms at
    n = 8192 (medians of 40 steps, three runs each; at 65536 no difference beyond the
    runs' spread). The output gradient and the gated sum then stay allocated through the
    branches' backward: measured together with the compression MLPs' single cast
    (``kernels/compress_mlp.py``), the eager step's peak memory went 0.97 -> 1.04 GiB at
    8192 and 5.21 -> 5.50 GiB at 65536.
    """
    inputs = (gates, q, ck, cv, rq, rk, v, out_weight)
    invert = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs)
    document_start, document_end = (None, None) if documents is None else documents
    out, indices, mask, scores = _GatedBranches.apply(*inputs, compressed_options, selection_options, invert,
                                                      document_start, document_end)
    return out, BlockSelection(indices, mask, scores)
