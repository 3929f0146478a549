"""Exporters: write a kvbench trace in formats other tools replay (AIPerf, `vllm bench serve`, GuideLLM)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa

from kvbench.registry import Registry
from kvbench.trace.files import TraceMeta
from kvbench.trace.schema import KNOWN_COLUMNS

# Each exporter registers with @exporter("format"): (table, meta, out, renumber=False) -> the file written.
EXPORTERS: Registry = Registry(None, "export format")
exporter = EXPORTERS.register


def _dense_ids(hashes: pa.ListArray) -> pa.ListArray:
    """Renumber ids 0, 1, 2, ... in order of first appearance (keeps equality, drops the 64-bit values)."""
    flat = np.asarray(hashes.flatten())
    _, first, inverse = np.unique(flat, return_index=True, return_inverse=True)
    rank = np.empty(first.size, dtype=np.int64)
    rank[np.argsort(first, kind="stable")] = np.arange(first.size)
    offsets = np.asarray(hashes.offsets) - hashes.offsets[0].as_py()
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(rank[inverse], pa.uint64()))


@exporter("mooncake")
def export_mooncake(table: pa.Table, meta: TraceMeta, out: str | Path, renumber: bool = False) -> Path:
    """Mooncake JSONL: {timestamp (integer ms), input_length, output_length, hash_ids} per request.

    Extra (non-schema) columns, such as those an importer kept from the source file, are written back, so
    that mooncake -> parquet -> mooncake preserves every field. The block size is implied (the file format
    has no place for it); AIPerf and `vllm bench serve` take it as an option.
    """
    out = Path(out)
    hashes = table.column("block_hashes").combine_chunks()
    if renumber:
        hashes = _dense_ids(hashes)
    stamps = table.column("arrival_s").to_numpy()
    if meta.source.get("importer") == "mooncake":  # restore the source's time origin and unit exactly
        scale = {"ms": 1e3, "s": 1.0, "us": 1e6}[meta.source.get("time_unit", "ms")]
        stamps = (stamps + float(meta.source.get("time_offset_s", 0.0))) * scale
    else:  # the replayers read integer milliseconds
        stamps = np.rint(stamps * 1e3)
    extras = [c for c in table.column_names if c not in KNOWN_COLUMNS]
    extra_values = {c: table.column(c).to_pylist() for c in extras}
    inp = table.column("input_tokens").to_pylist()
    outp = table.column("output_tokens").to_pylist()
    ids = hashes.to_pylist()
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as fh:
        for i in range(table.num_rows):
            ts = round(float(stamps[i]), 6)
            rec = {
                "timestamp": int(ts) if float(ts).is_integer() else ts,
                "input_length": inp[i],
                "output_length": outp[i],
                "hash_ids": ids[i],
            }
            for c in extras:
                if extra_values[c][i] is not None:
                    rec[c] = extra_values[c][i]
            fh.write(json.dumps(rec) + "\n")
    return out
