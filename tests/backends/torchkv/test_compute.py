import numpy as np
import pytest
import torch
from kvbench.backends.torchkv.compute import VOCAB, PagedAttentionModel
from kvbench.backends.torchkv.geometry import KvGeometry, layer_kv

from kvbench.errors import KvbenchError
from kvbench.trace.tokens import prompt_tokens

T = 16
POOL_BLOCKS = 48
# bf16 keeps ~3 significant digits and the paged path runs SDPA over other shapes than the reference
TOL = {"fp32": dict(atol=1e-4, rtol=1e-4), "bf16": dict(atol=6e-2, rtol=3e-2)}
LAYOUTS = ("block_major", "layer_first")
CASES = [(d, lay) for d in ("fp32", "bf16") for lay in LAYOUTS]


def setup(dtype="fp32", layout="block_major"):
    geo = KvGeometry.named("kvbench-tiny", T, dtype, layout)
    pool = torch.zeros(geo.pool_shape(POOL_BLOCKS), dtype=geo.torch_dtype)
    return geo, pool, PagedAttentionModel(geo, seed=7)


def tokens(n, salt=0):
    hashes = np.arange(-(-n // T), dtype=np.uint64) + np.uint64(1000 * salt + 1)
    return torch.from_numpy(prompt_tokens(hashes, n, T, VOCAB))


def scattered(n_blocks, seed=0):
    # out-of-order, non-adjacent slots: any mix-up of slot and position shows up as a wrong hidden state
    return torch.randperm(POOL_BLOCKS, generator=torch.Generator().manual_seed(seed))[:n_blocks]


def close(a, b, dtype):
    torch.testing.assert_close(a.float(), b.float(), **TOL[dtype])


@pytest.mark.parametrize("dtype,layout", CASES)
def test_paged_prefill_matches_contiguous(dtype, layout):
    _, pool, model = setup(dtype, layout)
    prompt = tokens(100)
    table = scattered(7)
    assert not torch.equal(table.sort().values, table)
    out = model.prefill(pool, table, prompt, 0)
    assert out.shape == (model.hidden,) and out.dtype == model.dtype
    close(out, model.contiguous_forward(prompt), dtype)
    assert model.computed_tokens == 100


@pytest.mark.parametrize("dtype,layout", CASES)
def test_prefix_reuse_computes_only_the_suffix(dtype, layout):
    _, pool, model = setup(dtype, layout)
    a = tokens(100)
    slots = scattered(12, seed=1)
    table_a = slots[:7]
    model.prefill(pool, table_a, a, 0)
    shared_before = [c[table_a[:7]].clone() for layer in range(2) for c in layer_kv(pool, layout, layer)]

    b = torch.cat([a[:64], tokens(50, salt=1)])
    table_b = torch.cat([table_a[:4], slots[7:11]])
    before = model.computed_tokens
    out = model.prefill(pool, table_b, b, 64)
    close(out, model.contiguous_forward(b), dtype)
    assert model.computed_tokens - before == len(b) - 64
    # B wrote only into its own blocks: all of A's pages, shared or not, are as A left them
    after = [c[table_a[:7]] for layer in range(2) for c in layer_kv(pool, layout, layer)]
    for x, y in zip(shared_before, after):
        assert torch.equal(x, y)
    # Every position's K/V, not just the last hidden state, equals a from-scratch prefill of B: the last token
    # sees all keys anyway, so only the earlier suffix positions' layer-1 K/V show a misaligned causal mask.
    _, fresh, _ = setup(dtype, layout)
    model.prefill(fresh, table_b, b, 0)
    for layer in range(2):
        for reused, scratch in zip(layer_kv(pool, layout, layer), layer_kv(fresh, layout, layer)):
            close(reused[table_b].flatten(0, 1)[: len(b)], scratch[table_b].flatten(0, 1)[: len(b)], dtype)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_full_hit_recomputes_one_token(layout):
    _, pool, model = setup("fp32", layout)
    prompt = tokens(40)
    table = scattered(3)
    first = model.prefill(pool, table, prompt, 0)
    snapshot = pool.clone()
    before = model.computed_tokens
    again = model.prefill(pool, table, prompt, len(prompt))
    assert model.computed_tokens - before == 1
    close(again, model.contiguous_forward(prompt), "fp32")
    close(again, first, "fp32")
    assert torch.equal(pool, snapshot)


@pytest.mark.parametrize("dtype,layout", CASES)
def test_decode_matches_contiguous_each_step(dtype, layout):
    _, pool, model = setup(dtype, layout)
    seq = tokens(30)
    table = scattered(3, seed=2)  # 30 + 5 tokens cross from block 1 into block 2 at position 32
    model.prefill(pool, table, seq, 0)
    computed = model.computed_tokens
    for tok in [17, 4095, 300, 42, 1234]:
        seq = torch.cat([seq, torch.tensor([tok])])
        out = model.decode(pool, table, len(seq) - 1, tok)
        close(out, model.contiguous_forward(seq), dtype)
    assert model.computed_tokens == computed  # decode steps are not prefill compute


def test_layouts_hold_the_same_kv():
    prompt = tokens(70)
    table = scattered(5, seed=3)
    pools, outs = {}, {}
    for layout in LAYOUTS:
        _, pool, model = setup("fp32", layout)
        outs[layout] = model.prefill(pool, table, prompt, 0)
        outs[layout + "+decode"] = model.decode(pool, table, 70, 99)
        pools[layout] = pool
    for layer in range(2):
        views = zip(
            layer_kv(pools["block_major"], "block_major", layer), layer_kv(pools["layer_first"], "layer_first", layer)
        )
        for bm, lf in views:
            assert torch.equal(bm, lf)
            assert bm[table].abs().sum() > 0
    torch.testing.assert_close(outs["block_major"], outs["layer_first"], atol=0, rtol=0)
    torch.testing.assert_close(outs["block_major+decode"], outs["layer_first+decode"], atol=0, rtol=0)


def test_same_seed_same_model_other_seed_differs():
    prompt = tokens(20)
    geo = KvGeometry.named("kvbench-tiny", T, "fp32")
    a, b, c = (PagedAttentionModel(geo, seed=s).contiguous_forward(prompt) for s in (3, 3, 4))
    assert torch.equal(a, b) and not torch.allclose(a, c)


@pytest.mark.parametrize("model,dtype", [("kvbench-tiny", "fp8"), ("deepseek-v3", "bf16")])
def test_refuses_fp8_and_mla(model, dtype):
    with pytest.raises(KvbenchError, match="bf16/fp16/fp32 and non-MLA"):
        PagedAttentionModel(KvGeometry.named(model, T, dtype))


def test_short_block_table_is_refused():
    _, pool, model = setup()
    with pytest.raises(KvbenchError, match="need 3 blocks"):
        model.prefill(pool, scattered(2), tokens(40), 0)
