"""Reasoning traffic on its own instances: its 30K-100K-token decodes hold KV for minutes and would otherwise
crowd the pool that short chat turns need (a separate decode pool)."""

from __future__ import annotations

from dataclasses import dataclass

import click
from kvbench.backends.enginesim.scenarios import Scenario, scenario

from kvbench.options import cli_options, option


@dataclass(frozen=True)
class ReasoningPoolOptions:
    """The engine-sim options of the ReasoningPool scenario."""

    reasoning_instances: int = option(
        0,
        "instances (out of --instances) that serve only reasoning requests (workload 'reasoning' or "
        "reasoning_tokens > 0); the others serve the rest",
        unit="instances",
        type=click.IntRange(min=0),
    )


@scenario
class ReasoningPool(Scenario):
    name = "reasoning-pool"
    options = cli_options(ReasoningPoolOptions)

    def __init__(self, n: int):
        self.n = n

    @classmethod
    def create(cls, settings):
        n = settings.get("reasoning_instances") or 0
        if not n:
            return None
        if n >= settings["instances"]:
            from kvbench.errors import KvbenchError

            raise KvbenchError(
                f"--reasoning-instances {n} leaves no instance for other traffic (--instances {settings['instances']})"
            )
        return cls(n)

    def attach(self, instances, reqs, trace, prep, block_size):
        workload = (
            trace.column("workload").cast("string").to_pylist()
            if "workload" in trace.column_names
            else [None] * len(reqs)
        )
        reasoning = (
            trace.column("reasoning_tokens").fill_null(0).to_pylist()
            if "reasoning_tokens" in trace.column_names
            else [0] * len(reqs)
        )
        self.is_reasoning = [w == "reasoning" or (t or 0) > 0 for w, t in zip(workload, reasoning)]
        self.pools = (instances[: -self.n], instances[-self.n :])

    def candidates(self, instances, req, t):
        return self.pools[1] if self.is_reasoning[req.row] else self.pools[0]

    def summary(self, reqs, instances, prep, kv_bytes_block):
        reasoning = sum(self.is_reasoning)
        return {"reasoning_instances": self.n, "reasoning_requests": reasoning, "other_requests": len(reqs) - reasoning}
