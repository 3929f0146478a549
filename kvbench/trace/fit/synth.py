"""A synthetic twin from fitted parameters (`model.fit`): arrivals, then each request attached to the prefix tree.

The twin is grown request by request in arrival order (docs/semantics.md, Fitting a synthetic twin). A request
draws a row of the fitted joint table from its own tenth of the trace: how many blocks it shares, the LRU stack
distance and popularity of the shared prefix, how many blocks the prefix's latest holder had past it, the blocks
it adds and its lengths. A reusing request then attaches to the twin's tree where the row says: it continues a
prompt of about the row's length at about its distance, or branches off a node of the row's depth at about its
distance and popularity. It keeps that path and appends new blocks, with ids no other block has, so equal id
still means equal prefix. Popular prefixes, conversation chains and fan-out are not drawn separately: they arise,
as in the trace, from requests attaching where the trace's requests attached.
"""

from __future__ import annotations

import bisect

import numpy as np
import pyarrow as pa

from kvbench.trace.blockhash import content_ids, name_key
from kvbench.trace.fit.model import BRANCH, EXTEND, FRESH, JOINT_COLUMNS, TENTHS, Recency, draw, sessions_of

NCOL = len(JOINT_COLUMNS)
SHARED, DISTANCE, NEW, TAIL, OUTPUT, BEYOND, TENTH, HOLDERS, CHILDREN, CONTINUES, PREFIX, MAKES = (
    JOINT_COLUMNS.index(c)
    for c in (
        "shared_blocks", "distance_blocks", "new_blocks", "last_block_tokens", "output_tokens", "holder_beyond",
        "tenth", "holders", "children", "continues", "prefix", "makes_prefix",
    )
)  # fmt: skip
LOOK = 64  # stale records skipped, each way, when looking for a node or a prompt's end near a request
BANDS = 2  # length bands either side a next turn may continue a prompt of (2 bands: within about 19%)


def length_band(length: int) -> int:
    """Bands of path lengths an eighth of an octave wide (about 9%): a next turn continues a prompt of about
    the length the trace's did, where exact lengths rarely meet."""
    return int(np.floor(8 * np.log2(max(length, 1))))


