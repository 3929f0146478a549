"""Ray across nodes (issue 19, point 5): a sweep and the distributed load generator on 1, 2 and 3 Ray nodes.

Usage (from the repository root):

    python benchmarks/ray_nodes.py [--rounds 3] [--nodes 1,2,3] [--quick] [--out JSON]

The cluster is the tests' multi-node one (tests/raycluster.py): a head that runs nothing (0 CPUs) and N worker
nodes of 1 CPU each, every node its own raylet, object store and worker processes, all on this machine. Each
round starts a fresh cluster per node count (its start timed apart, `cluster_start_s`), runs on it

  sweep   `kvbench sweep --executor ray --ray-address ADDR --workers N` of 64 `sim` points (4 policies x 16
          capacities, without the Belady bound, reports included; traces reach the nodes through the object
          store and run directories come back to the driver), a fresh --out each run;
  load    `kvbench replay --backend openai --workers N --executor ray --ray-address ADDR` against the fake
          server (`python -m kvbench.testing.fakeserver`, its own process for the whole benchmark, so that it
          shares no process with the clients): max completed rate (`--requests` requests at --rate 1e9) and
          the schedule lag of a Poisson run at `--rate` req/s; completed req/s and lag are computed from
          requests.parquet exactly as benchmarks/client_overhead.py does (its `summarize`);

and closes it; the serial sweep (`--executor local`) runs once a round as the reference. The configurations
alternate their order from round to round (serial, 1, 2, 3 nodes; then 3, 2, 1, serial), so that drifting
load falls on all of them alike; figures are medians over rounds. Per configuration: sweep wall seconds,
speed-up against 1 node, the per-point overhead of Ray ((1-node wall - serial wall) / points), and a check
that every point's hit rate equals the serial sweep's. The machine's load average is recorded before each
round. Writes benchmarks/results/ray_nodes.json (every run's raw numbers and the medians).

A machine with fewer cores than nodes (+ the driver and the fake server) cannot show scaling: its nodes share
the cores, and the figures then measure Ray's overhead, not its speed-up; the JSON's "note" says so.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The tests' cluster controller is imported rather than re-implemented: the benchmark then measures exactly the
# multi-node cluster that tests/integration exercises (nodes of 1 CPU, a head that runs no task).
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))
from raycluster import ClusterProcess, free_port  # noqa: E402

from benchmarks.client_overhead import make_trace, summarize  # noqa: E402  same trace shape and same figures

DEFAULT_OUT = REPO / "benchmarks/results/ray_nodes.json"
# The smallest sample trace: a point's cost is then mostly kvbench's fixed per-point work (trace preparation,
# report, run directory), which is what shipping points to other nodes adds to, and 4 sweeps a round of 64
# points stay within minutes.
DEFAULT_TRACE = REPO / "traces/samples/reasoning.parquet"
POLICIES = "lru,fifo,s3fifo,radix-lru"
CAPACITIES = "100,200,300,500,750,1000,1500,2000,3000,5000,7500,10000,15000,20000,30000,50000"
QUICK_POLICIES, QUICK_CAPACITIES = "lru,fifo", "1000,10000"
KVBENCH = [sys.executable, "-c", "from kvbench.cli import main; main()"]


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def tail(path: Path, n: int = 8) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-n:])
    except OSError:
        return ""


def run_logged(cmd: list[str], log: Path, timeout: float) -> tuple[int, float]:
    """Run a kvbench command with its output in `log`; (exit status, wall seconds)."""
    t0 = time.perf_counter()
    with open(log, "w") as fh:
        fh.write(" ".join(cmd) + "\n\n")
        fh.flush()
        try:
            rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=REPO, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    return rc, time.perf_counter() - t0


# ------------------------------------------------------------------------------------------------ sweep


def sweep(args, executor: list[str], out: Path) -> dict:
    """One sweep into a fresh `out`: wall seconds (process start to exit) and every point's hit rate."""
    cmd = KVBENCH + ["sweep", "--trace", str(args.trace), "--policy", args.policies, "--capacity", args.capacities]
    cmd += ["--no-bound", "--out", str(out)] + executor
    rc, wall = run_logged(cmd, out.with_suffix(".log"), args.timeout)
    manifest_path = out / "sweep.json"
    if rc != 0 or not manifest_path.exists():
        raise SystemExit(f"sweep {' '.join(executor)} exited {rc}: {tail(out.with_suffix('.log'))}")
    points = json.loads(manifest_path.read_text())["points"]
    failed = [p["name"] for p in points if p["status"] != "ok"]
    if failed:
        raise SystemExit(f"sweep {' '.join(executor)}: {len(failed)} point(s) not ok, e.g. {failed[0]} ({out})")
    return {
        "wall_s": wall,
        "points": len(points),
        "hit_rates": {p["name"]: p["hit_rate"] for p in points},
        "attempts": sum(p.get("attempts", 1) for p in points),
        "hosts": sorted({str(p.get("host")) for p in points}),
    }


