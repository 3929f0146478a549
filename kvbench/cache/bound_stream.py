"""The Belady bound of a streamed replay: `belady` over a trace given chunk by chunk, in bounded memory.

`belady` (policies/belady.py) needs each block reference's next use, which the in-memory path computes over the
whole trace; here `nextuse.NextUseFile` computes it out of core first, in one pass over the trace, and
`StreamBound` then replays the trace chunk by chunk reading the next uses of each chunk from disk. The cache
itself is the in-memory kernel's (trie.leaf_kernel in BELADY mode), made resumable: its node table is indexed
by the recycled block ids of `stream.BlockIds` (capacity + one chunk's references), and a block's parent is
the block before it in the prompt (prefix-chained ids have one parent each: the in-memory `trace.parent`).

Exact: hit blocks, evictions and the evictor/victim matrix equal the in-memory kernel's. Ties are broken as
there: two leaves can only tie when neither is used again (a request's blocks lie on one path, and a leaf has
no cached descendant), and then the later first appearance (the larger dense key in memory) goes first; the
recycled ids do not keep that order, so `NextUseFile` gives each last reference its block's first position.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa

from kvbench.cache.compiled import i4, i8, kernel_fn
from kvbench.cache.nextuse import NextUseFile, spill_bytes
from kvbench.cache.policies import SimOutput
from kvbench.cache.prepared import PreparedTrace, fold_isolation, prepare_requests
from kvbench.cache.stream import BlockIds
from kvbench.cache.trie import (
    CODE,
    NCHILD,
    NONE,
    OWNER,
    PARENT,
    PROT,
    STAMP,
    heap_add,
    heap_restore,
    heap_size,
    sift_down,
)

_FAR = np.int64(1) << 62
HEAP_N, SIZE, FILLED_AT = range(3)  # fields of the int64 `state` carried from chunk to chunk
FIRST = 6  # node column (trie.PRIO, unused by Belady): first position of a block never used again


@kernel_fn()
def _learn(nodes, k, nu, never):
    """Set a block's next use from a `NextUseFile` value: beyond `never`, none, and the block's first position."""
    if nu >= never:
        nodes[k, STAMP] = never
        nodes[k, FIRST] = nu - never
    else:
        nodes[k, STAMP] = nu


@kernel_fn()
def _rank(nodes, k, never):
    """trie._rank's BELADY order: farthest next use first, then the larger key. Only blocks never used again
    can tie, and for them the in-memory key (order of first appearance) is the first position, not `k`."""
    if nodes[k, STAMP] == never:
        return _FAR - (never << 31) - 1 - nodes[k, FIRST]  # below every rank of a block used again
    return _FAR - ((nodes[k, STAMP] << 31) | k)


@kernel_fn("Tuple((i4[::1], i4[::1]))(i4[::1], i8[::1], i4[::1], i4[::1], i8[::1], i8, i8, i8, i8[:, ::1], "
           "i8[::1], i4[::1], i8[::1], i8[::1], i4[::1], i8[:, ::1])")  # fmt: skip
def _belady_chunk(
    keys, offsets, max_hit, tenant, next_use, r0, never, capacity, nodes, hp, hk, state, stash_p, stash_k, matrix
):
    """trie.leaf_kernel's BELADY mode over one chunk, its requests numbered from r0 (PROT and filled_at hold
    global request indices, so that a recycled id's stale PROT never equals a later request). The heap, size
    and filled_at come and go in `state`; evictions are added to `matrix`. `never`: n_requests + 1."""
    n = offsets.size - 1
    hn, size, filled_at = state[HEAP_N], state[SIZE], state[FILLED_AT]
    hit_blocks = np.zeros(n, np.int32)
    evictions = np.zeros(n, np.int32)
    for i in range(n):
        r = r0 + i
        lo, hi = offsets[i], offsets[i + 1]
        h = 0
        while h < max_hit[i] and nodes[keys[lo + h], NCHILD] >= 0:
            h += 1
        hit_blocks[i] = h
        for j in range(lo, hi):
            nodes[keys[j], PROT] = r
        ns = 0
        for j in range(lo, hi):
            k = keys[j]
            if j >= lo + h:
                if nodes[k, NCHILD] >= 0:  # beyond the hit prefix (hit cap): skipped, its next use learnt
                    _learn(nodes, k, next_use[j], never)
                    nodes[k, CODE] = NONE
                    continue
                p = keys[j - 1] if j > lo else -1
                if p >= 0 and nodes[p, NCHILD] < 0:
                    break
                if size >= capacity:
                    v = -1
                    while hn > 0:
                        v = hk[0]
                        if nodes[v, CODE] == hp[0]:
                            if nodes[v, PROT] != r:
                                break
                            stash_p[ns] = hp[0]
                            stash_k[ns] = v
                            ns += 1
                            nodes[v, CODE] = -3 - hp[0]
                        v = -1
                        hn -= 1
                        sift_down(hp, hk, hn, hp[hn], hk[hn])
                    if v < 0 or nodes[v, STAMP] <= min(next_use[j], never):
                        break  # bypass: the cache as it is serves the future at least as well
                    nodes[v, NCHILD] = -1
                    nodes[v, CODE] = NONE
                    size -= 1
                    evictions[i] += 1
                    matrix[tenant[i], nodes[v, OWNER]] += 1
                    u = nodes[v, PARENT]
                    if u >= 0:
                        nodes[u, NCHILD] -= 1
                    if u >= 0 and nodes[u, NCHILD] == 0 and nodes[u, PROT] != r:
                        nodes[u, CODE] = _rank(nodes, u, never)
                        sift_down(hp, hk, hn, nodes[u, CODE], u)
                    else:
                        hn -= 1
                        sift_down(hp, hk, hn, hp[hn], hk[hn])
                nodes[k, NCHILD] = 0
                nodes[k, OWNER] = tenant[i]
                nodes[k, PARENT] = p
                size += 1
                if size >= capacity and filled_at < 0:
                    filled_at = r
                if p >= 0:
                    nodes[p, NCHILD] += 1
                    nodes[p, CODE] = NONE
            nodes[k, CODE] = NONE  # protected until the request is done
            _learn(nodes, k, next_use[j], never)
        hn = heap_restore(hp, hk, hn, nodes, stash_p, stash_k, ns)
        for j in range(lo, hi):
            k = keys[j]
            if nodes[k, NCHILD] == 0 and nodes[k, CODE] == NONE:
                nodes[k, CODE] = _rank(nodes, k, never)
                hn = heap_add(hp, hk, hn, nodes, nodes[k, CODE], k)
    state[HEAP_N], state[SIZE], state[FILLED_AT] = hn, size, filled_at
    return hit_blocks, evictions


def spill_check(block_references: int, tmpdir=None) -> str | None:
    """Why the next uses of a trace this long cannot be spilled under `tmpdir` (default: $TMPDIR), or None."""
    where = Path(tmpdir or tempfile.gettempdir())
    need, free = spill_bytes(block_references), shutil.disk_usage(where).free
    if need > free:
        return (
            f"its next uses need up to {need / 2**30:.1f} GiB of scratch disk under {where} "
            f"({block_references:,} block references), and {free / 2**30:.1f} GiB are free; point TMPDIR at a "
            "larger disk"
        )
    return None


def next_uses(
    scanned, *, use_salt: bool, share_lora: bool, tmpdir=None, partition_refs: int = 4_000_000, progress=None
) -> NextUseFile:
    """A finished `NextUseFile` for a `ScannedTrace` (one pass over its block ids); the caller closes it.
    `progress(references done)` is called after each chunk."""
    nu = NextUseFile(scanned.block_references, scanned.n_requests, tmpdir=tmpdir, partition_refs=partition_refs)
    try:
        for batch in scanned.chunks(columns=("cache_salt", "lora")):
            hashes = fold_isolation(pa.Table.from_batches([batch]), use_salt=use_salt, share_lora=share_lora)
            offsets = np.asarray(hashes.offsets, np.int64)
            nu.add(np.asarray(hashes.flatten()), offsets - offsets[0])
            if progress is not None:
                progress(nu.added)
        nu.finish()
    except BaseException:
        nu.close()
        raise
    return nu


class StreamBound:
    """`belady` at one capacity over a trace fed chunk by chunk in row order (as `stream.StreamReplay`), its
    next uses read from `next_use` (a finished `NextUseFile` of the same trace and isolation options)."""

    def __init__(self, next_use: NextUseFile, capacity: int, *, block_size, tenant_names, chunk_refs, longest,
                 use_salt, share_lora):  # fmt: skip
        n_ids = int(min(capacity, next_use.m) + chunk_refs + 1)
        self.ids = BlockIds(n_ids)
        self.nodes = np.zeros((n_ids, 8), np.int64)
        self.nodes[:, CODE], self.nodes[:, NCHILD], self.nodes[:, PROT] = NONE, -1, -1
        size = heap_size(min(capacity, n_ids))  # room for every candidate leaf
        self.hp, self.hk = np.empty(size, np.int64), np.empty(size, np.int32)
        self.state = np.array([0, 0, -1], np.int64)
        self.stash_p = np.empty(2 * longest + 2, np.int64)  # a key is hidden at most twice per request
        self.stash_k = np.empty(2 * longest + 2, np.int32)
        self.evict_matrix = np.zeros((len(tenant_names), len(tenant_names)), np.int64)
        self.next_use, self.capacity = next_use, int(capacity)
        self.block_size, self.tenant_names = block_size, tenant_names
        self.use_salt, self.share_lora = use_salt, share_lora
        self._pos = self._rows = 0  # references and requests fed so far
        self._never = next_use.n + 1

    def feed(self, chunk: pa.RecordBatch) -> tuple[SimOutput, PreparedTrace]:
        """The next rows' answers and the chunk as the bound saw it (as `StreamReplay.feed`)."""
        table = pa.Table.from_batches([chunk])
        hashes = fold_isolation(table, use_salt=self.use_salt, share_lora=self.share_lora)
        offsets = np.asarray(hashes.offsets, dtype=np.int64)
        offsets = offsets - offsets[0]
        prepared = prepare_requests(
            table, self.block_size, np.diff(offsets), vllm_cap=False, tenant_names=self.tenant_names
        )
        prepared.keys, prepared.offsets = self.ids.assign(np.asarray(hashes.flatten())), offsets
        nu = self.next_use.read(self._pos, int(offsets[-1]))
        matrix = np.zeros_like(self.evict_matrix)
        hit_blocks, evictions = _belady_chunk(
            i4(prepared.keys), i8(offsets), i4(prepared.max_hit), i4(prepared.tenant), nu, self._rows, self._never,
            self.capacity, self.nodes, self.hp, self.hk, self.state, self.stash_p, self.stash_k, matrix,
        )  # fmt: skip
        self._pos += int(offsets[-1])
        self._rows += table.num_rows
        self.evict_matrix += matrix
        self.ids.release(self.nodes[:, NCHILD] >= 0)
        return SimOutput(hit_blocks, evictions, matrix, int(self.state[FILLED_AT])), prepared

    @property
    def filled_at(self) -> int:
        return int(self.state[FILLED_AT])
