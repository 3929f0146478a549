"""Azure LLM inference traces (2023 Splitwise release, 2024 week-long release): CSV of TIMESTAMP, ContextTokens,
GeneratedTokens.

The traces carry no prompt content, so there is no prefix identity: every request gets block ids of its own
(one content id per request, cut into blocks by `prompt_block_ids`), and an infinite cache never hits. The
metadata says so with `"prefix_identity": "none"`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..blockhash import name_key
from ..errors import TraceFormatError
from ..schema import conform
from ..traceio import new_meta
from . import importer
from ._csv import CsvFile, parse_datetimes
from ._ids import unique_block_ids

COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


@importer("azure")
def read_azure(src: Path, block_size: int = 16, workload: str | None = None):
    """Azure LLM inference trace CSV (TIMESTAMP, ContextTokens, GeneratedTokens; no prefix identity)."""
    src = Path(src)
    if block_size <= 0:
        raise TraceFormatError(f"block size {block_size} must be > 0")
    f = CsvFile(src, COLUMNS, "an Azure LLM inference trace")
    epoch_ns = parse_datetimes(f, "TIMESTAMP")
    inp = f.numbers("ContextTokens", int, lo=1, what=" (a request needs a prompt)")
    out = f.numbers("GeneratedTokens", int, lo=0)

    n = inp.size
    rows = np.arange(n)
    t0_ns = int(epoch_ns.min())
    arrival = (epoch_ns - t0_ns).astype(np.float64) / 1e9  # subtract in integers: no precision lost
    table = pa.table(
        {
            "request_id": pc.binary_join_element_wise(pa.scalar("az-"), pc.cast(pa.array(rows), pa.string()), ""),
            "arrival_s": arrival,
            "input_tokens": inp.astype(np.int32),
            "output_tokens": out.astype(np.int32),
            "block_hashes": unique_block_ids(name_key("import", "azure", src.name), rows, inp, block_size),
            "workload": pa.array(np.full(n, workload or "azure", dtype=object)),
            **f.extra_columns(),
        }
    )
    order = np.argsort(arrival, kind="stable")
    origin = str(np.datetime64(t0_ns, "ns"))
    source = {
        "importer": "azure",
        "file": src.name,
        "prefix_identity": "none",  # no content in the trace: every request has unique block ids
        "time_origin": origin,  # TIMESTAMP of the first request (UTC when the file gives an offset)
        "time_offset_s": t0_ns / 1e9,  # seconds since 1970 of the first request; arrivals are shifted to start at 0
        "reordered": bool(np.any(order != rows)),
    }
    return conform(table).take(order), new_meta(block_size, source)
