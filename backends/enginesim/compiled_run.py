"""When engine-sim runs its compiled loop (compiled_loop.py), and the glue: the trace and the deployment into
arrays, the arrays back into the `Req` and `Instance` objects that results.py reads, so that both loops feed
the same report code. The Python loop (cluster.py) stays the reference and runs everything the compiled one
does not cover (scenarios, tiers below HBM, closed loop, a client concurrency limit, other policies, routers
a plugin registers); tests/backends/enginesim/test_compiled_loop.py replays traces through both and compares.
"""

from __future__ import annotations

import os

import numpy as np
from kvbench.backends.enginesim import cluster
from kvbench.backends.enginesim import compiled_loop as L
from kvbench.backends.enginesim import compiled_pool as P
from kvbench.backends.enginesim.engine import MAX_FAST_FORWARD, Instance, Req
from kvbench.backends.enginesim.roofline import LatencyModel

from kvbench.cache.compiled import start_background_build
from kvbench.cache.policies.vllm import VllmPool
from kvbench.cache.tiers import Tier, TierStack

# KVBENCH_ENGINE_LOOP=python: always the Python loop (to compare, or to rule the compiled one out); =compiled: the
# compiled one wherever it applies, compiled now if need be; unset: as `applies` says
SWITCH = "KVBENCH_ENGINE_LOOP"
# Below this many requests the Python loop (~2,000 requests/s) is done before numba would have compiled the loop
# (~45 s on one core): such a replay runs in Python while the AOT module builds in the background for later runs.
JIT_WORTH_REQUESTS = 50_000
# The kernel-by-kernel step's tables (compiled_loop.OPS) hold one entry per token count a step can reach; past
# this many (a --max-num-batched-tokens in the millions) filling them would take longer than the replay saves.
OPS_TABLE_MAX = 1 << 17


def applies(settings: dict, pol, scenarios, latency, router: str, tiers: TierStack, n_requests: int) -> bool:
    """Whether to run the compiled loop: it covers this replay (with the Python loop's results, only faster),
    and it is built, or the replay is long enough to be worth compiling it now."""
    if not _covers(settings, pol, scenarios, latency, router, tiers) or os.environ.get(SWITCH) == "python":
        return False
    if L.run_cluster.aot_ready() or os.environ.get(SWITCH) == "compiled" or n_requests >= JIT_WORTH_REQUESTS:
        return True
    start_background_build(L.run_cluster.unit)
    return False


def _covers(settings: dict, pol, scenarios, latency, router: str, tiers: TierStack) -> bool:
    return (
        pol.cache is VllmPool
        and not scenarios
        and not tiers.lower
        and not settings["closed_loop"]
        and not settings["max_concurrency"]
        and type(latency) is LatencyModel
        and latency.join_window_s == 0  # (the compiled loop starts an idle instance's step at the arrival)
        and (latency._ops is None or _step_cap(settings) <= OPS_TABLE_MAX)
        and router in L.ROUTER_CODES
        and cluster.ROUTERS[router] is cluster.BUILTIN_ROUTERS.get(router)  # (not replaced by a plugin's)
    )


def _step_cap(settings: dict) -> int:
    """The most tokens one step can run: a full token budget plus every running sequence's decode."""
    return settings["max_num_batched_tokens"] + settings["max_num_seqs"]


def _latency_constants(latency: LatencyModel, kv_bytes_block: float, pcie_bw: float, sched) -> np.ndarray:
    cal, terms = latency.calibration, latency.step_terms()
    ops, tables = terms["ops"], []
    if ops is not None:
        tokens, seqs = sched.max_num_batched_tokens + sched.max_num_seqs, sched.max_num_seqs
        tables = [ops.linear_s(t) for t in range(tokens + 1)] + [ops.lm_head_s(s) for s in range(seqs + 1)]
    lat = np.zeros(L.LAT_FIELDS + len(tables))
    lat[L.LAT_FIELDS :] = tables
    values = {
        L.CALIBRATED: cal is not None,
        L.LIN_FPT: terms["linear_flops_per_token"],
        L.LIN_FS: terms["linear_flops_s"],
        L.ATTN_FPP: terms["attn_flops_per_pair"],
        L.ATTN_FS: terms["attn_flops_s"],
        L.WEIGHT_BYTES: terms["weight_bytes"],
        L.TP: latency.tp,
        L.ACTIVE: terms["active_fraction"],
        L.BYTES_S: terms["bytes_s"],
        L.KV_BYTES: terms["kv_bytes"],
        L.KV_SHARDS: terms["kv_shards"],
        L.COMM_BPT: terms["comm_bytes_per_token"],
        L.PEER_BW: latency.hw.peer_bw,
        L.KV_BYTES_BLOCK: kv_bytes_block,
        L.PCIE_BW: pcie_bw,
    }
    if ops is not None:
        values |= {
            L.OPS: 1,
            L.ATTN_FLOOR: terms["attn_floor_s"],
            L.COMM_FIXED: terms["comm_fixed_s"],
            L.COMM_SPT: terms["comm_s_per_token"],
            L.LM_AT: L.LAT_FIELDS + sched.max_num_batched_tokens + sched.max_num_seqs + 1,
        }
    if cal is not None:
        values |= {
            L.C_STEP: cal.step_overhead_s,
            L.C_SEQ: cal.s_per_seq,
            L.C_TOKEN: cal.s_per_token,
            L.C_PAIR: cal.s_per_pair,
            L.C_KV: cal.s_per_kv_token,
        }
    for field, value in values.items():
        lat[field] = value
    return lat


