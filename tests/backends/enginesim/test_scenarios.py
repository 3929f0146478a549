"""Each engine-sim scenario shows the effect that defines it, against the same run without it."""

from __future__ import annotations

import subprocess

import numpy as np
import pyarrow.parquet as pq
import pytest

from kvbench.errors import KvbenchError
from kvbench.run.runner import run_replay
from kvbench.trace.files import read_trace
from tests.conftest import SAMPLES


def replay(trace, tmp_path, name, **opts):
    run_dir, summary = run_replay(trace, "engine-sim", opts, out=tmp_path / name, report=False)
    return pq.read_table(run_dir / "requests.parquet"), summary["points"][0]


def scenario(point, name):
    return point["engine"]["scenarios"][name]


@pytest.fixture(scope="module")
def busy_chat(tmp_path_factory):
    path = tmp_path_factory.mktemp("t") / "chat4k.parquet"
    subprocess.run(
        ["kvbench", "trace", "gen", "chat", "-n", "4000", "--seed", "3", "--session-rate", "4", "-o", path],
        check=True,
        capture_output=True,
    )
    return path


def test_a_reasoning_pool_shields_chat_from_long_decodes(tmp_path):
    opts = dict(instances=3, hbm_capacity="3000")
    shared_rows, _ = replay(SAMPLES / "mix.parquet", tmp_path, "shared", **opts)
    pooled_rows, p = replay(SAMPLES / "mix.parquet", tmp_path, "pooled", reasoning_instances=1, **opts)
    assert scenario(p, "reasoning-pool")["reasoning_requests"] > 0

    def chat_ttft_p99(rows):
        chat = np.array([w == "chat" for w in rows.column("workload").to_pylist()])
        return np.percentile(rows.column("ttft_s").to_numpy()[chat], 99)

    assert chat_ttft_p99(pooled_rows) < chat_ttft_p99(shared_rows)


def test_shared_base_lora_kv_stays_in_the_pool_for_ten_adapters(tmp_path):
    """Deltas are charged to the pool (hand-counted cases: test_scenario_fixes.py). In this trace adapters belong
    to salted tenants and share little KV across adapters, so shared-base saves little and its deltas cost."""
    trace = tmp_path / "lora10.parquet"
    subprocess.run(
        ["kvbench", "trace", "gen", "multi-tenant", "-n", "1500", "--seed", "4", "--lora-tenant-share", "1",
         "--lora-adapters", "10", "--lora-session-share", "1", "-o", trace],
        check=True, capture_output=True,
    )  # fmt: skip
    table, _ = read_trace(trace)
    # every block fits, generated tokens' blocks included (the vllm pool makes slots only as they are used)
    unbounded = str(10 * sum(len(h) for h in table.column("block_hashes").to_pylist()))
    for pool in ("3000", unbounded):
        _, iso = replay(trace, tmp_path, f"iso{pool}", lora_kv="isolated", hbm_capacity=pool)
        _, shared = replay(trace, tmp_path, f"shared{pool}", lora_kv="shared-base", lora_delta=0.1, hbm_capacity=pool)
        a, b = scenario(iso, "multi-lora"), scenario(shared, "multi-lora")
        assert a["adapters"] == b["adapters"] == 10 and b["delta_blocks"] > 0 == a["delta_blocks"]
        assert a["kv_bytes_occupied"] <= a["pool_bytes"] and b["kv_bytes_occupied"] <= b["pool_bytes"]
    # with room for everything (the last pool), a hit needs the adapter's own delta page: about isolated's hit
    # rate, a little below it (a page covers 10 blocks; a prompt that leaves a group early has no page there)
    rate = lambda p: p["hit_rate"]["token"]["all"]  # noqa: E731
    assert rate(iso) - 0.01 < rate(shared) <= rate(iso)


def test_position_independent_media_kv_raises_the_image_hit_rate(tmp_path):
    _, prefix = replay(SAMPLES / "multimodal.parquet", tmp_path, "prefix", mm_cache="prefix")
    _, pic = replay(SAMPLES / "multimodal.parquet", tmp_path, "pic", mm_cache="position-independent")
    image = lambda p: scenario(p, "mm-cache")["hit_rate_by_modality"]["image"]  # noqa: E731
    assert image(pic) > image(prefix)
    assert pic["latency"]["ttft"]["mean_ms"] < prefix["latency"]["ttft"]["mean_ms"]


