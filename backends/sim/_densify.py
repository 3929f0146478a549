"""Compiled helpers shared by every policy: id densification and next-use times (numba)."""

from __future__ import annotations

import numpy as np
from numba import njit

_EMPTY = np.int32(-1)


@njit(cache=True)
def _densify(ids, offsets):
    m = ids.size
    size = 1
    while size < 2 * m + 2:
        size *= 2
    mask = np.uint64(size - 1)
    slot_key = np.zeros(size, dtype=np.uint64)
    slot_val = np.full(size, -1, dtype=np.int32)
    keys = np.empty(m, dtype=np.int32)
    parent = np.empty(m, dtype=np.int32)  # per new key, trimmed below
    n_keys = 0
    n_req = offsets.size - 1
    for r in range(n_req):
        prev = np.int32(-1)
        for j in range(offsets[r], offsets[r + 1]):
            x = ids[j]
            # splitmix64 finaliser spreads clustered source ids (e.g. 0, 1, 2 ...) over the table
            z = x + np.uint64(0x9E3779B97F4A7C15)
            z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
            z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
            z = z ^ (z >> np.uint64(31))
            h = z & mask
            while True:
                v = slot_val[h]
                if v == -1:
                    slot_key[h] = x
                    slot_val[h] = n_keys
                    parent[n_keys] = prev
                    v = n_keys
                    n_keys += 1
                    break
                if slot_key[h] == x:
                    break
                h = (h + np.uint64(1)) & mask
            keys[j] = v
            prev = v
    return keys, parent[:n_keys].copy()


@njit(cache=True)
def _densify_small(ids, offsets, bound):
    """Same as _densify for ids that are already small integers (imported traces): a direct table."""
    table = np.full(bound, -1, dtype=np.int32)
    keys = np.empty(ids.size, dtype=np.int32)
    parent = np.empty(ids.size, dtype=np.int32)
    n_keys = 0
    for r in range(offsets.size - 1):
        prev = np.int32(-1)
        for j in range(offsets[r], offsets[r + 1]):
            v = table[ids[j]]
            if v == -1:
                v = n_keys
                table[ids[j]] = v
                parent[v] = prev
                n_keys += 1
            keys[j] = v
            prev = v
    return keys, parent[:n_keys].copy()


def densify(ids: np.ndarray, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Renumber 64-bit block ids 0..U-1 by first appearance; also each key's predecessor in its prompt."""
    ids = np.ascontiguousarray(ids, dtype=np.uint64)
    offsets = np.ascontiguousarray(offsets, dtype=np.int64)
    if ids.size and int(ids.max()) < 4 * ids.size + 1024:
        return _densify_small(ids, offsets, int(ids.max()) + 1)
    return _densify(ids, offsets)


@njit(cache=True)
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
    return _next_request_use(keys, offsets, n_keys)
