"""The validation rules that relate rows: unique request ids, parent_id and depends_on naming requests of the
trace, no dependency cycles.

A trace in memory is checked on the ids' text with Arrow's hash tables. A streamed trace (read or written
chunk by chunk) keeps only 64-bit hashes of its ids and checks them by sorting: a hash table over 20M ids
costs 40-60 bytes an id, a sorted copy 8, and the rules then need at most one argsort (for depends_on).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, fields

import numpy as np
import pyarrow as pa

from kvbench.trace.compute import call, cast, fill_null, index_in
from kvbench.trace.outofcore import GrowingArray

# Values looked up per searchsorted call: bounds the int64 positions it returns to 32 MB.
_LOOKUP_SLICE = 4_000_000
DUPLICATE_RULE = "duplicate request_id (an earlier row has the same id)"
DANGLING_RULE = "refers to a request_id that is not in the trace"
CYCLE_RULE = "dependency cycle (requests that wait for each other)"


def _np(col, fill) -> np.ndarray:
    return fill_null(col, fill).to_numpy(zero_copy_only=False)


def _id_hashes(values: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """64-bit hashes of request ids (null as ""): 8 bytes a row instead of the id's text."""
    import polars as pl  # loaded on use: the CLI starts faster without it

    return pl.Series(fill_null(values, "")).cast(pl.Utf8).hash(seed=7).to_numpy()


@dataclass
class References:
    """What the rules across rows look at: every request's id, and the rows that name other requests. Ids
    are 64-bit hashes (a 20M-row trace keeps 160 MB, not its ids' text) or, with `hashed=False`, the text."""

    ids: np.ndarray | pa.Array  # request_id of every row: uint64 hashes, or the text (`hashed=False`)
    parent_rows: np.ndarray
    parents: np.ndarray | pa.Array  # parent_id of those rows, the same way
    dep_rows: np.ndarray  # one entry per depends_on element
    deps: np.ndarray | pa.Array

    @classmethod
    def of(cls, t: pa.Table, first_row: int = 0, hashed: bool = True) -> References:
        """`hashed=False` keeps the ids' text: exact, and no hashing (nor polars import) for a trace that is
        in memory anyway."""
        parent = t.column("parent_id").combine_chunks()
        # (Arrow's own methods import pyarrow.compute, 70-120 ms that a first run would pay: `call` instead)
        valid = call("is_valid", parent)
        has_parent = np.flatnonzero(_np(valid, False))
        deps = t.column("depends_on").combine_chunks()

        def ids(values):
            return _id_hashes(values) if hashed else cast(fill_null(values, ""), pa.string())

        return cls(
            ids=ids(t.column("request_id").combine_chunks()),
            parent_rows=has_parent + first_row,
            # (the rows of has_parent; pa.array(has_parent) would import numpy.ma)
            parents=ids(call("array_filter", parent, valid)),
            dep_rows=np.asarray(call("list_parent_indices", deps), dtype=np.int64) + first_row,
            deps=ids(call("list_flatten", deps)),
        )


class GrowingReferences:
    """Hashed `References` of a trace given chunk by chunk, each field in one growing buffer
    (`outofcore.GrowingArray`: per-chunk arrays would fragment the heap)."""

    def __init__(self):
        self._fields = {
            f.name: GrowingArray(np.uint64 if f.name in ("ids", "parents", "deps") else np.int64)
            for f in fields(References)
        }

    def add(self, refs: References) -> None:
        for name, buffer in self._fields.items():
            buffer.extend(getattr(refs, name))

    def result(self) -> References:
        return References(**{name: buffer.values for name, buffer in self._fields.items()})


class _TextIds:
    """Ids as text (a trace in memory): Arrow's hash tables."""

    def __init__(self, ids: pa.Array):
        self.ids = ids

    def repeated(self, id_text=None) -> np.ndarray:
        return _repeated_text(self.ids)

    def rows_of(self, values) -> np.ndarray:
        """Row of each value's first occurrence among the ids, -1 where it has none."""
        return _np(index_in(pa.array(values), self.ids), -1).astype(np.int64)

    def contains(self, values) -> np.ndarray:
        return self.rows_of(values) >= 0


