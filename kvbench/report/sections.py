"""The sections of a run's report, registered where each is written (docs/architecture.md, Registration), so that
the page's table of contents is not a list kept by hand in kvbench/report/run.py. Each section names its place
on the page (`order`, smallest first), what of the run it reads (the summary, the requests, the trace, …) and
whether it needs a point: a run interrupted before its first point shows only the run-wide sections."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import pyarrow as pa

from kvbench.registry import Registry


class Inputs(NamedTuple):
    """What a section may read of one run."""

    summary: dict
    requests: pa.Table | None  # requests.parquet (its first rows when `truncated`)
    trace: pa.Table | None  # the trace replayed, when at hand (its first rows when long)
    truncated: bool
    point: str | None  # the first point's name: the trace views show that point


class RunSection(NamedTuple):
    order: int
    make: Callable  # called with the Inputs fields named in `reads`; returns a Section or a list of them
    reads: tuple[str, ...]
    per_point: bool


# the public modules of kvbench.report, imported on the first read, register their sections as they load
RUN_SECTIONS: Registry[RunSection] = Registry("kvbench.report", "report section")


def section_at(order: int, *reads: str, per_point: bool = False):
    """Register the decorated function as the run report's section at `order`, called with the `reads` fields
    of `Inputs` in that order; the function is returned unchanged (other pages call it too)."""
    unknown = set(reads) - set(Inputs._fields)
    if unknown:
        raise ValueError(f"a section reads one of {', '.join(Inputs._fields)}, not {', '.join(sorted(unknown))}")

    def add(make):
        RUN_SECTIONS.add(make.__name__, RunSection(order, make, reads, per_point))
        return make

    return add


def run_sections(inputs: Inputs) -> list:
    """Every registered section of the run, in page order."""
    out = []
    for entry in sorted(RUN_SECTIONS.values(), key=lambda s: s.order):
        if entry.per_point and inputs.point is None:
            continue
        made = entry.make(*(getattr(inputs, name) for name in entry.reads))
        out += made if isinstance(made, list) else [made]
    return out
