"""Speed and results of the `sim` backend (asv).

Speed (on the Mooncake conversation trace, 12,031 requests, 288,500 block references):

- `Replay.time_prepare_and_replay`: prepare (isolation folding, densification) + one kernel run at
  `REPLAY_CAPACITY` blocks, per registered policy; `time_replay` is the kernel alone;
  `peakmem_prepare_and_replay` the peak memory of the first.
- `Curve.time_one_pass_curve` / `peakmem_one_pass_curve`: the one-pass hit-rate curve (every capacity at
  once, by stack distances) of each stack policy (lru, vllm).

Results, not speed (`track_*`; a change of these values is a change of *behaviour*, shown in the asv history
next to the timings). Token-weighted prefix hit rates as `kvbench replay --backend sim` reports them
(`kvbench.trace.stats.hit_rates`): `all` = every request, `steady` = the requests after the warm-up share (the first
50 %). Policies are enumerated from the registry (`kvbench.cache.policies.registry()`):

- `HitRateMooncake`: every policy at every capacity that docs/semantics.md, Reference figures (and
  ../shared/reference/mooncake_conversation.json) gives a reference number for: `MOONCAKE_CAPACITIES`
  blocks of 512 tokens. At radix-lru / fifo / belady (steady) and lru (all and steady) these values must
  equal the reference numbers; the other cells have no reference and are tracked for change only.
- `HitRateSamples`: every policy on every committed sample (traces/samples/*.parquet, found by glob) at
  `SAMPLE_CAPACITY` blocks (2,048 blocks of 64 tokens = 131,072 tokens: below every sample's working set,
  so the policies differ).
- `InfiniteCache`: the infinite-cache hit rate of each of those traces (Mooncake: 0.3736 all / 0.3981
  steady, docs/semantics.md, Reference figures; samples: traces/README.md).

A policy whose `needs` the trace lacks (tenant-quota needs a tenant column) is skipped on that trace
(NotImplementedError in setup: asv's skip), and so is every Mooncake benchmark when the trace is absent.

The Mooncake trace: traces/mooncake/conversation_trace.parquet (committed), else the FAST'25 JSONL
$KVBENCH_SHARED/traces/mooncake/conversation_trace.jsonl (default ../shared, as the tests look for it).
Run with `asv run --bench bench_sim` or, without asv, `python -m benchmarks.bench_sim` for a quick table.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
from kvbench.backends.sim import SimBackend

from kvbench.cache import policies
from kvbench.cache.curve import lru_curve
from kvbench.cache.prepared import prepare
from kvbench.errors import KvbenchError
from kvbench.trace.files import read_trace
from kvbench.trace.stats import DEFAULT_WARMUP, hit_rates, infinite_cache_hits

REPO = Path(__file__).resolve().parents[1]
MOONCAKE_PARQUET = REPO / "traces/mooncake/conversation_trace.parquet"
SHARED = Path(os.environ.get("KVBENCH_SHARED", REPO.parent / "shared"))  # as tests/conftest.py
MOONCAKE_JSONL = SHARED / "traces/mooncake/conversation_trace.jsonl"
SAMPLES = sorted(p.stem for p in (REPO / "traces/samples").glob("*.parquet"))

REPLAY_CAPACITY = 10_000  # blocks (5.1M tokens on Mooncake): speed benchmarks
SAMPLE_CAPACITY = 2_048  # blocks (131,072 tokens at the samples' 64-token blocks)
# Every capacity (blocks) that docs/semantics.md (Reference figures) / the reference JSON gives a Mooncake number for:
# lru 32 … 32768 (all and steady); radix-lru, fifo, belady 1000 … 100000 (steady).
MOONCAKE_CAPACITIES = [32, 128, 512, 1000, 2048, 3000, 5859, 8192, 10000, 19531, 30000, 32768, 50000, 100000]
# block caches (llama-slot keeps token sequences per slot and runs in Python, minutes on Mooncake: its own
# benchmark below, on a sample)
POLICIES = sorted(name for name, pol in policies.registry().items() if pol.blocks)
STACK_POLICIES = sorted(name for name, pol in policies.registry().items() if pol.stack)

_tables: dict = {}


def mooncake_source() -> Path | None:
    """The Mooncake conversation trace: the committed parquet, else the shared JSONL, else None."""
    for path in (MOONCAKE_PARQUET, MOONCAKE_JSONL):
        if path.exists():
            return path
    return None


def load(name: str):
    """(table, meta) of "mooncake" or a sample's name; NotImplementedError (asv: skip) when absent."""
    if name not in _tables:
        if name == "mooncake":
            path = mooncake_source()
            if path is None:
                raise NotImplementedError(
                    f"Mooncake trace absent: neither {MOONCAKE_PARQUET} nor {MOONCAKE_JSONL} "
                    "(set KVBENCH_SHARED to the folder holding traces/)"
                )
            if path.suffix == ".jsonl":
                from kvbench.trace.importers import get

                _tables[name] = get("mooncake").read(path)
            else:
                _tables[name] = read_trace(path)
        else:
            _tables[name] = read_trace(REPO / "traces/samples" / f"{name}.parquet")
    return _tables[name]


