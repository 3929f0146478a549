"""`torch`: the trace's block stream against real KV tensors (docs/architecture.md, Built-in backends). The
device pool is real memory on the GPU (or the CPU), the tiers below are pinned host memory and a file on disk,
every load, eviction and write-back is a timed copy, and with `--compute` each request's prefill and decode run
real attention over the paged cache. The cache policies are the `sim` backend's own, so its counts equal
sim's."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

import click
import pyarrow as pa

from kvbench import options
from kvbench.cache import policies as _policies
from kvbench.cache.capacity import check_capacities, parse_capacities, parse_capacity
from kvbench.cache.policy_options import parse_policy_options, policy_option_params
from kvbench.cache.prepared import prepare
from kvbench.errors import KvbenchError
from kvbench.models import HARDWARE, MODELS
from kvbench.options import option
from kvbench.run.backend import PointResult, Progress
from kvbench.run.pointnames import point_name
from kvbench.trace.files import TraceMeta

COPY_MODES = ("block", "coalesced", "staged")
KV_DTYPES = ("auto", "bf16", "fp16", "fp32", "fp8")


def _size(default: str, help: str, **kwargs):
    return option(default, help, unit="blocks, tokens or bytes", **kwargs)


@dataclass
class TorchConfig:
    """The options of `kvbench replay --backend torch` (kvbench.options): flags, help, config() keys."""

    device: str = option(
        "auto", "where the HBM pool lives: cuda when a GPU is present (auto), else cpu", unit="name",
        type=click.Choice(["auto", "cpu", "cuda"]),
    )  # fmt: skip
    policy: str = option(
        "lru",
        lambda: (
            "HBM eviction policy (the sim backend's), or several separated by commas: "
            + ", ".join(_policies.registry())
        ),
        unit="name(s)",
        key="policies",
    )
    capacity: str | None = _size(None, "HBM pool size(s), comma-separated: 10000, 5M tok or 2GiB; a list makes a sweep")
    dram_capacity: str = _size("0", "host DRAM tier below HBM (pinned host memory); 0 = none")
    ssd_capacity: str = _size("0", "local SSD tier below DRAM (a file in --disk-dir); 0 = none")
    disk_dir: str = option(
        tempfile.gettempdir(), "directory of the SSD tier's file (put it on the SSD to measure)", unit="path"
    )
    disk_sync: bool = option(
        False, "fdatasync each SSD-tier write and drop it from the page cache, so reads come from the drive",
        unit="on/off", flag="--disk-sync/--no-disk-sync",
    )  # fmt: skip
    write_through: bool = option(
        False, "write every block HBM admits to DRAM at once, or only the blocks HBM evicts", unit="on/off",
        flag="--write-through/--write-back",
    )  # fmt: skip
    copy_mode: str = option(
        "coalesced",
        "block: one copy per block; coalesced: one copy per run of consecutive slots; staged: gather into a "
        "contiguous staging buffer, one copy, scatter",
        unit="name",
        type=click.Choice(COPY_MODES),
    )
    layout: str = option(
        "block_major",
        "HBM pool layout: block_major [blocks, layers, kv, tokens, heads, dim] keeps a block contiguous; "
        "layer_first [layers, kv, blocks, …] is vLLM's per-layer layout",
        unit="name",
        type=click.Choice(["block_major", "layer_first"]),
    )
    model: str = option(
        "kvbench-tiny", "model geometry preset: layers, KV heads and head dim set the bytes per block", unit="name",
        type=click.Choice(list(MODELS)),
    )  # fmt: skip
    kv_dtype: str = option(
        "auto", "KV element type; auto: bf16 on CUDA, fp32 on CPU (CPUs without bf16 units run it slowly)",
        unit="name", type=click.Choice(KV_DTYPES),
    )  # fmt: skip
    compute: bool = option(
        False,
        "run real attention: prefill of the uncached tokens over the cached pages and decode steps, giving "
        "measured TTFT/TPOT (s)",
        unit="on/off",
        flag="--compute/--no-compute",
    )
    decode_steps: str = option(
        "auto",
        "decode steps timed per request: all, or N spread evenly over the output (TPOT is their mean); auto: all "
        "on CUDA, 8 on CPU",
        unit="steps",
    )
    verify: bool = option(
        False, "checksum every block when it is produced and check it on every load (slower)", unit="on/off",
        flag="--verify/--no-verify",
    )  # fmt: skip
    hardware: str | None = option(
        None,
        "datasheet whose peak bandwidths the transfer report compares with [default: the detected GPU, or cpu]",
        unit="name",
        type=click.Choice(list(HARDWARE)),
    )
    threads: int = option(
        0,
        "CPU threads for torch (0: 1 without --compute, since block copies are memory-bound and a second thread "
        "mostly adds wake-up stalls; every core with --compute, for the attention)",
        unit="threads",
        type=click.IntRange(0),
    )
    salt: bool = option(True, "fold cache_salt into keys", unit="on/off", flag="--salt/--no-salt")
    share_lora_kv: bool = option(False, "let different LoRA adapters share KV", unit="on/off", is_flag=True)


class TorchBackend:
    name = "torch"
    kind = "offline"  # kvbench.run.backend.OfflineBackend
    Config = TorchConfig

    @classmethod
    def cli_options(cls) -> list[click.Option]:
        return options.cli_options(TorchConfig) + policy_option_params()

    def __init__(self, config: TorchConfig | None = None, **kwargs):
        """`config`, or its fields as keyword arguments; the other keywords are policy options (--quota, …)."""
        import torch

        c, policy_options = options.build(TorchConfig, config, kwargs)
        self.options = c
        if c.capacity is None:
            raise KvbenchError("give --capacity: the HBM pool in blocks, tokens or bytes (e.g. 20000 or 1GiB)")
        if c.device == "cuda" and not torch.cuda.is_available():
            raise KvbenchError("--device cuda: no CUDA device here; use --device cpu (or auto)")
        device = ("cuda" if torch.cuda.is_available() else "cpu") if c.device == "auto" else c.device
        self.device = torch.device(device)
        self.policies = _policies.parse_names(c.policy)
        for name in self.policies:  # refused before any run directory exists
            if not _policies.get(name).blocks:
                raise KvbenchError(
                    f"--policy {name} keeps token sequences, not blocks, so the torch backend cannot store its KV "
                    "block by block; replay it with --backend sim or --backend engine-sim"
                )
        if c.copy_mode not in COPY_MODES:
            raise KvbenchError(f"--copy-mode {c.copy_mode!r}: choose {', '.join(COPY_MODES)}")
        self.kv_dtype = ("bf16" if self.device.type == "cuda" else "fp32") if c.kv_dtype == "auto" else c.kv_dtype
        self.decode_steps = _decode_steps(c.decode_steps, self.device.type)
        self.capacity, self.dram_capacity, self.ssd_capacity = c.capacity, str(c.dram_capacity), str(c.ssd_capacity)
        self.disk_dir, self.disk_sync, self.write_through = (
            c.disk_dir or tempfile.gettempdir(),
            c.disk_sync,
            c.write_through,
        )
        self.copy_mode, self.layout, self.model = c.copy_mode, c.layout, c.model
        self.compute, self.verify, self.hardware = c.compute, c.verify, c.hardware
        self.threads = c.threads or (torch.get_num_threads() if c.compute else 1)
        self.salt, self.share_lora_kv = c.salt, c.share_lora_kv
        self.policy_options = parse_policy_options(policy_options, self.policies)  # refuses options none takes
        check_capacities(
            c.capacity, c.model, self.kv_dtype
        )  # before any replay (less than a block waits for the trace)

    def config(self) -> dict:
        return options.record(
            self.options,
            device=str(self.device),
            policy=self.policies,
            dram_capacity=self.dram_capacity,
            ssd_capacity=self.ssd_capacity,
            disk_dir=self.disk_dir,
            kv_dtype=self.kv_dtype,
            decode_steps=self.decode_steps or "all",
            threads=self.threads,
            policy_options=self.policy_options,
        )

    def replay(self, trace: pa.Table, meta: TraceMeta, progress=None) -> Iterator[PointResult]:
        """`progress`: called with a kvbench.run.backend.Progress as requests finish."""
        import torch

        before = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            yield from self._points(trace, meta, progress)
        finally:
            torch.set_num_threads(before)

    def _points(self, trace: pa.Table, meta: TraceMeta, on_progress) -> Iterator[PointResult]:
        from kvbench.backends.torchkv.geometry import KvGeometry
        from kvbench.backends.torchkv.replayer import PointReplay, Settings

        bs = meta.block_size
        geometry = KvGeometry.named(self.model, bs, self.kv_dtype, self.layout)
        caps = parse_capacities(self.capacity, bs, self.model, self.kv_dtype)
        dram, ssd = (self._blocks(text, bs) for text in (self.dram_capacity, self.ssd_capacity))
        filled = {c for c in trace.column_names if trace.column(c).null_count < trace.num_rows}
        for name in self.policies:
            pol = _policies.get(name)
            if pol.cache is None:
                raise KvbenchError(f"policy {name} has no per-request form the torch backend can drive")
            for col in pol.needs:
                if col not in filled:
                    raise KvbenchError(f"policy {name} needs the trace column {col!r}, which is empty in this trace")
            prep = prepare(trace, bs, use_salt=self.salt, share_lora=self.share_lora_kv, vllm_cap=name == "vllm")
            for cap in caps:
                settings = Settings(
                    self.device, cap.blocks, dram, ssd, self.disk_dir, self.disk_sync, self.write_through,
                    self.copy_mode, self.compute, self.decode_steps, self.verify, self.hardware,
                )  # fmt: skip
                labels = {"policy": name, "capacity_blocks": cap.blocks}
                label = point_name(labels)

                def progress(done, total, label=label):
                    if on_progress is not None:
                        on_progress(Progress(done, total, f"torch {label}"))

                run = PointReplay(
                    settings, geometry, prep, trace, pol.cache(prep, cap.blocks, self.policy_options), progress
                )
                point = run.run(labels)
                point.extra["capacity"] = cap.text
                yield point

    def _blocks(self, text: str, bs: int) -> int:
        if str(text).strip() in ("", "0"):
            return 0
        return parse_capacity(text, bs, self.model, self.kv_dtype).blocks


def _decode_steps(text, device_type: str) -> int:
    """0 = every step."""
    text = str(text).strip().lower()
    if text == "auto":
        return 0 if device_type == "cuda" else 8
    if text == "all":
        return 0
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise KvbenchError(f"--decode-steps {text!r}: write all, auto or a number of steps ≥ 1")
    return n
