"""Attention error of quantized KV on a trace's own requests, by position in the decode (docs/kv-quantization.md).

For each measured request: its K/V (kvbench.backends.torchkv.synthetic_kv) up to its prompt plus output, capped
at `max_context` tokens; queries at positions sampled in each decode bucket; the attention output with the cache
in bf16 (the reference, computed in fp32) and with the cache in each format, and the relative error
||o_q - o_ref|| / ||o_ref|| per query. Two more measurements on the same queries:

- the mixed policy (older blocks in fewer bits: `MixedPolicy`), its old blocks requantized from the recent
  format, as a cache converting blocks in place would;
- key-age sensitivity: for the latest queries of each request, only the k-th of `parts` equal slices of the
  context (earliest first) stored in the low-bit format, the rest bf16: which part of a long context tolerates
  compression best under this generative assumption.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from kvbench.backends.torchkv.quantization import KvFormat, MixedPolicy, grouped
from kvbench.backends.torchkv.synthetic_kv import SyntheticKv, attention, mix, relative_error, text_seed

from kvbench.errors import KvbenchError


@dataclass(frozen=True)
class ErrorSettings:
    group: int = 32  # elements per quantization group
    key_axis: str = "channel"  # KIVI: keys per channel, values per token
    value_axis: str = "token"
    max_context: int = 8192  # tokens generated per request at most (prompt + decode)
    requests: int = 4  # the trace's requests with the longest outputs
    layers: int = 2  # layers measured, evenly spaced
    buckets: int = 8  # decode-position buckets
    queries_per_bucket: int = 8  # query positions per request and bucket
    age_parts: int = 4  # slices of the context for the key-age sensitivity
    seed: int = 0
    device: str = "cpu"  # where attention and quantization run; K/V are drawn on the CPU generator, then moved


def pick_requests(rows: list[dict], settings: ErrorSettings) -> list[dict]:
    """The `settings.requests` requests with the most output tokens whose prompt leaves room to decode within
    max_context (ties: trace order)."""
    fits = [r for r in rows if r["input_tokens"] < settings.max_context and r["output_tokens"] > 0]
    if not fits:
        raise KvbenchError(
            f"no request of the trace has a prompt shorter than --max-context {settings.max_context} tokens and an "
            "output; raise --max-context"
        )
    order = sorted(range(len(fits)), key=lambda i: (-fits[i]["output_tokens"], i))
    return [fits[i] for i in order[: settings.requests]]


def _decode_length(row: dict, max_context: int) -> int:
    return min(row["input_tokens"] + row["output_tokens"], max_context) - row["input_tokens"]


def bucket_edges(rows: list[dict], settings: ErrorSettings) -> list[int]:
    """Decode-step edges of the buckets: 0 to the longest measured decode, in equal steps (whole tokens)."""
    longest = max(_decode_length(r, settings.max_context) for r in rows)
    n = min(settings.buckets, longest)
    return [round(longest * b / n) for b in range(n + 1)]


def _query_positions(row: dict, edges: list[int], settings: ErrorSettings) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions, bucket of each), sorted: up to queries_per_bucket distinct decode positions per bucket."""
    start, decoded = row["input_tokens"], _decode_length(row, settings.max_context)
    rng = np.random.default_rng(mix(settings.seed, text_seed(row["request_id"])))
    positions, buckets = [], []
    for b, (lo, hi) in enumerate(zip(edges[:-1], edges[1:], strict=True)):
        hi = min(hi, decoded)
        if hi <= lo:
            continue
        take = min(settings.queries_per_bucket, hi - lo)
        chosen = np.sort(rng.choice(np.arange(lo, hi), size=take, replace=False))
        positions += (start + chosen).tolist()
        buckets += [b] * take
    return torch.tensor(positions), torch.tensor(buckets)


class Errors:
    """Per-query errors of one row of the table, with each query's bucket."""

    def __init__(self):
        self.errors: list[np.ndarray] = []
        self.buckets: list[np.ndarray] = []

    def add(self, errors: torch.Tensor, buckets: torch.Tensor) -> None:
        self.errors.append(errors.double().cpu().numpy())
        self.buckets.append(buckets.numpy())

    def summary(self, n_buckets: int) -> dict:
        e, b = np.concatenate(self.errors), np.concatenate(self.buckets)
        by_bucket = [float(e[b == i].mean()) if (b == i).any() else None for i in range(n_buckets)]
        return {
            "queries": int(e.size),
            "mean": float(e.mean()),
            "p95": float(np.quantile(e, 0.95)),
            "max": float(e.max()),
            "by_bucket": by_bucket,
        }


