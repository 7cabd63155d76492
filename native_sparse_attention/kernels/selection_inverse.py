"""The selection's inversion: its (query, key set) entries grouped by the key block they
attend, the table that the key-major kernels of ``kernels/selection.py`` walk (the dK / dV
pass and the key-major forward).

Notation (that of ``kernels/selection.py``)
-------------------------------------------
Entry: one (query i, selection head, key set) whose key set is a valid block, packed into
    an int64 as ``i << 32 | selection_head << 16 | key_set``. Key: one (batch z, kv head,
    key block), numbered (z * HKV + kv_head) * NUM_BLOCKS + block; NUM_KEYS of them, and
    NUM_KEYS itself marks an entry without a key (a masked slot, a block out of range).
CHUNK: most entries per program of a key-major kernel; a key's entries are cut into
    chunks, numbered key after key.

``key_block_entries`` builds the table on the device, without a host synchronisation;
``KeyBlockEntries`` says what it holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from native_sparse_attention.kernels.launch import launch
from native_sparse_attention.kernels.library import cdiv, device_properties

if TYPE_CHECKING:
    from native_sparse_attention.kernels.selection import _Problem

__all__ = ["KeyBlockEntries", "fake_key_block_entries", "key_block_entries", "orders_chunks"]

ENTRY_KEYS_QUERIES = 64  # queries per program of _entry_keys_kernel
CHUNK_KEYS_BLOCK = 1024  # chunks per program of _chunk_keys_kernel
FIRST_CHUNK_KEYS = 1024  # keys per step of _first_chunks_kernel
# The dK / dV chunks launch in query order only where q and dO together exceed this many
# times L2 (see orders_chunks).
ORDERED_CHUNKS_MIN_L2_FILLS = 8


@triton.jit
def _entry_keys_kernel(
    SEL_IDX, SEL_MASK, KEYS, ENTRIES,
    N, HKV, HS, NUM_BLOCKS, NUM_KEYS,
    SEL: tl.constexpr, NUM_SETS: tl.constexpr, SETS_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    CAUSAL: tl.constexpr, BLOCK_Q: tl.constexpr,
):
    """The key of each of the NUM_SETS entries of BLOCK_Q queries of one selection head
    (NUM_KEYS for a masked slot or a block with no visible key) and the packed entry
    (see ``selection._entry_rows``), at the entry's index in the [Z, HS, N, NUM_SETS] order."""
    sel_head = tl.program_id(1)
    z = tl.program_id(2)
    i = tl.program_id(0) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    sets = tl.arange(0, SETS_PAD)
    slot = sets - (NUM_SETS - SEL)
    query = (z.to(tl.int64) * HS + sel_head) * N + i
    exists = (i < N)[:, None] & (sets < NUM_SETS)[None, :]
    is_slot = exists & (slot >= 0)[None, :]
    block = tl.load(SEL_IDX + query[:, None] * SEL + slot[None, :], mask=is_slot, other=-1).to(tl.int64)
    on = tl.load(SEL_MASK + query[:, None] * SEL + slot[None, :], mask=is_slot, other=0) != 0
    valid = is_slot & on & (block >= 0) & (block < NUM_BLOCKS)
    if CAUSAL:
        own = (i // BLOCK_SIZE)[:, None]
        valid = (valid & (block <= own)) | (exists & (sets == 0)[None, :])  # the own block is always attended
        block = tl.where((sets == 0)[None, :], own, block)
    kv_head = sel_head // (HS // HKV)
    key = tl.where(valid, (z.to(tl.int64) * HKV + kv_head) * NUM_BLOCKS + block, NUM_KEYS)
    entry = query[:, None] * NUM_SETS + sets[None, :]
    tl.store(KEYS + entry, key.to(KEYS.dtype.element_ty), mask=exists)
    packed = (i.to(tl.int64)[:, None] << 32) | ((sel_head << 16) | sets)[None, :]
    tl.store(ENTRIES + entry, packed, mask=exists)


@triton.jit
def _first_chunks_kernel(KEY_FIRST_ENTRY, KEY_FIRST_CHUNK, NUM_KEYS, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """One program: ``KEY_FIRST_CHUNK[k]``, the chunks of CHUNK entries of the keys before
    key k, for k = 0 .. NUM_KEYS (the last: every chunk), from the keys' first entries."""
    total = tl.zeros([], tl.int64)
    for start in range(0, NUM_KEYS + 1, BLOCK):
        key = start + tl.arange(0, BLOCK)
        is_key = key < NUM_KEYS
        first = tl.load(KEY_FIRST_ENTRY + key, mask=is_key, other=0)
        count = tl.load(KEY_FIRST_ENTRY + key + 1, mask=is_key, other=0) - first
        chunks = (count + CHUNK - 1) // CHUNK
        tl.store(KEY_FIRST_CHUNK + key, total + tl.cumsum(chunks, 0) - chunks, mask=key <= NUM_KEYS)
        total += tl.sum(chunks, 0)


@triton.jit
def _chunk_keys_kernel(
    ENTRIES, KEY_FIRST_ENTRY, KEY_FIRST_CHUNK, CHUNK_KEY, POSITION, NUM_CHUNKS, NUM_KEYS, SEARCH_STEPS, N,
    NUM_BLOCKS, CHUNK: tl.constexpr, BLOCK: tl.constexpr, ORDERED: tl.constexpr,
):
    """The key of BLOCK chunks (NUM_KEYS for the spare ones past the last chunk), found by
    a binary search of SEARCH_STEPS steps in KEY_FIRST_CHUNK; with ORDERED also their
    launch position: (z * HKV + kv_head) * N + the query of the chunk's first entry, and
    Z * HKV * N, past every chunk, for the spare ones."""
    chunk = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    exists = chunk < NUM_CHUNKS
    # The last key whose first chunk is at most `chunk`: lo's first chunk is <= chunk,
    # hi's (NUM_KEYS + 1: past the end) above it.
    lo = tl.zeros([BLOCK], tl.int32)
    hi = tl.full([BLOCK], NUM_KEYS + 1, tl.int32)
    for _ in range(SEARCH_STEPS):
        mid = (lo + hi) // 2
        active = hi - lo > 1
        below = tl.load(KEY_FIRST_CHUNK + mid, mask=active, other=0) <= chunk
        lo = tl.where(active & below, mid, lo)
        hi = tl.where(active & ~below, mid, hi)
    key = lo
    tl.store(CHUNK_KEY + chunk, key, mask=exists)
    if ORDERED:
        real = key < NUM_KEYS
        first_entry = tl.load(KEY_FIRST_ENTRY + key, mask=real, other=0)
        first_chunk = tl.load(KEY_FIRST_CHUNK + key, mask=real, other=0)
        entry = first_entry + (chunk - first_chunk).to(tl.int64) * CHUNK
        i = tl.load(ENTRIES + entry, mask=real, other=0) >> 32
        head = (key // NUM_BLOCKS).to(tl.int64)
        # Scalar arguments equal to 1 arrive as constexprs, hence no .to() on N.
        position = tl.where(real, head * N + i, head * N)
        tl.store(POSITION + chunk, position.to(POSITION.dtype.element_ty), mask=exists)


# ----------------------------------------------------------------------------- host


@dataclass(frozen=True)
class KeyBlockEntries:
    """The (query, key set) entries of the selection grouped by the key they attend.

    ``entries``: the (query, selection head, key set) of each of the [b, hs, n, num_sets]
    key sets, packed (module notation), sorted by key (in query order within a key), those
    without a valid key last; key k owns ``entries[first_entry[k]:first_entry[k + 1]]``,
    cut into chunks of ``chunk`` entries numbered from ``first_chunk[k]``;
    ``chunk_key[p]`` is the key of chunk p, or ``num_keys`` for the spare programs past
    the last chunk; program p of a key-major kernel takes chunk ``chunk_order[p]``, or
    chunk p where ``chunk_order`` is None (``orders_chunks``).
    """

    entries: torch.Tensor
    first_entry: torch.Tensor
    first_chunk: torch.Tensor
    chunk_key: torch.Tensor
    chunk_order: torch.Tensor | None
    num_keys: int

    def tensors(self) -> list[torch.Tensor]:
        """The table as an operator passes it on: an empty ``chunk_order`` where it is None."""
        order = self.chunk_key.new_empty(0, dtype=torch.int64) if self.chunk_order is None else self.chunk_order
        return [self.entries, self.first_entry, self.first_chunk, self.chunk_key, order]

    @staticmethod
    def from_tensors(tensors: list[torch.Tensor], num_keys: int) -> KeyBlockEntries:
        entries, first_entry, first_chunk, chunk_key, order = tensors
        order = order if order.numel() else None
        return KeyBlockEntries(entries, first_entry, first_chunk, chunk_key, order, num_keys)


def key_block_entries(problem: _Problem, indices: torch.Tensor, fmask: torch.Tensor,
                      element_size: int) -> KeyBlockEntries:
    """indices, fmask: the contiguous [b, hs, n, sel] operands of the kernels;
    ``element_size``: bytes per element of q and dO.

    Inverts the selection on the device, without a host synchronisation: the grid of
    the key-major kernels is an upper bound on the number of chunks, known from the shapes. One
    kernel labels the entries, a sort groups them by key, a search finds each key's first
    entry, and two small kernels number the chunks and find each chunk's key (and
    position, where a second sort then gives the launch order). Few launches matter here:
    below ~16k tokens an eager backward is bound by the host's launches, and a replayed
    one pays a few microseconds for each. At 32 heads on 2 kv heads, random selections,
    n = 8192 on an H100, the inversion took 52 us in 16 kernels against 83 us in 29 when
    eight elementwise, scan and search ops built the table and the chunks were always
    ordered (the backward 1.27 -> 1.25 ms); at 65536, where they still are, 211-218
    against 218 us.
    """
    b, hs, n, device = problem.batch, problem.selection_heads, problem.seq_len, indices.device
    constexprs = problem.constexprs
    num_keys = problem.num_key_blocks
    # Each halving of the keys' width halves the radix sort's passes (NUM_KEYS itself
    # marks the entries without a key).
    key_dtype = next(dtype for dtype in (torch.int16, torch.int32, torch.int64) if num_keys < torch.iinfo(dtype).max)
    keys = torch.empty((b, hs, n, constexprs["NUM_SETS"]), dtype=key_dtype, device=device)
    entries = torch.empty(keys.shape, dtype=torch.int64, device=device)
    launch(_entry_keys_kernel, (cdiv(n, ENTRY_KEYS_QUERIES), hs, b),
        indices, fmask, keys, entries,
        n, problem.kv_heads, hs, problem.num_blocks, num_keys,
        **{name: constexprs[name] for name in ("SEL", "NUM_SETS", "SETS_PAD", "BLOCK_SIZE")},
        CAUSAL=problem.causal,
        BLOCK_Q=ENTRY_KEYS_QUERIES,
    )
    sorted_keys, order = torch.sort(keys.flatten(), stable=True)
    first_entry = torch.searchsorted(sorted_keys, torch.arange(num_keys + 1, dtype=key_dtype, device=device))
    chunk = problem.config.dkv_chunk
    first_chunk = torch.empty(num_keys + 1, dtype=torch.int64, device=device)
    launch(_first_chunks_kernel, (1,), first_entry, first_chunk, num_keys, CHUNK=chunk, BLOCK=FIRST_CHUNK_KEYS)
    entries = entries.flatten()[order]
    max_chunks = cdiv(keys.numel(), chunk) + num_keys
    chunk_key = torch.empty(max_chunks, dtype=torch.int32, device=device)
    ordered = orders_chunks(problem, element_size, device)
    position_dtype = torch.int32 if b * problem.kv_heads * n < torch.iinfo(torch.int32).max else torch.int64
    position = torch.empty(max_chunks if ordered else 0, dtype=position_dtype, device=device)
    launch(_chunk_keys_kernel, (cdiv(max_chunks, CHUNK_KEYS_BLOCK),),
        entries, first_entry, first_chunk, chunk_key, position if ordered else chunk_key, max_chunks, num_keys,
        num_keys.bit_length(), n, problem.num_blocks,
        CHUNK=chunk,
        BLOCK=CHUNK_KEYS_BLOCK,
        ORDERED=ordered,
    )
    return KeyBlockEntries(entries, first_entry, first_chunk, chunk_key, position.argsort() if ordered else None,
                            num_keys)


def fake_key_block_entries(problem: _Problem, element_size: int, device: torch.device) -> list[torch.Tensor]:
    """``key_block_entries(...).tensors()``'s shapes and dtypes."""
    num_keys = problem.num_key_blocks
    num_entries = problem.batch * problem.selection_heads * problem.seq_len * problem.constexprs["NUM_SETS"]
    max_chunks = cdiv(num_entries, problem.config.dkv_chunk) + num_keys
    order = max_chunks if orders_chunks(problem, element_size, device) else 0
    return [torch.empty(size, dtype=dtype, device=device) for size, dtype in (
        (num_entries, torch.int64), (num_keys + 1, torch.int64), (num_keys + 1, torch.int64),
        (max_chunks, torch.int32), (order, torch.int64))]


def orders_chunks(problem: _Problem, element_size: int, device: torch.device) -> bool:
    """Whether the dK / dV chunks launch in the order of their first query, so that the
    programs running together gather neighbouring q and dO rows, which L2 then holds.
    That pays only where q and dO outgrow L2 many times over: at 32 heads on 2 kv heads,
    d = 64, bf16, random selections on an H100 (50 MB of L2), the pass took 2.63 against
    2.68-2.71 ms in key order at n = 65536 (q and dO 537 MB) and 1.300-1.306 against
    1.306-1.314 ms at 32768, and lost at most 0.015 ms in key order at 16384 and 8192,
    while the sort that orders them takes 0.02-0.04 ms. The interpreter always orders
    them (the tests cover both orders)."""
    if device.type != "cuda":
        return True
    l2_bytes = getattr(device_properties(device), "L2_cache_size", 0)
    q_and_do_bytes = 2 * problem.batch * problem.query_heads * problem.seq_len * problem.head_dim * element_size
    return q_and_do_bytes > ORDERED_CHUNKS_MIN_L2_FILLS * l2_bytes
