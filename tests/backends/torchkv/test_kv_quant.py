"""KV quantization (docs/kv-quantization.md): quantizers against hand arithmetic, bytes per token with scale
overhead, the mixed policy's bytes, the generative K/V's prefix sharing, and `kvbench experiment kv-quant` end to
end on a sample's head, with its refusals."""

from __future__ import annotations

import json
from fractions import Fraction

import pytest
import torch
from click.testing import CliRunner
from kvbench.backends.torchkv.kv_quant_report import write_reports
from kvbench.backends.torchkv.quantization import (
    FORMATS,
    MixedPolicy,
    bytes_per_token,
    check_group,
    grouped,
    quantize,
)
from kvbench.backends.torchkv.synthetic_kv import SyntheticKv, attention, relative_error

from kvbench.cli import main
from kvbench.errors import KvbenchError
from kvbench.models import KV_DTYPE_BYTES, MODELS
from kvbench.run.runner import run_replay


def test_int4_group_by_hand():
    # min -1, max 2.75: scale (2.75 + 1) / 15 = 0.25 (exact in fp16); q = round((x + 1) / 0.25) = 0, 4 (4.4),
    # 6 (6.2), 15 → x' = -1, 0, 0.5, 2.75. Second group: min 0, max 15, scale 1: integers come back exactly.
    x = torch.tensor([[-1.0, 0.1, 0.55, 2.75], [0.0, 7.0, 3.0, 15.0]])
    assert quantize(x, "int4", 4).tolist() == [[-1.0, 0.0, 0.5, 2.75], [0.0, 7.0, 3.0, 15.0]]


def test_int2_and_int8_by_hand():
    # int2: 3 levels above the min; [0, 0.4, 1, 3] has scale 1, so q = 0, 0 (0.4), 1, 3
    assert quantize(torch.tensor([0.0, 0.4, 1.0, 3.0]), "int2", 4).tolist() == [0.0, 0.0, 1.0, 3.0]
    # int8: [0, 255] has scale 1: every integer survives, 100.4 rounds to 100
    assert quantize(torch.tensor([0.0, 100.4, 17.0, 255.0]), "int8", 4).tolist() == [0.0, 100.0, 17.0, 255.0]


def test_fp4_grid_by_hand():
    # max |x| = 6 → scale 1: each value to the nearest of ±{0, .5, 1, 1.5, 2, 3, 4, 6}, halfway to the even mantissa
    x = torch.tensor([6.0, 3.0, -1.5, 0.2, 5.0, 0.75, 2.5, -0.3])
    want = [6.0, 3.0, -1.5, 0.0, 4.0, 1.0, 2.0, -0.5]
    assert quantize(x, "fp4", 8).tolist() == want
    # the same group doubled: scale 2, the same grid points doubled
    assert quantize(2 * x, "fp4", 8).tolist() == [2 * w for w in want]


def test_fp8_by_hand():
    # max |x| = 448 → scale 1; e4m3 spacing is 2 between 16 and 32, so 17 (halfway) goes to the even 16
    assert quantize(torch.tensor([448.0, 17.0, -2.0, 0.5]), "fp8", 4).tolist() == [448.0, 16.0, -2.0, 0.5]


def test_bytes_per_token_by_hand():
    # Llama-3-8B: 32 layers × 2 × 8 KV heads × 128 = 65,536 elements a token; groups of 32 elements
    m, e = MODELS["llama3-8b"], 65_536
    want = {"bf16": 2 * e, "fp8": e * (1 + 2 / 32), "int8": e * (1 + 4 / 32), "fp4": e * (0.5 + 2 / 32),
            "int4": e * (0.5 + 4 / 32), "int2": e * (0.25 + 4 / 32)}  # fmt: skip
    assert {n: bytes_per_token(m, f, 32) for n, f in FORMATS.items()} == want
    assert want["int4"] == 40_960 and want["int2"] == 24_576
    # without the per-group metadata, what --kv-dtype already assumes (kvbench.cache.capacity)
    for name, f in FORMATS.items():
        overhead = e * Fraction(f.stored_per_group, 32)
        assert bytes_per_token(m, f, 32) - overhead == m.kv_bytes_per_token(name) == e * KV_DTYPE_BYTES[name]


