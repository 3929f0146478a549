"""engine-sim's global KV store (--global-pool) on traces small enough to check by hand: what one instance
prefills another finds in the store (put on prefill), or only after it left the first one (put on evict); the
store's own capacity and LRU / FIFO order; loads costed at --pool-bandwidth-gbps.

Block size 16 tokens, Llama-3-8B in bf16: 131,072 KV bytes a token, 2 MiB a block. Requests arrive 1 s apart,
each one done long before the next, and round-robin sends request i to instance i mod N."""

from __future__ import annotations

import pyarrow as pa
import pytest
from kvbench.backends.enginesim import EngineSimBackend

from kvbench.cache.tiers import GlobalStore
from kvbench.errors import KvbenchError
from kvbench.trace.files import TraceMeta, conform

BS = 16
BLOCK_BYTES = 131_072 * BS


def trace_of(prompts: list[list[int]]) -> tuple[pa.Table, TraceMeta]:
    """Request i: block ids prompts[i] (whole blocks), arriving at i seconds."""
    n = len(prompts)
    table = pa.table(
        {
            "request_id": [f"r{i}" for i in range(n)],
            "arrival_s": [float(i) for i in range(n)],
            "input_tokens": [len(p) * BS for p in prompts],
            "output_tokens": [1] * n,
            "block_hashes": pa.array(prompts, pa.list_(pa.uint64())),
        }
    )
    return conform(table), TraceMeta(block_size=BS, source={"test": "global pool"}, created="test")


def run(prompts, **opts):
    """One engine-sim point; HBM is a plain block LRU (its eviction order is easy to follow)."""
    table, meta = trace_of(prompts)
    settings = {"policy": "lru", "instances": 2, "router": "round-robin", "hbm_capacity": "100"} | opts
    return next(EngineSimBackend(**settings).replay(table, meta))


