"""One option vocabulary (kvbench.options): each built-in backend's click options, constructor keywords and
config() record come from one dataclass; the same name means the same thing in every backend and every help
states its unit."""

from __future__ import annotations

import dataclasses
import re

import click
import pytest
from click.testing import CliRunner

from kvbench import options
from kvbench.cli import main
from kvbench.errors import KvbenchError
from kvbench.models import MODELS
from kvbench.options import option, unit_of
from kvbench.run.plugins import load_backend

from ..conftest import make_trace

URL = "http://127.0.0.1:1"  # openai checks the URL's form only when built; nothing is sent
REQUIRED = {"sim": {"capacity": "100"}, "engine-sim": {}, "torch": {"capacity": "100"}, "openai": {"url": URL}}
BUILT_IN = list(REQUIRED)


def _visible(params) -> list[click.Option]:
    return [p for p in params if not p.hidden]


@pytest.mark.parametrize("name", BUILT_IN)
def test_cli_options_config_and_keywords_come_from_one_dataclass(name):
    cls = load_backend(name)
    config_cls = cls.Config
    fields = [f.name for f in dataclasses.fields(config_cls)]
    params = cls.cli_options()
    own = [p.name for p in params[: len(fields)]]
    assert own == fields  # one click option per field, in field order, named as the field
    assert set(fields) <= {p.name for p in _visible(params)}
    # the constructor takes the fields as keywords or one config object, to the same record
    by_keywords = cls(**REQUIRED[name])
    by_object = cls(config_cls(**REQUIRED[name]))
    assert by_keywords.config() == by_object.config()
    keys = [(f.metadata["option"].key or f.name) for f in dataclasses.fields(config_cls)]
    assert list(by_keywords.config())[: len(keys)] == keys  # config(): one key per field, in field order
    # the CLI's defaults are the dataclass defaults (what Python callers get)
    defaults = {p.name: p.default for p in params if p.name in fields}
    assert defaults == {f.name: f.default for f in dataclasses.fields(config_cls)}


@pytest.mark.parametrize("name", BUILT_IN)
def test_every_option_states_its_unit(name):
    missing = [p.opts[0] for p in load_backend(name).cli_options() if not unit_of(p)]
    assert not missing, f"{name}: these options' help states no [unit: …]: {missing}"


def test_the_same_name_means_the_same_thing_in_every_backend():
    params = {name: {p.name: p for p in load_backend(name).cli_options()} for name in BUILT_IN}
    for name in ("sim", "engine-sim", "torch"):  # --model: a model geometry preset wherever there is a geometry
        model = params[name]["model"]
        assert unit_of(model) == "name" and "geometry" in model.help
        assert model.default is None or model.default in MODELS
    openai = params["openai"]
    assert "served_model" in openai and "model" not in openai  # a server's model is named, not a geometry
    for name in ("engine-sim", "torch"):  # the tiers below HBM, spelled alike
        for tier in ("dram_capacity", "ssd_capacity"):
            assert unit_of(params[name][tier]) == "blocks, tokens or bytes"
    for name, by_name in params.items():  # bandwidths say GB/s in their name and their unit
        for pname, p in by_name.items():
            if "bandwidth" in pname or "gbps" in pname:
                assert pname.endswith("_gbps"), (name, pname)
                assert unit_of(p).startswith("GB/s, 1e9 bytes/s"), (name, pname)


def test_python_api_takes_the_option_keywords(tmp_path):
    import kvbench
    from kvbench import api
    from kvbench.trace.files import new_meta, write_trace

    trace = write_trace(make_trace(12), tmp_path / "t.parquet", new_meta(4, {}))
    run = kvbench.replay(trace, backend="engine-sim", out=tmp_path / "new", report=False, dram_capacity="1GiB")
    assert run.summary["config"]["dram_capacity"] == "1GiB"
    with pytest.raises(KvbenchError, match="dram"):  # the pre-release spelling is gone
        kvbench.replay(trace, backend="engine-sim", out=tmp_path / "old", report=False, dram="1GiB")
    grid = api._grid({"trace": ["t.parquet"], "backend": "engine-sim,torch", "dram_capacity": "1GiB"})
    assert grid.options == {"dram_capacity": "1GiB"}


