"""Importers of public trace formats. Each module registers itself with `@importer`; none is listed by hand.

An importer is `fn(src: Path, **options) -> (pa.Table, TraceMeta)`; it raises `TraceFormatError` naming the
file, line/row and field for anything it cannot read, and never drops a record silently. An importer that
streams also registers `write(src, out, **options) -> rows`, which converts the source batch by batch into a
validated trace file in bounded memory (mooncake, azure, burstgpt); the others build the table in memory
(bailian follows parent chains across the whole file; kv-cache-tester interleaves conversations by time).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import click

from kvbench.errors import TraceFormatError
from kvbench.options import option
from kvbench.registry import Registry


# The options importers commonly take, as `kvbench.options.option` fields of an importer's options dataclass.
def block_size_option(
    default: int | None, help: str = "tokens per hash block of the source (the format documents its own)"
):
    return option(default, help, unit="tokens", type=int)


def time_unit_option():
    return option(
        None,
        "unit of the source's timestamps (s, ms or us) when it differs from the format's documented one",
        unit="name",
        type=click.Choice(["s", "ms", "us"]),
    )


def workload_option(help: str = "workload label to put on every request [default: per format]"):
    return option(None, help, unit="name")


@dataclass(frozen=True)
class Importer:
    name: str
    read: Callable
    summary: str
    options: type  # a dataclass of its keyword options (`kvbench.options.option` fields): `trace import`'s options
    write: Callable | None = None  # streamed form: (src, out, **options) -> rows written


_REGISTRY: Registry[Importer] = Registry(__name__, "trace format")


def importer(name: str, options: type, write: Callable | None = None):
    """Register `fn(src, **options)`; `options` declares its keyword options (each with its help and unit),
    which must be fn's own, with the same defaults; `write` is its streamed form, if it has one (same options,
    plus the output path)."""

    def wrap(fn):
        _check_options(name, fn, options)
        summary = (fn.__doc__ or name).strip().splitlines()[0]
        _REGISTRY.add(name, Importer(name, fn, summary, options, write))
        return fn

    return wrap


def _check_options(name: str, fn: Callable, options: type) -> None:
    """The declared options are the reader's keyword arguments (less `progress`, the command's callback), in
    its order and with its defaults: a Python caller and `kvbench trace import` then read a trace alike."""
    params = [p for p in list(inspect.signature(fn).parameters.values())[1:] if p.name != "progress"]
    declared = [(f.name, f.default) for f in dataclasses.fields(options)]
    if declared != [(p.name, p.default) for p in params]:
        raise TypeError(f"importer {name}: {options.__name__} declares {declared}, but {fn.__name__} takes {params}")


registry = _REGISTRY.all
get = _REGISTRY.get


def read_jsonl(path: Path) -> Iterator[tuple[int, dict]]:
    """Yield (line number, record) from a JSONL file; a broken line is an error naming file and line."""
    path = Path(path)
    if not path.exists():
        raise TraceFormatError(f"{path}: no such file")
    empty = True
    with path.open("rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            if not raw.strip():
                continue
            try:
                rec = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise TraceFormatError(
                    f"{path}: line {lineno} is not valid JSON ({exc.msg if hasattr(exc, 'msg') else exc})"
                ) from None
            if not isinstance(rec, dict):
                raise TraceFormatError(f"{path}: line {lineno} is not a JSON object")
            empty = False
            yield lineno, rec
    if empty:
        raise TraceFormatError(f"{path}: file has no records")


def require(rec: dict, field: str, kind, path: Path, where: str):
    """Fetch a required field of a record and check its type; errors name file, line/row and field."""
    if field not in rec:
        raise TraceFormatError(f"{path}: {where}: field {field!r} is missing")
    value = rec[field]
    if kind is int and isinstance(value, float) and value.is_integer():
        value = int(value)
    ok = isinstance(value, kind) and not (kind in (int, float) and isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        ok, value = True, float(value)
    if not ok:
        raise TraceFormatError(f"{path}: {where}: field {field!r} should be {kind.__name__}, got {value!r}")
    return value
