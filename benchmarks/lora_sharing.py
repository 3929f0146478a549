"""Multi-LoRA KV: how much KV N adapters keep, and what they hit, when they share long prefixes, with the adapter
in the cache key (`--lora-kv isolated`, vLLM today) or the base KV shared and a per-adapter delta of 10 % of a
block charged to the same pool (`--lora-kv shared-base --lora-delta 0.1`), for N = 1, 10 and 100 adapters.

The trace (built here, seeded): 2,000 requests, Poisson arrivals at 4/s, each one an adapter drawn uniformly
from N, one of 4 shared documents of 4,096 tokens (256 blocks of 16 tokens), then a question of its own of
100 tokens (6 full blocks and a partial one), and 64 output tokens. Every (adapter, document) pair recurs, so
each adapter's document KV is reusable, and across adapters the document's base KV is the same.

Each trace is replayed with engine-sim (one H100, Llama-3-8B, policy vllm) at two pool sizes:

- `unbounded`: as many blocks as the trace has, so nothing is evicted: the KV each mode needs to keep all it
  computed (its footprint), read at the end of the run;
- `default`: what 90 % of an H100 leaves after the weights (26,674 blocks, 55.9 GB): the hit rate and TTFT the
  footprint buys.

    python benchmarks/lora_sharing.py [--requests 2000] [--seed 7]

Writes benchmarks/results/lora_sharing.json (notes there explain the numbers) and prints a table. Equivalent
command for one point: `kvbench replay TRACE --backend engine-sim --lora-kv shared-base --lora-delta 0.1
[--hbm-capacity BLOCKS]`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "lora_sharing.json"
BLOCK = 16  # tokens per block
DOCS, DOC_BLOCKS = 4, 256  # shared prefixes: 4 documents of 4,096 tokens
QUESTION_TOKENS, OUTPUT_TOKENS, RATE = 100, 64, 4.0  # per request; arrivals per second
ADAPTERS = (1, 10, 100)
DELTA = 0.1
PER_PAGE = 10  # deltas in one pool block at DELTA = 0.1
KV_BLOCK_BYTES = 131_072 * BLOCK  # llama3-8b bf16: 32 layers x 8 KV heads x 128 x 2 (K, V) x 2 bytes a token


def _id(*parts) -> int:
    """A stable 63-bit block id (Python's hash() of a string changes from run to run)."""
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little") >> 1


def build_trace(n_adapters: int, requests: int, seed: int) -> pa.Table:
    """Requests of `n_adapters` adapters over the shared documents (block ids prefix-chained, as keys are)."""
    rng = np.random.default_rng(seed)
    arrival = np.cumsum(rng.exponential(1 / RATE, requests))
    adapter = rng.integers(0, n_adapters, requests)
    doc = rng.integers(0, DOCS, requests)
    doc_ids = [[_id("doc", d, b) for b in range(DOC_BLOCKS)] for d in range(DOCS)]
    q_blocks = -(-QUESTION_TOKENS // BLOCK)
    hashes = []
    for i in range(requests):
        prefix = doc_ids[doc[i]]
        hashes.append(prefix + [_id("question", i, prefix[-1], b) for b in range(q_blocks)])
    return pa.table(
        {
            "request_id": [f"r{i}" for i in range(requests)],
            "arrival_s": arrival,
            "input_tokens": pa.array([DOC_BLOCKS * BLOCK + QUESTION_TOKENS] * requests, pa.int32()),
            "output_tokens": pa.array([OUTPUT_TOKENS] * requests, pa.int32()),
            "block_hashes": pa.array(hashes, pa.list_(pa.uint64())),
            "lora": [f"adapter-{a}" for a in adapter],
        }
    )


def run_point(path: Path, out: Path, mode: str, pool: str | None) -> dict:
    from kvbench.run.runner import run_replay

    opts = {"lora_kv": mode, "lora_delta": DELTA}
    if pool:
        opts["hbm_capacity"] = pool
    t0 = time.perf_counter()
    _, summary = run_replay(path, "engine-sim", opts, out=out, report=False)
    point = summary["points"][0]
    facts = point["engine"]["scenarios"]["multi-lora"]
    return {
        "mode": mode,
        "kv_gb": round(facts["kv_bytes_occupied"] / 1e9, 3),
        "pool_gb": round(facts["pool_bytes"] / 1e9, 3),
        "base_blocks": facts["cached_blocks"],
        "delta_blocks": facts["delta_blocks"],
        "token_hit_rate": round(point["hit_rate"]["token"]["all"], 4),
        "ttft_mean_ms": round(point["latency"]["ttft"]["mean_ms"], 2),
        "replay_s": round(time.perf_counter() - t0, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()
    from kvbench.trace.files import new_meta, write_trace

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in ADAPTERS:
            table = build_trace(n, args.requests, args.seed)
            path = write_trace(table, Path(tmp) / f"lora{n}.parquet", new_meta(BLOCK, {"generator": "lora_sharing"}))
            blocks = sum(len(h) for h in table.column("block_hashes").to_pylist())
            for pool_name, pool in (("unbounded", str(blocks)), ("default", None)):
                for mode in ("isolated", "shared-base"):
                    row = {"adapters": n, "pool": pool_name} | run_point(path, Path(tmp) / "run", mode, pool)
                    rows.append(row)
                    print(" ".join(f"{k}={v}" for k, v in row.items()), file=sys.stderr)
    footprint = {
        n: {r["mode"]: r["kv_gb"] for r in rows if r["adapters"] == n and r["pool"] == "unbounded"} for n in ADAPTERS
    }
    ratios = {str(n): round(f["isolated"] / f["shared-base"], 2) for n, f in footprint.items()}
    q_full = QUESTION_TOKENS // BLOCK
    # the documents' share of the unbounded footprint: every question block is a key of its own request (in both
    # modes), and in shared-base each request also has the pages of the groups its question reaches into
    full = DOC_BLOCKS + q_full
    own_pages = -(-full // PER_PAGE) - DOC_BLOCKS // PER_PAGE
    for r in rows:
        if r["pool"] == "unbounded":
            blocks = r["base_blocks"] - args.requests * q_full + r["delta_blocks"]
            blocks -= args.requests * own_pages if r["mode"] == "shared-base" else 0
            r["document_kv_gb"] = round(blocks * KV_BLOCK_BYTES / 1e9, 3)
    docs = {
        n: {r["mode"]: r["document_kv_gb"] for r in rows if r["adapters"] == n and "document_kv_gb" in r}
        for n in ADAPTERS
    }
    doc_ratios = {str(n): round(f["isolated"] / f["shared-base"], 2) for n, f in docs.items()}
    result = {
        "command": "python benchmarks/lora_sharing.py " + " ".join(sys.argv[1:]),
        "machine": {"python": platform.python_version(), "platform": platform.platform()},
        "trace": {
            "requests": args.requests,
            "seed": args.seed,
            "arrivals_per_s": RATE,
            "documents": DOCS,
            "document_tokens": DOC_BLOCKS * BLOCK,
            "question_tokens": QUESTION_TOKENS,
            "output_tokens": OUTPUT_TOKENS,
            "block_size": BLOCK,
        },
        "engine": "engine-sim, 1 instance, h100, llama3-8b bf16 (2 MiB a block), policy vllm, lora_delta 0.1",
        "results": rows,
        "isolated_over_shared_kv_unbounded": ratios,
        "isolated_over_shared_document_kv_unbounded": doc_ratios,
        "notes": [
            "Footprint (unbounded pool, KV held at the end of the run): shared-base keeps "
            f"{ratios['100']}x less KV than isolated at 100 adapters, {ratios['10']}x at 10, and "
            f"{ratios['1']}x at 1 (more: one adapter shares nothing and pays for its deltas).",
            "On the documents alone (document_kv_gb: the footprint less every request's own question blocks and, "
            f"in shared-base, the pages its question reaches into) the saving is {doc_ratios['100']}x at 100 "
            f"adapters and {doc_ratios['10']}x at 10. A document of B = 256 blocks used by N adapters costs "
            "isolated N*B blocks and shared-base B + N*floor(B/10) pages, about B*(1 + N*d): 25,600 vs 2,756 at "
            "N = 100, d = 0.1 (9.3x), 2,560 vs 506 at N = 10 (5.1x), 256 vs 281 at N = 1 (0.91x). It tends to "
            "1/d = 10x as N grows and never reaches it, because the deltas grow with N.",
            "Why the total is well below that: the KV that is not shared. Each request's question "
            f"({q_full} full blocks) is kept by both modes, and shared-base adds {own_pages} delta pages per "
            "request (the page of the group that straddles the document's end and the question, and the "
            "question's last one): a page is keyed by the last block it covers, so it is the request's own and "
            "takes a whole pool block for the 2-10 deltas it holds. With 2,000 requests the questions are 12,000 "
            "blocks, about as much as the shared documents' base KV and pages together.",
            "Hit rate: a block hits for an adapter only when its base block and the page holding that adapter's "
            "delta are both cached (the delta cannot be had without running the adapter): with room for "
            "everything both modes hit exactly alike. In the default 55.9 GB pool isolated cannot keep 100 "
            "adapters x 4 documents (about 214 GB of document KV) and its hit rate falls, while shared-base "
            "still holds every document and its pages (both fill the pool; shared-base evicts old questions): "
            "the saving shows as hits and TTFT, not as fewer GB.",
            "kv_gb never exceeds pool_gb: delta pages take pool blocks and the policy evicts them like any block "
            "(before issue 13 the delta bytes were added on top of a full pool: 61.7 GB in a 55.9 GB pool).",
        ],
    }
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
