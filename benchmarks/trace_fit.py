"""Cross-trace fidelity of `kvbench trace fit`: how close a synthetic twin's cache behaviour is to its trace, on
every trace available to the project, with a held-out rule.

Targets on every trace: the twin's infinite-cache token hit rate within 0.02 of the trace's, and its radix-lru
hit rate within 0.03 at each of 8 capacities from 1% to 100% of the trace's distinct blocks (token hit rates
after the warm-up half). A `--scale 2` twin is compared at twice each capacity (the same cache per user).

Traces: the Mooncake FAST'25 conversation trace and the kv-cache-tester agentic traces (../shared/traces, their
licences beside them), and kvbench's five generated kinds and `mix`, each generated at 3 seeds drawn at random
per run (printed, and written to the results). Each twin is made with a seed drawn the same way.

Held-out rule: nothing in the fit (kvbench/trace/fit) was chosen by looking at these traces' figures; its
estimators are stated in docs/semantics.md (Fitting a synthetic twin) and the only constants are sizes and
search bounds (rows kept, records looked through, length bands) that say nothing of any trace. Other public
traces than these check the fit and are kept out of the project.

Each step is a kvbench command as a user types it (`kvbench trace import`, `kvbench trace gen`, `kvbench trace
fit`, whose parameters JSON holds the self-check). Writes benchmarks/results/trace_fit.json.

    python benchmarks/trace_fit.py [--seeds S1,S2,S3] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "trace_fit.json"
SHARED = REPO.parent / "shared" / "traces"
PUBLIC = {  # name -> (importer, source)
    "mooncake-conversation": ("mooncake", SHARED / "mooncake" / "conversation_trace.jsonl"),
    "kv-cache-tester": ("kv-cache-tester", SHARED / "kv-cache-tester"),
}
KINDS = {"chat": 2000, "agent": 1000, "multimodal": 2000, "reasoning": 500, "multi-tenant": 2000, "mix": 2000}
INFINITE_TARGET, CURVE_TARGET = 0.02, 0.03


def kvbench(*args: str) -> None:
    print("$ kvbench " + " ".join(args), file=sys.stderr, flush=True)
    cmd = [shutil.which("kvbench") or "kvbench", *args]
    subprocess.run(cmd, check=True, cwd=REPO, stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL)


def traces(work: Path, seeds: list[int]) -> dict[str, Path]:
    out = {}
    for name, (importer, src) in PUBLIC.items():
        if not src.exists():
            print(f"skipping {name}: {src} not found", file=sys.stderr)
            continue
        out[name] = work / f"{name}.parquet"
        kvbench("trace", "import", importer, str(src), "-o", str(out[name]))
    for kind, n in KINDS.items():
        for s in seeds:
            out[f"{kind}-s{s}"] = work / f"{kind}-s{s}.parquet"
            kvbench("trace", "gen", kind, "-n", str(n), "--seed", str(s), "-o", str(out[f"{kind}-s{s}"]))
    return out


def measure(name: str, path: Path, work: Path, seed: int, scale: float) -> dict:
    twin = work / f"{name}-twin-{seed}-x{scale:g}.parquet"
    started = time.monotonic()
    kvbench("trace", "fit", str(path), "-o", str(twin), "--seed", str(seed), "--scale", f"{scale:g}")
    params = json.loads(twin.with_suffix(".params.json").read_text())
    fid = params["fidelity"]
    off = [g for g, v in fid["statistics"].items() if v["worst_ratio"] > 1]
    # capacities (of TRACE's curve) that hold at least one 90th-percentile prompt: below that, a K-times twin's
    # disjoint copies replace each other's prompts under radix-lru whatever the twin (docs/semantics.md)
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    lengths = pc.list_value_length(pq.read_table(path, columns=["block_hashes"]).column("block_hashes"))
    prompt = float(np.quantile(lengths.to_numpy(zero_copy_only=False), 0.9))
    above = [abs(c["original"]["steady"] - c["twin"]["steady"]) for c in fid["curve"] if c["capacity_blocks"] >= prompt]
    return {
        "trace": name,
        "twin_seed": seed,
        "scale": scale,
        "seconds": round(time.monotonic() - started, 1),
        "infinite_cache": fid["infinite_cache"],
        "infinite_cache_gap": fid["infinite_cache"]["gap_steady"],
        "max_curve_gap": fid["max_curve_gap_steady"],
        "curve": fid["curve"],
        "faithful": fid["faithful"],
        "statistics_off": off,
        "moved_share": params["placement"]["moved_share"],
        "p90_prompt_blocks": prompt,
        "max_curve_gap_from_one_prompt": max(above, default=0.0),
    }


def exact_copies(name: str, path: Path, work: Path, k: int = 2) -> dict:
    """The trace and k - 1 renamed copies of it, in lockstep (each request beside its copies), measured as a
    k-times twin is: k times the trace's own users, exactly, at k times the cache. Where a twin misses the
    target by as much as these copies do, the miss is the comparison's under LRU, not the twin's units'."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from kvbench.cache.prepared import fold_isolation
    from kvbench.run import twin as twin_measure
    from kvbench.trace.files import new_meta, write_trace
    from kvbench.trace.validation import read_valid_trace

    table, meta = read_valid_trace(path)
    table = table.sort_by([("arrival_s", "ascending")])
    hashes = fold_isolation(table)
    parts = []
    for c in range(k):
        ids = pc.list_flatten(hashes).to_numpy().astype(np.uint64) * np.uint64(2 * c + 1) + np.uint64(c)
        renamed = pa.ListArray.from_arrays(hashes.offsets, pa.array(ids, pa.uint64()))
        parts.append(
            pa.table(
                {
                    "request_id": pc.binary_join_element_wise(table.column("request_id"), f"-c{c}", ""),
                    "arrival_s": table.column("arrival_s"),
                    "input_tokens": table.column("input_tokens"),
                    "output_tokens": table.column("output_tokens"),
                    "block_hashes": renamed,
                }
            )
        )
    both = pa.concat_tables(parts)
    both = both.take(np.argsort(np.tile(np.arange(table.num_rows), k), kind="stable"))
    out = write_trace(both, work / f"{name}-exact-x{k}.parquet", new_meta(meta.block_size, {"generator": "copies"}))
    fid = twin_measure.fidelity(table, path, both, out, meta.block_size, float(k))
    return {"infinite_cache_gap": fid["infinite_cache"]["gap_steady"], "max_curve_gap": fid["max_curve_gap_steady"]}


