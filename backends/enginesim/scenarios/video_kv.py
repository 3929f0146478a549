"""Video KV what-ifs (docs/video-audio-kv.md): a video prompt carries 1K-10K tokens per second of clip, and
adjacent frames are largely the same picture.

`--frame-similarity S` (a share, or `measured` from repeated frame hashes): the redundant non-key frames
(_video_frames.py says which) are deduplicated against the frame before them: their tokens are taken out of the
prompt before the engine sees it, as video token-pruning methods drop them before the LLM, so their KV is
never computed, held, moved between tiers or read. The pool then holds fewer blocks per video request; the
blocks after the first removed frame are renamed (_video_frames.pruned_block_ids) so copies of a clip still
share them. KV compression by the same ratio saves the same capacity and bytes moved, but would still compute
the frames (not modelled).

`--keyframe-attention`: attention over a video item reads only its keyframes' KV (one frame in
`--keyframe-interval`); the other frames' KV is still computed and held. Every step's prefill pieces and decodes
read their context less the non-key frame tokens in it: the step costs `LatencyModel.step_s` of those shorter
contexts (fewer KV bytes through HBM, fewer attention pairs), charged through `step_extra_s`.

Reported under engine.scenarios.video-kv: the video frames and tokens of the trace's prompts, the video KV
written and the peak held on an instance with and without the pruning, and the attention KV read with and
without keyframe-only attention, with the step time it saved. TTFT/TPOT change: replay without the options and
compare the points (`kvbench report compare`)."""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa
from kvbench.backends.enginesim.scenarios import Scenario, scenario
from kvbench.backends.enginesim.scenarios._video_frames import (
    layout,
    parse_similarity,
    pruned_block_ids,
    skipped_before,
)

from kvbench.errors import KvbenchError
from kvbench.options import cli_options, option
from kvbench.trace.blockhash import mix, name_key

DEFAULT_FRAME_TOKENS = 576  # LLaVA-style 24x24 patches per frame: 1152 tokens/s at 2 frames/s, the generator's default
DEFAULT_KEYFRAME_INTERVAL = 4  # one keyframe per 2 s at 2 frames/s
_PRUNED_KEY = name_key("video-kv", "pruned-block")


@dataclass(frozen=True)
class VideoKvOptions:
    """The engine-sim options of the VideoKv scenario."""

    frame_similarity: str | None = option(
        None,
        "deduplicate video frames: this share of each clip's non-key frames repeats the frame before and "
        "its KV is dropped (not computed, held, moved or read); 'measured': the non-key frames whose frame hash "
        "repeats the previous one's (traces from trace gen multimodal --video-frame-items) [default: off]",
        unit="share of non-key frames, 0..1, or 'measured'",
    )
    keyframe_attention: bool = option(
        False,
        "sparse attention: queries read only the keyframes' KV of a video item (every frame's KV is held)",
        unit="on/off",
        is_flag=True,
    )
    keyframe_interval: str = option(
        DEFAULT_KEYFRAME_INTERVAL,
        "a keyframe every this many frames of a clip, the first frame included",
        unit="frames",
        type=int,
    )
    video_frame_tokens: str = option(
        DEFAULT_FRAME_TOKENS,
        "tokens of one video frame: a longer video item is a whole clip cut into frames of this size",
        unit="tokens",
        type=int,
    )


