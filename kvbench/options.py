"""Options declared once (docs/architecture.md, Options). A backend's settings, a command's options, a trace
generator's parameters, the pacing and scenario options are each one dataclass whose fields are made with
`option(...)`: each carries its help, its unit and its click type. From such a class come:

- `cli_options(cls)`: the click options, one per field in field order, each help ending in `[unit: …]`;
- `command_options(cls)`: the same as a decorator of a click command;
- `parse(cls, kwargs)`: a backend's keyword arguments read into the dataclass, and what is left for options
  declared elsewhere (policies', scenarios');
- `record(config, **resolved)`: a backend's `config()` record, one key per field;
- `Bounds`: the range a number must lie in, checked where the values are read (generators, policies).

It is an opt-in helper: a plug-in backend may write its three methods by hand (tests/plugins has one)."""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable
from typing import Any

import click

NO_UNIT = ("name", "path", "on/off", "unitless", "")  # what an option states when no unit applies
UNIT_TAG = "[unit: "  # how every help states its unit, so that a test (and a reader) can find it


@dataclasses.dataclass(frozen=True)
class Bounds:
    """Where a numeric option's value must lie; `whole`: a count (a whole number, read as an int)."""

    at_least: float | None = None
    above: float | None = None
    at_most: float | None = None
    below: float | None = None
    whole: bool = False

    def broken(self, value: float) -> str | None:
        """What `value` (a finite number) fails to be, e.g. "a whole number" or ">= 1", or None."""
        if self.whole and value != int(value):
            return "a whole number"
        rules = ((">=", self.at_least, operator.ge), (">", self.above, operator.gt),
                 ("<=", self.at_most, operator.le), ("<", self.below, operator.lt))  # fmt: skip
        broken = (f"{sign} {bound}" for sign, bound, holds in rules if bound is not None and not holds(value, bound))
        return next(broken, None)


@dataclasses.dataclass(frozen=True)
class Spec:
    """What a field says about its option (the metadata `option` stores)."""

    help: str | Callable[[], str]  # a callable when the text is made from a registry (read at --help time)
    unit: str  # GB/s, bytes, s, …; "name", "path", "on/off" or "unitless" where no unit applies
    flag: str | tuple[str, ...] | None  # "--salt/--no-salt", ("-o", "--out"); None: "--" + the field name, hyphens
    type: Any  # a click type; None: click's guess from the default
    key: str | None  # the field's name in config() when it differs (policy -> policies: the parsed list)
    bounds: Bounds | None  # a number's range, checked by whoever reads the value (click does not)
    click: dict  # further click.Option arguments (is_flag, multiple, envvar, metavar, show_default)


def option(
    default, help: str | Callable[[], str], *, unit: str, flag=None, type=None, key=None, bounds=None, **click_kwargs
):
    """An option as a dataclass field (a backend's, a command's, a policy's, an importer's); `unit` is shown in
    --help (GB/s means 1e9 bytes/s)."""
    spec = Spec(help, unit, flag, type, key, bounds, click_kwargs)
    return dataclasses.field(default=default, metadata={"option": spec})


def spec(field: dataclasses.Field) -> Spec:
    """What the field says about its option."""
    return field.metadata["option"]


def help_of(field: dataclasses.Field) -> str:
    """The field's help as written, without its unit (for a message that quotes it)."""
    help = spec(field).help
    return help() if callable(help) else help


def _decls(field: dataclasses.Field) -> list[str]:
    flag = spec(field).flag or "--" + field.name.replace("_", "-")
    return [flag] if isinstance(flag, str) else list(flag)


def flag_of(field: dataclasses.Field) -> str:
    """The field's main flag (`--salt` of `--salt/--no-salt`, `--out` of `-o/--out`)."""
    decls = _decls(field)
    return next((d for d in decls if d.startswith("--")), decls[0]).split("/")[0]


def tagged(help: str | Callable[[], str], unit: str) -> str:
    """`help` with its unit stated, before a default the help states itself, as click places its own default
    last (two brackets one space apart would also read as a Markdown reference link in the docs site)."""
    text = help() if callable(help) else help
    head, sep, default = text.rpartition(" [default: ")
    if sep and default.endswith("]"):
        return f"{head} {UNIT_TAG}{unit}]  [default: {default}"
    return f"{text} {UNIT_TAG}{unit}]"


def cli_option(f: dataclasses.Field, kind: type[click.Option] = click.Option, prefix: str = "", **more) -> click.Option:
    """The click option of one field: a `kind` of click.Option (PolicyOption, with its `more` arguments), its
    help after `prefix` (e.g. the policy that takes it)."""
    declared = spec(f)
    extra = {**declared.click, **more}
    plain_flag = extra.get("is_flag") and not any("/" in d for d in _decls(f))
    extra.setdefault("show_default", f.default is not None and not plain_flag)
    help = tagged(prefix + help_of(f), declared.unit)
    return kind([*_decls(f), f.name], type=declared.type, default=f.default, help=help, **extra)


def cli_options(cls) -> list[click.Option]:
    """The click options of a config dataclass, in field order."""
    return [cli_option(f) for f in dataclasses.fields(cls)]


def command_options(cls):
    """A decorator that gives a click command the options of `cls` (`cli_options`), in field order, where it
    stands among the command's other decorators, as the same run of `@click.option`s would."""
    params = cli_options(cls)

    def decorate(f):
        if isinstance(f, click.Command):
            f.params.extend(params)
        else:  # click reverses the decorators' list when it makes the command
            f.__dict__.setdefault("__click_params__", []).extend(reversed(params))
        return f

    return decorate


def parse(cls, kwargs: dict):
    """(the config dataclass, the other keyword arguments): a field not given takes its default."""
    names = {f.name for f in dataclasses.fields(cls)}
    config = cls(**{k: v for k, v in kwargs.items() if k in names})
    return config, {k: v for k, v in kwargs.items() if k not in names}


def build(cls, config, kwargs: dict):
    """What a backend's `__init__(self, config=None, **kwargs)` starts with: a config object given as is, or
    one read from the keyword arguments (plus the rest, for options declared elsewhere)."""
    if config is None:
        return parse(cls, kwargs)
    if not isinstance(config, cls):
        raise TypeError(f"config must be a {cls.__name__}, not {type(config).__name__}")
    return config, kwargs


def record(config, **resolved) -> dict:
    """The config() record: one key per field (its `key` where it has one), valued as given unless `resolved`
    names the field (the value the backend made of it: a parsed list, a detected device); further `resolved`
    keys are appended (options declared elsewhere)."""
    out = {}
    for f in dataclasses.fields(config):
        out[spec(f).key or f.name] = resolved.pop(f.name) if f.name in resolved else getattr(config, f.name)
    return {**out, **resolved}


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


def served_model(help: str):
    """`--served-model NAME` of a command that talks to a server (calibrate, fidelity, audit), as the command's
    `model` field: the name the server serves, where `--model` means a model geometry everywhere else."""
    return option(None, help, unit="name", flag="--served-model")
