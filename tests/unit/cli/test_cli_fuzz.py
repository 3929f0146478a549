"""Property: the command line meets malformed traces and option strings with one error line and a non-zero
exit, never a traceback, and never touches a run made before. Traces are written as real Parquet files
(wrong column types, missing columns, negative and huge numbers, nulls, bad list contents, broken metadata,
bytes that are not Parquet); options are the strings a user could type for --capacity, --policy, --quota,
--small-fraction and --warmup. The CLI runs in-process (click's CliRunner), as `kvbench` would."""

from __future__ import annotations

import io
import os
import tempfile
from pathlib import Path
from typing import NamedTuple

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbench.cli import main
from kvbench.trace.files import read_trace, write_trace
from tests.conftest import REPO

ROWS = 40  # a short trace: a fuzzed replay that happens to be valid stays quick
FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _snapshot(run_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """A valid short trace, and a finished run of it whose bytes every later command must leave alone."""
    os.environ.pop("KVBENCH_DEBUG", None)  # tracebacks on would defeat the point
    root = tmp_path_factory.mktemp("fuzz")
    table, meta = read_trace(REPO / "traces/samples/chat.parquet")
    trace = root / "good.parquet"
    write_trace(table.slice(0, ROWS), trace, meta)
    run_dir = root / "good-run"
    result = CliRunner().invoke(main, ["replay", str(trace), "--capacity", "50", "--out", str(run_dir), "--no-report"])
    assert result.exit_code == 0, result.output
    return trace, run_dir, _snapshot(run_dir)


def _invoke(args: list[str]):
    result = CliRunner().invoke(main, [str(a) for a in args])
    # an uncaught exception is left in result.exception; a handled error or success is a SystemExit (or none)
    assert result.exception is None or isinstance(result.exception, SystemExit), (args, repr(result.exception))
    assert "Traceback" not in result.output, (args, result.output)
    return result


def _assert_refused(result, args) -> None:
    assert result.exit_code != 0, (args, result.output)
    assert "error" in result.output.lower() or "violated" in result.output or "cannot be read" in result.output, (
        args,
        result.output,
    )


# --- malformed traces -------------------------------------------------------------------------------------


def _column(table: pa.Table, name: str, array) -> pa.Table:
    if name in table.column_names:
        return table.set_column(table.schema.get_field_index(name), name, array)
    return table.append_column(name, array)


def _mutations(table: pa.Table):
    """(name, function(draw) -> table or raw bytes): each surely breaks a rule of schema v1."""
    n = table.num_rows
    ints = st.integers(-(2**70), 2**70)

    def as_text(name):
        return lambda draw: _column(table, name, pa.array([str(v) for v in table.column(name).to_pylist()]))

    def numbers_out_of_range(name):
        def make(draw):
            values = table.column(name).to_pylist()
            row = draw(st.integers(0, n - 1))
            values[row] = draw(st.one_of(st.integers(-(2**40), -1), st.integers(2**31, 2**62)))
            return _column(table, name, pa.array(values, pa.int64()))

        return make

    def nulls(name):
        def make(draw):
            values = table.column(name).to_pylist()
            values[draw(st.integers(0, n - 1))] = None
            return _column(table, name, pa.array(values, table.column(name).type))

        return make

    def hashes_of(kind):
        def make(draw):
            lists = table.column("block_hashes").to_pylist()
            row = draw(st.integers(0, n - 1))
            if kind == "text":
                lists = [[str(h) for h in hs] for hs in lists]
                return _column(table, "block_hashes", pa.array(lists))
            if kind == "negative":
                lists = [[h % 2**62 for h in hs] for hs in lists]
                lists[row] = [-draw(st.integers(1, 2**40))] + lists[row][1:]
                return _column(table, "block_hashes", pa.array(lists, pa.list_(pa.int64())))
            if kind == "null item":
                lists[row] = [None] + lists[row][1:]
            elif kind == "wrong length":
                lists[row] = lists[row] + [draw(st.integers(0, 2**63))] * draw(st.integers(1, 5))
            return _column(table, "block_hashes", pa.array(lists, pa.list_(pa.uint64())))

        return make

    def fractional_tokens(draw):
        values = [float(v) for v in table.column("input_tokens").to_pylist()]
        values[draw(st.integers(0, n - 1))] += draw(st.sampled_from([0.5, 0.25, 0.001]))
        return _column(table, "input_tokens", pa.array(values))

    def bools(draw):
        return _column(table, draw(st.sampled_from(["input_tokens", "output_tokens", "turn"])), pa.array([True] * n))

    def arrival(draw):
        values = table.column("arrival_s").to_pylist()
        values[draw(st.integers(0, n - 1))] = draw(st.sampled_from([-1.0, float("nan"), float("inf"), -1e300]))
        return _column(table, "arrival_s", pa.array(values))

    def missing(draw):
        return table.drop_columns([draw(st.sampled_from(["request_id", "arrival_s", "input_tokens", "block_hashes"]))])

    def random_column(draw):  # any integers where the schema keeps strings, numbers or lists
        name = draw(st.sampled_from(["output_tokens", "priority", "reasoning_tokens", "turn"]))
        values = draw(st.lists(ints, min_size=n, max_size=n))
        values[0] = -1  # (no rule refuses every integer: a negative one keeps it surely bad)
        return _column(table, name, pa.array(values, pa.decimal128(38, 0) if max(map(abs, values)) >= 2**63 else None))

    def empty(draw):
        return table.slice(0, 0)

    yield from [
        ("text tokens", as_text("input_tokens")),
        ("text output", as_text("output_tokens")),
        ("text arrival", as_text("arrival_s")),
        ("huge tokens", numbers_out_of_range("input_tokens")),
        ("null tokens", nulls("input_tokens")),
        ("null arrival", nulls("arrival_s")),
        ("null id", nulls("request_id")),
        ("text hashes", hashes_of("text")),
        ("negative hash", hashes_of("negative")),
        ("null hash", hashes_of("null item")),
        ("wrong length", hashes_of("wrong length")),
        ("fractional tokens", fractional_tokens),
        ("bools", bools),
        ("bad arrival", arrival),
        ("missing column", missing),
        ("random column", random_column),
        ("no rows", empty),
    ]


class Malformed(NamedTuple):
    """A broken trace file's bytes; shown by its label alone (a falsifying example stays readable)."""

    label: str
    data: bytes

    def __repr__(self) -> str:
        return f"Malformed({self.label!r}, {len(self.data)} bytes)"


@st.composite
def malformed_traces(draw, table: pa.Table, metadata: dict):
    """(label, file bytes): a table broken by one mutation with the trace's metadata, broken metadata on the good
    table, or bytes that are no Parquet file at all."""
    choice = draw(st.sampled_from(["rows", "rows", "rows", "metadata", "bytes"]))
    if choice == "bytes":
        good = io.BytesIO()
        pq.write_table(table.replace_schema_metadata(metadata), good)
        data = good.getvalue()
        cut = draw(
            st.one_of(st.just(b""), st.binary(max_size=64), st.integers(1, len(data) - 1).map(lambda k: data[:k]))
        )
        return Malformed("bytes", cut)
    if choice == "metadata":
        meta = dict(metadata)
        key = draw(st.sampled_from([b"kvbench.block_size", b"kvbench.schema_version"]))
        if draw(st.booleans()):
            meta.pop(key)
        else:
            meta[key] = (
                draw(st.sampled_from([b"0", b"-16", b"abc", b"", b"1e3", b"99"])) if key.endswith(b"size") else b"0"
            )
        label, out = "metadata", table.replace_schema_metadata(meta)
    else:
        label, make = draw(st.sampled_from(list(_mutations(table))))
        out = make(draw).replace_schema_metadata(metadata)
    buffer = io.BytesIO()
    pq.write_table(out, buffer)
    return Malformed(label, buffer.getvalue())


def _write(data: bytes) -> Path:
    fd, name = tempfile.mkstemp(suffix=".parquet", prefix="fuzz-")
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    return Path(name)


@pytest.fixture(scope="module")
def good_table(good):
    trace, _, _ = good
    table = pq.read_table(trace)
    return table, dict(table.schema.metadata)


def test_malformed_traces_are_refused_cleanly(good, good_table):
    trace, run_dir, before = good
    table, metadata = good_table

    @FUZZ
    @given(malformed_traces(table, metadata))
    def check(case):
        label, data = case
        path = _write(data)
        try:
            _assert_refused(_invoke(["trace", "validate", path]), label)
            # every file given gets its verdict, the unreadable ones too
            result = _invoke(["trace", "validate", trace, path, trace])
            _assert_refused(result, label)
            assert result.output.count(f"{trace}: valid") == 2, result.output
            # pointed at the earlier run: refused before it is touched
            args = ["replay", path, "--capacity", "50", "--out", run_dir, "--no-report"]
            _assert_refused(_invoke(args), (label, args))
            assert _snapshot(run_dir) == before
        finally:
            path.unlink()

    check()


# --- malformed options ------------------------------------------------------------------------------------

BAD_CAPACITIES = st.one_of(
    st.sampled_from(["", " ", ",", "0", "-1", "1.5", "0.5", "1e400", "99999999999999999999", "nan", "inf", "1,,2"]),
    st.sampled_from(["10 parsecs", "40GiB", "5 tok", "0x10", "1_000.5", "--1", "1e-3", "100000000000000 tok"]),
    st.integers(-(10**30), 0).map(str),
    st.integers(10**13, 10**40).map(str),
    st.floats(allow_nan=True, allow_infinity=True)
    .filter(lambda x: x != int(x) if x == x and abs(x) < 1e300 else True)
    .map(repr),
)


_TEXT = st.text(max_size=12)
_POLICIES = {"belady", "fifo", "lfu", "lru", "priority-lru", "radix-lru", "s3fifo", "tenant-quota", "vllm"}


def _surely_bad_policy(name: str) -> str:
    names = [p.strip() for p in name.split(",")]
    if all(p in _POLICIES for p in names if p) and any(names) and not name.startswith("-"):
        return "nope," + name  # (a text that happens to name policies only is fine: keep it bad)
    return name


# Each family: `kvbench replay` option tails that must be refused, as a user could type them.
BAD_OPTIONS = {
    "capacity": BAD_CAPACITIES.map(lambda c: ["--capacity", c]),
    "policy": st.one_of(st.sampled_from(["", ",", "LRU", "lru,,", "nope", "lru nope"]), _TEXT).map(
        lambda p: ["--policy", _surely_bad_policy(p), "--capacity", "50"]
    ),
    # any quota under a policy that takes none
    "quota-lru": st.one_of(st.just("a=0.5"), _TEXT).map(lambda q: ["--capacity", "50", "--quota", q]),
    # tenant-quota on a trace without tenants, or a malformed quota
    "quota": st.one_of(_TEXT, st.sampled_from(["a=nan", "a=-1", "a=1.5", ",", "=", "q.toml"])).map(
        lambda q: ["--policy", "tenant-quota", "--capacity", "50", "--quota", q]
    ),
    "small-fraction": st.one_of(
        st.sampled_from(["0", "-1", "1.5", "nan", "inf", "", "x"]), st.floats(1.0001, 1e300).map(repr)
    ).map(lambda v: ["--policy", "s3fifo", "--capacity", "50", "--small-fraction", v]),
    "priority-duration": st.sampled_from(["-1", "nan", "inf", "x", "", "-0.5"]).map(
        lambda v: ["--policy", "priority-lru", "--capacity", "50", "--priority-duration-s", v]
    ),
    "warmup": st.one_of(st.sampled_from(["-0.1", "1", "1.5", "nan", "x", ""]), st.floats(1, 1e300).map(repr)).map(
        lambda v: ["--capacity", "50", "--warmup", v]
    ),
}


@pytest.mark.parametrize("family", sorted(BAD_OPTIONS))
def test_bad_options_are_refused_cleanly(family, good, tmp_path_factory):
    """Refused for the option itself (a fresh --out), and never touching an earlier run (its --out)."""
    trace, run_dir, before = good

    @settings(FUZZ, max_examples=40 if family == "capacity" else 12)
    @given(BAD_OPTIONS[family])
    def check(options):
        fresh = tmp_path_factory.mktemp("bad") / "run"
        for out in (fresh, run_dir):
            args = ["replay", trace, *options, "--out", out, "--no-report"]
            result = _invoke(args)
            _assert_refused(result, args)
        assert _snapshot(run_dir) == before

    check()


def test_any_option_text_never_gives_a_traceback(good, tmp_path_factory):
    """Arbitrary text for each option: refused or run, but cleanly, and the earlier run is untouched."""
    trace, run_dir, before = good
    option = st.sampled_from(["--capacity", "--policy", "--quota", "--warmup", "--small-fraction"])

    @FUZZ
    @given(option, st.text(max_size=16))
    def check(name, value):
        extra = ["--capacity", "50"] if name != "--capacity" else []
        out = tmp_path_factory.mktemp("any")
        result = _invoke(["replay", trace, name, value, *extra, "--out", out / "run", "--no-report"])
        assert result.exit_code in (0, 1, 2), result.output
        assert _snapshot(run_dir) == before

    check()
