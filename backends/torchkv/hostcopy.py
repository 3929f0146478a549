"""Block copies between host tensors in one pass: scattered slots to scattered slots, one `memmove` per chunk
from compiled code.

Why not torch: it has no op that copies rows from a list of slots to another list of slots. `index_select`
then `index_copy_` goes through an intermediate (every byte read and written twice, and `index_copy_` on a
CPU is an element loop well below memcpy speed), and a `copy_` per block spends microseconds of dispatch on a
16 KiB block, as long as the bytes take. Engines do the same thing in C++ (vLLM's `swap_blocks` on a CPU is a
loop of memcpy over (src, dst) block pairs); here the loop is a numba kernel. It
walks the slot pairs itself (checking them, finding runs, moving each run's pieces), so a move costs one call
whatever the number of blocks and no offset arrays are built in Python: planning them with numpy cost ~60 µs
a move, several percent of a 16 MiB copy. A move of at least `PARALLEL_BYTES` is shared among as many threads
as torch's own copies use (`torch.get_num_threads()`), in parts of equal block counts (a run crossing a part
boundary is cut there), so that it is held to the same resources as the contiguous `copy_` it is compared with.

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
def _check(ss, ds, s_blocks, d_blocks):  # pragma: no cover  (compiled; Python never runs this body)
    """The number of runs (pairs consecutive on both sides); -1 or -2 when a source or destination slot is out
    of range."""
    n_runs = 0
    for i in range(ss.shape[0]):
        if ss[i] < 0 or ss[i] >= s_blocks:
            return -1
        if ds[i] < 0 or ds[i] >= d_blocks:
            return -2
        if i == 0 or ss[i] != ss[i - 1] + 1 or ds[i] != ds[i - 1] + 1:
            n_runs += 1
    return n_runs


@numba.njit(nogil=True, cache=True)
def _copy_range(dst, ds, src, ss, lo, hi, geom):  # pragma: no cover  (compiled)
    """Pairs lo..hi-1. geom: pieces, piece bytes, source slot and piece strides, destination slot and piece
    strides, whether a run's pieces are adjacent on both sides (then a run moves as one chunk per piece)."""
    pieces, piece_bytes, s_slot, s_piece = geom[0], geom[1], geom[2], geom[3]
    d_slot, d_piece, merge = geom[4], geom[5], geom[6]
    i = lo
    while i < hi:
        j = i + 1
        if merge:
            while j < hi and ss[j] == ss[j - 1] + 1 and ds[j] == ds[j - 1] + 1:
                j += 1
        size = (j - i) * piece_bytes
        s0, d0 = src + ss[i] * s_slot, dst + ds[i] * d_slot
        for p in range(pieces):
            _move(d0 + p * d_piece, s0 + p * s_piece, size)
        i = j


@numba.njit(nogil=True, cache=True)
def _copy_serial(dst, ds, src, ss, geom):  # pragma: no cover  (compiled)
    _copy_range(dst, ds, src, ss, 0, ss.shape[0], geom)


@numba.njit(nogil=True, parallel=True, cache=True)
def _copy_parallel(dst, ds, src, ss, geom, parts):  # pragma: no cover  (compiled)
    n = ss.shape[0]
    for part in numba.prange(parts):  # one part per thread, of equal block counts
        _copy_range(dst, ds, src, ss, n * part // parts, n * (part + 1) // parts, geom)


_ARRAY = numba.types.Array(numba.types.int64, 1, "C", readonly=False)


def ready() -> None:
    """Compile (or load from numba's cache) the kernels now, so that no timed move pays for it."""
    i64 = numba.types.int64
    _check.compile((_ARRAY, _ARRAY, i64, i64))
    _copy_serial.compile((i64, _ARRAY, i64, _ARRAY, _ARRAY))
    _copy_parallel.compile((i64, _ARRAY, i64, _ARRAY, _ARRAY, i64))


def _threads() -> int:
    return max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))


def _slots(slots) -> np.ndarray:
    if isinstance(slots, range):  # the staging side: np.asarray would go through a list
        return np.arange(slots.start, slots.stop, slots.step, dtype=np.int64)
    return np.ascontiguousarray(slots, dtype=np.int64)


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


def copy_blocks(dst: torch.Tensor, dst_layout: str, ds, src: torch.Tensor, src_layout: str, ss) -> int:
    """Copy the blocks at slots `ss` of `src` to slots `ds` of `dst` (host pool tensors, see `pieces_of`), byte for
    byte, in one kernel call. Runs of slots consecutive in both lists are one chunk where both layouts keep a
    run's bytes together (both block-major: the whole run; both layer-first: each piece of the run), else every
    piece of every block is its own chunk. Returns the number of runs (slots consecutive on both sides)."""
    ss, ds = _slots(ss), _slots(ds)
    if ss.shape != ds.shape or ss.ndim != 1:
        raise ValueError(f"{ss.size} source slots for {ds.size} destination slots")
    if not ss.size:
        return 0
    s_blocks, pieces, s_slot, s_piece = pieces_of(src, src_layout)
    d_blocks, d_pieces, d_slot, d_piece = pieces_of(dst, dst_layout)
    block_bytes = src.numel() * src.element_size() // max(s_blocks, 1)
    if pieces != d_pieces or block_bytes != dst.numel() * dst.element_size() // max(d_blocks, 1):
        raise ValueError("source and destination blocks differ in shape")
    n_runs = _check(ss, ds, s_blocks, d_blocks)
    if n_runs < 0:
        side, n = ("source", s_blocks) if n_runs == -1 else ("destination", d_blocks)
        raise IndexError(f"{side} slot out of range 0..{n - 1}")
    if src_layout == dst_layout == "block_major":  # a block, or a run, is one chunk: the piece is the block
        geom = [1, block_bytes, block_bytes, 0, block_bytes, 0, 1]
    else:
        geom = [pieces, block_bytes // pieces, s_slot, s_piece, d_slot, d_piece, int(src_layout == dst_layout)]
    geom = np.array(geom, dtype=np.int64)
    threads = min(_threads(), ss.size)
    if threads > 1 and ss.size * block_bytes >= PARALLEL_BYTES:
        _copy_parallel(dst.data_ptr(), ds, src.data_ptr(), ss, geom, threads)
    else:
        _copy_serial(dst.data_ptr(), ds, src.data_ptr(), ss, geom)
    return int(n_runs)
