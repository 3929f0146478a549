"""A sweep's index page (index.html / index.md): its grid, every point's status with the error of each failed
one, links to the point reports, and the comparison of every point that has a run."""

from __future__ import annotations

import os
import re
from pathlib import Path

from kvbench.report.compare import page_sections, write_page
from kvbench.report.page import Links, Section, Table, pct
from kvbench.run.comparison import analyse, load_run

ABSOLUTE = re.compile(r"(?<![\w.~:/])/(?:[\w.+-]+/)+([\w.+-]+)")


def _shown(text: str, out_dir: Path) -> str:
    """Error text as the report shows it: this machine's folders replaced by relative or home-relative ones."""
    try:
        here = [(Path.cwd(), ".")]
    except FileNotFoundError:  # this process's folder is gone (a Ray job's driver once it joined the cluster)
        here = []
    for folder, short in ((out_dir.resolve(), "."), *here, (Path.home(), "~")):
        text = text.replace(str(folder) + os.sep, short + os.sep).replace(str(folder), short)
    return ABSOLUTE.sub(r"…/\1", text)  # any other absolute path: its last part only (URLs are left alone)


def _path(p: str) -> str:
    return p if not Path(p).is_absolute() else Path(p).name


def write_index(out_dir: Path, manifest: dict, progress=None) -> None:
    """index.html / index.md: the grid, every point's status (failures with their error) and report, and
    the comparison of every point that has a run. `progress`: called as the comparison's bootstrap advances."""
    grid = manifest["grid"]
    rows = [["trace", ", ".join(_path(t) for t in grid["traces"])], ["backend", ", ".join(grid["backends"])]]
    for label, key in (("policy", "policies"), ("capacity", "capacities"), ("engine args", "engine_args")):
        if grid.get(key):
            rows.append([label, ", ".join(grid[key])])
    if grid.get("engine"):
        rows.append(["engine", grid["engine"]])
    points = manifest["points"]
    status = [
        [
            p["name"], p["status"], p.get("policy") or "–", p.get("capacity") or "–", p.get("engine_args") or "–",
            pct(p.get("hit_rate")), "–" if p.get("seconds") is None else f"{p['seconds']:.1f}",
            _shown(p.get("error") or "", out_dir),
        ]
        for p in points
    ]  # fmt: skip
    header = ["point", "status", "policy", "capacity", "engine args", "hit rate", "seconds", "error"]
    reports = [(p["name"], f"{p['dir']}/report.html") for p in points if (out_dir / p["dir"] / "report.html").exists()]
    counts = {s: sum(p["status"] == s for p in points) for s in ("ok", "skipped", "failed", "pending")}
    note = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
    note += " (skipped: finished by an earlier sweep, not run again)" if counts["skipped"] else ""
    sections = [
        Section("Grid", [Table(["axis", "values"], rows)]),
        Section("Points", [note, Table(header, status)]),
        Section("Point reports", [Links(reports)] if reports else []),
    ]
    runs = []
    for p in points:
        if p["status"] in ("ok", "skipped"):
            run = load_run(out_dir / p["dir"])
            # one hit-rate-vs-capacity line per grid cell other than policy and capacity
            run["_group"] = " ".join(x for x in (Path(p["trace"]).stem, p["backend"], p.get("engine_args")) if x)
            runs.append(run)
    if runs:
        sections += page_sections(analyse(runs, progress=progress))
    write_page(out_dir, "index", "kvbench sweep", sections)
