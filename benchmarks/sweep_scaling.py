"""How much faster a sweep runs on Ray (and on a process pool) than one point after another, on this machine.

Usage (from the repository root):

    python benchmarks/sweep_scaling.py [--workers N] [--repeat N] [--quiet-below CORES] [--wait-quiet S]
                                       [--session-nice N] [--out JSON]

One run times the same grid of 32 `sim` points (the Mooncake conversation trace × 4 policies × 8 capacities,
without the Belady bound, each point writing its run directory and report as `kvbench sweep` does) three
ways, in rounds that alternate their order so that drifting load falls on all of them alike:

  serial   --executor local: one point after another in this process;
  process  --executor process --workers N: a pool of N spawned processes (their start-up included);
  ray      --executor ray on a local Ray cluster of N CPUs, started for the round: the cluster's start is
           timed apart (`ray_start_s`), and the ratio to serial is given with and without it.

Parallel speed-up needs idle cores: Linux shares the CPUs fairly between sessions (autogroups), so while
other sessions keep the cores busy, a sweep's workers together get one session's share and no executor can
beat serial. Before each timed sweep the script therefore waits (up to --wait-quiet seconds) until the rest
of the machine keeps fewer than --quiet-below cores busy, and records that background load and the busy
cores during the sweep (from /proc/stat) beside each time. On a machine others keep busy, --session-nice
-10 (root) weights this session's autogroup up for the run, so that the sweeps get the cores an idle
machine would give them, serial and parallel alike; it is put back at the end and recorded.

It prints each round and the medians, with ray/serial (target: ≤ 0.6 with 2 CPUs) and process/serial,
checks that all three give the same hit rates, and writes everything to --out. The trace is
traces/mooncake/conversation_trace.parquet, else the shared JSONL ($KVBENCH_SHARED or ../shared,
traces/mooncake/conversation_trace.jsonl) imported into a temp folder.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PARQUET = REPO / "traces/mooncake/conversation_trace.parquet"
SHARED = Path(os.environ.get("KVBENCH_SHARED", REPO.parent / "shared"))
JSONL = SHARED / "traces/mooncake/conversation_trace.jsonl"
DEFAULT_OUT = REPO / "benchmarks/results/sweep_scaling.json"
POLICIES = "lru,fifo,s3fifo,radix-lru"
CAPACITIES = "1000,2000,3000,5000,10000,20000,30000,50000"  # blocks of 512 tokens
TARGET = 0.6
TICKS = os.sysconf("SC_CLK_TCK")  # /proc/stat counts in these per second


def trace_path(tmp: Path) -> Path:
    if PARQUET.exists():
        return PARQUET
    if not JSONL.exists():
        sys.exit(f"no Mooncake trace: neither {PARQUET} nor {JSONL} exists (set KVBENCH_SHARED)")
    out = tmp / "mooncake.parquet"
    subprocess.run(["kvbench", "trace", "import", "mooncake", str(JSONL), "-o", str(out)], check=True)
    return out


def busy_ticks() -> int | None:
    """CPU time the whole machine has spent busy (user, nice, system, irq, softirq, steal), in ticks."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()
    except OSError:
        return None
    return sum(int(fields[i]) for i in (1, 2, 3, 6, 7, 8))


def wait_for_quiet(below: float, patience: float, window: float = 3.0) -> float | None:
    """Cores the machine keeps busy while this script idles (the background), once below `below` or after
    `patience` seconds; None without /proc/stat."""
    deadline = time.monotonic() + patience
    while True:
        t0, b0 = time.monotonic(), busy_ticks()
        time.sleep(window)
        b1 = busy_ticks()
        if b0 is None or b1 is None:
            return None
        background = (b1 - b0) / TICKS / (time.monotonic() - t0)
        if background < below or time.monotonic() > deadline:
            return round(background, 2)


class SessionNice:
    """This session's autogroup nice value (Linux: CPU is shared between sessions by these weights)."""

    path = Path("/proc/self/autogroup")

    def __init__(self, nice: int | None):
        self.nice, self.before = nice, None

    def __enter__(self):
        if self.nice is not None:
            self.before = int(self.path.read_text().split()[-1])
            self.path.write_text(str(self.nice))
        return self

    def __exit__(self, *_):
        if self.before is not None:
            self.path.write_text(str(self.before))


