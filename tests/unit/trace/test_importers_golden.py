"""The Bailian and kv-cache-tester importers give, for small committed inputs, exactly the table and metadata
they gave when the expected files in tests/data/importers/ were written (before their readers were split into
named steps): same columns, types, values, row order and source metadata."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from kvbench.trace.importers import get

TESTS = Path(__file__).resolve().parents[2]
FIXTURES = TESTS / "fixtures"
EXPECTED = TESTS / "data" / "importers"
META_KEY = b"kvbench_test_meta"

CASES = {
    "bailian_default": ("bailian", FIXTURES / "bailian_sample.jsonl", {}),
    "bailian_chat_ms": ("bailian", FIXTURES / "bailian_sample.jsonl", {"workload": "chat", "time_unit": "ms"}),
    # 4 conversations: sub-agents (nested), a shifted start, local and global id scopes, one rechained
    "kvct_dir_stagger": ("kv-cache-tester", FIXTURES / "kv_cache_tester_sample", {"stagger_s": 10.0}),
    "kvct_file": ("kv-cache-tester", FIXTURES / "kv_cache_tester_sample" / "a.json", {}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_import_matches_the_recorded_table(case):
    importer, src, options = CASES[case]
    table, meta = get(importer).read(src, **options)
    expected = pq.read_table(EXPECTED / f"{case}.parquet")
    recorded = json.loads(expected.schema.metadata[META_KEY])
    expected = expected.replace_schema_metadata({k: v for k, v in expected.schema.metadata.items() if k != META_KEY})
    assert table.schema.remove_metadata().equals(expected.schema.remove_metadata())
    assert table.to_pylist() == expected.to_pylist()
    assert table.equals(expected.replace_schema_metadata(table.schema.metadata))
    assert {"block_size": meta.block_size, "source": json.loads(json.dumps(meta.source))} == recorded
