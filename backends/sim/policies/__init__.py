"""Eviction policies of the `sim` backend. Each module registers one policy with `@policy`; none is listed
by hand. A policy provides two implementations of the same update rule (DESIGN.md section 5):

- `kernel(trace, capacity, options) -> SimOutput`: the compiled (numba) hot loop used for real runs;
- `reference(trace, capacity, options) -> SimOutput`: a readable pure-Python version built on
  `_reference.PrefixCache`, which writes the request path (lookup with the prefix rule, then the update)
  once. Tests check the two agree on every sample trace.

Both see requests strictly one at a time in arrival order: first the lookup (the longest cached prefix,
capped at `trace.max_hit[i]`), then the cache update.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from kvbench.registry import Registry

from ..prepared import PreparedTrace


@dataclass
class SimOutput:
    hit_blocks: np.ndarray  # int32[n]: leading blocks of each request found in the cache (prefix rule)
    evictions: np.ndarray  # int32[n]: blocks evicted by each request's insertions
    evict_matrix: np.ndarray  # int64[T, T]: [evictor tenant, victim tenant] -> blocks evicted
    filled_at: int  # first request index after which the cache was full; -1 if it never filled

    @classmethod
    def empty(cls, trace: PreparedTrace) -> SimOutput:
        t = len(trace.tenant_names)
        n = trace.n_requests
        return cls(np.zeros(n, np.int32), np.zeros(n, np.int32), np.zeros((t, t), np.int64), -1)


@dataclass(frozen=True)
class Policy:
    name: str
    summary: str
    kernel: Callable[..., SimOutput]
    reference: Callable[..., SimOutput]
    needs: tuple[str, ...] = ()  # trace columns the policy cannot work without (e.g. "tenant")
    options: dict[str, str] = field(default_factory=dict)  # option name -> help (with units)
    stack: bool = False  # a stack algorithm: the one-pass curve applies


def _checked(fn: Callable[..., SimOutput]) -> Callable[..., SimOutput]:
    """The one place kernels check the capacity (references check it in their shared PrefixCache)."""

    @functools.wraps(fn)
    def run(trace, capacity, options=None) -> SimOutput:
        if capacity <= 0:
            raise ValueError("capacity must be > 0 blocks")
        return fn(trace, capacity, options)

    return run


_REGISTRY: Registry[Policy] = Registry(__name__, "policy")


def policy(
    name: str, *, reference: Callable, needs: tuple[str, ...] = (), options: dict | None = None, stack: bool = False
):
    """Register `kernel` (the decorated function) and its pure-Python `reference` under `name`."""

    def wrap(kernel):
        summary = (kernel.__doc__ or name).strip().splitlines()[0]
        checked = _checked(kernel)
        _REGISTRY.add(name, Policy(name, summary, checked, reference, needs, options or {}, stack))
        return checked

    return wrap


registry = _REGISTRY.all
get = _REGISTRY.get
