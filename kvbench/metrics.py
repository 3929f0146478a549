"""Metrics of one configuration point (DESIGN.md section 7): hit rates overall, per tenant / workload /
modality, and fairness across tenants. Pure functions of the per-request results and the trace."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .stats import hit_rates


def jain_index(values) -> float | None:
    """Jain's fairness index (sum x)^2 / (n * sum x^2): 1 when all equal, 1/n when one takes all."""
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0 or not np.any(x):
        return None
    return float(x.sum() ** 2 / (x.size * np.square(x).sum()))


def max_min_ratio(values) -> float | None:
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0 or x.min() <= 0:
        return None  # undefined when some tenant gets nothing; the per-tenant table shows who
    return float(x.max() / x.min())


def _groups(labels: pa.ChunkedArray, input_tokens: np.ndarray, hit_tokens: np.ndarray, steady_from: int) -> list[dict]:
    """Hit rate per label (tenant, workload), all requests and steady state, largest input share first."""
    import polars as pl  # loaded on use: the CLI starts faster without it

    if pa.types.is_dictionary(labels.type):
        labels = labels.cast(pa.string())
    steady = np.arange(input_tokens.size) >= steady_from
    frame = pl.DataFrame(
        {
            "name": pl.Series(labels.fill_null("(none)"), dtype=pl.Utf8),
            "inp": input_tokens,
            "hit": hit_tokens,
            "s_inp": np.where(steady, input_tokens, 0),
            "s_hit": np.where(steady, hit_tokens, 0),
        }
    )
    grouped = frame.group_by("name").agg(pl.len().alias("requests"), pl.col("inp", "hit", "s_inp", "s_hit").sum())
    out = [
        {
            "name": g["name"],
            "requests": int(g["requests"]),
            "input_tokens": int(g["inp"]),
            "hit_tokens": int(g["hit"]),
            "hit_rate": g["hit"] / g["inp"] if g["inp"] else 0.0,
            "hit_rate_steady": g["s_hit"] / g["s_inp"] if g["s_inp"] else None,
        }
        for g in grouped.sort("name").to_dicts()
    ]
    return sorted(out, key=lambda g: -g["input_tokens"])


def _by_modality(trace: pa.Table, hit_tokens: np.ndarray, input_tokens: np.ndarray) -> list[dict]:
    """Hit rate of the tokens inside image/video/audio spans, by modality, and of the remaining text."""
    if "mm_items" not in trace.column_names:
        return []
    mm = trace.column("mm_items")
    if mm.null_count == trace.num_rows:
        return []
    mm = mm.combine_chunks()
    flat = pc.list_flatten(mm)
    if len(flat) == 0:
        return []
    owner = np.asarray(pc.list_parent_indices(mm))
    offset = pc.struct_field(flat, "offset").to_numpy(zero_copy_only=False).astype(np.int64)
    tokens = pc.struct_field(flat, "tokens").to_numpy(zero_copy_only=False).astype(np.int64)
    modality = np.array(pc.struct_field(flat, "modality").to_pylist(), dtype=object)
    hit_in_span = np.clip(hit_tokens[owner] - offset, 0, tokens)
    rows = []
    for name in sorted(set(modality.tolist())):
        sel = modality == name
        rows.append(
            {
                "name": name,
                "tokens": int(tokens[sel].sum()),
                "hit_tokens": int(hit_in_span[sel].sum()),
                "hit_rate": float(hit_in_span[sel].sum() / tokens[sel].sum()),
            }
        )
    text_tokens = int(input_tokens.sum() - tokens.sum())
    text_hits = int(hit_tokens.sum() - hit_in_span.sum())
    rows.append(
        {
            "name": "text",
            "tokens": text_tokens,
            "hit_tokens": text_hits,
            "hit_rate": text_hits / text_tokens if text_tokens else 0.0,
        }
    )
    return rows


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
    """Everything summary.json reports for one point; keys are documented in the README. `trace` needs its
    per-request columns only (not block_hashes): `n_blocks` gives each request's block count."""
    input_tokens = trace.column("input_tokens").to_numpy().astype(np.int64)
    hit_blocks = np.asarray(hit_blocks, dtype=np.int64)
    if hit_tokens is None:  # (a live server reports tokens, at its own block size)
        hit_tokens = np.minimum(hit_blocks * block_size, input_tokens)
    hit_tokens = np.minimum(np.asarray(hit_tokens, dtype=np.int64), input_tokens)
    steady_from = int(trace.num_rows * warmup)

    by_tenant = _groups(trace.column("tenant"), input_tokens, hit_tokens, steady_from)
    tenant_rates = [g["hit_rate"] for g in by_tenant]
    fairness = {
        "jain": {"hit_rate": jain_index(tenant_rates)},
        "max_min_ratio": {"hit_rate": max_min_ratio(tenant_rates)},
        "tenants": len(by_tenant),
    }
    if evict_matrix is not None:
        fairness["evictor_victim"] = {"tenants": tenant_names, "matrix": np.asarray(evict_matrix).tolist()}
    return {
        "hit_rate": hit_rates(hit_blocks, n_blocks, input_tokens, block_size, warmup, hit_tokens),
        "hit_tokens": int(hit_tokens.sum()),
        "input_tokens": int(input_tokens.sum()),
        "evictions": int(np.sum(evictions)) if evictions is not None else None,
        "by_tenant": by_tenant,
        "by_workload": _groups(trace.column("workload"), input_tokens, hit_tokens, steady_from),
        "by_modality": _by_modality(trace, hit_tokens, input_tokens),
        "fairness": fairness,
    }
