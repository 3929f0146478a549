"""Where the frames of a request's video lie, which are keyframes and which repeat the frame before: the layout
the video-kv scenario (video_kv.py) prunes and reads a prompt by (docs/video-audio-kv.md).

A video item longer than a frame (`frame_tokens`) is one whole clip: it is cut into frames of `frame_tokens`
(the last one shorter). An item no longer than a frame is one frame, and consecutive such items that touch
(one ends where the next begins) are the frames of one clip, as `kvbench trace gen multimodal
--video-frame-items` writes them. Frame j of a clip is a keyframe when j is a multiple of the keyframe interval.

A non-key frame is redundant either
- by a given similarity S: of a clip's M non-key frames, the m-th (m = 1..M) is redundant when ⌊m·S⌋ > ⌊(m−1)·S⌋,
  so exactly ⌊M·S⌋ of them are, spread evenly (no draw: a reader can count them, and every copy of a clip
  loses the same frames, so copies keep sharing their KV blocks), or
- measured: its frame hash equals the previous frame's (an exact repeat). A whole-clip item has no frame
  hashes to compare, so measured similarity needs frame items.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass, field

import numpy as np

from kvbench.errors import KvbenchError

MEASURED = "measured"
_EPS = 1e-9  # ⌊m·S⌋ of a share written in decimal (0.7 · 10 is 7.000000000000001, 0.29 · 100 is 28.999999999999996)


@dataclass
class Frame:
    start: int  # token offset in the prompt
    tokens: int
    key: bool
    redundant: bool


@dataclass
class VideoLayout:
    """One prompt's video frames, and the same prompt with its redundant frames' tokens removed."""

    frames: list[Frame] = field(default_factory=list)
    removed: list[tuple[int, int]] = field(default_factory=list)  # [start, end) token runs dropped, in order
    skipped: list[tuple[int, int]] = field(default_factory=list)  # kept non-key frames, in the pruned prompt

    @property
    def video_tokens(self) -> int:
        return sum(f.tokens for f in self.frames)

    @property
    def removed_tokens(self) -> int:
        return sum(b - a for a, b in self.removed)

    def skip_prefix(self) -> tuple[list[int], list[int]]:
        """Starts of the kept non-key frames and the tokens of those before each (for `skipped_before`)."""
        starts, before, total = [], [], 0
        for a, b in self.skipped:
            starts.append(a)
            before.append(total)
            total += b - a
        return starts, before


def parse_similarity(text) -> float | str | None:
    """--frame-similarity as a share in [0, 1], 'measured', or None (off)."""
    if text is None:
        return None
    if str(text).strip().lower() == MEASURED:
        return MEASURED
    try:
        share = float(text)
    except ValueError:
        share = math.nan
    if not 0 <= share <= 1:
        raise KvbenchError(
            f"--frame-similarity {text!r}: give the share of non-key frames that repeat the previous one, a "
            "number from 0 to 1 (e.g. 0.8), or 'measured' to count repeated frame hashes in the trace"
        )
    return share


def clips(items, frame_tokens: int) -> list[list[tuple[int, int, int | None]]]:
    """The video clips of a prompt's `mm_items`, each a list of frames (offset, tokens, frame hash or None)."""
    out: list[list[tuple[int, int, int | None]]] = []
    end = None  # where the last frame item ended: a frame item starting there continues its clip
    for it in sorted((i for i in items or () if i["modality"] == "video"), key=lambda i: i["offset"]):
        offset, tokens = int(it["offset"]), int(it["tokens"])
        if tokens > frame_tokens:  # a whole clip
            out.append(
                [
                    (s, min(frame_tokens, offset + tokens - s), None)
                    for s in range(offset, offset + tokens, frame_tokens)
                ]
            )
            end = None
            continue
        if end is None or offset != end:
            out.append([])
        out[-1].append((offset, tokens, it["hash"]))
        end = offset + tokens
    return out


def layout(items, frame_tokens: int, interval: int, similarity, prune: bool) -> VideoLayout:
    """A prompt's video layout: keyframes every `interval` frames, redundant frames by `similarity` (a share or
    MEASURED; None: none), their tokens removed when `prune`."""
    lay = VideoLayout()
    for clip in clips(items, frame_tokens):
        non_key = 0
        for j, (start, tokens, h) in enumerate(clip):
            key = j % interval == 0
            redundant = False
            if not key and similarity is not None:
                non_key += 1
                if similarity == MEASURED:
                    if h is None:
                        raise KvbenchError(
                            "--frame-similarity measured compares frame hashes, and this trace lists whole video "
                            "clips: generate it with `kvbench trace gen multimodal --video-frame-items`, or give "
                            "the similarity as a share (e.g. --frame-similarity 0.8)"
                        )
                    redundant = h == clip[j - 1][2]
                else:
                    redundant = math.floor(non_key * similarity + _EPS) > math.floor((non_key - 1) * similarity + _EPS)
            lay.frames.append(Frame(start, tokens, key, redundant))
    gone = 0  # tokens removed before the frame at hand
    for f in lay.frames:
        if prune and f.redundant:
            lay.removed.append((f.start, f.start + f.tokens))
            gone += f.tokens
        elif not f.key:
            lay.skipped.append((f.start - gone, f.start - gone + f.tokens))
    return lay


def skipped_before(starts: list[int], before: list[int], ends: list[int], context: float) -> float:
    """Tokens of the kept non-key frames among the first `context` tokens of the pruned prompt."""
    i = bisect_right(starts, context)
    if i == 0:
        return 0
    return before[i - 1] + min(ends[i - 1], context) - starts[i - 1]


def pruned_block_ids(block_ids: list[int], tokens: int, removed: list[tuple[int, int]], bs: int, mix) -> list[int]:
    """Block ids of a prompt of `tokens` tokens with the runs `removed` taken out. A block whose tokens are those
    of the original block at its place keeps its id; any other is named by the original block holding its last
    token, that token's place in it and the block's index (`mix` hashes them), so two prompts get equal ids
    wherever their pruned prefixes are equal, as long as they agree up to the end of that original block."""
    kept = tokens - sum(b - a for a, b in removed)
    out, i, shift = [], 0, 0  # removed[:i] lie before the block's last token, `shift` tokens in all
    renamed, src, place = [], [], []  # the blocks to rename, hashed together at the end (one vector call)
    for j in range(-(-kept // bs)):
        last = min((j + 1) * bs, kept) - 1  # in the pruned prompt
        while i < len(removed) and removed[i][0] <= last + shift:  # its place in the original prompt
            shift += removed[i][1] - removed[i][0]
            i += 1
        p = last + shift
        if p == last and p + 1 == min((j + 1) * bs, tokens):
            out.append(block_ids[j])
        else:
            out.append(0)
            renamed.append(j)
            src.append(block_ids[p // bs])
            place.append(p % bs)
    if renamed:
        for j, new_id in zip(
            renamed, mix(np.array(src, np.uint64), np.array(place, np.uint64), np.array(renamed, np.uint64)).tolist()
        ):
            out[j] = new_id
    return out
