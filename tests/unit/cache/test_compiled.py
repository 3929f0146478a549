"""The AOT (numba.pycc) kernel module: built once, used by later processes without importing numba, and
giving exactly what numba's JIT gives (which the other sim tests check against the pure-Python references)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import REPO

CAPACITIES = (1, 7, 64, 500, 5000)

# Run in a fresh interpreter: replays every registered policy and the one-pass curves on the sample traces,
# saves the results, and reports whether numba got imported on the way.
REPLAY = r"""
import sys
import numpy as np
from kvbench.trace.files import read_trace
from kvbench.cache import policies
from kvbench.cache.curve import lru_curve
from kvbench.cache.prepared import prepare

out = {}
for sample in ("chat", "multi-tenant"):
    table, meta = read_trace(f"traces/samples/{sample}.parquet")
    for cap in (False, True):
        trace = prepare(table, meta.block_size, vllm_cap=cap)
        out[f"{sample}/{cap}/keys"] = trace.keys
        for name, pol in policies.registry().items():
            options = {"quota": {"*": 0.3}} if name == "tenant-quota" else {}
            for c in CAPACITIES:
                res = pol.kernel(trace, c, options)
                for field in ("hit_blocks", "evictions", "evict_matrix"):
                    out[f"{sample}/{cap}/{name}/{c}/{field}"] = getattr(res, field)
                out[f"{sample}/{cap}/{name}/{c}/filled_at"] = np.array(res.filled_at)
        curve = lru_curve(trace)
        out[f"{sample}/{cap}/curve/depth"] = curve.depth
        out[f"{sample}/{cap}/curve/cumulative"] = curve.cumulative
        for c in CAPACITIES:
            out[f"{sample}/{cap}/curve/{c}"] = curve.hit_blocks(c)
np.savez(sys.argv[1], **out)
print("numba imported" if "numba" in sys.modules else "numba not imported")
""".replace("CAPACITIES", repr(CAPACITIES))


def _env(kernel_dir, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("KVBENCH_NO_AOT", "KVBENCH_KERNEL_DIR")}
    env["KVBENCH_KERNEL_DIR"] = str(kernel_dir)
    env.update(extra)
    return env


def _python(code: str, *args, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, cwd=REPO, env=env
    )


@pytest.fixture(scope="module")
def kernel_dir(tmp_path_factory):
    if not any(shutil.which(c) for c in (os.environ.get("CC", "cc"), "cc", "gcc", "clang")):
        pytest.skip("no C compiler on PATH: numba.pycc cannot build the AOT kernel module")
    d = tmp_path_factory.mktemp("kernels")
    build = "from kvbench.cache.compiled import build; print(build())"
    r = _python(build, env=_env(d))
    assert r.returncode == 0, r.stderr
    failed = list(d.glob("*.failed"))
    assert not failed, f"AOT build failed: {failed[0].read_text() if failed else ''}"
    assert r.stdout.strip().endswith(".so") or r.stdout.strip().endswith(".pyd"), r.stdout
    return d


def test_aot_results_equal_jit_without_numba(kernel_dir, tmp_path):
    aot = _python(REPLAY, tmp_path / "aot.npz", env=_env(kernel_dir))
    assert aot.returncode == 0, aot.stderr
    assert aot.stdout.strip() == "numba not imported"
    jit_dir = tmp_path / "no-kernels"
    jit = _python(REPLAY, tmp_path / "jit.npz", env=_env(jit_dir, KVBENCH_NO_AOT="1"))
    assert jit.returncode == 0, jit.stderr
    assert jit.stdout.strip() == "numba imported"
    assert not jit_dir.exists(), "KVBENCH_NO_AOT=1 must not start a build"
    a, b = np.load(tmp_path / "aot.npz"), np.load(tmp_path / "jit.npz")
    assert sorted(a.files) == sorted(b.files)
    assert any("/radix-lru/" in f for f in a.files) and any("/curve/" in f for f in a.files)
    for f in a.files:
        assert a[f].dtype == b[f].dtype, f
        np.testing.assert_array_equal(a[f], b[f], err_msg=f)


def test_cli_replay_uses_the_aot_module(kernel_dir, tmp_path):
    """Neither numba nor pyarrow.compute (~100 ms of wrappers) is imported by a replay, on the first run of a
    trace (validated, fingerprinted, prepared and stored in the trace cache) or on the next (loaded)."""
    code = (
        "import sys\nfrom kvbench.cli import main\n"
        "try:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
        "print(sorted(m for m in ('numba', 'pyarrow.compute') if m in sys.modules))"
    )
    env = _env(kernel_dir, KVBENCH_CACHE_DIR=str(tmp_path / "trace-cache"))
    for sample in ("chat", "multi-tenant", "agent"):  # (multi-tenant: tenants, salts, LoRA adapters, priorities)
        args = ["replay", f"traces/samples/{sample}.parquet", "--policy", "radix-lru,lru,vllm",
                "--capacity", "100,1000"]  # fmt: skip
        for run in ("first", "cached"):
            r = _python(code, *args, "--no-report", "--out", tmp_path / f"{sample}-{run}", env=env)
            assert r.returncode == 0, r.stderr
            assert r.stdout.strip().endswith("[]"), (sample, run, r.stdout)


def test_import_and_help_do_not_import_numba(tmp_path):
    code = (
        "import sys\nimport kvbench.backends.sim\nassert 'numba' not in sys.modules\n"
        "from kvbench.cli import main\n"
        "try:\n    main(['replay', '--help'])\nexcept SystemExit:\n    pass\n"
        "print('numba imported' if 'numba' in sys.modules else 'numba not imported')"
    )
    r = _python(code, env=_env(tmp_path / "kernels"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith("numba not imported"), r.stdout
    assert not (tmp_path / "kernels").exists(), "no kernel ran, so no build may start"


def test_module_name_tracks_the_sources(tmp_path, monkeypatch):
    from kvbench.cache import compiled as _compiled

    name = _compiled.module_name()
    assert name.startswith("kvbench_kernels_") and name == _compiled.module_name()
    monkeypatch.setattr(_compiled, "_PKG_DIR", tmp_path)
    (tmp_path / "a.py").write_text("x = 1\n")
    other = _compiled.module_name()
    (tmp_path / "a.py").write_text("x = 2\n")
    assert other != name and _compiled.module_name() != other
