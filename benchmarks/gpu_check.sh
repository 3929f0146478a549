#!/usr/bin/env bash
# The one script to run on a lent GPU machine (an H100 or H200): checks engine-sim's time model against that GPU
# and checks and measures the `torch` backend on CUDA, in under 10 minutes of wall clock, and leaves a small
# results folder.
#
#   bash benchmarks/gpu_check.sh            # from the repository root
#
# Stages, each timed, each bounded by `timeout` and by one overall deadline (GPU_CHECK_BUDGET_S, default 570 s),
# so that a hung stage cannot eat the machine's lease:
#   0. facts: nvidia-smi, memory, disk, locked-memory limit;
#   1. install: `pip install -e ".[dev]"` unless this checkout is already importable with its entry points,
#      and `pip install torch` only when the installed torch cannot see CUDA (the machine may be offline: every
#      failure is reported and the script goes on with what is there);
#   T. time model: benchmarks/gpu_time_check.py (at most 200 s; docs/gpu-truth.md): the nine linear kernels of a
#      Llama layer timed on this GPU against the matching preset (targets: GEMM MAPE <= 10 % at >= 64 tokens,
#      <= 25 % below), vLLM's batch-8 latency shape against engine-sim when vLLM is importable (+-15 %), and
#      llama.cpp's TTFT/E2EL fidelity when a llama-server is on the PATH (<= 20 % / <= 10 %); one table;
#   2. pytest: tests/gpu + tests/unit/torchkv with KVBENCH_TORCH_DEVICE=cuda (at most 300 s);
#   3. bandwidth: benchmarks/torch_bandwidth.py --budget-s 150 (block-size sweep of transfer rates), then the
#      issue-18 targets, one pass/FAIL line per cell: between HBM and pinned DRAM, coalesced and staged moves at
#      >= 80 % of one contiguous copy of the same bytes measured in the same rounds (the PCIe/NVLink rate this
#      machine gets: `vs_contiguous` >= 0.8), block mode at least as fast as the naive per-block loop
#      (`vs_naive_loop` >= 1). A missed target is reported (targets.log, gpu_check.json), not an exit status;
#   4. replay: `kvbench replay` of the chat sample with llama3-8b KV on cuda, --compute --verify (at most 180 s).
#
# Results go to $OUT when set (the device runner's folder that comes back), else benchmarks/results/gpu_check/:
# gpu_check.json (the summary: pytest counts, bandwidth results path and best rates, the replay's transfer
# report and TTFT/TPOT p50, wall times), one log per stage, pytest.xml, the bandwidth JSON, replay/.
# Exit status: 1 when pytest failed (or timed out: a timed-out stage is interrupted, so it still writes what it
# has), 2 when CUDA is not usable, 3 when the time model, bandwidth or replay failed, else 0.
#
# Knobs (environment): PYTHON, GPU_CHECK_BUDGET_S, GPU_CHECK_INSTALL=0 (no pip at all), GPU_CHECK_PYTEST_FLAGS
# (default "-q -x"; "-q" runs every test past a failure), GPU_CHECK_DISK_DIR (disk tier files; default
# /var/tmp/kvbench-gpu-check, not /tmp, which is often RAM), REPLAY_CAPACITY / REPLAY_HOST_CAPACITY /
# REPLAY_DISK_CAPACITY (blocks), REPLAY_DECODE_STEPS.