@scenario
class VideoKv(Scenario):
    name = "video-kv"
    options = cli_options(VideoKvOptions)

    def __init__(self, similarity, sparse: bool, interval: int, frame_tokens: int):
        self.similarity, self.sparse, self.interval, self.frame_tokens = similarity, sparse, interval, frame_tokens
        self.layouts: list = []
        self.pending: dict[
            int, tuple
        ] = {}  # instance -> the last step's (read, skipped, saved s, steps) not counted yet
        self.read = self.skipped = self.saved_s = 0.0
        self.unmatched_steps = 0

    @classmethod
    def create(cls, settings):
        similarity, sparse = (
            parse_similarity(settings.get("frame_similarity")),
            bool(settings.get("keyframe_attention")),
        )
        if similarity is None and not sparse:
            return None
        interval, frame_tokens = settings.get("keyframe_interval"), settings.get("video_frame_tokens")
        if not isinstance(interval, int) or interval < 1:
            raise KvbenchError(
                f"--keyframe-interval {interval!r}: give a whole number of frames ≥ 1 (1: every frame is a keyframe)"
            )
        if not isinstance(frame_tokens, int) or frame_tokens < 1:
            raise KvbenchError(
                f"--video-frame-tokens {frame_tokens!r}: give the tokens of one frame, a whole number ≥ 1"
            )
        if similarity is not None and settings.get("mm_cache") is not None:
            raise KvbenchError(
                "--frame-similarity prunes prompts, and --mm-cache reads media items at their places in the trace: "
                "use one of them per replay"
            )
        return cls(similarity, sparse, interval, frame_tokens)

    # --- the trace the cache sees ---------------------------------------------------------------------------
    def prepare_trace(self, trace: pa.Table) -> pa.Table:
        """Lay out every prompt's frames; with --frame-similarity, return the prompts with redundant frames
        removed (input_tokens and block ids; mm_items left out, as their offsets are the original prompts')."""
        bs = int(trace.schema.metadata.get(b"kvbench.block_size", 0) or 0) if trace.schema.metadata else 0
        items = trace.column("mm_items").to_pylist() if "mm_items" in trace.column_names else [None] * trace.num_rows
        prune = self.similarity is not None
        self.layouts = [layout(row, self.frame_tokens, self.interval, self.similarity, prune) for row in items]
        self.skip_index = [(*lay.skip_prefix(), [b for _, b in lay.skipped]) for lay in self.layouts]
        self.video_rows = [r for r, lay in enumerate(self.layouts) if lay.frames]
        self.prompt_tokens = sum(trace.column("input_tokens").to_pylist())
        self.removed_prompt = sum(lay.removed_tokens for lay in self.layouts)
        if not self.video_rows:
            raise KvbenchError(
                "video-kv: no request of this trace has a video item in mm_items (modality 'video'); generate one "
                "with `kvbench trace gen multimodal --video-share 1`"
            )
        if not prune or not any(lay.removed for lay in self.layouts):
            return trace
        self.bs = bs or self._block_size(trace)
        tokens = trace.column("input_tokens").to_pylist()
        hashes = trace.column("block_hashes").to_pylist()
        new_tokens, new_hashes = list(tokens), list(hashes)
        for r, lay in enumerate(self.layouts):
            if lay.removed:
                new_tokens[r] = tokens[r] - lay.removed_tokens
                new_hashes[r] = pruned_block_ids(hashes[r], tokens[r], lay.removed, self.bs, self._mix)
        out = trace.set_column(
            trace.schema.get_field_index("input_tokens"), "input_tokens", pa.array(new_tokens, pa.int32())
        )
        out = out.set_column(
            out.schema.get_field_index("block_hashes"), "block_hashes", pa.array(new_hashes, pa.list_(pa.uint64()))
        )
        return out.set_column(
            out.schema.get_field_index("mm_items"),
            "mm_items",
            pa.nulls(out.num_rows, out.schema.field("mm_items").type),
        )

    @staticmethod
    def _mix(block_ids, places, indices):
        return mix(_PRUNED_KEY, block_ids, places, indices)

    @staticmethod
    def _block_size(trace: pa.Table) -> int:
        """The block size of a table without file metadata (a Python caller's): the smallest one that gives every
        prompt its number of block ids (n blocks of t tokens: ⌈t/n⌉ ≤ bs ≤ ⌊(t−1)/(n−1)⌋)."""
        lo, hi = 1, float("inf")
        for t, ids in zip(trace.column("input_tokens").to_pylist(), trace.column("block_hashes").to_pylist()):
            n = len(ids)
            if n:
                lo = max(lo, -(-t // n))
                hi = min(hi, (t - 1) // (n - 1) if n > 1 else hi)
        if lo > hi:
            raise KvbenchError("video-kv: no block size gives every prompt its number of block ids")
        return lo

    def attach(self, instances, reqs, trace, prep, block_size):
        self.bs, self.reqs = block_size, reqs
        self.first_admissions: set[int] = set()
        self.written = [0, 0]  # video KV tokens written by first admissions: all frames, kept frames
        self.peak = [0, 0]  # video KV tokens the running requests of one instance held at most: all, kept

    # --- capacity -------------------------------------------------------------------------------------------
    def admitted(self, inst, req):
        lay = self.layouts[req.row]
        if lay.frames and req.row not in self.first_admissions:
            self.first_admissions.add(req.row)
            self.written[0] += lay.video_tokens
            self.written[1] += lay.video_tokens - lay.removed_tokens
        # what this instance holds of video now (req joins the running ones right after this hook)
        rows = [r.row for r in inst.running if r is not req] + [req.row]
        full = sum(self.layouts[r].video_tokens for r in rows)
        kept = full - sum(self.layouts[r].removed_tokens for r in rows)
        if full > self.peak[0]:
            self.peak = [full, kept]

    # --- keyframe-only attention ----------------------------------------------------------------------------
    def _skipped(self, row: int, context: float) -> float:
        starts, before, ends = self.skip_index[row]
        return skipped_before(starts, before, ends, context) if starts else 0

    def step_extra_s(self, inst, prefills, decode_contexts):
        if not self.sparse:
            return 0.0
        # The requests behind the step's work, in the engine's order: the decoding ones are the running ones with
        # no prompt left, the prefill pieces the first running ones with prompt left (Instance.plan).
        decoding = [r for r in inst.running if r.todo == 0]
        prefilling = [r for r in inst.running if r.todo > 0][: len(prefills)]
        steps = 1  # a decode window asks with its mean contexts, c + (k − 1)/2: that gives k
        if decoding and decode_contexts and not prefills:
            steps = max(1, round(2 * (decode_contexts[0] - decoding[0].context)) + 1)
        ahead = (steps - 1) / 2
        if (
            len(decoding) != len(decode_contexts)
            or len(prefilling) != len(prefills)
            or any(r.context != c for r, (_, c) in zip(prefilling, prefills))
            or any(r.context + ahead != c for r, c in zip(decoding, decode_contexts))
        ):
            self.unmatched_steps += 1  # charged in full (never seen on the engine's own plans)
            return 0.0
        cut_p = [self._skipped(r.row, c) for r, (_, c) in zip(prefilling, prefills)]
        cut_d = [self._skipped(r.row, c) for r, c in zip(decoding, decode_contexts)]
        read = sum(c for _, c in prefills) + sum(decode_contexts)
        skipped = sum(cut_p) + sum(cut_d)
        extra = 0.0
        if skipped:
            lat = inst.latency
            shorter = [(n, c - s) for (n, c), s in zip(prefills, cut_p)]
            extra = lat.step_s(shorter, [c - s for c, s in zip(decode_contexts, cut_d)]) - lat.step_s(
                prefills, decode_contexts
            )
        # A window's ask follows the ask of its first step (whose time it replaces): it replaces that record.
        if steps == 1 and inst.index in self.pending:
            self._count(self.pending.pop(inst.index))
        self.pending[inst.index] = (read, skipped, -extra, steps)
        return extra

    def _count(self, record) -> None:
        read, skipped, saved, steps = record
        self.read += read * steps
        self.skipped += skipped * steps
        self.saved_s += saved * steps

    # --- report ---------------------------------------------------------------------------------------------
    def summary(self, reqs, instances, prep, kv_bytes_block):
        for record in self.pending.values():
            self._count(record)
        self.pending = {}
        per_token = kv_bytes_block / self.bs
        frames = [f for r in self.video_rows for f in self.layouts[r].frames]
        non_key = sum(1 for f in frames if not f.key)
        redundant = sum(1 for f in frames if f.redundant)
        out = {
            "video_requests": len(self.video_rows),
            "video_frames": len(frames),
            "keyframes": len(frames) - non_key,
            "keyframe_interval_frames": self.interval,
            "video_prompt_tokens": sum(f.tokens for f in frames),
        }
        if self.similarity is not None:
            full, kept = self.written
            out |= {
                "frame_similarity": self.similarity,
                "redundant_frames": redundant,
                "redundant_share_of_non_key_frames": redundant / non_key if non_key else 0.0,
                "video_kv_written_bytes": {"all_frames": full * per_token, "deduplicated": kept * per_token},
                "video_kv_held_peak_bytes": {
                    "all_frames": self.peak[0] * per_token,
                    "deduplicated": self.peak[1] * per_token,
                },
                "capacity_saved_share": 1 - kept / full if full else 0.0,
                # the point's hit rate divides hits in the pruned prompts by the original prompt tokens
                "prompt_tokens_removed_share": self.removed_prompt / self.prompt_tokens if self.prompt_tokens else 0.0,
                "kv_write_bytes_saved": (full - kept) * per_token,
            }
        if self.sparse:
            out |= {
                "attention_kv_read_bytes": {
                    "all_frames": self.read * per_token,
                    "keyframes_only": (self.read - self.skipped) * per_token,
                },
                "attention_read_saved_share": self.skipped / self.read if self.read else 0.0,
                "attention_step_s_saved": self.saved_s,
                "unmatched_steps": self.unmatched_steps,
            }
        return out
