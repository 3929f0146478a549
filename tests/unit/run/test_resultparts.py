"""Durable result parts (`resultparts`) and their one reader (`results.read_requests`), on files made by hand:
torn temporary files are ignored, a later row of a request supersedes an earlier one, a merge interrupted at
any step reads back the same, and an unreadable file is named in the error."""

from __future__ import annotations

import re
import subprocess
import sys

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from kvbench.run.backend import PointResult
from kvbench.run.resultparts import PartWriter, list_parts, merge_parts, parts_dir, write_durably
from kvbench.run.results import RESULT_SCHEMA, ResultsUnreadable, ResultWriter, read_requests, result_files


def rows(ids: list[str], status: str = "ok", point: str = "live") -> pa.Table:
    n = len(ids)
    cols = {f.name: pa.nulls(n, f.type) for f in RESULT_SCHEMA}
    cols.update(
        point=pa.array([point] * n),
        request_id=pa.array(ids),
        status=pa.array([status] * n),
        ttft_s=pa.array([0.1 * (i + 1) for i in range(n)]),
    )
    return pa.table(cols, schema=RESULT_SCHEMA)


def statuses(table: pa.Table) -> dict[str, str]:
    return dict(zip(table.column("request_id").to_pylist(), table.column("status").to_pylist(), strict=True))


def test_parts_are_numbered_whole_files_and_torn_temporary_files_are_ignored(tmp_path):
    results = tmp_path / "requests.parquet"
    parts = PartWriter(results, RESULT_SCHEMA)
    parts.write(rows(["a", "b"]))
    parts.write(rows(["c"]))
    (parts_dir(results) / "part-000002.parquet.tmp").write_bytes(b"PAR1 half a file")  # killed mid-write
    assert [p.name for p in list_parts(results)] == ["part-000000.parquet", "part-000001.parquet"]
    assert read_requests(tmp_path).column("request_id").to_pylist() == ["a", "b", "c"]
    # a writer started later goes on after the last whole part
    assert PartWriter(results, RESULT_SCHEMA).write(rows(["d"])).name == "part-000002.parquet"


def test_a_later_row_of_a_request_supersedes_an_earlier_one(tmp_path):
    results = tmp_path / "requests.parquet"
    write_durably([rows(["a", "b", "c"], status="not_sent")], RESULT_SCHEMA, results)
    parts = PartWriter(results, RESULT_SCHEMA)
    parts.write(rows(["b"], status="error"))
    parts.write(rows(["b", "a"]))
    parts.write(rows(["a"], point="lru/100"))  # another point's row of the same request is another row
    got = read_requests(tmp_path)
    assert got.num_rows == 4
    assert statuses(got.filter(pc.equal(got.column("point"), "live"))) == {"a": "ok", "b": "ok", "c": "not_sent"}
    assert read_requests(tmp_path, columns=["status", "no_such"]).column_names == ["status"]
    assert read_requests(tmp_path, max_rows=2).num_rows == 2


def test_a_merge_interrupted_before_the_parts_are_removed_reads_back_the_same(tmp_path):
    results = tmp_path / "requests.parquet"
    parts = PartWriter(results, RESULT_SCHEMA)
    parts.write(rows(["a", "b"]))
    parts.write(rows(["c"]))
    before = read_requests(tmp_path)
    # the merged file took its name; the kill came before the parts were removed
    write_durably([before], RESULT_SCHEMA, results)
    assert len(result_files(tmp_path)) == 3
    assert read_requests(tmp_path).equals(before)
    merge_parts(results, RESULT_SCHEMA)  # ...and a merge after the fact is a no-op on the rows
    assert result_files(tmp_path) == [results] and not parts_dir(results).exists()


def test_result_writer_merges_its_parts_on_close_and_a_resumed_one_keeps_its_base(tmp_path):
    results = tmp_path / "requests.parquet"
    trace = pa.table(
        {
            "request_id": ["a", "b", "c"],
            "tenant": ["t"] * 3,
            "workload": ["chat"] * 3,
            "input_tokens": pa.array([10, 20, 30], pa.int32()),
            "output_tokens": pa.array([1, 2, 3], pa.int32()),
        }
    )
    writer = ResultWriter(results)
    assert pq.read_table(results).num_rows == 0  # readable from the start
    writer.write(trace.slice(0, 2), PointResult({"point": "live"}, {"status": ["ok", "ok"]}))
    assert len(list_parts(results)) == 1 and read_requests(tmp_path).num_rows == 2  # durable before close
    writer.close()
    assert not parts_dir(results).exists() and pq.read_table(results).num_rows == 2
    # resumed: `base` replaces what was there, new rows follow
    base = pq.read_table(results).slice(0, 1)
    writer = ResultWriter(results, base=base)
    writer.write(trace.slice(1), PointResult({"point": "live"}, {"status": ["ok", "ok"]}))
    writer.close()
    assert pq.read_table(results).column("request_id").to_pylist() == ["a", "b", "c"]


