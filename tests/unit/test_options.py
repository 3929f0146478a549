"""One option vocabulary (kvbench.options): each built-in backend's click options, constructor keywords and
config() record come from one dataclass; the same name means the same thing in every backend and every help
states its unit; the old spellings still work, with a warning on stderr (CLI) or a DeprecationWarning
(Python)."""

from __future__ import annotations

import dataclasses
import json
import warnings

import click
import pytest
from click.testing import CliRunner

from kvbench import options
from kvbench.cache.capacity import MODELS
from kvbench.cli import main
from kvbench.errors import KvbenchError
from kvbench.options import DeprecatedAlias, option, unit_of
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
    assert "served_model" in openai and isinstance(openai["model"], DeprecatedAlias) and openai["model"].hidden
    for name in ("engine-sim", "torch"):  # the tiers below HBM, spelled alike
        for tier in ("dram_capacity", "ssd_capacity"):
            assert unit_of(params[name][tier]) == "blocks, tokens or bytes"
    for name, by_name in params.items():  # bandwidths say GB/s in their name and their unit
        for pname, p in by_name.items():
            if "bandwidth" in pname or "gbps" in pname:
                assert pname.endswith("_gbps") or isinstance(p, DeprecatedAlias), (name, pname)
                assert unit_of(p).startswith("GB/s, 1e9 bytes/s"), (name, pname)


@pytest.mark.parametrize(
    "name,old,new,value",
    [
        ("engine-sim", "dram", "dram_capacity", "20GB"),
        ("engine-sim", "ssd", "ssd_capacity", "1TB"),
        ("engine-sim", "pool_bandwidth", "pool_bandwidth_gbps", 4.0),
        ("torch", "host_capacity", "dram_capacity", "500"),
        ("torch", "disk_capacity", "ssd_capacity", "1500"),
        ("openai", "model", "served_model", "tiny"),
    ],
)
def test_old_keywords_work_with_a_deprecation_warning(name, old, new, value):
    cls = load_backend(name)
    with pytest.warns(DeprecationWarning, match=f"{old}= .* is deprecated.*use {new}="):
        backend = cls(**REQUIRED[name], **{old: value})
    assert backend.config()[new] == value
    with pytest.raises(KvbenchError, match="not both"):
        cls(**REQUIRED[name], **{old: value, new: "2" if isinstance(value, str) else 2.0})


def _cli(name: str, args: list[str]):
    """The backend's options parsed as `kvbench replay` parses them, the backend built from them."""
    cls = load_backend(name)

    def run(**kwargs):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            click.echo(json.dumps(cls(**kwargs).config(), default=str))

    cmd = click.Command("replay", params=cls.cli_options(), callback=run)
    return CliRunner().invoke(
        cmd, [*sum((["--" + k.replace("_", "-"), v] for k, v in REQUIRED[name].items()), []), *args]
    )


@pytest.mark.parametrize(
    "name,args,key,value",
    [
        ("engine-sim", ["--dram", "64GiB"], "dram_capacity", "64GiB"),
        ("engine-sim", ["--pool-bandwidth", "10"], "pool_bandwidth_gbps", 10.0),
        ("torch", ["--disk-capacity", "800"], "ssd_capacity", "800"),
        ("openai", ["--model", "tiny"], "served_model", "tiny"),
    ],
)
def test_old_flags_work_and_warn_on_stderr(name, args, key, value):
    res = _cli(name, args)
    assert res.exit_code == 0, res.output
    assert f"{args[0]} is deprecated" in res.stderr
    assert json.loads(res.stdout)[key] == value
    new = _cli(
        name,
        [options.flag_of(next(f for f in dataclasses.fields(load_backend(name).Config) if f.name == key)), args[1]],
    )
    assert new.exit_code == 0 and "deprecated" not in new.stderr and json.loads(new.stdout)[key] == value


def test_help_lists_the_new_spellings_and_names_the_old():
    runner = CliRunner()
    text = runner.invoke(main, ["replay", "--backend", "engine-sim", "--help"]).output
    assert "--dram-capacity" in text and "--pool-bandwidth-gbps" in text and "formerly --dram" in text
    text = runner.invoke(main, ["replay", "--backend", "openai", "--help"]).output
    assert "--served-model" in text and "formerly --model" in text


def test_python_api_takes_new_and_old_keywords(tmp_path):
    import kvbench
    from kvbench import api
    from kvbench.trace.files import new_meta, write_trace

    trace = write_trace(make_trace(12), tmp_path / "t.parquet", new_meta(4, {}))
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        run = kvbench.replay(trace, backend="engine-sim", out=tmp_path / "new", report=False, dram_capacity="1GiB")
    with pytest.warns(DeprecationWarning, match="dram= .*use dram_capacity=") as caught:
        old = kvbench.replay(trace, backend="engine-sim", out=tmp_path / "old", report=False, dram="1GiB")
    assert caught[0].filename == __file__  # the warning points at the caller's line
    assert run.summary["config"]["dram_capacity"] == old.summary["config"]["dram_capacity"] == "1GiB"
    assert run.hit_rate == old.hit_rate
    with pytest.warns(DeprecationWarning):  # a sweep gives each backend the new name, whatever the old one was
        grid = api._grid({"trace": ["t.parquet"], "backend": "engine-sim,torch", "host_capacity": "1GiB"})
    assert grid.options == {"dram_capacity": "1GiB"}


def test_a_config_dataclass_of_ones_own():
    """The mechanism for any backend: flags, defaults, units, the record and an old spelling."""

    @dataclasses.dataclass
    class Config:
        rate_gbps: float = option(1.5, "link speed", unit="GB/s, 1e9 bytes/s", old=["--rate"])
        name: str | None = option(None, "what to call it", unit="name", key="label")
        fast: bool = option(False, "go fast", unit="on/off", is_flag=True)

    params = options.cli_options(Config)
    assert [p.opts[0] for p in params] == ["--rate-gbps", "--name", "--fast", "--rate"]
    assert [unit_of(p) for p in params[:3]] == ["GB/s, 1e9 bytes/s", "name", "on/off"] and params[3].hidden
    with pytest.warns(DeprecationWarning):
        config, rest = options.parse(Config, {"rate": 3.0, "other": 1})
    assert config.rate_gbps == 3.0 and rest == {"other": 1}
    assert options.record(config, extra=2) == {"rate_gbps": 3.0, "label": None, "fast": False, "extra": 2}


def test_commands_that_talk_to_a_server_take_served_model_and_still_the_old_model():
    from click.testing import CliRunner

    @click.command()
    @options.served_model_option(help="the served model name")
    def cmd(model):
        click.echo(f"model={model}")

    runner = CliRunner()
    new = runner.invoke(cmd, ["--served-model", "m1"])
    assert new.exit_code == 0 and "model=m1" in new.stdout and "deprecated" not in new.stderr
    old = runner.invoke(cmd, ["--model", "m1"])
    assert old.exit_code == 0 and "model=m1" in old.stdout and "--model is deprecated" in old.stderr
    assert runner.invoke(cmd, []).stdout.strip() == "model=None"
    both = runner.invoke(cmd, ["--model", "a", "--served-model", "b"])
    assert both.exit_code == 2 and "not both" in both.stderr
    for command in ("calibrate", "fidelity"):
        shown = runner.invoke(main, [command, "--help"])
        assert "--served-model TEXT" in shown.stdout and "  --model TEXT" not in shown.stdout  # the old one is hidden
