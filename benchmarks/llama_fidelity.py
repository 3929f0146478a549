"""Time fidelity of engine-sim against llama.cpp's llama-server (docs/llama-cpp.md, Time fidelity): `kvbench
calibrate` then `kvbench fidelity` at concurrency 1 and 2, in alternating rounds (round 0: 1 then 2, round 1: 2
then 1, ...), each round on a freshly started server with a fresh calibration. llama-server streams one token per
SSE event, so its TTFT and TPOT are observable here (vLLM CPU's streams reach the client in bursts).

The server is `kvbench engine up llama-cpp --ctx-size 8192 --engine-args "--parallel 2" --cpus 1`: two slots, so
that two requests decode together at concurrency 2, pinned to CPU 1 with one compute thread, so that the client
(kvbench, on the other core) does not take turns with it on one core. `--cpus none` runs it unpinned.

Every round draws one seed at random (printed, recorded; `--seeds A,B,C` replays them): the calibration's prompts
use it, and the round's traces are generated with seed+1 (concurrency 1) and seed+2 (concurrency 2), so no run
replays prompts a slot or the host prompt cache already holds. The load average (os.getloadavg) is recorded
before and after every round, and so is the engine's own repeat spread (how far a calibration point's repeats
lie from their median: the floor under any per-request MAPE of that round). Targets (docs/fidelity.md): TTFT
MAPE ≤ 20%, E2EL MAPE ≤ 10%.

    python benchmarks/llama_fidelity.py [--rounds 3] [--requests 60] [--workload chat] [--seeds A,B,C]
        [--cpus 1|none] [--parallel 2] [--keep DIR]

Prints the medians over rounds per concurrency and writes benchmarks/results/llama_fidelity.json (every round's
numbers, seeds, calibration terms, load averages, the command and the engine's settings). The engine the script
found running is put back at the end (none: it is stopped).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.fidelity import errors  # noqa: E402  (the same per-run errors as the vLLM benchmark)
from kvbench import engines  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "llama_fidelity.json"
TARGETS = {"ttft_mape": 0.20, "e2el_mape": 0.10}
KEYS = ("ttft_mape", "ttft_mean_ratio", "tpot_mape", "tpot_mean_ratio", "e2el_mape", "e2el_mean_ratio",
        "cached_exact", "burst_streams")  # fmt: skip


def kvbench(*args) -> str:
    cmd = [shutil.which("kvbench") or "kvbench", *map(str, args)]
    print("$", shlex.join(cmd), flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"failed ({proc.returncode}): {shlex.join(cmd)}\n{(proc.stderr or proc.stdout)[-2000:]}")
    return proc.stdout


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def repeat_spread(measurements: dict) -> dict:
    """The engine's own scatter: over the calibration's points, the mean |sample − the point's median| / median of
    its repeats (the same request sent again). A deterministic model of each request's median time scores about
    this MAPE against single requests, so it is the floor under the per-request MAPEs of the same run."""
    out = {}
    for kind, key in (("prefill", "ttft_s"), ("decode", "step_s")):
        devs = [abs(x - p[key]) / p[key] for p in measurements.get(kind, []) for x in p["samples_s"] if p[key] > 0]
        out[kind] = round(statistics.fmean(devs), 4) if devs else None
    return out


def calibrate(url: str, path: Path, seed: int, repeats: int, tries: int = 3) -> dict:
    """A calibration that passes kvbench's own fit checks (a busy moment can spoil one: it is measured again, with
    the seed + 1000 × the attempt, since a repeated seed would repeat prompts the server has cached), or the run
    stops: its terms, fit figures and the seed it used."""
    for attempt in range(tries):
        cmd = ["kvbench", "calibrate", "--url", url, "-o", str(path), "--seed", str(seed + 1000 * attempt),
               "--repeats", str(repeats), "--overwrite"]  # fmt: skip
        print("$", shlex.join(cmd), flush=True)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode == 0:
            break
        print(f"calibration {attempt + 1} rejected by its fit checks: {proc.stderr.strip().splitlines()[-1:]}")
    else:
        sys.exit(f"no calibration passed its fit checks in {tries} tries: is the machine busy?")
    data = tomllib.loads(path.read_text())
    fit = data["measurements"]["fit"]
    return {"terms": data["calibration"], "r2_prefill": fit["r2_prefill"], "r2_decode": fit["r2_decode"],
            "repeat_spread": repeat_spread(data["measurements"]),
            "step_budget": data["measurements"]["plan"]["max_num_batched_tokens"],
            "batch_sizes": data["measurements"]["plan"]["batch_sizes"], "seed": seed + 1000 * attempt}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=60, help="requests per fidelity run")
    ap.add_argument("--concurrency", default="1,2", help="client concurrencies, alternated between rounds")
    ap.add_argument("--workload", default="chat", help="kvbench trace gen kind of the replayed traces")
    ap.add_argument("--seeds", help="one seed per round, comma-separated [default: drawn at random, printed]")
    ap.add_argument("--cpus", default="1", help="CPU list the server is pinned to (taskset), or none")
    ap.add_argument("--parallel", type=int, default=2, help="llama-server --parallel (slots)")
    ap.add_argument("--ctx-size", type=int, default=8192, help="llama-server --ctx-size, tokens")
    ap.add_argument("--port", type=int, default=8012)
    ap.add_argument("--calibrate-repeats", type=int, default=3)
    ap.add_argument("--keep", type=Path, help="keep every run directory here")
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else [secrets.randbelow(10**6) for _ in
                                                                         range(args.rounds)]  # fmt: skip
    if len(seeds) != args.rounds:
        sys.exit(f"--seeds gives {len(seeds)} seeds for {args.rounds} rounds")
    print(f"seeds {','.join(map(str, seeds))} (replay: --seeds {','.join(map(str, seeds))})", flush=True)
    concs = [int(c) for c in args.concurrency.split(",")]
    cpus = None if args.cpus.lower() == "none" else args.cpus
    settings = {"port": args.port, "ctx_size": args.ctx_size, "engine_args": f"--parallel {args.parallel}",
                "cpus": cpus}  # fmt: skip
    before = engines.running("llama-cpp")
    work = args.keep or Path(tempfile.mkdtemp(prefix="kvbench-llama-fidelity-"))
    work.mkdir(parents=True, exist_ok=True)
    rounds, t0 = [], time.time()
    try:
        for rnd, seed in enumerate(seeds):
            # a fresh server each round: empty slots and host prompt cache, nothing one round leaves to the next
            engines.down("llama-cpp")
            info = engines.up("llama-cpp", restart=True, **settings)
            record = {"round": rnd, "seed": seed, "load_avg_before": load()}
            record["calibration"] = calibrate(info.url, work / f"calibration-r{rnd}.toml", seed,
                                              args.calibrate_repeats)  # fmt: skip
            record["runs"] = {}
            for conc in concs if rnd % 2 == 0 else list(reversed(concs)):
                out = work / f"r{rnd}-c{conc}"
                trace_seed = seed + concs.index(conc) + 1
                kvbench("fidelity", "--url", info.url, "--workload", args.workload, "--seed", trace_seed,
                        "--requests", args.requests, "--concurrency", conc, "--calibration",
                        work / f"calibration-r{rnd}.toml", "--out", out, "--overwrite")  # fmt: skip
                run = errors(out)
                run["trace_seed"] = trace_seed
                record["runs"][str(conc)] = run
                print(f"round {rnd} concurrency {conc}: TTFT MAPE {run['ttft_mape']:.1%}, TPOT MAPE "
                      f"{run['tpot_mape']:.1%}, E2EL MAPE {run['e2el_mape']:.1%}", flush=True)  # fmt: skip
            record["load_avg_after"] = load()
            rounds.append(record)
    finally:
        engines.down("llama-cpp")
        if before is not None:  # put back the engine the script found
            engines.up("llama-cpp", restart=True, **before.settings)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    report(args, seeds, settings, rounds, concs, round(time.time() - t0))


def report(args, seeds: list[int], settings: dict, rounds: list[dict], concs: list[int], seconds: int) -> None:
    medians = {}
    for conc in map(str, concs):
        runs = [r["runs"][conc] for r in rounds]
        m = {k: statistics.median(v) for k in KEYS if (v := [x[k] for x in runs if isinstance(x.get(k), int | float)])}
        m["targets_met"] = m["ttft_mape"] <= TARGETS["ttft_mape"] and m["e2el_mape"] <= TARGETS["e2el_mape"]
        medians[conc] = m
    print(f"\n{'concurrency':>11} {'TTFT MAPE':>9} {'TPOT MAPE':>9} {'E2EL MAPE':>9} {'TTFT ratio':>10} {'exact':>6}")
    for conc, m in medians.items():
        print(f"{conc:>11} {m['ttft_mape']:9.1%} {m['tpot_mape']:9.1%} {m['e2el_mape']:9.1%} "
              f"{m['ttft_mean_ratio']:10.3f} {m['cached_exact']:6.1%}"
              f"{'' if m['targets_met'] else '  (targets NOT met)'}")  # fmt: skip
    for r in rounds:
        spread = r["calibration"]["repeat_spread"]
        print(f"round {r['round']} (seed {r['seed']}): load average {r['load_avg_before']} -> {r['load_avg_after']}; "
              f"the engine's repeat spread (calibration points sent again): prefill TTFT {spread['prefill']:.1%}, "
              f"decode step {spread['decode']:.1%}")  # fmt: skip
    command = ["python", "benchmarks/llama_fidelity.py", "--rounds", str(args.rounds), "--requests",
               str(args.requests), "--concurrency", args.concurrency, "--workload", args.workload, "--seeds",
               ",".join(map(str, seeds)), "--cpus", args.cpus, "--parallel", str(args.parallel)]  # fmt: skip
    pinned = settings["cpus"] is not None
    RESULTS.write_text(json.dumps({
        "command": shlex.join(command),
        "engine": {"name": "llama-cpp", **settings,
                   "up": shlex.join(["kvbench", "engine", "up", "llama-cpp", "--port", str(settings["port"]),
                                     "--ctx-size", str(settings["ctx_size"]), "--engine-args",
                                     settings["engine_args"]] + (["--cpus", settings["cpus"]] if pinned else []))},
        "pinned": pinned,
        "pinning_why": "llama-server pinned to one CPU with one compute thread (taskset via --cpus), the client on the "
        "other: unpinned, its two spinning threads and the client share both cores, streams reach the client in "
        "bursts and the decode fit is poorer" if pinned else "not pinned (--cpus none)",
        "workload": args.workload, "requests": args.requests, "rounds": args.rounds, "seeds": seeds,
        "order": "round r runs the concurrencies in the given order when r is even, reversed when odd; a fresh "
        "server and calibration each round; trace seed = round seed + 1 + the concurrency's position",
        "targets": TARGETS, "seconds": seconds, "medians": medians, "per_round": rounds,
        "repeat_spread_median": {kind: statistics.median(r["calibration"]["repeat_spread"][kind] for r in rounds)
                                 for kind in ("prefill", "decode")},
        "repeat_spread_why": "mean |sample - median| / median of the calibration's repeated points: a model of each "
        "request's median time scores about this MAPE against single requests (the floor under the MAPEs)",
    }, indent=1) + "\n")  # fmt: skip
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
