"""Multimodal requests: prompts with image, video and audio spans drawn from Zipf-popular content pools.

A prompt is: shared system prompt, then for every turn of the session so far its media items, its user
text and (for earlier turns) its answer. A media item is one segment whose content id is derived from the
item's content hash alone, so the same image/video/audio after the same prefix always yields the same
block ids (the KV of a popular image is reusable), and `mm_items` records where each item sits.

Video is one item per clip by default: the frames of a clip are different token runs, so near-duplicate
adjacent frames are never deduplicated against each other (as in engines that cache by whole-item hash).
With `video_frame_items` the clip is listed frame by frame instead (one `mm_items` entry per frame, the block
ids unchanged), and `video_frame_repeat` makes a frame repeat the previous one exactly (the same frame hash):
what the engine simulator's video-kv scenario measures a frame similarity from (docs/video-audio-kv.md).

Voice chats (`voice_session_share`): every user turn of such a session is speech, an audio item of its own
(never reused: each utterance is new) at `audio_tokens_per_s`, with a few tokens of text around it, so audio
and text interleave turn by turn as in a spoken conversation with a text-answering model.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from kvbench.trace.blockhash import content_ids, mix, name_key
from kvbench.trace.generators import BadParameter, generator, param
from kvbench.trace.generators._common import (
    Conversations,
    Segments,
    assemble,
    group_ranks,
    lognormal_ints,
    poisson_arrivals,
    rng_for,
    zipf_indices,
)
from kvbench.trace.schema import MM_ITEM

MODALITIES = ("image", "video", "audio")
# Not seeded: the content id of an item depends on its hash only, whichever trace it appears in.
_ITEM_CONTENT_KEY = name_key("multimodal", "item-content")
_FRAME_KEY, _REPEAT_KEY = name_key("multimodal", "frame"), name_key("multimodal", "frame-repeat")


@dataclass(frozen=True)
class MultimodalParams:
    session_rate: float = param(1.0, "new sessions per second (Poisson)", unit="sessions/s", above=0)
    turns_mean: float = param(1.5, "mean turns per session (geometric; 1 = independent requests)", unit="turns")
    max_turns: int = param(8, "cap on turns per session", unit="turns", at_least=1)
    text_only_share: float = param(
        0.2, "share of sessions whose first request carries no media (0..1)", unit="fraction", at_most=1
    )
    followup_media_share: float = param(
        0.2, "probability that a follow-up turn attaches new media (0..1)", unit="fraction", at_most=1
    )
    extra_items_mean: float = param(
        0.3, "mean media items beyond the first in a request with media (Poisson)", unit="items"
    )
    max_items: int = param(8, "cap on media items attached to one request", unit="items", at_least=1)
    image_share: float = param(0.75, "relative weight of images among media items", unit="fraction")
    video_share: float = param(0.10, "relative weight of video clips among media items", unit="fraction")
    audio_share: float = param(0.15, "relative weight of audio clips among media items", unit="fraction")
    image_pool: int = param(10_000, "distinct images in the content pool", unit="count", at_least=1)
    image_zipf: float = param(1.0, "Zipf exponent of image popularity", unit="unitless")
    image_token_choices: str = param(
        "256,576,729,1024",
        "comma-separated tokens per image, one drawn per pool image (tokens; PaliGemma-224 256, "
        "LLaVA-1.5 CLIP-336 576, SigLIP-384 729, PaliGemma-448 1024)",
        unit="tokens",
    )
    video_pool: int = param(1_000, "distinct video clips in the content pool", unit="count", at_least=1)
    video_zipf: float = param(0.8, "Zipf exponent of video popularity", unit="unitless")
    video_tokens_per_s: float = param(
        1152.0, "tokens per second of video (2 frames/s x 576 tokens; published ~1K-10K)", unit="tokens/s", above=0
    )
    video_s_mean: float = param(10.0, "mean clip duration (s, log-normal)", unit="s", above=0)
    video_max_s: float = param(60.0, "cap on clip duration (s)", unit="s", above=0)
    audio_pool: int = param(1_000, "distinct audio clips in the content pool", unit="count", at_least=1)
    audio_zipf: float = param(0.8, "Zipf exponent of audio popularity", unit="unitless")
    audio_tokens_per_s: float = param(
        50.0, "tokens per second of audio (Whisper encoder: 1500 frames per 30 s)", unit="tokens/s", above=0
    )
    audio_s_mean: float = param(15.0, "mean audio duration (s, log-normal)", unit="s", above=0)
    audio_max_s: float = param(300.0, "cap on audio duration (s)", unit="s", above=0)
    system_prompts: int = param(8, "distinct system prompts shared across sessions", unit="count", at_least=1)
    system_zipf: float = param(1.0, "Zipf exponent of system-prompt popularity", unit="unitless")
    system_tokens_mean: float = param(400.0, "mean system prompt length (tokens)", unit="tokens")
    user_tokens_mean: float = param(60.0, "mean user text per turn (tokens, log-normal)", unit="tokens")
    user_tokens_sigma: float = param(1.0, "log-normal shape of user text length", unit="unitless")
    output_tokens_mean: float = param(250.0, "mean answer length (tokens, log-normal)", unit="tokens")
    output_tokens_sigma: float = param(0.8, "log-normal shape of answer length", unit="unitless")
    think_time_mean_s: float = param(30.0, "mean human think time between an answer and the next turn (s)", unit="s")
    decode_s_per_token: float = param(
        0.03, "assumed server time per output token, to place later turns (s)", unit="s/token"
    )
    # Frames and voice turns (docs/video-audio-kv.md); the defaults leave the trace as it was without them.
    video_fps: float = param(
        2.0,
        "frames per second a clip is sampled at (frames/s): a frame is video_tokens_per_s / video_fps tokens",
        unit="frames/s",
        above=0,
    )
    video_frame_items: bool = param(
        False,
        "list each video clip frame by frame in mm_items (one item per frame; block ids unchanged)",
        unit="on/off",
        flag="--video-frame-items/--no-video-frame-items",
    )
    video_frame_repeat: float = param(
        0.0,
        "probability that a frame after a clip's first repeats the previous frame exactly (same frame hash; "
        "0..1; needs --video-frame-items)",
        unit="fraction",
        at_most=1,
    )
    voice_session_share: float = param(
        0.0,
        "share of sessions that are voice chats: every user turn carries a new audio clip of speech (0..1)",
        unit="fraction",
        at_most=1,
    )
    voice_turn_s_mean: float = param(6.0, "mean length of a spoken user turn (s, log-normal)", unit="s", above=0)
    voice_turn_s_max: float = param(60.0, "cap on a spoken user turn (s)", unit="s", above=0)
    voice_text_tokens: int = param(
        8, "text tokens of a spoken turn beside its audio (chat template)", unit="tokens", at_least=1
    )


def _pool_tokens(p: MultimodalParams, modality: str, seed: int) -> np.ndarray:
    """Token count of every item of a modality's pool: fixed per item, so a reused item has equal length."""
    rng = rng_for(seed, "multimodal", modality, "pool")
    if modality == "image":
        try:
            choices = np.array([int(x) for x in p.image_token_choices.split(",") if x.strip()], dtype=np.int64)
        except (ValueError, OverflowError):
            choices = np.zeros(1, np.int64)
        if choices.size == 0 or np.any(choices <= 0):
            raise BadParameter(
                f"--image-token-choices {p.image_token_choices!r} needs positive integers, e.g. '256,576'"
            )
        return rng.choice(choices, size=p.image_pool)
    pool, per_s, mean_s, max_s = (
        (p.video_pool, p.video_tokens_per_s, p.video_s_mean, p.video_max_s)
        if modality == "video"
        else (p.audio_pool, p.audio_tokens_per_s, p.audio_s_mean, p.audio_max_s)
    )
    mu = np.log(max(mean_s, 1e-3)) - 0.8**2 / 2
    seconds = np.clip(rng.lognormal(mu, 0.8, pool), 1.0, max(max_s, 1.0))
    return np.maximum(np.rint(seconds * per_s), 1).astype(np.int64)


