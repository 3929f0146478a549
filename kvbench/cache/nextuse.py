"""Next uses out of core: `PreparedTrace.next_use()` of a trace too large to hold, computed in passes over its
chunks with the intermediate records on disk, for the Belady bound of a streamed replay (`bound_stream`).

The next use of a block reference is the index of the next request that references the same block (after the
reference's own request; `n_requests + 1` when none). Only references to the same block decide it, so:

1. `add` (forward, chunk by chunk): one record per reference (mixed block id, global position, global
   request) is appended to one of P partition files chosen by the top bits of the mixed id. Records of a block
   thus sit in one file, in trace order.
2. `finish`, per partition: a stable sort by block id puts each block's references together, still in trace
   order; the next use of a reference is the request of the next run of that block's references with a later
   request; the last reference of a block (no next use) gets `n_requests + 1 + f` instead, where f is the
   block's first position in the trace, which orders blocks as the in-memory dense keys do (by first
   appearance) for `bound_stream`'s ties. The answers (position in its group, next use) go to G group files,
   one per range of consecutive positions, so that no pass ever writes at random over the whole trace (a
   memory map would, and its touched pages count as resident memory).
3. Per group, the answers are put in position order and appended to one flat int64 file, which `read` serves
   chunk by chunk to the forward pass.

Memory: one chunk in `add`, about 50 bytes per record of the partition being resolved, 8 bytes per position
of a group; P is chosen so that a partition holds about `partition_refs` records (more only for a block
referenced that often by itself, or past 2**_MAX_BITS partitions). Disk: `DISK_BYTES_PER_REF` per block
reference at most (records are deleted as they are consumed), in a temporary directory under `tmpdir`
(default: $TMPDIR), removed by `close`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref

import numpy as np

_MIX = np.uint64(0x9E3779B97F4A7C15)  # odd: a bijection on uint64 whose top bits are uniform even for 0, 1, 2 ...
_RECORD = np.dtype([("h", "<u8"), ("pos", "<u8"), ("r", "<u4")])  # 20 bytes
_ANSWER = np.dtype([("i", "<u4"), ("nu", "<i8")], align=False)  # position within its group, next use
_MAX_BITS = 8  # at most 256 partition files open at once (a common limit on open files is 1024)
# the records and the answers can both be on disk while a partition is resolved, then the flat file (4 bytes)
DISK_BYTES_PER_REF = _RECORD.itemsize + _ANSWER.itemsize + 8


def spill_bytes(block_references: int) -> int:
    """Scratch disk `NextUseFile` needs at most for a trace of this many block references."""
    return DISK_BYTES_PER_REF * int(block_references)


class NextUseFile:
    """Next use of every block reference of a trace given chunk by chunk (see the module docstring).

    Usage: `add(ids, offsets)` for every chunk in trace order (64-bit block ids with isolation folded in, and
    their chunk-relative request offsets), then `finish()`, then `read(start, count)` for the next uses of
    references start .. start + count - 1 (global positions), and `close()`.
    """

    def __init__(self, block_references: int, n_requests: int, tmpdir=None, partition_refs: int = 4_000_000):
        if n_requests + 1 >= 2**32 or partition_refs >= 2**32:
            raise ValueError("too many requests for 32-bit request indices")
        self.m, self.n = int(block_references), int(n_requests)
        self.partition_refs = max(int(partition_refs), 1)
        # 2**bits >= m / partition_refs, at most _MAX_BITS: a partition file stays open for the whole first pass
        self.bits = min(_MAX_BITS, (max(1, -(-self.m // self.partition_refs)) - 1).bit_length())
        self.dir = tempfile.mkdtemp(prefix="kvbench-nextuse-", dir=tmpdir)
        self._cleanup = weakref.finalize(self, shutil.rmtree, self.dir, ignore_errors=True)
        self._parts: list = [None] * (1 << self.bits)  # opened on first write
        self.unique = 0  # distinct blocks, known after `finish`
        self._pos = 0  # references added so far
        self._rows = 0  # requests added so far
        self._flat = os.path.join(self.dir, "next_use.i8")
        self._reader = None

    def __enter__(self) -> NextUseFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for f in [*self._parts, self._reader]:
            if f is not None:
                f.close()
        self._parts, self._reader = [None] * len(self._parts), None
        self._cleanup()

    def _path(self, kind: str, i: int) -> str:
        return os.path.join(self.dir, f"{kind}-{i}")

    @property
    def added(self) -> int:
        """Block references added so far."""
        return self._pos

    def add(self, ids: np.ndarray, offsets: np.ndarray) -> None:
        """The next chunk: ids (uint64[k], block references in prompt order) of requests offsets[i]..offsets[i+1]."""
        ids = np.asarray(ids, np.uint64)
        n_rows = offsets.size - 1
        h = ids * _MIX  # wraps modulo 2**64 by design
        r = np.repeat(np.arange(self._rows, self._rows + n_rows, dtype=np.uint32), np.diff(offsets))
        if self.bits == 0:
            order = np.arange(ids.size)
            bounds = np.array([0, ids.size])
        else:
            part = (h >> np.uint64(64 - self.bits)).astype(np.uint8)
            # stable (a radix sort on uint8) keeps trace order within each partition, which `_resolve` relies on
            order = np.argsort(part, kind="stable")
            bounds = np.concatenate(([0], np.cumsum(np.bincount(part, minlength=len(self._parts)))))
        # columns gathered one by one: numpy takes a structured array's rows element by element, 10x slower
        rec = np.empty(ids.size, _RECORD)
        rec["h"], rec["pos"], rec["r"] = h[order], order + np.uint64(self._pos), r[order]
        self._pos += ids.size
        self._rows += n_rows
        for p in np.flatnonzero(np.diff(bounds)):
            self._write(self._parts, p, "part", rec[bounds[p] : bounds[p + 1]])

    def _write(self, files: list, i: int, kind: str, rec: np.ndarray) -> None:
        if files[i] is None:
            files[i] = open(self._path(kind, i), "wb")
        files[i].write(rec.tobytes())

    def _append(self, i: int, rec: np.ndarray) -> None:
        # opened per write: there are as many answer files as groups, which may be more than one may hold open
        with open(self._path("answer", i), "ab") as f:
            f.write(rec.tobytes())

    def finish(self) -> None:
        """Resolve every partition into the flat file of next uses (int64, in trace order)."""
        if self._pos != self.m or self._rows != self.n:
            raise RuntimeError(f"added {self._pos} references of {self._rows} requests, sized for {self.m} of {self.n}")
        for f in self._parts:
            if f is not None:
                f.close()
        group = self.partition_refs
        answers = np.zeros(max(1, -(-self.m // group)), np.bool_)  # groups with an answer file
        for p in range(len(self._parts)):
            if self._parts[p] is not None:
                self._resolve(self._path("part", p), answers, group)
        self._parts = [None] * len(self._parts)
        with open(self._flat, "wb") as out:
            for g in range(len(answers)):
                size = min(group, self.m - g * group)
                if size <= 0:
                    break
                nu = np.empty(size, np.int64)
                filled = 0
                if answers[g]:
                    ans = np.fromfile(self._path("answer", g), _ANSWER)
                    os.remove(self._path("answer", g))
                    nu[ans["i"]] = ans["nu"]
                    filled = ans.size
                if filled != size:
                    raise RuntimeError(f"next uses: group {g} has {filled} answers for {size} references")
                out.write(nu.tobytes())
        self._reader = open(self._flat, "rb")

    def _resolve(self, path: str, answers: np.ndarray, group: int) -> None:
        rec = np.fromfile(path, _RECORD)
        os.remove(path)
        pos = np.ascontiguousarray(rec["pos"])  # ascending: records arrive in trace order
        order = np.argsort(rec["h"], kind="stable")  # each block's references together, still in trace order
        h, r = rec["h"][order], rec["r"][order]
        del rec
        # runs of references of one block by one request: they share the next run's request as next use
        new_run = np.ones(h.size, np.bool_)
        new_run[1:] = (h[1:] != h[:-1]) | (r[1:] != r[:-1])
        starts = np.flatnonzero(new_run)
        first = np.ones(starts.size, np.bool_)  # the block's first run
        first[1:] = h[starts[1:]] != h[starts[:-1]]
        run_first = pos[order[starts[first]]][np.cumsum(first) - 1].astype(np.int64)  # the block's first position
        run_nu = self.n + 1 + run_first  # no next use, until the next run of the block says otherwise
        self.unique += int(np.count_nonzero(first))
        later = ~first[1:]
        run_nu[:-1][later] = r[starts[1:]][later]
        del h, r
        nu = np.empty(pos.size, np.int64)
        nu[order] = np.repeat(run_nu, np.diff(np.append(starts, order.size)))  # back in trace order
        # so each group's answers are one slice
        cuts = np.searchsorted(pos, np.arange(answers.size + 1, dtype=np.uint64) * np.uint64(group))
        for g in np.flatnonzero(np.diff(cuts)):
            part = slice(cuts[g], cuts[g + 1])
            ans = np.empty(cuts[g + 1] - cuts[g], _ANSWER)
            ans["i"], ans["nu"] = pos[part] - np.uint64(g * group), nu[part]
            self._append(g, ans)
            answers[g] = True

    def read(self, start: int, count: int) -> np.ndarray:
        """int64[count]: next uses of the references at global positions start .. start + count - 1 (above
        n_requests: none, see the module docstring)."""
        self._reader.seek(8 * int(start))
        out = np.fromfile(self._reader, np.int64, count=int(count))
        if out.size != count:
            raise RuntimeError(f"next uses: asked for {count} from {start}, {self.m} in all")
        return out
