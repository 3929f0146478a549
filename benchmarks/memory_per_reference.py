"""Peak memory of an in-memory `sim` replay, per block reference (issue 18: the target is 24 bytes).

    python benchmarks/memory_per_reference.py [--requests 100000,300000] [--work DIR]

For each size a chat trace is generated (`kvbench trace gen chat -n N --seed 1`), then replayed whole
(`kvbench replay TRACE --policy lru --capacity 100000 --no-bound --no-report --no-stream`), each command its
own process, started from this one so that `ru_maxrss` of the children is the replay's peak RSS. The baseline
is the peak of a process that imports what the replay imports and reads nothing; bytes per reference =
(replay peak - baseline) / block references. Writes benchmarks/results/memory_per_reference.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "memory_per_reference.json"
BASELINE = (
    "import kvbench.cli.replay, kvbench.run.runner; from kvbench.run.plugins import load_backend; load_backend('sim')"
)


def peak_mb(cmd: list[str]) -> float:
    """Peak RSS (MB) of `cmd`, run in a fresh child of a fresh interpreter (ru_maxrss of the children is the
    largest of them, so each measurement gets its own parent)."""
    probe = (
        "import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, capture_output=True); "
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024)"
    )
    out = subprocess.run([sys.executable, "-c", probe, *cmd], check=True, capture_output=True, text=True)
    return float(out.stdout.split()[-1])


def block_references(trace: Path) -> int:
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    hashes = pq.read_table(trace, columns=["block_hashes"]).column("block_hashes")
    return int(pc.sum(pc.list_value_length(hashes)).as_py())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", default="100000,300000", help="trace sizes (requests), comma-separated")
    ap.add_argument("--work", type=Path, help="keep the traces in DIR")
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="kvbench-mem-"))
    work.mkdir(parents=True, exist_ok=True)
    baseline = peak_mb([sys.executable, "-c", BASELINE])
    rows = []
    for n in (int(x) for x in args.requests.split(",")):
        trace = work / f"chat-{n}.parquet"
        if not trace.exists():
            subprocess.run(["kvbench", "trace", "gen", "chat", "-n", str(n), "--seed", "1", "-o", str(trace)],
                           check=True, capture_output=True)  # fmt: skip
        refs = block_references(trace)
        cmd = ["kvbench", "replay", str(trace), "--policy", "lru", "--capacity", "100000", "--no-bound",
               "--no-report", "--no-stream", "--overwrite", "--out", str(work / f"run-{n}")]  # fmt: skip
        peak = peak_mb(cmd)
        row = {
            "requests": n,
            "block_references": refs,
            "peak_rss_mb": round(peak, 1),
            "bytes_per_reference": round((peak - baseline) * 2**20 / refs, 1),
        }
        print(row, file=sys.stderr)
        rows.append(row)
    RESULTS.write_text(
        json.dumps(
            {
                "benchmark": "memory_per_reference",
                "command": "python benchmarks/memory_per_reference.py --requests " + args.requests,
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "machine": {"python": platform.python_version(), "platform": platform.platform()},
                "target_bytes_per_reference": 24,
                "baseline_rss_mb": round(baseline, 1),
                "rows": rows,
            },
            indent=1,
        )
        + "\n"
    )
    print(f"wrote {RESULTS}", file=sys.stderr)


if __name__ == "__main__":
    main()
