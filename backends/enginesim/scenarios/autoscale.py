"""Serverless cold start, phase by phase (docs/semantics.md, "Cold start"): only `--autoscale MIN` of the
`--instances` serve at first; when the active ones are loaded past `--scale-up-load` tokens each, one more is
started. A cold instance first starts its runtime (`--instance-start-s`: node, container, CUDA context), then
loads the model's weights at `--weight-load-gbps` (weight bytes per device / bandwidth: a 70B BF16 model at
2 GB/s is 70 s), then serves with an empty KV cache that warms with the traffic it gets.

Three ways to shorten it, each a what-if of its own:
- `--prewarmed N` keeps N more instances loaded and idle from the start: a scale-up takes one at once and
  starts a cold one to refill the pool. Their idle time is billed like any other instance's;
- `--lazy-weights` loads weights layer by layer and lets the instance take requests once its runtime is up
  (ServerlessLLM's direction): an iteration that starts before the last layer has arrived ends no earlier
  than that arrival plus its last layer's share of the iteration;
- `--global-pool` (an engine-sim option) lets a new instance read the KV the others computed at once.
`--cold-start-s` instead gives the whole cold start as one constant (runtime and weights not modeled apart).

Reported: for each instance when it was asked for, when it took requests, when its weights were in, and when
it served its first token; the hit rate and TTFT of what it served in its first `--warm-window-s` seconds;
TTFT across the cluster in the window after each scale-up; and the cost in instance-hours (idle pre-warmed
time apart), in dollars with `--instance-hour-usd`."""

from __future__ import annotations

from dataclasses import dataclass

import click
import numpy as np
from kvbench.backends.enginesim.scenarios import Scenario, scenario

from kvbench.errors import KvbenchError
from kvbench.options import cli_options, option

ACTIVE, WARM, COLD = "active", "warm", "cold"  # how an instance starts the run


@dataclass(frozen=True)
class AutoscaleOptions:
    """The engine-sim options of the Autoscale scenario."""

    autoscale: int | None = option(
        None,
        "instances active at the start; more start under load, up to --instances",
        unit="instances",
        type=click.IntRange(min=1),
    )
    instance_start_s: float = option(
        10.0,
        "seconds from the decision to scale up until the new instance's runtime is up and loads weights",
        unit="s",
        type=click.FloatRange(min=0),
    )
    weight_load_gbps: float = option(
        2.0,
        "storage → HBM bandwidth for the model's weights (network storage 1-3, local NVMe 5-7, host DRAM 20+)",
        unit="GB/s, 1e9 bytes/s",
        type=click.FloatRange(min=0, min_open=True),
    )
    cold_start_s: float | None = option(
        None,
        "the whole cold start as one constant, instead of --instance-start-s plus the weights' load time",
        unit="s",
        type=click.FloatRange(min=0),
    )
    lazy_weights: bool = option(
        False,
        "load weights layer by layer: a new instance takes requests once its runtime is up, and computes "
        "each layer as it arrives",
        unit="on/off",
        is_flag=True,
    )
    prewarmed: int = option(
        0,
        "instances kept loaded and idle beside the active ones (billed while idle); a scale-up takes one "
        "at once and starts a cold one in its place",
        unit="instances",
        type=click.IntRange(min=0),
    )
    instance_hour_usd: float | None = option(
        None,
        "price of one instance-hour, for the cost in dollars [default: instance-hours only]",
        unit="USD per instance-hour",
        type=click.FloatRange(min=0),
    )
    scale_up_load: int = option(
        20000,
        "tokens queued or in flight per active instance that start one more",
        unit="tokens per instance",
        type=click.IntRange(min=1),
    )
    warm_window_s: float = option(
        60.0,
        "seconds after an instance comes up (and after each scale-up) that the report looks at",
        unit="s",
        type=click.FloatRange(min=0, min_open=True),
    )


