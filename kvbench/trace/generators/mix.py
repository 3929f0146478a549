"""A weighted blend of the other workload kinds in one trace."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kvbench.trace.generators import BadParameter, generator, get, param


@dataclass(frozen=True)
class MixParams:
    weights: str = param(
        "chat=0.4,agent=0.2,multimodal=0.15,reasoning=0.1,multi-tenant=0.15",
        "share of requests per kind, as kind=weight pairs separated by commas (normalised to 1)",
        unit="unitless",
    )
    clock: str = param(
        "shortest",
        "how the kinds' clocks are merged: 'native' keeps each kind's own arrival times; 'shortest'/'longest' "
        "stretch each kind's arrivals (and think times) so that all span the shortest/longest kind's duration",
        unit="name",
    )


def parse_weights(spec: str) -> dict[str, float]:
    weights = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        kind, sep, value = part.partition("=")
        try:
            weights[kind.strip()] = float(value) if sep else float("nan")
        except ValueError:
            weights[kind.strip()] = float("nan")
        if not weights[kind.strip()] >= 0:
            raise BadParameter(f"--weights {spec!r}: {part!r} must look like kind=weight with weight >= 0")
    if not weights or sum(weights.values()) <= 0:
        raise BadParameter(f"--weights {spec!r} must name at least one kind with a weight > 0")
    if "mix" in weights:
        raise BadParameter(f"--weights {spec!r}: a mix cannot contain itself")
    return weights


@generator("mix", MixParams, bytes_per_request=8_000)
def mix(p: MixParams, n: int, seed: int, block_size: int) -> pa.Table:
    """A weighted blend of the other kinds; each keeps its own arrival process, merged on one clock."""
    weights = parse_weights(p.weights)
    kinds = list(weights)
    share = np.array([weights[k] for k in kinds]) / sum(weights.values())
    # Largest-remainder rounding so the counts add up to exactly n.
    counts = np.floor(share * n).astype(int)
    counts[np.argsort(-(share * n - counts), kind="stable")[: n - counts.sum()]] += 1
    if p.clock not in ("native", "shortest", "longest"):
        raise BadParameter(f"--clock {p.clock!r} must be native, shortest or longest")
    parts = []
    for i, (kind, count) in enumerate(zip(kinds, counts)):
        if count > 0:
            table, _ = get(kind).run(int(count), seed=seed * 1000 + i, block_size=block_size)
            parts.append(table)
    if p.clock != "native":
        parts = _common_span(parts, min if p.clock == "shortest" else max)
    table = pa.concat_tables(parts, promote_options="permissive").unify_dictionaries()
    order = np.argsort(np.asarray(table.column("arrival_s")), kind="stable")
    return table.take(order).combine_chunks()


def _common_span(parts: list[pa.Table], pick) -> list[pa.Table]:
    """Stretch each part's arrivals and think times so that every part spans the same duration.

    Kinds have very different natural spans (a chat sample covers minutes, multi-tenant users return over
    days); without this, a blend would put one kind's whole traffic in the first minutes of another's.
    """
    spans = [float(pc.max(t.column("arrival_s")).as_py()) for t in parts]
    target = pick([s for s in spans if s > 0], default=0.0)
    out = []
    for table, span in zip(parts, spans):
        factor = target / span if span > 0 else 1.0
        for name in ("arrival_s", "think_time_s"):
            i = table.column_names.index(name)
            scaled = pc.multiply(table.column(name), pa.scalar(factor, table.schema.field(name).type))
            table = table.set_column(i, table.schema.field(name), scaled)
        out.append(table)
    return out
