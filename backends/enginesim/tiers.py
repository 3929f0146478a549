"""KV tiers below HBM: host DRAM and local SSD per instance, and a global pool shared by every instance
(Mooncake Store style). Each is a block-key LRU with a capacity and the bandwidth its loads are costed at.

HBM is the prefix cache of a `sim` policy (its reference class, driven request by request). With write-back a
block reaches DRAM when HBM evicts it, and SSD when DRAM evicts it; with write-through every block HBM admits
is also written to DRAM at once (more traffic, nothing lost on eviction). A global pool receives what an
instance evicts from its lowest tier and serves any instance. After the HBM prefix, the blocks that follow
are looked up tier by tier; the ones found are loaded (costed by bandwidth) instead of computed.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass
class Tier:
    name: str
    capacity: int  # blocks; 0 = the tier is off
    bandwidth: float  # bytes/s for loads into HBM
    blocks: OrderedDict = field(default_factory=OrderedDict)  # key -> None, least recent first
    written: int = 0  # blocks written into this tier
    loaded: int = 0  # blocks loaded from this tier into HBM

    def __contains__(self, key: int) -> bool:
        return key in self.blocks

    def touch(self, key: int) -> None:
        self.blocks.move_to_end(key)

    def put(self, key: int) -> int | None:
        """Store `key`; returns the key it evicted to make room, if any."""
        if self.capacity <= 0:
            return key
        if key in self.blocks:
            self.blocks.move_to_end(key)
            return None
        self.written += 1
        self.blocks[key] = None
        if len(self.blocks) > self.capacity:
            return self.blocks.popitem(last=False)[0]
        return None


class TierStack:
    """DRAM and SSD of one instance, above an optional shared global pool."""

    def __init__(self, dram: Tier, ssd: Tier, pool: Tier | None, write_through: bool):
        self.dram, self.ssd, self.pool, self.write_through = dram, ssd, pool, write_through
        self.lower = [t for t in (dram, ssd, pool) if t is not None and t.capacity > 0]

    def admitted(self, key: int) -> None:
        """HBM admitted a block (computed or loaded)."""
        if self.write_through and self.dram.capacity > 0:
            self._spill(self.dram.put(key), below=self.dram)

    def evicted(self, key: int) -> None:
        """HBM evicted a block: write-back keeps it one tier down (write-through already has it there)."""
        if not self.lower:
            return
        if self.write_through and key in self.dram:
            return
        self._spill(self.lower[0].put(key), below=self.lower[0])

    def _spill(self, key: int | None, below: Tier) -> None:
        i = self.lower.index(below) if below in self.lower else len(self.lower)
        while key is not None and i + 1 < len(self.lower):
            i += 1
            key = self.lower[i].put(key)

    def find(self, keys: list[int], start: int, stop: int) -> list[Tier]:
        """The tier of each block keys[start:stop] found contiguously below HBM (stops at the first miss)."""
        found = []
        for pos in range(start, stop):
            tier = next((t for t in self.lower if keys[pos] in t), None)
            if tier is None:
                break
            tier.touch(keys[pos])
            tier.loaded += 1
            found.append(tier)
        return found
