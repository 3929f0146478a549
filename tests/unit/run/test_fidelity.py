"""kvbench.run.fidelity on two requests.parquet files written by hand, every expected number worked out by hand
(below), and the Markdown/HTML rendering of the table with its off-target cells.

Live run, rows stored out of send order (skipping must go by send time, not row order):

    id  sent  workload tenant out status  TTFT  TPOT  E2EL  cached | modeled TTFT  TPOT  E2EL  hit
    r0  0.0   chat     a      10  ok      1.0   0.10  2.0   0      |         1.6   0.10  2.0   0
    r4  0.5   agent    a      10  error   -     -     -     -      |         100   1.0   200   0   (failed live)
    r1  1.0   chat     a      10  ok      1.0   0.10  2.0   32     |         1.3   0.08  2.2   32
    r2  2.0   chat     b       1  ok      2.0   0.50  2.5   16     |         1.0   5.0   2.0   0   (1 token: no TPOT)
    r3  3.0   agent    b       5  ok      4.0   0.20  5.0   64     |         4.4   0.25  4.0   64
    r5  5.0   agent    a      10  ok      1.0   0.10  2.0   0      |         (not modeled)
                                                                   r6 modeled only

Counted: r0 r1 r2 r3. TTFT APE .6 .3 .5 .1 -> MAPE .375; ratios 1.6 1.3 .5 1.1 -> median 1.2; p90 APE of
(.1 .3 .5 .6) at position 2.7 -> .5 + .7 * .1 = .57; mean ratio 8.3 / 8. TPOT (r0 r1 r3) APE 0 .2 .25 -> .15,
ratios 1 .8 1.25 -> 1.0. E2EL APE 0 .1 .2 .2 -> .125, ratios 1 1.1 .8 .8 -> .9. Cached exact 3/4 (r2 is not),
measured 112, modeled 96.
"""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kvbench.errors import KvbenchError
from kvbench.report.fidelity import fidelity_html, fidelity_markdown, off_target
from kvbench.run import fidelity as F
from kvbench.run.fidelity import fidelity, format_rows, join, rows

NaN = math.nan
LIVE_ROWS = [  # request_id, sent, workload, tenant, output_tokens, status, ttft, tpot, e2el, cached
    ("r3", 3.0, "agent", "b", 5, "ok", 4.0, 0.20, 5.0, 64),
    ("r1", 1.0, "chat", "a", 10, "ok", 1.0, 0.10, 2.0, 32),
    ("r0", 0.0, "chat", "a", 10, "ok", 1.0, 0.10, 2.0, 0),
    ("r5", 5.0, "agent", "a", 10, "ok", 1.0, 0.10, 2.0, 0),
    ("r2", 2.0, "chat", "b", 1, "ok", 2.0, 0.50, 2.5, 16),
    ("r4", 0.5, "agent", "a", 10, "error", NaN, NaN, NaN, None),
]
MODEL_ROWS = [  # request_id, workload, tenant, output_tokens, ttft, tpot, e2el, hit_tokens
    ("r0", "chat", "a", 10, 1.6, 0.10, 2.0, 0),
    ("r1", "chat", "a", 10, 1.3, 0.08, 2.2, 32),
    ("r2", "chat", "b", 1, 1.0, 5.0, 2.0, 0),
    ("r3", "agent", "b", 5, 4.4, 0.25, 4.0, 64),
    ("r4", "agent", "a", 10, 100.0, 1.0, 200.0, 0),
    ("r6", "chat", "a", 10, 1.0, 0.1, 2.0, 0),
]


def _live_table() -> pa.Table:
    cols = list(zip(*LIVE_ROWS))
    return pa.table({
        "point": ["live"] * len(LIVE_ROWS),
        "request_id": list(cols[0]),
        "actual_send_s": pa.array(cols[1], pa.float64()),
        "workload": list(cols[2]),
        "tenant": list(cols[3]),
        "output_tokens": pa.array(cols[4], pa.int32()),
        "status": list(cols[5]),
        "ttft_s": pa.array(cols[6], pa.float64()),
        "tpot_s": pa.array(cols[7], pa.float64()),
        "e2el_s": pa.array(cols[8], pa.float64()),
        "cached_tokens": pa.array(cols[9], pa.int32()),
    })  # fmt: skip


