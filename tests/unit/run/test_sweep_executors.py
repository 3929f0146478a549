"""`kvbench sweep --executor local|process|ray`: the same points, statuses and hit rates whichever executor runs
them; failed tries retried and counted (exceptions, failures, dead workers) and reported, never dropped;
resumption; live points one at a time unless --workers says otherwise."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvbench.cli import main
from kvbench.errors import KvbenchError
from kvbench.run import sweeps as sweep_module
from kvbench.run.executors import ExecutorSettings, open_pool, run_points
from kvbench.run.sweeps import Point, PointTask, name_points
from kvbench.testing.fakeserver import FakeServer
from tests.conftest import REPO
from tests.unit.live.conftest import RunningServer

CHAT = "traces/samples/chat.parquet"
GRID = ["--trace", CHAT, "--policy", "lru,fifo", "--capacity", "1000,3000,10000", "--no-bound"]
NAMES = {f"chat_sim_{p}_{c}" for p in ("lru", "fifo") for c in (1000, 3000, 10000)}
RAISES_ONCE, DIES_ONCE, DIES_ALWAYS = "chat_sim_lru_1000", "chat_sim_lru_3000", "chat_sim_fifo_3000"


def faults_dir(out) -> Path:
    """Beside the sweep folder, not in it: a sweep refuses a folder that holds something else."""
    return Path(out).with_name(Path(out).name + "-faults")


class FaultyTask(PointTask):
    """PointTask with the faults that OUT-faults/faults.json names, in place of the sweep's own. Files, because
    the worker (this process, a spawned one or a Ray worker, which imports this class from this module) and
    the test must both see them: each try counts itself in OUT-faults/<point>.tries."""

    def __call__(self, point, **kwargs):
        faults = json.loads((faults_dir(self.out_dir) / "faults.json").read_text())
        marker = faults_dir(self.out_dir) / f"{point.name}.tries"
        tries = int(marker.read_text()) + 1 if marker.exists() else 1
        marker.write_text(str(tries))
        fault = faults.get(point.name)
        if fault == "raises-once" and tries == 1:
            raise RuntimeError("injected failure")
        if fault == "dies-always" or (fault == "dies-once" and tries == 1):
            os._exit(3)  # the worker process ends without a word, as when killed
        return super().__call__(point, **kwargs)


def sweep(*args):
    return CliRunner().invoke(main, ["sweep", *map(str, args)], catch_exceptions=False)


def _points(out: Path) -> dict:
    return {p["name"]: p for p in json.loads((out / "sweep.json").read_text())["points"]}


def _hit_rates(out: Path) -> dict:
    return {n: json.loads((out / n / "summary.json").read_text())["points"][0]["hit_rate"] for n in NAMES}


@pytest.fixture(scope="module")
def local_run(tmp_path_factory):
    """The grid run by the local executor: what every other executor must reproduce."""
    out = tmp_path_factory.mktemp("local") / "sweep"
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(REPO)
        r = sweep(*GRID, "--out", out)
    assert r.exit_code == 0, r.output
    assert {n: p["status"] for n, p in _points(out).items()} == dict.fromkeys(NAMES, "ok")
    return out


def _same_as_local(out: Path, local: Path) -> None:
    points = _points(out)
    assert {n: p["status"] for n, p in points.items()} == dict.fromkeys(NAMES, "ok")
    assert all(p["attempts"] == 1 for p in points.values())
    assert _hit_rates(out) == _hit_rates(local)
    assert {n: p["hit_rate"] for n, p in points.items()} == {n: p["hit_rate"] for n, p in _points(local).items()}
    assert (out / "index.html").exists() and all((out / n / "report.html").exists() for n in NAMES)


def test_process_executor_matches_local(tmp_path, monkeypatch, local_run):
    monkeypatch.chdir(REPO)
    r = sweep(*GRID, "--executor", "process", "--workers", "2", "--out", tmp_path)
    assert r.exit_code == 0, r.output
    _same_as_local(tmp_path, local_run)
    assert json.loads((tmp_path / "sweep.json").read_text())["executor"] == "process"


def test_ray_executor_matches_local_and_resumes(tmp_path, monkeypatch, local_run, ray_cluster):
    monkeypatch.chdir(REPO)
    r = sweep(*GRID, "--executor", "ray", "--out", tmp_path)
    assert r.exit_code == 0, r.output
    _same_as_local(tmp_path, local_run)
    mtimes = {n: (tmp_path / n / "summary.json").stat().st_mtime_ns for n in NAMES}
    r = sweep(*GRID, "--executor", "ray", "--out", tmp_path)
    assert r.exit_code == 0, r.output
    assert {p["status"] for p in _points(tmp_path).values()} == {"skipped"}
    assert mtimes == {n: (tmp_path / n / "summary.json").stat().st_mtime_ns for n in NAMES}


def test_ray_executor_joins_a_running_cluster_by_address(tmp_path, local_run, ray_cluster):
    """`--ray-address` from another process: the sweep joins the session's cluster (it cannot start one at an
    address), gets the local executor's results, and leaves the cluster running when it disconnects."""
    address = ray_cluster.get_runtime_context().gcs_address
    cmd = ["kvbench", "sweep", *map(str, GRID), "--executor", "ray", "--ray-address", address, "--out", str(tmp_path)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    _same_as_local(tmp_path, local_run)
    assert ray_cluster.is_initialized() and ray_cluster.cluster_resources()["CPU"] == 2


def _faulty_sweep(monkeypatch, out: Path, faults: dict, executor: str, retries: int, *extra, policies="lru,fifo"):
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(sweep_module, "PointTask", FaultyTask)
    faults_dir(out).mkdir(parents=True, exist_ok=True)
    (faults_dir(out) / "faults.json").write_text(json.dumps(faults))
    r = sweep(
        "--trace", CHAT, "--policy", policies, "--capacity", "1000,3000,lots", "--no-bound",
        "--executor", executor, "--retries", retries, "--out", out, *extra,
    )  # fmt: skip
    return r.exit_code, _points(out)


def test_local_retries_then_reports(tmp_path, monkeypatch):
    code, points = _faulty_sweep(monkeypatch, tmp_path, {RAISES_ONCE: "raises-once"}, "local", 2)
    assert code == 1
    ok = points[RAISES_ONCE]
    assert ok["status"] == "ok" and ok["attempts"] == 2 and ok["errors"] == ["RuntimeError: injected failure"]
    for name in ("chat_sim_lru_lots", "chat_sim_fifo_lots"):  # fails every time: 1 try + 2 retries
        assert points[name]["status"] == "failed" and points[name]["attempts"] == 3
        assert "lots" in points[name]["error"] and len(points[name]["errors"]) == 3
    assert points["chat_sim_fifo_1000"]["attempts"] == 1 and "errors" not in points["chat_sim_fifo_1000"]
    assert "failed" in (tmp_path / "index.md").read_text()


def test_process_retries_and_dead_workers(tmp_path, monkeypatch):
    """A worker that dies takes the pool and every try in flight with it; only a try that died alone in the
    pool is counted, so the points that shared the pool with the dying one still end ok at attempt 1.
    (Which points share the pool with it is a race, so no point here fails only once.)"""
    code, points = _faulty_sweep(monkeypatch, tmp_path, {DIES_ALWAYS: "dies-always"}, "process", 1, "--workers", "2")
    assert code == 1
    failing = {DIES_ALWAYS, "chat_sim_lru_lots", "chat_sim_fifo_lots"}
    assert {n: (p["status"], p["attempts"]) for n, p in points.items()} == {
        n: ("failed", 2) if n in failing else ("ok", 1) for n in points
    }
    assert points[DIES_ALWAYS]["error"].startswith("worker died") and "lots" in points["chat_sim_lru_lots"]["error"]
    assert int((faults_dir(tmp_path) / f"{DIES_ALWAYS}.tries").read_text()) >= 2


def test_ray_retries_and_dead_workers(tmp_path, monkeypatch, ray_cluster):
    faults = {RAISES_ONCE: "raises-once", DIES_ONCE: "dies-once"}  # each death costs a new Ray worker
    code, points = _faulty_sweep(monkeypatch, tmp_path, faults, "ray", 2, policies="lru")
    assert code == 1
    assert {n: (p["status"], p["attempts"]) for n, p in points.items()} == {
        RAISES_ONCE: ("ok", 2), DIES_ONCE: ("ok", 2), "chat_sim_lru_lots": ("failed", 3),
    }  # fmt: skip
    assert points[RAISES_ONCE]["errors"] == ["RuntimeError: injected failure"]
    assert points[DIES_ONCE]["errors"][0].startswith("worker died")
    assert "lots" in points["chat_sim_lru_lots"]["error"] and len(points["chat_sim_lru_lots"]["errors"]) == 3
    assert (tmp_path / DIES_ONCE / "summary.json").exists()  # written by the worker, read here


def test_live_points_run_one_at_a_time_unless_workers_given(tmp_path, monkeypatch):
    """Offline points of a stage use the whole pool; its live points one at a time, on this machine."""
    calls = []
    real = sweep_module.run_points

    def recording(pool, task, points, retries, limit=None, here=False, on_retry=None):
        calls.append(([p.backend for p in points], limit, here))
        return real(pool, task, points, retries, limit, here, on_retry)

    monkeypatch.setattr(sweep_module, "run_points", recording)
    srv = RunningServer(FakeServer(block_size=16))
    try:
        r = sweep(
            "--trace", REPO / CHAT, "--backend", "sim,openai", "--capacity", "1000", "--no-bound",
            "--url", srv.url, "--mode", "rate", "--rate", "200", "--max-requests", "5",
            "--executor", "process", "--workers", "2", "--out", tmp_path,
        )  # fmt: skip
    finally:
        srv.stop()
    assert r.exit_code == 0, r.output
    assert calls == [(["sim"], None, False), (["openai"], 2, True)]  # --workers given: 2 live points at once
    assert _points(tmp_path)["chat_openai"]["status"] == "ok"
    calls.clear()
    monkeypatch.setattr(
        sweep_module,
        "run_points",
        lambda pool, task, points, retries, limit=None, here=False, on_retry=None: (
            calls.append(([p.backend for p in points], limit, here)) or iter(())
        ),
    )
    grid = sweep_module.Grid([str(REPO / CHAT)], ["openai"], options={"url": "http://127.0.0.1:1"})
    sweep_module.run_sweep(grid, tmp_path / "default", ExecutorSettings("process"))
    assert calls == [([], None, False), (["openai"], 1, True)]  # not given: one at a time


def test_retry_loop_counts_every_failed_try():
    points = name_points([Point(f"t{i}.parquet", "sim") for i in range(3)])
    outcomes = {"t0_sim": ["failed", "ok"], "t1_sim": ["failed"] * 5, "t2_sim": ["ok"]}

    def task(p):
        status = outcomes[p.name].pop(0)
        if status == "failed" and p.name == "t1_sim":
            raise ValueError("bad luck")
        return {"status": status, "error": "once" if status == "failed" else None}

    retried = []
    with open_pool(ExecutorSettings("local")) as pool:
        on_retry = lambda p, n, e: retried.append((p.name, n))  # noqa: E731
        done = {p.name: o for p, o in run_points(pool, task, points, retries=3, on_retry=on_retry)}
    assert {n: (o["status"], o["attempts"]) for n, o in done.items()} == {
        "t0_sim": ("ok", 2), "t1_sim": ("failed", 4), "t2_sim": ("ok", 1),
    }  # fmt: skip
    assert done["t1_sim"]["error"] == "ValueError: bad luck" and done["t0_sim"]["errors"] == ["once"]
    assert retried == [("t0_sim", 1), ("t1_sim", 1), ("t1_sim", 2), ("t1_sim", 3)]


def test_settings_errors_say_what_to_do(tmp_path, monkeypatch):
    r = sweep("--trace", REPO / CHAT, "--workers", "2", "--out", tmp_path)
    assert r.exit_code == 2 and "add --executor process" in r.output
    r = sweep("--trace", REPO / CHAT, "--executor", "process", "--ray-address", "auto", "--out", tmp_path)
    assert r.exit_code == 2 and "--executor ray only" in r.output
    grid = tmp_path / "grid.toml"
    grid.write_text(f'trace = "{REPO / CHAT}"\ncapacity = 1000\nexecutor = "local"\nworkers = 2\n')
    r = sweep(grid, "--out", tmp_path)
    assert r.exit_code == 2 and "add --executor process" in r.output  # the grid file's keys are checked too
    grid.write_text(f'trace = "{REPO / CHAT}"\ncapacity = 1000\nretries = -1\n')
    assert sweep(grid, "--out", tmp_path).exit_code == 2
    monkeypatch.setitem(sys.modules, "ray", None)  # as if not installed
    with pytest.raises(KvbenchError, match=r"pip install 'kvbench\[ray\]'"):
        open_pool(ExecutorSettings("ray"))


def test_help_explains_executors():
    r = CliRunner().invoke(main, ["sweep", "--help"])
    assert r.exit_code == 0
    for text in ("--executor", "local", "process", "ray", "--workers", "--retries", "--ray-address", "ray://"):
        assert text in r.output


class _FlakyRay:
    """Fault injection: a Ray whose client connection fails as a busy head's does, `failures` times."""

    def __init__(self, failures: int):
        self.failures, self.calls = failures, []

    def init(self, address, **kwargs):
        self.calls.append(address)
        if self.failures:
            self.failures -= 1
            raise ConnectionAbortedError("Initialization failure from server:\n")

    def shutdown(self):
        self.calls.append("shutdown")


def test_a_ray_client_connection_is_tried_again_when_the_head_cannot_start_its_server(monkeypatch):
    from kvbench.run import executors

    monkeypatch.setattr(executors.time, "sleep", lambda s: None)
    said: list[str] = []
    ray = _FlakyRay(failures=2)
    executors.init_ray(ray, "ray://head:10001", said.append)
    assert ray.calls == ["ray://head:10001", "shutdown"] * 2 + ["ray://head:10001"]
    assert len(said) == 2 and "Initialization failure from server" in said[0]
    with pytest.raises(ConnectionAbortedError):  # the last failure is the caller's to report
        executors.init_ray(_FlakyRay(failures=executors.RAY_CLIENT_TRIES), "ray://head:10001", said.append)
    plain = _FlakyRay(failures=1)
    with pytest.raises(ConnectionAbortedError):  # not a Ray Client address: no second try
        executors.init_ray(plain, "10.0.0.1:6379", said.append)
    assert plain.calls == ["10.0.0.1:6379"]
