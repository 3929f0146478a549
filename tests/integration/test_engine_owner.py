"""A test session stops the engines it started and only those (tests/conftest.py, `kvbench.engines.stop_owned`),
checked with stand-in servers in a temporary engine folder: the real engine CI or a developer runs is never
touched."""

from __future__ import annotations

import os
import sys
import types

import pytest

from kvbench import engines
from kvbench.engines import base

from ..conftest import free_port
from .conftest import FAKE_SERVER


@pytest.fixture
def two_fakes(tmp_path, monkeypatch):
    """Engines 'fake-a' and 'fake-b' (10-line HTTP servers) registered beside the real ones, folders in tmp_path."""
    monkeypatch.setenv("KVBENCH_ENGINE_DIR", str(tmp_path))
    script = tmp_path / "server.py"
    script.write_text(FAKE_SERVER)

    def spec(name):
        return types.SimpleNamespace(
            NAME=name,
            settings=lambda port=None, flavour="": {"port": port, "flavour": flavour},
            provision=lambda s, progress: base.engine_dir(name).mkdir(parents=True, exist_ok=True),
            command=lambda s: ([sys.executable, str(script), str(s["port"])], {}, "m", 16),
            hint=lambda: "",
        )

    for name in ("fake-a", "fake-b"):
        monkeypatch.setitem(engines.ENGINES, name, spec(name))
    yield
    for name in ("fake-a", "fake-b"):
        engines.down(name, grace_s=2)


def test_the_session_marks_what_it_starts():
    assert os.environ[base.OWNER_ENV].startswith("pytest-")  # set by tests/conftest.py for the whole session


def test_only_the_owners_engines_are_stopped(two_fakes, monkeypatch):
    monkeypatch.setenv(base.OWNER_ENV, "session-1")
    mine = engines.up("fake-a", port=free_port())
    monkeypatch.delenv(base.OWNER_ENV)
    theirs = engines.up("fake-b", port=free_port())  # e.g. .ci/start-engines, before the session
    assert (mine.owner, theirs.owner) == ("session-1", None)
    assert {r["engine"]: r["owner"] for r in engines.status()}["fake-a"] == "session-1"
    assert engines.stop_owned("other-session") == {}
    assert engines.stop_owned("session-1") == {"fake-a": "stopped"}
    assert not base.pid_alive(mine.pid) and engines.running("fake-a") is None
    assert engines.running("fake-b").pid == theirs.pid  # left running


def test_a_restart_keeps_the_engine_whoever_s_it_was(two_fakes, monkeypatch):
    """A test that restarts a running engine with other settings (and puts it back) does not make it its own."""
    port = free_port()
    monkeypatch.delenv(base.OWNER_ENV, raising=False)
    before = engines.up("fake-a", port=port)
    monkeypatch.setenv(base.OWNER_ENV, "session-1")
    changed = engines.up("fake-a", port=port, flavour="small", restart=True)
    assert changed.pid != before.pid and changed.owner is None
    assert engines.stop_owned("session-1") == {}
    assert engines.running("fake-a").pid == changed.pid
    engines.down("fake-a", grace_s=2)
    started = engines.up("fake-a", port=port)  # not running: now it is the session's
    assert started.owner == "session-1" and engines.stop_owned("session-1") == {"fake-a": "stopped"}


def test_the_owner_does_not_leak_into_the_engine_s_environment(monkeypatch):
    monkeypatch.setenv(base.OWNER_ENV, "session-1")
    assert base.OWNER_ENV not in base.clean_env()
