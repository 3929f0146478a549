"""engine-sim speed against a baseline commit: the same `kvbench replay --backend engine-sim` command run as a whole
process by both versions, in interleaved rounds, with the per-request results compared.

Usage (from the repository root):

    python benchmarks/enginesim_speed.py [--baseline COMMIT] [--new COMMIT] [--requests N] [--rounds N] [--out JSON]

The baseline commit (and `--new`, else this checkout as it is) is checked out into a temporary `git worktree`
(removed at the end). Before timing, each tree builds its ahead-of-time kernel modules (kvbench.cache and, where
it has one, engine-sim's loop), as a user's machine has them after the first run: the rounds time replays, not
compiles. One seeded chat trace
(`kvbench trace gen chat`, seed 1, 9.3 new conversations/s: 100k requests span about an hour, as asv's
bench_enginesim) is replayed on 8 instances behind the cache-aware router by each tree in turn, the order
alternating from round to round so that drifting load on a shared machine falls on both alike. Each process
imports its own tree's `kvbench` and `kvbench.backends` (the editable install maps the latter to this
checkout, so the bootstrap below points it at the tree being timed, and prints which files it loaded).

Reported: each run's wall seconds, the medians and baseline/new ratio, and whether requests.parquet's columns
are identical between the two versions (else each differing column's largest absolute difference).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "benchmarks/results/enginesim_speed.json"
DEFAULT_BASELINE = "73dd89e37dfaaa0b5344439ac665432aa76976f9"  # the commit before the issue-18 speed work
SESSION_RATE = 9.3
REPLAY = ["--backend", "engine-sim", "--instances", "8", "--router", "cache-aware", "--no-report", "--overwrite"]

# Runs `kvbench` from the tree in argv[1]: its kvbench package first on sys.path, and kvbench.backends loaded
# from its backends/ folder before anything imports it (the editable install's finder would map it here).
BOOT = """
import importlib.util, sys
tree = sys.argv.pop(1)
sys.path.insert(0, tree)
import kvbench
spec = importlib.util.spec_from_file_location(
    "kvbench.backends", tree + "/backends/__init__.py", submodule_search_locations=[tree + "/backends"])
mod = importlib.util.module_from_spec(spec)
sys.modules["kvbench.backends"] = mod
spec.loader.exec_module(mod)
kvbench.backends = mod
import kvbench.backends.enginesim as es
print("engine-sim from", es.__file__, "kvbench from", kvbench.__file__, file=sys.stderr)
assert es.__file__.startswith(tree) and kvbench.__file__.startswith(tree)
from kvbench.cli import main
sys.argv[0] = "kvbench"
main()
"""


def git(*args: str, cwd: Path = REPO) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def run(tree: Path, args: list[str]) -> float:
    """Wall seconds of one whole `kvbench` process run from `tree`."""
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("PYTHONPATH", None)
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", BOOT, str(tree), *args], env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if proc.returncode:
        raise SystemExit(f"{tree}: kvbench {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")
    return wall


def build_kernels(tree: Path) -> None:
    """The tree's AOT kernel modules (those it knows how to build), so that no timed round compiles."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    for unit in ("kvbench.cache", "kvbench.backends.enginesim"):
        code = BOOT.split("from kvbench.cli import main")[0] + (
            f"from kvbench.cache import compiled\ntry:\n    compiled.build(unit={unit!r})\n"
            "except TypeError:\n    compiled.build()  # (a tree with one unit)\n"
        )
        subprocess.run([sys.executable, "-c", code, str(tree)], env=env, capture_output=True, text=True)


