"""The numbers `kvbench trace info` prints, summed chunk by chunk in row order.

`TraceSummary` takes a trace's light per-request columns (arrival, lengths, workload, tenant, session, user;
never the block ids) with the infinite cache's hit blocks of the same rows, and keeps only totals. State:
the length distributions as (value, count) pairs, which grow with the distinct lengths (bounded by the
longest prompt), not with requests; the distinct sessions and users as sorted 64-bit hashes (8 bytes each
while counting, exact but for a hash collision: odds ~1e-6 with 10M ids); a row of sums per workload and
tenant label. A trace in memory is the one-chunk case, so both paths print the same numbers.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from kvbench.trace.compute import pc
from kvbench.trace.hitsums import NO_LABEL, HitSums

PERCENTILES = (50, 90, 99)
COLUMNS = ("arrival_s", "input_tokens", "output_tokens", "workload", "tenant", "session_id", "user_id")


def percentiles_of_counts(values: np.ndarray, counts: np.ndarray, qs=PERCENTILES) -> list[float]:
    """`np.percentile(data, qs)` (linear method) of the data with `values` (sorted, distinct) occurring
    `counts` times, computed as numpy does, float operation for float operation, so the results are equal."""
    n = int(counts.sum())
    q = np.true_divide(np.asarray(qs, dtype=np.float64), 100)
    virtual = (n - 1) * q  # numpy's virtual index for the linear method
    previous = np.floor(virtual)
    nxt = previous + 1
    previous = np.where(virtual < 0, 0, np.where(virtual >= n - 1, n - 1, previous)).astype(np.int64)
    nxt = np.where(virtual < 0, 0, np.where(virtual >= n - 1, n - 1, nxt)).astype(np.int64)
    gamma = np.asarray(virtual - np.floor(virtual), dtype=np.float64)
    ends = np.cumsum(counts)  # sorted rank r holds values[searchsorted(ends, r, 'right')]
    a = values[np.searchsorted(ends, previous, side="right")]
    b = values[np.searchsorted(ends, nxt, side="right")]
    diff = b - a
    out = np.add(a, diff * gamma)
    np.subtract(b, diff * (1 - gamma), out=out, where=gamma >= 0.5, casting="unsafe")
    return [float(x) for x in out]


class _Distribution:
    """An integer column as sorted distinct values and their counts."""

    def __init__(self):
        self.values = np.zeros(0, np.int64)
        self.counts = np.zeros(0, np.int64)
        self.total = 0

    def add(self, x: np.ndarray) -> None:
        values, counts = np.unique(x, return_counts=True)
        self.total += int(x.sum())
        merged, inverse = np.unique(np.concatenate([self.values, values]), return_inverse=True)
        self.counts = np.bincount(inverse, np.concatenate([self.counts, counts]), len(merged)).astype(np.int64)
        self.values = merged  # (bincount sums counts as float64: exact below 2**53 rows)

    def result(self) -> dict:
        n = int(self.counts.sum())
        if n == 0:
            return {"total": 0, "mean": 0.0, **{f"p{p}": 0.0 for p in PERCENTILES}, "max": 0.0}
        pct = percentiles_of_counts(self.values, self.counts)
        # the mean as np.mean has it: the integer sum is exact in float64 below 2**53
        return {
            "total": self.total,
            "mean": float(np.float64(self.total) / n),
            **{f"p{p}": v for p, v in zip(PERCENTILES, pct)},
            "max": float(self.values[-1]),
        }


class _DistinctHashes:
    """Distinct non-null strings of a column, counted by 64-bit hash. Per-chunk distinct hashes are kept
    and merged whenever they outgrow the merged set, so the work stays linear in the distinct count."""

    def __init__(self):
        self.merged = np.zeros(0, np.uint64)
        self.parts: list[np.ndarray] = []
        self.pending = 0

    def add(self, col) -> None:
        import polars as pl  # loaded on use: the CLI starts faster without it

        if col is None or col.null_count == len(col):
            return
        ids = pl.from_arrow(_text(col)).drop_nulls()
        self.parts.append(np.unique(ids.hash(seed=0).to_numpy()))
        self.pending += self.parts[-1].size
        if self.pending > max(self.merged.size, 1 << 20):
            self._merge()

    def _merge(self) -> None:
        self.merged = np.unique(np.concatenate([self.merged, *self.parts]))
        self.parts, self.pending = [], 0

    def count(self) -> int:
        self._merge()
        return int(self.merged.size)


def _text(col):
    return col.cast(pa.string()) if pa.types.is_dictionary(col.type) else col


class _LabelSums:
    """Per label: requests, input tokens, output tokens, infinite-cache hit tokens."""

    def __init__(self):
        self.sums: dict[str | None, np.ndarray] = {}

    def add(self, labels, inp: np.ndarray, out: np.ndarray, hit_tokens: np.ndarray) -> None:
        if labels is None:
            labels = pa.nulls(inp.size, pa.string())
        encoded = pc.dictionary_encode(_text(labels), null_encoding="encode")
        if isinstance(encoded, pa.ChunkedArray):
            encoded = encoded.unify_dictionaries().combine_chunks()
        codes = np.asarray(encoded.indices.fill_null(0), dtype=np.int64)
        k = len(encoded.dictionary)
        columns = [np.bincount(codes, minlength=k)]
        columns += [np.bincount(codes, np.asarray(v, np.float64), minlength=k) for v in (inp, out, hit_tokens)]
        for i, name in enumerate(encoded.dictionary.to_pylist()):
            row = self.sums.setdefault(name, np.zeros(4, dtype=object))  # Python ints: exact at any length
            row += [int(round(c[i])) for c in columns]

    def result(self, key: str) -> list[dict]:
        """One row per label, most requests first (ties by name); [] when no request has a label."""
        if all(name is None for name in self.sums):
            return []
        total = sum(int(row[1]) for row in self.sums.values())
        rows = []
        for name, (requests, inp, out, hit) in self.sums.items():
            rows.append(
                {
                    key: NO_LABEL if name is None else name,
                    "requests": int(requests),
                    "input_tokens": int(inp),
                    "mean_input": inp / requests,
                    "mean_output": out / requests,
                    "hit_tokens": int(hit),
                    "token_share": inp / total,
                    "infinite_cache_token_hit_rate": hit / inp,
                }
            )
        return sorted(rows, key=lambda r: (-r["requests"], r[key]))


class TraceSummary:
    """`kvbench trace info`'s statistics of a trace of `n_rows` requests, from its chunks in row order."""

    def __init__(self, n_rows: int, block_size: int, warmup: float):
        self.block_size, self.n = block_size, 0
        self.first_arrival = self.last_arrival = None
        self.inputs, self.outputs = _Distribution(), _Distribution()
        self.sessions, self.users = _DistinctHashes(), _DistinctHashes()
        self.tenants: set[str] = set()
        self.workload_sums, self.tenant_sums = _LabelSums(), _LabelSums()
        self.hits = HitSums(int(n_rows * warmup), warmup)

    def add(self, chunk: pa.Table | pa.RecordBatch, hit_blocks: np.ndarray, n_blocks: np.ndarray) -> None:
        """The next rows: their COLUMNS (absent ones count as null), the infinite cache's hit blocks and their
        blocks per request."""
        names = chunk.schema.names

        def col(name):
            return chunk.column(name) if name in names else None

        if not chunk.num_rows:
            return
        arrival = chunk.column("arrival_s").to_numpy()
        self.first_arrival = arrival[0] if self.first_arrival is None else self.first_arrival
        self.last_arrival, self.n = arrival[-1], self.n + chunk.num_rows
        inp = chunk.column("input_tokens").to_numpy().astype(np.int64)
        out = chunk.column("output_tokens").to_numpy().astype(np.int64)
        hit_blocks = np.asarray(hit_blocks, np.int64)
        hit_tokens = np.minimum(hit_blocks * self.block_size, inp)
        self.inputs.add(inp)
        self.outputs.add(out)
        self.hits.add(hit_tokens, inp, hit_blocks, np.asarray(n_blocks, np.int64))
        self.sessions.add(col("session_id"))
        self.users.add(col("user_id"))
        if col("tenant") is not None:
            self.tenants.update(t for t in pc.unique(_text(col("tenant"))).to_pylist() if t is not None)
        self.workload_sums.add(col("workload"), inp, out, hit_tokens)
        self.tenant_sums.add(col("tenant"), inp, out, hit_tokens)

    def result(self, unique_blocks: int) -> dict:
        n = self.n
        duration = float(self.last_arrival - self.first_arrival) if n else 0.0
        inputs, outputs = self.inputs.result(), self.outputs.result()

        def rate(total):
            return total / duration if duration > 0 else None

        return {
            "requests": n,
            "block_size": self.block_size,
            "duration_s": duration,
            "rates": {
                "requests_per_s": rate(n),
                "input_tokens_per_s": rate(float(inputs["total"])),
                "output_tokens_per_s": rate(float(outputs["total"])),
            },
            "input_tokens": inputs,
            "output_tokens": outputs,
            "blocks": {"references": int(self.hits.sums[0, 3]), "unique": unique_blocks},
            "sessions": self.sessions.count(),
            "users": self.users.count(),
            "tenants": len(self.tenants),
            "infinite_cache_hit_rate": self.hits.rates(),
            "by_workload": self.workload_sums.result("workload"),
            "by_tenant": self.tenant_sums.result("tenant"),
        }
