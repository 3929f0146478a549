"""The video-kv scenario against arithmetic done by hand on traces of one or two requests
(docs/video-audio-kv.md).

The clip: 8 frames of 32 tokens (--video-frame-tokens 32) after 16 tokens of text and before 16 more, so a
prompt of 16 + 256 + 16 = 288 tokens, 18 blocks of 16 tokens. With --keyframe-interval 4 frames 0 and 4 are
keyframes; the 6 others are non-key. llama3-8b in bf16 holds 32 layers × 8 KV heads × 128 × 2 (K and V) × 2
bytes = 131,072 bytes of KV per token. Requests 10 s apart run alone; the policy is `lru` (no vLLM cap on the
hit), so a prompt cached in full is hit in full."""

from __future__ import annotations

import hashlib

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from kvbench.backends.enginesim.roofline import LatencyModel
from kvbench.backends.enginesim.scenarios._video_frames import layout, pruned_block_ids

from kvbench.errors import KvbenchError
from kvbench.models import resolve_hardware, resolve_model
from kvbench.run.rundir import fresh_dir
from kvbench.run.runner import run_replay
from kvbench.trace.files import new_meta, write_trace

BS = 16
KV_TOKEN = 32 * 8 * 128 * 2 * 2  # bytes of KV of one llama3-8b token
FRAME = 32
CLIP = 8 * FRAME
OPTS = dict(policy="lru", video_frame_tokens=FRAME, keyframe_interval=4)


def ids(name: str, n: int) -> list[int]:
    """n prefix-chained block ids of one prompt's content."""
    return [
        int.from_bytes(hashlib.blake2b(f"{name}/{i}".encode(), digest_size=8).digest(), "little") >> 1 for i in range(n)
    ]