def run(prep, trace, n_instances: int, pool_blocks: int, sched, latency: LatencyModel, router: str, pcie_bw: float):
    """Replay `prep` on `n_instances` instances; returns (reqs, instances, timeline, evictions, evict_matrix) in
    the form cluster.simulate and the pools leave them."""
    n, bs = prep.n_requests, prep.block_size
    n_in = prep.input_tokens.astype(np.int64)
    n_out = np.maximum(trace.column("output_tokens").to_numpy(), 1).astype(np.int64)
    arrival = trace.column("arrival_s").to_numpy().astype(np.float64)
    kv_bytes_block = latency.kv_bytes_per_token * bs
    rq = np.zeros((L.REQ_FIELDS, n), np.int64)
    rq[P.KOFF] = prep.offsets[:-1]
    rq[P.MAXHIT] = prep.max_hit
    rq[P.FULL] = np.minimum(np.diff(prep.offsets), n_in // bs)
    rq[P.TENANT] = prep.tenant
    rq[L.NIN], rq[L.NOUT] = n_in, n_out
    rq[[L.INSTANCE, L.CACHED_ON, L.HIT, L.WNEXT]] = -1
    rqf = np.full((3, n), -1.0)
    # each request's held slots: at most its prompt and output in blocks
    most = -(-(n_in + n_out) // bs)
    hoff = np.zeros(n + 1, np.int64)
    np.cumsum(most, out=hoff[1:])
    # slots ever made are at most the pool's, and at most the blocks the whole trace asks for
    slots = int(min(pool_blocks, 2 + hoff[-1])) + 1
    table = 1 << max(4, int(2 * slots).bit_length())
    sl = np.zeros((n_instances, P.SLOT_FIELDS, slots), np.int32)
    born = np.zeros((n_instances, slots))
    hk, hv = np.full((n_instances, table), -1, np.int32), np.zeros((n_instances, table), np.int32)
    evictions = np.zeros(n, np.int32)
    matrix = np.zeros((len(prep.tenant_names),) * 2, np.int64)
    pool = (
        sl,
        np.zeros((n_instances, 3), np.int64),
        born,
        hk,
        hv,
        np.ascontiguousarray(prep.keys, np.int32),
        np.zeros(hoff[-1], np.int32),
        hoff,
        np.zeros(max(1, int(most.max(initial=1))), np.int32),
        evictions,
        matrix,
    )
    entry_delay = latency.request_overhead_s
    due = arrival + entry_delay
    order = np.argsort(due, kind="stable")  # the arrival heap's order: time, then row
    fixed = _fixed_routes(prep, n_instances) if router == "prefix-affinity" else np.zeros(1, np.int64)
    ins = np.zeros((n_instances, L.INST_FIELDS), np.int64)
    insf = np.zeros((n_instances, L.INST_FLOATS))
    seqs = sched.max_num_seqs
    batch = [np.zeros((n_instances, seqs), np.int64) for _ in range(4)]  # running, pieces' rows and sizes, decodes
    mode = {"recompute": L.RECOMPUTE, "swap": L.SWAP, "protect-after": L.PROTECT}[sched.preemption]
    cfg = np.zeros(L.CFG_FIELDS, np.int64)
    cfg[[L.BS, L.MAX_SEQS, L.MAX_BATCHED, L.PREEMPT_MODE, L.PROTECT_AFTER, L.ROUTER, L.FAST_FORWARD]] = (
        bs, seqs, sched.max_num_batched_tokens, mode, sched.protect_after, L.ROUTER_CODES[router], MAX_FAST_FORWARD
    )  # fmt: skip
    span = float(arrival.max() - arrival.min()) if n else 0.0
    sample_every = max(span, 1e-3) / cluster.TIMELINE_POINTS
    lifetimes, lifetime_of, *samples = L.run_cluster(
        *pool, rq, rqf, due, order, fixed, ins, insf, *batch,
        _latency_constants(latency, kv_bytes_block, pcie_bw, sched), cfg, pool_blocks, sample_every,
    )  # fmt: skip
    instances = _instances(ins, insf, pool, lifetimes, lifetime_of, latency, pool_blocks, bs, sched, pcie_bw)
    reqs = _requests(rq, rqf, arrival, prep, instances)
    return reqs, instances, _timeline(samples, n_instances, pool_blocks), evictions, matrix


def _fixed_routes(prep, n_instances: int) -> np.ndarray:
    """prefix-affinity's choice per request: a function of the request's first keys alone."""
    keys, off, state = prep.keys, prep.offsets, {}
    stand_ins = list(range(n_instances))
    pick = cluster.ROUTERS["prefix-affinity"]
    first = [keys[off[r] : min(off[r + 1], off[r] + cluster.AFFINITY_BLOCKS)].tolist() for r in range(prep.n_requests)]
    return np.array([pick(stand_ins, _Keys(k), state) for k in first], np.int64)


class _Keys:
    __slots__ = ("keys",)

    def __init__(self, keys):
        self.keys = keys


def _instances(ins, insf, pool, lifetimes, lifetime_of, latency, pool_blocks, bs, sched, pcie_bw):
    born, hk, hv = pool[2:5]
    out = []
    for i in range(ins.shape[0]):
        tiers = TierStack(Tier("dram", 0, 1.0), Tier("ssd", 0, 1.0), None, False)
        inst = Instance(i, None, tiers, latency, pool_blocks, bs, sched, pcie_bw)
        inst.now, inst.used, inst.routed = float(insf[i, L.NOW]), int(ins[i, L.USED]), int(ins[i, L.ROUTED])
        inst.stats.update(
            preemptions=int(ins[i, L.PREEMPTIONS]),
            recomputed_tokens=int(ins[i, L.RECOMP_TOKENS]),
            swap_bytes=float(insf[i, L.SWAP_BYTES]),
            steps=int(ins[i, L.STEPS]),
        )
        inst.lifetimes = lifetimes[lifetime_of == i].tolist()
        heads = hv[i][hk[i] != -1]  # each cached key's oldest slot holds its birth
        inst.born = dict(enumerate(born[i, heads].tolist()))
        out.append(inst)
    return out


def _requests(rq, rqf, arrival, prep, instances) -> list[Req]:
    cols = {name: rq[f].tolist() for name, f in (("instance", L.INSTANCE), ("hit", L.HIT), ("gen", L.GEN))}
    recomputed, rejected = rq[L.RECOMP].tolist(), rq[L.REJECTED].tolist()
    start, first, finish = (rqf[f].tolist() for f in (L.START, L.FIRST, L.FINISH))
    n_in, n_out, max_hit, arrival = rq[L.NIN].tolist(), rq[L.NOUT].tolist(), prep.max_hit.tolist(), arrival.tolist()
    reqs = []
    for r in range(len(arrival)):
        hit = cols["hit"][r]
        req = Req(r, arrival[r], n_in[r], n_out[r], None, max_hit[r], start[r], first[r], finish[r],
                  None if hit < 0 else {"hbm": hit}, generated=cols["gen"][r], recomputed=recomputed[r],
                  instance=cols["instance"][r])  # fmt: skip
        if rejected[r]:
            req.rejected_for = instances[req.instance].rejection(req)
        reqs.append(req)
    return reqs


def _timeline(samples, n_instances: int, pool_blocks: int) -> dict:
    """Cluster._sample's record from the loop's samples (the same float arithmetic)."""
    t, used, running, waiting = samples
    used = used.reshape(-1, n_instances).tolist()
    usage = [float(np.mean([min(1.0, u / pool_blocks) if pool_blocks else 0.0 for u in row])) for row in used]
    return {
        "t_s": [round(x, 6) for x in t.tolist()],
        "kv_usage": usage,
        "running": running.tolist(),
        "waiting": waiting.tolist(),
    }
