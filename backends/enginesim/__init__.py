"""`engine-sim`: a discrete-event model of serving instances that turns a trace into modeled TTFT / TPOT /
E2EL, queueing, KV occupancy over time and tier traffic (docs/architecture.md, Built-in backends). It reuses
the `sim` backend's keys (salt and LoRA folding) and policies (their reference classes, driven request by
request), and a roofline latency model from a model geometry and a hardware spec (kvbench.hardware,
overridable from a TOML file)."""

from __future__ import annotations

from collections.abc import Iterator

import click
import numpy as np
import pyarrow as pa
from kvbench.backends.enginesim import scenarios as _scenarios
from kvbench.backends.enginesim.cluster import ROUTERS, simulate
from kvbench.backends.enginesim.engine import Instance, Req, Scheduler

from kvbench.cache import policies as _policies
from kvbench.cache.capacity import KV_DTYPE_BYTES, MODELS, parse_capacity
from kvbench.cache.prepared import prepare
from kvbench.cache.tiers import STORE_POLICIES, STORE_PUTS, GlobalStore, Tier, TierStack, check_store_options
from kvbench.errors import KvbenchError
from kvbench.live.latency import modeled_latency_summary
from kvbench.run.backend import PointResult
from kvbench.trace.files import TraceMeta


def _size_option(flag: str, help: str) -> click.Option:
    return click.Option([flag], default="0", show_default=True, help=help)


