"""Block copies between host tensors in one pass: scattered slots to scattered slots, one `memmove` per chunk
from compiled code.

Why not torch: it has no op that copies rows from a list of slots to another list of slots. `index_select`
then `index_copy_` goes through an intermediate (every byte read and written twice, and `index_copy_` on a
CPU is an element loop well below memcpy speed), and a `copy_` per block spends microseconds of dispatch on a
16 KiB block, as long as the bytes take. Engines do the same thing in C++ (vLLM's `swap_blocks` on a CPU is a
loop of memcpy over (src, dst) block pairs); here the loop is a numba kernel over byte offsets planned with
numpy, so a move costs one call whatever the number of blocks. A move of at least `PARALLEL_BYTES` is shared
among as many threads as torch's own copies use (`torch.get_num_threads()`), split by bytes (large chunks cut
into `SPLIT_BYTES` pieces), so that it is held to the same resources as the contiguous `copy_` it is
compared with.

A pool tensor is described by its layout (`geometry.block_dim`): block-major `[blocks, *block_shape]` (a block
is one contiguous chunk) or layer-first `[layers, kv, blocks, ...]` (a block is `layers × kv` pieces, each
contiguous, the same piece of consecutive blocks adjacent). Slots are checked against the pool's size before
the kernel runs: it writes through raw addresses, where torch would have raised an IndexError.

This module imports numba (about a second, once per process); `transfers` imports it only when a move needs
it, and calls `ready()` before it starts a timer. The kernel is cached on disk by numba after the first build.
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from llvmlite import ir
from numba.core import cgutils
from numba.extending import intrinsic

PARALLEL_BYTES = 1 << 20  # smaller moves stay on one thread: waking the others costs more than it saves
SPLIT_BYTES = 1 << 20  # a chunk longer than this is cut, so that one long run can be shared among threads


@intrinsic
def _move(typingctx, dst, src, size):
    """memmove(dst, src, size) on integer addresses: LLVM's memmove intrinsic, which is libc's. memmove, not
    memcpy: a copy within one tensor must not be undefined behaviour if its chunks overlap."""
    sig = numba.types.void(numba.types.int64, numba.types.int64, numba.types.int64)

    def codegen(context, builder, signature, args):
        d, s, n = args
        byte_ptr = ir.IntType(8).as_pointer()
        cgutils.raw_memmove(builder, builder.inttoptr(d, byte_ptr), builder.inttoptr(s, byte_ptr), n, 1)

    return sig, codegen


@numba.njit(nogil=True, cache=True)
def _copy_chunks(dst, doff, src, soff, size):  # pragma: no cover  (compiled; Python never runs this body)
    for i in range(size.shape[0]):
        _move(dst + doff[i], src + soff[i], size[i])


@numba.njit(nogil=True, parallel=True, cache=True)
def _copy_chunks_parallel(dst, doff, src, soff, size, bounds):  # pragma: no cover  (compiled)
    for part in numba.prange(bounds.shape[0] - 1):  # one part per thread, parts of about equal bytes
        for i in range(bounds[part], bounds[part + 1]):
            _move(dst + doff[i], src + soff[i], size[i])


_OFFSETS = numba.types.Array(numba.types.int64, 1, "C", readonly=False)


def ready() -> None:
    """Compile (or load from numba's cache) the kernels now, so that no timed move pays for it."""
    i64 = numba.types.int64
    _copy_chunks.compile((i64, _OFFSETS, i64, _OFFSETS, _OFFSETS))
    _copy_chunks_parallel.compile((i64, _OFFSETS, i64, _OFFSETS, _OFFSETS, _OFFSETS))


def _threads() -> int:
    return max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))


