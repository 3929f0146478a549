"""`kvbench sweep --executor ray` on a real multi-node cluster (tests/raycluster.py: a head that runs nothing and
worker nodes of 1 CPU, each its own raylet and object store): points run on the worker nodes, traces reach them
through the object store and run directories come back through Ray, so the sweep needs no shared filesystem
(proved by a driver whose folder no node can see); a node lost mid-sweep has its points retried elsewhere."""

from __future__ import annotations

import json
import shutil
import subprocess
import tarfile
import time

import pyarrow.parquet as pq
import pytest

from tests.conftest import SAMPLES
from tests.raycluster import ClusterProcess

pytest.importorskip("ray", reason="Ray is not installed (pip install 'kvbench[ray]')")
CAPACITIES = "100,200,300,400,600,800"
TRACE = SAMPLES / "multi-tenant.parquet"
KVBENCH = shutil.which("kvbench") or pytest.skip("the kvbench command is not on PATH", allow_module_level=True)


@pytest.fixture(scope="module")
def nodes():
    cluster = ClusterProcess(2)
    try:
        yield cluster
    finally:
        cluster.close()


@pytest.fixture(scope="module")
def serial(tmp_path_factory):
    """The same grid swept in this process: what every executor must reproduce."""
    work = tmp_path_factory.mktemp("serial")
    shutil.copy(TRACE, work / "trace.parquet")
    cmd = [KVBENCH, "sweep", "--trace", "trace.parquet", "--capacity", CAPACITIES]
    r = subprocess.run([*cmd, "--out", "sweep"], cwd=work, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return work / "sweep"


def _same_points(got, want) -> dict:
    manifest = json.loads((got / "sweep.json").read_text())
    assert manifest["complete"] and {p["status"] for p in manifest["points"]} == {"ok"}
    names = sorted(p["name"] for p in manifest["points"])
    assert names == sorted(p["name"] for p in json.loads((want / "sweep.json").read_text())["points"])
    for name in names:
        a, b = pq.read_table(got / name / "requests.parquet"), pq.read_table(want / name / "requests.parquet")
        for col in ("request_id", "hit_blocks", "hit_tokens", "evictions"):
            assert a.column(col).equals(b.column(col)), (name, col)
        summary = json.loads((got / name / "summary.json").read_text())
        assert summary["complete"] and summary["trace"]["path"] == "trace.parquet"
        assert (got / name / "report.html").is_file()
    return {p["name"]: p for p in manifest["points"]}


def _sweep_cmd(address: str, *extra: str) -> list[str]:
    return [
        KVBENCH, "sweep", "--trace", "trace.parquet", "--capacity", CAPACITIES,
        "--executor", "ray", "--ray-address", address, "--out", "sweep", *extra,
    ]  # fmt: skip


def test_points_run_on_the_other_nodes_and_match_the_serial_sweep(nodes, serial, tmp_path):
    shutil.copy(TRACE, tmp_path / "trace.parquet")
    r = subprocess.run(_sweep_cmd(nodes.address), cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    points = _same_points(tmp_path / "sweep", serial)
    ran_on = {p["node"] for p in points.values()}
    assert len(ran_on) == 2, ran_on  # both worker nodes (the head has no CPU for them)


def _unshare_works() -> bool:
    if not shutil.which("unshare"):
        return False
    r = subprocess.run(["unshare", "-m", "true"], capture_output=True)
    return r.returncode == 0


@pytest.mark.skipif(not _unshare_works(), reason="needs `unshare -m` (a private mount namespace) for the driver")
def test_no_node_needs_the_drivers_folder(nodes, serial, tmp_path):
    """The driver runs in a mount namespace of its own with a private tmpfs over its folder: the nodes see that
    folder empty, so the trace can only reach them through Ray and the run directories only come back that way."""
    private, visible = tmp_path / "driver", tmp_path / "visible"
    private.mkdir()
    visible.mkdir()
    script = (
        f"set -e; mount -t tmpfs none {private}; cp {TRACE} {private}/trace.parquet; cd {private}; "
        f"{' '.join(_sweep_cmd(nodes.address))}; tar -cf {visible}/sweep.tar sweep"
    )
    r = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert not any(private.iterdir()), "the driver's folder was visible outside its namespace"
    with tarfile.open(visible / "sweep.tar") as tar:
        tar.extractall(visible, filter="data")
    _same_points(visible / "sweep", serial)


def test_a_node_lost_mid_sweep_has_its_points_retried_elsewhere(nodes, serial, tmp_path):
    shutil.copy(TRACE, tmp_path / "trace.parquet")
    proc = subprocess.Popen(_sweep_cmd(nodes.address), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    manifest = tmp_path / "sweep" / "sweep.json"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # a point done: the sweep is under way
        if manifest.is_file() and any(p["status"] == "ok" for p in json.loads(manifest.read_text())["points"]):
            break
        time.sleep(0.05)
    nodes.kill("busy")  # a node that runs a point now
    try:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        points = _same_points(tmp_path / "sweep", serial)
        retried = [p for p in points.values() if p["attempts"] > 1]
        assert retried, "no point was running on the lost node"
        assert all("worker died" in p["errors"][0] for p in retried)
    finally:
        nodes.add()  # the next tests get two live nodes again


def test_a_node_lost_mid_live_replay_loses_its_requests_and_resume_completes_the_run(nodes, tmp_path):
    """`--workers 2 --executor ray` against the fake server, one load worker per node: the lost node's unanswered
    requests are recorded `worker_lost`, and --resume sends them so the run holds each trace request once."""
    from kvbench.testing.fakeserver import FakeServer
    from kvbench.trace.files import new_meta, write_trace
    from tests.unit.live.conftest import RunningServer
    from tests.unit.live.test_distributed import N, sessions_trace

    trace = write_trace(sessions_trace(), tmp_path / "sessions.parquet", new_meta(4, {"kind": "test"}))
    srv = RunningServer(FakeServer(block_size=16, itl_s=0.05))
    cmd = [
        KVBENCH, "replay", str(trace), "--backend", "openai", "--url", srv.url, "--mode", "trace", "--time-scale", "3",
        "--workers", "2", "--executor", "ray", "--ray-address", nodes.address, "--no-report", "--out", "run",
    ]  # fmt: skip
    try:
        proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 120
        while srv.server.received < 6 and time.monotonic() < deadline:  # both workers under way
            time.sleep(0.02)
        nodes.kill(0)
        out, err = proc.communicate(timeout=300)
        rows = pq.read_table(tmp_path / "run" / "requests.parquet").to_pylist()
        lost = [r for r in rows if r["status"] == "worker_lost"]
        assert len(rows) == N and lost, (out, err)
        assert proc.returncode == 4 and "died" in err, (out, err)  # lost work is not success
        summary = json.loads((tmp_path / "run" / "summary.json").read_text())
        assert [w["status"] for w in summary["workers"]].count("dead") == 1
        answered = srv.server.received
        nodes.add()
        r = subprocess.run([*cmd, "--resume"], cwd=tmp_path, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        rows = pq.read_table(tmp_path / "run" / "requests.parquet").to_pylist()
        assert sorted(x["request_id"] for x in rows) == sorted(sessions_trace().column("request_id").to_pylist())
        assert {x["status"] for x in rows} == {"ok"}
        assert srv.server.received - answered >= len(lost)  # the lost ones were sent again
    finally:
        srv.stop()


def test_a_ray_client_driver_runs_the_sweep(nodes, serial, tmp_path):
    """`--ray-address ray://host:port`: the driver is a Ray Client, on no node of the cluster."""
    if nodes.client is None:
        pytest.skip("Ray's client extra is not installed (pip install 'ray[client]')")
    shutil.copy(TRACE, tmp_path / "trace.parquet")
    r = subprocess.run(_sweep_cmd(nodes.client), cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    _same_points(tmp_path / "sweep", serial)


def test_the_sweep_runs_as_a_ray_job(nodes, serial, tmp_path):
    """The README's recipe: `ray job submit` with the trace in the job's working directory and an absolute --out
    on the head node; the job joins its own cluster (RAY_ADDRESS) without --ray-address."""
    if nodes.dashboard is None:
        pytest.skip("Ray's default extra (its dashboard, which runs jobs) is not installed: pip install 'ray[default]'")
    job = tmp_path / "job"
    job.mkdir()
    shutil.copy(TRACE, job / "trace.parquet")
    out = tmp_path / "results"
    cmd = [
        shutil.which("ray") or "ray", "job", "submit", "--address", nodes.dashboard, "--working-dir", str(job),
        "--", "kvbench", "sweep", "--trace", "trace.parquet", "--capacity", CAPACITIES, "--executor", "ray",
        "--out", str(out),
    ]  # fmt: skip
    deadline = time.monotonic() + 120
    while True:  # the head's job agent registers a little after the cluster is up
        r = subprocess.run(cmd, capture_output=True, text=True)
        if "No available agent to submit job" not in r.stderr or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    _same_points(out, serial)
