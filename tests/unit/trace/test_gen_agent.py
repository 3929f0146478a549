"""The agent generator: trees of calls with prefix-sharing forks, merges, compaction and very high reuse."""

from collections import defaultdict

import numpy as np
import pytest

from kvbench.trace.blockhash import is_prefix_consistent, mix
from kvbench.trace.generators import get
from kvbench.trace.generators.agent import AgentParams
from kvbench.trace.validation import validate_table

BS = 64
DEFAULTS = AgentParams()
# Frequent forks and a small context, so forks, merges and compactions all occur many times.
STRESS = dict(fork_prob=0.05, max_context_tokens=40_000, summary_tokens=2_000)


@pytest.fixture(scope="module")
def trace():
    table, meta = get("agent").run(3000, seed=7, block_size=BS)
    return table, meta


@pytest.fixture(scope="module")
def stress():
    table, _ = get("agent").run(3000, seed=11, block_size=BS, **STRESS)
    return table


def rows_of(table):
    """Each request as a dict, plus the request_id -> row index."""
    rows = table.select(
        [
            "request_id",
            "arrival_s",
            "input_tokens",
            "output_tokens",
            "block_hashes",
            "session_id",
            "user_id",
            "turn",
            "parent_id",
            "depends_on",
            "think_time_s",
        ]
    ).to_pylist()
    return rows, {r["request_id"]: i for i, r in enumerate(rows)}


def edges(table):
    """Classify every (parent, child) pair: 'fork' (a sub-agent's first call), 'merge', or 'next' (same chain)."""
    rows, index = rows_of(table)
    children = defaultdict(list)
    for i, r in enumerate(rows):
        if r["parent_id"] is not None:
            children[index[r["parent_id"]]].append(i)
    out = []
    for r in rows:
        if r["parent_id"] is None:
            continue
        p = index[r["parent_id"]]
        if r["depends_on"] is not None:
            kind = "merge"
        elif len(children[p]) > 1 or any(rows[c]["depends_on"] is not None for c in children[p]):
            kind = "fork"  # a fork call's children: its sub-agents (and its merge)
        else:
            kind = "next"
        out.append((kind, rows[p], r))
    return out


def prefix_hit_rate(table, scope="session_id"):
    """Token-weighted prefix hit rate of an infinite cache private to each `scope` value (None: one shared cache)."""
    lists = table.column("block_hashes").combine_chunks()
    ids, offsets = np.asarray(lists.values), np.asarray(lists.offsets).astype(np.int64)
    n_blocks = np.diff(offsets)
    row = np.repeat(np.arange(table.num_rows), n_blocks)
    key = ids
    if scope is not None:
        _, owner = np.unique(table.column(scope).to_numpy(zero_copy_only=False), return_inverse=True)
        key = mix(owner[row], ids)
    _, first, inverse = np.unique(key, return_index=True, return_inverse=True)
    seen = row[first[inverse]] < row  # rows are in arrival order
    pos = np.arange(ids.size) - offsets[:-1][row]
    first_miss = np.minimum.reduceat(np.where(seen, n_blocks[row], pos), offsets[:-1])
    inp = np.asarray(table.column("input_tokens")).astype(np.int64)
    return np.minimum(first_miss * BS, inp).sum() / inp.sum()


@pytest.mark.parametrize("block_size", [1, 16, 64, 512])
def test_traces_validate(block_size):
    for overrides in ({}, STRESS, {"fork_prob": 0.0}, {"fork_prob": 1.0}):
        n = {1: 60, 16: 400}.get(block_size, 1500)
        table, meta = get("agent").run(n, seed=3, block_size=block_size, **overrides)
        report = validate_table(table, meta.block_size)
        assert report.ok, report.summary()
        assert table.num_rows == n
        assert is_prefix_consistent(table.column("block_hashes").combine_chunks())


def test_columns(trace):
    table, meta = trace
    rows, _ = rows_of(table)
    assert meta.block_size == BS
    assert set(table.column("workload").to_pylist()) == {"agent"}
    assert all(r["request_id"].startswith("agent-") for r in rows)
    assert np.all(np.diff(np.asarray(table.column("arrival_s"))) >= 0)
    assert np.all(np.asarray(table.column("think_time_s")) >= 0)
    by_task = defaultdict(list)
    for r in rows:
        by_task[r["session_id"]].append(r)
    for task_rows in by_task.values():
        assert [r["turn"] for r in task_rows] == list(range(len(task_rows)))  # call index within the task
        assert len({r["user_id"] for r in task_rows}) == 1
        assert task_rows[0]["parent_id"] is None and task_rows[0]["think_time_s"] == 0
    assert sum(r["parent_id"] is None for r in rows) == len(by_task)


def test_calls_extend_the_prompt_they_continue(trace):
    table, _ = trace
    compactions = 0
    # Every non-merge edge: the next call of a chain, or a sub-agent's first call (the trace does not say
    # which when a fork's other children fall outside the window). Both start with the parent's prompt.
    pairs = [(p, c) for kind, p, c in edges(table) if kind != "merge"]
    for p, c in pairs:
        full = p["input_tokens"] // BS
        if c["input_tokens"] > p["input_tokens"]:
            assert c["block_hashes"][:full] == p["block_hashes"][:full]
        else:  # a compaction: only the shared system prompt + tool definitions (+ task message) survive
            compactions += 1
            assert c["block_hashes"][0] == p["block_hashes"][0]
            assert c["block_hashes"][:full] != p["block_hashes"][:full]
        # think time = tool time between the parent finishing (decode estimate) and this call
        expect = p["arrival_s"] + p["output_tokens"] * DEFAULTS.decode_s_per_token + c["think_time_s"]
        assert c["arrival_s"] == pytest.approx(expect, abs=1e-3)
    assert len(pairs) > 1000 and compactions < 0.05 * len(pairs)


