"""kvbench's simulator against what users would use instead, in one run on this machine
(docs/semantics.md, Reference figures).

Usage (from the repository root):

    python benchmarks/peers.py [TRACE.jsonl] [--parquet PARQUET] [--rounds N] [--out JSON]

    TRACE.jsonl  the Mooncake conversation trace as JSONL, for kvcache-simulator and libCacheSim
                 (default: ../shared/traces/mooncake/conversation_trace.jsonl)
    --parquet    the same trace as kvbench parquet (default: traces/mooncake/conversation_trace.parquet)
    --rounds     interleaved rounds of the whole-process commands; medians are reported (default 5)
    --out        where the results go (default: benchmarks/results/peers.json)

Whole processes (start-up, trace reading, simulation, output), each command once per round, the commands in
the same order every round so that machine noise falls on all of them alike; medians of the rounds:

(a) 8 capacities. `kvcache-simulator run` (kvcache.ai, C++ core; pip-installed here if missing) with its
    policy "lru", a leaf-first LRU on the prefix trie (kvbench's `radix-lru`). Its budgets are GiB of a
    model: with llama-3.1-8b (bf16, 128 KiB of KV per token) a 512-token block is 64 MiB, so a budget of C/16
    GiB is exactly C blocks; the block counts it reports are checked and recorded. Against it `kvbench replay
    ... --policy radix-lru --capacity <the same blocks> --no-bound --no-report --json` (the same work), and
    the same with kvbench's default Belady bound, whose cost is the difference. Steady-state hit rates are
    compared point by point.
(b) 1 capacity (IN_PROCESS_CAPACITY blocks), block LRU. libCacheSim's Python binding (`libcachesim`, C core;
    pip-installed here if missing) replaying the trace's block ids from its own binary oracleGeneral file
    (the fastest input it reads, written beforehand, untimed), against `kvbench replay --policy lru
    --capacity N --no-bound --no-report --json`. Their cache contents are the same (every block of a request
    touched in order); libCacheSim counts a hit per block reference, kvbench the leading run of a prompt's
    blocks (what prefill skips), so kvbench's block hit rate is at most libCacheSim's.

Each kvbench command runs twice per round: cold, its trace cache (docs/architecture.md, Trace cache) emptied
before every run, so that it reads, validates and prepares the trace and stores what it computed (what a
first run of a trace costs); and warm, loading what the untimed first run stored (every later run of the
same trace file).

Untimed first: one run of each command (kvcache-simulator builds its C++ core, kvbench builds its compiled
kernels and byte-compiles its modules, as a wheel install does), so no compilation is timed.

(c) In process, one capacity (IN_PROCESS_CAPACITY blocks): a pure-Python OrderedDict block LRU (the usual
    quick script) against kvbench's kernels, as block references per second (medians of many runs);
    "prepare included" counts isolation folding and id densification, "load included" the same prepared
    trace loaded from the trace cache instead (finding the file's entry, mapping its arrays).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_JSONL = REPO.parent / "shared/traces/mooncake/conversation_trace.jsonl"
DEFAULT_PARQUET = REPO / "traces/mooncake/conversation_trace.parquet"
DEFAULT_OUT = REPO / "benchmarks/results/peers.json"
CAPACITIES = [1000, 3000, 5859, 10000, 19531, 30000, 50000, 100000]  # blocks of 512 tokens
PEER_MODEL = "llama-3.1-8b"
BLOCKS_PER_GIB = 16  # llama-3.1-8b, bf16: 131072 B/token x 512 tokens = 64 MiB per block
BLOCK_SIZE = 512
IN_PROCESS_CAPACITY = 10_000
LIBCACHESIM_RUN = (
    "import sys, libcachesim as lcs; "
    "reader = lcs.TraceReader(sys.argv[1], lcs.TraceType.ORACLE_GENERAL_TRACE); "
    "miss, _ = lcs.LRU(cache_size=int(sys.argv[2])).process_trace(reader); print(1 - miss)"
)


def _tail(text: str, lines: int = 8) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def _runs(probe: list[str]) -> bool:
    try:
        return subprocess.run(probe, capture_output=True).returncode == 0
    except OSError:  # not installed (no such executable)
        return False


def _ensure(dist: str, probe: list[str]) -> bool:
    """Whether `probe` runs, after pip-installing `dist` if it did not."""
    if _runs(probe):
        return True
    print(f"{dist} not found: pip install {dist} ...", file=sys.stderr)
    r = subprocess.run([sys.executable, "-m", "pip", "install", dist], capture_output=True, text=True)
    if r.returncode != 0:
        print(f"  pip failed:\n{_tail(r.stderr)}", file=sys.stderr)
    return _runs(probe)


@dataclass
class Command:
    """A whole-process command of the comparison: what runs, how its output is read, and for kvbench's the
    trace cache folder it runs with and whether that is emptied before each run (cold)."""

    argv: list[str]
    read: object
    cache_dir: Path | None = None
    cold: bool = False

    def empty(self) -> None:
        """A cold command's cache emptied (untimed, before its run)."""
        if self.cold:
            shutil.rmtree(self.cache_dir, ignore_errors=True)

    def run(self) -> subprocess.CompletedProcess:
        env = None if self.cache_dir is None else {**os.environ, "KVBENCH_CACHE_DIR": str(self.cache_dir)}
        return subprocess.run(self.argv, capture_output=True, text=True, cwd=REPO, env=env)


