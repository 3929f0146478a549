"""Backend options declared once (docs/architecture.md, Options). A backend's settings are one dataclass whose
fields are made with `option(...)`: each carries its help, its unit, its click type and the old spellings that
still work. From that class come the three things the backend protocol (kvbench.run.backend) asks for:

- `cli_options(cls)`: the `kvbench replay` options, one per field, each help ending in `[unit: …]`, plus a
  hidden option per old spelling that warns on stderr when used;
- `parse(cls, kwargs)`: the constructor's keyword arguments read into the dataclass (old keywords accepted
  with a DeprecationWarning), and what is left for options declared elsewhere (policies', scenarios');
- `record(config, **resolved)`: the `config()` record, one key per field.

It is an opt-in helper: a plug-in backend may write the three methods by hand (tests/plugins has one)."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import click

from kvbench.errors import KvbenchError

NO_UNIT = ("name", "path", "on/off", "unitless", "")  # what an option states when no unit applies
UNIT_TAG = "[unit: "  # how every help states its unit, so that a test (and a reader) can find it


@dataclasses.dataclass(frozen=True)
class Spec:
    """What a field says about its option (the metadata `option` stores)."""

    help: str | Callable[[], str]  # a callable when the text is made from a registry (read at --help time)
    unit: str  # GB/s, bytes, s, …; "name", "path", "on/off" or "unitless" where no unit applies
    flag: str | None  # "--salt/--no-salt", "--timeout"; None: "--" + the field name with hyphens
    type: Any  # a click type; None: click's guess from the default
    old: tuple[str, ...]  # earlier spellings, still accepted for one release
    key: str | None  # the field's name in config() when it differs (policy -> policies: the parsed list)
    click: dict  # further click.Option arguments (is_flag, multiple, envvar, metavar, show_default)


def option(
    default, help: str | Callable[[], str], *, unit: str, flag=None, type=None, old=(), key=None, **click_kwargs
):
    """A backend option as a dataclass field; `unit` is shown in --help (GB/s means 1e9 bytes/s)."""
    spec = Spec(help, unit, flag, type, tuple(old), key, click_kwargs)
    return dataclasses.field(default=default, metadata={"option": spec})


def _spec(field: dataclasses.Field) -> Spec:
    return field.metadata["option"]


def flag_of(field: dataclasses.Field) -> str:
    """The field's main flag (`--salt` of `--salt/--no-salt`)."""
    return (_spec(field).flag or "--" + field.name.replace("_", "-")).split("/")[0]


def tagged(help: str | Callable[[], str], unit: str) -> str:
    """`help` with its unit stated, before a default the help states itself, as click places its own default
    last (two brackets one space apart would also read as a Markdown reference link in the docs site)."""
    text = help() if callable(help) else help
    head, sep, default = text.rpartition(" [default: ")
    if sep and default.endswith("]"):
        return f"{head} {UNIT_TAG}{unit}]  [default: {default}"
    return f"{text} {UNIT_TAG}{unit}]"


def _help(spec: Spec) -> str:
    """The help as --help shows it: the text, the old spellings while they last, the unit."""
    text = spec.help() if callable(spec.help) else spec.help
    if spec.old:
        text += f" (formerly {', '.join(spec.old)}, which still works in this release)"
    return tagged(text, spec.unit)


def _alias_name(old: str) -> str:
    return old.lstrip("-").replace("-", "_")


class DeprecatedAlias(click.Option):
    """An old spelling of an option (hidden from --help): its value goes to `replaced_by`, with a warning on
    stderr when it is given on the command line."""

    def __init__(self, old: str, field: dataclasses.Field):
        spec = _spec(field)
        self.replaced_by, self.new_flag, self.new_default = field.name, flag_of(field), field.default
        super().__init__(
            [old, _alias_name(old)],
            type=spec.type,
            default=None,
            hidden=True,
            help=tagged(f"deprecated spelling of {self.new_flag}", spec.unit),
        )

    def handle_parse_result(self, ctx: click.Context, opts, args):
        # `opts` holds what the command line gave (a default_map's values, the Python API's, never get here)
        if opts.get(self.name) is not None:
            click.echo(f"kvbench: warning: {self.opts[0]} is deprecated, use {self.new_flag} (same value)", err=True)
        return super().handle_parse_result(ctx, opts, args)


def cli_options(cls) -> list[click.Option]:
    """The click options of a config dataclass, in field order, then the hidden old spellings."""
    opts, aliases = [], []
    for f in dataclasses.fields(cls):
        spec = _spec(f)
        extra = dict(spec.click)
        plain_flag = extra.get("is_flag") and "/" not in (spec.flag or "")
        extra.setdefault("show_default", f.default is not None and not plain_flag)
        opts.append(
            click.Option(
                [spec.flag or flag_of(f), f.name], type=spec.type, default=f.default, help=_help(spec),
                **extra,
            )
        )  # fmt: skip
        aliases += [DeprecatedAlias(old, f) for old in spec.old]
    return opts + aliases


@dataclasses.dataclass(frozen=True)
class Renaming:
    """An old keyword and the field it now sets."""

    old: str  # the old keyword (its flag: --old-name)
    new: str
    new_flag: str
    new_default: Any


