"""BurstGPT (HPMLL/BurstGPT): CSV of Timestamp (s), Model, Request tokens, Response tokens, Total tokens, Log Type.

Like Azure, the trace carries no prompt content, so every request gets block ids of its own
(`"prefix_identity": "none"` in the metadata). Failed requests (Response tokens == 0, present in the
`BurstGPT_*.csv` files and absent from the `*_without_fails_*` ones) are kept with output_tokens 0 and counted
in the metadata. Model becomes the extra column `model`; Log Type ("Conversation log", "API log") becomes the
workload label. Total tokens is redundant; rows where it differs from Request + Response are counted, not
rejected. Unknown columns (later releases announce e.g. session ids) are kept as string columns.
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
from ._csv import CsvFile
from ._ids import unique_block_ids

COLUMNS = ("Timestamp", "Model", "Request tokens", "Response tokens", "Total tokens", "Log Type")
TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}


@importer("burstgpt", options={"drop_empty_prompts": "drop (and count) rows with 0 request tokens instead of failing"})
def read_burstgpt(
    src: Path,
    block_size: int = 16,
    time_unit: str | None = None,
    workload: str | None = None,
    drop_empty_prompts: bool = False,
):
    """BurstGPT CSV (Timestamp s, Model, Request/Response/Total tokens, Log Type; no prefix identity).

    `drop_empty_prompts`: rows with Request tokens == 0 cannot be replayed (a prompt needs a token); by
    default they are an error naming the first such line; with True they are dropped and counted in the
    metadata (`dropped_empty_prompts`).
    """
    src = Path(src)
    unit = time_unit or "s"
    if unit not in TIME_UNITS:
        raise TraceFormatError(f"time unit {unit!r} unknown; use one of {', '.join(TIME_UNITS)}")
    if block_size <= 0:
        raise TraceFormatError(f"block size {block_size} must be > 0")
    f = CsvFile(src, COLUMNS, "a BurstGPT")
    ts = f.numbers("Timestamp", float, lo=0)
    inp = f.numbers("Request tokens", int, lo=0)
    out = f.numbers("Response tokens", int, lo=0)
    total = f.numbers("Total tokens", int, lo=0)
    model = f.strings("Model")
    log_type = f.strings("Log Type")
    for name, col in (("Model", model), ("Log Type", log_type)):
        empty = pc.equal(col, "")
        if pc.any(empty).as_py():
            raise f.error(int(pc.index(empty, True).as_py()), name, "is empty; every row needs a value")

    rows = np.arange(inp.size)
    empty_prompt = inp == 0
    if empty_prompt.any() and not drop_empty_prompts:
        row = int(np.flatnonzero(empty_prompt)[0])
        raise f.error(
            row,
            "Request tokens",
            f"is 0 ({int(empty_prompt.sum())} rows): a request needs a prompt; "
            "import with drop_empty_prompts=True to drop these rows (they are counted in the metadata)",
        )
    keep = ~empty_prompt
    take = pa.array(rows[keep])
    rows, ts, inp, out, total = rows[keep], ts[keep], inp[keep], out[keep], total[keep]
    model, log_type = model.take(take), log_type.take(take)
    extras = {k: v.take(take) for k, v in f.extra_columns().items()}

    arrival = ts * TIME_UNITS[unit]
    t0 = float(arrival.min())
    arrival = arrival - t0
    n = rows.size
    columns = {
        "request_id": pc.binary_join_element_wise(pa.scalar("bg-"), pc.cast(pa.array(rows), pa.string()), ""),
        "arrival_s": arrival,
        "input_tokens": inp.astype(np.int32),
        "output_tokens": out.astype(np.int32),
        "block_hashes": unique_block_ids(name_key("import", "burstgpt", src.name), rows, inp, block_size),
        "workload": pa.array(np.full(n, workload, dtype=object)) if workload else log_type,
        "model": model.dictionary_encode(),
    }
    if workload:  # the label replaces Log Type as workload; keep Log Type itself
        columns["log_type"] = log_type.dictionary_encode()
    table = pa.table({**columns, **extras})
    order = np.argsort(arrival, kind="stable")
    source = {
        "importer": "burstgpt",
        "file": src.name,
        "prefix_identity": "none",  # no content in the trace: every request has unique block ids
        "time_unit": unit,
        "time_offset_s": t0,  # arrivals are shifted to start at 0; the exporter adds this back
        "failed_requests": int(np.sum(out == 0)),  # Response tokens == 0, kept with output_tokens 0
        "dropped_empty_prompts": int(empty_prompt.sum()),
        "total_tokens_mismatch": int(np.sum(total != inp + out)),
        "reordered": bool(np.any(order != np.arange(n))),
    }
    return conform(table).take(order), new_meta(block_size, source)
