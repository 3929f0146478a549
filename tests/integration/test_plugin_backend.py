"""The plug-in route, taken as an outside user takes it: tests/plugins/kvbench-example-backend is its own
distribution with its own `kvbench.backends` entry point, pip-installed (as .ci/run does), and a trace is
replayed through it by the `kvbench` command. Without it installed these tests skip and say how to install
it, except when KVBENCH_REQUIRE_ENGINES is set (CI), when they fail."""

import json
import subprocess
from importlib.metadata import PackageNotFoundError, distribution

import pyarrow.parquet as pq
import pytest

from kvbench.run import plugins

from ..conftest import CHAT, REPO, missing

PLUGIN = REPO / "tests" / "plugins" / "kvbench-example-backend"
CHAT_BLOCKS = 20404  # distinct block hashes of chat.parquet: a cache this large never evicts


@pytest.fixture(scope="module")
def example():
    try:
        distribution("kvbench-example-backend")
    except PackageNotFoundError:
        missing(
            "KVBENCH_REQUIRE_ENGINES",
            f"the example plug-in is not installed: python3 -m pip install --no-deps {PLUGIN.relative_to(REPO)}",
        )
    assert "example" in plugins.backend_names()


def replay(tmp_path, name, *options):
    out = tmp_path / name
    result = subprocess.run(
        ["kvbench", "replay", str(CHAT), "--out", str(out), "--no-report", "--json", *options],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout), pq.read_table(out / "requests.parquet")


def test_the_example_plugin_is_a_fifo_cache_like_the_builtin_one(example, tmp_path):
    """Its FIFO of 3000 blocks follows the rule of `--backend sim --policy fifo` (chat.parquet has no
    cache_salt or LoRA to fold into the keys), so every request hits and evicts as many blocks in both.
    The oracle is kvbench's own sim (itself checked against its Python reference in tests/unit/sim), not an
    outside figure: what this test proves is the plug-in route, discovery to results, not a hit rate."""
    summary, rows = replay(tmp_path, "example", "--backend", "example", "--capacity", "3000")
    sim, sim_rows = replay(tmp_path, "sim", "--backend", "sim", "--policy", "fifo", "--capacity", "3000", "--no-bound")
    assert summary["backend"] == "example" and summary["complete"]
    assert summary["config"]["capacity"] == 3000
    assert [p["name"] for p in summary["points"]] == ["fifo/3000blocks"]
    assert rows.column("hit_blocks").to_pylist() == sim_rows.column("hit_blocks").to_pylist()
    assert rows.column("evictions").to_pylist() == sim_rows.column("evictions").to_pylist()
    assert summary["hit_rate"] == sim["hit_rate"]
    assert 0 < summary["hit_rate"]["token"]["all"] < summary["infinite_cache"]["token"]["all"]


def test_a_cache_that_holds_every_block_hits_as_an_unbounded_one(example, tmp_path):
    """The infinite-cache figure is counted from the trace itself (every block seen before is a hit), not by
    any backend."""
    summary, rows = replay(tmp_path, "big", "--backend", "example", "--capacity", str(CHAT_BLOCKS))
    assert summary["evictions"] == 0 and sum(rows.column("evictions").to_pylist()) == 0
    assert summary["hit_rate"] == summary["infinite_cache"]


class NotABackend:
    """What a plug-in that implements no protocol looks like to kvbench: a `replay`, but no declared kind."""

    name = "broken"

    @classmethod
    def cli_options(cls):
        return []

    def replay(self, trace, meta, progress=None):
        return iter(())


def test_a_plugin_that_implements_no_protocol_is_refused_by_name(monkeypatch):
    from click.testing import CliRunner

    from kvbench.cli import main

    monkeypatch.setitem(plugins.BACKENDS, "broken", NotABackend)  # as if an entry point named it
    with pytest.raises(KeyError, match="backend broken implements none of the kvbench backend protocols"):
        plugins.load_backend("broken")
    result = CliRunner().invoke(main, ["replay", str(CHAT), "--backend", "broken"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "backend broken implements none of the kvbench backend protocols (kvbench.run.backend)" in result.output
    assert "declares no kind" in result.output
