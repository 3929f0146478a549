"""`kvbench trace anonymize`: an anonymized trace replays with exactly the same hits, and holds none of the
original's ids, names or block hashes."""

from __future__ import annotations

import json
import os
import re
import subprocess

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbench.run.runner import run_replay
from kvbench.trace.anonymize import ANON_KEY_ENV, anon_key, anonymize, pseudonym
from kvbench.trace.files import new_meta, read_trace, write_trace
from kvbench.trace.keyed import rekey
from kvbench.trace.validation import validate_table
from tests.conftest import SAMPLES, make_trace

SIM = {"policy": "lru,radix-lru", "capacity": "100,400,1600,6400"}
KEY = "a secret for the tests"
PSEUDONYM_PREFIX = re.compile(r"^(req|user|session|tenant|lora|salt)-[0-9a-f]*$")


def _anonymize(src, out, key=KEY, *extra):
    env = {**os.environ, ANON_KEY_ENV: key}
    r = subprocess.run(
        ["kvbench", "trace", "anonymize", str(src), "-o", str(out), *map(str, extra)],
        capture_output=True,
        text=True,
        env=env,
    )
    assert r.returncode == 0, r.stderr
    return out


def _hits(trace, out):
    run_dir, summary = run_replay(trace, "sim", SIM, out=out, report=False)
    per_request = pq.read_table(run_dir / "requests.parquet", columns=["point", "request_id", "hit_tokens"])
    return summary, per_request


@pytest.mark.parametrize(
    "sample,round_s",
    [("chat", None), ("multi-tenant", None), ("multimodal", None), ("agent", None), ("mix", 1.0)],
)
def test_anonymized_trace_replays_with_the_same_hits_at_every_capacity(tmp_path, sample, round_s):
    src = SAMPLES / f"{sample}.parquet"
    extra = ("--round-s", round_s) if round_s else ()
    anon = _anonymize(src, tmp_path / "anon.parquet", KEY, *extra)
    s0, r0 = _hits(src, tmp_path / "orig-run")
    s1, r1 = _hits(anon, tmp_path / "anon-run")
    assert s1["infinite_cache"] == s0["infinite_cache"]
    assert [p["name"] for p in s1["points"]] == [p["name"] for p in s0["points"]] and len(s0["points"]) >= 8
    for p0, p1 in zip(s0["points"], s1["points"], strict=True):
        assert (p1["hit_rate"], p1["hit_tokens"]) == (p0["hit_rate"], p0["hit_tokens"]), p0["name"]
    # request by request: the same rows, renamed, with exactly the same hit tokens at every point
    assert r1.column("point").to_pylist() == r0.column("point").to_pylist()
    assert r1.column("hit_tokens").to_pylist() == r0.column("hit_tokens").to_pylist()
    key = anon_key(ANON_KEY_ENV, {ANON_KEY_ENV: KEY})
    assert r1.column("request_id").to_pylist() == [
        pseudonym(i, "req", key) for i in r0.column("request_id").to_pylist()
    ]
    table, meta = read_trace(anon)
    assert meta.source["anonymized"] is True and meta.source["anonymization"]["arrival_round_s"] == round_s
    assert KEY not in json.dumps(meta.source)
    if round_s:
        arrival = np.asarray(table.column("arrival_s"))
        assert np.allclose(arrival / round_s, np.round(arrival / round_s))


def _originals(table: pa.Table) -> tuple[list[str], list[int]]:
    """A few of a trace's names (ids, users, sessions, tenants, adapters, salts) and block / media hashes."""
    names = []
    for col in ("request_id", "user_id", "session_id", "tenant", "lora", "cache_salt", "parent_id"):
        values = [v for v in table.column(col).to_pylist() if v is not None]
        names += sorted(set(values))[:5]
    hashes = [h for row in table.column("block_hashes").to_pylist()[:50] for h in row[:2]]
    hashes += [i["hash"] for row in table.column("mm_items").to_pylist() if row for i in row][:20]
    return names, hashes


@pytest.mark.parametrize("sample", ["multi-tenant", "multimodal", "agent"])
def test_no_original_id_name_or_hash_is_left_in_the_file(tmp_path, sample):
    src = SAMPLES / f"{sample}.parquet"
    anon = _anonymize(src, tmp_path / "anon.parquet")
    original, _ = read_trace(src)
    names, hashes = _originals(original)
    assert names and hashes
    raw, raw_src = anon.read_bytes(), src.read_bytes()
    # the bytes of the file as written: a needle the original's bytes show must not be in the output's
    # (a name such as "tenant-0" can be the start of a pseudonym, "tenant-0f3a…": only the others are searched)
    texts = [n.encode() for n in names if not PSEUDONYM_PREFIX.match(n)]
    needles = texts + [int(h).to_bytes(8, "little") for h in hashes]
    seen = [n for n in needles if n in raw_src]
    assert any(n in seen for n in texts) and any(n not in texts for n in seen), (
        "the search must be able to find originals in a Parquet file's bytes"
    )
    assert [n for n in needles if n in raw] == []
    # and decoded (compression could hide a needle from a byte search): no value survives anywhere
    table, _ = read_trace(anon)
    text = json.dumps(table.to_pylist(), default=str) + str(pq.read_schema(anon).metadata)
    assert [n for n in names if f'"{n}"' in text] == []
    new_ids = set(pa.compute.list_flatten(table.column("block_hashes")).to_pylist())
    assert new_ids.isdisjoint(set(pa.compute.list_flatten(original.column("block_hashes")).to_pylist()))


