"""`kvbench audit isolation` on fake servers that honour and that ignore cache_salt (the real engines are in
tests/integration)."""

import json
import subprocess

import pytest

from kvbench.errors import KvbenchError
from kvbench.live.audit import audit_isolation
from kvbench.testing.fakeserver import FakeServer

from .conftest import RunningServer, free_port


@pytest.mark.parametrize(("ignore_salt", "passed"), [(False, True), (True, False)])
def test_verdict(ignore_salt, passed):
    srv = RunningServer(FakeServer(block_size=16, ignore_salt=ignore_salt))
    try:
        result = audit_isolation(srv.url)
        assert result["passed"] is passed
        control, same, other, unsalted = result["probes"]
        assert control["hit"] and same["hit"] and control["cached_tokens"] == 496  # (512 - 1) // 16 blocks
        assert other["hit"] is ignore_salt and unsalted["hit"] is ignore_salt
        assert ("salts are ignored" in result["verdict"]) is ignore_salt
        # the CLI exits 1 when salts do not isolate, and prints JSON on request
        r = subprocess.run(
            ["kvbench", "audit", "isolation", "--url", srv.url, "--json"], capture_output=True, text=True
        )
        assert r.returncode == (0 if passed else 1) and json.loads(r.stdout)["passed"] is passed
    finally:
        srv.stop()


def test_unreachable_server_is_one_clear_error():
    with pytest.raises(KvbenchError, match="cannot probe .*engine status"):
        audit_isolation(f"http://127.0.0.1:{free_port()}")
