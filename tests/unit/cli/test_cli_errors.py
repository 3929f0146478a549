"""The CLI's catch-all: kvbench's own errors and the library errors that are the user's input (a file that
cannot be opened, data Arrow refuses) are one line and exit 2 (or the error's own code); anything else is a
bug in kvbench, reported as one "internal error" line with exit status 70, never a silent success."""

from __future__ import annotations

import errno

import click
import pyarrow as pa
import pytest
from click.testing import CliRunner

from kvbench.cli import INTERNAL_ERROR_EXIT, FriendlyGroup, main
from kvbench.errors import KvbenchError, TraceFormatError, ValidationFailed


def _run(exc: BaseException, env: dict | None = None):
    @click.group(cls=FriendlyGroup)
    def group():
        pass

    @group.command()
    def boom():
        raise exc

    return CliRunner().invoke(group, ["boom"], env={"KVBENCH_DEBUG": "", **(env or {})})


def _one_error_line(result) -> str:
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert "Traceback" not in result.output
    return lines[0]


class _Report:
    def summary(self):
        return "2 rules violated"


@pytest.mark.parametrize(
    "exc, code",
    [
        (KvbenchError("bad option"), 2),
        (TraceFormatError("t.parquet: column 'x' row 3: bad"), 2),
        (ValidationFailed(_Report()), 1),
    ],
)
def test_kvbench_errors_keep_their_exit_code(exc, code):
    result = _run(exc)
    assert result.exit_code == code
    assert str(exc) in _one_error_line(result)


@pytest.mark.parametrize(
    "exc",
    [
        FileNotFoundError(errno.ENOENT, "No such file or directory", "/no/such/trace.parquet"),
        PermissionError(errno.EACCES, "Permission denied", "/root/trace.parquet"),
        IsADirectoryError(errno.EISDIR, "Is a directory", "/tmp"),
        NotADirectoryError(errno.ENOTDIR, "Not a directory", "/etc/passwd/x"),
        OSError(errno.ENAMETOOLONG, "File name too long", "x" * 300),  # any OSError on a named file
        pa.ArrowInvalid("CSV parse error: Expected 3 columns, got 2"),
    ],
)
def test_users_input_errors_are_one_line_and_exit_2(exc):
    result = _run(exc)
    assert result.exit_code == 2
    assert "internal error" not in _one_error_line(result)


@pytest.mark.parametrize(
    "exc",
    [
        ValueError("a prompt has more than 65536 pieces"),
        KeyError("block_hashes"),
        TypeError("unsupported operand"),
        RuntimeError("finish() called twice"),
        IndexError("list index out of range"),
        OSError("an OSError naming no file"),
        pa.ArrowTypeError("Expected bytes, got a 'int' object"),
    ],
)
def test_other_errors_are_reported_as_internal_errors(exc):
    result = _run(exc)
    assert result.exit_code == INTERNAL_ERROR_EXIT == 70
    line = _one_error_line(result)
    assert f"internal error ({type(exc).__name__}: " in line and "KVBENCH_DEBUG=1" in line


def test_debug_shows_the_traceback():
    result = _run(KeyError("block_hashes"), env={"KVBENCH_DEBUG": "1"})
    assert isinstance(result.exception, KeyError)


def test_click_usage_errors_pass_through():
    result = CliRunner().invoke(main, ["replay", "--no-such-option"])
    assert result.exit_code == 2 and "No such option" in result.output and "internal error" not in result.output


@pytest.mark.parametrize(
    "args, message",
    [
        (["agent", "--summary-tokens", "100000"], "summary_tokens must be > 0"),
        (["multimodal", "--image-share", "0", "--video-share", "0", "--audio-share", "0"], "modality shares"),
    ],
)
def test_generator_parameter_checks_are_user_errors(tmp_path, args, message):
    """Cross-parameter checks of the generators are the user's input, not internal errors."""
    result = CliRunner().invoke(main, ["trace", "gen", *args, "-n", "20", "-o", str(tmp_path / "t.parquet")])
    assert result.exit_code == 2
    assert message in _one_error_line(result)


def test_missing_trace_is_a_user_error(tmp_path):
    result = CliRunner().invoke(main, ["trace", "info", str(tmp_path / "missing.parquet")])
    assert result.exit_code == 2 and "internal error" not in result.output
