"""`kvbench replay` with the sim backend: run directory, summary keys, reports, errors, interruption."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kvbench.run.runner import run_replay
from kvbench.trace.files import new_meta, write_trace
from kvbench.trace.schema import conform
from tests.conftest import CHAT, REPO, kvbench, without_fairness_views

TENANTS = REPO / "traces/samples/multi-tenant.parquet"


def test_sweep_writes_results_summary_and_reports(tmp_path):
    out = tmp_path / "run"
    r = kvbench("replay", CHAT, "--policy", "lru", "--capacity", "200,2000", "--no-bound", "--out", out)
    assert r.returncode == 0, r.stderr
    assert "lru/200blocks" in r.stdout and "lru/2000blocks" in r.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["complete"] and summary["backend"] == "sim"
    assert summary["trace"]["requests"] == 2000 and len(summary["trace"]["fingerprint"]) == 32
    assert [p["capacity_blocks"] for p in summary["points"]] == [200, 2000]
    small, large = (p["hit_rate"]["token"]["all"] for p in summary["points"])
    assert 0 <= small < large <= summary["infinite_cache"]["token"]["all"] + 1e-12
    results = pq.read_table(out / "requests.parquet")
    assert results.num_rows == 4000
    assert set(results.column("point").to_pylist()) == {"lru/200blocks", "lru/2000blocks"}
    hits = results.filter(pa.compute.equal(results.column("point"), "lru/2000blocks")).column("hit_tokens").to_numpy()
    assert hits.sum() == summary["points"][1]["hit_tokens"]
    html = (out / "report.html").read_text()
    assert html.count("<svg") >= 1 and "Hit rate vs capacity" in html and "http" not in html.split("<svg")[0]
    assert "| lru/200blocks |" in (out / "report.md").read_text()


def test_single_point_has_top_level_keys_and_json_output(tmp_path):
    r = kvbench(
        "replay",
        TENANTS,
        "--policy",
        "lru",
        "--capacity",
        "2000",
        "--no-bound",
        "--out",
        tmp_path / "r",
        "--json",
        "--no-report",
    )
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    for key in ("hit_rate", "evictions", "fairness", "by_tenant", "by_workload"):
        assert key in s
    assert s["hit_rate"]["token"]["steady"] >= 0 and s["hit_rate"]["block"]["all"] >= 0
    assert 0 < s["fairness"]["jain"]["hit_rate"] <= 1
    ev = s["fairness"]["evictor_victim"]
    assert len(ev["matrix"]) == len(ev["tenants"]) and np.sum(ev["matrix"]) == s["evictions"]
    assert not (tmp_path / "r" / "report.html").exists()


def test_capacity_units(tmp_path):
    r = kvbench(
        "replay",
        CHAT,
        "--capacity",
        "64k tok,1GiB",
        "--model",
        "llama3-8b",
        "--kv-dtype",
        "fp8",
        "--no-bound",
        "--out",
        tmp_path / "r",
        "--no-report",
    )
    assert r.returncode == 0, r.stderr
    s = json.loads((tmp_path / "r" / "summary.json").read_text())
    # 64k tokens / 64-token blocks; 1 GiB / (131072 B/token bf16 / 2 for fp8) / 64 tokens per block
    assert [p["capacity_blocks"] for p in s["points"]] == [1000, 2**30 // (65536 * 64)]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--policy", "nope", "--capacity", "10"], "unknown policy 'nope'"),
        (["--capacity", "0"], "must be > 0"),
        (["--capacity", "lots"], "not understood"),
        (["--capacity", "40GiB"], "pass --model"),
        (["--policy", "tenant-quota", "--capacity", "100", "--quota", "a=0.5"], "needs the trace column 'tenant'"),
        ([], "give --capacity"),
        (["--backend", "nope", "--capacity", "10"], "unknown backend"),
    ],
)
def test_bad_input_is_one_clear_line(tmp_path, args, message):
    r = kvbench("replay", CHAT, *args, "--out", tmp_path / "r")
    assert r.returncode != 0
    assert "Traceback" not in r.stderr and message in r.stderr, r.stderr


def _two_tenant_trace(tmp_path, salts):
    ids = [[11, 12, 13], [11, 12, 13]]
    t = conform(
        pa.table(
            {
                "request_id": ["a", "b"],
                "arrival_s": [0.0, 1.0],
                "input_tokens": [12, 12],
                "output_tokens": [1, 1],
                "block_hashes": pa.array(ids, pa.list_(pa.uint64())),
                "tenant": ["x", "y"],
                "cache_salt": salts,
            }
        )
    )
    return write_trace(t, tmp_path / f"t{len(set(salts))}.parquet", new_meta(4, {"test": True}))


def test_salted_tenants_never_share_blocks(tmp_path):
    def second_hit(path, *flags):
        _, s = run_replay(
            path,
            "sim",
            {"policy": "lru", "capacity": "100", "bound": False, **dict(flags)},
            out=tmp_path / f"{path.stem}-{len(flags)}",
            report=False,
        )
        return s["by_tenant"][[g["name"] for g in s["by_tenant"]].index("y")]["hit_tokens"]

    salted = _two_tenant_trace(tmp_path, ["s1", "s2"])
    shared = _two_tenant_trace(tmp_path, ["s1", "s1"])
    assert second_hit(salted) == 0
    assert second_hit(shared) == 12
    assert second_hit(salted, ("salt", False)) == 12  # isolation off: the same trace shares again


def test_interrupted_run_keeps_finished_points(tmp_path, monkeypatch):
    import dataclasses

    from kvbench.cache import policies

    lru = policies.get("lru")
    calls = []

    def interrupted_on_second_point(trace, capacity, options=None):  # fault injection (Ctrl-C)
        calls.append(capacity)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return lru.kernel(trace, capacity, options)

    monkeypatch.setitem(
        policies._REGISTRY._entries, "lru", dataclasses.replace(lru, kernel=interrupted_on_second_point)
    )
    run_dir, s = run_replay(
        CHAT, "sim", {"policy": "lru", "capacity": "100,200,300", "bound": False}, out=tmp_path / "r"
    )
    assert s["interrupted"] and not s["complete"] and len(s["points"]) == 1
    saved = json.loads((run_dir / "summary.json").read_text())
    assert len(saved["points"]) == 1 and saved["interrupted"]
    assert pq.read_table(run_dir / "requests.parquet").num_rows == 2000
    assert (run_dir / "report.html").exists()


def test_curve_with_belady_bound(tmp_path):
    out = tmp_path / "curve"
    r = kvbench("replay", CHAT, "--policy", "lru,vllm", "--curve", "--out", out)
    assert r.returncode == 0, r.stderr
    s = json.loads((out / "summary.json").read_text())
    assert [c["policy"] for c in s["curves"]] == ["lru"]  # (vllm is not a stack algorithm: no one-pass curve)
    for c in s["curves"]:
        assert np.all(np.diff(c["capacity_blocks"]) > 0)
        assert np.all(np.diff(c["token_steady"]) >= 0)  # more cache never hurts a stack policy
        assert c["token_all"][-1] <= s["infinite_cache"]["token"]["all"] + 1e-12
    bound = {p["capacity_blocks"]: p["hit_rate"]["token"]["steady"] for p in s["points"] if p["policy"] == "belady"}
    assert len(bound) >= 5
    lru = s["curves"][0]
    for cap, h in bound.items():  # optimum(C) >= lru(C) >= lru(C') for the largest sampled C' <= C
        i = np.searchsorted(lru["capacity_blocks"], cap, side="right") - 1
        assert i >= 0 and h >= lru["token_steady"][i] - 1e-12
    assert "one-pass curve" in (out / "report.html").read_text()


def test_curve_needs_a_stack_policy(tmp_path):
    r = kvbench("replay", CHAT, "--policy", "fifo", "--curve", "--out", tmp_path / "r")
    assert r.returncode != 0 and "needs a stack policy" in r.stderr


@pytest.mark.parametrize("sample", ["multi-tenant", "mix"])
def test_streamed_replay_equals_in_memory(tmp_path, sample):
    """--stream (block ids read by row group, ids recycled) gives the in-memory run's results exactly."""
    trace = REPO / f"traces/samples/{sample}.parquet"
    runs = {}
    for mode in ("--stream", "--no-stream"):
        out = tmp_path / mode
        args = ("replay", trace, "--policy", "lru,vllm", "--capacity", "300,4000", "--no-bound", "--out", out, mode)
        r = kvbench(*args)
        assert r.returncode == 0, r.stderr
        runs[mode] = (json.loads((out / "summary.json").read_text()), pq.read_table(out / "requests.parquet"))
    (streamed, s_rows), (whole, w_rows) = runs["--stream"], runs["--no-stream"]
    assert streamed["trace"]["streamed"] and not whole["trace"]["streamed"]
    for key in ("fingerprint", "requests", "block_references"):
        assert streamed["trace"][key] == whole["trace"][key]
    assert streamed["infinite_cache"] == whole["infinite_cache"]
    assert streamed["points"] == without_fairness_views(whole["points"])  # (those views need the trace in memory)
    assert s_rows.equals(w_rows)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("--policy", "radix-lru"), "needs the whole trace in memory"),
        (("--policy", "lru", "--reference"), "--reference needs the whole trace"),
    ],
)
def test_stream_refuses_what_needs_the_whole_trace(tmp_path, extra, message):
    r = kvbench("replay", CHAT, "--capacity", "100", "--stream", "--out", tmp_path / "r", *extra)
    assert r.returncode != 0 and message in r.stderr and "Traceback" not in r.stderr


def test_metrics_summed_chunk_by_chunk_equal_the_whole_trace():
    """A streamed replay reports from per-chunk sums (MetricSums): however the rows are cut, the same dict."""
    from kvbench.metrics.hits import MetricSums, point_metrics
    from kvbench.trace.files import read_trace

    table, meta = read_trace(REPO / "traces/samples/mix.parquet")  # tenants, workloads and modalities
    n_blocks = pa.compute.list_value_length(table.column("block_hashes")).to_numpy(zero_copy_only=False)
    rng = np.random.default_rng(0)
    hit_blocks = (rng.random(table.num_rows) * (n_blocks + 1)).astype(np.int64)
    evictions = rng.integers(0, 5, table.num_rows)
    whole = point_metrics(table, n_blocks, meta.block_size, hit_blocks, 0.37, evictions)
    assert whole["by_modality"] and len(whole["by_tenant"]) > 1 and len(whole["by_workload"]) > 1
    sums = MetricSums(table.num_rows, meta.block_size, 0.37)
    for start in range(0, table.num_rows, 77):
        rows = slice(start, start + 77)
        sums.add(table.slice(start, 77), n_blocks[rows], hit_blocks[rows], evictions[rows])
    assert sums.result() == whole
