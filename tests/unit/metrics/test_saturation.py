"""Saturation (kvbench/metrics/saturation.py, docs/semantics.md): real replays — engine-sim on a sample trace at
its own pace and squeezed into a fraction of its time, a live replay against a server slower than its
schedule — say saturated or not, from when, and the engine-sim demo deployment serves every workload."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from kvbench.metrics.saturation import describe, saturation
from kvbench.run.limits import RequestLimits
from kvbench.run.runner import run_replay
from kvbench.trace.files import read_trace, write_trace
from tests.conftest import CHAT
from tests.unit.live.conftest import fake_server  # noqa: F401  (the fixture, for the live test)

CAP16 = RequestLimits(max_output_tokens=16)

REQUESTS = 400  # of the chat sample: enough bins for a trend, a second or two of engine-sim


def _chat(tmp_path, squeeze: float):
    """The chat sample's first REQUESTS requests, arrivals divided by `squeeze` (1: as recorded)."""
    table, meta = read_trace(CHAT)
    table = table.slice(0, REQUESTS)
    i = table.schema.get_field_index("arrival_s")
    arrival = pa.array(table.column("arrival_s").to_numpy() / squeeze, pa.float64())
    path = tmp_path / f"chat-x{squeeze:g}.parquet"
    write_trace(table.set_column(i, table.schema.field(i), arrival), path, meta)
    return path, float(arrival.to_numpy().max())


def _replay(path, out, **options):
    run_dir, summary = run_replay(path, "engine-sim", {"policy": "vllm", **options}, out=out, report=False)
    (point,) = summary["points"]
    return point


def test_one_instance_serves_the_chat_sample_at_its_own_pace(tmp_path):
    path, _ = _chat(tmp_path, 1)
    v = _replay(path, tmp_path / "paced")["saturation"]
    assert v["saturated"] is False and v["from_s"] is None
    # a deployment that keeps up completes what arrives: served within a few percent of offered
    assert v["served_rps"] == pytest.approx(v["offered_rps"], rel=0.1)
    assert describe(v).startswith("not saturated: offered")


def test_the_same_requests_squeezed_into_a_fiftieth_of_the_time_saturate_it(tmp_path):
    path, span = _chat(tmp_path, 50)
    point = _replay(path, tmp_path / "squeezed")
    v = point["saturation"]
    assert v["saturated"] is True
    assert 0 <= v["from_s"] < span  # the queue began growing during the run, not after it
    assert v["served_rps"] < 0.8 * v["offered_rps"]
    assert v["late_delay_s"] > v["early_delay_s"] + v["queue_growth_s"] / 2
    assert v["offered_input_tps"] > 0 and "did not recover" in v["why"]
    assert describe(v).startswith("saturated from t = ") and "served" in describe(v)
    # the report's section: one row, its verdict and rates in units, and the delay plot of a saturated point
    from kvbench.report.page import Figure, Table
    from kvbench.report.saturation import saturation_section

    section = saturation_section({"points": [point]})
    (table,) = [i for i in section.items if isinstance(i, Table)]
    assert table.rows[0][:2] == [point["name"], "saturated"] and table.rows[0][3].endswith(" req/s")
    assert any(isinstance(i, Figure) and "<svg" in i.svg for i in section.items)
    assert saturation_section({"points": [{"name": "lru/1000blocks"}]}).items == []
    # the deployment the roofline sizes for this load (demo_options) has more instances, and keeps up
    from kvbench.run.plugins import load_backend

    options = load_backend("engine-sim").demo_options(*read_trace(path))
    assert options["instances"] > 1
    relieved = _replay(path, tmp_path / "more", **options)["saturation"]
    assert relieved["saturated"] is False, relieved["why"]


def test_an_offline_simulation_has_no_verdict(tmp_path):
    path, _ = _chat(tmp_path, 1)
    _, summary = run_replay(path, "sim", {"policy": "lru", "capacity": "1000"}, out=tmp_path / "sim", report=False)
    assert all("saturation" not in p for p in summary["points"])


def test_a_live_run_faster_than_the_server_is_saturated_and_a_slow_one_is_not(fake_server, tmp_path):  # noqa: F811
    srv = fake_server(itl_ms=2.0)  # 16 tokens each: ~35 ms a request, one at a time below
    fast = {"url": srv.url, "mode": "rate", "rate": 500.0, "max_requests": 60}
    one_at_a_time = {**fast, "max_concurrency": 1}
    _, summary = run_replay(CHAT, "openai", one_at_a_time, out=tmp_path / "fast", report=False, limits=CAP16)
    v = summary["points"][0]["saturation"]
    assert v["saturated"] is True and v["signal"] == "schedule lag + ttft_s"
    assert v["served_rps"] < v["offered_rps"] / 3
    span = 60 / 500.0 * 3  # the schedule's length, generously (gamma gaps)
    assert 0 <= v["from_s"] <= span
    slow = {**fast, "rate": 10.0, "max_requests": 16}
    _, summary = run_replay(CHAT, "openai", slow, out=tmp_path / "slow", report=False, limits=CAP16)
    assert summary["points"][0]["saturation"]["saturated"] is False


