"""Multi-LoRA KV: `isolated` puts the adapter in the cache key (vLLM today: requests of different adapters never
share KV), `shared-base` shares the base model's KV among all adapters and keeps a per-adapter delta of
relative size `--lora-delta` beside each block an adapter uses. Reported: KV bytes the cache holds at the end
and hit rates, to compare the two as adapters multiply (1…100)."""

from __future__ import annotations

import click
import numpy as np

from kvbench.errors import KvbenchError

from . import Scenario, scenario


@scenario
class MultiLora(Scenario):
    name = "multi-lora"
    options = [
        click.Option(
            ["--lora-kv"],
            type=click.Choice(["isolated", "shared-base"]),
            default=None,
            help="isolated: the adapter is part of the cache key (vLLM); shared-base: base KV shared by all "
            "adapters plus a per-adapter delta [default: as --share-lora-kv says, no delta]",
        ),
        click.Option(
            ["--lora-delta"],
            type=click.FloatRange(0, 1),
            default=0.1,
            show_default=True,
            help="shared-base: size of an adapter's KV delta relative to the base block",
        ),
    ]

    def __init__(self, mode: str, delta: float):
        self.mode, self.delta = mode, delta

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
        # adapters that use each key (shared-base: one delta each)
        users: dict[int, set] = {}
        for r, adapter in enumerate(lora):
            if adapter is not None:
                for k in prep.keys[prep.offsets[r] : prep.offsets[r + 1]].tolist():
                    users.setdefault(k, set()).add(adapter)
        self.users = users
        self.adapters = len({a for a in lora if a is not None})

    def summary(self, reqs, instances, prep, kv_bytes_block):
        blocks = deltas = 0
        for inst in instances:
            cached = list(inst.cache.owner)
            blocks += len(cached)
            if self.mode == "shared-base":
                deltas += sum(len(self.users.get(k, ())) for k in cached)
        occupied = (blocks + self.delta * deltas) * kv_bytes_block
        hit = np.array([sum((r.hit or {}).values()) for r in reqs], dtype=np.int64)
        return {
            "mode": self.mode,
            "adapters": self.adapters,
            "delta": self.delta if self.mode == "shared-base" else 0.0,
            "cached_blocks": blocks,
            "delta_blocks": self.delta * deltas,
            "kv_bytes_occupied": occupied,
            "hit_blocks": int(hit.sum()),
        }
