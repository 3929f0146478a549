"""The multimodal generator's video frames and voice turns (docs/video-audio-kv.md), checked against arithmetic
done by hand: a clip is its duration × tokens per second, cut into frames of tokens/s ÷ frames/s; a spoken turn
is its duration × audio tokens per second, followed by a few tokens of text and then the answer."""

from __future__ import annotations

import numpy as np
import pytest

from kvbench.errors import KvbenchError
from kvbench.trace.generators import get
from kvbench.trace.validation import validate_table

BS = 64
# Clips of exactly 4 s: a log-normal of mean 1000 s is below 4 s with probability ~1e-10, so the 4 s cap holds.
FOUR_SECOND_CLIPS = dict(video_s_mean=1000.0, video_max_s=4.0, image_share=0.0, audio_share=0.0, video_share=1.0)


def _gen(n=400, seed=5, **overrides):
    table, meta = get("multimodal").run(n, seed=seed, block_size=BS, **overrides)
    assert validate_table(table, meta.block_size).ok
    return table


def _items(table, modality=None):
    """(row, item) for every mm_items entry, of one modality if given."""
    return [
        (r, it)
        for r, row in enumerate(table.column("mm_items").to_pylist())
        for it in row or ()
        if modality is None or it["modality"] == modality
    ]


def test_a_clip_is_its_duration_times_tokens_per_second():
    table = _gen(video_tokens_per_s=2000.0, **FOUR_SECOND_CLIPS)
    tokens = {it["tokens"] for _, it in _items(table, "video")}
    assert tokens == {4 * 2000}


def test_frame_items_cut_each_clip_into_frames_of_rate_over_fps():
    # 2000 tokens/s at 2 frames/s: frames of 1000 tokens, 8 per 4 s clip, back to back
    whole = _gen(video_tokens_per_s=2000.0, **FOUR_SECOND_CLIPS)
    frames = _gen(video_tokens_per_s=2000.0, video_frame_items=True, **FOUR_SECOND_CLIPS)
    assert whole.column("block_hashes").equals(frames.column("block_hashes"))  # the prompts are the same
    for (r, clip), start in zip(_items(whole, "video"), range(0, 10**9, 8)):
        run = _items(frames, "video")[start : start + 8]
        assert {row for row, _ in run} == {r}
        assert [f["tokens"] for _, f in run] == [1000] * 8
        assert [f["offset"] for _, f in run] == [clip["offset"] + 1000 * k for k in range(8)]
    assert len(_items(frames, "video")) == 8 * len(_items(whole, "video"))


def test_a_frame_rate_that_does_not_divide_leaves_a_short_last_frame():
    # 1000 tokens/s at 3 frames/s: round(333.3) = 333 tokens a frame; 4000 tokens = 12 × 333 + 4
    table = _gen(n=50, video_tokens_per_s=1000.0, video_fps=3.0, video_frame_items=True, **FOUR_SECOND_CLIPS)
    video = [it["tokens"] for _, it in _items(table, "video")]
    assert len(video) % 13 == 0 and video[:13] == [333] * 12 + [4]


def test_repeated_frames_share_the_previous_frames_hash_at_the_given_rate():
    table = _gen(n=2_000, video_frame_items=True, video_frame_repeat=0.8, **FOUR_SECOND_CLIPS)
    frames = _items(table, "video")
    # 1152 tokens/s (default) at 2 frames/s: 576-token frames, 8 per clip; frames 1..7 may repeat frame k−1
    hashes = np.array([it["hash"] for _, it in frames], dtype=np.uint64).reshape(-1, 8)
    repeats = hashes[:, 1:] == hashes[:, :-1]
    assert abs(repeats.mean() - 0.8) < 0.03
    # a clip's frames depend on the clip only: every copy of its first frame has the same 7 after it
    first = {}
    for clip in hashes:
        assert tuple(first.setdefault(int(clip[0]), tuple(clip.tolist()))) == tuple(clip.tolist())
    still = _gen(n=200, video_frame_items=True, **FOUR_SECOND_CLIPS)
    hashes = np.array([it["hash"] for _, it in _items(still, "video")], dtype=np.uint64).reshape(-1, 8)
    assert not np.any(hashes[:, 1:] == hashes[:, :-1])  # no repeat unless asked for


def test_voice_turns_interleave_audio_and_text():
    # every session spoken, every turn 3 s at 100 tokens/s = 300 audio tokens then 8 tokens of text; no other media
    table = _gen(
        n=600,
        voice_session_share=1.0,
        voice_turn_s_mean=1000.0,
        voice_turn_s_max=3.0,
        audio_tokens_per_s=100.0,
        text_only_share=1.0,
        followup_media_share=0.0,
        turns_mean=3.0,
    )
    rows = {rid: r for r, rid in enumerate(table.column("request_id").to_pylist())}
    out = table.column("output_tokens").to_pylist()
    parents, turns = table.column("parent_id").to_pylist(), table.column("turn").to_pylist()
    inp = table.column("input_tokens").to_pylist()
    checked = 0
    for r, row in enumerate(table.column("mm_items").to_pylist()):
        assert [it["modality"] for it in row] == ["audio"] * (turns[r] + 1)  # one clip per turn so far
        assert {it["tokens"] for it in row} == {300}
        assert inp[r] == row[-1]["offset"] + 300 + 8  # the prompt ends with this turn's clip and its 8 tokens
        if parents[r] is not None:
            p = rows[parents[r]]
            # after the previous turn's clip: its 8 tokens of text, then that turn's answer, then this clip
            assert row[-1]["offset"] == row[-2]["offset"] + 300 + 8 + out[p]
            assert row[:-1] == table.column("mm_items")[p].as_py()
            checked += 1
    assert checked > 100
    hashes = [it["hash"] for _, it in _items(table)]
    assert len(set(hashes)) == table.num_rows  # one new utterance per request, never reused


def test_audio_tokens_scale_with_the_rate():
    spoken = dict(voice_session_share=1.0, voice_turn_s_mean=1000.0, voice_turn_s_max=2.0, text_only_share=1.0)
    spoken |= dict(followup_media_share=0.0)
    for rate in (50.0, 100.0):
        table = _gen(n=100, audio_tokens_per_s=rate, **spoken)
        assert {it["tokens"] for _, it in _items(table, "audio")} == {int(2 * rate)}


def test_the_new_options_off_leave_the_trace_as_it_was():
    plain = _gen(n=500)
    off = _gen(n=500, video_frame_items=False, voice_session_share=0.0, video_fps=5.0, voice_turn_s_mean=9.0)
    assert plain.equals(off)


@pytest.mark.parametrize(
    "opts, words",
    [
        (dict(video_frame_repeat=0.5), "--video-frame-repeat needs --video-frame-items"),
        (dict(video_fps=0.0), "--video-fps"),
        (dict(voice_session_share=1.5), "--voice-session-share"),
        (dict(voice_text_tokens=0), "--voice-text-tokens"),
    ],
)
def test_bad_parameters_say_what_to_fix(opts, words):
    with pytest.raises(KvbenchError, match=words):
        get("multimodal").run(10, seed=1, block_size=BS, **opts)