def kvcache_simulator_cmd(jsonl: Path, tmp: Path) -> list[str] | None:
    exe = shutil.which("kvcache-simulator") or str(Path(sys.executable).parent / "kvcache-simulator")
    if not _ensure("kvcache-simulator", [exe, "--help"]):
        return None
    budgets = ",".join(repr(c / BLOCKS_PER_GIB) for c in CAPACITIES)
    return [exe, "run", "--trace", str(jsonl), "--model", PEER_MODEL, "--block-size", str(BLOCK_SIZE),
            "--budgets-gib", budgets, "--policies", "lru", "--format", "json", "--no-progress",
            "-o", str(tmp / "kvcache-simulator.json")]  # fmt: skip


def read_kvcache_simulator(cmd: list[str], proc) -> dict:
    data = json.loads(Path(cmd[-1]).read_text())
    points = {int(p["cacheBlocks"]): p["results"]["lru"]["hitRate"] for p in data["points"]}
    return {
        "version": _pip_version("kvcache-simulator"),
        "bytes_per_block": data["metadata"]["bytesPerBlock"],
        "capacity_blocks_used": sorted(points),
        "capacities_match": sorted(points) == CAPACITIES,
        "token_steady": {str(c): points[c] for c in sorted(points)},
    }


def kvbench_cmd(parquet: Path, tmp: Path, policy: str, capacities: list[int], bound: bool, state: str) -> list[str]:
    exe = shutil.which("kvbench") or "kvbench"
    name = f"kvbench-{policy}-{len(capacities)}-{'bound' if bound else 'nobound'}-{state}"
    return [
        exe,
        "replay",
        str(parquet),
        "--backend",
        "sim",
        "--policy",
        policy,
        "--capacity",
        ",".join(map(str, capacities)),
        "--bound" if bound else "--no-bound",
        "--no-report",
        "--json",
        "--overwrite",
        "--out",
        str(tmp / name),
    ]  # fmt: skip  (--overwrite: each round replaces the last)


def kvbench_commands(label: str, parquet: Path, tmp: Path, policy: str, capacities, bound: bool) -> dict:
    """The kvbench command `label`, cold (its own cache folder, emptied before each run) and warm (a folder
    the untimed first run fills, shared by the warm commands)."""
    out = {}
    for state in ("cold", "warm"):
        argv = kvbench_cmd(parquet, tmp, policy, capacities, bound, state)
        folder = tmp / (f"cache-cold-{len(out)}-{policy}" if state == "cold" else "cache-warm")
        out[f"kvbench {label}, {state} trace cache"] = Command(argv, read_kvbench, folder, cold=state == "cold")
    return out