def _run(dst_addr: int, doff: np.ndarray, src_addr: int, soff: np.ndarray, size: np.ndarray) -> None:
    """The chunks, on one thread or shared among `_threads()` by bytes."""
    total, threads = int(size.sum()), _threads()
    if threads == 1 or total < PARALLEL_BYTES:
        _copy_chunks(dst_addr, doff, src_addr, soff, size)
        return
    pieces = -(-size // SPLIT_BYTES)
    if (pieces > 1).any():  # cut the long chunks: piece j of a chunk starts j × SPLIT_BYTES into it
        first = np.repeat(np.cumsum(pieces) - pieces, pieces)
        within = (np.arange(first.size, dtype=np.int64) - first) * SPLIT_BYTES
        soff, doff = np.repeat(soff, pieces) + within, np.repeat(doff, pieces) + within
        size = np.minimum(np.repeat(size, pieces) - within, SPLIT_BYTES)
    ends = np.cumsum(size)
    bounds = np.searchsorted(ends, total * np.arange(1, threads, dtype=np.int64) // threads, side="right")
    bounds = np.ascontiguousarray(np.concatenate(([0], bounds, [size.size])), dtype=np.int64)
    _copy_chunks_parallel(dst_addr, doff, src_addr, soff, size, bounds)


def pieces_of(t: torch.Tensor, layout: str) -> tuple[int, int, int, int]:
    """(blocks, pieces per block, slot stride, piece stride) of a pool tensor, strides in bytes: piece `p` of the
    block at slot `s` starts `s × slot stride + p × piece stride` bytes into the tensor. The pieces are the
    layer-first layout's `layers × kv`, whatever the layout, so that pools of either layout pair up."""
    if not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError("host copies need contiguous CPU tensors")
    shape = t.shape
    if layout == "block_major":
        blocks, pieces = shape[0], shape[1] * shape[2]
        block_bytes = t.numel() * t.element_size() // max(blocks, 1)
        return blocks, pieces, block_bytes, block_bytes // pieces
    blocks, pieces = shape[2], shape[0] * shape[1]
    piece_bytes = t.numel() * t.element_size() // max(blocks * pieces, 1)
    return blocks, pieces, piece_bytes, blocks * piece_bytes


def _run_starts(ss: np.ndarray, ds: np.ndarray) -> np.ndarray:
    """Indices where a run of slots consecutive on both sides begins."""
    breaks = (np.diff(ss) != 1) | (np.diff(ds) != 1)
    return np.flatnonzero(np.concatenate(([True], breaks)))


def copy_blocks(dst: torch.Tensor, dst_layout: str, ds, src: torch.Tensor, src_layout: str, ss) -> int:
    """Copy the blocks at slots `ss` of `src` to slots `ds` of `dst` (host pool tensors, see `pieces_of`), byte for
    byte, in one kernel call. Runs of slots consecutive in both lists are one chunk where both layouts keep a
    run's bytes together (both block-major: the whole run; both layer-first: each piece of the run), else every
    piece of every block is its own chunk. Returns the number of runs (slots consecutive on both sides)."""
    ss, ds = np.asarray(ss, dtype=np.int64), np.asarray(ds, dtype=np.int64)
    if ss.shape != ds.shape or ss.ndim != 1:
        raise ValueError(f"{ss.size} source slots for {ds.size} destination slots")
    if not ss.size:
        return 0
    s_blocks, pieces, s_slot, s_piece = pieces_of(src, src_layout)
    d_blocks, d_pieces, d_slot, d_piece = pieces_of(dst, dst_layout)
    block_bytes = src.numel() * src.element_size() // max(s_blocks, 1)
    if pieces != d_pieces or block_bytes != dst.numel() * dst.element_size() // max(d_blocks, 1):
        raise ValueError("source and destination blocks differ in shape")
    for name, slots, n in (("source", ss, s_blocks), ("destination", ds, d_blocks)):
        if slots.min() < 0 or slots.max() >= n:
            raise IndexError(f"{name} slot out of range 0..{n - 1}")
    starts = _run_starts(ss, ds)
    lengths = np.diff(np.append(starts, ss.size))
    if src_layout == dst_layout == "block_major":  # a block, or a run, is one chunk: the piece is the block
        pieces, s_piece, d_piece, piece_bytes = 1, 0, 0, block_bytes
    else:
        piece_bytes = block_bytes // pieces
    if src_layout == dst_layout:  # a run's bytes (of each piece) are adjacent on both sides
        ss, ds, sizes = ss[starts], ds[starts], lengths * piece_bytes
    else:
        sizes = np.full(ss.size, piece_bytes, dtype=np.int64)
    p = np.arange(pieces, dtype=np.int64)[:, None]
    soff = np.ascontiguousarray((ss[None, :] * s_slot + p * s_piece).ravel())
    doff = np.ascontiguousarray((ds[None, :] * d_slot + p * d_piece).ravel())
    _run(dst.data_ptr(), doff, src.data_ptr(), soff, np.ascontiguousarray(np.tile(sizes, pieces)))
    return int(starts.size)
