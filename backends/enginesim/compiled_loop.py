"""engine-sim's event loop compiled: cluster.py's `Cluster` and engine.py's `Instance` over vLLM's pool
(compiled_pool.py), for the configuration most replays use: open loop, no client concurrency limit, no
scenario, no tier below HBM, the `vllm` policy and a built-in router. Each function below is the Python
method it names, step for step and in the same floating-point order, so the results are the Python loop's
bit for bit; compiled_run.py decides when it applies and turns its arrays back into the Python objects.

Why: a long replay runs millions of scheduler iterations, each a few dozen Python calls per request in the
batch; compiled, an hour of a busy cluster replays in seconds (benchmarks/enginesim_speed.py).
"""

from __future__ import annotations

import numpy as np
from kvbench.backends.enginesim.compiled_pool import (
    MAXHIT,
    admission_need,
    begin,
    cached_prefix,
    end,
    free_blocks,
    grow,
    init_pool,
)

from kvbench.cache.compiled import kernel_fn

# numba's, bound before any compile (kvbench.cache.compiled._use_jit): an AOT replay never imports numba
NUMBA_GLOBALS = {"List": "numba.typed:List", "types": "numba:types"}
List = types = None

# per-request ints `rq[FIELD, r]` beyond the pool's (compiled_pool.HELD ... TENANT = 0..5)
NIN, NOUT, TODO, CONTEXT, GEN, INSTANCE, CACHED_ON, HIT, RECOMP, SWAPPED, REJECTED, WNEXT = range(6, 18)
REQ_FIELDS = 18
START, FIRST, FINISH = 0, 1, 2  # per-request times `rqf[FIELD, r]`, -1 until they happen
# per-instance ints `ins[i, FIELD]` and floats `insf[i, FIELD]`
BUSY, ROUTED, USED, RUNN, WHEAD, WTAIL, WCOUNT, QUEUED, NPIECES, NDEC, WIN_TOKEN, WIN_N = range(12)
PREEMPTIONS, RECOMP_TOKENS, STEPS = 12, 13, 14
INST_FIELDS = 15
WIN_BEGUN, WIN_PER, WIN_END, SWAP_BYTES, NOW = range(5)
INST_FLOATS = 5
# the latency model's constants `lat[...]` (roofline.LatencyModel, or its Calibration's terms)
(CALIBRATED, LIN_FPT, LIN_FS, ATTN_FPP, ATTN_FS, WEIGHT_BYTES, TP, ACTIVE, BYTES_S, KV_BYTES, KV_SHARDS, COMM_BPT,
 PEER_BW, C_STEP, C_SEQ, C_TOKEN, C_PAIR, C_KV, KV_BYTES_BLOCK, PCIE_BW,
 OPS, ATTN_FLOOR, COMM_FIXED, COMM_SPT, LM_AT) = range(25)  # fmt: skip
LAT_FIELDS = 25
# With OPS (operators.py's kernel-by-kernel step), lat[LAT_FIELDS + t] holds the linear kernels' seconds at t
# tokens, and lat[lat[LM_AT] + s] the logits GEMM's at s sequences: tables compiled_run fills from the Python
# model itself, so both loops read the same floats.
# the scheduler and loop settings `cfg[...]`
BS, MAX_SEQS, MAX_BATCHED, PREEMPT_MODE, PROTECT_AFTER, ROUTER, FAST_FORWARD = range(7)
CFG_FIELDS = 7
RECOMPUTE, SWAP, PROTECT = 0, 1, 2  # PREEMPT_MODE
ROUND_ROBIN, LEAST_LOADED, CACHE_AWARE, FIXED = 0, 1, 2, 3  # ROUTER (FIXED: a route per request, given)
ROUTER_CODES = {"round-robin": ROUND_ROBIN, "least-loaded": LEAST_LOADED, "cache-aware": CACHE_AWARE,
                "prefix-affinity": FIXED}  # fmt: skip


