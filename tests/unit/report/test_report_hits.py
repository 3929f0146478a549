"""Hit-rate sections of a run report on real replays: every point named in each per-point section (tenant,
workload, fairness, evictor × victim) of a multi-tenant sweep of four policies, the max/min ratio explained when
a tenant has no hit, no Jain's index without tenants, no scientific notation in report.md, the capacity plot at
full width in the policies' colours with bytes when the run names a model."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from kvbench.report import tenants
from kvbench.report.style import FULL_WIDTH, colour
from kvbench.run.runner import run_replay
from tests.browser import markdown_sections as md_sections
from tests.conftest import CHAT, SAMPLES

POLICIES = "lru,tenant-quota,priority-lru,s3fifo"


def names(text: str, point: str) -> bool:
    # whole names only: lru/300blocks is not found inside priority-lru/300blocks
    return re.search(rf"(?<![\w/.\-]){re.escape(point)}(?![\w/.\-])", text) is not None


def html_section(html: str, title: str) -> str:
    start = html.index(f">{title}</h2>")
    end = html.find("<h2", start)
    return html[start : end if end > 0 else len(html)]


@pytest.fixture(scope="module")
def tenant_run(tmp_path_factory):
    """A multi-tenant sweep: four policies at two capacities, plus the Belady bound's own capacities."""
    out = tmp_path_factory.mktemp("hits") / "mt"
    run_dir, _ = run_replay(SAMPLES / "multi-tenant.parquet", "sim", {"policy": POLICIES, "capacity": "300,1000"},
                            out=out)  # fmt: skip
    summary = json.loads((run_dir / "summary.json").read_text())
    return run_dir, summary, (run_dir / "report.md").read_text(), (run_dir / "report.html").read_text()


@pytest.fixture(scope="module")
def model_run(tmp_path_factory):
    """A single-tenant sweep with the one-pass curve and a model geometry (capacities in bytes too)."""
    out = tmp_path_factory.mktemp("hits") / "chat"
    opts = {"policy": "lru,fifo", "capacity": "200,2000", "curve": True, "model": "llama3-8b"}
    run_dir, _ = run_replay(CHAT, "sim", opts, out=out)
    return run_dir, json.loads((run_dir / "summary.json").read_text())


def test_every_point_in_each_per_point_section(tenant_run):
    _, summary, md, _ = tenant_run
    points = [p["name"] for p in summary["points"]]
    assert len({p["policy"] for p in summary["points"]}) >= 5  # the four policies and the Belady bound
    sections = md_sections(md)
    for title in ("Hit rate per point", "Hit rate by tenant", "Tenant fairness"):
        missing = [p for p in points if not names(sections[title], p)]
        assert not missing, (title, missing)
    # the tenant list is cut (62 tenants), and says by how much and where the rest is
    cut = r"\d+ tenants: the 30 with the most input tokens are shown; the remaining \d+ are in summary\.json"
    assert re.search(cut, sections["Hit rate by tenant"])
    assert "requests.parquet" in sections["Hit rate by tenant"]
    # the evictor × victim table has a row for every point that evicted anything
    evicting = [p["name"] for p in summary["points"] if tenants._matrix(p) is not None]
    table = sections["Tenant fairness"].split("Evictions by evicting and victim tenant")[1]
    assert evicting and all(names(table, p) for p in evicting)


def test_tenant_plot_has_a_panel_per_swept_capacity_in_policy_colours(tenant_run):
    _, _, _, html = tenant_run
    part = html_section(html, "Hit rate by tenant")
    assert part.count("<svg") == 1
    for title in ("300 blocks", "1,000 blocks"):
        assert title in part
    for policy in POLICIES.split(","):
        assert colour(policy) in part, policy


def test_heat_maps_keep_every_eviction_on_capped_axes(tenant_run):
    _, summary, _, html = tenant_run
    m, who = tenants._matrix(summary["points"][0])
    assert len(who) > tenants.MAX_HEAT  # 62 tenants: the axes are capped
    reduced, labels = tenants._reduced(m, who, tenants._shared_axes([(m, who)]))
    assert len(labels) == tenants.MAX_HEAT and labels[-1].startswith("other (")
    assert reduced.sum() == m.sum()
    fairness = html_section(html, "Tenant fairness")
    # one panel per policy at the chosen capacity: its title is the point's name
    label, group = tenants.chosen_group(tenants.point_groups(summary["points"]))
    assert {p["policy"] for p in group} >= set(POLICIES.split(","))
    assert fairness.count("<svg") == 1 and "'other' sums the rest" in fairness.replace("&#x27;", "'")


def test_max_min_ratio_is_explained_when_a_tenant_has_no_hit(tenant_run):
    _, summary, md, _ = tenant_run
    zero = [p for p in summary["points"] if any(g["hit_rate"] == 0 for g in p["by_tenant"])]
    assert zero, "the sample trace has tenants with a single request and no hit: the case under test"
    fairness = md_sections(md)["Tenant fairness"]
    for p in zero:
        n = sum(g["hit_rate"] == 0 for g in p["by_tenant"])
        assert re.search(rf"\| {re.escape(p['name'])} \| [\d.]+ \| undefined \({n} at 0%\) \| [\d.]+ \|", fairness)
    assert "max/min ratio undefined" in fairness and "no ratio divides by 0" in fairness
    assert "| – |" not in fairness  # no bare dash where a reason belongs


def test_no_jain_index_without_tenants(model_run):
    run_dir, summary = model_run
    assert all(p["fairness"]["tenants"] < 2 for p in summary["points"])
    md = (run_dir / "report.md").read_text()
    assert "Jain" not in md
    sections = md_sections(md)
    assert "Tenant fairness" not in sections
    assert "the trace names none" in sections["Hit rate by tenant"]


def test_no_scientific_notation_in_tables(tenant_run, model_run):
    for md in (tenant_run[2], (model_run[0] / "report.md").read_text()):
        rows = [line for line in md.splitlines() if line.startswith("|")]
        assert rows
        bad = [r for r in rows if re.search(r"\de[+-]?\d", r)]
        assert not bad, bad


def test_capacity_plot_is_full_width_with_bytes_and_one_colour_per_policy(model_run):
    run_dir, summary = model_run
    html = (run_dir / "report.html").read_text()
    part = html_section(html, "Hit rate vs capacity")
    width = float(re.search(r'<svg[^>]* width="([\d.]+)pt"', part).group(1))
    assert width >= 0.9 * FULL_WIDTH * 72  # matplotlib writes points, 72 per inch
    assert "capacity (llama3-8b, 8 MiB per block)" in part  # the bytes axis
    assert colour("lru") in part and colour("fifo") in part
    md = md_sections((run_dir / "report.md").read_text())["Hit rate vs capacity"]
    assert "| capacity (blocks) | capacity (bytes) | lru steady |" in md


def test_point_groups_put_every_point_in_one_group(tenant_run):
    _, summary, _, _ = tenant_run
    groups = tenants.point_groups(summary["points"])
    flat = [p["name"] for _, g in groups for p in g]
    assert sorted(flat) == sorted(p["name"] for p in summary["points"])
    assert all(len(g) <= max(tenants.MAX_COLUMNS, len(POLICIES.split(",")) + 1) for _, g in groups)
    # a swept capacity holds every policy run at it
    swept = dict(groups)["300 blocks"]
    assert [p["policy"] for p in swept] == [*POLICIES.split(","), "belady"]
    assert np.isfinite([p["capacity_blocks"] for p in swept]).all()
