"""How far the `llama-slot` prediction holds when requests overlap on llama.cpp (README, Predictions that pair
with the live run). At concurrency 1 every request's cached_tokens is predicted exactly; with requests in flight
together, the slot a prompt takes depends on which slots are busy at that instant, which a cache simulation does
not know. This measures the share of requests still exact, per trace, against the running `kvbench engine up
llama-cpp` (restarted empty before each trace), chat traces at seeds drawn at random per run (printed).

    python benchmarks/llama_concurrency.py [--seeds S1,S2,S3] [--concurrency 4] [--requests 40]

Writes benchmarks/results/llama_concurrency.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from kvbench import engines

RESULTS = Path(__file__).resolve().parent / "results" / "llama_concurrency.json"


def kvbench(*args) -> None:
    cmd = [shutil.which("kvbench") or "kvbench", *map(str, args)]
    subprocess.run(cmd, check=True, capture_output=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", help="chat trace seeds [default: 3 drawn at random]")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--requests", type=int, default=40)
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else [
        int(s) for s in np.random.SeedSequence().generate_state(3) % 100_000
    ]
    print(f"seeds {','.join(map(str, seeds))}", file=sys.stderr)
    info = engines.running("llama-cpp")
    if info is None:
        sys.exit("start llama.cpp first: kvbench engine up llama-cpp")
    work, rows = Path(tempfile.mkdtemp(prefix="kvbench-llama-conc-")), []
    common = ["--max-output-tokens", 4, "--fit-context", "truncate", "--no-report"]
    for seed in seeds:
        trace = work / f"chat-{seed}.parquet"
        kvbench("trace", "gen", "chat", "-n", args.requests, "--seed", seed, "-o", trace)
        shares = {}
        for conc in (1, args.concurrency):
            engines.down("llama-cpp")
            info = engines.up("llama-cpp", restart=True, **info.settings)
            live, pred = work / f"live-{seed}-{conc}", work / f"pred-{seed}-{conc}"
            kvbench("replay", trace, "--backend", "openai", "--url", info.url, "--mode", "rate", "--rate", 1000,
                    "--max-concurrency", conc, *common, "--out", live)  # fmt: skip
            kvbench("replay", trace, "--like", info.url, "--no-bound", *common, "--out", pred)
            got = pq.read_table(live / "requests.parquet").column("cached_tokens").to_pylist()
            want = pq.read_table(pred / "requests.parquet").column("hit_tokens").to_pylist()
            shares[conc] = float(np.mean([g == w for g, w in zip(got, want)]))
        rows.append({"seed": seed, "exact_share": {str(c): s for c, s in shares.items()}})
        print(f"seed {seed}: exact share " + ", ".join(f"concurrency {c}: {s:.3f}" for c, s in shares.items()))
    shutil.rmtree(work, ignore_errors=True)
    conc = str(args.concurrency)
    result = {
        "command": " ".join(["python benchmarks/llama_concurrency.py", "--seeds", ",".join(map(str, seeds)),
                             "--concurrency", conc, "--requests", str(args.requests)]),  # fmt: skip
        "engine": {"name": "llama-cpp", **info.settings},
        "runs": rows,
        "median_exact_share": {c: float(np.median([r["exact_share"][c] for r in rows])) for c in ("1", conc)},
    }
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    print(f"median exact share: {result['median_exact_share']}; wrote {RESULTS}")


if __name__ == "__main__":
    main()
