"""Agent task graphs (with --closed-loop: a call arrives when the calls it depends on finish, plus its think
time). Reported per task (session): completion time and the peak KV its calls hold at once. With
`--task-retention`, a finished call's blocks stay held (not evictable) until the next call of its task is
scheduled, so a live task's context survives the think time (task-aware retention; it acts through policies
that hold blocks, such as vllm, the default). Retained KV takes pool space: a request that does not fit waits
for running ones to finish, and only when nothing runs does the longest-retained call give its KV back.

`--task-order` makes the task, not the call, the unit of admission (docs/task-scheduling.md): each instance's
waiting queue is ordered by a measure of the call's task, ties broken by the call's arrival, then its row.
With `--task-retention` it is "keep a task's KV until its last call, and finish tasks first"."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import click
import numpy as np
from kvbench.backends.enginesim.scenarios import Scenario, scenario

from kvbench.errors import KvbenchError
from kvbench.options import cli_options, option
from kvbench.registry import Registry

class TaskOrder(NamedTuple):
    """A waiting-queue order of --task-order: what goes first, and the measure of a call's task that ranks it
    (smallest first; None: the calls' own arrival order)."""

    help: str
    measure: Callable[[AgentTasks, int], float] | None


# the waiting-queue orders of --task-order, each registered with the measure it ranks tasks by
TASK_ORDERS: Registry[TaskOrder] = Registry(None, "task order")
TASK_ORDERS.add("fcfs", TaskOrder("calls in arrival order, tasks ignored (vLLM)", None))


def task_order(name: str, help: str):
    def add(measure):
        TASK_ORDERS.add(name, TaskOrder(help, measure))
        return measure

    return add


@task_order("oldest-task", "calls of the task whose first call arrived first (task-level FCFS)")
def _oldest_task(s: AgentTasks, task: int) -> float:
    return s.task_start[task]


@task_order("fewest-remaining-calls", "calls of the task with the fewest calls not finished (it knows the task graph)")
def _fewest_remaining_calls(s: AgentTasks, task: int) -> float:
    return sum(1 for c in s.calls[task] if c.finish < 0)


@task_order("least-remaining-work", "calls of the task with the fewest tokens (prompt plus output) not yet computed "
            "(it knows the task graph)")  # fmt: skip
def _least_remaining_work(s: AgentTasks, task: int) -> float:
    # a running call's context is KV it already has
    return sum(max(0, c.n_in + c.n_out - c.context) for c in s.calls[task] if c.finish < 0)


@task_order("least-attained-service", "calls of the task whose finished calls ran the fewest seconds (as "
            "Autellix's PLAS; needs no knowledge of what is to come)")  # fmt: skip
def _least_attained_service(s: AgentTasks, task: int) -> float:
    return sum(c.finish - c.start for c in s.calls[task] if c.finish >= 0)


@dataclass(frozen=True)
class AgentTasksOptions:
    """The engine-sim options of the AgentTasks scenario."""

    task_retention: bool = option(
        False,
        "keep a finished call's KV held until the next call of its task starts (needs --closed-loop)",
        unit="on/off",
        is_flag=True,
    )
    task_order: str = option(
        "fcfs",
        "order of each instance's waiting queue: "
        + "; ".join(f"{k}: {v.help}" for k, v in TASK_ORDERS.items())
        + "; ties go to the call that arrived first (needs --closed-loop)",
        unit="name",
        type=click.Choice(list(TASK_ORDERS)),
    )


@scenario
class AgentTasks(Scenario):
    name = "agent-tasks"
    options = cli_options(AgentTasksOptions)

    def __init__(self, retention: bool, order: str = "fcfs"):
        self.retention, self.order = retention, order

    @classmethod
    def create(cls, settings):
        if settings.get("task_retention") and not settings.get("closed_loop"):
            raise KvbenchError("--task-retention keeps KV between a task's calls: it needs --closed-loop")
        order = settings.get("task_order") or "fcfs"
        if order not in TASK_ORDERS:
            raise KvbenchError(f"--task-order {order!r}: not one of {', '.join(TASK_ORDERS)}")
        if order != "fcfs" and not settings.get("closed_loop"):
            raise KvbenchError(f"--task-order {order} orders calls by their task's graph: it needs --closed-loop")
        return cls(bool(settings.get("task_retention")), order) if settings.get("closed_loop") else None

    def attach(self, instances, reqs, trace, prep, block_size):
        from kvbench.run.pacing import predecessors

        self.preds = predecessors(trace)
        self.waiting_succ = np.zeros(len(reqs), dtype=np.int64)
        for ps in self.preds:
            for p in ps:
                self.waiting_succ[p] += 1
        self.held: dict[int, object] = {}  # finished row -> instance holding its blocks
        self.task = trace.column("session_id").cast("string").to_pylist()
        self.bs = block_size
        self.released_at: dict[int, float] = {}
        self.released_for_room = 0  # retained calls whose KV was given back because a request did not fit
        names, task_of = np.unique(np.asarray(self.task, dtype=object).astype(str), return_inverse=True)
        self.task_of = task_of.tolist()
        self.calls: list[list] = [[] for _ in names]
        for r in reqs:
            self.calls[self.task_of[r.row]].append(r)
        start = np.full(len(names), np.inf)
        np.minimum.at(start, task_of, trace.column("arrival_s").to_numpy().astype(np.float64))
        self.task_start = start.tolist()  # the trace time of each task's first call

    def waiting_order(self, inst):
        rank = TASK_ORDERS[self.order].measure
        if rank is None:
            return None
        memo: dict[int, float] = {}  # a task's measure, once per ordering (several of its calls may wait)
        task_of = self.task_of

        def measure(task: int) -> float:
            return rank(self, task)

        def key(r):
            t = task_of[r.row]
            m = memo.get(t)
            if m is None:
                m = memo[t] = measure(t)
            return (m, r.arrival, r.row)

        return key

    def retain(self, inst, req):
        if self.retention and self.waiting_succ[req.row] > 0:
            self.held[req.row] = inst
            return True
        return False

    def admitted(self, inst, req):
        for p in self.preds[req.row]:
            self.waiting_succ[p] -= 1
            holder = self.held.get(p)
            if holder is not None and self.waiting_succ[p] == 0:
                del self.held[p]
                holder.cache.end(p)
                self.released_at[p] = inst.now

    def make_room(self, inst) -> bool:
        """Nothing runs and a request does not fit: the call retained longest gives its KV back."""
        for p, holder in self.held.items():
            if holder is inst:
                del self.held[p]
                holder.cache.end(p)
                self.released_at[p] = inst.now
                self.released_for_room += 1
                return True
        return False

    def summary(self, reqs, instances, prep, kv_bytes_block):
        tasks: dict[str, list] = {}
        for r in reqs:
            tasks.setdefault(self.task[r.row], []).append(r)
        completion, peaks = [], []
        for calls in tasks.values():
            done = [c for c in calls if c.finish >= 0]
            if len(done) == len(calls):
                completion.append(max(c.finish for c in calls) - min(c.arrival for c in calls))
            # peak KV held at once: each call holds its context from its start to its end (or release)
            events = []
            for c in done:
                end = self.released_at.get(c.row, c.finish)
                size = -(-(c.n_in + c.n_out) // self.bs) * kv_bytes_block
                events += [(c.start, size), (end, -size)]
            level = peak = 0.0
            for _, d in sorted(events, key=lambda e: (e[0], e[1])):
                level += d
                peak = max(peak, level)
            peaks.append(peak)

        def dist(x):
            if not x:
                return None
            return (
                {"mean": float(np.mean(x))}
                | {f"p{q}": float(np.percentile(x, q)) for q in (50, 90, 99)}
                | {"max": float(np.max(x))}
            )

        # each call's TTFT from its arrival (closed loop: when its predecessors finished, plus think time), the
        # request-level price of ordering by task
        ttft = [r.first_token - r.arrival for r in reqs if r.first_token >= 0]
        return {
            "tasks": len(tasks),
            "task_order": self.order,
            "task_retention": self.retention,
            "call_ttft_s": dist(ttft),
            "retained_released_for_room": self.released_for_room,
            "completion_s": dist(completion),
            "peak_kv_bytes_per_task": dist(peaks),
        }
