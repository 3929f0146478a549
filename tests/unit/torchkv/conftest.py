import importlib.util

import pytest

from kvbench.trace.files import read_trace, write_trace

if importlib.util.find_spec("torch") is None:  # the torch backend needs torch: pip install -e '.[torch]'
    collect_ignore_glob = ["test_*.py"]

SAMPLES = "traces/samples"


@pytest.fixture(scope="session")
def small_trace(tmp_path_factory):
    """A few hundred requests of a sample trace, written as a real trace file: {kind: path}."""

    def make(kind: str, rows: int):
        table, meta = read_trace(f"{SAMPLES}/{kind}.parquet")
        path = tmp_path_factory.mktemp("traces") / f"{kind}-{rows}.parquet"
        write_trace(table.slice(0, rows), path, meta)
        return path

    cache = {}

    def get(kind: str = "chat", rows: int = 300):
        if (kind, rows) not in cache:
            cache[kind, rows] = make(kind, rows)
        return cache[kind, rows]

    return get