# ------------------------------------------------------------------------------------------------- load


class FakeServerProcess:
    """`python -m kvbench.testing.fakeserver` in a process of its own, with its CPU time readable from /proc."""

    def __init__(self, log: Path):
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(log, "w")
        cmd = [sys.executable, "-m", "kvbench.testing.fakeserver", "--port", str(port), "--block-size", "16"]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=REPO)
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as answer:
                    if answer.status == 200:
                        return
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise SystemExit(f"the fake server did not start: {tail(log)}")
            time.sleep(0.2)

    def cpu_s(self) -> float | None:
        try:
            fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return None
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def load_run(args, server: FakeServerProcess, address: str, workers: int, rate: float, n: int, out: Path) -> dict:
    """One distributed replay; completed req/s and schedule lag (client_overhead.py's definitions), the
    workers' own p99 lags and the fake server's CPU seconds during the command (against span_s: how near the
    server came to setting the pace)."""
    import numpy as np
    import pyarrow.parquet as pq

    cmd = KVBENCH + ["replay", str(args.load_trace), "--backend", "openai", "--url", server.url]
    cmd += ["--mode", "rate", "--rate", repr(rate), "--seed", "1", "--max-requests", str(n), "--no-report"]
    cmd += ["--workers", str(workers), "--executor", "ray", "--ray-address", address, "--out", str(out)]
    cpu0 = server.cpu_s()
    rc, wall = run_logged(cmd, out.with_suffix(".log"), args.timeout)
    cpu1 = server.cpu_s()
    if rc != 0 or not (out / "requests.parquet").exists():
        return {"error": f"exit status {rc}: {tail(out.with_suffix('.log'))}", "process_wall_s": wall}
    table = pq.read_table(out / "requests.parquet")
    scheduled, sent, e2el = (
        table.column(c).to_numpy(zero_copy_only=False) for c in ("scheduled_send_s", "actual_send_s", "e2el_s")
    )
    ok = np.array(table.column("status").to_pylist()) == "ok"
    figures = summarize(sent, sent + e2el, ok, sent - scheduled)
    summary = json.loads((out / "summary.json").read_text())
    figures["worker_lag_p99_ms"] = [(w.get("schedule_lag") or {}).get("p99_ms") for w in summary.get("workers", [])]
    figures["worker_requests"] = [w.get("requests") for w in summary.get("workers", [])]
    figures["worker_nodes"] = len({w.get("node") for w in summary.get("workers", [])})
    if cpu0 is not None and cpu1 is not None and figures.get("span_s"):
        # over the whole command (Ray start-up included): an upper bound of what the requests themselves cost it
        figures["server_cpu_s"] = cpu1 - cpu0
    figures["process_wall_s"] = wall
    return figures


# ------------------------------------------------------------------------------------------------- main


