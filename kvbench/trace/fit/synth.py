"""A synthetic twin from fitted parameters (`model.fit`): arrivals, then each request's kind, parent and blocks.

The twin is generated request by request in arrival order, the way the model reads a trace (model.py): a fresh
request gets new blocks; an extend takes the request that arrived `lag` seconds earlier, keeps its blocks but
the dropped ones and appends new blocks; a branch takes the first `shared` blocks of the request `lag` seconds
earlier and appends its own. Popular prefixes are not listed anywhere: they arise, as in the trace, from
requests copying prefixes that earlier requests copied. New blocks get ids no other block has, so equal id still
means equal prefix.
"""

from __future__ import annotations

import bisect

import numpy as np
import pyarrow as pa

from kvbench.trace.blockhash import content_ids, name_key
from kvbench.trace.fit.model import BRANCH, EXTEND, FRESH, at, draw, for_length

BRANCH_SEARCH = (
    256  # requests looked back for a branch's parent: bounds the cost of a prefix no prompt is long enough for
)


def arrivals(arrival: dict, n: int, scale: float, rng: np.random.Generator) -> np.ndarray:
    """n arrival times (s): gaps drawn with the fitted burstiness in rescaled time, mapped through the fitted
    cumulative rate curve; `scale` times the requests over the same duration is `scale` times the rate."""
    edges = np.asarray(arrival["bin_edges_s"], dtype=np.float64)
    cum = np.asarray(arrival["cumulative_requests"], dtype=np.float64)
    if n <= 1 or cum[-1] <= 0 or edges[-1] <= 0:
        return np.zeros(n)
    gaps = np.maximum(draw(arrival["rescaled_gaps"], rng, n - 1, discrete=False), 0.0)
    if gaps.sum() <= 0:
        gaps = np.ones(n - 1)
    u = np.concatenate([[0.0], np.cumsum(gaps)])
    u *= cum[-1] / u[-1]  # the twin spans the trace's duration, whatever the scale
    return np.maximum.accumulate(np.interp(u, cum, edges))


def _choice(shares: dict[str, float], rng, n: int) -> np.ndarray | None:
    if not shares:
        return None
    names = list(shares)
    p = np.asarray([shares[k] for k in names], dtype=np.float64)
    return np.asarray(names, dtype=object)[rng.choice(len(names), size=n, p=p / p.sum())]


def _schedule(params: dict, scale: float, rng: np.random.Generator):
    """Sessions and their turns in time: session starts with the fitted rate curve (x scale) and burstiness, each
    with a drawn number of turns, consecutive turns a drawn reuse distance apart. Turns past the fitted duration
    are cut, as the trace's own window cut its last sessions. Returns (arrival, session, turn) in arrival order."""
    n_sessions = max(1, int(round(params["session_arrival"]["cumulative_requests"][-1] * scale)))
    start = arrivals(params["session_arrival"], n_sessions, scale, rng)
    turns = np.maximum(draw(params["turns_per_session"], rng, n_sessions, True), 1).astype(np.int64)
    session = np.repeat(np.arange(n_sessions), turns)
    first = np.repeat(np.cumsum(turns) - turns, turns)
    turn = np.arange(session.size) - first + 1
    gaps = np.where(turn > 1, np.maximum(draw(params["extend"]["lag_s"], rng, session.size, False), 0.0), 0.0)
    # cumulative gaps within each session
    cum = np.cumsum(gaps)
    t = start[session] + cum - np.repeat(cum[np.cumsum(turns) - turns], turns)
    keep = t <= params["arrival"]["duration_s"] + 1e-9
    t, session, turn = t[keep], session[keep], turn[keep]
    order = np.lexsort((turn, session, t))
    return t[order], session[order], turn[order], turns


def _branchable(prompt: np.ndarray, want: int, touched: dict[int, float], since: float) -> bool:
    """Whether a prompt can be a branch's parent: long enough to share `want` blocks and differ after them, and
    (for more than a root block) its first `want` blocks last touched no later than `since`."""
    return bool(prompt.size >= want + 2 and (want <= 1 or touched[int(prompt[want - 1])] <= since))


