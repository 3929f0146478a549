"""Point names.

A point is named by its labels' values joined with "/"; a number is followed by its unit, the last word of its
label's key (`{"policy": "lru", "capacity_blocks": 1000}` is `lru/1000blocks`, `{"policy": "vllm",
"instances": 2}` is `vllm/2instances`), so a name read alone in a table, a plot or requests.parquet says what
it counts (docs/semantics.md, "Point names").
"""

from __future__ import annotations

from numbers import Number


def _part(key: str, value) -> str:
    if isinstance(value, Number) and not isinstance(value, bool):
        return f"{value}{key.rsplit('_', 1)[-1]}"
    return str(value)


def point_name(labels: dict) -> str:
    """The name of the point with these labels (see the module's docstring)."""
    return "/".join(_part(k, v) for k, v in labels.items())