def renamings(cls) -> list[Renaming]:
    """The old spellings of a config dataclass."""
    return [
        Renaming(_alias_name(old), f.name, flag_of(f), f.default)
        for f in dataclasses.fields(cls)
        for old in _spec(f).old
    ]


def renamings_of(params: list[click.Parameter]) -> list[Renaming]:
    """The old spellings among a backend's click options (none for a backend that does not use this module)."""
    return [
        Renaming(p.name, p.replaced_by, p.new_flag, p.new_default) for p in params if isinstance(p, DeprecatedAlias)
    ]


def renamed(renames: list[Renaming], kwargs: dict, stacklevel: int = 2) -> dict:
    """`kwargs` with every old keyword (given, not None) replaced by its field's name, each with a
    DeprecationWarning (`stacklevel` as warnings.warn counts it from the caller of `renamed`); both spellings
    with different values is an error."""
    by_old = {r.old: r for r in renames}
    out = {k: v for k, v in kwargs.items() if k not in by_old}
    for name, value in kwargs.items():
        r = by_old.get(name)
        if r is None or value is None:
            continue
        new = kwargs.get(r.new)
        if new is not None and new != r.new_default and new != value:
            raise KvbenchError(f"give {r.new_flag} or its old spelling --{name.replace('_', '-')}, not both")
        warnings.warn(
            f"{name}= (--{name.replace('_', '-')}) is deprecated and goes in the next release; use "
            f"{r.new}= ({r.new_flag})",
            DeprecationWarning,
            stacklevel=stacklevel + 1,
        )
        out[r.new] = value
    return out


def parse(cls, kwargs: dict, stacklevel: int = 3):
    """(the config dataclass, the other keyword arguments): a field not given takes its default."""
    kwargs = renamed(renamings(cls), kwargs, stacklevel)
    names = {f.name for f in dataclasses.fields(cls)}
    config = cls(**{k: v for k, v in kwargs.items() if k in names})
    return config, {k: v for k, v in kwargs.items() if k not in names}


def build(cls, config, kwargs: dict, stacklevel: int = 4):
    """What a backend's `__init__(self, config=None, **kwargs)` starts with: a config object given as is, or
    one read from the keyword arguments (plus the rest, for options declared elsewhere)."""
    if config is None:
        return parse(cls, kwargs, stacklevel)
    if not isinstance(config, cls):
        raise TypeError(f"config must be a {cls.__name__}, not {type(config).__name__}")
    return config, kwargs


def record(config, **resolved) -> dict:
    """The config() record: one key per field (its `key` where it has one), valued as given unless `resolved`
    names the field (the value the backend made of it: a parsed list, a detected device); further `resolved`
    keys are appended (options declared elsewhere)."""
    out = {}
    for f in dataclasses.fields(config):
        out[_spec(f).key or f.name] = resolved.pop(f.name) if f.name in resolved else getattr(config, f.name)
    return {**out, **resolved}


def with_units(options: list[click.Option], units: dict[str, str]) -> list[click.Option]:
    """Options declared elsewhere (pacing, scenarios) with the unit of those named in `units` added to their
    help, when it does not state one yet. They are changed in place (a scenario's are class attributes), which
    is safe to repeat: a help that states a unit is left as it is."""
    for opt in options:
        if opt.name in units and UNIT_TAG not in (opt.help or ""):
            opt.help = tagged(opt.help or "", units[opt.name])
    return options


def unit_of(opt: click.Parameter) -> str | None:
    """The unit an option's help states, or None."""
    help = getattr(opt, "help", None) or ""
    start = help.rfind(UNIT_TAG)
    return help[start + len(UNIT_TAG) : help.index("]", start)] if start >= 0 else None


class PolicyOption(click.Option):
    """A backend option that only some eviction policies use (`--quota` for tenant-quota, …). Declaring which
    lets a sweep over several policies give the option to those points only: the backend refuses an option
    that none of a run's policies takes."""

    def __init__(self, *args, policies: frozenset[str], **kwargs):
        super().__init__(*args, **kwargs)
        self.policies = policies


def served_model_option(help: str):
    """`--served-model NAME` for a command that talks to a server (calibrate, fidelity, audit): the name the
    server serves, where `--model` means a model geometry everywhere else. `--model` still works for one
    release, hidden, with a warning on stderr. Both land in the command's `model` parameter."""

    def keep_old(ctx: click.Context, param, value):
        # click processes options given on the command line first: --model may already have set `model`
        if value is not None and ctx.params.get("model") not in (None, value):
            raise click.UsageError("give --served-model or its old spelling --model, not both")
        return value if value is not None else ctx.params.get("model")

    def old_spelling(ctx: click.Context, param, value):
        if value is not None:
            click.echo("kvbench: warning: --model is deprecated here, use --served-model (same value)", err=True)
            if ctx.params.get("model") not in (None, value):
                raise click.UsageError("give --served-model or its old spelling --model, not both")
            ctx.params["model"] = value

    def decorate(f):
        f = click.option("--model", "old_model", hidden=True, expose_value=False, callback=old_spelling)(f)
        return click.option("--served-model", "model", callback=keep_old, help=help)(f)

    return decorate