def test_deleting_a_users_kv_leaves_no_later_hits_on_it(tmp_path):
    table, _ = read_trace(SAMPLES / "multi-tenant.parquet")
    users = table.column("user_id").to_pylist()
    user = max(set(users), key=users.count)
    times = [t for u, t in zip(users, table.column("arrival_s").to_pylist()) if u == user]
    at = times[len(times) // 2]
    kept_rows, _ = replay(SAMPLES / "multi-tenant.parquet", tmp_path, "kept", user_kv_ttl=1e9)
    rows, p = replay(SAMPLES / "multi-tenant.parquet", tmp_path, "deleted", delete_user=(f"{user}@{at}",))
    facts = scenario(p, "user-kv")
    assert facts["hits_on_deleted_kv"] == 0 and facts["hits_before_deletion"][user] > 0  # the KV was in use
    after = [i for i, (u, t) in enumerate(zip(users, table.column("arrival_s").to_pylist())) if u == user and t >= at]
    hits = lambda r: sum(r.column("hit_tokens").to_numpy()[after])  # noqa: E731
    assert hits(rows) < hits(kept_rows)  # the user's later requests recompute what was deleted
    assert sum(facts["gb_hours_by_user"].values()) > 0
    with pytest.raises(KvbenchError, match="USER@SECONDS"):
        replay(SAMPLES / "chat.parquet", tmp_path, "bad", delete_user=("nobody",))


def test_a_cold_instance_starts_empty_and_a_global_pool_warms_it(busy_chat, tmp_path):
    opts = dict(
        instances=4, router="least-loaded", hbm_capacity="3000", autoscale=1, scale_up_load=3000, cold_start_s=30.0
    )
    _, cold = replay(busy_chat, tmp_path, "cold", **opts)
    _, pooled = replay(busy_chat, tmp_path, "pooled", global_pool="100GB", **opts)
    rows = scenario(cold, "autoscale")["instances"]
    assert rows[0]["up_at_s"] == 0.0 and all(r["up_at_s"] and r["up_at_s"] >= 30.0 for r in rows[1:])
    last = -1
    assert scenario(pooled, "autoscale")["instances"][last]["hit_rate_in_window"] > rows[last]["hit_rate_in_window"]
    assert pooled["hit_rate"]["token"]["all"] > cold["hit_rate"]["token"]["all"]


def test_pd_disaggregation_moves_kv_and_counts_it_in_ttft(busy_chat, tmp_path):
    agg_rows, agg = replay(busy_chat, tmp_path, "agg", instances=3)
    pd_rows, pd = replay(busy_chat, tmp_path, "pd", instances=3, disagg="pd", prefill_instances=1, kv_link_gbps=1.0)
    facts = scenario(pd, "disagg")
    assert facts["kv_bytes_transferred"] > 0
    assert pd["engine"]["requests_per_instance"][0] == 0  # every request finished on a decode instance
    # a slow link: the KV transfer shows in TTFT
    assert pd["latency"]["ttft"]["p50_ms"] > agg["latency"]["ttft"]["p50_ms"]
    _, af = replay(busy_chat, tmp_path, "af", instances=3, disagg="attn-ffn")
    ffn = scenario(af, "disagg")
    assert ffn["activation_bytes"] > 0 and ffn["added_latency_per_token_s"] > 0 and ffn["kv_bytes_not_moved_vs_pd"] > 0


def test_task_retention_keeps_a_live_tasks_kv(tmp_path):
    """Retained KV is held through the think time, so a task's calls hold more KV at once; it takes pool space
    (it yields only when nothing runs), so on this oversubscribed sample it does not raise the hit rate."""
    opts = dict(closed_loop=True, hbm_capacity="3000")
    _, plain = replay(SAMPLES / "agent.parquet", tmp_path, "plain", **opts)
    _, kept = replay(SAMPLES / "agent.parquet", tmp_path, "kept", task_retention=True, **opts)
    held, free = scenario(kept, "agent-tasks"), scenario(plain, "agent-tasks")
    assert held["peak_kv_bytes_per_task"]["max"] >= free["peak_kv_bytes_per_task"]["max"]
    assert held["retained_released_for_room"] > 0 == free["retained_released_for_room"]
    facts = scenario(kept, "agent-tasks")
    assert facts["tasks"] > 0 and facts["completion_s"]["p50"] > 0 and facts["peak_kv_bytes_per_task"]["max"] > 0
    assert kept["engine"]["kv_lifetime_s"]["evicted"] > 0
    with pytest.raises(KvbenchError, match="closed-loop"):
        replay(SAMPLES / "agent.parquet", tmp_path, "bad", task_retention=True)
