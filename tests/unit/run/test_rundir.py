"""Run directories are never destroyed: a bad option leaves an earlier run byte for byte as it was, an existing
--out is refused unless --resume or --overwrite, default names never collide, and a command that fails before
it measured anything leaves no directory behind."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvbench.cli import main
from kvbench.errors import KvbenchError
from kvbench.run.rundir import RunDir, fresh_dir

SAMPLES = Path(__file__).resolve().parents[3] / "traces" / "samples"
CHAT = str(SAMPLES / "chat.parquet")


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _replay(*args: str):
    return CliRunner().invoke(main, ["replay", CHAT, "--no-report", *args])


@pytest.fixture
def good_run(tmp_path):
    out = tmp_path / "good-run"
    done = _replay("--policy", "lru", "--capacity", "1000", "--out", str(out))
    assert done.exit_code == 0, done.output
    return out, _snapshot(out)


@pytest.mark.parametrize(
    "bad",
    [
        ["--capacity", "10XB"],
        ["--capacity", "0"],
        ["--policy", "no-such-policy"],
        ["--capacity", "1000"],  # a valid command too: the run exists
    ],
)
def test_a_command_never_touches_an_existing_run(good_run, bad):
    out, before = good_run
    done = _replay(*bad, "--out", str(out))
    assert done.exit_code == 2 and "Traceback" not in done.output
    assert _snapshot(out) == before


def test_an_existing_run_is_refused_with_what_to_do(good_run):
    out, _ = good_run
    done = _replay("--capacity", "1000", "--out", str(out))
    assert "already holds a run" in done.output and "--resume" in done.output and "--overwrite" in done.output


def test_overwrite_replaces_a_run_only_once_every_option_was_checked(good_run):
    out, before = good_run
    assert _replay("--capacity", "nope", "--overwrite", "--out", str(out)).exit_code == 2
    assert _snapshot(out) == before  # the typo is caught before the old run is deleted
    done = _replay("--policy", "fifo", "--capacity", "500", "--overwrite", "--out", str(out))
    assert done.exit_code == 0, done.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["policies"] == ["fifo"] and summary["config"]["capacity"] == "500"


def test_default_names_never_collide(tmp_path):
    """Eight claims of one name at once (two runs started in the same second) get eight directories."""
    base = tmp_path / "reports" / "20261201-120000-sim-chat"
    made: list[Path] = []
    lock = threading.Lock()

    def claim():
        path = fresh_dir(base)
        with lock:
            made.append(path)

    threads = [threading.Thread(target=claim) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(made)) == 8 and base in made and base.with_name(base.name + "-2") in made


@pytest.mark.parametrize(
    "bad",
    [
        ["--capacity", "0"],
        ["--policy", "no-such-policy"],
        ["--capacity", "1000", "--quota", "nobody=0.5"],
        ["--capacity", "1000", "--warmup", "2"],
    ],
)
def test_a_failed_command_leaves_no_run_directory(tmp_path, monkeypatch, bad):
    monkeypatch.chdir(tmp_path)
    done = _replay(*bad)
    assert done.exit_code == 2, done.output
    assert not (tmp_path / "reports").exists() or not any((tmp_path / "reports").iterdir())


def test_a_failed_command_empties_the_empty_directory_it_was_given(tmp_path):
    out = tmp_path / "empty"
    out.mkdir()
    claimed = RunDir.claim(out, tmp_path / "unused")
    (out / "summary.json").write_text("{}")
    claimed.discard()
    assert out.is_dir() and not any(out.iterdir())


def test_resume_needs_an_earlier_run_and_excludes_overwrite(tmp_path):
    with pytest.raises(KvbenchError, match="no interrupted run"):
        RunDir.claim(tmp_path / "nothing", tmp_path / "d", resume=True)
    with pytest.raises(KvbenchError, match="give one of them"):
        RunDir.claim(tmp_path / "x", tmp_path / "d", resume=True, overwrite=True)
