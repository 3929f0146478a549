"""Point names carry their units, and a run recorded with the bare names of kvbench 0.1.0 is still read
(tests/data/runs/chat40-sim is one: sim points `vllm/16` … recorded by 0.1.0)."""

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import kvbench
from kvbench.run.backend import PointResult
from kvbench.run.comparison import load_run
from kvbench.run.pointnames import LegacyPointNames, legacy_name, point_name, renames
from kvbench.run.results import read_requests

OLD_RUN = Path(__file__).parents[2] / "data" / "runs" / "chat40-sim"


def test_each_number_carries_the_unit_its_key_names():
    assert PointResult({"policy": "lru", "capacity_blocks": 1000}).name == "lru/1000blocks"
    assert point_name({"policy": "vllm", "instances": 2}) == "vllm/2instances"
    assert point_name({"policy": "lru"}) == "lru" and point_name({"point": "live"}) == "live"
    assert point_name({"policy": "lru", "capacity": "4GiB"}) == "lru/4GiB"  # text is kept as written
    assert legacy_name("vllm/2instances") == "vllm/2" and legacy_name("tenant-quota/8blocks") == "tenant-quota/8"


def test_renames_only_points_named_by_their_bare_label_values():
    points = [
        {"name": "lru/16", "policy": "lru", "capacity_blocks": 16, "hit_rate": 0.1},
        {"name": "vllm/2", "policy": "vllm", "instances": 2, "latency": {}},
        {"name": "lru/16blocks", "policy": "lru", "capacity_blocks": 16},  # recorded today
        {"name": "live", "point": "live"},
        {"name": "odd/3", "policy": "lru", "capacity_blocks": 16},  # not its labels' values: left alone
    ]
    assert renames(points) == {"lru/16": "lru/16blocks", "vllm/2": "vllm/2instances"}


def test_an_old_run_reads_with_todays_names_and_one_warning(tmp_path):
    run_dir = shutil.copytree(OLD_RUN, tmp_path / "old")
    on_disk = pq.read_table(run_dir / "requests.parquet", columns=["point"]).column("point")
    before = (run_dir / "summary.json").read_bytes()
    with pytest.warns(LegacyPointNames, match=r"0\.1\.0 .*\(vllm/16\); read as vllm/16blocks") as caught:
        summary = load_run(run_dir)
        rows = read_requests(run_dir)
    assert len([w for w in caught if issubclass(w.category, LegacyPointNames)]) == 1  # once per run
    names = [p["name"] for p in summary["points"]]
    assert names[:3] == ["vllm/16blocks", "vllm/64blocks", "vllm/100000000blocks"]
    assert set(rows.column("point").to_pylist()) == set(names)
    # row for row the same points as on disk, only spelt with the unit
    assert [legacy_name(n) for n in rows.column("point").to_pylist()] == on_disk.to_pylist()
    assert (run_dir / "summary.json").read_bytes() == before  # nothing on disk rewritten


def test_an_old_name_still_answers_in_the_api_with_a_warning(tmp_path):
    with pytest.warns(LegacyPointNames, match="recorded by kvbench 0.1.0"):
        run = kvbench.open_run(shutil.copytree(OLD_RUN, tmp_path / "old"))
    with pytest.warns(LegacyPointNames, match="'lru/64' is the old spelling of 'lru/64blocks'"):
        assert run.hit_rate["lru/64"] == run.hit_rate["lru/64blocks"] > 0
    assert run.hit_rate.get("lru/65") is None
    with pytest.raises(KeyError):
        run.hit_rate["lru/65"]


def test_comparing_an_old_run_with_a_new_one_matches_points_by_todays_names(tmp_path):
    old = shutil.copytree(OLD_RUN, tmp_path / "old")
    new = shutil.copytree(OLD_RUN, tmp_path / "new")
    summary = json.loads((new / "summary.json").read_text())
    for p in summary["points"]:  # as kvbench writes it today
        p["name"] = point_name({"policy": p["policy"], "capacity_blocks": p["capacity_blocks"]})
    (new / "summary.json").write_text(json.dumps(summary))
    rows = pq.read_table(new / "requests.parquet")
    named = pa.array([n + "blocks" for n in rows.column("point").to_pylist()], pa.string())
    pq.write_table(rows.set_column(rows.column_names.index("point"), "point", named), new / "requests.parquet")
    with pytest.warns(LegacyPointNames):
        result = kvbench.compare([old, new])
    by_run: dict = {}
    for r in result["runs"]:
        by_run.setdefault(r["point"], {})[r["run"]] = r
    assert all(len(runs) == 2 for runs in by_run.values()) and "lru/64blocks" in by_run
    first, second = by_run["lru/64blocks"].values()
    assert first["hit rate"] == second["hit rate"]


def test_the_cli_prints_the_warning_as_one_line(tmp_path):
    from click.testing import CliRunner

    from kvbench.cli import main

    run_dir = shutil.copytree(OLD_RUN, tmp_path / "old")
    r = CliRunner().invoke(main, ["report", str(run_dir)])
    assert r.exit_code == 0, r.output
    assert f"kvbench: warning: {run_dir}: recorded by kvbench 0.1.0" in r.stderr
    assert "LegacyPointNames" not in r.stderr and "warnings.warn" not in r.stderr
    assert "| lru/64blocks |" in (run_dir / "report.md").read_text()
