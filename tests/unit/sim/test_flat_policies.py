"""The flat block policies of the sim backend: vllm, fifo, lfu, s3fifo (DESIGN.md sections 5, 7 and 10).

Each compiled kernel must agree exactly with its pure-Python reference; the references run here with checking
hooks (capacity, pinned blocks, queue bookkeeping, salt isolation), so every comparison also checks the
invariants along the way.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from kvbench.backends.sim import policies
from kvbench.backends.sim.policies import fifo, lfu, lru, s3fifo, vllm
from kvbench.backends.sim.prepared import prepare

from kvbench.schema import conform
from kvbench.traceio import read_trace

REPO = Path(__file__).resolve().parents[3]
MOONCAKE = REPO / "traces" / "mooncake" / "conversation_trace.parquet"
SAMPLES = sorted((REPO / "traces" / "samples").glob("*.parquet"))

MODULES = {"vllm": vllm, "fifo": fifo, "lfu": lfu, "s3fifo": s3fifo}
REFERENCE_CLASSES = {name: policies.get(name).cache for name in MODULES}
NAMES = list(MODULES)

# DESIGN.md section 10: fifo, Mooncake conversation trace, token-weighted, steady state (index >= N // 2)
FIFO_STEADY = {
    1000: 0.0457,
    3000: 0.0644,
    5859: 0.1283,
    10000: 0.1831,
    19531: 0.2663,
    30000: 0.3042,
    50000: 0.3483,
    100000: 0.3762,
}
# Long sample traces are cut to this many requests for the pure-Python references (time budget).
SAMPLE_REQUESTS = 400


# --- helpers ---------------------------------------------------------------------------------------------------
def prepared(table, block_size, name, **kw):
    return prepare(table, block_size, vllm_cap=name == "vllm", **kw)


def checked_reference(name, trace, capacity, options=None, same_tenant_hits=False):
    """Run the reference of `name` with invariant checks hooked into the shared request path."""
    base = REFERENCE_CLASSES[name]

    class Checked(base):
        def insert(self, key):
            super().insert(key)
            assert len(self.owner) <= self.capacity, "cache exceeds its capacity"

        def evict(self, key):
            if name == "vllm":
                assert key not in self.refs, "vllm evicted a block held by a running request"
            super().evict(key)

        def on_hit(self, key, pos):
            assert pos < self.trace.max_hit[self.request]
            if same_tenant_hits:
                assert self.owner[key] == self.trace.tenant[self.request], "a tenant hit another tenant's block"
            super().on_hit(key, pos)

        def after_request(self, keys):
            super().after_request(keys)
            assert len(self.owner) <= self.capacity
            if name == "vllm":
                assert not self.held and len(self.free) == len(self.owner)
            elif name == "fifo":
                assert len(self.queue) == len(self.owner)
            elif name == "lfu":
                assert len(self.freq) == len(self.owner)
            elif name == "s3fifo":
                assert len(self.small) + len(self.main) == len(self.owner)
                assert len(self.ghost) <= self.main_cap

    return Checked(trace, capacity, options).run()


def assert_same(a, b):
    np.testing.assert_array_equal(a.hit_blocks, b.hit_blocks)
    np.testing.assert_array_equal(a.evictions, b.evictions)
    np.testing.assert_array_equal(a.evict_matrix, b.evict_matrix)
    assert a.filled_at == b.filled_at


def check_output(trace, out):
    assert out.hit_blocks.shape == out.evictions.shape == (trace.n_requests,)
    assert (out.hit_blocks >= 0).all() and (out.hit_blocks <= trace.max_hit).all()
    assert out.evict_matrix.sum() == out.evictions.sum()


def steady_token_hit_rate(trace, out):
    hit_tokens = np.minimum(out.hit_blocks.astype(np.int64) * trace.block_size, trace.input_tokens)
    start = trace.n_requests // 2
    return hit_tokens[start:].sum() / trace.input_tokens[start:].sum()


def table_of(prompts, block_size=4, **columns):
    """A trace from (block ids, input_tokens) pairs; input_tokens defaults to whole blocks."""
    prompts = [(p, len(p) * block_size) if not isinstance(p, tuple) else p for p in prompts]
    n = len(prompts)
    cols = {
        "request_id": [f"r{i}" for i in range(n)],
        "arrival_s": [float(i) for i in range(n)],
        "input_tokens": [tokens for _, tokens in prompts],
        "output_tokens": [1] * n,
        "block_hashes": pa.array([list(ids) for ids, _ in prompts], pa.list_(pa.uint64())),
        **columns,
    }
    return conform(pa.table(cols))


def run_both(name, table, capacity, block_size=4, options=None):
    trace = prepared(table, block_size, name)
    out = MODULES[name].kernel(trace, capacity, options)
    assert_same(out, checked_reference(name, trace, capacity, options))
    return out


def lru_reversed_hits(trace, capacity):
    """vllm's definition as a stack algorithm, simulated independently: plain LRU where, after the lookup, the
    request's full blocks are referenced in reverse order (block 0 last), hits capped by max_hit."""
    stack: OrderedDict[int, None] = OrderedDict()  # least recent first
    hits = np.zeros(trace.n_requests, np.int32)
    for r in range(trace.n_requests):
        keys = trace.keys[trace.offsets[r] : trace.offsets[r + 1]].tolist()
        h = 0
        while h < trace.max_hit[r] and keys[h] in stack:
            h += 1
        hits[r] = h
        for key in reversed(keys[: trace.input_tokens[r] // trace.block_size]):
            if key in stack:
                stack.move_to_end(key)
            else:
                stack[key] = None
                if len(stack) > capacity:
                    stack.popitem(last=False)
    return hits


# --- fixtures ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def mooncake():
    table, meta = read_trace(MOONCAKE)
    return table, meta.block_size


@pytest.fixture(scope="module")
def mooncake_traces(mooncake):
    table, bs = mooncake
    return {cap: prepare(table, bs, vllm_cap=cap) for cap in (False, True)}


@pytest.fixture(scope="module")
def samples():
    out = {}
    for path in SAMPLES:
        table, meta = read_trace(path)
        out[path.stem] = (table.slice(0, SAMPLE_REQUESTS), meta.block_size)
    return out


# --- registry ----------------------------------------------------------------------------------------------------
def test_registered():
    for name, mod in MODULES.items():
        pol = policies.get(name)
        assert pol.kernel is mod.kernel and pol.reference is mod.reference
        assert pol.stack == (name == "vllm")
        assert pol.summary
    assert "small_fraction" in policies.get("s3fifo").options


@pytest.mark.parametrize("name", NAMES)
def test_capacity_must_be_positive(name):
    trace = prepared(table_of([[1, 2]]), 4, name)
    for run in (MODULES[name].kernel, MODULES[name].reference):
        with pytest.raises(ValueError):
            run(trace, 0)


# --- fifo reference numbers ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("capacity", sorted(FIFO_STEADY))
def test_fifo_mooncake_reference_numbers(mooncake_traces, capacity):
    trace = mooncake_traces[False]
    out = fifo.kernel(trace, capacity)
    check_output(trace, out)
    assert steady_token_hit_rate(trace, out) == pytest.approx(FIFO_STEADY[capacity], abs=5e-4)


@pytest.mark.parametrize("name", NAMES)
def test_unbounded_capacity_is_the_infinite_cache(mooncake_traces, samples, name):
    """A capacity far above the number of distinct blocks never evicts (and the queues are sized by the keys,
    not the capacity); on Mooncake every policy but vllm (which recomputes the last block) then gives the
    infinite-cache numbers."""
    trace = mooncake_traces[name == "vllm"]
    out = MODULES[name].kernel(trace, 10**9)
    assert out.filled_at == -1 and out.evictions.sum() == 0
    if name != "vllm":
        np.testing.assert_array_equal(out.hit_blocks, lru.kernel(trace, 10**9).hit_blocks)
        assert steady_token_hit_rate(trace, out) == pytest.approx(0.3981, abs=5e-5)
    table, bs = samples["chat"]
    small = prepared(table, bs, name)
    exact = MODULES[name].kernel(small, small.n_keys)
    assert_same(MODULES[name].kernel(small, 10**9), checked_reference(name, small, 10**9))
    np.testing.assert_array_equal(exact.hit_blocks, MODULES[name].kernel(small, 10**9).hit_blocks)


# --- kernel == reference -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("sample", [p.stem for p in SAMPLES])
def test_kernel_matches_reference_on_samples(samples, name, sample):
    table, bs = samples[sample]
    trace = prepared(table, bs, name)
    caps = [max(trace.n_keys // 10, 8)]
    if sample in ("chat", "reasoning", "multi-tenant"):
        caps.append(5)  # requests larger than the cache: self-eviction, vllm's full pool
    for cap in caps:
        out = MODULES[name].kernel(trace, cap)
        check_output(trace, out)
        assert_same(out, checked_reference(name, trace, cap))


@pytest.mark.parametrize("name", NAMES)
def test_kernel_matches_reference_on_mooncake(mooncake, mooncake_traces, name):
    trace = mooncake_traces[name == "vllm"]
    out = MODULES[name].kernel(trace, 5859)
    check_output(trace, out)
    assert out.filled_at >= 0 and out.evictions.sum() > 0
    assert_same(out, checked_reference(name, trace, 5859))
    table, bs = mooncake
    head = prepared(table.slice(0, 1500), bs, name)
    for cap in (32, 1000):
        assert_same(MODULES[name].kernel(head, cap), checked_reference(name, head, cap))


@pytest.mark.parametrize("name", NAMES)
def test_kernel_matches_reference_on_random_traces(name):
    """Small caches over a skewed random trace with three tenants, partial last blocks and shared prefixes:
    exercises every queue move (S3-FIFO promotion, ghost hits, second chances; LFU buckets; vllm's full pool)."""
    rng = np.random.default_rng(7)
    prompts, tenants = [], []
    for _ in range(1500):
        doc = int(rng.zipf(1.3)) % 60
        length = int(rng.integers(1, 7))
        ids = [doc * 100 + i for i in range(length)]
        prompts.append((ids, length * 4 - int(rng.integers(0, 4))))
        tenants.append(f"t{doc % 3}")
    table = table_of(prompts, tenant=tenants)
    for cap in (1, 2, 3, 10, 37, 120):
        out = run_both(name, table, cap)
        assert out.evict_matrix.shape == (3, 3)
    if name == "s3fifo":
        for fraction in (0.25, 0.5, 1.0):
            run_both(name, table, 37, options={"small_fraction": fraction})


# --- vllm ----------------------------------------------------------------------------------------------------------
def test_vllm_hits_capped_below_whole_prompt(samples, mooncake_traces):
    traces = [prepare(t, bs, vllm_cap=True) for t, bs in samples.values()] + [mooncake_traces[True]]
    for trace in traces:
        assert (trace.max_hit <= (trace.input_tokens - 1) // trace.block_size).all()
        for cap in (64, 4096):
            out = vllm.kernel(trace, cap)
            assert (out.hit_blocks <= trace.max_hit).all()
    # a prompt of whole blocks seen twice: vllm recomputes its last block, lru hits all of it
    table = table_of([[1, 2, 3], [1, 2, 3]])
    assert vllm.kernel(prepare(table, 4, vllm_cap=True), 10).hit_blocks.tolist() == [0, 2]
    assert lru.kernel(prepare(table, 4), 10).hit_blocks.tolist() == [0, 3]


@pytest.mark.parametrize("cap", [1, 5, 64, 1000])
def test_vllm_is_lru_with_reversed_reference_order(samples, cap):
    for table, bs in samples.values():
        trace = prepare(table, bs, vllm_cap=True)
        np.testing.assert_array_equal(vllm.kernel(trace, cap).hit_blocks, lru_reversed_hits(trace, cap))


def test_vllm_is_lru_with_reversed_reference_order_on_mooncake(mooncake_traces):
    trace = mooncake_traces[True]
    for cap in (1000, 10000):
        np.testing.assert_array_equal(vllm.kernel(trace, cap).hit_blocks, lru_reversed_hits(trace, cap))


def test_vllm_releases_tail_first():
    # 4 slots. r0 caches a0..a3 (its partial 5th block is not cached) and releases a3 first, so r1's two
    # blocks evict a3 and a2; r2 then still hits a0 a1. Forward-order lru loses a0 a1 (and caches partials).
    a, b = [10, 11, 12, 13, 14], [20, 21, 22]
    table = table_of([(a, 17), (b, 9), (a, 17)])
    out = run_both("vllm", table, 4)
    assert out.hit_blocks.tolist() == [0, 0, 2]
    assert out.evictions.tolist() == [0, 2, 2]
    assert lru.kernel(prepare(table, 4), 4).hit_blocks.tolist() == [0, 0, 0]


def test_vllm_does_not_cache_the_partial_last_block():
    # r0 = x0 + 1 token of x1: only x0 is cached. r1 holds x0 x1 as full blocks: x1 misses although r0 had it.
    table = table_of([([1, 2], 5), ([1, 2, 3], 12), ([1, 2, 3], 12)])
    out = run_both("vllm", table, 10)
    assert out.hit_blocks.tolist() == [0, 1, 2]  # r2: capped at 2 of 3 (last token recomputed)
    assert lru.kernel(prepare(table, 4), 10).hit_blocks.tolist() == [0, 2, 3]


def test_vllm_pins_the_running_request():
    # 3 slots. Free queue before r2: a0 (least recent), x1, x0. r2 hits a0, which is pinned: its two new
    # blocks evict x1 and x0 instead. Afterwards a0 still hits.
    table = table_of([([1], 5), ([2, 3], 9), ([1, 4, 5], 13), ([1], 5)])
    out = run_both("vllm", table, 3)
    assert out.hit_blocks.tolist() == [0, 0, 1, 1]
    assert out.evictions.tolist() == [0, 0, 2, 0]


def test_vllm_request_larger_than_the_cache():
    # 3 slots, 5 full blocks: the first 3 are held and cached, the rest of the request is not.
    table = table_of([([1, 2, 3, 4, 5, 6], 21)] * 2)
    out = run_both("vllm", table, 3)
    assert out.hit_blocks.tolist() == [0, 3]
    # lru (every block in order) ends with the last three cached and hits nothing
    assert lru.kernel(prepare(table, 4), 3).hit_blocks.tolist() == [0, 0]


# --- isolation -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_salted_tenants_never_hit_each_other(samples, name):
    table, bs = samples["multi-tenant"]
    salts = pa.array(table.column("tenant").to_pylist(), pa.string())
    table = table.set_column(table.schema.get_field_index("cache_salt"), "cache_salt", salts)
    trace = prepared(table, bs, name)
    # keys are disjoint between tenants ...
    pairs = np.unique(np.stack([trace.keys, np.repeat(trace.tenant, trace.n_blocks)]), axis=1)
    assert np.bincount(pairs[0]).max() == 1
    # ... so every hit is on a block the same tenant inserted
    cap = trace.n_keys // 4
    out = MODULES[name].kernel(trace, cap)
    assert out.hit_blocks.sum() > 0
    assert_same(out, checked_reference(name, trace, cap, same_tenant_hits=True))
    # without the salt the same trace does share blocks across tenants (the check above is not vacuous)
    open_trace = prepared(table, bs, name, use_salt=False)
    with pytest.raises(AssertionError, match="another tenant"):
        checked_reference(name, open_trace, open_trace.n_keys // 4, same_tenant_hits=True)


# --- policy sanity -------------------------------------------------------------------------------------------------
def _single_blocks(seq):
    return table_of([[ord(c)] for c in seq])


def test_fifo_hits_do_not_refresh():
    # 2 slots: A B, A hits, C evicts A (oldest insertion) although A was just used; lru evicts B instead.
    table = _single_blocks("ABACA")
    assert run_both("fifo", table, 2).hit_blocks.tolist() == [0, 0, 1, 0, 0]
    assert lru.kernel(prepare(table, 4), 2).hit_blocks.tolist() == [0, 0, 1, 0, 1]


def test_lfu_keeps_the_frequent_block():
    # 3 slots: A used 4 times, B and C once; D evicts B (lowest frequency, least recent of those), not A.
    table = _single_blocks("AAAABCDACB")
    assert run_both("lfu", table, 3).hit_blocks.tolist() == [0, 1, 1, 1, 0, 0, 0, 1, 1, 0]
    assert lru.kernel(prepare(table, 4), 3).hit_blocks.tolist() == [0, 1, 1, 1, 0, 0, 0, 0, 1, 0]


def test_lfu_frequency_restarts_after_eviction():
    # 2 slots: X reaches 3, B 2; C evicts B, B evicts C and comes back with frequency 1, so D evicts B, not X.
    table = _single_blocks("XXXBBCBDXB")
    assert run_both("lfu", table, 2).hit_blocks.tolist() == [0, 1, 1, 0, 1, 0, 0, 0, 1, 0]


def test_s3fifo_resists_a_scan():
    # 10 slots (S = 1, M = 9). H is used three times, then 30 one-off blocks pass: H moves to M when S is
    # first evicted and outlives the scan; lru and fifo lose it.
    prompts = [[1]] * 3 + [[100 + i] for i in range(30)] + [[1]]
    table = table_of(prompts)
    assert run_both("s3fifo", table, 10).hit_blocks[-1] == 1
    assert run_both("fifo", table, 10).hit_blocks[-1] == 0
    assert lru.kernel(prepare(table, 4), 10).hit_blocks[-1] == 0


def test_s3fifo_ghost_hit_goes_to_main():
    # 10 slots. X1..X10 fill the cache, Y evicts X1 into the ghost; X1 returns (miss, ghost hit -> M), then a
    # scan of 20 blocks: X1 survives in M, while X3 (evicted to the ghost and not back) does not.
    prompts = [[i] for i in range(1, 11)] + [[50], [1]] + [[100 + i] for i in range(20)] + [[1], [3]]
    out = run_both("s3fifo", table_of(prompts), 10)
    assert out.hit_blocks.tolist()[-2:] == [1, 0]
    assert out.hit_blocks[11] == 0  # the ghost holds no KV


def test_s3fifo_frequency_is_capped_at_3():
    # 10 slots (S = 1, M = 9). A is promoted to M, then used `extra` more times; rounds of churn (one-off
    # blocks that come back from the ghost into M) then cost A one second chance per pass over M. Each use
    # buys a pass up to 3 uses; more buy nothing.
    def a_survives(extra, rounds):
        prompts = [[1]] * 3 + [[i] for i in range(10, 20)] + [[1]] * extra
        prompts += [[100 + i % 12] for i in range(12 * rounds)] + [[1]]
        return run_both("s3fifo", table_of(prompts), 10).hit_blocks[-1] == 1

    assert [a_survives(extra, 5) for extra in (0, 2, 3, 10)] == [False, False, True, True]
    assert [a_survives(extra, 6) for extra in (3, 4, 10)] == [False, False, False]
