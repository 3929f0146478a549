"""`kvbench trace fit`: the twin of traces/samples/chat.parquet validates, its hit rates stay near the
original's, --scale K is K times the users with the same per-session turns, a seed fixes the twin, bad input is
named. Bounds are what was measured (docs/semantics.md, Fitting a synthetic twin) with margin."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from click.testing import CliRunner

from kvbench.cli import main
from kvbench.run import twin as twin_measure
from kvbench.trace.files import new_meta, read_trace, write_trace
from kvbench.trace.fit import fit, synthesize
from kvbench.trace.fit.model import EXTEND, FRESH, session_stats, structure
from kvbench.trace.validation import validate_table
from tests.conftest import fresh_seeds

CHAT = Path(__file__).resolve().parents[3] / "traces" / "samples" / "chat.parquet"


@pytest.fixture(params=fresh_seeds(2))
def seed(request):
    """Seeds drawn at random per run and printed (pytest -s, or in a failure's report); replay with
    KVBENCH_TEST_SEEDS=a,b."""
    print(f"seed {request.param}")
    return request.param


@pytest.fixture(scope="module")
def chat():
    table, meta = read_trace(CHAT)
    params, _ = fit(table, meta.block_size)
    return table, meta, params


def _sessions(table: pa.Table) -> dict:
    names = table.column("session_id").to_numpy(zero_copy_only=False)
    return session_stats(np.unique(names, return_inverse=True)[1], table.column("arrival_s").to_numpy())


def _rate(table: pa.Table) -> float:
    t = table.column("arrival_s").to_numpy()
    return t.size / (t[-1] - t[0])


def test_structure_reads_turns_and_shared_prefixes():
    # two conversations on one system prompt [1, 2]: B's first turn branches off A's, each second turn extends
    # its first (a turn may drop its parent's last block, which was partial: shared 2 of 3 would be an extend)
    blocks = [[1, 2, 3, 4], [1, 2, 7, 8], [1, 2, 3, 4, 5], [1, 2, 7, 8, 9]]
    table = pa.table({"block_hashes": pa.array(blocks, pa.list_(pa.uint64())), "arrival_s": [0.0, 1.0, 5.0, 9.0]})
    st = structure(table)
    assert st["kind"].tolist() == [FRESH, 2, EXTEND, EXTEND]
    assert st["parent"].tolist() == [-1, 0, 0, 1]
    assert st["lag_s"][2:].tolist() == [5.0, 8.0]


def test_stack_distance_counts_distinct_blocks_since_the_parent():
    blocks = [[1, 2, 3, 4], [1, 2, 7, 8], [1, 2, 3, 4, 5], [1, 2, 7, 8, 9]]
    table = pa.table({"block_hashes": pa.array(blocks, pa.list_(pa.uint64())), "arrival_s": [0.0, 1.0, 5.0, 9.0]})
    st = structure(table)
    # B right after A: nothing in between; A's next turn: B's 4 blocks since; B's: the 5 of A's second turn
    assert st["distance_blocks"][1:].tolist() == [0, 4, 5]
    assert st["holders"][1:].tolist() == [1, 1, 1]  # blocks 2, 4 and 8 were each held by one request before


def _known(seed: int, conversations=40, turns=5, root_blocks=10, new_blocks=4, rate=2.0, bs=16):
    """A trace built with stated structure: one shared root prompt of `root_blocks` full blocks, conversations
    that each start on it and then add `new_blocks` full blocks per turn; turns round-robin over the open
    conversations (a fixed stack distance); Poisson arrivals at `rate`; log-normal outputs, median 200."""
    rng = np.random.default_rng(seed)
    root = list(range(1, root_blocks + 1))
    paths, next_id = {}, 1000
    rows = []
    for _turn in range(turns):
        for c in range(conversations):
            base = paths.get(c, root)
            paths[c] = base + list(range(next_id, next_id + new_blocks))
            next_id += new_blocks
            rows.append(paths[c])
    n = len(rows)
    t = np.cumsum(rng.exponential(1 / rate, n))
    return pa.table(
        {
            "request_id": [f"r{i}" for i in range(n)],
            "arrival_s": t,
            "input_tokens": pa.array([len(r) * bs for r in rows], pa.int32()),
            "output_tokens": pa.array(np.round(rng.lognormal(np.log(200), 0.5, n)).astype(int), pa.int32()),
            "block_hashes": pa.array(rows, pa.list_(pa.uint64())),
        }
    )


def test_fit_recovers_a_structure_known_by_construction(seed):
    conversations, turns, root_blocks, new_blocks, bs = 40, 5, 10, 4, 16
    table = _known(seed, conversations, turns, root_blocks, new_blocks, bs=bs)
    params, st = fit(table, bs)
    rows = np.asarray(params["units"]["rows"])
    col = {name: rows[:, k] for k, name in enumerate(params["units"]["columns"])}
    # sessions: each conversation is one unit of `turns` requests (its turns extend each other; the first turns
    # branch off the shared root, which ties no two conversations together)
    assert params["units"]["units"] == conversations
    assert np.bincount(col["unit"].astype(int)).tolist() == [turns] * conversations
    # fan-out: one fresh request, then 39 first turns on the root (shared = the root) and later turns sharing
    # their whole previous prompt and adding `new_blocks`
    reuse = col["shared_blocks"] > 0
    assert (~reuse).sum() == 1
    first_turns = reuse & (col["shared_blocks"] == root_blocks)
    assert first_turns.sum() == conversations - 1
    assert (col["new_blocks"][reuse] == new_blocks).all()
    shared = params["describe"]["shared_prefixes"]
    assert shared["count"] == 1 and shared["most_used"][0] == {"depth_blocks": root_blocks, "branches": 39}
    # reuse: a later turn comes after the other 39 conversations' turns, whose own blocks are all distinct
    # (the root is touched by them too, which is then more recent than the parent: counted once)
    # reuse: between turns k-1 and k of conversation c come the later conversations' turn k-1 and the earlier
    # ones' turn k, each touching the root (10 blocks, counted once) and its own path
    distance = st["distance_blocks"]
    for k in range(1, turns):
        for c in range(conversations):
            others = (conversations - 1 - c) * new_blocks * k + c * new_blocks * (k + 1)
            assert distance[k * conversations + c] == root_blocks + others
    assert int(st["n_blocks"].max()) == root_blocks + new_blocks * turns
    # lengths and arrivals
    # the median of 200 draws of a log-normal with sigma 0.5 is off by 4.4% (one standard error) on average
    assert np.median(col["output_tokens"]) == pytest.approx(200, rel=0.15)
    assert params["describe"]["lengths"]["output_tokens"][100] == pytest.approx(200, rel=0.15)  # the median
    assert params["arrival"]["rate_per_s"] == pytest.approx(2.0, rel=0.2)
    # units start with their first turns, the first `conversations` requests, and keep those start times
    t = table.column("arrival_s").to_numpy()
    assert params["unit_arrival"]["starts_s"] == pytest.approx((t[:conversations] - t[0]).tolist())
    assert params["unit_arrival"]["rate_per_s"] == pytest.approx(conversations / (t[conversations - 1] - t[0]))
    assert params["arrival"]["gap_cv"] == pytest.approx(1.0, abs=0.2)


def test_twin_of_a_known_structure_keeps_it(seed):
    table = _known(seed)
    params, st = fit(table, 16)
    twin = synthesize(params, seed=seed)
    assert twin.num_rows == table.num_rows
    st_twin = structure(twin)
    assert st_twin["shared"].sum() / st_twin["n_blocks"].sum() == pytest.approx(
        st["shared"].sum() / st["n_blocks"].sum(), abs=0.02
    )
    d0, d1 = st["distance_blocks"], st_twin["distance_blocks"]
    assert np.nanmedian(d1) == pytest.approx(np.nanmedian(d0), rel=0.25)
    assert np.median(twin.column("output_tokens").to_numpy()) == pytest.approx(200, rel=0.15)


def _documents(seed: int, documents=12, doc_blocks=(20, 60), requests=1200, bs=16):
    """A trace built with stated hot prefixes: `documents` documents of 20-60 full blocks, each request one of
    them (Zipf-popular, exponent 1) and a question of its own of 1-3 blocks, in random order."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(*doc_blocks, documents)
    starts = np.concatenate([[0], np.cumsum(lengths)])
    p = 1 / np.arange(1, documents + 1)
    pick = rng.choice(documents, requests, p=p / p.sum())
    next_id, rows = int(starts[-1]) + 1, []
    for d in pick:
        q = int(rng.integers(1, 4))
        rows.append(list(range(starts[d] + 1, starts[d + 1] + 1)) + list(range(next_id, next_id + q)))
        next_id += q
    t = np.cumsum(rng.exponential(0.5, requests))
    table = pa.table(
        {
            "request_id": [f"r{i}" for i in range(requests)],
            "arrival_s": t,
            "input_tokens": pa.array([len(r) * bs for r in rows], pa.int32()),
            "output_tokens": pa.array(np.full(requests, 50), pa.int32()),
            "block_hashes": pa.array(rows, pa.list_(pa.uint64())),
        }
    )
    return table, lengths, np.bincount(pick, minlength=documents)


def _uses_by_document(table: pa.Table, min_depth: int) -> list[int]:
    """Requests per shared prefix of at least `min_depth` blocks, most used first."""
    st = structure(table)
    node = [r[s - 1] if s else None for r, s in zip(table.column("block_hashes").to_pylist(), st["shared"])]
    counts: dict = {}
    for n, s in zip(node, st["shared"]):
        if s >= min_depth:
            counts[n] = counts.get(n, 0) + 1
    return sorted(counts.values(), reverse=True)


def test_twin_keeps_hot_documents_as_shared_prefixes(seed):
    table, lengths, uses = _documents(seed)
    params, _ = fit(table, 16)
    used = uses >= 2  # a document read once is no shared prefix
    # the fit finds each document read twice or more as one shared prefix, at the document's depth, branched
    # off by the other reads (a question of one block right after a first read is read as its next turn)
    found = params["describe"]["shared_prefixes"]["most_used"]
    assert sorted(p["depth_blocks"] for p in found) == sorted(lengths[used].tolist())
    twin = synthesize(params, seed=seed)
    # the twin draws every request once, so each document is read as often as in the trace; whichever read
    # comes first in the twin shares nothing
    got = _uses_by_document(twin, int(lengths.min()))
    assert got == sorted((uses[used] - 1).tolist(), reverse=True)


def test_twin_validates_and_keeps_hit_rates(chat, tmp_path, seed):
    table, meta, params = chat
    twin = synthesize(params, seed=seed)
    assert validate_table(twin, meta.block_size, "twin").ok
    # seeds 0-2 measured 0.010-0.025 (benchmarks/results/trace_fit.json has the cross-trace figures)
    assert (
        abs(
            twin_measure.infinite(twin, meta.block_size)["steady"]
            - twin_measure.infinite(table, meta.block_size)["steady"]
        )
        < 0.05
    )
    path = write_trace(twin, tmp_path / "twin.parquet", new_meta(meta.block_size, {"test": True}))
    caps = twin_measure.capacities(table, 4)
    original, synthetic = twin_measure.curve(CHAT, caps), twin_measure.curve(path, caps)
    gaps = [abs(o["steady"] - t["steady"]) for o, t in zip(original, synthetic, strict=True)]
    assert max(gaps) < 0.05  # benchmarks/trace_fit.py measures the 8-capacity curve over every trace kind


def test_scale_doubles_users_not_their_behaviour(chat):
    _, _, params = chat
    one, two = synthesize(params, seed=3), synthesize(params, seed=3, scale=2)
    assert two.num_rows == 2 * one.num_rows
    assert 1.7 < _rate(two) / _rate(one) < 2.3
    # twice the users touch twice the blocks between a prefix's uses, and the other copy its own prompt too:
    # the stack distance a little over doubles (2 D + the parent's length)
    d1, d2 = structure(one)["distance_blocks"], structure(two)["distance_blocks"]
    assert 1.8 < np.nanmedian(d2) / np.nanmedian(d1) < 3.0


def test_self_check_names_what_a_misfitted_twin_gets_wrong(chat, tmp_path):
    from kvbench.trace.fit import check

    table, meta, params = chat
    bad = json.loads(json.dumps(params))
    col = bad["units"]["columns"].index("offset_s")
    for row in bad["units"]["rows"]:
        row[col] *= 30  # every conversation's turns 30 times further apart than fitted
    twin = synthesize(bad, seed=0)
    path = write_trace(twin, tmp_path / "bad.parquet", new_meta(meta.block_size, {"test": True}))
    fid = twin_measure.fidelity(table, CHAT, twin, path, meta.block_size)
    stats = check.compare(structure(table), table, structure(twin), twin)
    warning = check.verdict(fid, stats)
    assert warning is not None and "reuse (stack distance (blocks)" in warning
    good = synthesize(params, seed=0)
    good_stats = check.compare(structure(table), table, structure(good), good)

    def ks(st):
        return st["reuse"]["statistics"]["stack distance (blocks)"]["ks"]

    assert ks(stats) > 3 * ks(good_stats)  # the fitted twin is far closer on the statistic the bad one broke


def test_same_seed_same_twin(chat):
    _, _, params = chat
    assert synthesize(params, seed=7).equals(synthesize(params, seed=7))
    assert not synthesize(params, seed=7).equals(synthesize(params, seed=8))


def test_cli_writes_twin_params_and_report(tmp_path):
    out = tmp_path / "twin.parquet"
    result = CliRunner().invoke(main, ["trace", "fit", str(CHAT), "-o", str(out), "--seed", "1"])
    assert result.exit_code == 0, result.output
    twin, meta = read_trace(out)
    assert meta.source["generator"] == "trace-fit" and twin.num_rows > 0
    params = json.loads((tmp_path / "twin.params.json").read_text())
    fid = params["fidelity"]
    assert len(fid["curve"]) == 8 and fid["infinite_cache"]["gap_steady"] < 0.05
    check = meta.source["self_check"]  # the verdict travels in the twin's own metadata
    assert check["max_curve_gap"] == fid["max_curve_gap_steady"] and check["faithful"] == fid["faithful"]
    assert set(fid["statistics"]) == {"fan-out", "reuse", "lengths", "arrivals"}
    report_md = (tmp_path / "twin.report" / "report.md").read_text()
    assert "Fidelity" in report_md and "radix-lru" in report_md
    assert "<svg" in (tmp_path / "twin.report" / "report.html").read_text()


def test_bad_input_names_the_file(tmp_path):
    missing = tmp_path / "nope.parquet"
    result = CliRunner().invoke(main, ["trace", "fit", str(missing), "-o", str(tmp_path / "t.parquet")])
    assert result.exit_code != 0 and str(missing) in result.output
    junk = tmp_path / "junk.parquet"
    junk.write_text("not parquet")
    result = CliRunner().invoke(main, ["trace", "fit", str(junk), "-o", str(tmp_path / "t.parquet")])
    assert result.exit_code != 0 and str(junk) in result.output
    assert not (tmp_path / "t.parquet").exists()


def test_units_are_conversations_and_named_sessions_not_shared_prompts():
    from kvbench.trace.fit.units import units_of

    # A and B start on one system prompt [1, 2]; each next turn extends its own conversation
    blocks = [[1, 2, 3, 4], [1, 2, 7, 8], [1, 2, 3, 4, 5], [1, 2, 7, 8, 9]]
    table = pa.table(
        {
            "request_id": ["a1", "b1", "a2", "b2"],
            "arrival_s": [0.0, 1.0, 5.0, 9.0],
            "block_hashes": pa.array(blocks, pa.list_(pa.uint64())),
        }
    )

    def units(t):
        st = structure(t)
        return units_of(t, st["kind"] == EXTEND, st["parent"]).tolist()

    assert units(table) == [0, 1, 0, 1]
    # a trace that names one session for all four, or a parent_id from b1 to a1, ties them into one unit
    named = table.append_column("session_id", pa.array(["s"] * 4))
    assert units(named) == [0, 0, 0, 0]
    parented = table.append_column("parent_id", pa.array([None, "a1", None, None], pa.string()))
    assert units(parented) == [0, 0, 0, 0]


def test_a_subsampled_fit_keeps_whole_units_and_the_prefixes_they_share(seed, monkeypatch):
    from kvbench.trace.fit import units

    table = _known(seed)  # 40 conversations of 5 turns on one root prompt
    monkeypatch.setattr(units, "MAX_ROWS", 60)
    params, st = fit(table, 16)
    rows = np.asarray(params["units"]["rows"])
    unit = rows[:, 0].astype(int)
    drawn = unit[unit >= 0]
    # 12 whole units of 5 turns fit in 60 rows; the rows the root prompt comes from are kept, never emitted
    assert np.bincount(drawn)[np.unique(drawn)].tolist() == [5] * 12
    twin = synthesize(params, seed=seed)
    # the twin has as many units as the trace, each drawn whole (repeats with fresh ids), all on the root
    assert twin.num_rows == table.num_rows and validate_table(twin, 16, "twin").ok
    st_twin = structure(twin)
    assert st_twin["shared"].sum() / st_twin["n_blocks"].sum() == pytest.approx(
        st["shared"].sum() / st["n_blocks"].sum(), abs=0.02
    )
    roots = {r[0] for r in twin.column("block_hashes").to_pylist()}
    assert len(roots) == 1


def test_twin_places_each_unit_once_keeping_its_timing(seed):
    table = _known(seed)  # 40 conversations of 5 turns, all on one root prompt, alike in the work they bring
    params, _ = fit(table, 16)
    info: dict = {}
    twin = synthesize(params, seed=seed, info=info)
    # every conversation placed once; some at another's start (they are alike), the rest at their own
    assert info["units"] == 40 and 0 < info["moved_share"] <= 1

    def gaps(t):
        s = session_stats(
            np.unique(t.column("session_id").to_numpy(zero_copy_only=False), return_inverse=True)[1],
            t.column("arrival_s").to_numpy(),
        )
        return s["sessions"], s["turn_gap_s"]

    (n0, g0), (n1, g1) = gaps(_with_sessions(table)), gaps(twin)
    assert n1 == n0 == 40 and g1 == pytest.approx(g0, abs=1e-5)  # turn gaps kept exactly (as quantiles)
    # the twin's start times are the trace's own: the same first arrivals of conversations (a moved
    # conversation keeps its own turn gaps, so its second turn may come before a later start)
    sessions = np.unique(twin.column("session_id").to_numpy(zero_copy_only=False), return_inverse=True)[1]
    first = np.full(sessions.max() + 1, np.inf)
    np.minimum.at(first, sessions, twin.column("arrival_s").to_numpy())
    t = table.column("arrival_s").to_numpy()
    assert np.sort(first) == pytest.approx(t[:40] - t[0], abs=1e-5)


def _with_sessions(table: pa.Table) -> pa.Table:
    """_known's trace with each conversation named (request i is conversation i mod 40)."""
    return table.append_column("session_id", pa.array([f"c{i % 40}" for i in range(table.num_rows)]))
