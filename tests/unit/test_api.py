"""The public Python API (`import kvbench`): its names, a notebook's flow end to end on real files, and the
CLI's checks and messages."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest

import kvbench
from kvbench.errors import KvbenchError, ValidationFailed

from ..conftest import make_trace

N = 300  # requests: enough for two capacities to differ, quick to replay


def test_every_public_name_of_the_api_is_exported_and_documented():
    """`kvbench.__all__` is what kvbench.api defines for users (functions and classes whose module is
    kvbench.api), plus the two names taken from elsewhere; each resolves lazily and has a docstring."""
    import inspect

    from kvbench import api

    defined = {
        name
        for name, value in vars(api).items()
        if not name.startswith("_")
        and (inspect.isfunction(value) or inspect.isclass(value))
        and value.__module__ == "kvbench.api"
    }
    assert set(kvbench.__all__) == defined | {"Grid", "KvbenchError"}
    assert kvbench.__all__ == sorted(kvbench.__all__)
    for name in kvbench.__all__:
        value = getattr(kvbench, name)
        assert (value.__doc__ or "").strip(), f"kvbench.{name} has no docstring"
    assert kvbench.Grid.__module__ == "kvbench.run.sweeps" and kvbench.KvbenchError.__module__ == "kvbench.errors"


def _fresh(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout


def test_import_is_cheap():
    """`import kvbench`, and looking up the API, import none of the heavy libraries; calling it does."""
    heavy = "('pyarrow', 'polars', 'numpy', 'numba', 'torch', 'matplotlib', 'click', 'importlib.metadata')"
    out = _fresh(
        f"import sys, kvbench; kvbench.replay, kvbench.Run, kvbench.load_trace;"
        f"print(sorted(m for m in {heavy} if m in sys.modules))"
    )
    assert out.strip() == "[]"


@pytest.mark.parametrize(
    "code",
    [
        "import kvbench, kvbench.run.sweeps, kvbench.run.comparison, kvbench.trace.validation",
        "import kvbench.run.sweeps, kvbench.run.comparison, kvbench.trace.validation, kvbench",
    ],
)
def test_compare_sweep_and_validate_stay_functions_whatever_is_imported(code):
    """The modules behind them are named otherwise (sweeps, comparison, validation), so importing those never
    rebinds the package's API names."""
    out = _fresh(code + "; import inspect; print([inspect.isfunction(getattr(kvbench, n)) for n in "
                 "('compare', 'sweep', 'validate')])")  # fmt: skip
    assert out.strip() == "[True, True, True]"


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    return kvbench.generate("chat", N, seed=3, path=tmp_path_factory.mktemp("traces") / "chat.parquet")


def test_notebook_flow(chat, tmp_path):
    assert isinstance(chat, kvbench.Trace) and len(chat.table) == N and chat.meta.block_size == 64
    report = kvbench.validate(chat.path)
    assert report.ok and report.rows == N
    assert kvbench.load_trace(chat.path).to_polars().height == N

    run = kvbench.replay(chat, policy="lru,fifo", capacity=[200, 1000], bound=False, out=tmp_path / "run")
    assert run.path == tmp_path / "run" and run.summary["complete"]
    assert list(run.hit_rate) == ["lru/200blocks", "lru/1000blocks", "fifo/200blocks", "fifo/1000blocks"]
    assert run.hit_rate["lru/200blocks"] < run.hit_rate["lru/1000blocks"]
    assert run.summary["command"] == (
        f"kvbench.replay({str(chat.path)!r}, backend='sim', policy='lru,fifo', capacity=[200, 1000], bound=False)"
    )

    requests = run.requests
    assert isinstance(requests, pl.DataFrame) and requests.height == 4 * N
    assert requests.select("point", "request_id").n_unique() == 4 * N
    assert set(requests["point"].unique()) == set(run.hit_rate)

    (run.path / "report.html").unlink()
    assert run.report() == run.path / "report.html" and run.report().stat().st_size > 0

    again = kvbench.open_run(run.path)
    assert again.summary == json.loads((run.path / "summary.json").read_text()) == run.summary

    other = kvbench.replay(chat.path, policy="lru", capacity=500, bound=False, out=tmp_path / "other", report=False)
    result = kvbench.compare(run, other.path, out=tmp_path / "cmp")
    assert [r["point"] for r in result["runs"]] == [*run.hit_rate, "lru/500blocks"]
    assert (tmp_path / "cmp" / "compare.html").exists()
    assert json.loads((tmp_path / "cmp" / "compare.json").read_text()) == json.loads(json.dumps(result))

    swept = kvbench.sweep(trace=chat, policy="lru", capacity="200,1000", bound=False, out=tmp_path / "sweep")
    assert [p["status"] for p in swept.manifest["points"]] == ["ok", "ok"]
    assert (swept.path / "index.html").exists()
    by_point = {name: r.hit_rate for name, r in swept.runs.items()}
    assert by_point == {"chat_sim_lru_200": {"lru/200blocks": run.hit_rate["lru/200blocks"]},
                        "chat_sim_lru_1000": {"lru/1000blocks": run.hit_rate["lru/1000blocks"]}}  # fmt: skip