@pytest.mark.parametrize("where", ["requests.parquet", "requests.parts/part-000000.parquet"])
def test_an_unreadable_file_is_named_in_the_error(tmp_path, where):
    write_durably([rows(["a"])], RESULT_SCHEMA, tmp_path / "requests.parquet")
    bad = tmp_path / where
    bad.parent.mkdir(exist_ok=True)
    bad.write_bytes(b"\0" * 64)  # what a run killed by an older kvbench left: no footer
    with pytest.raises(ResultsUnreadable, match=re.escape(f"{bad}: not a readable Parquet file")):
        read_requests(tmp_path)


def test_no_results_at_all_is_named_too(tmp_path):
    with pytest.raises(ResultsUnreadable, match=re.escape(f"{tmp_path / 'requests.parquet'}: no such file")):
        read_requests(tmp_path)


def test_sigterm_and_sighup_are_handled_as_ctrl_c():
    """The CLI's handler goes through SIGINT's (here Python's own, raising KeyboardInterrupt)."""
    code = (
        "import os, signal, click\n"
        "from kvbench.cli import main\n"
        "@main.command()\n"
        "def wait():\n"
        "    try:\n"
        "        os.kill(os.getpid(), signal.%s)\n"
        "        import time; time.sleep(10)\n"
        "    except KeyboardInterrupt:\n"
        "        print('interrupted like Ctrl-C')\n"
        "main(['wait'])\n"
    )
    # the child starts with the default handlers, whatever this test runs under (a CI started with nohup
    # ignores SIGHUP, and an ignored signal stays ignored, as below)
    default = "import signal; signal.signal(signal.SIGHUP, signal.SIG_DFL)\n"
    for name in ("SIGTERM", "SIGHUP"):
        out = subprocess.run([sys.executable, "-c", default + code % name], capture_output=True, text=True, timeout=60)
        assert "interrupted like Ctrl-C" in out.stdout, (name, out.stderr)
    # a signal ignored when kvbench starts (`nohup`) stays ignored
    nohup = "import signal; signal.signal(signal.SIGHUP, signal.SIG_IGN)\n" + code % "SIGHUP"
    nohup = nohup.replace("time.sleep(10)", "time.sleep(0.2); print('still running')")
    out = subprocess.run([sys.executable, "-c", nohup], capture_output=True, text=True, timeout=60)
    assert "still running" in out.stdout and "interrupted" not in out.stdout, out.stderr


def test_report_of_a_run_with_a_torn_results_file_names_the_file(tmp_path):
    """What a run killed under an older kvbench left: one clear line naming the file, exit status 2."""
    from click.testing import CliRunner

    from kvbench.cli import main
    from kvbench.run.runner import run_replay
    from tests.conftest import REPO

    trace = REPO / "traces/samples/chat.parquet"
    run_dir, _ = run_replay(trace, "sim", {"policy": "lru", "capacity": "500"}, out=tmp_path / "r", report=False)
    torn = run_dir / "requests.parquet"
    torn.write_bytes(torn.read_bytes()[:1000])  # the footer never written
    result = CliRunner().invoke(main, ["report", str(run_dir)])
    assert result.exit_code == 2 and f"{torn}: not a readable Parquet file" in result.output, result.output


def test_held_rows_are_durable_only_once_committed_and_a_short_run_writes_one_file(tmp_path):
    """An offline run holds its rows (commit_every_s > 0): nothing is on disk before `commit()` (a kill then
    loses only what the summary does not list yet), a commit makes one part, and a run that never committed
    writes requests.parquet at once, without parts."""
    trace = pa.table(
        {
            "request_id": ["a", "b", "c"],
            "tenant": ["t"] * 3,
            "workload": ["chat"] * 3,
            "input_tokens": [1, 2, 3],
            "output_tokens": [1, 1, 1],
        }  # fmt: skip
    )
    point = PointResult({"policy": "lru"}, {"hit_blocks": pa.array([0, 1, 2]).to_numpy()})

    held = tmp_path / "held" / "requests.parquet"
    held.parent.mkdir()
    writer = ResultWriter(held, commit_every_s=3600)
    writer.write(trace, point)
    assert not writer.commit_due() and list_parts(held) == [] and read_requests(held.parent).num_rows == 0
    writer.commit()
    assert len(list_parts(held)) == 1 and read_requests(held.parent).num_rows == 3
    writer.write(trace, PointResult({"policy": "fifo"}, point.columns))
    writer.close()
    assert list_parts(held) == [] and read_requests(held.parent).num_rows == 6

    short = tmp_path / "short" / "requests.parquet"
    short.parent.mkdir()
    writer = ResultWriter(short, commit_every_s=3600)
    writer.write(trace, point)
    writer.close()
    assert not parts_dir(short).exists()
    assert pq.read_table(short).column("hit_blocks").to_pylist() == [0, 1, 2]
