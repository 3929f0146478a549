"""KV block transfer rates of the `torch` backend's Mover over block sizes, copy modes, layouts and directions.

    python benchmarks/torch_bandwidth.py [--device auto] [--block-tokens 16,32,64,128,256] [--budget-s 240]
    python benchmarks/torch_bandwidth.py --quick --out /tmp/bw.json     # tiny CPU run (the unit test's)

For each block size (tokens per block) the script allocates the pools a replay uses (the device pool in each
`--layouts` layout, a host DRAM pool, pinned on CUDA and always block-major, and a disk pool file), then for
each copy mode and direction (hbm->dram, dram->hbm, dram->ssd, ssd->dram) moves one batch of blocks with
`Mover.copy`, `--repeats` times after one untimed warm-up, and reports the best and median rate.

The batch goes from scattered source slots to scattered destination slots, drawn at random from pools twice
the batch's size: after a while a cache's free list is in no order, so this is the case a replay sees. The
coalesced mode is also measured from and to contiguous slots (one run: its best case). Each rate is shown
beside the rate of one contiguous copy of the same byte size between the same kinds of memory
(`bandwidth.baseline_bytes_per_s`) and beside the datasheet peak (`bandwidth.peak_bytes_per_s` of the
detected or `--hardware` preset). Block mode between tensor pools is also timed, in turns, against the plain
per-block `copy_` loop one would write over the same pools and slots (`vs_naive_loop`: above 1, the Mover is
faster). Between HBM and DRAM each move is also timed, in turns, against one contiguous copy of the same bytes
between the same kinds of memory (pinned host memory on CUDA: the measured PCIe/NVLink rate), and
`vs_contiguous` is the median of the per-round ratios (one noise for both, where `vs_baseline` compares with a
best-of measured once). After timing, the moved blocks are compared byte for byte (`ok`).

Targets (issue 18), checked per cell (`target`, `target_met`) and summarised per mode (`targets`): block mode at
least as fast as the naive loop (`vs_naive_loop` ≥ 1); coalesced and staged moves between HBM and DRAM at
≥ 90 % of the contiguous copy on a CPU, ≥ 80 % on CUDA. A miss is reported, not an error: the exit status is 0.

The disk tier is read through the page cache unless --disk-sync is given (then writes are fdatasync'ed and
dropped from the cache, and the file is dropped from the cache before each timed read). The sweep stops
before a cell that would run past --budget-s and says so. Results: benchmarks/results/torch_bandwidth-<device>.json.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from kvbench.backends.torchkv.bandwidth import (
    Contiguous,
    Scrub,
    baseline_bytes_per_s,
    best_by_direction,
    hardware_for,
    naive_loop,
    peak_bytes_per_s,
    print_table,
    target_of,
    target_summary,
)
from kvbench.backends.torchkv.geometry import DTYPES, LAYOUTS, KvGeometry
from kvbench.backends.torchkv.pools import DiskPool, TensorPool
from kvbench.backends.torchkv.transfers import COPY_MODES, Mover

from kvbench.models import HARDWARE, MODELS

RESULTS = Path(__file__).parent / "results"
DIRECTIONS = ("hbm->dram", "dram->hbm", "dram->ssd", "ssd->dram")
CONFIG_KEYS = "block_tokens modes layouts directions batch_mib blocks max_blocks repeats disk_dir disk_sync".split()
CONFIG_KEYS += ["budget_s", "seed", "quick"]
MIN_BLOCKS = 4  # a batch of fewer blocks says nothing about scattered slots
# Linux caps one preadv/pwritev at IOV_MAX (1024) buffers and DiskPool passes one buffer per block, so a
# contiguous run longer than this would fail in the disk directions (EINVAL), not measure anything.
MAX_BLOCKS = 1024


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], help="device pool: auto = cuda when present [auto]")
    ap.add_argument("--model", choices=list(MODELS), help="geometry [llama3-8b on cuda, kvbench-tiny on cpu]")
    ap.add_argument("--dtype", choices=list(DTYPES), help="KV element type [bf16 on cuda, fp32 on cpu]")
    ap.add_argument("--block-tokens", help="tokens per block, comma-separated [16,32,64,128,256]")
    ap.add_argument("--modes", default=",".join(COPY_MODES), help="copy modes, comma-separated [%(default)s]")
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help="device pool layouts, comma-separated [%(default)s]")
    ap.add_argument("--directions", default=",".join(DIRECTIONS), help="directions, comma-separated [%(default)s]")
    ap.add_argument(
        "--batch-mib", type=float, default=64.0, help="target batch size, MiB, sets the blocks moved [%(default)s]"
    )
    ap.add_argument("--blocks", type=int, help=f"blocks per batch, overriding --batch-mib [{MIN_BLOCKS}..--max-blocks]")
    ap.add_argument("--max-blocks", type=int, default=MAX_BLOCKS, help="cap on blocks per batch (count) [%(default)s]")
    ap.add_argument("--repeats", type=int, help="timed moves per cell, after one warm-up (count) [5]")
    ap.add_argument(
        "--disk-dir",
        default=tempfile.gettempdir(),
        help="directory of the disk pool file: put it on the SSD [%(default)s]",
    )
    ap.add_argument(
        "--disk-sync", action="store_true", help="fdatasync writes, drop the file from the page cache before reads"
    )
    ap.add_argument("--hardware", choices=list(HARDWARE), help="datasheet preset for the peak [detected GPU, or cpu]")
    ap.add_argument(
        "--budget-s", type=float, default=240.0, help="wall-clock limit of the sweep, seconds [%(default)s]"
    )
    ap.add_argument("--seed", type=int, default=0, help="seed of the slot draws and block contents [%(default)s]")
    ap.add_argument(
        "--quick", action="store_true", help="tiny CPU run: kvbench-tiny, 16,64 tokens, 32 blocks, 2 repeats"
    )
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument("--out", type=Path, help="JSON results [benchmarks/results/torch_bandwidth-<device>.json]")
    a = ap.parse_args(argv)
    if a.quick:  # only what the user did not set; a quick run must stay well under the test's 30 s
        a.device = a.device or "cpu"
        a.model = a.model or "kvbench-tiny"
        a.block_tokens, a.blocks, a.repeats = a.block_tokens or "16,64", a.blocks or 32, a.repeats or 2
    want = a.device or "auto"
    if want == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here")
    a.device = torch.device("cuda" if want == "cuda" or (want == "auto" and torch.cuda.is_available()) else "cpu")
    cuda = a.device.type == "cuda"
    a.model = a.model or ("llama3-8b" if cuda else "kvbench-tiny")
    a.dtype = a.dtype or ("bf16" if cuda else "fp32")
    a.block_tokens = [int(x) for x in (a.block_tokens or "16,32,64,128,256").split(",") if x.strip()]
    a.repeats = a.repeats or 5
    for name, allowed in (("modes", COPY_MODES), ("layouts", LAYOUTS), ("directions", DIRECTIONS)):
        chosen = [x.strip() for x in getattr(a, name).split(",") if x.strip()]
        if not chosen or any(x not in allowed for x in chosen):
            ap.error(f"--{name}: choose from {', '.join(allowed)}")
        setattr(a, name, chosen)
    a.out = a.out or RESULTS / f"torch_bandwidth-{a.device.type}.json"
    return a


def batch_blocks(a, block_bytes: int) -> int:
    n = a.blocks or round(a.batch_mib * 2**20 / block_bytes)
    return max(MIN_BLOCKS, min(n, a.max_blocks))


def cells(a) -> list[tuple]:
    """(block_tokens, layout, mode, slots, direction). DRAM and disk pools are block-major whatever the device
    layout, so their directions are measured once per block size, under the first layout."""
    out = []
    for bt in a.block_tokens:
        for li, layout in enumerate(a.layouts):
            for mode in a.modes:
                for slots in ("scattered", "contiguous") if mode == "coalesced" else ("scattered",):
                    for d in a.directions:
                        if "hbm" in d or li == 0:
                            out.append((bt, layout if "hbm" in d else "block_major", mode, slots, d))
    return out


def fill_random(t: torch.Tensor, device: torch.device) -> None:
    """Distinct contents per block, so that a mixed-up slot shows in the byte comparison. Random bytes below 64
    are finite numbers in every KV dtype (fp8 has no random_ kernel, bytes do). A host tensor is filled on the
    GPU when there is one: the CPU generator is much slower."""
    b = t.view(torch.uint8)
    if device.type == "cuda" and t.device.type == "cpu":
        b.copy_(torch.empty(b.shape, dtype=torch.uint8, device=device).random_(0, 64))
    else:
        b.random_(0, 64)


def fetch(pool, slots: list[int]) -> torch.Tensor:
    """The blocks at `slots` as host bytes, read back for the comparison (untimed)."""
    if pool.kind == "tensor":
        return pool.gather(torch.tensor(slots, device=pool.data.device)).cpu().view(torch.uint8)
    buf = torch.empty((len(slots), *pool.geometry.block_shape), dtype=pool.geometry.torch_dtype)
    for i, s in enumerate(slots):
        pool.read(s, [buf[i]])
    return buf.view(torch.uint8)


def measure(a, mover: Mover, direction: str, src, dst, ss: list[int], ds: list[int], contiguous=None, scrub=None):
    t = mover.traffic[direction]  # one Mover serves several cells: count this cell's moves as differences
    calls, copies = t.calls, t.copies

    def move() -> float:
        before = t.seconds
        mover.copy(direction, src, ss, dst, ds)
        return t.seconds - before

    # block mode between tensor pools is timed beside the naive loop, and moves between HBM and DRAM beside one
    # contiguous copy of the same bytes: in turns (one noise for all), the order rotated every round
    timers = {"move": move}
    if mover.mode == "block" and src.kind == dst.kind == "tensor":
        timers["naive"] = lambda: naive_loop(src, ss, dst, ds)
    if contiguous is not None:
        timers["contiguous"] = contiguous.seconds
    names, got = list(timers), {k: [] for k in timers}
    for rep in range(a.repeats + 1):
        if a.disk_sync and src.kind == "disk":  # make the read come from the drive again
            os.posix_fadvise(src.fd, 0, 0, os.POSIX_FADV_DONTNEED)
        for j in range(len(names)):
            name = names[(rep + j) % len(names)]
            if scrub is not None:
                scrub()
            elapsed = timers[name]()
            if rep:  # the first round allocates staging buffers and faults pages in: untimed
                got[name].append(elapsed)
    times, naive = got["move"], got.get("naive")
    nbytes = len(ss) * src.geometry.block_bytes
    best, med = min(times), statistics.median(times)
    extra = {}
    if naive:
        extra = {"naive_loop_median_gb_per_s": nbytes / statistics.median(naive) / 1e9,
                 "vs_naive_loop": statistics.median(naive) / med}  # fmt: skip
    if "contiguous" in got:  # the median of the per-round ratios, and the reference's own median rate
        extra["vs_contiguous"] = statistics.median(c / m for c, m in zip(got["contiguous"], times, strict=True))
        extra["contiguous_median_gb_per_s"] = nbytes / statistics.median(got["contiguous"]) / 1e9
    return {
        **extra,
        "copies_per_move": (t.copies - copies) / (t.calls - calls),
        "best_s": best,
        "median_s": med,
        "gb_per_s": nbytes / best / 1e9 if best > 0 else None,
        "median_gb_per_s": nbytes / med / 1e9 if med > 0 else None,
        "ok": bool(torch.equal(fetch(src, ss), fetch(dst, ds))),
    }


class Pools:
    """One block size's pools: the device pool per layout (made on demand), DRAM and disk."""

    def __init__(self, a, bt: int, n: int):
        self.a, self.bt, self.slots = a, bt, 2 * n  # twice the batch: room for scattered slots
        cuda = a.device.type == "cuda"
        self.geo = KvGeometry.named(a.model, bt, a.dtype, "block_major")
        self.dram = TensorPool("dram", self.geo, self.slots, torch.device("cpu"), "block_major", pin=cuda)
        fill_random(self.dram.data, a.device)
        self.hbm: dict[str, TensorPool] = {}
        self.ssd = None
        if any("ssd" in d for d in a.directions):
            self.ssd = DiskPool("ssd", self.geo, self.slots, a.disk_dir, a.disk_sync)
            # fallocate'd space reads back as zeros without touching the drive: write real blocks first
            for first in range(0, self.slots, MAX_BLOCKS):
                self.ssd.write(first, list(self.dram.data[first : first + MAX_BLOCKS]))

    def pool(self, tier: str, layout: str):
        if tier != "hbm":
            return self.dram if tier == "dram" else self.ssd
        if layout not in self.hbm:
            for old in self.hbm.values():  # one device pool at a time
                old.close()
            self.hbm.clear()
            geo = KvGeometry.named(self.a.model, self.bt, self.a.dtype, layout)
            self.hbm[layout] = TensorPool("hbm", geo, self.slots, self.a.device, layout)
            fill_random(self.hbm[layout].data, self.a.device)
        return self.hbm[layout]

    def close(self) -> None:
        for p in [*self.hbm.values(), self.dram, self.ssd]:
            if p is not None:
                p.close()


