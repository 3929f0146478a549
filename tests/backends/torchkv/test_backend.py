"""The torch backend end to end on the CPU: real pools, real files, the runner's run directory."""

import json

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from kvbench.cache import policies
from kvbench.cli import main
from kvbench.run.runner import run_replay

ALL_POLICIES = [p for p in policies.registry() if p != "tenant-quota" and policies.get(p).blocks]  # (block stores)


def _replay(trace, backend, out, **options):
    run_dir, summary = run_replay(trace, backend, options, out=out, report=False)
    return summary, pq.read_table(run_dir / "requests.parquet")


def _point(table, name):
    rows = table.filter(pc.equal(table["point"], name))
    return {c: rows[c].to_numpy(zero_copy_only=False) for c in rows.column_names}


@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_hits_and_evictions_equal_the_sim_backend(sample_head, tmp_path, policy):
    trace = sample_head("chat", 300)
    caps = "400,1500"
    _, sim = _replay(trace, "sim", tmp_path / "sim", policy=policy, capacity=caps, bound=False)
    # tiers below HBM change nothing the HBM policy sees
    _, tk = _replay(trace, "torch", tmp_path / "torch", policy=policy, capacity=caps, dram_capacity="600")
    for cap in caps.split(","):
        a, b = _point(sim, f"{policy}/{cap}blocks"), _point(tk, f"{policy}/{cap}blocks")
        assert np.array_equal(a["hit_tokens"], b["hit_tokens_hbm"])
        assert np.array_equal(a["evictions"], b["evictions"])
        assert a["evictions"].sum() > 0  # the capacities are small enough to evict


def test_tenant_quota_equals_the_sim_backend(sample_head, tmp_path):
    trace = sample_head("multi-tenant", 300)
    opts = dict(policy="tenant-quota", capacity="800", quota="*=0.3")
    _, sim = _replay(trace, "sim", tmp_path / "sim", bound=False, **opts)
    _, tk = _replay(trace, "torch", tmp_path / "torch", **opts)
    a, b = _point(sim, "tenant-quota/800blocks"), _point(tk, "tenant-quota/800blocks")
    assert np.array_equal(a["hit_tokens"], b["hit_tokens_hbm"]) and np.array_equal(a["evictions"], b["evictions"])


@pytest.mark.parametrize("write_through", [False, True])
@pytest.mark.parametrize("mode", ["block", "coalesced", "staged"])
def test_tiers_return_every_block_intact(sample_head, tmp_path, write_through, mode):
    """Tiny HBM, DRAM and disk: blocks go down and come back all the time; every load is checksummed."""
    summary, table = _replay(
        sample_head("chat", 300),
        "torch",
        tmp_path,
        capacity="300",
        dram_capacity="500",
        ssd_capacity="1500",
        disk_dir=str(tmp_path),
        write_through=write_through,
        copy_mode=mode,
        verify=True,
    )
    facts = summary["points"][0]["torch"]
    assert facts["verify"]["checked"] > 500 and facts["verify"]["mismatches"] == 0
    assert facts["blocks"]["dram_hits"] > 0 and facts["blocks"]["ssd_hits"] > 0
    rows = _point(table, "lru/300blocks")
    assert rows["hit_tokens_dram"].sum() > 0 and rows["hit_tokens_ssd"].sum() > 0
    moved = facts["transfers"]
    for direction in ("hbm->dram", "dram->ssd", "dram->hbm", "ssd->hbm"):
        assert moved[direction]["bytes"] > 0 and moved[direction]["gb_per_s"] > 0
        assert moved[direction]["vs_baseline"] > 0 and moved[direction]["vs_peak"] > 0
    assert list(tmp_path.glob("kvbench-ssd-*.kv")) == []  # the disk tier's file is removed at the end


def test_write_through_writes_more_than_write_back(sample_head, tmp_path):
    written = {}
    for wt in (False, True):
        summary, _ = _replay(sample_head("chat", 300), "torch", tmp_path / str(wt), capacity="300",
                             dram_capacity="5000", write_through=wt)  # fmt: skip
        facts = summary["points"][0]["torch"]
        written[wt] = facts["blocks"]["written"]["dram"]
        assert facts["transfers"]["hbm->dram"]["blocks"] == written[wt]
    assert written[True] > written[False] > 0


