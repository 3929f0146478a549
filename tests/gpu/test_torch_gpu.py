"""The torch backend on a real GPU: byte-exact moves through pinned host memory and disk in every copy mode
and layout, page-locked allocation, event-timed traffic, a replay that agrees with the simulator, and paged
attention on CUDA. Skipped without CUDA (see conftest.py); `benchmarks/gpu_check.sh` runs them."""

from __future__ import annotations

import time

import pyarrow.parquet as pq
import pytest

torch = pytest.importorskip("torch")

from kvbench.backends.torchkv.geometry import LAYOUTS, KvGeometry  # noqa: E402
from kvbench.backends.torchkv.pools import DiskPool, TensorPool, checksums, pinned_empty, unpin  # noqa: E402
from kvbench.backends.torchkv.transfers import COPY_MODES, Mover  # noqa: E402

pytestmark = pytest.mark.gpu
CPU = torch.device("cpu")
POOL = 48


def pools(geo: KvGeometry, layout: str, tmp_path, cuda):
    hbm = TensorPool("hbm", geo, POOL, cuda, layout)
    hbm.data.normal_(generator=torch.Generator(cuda).manual_seed(1))
    back = TensorPool("back", geo, POOL, cuda, layout)
    back.data.zero_()
    dram = TensorPool("dram", geo, POOL, CPU, "block_major", pin=True)
    dram.data.zero_()
    return hbm, back, dram, DiskPool("ssd", geo, POOL, tmp_path)


def same_bytes(a: torch.Tensor, b: torch.Tensor, hop: str) -> None:
    a, b = a.cpu(), b.cpu()
    assert torch.equal(checksums(a), checksums(b)), f"{hop}: checksums differ"
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"{hop}: bytes differ"


# Slots with runs consecutive in both lists (which coalesced mode merges) and scattered ones, out of order.
SRC = [5, 6, 7, 8, 40, 2, 33, 34, 47, 11]
DRAM = [10, 11, 12, 13, 0, 45, 20, 21, 3, 30]
DISK = [30, 31, 32, 33, 7, 1, 18, 19, 46, 25]
DRAM2 = [40, 41, 42, 43, 9, 14, 2, 3, 27, 36]
BACK = [0, 1, 2, 3, 44, 17, 29, 30, 8, 12]
HBM2 = [12, 13, 14, 15, 16, 17, 18, 19, 20, 21]  # hbm->hbm: none of SRC, so no block is overwritten before read


@pytest.mark.parametrize("model", ["kvbench-tiny", "llama3-8b"])  # 16 KiB and 2 MiB blocks
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mode", COPY_MODES)
def test_round_trip_is_byte_exact(mode, layout, model, tmp_path, cuda):
    """device -> pinned host -> disk -> host (other slots) -> device, checked after every hop so that a
    failure names the hop. Large blocks matter: an asynchronous device-to-host copy that is read on the host
    before it lands shows with megabytes in flight, rarely with kilobytes."""
    geo = KvGeometry.named(model, 16, "bf16", layout)
    hbm, back, dram, ssd = pools(geo, layout, tmp_path, cuda)
    mover = Mover(mode, cuda)
    try:
        want = hbm.gather(torch.tensor(SRC, device=cuda))
        mover.copy("hbm->dram", hbm, SRC, dram, DRAM)
        same_bytes(dram.gather(torch.tensor(DRAM)), want, "hbm->dram")
        mover.copy("dram->ssd", dram, DRAM, ssd, DISK)
        mover.copy("ssd->dram", ssd, DISK, dram, DRAM2)
        same_bytes(dram.gather(torch.tensor(DRAM2)), want, "dram->ssd->dram")
        mover.copy("dram->hbm", dram, DRAM2, back, BACK)
        same_bytes(back.gather(torch.tensor(BACK, device=cuda)), want, "dram->hbm")
        # and straight between device and disk (the replay's hbm->ssd / ssd->hbm with no DRAM tier)
        back.data.zero_()
        mover.copy("hbm->ssd", hbm, SRC, ssd, DISK)
        mover.copy("ssd->hbm", ssd, DISK, back, BACK)
        same_bytes(back.gather(torch.tensor(BACK, device=cuda)), want, "hbm->ssd->hbm")
        # the untouched slots stayed untouched
        rest = [s for s in range(POOL) if s not in BACK]
        assert not back.gather(torch.tensor(rest, device=cuda)).any()
    finally:
        for p in (hbm, back, dram, ssd):
            p.close()