def read_kvbench(cmd: list[str], proc) -> dict:
    summary = json.loads(proc.stdout)
    policy = cmd[cmd.index("--policy") + 1]
    points = [p for p in summary["points"] if p.get("policy") == policy]
    return {
        "token_steady": {str(p["capacity_blocks"]): p["hit_rate"]["token"]["steady"] for p in points},
        "block_all": {str(p["capacity_blocks"]): p["hit_rate"]["block"]["all"] for p in points},
        "bound_points": sum(p.get("policy") == "belady" for p in summary["points"]),
    }


def libcachesim_cmd(jsonl: Path, tmp: Path) -> list[str] | None:
    """libCacheSim's binding on the trace's block ids, in its oracleGeneral binary format (24 bytes a
    reference: time, id, size 1, next access unknown), written here, untimed."""
    if not _ensure("libcachesim", [sys.executable, "-c", "import libcachesim"]):
        return None
    import numpy as np

    ids: list[int] = []
    with open(jsonl) as f:
        for line in f:
            ids.extend(json.loads(line)["hash_ids"])
    rec = np.zeros(len(ids), dtype=np.dtype([("t", "<u4"), ("id", "<u8"), ("size", "<u4"), ("next", "<i8")]))
    rec["id"], rec["size"], rec["next"] = np.asarray(ids, np.uint64) + 1, 1, -1
    path = tmp / "mooncake.oracleGeneral.bin"
    rec.tofile(path)
    return [sys.executable, "-c", LIBCACHESIM_RUN, str(path), str(IN_PROCESS_CAPACITY)]


def read_libcachesim(cmd: list[str], proc) -> dict:
    return {"version": _pip_version("libcachesim"), "block_hit_ratio": float(proc.stdout.split()[-1])}


def interleaved(commands: dict[str, Command], rounds: int) -> dict[str, dict]:
    """Each command once untimed, then `rounds` rounds of every command in turn; per command the wall times
    (a cold command's cache emptied before, untimed), their median and what its reader makes of the last
    run's output."""
    out = {}
    for name, c in commands.items():
        print(f"  untimed first run: {name}", file=sys.stderr)
        c.empty()
        t0 = time.perf_counter()
        proc = c.run()
        out[name] = {"command": c.argv, "first_run_s": time.perf_counter() - t0, "wall_s": []}
        if c.cache_dir is not None:
            out[name]["trace_cache"] = "emptied before each run" if c.cold else "filled by the first run"
        if proc.returncode != 0:
            out[name].update(ok=False, error=f"exit {proc.returncode}: {_tail(proc.stderr)}")
    live = {n: c for n, c in commands.items() if out[n].get("ok", True)}
    last = {}
    for r in range(rounds):
        print(f"  round {r + 1}/{rounds}", file=sys.stderr)
        for name, c in live.items():
            c.empty()
            t0 = time.perf_counter()
            last[name] = c.run()
            out[name]["wall_s"].append(time.perf_counter() - t0)
    for name, c in live.items():
        proc = last.get(name)
        if proc is None or proc.returncode != 0:
            out[name].update(ok=False, error=f"exit {proc.returncode}: {_tail(proc.stderr)}" if proc else "no run")
            continue
        out[name].update(ok=True, median_s=statistics.median(out[name]["wall_s"]), **c.read(c.argv, proc))
    return out


def python_ordereddict_lru(keys: list[list[int]], capacity: int) -> list[int]:
    """The quick script one would write: classic block LRU with the prefix rule (same rule as kvbench `lru`)."""
    cache: OrderedDict[int, None] = OrderedDict()
    hits = []
    for blocks in keys:
        h = 0
        while h < len(blocks) and blocks[h] in cache:
            h += 1
        hits.append(h)
        for b in blocks:
            if b in cache:
                cache.move_to_end(b)
            else:
                if len(cache) >= capacity:
                    cache.popitem(last=False)
                cache[b] = None
    return hits