def test_a_request_never_finds_below_hbm_what_it_evicted_itself(sample_head, tmp_path):
    """With a cache smaller than one prompt, a request pushes its own first blocks down to DRAM; finding them
    there would count blocks never computed as hits."""
    _, table = _replay(sample_head("chat", 40), "torch", tmp_path, capacity="8", dram_capacity="100000", verify=True)
    rows = _point(table, "lru/8blocks")
    assert rows["input_tokens"][0] > 8 * 64  # longer than the whole HBM pool
    assert rows["hit_tokens"][0] == 0  # the very first request can hit nothing anywhere


def test_compute_skips_the_cached_prefix(sample_head, tmp_path):
    """Measured TTFT falls with the hit rate because cached tokens are not computed: counted, not timed."""
    trace = sample_head("chat", 60)
    computed = {}
    for cap in ("100", "100000"):
        summary, table = _replay(trace, "torch", tmp_path / cap, capacity=cap, compute=True, decode_steps="2")
        rows = _point(table, f"lru/{cap}blocks")
        expected = np.maximum(rows["input_tokens"] - rows["hit_tokens"], 1)
        assert np.array_equal(rows["prefill_tokens"], expected)
        assert np.all(rows["ttft_s"] > 0) and np.all(np.isfinite(rows["ttft_s"]))
        multi = rows["output_tokens"] > 1
        assert np.all(rows["tpot_s"][multi] > 0)
        lat = summary["points"][0]["latency"]
        assert lat["ttft"]["p50_ms"] > 0 and lat["tpot"]["p50_ms"] > 0
        computed[cap] = rows["prefill_tokens"].sum()
    assert computed["100000"] < computed["100"]


def test_every_decode_step_timed_gives_itls(sample_head, tmp_path):
    _, table = _replay(sample_head("chat", 5), "torch", tmp_path, capacity="1000", compute=True, decode_steps="all")
    rows = _point(table, "lru/1000blocks")
    for n_out, itl in zip(rows["output_tokens"], rows["itl_s"]):
        assert len(itl) == n_out - 1


def test_cli_replay_and_errors(sample_head, tmp_path):
    runner = CliRunner()
    trace = str(sample_head("chat", 50))
    out = tmp_path / "run"
    res = runner.invoke(main, ["replay", trace, "--backend", "torch", "--capacity", "2MiB", "--out", str(out)])
    assert res.exit_code == 0, res.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["backend"] == "torch" and summary["config"]["device"] == "cpu"
    assert summary["points"][0]["capacity_blocks"] == 2 * 2**20 // (1024 * 64)  # kvbench-tiny fp32: 1 KiB/token
    assert "KV transfers" in (out / "report.md").read_text()
    bad = runner.invoke(main, ["replay", trace, "--backend", "torch", "--capacity", "100", "--decode-steps", "x"])
    assert bad.exit_code != 0 and "--decode-steps" in bad.output and "Traceback" not in bad.output
    help_text = runner.invoke(main, ["replay", "--backend", "torch", "--help"]).output
    for flag in ("--dram-capacity", "--ssd-capacity", "--copy-mode", "--compute", "--layout"):
        assert flag in help_text


def test_computed_kv_survives_the_tiers(sample_head, tmp_path):
    """Compute on: the KV a prefill wrote goes down to DRAM and disk and comes back bit for bit."""
    summary, table = _replay(
        sample_head("chat", 80),
        "torch",
        tmp_path,
        model="kvbench-micro",
        capacity="100",
        dram_capacity="200",
        ssd_capacity="2000",
        disk_dir=str(tmp_path),
        compute=True,
        decode_steps="1",
        verify=True,
    )
    facts = summary["points"][0]["torch"]
    assert facts["verify"]["checked"] > 100 and facts["verify"]["mismatches"] == 0
    rows = _point(table, "lru/100blocks")
    assert np.array_equal(rows["prefill_tokens"], np.maximum(rows["input_tokens"] - rows["hit_tokens"], 1))
