"""Validation rules, by example and as properties (hypothesis)."""

import math

import pyarrow as pa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbench.trace.validation import validate_table
from tests.conftest import make_trace


def violations(table, block_size=4):
    report = validate_table(table, block_size)
    return {(v.column, r) for v in report.violations for r in v.rows} | {
        (v.column, None) for v in report.violations if not v.rows
    }


def set_value(table, column, row, value):
    values = table.column(column).to_pylist()
    values[row] = value
    idx = table.column_names.index(column)
    try:
        arr = pa.array(values, type=table.schema.field(column).type)
    except (pa.ArrowInvalid, pa.ArrowTypeError):  # a value of the wrong type: the column becomes text
        arr = pa.array([None if v is None else str(v) for v in values])
    return table.set_column(idx, table.schema.field(column).with_type(arr.type), arr)


def test_valid_trace_passes(small_trace):
    report = validate_table(small_trace, 4)
    assert report.ok, report.summary()
    assert "valid (6 requests)" in report.summary()


def test_every_violation_is_listed_with_column_and_row(small_trace):
    t = set_value(small_trace, "arrival_s", 3, 0.1)
    t = set_value(t, "output_tokens", 2, -1)
    t = set_value(t, "parent_id", 4, "ghost")
    found = violations(t)
    assert {("arrival_s", 3), ("output_tokens", 2), ("parent_id", 4)} <= found
    summary = validate_table(t, 4).summary()
    assert "column 'arrival_s' row 3" in summary and "column 'parent_id' row 4" in summary


def test_missing_required_column_and_empty_trace(small_trace):
    assert ("block_hashes", None) in violations(small_trace.drop_columns(["block_hashes"]))
    assert not validate_table(small_trace.slice(0, 0), 4).ok


def test_wrong_type_names_rows(small_trace):
    t = set_value(small_trace, "input_tokens", 2, "x")
    assert t.schema.field("input_tokens").type == pa.string()
    assert ("input_tokens", 2) in violations(t)


def _retyped(table, column, values, type=None):
    return table.set_column(table.column_names.index(column), column, pa.array(values, type))


def test_numbers_written_as_text_are_refused_naming_column_and_rows(small_trace):
    """'1200' would cast to 1200, but a producer that wrote text where the schema has integers is broken."""
    text = [str(v) for v in small_trace.column("input_tokens").to_pylist()]
    report = validate_table(_retyped(small_trace, "input_tokens", text), 4)
    assert not report.ok
    assert "column 'input_tokens' rows 0, 1, 2, 3, 4 (and 1 more): holds string values" in report.summary()
    hashes = [[str(h) for h in hs] for hs in small_trace.column("block_hashes").to_pylist()]
    assert ("block_hashes", 0) in violations(_retyped(small_trace, "block_hashes", hashes))
    assert ("output_tokens", 0) in violations(_retyped(small_trace, "output_tokens", [True] * 6))


def test_compatible_types_still_validate(small_trace):
    """Wider integers, whole floats (pandas' integers with nulls), integer ids and all-null columns of any type."""
    inp = small_trace.column("input_tokens").to_pylist()
    assert validate_table(_retyped(small_trace, "input_tokens", inp, pa.int64()), 4).ok
    assert validate_table(_retyped(small_trace, "input_tokens", [float(v) for v in inp]), 4).ok
    assert validate_table(_retyped(small_trace, "turn", [None] * 6, pa.string()), 4).ok
    fractional = [v + 0.5 for v in inp]
    assert ("input_tokens", 0) in violations(_retyped(small_trace, "input_tokens", fractional))


def test_null_block_ids_are_refused(small_trace):
    hashes = small_trace.column("block_hashes").to_pylist()
    hashes[2] = [None] + hashes[2][1:]
    assert ("block_hashes", 2) in violations(_retyped(small_trace, "block_hashes", hashes, pa.list_(pa.uint64())))


def test_trace_validate_gives_a_verdict_for_every_file(small_trace, tmp_path):
    from click.testing import CliRunner

    from kvbench.cli import main
    from kvbench.trace.files import new_meta, write_trace

    good, bad = tmp_path / "good.parquet", tmp_path / "bad.parquet"
    write_trace(small_trace, good, new_meta(4, {}))
    write_trace(small_trace, bad, new_meta(8, {}))  # block_hashes counted in 4-token blocks
    junk = tmp_path / "junk.parquet"
    junk.write_bytes(b"not parquet")
    files = [good, junk, tmp_path / "missing.parquet", bad, good]
    result = CliRunner().invoke(main, ["trace", "validate", *map(str, files)])
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit)
    out = result.output
    assert out.count(f"{good}: valid (6 requests)") == 2 and f"{bad}: 1 rule(s) violated" in out
    assert f"{junk}: cannot be read: not a readable Parquet file" in out
    assert f"{tmp_path / 'missing.parquet'}: cannot be read: no such file" in out
    assert "error: 2 of 5 trace(s) could not be read" in out
    result = CliRunner().invoke(main, ["trace", "validate", str(good), str(bad)])
    assert result.exit_code == 1