def median(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return round(statistics.median(values), 3) if values else None


def write_result(args, rounds: list[dict], run: dict) -> dict:
    """The medians, checks and raw rounds so far, written to --out; returns them."""
    rounds = copy.deepcopy(rounds)
    command, started, node_counts, n_points = run["command"], run["started"], run["node_counts"], run["points"]
    poisson_requests = run["poisson_requests"]
    # every point of every sweep against the serial sweep of the same round
    mismatches = []
    for row in rounds:
        reference = row["configs"]["serial"]["sweep"]["hit_rates"]
        for config, entry in row["configs"].items():
            if entry["sweep"]["hit_rates"] != reference:
                differing = [k for k in reference if entry["sweep"]["hit_rates"].get(k) != reference[k]]
                mismatches.append({"round": row["round"], "config": config, "points": differing[:5]})
    # the raw rows keep hit rates once (the serial sweep's), not once per configuration
    for row in rounds:
        for config, entry in row["configs"].items():
            if config != "serial":
                entry["sweep"].pop("hit_rates")

    def flat(config: str) -> list[dict]:
        rows = []
        for row in rounds:
            entry = row["configs"][config]
            rows.append(
                {
                    "sweep_s": entry["sweep"]["wall_s"],
                    "cluster_start_s": entry.get("cluster_start_s"),
                    "max_rate_rps": entry.get("max_rate", {}).get("completed_rps"),
                    "lag_p50_ms": entry.get("poisson", {}).get("lag_p50_ms"),
                    "lag_p99_ms": entry.get("poisson", {}).get("lag_p99_ms"),
                    "poisson_rps": entry.get("poisson", {}).get("completed_rps"),
                }
            )
        return rows

    medians = {config: {k: median(flat(config), k) for k in flat(config)[0]} for config in rounds[0]["configs"]}
    serial_s = medians["serial"]["sweep_s"]
    one_node = medians.get("1-node", {}).get("sweep_s")
    for config, m in medians.items():
        if config != "serial":
            m["speed_up_vs_1_node"] = round(one_node / m["sweep_s"], 3) if one_node else None
            m["over_serial"] = round(m["sweep_s"] / serial_s, 3)
    # per-round differences, then their median: each round's serial and 1-node sweeps ran side by side
    per_point = [
        (row["configs"]["1-node"]["sweep"]["wall_s"] - row["configs"]["serial"]["sweep"]["wall_s"]) / n_points
        for row in rounds
        if "1-node" in row["configs"]
    ]
    cores = os.cpu_count()
    result = {
        "what": "kvbench sweep and distributed live load on a multi-node Ray cluster on one machine "
        "(tests/raycluster.py: head of 0 CPUs + N worker nodes of 1 CPU, each its own raylet and object store)",
        "command": command,
        "note": (
            f"This machine has {cores} cores: the {max(node_counts)} one-CPU nodes, the driver and the fake server "
            f"share them, so figures for more nodes than cores measure Ray's overhead, not scaling."
            if cores is not None and max(node_counts) >= cores
            else "nodes, driver and fake server share this machine's cores"
        ),
        "machine": {
            "cpus": cores,
            "platform": platform.platform(),
            "python": platform.python_version(),
            "ray": __import__("ray").__version__,
        },
        "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "wall_s": round(time.time() - started, 1),
        "load_average_end": load_average(),
        "sweep": {
            "trace": os.path.relpath(args.trace, REPO),
            "policies": args.policies.split(","),
            "capacities": args.capacities.split(","),
            "points": n_points,
            "options": "--no-bound, reports included",
        },
        "load": {
            "server": "python -m kvbench.testing.fakeserver (own process, not pinned)",
            "trace": f"generated: {args.input_len}-token prompts, no shared prefix, {args.output_len} output tokens",
            "max_rate_requests": args.requests,
            "poisson_rate_rps": args.rate,
            "poisson_requests": poisson_requests,
            "workers": "as many as nodes, one per node",
            "definitions": "completed req/s = ok / (last completion - first send); schedule lag = actual - "
            "scheduled send, over every request (benchmarks/client_overhead.py summarize)",
        },
        "rounds_planned": args.rounds,
        "rounds_done": len(rounds),
        "medians": medians,
        "per_point_overhead_s": round(statistics.median(per_point), 3) if per_point else None,
        "per_point_overhead_s_rounds": [round(x, 3) for x in per_point],
        "serial_s_per_point": round(serial_s / n_points, 3),
        "hit_rates_identical": not mismatches,
        "hit_rate_mismatches": mismatches,
        "rounds": rounds,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds; medians (default 3)")
    ap.add_argument("--nodes", default="1,2,3", help="cluster sizes, worker nodes of 1 CPU each (default 1,2,3)")
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="sweep trace (default: reasoning sample)")
    ap.add_argument("--policies", default=POLICIES, help=f"sweep policies (default {POLICIES})")
    ap.add_argument("--capacities", default=CAPACITIES, help="sweep capacities, blocks (default: 16 values)")
    ap.add_argument("--requests", type=int, default=3000, help="max-rate run: requests at --rate 1e9 (3000)")
    ap.add_argument("--rate", type=float, default=500.0, help="Poisson run: requests per second (500)")
    ap.add_argument("--duration", type=float, default=6.0, help="Poisson run: seconds, requests = rate x this (6)")
    ap.add_argument("--input-len", type=int, default=100, help="load trace: prompt tokens (100)")
    ap.add_argument("--output-len", type=int, default=16, help="load trace: output tokens (16)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds one kvbench command may take")
    ap.add_argument("--quick", action="store_true", help="smoke run: 4 points, 1 round, 500 requests, 2 s Poisson")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results JSON (default: benchmarks/results/…)")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.policies, args.capacities = 1, QUICK_POLICIES, QUICK_CAPACITIES
        args.requests, args.duration = 500, 2.0
    node_counts = [int(x) for x in args.nodes.split(",")]
    n_points = len(args.policies.split(",")) * len(args.capacities.split(","))
    poisson_requests = int(args.rate * args.duration)
    command = " ".join([Path(sys.executable).name, *sys.argv])
    started = time.time()
    run_facts = {
        "command": command,
        "started": started,
        "node_counts": node_counts,
        "points": n_points,
        "poisson_requests": poisson_requests,
    }

    work = Path(tempfile.mkdtemp(prefix="kvbench-ray-nodes-"))
    server = None
    try:
        args.load_trace = make_trace(
            work / "load.parquet", max(args.requests, poisson_requests), args.input_len, args.output_len, seed=1
        )
        # untimed: loads or fills the trace cache and the compiled kernels that every timed sweep then finds
        sweep(args, ["--executor", "local"], work / "warm")
        server = FakeServerProcess(work / "server.log")
        configs = ["serial"] + [f"{n}-node" for n in node_counts]
        rounds = []
        for r in range(args.rounds):
            order = configs if r % 2 == 0 else configs[::-1]
            row = {"round": r + 1, "order": order, "load_average": load_average(), "configs": {}}
            for config in order:
                tag = f"r{r + 1}-{config}"
                if config == "serial":
                    row["configs"][config] = {"sweep": sweep(args, ["--executor", "local"], work / tag)}
                    continue
                nodes = int(config.split("-")[0])
                t0 = time.perf_counter()
                cluster = ClusterProcess(nodes)
                try:
                    entry = {"cluster_start_s": time.perf_counter() - t0}
                    ray = ["--executor", "ray", "--ray-address", cluster.address, "--workers", str(nodes)]
                    entry["sweep"] = sweep(args, ray, work / f"{tag}-sweep")
                    entry["max_rate"] = load_run(
                        args, server, cluster.address, nodes, 1e9, args.requests, work / f"{tag}-max"
                    )
                    entry["poisson"] = load_run(
                        args, server, cluster.address, nodes, args.rate, poisson_requests, work / f"{tag}-poisson"
                    )
                finally:
                    cluster.close()
                row["configs"][config] = entry
                print(
                    f"round {r + 1} {config}: sweep {entry['sweep']['wall_s']:.1f} s, "
                    f"max rate {entry['max_rate'].get('completed_rps', float('nan')):.0f} req/s, "
                    f"p99 lag at {args.rate:g} req/s {entry['poisson'].get('lag_p99_ms', float('nan')):.2f} ms, "
                    f"cluster start {entry['cluster_start_s']:.1f} s",
                    flush=True,
                )
            serial = row["configs"]["serial"]["sweep"]
            print(f"round {r + 1} serial: sweep {serial['wall_s']:.1f} s; load average {row['load_average']}")
            rounds.append(row)
            # after every round, so that the rounds done are kept if the run is cut short
            result = write_result(args, rounds, run_facts)
    finally:
        if server is not None:
            server.close()
        shutil.rmtree(work, ignore_errors=True)

    for config, m in result["medians"].items():
        print(f"median {config}: {m}")
    print(
        f"per-point overhead (1 node - serial) {result['per_point_overhead_s']} s; hit rates identical: "
        f"{result['hit_rates_identical']} → {args.out}"
    )
    if result["hit_rate_mismatches"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
