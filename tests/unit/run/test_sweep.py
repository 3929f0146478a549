"""`kvbench sweep`: grids from flags and from a TOML file, resumption, failing points, engine args."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvbench import engines
from kvbench.cli import main
from kvbench.errors import KvbenchError
from kvbench.run import runner
from kvbench.run.executors import ExecutorSettings, open_pool, run_points
from kvbench.run.sweeps import Grid, Point, expand, name_points
from kvbench.testing.fakeserver import FakeServer
from tests.conftest import REPO
from tests.unit.live.conftest import RunningServer

CHAT = "traces/samples/chat.parquet"
NAMES = {f"chat_sim_{p}_{c}" for p in ("lru", "belady") for c in (1000, 10000)}


def sweep(*args):
    return CliRunner().invoke(main, ["sweep", *map(str, args)], catch_exceptions=False)


@pytest.fixture
def replays(monkeypatch):
    """Counts the replays the sweep really runs."""
    calls = []
    real = runner.run_replay

    def counting(*args, **kwargs):
        calls.append(kwargs["out"].name)
        return real(*args, **kwargs)

    monkeypatch.setattr(runner, "run_replay", counting)
    return calls


def _manifest(out: Path) -> dict:
    return json.loads((out / "sweep.json").read_text())


def test_flags_sweep_then_resume_skips_finished_points(tmp_path, monkeypatch, replays):
    monkeypatch.chdir(REPO)  # the trace by a relative path, as a user types it
    out = tmp_path / "sweep"
    args = ["--trace", CHAT, "--backend", "sim", "--policy", "lru,belady", "--capacity", "1000,10000", "--no-bound"]
    r = sweep(*args, "--out", out)
    assert r.exit_code == 0, r.output
    assert {d.name for d in out.iterdir() if d.is_dir()} == NAMES
    manifest = _manifest(out)
    assert {p["name"]: p["status"] for p in manifest["points"]} == dict.fromkeys(NAMES, "ok")
    assert manifest["complete"] and manifest["grid"]["policies"] == ["lru", "belady"]
    assert manifest["options"]["bound"] is False  # a backend option passed through to every point
    summary = json.loads((out / "chat_sim_lru_1000" / "summary.json").read_text())
    assert summary["config"]["bound"] is False and [p["name"] for p in summary["points"]] == ["lru/1000blocks"]
    assert summary["trace"]["path"] == CHAT
    by_name = {p["name"]: p for p in manifest["points"]}
    assert by_name["chat_sim_belady_10000"]["hit_rate"] >= by_name["chat_sim_lru_10000"]["hit_rate"] > 0
    assert by_name["chat_sim_lru_10000"]["hit_rate"] > by_name["chat_sim_lru_1000"]["hit_rate"]
    html, md = (out / "index.html").read_text(), (out / "index.md").read_text()
    for name in NAMES:
        assert f"{name}/report.html" in html and name in md
    assert html.count("<svg") >= 2 and "Hit rate vs capacity" in html
    assert not any(p in html + md for p in ("/work", "/tmp", "/root"))
    assert sorted(replays) == sorted(NAMES)

    mtimes = {n: (out / n / "summary.json").stat().st_mtime_ns for n in NAMES}
    r = sweep(*args, "--out", out)
    assert r.exit_code == 0, r.output
    assert {p["status"] for p in _manifest(out)["points"]} == {"skipped"}
    assert r.output.count("skipped, finished by an earlier sweep") == 4
    assert mtimes == {n: (out / n / "summary.json").stat().st_mtime_ns for n in NAMES}
    assert len(replays) == 4  # nothing replayed the second time
    assert (out / "index.html").exists()


def test_toml_sweep(tmp_path, monkeypatch):
    (tmp_path / "traces").mkdir()
    shutil.copy(REPO / CHAT, tmp_path / "traces" / "chat.parquet")
    grid = tmp_path / "grid.toml"
    grid.write_text(
        'trace = ["traces/chat.parquet"]\nbackend = "sim"\npolicy = ["lru", "belady"]\ncapacity = [1000, 10000]\n'
        'out = "sweep"\n\n[options]\nbound = false\nwarmup = 0.25\n'
    )
    monkeypatch.chdir(tmp_path / "traces")  # the file's paths are relative to the file, not to here
    r = sweep(grid)
    assert r.exit_code == 0, r.output
    out = tmp_path / "sweep"
    assert {p["name"]: p["status"] for p in _manifest(out)["points"]} == dict.fromkeys(NAMES, "ok")
    summary = json.loads((out / "chat_sim_belady_1000" / "summary.json").read_text())
    assert summary["config"]["warmup"] == 0.25 and summary["config"]["bound"] is False
    assert summary["trace"]["path"] == "chat.parquet"  # relative to the working directory
    assert (out / "index.html").exists() and (out / "index.md").exists()


def test_a_failing_point_is_reported_and_the_others_run(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    out = tmp_path / "sweep"
    r = sweep("--trace", CHAT, "--policy", "lru,belady", "--capacity", "1000,lots", "--no-bound", "--out", out)
    assert r.exit_code == 1
    points = {p["name"]: p for p in _manifest(out)["points"]}
    assert {n: p["status"] for n, p in points.items()} == {
        "chat_sim_lru_1000": "ok",
        "chat_sim_belady_1000": "ok",
        "chat_sim_lru_lots": "failed",
        "chat_sim_belady_lots": "failed",
    }
    assert "lots" in points["chat_sim_lru_lots"]["error"]
    md = (out / "index.md").read_text()
    assert "failed" in md and points["chat_sim_lru_lots"]["error"].split(":")[0] in md
    assert (out / "index.html").exists() and "chat_sim_lru_1000/report.html" in (out / "index.html").read_text()


def test_engine_args_are_refused_for_an_offline_backend(tmp_path):
    r = CliRunner().invoke(
        main,
        ["sweep", "--trace", str(REPO / CHAT), "--capacity", "100", "--engine-args", "--x 1", "--out", str(tmp_path)],
    )
    assert r.exit_code == 2 and "backend sim is offline" in r.output
    assert not (tmp_path / "sweep.json").exists()


def test_engine_args_restart_the_engine_per_stage(tmp_path, monkeypatch):
    """Live points: the engine is restarted with each engine-args value (other settings kept) before its
    points, the engine's URL is used, live options pass through, and the engine is put back at the end."""
    srv = RunningServer(FakeServer(block_size=16))
    original = engines.EngineInfo(
        "vllm-cpu", 1, srv.port, srv.url, "m", 16, "log", [], {"port": 1, "engine_args": ""}, 0
    )
    ups = []

    def up(name, restart=False, progress=None, **settings):
        ups.append((name, restart, settings))
        return original

    monkeypatch.setattr(engines, "running", lambda name: original)
    monkeypatch.setattr(engines, "up", up)
    try:
        r = sweep(
            "--trace", REPO / CHAT, "--backend", "openai", "--engine", "vllm-cpu",
            "--engine-args", "--num-gpu-blocks-override 320", "--engine-args=--enforce-eager",
            "--mode", "rate", "--rate", "200", "--max-requests", "5", "--out", tmp_path,
        )  # fmt: skip
    finally:
        srv.stop()
    assert r.exit_code == 0, r.output
    assert ups == [
        ("vllm-cpu", True, {"port": 1, "engine_args": "--num-gpu-blocks-override 320"}),
        ("vllm-cpu", True, {"port": 1, "engine_args": "--enforce-eager"}),
        ("vllm-cpu", True, {"port": 1, "engine_args": ""}),  # as it was before the sweep
    ]
    names = {p["name"] for p in _manifest(tmp_path)["points"]}
    assert names == {"chat_openai_num-gpu-blocks-override-320", "chat_openai_enforce-eager"}
    summary = json.loads((tmp_path / "chat_openai_enforce-eager" / "summary.json").read_text())
    assert summary["config"]["url"] == srv.url and summary["config"]["pacing"]["max_requests"] == 5
    assert summary["points"][0]["latency"]["requests"]["ok"] == 5