def _mm_items_column(item_hash, item_modality, offset, tokens, owner: np.ndarray, n: int) -> pa.ListArray:
    """list<struct{hash, modality, offset, tokens}> per request from flat items grouped by owner request."""
    modality = pa.array(list(MODALITIES)).take(pa.array(item_modality))
    items = pa.StructArray.from_arrays(
        [pa.array(item_hash, pa.uint64()), modality, pa.array(offset, pa.int32()), pa.array(tokens, pa.int32())],
        fields=list(MM_ITEM),
    )
    offsets = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(np.bincount(owner, minlength=n), out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets), items, type=pa.list_(MM_ITEM))


def _with_voice_items(p: MultimodalParams, seed: int, voice, item_req, item_modality, item_hash, item_tokens):
    """The flat item arrays with one audio item more for every request of a voice session: its user turn
    spoken, duration x audio_tokens_per_s tokens, after the turn's other media and before its text."""
    rng = rng_for(seed, "multimodal", "voice", "length")
    spoken = np.flatnonzero(voice)
    mu = np.log(p.voice_turn_s_mean) - 0.6**2 / 2
    seconds = np.clip(rng.lognormal(mu, 0.6, spoken.size), 1.0, max(p.voice_turn_s_max, 1.0))
    tokens = np.maximum(np.rint(seconds * p.audio_tokens_per_s), 1).astype(np.int64)
    # each utterance is new content: its id is derived from the request it was spoken in
    hashes = content_ids(name_key("multimodal", seed, "voice"), spoken)
    req = np.concatenate([item_req, spoken])
    order = np.argsort(req, kind="stable")  # a request's pool items first, then its speech
    return (
        req[order],
        np.concatenate([item_modality, np.full(spoken.size, MODALITIES.index("audio"))])[order],
        np.concatenate([item_hash, hashes])[order],
        np.concatenate([item_tokens, tokens])[order],
    )


