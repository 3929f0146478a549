"""Task-level scheduling (docs/task-scheduling.md): the agent-tasks facts of engine-sim points (summary.json's
`engine.scenarios.agent-tasks`) as one row per point, so waiting-queue orders (`--task-order`) are read side by
side on what a task graph costs: its completion time, the KV it holds at its peak, and what its calls wait for a
first token. Used by a run's report (its points) and by `kvbench compare` (every run's points)."""

from __future__ import annotations

from kvbench.report.page import Section, Table, pct
from kvbench.report.sections import section_at
from kvbench.report.style import duration, size

TITLE = "Task scheduling (agent task graphs)"
SCENARIO = "agent-tasks"
BASELINE = "fcfs"  # the order the others are measured against: vLLM's, the default


def _facts(point: dict) -> dict | None:
    return ((point.get("engine") or {}).get("scenarios") or {}).get(SCENARIO)


def _hit(point: dict) -> float | None:
    return ((point.get("hit_rate") or {}).get("token") or {}).get("all")


def _time(d: dict | None, key: str) -> str:
    return duration(d[key]) if d and d.get(key) is not None else "–"


def _bytes(d: dict | None, key: str) -> str:
    return size(d[key]) if d and d.get(key) is not None else "–"


def _ratio_lines(entries: list[tuple[str, dict]]) -> list[str]:
    """Each non-fcfs point against the fcfs point of the same run (or the only fcfs point there is)."""
    base = [(name, f) for name, f in entries if f.get("task_order", BASELINE) == BASELINE and f.get("completion_s")]
    lines = []
    for name, f in entries:
        if f.get("task_order", BASELINE) == BASELINE or not f.get("completion_s"):
            continue
        run = name.split(":")[0]
        same_run = [b for b in base if b[0].split(":")[0] == run]
        ref = same_run[0] if same_run else (base[0] if len(base) == 1 else None)
        if ref is None:
            continue
        b = ref[1]
        parts = [
            f"mean task completion {f['completion_s']['mean'] / b['completion_s']['mean']:.2f}×",
            f"p99 {f['completion_s']['p99'] / b['completion_s']['p99']:.2f}×" if b["completion_s"]["p99"] else "",
        ]
        if f.get("call_ttft_s") and b.get("call_ttft_s") and b["call_ttft_s"]["p99"]:
            parts.append(f"call TTFT p99 {f['call_ttft_s']['p99'] / b['call_ttft_s']['p99']:.2f}×")
        lines.append(f"{name} ({f['task_order']}) against {ref[0]} (fcfs): " + ", ".join(p for p in parts if p) + ".")
    return lines


def task_table(entries: list[tuple[str, dict, float | None]]) -> Section:
    """One row per (point name, agent-tasks facts, the point's token hit rate): a task's calls run close
    together under a task order, so its prefix is still cached when the next one comes (the hit rate says so)."""
    if not entries:
        return Section(TITLE)
    header = ["point", "task order", "KV kept between calls", "tasks", "completion mean", "p50", "p99",
              "peak KV per task p50", "max", "call TTFT mean", "p50", "p99", "token hit rate"]  # fmt: skip
    rows = []
    for name, f, hit in entries:
        c, k, t = f.get("completion_s"), f.get("peak_kv_bytes_per_task"), f.get("call_ttft_s")
        rows.append(
            [name, f.get("task_order", BASELINE), "yes" if f.get("task_retention") else "no", f"{f.get('tasks', 0):,}",
             _time(c, "mean"), _time(c, "p50"), _time(c, "p99"), _bytes(k, "p50"), _bytes(k, "max"),
             _time(t, "mean"), _time(t, "p50"), _time(t, "p99"), "–" if hit is None else pct(hit)]
        )  # fmt: skip
    items: list = [
        "Each session is one task graph. Completion: its last call's finish less its first call's arrival; peak "
        "KV: the most blocks its calls hold at once (retained KV included); call TTFT: each call's first token "
        "less its arrival (closed loop: when what it depends on finished, plus its think time). Orders: "
        "docs/task-scheduling.md.",
        Table(header, rows),
    ]
    items += _ratio_lines([(name, f) for name, f, _ in entries])
    if len(entries) == 1:
        items.append(
            "One order only: run the same trace with each --task-order and put the runs side by side with "
            "`kvbench compare` (docs/task-scheduling.md)."
        )
    return Section(TITLE, items)


@section_at(140, "summary", per_point=True)
def task_section(summary: dict) -> Section:
    """A run's points that modeled agent tasks (engine-sim with --closed-loop)."""
    points = summary.get("points", [])
    return task_table([(p["name"], f, _hit(p)) for p in points if (f := _facts(p))])


def task_comparison_section(runs: list[dict]) -> Section:
    """The points of several runs (`kvbench compare`'s summaries, labelled), as `run:point`."""
    entries = []
    for run in runs:
        for p in run.get("points", []):
            if f := _facts(p):
                entries.append((f"{run.get('_label', run.get('run_id', 'run'))}:{p['name']}", f, _hit(p)))
    return task_table(entries)
