"""The readable request path every pure-Python reference policy shares.

`PrefixCache.run` walks the trace once: for each request it counts the cached prefix (capped at
`max_hit`), calls `on_hit` for those blocks, then `admit` for the rest in order until a policy says stop,
and finally `after_request`. `begin` and `end` are the two halves, for callers in which requests overlap.
A policy subclass only says how recency/frequency/priority change and which
block to evict; eviction bookkeeping (per-request counts, evictor x victim tenants, fill time) is here.
"""

from __future__ import annotations

from kvbench.cache.policies import SimOutput
from kvbench.cache.prepared import PreparedTrace


class PrefixCache:
    def __init__(self, trace: PreparedTrace, capacity: int, options: dict | None = None):
        if capacity <= 0:
            raise ValueError("capacity must be > 0 blocks")
        self.trace, self.capacity, self.options = trace, capacity, options or {}
        self.owner: dict[int, int] = {}  # cached key -> tenant whose request inserted it
        self.out = SimOutput.empty(trace)
        self.request = 0  # index of the request being processed

    # --- what a policy implements ----------------------------------------------------------------
    def contains(self, key: int) -> bool:
        return key in self.owner

    def on_hit(self, key: int, pos: int) -> None:
        """A block of the hit prefix (position pos in the prompt) was used."""

    def admit(self, key: int, pos: int) -> bool:
        """Handle block `pos` after the hit prefix (cached or not); return False to stop this request."""
        raise NotImplementedError

    def after_request(self, keys: list[int]) -> None:
        """Called once the request's blocks were handled (e.g. vLLM releases them here)."""

    # --- shared bookkeeping ----------------------------------------------------------------------
    def insert(self, key: int) -> None:
        self.owner[key] = int(self.trace.tenant[self.request])
        if len(self.owner) >= self.capacity and self.out.filled_at < 0:
            self.out.filled_at = self.request

    def evict(self, key: int) -> None:
        victim = self.owner.pop(key)
        self.out.evictions[self.request] += 1
        self.out.evict_matrix[self.trace.tenant[self.request], victim] += 1

    @property
    def full(self) -> bool:
        return len(self.owner) >= self.capacity

    def lookup(self, r: int) -> int:
        """Request r's cached prefix in blocks (capped at max_hit), changing nothing: what `begin` will hit."""
        t = self.trace
        keys = t.keys[t.offsets[r] : t.offsets[r + 1]]
        hit = 0
        while hit < t.max_hit[r] and self.contains(int(keys[hit])):
            hit += 1
        return hit

    def begin(self, r: int) -> int:
        """Request r arrives (or is scheduled): count its cached prefix, then admit its blocks. Returns the
        hit blocks. A time-aware caller (engine-sim) calls `end(r)` when it finishes, with other requests
        begun in between; `run` ends each request at once."""
        self.request = r
        t = self.trace
        keys = t.keys[t.offsets[r] : t.offsets[r + 1]].tolist()
        hit = 0
        while hit < t.max_hit[r] and self.contains(keys[hit]):
            hit += 1
        self.out.hit_blocks[r] = hit
        for pos in range(hit):
            self.on_hit(keys[pos], pos)
        for pos in range(hit, len(keys)):
            if not self.admit(keys[pos], pos):
                break
        return hit

    def end(self, r: int) -> None:
        self.request = r
        t = self.trace
        self.after_request(t.keys[t.offsets[r] : t.offsets[r + 1]].tolist())

    def run(self) -> SimOutput:
        for r in range(self.trace.n_requests):
            self.begin(r)
            self.end(r)
        return self.out