def _model_table(status: str | None = "ok", point: str = "engine-sim/model") -> pa.Table:
    cols = list(zip(*MODEL_ROWS))
    return pa.table({
        "point": [point] * len(MODEL_ROWS),
        "request_id": list(cols[0]),
        "workload": list(cols[1]),
        "tenant": list(cols[2]),
        "output_tokens": pa.array(cols[3], pa.int32()),
        "status": pa.array([status] * len(MODEL_ROWS), pa.string()),
        "ttft_s": pa.array(cols[4], pa.float64()),
        "tpot_s": pa.array(cols[5], pa.float64()),
        "e2el_s": pa.array(cols[6], pa.float64()),
        "hit_tokens": pa.array(cols[7], pa.int32()),
    })  # fmt: skip


@pytest.fixture
def tables(tmp_path):
    """The two runs as real requests.parquet files, read back as `kvbench fidelity` and compare read them."""
    pq.write_table(_live_table(), tmp_path / "live.parquet")
    pq.write_table(_model_table(), tmp_path / "model.parquet")
    return pq.read_table(tmp_path / "live.parquet"), pq.read_table(tmp_path / "model.parquet")


def approx(x):
    return pytest.approx(x, abs=1e-12)


def test_overall_errors_by_hand(tables):
    t = fidelity(*tables)
    assert t["skipped_first"] == 0
    e = t["overall"]
    assert e["requests"] == 4  # r4 failed live, r5 not modeled, r6 not measured
    ttft = e["ttft"]
    assert ttft["requests"] == 4
    assert ttft["mape"] == approx(0.375)
    assert ttft["median_ratio"] == approx(1.2)
    assert ttft["p90_ape"] == approx(0.57)
    assert ttft["mean_ratio"] == approx(8.3 / 8)
    assert ttft["measured_mean_s"] == approx(2.0) and ttft["modeled_mean_s"] == approx(8.3 / 4)
    # r2 asked for one output token: its TPOT (ten times off) is left out
    assert e["tpot"]["requests"] == 3
    assert e["tpot"]["mape"] == approx(0.15) and e["tpot"]["median_ratio"] == approx(1.0)
    assert e["e2el"]["requests"] == 4
    assert e["e2el"]["mape"] == approx(0.125) and e["e2el"]["median_ratio"] == approx(0.9)
    assert e["cached_tokens"] == {"requests": 4, "exact": 3, "exact_share": 0.75, "measured": 112, "modeled": 96}


def test_by_workload_and_tenant(tables):
    t = fidelity(*tables)
    chat, agent = t["by_workload"]["chat"], t["by_workload"]["agent"]
    assert set(t["by_workload"]) == {"chat", "agent"}
    assert chat["requests"] == 3 and chat["ttft"]["mape"] == approx(1.4 / 3)
    assert chat["ttft"]["median_ratio"] == approx(1.3)
    assert chat["tpot"]["requests"] == 2 and chat["tpot"]["mape"] == approx(0.1)  # r0 0, r1 .2
    assert chat["cached_tokens"]["exact"] == 2
    assert agent["requests"] == 1 and agent["ttft"]["mape"] == approx(0.1)
    assert agent["e2el"]["median_ratio"] == approx(0.8)
    a, b = t["by_tenant"]["a"], t["by_tenant"]["b"]
    assert a["requests"] == 2 and a["ttft"]["mape"] == approx(0.45) and a["ttft"]["median_ratio"] == approx(1.45)
    assert a["e2el"]["mape"] == approx(0.05) and a["cached_tokens"]["exact"] == 2
    assert b["requests"] == 2 and b["ttft"]["mape"] == approx(0.3) and b["ttft"]["median_ratio"] == approx(0.8)
    assert b["tpot"]["requests"] == 1 and b["tpot"]["mape"] == approx(0.25)
    assert b["e2el"]["mape"] == approx(0.2) and b["cached_tokens"] == {
        "requests": 2, "exact": 1, "exact_share": 0.5, "measured": 80, "modeled": 64,
    }  # fmt: skip
    assert [label for label, _ in rows(t)] == ["all", "workload agent", "workload chat", "tenant a", "tenant b"]


def test_skip_first_goes_by_send_time_failed_requests_included(tables):
    one = fidelity(*tables, skip=1)  # r0, the first sent (third row stored)
    assert one["skipped_first"] == 1 and one["overall"]["requests"] == 3
    assert one["overall"]["ttft"]["mape"] == approx(0.3)  # r1 .3, r2 .5, r3 .1
    assert one["overall"]["ttft"]["median_ratio"] == approx(1.1)
    assert one["overall"]["ttft"]["p90_ape"] == approx(0.46)  # (.1 .3 .5) at position 1.8
    assert one["overall"]["e2el"]["mape"] == approx(0.5 / 3)
    assert one["overall"]["cached_tokens"]["exact"] == 2
    # the second sent is r4, which failed: skipping it leaves the same requests
    two = fidelity(*tables, skip=2)
    assert two["overall"] == one["overall"]
    three = fidelity(*tables, skip=3)  # r1 goes too
    assert three["overall"]["requests"] == 2 and three["overall"]["ttft"]["mape"] == approx(0.3)
    assert set(join(*tables, skip=3)["request_id"]) == {"r2", "r3"}


