"""The discrete-event loop: requests arrive (open loop at trace times, or closed loop per session and task
graph), a router picks an instance, and each busy instance runs one iteration after another."""

from __future__ import annotations

import gc
import hashlib
import heapq
import itertools
from bisect import bisect
from collections import deque
from collections.abc import Callable

import numpy as np
from kvbench.backends.enginesim.engine import Instance, Req

from kvbench.cache.policies.vllm import VllmPool
from kvbench.registry import Registry

ROUTERS: Registry[Callable] = Registry(None, "router")  # the routers below register with @router
TIMELINE_POINTS = 1000  # samples of KV occupancy kept for the report
AFFINITY_BLOCKS = 4  # prefix-affinity hashes a request's first blocks (a shared system prompt goes one place)
VIRTUAL_NODES = 64  # per instance on the consistent-hash ring: an even split that moves little when N changes
VLLM_CONTAINS = VllmPool.contains


router = ROUTERS.register


@router("round-robin")
def _round_robin(instances, req, state):
    state["next"] = (state.get("next", -1) + 1) % len(instances)
    return instances[state["next"]]


@router("least-loaded")
def _least_loaded(instances, req, state):
    return min(instances, key=lambda i: (i.load, i.routed, i.index))  # idle ties: spread, don't pile on one


@router("prefix-affinity")
def _prefix_affinity(instances, req, state):
    if "ring" not in state:
        points = sorted(
            (int.from_bytes(hashlib.blake2b(f"{i}/{v}".encode(), digest_size=8).digest(), "little"), i)
            for i in range(len(instances))
            for v in range(VIRTUAL_NODES)
        )
        state["ring"] = ([p for p, _ in points], [i for _, i in points])
    hashes, owners = state["ring"]
    head = ",".join(map(str, req.keys[:AFFINITY_BLOCKS])).encode()
    h = int.from_bytes(hashlib.blake2b(head, digest_size=8).digest(), "little")
    return instances[owners[bisect(hashes, h) % len(owners)]]


@router("cache-aware")
def _cache_aware(instances, req, state):
    """Longest cached prefix, load-balanced: cached tokens save prefill, queued tokens add waiting; both are
    tokens, so the score is their difference (ties go to the less loaded instance)."""
    keys, top = req.keys, req.max_hit
    best = best_score = None
    for inst in instances:
        # binary search for the cached prefix (a prefix cache keeps prefixes: block i cached implies the
        # blocks before it, up to rare exceptions); a router's estimate, as real cache-aware routers keep
        cache = inst.cache
        contains = cache.contains
        if getattr(contains, "__func__", None) is VLLM_CONTAINS:  # the pool's own (not a scenario's) test:
            contains = cache.copies.__contains__  # what it does, without its call
        lo, hi = 0, top
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if contains(keys[mid - 1]):
                lo = mid
            else:
                hi = mid - 1
        score = (lo * inst.bs - inst.load, -inst.routed, -inst.index)
        if best is None or score > best_score:  # (max's choice: the first of equal scores)
            best, best_score = inst, score
    return best


BUILTIN_ROUTERS = dict(ROUTERS)  # the routers above, as registered here (a plugin may register or replace others)


def simulate(
    instances: list[Instance],
    reqs: list[Req],
    route: str,
    successors=None,
    think=None,
    scenarios=(),
    max_in_flight=None,
) -> dict:
    """Run every request to completion. `successors[r]`: rows that wait for r (closed loop); a row with
    predecessors arrives when the last of them finishes plus its think time. `max_in_flight`: the client's
    concurrency limit (as `--max-concurrency` of a live replay): a request due while that many are in flight is
    sent when one finishes, and its latencies count from then. Returns the KV timeline."""
    return Cluster(instances, reqs, route, successors, think, scenarios, max_in_flight).run()


