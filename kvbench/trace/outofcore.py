"""Out-of-core infinite-cache hit counting: the exact result of `stats.infinite_cache_hits` in bounded memory.

`stats.infinite_cache_hits` sorts every block reference of the trace at once, which on a 10M-request trace
(~600M references) needs well over 10 GB. `InfiniteCacheStream` reads the trace batch by batch instead and
spills a compact record per reference to partition files on disk, split by block hash, so that each partition
can be resolved on its own: whether a reference was seen before only depends on the other references to the
same hash, which all land in the same partition.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref

import numpy as np
import pyarrow as pa

# Hashes are stored multiplied by this odd constant (Fibonacci hashing). Multiplying by an odd number is a
# bijection on uint64, so equality and distinct counts are unchanged, while the top bits become uniform even
# for small sequential ids (Mooncake uses 0, 1, 2, ...), which would otherwise all share one partition.
_MIX = np.uint64(0x9E3779B97F4A7C15)
_BITS = 6  # 64 partitions per level: few enough open files, enough to keep partitions small
_FANOUT = 1 << _BITS
# One spilled record: mixed hash, global row, position of the block in the row's prompt.
_ENTRY = np.dtype([("h", "<u8"), ("r", "<u4"), ("p", "<u4")])
_MAX_ROWS = np.iinfo(np.uint32).max


class GrowingArray:
    """A 1-d array appended to chunk by chunk, kept in one buffer that doubles when full.

    Why not a list of per-chunk arrays: a trace's worth of small long-lived arrays fragments the C heap
    (once a large block has been freed, glibc serves allocations up to 32 MB from the heap, and pages
    between long-lived arrays never return to the system): measured 36 bytes a request of extra RSS while
    validating a 20M-request trace. A few large buffers are mapped and unmapped whole."""

    def __init__(self, dtype, capacity: int = 1 << 16):
        self._buf = np.empty(capacity, dtype=dtype)
        self.size = 0

    def extend(self, values) -> None:
        values = np.asarray(values, dtype=self._buf.dtype)
        end = self.size + values.size
        if end > self._buf.size:
            grown = np.empty(max(end, 2 * self._buf.size), dtype=self._buf.dtype)
            grown[: self.size] = self._buf[: self.size]
            self._buf = grown
        self._buf[self.size : end] = values
        self.size = end

    @property
    def values(self) -> np.ndarray:
        """The elements so far (a view: valid until the next `extend`)."""
        return self._buf[: self.size]


def _first_occurrence(values: np.ndarray) -> np.ndarray:
    """Boolean mask of the first occurrence of each value, in array order.

    A hash-based pass (polars) rather than a stable argsort: about 3x faster on a 3M-reference batch.
    """
    import polars as pl  # loaded on use, as in stats.py: the CLI starts faster without it

    return pl.Series(values, dtype=pl.UInt64).is_first_distinct().to_numpy()


class InfiniteCacheStream:
    """Hit blocks per request with an unbounded cache under the prefix rule, computed out of core.

    Usage::

        with InfiniteCacheStream() as s:
            for batch in iter_batches(path, columns=["block_hashes"]):
                s.add(batch.column("block_hashes"))
            hits, unique_blocks = s.finish()

    Rows are numbered globally in the order `add` sees them. The result equals
    `stats.infinite_cache_hits` on the concatenated column, for any split into batches.

    How: within a batch, only the first occurrence of each hash can be a miss (a later one in the same batch
    is preceded by an earlier row, or sits in the same row as the first and shares its fate), so `add` spills
    one record per distinct hash per batch. Records of one hash therefore sit in their partition file in
    ascending row order, and at `finish` the first record of each hash in a partition is the one not seen
    before; every other reference to it was a hit-eligible repeat. A row's hits are the lowest position among
    its not-seen records, or all its blocks if there are none.

    Memory: the per-row arrays (n_blocks and hits, 8 bytes a row with `finish(np.int32)`), plus
    O(references of one batch) in `add`, plus about 40 bytes per record of the partition being resolved in
    `finish`. A partition with more than `partition_refs` records is first split 64 ways on further hash
    bits, streaming, so the last term stays at most ~40 x `partition_refs` bytes (~320 MB by default). The only
    partition that cannot be split is one hash alone, whose records number at most the count of `add` calls.
    Disk: 16 bytes per record, in a temporary directory under `tmpdir` (default: the system's) that is
    removed on exit, exceptions included.
    """

    def __init__(self, tmpdir: str | os.PathLike | None = None, partition_refs: int = 8_000_000):
        if partition_refs < 1:
            raise ValueError("partition_refs must be >= 1")
        self.partition_refs = partition_refs
        self.n_blocks: np.ndarray | None = None  # blocks per row, set by finish()
        self._dir = tempfile.mkdtemp(prefix="kvbench-ooc-", dir=tmpdir)
        # Removes the directory even if the object is dropped without close() (and at interpreter exit).
        self._cleanup = weakref.finalize(self, shutil.rmtree, self._dir, ignore_errors=True)
        self._files: list = [None] * _FANOUT  # opened on first write: small streams touch few partitions
        self._n_blocks = GrowingArray(np.int32)
        self._rows = 0
        self._done = False

    def __enter__(self) -> InfiniteCacheStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Close the partition files and remove the temporary directory (idempotent)."""
        self._close_files(self._files)
        self._cleanup()

    @staticmethod
    def _close_files(files: list) -> None:
        for f in files:
            if f is not None:
                f.close()

    def _path(self, key: tuple[int, ...]) -> str:
        return os.path.join(self._dir, "part-" + "-".join(map(str, key)))

    def add(self, block_hashes: pa.ListArray | pa.ChunkedArray) -> None:
        """Append the next rows (list<uint64> of prefix-chained block ids) in trace order."""
        if self._done:
            raise RuntimeError("add() after finish()")
        chunks = block_hashes.chunks if isinstance(block_hashes, pa.ChunkedArray) else [block_hashes]
        for chunk in chunks:
            self._add_chunk(chunk)

    def _add_chunk(self, arr: pa.ListArray) -> None:
        offsets = np.asarray(arr.offsets, dtype=np.int64)
        offsets = offsets - offsets[0]  # a sliced array's offsets start past zero
        n_blocks = np.diff(offsets)
        if self._rows + n_blocks.size > _MAX_ROWS:
            raise ValueError(f"more than {_MAX_ROWS} rows: rows are stored as uint32")
        base, self._rows = self._rows, self._rows + n_blocks.size
        self._n_blocks.extend(n_blocks)  # (list offsets are int32: no row has more)
        flat = np.asarray(arr.flatten(), dtype=np.uint64)
        if not flat.size:
            return
        idx = np.flatnonzero(_first_occurrence(flat))  # flat order is row-major: first = lowest (row, position)
        row = np.searchsorted(offsets, idx, side="right") - 1  # searchsorted on the few spilled refs only
        rec = np.empty(idx.size, dtype=_ENTRY)
        rec["h"] = flat[idx] * _MIX  # wraps modulo 2**64 by design
        rec["r"] = base + row
        rec["p"] = idx - offsets[row]
        self._spill(rec, self._files, ())

    def _spill(self, rec: np.ndarray, files: list, parent: tuple[int, ...]) -> None:
        """Append records to the children of partition `parent` (`()`: the top level), on the next hash bits."""
        shift = np.uint64(64 - _BITS * (len(parent) + 1))
        part = ((rec["h"] >> shift) & np.uint64(_FANOUT - 1)).astype(np.uint8)
        order = np.argsort(part, kind="stable")  # stable (a radix sort on uint8): keeps each hash's row order
        bounds = np.concatenate(([0], np.cumsum(np.bincount(part, minlength=_FANOUT))))
        rec = rec[order]
        for p in range(_FANOUT):
            if bounds[p + 1] > bounds[p]:
                if files[p] is None:
                    files[p] = open(self._path((*parent, p)), "wb")
                files[p].write(rec[bounds[p] : bounds[p + 1]].tobytes())

    def finish(self, dtype=np.int64) -> tuple[np.ndarray, int]:
        """Hit blocks per row (of `dtype`: int32 halves the memory, in `add` order) and the number of
        distinct block ids.

        Also sets `self.n_blocks` (blocks per row, int32) and removes the temporary directory.
        """
        if self._done:
            raise RuntimeError("finish() called twice")
        self._done = True
        self._close_files(self._files)
        self.n_blocks, self._n_blocks = self._n_blocks.values, None
        hits = self.n_blocks.astype(dtype)  # a row with no not-seen block hits on all of them
        unique = 0
        # Depth-first over (partition key, may split); a partition is deleted as soon as it is consumed,
        # so the disk footprint never grows beyond the spilled records.
        stack = [((p,), True) for p in reversed(range(_FANOUT)) if self._files[p] is not None]
        while stack:
            key, splittable = stack.pop()
            path = self._path(key)
            count = os.path.getsize(path) // _ENTRY.itemsize
            if splittable and count > self.partition_refs and _BITS * (len(key) + 1) <= 64:
                # A child holding every record (one hash alone, in practice) would not shrink by splitting again.
                stack.extend((child, n < count) for child, n in reversed(self._split(path, key)))
            else:
                unique += self._resolve(path, hits)
        self.close()
        return hits, unique

    def _split(self, path: str, key: tuple[int, ...]) -> list[tuple[tuple[int, ...], int]]:
        """Stream one partition into 64 children on the next hash bits; returns (child key, records)."""
        files: list = [None] * _FANOUT
        try:
            with open(path, "rb") as src:
                while (rec := np.fromfile(src, dtype=_ENTRY, count=self.partition_refs)).size:
                    self._spill(rec, files, key)
        finally:
            self._close_files(files)
        os.remove(path)
        children = [(*key, p) for p in range(_FANOUT) if files[p] is not None]
        return [(k, os.path.getsize(self._path(k)) // _ENTRY.itemsize) for k in children]

    @staticmethod
    def _resolve(path: str, hits: np.ndarray) -> int:
        """Lower `hits` by the partition's not-seen records; returns its number of distinct hashes."""
        rec = np.fromfile(path, dtype=_ENTRY)
        os.remove(path)
        # Records of one hash are in ascending row order (batches are appended in call order, one record per
        # hash per batch, and splits keep order), so its first record is its earliest row: not seen before.
        first = _first_occurrence(rec["h"])
        np.minimum.at(hits, rec["r"][first].astype(np.intp), rec["p"][first].astype(hits.dtype))
        return int(np.count_nonzero(first))
