"""Speed and results of the `sim` backend (asv).

- `Replay.time_prepare_and_replay`: prepare (isolation folding, densification) + one kernel run at 10,000
  blocks on the Mooncake conversation trace, per registered policy; `time_replay` is the kernel alone.
- `Curve.time_*`: the one-pass hit-rate curve of lru / vllm (every capacity at once).
- `HitRateMooncake` / `HitRateChat`: `track_*` the steady-state token hit rate of every policy at 10,000
  blocks on Mooncake and on the chat sample, so that a change of *results* shows in the asv history next to
  the timings.
- `*.peakmem_*`: peak memory of a prepare + replay.

Policies whose `needs` the trace lacks (e.g. a tenant column) are skipped (NotImplementedError in setup).
Run with `asv run --bench bench_sim` or, without asv, `python -m benchmarks.bench_sim` for a quick table.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from kvbench.backends.sim import policies
from kvbench.backends.sim.curve import lru_curve
from kvbench.backends.sim.prepared import prepare

from kvbench.stats import DEFAULT_WARMUP
from kvbench.traceio import read_trace

REPO = Path(__file__).resolve().parents[1]
TRACES = {"mooncake": REPO / "traces/mooncake/conversation_trace.parquet", "chat": REPO / "traces/samples/chat.parquet"}
CAPACITY = 10_000  # blocks
POLICIES = sorted(policies.registry())

_tables: dict = {}


def _table(name: str):
    if name not in _tables:
        _tables[name] = read_trace(TRACES[name])
    return _tables[name]


def _prepared(name: str, policy: str):
    table, meta = _table(name)
    return prepare(table, meta.block_size, vllm_cap=policy == "vllm")


def _policy_for(name: str, policy: str):
    """The policy, or NotImplementedError (asv: skipped) when the trace lacks a column it needs."""
    pol = policies.get(policy)
    table, _ = _table(name)
    for col in pol.needs:
        if col not in table.column_names or table.column(col).null_count == table.num_rows:
            raise NotImplementedError(f"{policy} needs the column {col!r}, empty in the {name} trace")
    return pol


def steady_token_hit_rate(trace, hit_blocks: np.ndarray, warmup: float = DEFAULT_WARMUP) -> float:
    start = int(trace.n_requests * warmup)
    hit = np.minimum(hit_blocks[start:].astype(np.int64) * trace.block_size, trace.input_tokens[start:])
    return float(hit.sum() / trace.input_tokens[start:].sum())


class Replay:
    params = POLICIES
    param_names = ["policy"]
    timeout = 300

    def setup(self, policy):
        self.pol = _policy_for("mooncake", policy)
        self.table, self.meta = _table("mooncake")
        self.trace = _prepared("mooncake", policy)
        self.pol.kernel(self.trace, CAPACITY)  # compile / load the numba cache outside the timing

    def time_prepare_and_replay(self, policy):
        trace = prepare(self.table, self.meta.block_size, vllm_cap=policy == "vllm")
        self.pol.kernel(trace, CAPACITY)

    def time_replay(self, policy):
        self.pol.kernel(self.trace, CAPACITY)

    def peakmem_prepare_and_replay(self, policy):
        trace = prepare(self.table, self.meta.block_size, vllm_cap=policy == "vllm")
        self.pol.kernel(trace, CAPACITY)


class Curve:
    params = ["lru", "vllm"]
    param_names = ["policy"]
    timeout = 300

    def setup(self, policy):
        if policy not in policies.registry():
            raise NotImplementedError(f"policy {policy} not registered")
        self.trace = _prepared("mooncake", policy)
        lru_curve(self.trace, vllm=policy == "vllm")

    def time_one_pass_curve(self, policy):
        lru_curve(self.trace, vllm=policy == "vllm")

    def peakmem_one_pass_curve(self, policy):
        lru_curve(self.trace, vllm=policy == "vllm")


class _HitRate:
    """Results, not speed: steady-state token hit rate at 10,000 blocks (a change here is a behaviour change)."""

    trace = ""
    params = POLICIES
    param_names = ["policy"]
    timeout = 300

    def setup(self, policy):
        self.pol = _policy_for(self.trace, policy)  # skipped when the trace lacks a column the policy needs

    def rate(self, policy):
        trace = _prepared(self.trace, policy)
        return steady_token_hit_rate(trace, self.pol.kernel(trace, CAPACITY).hit_blocks)


class HitRateMooncake(_HitRate):
    trace = "mooncake"

    def track_steady_token_hit_rate(self, policy):
        return self.rate(policy)

    track_steady_token_hit_rate.unit = "hit rate"


class HitRateChat(_HitRate):
    trace = "chat"

    def track_steady_token_hit_rate(self, policy):
        return self.rate(policy)

    track_steady_token_hit_rate.unit = "hit rate"


if __name__ == "__main__":  # a quick look without asv
    import time

    for policy in POLICIES:
        try:
            bench = Replay()
            bench.setup(policy)
        except NotImplementedError as e:
            print(f"{policy:>12}: skipped ({e})")
            continue
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            bench.time_prepare_and_replay(policy)
            times.append(time.perf_counter() - t0)
        rates = []
        for cls in (HitRateMooncake, HitRateChat):
            try:
                track = cls()
                track.setup(policy)
                rates.append(f"{cls.trace} {track.track_steady_token_hit_rate(policy):.4f}")
            except NotImplementedError:
                rates.append(f"{cls.trace} (skipped)")
        print(f"{policy:>12}: prepare+replay {min(times) * 1e3:8.2f} ms   steady hit @10k: {'  '.join(rates)}")
    c = Curve()
    c.setup("lru")
    t0 = time.perf_counter()
    c.time_one_pass_curve("lru")
    print(f"{'lru curve':>12}: {(time.perf_counter() - t0) * 1e3:.2f} ms")
