"""Compiled helpers shared by every policy: id densification, next-use times (numba), reusable work buffers."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np

from kvbench.cache.compiled import i8, kernel_fn

_EMPTY = np.int32(-1)

# Work buffers kept between calls (per thread): a fresh multi-MB array costs a page fault per 4 KiB page on
# first touch, which is as slow as the simulation itself on a trace of a few hundred thousand blocks.
# Buffers larger than this are allocated per call and not kept.
SCRATCH_KEEP_BYTES = 64 << 20
_scratch = threading.local()


def _pool() -> dict:
    return _scratch.__dict__.setdefault("pool", {})


def keep(name: str, buf: np.ndarray) -> None:
    """Keep `buf` as the work buffer `name` (e.g. one a kernel had to grow), unless it is too large."""
    if buf.nbytes <= SCRATCH_KEEP_BYTES:
        _pool()[name] = buf


def scratch(name: str, size: int, dtype) -> np.ndarray:
    """A work array of `size` elements, contents undefined, reused by later calls asking for the same `name`.
    The caller owns it until its next call with that name (do not return it, or a view of it, to users)."""
    dtype = np.dtype(dtype)
    buf = _pool().get(name)
    if buf is None or buf.dtype != dtype or buf.size < size:
        buf = np.empty(max(size, 1), dtype)
        keep(name, buf)
    return buf[:size]


@kernel_fn()
def mix64(x):
    # splitmix64 finaliser spreads clustered source ids (e.g. 0, 1, 2 ...) over the table
    z = x + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


@kernel_fn()
def _rehash(slots, size, uniq, n_keys):
    """Empty the first `size` slots (a power of two) of the table, growing it if needed, and put back the keys
    numbered so far (slot -> dense key; the 64-bit id of dense key v is uniq[v])."""
    if slots.size < size:
        slots = np.empty(size, np.int32)
    slots[:size] = -1
    mask = np.uint64(size - 1)
    for v in range(n_keys):
        h = mix64(uniq[v]) & mask
        while slots[h] != -1:
            h = (h + np.uint64(1)) & mask
        slots[h] = v
    return slots


@kernel_fn("Tuple((i4[::1], i4[::1], i8, i8))(u8[::1], i8[::1], i4[::1], i8, u8[::1], i4[::1], i8)")
def _densify(ids, offsets, slots, size, uniq, parent, n_keys):
    """Open addressing, linear probing, continuing a numbering of which `n_keys` ids are done (`Numbering`).
    The table (`size` slots of the reusable buffer `slots`, a power of two) grows with the number of unique
    keys (load <= 1/2, checked before each request so that the inner loop never rehashes). `uniq` (id of each
    key) and `parent` must have room for every id of this call. Returns the keys of `ids`, the table (maybe
    a larger buffer), its size and the new number of keys."""
    keys = np.empty(ids.size, dtype=np.int32)
    for r in range(offsets.size - 1):
        lo, hi = offsets[r], offsets[r + 1]
        if 2 * (n_keys + hi - lo) > size:
            while 2 * (n_keys + hi - lo) > size:
                size *= 2
            slots = _rehash(slots, size, uniq, n_keys)
        mask = np.uint64(size - 1)
        prev = np.int32(-1)
        for j in range(lo, hi):
            x = ids[j]
            h = mix64(x) & mask
            while True:
                v = slots[h]
                if v == -1:
                    v = np.int32(n_keys)
                    slots[h] = v
                    uniq[v] = x
                    parent[v] = prev
                    n_keys += 1
                    break
                if uniq[v] == x:
                    break
                h = (h + np.uint64(1)) & mask
            keys[j] = v
            prev = v
    return keys, slots, size, n_keys


class Numbering:
    """64-bit block ids numbered 0..U-1 by first appearance, given a chunk at a time (a trace read by row
    group): the ids need not be copied into one array first (8 bytes a reference). Memory: the table (8 bytes
    a key at the most) and each key's id and parent (12), only as many as there are keys."""

    def __init__(self, expected_keys: int = 0):
        # The table starts at up to 2**19 slots (2 MiB, cache-resident): traces of up to ~250k unique blocks
        # never rehash. `uniq` and `parent` are np.empty: pages past n_keys are never touched, so never resident.
        self.size = 1024
        while self.size < expected_keys and self.size < (1 << 19):
            self.size *= 2
        self.n_keys = 0
        self._uniq = np.empty(0, np.uint64)
        self._parent = np.empty(0, np.int32)
        slots = _pool().pop("densify.slots", None)  # one Numbering at a time uses the kept buffer
        if slots is None or slots.size < self.size:
            slots = np.empty(self.size, np.int32)
        slots[: self.size] = -1
        self._slots = slots

    def add(self, ids: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        """int32 keys of `ids` (uint64), whose requests start at `offsets` (int64, from 0 to ids.size)."""
        ids = np.ascontiguousarray(ids, dtype=np.uint64)
        need = self.n_keys + ids.size
        if self._uniq.size < need:  # room for every id of the chunk, grown geometrically
            room = max(need, 2 * self._uniq.size)
            self._uniq = _grown(self._uniq, room, self.n_keys)
            self._parent = _grown(self._parent, room, self.n_keys)
        keys, self._slots, self.size, self.n_keys = _densify(
            ids, i8(offsets), self._slots, self.size, self._uniq, self._parent, self.n_keys
        )
        return keys

    def parent(self) -> np.ndarray:
        """int32[U]: each key's predecessor in the prompt it first appeared in, -1 for a first block."""
        return self._parent[: self.n_keys].copy()

    def close(self) -> None:
        """Give the table back for the next numbering (a fresh one costs a page fault per 4 KiB)."""
        keep("densify.slots", self._slots)
        self._slots = self._uniq = self._parent = None


def _grown(a: np.ndarray, room: int, used: int) -> np.ndarray:
    out = np.empty(room, a.dtype)
    out[:used] = a[:used]
    return out


@kernel_fn("Tuple((i4[::1], i4[::1], b1))(u8[::1], i8[::1], i8)")
def _densify_ordered(ids, offsets, bound):
    """Ids that are already numbered by first appearance (each new id one above the largest so far, as in
    imported traces such as Mooncake's) are their own dense keys: no table. Returns ok=False once a request
    holds an id that breaks the rule (the caller then uses the general path). Without a branch on whether an
    id is new (on Mooncake two ids in three are, in no pattern a predictor learns): an id that is not new
    writes its parent to a spare slot at `bound`."""
    keys = np.empty(ids.size, dtype=np.int32)
    parent = np.empty(bound + 1, dtype=np.int32)
    largest = np.int64(-1)
    bad = False
    for r in range(offsets.size - 1):
        prev = np.int32(-1)
        for j in range(np.uint64(offsets[r]), np.uint64(offsets[r + 1])):
            x = np.int64(ids[j])  # < 2**63: the caller checked the ids are small
            bad |= x > largest + 1
            parent[x if x > largest else bound] = prev
            largest = max(largest, x)
            v = np.int32(x)
            keys[j] = v
            prev = v
        if bad:
            return keys, parent[:bound], False
    return keys, parent[:bound], largest + 1 == bound


@kernel_fn("Tuple((i4[::1], i4[::1]))(u8[::1], i8[::1], i4[::1])")
def _densify_small(ids, offsets, table):
    """Same as _densify for ids that are already small integers (imported traces): a direct table."""
    table[:] = -1
    keys = np.empty(ids.size, dtype=np.int32)
    parent = np.empty(min(ids.size, table.size), dtype=np.int32)
    n_keys = 0
    for r in range(offsets.size - 1):
        prev = np.int32(-1)
        for j in range(offsets[r], offsets[r + 1]):
            x = ids[j]
            v = table[x]
            if v == -1:
                v = np.int32(n_keys)
                table[x] = v
                parent[v] = prev
                n_keys += 1
            keys[j] = v
            prev = v
    return keys, parent[:n_keys].copy()


def densify(ids: np.ndarray, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Renumber 64-bit block ids 0..U-1 by first appearance; also each key's predecessor in its prompt."""
    ids = np.ascontiguousarray(ids, dtype=np.uint64)
    offsets = np.ascontiguousarray(offsets, dtype=np.int64)
    top = int(ids.max()) if ids.size else -1
    if 0 <= top < 4 * ids.size + 1024:
        keys, parent, ok = _densify_ordered(ids, offsets, int(top + 1))
        if ok:
            return keys, parent
        return _densify_small(ids, offsets, scratch("densify.table", top + 1, np.int32))
    numbering = Numbering(ids.size)
    keys = numbering.add(ids, offsets)
    parent = numbering.parent()
    numbering.close()
    return keys, parent


@kernel_fn("i4[::1](i4[::1], i8[::1], i8)")
def _next_request_use(keys, offsets, n_keys):
    n_req = offsets.size - 1
    never = np.int32(n_req + 1)
    last = np.full(n_keys, never, dtype=np.int32)
    out = np.empty(keys.size, dtype=np.int32)
    for r in range(n_req - 1, -1, -1):
        for j in range(offsets[r], offsets[r + 1]):
            out[j] = last[keys[j]]
        for j in range(offsets[r], offsets[r + 1]):
            last[keys[j]] = r
    return out


def next_request_use(keys: np.ndarray, offsets: np.ndarray, n_keys: int) -> np.ndarray:
    return _next_request_use(np.ascontiguousarray(keys, dtype=np.int32), i8(offsets), int(n_keys))


def numbered_chunks(chunks) -> Iterator[np.ndarray]:
    """The ids of each list array in `chunks` numbered by first appearance across them (int32), with the
    compiled table: `trace.stats.infinite_cache_hits`' numbering at ~20 bytes a distinct id instead of Arrow's
    ~80, and no more than one chunk's keys at a time. One chunk takes `densify`'s faster paths for ids that
    are already small (imported traces)."""
    flats = [flat_ids(chunk) for chunk in chunks]
    if len(flats) == 1:
        yield densify(*flats[0])[0]
        return
    numbering = Numbering(sum(ids.size for ids, _ in flats))
    try:
        for ids, offsets in flats:
            yield numbering.add(ids, offsets)
    finally:
        numbering.close()


def flat_ids(chunk) -> tuple[np.ndarray, np.ndarray]:
    """(ids, offsets from 0) of a list array without nulls: views of its buffers."""
    offsets = np.asarray(chunk.offsets, dtype=np.int64)
    start, stop = int(offsets[0]), int(offsets[-1])
    ids = np.asarray(chunk.values.slice(start, stop - start)) if stop > start else np.empty(0, np.uint64)
    return ids, offsets - start
