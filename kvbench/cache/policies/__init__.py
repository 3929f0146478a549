"""Eviction policies of the `sim` backend. Each module registers one policy with `@policy`; none is listed
by hand. A policy provides two implementations of the same update rule (docs/semantics.md, Policies):

- `kernel(trace, capacity, options) -> SimOutput`: the compiled (numba) hot loop used for real runs;
- `reference(trace, capacity, options) -> SimOutput`: a readable pure-Python version built on
  `kvbench.cache.reference.PrefixCache`, which writes the request path (lookup with the prefix rule, then the update)
  once. Tests check the two agree on every sample trace.

Both see requests strictly one at a time in arrival order: first the lookup (the longest cached prefix,
capped at `trace.max_hit[i]`), then the cache update.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvbench.cache.densify import scratch
from kvbench.cache.prepared import PreparedTrace
from kvbench.errors import KvbenchError
from kvbench.registry import Registry


@dataclass
class SimOutput:
    hit_blocks: np.ndarray  # int32[n]: leading blocks of each request found in the cache (prefix rule)
    evictions: np.ndarray  # int32[n]: blocks evicted by each request's insertions
    evict_matrix: np.ndarray  # int64[T, T]: [evictor tenant, victim tenant] -> blocks evicted
    filled_at: int  # first request index after which the cache was full; -1 if it never filled
    # int64[n]: cached tokens of each request, for a policy that reuses token by token (llama-slot with its
    # prompts' tokens); None: hit_blocks x block size (capped at the prompt) is the count
    hit_tokens: np.ndarray | None = None

    @classmethod
    def empty(cls, trace: PreparedTrace) -> SimOutput:
        t = len(trace.tenant_names)
        n = trace.n_requests
        return cls(np.zeros(n, np.int32), np.zeros(n, np.int32), np.zeros((t, t), np.int64), -1)


# Layout of the int64 `state` array that resumable kernels carry from one chunk of a trace to the next.
STARTED, SIZE, TAIL, FILLED_AT, FIRST_REQUEST = range(5)
STATE_FIELDS = 5
UNCACHED = np.uint32(0xFFFFFFFF)  # `link` value of a key that is not cached (the kernels' _NONE)


class Carry:
    """A policy's cache carried across chunks of one trace, for traces streamed in bounded memory. Keys are
    ids in [0, n_ids): the streaming driver gives an id to each block it meets and, between chunks, takes
    back the ids that `cached()` reports False (so only policies whose state is nil for uncached blocks can
    carry). `reuse_buffers` takes the work arrays from the per-thread scratch pool (one run at a time)."""

    def __init__(self, n_ids: int, tenant_names: list[str], capacity: int, reuse_buffers=False):
        self.n_ids, self.n_tenants, self.capacity = n_ids, len(tenant_names), capacity
        self.state = np.zeros(STATE_FIELDS, np.int64)
        self._reuse = reuse_buffers

    def buffer(self, name: str, size: int, dtype) -> np.ndarray:
        return scratch(name, size, dtype) if self._reuse else np.empty(max(size, 1), dtype)[:size]

    def feed(self, chunk: PreparedTrace) -> SimOutput:  # the next requests, in order
        raise NotImplementedError

    def cached(self) -> np.ndarray:
        """bool[n_ids]. The compiled carries keep their recency list in `self.link` (prev of key k at 2k,
        UNCACHED when k is not cached); a carry with other state overrides this."""
        return self.link[0 : 2 * self.n_ids : 2] != UNCACHED

    @classmethod
    def run(cls, trace: PreparedTrace, capacity: int, options=None) -> SimOutput:
        """The whole trace in one chunk, with dense keys: the in-memory kernel."""
        return cls(trace.n_keys, trace.tenant_names, capacity, reuse_buffers=True).feed(trace)


@dataclass(frozen=True)
class Policy:
    name: str
    summary: str
    kernel: Callable[..., SimOutput]
    reference: Callable[..., SimOutput]
    needs: tuple[str, ...] = ()  # trace columns the policy cannot work without (e.g. "tenant")
    # the options it takes: a dataclass of `kvbench.options.option` fields (help, unit, bounds), or None
    options: type | None = None
    stack: bool = False  # a stack algorithm: the one-pass curve applies
    carry: type[Carry] | None = None  # resumable form, for traces streamed in bounded memory
    # the reference as a PrefixCache class: begin/end per request, for callers whose requests overlap in time
    # (engine-sim); `reference` runs it over a whole trace
    cache: type | None = None
    # for a policy that needs more of the trace than its block keys (llama-slot: the prompts' tokens):
    # extend(table, block_size, options, prepared) -> the prepared trace it runs on (`--backend sim` calls it)
    extend: Callable | None = None
    # a block cache (inserts, hits and evicts blocks one by one): the torch backend can store its KV and the
    # block-cache properties hold (an unbounded one is the infinite cache); llama-slot keeps token sequences
    blocks: bool = True


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
    name: str,
    *,
    reference: Callable,
    needs: tuple[str, ...] = (),
    options: type | None = None,
    stack: bool = False,
    carry: type[Carry] | None = None,
    cache: type | None = None,
    extend: Callable | None = None,
    blocks: bool = True,
):
    """Register `kernel` (the decorated function) and its pure-Python `reference` under `name`."""

    def wrap(kernel):
        summary = (kernel.__doc__ or name).strip().splitlines()[0]
        checked = _checked(kernel)
        pol = Policy(name, summary, checked, reference, needs, options, stack, carry, cache, extend, blocks)
        _REGISTRY.add(name, pol)
        return checked

    return wrap


def option_fields(pol: Policy) -> tuple[dataclasses.Field, ...]:
    """The fields of the options `pol` takes (none for most policies)."""
    return dataclasses.fields(pol.options) if pol.options is not None else ()


registry = _REGISTRY.all
get = _REGISTRY.get


def parse_names(spec) -> list[str]:
    """`--policy a,b` as a list of registered policy names; an unknown one is an error that lists the choices."""
    known = registry()
    names = [p.strip() for p in str(spec).split(",") if p.strip()]
    for p in names:
        if p not in known:
            raise KvbenchError(f"unknown policy {p!r}; choose from: {', '.join(known)}")
    if not names:
        raise KvbenchError(f"--policy {spec!r} names no policy; choose from: {', '.join(known)}")
    return names