def test_mixed_policy_bytes_by_hand():
    # kvbench-micro: 1 layer × 2 × 1 head × 16 = 32 elements a token; groups of 16: int4 32 × (1/2 + 4/16) = 24 B,
    # int2 32 × (1/4 + 4/16) = 16 B. Blocks of 64, old after 256 tokens: at 1000 tokens (1000 - 256) // 64 = 11
    # blocks = 704 tokens are old; at 200 tokens none.
    p = MixedPolicy(FORMATS["int4"], FORMATS["int2"], 256, 64)
    assert p.old_tokens(1000) == 704 and p.old_tokens(200) == 0 and p.old_tokens(256 + 64) == 64
    got = p.bytes_per_token(MODELS["kvbench-micro"], 16, [1000, 200])
    assert got == Fraction(704 * 16 + 296 * 24 + 200 * 24, 1200)
    mask = p.old_mask(torch.tensor([1000, 200]), 1000)
    assert mask.sum(dim=1).tolist() == [704, 0] and mask[0, :704].all()


def test_error_falls_with_bits_on_the_same_data():
    kv = SyntheticKv(MODELS["kvbench-tiny"], 16, seed=3)
    k, v = kv.sequence(list(range(100, 140)), 300, "r", 600, 0)
    q = kv.queries("r", torch.arange(300, 600, 30), 0)
    lengths = torch.arange(300, 600, 30) + 1
    ref = attention(q, grouped(k, "bf16", 16, "channel"), grouped(v, "bf16", 16, "token"), lengths)

    def err(fmt):
        out = attention(q, grouped(k, fmt, 16, "channel"), grouped(v, fmt, 16, "token"), lengths)
        return relative_error(out, ref).mean().item()

    e = {f: err(f) for f in FORMATS}
    assert e["bf16"] == 0 < e["int8"] < e["int4"] < e["int2"]
    assert 0 < e["fp8"] < e["fp4"]


def test_attention_with_zero_query_averages_visible_values():
    # a zero query scores every key alike: the output is the mean of the values it sees
    v = torch.arange(24, dtype=torch.float32).view(6, 1, 4)
    out = attention(torch.zeros(2, 2, 4), torch.randn(6, 1, 4), v, torch.tensor([2, 6]))
    assert torch.allclose(out[0, 0], v[:2, 0].mean(0)) and torch.allclose(out[1, 1], v[:, 0].mean(0))


def test_shared_prefix_gives_identical_kv():
    kv = SyntheticKv(MODELS["kvbench-tiny"], 16)
    a_k, a_v = kv.sequence([1, 2, 3, 4], 64, "a", 100, 1)
    b_k, b_v = kv.sequence([1, 2, 9, 9], 64, "b", 100, 1)
    assert torch.equal(a_k[:32], b_k[:32]) and torch.equal(a_v[:32], b_v[:32])  # blocks 1, 2 shared
    assert not torch.equal(a_k[32:48], b_k[32:48]) and not torch.equal(a_k[64:], b_k[64:])  # prompt, decode differ


def test_channel_groups_pad_without_changing_values():
    # 5 tokens in groups of 4 along tokens: tokens 0-3 are one group, token 4 a group of its own (exact in int2)
    x = torch.tensor([0.0, 1.0, 2.0, 3.0, 0.5]).view(5, 1, 1)
    assert grouped(x, "int2", 4, "channel").flatten().tolist() == [0.0, 1.0, 2.0, 3.0, 0.5]


def test_group_checks():
    check_group(32, 128, "token")
    check_group(48, 128, "channel")  # along tokens any size works
    with pytest.raises(KvbenchError, match="does not divide head_dim 128"):
        check_group(48, 128, "token")
    with pytest.raises(KvbenchError, match="at least 1 element"):
        check_group(0, 128, "channel")
    with pytest.raises(KvbenchError, match="kv-old-after-tokens"):
        MixedPolicy(FORMATS["int4"], FORMATS["int2"], -1, 64)


SMALL = ["--model", "kvbench-tiny", "--max-context", "2048", "--requests", "2", "--buckets", "2",
         "--queries-per-bucket", "2", "--age-parts", "2", "--no-plots"]  # fmt: skip


