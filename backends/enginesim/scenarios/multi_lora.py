"""Multi-LoRA KV: `isolated` puts the adapter in the cache key (vLLM today: requests of different adapters never
share KV); `shared-base` stores the base model's KV once for all adapters plus, for each adapter that uses a
block, a delta of relative size d = `--lora-delta`. Reported: KV bytes the cache holds at the end and hit
rates, to compare the two as adapters multiply (1…100).

Deltas are KV like any other: they live in the same pool and go through the same policy. An adapter's deltas
for g = ⌊1/d⌋ consecutive full blocks of a prompt (positions [j·g, (j+1)·g)) are packed into one pool block,
a *delta page*; its key is (adapter, key of the last block it covers), prefix-chained like every key, so the
page of a group a prompt ends inside (or leaves for its own suffix) is that request's own, a whole block for
its few deltas. After a request's blocks are admitted, its pages are admitted through the policy (held while
it runs, evicting what the policy chooses when the pool is full), so base blocks + pages never exceed the
pool. A block hits for adapter a only when its base block and the newest page holding a's delta for it are
both cached: the delta is part of the adapter's KV and cannot be had without running the adapter. The policy
still takes the whole base hit (its blocks are reused in place, not stored twice); the engine is told only
the covered part and prefills the rest. Sharing thus saves memory, not compute: with room for everything
shared-base hits exactly as isolated does; in a bounded pool it keeps more prefixes and hits more. Requests
without an adapter use base blocks only.

Footprint of a prefix of B blocks used by N adapters: isolated N·B blocks, shared-base B + N·⌊B/g⌋ pages
(plus the pages a request's own suffix starts) ≈ B·(1 + N·d); at N = 100, d = 0.1 that is 100 vs 11, about
9× on the shared part, tending to 1/d as N grows. KV that is not shared (each request's own suffix) costs as
much in both, plus its pages in shared-base (benchmarks/lora_sharing.py).

Pages are keys outside the trace's key space. A policy that admits blocks one by one (`admit`: lru, fifo,
lfu, s3fifo) takes them as it takes the request's own blocks; vLLM's slot pool gives each page a slot from the
head of its free queue, held until the request ends and then released like a hashed block. The trie policies
(which need a parent for every key) are refused. Tiers below HBM see pages as blocks but a lower-tier hit needs
no page (deltas are modeled in HBM only).
"""

from __future__ import annotations

from dataclasses import dataclass

import click
import numpy as np
from kvbench.backends.enginesim.scenarios import Scenario, scenario

from kvbench.cache.reference import PrefixCache
from kvbench.errors import KvbenchError
from kvbench.options import cli_options, option


@dataclass(frozen=True)
class MultiLoraOptions:
    """The engine-sim options of the MultiLora scenario."""

    lora_kv: str | None = option(
        None,
        "isolated: the adapter is part of the cache key (vLLM); shared-base: base KV shared by all "
        "adapters plus a per-adapter delta in the same pool [default: as --share-lora-kv says, no delta]",
        unit="name",
        type=click.Choice(["isolated", "shared-base"]),
    )
    lora_delta: float = option(
        0.1,
        "shared-base: bytes of an adapter's KV delta per block, as a fraction of a base block "
        "(0: no delta; 1/d deltas share one pool block)",
        unit="share of a base block",
        type=click.FloatRange(0, 1),
    )


