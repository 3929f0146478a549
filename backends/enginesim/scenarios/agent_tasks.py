"""Agent task graphs (with --closed-loop: a call arrives when the calls it depends on finish, plus its think
time). Reported per task (session): completion time and the peak KV its calls hold at once. With
`--task-retention`, a finished call's blocks stay held (not evictable) until the next call of its task is
scheduled, so a live task's context survives the think time (task-aware retention; it acts through policies
that hold blocks, such as vllm, the default). Retained KV takes pool space: a request that does not fit waits
for running ones to finish, and only when nothing runs does the longest-retained call give its KV back."""

from __future__ import annotations

import click
import numpy as np
from kvbench.backends.enginesim.scenarios import Scenario, scenario

from kvbench.errors import KvbenchError


@scenario
class AgentTasks(Scenario):
    name = "agent-tasks"
    units = {  # of its options, shown in --help
        "task_retention": "on/off",
    }
    options = [
        click.Option(
            ["--task-retention"],
            is_flag=True,
            default=False,
            help="keep a finished call's KV held until the next call of its task starts (needs --closed-loop)",
        )
    ]

    def __init__(self, retention: bool):
        self.retention = retention

    @classmethod
    def create(cls, settings):
        if settings.get("task_retention") and not settings.get("closed_loop"):
            raise KvbenchError("--task-retention keeps KV between a task's calls: it needs --closed-loop")
        return cls(bool(settings.get("task_retention"))) if settings.get("closed_loop") else None

    def attach(self, instances, reqs, trace, prep, block_size):
        from kvbench.live.pacing import predecessors

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
            return (
                {f"p{q}": float(np.percentile(x, q)) for q in (50, 90, 99)} | {"max": float(np.max(x))} if x else None
            )

        return {
            "tasks": len(tasks),
            "task_retention": self.retention,
            "retained_released_for_room": self.released_for_room,
            "completion_s": dist(completion),
            "peak_kv_bytes_per_task": dist(peaks),
        }