def video_request(i: int, at: float, items: list[dict], out: int = 1, text: int = 16) -> dict:
    tokens = text + CLIP + text
    return {
        "request_id": f"r{i}",
        "arrival_s": at,
        "input_tokens": tokens,
        "output_tokens": out,
        "block_hashes": ids("clip-prompt", tokens // BS),  # every request here has the same prompt
        "mm_items": items,
    }


WHOLE_CLIP = [{"hash": 7, "modality": "video", "offset": 16, "tokens": CLIP}]


def frame_items(hashes) -> list[dict]:
    return [{"hash": h, "modality": "video", "offset": 16 + FRAME * k, "tokens": FRAME} for k, h in enumerate(hashes)]


def replay(tmp_path, name, rows, **opts):
    path = tmp_path / f"{name}.parquet"
    write_trace(pa.Table.from_pylist(rows), path, new_meta(BS, {"test": name}))
    run_dir, summary = run_replay(
        path, "engine-sim", OPTS | opts, out=fresh_dir(tmp_path / f"run-{name}"), report=False
    )
    return pq.read_table(run_dir / "requests.parquet").to_pydict(), summary["points"][0]


def facts(point):
    return point["engine"]["scenarios"]["video-kv"]


def test_half_similarity_drops_every_second_non_key_frame_and_its_blocks(tmp_path):
    # non-key frames 1 2 3 5 6 7 are m = 1..6; m is redundant when ⌊m/2⌋ > ⌊(m−1)/2⌋: m = 2, 4, 6, frames 2, 5, 7
    lay = layout(WHOLE_CLIP, FRAME, 4, 0.5, prune=True)
    assert [k for k, f in enumerate(lay.frames) if f.redundant] == [2, 5, 7]
    assert lay.removed == [(16 + 64, 16 + 96), (16 + 160, 16 + 192), (16 + 224, 16 + 256)]
    rows = [video_request(0, 0.0, WHOLE_CLIP), video_request(1, 10.0, WHOLE_CLIP)]
    base, _ = replay(tmp_path, "base", rows, frame_similarity="0")  # nothing redundant: the run without pruning
    dedup, point = replay(tmp_path, "dedup", rows, frame_similarity="0.5")
    # 288 − 3 × 32 = 192 tokens are left: the first request computes them, the second hits all 12 blocks
    assert base["hit_tokens"] == [0, 288] and dedup["hit_tokens"] == [0, 192]
    f = facts(point)
    assert (f["video_frames"], f["keyframes"], f["redundant_frames"]) == (16, 4, 6)  # two requests
    assert f["redundant_share_of_non_key_frames"] == 6 / 12
    # KV written once per request: 256 video tokens each, 160 kept
    assert f["video_kv_written_bytes"] == {"all_frames": 2 * 256 * KV_TOKEN, "deduplicated": 2 * 160 * KV_TOKEN}
    assert f["kv_write_bytes_saved"] == 2 * 96 * KV_TOKEN
    assert f["capacity_saved_share"] == 96 / 256
    assert f["video_kv_held_peak_bytes"] == {"all_frames": 256 * KV_TOKEN, "deduplicated": 160 * KV_TOKEN}
    assert f["prompt_tokens_removed_share"] == 192 / 576
    # TTFT of the lone first request: the roofline's prefill of the 192 kept tokens (its answer is 1 token)
    lat = LatencyModel(resolve_model("llama3-8b"), resolve_hardware("h100"))
    assert dedup["ttft_s"][0] == pytest.approx(lat.prefill_s(192, 0))
    assert base["ttft_s"][0] == pytest.approx(lat.prefill_s(288, 0))


def test_a_follow_up_turn_hits_the_whole_pruned_prompt_before_it(tmp_path):
    # r1 is r0's prompt plus 32 tokens of text: 320 tokens, 20 blocks, the first 18 r0's. Pruned, r0 is 192 tokens
    # in 12 whole blocks; r1's first 12 pruned blocks end at the same original token (287, place 15 of block 17),
    # so they get r0's pruned ids and r1 hits all 192 tokens, then computes its 32 new ones
    first = video_request(0, 0.0, WHOLE_CLIP)
    longer = {**video_request(1, 10.0, WHOLE_CLIP), "input_tokens": 320}
    longer["block_hashes"] = first["block_hashes"] + ids("follow-up", 2)
    rows, _ = replay(tmp_path, "follow-up", [first, longer], frame_similarity="0.5")
    assert rows["hit_tokens"] == [0, 192]


def test_measured_similarity_counts_non_key_frames_that_repeat_the_frame_before(tmp_path):
    # frames 0..7 with hashes A A B B B C D D: frames 1, 3 and 7 repeat the one before (frame 4 too, but is a key)
    items = frame_items([1, 1, 2, 2, 2, 3, 4, 4])
    lay = layout(items, FRAME, 4, "measured", prune=True)
    assert [k for k, f in enumerate(lay.frames) if f.redundant] == [1, 3, 7]
    _, point = replay(tmp_path, "measured", [video_request(0, 0.0, items)], frame_similarity="measured")
    f = facts(point)
    assert f["frame_similarity"] == "measured" and f["redundant_share_of_non_key_frames"] == 3 / 6
    assert f["kv_write_bytes_saved"] == 3 * FRAME * KV_TOKEN


def test_pruned_block_ids_keep_the_untouched_prefix_and_name_the_rest_by_their_last_token():
    # 64 tokens in 4 blocks; removing tokens 20..28 leaves 56 tokens: block 0 (0..15) is untouched and keeps its
    # id; pruned block 1 (tokens 16..31) ends at original token 31 + 8 = 39, place 7 of original block 2; block 2
    # ends at 47 + 8 = 55, place 7 of block 3; block 3 (pruned 48..55) at 63, place 15 of block 3
    original = [10, 11, 12, 13]
    seen = []

    def mix(src, place, index):
        seen.extend(zip(src.tolist(), place.tolist(), index.tolist()))
        return src * 0 + 100 + index

    out = pruned_block_ids(original, 64, [(20, 28)], 16, mix)
    assert out == [10, 101, 102, 103]
    assert seen == [(12, 7, 1), (13, 7, 2), (13, 15, 3)]


def test_keyframe_attention_reads_keyframes_out_of_frames(tmp_path):
    # a prompt that is all video: 8 frames, 2 keyframes: attention over it reads 2/8 of its KV
    rows = [{**video_request(0, 0.0, [{**WHOLE_CLIP[0], "offset": 0}], out=3, text=0)}]
    rows[0]["input_tokens"], rows[0]["block_hashes"] = CLIP, ids("all-video", CLIP // BS)
    lay = layout(rows[0]["mm_items"], FRAME, 4, None, prune=False)
    assert sum(b - a for a, b in lay.skipped) / CLIP == 1 - 2 / 8
    plain, _ = replay(tmp_path, "dense", rows, frame_similarity="0")  # on, nothing removed: the dense run
    sparse, point = replay(tmp_path, "sparse", rows, keyframe_attention=True)
    f = facts(point)
    # the prefill reads no cached context; then 2 decodes over contexts 256 and 257 (one window of mean 256.5):
    # 513 tokens read, of which 2 × 192 non-key frame tokens are skipped
    assert f["attention_kv_read_bytes"] == {"all_frames": 513 * KV_TOKEN, "keyframes_only": 129 * KV_TOKEN}
    assert f["attention_read_saved_share"] == 384 / 513 and f["unmatched_steps"] == 0
    lat = LatencyModel(resolve_model("llama3-8b"), resolve_hardware("h100"))
    saved = 2 * (lat.step_s([], [256.5]) - lat.step_s([], [64.5]))
    assert f["attention_step_s_saved"] == pytest.approx(saved)
    # the decodes are that much faster: same TTFT, TPOT down by saved / 2 per token
    assert sparse["ttft_s"] == pytest.approx(plain["ttft_s"])
    assert sparse["tpot_s"][0] == pytest.approx(plain["tpot_s"][0] - saved / 2)


@pytest.mark.parametrize(
    "opts, words",
    [
        (dict(frame_similarity="1.5"), "a number from 0 to 1"),
        (dict(frame_similarity="most"), "a number from 0 to 1"),
        (dict(frame_similarity="0.8", keyframe_interval=0), "--keyframe-interval"),
        (dict(keyframe_attention=True, video_frame_tokens=0), "--video-frame-tokens"),
        (dict(frame_similarity="0.8", mm_cache="prefix"), "use one of them"),
        (dict(frame_similarity="measured"), "--video-frame-items"),  # whole clips have no frame hashes
    ],
)
def test_bad_options_say_what_to_fix(tmp_path, opts, words):
    with pytest.raises(KvbenchError, match=words):
        replay(tmp_path, "bad", [video_request(0, 0.0, WHOLE_CLIP)], **opts)


def test_a_trace_without_video_is_refused(tmp_path):
    row = video_request(0, 0.0, [{"hash": 1, "modality": "image", "offset": 16, "tokens": 576 - 320}])
    with pytest.raises(KvbenchError, match="no request of this trace has a video item"):
        replay(tmp_path, "novideo", [row], keyframe_attention=True)
