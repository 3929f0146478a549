"""The one-pass host copy kernel and the Mover paths that use it: every block lands in its slot, byte for byte,
whatever the layouts and the order of the slots, and nothing else is written."""

import random

import pytest
import torch
from kvbench.backends.torchkv import hostcopy
from kvbench.backends.torchkv.geometry import LAYOUTS, KvGeometry
from kvbench.backends.torchkv.pools import TensorPool
from kvbench.backends.torchkv.transfers import COPY_MODES, Mover, runs

CPU = torch.device("cpu")


def _pool(name, layout, blocks, dtype="bf16", tokens=16, seed=None):
    g = KvGeometry.named("kvbench-tiny", tokens, dtype, layout)
    pool = TensorPool(name, g, blocks, CPU, layout)
    b = pool.data.view(torch.uint8)
    if seed is None:
        b.fill_(0xAB)  # a pattern no random block is made of
    else:
        b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)))
    return pool


def _blocks(pool, slots):
    """The blocks at `slots` as `[n, block_bytes]` bytes, read with torch's own indexing."""
    return pool.gather(torch.tensor(slots, dtype=torch.int64)).contiguous().view(torch.uint8).view(len(slots), -1)


SLOTS = {
    "scattered": ([17, 3, 40, 8, 31, 0, 22, 45], [5, 29, 11, 38, 2, 19, 44, 27]),
    "contiguous": (list(range(10, 22)), list(range(30, 42))),
    "runs": ([3, 4, 5, 9, 0, 1, 31, 32, 33, 34], [7, 8, 9, 2, 3, 20, 21, 22, 23, 29]),
    "src run, dst scattered": (list(range(5, 13)), [40, 2, 17, 9, 33, 0, 25, 12]),
}


@pytest.mark.parametrize("src_layout", LAYOUTS)
@pytest.mark.parametrize("dst_layout", LAYOUTS)
@pytest.mark.parametrize("slots", list(SLOTS))
def test_copy_blocks_lands_each_block_in_its_slot(src_layout, dst_layout, slots):
    ss, ds = SLOTS[slots]
    src, dst = _pool("src", src_layout, 48, seed=1), _pool("dst", dst_layout, 48)
    before = src.data.view(torch.uint8).clone()
    n_runs = hostcopy.copy_blocks(dst.data, dst_layout, ds, src.data, src_layout, ss)
    assert n_runs == len(runs(ss, ds))
    assert torch.equal(_blocks(dst, ds), _blocks(src, ss))
    untouched = [s for s in range(48) if s not in ds]
    assert bool((_blocks(dst, untouched) == 0xAB).all()), "a slot outside the destination list was written"
    assert torch.equal(src.data.view(torch.uint8), before), "the source changed"


@pytest.mark.parametrize("dtype", ["fp8", "fp32"])
def test_copy_blocks_moves_bits_of_any_dtype(dtype):
    src, dst = _pool("src", "layer_first", 20, dtype, tokens=3, seed=2), _pool("dst", "block_major", 20, dtype, 3)
    ss, ds = random.Random(0).sample(range(20), 12), random.Random(1).sample(range(20), 12)
    hostcopy.copy_blocks(dst.data, "block_major", ds, src.data, "layer_first", ss)
    assert torch.equal(_blocks(dst, ds), _blocks(src, ss))


def test_copy_blocks_refuses_slots_out_of_range_and_mismatched_pools():
    src, dst = _pool("src", "block_major", 8, seed=3), _pool("dst", "block_major", 8)
    with pytest.raises(IndexError):
        hostcopy.copy_blocks(dst.data, "block_major", [8], src.data, "block_major", [0])
    with pytest.raises(IndexError):
        hostcopy.copy_blocks(dst.data, "block_major", [0], src.data, "block_major", [-1])
    with pytest.raises(ValueError):
        hostcopy.copy_blocks(dst.data, "block_major", [0, 1], src.data, "block_major", [0])
    other = _pool("other", "block_major", 8, tokens=32)
    with pytest.raises(ValueError):
        hostcopy.copy_blocks(other.data, "block_major", [0], src.data, "block_major", [0])
    assert bool((dst.data.view(torch.uint8) == 0xAB).all())
    assert hostcopy.copy_blocks(dst.data, "block_major", [], src.data, "block_major", []) == 0


@pytest.mark.parametrize("mode", COPY_MODES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("slots", ["scattered", "contiguous"])
def test_mover_round_trip_hbm_dram_hbm_is_byte_exact(mode, layout, slots):
    """A CPU run's "HBM" pool (either layout) to the block-major DRAM pool and back to other slots."""
    hbm, dram = _pool("hbm", layout, 64, seed=4), _pool("dram", "block_major", 40)
    rng = random.Random(5)
    if slots == "contiguous":
        src, via, back = list(range(8, 24)), list(range(20, 36)), list(range(40, 56))
    else:
        src, via, back = rng.sample(range(32), 16), rng.sample(range(40), 16), rng.sample(range(32, 64), 16)
    original = _blocks(hbm, src).clone()
    mover = Mover(mode, CPU)
    mover.copy("hbm->dram", hbm, src, dram, via)
    assert torch.equal(_blocks(dram, via), original)
    assert bool((_blocks(dram, [s for s in range(40) if s not in via]) == 0xAB).all())
    mover.copy("dram->hbm", dram, via, hbm, back)
    assert torch.equal(_blocks(hbm, back), original)
    expected = {"block": 16, "coalesced": len(runs(src, via)), "staged": 1}[mode]
    assert mover.traffic["hbm->dram"].copies == expected
    assert mover.traffic["dram->hbm"].bytes == 16 * hbm.geometry.block_bytes


@pytest.mark.parametrize("layouts", [("block_major", "block_major"), ("layer_first", "layer_first"),
                                     ("layer_first", "block_major")])  # fmt: skip
@pytest.mark.parametrize("slots", ["runs", "contiguous", "scattered"])
def test_shared_among_threads_with_runs_cut(monkeypatch, layouts, slots):
    """The parallel kernel: any move is shared (PARALLEL_BYTES 0) among 3 parts, so that part boundaries cut
    runs (8 and 12 pairs in 3 parts)."""
    monkeypatch.setattr(hostcopy, "PARALLEL_BYTES", 0)
    monkeypatch.setattr(hostcopy, "_threads", lambda: 3)
    ss, ds = SLOTS[slots]
    src, dst = _pool("src", layouts[0], 48, seed=6), _pool("dst", layouts[1], 48)
    hostcopy.copy_blocks(dst.data, layouts[1], ds, src.data, layouts[0], ss)
    assert torch.equal(_blocks(dst, ds), _blocks(src, ss))
    assert bool((_blocks(dst, [s for s in range(48) if s not in ds]) == 0xAB).all())
