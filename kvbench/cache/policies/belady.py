"""`belady`: offline optimal with bypass on the prefix trie, the upper bound every report shows beside the real
policies (docs/semantics.md, Policies).

Same structure as `radix-lru` (leaf-first, the running request's blocks protected, a block inserted only
below a cached parent), but a block's key is its next use: the index of the next request that references it,
`trace.next_use()`, set whenever a request hits or inserts it (and for a cached block beyond a capped hit
prefix, which a later request still uses). To insert a block into a full cache, the unprotected leaf used
farthest in the future is the candidate (ties: the larger key id); if that next use is no later than the
next use of the block being inserted, nothing more of this request is inserted (bypass), since keeping the
cache as it is serves the future at least as well.
"""

from __future__ import annotations

from kvbench.cache.policies import SimOutput, policy
from kvbench.cache.trie import BELADY, TrieReference, run_leaf_kernel


class _BeladyReference(TrieReference):
    def __init__(self, *args):
        super().__init__(*args)
        self.next_use = self.trace.next_use().tolist()
        self.nu: dict[int, int] = {}

    def rank(self, key):
        return (-self.nu[key], -key)  # farthest next use first, then the larger key

    def _learn(self, key, pos):
        self.nu[key] = self.next_use[self.trace.offsets[self.request] + pos]

    def touch(self, key, pos):
        self._learn(key, pos)
        self.refresh(key)

    def on_skip(self, key, pos):
        self.touch(key, pos)

    def on_insert(self, key, pos):
        self._learn(key, pos)

    def choose_victim(self, key, pos):
        victim = self.top(0)
        incoming = self.next_use[self.trace.offsets[self.request] + pos]
        if victim is None or self.nu[victim] <= incoming:
            return None  # bypass: the cache as it is serves the future at least as well
        return victim


def reference(trace, capacity, options=None) -> SimOutput:
    return _BeladyReference(trace, capacity, options).run()


@policy("belady", reference=reference, cache=_BeladyReference)
def kernel(trace, capacity, options=None) -> SimOutput:
    """Offline optimal with bypass on the prefix trie: evict the leaf used farthest in the future."""
    return run_leaf_kernel(BELADY, trace, capacity, next_use=trace.next_use())