def test_point_names_are_stable_safe_and_unique():
    grid = Grid(traces=["a/chat.parquet", "b/chat.parquet"], policies=["lru"], capacities=["5M tok", "40GiB"])
    names = [p.name for p in expand(grid)]
    assert len(set(names)) == 4 and all("/" not in n and " " not in n for n in names)
    assert names[0].startswith("chat_sim_lru_5M-tok-")  # two traces named chat: a hash of the values follows
    assert names == [p.name for p in expand(grid)]
    (p,) = name_points([Point("t.parquet", "openai", engine_args="--num-gpu-blocks-override 320")])
    assert p.name == "t_openai_num-gpu-blocks-override-320"
    assert [q.name for q in expand(Grid(traces=["t.parquet"], capacities=["10"]))] == ["t_sim_lru_10"]  # default
    (q,) = name_points([Point("u.parquet", "sim")])
    with open_pool(ExecutorSettings("local")) as pool:  # in order, in this process
        assert [r for r, _ in run_points(pool, lambda r: {"status": "ok"}, [p, q])] == [p, q]
    with pytest.raises(KvbenchError, match="--policy applies to none"):
        expand(Grid(traces=["t.parquet"], backends=["openai"], policies=["lru"], options={"url": "http://x"}))


def test_help_explains_grid_and_backend_options():
    r = CliRunner().invoke(main, ["sweep", "--help"])
    assert r.exit_code == 0
    for opt in ("--trace", "--backend", "--policy", "--capacity", "--engine-args", "--engine", "--url", "--warmup"):
        assert opt in r.output


def test_a_policy_option_goes_only_to_the_points_whose_policy_takes_it(tmp_path, monkeypatch):
    """--quota under a sweep of lru and tenant-quota: the tenant-quota points get it, the lru points run
    without it (a plain replay of lru with --quota is refused: the option would be silently ignored)."""
    monkeypatch.chdir(REPO)
    trace = "traces/samples/multi-tenant.parquet"
    r = sweep("--trace", trace, "--policy", "lru,tenant-quota", "--capacity", "500", "--no-bound",
              "--quota", "tenant-0=0.2", "--out", tmp_path / "s")  # fmt: skip
    assert r.exit_code == 0, r.output
    points = {p["name"]: p for p in json.loads((tmp_path / "s" / "sweep.json").read_text())["points"]}
    assert {p["status"] for p in points.values()} == {"ok"} and len(points) == 2
    configs = {
        n: json.loads((tmp_path / "s" / p["dir"] / "summary.json").read_text())["config"] for n, p in points.items()
    }
    quota = {n: c["policy_options"].get("quota") for n, c in configs.items()}
    assert sorted(map(bool, quota.values())) == [False, True]
    assert all(("tenant-quota" in n) == bool(q) for n, q in quota.items())
