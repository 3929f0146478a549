"""Multimodal KV reuse: `prefix` (today's engines: an image's KV is reused only as part of an identical prefix)
vs `position-independent` (an item's KV is reusable wherever it appears, as in position-independent caching
research: EPIC, MPIC). With the latter, the blocks that lie wholly inside an item seen before on the same
instance need no prefill even after the prefix stops matching. Reported: hit rate per modality, for both."""

from __future__ import annotations

import click

from . import Scenario, scenario


@scenario
class MultimodalCache(Scenario):
    name = "mm-cache"
    options = [
        click.Option(
            ["--mm-cache"],
            type=click.Choice(["prefix", "position-independent"]),
            default=None,
            help="prefix: media KV reused only inside an identical prefix (engines today); position-independent: "
            "an item's KV reused wherever the item appears [default: prefix, without the per-modality report]",
        )
    ]

    def __init__(self, mode: str):
        self.mode = mode

    @classmethod
    def create(cls, settings):
        mode = settings.get("mm_cache")
        return None if mode is None else cls(mode)

    def attach(self, instances, reqs, trace, prep, block_size):
        self.bs = block_size
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
        self.seen = [set() for _ in instances]  # item hashes whose KV an instance computed
        self.item_tokens: dict[str, int] = {}
        self.item_hit_tokens: dict[str, int] = {}

    def extra_hits(self, inst, req, prefix):
        spans = self.spans[req.row]
        if not spans:
            return 0
        extra = 0
        seen = self.seen[inst.index]
        for modality, h, lo, hi in spans:
            whole = max(0, hi - lo)
            in_prefix = max(0, min(hi, prefix) - lo)
            reused = in_prefix
            if self.mode == "position-independent" and h in seen:
                later = max(0, min(hi, req.max_hit) - max(lo, prefix))
                extra += later
                reused += later
            self.item_tokens[modality] = self.item_tokens.get(modality, 0) + whole * self.bs
            self.item_hit_tokens[modality] = self.item_hit_tokens.get(modality, 0) + reused * self.bs
            seen.add(h)
        return extra

    def summary(self, reqs, instances, prep, kv_bytes_block):
        return {
            "mode": self.mode,
            "hit_rate_by_modality": {m: self.item_hit_tokens[m] / t for m, t in sorted(self.item_tokens.items()) if t},
        }