@scenario
class Autoscale(Scenario):
    name = "autoscale"
    options = cli_options(AutoscaleOptions)

    def __init__(self, settings: dict):
        self.start, self.prewarmed = settings["autoscale"], settings["prewarmed"]
        self.instance_start_s, self.fixed_cold_s = settings["instance_start_s"], settings["cold_start_s"]
        self.load_bw = settings["weight_load_gbps"] * 1e9
        self.lazy, self.usd = settings["lazy_weights"], settings["instance_hour_usd"]
        self.threshold, self.window = settings["scale_up_load"], settings["warm_window_s"]

    @classmethod
    def create(cls, settings):
        start = settings.get("autoscale")
        if start is None:
            if settings.get("prewarmed") or settings.get("lazy_weights"):
                raise KvbenchError("--prewarmed and --lazy-weights model scale-ups: add --autoscale MIN")
            return None
        if start + settings["prewarmed"] > settings["instances"]:
            raise KvbenchError(
                f"--autoscale {start} plus --prewarmed {settings['prewarmed']} is more than --instances "
                f"{settings['instances']}: raise --instances (the most instances that may run)"
            )
        if settings["cold_start_s"] is not None and settings["lazy_weights"]:
            raise KvbenchError("--lazy-weights needs the weights' load modeled: drop --cold-start-s")
        return cls(settings)

    def attach(self, instances, reqs, trace, prep, block_size):
        lat = instances[0].latency
        self.weight_bytes = lat.weight_bytes / lat.tp  # per device: the TP ranks load their shards at once
        self.layers = lat.model.layers
        if self.fixed_cold_s is None:
            self.load_s = self.weight_bytes / self.load_bw
            self.cold_s = self.instance_start_s + self.load_s
        else:
            self.load_s, self.cold_s = 0.0, self.fixed_cold_s
        n = len(instances)
        self.kind = [ACTIVE if i < self.start else WARM if i < self.start + self.prewarmed else COLD for i in range(n)]
        self.asked_at = [0.0 if k != COLD else None for k in self.kind]  # billed from here
        self.warm_at = [0.0 if k != COLD else None for k in self.kind]  # weights in HBM
        self.up_at = [0.0 if k == ACTIVE else None for k in self.kind]  # takes requests
        self.decided_at = [None] * n  # the scale-up decision that made it serve
        self.starting = False
        self.reqs = reqs

    def timers(self, schedule):
        self.schedule = schedule
        return []

    def candidates(self, instances, req, t):
        active = self._serving(instances, t)
        more = any(u is None for u in self.up_at)  # an instance not serving nor asked to
        if more and not self.starting and np.mean([i.load for i in active]) > self.threshold:
            self._scale_up(t)
            active = self._serving(instances, t)  # a pre-warmed instance takes this very request
        return active or instances[:1]

    def _serving(self, instances, t):
        return [i for i in instances if self.up_at[i.index] is not None and self.up_at[i.index] <= t]

    def _scale_up(self, t: float) -> None:
        idle = [i for i, (w, u) in enumerate(zip(self.warm_at, self.up_at)) if u is None and w is not None]
        ready = [i for i in idle if self.warm_at[i] <= t]
        if ready:  # a pre-warmed instance serves at once; a cold one starts to take its place in the pool
            i = ready[0]
            self.up_at[i] = t
            self._boot(t, activate=False)
        elif idle:  # the pool's replacement is still loading: it serves when loaded (or its runtime is up, lazily)
            i = idle[0]
            self.up_at[i] = max(t, self.asked_at[i] + self.instance_start_s) if self.lazy else self.warm_at[i]
            self._wait_for(self.up_at[i])
        else:
            i = self._boot(t, activate=True)
            self._wait_for(self.up_at[i])
        self.decided_at[i] = t

    def _boot(self, t: float, activate: bool) -> int | None:
        """Start a cold instance's runtime and weight load at t: active when up, or pre-warmed when loaded.
        (Activating needs one: `candidates` scales up only while some instance is not serving, and none is
        idle here.)"""
        cold = [i for i, a in enumerate(self.asked_at) if a is None]
        if not cold:
            return None
        i = cold[0]
        self.asked_at[i], self.warm_at[i] = t, t + self.cold_s
        if activate:
            self.up_at[i] = t + self.instance_start_s if self.lazy else t + self.cold_s
        return i

    def _wait_for(self, when: float) -> None:
        self.starting = True  # one scale-up at a time: the next decision waits until this instance serves
        self.schedule(when, self._ready)

    def _ready(self, t):
        self.starting = False

    def step_extra_s(self, inst, prefills, decode_contexts):
        """Lazy weights: an iteration that starts before the last layer has arrived waits for it; only the
        last layer's share of the iteration comes after (the other layers ran as theirs arrived)."""
        loaded = self.warm_at[inst.index]
        if not self.lazy or loaded is None or inst.now >= loaded:
            return 0.0
        step = inst.latency.step_s(prefills, decode_contexts)
        return max(0.0, loaded + step / self.layers - (inst.now + step))

    def summary(self, reqs, instances, prep, kv_bytes_block):
        ended = max((r.finish for r in reqs if r.finish >= 0), default=0.0)
        served = [r for r in reqs if r.first_token >= 0]
        rows, billed, idle = [], 0.0, 0.0
        for inst in instances:
            i = inst.index
            asked, up, warm, decided = self.asked_at[i], self.up_at[i], self.warm_at[i], self.decided_at[i]
            mine = sorted((r for r in served if r.instance == i), key=lambda r: r.first_token)
            first = mine[0].first_token if mine else None
            window = [r for r in mine if up is not None and up <= r.arrival <= up + self.window]
            n_in = sum(r.n_in for r in window)
            hit = sum(min(sum((r.hit or {}).values()) * inst.bs, r.n_in) for r in window)
            ttft = [r.first_token - r.arrival for r in window]
            if asked is not None:
                billed += max(0.0, ended - asked)
                if warm is not None and self.kind[i] != ACTIVE:  # loaded, waiting to be taken (or never taken)
                    idle += max(0.0, min(up if up is not None else ended, ended) - warm)
            rows.append(
                {
                    "instance": i,
                    "started_as": self.kind[i],
                    "booted_at_s": asked,
                    "scaled_up_at_s": decided,
                    "up_at_s": up,
                    "weights_in_at_s": warm,
                    "first_token_at_s": first,
                    "time_to_first_served_s": first - decided if first is not None and decided is not None else None,
                    "requests_in_window": len(window),
                    "hit_rate_in_window": hit / n_in if n_in else None,
                    "ttft_mean_s_in_window": float(np.mean(ttft)) if ttft else None,
                    "ttft_p99_s_in_window": float(np.percentile(ttft, 99)) if ttft else None,
                }
            )
        scale_ups = sorted(d for d in self.decided_at if d is not None)
        after = [r.first_token - r.arrival for r in served if any(s <= r.arrival <= s + self.window for s in scale_ups)]
        firsts = [r["time_to_first_served_s"] for r in rows if r["time_to_first_served_s"] is not None]
        return {
            "start": self.start,
            "prewarmed": self.prewarmed,
            "lazy_weights": self.lazy,
            "instance_start_s": self.instance_start_s if self.fixed_cold_s is None else None,
            "weight_bytes": self.weight_bytes,
            "weight_load_s": self.load_s if self.fixed_cold_s is None else None,
            "cold_start_s": self.cold_s,
            "scale_ups": len(scale_ups),
            "time_to_first_served_s": min(firsts) if firsts else None,
            "ttft_p50_s_after_scale_up": float(np.percentile(after, 50)) if after else None,
            "ttft_p99_s_after_scale_up": float(np.percentile(after, 99)) if after else None,
            "instance_hours": billed / 3600,
            "idle_prewarmed_instance_hours": idle / 3600,
            "cost_usd": billed / 3600 * self.usd if self.usd is not None else None,
            "instances": rows,
        }
