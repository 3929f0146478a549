"""Prompt synthesis from block ids, `trace rebase`, and `kvbench compare` of a sim run and a live run."""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pyarrow.compute as pc
import pytest

from kvbench.live.prompts import rebase_blocks, words
from kvbench.run.runner import run_replay
from kvbench.trace.files import read_trace
from kvbench.trace.tokens import RESERVED_TOKENS, prompt_tokens

from ...conftest import CHAT, REPO

MM = REPO / "traces/samples/multimodal.parquet"


def _prompts(table, block_size, vocab=4096):
    hashes = table.column("block_hashes").to_pylist()
    inp = table.column("input_tokens").to_pylist()
    mm = table.column("mm_items").to_pylist()
    return [prompt_tokens(np.array(h, np.uint64), n, block_size, vocab, m) for h, n, m in zip(hashes, inp, mm)]


@pytest.mark.parametrize("path", [CHAT, MM], ids=["chat", "multimodal"])
def test_equal_block_ids_give_equal_tokens_and_nothing_else(path):
    table, meta = read_trace(path)
    bs = meta.block_size
    prompts = _prompts(table.slice(0, 300), bs)
    hashes = table.slice(0, 300).column("block_hashes").to_pylist()
    seen = {}
    for p, h, n in zip(prompts, hashes, table.column("input_tokens").to_pylist()):
        assert len(p) == n and p.min() >= RESERVED_TOKENS and p.max() < 4096
        for j, block_id in enumerate(h[: n // bs]):  # full blocks, keyed like an engine: previous block + tokens
            key = (h[j - 1] if j else None, tuple(p[j * bs : (j + 1) * bs]))
            assert seen.setdefault(block_id, key) == key
    by_key = {}
    for block_id, key in seen.items():
        assert by_key.setdefault(key, block_id) == block_id  # a different prefix is never the same tokens
    again = _prompts(table.slice(0, 300), bs)
    assert all(np.array_equal(a, b) for a, b in zip(prompts, again))  # deterministic


def test_same_media_is_the_same_tokens_wherever_it_appears():
    table, meta = read_trace(MM)
    items = table.column("mm_items").to_pylist()
    prompts = _prompts(table, meta.block_size)
    runs = {}
    for p, its in zip(prompts, items):
        for it in its or ():
            span = tuple(p[it["offset"] : it["offset"] + it["tokens"]])
            assert runs.setdefault(it["hash"], span) == span


def test_words_are_one_per_token():
    assert words(np.array([17, 4000])) == "w17 w4000"


def test_rebase_keeps_prefix_sharing_and_counts():
    """(tests/unit/trace/test_rebase.py checks the ids against a token-hashing prefix cache)"""
    table, meta = read_trace(CHAT)
    for engine_block in (16, 48):  # a block size need not divide the trace's: the ids come from the tokens
        re = rebase_blocks(table, meta.block_size, engine_block)
        counts = pc.list_value_length(re).to_numpy()
        assert np.array_equal(counts, -(-table.column("input_tokens").to_numpy() // engine_block))
    with pytest.raises(ValueError, match="positive"):
        rebase_blocks(table, meta.block_size, 0)


def test_compare_shows_the_fidelity_gap(fake_server, tmp_path):
    """A live run against a server with 16-token blocks, and the vllm policy on the trace re-cut at 16 with a
    capacity no request can exhaust: every request's prediction equals what the server reported."""
    srv = fake_server(block_size=16)
    live, _ = run_replay(
        CHAT,
        "openai",
        {"url": srv.url, "mode": "rate", "rate": 200.0, "max_requests": 200, "max_concurrency": 1},
        out=tmp_path / "live",
        report=False,
    )
    subprocess.run(
        ["kvbench", "trace", "rebase", CHAT, "--block-size", "16", "-o", tmp_path / "c16.parquet"], check=True
    )
    sim, _ = run_replay(
        tmp_path / "c16.parquet",
        "sim",
        {"policy": "vllm", "capacity": "10000000", "bound": False},
        out=tmp_path / "sim",
        report=False,
    )
    # the live run covers the first 200 requests: compare those
    r = subprocess.run(["kvbench", "compare", live, sim, "--json"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    assert {row["backend"] for row in result["runs"]} == {"openai", "sim"}
    (fid,) = result["fidelity"]
    assert fid["requests compared"] == 200 and fid["requests equal"] == 1.0
    text = subprocess.run(["kvbench", "compare", live, sim], capture_output=True, text=True).stdout
    assert "Fidelity: predicted vs measured" in text and "| openai | live |" in text


def test_batched_synthesis_equals_per_request():
    from kvbench.trace.tokens import prompt_tokens_batch

    table, meta = read_trace(CHAT)
    table = table.slice(100, 300)
    hashes = table.column("block_hashes").combine_chunks()
    offsets = np.asarray(hashes.offsets) - hashes.offsets[0].as_py()
    flat = np.asarray(hashes.flatten())
    tokens, starts = prompt_tokens_batch(flat, offsets[:-1], table.column("input_tokens").to_numpy(), 64, 4096)
    for r, p in enumerate(_prompts(table, meta.block_size)):
        assert np.array_equal(tokens[starts[r] : starts[r + 1]], p)