def frame_tokens(p: MultimodalParams) -> int:
    """Tokens of one video frame: the clip's tokens per second over the frames per second (at least 1)."""
    return max(1, round(p.video_tokens_per_s / p.video_fps))


def _frames(p: MultimodalParams, item_hash, modality, offset, tokens, owner):
    """The item occurrences as `mm_items` lists them: as they are, or with `video_frame_items` every video clip
    as consecutive frames of `frame_tokens` (the last one shorter). A frame's hash depends on its clip and its
    index only, so every copy of a clip has the same frames; a repeated frame takes the previous frame's hash."""
    if not p.video_frame_items:
        return item_hash, modality, offset, tokens, owner
    per_frame = frame_tokens(p)
    video = modality == MODALITIES.index("video")
    count = np.where(video, -(-tokens // per_frame), 1)
    src = np.repeat(np.arange(item_hash.size), count)
    k = group_ranks(src)
    is_video = video[src]
    frame_offset = np.where(is_video, offset[src] + k * per_frame, offset[src])
    frame_len = np.where(is_video, np.minimum(per_frame, tokens[src] - k * per_frame), tokens[src])
    fresh = mix(_FRAME_KEY, item_hash[src], k.astype(np.uint64))
    draw = (mix(_REPEAT_KEY, item_hash[src], k.astype(np.uint64)) >> np.uint64(11)) * 2.0**-53
    repeat = is_video & (k > 0) & (draw < p.video_frame_repeat)
    # each frame takes the hash of the last frame at or before it that is not a repeat (a clip's first never is)
    last_new = np.maximum.accumulate(np.where(repeat, 0, np.arange(src.size)))
    frame_hash = np.where(is_video, fresh[last_new], item_hash[src])
    return frame_hash, modality[src], frame_offset, frame_len, owner[src]


@generator("multimodal", MultimodalParams, bytes_per_request=4_000)
def multimodal(p: MultimodalParams, n: int, seed: int, block_size: int):
    """Image/video/audio prompts with Zipf-popular, reusable media items and short sessions."""
    rng = rng_for(seed, "multimodal")
    conv = Conversations(rng, n, p.turns_mean, p.max_turns)
    n_sessions, session, turn = conv.n_sessions, conv.session, conv.turn
    req = np.arange(n)

    # Which requests carry media, and how many items each.
    media_prob = np.where(turn == 0, 1.0 - p.text_only_share, p.followup_media_share)
    has_media = rng.random(n) < media_prob
    n_items = np.where(has_media, np.minimum(1 + rng.poisson(p.extra_items_mean, n), max(p.max_items, 1)), 0)
    item_req = np.repeat(req, n_items)  # flat list of the items each request attaches itself
    shares = np.array([p.image_share, p.video_share, p.audio_share], dtype=np.float64)
    if shares.sum() <= 0 or np.any(shares < 0):
        raise BadParameter("modality shares must be >= 0 and not all 0")
    item_modality = rng.choice(len(MODALITIES), size=item_req.size, p=shares / shares.sum())
    item_hash = np.zeros(item_req.size, dtype=np.uint64)
    item_tokens = np.zeros(item_req.size, dtype=np.int64)
    pools = {
        "image": (p.image_pool, p.image_zipf),
        "video": (p.video_pool, p.video_zipf),
        "audio": (p.audio_pool, p.audio_zipf),
    }
    for m, name in enumerate(MODALITIES):  # three vectorised draws, one per pool
        sel = np.flatnonzero(item_modality == m)
        size, alpha = pools[name]
        rank = zipf_indices(rng_for(seed, "multimodal", name, "draw"), max(size, 1), alpha, sel.size)
        item_hash[sel] = content_ids(name_key("multimodal", seed, name), rank)
        item_tokens[sel] = _pool_tokens(p, name, seed)[rank]
    if p.video_frame_repeat > 0 and not p.video_frame_items:
        raise BadParameter("--video-frame-repeat needs --video-frame-items (repeats are seen frame by frame)")
    voice = np.zeros(n, dtype=bool)
    if p.voice_session_share > 0:  # drawn from streams of their own: the rest of the trace is unchanged
        voice = (rng_for(seed, "multimodal", "voice").random(n_sessions) < p.voice_session_share)[session]
        item_req, item_modality, item_hash, item_tokens = _with_voice_items(
            p, seed, voice, item_req, item_modality, item_hash, item_tokens
        )
        n_items = np.bincount(item_req, minlength=n)
    # Token offset of each item inside its own turn (items come first, then the user's text).
    item_first = np.cumsum(n_items) - n_items
    tokens_before = np.cumsum(item_tokens) - item_tokens
    item_turn_offset = tokens_before - tokens_before[item_first[item_req]]

    system = zipf_indices(rng, p.system_prompts, p.system_zipf, n_sessions)
    system_len = lognormal_ints(
        rng_for(seed, "multimodal", "sys-len"), p.system_tokens_mean, 0.5, p.system_prompts, lo=16
    )
    user_len = lognormal_ints(rng, p.user_tokens_mean, p.user_tokens_sigma, n, lo=1, hi=32_000)
    out_len = lognormal_ints(rng, p.output_tokens_mean, p.output_tokens_sigma, n, lo=1, hi=16_000)
    user_len = np.where(voice, p.voice_text_tokens, user_len)  # a spoken turn's words are its audio
    think = rng.exponential(p.think_time_mean_s, n) * (turn > 0)

    # Arrivals as in chat: sessions start as a Poisson process, a turn follows the previous one after its
    # (assumed) decode time plus the think time.
    start = poisson_arrivals(rng, p.session_rate, n_sessions)
    arrival = conv.arrivals(start, out_len * p.decode_s_per_token, think)

    # Where each turn's content starts, counted from the end of the system prompt: the sum of all earlier
    # turns of the session (their media, user text and answer). Equal for every later request.
    turn_tokens = np.bincount(item_req, weights=item_tokens, minlength=n).astype(np.int64) + user_len + out_len
    before = np.cumsum(turn_tokens) - turn_tokens
    turn_start = before - before[req - turn]

    # Every request replays turns 0..turn of its session: pair (request, k) -> global turn index g.
    pair_req, g, k = conv.earlier_turns(include_current=True)
    occ_pair = np.repeat(np.arange(pair_req.size), n_items[g])  # one entry per item occurrence in a prompt
    occ_item = item_first[g[occ_pair]] + group_ranks(occ_pair)
    occ_req = pair_req[occ_pair]
    sys_of_req = system[session]

    key_user, key_answer = name_key("multimodal", seed, "user"), name_key("multimodal", seed, "answer")
    segs = Segments()
    segs.add(req, content_ids(name_key("multimodal", seed, "system"), sys_of_req), system_len[sys_of_req], order=0)
    segs.add(occ_req, mix(_ITEM_CONTENT_KEY, item_hash[occ_item]), item_tokens[occ_item], order=1 + 3 * k[occ_pair])
    segs.add(pair_req, content_ids(key_user, g), user_len[g], order=2 + 3 * k)
    answered = k < turn[pair_req]  # earlier turns' answers are in the context, the current one is not
    segs.add(pair_req[answered], content_ids(key_answer, g[answered]), out_len[g[answered]], order=3 + 3 * k[answered])

    occ_offset = system_len[sys_of_req[occ_req]] + turn_start[g[occ_pair]] + item_turn_offset[occ_item]
    columns = {
        **conv.id_columns("mm"),
        "arrival_s": arrival,
        "output_tokens": out_len.astype(np.int32),
        "workload": np.full(n, "multimodal", dtype=object),
        "think_time_s": think.astype(np.float32),
        "mm_items": _mm_items_column(
            *_frames(p, item_hash[occ_item], item_modality[occ_item], occ_offset, item_tokens[occ_item], occ_req), n
        ),
    }
    return assemble(columns, segs, n, block_size)
