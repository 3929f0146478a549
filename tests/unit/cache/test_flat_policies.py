"""The flat block policies of the sim backend: every registered policy whose reference is not a trie (lru, vllm,
fifo, lfu, s3fifo; the trie ones are test_trie_policies.py's), taken from the registry, so a policy is tested
here by being registered (docs/semantics.md: Policies, Hit rates, Reference figures).

Each compiled kernel must agree exactly with its pure-Python reference; the references run here with checking
hooks (capacity, pinned blocks, queue bookkeeping, salt isolation), so every comparison also checks the
invariants along the way.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from kvbench.cache import policies
from kvbench.cache.policies import fifo, lru, vllm
from kvbench.cache.prepared import prepare
from kvbench.cache.trie import TrieReference
from kvbench.trace.files import read_trace
from kvbench.trace.schema import conform

REPO = Path(__file__).resolve().parents[3]
MOONCAKE = REPO / "traces" / "mooncake" / "conversation_trace.parquet"
SAMPLES = sorted((REPO / "traces" / "samples").glob("*.parquet"))

NAMES = [name for name, p in policies.registry().items() if not issubclass(p.cache, TrieReference)]
# block caches: a request hits leading blocks, and what it inserts is evicted block by block (llama-slot keeps
# token sequences per slot instead: its own tests, tests/unit/cache/test_llama_slot.py)
BLOCK_NAMES = [name for name in NAMES if policies.get(name).blocks]
REFERENCE_CLASSES = {name: policies.get(name).cache for name in NAMES}


def kernel(name):
    return policies.get(name).kernel


# docs/semantics.md, Reference figures: fifo, Mooncake conversation trace, token-weighted, steady state
# (index >= N // 2)
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
                assert all(self.refs[s] == 0 for s in self.copies.get(key, [])), "vllm evicted a held block"
            super().evict(key)

        def on_hit(self, key, pos):
            assert pos < self.trace.max_hit[self.request]
            if same_tenant_hits:
                assert self.owner[key] == self.trace.tenant[self.request], "a tenant hit another tenant's block"
            super().on_hit(key, pos)

        def end(self, r):
            super().end(r)
            assert len(self.owner) <= self.capacity
            if name == "vllm":  # every slot but the null block is free again (or never used), each key has a slot
                made = len(self.slot_key) - 2
                assert not self.held and len(self.free) - (self.fresh > 0) == made
                assert made + self.fresh == self.capacity - 1 and len(self.copies) == len(self.owner)
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
    out = kernel(name)(trace, capacity, options)
    assert_same(out, checked_reference(name, trace, capacity, options))
    return out


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
    assert {"lru", "vllm", "fifo", "lfu", "s3fifo"} <= set(NAMES)
    for name in NAMES:
        pol = policies.get(name)
        assert callable(pol.kernel) and callable(pol.reference) and pol.summary, name
    assert [name for name in policies.registry() if policies.get(name).stack] == ["lru"]  # the one-pass curve
    assert [f.name for f in policies.option_fields(policies.get("s3fifo"))] == ["small_fraction"]


@pytest.mark.parametrize("name", NAMES)
def test_capacity_must_be_positive(name):
    trace = prepared(table_of([[1, 2]]), 4, name)
    for run in (kernel(name), policies.get(name).reference):
        with pytest.raises(ValueError):
            run(trace, 0)


# --- fifo reference numbers ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("capacity", sorted(FIFO_STEADY))
def test_fifo_mooncake_reference_numbers(mooncake_traces, capacity):
    trace = mooncake_traces[False]
    out = fifo.kernel(trace, capacity)
    check_output(trace, out)
    assert steady_token_hit_rate(trace, out) == pytest.approx(FIFO_STEADY[capacity], abs=5e-4)


@pytest.mark.parametrize("name", BLOCK_NAMES)
def test_unbounded_capacity_is_the_infinite_cache(mooncake_traces, samples, name):
    """A capacity far above the number of distinct blocks never evicts (and the queues are sized by the keys,
    not the capacity); on Mooncake every policy but vllm (which recomputes the last block) then gives the
    infinite-cache numbers."""
    trace = mooncake_traces[name == "vllm"]
    out = kernel(name)(trace, 10**9)
    assert out.filled_at == -1 and out.evictions.sum() == 0
    if name != "vllm":
        np.testing.assert_array_equal(out.hit_blocks, lru.kernel(trace, 10**9).hit_blocks)
        assert steady_token_hit_rate(trace, out) == pytest.approx(0.3981, abs=5e-5)
    table, bs = samples["chat"]
    small = prepared(table, bs, name)
    # vllm's pool also holds generated tokens' blocks and duplicates: it never evicts with a slot for every block
    # any request takes (and the null block)
    enough = small.n_keys if name != "vllm" else int((-(-small.kv_tokens() // bs)).sum()) + 1
    exact = kernel(name)(small, enough)
    assert_same(kernel(name)(small, 10**9), checked_reference(name, small, 10**9))
    np.testing.assert_array_equal(exact.hit_blocks, kernel(name)(small, 10**9).hit_blocks)


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
        out = kernel(name)(trace, cap)
        check_output(trace, out)
        assert_same(out, checked_reference(name, trace, cap))


@pytest.mark.parametrize("name", BLOCK_NAMES)
def test_kernel_matches_reference_on_mooncake(mooncake, mooncake_traces, name):
    trace = mooncake_traces[name == "vllm"]
    out = kernel(name)(trace, 5859)
    check_output(trace, out)
    assert out.filled_at >= 0 and out.evictions.sum() > 0
    assert_same(out, checked_reference(name, trace, 5859))
    table, bs = mooncake
    head = prepared(table.slice(0, 1500), bs, name)
    for cap in (32, 1000):
        assert_same(kernel(name)(head, cap), checked_reference(name, head, cap))


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


def test_vllm_releases_tail_first():
    # capacity 6 = the null block + 5 slots. r0 (17 tokens: a0..a3 full, a partial 5th block) takes all 5; at
    # the end its unhashed partial block goes to the head of the free queue and a3, a2, a1, a0 to the tail:
    # [p, a3, a2, a1, a0]. r1 (b0 b1 + a partial) takes p, a3, a2: 2 evictions; queue [p', a1, a0, b1, b0].
    # r2 (a again) hits a0 a1 and takes p', b1, b0: 2 evictions. Forward-order lru keeps nothing of a.
    a, b = [10, 11, 12, 13, 14], [20, 21, 22]
    table = table_of([(a, 17), (b, 9), (a, 17)])
    out = run_both("vllm", table, 6)
    assert out.hit_blocks.tolist() == [0, 0, 2]
    assert out.evictions.tolist() == [0, 2, 2]
    assert lru.kernel(prepare(table, 4), 5).hit_blocks.tolist() == [0, 0, 0]


def test_vllm_does_not_cache_the_partial_last_block():
    # r0 = x0 + 1 token of x1: only x0 is cached. r1 holds x0 x1 as full blocks: x1 misses although r0 had it.
    table = table_of([([1, 2], 5), ([1, 2, 3], 12), ([1, 2, 3], 12)])
    out = run_both("vllm", table, 10)
    assert out.hit_blocks.tolist() == [0, 1, 2]  # r2: capped at 2 of 3 (last token recomputed)
    assert lru.kernel(prepare(table, 4), 10).hit_blocks.tolist() == [0, 2, 3]


def test_vllm_null_block_generated_tokens_and_duplicates():
    # capacity 4 = null + 3 slots, 4-token blocks.
    # r0: prompt k1 k2 (8 tokens), 5 output tokens: KV for 8 + 5 - 1 = 12 tokens = 3 blocks, the third full of
    #     generated tokens (hashed, never asked for). Released tail-first: queue [g, k2, k1].
    # r1: k1 k2 again: the hit is capped at (8 - 1) // 4 = 1 block; k2 is computed again into a new slot (g's,
    #     which evicts no trace block): k2 now has two copies. Queue [k2, k2', k1].
    # r2: k3 (4 tokens): takes the old copy of k2, which stays cached through k2'. No eviction.
    # r3: k1 k2 k5: hits k1 k2 (capped at 2), takes k3's slot: 1 eviction.
    table = table_of([[1, 2], [1, 2], [3], [1, 2, 5]], output_tokens=[5, 1, 1, 1])
    out = run_both("vllm", table, 4)
    assert out.hit_blocks.tolist() == [0, 1, 0, 2]
    assert out.evictions.tolist() == [0, 0, 0, 1]
    # a capacity of 1 is the null block alone: nothing is cached
    assert run_both("vllm", table, 1).hit_blocks.tolist() == [0, 0, 0, 0]


def test_vllm_pins_the_running_request():
    # capacity 4 (3 slots), whole-block prompts. r0: k1 → queue [_, _, k1] (the two never-used slots first).
    # r1: k2 k3 take both unused slots → queue [k1, k3, k2]. r2: k1 k4 k5 hits k1 (pinned: off the queue), its
    # two new blocks evict k3 and k2, not k1; queue [k5, k4, k1]. r3: k1 k6 hits k1 still, evicts k5.
    table = table_of([[1], [2, 3], [1, 4, 5], [1, 6]])
    out = run_both("vllm", table, 4)
    assert out.hit_blocks.tolist() == [0, 0, 1, 1]
    assert out.evictions.tolist() == [0, 0, 2, 1]


def test_vllm_request_larger_than_the_cache():
    # capacity 4 (3 slots), 5 full blocks: the first 3 are held and cached, the rest of the request is not.
    table = table_of([([1, 2, 3, 4, 5, 6], 21)] * 2)
    out = run_both("vllm", table, 4)
    assert out.hit_blocks.tolist() == [0, 3]
    # lru (every block in order) ends with the last three cached and hits nothing
    assert lru.kernel(prepare(table, 4), 3).hit_blocks.tolist() == [0, 0]


# --- isolation -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", BLOCK_NAMES)
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
    out = kernel(name)(trace, cap)
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


def test_vllm_slot_arrays_grow_as_slots_are_made(samples, monkeypatch):
    """The kernel makes slots as vLLM first hands them out and its caller grows the node arrays, so a capacity of
    a billion blocks costs nothing; growing from a handful of nodes gives the same answers as one allocation."""
    table, bs = samples["chat"]
    trace = prepared(table.slice(0, 300), bs, "vllm")
    for cap in (7, 300, 10**9):
        whole = vllm.kernel(trace, cap)
        monkeypatch.setattr(vllm.VllmBlockPool, "INITIAL_SLOTS", 4)
        assert_same(vllm.kernel(trace, cap), whole)
        monkeypatch.undo()
        assert_same(whole, checked_reference("vllm", trace, cap))