def test_dependency_cycle_is_found():
    t = make_trace(depends_on=[["r2"], ["r0"], ["r1"], [], [], []])
    found = violations(t)
    assert {("depends_on", 0), ("depends_on", 1), ("depends_on", 2)} <= found


def test_mm_items_must_fit_the_prompt(small_trace):
    item = {"hash": 1, "modality": "image", "offset": 2, "tokens": 100}
    t = set_value(small_trace, "mm_items", 1, [item])
    assert ("mm_items", 1) in violations(t)


def test_report_caps_rows_but_counts_all():
    t = make_trace(n=20, output_tokens=[-1] * 20)
    v = [v for v in validate_table(t, 4).violations if v.column == "output_tokens"][0]
    assert v.count == 20 and len(v.rows) == 5 and "and 15 more" in v.describe()


# --- properties -------------------------------------------------------------------------------------


@st.composite
def valid_traces(draw):
    n = draw(st.integers(1, 30))
    bs = draw(st.sampled_from([1, 4, 16, 64]))
    gaps = draw(st.lists(st.floats(0, 100), min_size=n, max_size=n))
    arrival = [sum(gaps[: i + 1]) - gaps[0] for i in range(n)]
    inp = draw(st.lists(st.integers(1, 500), min_size=n, max_size=n))
    out = draw(st.lists(st.integers(0, 500), min_size=n, max_size=n))
    hashes = [[draw(st.integers(0, 2**64 - 1)) for _ in range(math.ceil(t / bs))] for t in inp]
    parents = [None] + [draw(st.one_of(st.none(), st.integers(0, i - 1).map(lambda j: f"q{j}"))) for i in range(1, n)]
    deps = [[]] + [draw(st.lists(st.integers(0, i - 1).map(lambda j: f"q{j}"), max_size=3)) for i in range(1, n)]
    reasoning = [draw(st.integers(0, o)) for o in out]
    table = make_trace(
        n=n,
        block_size=bs,
        request_id=[f"q{i}" for i in range(n)],
        arrival_s=arrival,
        input_tokens=inp,
        output_tokens=out,
        block_hashes=hashes,
        parent_id=parents,
        depends_on=deps,
        reasoning_tokens=reasoning,
    )
    return table, bs


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(valid_traces())
def test_generated_valid_traces_always_validate(case):
    table, bs = case
    report = validate_table(table, bs)
    assert report.ok, report.summary()


CORRUPTIONS = {
    "unsorted": ("arrival_s", lambda t, i: set_value(t, "arrival_s", i, t.column("arrival_s")[i - 1].as_py() - 1.0)),
    "negative_input": ("input_tokens", lambda t, i: set_value(t, "input_tokens", i, -3)),
    "negative_output": ("output_tokens", lambda t, i: set_value(t, "output_tokens", i, -1)),
    "block_count": (
        "block_hashes",
        lambda t, i: set_value(t, "block_hashes", i, t.column("block_hashes")[i].as_py() + [7]),
    ),
    "dangling_parent": ("parent_id", lambda t, i: set_value(t, "parent_id", i, "nobody")),
    "dangling_dep": ("depends_on", lambda t, i: set_value(t, "depends_on", i, ["nobody"])),
    "cycle": (
        "depends_on",
        lambda t, i: set_value(
            set_value(t, "depends_on", i - 1, [t.column("request_id")[i].as_py()]),
            "depends_on",
            i,
            [t.column("request_id")[i - 1].as_py()],
        ),
    ),
    "duplicate": ("request_id", lambda t, i: set_value(t, "request_id", i, t.column("request_id")[i - 1].as_py())),
    "wrong_type": ("output_tokens", lambda t, i: set_value(t, "output_tokens", i, "many")),
    "reasoning_over_output": (
        "reasoning_tokens",
        lambda t, i: set_value(t, "reasoning_tokens", i, t.column("output_tokens")[i].as_py() + 1),
    ),
}


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(valid_traces(), st.sampled_from(sorted(CORRUPTIONS)), st.data())
def test_corrupted_traces_always_fail_naming_column_and_row(case, rule, data):
    table, bs = case
    if table.num_rows < 2:
        return
    row = data.draw(st.integers(1, table.num_rows - 1))
    column, corrupt = CORRUPTIONS[rule]
    report = validate_table(corrupt(table, row), bs)
    assert not report.ok
    assert (column, row) in {(v.column, r) for v in report.violations for r in v.rows}, report.summary()
    assert f"column {column!r}" in report.summary()
