"""Multimodal requests: prompts with image, video and audio spans drawn from Zipf-popular content pools.

A prompt is: shared system prompt, then for every turn of the session so far its media items, its user
text and (for earlier turns) its answer. A media item is one segment whose content id is derived from the
item's content hash alone, so the same image/video/audio after the same prefix always yields the same
block ids (the KV of a popular image is reusable), and `mm_items` records where each item sits.

Video is one item per clip: the frames of a clip are different token runs, so near-duplicate adjacent
frames are never deduplicated against each other (as in engines that cache by whole-item hash).
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


@dataclass(frozen=True)
class MultimodalParams:
    session_rate: float = param(1.0, "new sessions per second (Poisson)", above=0)
    turns_mean: float = param(1.5, "mean turns per session (geometric; 1 = independent requests)")
    max_turns: int = param(8, "cap on turns per session", at_least=1)
    text_only_share: float = param(0.2, "share of sessions whose first request carries no media (0..1)", at_most=1)
    followup_media_share: float = param(0.2, "probability that a follow-up turn attaches new media (0..1)", at_most=1)
    extra_items_mean: float = param(0.3, "mean media items beyond the first in a request with media (Poisson)")
    max_items: int = param(8, "cap on media items attached to one request", at_least=1)
    image_share: float = param(0.75, "relative weight of images among media items")
    video_share: float = param(0.10, "relative weight of video clips among media items")
    audio_share: float = param(0.15, "relative weight of audio clips among media items")
    image_pool: int = param(10_000, "distinct images in the content pool", at_least=1)
    image_zipf: float = param(1.0, "Zipf exponent of image popularity")
    image_token_choices: str = param(
        "256,576,729,1024",
        "comma-separated tokens per image, one drawn per pool image (tokens; PaliGemma-224 256, "
        "LLaVA-1.5 CLIP-336 576, SigLIP-384 729, PaliGemma-448 1024)",
    )
    video_pool: int = param(1_000, "distinct video clips in the content pool", at_least=1)
    video_zipf: float = param(0.8, "Zipf exponent of video popularity")
    video_tokens_per_s: float = param(
        1152.0, "tokens per second of video (2 frames/s x 576 tokens; published ~1K-10K)", above=0
    )
    video_s_mean: float = param(10.0, "mean clip duration (s, log-normal)", above=0)
    video_max_s: float = param(60.0, "cap on clip duration (s)", above=0)
    audio_pool: int = param(1_000, "distinct audio clips in the content pool", at_least=1)
    audio_zipf: float = param(0.8, "Zipf exponent of audio popularity")
    audio_tokens_per_s: float = param(
        50.0, "tokens per second of audio (Whisper encoder: 1500 frames per 30 s)", above=0
    )
    audio_s_mean: float = param(15.0, "mean audio duration (s, log-normal)", above=0)
    audio_max_s: float = param(300.0, "cap on audio duration (s)", above=0)
    system_prompts: int = param(8, "distinct system prompts shared across sessions", at_least=1)
    system_zipf: float = param(1.0, "Zipf exponent of system-prompt popularity")
    system_tokens_mean: float = param(400.0, "mean system prompt length (tokens)")
    user_tokens_mean: float = param(60.0, "mean user text per turn (tokens, log-normal)")
    user_tokens_sigma: float = param(1.0, "log-normal shape of user text length")
    output_tokens_mean: float = param(250.0, "mean answer length (tokens, log-normal)")
    output_tokens_sigma: float = param(0.8, "log-normal shape of answer length")
    think_time_mean_s: float = param(30.0, "mean human think time between an answer and the next turn (s)")
    decode_s_per_token: float = param(0.03, "assumed server time per output token, to place later turns (s)")


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
            item_hash[occ_item], item_modality[occ_item], occ_offset, item_tokens[occ_item], occ_req, n
        ),
    }
    return assemble(columns, segs, n, block_size)