def measure(
    kv: SyntheticKv,
    rows: list[dict],
    formats: list[KvFormat],
    mixed: MixedPolicy | None,
    age_format: KvFormat | None,
    settings: ErrorSettings,
) -> dict:
    """The errors of every format (and of the mixed policy and the key-age slices) over the chosen requests."""
    edges = bucket_edges(rows, settings)
    n_buckets = len(edges) - 1
    n_layers, k = kv.model.layers, min(settings.layers, kv.model.layers)
    layers = sorted({round(i * (n_layers - 1) / max(1, k - 1)) for i in range(k)})  # k distinct, evenly spaced
    table = {f.name: Errors() for f in formats}
    mixed_errors, age = Errors(), [Errors() for _ in range(settings.age_parts)]
    g, ka, va = settings.group, settings.key_axis, settings.value_axis
    dev = torch.device(settings.device)
    with torch.inference_mode():
        for row in rows:
            length = min(row["input_tokens"] + row["output_tokens"], settings.max_context)
            positions, buckets = _query_positions(row, edges, settings)
            lengths = (positions + 1).to(dev)  # a query sees itself and everything before it
            latest = buckets == buckets.max()  # on the CPU, like `buckets`; a copy on the device for device tensors
            latest_dev = latest.to(dev)
            for layer in layers:
                k, v = kv.sequence(row["block_hashes"], row["input_tokens"], row["request_id"], length, layer)
                k, v = grouped(k.to(dev), "bf16", g, ka), grouped(v.to(dev), "bf16", g, va)  # the reference cache
                q = kv.queries(row["request_id"], positions, layer).to(dev)
                ref = attention(q, k, v, lengths)
                for f in formats:
                    out = attention(q, grouped(k, f, g, ka), grouped(v, f, g, va), lengths)
                    table[f.name].add(relative_error(out, ref), buckets)
                if mixed is not None:
                    k_recent, v_recent = grouped(k, mixed.recent, g, ka), grouped(v, mixed.recent, g, va)
                    k_old, v_old = grouped(k_recent, mixed.old, g, ka), grouped(v_recent, mixed.old, g, va)
                    old = (mixed.old_mask(lengths, length), k_old, v_old)
                    out = attention(q, k_recent, v_recent, lengths, old=old)
                    mixed_errors.add(relative_error(out, ref), buckets)
                if age_format is not None:
                    _age_sensitivity(
                        q[latest_dev], k, v, lengths[latest_dev], age_format, settings, age, buckets[latest]
                    )
    result = {
        "bucket_edges_decode_tokens": edges,
        "layers_measured": layers,
        "requests_measured": [
            {
                "request_id": r["request_id"],
                "prompt_tokens": r["input_tokens"],
                "decode_tokens_measured": _decode_length(r, settings.max_context),
            }
            for r in rows
        ],  # fmt: skip
        "formats": {name: e.summary(n_buckets) for name, e in table.items()},
    }
    if mixed is not None:
        result["mixed"] = mixed_errors.summary(n_buckets)
    if age_format is not None:
        result["age_sensitivity"] = {
            "format": age_format.name,
            "parts": settings.age_parts,
            "mean_error": [a.summary(1)["mean"] for a in age],
        }
    return result


def _age_sensitivity(q, k, v, lengths, fmt: KvFormat, settings: ErrorSettings, out: list[Errors], buckets) -> None:
    """Error when only the p-th slice of each query's context (p = 0: its earliest tokens) is in `fmt`."""
    g = settings.group
    k_low, v_low = grouped(k, fmt, g, settings.key_axis), grouped(v, fmt, g, settings.value_axis)
    ref = attention(q, k, v, lengths)
    pos = torch.arange(k.shape[0], device=k.device).unsqueeze(0)
    part_of = (pos * settings.age_parts) // lengths.unsqueeze(1)  # [n, S]: which slice each position is in
    for p in range(settings.age_parts):
        mask = (part_of == p) & (pos < lengths.unsqueeze(1))
        res = attention(q, k, v, lengths, old=(mask, k_low, v_low))
        out[p].add(relative_error(res, ref), torch.zeros_like(buckets))
