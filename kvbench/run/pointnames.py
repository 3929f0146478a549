"""Point names, and reading the runs recorded before they carried their units.

A point is named by its labels' values joined with "/"; a number is followed by its unit, the last word of its
label's key (`{"policy": "lru", "capacity_blocks": 1000}` is `lru/1000blocks`, `{"policy": "vllm",
"instances": 2}` is `vllm/2instances`), so a name read alone in a table, a plot or requests.parquet says what
it counts (docs/semantics.md, "Point names").

kvbench 0.1.0 wrote the bare values (`lru/1000`, `vllm/2`). A run recorded so is read with the names it
would have today: its summary's points (`migrate_summary`), its requests' `point` column (`rename_column`)
and a mapping keyed by point name (`PointsByName`, which still answers an old name) — each with a
`LegacyPointNames` warning naming the run. These readers go in the next release.
"""

from __future__ import annotations

import json
import re
import warnings
from numbers import Number
from pathlib import Path

import pyarrow as pa

from kvbench.errors import KvbenchDeprecationWarning
from kvbench.trace.compute import pc

_NUMBER_WITH_UNIT = re.compile(r"^(-?\d+(?:\.\d+)?)[A-Za-z]+$")


def _part(key: str, value) -> str:
    if isinstance(value, Number) and not isinstance(value, bool):
        return f"{value}{key.rsplit('_', 1)[-1]}"
    return str(value)


def point_name(labels: dict) -> str:
    """The name of the point with these labels (see the module's docstring)."""
    return "/".join(_part(k, v) for k, v in labels.items())


def legacy_name(name: str) -> str:
    """The name kvbench 0.1.0 gave the point now named `name` (its units dropped)."""
    return "/".join(_NUMBER_WITH_UNIT.sub(r"\1", part) for part in name.split("/"))


class LegacyPointNames(KvbenchDeprecationWarning):
    """A run recorded with the point names of kvbench 0.1.0, read with today's."""


def renames(points: list[dict]) -> dict[str, str]:
    """{old name: name} for the points of a summary recorded with bare values. A summary point is
    {"name", *labels, *totals, ...} in that order (runner), so its labels are the keys after "name", as many
    as the name has parts; a point whose name is not those values joined is left as it is."""
    out = {}
    for point in points:
        name = point.get("name")
        if not isinstance(name, str):
            continue
        keys = list(point)[1:][: len(name.split("/"))]
        if keys and list(point)[0] == "name":
            labels = {k: point[k] for k in keys}
            if "/".join(map(str, labels.values())) == name and point_name(labels) != name:
                out[name] = point_name(labels)
    return out


_warned: set[str] = set()  # runs already warned about, once per process (a report reads a run several times)


def _warn(run: str, renamed: dict[str, str]) -> None:
    if run in _warned:
        return
    _warned.add(run)
    old, new = next(iter(renamed.items()))
    warnings.warn(
        f"{run}: recorded by kvbench 0.1.0 with point names without units ({old}); read as {new} and so on. "
        "The next release stops reading the old names: re-run, or keep this kvbench to read it.",
        LegacyPointNames,
        stacklevel=3,
    )


def migrate_summary(summary: dict, run: str) -> dict:
    """`summary` with its points named as today, warning once if any was renamed."""
    renamed = renames(summary.get("points") or [])
    if renamed:
        _warn(run, renamed)
        for point in summary["points"]:
            point["name"] = renamed.get(point["name"], point["name"])
    return summary


def run_renames(run_dir: Path) -> dict[str, str]:
    """The renames for the run in `run_dir` (none when its summary is missing or unreadable: a run still
    being written, whose points are named as today)."""
    try:
        summary = json.loads((Path(run_dir) / "summary.json").read_text())
    except (OSError, ValueError):
        return {}
    return renames(summary.get("points") or []) if isinstance(summary, dict) else {}


def rename_column(rows: pa.Table, renamed: dict[str, str], run: str) -> pa.Table:
    """`rows` with its `point` column named as today."""
    if not renamed or "point" not in rows.column_names:
        return rows
    _warn(run, renamed)
    old = pa.array(list(renamed), pa.string())
    new = pa.array(list(renamed.values()), pa.string())
    col = pc.cast(rows.column("point"), pa.string())
    at = pc.index_in(col, value_set=old)
    named = pc.if_else(pc.is_null(at), col, pc.take(new, pc.fill_null(at, 0)))
    return rows.set_column(rows.column_names.index("point"), "point", named)


class PointsByName(dict):
    """A dict keyed by point name that also answers a name spelt as kvbench 0.1.0 did (`lru/1000` for
    `lru/1000blocks`), with a warning."""

    def __missing__(self, key):
        if isinstance(key, str):
            for name in self:
                if legacy_name(name) == key and name != key:
                    warnings.warn(
                        f"point name {key!r} is the old spelling of {name!r}; the next release only knows {name!r}",
                        LegacyPointNames,
                        stacklevel=2,
                    )
                    return self[name]
        raise KeyError(key)

    def get(self, key, default=None):
        try:
            return self[key]
        except KeyError:
            return default
