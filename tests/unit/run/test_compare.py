"""`kvbench compare` on recorded run directories (tests/data/runs, see its README): a sim prediction and a
live vLLM CPU measurement of the same 40 requests; bootstrap intervals, differences beyond noise, and the
fidelity tables; the model vs measurement table of a modeled copy of the live run, whose errors are set by
hand; the pages must name no folder of the machine they were made on."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from kvbench.cli import main
from kvbench.run.comparison import QUANTILES, bootstrap, compare

RUNS = Path(__file__).resolve().parents[2] / "data" / "runs"
LIVE, SIM = "chat40-live", "chat40-sim"
MACHINE_PATHS = ("/work", "/tmp", "/root")


@pytest.fixture
def runs(tmp_path, monkeypatch):
    """The recorded runs copied beside the output folder, worked on by relative paths as a user would."""
    shutil.copytree(RUNS, tmp_path / "runs")
    (tmp_path / "runs" / LIVE / "report.html").write_text("<!doctype html><title>stand-in</title>")
    monkeypatch.chdir(tmp_path)
    return Path("runs")


def _with_requests(src: Path, dst: Path, change) -> Path:
    """A copy of run `src` whose requests.parquet columns are changed by `change(table) -> table`."""
    shutil.copytree(src, dst)
    t = pq.read_table(dst / "requests.parquet")
    pq.write_table(change(t), dst / "requests.parquet")
    summary = json.loads((dst / "summary.json").read_text())
    summary["run_id"] = dst.name
    (dst / "summary.json").write_text(json.dumps(summary))
    return dst


def _set(t: pa.Table, name: str, values) -> pa.Table:
    i = t.schema.get_field_index(name)
    if isinstance(values, pa.ChunkedArray):
        values = values.to_pylist()
    return t.set_column(i, name, pa.array(values, t.schema.field(name).type))


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def test_recorded_fixtures_are_small_and_portable():
    total = sum(f.stat().st_size for f in RUNS.rglob("*") if f.is_file())
    assert total < 300_000
    for f in RUNS.rglob("summary.json"):
        text = f.read_text()
        assert not any(p in text for p in MACHINE_PATHS), f


def test_fidelity_and_bootstrap_on_recorded_runs(runs):
    r = invoke("compare", runs / LIVE, runs / SIM, "--out", "out", "--json")
    assert r.exit_code == 0, r.output
    result = json.loads(r.stdout)
    assert {row["backend"] for row in result["runs"]} == {"openai", "sim"}
    # predicted vs measured hit rate, per point of the simulator, over the 40 requests both answered
    fid = {row["predicted"]: row for row in result["fidelity"]}
    vllm = next(row for name, row in fid.items() if ":vllm/" in name and name.endswith("/100000000blocks"))
    assert vllm["measured"] == LIVE and vllm["requests compared"] == 40
    assert vllm["requests equal"] == 1.0 and vllm["gap"] == 0.0  # vLLM at concurrency 1 is the vllm policy
    assert 0.3 < vllm["hit rate measured"] < 0.9
    small = [row for name, row in fid.items() if name.endswith("/16blocks")]
    assert small and all(row["hit rate predicted"] < vllm["hit rate predicted"] for row in small)
    # percentiles of the live run with their bootstrap intervals
    lat = {row["metric"]: row for row in result["latency"]}
    assert set(lat) == {"ttft", "tpot", "itl", "e2el"}
    for m, row in lat.items():
        assert row["run"] == LIVE and row["point"] == "live"
        for q in QUANTILES:
            lo, hi = row[f"p{q}_ci_ms"]
            assert 0 < lo <= hi, (m, q)
        assert row["p50_ms"] <= row["p90_ms"] <= row["p99_ms"]
    itl = pq.read_table(runs / LIVE / "requests.parquet", columns=["itl_s"])["itl_s"]
    assert lat["ttft"]["count"] == 40 and lat["itl"]["count"] == len(pc.list_flatten(itl)) <= 40 * 7
    assert result["differences"] == []  # one measured run: no baseline to differ from
    html, md = Path("out/compare.html").read_text(), Path("out/compare.md").read_text()
    for text in (html, md):
        assert not any(p in text for p in MACHINE_PATHS)
        assert "Fidelity: predicted vs measured hit rate" in text and "Latency percentiles" in text
    assert html.count("<svg") >= 3  # latency CDFs, hit-rate bars, hit rate vs capacity
    assert f"../runs/{LIVE}/report.html" in html  # relative to the output folder
    assert f"not linked (no report.html, or outside this folder's tree): {SIM}" in md
    assert json.loads(Path("out/compare.json").read_text()) == result


def test_differences_beyond_noise_are_flagged(runs):
    # 1 s more TTFT: beyond noise at every percentile (doubling it is not, at p50: 40 requests, 20-1000 ms)
    slower = _with_requests(runs / LIVE, runs / "slower", lambda t: _set(t, "ttft_s", pc.add(t["ttft_s"], 1.0)))
    same = _with_requests(runs / LIVE, runs / "same", lambda t: t)
    cmp = compare([runs / LIVE, slower, same])
    diffs = {(d["run"], d["metric"]): d for d in cmp.result["differences"]}
    assert set(diffs) == {(r, m) for r in ("slower", "same") for m in ("ttft", "tpot", "itl", "e2el")}
    assert all(d["baseline"] == f"{LIVE}:live" for d in diffs.values())
    for q in QUANTILES:
        ttft = diffs["slower", "ttft"][f"p{q}"]
        assert ttft["significant"] and ttft["diff_ms"] == pytest.approx(1000.0) and ttft["ci_ms"][0] > 0
        assert not diffs["same", "ttft"][f"p{q}"]["significant"] and diffs["same", "ttft"][f"p{q}"]["diff_ms"] == 0
    assert not diffs["slower", "tpot"]["p50"]["significant"]  # only TTFT changed
    r = invoke("compare", runs / LIVE, slower, same)
    assert r.exit_code == 0
    assert "▲ significant" in r.stdout and "≈" in r.stdout and "Differences vs baseline" in r.stdout
    assert compare([runs / LIVE, slower, same]).result == cmp.result  # seeded: the same intervals every time


def test_modeled_vs_measured_ttft(runs):
    """An offline backend that fills ttft_s (the engine simulator, later) is compared request by request."""
    live = pq.read_table(runs / LIVE / "requests.parquet", columns=["request_id", "ttft_s"])
    ttft = dict(zip(live["request_id"].to_pylist(), live["ttft_s"].to_pylist()))

    def model(t):
        return _set(t, "ttft_s", [ttft.get(rid, 0.0) + 0.001 for rid in t["request_id"].to_pylist()])

    modeled = _with_requests(runs / SIM, runs / "modeled", model)
    cmp = compare([runs / LIVE, modeled])
    rows = cmp.result["ttft_fidelity"]
    assert rows and {r["measured"] for r in rows} == {LIVE}
    for row in rows:
        assert row["requests compared"] == 40
        assert row["median |error| ms"] == pytest.approx(1.0, abs=1e-6)
        assert row["TTFT p50 modeled ms"] == pytest.approx(row["TTFT p50 measured ms"] + 1.0, abs=1e-6)
    r = invoke("compare", runs / LIVE, modeled)
    assert "Fidelity: modeled vs measured TTFT" in r.stdout


def _modeled_copy(runs: Path, name: str, change) -> Path:
    """The live run turned into an engine-sim run of one point "model" with `change(table) -> table` applied:
    a model of the live run whose errors are known in advance."""

    def as_model(t):
        t = _set(t, "point", ["model"] * t.num_rows)
        return change(t)

    path = _with_requests(runs / LIVE, runs / name, as_model)
    summary = json.loads((path / "summary.json").read_text())
    summary["backend"] = "engine-sim"
    summary["points"][0]["name"] = "model"
    (path / "summary.json").write_text(json.dumps(summary))
    return path


def test_model_vs_measurement_table(runs):
    """TTFT 10% long, TPOT 20% short, E2EL 5% long for every request, hits as the server reported them: MAPE
    10% / 20% / 5%, ratios 1.1 / 0.8 / 1.05, p90 APE 10%, 40 of 40 cached-token counts exact. Off target:
    the TPOT ratio (outside 0.85–1.15); TTFT MAPE 10% and E2EL MAPE 5% are within theirs."""

    def skew(t):
        t = _set(t, "ttft_s", pc.multiply(t["ttft_s"], 1.1))
        t = _set(t, "tpot_s", pc.multiply(t["tpot_s"], 0.8))
        t = _set(t, "e2el_s", pc.multiply(t["e2el_s"], 1.05))
        return _set(t, "hit_tokens", t["cached_tokens"])

    modeled = _modeled_copy(runs, "modeled", skew)
    r = invoke("compare", runs / LIVE, modeled, "--json")
    assert r.exit_code == 0, r.output
    (entry,) = json.loads(r.stdout)["model_vs_measurement"]
    assert entry["modeled"] == "modeled:model" and entry["measured"] == LIVE and entry["backend"] == "engine-sim"
    e = entry["table"]["overall"]
    assert e["requests"] == 40 and entry["table"]["skipped_first"] == 0
    assert e["ttft"]["mape"] == pytest.approx(0.1) and e["ttft"]["median_ratio"] == pytest.approx(1.1)
    assert e["ttft"]["p90_ape"] == pytest.approx(0.1)
    assert e["tpot"]["mape"] == pytest.approx(0.2) and e["tpot"]["median_ratio"] == pytest.approx(0.8)
    assert e["e2el"]["mape"] == pytest.approx(0.05) and e["e2el"]["median_ratio"] == pytest.approx(1.05)
    assert e["cached_tokens"]["exact"] == 40 and e["cached_tokens"]["requests"] == 40
    row = "| all | 40 (4 burst) | 10.0% | 1.100 | 10.0% | 20.0% | **0.800** | 5.0% | 1.050 | 40/40 |"
    r = invoke("compare", runs / LIVE, modeled)  # the terminal
    assert r.exit_code == 0 and "## Model vs measurement" in r.stdout and row in r.stdout
    assert "modeled:model (engine-sim) against chat40-live:" in r.stdout
    assert "22.8% TTFT and 11.8% E2E MAPE over 38 vLLM experiments" in r.stdout
    r = invoke("compare", runs / LIVE, modeled, "--out", "out", "--skip-first", "5")
    assert r.exit_code == 0, r.output
    md, html = Path("out/compare.md").read_text(), Path("out/compare.html").read_text()
    assert "## Model vs measurement" in md and "| all | 35 (4 burst) | 10.0% |" in md
    assert "first 5 requests sent left out" in md
    assert "<h2 id='model-vs-measurement'>Model vs measurement</h2>" in html
    assert html.count("class='off'") == 1 and "<td class='off' style='background:#fbe1dd;font-weight:600' " \
        "title='off target'>0.800</td>" in html and "**" not in html  # fmt: skip
    saved = json.loads(Path("out/compare.json").read_text())["model_vs_measurement"]
    assert saved[0]["table"]["overall"]["requests"] == 35 and saved[0]["table"]["skipped_first"] == 5


def test_model_vs_measurement_says_why_runs_do_not_pair(runs):
    renamed = _modeled_copy(runs, "stranger", lambda t: _set(t, "request_id", [f"x{i}" for i in range(t.num_rows)]))
    r = invoke("compare", runs / LIVE, renamed)
    assert r.exit_code == 0 and "Traceback" not in r.output
    assert "stranger not compared with chat40-live: no request id in common: not a model of that run" in r.stdout
    # the sim run of the same requests pairs, one table per point (hits only: latency cells empty)
    cmp = compare([runs / LIVE, runs / SIM, renamed])
    tables = [e for e in cmp.result["model_vs_measurement"] if "table" in e]
    assert len(tables) == 9 and all(e["backend"] == "sim" for e in tables)
    exact = {e["modeled"]: e["table"]["overall"]["cached_tokens"]["exact"] for e in tables}
    assert exact[f"{SIM}:vllm/100000000blocks"] == 40 and exact[f"{SIM}:vllm/16blocks"] < 40
    assert all(e["table"]["overall"]["ttft"] == {"requests": 0} for e in tables)
    twice = _with_requests(runs / LIVE, runs / "live-again", lambda t: t)
    r = invoke("compare", runs / LIVE, twice, runs / SIM)
    assert "model vs measurement needs one live run, not chat40-live, live-again" in r.stdout


def test_bootstrap_intervals_cover_the_truth():
    """Exponential samples: the 95% interval of the median should hold ln 2 most of the time."""
    rng = np.random.default_rng(7)
    hits = 0
    for trial in range(40):
        x = rng.exponential(1.0, 400)
        boot = bootstrap(x, np.ones(x.size, dtype=np.int64), np.random.default_rng(trial), 400)
        lo, hi = np.percentile(boot[:, 0], [2.5, 97.5])
        hits += lo <= np.log(2) <= hi
    assert hits >= 34
    # grouped values (ITL gaps of a request) are resampled together: one request of 3 gaps and one of 1
    boot = bootstrap(np.array([1.0, 1.0, 1.0, 5.0]), np.array([3, 1]), np.random.default_rng(0), 200)
    assert set(np.round(boot[:, 0], 6)) <= {1.0, 5.0}  # 3.0 would mean the gaps were split up


def test_compare_refuses_a_folder_that_is_not_a_run(tmp_path):
    r = CliRunner().invoke(main, ["compare", str(tmp_path)])
    assert r.exit_code != 0 and "not a run directory" in r.output