def compare(a: Path, b: Path) -> dict:
    """requests.parquet of the two runs, column by column: identical, or the largest absolute differences."""
    ta, tb = pq.read_table(a), pq.read_table(b)
    out = {"rows": ta.num_rows, "columns": ta.column_names, "identical": True, "differences": {}}
    if ta.column_names != tb.column_names or ta.num_rows != tb.num_rows:
        out.update(identical=False, differences={"shape": [ta.column_names, tb.column_names]})
        return out
    for name in ta.column_names:
        x, y = ta.column(name).to_pylist(), tb.column(name).to_pylist()
        if x == y or all(u == v or (u != u and v != v) for u, v in zip(x, y)):  # (NaN equals NaN here)
            continue
        out["identical"] = False
        try:
            xa, ya = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
            out["differences"][name] = {
                "rows": int(np.sum(~((xa == ya) | (np.isnan(xa) & np.isnan(ya))))),
                "max_abs": float(np.nanmax(np.abs(xa - ya))),
            }
        except (TypeError, ValueError):
            out["differences"][name] = {"rows": sum(u != v for u, v in zip(x, y))}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", default=DEFAULT_BASELINE, help="commit to compare against")
    ap.add_argument("--new", default=None, help="commit to time (default: this checkout, uncommitted changes included)")
    ap.add_argument("--requests", type=int, default=100_000, help="requests in the generated chat trace")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (each runs both versions once)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    a = ap.parse_args()
    new_commit = git("rev-parse", a.new or "HEAD")
    dirty = a.new is None and bool(git("status", "--porcelain", "--", "backends/enginesim", "kvbench"))
    base_commit = git("rev-parse", a.baseline)
    with tempfile.TemporaryDirectory(prefix="enginesim-speed-") as tmp:
        tmp = Path(tmp)
        base_tree = tmp / "baseline"
        git("worktree", "add", "--detach", str(base_tree), base_commit)
        new_tree = REPO
        if a.new:
            new_tree = tmp / "new"
            git("worktree", "add", "--detach", str(new_tree), new_commit)
        try:
            for tree in (base_tree, new_tree):
                build_kernels(tree)
            trace = tmp / f"chat-{a.requests}.parquet"
            gen = ["trace", "gen", "chat", "-n", str(a.requests), "--seed", "1", "--session-rate", str(SESSION_RATE)]
            run(REPO, [*gen, "-o", str(trace)])
            walls: dict[str, list[float]] = {"baseline": [], "new": []}
            trees = {"baseline": base_tree, "new": new_tree}
            for i in range(a.rounds):
                order = ["baseline", "new"] if i % 2 == 0 else ["new", "baseline"]
                for which in order:
                    wall = run(trees[which], ["replay", str(trace), *REPLAY, "--out", str(tmp / "runs" / which)])
                    walls[which].append(round(wall, 2))
                    print(f"round {i}: {which:8s} {wall:7.2f} s", flush=True)
            check = compare(tmp / "runs/baseline/requests.parquet", tmp / "runs/new/requests.parquet")
        finally:
            for tree in {base_tree, new_tree} - {REPO}:
                git("worktree", "remove", "--force", str(tree))
    med = {k: statistics.median(v) for k, v in walls.items()}
    result = {
        "command": f"kvbench trace gen chat -n {a.requests} --seed 1 --session-rate {SESSION_RATE} -o T.parquet; "
        f"kvbench replay T.parquet {' '.join(REPLAY)} --out DIR",
        "requests": a.requests,
        "rounds": a.rounds,
        "baseline_commit": base_commit,
        "new_commit": new_commit + (" (+ uncommitted changes)" if dirty else ""),
        "kernels": "ahead-of-time modules built before the rounds (compiles not timed)",
        "wall_s": walls,
        "median_s": med,
        "speedup": round(med["baseline"] / med["new"], 2),
        "requests_per_s": {k: round(a.requests / v) for k, v in med.items()},
        "requests_parquet": check,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "load_avg_end": os.getloadavg()},
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    print(json.dumps({k: result[k] for k in ("median_s", "speedup")}), "identical:", check["identical"])
    if not check["identical"]:
        print(json.dumps(check["differences"], indent=1))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
