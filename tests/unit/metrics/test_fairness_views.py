"""Tenant fairness three ways (kvbench.metrics.fairness), on a hand-built two-tenant trace whose every figure can be
worked out by hand: hit rate over each tenant's own bound, hit share over entitlement, SLO attainment and the
TTFT p99 guarantee; and --quota reaching engine-sim's policies, so a partitioned pool can be compared with a
shared one."""

from __future__ import annotations

import json
from unittest.mock import ANY

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from kvbench.cli import main
from kvbench.errors import KvbenchError, KvbenchWarning
from kvbench.metrics.fairness import parse_tenant_slo, parse_tenant_weights
from kvbench.run.runner import run_replay
from kvbench.trace.files import new_meta, write_trace
from tests.conftest import make_trace

BS = 4
# tenant A sends the same two blocks twice; tenant B two prompts that share their first block. Each prompt is
# 8 tokens (2 blocks). Own bounds: A 8 hit tokens of 16 = 0.5; B 4 of 16 = 0.25.
BLOCKS = [[1, 2], [1, 2], [3, 4], [3, 5]]
TENANTS = ["A", "A", "B", "B"]


@pytest.fixture
def trace(tmp_path):
    n = len(BLOCKS)
    table = make_trace(
        n=n,
        block_size=BS,
        arrival_s=[0.0, 1.0, 2.0, 3.0],
        input_tokens=[8] * n,
        output_tokens=[4] * n,
        block_hashes=BLOCKS,
        parent_id=[None] * n,
        depends_on=[[]] * n,
        tenant=TENANTS,
        slo_ttft_ms=[1e9, 1e9, 1e-6, 1e-6],  # the trace's own targets: A's always met, B's never
    )
    return write_trace(table, tmp_path / "two-tenants.parquet", new_meta(BS, {"kind": "test"}))


def jain(xs):
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs))


def tenants_of(point):
    return {r["name"]: r for r in point["tenant_fairness"]}


def test_hit_rate_over_own_bound_and_share_over_entitlement(trace, tmp_path):
    _, summary = run_replay(
        trace, "sim", {"policy": "lru", "capacity": "100,1", "bound": False}, out=tmp_path / "run", report=False,
        fairness={"tenant_weights": {"A": 3.0, "B": 1.0}},
    )  # fmt: skip
    big, tiny = summary["points"]
    a, b = tenants_of(big)["A"], tenants_of(big)["B"]
    assert (a["own_bound"], b["own_bound"]) == (0.5, 0.25)
    # 100 blocks hold everything: each tenant gets its whole bound
    assert (a["hit_rate"], b["hit_rate"]) == (0.5, 0.25)
    assert (a["hit_rate_of_bound"], b["hit_rate_of_bound"]) == (1.0, 1.0)
    assert big["fairness"]["jain"]["hit_rate_of_bound"] == 1.0
    assert big["fairness"]["jain"]["hit_rate"] == pytest.approx(jain([0.5, 0.25]))  # 0.9: raw rates differ
    # hit tokens 8 and 4: shares 2/3 and 1/3 against entitlements 3/4 and 1/4
    assert (a["hit_share"], b["hit_share"]) == pytest.approx((2 / 3, 1 / 3))
    assert (a["entitlement"], b["entitlement"]) == (0.75, 0.25)
    assert (a["share_of_entitlement"], b["share_of_entitlement"]) == pytest.approx((8 / 9, 4 / 3))
    assert big["fairness"]["jain"]["share_of_entitlement"] == pytest.approx(jain([8 / 9, 4 / 3]))
    # one block of cache: A's second request finds block 2 (its first is gone), B's finds block 4: no hits
    assert [r["hit_rate"] for r in tiny["tenant_fairness"]] == [0.0, 0.0]
    assert tiny["fairness"]["jain"]["hit_rate_of_bound"] is None  # (Jain's index is undefined when all are 0)
    # no latency here (sim), so no SLO facts
    assert "slo_attainment" not in a and "p99_guarantee" not in big["fairness"]


