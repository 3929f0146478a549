"""The join window: how long after a request reaches an idle server another one may still arrive and be
prefilled in the same first step. Measured with pairs of equal fresh prompts, the second sent a set offset after
the first; a pair joined when the second's first token comes well before a second prefill could have ended.

Why it matters: a client at concurrency N sends its next requests together as earlier ones finish, and an engine
whose loop takes every queued request before it builds a batch (llama-server's `update_slots`, vLLM's engine core
between steps) prefills them in one step. A simulator that starts the step at the first arrival runs the others'
prefills in the first one's decode steps: their TTFT too short, the decode steps too long (docs/llama-cpp.md).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

# A second prefill of the same prompt takes about the fitted lone prefill time; a pair whose first tokens come
# less than this share of it apart ran as one batch (a sequential pair is a whole prefill apart, a joined one
# a few ms: the bimodal gap sits far from the cut on both sides).
JOINED_SHARE = 0.5
JOIN_ATTEMPTS = 3  # tries for a pair whose answers streamed no text (no first-token time)


@dataclass
class JoinPoint:
    """Pairs of `tokens`-token fresh prompts, the second sent `offset_s` after the first: per pair, the gap
    between their first tokens (s) and the first request's TTFT (s)."""

    offset_s: float
    tokens: int
    gaps_s: list[float]
    ttfts_s: list[float]

    def joined(self, lone_prefill_s: float) -> list[bool]:
        return [gap < JOINED_SHARE * lone_prefill_s for gap in self.gaps_s]

    def record(self, lone_prefill_s: float) -> dict:
        joined = self.joined(lone_prefill_s)
        return {
            "offset_s": self.offset_s,
            "tokens": self.tokens,
            "joined": sum(joined),
            "pairs": len(joined),
            "gaps_s": [round(g, 6) for g in self.gaps_s],
            "first_ttft_s": [round(t, 6) for t in self.ttfts_s],
        }


async def join_sample(meter, offset_s: float, tokens: int) -> tuple[float, float] | None:
    """(first-token gap, first request's TTFT) of one pair sent `offset_s` apart, or None when the answers
    streamed no text in JOIN_ATTEMPTS tries."""

    async def second():
        await asyncio.sleep(offset_s)
        return await meter.send(meter.prompts(tokens), 1, allow_empty=True)

    for _ in range(JOIN_ATTEMPTS):
        a, b = await asyncio.gather(meter.send(meter.prompts(tokens), 1, allow_empty=True), second())
        if a.chunk_s and b.chunk_s:
            return b.first_chunk_s - a.first_chunk_s, a.first_chunk_s - a.sent_s
    return None


def join_window(points: list[JoinPoint], lone_prefill_s: float, request_overhead_s: float) -> tuple[float, list[str]]:
    """(seconds, warnings): the window estimated as the midpoint between the largest offset at which most pairs
    joined (every smaller offset too) and the next offset measured; 0 when pairs sent together did not join.
    Capped at the request overhead: the simulator takes the window out of the overhead (a lone request's TTFT
    already holds it), so it cannot exceed it."""
    warnings: list[str] = []
    ordered = sorted((p for p in points if p.gaps_s), key=lambda p: p.offset_s)
    window, last = 0.0, None
    for p in ordered:
        joined = p.joined(lone_prefill_s)
        if sum(joined) * 2 <= len(joined):
            window = 0.0 if last is None else (last + p.offset_s) / 2
            break
        last = p.offset_s
    else:
        if last is not None:
            window = last
            warnings.append(
                f"pairs joined at every offset measured (up to {last * 1e3:g} ms): the join window is at least that; "
                "measure larger --join-offsets"
            )
    if window > request_overhead_s:
        warnings.append(
            f"join window {window * 1e3:.3g} ms capped at the fitted request overhead {request_overhead_s * 1e3:.3g} ms"
        )
        window = request_overhead_s
    return window, warnings


def join_points(samples: dict[float, list[tuple[float, float]]], tokens: int) -> list[JoinPoint]:
    return [
        JoinPoint(offset, tokens, [g for g, _ in got], [t for _, t in got]) for offset, got in sorted(samples.items())
    ]
