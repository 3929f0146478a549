"""Azure LLM inference traces (2023 Splitwise release, 2024 week-long release): CSV of TIMESTAMP, ContextTokens,
GeneratedTokens.

The traces carry no prompt content, so there is no prefix identity: every request gets block ids of its own
(one content id per request, cut into blocks by `prompt_block_ids`), and an infinite cache never hits. The
metadata says so with `"prefix_identity": "none"`.

`kvbench trace import azure` streams (`write_azure`): a survey of the CSV block by block, then conversion block
by block; the week-long 2024 traces hold tens of millions of requests.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kvbench.errors import TraceFormatError
from kvbench.trace.blockhash import name_key
from kvbench.trace.files import new_meta
from kvbench.trace.importers import block_size_option, importer, workload_option
from kvbench.trace.importers._csv import CsvFile, FirstErrors, parse_datetimes
from kvbench.trace.importers._ids import unique_block_ids
from kvbench.trace.schema import conform
from kvbench.trace.writer import TraceWriter

COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
FORMAT = "an Azure LLM inference trace"


def _arrivals(f: CsvFile, errors: FirstErrors | None = None) -> tuple:
    """(epoch ns, input, output) of a file or part, each value checked (errors name line and column); with
    `errors`, a failed check is recorded there and its column is None."""
    epoch_ns = FirstErrors.check(errors, "TIMESTAMP", lambda: parse_datetimes(f, "TIMESTAMP"))
    what = " (a request needs a prompt)"
    inp = FirstErrors.check(errors, "ContextTokens", lambda: f.numbers("ContextTokens", int, lo=1, what=what))
    return epoch_ns, inp, FirstErrors.check(errors, "GeneratedTokens", lambda: f.numbers("GeneratedTokens", int, lo=0))


def _table(f: CsvFile, parsed: tuple, t0_ns: int, block_size: int, workload: str | None) -> pa.Table:
    """A file or part (`parsed`: its `_arrivals`) as trace rows, in file order; request ids and block ids
    follow the file's row numbers."""
    epoch_ns, inp, out = parsed
    n = inp.size
    rows = np.arange(f.first_row, f.first_row + n)
    arrival = (epoch_ns - t0_ns).astype(np.float64) / 1e9  # subtract in integers: no precision lost
    return conform(
        pa.table(
            {
                "request_id": pc.binary_join_element_wise(pa.scalar("az-"), pc.cast(pa.array(rows), pa.string()), ""),
                "arrival_s": arrival,
                "input_tokens": inp.astype(np.int32),
                "output_tokens": out.astype(np.int32),
                "block_hashes": unique_block_ids(name_key("import", "azure", f.path.name), rows, inp, block_size),
                "workload": pa.array(np.full(n, workload or "azure", dtype=object)),
                **f.extra_columns(),
            }
        )
    )


def _meta(src: Path, t0_ns: int, reordered: bool, block_size: int):
    source = {
        "importer": "azure",
        "file": src.name,
        "prefix_identity": "none",  # no content in the trace: every request has unique block ids
        "time_origin": str(np.datetime64(t0_ns, "ns")),  # TIMESTAMP of the first request (UTC given an offset)
        "time_offset_s": t0_ns / 1e9,  # seconds since 1970 of the first request; arrivals are shifted to start at 0
        "reordered": reordered,
    }
    return new_meta(block_size, source)


def _check(block_size: int) -> None:
    if block_size <= 0:
        raise TraceFormatError(f"block size {block_size} must be > 0")


def write_azure(
    src: Path, out: Path, block_size: int = 16, workload: str | None = None, block_bytes: int = 16 << 20
) -> int:
    """`read_azure` written to `out` a block of the CSV at a time (validated as it is written); returns the
    row count. Memory: one block. A file whose timestamps are out of order is sorted in memory."""
    src = Path(src)
    _check(block_size)
    f = CsvFile(src, COLUMNS, FORMAT, read=False)
    errors, t0_ns, last, in_order = FirstErrors(), None, None, True
    for part in f.parts(block_bytes):  # survey: every value checked, the earliest time, whether times are sorted
        epoch_ns = _arrivals(part, errors)[0]
        if epoch_ns is not None and epoch_ns.size:
            in_order &= bool(last is None or epoch_ns[0] >= last) and bool(np.all(np.diff(epoch_ns) >= 0))
            t0_ns = int(epoch_ns.min()) if t0_ns is None else min(t0_ns, int(epoch_ns.min()))
            last = epoch_ns[-1]
    errors.raise_first(COLUMNS)
    if not in_order:
        table, meta = read_azure(src, block_size, workload)
        with TraceWriter(out, meta) as writer:
            writer.write(table)
        return writer.rows
    with TraceWriter(out, _meta(src, t0_ns, False, block_size)) as writer:
        for part in f.parts(block_bytes):
            writer.write(_table(part, _arrivals(part), t0_ns, block_size, workload))
    return writer.rows


@dataclass(frozen=True)
class AzureOptions:
    block_size: int = block_size_option(16)
    workload: str | None = workload_option()


@importer("azure", AzureOptions, write=write_azure)
def read_azure(src: Path, block_size: int = 16, workload: str | None = None):
    """Azure LLM inference trace CSV (TIMESTAMP, ContextTokens, GeneratedTokens; no prefix identity)."""
    src = Path(src)
    _check(block_size)
    f = CsvFile(src, COLUMNS, FORMAT)
    parsed = _arrivals(f)
    t0_ns = int(parsed[0].min())
    table = _table(f, parsed, t0_ns, block_size, workload)
    order = np.argsort(np.asarray(table.column("arrival_s")), kind="stable")
    return table.take(order), _meta(src, t0_ns, bool(np.any(order != np.arange(order.size))), block_size)
