"""engine-sim's QuickPool (backends/enginesim/pool.py) is vLLM's pool rule (kvbench.cache.policies.vllm.VllmPool)
made quick: driven by the same calls, both end in the same state, and engine-sim replays give the same
per-request results with either."""

from __future__ import annotations

import random

import kvbench.backends.enginesim as enginesim
import numpy as np
import pyarrow.parquet as pq
import pytest
from kvbench.backends.enginesim import compiled_run
from kvbench.backends.enginesim.pool import QuickPool

from kvbench.cache.policies.vllm import VllmPool
from kvbench.cache.prepared import prepare
from kvbench.run.runner import run_replay
from kvbench.trace.files import read_trace
from tests.conftest import SAMPLES


def state(pool):
    if isinstance(pool, QuickPool):
        pool.flush_evictions()
    out = pool.out
    return (
        pool.free_queue() if isinstance(pool, QuickPool) else list(pool.free),
        pool.fresh,
        pool.slot_key,
        pool.copies,
        pool.refs,
        pool.held,
        pool.unhashed_from,
        pool.extra,
        pool.owner,
        pool.request,
        out.hit_blocks.tolist(),
        out.evictions.tolist(),
        out.evict_matrix.tolist(),
        out.filled_at,
    )


class Clock:
    now = 0.0


@pytest.mark.parametrize("tracked", [False, True])
@pytest.mark.parametrize("capacity", [40, 400, 100_000])
def test_the_same_calls_leave_both_pools_in_the_same_state(capacity, tracked):
    """Requests begun, grown chunk by chunk, held past their prompt, checked for admission and ended in a random
    overlapping order, with keys outside the trace held too (multi-LoRA's delta pages). Tracked, as engine-sim
    runs it (the blocks' lives timed, insert's and evict's work done inline), the quick pool also times each
    block's life as the hooks on the reference do."""
    table, meta = read_trace(SAMPLES / "multi-tenant.parquet")
    prep = prepare(table.slice(0, 300), meta.block_size, vllm_cap=True)
    ref, quick = VllmPool(prep, capacity, {}), QuickPool(prep, capacity, {})
    clock, born, lifetimes = Clock(), {}, []
    if tracked:
        quick.track(clock, born, lifetimes)
        insert, evict = ref.insert, ref.evict
        ref_born, ref_lifetimes = {}, []

        def inserted(key):
            insert(key)
            ref_born[key] = clock.now

        def evicted(key):
            evict(key)
            ref_lifetimes.append(clock.now - ref_born.pop(key, clock.now))

        ref.insert, ref.evict = inserted, evicted
    rng = random.Random(capacity)
    running: dict[int, int] = {}  # row -> tokens of KV so far
    row = 0
    for _ in range(3000):
        clock.now += rng.random()
        action = rng.random()
        if (action < 0.3 or not running) and row < prep.n_requests:
            tokens = int(prep.input_tokens[row]) + 1
            assert ref.admission_need(row, tokens) == quick.admission_need(row, tokens)
            prompt_slots = rng.random() < 0.3
            assert ref.begin(row, prompt_slots=prompt_slots) == quick.begin(row, prompt_slots=prompt_slots)
            running[row], row = 0, row + 1
        elif action < 0.8 and running:
            r = rng.choice(list(running))
            running[r] += rng.choice([1, 1, 1, 7, 64, 500])
            ref.grow(r, running[r])
            quick.grow(r, running[r])
        elif action < 0.85 and running:
            r = rng.choice(list(running))
            key = 10**9 + rng.randrange(50)
            assert ref.hold_key(r, key) == quick.hold_key(r, key)
        elif running:
            r = rng.choice(list(running))
            del running[r]
            ref.end(r)
            quick.end(r)
        assert ref.free_blocks() == quick.free_blocks()
    for r in list(running):
        ref.end(r)
        quick.end(r)
    assert state(ref) == state(quick)
    assert capacity == 100_000 or quick.out.evictions.sum() > 0  # the small pools did evict
    if tracked:
        assert (born, lifetimes) == (ref_born, ref_lifetimes)
        assert capacity == 100_000 or lifetimes


@pytest.mark.parametrize(
    "sample, opts",
    [
        ("chat", {"instances": 2, "router": "cache-aware", "hbm_capacity": "400"}),
        ("multi-tenant", {"instances": 3, "router": "least-loaded", "hbm_capacity": "300", "max_num_seqs": 8}),
        ("reasoning", {"hbm_capacity": "6000", "max_num_seqs": 64, "preemption": "protect-after=1000"}),
    ],
)
def test_engine_sim_gives_the_same_results_with_the_reference_pool(sample, opts, tmp_path, monkeypatch):
    """Preemption, evictions and routing included: every per-request column and the engine facts are equal."""
    trace = SAMPLES / f"{sample}.parquet"
    monkeypatch.setenv(compiled_run.SWITCH, "python")  # the pools compared are the Python loop's

    def go(name):
        run_dir, summary = run_replay(trace, "engine-sim", opts, out=tmp_path / name, report=False)
        return pq.read_table(run_dir / "requests.parquet"), summary["points"][0]["engine"]

    quick_rows, quick_engine = go("quick")
    monkeypatch.setattr(enginesim, "QuickPool", lambda prep, capacity, options, keys: VllmPool(prep, capacity, options))
    ref_rows, ref_engine = go("reference")
    assert quick_rows.column_names == ref_rows.column_names
    for name in quick_rows.column_names:
        a, b = quick_rows.column(name).to_pylist(), ref_rows.column(name).to_pylist()
        if isinstance(a[0], float):
            np.testing.assert_array_equal(np.array(a, dtype=float), np.array(b, dtype=float), err_msg=name)
        else:
            assert a == b, name
    assert quick_engine == ref_engine