@kernel_fn()
def _cost(lat, tokens, pairs, kv_read, kv_written, seqs):
    """roofline.LatencyModel._cost(...).total"""
    if tokens == 0:
        return 0.0
    if lat[OPS]:  # LatencyModel._operator_cost
        kv = (kv_read + kv_written) * (lat[KV_BYTES] / lat[KV_SHARDS]) / lat[BYTES_S]
        attn = pairs * lat[ATTN_FPP] / lat[ATTN_FS]
        attention = lat[ATTN_FLOOR] + (attn if attn > kv else kv)
        kernels = lat[LAT_FIELDS + tokens] + lat[int(lat[LM_AT]) + seqs] + attention
        return kernels + (lat[COMM_FIXED] + tokens * lat[COMM_SPT])
    comm = tokens * lat[COMM_BPT] / lat[PEER_BW] if lat[TP] > 1 else 0.0
    if lat[CALIBRATED]:
        step = lat[C_STEP] + lat[C_SEQ] * seqs + lat[C_TOKEN] * tokens + lat[C_PAIR] * pairs + lat[C_KV] * kv_read
        return max(step, 0.0) + comm
    compute = tokens * lat[LIN_FPT] / lat[LIN_FS] + pairs * lat[ATTN_FPP] / lat[ATTN_FS]
    share = lat[ACTIVE]
    touched = 1.0 if share >= 1.0 else 1.0 - (1.0 - share) ** float(tokens)  # (pow(), as Python's float ** int)
    weights = lat[WEIGHT_BYTES] * touched / lat[TP] / lat[BYTES_S]
    kv = (kv_read + kv_written) * (lat[KV_BYTES] / lat[KV_SHARDS]) / lat[BYTES_S]
    memory = weights + kv
    return (memory if memory > compute else compute) + comm


@kernel_fn()
def _step_s(lat, rq, pieces_r, pieces_t, dec, i, n_pieces, n_dec):
    """LatencyModel.step_s(prefills, contexts) of instance i's planned iteration."""
    tokens, pairs, kv_read, kv_written, seqs = 0, 0.0, 0, 0, 0
    for j in range(n_pieces):
        new, context = pieces_t[i, j], rq[CONTEXT, pieces_r[i, j]]
        if new:
            seqs += 1
            tokens += new
            pairs += new * context + new * (new + 1) / 2
            kv_read += context
            kv_written += new
    context = 0
    for j in range(n_dec):
        context += rq[CONTEXT, dec[i, j]]
    n = n_dec
    return _cost(lat, tokens + n, pairs + context + n, kv_read + context, kv_written + n, seqs + n)


@kernel_fn()
def _enqueue(rq, ins, i, r, front):
    if front:
        rq[WNEXT, r] = ins[i, WHEAD]
        ins[i, WHEAD] = r
        if ins[i, WTAIL] == -1:
            ins[i, WTAIL] = r
    else:
        rq[WNEXT, r] = -1
        if ins[i, WTAIL] == -1:
            ins[i, WHEAD] = r
        else:
            rq[WNEXT, ins[i, WTAIL]] = r
        ins[i, WTAIL] = r
    ins[i, WCOUNT] += 1
    ins[i, QUEUED] += rq[NIN, r]


@kernel_fn()
def _dequeue(rq, ins, i):
    r = ins[i, WHEAD]
    ins[i, WHEAD] = rq[WNEXT, r]
    if ins[i, WHEAD] == -1:
        ins[i, WTAIL] = -1
    ins[i, WCOUNT] -= 1
    ins[i, QUEUED] -= rq[NIN, r]
    return r


@kernel_fn()
def _load(rq, ins, running, i):
    """Instance.load: tokens queued or still to run."""
    total = 0
    for j in range(ins[i, RUNN]):
        r = running[i, j]
        total += rq[TODO, r] + rq[NOUT, r] - rq[GEN, r]
    return total + ins[i, QUEUED]


@kernel_fn()
def _route(hk, hv, keys, rq, ins, running, cfg, fixed, r, state):
    """The routers of cluster.py (prefix-affinity's choice depends on the request alone: given in `fixed`)."""
    n = ins.shape[0]
    kind = cfg[ROUTER]
    if kind == FIXED:
        return fixed[r]
    if kind == ROUND_ROBIN:
        state[0] = (state[0] + 1) % n
        return state[0]
    best, b0, b1 = -1, 0, 0
    for i in range(n):
        if kind == LEAST_LOADED:  # min of (load, routed, index)
            s0, s1 = -_load(rq, ins, running, i), -ins[i, ROUTED]
        else:  # max of (cached tokens - load, -routed, -index)
            s0 = cached_prefix(hk, hv, keys, rq, i, r, rq[MAXHIT, r]) * cfg[BS] - _load(rq, ins, running, i)
            s1 = -ins[i, ROUTED]
        if best < 0 or s0 > b0 or (s0 == b0 and s1 > b1):
            best, b0, b1 = i, s0, s1
    return best


