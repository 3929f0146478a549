"""The answer block that opens each report says what summary.json says, for the run's kind: real replays of
the committed sample traces, the recorded live run of tests/data/runs, and the reports they write."""

import json
import re
import shutil
from pathlib import Path

import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from kvbench.report.answer import TARGETS, answer_section, bytes_per_block, capacity_for
from kvbench.report.compare import answer_section as compare_answer
from kvbench.report.page import Table, render_markdown
from kvbench.run.comparison import compare
from kvbench.run.runner import run_replay
from tests.conftest import CHAT, SAMPLES

RUNS = Path(__file__).resolve().parents[2] / "data" / "runs"


@pytest.fixture(scope="module")
def tenants_run(tmp_path_factory):
    """Four policies and the Belady bound at two capacities, with the one-pass curve, on 62 tenants."""
    out = tmp_path_factory.mktemp("answer") / "run"
    opts = {"policy": "lru,tenant-quota,priority-lru,vllm", "capacity": "200,1000", "curve": True,
            "model": "llama3-8b"}  # fmt: skip
    run_replay(SAMPLES / "multi-tenant.parquet", "sim", opts, out=out, report=True)
    return out, json.loads((out / "summary.json").read_text())


def _table(section) -> Table:
    return next(i for i in section.items if isinstance(i, Table))


def _pct(x: float) -> str:
    return f"{100 * x:.2f}%"


def test_offline_answer_matches_summary_capacity_by_capacity(tenants_run):
    out, summary = tenants_run
    section = answer_section(summary)
    rows = {r[0].split(" blocks")[0].replace(",", ""): r for r in _table(section).rows}
    per_block = 32 * 8 * 128 * 2 * 2 * summary["trace"]["block_size"]  # llama3-8b: layers × kv heads × dim × K,V × bf16
    assert bytes_per_block(summary) == per_block
    for cap in (200, 1000):
        points = [p for p in summary["points"] if p.get("capacity_blocks") == cap]
        real = [p for p in points if p["policy"] != "belady"]
        best = max(real, key=lambda p: p["hit_rate"]["token"]["steady"])
        bound = next(p for p in points if p["policy"] == "belady")
        row = rows[str(cap)]
        assert "MiB" in row[0] or "GiB" in row[0]  # bytes under --model
        assert row[1] == best["policy"] and row[2] == _pct(best["hit_rate"]["token"]["steady"])
        assert row[3] == _pct(bound["hit_rate"]["token"]["steady"])
        gap = 100 * (bound["hit_rate"]["token"]["steady"] - best["hit_rate"]["token"]["steady"])
        assert row[4] == f"{gap:.1f} points"
        # the worst-served tenant (with enough requests to judge) under the best policy, and who serves it best
        tenants = [t for t in best["by_tenant"] if t["requests"] >= 10]
        worst = min(tenants, key=lambda t: t["hit_rate"])
        assert row[6].startswith(worst["name"] + " ")
        theirs = {p["policy"]: next(t["hit_rate"] for t in p["by_tenant"] if t["name"] == worst["name"]) for p in real}
        assert row[7].split(" ")[0] in {k for k, v in theirs.items() if v == max(theirs.values())}


def test_capacity_for_a_share_of_the_bound_is_read_off_the_curve(tenants_run):
    _, summary = tenants_run
    inf = summary["infinite_cache"]["token"]["steady"]
    curve = next(c for c in summary["curves"] if c["policy"] == "lru")
    for share in TARGETS:
        policy, blocks, how = capacity_for(summary, share)
        if blocks is None:
            assert max(curve["token_steady"]) < share * inf
            continue
        # no capacity of any curve or any swept point below `blocks` reaches the target
        reach = [cap for cap, h in zip(curve["capacity_blocks"], curve["token_steady"]) if h >= share * inf]
        swept = [p["capacity_blocks"] for p in summary["points"] if p.get("policy") not in (None, "belady")
                 and "capacity_blocks" in p and p["hit_rate"]["token"]["steady"] >= share * inf]  # fmt: skip
        assert blocks == min(reach + swept)


def test_the_report_opens_with_the_answer_and_a_readable_configuration(tenants_run):
    out, summary = tenants_run
    md = (out / "report.md").read_text()
    headings = re.findall(r"^## (.+)$", md, flags=re.M)
    assert headings[:3] == ["Answer", "Run", "Configuration"]
    config = md.split("## Configuration")[1].split("\n## ")[0]
    assert "| policies | lru, tenant-quota, priority-lru, vllm |" in config
    assert "| curve | yes |" in config
    assert not re.search(r"\[|\]|\(\)|\bTrue\b|\bFalse\b|e\+\d", config)  # no Python reprs
    assert "| capacity | 200,1000 | blocks, tokens or bytes |" in config  # the unit the option states
    answer = md.split("## Answer")[1].split("\n## ")[0]
    assert "Capacity to reach 80% of the bound" in answer


def test_a_timed_run_answers_with_throughput_latency_and_saturation(tmp_path):
    out = tmp_path / "es"
    run_replay(CHAT, "engine-sim", {"policy": "vllm,lru", "slo": "ttft=200"}, out=out, report=True)
    summary = json.loads((out / "summary.json").read_text())
    table = _table(answer_section(summary))
    assert [r[0] for r in table.rows] == [p["name"] for p in summary["points"]]
    for row, p in zip(table.rows, summary["points"]):
        lat = p["latency"]
        assert row[table.header.index("goodput")].endswith(f"({_pct(lat['goodput']['fraction'])})")
        p50 = lat["ttft"]["p50_ms"]
        unit = "ms" if p50 < 1000 else "s"
        assert row[table.header.index("TTFT p50")].endswith(unit)
        verdict = row[table.header.index("saturated")]
        assert verdict == ("not assessed" if "saturation" not in p else verdict)


def test_compare_says_what_moved_beyond_noise(tmp_path):
    shutil.copytree(RUNS / "chat40-live", tmp_path / "base")
    slower = shutil.copytree(RUNS / "chat40-live", tmp_path / "slower")
    t = pq.read_table(slower / "requests.parquet")
    t = t.set_column(t.schema.get_field_index("ttft_s"), "ttft_s", pc.add(t["ttft_s"], 1.0))
    pq.write_table(t, slower / "requests.parquet")
    summary = json.loads((slower / "summary.json").read_text())
    summary["run_id"] = "slower"
    (slower / "summary.json").write_text(json.dumps(summary))
    text = render_markdown("x", [compare_answer(compare([tmp_path / "base", slower]).result)])
    # TTFT got 1 s slower at every percentile; nothing else changed
    assert "slower:live has slower TTFT (p50 +1 s, p99 +1 s)" in text
    assert "faster" not in text
