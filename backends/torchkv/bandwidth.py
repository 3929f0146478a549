"""What the measured transfer rates are worth: each direction beside a same-process baseline (one contiguous
copy of the same size between the same kinds of memory) and beside the hardware's datasheet peak, and a sweep
of rates over block sizes (`benchmarks/torch_bandwidth.py`, `benchmarks/gpu_check.sh`) with the references it
times in turns with each move (`Contiguous`, `naive_loop`) and the issue-18 targets it checks them against."""

from __future__ import annotations

import os
import statistics
import tempfile
import time

import torch

from kvbench.models import HARDWARE, Hardware

BASELINE_CAP = 256 << 20  # bytes: a larger batch is measured at this size (the rate has flattened by then)
# least vs_contiguous of a coalesced or staged move between HBM and DRAM, by device type (issue 18)
CONTIGUOUS_TARGET = {"cpu": 0.90, "cuda": 0.80}
NAIVE_TARGET = 1.0  # least vs_naive_loop of block mode


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


def naive_loop(src, ss: list[int], dst, ds: list[int]) -> float:
    """Seconds of the plain per-block loop one would write over the same pools and slots, the bar `block` mode
    must clear: `dst.data[d].copy_(src.data[s])` per block (`select` in either layout)."""
    cuda = src.data.device.type == "cuda" or dst.data.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for s, d in zip(ss, ds):
        dst.data.select(dst.dim, d).copy_(src.data.select(src.dim, s))
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0


class Contiguous:
    """One contiguous copy of `nbytes` between the memories of a direction (hbm, dram; pinned host memory on
    CUDA), timed the way the Mover times (CUDA events on the GPU): what a move of the same bytes is compared
    with, in turns."""

    def __init__(self, direction: str, nbytes: int, device: torch.device):
        src, dst = direction.split("->")
        self.cuda = device.type == "cuda"
        place = {"hbm": device, "dram": torch.device("cpu")}
        self.a = torch.empty(nbytes, dtype=torch.uint8, device=place[src], pin_memory=self.cuda and src == "dram")
        self.b = torch.empty(nbytes, dtype=torch.uint8, device=place[dst], pin_memory=self.cuda and dst == "dram")
        self.a.fill_(1)  # fault the pages in: a first touch is not a copy
        self.b.fill_(0)

    def seconds(self) -> float:
        if not self.cuda:
            t0 = time.perf_counter_ns()
            self.b.copy_(self.a)
            return (time.perf_counter_ns() - t0) / 1e9
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        self.b.copy_(self.a, non_blocking=True)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3


def target_of(mode: str, direction: str, device: torch.device) -> tuple[str, float] | None:
    """(the row's field, its least value) that a cell must reach, or None where the issue sets no target."""
    if "ssd" in direction:
        return None
    return ("vs_naive_loop", NAIVE_TARGET) if mode == "block" else ("vs_contiguous", CONTIGUOUS_TARGET[device.type])


class Scrub:
    """Writes a buffer twice the size of a large last-level cache before each timed copy on a CPU, so that every
    copy starts from DRAM: without it the naive loop, run right after the Mover over the same blocks, found them
    in the cache that the contiguous reference copy had just emptied for the Mover."""

    def __init__(self, device: torch.device, nbytes: int = 64 << 20):
        self.buf = torch.ones(nbytes, dtype=torch.uint8) if device.type == "cpu" else None

    def __call__(self) -> None:
        if self.buf is not None:
            self.buf.add_(1)


def target_summary(rows: list[dict]) -> dict:
    """Per mode and slots: the median, least and greatest of the targeted ratio over the cells, and how many cells
    met the bar."""
    groups: dict[str, list[dict]] = {}
    for r in rows:
        if "target" in r:
            groups.setdefault(f"{r['mode']} {r['slots']}", []).append(r)
    out = {}
    for name, rs in groups.items():
        field, bar = rs[0]["target"].split(" >= ")
        values = [r[field] for r in rs]
        out[name] = {"field": field, "bar": float(bar), "cells": len(rs), "cells_met": sum(r["target_met"] for r in rs),
                     "median": statistics.median(values), "min": min(values), "max": max(values),
                     "median_met": statistics.median(values) >= float(bar)}  # fmt: skip
    return out


def target_lines(result: dict, per_cell: bool = True) -> list[str]:
    """A pass/FAIL line per targeted cell of a sweep's result (when `per_cell`), then a line per mode."""
    lines = []
    for r in result["rows"] if per_cell else []:
        if "target" in r:
            field = r["target"].split(" >= ")[0]
            lines.append(
                f"{'pass' if r['target_met'] else 'FAIL'} {r['block_tokens']:>4} tok {r['layout']:11} {r['mode']:9} "
                f"{r['slots']:10} {r['direction']:9} {field} {r[field]:.2f} (target {r['target']})"
            )
    for name, t in result.get("targets", {}).items():
        lines.append(
            f"target {name:22} {t['field']} >= {t['bar']:g}: median {t['median']:.2f} ({t['min']:.2f}-{t['max']:.2f}), "
            f"{t['cells_met']}/{t['cells']} cells pass; median {'met' if t['median_met'] else 'NOT MET'}"
        )
    return lines


def best_by_direction(rows: list[dict]) -> dict:
    out = {}
    for r in rows:
        if r.get("gb_per_s") and (r["direction"] not in out or r["gb_per_s"] > out[r["direction"]]["gb_per_s"]):
            keep = ("gb_per_s", "vs_baseline", "vs_peak", "block_tokens", "layout", "mode", "slots")
            out[r["direction"]] = {k: r[k] for k in keep}
    return out


def fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def print_table(result: dict) -> None:
    """The sweep's rows as a table, then the targets per mode."""
    head = (
        f"{'tok':>4} {'layout':11} {'mode':9} {'slots':10} {'direction':9} {'blocks':>6} {'MiB':>7} "
        f"{'GB/s':>7} {'median':>7} {'base':>7} {'x base':>6} {'peak':>6} {'x peak':>6} ok  x naive x contig target"
    )
    print(head + "\n" + "-" * len(head))
    for r in result["rows"]:
        lead = (
            f"{r['block_tokens']:>4} {r['layout']:11} {r['mode']:9} {r['slots']:10} {r['direction']:9} "
            f"{r['blocks']:>6} {r['batch_bytes'] / 2**20:>7.1f} "
        )
        if "error" in r:
            print(lead + "ERROR " + r["error"])
            continue
        verdict = "" if "target" not in r else "pass" if r["target_met"] else "FAIL"
        print(
            lead + f"{fmt(r['gb_per_s'], '7.2f')} {fmt(r['median_gb_per_s'], '7.2f')} "
            f"{fmt(r['baseline_gb_per_s'], '7.2f')} {fmt(r['vs_baseline'], '6.2f')} {fmt(r['peak_gb_per_s'], '6.1f')} "
            f"{fmt(r['vs_peak'], '6.2f')} {'yes' if r['ok'] else 'NO '} {fmt(r.get('vs_naive_loop'), '7.2f')} "
            f"{fmt(r.get('vs_contiguous'), '8.2f')} {verdict}"
        )
    for line in target_lines(result, per_cell=False):
        print(line)