def sweep(a) -> dict:
    hw = hardware_for(a.device, a.hardware)
    cuda = a.device.type == "cuda"
    todo = cells(a)
    rng = random.Random(a.seed)
    torch.manual_seed(a.seed)
    rows, baselines, stopped, last_cell = [], {}, None, 0.0
    t_start = time.perf_counter()
    progress = None
    if not a.no_progress:
        from rich.console import Console
        from rich.progress import Progress

        progress = Progress(console=Console(stderr=True), transient=True)
        task = progress.add_task("sweep", total=len(todo))
        progress.start()
    pools, pools_bt, pools_error, movers, i = None, None, None, {}, 0
    contiguous: dict[tuple, Contiguous] = {}  # (direction, bytes): one pair of buffers per block size
    scrub = Scrub(a.device)
    try:
        for i, (bt, layout, mode, slots, direction) in enumerate(todo):
            used = time.perf_counter() - t_start
            if used + last_cell > a.budget_s:
                stopped = f"stopped after {used:.0f} s of the {a.budget_s:.0f} s budget: {len(todo) - i} cells not run"
                break
            t_cell = time.perf_counter()
            if pools_bt != bt:
                for m in movers.values():
                    m.close()  # one Mover per block size and mode: give back its locked staging buffers
                movers = {}
                contiguous.clear()
                if pools is not None:
                    pools.close()
                pools, pools_bt = None, bt
                try:
                    geo = KvGeometry.named(a.model, bt, a.dtype)
                    pools = Pools(a, bt, batch_blocks(a, geo.block_bytes))
                except Exception as exc:  # e.g. no room to page-lock or on disk: the next block size may fit
                    pools_error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            if pools is None:
                cell = dict(block_tokens=bt, layout=layout, mode=mode, slots=slots, direction=direction)
                rows.append({**cell, "blocks": 0, "batch_bytes": 0, "error": f"allocating the pools: {pools_error}"})
                continue
            n = pools.slots // 2
            geo = pools.geo
            if slots == "contiguous":
                ss, ds = list(range(n)), list(range(n))
            else:
                ss, ds = rng.sample(range(pools.slots), n), rng.sample(range(pools.slots), n)
            src_tier, dst_tier = direction.split("->")
            row = {
                "block_tokens": bt, "block_bytes": geo.block_bytes, "layout": layout, "mode": mode, "slots": slots,
                "direction": direction, "blocks": n, "batch_bytes": n * geo.block_bytes,
            }  # fmt: skip
            try:
                if mode not in movers:
                    movers[mode] = Mover(mode, a.device)
                mover = movers[mode]
                src, dst = pools.pool(src_tier, layout), pools.pool(dst_tier, layout)
                target = target_of(mode, direction, a.device)
                ref = None
                if target is not None:
                    key = (direction, row["batch_bytes"])
                    if key not in contiguous:
                        contiguous[key] = Contiguous(direction, row["batch_bytes"], a.device)
                    ref = contiguous[key]
                row.update(measure(a, mover, direction, src, dst, ss, ds, ref, scrub))
                if target is not None and row.get(target[0]) is not None:
                    row.update(target=f"{target[0]} >= {target[1]:g}", target_met=row[target[0]] >= target[1])
                key = (direction, row["batch_bytes"])
                if key not in baselines:
                    baselines[key] = baseline_bytes_per_s(direction, row["batch_bytes"], a.device, a.disk_dir)
                peak = peak_bytes_per_s(direction, hw, cuda)
                rate = row["gb_per_s"] * 1e9 if row["gb_per_s"] else None
                row.update(
                    baseline_gb_per_s=baselines[key] / 1e9,
                    vs_baseline=rate / baselines[key] if rate else None,
                    peak_gb_per_s=peak / 1e9,
                    vs_peak=rate / peak if rate else None,
                )
            except Exception as exc:  # one broken cell (a Mover bug, out of memory) must not lose the sweep
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            rows.append(row)
            last_cell = time.perf_counter() - t_cell
            if progress is not None:
                progress.update(task, advance=1, description=f"{bt} tok {layout} {mode} {direction}")
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM (see main): keep and write what was measured
        stopped = f"interrupted after {time.perf_counter() - t_start:.0f} s: {len(todo) - len(rows)} cells not run"
    finally:
        if progress is not None:
            progress.stop()
        for m in movers.values():
            m.close()  # one Mover per block size and mode: give back its locked staging buffers
        if pools is not None:
            pools.close()
    wall = time.perf_counter() - t_start
    return {"rows": rows, "stopped_early": stopped, "cells": len(todo), "wall_s": wall, "hw": hw}