def test_pinned_empty_is_exact_and_unregisters():
    shape = (3, 1000, 7)  # 42,000 bytes in bf16: nowhere near a power of two
    t = pinned_empty(shape, torch.bfloat16)
    assert t.shape == shape and t.dtype == torch.bfloat16 and t.device.type == "cpu"
    assert t.untyped_storage().nbytes() == 3 * 1000 * 7 * 2  # no rounding up, unlike pin_memory=True
    assert t.is_pinned()
    t.fill_(1.5)  # usable as ordinary memory while registered
    assert float(t.float().sum()) == 1.5 * t.numel()
    unpin(t)
    assert not t.is_pinned()
    assert pinned_empty((0, 4), torch.float32).numel() == 0  # nothing to register
    geo = KvGeometry.named("kvbench-tiny", 16, "bf16")
    pool = TensorPool("dram", geo, 8, CPU, "block_major", pin=True)
    assert pool.pinned and pool.data.is_pinned() and pool.nbytes == 8 * geo.block_bytes
    pool.close()
    assert not pool.pinned and not pool.data.is_pinned()
    pool.close()  # a second close is a no-op, not a CUDA error


DIRECTIONS = ["hbm->dram", "dram->hbm", "dram->ssd", "ssd->dram", "hbm->ssd", "ssd->hbm", "hbm->hbm"]


@pytest.mark.parametrize("mode", COPY_MODES)
def test_mover_counts_bytes_and_event_time_per_direction(mode, tmp_path, cuda):
    geo = KvGeometry.named("llama3-8b", 16, "bf16")
    tiers = {
        "hbm": TensorPool("hbm", geo, POOL, cuda, "block_major"),
        "dram": TensorPool("dram", geo, POOL, CPU, "block_major", pin=True),
        "ssd": DiskPool("ssd", geo, POOL, tmp_path),
    }
    tiers["hbm"].data.normal_()
    mover = Mover(mode, cuda)
    try:
        for d in DIRECTIONS:
            src, dst = d.split("->")
            ss, ds = SRC, (HBM2 if src == dst else DRAM)
            t0 = time.perf_counter()
            mover.copy(d, tiers[src], ss, tiers[dst], ds)
            wall = time.perf_counter() - t0
            row = mover.traffic[d].summary()
            assert row["bytes"] == len(ss) * geo.block_bytes and row["blocks"] == len(ss) and row["calls"] == 1
            assert row["copies"] >= 1 and row["seconds"] > 0 and row["gb_per_s"] > 0, (d, row)
            # events time the device side only: never more than the host saw around the whole call
            assert row["seconds"] <= wall + 1e-3, (d, row, wall)
        assert set(mover.traffic) == set(DIRECTIONS)
    finally:
        for p in tiers.values():
            p.close()


def test_copy_waits_for_the_compute_stream(cuda):
    """A block written on the compute stream is sent only once written: the copy stream waits for it."""
    geo = KvGeometry.named("llama3-8b", 16, "bf16")
    hbm = TensorPool("hbm", geo, 4, cuda, "block_major")
    dram = TensorPool("dram", geo, 4, CPU, "block_major", pin=True)
    try:
        hbm.data.zero_()
        dram.data.fill_(-1)
        torch.cuda.synchronize()
        torch.cuda._sleep(50_000_000)  # ~tens of ms of GPU time queued ahead of the write
        hbm.data.fill_(7)
        Mover("block", cuda).copy("hbm->dram", hbm, [0, 1, 2, 3], dram, [0, 1, 2, 3])
        assert bool((dram.data == 7).all())
    finally:
        hbm.close()
        dram.close()


