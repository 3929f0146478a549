"""engine-sim's compiled loop (compiled_loop.py) gives the Python loop's results bit for bit: every per-request
column and every summary fact, over routers, preemption modes, pools small enough to evict, preempt and reject,
a calibrated step model, the h100's kernel-by-kernel model (the default), a datasheet roofline and a
mixture-of-experts roofline; the cases it does not cover run the Python loop; its
AOT module builds and runs.

This is an equivalence check between kvbench's two loops, not a check of truth: engine-sim against the live vLLM
engine is benchmarks/fidelity.py and tests/integration/test_live_vllm.py (cached tokens per request, latency errors)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from kvbench.backends.enginesim import compiled_run

from kvbench.run.runner import run_replay
from tests.conftest import REPO, SAMPLES

CASES = {
    "chat, cache-aware, evicting": ("chat", {"instances": 3, "router": "cache-aware", "hbm_capacity": "400"}),
    "multi-tenant, least-loaded, preempting": (
        "multi-tenant",
        {"instances": 2, "router": "least-loaded", "hbm_capacity": "120", "max_num_seqs": 32},
    ),
    "agent, round-robin, swapping": (
        "agent",
        {"instances": 2, "router": "round-robin", "hbm_capacity": "500", "preemption": "swap", "max_num_seqs": 16},
    ),
    "reasoning, protect-after, fast-forward windows": (
        "reasoning",
        {"hbm_capacity": "6000", "max_num_seqs": 64, "preemption": "protect-after=1000"},
    ),
    "multimodal, prefix-affinity, a pool too small for some prompts": (
        "multimodal",
        {"instances": 4, "router": "prefix-affinity", "hbm_capacity": "60", "max_num_batched_tokens": 2048},
    ),
    "chat, the datasheet roofline of an A100 (no measured kernels)": (
        "chat",
        {"instances": 2, "hardware": "a100", "hbm_capacity": "400"},
    ),
    "chat, mixture of experts (MLA) on a B200": (
        "chat",
        {"instances": 2, "model": "deepseek-v3", "hardware": "b200", "hbm_capacity": "4000"},
    ),
}


def _assert_same_rows(got, want):
    """Column by column, NaN equal to NaN (a rejected request's latencies)."""
    assert got.schema == want.schema
    for name in want.column_names:
        a, b = got.column(name).to_pylist(), want.column(name).to_pylist()
        if want.schema.field(name).type in (pa.float64(), pa.float32()):
            np.testing.assert_array_equal(np.array(a, float), np.array(b, float), err_msg=name)
        else:
            assert a == b, name


def _replay(trace, opts, out, loop, monkeypatch):
    monkeypatch.setenv(compiled_run.SWITCH, loop)
    run_dir, summary = run_replay(trace, "engine-sim", opts, out=out, report=False)
    return pq.read_table(run_dir / "requests.parquet"), summary["points"]


@pytest.mark.parametrize("case", list(CASES))
def test_the_compiled_loop_gives_the_python_loops_results(case, tmp_path, monkeypatch):
    sample, opts = CASES[case]
    trace = SAMPLES / f"{sample}.parquet"
    py_rows, py_points = _replay(trace, opts, tmp_path / "python", "python", monkeypatch)
    c_rows, c_points = _replay(trace, opts, tmp_path / "compiled", "compiled", monkeypatch)
    _assert_same_rows(c_rows, py_rows)
    assert c_points == py_points
    assert py_points[0]["engine"]["iterations"] > 0


def test_the_cases_exercise_what_they_name(tmp_path, monkeypatch):
    """The case list really reaches evictions, preemptions, swaps, rejections and several instances."""
    seen = {}
    for case, (sample, opts) in CASES.items():
        rows, points = _replay(SAMPLES / f"{sample}.parquet", opts, tmp_path / case, "compiled", monkeypatch)
        seen[case] = points[0]["engine"] | {"evicted": sum(rows.column("evictions").to_pylist())}
    assert seen["chat, cache-aware, evicting"]["evicted"] > 0
    assert seen["multi-tenant, least-loaded, preempting"]["preemptions"] > 0
    assert seen["agent, round-robin, swapping"]["swap_bytes"] > 0
    assert seen["reasoning, protect-after, fast-forward windows"]["recomputed_tokens"] > 0
    assert seen["multimodal, prefix-affinity, a pool too small for some prompts"]["rejected"] > 0
    assert min(seen["chat, cache-aware, evicting"]["requests_per_instance"]) > 0


def test_calibrated_models_run_compiled_with_their_request_overhead(tmp_path, monkeypatch):
    calib = tmp_path / "calib.toml"
    calib.write_text(
        "[calibration]\nrequest_overhead_s = 0.004\nstep_overhead_s = 0.002\ns_per_seq = 0.0001\n"
        "s_per_token = 0.00002\ns_per_pair = 1e-9\ns_per_kv_token = 2e-7\n"
    )
    opts = {"instances": 2, "calibration": str(calib), "hbm_capacity": "400"}
    py_rows, py_points = _replay(SAMPLES / "chat.parquet", opts, tmp_path / "py", "python", monkeypatch)
    c_rows, c_points = _replay(SAMPLES / "chat.parquet", opts, tmp_path / "c", "compiled", monkeypatch)
    _assert_same_rows(c_rows, py_rows)
    assert c_points == py_points


@pytest.mark.parametrize(
    "opts",
    [{"dram_capacity": "2000"}, {"closed_loop": True}, {"max_concurrency": 4}, {"policy": "lru"}],
    ids=["a DRAM tier", "closed loop", "a client concurrency limit", "another policy"],
)
def test_what_the_compiled_loop_does_not_cover_runs_in_python(opts, tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the compiled loop ran a replay it does not cover")

    monkeypatch.setattr(compiled_run, "run", refuse)
    opts = {"hbm_capacity": "400", **opts}
    rows, _ = _replay(SAMPLES / "chat.parquet", opts, tmp_path / "r", "compiled", monkeypatch)
    assert rows.num_rows > 0


def test_the_aot_module_builds_and_replays(tmp_path):
    """The engine's kernels build into their own AOT module (kvbench.cache.compiled's units), and a replay then
    runs the loop from it, with the Python loop's results."""
    if not any(shutil.which(c) for c in (os.environ.get("CC", "cc"), "cc", "gcc", "clang")):
        pytest.skip("no C compiler on PATH: numba.pycc cannot build the AOT module")
    env = {k: v for k, v in os.environ.items() if k not in ("KVBENCH_NO_AOT", compiled_run.SWITCH)}
    env["KVBENCH_KERNEL_DIR"] = str(tmp_path / "kernels")
    unit = "kvbench.backends.enginesim"
    build = subprocess.run(
        [sys.executable, "-m", "kvbench.cache.compiled", "build", unit], env=env, capture_output=True, text=True
    )
    assert build.returncode == 0, build.stderr
    assert list((tmp_path / "kernels").glob("kvbench_backends_enginesim_kernels_*")), "no AOT module was written"
    code = (
        "import sys\nfrom kvbench.cli import main\n"
        "try:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
        "from kvbench.backends.enginesim.compiled_loop import run_cluster\n"
        "print('ran', type(run_cluster._impl).__name__)"  # the AOT module's functions are builtins; JIT's dispatchers
    )
    opts = ["--backend", "engine-sim", "--instances", "2", "--hbm-capacity", "400", "--policy", "vllm", "--no-report"]
    outs = {}
    for loop in ("aot", "python"):
        run_env = env | ({compiled_run.SWITCH: "python"} if loop == "python" else {})
        out = tmp_path / loop
        r = subprocess.run(
            [sys.executable, "-c", code, "replay", str(SAMPLES / "chat.parquet"), *opts, "--out", str(out)],
            env=run_env, cwd=REPO, capture_output=True, text=True,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
        outs[loop] = pq.read_table(out / "requests.parquet")
        if loop == "aot":
            assert r.stdout.strip().endswith("ran builtin_function_or_method"), r.stdout
        else:
            assert r.stdout.strip().endswith("ran NoneType"), r.stdout
    _assert_same_rows(outs["aot"], outs["python"])


@pytest.mark.parametrize("built", [True, False])
def test_a_short_replay_waits_for_the_aot_module_in_the_python_loop(built, tmp_path, monkeypatch):
    """Without the AOT module a short replay runs the Python loop (quicker than compiling) and starts its build;
    with it, the compiled loop runs."""
    from kvbench.backends.enginesim import compiled_loop

    monkeypatch.delenv(compiled_run.SWITCH, raising=False)
    monkeypatch.setattr(type(compiled_loop.run_cluster), "aot_ready", lambda self: built)
    builds, runs = [], []
    monkeypatch.setattr(compiled_run, "start_background_build", builds.append)
    real_run = compiled_run.run
    monkeypatch.setattr(compiled_run, "run", lambda *a: runs.append(1) or real_run(*a))
    run_replay(SAMPLES / "chat.parquet", "engine-sim", {"hbm_capacity": "400"}, out=tmp_path / "r", report=False)
    assert (runs, builds) == (([1], []) if built else ([], ["kvbench.backends.enginesim"]))
