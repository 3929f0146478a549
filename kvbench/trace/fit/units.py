"""The trace's users as units the twin resamples: conversations and task trees, kept whole.

What decides a prefix cache's hit rates is inside these units (a conversation's next turn continues its last
prompt seconds or minutes later; sub-agents fork from their task's context) and between them only through
prefixes many of them share (system prompts, documents, tool definitions). So the fit cuts the trace into units
and keeps each one's requests as they are, relative to the unit's start; the twin places units on the trace's
own unit start times, exchanging units alike (docs/semantics.md, Fitting a synthetic twin).

A unit is a connected set of requests under the links the trace shows: a request that continues its parent's
whole prompt (an *extend*: a next turn, a retry, a fork off the full context), and, where the trace names them,
one session_id, parent_id or depends_on. A request that branches off inside an earlier prompt (a shared system
prompt or document) starts or joins a unit by those links only: the prefix it shares is content, not history.
"""

from __future__ import annotations

import bisect

import numpy as np
import pyarrow as pa
from scipy.sparse import coo_matrix
from scipy.sparse.csgraph import connected_components

ROW_COLUMNS = ("unit", "offset_s", "parent", "shared_blocks", "new_blocks", "input_tokens", "output_tokens",
               "tenant", "workload")  # fmt: skip
TENTHS = 10  # units are exchanged only with those of the same tenth of the trace, by start
MAX_ROWS = 40_000  # rows kept: whole units drawn uniformly past that, plus the requests their prefixes come from


def _named_links(table: pa.Table) -> list[tuple[int, int]]:
    """Pairs of rows the trace itself ties together: one session_id, or a parent_id / depends_on naming a row."""
    n, links = table.num_rows, []
    names = table.column("request_id").to_pylist() if "request_id" in table.column_names else []
    index = {r: i for i, r in enumerate(names)}
    if "session_id" in table.column_names:
        first: dict[str, int] = {}
        for i, s in enumerate(table.column("session_id").to_pylist()):
            if s is not None and s != "":
                links.append((first.setdefault(s, i), i))
    for column in ("parent_id", "depends_on"):
        if column not in table.column_names or not index:
            continue
        for i, v in enumerate(table.column(column).to_pylist()):
            for name in v if isinstance(v, list) else [v]:
                j = index.get(name) if name is not None else None
                if j is not None and j != i:
                    links.append((j, i))
    return [(a, b) for a, b in links if 0 <= a < n and 0 <= b < n]


def units_of(table: pa.Table, extends: np.ndarray, parent: np.ndarray) -> np.ndarray:
    """Unit per request, numbered by first arrival, given which requests extend their `parent` (model.structure
    reads both off the block ids): the connected components of the links."""
    n = table.num_rows
    child = np.flatnonzero(extends)
    named = np.asarray(_named_links(table), dtype=np.int64).reshape(-1, 2)
    a = np.concatenate([parent[child], named[:, 0]])
    b = np.concatenate([child, named[:, 1]])
    graph = coo_matrix((np.ones(a.size, dtype=np.int8), (a, b)), shape=(n, n))
    _, component = connected_components(graph, directed=False)
    _, first, inverse = np.unique(component, return_index=True, return_inverse=True)
    return np.argsort(np.argsort(first))[inverse]  # units renumbered in order of their first request


def _codes(table: pa.Table, column: str, names: list[str]) -> np.ndarray:
    if not names or column not in table.column_names:
        return np.full(table.num_rows, -1, dtype=np.int64)
    values = table.column(column).cast(pa.string()).fill_null("").to_pylist()
    index = {k: i for i, k in enumerate(names)}
    return np.asarray([index.get(v, -1) for v in values], dtype=np.int64)


