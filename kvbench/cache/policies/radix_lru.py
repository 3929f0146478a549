"""`radix-lru`: leaf-first LRU on the prefix trie, as SGLang's radix cache and the kvcache.ai simulator do it
(docs/semantics.md, Policies).

- The lookup touches only the hit prefix: each hit block becomes most recent, in prompt order.
- The missing blocks are then inserted in prompt order, each becoming most recent. A cached block beyond
  the hit prefix (possible only under a hit cap) is skipped, not touched, and insertion goes on.
- A block is inserted only if its parent is cached (a first block's parent is the root); otherwise this
  request inserts nothing more.
- When full, the least recently used leaf (cached, no cached children) is evicted, never one of the running
  request's blocks; evicting a leaf can make its parent a leaf. With no evictable leaf the request stops.
"""

from __future__ import annotations

from kvbench.cache.policies import SimOutput, policy
from kvbench.cache.trie import RADIX_LRU, TrieReference, run_leaf_kernel


class RadixLruReference(TrieReference):
    def __init__(self, *args):
        super().__init__(*args)
        self.clock = 0
        self.stamp: dict[int, int] = {}

    def rank(self, key):
        return self.stamp[key]

    def _use(self, key):
        self.clock += 1
        self.stamp[key] = self.clock

    def touch(self, key, pos):
        self._use(key)
        self.refresh(key)

    def on_insert(self, key, pos):
        self._use(key)


def reference(trace, capacity, options=None) -> SimOutput:
    return RadixLruReference(trace, capacity, options).run()


@policy("radix-lru", reference=reference, cache=RadixLruReference)
def kernel(trace, capacity, options=None) -> SimOutput:
    """Leaf-first LRU on the prefix trie (SGLang radix cache): hits touch only the hit prefix."""
    return run_leaf_kernel(RADIX_LRU, trace, capacity)
