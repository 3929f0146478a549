"""Block ids numbered chunk by chunk (`densify.Numbering`, what `prepare` does with a trace read by row group)
give the keys and parents of numbering the whole at once, isolation folded in, and so the same simulation."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from kvbench.cache import policies
from kvbench.cache.densify import Numbering, densify
from kvbench.cache.prepared import prepare
from kvbench.trace.generators import get


def cut(table: pa.Table, bounds: list[int]) -> pa.Table:
    """`table` with block_hashes in chunks ending at `bounds` (the other columns untouched)."""
    whole = table.column("block_hashes").combine_chunks()
    edges = [0, *bounds, len(whole)]
    chunks = [whole.slice(a, b - a) for a, b in zip(edges, edges[1:])]
    i = table.column_names.index("block_hashes")
    return table.set_column(i, "block_hashes", pa.chunked_array(chunks, whole.type))


@pytest.mark.parametrize("kind", ["chat", "multi-tenant", "agent"])
def test_prepare_by_chunk_equals_prepare_whole(kind):
    table, meta = get(kind).run(2000, seed=6)
    whole = prepare(table, meta.block_size)
    chunked = prepare(cut(table, [1, 1, 900, 1999]), meta.block_size)
    assert cut(table, [1, 1, 900, 1999]).column("block_hashes").num_chunks == 5
    for name in ("keys", "parent", "offsets", "max_hit", "tenant", "input_tokens"):
        np.testing.assert_array_equal(getattr(chunked, name), getattr(whole, name), err_msg=name)
    lru = policies.get("lru")
    np.testing.assert_array_equal(lru.kernel(chunked, 500).hit_blocks, lru.kernel(whole, 500).hit_blocks)


def test_numbering_grows_across_many_small_chunks():
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 5000, 40_000).astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)  # large 64-bit ids
    offsets = np.arange(0, ids.size + 1, 8, dtype=np.int64)
    keys, parent = densify(ids, offsets)
    numbering = Numbering()
    parts = [
        numbering.add(ids[lo : lo + 800], offsets[lo // 8 : (lo + 800) // 8 + 1] - lo) for lo in range(0, ids.size, 800)
    ]
    np.testing.assert_array_equal(np.concatenate(parts), keys)
    np.testing.assert_array_equal(numbering.parent(), parent)
    assert numbering.n_keys == parent.size == np.unique(ids).size
    numbering.close()


def _by_first_appearance(ids: np.ndarray) -> np.ndarray:
    _, first, inverse = np.unique(ids, return_index=True, return_inverse=True)
    rank = np.empty(first.size, np.int64)
    rank[np.argsort(first)] = np.arange(first.size)
    return rank[inverse].astype(np.uint64)


@pytest.mark.parametrize("case", ["ordered", "ordered but one id ahead in the last request", "small, any order"])
def test_densify_paths_agree(case):
    """densify's paths for imported ids (ids already in first-appearance order: no table; small ids: a direct
    table) give the keys and parents of the general hash table, which the same ids made large take."""
    rng = np.random.default_rng(3)
    ids = _by_first_appearance(rng.zipf(1.2, 30_000) % 4000)
    offsets = np.concatenate([[0], np.sort(rng.choice(np.arange(1, ids.size), 1500, replace=False)), [ids.size]])
    if case == "ordered but one id ahead in the last request":
        ids[offsets[-2] + 1] = ids.max() + 2
    elif case == "small, any order":
        ids = rng.permutation(int(ids.max()) + 1).astype(np.uint64)[ids]
    keys, parent = densify(ids, offsets)
    large = ids * np.uint64(0x9E3779B97F4A7C15) + np.uint64(1 << 40)  # the general path: too large for a table
    want_keys, want_parent = densify(large, offsets)
    np.testing.assert_array_equal(keys, want_keys)
    np.testing.assert_array_equal(parent, want_parent)
    if case == "ordered":
        np.testing.assert_array_equal(keys, ids.astype(np.int32))  # its own dense keys