def _replay(trace, backend: str, options: dict, out):
    from kvbench.run.runner import run_replay

    _, summary = run_replay(trace, backend, options, out=out, report=False)
    return pq.read_table(out / "requests.parquet"), summary


def _col(table, name):
    return table.column(name).to_numpy()


SIM = {"policy": "lru", "capacity": "300", "bound": False}
TORCH = {"device": "cuda", "capacity": "300", "compute": True, "decode_steps": "2", "verify": True}


def test_replay_on_cuda_matches_sim(chat200, tmp_path):
    sim, _ = _replay(chat200, "sim", SIM, tmp_path / "sim")
    got, summary = _replay(chat200, "torch", TORCH, tmp_path / "torch")
    assert summary["complete"]
    assert _col(sim, "evictions").sum() > 0 and _col(sim, "hit_tokens").sum() > 0  # the cache is exercised
    assert (_col(got, "hit_tokens") == _col(sim, "hit_tokens")).all()
    assert (_col(got, "evictions") == _col(sim, "evictions")).all()
    facts = summary["points"][0]["torch"]
    assert facts["device"].startswith("cuda") and facts["compute"]
    assert summary["latency"]["ttft"]["p50_ms"] > 0


def test_tiered_replay_on_cuda_keeps_hbm_counts_and_data(chat200, tmp_path):
    """With DRAM and disk below HBM the HBM policy is unchanged (hits in HBM and evictions equal sim's), blocks
    found below are loaded, and every loaded block's checksum matches the one recorded when it was computed."""
    sim, _ = _replay(chat200, "sim", SIM, tmp_path / "sim")
    tiers = {**TORCH, "dram_capacity": "400", "ssd_capacity": "800", "disk_dir": str(tmp_path)}
    got, summary = _replay(chat200, "torch", tiers, tmp_path / "torch")
    assert (_col(got, "hit_tokens_hbm") == _col(sim, "hit_tokens")).all()
    assert (_col(got, "evictions") == _col(sim, "evictions")).all()
    assert (_col(got, "hit_tokens") >= _col(sim, "hit_tokens")).all()
    facts = summary["points"][0]["torch"]
    assert facts["verify"]["checked"] > 0 and facts["verify"]["mismatches"] == 0, facts["verify"]
    for direction in ("hbm->dram", "dram->hbm", "dram->ssd"):
        row = facts["transfers"][direction]
        assert row["bytes"] > 0 and row["gb_per_s"] > 0 and row["vs_peak"] > 0, (direction, row)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_paged_prefill_on_cuda_matches_contiguous(layout, cuda):
    from kvbench.backends.torchkv import compute  # a rename fails this test; only a missing CUDA skips it

    geo = KvGeometry.named("kvbench-tiny", 16, "bf16", layout)
    model = compute.PagedAttentionModel(geo, cuda, seed=7)
    pool = torch.zeros(geo.pool_shape(32), dtype=geo.torch_dtype, device=cuda)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, compute.VOCAB, (100,), generator=gen)
    table = torch.randperm(30, generator=gen)[:8].to(cuda)  # scattered, out of order; 30 and 31 stay free
    tol = dict(atol=6e-2, rtol=3e-2)  # bf16 keeps ~3 digits; the paged path runs SDPA on other shapes

    def close(a, b):
        torch.testing.assert_close(a.float(), b.float(), **tol)

    full = model.contiguous_forward(prompt)
    close(model.prefill(pool, table, prompt, 0), full)
    # a second request sharing the first 64 tokens (4 whole blocks) computes only its suffix, on the pages
    other = torch.cat([prompt[:64], torch.randint(0, compute.VOCAB, (30,), generator=gen)])
    table_b = torch.cat([table[:4], torch.tensor([30, 31], device=cuda)])
    close(model.prefill(pool, table_b, other, 64), model.contiguous_forward(other))
    # and a decode step after the first prompt
    seq = torch.cat([prompt, torch.tensor([17])])
    close(model.decode(pool, table, 100, 17), model.contiguous_forward(seq))
