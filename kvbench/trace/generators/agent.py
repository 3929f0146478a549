"""Agent tasks: chains of tool calls that fork sub-agents on the parent's prefix and merge their results.

Shape of a task (docs/semantics.md, Workload kinds). The main agent makes a chain of calls; each call's prompt is the
previous prompt + the previous output + the tool output. Every prompt starts with a system prompt + tool
definitions prefix drawn from a small shared pool (Zipf), then the task's first user message. At some calls
the agent forks K sub-agents: each is its own chain whose first prompt is the parent's prompt at the fork
+ its own instruction. The parent's next call is the merge: it depends on the last call of every
sub-agent and appends their final outputs. Sub-agents do not fork again (one level of nesting).

Context cap: when a chain's history would push a prompt past `max_context_tokens`, the chain compacts,
as coding agents do: the next prompt restarts from the shared prefix + the task message + a summary of
`summary_tokens`, and later calls grow from there. The summarising call itself is not emitted.

Window: tasks last minutes to hours, so the trace is the first n requests in time of an open Poisson
stream of tasks (tasks still running at the end are cut); every parent and dependency arrives earlier, so
references never dangle.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kvbench.trace.blockhash import content_ids, mix, name_key, prompt_block_ids
from kvbench.trace.generators import BadParameter, generator, param
from kvbench.trace.generators._common import (
    group_ranks,
    lognormal_ints,
    poisson_arrivals,
    rng_for,
    string_ids,
    zipf_indices,
)
from kvbench.trace.schema import conform

MAX_OUTPUT_TOKENS = 32_000  # common max_tokens ceiling of agent calls
SUBAGENT_CALLS_SIGMA = 0.6  # spread of sub-agent chain lengths (kv-cache-tester samples: 4-24 calls)


# Defaults follow the kv-cache-tester Claude Code traces (739 conversations, 59,204 requests; README in
# ../shared/traces/kv-cache-tester): median 48 requests per conversation; tools ~10.5K + system ~2.6K tokens
# of shared prefix (median); output mean 446, median 218 tokens; think time median 10 s; 93-97% prefix reuse
# per conversation. Per-call prompt growth in the bundled samples: median ~400, mean ~2.5K tokens. Forks are
# more frequent here than in those traces (19 of 739 had sub-agents) so that trees are exercised.
@dataclass(frozen=True)
class AgentParams:
    task_rate: float = param(0.05, "new agent tasks per second (Poisson)", unit="tasks/s", above=0)
    calls_mean: float = param(50.0, "mean calls of the main agent per task (log-normal)", unit="calls")
    calls_sigma: float = param(1.0, "log-normal shape of main-agent calls per task", unit="unitless")
    max_calls: int = param(1000, "cap on calls of one agent chain", unit="calls", at_least=1)
    system_prompts: int = param(
        8, "distinct system prompt + tool definition prefixes shared across tasks", unit="count", at_least=1
    )
    system_zipf: float = param(1.0, "Zipf exponent of prefix popularity", unit="unitless")
    system_tokens_mean: float = param(13_000.0, "mean system prompt + tool definitions length (tokens)", unit="tokens")
    task_tokens_mean: float = param(
        6_000.0, "mean first user message of a task, project context included (tokens)", unit="tokens"
    )
    output_tokens_mean: float = param(450.0, "mean output per call (tokens, log-normal)", unit="tokens")
    output_tokens_sigma: float = param(1.0, "log-normal shape of output length", unit="unitless")
    tool_tokens_mean: float = param(
        2_000.0, "mean tool output appended after a call (tokens, log-normal)", unit="tokens"
    )
    tool_tokens_sigma: float = param(
        1.8, "log-normal shape of tool output length (heavy tail: file reads, logs)", unit="unitless"
    )
    max_tool_tokens: int = param(25_000, "cap on one tool output (tokens)", unit="tokens", at_least=1)
    tool_time_mean_s: float = param(
        20.0, "mean tool/client time between a call finishing and the next (s, log-normal)", unit="s"
    )
    tool_time_sigma: float = param(1.2, "log-normal shape of tool time", unit="unitless")
    fork_prob: float = param(
        0.01, "probability that a main-agent call spawns sub-agents (never the last call)", unit="fraction", at_most=1
    )
    subagents_mean: float = param(3.0, "mean sub-agents per fork (1 + Poisson)", unit="sub-agents")
    max_subagents: int = param(8, "cap on sub-agents per fork", unit="sub-agents", at_least=1)
    subagent_calls_mean: float = param(12.0, "mean calls per sub-agent (log-normal)", unit="calls")
    subagent_task_tokens_mean: float = param(
        500.0, "mean sub-agent instruction after the inherited prefix (tokens)", unit="tokens"
    )
    max_context_tokens: int = param(
        131_072, "context cap (tokens); a chain that would exceed it compacts its history", unit="tokens", at_least=1
    )
    summary_tokens: int = param(3_000, "compaction summary that replaces a chain's history (tokens)", unit="tokens")
    users: int = param(500, "distinct users submitting tasks (Zipf)", unit="count", at_least=1)
    decode_s_per_token: float = param(
        0.03, "assumed server time per output token, to place later calls (s)", unit="s/token"
    )


def _check(p: AgentParams) -> None:
    if p.task_rate <= 0 or p.decode_s_per_token < 0 or not 0 <= p.fork_prob <= 1:
        raise BadParameter("need task_rate > 0, decode_s_per_token >= 0 and 0 <= fork_prob <= 1")
    # The prefix, the task message and the summary must leave room for history after a compaction;
    # the prefix and task message are clipped to a quarter of the context each.
    if not 0 < p.summary_tokens <= p.max_context_tokens // 4:
        raise BadParameter("summary_tokens must be > 0 and at most max_context_tokens / 4")


def _lognormal(rng: np.random.Generator, mean: float, sigma: float, size: int) -> np.ndarray:
    return rng.lognormal(np.log(max(mean, 1e-9)) - sigma**2 / 2, sigma, size)


def _chain_cumsum(x: np.ndarray, chain_start: np.ndarray) -> np.ndarray:
    """Inclusive running sum of x restarted at every chain; chain_start[i] is the first index of i's chain."""
    total = np.cumsum(x)
    return total - (total[chain_start] - x[chain_start])


