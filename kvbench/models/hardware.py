"""Accelerator specs for the engine simulator's roofline, the built-in presets, and the TOML file that overrides
them or adds hardware and models of its own.

Units everywhere: bytes, bytes per second, FLOP per second. Link bandwidths are *one direction*: a datasheet's
"900 GB/s NVLink" or "PCIe Gen5 128 GB/s" counts both directions together and is halved here, because a KV
transfer moves data one way.

    [hardware.h100]            # override fields of a preset
    hbm_bw = 3.0e12
    [hardware.mi300x]          # or add a new one (name, then every field without a default)
    hbm_bytes = 192e9
    ...
    [model.my-8b]              # models use ModelGeometry's fields (kvbench/cache/capacity.py)
    layers = 32
    ...
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from kvbench.errors import KvbenchError
from kvbench.models.geometry import MODELS, ModelGeometry

# Host-tier defaults, for presets that do not say otherwise.
# DRAM: two sockets × 8 channels of DDR5-4800 (2 × 307 GB/s) shared by the 8 GPUs of a server ≈ 77 GB/s each.
# That is above a Gen5 x16 link, so for most presets PCIe stays the limit of a DRAM → HBM move.
DRAM_BW = 75e9
# SSD: one PCIe Gen4 x4 NVMe drive's sequential read (Samsung PM9A3 and Micron 7450 datasheets: ~6.8–6.9 GB/s).
SSD_BW = 7e9
# Between devices. NVLink hop: NCCL's small-message all-reduce on an 8-GPU NVSwitch server takes on the order of
# ten microseconds, i.e. about 1 µs for each of a ring's 2(n − 1) steps at n = 8 (an assumption of this model, not
# a datasheet figure). Network: one 400 Gb/s ConnectX-7 NIC per GPU, as the DGX/HGX H100 and H200 reference
# designs have (50 GB/s one way), and an RDMA hop through one switch of about 5 µs.
LINK_LATENCY_S = 1e-6
NET_BW = 50e9
NET_LATENCY_S = 5e-6
# Output tile shapes (rows × columns) of the tensor-core GEMM kernels cuBLAS and CUTLASS ship for Ampere and Hopper;
# the operator model (backends/enginesim/operators.py) takes the GEMM to run on whichever wastes least.
GEMM_TILES = ((64, 64), (64, 128), (128, 128), (128, 256), (256, 128))


@dataclass(frozen=True)
class Hardware:
    """One accelerator (or one CPU socket standing in for one), as the roofline and the KV tiers see it."""

    name: str
    hbm_bytes: float  # device memory, bytes
    hbm_bw: float  # device memory bandwidth, bytes/s
    flops: float  # dense (no 2:4 sparsity) bf16 tensor FLOP/s
    pcie_bw: float  # host ↔ device, one direction, bytes/s
    nvlink_bw: float = 0.0  # device ↔ device, one direction, bytes/s; 0 when there is no such link
    flops_fp8: float = 0.0  # dense fp8 FLOP/s; 0 → no fp8 tensor cores: fp8 weights are widened to bf16 math
    dram_bw: float = DRAM_BW  # host DRAM bandwidth available to this device, bytes/s
    ssd_bw: float = SSD_BW  # local NVMe read bandwidth available to this device, bytes/s
    # Multi-device instances (backends/enginesim/parallel.py): how many devices share one server's NVLink
    # domain, the latency of one hop on that link, and each device's share of the network between servers.
    devices_per_node: int = 8
    link_latency_s: float = LINK_LATENCY_S  # one hop of a collective on the device ↔ device link, seconds
    net_bw: float = NET_BW  # this device's network bandwidth to other servers, one direction, bytes/s
    net_latency_s: float = NET_LATENCY_S  # one hop across the network, seconds
    # Kernel times measured on this device (docs/gpu-truth.md; 0 = not measured: the plain roofline). With them,
    # engine-sim costs a dense model's step kernel by kernel (backends/enginesim/operators.py).
    sms: int = 0  # streaming multiprocessors: GEMM tiles run in waves of one per SM
    gemm_floor_s: float = 0.0  # seconds any GEMM kernel costs on top of its work (launch, prologue, epilogue)
    gemm_mfu: float = 0.0  # share of `flops` a GEMM's whole tiles achieve
    gemm_mbu: float = 0.0  # share of `hbm_bw` a memory-bound GEMM achieves
    eltwise_floor_s: float = 0.0  # seconds any memory-bound kernel (norm, rotary, activation, add) costs
    norm_mbu: float = 0.0  # share of `hbm_bw` an RMS norm streams at
    rope_mbu: float = 0.0  # ... rotary embedding
    act_mbu: float = 0.0  # ... the gated activation
    add_mbu: float = 0.0  # ... the residual add
    collective_latency_s: float = 0.0  # fixed seconds of one all-reduce on top of its hops and bytes
    allreduce_bw: float = 0.0  # all-reduce bus bandwidth, bytes/s: a ring's 2(n − 1)/n of the bytes move at this

    def __post_init__(self):
        for key in ("hbm_bytes", "hbm_bw", "flops", "pcie_bw", "dram_bw", "ssd_bw", "net_bw"):
            if not getattr(self, key) > 0:  # a zero here would divide by zero in every latency
                raise KvbenchError(f"hardware {self.name!r}: {key} must be > 0, got {getattr(self, key)!r}")
        if not isinstance(self.devices_per_node, int) or self.devices_per_node < 1:
            raise KvbenchError(
                f"hardware {self.name!r}: devices_per_node must be a whole number ≥ 1, got {self.devices_per_node!r}"
            )

    @property
    def has_operator_times(self) -> bool:
        """Whether kernel times were measured on this device (the fields above are all set)."""
        keys = ("sms", "gemm_mfu", "gemm_mbu", "norm_mbu", "rope_mbu", "act_mbu", "add_mbu", "allreduce_bw")
        return all(getattr(self, k) > 0 for k in keys)

    def flops_for(self, dtype: str) -> float:
        """FLOP/s of the matrix units for operands of `dtype` (fp8 where supported; everything else runs as bf16:
        int4/fp4 weight-only formats are dequantized before the multiply)."""
        return self.flops_fp8 if dtype == "fp8" and self.flops_fp8 else self.flops

    @property
    def host_to_device_bw(self) -> float:
        """DRAM ↔ HBM bytes/s, one direction: the slower of the DRAM itself and the PCIe link."""
        return min(self.dram_bw, self.pcie_bw)

    @property
    def ssd_to_device_bw(self) -> float:
        """SSD → HBM bytes/s: bounce buffer or GPUDirect Storage, the data crosses PCIe either way."""
        return min(self.ssd_bw, self.pcie_bw)

    @property
    def peer_bw(self) -> float:
        """Device ↔ device bytes/s, one direction: NVLink, or PCIe (through the host) when there is none."""
        return self.nvlink_bw or self.pcie_bw


# Kernel terms of a GH100 (H100/H200 SXM) in a DGX/HGX server, fitted by `python benchmarks/gpu_truth.py --fit` on
# operator times measured on real H100s and published with the Vidur simulator (microsoft/vidur, data/profiling,
# MIT licence): every linear-layer kernel of Llama-2-7B and -70B at 1–4,096 tokens and TP 1–8, and NCCL
# all-reduce of 2 KB–64 MB on 2, 4 and 8 GPUs of a DGX H100. docs/gpu-truth.md has the fit's errors.
GH100_KERNELS = dict(
    sms=132, gemm_floor_s=6.0e-6, gemm_mfu=0.706, gemm_mbu=0.86, eltwise_floor_s=1.36e-6, norm_mbu=0.393,
    rope_mbu=0.497, act_mbu=0.564, add_mbu=1.0, collective_latency_s=18.3e-6, link_latency_s=0.79e-6,
    allreduce_bw=328.5e9,
)

# Vendor datasheets; Tensor Core numbers there are "with sparsity" and halved here to the dense rate.
HARDWARE = {
    h.name: h
    for h in (
        # NVIDIA H100 Tensor Core GPU datasheet, SXM5 80 GB: HBM3 3.35 TB/s; BF16 1,979 / FP8 3,958 TFLOPS sparse;
        # NVLink 900 GB/s; PCIe Gen5 128 GB/s (both directions); 132 SMs. Kernel times: GH100_KERNELS.
        Hardware(
            "h100", hbm_bytes=80e9, hbm_bw=3.35e12, flops=989.5e12, flops_fp8=1979e12, pcie_bw=64e9, nvlink_bw=450e9,
            **GH100_KERNELS,
        ),
        # NVIDIA H200 datasheet, SXM 141 GB: HBM3e 4.8 TB/s; same GH100 compute, NVLink and PCIe as the H100, so the
        # same kernel terms (their bandwidth shares taken to hold at the faster memory: an assumption, unmeasured)
        Hardware(
            "h200", hbm_bytes=141e9, hbm_bw=4.8e12, flops=989.5e12, flops_fp8=1979e12, pcie_bw=64e9, nvlink_bw=450e9,
            **GH100_KERNELS,
        ),
        # NVIDIA HGX B200 datasheet, per GPU: 180 GB HBM3e at 7.7 TB/s; BF16 4.5 / FP8 9 PFLOPS sparse;
        # NVLink 5 1.8 TB/s; PCIe Gen5 128 GB/s (both directions)
        Hardware(
            "b200", hbm_bytes=180e9, hbm_bw=7.7e12, flops=2.25e15, flops_fp8=4.5e15, pcie_bw=64e9, nvlink_bw=900e9
        ),
        # NVIDIA A100 Tensor Core GPU datasheet, SXM4 80 GB: HBM2e 2,039 GB/s; BF16 312 TFLOPS dense (624 sparse),
        # no fp8; NVLink 600 GB/s; PCIe Gen4 64 GB/s (both directions)
        # (DGX A100: one 200 Gb/s HDR NIC per GPU, 25 GB/s one way)
        Hardware("a100", hbm_bytes=80e9, hbm_bw=2.039e12, flops=312e12, pcie_bw=32e9, nvlink_bw=300e9, net_bw=25e9),
        # NVIDIA L40S datasheet: 48 GB GDDR6 at 864 GB/s; BF16 362.05 / FP8 733 TFLOPS dense; PCIe Gen4 x16 64 GB/s
        # bidirectional; no NVLink
        Hardware("l40s", hbm_bytes=48e9, hbm_bw=864e9, flops=362.05e12, flops_fp8=733e12, pcie_bw=32e9),
        # The 2-core development VM (AMD EPYC Zen 3, 24 GiB) serving kvbench-tiny with the vLLM CPU engine.
        # flops: peak, 2 cores × 2.45 GHz × 32 fp32 FLOP/cycle (two 256-bit AVX2 FMA pipes); no bf16 units, so
        # bf16 runs at the fp32 rate (OpenBLAS sgemm sustains ~21 GFLOP/s on this shared VM). Memory: a numpy copy
        # sustains ~9 GB/s here; a host ↔ "device" move is a memcpy within that same DRAM. SSD: a virtio disk,
        # assumed 1 GB/s, not measured. Rough by design: a calibration file replaces these terms.
        # One "device" per machine; other machines over an assumed 10 Gb/s Ethernet (1.25 GB/s, 50 µs).
        Hardware(
            "cpu",
            hbm_bytes=24e9,
            hbm_bw=10e9,
            flops=157e9,
            pcie_bw=10e9,
            dram_bw=10e9,
            ssd_bw=1e9,
            devices_per_node=1,
            net_bw=1.25e9,
            net_latency_s=50e-6,
        ),  # fmt: skip
    )
}


@dataclass(frozen=True)
class WeightSplit:
    """Where a model's parameters sit, for splitting them over devices: the attention projections (replicated by
    data-parallel attention), the routed experts of a mixture-of-experts (spread by expert parallelism), and
    the rest (dense MLPs, shared experts, embeddings, norms: split by tensor parallelism). Plain counts."""

    attention_params: int
    routed_expert_params: int = 0  # every routed expert of every MoE layer together
    experts: int = 0  # routed experts per MoE layer
    experts_per_token: int = 0  # routed experts one token runs through per MoE layer
    moe_layers: int = 0  # layers whose MLP is a mixture of experts (the others are dense)

    @property
    def moe(self) -> bool:
        return self.experts > 0


# Splits that the geometry cannot give (weight_split below derives a GQA model's). deepseek-ai/DeepSeek-V3
# config.json: hidden 7168, 61 layers of which the first 3 are dense (first_k_dense_replace), 256 routed experts
# of moe_intermediate_size 2048 (gate, up, down: 3 × 7168 × 2048 each) with 8 per token, 128 heads; MLA
# projections per layer: q_a 7168 × 1536, q_b 1536 × 128·192, kv_a 7168 × 576, kv_b 512 × 128·256,
# o 128·128 × 7168, and the q_a / kv_a norms (1536 + 512) = 187,107,328.
WEIGHT_SPLITS = {
    "deepseek-v3": WeightSplit(
        attention_params=61 * 187_107_328,
        routed_expert_params=58 * 256 * 3 * 7168 * 2048,
        experts=256,
        experts_per_token=8,
        moe_layers=58,
    ),
}


def weight_split(model: ModelGeometry) -> WeightSplit:
    """The model's split: its WEIGHT_SPLITS entry, or for a grouped-query model the Q, K, V and O projections
    (hidden × heads·head_dim twice, hidden × kv_heads·head_dim twice, every layer) and no routed experts."""
    if model.name in WEIGHT_SPLITS:
        return WEIGHT_SPLITS[model.name]
    per_layer = model.hidden * (2 * model.heads * model.attn_head_dim + 2 * model.kv_heads * model.head_dim)
    return WeightSplit(attention_params=min(model.layers * per_layer, model.params))


@dataclass(frozen=True)
class Deployment:
    """A multi-device instance people run: `kvbench replay --backend engine-sim --deployment NAME` sets these
    (options given explicitly win). tp × pp devices per instance; ep and dp_attention group the tp devices of a
    pipeline stage (backends/enginesim/parallel.py)."""

    name: str
    model: str
    hardware: str
    tp: int = 1
    pp: int = 1
    ep: int = 1
    dp_attention: int = 1
    weight_dtype: str = "bf16"
    why: str = ""  # who runs it this way


DEPLOYMENTS = {
    d.name: d
    for d in (
        Deployment("llama3-70b-4xh100", "llama3-70b", "h100", tp=4, why="vLLM's and Lambda's 70B benchmark setup"),
        Deployment("llama3-70b-8xh100", "llama3-70b", "h100", tp=8, why="one HGX H100 server per instance"),
        Deployment("llama3-70b-2xh200", "llama3-70b", "h200", tp=2, why="bf16 70B on the fewest H200s"),
        Deployment(
            "llama3-405b-8xh100-fp8", "llama3-405b", "h100", tp=8, weight_dtype="fp8",
            why="Meta's FP8 405B release, sized for one 8-GPU server",
        ),
        Deployment(
            "llama3-405b-2x8xh100", "llama3-405b", "h100", tp=8, pp=2,
            why="bf16 405B: TP within a server, PP across two",
        ),
        Deployment(
            "deepseek-v3-8xh200", "deepseek-v3", "h200", tp=8, ep=8, dp_attention=8, weight_dtype="fp8",
            why="SGLang's single-node H200 recipe (fp8 weights, DP attention, EP MoE)",
        ),
        Deployment(
            "deepseek-v3-2x8xh200", "deepseek-v3", "h200", tp=16, ep=16, dp_attention=16, weight_dtype="fp8",
            why="two H200 servers as one instance: DP attention, EP over 16 devices",
        ),
        Deployment(
            "deepseek-v3-8xb200", "deepseek-v3", "b200", tp=8, ep=8, dp_attention=8, weight_dtype="fp8",
            why="one HGX B200 server",
        ),
    )
}  # fmt: skip


@dataclass
class Specs:
    """Hardware and models after a TOML file's overrides; `source` names the file (None: presets only)."""

    hardware: dict[str, Hardware] = field(default_factory=lambda: dict(HARDWARE))
    models: dict[str, ModelGeometry] = field(default_factory=lambda: dict(MODELS))
    source: str | None = None
    file_hardware: tuple[str, ...] = ()  # the names the file has tables for, in its order
    file_models: tuple[str, ...] = ()


