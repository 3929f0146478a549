"""`priority-lru`: TensorRT-LLM's KV cache retention priorities on the prefix trie (docs/semantics.md, Policies).

What TensorRT-LLM does (KvCacheRetentionConfig / TokenRangeRetentionConfig, its LRUEvictionPolicy): blocks
carry a retention priority 0-100 (default 35); eviction takes a free leaf from the lowest non-empty priority
level, least recently released first; a new priority always overrides the old one; a priority given with a
`duration_ms` applies until that long after the block was last used, then the block reverts to the default
priority and is re-queued at the most recent end of the default level.

Here, on the same trie as `radix-lru` (leaf-first, the running request's blocks protected, a block inserted
only below a cached parent):
- a request's blocks (hit prefix and insertions) take its `priority` (trace column, 35 when null), the whole
  prompt as one token range; a block keeps the priority of the request that last used it;
- eviction takes the unprotected leaf of lowest priority, least recently used within a priority;
- with a duration, a non-default priority expires that long after the block's last use: before the first
  request at or after that time the block reverts to 35 and counts as used then (TensorRT-LLM's re-queue).
  `priority_duration_s` counts seconds of trace time (arrival_s); `priority_duration_requests` counts
  requests. Without either, priorities never expire.
Decode blocks are not cached by the sim, so `decode_retention_priority` has nothing to act on.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from kvbench.cache.policies import SimOutput, policy
from kvbench.cache.trie import PRIORITY_LRU, TrieReference, run_leaf_kernel
from kvbench.options import Bounds, option
from kvbench.trace.schema import DEFAULT_PRIORITY


@dataclass(frozen=True)
class PriorityOptions:
    """priority-lru's options (one of the two, read and checked by `kvbench.cache.policy_options`)."""

    priority_duration_requests: int | None = option(
        None,
        "requests after a block's last use until its priority reverts to 35 (default: never)",
        unit="requests",
        bounds=Bounds(at_least=0, whole=True),
    )
    priority_duration_s: float | None = option(
        None,
        "seconds (trace time) after a block's last use until its priority reverts to 35 (TensorRT-LLM "
        "duration_ms / 1000; default: never)",
        unit="s (trace time)",
        bounds=Bounds(at_least=0),
    )


def expiry(trace, options) -> np.ndarray:
    """int64[n]: for a block last used by request i, the first request before which its priority expires."""
    options = options or {}
    n = trace.n_requests
    by_requests = options.get("priority_duration_requests")
    by_seconds = options.get("priority_duration_s")
    if by_requests is not None and by_seconds is not None:
        raise ValueError("give priority_duration_requests or priority_duration_s, not both")
    if by_seconds is not None:
        if by_seconds < 0:
            raise ValueError("priority_duration_s must be >= 0")
        arrival = np.asarray(trace.arrival_s, np.float64)
        return np.searchsorted(arrival, arrival + float(by_seconds), side="left").astype(np.int64)
    if by_requests is not None:
        if int(by_requests) != by_requests or by_requests < 0:
            raise ValueError("priority_duration_requests must be a whole number >= 0")
        return np.arange(n, dtype=np.int64) + int(by_requests)
    return np.full(n, n + 1, np.int64)


def priorities(trace) -> np.ndarray:
    return np.clip(trace.priority.astype(np.int64), 0, 100)


class _PriorityLruReference(TrieReference):
    def __init__(self, *args):
        super().__init__(*args)
        self.expire_at = expiry(self.trace, self.options).tolist()
        self.request_priority = priorities(self.trace).tolist()
        self.clock = 0
        self.stamp: dict[int, int] = {}
        self.priority: dict[int, int] = {}
        self.used_by: dict[int, int] = {}
        self.expiring: deque[tuple[int, int]] = deque()  # (stamp, key) of uses with a non-default priority

    def rank(self, key):
        return (self.priority[key], self.stamp[key])

    def begin_request(self):
        while self.expiring:
            stamp, key = self.expiring[0]
            if self.contains(key) and self.stamp[key] == stamp:  # still the block's last use
                if self.expire_at[self.used_by[key]] > self.request:
                    break
                self.priority[key] = DEFAULT_PRIORITY
                self.clock += 1
                self.stamp[key] = self.clock
                self.refresh(key)
            self.expiring.popleft()

    def _use(self, key):
        self.clock += 1
        self.stamp[key] = self.clock
        self.priority[key] = self.request_priority[self.request]
        self.used_by[key] = self.request
        if self.priority[key] != DEFAULT_PRIORITY:
            self.expiring.append((self.clock, key))

    def touch(self, key, pos):
        self._use(key)
        self.refresh(key)

    def on_insert(self, key, pos):
        self._use(key)


def reference(trace, capacity, options=None) -> SimOutput:
    return _PriorityLruReference(trace, capacity, options).run()


@policy("priority-lru", reference=reference, cache=_PriorityLruReference, options=PriorityOptions)
def kernel(trace, capacity, options=None) -> SimOutput:
    """TensorRT-LLM retention priorities: evict the lowest-priority leaf, LRU within a priority."""
    return run_leaf_kernel(
        PRIORITY_LRU,
        trace,
        capacity,
        priority=priorities(trace),
        expire_at=expiry(trace, options),
        default_prio=DEFAULT_PRIORITY,
    )
