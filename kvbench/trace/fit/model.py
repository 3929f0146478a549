"""What `kvbench trace fit` measures in a trace: the statistics that decide its prefix-cache hit rates.

A trace without text has only block ids and timings, so the model is stated in those terms (docs/semantics.md,
Fitting a synthetic twin). For each request, in arrival order: how many leading blocks an earlier request
already had (the depth at which it attaches to the prefix tree), the *parent* (the latest earlier request
holding its last shared block; equal chained id means equal prefix), how many requests held that block before
(its popularity), how many blocks the parent has past it, how many distinct blocks were touched between the
parent and the request (the LRU stack distance of the shared prefix) and how many seconds (the reuse
distance). Requests are also read as fresh, extend (a conversation's next turn) or branch: extends tie requests
into the units the twin keeps whole (units.py). `fit` gathers the parameters.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kvbench.trace.fit import units
from kvbench.trace.stats import infinite_cache_hits

FRESH, EXTEND, BRANCH = 0, 1, 2
KIND_NAMES = ("fresh", "extend", "branch")
LEVELS = 201  # quantile levels stored per distribution: 0.5% steps, enough to keep point masses of counts
MODEL_VERSION = 3
MAX_STARTS = 40_000  # unit start times kept exactly up to this many units, as that many quantiles past it
MOST_USED = 50  # shared prefixes listed by name in the parameters, most branched-off first
MODEL_NOTE = "units kept whole, placed on the trace's unit start times among units alike (kvbench/trace/fit/)"


def quantiles(values, levels: int = LEVELS) -> list[float]:
    """The distribution of `values` as `levels` evenly spaced quantiles (min to max); [] when there are none."""
    values = np.asarray(values, dtype=np.float64)
    if values.size == 0:
        return []
    return [float(q) for q in np.quantile(values, np.linspace(0.0, 1.0, levels))]


class Recency:
    """Blocks by the request that last touched them, as a Fenwick tree over request indices: how many distinct
    blocks were touched after a given request (its blocks' LRU stack distance) in O(log n)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.tree = [0] * (n + 1)
        self.total = 0

    def add(self, request: int, count: int) -> None:
        self.total += count
        i = request + 1
        while i <= self.n:
            self.tree[i] += count
            i += i & -i

    def held_up_to(self, request: int) -> int:
        """Blocks whose last touch was by a request <= `request`."""
        i, out = request + 1, 0
        while i > 0:
            out += self.tree[i]
            i -= i & -i
        return out

    def after(self, request: int) -> int:
        """Distinct blocks touched after `request`: the stack distance of the blocks it last touched."""
        return self.total - self.held_up_to(request)


def structure(table: pa.Table) -> dict:
    """Per-request reuse structure of a trace (in arrival order): kind, shared blocks, parent row, lag (s)."""
    hashes = table.column("block_hashes").combine_chunks()
    offsets = np.asarray(hashes.offsets, dtype=np.int64)
    offsets = offsets - offsets[0]
    flat = np.asarray(pc.list_flatten(hashes)).astype(np.uint64)
    n_blocks = np.diff(offsets)
    arrival = table.column("arrival_s").to_numpy().astype(np.float64)
    shared = infinite_cache_hits(hashes)
    n = n_blocks.size
    parent = np.full(n, -1, dtype=np.int64)
    distance = np.full(n, np.nan)
    holders = np.zeros(n, dtype=np.int64)  # earlier requests holding the last shared block: its popularity
    held: dict[int, int] = {}
    children = np.zeros(n, dtype=np.int64)  # distinct blocks that followed the last shared block: its fan-out
    attach = np.zeros(n, dtype=np.uint64)  # the last shared block
    kids: dict[int, int] = {}
    last_holder: dict[int, int] = {}
    recency = Recency(n)
    # One pass over the ids: the holder of a block id before request i is the latest earlier request with it;
    # the distinct blocks touched since the parent are its shared prefix's LRU stack distance.
    for i in range(n):
        lo, hi = offsets[i], offsets[i + 1]
        if shared[i] > 0:
            node = int(flat[lo + shared[i] - 1])
            attach[i] = node
            parent[i] = last_holder[node]
            distance[i] = recency.after(int(parent[i]))
            holders[i] = held.get(node, 0)
            children[i] = kids.get(node, 0)
        moved: dict[int, int] = {}
        mine = 0
        before = None
        for b in flat[lo:hi].tolist():
            h = last_holder.get(b)
            if h is None and before is not None:  # a block id seen for the first time: a new edge of the tree
                kids[before] = kids.get(before, 0) + 1
            before = b
            if h != i:
                mine += 1
                held[b] = held.get(b, 0) + 1
                if h is not None:
                    moved[h] = moved.get(h, 0) + 1
                last_holder[b] = i
        for h, c in moved.items():
            recency.add(h, -c)
        recency.add(i, mine)
    kind = np.full(n, FRESH, dtype=np.int8)
    reuse = parent >= 0
    parent_len = np.where(reuse, n_blocks[np.maximum(parent, 0)], 0)
    # An extend continues what was its parent's own: sharing no more than the parent itself borrowed (a 2-block
    # prompt after another that shares only the system prompt) is a branch off that borrowed prefix
    own = shared > shared[np.maximum(parent, 0)]
    extend = reuse & (shared >= parent_len - 1) & own
    kind[extend] = EXTEND
    kind[reuse & ~extend] = BRANCH
    lag = np.where(reuse, arrival - arrival[np.maximum(parent, 0)], np.nan)
    prefix, makes, prefixes = _shared_prefixes(kind, attach, kids, flat, offsets, shared)
    first_block = np.where(n_blocks > 0, flat[np.minimum(offsets[:-1], max(flat.size - 1, 0))], 0)
    return {
        "first_block": first_block,
        "n_blocks": n_blocks,
        "shared": shared,
        "parent": parent,
        "parent_len": parent_len,
        "kind": kind,
        "lag_s": lag,
        "distance_blocks": distance,
        "holders": holders,
        "children": children,
        "prefix": prefix,
        "makes_prefix": makes,
        "prefixes": prefixes,
        "arrival_s": arrival,
    }


def _shared_prefixes(kind, attach, kids, flat, offsets, shared) -> tuple[np.ndarray, np.ndarray, list[list[int]]]:
    """The trace's shared prefixes: the nodes two or more distinct blocks follow by the end of the trace (a
    system prompt, a document, a task's context that sub-agents fork from). Returns, per request, the number of
    the one it branches off and of the deepest one its own new blocks make (-1 for none), and per number
    [depth, number of the deepest shared prefix above it or -1]. The twin keeps each as one prefix, under the
    one above it, used as often as in the trace: what is popular and how popular prefixes nest, not only how
    often they are hit."""
    out = np.full(kind.size, -1, dtype=np.int64)
    numbered: dict[int, int] = {}
    table: list[list[int]] = []

    def number(path: list[int], depth: int) -> int:
        node = path[depth - 1]
        if node in numbered:
            return numbered[node]
        above = next((d for d in range(depth - 1, 0, -1) if kids.get(path[d - 1], 0) >= 2), 0)
        parent = number(path, above) if above else -1
        numbered[node] = len(table)
        table.append([depth, parent])
        return numbered[node]

    makes = np.full(kind.size, -1, dtype=np.int64)
    for i in range(kind.size):
        path = flat[offsets[i] : offsets[i + 1]].tolist()
        if kind[i] == BRANCH and kids.get(int(attach[i]), 0) >= 2:
            out[i] = number(path, int(shared[i]))
        # the deepest shared prefix among the request's own new blocks: this request made it (and those above)
        deepest = next((d for d in range(len(path), int(shared[i]), -1) if kids.get(path[d - 1], 0) >= 2), 0)
        if deepest:
            makes[i] = number(path, deepest)
    return out, makes, table


def sessions_of(kind: np.ndarray, parent: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Session and turn per request where the trace names none: an extend continues its parent's session (the
    first extend of a parent does; a second one forks a new session that starts at the next turn)."""
    n = kind.size
    session = np.arange(n, dtype=np.int64)
    turn = np.ones(n, dtype=np.int64)
    continued = np.zeros(n, dtype=bool)
    for i in np.flatnonzero(kind == EXTEND).tolist():
        p = int(parent[i])
        turn[i] = turn[p] + 1
        if not continued[p]:
            continued[p] = True
            session[i] = session[p]
    return session, turn


def _named_sessions(table: pa.Table) -> np.ndarray | None:
    if "session_id" not in table.column_names or table.column("session_id").null_count == table.num_rows:
        return None
    col = table.column("session_id").cast(pa.string()).fill_null("")
    return np.asarray(pc.dictionary_encode(col).combine_chunks().indices)


def session_stats(session: np.ndarray, arrival: np.ndarray) -> dict:
    """Turns per session and gaps between consecutive turns' arrivals (s), as quantile tables."""
    order = np.lexsort((arrival, session))
    s, t = session[order], arrival[order]
    same = s[1:] == s[:-1]
    _, counts = np.unique(session, return_counts=True)
    return {
        "sessions": int(counts.size),
        "turns_per_session": quantiles(counts),
        "mean_turns": float(counts.mean()) if counts.size else 0.0,
        "turn_gap_s": quantiles((t[1:] - t[:-1])[same]),
    }


def arrival_model(arrival: np.ndarray) -> dict:
    """Rate over time (a cumulative count curve on equal time bins) and the burstiness left once the rate curve
    is taken out: gaps in rescaled time, where a Poisson process at the fitted rate has exponential gaps of
    mean 1 (coefficient of variation 1; above 1 is burstier)."""
    n = arrival.size
    start = float(arrival[0]) if n else 0.0
    duration = float(arrival[-1] - start) if n else 0.0
    bins = int(min(100, max(1, np.sqrt(n))))  # square-root rule: bins grow with the evidence for them
    edges = np.linspace(0.0, duration, bins + 1) if duration > 0 else np.zeros(2)
    counts = np.searchsorted(arrival - start, edges, side="right").astype(np.float64)
    counts[0] = 0.0
    if duration > 0:
        rescaled = np.interp(arrival - start, edges, counts)
        gaps = np.diff(rescaled)
    else:
        gaps = np.zeros(max(n - 1, 0))
    mean = float(gaps.mean()) if gaps.size else 0.0
    cv = float(gaps.std() / mean) if mean > 0 else 0.0
    return {
        "duration_s": duration,
        "rate_per_s": n / duration if duration > 0 else 0.0,
        "bin_edges_s": [float(e) for e in edges],
        "cumulative_requests": [float(c) for c in counts],
        "rescaled_gaps": quantiles(gaps / mean if mean > 0 else gaps),
        "gap_cv": cv,
    }


def _shares(table: pa.Table, column: str) -> dict[str, float]:
    if column not in table.column_names or table.column(column).null_count == table.num_rows:
        return {}
    counts = pc.value_counts(table.column(column).cast(pa.string()).fill_null("")).to_pylist()
    total = sum(c["counts"] for c in counts)
    return {c["values"]: c["counts"] / total for c in sorted(counts, key=lambda c: str(c["values"]))}


def _by_octave(depth: np.ndarray, values: np.ndarray) -> list[dict]:
    out = []
    octave = np.floor(np.log2(np.maximum(depth, 1))).astype(np.int64)
    for k in np.unique(octave).tolist():
        sel = octave == k
        v = values[sel]
        v = v[np.isfinite(v)]
        out.append({"depth_blocks": [2**k, 2 ** (k + 1) - 1], "requests": int(sel.sum()),
                    "median": float(np.median(v)) if v.size else None,
                    "p90": float(np.quantile(v, 0.9)) if v.size else None})  # fmt: skip
    return out


def describe(st: dict, inp: np.ndarray, out: np.ndarray) -> dict:
    """What the twin keeps, summarised for a reader (the twin itself resamples whole units, not these): the
    prefix tree's fan-out and popularity by attach depth, the reuse distance at each depth, the shared prefixes,
    and the joint distribution of prompt and output lengths."""
    reuse = st["shared"] > 0
    depth = st["shared"][reuse]
    prefixes = np.asarray(st["prefixes"], dtype=np.int64).reshape(-1, 2)
    used = np.bincount(st["prefix"][st["prefix"] >= 0], minlength=prefixes.shape[0])
    top = np.argsort(-used, kind="stable")[:MOST_USED]
    rank = lambda v: np.argsort(np.argsort(v))  # noqa: E731 - Spearman's rho is Pearson's on ranks
    rho = float(np.corrcoef(rank(inp), rank(out))[0, 1]) if inp.size > 2 and inp.std() and out.std() else 0.0
    return {
        "reusing_share": float(reuse.mean()),
        "fanout_by_depth": _by_octave(depth, st["children"][reuse].astype(np.float64)),
        "holders_by_depth": _by_octave(depth, st["holders"][reuse].astype(np.float64)),
        "stack_distance_blocks_by_depth": _by_octave(depth, st["distance_blocks"][reuse]),
        "reuse_distance_s_by_depth": _by_octave(depth, st["lag_s"][reuse]),
        "shared_prefixes": {
            "count": int(prefixes.shape[0]),
            "depth_blocks": quantiles(prefixes[:, 0]) if prefixes.size else [],
            "most_used": [{"depth_blocks": int(prefixes[k, 0]), "branches": int(used[k])} for k in top.tolist()],
        },
        "lengths": {"input_tokens": quantiles(inp), "output_tokens": quantiles(out), "spearman": rho},
    }


def fit(table: pa.Table, block_size: int) -> tuple[dict, dict]:
    """Fit the twin's parameters to a trace (sorted by arrival). Returns (params, structure of the trace)."""
    if table.num_rows == 0:
        raise ValueError("the trace has no requests")
    st = structure(table)
    kind = st["kind"]
    inp = table.column("input_tokens").to_numpy().astype(np.int64)
    out = table.column("output_tokens").to_numpy().astype(np.int64)
    named = _named_sessions(table)
    session, _ = sessions_of(kind, st["parent"])
    rng = np.random.default_rng(0)  # the subsample of units: the same trace gives the same parameters
    tenants, workloads = _shares(table, "tenant"), _shares(table, "workload")
    rows, starts = units.unit_model(table, st, kind == EXTEND, list(tenants), list(workloads), rng)
    params = {
        "model": "unit-resample",
        "model_version": MODEL_VERSION,
        "note": MODEL_NOTE,
        "block_size": block_size,
        "requests": int(table.num_rows),
        "arrival": arrival_model(st["arrival_s"]),
        "unit_arrival": {
            **arrival_model(starts),
            "starts_s": quantiles(starts - starts[0], min(starts.size, MAX_STARTS)),
            "end_s": float(st["arrival_s"][-1] - starts[0]),  # the trace's window, from its first unit's start
        },
        "units": rows,
        "describe": describe(st, inp, out),
        "kinds": {name: float(np.mean(kind == k)) for k, name in enumerate(KIND_NAMES)},
        "sessions": {
            "named": None if named is None else session_stats(named, st["arrival_s"]),
            "inferred": session_stats(session, st["arrival_s"]),
        },
        "tenants": tenants,
        "workloads": workloads,
    }
    return params, st
