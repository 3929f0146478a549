"""What the measured transfer rates are worth: each direction beside a same-process baseline (one contiguous
copy of the same size between the same kinds of memory) and beside the hardware's datasheet peak, and a sweep
of rates over block sizes (`benchmarks/torch_bandwidth.py`, `benchmarks/gpu_check.sh`)."""

from __future__ import annotations

import os
import tempfile
import time

import torch

from kvbench.hardware import HARDWARE, Hardware

BASELINE_CAP = 256 << 20  # bytes: a larger batch is measured at this size (the rate has flattened by then)


def hardware_for(device: torch.device, name: str | None = None) -> Hardware:
    """The named preset, or the one matching the CUDA device's name, or the CPU preset."""
    if name:
        return HARDWARE[name]
    if device.type == "cuda":
        gpu = torch.cuda.get_device_name(device).lower()
        for preset in HARDWARE:
            if preset != "cpu" and preset in gpu:
                return HARDWARE[preset]
    return HARDWARE["cpu"]


def peak_bytes_per_s(direction: str, hw: Hardware, cuda: bool) -> float:
    """Datasheet peak of one direction `src->dst` (tier names hbm, dram, ssd)."""
    src, dst = direction.split("->")
    if "ssd" in (src, dst):
        return hw.ssd_to_device_bw if "hbm" in (src, dst) else hw.ssd_bw
    if src == dst == "hbm":
        return hw.hbm_bw / 2  # a device-to-device copy reads and writes the same memory
    return hw.host_to_device_bw if cuda else hw.dram_bw / 2


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_of(fn, device, repeats: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter_ns()
        fn()
        _sync(device)
        best = min(best, (time.perf_counter_ns() - t0) / 1e9)
    return best


def baseline_bytes_per_s(direction: str, nbytes: int, device: torch.device, disk_dir: str | None = None) -> float:
    """Rate of one contiguous copy of `nbytes` (at most BASELINE_CAP) along `direction`, in this process."""
    nbytes = max(4096, min(int(nbytes), BASELINE_CAP))
    src, dst = direction.split("->")
    place = {"hbm": device, "dram": torch.device("cpu")}
    pin = device.type == "cuda"
    if "ssd" not in (src, dst):
        a = torch.empty(nbytes, dtype=torch.uint8, device=place[src], pin_memory=pin and src == "dram")
        b = torch.empty(nbytes, dtype=torch.uint8, device=place[dst], pin_memory=pin and dst == "dram")
        return nbytes / _best_of(lambda: b.copy_(a, non_blocking=pin), device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    view = memoryview(host.numpy())
    with tempfile.TemporaryDirectory(dir=disk_dir) as tmp:
        fd = os.open(os.path.join(tmp, "baseline.kv"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.pwrite(fd, view, 0)
            if dst == "ssd":
                return nbytes / _best_of(lambda: os.pwrite(fd, view, 0), device)
            return nbytes / _best_of(lambda: os.preadv(fd, [view], 0), device)
        finally:
            os.close(fd)


def transfer_report(traffic: dict, device: torch.device, hw: Hardware, disk_dir: str | None) -> dict:
    """Per direction: bytes, blocks, copies, seconds, GB/s, the baseline's GB/s at the mean batch size, the
    efficiency against it and against the datasheet peak."""
    out = {}
    for direction, t in sorted(traffic.items()):
        row = t.summary()
        if t.bytes and t.seconds > 0:
            base = baseline_bytes_per_s(direction, t.bytes / t.calls, device, disk_dir)
            peak = peak_bytes_per_s(direction, hw, device.type == "cuda")
            rate = t.bytes / t.seconds
            row.update(
                baseline_gb_per_s=base / 1e9,
                vs_baseline=rate / base,
                peak_gb_per_s=peak / 1e9,
                vs_peak=rate / peak,
                hardware=hw.name,
            )
        out[direction] = row
    return out
