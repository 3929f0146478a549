"""The discrete-event loop: requests arrive (open loop at trace times, or closed loop per session and task
graph), a router picks an instance, and each busy instance runs one iteration after another."""

from __future__ import annotations

import hashlib
import heapq
import itertools
from bisect import bisect
from collections import deque
from collections.abc import Callable

import numpy as np
from kvbench.backends.enginesim.engine import Instance, Req

from kvbench.registry import Registry

ROUTERS: Registry[Callable] = Registry(None, "router")  # the routers below register with @router
TIMELINE_POINTS = 1000  # samples of KV occupancy kept for the report
AFFINITY_BLOCKS = 4  # prefix-affinity hashes a request's first blocks (a shared system prompt goes one place)
VIRTUAL_NODES = 64  # per instance on the consistent-hash ring: an even split that moves little when N changes


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

    def score(inst):
        # binary search for the cached prefix (a prefix cache keeps prefixes: block i cached implies the
        # blocks before it, up to rare exceptions); a router's estimate, as real cache-aware routers keep
        lo, hi = 0, req.max_hit
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if inst.cache.contains(req.keys[mid - 1]):
                lo = mid
            else:
                hi = mid - 1
        return (lo * inst.bs - inst.load, -inst.routed, -inst.index)

    return max(instances, key=score)


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
    pick = ROUTERS[route]
    state: dict = {}
    seq = itertools.count()
    arrivals: list = []  # (time, seq, req): kept apart from iterations so an instance knows the next one
    steps: list = []  # (time, seq, (instance, pieces, decoding, n))
    waiting_for = None
    if successors is not None:
        waiting_for = np.zeros(len(reqs), dtype=np.int64)
        for succ in successors:
            for s in succ:
                waiting_for[s] += 1
    for r in reqs:
        if waiting_for is None or waiting_for[r.row] == 0:
            arrivals.append((r.arrival, next(seq), r))
    # a calibrated model's per-request overhead (HTTP, tokenising, the hand-off to the engine core): a request
    # reaches the scheduler that long after it is sent, and its TTFT, measured from the send, includes the wait
    entry_delay = instances[0].latency.request_overhead_s if instances else 0.0
    if entry_delay:
        arrivals = [(t + entry_delay, s, r) for t, s, r in arrivals]
    heapq.heapify(arrivals)

    def schedule(when: float, fn) -> None:  # a scenario's timed event: fn(t) runs at simulated time `when`
        heapq.heappush(arrivals, (when, next(seq), fn))

    for sc in scenarios:
        for when, fn in sc.timers(schedule):
            schedule(when, fn)
    span = max((r.arrival for r in reqs), default=0.0) - min((r.arrival for r in reqs), default=0.0)
    every = max(span, 1e-3) / TIMELINE_POINTS
    timeline = {"t_s": [], "kv_usage": [], "running": [], "waiting": []}
    next_sample = 0.0

    def start(inst: Instance, t: float) -> None:
        dt, pieces, decoding, n = inst.plan(t)
        if not pieces and not decoding:
            inst.busy = False
            return
        inst.busy = True
        token = next(seq)
        inst.window = (token, t, dt / n, n, pieces, decoding)
        heapq.heappush(steps, (t + dt, token, (inst, pieces, decoding, n)))

    def cut(inst: Instance, t: float) -> None:
        """A request arrived while `inst` runs several decode iterations as one: end the window after the
        iteration in progress, so the newcomer is scheduled at the next iteration boundary as in an engine."""
        token, begun, per, n, pieces, decoding = inst.window
        done = min(n, int((t - begun) / per) + 1) if per > 0 else n
        if done < n:
            cancelled.add(token)
            token = next(seq)
            inst.window = (token, begun, per, done, pieces, decoding)
            heapq.heappush(steps, (begun + done * per, token, (inst, pieces, decoding, done)))

    cancelled: set[int] = set()
    in_flight = 0
    held: deque[Req] = deque()  # due, but the client's concurrency limit holds them back

    def send(req: Req, t: float) -> None:
        """The client sends a held request now: it reaches the scheduler after the per-request overhead."""
        req.scheduled, req.arrival = req.arrival, t
        heapq.heappush(arrivals, (t + entry_delay, next(seq), req))

    while arrivals or steps:
        if arrivals and (not steps or arrivals[0][0] <= steps[0][0]):
            t, _, req = heapq.heappop(arrivals)
            if callable(req):  # a scenario's timed event (an instance coming up, a user's KV deleted)
                req(t)
                continue
            if max_in_flight and req.scheduled < 0 and not req.handoff:
                if in_flight >= max_in_flight:
                    req.scheduled = -2.0  # (marks it held until send() gives it its send time)
                    held.append(req)
                    continue
                req.scheduled = req.arrival
                in_flight += 1
            candidates = instances
            for sc in scenarios:
                candidates = sc.candidates(candidates, req, t)
            inst = pick(candidates, req, state)
            req.instance = inst.index
            inst.routed += 1
            inst.enqueue(req)
            if not inst.busy:
                start(inst, t)
            elif inst.window[3] > 1:
                cut(inst, t)
            continue
        t, token, (inst, pieces, decoding, n) = heapq.heappop(steps)
        if token in cancelled:
            cancelled.discard(token)
            continue
        finished = inst.finish_step(t, pieces, decoding, n)
        if max_in_flight:
            in_flight -= len(finished) + len(inst.rejected) - inst.rejected_seen
            inst.rejected_seen = len(inst.rejected)
            while held and in_flight < max_in_flight:
                in_flight += 1
                send(held.popleft(), t)
        for req in inst.handed:  # disaggregated prefill done: the KV crosses the link, then decode elsewhere
            delay = sum(sc.handoff_s(req) for sc in scenarios)
            heapq.heappush(arrivals, (t + delay, next(seq), req))
        inst.handed.clear()
        for done in finished:
            if successors is not None:
                for s in successors[done.row]:
                    waiting_for[s] -= 1
                    if waiting_for[s] == 0:
                        succ = reqs[s]
                        succ.arrival = max(succ.arrival, t + float(think[s]))
                        heapq.heappush(arrivals, (succ.arrival + entry_delay, next(seq), succ))
        if t >= next_sample:
            timeline["t_s"].append(round(t, 6))
            timeline["kv_usage"].append(float(np.mean([i.occupancy() for i in instances])))
            timeline["running"].append(sum(len(i.running) for i in instances))
            timeline["waiting"].append(sum(len(i.waiting) for i in instances))
            next_sample = t + every
        start(inst, t)
    return timeline