def seed_to_seed(kind: str, paths: list[Path]) -> dict:
    """The same generator at two seeds, measured as a twin is: how far apart two draws of one workload are.
    No twin of one draw can be expected closer to it than another draw of the same generator."""
    from kvbench.run import twin as twin_measure
    from kvbench.trace.validation import read_valid_trace

    gaps = []
    for a, b in zip(paths, paths[1:] + paths[:1]):
        ta, meta = read_valid_trace(a)
        tb, _ = read_valid_trace(b)
        fid = twin_measure.fidelity(ta, a, tb, b, meta.block_size)
        inf, curve = fid["infinite_cache"]["gap_steady"], fid["max_curve_gap_steady"]
        gaps.append({"infinite_cache_gap": inf, "max_curve_gap": curve})
    return {
        "pairs": gaps,
        "median_infinite_cache_gap": float(np.median([g["infinite_cache_gap"] for g in gaps])),
        "median_max_curve_gap": float(np.median([g["max_curve_gap"] for g in gaps])),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", help="3 seeds for the generated kinds and the twins [default: drawn at random]")
    ap.add_argument("--keep", type=Path, help="keep the traces, twins and reports in DIR")
    args = ap.parse_args()
    if args.seeds:
        seeds = [int(s) for s in args.seeds.split(",")]
    else:
        seeds = [int(s) for s in np.random.SeedSequence().generate_state(3) % 100_000]
    print(f"seeds {','.join(map(str, seeds))}", file=sys.stderr)
    work = args.keep or Path(tempfile.mkdtemp(prefix="kvbench-trace-fit-"))
    work.mkdir(parents=True, exist_ok=True)
    runs = []
    floors = {}
    try:
        paths = traces(work, seeds)
        for kind in KINDS:
            floors[kind] = seed_to_seed(kind, [paths[f"{kind}-s{s}"] for s in seeds])
        copies = {name: exact_copies(name, path, work) for name, path in paths.items()}
        for i, (name, path) in enumerate(paths.items()):
            for scale in (1.0, 2.0):
                r = measure(name, path, work, seeds[i % len(seeds)], scale)
                runs.append(r)
                print(
                    f"{name:26s} x{scale:g}  infinite-cache gap {r['infinite_cache_gap']:.4f}  "
                    f"curve gap {r['max_curve_gap']:.4f}  moved {r['moved_share']:4.0%}  "
                    f"off: {', '.join(r['statistics_off']) or '-'}",
                    flush=True,
                )
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    by_trace: dict[str, dict] = {}
    for r in runs:
        group = r["trace"].rsplit("-s", 1)[0] if r["trace"] not in PUBLIC else r["trace"]
        g = by_trace.setdefault(group, {"worst_infinite_cache_gap": 0.0, "worst_max_curve_gap": 0.0})
        g["worst_infinite_cache_gap"] = max(g["worst_infinite_cache_gap"], r["infinite_cache_gap"])
        g["worst_max_curve_gap"] = max(g["worst_max_curve_gap"], r["max_curve_gap"])
        g["worst_curve_gap_from_one_prompt"] = max(g.get("worst_curve_gap_from_one_prompt", 0.0),
                                                   r["max_curve_gap_from_one_prompt"])  # fmt: skip
        at = f"worst_max_curve_gap_x{r['scale']:g}"
        g[at] = max(g.get(at, 0.0), r["max_curve_gap"])
        c = g.setdefault("exact_copies_x2", {"infinite_cache_gap": 0.0, "max_curve_gap": 0.0})
        for key in c:  # the worst over a kind's seeds
            c[key] = max(c[key], copies[r["trace"]][key])
    for name, g in by_trace.items():
        worst_inf, worst_curve = g["worst_infinite_cache_gap"], g["worst_max_curve_gap"]
        g["meets_target"] = worst_inf <= INFINITE_TARGET and worst_curve <= CURVE_TARGET
        if name in floors:
            g["seed_to_seed"] = floors[name]
    print(
        "\ntrace                worst gaps: infinite  curve x1  curve x2   met   from one prompt   "
        "exact 2-copy: curve   another seed: curve"
    )
    for name, g in by_trace.items():
        floor = g.get("seed_to_seed")
        ref = f"{floor['median_max_curve_gap']:>8.4f}" if floor else ""
        print(
            f"{name:21s}{g['worst_infinite_cache_gap']:>20.4f}{g['worst_max_curve_gap_x1']:>10.4f}"
            f"{g['worst_max_curve_gap_x2']:>10.4f}   {str(g['meets_target']):5s}"
            f"{g['worst_curve_gap_from_one_prompt']:>16.4f}{g['exact_copies_x2']['max_curve_gap']:>22.4f}"
            f"{' ' * 14}{ref}"
        )
    RESULTS.write_text(
        json.dumps(
            {
                "benchmark": "trace_fit",
                "command": "python benchmarks/trace_fit.py --seeds " + ",".join(map(str, seeds)),
                "seeds": seeds,
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "target": {"infinite_cache_gap": INFINITE_TARGET, "max_curve_gap": CURVE_TARGET},
                "hit_rate": "token hit rate after the warm-up half; scale-2 twins at twice each capacity",
                "seed_to_seed": "per generated kind: the same generator at two of the seeds, measured as a twin is",
                "curve_gap_from_one_prompt": "the curve gap over the capacities that hold at least the trace's "
                "90th-percentile prompt (blocks)",
                "exact_copies_x2": "per trace (the worst over a kind's seeds): the trace and a renamed copy in "
                "lockstep, measured as a scale-2 twin is (the trace's own users twice, exactly, at twice the cache)",
                "worst": {
                    "infinite_cache_gap": max(r["infinite_cache_gap"] for r in runs),
                    "max_curve_gap": max(r["max_curve_gap"] for r in runs),
                },
                "traces": by_trace,
                "runs": runs,
            },
            indent=1,
        )
        + "\n"
    )
    print(f"wrote {RESULTS}", file=sys.stderr)


if __name__ == "__main__":
    main()