class Cluster:
    """The event loop of `simulate`. Two heaps of timed events: `arrivals` (requests reaching the scheduler,
    and scenarios' timed events) and `steps` (an instance's iteration ending), kept apart so that an instance
    knows the next arrival; ties go to arrivals, then to the order events were made in (`seq`)."""

    def __init__(self, instances, reqs, route, successors, think, scenarios, max_in_flight):
        self.instances, self.reqs, self.scenarios = instances, reqs, scenarios
        self.successors, self.think, self.max_in_flight = successors, think, max_in_flight
        self.pick = ROUTERS[route]
        self.router_state: dict = {}
        self.seq = itertools.count()
        self.arrivals: list = []  # (time, seq, req or a scenario's fn(t))
        self.steps: list = []  # (time, seq, (instance, pieces, decoding, n))
        self.cancelled: set[int] = set()  # seq of the steps that `cut` replaced
        self.in_flight = 0
        self.held: deque[Req] = deque()  # due, but the client's concurrency limit holds them back
        # a calibrated model's per-request overhead (HTTP, tokenising, the hand-off to the engine core): a
        # request reaches the scheduler that long after it is sent, and its TTFT, measured from the send,
        # includes the wait
        latency = instances[0].latency if instances else None
        # ... less the join window, its last part: an idle instance waits that long after its first arrival
        # before it starts a step, so requests sent just after join the first one's step, as in an engine that
        # takes every queued request before it builds a batch (Calibration.join_window_s)
        self.join_window = latency.join_window_s if latency else 0.0
        self.entry_delay = latency.request_overhead_s - self.join_window if latency else 0.0
        self.waiting_for = self._count_predecessors()
        self._schedule_first_arrivals()
        span = max((r.arrival for r in reqs), default=0.0) - min((r.arrival for r in reqs), default=0.0)
        self.sample_every = max(span, 1e-3) / TIMELINE_POINTS
        self.next_sample = 0.0
        self.timeline = {"t_s": [], "kv_usage": [], "running": [], "waiting": []}

    def _count_predecessors(self) -> np.ndarray | None:
        """How many requests each row still waits for (closed loop), or None (open loop)."""
        if self.successors is None:
            return None
        waiting_for = np.zeros(len(self.reqs), dtype=np.int64)
        for succ in self.successors:
            for s in succ:
                waiting_for[s] += 1
        return waiting_for

    def _schedule_first_arrivals(self) -> None:
        """The requests that wait for nothing arrive at their trace time; the scenarios' timers are set."""
        first = self.reqs if self.waiting_for is None else [r for r in self.reqs if self.waiting_for[r.row] == 0]
        self.arrivals = [(r.arrival + self.entry_delay, next(self.seq), r) for r in first]
        heapq.heapify(self.arrivals)
        for sc in self.scenarios:
            for when, fn in sc.timers(self.schedule):
                self.schedule(when, fn)

    def schedule(self, when: float, fn) -> None:
        """A scenario's timed event: fn(t) runs at simulated time `when`."""
        heapq.heappush(self.arrivals, (when, next(self.seq), fn))

    def run(self) -> dict:
        # What exists now (the requests, their keys, the pools) lives until the loop ends: frozen, the cyclic
        # collector's full passes skip it instead of walking it again and again (a fifth of a long replay)
        gc.freeze()
        arrivals, steps, pop, arrive, end_step = self.arrivals, self.steps, heapq.heappop, self._arrive, self._end_step
        try:
            while arrivals or steps:  # (the heaps are these lists for the whole run: pushes go to them)
                if arrivals and (not steps or arrivals[0][0] <= steps[0][0]):
                    arrive(*pop(arrivals))
                else:
                    end_step(*pop(steps))
        finally:
            gc.unfreeze()
        return self.timeline

    def _arrive(self, t: float, _, req) -> None:
        """A request reaches the scheduler (unless the client's limit holds it back): routed, queued, and the
        instance started or its multi-iteration window cut."""
        if callable(req):  # a scenario's timed event (an instance coming up, a user's KV deleted)
            req(t)
            return
        if self.max_in_flight and req.scheduled < 0 and not req.handoff and not self._admit(req):
            return
        candidates = self.instances
        for sc in self.scenarios:
            candidates = sc.candidates(candidates, req, t)
        inst = self.pick(candidates, req, self.router_state)
        req.instance = inst.index
        inst.routed += 1
        inst.enqueue(req)
        if not inst.busy:
            if self.join_window > 0:
                inst.busy, inst.window = True, None  # (None: the step is not planned yet, nothing to cut)
                self.schedule(t + self.join_window, lambda when, inst=inst: self.start(inst, when))
            else:
                self.start(inst, t)
        elif inst.window is not None and inst.window[3] > 1:
            self.cut(inst, t)

    def _admit(self, req: Req) -> bool:
        """The client's concurrency limit: a request due while it is reached is held until one finishes."""
        if self.in_flight >= self.max_in_flight:
            req.scheduled = -2.0  # (marks it held until send() gives it its send time)
            self.held.append(req)
            return False
        req.scheduled = req.arrival
        self.in_flight += 1
        return True

    def send(self, req: Req, t: float) -> None:
        """The client sends a held request now: it reaches the scheduler after the per-request overhead."""
        req.scheduled, req.arrival = req.arrival, t
        heapq.heappush(self.arrivals, (t + self.entry_delay, next(self.seq), req))

    def start(self, inst: Instance, t: float) -> None:
        """Plan `inst`'s next iteration (or several decode iterations as one window), or leave it idle."""
        dt, pieces, decoding, n = inst.plan(t)
        if not pieces and not decoding:
            inst.busy = False
            return
        inst.busy = True
        token = next(self.seq)
        inst.window = (token, t, dt / n, n, pieces, decoding)
        heapq.heappush(self.steps, (t + dt, token, (inst, pieces, decoding, n)))

    def cut(self, inst: Instance, t: float) -> None:
        """A request arrived while `inst` runs several decode iterations as one: end the window after the
        iteration in progress, so the newcomer is scheduled at the next iteration boundary as in an engine."""
        token, begun, per, n, pieces, decoding = inst.window
        done = min(n, int((t - begun) / per) + 1) if per > 0 else n
        if done < n:
            self.cancelled.add(token)
            token = next(self.seq)
            inst.window = (token, begun, per, done, pieces, decoding)
            heapq.heappush(self.steps, (begun + done * per, token, (inst, pieces, decoding, done)))

    def _end_step(self, t: float, token: int, step) -> None:
        """An instance's iteration (or window) ends: finished requests free the client's slots and release
        what waited for them, prefills hand off, and the instance starts its next iteration."""
        if token in self.cancelled:
            self.cancelled.discard(token)
            return
        inst, pieces, decoding, n = step
        finished = inst.finish_step(t, pieces, decoding, n)
        if self.max_in_flight:
            self.in_flight -= len(finished) + len(inst.rejected) - inst.rejected_seen
            inst.rejected_seen = len(inst.rejected)
            while self.held and self.in_flight < self.max_in_flight:
                self.in_flight += 1
                self.send(self.held.popleft(), t)
        for req in inst.handed:  # disaggregated prefill done: the KV crosses the link, then decode elsewhere
            delay = sum(sc.handoff_s(req) for sc in self.scenarios)
            heapq.heappush(self.arrivals, (t + delay, next(self.seq), req))
        inst.handed.clear()
        if self.successors is not None:
            for done in finished:
                self._release_successors(done, t)
        if t >= self.next_sample:
            self._sample(t)
        self.start(inst, t)

    def _release_successors(self, done: Req, t: float) -> None:
        """Closed loop: a row whose last predecessor finished arrives after its think time."""
        for s in self.successors[done.row]:
            self.waiting_for[s] -= 1
            if self.waiting_for[s] == 0:
                succ = self.reqs[s]
                succ.arrival = max(succ.arrival, t + float(self.think[s]))
                heapq.heappush(self.arrivals, (succ.arrival + self.entry_delay, next(self.seq), succ))

    def _sample(self, t: float) -> None:
        """One point of the KV timeline (about TIMELINE_POINTS over the trace's span)."""
        self.timeline["t_s"].append(round(t, 6))
        self.timeline["kv_usage"].append(float(np.mean([i.occupancy() for i in self.instances])))
        self.timeline["running"].append(sum(len(i.running) for i in self.instances))
        self.timeline["waiting"].append(sum(len(i.waiting) for i in self.instances))
        self.next_sample = t + self.sample_every
