"""An engine-sim run's per-request columns and summary facts: modeled latencies, hits per tier, queueing,
preemptions, tier traffic, local vs global hits and the KV occupancy timeline."""

from __future__ import annotations

import numpy as np

from kvbench.run.backend import PointResult


def point_result(
    pol, reqs, instances, prep, trace, timeline, kv_bytes_block, pool, latency_summary, evictions=None
) -> PointResult:
    """`evictions`: (per request, evictor × victim tenant matrix) when the compiled loop counted them; else
    each instance's pool has them."""
    n, bs = len(reqs), prep.block_size
    for inst in instances:
        if hasattr(inst.cache, "flush_evictions"):  # (QuickPool counts its evictions at the end)
            inst.cache.flush_evictions()
    ok = np.array([r.finish >= 0 for r in reqs])
    arrival = np.array([r.arrival for r in reqs])
    first = np.array([r.first_token if r.first_token >= 0 else np.nan for r in reqs])
    finish = np.array([r.finish if r.finish >= 0 else np.nan for r in reqs])
    start = np.array([r.start if r.start >= 0 else np.nan for r in reqs])
    n_out = np.array([r.n_out for r in reqs], dtype=np.int64)
    ttft, e2el = first - arrival, finish - arrival
    tpot = np.where(n_out > 1, (finish - first) / np.maximum(n_out - 1, 1), np.nan)
    tiers = ("hbm", "dram", "ssd", "global")
    hits = {t: np.array([(r.hit or {}).get(t, 0) for r in reqs], dtype=np.int64) for t in (*tiers, "reused")}
    hit_blocks = sum(hits.values())
    inp = prep.input_tokens.astype(np.int64)

    def tokens(blocks):
        return np.minimum(blocks * bs, inp)

    if evictions is None:
        evictions = (sum(i.cache.out.evictions for i in instances), sum(i.cache.out.evict_matrix for i in instances))
    evictions, matrix = evictions
    columns = {
        "hit_blocks": hit_blocks,
        "hit_tokens": tokens(hit_blocks),
        "hit_tokens_hbm": tokens(hits["hbm"]),
        "hit_tokens_dram": tokens(hits["dram"]),
        "hit_tokens_ssd": tokens(hits["ssd"]),
        "hit_tokens_global": tokens(hits["global"]),
        "evictions": evictions,
        "scheduled_send_s": np.array([r.scheduled if r.scheduled >= 0 else r.arrival for r in reqs]),
        "actual_send_s": arrival,
        "ttft_s": ttft,
        "tpot_s": tpot,
        "e2el_s": e2el,
        "queue_s": start - arrival,
        "warmup": np.zeros(n, dtype=bool),
        "status": np.where(ok, "ok", "error"),
        "error": np.array([None if r.finish >= 0 else r.rejected_for or "rejected" for r in reqs], dtype=object),
    }
    tenants = prep.tenant_names
    latency = latency_summary(ttft, tpot, e2el, n_out, [tenants[t] for t in prep.tenant], send=arrival, ok=ok)
    queue = columns["queue_s"][ok]
    stats = [inst.stats for inst in instances]
    load_bytes: dict[str, int] = {}
    for st in stats:
        for k, v in st["load_bytes"].items():
            load_bytes[k] = load_bytes.get(k, 0) + v
    lower = {t.name: t for inst in instances for t in inst.tiers.lower}
    local = int(hits["hbm"].sum() + hits["dram"].sum() + hits["ssd"].sum())
    engine = {
        "instances": len(instances),
        "pool_blocks_per_instance": instances[0].pool,
        "preemptions": int(sum(st["preemptions"] for st in stats)),
        "recomputed_tokens": int(sum(st["recomputed_tokens"] for st in stats)),
        "swap_bytes": int(sum(st["swap_bytes"] for st in stats)),
        "iterations": int(sum(st["steps"] for st in stats)),
        "rejected": int((~ok).sum()),
        "queue_s": {
            "mean": float(queue.mean()) if queue.size else None,
            "p99": float(np.percentile(queue, 99)) if queue.size else None,
        },
        "tier_bytes": {
            "loaded": load_bytes,
            "written": {name: t.written * kv_bytes_block for name, t in lower.items()},
        },
        "hit_blocks": {"local": local, "global": int(hits["global"].sum())},
        # the shared store's own traffic and occupancy (one object for every instance): None without --global-pool
        "global_store": pool.summary(kv_bytes_block) if pool is not None else None,
        "requests_per_instance": _per_instance(reqs, instances),
        "kv_lifetime_s": _lifetimes(instances),
    }
    extra = {
        "latency": latency,
        "engine": engine,
        "kv_timeline": timeline,
        "evict_matrix": matrix,
        "tenant_names": tenants,
    }
    labels = {"policy": pol.name, "instances": len(instances)}
    return PointResult(labels=labels, columns=columns, extra=extra)


def _lifetimes(instances) -> dict:
    """Seconds blocks stayed in HBM: evicted ones, and the ones still cached at the end (censored there)."""
    end = max(i.now for i in instances)
    evicted = np.concatenate([np.asarray(i.lifetimes, dtype=np.float64) for i in instances])
    alive = np.concatenate([end - np.fromiter(i.born.values(), np.float64, len(i.born)) for i in instances])
    out = {"evicted": int(evicted.size), "still_cached": int(alive.size)}
    for name, x in (("evicted_s", evicted), ("all_s", np.concatenate([evicted, alive]))):
        if x.size:
            out[name] = {f"p{q}": float(np.percentile(x, q)) for q in (10, 50, 90, 99)}
    return out


def _per_instance(reqs, instances) -> list[int]:
    return np.bincount([r.instance for r in reqs if r.instance >= 0], minlength=len(instances)).tolist()
