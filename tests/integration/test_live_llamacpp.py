"""The live suite against llama.cpp's server (`kvbench engine up llama-cpp`), where its features allow.

llama.cpp keeps one prompt per slot and reuses its longest common prefix (token by token), not a block pool,
so the `vllm` policy's per-request prediction does not apply and is not tested here; it ignores cache_salt,
which the isolation audit must report.
"""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from kvbench.live.audit import audit_isolation
from kvbench.run.runner import run_replay

from ..conftest import CHAT

pytestmark = pytest.mark.engine


def test_prompts_and_cache_reporting(llama, tmp_path):
    opts = {
        "url": llama.url,
        "mode": "rate",
        "rate": 1000.0,
        "max_concurrency": 1,
        "max_requests": 20,
        "max_output_tokens": 1,
    }
    run_dir, summary = run_replay(CHAT, "openai", opts, out=tmp_path / "r", report=False)
    rows = pq.read_table(run_dir / "requests.parquet")
    assert set(rows.column("status").to_pylist()) == {"ok"}, rows.column("error").to_pylist()
    assert rows.column("server_prompt_tokens").to_pylist() == rows.column("input_tokens").to_pylist()
    cached = rows.column("cached_tokens").to_pylist()
    assert all(c is not None for c in cached) and sum(cached) > 0  # consecutive turns share their prefix
    checks = summary["points"][0]["server_counters"].get("checks", {})
    if "cached_tokens" not in checks:
        pytest.skip("this llama.cpp build exports no prompt_tokens_cached counter on /metrics")
    assert checks["cached_tokens"]["server"] == sum(cached)


def test_audit_reports_that_salts_are_ignored(llama):
    result = audit_isolation(llama.url)
    assert result["passed"] is False and "salts are ignored" in result["verdict"], result