def test_same_chain_calls_append_output_and_tool_output(trace):
    table, _ = trace
    pairs = [(p, c) for kind, p, c in edges(table) if kind == "next" and c["input_tokens"] > p["input_tokens"]]
    grown = [c["input_tokens"] - p["input_tokens"] - p["output_tokens"] for p, c in pairs]
    # Sub-agent first calls hidden among these add only an instruction; the rest add output + tool output.
    assert np.mean(np.array(grown) >= 1) > 0.95
    assert np.median(grown) > 100  # tool outputs, log-normal with a mean of thousands of tokens


def test_subagent_shares_parent_prefix_then_diverges(stress):
    table = stress
    forks = defaultdict(list)
    for kind, p, c in edges(table):
        if kind == "fork":
            forks[p["request_id"]].append((p, c))
    assert len(forks) > 20
    for pairs in forks.values():
        p = pairs[0][0]
        full = p["input_tokens"] // BS
        assert full > 0
        subs = [c for _, c in pairs]
        for c in subs:
            assert c["session_id"] == p["session_id"]
            # the parent's prompt + the sub-agent's instruction (clipped to fit the context, rarely to 0)
            assert p["input_tokens"] <= c["input_tokens"] <= STRESS["max_context_tokens"]
            assert c["block_hashes"][:full] == p["block_hashes"][:full]
        # Past the shared prefix every sub-agent has its own content.
        next_blocks = [c["block_hashes"][full] for c in subs if c["input_tokens"] > p["input_tokens"]]
        assert len(set(next_blocks)) == len(next_blocks)


def test_merge_depends_on_the_last_call_of_each_subagent(stress):
    table = stress
    rows, index = rows_of(table)
    merges = [(i, r) for i, r in enumerate(rows) if r["depends_on"] is not None]
    assert len(merges) > 20
    for i, merge in merges:
        fork = rows[index[merge["parent_id"]]]
        deps = [index[d] for d in merge["depends_on"]]
        assert deps and all(j < i for j in deps)
        assert all(rows[j]["arrival_s"] < merge["arrival_s"] for j in deps)
        for j in deps:  # each dependency is a sub-agent call descending from the fork
            node = rows[j]
            assert node["session_id"] == merge["session_id"]
            while node["parent_id"] != fork["request_id"]:
                node = rows[index[node["parent_id"]]]
            assert node["depends_on"] is None
        # The merge waits for the slowest sub-agent, then the tool time.
        done = max(rows[j]["arrival_s"] + rows[j]["output_tokens"] * DEFAULTS.decode_s_per_token for j in deps)
        assert merge["arrival_s"] == pytest.approx(done + merge["think_time_s"], abs=1e-3)
        # Its prompt is the fork call's prompt + the fork call's output + every sub-agent's final output,
        # unless that overflowed the context and the chain compacted.
        appended = fork["input_tokens"] + fork["output_tokens"] + sum(rows[j]["output_tokens"] for j in deps)
        if appended <= STRESS["max_context_tokens"]:
            assert merge["input_tokens"] == appended
            full = fork["input_tokens"] // BS
            assert merge["block_hashes"][:full] == fork["block_hashes"][:full]
        # no sub-agent has a later call: the dependencies are the last calls of their chains
        for j in deps:
            assert not any(r["parent_id"] == rows[j]["request_id"] for r in rows)


def test_context_is_capped_by_compaction(stress):
    inp = np.asarray(stress.column("input_tokens"))
    assert inp.max() <= STRESS["max_context_tokens"]
    shrinks = [c for kind, p, c in edges(stress) if kind == "next" and c["input_tokens"] < p["input_tokens"]]
    assert len(shrinks) > 10  # compactions happened


def test_defaults_have_very_high_prefix_reuse_within_a_task(trace):
    table, _ = trace
    assert prefix_hit_rate(table, "session_id") > 0.85  # real agent traces: ~93-97% per conversation
    assert np.asarray(table.column("input_tokens")).max() <= DEFAULTS.max_context_tokens


def test_shared_system_prompt_across_tasks(trace):
    table, _ = trace
    firsts = [r for r in rows_of(table)[0] if r["parent_id"] is None]
    first_blocks = [r["block_hashes"][0] for r in firsts]
    assert len(set(first_blocks)) <= DEFAULTS.system_prompts < len(firsts)


def test_deterministic():
    gen = get("agent")
    a, _ = gen.run(800, seed=5, block_size=32)
    b, _ = gen.run(800, seed=5, block_size=32)
    c, _ = gen.run(800, seed=6, block_size=32)
    assert a.equals(b)
    assert not a.equals(c)


def test_rejects_impossible_parameters():
    with pytest.raises(ValueError):
        get("agent").run(10, summary_tokens=60_000, max_context_tokens=100_000)
    with pytest.raises(ValueError):
        get("agent").run(10, fork_prob=1.5)