class EngineSimBackend:
    name = "engine-sim"
    kind = "offline"  # kvbench.run.backend.OfflineBackend

    @classmethod
    def cli_options(cls) -> list[click.Option]:
        pols = ", ".join(_policies.registry())
        return [
            click.Option(
                ["--policy"],
                default="vllm",
                show_default=True,
                help=f"HBM prefix-cache policy, or several (comma-separated, one point each): {pols}",
            ),
            click.Option(
                ["--hardware"],
                default="h100",
                show_default=True,
                help="accelerator preset (kvbench.hardware) or a [hardware.NAME] table of --specs",
            ),
            click.Option(
                ["--model"],
                default="llama3-8b",
                show_default=True,
                help="model geometry preset or a [model.NAME] table of --specs",
            ),
            click.Option(
                ["--specs"],
                type=click.Path(exists=True, dir_okay=False),
                help="TOML file of hardware/model tables that override or add presets",
            ),
            click.Option(
                ["--kv-dtype"],
                type=click.Choice(list(KV_DTYPE_BYTES)),
                default="bf16",
                show_default=True,
                help="KV cache element type: scales bytes per token",
            ),
            click.Option(
                ["--instances"],
                type=click.IntRange(min=1),
                default=1,
                show_default=True,
                help="serving instances (one accelerator each)",
            ),
            click.Option(
                ["--router"],
                type=click.Choice(list(ROUTERS)),
                default="round-robin",
                show_default=True,
                help="how a request picks an instance",
            ),
            click.Option(
                ["--hbm-capacity"],
                help="KV pool per instance: blocks, tokens (5M tok) or bytes (40GiB); with --policy vllm the "
                "engine's num_gpu_blocks, one of which is its null block "
                "[default: what --gpu-memory-utilization of HBM leaves after the weights]",
            ),
            click.Option(
                ["--gpu-memory-utilization"],
                type=click.FloatRange(0, 1, min_open=True),
                default=0.9,
                show_default=True,
                help="share of HBM for weights + KV when the pool is derived",
            ),
            click.Option(
                ["--max-num-seqs"],
                type=click.IntRange(min=1),
                default=256,
                show_default=True,
                help="sequences per iteration (continuous batching)",
            ),
            click.Option(
                ["--max-num-batched-tokens"],
                type=click.IntRange(min=1),
                default=8192,
                show_default=True,
                help="tokens per iteration (chunked prefill splits longer prompts)",
            ),
            click.Option(
                ["--preemption"],
                default="recompute",
                show_default=True,
                help="when the pool runs out: recompute, swap, or protect-after=N (requests past N generated "
                "tokens are swapped, never recomputed)",
            ),
            _size_option("--dram", "host DRAM tier per instance (bytes, e.g. 64GiB; 0 = none)"),
            _size_option("--ssd", "local SSD tier per instance (bytes, e.g. 1TB; 0 = none)"),
            _size_option(
                "--global-pool",
                "global KV store shared by all instances, Mooncake Store / LMCache style: blocks, tokens "
                "(30M tok) or bytes (500GB); 0 = none. Every instance looks a prompt up in its HBM, DRAM, SSD, "
                "then the store",
            ),
            click.Option(
                ["--pool-bandwidth"],
                type=click.FloatRange(min=0, min_open=True),
                default=25.0,
                show_default=True,
                help="global store → HBM bandwidth per instance (GB/s): what a block loaded from the store costs",
            ),
            click.Option(
                ["--pool-put"],
                type=click.Choice(list(STORE_PUTS)),
                default="prefill",
                show_default=True,
                help="when an instance puts KV blocks into the global store: prefill (as soon as it computes or "
                "admits them, write-through) or evict (when they leave the instance: a victim cache)",
            ),
            click.Option(
                ["--pool-policy"],
                default="lru",
                show_default=True,
                help=f"eviction policy of the global store (its own, apart from --policy): {', '.join(STORE_POLICIES)}",
            ),
            click.Option(
                ["--write-through/--write-back"],
                default=False,
                show_default=True,
                help="write-through: every block HBM admits is also written to DRAM; write-back: only what HBM evicts",
            ),
            click.Option(
                ["--max-concurrency"],
                type=click.IntRange(min=1),
                help="requests the client keeps in flight at most (as a live replay's --max-concurrency): one due "
                "while that many run is sent when one finishes, its latencies counted from then [default: no limit]",
            ),
            click.Option(
                ["--closed-loop"],
                is_flag=True,
                help="a session's next turn (and an agent call after its depends_on) arrives when the previous "
                "finishes plus think_time_s, not at its trace time",
            ),
            click.Option(
                ["--mfu"],
                type=click.FloatRange(0, 1, min_open=True),
                default=0.5,
                show_default=True,
                help="achieved share of peak FLOP/s (prefill)",
            ),
            click.Option(
                ["--mbu"],
                type=click.FloatRange(0, 1, min_open=True),
                default=0.8,
                show_default=True,
                help="achieved share of peak memory bandwidth (decode)",
            ),
            click.Option(
                ["--calibration"],
                type=click.Path(exists=True, dir_okay=False),
                help="TOML file with a [calibration] table (from `kvbench calibrate`): measured prefill tokens/s "
                "and decode step terms replace the roofline's",
            ),
            click.Option(["--salt/--no-salt"], default=True, show_default=True, help="fold cache_salt into cache keys"),
            click.Option(["--share-lora-kv"], is_flag=True, help="let requests of different LoRA adapters share KV"),
        ] + [opt for sc in _scenarios.registry().values() for opt in sc.options]

    def __init__(
        self,
        policy="vllm",
        hardware="h100",
        model="llama3-8b",
        specs=None,
        kv_dtype="bf16",
        instances=1,
        router="round-robin",
        hbm_capacity=None,
        gpu_memory_utilization=0.9,
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        preemption="recompute",
        dram="0",
        ssd="0",
        global_pool="0",
        pool_bandwidth=25.0,
        pool_put="prefill",
        pool_policy="lru",
        write_through=False,
        closed_loop=False,
        max_concurrency=None,
        mfu=0.5,
        mbu=0.8,
        calibration=None,
        salt=True,
        share_lora_kv=False,
        **scenario_options,
    ):
        from kvbench.backends.enginesim.roofline import LatencyModel

        from kvbench.hardware import load_specs, resolve_hardware, resolve_model

        self.policies = _policies.parse_names(policy)
        check_store_options(pool_policy, pool_put)  # before any replay, as the other names are
        if router not in ROUTERS:
            raise KvbenchError(f"unknown router {router!r}; choose from: {', '.join(ROUTERS)}")
        loaded = load_specs(specs) if specs else None
        self.hw, self.model = resolve_hardware(hardware, loaded), resolve_model(model, loaded)
        calib = _calibration(calibration) if calibration else None
        self.latency = LatencyModel(self.model, self.hw, kv_dtype=kv_dtype, mfu=mfu, mbu=mbu, calibration=calib)
        self.sched = Scheduler(max_num_seqs, max_num_batched_tokens, *_preemption(preemption))
        self.settings = {
            "policies": self.policies,
            "hardware": self.hw.name,
            "model": self.model.name,
            "specs": specs,
            "kv_dtype": kv_dtype,
            "instances": instances,
            "router": router,
            "hbm_capacity": hbm_capacity,
            "gpu_memory_utilization": gpu_memory_utilization,
            "max_num_seqs": max_num_seqs,
            "max_num_batched_tokens": max_num_batched_tokens,
            "preemption": preemption,
            "dram": dram,
            "ssd": ssd,
            "global_pool": global_pool,
            "pool_bandwidth_gbps": pool_bandwidth,
            "pool_put": pool_put,
            "pool_policy": pool_policy,
            "write_through": write_through,
            "closed_loop": closed_loop,
            "max_concurrency": max_concurrency,
            "mfu": mfu,
            "mbu": mbu,
            "calibration": calib and vars(calib),
            "salt": salt,
            "share_lora_kv": share_lora_kv,
            # scenario options not given (a call from Python rather than the CLI) take their declared defaults
            **{o.name: _declared_default(o) for sc in _scenarios.registry().values() for o in sc.options},
            **scenario_options,
        }
        self.scenarios = _scenarios.active(self.settings)  # checks the scenario options now, before any replay
        self.kv_dtype = kv_dtype
        for key in ("hbm_capacity", "dram", "ssd", "global_pool"):  # sizes too (not 'less than a block': no trace yet)
            if str(self.settings[key] or "0").strip() != "0":
                model = self.model.name if self.model.name in MODELS else None
                parse_capacity(str(self.settings[key]), 1, model, kv_dtype, "--" + key.replace("_", "-"))

    @classmethod
    def demo_options(cls, trace: pa.Table, meta: TraceMeta) -> dict:
        """`kvbench demo`: the trace on two H100 instances with the cache-aware router, vLLM's policy."""
        return {"policy": "vllm", "instances": 2, "router": "cache-aware"}

    def config(self) -> dict:
        return dict(self.settings)

    def _blocks(self, text: str, bs: int, option: str) -> int:
        if str(text).strip() in ("", "0"):
            return 0
        model = self.model.name if self.model.name in MODELS else None  # --specs models: blocks or tokens
        return parse_capacity(str(text), bs, model, self.kv_dtype, option).blocks

    def pool_blocks(self, bs: int) -> int:
        if self.settings["hbm_capacity"]:
            return self._blocks(self.settings["hbm_capacity"], bs, "--hbm-capacity")
        blocks = self.latency.kv_capacity_tokens(self.settings["gpu_memory_utilization"]) // bs
        if blocks <= 0:
            raise KvbenchError(
                f"{self.model.name} weights ({self.latency.weight_bytes / 1e9:.1f} GB) leave no KV room on "
                f"{self.hw.name} ({self.hw.hbm_bytes / 1e9:.0f} GB); pick a larger --hardware or give --hbm-capacity"
            )
        return blocks

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
        pool_blocks = self.pool_blocks(bs)
        kvb = self.latency.kv_bytes_per_token * bs
        pool_size = self._blocks(s["global_pool"], bs, "--global-pool")
        pool = None
        if pool_size:
            pool_bw = s["pool_bandwidth_gbps"] * 1e9
            pool = GlobalStore("global", pool_size, pool_bw, policy=s["pool_policy"], put_on=s["pool_put"])
        instances = []
        for i in range(s["instances"]):
            cache = pol.cache(prep, pool_blocks, {})
            tiers = TierStack(
                Tier("dram", self._blocks(s["dram"], bs, "--dram"), self.hw.host_to_device_bw),
                Tier("ssd", self._blocks(s["ssd"], bs, "--ssd"), self.hw.ssd_to_device_bw),
                pool,
                s["write_through"],
            )
            inst = Instance(i, cache, tiers, self.latency, pool_blocks, bs, self.sched, self.hw.host_to_device_bw)
            inst.scenarios = scenarios
            _hook(inst)
            instances.append(inst)
        arrival = trace.column("arrival_s").to_numpy().astype(np.float64)
        n_out = trace.column("output_tokens").to_numpy()
        reqs = [
            Req(
                r,
                float(arrival[r]),
                int(prep.input_tokens[r]),
                max(1, int(n_out[r])),
                prep.keys[prep.offsets[r] : prep.offsets[r + 1]].tolist(),
                int(prep.max_hit[r]),
            )
            for r in range(prep.n_requests)
        ]
        successors = think = None
        if s["closed_loop"]:
            from kvbench.live.pacing import predecessors

            successors = [[] for _ in reqs]
            for r, preds in enumerate(predecessors(trace)):
                for p in preds:
                    successors[p].append(r)
            col = trace.column("think_time_s") if "think_time_s" in trace.column_names else None
            think = np.zeros(len(reqs)) if col is None else col.fill_null(0.0).to_numpy().astype(np.float64)
        for sc in scenarios:
            sc.attach(instances, reqs, trace, prep, bs)
        timeline = simulate(instances, reqs, s["router"], successors, think, scenarios, s["max_concurrency"])
        result = point_result(pol, reqs, instances, prep, trace, timeline, kvb, pool, modeled_latency_summary)
        result.extra["engine"]["scenarios"] = {sc.name: sc.summary(reqs, instances, prep, kvb) for sc in scenarios}
        return result


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

    def inserted(key):
        insert(key)
        inst.born[key] = inst.now
        tiers.admitted(key)

    def evicted(key):
        evict(key)
        inst.lifetimes.append(inst.now - inst.born.pop(key, inst.now))
        tiers.evicted(key)

    cache.insert, cache.evict = inserted, evicted
