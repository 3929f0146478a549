"""Multimodal KV reuse: `prefix` (today's engines: an image's KV is reused only as part of an identical prefix)
vs `position-independent` (an item's KV is reusable wherever it appears, as in position-independent caching
research: EPIC, MPIC). Reported: hit rate per modality, for both.

Position-independent reuse reads KV that is in the pool, nowhere else: the blocks wholly inside an item are
the KV some earlier request computed for it, and they are cached, released and evicted by the HBM policy like
every other block (they are that request's own prefix blocks). A later request on the same instance reuses
the longest leading run of such a copy that is still cached, after its own prefix hit; so the smaller the
pool, the less media KV survives to be reused. Before the request's own blocks are admitted, the blocks it
reuses are passed to the policy's `on_hit` as its hit blocks are (LRU-like policies refresh them, so the
request's own admission evicts other blocks first; a policy that does nothing there leaves them as they are).
Granularity is the block: an item's position inside a block-aligned prompt may leave a different number of
whole blocks than in the copy; the reuse is capped by both. Each instance remembers the last
`COPIES_PER_ITEM` copies of an item (keys only; whether they are still cached is asked of the policy)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import click
from kvbench.backends.enginesim.scenarios import Scenario, scenario

from kvbench.options import cli_options, option

COPIES_PER_ITEM = 4  # newest copies of an item's KV an instance looks for (older ones are rarely still cached)


@dataclass(frozen=True)
class MultimodalCacheOptions:
    """The engine-sim options of the MultimodalCache scenario."""

    mm_cache: str | None = option(
        None,
        "prefix: media KV reused only inside an identical prefix (engines today); position-independent: "
        "an item's KV reused wherever the item appears while its blocks stay cached "
        "[default: prefix, without the per-modality report]",
        unit="name",
        type=click.Choice(["prefix", "position-independent"]),
    )


@scenario
class MultimodalCache(Scenario):
    name = "mm-cache"
    options = cli_options(MultimodalCacheOptions)

    def __init__(self, mode: str):
        self.mode = mode

    @classmethod
    def create(cls, settings):
        mode = settings.get("mm_cache")
        return None if mode is None else cls(mode)

    def attach(self, instances, reqs, trace, prep, block_size):
        self.bs, self.prep = block_size, prep
        items = trace.column("mm_items").to_pylist() if "mm_items" in trace.column_names else [None] * len(reqs)
        # per request: (modality, item hash, first block wholly inside, end block) of each item
        self.spans = [
            [
                (
                    it["modality"],
                    it["hash"],
                    -(-it["offset"] // block_size),
                    (it["offset"] + it["tokens"]) // block_size,
                )
                for it in (row or ())
            ]
            for row in items
        ]
        self.copies = [{} for _ in instances]  # per instance: item hash -> deque of key tuples, newest first
        self.found: dict[tuple[int, int], dict[int, int]] = {}  # (instance, row) -> {item index: blocks reusable}
        self.item_tokens: dict[str, int] = {}
        self.item_hit_tokens: dict[str, int] = {}
        if self.mode == "position-independent":
            for inst in instances:
                self._wrap(inst)

    def _keys(self, row: int) -> list:
        p = self.prep
        return p.keys[p.offsets[row] : p.offsets[row + 1]].tolist()

    def _wrap(self, inst) -> None:
        """Look for cached copies of a request's items before it is admitted, and record its own after."""
        cache, begin = inst.cache, inst.cache.begin

        def begun(row, **kw):
            self.found[(inst.index, row)] = self._reusable(inst, row)
            hit = begin(row, **kw)
            copies, keys = self.copies[inst.index], self._keys(row)
            for _, h, lo, hi in self.spans[row]:
                if hi > lo:
                    copies.setdefault(h, deque(maxlen=COPIES_PER_ITEM)).appendleft(tuple(keys[lo:hi]))
            return hit

        cache.begin = begun

    def _reusable(self, inst, row) -> dict[int, int]:
        """Blocks of each item of `row` found cached as the leading run of an earlier copy (touched as hits)."""
        cache, copies, found = inst.cache, self.copies[inst.index], {}
        for index, (_, h, lo, hi) in enumerate(self.spans[row]):
            best, best_copy = 0, ()
            for copy in copies.get(h, ()):
                run = 0
                while run < min(len(copy), hi - lo) and cache.contains(copy[run]):
                    run += 1
                if run > best:
                    best, best_copy = run, copy
            if best:
                found[index] = best
                cache.request = row  # the policy holds / refreshes them on behalf of this request
                for j in range(best):
                    cache.on_hit(best_copy[j], lo + j)
        return found

    def extra_hits(self, inst, req, prefix):
        spans = self.spans[req.row]
        if not spans:
            return 0
        found = self.found.pop((inst.index, req.row), {})
        extra = 0
        for index, (modality, _, lo, hi) in enumerate(spans):
            whole = max(0, hi - lo)
            reused = max(0, min(hi, prefix) - lo)  # inside the prefix hit
            if index in found:  # position-independent: the copy's cached blocks after the prefix
                later = max(0, min(lo + found[index], req.max_hit) - max(lo, prefix))
                extra += later
                reused += later
            if req.hit is None:  # the first admission only (a recompute after preemption is not a new use)
                self.item_tokens[modality] = self.item_tokens.get(modality, 0) + whole * self.bs
                self.item_hit_tokens[modality] = self.item_hit_tokens.get(modality, 0) + reused * self.bs
        return extra

    def summary(self, reqs, instances, prep, kv_bytes_block):
        return {
            "mode": self.mode,
            "hit_rate_by_modality": {m: self.item_hit_tokens[m] / t for m, t in sorted(self.item_tokens.items()) if t},
        }