class _Tree:
    """The twin's prefix tree. Every node (block) has the latest request holding it; `recency` counts blocks
    by that request, so the distinct blocks touched since a request (the LRU stack distance of what it last
    touched) is a Fenwick query. Touches are listed per depth and prompt ends per length band, both in request
    order, so the candidate nearest a request is a bisection away; a record is stale once its node was touched
    again (or its prompt continued)."""

    def __init__(self, n: int) -> None:
        self.recency = Recency(n)
        self.by_depth: list[tuple[list[int], list[int]]] = [([], [])]  # depth -> (requests, nodes) per touch
        self.last: list[int] = []  # node -> index of its latest touch in its depth's lists
        self.holder: list[int] = []  # node -> the latest request holding it
        self.held: list[int] = []  # node -> how many requests held it
        self.kids: list[int] = []  # node -> how many distinct nodes follow it (its fan-out)
        self.depth: list[int] = []  # node -> its depth (1 for a root block)
        self.ends: dict[int, list[int]] = {}  # length band -> requests whose prompt has a length in it
        self.paths: list[list[int]] = []  # request -> its path
        self.continued: list[bool] = []  # request -> a later request already continued where it ended

    def add(self, keep: list[int], new: int) -> list[int]:
        """Request len(paths): its path is `keep` (existing nodes, root first) and `new` fresh nodes."""
        request = len(self.paths)
        first = len(self.holder)
        self.holder.extend([-1] * new)
        self.held.extend([0] * new)
        self.kids.extend([0] * new)
        self.depth.extend(range(len(keep) + 1, len(keep) + new + 1))
        if new and keep:
            self.kids[keep[-1]] += 1
        self.last.extend([-1] * new)
        path = keep + list(range(first, first + new))
        for node in path[len(keep) : -1]:
            self.kids[node] += 1
        moved: dict[int, int] = {}
        for d, node in enumerate(path, start=1):
            h = self.holder[node]
            if h >= 0:
                moved[h] = moved.get(h, 0) + 1
            if d >= len(self.by_depth):
                self.by_depth.append(([], []))
            requests, nodes = self.by_depth[d]
            self.last[node] = len(requests)
            self.holder[node] = request
            self.held[node] += 1
            requests.append(request)
            nodes.append(node)
        for h, c in moved.items():
            self.recency.add(h, -c)
        self.recency.add(request, len(path))
        self.paths.append(path)
        self.continued.append(False)
        self.ends.setdefault(length_band(len(path)), []).append(request)
        return path

    def deepest(self) -> int:
        return len(self.by_depth) - 1

    def _nearest(self, requests: list[int], target: int, valid) -> int | None:
        """Index in `requests` (ascending) of a valid record nearest `target` in stack distance: the latest at
        or before it, or the earliest after it, whichever is closer; None if neither is within LOOK records."""
        pos = bisect.bisect_right(requests, target) - 1
        before = next((k for k in range(pos, max(pos - LOOK, -1), -1) if valid(k)), None)
        after = next((k for k in range(pos + 1, min(pos + 1 + LOOK, len(requests))) if valid(k)), None)
        if before is None or after is None:
            return before if after is None else after
        want = self.recency.after(target) if target >= 0 else self.recency.total
        far_before = self.recency.after(requests[before]) - want
        short_after = want - self.recency.after(requests[after])
        return after if short_after < far_before else before

    def _within(self, requests: list[int], distance: float, slack: float, valid) -> list[int]:
        """Indices in `requests` of valid records whose stack distance is within `slack` of `distance`,
        looking through at most LOOK records each way from the one at that distance."""
        pos = bisect.bisect_right(requests, self.recency.request_at(distance)) - 1
        out = []
        for ks in (range(pos, max(pos - LOOK, -1), -1), range(pos + 1, min(pos + 1 + LOOK, len(requests)))):
            for k in ks:
                gap = abs(self.recency.after(requests[k]) - distance)
                if gap > slack:
                    break
                if valid(k):
                    out.append(k)
        return out

    def node_at(self, depth: int, distance: float, holders: int, children: int, slack: float) -> int:
        """The latest holder of a node at `depth`: among the current ones within `slack` of `distance`, the one
        off by the fewest octaves of stack distance, of holders and of fan-out together (a document's last block
        that many questions follow, where the trace's request took one, not the middle of a longer document);
        else the one nearest in distance, and the most recently touched node of that depth when no record near
        it is current."""
        requests, nodes = self.by_depth[depth]

        def valid(k):
            return self.last[nodes[k]] == k

        near = self._within(requests, distance, slack, valid)
        if near:
            want = np.log2([distance + 1, holders + 1, children + 1])

            def octaves(k):
                node = nodes[k]
                have = np.log2([self.recency.after(requests[k]) + 1, self.held[node] + 1, self.kids[node] + 1])
                return float(np.abs(have - want).sum())

            k = min(near, key=octaves)
        else:
            k = self._nearest(requests, self.recency.request_at(distance), valid)
        return self.holder[nodes[-1 if k is None else k]]

    def end_at(self, length: int, distance: float, slack: float, bands: int | None = BANDS) -> int | None:
        """A request not yet continued, still the latest holder of its last block, with a length within `bands`
        length bands of `length` (any length for None) and a stack distance within `slack` of `distance`: the one
        off by the fewest octaves of length plus octaves of distance (the nearest candidates in distance are more
        often shorter, since shorter prompts are more common: choosing by distance alone would shorten what is
        shared); None if there is none."""
        best, best_key = None, None
        want_length, want_distance = np.log2(length), np.log2(distance + 1)
        centre = length_band(length)
        for band, requests in self.ends.items():
            if (bands is not None and abs(band - centre) > bands) or not requests:
                continue

            def valid(k, requests=requests):
                r = requests[k]
                return not self.continued[r] and self.holder[self.paths[r][-1]] == r

            for k in self._within(requests, distance, slack, valid):
                r = requests[k]
                key = abs(np.log2(len(self.paths[r])) - want_length) + abs(
                    np.log2(self.recency.after(r) + 1) - want_distance
                )
                if best_key is None or key < best_key:
                    best, best_key = r, key
        return best


