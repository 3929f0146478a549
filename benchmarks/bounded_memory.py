"""Peak memory of `kvbench trace info` and a streamed `sim` replay on a 10M-request trace.

    python benchmarks/bounded_memory.py [--requests 10000000] [--work DIR]

The trace: a generated chat trace of 1M requests (`kvbench trace gen chat`), repeated back to back until it has
the requested number of requests; each copy gets its own block ids (mixed with the copy number), request and
session ids, and is shifted in time, so that no copy can hit another's blocks. Generation itself is not
streamed yet, hence the repetition. Each command runs as its own process; its peak RSS is that process's
`ru_maxrss`. Results go to benchmarks/results/bounded_memory.json.

A streamed replay keeps nothing per request (its scan, a few bytes per request while it validates), so its
peak should hardly move between --requests 1000000 and 2000000.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from kvbench.blockhash import mix
from kvbench.tracescan import block_references

BASE_REQUESTS = 1_000_000
RESULTS = Path(__file__).parent / "results" / "bounded_memory.json"


def build_trace(base: Path, out: Path, requests: int) -> None:
    pf = pq.ParquetFile(base)
    duration = pq.read_table(base, columns=["arrival_s"]).column("arrival_s").to_numpy()[-1] + 1.0
    copies = -(-requests // pf.metadata.num_rows)
    written = 0
    with pq.ParquetWriter(out.with_suffix(".partial"), pf.schema_arrow, compression="zstd") as writer:
        for copy in range(copies):
            for batch in pf.iter_batches(batch_size=65536):
                if written >= requests:
                    break
                batch = batch.slice(0, min(batch.num_rows, requests - written))
                table = pa.Table.from_batches([batch])
                if copy:
                    table = _shifted(table, copy, copy * duration)
                writer.write_table(table)
                written += table.num_rows
    out.with_suffix(".partial").replace(out)


def _shifted(table: pa.Table, copy: int, dt: float) -> pa.Table:
    hashes = table.column("block_hashes").combine_chunks()
    flat = mix(np.asarray(hashes.flatten()), np.full(len(hashes.flatten()), copy, np.uint64))
    offsets = np.asarray(hashes.offsets) - hashes.offsets[0].as_py()
    columns = {
        "block_hashes": pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(flat, pa.uint64())),
        "arrival_s": pc.add(table.column("arrival_s"), dt),
    }
    for name in ("request_id", "session_id", "user_id", "parent_id"):
        if name in table.column_names and table.column(name).null_count < table.num_rows:
            columns[name] = pc.binary_join_element_wise(table.column(name), pa.scalar(f"c{copy}"), "~")
    for name, values in columns.items():
        i = table.schema.get_field_index(name)
        table = table.set_column(i, table.schema.field(i), values.cast(table.schema.field(i).type))
    return table


def measure(cmd: list[str]) -> dict:
    """Run `cmd`; its wall time, CPU time and peak RSS (call from a process that has run no other child:
    ru_maxrss of the children is the largest of any of them). CPU time is the steadier figure on a shared
    machine."""
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode:
        sys.exit(f"{' '.join(cmd)} failed:\n{proc.stderr}")
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {
        "command": " ".join(cmd),
        "wall_s": round(wall, 1),
        "cpu_s": round(usage.ru_utime + usage.ru_stime, 1),
        "peak_rss_mb": round(usage.ru_maxrss / 1024),
    }


def main() -> None:
    if sys.argv[1:2] == ["--measure"]:
        print(json.dumps(measure(sys.argv[2:])))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=10_000_000, help="requests in the trace (default 10M)")
    ap.add_argument("--capacity", default="2000000", help="cache capacity in blocks (default 2M)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/kvbench-bounded"), help="directory for the traces")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    base = args.work / "chat-1m.parquet"
    if not base.exists():
        subprocess.run(
            ["kvbench", "trace", "gen", "chat", "-n", str(BASE_REQUESTS), "--seed", "1", "-o", str(base)], check=True
        )
    big = args.work / f"chat-{args.requests // 1_000_000}m.parquet"
    if not big.exists():
        t0 = time.perf_counter()
        build_trace(base, big, args.requests)
        print(f"built {big} in {time.perf_counter() - t0:.0f} s")
    refs = block_references(big)
    results = {"requests": args.requests, "block_references": refs, "file_mb": round(big.stat().st_size / 2**20)}
    for key, cmd in (
        ("trace_info", ["kvbench", "trace", "info", str(big), "--json"]),
        (
            "replay_lru_vllm",
            [
                "kvbench",
                "replay",
                str(big),
                "--policy",
                "lru,vllm",
                "--capacity",
                args.capacity,
                "--stream",
                "--out",
                str(args.work / "run"),
                "--no-report",
            ],
        ),
    ):
        # each measurement from a fresh interpreter, so that ru_maxrss is that command's own peak
        child = subprocess.run([sys.executable, __file__, "--measure", *cmd], capture_output=True, text=True)
        if child.returncode:
            sys.exit(child.stderr)
        results[key] = json.loads(child.stdout)
        print(key, results[key])
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