# Fields a dense preset derives from another when left unset (ModelGeometry.__post_init__): an override of the
# source field must re-derive them instead of keeping the preset's old value.
_DERIVED = {"active_params": "params", "attn_head_dim": "head_dim"}


def load_specs(path: str | Path) -> Specs:
    """Presets with the [hardware.NAME] and [model.NAME] tables of the TOML file at `path` applied on top:
    a known NAME overrides the fields given, a new NAME must give every field without a default."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except OSError as e:
        raise KvbenchError(f"{path}: cannot read the specs file ({e.strerror or e})") from None
    except tomllib.TOMLDecodeError as e:
        raise KvbenchError(f"{path}: not valid TOML ({e})") from None
    specs = Specs(source=str(path))
    for section in data:
        if section not in ("hardware", "model"):
            raise KvbenchError(f"{path}: unknown table [{section}]; use [hardware.NAME] or [model.NAME]")
    for name, table in _tables(path, data, "hardware"):
        specs.hardware[name] = _build(path, "hardware", name, table, Hardware, specs.hardware.get(name))
        specs.file_hardware += (name,)
    for name, table in _tables(path, data, "model"):
        specs.models[name] = _build(path, "model", name, table, ModelGeometry, specs.models.get(name))
        specs.file_models += (name,)
    return specs


def _tables(path: Path, data: dict, section: str):
    group = data.get(section, {})
    if not isinstance(group, dict):
        raise KvbenchError(f"{path}: {section} must be tables, e.g. [{section}.NAME]")
    for name, table in group.items():
        if not isinstance(table, dict):
            raise KvbenchError(f"{path}: {section}.{name} must be a table [{section}.{name}], not a value")
        yield name, table


def _build(path: Path, section: str, name: str, table: dict, cls, preset):
    where = f"{path}: [{section}.{name}]"
    fields = {f.name: f for f in dataclasses.fields(cls) if f.name != "name"}
    values = {}
    for key, value in table.items():
        if key not in fields:
            raise KvbenchError(f"{where}: unknown key {key!r}; known keys: {', '.join(fields)}")
        values[key] = _coerce(where, key, value, fields[key].type)
    if preset is None:
        missing = [k for k, f in fields.items() if f.default is dataclasses.MISSING and k not in values]
        if missing:
            raise KvbenchError(f"{where}: a new {section} needs {', '.join(missing)}")
    else:
        for derived, source in _DERIVED.items():
            unset = derived in fields and source in values and derived not in values
            if unset and getattr(preset, derived) == getattr(preset, source):
                values[derived] = 0
    try:
        return cls(name=name, **values) if preset is None else dataclasses.replace(preset, **values)
    except KvbenchError as e:  # the dataclass's own checks, e.g. active_params > params
        raise KvbenchError(f"{where}: {e}") from None


def _coerce(where: str, key: str, value, annotation: str):
    # Annotations are strings here (from __future__ import annotations): 'int', 'float' or 'bool'.
    if annotation == "bool":
        if not isinstance(value, bool):
            raise KvbenchError(f"{where}: {key} must be true or false, got {value!r}")
        return value
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise KvbenchError(f"{where}: {key} must be a number ≥ 0, got {value!r}")
    if annotation == "int":
        if value != int(value):
            raise KvbenchError(f"{where}: {key} must be a whole number, got {value!r}")
        return int(value)
    return float(value)


def _specs(toml: str | Path | Specs | None) -> Specs:
    if isinstance(toml, Specs):
        return toml
    return Specs() if toml is None else load_specs(toml)


def _resolve(kind: str, option: str, name: str | None, table: dict, in_file: tuple[str, ...], source: str | None):
    if name is None:
        if len(in_file) == 1:  # a specs file that describes one machine (or one model) needs no flag to pick it
            return table[in_file[0]]
        raise KvbenchError(f"no {kind} given; pass {option} (one of: {', '.join(table)})")
    for key in (name, name.lower()):
        if key in table:
            return table[key]
    where = f" in the presets and {source}" if source else f" (add a [{kind}.{name}] table to a specs file)"
    raise KvbenchError(f"unknown {kind} {name!r}{where}; choose one of: {', '.join(table)}")


def resolve_hardware(name: str | None, toml: str | Path | Specs | None = None) -> Hardware:
    """The hardware called `name` among the presets and the specs file `toml`; with no name, the one hardware
    the file has a table for. Errors list the choices."""
    specs = _specs(toml)
    return _resolve("hardware", "--hardware", name, specs.hardware, specs.file_hardware, specs.source)


def resolve_model(name: str | None, toml: str | Path | Specs | None = None) -> ModelGeometry:
    """The model called `name` among the presets and the specs file `toml`; with no name, the one model the file
    has a table for. Errors list the choices."""
    specs = _specs(toml)
    return _resolve("model", "--model", name, specs.models, specs.file_models, specs.source)
