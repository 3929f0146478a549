"""Each importer declares its keyword options once, as `kvbench.options.option` fields (help, unit); the
`kvbench trace import FORMAT` command is made from them, and they must be the reader's own arguments."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvbench.cli import main
from kvbench.options import option, unit_of
from kvbench.trace import importers
from kvbench.trace.files import read_trace


def test_the_command_takes_the_readers_keyword_arguments_with_their_units():
    for name, imp in importers.registry().items():
        params = [p for p in list(inspect.signature(imp.read).parameters)[1:] if p != "progress"]
        command = main.get_command(None, "trace").get_command(None, "import").get_command(None, name)
        options = {p.name: p for p in command.params if p.name not in ("src", "out", "help")}
        assert list(options) == params, name
        assert all(unit_of(p) for p in options.values()), name
        for f in dataclasses.fields(imp.options):
            assert options[f.name].default == f.default, (name, f.name)


def test_options_that_are_not_the_readers_are_refused_when_registered():
    @dataclasses.dataclass(frozen=True)
    class Drifted:
        block_size: int = option(32, "tokens per block", unit="tokens")

    def read_thing(src: Path, block_size: int = 16):
        """A format whose options drifted from its reader's defaults."""

    with pytest.raises(TypeError, match=r"importer thing: Drifted declares \[\('block_size', 32\)\]"):
        importers.importer("thing", Drifted)(read_thing)
    assert "thing" not in importers.registry()


def test_an_option_reaches_the_reader(tmp_path):
    src = tmp_path / "m.jsonl"
    src.write_text('{"timestamp": 0, "input_length": 40, "output_length": 3, "hash_ids": [1, 2]}\n'
                   '{"timestamp": 1500, "input_length": 20, "output_length": 2, "hash_ids": [1]}\n')  # fmt: skip
    out = tmp_path / "t.parquet"
    args = ["trace", "import", "mooncake", str(src), "-o", str(out), "--block-size", "20", "--time-unit", "ms"]
    result = CliRunner().invoke(main, [*args, "--workload", "w"])
    assert result.exit_code == 0, result.output
    table, meta = read_trace(out)
    assert meta.block_size == 20 and table.column("arrival_s").to_pylist() == [0.0, 1.5]
    assert set(table.column("workload").to_pylist()) == {"w"}
    bad = CliRunner().invoke(main, [*args[:-1], "minutes"])
    assert bad.exit_code == 2 and "'minutes' is not one of 's', 'ms', 'us'" in bad.output