@scenario
class MultiLora(Scenario):
    name = "multi-lora"
    options = cli_options(MultiLoraOptions)

    def __init__(self, mode: str, delta: float):
        self.mode, self.delta = mode, delta
        # deltas per pool block (the epsilon keeps 1/0.1 from flooring to 9)
        self.per_page = int(1 / delta + 1e-9) if mode == "shared-base" and delta > 0 else 0

    @classmethod
    def create(cls, settings):
        mode = settings.get("lora_kv")
        if mode is None:
            return None
        if settings.get("share_lora_kv"):
            raise KvbenchError("give either --lora-kv or --share-lora-kv, not both")
        return cls(mode, float(settings.get("lora_delta") or 0.0))

    def share_lora(self, default):
        return self.mode == "shared-base"

    def attach(self, instances, reqs, trace, prep, block_size):
        lora = trace.column("lora").cast("string").to_pylist() if "lora" in trace.column_names else [None] * len(reqs)
        self.adapter, self.prep = lora, prep
        self.adapters = len({a for a in lora if a is not None})
        self.pages: dict[tuple[str, int], int] = {}  # (adapter, last base key covered) -> page key
        self.page_of: dict[tuple[str, int], int] = {}  # (adapter, base key) -> page holding its delta
        self.first_page = prep.n_keys  # page keys follow the trace's dense keys
        if not self.per_page:
            return
        for inst in instances:
            self._wrap(inst.cache, _page_admitter(inst.cache))

    def _keys(self, row: int) -> list:
        p = self.prep
        return p.keys[p.offsets[row] : p.offsets[row + 1]].tolist()

    def _wrap(self, cache, admit_page) -> None:
        lookup, begin, contains = cache.lookup, cache.begin, cache.contains

        def covered_lookup(row):
            return self._covered(cache, row, lookup(row))

        def begun(row, **kw):
            # the policy takes the base hit as usual (its blocks are held and reused in place, not stored twice);
            # the engine is told only what the adapter's deltas cover, and computes the rest
            covered = covered_lookup(row)
            hit = begin(row, **kw)
            self._admit_pages(cache, contains, admit_page, row)
            return min(hit, covered)

        cache.lookup, cache.begin = covered_lookup, begun
        if hasattr(cache, "grow"):  # a slot pool caches the prompt as its chunks run: page it when it ends
            end = cache.end

            def ended(row, **kw):
                self._admit_pages(cache, contains, admit_page, row)
                end(row, **kw)

            cache.end = ended

    def _covered(self, cache, row: int, hit: int) -> int:
        """Leading blocks of `row` (of its `hit` cached base blocks) whose delta for its adapter is cached too."""
        adapter = self.adapter[row]
        if adapter is None:
            return hit
        keys = self._keys(row)
        for pos in range(hit):
            page = self.page_of.get((adapter, keys[pos]))
            if page is None or not cache.contains(page):
                return pos
        return hit

    def _admit_pages(self, cache, contains, admit_page, row: int) -> None:
        """Admit (or touch) the pages of the request's cached leading blocks, one per group of g."""
        adapter = self.adapter[row]
        if adapter is None:
            return
        keys = self._keys(row)
        # full blocks only: a partial last block's key is one no longer prompt shares, so a page ending there
        # could never cover a later turn of the same conversation (its delta is recomputed with it)
        full = min(len(keys), int(self.prep.input_tokens[row]) // self.prep.block_size)
        cached = 0
        while cached < full and contains(keys[cached]):
            cached += 1
        cache.request = row
        for start in range(0, cached, self.per_page):
            last = min(start + self.per_page, cached) - 1
            page = self.pages.setdefault((adapter, keys[last]), self.first_page + len(self.pages))
            admit_page(row, page)
            for key in keys[start : last + 1]:  # where each block's delta is now (the newest page holding it)
                self.page_of[(adapter, key)] = page

    def summary(self, reqs, instances, prep, kv_bytes_block):
        blocks = pages = pool = 0
        for inst in instances:
            cached = list(inst.cache.owner)
            in_pages = sum(1 for k in cached if k >= self.first_page)
            blocks, pages, pool = blocks + len(cached) - in_pages, pages + in_pages, pool + inst.pool
        hit = np.array([sum((r.hit or {}).values()) for r in reqs], dtype=np.int64)
        return {
            "mode": self.mode,
            "adapters": self.adapters,
            "delta": self.delta if self.mode == "shared-base" else 0.0,
            "deltas_per_block": self.per_page,
            "cached_blocks": blocks,  # base KV (isolated: every adapter's own copy)
            "delta_blocks": pages,  # pool blocks holding delta pages
            "kv_bytes_occupied": (blocks + pages) * kv_bytes_block,
            "pool_bytes": pool * kv_bytes_block,
            "hit_blocks": int(hit.sum()),
        }


def _page_admitter(cache):
    """`admit(row, page)`: take (or touch) a delta page for request `row`, through the policy's own admission."""
    if hasattr(cache, "hold_key"):
        # vLLM's slot pool: a page is held like a hit block (or takes the free queue's head like a computed one)
        # and is released with the request's blocks
        return cache.hold_key
    from kvbench.cache.trie import TrieReference

    if type(cache).admit is PrefixCache.admit or isinstance(cache, TrieReference):
        raise KvbenchError(
            f"--lora-kv shared-base keeps delta pages in the policy; {type(cache).__name__} cannot hold keys "
            "outside the trace: use vllm, lru, fifo, lfu or s3fifo"
        )
    return lambda row, page: cache.admit(page, 0)  # as a block after the hit: cached, touched or evicting