def test_same_key_same_output_different_keys_share_no_block(tmp_path):
    src = SAMPLES / "multi-tenant.parquet"
    a = read_trace(_anonymize(src, tmp_path / "a.parquet", "k1"))
    b = read_trace(_anonymize(src, tmp_path / "b.parquet", "k1"))
    c = read_trace(_anonymize(src, tmp_path / "c.parquet", "k2"))
    assert a[0].equals(b[0]) and a[1].source == b[1].source
    ids = {k: set(pa.compute.list_flatten(t.column("block_hashes")).to_pylist()) for k, (t, _) in zip("ac", (a, c))}
    assert ids["a"].isdisjoint(ids["c"])
    tenants = {k: set(t.column("tenant").to_pylist()) for k, (t, _) in zip("ac", (a, c))}
    assert tenants["a"].isdisjoint(tenants["c"]) and all(t.startswith("tenant-") for t in tenants["a"])


def test_missing_key_is_one_line_exit_2_and_existing_output_needs_force(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "KVBENCH_TEST_ANON"}
    out = tmp_path / "a.parquet"
    cmd = ["kvbench", "trace", "anonymize", str(SAMPLES / "chat.parquet"), "-o", str(out), "--key-env"]
    r = subprocess.run([*cmd, "KVBENCH_TEST_ANON"], capture_output=True, text=True, env=env)
    assert r.returncode == 2 and not out.exists()
    assert len(r.stderr.strip().splitlines()) == 1 and "set KVBENCH_TEST_ANON" in r.stderr
    env["KVBENCH_TEST_ANON"] = "s"
    assert subprocess.run([*cmd, "KVBENCH_TEST_ANON"], env=env, capture_output=True).returncode == 0
    before = out.read_bytes()
    r = subprocess.run([*cmd, "KVBENCH_TEST_ANON"], capture_output=True, text=True, env=env)
    assert r.returncode == 2 and "--force" in r.stderr and out.read_bytes() == before
    r = subprocess.run([*cmd, "KVBENCH_TEST_ANON", "--force"], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr


def test_extra_columns_and_identifying_provenance_are_dropped():
    table = make_trace().append_column("external_parent_id", pa.array(["x-secret"] * 6))
    source = {"importer": "bailian", "file": "/home/alice/traffic.jsonl", "time_offset_s": 1.7e9, "reordered": False}
    out = anonymize(table, new_meta(4, source), anon_key(ANON_KEY_ENV, {ANON_KEY_ENV: "k"}))
    assert "external_parent_id" not in out.table.column_names and out.dropped_columns == ["external_parent_id"]
    assert out.dropped_source_keys == ["file", "time_offset_s"]
    assert {k: v for k, v in out.meta.source.items() if k != "anonymization"} == {
        "importer": "bailian",
        "reordered": False,
        "anonymized": True,
    }
    assert validate_table(out.table, 4).ok
    # parent_id and depends_on still name the (renamed) request before
    ids = out.table.column("request_id").to_pylist()
    assert out.table.column("parent_id").to_pylist() == [None] + ids[:-1]
    assert out.table.column("depends_on").to_pylist() == [[]] + [[i] for i in ids[:-1]]


def test_ids_written_as_integers_are_renamed_like_their_text():
    table = make_trace()
    ints = {c: pa.array([None if v is None else int(v[1:]) for v in table.column(c).to_pylist()], pa.int64())
            for c in ("request_id", "parent_id")}  # fmt: skip
    ints["depends_on"] = pa.array([[]] + [[str(i)] for i in range(5)], pa.list_(pa.string()))
    raw = pa.table({**{c: table.column(c) for c in table.column_names}, **ints})
    key = anon_key(ANON_KEY_ENV, {ANON_KEY_ENV: "k"})
    out = anonymize(raw, new_meta(4, {}), key)
    assert out.table.column("request_id").to_pylist() == [pseudonym(str(i), "req", key) for i in range(6)]
    assert validate_table(out.table, 4).ok


def test_written_and_read_back_the_trace_validates(tmp_path):
    table = make_trace()
    out = anonymize(table, new_meta(4, {}), anon_key(ANON_KEY_ENV, {ANON_KEY_ENV: "k"}), round_s=1.0)
    write_trace(out.table, tmp_path / "t.parquet", out.meta)
    back, meta = read_trace(tmp_path / "t.parquet")
    assert validate_table(back, meta.block_size).ok and meta.source["anonymized"] is True


def _same_equalities(a: np.ndarray, b: np.ndarray) -> bool:
    return bool(np.array_equal(a[:, None] == a[None, :], b[:, None] == b[None, :]))


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=8),
    st.lists(st.integers(0, 7), max_size=60),
    st.binary(min_size=1, max_size=16),
)
def test_rekeying_preserves_the_equality_structure(pool, picks, secret):
    ids = np.array([pool[p % len(pool)] for p in picks] + pool, dtype=np.uint64)  # repeats and distinct ids
    key = anon_key("K", {"K": secret.hex()})
    new = rekey(ids, key)
    assert _same_equalities(ids, new)
    names = [str(i) for i in ids]
    renamed = np.array([pseudonym(n, "user", key) for n in names])
    assert _same_equalities(np.array(names), renamed)