def _median(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_in_process(parquet: Path, repeat: int) -> dict:
    import numpy as np

    from kvbench.cache import policies
    from kvbench.cache.curve import lru_curve
    from kvbench.cache.densify import densify
    from kvbench.cache.prepared import fold_isolation, prepare
    from kvbench.trace.files import read_trace

    table, meta = read_trace(parquet)
    lru = policies.get("lru")
    trace = prepare(table, meta.block_size)
    refs = int(trace.keys.size)
    lru.kernel(trace, IN_PROCESS_CAPACITY)  # compile / load the numba cache
    lru_curve(trace)

    py_keys = table.column("block_hashes").to_pylist()
    t0 = time.perf_counter()
    py_hits = python_ordereddict_lru(py_keys, IN_PROCESS_CAPACITY)
    py_s = time.perf_counter() - t0
    kernel_hits = lru.kernel(trace, IN_PROCESS_CAPACITY).hit_blocks
    same = bool(np.array_equal(np.asarray(py_hits), kernel_hits))

    def prepare_and_replay():
        lru.kernel(prepare(table, meta.block_size), IN_PROCESS_CAPACITY)

    hashes = fold_isolation(table)
    ids = np.asarray(hashes.flatten())

    def densify_and_replay(name, prepared):
        pol = policies.get(name)
        pol.kernel(prepared, IN_PROCESS_CAPACITY)  # compile / load once

        def run():
            densify(ids, prepared.offsets)  # the id densification counts, as the target says
            pol.kernel(prepared, IN_PROCESS_CAPACITY)

        return run

    prep_s = _median(prepare_and_replay, max(repeat, 20))
    curve_s = _median(lambda: lru_curve(trace), max(repeat, 10))
    out = {
        "capacity_blocks": IN_PROCESS_CAPACITY,
        "block_refs": refs,
        "python_ordereddict_lru": {"s": py_s, "refs_per_s": refs / py_s, "same_hits_as_kvbench": same},
        "kvbench_lru_prepare_and_kernel": {"s": prep_s, "refs_per_s": refs / prep_s},
        "kvbench_lru_curve_all_capacities": {"s": curve_s},
    }
    vllm = policies.get("vllm")

    def prepare_and_replay_vllm():
        vllm.kernel(prepare(table, meta.block_size, vllm_cap=True), IN_PROCESS_CAPACITY)

    s = _median(prepare_and_replay_vllm, max(repeat, 20))
    out["kvbench_vllm_prepare_and_kernel"] = {"s": s, "refs_per_s": refs / s}
    out.update(_load_and_replay(parquet, table, meta, refs, max(repeat, 200)))
    capped = prepare(table, meta.block_size, vllm_cap=True)
    for name, prepared in (("lru", trace), ("vllm", capped), ("radix-lru", trace), ("belady", trace)):
        s = _median(densify_and_replay(name, prepared), max(repeat, 200))  # many: the VM is noisy
        out[f"kvbench_{name.replace('-', '_')}_densify_and_kernel"] = {"s": s, "refs_per_s": refs / s}
    return out


def _load_and_replay(parquet: Path, table, meta, refs: int, repeat: int) -> dict:
    """lru and vllm with their prepared trace loaded from the trace cache (a fresh entry in a temporary folder,
    stored once, untimed): finding the file's entry (a stat and its Parquet footer), mapping its arrays, the
    kernel; what a warm run does instead of preparing."""
    from kvbench.cache import policies
    from kvbench.cache.prepared import prepare
    from kvbench.run.tracecache import TraceCache

    out = {}
    with tempfile.TemporaryDirectory(prefix="kvbench-peers-cache-") as root:
        for name, cap in (("lru", False), ("vllm", True)):
            entry = TraceCache.for_file(parquet, Path(root))
            part = entry.prepared_part(True, False, cap)
            entry.store_prepared(part, prepare(table, meta.block_size, vllm_cap=cap))
            pol = policies.get(name)

            def load_and_replay(pol=pol, part=part):
                pol.kernel(TraceCache.for_file(parquet, Path(root)).load_prepared(part), IN_PROCESS_CAPACITY)

            load_and_replay()
            s = _median(load_and_replay, repeat)
            out[f"kvbench_{name}_load_and_kernel"] = {"s": s, "refs_per_s": refs / s}
    return out


def _pip_version(dist: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(dist)
    except Exception:
        return None


def prepare_kvbench() -> str | None:
    """What a wheel install has before its first run: kvbench byte-compiled, and its compiled kernels built."""
    import kvbench

    subprocess.run([sys.executable, "-m", "compileall", "-q", str(Path(kvbench.__file__).parent),
                    str(REPO / "backends")], capture_output=True)  # fmt: skip
    build = "from kvbench.cache.compiled import build; print(build())"
    return subprocess.run([sys.executable, "-c", build], capture_output=True, text=True, cwd=REPO).stdout.strip()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("jsonl", nargs="?", type=Path, default=DEFAULT_JSONL)
    ap.add_argument("--parquet", type=Path, default=DEFAULT_PARQUET)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    if not args.jsonl.exists():
        print(f"{args.jsonl} not found (give the Mooncake JSONL trace as the first argument)", file=sys.stderr)
        return 2

    aot = prepare_kvbench()
    with tempfile.TemporaryDirectory(prefix="kvbench-peers-") as tmp:
        tmp = Path(tmp)
        commands = {}
        if (cmd := kvcache_simulator_cmd(args.jsonl, tmp)) is not None:
            commands["kvcache-simulator lru, 8 capacities"] = Command(cmd, read_kvcache_simulator)
        for label, policy, capacities, bound in (
            ("radix-lru, 8 capacities, --no-bound", "radix-lru", CAPACITIES, False),
            ("radix-lru, 8 capacities, Belady bound (default)", "radix-lru", CAPACITIES, True),
        ):
            commands.update(kvbench_commands(label, args.parquet, tmp, policy, capacities, bound))
        if (cmd := libcachesim_cmd(args.jsonl, tmp)) is not None:
            commands["libcachesim LRU, 1 capacity"] = Command(cmd, read_libcachesim)
        commands.update(
            kvbench_commands("lru, 1 capacity, --no-bound", args.parquet, tmp, "lru", [IN_PROCESS_CAPACITY], False)
        )
        print(f"(a, b) whole processes, {args.rounds} interleaved rounds ...", file=sys.stderr)
        whole = interleaved(commands, args.rounds)
    print("(c) in process ...", file=sys.stderr)
    inproc = run_in_process(args.parquet, 20)

    result = {
        "command": "python benchmarks/peers.py --rounds " + str(args.rounds),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpus": _cpus(),
            "load_average": list(__import__("os").getloadavg()),
        },
        "capacities_blocks": CAPACITIES,
        "aot_module": aot,
        "whole_process": whole,
        "in_process": inproc,
    }
    result["ratios"] = _ratios(whole)
    print(_table(result))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwritten: {args.out}")
    return 0


PEER_OF = {  # each kvbench command (less its cache state) and the peer it is measured against
    "kvbench radix-lru, 8 capacities, --no-bound": (
        "kvcache-simulator lru, 8 capacities",
        "no_bound_over_kvcache_simulator",
    ),
    "kvbench radix-lru, 8 capacities, Belady bound (default)": (
        "kvcache-simulator lru, 8 capacities",
        "with_bound_over_kvcache_simulator",
    ),
    "kvbench lru, 1 capacity, --no-bound": ("libcachesim LRU, 1 capacity", "lru_over_libcachesim"),
}
STATES = ("cold", "warm")


def _ratios(w: dict) -> dict:
    """kvbench's median wall time over the peer's (below 1: kvbench faster), cold and warm, the bound's cost,
    and the hit rates' agreement (with the peer, and between cold and warm runs)."""

    def med(name):
        return w.get(name, {}).get("median_s") if w.get(name, {}).get("ok") else None

    out = {}
    for ours, (peer, key) in PEER_OF.items():
        for state in STATES:
            mine, theirs = med(f"{ours}, {state} trace cache"), med(peer)
            out[f"kvbench_{key}_{state}"] = mine / theirs if mine and theirs else None
    for state in STATES:
        bound = med(f"kvbench radix-lru, 8 capacities, Belady bound (default), {state} trace cache")
        no_bound = med(f"kvbench radix-lru, 8 capacities, --no-bound, {state} trace cache")
        out[f"bound_cost_s_{state}"] = bound - no_bound if bound and no_bound else None
    peer = w.get("kvcache-simulator lru, 8 capacities", {})
    for state in STATES:
        mine = w.get(f"kvbench radix-lru, 8 capacities, --no-bound, {state} trace cache", {})
        if peer.get("ok") and mine.get("ok"):
            common = set(peer["token_steady"]) & set(mine["token_steady"])
            out[f"max_abs_hit_rate_diff_{state}"] = max(
                abs(peer["token_steady"][c] - mine["token_steady"][c]) for c in common
            )
    kv = [n for n in w if n.startswith("kvbench ") and n.endswith("cold trace cache")]
    out["cold_and_warm_same_hit_rates"] = all(
        w[n].get("ok")
        and w[n.replace("cold", "warm")].get("ok")
        and w[n]["block_all"] == w[n.replace("cold", "warm")]["block_all"]
        for n in kv
    )
    return out


def _cpus() -> int | None:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def _table(r: dict) -> str:
    rows = [("what", "wall (median)", "rate", "vs peer")]
    ratios = r["ratios"]
    vs = {
        f"{ours}, {state} trace cache": ratios[f"kvbench_{key}_{state}"]
        for ours, (_, key) in PEER_OF.items()
        for state in STATES
    }
    for name, w in r["whole_process"].items():
        if not w.get("ok"):
            rows.append((name, "FAILED", "", w.get("error", "").splitlines()[0] if w.get("error") else ""))
            continue
        ratio = vs.get(name)
        rows.append((name, f"{w['median_s']:.2f} s", "", "peer" if name not in vs else _ratio(ratio)))
    ip = r["in_process"]
    py = ip["python_ordereddict_lru"]
    rows.append(("Python OrderedDict block LRU, in process", f"{py['s'] * 1e3:.1f} ms",
                 f"{py['refs_per_s'] / 1e6:.1f} M refs/s", "peer"))  # fmt: skip
    for key, label in (
        ("kvbench_lru_prepare_and_kernel", "kvbench lru, prepare included (target >= 200 M/s)"),
        ("kvbench_vllm_prepare_and_kernel", "kvbench vllm, prepare included (target >= 200 M/s)"),
        ("kvbench_lru_load_and_kernel", "kvbench lru, load from the trace cache included"),
        ("kvbench_vllm_load_and_kernel", "kvbench vllm, load from the trace cache included"),
        ("kvbench_lru_densify_and_kernel", "kvbench lru kernel + densify"),
        ("kvbench_vllm_densify_and_kernel", "kvbench vllm kernel + densify"),
        ("kvbench_radix_lru_densify_and_kernel", "kvbench radix-lru kernel + densify"),
        ("kvbench_belady_densify_and_kernel", "kvbench belady kernel + densify"),
    ):
        k = ip[key]
        rows.append((label, f"{k['s'] * 1e3:.2f} ms", f"{k['refs_per_s'] / 1e6:.1f} M refs/s",
                     f"{k['refs_per_s'] / py['refs_per_s']:.1f}x the OrderedDict"))  # fmt: skip
    rows.append(("kvbench lru one-pass curve", f"{ip['kvbench_lru_curve_all_capacities']['s'] * 1e3:.1f} ms", "", ""))
    widths = [max(len(str(row[i])) for row in rows) for i in range(4)]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    for state in STATES:
        if ratios.get(f"bound_cost_s_{state}") is not None:
            lines.append(
                f"the Belady bound's cost ({state}; with - without, medians): {ratios[f'bound_cost_s_{state}']:.2f} s"
            )
        if ratios.get(f"max_abs_hit_rate_diff_{state}") is not None:
            diff = ratios[f"max_abs_hit_rate_diff_{state}"]
            lines.append(f"steady-state hit rates ({state}), kvbench radix-lru vs kvcache-simulator lru: max |diff| = "
                         f"{diff:.2e} over {len(CAPACITIES)} capacities")  # fmt: skip
    if not ratios["cold_and_warm_same_hit_rates"]:
        lines.append("WARNING: kvbench's cold and warm runs disagree on hit rates")
    if not py["same_hits_as_kvbench"]:
        lines.append("WARNING: the OrderedDict LRU and kvbench lru disagree on hit blocks")
    return "\n".join(lines)


def _ratio(x: float | None) -> str:
    if x is None:
        return ""
    return f"{x:.2f}x the peer's time" + (" (kvbench faster)" if x < 1 else " (kvbench slower)")


if __name__ == "__main__":
    sys.exit(main())