def test_replay_passes_the_options_the_cli_passes(chat, tmp_path):
    """The same options through `kvbench replay` give the same backend config and hit rates."""
    api = kvbench.replay(chat, policy="lru", capacity=[200, 1000], kv_dtype="fp8", out=tmp_path / "api", report=False)
    cli = tmp_path / "cli"
    args = ["kvbench", "replay", chat.path, "--policy", "lru", "--capacity", "200,1000", "--kv-dtype", "fp8"]
    subprocess.run([*map(str, args), "--out", cli, "--no-report"], check=True, capture_output=True)
    summary = json.loads((cli / "summary.json").read_text())
    assert api.summary["config"] == summary["config"]
    assert api.hit_rate == kvbench.open_run(cli).hit_rate


def test_an_existing_out_is_refused_unless_overwrite(chat, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    first = kvbench.replay(chat, capacity=200, bound=False, report=False)  # the default: reports/<time>-sim-chat
    assert first.path.parent == Path("reports") and first.path.name.endswith("-sim-chat")
    with pytest.raises(KvbenchError, match="already holds a run .* --overwrite"):
        kvbench.replay(chat, capacity=1000, bound=False, out=first.path)
    assert kvbench.open_run(first.path).hit_rate == first.hit_rate  # untouched
    second = kvbench.replay(chat, capacity=1000, bound=False, out=first.path, overwrite=True, report=False)
    assert list(kvbench.open_run(first.path).hit_rate) == list(second.hit_rate) == ["lru/1000blocks"]


@pytest.mark.parametrize(
    "options, message",
    [
        ({"polcy": "lru"}, r"No such option '--polcy'. Did you mean '--policy'\? \(keyword 'polcy'"),
        ({"model": "nope"}, r"Invalid value for '--model': 'nope' is not one of"),
        ({"warmup": 1.5}, r"Invalid value for '--warmup': 1.5 is not in the range 0<=x<1"),
        ({"capacity": None}, r"give --capacity"),
        ({"backend": "nope"}, r"unknown backend 'nope'; installed: .*sim"),
        ({"policy": "nope"}, r"unknown policy 'nope'; choose from: .*lru"),
    ],
)
def test_bad_options_raise_kvbench_errors_naming_them(chat, tmp_path, options, message):
    options = {"capacity": 100, **options}
    with pytest.raises(KvbenchError, match=message):
        kvbench.replay(chat, out=tmp_path / "run", **options)
    assert not (tmp_path / "run").exists()  # checked before the run directory is claimed


def test_generate_import_and_validate_errors(tmp_path):
    with pytest.raises(KvbenchError, match="unknown workload kind 'chatt'"):
        kvbench.generate("chatt", 10)
    with pytest.raises(KvbenchError, match="No such option '--turns'"):
        kvbench.generate("chat", 10, turns=3)
    with pytest.raises(KvbenchError, match="--session-rate"):
        kvbench.generate("chat", 10, session_rate=-1.0)
    with pytest.raises(KvbenchError, match="unknown trace format 'nope'"):
        kvbench.import_trace("nope", tmp_path / "x", tmp_path / "y.parquet")
    with pytest.raises(KvbenchError, match="does not exist"):
        kvbench.import_trace("mooncake", tmp_path / "missing.jsonl", tmp_path / "y.parquet")
    with pytest.raises(KvbenchError, match="No such option '--nope'"):
        kvbench.import_trace("mooncake", tmp_path / "missing.jsonl", tmp_path / "y.parquet", nope=1)
    with pytest.raises(KvbenchError, match="No such option '--capacty'"):
        kvbench.sweep(trace="t.parquet", capacty=5, out=tmp_path / "sweep")


def test_in_memory_traces_and_imports(tmp_path):
    trace = kvbench.generate("chat", 50, seed=1)
    assert trace.path is None and kvbench.validate(trace).ok
    with pytest.raises(KvbenchError, match=r"in memory only: save it first"):
        kvbench.replay(trace, capacity=100)
    run = kvbench.replay(trace.save(tmp_path / "chat.parquet"), capacity=100, out=tmp_path / "run", report=False)
    assert run.summary["trace"]["requests"] == 50

    src = tmp_path / "mooncake.jsonl"
    records = [{"timestamp": 1000 * i, "input_length": 1024, "output_length": 8, "hash_ids": [0, 1]} for i in range(3)]
    src.write_text("".join(json.dumps(r) + "\n" for r in records))
    imported = kvbench.import_trace("mooncake", src, tmp_path / "mooncake.parquet")
    assert len(imported.table) == 3 and imported.meta.block_size == 512


def test_validate_reports_violations_without_raising(tmp_path):
    from kvbench.trace.files import new_meta, write_trace

    bad = make_trace(input_tokens=[3, 5, -7, 9, 11, 13])
    write_trace(bad, tmp_path / "bad.parquet", new_meta(4, {}))
    report = kvbench.validate(tmp_path / "bad.parquet")
    assert not report.ok and any(v.column == "input_tokens" and v.rows == [2] for v in report.violations)
    with pytest.raises(ValidationFailed, match="input_tokens"):
        kvbench.load_trace(tmp_path / "bad.parquet")