def test_a_config_dataclass_of_ones_own():
    """The mechanism for any backend: flags, defaults, units and the record."""

    @dataclasses.dataclass
    class Config:
        rate_gbps: float = option(1.5, "link speed", unit="GB/s, 1e9 bytes/s")
        name: str | None = option(None, "what to call it", unit="name", key="label")
        fast: bool = option(False, "go fast", unit="on/off", is_flag=True)

    params = options.cli_options(Config)
    assert [p.opts[0] for p in params] == ["--rate-gbps", "--name", "--fast"]
    assert [unit_of(p) for p in params] == ["GB/s, 1e9 bytes/s", "name", "on/off"]
    config, rest = options.parse(Config, {"rate_gbps": 3.0, "other": 1})
    assert config.rate_gbps == 3.0 and rest == {"other": 1}
    assert options.record(config, extra=2) == {"rate_gbps": 3.0, "label": None, "fast": False, "extra": 2}


def test_a_commands_options_come_from_one_dataclass_in_field_order():
    @dataclasses.dataclass(frozen=True)
    class CmdOptions:
        model: str | None = options.served_model("the served model name")
        out: str | None = option(None, "where to write", unit="path", flag=("-o", "--out"))
        rate: float = option(2.0, "requests sent per second", unit="requests/s")

    @click.command()
    @click.argument("trace")
    @options.command_options(CmdOptions)
    def cmd(trace, model, out, rate):
        click.echo(f"{trace} model={model} out={out} rate={rate}")

    assert [p.name for p in cmd.params] == ["trace", "model", "out", "rate"]
    assert [unit_of(p) for p in cmd.params[1:]] == ["name", "path", "requests/s"]
    runner = CliRunner()
    res = runner.invoke(cmd, ["t", "--served-model", "m1", "-o", "x", "--rate", "3"])
    assert res.exit_code == 0 and res.stdout.strip() == "t model=m1 out=x rate=3.0"
    assert runner.invoke(cmd, ["t"]).stdout.strip() == "t model=None out=None rate=2.0"
    assert runner.invoke(cmd, ["t", "--model", "m1"]).exit_code == 2  # --model is a geometry preset elsewhere
    assert "[unit: requests/s]  [default: 2.0]" in runner.invoke(cmd, ["--help"], terminal_width=200).stdout


def test_every_option_of_every_command_states_its_unit():
    def walk(command, path):
        ctx = click.Context(command)
        for name in command.list_commands(ctx) if isinstance(command, click.Group) else []:
            yield from walk(command.get_command(ctx, name), [*path, name])
        for p in command.params:
            if isinstance(p, click.Option) and not p.hidden and p.name not in ("help", "version"):
                yield " ".join(path), p

    missing = [f"kvbench {path} {p.opts[0]}" for path, p in walk(main, []) if not unit_of(p)]
    assert not missing, f"these options' help states no [unit: …]: {missing}"


def test_commands_that_talk_to_a_server_take_served_model_only():
    runner = CliRunner()
    for command in (["calibrate"], ["fidelity"], ["audit", "isolation"]):
        shown = runner.invoke(main, [*command, "--help"])
        assert "--served-model TEXT" in shown.stdout and "\n  --model" not in shown.stdout


def test_bounds_say_what_a_value_fails_to_be():
    count = options.Bounds(at_least=1, at_most=4, whole=True)
    assert [count.broken(v) for v in (0, 1, 2.5, 4, 5)] == [">= 1", None, "a whole number", None, "<= 4"]
    share = options.Bounds(above=0, below=1)
    assert [share.broken(v) for v in (0, 0.5, 1)] == ["> 0", None, "< 1"]
    assert options.Bounds(at_least=0.5).broken(0) == ">= 0.5"  # an int against a float bound


def test_policy_options_are_their_policies_fields():
    from kvbench.cache import policies
    from kvbench.cache.policy_options import parse_policy_options, policy_option_params

    declared = {f.name: name for name, pol in policies.registry().items() for f in policies.option_fields(pol)}
    params = {p.name: p for p in policy_option_params()}
    assert set(params) == set(declared) and declared  # one click option per field, none kept elsewhere
    for name, param in params.items():
        assert param.policies == {declared[name]} and param.help.startswith(f"[{declared[name]}] ")
    # a field's bounds are what the value is checked against; a count comes back an int
    assert parse_policy_options({"slots": "3", "small_fraction": "0.5"}) == {"slots": 3, "small_fraction": 0.5}
    with pytest.raises(KvbenchError, match=r"--slots '0' must be >= 1 \(slots\)"):
        parse_policy_options({"slots": "0"})
    with pytest.raises(KvbenchError, match="no policy takes the option"):
        parse_policy_options({"slotz": "3"})
    result = CliRunner().invoke(main, ["replay", "x.parquet", "--backend", "sim", "--help"], terminal_width=200)
    shown = r"--small-fraction TEXT +\[s3fifo\] S3-FIFO: .* \[unit: share of the capacity, 0-1\]"
    assert re.search(shown, result.stdout)