def _policy_for(name: str, policy: str):
    """The policy, or NotImplementedError (asv: skipped) when the trace lacks a column it needs."""
    pol = policies.get(policy)
    table, _ = load(name)
    for col in pol.needs:
        if col not in table.column_names or table.column(col).null_count == table.num_rows:
            raise NotImplementedError(f"{policy} needs the column {col!r}, empty in the {name} trace")
    return pol


def _counts(table):
    n_blocks = pc.list_value_length(table.column("block_hashes")).to_numpy(zero_copy_only=False).astype(np.int64)
    return n_blocks, table.column("input_tokens").to_numpy().astype(np.int64)


def policy_hit_rates(name: str, capacities) -> dict:
    """{policy: {capacity_blocks: {"all": token hit rate, "steady": …}}} through the sim backend, as
    `kvbench replay --backend sim --policy P --capacity C1,C2,… --no-bound` computes them; a policy the trace
    cannot run (a column it needs is empty) maps to the reason, a string."""
    table, meta = load(name)
    n_blocks, input_tokens = _counts(table)
    out: dict = {}
    for policy in POLICIES:
        sim = SimBackend(policy=policy, capacity=",".join(map(str, capacities)), bound=False)
        try:
            out[policy] = {
                point.labels["capacity_blocks"]: hit_rates(
                    point.columns["hit_blocks"],
                    n_blocks,
                    input_tokens,
                    meta.block_size,
                    DEFAULT_WARMUP,
                    point.columns["hit_tokens"],
                )["token"]
                for point in sim.replay(table, meta)
            }
        except KvbenchError as exc:
            out[policy] = str(exc)
    return out


def infinite_hit_rates(name: str) -> dict:
    """{"all": …, "steady": …}: token hit rate of an unbounded cache (what `kvbench trace info` prints)."""
    table, meta = load(name)
    n_blocks, input_tokens = _counts(table)
    hits = infinite_cache_hits(table.column("block_hashes"))
    return hit_rates(hits, n_blocks, input_tokens, meta.block_size, DEFAULT_WARMUP)["token"]


# ------------------------------------------------------------------------------------------------- speed


class ReplayLlamaSlot:
    """llama-slot (docs/llama-cpp.md) on the chat sample: 4 unified slots in a 128-block (8,192-token) context,
    with the live client's tokens (--vocab 4096), as `kvbench replay --policy llama-slot` runs it."""

    timeout = 300

    def setup(self):
        self.sim = SimBackend(policy="llama-slot", capacity="128", bound=False, vocab="4096")
        self.table, self.meta = load("chat")

    def time_replay(self):
        list(self.sim.replay(self.table, self.meta))



class Replay:
    params = POLICIES
    param_names = ["policy"]
    timeout = 300

    def setup(self, policy):
        self.pol = _policy_for("mooncake", policy)
        self.table, self.meta = load("mooncake")
        self.trace = prepare(self.table, self.meta.block_size, vllm_cap=policy == "vllm")
        self.pol.kernel(self.trace, REPLAY_CAPACITY)  # compile / load the numba cache outside the timing

    def time_prepare_and_replay(self, policy):
        trace = prepare(self.table, self.meta.block_size, vllm_cap=policy == "vllm")
        self.pol.kernel(trace, REPLAY_CAPACITY)

    def time_replay(self, policy):
        self.pol.kernel(self.trace, REPLAY_CAPACITY)

    def peakmem_prepare_and_replay(self, policy):
        trace = prepare(self.table, self.meta.block_size, vllm_cap=policy == "vllm")
        self.pol.kernel(trace, REPLAY_CAPACITY)


class Curve:
    params = STACK_POLICIES
    param_names = ["policy"]
    timeout = 300

    def setup(self, policy):
        table, meta = load("mooncake")
        self.trace = prepare(table, meta.block_size, vllm_cap=policy == "vllm")
        lru_curve(self.trace)  # compile / load the numba cache

    def time_one_pass_curve(self, policy):
        lru_curve(self.trace)

    def peakmem_one_pass_curve(self, policy):
        lru_curve(self.trace)


# ----------------------------------------------------------------------------------------------- results


class _Tracked:
    """Results computed once per class (`setup_cache`, one process) and looked up by each track."""

    timeout = 600

    def _lookup(self, rates, *params):
        raise NotImplementedError

    def setup(self, rates, *params):
        if rates is None:
            load("mooncake")  # raises NotImplementedError: the trace is absent
        value = self._lookup(rates, *params)
        if isinstance(value, str):  # the policy cannot run on this trace
            raise NotImplementedError(value)


