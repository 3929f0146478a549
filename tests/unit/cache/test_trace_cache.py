"""The trace cache (kvbench.run.tracecache): a replay that loads what an earlier one prepared gives the same
results, bit for bit; what changes the preparation (an option, the file) misses; a damaged entry is rebuilt
with a note; a cache that cannot be written and --no-trace-cache mean no caching. The conftest gives each test
its own empty cache folder (KVBENCH_CACHE_DIR)."""

from __future__ import annotations

import errno
import json
import os
import warnings
from pathlib import Path

import numpy as np
import pytest

from kvbench.cache.prepared import prepare
from kvbench.errors import KvbenchWarning
from kvbench.run import tracecache
from kvbench.run.runner import run_replay
from kvbench.run.tracecache import TraceCache, cache_root
from kvbench.trace.files import read_trace
from tests.conftest import kvbench

SIM = {"policy": "lru,vllm,radix-lru", "capacity": "40,400", "bound": True}
RUN_KEYS_THAT_DIFFER = ("run_id", "created", "command")  # of summary.json: when and as what a run was made


@pytest.fixture(scope="module")
def tenants_trace(tmp_path_factory) -> Path:
    """A multi-tenant trace (salts, LoRA adapters, priorities) written by `kvbench trace gen`."""
    path = tmp_path_factory.mktemp("trace") / "tenants.parquet"
    out = kvbench("trace", "gen", "multi-tenant", "-n", 400, "--tenants", 8, "--block-size", 16, "-o", path)
    assert out.returncode == 0, out.stderr
    return path


def replay(trace: Path, out: Path, trace_cache: bool = True, **options) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("error", KvbenchWarning)  # a note would mean something was not cached as it should
        run_replay(trace, "sim", {**SIM, **options}, out=out, report=False, trace_cache=trace_cache)
    return results(out)


def results(run_dir: Path) -> dict:
    """What a run measured: requests.parquet's bytes and summary.json but for when and as what it ran."""
    summary = json.loads((run_dir / "summary.json").read_text())
    return {
        "requests": (run_dir / "requests.parquet").read_bytes(),
        "summary": {k: v for k, v in summary.items() if k not in RUN_KEYS_THAT_DIFFER},
    }


def parts() -> list[str]:
    """Every part of every entry in the cache, as 'entry/part'."""
    root = cache_root()
    return sorted(f"{e.name}/{p.name}" for e in root.iterdir() for p in e.iterdir()) if root.is_dir() else []


def test_a_warm_replay_gives_the_same_results_bit_for_bit(tenants_trace, tmp_path):
    uncached = replay(tenants_trace, tmp_path / "uncached", trace_cache=False)
    assert parts() == []
    cold = replay(tenants_trace, tmp_path / "cold")
    stored = parts()
    assert [p.split("/")[1] for p in stored] == [
        "prepared-salt1-sharelora0-vllmcap0",
        "prepared-salt1-sharelora0-vllmcap1",
        "trace",
    ]
    warm = replay(tenants_trace, tmp_path / "warm")
    assert parts() == stored
    assert cold == uncached
    assert warm == uncached


def test_a_loaded_prepared_trace_equals_a_fresh_one(tenants_trace):
    table, meta = read_trace(tenants_trace)
    entry = TraceCache.for_file(tenants_trace)
    for options in ({}, {"use_salt": False, "share_lora": True, "vllm_cap": True}):
        fresh = prepare(table, meta.block_size, **options)
        fresh.next_use()
        part = entry.prepared_part(options.get("use_salt", True), options.get("share_lora", False), bool(options))
        entry.store_prepared(part, fresh)
        loaded = entry.load_prepared(part)
        assert loaded.block_size == fresh.block_size and loaded.tenant_names == fresh.tenant_names
        for name in ("offsets", "keys", "parent", "input_tokens", "max_hit", "tenant", "priority", "arrival_s"):
            got, want = getattr(loaded, name), getattr(fresh, name)
            assert got.dtype == want.dtype and np.array_equal(got, want), name
        assert np.array_equal(loaded.next_use(), fresh.next_use())


@pytest.mark.parametrize("content", [b"", b"PAR", b"not a parquet file at all", b"PAR1" + b"\xff" * 4 + b"PAR1"])
def test_a_file_that_is_not_parquet_has_no_entry(tmp_path, content):
    """Short files, other files, and a footer length past the file's start: no entry (reading says why)."""
    path = tmp_path / "x.parquet"
    path.write_bytes(content)
    assert TraceCache.for_file(path) is None
    assert TraceCache.for_file(tmp_path / "missing.parquet") is None


def test_the_entry_is_the_files_under_a_relative_path_too(tenants_trace, monkeypatch):
    monkeypatch.chdir(tenants_trace.parent)
    relative = TraceCache.for_file(Path(tenants_trace.name))
    assert relative.folder == TraceCache.for_file(tenants_trace).folder
    assert relative.footer == tracecache.parquet_footer_hash(tenants_trace)


def test_an_option_that_changes_the_preparation_misses(tenants_trace, tmp_path):
    replay(tenants_trace, tmp_path / "salted")
    for options, part in (
        ({"salt": False}, "prepared-salt0-sharelora0-vllmcap0"),
        ({"share_lora_kv": True}, "prepared-salt1-sharelora1-vllmcap0"),
    ):
        name = part.split("-", 1)[1]
        warm = replay(tenants_trace, tmp_path / f"{name}-cold", **options)
        assert any(p.endswith("/" + part) for p in parts())
        assert warm == replay(tenants_trace, tmp_path / f"{name}-uncached", trace_cache=False, **options)
        assert warm == replay(tenants_trace, tmp_path / f"{name}-warm", **options)


