"""Distributed load generation against the real vLLM CPU engine (`@pytest.mark.engine`): two Ray workers on a
local cluster replay the same requests a single client does, every one answered at the trace's length."""

from __future__ import annotations

import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from kvbench.run.limits import RequestLimits
from kvbench.run.runner import run_replay

from ..conftest import CHAT

pytestmark = pytest.mark.engine
N = 40


def live(vllm, out, **extra):
    opts = {
        "url": vllm.url,
        "mode": "rate",
        "rate": 1000.0,
        "max_concurrency": 1,  # per worker
        "max_requests": N,
        "send_lora": False,
    }
    return run_replay(CHAT, "openai", opts, out=out, report=False, limits=RequestLimits(max_output_tokens=1), **extra)


def test_two_ray_workers_replay_the_single_client_request_set(vllm, ray_cluster, tmp_path):
    single, _ = live(vllm, tmp_path / "single")
    run_dir, summary = live(vllm, tmp_path / "ray", workers=2, executor="ray")
    one = pq.read_table(single / "requests.parquet")
    rows = pq.read_table(run_dir / "requests.parquet")
    assert sorted(rows.column("request_id").to_pylist()) == sorted(one.column("request_id").to_pylist())
    assert rows.num_rows == N and set(rows.column("status").to_pylist()) == {"ok"}, rows.column("error")
    # the server counted exactly the trace's prompt lengths, whichever worker sent them
    assert rows.column("server_prompt_tokens").to_pylist() == rows.column("input_tokens").to_pylist()
    workers = summary["workers"]
    assert [w["status"] for w in workers] == ["alive", "alive"]
    assert [w["ok"] for w in workers] == [w["requests"] for w in workers] and sum(w["ok"] for w in workers) == N
    listed = [s for w in workers for s in w["session_ids"]]
    assert len(listed) == len(set(listed))  # no session split across workers
    # one /metrics delta over the whole run, from the first worker's scrape before and the last one's after
    checks = summary["points"][0]["server_counters"]["checks"]
    assert checks["prompt_tokens"]["server"] == pc.sum(rows.column("input_tokens")).as_py()