def _interrupt(*_):
    raise KeyboardInterrupt


def main(argv=None) -> dict:
    a = parse_args(argv)
    # `timeout` sends SIGTERM, and a job started in the background ignores SIGINT: both end the sweep early the
    # way Ctrl-C does, with the rows measured so far written out
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    cuda = a.device.type == "cuda"
    res = sweep(a)
    hw = res.pop("hw")
    result = {
        "benchmark": "torch_bandwidth",
        "command": " ".join(["python", *(sys.argv if argv is None else ["benchmarks/torch_bandwidth.py", *argv])]),
        "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "device": a.device.type,
        "device_name": torch.cuda.get_device_name(a.device) if cuda else "cpu",
        "torch": torch.__version__,
        "hardware": hw.name,
        "model": a.model,
        "dtype": a.dtype,
        "config": {k: getattr(a, k) for k in CONFIG_KEYS},
        "units": {"gb_per_s": "1e9 bytes/s", "best_s": "s per batch", "batch_bytes": "bytes"},
        **res,
        "best_by_direction": best_by_direction(res["rows"]),
        "targets": target_summary(res["rows"]),
        "errors": sum("error" in r for r in res["rows"]),
        "mismatches": sum(r.get("ok") is False for r in res["rows"]),
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"KV transfer rates: {a.model} {a.dtype} on {result['device_name']} (peaks: {hw.name} datasheet); "
        f"best of {a.repeats}, disk {'synced' if a.disk_sync else 'through the page cache'}"
    )
    print_table(result)
    if res["stopped_early"]:
        hint = " (raise --budget-s or narrow the sweep)" if "budget" in res["stopped_early"] else ""
        print(f"\n{res['stopped_early']}{hint}")
    if result["errors"] or result["mismatches"]:
        print(f"\n{result['errors']} cells failed, {result['mismatches']} moved the wrong bytes (see the rows)")
    print(f"\n{len(res['rows'])}/{res['cells']} cells in {res['wall_s']:.1f} s; written {a.out}")
    return result


if __name__ == "__main__":
    main()