def _ranges(lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every index in [lo[i], hi[i]) for each i, as (i, index), in order."""
    length = hi - lo
    owner = np.repeat(np.arange(lo.size), length)
    return owner, np.arange(length.sum()) - np.repeat(np.cumsum(length) - length - lo, length)


def _compact(p: AgentParams, appended, chain_start, hist0, base):
    """Compaction epoch, first call of that epoch and prompt length of every call.

    hist0 is history a chain starts with (a sub-agent: the parent's prompt beyond the shared prefix and the
    task message, + its instruction). Epoch 0 may fill the whole context with history; a call that would
    not fit starts the next epoch, whose prompts hold a summary and at most `budget` tokens of history.
    """
    before = _chain_cumsum(appended, chain_start) - appended + hist0  # history tokens, were nothing dropped
    room = p.max_context_tokens - base
    budget = room - p.summary_tokens
    epoch = np.zeros(before.size, dtype=np.int64)
    run_first = chain_start.copy()
    # Calls that do not fit their epoch form a suffix of it; each pass opens the next epoch on every chain
    # at the first of them. Passes = compactions of the longest chain, each on the calls still overflowing.
    late = np.flatnonzero(before > room)
    while late.size:
        new_chain = np.ones(late.size, dtype=bool)
        new_chain[1:] = chain_start[late[1:]] != chain_start[late[:-1]]
        first = late[np.maximum.accumulate(np.where(new_chain, np.arange(late.size), 0))]
        epoch[late] += 1
        run_first[late] = first
        late = late[before[late] - before[first] > budget[late]]
    prompt = np.where(epoch == 0, base + before, base + p.summary_tokens + before - before[run_first])
    return epoch, run_first, prompt


def _plan_calls(p: AgentParams, m: int, seed: int) -> SimpleNamespace:
    """Structure, lengths and arrivals of every call of m tasks: their main chains first, then every
    sub-agent chain; each chain's calls are consecutive, so a history is a contiguous range of calls."""

    def draw(purpose):
        return rng_for(seed, "agent", purpose)

    c = SimpleNamespace(m=m, summary_tokens=p.summary_tokens)
    quarter = p.max_context_tokens // 4
    c.task_start = poisson_arrivals(draw("start"), p.task_rate, m)
    c.task_system = zipf_indices(draw("system"), p.system_prompts, p.system_zipf, m)
    c.task_user = zipf_indices(draw("user"), p.users, 1.0, m)
    c.system_len = lognormal_ints(draw("system-len"), p.system_tokens_mean, 0.3, p.system_prompts, lo=16, hi=quarter)
    c.task_len = lognormal_ints(draw("task-len"), p.task_tokens_mean, 1.0, m, lo=1, hi=quarter)
    main_calls = lognormal_ints(draw("calls"), p.calls_mean, p.calls_sigma, m, lo=1, hi=p.max_calls)

    n_main = int(main_calls.sum())
    main_task = np.repeat(np.arange(m), main_calls)
    main_pos = group_ranks(main_task)
    fork = (draw("fork").random(n_main) < p.fork_prob) & (main_pos < main_calls[main_task] - 1)
    c.fork_call = np.flatnonzero(fork)
    c.fanout = np.minimum(
        1 + draw("fanout").poisson(max(p.subagents_mean - 1, 0.0), c.fork_call.size), max(p.max_subagents, 1)
    )
    fork_first_sub = np.cumsum(c.fanout) - c.fanout
    c.sub_fork = np.repeat(c.fork_call, c.fanout)  # the main call each sub-agent was forked from
    sub_calls = lognormal_ints(
        draw("sub-calls"), p.subagent_calls_mean, SUBAGENT_CALLS_SIGMA, c.sub_fork.size, lo=1, hi=p.max_calls
    )

    chain_len = np.concatenate([main_calls, sub_calls])
    chain_first = np.cumsum(chain_len) - chain_len
    c.n_calls = n = int(chain_len.sum())
    c.chain = np.repeat(np.arange(chain_len.size), chain_len)
    c.start = chain_first[c.chain]
    c.pos = np.arange(n) - c.start
    c.is_sub = c.chain >= m
    c.sub_of = np.where(c.is_sub, c.chain - m, 0)
    c.task = np.concatenate([main_task, np.repeat(main_task[c.sub_fork], sub_calls)])
    c.sub_last = chain_first[m:] + sub_calls - 1  # a sub-agent's final output is its result
    c.origin = np.concatenate([np.arange(n_main), np.repeat(c.sub_fork, sub_calls)])  # fork call of a sub-agent call
    c.is_fork = np.zeros(n, dtype=bool)
    c.is_fork[c.fork_call] = True
    c.call_fanout = np.zeros(n, dtype=np.int64)
    c.call_fanout[c.fork_call] = c.fanout
    c.call_first_sub = np.zeros(n, dtype=np.int64)
    c.call_first_sub[c.fork_call] = fork_first_sub

    c.out = lognormal_ints(draw("output"), p.output_tokens_mean, p.output_tokens_sigma, n, lo=1, hi=MAX_OUTPUT_TOKENS)
    c.tool = lognormal_ints(draw("tool"), p.tool_tokens_mean, p.tool_tokens_sigma, n, lo=1, hi=p.max_tool_tokens)
    c.think = _lognormal(draw("tool-time"), p.tool_time_mean_s, p.tool_time_sigma, n)
    c.think[:n_main][main_pos == 0] = 0.0  # a task's first call waits for nothing
    # What each call leaves in its chain's history: its output + the tool output, or for a fork call its
    # output + the results of its sub-agents.
    results = np.bincount(
        np.repeat(np.arange(c.fork_call.size), c.fanout), weights=c.out[c.sub_last], minlength=c.fork_call.size
    ).astype(np.int64)
    appended = c.out + c.tool
    appended[c.fork_call] = c.out[c.fork_call] + results

    # Arrivals. A call is sent when the previous call on its chain has decoded and its tool has run; a
    # merge waits for its slowest sub-agent instead. Sub-agent clocks start when the fork call finishes.
    decode = c.out * p.decode_s_per_token
    prev_decode = np.where(c.pos > 0, np.roll(decode, 1), 0.0)
    clock = _chain_cumsum(c.think + prev_decode, c.start)
    wait = np.zeros(n)
    if c.fork_call.size:
        sub_done = clock[c.sub_last] + decode[c.sub_last]
        wait[c.fork_call + 1] = np.maximum.reduceat(sub_done, fork_first_sub)
    clock += _chain_cumsum(wait, c.start)
    main_arrival = c.task_start[c.task] + clock
    c.arrival = np.where(c.is_sub, main_arrival[c.origin] + decode[c.origin] + clock, main_arrival)

    # Prompt lengths: main chains first, then sub-agents, which inherit the parent's prompt at the fork.
    base = c.system_len[c.task_system[c.task]] + c.task_len[c.task]
    _, _, prompt = _compact(p, appended, c.start, np.zeros(n, dtype=np.int64), base)
    # The instruction is clipped so that the inherited prompt always fits without a compaction.
    instr = np.minimum(
        lognormal_ints(draw("sub-task-len"), p.subagent_task_tokens_mean, 1.0, c.sub_fork.size),
        p.max_context_tokens - prompt[c.sub_fork],
    )
    c.instr = np.concatenate([np.zeros(n_main, dtype=np.int64), np.repeat(instr, sub_calls)])  # per call
    hist0 = np.where(c.is_sub, prompt[c.origin] - base + c.instr, 0)
    c.epoch, c.run_first, c.prompt = _compact(p, appended, c.start, hist0, base)
    return c


def _tasks_needed(p: AgentParams, n: int) -> int:
    """A first guess of how many tasks cover n requests: steady state plus the tasks of one task duration."""
    per_task = p.calls_mean * (1 + p.fork_prob * p.subagents_mean * p.subagent_calls_mean)
    duration = p.calls_mean * (p.output_tokens_mean * p.decode_s_per_token + p.tool_time_mean_s)
    return int(1.1 * n / per_task + p.task_rate * duration) + 16


def _item_segments(c: SimpleNamespace, keys: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The segments each call appends to its chain's history, flattened; calls' items at bounds[i]:bounds[i+1]."""
    count = np.where(c.is_fork, 1 + c.call_fanout, 2)
    bounds = np.zeros(c.n_calls + 1, dtype=np.int64)
    np.cumsum(count, out=bounds[1:])
    content = np.empty(bounds[-1], dtype=np.uint64)
    tokens = np.empty(bounds[-1], dtype=np.int64)
    content[bounds[:-1]] = content_ids(keys["output"], np.arange(c.n_calls))
    tokens[bounds[:-1]] = c.out
    plain = np.flatnonzero(~c.is_fork)
    content[bounds[plain] + 1] = content_ids(keys["tool"], plain)
    tokens[bounds[plain] + 1] = c.tool[plain]
    # A merge appends each sub-agent's final output: the same content, hence the same tokens.
    slot = bounds[c.sub_fork] + 1 + group_ranks(c.sub_fork)
    content[slot] = content_ids(keys["output"], c.sub_last)
    tokens[slot] = c.out[c.sub_last]
    return bounds, content, tokens


def _block_hashes(c: SimpleNamespace, rows: np.ndarray, block_size: int, seed: int) -> pa.ListArray:
    """Block ids of the calls `rows`, in that order.

    Hashing every prompt would cost the sum of all prompt lengths, quadratic in chain length. Instead each
    run of calls sharing a chain and a compaction epoch is hashed once, through its longest kept prompt: the
    others are token prefixes of it, so their full blocks are its first blocks. Only a prompt's last,
    partial block needs its own id: a hash of the previous block's id and the pieces of segments it holds,
    so equal content still gives equal ids.
    """
    keys = {k: name_key("agent", seed, k) for k in ("system", "task", "summary", "subtask", "output", "tool", "tail")}
    bounds, item_content, item_tokens = _item_segments(c, keys)

    kept = np.sort(rows)
    new_group = np.ones(kept.size, dtype=bool)
    new_group[1:] = c.run_first[kept[1:]] != c.run_first[kept[:-1]]
    group_of = np.full(c.n_calls, -1)
    group_of[kept] = np.cumsum(new_group) - 1
    longest = kept[np.append(np.flatnonzero(new_group)[1:] - 1, kept.size - 1)]
    nv = longest.size
    v = np.arange(nv)

    # Layout of a longest prompt: prefix, task message, summary, inherited history, sub-agent instruction,
    # own history. A sub-agent before its first compaction inherits the parent's prompt at the fork.
    task, sub = c.task[longest], c.sub_of[longest]
    inherit = c.is_sub[longest] & (c.epoch[longest] == 0)
    fork = np.where(inherit, c.origin[longest], longest)
    system = c.task_system[task]
    parts = [
        (v, 0, content_ids(keys["system"], system), c.system_len[system]),
        (v, 1, content_ids(keys["task"], task), c.task_len[task]),
        (v, 2, mix(keys["summary"], c.chain[fork], c.epoch[fork]), np.where(c.epoch[fork] > 0, c.summary_tokens, 0)),
        (v, 4, content_ids(keys["subtask"], sub), np.where(inherit, c.instr[longest], 0)),
    ]
    for order, owners, lo, hi in (
        (3, v[inherit], c.run_first[fork[inherit]], fork[inherit]),
        (5, v, c.run_first[longest], longest),
    ):
        which, items = _ranges(bounds[lo], bounds[hi])
        parts.append((owners[which], order, item_content[items], item_tokens[items]))
    owner, order, content, tokens = (
        np.concatenate([np.broadcast_to(part[i], part[0].shape) for part in parts]) for i in range(4)
    )
    sort = np.lexsort((np.arange(owner.size), order, owner))
    sort = sort[tokens[sort] > 0]
    owner, content, tokens = owner[sort], content[sort].astype(np.uint64), tokens[sort]
    v_len, v_ids = prompt_block_ids(owner, content, tokens, nv, block_size)
    if not np.array_equal(v_len, c.prompt[longest]):
        raise AssertionError("agent generator: segment layout disagrees with the planned prompt lengths")
    v_first = np.asarray(v_ids.offsets)[:-1].astype(np.int64)
    v_values = np.asarray(v_ids.values)

    # Full blocks come from the group's longest prompt.
    length, group = c.prompt[rows], group_of[rows]
    full = length // block_size
    tail = length - full * block_size
    n_blocks = full + (tail > 0)
    offsets = np.zeros(rows.size + 1, dtype=np.int64)
    np.cumsum(n_blocks, out=offsets[1:])
    src = np.repeat(v_first[group] - offsets[:-1], n_blocks)
    src += np.arange(offsets[-1])
    values = v_values[src]
    del src

    # Partial last blocks: the pieces of the longest prompt's segments in [full * block_size, length).
    has_tail = np.flatnonzero(tail)
    seg_end = np.cumsum(tokens)
    seg_start = seg_end - tokens
    v_base = np.cumsum(v_len) - v_len
    lo = v_base[group[has_tail]] + full[has_tail] * block_size
    hi = v_base[group[has_tail]] + length[has_tail]
    first_seg = np.searchsorted(seg_end, lo, side="right")
    last_seg = np.searchsorted(seg_end, hi - 1, side="right")
    which, seg = _ranges(first_seg, last_seg + 1)
    piece_lo = np.maximum(lo[which], seg_start[seg])
    piece_hi = np.minimum(hi[which], seg_end[seg])
    piece = mix(content[seg], piece_lo - seg_start[seg], piece_hi - piece_lo, seg - first_seg[which])
    n_pieces = last_seg + 1 - first_seg
    pieces = np.add.reduceat(piece, np.cumsum(n_pieces) - n_pieces)  # order-sensitive: piece index is hashed
    prev = np.where(full[has_tail] > 0, v_values[v_first[group[has_tail]] + np.maximum(full[has_tail] - 1, 0)], 0)
    values[offsets[has_tail + 1] - 1] = mix(keys["tail"], prev, pieces, tail[has_tail])
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(values, pa.uint64()))


@generator("agent", AgentParams, bytes_per_request=18_000)
def agent(p: AgentParams, n: int, seed: int, block_size: int):
    """Agent tasks: tool-call chains that fork sub-agents on the parent's prefix and merge their results."""
    _check(p)
    m = _tasks_needed(p, n)
    while True:
        c = _plan_calls(p, m, seed)
        # Later tasks start after the last one planned, so the first n calls in time are final once this
        # many calls arrive before that start.
        covered = int(np.count_nonzero(c.arrival <= c.task_start[-1]))
        if covered >= n:
            break
        m = int(m * min(4.0, max(1.25, 1.1 * n / max(covered, 1)))) + 16
    rows = np.argsort(c.arrival, kind="stable")[:n]  # call behind each output row, rows in arrival order
    row_of = np.full(c.n_calls, -1)
    row_of[rows] = np.arange(n)

    parent = np.where(c.pos > 0, np.arange(c.n_calls) - 1, np.where(c.is_sub, c.origin, -1))
    parent_row = row_of[parent[rows]]
    # A merge is the main-chain call right after a fork; it depends on the last call of each sub-agent.
    merges = (c.pos[rows] > 0) & ~c.is_sub[rows] & c.is_fork[rows - 1]
    fork = rows[merges] - 1
    dep_count = np.zeros(n, dtype=np.int64)
    dep_count[merges] = c.call_fanout[fork]
    _, sub = _ranges(c.call_first_sub[fork], c.call_first_sub[fork] + c.call_fanout[fork])
    dep_offsets = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(dep_count, out=dep_offsets[1:])
    depends_on = pa.ListArray.from_arrays(
        pa.array(dep_offsets), string_ids("agent-", row_of[c.sub_last[sub]]), mask=pa.array(~merges)
    )

    # turn: the call's index within its task, in arrival order.
    task = c.task[rows]
    by_task = np.argsort(task, kind="stable")
    turn = np.empty(n, dtype=np.int64)
    turn[by_task] = group_ranks(task[by_task])

    arrays = {
        "request_id": string_ids("agent-", np.arange(n)),
        "arrival_s": pa.array(c.arrival[rows]),
        "input_tokens": pa.array(c.prompt[rows].astype(np.int32)),
        "output_tokens": pa.array(c.out[rows].astype(np.int32)),
        "block_hashes": _block_hashes(c, rows, block_size, seed),
        "workload": pa.array(np.full(n, "agent", dtype=object)),
        "user_id": string_ids("agent-u", c.task_user[task]),
        "session_id": string_ids("agent-t", task),
        "turn": pa.array(turn.astype(np.int32)),
        "parent_id": pc.if_else(pa.array(parent_row >= 0), string_ids("agent-", np.maximum(parent_row, 0)), None),
        "depends_on": depends_on,
        "think_time_s": pa.array(c.think[rows].astype(np.float32)),
    }
    return conform(pa.table(arrays))
