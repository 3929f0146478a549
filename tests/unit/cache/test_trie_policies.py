"""The trie policies of the sim backend: every registered policy whose reference is a trie (radix-lru, belady,
priority-lru, tenant-quota; the flat ones are test_flat_policies.py's), taken from the registry, so a policy is
tested here by being registered (docs/semantics.md: Policies, Hit rates, Reference figures).

Every compiled kernel must agree exactly with its pure-Python reference. The references run here with an
audit that keeps its own copy of the cache from the insert/evict events and checks, at every step, what the
policy may never do: report a hit on a block that is not cached, evict a block of the running request or a
block with cached children, exceed the capacity or a tenant's quota.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from kvbench.cache import policies
from kvbench.cache.policies import tenant_quota
from kvbench.cache.prepared import PreparedTrace, prepare
from kvbench.cache.trie import TrieReference
from kvbench.trace.files import read_trace
from kvbench.trace.schema import conform

REPO = Path(__file__).resolve().parents[3]
MOONCAKE = REPO / "traces" / "mooncake" / "conversation_trace.parquet"
SAMPLES = sorted((REPO / "traces" / "samples").glob("*.parquet"))
REFERENCE_CLASSES = {name: p.cache for name, p in policies.registry().items() if issubclass(p.cache, TrieReference)}

# docs/semantics.md, Reference figures / shared/reference/mooncake_conversation.json: Mooncake conversation
# trace, 512-token blocks, token-weighted hit rate (steady = requests with index >= N // 2), block hit rate over
# all requests
RADIX_STEADY = {
    1000: 0.0467,
    3000: 0.0669,
    5859: 0.1367,
    10000: 0.2195,
    19531: 0.2997,
    30000: 0.3438,
    50000: 0.3767,
    100000: 0.3922,
}
RADIX_ALL = {1000: 0.0454, 3000: 0.0666, 5859: 0.1387, 10000: 0.2157, 30000: 0.3322, 50000: 0.3615, 100000: 0.3708}
RADIX_BLOCK_ALL = {
    1000: 0.0445,
    3000: 0.0653,
    5859: 0.1361,
    10000: 0.2116,
    30000: 0.3257,
    50000: 0.3546,
    100000: 0.3637,
}
BELADY_STEADY = {
    1000: 0.1970,
    3000: 0.3096,
    5859: 0.3762,
    10000: 0.3981,
    19531: 0.3981,
    30000: 0.3981,
    50000: 0.3981,
    100000: 0.3981,
}


@cache
def load(path: Path, vllm_cap: bool = False) -> PreparedTrace:
    table, meta = read_trace(path)
    return prepare(table, meta.block_size, vllm_cap=vllm_cap)


def sample(stem: str) -> PreparedTrace:
    return load(REPO / "traces" / "samples" / f"{stem}.parquet")


@pytest.fixture(scope="module")
def mooncake() -> PreparedTrace:
    if not MOONCAKE.exists():
        pytest.skip(f"{MOONCAKE} not present")
    return load(MOONCAKE)


def token_rate(trace, out, start: int = 0) -> float:
    hit = np.minimum(out.hit_blocks.astype(np.int64) * trace.block_size, trace.input_tokens)
    return float(hit[start:].sum() / trace.input_tokens[start:].sum())


def has_tenants(trace) -> bool:
    return trace.tenant_names != ["(none)"]


# --- the audit -------------------------------------------------------------------------------------------


def audited(name: str):
    """The reference class of `name`, checking the invariants of every trie policy as it runs."""

    class Audited(REFERENCE_CLASSES[name]):
        def __init__(self, trace, capacity, options=None):
            super().__init__(trace, capacity, options)
            self.shadow: dict[int, int] = {}  # cached key -> owner, from the insert/evict events alone
            self.kids = [0] * trace.n_keys  # cached children per key, from the same events
            self.held = [0] * len(trace.tenant_names)  # cached blocks per owner
            self.peak = [0] * len(trace.tenant_names)
            self.quota_of = tenant_quota.quotas(trace, capacity, options) if name == "tenant-quota" else None
            self.victims: list[int] = []
            self.skipped = 0
            self._running = (-1, set())

        def running(self) -> set[int]:
            if self._running[0] != self.request:
                t, r = self.trace, self.request
                self._running = (r, set(t.keys[t.offsets[r] : t.offsets[r + 1]].tolist()))
            return self._running[1]

        def on_hit(self, key, pos):
            assert key in self.shadow, f"request {self.request} hit key {key}, which is not cached"
            super().on_hit(key, pos)

        def admit(self, key, pos):
            r = self.request
            if pos == self.out.hit_blocks[r] and pos < self.trace.max_hit[r]:  # the lookup stopped here
                assert key not in self.shadow, "a cached block after the hit prefix was not counted as a hit"
            return super().admit(key, pos)

        def on_skip(self, key, pos):
            assert key in self.shadow
            self.skipped += 1
            super().on_skip(key, pos)

        def insert(self, key):
            p = int(self.trace.parent[key])
            assert key not in self.shadow and (p < 0 or p in self.shadow), "inserted below an uncached parent"
            super().insert(key)
            owner = int(self.trace.tenant[self.request])
            self.shadow[key] = owner
            self.held[owner] += 1
            self.peak[owner] = max(self.peak[owner], self.held[owner])
            if p >= 0:
                self.kids[p] += 1
            assert len(self.shadow) <= self.capacity
            if self.quota_of is not None:
                assert self.held[owner] <= self.quota_of[owner], f"tenant {owner} went over its quota"

        def evict(self, key):
            assert key in self.shadow, "evicted a block that is not cached"
            assert key not in self.running(), f"request {self.request} evicted its own block {key}"
            assert self.kids[key] == 0, f"evicted key {key}, which has cached children"
            super().evict(key)
            self.held[self.shadow.pop(key)] -= 1
            p = int(self.trace.parent[key])
            if p >= 0:
                self.kids[p] -= 1
            self.victims.append(key)

    return Audited


def run_audited(name, trace, capacity, options=None):
    cache = audited(name)(trace, capacity, options)
    return cache.run(), cache


def assert_same(a, b):
    np.testing.assert_array_equal(a.hit_blocks, b.hit_blocks)
    np.testing.assert_array_equal(a.evictions, b.evictions)
    np.testing.assert_array_equal(a.evict_matrix, b.evict_matrix)
    assert a.filled_at == b.filled_at


# --- docs/semantics.md, Reference figures -------------------------------------------------------------


def test_radix_lru_reproduces_the_reference_numbers(mooncake):
    kernel = policies.get("radix-lru").kernel
    steady = mooncake.n_requests // 2
    for capacity, expected in RADIX_STEADY.items():
        out = kernel(mooncake, capacity)
        got = (token_rate(mooncake, out, steady), token_rate(mooncake, out), out.hit_blocks.sum() / mooncake.keys.size)
        print(f"radix-lru {capacity:>6}: steady {got[0]:.4f} all {got[1]:.4f} block_all {got[2]:.4f}")
        assert got[0] == pytest.approx(expected, abs=5e-4)
        if capacity in RADIX_ALL:
            assert got[1] == pytest.approx(RADIX_ALL[capacity], abs=5e-4)
            assert got[2] == pytest.approx(RADIX_BLOCK_ALL[capacity], abs=5e-4)


def test_belady_reproduces_the_reference_numbers(mooncake):
    kernel = policies.get("belady").kernel
    steady = mooncake.n_requests // 2
    for capacity, expected in BELADY_STEADY.items():
        got = token_rate(mooncake, kernel(mooncake, capacity), steady)
        print(f"belady {capacity:>6}: steady {got:.4f}")
        assert got == pytest.approx(expected, abs=5e-4)


# --- kernel == reference, with the audit ----------------------------------------------------------------

QUOTAS = {"*": 0.05}  # and the busiest tenant gets a third of the cache, the second busiest 100 blocks
# options a policy needs on the samples ("quotas": quota_options of the trace); the rest run with their defaults
SAMPLE_OPTIONS = {"tenant-quota": "quotas"}


def cases():
    """Every registered trie policy on every sample it can run on (one that needs tenants, on the samples that
    have several), and a few option variants."""
    for path in SAMPLES:
        for name in REFERENCE_CLASSES:
            if "tenant" in policies.get(name).needs and not has_tenants(load(path)):
                continue
            yield pytest.param(path, name, SAMPLE_OPTIONS.get(name), id=f"{path.stem}-{name}")
        if path.stem in ("mix", "multi-tenant"):
            yield pytest.param(
                path, "priority-lru", {"priority_duration_requests": 20}, id=f"{path.stem}-priority-lru-expiring"
            )


def quota_options(trace):
    blocks = np.bincount(trace.tenant, weights=trace.n_blocks, minlength=len(trace.tenant_names))
    busiest = np.argsort(-blocks)
    return {"quota": {**QUOTAS, trace.tenant_names[busiest[0]]: 1 / 3, trace.tenant_names[busiest[1]]: 100}}


@pytest.mark.parametrize("path,name,options", list(cases()))
def test_kernel_matches_the_audited_reference_on_samples(path, name, options):
    trace = load(path)
    if options == "quotas":
        options = quota_options(trace)
    capacity = trace.n_keys // 5
    ref, cache = run_audited(name, trace, capacity, options)
    assert_same(policies.get(name).kernel(trace, capacity, options), ref)
    assert ref.evictions.sum() > 0  # the comparison covered eviction
    if name == "tenant-quota":  # the quotas bound someone
        assert any(cache.peak[t] == q for t, q in enumerate(cache.quota_of) if q < capacity)


def random_prompts(rng, n: int) -> list[list[int]]:
    """Prompts that share prefixes the way conversations and agents do: a request continues a random earlier
    prompt (cut at a random point, or whole: an exact repeat) with a few new blocks, or starts afresh. New
    blocks get fresh ids, so ids stay prefix-chained."""
    prompts: list[list[int]] = []
    fresh = 0
    for _ in range(n):
        base = prompts[rng.integers(len(prompts))] if prompts and rng.random() < 0.8 else []
        path = base[: rng.integers(len(base) + 1)] if rng.random() < 0.7 else list(base)
        for _ in range(rng.integers(0 if path else 1, 6)):
            path.append(fresh)
            fresh += 1
        prompts.append(path)
    return prompts


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("vllm_cap", [False, True])
@pytest.mark.parametrize("name", list(REFERENCE_CLASSES))
def test_kernel_matches_the_audited_reference_on_random_tries(name, vllm_cap, seed):
    """Small random tries with exact repeats: under vLLM's hit cap a repeated prompt's last block is cached
    beyond the hit prefix, so it is skipped and insertion goes on."""
    rng = np.random.default_rng(seed)
    prompts = random_prompts(rng, 400)
    trace = synthetic(
        prompts,
        priority=rng.choice([10, 35, 80], len(prompts)).tolist(),
        tenant=rng.choice(list("abc"), len(prompts)).tolist(),
        vllm_cap=vllm_cap,
    )
    options = {"priority-lru": {"priority_duration_requests": 30}, "tenant-quota": {"quota": {"a": 0.2, "b": 0.5}}}
    for capacity in (3, trace.n_keys // 8, trace.n_keys // 2):
        ref, cache = run_audited(name, trace, capacity, options.get(name))
        assert_same(policies.get(name).kernel(trace, capacity, options.get(name)), ref)
        assert cache.skipped > 0 or not vllm_cap or capacity == 3


@pytest.mark.parametrize("capacity", [1000, 30000])
@pytest.mark.parametrize("name", [n for n in REFERENCE_CLASSES if "tenant" not in policies.get(n).needs])
def test_kernel_matches_the_audited_reference_on_mooncake(mooncake, name, capacity):
    ref, _ = run_audited(name, mooncake, capacity)
    assert_same(policies.get(name).kernel(mooncake, capacity), ref)


# --- what the policies mean -----------------------------------------------------------------------------


def runnable(trace):
    for name, policy in policies.registry().items():
        if "tenant" in policy.needs and not has_tenants(trace):
            continue
        if set(policy.needs) - {"tenant"}:
            continue  # a column this test does not know how to check for
        if not policy.blocks:
            continue  # Belady bounds block caches; a slot cache's capacity is a context, not blocks
        yield name, policy


@pytest.mark.parametrize("which", ["mix", "mooncake"])
def test_belady_is_an_upper_bound_of_every_registered_policy(which, request):
    trace = request.getfixturevalue("mooncake") if which == "mooncake" else sample(which)
    for capacity in (trace.n_keys // 200, trace.n_keys // 50, trace.n_keys // 10, trace.n_keys // 3):
        rates = {name: token_rate(trace, policy.kernel(trace, capacity)) for name, policy in runnable(trace)}
        assert len(rates) > 3
        best = max(rates, key=rates.get)
        assert rates["belady"] >= rates[best], (capacity, rates)


def synthetic(prompts: list[list[int]], priority=None, tenant=None, vllm_cap=False) -> PreparedTrace:
    """A prepared trace from prompts of block ids, numbered in order of first appearance (so key == id) and
    prefix-chained (each id always follows the same one). Built through `prepare`, as real traces are."""
    n = len(prompts)
    cols = {
        "request_id": [f"r{i}" for i in range(n)],
        "arrival_s": [float(i) for i in range(n)],
        "input_tokens": [4 * len(p) for p in prompts],
        "output_tokens": [1] * n,
        "block_hashes": pa.array(prompts, pa.list_(pa.uint64())),
    }
    if priority is not None:
        cols["priority"] = pa.array(priority, pa.int8())
    if tenant is not None:
        cols["tenant"] = tenant
    return prepare(conform(pa.table(cols)), 4, vllm_cap=vllm_cap)


def both(name, trace, capacity, options=None):
    out = policies.get(name).kernel(trace, capacity, options)
    ref, cache = run_audited(name, trace, capacity, options)
    assert_same(out, ref)
    return out, cache


def test_radix_lru_evicts_leaves_first_and_touches_only_the_hit_prefix():
    # 0-1-2 then 0-3: the shared root 0 stays while the leaves 2 and 1 go
    out, cache = both("radix-lru", synthetic([[0, 1, 2], [0, 3], [4], [5], [0, 3]]), 4)
    assert cache.victims == [2, 1]
    assert out.hit_blocks.tolist() == [0, 1, 0, 0, 2]


def test_belady_bypasses_and_breaks_ties_by_the_larger_key():
    # at request 2 the leaves 1 and 2 are never used again: the larger key goes first; request 3's block 4 is
    # never used again either, so it is not worth a victim (bypass)
    trace = synthetic([[0, 1], [0, 2], [3], [4], [3], [0]])
    out, cache = both("belady", trace, 3)
    assert cache.victims == [2]
    assert out.hit_blocks.tolist() == [0, 1, 0, 0, 1, 1]


def test_priority_lru_keeps_a_high_priority_block_while_a_lower_priority_leaf_exists():
    prompts, priority = [[0], [1], [2], [3], [4], [0]], [80, 35, 35, 35, 35, 35]
    out, cache = both("priority-lru", synthetic(prompts, priority), 3)
    assert cache.victims == [1, 2] and out.hit_blocks[-1] == 1
    out, _ = both("radix-lru", synthetic(prompts, priority), 3)
    assert out.hit_blocks[-1] == 0  # plain LRU loses it
    # once its priority has expired (two requests after its use) it is an ordinary block again
    out, cache = both("priority-lru", synthetic(prompts, priority), 3, {"priority_duration_requests": 2})
    assert cache.victims[0] == 1 and out.hit_blocks[-1] == 0


def test_priority_lru_evicts_the_lowest_priority_least_recent_leaf():
    trace = sample("multi-tenant")
    trace = PreparedTrace(
        block_size=trace.block_size,
        offsets=trace.offsets[:301],
        keys=trace.keys,
        parent=trace.parent,
        input_tokens=trace.input_tokens[:300],
        max_hit=trace.max_hit[:300],
        tenant=trace.tenant[:300],
        tenant_names=trace.tenant_names,
        priority=trace.priority[:300],
    )
    assert len(set(trace.priority.tolist())) > 1

    class Checked(audited("priority-lru")):
        def evict(self, key):
            running = self.running()
            leaves = [k for k in self.shadow if self.kids[k] == 0 and k not in running]
            assert min(leaves, key=self.rank) == key
            super().evict(key)

    ref = Checked(trace, trace.n_keys // 30, {"priority_duration_requests": 40}).run()
    assert ref.evictions.sum() > 100


def test_priority_lru_with_instant_expiry_is_radix_lru():
    trace = sample("multi-tenant")
    capacity = trace.n_keys // 10
    assert_same(
        policies.get("priority-lru").kernel(trace, capacity, {"priority_duration_requests": 0}),
        policies.get("radix-lru").kernel(trace, capacity),
    )


def test_priority_duration_in_seconds_follows_arrival_times():
    # synthetic() spaces arrivals 1 s apart, so 3 s of trace time is 3 requests
    trace = synthetic([[0], [1], [2], [3], [4], [0], [1]], priority=[90, 10, 10, 10, 10, 10, 10])
    by_seconds, _ = both("priority-lru", trace, 3, {"priority_duration_s": 3.0})
    by_requests, _ = both("priority-lru", trace, 3, {"priority_duration_requests": 3})
    assert by_seconds.hit_blocks.tolist() == by_requests.hit_blocks.tolist()
    with pytest.raises(ValueError, match="not both"):
        policies.get("priority-lru").kernel(trace, 3, {"priority_duration_s": 3.0, "priority_duration_requests": 3})


def test_tenant_quota_caps_each_tenant_and_takes_from_tenants_at_quota_first():
    # tenant b may hold 2 blocks: its third insertion evicts its own LRU leaf, not a's older block 0
    trace = synthetic([[0], [1], [2], [3], [4], [0]], tenant=list("abbbaa"))
    assert trace.tenant_names == ["a", "b"]
    out, cache = both("tenant-quota", trace, 3, {"quota": {"b": 2}})
    assert cache.victims == [1, 2] and out.hit_blocks[-1] == 1
    # rows evictor, columns victim: b evicted its own block, a's insertion into a full cache took b's (at quota)
    assert out.evict_matrix.tolist() == [[0, 1], [0, 1]]
    out, _ = both("tenant-quota", trace, 3)  # no quota: plain leaf LRU evicts tenant a's block 0
    assert out.hit_blocks[-1] == 0


def test_tenant_quota_options():
    trace = synthetic([[0], [1], [2]], tenant=list("abc"))
    q = tenant_quota.quotas(trace, 1000, {"quota": {"a": 0.25, "b": 10, "*": 1.0}})
    assert q.tolist() == [250, 10, 1000]
    assert tenant_quota.quotas(trace, 1000, None).tolist() == [1000, 1000, 1000]
    with pytest.raises(ValueError, match="not in the trace"):
        tenant_quota.quotas(trace, 1000, {"quota": {"z": 1}})
    with pytest.raises(ValueError):
        tenant_quota.quotas(trace, 1000, {"quota": {"a": 2.5}})
    assert policies.get("tenant-quota").needs == ("tenant",)
