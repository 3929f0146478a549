"""engine-sim speed: a one-hour chat trace of 100k requests on 8 instances (the issue's bar: under 60 s), and
a small trace per router and event loop (Python reference, compiled) for the history."""

from __future__ import annotations

import os

from kvbench.backends.enginesim import EngineSimBackend, compiled_run

from kvbench.trace import generators

HOUR_REQUESTS = 100_000
SESSION_RATE = 9.3  # new conversations per second: 100k requests span about 65 minutes (trace info)


class HourOfChat:
    timeout = 600  # seconds asv lets one sample run
    number = 1
    repeat = 1
    rounds = 1

    def setup_cache(self):
        table, meta = generators.get("chat").run(HOUR_REQUESTS, seed=1, session_rate=SESSION_RATE)
        return table, meta

    def time_100k_requests_8_instances(self, cached):
        table, meta = cached
        list(EngineSimBackend(instances=8, router="cache-aware").replay(table, meta))


class Routers:
    params = (["round-robin", "least-loaded", "prefix-affinity", "cache-aware"], ["python", "compiled"])
    param_names = ["router", "loop"]

    def setup(self, router, loop):
        os.environ[compiled_run.SWITCH] = loop
        self.table, self.meta = generators.get("chat").run(5000, seed=2, session_rate=9.3)

    def teardown(self, router, loop):
        os.environ.pop(compiled_run.SWITCH, None)

    def time_5k_requests_4_instances(self, router, loop):
        list(EngineSimBackend(instances=4, router=router).replay(self.table, self.meta))

    def track_hit_rate(self, router, loop):
        """Token hit rate (all requests) of 4 instances behind this router on a 5k-request chat trace."""
        (point,) = EngineSimBackend(instances=4, router=router).replay(self.table, self.meta)
        hit = point.columns["hit_tokens"].sum()
        return float(hit / self.table.column("input_tokens").to_numpy().sum())

    track_hit_rate.unit = "ratio"
