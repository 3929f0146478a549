"""No credential given to a live run is ever written down or printed: a real `kvbench replay` (a subprocess,
so that its terminal output is captured) against the fake server, with a key in the URL's user-info, in the
variable named by --api-key-env and in two --header options; once answered, once where every request fails,
once refused at discovery and once with nobody listening. Every file of the run directory (requests.parquet
read back as well as byte for byte) and the captured stdout/stderr are searched for each secret."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from ...conftest import CHAT, REPO
from .conftest import free_port

SECRETS = ("SECRET1xq", "SECRET2xq", "SECRET3xq", "SECRET4xq")


@pytest.fixture
def fake_server_process():
    """Factory: start `python -m kvbench.testing.fakeserver` with these arguments -> its port."""
    started = []

    def start(*args: str) -> int:
        port = free_port()
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvbench.testing.fakeserver", "--port", str(port), *args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        started.append(proc)
        for _ in range(200):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).close()
                return port
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("the fake server did not start")

    yield start
    for proc in started:
        proc.terminate()
        proc.wait(10)


def replay(port: int, out: Path, *extra: str) -> subprocess.CompletedProcess:
    """`kvbench replay` with every kind of credential at once."""
    url = f"http://user:{SECRETS[0]}@127.0.0.1:{port}"
    cmd = [sys.executable, "-c", "from kvbench.cli import main; main()", "replay", str(CHAT),
           "--backend", "openai", "--url", url,
           "--api-key-env", "MY_KEY", "--header", f"X-Api-Key: {SECRETS[2]}",
           "--header", f"Authorization: Bearer {SECRETS[3]}", "--mode", "rate", "--rate", "200",
           "--max-requests", "12", "--timeout", "5", "--out", str(out), *extra]  # fmt: skip
    env = {**os.environ, "MY_KEY": SECRETS[1]}
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=REPO)


def leaks(proc: subprocess.CompletedProcess, run_dir: Path) -> list[str]:
    """Where any secret shows: 'stdout', 'stderr' or a file's path (with ':rows' for parquet read back)."""
    found = []
    texts = {"stdout": proc.stdout, "stderr": proc.stderr}
    for path in sorted(run_dir.rglob("*")) if run_dir.exists() else ():
        if path.is_file():
            texts[str(path.relative_to(run_dir))] = path.read_bytes().decode("latin-1")
            if path.suffix == ".parquet":  # compressed pages would hide a secret from a byte search
                table = pq.read_table(path)
                texts[f"{path.name}:rows"] = repr(table.to_pylist()) + repr(table.schema.metadata)
    for where, text in texts.items():
        found += [f"{secret} in {where}" for secret in SECRETS if secret in text]
    return found


def test_credentials_are_used_but_never_written_down(fake_server_process, tmp_path):
    port = fake_server_process()
    proc = replay(port, tmp_path / "ok")
    assert proc.returncode == 0, proc.stderr
    assert {r["status"] for r in pq.read_table(tmp_path / "ok" / "requests.parquet").to_pylist()} == {"ok"}
    assert (tmp_path / "ok" / "report.html").exists() and (tmp_path / "ok" / "report.md").exists()
    assert leaks(proc, tmp_path / "ok") == []


def test_credentials_stay_hidden_when_the_server_accepts_them(fake_server_process, tmp_path):
    """The key is really sent: a server that wants it answers every request."""
    port = fake_server_process("--require-key", SECRETS[3])
    proc = replay(port, tmp_path / "auth", "--no-report")
    assert proc.returncode == 0, proc.stderr
    assert {r["status"] for r in pq.read_table(tmp_path / "auth" / "requests.parquet").to_pylist()} == {"ok"}
    assert leaks(proc, tmp_path / "auth") == []


def test_credentials_stay_hidden_when_every_request_fails(fake_server_process, tmp_path):
    port = fake_server_process("--fault", "every=3:html", "--fault", "every=2:cut", "--fault", "every=1:http500")
    proc = replay(port, tmp_path / "failed")
    rows = pq.read_table(tmp_path / "failed" / "requests.parquet").to_pylist()
    assert {r["status"] for r in rows} == {"error"}
    assert {r["error"].split(":")[0] for r in rows} == {"not an event stream", "stream cut", "http 500"}
    assert leaks(proc, tmp_path / "failed") == []


def test_credentials_stay_hidden_when_discovery_is_refused(fake_server_process, tmp_path):
    port = fake_server_process("--require-key", "another-key")
    proc = replay(port, tmp_path / "refused")
    assert proc.returncode != 0
    assert "answered http 403" in proc.stderr and "refused the credentials sent" in proc.stderr
    assert leaks(proc, tmp_path / "refused") == []


def test_credentials_stay_hidden_when_nobody_listens(tmp_path):
    proc = replay(free_port(), tmp_path / "down", "--served-model", "m")
    assert proc.returncode != 0 and "connection refused" in proc.stderr
    assert leaks(proc, tmp_path / "down") == []
