"""`engine-sim`: a discrete-event model of serving instances that turns a trace into modeled TTFT / TPOT /
E2EL, queueing, KV occupancy over time and tier traffic (docs/architecture.md, Built-in backends). It reuses
the `sim` backend's keys (salt and LoRA folding) and policies (their reference classes, driven request by
request), and a roofline latency model from a model geometry and a hardware spec (kvbench.models,
overridable from a TOML file)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator
from dataclasses import dataclass

import click
import numpy as np
import pyarrow as pa
from kvbench.backends.enginesim import compiled_run, parallel
from kvbench.backends.enginesim import scenarios as _scenarios
from kvbench.backends.enginesim.cluster import ROUTERS, simulate
from kvbench.backends.enginesim.engine import Instance, Req, Scheduler
from kvbench.backends.enginesim.pool import QuickPool

from kvbench import options
from kvbench.cache import policies as _policies
from kvbench.cache.capacity import parse_capacity
from kvbench.cache.policies.vllm import VllmPool
from kvbench.cache.policy_options import check_quota_tenants, parse_policy_options, policy_option_params
from kvbench.cache.prepared import prepare
from kvbench.cache.tiers import STORE_POLICIES, STORE_PUTS, GlobalStore, Tier, TierStack, check_store_options
from kvbench.errors import KvbenchError
from kvbench.metrics.latency import modeled_latency_summary
from kvbench.metrics.slo import parse_slo
from kvbench.models import KV_DTYPE_BYTES, MODELS
from kvbench.options import option
from kvbench.run.backend import PointResult
from kvbench.trace.files import TraceMeta


def _size(default: str, help: str, **kwargs):
    return option(default, help, unit="blocks, tokens or bytes", **kwargs)


def _share(default: float, help: str):
    return option(default, help, unit="share, 0-1", type=click.FloatRange(0, 1, min_open=True))


@dataclass
class EngineSimConfig:
    """The options of `kvbench replay --backend engine-sim` (kvbench.options); the scenarios add theirs."""

    policy: str = option(
        "vllm",
        lambda: (
            f"HBM prefix-cache policy, or several (comma-separated, one point each): {', '.join(_policies.registry())}"
        ),
        unit="name(s)",
        key="policies",
    )
    hardware: str = option(
        "h100", "accelerator preset (kvbench.models) or a [hardware.NAME] table of --specs", unit="name"
    )
    model: str = option(
        "llama3-8b", "model geometry preset (kvbench.models) or a [model.NAME] table of --specs", unit="name"
    )
    specs: str | None = option(
        None, "TOML file of hardware/model tables that override or add presets", unit="path",
        type=click.Path(exists=True, dir_okay=False),
    )  # fmt: skip
    kv_dtype: str = option(
        "bf16", "KV cache element type: scales bytes per token", unit="name", type=click.Choice(list(KV_DTYPE_BYTES))
    )
    instances: int = option(
        1, "serving instances (tp × pp accelerators each: --tp, --pp)", unit="instances", type=click.IntRange(min=1)
    )
    router: str = option(
        "round-robin", "how a request picks an instance", unit="name", type=click.Choice(list(ROUTERS))
    )
    hbm_capacity: str | None = _size(
        None,
        "KV pool per instance: blocks, tokens (5M tok) or bytes (40GiB); with --policy vllm the engine's "
        "num_gpu_blocks, one of which is its null block [default: what --gpu-memory-utilization of HBM leaves "
        "after the weights]",
    )
    gpu_memory_utilization: float = _share(0.9, "share of HBM for weights + KV when the pool is derived")
    max_num_seqs: int = option(
        256, "sequences per iteration (continuous batching)", unit="sequences", type=click.IntRange(min=1)
    )
    max_num_batched_tokens: int = option(
        8192, "tokens per iteration (chunked prefill splits longer prompts)", unit="tokens", type=click.IntRange(min=1)
    )
    preemption: str = option(
        "recompute",
        "when the pool runs out: recompute, swap, or protect-after=N (requests past N generated tokens are "
        "swapped, never recomputed)",
        unit="name (N: tokens)",
    )
    dram_capacity: str = _size("0", "host DRAM tier per instance (e.g. 64GiB; 0 = none)")
    ssd_capacity: str = _size("0", "local SSD tier per instance (e.g. 1TB; 0 = none)")
    global_pool: str = _size(
        "0",
        "global KV store shared by all instances, Mooncake Store / LMCache style (30M tok, 500GB; 0 = none). Every "
        "instance looks a prompt up in its HBM, DRAM, SSD, then the store",
    )
    pool_bandwidth_gbps: float = option(
        25.0,
        "global store → HBM bandwidth per instance, per device when an instance has several (each loads its "
        "share of the KV at this rate): what a block loaded from the store costs",
        unit="GB/s, 1e9 bytes/s",
        type=click.FloatRange(min=0, min_open=True),
    )
    pool_put: str = option(
        "prefill",
        "when an instance puts KV blocks into the global store: prefill (as soon as it computes or admits them, "
        "write-through) or evict (when they leave the instance: a victim cache)",
        unit="name",
        type=click.Choice(list(STORE_PUTS)),
    )
    pool_policy: str = option(
        "lru", f"eviction policy of the global store (its own, apart from --policy): {', '.join(STORE_POLICIES)}",
        unit="name",
    )  # fmt: skip
    write_through: bool = option(
        False,
        "write-through: every block HBM admits is also written to DRAM; write-back: only what HBM evicts",
        unit="on/off",
        flag="--write-through/--write-back",
    )
    closed_loop: bool = option(
        False,
        "a session's next turn (and an agent call after its depends_on) arrives when the previous finishes plus "
        "think_time_s, not at its trace time",
        unit="on/off",
        is_flag=True,
    )
    max_concurrency: int | None = option(
        None,
        "requests the client keeps in flight at most (as a live replay's --max-concurrency): one due while that "
        "many run is sent when one finishes, its latencies counted from then [default: no limit]",
        unit="requests",
        type=click.IntRange(min=1),
    )
    slo: str | None = option(
        None,
        "goodput targets on the modeled latencies, as a live replay's --slo: e.g. ttft=500,tpot=50,e2el=20000",
        unit="ms",
    )
    mfu: float = _share(0.5, "achieved share of peak FLOP/s (prefill)")
    mbu: float = _share(0.8, "achieved share of peak memory bandwidth (decode)")
    calibration: str | None = option(
        None,
        "TOML file with a [calibration] table (from `kvbench calibrate`): measured prefill tokens/s and decode "
        "step terms replace the roofline's",
        unit="path",
        type=click.Path(exists=True, dir_okay=False),
    )
    salt: bool = option(True, "fold cache_salt into cache keys", unit="on/off", flag="--salt/--no-salt")
    share_lora_kv: bool = option(False, "let requests of different LoRA adapters share KV", unit="on/off", is_flag=True)


TIER_OPTIONS = ("hbm_capacity", "dram_capacity", "ssd_capacity", "global_pool")  # sizes, checked when built
DEMO_LOAD = 0.6  # busiest share of an instance the demo's deployment runs at: queues stay short below ~70%
DEMO_WINDOWS = 10  # stretches of the trace whose load is compared (a diurnal trace's peak, not its mean)
DEMO_MAX_INSTANCES = 256


class EngineSimBackend:
    name = "engine-sim"
    kind = "offline"  # kvbench.run.backend.OfflineBackend
    Config = EngineSimConfig

    @classmethod
    def cli_options(cls) -> list[click.Option]:
        scenario_options = [opt for sc in _scenarios.registry().values() for opt in sc.options]
        return options.cli_options(EngineSimConfig) + parallel.OPTIONS + policy_option_params() + scenario_options

    def __init__(self, config: EngineSimConfig | None = None, **kwargs):
        """`config`, or its fields as keyword arguments; the other keywords are the policies' options (--quota,
        as the sim backend takes them) and the scenarios'."""
        from kvbench.models import load_specs, resolve_hardware, resolve_model

        c, others = options.build(EngineSimConfig, config, kwargs)
        fields = {f.name: f for f in dataclasses.fields(EngineSimConfig)}
        given = {k: others.pop(k) for k in list(others) if k in parallel.NAMES}
        defaults = {k: f.default for k, f in fields.items()}
        c, layout = parallel.resolve(c, given, defaults, others.get("disagg") == "pd")
        self.options = c
        self.policies = _policies.parse_names(c.policy)
        names = {p.name for p in policy_option_params()}
        self.policy_options = parse_policy_options({k: v for k, v in others.items() if k in names}, self.policies)
        scenario_options = {k: v for k, v in others.items() if k not in names}
        check_store_options(c.pool_policy, c.pool_put)  # before any replay, as the other names are
        if c.router not in ROUTERS:
            raise KvbenchError(f"unknown router {c.router!r}; choose from: {', '.join(ROUTERS)}")
        loaded = load_specs(c.specs) if c.specs else None
        self.hw, self.model = resolve_hardware(c.hardware, loaded), resolve_model(c.model, loaded)
        calib = _calibration(c.calibration) if c.calibration else None
        common = {"kv_dtype": c.kv_dtype, "mfu": c.mfu, "mbu": c.mbu, "calibration": calib}
        self.latency = parallel.latency_model(self.model, self.hw, layout.instance, layout, **common)
        # --disagg pd: each pool its own devices (--prefill-tp, --decode-tp, …)
        self.pool_latency = {
            pool: parallel.latency_model(self.model, self.hw, d, layout, f"{pool}-", **common)
            for pool, d in layout.pools.items()
        }
        self.sched = Scheduler(c.max_num_seqs, c.max_num_batched_tokens, *_preemption(c.preemption))
        self.slo = parse_slo(c.slo)  # checked now, before any replay
        self.settings = {
            **options.record(
                c,
                policy=self.policies,
                hardware=self.hw.name,
                model=self.model.name,
                calibration=calib and vars(calib),
                policy_options=self.policy_options,
            ),
            **layout.record(),
            # scenario options not given (a call from Python rather than the CLI) take their declared defaults
            **{o.name: _declared_default(o) for sc in _scenarios.registry().values() for o in sc.options},
            **scenario_options,
        }
        self.scenarios = _scenarios.active(self.settings)  # checks the scenario options now, before any replay
        self.kv_dtype = c.kv_dtype
        for key in TIER_OPTIONS:  # sizes too (not 'less than a block': no trace yet)
            if str(self.settings[key] or "0").strip() != "0":
                model = self.model.name if self.model.name in MODELS else None
                parse_capacity(str(self.settings[key]), 1, model, c.kv_dtype, options.flag_of(fields[key]))

    @classmethod
    def demo_options(cls, trace: pa.Table, meta: TraceMeta) -> dict:
        """`kvbench demo`: vLLM's policy with the cache-aware router on as many H100 instances as the trace's
        busiest stretch needs: the roofline's work of each request spread over the time it runs, summed per
        tenth of the trace, at most DEMO_LOAD of each instance. A deployment the load saturates would show a
        queue growing for the whole trace, not the cache (docs/semantics.md, Saturation)."""
        base = {"policy": "vllm", "router": "cache-aware"}
        lat, c = cls(**base).latency, cls.Config()
        inp = trace.column("input_tokens").to_numpy().astype(np.int64)
        out = np.maximum(trace.column("output_tokens").to_numpy().astype(np.int64), 1)
        arrival = trace.column("arrival_s").to_numpy().astype(np.float64)
        if inp.size == 0:
            return {**base, "instances": 1}
        # Prompts computed in full, chunk by chunk over their growing context: the deployment must serve the
        # trace whatever the cache saves (the cache is what the demo measures, not something to lean on).
        step = c.max_num_batched_tokens
        prefill = np.array([sum(lat.prefill_s(min(step, n - d), d) for d in range(0, int(n), step)) for n in inp])
        # Decode in batches as large as the sequence cap and the KV pool allow at the trace's mean context: a
        # request holds one of `seqs` slots for `out` steps, 1/seqs of an instance for that long.
        context = float(np.mean(inp + out / 2))
        seqs = int(max(1, min(c.max_num_seqs, lat.kv_capacity_tokens(c.gpu_memory_utilization) // max(context, 1))))
        step_s = lat.decode_step_s(seqs, int(seqs * context))
        busiest = _busiest_load(arrival, prefill + out * step_s / seqs, prefill + out * step_s)
        return {**base, "instances": int(min(DEMO_MAX_INSTANCES, max(1, np.ceil(busiest / DEMO_LOAD))))}

    def config(self) -> dict:
        return dict(self.settings)

    def _blocks(self, text: str, bs: int, option: str) -> int:
        if str(text).strip() in ("", "0"):
            return 0
        model = self.model.name if self.model.name in MODELS else None  # --specs models: blocks or tokens
        return parse_capacity(str(text), bs, model, self.kv_dtype, option).blocks

    def pool_blocks(self, bs: int, latency=None, pool: str = "") -> int:
        """KV blocks of one instance whose latency model is `latency` (default: the instance-wide one) of the
        --disagg pd `pool` ("prefill", "decode"; "" for all instances): the refusal names its options."""
        if self.settings["hbm_capacity"]:
            return self._blocks(self.settings["hbm_capacity"], bs, "--hbm-capacity")
        latency = latency or self.latency
        util = self.settings["gpu_memory_utilization"]
        blocks = parallel.pool_tokens(latency, util) // bs
        if blocks <= 0:
            raise parallel.no_room_error(latency, util, bs, f"{pool}-" if pool else "")
        return blocks

    def _pool_models(self, bs: int) -> list[tuple[str, object, int]]:
        """(pool, latency model, KV blocks) per instance: one pool, or --disagg pd's prefill and decode pools."""
        if not self.pool_latency:
            return [("instance", self.latency, self.pool_blocks(bs))] * self.settings["instances"]
        n_prefill = self.settings["prefill_instances"]
        sized = {pool: (pool, lat, self.pool_blocks(bs, lat, pool)) for pool, lat in self.pool_latency.items()}
        return [sized["prefill" if i < n_prefill else "decode"] for i in range(self.settings["instances"])]

    def replay(self, trace: pa.Table, meta: TraceMeta, progress=None) -> Iterator[PointResult]:
        for name in self.policies:
            yield self._point(trace, meta, _policies.get(name))

    def _point(self, trace: pa.Table, meta: TraceMeta, pol) -> PointResult:
        from kvbench.backends.enginesim.results import point_result

        s, bs = self.settings, meta.block_size
        scenarios = _scenarios.active(s)
        keyed, share_lora = trace, s["share_lora_kv"]
        for sc in scenarios:
            keyed, share_lora = sc.prepare_trace(keyed), sc.share_lora(share_lora)
        prep = prepare(keyed, bs, use_salt=s["salt"], share_lora=share_lora, vllm_cap=pol.name == "vllm")
        check_quota_tenants(self.policy_options, prep.tenant_names)
        pool_models = self._pool_models(bs)
        pool_blocks = pool_models[0][2]
        kvb = self.latency.kv_bytes_per_token * bs
        pool_size = self._blocks(s["global_pool"], bs, "--global-pool")
        pool = None
        if pool_size:
            pool_bw = s["pool_bandwidth_gbps"] * 1e9
            pool = GlobalStore("global", pool_size, pool_bw, policy=s["pool_policy"], put_on=s["pool_put"])
        tiers, pcie = self._tiers(bs, pool), self.hw.host_to_device_bw
        if compiled_run.applies(s, pol, scenarios, self.latency, s["router"], tiers, prep.n_requests):
            reqs, instances, timeline, *evictions = compiled_run.run(
                prep, trace, s["instances"], pool_blocks, self.sched, self.latency, s["router"], pcie
            )
        else:
            reqs, instances, timeline = self._python_loop(trace, prep, pol, scenarios, bs, pool_models, pool)
            evictions = None
        summarise = functools.partial(modeled_latency_summary, slo=self.slo)
        result = point_result(pol, reqs, instances, prep, trace, timeline, kvb, pool, summarise, evictions)
        result.extra["engine"]["scenarios"] = {sc.name: sc.summary(reqs, instances, prep, kvb) for sc in scenarios}
        util = s["gpu_memory_utilization"]
        result.extra["engine"]["parallelism"] = {
            name: parallel.summary(lat, util, blocks, bs) for name, lat, blocks in dict.fromkeys(pool_models)
        }
        if any(p["devices"] > 1 for p in result.extra["engine"]["parallelism"].values()):  # the terminal's line
            result.extra["engine"]["deployment"] = parallel.describe(result.extra["engine"]["parallelism"])
        return result

    def _tiers(self, bs: int, pool) -> TierStack:
        """One instance's tiers below HBM (the global store, `pool`, shared by all)."""
        s = self.settings
        return TierStack(
            Tier("dram", self._blocks(s["dram_capacity"], bs, "--dram-capacity"), self.hw.host_to_device_bw),
            Tier("ssd", self._blocks(s["ssd_capacity"], bs, "--ssd-capacity"), self.hw.ssd_to_device_bw),
            pool,
            s["write_through"],
        )

    def _python_loop(self, trace, prep, pol, scenarios, bs: int, pool_models: list, pool):
        """cluster.simulate over the Python instances: the reference loop, and every case the compiled one
        (compiled_run.py) does not cover."""
        s = self.settings
        flat, off = prep.keys.tolist(), prep.offsets.tolist()
        keys = [flat[off[r] : off[r + 1]] for r in range(prep.n_requests)]  # each request's, read-only, shared
        instances = []
        for i, (_, latency, pool_blocks) in enumerate(pool_models):
            # vLLM's pool in its quick form (pool.py): the same rule, what a long replay spends most time in
            if pol.cache is VllmPool:
                cache = QuickPool(prep, pool_blocks, {}, keys)
            else:
                cache = pol.cache(prep, pool_blocks, self.policy_options)
            tiers = self._tiers(bs, pool)
            inst = Instance(i, cache, tiers, latency, pool_blocks, bs, self.sched, self.hw.host_to_device_bw)
            inst.scenarios = scenarios
            _hook(inst)
            instances.append(inst)
        arrival = trace.column("arrival_s").to_numpy().astype(np.float64).tolist()
        n_out = np.maximum(trace.column("output_tokens").to_numpy(), 1).tolist()
        n_in, max_hit = prep.input_tokens.tolist(), prep.max_hit.tolist()
        reqs = [Req(r, arrival[r], n_in[r], n_out[r], keys[r], max_hit[r]) for r in range(prep.n_requests)]
        successors = think = None
        if s["closed_loop"]:
            from kvbench.run.pacing import predecessors

            successors = [[] for _ in reqs]
            for r, preds in enumerate(predecessors(trace)):
                for p in preds:
                    successors[p].append(r)
            col = trace.column("think_time_s") if "think_time_s" in trace.column_names else None
            think = np.zeros(len(reqs)) if col is None else col.fill_null(0.0).to_numpy().astype(np.float64)
        for sc in scenarios:
            sc.attach(instances, reqs, trace, prep, bs)
        timeline = simulate(instances, reqs, s["router"], successors, think, scenarios, s["max_concurrency"])
        return reqs, instances, timeline


def _busiest_load(start: np.ndarray, work: np.ndarray, duration: np.ndarray) -> float:
    """Instances' worth of work in the trace's busiest tenth: each request's `work` (instance-seconds) spread
    evenly over [start, start + duration], the time it runs. Spread, not counted at arrival: a reasoning
    request decoding for an hour loads an instance a little for that hour, not fully for a tenth of a short
    trace. Cumulative work F(x) = Σ rate·(clip(x − start) − clip(x − end)) from sorted starts and ends."""
    duration = np.maximum(duration, 1e-9)
    rate, end = work / duration, start + duration
    lo = float(start.min())
    window = max(float(np.ptp(start)) / DEMO_WINDOWS, 1.0)
    edges = np.arange(lo, float(end.max()) + window, window)

    def below(points: np.ndarray, x: np.ndarray) -> np.ndarray:  # Σ over points < x of rate·(x − point)
        order = np.argsort(points)
        p, r = points[order], rate[order]
        k = np.searchsorted(p, x)
        cum_r, cum_rp = np.concatenate([[0.0], np.cumsum(r)]), np.concatenate([[0.0], np.cumsum(r * p)])
        return cum_r[k] * x - cum_rp[k]

    done = below(start, edges) - below(end, edges)
    return float(np.diff(done).max() / window) if edges.size > 1 else float(work.sum() / window)


def _declared_default(option: click.Option):
    """An option's default as a value: click marks "no default" with a sentinel object (truthy), never None."""
    default = option.default
    return default if default is None or isinstance(default, bool | int | float | str | tuple | list) else None


def _calibration(path: str):
    import tomllib

    from kvbench.backends.enginesim.roofline import Calibration

    try:
        data = tomllib.loads(open(path).read())
    except tomllib.TOMLDecodeError as exc:
        raise KvbenchError(f"{path}: not valid TOML ({exc})") from None
    if "calibration" not in data:
        raise KvbenchError(f"{path}: no [calibration] table; write one with `kvbench calibrate --url …`")
    return Calibration.from_mapping(data["calibration"], path)


def _preemption(text: str) -> tuple[str, int]:
    text = str(text).strip()
    if text in ("recompute", "swap"):
        return text, 0
    if text.startswith("protect-after="):
        try:
            return "protect-after", int(text.split("=", 1)[1])
        except ValueError:
            pass
    raise KvbenchError(f"--preemption {text!r}: use recompute, swap or protect-after=N (N generated tokens)")


def _hook(inst: Instance) -> None:
    """Let the tiers see what the HBM policy admits and evicts, and time each block's life in HBM, without
    touching the policy's code."""
    cache, tiers = inst.cache, inst.tiers
    insert, evict = cache.insert, cache.evict
    born, lifetimes = inst.born, inst.lifetimes
    # with no tier below HBM the tiers have nothing to do: not called (twice per block of a long replay)
    admitted, left = (tiers.admitted, tiers.evicted) if tiers.lower else (None, None)
    if hasattr(cache, "track"):  # the quick pool does the same in its own insert and evict, in the same order
        cache.track(inst, born, lifetimes, admitted, left)
        return

    def inserted(key):
        insert(key)
        born[key] = inst.now
        if admitted is not None:
            admitted(key)

    def evicted(key):
        evict(key)
        lifetimes.append(inst.now - born.pop(key, inst.now))
        if left is not None:
            left(key)

    cache.insert, cache.evict = inserted, evicted
