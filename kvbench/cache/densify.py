"""Compiled helpers shared by every policy: id densification, next-use times (numba), reusable work buffers."""

from __future__ import annotations

import threading

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


@kernel_fn("Tuple((i4[::1], i4[::1], i4[::1]))(u8[::1], i8[::1], i4[::1])")
def _densify(ids, offsets, slots):
    """Open addressing, linear probing. The table grows with the number of unique keys (load <= 1/2, checked
    before each request so that the inner loop never rehashes). It starts at m slots up to 2**19 (2 MiB,
    cache-resident), so that traces of up to ~250k unique blocks never rehash. `slots` is a reusable buffer,
    returned (maybe replaced by a larger one) for the next call."""
    m = ids.size
    size = 1024
    while size < m and size < (1 << 19):
        size *= 2
    uniq = np.empty(m, dtype=np.uint64)  # only the first n_keys entries are ever touched
    keys = np.empty(m, dtype=np.int32)
    parent = np.empty(m, dtype=np.int32)  # per new key, trimmed below
    slots = _rehash(slots, size, uniq, 0)
    n_keys = 0
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
    return keys, parent[:n_keys].copy(), slots


@kernel_fn("Tuple((i4[::1], i4[::1], b1))(u8[::1], i8[::1], i8)")
def _densify_ordered(ids, offsets, bound):
    """Ids that are already numbered by first appearance (each new id one above the largest so far, as in
    imported traces such as Mooncake's) are their own dense keys: no table. Returns ok=False as soon as an id
    breaks the rule (the caller then uses the general path)."""
    keys = np.empty(ids.size, dtype=np.int32)
    parent = np.empty(bound, dtype=np.int32)
    n_keys = 0
    for r in range(offsets.size - 1):
        prev = np.int32(-1)
        for j in range(offsets[r], offsets[r + 1]):
            x = np.int64(ids[j])  # < 2**63: the caller checked the ids are small
            if x >= n_keys:
                if x != n_keys:
                    return keys, parent, False
                parent[n_keys] = prev
                n_keys += 1
            v = np.int32(x)
            keys[j] = v
            prev = v
    return keys, parent, n_keys == bound


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
    slots = _pool().get("densify.slots")
    keys, parent, slots = _densify(ids, offsets, slots if slots is not None else np.empty(0, np.int32))
    keep("densify.slots", slots)
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