def arrivals(arrival: dict, n: int, rng: np.random.Generator) -> np.ndarray:
    """n arrival times (s): gaps drawn with the fitted burstiness in rescaled time, mapped through the fitted
    cumulative rate curve, so n requests span the trace's duration whatever n is (a K-times twin has K times
    the rate)."""
    edges = np.asarray(arrival["bin_edges_s"], dtype=np.float64)
    cum = np.asarray(arrival["cumulative_requests"], dtype=np.float64)
    if n <= 1 or cum[-1] <= 0 or edges[-1] <= 0:
        return np.zeros(n)
    gaps = np.maximum(draw(arrival["rescaled_gaps"], rng, n - 1, discrete=False), 0.0)
    if gaps.sum() <= 0:
        gaps = np.ones(n - 1)
    u = np.concatenate([[0.0], np.cumsum(gaps)])
    u *= cum[-1] / u[-1]
    return np.maximum.accumulate(np.interp(u, cum, edges))


def _choice(shares: dict[str, float], rng, n: int) -> np.ndarray | None:
    if not shares:
        return None
    names = list(shares)
    p = np.asarray([shares[k] for k in names], dtype=np.float64)
    return np.asarray(names, dtype=object)[rng.choice(len(names), size=n, p=p / p.sum())]


class _Rows:
    """The fitted joint rows by tenth of the trace, each tenth's by stack distance (fresh rows first), so that
    a request draws among its tenth's rows whose distance fits in what the twin has touched so far (in the
    trace, no request could reuse a prefix from before the trace began). Drawn without replacement, a tenth's
    rows all once before any twice, for each of the K copies of the users apart: a twin of the trace's size
    uses each row once, so each shared prefix is made once and branched off as often as in the trace (with
    replacement, about a third of the rows would be missing and as many drawn twice)."""

    def __init__(self, params: dict, scale: float) -> None:
        rows = np.asarray(params["joint"]["rows"], dtype=np.float64).reshape(-1, NCOL)
        # A K-times twin is K interleaved copies of the trace's users: between a prefix's two uses, each other
        # copy touches what the trace touched in between (the distance) and its copy of the parent's prompt
        parent_len = (rows[:, SHARED] + rows[:, BEYOND]) * (rows[:, SHARED] > 0)
        rows[:, DISTANCE] = scale * rows[:, DISTANCE] + (scale - 1) * parent_len
        rows = rows[np.lexsort((rows[:, DISTANCE], rows[:, TENTH]))]
        self.rows = rows
        self.start = np.searchsorted(rows[:, TENTH], np.arange(TENTHS + 1), side="left")
        self.left: dict[tuple[int, int], tuple[list[float], list[int]]] = {}  # (tenth, copy) -> rows not drawn
        # shared prefix -> the rows of the requests that made it (and those above it past what they shared)
        prefixes = params.get("shared_prefixes", [])
        self.makers: dict[int, list[int]] = {}
        for r in np.flatnonzero(rows[:, MAKES] >= 0):
            p = int(rows[r, MAKES])
            while p >= 0 and prefixes[p][0] > rows[r, SHARED]:
                self.makers.setdefault(p, []).append(int(r))
                p = prefixes[p][1]

    def _left(self, i: int, n: int, copy: int) -> tuple[list[float], list[int]]:
        k = min(i * TENTHS // n, TENTHS - 1)
        distances, left = self.left.get((k, copy), ([], []))
        if not left:
            lo, hi = self.start[k], self.start[k + 1]
            if lo == hi:  # a tenth without rows (a subsampled tiny trace): all rows
                lo, hi = 0, self.rows.shape[0]
            distances, left = self.left[k, copy] = (self.rows[lo:hi, DISTANCE].tolist(), list(range(lo, hi)))
        return distances, left

    def draw(self, i: int, n: int, copy: int, u: float, touched: int) -> int:
        """The row (its index) request i of n, of the given copy of the users, draws."""
        distances, left = self._left(i, n, copy)
        j = int(u * max(bisect.bisect_right(distances, touched), 1))
        distances.pop(j)
        return left.pop(j)

    def maker_for(self, i: int, n: int, copy: int, drawn: int, prefix: int) -> int | None:
        """In the trace a shared prefix is made before any request branches off it: a request that drew a row
        branching off one the twin has not made yet takes instead the row of a request that made it, if its
        tenth has one left, and puts its own back."""
        distances, left = self._left(i, n, copy)
        for m in self.makers.get(prefix, ()):
            j = bisect.bisect_left(distances, self.rows[m, DISTANCE])
            while j < len(left) and left[j] != m and distances[j] == self.rows[m, DISTANCE]:
                j += 1
            if j < len(left) and left[j] == m:
                distances.pop(j)
                left.pop(j)
                back = bisect.bisect_right(distances, self.rows[drawn, DISTANCE])
                distances.insert(back, float(self.rows[drawn, DISTANCE]))
                left.insert(back, drawn)
                return m
        return None


class _SharedPrefixes:
    """The trace's shared prefixes in the twin: each (prefix, copy) is one node, at the prefix's depth in the
    trace, made by a request drawing the row of the request that made it in the trace (its own new blocks
    reach that depth), under the twin's node for the shared prefix above it when that one is made."""

    def __init__(self, table: list[list[int]], tree: _Tree) -> None:
        self.table, self.tree = table, tree
        self.nodes: dict[tuple[int, int], int] = {}

    def find(self, prefix: int, copy: int) -> tuple[int, int] | None:
        """(latest holder, depth) of the twin's node for `prefix` in `copy`; None while it is not made."""
        node = self.nodes.get((prefix, copy))
        return None if node is None else (self.tree.holder[node], self.tree.depth[node])

    def made(self, prefix: int, copy: int, path: list[int], kept: int) -> None:
        """`path` made `prefix` (and the shared prefixes above it not made yet) where its part past the `kept`
        blocks it shares reaches their depths."""
        while prefix >= 0 and (prefix, copy) not in self.nodes:
            depth = self.table[prefix][0]
            if kept < depth <= len(path):
                self.nodes[(prefix, copy)] = path[depth - 1]
            prefix = self.table[prefix][1]


def synthesize(params: dict, scale: float = 1.0, seed: int = 0, progress=None) -> pa.Table:
    """The twin as a trace table: round(requests x scale) requests over the fitted duration."""
    if scale <= 0:
        raise ValueError(f"scale must be > 0, got {scale}")
    rng = np.random.default_rng(seed)
    n = max(1, int(round(params["requests"] * scale)))
    t = arrivals(params["arrival"], n, rng)
    table = _Rows(params, scale)
    u = rng.random(n)
    tree = _Tree(n)
    rows = np.empty((n, NCOL))
    shared = np.zeros(n, dtype=np.int64)
    parent = np.full(n, -1, dtype=np.int64)
    step = max(1, n // 20)
    hot = _SharedPrefixes(params.get("shared_prefixes", []), tree)
    copy = np.floor(rng.random(n) * scale)  # K interleaved copies of the users, each with its own prefixes
    for i in range(n):
        r = table.draw(i, n, int(copy[i]), u[i], tree.recency.total)
        while table.rows[r, PREFIX] >= 0 and hot.find(int(table.rows[r, PREFIX]), int(copy[i])) is None:
            m = table.maker_for(i, n, int(copy[i]), r, int(table.rows[r, PREFIX]))
            if m is None:
                break
            r = m
        row = rows[i] = table.rows[r]
        want, distance, new, beyond = int(row[SHARED]), float(row[DISTANCE]), int(row[NEW]), int(row[BEYOND])
        depth = min(want, tree.deepest())
        keep: list[int] = []
        if depth > 0:
            # A request that continued where its parent ended (a next turn: the parent had at most one block
            # past the shared prefix, and more of its own than it borrowed) continues a prompt of about that
            # length at about that distance; failing that, the end at that distance of any length, growing by
            # its own new blocks (a session grows turn by turn: in the trace the parent is most often the
            # request just before, which in the twin is seldom of the drawn length). One that branched off one
            # of the trace's shared prefixes takes that prefix (in its copy) once it is made; any other, a node
            # of its depth at about that distance, popularity and fan-out.
            grown, holder = False, None
            if row[CONTINUES] > 0:
                holder = tree.end_at(want + beyond, distance, slack=distance + new)
                if holder is None:
                    holder = tree.end_at(want + beyond, distance, slack=distance + new, bands=None)
                    grown = holder is not None
            if holder is not None:
                tree.continued[holder] = True
                depth = max(len(tree.paths[holder]) - beyond, 1)
            elif row[PREFIX] >= 0 and (found := hot.find(int(row[PREFIX]), int(copy[i]))) is not None:
                holder, depth = found
            else:
                slack = distance + new
                holder = tree.node_at(depth, distance, int(row[HOLDERS]), int(row[CHILDREN]), slack=slack)
            keep = tree.paths[holder][:depth]
            if not grown:
                new = max(want + new - len(keep), 0)  # the prompt keeps its fitted length
            parent[i] = holder
        else:
            new += want
        if not keep and new == 0:
            new = 1  # a prompt has at least one token
        path = tree.add(keep, new)
        if row[MAKES] >= 0:
            hot.made(int(row[MAKES]), int(copy[i]), path, len(keep))
        shared[i] = len(keep)
        if progress is not None and (i + 1) % step == 0:
            progress(i + 1, n)
    return _table(params, seed, scale, t, rows, tree.paths, shared, parent, rng)


def _sessions(shared: np.ndarray, n_blocks: np.ndarray, parent: np.ndarray):
    """Kinds and sessions by the rule the fit reads a trace with (model.structure, model.sessions_of)."""
    reuse = parent >= 0
    p = np.maximum(parent, 0)
    extend = reuse & (shared >= n_blocks[p] - 1) & (shared > shared[p])
    kind = np.where(extend, EXTEND, np.where(reuse, BRANCH, FRESH)).astype(np.int8)
    return sessions_of(kind, parent)


def _table(params, seed, scale, t, rows, paths, shared, parent, rng) -> pa.Table:
    n, bs = t.size, int(params["block_size"])
    n_blocks = np.asarray([len(p) for p in paths], dtype=np.int64)
    tail = np.clip(rows[:, TAIL], 1, bs).astype(np.int64)
    input_tokens = (n_blocks - 1) * bs + tail
    offsets = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(n_blocks, out=offsets[1:])
    flat = np.fromiter((b for p in paths for b in p), dtype=np.int64, count=int(offsets[-1]))
    flat = content_ids(name_key("trace-fit", seed, scale), flat) if flat.size else np.empty(0, np.uint64)
    session, turn = _sessions(shared, n_blocks, parent)
    width = len(str(n))
    ids = np.asarray([f"twin-{i:0{width}d}" for i in range(n)], dtype=object)
    columns = {
        "request_id": pa.array(ids, pa.string()),
        "arrival_s": pa.array(t, pa.float64()),
        "input_tokens": pa.array(input_tokens, pa.int32()),
        "output_tokens": pa.array(np.maximum(rows[:, OUTPUT], 0).astype(np.int64), pa.int32()),
        "block_hashes": pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat, pa.uint64())),
        "session_id": pa.array([f"s{s}" for s in session.tolist()], pa.string()),
        "turn": pa.array(turn, pa.int32()),
        "parent_id": pa.array(np.where(parent >= 0, ids[np.maximum(parent, 0)], None), pa.string()),
    }
    # Tenants and workloads follow prefixes: a reusing request belongs where its parent does; fresh ones are
    # drawn by the fitted shares.
    for column, shares in (("tenant", params.get("tenants")), ("workload", params.get("workloads"))):
        drawn = _choice(shares or {}, rng, n)
        if drawn is None:
            continue
        for i in np.flatnonzero(parent >= 0).tolist():
            drawn[i] = drawn[parent[i]]
        columns[column] = pa.array(drawn.tolist(), pa.string())
    return pa.table(columns)