def test_slo_attainment_and_the_p99_guarantee(trace, tmp_path):
    run_dir, summary = run_replay(trace, "engine-sim", {}, out=tmp_path / "modeled", report=False)
    point = summary["points"][0]
    a, b = tenants_of(point)["A"], tenants_of(point)["B"]
    # the trace's targets: A's TTFT target is 1e9 ms (met), B's 1e-6 ms (missed by every request)
    assert (a["slo_attainment"], b["slo_attainment"]) == (1.0, 0.0)
    assert (a["ttft_p99_met"], b["ttft_p99_met"]) == (True, False)
    assert point["fairness"]["p99_guarantee"] == {"met": False, "tenants": 2, "missed": ["B"]}
    assert point["fairness"]["jain"]["slo_attainment"] == pytest.approx(jain([1.0, 0.0]))  # 0.5
    rows = pq.read_table(run_dir / "requests.parquet").to_pylist()
    ttft_a = sorted(r["ttft_s"] * 1000 for r in rows if r["tenant"] == "A")
    # numpy's linear interpolation of two values at 99 %
    assert a["ttft_p99_ms"] == pytest.approx(ttft_a[0] + 0.99 * (ttft_a[1] - ttft_a[0]))
    # --tenant-slo overrides the trace's: B within 10 s, the others ('*') within 1e-6 ms
    _, summary = run_replay(
        trace, "engine-sim", {}, out=tmp_path / "given", report=False,
        fairness={"tenant_slo": parse_tenant_slo("B:ttft=10000;*:ttft=0.000001")},
    )  # fmt: skip
    point = summary["points"][0]
    assert point["fairness"]["p99_guarantee"]["missed"] == ["A"]
    assert [tenants_of(point)[t]["ttft_p99_target_ms"] for t in "AB"] == [0.000001, 10000.0]


def test_quota_partitions_engine_sim_pools(trace, tmp_path):
    """--quota reaches engine-sim's tenant-quota pool: A's share of a 10-block pool is one block."""
    opts = {"policy": "tenant-quota", "hbm_capacity": "10"}
    _, shared = run_replay(trace, "engine-sim", opts, out=tmp_path / "shared", report=False)
    _, capped = run_replay(trace, "engine-sim", {**opts, "quota": "A=0.1,*=0.9"}, out=tmp_path / "capped", report=False)
    assert capped["config"]["policy_options"]["quota"] == {"A": 0.1, "*": 0.9}
    assert tenants_of(shared["points"][0])["A"]["hit_rate"] == 0.5
    # A's first request caches block 1, then is at its quota with nothing of its own to evict (its running
    # request's blocks are protected) and caches no more: the second request hits 4 of its 8 tokens
    assert tenants_of(capped["points"][0])["A"]["hit_rate"] == 4 / 16
    assert tenants_of(capped["points"][0])["B"]["hit_rate"] == 0.25  # B's share holds all it needs
    with pytest.raises(KvbenchError, match="quota"):
        run_replay(trace, "engine-sim", {**opts, "quota": "nobody=1"}, out=tmp_path / "bad", report=False)


def test_a_streamed_replay_says_it_left_the_views_out_when_they_were_asked_for(trace, tmp_path):
    opts = {"policy": "lru", "capacity": "10", "bound": False}
    with pytest.warns(KvbenchWarning, match="tenant fairness views skipped: they need the trace in memory"):
        _, summary = run_replay(
            trace, "sim", opts, out=tmp_path / "s", stream=True, report=False, fairness={"tenant_weights": {"A": 1.0}}
        )
    assert summary["skipped"] == [{"what": "tenant fairness views", "why": ANY}]
    assert "tenant_fairness" not in summary["points"][0]
    _, summary = run_replay(trace, "sim", opts, out=tmp_path / "quiet", stream=True, report=False)
    assert "skipped" not in summary  # not asked for: a streamed run simply has Jain's index on hit rates


def test_bad_fairness_options_are_refused_before_the_run(trace, tmp_path):
    with pytest.raises(KvbenchError, match="TENANT=WEIGHT"):
        parse_tenant_weights("A3")
    with pytest.raises(KvbenchError, match="> 0"):
        parse_tenant_weights("A=0")
    with pytest.raises(KvbenchError, match="TENANT:ttft"):
        parse_tenant_slo("ttft=200")
    with pytest.raises(KvbenchError, match="--tenant-slo 'e2e=5': use ttft=MS, tpot=MS or e2el=MS"):
        parse_tenant_slo("A:e2e=5")
    both = {"A": {"ttft_ms": 1.0, "e2el_ms": 9.0}, "B": {"tpot_ms": 2.0}}
    assert parse_tenant_slo("A:ttft=1,e2el=9; B:tpot=2") == both
    out = tmp_path / "never"
    r = CliRunner().invoke(main, ["replay", str(trace), "--policy", "lru", "--capacity", "10", "--tenant-weights",
                                  "A=1,C=2", "--out", str(out)])  # fmt: skip
    assert r.exit_code != 0 and "--tenant-weights names tenants not in two-tenants.parquet: C" in r.output
    assert "its tenants: A, B" in r.output and not out.exists()
    r = CliRunner().invoke(main, ["replay", str(trace), "--policy", "lru", "--capacity", "10", "--tenant-weights",
                                  "A=1,B=2", "--no-report", "--json", "--out", str(tmp_path / "ok")])  # fmt: skip
    assert r.exit_code == 0, r.output
    summary = json.loads(r.output[r.output.index("{") :])
    assert summary["config"]["fairness"] == {"tenant_weights": {"A": 1.0, "B": 2.0}}
