"""The tutorials (docs/tutorials/*.md) as tests: every command of their ```bash blocks runs, in order, as
written, in a fresh folder that sees the repository's traces/, and must exit 0; then each tutorial's claims are
checked on what the commands wrote (values, not timings). A tutorial that sends to a local engine (the URLs
`kvbench engine up` gives) needs that engine: it skips without it, and fails in CI (KVBENCH_REQUIRE_ENGINES)."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from ..conftest import REPO

TUTORIALS = sorted((REPO / "docs" / "tutorials").glob("*.md"))
BLOCK = re.compile(r"```bash\n(.*?)```", re.S)
ENGINES = {"127.0.0.1:8011": "vllm", "127.0.0.1:8012": "llama"}  # URL -> the fixture of tests/integration/conftest


def commands(text: str) -> list[str]:
    """The commands of a tutorial's bash blocks, in order (a trailing backslash continues a line; comments and
    blank lines are skipped)."""
    out = []
    for block in BLOCK.findall(text):
        for line in block.replace("\\\n", " ").splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                out.append(line.strip())
    return out


def summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


def hit_rates(run: Path) -> dict[str, float]:
    return {p["name"]: p["hit_rate"]["token"]["all"] for p in summary(run)["points"]}


def check_cache_size(work: Path) -> None:
    sizes = hit_rates(work / "runs/chat-sizes")
    for cap in (250, 1000, 4000):  # the bound is the bound, and more cache never hurts LRU
        assert sizes[f"belady/{cap}blocks"] >= max(sizes[f"lru/{cap}blocks"], sizes[f"s3fifo/{cap}blocks"]) - 1e-9
    assert sizes["lru/250blocks"] <= sizes["lru/1000blocks"] <= sizes["lru/4000blocks"]
    infinite = summary(work / "runs/chat-curve")["infinite_cache"]["token"]["all"]
    assert all(v <= infinite + 1e-9 for v in sizes.values())
    assert summary(work / "runs/chat-curve")["curves"], "--curve wrote no curve"
    assert len(hit_rates(work / "runs/chat-bytes")) >= 2


def check_multi_tenant(work: Path) -> None:
    points = {p["name"]: p for p in summary(work / "runs/mt")["points"]}
    jain = {name: p["fairness"]["jain"]["hit_rate"] for name, p in points.items()}
    assert all(1 / 8 - 1e-9 <= j <= 1 + 1e-9 for j in jain.values())
    assert jain["s3fifo/300blocks"] < jain["lru/300blocks"]  # what the tutorial says of this seed
    assert "## Tenant fairness" in (work / "runs/mt/report.md").read_text()
    assert hit_rates(work / "runs/mt-nosalt")["lru/300blocks"] >= hit_rates(work / "runs/mt")["lru/300blocks"]


def check_verify_vllm(work: Path) -> None:
    s = summary(work / "runs/fidelity")
    overall = s["fidelity"]["overall"]
    assert s["complete"] and overall["ttft"]["requests"] > 0 and overall["ttft"]["mape"] >= 0


def check_compare_engines(work: Path) -> None:
    for run in ("vllm", "llama"):
        s = summary(work / "runs" / run)
        assert s["complete"] and [p["failures"]["failed"] for p in s["points"]] == [0]


def check_what_if(work: Path) -> None:
    base, pool = hit_rates(work / "runs/base"), hit_rates(work / "runs/pool")
    assert list(pool.values())[0] > list(base.values())[0]  # the store serves what the small HBM evicted
    shared, isolated = hit_rates(work / "runs/lora-shared"), hit_rates(work / "runs/lora-isolated")
    assert list(shared.values())[0] >= list(isolated.values())[0]


CHECKS = {
    "cache-size": check_cache_size,
    "multi-tenant": check_multi_tenant,
    "verify-vllm": check_verify_vllm,
    "compare-engines": check_compare_engines,
    "what-if": check_what_if,
}


def test_every_tutorial_has_its_check():
    assert {t.stem for t in TUTORIALS} == set(CHECKS)


@pytest.mark.parametrize("tutorial", TUTORIALS, ids=lambda p: p.stem)
def test_tutorial_runs_as_written(tutorial: Path, tmp_path: Path, request):
    text = tutorial.read_text()
    for url, fixture in ENGINES.items():
        if url in text:
            request.getfixturevalue(fixture)
    (tmp_path / "traces").symlink_to(REPO / "traces")
    env = {**os.environ, "NO_COLOR": "1"}
    for cmd in commands(text):
        proc = subprocess.run(cmd, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, f"{tutorial.name}: `{cmd}` exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    CHECKS[tutorial.stem](tmp_path)
