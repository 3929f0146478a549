"""Bounded-memory replay: a trace streamed by row groups through a policy's `Carry`.

The in-memory path numbers every distinct block 0..U-1 up front, which takes memory in proportion to the
trace. Here a block gets an id only while the policy caches it: ids come from a free list, a hash table maps
block ids (64-bit) to them, and after each chunk the ids of blocks the policy no longer caches go back to the
free list. The id space is therefore capacity + the largest chunk's block references, whatever the length of
the trace. The per-request columns come with each chunk too, and the answers leave with it (the runner writes
them and sums its metrics), so nothing grows with the length of the trace.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from kvbench.cache.compiled import kernel_fn
from kvbench.cache.densify import mix64
from kvbench.cache.policies import FILLED_AT, Carry, SimOutput
from kvbench.cache.prepared import PreparedTrace, fold_isolation, prepare_requests

_FREE = 0  # counters[_FREE]: number of ids on the free stack


@kernel_fn("i4[::1](u8[::1], i4[::1], u8[::1], i4[::1], b1[::1], i8[:])")
def _assign_ids(hashes, slots, block_of, free, in_use, counters):
    """Id of each block reference: the id its block already has, or one popped from the free stack.
    `slots` is an open-addressing table (linear probing, power-of-two size >= 2 x ids) of ids; `block_of`
    maps an id back to its 64-bit block id."""
    mask = np.uint64(slots.size - 1)
    out = np.empty(hashes.size, np.int32)
    n_free = counters[_FREE]
    for j in range(hashes.size):
        x = hashes[j]
        h = mix64(x) & mask
        while True:
            v = slots[h]
            if v == -1:
                n_free -= 1
                v = free[n_free]
                slots[h] = v
                block_of[v] = x
                in_use[v] = True
                break
            if block_of[v] == x:
                break
            h = (h + np.uint64(1)) & mask
        out[j] = v
    counters[_FREE] = n_free
    return out


@kernel_fn("void(i4[::1], u8[::1], i4[::1], b1[::1], b1[::1], i8[:])")
def _release(slots, block_of, free, in_use, cached, counters):
    """Give back the ids of blocks that are no longer cached and rebuild the table from the rest (rebuilding
    is one pass over the table; deleting from a linear-probing table one key at a time is not simpler)."""
    mask = np.uint64(slots.size - 1)
    slots[:] = -1
    n_free = counters[_FREE]
    for v in range(in_use.size):
        if not in_use[v]:
            continue
        if not cached[v]:
            in_use[v] = False
            free[n_free] = v
            n_free += 1
            continue
        h = mix64(block_of[v]) & mask
        while slots[h] != -1:
            h = (h + np.uint64(1)) & mask
        slots[h] = v
    counters[_FREE] = n_free


class BlockIds:
    """Ids for the blocks a policy caches, recycled between chunks (see the module docstring)."""

    def __init__(self, n_ids: int):
        self.n_ids = n_ids
        size = 1 << max(10, int(2 * n_ids - 1).bit_length())
        self.slots = np.full(size, -1, np.int32)
        self.block_of = np.zeros(n_ids, np.uint64)
        self.free = np.arange(n_ids - 1, -1, -1, dtype=np.int32)  # popped from the end: id 0 first
        self.in_use = np.zeros(n_ids, np.bool_)
        self.counters = np.array([n_ids], np.int64)

    def assign(self, hashes: np.ndarray) -> np.ndarray:
        if hashes.size > self.counters[_FREE]:
            raise RuntimeError("block id space exhausted: a chunk has more block references than was sized for")
        return _assign_ids(
            np.ascontiguousarray(hashes, np.uint64), self.slots, self.block_of, self.free, self.in_use, self.counters
        )

    def release(self, cached: np.ndarray) -> None:
        _release(self.slots, self.block_of, self.free, self.in_use, np.ascontiguousarray(cached), self.counters)


class StreamReplay:
    """One policy at one capacity over a trace given chunk by chunk, in row order: record batches with
    `block_hashes` and the per-request columns (input_tokens, tenant, priority, arrival_s, and cache_salt,
    lora for isolation). Sized up front from the trace's totals: `block_references` (all of them) and
    `chunk_refs` (the most in one chunk); `tenant_names` are all the trace's tenants, so that tenant codes
    (and the evictor/victim matrix) agree across chunks."""

    def __init__(
        self,
        carry_cls: type[Carry],
        capacity: int,
        *,
        block_size: int,
        tenant_names: list[str],
        block_references: int,
        chunk_refs: int,
        vllm_cap: bool,
        use_salt: bool,
        share_lora: bool,
    ):
        n_ids = int(min(capacity, block_references) + chunk_refs + 1)
        self.ids = BlockIds(n_ids)
        self.cache = carry_cls(n_ids, tenant_names, capacity)
        self.evict_matrix = np.zeros((len(tenant_names), len(tenant_names)), np.int64)
        self.block_size, self.tenant_names, self.vllm_cap = block_size, tenant_names, vllm_cap
        self.use_salt, self.share_lora = use_salt, share_lora

    def feed(self, chunk: pa.RecordBatch) -> tuple[SimOutput, PreparedTrace]:
        """The next rows' answers (hit blocks, evictions; evict_matrix of these rows only, also summed into
        `self.evict_matrix`) and the chunk as the policy saw it."""
        table = pa.Table.from_batches([chunk])
        hashes = fold_isolation(table, use_salt=self.use_salt, share_lora=self.share_lora)
        offsets = np.asarray(hashes.offsets, dtype=np.int64)
        offsets = offsets - offsets[0]
        prepared = prepare_requests(
            table, self.block_size, np.diff(offsets), vllm_cap=self.vllm_cap, tenant_names=self.tenant_names
        )
        prepared.keys, prepared.offsets = self.ids.assign(np.asarray(hashes.flatten())), offsets
        part = self.cache.feed(prepared)
        self.evict_matrix += part.evict_matrix
        self.ids.release(self.cache.cached())
        return part, prepared

    @property
    def filled_at(self) -> int:
        """First request index after which the cache was full; -1 if it has not filled yet."""
        return int(self.cache.state[FILLED_AT])