def own_cpu_s() -> float:
    """CPU seconds of this process and of its children that ended (the process pool's, once shut down)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def timed_sweep(grid, out: Path, settings) -> tuple[dict, dict]:
    from kvbench.run.sweeps import run_sweep

    t0, b0, c0 = time.perf_counter(), busy_ticks(), own_cpu_s()
    manifest = run_sweep(grid, out, settings)
    seconds = time.perf_counter() - t0
    failed = [p["name"] for p in manifest["points"] if p["status"] != "ok"]
    if failed:
        sys.exit(f"{settings.executor}: {len(failed)} point(s) did not run ok, e.g. {failed[0]}: see {out}/sweep.json")
    b1 = busy_ticks()
    stats = {"s": seconds, "busy_cores": None if b0 is None or b1 is None else (b1 - b0) / TICKS / seconds}
    if settings.executor != "ray":  # Ray's workers are the raylet's children, not counted here
        stats["own_cores"] = (own_cpu_s() - c0) / seconds
    return stats, {p["name"]: p["hit_rate"] for p in manifest["points"]}


def run_ray(grid, out: Path, settings) -> tuple[dict, dict]:
    import ray

    t0 = time.perf_counter()
    ray.init(num_cpus=settings.workers, include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
    start = time.perf_counter() - t0
    try:
        stats, rates = timed_sweep(grid, out, settings)
    finally:
        ray.shutdown()
    return {**stats, "start_s": start}, rates


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=2, help="points at once: Ray cluster CPUs, pool processes (2)")
    ap.add_argument("--repeat", type=int, default=2, help="rounds of serial + process + ray; medians (default 2)")
    ap.add_argument("--policies", default=POLICIES, help=f"sim policies, comma-separated (default {POLICIES})")
    ap.add_argument("--capacities", default=CAPACITIES, help=f"blocks of 512 tokens (default {CAPACITIES})")
    ap.add_argument(
        "--quiet-below", type=float, default=0.3, help="cores the rest of the machine may keep busy (default 0.3)"
    )
    ap.add_argument("--wait-quiet", type=float, default=300, help="seconds to wait for that, each sweep (300)")
    ap.add_argument(
        "--session-nice", type=int, help="autogroup nice of this session for the run (-20..19; < 0 needs root)"
    )
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results JSON (default: benchmarks/results/…)")
    args = ap.parse_args()

    from kvbench.run.executors import ExecutorSettings
    from kvbench.run.runner import run_replay
    from kvbench.run.sweeps import Grid, expand

    os.chdir(REPO)
    with SessionNice(args.session_nice), tempfile.TemporaryDirectory(prefix="kvbench-sweep-scaling-") as tmp_name:
        tmp = Path(tmp_name)
        trace = trace_path(tmp)
        grid = Grid(
            traces=[os.path.relpath(trace)],
            policies=args.policies.split(","),
            capacities=args.capacities.split(","),
            options={"bound": False},
        )
        n_points = len(expand(grid))
        # untimed: builds or loads the simulator's compiled kernels and reads the trace into the page cache
        run_replay(trace, "sim", {"policy": "lru", "capacity": "1000", "bound": False}, out=tmp / "warm")
        ways = {
            "serial": ExecutorSettings("local"),
            "process": ExecutorSettings("process", workers=args.workers),
            "ray": ExecutorSettings("ray", workers=args.workers),
        }
        rounds, reference = [], None
        for r in range(args.repeat):
            order = list(ways) if r % 2 == 0 else list(reversed(ways))
            row = {}
            for way in order:
                background = wait_for_quiet(args.quiet_below, args.wait_quiet)
                runner = run_ray if way == "ray" else timed_sweep
                stats, rates = runner(grid, tmp / f"round{r}-{way}", ways[way])
                row.update({f"{way}_{k}": v for k, v in {**stats, "background_cores": background}.items()})
                reference = reference or rates
                if rates != reference:
                    sys.exit(f"{way}: hit rates differ from the first run's: the executors must agree")
            row["ray_with_start_s"] = row["ray_start_s"] + row["ray_s"]
            row = {k: None if v is None else round(v, 2) for k, v in sorted(row.items())}
            rounds.append(row)
            times = ", ".join(f"{k} {row[k]:.1f}" for k in ("serial_s", "process_s", "ray_s", "ray_start_s"))
            loads = ", ".join(f"{w} {row[f'{w}_background_cores']}" for w in ways)
            print(f"round {r + 1} ({' → '.join(order)}): {times}; background cores before: {loads}", flush=True)

    med = {k: round(statistics.median(r[k] for r in rounds), 2) for k in rounds[0] if rounds[0][k] is not None}
    result = {
        "what": f"kvbench sweep of {n_points} sim points on the Mooncake trace: local vs process pool vs Ray",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "grid": {"trace": Path(trace).name, "policies": grid.policies, "capacities": grid.capacities},
        "points": n_points,
        "workers": args.workers,
        "quiet_below_cores": args.quiet_below,
        "session_nice": args.session_nice,
        "rounds": rounds,
        "median": med,
        "serial_s_per_point": round(med["serial_s"] / n_points, 2),
        "ray_over_serial": round(med["ray_s"] / med["serial_s"], 3),
        "ray_with_start_over_serial": round(med["ray_with_start_s"] / med["serial_s"], 3),
        "process_over_serial": round(med["process_s"] / med["serial_s"], 3),
        "target_ray_over_serial": TARGET,
    }
    result["meets_target"] = result["ray_over_serial"] <= TARGET
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"median of {len(rounds)}: serial {med['serial_s']:.1f} s ({result['serial_s_per_point']:.2f} s/point), "
        f"ray {med['ray_s']:.1f} s (+ {med['ray_start_s']:.1f} s cluster start), process {med['process_s']:.1f} s\n"
        f"ray/serial {result['ray_over_serial']:.3f} (with start {result['ray_with_start_over_serial']:.3f}; "
        f"target ≤ {TARGET}), process/serial {result['process_over_serial']:.3f} → {args.out}"
    )


if __name__ == "__main__":  # the process pool's spawned workers import this file: run nothing then
    main()