def synthesize(params: dict, scale: float = 1.0, seed: int = 0, progress=None) -> pa.Table:
    """The twin as a trace table: about requests x scale requests over the fitted duration."""
    if scale <= 0:
        raise ValueError(f"scale must be > 0, got {scale}")
    bs = int(params["block_size"])
    rng = np.random.default_rng(seed)
    t, session, turn, turns = _schedule(params, scale, rng)
    n = t.size
    starts = params["sessions_start"]
    shared_start = rng.random(n) < starts["shared_prefix"]
    ext, br = params["extend"], params["branch"]
    # Draw every distribution once, vectorised; the loop below only wires parents and block lists.
    head_u = rng.random(n)  # levels for a session's first prompt, whose table depends on its turns
    ext_drop = draw(ext["dropped_blocks"], rng, n, True).astype(np.int64)
    ext_new_u = rng.random(n)  # levels: the table depends on the parent's length, known only in the loop
    br_lag_u = rng.random(n)  # levels: the lag's table depends on the shared length
    br_shared = np.maximum(draw(br["shared_blocks"], rng, n, True), 1).astype(np.int64)
    tail = np.clip(draw(params["last_block_tokens"], rng, n, True), 1, bs).astype(np.int64)
    out_tokens = np.maximum(draw(params["output_tokens"], rng, n, True), 0).astype(np.int64)

    namespace = name_key("trace-fit", seed, scale)
    next_id = 0
    blocks: list[np.ndarray] = []
    kind = np.full(n, FRESH, dtype=np.int8)
    parent = np.full(n, -1, dtype=np.int64)
    root_p = np.asarray(br.get("root_shares", []), dtype=np.float64)
    root_u = rng.random(n)
    root_of = np.zeros(n, dtype=np.int64)
    members: list[list[int]] = []  # requests of each root prefix, in arrival order
    latest: dict[int, int] = {}  # session -> its latest turn so far
    touched: dict[int, float] = {}  # block id -> arrival (s) of the latest request holding it
    step = max(1, n // 20)
    for i in range(n):
        s = int(session[i])
        if s in latest:
            kind[i], parent[i] = EXTEND, latest[s]
            pb = blocks[parent[i]]
            table = for_length(ext["new_blocks"], pb.size)
            keep, new = pb[: max(pb.size - int(ext_drop[i]), 0)], int(at(table, ext_new_u[i]))
        elif shared_start[i] and i > 0:
            want = int(br_shared[i])
            lags = for_length(br["lag_s"], want)
            lag = at(lags, br_lag_u[i], discrete=False)
            # the root prefix (first block) by its fitted popularity among the roots created so far, then the
            # latest request of that root that arrived at least `lag` seconds before this one (the first if none)
            avail = min(len(members), len(root_p))
            weights = root_p[:avail]
            if avail and weights.sum() > 0:
                rank = int(np.searchsorted(np.cumsum(weights), root_u[i] * weights.sum(), side="right"))
                pool = members[min(rank, avail - 1)]
            else:
                pool = list(range(i))
            pos = max(bisect.bisect_right(pool, t[i] - lag, key=t.__getitem__) - 1, 0)
            # A branch shares part of a longer prompt (else it would be that prompt's next turn): go back to the
            # latest one long enough to share `want` blocks and differ after them, whose shared prefix nothing
            # touched since. The fitted lag is to the *latest* holder of the shared prefix, and later turns of a
            # session, or earlier branches, hold it too: taking the request `lag` seconds back regardless would
            # reuse blocks touched moments ago (Mooncake: 3x the original's hits on long shared prefixes at 1%
            # capacity). A one-block root is held by nearly everything, so its lag is left to popularity.
            since = t[i] - lag
            k = pos
            while k > 0 and pos - k < BRANCH_SEARCH and not _branchable(blocks[pool[k]], want, touched, since):
                k -= 1
            kind[i], parent[i] = BRANCH, pool[k] if _branchable(blocks[pool[k]], want, touched, since) else pool[pos]
            pb = blocks[parent[i]]
            table = for_length(br["new_blocks"], turns[s])
            keep, new = pb[: min(want, pb.size)], int(at(table, head_u[i]))
        else:
            table = for_length(params["fresh"]["blocks"], turns[s])
            keep, new = np.empty(0, np.uint64), max(int(at(table, head_u[i])), 1)
        if keep.size + new == 0:
            new = 1  # a prompt has at least one token
        latest[s] = i
        if parent[i] < 0:
            root_of[i] = len(members)  # a fresh prompt starts a new root prefix
            members.append([])
        else:
            root_of[i] = root_of[parent[i]]
        members[root_of[i]].append(i)
        fresh = content_ids(namespace, np.arange(next_id, next_id + new)) if new else np.empty(0, np.uint64)
        next_id += new
        blocks.append(np.concatenate([keep, fresh]).astype(np.uint64))
        touched.update(dict.fromkeys(blocks[-1].tolist(), float(t[i])))
        if progress is not None and (i + 1) % step == 0:
            progress(i + 1, n)

    n_blocks = np.asarray([b.size for b in blocks], dtype=np.int64)
    input_tokens = (n_blocks - 1) * bs + tail
    offsets = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(n_blocks, out=offsets[1:])
    flat = np.concatenate(blocks) if blocks else np.empty(0, np.uint64)
    width = len(str(n))
    ids = np.asarray([f"twin-{i:0{width}d}" for i in range(n)], dtype=object)
    columns = {
        "request_id": pa.array(ids, pa.string()),
        "arrival_s": pa.array(t, pa.float64()),
        "input_tokens": pa.array(input_tokens, pa.int32()),
        "output_tokens": pa.array(out_tokens, pa.int32()),
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