@kernel_fn()
def _blocks(tokens, bs):
    return -(-tokens // bs)


@kernel_fn()
def _fits(sl, pc, hk, hv, keys, rq, cfg, i, r):
    need = admission_need(sl, hk, hv, keys, rq, i, r, rq[NIN, r] + rq[GEN, r], cfg[BS])
    return need <= free_blocks(pc, i)


@kernel_fn()
def _preempt(sl, pc, rq, ins, insf, running, held, hoff, scratch, lat, cfg, i):
    """Instance._preempt: the most recently scheduled sequence goes back to the queue's head."""
    bs = cfg[BS]
    ins[i, RUNN] -= 1
    victim = running[i, ins[i, RUNN]]
    ins[i, USED] -= _blocks(rq[CONTEXT, victim] + rq[TODO, victim], bs)
    ins[i, PREEMPTIONS] += 1
    if rq[CACHED_ON, victim] == i:
        end(sl, pc, rq, held, hoff, scratch, i, victim)
    mode = cfg[PREEMPT_MODE]
    swap = mode == SWAP or (mode == PROTECT and rq[GEN, victim] > cfg[PROTECT_AFTER])
    _enqueue(rq, ins, i, victim, True)
    if swap:
        rq[SWAPPED, victim] = 1
        n_bytes = _blocks(rq[CONTEXT, victim], bs) * lat[KV_BYTES_BLOCK]
        insf[i, SWAP_BYTES] += n_bytes
        return n_bytes / lat[PCIE_BW]
    rq[TODO, victim] = 0
    return 0.0


@kernel_fn()
def _admit(sl, pc, hk, hv, keys, rq, rqf, ins, insf, running, held, hoff, lat, cfg, i, r, now):
    """Instance._admit: look r up, hold its hit; returns the seconds its KV takes to come back from a swap."""
    bs, load_s = cfg[BS], 0.0
    if rq[SWAPPED, r]:
        n_bytes = _blocks(rq[CONTEXT, r], bs) * lat[KV_BYTES_BLOCK]
        load_s = n_bytes / lat[PCIE_BW]
        insf[i, SWAP_BYTES] += n_bytes
        if rq[CACHED_ON, r] == i:
            begin(sl, pc, hk, hv, keys, rq, held, hoff, i, r)
        rq[SWAPPED, r] = 0
    else:
        hit = begin(sl, pc, hk, hv, keys, rq, held, hoff, i, r)
        rq[CACHED_ON, r] = i
        cached = min(hit * bs, rq[NIN, r])
        if rq[HIT, r] < 0:
            rq[HIT, r] = hit
        else:  # a recompute after preemption: what is not cached any more is computed again
            lost = max(0, rq[CONTEXT, r] - cached)
            rq[RECOMP, r] += lost
            ins[i, RECOMP_TOKENS] += lost
        rq[TODO, r] = rq[NIN, r] + rq[GEN, r] - cached
        rq[CONTEXT, r] = cached
    if rqf[START, r] < 0:
        rqf[START, r] = now
    running[i, ins[i, RUNN]] = r
    ins[i, RUNN] += 1
    ins[i, USED] += _blocks(rq[CONTEXT, r] + rq[TODO, r], bs)
    return load_s


@kernel_fn()
def _take_all(sl, pc, born, hk, hv, keys, rq, held, hoff, dec, cfg, i, n_dec, more, now, ev, matrix, life, life_of):
    """Instance._take_all: each decoding sequence's slots for `more` more tokens."""
    for j in range(n_dec):
        r = dec[i, j]
        if rq[CACHED_ON, r] == i:
            tokens = rq[CONTEXT, r] + more
            grow(sl, pc, born, hk, hv, keys, rq, held, hoff, i, r, tokens, cfg[BS], now, ev, matrix, life, life_of)


@kernel_fn()
def _fast_forward(pc, rq, dec, cfg, i, n_dec):
    """Instance._fast_forward: identical decode iterations run as one, up to the first request that finishes."""
    k = cfg[FAST_FORWARD]
    for j in range(n_dec):
        r = dec[i, j]
        k = min(k, rq[NOUT, r] - rq[GEN, r])
    if k <= 1:
        return 1
    bs, more = cfg[BS], 0
    for j in range(n_dec):
        c = rq[CONTEXT, dec[i, j]]
        more += (c + 1) // -bs - (c + k) // -bs
    return 1 if more > free_blocks(pc, i) else k


@kernel_fn()
def _collect_decoding(rq, ins, running, dec, cfg, i):
    """The running sequences past their prefill, in order, into dec[i]; returns (how many, blocks they need)."""
    n_dec, need = 0, 0
    for j in range(ins[i, RUNN]):
        r = running[i, j]
        if rq[TODO, r] == 0:
            dec[i, n_dec] = r
            n_dec += 1
            if rq[CONTEXT, r] % cfg[BS] == 0:
                need += 1
    return n_dec, need


@kernel_fn()
def _plan(S, rq, rqf, ins, insf, running, pieces_r, pieces_t, dec, lat, cfg, i, now):
    """Instance.plan: this iteration's prefill pieces and decodes (in pieces_*[i], dec[i]); returns (seconds,
    iterations). `S`: the pool's and the requests' arrays (see run_cluster)."""
    sl, pc, born, hk, hv, keys, held, hoff, scratch, ev, matrix, life, life_of = S
    bs = cfg[BS]
    insf[i, NOW] = now
    budget, extra = cfg[MAX_BATCHED], 0.0
    n_dec, need = _collect_decoding(rq, ins, running, dec, cfg, i)
    while ins[i, RUNN] > 0 and need > free_blocks(pc, i):  # decodes crossing into a new block need one
        extra += _preempt(sl, pc, rq, ins, insf, running, held, hoff, scratch, lat, cfg, i)
        n_dec, need = _collect_decoding(rq, ins, running, dec, cfg, i)
    ins[i, USED] += need
    _take_all(sl, pc, born, hk, hv, keys, rq, held, hoff, dec, cfg, i, n_dec, 1, now, ev, matrix, life, life_of)
    budget -= n_dec
    n_pieces = 0
    if budget > 0 and n_dec < ins[i, RUNN]:  # running prefills take their next chunk
        for j in range(ins[i, RUNN]):
            r = running[i, j]
            if rq[TODO, r] > 0:
                take = min(rq[TODO, r], budget)
                pieces_r[i, n_pieces], pieces_t[i, n_pieces] = r, take
                n_pieces += 1
                if rq[CACHED_ON, r] == i:
                    grow(sl, pc, born, hk, hv, keys, rq, held, hoff, i, r, rq[CONTEXT, r] + take, bs, now, ev, matrix,
                         life, life_of)  # fmt: skip
                budget -= take
                if budget <= 0:
                    break
    blocked = False
    while ins[i, WCOUNT] > 0 and budget > 0 and ins[i, RUNN] < cfg[MAX_SEQS]:
        r = ins[i, WHEAD]
        if not _fits(sl, pc, hk, hv, keys, rq, cfg, i, r):
            if ins[i, RUNN] > 0:
                blocked = True
                break  # wait for running sequences to free blocks
            _dequeue(rq, ins, i)
            rq[REJECTED, r] = 1  # larger than the whole pool: it could never run
            continue
        _dequeue(rq, ins, i)
        extra += _admit(sl, pc, hk, hv, keys, rq, rqf, ins, insf, running, held, hoff, lat, cfg, i, r, now)
        if rq[TODO, r] > 0:
            take = min(rq[TODO, r], budget)
            pieces_r[i, n_pieces], pieces_t[i, n_pieces] = r, take
            n_pieces += 1
        else:
            dec[i, n_dec] = r
            n_dec += 1
            take = 1
        if rq[CACHED_ON, r] == i:
            grow(sl, pc, born, hk, hv, keys, rq, held, hoff, i, r, rq[CONTEXT, r] + take, bs, now, ev, matrix, life,
                 life_of)  # fmt: skip
        budget -= take
    ins[i, NPIECES], ins[i, NDEC] = n_pieces, n_dec
    steps = 1
    if (
        n_dec
        and not n_pieces
        and extra == 0.0
        and (
            ins[i, WCOUNT] == 0
            or ins[i, RUNN] >= cfg[MAX_SEQS]
            or blocked
            or not _fits(sl, pc, hk, hv, keys, rq, cfg, i, ins[i, WHEAD])
        )
    ):
        steps = _fast_forward(pc, rq, dec, cfg, i, n_dec)
    if steps > 1:
        contexts = 0
        for j in range(n_dec):
            contexts += rq[CONTEXT, dec[i, j]]
        kv = contexts + n_dec * (steps - 1) / 2  # (decode_step_s of the window's middle, as engine.py)
        step = _cost(lat, n_dec, kv + n_dec, kv, n_dec, n_dec) * steps
        _take_all(sl, pc, born, hk, hv, keys, rq, held, hoff, dec, cfg, i, n_dec, steps, now, ev, matrix, life, life_of)
    else:
        step = _step_s(lat, rq, pieces_r, pieces_t, dec, i, n_pieces, n_dec)
    ins[i, STEPS] += steps
    return step + extra, steps


@kernel_fn()
def _sampled(rq, rqf, r, tokens, t, done, n_done):
    """Request r sampled `tokens` tokens by time t (Instance._token); a finished one joins `done`. Returns how
    many `done` holds."""
    rq[GEN, r] += tokens
    if rqf[FIRST, r] < 0:
        rqf[FIRST, r] = t
    if rq[GEN, r] >= rq[NOUT, r]:
        rqf[FINISH, r] = t
        done[n_done] = r
        n_done += 1
    return n_done


@kernel_fn()
def _finish_step(S, rq, rqf, ins, insf, running, pieces_r, pieces_t, dec, cfg, i, t, steps, done):
    """Instance.finish_step: apply the iteration (or `steps` identical decodes) that ended at t."""
    sl, pc, born, hk, hv, keys, held, hoff, scratch, ev, matrix, life, life_of = S
    bs = cfg[BS]
    insf[i, NOW] = t
    n_done = 0
    for j in range(ins[i, NPIECES]):
        r, take = pieces_r[i, j], pieces_t[i, j]
        rq[TODO, r] -= take
        rq[CONTEXT, r] += take
        if rq[TODO, r] == 0:  # the iteration that completes the prefill samples a token
            n_done = _sampled(rq, rqf, r, 1, t, done, n_done)
    n_dec = ins[i, NDEC]
    if steps > 1:  # the first step's block was taken when it was planned
        for j in range(n_dec):
            c = rq[CONTEXT, dec[i, j]]
            ins[i, USED] += (c + 1) // -bs - (c + steps) // -bs
    for j in range(n_dec):
        r = dec[i, j]
        rq[CONTEXT, r] += steps
        n_done = _sampled(rq, rqf, r, steps, t, done, n_done)
    for j in range(n_done):
        r = done[j]
        k = 0  # running.remove(r)
        while running[i, k] != r:
            k += 1
        for m in range(k, ins[i, RUNN] - 1):
            running[i, m] = running[i, m + 1]
        ins[i, RUNN] -= 1
        ins[i, USED] -= _blocks(rq[CONTEXT, r], bs)
        if rq[CACHED_ON, r] == i:
            end(sl, pc, rq, held, hoff, scratch, i, r)


@kernel_fn()
def _start(S, rq, rqf, ins, insf, running, pieces_r, pieces_t, dec, lat, cfg, i, t, seq):
    """Cluster.start: plan instance i's next iteration (or window of decodes), or leave it idle."""
    dt, n = _plan(S, rq, rqf, ins, insf, running, pieces_r, pieces_t, dec, lat, cfg, i, t)
    if ins[i, NPIECES] == 0 and ins[i, NDEC] == 0:
        ins[i, BUSY] = 0
        return seq
    ins[i, BUSY] = 1
    ins[i, WIN_TOKEN], ins[i, WIN_N] = seq, n
    insf[i, WIN_BEGUN], insf[i, WIN_PER], insf[i, WIN_END] = t, dt / n, t + dt
    return seq + 1


@kernel_fn()
def _cut(ins, insf, i, t, seq):
    """Cluster.cut: an arrival ends instance i's decode window after the iteration in progress."""
    begun, per, n = insf[i, WIN_BEGUN], insf[i, WIN_PER], ins[i, WIN_N]
    done = min(n, int((t - begun) / per) + 1) if per > 0 else n
    if done < n:
        ins[i, WIN_TOKEN], ins[i, WIN_N] = seq, done
        insf[i, WIN_END] = begun + done * per
        return seq + 1
    return seq


RUN_SIGNATURE = (
    "Tuple((f8[::1], i8[::1], f8[::1], i8[::1], i8[::1], i8[::1]))("
    "i4[:, :, ::1], i8[:, ::1], f8[:, ::1], i4[:, ::1], i4[:, ::1], i4[::1], i4[::1], i8[::1], i4[::1], i4[::1], "
    "i8[:, ::1], i8[:, ::1], f8[:, ::1], f8[::1], i8[::1], i8[::1], i8[:, ::1], f8[:, ::1], i8[:, ::1], i8[:, ::1], "
    "i8[:, ::1], i8[:, ::1], f8[::1], i8[::1], i8, f8)"
)


@kernel_fn(RUN_SIGNATURE)
def run_cluster(sl, pc, born, hk, hv, keys, held, hoff, scratch, ev, matrix, rq, rqf, due, order, fixed, ins, insf,
                running, pieces_r, pieces_t, dec, lat, cfg, capacity, sample_every):  # fmt: skip
    """Cluster.run: requests arrive at `due` (in `order`), each instance runs iteration after iteration. The
    first eleven arrays are compiled_pool.py's (evictions and the evictor x victim tenant matrix last).
    Returns the evicted blocks' lifetimes and instances, and the KV timeline's samples: times, each instance's
    used blocks, running and waiting sequences."""
    life, life_of = List.empty_list(types.float64), List.empty_list(types.int64)
    S = (sl, pc, born, hk, hv, keys, held, hoff, scratch, ev, matrix, life, life_of)
    init_pool(sl, pc, capacity)
    n, n_inst = due.size, ins.shape[0]
    for i in range(n_inst):
        ins[i, WHEAD], ins[i, WTAIL] = -1, -1
    done = running[0].copy()  # (scratch: at most every running sequence finishes in one step)
    sample_t, sample_used = List.empty_list(types.float64), List.empty_list(types.int64)
    sample_running, sample_waiting = List.empty_list(types.int64), List.empty_list(types.int64)
    router_state = [-1]
    seq, a, next_sample = 0, 0, 0.0
    while True:
        b = -1  # the instance whose iteration ends first (ties: the window made first)
        for i in range(n_inst):
            if ins[i, BUSY] and (
                b < 0 or insf[i, WIN_END] < insf[b, WIN_END]
                or (insf[i, WIN_END] == insf[b, WIN_END] and ins[i, WIN_TOKEN] < ins[b, WIN_TOKEN])
            ):  # fmt: skip
                b = i
        if a < n and (b < 0 or due[order[a]] <= insf[b, WIN_END]):  # an arrival (ties: arrivals first)
            r = order[a]
            a += 1
            t = due[r]
            i = _route(S[3], S[4], S[5], rq, ins, running, cfg, fixed, r, router_state)
            rq[INSTANCE, r] = i
            ins[i, ROUTED] += 1
            _enqueue(rq, ins, i, r, False)
            if not ins[i, BUSY]:
                seq = _start(S, rq, rqf, ins, insf, running, pieces_r, pieces_t, dec, lat, cfg, i, t, seq)
            elif ins[i, WIN_N] > 1:
                seq = _cut(ins, insf, i, t, seq)
        elif b >= 0:
            t = insf[b, WIN_END]
            _finish_step(S, rq, rqf, ins, insf, running, pieces_r, pieces_t, dec, cfg, b, t, ins[b, WIN_N], done)
            if t >= next_sample:
                sample_t.append(t)
                waiting, busy = 0, 0
                for i in range(n_inst):
                    sample_used.append(ins[i, USED])
                    busy += ins[i, RUNN]
                    waiting += ins[i, WCOUNT]
                sample_running.append(busy)
                sample_waiting.append(waiting)
                next_sample = t + sample_every
            seq = _start(S, rq, rqf, ins, insf, running, pieces_r, pieces_t, dec, lat, cfg, b, t, seq)
        else:
            break
    return (
        _to_array(life, np.empty(len(life))),
        _to_array(life_of, np.empty(len(life_of), np.int64)),
        _to_array(sample_t, np.empty(len(sample_t))),
        _to_array(sample_used, np.empty(len(sample_used), np.int64)),
        _to_array(sample_running, np.empty(len(sample_running), np.int64)),
        _to_array(sample_waiting, np.empty(len(sample_waiting), np.int64)),
    )


@kernel_fn()
def _to_array(values, out):
    """A typed list's values in `out` (numba has no np.array of a typed list)."""
    for j in range(len(values)):
        out[j] = values[j]
    return out
