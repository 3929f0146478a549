"""Instances of many devices in engine-sim: the options (--tp, --pp, --ep, --dp-attention, their --prefill- and
--decode- forms for the pools of --disagg pd, --deployment presets), their checks, the refusal that names the
smallest setting that fits, and the latency model each pool gets (parallel_model.py; docs/parallelism.md).

A deployment with every degree 1 gets the plain one-device `LatencyModel`, so a one-device run is the run it
was before these options existed (and may use the compiled loop, which knows only that model)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import click
from kvbench.backends.enginesim.parallel_model import ParallelLatencyModel
from kvbench.backends.enginesim.roofline import LatencyModel

from kvbench.errors import KvbenchError
from kvbench.models import DEPLOYMENTS, KV_DTYPE_BYTES, weight_split
from kvbench.options import cli_options, option

DEGREES = ("tp", "pp", "ep", "dp_attention")
POOLS = ("prefill", "decode")
TP_CHOICES = (1, 2, 4, 8, 16, 32, 64)  # what the refusal searches; heads must divide by it (vLLM's rule)

_DEGREE_HELP = {
    "tp": "tensor-parallel devices per pipeline stage (attention heads and MLP split across them)",
    "pp": "pipeline stages per instance (layers split across them); an instance has tp × pp devices",
    "ep": "expert-parallel groups among a stage's tp devices (MoE models; divides tp)",
    "dp_attention": "data-parallel attention groups among a stage's tp devices: each holds the attention weights "
    "and its own requests' KV, MLA's latent no longer copied on every rank (divides tp)",
}


def _fields():
    """(name, type, field) of every parallelism option, in --help order: made in a loop, as each degree has a
    prefill and a decode twin for --disagg pd."""
    yield (
        "deployment",
        str | None,
        option(
            None,
            "preset instance: model, hardware, tp/pp/ep/dp-attention and weight dtype together "
            "(kvbench.models.DEPLOYMENTS); options given explicitly win",
            unit="name",
            type=click.Choice(list(DEPLOYMENTS)),
        ),
    )
    for name in DEGREES:
        flag, unit = "--" + name.replace("_", "-"), {"tp": "devices", "pp": "stages"}.get(name, "groups")
        help = f"{_DEGREE_HELP[name]} [default: the --deployment's, else 1]"
        yield name, int | None, option(None, help, unit=unit, type=click.IntRange(min=1))
        for pool in POOLS:
            help = f"--disagg pd: {flag} of the {pool} instances [default: {flag}]"
            yield f"{pool}_{name}", int | None, option(None, help, unit=unit, type=click.IntRange(min=1))
    yield (
        "weight_dtype",
        str | None,
        option(
            None,
            "weight element type: bytes per parameter in HBM and per step read "
            "[default: the --deployment's, else bf16]",
            unit="name",
            type=click.Choice(list(KV_DTYPE_BYTES)),
        ),
    )
    yield (
        "pp_micro_batches",
        int | None,
        option(
            None,
            "micro-batches a step is cut into when pp > 1 (at most one per sequence) [default: pp]",
            unit="micro-batches",
            type=click.IntRange(min=1),
        ),
    )
    yield (
        "expert_imbalance",
        float,
        option(
            1.0,
            "busiest expert-parallel group's tokens over the mean (1 = perfectly balanced); scales its expert math, "
            "expert weight reads and all-to-all bytes",
            unit="ratio, ≥ 1",
            type=click.FloatRange(min=1.0),
        ),
    )


ParallelOptions = dataclasses.make_dataclass("ParallelOptions", list(_fields()), frozen=True)
OPTIONS = cli_options(ParallelOptions)
NAMES = frozenset(o.name for o in OPTIONS)


@dataclass(frozen=True)
class Degrees:
    tp: int = 1
    pp: int = 1
    ep: int = 1
    dp_attention: int = 1

    @property
    def single(self) -> bool:
        return (self.tp, self.pp, self.ep, self.dp_attention) == (1, 1, 1, 1)


@dataclass(frozen=True)
class Layout:
    """The resolved parallelism: the instance's degrees and, with --disagg pd, each pool's."""

    instance: Degrees
    pools: dict  # "prefill"/"decode" -> Degrees (empty without --disagg pd)
    weight_dtype: str
    micro_batches: int | None
    expert_imbalance: float
    deployment: str | None

    def record(self) -> dict:
        out = {**dataclasses.asdict(self.instance), "weight_dtype": self.weight_dtype,
               "pp_micro_batches": self.micro_batches, "expert_imbalance": self.expert_imbalance,
               "deployment": self.deployment}  # fmt: skip
        for pool, d in self.pools.items():
            out.update({f"{pool}_{k}": v for k, v in dataclasses.asdict(d).items()})
        return out


def resolve(config, given: dict, defaults: dict, disagg_pd: bool):
    """(config with the --deployment's model and hardware, the Layout). `given`: the parallel options as passed
    (None where not given); `defaults`: the config's field defaults, to tell a --model left alone from one
    given (the preset fills the first, refuses to contradict the second)."""
    preset = DEPLOYMENTS[given["deployment"]] if given.get("deployment") else None
    if given.get("deployment") and preset is None:
        raise KvbenchError(f"unknown --deployment {given['deployment']!r}; choose one of: {', '.join(DEPLOYMENTS)}")
    if preset is not None:
        for key in ("model", "hardware"):
            value = getattr(config, key)
            if value != defaults[key] and value.lower() != getattr(preset, key):
                raise KvbenchError(
                    f"--deployment {preset.name} runs {preset.model} on {preset.hardware}; --{key} {value} "
                    f"contradicts it: drop --{key} or pick another --deployment"
                )
        config = dataclasses.replace(config, model=preset.model, hardware=preset.hardware)

    def degree(name: str, pool: str | None = None) -> int:
        if pool and given.get(f"{pool}_{name}") is not None:
            return int(given[f"{pool}_{name}"])
        if given.get(name) is not None:
            return int(given[name])
        return getattr(preset, name) if preset else 1

    instance = Degrees(*(degree(n) for n in DEGREES))
    pools = {}
    pool_given = [f"--{p}-{n.replace('_', '-')}" for p in POOLS for n in DEGREES if given.get(f"{p}_{n}")]
    if disagg_pd:
        pools = {p: Degrees(*(degree(n, p) for n in DEGREES)) for p in POOLS}
    elif pool_given:
        raise KvbenchError(f"{', '.join(pool_given)} apply to the pools of --disagg pd; add --disagg pd or use --tp …")
    weight_dtype = given.get("weight_dtype") or (preset.weight_dtype if preset else "bf16")
    layout = Layout(instance, pools, weight_dtype, given.get("pp_micro_batches"),
                    float(given.get("expert_imbalance") or 1.0), preset.name if preset else None)  # fmt: skip
    if config.calibration and not all(d.single for d in (instance, *pools.values())):
        raise KvbenchError(
            "--calibration measures one deployment as it ran; it cannot be combined with --tp/--pp/--ep/"
            "--dp-attention: drop those options, or the calibration to use the roofline"
        )
    return config, layout


def check_layout(model, tp: int, pp: int, ep: int, dp: int, prefix: str = "") -> None:
    """Refuse degrees the engines refuse, naming the option and what would do."""

    def flag(name: str) -> str:
        return f"--{prefix}{name}"

    if model.heads % tp:
        ok = ", ".join(str(t) for t in TP_CHOICES if model.heads % t == 0)
        raise KvbenchError(f"{flag('tp')} {tp}: {model.name} has {model.heads} attention heads, which tp must "
                           f"divide; use one of {ok}")  # fmt: skip
    if pp > model.layers:
        raise KvbenchError(f"{flag('pp')} {pp}: {model.name} has only {model.layers} layers to split; use at most "
                           f"{model.layers}")  # fmt: skip
    if ep > 1 and not weight_split(model).moe:
        raise KvbenchError(
            f"{flag('ep')} {ep}: {model.name} has no routed experts to spread (expert parallelism is for MoE "
            "models with a WeightSplit entry in kvbench.models); leave --ep at 1"
        )
    for name, value in (("ep", ep), ("dp-attention", dp)):
        if tp % value:
            raise KvbenchError(f"{flag(name)} {value} must divide {flag('tp')} {tp} (its groups are made of the "
                               f"tp devices of a stage); raise {flag('tp')} to a multiple of {value} or lower "
                               f"{flag(name)}")  # fmt: skip


def latency_model(model, hw, degrees: Degrees, layout: Layout, prefix: str = "", **common) -> LatencyModel:
    """The latency model of one pool: the plain one-device roofline when every degree is 1 (the run is exactly
    what it was before multi-device instances), else the parallel one. `common`: kv_dtype, mfu, mbu,
    calibration, as LatencyModel takes them."""
    if degrees.single:
        return LatencyModel(model, hw, weight_dtype=layout.weight_dtype, **common)
    return ParallelLatencyModel(
        model, hw, weight_dtype=layout.weight_dtype, tp=degrees.tp, pp=degrees.pp, ep=degrees.ep,
        dp_attention=degrees.dp_attention, micro_batches=layout.micro_batches or 0,
        expert_imbalance=layout.expert_imbalance, option_prefix=prefix, **common,
    )  # fmt: skip


def _capacity(lat: LatencyModel, mem_util: float, **changes) -> int:
    """KV tokens of `lat`'s instance with some degrees or the weight dtype changed (0: no room, or not a layout
    the engines accept)."""
    keys = {"tp": lat.tp, "pp": 1, "ep": 1, "dp_attention": 1, "weight_dtype": lat.weight_dtype}
    if isinstance(lat, ParallelLatencyModel):
        keys |= {"pp": lat.pp, "ep": lat.ep, "dp_attention": lat.dp_attention}
    keys |= changes
    try:
        trial = ParallelLatencyModel(lat.model, lat.hw, kv_dtype=lat.kv_dtype, mfu=lat.mfu, mbu=lat.mbu, **keys)
    except KvbenchError:
        return 0
    return trial.capacity_tokens(mem_util)


def smallest_fits(lat: LatencyModel, mem_util: float, need_tokens: int = 1) -> dict:
    """The smallest tp, the smallest pp (at this tp) and the first smaller weight dtype (at these degrees) whose
    instance holds at least `need_tokens` of KV; a key is absent when nothing up to its limit does."""
    out = {}
    dp = getattr(lat, "dp_attention", 1)
    for tp in TP_CHOICES:
        if tp > lat.tp and _capacity(lat, mem_util, tp=tp, dp_attention=dp if tp % dp == 0 else 1) >= need_tokens:
            out["tp"] = tp
            break
    for pp in range(getattr(lat, "pp", 1) + 1, lat.model.layers + 1):
        if _capacity(lat, mem_util, pp=pp) >= need_tokens:
            out["pp"] = pp
            break
    for dtype in ("fp8", "int4"):
        if KV_DTYPE_BYTES[dtype] < KV_DTYPE_BYTES[lat.weight_dtype]:
            if _capacity(lat, mem_util, weight_dtype=dtype) >= need_tokens:
                out["weight_dtype"] = dtype
                break
    return out


def pool_tokens(lat: LatencyModel, mem_util: float) -> int:
    """KV tokens of one instance; 0 when the weights leave no room (the caller words the refusal)."""
    try:
        return lat.kv_capacity_tokens(mem_util)
    except KvbenchError:
        return 0


def no_room_error(lat: LatencyModel, mem_util: float, need_tokens: int = 1, prefix: str | None = None):
    """The refusal when the weights leave less than `need_tokens` of KV room: what is on each device, and the
    smallest --tp, --pp and --weight-dtype that would fit. `prefix`: the pool's option prefix ("decode-"),
    default the model's own."""
    prefix = getattr(lat, "option_prefix", "") if prefix is None else prefix
    pp, ep = getattr(lat, "pp", 1), getattr(lat, "ep", 1)
    per_device = lat.weight_bytes_per_device if isinstance(lat, ParallelLatencyModel) else lat.weight_bytes / lat.tp
    hw, m = lat.hw, lat.model
    head = (
        f"{m.name} {lat.weight_dtype} weights ({lat.weight_bytes / 1e9:.1f} GB, {per_device / 1e9:.1f} GB per device) "
        f"leave no room for KV on {lat.tp * pp} × {hw.name} ({hw.hbm_bytes / 1e9:.0f} GB each, {mem_util:.0%} usable)"
    )
    fits = smallest_fits(lat, mem_util, need_tokens)
    fixes = []
    if "tp" in fits:
        fixes.append(f"--{prefix}tp {fits['tp']}")
    if "pp" in fits:
        fixes.append(f"--{prefix}pp {fits['pp']}" + (f" (at --{prefix}tp {lat.tp})" if lat.tp > 1 else ""))
    if "weight_dtype" in fits:
        fixes.append(f"--weight-dtype {fits['weight_dtype']} (at these degrees)")
    text = f"{head}; the smallest settings that fit: {', or '.join(fixes)}" if fixes else (
        f"{head}; nothing up to --{prefix}tp {TP_CHOICES[-1]} or --{prefix}pp {m.layers} fits: pick a larger "
        "--hardware or give --hbm-capacity")  # fmt: skip
    if weight_split(m).moe:
        text += f" (--{prefix}ep {ep if ep > 1 else 'N'} spreads the same expert bytes over the same devices: no room)"
    presets = [d.name for d in DEPLOYMENTS.values() if d.model == m.name]
    if presets:
        text += f"; presets: {', '.join('--deployment ' + p for p in presets)}"
    return KvbenchError(text)