def hits(point, tier: str) -> list[int]:
    """Blocks each request took from `tier` (hbm, dram, ssd, global)."""
    return [int(t) // BS for t in point.columns[f"hit_tokens_{tier}"]]


A = [1, 2, 3, 4]  # the shared prefix
B = A + [50]  # A's prefix and one block of its own


def test_a_prefix_prefilled_on_one_instance_is_loaded_from_the_store_on_another():
    prompts = [A, B]
    with_store = run(prompts, global_pool="1000")
    assert hits(with_store, "global") == [0, 4]  # B (instance 1) loads A's four blocks
    assert hits(with_store, "hbm") == [0, 0]
    without = run(prompts)
    assert hits(without, "global") == [0, 0] and list(without.columns["hit_blocks"]) == [0, 0]
    store = with_store.extra["engine"]["global_store"]
    # put on prefill: A's 4 blocks, then B's own one; B's loaded blocks are already there, not written again
    assert store["written_blocks"] == 5 and store["loaded_blocks"] == 4 and store["resident_blocks"] == 5
    assert with_store.extra["engine"]["hit_blocks"] == {"local": 0, "global": 4}
    assert without.extra["engine"]["global_store"] is None
    # a third request on instance 0 finds A in its own HBM, not in the store
    again = run([A, [90], B], global_pool="1000")
    assert hits(again, "hbm") == [0, 0, 4] and hits(again, "global") == [0, 0, 0]


def test_put_on_evict_shows_a_block_to_others_only_once_it_left_its_instance():
    # A's blocks stay in instance 0's HBM: with put-on-evict the store never saw them
    still_cached = run([A, B], global_pool="1000", pool_put="evict")
    assert hits(still_cached, "global") == [0, 0]
    assert still_cached.extra["engine"]["global_store"]["written_blocks"] == 0
    # HBM of 6 blocks: C (4 new blocks, instance 0) evicts A's least recent two, 1 and 2, into the store; B on
    # instance 1 then loads 1 and 2 from it and stops at 3, which is still in instance 0's HBM only
    C, X = [60, 61, 62, 63], [70]
    evicted = run([A, X, C, B], hbm_capacity="6", global_pool="1000", pool_put="evict")
    assert hits(evicted, "global") == [0, 0, 0, 2]
    # put on prefill: all four are there from the start
    prefilled = run([A, X, C, B], hbm_capacity="6", global_pool="1000", pool_put="prefill")
    assert hits(prefilled, "global") == [0, 0, 0, 4]


def test_an_instance_looks_in_its_own_dram_before_the_store():
    # as above, C evicts A's blocks 1 and 2 from instance 0's HBM, now into its DRAM; A again on instance 0
    # misses HBM at block 1 (the prefix rule), loads 1 and 2 from DRAM and 3 and 4 from the store
    C, X = [60, 61, 62, 63], [70]
    point = run([A, X, C, X, B], hbm_capacity="6", dram_capacity="100 tok", global_pool="1000")
    assert hits(point, "dram")[4] == 2 and hits(point, "global")[4] == 2


@pytest.mark.parametrize("policy", ["lru", "fifo"])
def test_a_three_block_store_evicts_in_its_own_policy_order(policy):
    """One-block prompts on four instances, so that each probe lands on an instance that never saw its block:
    r0-r2 put a, b, c (store full); r3 (instance 3) loads a, which LRU makes the most recent; r4 puts d, which
    evicts b under LRU and a under FIFO; r5 (instance 1, saw only b) looks for a."""
    a, b, c, d = 1, 2, 3, 4
    point = run([[k] for k in (a, b, c, a, d, a)], instances=4, global_pool="3", pool_policy=policy)
    want = {"lru": [0, 0, 0, 1, 0, 1], "fifo": [0, 0, 0, 1, 0, 0]}[policy]
    assert hits(point, "global") == want
    store = point.extra["engine"]["global_store"]
    assert store["capacity_blocks"] == 3 and store["resident_blocks"] == 3 and store["policy"] == policy
    # LRU: d evicts b; FIFO: d evicts a, then r5 puts a back, evicting b
    assert store["evicted_blocks"] == {"lru": 1, "fifo": 2}[policy]


def test_store_order_lru_refreshes_on_use_fifo_does_not():
    for policy, survivor in (("lru", [3, 1, 4]), ("fifo", [2, 3, 4])):
        store = GlobalStore("global", 3, 1e9, policy=policy)
        for key in (1, 2, 3):
            store.put(key)
        store.touch(1)
        assert store.put(1) is None  # already there: a use, not a write
        assert store.put(4) == {"lru": 2, "fifo": 1}[policy]
        assert list(store.blocks) == survivor and store.written == 4


def test_store_loads_are_costed_at_the_pool_bandwidth():
    """B loads 4 blocks (8 MiB) from the store; everything else about its first token is the same, so its TTFT
    at 1 GB/s exceeds that at 4 GB/s by 8,388,608 B x (1/1e9 - 1/4e9) s/B = 6.291456 ms."""
    slow = run([A, B], global_pool="1000", pool_bandwidth_gbps=1.0)
    fast = run([A, B], global_pool="1000", pool_bandwidth_gbps=4.0)
    loaded = 4 * BLOCK_BYTES
    assert loaded == 8_388_608
    assert slow.extra["engine"]["tier_bytes"]["loaded"] == {"global": loaded}
    gap = slow.columns["ttft_s"][1] - fast.columns["ttft_s"][1]
    assert gap == pytest.approx(loaded / 1e9 - loaded / 4e9, rel=1e-9)
    assert gap == pytest.approx(6.291456e-3, rel=1e-9)
    assert slow.columns["ttft_s"][0] == pytest.approx(fast.columns["ttft_s"][0], rel=1e-12)  # A loads nothing


def test_unknown_store_policy_names_the_choices():
    with pytest.raises(KvbenchError, match="lru, fifo"):
        EngineSimBackend(global_pool="100", pool_policy="s3fifo")
