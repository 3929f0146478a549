"""The multimodal generator: media items are reusable by content, well-formed, Zipf-popular and sized per modality."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from kvbench.trace.generators import get
from kvbench.trace.validation import validate_table

BS = 64


def _gen(n=20_000, seed=7, **overrides):
    return get("multimodal").run(n, seed=seed, block_size=BS, **overrides)


@pytest.fixture(scope="module")
def trace():
    return _gen()


def _items(table: pa.Table) -> dict[str, np.ndarray]:
    """Flat mm_items with the row each item belongs to."""
    mm = table.column("mm_items").combine_chunks()
    flat = pc.list_flatten(mm)
    return {
        "row": np.asarray(pc.list_parent_indices(mm)),
        "hash": np.asarray(flat.field("hash")),
        "modality": np.asarray(flat.field("modality").to_numpy(zero_copy_only=False)),
        "offset": np.asarray(flat.field("offset")).astype(np.int64),
        "tokens": np.asarray(flat.field("tokens")).astype(np.int64),
    }


def test_table_validates_and_has_the_columns(trace):
    table, meta = trace
    report = validate_table(table, meta.block_size)
    assert report.ok, report.summary()
    assert table.num_rows == 20_000
    assert pc.all(pc.starts_with(table.column("request_id"), "mm-")).as_py()
    assert set(table.column("workload").to_pylist()) == {"multimodal"}
    assert table.column("session_id").null_count == 0 and table.column("turn").null_count == 0


def test_deterministic_per_seed(trace):
    table, _ = trace
    again, _ = _gen()
    other, _ = _gen(seed=8)
    assert table.equals(again)
    assert not table.equals(other)


def test_mm_items_are_well_formed(trace):
    table, _ = trace
    it = _items(table)
    inp = np.asarray(table.column("input_tokens")).astype(np.int64)
    assert it["hash"].size > 0
    assert set(np.unique(it["modality"])) == {"image", "video", "audio"}
    assert np.all(it["offset"] >= 0) and np.all(it["tokens"] > 0)
    assert np.all(it["offset"] + it["tokens"] <= inp[it["row"]])
    # Items of one prompt are in order and never overlap.
    same_row = it["row"][1:] == it["row"][:-1]
    assert np.all((it["offset"][:-1] + it["tokens"][:-1] <= it["offset"][1:])[same_row])
    # Equal hash <=> equal content: one length and one modality per hash.
    order = np.argsort(it["hash"], kind="stable")
    h, tok, mod = it["hash"][order], it["tokens"][order], it["modality"][order]
    dup = h[1:] == h[:-1]
    assert np.all(tok[1:][dup] == tok[:-1][dup]) and np.all(mod[1:][dup] == mod[:-1][dup])


def test_same_image_after_same_prefix_gives_same_block_ids():
    # One system prompt: every first turn is system prompt + its first item, so equal first items must
    # give identical ids over every block that ends inside the item.
    table, meta = _gen(n=5_000, system_prompts=1, video_share=0.0, audio_share=0.0)
    it = _items(table)
    turn = np.asarray(table.column("turn"))
    first = np.ones(it["row"].size, dtype=bool)
    first[1:] = it["row"][1:] != it["row"][:-1]
    sel = first & (turn[it["row"]] == 0)
    rows, hashes, ends = it["row"][sel], it["hash"][sel], (it["offset"] + it["tokens"])[sel]
    popular = np.bincount(np.unique(hashes, return_inverse=True)[1]).argmax()
    popular_hash = np.unique(hashes)[popular]
    group = rows[hashes == popular_hash]
    assert group.size >= 10
    covered = int(ends[hashes == popular_hash][0]) // meta.block_size
    assert covered >= 4  # the image spans several whole blocks
    ids = [table.column("block_hashes")[int(r)].as_py()[:covered] for r in group]
    assert all(x == ids[0] for x in ids)
    # A different image after the same prefix diverges inside the image.
    other = rows[hashes != popular_hash][0]
    other_ids = table.column("block_hashes")[int(other)].as_py()
    offset = int(it["offset"][sel][0])
    assert other_ids[offset // meta.block_size + 1] != ids[0][offset // meta.block_size + 1]


def test_follow_up_turn_extends_its_parent_prompt(trace):
    table, meta = trace
    rows = {rid: i for i, rid in enumerate(table.column("request_id").to_pylist())}
    parents = table.column("parent_id").to_pylist()
    hashes, mm, inp = table.column("block_hashes"), table.column("mm_items"), table.column("input_tokens")
    checked = 0
    for child, parent in enumerate(parents):
        if parent is None:
            continue
        p = rows[parent]
        full = inp[p].as_py() // meta.block_size
        assert hashes[child].as_py()[:full] == hashes[p].as_py()[:full]
        parent_items = mm[p].as_py()
        assert mm[child].as_py()[: len(parent_items)] == parent_items  # history keeps media at its offsets
        checked += 1
        if checked == 200:
            break
    assert checked == 200


def test_reuse_follows_zipf_popularity(trace):
    table, _ = trace
    it = _items(table)
    first_turn = np.asarray(table.column("turn"))[it["row"]] == 0  # count each attachment once
    images = it["hash"][first_turn & (it["modality"] == "image")]
    counts = np.sort(np.unique(images, return_counts=True)[1])[::-1]
    assert counts[0] >= 20 * np.median(counts)
    # Several requests share the most popular image, so its KV is reusable across requests.
    assert counts[0] > 0.05 * images.size


def test_token_counts_per_modality_are_in_documented_ranges(trace):
    table, _ = trace
    it = _items(table)
    img = it["tokens"][it["modality"] == "image"]
    assert set(np.unique(img)) <= {256, 576, 729, 1024}
    video = it["tokens"][it["modality"] == "video"]
    assert video.min() >= 1152 and video.max() <= 1152 * 60  # 1..60 s at 1152 tokens/s
    audio = it["tokens"][it["modality"] == "audio"]
    assert audio.min() >= 50 and audio.max() <= 50 * 300  # 1..300 s at 50 tokens/s
    # The per-second rates are parameters.
    fast, _ = _gen(n=3_000, video_tokens_per_s=5000.0, video_max_s=10.0, audio_tokens_per_s=100.0)
    it = _items(fast)
    video = it["tokens"][it["modality"] == "video"]
    assert video.min() >= 5000 and video.max() <= 50_000
    assert it["tokens"][it["modality"] == "audio"].min() >= 100


def test_text_only_share():
    table, _ = _gen(n=10_000, text_only_share=0.3)
    n_items = np.asarray(pc.list_value_length(table.column("mm_items")))
    first = np.asarray(table.column("turn")) == 0
    assert abs((n_items[first] == 0).mean() - 0.3) < 0.03
    table, _ = _gen(n=2_000, text_only_share=1.0, followup_media_share=0.0)
    assert pc.sum(pc.list_value_length(table.column("mm_items"))).as_py() == 0


def test_image_only_mix_and_custom_resolutions():
    table, _ = _gen(n=2_000, video_share=0.0, audio_share=0.0, image_token_choices="100,200")
    it = _items(table)
    assert set(np.unique(it["modality"])) == {"image"}
    assert set(np.unique(it["tokens"])) == {100, 200}
