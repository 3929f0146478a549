"""What-if scenarios of the engine simulator, one module each, registered here when imported (no list kept by
hand). A scenario contributes its own `kvbench replay --backend engine-sim` options and is active when they
ask for it; it acts through a few hooks of the simulation and adds its facts to the point's summary under
`engine.scenarios.<name>`."""

from __future__ import annotations

from typing import ClassVar

import click
import pyarrow as pa

from kvbench.registry import Registry


class Scenario:
    name: ClassVar[str]
    options: ClassVar[list[click.Option]] = []
    units: ClassVar[dict[str, str]] = {}  # option name -> its unit, added to the option's --help

    @classmethod
    def create(cls, settings: dict) -> Scenario | None:
        """The scenario for these backend settings, or None when its options leave it off."""
        raise NotImplementedError

    def prepare_trace(self, trace: pa.Table) -> pa.Table:
        """The trace as the cache keys should see it (before salts and adapters are folded in)."""
        return trace

    def share_lora(self, default: bool) -> bool:
        return default

    def attach(self, instances: list, reqs: list, trace: pa.Table, prep, block_size: int) -> None:
        """Called once the instances and requests exist."""

    def extra_hits(self, inst, req, prefix: int) -> int:
        """Blocks after the cached prefix (`prefix` blocks, all tiers) that need no prefill all the same."""
        return 0

    def candidates(self, instances: list, req, t: float) -> list:
        """The instances this request may be routed to (the router picks among them)."""
        return instances

    def retain(self, inst, req) -> bool:
        """True to keep a finished request's blocks held (the scenario ends them later)."""
        return False

    def make_room(self, inst) -> bool:
        """A request does not fit `inst`'s pool: give back KV the scenario holds there (True if it did)."""
        return False

    def waiting_order(self, inst):
        """A sort key for `inst`'s waiting queue (smaller is admitted first), or None to admit in the queue's
        order (first come, first served: arrival, a preempted request back at the head). Asked before each
        admission pass while more than one request waits; the engine sorts stably, so requests whose keys tie
        keep their queue order, and it keeps requests that already ran (preempted) ahead of the rest, as vLLM
        does. Only one active scenario may return a key (the first one that does is used)."""
        return None

    def admitted(self, inst, req) -> None:
        """A request was looked up and took its blocks on `inst`."""

    def handoff_s(self, req) -> float:
        """Seconds a prefilled request's KV takes to reach a decode instance (disaggregated serving)."""
        return 0.0

    def step_extra_s(self, inst, prefills: list[tuple[int, int]], decode_contexts: list) -> float:
        """Seconds added to one iteration of `inst` whose work is given as `LatencyModel.step_s` takes it
        (prefill pieces as (new tokens, cached context), one context per decoding sequence). Negative when
        the scenario overlaps work the roofline runs one after another; the iteration is then
        `step_s(...) + this`, which a scenario must keep ≥ 0. A decode-only window of k identical
        iterations asks once, with the window's mean contexts, and is charged k times."""
        return 0.0

    def timers(self, schedule) -> list[tuple[float, object]]:
        """(time, callable(t)) events to run during the simulation. `schedule(when, fn)`, called at the start:
        runs fn(t) at simulated time `when`; a scenario keeps it to add events as the simulation goes (e.g. an
        instance coming up)."""
        return []

    def summary(self, reqs: list, instances: list, prep, kv_bytes_block: float) -> dict:
        return {}


_REGISTRY: Registry[type[Scenario]] = Registry(__name__, "scenario")


def scenario(cls: type[Scenario]) -> type[Scenario]:
    _REGISTRY.add(cls.name, cls)
    return cls


registry = _REGISTRY.all


def active(settings: dict) -> list[Scenario]:
    return [s for cls in registry().values() if (s := cls.create(settings)) is not None]