def summary(lat: LatencyModel, mem_util: float, pool_blocks: int, block_size: int) -> dict:
    """What the run's summary says of one pool's instances: devices, degrees, bytes per device, the KV pool."""
    par = isinstance(lat, ParallelLatencyModel)
    degrees = {"tp": lat.tp, "pp": 1, "ep": 1, "dp_attention": 1} | (
        {"pp": lat.pp, "ep": lat.ep, "dp_attention": lat.dp_attention} if par else {}
    )
    kv_dev = lat.kv_bytes_per_token_per_device if par else lat.kv_bytes_per_token
    weights = lat.weight_bytes_per_device if par else lat.weight_bytes
    return {
        "devices": degrees["tp"] * degrees["pp"],
        **degrees,
        "hardware": lat.hw.name,
        "weight_dtype": lat.weight_dtype,
        "weight_bytes_per_device": weights,
        "kv_bytes_per_token_per_device": kv_dev,
        "kv_pool_tokens": pool_blocks * block_size,
        "kv_pool_blocks": pool_blocks,
        "micro_batches": (lat._m if lat.pp > 1 else 1) if par else 1,
        "expert_imbalance": lat.expert_imbalance if par else 1.0,
    }


def describe(pools: dict) -> str:
    """One terminal line per run: 'llama3-70b-…: 4 × h100 (tp 4): KV pool 448k tokens per instance'."""
    parts = []
    for name, s in pools.items():
        degrees = ", ".join(f"{k.replace('_', '-')} {s[k]}" for k in DEGREES if s[k] > 1) or "one device"
        parts.append(f"{name + ': ' if len(pools) > 1 else ''}{s['devices']} × {s['hardware']} ({degrees}), "
                     f"{s['weight_bytes_per_device'] / 1e9:.1f} GB weights per device, KV pool "
                     f"{s['kv_pool_tokens'] / 1e3:,.0f}k tokens per instance")  # fmt: skip
    return "; ".join(parts)
