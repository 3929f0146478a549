"""Importers of public trace formats. Each module registers itself with `@importer`; none is listed by hand.

An importer is `fn(src: Path, **options) -> (pa.Table, TraceMeta)`; it raises `TraceFormatError` naming the
file, line/row and field for anything it cannot read, and never drops a record silently. An importer that
streams also registers `write(src, out, **options) -> rows`, which converts the source batch by batch into a
validated trace file in bounded memory (mooncake, azure, burstgpt); the others build the table in memory
(bailian follows parent chains across the whole file; kv-cache-tester interleaves conversations by time).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from kvbench.errors import TraceFormatError
from kvbench.registry import Registry

# Help for the keyword options importers commonly take; an importer adds its own through `options=`.
COMMON_OPTIONS = {
    "block_size": "tokens per hash block of the source (the format documents its own)",
    "time_unit": "unit of the source's timestamps (s, ms or us) when it differs from the format's documented one",
    "workload": "workload label to put on every request [default: per format]",
}


@dataclass(frozen=True)
class Importer:
    name: str
    read: Callable
    summary: str
    option_help: dict[str, str]
    write: Callable | None = None  # streamed form: (src, out, **options) -> rows written


_REGISTRY: Registry[Importer] = Registry(__name__, "trace format")


def importer(name: str, options: dict[str, str] | None = None, write: Callable | None = None):
    """Register `fn(src, **options)`; `options` documents its keyword options beyond COMMON_OPTIONS; `write`
    is its streamed form, if it has one (same options, plus the output path)."""

    def wrap(fn):
        summary = (fn.__doc__ or name).strip().splitlines()[0]
        _REGISTRY.add(name, Importer(name, fn, summary, {**COMMON_OPTIONS, **(options or {})}, write))
        return fn

    return wrap


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