set -u
set -o pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO" || exit 2
OUT_DIR="${OUT:-$REPO/benchmarks/results/gpu_check}"
mkdir -p "$OUT_DIR"
# a reused folder (the local default) must not lend an earlier run's files to this run's summary
rm -rf "$OUT_DIR/replay" "$OUT_DIR/pytest.xml" "$OUT_DIR/gpu_check.json" "$OUT_DIR/torch_bandwidth-cuda.json" \
    "$OUT_DIR/gpu_time_check.json" "$OUT_DIR/llama_fidelity.json" \
    "$OUT_DIR"/*.log
PY="${PYTHON:-$(command -v python3 || command -v python)}"
BUDGET_S="${GPU_CHECK_BUDGET_S:-570}"
PYTEST_FLAGS="${GPU_CHECK_PYTEST_FLAGS:--q -x}"
DISK_DIR="${GPU_CHECK_DISK_DIR:-/var/tmp/kvbench-gpu-check}"
# The brief's replay (4,000 / 20,000 / 40,000 blocks) needs 160 GiB of DRAM and 320 GiB of disk at llama3-8b's
# 8 MiB per 64-token block; the capacities are shrunk below to what this machine holds (see `fit`).
CAP="${REPLAY_CAPACITY:-4000}"
HOST_CAP="${REPLAY_HOST_CAPACITY:-20000}"
DISK_CAP="${REPLAY_DISK_CAPACITY:-40000}"
# Every decode step of all 2,000 requests (670k steps at ~2 ms) would take 20+ minutes; 4 per request still
# gives TPOT, spread over each output.
DECODE_STEPS="${REPLAY_DECODE_STEPS:-4}"
export KVBENCH_TORCH_DEVICE=cuda PYTHONUNBUFFERED=1
mkdir -p "$DISK_DIR"
trap 'rm -rf "$DISK_DIR"' EXIT  # a stage killed by timeout leaves its disk-tier file behind

T0=$(date +%s.%N)
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }
left() { awk -v a="$T0" -v b="$(now)" -v t="$BUDGET_S" 'BEGIN { printf "%d", t - (b - a) }'; }
min() { if [ "$1" -lt "$2" ]; then echo "$1"; else echo "$2"; fi; }
max() { if [ "$1" -gt "$2" ]; then echo "$1"; else echo "$2"; fi; }
# Python prelude: `timeout`'s SIGTERM becomes a KeyboardInterrupt, which pytest and kvbench replay handle by
# writing what they have (junit counts, summary.json) and closing their pools (no pinned memory or disk file
# left behind), where a plain SIGTERM would end them with nothing written.
ON_TERM='import signal, sys
def _stop(*_):
    raise KeyboardInterrupt
signal.signal(signal.SIGTERM, _stop)
signal.signal(signal.SIGINT, _stop)'
say() { printf '\n=== %s (%ss elapsed, %ss left)\n' "$1" "$(since "$T0")" "$(left)"; }

# ---------------------------------------------------------------------------------------------- 0. facts
say "facts"
if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=index,name,driver_version,memory.total,memory.used,utilization.gpu,temperature.gpu,power.draw,clocks.max.sm,pcie.link.gen.current,pcie.link.width.current \
        --format=csv 2>&1 | tee "$OUT_DIR/nvidia-smi.csv"
else
    echo "nvidia-smi: not found" | tee "$OUT_DIR/nvidia-smi.csv"
fi
{
    echo "python: $PY ($("$PY" --version 2>&1))"
    echo "locked-memory limit (ulimit -l): $(ulimit -l)"
    grep -E '^(MemTotal|MemAvailable)' /proc/meminfo
    df -hT "$DISK_DIR" "$REPO" 2>/dev/null
    nproc
} 2>&1 | tee "$OUT_DIR/facts.txt"

# -------------------------------------------------------------------------------------------- 1. install
say "install"
S=$(now)
INSTALL_NOTES=""
checkout_ok() {  # this checkout importable (not some other copy), with its backends registered and pytest
    "$PY" - "$REPO" <<'EOF' >/dev/null 2>&1
import sys
from importlib.metadata import entry_points
from pathlib import Path
import hypothesis, pytest  # noqa: F401
import kvbench, kvbench.backends.torchkv  # noqa: F401
assert Path(kvbench.__file__).resolve().is_relative_to(Path(sys.argv[1]).resolve())
assert "torch" in {e.name for e in entry_points(group="kvbench.backends")}
EOF
}
if [ "${GPU_CHECK_INSTALL:-1}" = 0 ]; then
    INSTALL_NOTES="install skipped (GPU_CHECK_INSTALL=0)"
elif checkout_ok; then
    INSTALL_NOTES="kvbench already installed from this checkout"
else
    # The device machine may have no network, where pip would spend minutes retrying: when every dependency is
    # already importable, only register this checkout (no index, no isolated build env); otherwise ask the
    # index once, briefly, and fall back to that.
    NO_NET=(--no-deps --no-build-isolation --no-index)
    FAST=(--retries 1 --timeout 10)
    if "$PY" -c "import pyarrow, polars, numpy, click, rich, numba, matplotlib, pytest, hypothesis" >/dev/null 2>&1 \
        && timeout -k 10 90 "$PY" -m pip install -q "${NO_NET[@]}" -e . >"$OUT_DIR/install.log" 2>&1; then
        INSTALL_NOTES="dependencies present; pip install --no-deps -e .: ok"
    elif timeout -k 10 "$(min 200 "$(left)")" "$PY" -m pip install -q "${FAST[@]}" -e ".[dev]" >>"$OUT_DIR/install.log" 2>&1
    then
        INSTALL_NOTES="pip install -e .[dev]: ok"
    else
        INSTALL_NOTES="pip install -e .[dev] FAILED (offline?), see install.log;"
        timeout -k 10 90 "$PY" -m pip install -q "${NO_NET[@]}" -e . >>"$OUT_DIR/install.log" 2>&1 \
            && INSTALL_NOTES="$INSTALL_NOTES --no-deps install: ok" \
            || INSTALL_NOTES="$INSTALL_NOTES --no-deps install: FAILED"
    fi
    checkout_ok || INSTALL_NOTES="$INSTALL_NOTES; kvbench (this checkout), pytest or hypothesis NOT importable"
fi
if [ "${GPU_CHECK_INSTALL:-1}" != 0 ] && ! "$PY" -c "import torch; assert torch.cuda.is_available()" >/dev/null 2>&1; then
    # only now: pip's torch on Linux is a CUDA build; a CPU-only torch here would make every GPU test skip
    if timeout -k 10 "$(min 240 "$(left)")" "$PY" -m pip install -q --retries 1 --timeout 10 torch \
        >>"$OUT_DIR/install.log" 2>&1; then
        INSTALL_NOTES="$INSTALL_NOTES; pip install torch: ok"
    else
        INSTALL_NOTES="$INSTALL_NOTES; pip install torch: FAILED (offline?)"
    fi
fi
CUDA_OK=0
"$PY" -c "import torch; assert torch.cuda.is_available()" >/dev/null 2>&1 && CUDA_OK=1
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')" 2>&1 | tee -a "$OUT_DIR/facts.txt"
INSTALL_WALL=$(since "$S")
echo "$INSTALL_NOTES (${INSTALL_WALL}s)"
[ "$CUDA_OK" = 1 ] || echo "CUDA is NOT usable from $PY: the GPU tests will skip and the GPU stages will fail"

# ----------------------------------------------------------------------------------------- T. time model
say "time model"
S=$(now)
TIME_BUDGET=$(min 200 $(($(left) - 330)))  # leave >= 330 s for pytest, the sweep and the replay
if [ "$TIME_BUDGET" -ge 30 ]; then
    timeout -k 10 $((TIME_BUDGET + 30)) "$PY" benchmarks/gpu_time_check.py --out "$OUT_DIR" --budget-s "$TIME_BUDGET" \
        2>&1 | tee "$OUT_DIR/time.log"
    TIME_RC=$?
else
    TIME_RC=124
    echo "skipped: out of time" | tee "$OUT_DIR/time.log"
fi
TIME_WALL=$(since "$S")

# --------------------------------------------------------------------------------------------- 2. pytest
say "pytest"
S=$(now)
T=$(max 60 "$(min 300 $(($(left) - 200)))")  # leave >= 200 s for the sweep and the replay, if there is time
# shellcheck disable=SC2086  # PYTEST_FLAGS is a list of flags
timeout -k 15 "$T" "$PY" -c "$ON_TERM
import pytest; sys.exit(pytest.main(sys.argv[1:]))" tests/gpu tests/unit/torchkv $PYTEST_FLAGS --tb=short \
    -p no:cacheprovider --junitxml="$OUT_DIR/pytest.xml" 2>&1 | tee "$OUT_DIR/pytest.log"
PYTEST_RC=$?
PYTEST_WALL=$(since "$S")

# ------------------------------------------------------------------------------------------ 3. bandwidth
say "bandwidth"
S=$(now)
BW_BUDGET=$(min 150 $(($(left) - 170)))  # leave >= 170 s for the replay
BW_JSON="$OUT_DIR/torch_bandwidth-cuda.json"
if [ "$BW_BUDGET" -ge 20 ]; then
    timeout -k 10 $((BW_BUDGET + 45)) "$PY" benchmarks/torch_bandwidth.py --device cuda --budget-s "$BW_BUDGET" \
        --disk-dir "$DISK_DIR" --no-progress --out "$BW_JSON" >"$OUT_DIR/bandwidth.log" 2>&1
    BW_RC=$?
    tail -n 30 "$OUT_DIR/bandwidth.log"
    "$PY" - "$BW_JSON" <<'EOF' 2>&1 | tee "$OUT_DIR/targets.log"
import json, sys
from kvbench.backends.torchkv.bandwidth import target_lines
try:
    result = json.load(open(sys.argv[1]))
except (OSError, ValueError) as e:
    sys.exit(f"targets: no bandwidth results ({e})")
print("targets (issue 18): HBM <-> pinned DRAM coalesced/staged >= 0.8 x contiguous copy; block >= 1 x naive loop")
print("\n".join(target_lines(result)))
EOF
else
    BW_RC=124
    echo "skipped: out of time" | tee "$OUT_DIR/bandwidth.log"
fi
BW_WALL=$(since "$S")

# --------------------------------------------------------------------------------------------- 4. replay
say "replay"
S=$(now)
fit() {  # the capacities, shrunk to 40 % of free DRAM and disk and 50 % of free GPU memory (blocks)
    "$PY" - "$CAP" "$HOST_CAP" "$DISK_CAP" "$DISK_DIR" <<'EOF'
import os, sys
import torch
from kvbench.backends.torchkv.geometry import KvGeometry
from kvbench.trace.files import read_meta
cap, host, disk, where = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
block = KvGeometry.named("llama3-8b", read_meta("traces/samples/chat.parquet").block_size, "bf16").block_bytes
mem = next(int(l.split()[1]) * 1024 for l in open("/proc/meminfo") if l.startswith("MemAvailable"))
st = os.statvfs(where)
gpu = torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else 0
print(min(cap, int(0.5 * gpu / block)), min(host, int(0.4 * mem / block)), min(disk, int(0.4 * st.f_bavail * st.f_frsize / block)))
EOF
}
read -r R_CAP R_HOST R_DISK < <(fit 2>>"$OUT_DIR/replay.log" || echo "$CAP $HOST_CAP $DISK_CAP")
T=$(min 180 $(($(left) - 10)))
echo "capacities (blocks): hbm $R_CAP, dram $R_HOST, disk $R_DISK (asked $CAP / $HOST_CAP / $DISK_CAP); timeout ${T}s"
if [ "$T" -ge 30 ]; then
    # kvbench.cli has no __main__; this runs the `kvbench` console script's function with this python
    timeout -k 15 "$T" "$PY" -c "$ON_TERM
from kvbench.cli import main; main()" replay traces/samples/chat.parquet --backend torch --device cuda \
        --model llama3-8b --capacity "$R_CAP" --dram-capacity "$R_HOST" --ssd-capacity "$R_DISK" \
        --disk-dir "$DISK_DIR" --decode-steps "$DECODE_STEPS" --compute --verify --no-report \
        --out "$OUT_DIR/replay" >>"$OUT_DIR/replay.log" 2>&1
    REPLAY_RC=$?
    tail -n 15 "$OUT_DIR/replay.log"
else
    REPLAY_RC=124
    echo "skipped: out of time" | tee -a "$OUT_DIR/replay.log"
fi
REPLAY_WALL=$(since "$S")

# -------------------------------------------------------------------------------------------- summary
say "summary"
export OUT_DIR INSTALL_NOTES INSTALL_WALL CUDA_OK PYTEST_RC PYTEST_WALL BW_RC BW_WALL BW_JSON BW_BUDGET
export TIME_RC TIME_WALL REPLAY_RC REPLAY_WALL R_CAP R_HOST R_DISK DECODE_STEPS PYTEST_FLAGS
export TOTAL_WALL="$(since "$T0")"
"$PY" - <<'EOF'
import json, os
import xml.etree.ElementTree as ET
from pathlib import Path

env, out = os.environ, Path(os.environ["OUT_DIR"])
def load(path):
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None

counts = None
try:
    root = ET.parse(out / "pytest.xml").getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    n = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    counts = {**n, "passed": n["tests"] - n["failures"] - n["errors"] - n["skipped"]}
except (OSError, ET.ParseError, AttributeError):
    pass
bw = load(env["BW_JSON"]) or {}
rs = load(out / "replay" / "summary.json") or {}
point = (rs.get("points") or [{}])[0]
lat = rs.get("latency") or {}
def stage(name):  # exit status, timed out (124), wall seconds of a stage
    rc = int(env[f"{name}_RC"])
    return {"rc": rc, "timed_out": rc == 124, "wall_s": float(env[f"{name}_WALL"])}

facts = (point.get("torch") or {})
summary = {
    "cuda": env["CUDA_OK"] == "1",
    "total_wall_s": float(env["TOTAL_WALL"]),
    "install": {"notes": env["INSTALL_NOTES"], "wall_s": float(env["INSTALL_WALL"])},
    "time_model": {**stage("TIME"), "results": load(out / "gpu_time_check.json"), "log": "time.log"},
    "pytest": {**stage("PYTEST"), "flags": env["PYTEST_FLAGS"], "counts": counts, "log": "pytest.log"},
    "bandwidth": {
        **stage("BW"), "budget_s": int(env["BW_BUDGET"]), "log": "bandwidth.log",
        "results": Path(env["BW_JSON"]).name if bw else None,  # the full table, beside this file
        "sweep_wall_s": bw.get("wall_s"),
        **{k: bw.get(k) for k in ("device_name", "model", "dtype", "cells", "errors", "mismatches", "stopped_early",
                                  "best_by_direction", "targets")},
    },
    "replay": {
        **stage("REPLAY"), "complete": rs.get("complete"), "interrupted": rs.get("interrupted", False),
        "capacities_blocks": {"hbm": env["R_CAP"], "dram": env["R_HOST"], "disk": env["R_DISK"]},
        "decode_steps": env["DECODE_STEPS"], "hit_rate": rs.get("hit_rate"), "verify": facts.get("verify"),
        "blocks": facts.get("blocks"), "transfers": facts.get("transfers"),
        "ttft_p50_ms": (lat.get("ttft") or {}).get("p50_ms"), "tpot_p50_ms": (lat.get("tpot") or {}).get("p50_ms"),
        "log": "replay.log",
    },
}
(out / "gpu_check.json").write_text(json.dumps(summary, indent=2) + "\n")
print(json.dumps(summary, indent=1))
EOF
echo "written $OUT_DIR/gpu_check.json (${TOTAL_WALL}s)"

if [ "$PYTEST_RC" -ne 0 ]; then exit 1; fi
if [ "$CUDA_OK" != 1 ]; then exit 2; fi
if [ "$BW_RC" -ne 0 ] || [ "$REPLAY_RC" -ne 0 ] || [ "$TIME_RC" -ne 0 ]; then exit 3; fi
exit 0