def test_touching_or_rewriting_the_trace_misses(tenants_trace, tmp_path):
    trace = tmp_path / "trace.parquet"
    trace.write_bytes(tenants_trace.read_bytes())
    replay(trace, tmp_path / "first")
    first = {p.split("/")[0] for p in parts()}
    os.utime(trace, ns=(trace.stat().st_atime_ns, trace.stat().st_mtime_ns + 10**9))  # touched: same bytes
    replay(trace, tmp_path / "touched")
    assert len({p.split("/")[0] for p in parts()}) == 2
    # rewritten in place with another trace: its own results, never the first one's
    out = kvbench("trace", "gen", "multi-tenant", "-n", 300, "--seed", 7, "--block-size", 16, "-o", trace)
    assert out.returncode == 0, out.stderr
    rewritten = replay(trace, tmp_path / "rewritten")
    assert len({p.split("/")[0] for p in parts()} - first) == 2
    assert rewritten == replay(trace, tmp_path / "rewritten-uncached", trace_cache=False)
    assert rewritten["summary"]["trace"]["requests"] == 300


@pytest.mark.parametrize(
    "damage",
    ["truncated arrays", "garbage trace.json", "truncated requests.arrow", "another file's footer", "missing arrays"],
)
def test_a_damaged_entry_is_rebuilt_with_a_note(tenants_trace, tmp_path, damage):
    want = replay(tenants_trace, tmp_path / "cold")
    (entry,) = cache_root().iterdir()
    prepared, trace = entry / "prepared-salt1-sharelora0-vllmcap0", entry / "trace"
    if damage == "truncated arrays":
        arrays = prepared / "arrays.bin"
        arrays.write_bytes(arrays.read_bytes()[: arrays.stat().st_size // 2])
    elif damage == "garbage trace.json":
        (trace / "trace.json").write_text("{not json")
    elif damage == "truncated requests.arrow":
        arrow = trace / "requests.arrow"
        arrow.write_bytes(arrow.read_bytes()[:100])
    elif damage == "another file's footer":
        info = json.loads((trace / "trace.json").read_text())
        (trace / "trace.json").write_text(json.dumps({**info, "footer": "0" * 32}))
    else:
        (prepared / "arrays.bin").unlink()
    with pytest.warns(KvbenchWarning, match="trace cache: .* is unreadable .*; rebuilding it"):
        run_replay(tenants_trace, "sim", SIM, out=tmp_path / "damaged", report=False)
    assert results(tmp_path / "damaged") == want
    assert replay(tenants_trace, tmp_path / "rebuilt") == want  # (no note: the entry is whole again)


def test_a_cache_that_cannot_be_written_means_no_caching(tenants_trace, tmp_path, monkeypatch):
    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(tracecache.tempfile, "mkdtemp", read_only)
    want = replay(tenants_trace, tmp_path / "uncached", trace_cache=False)
    assert replay(tenants_trace, tmp_path / "read-only", trace_cache=True) == want  # no note either
    assert parts() == []


def test_a_cache_folder_that_cannot_be_made_is_noted_once(tenants_trace, tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("KVBENCH_CACHE_DIR", str(blocker / "cache"))
    want = replay(tenants_trace, tmp_path / "uncached", trace_cache=False)
    with pytest.warns(KvbenchWarning, match="trace cache: could not store .*; this run is not cached") as notes:
        run_replay(tenants_trace, "sim", SIM, out=tmp_path / "unstorable", report=False)
    assert len([n for n in notes if "trace cache" in str(n.message)]) == 1
    assert results(tmp_path / "unstorable") == want


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only folder")
def test_a_read_only_cache_folder_means_no_caching(tenants_trace, tmp_path):
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    root.chmod(0o555)
    try:
        want = replay(tenants_trace, tmp_path / "uncached", trace_cache=False)
        assert replay(tenants_trace, tmp_path / "read-only") == want
    finally:
        root.chmod(0o755)
    assert parts() == []


def test_no_trace_cache_bypasses_it_on_the_command_line(tenants_trace, tmp_path):
    common = ["--policy", "lru", "--capacity", "100"]
    off = kvbench("replay", tenants_trace, *common, "--no-report", "--no-trace-cache", "--out", tmp_path / "off")
    assert off.returncode == 0, off.stderr
    sweep = kvbench("sweep", "--trace", tenants_trace, *common, "--no-trace-cache", "--out", tmp_path / "sweep-off")
    assert sweep.returncode == 0, sweep.stderr
    assert parts() == []
    on = kvbench("replay", tenants_trace, *common, "--no-report", "--out", tmp_path / "on")
    assert on.returncode == 0, on.stderr
    assert parts() != []
    assert results(tmp_path / "on") == results(tmp_path / "off")


def test_a_sweep_loads_what_its_first_point_stored(tenants_trace, tmp_path):
    args = ["sweep", "--trace", tenants_trace, "--policy", "lru,radix-lru", "--capacity", "40,400"]
    warm = kvbench(*args, "--out", tmp_path / "cached")
    cold = kvbench(*args, "--no-trace-cache", "--out", tmp_path / "uncached")
    assert warm.returncode == 0 and cold.returncode == 0, warm.stderr + cold.stderr
    points = sorted(p.name for p in (tmp_path / "cached").iterdir() if (p / "summary.json").exists())
    assert len(points) == 4
    for point in points:
        assert results(tmp_path / "cached" / point) == results(tmp_path / "uncached" / point)
