"""Properties every registered generator must have, plus chat and mix specifics."""

import numpy as np
import pyarrow.compute as pc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbench.trace.generators import get, registry
from kvbench.trace.stats import infinite_cache_hits
from kvbench.trace.validation import validate_table

KINDS = sorted(registry())


def test_all_five_kinds_and_mix_are_registered():
    assert {"chat", "agent", "multimodal", "reasoning", "multi-tenant", "mix"} <= set(KINDS)


def test_every_registered_generator_is_a_gen_command_described_by_its_summary():
    """What `kvbench trace gen --help` lists is the registry, each kind with its one-line summary."""
    from click.testing import CliRunner

    from kvbench.cli import main

    listing = CliRunner().invoke(main, ["trace", "gen", "--help"])
    assert listing.exit_code == 0, listing.output
    text = " ".join(listing.output.split())  # click wraps the summaries
    for kind in KINDS:
        summary = get(kind).summary
        assert summary and f"{kind} {summary}" in text, kind


@pytest.mark.parametrize("kind", KINDS)
def test_deterministic_per_seed(kind):
    a, _ = get(kind).run(300, seed=7)
    b, _ = get(kind).run(300, seed=7)
    c, _ = get(kind).run(300, seed=8)
    assert a.equals(b)
    assert not a.equals(c)
    assert a.num_rows == 300


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kind=st.sampled_from(KINDS),
    n=st.integers(1, 400),
    seed=st.integers(0, 2**31),
    block_size=st.sampled_from([16, 32, 64, 512]),
)
def test_generated_traces_always_validate(kind, n, seed, block_size):
    table, meta = get(kind).run(n, seed=seed, block_size=block_size)
    assert meta.block_size == block_size and meta.source["generator"] == kind
    report = validate_table(table, block_size)
    assert report.ok, report.summary()


def _rows(table):
    return {r["request_id"]: r for r in table.to_pylist()}


def test_chat_turn_extends_previous_prompt_and_answer():
    table, meta = get("chat").run(2000, seed=3)
    bs = meta.block_size
    rows = _rows(table)
    checked = 0
    for r in rows.values():
        if r["parent_id"] is None:
            continue
        prev = rows[r["parent_id"]]
        assert r["session_id"] == prev["session_id"] and r["turn"] == prev["turn"] + 1
        assert r["arrival_s"] >= prev["arrival_s"]
        # prompt = previous prompt + previous answer + new user text (> 0 tokens)
        assert r["input_tokens"] > prev["input_tokens"] + prev["output_tokens"]
        full = prev["input_tokens"] // bs  # full blocks of the previous prompt are shared verbatim
        assert r["block_hashes"][:full] == prev["block_hashes"][:full]
        checked += 1
    assert checked > 500


def test_chat_system_prompts_are_shared_across_sessions():
    table, meta = get("chat").run(3000, seed=1, system_tokens_mean=2000.0)
    first = table.filter(pc.equal(table.column("turn"), 0))
    heads = [h[0] for h in first.column("block_hashes").to_pylist()]
    values, counts = np.unique(np.array(heads, dtype=np.uint64), return_counts=True)
    assert counts.max() > 10  # a popular system prompt opens many conversations
    assert len(values) <= 16
    hits = infinite_cache_hits(table.column("block_hashes"))
    assert hits.sum() > 0


def test_mix_blends_kinds_by_weight():
    table, _ = get("mix").run(1000, seed=2, weights="chat=3,reasoning=1")
    kinds = table.column("workload").cast("string").to_pylist()
    assert kinds.count("chat") == 750 and kinds.count("reasoning") == 250
    arrival = table.column("arrival_s").to_numpy()
    assert np.all(np.diff(arrival) >= 0)
    with pytest.raises(ValueError, match="kind=weight"):
        get("mix").run(10, weights="chat")


def test_mix_puts_all_kinds_on_one_clock():
    table, _ = get("mix").run(2000, seed=4)
    frame = table.select(["workload", "arrival_s"]).to_pylist()
    ends = {}
    for r in frame:
        ends[r["workload"]] = max(ends.get(r["workload"], 0.0), r["arrival_s"])
    assert len(ends) == 5
    assert max(ends.values()) == pytest.approx(min(ends.values()))
    native, _ = get("mix").run(2000, seed=4, clock="native")
    assert not native.column("arrival_s").equals(table.column("arrival_s"))


@pytest.mark.parametrize(
    "kind,option,value,message",
    [
        ("chat", "session_rate", -1.0, "--session-rate -1.0 must be > 0"),
        ("chat", "session_rate", 0.0, "--session-rate 0.0 must be > 0"),
        ("chat", "user_tokens_sigma", float("nan"), "--user-tokens-sigma nan must be a finite number"),
        ("chat", "max_turns", 0, "--max-turns 0 must be >= 1"),
        ("agent", "fork_prob", 1.5, "--fork-prob 1.5 must be <= 1"),
        ("multi-tenant", "diurnal_amplitude", 1.0, "--diurnal-amplitude 1.0 must be < 1"),
        ("multi-tenant", "premium_priority", 101, "--premium-priority 101 must be <= 100"),
        ("multimodal", "image_pool", 0, "--image-pool 0 must be >= 1"),
        ("reasoning", "think_time_mean_s", -5.0, "--think-time-mean-s -5.0 must be >= 0"),
    ],
)
def test_parameters_out_of_range_are_refused_naming_the_option(kind, option, value, message):
    from kvbench.errors import KvbenchError

    with pytest.raises(KvbenchError) as err:
        get(kind).run(10, **{option: value})
    assert message in str(err.value)
    assert isinstance(err.value, ValueError)  # Python callers catching ValueError still do