def _repeated_text(values: pa.Array) -> np.ndarray:
    """True where an earlier element has the same value (index_in finds each value's first position)."""
    return _np(index_in(values, values), -1) != np.arange(len(values))


class _HashedIds:
    """Ids as uint64 hashes, checked through a sorted copy (8 bytes a row; a stable argsort only when rows
    must be found, for depends_on)."""

    def __init__(self, ids: np.ndarray):
        self.ids = ids
        self.sorted = np.sort(ids)
        self._order: np.ndarray | None = None

    def repeated(self, id_text=None) -> np.ndarray:
        """True where an earlier row has the same id. `id_text(rows) -> list[str]` gives the ids of some rows,
        to tell a real duplicate from two ids whose hashes collide (odds ~1e-6 on 10M rows); without it hashes
        are trusted."""
        mask = np.zeros(self.ids.size, bool)
        equal = self.sorted[1:] == self.sorted[:-1]
        if not equal.any():
            return mask
        # every row whose hash occurs more than once (the first occurrences included)
        suspects = np.flatnonzero(np.isin(self.ids, np.unique(self.sorted[1:][equal])))
        if id_text is not None:
            mask[suspects[_repeated_text(pa.array(id_text(suspects), pa.string()))]] = True
        else:
            _, first = np.unique(self.ids[suspects], return_index=True)
            mask[suspects] = True
            mask[suspects[first]] = False
        return mask

    def contains(self, values: np.ndarray) -> np.ndarray:
        found = np.zeros(values.size, bool)
        if not self.sorted.size:
            return found
        for lo in range(0, values.size, _LOOKUP_SLICE):
            part = values[lo : lo + _LOOKUP_SLICE]
            pos = np.minimum(np.searchsorted(self.sorted, part), self.sorted.size - 1)
            found[lo : lo + part.size] = self.sorted[pos] == part
        return found

    def rows_of(self, values: np.ndarray) -> np.ndarray:
        if self._order is None:
            self._order = np.argsort(self.ids, kind="stable")  # equal ids: the first row first
        rows = np.full(values.size, -1, np.int64)
        if not self.sorted.size:
            return rows
        pos = np.minimum(np.searchsorted(self.sorted, values), self.sorted.size - 1)
        hit = self.sorted[pos] == values
        rows[hit] = self._order[pos[hit]]
        return rows


def check_across_rows(refs: References, report, id_text=None) -> None:
    """Report duplicate ids, dangling parent_id/depends_on and dependency cycles into `report` (a
    `validation.ValidationReport`). Hashed refs take `id_text(rows) -> list[str]` to rule out hash collisions
    among duplicates."""
    report.first_row = 0
    index = _HashedIds(refs.ids) if isinstance(refs.ids, np.ndarray) else _TextIds(pa.array(refs.ids))
    report.add("request_id", DUPLICATE_RULE, index.repeated(id_text))
    if len(refs.parents):
        report.add("parent_id", DANGLING_RULE, refs.parent_rows[~index.contains(refs.parents)])
    if not len(refs.deps):
        return
    targets = index.rows_of(refs.deps)
    missing = targets < 0
    report.add("depends_on", DANGLING_RULE, np.unique(refs.dep_rows[missing]))
    rows, targets = refs.dep_rows[~missing], targets[~missing]
    if np.any(targets >= rows):  # only an edge to the same or a later row can close a cycle
        graph: dict[int, list[int]] = defaultdict(list)
        for row, target in zip(rows.tolist(), targets.tolist()):
            graph[row].append(target)
        report.add("depends_on", CYCLE_RULE, _rows_on_cycles(graph))


def _rows_on_cycles(graph: dict[int, list[int]]) -> list[int]:
    """Rows that lie on a dependency cycle (iterative DFS: a back edge to a node on the path closes one)."""
    state: dict[int, int] = {}  # 1 = on stack, 2 = done
    on_cycle: set[int] = set()
    for root in list(graph):
        if root in state:
            continue
        stack = [(root, iter(graph.get(root, ())))]
        path = [root]
        state[root] = 1
        while stack:
            node, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                state[node] = 2
                stack.pop()
                path.pop()
            elif state.get(nxt) == 1:
                on_cycle.update(path[path.index(nxt) :])
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                stack.append((nxt, iter(graph.get(nxt, ()))))
    return sorted(on_cycle)
