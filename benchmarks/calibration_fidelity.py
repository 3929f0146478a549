"""Calibration fidelity: does the engine simulator, calibrated against the local vLLM CPU engine with `kvbench
calibrate`, model the mean TTFT and TPOT that the same engine shows on the same requests? Target: modeled /
measured within 0.75–1.25 for both.

Steps (each a kvbench command, as a user would type it):

1. the engine: reuse a running `vllm-cpu` (`kvbench engine status`) or start one (`kvbench engine up vllm-cpu`),
   and stop it at the end only if this script started it;
2. `kvbench calibrate --url URL -o calib.toml`;
3. the requests: the first `--requests` (100) rows of traces/samples/chat.parquet whose prompt and capped output fit
   the engine's context (8,192 tokens), output capped at `--max-output-tokens` (16) in the trace itself so that both
   sides decode the same tokens;
4. measured: `kvbench replay SUBSET --backend openai --url URL --max-output-tokens 16 --reset-prefix-cache` in
   trace mode: open loop on the trace's own arrival times. The first 100 chat requests arrive at 1.6 req/s over 64 s,
   which keeps the engine busy about half the time: requests overlap now and then (queueing and prefills that stall
   other requests' decodes are part of what is compared), yet the engine is not saturated, where a small error in
   the step time would grow without bound in the queue. The prefix cache is reset first, so hits come from the
   trace alone;
5. modeled: `kvbench replay SUBSET@32 --backend engine-sim --hardware cpu --model kvbench-tiny --calibration
   calib.toml` with the engine's scheduler limits (vLLM's CPU defaults for its API server: --max-num-seqs 128,
   --max-num-batched-tokens 2048, unless the engine was started with others) and its KV pool (--hbm-capacity = the
   engine's KV blocks). The trace is re-cut to the engine's 32-token blocks (`kvbench trace rebase`), the block
   size engine-sim then uses for its pool and prefix hits, so that modeled hits are the engine's (the hit rates
   of both sides are printed);
6. for context, the same replay through the uncalibrated roofline (`--hardware cpu` datasheet numbers), and a
   what-if of the Calibration terms `kvbench calibrate` proposes but the simulator lacks (a per-request overhead,
   attention per (query, key) pair, a per-sequence decode cost, a step that sums its parts): the simulator run
   in-process with those terms, roofline.py untouched.

Prints the ratios and writes benchmarks/results/calibration_fidelity.json. `--rounds N` repeats steps 2–6 (the
machine is shared: load moves both sides) and reports each round and the median.

    python benchmarks/calibration_fidelity.py [--requests 100] [--max-output-tokens 16] [--rounds 1] [--keep DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

import numpy as np
import pyarrow as pa

REPO = Path(__file__).resolve().parents[1]
TRACE = REPO / "traces" / "samples" / "chat.parquet"
RESULTS = REPO / "benchmarks" / "results" / "calibration_fidelity.json"
ENGINE = "vllm-cpu"
# vLLM's defaults for the OpenAI API server on CPU (vllm/engine/arg_utils.py, current_platform.is_cpu())
CPU_MAX_NUM_SEQS, CPU_MAX_NUM_BATCHED_TOKENS = 128, 2048
TARGET = (0.75, 1.25)


def kvbench(*args: str, capture: bool = True) -> str:
    cmd = ["kvbench", *map(str, args)]
    print("$", shlex.join(cmd), flush=True)
    proc = subprocess.run(cmd, capture_output=capture, text=True)
    if proc.returncode:
        sys.exit(f"failed ({proc.returncode}): {shlex.join(cmd)}\n{proc.stderr or ''}")
    return proc.stdout if capture else ""


def ensure_engine():
    from kvbench import engines

    info = engines.running(ENGINE)
    if info is not None:
        print(f"reusing {ENGINE} at {info.url} (pid {info.pid})")
        return info, False
    kvbench("engine", "up", ENGINE, capture=False)
    info = engines.running(ENGINE)
    if info is None:
        sys.exit(f"{ENGINE} did not come up; see `kvbench engine status`")
    return info, True


def engine_limits(info) -> dict:
    """The engine's scheduler limits: from its command line where given, else vLLM's CPU defaults."""
    args = list(info.args)

    def flag(name, default):
        for i, a in enumerate(args):
            if a == name and i + 1 < len(args):
                return int(args[i + 1])
            if a.startswith(name + "="):
                return int(a.split("=", 1)[1])
        return default

    return {
        "max_num_seqs": flag("--max-num-seqs", CPU_MAX_NUM_SEQS),
        "max_num_batched_tokens": flag("--max-num-batched-tokens", CPU_MAX_NUM_BATCHED_TOKENS),
        "max_model_len": flag("--max-model-len", 8192),
        "num_gpu_blocks_override": flag("--num-gpu-blocks-override", 0),
    }


def subset(path: Path, n: int, max_out: int, max_len: int, out: Path) -> Path:
    """The first n requests whose prompt + capped output fit max_len, output capped; references to rows left
    out are dropped so that the subset validates."""
    from kvbench.traceio import new_meta, write_trace
    from kvbench.validate import read_valid_trace

    table, meta = read_valid_trace(path)
    inp = table.column("input_tokens").to_numpy()
    outp = np.minimum(table.column("output_tokens").to_numpy(), max_out)
    rows = np.nonzero(inp + outp <= max_len)[0][:n]
    sub = table.take(pa.array(rows))
    col = sub.schema.get_field_index("output_tokens")
    sub = sub.set_column(col, "output_tokens", pa.array(outp[rows], sub.schema.field("output_tokens").type))
    kept = set(sub.column("request_id").to_pylist())
    if "parent_id" in sub.column_names:
        parents = [p if p in kept else None for p in sub.column("parent_id").to_pylist()]
        i = sub.schema.get_field_index("parent_id")
        sub = sub.set_column(i, "parent_id", pa.array(parents, sub.schema.field("parent_id").type))
    if "depends_on" in sub.column_names:
        deps = [[d for d in (ds or []) if d in kept] for ds in sub.column("depends_on").to_pylist()]
        i = sub.schema.get_field_index("depends_on")
        sub = sub.set_column(i, "depends_on", pa.array(deps, sub.schema.field("depends_on").type))
    source = {**meta.source, "subset_of": path.name, "first_rows_fitting": max_len, "output_capped_at": max_out}
    write_trace(sub, out, new_meta(meta.block_size, source))
    return out


def means(summary: dict) -> dict:
    lat = summary["latency"]
    return {
        "ttft_mean_ms": lat["ttft"]["mean_ms"],
        "tpot_mean_ms": lat["tpot"]["mean_ms"],
        "ttft_p50_ms": lat["ttft"]["p50_ms"],
        "tpot_p50_ms": lat["tpot"]["p50_ms"],
        "requests_ok": lat["requests"]["ok"],
        "token_hit_rate": summary["hit_rate"]["token"]["all"],
    }


def ratios(modeled: dict, measured: dict) -> dict:
    return {k: modeled[f"{k}_mean_ms"] / measured[f"{k}_mean_ms"] for k in ("ttft", "tpot")}


def what_if(trace_path: Path, calib: dict, sim_opts: dict) -> dict:
    """The simulator with the terms `kvbench calibrate` proposes (its [measurements.proposed]), in-process:
    step = base + per-token × prefill tokens + per-pair × attention pairs + per-sequence × decodes + per-KV × decode
    KV tokens (summed: nothing overlaps on a CPU), and every TTFT plus the per-request overhead (paid outside the
    engine's loop, it delays each request alike and so leaves the schedule as it is)."""
    from kvbench.backends.enginesim import EngineSimBackend
    from kvbench.backends.enginesim.roofline import LatencyModel, StepCost

    from kvbench.latency import distribution
    from kvbench.validate import read_valid_trace

    proposed = calib["measurements"]["proposed"]
    decode = calib["measurements"]["fits"]["decode_with_per_seq"]

    @dataclasses.dataclass(frozen=True)
    class Proposed(LatencyModel):
        def step_cost(self, prefills, decode_contexts):
            tokens = sum(n for n, _ in prefills)
            pairs = sum(n * c + n * (n + 1) / 2 for n, c in prefills)
            n, kv = len(decode_contexts), float(sum(decode_contexts))
            if tokens == 0 and n == 0:
                return StepCost(0.0, 0.0, 0.0)
            s = (
                decode["base_s"]
                + proposed["prefill_s_per_token"] * tokens
                + proposed["prefill_s_per_pair"] * pairs
                + proposed["decode_s_per_seq"] * n
                + decode["s_per_kv_token"] * kv
            )
            return StepCost(s, 0.0, 0.0)

    backend = EngineSimBackend(**sim_opts)
    lat = backend.latency
    backend.latency = Proposed(lat.model, lat.hw, kv_dtype=lat.kv_dtype)
    table, meta = read_valid_trace(trace_path)
    point = next(backend.replay(table, meta))
    ttft = point.columns["ttft_s"] + proposed["request_overhead_s"]
    return {
        "ttft_mean_ms": distribution(ttft)["mean_ms"],
        "tpot_mean_ms": distribution(point.columns["tpot_s"])["mean_ms"],
        "terms": {**proposed, "decode_base_s": decode["base_s"], "decode_s_per_kv_token": decode["s_per_kv_token"]},
    }


def one_round(k: int, info, work: Path, sub: Path, sub_sim: Path, limits: dict, args) -> dict:
    print(f"\n=== round {k + 1}: calibrate, replay live, replay modeled ===", flush=True)
    calib_path = work / f"calib-{k}.toml"
    load = {"before": os.getloadavg()[0]}
    t0 = time.time()
    kvbench("calibrate", "--url", info.url, "-o", calib_path, "--repeats", args.repeats)
    calib_s = time.time() - t0
    calib = tomllib.loads(calib_path.read_text())
    server = calib["measurements"].get("server", {})
    pool = server.get("num_gpu_blocks") or limits["num_gpu_blocks_override"]
    live_dir = work / f"live-{k}"
    if live_dir.exists():
        shutil.rmtree(live_dir)
    live = json.loads(
        kvbench(
            "replay", sub, "--backend", "openai", "--url", info.url, "--max-output-tokens", args.max_output_tokens,
            "--mode", "trace", "--reset-prefix-cache", "--out", live_dir, "--no-report", "--json",
        )
    )  # fmt: skip
    load["after"] = os.getloadavg()[0]
    sim_opts = {
        "hardware": "cpu",
        "model": "kvbench-tiny",
        "max_num_seqs": limits["max_num_seqs"],
        "max_num_batched_tokens": limits["max_num_batched_tokens"],
        "hbm_capacity": str(pool) if pool else None,
    }
    flags = ["--hardware", "cpu", "--model", "kvbench-tiny", "--max-num-seqs", limits["max_num_seqs"]]
    flags += ["--max-num-batched-tokens", limits["max_num_batched_tokens"]]
    flags += ["--hbm-capacity", pool] if pool else []
    runs = {}
    for name, extra in (("calibrated", ["--calibration", calib_path]), ("roofline", [])):
        out = work / f"sim-{name}-{k}"
        if out.exists():
            shutil.rmtree(out)
        runs[name] = json.loads(
            kvbench("replay", sub_sim, "--backend", "engine-sim", *flags, *extra, "--out", out, "--no-report", "--json")
        )
    measured = means(live)
    modeled = {name: means(s) for name, s in runs.items()}
    proposal = what_if(sub_sim, calib, {**sim_opts, "calibration": str(calib_path)})
    row = {
        "calibration": calib["calibration"],
        "calibration_fits": calib["measurements"]["fits"],
        "proposed_terms": calib["measurements"].get("proposed"),
        "calibrate_s": round(calib_s, 1),
        "load_avg_1min": load,
        "measured": measured,
        "modeled": modeled,
        "ratio": ratios(modeled["calibrated"], measured),
        "ratio_uncalibrated_roofline": ratios(modeled["roofline"], measured),
        "what_if_proposed_terms": {
            "ttft_mean_ms": proposal["ttft_mean_ms"],
            "tpot_mean_ms": proposal["tpot_mean_ms"],
            "ratio": ratios(proposal, measured),
        },
    }
    r = row["ratio"]
    print(
        f"round {k + 1}: measured TTFT {measured['ttft_mean_ms']:.1f} ms, TPOT {measured['tpot_mean_ms']:.2f} ms; "
        f"modeled {modeled['calibrated']['ttft_mean_ms']:.1f} / {modeled['calibrated']['tpot_mean_ms']:.2f} ms; "
        f"ratio TTFT {r['ttft']:.3f}, TPOT {r['tpot']:.3f}"
    )
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, default=TRACE, help="trace to take the requests from")
    ap.add_argument("--requests", type=int, default=100, help="first N requests that fit the engine's context")
    ap.add_argument("--max-output-tokens", type=int, default=16, help="output tokens per request at most")
    ap.add_argument("--rounds", type=int, default=1, help="calibrate + replay rounds (the median is reported)")
    ap.add_argument("--repeats", type=int, default=3, help="kvbench calibrate --repeats")
    ap.add_argument("--keep", type=Path, help="keep the work files (traces, calibration, run directories) here")
    ap.add_argument("--out", type=Path, default=RESULTS, help="results JSON")
    args = ap.parse_args()

    work = args.keep or Path(tempfile.mkdtemp(prefix="kvb-calfid-"))
    work.mkdir(parents=True, exist_ok=True)
    info, started = ensure_engine()
    try:
        limits = engine_limits(info)
        sub = subset(
            args.trace, args.requests, args.max_output_tokens, limits["max_model_len"], work / "chat-subset.parquet"
        )
        from kvbench.traceio import read_meta

        sub_sim = sub
        if info.block_size and read_meta(sub).block_size != info.block_size:
            sub_sim = work / f"chat-subset-bs{info.block_size}.parquet"
            kvbench("trace", "rebase", sub, "--block-size", info.block_size, "-o", sub_sim)
        rounds = [one_round(k, info, work, sub, sub_sim, limits, args) for k in range(args.rounds)]
    finally:
        if started:
            kvbench("engine", "down", ENGINE, capture=False)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)

    med = {k: statistics.median(r["ratio"][k] for r in rounds) for k in ("ttft", "tpot")}
    med_prop = {k: statistics.median(r["what_if_proposed_terms"]["ratio"][k] for r in rounds) for k in ("ttft", "tpot")}
    med_roof = {k: statistics.median(r["ratio_uncalibrated_roofline"][k] for r in rounds) for k in ("ttft", "tpot")}
    ok = all(TARGET[0] <= v <= TARGET[1] for v in med.values())
    print("\nmodeled / measured mean latency (median over rounds)")
    print(f"{'':38} {'TTFT':>7} {'TPOT':>7}")
    print(f"{'engine-sim --calibration (target)':38} {med['ttft']:7.3f} {med['tpot']:7.3f}")
    print(f"{'engine-sim, uncalibrated roofline':38} {med_roof['ttft']:7.3f} {med_roof['tpot']:7.3f}")
    print(f"{'what-if: proposed Calibration terms':38} {med_prop['ttft']:7.3f} {med_prop['tpot']:7.3f}")
    print(f"target {TARGET[0]}–{TARGET[1]}: {'met' if ok else 'NOT met'}")
    result = {
        "benchmark": "calibration_fidelity",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "config": {
            "trace": str(args.trace.relative_to(REPO) if args.trace.is_relative_to(REPO) else args.trace.name),
            "requests": args.requests,
            "max_output_tokens": args.max_output_tokens,
            "mode": "trace (open loop on the trace's arrival times)",
            "rounds": args.rounds,
            "calibrate_repeats": args.repeats,
            "engine": {"name": ENGINE, "block_size": info.block_size, "settings": info.settings, **limits},
            "engine_started_here": started,
            "cpus": os.cpu_count(),
        },
        "target": list(TARGET),
        "ratio_median": med,
        "ratio_uncalibrated_roofline_median": med_roof,
        "ratio_what_if_proposed_terms_median": med_prop,
        "target_met": ok,
        "rounds": rounds,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
