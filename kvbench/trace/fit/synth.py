"""A synthetic twin from fitted parameters (`model.fit`): the trace's units placed on the trace's unit starts.

Each copy of the users (a K-times twin has K) places the trace's units (kvbench/trace/fit/units.py), each once,
on the trace's own unit start times, exchanging units only with units alike (`units.draws`). A unit's requests
keep their offsets from its start, their lengths and their block paths, rebuilt with ids of the copy's own, so a
conversation's turns and a task's forks stay as far apart as they were; what units share (a system prompt, a
document) is shared by the copy's units wherever they land in time (docs/semantics.md, Fitting a synthetic twin).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from kvbench.trace.blockhash import content_ids, name_key
from kvbench.trace.fit.model import sessions_of, structure
from kvbench.trace.fit.units import INPUT, NCOL, NEW, OFFSET, OUTPUT, TENANT, UNIT, WORKLOAD, Layout, draws


def synthesize(params: dict, scale: float = 1.0, seed: int = 0, progress=None, info: dict | None = None) -> pa.Table:
    """The twin as a trace table: round(units x scale) units, as many requests as those units hold. `info`, when
    given, receives how many units were placed and the share of them that moved to another unit's start."""
    if scale <= 0:
        raise ValueError(f"scale must be > 0, got {scale}")
    rng = np.random.default_rng(seed)
    model = params["units"]
    rows = np.asarray(model["rows"], dtype=np.float64).reshape(-1, NCOL)
    layout = Layout(rows)
    unit = rows[:, UNIT].astype(np.int64)
    emitted = np.flatnonzero(unit >= 0)
    by_unit = emitted[np.argsort(unit[emitted], kind="stable")]  # rows grouped by unit, each in arrival order
    kept, first = np.unique(unit[by_unit], return_index=True)
    members = dict(zip(kept.tolist(), np.split(by_unit, first[1:])))
    root = np.asarray([layout.paths[members[u][0]][:1].sum() for u in kept.tolist()])  # first block of each unit
    duration = np.asarray([rows[members[u], OFFSET].max() for u in kept.tolist()])
    # units alike are exchanged: same root block (application), same octave of new blocks (work they bring)
    work = np.floor(np.log2(np.maximum([rows[members[u], NEW].sum() for u in kept.tolist()], 1)))
    group = np.unique(np.stack([root, work]), axis=1, return_inverse=True)[1].ravel()
    total = max(1, int(round(model["units"] * scale)))
    copies = int(np.ceil(total / model["units"]))
    layout.fresh = copies * layout.nodes
    # Unit starts come from the empirical quantile function of the trace's (its start times themselves, up to
    # MAX_STARTS units): copy k of K takes it at fractional positions j + k/K, so one copy starts its units when
    # the trace did, with the trace's rate and bursts, and K copies interleave their starts evenly between those
    quantile = np.asarray(params["unit_arrival"]["starts_s"], dtype=np.float64)
    slots = [
        np.interp((np.arange(model["units"]) + copy / copies) * (quantile.size - 1) / max(model["units"] - 1, 1),
                  np.arange(quantile.size), quantile)
        for copy in range(copies)
    ]  # fmt: skip
    times, picked, paths = [], [], []
    placed = exchanged = 0
    for copy in range(copies):
        count = min(model["units"], total - copy * model["units"])
        starts = slots[copy]
        if count < starts.size:  # a fraction of a copy: as many of its slots, spread over the span
            starts = np.sort(rng.choice(starts, size=count, replace=False))
        drawn, repeat, moved = draws(kept, group, duration, starts, params["unit_arrival"]["end_s"], rng)
        placed, exchanged = placed + drawn.size, exchanged + moved
        for u, again, t0 in zip(drawn.tolist(), repeat.tolist(), starts.tolist()):
            m = members[u]
            times.append(t0 + rows[m, OFFSET])
            picked.append(m)
            paths.extend(layout.occurrence(m, copy, again))
        if progress is not None:
            progress(copy + 1, copies)
    if info is not None:
        info.update(units=placed, moved_share=exchanged / max(placed, 1))
    t = np.concatenate(times)
    picked = np.concatenate(picked)
    order = np.argsort(t, kind="stable")
    return _table(params, seed, scale, t[order], rows[picked[order]], [paths[i] for i in order.tolist()])


def _table(params: dict, seed: int, scale: float, t: np.ndarray, rows: np.ndarray, paths: list) -> pa.Table:
    n = t.size
    n_blocks = np.asarray([p.size for p in paths], dtype=np.int64)
    offsets = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(n_blocks, out=offsets[1:])
    flat = np.concatenate(paths) if n else np.empty(0, np.int64)
    flat = content_ids(name_key("trace-fit", seed, scale), flat) if flat.size else np.empty(0, np.uint64)
    hashes = pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat, pa.uint64()))
    width = len(str(n))
    ids = np.asarray([f"twin-{i:0{width}d}" for i in range(n)], dtype=object)
    # parents and sessions by the rule the fit reads a trace with: where units landed decides which earlier
    # request holds a shared system prompt last
    st = structure(pa.table({"block_hashes": hashes, "arrival_s": pa.array(t, pa.float64())}))
    session, turn = sessions_of(st["kind"], st["parent"])
    parent = st["parent"]
    columns = {
        "request_id": pa.array(ids, pa.string()),
        "arrival_s": pa.array(t, pa.float64()),
        "input_tokens": pa.array(rows[:, INPUT].astype(np.int64), pa.int32()),
        "output_tokens": pa.array(np.maximum(rows[:, OUTPUT], 0).astype(np.int64), pa.int32()),
        "block_hashes": hashes,
        "session_id": pa.array([f"s{s}" for s in session.tolist()], pa.string()),
        "turn": pa.array(turn, pa.int32()),
        "parent_id": pa.array(np.where(parent >= 0, ids[np.maximum(parent, 0)], None), pa.string()),
    }
    for column, col, names in (
        ("tenant", TENANT, params.get("tenants")),
        ("workload", WORKLOAD, params.get("workloads")),
    ):
        if names:
            names = list(names)
            codes = rows[:, col].astype(np.int64)
            columns[column] = pa.array([names[c] if c >= 0 else "" for c in codes.tolist()], pa.string())
    return pa.table(columns)
