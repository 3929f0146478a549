"""The reasoning generator: long decodes whose reasoning is stripped from the next turn's prompt."""

from collections import defaultdict

import numpy as np
import pytest

from kvbench.trace.generators import get
from kvbench.trace.generators.reasoning import ReasoningParams
from kvbench.trace.validation import validate_table

BS = 64
DEFAULTS = ReasoningParams()


@pytest.fixture(scope="module")
def stripped():
    return get("reasoning").run(2000, seed=4, block_size=BS)[0]


@pytest.fixture(scope="module")
def kept():
    """Same seed with the reasoning kept in the context: the counterfactual prompt."""
    return get("reasoning").run(2000, seed=4, block_size=BS, keep_reasoning=True)[0]


def sessions(table):
    rows = table.select(
        [
            "request_id",
            "arrival_s",
            "input_tokens",
            "output_tokens",
            "reasoning_tokens",
            "block_hashes",
            "session_id",
            "user_id",
            "turn",
            "parent_id",
            "think_time_s",
        ]
    ).to_pylist()
    out = defaultdict(list)
    for r in rows:
        out[r["session_id"]].append(r)
    for turns in out.values():
        turns.sort(key=lambda r: r["turn"])
    return out


@pytest.mark.parametrize("block_size", [16, 64, 512])
def test_traces_validate(block_size):
    for keep in (False, True):
        n = 500 if block_size < 64 else 1500
        table, meta = get("reasoning").run(n, seed=1, block_size=block_size, keep_reasoning=keep)
        report = validate_table(table, meta.block_size)
        assert report.ok, report.summary()
        assert table.num_rows == n


def test_columns(stripped):
    table = stripped
    assert set(table.column("workload").to_pylist()) == {"reasoning"}
    assert all(r.startswith("reasoning-") for r in table.column("request_id").to_pylist())
    out = np.asarray(table.column("output_tokens"))
    reasoning = np.asarray(table.column("reasoning_tokens"))
    assert np.all((reasoning >= 0) & (reasoning <= out))
    assert reasoning.sum() > 0.9 * out.sum()  # most of a decode is reasoning
    for turns in sessions(table).values():
        assert [r["turn"] for r in turns] == list(range(len(turns)))
        assert turns[0]["parent_id"] is None
        assert all(b["parent_id"] == a["request_id"] for a, b in zip(turns, turns[1:]))
        assert len({r["user_id"] for r in turns}) == 1


def test_default_outputs_are_long(stripped):
    out = np.asarray(stripped.column("output_tokens"))
    assert np.mean((out >= 30_000) & (out <= 100_000)) > 0.8
    assert np.median(out) > 10 * np.median(np.asarray(stripped.column("input_tokens")))  # decode-dominated


def test_next_turn_appends_only_the_visible_answer(stripped, kept):
    assert np.array_equal(np.asarray(stripped.column("arrival_s")), np.asarray(kept.column("arrival_s")))
    strip_sessions, keep_sessions = sessions(stripped), sessions(kept)
    checked = 0
    for sid, turns in strip_sessions.items():
        counterfactual = keep_sessions[sid]
        reasoning_so_far = 0
        for k in range(1, len(turns)):
            prev, cur = turns[k - 1], turns[k]
            visible = prev["output_tokens"] - prev["reasoning_tokens"]
            new_user_text = cur["input_tokens"] - prev["input_tokens"] - visible
            assert new_user_text >= 1  # input = previous input + visible answer + new user text
            # The previous prompt's blocks are reused ...
            full = prev["input_tokens"] // BS
            assert cur["block_hashes"][:full] == prev["block_hashes"][:full]
            # ... and what follows is not what keeping the reasoning would have produced.
            reasoning_so_far += prev["reasoning_tokens"]
            assert counterfactual[k]["input_tokens"] - cur["input_tokens"] == reasoning_so_far
            first = turns[0]["input_tokens"] // BS  # both variants agree up to the first reasoning span
            assert counterfactual[k]["block_hashes"][:first] == cur["block_hashes"][:first]
            if turns[0]["reasoning_tokens"] > 0:
                assert counterfactual[k]["block_hashes"][first] != cur["block_hashes"][first]
            checked += 1
    assert checked > 200


def test_arrivals_wait_for_the_whole_decode(stripped):
    for turns in sessions(stripped).values():
        for prev, cur in zip(turns, turns[1:]):
            decode = prev["output_tokens"] * DEFAULTS.decode_s_per_token  # reasoning included
            assert cur["arrival_s"] == pytest.approx(prev["arrival_s"] + decode + cur["think_time_s"], abs=1e-3)
            assert cur["arrival_s"] - prev["arrival_s"] >= decode - 1e-6


def test_deterministic():
    gen = get("reasoning")
    a, _ = gen.run(500, seed=9, block_size=32)
    b, _ = gen.run(500, seed=9, block_size=32)
    c, _ = gen.run(500, seed=10, block_size=32)
    assert a.equals(b)
    assert not a.equals(c)
