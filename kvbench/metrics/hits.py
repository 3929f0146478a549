"""Metrics of one configuration point (docs/semantics.md, Hit rates and Fairness): hit rates overall, per
tenant / workload / modality, and fairness across tenants.

Every metric is a ratio of sums over requests, so `MetricSums` takes a point's results chunk by chunk, in row
order, and keeps only sums (per label, per modality): a streamed replay reports a trace of any length in
memory that does not grow with it. `point_metrics` is the one-chunk case."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from kvbench.metrics.fairness import jain_index, max_min_ratio
from kvbench.trace.compute import dictionary_encode, fill_null, pc, to_text
from kvbench.trace.hitsums import NO_LABEL, HitSums


class _GroupSums:
    """Per label (tenant, workload): requests, input tokens, hit tokens, and both over the steady state."""

    def __init__(self):
        self.sums: dict[str, np.ndarray] = {}

    def add(self, labels, input_tokens: np.ndarray, hit_tokens: np.ndarray, steady: np.ndarray) -> None:
        # pyarrow's dictionary encoding + numpy bincount: no polars import (0.35 s) on the common path
        encoded = dictionary_encode(fill_null(to_text(labels), NO_LABEL))
        if isinstance(encoded, pa.ChunkedArray):
            encoded = encoded.unify_dictionaries().combine_chunks()
        codes = np.asarray(encoded.indices, dtype=np.int64)
        k = len(encoded.dictionary)
        inp = np.asarray(input_tokens, dtype=np.int64)
        hit = np.asarray(hit_tokens, dtype=np.int64)
        columns = (
            np.bincount(codes, minlength=k),
            np.bincount(codes, inp, minlength=k),
            np.bincount(codes, hit, minlength=k),
            np.bincount(codes, np.where(steady, inp, 0), minlength=k),
            np.bincount(codes, np.where(steady, hit, 0), minlength=k),
        )
        for i, name in enumerate(encoded.dictionary.to_pylist()):
            row = self.sums.setdefault(name, np.zeros(5, dtype=object))
            row += [int(round(c[i])) for c in columns]

    def result(self) -> list[dict]:
        """Hit rate per label, all requests and steady state, largest input share first (ties by name)."""
        out = []
        for name, (requests, inp, hit, s_inp, s_hit) in sorted(self.sums.items()):
            out.append(
                {
                    "name": name,
                    "requests": int(requests),
                    "input_tokens": int(inp),
                    "hit_tokens": int(hit),
                    "hit_rate": hit / inp if inp else 0.0,
                    "hit_rate_steady": s_hit / s_inp if s_inp else None,
                }
            )
        return sorted(out, key=lambda g: -g["input_tokens"])


class _ModalitySums:
    """Tokens inside image/video/audio spans and how many of them hit, by modality."""

    def __init__(self):
        self.sums: dict[str, list[int]] = {}  # modality -> [tokens, hit tokens]

    def add(self, mm: pa.ChunkedArray | pa.Array, hit_tokens: np.ndarray) -> None:
        if mm.null_count == len(mm):
            return
        mm = mm.combine_chunks() if isinstance(mm, pa.ChunkedArray) else mm
        flat = pc.list_flatten(mm)
        if len(flat) == 0:
            return
        owner = np.asarray(pc.list_parent_indices(mm))
        offset = pc.struct_field(flat, "offset").to_numpy(zero_copy_only=False).astype(np.int64)
        tokens = pc.struct_field(flat, "tokens").to_numpy(zero_copy_only=False).astype(np.int64)
        modality = np.array(to_text(pc.struct_field(flat, "modality")).to_pylist(), dtype=object)
        hit_in_span = np.clip(hit_tokens[owner] - offset, 0, tokens)
        for name in set(modality.tolist()):
            sel = modality == name
            row = self.sums.setdefault(name, [0, 0])
            row[0] += int(tokens[sel].sum())
            row[1] += int(hit_in_span[sel].sum())

    def result(self, input_tokens: int, hit_tokens: int) -> list[dict]:
        """Hit rate by modality, then of the remaining text; [] for a trace without spans."""
        if not self.sums:
            return []
        rows = [
            {"name": name, "tokens": tokens, "hit_tokens": hits, "hit_rate": hits / tokens}  # tokens > 0: validated
            for name, (tokens, hits) in sorted(self.sums.items())
        ]
        text_tokens = input_tokens - sum(r["tokens"] for r in rows)
        text_hits = hit_tokens - sum(r["hit_tokens"] for r in rows)
        rows.append(
            {
                "name": "text",
                "tokens": text_tokens,
                "hit_tokens": text_hits,
                "hit_rate": text_hits / text_tokens if text_tokens else 0.0,
            }
        )
        return rows


class MetricSums:
    """One point's metrics, from its results given chunk by chunk in row order (`add`), for a trace of
    `n_rows` requests (the steady state starts at row int(n_rows * warmup), as in `stats.hit_rates`)."""

    def __init__(self, n_rows: int, block_size: int, warmup: float):
        self.block_size = block_size
        self.hits = HitSums(int(n_rows * warmup), warmup)
        self.tenants, self.workloads, self.modalities = _GroupSums(), _GroupSums(), _ModalitySums()
        self.evictions: int | None = None

    def add(
        self,
        trace: pa.Table | pa.RecordBatch,
        n_blocks: np.ndarray,
        hit_blocks: np.ndarray,
        evictions: np.ndarray | None = None,
        hit_tokens: np.ndarray | None = None,
    ) -> None:
        """The next rows: `trace` their per-request columns (input_tokens, tenant, workload, mm_items when
        the trace has it), the arrays their results. `hit_tokens` defaults to whole hit blocks."""
        input_tokens = trace.column("input_tokens").to_numpy().astype(np.int64)
        hit_blocks = np.asarray(hit_blocks, dtype=np.int64)
        if hit_tokens is None:  # (a live server reports tokens, at its own block size)
            hit_tokens = hit_blocks * self.block_size
        hit_tokens = np.minimum(np.asarray(hit_tokens, dtype=np.int64), input_tokens)
        steady = np.arange(self.hits.rows, self.hits.rows + len(input_tokens)) >= self.hits.steady_from
        self.hits.add(hit_tokens, input_tokens, hit_blocks, np.asarray(n_blocks, dtype=np.int64))
        self.tenants.add(trace.column("tenant"), input_tokens, hit_tokens, steady)
        self.workloads.add(trace.column("workload"), input_tokens, hit_tokens, steady)
        if "mm_items" in trace.column_names:
            self.modalities.add(trace.column("mm_items"), hit_tokens)
        if evictions is not None:
            self.evictions = (self.evictions or 0) + int(np.sum(evictions))

    def result(self, evict_matrix: np.ndarray | None = None, tenant_names: list[str] | None = None) -> dict:
        """Everything summary.json reports for the point; keys are documented in docs/sim.md (summary.json keys)."""
        by_tenant = self.tenants.result()
        tenant_rates = [g["hit_rate"] for g in by_tenant]
        fairness = {
            "jain": {"hit_rate": jain_index(tenant_rates)},
            "max_min_ratio": {"hit_rate": max_min_ratio(tenant_rates)},
            "tenants": len(by_tenant),
        }
        if evict_matrix is not None:
            fairness["evictor_victim"] = {"tenants": tenant_names, "matrix": np.asarray(evict_matrix).tolist()}
        hit_tokens, input_tokens = int(self.hits.sums[0, 0]), int(self.hits.sums[0, 1])
        return {
            "hit_rate": self.hits.rates(),
            "hit_tokens": hit_tokens,
            "input_tokens": input_tokens,
            "evictions": self.evictions,
            "by_tenant": by_tenant,
            "by_workload": self.workloads.result(),
            "by_modality": self.modalities.result(input_tokens, hit_tokens),
            "fairness": fairness,
        }


def point_metrics(
    trace: pa.Table,
    n_blocks: np.ndarray,
    block_size: int,
    hit_blocks: np.ndarray,
    warmup: float,
    evictions: np.ndarray | None = None,
    evict_matrix: np.ndarray | None = None,
    tenant_names: list[str] | None = None,
    hit_tokens: np.ndarray | None = None,
) -> dict:
    """`MetricSums` of a whole trace at once. `trace` needs its per-request columns only (not block_hashes):
    `n_blocks` gives each request's block count."""
    sums = MetricSums(trace.num_rows, block_size, warmup)
    sums.add(trace, n_blocks, hit_blocks, evictions, hit_tokens)
    return sums.result(evict_matrix, tenant_names)
