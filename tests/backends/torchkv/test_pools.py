"""Block pools and transfers on the CPU: every way of moving blocks keeps them byte for byte."""

import pytest
import torch
from kvbench.backends.torchkv.geometry import KvGeometry
from kvbench.backends.torchkv.pools import DiskPool, TensorPool, checksums
from kvbench.backends.torchkv.transfers import COPY_MODES, Mover, runs


def _geometry(layout="block_major", dtype="bf16"):
    return KvGeometry.named("kvbench-tiny", 16, dtype, layout)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("mode", COPY_MODES)
@pytest.mark.parametrize("layout", ["block_major", "layer_first"])
@pytest.mark.parametrize("dtype", ["bf16", "fp32", "fp8"])
def test_round_trip_device_host_disk_device_is_byte_exact(tmp_path, mode, layout, dtype):
    g = _geometry(layout, dtype)
    cpu = torch.device("cpu")
    hbm = TensorPool("hbm", g, 40, cpu, layout)
    dram = TensorPool("dram", g, 30, cpu, "block_major")
    ssd = DiskPool("ssd", g, 50, tmp_path)
    gen = torch.Generator().manual_seed(1)
    hbm.data.copy_(torch.randn(hbm.data.shape, generator=gen).to(g.torch_dtype))
    src = [3, 4, 5, 9, 0, 1, 31, 32, 33, 34]  # runs and singles
    original = hbm.gather(torch.tensor(src)).clone()
    sums = checksums(original)
    mover = Mover(mode, cpu)
    via_dram = [7, 8, 9, 2, 3, 20, 21, 22, 23, 29]
    via_ssd = [40, 41, 42, 0, 5, 6, 7, 10, 11, 49]
    back = [20, 21, 22, 23, 24, 10, 12, 14, 16, 18]
    mover.copy("hbm->dram", hbm, src, dram, via_dram)
    mover.copy("dram->ssd", dram, via_dram, ssd, via_ssd)
    dram.data.zero_()  # nothing may come back from the DRAM copy
    mover.copy("ssd->hbm", ssd, via_ssd, hbm, back)
    returned = hbm.gather(torch.tensor(back))
    assert torch.equal(_bytes(returned), _bytes(original))
    assert torch.equal(checksums(returned), sums)
    for direction in ("hbm->dram", "dram->ssd", "ssd->hbm"):
        t = mover.traffic[direction]
        assert t.bytes == len(src) * g.block_bytes and t.blocks == len(src) and t.seconds > 0
    expected_copies = {"block": len(src), "coalesced": len(runs(src, via_dram)), "staged": 1}[mode]
    assert mover.traffic["hbm->dram"].copies == expected_copies
    ssd.close()
    assert not ssd.path.exists()


def test_checksums_see_a_moved_or_flipped_word():
    g = _geometry(dtype="fp32")
    blocks = torch.randn((3, *g.block_shape))
    base = checksums(blocks)
    swapped = blocks.clone().view(3, -1)
    swapped[0, [0, 1]] = swapped[0, [1, 0]]
    flipped = blocks.clone().view(3, -1)
    flipped[1, 5] += 1.0
    assert checksums(swapped.view_as(blocks))[0] != base[0]
    assert checksums(flipped.view_as(blocks))[1] != base[1]
    assert torch.equal(checksums(blocks.clone()), base)


def test_pool_bytes_follow_the_geometry():
    g = KvGeometry.named("llama3-8b", 16, "bf16")
    assert g.block_bytes == 32 * 2 * 16 * 8 * 128 * 2  # layers × K,V × tokens × KV heads × head dim × 2 B
    assert g.block_bytes == g.model.kv_bytes_per_token("bf16") * 16
    mla = KvGeometry.named("deepseek-v3", 64, "fp8")
    assert mla.block_bytes == mla.model.kv_bytes_per_token("fp8") * 64


def test_runs_merge_only_slots_consecutive_on_both_sides():
    assert runs([1, 2, 3, 7, 8], [5, 6, 9, 10, 11]) == [(1, 5, 2), (3, 9, 1), (7, 10, 2)]


def test_disk_runs_longer_than_one_vectored_call(tmp_path):
    """More buffers than one preadv/pwritev takes (IOV_MAX): split into several calls, nothing lost."""
    g = KvGeometry.named("kvbench-micro", 2, "fp32")
    n = 1100
    host = TensorPool("dram", g, n, torch.device("cpu"), "block_major")
    host.data.copy_(torch.randn(host.data.shape))
    ssd = DiskPool("ssd", g, n, tmp_path)
    back = TensorPool("dram2", g, n, torch.device("cpu"), "block_major")
    mover = Mover("coalesced", torch.device("cpu"))
    mover.copy("dram->ssd", host, list(range(n)), ssd, list(range(n)))
    mover.copy("ssd->dram", ssd, list(range(n)), back, list(range(n)))
    assert torch.equal(back.data, host.data)
    ssd.close()
