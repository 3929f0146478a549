"""Moving blocks between pools, timed, in one of three ways (`--copy-mode`):

- `block`: one copy per block (what a naive offloader does; many small DMA transfers);
- `coalesced`: runs of blocks consecutive in both pools move as one copy (or one vectored disk call);
- `staged`: the blocks are gathered into a contiguous staging buffer on the source side, moved in one copy,
  and scattered on the destination side (two extra on-device passes, one large transfer).

Between two host pools (a CPU run, where "HBM" is host memory too) there is no link to stage across: both
`coalesced` and `staged` copy every block straight from its source slot to its destination slot in one pass
(`hostcopy`, one compiled call per move); host-side gathers and scatters of the other paths use the same kernel.

Timing is per direction (`hbm->dram`, `dram->ssd`, …): CUDA events on a dedicated copy stream for what runs on
the GPU, `perf_counter_ns` for host copies and disk calls, each call synchronised so that the bytes counted
are bytes moved. The copy stream waits for the compute stream first, so a block is never sent before it is
written.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import torch
from kvbench.backends.torchkv.pools import DiskPool, TensorPool, pinned_empty

COPY_MODES = ("block", "coalesced", "staged")


@dataclass
class DirectionTraffic:
    bytes: int = 0
    blocks: int = 0
    calls: int = 0  # copy calls (batches)
    copies: int = 0  # individual copies issued (blocks, runs or staged transfers)
    seconds: float = 0.0

    def summary(self) -> dict:
        gbps = self.bytes / self.seconds / 1e9 if self.seconds > 0 else None
        return {
            "bytes": self.bytes,
            "blocks": self.blocks,
            "calls": self.calls,
            "copies": self.copies,
            "seconds": self.seconds,
            "gb_per_s": gbps,
        }


def runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """(src first, dst first, length) of the maximal runs consecutive in both lists. Vectorised: for small
    blocks a Python loop over the slots cost as much as copying them."""
    if not src:
        return []
    s, d = np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)
    starts = np.flatnonzero(np.concatenate(([True], (np.diff(s) != 1) | (np.diff(d) != 1))))
    lengths = np.diff(np.append(starts, s.size))
    return list(zip(s[starts].tolist(), d[starts].tolist(), lengths.tolist(), strict=True))


class Mover:
    def __init__(self, mode: str, device: torch.device):
        if mode not in COPY_MODES:
            raise ValueError(f"copy mode {mode!r}: choose {', '.join(COPY_MODES)}")
        self.mode, self.device = mode, device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.traffic: dict[str, DirectionTraffic] = defaultdict(DirectionTraffic)
        self._host_staging: dict[tuple, torch.Tensor] = {}
        self._hostcopy = None  # the host copy kernel's module, imported on the first move that touches host memory

    def host_staging(self, shape: tuple[int, ...], dtype: torch.dtype, tag: str) -> torch.Tensor:
        """A reusable contiguous host buffer of at least shape[0] blocks (pinned on CUDA), grown by doubling."""
        key = (tag, shape[1:], dtype)
        buf = self._host_staging.get(key)
        if buf is None or buf.shape[0] < shape[0]:
            n = max(shape[0], 2 * (buf.shape[0] if buf is not None else 0), 16)
            buf = pinned_empty((n, *shape[1:]), dtype) if self.cuda else torch.empty((n, *shape[1:]), dtype=dtype)
            old = self._host_staging.pop(key, None)
            if old is not None and self.cuda:
                torch.cuda.cudart().cudaHostUnregister(old.data_ptr())
            self._host_staging[key] = buf
        return buf[: shape[0]]

    def copy(self, direction: str, src, src_slots: list[int], dst, dst_slots: list[int]) -> None:
        """Move blocks src[src_slots[i]] → dst[dst_slots[i]] and count the bytes and time under `direction`."""
        if not src_slots:
            return
        t = self.traffic[direction]
        nblk = len(src_slots)
        t.bytes += nblk * src.geometry.block_bytes
        t.blocks += nblk
        t.calls += 1
        if self._hostcopy is None and any(p.kind == "tensor" and p.data.device.type == "cpu" for p in (src, dst)):
            from kvbench.backends.torchkv import hostcopy  # numba: a second to import, so only when needed

            hostcopy.ready()  # compiled or loaded from cache here, outside the timed move
            self._hostcopy = hostcopy
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(self.stream):
                t0 = time.perf_counter_ns()
                start.record()
                t.copies += self._move(src, src_slots, dst, dst_slots)
                end.record()
            end.synchronize()
            host_ns = time.perf_counter_ns() - t0
            # disk calls are synchronous host work between the events; events alone miss nothing on the GPU side
            t.seconds += max(start.elapsed_time(end) / 1e3, host_ns / 1e9 if _has_disk(src, dst) else 0.0)
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
        else:
            t0 = time.perf_counter_ns()
            t.copies += self._move(src, src_slots, dst, dst_slots)
            t.seconds += (time.perf_counter_ns() - t0) / 1e9

    def close(self) -> None:
        """Give back the page-locked staging buffers."""
        for buf in self._host_staging.values():
            if self.cuda:
                torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())
        self._host_staging.clear()

    # --- the moves, by pool kinds ----------------------------------------------------------------------
    def _move(self, src, ss: list[int], dst, ds: list[int]) -> int:
        if src.kind == "tensor" and dst.kind == "tensor":
            return self._tensor_to_tensor(src, ss, dst, ds)
        if src.kind == "tensor":  # → disk, through host blocks
            return self._to_disk(src, ss, dst, ds)
        if dst.kind == "tensor":
            return self._from_disk(src, ss, dst, ds)
        # disk → disk (a block that left the disk tier and came back to it in one request): via the host
        buf = self.host_staging((len(ss), *src.geometry.block_shape), src.geometry.torch_dtype, "from-disk")
        return self._disk_calls(src.read, list(buf), ss) + self._disk_calls(dst.write, list(buf), ds)

    def _tensor_to_tensor(self, src: TensorPool, ss, dst: TensorPool, ds) -> int:
        nb = self.cuda and (src.pinned or dst.pinned)
        if self.mode == "block":
            # one copy per block, issued in one call: the per-block `copy_` dispatch from Python is what made
            # this mode no faster than the loop one would write
            sel_s, sel_d, dim_s, dim_d = src.bits.select, dst.bits.select, src.dim, dst.dim
            torch._foreach_copy_([sel_d(dim_d, d) for d in ds], [sel_s(dim_s, s) for s in ss], non_blocking=nb)
            return len(ss)
        src_host, dst_host = src.data.device.type == "cpu", dst.data.device.type == "cpu"
        if src_host and dst_host:  # one memory: each block straight to its slot, one pass (module docstring)
            n_runs = self._hostcopy.copy_blocks(dst.data, dst.layout, ds, src.data, src.layout, ss)
            return n_runs if self.mode == "coalesced" else 1
        if self.mode == "coalesced":
            rr = runs(ss, ds)
            for s, d, n in rr:
                if n == 1:  # scattered slots make many runs of one: the per-block view is the cheaper one
                    dst.block(d).copy_(src.block(s), non_blocking=nb)
                else:
                    dst.run(d, n).copy_(src.run(s, n), non_blocking=nb)
            return len(rr)
        # staged across the link: gather on the source side, one transfer, scatter on the destination side
        n = len(ss)
        if src_host:  # host gather by the kernel, straight into the pinned buffer the transfer reads
            staged = self.host_staging((n, *src.geometry.block_shape), src.data.dtype, "gather")
            self._hostcopy.copy_blocks(staged, "block_major", range(n), src.data, src.layout, ss)
        else:
            staged = src.gather(torch.tensor(ss, device=src.data.device))
        if dst_host:
            landing = self.host_staging(tuple(staged.shape), staged.dtype, "landing")
            landing.copy_(staged, non_blocking=nb)
            if nb:  # the host scatter below must not read it before it lands
                torch.cuda.current_stream(self.device).synchronize()
            self._hostcopy.copy_blocks(dst.data, dst.layout, ds, landing, "block_major", range(n))
        else:
            landing = staged
            if staged.device != dst.data.device:  # (hbm->hbm stages nothing across a link: scatter in place)
                landing = torch.empty_like(staged, device=dst.data.device)
                landing.copy_(staged, non_blocking=nb)
            dst.scatter(torch.tensor(ds, device=dst.data.device), landing)
        return 1

    def _to_disk(self, src: TensorPool, ss, dst: DiskPool, ds) -> int:
        if src.data.device.type == "cpu" and src.layout == "block_major" and self.mode != "staged":
            blocks = [src.data[s] for s in ss]  # already contiguous host blocks: write them in place
        else:
            buf = self.host_staging((len(ss), *src.geometry.block_shape), src.data.dtype, "to-disk")
            if src.data.device.type == "cpu":
                self._hostcopy.copy_blocks(buf, "block_major", range(len(ss)), src.data, src.layout, ss)
            else:
                buf.copy_(src.gather(torch.tensor(ss, device=src.data.device)))
            blocks = list(buf)
        return self._disk_calls(dst.write, blocks, ds)

    def _from_disk(self, src: DiskPool, ss, dst: TensorPool, ds) -> int:
        if dst.data.device.type == "cpu" and dst.layout == "block_major" and self.mode != "staged":
            return self._disk_calls(src.read, [dst.data[d] for d in ds], ss)
        buf = self.host_staging((len(ss), *src.geometry.block_shape), src.geometry.torch_dtype, "from-disk")
        calls = self._disk_calls(src.read, list(buf), ss)
        if dst.data.device.type == "cpu":
            self._hostcopy.copy_blocks(dst.data, dst.layout, ds, buf, "block_major", range(len(ds)))
        else:
            dst.scatter(torch.tensor(ds, device=dst.data.device), buf.to(dst.data.device, non_blocking=self.cuda))
        return calls

    def _disk_calls(self, call, blocks: list[torch.Tensor], disk_slots: list[int]) -> int:
        """One call per block (`block` mode) or one vectored call per run of consecutive disk slots."""
        if self.mode == "block":
            for b, slot in zip(blocks, disk_slots):
                call(slot, [b])
            return len(blocks)
        calls = 0
        i = 0
        while i < len(disk_slots):
            j = i + 1
            while j < len(disk_slots) and disk_slots[j] == disk_slots[j - 1] + 1:
                j += 1
            call(disk_slots[i], blocks[i:j])
            calls += 1
            i = j
        return calls


def _has_disk(src, dst) -> bool:
    return src.kind == "disk" or dst.kind == "disk"