def test_the_verdict_from_columns_alone():
    """The rule on made-up columns: a queue growing linearly from the middle of the run."""
    n = 200
    t = np.linspace(0, 100, n)
    queue = np.where(t < 50, 0.01, (t - 50) * 2.0)
    cols = {"scheduled_send_s": t, "actual_send_s": t, "queue_s": queue, "e2el_s": queue + 1.0, "status": ["ok"] * n}
    v = saturation(cols, np.full(n, 100))
    assert v["saturated"] and 45 <= v["from_s"] <= 60 and v["offered_input_tps"] == pytest.approx(200.0, rel=0.01)
    # a burst that the deployment works off before the end is no saturation
    burst = np.where((t > 40) & (t < 70), 30.0, 0.01)
    cols = {**cols, "queue_s": burst, "e2el_s": burst + 1.0}
    assert saturation(cols)["saturated"] is False
    assert saturation({"hit_blocks": np.zeros(3)}) is None


@pytest.mark.parametrize("workload", ["chat", "agent", "reasoning", "multi-tenant", "multimodal", "mix"])
def test_demo_options_give_a_deployment_that_serves_each_generated_workload(tmp_path, workload):
    from kvbench.run.plugins import load_backend
    from kvbench.trace import generators

    table, meta = generators.registry()[workload].run(300, seed=1)
    path = tmp_path / f"{workload}.parquet"
    write_trace(table, path, meta)
    options = load_backend("engine-sim").demo_options(table, meta)
    assert options["instances"] >= 1
    _, summary = run_replay(path, "engine-sim", options, out=tmp_path / "run", report=False)
    v = summary["points"][0]["saturation"]
    assert v["saturated"] is False, v["why"]


def test_a_workload_that_drowns_under_a_served_majority_is_the_verdict():
    """Nine chat requests in ten admitted at once, the tenth (reasoning) queueing ever longer: the median
    request sees no queue, the reasoning pool is saturated, and the verdict says which workload."""
    n = 400
    t = np.linspace(0, 400, n)
    reasoning = np.arange(n) % 10 == 0
    queue = np.where(reasoning, t * 0.5, 0.01)
    cols = {"scheduled_send_s": t, "actual_send_s": t, "queue_s": queue, "e2el_s": queue + 2.0, "status": ["ok"] * n}
    v = saturation(cols, None, np.where(reasoning, "reasoning", "chat").tolist())
    assert v["saturated"] and v["workload"] == "reasoning" and v["all"]["saturated"] is False
    assert v["by_workload"]["chat"]["saturated"] is False and 0 <= v["from_s"] < 400
    assert "(reasoning requests)" in describe(v) and v["why"].startswith("reasoning requests: ")


def test_the_live_demo_cuts_every_workload_to_the_engine_context_keeping_shared_prefixes(tmp_path):
    """`demo --live` replays all five kinds: the agent trace's prompts (all longer than a tiny CPU model's
    8192-token context) keep their leading whole blocks, so requests still share what they shared."""
    from kvbench.cli.demo_run import LIVE_OUTPUT_TOKENS, live_subset
    from kvbench.trace import generators
    from kvbench.trace.validation import check

    for kind, gen in generators.registry().items():
        table, meta = gen.run(60, seed=1)
        sub, cut = live_subset(table, 8192, 40, meta.block_size)
        check(sub, meta.block_size, kind)
        assert sub.num_rows == 40
        assert max(sub.column("input_tokens").to_pylist()) + LIVE_OUTPUT_TOKENS <= 8192
        before, after = table.slice(0, 40).column("block_hashes").to_pylist(), sub.column("block_hashes").to_pylist()
        assert all(a == b[: len(a)] for a, b in zip(after, before))  # a prefix of the original, always
        if kind == "agent":
            assert cut == 40
            firsts = [h[0] for h in after]
            assert len(set(firsts)) < len(firsts)  # requests still share leading blocks


def test_the_terminal_says_saturated_from_when_with_both_rates(capsys):
    from kvbench.cli.replay import _print_points

    n = 200
    t = np.linspace(0, 1000, n)
    queue = np.where(t < 500, 0.0, (t - 500) * 3.0)
    cols = {"scheduled_send_s": t, "actual_send_s": t, "queue_s": queue, "e2el_s": queue + 1.0, "status": ["ok"] * n}
    point = {"name": "vllm/1instances", "hit_rate": {"token": {"all": 0.5, "steady": 0.5}}}
    _print_points({"points": [{**point, "saturation": saturation(cols)}, point], "curves": []})
    lines = capsys.readouterr().out.splitlines()
    (load,) = [line for line in lines if line.strip().startswith("load:")]  # the point without timing: none
    assert "load: saturated from t = " in load and " s: offered " in load and "req/s, served " in load
