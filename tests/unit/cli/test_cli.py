"""The `kvbench trace` command line, run as a user would (a real subprocess)."""

import json

import pytest

from kvbench.trace.generators import registry
from tests.conftest import kvbench, shared_trace


def assert_clean_error(result):
    assert result.returncode != 0
    assert "Traceback" not in result.stderr + result.stdout
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines and lines[0].startswith("error:"), result.stderr
    return result.stderr


@pytest.mark.parametrize("kind", sorted(registry()))
def test_gen_then_validate_and_info(kind, tmp_path):
    out = tmp_path / f"{kind}.parquet"
    r = kvbench("trace", "gen", kind, "-n", 200, "--seed", 5, "-o", out)
    assert r.returncode == 0, r.stderr
    assert "200 requests" in r.stdout
    r = kvbench("trace", "validate", out)
    assert r.returncode == 0 and "valid (200 requests)" in r.stdout
    info = json.loads(kvbench("trace", "info", out, "--json").stdout)
    assert info["requests"] == 200 and info["source"]["generator"] == kind
    assert 0.0 <= info["infinite_cache_hit_rate"]["token"]["all"] <= 1.0


def test_gen_help_documents_every_parameter():
    r = kvbench("trace", "gen", "chat", "--help")
    assert "--think-time-mean-s" in r.stdout and "(s)" in r.stdout and "--seed" in r.stdout


def test_info_markdown_report(tmp_path):
    out = tmp_path / "t.parquet"
    kvbench("trace", "gen", "chat", "-n", 100, "-o", out)
    r = kvbench("trace", "info", out, "--markdown", tmp_path / "r.md")
    assert r.returncode == 0
    text = (tmp_path / "r.md").read_text()
    assert "Infinite-cache prefix hit rate" in text and "| requests | 100 |" in text


def test_invalid_trace_is_reported_and_exits_nonzero(tmp_path):
    import pyarrow as pa

    from kvbench.trace.files import read_trace, write_trace

    out = tmp_path / "t.parquet"
    kvbench("trace", "gen", "chat", "-n", 50, "-o", out)
    table, meta = read_trace(out)
    arrival = table.column("arrival_s").to_pylist()
    arrival[10] = -1.0
    table = table.set_column(1, "arrival_s", pa.array(arrival))
    write_trace(table, tmp_path / "bad.parquet", meta)
    r = kvbench("trace", "validate", tmp_path / "bad.parquet")
    assert r.returncode == 1 and "column 'arrival_s' row 10" in r.stdout
    err = assert_clean_error(kvbench("trace", "info", tmp_path / "bad.parquet"))
    assert "row 10" in err
    assert_clean_error(kvbench("trace", "export", tmp_path / "bad.parquet"))


def test_bad_inputs_give_one_line_errors(tmp_path):
    empty = tmp_path / "empty.parquet"
    empty.write_bytes(b"")
    assert "empty" in assert_clean_error(kvbench("trace", "info", empty))

    out = tmp_path / "t.parquet"
    kvbench("trace", "gen", "chat", "-n", 50, "-o", out)
    data = out.read_bytes()
    truncated = tmp_path / "truncated.parquet"
    truncated.write_bytes(data[: len(data) // 3])
    assert "truncated.parquet" in assert_clean_error(kvbench("trace", "info", truncated))

    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n{oops\n')
    assert "line 2" in assert_clean_error(kvbench("trace", "import", "mooncake", broken, "-o", tmp_path / "x.parquet"))

    seconds = tmp_path / "seconds.jsonl"
    seconds.write_text('{"timestamp": 0.5, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n')
    assert "--time-unit s" in assert_clean_error(
        kvbench("trace", "import", "mooncake", seconds, "-o", tmp_path / "x.parquet")
    )
    r = kvbench("trace", "import", "mooncake", seconds, "-o", tmp_path / "x.parquet", "--time-unit", "s")
    assert r.returncode == 0, r.stderr

    assert_clean_error(kvbench("trace", "info", tmp_path / "missing.parquet"))
    assert not (tmp_path / "missing.parquet").exists()


def test_bad_generator_parameter(tmp_path):
    assert_clean_error(kvbench("trace", "gen", "mix", "-n", 10, "--weights", "chat", "-o", tmp_path / "m.parquet"))


@pytest.mark.parametrize(
    "fmt, relative, options",
    [
        ("azure", "azure/AzureLLMInferenceTrace_conv.csv", []),
        ("kv-cache-tester", "kv-cache-tester", ["--stagger-s", "60"]),
    ],
)
def test_import_shared_traces(fmt, relative, options, tmp_path):
    out = tmp_path / "t.parquet"
    r = kvbench("trace", "import", fmt, shared_trace(relative), "-o", out, *options)
    assert r.returncode == 0, r.stderr
    info = json.loads(kvbench("trace", "info", out, "--json").stdout)
    assert info["requests"] > 0 and info["source"]["importer"] == fmt


def test_import_fixtures_and_unsupported_option(tmp_path):
    from pathlib import Path

    fixtures = Path(__file__).resolve().parents[2] / "fixtures"
    for fmt, name in (("bailian", "bailian_sample.jsonl"), ("burstgpt", "burstgpt_sample.csv")):
        r = kvbench("trace", "import", fmt, fixtures / name, "-o", tmp_path / f"{fmt}.parquet")
        assert r.returncode == 0, r.stderr
    r = kvbench(
        "trace", "import", "azure", fixtures / "burstgpt_sample.csv", "-o", tmp_path / "x.parquet", "--time-unit", "s"
    )
    assert r.returncode == 2 and "No such option" in r.stderr
