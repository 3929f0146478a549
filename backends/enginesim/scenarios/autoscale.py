"""Serverless cold start: only `--autoscale MIN` of the `--instances` serve at first; when the active ones are
loaded past `--scale-up-load` tokens each, one more starts, ready `--cold-start-s` later (container start and
weight load) with an empty cache. Compare with a pre-warmed pool (no --autoscale: every instance from the
start) and with a global KV pool (--global-pool), which lets a new instance hit what the others computed.
Reported: when each instance came up, and the hit rate and TTFT of the requests each served in its first
`--warm-window-s` seconds."""

from __future__ import annotations

import click
import numpy as np
from kvbench.backends.enginesim.scenarios import Scenario, scenario

from kvbench.errors import KvbenchError


@scenario
class Autoscale(Scenario):
    name = "autoscale"
    units = {  # of its options, shown in --help
        "autoscale": "instances",
        "cold_start_s": "s",
        "scale_up_load": "tokens per instance",
        "warm_window_s": "s",
    }
    options = [
        click.Option(
            ["--autoscale"],
            type=click.IntRange(min=1),
            help="instances active at the start; more start under load, up to --instances",
            default=None,
        ),
        click.Option(
            ["--cold-start-s"],
            type=click.FloatRange(min=0),
            default=30.0,
            show_default=True,
            help="seconds from the decision to scale up until the new instance serves",
        ),
        click.Option(
            ["--scale-up-load"],
            type=click.IntRange(min=1),
            default=20000,
            show_default=True,
            help="tokens queued or in flight per active instance that start one more",
        ),
        click.Option(
            ["--warm-window-s"],
            type=click.FloatRange(min=0, min_open=True),
            default=60.0,
            show_default=True,
            help="seconds after an instance comes up that count as its cold period in the report",
        ),
    ]

    def __init__(self, start: int, cold_s: float, threshold: int, window: float):
        self.start, self.cold_s, self.threshold, self.window = start, cold_s, threshold, window

    @classmethod
    def create(cls, settings):
        start = settings.get("autoscale")
        if start is None:
            return None
        if start > settings["instances"]:
            raise KvbenchError(f"--autoscale {start} is more than --instances {settings['instances']}")
        return cls(start, settings["cold_start_s"], settings["scale_up_load"], settings["warm_window_s"])

    def attach(self, instances, reqs, trace, prep, block_size):
        self.up_at = [0.0 if i < self.start else None for i in range(len(instances))]
        self.starting = False
        self.reqs = reqs

    def timers(self, schedule):
        self.schedule = schedule
        return []

    def candidates(self, instances, req, t):
        active = [i for i in instances if self.up_at[i.index] is not None and self.up_at[i.index] <= t]
        if not self.starting and len(active) < len(self.up_at):
            if np.mean([i.load for i in active]) > self.threshold:
                nxt = next(k for k, u in enumerate(self.up_at) if u is None)
                self.up_at[nxt] = t + self.cold_s
                self.starting = True
                self.schedule(t + self.cold_s, self._ready)
        return active or instances[:1]

    def _ready(self, t):
        self.starting = False

    def summary(self, reqs, instances, prep, kv_bytes_block):
        rows = []
        for inst in instances:
            up = self.up_at[inst.index]
            mine = [
                r for r in reqs if r.instance == inst.index and up is not None and up <= r.arrival <= up + self.window
            ]
            n_in = sum(r.n_in for r in mine)
            hit = sum(min(sum((r.hit or {}).values()) * inst.bs, r.n_in) for r in mine)
            ttft = [r.first_token - r.arrival for r in mine if r.first_token >= 0]
            rows.append(
                {
                    "instance": inst.index,
                    "up_at_s": up,
                    "requests_in_window": len(mine),
                    "hit_rate_in_window": hit / n_in if n_in else None,
                    "ttft_mean_s_in_window": float(np.mean(ttft)) if ttft else None,
                }
            )
        return {"start": self.start, "cold_start_s": self.cold_s, "instances": rows}
