"""Cold start from first principles (engine-sim's autoscale scenario), checked against hand arithmetic on a
hand-built trace: a scale-up decided at t=0 brings an instance up after its runtime start plus weight bytes /
load bandwidth; a pre-warmed one serves at once and is billed while idle; lazy weights take requests early and
answer the first one when the last layer arrives plus that layer's share of the prefill."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from kvbench.errors import KvbenchError
from kvbench.models import KV_DTYPE_BYTES, MODELS
from kvbench.run.plugins import load_backend
from kvbench.run.runner import run_replay
from kvbench.trace.files import new_meta, write_trace
from tests.conftest import make_trace

BS = 16
PROMPT = 2000
# r0 decodes for long (instance 0 stays loaded), r1 arrives with it and triggers the scale-up at t=0, r2 comes
# while the new instance's weights load (10 s runtime + 8.03 s of weights), r3 after
ARRIVALS = [0.0, 0.0, 12.0, 40.0]
OUTPUTS = [4000, 8, 8, 8]


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    n = len(ARRIVALS)
    table = make_trace(
        n=n,
        block_size=BS,
        arrival_s=ARRIVALS,
        input_tokens=[PROMPT] * n,
        output_tokens=OUTPUTS,
        block_hashes=[list(range(1000 * i, 1000 * i + PROMPT // BS)) for i in range(n)],
        parent_id=[None] * n,
        depends_on=[[]] * n,
    )
    return write_trace(table, tmp_path_factory.mktemp("cold") / "cold.parquet", new_meta(BS, {"kind": "test"}))


OPTS = dict(instances=2, router="least-loaded", autoscale=1, scale_up_load=1000)
WEIGHTS = MODELS["llama3-8b"].params * KV_DTYPE_BYTES["bf16"]  # engine-sim's default model, BF16 weights
COLD_S = 10.0 + WEIGHTS / 2e9  # default --instance-start-s 10, --weight-load-gbps 2


def replay(trace, tmp_path, name, **opts):
    run_dir, summary = run_replay(trace, "engine-sim", {**OPTS, **opts}, out=tmp_path / name, report=False)
    rows = pq.read_table(run_dir / "requests.parquet").to_pylist()
    return summary["points"][0]["engine"]["scenarios"]["autoscale"], rows


def run_end(rows) -> float:
    return max(r["scheduled_send_s"] + r["e2el_s"] for r in rows)


def test_a_cold_instance_serves_after_its_runtime_start_plus_the_weights_load(trace, tmp_path):
    facts, rows = replay(trace, tmp_path, "cold")
    assert facts["weight_bytes"] == pytest.approx(WEIGHTS)
    assert facts["weight_load_s"] == pytest.approx(WEIGHTS / 2e9)  # 16.06 GB at 2 GB/s: 8.03 s
    assert facts["cold_start_s"] == pytest.approx(COLD_S)
    new = facts["instances"][1]
    assert new["started_as"] == "cold" and new["scaled_up_at_s"] == 0.0 and new["booted_at_s"] == 0.0
    assert new["up_at_s"] == pytest.approx(COLD_S) and new["weights_in_at_s"] == pytest.approx(COLD_S)
    # r2 (t=12) found it still loading: only r3 (t=40) reached it, so its first token came after 40 s
    assert new["first_token_at_s"] > 40.0
    assert new["time_to_first_served_s"] == pytest.approx(new["first_token_at_s"])
    assert facts["scale_ups"] == 1
    # cost: each instance billed from its boot to the run's end (instance 0 from the start)
    end = run_end(rows)
    assert facts["instance_hours"] * 3600 == pytest.approx(end + (end - 0.0))
    assert facts["idle_prewarmed_instance_hours"] == 0.0 and facts["cost_usd"] is None
    # a constant instead of the phases
    facts, _ = replay(trace, tmp_path, "fixed", cold_start_s=5.0, instance_hour_usd=3.0)
    assert facts["instances"][1]["up_at_s"] == 5.0 and facts["weight_load_s"] is None
    assert facts["cost_usd"] == pytest.approx(facts["instance_hours"] * 3.0)


def test_a_prewarmed_instance_serves_at_once_and_its_replacement_is_billed_idle(trace, tmp_path):
    facts, rows = replay(trace, tmp_path, "warm", instances=3, prewarmed=1)
    warm, spare = facts["instances"][1], facts["instances"][2]
    assert warm["started_as"] == "warm" and warm["up_at_s"] == 0.0 and warm["booted_at_s"] == 0.0
    # the request that asked for it (r1, t=0) is served there at once: no runtime start, no weights to load
    r1 = next(r for r in rows if r["request_id"] == "r1")
    assert warm["first_token_at_s"] == pytest.approx(r1["ttft_s"]) and r1["ttft_s"] < 1.0
    assert warm["time_to_first_served_s"] == pytest.approx(r1["ttft_s"])
    # its replacement booted at the same decision; the next scale-up (r2, t=12) took it while it still loaded
    assert spare["booted_at_s"] == 0.0 and spare["scaled_up_at_s"] == 12.0
    assert spare["up_at_s"] == pytest.approx(COLD_S) and spare["weights_in_at_s"] == pytest.approx(COLD_S)
    assert facts["scale_ups"] == 2 and facts["idle_prewarmed_instance_hours"] == 0.0
    end = run_end(rows)
    assert facts["instance_hours"] * 3600 == pytest.approx(3 * end)  # all three billed from t=0
    # with nothing to take it, the pre-warmed one waits loaded all run: billed, and counted idle
    facts, rows = replay(trace, tmp_path, "idle", instances=3, prewarmed=1, scale_up_load=10**6)
    assert facts["scale_ups"] == 0 and facts["instances"][2]["booted_at_s"] is None
    end = run_end(rows)
    assert facts["idle_prewarmed_instance_hours"] * 3600 == pytest.approx(end)
    assert facts["instance_hours"] * 3600 == pytest.approx(2 * end)


def test_lazy_weights_answer_when_the_last_layer_arrives_plus_its_share_of_the_prefill(trace, tmp_path):
    facts, rows = replay(trace, tmp_path, "lazy", lazy_weights=True)
    new = facts["instances"][1]
    assert new["up_at_s"] == 10.0 and new["weights_in_at_s"] == pytest.approx(COLD_S)
    engine = load_backend("engine-sim")(**OPTS)
    step = engine.latency.step_s([(PROMPT, 0)], [])  # r2's prefill, alone on the new instance
    layers = MODELS["llama3-8b"].layers
    # r2 arrived at 12 s, was routed to the loading instance (nothing queued there) and its prefill ran layer by
    # layer as the weights came: its first token came one layer's share of the prefill after the last layer
    assert new["first_token_at_s"] == pytest.approx(COLD_S + step / layers)
    r2 = next(r for r in rows if r["request_id"] == "r2")
    assert r2["ttft_s"] == pytest.approx(COLD_S + step / layers - 12.0)
    assert new["time_to_first_served_s"] == pytest.approx(COLD_S + step / layers)


def test_cold_start_options_are_checked(trace, tmp_path):
    with pytest.raises(KvbenchError, match="raise --instances"):
        replay(trace, tmp_path, "bad1", prewarmed=2)
    with pytest.raises(KvbenchError, match="add --autoscale"):
        replay(trace, tmp_path, "bad2", autoscale=None, prewarmed=1)
    with pytest.raises(KvbenchError, match="drop --cold-start-s"):
        replay(trace, tmp_path, "bad3", lazy_weights=True, cold_start_s=3.0)