class HitRateMooncake(_Tracked):
    params = [POLICIES, MOONCAKE_CAPACITIES]
    param_names = ["policy", "capacity_blocks"]

    def setup_cache(self):
        if mooncake_source() is None:
            return None
        return policy_hit_rates("mooncake", MOONCAKE_CAPACITIES)

    def _lookup(self, rates, policy, capacity):
        got = rates[policy]
        return got if isinstance(got, str) else got[capacity]

    def track_steady_token_hit_rate(self, rates, policy, capacity):
        """Mooncake conversation trace (512-token blocks): steady-state (last 50 % of requests) token hit rate
        of `policy` at `capacity_blocks` blocks. Reference (docs/semantics.md): radix-lru, fifo, belady at
        1000 … 100000 and lru at 32 … 32768."""
        return rates[policy][capacity]["steady"]

    track_steady_token_hit_rate.unit = "hit rate"

    def track_token_hit_rate(self, rates, policy, capacity):
        """Mooncake conversation trace (512-token blocks): token hit rate over all requests of `policy` at
        `capacity_blocks` blocks. Reference (docs/semantics.md): lru at 32 … 32768 (radix-lru in the
        reference JSON)."""
        return rates[policy][capacity]["all"]

    track_token_hit_rate.unit = "hit rate"


class HitRateSamples(_Tracked):
    params = [SAMPLES, POLICIES]
    param_names = ["sample", "policy"]

    def setup_cache(self):
        return {name: policy_hit_rates(name, [SAMPLE_CAPACITY]) for name in SAMPLES}

    def _lookup(self, rates, sample, policy):
        got = rates[sample][policy]
        return got if isinstance(got, str) else got[SAMPLE_CAPACITY]

    def track_steady_token_hit_rate(self, rates, sample, policy):
        """traces/samples/<sample>.parquet (64-token blocks): steady-state (last 50 % of requests) token hit
        rate of `policy` at SAMPLE_CAPACITY = 2,048 blocks (131,072 tokens). No external reference: tracked
        for change."""
        return rates[sample][policy][SAMPLE_CAPACITY]["steady"]

    track_steady_token_hit_rate.unit = "hit rate"

    def track_token_hit_rate(self, rates, sample, policy):
        """traces/samples/<sample>.parquet (64-token blocks): token hit rate over all requests of `policy` at
        SAMPLE_CAPACITY = 2,048 blocks (131,072 tokens). No external reference: tracked for change."""
        return rates[sample][policy][SAMPLE_CAPACITY]["all"]

    track_token_hit_rate.unit = "hit rate"


class InfiniteCache(_Tracked):
    params = ["mooncake", *SAMPLES]
    param_names = ["trace"]

    def setup_cache(self):
        return {name: infinite_hit_rates(name) for name in self.params if name != "mooncake" or mooncake_source()}

    def _lookup(self, rates, trace):
        if trace not in rates:
            load(trace)  # raises NotImplementedError: the Mooncake trace is absent
        return rates[trace]

    def track_steady_token_hit_rate(self, rates, trace):
        """Token hit rate of an unbounded cache (every block seen before hits, prefix rule), steady state (last
        50 % of requests). Reference: Mooncake 0.3981 (docs/semantics.md); samples: traces/README.md."""
        return rates[trace]["steady"]

    track_steady_token_hit_rate.unit = "hit rate"

    def track_token_hit_rate(self, rates, trace):
        """Token hit rate of an unbounded cache (every block seen before hits, prefix rule), all requests.
        Reference: Mooncake 0.3736 (docs/semantics.md); samples: traces/README.md."""
        return rates[trace]["all"]

    track_token_hit_rate.unit = "hit rate"


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
        print(f"{policy:>12}: prepare+replay @{REPLAY_CAPACITY}: {min(times) * 1e3:8.2f} ms")
    for name, caps in [("mooncake", MOONCAKE_CAPACITIES), *((s, [SAMPLE_CAPACITY]) for s in SAMPLES)]:
        try:
            rates = policy_hit_rates(name, caps)
        except NotImplementedError as e:
            print(f"{name}: skipped ({e})")
            continue
        print(f"\n{name}: steady token hit rate (all requests), capacity in blocks")
        print(f"{'':>12} " + " ".join(f"{c:>15}" for c in caps))
        for policy, by_cap in rates.items():
            if isinstance(by_cap, str):
                print(f"{policy:>12}: skipped ({by_cap})")
                continue
            cells = (f"{r['steady']:.4f} ({r['all']:.4f})" for r in by_cap.values())
            print(f"{policy:>12} " + " ".join(f"{c:>15}" for c in cells))
