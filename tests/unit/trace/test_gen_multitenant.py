"""The multi-tenant generator: public/private prefixes, skewed traffic, salts, priorities, LoRA, returning users."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from kvbench.trace.generators import get
from kvbench.trace.validation import validate_table

BS = 64


def _gen(n=20_000, seed=3, **overrides):
    return get("multi-tenant").run(n, seed=seed, block_size=BS, **overrides)


@pytest.fixture(scope="module")
def trace():
    return _gen()


def _strings(table: pa.Table, name: str) -> np.ndarray:
    col = table.column(name).combine_chunks()
    if pa.types.is_dictionary(col.type):
        col = col.dictionary_decode()
    return np.asarray(col.to_pylist(), dtype=object)


def _blocks(table: pa.Table) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every block id with its row and its position in the prompt."""
    hashes = table.column("block_hashes").combine_chunks()
    rows = np.asarray(pc.list_parent_indices(hashes))
    ids = np.asarray(pc.list_flatten(hashes))
    starts = np.asarray(hashes.offsets)[:-1]
    return ids, rows, np.arange(ids.size) - starts[rows]


def _tenants_per_id(ids: np.ndarray, tenant_codes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Distinct ids and how many distinct tenants use each."""
    pairs = np.unique(np.stack([ids, tenant_codes.astype(np.uint64)]), axis=1)
    uniq, counts = np.unique(pairs[0], return_counts=True)
    return uniq, counts


def test_table_validates_and_has_the_columns(trace):
    table, meta = trace
    report = validate_table(table, meta.block_size)
    assert report.ok, report.summary()
    assert pc.all(pc.starts_with(table.column("request_id"), "mt-")).as_py()
    assert set(table.column("workload").to_pylist()) == {"multi-tenant"}
    for name in ("tenant", "user_id", "session_id", "turn", "think_time_s", "priority", "slo_ttft_ms", "slo_tpot_ms"):
        assert table.column(name).null_count == 0, name


def test_deterministic_per_seed(trace):
    table, _ = trace
    again, _ = _gen()
    other, _ = _gen(seed=4)
    assert table.equals(again)
    assert not table.equals(other)


def test_public_prefixes_shared_by_id_private_ones_unique_to_a_tenant():
    # Every public prompt is exactly 16 blocks long, so blocks from position 16 on are tenant content.
    table, _ = _gen(n=10_000, public_tokens_mean=16 * BS, public_tokens_sigma=0.0)
    ids, rows, pos = _blocks(table)
    tenant = np.asarray(table.column("tenant").combine_chunks().indices)[rows]
    public = pos < 16
    uniq, n_tenants = _tenants_per_id(ids[public], tenant[public])
    assert n_tenants.max() >= 3  # a popular public prompt: identical ids in several tenants
    _, n_tenants = _tenants_per_id(ids[~public], tenant[~public])
    assert n_tenants.max() == 1  # private prefixes, user memory and conversations never cross tenants
    # Within one tenant, every session starts with the same tenant prefix (public + private).
    first = np.asarray(table.column("tenant").combine_chunks().indices) == 0
    first_ids = ids[(pos == 16) & first[rows]]
    assert first_ids.size > 100 and np.unique(first_ids).size == 1


def test_traffic_share_is_skewed(trace):
    table, _ = trace
    tenants = _strings(table, "tenant")
    _, counts = np.unique(tenants, return_counts=True)
    top_share = counts.max() / counts.sum()
    assert top_share > 5 * (1 / 200)
    assert np.unique(tenants).size > 50  # many tenants, not just a few


def test_salts_are_per_tenant_and_never_in_the_ids(trace):
    table, _ = trace
    tenants, salts = _strings(table, "tenant"), _strings(table, "cache_salt")
    pairs = {(t, s) for t, s in zip(tenants, salts)}
    by_tenant = {}
    for t, s in pairs:
        by_tenant.setdefault(t, set()).add(s)
    assert all(len(s) == 1 for s in by_tenant.values())  # one salt (or none) per tenant
    salted = [next(iter(s)) for s in by_tenant.values() if next(iter(s)) is not None]
    assert len(salted) == len(set(salted))  # distinct tenants, distinct salts
    assert any(next(iter(s)) is None for s in by_tenant.values())  # default: some tenants send no salt
    # Salts and adapters are separate columns: changing them leaves every block id as it was.
    no_salt, _ = _gen(unsalted_share=1.0, lora_tenant_share=0.0)
    all_salt, _ = _gen(unsalted_share=0.0)
    assert no_salt.column("cache_salt").null_count == no_salt.num_rows
    assert all_salt.column("cache_salt").null_count == 0
    assert no_salt.column("lora").null_count == no_salt.num_rows
    assert no_salt.column("block_hashes").equals(table.column("block_hashes"))
    assert all_salt.column("block_hashes").equals(table.column("block_hashes"))


def test_lora_adapters_belong_to_one_tenant_and_respect_the_cap(trace):
    table, _ = trace
    lora, tenants = _strings(table, "lora"), _strings(table, "tenant")
    used = lora != None  # noqa: E711 (element-wise on an object array)
    assert 0 < used.sum() < lora.size  # adapters and the base model both serve traffic
    assert np.unique(lora[used]).size <= 100
    owners = {}
    for a, t in zip(lora[used], tenants[used]):
        owners.setdefault(a, set()).add(t)
    assert all(len(t) == 1 for t in owners.values())
    small, _ = _gen(n=5_000, lora_adapters=10, lora_tenant_share=1.0)
    small_lora = _strings(small, "lora")
    assert 0 < np.unique(small_lora[small_lora != None]).size <= 10  # noqa: E711


def test_priorities_and_slos_follow_the_tenant_tier(trace):
    table, _ = trace
    prio = np.asarray(table.column("priority")).astype(np.int64)
    assert prio.min() >= 0 and prio.max() <= 100
    assert set(np.unique(prio)) == {10, 35, 80}
    tenants = _strings(table, "tenant")
    ttft = np.asarray(table.column("slo_ttft_ms"))
    for t in np.unique(tenants)[:50]:
        mine = tenants == t
        assert np.unique(prio[mine]).size == 1 and np.unique(ttft[mine]).size == 1
    assert ttft[prio == 80].max() < ttft[prio == 10].min()
    no_slo, _ = _gen(n=1_000, slo=False)
    assert no_slo.column("slo_ttft_ms").null_count == no_slo.num_rows


def test_users_return_over_days_within_one_tenant(trace):
    table, _ = trace
    g = (
        pa.table({"user": table.column("user_id"), "tenant": _strings(table, "tenant"), "t": table.column("arrival_s")})
        .group_by("user")
        .aggregate([("t", "min"), ("t", "max"), ("tenant", "count_distinct")])
    )
    spread_h = (np.asarray(g["t_max"]) - np.asarray(g["t_min"])) / 3600
    assert spread_h.max() > 24  # some user comes back more than a day later
    assert (spread_h > 24).mean() > 0.1
    assert np.all(np.asarray(g["tenant_count_distinct"]) == 1)
    assert np.asarray(table.column("arrival_s")).max() < 3.1 * 86_400  # default span: 3 days


def test_returning_sessions_start_with_the_users_private_memory():
    table, _ = _gen(n=10_000, memory_tokens_mean=3000.0)
    first_turn = np.asarray(table.column("turn")) == 0
    t = table.filter(pa.array(first_turn))
    users, tenants = t.column("user_id").to_pylist(), _strings(t, "tenant")
    hashes = t.column("block_hashes").to_pylist()
    seen: dict[str, list[int]] = {}
    for i, u in enumerate(users):  # rows are in arrival order, so the first one is the user's first session
        seen.setdefault(u, []).append(i)

    def common(a, b):
        k = 0
        while k < min(len(a), len(b)) and a[k] == b[k]:
            k += 1
        return k

    returning = {u: rows[1:] for u, rows in seen.items() if len(rows) >= 3}
    users_list = list(returning)
    wins, trials = 0, 0
    for u in users_list[:200]:
        a, b = returning[u][0], returning[u][1]
        others = [v for v in users_list if v != u and tenants[returning[v][0]] == tenants[a]]
        if not others:
            continue
        c = returning[others[0]][0]
        trials += 1
        wins += common(hashes[a], hashes[b]) > common(hashes[a], hashes[c])
    assert trials >= 50 and wins / trials > 0.9


def test_diurnal_rate_peaks_at_the_configured_hour():
    table, _ = _gen(n=20_000, diurnal_amplitude=0.9, diurnal_peak_hour=14.0)
    starts = np.asarray(table.column("arrival_s"))[np.asarray(table.column("turn")) == 0]
    hour = (starts % 86_400) / 3600
    assert (np.abs(hour - 14) < 3).sum() > 3 * (np.abs(hour - 2) < 3).sum()