def test_cli_end_to_end(sample_head, tmp_path, monkeypatch):
    trace = sample_head("chat", 300)
    monkeypatch.chdir(tmp_path)
    args = ["experiment", "kv-quant", str(trace), "--memory", "1MiB", "--kv-dtypes", "bf16,int8,int4,int2",
            "--kv-dtype-old", "int2", "--kv-old-after-tokens", "128", *SMALL]  # fmt: skip
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    runs = sorted((tmp_path / "reports").iterdir())
    result = json.loads((runs[0] / "kv_quant.json").read_text())
    rows = {r["label"]: r for r in result["table"]}
    # kvbench-tiny: 2 layers × 2 × 2 heads × 32 = 256 elements a token; 64-token blocks; 1 MiB = 1,048,576 B.
    # bf16 512 B/token → 32,768 B a block → 32 blocks; int4 (groups of 32) 256 × 0.625 = 160 B → 102 blocks
    assert rows["bf16"]["blocks"] == 32 and rows["int4"]["blocks"] == 102
    assert rows["int8"]["bytes_per_token"] == 256 * (1 + 4 / 32) and rows["int2"]["bytes_per_token"] == 96
    assert rows["int4"]["capacity_gain"] == 512 / 160
    # LRU's hit rate never falls as its capacity grows (inclusion): more blocks, at least the hits
    by_blocks = sorted(result["table"], key=lambda r: r["blocks"])
    assert all(a["hit_rate"] <= b["hit_rate"] for a, b in zip(by_blocks, by_blocks[1:]))
    mixed = next(r for r in result["table"] if r.get("mixed"))
    assert 96 <= mixed["bytes_per_token"] <= 160
    assert result["errors"]["formats"]["bf16"]["mean"] == 0 < result["errors"]["formats"]["int4"]["mean"]
    for name in ("report.html", "report.md", "sim/summary.json"):
        assert (runs[0] / name).exists()
    # the int4 row's hit rate is the sim's own at 102 blocks, run apart here
    _, alone = run_replay(trace, "sim", {"policy": "lru", "capacity": "102", "bound": False}, out=tmp_path / "alone")
    assert rows["int4"]["hit_rate"] == alone["points"][0]["hit_rate"]["token"]["all"]
    write_reports(runs[0], result, plots=True)  # the plot too (the command ran with --no-plots, to be quick)
    assert "<svg" in (runs[0] / "report.html").read_text()
    report = (runs[0] / "report.md").read_text()
    for section in ("capacity gained vs accuracy lost", "Attention error by decode position", "What the K/V are",
                    "| int4 | 160 | 3.20× | 102 |"):  # fmt: skip
        assert section in report
    # a second run (of one format, to be quick) never overwrites the first
    assert CliRunner().invoke(main, [*args[:5], "--kv-dtypes", "bf16", *SMALL, "--requests", "1"]).exit_code == 0
    assert len(list((tmp_path / "reports").iterdir())) == 2


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--memory", "lots"], "is not a size"),
        (["--memory", "1KiB"], "less than one 64-token block"),
        (["--memory", "1MiB", "--kv-dtypes", "int3"], "unknown KV format 'int3'"),
        (["--memory", "1MiB", "--group-size", "0"], "at least 1 element"),
        (["--memory", "1MiB", "--key-grouping", "token", "--group-size", "5"], "does not divide head_dim 32"),
        (["--memory", "1MiB", "--kv-dtype-old", "int1"], "unknown KV format 'int1'"),
        (["--memory", "1MiB", "--kv-dtype", "int5"], "--kv-dtype: unknown KV format 'int5'"),
        (["--memory", "1MiB", "--kv-dtype-old", "int2", "--kv-old-after-tokens", "-5"], "give a number of tokens"),
        (["--memory", "1MiB", "--policy", "lru,fifo"], "give one eviction policy"),
        (["--memory", "1MiB", "--max-context", "100"], "raise --max-context"),
    ],
)
def test_cli_refusals(sample_head, tmp_path, monkeypatch, extra, message):
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(main, ["experiment", "kv-quant", str(sample_head("chat", 300)), *SMALL, *extra])
    assert res.exit_code == 2 and message in res.output and "Traceback" not in res.output
    assert not (tmp_path / "reports").exists()  # refused before a run directory was claimed


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cli_refuses_cuda_without_a_gpu(sample_head, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = ["experiment", "kv-quant", str(sample_head("chat", 300)), *SMALL, "--memory", "1MiB", "--device", "cuda"]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 2 and "no CUDA device here" in res.output
