"""Where KV blocks live: one allocation per tier, made once at the start of a run.

- `TensorPool`: the device pool (HBM on CUDA; plain memory on CPU) in the geometry's layout, or host DRAM,
  always block-major there so that a block is one contiguous chunk to send on to disk.
- `DiskPool`: a file on local disk, block i at byte offset i × block_bytes, read and written with vectored
  `preadv`/`pwritev` straight from and into host tensors.

Host pools on a CUDA machine are pinned so that copies are true DMA. PyTorch's pinned allocator rounds every
request up to a power of two (a 40 GiB DRAM tier would take 64 GiB of locked memory), so large host pools are
allocated as ordinary memory and page-locked in place with cudaHostRegister instead.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from kvbench.backends.torchkv.geometry import KvGeometry, block_dim

from kvbench.errors import KvbenchError

IOV_MAX = 1024  # buffers per preadv/pwritev call (Linux)
CALL_BYTES = 1 << 30  # bytes per call: Linux moves at most 0x7ffff000 bytes in one


def _skip(views: list[memoryview], n: int) -> list[memoryview]:
    """The buffers after their first n bytes."""
    out = []
    for v in views:
        if n >= len(v):
            n -= len(v)
            continue
        out.append(v[n:])
        n = 0
    return out


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def pinned_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Page-locked host memory of exactly the size asked for (no power-of-two rounding)."""
    t = torch.empty(shape, dtype=dtype)
    if t.numel():
        err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
        if int(err) != 0:
            raise KvbenchError(
                f"could not page-lock {t.numel() * t.element_size() / 2**30:.1f} GiB of host memory (CUDA error "
                f"{int(err)}); lower --dram-capacity or raise the locked-memory limit (ulimit -l)"
            )
    return t


def unpin(t: torch.Tensor) -> None:
    if t.numel():
        torch.cuda.cudart().cudaHostUnregister(t.data_ptr())


def checksums(blocks: torch.Tensor) -> torch.Tensor:
    """int64 per block (axis 0): a position-weighted sum of the block's bytes read as int32 words, so that a
    flipped, lost or moved word changes it. Computed where the blocks are (no copy to the host)."""
    words = blocks.contiguous().view(torch.uint8).view(blocks.shape[0], -1).view(torch.int32).to(torch.int64)
    weights = torch.arange(1, words.shape[1] + 1, device=blocks.device, dtype=torch.int64) % 65521 + 1
    return (words * weights).sum(dim=1)


class TensorPool:
    kind = "tensor"

    def __init__(self, name: str, geometry: KvGeometry, blocks: int, device: torch.device, layout: str, pin=False):
        self.name, self.geometry, self.blocks, self.device, self.layout = name, geometry, blocks, device, layout
        shape = geometry.pool_shape(blocks, layout)
        try:
            self.data = (
                pinned_empty(shape, geometry.torch_dtype)
                if pin
                else torch.empty(shape, dtype=geometry.torch_dtype, device=device)
            )
        except (torch.OutOfMemoryError, RuntimeError):  # the CPU allocator raises a plain RuntimeError
            raise KvbenchError(
                f"{name}: {blocks:,} blocks × {geometry.block_bytes:,} B do not fit on {device}; lower the capacity"
            ) from None
        self.pinned = pin
        self.dim = block_dim(layout)
        # moves copy bits, whatever they mean: an integer view of the same width works for every KV dtype
        # (index_copy_ has no fp8 kernels, for one)
        self.bits = self.data.view(_BITS[self.data.element_size()])

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def run(self, first: int, count: int) -> torch.Tensor:
        """`count` consecutive blocks from slot `first`, as a `[count, *block_shape]` view (strided in the
        layer-first layout), so that pools of either layout copy into each other."""
        return self.bits.narrow(self.dim, first, count).movedim(self.dim, 0)

    def block(self, slot: int) -> torch.Tensor:
        """The block at `slot` as a `block_shape` view: one `select`, the cheapest view there is (a per-block
        copy of a small block costs about as much in view-making as in bytes moved)."""
        return self.bits.select(self.dim, slot)

    def gather(self, slots: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Blocks at `slots` (int64 on this pool's device), as `[n, *block_shape]` contiguous; into `out` (of the
        pool's bits dtype) when given, in the block-major layout: a reused buffer spares the page faults of a
        fresh one, which on a CPU made the gather 10 times slower than the bytes it moves."""
        blocks_first = self.bits.movedim(self.dim, 0)  # a view: index_select reads the layer-first layout in place
        return (
            blocks_first.index_select(0, slots) if out is None else torch.index_select(blocks_first, 0, slots, out=out)
        )

    def scatter(self, slots: torch.Tensor, blocks: torch.Tensor) -> None:
        """Write `[n, *block_shape]` blocks (as `gather` returns them, or of the pool's dtype) into `slots`."""
        self.bits.movedim(self.dim, 0).index_copy_(0, slots, blocks.view(self.bits.dtype))

    def close(self) -> None:
        if self.pinned:
            unpin(self.data)
            self.pinned = False


class DiskPool:
    kind = "disk"

    def __init__(self, name: str, geometry: KvGeometry, blocks: int, directory: Path, sync: bool = False):
        self.name, self.geometry, self.blocks, self.sync = name, geometry, blocks, sync
        self.block_bytes = geometry.block_bytes
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / f"kvbench-{name}-{os.getpid()}.kv"
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.posix_fallocate(self.fd, 0, blocks * self.block_bytes)
        except OSError as e:
            self.close()
            raise KvbenchError(
                f"{directory}: cannot reserve {blocks * self.block_bytes / 2**30:.2f} GiB for the disk tier "
                f"({e.strerror}); lower --ssd-capacity or pick another --disk-dir"
            ) from None

    @property
    def nbytes(self) -> int:
        return self.blocks * self.block_bytes

    def write(self, first: int, blocks: list[torch.Tensor]) -> None:
        """Write contiguous host blocks to consecutive slots from `first`, in as few vectored calls as the kernel
        takes (at most IOV_MAX buffers and about 2 GiB per call)."""
        offset = first * self.block_bytes
        self._vectored(os.pwritev, blocks, offset, "write")
        if self.sync:  # write through the page cache and drop it, so later reads come from the drive
            os.fdatasync(self.fd)
            os.posix_fadvise(self.fd, offset, len(blocks) * self.block_bytes, os.POSIX_FADV_DONTNEED)

    def read(self, first: int, blocks: list[torch.Tensor]) -> None:
        """Read consecutive slots from `first` into contiguous host blocks."""
        self._vectored(os.preadv, blocks, first * self.block_bytes, "read")

    def _vectored(self, call, blocks: list[torch.Tensor], offset: int, what: str) -> None:
        views = [memoryview(b.view(torch.uint8).numpy()).cast("B") for b in blocks]
        per_call = max(1, min(IOV_MAX, CALL_BYTES // self.block_bytes))
        for i in range(0, len(views), per_call):
            batch = views[i : i + per_call]
            want = len(batch) * self.block_bytes
            done = call(self.fd, batch, offset)
            while 0 < done < want:  # a partial transfer: go on from where it stopped
                rest = _skip(batch, done)
                more = call(self.fd, rest, offset + done)
                if more <= 0:
                    break
                done += more
            if done != want:
                raise KvbenchError(f"{self.path}: short {what} ({done} of {want} bytes at offset {offset})")
            offset += want

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
            self.path.unlink(missing_ok=True)
