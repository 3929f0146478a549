"""`torch`: the trace's block stream against real KV tensors (docs/architecture.md, Built-in backends). The
device pool is real memory on the GPU (or the CPU), the tiers below are pinned host memory and a file on disk,
every load, eviction and write-back is a timed copy, and with `--compute` each request's prefill and decode run
real attention over the paged cache. The cache policies are the `sim` backend's own, so its counts equal
sim's."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator

import click
import pyarrow as pa
from kvbench.backends.sim import parse_policy_options, policy_option_params

from kvbench.cache import policies as _policies
from kvbench.cache.capacity import MODELS, check_capacities, parse_capacities, parse_capacity
from kvbench.cache.prepared import prepare
from kvbench.errors import KvbenchError
from kvbench.hardware import HARDWARE
from kvbench.run.backend import PointResult, Progress
from kvbench.trace.files import TraceMeta

COPY_MODES = ("block", "coalesced", "staged")
KV_DTYPES = ("auto", "bf16", "fp16", "fp32", "fp8")


def _size(flag: str, help: str) -> click.Option:
    return click.Option([flag], default="0", show_default=True, help=help)


class TorchBackend:
    name = "torch"
    kind = "offline"  # kvbench.run.backend.OfflineBackend

    @classmethod
    def cli_options(cls) -> list[click.Option]:
        return [
            click.Option(
                ["--device"],
                type=click.Choice(["auto", "cpu", "cuda"]),
                default="auto",
                show_default=True,
                help="where the HBM pool lives: cuda when a GPU is present (auto), else cpu",
            ),
            click.Option(
                ["--policy"],
                default="lru",
                show_default=True,
                help=f"HBM eviction policy (the sim backend's), or several separated by commas: "
                f"{', '.join(_policies.registry())}",
            ),
            click.Option(
                ["--capacity"],
                help="HBM pool size(s), comma-separated: blocks (10000), tokens (5M tok) or bytes (2GiB); "
                "a list makes a sweep",
            ),
            _size("--host-capacity", "host DRAM tier below HBM: blocks, tokens or bytes; 0 = no DRAM tier"),
            _size("--disk-capacity", "disk tier below DRAM: blocks, tokens or bytes; 0 = no disk tier"),
            click.Option(
                ["--disk-dir"],
                default=tempfile.gettempdir(),
                show_default=True,
                help="directory of the disk tier's file (put it on the SSD to measure)",
            ),
            click.Option(
                ["--disk-sync/--no-disk-sync"],
                default=False,
                show_default=True,
                help="fdatasync each disk write and drop it from the page cache, so reads come from the drive",
            ),
            click.Option(
                ["--write-through/--write-back"],
                default=False,
                show_default=True,
                help="write every block HBM admits to DRAM at once, or only the blocks HBM evicts",
            ),
            click.Option(
                ["--copy-mode"],
                type=click.Choice(COPY_MODES),
                default="coalesced",
                show_default=True,
                help="block: one copy per block; coalesced: one copy per run of consecutive slots; "
                "staged: gather into a contiguous staging buffer, one copy, scatter",
            ),
            click.Option(
                ["--layout"],
                type=click.Choice(["block_major", "layer_first"]),
                default="block_major",
                show_default=True,
                help="HBM pool layout: block_major [blocks, layers, kv, tokens, heads, dim] keeps a block "
                "contiguous; layer_first [layers, kv, blocks, …] is vLLM's per-layer layout",
            ),
            click.Option(
                ["--model"],
                type=click.Choice(list(MODELS)),
                default="kvbench-tiny",
                show_default=True,
                help="model geometry: layers, KV heads and head dim set the bytes per block",
            ),
            click.Option(
                ["--kv-dtype"],
                type=click.Choice(KV_DTYPES),
                default="auto",
                show_default=True,
                help="KV element type; auto: bf16 on CUDA, fp32 on CPU (CPUs without bf16 units run it slowly)",
            ),
            click.Option(
                ["--compute/--no-compute"],
                default=False,
                show_default=True,
                help="run real attention: prefill of the uncached tokens over the cached pages and decode "
                "steps, giving measured TTFT/TPOT (s)",
            ),
            click.Option(
                ["--decode-steps"],
                default="auto",
                show_default=True,
                help="decode steps timed per request: all, or N spread evenly over the output (TPOT is their "
                "mean); auto: all on CUDA, 8 on CPU",
            ),
            click.Option(
                ["--verify/--no-verify"],
                default=False,
                show_default=True,
                help="checksum every block when it is produced and check it on every load (slower)",
            ),
            click.Option(
                ["--hardware"],
                type=click.Choice(list(HARDWARE)),
                default=None,
                help="datasheet whose peak bandwidths the transfer report compares with [default: the "
                "detected GPU, or cpu]",
            ),
            click.Option(
                ["--threads"],
                type=click.IntRange(0),
                default=0,
                show_default=True,
                help="CPU threads for torch (0: 1 without --compute, since block copies are memory-bound and a "
                "second thread mostly adds wake-up stalls; every core with --compute, for the attention)",
            ),
            click.Option(["--salt/--no-salt"], default=True, show_default=True, help="fold cache_salt into keys"),
            click.Option(["--share-lora-kv"], is_flag=True, default=False, help="let different LoRA adapters share KV"),
            *policy_option_params(),
        ]

    def __init__(
        self,
        device="auto",
        policy="lru",
        capacity=None,
        host_capacity="0",
        disk_capacity="0",
        disk_dir=None,
        disk_sync=False,
        write_through=False,
        copy_mode="coalesced",
        layout="block_major",
        model="kvbench-tiny",
        kv_dtype="auto",
        compute=False,
        decode_steps="auto",
        verify=False,
        hardware=None,
        threads=0,
        salt=True,
        share_lora_kv=False,
        **policy_options,
    ):
        import torch

        if capacity is None:
            raise KvbenchError("give --capacity: the HBM pool in blocks, tokens or bytes (e.g. 20000 or 1GiB)")
        if device == "cuda" and not torch.cuda.is_available():
            raise KvbenchError("--device cuda: no CUDA device here; use --device cpu (or auto)")
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.policies = _policies.parse_names(policy)
        if copy_mode not in COPY_MODES:
            raise KvbenchError(f"--copy-mode {copy_mode!r}: choose {', '.join(COPY_MODES)}")
        self.kv_dtype = ("bf16" if self.device.type == "cuda" else "fp32") if kv_dtype == "auto" else kv_dtype
        self.decode_steps = _decode_steps(decode_steps, self.device.type)
        self.capacity, self.host_capacity, self.disk_capacity = capacity, str(host_capacity), str(disk_capacity)
        self.disk_dir, self.disk_sync, self.write_through = disk_dir or tempfile.gettempdir(), disk_sync, write_through
        self.copy_mode, self.layout, self.model = copy_mode, layout, model
        self.compute, self.verify, self.hardware = compute, verify, hardware
        self.threads = threads or (torch.get_num_threads() if compute else 1)
        self.salt, self.share_lora_kv = salt, share_lora_kv
        self.policy_options = parse_policy_options(policy_options, self.policies)  # refuses options none takes
        check_capacities(capacity, model, self.kv_dtype)  # before any replay (less than a block waits for the trace)

    def config(self) -> dict:
        return {
            "device": str(self.device),
            "policies": self.policies,
            "capacity": self.capacity,
            "host_capacity": self.host_capacity,
            "disk_capacity": self.disk_capacity,
            "disk_sync": self.disk_sync,
            "write_through": self.write_through,
            "copy_mode": self.copy_mode,
            "layout": self.layout,
            "model": self.model,
            "kv_dtype": self.kv_dtype,
            "compute": self.compute,
            "decode_steps": self.decode_steps or "all",
            "verify": self.verify,
            "threads": self.threads,
            "salt": self.salt,
            "share_lora_kv": self.share_lora_kv,
            "policy_options": self.policy_options,
        }

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
        dram, ssd = (self._blocks(text, bs) for text in (self.host_capacity, self.disk_capacity))
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
                label = "/".join(map(str, labels.values()))

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