def test_sim_rows_with_null_status_count_and_unreported_cached_tokens_are_not_judged(tables):
    live, model = tables
    sim = _model_table(status=None)  # the sim backend leaves status null
    assert fidelity(live, sim)["overall"] == fidelity(live, model)["overall"]
    i = live.schema.get_field_index("cached_tokens")
    unreported = live.set_column(i, "cached_tokens", pa.array([64, None, 0, 0, 16, None], pa.int32()))  # r1 null
    c = fidelity(unreported, model)["overall"]["cached_tokens"]
    assert c == {"requests": 3, "exact": 2, "exact_share": 2 / 3, "measured": 80, "modeled": 64}


def test_nothing_in_common_and_several_points_are_errors(tables):
    live, model = tables
    strangers = model.set_column(1, "request_id", pa.array([f"x{i}" for i in range(model.num_rows)]))
    with pytest.raises(KvbenchError, match="no request in common"):
        fidelity(live, strangers)
    two_points = pa.concat_tables([model, _model_table(point="engine-sim/other")])
    with pytest.raises(KvbenchError, match="split by point"):
        fidelity(live, two_points)


def test_rendered_table_highlights_what_misses_the_targets(tables):
    t = fidelity(*tables)
    header, body = format_rows(t)
    assert body[0] == ["all", "4", "37.5%", "1.200", "57.0%", "15.0%", "1.000", "12.5%", "0.900", "3/4"]
    flags = dict(zip((r[0] for r in body), off_target(t)))
    col = {h: i for i, h in enumerate(header)}
    assert flags["all"][col["TTFT MAPE"]] and flags["all"][col["TTFT ratio"]] and flags["all"][col["E2EL MAPE"]]
    assert not flags["all"][col["TPOT ratio"]] and not flags["all"][col["E2EL ratio"]]
    assert not flags["all"][col["TTFT p90 APE"]] and not flags["all"][col["TPOT MAPE"]]  # no target for these
    assert not flags["tenant a"][col["E2EL MAPE"]] and flags["tenant b"][col["TTFT ratio"]]  # 5% ok; 0.8 off
    md = fidelity_markdown(t)
    assert "| all | 4 | **37.5%** | **1.200** | 57.0% | 15.0% | 1.000 | **12.5%** | 0.900 | 3/4 |" in md
    page = fidelity_html(t)
    assert "<td class='off'" in page and page.count("class='off'") == sum(map(sum, off_target(t)))
    assert "<td>1.000</td>" in page
    for text in (md, page):
        assert "TTFT MAPE ≤ 20%" in text and "E2EL MAPE ≤ 10%" in text and "0.85–1.15" in text
        assert "22.8% TTFT and 11.8% E2E MAPE over 38 vLLM experiments" in text


def test_a_stream_that_came_in_one_burst_counts_for_e2el_only():
    """Nine streams at 10 ms a token and one whose 20 tokens all arrived within 0.1 ms (a starved client): the
    burst's TTFT and TPOT say when it was flushed, so they stay out of those errors; its E2EL still counts."""
    n = 10
    live_ttft = np.full(n, 0.1)
    live_tpot = np.full(n, 0.01)
    live_tpot[3], live_ttft[3] = 0.1e-3 / 19, 0.29  # tokens 1..20 within 0.1 ms, at 0.29 s
    j = {
        "output_tokens": np.full(n, 20),
        "live_ttft_s": live_ttft, "model_ttft_s": np.full(n, 0.1),
        "live_tpot_s": live_tpot, "model_tpot_s": np.full(n, 0.01),
        "live_e2el_s": live_ttft + 19 * live_tpot, "model_e2el_s": np.full(n, 0.29),
        "cached_tokens": None, "hit_tokens": None,
    }  # fmt: skip
    assert F.bursts(j).tolist() == [i == 3 for i in range(n)]
    e = F._errors(j, np.ones(n, dtype=bool))
    assert e["burst_streams"] == 1 and e["ttft"]["requests"] == e["tpot"]["requests"] == 9 == n - 1
    assert e["ttft"]["mape"] == 0 and e["tpot"]["mape"] == pytest.approx(0)
    assert e["e2el"]["requests"] == n and e["e2el"]["mape"] == pytest.approx(0, abs=1e-3)
