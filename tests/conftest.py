import logging
import math
import os
import socket
import subprocess
import uuid
from pathlib import Path

# Imported up front: when a run used no hypothesis test, the hypothesis plugin imported it at the very end,
# and CPython 3.11.7's parser crashed there ("AST constructor recursion depth mismatch").
import hypothesis  # noqa: F401
import numpy as np
import pyarrow as pa
import pytest

REPO = Path(__file__).resolve().parents[1]
SAMPLES = REPO / "traces" / "samples"  # the sample traces committed with the repository
CHAT = SAMPLES / "chat.parquet"
# The public traces and reference data live beside the repository (../shared), or wherever KVBENCH_SHARED points.
SHARED = Path(os.environ.get("KVBENCH_SHARED", REPO.parent / "shared"))
SHARED_TRACES = SHARED / "traces"


# --- engines: a session stops those it started ---------------------------------------------------------
# Every engine started during the session (by a fixture, `kvbench demo --live` or a sweep in a subprocess, ...)
# records this session's token as its owner (kvbench.engines.base.OWNER_ENV, inherited by subprocesses); at the
# end the session stops those, and only those. One that already ran (CI's .ci/start-engines, a developer's) is
# left running, even if a test restarted it with other settings and put it back (a restart keeps the owner).
_OWNER = f"pytest-{os.getpid()}-{uuid.uuid4().hex[:8]}"
_previous_owner = None
_stopped: list[str] = []


def pytest_sessionstart(session):
    global _previous_owner
    from kvbench.engines.base import OWNER_ENV

    _previous_owner = os.environ.get(OWNER_ENV)
    os.environ[OWNER_ENV] = _OWNER


def pytest_sessionfinish(session, exitstatus):
    from kvbench import engines
    from kvbench.engines.base import OWNER_ENV

    try:
        stopped = engines.stop_owned(_OWNER)
    finally:
        if _previous_owner is None:
            os.environ.pop(OWNER_ENV, None)
        else:
            os.environ[OWNER_ENV] = _previous_owner
    if stopped:
        _stopped.append(", ".join(f"{n} ({r})" for n, r in stopped.items()))


def pytest_terminal_summary(terminalreporter):
    for line in _stopped:
        terminalreporter.write_line(f"stopped the engines this test session started: {line}")


@pytest.fixture(autouse=True)
def _own_trace_cache(tmp_path_factory, monkeypatch):
    """Each test its own empty trace cache (kvbench.run.tracecache), never the user's ~/.cache: a replay in a
    test runs cold, and a second replay of the same file in the same test loads what the first stored."""
    monkeypatch.setenv("KVBENCH_CACHE_DIR", str(tmp_path_factory.mktemp("trace-cache")))


def kvbench(*args, cwd=None) -> subprocess.CompletedProcess:
    """The installed `kvbench` command, as a user runs it: arguments made strings, output captured as text."""
    return subprocess.run(["kvbench", *map(str, args)], capture_output=True, text=True, cwd=cwd)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (now)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def missing(require_env: str, why: str):
    """Skip the test because something it needs is missing, or fail it when `require_env` is set (CI sets
    KVBENCH_REQUIRE_ENGINES, so that a missing engine or plug-in is an error there, not a quiet skip)."""
    if os.environ.get(require_env, "") not in ("", "0"):
        pytest.fail(f"{require_env} is set but {why}")
    pytest.skip(why)


def shared_trace(relative: str) -> Path:
    path = SHARED_TRACES / relative
    if not path.exists():
        pytest.skip(f"{path} not present (set KVBENCH_SHARED to the folder holding traces/)")
    return path


def fresh_seeds(n: int = 3) -> list[int]:
    """`n` seeds drawn per run, or KVBENCH_TEST_SEEDS=a,b,c to replay a failure's (printed by the caller)."""
    given = [int(s) for s in os.environ.get("KVBENCH_TEST_SEEDS", "").split(",") if s]
    return given or [int(s) for s in np.random.SeedSequence().generate_state(n) % 100_000]


def make_trace(n=6, block_size=4, **overrides) -> pa.Table:
    """A small valid trace built by hand: request i continues request i-1 and depends on it."""
    inp = [3 + 2 * i for i in range(n)]
    cols = {
        "request_id": [f"r{i}" for i in range(n)],
        "arrival_s": [0.5 * i for i in range(n)],
        "input_tokens": inp,
        "output_tokens": [i for i in range(n)],
        "block_hashes": [list(range(100 * i, 100 * i + math.ceil(t / block_size))) for i, t in enumerate(inp)],
        "parent_id": [None] + [f"r{i}" for i in range(n - 1)],
        "depends_on": [[]] + [[f"r{i}"] for i in range(n - 1)],
    }
    cols.update(overrides)
    from kvbench.trace.schema import conform

    types = {"block_hashes": pa.list_(pa.uint64())}
    return conform(pa.table({k: v if isinstance(v, pa.Array) else pa.array(v, types.get(k)) for k, v in cols.items()}))


def without_fairness_views(points: list[dict]) -> list[dict]:
    """Points as a streamed replay reports them: the per-tenant fairness views (kvbench.metrics.fairness) need the trace
    in memory, so an in-memory run's points are compared with a streamed run's without them."""
    out = []
    for p in points:
        p = {k: v for k, v in p.items() if k != "tenant_fairness"}
        if "fairness" in p:
            jain = {k: v for k, v in p["fairness"]["jain"].items() if k == "hit_rate"}
            p["fairness"] = {**{k: v for k, v in p["fairness"].items() if k != "p99_guarantee"}, "jain": jain}
        out.append(p)
    return out


@pytest.fixture
def small_trace():
    return make_trace()


@pytest.fixture(scope="session")
def mooncake_path():
    return shared_trace("mooncake/conversation_trace.jsonl")


@pytest.fixture(scope="session")
def sample_head(tmp_path_factory):
    """Factory: sample_head(kind="chat", rows=300) -> the first `rows` requests of traces/samples/<kind>.parquet,
    written once per session by kvbench's own writer (so the block size and source survive; parents come before
    their children in a sample, so a head validates)."""
    from kvbench.trace.files import read_trace, write_trace

    made: dict[tuple[str, int], Path] = {}

    def get(kind: str = "chat", rows: int = 300) -> Path:
        if (kind, rows) not in made:
            table, meta = read_trace(SAMPLES / f"{kind}.parquet")
            path = tmp_path_factory.mktemp("samples") / f"{kind}-{rows}.parquet"
            made[kind, rows] = write_trace(table.slice(0, rows), path, meta)
        return made[kind, rows]

    return get


# --- Ray: one local cluster for the session ------------------------------------------------------------
@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray cluster of 2 CPUs, started once, when the first test asks for it, and shut down at the end of
    the session; yields the `ray` module. Skips without Ray. kvbench's Ray code (the sweep's ray executor,
    kvbench.run.executors, and the live workers, kvbench.live.distributed) uses the connection this process
    already has (`ray.is_initialized()`) and leaves it running; a subprocess joins it with
    `--ray-address ray_cluster.get_runtime_context().gcs_address`."""
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'kvbench[ray]')")
    if ray.is_initialized():  # connected by someone else: theirs to shut down
        yield ray
        return
    with pytest.MonkeyPatch.context() as mp:
        # Ray puts the driver's folder on its workers' path: from the repository root they import test modules
        # (tests/unit/run/test_sweep_executors.py sends a task class of its own)
        mp.chdir(REPO)
        # "local": a cluster of its own, never one that already runs on this machine (ray.init() would join it)
        ray.init(
            address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING
        )
    try:
        yield ray
    finally:
        ray.shutdown()