def _kept(unit: np.ndarray, parent: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(rows kept, which of them are emitted): all rows up to MAX_ROWS; past that, whole units in random order
    while they fit, plus the rows their shared prefixes come from (transitively, never emitted themselves), so
    that every kept path can be rebuilt."""
    n = unit.size
    if n <= MAX_ROWS:
        return np.arange(n), np.ones(n, dtype=bool)
    sizes = np.bincount(unit)
    order = rng.permutation(sizes.size)
    chosen = np.zeros(sizes.size, dtype=bool)
    chosen[order[np.cumsum(sizes[order]) <= MAX_ROWS]] = True
    keep = chosen[unit]
    for i in range(n - 1, -1, -1):  # a parent comes before its child: one backward pass closes the set
        if keep[i] and parent[i] >= 0:
            keep[parent[i]] = True
    rows = np.flatnonzero(keep)
    return rows, chosen[unit[rows]]


def unit_model(table: pa.Table, st: dict, extends, tenants: list[str], workloads: list[str], rng):
    """The units' requests as rows of ROW_COLUMNS, in arrival order (`parent` indexes these rows, -1 for none;
    `unit` is -1 for a row kept only because a kept row's prefix comes from it), the number of units in the
    trace; and the units' start times (s), for the caller to fit their arrival process."""
    unit = units_of(table, extends, st["parent"])
    arrival, parent = st["arrival_s"], st["parent"]
    start = np.full(int(unit.max()) + 1, np.inf)
    np.minimum.at(start, unit, arrival)
    keep, emitted = _kept(unit, parent, rng)
    where = np.full(unit.size, -1, dtype=np.int64)
    where[keep] = np.arange(keep.size)
    rows = np.stack(
        [
            np.where(emitted, unit[keep], -1),
            np.round(arrival[keep] - start[unit[keep]], 6),
            np.where(parent[keep] >= 0, where[np.maximum(parent[keep], 0)], -1),
            st["shared"][keep],
            (st["n_blocks"] - st["shared"])[keep],
            table.column("input_tokens").to_numpy()[keep],
            table.column("output_tokens").to_numpy()[keep],
            _codes(table, "tenant", tenants)[keep],
            _codes(table, "workload", workloads)[keep],
        ],
        axis=1,
    )
    return {"columns": list(ROW_COLUMNS), "rows": rows.tolist(), "units": int(start.size)}, np.sort(start)


NCOL = len(ROW_COLUMNS)
UNIT, OFFSET, PARENT, SHARED, NEW, INPUT, OUTPUT, TENANT, WORKLOAD = range(NCOL)


class Layout:
    """The kept rows' block paths, rebuilt from (parent, shared, new): a row's path is its parent's first
    `shared` blocks and then `new` blocks no earlier row has. Node ids are local; copy k of the users adds
    k x nodes, and a unit drawn a second time in one copy (only when rows were subsampled) gets fresh ids for
    the blocks its own rows made, so that equal id still means equal prefix."""

    def __init__(self, rows: np.ndarray) -> None:
        self.rows = rows
        self.paths: list[np.ndarray] = []
        nodes = 0
        for r in range(rows.shape[0]):
            p, shared, new = int(rows[r, PARENT]), int(rows[r, SHARED]), int(rows[r, NEW])
            head = self.paths[p][:shared] if p >= 0 else np.empty(0, np.int64)
            self.paths.append(np.concatenate([head, np.arange(nodes, nodes + new, dtype=np.int64)]))
            nodes += new
        self.nodes = nodes
        self.fresh = nodes  # next id past every copy's, for repeated units; set by the caller per twin

    def occurrence(self, members: np.ndarray, copy: int, repeat: bool) -> list[np.ndarray]:
        """Paths of one unit's rows (`members`, ascending) as drawn in `copy`."""
        base = copy * self.nodes
        if not repeat:
            return [self.paths[r] + base for r in members.tolist()]
        mine: dict[int, np.ndarray] = {}
        for r in members.tolist():
            p, shared, new = int(self.rows[r, PARENT]), int(self.rows[r, SHARED]), int(self.rows[r, NEW])
            head = (mine[p] if p in mine else self.paths[p] + base)[:shared] if p >= 0 else np.empty(0, np.int64)
            mine[r] = np.concatenate([head, np.arange(self.fresh, self.fresh + new, dtype=np.int64)])
            self.fresh += new
        return [mine[r] for r in members.tolist()]


def draws(units, group, duration, slots: np.ndarray, end: float, rng: np.random.Generator):
    """Which unit starts at each of `slots` (ascending start times, s) in one copy of the users: the kept units
    (numbered by their first request, so in the order they started), each once as in the trace (a random subset
    for fewer slots; when fewer units were kept than the trace has, further draws with replacement, each beside
    its unit), then exchanged at random only among units of the same `group` (those that start on the same root
    block: one application's system prompt) in the same tenth of that order, and only where a unit's `duration`
    (s, first to last request) still ends by `end`, the trace's span, where it can. The tenth keeps what a
    trace's window does to its units (those that start early hold the history later ones reuse), the group each
    application's share of the traffic over time, the end that a unit cut short by the window is not moved to
    where it would run past it. Returns (units, whether each is a repeat within the copy) per slot, and how many
    slots hold another unit than their own."""
    count = slots.size
    if count <= units.size:
        nominal = np.sort(rng.choice(units.size, size=count, replace=False))
    else:
        nominal = np.sort(np.concatenate([np.arange(units.size), rng.choice(units.size, count - units.size)]))
    tenth = (np.arange(count) * TENTHS) // max(count, 1)
    placed = nominal.copy()
    kin = group[nominal]
    for key in np.unique(np.stack([tenth, kin]), axis=1).T:
        at = np.flatnonzero((tenth == key[0]) & (kin == key[1]))
        pool = sorted(nominal[at].tolist(), key=lambda q: duration[q])  # shortest first
        lengths = [float(duration[q]) for q in pool]
        for p in at[::-1].tolist():  # latest slot first: it has the least room before the end
            fits = bisect.bisect_right(lengths, end - slots[p])
            j = int(rng.integers(fits)) if fits else 0
            placed[p] = pool.pop(j)
            lengths.pop(j)
    seen: set[int] = set()
    again = np.zeros(count, dtype=bool)
    moved = int(np.count_nonzero(placed != nominal))
    for p, q in enumerate(placed.tolist()):
        again[p] = q in seen
        seen.add(q)
    return units[placed], again, moved
